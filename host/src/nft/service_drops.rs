//! The service side's drops and rejects, logged as the policy verdicts are
//! ([`super::policy::VerdictLog`]): to the same NFLOG group, rate-limited, by a rule of its
//! own before each verdict of the skeleton, whose prefix says why
//! (`wasmplane-service <reason>`). They are what a user meets first when a connection to a
//! service fails (Cilium's "Service backend not found" drops); the host reads them with the
//! policy verdicts (`policy_log`) and names the service when they are read.
//!
//! The skeleton's rules are shared by every service: each log rule's rate is the node's,
//! not a service's, which bounds what a flood costs the host.

use serde::{Deserialize, Serialize};
use wasmplane_model::format_compact;

use super::policy::VerdictLog;
use super::{MapKind, ObjectRules, SERVICE_MAPS};

/// First word of a service drop's log prefix: `wasmplane-service <reason>`.
pub const LOG_PREFIX: &str = "wasmplane-service";

/// Where a no-endpoint map's `drop` goes when service drops are logged: an element's verdict
/// cannot log, a chain can (`reject-chain` does the same for reject).
pub const DROP_CHAIN: &str = "drop-chain";

/// Why the service side dropped or rejected a new connection.
/// Spelt by [`ServiceDropReason::name`] in the log prefix, the API and the CLI alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
pub enum ServiceDropReason {
    /// Rejected: the service has no usable endpoint (`reject-chain`).
    NoEndpoints,
    /// Dropped: a traffic policy `Local` finds no endpoint on this node (a no-endpoint map's
    /// `drop`).
    NoLocalEndpoints,
    /// Dropped: a load balancer address reached from outside `loadBalancerSourceRanges`.
    SourceRange,
    /// Rejected: a cluster IP on a port none of its services has.
    UnknownPort,
    /// Dropped: an address of a service CIDR that is no service's.
    Unallocated,
}

impl ServiceDropReason {
    pub const ALL: [ServiceDropReason; 5] =
        [Self::NoEndpoints, Self::NoLocalEndpoints, Self::SourceRange, Self::UnknownPort, Self::Unallocated];

    pub fn name(self) -> &'static str {
        match self {
            Self::NoEndpoints => "no-endpoints",
            Self::NoLocalEndpoints => "no-local-endpoints",
            Self::SourceRange => "source-range",
            Self::UnknownPort => "unknown-port",
            Self::Unallocated => "unallocated",
        }
    }

    pub fn from_name(name: &str) -> Option<ServiceDropReason> {
        Self::ALL.into_iter().find(|reason| reason.name() == name)
    }
}

impl From<ServiceDropReason> for &'static str {
    fn from(reason: ServiceDropReason) -> &'static str {
        reason.name()
    }
}

impl TryFrom<String> for ServiceDropReason {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        Self::from_name(&name).ok_or_else(|| format!("unknown service drop reason {name:?}"))
    }
}

/// The prefix a drop for `reason` is logged with; [`parse_prefix`] reads it back.
pub fn prefix(reason: ServiceDropReason) -> String {
    format!("{LOG_PREFIX} {}", reason.name())
}

/// The reason a logged packet's prefix gives; `None` for anyone else's prefix.
pub fn parse_prefix(prefix: &str) -> Option<ServiceDropReason> {
    let (first, reason) = prefix.split_once(' ')?;
    if first != LOG_PREFIX {
        return None;
    }
    ServiceDropReason::from_name(reason)
}

/// The statements that log a drop for `reason` (the rule's matches go before them). A rule
/// of its own before the verdict: above the rate, `limit` ends this rule only, and the
/// verdict still follows.
pub fn log_statements(reason: ServiceDropReason, log: VerdictLog) -> String {
    format!("limit rate {}/second burst {} packets log group {} prefix \"{}\"", log.per_second, log.burst, log.group, prefix(reason))
}

