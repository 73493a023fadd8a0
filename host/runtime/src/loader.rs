//! Loading plugin files: ABI check, identity, registration. Never aborts the host.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use abi_stable::library::{lib_header_from_path, LibHeader, LibraryError, RootModule};
use abi_stable::sabi_types::VersionNumber;
use abi_stable::std_types::{RString, RVec, Tuple2};
use kvplug_plugin_api::{accepted_range, accepts, BackendModule_Ref, HostServices, Registrar};

use crate::discovery::{is_dylib, world_writable, PluginSearch};
use crate::plugin_file::{check_object, not_a_regular_file, open_now};
use crate::registry::BuilderRegistry;

/// A plugin that loaded and registered. What it says of itself and its device
/// ([`LoadedPlugin::description`]) is asked on first use, not at load: describing opens the
/// device (a Vulkan instance, a GPU context), which a run on another backend should not pay
/// for.
#[derive(Clone)]
pub struct LoadedPlugin {
    /// Its backend id.
    pub backend_id: String,
    /// The file it came from.
    pub file: PathBuf,
    /// The plugin API version it was built against.
    pub api_version: String,
    /// Kinds it registered.
    pub kinds: Vec<String>,
    /// Its `describe`, once asked (shared by clones).
    described: Arc<OnceLock<Description>>,
    pub(crate) module: BackendModule_Ref,
}

/// What a plugin's `describe` says: itself and its device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Description {
    /// Human-readable name.
    pub name: String,
    /// Plugin version.
    pub version: String,
    /// Device description; `unavailable: …` where the device did not open or `describe`
    /// failed.
    pub device: String,
    /// KV dtypes its pools support.
    pub kv_dtypes: Vec<String>,
    /// Feature flags.
    pub features: Vec<String>,
}

impl LoadedPlugin {
    /// The plugin's `describe`, called (opening its device) the first time any clone of this
    /// plugin asks. A `describe` that fails or panics gives the name `?` and a device
    /// `unavailable: describe failed: …`, with no dtypes or features.
    pub fn description(&self) -> &Description {
        self.described.get_or_init(|| {
            let _span = tracing::debug_span!("describe", backend = %self.backend_id).entered();
            let strings = |v: RVec<RString>| v.into_iter().map(String::from).collect();
            match (self.module.describe())().into_result() {
                Ok(info) => Description {
                    name: info.name.into(),
                    version: info.version.into(),
                    device: info.device.into(),
                    kv_dtypes: strings(info.kv_dtypes),
                    features: strings(info.features),
                },
                Err(e) => Description {
                    name: "?".into(),
                    version: "?".into(),
                    device: format!("unavailable: describe failed: {e}"),
                    kv_dtypes: Vec::new(),
                    features: Vec::new(),
                },
            }
        })
    }

    /// Its device's counters since it opened, by name (`dispatches`, `read_back_bytes`,
    /// ...; none where the backend keeps none).
    pub fn counters(&self) -> Vec<(String, u64)> {
        (self.module.counters())()
            .into_iter()
            .map(|Tuple2(name, value)| (name.into(), value))
            .collect()
    }
}

/// Serialized as one object, its description included (asked for here).
impl serde::Serialize for LoadedPlugin {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(serde::Serialize)]
        struct View<'a> {
            backend_id: &'a str,
            file: &'a Path,
            name: &'a str,
            version: &'a str,
            api_version: &'a str,
            device: &'a str,
            kinds: &'a [String],
            kv_dtypes: &'a [String],
            features: &'a [String],
        }
        let d = self.description();
        let view = View {
            backend_id: &self.backend_id,
            file: &self.file,
            name: &d.name,
            version: &d.version,
            api_version: &self.api_version,
            device: &d.device,
            kinds: &self.kinds,
            kv_dtypes: &d.kv_dtypes,
            features: &d.features,
        };
        serde::Serialize::serialize(&view, s)
    }
}

/// A file or directory that was not loaded, and why (one line).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// The file or directory.
    pub file: PathBuf,
    /// The reason, one line.
    pub reason: String,
}

/// Everything one load pass produced.
#[derive(Default)]
pub struct LoadReport {
    /// Loaded plugins, in load order.
    pub plugins: Vec<LoadedPlugin>,
    /// Skipped files.
    pub skipped: Vec<Skipped>,
    /// Wall time of the whole pass, in seconds.
    pub seconds: f64,
}

/// Loads every plugin `search` finds, registering builders into `builders`.
pub fn load_all(
    search: &PluginSearch,
    services: &HostServices,
    builders: &mut BuilderRegistry,
) -> LoadReport {
    let start = Instant::now();
    let _span = tracing::info_span!("plugin_load").entered();
    let mut report = LoadReport::default();
    let mut seen_files = HashSet::new();
    for file in &search.files {
        if !file.exists() {
            report.skipped.push(Skipped {
                file: file.clone(),
                reason: "plugin file (from --plugin) does not exist".into(),
            });
            continue;
        }
        load_file(
            file,
            search,
            services,
            builders,
            &mut seen_files,
            &mut report,
        );
    }
    for dir in &search.dirs {
        if !dir.path.is_dir() {
            if dir.origin != "default" {
                let what = if dir.path.exists() {
                    "is not a directory"
                } else {
                    "does not exist"
                };
                report.skipped.push(Skipped {
                    file: dir.path.clone(),
                    reason: format!("plugin directory (from {}) {what}", dir.origin),
                });
            }
            continue;
        }
        if !search.allow_insecure && world_writable(&dir.path) {
            report.skipped.push(Skipped {
                file: dir.path.clone(),
                reason: "directory is world-writable; refusing to load plugins from it (--allow-insecure-plugins overrides)".into(),
            });
            continue;
        }
        let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir.path) {
            Ok(rd) => rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_dylib(p))
                .collect(),
            Err(e) => {
                report.skipped.push(Skipped {
                    file: dir.path.clone(),
                    reason: format!("cannot read plugin directory: {e}"),
                });
                continue;
            }
        };
        files.sort();
        for file in files {
            load_file(
                &file,
                search,
                services,
                builders,
                &mut seen_files,
                &mut report,
            );
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    report
}

