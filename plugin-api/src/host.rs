//! What the host offers plugins: cache lookup by `cache_key` and a log sink.

use abi_stable::sabi_trait;
use abi_stable::std_types::{RArc, RResult, RStr, RString};
use abi_stable::StableAbi;

use crate::cache::CacheHandle;
use crate::error::PluginError;
use crate::log::LogRecord;

/// A cache registry entry: the owning backend and the shared cache object.
#[repr(C)]
#[derive(StableAbi, Clone)]
pub struct CacheEntry {
    /// The backend that built the cache; only that plugin may downcast it.
    pub backend_id: RString,
    /// The cache.
    pub cache: CacheHandle,
}

impl std::fmt::Debug for CacheEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheEntry")
            .field("backend_id", &self.backend_id)
            .field("kind", &self.cache.kind())
            .finish()
    }
}

/// Services the host passes to a plugin at registration and when loading methods.
#[sabi_trait]
pub trait HostServicesTrait: Clone + Send + Sync {
    /// The cache installed under `key`; `not_found` if there is none (any more).
    fn lookup_cache(&self, key: RStr<'_>) -> RResult<CacheEntry, PluginError>;
    /// The most verbose level the host wants (see [`LogRecord::level`]).
    fn max_level(&self) -> u8;
    /// Emits one log record through the host's subscriber.
    #[sabi(last_prefix_field)]
    fn log(&self, record: &LogRecord);
}

/// A clonable handle to the host's services.
pub type HostServices = HostServicesTrait_TO<'static, RArc<()>>;
