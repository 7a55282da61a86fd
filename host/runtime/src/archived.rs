//! Service translators of the `archived-service-translator` interface (package 1.2.0): one
//! archive each way (`wasmplane-archive`), read in place on both sides.
//!
//! The host archives a call's inputs straight from its model (strings borrowed, addresses
//! parsed to integers: an address that does not parse never reaches a guest), the guest
//! returns an archive of its result, and the host checks every byte of it before anything
//! reads it ([`ArchivedOutput`]). Names are made by the host (`wasmplane_archive::Names`),
//! so an archived guest cannot name anything outside its service's prefix. Typed callers get
//! the result in the typed world's terms ([`ArchivedOutput::to_typed`]); the dataplane reads
//! it in place (`nft::validate_archived_service_output` in the host).

use std::net::IpAddr;

use wasmplane_archive as archive;
use wasmplane_model as m;
use wasmplane_model::state::{NodeContext, ServiceView};

use crate::{CallError, Limits, wit};

/// The node context with its addresses parsed, kept while it does not change (a full sync
/// translates every service with the same one).
pub struct ParsedContext {
    model: NodeContext,
    node_ips: Vec<IpAddr>,
    cluster_cidrs: Vec<(IpAddr, u8)>,
    pod_cidrs: Vec<(IpAddr, u8)>,
}

impl ParsedContext {
    /// The context's own entries that do not parse are left out: they are the host's
    /// configuration and the node's spec, which the dataplane checks and reports itself.
    pub fn new(context: &NodeContext) -> ParsedContext {
        let nets = |list: &[m::CompactString]| {
            (list.iter())
                .filter_map(|cidr| {
                    let (ip, len) = cidr.split_once('/')?;
                    Some((ip.parse().ok()?, len.parse().ok()?))
                })
                .collect()
        };
        ParsedContext {
            model: context.clone(),
            node_ips: context.node_ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
            cluster_cidrs: nets(&context.cluster_cidrs),
            pod_cidrs: nets(&context.pod_cidrs),
        }
    }

    /// `cache`'s context, parsed again only when `context` differs from it.
    pub fn cached<'c>(cache: &'c mut Option<ParsedContext>, context: &NodeContext) -> &'c ParsedContext {
        if cache.as_ref().is_none_or(|c| c.model != *context) {
            *cache = Some(ParsedContext::new(context));
        }
        cache.as_ref().expect("filled above")
    }
}

fn protocol(p: m::Protocol) -> archive::Protocol {
    match p {
        m::Protocol::Tcp => archive::Protocol::Tcp,
        m::Protocol::Udp => archive::Protocol::Udp,
        m::Protocol::Sctp => archive::Protocol::Sctp,
    }
}

/// Model → archive. A service address or an endpoint address that is not an
/// IP address refuses the service, as the default typed translator does for the former
/// (`CallError::Input`, with its text); headless markers are no address.
pub fn encode(context: &ParsedContext, prefix: &str, view: &ServiceView) -> Result<Vec<u8>, CallError> {
    let s = &view.service;
    let invalid = |ip: &str| CallError::Input(format!("service {}/{}: invalid IP {ip:?}", s.namespace, s.name));
    let addresses = |list: &[m::CompactString], headless: bool| -> Result<Vec<IpAddr>, CallError> {
        (list.iter())
            .filter(|ip| !(headless && (ip.is_empty() || ip.as_str() == "None")))
            .map(|ip| ip.parse().map_err(|_| invalid(ip)))
            .collect()
    };
    let nets = |list: &[(IpAddr, u8)]| {
        list.iter().map(|&(address, prefix_len)| archive::Net { address, prefix_len }).collect()
    };
    let mut slices = Vec::with_capacity(view.slices.len());
    for slice in &view.slices {
        let mut endpoints = Vec::with_capacity(slice.endpoints.len());
        for e in &slice.endpoints {
            endpoints.push(archive::Endpoint {
                addresses: addresses(&e.addresses, false)?,
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                node_name: e.node_name.as_deref(),
                zone: e.zone.as_deref(),
                is_local: e.is_local,
            });
        }
        slices.push(archive::Slice {
            name: &slice.name,
            endpoints,
            ports: (slice.ports.iter())
                .map(|p| archive::EndpointPort { name: &p.name, protocol: protocol(p.protocol), port: p.port })
                .collect(),
        });
    }
    let inputs = archive::Inputs {
        node: archive::NodeContext {
            node_name: &context.model.node_name,
            node_ips: context.node_ips.clone(),
            cluster_cidrs: nets(&context.cluster_cidrs),
            pod_cidrs: nets(&context.pod_cidrs),
        },
        chain_prefix: prefix,
        service: archive::Service {
            namespace: &s.namespace,
            name: &s.name,
            service_type: match s.service_type {
                m::ServiceType::ClusterIP => archive::ServiceType::ClusterIp,
                m::ServiceType::NodePort => archive::ServiceType::NodePort,
                m::ServiceType::LoadBalancer => archive::ServiceType::LoadBalancer,
                m::ServiceType::ExternalName => archive::ServiceType::ExternalName,
            },
            cluster_ips: addresses(&s.cluster_ips, true)?,
            external_ips: addresses(&s.external_ips, false)?,
            load_balancer_ips: addresses(&s.load_balancer_ips, false)?,
            ports: (s.ports.iter())
                .map(|p| archive::ServicePort {
                    name: &p.name,
                    protocol: protocol(p.protocol),
                    port: p.port,
                    node_port: p.node_port,
                    target_port: match &p.target_port {
                        m::TargetPort::Number(n) => archive::TargetPort::Number(*n),
                        m::TargetPort::Name(n) => archive::TargetPort::Name(n),
                    },
                })
                .collect(),
            session_affinity_timeout: s.session_affinity_timeout,
            external_traffic_local: s.external_traffic_policy == m::TrafficPolicy::Local,
            internal_traffic_local: s.internal_traffic_policy == m::TrafficPolicy::Local,
            labels: s.labels.iter().map(|(key, value)| archive::Label { key, value }).collect(),
        },
        slices,
    };
    Ok(archive::encode_inputs(&inputs, Vec::with_capacity(512)))
}

