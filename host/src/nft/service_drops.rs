//! The service side's drops and rejects, logged as the policy verdicts are
//! ([`super::policy::VerdictLog`]): to the same NFLOG group, rate-limited, by a rule of its
//! own before each verdict of the skeleton, whose prefix says why
//! (`wasmplane-service <reason>`). They are what a user meets first when a connection to a
//! service fails (Cilium's "Service backend not found" drops); the host reads them with the
//! policy verdicts (`policy_log`) and names the service when they are read.
//!
//! The skeleton's rules are shared by every service, so each log rule meters its packets
//! per frontend (destination address, protocol and port, remembered for a minute in a
//! dynamic set of the main table): a frontend flooded with connections it drops logs at
//! most the log's rate, and another frontend's drops are still logged beside it. A second,
//! node-wide limit per rule ([`NODE_RATE_FACTOR`] times that) bounds what a flood across
//! many frontends (a scan of the service CIDR) costs the host.

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

/// The dynamic sets metering each frontend's logged drops (see the module doc): declared by
/// the skeleton whether or not drops are logged, so that none is left behind when logging
/// is turned off. Their size bounds the kernel memory a scan costs; a frontend that finds
/// its set full is not logged (the node-wide limit would soon stop it anyway).
pub const METER_SETS: [(&str, &str); 2] = [
    ("service-drop-log", "ipv4_addr . inet_proto . inet_service; flags dynamic,timeout; timeout 60s; size 4096"),
    ("service-drop-log6", "ipv6_addr . inet_proto . inet_service; flags dynamic,timeout; timeout 60s; size 4096"),
];

/// How many times one frontend's rate each log rule passes on for the whole node.
pub const NODE_RATE_FACTOR: u32 = super::policy::METERED_RULE_FACTOR;

/// The rules that log a drop for `reason`, each `matches` and then the metered log
/// statements: one rule per address family `matches` leaves open (a family's meter key
/// matches only that family's packets). Rules of their own before the verdict: above a
/// rate, the limit ends this rule only, and the verdict still follows.
///
/// `matches` is a skeleton constant: empty (both families), or starting with `ip ` or
/// `ip6 `.
pub fn log_rules(matches: &str, reason: ServiceDropReason, log: VerdictLog) -> Vec<String> {
    let families: &[(&str, &str)] = match matches.split_once(' ').map(|(first, _)| first) {
        _ if matches.is_empty() => &[("ip", METER_SETS[0].0), ("ip6", METER_SETS[1].0)],
        Some("ip") => &[("ip", METER_SETS[0].0)],
        Some("ip6") => &[("ip6", METER_SETS[1].0)],
        _ => panic!("service drop log rule {matches:?}: its family is not told by its first match"),
    };
    let separator = if matches.is_empty() { "" } else { " " };
    families
        .iter()
        .map(|(family, set)| {
            format!(
                "{matches}{separator}{}",
                log.metered_log(set, &format!("{family} daddr . meta l4proto . th dport"), &prefix(reason))
            )
        })
        .collect()
}

/// The static chain that logs and drops what the no-endpoint maps drop (declared by the
/// skeleton when service drops are logged).
pub(super) fn write_drop_chain(out: &mut String, t: super::Table, log: VerdictLog) {
    use std::fmt::Write as _;
    writeln!(out, "add chain {t} {DROP_CHAIN}").unwrap();
    writeln!(out, "flush chain {t} {DROP_CHAIN}").unwrap();
    for rule in log_rules("", ServiceDropReason::NoLocalEndpoints, log) {
        writeln!(out, "add rule {t} {DROP_CHAIN} {rule}").unwrap();
    }
    writeln!(out, "add rule {t} {DROP_CHAIN} drop").unwrap();
}

/// Sends a service's no-endpoint drops through [`DROP_CHAIN`], for a dataplane that logs
/// service drops. Only the no-endpoint maps hold a plain `drop`; their rejects already go to
/// `reject-chain`.
pub fn route_drops_through_log(rules: &mut ObjectRules) {
    let terminal = |map: &str| {
        SERVICE_MAPS.iter().any(|m| m.kind == MapKind::Terminal && (m.name == map || m.v6_name == Some(map)))
    };
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
        for foreign in [
            "wasmplane-service",
            "wasmplane-service gone",
            "wasmplane-service no-endpoints extra",
            "wasmplane-policy deny ingress 10.0.0.1",
            "ulogd x",
        ] {
            assert_eq!(parse_prefix(foreign), None, "{foreign}");
        }
        // Fits the kernel's prefix (NF_LOG_PREFIXLEN, 128 with its NUL).
        assert!(ServiceDropReason::ALL.iter().all(|r| prefix(*r).len() < 128));
    }

    #[test]
    fn each_log_rule_meters_by_frontend_in_the_families_its_matches_leave_open() {
        let log = VerdictLog::new(7).with_rate(5);
        let metered = |family: &str, set: &str| {
            format!(
                "update @{set} {{ {family} daddr . meta l4proto . th dport limit rate 5/second burst 10 packets }} limit rate 50/second burst 100 packets log group 7 prefix \"wasmplane-service unknown-port\""
            )
        };
        let reason = ServiceDropReason::UnknownPort;
        assert_eq!(
            log_rules("", reason, log),
            vec![metered("ip", "service-drop-log"), metered("ip6", "service-drop-log6")]
        );
        assert_eq!(
            log_rules("ip daddr @cluster-ips", reason, log),
            vec![format!("ip daddr @cluster-ips {}", metered("ip", "service-drop-log"))]
        );
        assert_eq!(
            log_rules("ip6 daddr @cluster-ips6", reason, log),
            vec![format!("ip6 daddr @cluster-ips6 {}", metered("ip6", "service-drop-log6"))]
        );
        // The sets the rules name are the ones the skeleton declares.
        assert_eq!(METER_SETS.map(|(name, _)| name), ["service-drop-log", "service-drop-log6"]);
        assert!(METER_SETS.iter().all(|(_, declaration)| declaration.contains("flags dynamic,timeout")));
    }

    #[test]
    #[should_panic(expected = "its family is not told")]
    fn a_log_rule_whose_family_is_not_its_first_match_is_refused() {
        log_rules("meta l4proto udp", ServiceDropReason::NoEndpoints, VerdictLog::new(7));
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
        assert_eq!(
            verdicts,
            vec!["", "goto drop-chain", "goto reject-chain", "goto drop-chain", "goto drop-chain", "goto svc/ns/a"],
            "{rules:?}"
        );
    }
}
