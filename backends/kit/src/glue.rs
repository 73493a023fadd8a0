//! The glue that turns a [`Backend`] into a plugin: builders registered through
//! `inventory`, the root module's functions, and [`export_backend!`](crate::export_backend).

use std::sync::Arc;

use kvplug_core::{CacheConfig, CacheKind};
use kvplug_plugin_api::abi_stable::std_types::{RResult, RStr, RString, RVec, Tuple2};
use kvplug_plugin_api::log::ForwardingSubscriber;
use kvplug_plugin_api::{
    guard, AbiCacheConfig, AbiErrorKind, BackendInfo, BackendOptions, CacheHandle, HostServices,
    MethodHandle, PluginError, Registrar,
};

use crate::cache::KitCache;
use crate::device::Backend;
use crate::object::SharedCache;

/// A cache builder a backend registers for one kind tag. [`export_backend!`]
/// submits one per kind; a backend may submit more.
///
/// [`export_backend!`]: crate::export_backend
pub struct BuilderEntry {
    /// The backend the builder belongs to (entries of other backends linked into the same
    /// binary are ignored).
    pub backend_id: &'static str,
    /// Kind tag.
    pub kind: &'static str,
    /// The builder.
    pub build: extern "C" fn(config: &AbiCacheConfig) -> RResult<CacheHandle, PluginError>,
}

inventory::collect!(BuilderEntry);

fn device_error(id: &str, e: &str) -> PluginError {
    PluginError::new(
        AbiErrorKind::Backend,
        format!("backend '{id}' has no usable device: {e}"),
    )
}

/// Builds a cache of `kind` on the opened device (the body of every registered builder).
pub fn build<B: Backend>(
    device: Result<&Arc<B>, &String>,
    kind: CacheKind,
    config: &AbiCacheConfig,
) -> RResult<CacheHandle, PluginError> {
    guard(|| -> Result<CacheHandle, PluginError> {
        let device = device.map_err(|e| device_error(B::ID, e))?;
        let cfg = CacheConfig::try_from(config)?;
        let _span =
            tracing::debug_span!("build_cache", backend = B::ID, kind = kind.as_str()).entered();
        Ok(SharedCache::new(KitCache::new(device.clone(), kind, cfg)?).into_handle())
    })
}

/// The root module's `describe`.
pub fn describe<B: Backend>(
    device: Result<&Arc<B>, &String>,
    version: &str,
) -> RResult<BackendInfo, PluginError> {
    guard(|| -> Result<BackendInfo, PluginError> {
        let strings = |v: Vec<String>| v.into_iter().map(RString::from).collect::<RVec<_>>();
        let kinds = inventory::iter::<BuilderEntry>
            .into_iter()
            .filter(|e| e.backend_id == B::ID)
            .map(|e| e.kind.to_string())
            .collect();
        let (device, dtypes, features) = match device {
            Ok(d) => (
                d.device_description(),
                d.kv_dtypes().iter().map(|t| t.to_string()).collect(),
                d.features(),
            ),
            Err(e) => (format!("unavailable: {e}"), Vec::new(), Vec::new()),
        };
        Ok(BackendInfo {
            name: B::NAME.into(),
            version: version.into(),
            device: device.into(),
            kinds: strings(kinds),
            kv_dtypes: strings(dtypes),
            features: strings(features),
        })
    })
}

/// The root module's `counters`: the device's, none when it has none or panics.
pub fn counters<B: Backend>(device: Result<&Arc<B>, &String>) -> RVec<Tuple2<RString, u64>> {
    let Ok(d) = device else {
        return RVec::new();
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.counters()))
        .unwrap_or_default()
        .into_iter()
        .map(|(name, value)| Tuple2(name.into(), value))
        .collect()
}

/// The root module's `register`: forwards this dylib's tracing events to the host and
/// registers this backend's builders.
pub fn register<B: Backend>(
    host: HostServices,
    registrar: &mut Registrar,
) -> RResult<(), PluginError> {
    guard(|| -> Result<(), PluginError> {
        // Fails harmlessly when linked in-process as an rlib (the host's subscriber is set).
        let _ = tracing::subscriber::set_global_default(ForwardingSubscriber::new(host.clone()));
        for e in inventory::iter::<BuilderEntry>
            .into_iter()
            .filter(|e| e.backend_id == B::ID)
        {
            registrar.add(e.kind, e.build);
        }
        tracing::debug!(backend = B::ID, "registered builders");
        Ok(())
    })
}

/// The root module's `load_method` for a backend without model methods.
pub fn load_no_method<B: Backend>(
    name: RStr<'_>,
    _options: &BackendOptions,
    _host: HostServices,
) -> RResult<MethodHandle, PluginError> {
    guard(|| -> Result<MethodHandle, PluginError> {
        Err(PluginError::new(
            AbiErrorKind::NotFound,
            format!(
                "backend '{}' provides no model methods (asked for '{name}')",
                B::ID
            ),
        ))
    })
}