/// An archived translator's result, every byte checked: its inputs (the host's archive, for
/// the names its numbers stand for) and its ruleset, both read in place.
pub struct ArchivedOutput {
    input: Vec<u8>,
    output: Vec<u8>,
}

impl ArchivedOutput {
    /// Checks `output` (the guest's) against the size limits and the layout; the guest's own
    /// error is [`CallError::Guest`], cut to 1 KiB.
    pub(crate) fn check(output: Vec<u8>, limits: &Limits) -> Result<Vec<u8>, CallError> {
        if output.len() > limits.max_output_bytes {
            return Err(CallError::OutputTooLarge(format!(
                "{} bytes (limit {})",
                output.len(),
                limits.max_output_bytes
            )));
        }
        let ruleset = match archive::validate_result(&output) {
            Err(e) => return Err(CallError::InvalidOutput(format!("the result archive does not check: {e}"))),
            Ok(archive::rkyv::result::ArchivedResult::Err(message)) => {
                return Err(CallError::Guest(message.chars().take(1024).collect()));
            }
            Ok(archive::rkyv::result::ArchivedResult::Ok(ruleset)) => ruleset,
        };
        let rules: usize = ruleset.chains.iter().map(|c| c.rules.len()).sum();
        let objects =
            ruleset.elements.len() + ruleset.chains.len() + ruleset.sets.len() + ruleset.warnings.len() + rules;
        crate::host::check_output_size(objects, output.len(), "objects", limits)?;
        Ok(output)
    }

    /// `output` as [`check`](Self::check) passed it, with the `input` it was translated from.
    pub(crate) fn checked(input: Vec<u8>, output: Vec<u8>) -> ArchivedOutput {
        ArchivedOutput { input, output }
    }

    /// The inputs the guest was given.
    pub fn inputs(&self) -> &archive::ArchivedInputs<'static> {
        // SAFETY: the host wrote `input` with `archive::encode_inputs` (`encode`).
        unsafe { archive::inputs_in_place(&self.input) }
    }

    /// The guest's ruleset.
    pub fn ruleset(&self) -> &archive::ArchivedRuleset {
        // SAFETY: `check` checked every byte of `output` as this type, and an `Ok`.
        match unsafe {
            archive::rkyv::access_unchecked::<archive::rkyv::Archived<archive::TranslateResult>>(&self.output)
        } {
            archive::rkyv::result::ArchivedResult::Ok(ruleset) => ruleset,
            archive::rkyv::result::ArchivedResult::Err(_) => unreachable!("check passes only an Ok"),
        }
    }

    /// The names its numbers stand for: the service's prefix and port ids.
    pub fn names(&self) -> archive::Names<'_> {
        archive::Names::of_inputs(self.inputs())
    }

    /// The result in the typed world's terms, its names made from the inputs (for callers that
    /// read typed rulesets, as tests comparing it with the typed translator and native do).
    pub fn to_typed(&self) -> Result<wit::Ruleset, String> {
        let names = self.names();
        let ruleset = self.ruleset();
        let chains = ruleset.chains.iter().map(|c| chain(c, &names)).collect::<Result<_, _>>()?;
        let sets = ruleset.sets.iter().map(|s| set(s, &names)).collect::<Result<_, _>>()?;
        let mut map_elements = Vec::with_capacity(ruleset.elements.len());
        for e in ruleset.elements.iter() {
            map_elements.push(wit::MapElement {
                map_name: e.map.native().name().into_owned(),
                key: (e.key.iter().filter_map(|p| p.as_ref()))
                    .map(|part| match part {
                        archive::ArchivedKeyPart::Address(a) => wit::KeyPart::Address(a.as_ipaddr().to_string()),
                        archive::ArchivedKeyPart::Protocol(p) => wit::KeyPart::Protocol(typed_protocol(p.native())),
                        archive::ArchivedKeyPart::Port(p) => wit::KeyPart::Port(p.to_native()),
                    })
                    .collect(),
                verdict: verdict(&e.verdict, &names)?,
            });
        }
        let warnings = ruleset.warnings.iter().map(|w| w.to_string()).collect();
        Ok(wit::Ruleset { chains, sets, map_elements, warnings })
    }
}

