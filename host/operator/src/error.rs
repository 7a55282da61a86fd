//! The crate's error type: callers branch on what failed (the API server, the
//! kvstore, the kernel, or their own configuration).

use std::path::PathBuf;

use wasmplane_kvstore::KvError;

/// Why an operator or agent duty failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("kubernetes API: {what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },

    /// A kvstore call failed.
    #[error("kvstore: {what}: {source}")]
    Kv {
        what: String,
        #[source]
        source: KvError,
    },

    /// A stored value does not decode.
    #[error("malformed value at {key:?}: {reason}")]
    Malformed { key: String, reason: String },

    /// The caller's configuration cannot work.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// A netlink request failed.
    #[error("netlink: {what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: rtnetlink::Error,
    },

    /// A network namespace could not be entered.
    #[error("network namespace {path}: {reason}")]
    Netns { path: PathBuf, reason: String },

    /// No node ID could be allocated (the ID space is exhausted or the store
    /// kept changing under us).
    #[error("node ID allocation for {node:?} failed: {reason}")]
    NodeIdAllocation { node: String, reason: String },

    /// The GC decider (guest) gave no answer; nothing was deleted.
    #[error("GC decider: {0}")]
    Gc(String),

    /// A background worker ended unexpectedly.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn kube(what: impl Into<String>, source: kube::Error) -> Self {
        Error::Kube { what: what.into(), source }
    }

    pub(crate) fn kv(what: impl Into<String>, source: KvError) -> Self {
        Error::Kv { what: what.into(), source }
    }

    pub(crate) fn netlink(what: impl Into<String>, source: rtnetlink::Error) -> Self {
        Error::Netlink { what: what.into(), source }
    }
}

/// The HTTP status code of a failed API call, if the server answered.
pub(crate) fn api_status(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}
