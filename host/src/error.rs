//! Host errors.

use kvplug_plugin_api::PluginError;

/// What a host operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// No loaded backend has this id.
    #[error("backend '{wanted}' is not loaded (loaded: {})", list(.loaded))]
    UnknownBackend {
        /// The id asked for.
        wanted: String,
        /// The ids that are loaded.
        loaded: Vec<String>,
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
    /// The plugin refused or failed.
    #[error(transparent)]
    Plugin(#[from] PluginError),
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}
