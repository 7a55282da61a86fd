//! The policy verdict log: the packets the per-pod dispatch chains drop, or in audit mode
//! would drop, as they log them to an NFLOG group (`nft::policy::dispatch_object`), read by
//! the host and kept as recent events (`GET /v1/policies/verdicts`): which pod, which way,
//! from and to where, on which port. What Antrea's and OVN-Kubernetes' policy logging and
//! Cilium's policy verdict events answer: why does this connection fail?
//!
//! Policies with allow logging on log the connections they accept to the same group (their
//! chains' accepts go to a host chain that logs first, `nft::policy::allow_logged_object`):
//! events of their own, with the policy's id, read by `GET /v1/policies/verdicts?verdict=allow`
//! and not by `GET /v1/drops` (they are no drops).
//!
//! The service side's drops and rejects come to the same group (`nft::service_drops`: no
//! endpoints, no local endpoints, outside the source ranges, a cluster IP's unknown port, an
//! unallocated service address) and into the same events, with their reason instead of a
//! verdict (`GET /v1/drops` shows both; the verdicts endpoint only the policy's).
//!
//! The kernel bounds the cost: each dispatch chain logs at most a few packets a second, and
//! only the packets' headers are copied. The events keep the pod address; the pod's name
//! and the policies selecting it are looked up when they are read, from the model then.

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nflog::{ConfigCmd, ConfigMode, PacketNla, Timeout, ULogMessage, config_request};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use serde::{Deserialize, Serialize};

use crate::nft::policy::{Direction, PolicyLogId, PolicyVerdict, parse_allow_prefix, parse_verdict_prefix};
use crate::nft::service_drops::{self, ServiceDropReason};

/// Events kept; older ones go first.
pub const CAPACITY: usize = 1024;
/// Bytes of each logged packet copied to the host: an IPv6 header and a transport header's
/// ports fit.
const COPY_BYTES: u32 = 128;
/// How often the reading thread looks whether the host still wants it.
const POLL: Duration = Duration::from_secs(1);
/// How long the kernel holds logged packets before it sends them: its default, 1 s (or 100
/// packets), is the delay a `drops -f` reader saw.
const FLUSH_AFTER: Duration = Duration::from_millis(100);

/// One logged packet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DropEvent {
    /// When the host read it, in milliseconds since the epoch.
    pub at_unix_ms: u64,
    /// Who dropped it and why; its fields are the event's own (flattened).
    #[serde(flatten)]
    pub cause: DropCause,
    pub source: IpAddr,
    pub destination: IpAddr,
    /// `tcp`, `udp`, `sctp`, `icmp`, `icmpv6`, or the protocol number.
    pub protocol: String,
    pub source_port: Option<u16>,
    pub destination_port: Option<u16>,
}

/// Who dropped a logged packet. Untagged: a policy event has the fields
/// `GET /v1/policies/verdicts` always showed (`verdict`, `direction`, `pod_address`), a
/// service event a `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum DropCause {
    /// A pod's policy dispatch chain.
    Policy {
        verdict: PolicyVerdict,
        direction: Direction,
        /// The pod whose policies decided (the destination for ingress, the source for egress).
        pod_address: IpAddr,
    },
    /// A policy with allow logging accepted the connection. `direction`: `None` when the
    /// policy's chain serves both (the reader infers it, `PolicyController::allowed_by`).
    Allow { direction: Option<Direction>, policy_id: PolicyLogId },
    /// The service side's checks (see `nft::service_drops`).
    Service { reason: ServiceDropReason },
}

/// Why a packet was logged, in one list (`GET /v1/drops?reason=`, `wasmplane drops
/// --reason`): a policy's verdict or a service drop's reason, each by its own name
/// (`deny`, `audit`, `no-endpoints`, ...), which serde and clap both take from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    Policy(PolicyVerdict),
    Service(ServiceDropReason),
}

