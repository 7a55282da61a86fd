//! A prototype of a zero-copy boundary (feature `bench-flat`, never shipped): the runtime
//! bench's measure of the "WIT 2.0" that BENCHMARKS.md estimates, to confirm or refute the
//! estimate before anyone changes how guests are written.
//!
//! The inputs cross as one rkyv archive that the guest reads in place (strings are views,
//! addresses are integers); the result is built from values without a string in them (map
//! names are numbers, addresses integers, keys fixed arrays) and crosses as one archive that
//! the host validates (bytecheck) and then reads in place. Native code runs the same
//! [`translate`] on the same archive, so the two sides differ only by the boundary.
//!
//! It covers every path of [`crate::translate`]: load balancing as data, the common case (every
//! service of the bench's cluster), and the ports that need chains of their own
//! (externalTrafficPolicy Local with external addresses, more than 32 backends), whose chains
//! and affinity sets are named by numbers too (a port's index and role, a backend's address
//! and port) and whose rules hold their matches and statements inline. The bench and the unit
//! tests check every ruleset against the typed translator's.

use std::collections::BTreeSet;
use std::net::IpAddr;

use rkyv::with::{InlineAsBox, Map};
use rkyv::{Archive, Deserialize, Serialize};
use wasmplane_sdk::builders::protocol_name;
use wasmplane_sdk::types as sdk;

use crate::MAX_AFFINITY_TIMEOUT_SECONDS;
use crate::MAX_BACKENDS_PER_FRONTEND;

/// One call's inputs: what `translate` of the service-translation world gets, with every
/// string borrowed from the host's model while it is archived.
#[derive(Archive, Serialize)]
pub struct Inputs<'a> {
    pub node: NodeContext<'a>,
    #[rkyv(with = InlineAsBox)]
    pub chain_prefix: &'a str,
    pub service: Service<'a>,
    pub slices: Vec<Slice<'a>>,
}

#[derive(Archive, Serialize)]
pub struct NodeContext<'a> {
    #[rkyv(with = InlineAsBox)]
    pub node_name: &'a str,
    pub node_ips: Vec<IpAddr>,
    pub cluster_cidrs: Vec<Net>,
    pub pod_cidrs: Vec<Net>,
}

#[derive(Archive, Serialize)]
pub struct Net {
    pub address: IpAddr,
    pub prefix_len: u8,
}

#[derive(Archive, Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
    ExternalName,
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl ArchivedProtocol {
    fn native(self) -> Protocol {
        match self {
            ArchivedProtocol::Tcp => Protocol::Tcp,
            ArchivedProtocol::Udp => Protocol::Udp,
            ArchivedProtocol::Sctp => Protocol::Sctp,
        }
    }
}

impl From<Protocol> for sdk::Protocol {
    fn from(p: Protocol) -> sdk::Protocol {
        match p {
            Protocol::Tcp => sdk::Protocol::Tcp,
            Protocol::Udp => sdk::Protocol::Udp,
            Protocol::Sctp => sdk::Protocol::Sctp,
        }
    }
}

/// Headless and ExternalName services have no cluster IPs here: an address that does not
/// parse never reaches a guest (the host refuses the object as it archives it).
#[derive(Archive, Serialize)]
pub struct Service<'a> {
    #[rkyv(with = InlineAsBox)]
    pub namespace: &'a str,
    #[rkyv(with = InlineAsBox)]
    pub name: &'a str,
    pub service_type: ServiceType,
    pub cluster_ips: Vec<IpAddr>,
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort<'a>>,
    pub session_affinity_timeout: Option<u32>,
    pub external_traffic_local: bool,
    pub internal_traffic_local: bool,
    pub labels: Vec<Label<'a>>,
}

#[derive(Archive, Serialize)]
pub struct Label<'a> {
    #[rkyv(with = InlineAsBox)]
    pub key: &'a str,
    #[rkyv(with = InlineAsBox)]
    pub value: &'a str,
}

#[derive(Archive, Serialize)]
pub struct ServicePort<'a> {
    #[rkyv(with = InlineAsBox)]
    pub name: &'a str,
    pub protocol: Protocol,
    pub port: u16,
    pub node_port: u16,
    pub target_port: TargetPort<'a>,
}

