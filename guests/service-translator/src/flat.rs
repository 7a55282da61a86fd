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
//! It covers load balancing as data, the common case of [`crate::translate`] (every service of
//! the bench); a service that needs chains of its own is refused with an error, and the
//! bench checks every ruleset against the typed translator's.

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

/// The result: elements of the host's maps, named by number.
#[derive(Archive, Serialize, Deserialize, Debug, Default, PartialEq)]
pub struct Ruleset {
    pub elements: Vec<Element>,
    pub warnings: Vec<String>,
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

/// The verdicts of map elements (chains, and the verdicts naming them, are not in the
/// prototype).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Clone, Copy, Debug, PartialEq, Eq))]
pub enum Verdict {
    None,
    Drop,
    Reject,
}

/// A flat ruleset in the typed world's terms, its elements in a canonical order
/// ([`canonical`]): the typed translator orders hairpin addresses as text, this one as numbers.
pub fn typed(ruleset: &Ruleset) -> sdk::Ruleset {
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
            verdict: match e.verdict {
                Verdict::None => sdk::Verdict::None,
                Verdict::Drop => sdk::Verdict::Drop,
                Verdict::Reject => sdk::Verdict::Reject,
            },
        })
        .collect();
    canonical(sdk::Ruleset { chains: vec![], sets: vec![], map_elements, warnings: ruleset.warnings.clone() })
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

/// [`crate::translate`] over the archive, for services whose ports are all load balanced as
/// data.
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
    for port in service.ports.iter() {
        translate_port(service, port, &inputs.slices, &cluster_ips, &external, &mut ruleset, &mut hairpin)?;
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
    port: &ArchivedServicePort<'_>,
    slices: &[ArchivedSlice<'_>],
    cluster_ips: &[IpAddr],
    external: &[IpAddr],
    ruleset: &mut Ruleset,
    hairpin: &mut BTreeSet<IpAddr>,
) -> Result<(), String> {
    let by_family = ByFamily { v4: categorize(port, slices, false), v6: categorize(port, slices, true) };
    let node_port = port.node_port.to_native();
    let has_node_port = node_port != 0
        && matches!(service.service_type, ArchivedServiceType::NodePort | ArchivedServiceType::LoadBalancer);
    let has_external = !external.is_empty() || has_node_port;
    let as_data = !(has_external && service.external_traffic_local)
        && cluster_ips.iter().chain(external).all(|ip| by_family.of(*ip).cluster.len() <= MAX_BACKENDS_PER_FRONTEND)
        && [&by_family.v4, &by_family.v6].iter().all(|f| f.cluster.len() <= MAX_BACKENDS_PER_FRONTEND);
    if !as_data {
        return Err(format!(
            "service {}/{} port {}: the flat prototype covers load balancing as data only",
            &*service.namespace,
            &*service.name,
            port_id(port)
        ));
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
        return Ok(());
    }
    let node_port_key = [KeyPart::Protocol(protocol), KeyPart::Port(node_port)];
    let backends: Vec<&Backend> = by_family.v4.cluster.iter().chain(&by_family.v6.cluster).collect();
    if backends.is_empty() {
        ruleset.elements.push(Element::new(MapName::NoEndpointNodeports, &node_port_key, Verdict::Reject));
        return Ok(());
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
    Ok(())
}
