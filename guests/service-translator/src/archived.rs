//! The default translator of the archived world (`archived-service-translation`, package
//! 1.2.0): [`crate::translate`] over the archive the host passes, read in place, returning a
//! string-free ruleset (BENCHMARKS.md, forty-eighth to fiftieth runs). It is what ships; the
//! typed translator it mirrors is built as a guest too (feature `typed-world`).
//!
//! The inputs cross as one rkyv archive (strings are views, addresses are integers); the
//! result is built from values without a string in them (map names are numbers, addresses
//! integers, keys fixed arrays) and crosses as one archive that the host checks and reads in
//! place. The archive's types are the `wasmplane-archive` crate's, which the host reads them
//! with. Native code runs the same [`translate`] on the same archive (the runtime bench).
//!
//! It covers every path of [`crate::translate`]: load balancing as data, the common case, and
//! the ports that need chains of their own (externalTrafficPolicy Local with external
//! addresses, more than 32 backends), whose chains and affinity sets are named by numbers too
//! (a port's index and role, a backend's address and port) and whose rules hold their matches
//! and statements inline. The unit tests check every ruleset against the typed translator's
//! ([`typed`]), and the host's tests that both validate to the same dataplane.

use std::collections::BTreeSet;
use std::net::IpAddr;

pub use wasmplane_archive::*;
use wasmplane_sdk::types as sdk;

use crate::MAX_AFFINITY_TIMEOUT_SECONDS;
use crate::MAX_BACKENDS_PER_FRONTEND;

/// A flat ruleset in the typed world's terms, its names resolved from the `inputs` it was
/// translated from, and its elements in a canonical order ([`canonical`]): the typed
/// translator orders hairpin addresses as text, this one as numbers.
pub fn typed(ruleset: &Ruleset, inputs: &ArchivedInputs<'_>) -> sdk::Ruleset {
    canonical(typed_in_order(ruleset, inputs))
}

/// [`typed`] with the elements in the order the guest gave them: what a host that keeps the
/// typed world's validator would convert every result into (the bench times it).
pub fn typed_in_order(ruleset: &Ruleset, inputs: &ArchivedInputs<'_>) -> sdk::Ruleset {
    let names = Names::of_inputs(inputs);
    let chain = |name: ChainName| names.chain(name).expect("the translator names its own ports");
    let set = |name: SetName| names.set(name).expect("the translator names its own ports");
    let verdict = |v: Verdict| match v {
        Verdict::None => sdk::Verdict::None,
        Verdict::Drop => sdk::Verdict::Drop,
        Verdict::Reject => sdk::Verdict::Reject,
        Verdict::Goto(name) => sdk::Verdict::Goto(chain(name)),
        Verdict::Masquerade => sdk::Verdict::Masquerade,
    };
    let address = |a: IpAddr| sdk::AddressMatch { cidr: a.to_string(), negate: false };
    let family = |ipv6: bool| if ipv6 { sdk::AddressFamily::Ipv6 } else { sdk::AddressFamily::Ipv4 };
    let rule = |rule: &Rule| sdk::Rule {
        matches: (rule.matches.iter().flatten())
            .map(|m| match *m {
                Match::Destination(a) => sdk::RuleMatch::Destination(address(a)),
                Match::Protocol(p) => sdk::RuleMatch::Protocol(sdk_protocol(p)),
                Match::DestinationPort(p) => sdk::RuleMatch::DestinationPort(p),
                Match::SourceInSet(name) => sdk::RuleMatch::SourceInSet(set(name)),
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
                Statement::RememberSource { set: name, timeout } => {
                    sdk::RuleStatement::AddSourceToSet(sdk::SetUpdate {
                        set: set(name),
                        timeout_seconds: Some(timeout),
                    })
                }
            })
            .collect(),
        verdict: verdict(rule.verdict),
        comment: None,
    };
    let map_elements = ruleset
        .elements
        .iter()
        .map(|e| sdk::MapElement {
            map_name: e.map.name().into_owned(),
            key: e
                .key
                .iter()
                .flatten()
                .map(|part| match *part {
                    KeyPart::Address(a) => sdk::KeyPart::Address(a.to_string()),
                    KeyPart::Protocol(p) => sdk::KeyPart::Protocol(sdk_protocol(p)),
                    KeyPart::Port(p) => sdk::KeyPart::Port(p),
                })
                .collect(),
            verdict: verdict(e.verdict),
        })
        .collect();
    let chains = (ruleset.chains.iter())
        .map(|c| sdk::Chain { name: chain(c.name), rules: c.rules.iter().map(rule).collect() })
        .collect();
    let sets = (ruleset.sets.iter())
        .map(|s| sdk::SetDeclaration {
            name: set(s.name),
            family: family(s.name.address.is_ipv6()),
            timeout_seconds: Some(s.timeout_seconds),
            elements: vec![],
        })
        .collect();
    sdk::Ruleset { chains, sets, map_elements, warnings: ruleset.warnings.clone() }
}

fn sdk_protocol(p: Protocol) -> sdk::Protocol {
    match p {
        Protocol::Tcp => sdk::Protocol::Tcp,
        Protocol::Udp => sdk::Protocol::Udp,
        Protocol::Sctp => sdk::Protocol::Sctp,
    }
}

/// A typed ruleset with its map elements in one order, to compare with [`typed`]'s.
pub fn canonical(mut ruleset: sdk::Ruleset) -> sdk::Ruleset {
    ruleset.map_elements.sort_by_key(|e| format!("{e:?}"));
    ruleset
}

/// [`translate`] as the SDK's archived world calls it: what the Wasm export runs (`lib.rs`).
pub struct DefaultTranslator;

impl wasmplane_sdk::archived::Translator for DefaultTranslator {
    fn translate(inputs: &ArchivedInputs<'_>) -> TranslateResult {
        translate(inputs)
    }
}

/// What the Wasm export does with its input buffer, and native code with the same archive.
///
/// # Safety
/// As [`inputs_in_place`].
pub unsafe fn translate_archive(input: &[u8]) -> Vec<u8> {
    // SAFETY: the caller's contract.
    unsafe { wasmplane_sdk::archived::translate_archive::<DefaultTranslator>(input) }
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

fn id_of(port: &ArchivedServicePort<'_>) -> String {
    wasmplane_archive::port_id(port.protocol.native(), &port.name, port.port.to_native())
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
                ruleset.warnings.push(format!("{}: no ready endpoints for {ip}", id_of(port)));
                Verdict::Reject
            } else {
                ruleset.warnings.push(format!(
                    "{}: internalTrafficPolicy Local and no endpoint on this node for {ip}",
                    id_of(port)
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
            rules.ruleset.warnings.push(format!("{}: no ready endpoints", id_of(port)));
            Verdict::Reject
        } else {
            rules
                .ruleset
                .warnings
                .push(format!("{}: internalTrafficPolicy Local and no endpoint on this node", id_of(port)));
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
