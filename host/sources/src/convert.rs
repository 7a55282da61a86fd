//! Kubernetes API objects (the parts [`crate::slim`] reads) to wasmplane's model types.
//!
//! Conversion keeps only what the dataplane needs and applies the API's defaults (no
//! protocol means TCP, no `ready` condition means ready, ...) so that nothing downstream
//! has to know which fields were optional. Values the API server would reject are errors
//! naming the field: a manifest directory has no API server validating it first.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use wasmplane_model::state::ClusterObject;
use wasmplane_model::*;

use crate::slim;

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Kubernetes' default for `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;
/// Kubernetes' upper bound for the affinity timeout (1 day).
const MAX_AFFINITY_TIMEOUT: u32 = 86400;

/// A Kubernetes object that cannot be converted, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {object}: {problem}")]
pub struct ConvertError {
    /// `Service`, `EndpointSlice`, ...
    pub kind: &'static str,
    /// `namespace/name`, or `name` for cluster-scoped kinds.
    pub object: String,
    pub problem: Problem,
}

/// What is wrong with an object; `at` is the Kubernetes field path (`spec.ports[3]`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// The document does not deserialize into the Kubernetes type (wrong field types,
    /// missing required fields).
    #[error("does not match the Kubernetes schema: {0}")]
    Schema(String),
    #[error("metadata.name is missing")]
    MissingName,
    #[error("{at} has invalid protocol {value:?} (TCP, UDP or SCTP)")]
    InvalidProtocol { at: String, value: String },
    #[error("{at} is {value}, not a port number (1-65535)")]
    InvalidPort { at: String, value: i32 },
    #[error("{at} is {value:?}, not an IP address (192.168.0.10, 2001:db8::10)")]
    InvalidIp { at: String, value: String },
    #[error("spec.type {0:?} is not ClusterIP, NodePort, LoadBalancer or ExternalName")]
    UnknownServiceType(String),
    #[error("spec.sessionAffinity {0:?} is not None or ClientIP")]
    UnknownSessionAffinity(String),
    #[error("spec.sessionAffinityConfig.clientIP.timeoutSeconds is {0}, not 1-86400")]
    InvalidAffinityTimeout(i32),
    #[error("label {} is missing", SERVICE_NAME_LABEL)]
    MissingServiceName,
    #[error("{at} has unknown operator {value:?} (In, NotIn, Exists or DoesNotExist)")]
    UnknownSelectorOperator { at: String, value: String },
    #[error("spec.policyTypes has unknown type {0:?} (Ingress or Egress)")]
    UnknownPolicyType(String),
    #[error("{at} is {value:?}, not a CIDR (10.0.0.0/8, 2001:db8::/32)")]
    InvalidCidr { at: String, value: String },
    /// A port range needs a numeric start no greater than its end.
    #[error("{at}.endPort {end} needs a numeric port no greater than it")]
    InvalidEndPort { at: String, end: i32 },
}

/// The object being converted, for error messages.
struct Subject {
    kind: &'static str,
    object: String,
}

impl Subject {
    fn namespaced(kind: &'static str, m: &meta::ObjectMeta) -> Self {
        Subject { kind, object: format!("{}/{}", namespace_of(m), m.name.as_deref().unwrap_or("<unnamed>")) }
    }

    fn cluster(kind: &'static str, m: &meta::ObjectMeta) -> Self {
        Subject { kind, object: m.name.clone().unwrap_or_else(|| "<unnamed>".into()) }
    }

    fn error(&self, problem: Problem) -> ConvertError {
        ConvertError { kind: self.kind, object: self.object.clone(), problem }
    }

    fn name(&self, m: &meta::ObjectMeta) -> Result<CompactString, ConvertError> {
        m.name.as_deref().filter(|n| !n.is_empty()).map(text).ok_or_else(|| self.error(Problem::MissingName))
    }

    /// A missing protocol is TCP, as in the API.
    fn protocol(&self, at: &str, value: Option<&str>) -> Result<Protocol, ConvertError> {
        match value {
            None => Ok(Protocol::Tcp),
            Some(s) => Protocol::parse(s)
                .ok_or_else(|| self.error(Problem::InvalidProtocol { at: at.to_string(), value: s.to_string() })),
        }
    }

    fn port(&self, at: &str, value: i32) -> Result<u16, ConvertError> {
        u16::try_from(value)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| self.error(Problem::InvalidPort { at: at.to_string(), value }))
    }

    /// A container port's `hostPort` and `hostIP` (`at` is the port's path). No host port
    /// or 0 is none, as in the API; a host IP that is empty or unspecified (`0.0.0.0`, `::`)
    /// means every address, and is kept only with a host port.
    fn host_port(
        &self,
        at: &str,
        cp: &core::ContainerPort,
    ) -> Result<(Option<u16>, Option<CompactString>), ConvertError> {
        let host_ip = match cp.host_ip.as_deref().filter(|ip| !ip.is_empty()) {
            None => None,
            Some(text) => match text.parse::<std::net::IpAddr>() {
                Ok(ip) if ip.is_unspecified() => None,
                Ok(ip) => Some(CompactString::from(ip.to_string())),
                Err(_) => {
                    return Err(self.error(Problem::InvalidIp { at: format!("{at}.hostIP"), value: text.to_string() }));
                }
            },
        };
        match cp.host_port.filter(|p| *p != 0) {
            None => Ok((None, None)),
            Some(port) => Ok((Some(self.port(&format!("{at}.hostPort"), port)?), host_ip)),
        }
    }
}

/// Namespaced objects without a namespace live in `default`, as `kubectl apply` would put them.
fn namespace_of(m: &meta::ObjectMeta) -> CompactString {
    text(m.namespace.as_deref().filter(|n| !n.is_empty()).unwrap_or("default"))
}

/// The model's copy of an API object's string (inline when short; see `wasmplane_model`).
fn text(s: &str) -> CompactString {
    CompactString::from(s)
}

fn texts<'a>(strings: impl IntoIterator<Item = &'a String>) -> Vec<CompactString> {
    strings.into_iter().map(|s| text(s)).collect()
}

fn label_map(labels: &BTreeMap<String, String>) -> Labels {
    labels.iter().map(|(k, v)| (text(k), text(v))).collect()
}

fn labels(m: &meta::ObjectMeta) -> Labels {
    m.labels.as_ref().map(label_map).unwrap_or_default()
}

/// Only `Local` changes behaviour; anything else routes cluster-wide.
fn traffic_policy(value: Option<&str>) -> TrafficPolicy {
    if value == Some("Local") { TrafficPolicy::Local } else { TrafficPolicy::Cluster }
}

