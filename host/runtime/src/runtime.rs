//! [`Runtime`]: the loaded plugins and both registries; where caches and models come from.

use std::path::Path;
use std::sync::Arc;

use kvplug_core::{CacheConfig, CacheKind};
use kvplug_plugin_api::abi_stable::std_types::RStr;
use kvplug_plugin_api::{
    AbiCacheConfig, BackendOptions, CacheEntry, HostServices, MethodHandle, OPTION_CACHE_KEY,
};

use crate::cache::Cache;
use crate::discovery::PluginSearch;
use crate::error::RuntimeError;
use crate::loader::{load_all, LoadedPlugin, Skipped};
use crate::model::Model;
use crate::registry::{BuilderRegistry, CacheRegistry};
use crate::services::HostServicesImpl;

/// A process's view of its plugins. Cheap to clone: clones share the plugins and registries
/// (a [`Model`] keeps one).
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

struct Inner {
    builders: BuilderRegistry,
    caches: Arc<CacheRegistry>,
    services: HostServices,
    plugins: Vec<LoadedPlugin>,
    skipped: Vec<Skipped>,
    load_seconds: f64,
}

impl Runtime {
    /// Discovers and loads plugins. Never fails: what could not load is in
    /// [`Runtime::skipped`].
    pub fn load(search: &PluginSearch) -> Runtime {
        let caches = Arc::new(CacheRegistry::default());
        let services = HostServicesImpl::handle(caches.clone());
        let mut builders = BuilderRegistry::default();
        let report = load_all(search, &services, &mut builders);
        Runtime {
            inner: Arc::new(Inner {
                builders,
                caches,
                services,
                plugins: report.plugins,
                skipped: report.skipped,
                load_seconds: report.seconds,
            }),
        }
    }

    /// Loaded plugins, in load order.
    pub fn plugins(&self) -> &[LoadedPlugin] {
        &self.inner.plugins
    }

    /// Files and directories that were not loaded, with reasons.
    pub fn skipped(&self) -> &[Skipped] {
        &self.inner.skipped
    }

    /// Seconds the load pass took.
    pub fn load_seconds(&self) -> f64 {
        self.inner.load_seconds
    }

    /// Ids of loaded backends.
    pub fn backend_ids(&self) -> Vec<String> {
        self.plugins()
            .iter()
            .map(|p| p.backend_id.clone())
            .collect()
    }

    /// The plugin with id `backend`.
    pub fn plugin(&self, backend: &str) -> Result<&LoadedPlugin, RuntimeError> {
        self.plugins()
            .iter()
            .find(|p| p.backend_id == backend)
            .ok_or_else(|| RuntimeError::UnknownBackend {
                wanted: backend.to_string(),
                loaded: self.backend_ids(),
                skipped: self.skipped().to_vec(),
            })
    }

    /// The builder registry (`backend_id:kind`).
    pub fn builders(&self) -> &BuilderRegistry {
        &self.inner.builders
    }

    /// The cache registry (`cache_key` → installed cache).
    pub fn caches(&self) -> &Arc<CacheRegistry> {
        &self.inner.caches
    }

    /// The services handed to plugins (cache lookup as a plugin sees it).
    pub fn services(&self) -> &HostServices {
        &self.inner.services
    }

    /// The model in directory `dir` (a Hugging Face–style package, or the index of a GGUF
    /// file that the SDK writes) on `backend`, its `config.json` read once.
    pub fn model(&self, backend: &str, dir: &Path) -> Result<Model, RuntimeError> {
        self.plugin(backend)?;
        Model::open(self.clone(), backend, dir)
    }

    /// A bare `kind` cache on `backend` (no model bound: the op `update_and_attend` and the
    /// verbs, as conformance drives them), installed under a fresh key while it lives.
    pub fn cache(
        &self,
        backend: &str,
        kind: CacheKind,
        cfg: &CacheConfig,
    ) -> Result<Cache, RuntimeError> {
        self.plugin(backend)?;
        let build = self.builders().get(backend, kind.as_str()).ok_or_else(|| {
            RuntimeError::UnknownKind {
                backend: backend.to_string(),
                kind: kind.as_str().to_string(),
                kinds: self.builders().kinds_of(backend),
            }
        })?;
        let _span = tracing::info_span!("cache_create", backend, kind = kind.as_str()).entered();
        let cache = build(&AbiCacheConfig::from(cfg)).into_result()?;
        let got = cache.kind().to_string();
        if got != kind.as_str() {
            return Err(RuntimeError::WrongKind {
                backend: backend.to_string(),
                wanted: kind.as_str().to_string(),
                got,
            });
        }
        let key = self.caches().make_unique_key();
        self.caches().install(
            &key,
            CacheEntry {
                backend_id: backend.into(),
                cache: cache.clone(),
            },
        );
        tracing::debug!(%key, "cache installed");
        Ok(Cache::new(
            key,
            backend.to_string(),
            kind,
            cache,
            self.caches().clone(),
        ))
    }

    /// Loads method `name` inside `backend`, bound to `cache` (its key goes in the options,
    /// with `extra` options such as the model directory).
    pub(crate) fn load_method(
        &self,
        backend: &str,
        name: &str,
        cache: &Cache,
        extra: &[(&str, String)],
    ) -> Result<MethodHandle, RuntimeError> {
        let plugin = self.plugin(backend)?;
        let mut options = BackendOptions::default();
        options.set(OPTION_CACHE_KEY, cache.key());
        for (k, v) in extra {
            options.set(k, v);
        }
        let load = plugin.module.load_method();
        Ok(load(RStr::from_str(name), &options, self.services().clone()).into_result()?)
    }
}
