//! Typed errors of the daemon and their CNI error codes.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The CNI spec's well-known error codes, and ours (100 and up).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: ADD cannot be served now (spec 1.1.0).
    pub const NOT_AVAILABLE: u32 = 50;
    /// Writing or reading the daemon's state (allocations, chained attachments) failed.
    pub const STATE: u32 = 100;
    /// No free address left in the node's pod CIDR.
    pub const POOL_EXHAUSTED: u32 = 101;
    /// The pod's network namespace cannot be opened or entered.
    pub const NETNS: u32 = 102;
    /// The kernel refused a netlink request.
    pub const NETLINK: u32 = 103;
    /// The interface name is taken in the pod's namespace by something that is not ours.
    pub const INTERFACE_EXISTS: u32 = 104;
    /// CHECK found the pod's network not as ADD left it.
    pub const CHECK_FAILED: u32 = 105;
    /// CHECK for a container the daemon never added (or already deleted).
    pub const UNKNOWN_CONTAINER: u32 = 106;
    /// GC released what it could; some stale attachments are left.
    pub const GC_INCOMPLETE: u32 = 107;
    /// The daemon could not be reached or answered something unreadable (plugin side).
    pub const DAEMON_UNREACHABLE: u32 = 110;
    pub const INTERNAL: u32 = 199;
}

/// Everything that can go wrong in the daemon.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("incompatible CNI version {0:?}; this plugin supports {supported:?}", supported = crate::SUPPORTED_VERSIONS)]
    IncompatibleVersion(String),
    #[error("invalid or missing CNI environment: {0}")]
    InvalidEnv(String),
    #[error("cannot decode the request: {0}")]
    Decode(String),
    #[error("invalid network configuration: {0}")]
    InvalidConfig(String),
    #[error("pod MTU {mtu} is out of range: {reason}")]
    InvalidMtu { mtu: u32, reason: String },
    #[error(
        "wasmplane runs chained (--cni-chained) and must come after the plugin that gives pods their addresses in the conflist's plugins: {0}"
    )]
    NoPreviousAddresses(String),
    #[error("pod {namespace}/{name} is not yet in wasmplane's watch cache (waited {waited:?}); try again later")]
    PodNotInCache { namespace: String, name: String, waited: Duration },
    #[error("CNI daemon state in {path}: {source}")]
    State { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("CNI daemon state in {path} is corrupt: {reason}")]
    CorruptState { path: PathBuf, reason: String },
    #[error("no free address left in the node's pod CIDR {cidr} ({allocated} allocated)")]
    PoolExhausted { cidr: ipnet::IpNet, allocated: usize },
    #[error("network namespace {path}: {reason}")]
    Netns { path: PathBuf, reason: String },
    #[error("kernel refused {what}: {source}")]
    Netlink { what: String, source: rtnetlink::Error },
    #[error(
        "interface {if_name} already exists in network namespace {netns} and was not created by wasmplane for this container"
    )]
    InterfaceExists { if_name: String, netns: String },
    #[error("check failed: {0}")]
    CheckFailed(String),
    #[error(
        "container {container_id} interface {if_name} has no wasmplane allocation (never added, or already deleted)"
    )]
    UnknownContainer { container_id: String, if_name: String },
    #[error("cannot add pods now: {0}")]
    NotAvailable(String),
    #[error("{0}")]
    GcIncomplete(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// The CNI error code the runtime sees.
    pub fn code(&self) -> u32 {
        match self {
            Error::IncompatibleVersion(_) => code::INCOMPATIBLE_VERSION,
            Error::InvalidEnv(_) => code::INVALID_ENV,
            Error::Decode(_) => code::DECODE,
            Error::InvalidConfig(_) | Error::InvalidMtu { .. } | Error::NoPreviousAddresses(_) => code::INVALID_CONFIG,
            Error::PodNotInCache { .. } => code::TRY_AGAIN_LATER,
            Error::State { .. } | Error::CorruptState { .. } => code::STATE,
            Error::PoolExhausted { .. } => code::POOL_EXHAUSTED,
            Error::Netns { .. } => code::NETNS,
            Error::Netlink { .. } => code::NETLINK,
            Error::InterfaceExists { .. } => code::INTERFACE_EXISTS,
            Error::CheckFailed(_) => code::CHECK_FAILED,
            Error::UnknownContainer { .. } => code::UNKNOWN_CONTAINER,
            Error::NotAvailable(_) => code::NOT_AVAILABLE,
            Error::GcIncomplete(_) => code::GC_INCOMPLETE,
            Error::Io { .. } | Error::Internal(_) => code::INTERNAL,
        }
    }

    /// A short, stable summary for `msg` (the full text goes to `details`).
    fn summary(&self) -> &'static str {
        match self {
            Error::IncompatibleVersion(_) => "incompatible CNI version",
            Error::InvalidEnv(_) => "invalid CNI environment variables",
            Error::Decode(_) => "failed to decode request",
            Error::InvalidConfig(_) => "invalid network configuration",
            Error::InvalidMtu { .. } => "invalid pod MTU",
            Error::NoPreviousAddresses(_) => "wasmplane is chained but no earlier plugin gave the pod addresses",
            Error::PodNotInCache { .. } => "pod not yet known to wasmplane, try again later",
            Error::State { .. } | Error::CorruptState { .. } => "wasmplane CNI state unavailable",
            Error::PoolExhausted { .. } => "no free pod IP on this node",
            Error::Netns { .. } => "pod network namespace unusable",
            Error::Netlink { .. } => "kernel refused a network change",
            Error::InterfaceExists { .. } => "interface already exists in pod",
            Error::CheckFailed(_) => "pod network check failed",
            Error::UnknownContainer { .. } => "container not known to wasmplane",
            Error::NotAvailable(_) => "wasmplane cannot add pods on this node now",
            Error::GcIncomplete(_) => "some stale pod networks could not be released",
            Error::Io { .. } | Error::Internal(_) => "wasmplane CNI internal error",
        }
    }

    /// The spec's error object, in the configuration's CNI version.
    pub fn to_cni(&self, cni_version: &str) -> CniErrorReply {
        CniErrorReply {
            cni_version: cni_version.to_string(),
            code: self.code(),
            msg: format!("wasmplane: {}", self.summary()),
            details: self.to_string(),
        }
    }

    pub(crate) fn netlink(what: impl Into<String>, source: rtnetlink::Error) -> Error {
        Error::Netlink { what: what.into(), source }
    }
}

/// `{"cniVersion","code","msg","details"}` as the spec defines it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniErrorReply {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub code: u32,
    pub msg: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}
