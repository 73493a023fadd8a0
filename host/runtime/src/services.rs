//! The host's implementation of [`HostServicesTrait`]: cache lookup and the log sink.

use std::sync::Arc;

use kvplug_plugin_api::abi_stable::sabi_trait::TD_Opaque;
use kvplug_plugin_api::abi_stable::std_types::{RArc, RResult, RStr};
use kvplug_plugin_api::log::{level_number, LogRecord};
use kvplug_plugin_api::{
    AbiErrorKind, CacheEntry, HostServices, HostServicesTrait, HostServicesTrait_TO, PluginError,
};
use tracing::level_filters::LevelFilter;

use crate::registry::CacheRegistry;

/// Services backed by the host's cache registry and tracing subscriber.
#[derive(Clone)]
pub struct HostServicesImpl {
    caches: Arc<CacheRegistry>,
}

impl HostServicesImpl {
    /// The ABI handle for `caches`.
    pub fn handle(caches: Arc<CacheRegistry>) -> HostServices {
        HostServicesTrait_TO::from_ptr(RArc::new(HostServicesImpl { caches }), TD_Opaque)
    }
}

impl HostServicesTrait for HostServicesImpl {
    fn lookup_cache(&self, key: RStr<'_>) -> RResult<CacheEntry, PluginError> {
        match self.caches.lookup(key.as_str()) {
            Some(e) => RResult::ROk(e),
            None => RResult::RErr(PluginError::new(
                AbiErrorKind::NotFound,
                format!("no cache is installed under key '{key}' (its session ended, or it never existed)"),
            )),
        }
    }

    fn max_level(&self) -> u8 {
        match LevelFilter::current().into_level() {
            Some(l) => level_number(&l),
            None => 0,
        }
    }

    fn log(&self, r: &LogRecord) {
        let (target, msg) = (r.target.as_str(), r.message.as_str());
        match r.level {
            0 | 1 => tracing::error!(target: "kvplug::plugin", plugin_target = target, "{msg}"),
            2 => tracing::warn!(target: "kvplug::plugin", plugin_target = target, "{msg}"),
            3 => tracing::info!(target: "kvplug::plugin", plugin_target = target, "{msg}"),
            4 => tracing::debug!(target: "kvplug::plugin", plugin_target = target, "{msg}"),
            _ => tracing::trace!(target: "kvplug::plugin", plugin_target = target, "{msg}"),
        }
    }
}
