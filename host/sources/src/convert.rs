//! Kubernetes API objects (k8s-openapi) to wasmplane's model types.

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use wasmplane_model::state::ClusterObject;
use wasmplane_model::*;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{kind} {object}: {reason}")]
pub struct ConvertError {
    pub kind: &'static str,
    pub object: String,
    pub reason: String,
}

fn err(kind: &'static str, m: &meta::ObjectMeta, reason: impl Into<String>) -> ConvertError {
    let object = format!("{}/{}", m.namespace.as_deref().unwrap_or("default"), m.name.as_deref().unwrap_or("<unnamed>"));
    ConvertError { kind, object, reason: reason.into() }
}

fn name(kind: &'static str, m: &meta::ObjectMeta) -> Result<String, ConvertError> {
    m.name.clone().filter(|n| !n.is_empty()).ok_or_else(|| err(kind, m, "metadata.name is missing"))
}

fn namespace(m: &meta::ObjectMeta) -> String {
    m.namespace.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| "default".into())
}

fn labels(m: &meta::ObjectMeta) -> Labels {
    m.labels.clone().unwrap_or_default().into_iter().collect()
}

fn protocol(kind: &'static str, m: &meta::ObjectMeta, p: Option<&String>) -> Result<Protocol, ConvertError> {
    match p.map(String::as_str) {
        None => Ok(Protocol::Tcp),
        Some(s) => Protocol::parse(s).ok_or_else(|| err(kind, m, format!("invalid protocol {s:?} (TCP, UDP or SCTP)"))),
    }
}

fn port(kind: &'static str, m: &meta::ObjectMeta, p: i32) -> Result<u16, ConvertError> {
    u16::try_from(p).ok().filter(|p| *p > 0).ok_or_else(|| err(kind, m, format!("invalid port {p}")))
}

fn policy(p: Option<&String>) -> TrafficPolicy {
    if p.map(String::as_str) == Some("Local") { TrafficPolicy::Local } else { TrafficPolicy::Cluster }
}

pub fn service(s: &core::Service) -> Result<Service, ConvertError> {
    const K: &str = "Service";
    let m = &s.metadata;
    let spec = s.spec.clone().unwrap_or_default();
    let service_type = match spec.type_.as_deref() {
        None | Some("ClusterIP") => ServiceType::ClusterIP,
        Some("NodePort") => ServiceType::NodePort,
        Some("LoadBalancer") => ServiceType::LoadBalancer,
        Some("ExternalName") => ServiceType::ExternalName,
        Some(other) => return Err(err(K, m, format!("unknown type {other:?}"))),
    };
    let cluster_ips = spec.cluster_ips.clone().filter(|v| !v.is_empty()).or_else(|| spec.cluster_ip.clone().map(|ip| vec![ip])).unwrap_or_default();
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let number = port(K, m, p.port).map_err(|e| ConvertError { reason: format!("port {i}: {}", e.reason), ..e })?;
        let target_port = match &p.target_port {
            None => TargetPort::Number(number),
            Some(IntOrString::Int(n)) => TargetPort::Number(port(K, m, *n)?),
            Some(IntOrString::String(s)) => match s.parse::<i32>() {
                Ok(n) => TargetPort::Number(port(K, m, n)?),
                Err(_) => TargetPort::Name(s.clone()),
            },
        };
        ports.push(ServicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol: protocol(K, m, p.protocol.as_ref()).map_err(|e| ConvertError { reason: format!("port {i}: {}", e.reason), ..e })?,
            port: number,
            node_port: p.node_port.map(|n| port(K, m, n)).transpose()?.unwrap_or(0),
            target_port,
        });
    }
    let session_affinity_timeout = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(10800)
    });
    let load_balancer_ips = s
        .status
        .as_ref()
        .and_then(|st| st.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|ing| ing.iter().filter_map(|i| i.ip.clone()).collect())
        .unwrap_or_default();
    Ok(Service {
        namespace: namespace(m),
        name: name(K, m)?,
        service_type,
        cluster_ips,
        external_ips: spec.external_ips.clone().unwrap_or_default(),
        load_balancer_ips,
        ports,
        session_affinity_timeout,
        external_traffic_policy: policy(spec.external_traffic_policy.as_ref()),
        internal_traffic_policy: policy(spec.internal_traffic_policy.as_ref()),
        labels: labels(m),
    })
}

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

