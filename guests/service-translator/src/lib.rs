//! The default service translator: what kube-proxy's nftables mode does, as a pure function
//! from one Service (and its EndpointSlices) to the typed nftables objects the host writes.
//!
//! Shape (per service port), in the common case (no externalTrafficPolicy Local with external
//! addresses, at most [`MAX_BACKENDS_PER_FRONTEND`] endpoints per frontend): no chain of its
//! own. Each frontend (cluster IP, external IP, load-balancer IP) names its backends in the
//! host's `service-backends` map and whether it is masqueraded (`masquerade-off-cluster`,
//! `masquerade-always`); the host's shard DNATs through a `numgen` map, and the same for a
//! node port (`nodeport-backends`). Session affinity is data too: each such frontend is an
//! element of the host's `session-affinity-<seconds>` map (a node port of
//! `nodeport-affinity-<seconds>`), and the host remembers which backend each client reached.
//! A change of endpoints is then map elements only, and the kernel, which walks every chain
//! on every commit, has no chain per service to walk.
//!
//! Otherwise (externalTrafficPolicy Local with external addresses, or too many endpoints;
//! per service port):
//! - `service-ips` / `service-nodeports` map elements jump to the port's *service chain*
//!   (cluster traffic) or *external chain* (NodePort, externalIPs, LoadBalancer IPs);
//! - the service chain marks off-cluster sources for masquerade, then picks an endpoint with
//!   a cascade of `numgen` rules that DNAT (no anonymous vmap per service: those load
//!   quadratically);
//! - with session affinity, each endpoint has a set of the clients it served (with the
//!   affinity timeout); the chain first sends a remembered client back to its endpoint, and
//!   every DNAT records the client. kube-proxy has a chain per endpoint for this; here it
//!   costs no chain;
//! - endpoints go into the host's `hairpin` set: a pod that reaches itself through the
//!   service is masqueraded at postrouting. kube-proxy does this in an endpoint chain per
//!   endpoint; without them a service costs one chain instead of 1 + endpoints, and every
//!   kernel commit walks every chain of the node.
//!
//! Services without usable endpoints get `no-endpoint-*` elements that reject. Cluster IPs go
//! into the host's `cluster-ips` set: other ports of them are rejected.
//!
//! What ships is the same translation over archives ([`archived`], the
//! `archived-service-translation` world of package 1.2.0), which costs what this code costs
//! natively; [`translate`] here is its typed twin (feature `typed-world` builds it as a
//! guest), which the archived one is tested against on every path.

use std::collections::BTreeSet;

use wasmplane_sdk::builders::{port_map_element, protocol_name, service_map_element};
use wasmplane_sdk::types::*;
use wasmplane_sdk::{Cidr, RuleBuilder};

#[cfg(target_family = "wasm")]
mod pool;

#[cfg(target_family = "wasm")]
#[global_allocator]
static ALLOCATOR: pool::Pool = pool::Pool::new();

#[cfg(all(
    target_family = "wasm",
    any(feature = "typed-world", feature = "bench-repeat"),
    not(any(feature = "bench-encoded", feature = "bench-batch"))
))]
mod export {
    use wasmplane_sdk::service::exports::wasmplane::dataplane::service_translator::Guest;
    use wasmplane_sdk::types::*;

    struct DefaultTranslator;

    impl Guest for DefaultTranslator {
        fn translate(
            node: NodeContext,
            chain_prefix: String,
            service: Service,
            slices: Vec<EndpointSlice>,
        ) -> Result<Ruleset, GuestError> {
            #[cfg(feature = "bench-repeat")]
            for _ in 1..super::bench_repeat(&service) {
                std::hint::black_box(super::translate(&node, &chain_prefix, &service, &slices).ok());
            }
            super::translate(&node, &chain_prefix, &service, &slices)
        }
    }

    wasmplane_sdk::export_service_translator!(DefaultTranslator);
}

