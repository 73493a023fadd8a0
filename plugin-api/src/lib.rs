//! # kvplug-plugin-api
//!
//! The only types that cross a plugin's dylib boundary. Everything here is
//! `abi_stable`-checked: the host verifies the layout of [`BackendModule`] (and everything it
//! reaches) when it loads a plugin, and refuses a plugin built against an incompatible
//! version of this crate: this crate has its own version ([`API_VERSION`]), independent of
//! kvplug's, and [`accepts`] states which plugin versions a host loads.
//!
//! Contracts:
//!
//! - **No panics across the boundary.** Every function a plugin exports, and every method of
//!   [`CacheObject`] and [`ModelMethod`], catches panics ([`guard()`]) and returns a
//!   [`PluginError`] of kind [`AbiErrorKind::Panic`].
//! - **No shared statics.** Each dylib has its own copy of every Rust static; what the host
//!   shares (cache lookup, the log sink) reaches a plugin through [`HostServices`].
//! - **Shared ownership.** Cache objects are `RArc`-backed trait objects with `&self`
//!   methods (implementations lock internally): the host registry, the session and a model
//!   method may all hold the same cache.
//! - **Downcasting** a cache object to its concrete type works only inside the dylib that
//!   created it; check [`CacheEntry::backend_id`] first.

// `#[sabi_trait]` expands to impls inside a const item; the lint fires on generated code.
#![allow(non_local_definitions)]

pub mod cache;
pub mod error;
pub mod guard;
pub mod host;
pub mod log;
pub mod method;
pub mod module;
pub mod tensor;

pub use cache::{AbiCacheConfig, CacheHandle, CacheObject, CacheObject_TO, CacheStats, SeqRows};
pub use error::{AbiErrorKind, PluginError, PluginResult};
pub use guard::{guard, guard_or};
pub use host::{CacheEntry, HostServices, HostServicesTrait, HostServicesTrait_TO};
pub use method::{MethodHandle, ModelMethod, ModelMethod_TO};
pub use module::{
    accepted_range, accepts, BackendInfo, BackendModule, BackendModule_Ref, BackendOptions,
    CacheBuilder, KindBuilder, Registrar, API_VERSION, OPTION_CACHE_KEY,
};
pub use tensor::{HostTensor, TensorDtype};

/// Re-exported so plugins and the host use the same version.
pub use abi_stable;
