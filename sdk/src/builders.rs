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