impl DropReason {
    pub const ALL: [DropReason; 2 + ServiceDropReason::ALL.len()] = {
        let mut all = [DropReason::Policy(PolicyVerdict::Deny); 2 + ServiceDropReason::ALL.len()];
        all[1] = DropReason::Policy(PolicyVerdict::Audit);
        let mut i = 0;
        while i < ServiceDropReason::ALL.len() {
            all[2 + i] = DropReason::Service(ServiceDropReason::ALL[i]);
            i += 1;
        }
        all
    };

    pub fn name(self) -> &'static str {
        match self {
            DropReason::Policy(verdict) => verdict.name(),
            DropReason::Service(reason) => reason.name(),
        }
    }

    pub fn from_name(name: &str) -> Option<DropReason> {
        Self::ALL.into_iter().find(|reason| reason.name() == name)
    }
}

impl Serialize for DropReason {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for DropReason {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<str>::deserialize(deserializer)?;
        DropReason::from_name(&name).ok_or_else(|| {
            let names: Vec<&str> = DropReason::ALL.iter().map(|r| r.name()).collect();
            serde::de::Error::custom(format!("unknown drop reason {name:?} (one of {})", names.join(", ")))
        })
    }
}

impl clap::ValueEnum for DropReason {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()))
    }
}

impl DropCause {
    pub fn reason(&self) -> DropReason {
        match *self {
            DropCause::Policy { verdict, .. } => DropReason::Policy(verdict),
            DropCause::Allow { .. } => DropReason::Policy(PolicyVerdict::Allow),
            DropCause::Service { reason } => DropReason::Service(reason),
        }
    }

    /// `policy` or `service`.
    pub fn kind(&self) -> &'static str {
        match self {
            DropCause::Policy { .. } | DropCause::Allow { .. } => "policy",
            DropCause::Service { .. } => "service",
        }
    }

    /// Whether the packet was dropped, or in audit mode would have been: every event but an
    /// allowed connection's.
    pub fn is_drop(&self) -> bool {
        !matches!(self, DropCause::Allow { .. })
    }
}

impl DropEvent {
    /// The verdict, direction and pod address of a policy event.
    pub fn policy(&self) -> Option<(PolicyVerdict, Direction, IpAddr)> {
        match self.cause {
            DropCause::Policy { verdict, direction, pod_address } => Some((verdict, direction, pod_address)),
            DropCause::Allow { .. } | DropCause::Service { .. } => None,
        }
    }

    /// The direction (if the prefix says it) and policy of an allowed connection's event.
    pub fn allow(&self) -> Option<(Option<Direction>, PolicyLogId)> {
        match self.cause {
            DropCause::Allow { direction, policy_id } => Some((direction, policy_id)),
            DropCause::Policy { .. } | DropCause::Service { .. } => None,
        }
    }

    /// The reason of a service event.
    pub fn service_reason(&self) -> Option<ServiceDropReason> {
        match self.cause {
            DropCause::Service { reason } => Some(reason),
            DropCause::Policy { .. } | DropCause::Allow { .. } => None,
        }
    }
}

/// The recent events and how many came, shared by the reading thread and the API.
#[derive(Debug, Default)]
pub struct PolicyVerdictLog {
    events: Mutex<VecDeque<DropEvent>>,
    denied: AtomicU64,
    audited: AtomicU64,
    allowed: AtomicU64,
    /// Service drops, by reason (in the order of `ServiceDropReason::ALL`).
    service_drops: [AtomicU64; ServiceDropReason::ALL.len()],
    /// Messages the kernel could not queue for the host (its socket buffer was full).
    lost: AtomicU64,
}

/// How many events came since the start, by verdict, and how many were lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VerdictTotals {
    pub deny: u64,
    pub audit: u64,
    /// Connections policies with allow logging accepted (no drops: `GET /v1/drops` leaves
    /// them out, see [`VerdictTotals::drops`]).
    pub allow: u64,
    pub lost: u64,
}

/// The drops among [`VerdictTotals`]: what `GET /v1/drops` counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DropTotals {
    pub deny: u64,
    pub audit: u64,
    pub lost: u64,
}

