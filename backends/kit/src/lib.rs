//! # kvplug-backend-kit
//!
//! Everything a backend shares, written once over a small device trait, so a backend crate
//! holds only tensor primitives and kernels:
//!
//! - [`Device`]: the primitives (pool allocate/grow, write a run, scatter rows, move rows
//!   for a tree commit, attend a window with a mask kind, upload/download [`HostTensor`]).
//! - [`KitCache`]: the Pool policy (lazy doubling from `min_chunk` to `capacity`, dtype from
//!   `kv_dtype`) and the three cache kinds on top of core's [`Bookkeeping`]; no integer
//!   logic lives anywhere else.
//! - [`SharedCache`]: the ABI [`CacheObject`](kvplug_plugin_api::CacheObject) over a
//!   `KitCache`, panic-guarded and locked.
//! - [`export_backend!`]: the one line that turns a [`Backend`] into a plugin.
//!
//! Contracts a device must meet: pools hold rows per head and cell, and read and write them
//! in the canonical row form of [`SeqRows`](kvplug_plugin_api::SeqRows); a write touches
//! only the rows it names; attention reads only `[0, read_len)`; quantized pools
//! follow [`kvplug_core::quant`] and dequantize inside attention.
//!
//! [`HostTensor`]: kvplug_plugin_api::HostTensor
//! [`Bookkeeping`]: kvplug_core::Bookkeeping

// A backend's docs are read with its private items (`cargo doc --document-private-items`),
// which its public items' docs link to.
#![allow(rustdoc::private_intra_doc_links)]

pub mod anchors;
pub mod cache;
pub(crate) mod delta_rule;
pub mod device;
pub mod glue;
pub mod kv_face;
pub(crate) mod mamba2;
pub mod model;
pub mod object;
pub mod quant;
#[cfg(feature = "testing")]
pub mod testing;

pub use cache::{KitCache, KitError, Step};
pub use device::{AttendMask, Backend, Device};
pub use object::SharedCache;

#[doc(hidden)]
pub use inventory;
#[doc(hidden)]
pub use kvplug_core;
#[doc(hidden)]
pub use kvplug_plugin_api;