#[cfg(all(target_family = "wasm", feature = "bench-encoded"))]
mod export_encoded {
    wit_bindgen::generate!({ path: "bench-encoded.wit", world: "encoded-translation" });

    struct EncodedTranslator;

    impl exports::wasmplane::bench::encoded_translator::Guest for EncodedTranslator {
        fn translate(input: Vec<u8>) -> Vec<u8> {
            super::translate_encoded(&input)
        }
    }

    export!(EncodedTranslator);
}

/// The shipped build: the `archived-service-translation` world (package 1.2.0), which costs
/// what native code does (BENCHMARKS.md, fiftieth run).
#[cfg(all(
    target_family = "wasm",
    not(any(feature = "typed-world", feature = "bench-repeat", feature = "bench-encoded", feature = "bench-batch"))
))]
mod export_archived {
    wasmplane_sdk::export_archived_translator!(super::archived::DefaultTranslator);
}

pub mod archived;

#[cfg(all(target_family = "wasm", feature = "bench-batch"))]
mod export_batch {
    wit_bindgen::generate!({
        path: "bench-batch",
        world: "batch-translation",
        // The SDK's types, so the same `translate` runs on what arrives.
        with: { "wasmplane:dataplane/types@1.2.0": wasmplane_sdk::types },
    });

    use exports::wasmplane::bench_batch::batch_translator::{Guest, ServiceInputs};
    use wasmplane_sdk::types::*;

    struct BatchTranslator;

    impl Guest for BatchTranslator {
        fn translate_batch(node: NodeContext, services: Vec<ServiceInputs>) -> Vec<Result<Ruleset, GuestError>> {
            services.iter().map(|s| super::translate(&node, &s.chain_prefix, &s.service, &s.slices)).collect()
        }
    }

    export!(BatchTranslator);
}

/// The runtime bench's serialized boundary (feature `bench-encoded`, never shipped): decodes
/// the inputs from one postcard buffer, translates, encodes the result into another. The
/// bench runs it both in Wasm (`bench-encoded.wit`) and natively.
#[cfg(feature = "bench-encoded")]
pub fn translate_encoded(input: &[u8]) -> Vec<u8> {
    let result = match postcard::from_bytes::<EncodedInputs>(input) {
        Ok((node, prefix, service, slices)) => translate(&node, &prefix, &service, &slices),
        Err(e) => Err(GuestError { message: format!("decoding the input: {e}") }),
    };
    postcard::to_allocvec(&result).expect("serializing into a Vec cannot fail")
}

/// What `translate_encoded` decodes its input buffer into.
#[cfg(feature = "bench-encoded")]
pub type EncodedInputs = (NodeContext, String, Service, Vec<EndpointSlice>);

/// The input buffer of `translate_encoded`.
#[cfg(feature = "bench-encoded")]
pub fn encode_inputs(node: &NodeContext, chain_prefix: &str, service: &Service, slices: &[EndpointSlice]) -> Vec<u8> {
    postcard::to_allocvec(&(node, chain_prefix, service, slices)).expect("serializing into a Vec cannot fail")
}

/// The result in an output buffer of `translate_encoded`.
#[cfg(feature = "bench-encoded")]
pub fn decode_output(output: &[u8]) -> Result<Result<Ruleset, GuestError>, postcard::Error> {
    postcard::from_bytes(output)
}

/// The runtime bench's build (feature `bench-repeat`, never shipped) translates a service
/// this many times per call, its label `wasmplane.io/bench-repeat` (default 1): the extra
/// runs are the guest's own work with no boundary crossing, timed against native.
pub const BENCH_REPEAT_LABEL: &str = "wasmplane.io/bench-repeat";

#[cfg(feature = "bench-repeat")]
fn bench_repeat(service: &Service) -> u32 {
    service.labels.iter().find(|l| l.key == BENCH_REPEAT_LABEL).and_then(|l| l.value.parse().ok()).unwrap_or(1)
}

