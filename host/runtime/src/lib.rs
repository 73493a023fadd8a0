//! # kvplug-runtime
//!
//! What a host application embeds to run kvplug's backends: plugin discovery and loading,
//! the two registries, and the three handles of a decode — like llama.cpp's `llama_model` →
//! `llama_context` → `llama_decode(ctx, batch)`:
//!
//! - [`Runtime`]: the loaded plugins (picked by string: `"cpu"`, `"wgpu"`, `"mlx"`), the
//!   builder registry (`backend_id:kind`) and the cache registry (`cache_key`).
//! - [`Model`]: a model directory read once for one backend (its `config.json` parsed by
//!   core's one parser, its cache shape), and views of its first `n` layers.
//! - [`Context`]: one cache of a kind bound to that model's `forward` (the `cache_key`
//!   rendezvous happens inside), [`Context::decode`] of a [`Batch`], and the cache verbs.
//!
//! Contracts:
//!
//! - **Loading never aborts the host.** A file that is not a kvplug plugin, whose ABI or
//!   version does not match, whose `register` fails or panics, or whose `backend_id` is
//!   already loaded is skipped with a one-line reason ([`Skipped`]).
//! - **A context is RAII.** Its cache is installed under a fresh `cache-N` key while the
//!   context lives; dropping it erases the key (the plugin's binding keeps the cache object
//!   alive until it is dropped too).
//! - **Typed errors, no printing.** Every failure is a [`RuntimeError`]; the crate writes
//!   nothing to stdout or stderr (events go to `tracing`).

pub mod batch;
pub mod cache;
pub mod context;
pub mod discovery;
pub mod error;
pub mod loader;
pub mod model;
pub mod plugin_file;
pub mod registry;
pub mod runtime;
pub mod services;

pub use batch::Batch;
pub use cache::Cache;
pub use context::{Context, Logits};
pub use discovery::{PluginSearch, SearchDir};
pub use error::RuntimeError;
pub use kvplug_core::{Adjust, Arithmetic, CacheKind, KeyBasis, KvDtype};
pub use loader::{Description, LoadedPlugin, Skipped};
pub use model::Model;
pub use registry::{BuilderRegistry, CacheRegistry};
pub use runtime::Runtime;