impl VerdictTotals {
    pub fn drops(self) -> DropTotals {
        DropTotals { deny: self.deny, audit: self.audit, lost: self.lost }
    }
}

impl PolicyVerdictLog {
    pub fn new() -> Arc<PolicyVerdictLog> {
        Arc::new(PolicyVerdictLog::default())
    }

    pub fn record(&self, event: DropEvent) {
        match event.cause {
            DropCause::Policy { verdict, direction, pod_address } => {
                match verdict {
                    PolicyVerdict::Deny => &self.denied,
                    PolicyVerdict::Audit => &self.audited,
                    PolicyVerdict::Allow => &self.allowed,
                }
                .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(verdict = verdict.name(), direction = direction.name(), pod = %pod_address, source = %event.source, destination = %event.destination, protocol = %event.protocol, port = ?event.destination_port, "policy verdict");
            }
            DropCause::Allow { direction, policy_id } => {
                self.allowed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(direction = direction.map(Direction::name), policy = %policy_id, source = %event.source, destination = %event.destination, protocol = %event.protocol, port = ?event.destination_port, "connection allowed by policy");
            }
            DropCause::Service { reason } => {
                self.service_drops[reason as usize].fetch_add(1, Ordering::Relaxed);
                tracing::debug!(reason = reason.name(), source = %event.source, destination = %event.destination, protocol = %event.protocol, port = ?event.destination_port, "service drop");
            }
        }
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if events.len() == CAPACITY {
            events.pop_front();
        }
        events.push_back(event);
    }

    /// The newest events first, at most `limit`, those `keep` wants.
    pub fn recent(&self, limit: usize, keep: impl Fn(&DropEvent) -> bool) -> Vec<DropEvent> {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        events.iter().rev().filter(|e| keep(e)).take(limit).cloned().collect()
    }

    pub fn totals(&self) -> VerdictTotals {
        VerdictTotals {
            deny: self.denied.load(Ordering::Relaxed),
            audit: self.audited.load(Ordering::Relaxed),
            allow: self.allowed.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
        }
    }

    /// Service drops since the start, by reason (every reason, zeros too).
    pub fn service_totals(&self) -> BTreeMap<ServiceDropReason, u64> {
        ServiceDropReason::ALL
            .into_iter()
            .map(|reason| (reason, self.service_drops[reason as usize].load(Ordering::Relaxed)))
            .collect()
    }
}

/// Why the log could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("opening the NFLOG socket: {0}")]
    Socket(#[from] std::io::Error),
    #[error(
        "binding NFLOG group {group}: {reason} (another listener, such as ulogd, may hold it: choose another --policy-log-group)"
    )]
    Bind { group: u16, reason: String },
}

/// Binds NFLOG `group` in network namespace `netns` (`None`: this process's) and records
/// every verdict the dispatch chains log there into `log`, on a thread of its own, until
/// `log` is dropped. A group another process holds (the agent this one replaces, still
/// stopping) is asked for again every [`BIND_RETRY`] until it is free: only opening the
/// socket fails here.
pub fn listen(netns: Option<&Path>, group: u16, log: Weak<PolicyVerdictLog>) -> Result<(), ListenError> {
    let socket = crate::dataplane::in_netns(netns, || {
        let mut socket = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        set_receive_timeout(&socket, POLL)?;
        Ok(socket)
    })?;
    let bound = bind(&socket, group);
    if let Err(e) = &bound {
        tracing::warn!("policy verdicts not read yet (retrying every {BIND_RETRY:?}): {e}");
    }
    std::thread::Builder::new().name("wp-policy-log".into()).spawn(move || {
        if bound.is_err() {
            loop {
                std::thread::sleep(BIND_RETRY);
                if log.strong_count() == 0 {
                    return;
                }
                if bind(&socket, group).is_ok() {
                    break;
                }
            }
        }
        tracing::info!(group, "reading the policy verdict log");
        read_events(&socket, &log);
    })?;
    Ok(())
}

