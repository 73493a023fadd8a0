//! Model methods: named computations a plugin runs on its own device, bound to a cache.

use abi_stable::sabi_trait;
use abi_stable::std_types::{RArc, RResult, RSlice, RString, RVec};

use crate::error::PluginError;
use crate::tensor::HostTensor;

/// A loaded model method (e.g. `forward`), bound at load time to the cache named by the
/// `cache_key` backend option.
#[sabi_trait]
pub trait ModelMethod: Clone + Send + Sync {
    /// The method name.
    fn name(&self) -> RString;
    /// Runs the method. Inputs and outputs are method-specific and documented by the
    /// backend kit (for `forward`: token ids and positions in, logits out).
    #[sabi(last_prefix_field)]
    fn execute(&self, inputs: RVec<HostTensor>) -> RResult<RVec<HostTensor>, PluginError>;
    /// [`execute`](ModelMethod::execute) into `outputs`: its tensors' buffers are reused
    /// (grown to the largest size seen, never shrunk) and surplus tensors dropped, so a
    /// caller that keeps `inputs` and `outputs` between calls lets a decode loop run without
    /// allocating them. On an error `outputs` holds unspecified tensors.
    fn execute_into(
        &self,
        inputs: RSlice<'_, HostTensor>,
        outputs: &mut RVec<HostTensor>,
    ) -> RResult<(), PluginError>;
}

/// A shared model method.
pub type MethodHandle = ModelMethod_TO<'static, RArc<()>>;
