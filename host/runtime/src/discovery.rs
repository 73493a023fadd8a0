//! Where plugins are looked for.
//!
//! Order: every `--plugins DIR`, then each entry of `KVPLUG_PLUGIN_PATH` (`:`-separated),
//! then the executable's directory and its `plugins/` subdirectory. Only files with the
//! platform's dylib extension are considered. Directories and files writable by everyone
//! are refused unless insecure loading is allowed.

use std::path::{Path, PathBuf};

/// The environment variable listing extra plugin directories.
pub const PLUGIN_PATH_ENV: &str = "KVPLUG_PLUGIN_PATH";

/// One directory to search, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SearchDir {
    /// The directory.
    pub path: PathBuf,
    /// `--plugins`, `KVPLUG_PLUGIN_PATH` or `default`.
    pub origin: &'static str,
}

/// Where to look and how strictly.
#[derive(Clone, Debug, Default)]
pub struct PluginSearch {
    /// Plugin files loaded first, whatever their extension (`--plugin FILE`).
    pub files: Vec<PathBuf>,
    /// Directories in search order.
    pub dirs: Vec<SearchDir>,
    /// Load from world-writable directories and files.
    pub allow_insecure: bool,
}

impl PluginSearch {
    /// The standard search: `explicit` dirs, then `KVPLUG_PLUGIN_PATH`, then the defaults.
    pub fn standard(explicit: &[PathBuf], allow_insecure: bool) -> Self {
        let mut dirs: Vec<SearchDir> = explicit
            .iter()
            .map(|p| SearchDir {
                path: p.clone(),
                origin: "--plugins",
            })
            .collect();
        if let Some(env) = std::env::var_os(PLUGIN_PATH_ENV) {
            dirs.extend(
                std::env::split_paths(&env)
                    .filter(|p| !p.as_os_str().is_empty())
                    .map(|path| SearchDir {
                        path,
                        origin: PLUGIN_PATH_ENV,
                    }),
            );
        }
        if let Some(exe_dir) = std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
        {
            dirs.push(SearchDir {
                path: exe_dir.join("plugins"),
                origin: "default",
            });
            dirs.push(SearchDir {
                path: exe_dir,
                origin: "default",
            });
        }
        PluginSearch {
            files: Vec::new(),
            dirs,
            allow_insecure,
        }
    }

    /// This build's plugins, for a cargo example (`target/<profile>/examples/NAME`, plugins
    /// in `target/<profile>`); nothing from the environment.
    pub fn of_build() -> Self {
        let dir = std::env::current_exe()
            .ok()
            .and_then(|e| Some(e.parent()?.parent()?.to_path_buf()))
            .unwrap_or_default();
        Self::only(&[dir], false)
    }

    /// Only `dirs`, nothing from the environment or the executable's location.
    pub fn only(dirs: &[PathBuf], allow_insecure: bool) -> Self {
        PluginSearch {
            files: Vec::new(),
            dirs: dirs
                .iter()
                .map(|p| SearchDir {
                    path: p.clone(),
                    origin: "--plugins",
                })
                .collect(),
            allow_insecure,
        }
    }
}

/// Whether `path` is writable by everyone (always false off Unix).
pub fn world_writable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o002 != 0)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        false
    }
}

/// Whether `path` has the platform's dylib extension.
pub fn is_dylib(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e == std::env::consts::DLL_EXTENSION)
}
