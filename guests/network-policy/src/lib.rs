//! The default network-policy guest: one Kubernetes NetworkPolicy (v1, complete) in, the
//! nftables filter objects that enforce it on this node out.
//!
//! ## Output shape (what the host composes)
//!
//! For each policy type the policy has (`ingress`/`egress` is `None` when that type is not
//! in `policyTypes`):
//! - one *policy chain* `<prefix>/ingress` (or `/egress`) holding one `accept` rule per
//!   (peer match × port match) of each rule, in order. It accepts what the policy allows and
//!   falls off its end (returns) otherwise: it never drops, so policies compose.
//! - peer pods live in *shared named sets*, one per distinct selection of peers and address
//!   family (`pol/_shared/peers/<hash>/v4`, named by a canonical form of the rule's
//!   selectors: see `wasmplane_sdk::shared`): every policy allowing the same peers uses the
//!   same set, and a peer pod appearing, leaving or changing its IP changes set elements
//!   only, never a chain. ipBlocks are CIDR matches in the rule, each `except` a negated
//!   match (they are spec, not cluster state).
//! - one `pod-ingress` / `pod-egress` map element per IP of every selected pod on this node,
//!   `jump`ing to the policy chain.
//!
//! The host owns the maps. One map key holds one verdict, and several policies may select
//! the same pod, so the host merges every policy's elements for one pod address into a
//! host-built per-pod *dispatch chain* (`jump` each policy chain in turn, then `drop`, or
//! log + count + accept in audit mode) and points the map key at it: the pod gets the union
//! of its policies (default deny for the selected pod, whatever any policy allows passes).
//! Return traffic of allowed connections is accepted by the host's base chains
//! (`ct state established,related accept`) before any map lookup.
//!
//! ## Named ports
//! Ingress: resolved against the selected local pods (the destination). When they all
//! resolve a name to the same number the rule matches the port alone; otherwise one rule per
//! number, restricted to the pods resolving to it (a destination set). Egress: resolved
//! against the destination pods: the peer pods of the rule (every pod, when the rule has no
//! peers), grouped by number into destination sets. A named port never matches an ipBlock
//! destination (no pod to resolve it against).

use std::collections::{BTreeMap, BTreeSet};

use wasmplane_sdk::lookups::Lookups;
use wasmplane_sdk::shared::{put_bytes, put_str, selector_key, shared_set_name};
use wasmplane_sdk::types::*;
use wasmplane_sdk::{Cidr, selector};

#[cfg(target_family = "wasm")]
mod export {
    use wasmplane_sdk::policy::exports::wasmplane::dataplane::network_policy::Guest;
    use wasmplane_sdk::types::*;

    struct DefaultPolicy;

    impl Guest for DefaultPolicy {
        fn compile(
            node: NodeContext,
            chain_prefix: String,
            policy: NetworkPolicy,
            local_pods: Vec<Pod>,
        ) -> Result<Ruleset, GuestError> {
            super::compile(&node, &chain_prefix, &policy, &local_pods, &wasmplane_sdk::lookups::HostLookups)
        }
    }

    wasmplane_sdk::export_network_policy!(DefaultPolicy);
}

/// The host map a direction's elements go to.
pub const INGRESS_MAP: &str = "pod-ingress";
pub const EGRESS_MAP: &str = "pod-egress";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
    fn map(self) -> &'static str {
        match self {
            Direction::Ingress => INGRESS_MAP,
            Direction::Egress => EGRESS_MAP,
        }
    }
    /// Matches the remote end of the connection (source for ingress, destination for egress).
    fn peer(self, cidr: String, negate: bool) -> RuleMatch {
        let a = AddressMatch { cidr, negate };
        match self {
            Direction::Ingress => RuleMatch::Source(a),
            Direction::Egress => RuleMatch::Destination(a),
        }
    }
    fn peer_in_set(self, set: String) -> RuleMatch {
        match self {
            Direction::Ingress => RuleMatch::SourceInSet(set),
            Direction::Egress => RuleMatch::DestinationInSet(set),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn of(ip: &str) -> Family {
        if ip.contains(':') { Family::V6 } else { Family::V4 }
    }
    fn suffix(self) -> &'static str {
        match self {
            Family::V4 => "v4",
            Family::V6 => "v6",
        }
    }
    fn wit(self) -> AddressFamily {
        match self {
            Family::V4 => AddressFamily::Ipv4,
            Family::V6 => AddressFamily::Ipv6,
        }
    }
}

fn error(policy: &NetworkPolicy, message: String) -> GuestError {
    GuestError { message: format!("networkpolicy {}/{}: {message}", policy.namespace, policy.name) }
}

