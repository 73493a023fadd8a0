//! # kvplug-host
//!
//! The host side of kvplug: discovers backend plugins, loads them (checking their ABI),
//! owns the two registries, and hands out cache sessions.
//!
//! Contracts:
//!
//! - **Loading never aborts the host.** A file that is not a kvplug plugin, whose ABI or
//!   version does not match, whose `register` fails or panics, or whose `backend_id` is
//!   already loaded is skipped with a one-line reason ([`Skipped`]).
//! - **The host owns both registries.** Builders are keyed `backend_id:kind`
//!   ([`BuilderRegistry`]); live caches are keyed by `cache_key` ([`CacheRegistry`]).
//! - **Sessions are RAII.** `make_*_session` builds through the builder registry, installs
//!   the cache under a fresh `cache-N` key and returns the session plus the
//!   [`BackendOptions`](kvplug_plugin_api::BackendOptions) carrying that key; dropping the
//!   session erases the key. The face (decode / seq / tree) is fixed by the factory.

pub mod agent_store;
pub mod bench;
pub mod chat;
pub mod conform;
pub mod discovery;
pub mod error;
pub mod fingerprint;
pub mod gguf;
mod gguf_check;
pub mod host;
pub mod loader;
pub mod model;
pub mod plan;
pub mod plugin_file;
pub mod registry;
pub mod run;
pub mod serve;
pub mod services;
pub mod session;
pub mod session_dir;
pub mod session_file;
pub mod speculative;
pub mod text;

pub use discovery::{PluginSearch, SearchDir};
pub use error::HostError;
pub use host::Host;
pub use loader::{LoadedPlugin, Skipped};
pub use registry::{BuilderRegistry, CacheRegistry};
pub use session::{CacheSession, DecodeSession, SeqSession, TreeSession};
