//! What the runtime's operations fail with.

use kvplug_core::{CacheError, ModelError};
use kvplug_plugin_api::PluginError;

use crate::discovery::PLUGIN_PATH_ENV;
use crate::loader::Skipped;

/// What a runtime operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// No loaded backend has this id (the files that were not loaded, with their reasons,
    /// may say why).
    #[error("backend '{wanted}' is not loaded (loaded: {}){}{}", list(.loaded), skips(.skipped),
            nothing_found(.loaded, .skipped))]
    UnknownBackend {
        /// The id asked for.
        wanted: String,
        /// The ids that are loaded.
        loaded: Vec<String>,
        /// The plugin files and directories skipped when loading.
        skipped: Vec<Skipped>,
    },
    /// The backend has no builder for this kind.
    #[error("backend '{backend}' has no '{kind}' cache (it has: {})", list(.kinds))]
    UnknownKind {
        /// The backend.
        backend: String,
        /// The kind asked for.
        kind: String,
        /// The kinds it has.
        kinds: Vec<String>,
    },
    /// The cache the builder returned is not of the kind asked for.
    #[error("backend '{backend}' built a '{got}' cache when asked for '{wanted}'")]
    WrongKind {
        /// The backend.
        backend: String,
        /// Kind asked for.
        wanted: String,
        /// Kind returned.
        got: String,
    },
    /// The plugin refused or failed (its error kind says why: capacity, bad shape, ...).
    #[error(transparent)]
    Plugin(#[from] PluginError),
    /// The model directory cannot be used (a missing or malformed `config.json`, bad
    /// `kv_cache.*` metadata, an unsupported architecture).
    #[error("{}: {reason}", .path.display())]
    Model {
        /// The model directory, or the file in it at fault.
        path: std::path::PathBuf,
        /// Why.
        reason: ModelError,
    },
    /// A model file could not be read (the message names it).
    #[error(transparent)]
    File(#[from] kvplug_core::files::FileError),
    /// A cache configuration or batch the runtime refuses before calling the plugin.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

impl RuntimeError {
    /// The plugin error's kind, when the plugin refused (e.g. `OutOfWindow`, `Capacity`),
    /// so callers can react to a refusal without parsing messages.
    pub fn plugin_kind(&self) -> Option<kvplug_plugin_api::AbiErrorKind> {
        match self {
            RuntimeError::Plugin(e) => Some(e.kind),
            _ => None,
        }
    }
}

fn skips(v: &[Skipped]) -> String {
    v.iter()
        .map(|s| format!("; skipped {}: {}", s.file.display(), s.reason))
        .collect()
}

/// Where no plugin was found at all, where the search looks (a host embedding the SDK has no
/// plugins beside its own binary).
fn nothing_found(loaded: &[String], skipped: &[Skipped]) -> String {
    match loaded.is_empty() && skipped.is_empty() {
        true => format!(
            "; no plugin was found: name the directory holding them (such as kvplug's \
             target/release) in {PLUGIN_PATH_ENV}, or put them beside the program or in its \
             plugins/ directory"
        ),
        false => String::new(),
    }
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}