/// One endpoint address chosen for a service port, with its resolved target port.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Backend {
    address: String,
    port: u16,
}

/// Endpoints of one service port, split the way kube-proxy's `CategorizeEndpoints` does.
#[derive(Default, Debug)]
struct PortEndpoints {
    cluster: Vec<Backend>,
    local: Vec<Backend>,
}

fn same_family(a: &str, b: &str) -> bool {
    a.contains(':') == b.contains(':')
}

/// The WIT family of an address or CIDR.
fn address_family(address: &str) -> AddressFamily {
    if address.contains(':') { AddressFamily::Ipv6 } else { AddressFamily::Ipv4 }
}

/// Ready endpoints, or, when none is ready, serving-and-terminating ones (so connections
/// drain during rolling updates instead of being rejected).
fn categorize(port: &ServicePort, slices: &[EndpointSlice], family_of: &str) -> PortEndpoints {
    let mut ready = (Vec::new(), Vec::new());
    let mut terminating = (Vec::new(), Vec::new());
    for slice in slices {
        let Some(ep_port) =
            slice.ports.iter().find(|p| p.name == port.name && p.protocol == port.protocol).or_else(|| {
                match &port.target_port {
                    // A slice without names for a single-port service still matches by number.
                    TargetPort::Number(n) if slice.ports.len() == 1 && slice.ports[0].name.is_empty() => {
                        slice.ports.iter().find(|p| p.port == *n)
                    }
                    _ => None,
                }
            })
        else {
            continue;
        };
        for ep in &slice.endpoints {
            let Some(address) = ep.addresses.first() else { continue };
            if !same_family(address, family_of) {
                continue;
            }
            let backend = Backend { address: address.clone(), port: ep_port.port };
            let bucket = if ep.ready {
                &mut ready
            } else if ep.serving && ep.terminating {
                &mut terminating
            } else {
                continue;
            };
            if ep.is_local {
                bucket.1.push(backend.clone());
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
    let cluster = pick(ready.0, terminating.0);
    let local = pick(ready.1, terminating.1);
    PortEndpoints { cluster, local }
}

/// A port's endpoints in each address family, categorized once per port.
struct ByFamily {
    v4: PortEndpoints,
    v6: PortEndpoints,
}

impl ByFamily {
    fn new(port: &ServicePort, slices: &[EndpointSlice]) -> ByFamily {
        ByFamily { v4: categorize(port, slices, "0.0.0.0"), v6: categorize(port, slices, "::") }
    }

    /// The endpoints of `address`'s family.
    fn of(&self, address: &str) -> &PortEndpoints {
        if address.contains(':') { &self.v6 } else { &self.v4 }
    }
}

fn port_id(port: &ServicePort) -> String {
    let name = if port.name.is_empty() { port.port.to_string() } else { port.name.clone() };
    format!("{}/{}", protocol_name(port.protocol), name)
}

/// nftables identifiers allow `[A-Za-z0-9/._-]`; IPv6 colons become dashes.
fn address_id(address: &str) -> String {
    address.replace(':', "-")
}

/// Emits the rules that pick one of a port's backends, the client sets session affinity
/// needs, and collects the backends as hairpin endpoints.
struct PortRules<'a> {
    prefix: String,
    affinity: Option<u32>,
    protocol: Protocol,
    ruleset: &'a mut Ruleset,
    /// Affinity sets declared so far (a backend may be drawn from two chains of the port).
    affinity_sets: BTreeSet<String>,
    hairpin: &'a mut BTreeSet<String>,
}

impl PortRules<'_> {
    /// The set of clients that last reached `backend` (session affinity), declared once.
    fn affinity_set(&mut self, backend: &Backend, timeout: u32) -> String {
        let name = format!("{}/ep/{}/{}/affinity", self.prefix, address_id(&backend.address), backend.port);
        if self.affinity_sets.insert(name.clone()) {
            self.ruleset.sets.push(SetDeclaration {
                name: name.clone(),
                family: address_family(&backend.address),
                timeout_seconds: Some(timeout),
                elements: vec![],
            });
        }
        name
    }

    /// A uniform pick: rule i matches with probability 1/(n-i) among what is left, the last
    /// one always; each DNATs. With session affinity, rules that send a remembered client
    /// back to its backend come first, and every DNAT (re)records the client in the
    /// backend's set. All in the calling chain: kube-proxy's chain per endpoint would cost
    /// every kernel commit a walk over it (see the module doc).
    fn pick_rules(&mut self, backends: &[Backend]) -> Vec<Rule> {
        self.hairpin.extend(backends.iter().map(|b| b.address.clone()));
        let n = backends.len() as u32;
        let draw = |i: usize| {
            let left = n - i as u32;
            if left > 1 { RuleBuilder::new().random(left, 0) } else { RuleBuilder::new() }
        };
        let protocol = self.protocol;
        let Some(timeout) = self.affinity else {
            return backends
                .iter()
                .enumerate()
                .map(|(i, b)| draw(i).protocol(protocol).dnat(&b.address, b.port).build())
                .collect();
        };
        let sets: Vec<String> = backends.iter().map(|b| self.affinity_set(b, timeout)).collect();
        let remember = |set: &str| {
            RuleStatement::AddSourceToSet(SetUpdate { set: set.to_string(), timeout_seconds: Some(timeout) })
        };
        let mut rules = Vec::with_capacity(backends.len() * 2);
        for (b, set) in backends.iter().zip(&sets) {
            rules.push(
                RuleBuilder::new()
                    .source_in_set(set)
                    .protocol(protocol)
                    .statement(remember(set))
                    .dnat(&b.address, b.port)
                    .build(),
            );
        }
        for (i, (b, set)) in backends.iter().zip(&sets).enumerate() {
            rules.push(draw(i).protocol(protocol).statement(remember(set)).dnat(&b.address, b.port).build());
        }
        rules
    }
}

/// Translates one service into its dataplane objects. The node context is not needed: pods
/// are told from other sources as the host detects them (`pod-traffic`), and the host
/// leaves out the rules of a family it cannot detect pods in.
pub fn translate(
    _node: &NodeContext,
    chain_prefix: &str,
    service: &Service,
    slices: &[EndpointSlice],
) -> Result<Ruleset, GuestError> {
    let mut ruleset = Ruleset { chains: vec![], sets: vec![], map_elements: vec![], warnings: vec![] };
    if service.service_type == ServiceType::ExternalName {
        return Ok(ruleset);
    }
    let cluster_ips: Vec<&String> =
        service.cluster_ips.iter().filter(|ip| !ip.is_empty() && ip.as_str() != "None").collect();
    if cluster_ips.is_empty() {
        // Headless: DNS only, nothing for the dataplane.
        return Ok(ruleset);
    }
    for ip in cluster_ips.iter().copied().chain(&service.external_ips).chain(&service.load_balancer_ips) {
        if ip.parse::<Cidr>().map(|c| c.prefix_len != if c.is_ipv4() { 32 } else { 128 }).unwrap_or(true) {
            return Err(GuestError {
                message: format!("service {}/{}: invalid IP {ip:?}", service.namespace, service.name),
            });
        }
    }
    let primary_family = cluster_ips[0].as_str();
    let mut hairpin = BTreeSet::new();
    for port in &service.ports {
        translate_port(chain_prefix, service, port, slices, primary_family, &cluster_ips, &mut ruleset, &mut hairpin);
    }
    // Many services may name the same endpoint here: the host keeps it while one does.
    ruleset.map_elements.extend(hairpin.into_iter().map(|address| MapElement {
        map_name: "hairpin".into(),
        key: vec![KeyPart::Address(address)],
        verdict: Verdict::None,
    }));
    if !service.ports.is_empty() {
        // The host rejects new connections to these addresses on ports no service port
        // handles (kube-proxy's `cluster-ips` set), so they fail at once instead of being
        // routed on. External and load-balancer IPs are not ours to close.
        for ip in &cluster_ips {
            ruleset.map_elements.push(MapElement {
                map_name: "cluster-ips".into(),
                key: vec![KeyPart::Address(ip.to_string())],
                verdict: Verdict::None,
            });
        }
    }
    Ok(ruleset)
}

#[allow(clippy::too_many_arguments)]
fn translate_port(
    chain_prefix: &str,
    service: &Service,
    port: &ServicePort,
    slices: &[EndpointSlice],
    family_of: &str,
    cluster_ips: &[&String],
    ruleset: &mut Ruleset,
    hairpin: &mut BTreeSet<String>,
) {
    let by_family = ByFamily::new(port, slices);
    let endpoints = by_family.of(family_of);
    let prefix = format!("{chain_prefix}/{}", port_id(port));
    let has_external = !service.external_ips.is_empty()
        || !service.load_balancer_ips.is_empty()
        || (port.node_port != 0 && matches!(service.service_type, ServiceType::NodePort | ServiceType::LoadBalancer));
    // Load balancing as data needs nothing decided per connection but the pick (and the
    // host's affinity): no external Local policy (it sends cluster sources elsewhere), and
    // no more backends per frontend than the host picks among.
    let as_data = !(has_external && service.external_traffic_policy == TrafficPolicy::Local)
        && cluster_ips
            .iter()
            .copied()
            .chain(&service.external_ips)
            .chain(&service.load_balancer_ips)
            .all(|ip| by_family.of(ip).cluster.len() <= MAX_BACKENDS_PER_FRONTEND)
        && [&by_family.v4, &by_family.v6].iter().all(|family| family.cluster.len() <= MAX_BACKENDS_PER_FRONTEND);
    if as_data {
        translate_port_as_data(service, port, &by_family, cluster_ips, ruleset, hairpin);
        return;
    }
    let cluster_backends = if service.internal_traffic_policy == TrafficPolicy::Local {
        endpoints.local.clone()
    } else {
        endpoints.cluster.clone()
    };
    let external_local = service.external_traffic_policy == TrafficPolicy::Local;
    let external_backends = if external_local { &endpoints.local } else { &endpoints.cluster };

    let mut rules = PortRules {
        prefix: prefix.clone(),
        affinity: service.session_affinity_timeout,
        protocol: port.protocol,
        ruleset,
        affinity_sets: BTreeSet::new(),
        hairpin,
    };
    // Pods are told from other sources as the host detects them (`pod-traffic`: kube-proxy's
    // `--detect-local-mode`), in one rule however many CIDRs, of the chain's family. Where the
    // node has no detector for it (by source address, no cluster CIDR of the family), the
    // host leaves the rule out, as kube-proxy writes none: by interface it has one anyway.
    let pods = address_family(family_of);

    // Cluster-IP traffic.
    let service_chain = prefix.clone();
    if cluster_backends.is_empty() {
        // Like kube-proxy: no endpoints at all rejects; internalTrafficPolicy Local with
        // endpoints only on other nodes drops (the client is not told to go elsewhere).
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
        for ip in cluster_ips {
            rules.ruleset.map_elements.push(service_map_element(
                "no-endpoint-services",
                ip,
                port.protocol,
                port.port,
                verdict.clone(),
            ));
        }
    } else {
        let mut chain_rules = Vec::new();
        for ip in cluster_ips.iter().filter(|ip| same_family(ip, family_of)) {
            // Off-cluster sources reaching a cluster IP must be masqueraded so replies return.
            chain_rules.push(
                RuleBuilder::new()
                    .destination(ip)
                    .protocol(port.protocol)
                    .dport(port.port)
                    .not_from_pods(pods)
                    .masquerade(),
            );
        }
        chain_rules.extend(rules.pick_rules(&cluster_backends));
        rules.ruleset.chains.push(Chain { name: service_chain.clone(), rules: chain_rules });
        for ip in cluster_ips {
            rules.ruleset.map_elements.push(service_map_element(
                "service-ips",
                ip,
                port.protocol,
                port.port,
                Verdict::Goto(service_chain.clone()),
            ));
        }
    }

    if !has_external {
        return;
    }
    // External traffic: NodePorts, externalIPs, LoadBalancer ingress IPs.
    let external_verdict = if external_backends.is_empty() {
        // Local policy without local endpoints drops (the load balancer should route elsewhere);
        // no endpoints at all rejects, like cluster traffic.
        if external_local && !endpoints.cluster.is_empty() { Verdict::Drop } else { Verdict::Reject }
    } else {
        let external_chain = format!("{prefix}/external");
        let mut chain_rules = Vec::new();
        if external_local {
            // Pods using the external address are short-circuited to the cluster chain;
            // everything else keeps its source IP and goes to a node-local endpoint.
            if !cluster_backends.is_empty() {
                chain_rules.push(RuleBuilder::new().from_pods(pods).goto(&service_chain));
            }
            let local_chain = format!("{prefix}/local");
            let pick = rules.pick_rules(external_backends);
            rules.ruleset.chains.push(Chain { name: local_chain.clone(), rules: pick });
            chain_rules.push(RuleBuilder::new().goto(&local_chain));
        } else {
            chain_rules.push(RuleBuilder::new().masquerade());
            if cluster_backends.is_empty() {
                // internalTrafficPolicy Local left the cluster chain empty: pick directly.
                chain_rules.extend(rules.pick_rules(external_backends));
            } else {
                chain_rules.push(RuleBuilder::new().goto(&service_chain));
            }
        }
        rules.ruleset.chains.push(Chain { name: external_chain.clone(), rules: chain_rules });
        Verdict::Goto(external_chain)
    };
    let (ok_ips, ok_ports, none_ips, none_ports) =
        ("service-ips", "service-nodeports", "no-endpoint-services", "no-endpoint-nodeports");
    let routed = matches!(external_verdict, Verdict::Goto(_));
    for ip in service.external_ips.iter().chain(&service.load_balancer_ips) {
        let map = if routed { ok_ips } else { none_ips };
        rules.ruleset.map_elements.push(service_map_element(
            map,
            ip,
            port.protocol,
            port.port,
            external_verdict.clone(),
        ));
    }
    if port.node_port != 0 && matches!(service.service_type, ServiceType::NodePort | ServiceType::LoadBalancer) {
        let map = if routed { ok_ports } else { none_ports };
        rules.ruleset.map_elements.push(port_map_element(map, port.protocol, port.node_port, external_verdict.clone()));
    }
}

/// The most backends one frontend may name in the host's `service-backends` map.
pub const MAX_BACKENDS_PER_FRONTEND: usize = 32;

/// The longest session affinity timeout a Service may ask for (a day, as Kubernetes
/// validates it); the host's affinity map families are named for timeouts in `1..=` this.
pub const MAX_AFFINITY_TIMEOUT_SECONDS: u32 = 86400;

/// One port as data: each frontend names its backends (of the frontend's address family)
/// and how it is masqueraded; the host's shard chains DNAT. A node port names its backends
/// of both families in `nodeport-backends`. With session affinity, each frontend with
/// backends is also an element of `session-affinity-<seconds>` (a node port of
/// `nodeport-affinity-<seconds>`): the host sends a client back to the backend it reached.
#[allow(clippy::too_many_arguments)]
fn translate_port_as_data(
    service: &Service,
    port: &ServicePort,
    by_family: &ByFamily,
    cluster_ips: &[&String],
    ruleset: &mut Ruleset,
    hairpin: &mut BTreeSet<String>,
) {
    let internal_local = service.internal_traffic_policy == TrafficPolicy::Local;
    // A valid Service has 1..=86400 seconds; clamped so the map name is always one the host has.
    let affinity = service.session_affinity_timeout.map(|t| t.clamp(1, MAX_AFFINITY_TIMEOUT_SECONDS));
    let key = |ip: &str| vec![KeyPart::Address(ip.into()), KeyPart::Protocol(port.protocol), KeyPart::Port(port.port)];
    // A frontend with backends: one element per backend, its masquerading and its affinity.
    let mut balance = |ruleset: &mut Ruleset, ip: &str, backends: &[Backend], masquerade: Option<&str>| {
        for b in backends {
            let mut k = key(ip);
            k.extend([KeyPart::Address(b.address.clone()), KeyPart::Port(b.port)]);
            ruleset.map_elements.push(MapElement {
                map_name: "service-backends".into(),
                key: k,
                verdict: Verdict::None,
            });
            hairpin.insert(b.address.clone());
        }
        if let Some(set) = masquerade {
            ruleset.map_elements.push(MapElement { map_name: set.into(), key: key(ip), verdict: Verdict::None });
        }
        if let Some(t) = affinity {
            ruleset.map_elements.push(MapElement {
                map_name: format!("session-affinity-{t}"),
                key: key(ip),
                verdict: Verdict::None,
            });
        }
    };

    // Cluster IPs, each with the endpoints of its own family.
    for ip in cluster_ips {
        let endpoints = by_family.of(ip);
        let backends = if internal_local { &endpoints.local } else { &endpoints.cluster };
        if backends.is_empty() {
            // Like kube-proxy: no endpoints at all rejects; internalTrafficPolicy Local with
            // endpoints only on other nodes drops (the client is not told to go elsewhere).
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
            ruleset.map_elements.push(service_map_element(
                "no-endpoint-services",
                ip,
                port.protocol,
                port.port,
                verdict,
            ));
            continue;
        }
        // Off-cluster sources reaching a cluster IP are masqueraded so replies return (the
        // host tells them as it detects pods, and masquerades none in a family it cannot
        // detect them in, as the chain's `pod-traffic` rule in `translate_port`).
        balance(ruleset, ip, backends, Some("masquerade-off-cluster"));
    }

    // External IPs and load-balancer IPs (externalTrafficPolicy Cluster): masqueraded.
    for ip in service.external_ips.iter().chain(&service.load_balancer_ips) {
        let endpoints = by_family.of(ip);
        if endpoints.cluster.is_empty() {
            ruleset.map_elements.push(service_map_element(
                "no-endpoint-services",
                ip,
                port.protocol,
                port.port,
                Verdict::Reject,
            ));
        } else {
            balance(ruleset, ip, &endpoints.cluster, Some("masquerade-always"));
        }
    }

    if port.node_port == 0 || !matches!(service.service_type, ServiceType::NodePort | ServiceType::LoadBalancer) {
        return;
    }
    // The node port: each address family over its own endpoints, always masqueraded.
    let backends: Vec<&Backend> = by_family.v4.cluster.iter().chain(&by_family.v6.cluster).collect();
    if backends.is_empty() {
        ruleset.map_elements.push(port_map_element(
            "no-endpoint-nodeports",
            port.protocol,
            port.node_port,
            Verdict::Reject,
        ));
        return;
    }
    for b in backends {
        ruleset.map_elements.push(MapElement {
            map_name: "nodeport-backends".into(),
            key: vec![
                KeyPart::Protocol(port.protocol),
                KeyPart::Port(port.node_port),
                KeyPart::Address(b.address.clone()),
                KeyPart::Port(b.port),
            ],
            verdict: Verdict::None,
        });
        hairpin.insert(b.address.clone());
    }
    if let Some(t) = affinity {
        ruleset.map_elements.push(MapElement {
            map_name: format!("nodeport-affinity-{t}"),
            key: vec![KeyPart::Protocol(port.protocol), KeyPart::Port(port.node_port)],
            verdict: Verdict::None,
        });
    }
}

#[cfg(test)]
mod tests;