#[derive(Archive, Serialize)]
pub enum TargetPort<'a> {
    Number(u16),
    Name(#[rkyv(with = InlineAsBox)] &'a str),
}

#[derive(Archive, Serialize)]
pub struct Slice<'a> {
    #[rkyv(with = InlineAsBox)]
    pub name: &'a str,
    pub endpoints: Vec<Endpoint<'a>>,
    pub ports: Vec<EndpointPort<'a>>,
}

#[derive(Archive, Serialize)]
pub struct Endpoint<'a> {
    pub addresses: Vec<IpAddr>,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    #[rkyv(with = Map<InlineAsBox>)]
    pub node_name: Option<&'a str>,
    #[rkyv(with = Map<InlineAsBox>)]
    pub zone: Option<&'a str>,
    pub is_local: bool,
}

#[derive(Archive, Serialize)]
pub struct EndpointPort<'a> {
    #[rkyv(with = InlineAsBox)]
    pub name: &'a str,
    pub protocol: Protocol,
    pub port: u16,
}

/// The result: elements of the host's maps, named by number, and the chains and affinity
/// sets of the ports that need their own.
#[derive(Archive, Serialize, Deserialize, Debug, Default, PartialEq)]
pub struct Ruleset {
    pub elements: Vec<Element>,
    pub chains: Vec<Chain>,
    pub sets: Vec<SetDeclaration>,
    pub warnings: Vec<String>,
}

/// A chain of the service's own: the host names it `<chain prefix>/<port id>` for
/// [`ChainRole::Service`], with `/external` or `/local` after it for the others.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub struct ChainName {
    /// The port's index in the service's ports.
    pub port: u16,
    pub role: ChainRole,
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum ChainRole {
    /// Cluster traffic.
    Service,
    /// Node ports, external and load-balancer addresses.
    External,
    /// externalTrafficPolicy Local: the node's own endpoints.
    Local,
}

/// The clients that last reached one backend of a port (session affinity): the host names it
/// `<chain prefix>/<port id>/ep/<address>/<port>/affinity`, its family the address's.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub struct SetName {
    pub port: u16,
    pub address: IpAddr,
    pub backend_port: u16,
}

#[derive(Archive, Serialize, Deserialize, Debug, PartialEq)]
pub struct SetDeclaration {
    pub name: SetName,
    pub timeout_seconds: u32,
}

#[derive(Archive, Serialize, Deserialize, Debug, PartialEq)]
pub struct Chain {
    pub name: ChainName,
    pub rules: Vec<Rule>,
}

/// The most matches a rule of the translator has (destination, protocol, port, pod traffic).
pub const MAX_MATCHES: usize = 4;
/// The most statements (remember the client, DNAT).
pub const MAX_STATEMENTS: usize = 2;

/// A rule with its matches and statements inline, so that it allocates nothing.
#[derive(Archive, Serialize, Deserialize, Debug, PartialEq)]
pub struct Rule {
    pub matches: [Option<Match>; MAX_MATCHES],
    pub statements: [Option<Statement>; MAX_STATEMENTS],
    pub verdict: Verdict,
}