/// The typed world's protocol.
pub fn typed_protocol(p: archive::Protocol) -> wit::Protocol {
    match p {
        archive::Protocol::Tcp => wit::Protocol::Tcp,
        archive::Protocol::Udp => wit::Protocol::Udp,
        archive::Protocol::Sctp => wit::Protocol::Sctp,
    }
}

fn family(ipv6: bool) -> wit::AddressFamily {
    if ipv6 { wit::AddressFamily::Ipv6 } else { wit::AddressFamily::Ipv4 }
}

fn no_port(what: &str, port: u16) -> String {
    format!("{what} names port number {port}, which the service does not have")
}

fn chain_name(name: &archive::ArchivedChainName, names: &archive::Names) -> Result<String, String> {
    names.archived_chain(name).ok_or_else(|| no_port("a chain", name.port.to_native()))
}

fn set_name(name: &archive::ArchivedSetName, names: &archive::Names) -> Result<String, String> {
    names.archived_set(name).ok_or_else(|| no_port("an affinity set", name.port.to_native()))
}

/// An archived verdict in the typed world's terms, its chain named.
pub fn verdict(v: &archive::ArchivedVerdict, names: &archive::Names) -> Result<wit::Verdict, String> {
    Ok(match v {
        archive::ArchivedVerdict::None => wit::Verdict::None,
        archive::ArchivedVerdict::Drop => wit::Verdict::Drop,
        archive::ArchivedVerdict::Reject => wit::Verdict::Reject,
        archive::ArchivedVerdict::Goto(chain) => wit::Verdict::Goto(chain_name(chain, names)?),
        archive::ArchivedVerdict::Masquerade => wit::Verdict::Masquerade,
    })
}

/// An archived chain as a typed translator would have written it.
pub fn chain(chain: &archive::ArchivedChain, names: &archive::Names) -> Result<wit::Chain, String> {
    let address = |a: IpAddr| wit::AddressMatch { cidr: a.to_string(), negate: false };
    let mut rules = Vec::with_capacity(chain.rules.len());
    for rule in chain.rules.iter() {
        let mut matches = Vec::with_capacity(archive::MAX_MATCHES);
        for m in rule.matches.iter().filter_map(|m| m.as_ref()) {
            matches.push(match m {
                archive::ArchivedMatch::Destination(a) => wit::RuleMatch::Destination(address(a.as_ipaddr())),
                archive::ArchivedMatch::Protocol(p) => wit::RuleMatch::Protocol(typed_protocol(p.native())),
                archive::ArchivedMatch::DestinationPort(p) => wit::RuleMatch::DestinationPort(p.to_native()),
                archive::ArchivedMatch::SourceInSet(set) => wit::RuleMatch::SourceInSet(set_name(set, names)?),
                archive::ArchivedMatch::Random(modulus) => wit::RuleMatch::Random((modulus.to_native(), 0)),
                archive::ArchivedMatch::PodTraffic { ipv6, negate } => {
                    wit::RuleMatch::PodTraffic(wit::PodTrafficMatch { family: family(*ipv6), negate: *negate })
                }
            });
        }
        let mut statements = Vec::with_capacity(archive::MAX_STATEMENTS);
        for s in rule.statements.iter().filter_map(|s| s.as_ref()) {
            statements.push(match s {
                archive::ArchivedStatement::Dnat { address, port } => wit::RuleStatement::Dnat(wit::DnatTarget {
                    address: address.as_ipaddr().to_string(),
                    port: port.to_native(),
                }),
                archive::ArchivedStatement::RememberSource { set, timeout } => {
                    wit::RuleStatement::AddSourceToSet(wit::SetUpdate {
                        set: set_name(set, names)?,
                        timeout_seconds: Some(timeout.to_native()),
                    })
                }
            });
        }
        rules.push(wit::Rule { matches, statements, verdict: verdict(&rule.verdict, names)?, comment: None });
    }
    Ok(wit::Chain { name: chain_name(&chain.name, names)?, rules })
}

/// An archived affinity set's declaration as a typed translator would have written it.
pub fn set(set: &archive::ArchivedSetDeclaration, names: &archive::Names) -> Result<wit::SetDeclaration, String> {
    Ok(wit::SetDeclaration {
        name: set_name(&set.name, names)?,
        family: family(set.name.address.as_ipaddr().is_ipv6()),
        timeout_seconds: Some(set.timeout_seconds.to_native()),
        elements: Vec::new(),
    })
}