pub fn endpoint_slice(s: &discovery::EndpointSlice) -> Result<EndpointSlice, ConvertError> {
    const K: &str = "EndpointSlice";
    let m = &s.metadata;
    let service_name = m
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .cloned()
        .ok_or_else(|| err(K, m, format!("label {SERVICE_NAME_LABEL} is missing")))?;
    let endpoints = s
        .endpoints
        .iter()
        .map(|e| {
            let c = e.conditions.clone().unwrap_or_default();
            // API semantics: a missing `ready` means ready; `serving` defaults to `ready`.
            let ready = c.ready.unwrap_or(true);
            Endpoint {
                addresses: e.addresses.clone(),
                ready,
                serving: c.serving.unwrap_or(ready),
                terminating: c.terminating.unwrap_or(false),
                node_name: e.node_name.clone(),
                zone: e.zone.clone(),
            }
        })
        .collect();
    let mut ports = Vec::new();
    for p in s.ports.iter().flatten() {
        let Some(number) = p.port else { continue };
        ports.push(EndpointPort { name: p.name.clone().unwrap_or_default(), protocol: protocol(K, m, p.protocol.as_ref())?, port: port(K, m, number)? });
    }
    Ok(EndpointSlice { namespace: namespace(m), name: name(K, m)?, service_name, endpoints, ports })
}

pub fn node(n: &core::Node) -> Result<Node, ConvertError> {
    let m = &n.metadata;
    let spec = n.spec.clone().unwrap_or_default();
    let pod_cidrs = spec.pod_cidrs.filter(|v| !v.is_empty()).or_else(|| spec.pod_cidr.map(|c| vec![c])).unwrap_or_default();
    let addresses = n
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|a| a.iter().filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP").map(|a| a.address.clone()).collect())
        .unwrap_or_default();
    Ok(Node { name: name("Node", m)?, addresses, pod_cidrs, labels: labels(m) })
}

pub fn namespace_object(n: &core::Namespace) -> Result<Namespace, ConvertError> {
    Ok(Namespace { name: name("Namespace", &n.metadata)?, labels: labels(&n.metadata) })
}

pub fn pod(p: &core::Pod) -> Result<Pod, ConvertError> {
    const K: &str = "Pod";
    let m = &p.metadata;
    let spec = p.spec.clone().unwrap_or_default();
    let status = p.status.clone().unwrap_or_default();
    let ips = status
        .pod_ips
        .filter(|v| !v.is_empty())
        .map(|v| v.into_iter().map(|ip| ip.ip).collect())
        .or_else(|| status.pod_ip.map(|ip| vec![ip]))
        .unwrap_or_default();
    let mut ports = Vec::new();
    for c in &spec.containers {
        for cp in c.ports.iter().flatten() {
            ports.push(ContainerPort { name: cp.name.clone().unwrap_or_default(), protocol: protocol(K, m, cp.protocol.as_ref())?, port: port(K, m, cp.container_port)? });
        }
    }
    Ok(Pod {
        namespace: namespace(m),
        name: name(K, m)?,
        ips,
        node_name: spec.node_name,
        labels: labels(m),
        ports,
        host_network: spec.host_network.unwrap_or(false),
    })
}

