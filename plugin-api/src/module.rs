#![allow(non_camel_case_types)] // `BackendModule_Ref` is named by abi_stable's convention.

//! The root module every plugin exports, and what it registers.

use abi_stable::library::RootModule;
use abi_stable::sabi_types::{VersionNumber, VersionStrings};
use abi_stable::std_types::{RResult, RStr, RString, RVec, Tuple2};
use abi_stable::{declare_root_module_statics, package_version_strings, StableAbi};

use crate::cache::{AbiCacheConfig, CacheHandle};
use crate::error::PluginError;
use crate::host::HostServices;
use crate::method::MethodHandle;

/// The backend option carrying the cache key a model method binds to.
pub const OPTION_CACHE_KEY: &str = "cache_key";

/// What `kvplug plugins` shows about a backend.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct BackendInfo {
    /// Human-readable name.
    pub name: RString,
    /// The plugin crate's version.
    pub version: RString,
    /// The device the backend computes on (or why it has none).
    pub device: RString,
    /// Cache kinds it registers builders for.
    pub kinds: RVec<RString>,
    /// KV storage dtypes its pools support.
    pub kv_dtypes: RVec<RString>,
    /// Feature flags (e.g. `xnnpack`, `avx2`).
    pub features: RVec<RString>,
}

/// Builds a cache of one kind. Must not panic across the boundary (the kit's glue guards).
pub type CacheBuilder = extern "C" fn(config: &AbiCacheConfig) -> RResult<CacheHandle, PluginError>;

/// One registered builder.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct KindBuilder {
    /// Kind tag (`contiguous`, `seq`, `tree`).
    pub kind: RStr<'static>,
    /// The builder (a [`CacheBuilder`]).
    pub build: extern "C" fn(config: &AbiCacheConfig) -> RResult<CacheHandle, PluginError>,
}

/// Collects the builders a plugin registers; the host keys them `backend_id:kind`.
#[repr(C)]
#[derive(StableAbi, Default)]
pub struct Registrar {
    /// Registered builders, in registration order.
    pub builders: RVec<KindBuilder>,
}

impl Registrar {
    /// Registers the builder for `kind`.
    pub fn add(&mut self, kind: &'static str, build: CacheBuilder) {
        self.builders.push(KindBuilder {
            kind: RStr::from_str(kind),
            build,
        });
    }
}

/// Options a model method is loaded with (`cache_key`, model directory, ...).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendOptions {
    /// Key/value pairs.
    pub entries: RVec<Tuple2<RString, RString>>,
}

impl BackendOptions {
    /// Sets `key` (replacing an earlier value).
    pub fn set(&mut self, key: &str, value: &str) {
        self.entries.retain(|e| e.0.as_str() != key);
        self.entries.push(Tuple2(key.into(), value.into()));
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|e| e.0.as_str() == key)
            .map(|e| e.1.as_str())
    }

    /// The `cache_key` option.
    pub fn cache_key(&self) -> Option<&str> {
        self.get(OPTION_CACHE_KEY)
    }
}

/// The root module of a backend plugin. A prefix type: fields can be appended in later
/// versions without breaking plugins built against this one.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = BackendModule_Ref)))]
#[allow(non_camel_case_types)]
#[sabi(missing_field(panic))]
pub struct BackendModule {
    /// The id applications select the backend by (`cpu`, `wgpu`, ...).
    pub backend_id: extern "C" fn() -> RString,
    /// Describes the backend and its device.
    pub describe: extern "C" fn() -> RResult<BackendInfo, PluginError>,
    /// Called once after loading: receives the host's services and registers one builder
    /// per kind.
    pub register:
        extern "C" fn(host: HostServices, registrar: &mut Registrar) -> RResult<(), PluginError>,
    /// Loads a model method (`forward`, ...) bound to the cache named by `options`, looked
    /// up through `host`: the services of the host asking, which need not be the first
    /// host that registered this dylib in the process.
    #[sabi(last_prefix_field)]
    pub load_method: extern "C" fn(
        name: RStr<'_>,
        options: &BackendOptions,
        host: HostServices,
    ) -> RResult<MethodHandle, PluginError>,
    /// The backend device's counters since it opened, by name (`dispatches`,
    /// `read_back_bytes`, ...; none where it keeps none): what a step costs where the host
    /// cannot see it (`kvplug bench` reports them per token). Since 3.1.
    pub counters: extern "C" fn() -> RVec<Tuple2<RString, u64>>,
}

/// The plugin API version this crate defines: what a plugin is built against and what a
/// host built with it offers (`kvplug --version` prints it).
pub const API_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version policy: a host built against plugin API `host` loads a plugin built against
/// `plugin` when their majors are equal and the plugin's minor is the host's or newer (for a
/// `0.y` API, when `y` is equal). A minor release only appends fields to prefix types
/// ([`BackendModule`], [`CacheObject`](crate::CacheObject)) — with a default or
/// `#[sabi(missing_field(option))]` — which an older host never reads, or adds what a host
/// may ask of a plugin's methods (3.1: the `forward` method's `argmax` input; 3.2: its
/// `top k` and adjustment inputs). An older plugin lacks them, and abi_stable's layout check refuses a
/// plugin whose prefix types have fewer fields than the host's, so it is refused here in one
/// line first. Any other change to a type that crosses the boundary is a new major.
pub fn accepts(host: VersionNumber, plugin: VersionNumber) -> bool {
    host.major == plugin.major
        && if host.major == 0 {
            host.minor == plugin.minor
        } else {
            plugin.minor >= host.minor
        }
}

/// The plugin API versions a host built against `host` loads, for messages: `1.1 or a later
/// 1.x`, `0.3.x`.
pub fn accepted_range(host: VersionNumber) -> String {
    if host.major == 0 {
        format!("0.{}.x", host.minor)
    } else {
        format!("{}.{} or a later {}.x", host.major, host.minor, host.major)
    }
}

impl RootModule for BackendModule_Ref {
    declare_root_module_statics! {BackendModule_Ref}
    const BASE_NAME: &'static str = "kvplug_backend";
    const NAME: &'static str = "kvplug_backend";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(major: u32, minor: u32, patch: u32) -> VersionNumber {
        VersionNumber {
            major,
            minor,
            patch,
        }
    }

    #[test]
    fn a_host_loads_its_minor_and_newer_ones_of_its_major_and_nothing_else() {
        let host = v(1, 2, 0);
        for plugin in [v(1, 2, 0), v(1, 2, 7), v(1, 9, 0)] {
            assert!(accepts(host, plugin), "{plugin}");
        }
        for plugin in [v(1, 1, 9), v(1, 0, 0), v(0, 2, 0), v(2, 0, 0), v(2, 2, 0)] {
            assert!(!accepts(host, plugin), "{plugin}");
        }
        assert_eq!(accepted_range(host), "1.2 or a later 1.x");
    }

    #[test]
    fn a_0_y_api_treats_y_as_its_major() {
        let host = v(0, 3, 1);
        assert!(accepts(host, v(0, 3, 0)) && accepts(host, v(0, 3, 9)));
        assert!(!accepts(host, v(0, 2, 0)) && !accepts(host, v(0, 4, 0)));
        assert_eq!(accepted_range(host), "0.3.x");
    }
}
