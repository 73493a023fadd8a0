//! The error type that crosses the ABI.

use abi_stable::std_types::{RResult, RString};
use abi_stable::StableAbi;
use kvplug_core::{CacheError, ErrorKind};

/// Classification of a [`PluginError`]: the cache error kinds plus failures that only exist
/// across a plugin boundary.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AbiErrorKind {
    /// See [`ErrorKind::Capacity`].
    Capacity,
    /// See [`ErrorKind::BadPosition`].
    BadPosition,
    /// See [`ErrorKind::UnknownSeq`].
    UnknownSeq,
    /// See [`ErrorKind::BadSeqId`].
    BadSeqId,
    /// See [`ErrorKind::BadTree`].
    BadTree,
    /// See [`ErrorKind::BadShape`].
    BadShape,
    /// See [`ErrorKind::BadConfig`].
    BadConfig,
    /// See [`ErrorKind::NotSupported`].
    NotSupported,
    /// See [`ErrorKind::OutOfWindow`].
    OutOfWindow,
    /// A lookup (cache key, method, backend) found nothing.
    NotFound,
    /// The device or its runtime failed.
    Backend,
    /// The plugin panicked; the panic was caught at the boundary.
    Panic,
}

impl AbiErrorKind {
    /// The cache error kind, when this is one.
    pub fn cache_kind(self) -> Option<ErrorKind> {
        Some(match self {
            AbiErrorKind::Capacity => ErrorKind::Capacity,
            AbiErrorKind::BadPosition => ErrorKind::BadPosition,
            AbiErrorKind::UnknownSeq => ErrorKind::UnknownSeq,
            AbiErrorKind::BadSeqId => ErrorKind::BadSeqId,
            AbiErrorKind::BadTree => ErrorKind::BadTree,
            AbiErrorKind::BadShape => ErrorKind::BadShape,
            AbiErrorKind::BadConfig => ErrorKind::BadConfig,
            AbiErrorKind::NotSupported => ErrorKind::NotSupported,
            AbiErrorKind::OutOfWindow => ErrorKind::OutOfWindow,
            AbiErrorKind::NotFound | AbiErrorKind::Backend | AbiErrorKind::Panic => return None,
        })
    }

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self.cache_kind() {
            Some(k) => k.as_str(),
            None => match self {
                AbiErrorKind::NotFound => "not_found",
                AbiErrorKind::Backend => "backend",
                _ => "panic",
            },
        }
    }
}

impl From<ErrorKind> for AbiErrorKind {
    fn from(k: ErrorKind) -> Self {
        match k {
            ErrorKind::Capacity => AbiErrorKind::Capacity,
            ErrorKind::BadPosition => AbiErrorKind::BadPosition,
            ErrorKind::UnknownSeq => AbiErrorKind::UnknownSeq,
            ErrorKind::BadSeqId => AbiErrorKind::BadSeqId,
            ErrorKind::BadTree => AbiErrorKind::BadTree,
            ErrorKind::BadShape => AbiErrorKind::BadShape,
            ErrorKind::BadConfig => AbiErrorKind::BadConfig,
            ErrorKind::NotSupported => AbiErrorKind::NotSupported,
            ErrorKind::OutOfWindow => AbiErrorKind::OutOfWindow,
        }
    }
}

/// An error returned by a plugin.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct PluginError {
    /// Classification.
    pub kind: AbiErrorKind,
    /// What went wrong, naming the offending value.
    pub message: RString,
}

impl PluginError {
    /// An error of `kind`.
    pub fn new(kind: AbiErrorKind, message: impl Into<String>) -> Self {
        PluginError {
            kind,
            message: RString::from(message.into()),
        }
    }
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl std::error::Error for PluginError {}

impl From<CacheError> for PluginError {
    fn from(e: CacheError) -> Self {
        PluginError {
            kind: e.kind.into(),
            message: e.message.into(),
        }
    }
}

/// Result type of every fallible ABI call.
pub type PluginResult<T> = RResult<T, PluginError>;