pub fn service(s: &slim::Service) -> Result<Service, ConvertError> {
    let m = &s.metadata;
    let subject = Subject::namespaced("Service", m);
    let default_spec = core::ServiceSpec::default();
    let spec = s.spec.as_ref().unwrap_or(&default_spec);
    let service_type = match spec.type_.as_deref() {
        None | Some("ClusterIP") => ServiceType::ClusterIP,
        Some("NodePort") => ServiceType::NodePort,
        Some("LoadBalancer") => ServiceType::LoadBalancer,
        Some("ExternalName") => ServiceType::ExternalName,
        Some(other) => return Err(subject.error(Problem::UnknownServiceType(other.into()))),
    };
    // `clusterIPs` is authoritative (dual-stack); older manifests set only `clusterIP`.
    let cluster_ips = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => texts(ips),
        _ => texts(spec.cluster_ip.iter().filter(|ip| !ip.is_empty())),
    };
    let ports = spec
        .ports
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, p)| service_port(&subject, i, p))
        .collect::<Result<Vec<_>, _>>()?;
    let session_affinity_timeout = match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match timeout {
                None => Some(DEFAULT_AFFINITY_TIMEOUT),
                Some(t) => Some(
                    u32::try_from(t)
                        .ok()
                        .filter(|t| (1..=MAX_AFFINITY_TIMEOUT).contains(t))
                        .ok_or_else(|| subject.error(Problem::InvalidAffinityTimeout(t)))?,
                ),
            }
        }
        Some(other) => return Err(subject.error(Problem::UnknownSessionAffinity(other.into()))),
    };
    // Hostname-only ingress entries (some cloud load balancers) have nothing to match on.
    // An `ipMode: Proxy` address is the load balancer's own: it proxies to the nodes and
    // traffic must reach it, not be short-cut on the node (kube-proxy programs no rules for
    // it either, KEP-1860).
    let load_balancer_ips = s
        .status
        .as_ref()
        .and_then(|st| st.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|ingress| {
            texts(ingress.iter().filter(|i| i.ip_mode.as_deref() != Some("Proxy")).filter_map(|i| i.ip.as_ref()))
        })
        .unwrap_or_default();
    let annotation = |key: &str| m.annotations.as_ref().and_then(|a| a.get(key)).map(String::as_str);
    Ok(Service {
        namespace: namespace_of(m),
        name: subject.name(m)?,
        service_type,
        cluster_ips,
        external_ips: texts(spec.external_ips.iter().flatten()),
        load_balancer_ips,
        ports,
        session_affinity_timeout,
        external_traffic_policy: traffic_policy(spec.external_traffic_policy.as_deref()),
        internal_traffic_policy: traffic_policy(spec.internal_traffic_policy.as_deref()),
        health_check_node_port: match spec.health_check_node_port {
            None | Some(0) => 0,
            Some(n) => subject.port("spec.healthCheckNodePort", n)?,
        },
        load_balancer_source_ranges: source_ranges(&subject, spec.load_balancer_source_ranges.iter().flatten())?,
        labels: labels(m),
        global: annotation(slim::GLOBAL_SERVICE_ANNOTATION) == Some("true"),
        cluster_affinity: match annotation(slim::CLUSTER_AFFINITY_ANNOTATION) {
            Some("local") => ClusterAffinity::Local,
            Some("remote") => ClusterAffinity::Remote,
            None | Some("none") => ClusterAffinity::None,
            Some(other) => {
                // As Cilium: an unknown value is no preference, not a broken Service.
                tracing::warn!(object = %subject.object, value = other, "unknown {}: none", slim::CLUSTER_AFFINITY_ANNOTATION);
                ClusterAffinity::None
            }
        },
        created_unix: m.creation_timestamp.as_ref().map(|t| t.0.as_second()),
    })
}

/// `spec.loadBalancerSourceRanges`, parsed as the API server parses them (surrounding
/// spaces allowed, host bits dropped). A range it would refuse is an error: left out, the
/// service would be open to every source.
fn source_ranges<'a>(
    subject: &Subject,
    ranges: impl Iterator<Item = &'a String>,
) -> Result<Vec<ipnet::IpNet>, ConvertError> {
    ranges
        .enumerate()
        .map(|(i, range)| {
            let invalid = || {
                subject.error(Problem::InvalidCidr {
                    at: format!("spec.loadBalancerSourceRanges[{i}]"),
                    value: range.clone(),
                })
            };
            cidr_sloppy(range.trim()).ok_or_else(invalid)
        })
        .collect()
}

/// A CIDR as Kubernetes parses it (`ParseCIDRSloppy`): IPv4 octets and the prefix length may
/// carry leading zeros (decimal all the same), which objects validated before Kubernetes'
/// stricter IP validation can still hold. Host bits are dropped.
fn cidr_sloppy(text: &str) -> Option<ipnet::IpNet> {
    let (address, prefix) = text.split_once('/')?;
    let address: std::net::IpAddr = match address.parse() {
        Ok(address) => address,
        Err(_) if !address.contains(':') => {
            let octets: Vec<u8> = address.split('.').map(|octet| octet.parse().ok()).collect::<Option<_>>()?;
            <[u8; 4]>::try_from(octets).ok()?.into()
        }
        Err(_) => return None,
    };
    ipnet::IpNet::new(address, prefix.parse().ok()?).ok().map(|net| net.trunc())
}

fn service_port(subject: &Subject, i: usize, p: &core::ServicePort) -> Result<ServicePort, ConvertError> {
    let at = format!("spec.ports[{i}]");
    let port = subject.port(&format!("{at}.port"), p.port)?;
    // The API defaults a missing, 0 or "" targetPort to the service port; a string is
    // always a container port name (the API rejects numeric strings).
    let target_port = match &p.target_port {
        None | Some(IntOrString::Int(0)) => TargetPort::Number(port),
        Some(IntOrString::String(name)) if name.is_empty() => TargetPort::Number(port),
        Some(IntOrString::Int(n)) => TargetPort::Number(subject.port(&format!("{at}.targetPort"), *n)?),
        Some(IntOrString::String(name)) => TargetPort::Name(text(name)),
    };
    let node_port = match p.node_port {
        None | Some(0) => 0,
        Some(n) => subject.port(&format!("{at}.nodePort"), n)?,
    };
    Ok(ServicePort {
        name: text(p.name.as_deref().unwrap_or_default()),
        protocol: subject.protocol(&at, p.protocol.as_deref())?,
        port,
        node_port,
        target_port,
    })
}

pub fn endpoint_slice(s: &slim::EndpointSlice) -> Result<EndpointSlice, ConvertError> {
    let m = &s.metadata;
    let subject = Subject::namespaced("EndpointSlice", m);
    let service_name = m
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .filter(|n| !n.is_empty())
        .map(|n| text(n))
        .ok_or_else(|| subject.error(Problem::MissingServiceName))?;
    let endpoints = s
        .endpoints
        .iter()
        .map(|e| {
            let c = e.conditions.as_ref();
            // discovery/v1: a missing `ready` or `serving` means true, a missing
            // `terminating` false (kube-proxy reads them the same way).
            Endpoint {
                addresses: texts(&e.addresses),
                ready: c.and_then(|c| c.ready).unwrap_or(true),
                serving: c.and_then(|c| c.serving).unwrap_or(true),
                terminating: c.and_then(|c| c.terminating).unwrap_or(false),
                node_name: e.node_name.as_deref().map(text),
                zone: e.zone.as_deref().map(text),
                for_zones: texts(e.hints.iter().flat_map(|h| h.for_zones.iter().flatten()).map(|z| &z.name)),
                for_nodes: texts(e.hints.iter().flat_map(|h| h.for_nodes.iter().flatten()).map(|n| &n.name)),
            }
        })
        .collect();
    let mut ports = Vec::new();
    for (i, p) in s.ports.iter().flatten().enumerate() {
        // A port without a number means "all ports" for non-Service consumers; a
        // Service has nothing to forward to with it.
        let Some(number) = p.port else { continue };
        let at = format!("ports[{i}]");
        ports.push(EndpointPort {
            name: text(p.name.as_deref().unwrap_or_default()),
            protocol: subject.protocol(&at, p.protocol.as_deref())?,
            port: subject.port(&format!("{at}.port"), number)?,
        });
    }
    let trigger_time = m
        .annotations
        .as_ref()
        .and_then(|a| a.get(slim::TRIGGER_TIME_ANNOTATION))
        .and_then(|t| trigger_time(&subject, t));
    Ok(EndpointSlice {
        namespace: namespace_of(m),
        name: subject.name(m)?,
        service_name,
        endpoints,
        ports,
        trigger_time,
        cluster: None,
    })
}

