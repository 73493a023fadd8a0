//! [`Error`]: what the SDK's operations fail with.

use kvplug_core::dtype::ParseDtypeError;
use kvplug_core::files::FileError;
use kvplug_core::{CacheError, ModelError};
use kvplug_plugin_api::{AbiErrorKind, PluginError};
use kvplug_runtime::RuntimeError;

use crate::session_file::SessionFileError;

/// What an SDK operation can fail with: the variant says which layer failed, the message
/// what and where (files, fields, numbers).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime refused or failed: no such backend or kind, a model directory it cannot
    /// read, a plugin's refusal.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A cache verb refused or the plugin failed.
    #[error(transparent)]
    Plugin(#[from] PluginError),
    /// A saved K/V file cannot be read, written or used with this model.
    #[error(transparent)]
    Session(#[from] SessionFileError),
    /// A cache configuration refused before any plugin saw it.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A model's `config.json` cannot be used.
    #[error(transparent)]
    Config(#[from] ModelError),
    /// A file could not be read (the message names it).
    #[error(transparent)]
    File(#[from] FileError),
    /// An I/O failure (see [`Error::Context`] for what was being done).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// JSON that does not parse or does not fit.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A model file or its metadata cannot be used: a GGUF, safetensors shard, tokenizer or
    /// chat template.
    #[error("{0}")]
    Model(String),
    /// Tokenizing, detokenizing or rendering a chat template failed.
    #[error("{0}")]
    Text(String),
    /// A request the SDK refuses: an empty prompt, a run that does not fit the capacity, a
    /// bad name or value.
    #[error("{0}")]
    Invalid(String),
    /// Something expected is missing (a key, a field, a file's part).
    #[error("{0}")]
    Missing(String),
    /// `cause`, with what was being done when it happened (the message holds both).
    #[error("{context}: {cause}")]
    Context {
        /// What was being done.
        context: String,
        /// The failure.
        cause: Box<Error>,
    },
}

/// The SDK's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<safetensors::SafeTensorError> for Error {
    fn from(e: safetensors::SafeTensorError) -> Self {
        Error::Model(format!("safetensors: {e}"))
    }
}

impl From<ParseDtypeError> for Error {
    fn from(e: ParseDtypeError) -> Self {
        Error::Invalid(e.to_string())
    }
}

impl Error {
    /// This error, with what was being done when it happened.
    pub fn context(self, what: impl Into<String>) -> Error {
        Error::Context {
            context: what.into(),
            cause: Box::new(self),
        }
    }

    /// The plugin's error kind where a cache verb or the plugin refused (e.g.
    /// `OutOfWindow`, `Capacity`), looking through added context.
    pub fn plugin_kind(&self) -> Option<AbiErrorKind> {
        match self {
            Error::Plugin(e) => Some(e.kind),
            Error::Runtime(e) => e.plugin_kind(),
            Error::Context { cause, .. } => cause.plugin_kind(),
            _ => None,
        }
    }
}

/// Returns early with `Err(Error::$kind(format!(...)))`.
macro_rules! fail {
    ($kind:ident, $($arg:tt)+) => {
        return Err($crate::error::Error::$kind(format!($($arg)+)))
    };
}
pub(crate) use fail;

/// Adds what was being done to a failure (or names what is missing, for an `Option`).
pub trait Context<T> {
    /// With a fixed description.
    fn context(self, what: impl Into<String>) -> Result<T>;
    /// With a description made only on failure.
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: what.into(),
            cause: Box::new(e.into()),
        })
    }

    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: what(),
            cause: Box::new(e.into()),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| Error::Missing(what.into()))
    }

    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.ok_or_else(|| Error::Missing(what()))
    }
}
