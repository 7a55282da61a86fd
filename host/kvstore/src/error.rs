//! The one error type every backend speaks.
//!
//! Callers branch on the kind of failure (retry on [`KvError::Unavailable`], relist
//! on [`KvError::Compacted`], re-read on [`KvError::Conflict`], re-grant on
//! [`KvError::LeaseNotFound`]), so backends translate their own errors into these
//! variants instead of passing strings through.

use crate::{LeaseId, Revision};

/// Result alias used across the crate.
pub type Result<T, E = KvError> = std::result::Result<T, E>;

/// Why a kvstore operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The store cannot be reached right now (connection refused, timeout, no
    /// leader). The operation may or may not have been applied; retrying is safe
    /// for idempotent writes and for every transaction in this crate.
    #[error("kvstore unavailable: {0}")]
    Unavailable(String),

    /// The requested revision is older than the oldest one the store retains.
    /// The caller must relist and continue from the listing's revision.
    #[error("revision compacted: history starts after revision {compact_revision}")]
    Compacted {
        /// Revision the store has compacted up to (0 when the server did not say).
        compact_revision: Revision,
    },

    /// A transaction's comparison failed: the key's modification revision was
    /// not the expected one (0 means absent).
    #[error("conflict on {key:?}: current modification revision is {current_revision}")]
    Conflict {
        key: String,
        /// The key's current modification revision, 0 when the key does not exist.
        current_revision: Revision,
    },

    /// The lease expired, was revoked or never existed.
    #[error("lease {0:#x} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),

    /// The request exceeds the store's size limit (etcd's `--max-request-bytes`,
    /// 1.5 MiB by default; the embedded backend enforces the same limit so code
    /// that works on one works on the other). Large values go through the blob
    /// helpers, which chunk them.
    #[error("request too large: {size} bytes (limit {limit} bytes)")]
    TooLarge {
        size: usize,
        /// The limit in bytes, 0 when the server did not say.
        limit: usize,
    },

    /// The caller passed something the store cannot do (e.g. a future revision).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A key that must exist (e.g. a blob manifest) does not.
    #[error("key not found: {0:?}")]
    NotFound(String),

    /// Stored data is inconsistent (e.g. a blob whose digest does not match).
    #[error("corrupt data at {key:?}: {reason}")]
    Corrupt { key: String, reason: String },

    /// The local database failed (embedded backend: disk full, I/O error).
    #[error("storage error: {0}")]
    Storage(String),

    /// The store (or the object using it) has been shut down.
    #[error("kvstore closed")]
    Closed,

    /// Anything else the backend reported; not expected to go away by retrying.
    #[error("kvstore backend error: {0}")]
    Backend(String),
}

impl KvError {
    /// Whether retrying the same call later can succeed without the caller
    /// changing anything.
    pub fn is_retryable(&self) -> bool {
        matches!(self, KvError::Unavailable(_))
    }
}