/// How often a group held by another process is asked for again.
pub const BIND_RETRY: Duration = Duration::from_secs(2);

fn bind(socket: &netlink_sys::Socket, group: u16) -> Result<(), ListenError> {
    request(socket, &bind_request(group)).map_err(|reason| ListenError::Bind { group, reason })
}

/// Binds `group`, copying [`COPY_BYTES`] of each packet, sent at most [`FLUSH_AFTER`] after
/// it was logged.
fn bind_request(group: u16) -> NetlinkMessage<NetfilterMessage> {
    config_request(
        NetfilterProtoFamily::Unspec,
        group,
        vec![ConfigCmd::Bind.into(), ConfigMode::new_packet(COPY_BYTES).into(), Timeout::from(FLUSH_AFTER).into()],
    )
}

/// Sends one configuration request and reads its acknowledgement.
fn request(socket: &netlink_sys::Socket, message: &NetlinkMessage<NetfilterMessage>) -> Result<(), String> {
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    socket.send(&buf, 0).map_err(|e| e.to_string())?;
    let mut answer = vec![0u8; 4096];
    let size = socket.recv(&mut &mut answer[..], 0).map_err(|e| e.to_string())?;
    match NetlinkMessage::<NetfilterMessage>::deserialize(&answer[..size]).map_err(|e| e.to_string())?.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => Err(e.to_io().to_string()),
        _ => Ok(()),
    }
}

fn set_receive_timeout(socket: &netlink_sys::Socket, timeout: Duration) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: a valid socket and a timeval of the size given.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

fn read_events(socket: &netlink_sys::Socket, log: &Weak<PolicyVerdictLog>) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let received = socket.recv(&mut &mut buf[..], 0);
        let Some(log) = log.upgrade() else { return };
        match received {
            Ok(size) => {
                for event in events_in(&buf[..size], now_unix_ms()) {
                    log.record(event);
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
                ) => {}
            // The kernel dropped messages for us: counted, and reading goes on.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                log.lost.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!("reading the policy verdict log stopped: {e}");
                return;
            }
        }
    }
}

fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The policy verdicts and service drops in one datagram of NFLOG messages; anyone else's
/// prefixes and packets that do not parse are skipped.
pub fn events_in(mut datagram: &[u8], at_unix_ms: u64) -> Vec<DropEvent> {
    let mut out = Vec::new();
    while !datagram.is_empty() {
        let Ok(message) = NetlinkMessage::<NetfilterMessage>::deserialize(datagram) else { break };
        let length = (message.header.length as usize).next_multiple_of(4);
        if let NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::ULog(ULogMessage::Packet(nlas)),
            ..
        }) = &message.payload
        {
            let prefix =
                nlas.iter().find_map(|nla| if let PacketNla::Prefix(p) = nla { p.to_str().ok() } else { None });
            let payload =
                nlas.iter().find_map(|nla| if let PacketNla::Payload(p) = nla { Some(p.as_slice()) } else { None });
            if let (Some(cause), Some(packet)) = (prefix.and_then(parse_cause), payload.and_then(parse_ip_packet)) {
                out.push(DropEvent { at_unix_ms, cause, ..packet });
            }
        }
        if length == 0 || length >= datagram.len() {
            break;
        }
        datagram = &datagram[length..];
    }
    out
}

/// Who logged a packet, as its prefix says: a policy verdict, a policy's allow, or a
/// service drop.
fn parse_cause(prefix: &str) -> Option<DropCause> {
    if let Some((verdict, direction, pod_address)) = parse_verdict_prefix(prefix) {
        return Some(DropCause::Policy { verdict, direction, pod_address });
    }
    if let Some((direction, policy_id)) = parse_allow_prefix(prefix) {
        return Some(DropCause::Allow { direction, policy_id });
    }
    service_drops::parse_prefix(prefix).map(|reason| DropCause::Service { reason })
}