/// The trigger-time annotation (RFC 3339). Only a metric starts from it: a malformed one is
/// skipped, not an error that would keep the slice's endpoints out (kube-proxy skips it too).
fn trigger_time(subject: &Subject, text: &str) -> Option<std::time::SystemTime> {
    match text.parse::<k8s_openapi::jiff::Timestamp>() {
        Ok(time) => Some(time.into()),
        Err(e) => {
            tracing::debug!(object = %subject.object, "ignoring annotation {}: {e}", slim::TRIGGER_TIME_ANNOTATION);
            None
        }
    }
}

/// The taint the cluster autoscaler puts on a node it is about to remove.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

pub fn node(n: &slim::Node) -> Result<Node, ConvertError> {
    let m = &n.metadata;
    let subject = Subject::cluster("Node", m);
    let spec = n.spec.as_ref();
    // `podCIDRs` is authoritative (dual-stack); `podCIDR` is its first entry.
    let pod_cidrs = match spec.and_then(|s| s.pod_cidrs.as_ref()) {
        Some(cidrs) if !cidrs.is_empty() => texts(cidrs),
        _ => texts(spec.and_then(|s| s.pod_cidr.as_ref()).filter(|c| !c.is_empty())),
    };
    // Only IPs: `Hostname` and `*DNS` addresses are not something traffic is addressed to.
    // InternalIPs first: the first of a family is the node's primary one (kube-proxy's).
    let listed = n.status.as_ref().and_then(|s| s.addresses.as_deref()).unwrap_or_default();
    let addresses = texts(
        ["InternalIP", "ExternalIP"]
            .iter()
            .flat_map(|kind| listed.iter().filter(move |a| a.type_ == *kind))
            .map(|a| &a.address),
    );
    let being_deleted = m.deletion_timestamp.is_some()
        || spec.and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    Ok(Node { name: subject.name(m)?, addresses, pod_cidrs, labels: labels(m), being_deleted })
}

pub fn namespace(n: &slim::Namespace) -> Result<Namespace, ConvertError> {
    let m = &n.metadata;
    Ok(Namespace { name: Subject::cluster("Namespace", m).name(m)?, labels: labels(m) })
}

pub fn pod(p: &slim::Pod) -> Result<Pod, ConvertError> {
    let m = &p.metadata;
    let subject = Subject::namespaced("Pod", m);
    let status = p.status.as_ref();
    // A finished pod (a Job's, an evicted one) keeps `podIPs` in its status, but its
    // addresses are released and may already be another pod's: it has none here, so no
    // policy peer set, dispatch or host port follows it (Calico's and
    // kube-network-policies' rule).
    let finished = status.and_then(|s| s.phase).is_some_and(slim::PodPhase::is_finished);
    // `podIPs` is authoritative (dual-stack); `podIP` is its first entry.
    let ips = match status.and_then(|s| s.pod_ips.as_ref()) {
        _ if finished => Vec::new(),
        Some(ips) if !ips.is_empty() => texts(ips.iter().map(|ip| &ip.ip)),
        _ => texts(status.and_then(|s| s.pod_ip.as_ref()).filter(|ip| !ip.is_empty())),
    };
    let mut ports = Vec::new();
    if let Some(spec) = &p.spec {
        for (c, container) in spec.containers.iter().enumerate() {
            for (i, cp) in container.ports.iter().flatten().enumerate() {
                let at = format!("spec.containers[{c}].ports[{i}]");
                let (host_port, host_ip) = subject.host_port(&at, cp)?;
                ports.push(ContainerPort {
                    name: text(cp.name.as_deref().unwrap_or_default()),
                    protocol: subject.protocol(&at, cp.protocol.as_deref())?,
                    port: subject.port(&format!("{at}.containerPort"), cp.container_port)?,
                    host_port,
                    host_ip,
                });
            }
        }
    }
    Ok(Pod {
        namespace: namespace_of(m),
        name: subject.name(m)?,
        ips,
        node_name: p.spec.as_ref().and_then(|s| s.node_name.as_deref()).filter(|n| !n.is_empty()).map(text),
        labels: labels(m),
        ports,
        host_network: p.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false),
    })
}

fn selector(subject: &Subject, at: &str, s: &meta::LabelSelector) -> Result<LabelSelector, ConvertError> {
    let mut match_expressions = Vec::new();
    for (i, r) in s.match_expressions.iter().flatten().enumerate() {
        let operator = match r.operator.as_str() {
            "In" => SelectorOperator::In,
            "NotIn" => SelectorOperator::NotIn,
            "Exists" => SelectorOperator::Exists,
            "DoesNotExist" => SelectorOperator::DoesNotExist,
            other => {
                let at = format!("{at}.matchExpressions[{i}]");
                return Err(subject.error(Problem::UnknownSelectorOperator { at, value: other.into() }));
            }
        };
        match_expressions.push(SelectorRequirement {
            key: text(&r.key),
            operator,
            values: texts(r.values.iter().flatten()),
        });
    }
    Ok(LabelSelector { match_labels: s.match_labels.as_ref().map(label_map).unwrap_or_default(), match_expressions })
}

fn policy_ports(
    subject: &Subject,
    at: &str,
    ports: Option<&Vec<networking::NetworkPolicyPort>>,
) -> Result<Vec<PolicyPort>, ConvertError> {
    let mut out = Vec::new();
    for (i, p) in ports.into_iter().flatten().enumerate() {
        let at = format!("{at}.ports[{i}]");
        let port = match &p.port {
            None => PolicyPortNumber::Any,
            Some(IntOrString::Int(n)) => PolicyPortNumber::Number(subject.port(&format!("{at}.port"), *n)?),
            Some(IntOrString::String(name)) => PolicyPortNumber::Name(text(name)),
        };
        let end_port = match (p.end_port, &port) {
            (None, _) => None,
            (Some(end), PolicyPortNumber::Number(start)) if i32::from(*start) <= end => {
                Some(subject.port(&format!("{at}.endPort"), end)?)
            }
            (Some(end), _) => return Err(subject.error(Problem::InvalidEndPort { at, end })),
        };
        out.push(PolicyPort { protocol: subject.protocol(&at, p.protocol.as_deref())?, port, end_port });
    }
    Ok(out)
}

