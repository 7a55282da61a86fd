//! The cluster the host sees: services and EndpointSlices written as manifest files, and the
//! host itself started over a manifest dir with its nft pointed into the node namespace.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use wasmplane::app::{DataplaneMode, HostConfig, RunningHost, start};

pub const NODE: &str = "node-a";
pub const OTHER_NODE: &str = "node-b";
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";

#[derive(Clone, Debug)]
pub struct Port {
    pub name: &'static str,
    pub protocol: &'static str,
    pub port: u16,
    /// `targetPort` as written in the Service: a number or a container port name.
    pub target: String,
    /// The port the endpoints serve on (what the EndpointSlice says).
    pub endpoint_port: u16,
    pub node_port: Option<u16>,
}

impl Port {
    pub fn new(name: &'static str, protocol: &'static str, port: u16, endpoint_port: u16) -> Port {
        Port { name, protocol, port, target: endpoint_port.to_string(), endpoint_port, node_port: None }
    }
    pub fn node_port(mut self, node_port: u16) -> Port {
        self.node_port = Some(node_port);
        self
    }
    pub fn named_target(mut self, name: &str) -> Port {
        self.target = name.to_string();
        self
    }
}

#[derive(Clone, Debug)]
pub struct Endpoint {
    pub ip: String,
    pub node: &'static str,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

pub fn ready(ip: &str, node: &'static str) -> Endpoint {
    Endpoint { ip: ip.into(), node, ready: true, serving: true, terminating: false }
}

#[derive(Clone, Debug)]
pub struct Svc {
    pub name: &'static str,
    pub cluster_ip: &'static str,
    pub service_type: &'static str,
    pub ports: Vec<Port>,
    pub affinity_seconds: Option<u32>,
    pub external_local: bool,
    pub internal_local: bool,
    pub load_balancer_ip: Option<&'static str>,
    pub health_check_node_port: Option<u16>,
    /// `spec.loadBalancerSourceRanges`.
    pub source_ranges: Vec<&'static str>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<&'static str>,
    pub endpoints: Vec<Endpoint>,
    /// `metadata.creationTimestamp` (RFC 3339), as an API server would give it.
    pub created: Option<&'static str>,
}

impl Svc {
    pub fn new(name: &'static str, cluster_ip: &'static str, ports: Vec<Port>, endpoints: Vec<Endpoint>) -> Svc {
        Svc {
            name,
            cluster_ip,
            service_type: "ClusterIP",
            ports,
            affinity_seconds: None,
            external_local: false,
            internal_local: false,
            load_balancer_ip: None,
            health_check_node_port: None,
            source_ranges: vec![],
            external_ips: vec![],
            created: None,
            endpoints,
        }
    }

    pub fn yaml(&self) -> String {
        let ports: Vec<String> = self
            .ports
            .iter()
            .map(|p| {
                let target =
                    if p.target.parse::<u16>().is_ok() { p.target.clone() } else { format!("\"{}\"", p.target) };
                let node_port = p.node_port.map(|n| format!(", nodePort: {n}")).unwrap_or_default();
                format!(
                    "    - {{ name: {}, protocol: {}, port: {}, targetPort: {target}{node_port} }}",
                    p.name, p.protocol, p.port
                )
            })
            .collect();
        let mut spec =
            format!("  type: {}\n  clusterIP: {ip}\n  clusterIPs: [{ip}]\n", self.service_type, ip = self.cluster_ip);
        if let Some(t) = self.affinity_seconds {
            spec += &format!(
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{ clientIP: {{ timeoutSeconds: {t} }} }}\n"
            );
        }
        if self.external_local {
            spec += "  externalTrafficPolicy: Local\n";
        }
        if self.internal_local {
            spec += "  internalTrafficPolicy: Local\n";
        }
        if let Some(port) = self.health_check_node_port {
            spec += &format!("  healthCheckNodePort: {port}\n");
        }
        if !self.external_ips.is_empty() {
            spec += &format!("  externalIPs: [{}]\n", self.external_ips.join(", "));
        }
        if !self.source_ranges.is_empty() {
            spec += &format!("  loadBalancerSourceRanges: [{}]\n", self.source_ranges.join(", "));
        }
        let mut status = String::new();
        if let Some(ip) = self.load_balancer_ip {
            status = format!("status:\n  loadBalancer: {{ ingress: [{{ ip: {ip} }}] }}\n");
        }
        let slice_ports: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("  - {{ name: {}, protocol: {}, port: {} }}", p.name, p.protocol, p.endpoint_port))
            .collect();
        let endpoints: Vec<String> = self
            .endpoints
            .iter()
            .map(|e| {
                format!(
                    "  - {{ addresses: [{}], conditions: {{ ready: {}, serving: {}, terminating: {} }}, nodeName: {} }}",
                    e.ip, e.ready, e.serving, e.terminating, e.node
                )
            })
            .collect();
        let endpoints = if endpoints.is_empty() {
            "endpoints: []".to_string()
        } else {
            format!("endpoints:\n{}", endpoints.join("\n"))
        };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{ name: {name}, namespace: default{created} }}\nspec:\n{spec}  ports:\n{ports}\n{status}---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-abcde\n  namespace: default\n  labels: {{ kubernetes.io/service-name: {name} }}\n\
             addressType: {family}\nports:\n{slice_ports}\n{endpoints}\n",
            name = self.name,
            created = self.created.map(|t| format!(", creationTimestamp: \"{t}\"")).unwrap_or_default(),
            family = if self.cluster_ip.contains(':') { "IPv6" } else { "IPv4" },
            ports = ports.join("\n"),
            slice_ports = slice_ports.join("\n"),
        )
    }
}

