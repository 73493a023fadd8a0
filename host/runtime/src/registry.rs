//! The two host-owned registries.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kvplug_plugin_api::abi_stable::std_types::RResult;
use kvplug_plugin_api::{AbiCacheConfig, CacheEntry, CacheHandle, PluginError};

/// A plugin's cache builder.
pub type Builder = extern "C" fn(&AbiCacheConfig) -> RResult<CacheHandle, PluginError>;

/// Builders keyed `backend_id:kind`.
#[derive(Default)]
pub struct BuilderRegistry {
    builders: BTreeMap<(String, String), Builder>,
}

impl BuilderRegistry {
    /// Registers (or replaces) the builder of `backend:kind`.
    pub fn insert(&mut self, backend: &str, kind: &str, build: Builder) {
        self.builders
            .insert((backend.to_string(), kind.to_string()), build);
    }

    /// The builder of `backend:kind`.
    pub fn get(&self, backend: &str, kind: &str) -> Option<Builder> {
        self.builders
            .get(&(backend.to_string(), kind.to_string()))
            .copied()
    }

    /// Kinds registered for `backend`, sorted.
    pub fn kinds_of(&self, backend: &str) -> Vec<String> {
        self.builders
            .keys()
            .filter(|(b, _)| b == backend)
            .map(|(_, k)| k.clone())
            .collect()
    }

    /// Every `backend_id:kind` key, sorted.
    pub fn keys(&self) -> Vec<String> {
        self.builders
            .keys()
            .map(|(b, k)| format!("{b}:{k}"))
            .collect()
    }
}

/// Live caches keyed by `cache_key`. Entries hold the owning backend id and a shared
/// reference to the cache; erasing an entry never invalidates other holders.
#[derive(Default)]
pub struct CacheRegistry {
    entries: Mutex<HashMap<String, CacheEntry>>,
    next: AtomicU64,
}

impl CacheRegistry {
    /// A fresh key, `cache-N`, never handed out before by this registry.
    pub fn make_unique_key(&self) -> String {
        format!("cache-{}", self.next.fetch_add(1, Ordering::Relaxed))
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, CacheEntry>> {
        // The map holds plain data; a panic elsewhere cannot leave it inconsistent.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Installs `entry` under `key`, replacing any earlier entry.
    pub fn install(&self, key: &str, entry: CacheEntry) {
        self.map().insert(key.to_string(), entry);
    }

    /// Removes `key`; true if it was present.
    pub fn erase(&self, key: &str) -> bool {
        self.map().remove(key).is_some()
    }

    /// The entry under `key`.
    pub fn lookup(&self, key: &str) -> Option<CacheEntry> {
        self.map().get(key).cloned()
    }

    /// Installed entries.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// True when nothing is installed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
