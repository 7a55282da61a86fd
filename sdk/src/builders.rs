//! Builders for the typed dataplane objects guests return.

use crate::types::*;

/// Builds one [`Rule`] fluently: `RuleBuilder::new().protocol(Protocol::Tcp).dport(80).goto("x")`.
#[derive(Default)]
pub struct RuleBuilder {
    rule: Option<Rule>,
}

impl RuleBuilder {
    pub fn new() -> Self {
        RuleBuilder {
            rule: Some(Rule { matches: Vec::new(), statements: Vec::new(), verdict: Verdict::None, comment: None }),
        }
    }

    fn rule(&mut self) -> &mut Rule {
        self.rule.as_mut().expect("builder used after build")
    }

    pub fn matching(mut self, m: RuleMatch) -> Self {
        self.rule().matches.push(m);
        self
    }
    pub fn source(self, cidr: &str) -> Self {
        self.matching(RuleMatch::Source(AddressMatch { cidr: cidr.into(), negate: false }))
    }
    pub fn source_not(self, cidr: &str) -> Self {
        self.matching(RuleMatch::Source(AddressMatch { cidr: cidr.into(), negate: true }))
    }
    /// Traffic from pods, as the host detects it (the `pod-traffic` match, since WIT 1.1.0):
    /// what kube-proxy calls local traffic, by the node's `--detect-local-mode`. By source
    /// address (`ClusterCIDR`, `NodeCIDR`) the host renders `ip saddr @cluster-cidrs`, or
    /// `ip6 saddr @cluster-cidrs6` for [`AddressFamily::Ipv6`], the set holding the cluster's
    /// pod CIDRs or this node's; by interface it renders `iifname "veth*"`
    /// (`InterfaceNamePrefix`, the configured prefix) or `iifname "cbr0"` (`BridgeInterface`,
    /// the configured bridge), and `family` is not used.
    ///
    /// Unlike matching the node context's `cluster_cidrs` with [`source`](Self::source), a
    /// rule with it follows whichever mode the node runs, and is one rule however many CIDRs
    /// there are. Where the node cannot detect pods in `family` (by source address, with no
    /// cluster CIDR of it) the host leaves the rule out, from pods or not, as kube-proxy
    /// writes none without a detector: no need to check `cluster_cidrs` first.
    pub fn from_pods(self, family: AddressFamily) -> Self {
        self.matching(RuleMatch::PodTraffic(PodTrafficMatch { family, negate: false }))
    }
    /// Traffic from anywhere but pods: [`from_pods`](Self::from_pods) negated (`ip saddr !=
    /// @cluster-cidrs`, `iifname != "veth*"`), e.g. to masquerade sources off the cluster.
    /// Left out as `from_pods` is where the node cannot detect pods in `family`.
    pub fn not_from_pods(self, family: AddressFamily) -> Self {
        self.matching(RuleMatch::PodTraffic(PodTrafficMatch { family, negate: true }))
    }
    pub fn destination(self, cidr: &str) -> Self {
        self.matching(RuleMatch::Destination(AddressMatch { cidr: cidr.into(), negate: false }))
    }
    pub fn protocol(self, p: Protocol) -> Self {
        self.matching(RuleMatch::Protocol(p))
    }
    pub fn dport(self, port: u16) -> Self {
        self.matching(RuleMatch::DestinationPort(port))
    }
    pub fn source_in_set(self, set: &str) -> Self {
        self.matching(RuleMatch::SourceInSet(set.into()))
    }
    /// Matches with probability 1/`modulus` … expressed as `numgen random mod m == v`.
    pub fn random(self, modulus: u32, value: u32) -> Self {
        self.matching(RuleMatch::Random((modulus, value)))
    }
    pub fn statement(mut self, s: RuleStatement) -> Self {
        self.rule().statements.push(s);
        self
    }
    pub fn dnat(self, address: &str, port: u16) -> Self {
        self.statement(RuleStatement::Dnat(DnatTarget { address: address.into(), port }))
    }
    pub fn comment(mut self, c: impl Into<String>) -> Self {
        self.rule().comment = Some(c.into());
        self
    }
    pub fn verdict(mut self, v: Verdict) -> Rule {
        let mut rule = self.rule.take().expect("builder used after build");
        rule.verdict = v;
        rule
    }
    pub fn jump(self, chain: &str) -> Rule {
        self.verdict(Verdict::Jump(chain.into()))
    }
    pub fn goto(self, chain: &str) -> Rule {
        self.verdict(Verdict::Goto(chain.into()))
    }
    pub fn masquerade(self) -> Rule {
        self.verdict(Verdict::Masquerade)
    }
    pub fn build(self) -> Rule {
        self.verdict(Verdict::None)
    }
}

/// `address . protocol . port : verdict` for one of the host's service maps.
pub fn service_map_element(map: &str, address: &str, protocol: Protocol, port: u16, verdict: Verdict) -> MapElement {
    MapElement {
        map_name: map.into(),
        key: vec![KeyPart::Address(address.into()), KeyPart::Protocol(protocol), KeyPart::Port(port)],
        verdict,
    }
}

/// `protocol . port : verdict` for one of the host's node-port maps.
pub fn port_map_element(map: &str, protocol: Protocol, port: u16, verdict: Verdict) -> MapElement {
    MapElement { map_name: map.into(), key: vec![KeyPart::Protocol(protocol), KeyPart::Port(port)], verdict }
}

/// Lower-case protocol name as nftables and Kubernetes write it.
pub fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_traffic_matches_carry_family_and_negation() {
        let rule = RuleBuilder::new().not_from_pods(AddressFamily::Ipv6).from_pods(AddressFamily::Ipv4).masquerade();
        assert_eq!(
            rule.matches,
            vec![
                RuleMatch::PodTraffic(PodTrafficMatch { family: AddressFamily::Ipv6, negate: true }),
                RuleMatch::PodTraffic(PodTrafficMatch { family: AddressFamily::Ipv4, negate: false }),
            ]
        );
        assert_eq!(rule.verdict, Verdict::Masquerade);
    }
}