/// The two nodes: node-a (192.168.77.1, pods 10.244.0.0/24), node-b (192.168.77.3, pods
/// 10.244.1.0/24).
pub const NODES_YAML: &str = "\
apiVersion: v1
kind: Node
metadata: { name: node-a }
spec: { podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24] }
status: { addresses: [{ type: InternalIP, address: 192.168.77.1 }] }
---
apiVersion: v1
kind: Node
metadata: { name: node-b }
spec: { podCIDR: 10.244.1.0/24, podCIDRs: [10.244.1.0/24] }
status: { addresses: [{ type: InternalIP, address: 192.168.77.3 }] }
";

const DEFAULT_NAMESPACE_YAML: &str = "\
apiVersion: v1
kind: Namespace
metadata: { name: default }
";

/// A manifest directory plus the host's data dir, in one temporary directory.
pub struct Cluster {
    dir: tempfile::TempDir,
}

impl Cluster {
    pub fn new() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("manifests")).unwrap();
        let c = Cluster { dir };
        c.write_file("cluster.yaml", &format!("{NODES_YAML}---\n{DEFAULT_NAMESPACE_YAML}"));
        c
    }

    pub fn manifests(&self) -> PathBuf {
        self.dir.path().join("manifests")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Replaces a file atomically (written beside, renamed in), so a poll never sees half.
    fn write_file(&self, name: &str, text: &str) {
        let tmp = self.dir.path().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.manifests().join(name)).unwrap();
    }

    /// Creates or replaces any manifest file (pods, policies).
    pub fn put_file(&self, name: &str, text: &str) {
        self.write_file(name, text);
    }

    /// Removes a manifest file written with [`Cluster::put_file`].
    pub fn remove_file(&self, name: &str) {
        std::fs::remove_file(self.manifests().join(name)).unwrap();
    }

    /// Creates or replaces one service (and its EndpointSlice).
    pub fn put(&self, svc: &Svc) {
        self.write_file(&format!("svc-{}.yaml", svc.name), &svc.yaml());
    }

    pub fn remove(&self, name: &str) {
        std::fs::remove_file(self.manifests().join(format!("svc-{name}.yaml"))).unwrap();
    }

    pub fn config(&self, nft_command: Vec<String>) -> HostConfig {
        HostConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            manifests: Some(self.manifests()),
            data_dir: Some(self.data_dir()),
            node_name: NODE.into(),
            cluster_cidrs: vec![CLUSTER_CIDR.into()],
            dataplane: DataplaneMode::Nftables,
            token: Some("traffic-test-token-0123456789".into()),
            manifest_poll: Duration::from_millis(40),
            nft_command,
            // One service to a shard: every traffic test crosses several shard tables.
            nft_services_per_shard: 1,
            ..Default::default()
        }
    }
}

pub async fn start_host(config: HostConfig) -> RunningHost {
    start(config).await.expect("starting the host")
}

/// The host's applied dataplane (what it has written to the kernel), rendered.
pub fn applied(host: &RunningHost) -> String {
    host.controller.lock().unwrap_or_else(|p| p.into_inner()).dataplane().render()
}

/// Polls `cond` until it holds (panics with `what` and the last value after `timeout`).
#[track_caller]
pub fn wait_for<T: std::fmt::Debug>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> T,
    cond: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        let value = probe();
        if cond(&value) {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}; last: {value:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the host has written rules in which `cond` holds.
#[track_caller]
pub fn wait_applied(host: &RunningHost, what: &str, cond: impl Fn(&str) -> bool) -> String {
    wait_for(what, Duration::from_secs(10), || applied(host), |t| cond(t))
}

/// Polls an async probe until `cond` holds (panics with `what` and the last value after `timeout`).
pub async fn eventually<T: std::fmt::Debug, F: std::future::Future<Output = T>>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> F,
    cond: impl Fn(&T) -> bool,
) -> T {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let value = probe().await;
        if cond(&value) {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: last seen {value:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