/// Loads `file` (once per canonical path) into `report`.
fn load_file(
    file: &Path,
    search: &PluginSearch,
    services: &HostServices,
    builders: &mut BuilderRegistry,
    seen_files: &mut HashSet<PathBuf>,
    report: &mut LoadReport,
) {
    let canonical = file.canonicalize().unwrap_or_else(|_| file.to_path_buf());
    if !seen_files.insert(canonical) {
        return;
    }
    let file = file.to_path_buf();
    if let Some(reason) = not_a_regular_file(&file) {
        report.skipped.push(Skipped { file, reason });
        return;
    }
    match load_one(
        &file,
        search.allow_insecure,
        services,
        builders,
        &report.plugins,
    ) {
        Ok(p) => {
            tracing::info!(backend = %p.backend_id, file = %file.display(), "plugin loaded");
            report.plugins.push(p);
        }
        Err(reason) => {
            tracing::warn!("skipped plugin {}: {reason}", file.display());
            report.skipped.push(Skipped { file, reason });
        }
    }
}

/// One line describing a library error; the full layout report goes to debug level.
fn describe_library_error(e: &LibraryError) -> String {
    match e {
        LibraryError::OpenError { err, .. } => {
            format!("cannot be opened as a shared library: {err}")
        }
        LibraryError::GetSymbolError { .. } => {
            "not a kvplug plugin: it exports no abi_stable root module".to_string()
        }
        LibraryError::InvalidAbiHeader(h) => {
            format!("built with an incompatible abi_stable ABI header ({h:?})")
        }
        LibraryError::IncompatibleVersionNumber {
            expected_version,
            actual_version,
            ..
        } => format!(
            "plugin API version {actual_version} is incompatible with the host's {expected_version}"
        ),
        LibraryError::AbiInstability(report) => {
            tracing::debug!("full layout report:\n{report}");
            "ABI/layout mismatch with this host's kvplug-plugin-api (RUST_LOG=debug shows the layout report)".to_string()
        }
        LibraryError::RootModule { err, .. } => format!("root module failed to initialise: {err}"),
        other => format!("{other}")
            .lines()
            .next()
            .unwrap_or("unknown loading error")
            .to_string(),
    }
}

fn load_one(
    file: &Path,
    allow_insecure: bool,
    services: &HostServices,
    builders: &mut BuilderRegistry,
    loaded: &[LoadedPlugin],
) -> Result<LoadedPlugin, String> {
    if !allow_insecure && world_writable(file) {
        return Err(
            "file is world-writable; refusing to load it (--allow-insecure-plugins overrides)"
                .into(),
        );
    }
    check_object(file)?;
    let library = open_now(file)?;
    let header = lib_header_from_path(file).map_err(|e| describe_library_error(&e))?;
    let api_version = check_api_version(header)?;
    // Plugins are never unloaded (abi_stable keeps its own handle loaded too).
    std::mem::forget(library);
    let module = header
        .init_root_module::<BackendModule_Ref>()
        .map_err(|e| describe_library_error(&e))?;
    let id = (module.backend_id())().to_string();
    if let Some(prev) = loaded.iter().find(|p| p.backend_id == id) {
        return Err(format!(
            "backend '{id}' is already loaded from {}",
            prev.file.display()
        ));
    }
    let mut registrar = Registrar::default();
    (module.register())(services.clone(), &mut registrar)
        .into_result()
        .map_err(|e| format!("register failed: {e}"))?;
    let mut kinds = Vec::new();
    for b in registrar.builders.iter() {
        builders.insert(&id, b.kind.as_str(), b.build);
        kinds.push(b.kind.to_string());
    }
    kinds.sort_by_key(|k| k.parse::<kvplug_core::CacheKind>().ok());
    Ok(LoadedPlugin {
        backend_id: id,
        file: file.to_path_buf(),
        api_version,
        kinds,
        described: Arc::default(),
        module,
    })
}

/// The plugin API version a plugin was built against, refused in one line unless this host
/// accepts it ([`accepts`]). Runs before abi_stable's layout check, whose report of a version
/// mismatch is thousands of lines.
fn check_api_version(header: &LibHeader) -> Result<String, String> {
    let theirs = header.version_strings();
    let plugin = VersionNumber::new(theirs)
        .map_err(|e| format!("unreadable plugin API version '{}': {e}", theirs.version))?;
    let host = host_api_version();
    if !accepts(host, plugin) {
        return Err(format!(
            "plugin API version {plugin} is incompatible with the host's {host} (this host loads plugins built against {})",
            accepted_range(host)
        ));
    }
    Ok(plugin.to_string())
}

/// The plugin API version this host was built against.
pub fn host_api_version() -> VersionNumber {
    VersionNumber::new(BackendModule_Ref::VERSION_STRINGS)
        .expect("kvplug-plugin-api's own version parses")
}

/// One line for `kvplug --version`: the host's plugin API version and what it loads.
pub fn api_version_line() -> String {
    let host = host_api_version();
    format!(
        "plugin API {host}; loads plugins built against {}",
        accepted_range(host)
    )
}
