//! The archive layout of `wasmplane:dataplane@1.2.0`'s `archived-service-translator`: what
//! crosses the component boundary as one rkyv archive each way (BENCHMARKS.md, forty-eighth
//! to fiftieth runs).
//!
//! The host archives a call's inputs straight from its model ([`Inputs`]: strings borrowed,
//! addresses as integers); the guest reads them in place ([`ArchivedInputs`], through
//! [`inputs_in_place`]) and returns a [`Ruleset`] with no string in it but its warnings: the
//! host's maps by number ([`MapName`]), addresses as integers, keys and rule parts in fixed
//! arrays, its own chains and affinity sets named by a port's index and role
//! ([`ChainName`], [`SetName`]). The host checks every byte of the result
//! ([`validate_result`]) and makes every name itself, under the service's prefix, so a guest
//! cannot name anything outside it.
//!
//! The layout is part of the package version: a change to any type here is a new package
//! version and a new interface version, never a change under the same one. Archives are
//! little-endian, unaligned (a lowered `list<u8>` has no alignment in the guest) and use
//! 32-bit relative pointers.

use std::borrow::Cow;
use std::net::IpAddr;

pub use rkyv;
use rkyv::with::{InlineAsBox, Map};
use rkyv::{Archive, Deserialize, Serialize};

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
    pub fn native(self) -> Protocol {
        match self {
            ArchivedProtocol::Tcp => Protocol::Tcp,
            ArchivedProtocol::Udp => Protocol::Udp,
            ArchivedProtocol::Sctp => Protocol::Sctp,
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
    pub fn new(matches: &[Match], statements: &[Statement], verdict: Verdict) -> Rule {
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
    /// The map's name in the typed world (the host's validator and its nftables tables).
    pub fn name(self) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            MapName::ServiceBackends => "service-backends",
            MapName::NodeportBackends => "nodeport-backends",
            MapName::MasqueradeOffCluster => "masquerade-off-cluster",
            MapName::MasqueradeAlways => "masquerade-always",
            MapName::SessionAffinity(t) => return Cow::Owned(format!("session-affinity-{t}")),
            MapName::NodeportAffinity(t) => return Cow::Owned(format!("nodeport-affinity-{t}")),
            MapName::NoEndpointServices => "no-endpoint-services",
            MapName::NoEndpointNodeports => "no-endpoint-nodeports",
            MapName::Hairpin => "hairpin",
            MapName::ClusterIps => "cluster-ips",
            MapName::ServiceIps => "service-ips",
            MapName::ServiceNodeports => "service-nodeports",
        })
    }
}