fn selector(s: &meta::LabelSelector) -> Result<LabelSelector, String> {
    let mut expressions = Vec::new();
    for r in s.match_expressions.iter().flatten() {
        let operator = match r.operator.as_str() {
            "In" => SelectorOperator::In,
            "NotIn" => SelectorOperator::NotIn,
            "Exists" => SelectorOperator::Exists,
            "DoesNotExist" => SelectorOperator::DoesNotExist,
            other => return Err(format!("unknown selector operator {other:?}")),
        };
        expressions.push(SelectorRequirement { key: r.key.clone(), operator, values: r.values.clone().unwrap_or_default() });
    }
    Ok(LabelSelector { match_labels: s.match_labels.clone().unwrap_or_default().into_iter().collect(), match_expressions: expressions })
}

pub fn network_policy(p: &networking::NetworkPolicy) -> Result<NetworkPolicy, ConvertError> {
    const K: &str = "NetworkPolicy";
    let m = &p.metadata;
    let spec = p.spec.clone().unwrap_or_default();
    let fail = |reason: String| err(K, m, reason);
    let ports = |ports: &Option<Vec<networking::NetworkPolicyPort>>| -> Result<Vec<PolicyPort>, ConvertError> {
        ports
            .iter()
            .flatten()
            .map(|p| {
                let port = match &p.port {
                    None => PolicyPortNumber::Any,
                    Some(IntOrString::Int(n)) => PolicyPortNumber::Number(port(K, m, *n)?),
                    Some(IntOrString::String(s)) => PolicyPortNumber::Name(s.clone()),
                };
                Ok(PolicyPort { protocol: protocol(K, m, p.protocol.as_ref())?, port, end_port: p.end_port.map(|e| port_of(K, m, e)).transpose()? })
            })
            .collect()
    };
    let peers = |peers: &Option<Vec<networking::NetworkPolicyPeer>>| -> Result<Vec<PolicyPeer>, ConvertError> {
        peers
            .iter()
            .flatten()
            .map(|peer| {
                Ok(PolicyPeer {
                    pod_selector: peer.pod_selector.as_ref().map(selector).transpose().map_err(fail)?,
                    namespace_selector: peer.namespace_selector.as_ref().map(selector).transpose().map_err(fail)?,
                    ip_block: peer.ip_block.as_ref().map(|b| IpBlock { cidr: b.cidr.clone(), except: b.except.clone().unwrap_or_default() }),
                })
            })
            .collect()
    };
    let types = spec.policy_types.clone();
    let has = |t: &str| types.as_ref().is_some_and(|ts| ts.iter().any(|x| x == t));
    let ingress_on = types.is_none() || has("Ingress");
    let egress_on = if types.is_none() { spec.egress.is_some() } else { has("Egress") };
    let ingress = if ingress_on {
        Some(spec.ingress.iter().flatten().map(|r| Ok(PolicyRule { ports: ports(&r.ports)?, peers: peers(&r.from)? })).collect::<Result<Vec<_>, ConvertError>>()?)
    } else {
        None
    };
    let egress = if egress_on {
        Some(spec.egress.iter().flatten().map(|r| Ok(PolicyRule { ports: ports(&r.ports)?, peers: peers(&r.to)? })).collect::<Result<Vec<_>, ConvertError>>()?)
    } else {
        None
    };
    Ok(NetworkPolicy {
        namespace: namespace(m),
        name: name(K, m)?,
        generation: m.generation.and_then(|g| u64::try_from(g).ok()).unwrap_or(0),
        pod_selector: spec.pod_selector.as_ref().map(selector).transpose().map_err(fail)?.unwrap_or_default(),
        ingress,
        egress,
    })
}

fn port_of(kind: &'static str, m: &meta::ObjectMeta, p: i32) -> Result<u16, ConvertError> {
    port(kind, m, p)
}