impl Rule {
    fn new(matches: &[Match], statements: &[Statement], verdict: Verdict) -> Rule {
        debug_assert!(matches.len() <= MAX_MATCHES && statements.len() <= MAX_STATEMENTS);
        let mut rule = Rule { matches: [None; MAX_MATCHES], statements: [None; MAX_STATEMENTS], verdict };
        rule.matches.iter_mut().zip(matches).for_each(|(slot, m)| *slot = Some(*m));
        rule.statements.iter_mut().zip(statements).for_each(|(slot, s)| *slot = Some(*s));
        rule
    }
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum Match {
    Destination(IpAddr),
    Protocol(Protocol),
    DestinationPort(u16),
    SourceInSet(SetName),
    /// `numgen random mod <modulus> == 0`.
    Random(u32),
    /// Traffic from pods (or, negated, from anywhere else) of a family, as the host detects it.
    PodTraffic {
        ipv6: bool,
        negate: bool,
    },
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum Statement {
    Dnat {
        address: IpAddr,
        port: u16,
    },
    /// Remember the client in an affinity set, for `timeout` seconds.
    RememberSource {
        set: SetName,
        timeout: u32,
    },
}

/// The host's maps a service translator writes to (their names in the typed world).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum MapName {
    ServiceBackends,
    NodeportBackends,
    MasqueradeOffCluster,
    MasqueradeAlways,
    SessionAffinity(u32),
    NodeportAffinity(u32),
    NoEndpointServices,
    NoEndpointNodeports,
    Hairpin,
    ClusterIps,
    ServiceIps,
    ServiceNodeports,
}

impl MapName {
    /// The map's name in the typed world.
    pub fn typed(self) -> String {
        match self {
            MapName::ServiceBackends => "service-backends".into(),
            MapName::NodeportBackends => "nodeport-backends".into(),
            MapName::MasqueradeOffCluster => "masquerade-off-cluster".into(),
            MapName::MasqueradeAlways => "masquerade-always".into(),
            MapName::SessionAffinity(t) => format!("session-affinity-{t}"),
            MapName::NodeportAffinity(t) => format!("nodeport-affinity-{t}"),
            MapName::NoEndpointServices => "no-endpoint-services".into(),
            MapName::NoEndpointNodeports => "no-endpoint-nodeports".into(),
            MapName::Hairpin => "hairpin".into(),
            MapName::ClusterIps => "cluster-ips".into(),
            MapName::ServiceIps => "service-ips".into(),
            MapName::ServiceNodeports => "service-nodeports".into(),
        }
    }
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum KeyPart {
    Address(IpAddr),
    Protocol(Protocol),
    Port(u16),
}

/// The longest key of the host's maps (`service-backends`: address . protocol . port .
/// backend address . backend port), kept inline so that an element allocates nothing.
pub const MAX_KEY_PARTS: usize = 5;

#[derive(Archive, Serialize, Deserialize, Debug, PartialEq)]
pub struct Element {
    pub map: MapName,
    pub key: [Option<KeyPart>; MAX_KEY_PARTS],
    pub verdict: Verdict,
}

impl Element {
    fn new(map: MapName, parts: &[KeyPart], verdict: Verdict) -> Element {
        let mut key = [None; MAX_KEY_PARTS];
        for (slot, part) in key.iter_mut().zip(parts) {
            *slot = Some(*part);
        }
        Element { map, key, verdict }
    }
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum Verdict {
    None,
    Drop,
    Reject,
    Goto(ChainName),
    /// Mark for masquerading at postrouting.
    Masquerade,
}

/// The names a flat ruleset's numbers stand for, from the inputs it was translated from
/// (what the host would resolve them with).
struct Names<'i> {
    chain_prefix: &'i str,
    port_ids: Vec<String>,
}

impl Names<'_> {
    fn port_prefix(&self, port: u16) -> String {
        format!("{}/{}", self.chain_prefix, self.port_ids[usize::from(port)])
    }

    fn chain(&self, name: ChainName) -> String {
        let suffix = match name.role {
            ChainRole::Service => "",
            ChainRole::External => "/external",
            ChainRole::Local => "/local",
        };
        format!("{}{suffix}", self.port_prefix(name.port))
    }

    fn set(&self, name: SetName) -> String {
        let address = name.address.to_string().replace(':', "-");
        format!("{}/ep/{address}/{}/affinity", self.port_prefix(name.port), name.backend_port)
    }

    fn verdict(&self, verdict: Verdict) -> sdk::Verdict {
        match verdict {
            Verdict::None => sdk::Verdict::None,
            Verdict::Drop => sdk::Verdict::Drop,
            Verdict::Reject => sdk::Verdict::Reject,
            Verdict::Goto(chain) => sdk::Verdict::Goto(self.chain(chain)),
            Verdict::Masquerade => sdk::Verdict::Masquerade,
        }
    }

