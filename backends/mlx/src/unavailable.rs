//! The plugin built without MLX: it loads, `describe` reports why it is unavailable, and
//! building a cache fails with that reason. The device types are uninhabited, so no
//! operation can ever run.

use kvplug_backend_kit::model::{ModelDevice, StoredTensor};
use kvplug_backend_kit::{AttendMask, Backend, Device, KitError};
use kvplug_core::{Arithmetic, KvDtype};
use kvplug_plugin_api::{HostTensor, TensorDtype};

/// No device: [`Backend::open`] always fails.
pub enum MlxDevice {}

/// Uninhabited: there is no device to hold tensors, pools or weights.
pub enum Never {}

impl Device for MlxDevice {
    type Tensor = Never;
    type Pool = Never;
    type Scratch = ();

    fn kv_dtypes(&self) -> &[KvDtype] {
        match *self {}
    }
    fn dims<'t>(&self, _: &'t Never) -> &'t [usize] {
        match *self {}
    }
    fn pool_new(&self, _: KvDtype, _: usize, _: usize, _: usize) -> Result<Never, KitError> {
        match *self {}
    }
    fn pool_grow(&self, _: &mut Never, _: usize, _: usize) -> Result<(), KitError> {
        match *self {}
    }
    fn pool_bytes(&self, _: &Never) -> usize {
        match *self {}
    }
    fn write_run(&self, _: &mut Never, _: usize, _: &Never) -> Result<(), KitError> {
        match *self {}
    }
    fn scatter_rows(&self, _: &mut Never, _: &[u32], _: &Never) -> Result<(), KitError> {
        match *self {}
    }
    fn read_rows(&self, _: &Never, _: &[u32]) -> Result<Vec<u8>, KitError> {
        match *self {}
    }
    fn write_rows(&self, _: &mut Never, _: &[u32], _: &[u8]) -> Result<(), KitError> {
        match *self {}
    }
    fn move_rows(&self, _: &mut Never, _: usize, _: &[u32]) {
        match *self {}
    }
    fn attend(
        &self,
        _: Arithmetic,
        _: &Never,
        _: &Never,
        _: &Never,
        _: usize,
        _: AttendMask<'_>,
        _: f32,
        _: &mut Never,
        _: &mut (),
    ) -> Result<(), KitError> {
        match *self {}
    }
    fn zeros(&self, _: &[usize]) -> Result<Never, KitError> {
        match *self {}
    }
    fn upload(&self, _: &HostTensor) -> Result<Never, KitError> {
        match *self {}
    }
    fn download(&self, _: &Never, _: TensorDtype) -> Result<HostTensor, KitError> {
        match *self {}
    }
}

impl ModelDevice for MlxDevice {
    type Weight = Never;

    fn weight(&self, _: StoredTensor, _: usize, _: usize) -> Result<Never, KitError> {
        match *self {}
    }
    fn tensor(&self, _: &[f32], _: &[usize]) -> Result<Never, KitError> {
        match *self {}
    }
    fn embed(&self, _: &Never, _: &[i32], _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
    fn rms_norm(&self, _: &Never, _: &Never, _: f32, _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
    fn linear(
        &self,
        _: &Never,
        _: &Never,
        _: Option<&Never>,
        _: &mut Never,
    ) -> Result<(), KitError> {
        match *self {}
    }
    fn rope(
        &self,
        _: &mut Never,
        _: usize,
        _: &[i32],
        _: &[f32],
        _: kvplug_core::RopePairs,
    ) -> Result<(), KitError> {
        match *self {}
    }
    fn hadamard(&self, _: &Never, _: usize, _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
    fn split_heads(&self, _: &Never, _: usize, _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
    fn merge_heads(&self, _: &Never, _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
    fn silu_mul(&self, _: &Never, _: &Never, _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
    fn gelu_tanh_mul(&self, _: &Never, _: &Never, _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
    fn scale(&self, _: &mut Never, _: f32) -> Result<(), KitError> {
        match *self {}
    }
    fn add_assign(&self, _: &mut Never, _: &Never) -> Result<(), KitError> {
        match *self {}
    }
    fn gather_rows(&self, _: &Never, _: &[usize], _: &mut Never) -> Result<(), KitError> {
        match *self {}
    }
}

impl Backend for MlxDevice {
    const ID: &'static str = "mlx";
    const NAME: &'static str = "kvplug MLX backend";

    fn open() -> Result<Self, String> {
        Err(env!("KVPLUG_MLX_MISSING").to_string())
    }
    fn device_description(&self) -> String {
        match *self {}
    }
    fn features(&self) -> Vec<String> {
        match *self {}
    }
}