/// The address families the cluster uses (both when the host does not say).
fn families(node: &NodeContext) -> BTreeSet<Family> {
    let f: BTreeSet<Family> = node.cluster_cidrs.iter().map(|c| Family::of(c)).collect();
    if f.is_empty() { [Family::V4, Family::V6].into() } else { f }
}

/// Compiles one policy. `local_pods`: the pods on this node the policy selects.
pub fn compile(
    node: &NodeContext,
    chain_prefix: &str,
    policy: &NetworkPolicy,
    local_pods: &[Pod],
    lookups: &dyn Lookups,
) -> Result<Ruleset, GuestError> {
    let mut out = Ruleset { chains: vec![], sets: vec![], map_elements: vec![], warnings: vec![] };
    // The host passes the selected pods; re-checking keeps the guest correct on its own.
    let mut targets: Vec<&Pod> = local_pods
        .iter()
        .filter(|p| {
            !p.host_network && p.namespace == policy.namespace && selector::matches(&policy.pod_selector, &p.labels)
        })
        .collect();
    targets.sort_by(|a, b| a.ips.cmp(&b.ips));
    let families = families(node);
    for (direction, rules) in [(Direction::Ingress, &policy.ingress), (Direction::Egress, &policy.egress)] {
        let Some(rules) = rules else { continue };
        let chain = format!("{chain_prefix}/{}", direction.name());
        let mut c = DirectionCompiler {
            policy,
            direction,
            chain: chain.clone(),
            families: &families,
            targets: &targets,
            lookups,
            rules: vec![],
            sets: &mut out.sets,
        };
        for (i, rule) in rules.iter().enumerate() {
            c.rule(i, rule)?;
        }
        out.chains.push(Chain { name: chain.clone(), rules: c.rules });
        let mut addresses = BTreeSet::new();
        for pod in &targets {
            addresses.extend(pod.ips.iter().filter(|ip| !ip.is_empty()).cloned());
        }
        for ip in addresses {
            out.map_elements.push(MapElement {
                map_name: direction.map().into(),
                key: vec![KeyPart::Address(ip)],
                verdict: Verdict::Jump(chain.clone()),
            });
        }
    }
    if out.map_elements.is_empty() && (policy.ingress.is_some() || policy.egress.is_some()) {
        out.warnings.push("selects no pod with an address on this node".into());
    }
    Ok(out)
}

struct DirectionCompiler<'a> {
    policy: &'a NetworkPolicy,
    direction: Direction,
    chain: String,
    families: &'a BTreeSet<Family>,
    /// The selected pods on this node (destinations of ingress, sources of egress).
    targets: &'a [&'a Pod],
    lookups: &'a dyn Lookups,
    rules: Vec<Rule>,
    /// The policy's sets, of both directions: rules with the same peers share a set.
    sets: &'a mut Vec<SetDeclaration>,
}

/// A port clause of a rule, before it is crossed with the peers.
enum PortClause {
    /// Matches on the packet's protocol/port only.
    Plain(Vec<RuleMatch>),
    /// Ingress named port resolving differently among the selected pods: the port, and the
    /// destination set of the pods it holds for.
    ForDestinations(Vec<RuleMatch>, Vec<RuleMatch>),
    /// Egress named port: complete matches (destination set + port); replaces the peers.
    Complete(Vec<RuleMatch>),
}

