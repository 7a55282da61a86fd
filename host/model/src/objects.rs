//! Cluster objects, normalised to what wasmplane needs (not the full Kubernetes schema).

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::CompactString;

/// `namespace/name`; cluster-scoped objects have an empty namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectKey {
    pub namespace: CompactString,
    pub name: CompactString,
}

impl ObjectKey {
    pub fn new(namespace: impl AsRef<str>, name: impl AsRef<str>) -> Self {
        ObjectKey { namespace: namespace.as_ref().into(), name: name.as_ref().into() }
    }
    pub fn cluster(name: impl AsRef<str>) -> Self {
        ObjectKey { namespace: CompactString::default(), name: name.as_ref().into() }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() { f.write_str(&self.name) } else { write!(f, "{}/{}", self.namespace, self.name) }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub fn parse(s: &str) -> Option<Protocol> {
        match s {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
    pub fn as_nft(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

pub use crate::labels::Labels;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum ServiceType {
    #[default]
    ClusterIP,
    NodePort,
    LoadBalancer,
    ExternalName,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum TrafficPolicy {
    #[default]
    Cluster,
    Local,
}

/// Which cluster's endpoints a global Service prefers (`wasmplane.io/affinity`, Cilium's
/// `service.cilium.io/affinity`): the preferred ones while any is ready, the others only then.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum ClusterAffinity {
    /// Every cluster's endpoints alike.
    #[default]
    None,
    /// This cluster's.
    Local,
    /// Other clusters'.
    Remote,
}

impl ClusterAffinity {
    fn is_none(&self) -> bool {
        *self == ClusterAffinity::None
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetPort {
    Number(u16),
    Name(CompactString),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServicePort {
    pub name: CompactString,
    pub protocol: Protocol,
    pub port: u16,
    /// 0 when none is allocated.
    pub node_port: u16,
    pub target_port: TargetPort,
}

impl ServicePort {
    /// A TCP port forwarded to a numbered target port, with no node port.
    pub fn tcp(name: &str, port: u16, target_port: u16) -> ServicePort {
        ServicePort {
            name: name.into(),
            protocol: Protocol::Tcp,
            port,
            node_port: 0,
            target_port: TargetPort::Number(target_port),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Service {
    pub namespace: CompactString,
    pub name: CompactString,
    pub service_type: ServiceType,
    pub cluster_ips: Vec<CompactString>,
    pub external_ips: Vec<CompactString>,
    pub load_balancer_ips: Vec<CompactString>,
    pub ports: Vec<ServicePort>,
    pub session_affinity_timeout: Option<u32>,
    pub external_traffic_policy: TrafficPolicy,
    pub internal_traffic_policy: TrafficPolicy,
    /// `spec.healthCheckNodePort` (0: none): where this node answers a load balancer's health
    /// check for a `LoadBalancer` service with `externalTrafficPolicy: Local`.
    #[serde(default)]
    pub health_check_node_port: u16,
    /// `spec.loadBalancerSourceRanges`, as networks: the only sources allowed to reach the
    /// service through its load balancer addresses (see [`Service::firewalled_frontends`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub load_balancer_source_ranges: Vec<IpNet>,
    pub labels: Labels,
    /// Annotated `wasmplane.io/global: "true"`: the endpoints other clusters export for the
    /// same namespace and name are backends here too (Cilium's global services).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub global: bool,
    /// A global service's preference among the clusters' endpoints.
    #[serde(default, skip_serializing_if = "ClusterAffinity::is_none")]
    pub cluster_affinity: ClusterAffinity,
    /// `metadata.creationTimestamp`, Unix seconds (`None`: not given, as in a manifest):
    /// of two services claiming one frontend, the older keeps it, in every run alike.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_unix: Option<i64>,
}

/// A load balancer frontend closed to all sources but some (kube-proxy's `firewall-ips`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirewalledFrontend {
    pub address: IpAddr,
    pub protocol: Protocol,
    pub port: u16,
    /// Sources allowed, of the address's family: sorted, none overlapping another.
    pub allowed: Vec<IpNet>,
}

impl Service {
    /// A ClusterIP service with what the API server defaults for the rest: traffic
    /// policies `Cluster`, no session affinity, no other addresses, no labels.
    pub fn cluster_ip(namespace: &str, name: &str, cluster_ip: &str, ports: Vec<ServicePort>) -> Service {
        Service {
            namespace: namespace.into(),
            name: name.into(),
            service_type: ServiceType::ClusterIP,
            cluster_ips: vec![cluster_ip.into()],
            external_ips: vec![],
            load_balancer_ips: vec![],
            ports,
            session_affinity_timeout: None,
            external_traffic_policy: TrafficPolicy::Cluster,
            internal_traffic_policy: TrafficPolicy::Cluster,
            health_check_node_port: 0,
            load_balancer_source_ranges: vec![],
            labels: Labels::new(),
            global: false,
            cluster_affinity: ClusterAffinity::None,
            created_unix: None,
        }
    }

    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(&self.namespace, &self.name)
    }
    /// The load balancer frontends `spec.loadBalancerSourceRanges` closes to other sources,
    /// as kube-proxy closes them: each load balancer address with each service port, open to
    /// the ranges of the address's family only. An address with no range of its family
    /// stays open (kube-proxy runs one proxier per family, and the other's ranges are not
    /// its). When a range holds one of `node_ips`, the load balancer addresses themselves are
    /// allowed as sources too: a VIP-like load balancer's address is often local to the
    /// nodes, so the node's own requests to it loop back with the VIP as their source.
    pub fn firewalled_frontends(&self, node_ips: &[CompactString]) -> Vec<FirewalledFrontend> {
        if self.load_balancer_source_ranges.is_empty() {
            return Vec::new();
        }
        let mut addresses: Vec<IpAddr> = self.load_balancer_ips.iter().filter_map(|ip| ip.parse().ok()).collect();
        addresses.sort();
        addresses.dedup();
        let node_ips: Vec<IpAddr> = node_ips.iter().filter_map(|ip| ip.parse().ok()).collect();
        let mut frontends = Vec::new();
        for address in &addresses {
            let same_family = |ip: &IpAddr| ip.is_ipv4() == address.is_ipv4();
            let mut allowed: Vec<IpNet> =
                self.load_balancer_source_ranges.iter().filter(|r| same_family(&r.addr())).map(IpNet::trunc).collect();
            if allowed.is_empty() {
                continue;
            }
            if allowed.iter().any(|range| node_ips.iter().any(|ip| range.contains(ip))) {
                allowed.extend(addresses.iter().filter(|a| same_family(a)).map(|a| IpNet::from(*a)));
            }
            // The kernel keeps a frontend's ranges in one interval set: none may overlap.
            let allowed = IpNet::aggregate(&allowed);
            for port in &self.ports {
                frontends.push(FirewalledFrontend {
                    address: *address,
                    protocol: port.protocol,
                    port: port.port,
                    allowed: allowed.clone(),
                });
            }
        }
        frontends
    }

    /// Headless and ExternalName services have nothing for the dataplane.
    pub fn is_proxied(&self) -> bool {
        self.service_type != ServiceType::ExternalName
            && self.cluster_ips.iter().any(|ip| !ip.is_empty() && ip != "None")
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub addresses: Vec<CompactString>,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<CompactString>,
    pub zone: Option<CompactString>,
    /// Topology hints (`hints.forZones`): the zones this endpoint should serve.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub for_zones: Vec<CompactString>,
    /// Node hints (`hints.forNodes`, `trafficDistribution: PreferSameNode`): the nodes this
    /// endpoint should serve.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub for_nodes: Vec<CompactString>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointPort {
    pub name: CompactString,
    pub protocol: Protocol,
    pub port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointSlice {
    pub namespace: CompactString,
    pub name: CompactString,
    /// From the `kubernetes.io/service-name` label.
    pub service_name: CompactString,
    pub endpoints: Vec<Endpoint>,
    pub ports: Vec<EndpointPort>,
    /// When the change this version of the slice reflects happened (the EndpointSlice
    /// controller's `endpoints.kubernetes.io/last-change-trigger-time`): where the network
    /// programming latency of the change starts. Not part of any view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger_time: Option<std::time::SystemTime>,
    /// The cluster this slice was imported from (a global service's endpoints elsewhere,
    /// read from the kvstore); `None`: this cluster's own, from its API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<CompactString>,
}

impl EndpointSlice {
    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(&self.namespace, &self.name)
    }
    pub fn service_key(&self) -> ObjectKey {
        ObjectKey::new(&self.namespace, &self.service_name)
    }

    /// The same slice but for its trigger time: an update that changed only the annotation.
    pub fn same_but_trigger_time(&self, other: &EndpointSlice) -> bool {
        let EndpointSlice { namespace, name, service_name, endpoints, ports, trigger_time: _, cluster } = self;
        (namespace, name, service_name, endpoints, ports, cluster)
            == (&other.namespace, &other.name, &other.service_name, &other.endpoints, &other.ports, &other.cluster)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub name: CompactString,
    pub addresses: Vec<CompactString>,
    pub pod_cidrs: Vec<CompactString>,
    pub labels: Labels,
    /// The node is going away: it has a deletion timestamp, or the cluster autoscaler's
    /// `ToBeDeletedByClusterAutoscaler` taint. Load balancers should drain it (KEP-3836).
    #[serde(default)]
    pub being_deleted: bool,
}

/// The well-known label that places a node in a zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

impl Node {
    pub fn zone(&self) -> Option<&str> {
        self.labels.get(ZONE_LABEL).map(CompactString::as_str)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    pub name: CompactString,
    pub labels: Labels,
}

/// A range cluster IPs are allocated from (`networking.k8s.io/v1` ServiceCIDR, GA in
/// Kubernetes 1.33): an address in one that no service has is dropped on the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceCidr {
    pub name: CompactString,
    pub cidrs: Vec<IpNet>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerPort {
    pub name: CompactString,
    pub protocol: Protocol,
    pub port: u16,
    /// `hostPort`: the node forwards this port of its addresses to `port` of the pod.
    /// Defaults keep recordings and JSON from before it loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_port: Option<u16>,
    /// `hostIP`: the one node address `host_port` is served on (an IP, as `IpAddr` prints it);
    /// `None`: every address (also for an empty, `0.0.0.0` or `::` one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ip: Option<CompactString>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    pub namespace: CompactString,
    pub name: CompactString,
    pub ips: Vec<CompactString>,
    pub node_name: Option<CompactString>,
    pub labels: Labels,
    pub ports: Vec<ContainerPort>,
    pub host_network: bool,
}

impl Pod {
    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(&self.namespace, &self.name)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SelectorOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectorRequirement {
    pub key: CompactString,
    pub operator: SelectorOperator,
    pub values: Vec<CompactString>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct LabelSelector {
    pub match_labels: Labels,
    pub match_expressions: Vec<SelectorRequirement>,
}

impl LabelSelector {
    /// One label every object this selector matches carries (its first `matchLabels` pair;
    /// `None`: it requires none), by which the model's indexes file selectors and look them up.
    /// Filing and lookup must take the same pair, so both ask this.
    pub fn required_label(&self) -> Option<(&CompactString, &CompactString)> {
        self.match_labels.iter().next()
    }

    /// Kubernetes semantics: every `matchLabels` pair and every expression must hold; the
    /// empty selector matches everything.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| {
                let value = labels.get(&r.key);
                match r.operator {
                    SelectorOperator::In => value.is_some_and(|v| r.values.contains(v)),
                    SelectorOperator::NotIn => value.is_none_or(|v| !r.values.contains(v)),
                    SelectorOperator::Exists => value.is_some(),
                    SelectorOperator::DoesNotExist => value.is_none(),
                }
            })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpBlock {
    pub cidr: CompactString,
    pub except: Vec<CompactString>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PolicyPortNumber {
    Any,
    Number(u16),
    Name(CompactString),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyPort {
    pub protocol: Protocol,
    pub port: PolicyPortNumber,
    pub end_port: Option<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyPeer {
    pub pod_selector: Option<LabelSelector>,
    pub namespace_selector: Option<LabelSelector>,
    pub ip_block: Option<IpBlock>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRule {
    pub ports: Vec<PolicyPort>,
    pub peers: Vec<PolicyPeer>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    pub namespace: CompactString,
    pub name: CompactString,
    /// `metadata.uid` (empty from a manifest without one): names the policy in the per-node
    /// realization status, so a recreated policy is not mistaken for its predecessor.
    #[serde(default)]
    pub uid: CompactString,
    pub generation: u64,
    pub pod_selector: LabelSelector,
    pub ingress: Option<Vec<PolicyRule>>,
    pub egress: Option<Vec<PolicyRule>>,
}

impl NetworkPolicy {
    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(&self.namespace, &self.name)
    }

    /// Every peer of every ingress and egress rule.
    pub fn peers(&self) -> impl Iterator<Item = &PolicyPeer> {
        self.ingress.iter().chain(self.egress.iter()).flatten().flat_map(|rule| rule.peers.iter())
    }

    /// Whether some peer selects pods outside the policy's own namespace, so that a change in
    /// any namespace may concern it.
    pub fn has_namespace_selectors(&self) -> bool {
        self.peers().any(|p| p.namespace_selector.is_some())
    }

    /// Whether `pod` (in a namespace labelled `namespace_labels`) is one this policy selects
    /// or names as a peer: the test the model's pod index uses to find what a change touches.
    pub fn involves(&self, pod: &Pod, namespace_labels: Option<&Labels>) -> bool {
        self.selects(pod) || self.peers().any(|peer| peer.selects(&self.namespace, pod, namespace_labels))
    }

    /// The pods the policy applies to: its own namespace, matching `podSelector`.
    pub fn selects(&self, pod: &Pod) -> bool {
        pod.namespace == self.namespace && !pod.host_network && self.pod_selector.matches(&pod.labels)
    }
}

impl PolicyPeer {
    /// NetworkPolicy peer semantics: a pod selector alone means the policy's namespace; a
    /// namespace selector alone means every pod of the matching namespaces; both means the
    /// matching pods of the matching namespaces. An ipBlock selects no pod.
    pub fn selects(&self, policy_namespace: &str, pod: &Pod, namespace_labels: Option<&Labels>) -> bool {
        self.selects_namespace(policy_namespace, &pod.namespace, namespace_labels) && self.selects_in_namespace(pod)
    }

    /// Whether this peer selects pods of `namespace` (labelled `namespace_labels`) at all.
    pub fn selects_namespace(
        &self,
        policy_namespace: &str,
        namespace: &str,
        namespace_labels: Option<&Labels>,
    ) -> bool {
        match &self.namespace_selector {
            Some(selector) => namespace_labels.is_some_and(|labels| selector.matches(labels)),
            None => self.pod_selector.is_some() && namespace == policy_namespace,
        }
    }

    /// Whether this peer selects `pod`, given that it selects the pod's namespace.
    pub fn selects_in_namespace(&self, pod: &Pod) -> bool {
        !pod.host_network && self.pod_selector.as_ref().is_none_or(|s| s.matches(&pod.labels))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(text: &str) -> IpNet {
        text.parse().unwrap()
    }

    fn load_balancer(ips: &[&str], ranges: &[&str]) -> Service {
        let mut s = Service::cluster_ip(
            "shop",
            "web",
            "10.96.0.10",
            vec![
                ServicePort::tcp("http", 80, 8080),
                ServicePort { protocol: Protocol::Udp, ..ServicePort::tcp("dns", 53, 5353) },
            ],
        );
        s.service_type = ServiceType::LoadBalancer;
        s.load_balancer_ips = ips.iter().map(|ip| (*ip).into()).collect();
        s.load_balancer_source_ranges = ranges.iter().map(|r| net(r)).collect();
        s
    }

    #[test]
    fn source_ranges_close_each_load_balancer_port_to_the_ranges_of_its_family() {
        let node_ips: Vec<CompactString> = vec!["192.168.77.1".into()];
        assert!(load_balancer(&["203.0.113.10"], &[]).firewalled_frontends(&node_ips).is_empty(), "no ranges: open");
        assert!(
            load_balancer(&[], &["198.51.100.0/24"]).firewalled_frontends(&node_ips).is_empty(),
            "no load balancer address yet"
        );

        // Host bits dropped, contained and adjacent ranges merged (one interval set: no overlaps).
        let s = load_balancer(
            &["203.0.113.10", "2001:db8::10"],
            &["198.51.100.7/24", "198.51.100.128/25", "198.51.101.0/24", "10.0.0.0/8", "10.1.0.0/16"],
        );
        let frontends = s.firewalled_frontends(&node_ips);
        let v4_allowed = vec![net("10.0.0.0/8"), net("198.51.100.0/23")];
        assert_eq!(
            frontends,
            vec![
                FirewalledFrontend {
                    address: "203.0.113.10".parse().unwrap(),
                    protocol: Protocol::Tcp,
                    port: 80,
                    allowed: v4_allowed.clone()
                },
                FirewalledFrontend {
                    address: "203.0.113.10".parse().unwrap(),
                    protocol: Protocol::Udp,
                    port: 53,
                    allowed: v4_allowed
                },
            ],
            "the IPv6 address has no IPv6 range: it stays open, as in kube-proxy"
        );

        // A range holding the node's own address lets the load balancer addresses in too.
        let s =
            load_balancer(&["203.0.113.10", "203.0.113.11", "2001:db8::10"], &["192.168.0.0/16", "2001:db8:1::/48"]);
        let frontends = s.firewalled_frontends(&node_ips);
        assert_eq!(frontends.len(), 6);
        assert_eq!(frontends[0].allowed, vec![net("192.168.0.0/16"), net("203.0.113.10/31")]);
        assert_eq!(
            frontends[4].allowed,
            vec![net("2001:db8:1::/48")],
            "per family: no IPv6 range holds a node address"
        );
        let dual_stack_node = s.firewalled_frontends(&["192.168.77.1".into(), "2001:db8:1::1".into()]);
        assert_eq!(dual_stack_node[4].allowed, vec![net("2001:db8::10/128"), net("2001:db8:1::/48")]);
        let elsewhere = s.firewalled_frontends(&["10.0.0.1".into()]);
        assert_eq!(elsewhere[0].allowed, vec![net("192.168.0.0/16")], "the node is outside every range");
    }

    #[test]
    fn container_ports_from_before_host_ports_still_load_and_print_as_they_did() {
        let old = r#"{"name":"http","protocol":"TCP","port":8080}"#;
        let port: ContainerPort = serde_json::from_str(old).unwrap();
        assert_eq!((port.host_port, port.host_ip.as_deref()), (None, None));
        assert_eq!(serde_json::to_string(&port).unwrap(), old);
        let exposed = ContainerPort { host_port: Some(18080), host_ip: Some("192.168.77.1".into()), ..port };
        let text = serde_json::to_string(&exposed).unwrap();
        assert_eq!(text, r#"{"name":"http","protocol":"TCP","port":8080,"host_port":18080,"host_ip":"192.168.77.1"}"#);
        assert_eq!(serde_json::from_str::<ContainerPort>(&text).unwrap(), exposed);
    }
}