    fn rule(&self, rule: &Rule) -> sdk::Rule {
        let address = |a: IpAddr| sdk::AddressMatch { cidr: a.to_string(), negate: false };
        let family = |ipv6: bool| if ipv6 { sdk::AddressFamily::Ipv6 } else { sdk::AddressFamily::Ipv4 };
        sdk::Rule {
            matches: (rule.matches.iter().flatten())
                .map(|m| match *m {
                    Match::Destination(a) => sdk::RuleMatch::Destination(address(a)),
                    Match::Protocol(p) => sdk::RuleMatch::Protocol(p.into()),
                    Match::DestinationPort(p) => sdk::RuleMatch::DestinationPort(p),
                    Match::SourceInSet(set) => sdk::RuleMatch::SourceInSet(self.set(set)),
                    Match::Random(modulus) => sdk::RuleMatch::Random((modulus, 0)),
                    Match::PodTraffic { ipv6, negate } => {
                        sdk::RuleMatch::PodTraffic(sdk::PodTrafficMatch { family: family(ipv6), negate })
                    }
                })
                .collect(),
            statements: (rule.statements.iter().flatten())
                .map(|s| match *s {
                    Statement::Dnat { address, port } => {
                        sdk::RuleStatement::Dnat(sdk::DnatTarget { address: address.to_string(), port })
                    }
                    Statement::RememberSource { set, timeout } => sdk::RuleStatement::AddSourceToSet(sdk::SetUpdate {
                        set: self.set(set),
                        timeout_seconds: Some(timeout),
                    }),
                })
                .collect(),
            verdict: self.verdict(rule.verdict),
            comment: None,
        }
    }
}

/// A flat ruleset in the typed world's terms, its names resolved from the `inputs` it was
/// translated from, and its elements in a canonical order ([`canonical`]): the typed
/// translator orders hairpin addresses as text, this one as numbers.
pub fn typed(ruleset: &Ruleset, inputs: &ArchivedInputs<'_>) -> sdk::Ruleset {
    let names =
        Names { chain_prefix: &inputs.chain_prefix, port_ids: inputs.service.ports.iter().map(port_id).collect() };
    let map_elements = ruleset
        .elements
        .iter()
        .map(|e| sdk::MapElement {
            map_name: e.map.typed(),
            key: e
                .key
                .iter()
                .flatten()
                .map(|part| match *part {
                    KeyPart::Address(a) => sdk::KeyPart::Address(a.to_string()),
                    KeyPart::Protocol(p) => sdk::KeyPart::Protocol(p.into()),
                    KeyPart::Port(p) => sdk::KeyPart::Port(p),
                })
                .collect(),
            verdict: names.verdict(e.verdict),
        })
        .collect();
    let chains = (ruleset.chains.iter())
        .map(|c| sdk::Chain { name: names.chain(c.name), rules: c.rules.iter().map(|r| names.rule(r)).collect() })
        .collect();
    let sets = (ruleset.sets.iter())
        .map(|s| sdk::SetDeclaration {
            name: names.set(s.name),
            family: if s.name.address.is_ipv6() { sdk::AddressFamily::Ipv6 } else { sdk::AddressFamily::Ipv4 },
            timeout_seconds: Some(s.timeout_seconds),
            elements: vec![],
        })
        .collect();
    canonical(sdk::Ruleset { chains, sets, map_elements, warnings: ruleset.warnings.clone() })
}

/// A typed ruleset with its map elements in one order, to compare with [`typed`]'s.
pub fn canonical(mut ruleset: sdk::Ruleset) -> sdk::Ruleset {
    ruleset.map_elements.sort_by_key(|e| format!("{e:?}"));
    ruleset
}

/// The archive of `inputs`, as the host passes it.
pub fn encode_inputs(inputs: &Inputs<'_>, buffer: Vec<u8>) -> Vec<u8> {
    rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(inputs, buffer).expect("archiving into a Vec cannot fail")
}

/// The archive of a result, as the guest returns it.
pub fn encode_result(result: &Result<Ruleset, String>, buffer: Vec<u8>) -> Vec<u8> {
    rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(result, buffer).expect("archiving into a Vec cannot fail")
}

/// Reads a guest's result in place after checking every byte of it: tags, lengths, offsets
/// and UTF-8 (the guest is not trusted).
pub fn validate_result(output: &[u8]) -> Result<&rkyv::Archived<Result<Ruleset, String>>, rkyv::rancor::Error> {
    rkyv::access::<rkyv::Archived<Result<Ruleset, String>>, rkyv::rancor::Error>(output)
}

/// The inputs in place, unchecked: only the host writes them.
///
/// # Safety
/// `input` must be an archive of [`Inputs`] made by [`encode_inputs`].
pub unsafe fn inputs_in_place(input: &[u8]) -> &ArchivedInputs<'static> {
    // SAFETY: the caller's contract.
    unsafe { rkyv::access_unchecked::<ArchivedInputs<'static>>(input) }
}

/// What the Wasm export does with its input buffer, and native code with the same archive.
///
/// # Safety
/// As [`inputs_in_place`].
pub unsafe fn translate_archive(input: &[u8]) -> Vec<u8> {
    // SAFETY: the caller's contract.
    let inputs = unsafe { inputs_in_place(input) };
    encode_result(&translate(inputs), Vec::with_capacity(1024))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Backend {
    address: IpAddr,
    port: u16,
}

#[derive(Default)]
struct PortEndpoints {
    cluster: Vec<Backend>,
    local: Vec<Backend>,
}

/// [`crate::translate`]'s categorization: ready endpoints, or serving-and-terminating ones
/// when none is ready, of one address family.
fn categorize(port: &ArchivedServicePort<'_>, slices: &[ArchivedSlice<'_>], ipv6: bool) -> PortEndpoints {
    let protocol = port.protocol;
    let mut ready = (Vec::new(), Vec::new());
    let mut terminating = (Vec::new(), Vec::new());
    for slice in slices {
        let by_name = slice.ports.iter().find(|p| *p.name == *port.name && p.protocol == protocol);
        let Some(ep_port) = by_name.or_else(|| match &port.target_port {
            ArchivedTargetPort::Number(n) if slice.ports.len() == 1 && slice.ports[0].name.is_empty() => {
                slice.ports.iter().find(|p| p.port == *n)
            }
            _ => None,
        }) else {
            continue;
        };
        for ep in slice.endpoints.iter() {
            let Some(address) = ep.addresses.first().map(|a| a.as_ipaddr()) else { continue };
            if address.is_ipv6() != ipv6 {
                continue;
            }
            let backend = Backend { address, port: ep_port.port.to_native() };
            let bucket = if ep.ready {
                &mut ready
            } else if ep.serving && ep.terminating {
                &mut terminating
            } else {
                continue;
            };
            if ep.is_local {
                bucket.1.push(backend);
            }
            bucket.0.push(backend);
        }
    }
    let pick = |r: Vec<Backend>, t: Vec<Backend>| {
        let mut v = if r.is_empty() { t } else { r };
        v.sort();
        v.dedup();
        v
    };
    PortEndpoints { cluster: pick(ready.0, terminating.0), local: pick(ready.1, terminating.1) }
}

struct ByFamily {
    v4: PortEndpoints,
    v6: PortEndpoints,
}

impl ByFamily {
    fn of(&self, address: IpAddr) -> &PortEndpoints {
        if address.is_ipv6() { &self.v6 } else { &self.v4 }
    }
}

fn port_id(port: &ArchivedServicePort<'_>) -> String {
    let protocol = protocol_name(port.protocol.native().into());
    if port.name.is_empty() { format!("{protocol}/{}", port.port) } else { format!("{protocol}/{}", &*port.name) }
}

fn addresses(list: &[rkyv::net::ArchivedIpAddr]) -> Vec<IpAddr> {
    list.iter().map(|a| a.as_ipaddr()).collect()
}

/// One of the service's ports, with its index (what its chains and sets are named by).
#[derive(Clone, Copy)]
struct PortOf<'p, 'a> {
    index: u16,
    port: &'p ArchivedServicePort<'a>,
}

/// [`crate::translate`] over the archive.
pub fn translate(inputs: &ArchivedInputs<'_>) -> Result<Ruleset, String> {
    let service = &inputs.service;
    let mut ruleset = Ruleset::default();
    if service.service_type == ArchivedServiceType::ExternalName || service.cluster_ips.is_empty() {
        return Ok(ruleset);
    }
    let cluster_ips = addresses(&service.cluster_ips);
    let external: Vec<IpAddr> =
        service.external_ips.iter().chain(service.load_balancer_ips.iter()).map(|a| a.as_ipaddr()).collect();
    let mut hairpin = BTreeSet::new();
    for (index, port) in service.ports.iter().enumerate() {
        let index = u16::try_from(index).map_err(|_| "more than 65,535 ports".to_string())?;
        let port = PortOf { index, port };
        translate_port(service, port, &inputs.slices, &cluster_ips, &external, &mut ruleset, &mut hairpin);
    }
    ruleset.elements.extend(
        hairpin.into_iter().map(|address| Element::new(MapName::Hairpin, &[KeyPart::Address(address)], Verdict::None)),
    );
    if !service.ports.is_empty() {
        for ip in &cluster_ips {
            ruleset.elements.push(Element::new(MapName::ClusterIps, &[KeyPart::Address(*ip)], Verdict::None));
        }
    }
    Ok(ruleset)
}

fn translate_port(
    service: &ArchivedService<'_>,
    port_of: PortOf<'_, '_>,
    slices: &[ArchivedSlice<'_>],
    cluster_ips: &[IpAddr],
    external: &[IpAddr],
    ruleset: &mut Ruleset,
    hairpin: &mut BTreeSet<IpAddr>,
) {
    let port = port_of.port;
    let by_family = ByFamily { v4: categorize(port, slices, false), v6: categorize(port, slices, true) };
    let node_port = port.node_port.to_native();
    let has_node_port = node_port != 0
        && matches!(service.service_type, ArchivedServiceType::NodePort | ArchivedServiceType::LoadBalancer);
    let has_external = !external.is_empty() || has_node_port;
    let as_data = !(has_external && service.external_traffic_local)
        && cluster_ips.iter().chain(external).all(|ip| by_family.of(*ip).cluster.len() <= MAX_BACKENDS_PER_FRONTEND)
        && [&by_family.v4, &by_family.v6].iter().all(|f| f.cluster.len() <= MAX_BACKENDS_PER_FRONTEND);
    if !as_data {
        let frontends = Frontends { cluster_ips, external, node_port: has_node_port.then_some(node_port) };
        translate_port_in_chains(service, port_of, &by_family, frontends, ruleset, hairpin);
        return;
    }
    let protocol = port.protocol.native();
    let number = port.port.to_native();
    let affinity =
        service.session_affinity_timeout.as_ref().map(|t| t.to_native().clamp(1, MAX_AFFINITY_TIMEOUT_SECONDS));
    let frontend = |ip: IpAddr| [KeyPart::Address(ip), KeyPart::Protocol(protocol), KeyPart::Port(number)];
    let mut balance = |ruleset: &mut Ruleset, ip: IpAddr, backends: &[Backend], masquerade: MapName| {
        for b in backends {
            let [a, p, n] = frontend(ip);
            ruleset.elements.push(Element::new(
                MapName::ServiceBackends,
                &[a, p, n, KeyPart::Address(b.address), KeyPart::Port(b.port)],
                Verdict::None,
            ));
            hairpin.insert(b.address);
        }
        ruleset.elements.push(Element::new(masquerade, &frontend(ip), Verdict::None));
        if let Some(t) = affinity {
            ruleset.elements.push(Element::new(MapName::SessionAffinity(t), &frontend(ip), Verdict::None));
        }
    };

    for &ip in cluster_ips {
        let endpoints = by_family.of(ip);
        let backends = if service.internal_traffic_local { &endpoints.local } else { &endpoints.cluster };
        if backends.is_empty() {
            let verdict = if endpoints.cluster.is_empty() {
                ruleset.warnings.push(format!("{}: no ready endpoints for {ip}", port_id(port)));
                Verdict::Reject
            } else {
                ruleset.warnings.push(format!(
                    "{}: internalTrafficPolicy Local and no endpoint on this node for {ip}",
                    port_id(port)
                ));
                Verdict::Drop
            };
            ruleset.elements.push(Element::new(MapName::NoEndpointServices, &frontend(ip), verdict));
            continue;
        }
        balance(ruleset, ip, backends, MapName::MasqueradeOffCluster);
    }
    for &ip in external {
        let endpoints = by_family.of(ip);
        if endpoints.cluster.is_empty() {
            ruleset.elements.push(Element::new(MapName::NoEndpointServices, &frontend(ip), Verdict::Reject));
        } else {
            balance(ruleset, ip, &endpoints.cluster, MapName::MasqueradeAlways);
        }
    }
    if !has_node_port {
        return;
    }
    let node_port_key = [KeyPart::Protocol(protocol), KeyPart::Port(node_port)];
    let backends: Vec<&Backend> = by_family.v4.cluster.iter().chain(&by_family.v6.cluster).collect();
    if backends.is_empty() {
        ruleset.elements.push(Element::new(MapName::NoEndpointNodeports, &node_port_key, Verdict::Reject));
        return;
    }
    for b in backends {
        let [p, n] = node_port_key;
        ruleset.elements.push(Element::new(
            MapName::NodeportBackends,
            &[p, n, KeyPart::Address(b.address), KeyPart::Port(b.port)],
            Verdict::None,
        ));
        hairpin.insert(b.address);
    }
    if let Some(t) = affinity {
        ruleset.elements.push(Element::new(MapName::NodeportAffinity(t), &node_port_key, Verdict::None));
    }
}

/// A port's frontends: its cluster IPs, its external and load-balancer addresses, its node
/// port (where the service type opens one).
#[derive(Clone, Copy)]
struct Frontends<'f> {
    cluster_ips: &'f [IpAddr],
    external: &'f [IpAddr],
    node_port: Option<u16>,
}

/// Backends in the typed translator's order, by their text, so that the rules picking among
/// them come out in the same order (only the chain path's rules depend on it).
fn in_text_order(backends: &[Backend]) -> Vec<Backend> {
    let mut ordered = backends.to_vec();
    ordered.sort_by_cached_key(|b| (b.address.to_string(), b.port));
    ordered
}

/// The typed `translate_port`'s chains: the rules that pick one of a port's backends, with the
/// affinity sets they need declared once, in `ruleset`.
struct ChainRules<'r> {
    port: u16,
    affinity: Option<u32>,
    protocol: Protocol,
    ruleset: &'r mut Ruleset,
    declared: BTreeSet<SetName>,
    hairpin: &'r mut BTreeSet<IpAddr>,
}