impl DirectionCompiler<'_> {
    /// Declares a set once (rules with the same peers name the same shared set).
    fn declare_set(&mut self, name: String, family: Family, mut elements: Vec<String>) -> String {
        if !self.sets.iter().any(|s| s.name == name) {
            elements.sort();
            elements.dedup();
            self.sets.push(SetDeclaration {
                name: name.clone(),
                family: family.wit(),
                timeout_seconds: None,
                elements,
            });
        }
        name
    }

    /// What identifies the pods one peer selects (see `wasmplane_sdk::shared`): the scope
    /// (this policy's namespace, or a namespace selector) and the pod selector.
    fn peer_key(&self, peer: &PolicyPeer) -> Vec<u8> {
        let everything = LabelSelector { match_labels: vec![], match_expressions: vec![] };
        let mut key = Vec::new();
        match &peer.namespace_selector {
            None => {
                key.push(0);
                put_str(&mut key, &self.policy.namespace);
            }
            Some(namespaces) => {
                key.push(1);
                selector_key(namespaces, &mut key);
            }
        }
        selector_key(peer.pod_selector.as_ref().unwrap_or(&everything), &mut key);
        key
    }

    /// Pods (with addresses) selected by one peer's selectors.
    fn peer_pods(&self, peer: &PolicyPeer) -> Vec<Pod> {
        let everything = LabelSelector { match_labels: vec![], match_expressions: vec![] };
        let pods = match (&peer.namespace_selector, &peer.pod_selector) {
            (None, None) => return vec![],
            (None, Some(pods)) => self.lookups.pods_matching(Some(&self.policy.namespace), None, pods),
            (Some(ns), pods) => self.lookups.pods_matching(None, Some(ns), pods.as_ref().unwrap_or(&everything)),
        };
        pods.into_iter().filter(|p| !p.host_network && !p.ips.is_empty()).collect()
    }

    fn rule(&mut self, index: usize, rule: &PolicyRule) -> Result<(), GuestError> {
        let base = format!("{}/{index}", self.chain);
        // Peers: `None` = every peer; else one match list per alternative.
        let mut peer_pods: Vec<Pod> = Vec::new();
        let peers: Option<Vec<Vec<RuleMatch>>> = if rule.peers.is_empty() {
            None
        } else {
            let mut alternatives = Vec::new();
            let mut any_selector = false;
            let mut peer_keys: Vec<Vec<u8>> = Vec::new();
            for peer in &rule.peers {
                match &peer.ip_block {
                    Some(block) => {
                        if peer.pod_selector.is_some() || peer.namespace_selector.is_some() {
                            return Err(error(self.policy, "a peer with ipBlock cannot also have selectors".into()));
                        }
                        alternatives.push(self.ip_block(block)?);
                    }
                    None => {
                        if peer.pod_selector.is_none() && peer.namespace_selector.is_none() {
                            return Err(error(
                                self.policy,
                                "a peer must have a podSelector, a namespaceSelector or an ipBlock".into(),
                            ));
                        }
                        any_selector = true;
                        peer_pods.extend(self.peer_pods(peer));
                        peer_keys.push(self.peer_key(peer));
                    }
                }
            }
            if any_selector {
                // The set holds the union of the peers' pods: named by their keys, in any order.
                peer_keys.sort_unstable();
                peer_keys.dedup();
                let mut key = Vec::new();
                for peer in &peer_keys {
                    put_bytes(&mut key, peer);
                }
                // Declared even when empty: a peer pod appearing later only adds elements.
                let mut families = self.families.clone();
                families.extend(peer_pods.iter().flat_map(|p| p.ips.iter()).map(|ip| Family::of(ip)));
                let mut in_sets = Vec::new();
                for family in families {
                    let ips = peer_pods
                        .iter()
                        .flat_map(|p| p.ips.iter())
                        .filter(|ip| Family::of(ip) == family)
                        .cloned()
                        .collect();
                    let set = self.declare_set(shared_set_name("peers", &key, family.suffix()), family, ips);
                    in_sets.push(vec![self.direction.peer_in_set(set)]);
                }
                alternatives.splice(0..0, in_sets);
            }
            Some(alternatives)
        };

        let mut clauses: Vec<PortClause> = Vec::new();
        if rule.ports.is_empty() {
            clauses.push(PortClause::Plain(vec![]));
        }
        for (j, port) in rule.ports.iter().enumerate() {
            let protocol = RuleMatch::Protocol(port.protocol);
            match (&port.port, port.end_port) {
                (PolicyPortNumber::Any, None) => clauses.push(PortClause::Plain(vec![protocol])),
                (PolicyPortNumber::Number(n), None) => {
                    clauses.push(PortClause::Plain(vec![protocol, RuleMatch::DestinationPort(*n)]))
                }
                (PolicyPortNumber::Number(n), Some(end)) => {
                    if end < *n {
                        return Err(error(self.policy, format!("endPort {end} is below port {n}")));
                    }
                    let m = if end == *n {
                        RuleMatch::DestinationPort(*n)
                    } else {
                        RuleMatch::DestinationPortRange((*n, end))
                    };
                    clauses.push(PortClause::Plain(vec![protocol, m]));
                }
                (_, Some(_)) => return Err(error(self.policy, "endPort is only allowed with a numeric port".into())),
                (PolicyPortNumber::Name(name), None) => {
                    let named = format!("{base}/port/{j}");
                    match self.direction {
                        Direction::Ingress => self.ingress_named(&named, name, port.protocol, &mut clauses),
                        Direction::Egress => {
                            let destinations = if rule.peers.is_empty() {
                                let everything = LabelSelector { match_labels: vec![], match_expressions: vec![] };
                                self.lookups.pods_matching(None, Some(&everything), &everything)
                            } else {
                                peer_pods.clone()
                            };
                            self.egress_named(&named, name, port.protocol, &destinations, &mut clauses)
                        }
                    }
                }
            }
        }

        let any_peer = vec![vec![]];
        let peer_alternatives = peers.as_ref().unwrap_or(&any_peer);
        for clause in clauses {
            let combos: Vec<Vec<RuleMatch>> = match clause {
                PortClause::Plain(port) => {
                    peer_alternatives.iter().map(|p| [p.clone(), port.clone()].concat()).collect()
                }
                PortClause::ForDestinations(port, dest) => {
                    peer_alternatives.iter().map(|p| [p.clone(), dest.clone(), port.clone()].concat()).collect()
                }
                PortClause::Complete(matches) => vec![matches],
            };
            for matches in combos {
                self.rules.push(Rule { matches, statements: vec![], verdict: Verdict::Accept, comment: None });
            }
        }
        Ok(())
    }

    fn ip_block(&self, block: &IpBlock) -> Result<Vec<RuleMatch>, GuestError> {
        let cidr: Cidr = block
            .cidr
            .parse()
            .map_err(|_| error(self.policy, format!("ipBlock cidr {:?} is not a CIDR", block.cidr)))?;
        let mut matches = vec![self.direction.peer(cidr.to_string(), false)];
        for except in &block.except {
            let e: Cidr =
                except.parse().map_err(|_| error(self.policy, format!("ipBlock except {except:?} is not a CIDR")))?;
            if e.is_ipv4() != cidr.is_ipv4() {
                return Err(error(
                    self.policy,
                    format!("ipBlock except {except} is not of the family of {}", block.cidr),
                ));
            }
            matches.push(self.direction.peer(e.to_string(), true));
        }
        Ok(matches)
    }

    /// Ingress named port: resolved on the selected pods (the destinations).
    fn ingress_named(&mut self, base: &str, name: &str, protocol: Protocol, clauses: &mut Vec<PortClause>) {
        let mut by_number: BTreeMap<u16, Vec<String>> = BTreeMap::new();
        let mut with_addresses = 0;
        for pod in self.targets {
            if pod.ips.is_empty() {
                continue;
            }
            with_addresses += 1;
            if let Some(p) = pod.ports.iter().find(|p| p.name == name && p.protocol == protocol) {
                by_number.entry(p.port).or_default().extend(pod.ips.iter().cloned());
            }
        }
        let uniform = by_number.len() == 1
            && by_number.values().next().is_some_and(|ips| {
                let pods = self.targets.iter().filter(|p| p.ips.iter().any(|ip| ips.contains(ip))).count();
                pods == with_addresses
            });
        for (number, ips) in by_number {
            let port = vec![RuleMatch::Protocol(protocol), RuleMatch::DestinationPort(number)];
            if uniform {
                clauses.push(PortClause::Plain(port));
                continue;
            }
            let families: BTreeSet<Family> = ips.iter().map(|ip| Family::of(ip)).collect();
            for family in families {
                let members = ips.iter().filter(|ip| Family::of(ip) == family).cloned().collect();
                let set = self.declare_set(format!("{base}/{number}/{}", family.suffix()), family, members);
                clauses.push(PortClause::ForDestinations(port.clone(), vec![RuleMatch::DestinationInSet(set)]));
            }
        }
    }

    /// Egress named port: resolved on the destination pods, grouped by number.
    fn egress_named(
        &mut self,
        base: &str,
        name: &str,
        protocol: Protocol,
        destinations: &[Pod],
        clauses: &mut Vec<PortClause>,
    ) {
        let mut by_number: BTreeMap<u16, Vec<String>> = BTreeMap::new();
        for pod in destinations.iter().filter(|p| !p.host_network) {
            if let Some(p) = pod.ports.iter().find(|p| p.name == name && p.protocol == protocol) {
                by_number.entry(p.port).or_default().extend(pod.ips.iter().cloned());
            }
        }
        for (number, ips) in by_number {
            let families: BTreeSet<Family> = ips.iter().map(|ip| Family::of(ip)).collect();
            for family in families {
                let members = ips.iter().filter(|ip| Family::of(ip) == family).cloned().collect();
                let set = self.declare_set(format!("{base}/{number}/{}", family.suffix()), family, members);
                clauses.push(PortClause::Complete(vec![
                    RuleMatch::DestinationInSet(set),
                    RuleMatch::Protocol(protocol),
                    RuleMatch::DestinationPort(number),
                ]));
            }
        }
    }
}

#[cfg(test)]
mod tests;