impl ArchivedMapName {
    pub fn native(&self) -> MapName {
        match self {
            ArchivedMapName::ServiceBackends => MapName::ServiceBackends,
            ArchivedMapName::NodeportBackends => MapName::NodeportBackends,
            ArchivedMapName::MasqueradeOffCluster => MapName::MasqueradeOffCluster,
            ArchivedMapName::MasqueradeAlways => MapName::MasqueradeAlways,
            ArchivedMapName::SessionAffinity(t) => MapName::SessionAffinity(t.to_native()),
            ArchivedMapName::NodeportAffinity(t) => MapName::NodeportAffinity(t.to_native()),
            ArchivedMapName::NoEndpointServices => MapName::NoEndpointServices,
            ArchivedMapName::NoEndpointNodeports => MapName::NoEndpointNodeports,
            ArchivedMapName::Hairpin => MapName::Hairpin,
            ArchivedMapName::ClusterIps => MapName::ClusterIps,
            ArchivedMapName::ServiceIps => MapName::ServiceIps,
            ArchivedMapName::ServiceNodeports => MapName::ServiceNodeports,
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
    pub fn new(map: MapName, parts: &[KeyPart], verdict: Verdict) -> Element {
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

/// A guest's result: its ruleset, or why it has none.
pub type TranslateResult = Result<Ruleset, String>;

/// The archive of `inputs`, as the host passes it, written into `buffer` (cleared first).
pub fn encode_inputs(inputs: &Inputs<'_>, mut buffer: Vec<u8>) -> Vec<u8> {
    buffer.clear();
    rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(inputs, buffer).expect("archiving into a Vec cannot fail")
}

/// The archive of a result, as the guest returns it.
pub fn encode_result(result: &TranslateResult, buffer: Vec<u8>) -> Vec<u8> {
    rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(result, buffer).expect("archiving into a Vec cannot fail")
}

/// Reads a guest's result in place after checking every byte of it: tags, lengths, offsets
/// and UTF-8 (the guest is not trusted).
pub fn validate_result(output: &[u8]) -> Result<&rkyv::Archived<TranslateResult>, rkyv::rancor::Error> {
    rkyv::access::<rkyv::Archived<TranslateResult>, rkyv::rancor::Error>(output)
}

/// The inputs in place, unchecked: what a guest does with the archive the host wrote.
///
/// # Safety
/// `input` must be an archive of [`Inputs`] made by [`encode_inputs`] (in a guest: the input
/// the host passed; the host is trusted not to lie about it).
pub unsafe fn inputs_in_place(input: &[u8]) -> &ArchivedInputs<'static> {
    // SAFETY: the caller's contract.
    unsafe { rkyv::access_unchecked::<ArchivedInputs<'static>>(input) }
}

impl Protocol {
    /// The protocol's name in nftables and in port names (`tcp`, `udp`, `sctp`).
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

/// A port's id in the names of its chains and sets: `<protocol>/<name>`, or
/// `<protocol>/<port>` for an unnamed port (what the typed translator names them by).
pub fn port_id(protocol: Protocol, name: &str, port: u16) -> String {
    if name.is_empty() { format!("{}/{port}", protocol.name()) } else { format!("{}/{name}", protocol.name()) }
}

/// The names a result's numbers stand for: its chains and affinity sets under the service's
/// chain prefix, by its ports' ids. The host names everything a guest declares with these;
/// a number naming no port of the service names nothing (`None`).
pub struct Names<'p> {
    chain_prefix: &'p str,
    port_ids: Vec<String>,
}

impl<'p> Names<'p> {
    /// `port_ids`: [`port_id`] of each of the service's ports, in order.
    pub fn new(chain_prefix: &'p str, port_ids: Vec<String>) -> Names<'p> {
        Names { chain_prefix, port_ids }
    }

    /// The names for the service `inputs` hold.
    pub fn of_inputs(inputs: &'p ArchivedInputs<'_>) -> Names<'p> {
        let ids = inputs.service.ports.iter().map(|p| port_id(p.protocol.native(), &p.name, p.port.to_native()));
        Names::new(&inputs.chain_prefix, ids.collect())
    }

    fn port_prefix(&self, port: u16) -> Option<String> {
        let id = self.port_ids.get(usize::from(port))?;
        Some(format!("{}/{id}", self.chain_prefix))
    }

    /// `<chain prefix>/<port id>`, then `/external` or `/local` for those roles.
    pub fn chain(&self, name: ChainName) -> Option<String> {
        let suffix = match name.role {
            ChainRole::Service => "",
            ChainRole::External => "/external",
            ChainRole::Local => "/local",
        };
        Some(self.port_prefix(name.port)? + suffix)
    }

    /// [`chain`](Self::chain) of an archived name.
    pub fn archived_chain(&self, name: &ArchivedChainName) -> Option<String> {
        self.chain(ChainName { port: name.port.to_native(), role: name.role.native() })
    }

    /// `<chain prefix>/<port id>/ep/<address>/<port>/affinity`, an IPv6 address's colons as
    /// dashes.
    pub fn set(&self, name: SetName) -> Option<String> {
        let address = name.address.to_string().replace(':', "-");
        Some(format!("{}/ep/{address}/{}/affinity", self.port_prefix(name.port)?, name.backend_port))
    }

    /// [`set`](Self::set) of an archived name.
    pub fn archived_set(&self, name: &ArchivedSetName) -> Option<String> {
        self.set(SetName {
            port: name.port.to_native(),
            address: name.address.as_ipaddr(),
            backend_port: name.backend_port.to_native(),
        })
    }
}

impl ArchivedChainRole {
    pub fn native(self) -> ChainRole {
        match self {
            ArchivedChainRole::Service => ChainRole::Service,
            ArchivedChainRole::External => ChainRole::External,
            ArchivedChainRole::Local => ChainRole::Local,
        }
    }
}