impl ChainRules<'_> {
    fn affinity_set(&mut self, backend: &Backend, timeout: u32) -> SetName {
        let name = SetName { port: self.port, address: backend.address, backend_port: backend.port };
        if self.declared.insert(name) {
            self.ruleset.sets.push(SetDeclaration { name, timeout_seconds: timeout });
        }
        name
    }

    /// A uniform pick, as the typed `pick_rules`: rule i matches with probability 1/(n-i)
    /// among what is left, the last always; with affinity, a remembered client goes back
    /// first, and every DNAT remembers the client.
    fn pick_rules(&mut self, backends: &[Backend]) -> Vec<Rule> {
        self.hairpin.extend(backends.iter().map(|b| b.address));
        let n = backends.len() as u32;
        let protocol = Match::Protocol(self.protocol);
        let draw = |i: usize, rest: &[Statement]| {
            let left = n - i as u32;
            if left > 1 {
                Rule::new(&[Match::Random(left), protocol], rest, Verdict::None)
            } else {
                Rule::new(&[protocol], rest, Verdict::None)
            }
        };
        let dnat = |b: &Backend| Statement::Dnat { address: b.address, port: b.port };
        let Some(timeout) = self.affinity else {
            return backends.iter().enumerate().map(|(i, b)| draw(i, &[dnat(b)])).collect();
        };
        let sets: Vec<SetName> = backends.iter().map(|b| self.affinity_set(b, timeout)).collect();
        let remember = |set: SetName| Statement::RememberSource { set, timeout };
        let mut rules = Vec::with_capacity(backends.len() * 2);
        for (b, set) in backends.iter().zip(&sets) {
            rules.push(Rule::new(&[Match::SourceInSet(*set), protocol], &[remember(*set), dnat(b)], Verdict::None));
        }
        for (i, (b, set)) in backends.iter().zip(&sets).enumerate() {
            rules.push(draw(i, &[remember(*set), dnat(b)]));
        }
        rules
    }
}