/// Addresses, protocol and ports of an IP packet's first bytes (an event with its cause
/// still to fill).
fn parse_ip_packet(packet: &[u8]) -> Option<DropEvent> {
    let (source, destination, protocol, transport): (IpAddr, IpAddr, u8, &[u8]) = match packet.first()? >> 4 {
        4 => {
            let header_len = usize::from(packet.first()? & 0x0f) * 4;
            let octets = |at: usize| -> Option<[u8; 4]> { packet.get(at..at + 4)?.try_into().ok() };
            (octets(12)?.into(), octets(16)?.into(), *packet.get(9)?, packet.get(header_len..).unwrap_or_default())
        }
        6 => {
            let octets = |at: usize| -> Option<[u8; 16]> { packet.get(at..at + 16)?.try_into().ok() };
            // Ports only right after the fixed header: extension headers are not walked.
            (octets(8)?.into(), octets(24)?.into(), *packet.get(6)?, packet.get(40..).unwrap_or_default())
        }
        _ => return None,
    };
    let (name, ports) = match protocol {
        6 => ("tcp", true),
        17 => ("udp", true),
        132 => ("sctp", true),
        1 => ("icmp", false),
        58 => ("icmpv6", false),
        _ => ("", false),
    };
    let port =
        |at: usize| ports.then(|| Some(u16::from_be_bytes(transport.get(at..at + 2)?.try_into().ok()?))).flatten();
    Some(DropEvent {
        at_unix_ms: 0,
        cause: DropCause::Policy {
            verdict: PolicyVerdict::Deny,
            direction: Direction::Ingress,
            pod_address: destination,
        },
        source,
        destination,
        protocol: if name.is_empty() { protocol.to_string() } else { name.to_string() },
        source_port: port(0),
        destination_port: port(2),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4_tcp(source: [u8; 4], destination: [u8; 4], source_port: u16, destination_port: u16) -> Vec<u8> {
        let mut packet = vec![0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0];
        packet.extend(source);
        packet.extend(destination);
        packet.extend(source_port.to_be_bytes());
        packet.extend(destination_port.to_be_bytes());
        packet.extend([0; 16]);
        packet
    }

    /// One NFLOG packet message as the kernel sends it: prefix and payload attributes.
    fn nflog_message(prefix: &str, payload: &[u8]) -> Vec<u8> {
        let nla = |ty: u16, value: &[u8]| {
            let mut out = ((4 + value.len()) as u16).to_ne_bytes().to_vec();
            out.extend(ty.to_ne_bytes());
            out.extend(value);
            out.resize(out.len().next_multiple_of(4), 0);
            out
        };
        let mut body = vec![libc::AF_INET as u8, 0, 0, 7]; // nfgenmsg: family, version, group (big endian)
        let mut prefix_bytes = prefix.as_bytes().to_vec();
        prefix_bytes.push(0);
        body.extend(nla(libc::NFULA_PREFIX as u16, &prefix_bytes));
        body.extend(nla(libc::NFULA_PAYLOAD as u16, payload));
        let mut message = ((16 + body.len()) as u32).to_ne_bytes().to_vec();
        message.extend(((libc::NFNL_SUBSYS_ULOG as u16) << 8 | libc::NFULNL_MSG_PACKET as u16).to_ne_bytes());
        message.extend([0u8; 10]); // flags, sequence, port id
        message.extend(body);
        message
    }

    #[test]
    fn verdicts_are_read_from_nflog_messages_and_foreign_ones_skipped() {
        let mut datagram = nflog_message(
            "wasmplane-policy deny ingress 10.244.1.10",
            &ipv4_tcp([10, 244, 2, 5], [10, 244, 1, 10], 40000, 8080),
        );
        datagram.extend(nflog_message("ulogd something else", &ipv4_tcp([1, 1, 1, 1], [2, 2, 2, 2], 1, 2)));
        datagram.extend(nflog_message(
            "wasmplane-policy audit egress 10.244.1.10",
            &ipv4_tcp([10, 244, 1, 10], [192, 0, 2, 1], 40001, 443),
        ));
        let events = events_in(&datagram, 5);
        assert_eq!(events.len(), 2, "{events:?}");
        let deny = &events[0];
        assert_eq!(deny.policy(), Some((PolicyVerdict::Deny, Direction::Ingress, "10.244.1.10".parse().unwrap())));
        assert_eq!((deny.source, deny.destination), ("10.244.2.5".parse().unwrap(), "10.244.1.10".parse().unwrap()));
        assert_eq!(
            (deny.protocol.as_str(), deny.source_port, deny.destination_port, deny.at_unix_ms),
            ("tcp", Some(40000), Some(8080), 5)
        );
        assert_eq!(
            (events[1].policy().map(|(v, d, _)| (v, d)), events[1].destination_port),
            (Some((PolicyVerdict::Audit, Direction::Egress)), Some(443))
        );
    }

    #[test]
    fn service_drops_are_read_with_their_reason() {
        let mut datagram = Vec::new();
        for reason in ServiceDropReason::ALL {
            datagram.extend(nflog_message(
                &service_drops::prefix(reason),
                &ipv4_tcp([10, 244, 1, 10], [10, 96, 0, 40], 40000, 80),
            ));
        }
        datagram.extend(nflog_message(
            "wasmplane-service gone-away",
            &ipv4_tcp([10, 244, 1, 10], [10, 96, 0, 40], 40000, 80),
        ));
        let events = events_in(&datagram, 9);
        let reasons: Vec<Option<ServiceDropReason>> = events.iter().map(DropEvent::service_reason).collect();
        assert_eq!(
            reasons,
            ServiceDropReason::ALL.map(Some).to_vec(),
            "each reason, an unknown one skipped: {events:?}"
        );
        let event = &events[0];
        assert_eq!(
            (event.policy(), event.source.to_string(), event.destination.to_string(), event.destination_port),
            (None, "10.244.1.10".into(), "10.96.0.40".into(), Some(80))
        );
        assert_eq!(event.cause.reason(), DropReason::Service(ServiceDropReason::NoEndpoints));
        assert_eq!(events[3].cause.reason(), DropReason::Service(ServiceDropReason::UnknownPort));

        let log = PolicyVerdictLog::new();
        events
            .into_iter()
            .chain(events_in(
                &nflog_message("wasmplane-service unknown-port", &ipv4_tcp([1, 1, 1, 1], [10, 96, 0, 40], 1, 81)),
                10,
            ))
            .for_each(|e| log.record(e));
        let totals = log.service_totals();
        assert_eq!(totals[&ServiceDropReason::UnknownPort], 2);
        assert_eq!(totals[&ServiceDropReason::Unallocated], 1);
        assert_eq!(log.totals(), VerdictTotals::default(), "not counted as policy verdicts");
        let json = serde_json::to_value(totals).unwrap();
        assert_eq!(
            json,
            serde_json::json!({ "no-endpoints": 1, "no-local-endpoints": 1, "source-range": 1, "unknown-port": 2, "unallocated": 1 })
        );
    }

    #[test]
    fn a_policy_event_has_the_fields_it_always_had_and_a_service_event_its_reason() {
        let packet = parse_ip_packet(&ipv4_tcp([10, 0, 0, 1], [10, 0, 0, 2], 1, 2)).unwrap();
        let policy = serde_json::to_value(DropEvent { at_unix_ms: 5, ..packet.clone() }).unwrap();
        let fields: std::collections::BTreeSet<&str> = policy.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            fields,
            std::collections::BTreeSet::from([
                "at_unix_ms",
                "destination",
                "destination_port",
                "direction",
                "pod_address",
                "protocol",
                "source",
                "source_port",
                "verdict"
            ]),
            "{policy}"
        );
        assert_eq!(
            (policy["verdict"].as_str(), policy["direction"].as_str(), policy["pod_address"].as_str()),
            (Some("deny"), Some("ingress"), Some("10.0.0.2"))
        );
        let service = serde_json::to_value(DropEvent {
            cause: DropCause::Service { reason: ServiceDropReason::NoLocalEndpoints },
            ..packet
        })
        .unwrap();
        assert_eq!(service["reason"], "no-local-endpoints", "{service}");
        assert!(service.get("verdict").is_none() && service.get("pod_address").is_none(), "{service}");
        for (text, reason) in [
            ("\"deny\"", DropReason::Policy(PolicyVerdict::Deny)),
            ("\"no-endpoints\"", DropReason::Service(ServiceDropReason::NoEndpoints)),
            ("\"source-range\"", DropReason::Service(ServiceDropReason::SourceRange)),
        ] {
            assert_eq!(serde_json::from_str::<DropReason>(text).unwrap(), reason);
        }
        assert!(serde_json::from_str::<DropReason>("\"dropped\"").is_err());
        // One name each, the same to serde and clap.
        let names: std::collections::BTreeSet<&str> = DropReason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), 7, "{names:?}");
        for reason in DropReason::ALL {
            assert_eq!(serde_json::to_value(reason).unwrap(), reason.name());
            assert_eq!(<DropReason as clap::ValueEnum>::from_str(reason.name(), false), Ok(reason));
        }
    }

    /// The group is bound with a flush timeout of its own: the kernel's default holds logged
    /// packets up to a second.
    #[test]
    fn the_group_is_bound_with_a_short_flush_timeout() {
        use netlink_packet_netfilter::nflog::ConfigNla;
        let NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::ULog(ULogMessage::Config(nlas)),
            ..
        }) = bind_request(1001).payload
        else {
            panic!("not an NFLOG config request");
        };
        assert!(nlas.contains(&ConfigNla::Timeout(Timeout::from(FLUSH_AFTER))), "{nlas:?}");
        assert!(FLUSH_AFTER < Duration::from_secs(1));
    }

    #[test]
    fn ipv6_and_portless_packets_parse() {
        let mut v6 = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        v6.extend("fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
        v6.extend("fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        v6.extend([0x13, 0x88, 0x00, 0x35, 0, 8, 0, 0]);
        let event = parse_ip_packet(&v6).unwrap();
        assert_eq!((event.source, event.destination), ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap()));
        assert_eq!((event.protocol.as_str(), event.source_port, event.destination_port), ("udp", Some(5000), Some(53)));
        let mut icmp = ipv4_tcp([10, 0, 0, 1], [10, 0, 0, 2], 0, 0);
        icmp[9] = 1;
        assert_eq!(
            (parse_ip_packet(&icmp).unwrap().protocol.as_str(), parse_ip_packet(&icmp).unwrap().destination_port),
            ("icmp", None)
        );
        assert_eq!(parse_ip_packet(&[0x45, 0]), None, "truncated");
    }

    #[test]
    fn the_log_keeps_the_newest_events_and_counts_all() {
        let log = PolicyVerdictLog::new();
        let event = parse_ip_packet(&ipv4_tcp([10, 0, 0, 1], [10, 0, 0, 2], 1, 2)).unwrap();
        for i in 0..CAPACITY as u64 + 5 {
            let verdict = if i % 2 == 0 { PolicyVerdict::Deny } else { PolicyVerdict::Audit };
            log.record(DropEvent {
                at_unix_ms: i,
                cause: DropCause::Policy { verdict, direction: Direction::Ingress, pod_address: event.destination },
                ..event.clone()
            });
        }
        let recent = log.recent(3, |_| true);
        assert_eq!(
            recent.iter().map(|e| e.at_unix_ms).collect::<Vec<_>>(),
            vec![CAPACITY as u64 + 4, CAPACITY as u64 + 3, CAPACITY as u64 + 2]
        );
        assert_eq!(log.recent(usize::MAX, |_| true).len(), CAPACITY);
        assert_eq!(
            log.recent(2, |e| e.cause.reason() == DropReason::Policy(PolicyVerdict::Audit))[0].at_unix_ms,
            CAPACITY as u64 + 3
        );
        assert_eq!(log.totals(), VerdictTotals { deny: 515, audit: 514, allow: 0, lost: 0 });
    }
}
