//! Typed errors shared by every cache kind and every backend.
//!
//! Every verb validates before it mutates: when one of these is returned, the cache is
//! exactly as it was before the call.

use std::fmt;

/// The stable classification of a [`CacheError`]; it crosses the plugin ABI and is what
/// conformance scenarios name in `expect_error`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Not enough free cells (or positions beyond the logical capacity).
    Capacity,
    /// A position that is negative, leaves a hole, or is not contiguous where it must be.
    BadPosition,
    /// A sequence id in range that holds no cells where one is required.
    UnknownSeq,
    /// A sequence id outside `0..MAX_SEQS`.
    BadSeqId,
    /// A malformed tree: forward-referencing parents, or an accepted chain that is not a
    /// root-first ancestor chain.
    BadTree,
    /// Tensor shapes or token counts that do not agree.
    BadShape,
    /// A configuration that cannot be built.
    BadConfig,
    /// The verb does not exist for this cache kind.
    NotSupported,
    /// A rollback (rewind, `seq_rm`, a rewriting step) or a share (`seq_cp`, a prefix
    /// attach) would leave a sequence's next query needing rows its sliding-window layers
    /// have already dropped, or a recurrent state its recurrent layers do not keep there;
    /// the message says where it can resume.
    OutOfWindow,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 9] = [
        ErrorKind::Capacity,
        ErrorKind::BadPosition,
        ErrorKind::UnknownSeq,
        ErrorKind::BadSeqId,
        ErrorKind::BadTree,
        ErrorKind::BadShape,
        ErrorKind::BadConfig,
        ErrorKind::NotSupported,
        ErrorKind::OutOfWindow,
    ];

    /// The snake_case name used in scenario files and error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Capacity => "capacity",
            ErrorKind::BadPosition => "bad_position",
            ErrorKind::UnknownSeq => "unknown_seq",
            ErrorKind::BadSeqId => "bad_seq_id",
            ErrorKind::BadTree => "bad_tree",
            ErrorKind::BadShape => "bad_shape",
            ErrorKind::BadConfig => "bad_config",
            ErrorKind::NotSupported => "not_supported",
            ErrorKind::OutOfWindow => "out_of_window",
        }
    }

    /// Inverse of [`ErrorKind::as_str`].
    pub fn parse(s: &str) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A cache verb or op was refused. The message says what was wrong with the input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct CacheError {
    /// Stable classification.
    pub kind: ErrorKind,
    /// Human-readable detail naming the offending value.
    pub message: String,
}

impl CacheError {
    /// Builds an error of `kind` with a message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        CacheError {
            kind,
            message: message.into(),
        }
    }

    /// Shorthand for [`ErrorKind::Capacity`].
    pub fn capacity(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Capacity, message)
    }
    /// Shorthand for [`ErrorKind::BadPosition`].
    pub fn bad_position(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadPosition, message)
    }
    /// Shorthand for [`ErrorKind::UnknownSeq`].
    pub fn unknown_seq(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::UnknownSeq, message)
    }
    /// Shorthand for [`ErrorKind::BadSeqId`].
    pub fn bad_seq_id(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadSeqId, message)
    }
    /// Shorthand for [`ErrorKind::BadTree`].
    pub fn bad_tree(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadTree, message)
    }
    /// Shorthand for [`ErrorKind::BadShape`].
    pub fn bad_shape(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadShape, message)
    }
    /// Shorthand for [`ErrorKind::BadConfig`].
    pub fn bad_config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::BadConfig, message)
    }
    /// Shorthand for [`ErrorKind::OutOfWindow`].
    pub fn out_of_window(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::OutOfWindow, message)
    }

    /// Shorthand for [`ErrorKind::NotSupported`].
    pub fn not_supported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotSupported, message)
    }
}

/// Result alias for cache verbs.
pub type CacheResult<T> = Result<T, CacheError>;