/// The static chain that logs and drops what the no-endpoint maps drop (declared by the
/// skeleton when service drops are logged).
pub(super) fn write_drop_chain(out: &mut String, t: super::Table, log: VerdictLog) {
    use std::fmt::Write as _;
    writeln!(out, "add chain {t} {DROP_CHAIN}").unwrap();
    writeln!(out, "flush chain {t} {DROP_CHAIN}").unwrap();
    writeln!(out, "add rule {t} {DROP_CHAIN} {}", log_statements(ServiceDropReason::NoLocalEndpoints, log)).unwrap();
    writeln!(out, "add rule {t} {DROP_CHAIN} drop").unwrap();
}

/// Sends a service's no-endpoint drops through [`DROP_CHAIN`], for a dataplane that logs
/// service drops. Only the no-endpoint maps hold a plain `drop`; their rejects already go to
/// `reject-chain`.
pub fn route_drops_through_log(rules: &mut ObjectRules) {
    let terminal = |map: &str| SERVICE_MAPS.iter().any(|m| m.kind == MapKind::Terminal && (m.name == map || m.v6_name == Some(map)));
    for ((map, _), verdict) in rules.elements.iter_mut() {
        if verdict == "drop" && terminal(map) {
            *verdict = format_compact!("goto {DROP_CHAIN}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_is_logged_with_a_prefix_that_reads_back() {
        for reason in ServiceDropReason::ALL {
            let prefix = prefix(reason);
            assert_eq!(parse_prefix(&prefix), Some(reason), "{prefix}");
            assert_eq!(serde_json::to_value(reason).unwrap(), serde_json::json!(reason.name()));
            assert_eq!(serde_json::from_value::<ServiceDropReason>(serde_json::json!(reason.name())).unwrap(), reason);
        }
        assert_eq!(prefix(ServiceDropReason::NoEndpoints), "wasmplane-service no-endpoints");
        assert_eq!(parse_prefix("wasmplane-service no-local-endpoints"), Some(ServiceDropReason::NoLocalEndpoints));
        assert_eq!(parse_prefix("wasmplane-service source-range"), Some(ServiceDropReason::SourceRange));
        assert_eq!(parse_prefix("wasmplane-service unknown-port"), Some(ServiceDropReason::UnknownPort));
        assert_eq!(parse_prefix("wasmplane-service unallocated"), Some(ServiceDropReason::Unallocated));
        for foreign in ["wasmplane-service", "wasmplane-service gone", "wasmplane-service no-endpoints extra", "wasmplane-policy deny ingress 10.0.0.1", "ulogd x"] {
            assert_eq!(parse_prefix(foreign), None, "{foreign}");
        }
        // Fits the kernel's prefix (NF_LOG_PREFIXLEN, 128 with its NUL).
        assert!(ServiceDropReason::ALL.iter().all(|r| prefix(*r).len() < 128));
    }

    #[test]
    fn only_the_no_endpoint_maps_drops_go_through_the_drop_chain() {
        let mut rules = ObjectRules::default();
        for (map, key, verdict) in [
            ("no-endpoint-services", "203.0.113.5 . tcp . 80", "drop"),
            ("no-endpoint-services6", "2001:db8::5 . tcp . 80", "drop"),
            ("no-endpoint-nodeports", "tcp . 30080", "drop"),
            ("no-endpoint-services", "10.96.0.5 . tcp . 80", "goto reject-chain"),
            ("service-ips", "10.96.0.6 . tcp . 80", "goto svc/ns/a"),
            ("cluster-ips", "10.96.0.5", ""),
        ] {
            rules.elements.insert((map.into(), key.into()), verdict.into());
        }
        route_drops_through_log(&mut rules);
        let verdicts: Vec<&str> = rules.elements.values().map(|v| v.as_str()).collect();
        assert_eq!(verdicts, vec!["", "goto drop-chain", "goto reject-chain", "goto drop-chain", "goto drop-chain", "goto svc/ns/a"], "{rules:?}");
    }
}