fn policy_peers(
    subject: &Subject,
    at: &str,
    peers: Option<&Vec<networking::NetworkPolicyPeer>>,
) -> Result<Vec<PolicyPeer>, ConvertError> {
    let mut out = Vec::new();
    for (i, peer) in peers.into_iter().flatten().enumerate() {
        let at = format!("{at}[{i}]");
        out.push(PolicyPeer {
            pod_selector: peer
                .pod_selector
                .as_ref()
                .map(|s| selector(subject, &format!("{at}.podSelector"), s))
                .transpose()?,
            namespace_selector: peer
                .namespace_selector
                .as_ref()
                .map(|s| selector(subject, &format!("{at}.namespaceSelector"), s))
                .transpose()?,
            ip_block: peer
                .ip_block
                .as_ref()
                .map(|b| IpBlock { cidr: text(&b.cidr), except: texts(b.except.iter().flatten()) }),
        });
    }
    Ok(out)
}

pub fn network_policy(p: &slim::NetworkPolicy) -> Result<NetworkPolicy, ConvertError> {
    let m = &p.metadata;
    let subject = Subject::namespaced("NetworkPolicy", m);
    let default_spec = networking::NetworkPolicySpec::default();
    let spec = p.spec.as_ref().unwrap_or(&default_spec);
    // Without policyTypes (the API treats an empty list the same) every policy isolates
    // ingress, and egress only when it has an egress section.
    let (ingress_on, egress_on) = match spec.policy_types.as_deref() {
        None | Some([]) => (true, spec.egress.is_some()),
        Some(types) => {
            let (mut ingress, mut egress) = (false, false);
            for t in types {
                match t.as_str() {
                    "Ingress" => ingress = true,
                    "Egress" => egress = true,
                    other => return Err(subject.error(Problem::UnknownPolicyType(other.into()))),
                }
            }
            (ingress, egress)
        }
    };
    let ingress = if ingress_on {
        let mut rules = Vec::new();
        for (i, r) in spec.ingress.iter().flatten().enumerate() {
            let at = format!("spec.ingress[{i}]");
            rules.push(PolicyRule {
                ports: policy_ports(&subject, &at, r.ports.as_ref())?,
                peers: policy_peers(&subject, &format!("{at}.from"), r.from.as_ref())?,
            });
        }
        Some(rules)
    } else {
        None
    };
    let egress = if egress_on {
        let mut rules = Vec::new();
        for (i, r) in spec.egress.iter().flatten().enumerate() {
            let at = format!("spec.egress[{i}]");
            rules.push(PolicyRule {
                ports: policy_ports(&subject, &at, r.ports.as_ref())?,
                peers: policy_peers(&subject, &format!("{at}.to"), r.to.as_ref())?,
            });
        }
        Some(rules)
    } else {
        None
    };
    Ok(NetworkPolicy {
        namespace: namespace_of(m),
        name: subject.name(m)?,
        uid: text(m.uid.as_deref().unwrap_or_default()),
        generation: m.generation.and_then(|g| u64::try_from(g).ok()).unwrap_or(0),
        // An absent podSelector is the empty selector: every pod in the namespace.
        pod_selector: spec
            .pod_selector
            .as_ref()
            .map(|s| selector(&subject, "spec.podSelector", s))
            .transpose()?
            .unwrap_or_default(),
        ingress,
        egress,
    })
}

