//! # kvplug-core
//!
//! The runner-facing face of kvplug and the bookkeeping every backend shares. Tensor-free:
//! only integers, masks and (in [`oracle`]) f64 reference maths.
//!
//! Contracts stated here hold for every backend:
//!
//! - **Validate, then mutate.** Every verb returns a typed [`CacheError`] for bad input and
//!   leaves the cache exactly as it was.
//! - **Visibility.** Seq cache: query `i` attends cell `j` iff `j` is occupied, shares a
//!   sequence with `i`, and `pos[j] <= pos[i]`. Tree cache: a frontier node attends the
//!   committed prefix, its ancestor chain and itself. Contiguous: causal.
//! - **Windows.** A step reads cells `[0, read_len)` with `read_len` the occupied extent,
//!   never the capacity.
//! - **Plans.** [`StepPlan`] is the integer hand-off to the byte layer: a contiguous write run
//!   or scatter cells, the read window, and a [`MaskKind`]. `SingleContiguous` (maskless) is
//!   an optimisation; `Explicit` is always correct.
//! - **Steps are transactions.** [`Bookkeeping::open_step`] places a step's tokens and plans
//!   it; every layer writes through that one plan; `commit_step` makes it permanent and
//!   `rollback_step` (or abandoning it: any verb, or the next step) leaves the bookkeeping
//!   exactly as before the step.

#![warn(missing_docs)]

pub mod argmax;
pub mod arithmetic;
pub mod config;
pub mod contiguous;
pub mod dtype;
pub mod error;
pub mod exp;
pub mod files;
pub mod gguf_index;
pub mod key_basis;
pub mod kind;
pub mod limits;
pub mod metadata;
pub mod model_config;
pub mod oracle;
pub mod plan;
pub mod quant;
pub mod radix;
pub mod rounding;
pub mod seq;
pub mod spec;
pub mod tree;
pub mod window;

pub use argmax::{argmax, rank, top_k, Adjust};
pub use arithmetic::Arithmetic;
pub use config::{
    make_config, CacheConfig, ConvLayers, DeltaLayers, LayerSet, ModelCacheParams, SlidingLayers,
    SsmLayers, DEFAULT_MIN_CHUNK,
};
pub use contiguous::ContiguousBookkeeping;
pub use dtype::KvDtype;
pub use error::{CacheError, CacheResult, ErrorKind};
pub use gguf_index::{GgufIndex, IndexedTensor, RopePairs};
pub use key_basis::KeyBasis;
pub use kind::{Bookkeeping, CacheKind, CacheVerbs};
pub use metadata::{read_cache_params, write_cache_params, MetadataError};
pub use model_config::{Experts, ModelConfig, ModelError};
pub use plan::{MaskKind, PlanKind, StepPlan};
pub use radix::{PrefixHandle, PrefixLock, RadixError, RadixIndex};
pub use seq::{PosRange, PrefixStats, SeqBookkeeping, MAX_SEQS};
pub use spec::{LayerAttention, LayerGroup, ModelCacheSpec};
pub use tree::{CommitPlan, TreeBookkeeping};
pub use window::SlotMap;
