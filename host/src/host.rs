//! [`Host`]: the loaded plugins, both registries and the session factories.

use std::sync::Arc;

use kvplug_core::{CacheConfig, CacheKind};
use kvplug_plugin_api::abi_stable::std_types::RStr;
use kvplug_plugin_api::{
    AbiCacheConfig, BackendOptions, CacheEntry, HostServices, MethodHandle, OPTION_CACHE_KEY,
};

use crate::discovery::PluginSearch;
use crate::error::HostError;
use crate::loader::{load_all, LoadedPlugin, Skipped};
use crate::registry::{BuilderRegistry, CacheRegistry};
use crate::services::HostServicesImpl;
use crate::session::{CacheSession, DecodeSession, SeqSession, TreeSession};

/// A host process's view of its plugins.
pub struct Host {
    builders: BuilderRegistry,
    caches: Arc<CacheRegistry>,
    services: HostServices,
    plugins: Vec<LoadedPlugin>,
    skipped: Vec<Skipped>,
    load_seconds: f64,
}

impl Host {
    /// Discovers and loads plugins. Never fails: what could not load is in
    /// [`Host::skipped`].
    pub fn load(search: &PluginSearch) -> Host {
        let caches = Arc::new(CacheRegistry::default());
        let services = HostServicesImpl::handle(caches.clone());
        let mut builders = BuilderRegistry::default();
        let report = load_all(search, &services, &mut builders);
        Host {
            builders,
            caches,
            services,
            plugins: report.plugins,
            skipped: report.skipped,
            load_seconds: report.seconds,
        }
    }

    /// Loaded plugins, in load order.
    pub fn plugins(&self) -> &[LoadedPlugin] {
        &self.plugins
    }

    /// Files and directories that were not loaded, with reasons.
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// Seconds the load pass took.
    pub fn load_seconds(&self) -> f64 {
        self.load_seconds
    }

    /// Ids of loaded backends.
    pub fn backend_ids(&self) -> Vec<String> {
        self.plugins.iter().map(|p| p.backend_id.clone()).collect()
    }

    /// The plugin with id `backend`.
    pub fn plugin(&self, backend: &str) -> Result<&LoadedPlugin, HostError> {
        self.plugins
            .iter()
            .find(|p| p.backend_id == backend)
            .ok_or_else(|| HostError::UnknownBackend {
                wanted: backend.to_string(),
                loaded: self.backend_ids(),
            })
    }

    /// The builder registry.
    pub fn builders(&self) -> &BuilderRegistry {
        &self.builders
    }

    /// The cache registry.
    pub fn caches(&self) -> &Arc<CacheRegistry> {
        &self.caches
    }

    /// The services handed to plugins (cache lookup as a plugin sees it).
    pub fn services(&self) -> &HostServices {
        &self.services
    }

    /// Builds a `kind` cache on `backend`, installs it under a fresh key and returns the
    /// session plus the options that carry the key.
    pub fn make_session(
        &self,
        backend: &str,
        kind: CacheKind,
        cfg: &CacheConfig,
    ) -> Result<(CacheSession, BackendOptions), HostError> {
        self.plugin(backend)?;
        let build =
            self.builders
                .get(backend, kind.as_str())
                .ok_or_else(|| HostError::UnknownKind {
                    backend: backend.to_string(),
                    kind: kind.as_str().to_string(),
                    kinds: self.builders.kinds_of(backend),
                })?;
        let _span = tracing::info_span!("session_create", backend, kind = kind.as_str()).entered();
        let cache = build(&AbiCacheConfig::from(cfg)).into_result()?;
        let got = cache.kind().to_string();
        if got != kind.as_str() {
            return Err(HostError::WrongKind {
                backend: backend.to_string(),
                wanted: kind.as_str().to_string(),
                got,
            });
        }
        let key = self.caches.make_unique_key();
        self.caches.install(
            &key,
            CacheEntry {
                backend_id: backend.into(),
                cache: cache.clone(),
            },
        );
        let mut options = BackendOptions::default();
        options.set(OPTION_CACHE_KEY, &key);
        tracing::debug!(%key, "cache installed");
        Ok((
            CacheSession::new(key, backend.to_string(), kind, cache, self.caches.clone()),
            options,
        ))
    }

    /// A plain-decode session (contiguous cache).
    pub fn make_decode_session(
        &self,
        backend: &str,
        cfg: &CacheConfig,
    ) -> Result<(DecodeSession, BackendOptions), HostError> {
        let (s, o) = self.make_session(backend, CacheKind::Contiguous, cfg)?;
        Ok((DecodeSession(s), o))
    }

    /// A multi-sequence session (seq cache).
    pub fn make_seq_session(
        &self,
        backend: &str,
        cfg: &CacheConfig,
    ) -> Result<(SeqSession, BackendOptions), HostError> {
        let (s, o) = self.make_session(backend, CacheKind::Seq, cfg)?;
        Ok((SeqSession(s), o))
    }

    /// A speculative session (tree cache).
    pub fn make_tree_session(
        &self,
        backend: &str,
        cfg: &CacheConfig,
    ) -> Result<(TreeSession, BackendOptions), HostError> {
        let (s, o) = self.make_session(backend, CacheKind::Tree, cfg)?;
        Ok((TreeSession(s), o))
    }

    /// Loads model method `name` inside `backend`, bound through `options`.
    pub fn load_method(
        &self,
        backend: &str,
        name: &str,
        options: &BackendOptions,
    ) -> Result<MethodHandle, HostError> {
        let plugin = self.plugin(backend)?;
        Ok(
            (plugin.module.load_method())(RStr::from_str(name), options, self.services.clone())
                .into_result()?,
        )
    }
}