/// A ServiceCIDR's ranges. The API server validates them strictly (no leading zeros, no
/// host bits); one that does not parse is an error naming it.
pub fn service_cidr(c: &slim::ServiceCidr) -> Result<ServiceCidr, ConvertError> {
    let m = &c.metadata;
    let subject = Subject::cluster("ServiceCIDR", m);
    let cidrs = c
        .spec
        .iter()
        .flat_map(|s| s.cidrs.iter().flatten())
        .enumerate()
        .map(|(i, cidr)| {
            cidr.parse::<ipnet::IpNet>().map_err(|_| {
                subject.error(Problem::InvalidCidr { at: format!("spec.cidrs[{i}]"), value: cidr.clone() })
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(ServiceCidr { name: subject.name(m)?, cidrs })
}

/// Converts one manifest document (a JSON object with `apiVersion` and `kind`).
///
/// `Ok(None)` for kinds wasmplane does not watch (Deployment, ConfigMap, ...), so a
/// directory of ordinary manifests can be used as is.
pub fn object_from_json(value: serde_json::Value) -> Result<Option<ClusterObject>, ConvertError> {
    let field = |name: &str| value.get(name).and_then(|v| v.as_str()).unwrap_or_default().to_string();
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    let object = match (api_version.as_str(), kind.as_str()) {
        ("v1", "Service") => ClusterObject::Service(service(&parse("Service", true, value)?)?),
        ("v1", "Node") => ClusterObject::Node(node(&parse("Node", false, value)?)?),
        ("v1", "Namespace") => ClusterObject::Namespace(namespace(&parse("Namespace", false, value)?)?),
        ("v1", "Pod") => ClusterObject::Pod(pod(&parse("Pod", true, value)?)?),
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            ClusterObject::EndpointSlice(endpoint_slice(&parse("EndpointSlice", true, value)?)?)
        }
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            ClusterObject::NetworkPolicy(network_policy(&parse("NetworkPolicy", true, value)?)?)
        }
        ("networking.k8s.io/v1", "ServiceCIDR") => {
            ClusterObject::ServiceCidr(service_cidr(&parse("ServiceCIDR", false, value)?)?)
        }
        _ => {
            tracing::trace!(api_version = %api_version, kind = %kind, "ignoring a kind wasmplane does not use");
            return Ok(None);
        }
    };
    Ok(Some(object))
}

fn parse<T: serde::de::DeserializeOwned>(
    kind: &'static str,
    namespaced: bool,
    value: serde_json::Value,
) -> Result<T, ConvertError> {
    let meta =
        |field: &str| value.pointer(&format!("/metadata/{field}")).and_then(|v| v.as_str()).filter(|s| !s.is_empty());
    let name = meta("name").unwrap_or("<unnamed>");
    let object =
        if namespaced { format!("{}/{name}", meta("namespace").unwrap_or("default")) } else { name.to_string() };
    serde_json::from_value(value).map_err(|e| ConvertError { kind, object, problem: Problem::Schema(e.to_string()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn k8s<T: serde::de::DeserializeOwned>(v: Value) -> T {
        serde_json::from_value(v).expect("valid Kubernetes object")
    }

    fn svc(spec: Value) -> Result<Service, ConvertError> {
        service(&k8s(json!({"metadata": {"name": "web", "namespace": "shop"}, "spec": spec})))
    }

    #[test]
    fn service_defaults() {
        let s = service(&k8s(json!({
            "metadata": {"name": "web"},
            "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}, {"port": 81, "targetPort": 0}]}
        })))
        .unwrap();
        assert_eq!(s.namespace, "default");
        assert_eq!(s.service_type, ServiceType::ClusterIP);
        assert_eq!(s.cluster_ips, vec!["10.96.0.20"]);
        assert_eq!(
            s.ports,
            vec![
                ServicePort {
                    name: Default::default(),
                    protocol: Protocol::Tcp,
                    port: 80,
                    node_port: 0,
                    target_port: TargetPort::Number(80)
                },
                ServicePort {
                    name: Default::default(),
                    protocol: Protocol::Tcp,
                    port: 81,
                    node_port: 0,
                    target_port: TargetPort::Number(81)
                },
            ]
        );
        assert_eq!(s.session_affinity_timeout, None);
        assert_eq!(s.external_traffic_policy, TrafficPolicy::Cluster);
        assert_eq!(s.internal_traffic_policy, TrafficPolicy::Cluster);
        assert!(
            s.external_ips.is_empty()
                && s.load_balancer_ips.is_empty()
                && s.labels.is_empty()
                && s.health_check_node_port == 0
        );
        assert!(!s.global);

        let bare = service(&k8s(json!({"metadata": {"name": "bare"}}))).unwrap();
        assert!(bare.cluster_ips.is_empty() && bare.ports.is_empty());
    }

    /// Global only with the annotation's value `"true"`, and read through the slim parser
    /// that drops the annotations it does not know.
    #[test]
    fn service_global_annotation() {
        let annotated = |value: &str| -> Service {
            let slim: slim::Service = serde_json::from_value(json!({"metadata": {"name": "web", "annotations": {
                "wasmplane.io/global": value, "kubectl.kubernetes.io/last-applied-configuration": "{}"}}}))
            .unwrap();
            service(&slim).unwrap()
        };
        assert!(annotated("true").global);
        assert!(!annotated("false").global);
        assert!(!annotated("yes").global);
        let affinity = |value: &str| -> ClusterAffinity {
            let slim: slim::Service = serde_json::from_value(json!({"metadata": {"name": "web", "annotations": {
                "wasmplane.io/global": "true", "wasmplane.io/affinity": value}}}))
            .unwrap();
            service(&slim).unwrap().cluster_affinity
        };
        assert_eq!(
            [affinity("local"), affinity("remote"), affinity("none"), affinity("nearest")],
            [ClusterAffinity::Local, ClusterAffinity::Remote, ClusterAffinity::None, ClusterAffinity::None]
        );
    }

    /// Its creationTimestamp, read through the slim parser, in Unix seconds: what decides
    /// which of two services claiming one frontend keeps it.
    #[test]
    fn service_creation_time() {
        let created = |metadata: serde_json::Value| -> Option<i64> {
            let slim: slim::Service = serde_json::from_value(json!({ "metadata": metadata })).unwrap();
            service(&slim).unwrap().created_unix
        };
        assert_eq!(created(json!({"name": "web", "creationTimestamp": "2026-12-07T10:00:05Z"})), Some(1_796_637_605));
        assert_eq!(created(json!({"name": "web"})), None, "a manifest that gives none");
        assert_eq!(created(json!({"name": "web", "creationTimestamp": "yesterday"})), None, "no age, not refused");
    }

    #[test]
    fn service_fields() {
        let s = service(&k8s(json!({
            "metadata": {"name": "lb", "namespace": "shop", "labels": {"app": "lb"}},
            "spec": {
                "type": "LoadBalancer", "clusterIP": "10.96.0.30", "clusterIPs": ["10.96.0.30", "fd00::30"],
                "externalIPs": ["203.0.113.5"], "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                "healthCheckNodePort": 31999, "loadBalancerSourceRanges": [" 198.51.100.7/24 ", "2001:db8::/32", "010.001.0.0/016"],
                "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
                "ports": [
                    {"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080},
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns-udp", "nodePort": 30053}
                ]
            },
            "status": {"loadBalancer": {"ingress": [
                {"ip": "198.51.100.7"}, {"hostname": "lb.example.com"},
                {"ip": "198.51.100.8", "ipMode": "VIP"}, {"ip": "198.51.100.9", "ipMode": "Proxy"}
            ]}}
        })))
        .unwrap();
        assert_eq!(s.key(), ObjectKey::new("shop", "lb"));
        assert_eq!(s.service_type, ServiceType::LoadBalancer);
        assert_eq!(s.cluster_ips, vec!["10.96.0.30", "fd00::30"], "clusterIPs wins over clusterIP");
        assert_eq!(s.external_ips, vec!["203.0.113.5"]);
        assert_eq!(
            s.load_balancer_ips,
            vec!["198.51.100.7", "198.51.100.8"],
            "hostnames and `ipMode: Proxy` addresses left out"
        );
        assert_eq!(s.session_affinity_timeout, Some(600));
        assert_eq!(s.external_traffic_policy, TrafficPolicy::Local);
        assert_eq!(s.internal_traffic_policy, TrafficPolicy::Local);
        assert_eq!(s.health_check_node_port, 31999);
        let ranges: Vec<String> = s.load_balancer_source_ranges.iter().map(ToString::to_string).collect();
        assert_eq!(
            ranges,
            ["198.51.100.0/24", "2001:db8::/32", "10.1.0.0/16"],
            "spaces trimmed, host bits dropped, leading zeros read as Kubernetes reads them"
        );
        assert_eq!(s.labels["app"], "lb");
        assert_eq!(
            s.ports[0],
            ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: 30080,
                target_port: TargetPort::Number(8080)
            }
        );
        assert_eq!(
            s.ports[1],
            ServicePort {
                name: "dns".into(),
                protocol: Protocol::Udp,
                port: 53,
                node_port: 30053,
                target_port: TargetPort::Name("dns-udp".into())
            }
        );

        let affinity = svc(json!({"sessionAffinity": "ClientIP"})).unwrap();
        assert_eq!(affinity.session_affinity_timeout, Some(DEFAULT_AFFINITY_TIMEOUT));
        let headless = svc(json!({"clusterIP": "None"})).unwrap();
        assert!(!headless.is_proxied());
        let external = svc(json!({"type": "ExternalName", "externalName": "payments.example.com"})).unwrap();
        assert_eq!(external.service_type, ServiceType::ExternalName);
        assert!(
            svc(json!({"externalTrafficPolicy": "Bogus"})).unwrap().external_traffic_policy == TrafficPolicy::Cluster
        );
    }

    #[test]
    fn service_errors_name_the_field() {
        let ports = |p: Value| svc(json!({"ports": p})).unwrap_err().to_string();
        assert_eq!(
            ports(json!([{"port": 1}, {"port": 2}, {"port": 3}, {"port": 4, "protocol": "FOO"}])),
            "Service shop/web: spec.ports[3] has invalid protocol \"FOO\" (TCP, UDP or SCTP)"
        );
        assert_eq!(
            ports(json!([{"port": 70000}])),
            "Service shop/web: spec.ports[0].port is 70000, not a port number (1-65535)"
        );
        assert_eq!(
            ports(json!([{"port": 80, "targetPort": -1}])),
            "Service shop/web: spec.ports[0].targetPort is -1, not a port number (1-65535)"
        );
        assert_eq!(
            ports(json!([{"port": 80, "nodePort": 65536}])),
            "Service shop/web: spec.ports[0].nodePort is 65536, not a port number (1-65535)"
        );
        assert_eq!(
            svc(json!({"healthCheckNodePort": -5})).unwrap_err().to_string(),
            "Service shop/web: spec.healthCheckNodePort is -5, not a port number (1-65535)"
        );
        assert_eq!(
            svc(json!({"loadBalancerSourceRanges": ["10.0.0.0/8", "office"]})).unwrap_err().to_string(),
            "Service shop/web: spec.loadBalancerSourceRanges[1] is \"office\", not a CIDR (10.0.0.0/8, 2001:db8::/32)"
        );
        for bad in ["10.0.0.0", "10.0.0/8", "10.0.0.0/33", "256.0.0.0/8", "2001:db8::/129", "10.0.0.0/-1"] {
            assert!(svc(json!({"loadBalancerSourceRanges": [bad]})).is_err(), "{bad}");
        }
        let e = svc(json!({"type": "Mesh"})).unwrap_err();
        assert_eq!(e.problem, Problem::UnknownServiceType("Mesh".into()));
        assert_eq!(
            svc(json!({"sessionAffinity": "Cookie"})).unwrap_err().problem,
            Problem::UnknownSessionAffinity("Cookie".into())
        );
        let timeout =
            svc(json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}));
        assert_eq!(timeout.unwrap_err().problem, Problem::InvalidAffinityTimeout(0));
        let unnamed = service(&k8s(json!({"metadata": {"namespace": "shop"}}))).unwrap_err();
        assert_eq!(unnamed.to_string(), "Service shop/<unnamed>: metadata.name is missing");
    }

    fn slice(body: Value) -> Result<EndpointSlice, ConvertError> {
        let mut v = json!({
            "metadata": {"name": "web-1", "namespace": "shop", "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": "IPv4", "endpoints": []
        });
        if let (Some(v), Value::Object(body)) = (v.as_object_mut(), body) {
            v.extend(body);
        }
        endpoint_slice(&k8s(v))
    }

    #[test]
    fn endpoint_slice_conditions_follow_api_defaults() {
        let s = slice(json!({
            "endpoints": [
                {"addresses": ["10.244.0.1"], "nodeName": "node-a", "zone": "zone-1",
                 "hints": {"forZones": [{"name": "zone-1"}], "forNodes": [{"name": "node-a"}, {"name": "node-b"}]}},
                {"addresses": ["10.244.0.2"], "conditions": {}},
                {"addresses": ["10.244.0.3"], "conditions": {"ready": false}},
                {"addresses": ["10.244.0.4"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                {"addresses": ["10.244.0.5"], "conditions": {"ready": false, "serving": false, "terminating": true}}
            ]
        }))
        .unwrap();
        assert_eq!(s.service_key(), ObjectKey::new("shop", "web"));
        let flags: Vec<_> = s.endpoints.iter().map(|e| (e.ready, e.serving, e.terminating)).collect();
        assert_eq!(
            flags,
            vec![
                (true, true, false),
                (true, true, false),
                (false, true, false),
                (false, true, true),
                (false, false, true)
            ]
        );
        assert_eq!(s.endpoints[0].node_name.as_deref(), Some("node-a"));
        assert_eq!(s.endpoints[0].zone.as_deref(), Some("zone-1"));
        assert_eq!(s.endpoints[1].node_name, None);
        assert_eq!(
            (s.endpoints[0].for_zones.as_slice(), s.endpoints[0].for_nodes.as_slice()),
            (&["zone-1".into()][..], &["node-a".into(), "node-b".into()][..])
        );
        assert!(s.endpoints[1].for_zones.is_empty() && s.endpoints[1].for_nodes.is_empty());
    }

    #[test]
    fn endpoint_slice_ports() {
        let s =
            slice(json!({"ports": [{"port": 8080}, {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "all"}]}))
                .unwrap();
        assert_eq!(
            s.ports,
            vec![
                EndpointPort { name: Default::default(), protocol: Protocol::Tcp, port: 8080 },
                EndpointPort { name: "dns".into(), protocol: Protocol::Udp, port: 53 },
            ],
            "a port without a number is skipped"
        );
        let e = slice(json!({"ports": [{"port": 80, "protocol": "ICMP"}]})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "EndpointSlice shop/web-1: ports[0] has invalid protocol \"ICMP\" (TCP, UDP or SCTP)"
        );
        assert!(matches!(
            slice(json!({"ports": [{"port": 0}]})).unwrap_err().problem,
            Problem::InvalidPort { value: 0, .. }
        ));
    }

    #[test]
    fn endpoint_slice_trigger_time() {
        let annotated = |time: &str| {
            let v = json!({"metadata": {"name": "web-1", "namespace": "shop", "labels": {SERVICE_NAME_LABEL: "web"},
                                        "annotations": {slim::TRIGGER_TIME_ANNOTATION: time}}, "endpoints": []});
            endpoint_slice(&k8s(v)).unwrap().trigger_time
        };
        let at = |secs: u64, nanos: u32| Some(std::time::UNIX_EPOCH + std::time::Duration::new(secs, nanos));
        // The EndpointSlice controller writes RFC 3339 with nanoseconds; offsets are read too.
        assert_eq!(annotated("2026-11-27T14:00:00.123456789Z"), at(1_795_788_000, 123_456_789));
        assert_eq!(annotated("2026-11-27T15:00:00+01:00"), at(1_795_788_000, 0));
        assert_eq!(annotated("yesterday"), None, "a malformed time is skipped, the slice kept");
        assert_eq!(slice(json!({})).unwrap().trigger_time, None);
    }

    #[test]
    fn service_cidrs() {
        let c = object_from_json(json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": ["10.96.0.0/12", "fd00:96::/108"]}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))
        .unwrap();
        let Some(ClusterObject::ServiceCidr(c)) = c else { panic!("{c:?}") };
        assert_eq!(
            (c.name.as_str(), c.cidrs),
            ("kubernetes", vec!["10.96.0.0/12".parse().unwrap(), "fd00:96::/108".parse().unwrap()])
        );
        let e = object_from_json(json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR", "metadata": {"name": "bad"}, "spec": {"cidrs": ["10.96.0.0/12", "10.300.0.0/16"]}}))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "ServiceCIDR bad: spec.cidrs[1] is \"10.300.0.0/16\", not a CIDR (10.0.0.0/8, 2001:db8::/32)"
        );
    }

    #[test]
    fn endpoint_slice_needs_its_service() {
        let e = endpoint_slice(&k8s(json!({"metadata": {"name": "orphan"}, "addressType": "IPv4", "endpoints": []})))
            .unwrap_err();
        assert_eq!(e.to_string(), "EndpointSlice default/orphan: label kubernetes.io/service-name is missing");
    }

    #[test]
    fn node_addresses_and_cidrs() {
        let n = node(&k8s(json!({
            "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-1"}},
            "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24", "fd00:10:244::/64"]},
            "status": {"addresses": [
                {"type": "ExternalIP", "address": "203.0.113.10"},
                {"type": "InternalIP", "address": "192.168.56.10"},
                {"type": "Hostname", "address": "node-a"},
                {"type": "InternalIP", "address": "fd00::10"}
            ]}
        })))
        .unwrap();
        assert_eq!(n.name, "node-a");
        assert_eq!(n.addresses, vec!["192.168.56.10", "fd00::10", "203.0.113.10"], "InternalIPs first, in their order");
        assert_eq!(n.pod_cidrs, vec!["10.244.0.0/24", "fd00:10:244::/64"]);
        assert_eq!(n.labels["topology.kubernetes.io/zone"], "zone-1");
        assert!(!n.being_deleted);
        let tainted = json!({"metadata": {"name": "n"}, "spec": {"taints": [{"key": "x", "effect": "NoSchedule"}, {"key": TO_BE_DELETED_TAINT, "value": "1700000000", "effect": "NoSchedule"}]}});
        assert!(node(&k8s(tainted)).unwrap().being_deleted, "the cluster autoscaler's taint");
        let deleting = json!({"metadata": {"name": "n", "deletionTimestamp": "2026-11-27T09:00:00Z"}, "spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}});
        assert!(node(&k8s(deleting)).unwrap().being_deleted, "a deletion timestamp");
        let old = node(&k8s(json!({"metadata": {"name": "old"}, "spec": {"podCIDR": "10.244.9.0/24"}}))).unwrap();
        assert_eq!(old.pod_cidrs, vec!["10.244.9.0/24"]);
        assert!(old.addresses.is_empty());
        let e = node(&k8s(json!({"metadata": {}}))).unwrap_err();
        assert_eq!(e.to_string(), "Node <unnamed>: metadata.name is missing");
    }

    #[test]
    fn namespace_labels() {
        let n = namespace(&k8s(json!({"metadata": {"name": "shop", "labels": {"team": "shop"}}}))).unwrap();
        assert_eq!((n.name.as_str(), n.labels["team"].as_str()), ("shop", "shop"));
        assert_eq!(namespace(&k8s(json!({"metadata": {"name": ""}}))).unwrap_err().problem, Problem::MissingName);
    }

    #[test]
    fn pod_ips_ports_and_host_network() {
        let p = pod(&k8s(json!({
            "metadata": {"name": "web-1", "namespace": "shop", "labels": {"app": "web"}},
            "spec": {
                "nodeName": "node-a",
                "containers": [
                    {"name": "web", "ports": [{"name": "http", "containerPort": 8080}]},
                    {"name": "sidecar", "ports": [{"name": "metrics", "containerPort": 9090}, {"containerPort": 53, "protocol": "UDP"}]},
                    {"name": "plain"}
                ]
            },
            "status": {"podIP": "10.244.0.11", "podIPs": [{"ip": "10.244.0.11"}, {"ip": "fd00::11"}]}
        })))
        .unwrap();
        assert_eq!(p.ips, vec!["10.244.0.11", "fd00::11"]);
        assert_eq!(p.node_name.as_deref(), Some("node-a"));
        assert_eq!(p.labels["app"], "web");
        assert!(!p.host_network);
        assert_eq!(
            p.ports,
            vec![
                ContainerPort {
                    name: "http".into(),
                    protocol: Protocol::Tcp,
                    port: 8080,
                    host_port: None,
                    host_ip: None
                },
                ContainerPort {
                    name: "metrics".into(),
                    protocol: Protocol::Tcp,
                    port: 9090,
                    host_port: None,
                    host_ip: None
                },
                ContainerPort {
                    name: Default::default(),
                    protocol: Protocol::Udp,
                    port: 53,
                    host_port: None,
                    host_ip: None
                },
            ]
        );
        let host = pod(&k8s(json!({"metadata": {"name": "agent"}, "spec": {"hostNetwork": true, "containers": []}, "status": {"podIP": "192.168.56.10"}}))).unwrap();
        assert_eq!(
            (host.namespace.as_str(), host.ips.as_slice(), host.host_network),
            ("default", &["192.168.56.10".into()][..], true)
        );
        let pending = pod(&k8s(json!({"metadata": {"name": "pending"}, "spec": {"containers": []}}))).unwrap();
        assert!(pending.ips.is_empty() && pending.node_name.is_none());
        let e = pod(&k8s(json!({"metadata": {"name": "bad"}, "spec": {"containers": [{"name": "c", "ports": [{"containerPort": 80, "protocol": "tcp"}]}]}})))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Pod default/bad: spec.containers[0].ports[0] has invalid protocol \"tcp\" (TCP, UDP or SCTP)"
        );
    }

    #[test]
    fn finished_pods_have_no_addresses() {
        let in_phase = |phase: &str| {
            let status =
                json!({"phase": phase, "podIP": "10.244.0.12", "podIPs": [{"ip": "10.244.0.12"}, {"ip": "fd00::12"}]});
            pod(&k8s(json!({"metadata": {"name": "job-1", "labels": {"app": "job"}}, "spec": {"nodeName": "node-a", "containers": []}, "status": status}))).unwrap()
        };
        for phase in ["Pending", "Running", "Unknown"] {
            assert_eq!(in_phase(phase).ips, ["10.244.0.12", "fd00::12"], "{phase}");
        }
        for phase in ["Succeeded", "Failed"] {
            let p = in_phase(phase);
            assert!(p.ips.is_empty(), "{phase}: a finished pod's addresses may be another pod's");
            assert_eq!(
                (p.labels["app"].as_str(), p.node_name.as_deref()),
                ("job", Some("node-a")),
                "{phase}: the pod itself is kept"
            );
        }
    }

    #[test]
    fn pod_host_ports_and_host_ips() {
        let with_ports = |ports: Value| {
            pod(&k8s(json!({"metadata": {"name": "ingress"}, "spec": {"containers": [{"name": "c", "ports": ports}]}})))
        };
        let p = with_ports(json!([
            {"name": "http", "containerPort": 8080, "hostPort": 18080},
            {"name": "dns", "containerPort": 53, "protocol": "UDP", "hostPort": 5353, "hostIP": "192.168.77.1"},
            {"containerPort": 443, "hostPort": 8443, "hostIP": "2001:DB8:0::10"},
            {"containerPort": 80, "hostPort": 18081, "hostIP": "0.0.0.0"},
            {"containerPort": 81, "hostPort": 18082, "hostIP": "::"},
            {"containerPort": 82, "hostPort": 18083, "hostIP": ""},
            {"containerPort": 9090, "hostPort": 0, "hostIP": "192.168.77.1"},
            {"containerPort": 9091}
        ]))
        .unwrap();
        let host: Vec<(u16, Option<u16>, Option<&str>)> =
            p.ports.iter().map(|c| (c.port, c.host_port, c.host_ip.as_deref())).collect();
        assert_eq!(
            host,
            vec![
                (8080, Some(18080), None),
                (53, Some(5353), Some("192.168.77.1")),
                (443, Some(8443), Some("2001:db8::10")),
                (80, Some(18081), None),
                (81, Some(18082), None),
                (82, Some(18083), None),
                (9090, None, None),
                (9091, None, None),
            ],
            "an unspecified or empty hostIP is every address; hostPort 0 is none, as in the API; addresses as IpAddr prints them"
        );
        let e = with_ports(json!([{"containerPort": 80}, {"containerPort": 8080, "hostPort": 70000}])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Pod default/ingress: spec.containers[0].ports[1].hostPort is 70000, not a port number (1-65535)"
        );
        let e = with_ports(json!([{"containerPort": 8080, "hostPort": -1}])).unwrap_err();
        assert!(matches!(e.problem, Problem::InvalidPort { value: -1, .. }), "{e}");
        let e = with_ports(json!([{"containerPort": 8080, "hostPort": 18080, "hostIP": "node-a"}])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Pod default/ingress: spec.containers[0].ports[0].hostIP is \"node-a\", not an IP address (192.168.0.10, 2001:db8::10)"
        );
        let e =
            with_ports(json!([{"containerPort": 8080, "hostPort": 18080, "hostIP": "192.168.77.0/24"}])).unwrap_err();
        assert!(matches!(e.problem, Problem::InvalidIp { .. }), "{e}");
    }

    fn policy(spec: Value) -> Result<NetworkPolicy, ConvertError> {
        network_policy(&k8s(json!({"metadata": {"name": "p", "namespace": "shop", "generation": 3}, "spec": spec})))
    }

    #[test]
    fn network_policy_types() {
        let rule = json!([{}]);
        let sides = |spec: Value| {
            let p = policy(spec).unwrap();
            (p.ingress.map(|r| r.len()), p.egress.map(|r| r.len()))
        };
        assert_eq!(sides(json!({})), (Some(0), None), "no policyTypes, no egress: isolates ingress only");
        assert_eq!(sides(json!({"policyTypes": []})), (Some(0), None), "an empty list is the same as none");
        assert_eq!(sides(json!({"egress": rule})), (Some(0), Some(1)), "no policyTypes, egress present: both");
        assert_eq!(sides(json!({"policyTypes": ["Ingress"], "egress": rule})), (Some(0), None));
        assert_eq!(sides(json!({"policyTypes": ["Egress"], "ingress": rule})), (None, Some(0)));
        assert_eq!(sides(json!({"policyTypes": ["Ingress", "Egress"], "ingress": rule})), (Some(1), Some(0)));
        assert_eq!(
            policy(json!({"policyTypes": ["Sideways"]})).unwrap_err().problem,
            Problem::UnknownPolicyType("Sideways".into())
        );
    }

    #[test]
    fn network_policy_rules() {
        let p = policy(json!({
            "podSelector": {"matchLabels": {"app": "api"}},
            "ingress": [{
                "from": [
                    {"podSelector": {"matchLabels": {"app": "web"}}, "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["shop"]}]}},
                    {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}
                ],
                "ports": [{"port": 8000, "endPort": 8100}, {"port": "https-api"}, {"protocol": "UDP"}]
            }],
            "egress": [{"to": [{"namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "Exists"}]}}]}]
        }))
        .unwrap();
        assert_eq!((p.namespace.as_str(), p.name.as_str(), p.generation), ("shop", "p", 3));
        assert_eq!(p.pod_selector.match_labels["app"], "api");
        let rule = &p.ingress.as_ref().unwrap()[0];
        assert_eq!(
            rule.ports,
            vec![
                PolicyPort { protocol: Protocol::Tcp, port: PolicyPortNumber::Number(8000), end_port: Some(8100) },
                PolicyPort {
                    protocol: Protocol::Tcp,
                    port: PolicyPortNumber::Name("https-api".into()),
                    end_port: None
                },
                PolicyPort { protocol: Protocol::Udp, port: PolicyPortNumber::Any, end_port: None },
            ]
        );
        assert_eq!(rule.peers[0].pod_selector.as_ref().unwrap().match_labels["app"], "web");
        assert_eq!(
            rule.peers[0].namespace_selector.as_ref().unwrap().match_expressions,
            vec![SelectorRequirement {
                key: "team".into(),
                operator: SelectorOperator::In,
                values: vec!["shop".into()]
            }]
        );
        assert_eq!(
            rule.peers[1].ip_block,
            Some(IpBlock { cidr: "10.0.0.0/8".into(), except: vec!["10.1.0.0/16".into()] })
        );
        assert_eq!(rule.peers[1].pod_selector, None);
        let egress = &p.egress.as_ref().unwrap()[0];
        assert_eq!(
            egress.peers[0].namespace_selector.as_ref().unwrap().match_expressions[0].operator,
            SelectorOperator::Exists
        );

        let all = network_policy(&k8s(json!({"metadata": {"name": "deny"}, "spec": {"podSelector": {}}}))).unwrap();
        assert_eq!((all.namespace.as_str(), all.generation), ("default", 0));
        assert_eq!(all.pod_selector, LabelSelector::default());
        assert_eq!(all.ingress, Some(vec![]));
    }

    #[test]
    fn network_policy_errors() {
        let e = policy(json!({"ingress": [{"ports": [{"port": "https", "endPort": 9000}]}]})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "NetworkPolicy shop/p: spec.ingress[0].ports[0].endPort 9000 needs a numeric port no greater than it"
        );
        let e = policy(json!({"egress": [{"ports": [{"port": 9000, "endPort": 8000}]}]})).unwrap_err();
        assert!(matches!(e.problem, Problem::InvalidEndPort { .. }), "{e}");
        let e = policy(
            json!({"egress": [{"to": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Like"}]}}]}]}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "NetworkPolicy shop/p: spec.egress[0].to[0].podSelector.matchExpressions[0] has unknown operator \"Like\" (In, NotIn, Exists or DoesNotExist)"
        );
        assert!(matches!(
            policy(json!({"ingress": [{"ports": [{"port": 0}]}]})).unwrap_err().problem,
            Problem::InvalidPort { .. }
        ));
    }

    #[test]
    fn object_from_json_dispatches_on_api_version_and_kind() {
        let kinds = [
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}),
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}}),
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}),
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4", "endpoints": [],
                   "metadata": {"name": "e", "labels": {SERVICE_NAME_LABEL: "s"}}}),
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "np"}}),
        ];
        let keys: Vec<String> =
            kinds.into_iter().map(|v| object_from_json(v).unwrap().unwrap().key().to_string()).collect();
        assert_eq!(keys, vec!["default/s", "n", "ns", "default/p", "default/e", "default/np"]);

        for ignored in [
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}}),
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a": "b"}}),
            json!({"apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice", "metadata": {"name": "old"}}),
            json!({"kind": "Service"}),
        ] {
            assert!(object_from_json(ignored).unwrap().is_none());
        }
    }

    #[test]
    fn object_from_json_reports_schema_errors() {
        let e = object_from_json(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "shop"}, "spec": {"ports": [{"port": "eighty"}]}}))
            .unwrap_err();
        assert_eq!((e.kind, e.object.as_str()), ("Service", "shop/s"));
        assert!(matches!(e.problem, Problem::Schema(_)), "{e}");
        let e = object_from_json(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": "e"}, "endpoints": {"addresses": []}}))
            .unwrap_err();
        assert!(
            e.to_string().starts_with(
                "EndpointSlice default/e: does not match the Kubernetes schema: invalid type: map, expected"
            ),
            "{e}"
        );
        let e = object_from_json(
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}, "spec": {"podCIDRs": "10.0.0.0/24"}}),
        )
        .unwrap_err();
        assert_eq!(e.object, "n", "cluster-scoped objects have no namespace");
    }
}