/// The root module's `load_method` for a backend with the kit's model graph: `forward`.
pub fn load_model_method<B: Backend + crate::model::ModelDevice>(
    name: RStr<'_>,
    options: &BackendOptions,
    host: HostServices,
) -> RResult<MethodHandle, PluginError> {
    guard(|| match name.as_str() {
        "forward" => crate::model::method::load_forward::<B>(options, &host),
        other => Err(PluginError::new(
            AbiErrorKind::NotFound,
            format!(
                "backend '{}' has no model method '{other}' (it has: forward)",
                B::ID
            ),
        )),
    })
}

/// Exports a [`Backend`] as a kvplug plugin: registers its contiguous, seq and tree
/// builders and emits the `abi_stable` root module. The crate must be a `cdylib` and depend
/// on `abi_stable` (the root-module attribute names it). With `, models` the backend (a
/// [`ModelDevice`](crate::model::ModelDevice)) also serves the kit's model methods.
///
/// ```text
/// kvplug_backend_kit::export_backend!(CpuDevice, models);
/// ```
#[macro_export]
macro_rules! export_backend {
    ($backend:ty) => {
        $crate::export_backend!(@emit $backend, $crate::glue::load_no_method::<$backend>);
    };
    ($backend:ty, models) => {
        $crate::export_backend!(@emit $backend, $crate::glue::load_model_method::<$backend>);
    };
    (@emit $backend:ty, $load:expr) => {
        #[doc(hidden)]
        pub mod __kvplug_plugin {
            use super::*;
            use $crate::kvplug_plugin_api::abi_stable::prefix_type::PrefixTypeTrait as _;
            use $crate::kvplug_plugin_api::abi_stable::std_types::{
                RResult, RStr, RString, RVec, Tuple2,
            };
            use $crate::kvplug_plugin_api::{
                AbiCacheConfig, BackendInfo, BackendModule, BackendModule_Ref, BackendOptions,
                CacheHandle, HostServices, MethodHandle, PluginError, Registrar,
            };
            use $crate::Backend as _;

            static DEVICE: ::std::sync::OnceLock<
                ::std::result::Result<::std::sync::Arc<$backend>, ::std::string::String>,
            > = ::std::sync::OnceLock::new();

            fn device() -> ::std::result::Result<&'static ::std::sync::Arc<$backend>, &'static ::std::string::String> {
                DEVICE
                    .get_or_init(|| {
                        ::std::panic::catch_unwind(<$backend>::open)
                            .unwrap_or_else(|_| Err("opening the device panicked".into()))
                            .map(::std::sync::Arc::new)
                    })
                    .as_ref()
            }

            extern "C" fn build_contiguous(c: &AbiCacheConfig) -> RResult<CacheHandle, PluginError> {
                $crate::glue::build::<$backend>(device(), $crate::kvplug_core::CacheKind::Contiguous, c)
            }
            extern "C" fn build_seq(c: &AbiCacheConfig) -> RResult<CacheHandle, PluginError> {
                $crate::glue::build::<$backend>(device(), $crate::kvplug_core::CacheKind::Seq, c)
            }
            extern "C" fn build_tree(c: &AbiCacheConfig) -> RResult<CacheHandle, PluginError> {
                $crate::glue::build::<$backend>(device(), $crate::kvplug_core::CacheKind::Tree, c)
            }
            $crate::inventory::submit! { $crate::glue::BuilderEntry { backend_id: <$backend>::ID, kind: "contiguous", build: build_contiguous } }
            $crate::inventory::submit! { $crate::glue::BuilderEntry { backend_id: <$backend>::ID, kind: "seq", build: build_seq } }
            $crate::inventory::submit! { $crate::glue::BuilderEntry { backend_id: <$backend>::ID, kind: "tree", build: build_tree } }

            extern "C" fn backend_id() -> RString {
                <$backend>::ID.into()
            }
            extern "C" fn describe() -> RResult<BackendInfo, PluginError> {
                $crate::glue::describe::<$backend>(device(), env!("CARGO_PKG_VERSION"))
            }
            extern "C" fn register(host: HostServices, registrar: &mut Registrar) -> RResult<(), PluginError> {
                $crate::glue::register::<$backend>(host, registrar)
            }
            extern "C" fn load_method(name: RStr<'_>, options: &BackendOptions, host: HostServices) -> RResult<MethodHandle, PluginError> {
                $load(name, options, host)
            }
            extern "C" fn counters() -> RVec<Tuple2<RString, u64>> {
                $crate::glue::counters::<$backend>(device())
            }

            /// The plugin's root module.
            #[::abi_stable::export_root_module]
            pub fn get_library() -> BackendModule_Ref {
                BackendModule {
                    backend_id,
                    describe,
                    register,
                    load_method,
                    counters,
                }
                .leak_into_prefix()
            }
        }
    };
}