/// The typed `translate_port`'s chain path, over the archive: a service chain for cluster
/// traffic, an external chain (and for externalTrafficPolicy Local a local one) for the rest,
/// over the endpoints of the service's first family.
fn translate_port_in_chains(
    service: &ArchivedService<'_>,
    port_of: PortOf<'_, '_>,
    by_family: &ByFamily,
    frontends: Frontends<'_>,
    ruleset: &mut Ruleset,
    hairpin: &mut BTreeSet<IpAddr>,
) {
    let Frontends { cluster_ips, external, node_port } = frontends;
    let port = port_of.port;
    let family_of = cluster_ips[0];
    let endpoints = by_family.of(family_of);
    let cluster_backends =
        in_text_order(if service.internal_traffic_local { &endpoints.local } else { &endpoints.cluster });
    let external_local = service.external_traffic_local;
    let external_backends = in_text_order(if external_local { &endpoints.local } else { &endpoints.cluster });
    let protocol = port.protocol.native();
    let number = port.port.to_native();
    let frontend = |ip: IpAddr| [KeyPart::Address(ip), KeyPart::Protocol(protocol), KeyPart::Port(number)];
    let mut rules = ChainRules {
        port: port_of.index,
        affinity: service.session_affinity_timeout.as_ref().map(|t| t.to_native()),
        protocol,
        ruleset,
        declared: BTreeSet::new(),
        hairpin,
    };
    let pods_v6 = family_of.is_ipv6();

    let service_chain = ChainName { port: port_of.index, role: ChainRole::Service };
    if cluster_backends.is_empty() {
        let verdict = if endpoints.cluster.is_empty() {
            rules.ruleset.warnings.push(format!("{}: no ready endpoints", port_id(port)));
            Verdict::Reject
        } else {
            rules
                .ruleset
                .warnings
                .push(format!("{}: internalTrafficPolicy Local and no endpoint on this node", port_id(port)));
            Verdict::Drop
        };
        for &ip in cluster_ips {
            rules.ruleset.elements.push(Element::new(MapName::NoEndpointServices, &frontend(ip), verdict));
        }
    } else {
        let mut chain_rules: Vec<Rule> = (cluster_ips.iter().filter(|ip| ip.is_ipv6() == pods_v6))
            .map(|&ip| {
                // Off-cluster sources reaching a cluster IP are masqueraded so replies return.
                let off_cluster = Match::PodTraffic { ipv6: pods_v6, negate: true };
                let matches =
                    [Match::Destination(ip), Match::Protocol(protocol), Match::DestinationPort(number), off_cluster];
                Rule::new(&matches, &[], Verdict::Masquerade)
            })
            .collect();
        chain_rules.extend(rules.pick_rules(&cluster_backends));
        rules.ruleset.chains.push(Chain { name: service_chain, rules: chain_rules });
        for &ip in cluster_ips {
            rules.ruleset.elements.push(Element::new(MapName::ServiceIps, &frontend(ip), Verdict::Goto(service_chain)));
        }
    }

    if external.is_empty() && node_port.is_none() {
        return;
    }
    let external_verdict = if external_backends.is_empty() {
        if external_local && !endpoints.cluster.is_empty() { Verdict::Drop } else { Verdict::Reject }
    } else {
        let external_chain = ChainName { port: port_of.index, role: ChainRole::External };
        let mut chain_rules = Vec::new();
        if external_local {
            if !cluster_backends.is_empty() {
                chain_rules.push(Rule::new(
                    &[Match::PodTraffic { ipv6: pods_v6, negate: false }],
                    &[],
                    Verdict::Goto(service_chain),
                ));
            }
            let local_chain = ChainName { port: port_of.index, role: ChainRole::Local };
            let pick = rules.pick_rules(&external_backends);
            rules.ruleset.chains.push(Chain { name: local_chain, rules: pick });
            chain_rules.push(Rule::new(&[], &[], Verdict::Goto(local_chain)));
        } else {
            chain_rules.push(Rule::new(&[], &[], Verdict::Masquerade));
            if cluster_backends.is_empty() {
                chain_rules.extend(rules.pick_rules(&external_backends));
            } else {
                chain_rules.push(Rule::new(&[], &[], Verdict::Goto(service_chain)));
            }
        }
        rules.ruleset.chains.push(Chain { name: external_chain, rules: chain_rules });
        Verdict::Goto(external_chain)
    };
    let routed = matches!(external_verdict, Verdict::Goto(_));
    for &ip in external {
        let map = if routed { MapName::ServiceIps } else { MapName::NoEndpointServices };
        rules.ruleset.elements.push(Element::new(map, &frontend(ip), external_verdict));
    }
    if let Some(node_port) = node_port {
        let map = if routed { MapName::ServiceNodeports } else { MapName::NoEndpointNodeports };
        let key = [KeyPart::Protocol(protocol), KeyPart::Port(node_port)];
        rules.ruleset.elements.push(Element::new(map, &key, external_verdict));
    }
}