/// Converts one manifest document; `Ok(None)` for kinds wasmplane does not watch.
pub fn object_from_json(value: serde_json::Value) -> Result<Option<ClusterObject>, ConvertError> {
    let api_version = value.get("apiVersion").and_then(|v| v.as_str()).unwrap_or_default().to_string();
    let kind = value.get("kind").and_then(|v| v.as_str()).unwrap_or_default().to_string();
    fn parse<T: serde::de::DeserializeOwned>(kind: &'static str, value: serde_json::Value) -> Result<T, ConvertError> {
        let object = value.pointer("/metadata/name").and_then(|v| v.as_str()).unwrap_or("<unnamed>").to_string();
        serde_json::from_value(value).map_err(|e| ConvertError { kind, object, reason: e.to_string() })
    }
    Ok(Some(match (api_version.as_str(), kind.as_str()) {
        ("v1", "Service") => ClusterObject::Service(service(&parse("Service", value)?)?),
        ("v1", "Node") => ClusterObject::Node(node(&parse("Node", value)?)?),
        ("v1", "Namespace") => ClusterObject::Namespace(namespace_object(&parse("Namespace", value)?)?),
        ("v1", "Pod") => ClusterObject::Pod(pod(&parse("Pod", value)?)?),
        ("discovery.k8s.io/v1", "EndpointSlice") => ClusterObject::EndpointSlice(endpoint_slice(&parse("EndpointSlice", value)?)?),
        ("networking.k8s.io/v1", "NetworkPolicy") => ClusterObject::NetworkPolicy(network_policy(&parse("NetworkPolicy", value)?)?),
        _ => return Ok(None),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn service_defaults_and_errors() {
        let obj = object_from_json(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"clusterIP": "10.96.0.20", "sessionAffinity": "ClientIP",
                     "ports": [{"port": 80}, {"name": "named", "port": 81, "targetPort": "http"}]}
        }))
        .unwrap()
        .unwrap();
        let ClusterObject::Service(s) = obj else { panic!() };
        assert_eq!(s.namespace, "default");
        assert_eq!(s.cluster_ips, vec!["10.96.0.20"]);
        assert_eq!(s.ports[0].protocol, Protocol::Tcp);
        assert_eq!(s.ports[0].target_port, TargetPort::Number(80));
        assert_eq!(s.ports[1].target_port, TargetPort::Name("http".into()));
        assert_eq!(s.session_affinity_timeout, Some(10800));
        let e = object_from_json(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "bad", "namespace": "x"},
            "spec": {"ports": [{"port": 80, "protocol": "FOO"}]}}))
        .unwrap_err();
        assert_eq!(e.to_string(), "Service x/bad: port 0: invalid protocol \"FOO\" (TCP, UDP or SCTP)");
        assert!(object_from_json(json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}})).unwrap().is_none());
    }

    #[test]
    fn endpoint_slice_conditions_follow_api_defaults() {
        let obj = object_from_json(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": "web-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": ["10.244.0.1"]}, {"addresses": ["10.244.0.2"], "conditions": {"ready": false, "terminating": true, "serving": true}}]
        }))
        .unwrap()
        .unwrap();
        let ClusterObject::EndpointSlice(s) = obj else { panic!() };
        assert_eq!(s.service_name, "web");
        assert!(s.endpoints[0].ready && s.endpoints[0].serving && !s.endpoints[0].terminating);
        assert!(!s.endpoints[1].ready && s.endpoints[1].serving && s.endpoints[1].terminating);
        let missing = object_from_json(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4", "metadata": {"name": "x"}, "endpoints": []}));
        assert!(missing.unwrap_err().reason.contains("kubernetes.io/service-name"));
    }

    #[test]
    fn network_policy_types_are_inferred() {
        let obj = object_from_json(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": "shop", "generation": 3},
            "spec": {"podSelector": {"matchLabels": {"app": "api"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": 8000, "endPort": 8100}]}]}
        }))
        .unwrap()
        .unwrap();
        let ClusterObject::NetworkPolicy(p) = obj else { panic!() };
        assert_eq!(p.generation, 3);
        assert!(p.egress.is_none(), "no policyTypes and no egress: ingress only");
        let rule = &p.ingress.as_ref().unwrap()[0];
        assert_eq!(rule.ports[0].end_port, Some(8100));
        assert_eq!(rule.peers[0].pod_selector.as_ref().unwrap().match_labels["app"], "web");
    }
}
