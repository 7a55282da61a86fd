//! The synthetic cluster: a deterministic, seeded generator of Kubernetes objects (namespaces,
//! nodes, services with one EndpointSlice each, the pods behind them, optional network
//! policies) and the churn that changes it (rolling endpoint replacements, scale up/down,
//! label changes). Pure: it returns the writes; the caller applies them (to the test API
//! server, or as manifest files). Same seed, same objects, same churn.

use serde_json::{Value, json};

/// The node the host under test runs as.
pub const HOST_NODE: &str = "perf-node-0";
/// Pod addresses: node `i` gets `10.64.0.0/10`'s `i`th /24.
pub const CLUSTER_CIDR: &str = "10.64.0.0/10";
/// The pod CIDR the host's CNI daemon allocates from in the harness: inside the cluster CIDR,
/// past the last node's /24 (16,000 nodes at most), so no synthetic pod has its addresses.
pub const CNI_POD_CIDR: &str = "10.127.255.0/24";
/// Pods per node (kubelet's default limit is 110; 30 is a typical density).
const PODS_PER_NODE: usize = 30;
/// NodePorts available (30000-32767).
const NODE_PORTS: usize = 2768;

/// xorshift64*: small, fast, and enough for picking objects.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub services: usize,
    /// Mean endpoints (pods) per service; fractional means a mix of ⌊m⌋ and ⌈m⌉.
    pub endpoints: f64,
    pub policies: usize,
    pub seed: u64,
    /// Objects with what a real cluster's objects carry besides what the host reads
    /// (`crate::detail`).
    pub full_objects: bool,
}

/// Which API resource a write is for (group, version, plural), and whether namespaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Namespace,
    Node,
    Service,
    EndpointSlice,
    Pod,
    NetworkPolicy,
}

impl Kind {
    pub fn api(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Kind::Namespace => ("", "v1", "namespaces"),
            Kind::Node => ("", "v1", "nodes"),
            Kind::Service => ("", "v1", "services"),
            Kind::Pod => ("", "v1", "pods"),
            Kind::EndpointSlice => ("discovery.k8s.io", "v1", "endpointslices"),
            Kind::NetworkPolicy => ("networking.k8s.io", "v1", "networkpolicies"),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Write {
    /// Create or replace.
    Put(Kind, Value),
    Delete(Kind, String, String),
}

#[derive(Clone, Debug)]
struct PodRef {
    name: String,
    ip: String,
    node: usize,
}

#[derive(Clone, Debug)]
struct SvcState {
    namespace: String,
    name: String,
    endpoints: Vec<PodRef>,
    /// Bumped on every pod label change (the `version` label).
    label_version: u64,
}

/// The generated cluster and the state churn needs (which pods back which service, free
/// addresses per node).
pub struct Cluster {
    pub spec: Spec,
    rng: Rng,
    namespaces: Vec<String>,
    nodes: usize,
    services: Vec<SvcState>,
    /// Free host offsets per node's /24.
    free: Vec<Vec<u8>>,
    pod_seq: u64,
    /// Pods made for CNI ADDs so far (their own count, so that the churn's pod names stay).
    cni_seq: u64,
}

fn ipv4(n: u32) -> String {
    std::net::Ipv4Addr::from(n).to_string()
}

impl Cluster {
    pub fn new(spec: Spec) -> Cluster {
        let mut rng = Rng::new(spec.seed);
        let namespaces: Vec<String> = (0..(spec.services / 100).clamp(1, 500)).map(|i| format!("ns-{i}")).collect();
        let expected_pods = (spec.services as f64 * spec.endpoints).ceil() as usize;
        let nodes = expected_pods.div_ceil(PODS_PER_NODE).clamp(2, 16_000);
        let free = (0..nodes).map(|_| (2..=254u8).rev().collect()).collect();
        let mut cluster = Cluster {
            spec: spec.clone(),
            rng: rng.clone(),
            namespaces,
            nodes,
            services: Vec::new(),
            free,
            pod_seq: 0,
            cni_seq: 0,
        };
        for i in 0..spec.services {
            let namespace = cluster.namespaces[rng.below(cluster.namespaces.len())].clone();
            let whole = spec.endpoints.floor() as usize;
            let count = whole + usize::from(rng.chance(spec.endpoints - whole as f64)).max(usize::from(whole == 0));
            let mut svc = SvcState { namespace, name: format!("svc-{i}"), endpoints: Vec::new(), label_version: 0 };
            for _ in 0..count {
                let pod = cluster.new_pod(&mut rng, &svc.name);
                svc.endpoints.push(pod);
            }
            cluster.services.push(svc);
        }
        cluster.rng = rng;
        cluster
    }

    pub fn services(&self) -> usize {
        self.services.len()
    }

    pub fn pods(&self) -> usize {
        self.services.iter().map(|s| s.endpoints.len()).sum()
    }

    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// (namespace, name) of service `i`.
    pub fn service_key(&self, i: usize) -> (String, String) {
        let s = &self.services[i];
        (s.namespace.clone(), s.name.clone())
    }

    fn new_pod(&mut self, rng: &mut Rng, service: &str) -> PodRef {
        let mut node = rng.below(self.nodes);
        while self.free[node].is_empty() {
            node = (node + 1) % self.nodes;
        }
        let offset = self.free[node].pop().expect("a node with a free address");
        self.pod_seq += 1;
        let ip = ipv4(u32::from(std::net::Ipv4Addr::new(10, 64, 0, 0)) + ((node as u32) << 8) + offset as u32);
        PodRef { name: format!("{service}-{:x}", self.pod_seq), ip, node }
    }

    fn release(&mut self, pod: &PodRef) {
        let offset = pod.ip.rsplit('.').next().and_then(|o| o.parse().ok()).expect("pod addresses are IPv4");
        self.free[pod.node].push(offset);
    }

    fn node_name(i: usize) -> String {
        format!("perf-node-{i}")
    }

    /// `object` as the API server would send it: unless `--minimal-objects`, also what a
    /// real cluster's objects carry that the host does not read.
    fn detailed(&self, kind: Kind, mut object: Value) -> Value {
        if self.spec.full_objects {
            crate::detail::add(kind, &mut object);
        }
        object
    }

    fn namespace_obj(&self, name: &str, i: usize) -> Value {
        self.detailed(Kind::Namespace, json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {"team": format!("team-{}", i % 7)}}}))
    }

    fn node_obj(&self, i: usize) -> Value {
        let cidr = format!("{}/24", ipv4(u32::from(std::net::Ipv4Addr::new(10, 64, 0, 0)) + ((i as u32) << 8)));
        self.detailed(Kind::Node, json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": Self::node_name(i), "labels": {"topology.kubernetes.io/zone": format!("zone-{}", i % 3)}},
            "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
            "status": {"addresses": [{"type": "InternalIP", "address": ipv4(u32::from(std::net::Ipv4Addr::new(172, 16, 0, 1)) + i as u32)}]}
        }))
    }

    fn ports(i: usize) -> Vec<(&'static str, u16, u16)> {
        let mut ports = vec![("http", 80, 8080)];
        if i.is_multiple_of(5) {
            ports.push(("https", 443, 8443));
        }
        ports
    }

    fn service_obj(&self, i: usize) -> Value {
        let s = &self.services[i];
        let ip = ipv4(u32::from(std::net::Ipv4Addr::new(10, 128, 0, 1)) + i as u32);
        let node_port = (i.is_multiple_of(20) && i / 20 < NODE_PORTS).then(|| 30000 + i / 20);
        let ports: Vec<Value> = Self::ports(i)
            .into_iter()
            .enumerate()
            .map(|(n, (name, port, target))| {
                let mut p = json!({"name": name, "protocol": "TCP", "port": port, "targetPort": target});
                if let (Some(np), 0) = (node_port, n) {
                    p["nodePort"] = json!(np);
                }
                p
            })
            .collect();
        let mut spec = json!({"type": if node_port.is_some() { "NodePort" } else { "ClusterIP" }, "clusterIP": ip, "clusterIPs": [ip], "ports": ports, "selector": {"app": s.name}});
        if i % 10 == 3 {
            spec["sessionAffinity"] = json!("ClientIP");
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": 10800}});
        }
        self.detailed(Kind::Service, json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": s.name, "namespace": s.namespace, "labels": {"app": s.name}}, "spec": spec}))
    }

    fn slice_obj(&self, i: usize) -> Value {
        let s = &self.services[i];
        let endpoints: Vec<Value> = s
            .endpoints
            .iter()
            .map(|p| {
                json!({
                    "addresses": [p.ip], "nodeName": Self::node_name(p.node), "zone": format!("zone-{}", p.node % 3),
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "targetRef": {"kind": "Pod", "namespace": s.namespace, "name": p.name}
                })
            })
            .collect();
        let ports: Vec<Value> = Self::ports(i)
            .into_iter()
            .map(|(name, _, target)| json!({"name": name, "protocol": "TCP", "port": target}))
            .collect();
        self.detailed(Kind::EndpointSlice, json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{}-slice", s.name), "namespace": s.namespace, "labels": {"kubernetes.io/service-name": s.name}},
            "addressType": "IPv4", "endpoints": endpoints, "ports": ports
        }))
    }

    fn pod_obj(&self, i: usize, pod: &PodRef) -> Value {
        let s = &self.services[i];
        let ports: Vec<Value> = Self::ports(i)
            .into_iter()
            .map(|(name, _, target)| json!({"name": name, "containerPort": target}))
            .collect();
        self.detailed(Kind::Pod, json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": s.namespace, "labels": {"app": s.name, "version": format!("v{}", s.label_version)}},
            "spec": {"nodeName": Self::node_name(pod.node), "containers": [{"name": "main", "image": "registry.example/app:1", "ports": ports}]},
            "status": {"phase": "Running", "podIP": pod.ip, "podIPs": [{"ip": pod.ip}]}
        }))
    }

    fn policy_obj(&self, j: usize) -> Value {
        let n = self.services.len().max(1);
        let target = &self.services[j % n];
        let peer = &self.services[(j * 7 + 1) % n];
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": format!("allow-{j}"), "namespace": target.namespace, "generation": 1},
            "spec": {
                "podSelector": {"matchLabels": {"app": target.name}}, "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": peer.name}}}], "ports": [{"protocol": "TCP", "port": 8080}]}]
            }
        })
    }

    /// Every object of the initial cluster, in an order an API server accepts.
    pub fn objects(&self) -> Vec<(Kind, Value)> {
        let mut out = Vec::new();
        out.extend(self.namespaces.iter().enumerate().map(|(i, n)| (Kind::Namespace, self.namespace_obj(n, i))));
        out.extend((0..self.nodes).map(|i| (Kind::Node, self.node_obj(i))));
        for i in 0..self.services.len() {
            out.push((Kind::Service, self.service_obj(i)));
            for pod in &self.services[i].endpoints {
                out.push((Kind::Pod, self.pod_obj(i, pod)));
            }
            out.push((Kind::EndpointSlice, self.slice_obj(i)));
        }
        out.extend((0..self.spec.policies).map(|j| (Kind::NetworkPolicy, self.policy_obj(j))));
        out
    }

    /// A random service index.
    pub fn pick(&mut self) -> usize {
        self.rng.below(self.services.len())
    }

    /// Starts replacing one endpoint of service `i` (a rolling update step): the new pod.
    /// Returns the writes and the new pod's address.
    pub fn replace_start(&mut self, i: usize) -> (Vec<Write>, String) {
        let mut rng = self.rng.clone();
        let name = self.services[i].name.clone();
        let pod = self.new_pod(&mut rng, &name);
        self.rng = rng;
        let ip = pod.ip.clone();
        let write = Write::Put(Kind::Pod, self.pod_obj(i, &pod));
        self.services[i].endpoints.push(pod);
        (vec![write], ip)
    }

    /// The EndpointSlice change: the new pod in, the oldest out (one object written).
    pub fn replace_slice(&mut self, i: usize) -> (Vec<Write>, PodGone) {
        let old = self.services[i].endpoints.remove(0);
        (vec![Write::Put(Kind::EndpointSlice, self.slice_obj(i))], PodGone(i, old.name.clone(), old))
    }

    /// The old pod deleted.
    pub fn replace_finish(&mut self, gone: PodGone) -> Vec<Write> {
        let PodGone(i, name, pod) = gone;
        self.release(&pod);
        vec![Write::Delete(Kind::Pod, self.services[i].namespace.clone(), name)]
    }

    /// A pod scheduled on this host's node that has no address yet, as the kubelet's CNI ADD
    /// finds it: labelled as service `i`'s pods are, `i` one a policy selects when there are
    /// policies. Returns the write, its namespace and name; [`Cluster::cni_pod_gone`] deletes it.
    pub fn cni_pod(&mut self) -> (Write, String, String) {
        self.cni_seq += 1;
        // A generator of its own: the churn after it stays the same as in a run without CNI.
        let mut rng = Rng::new(self.spec.seed ^ self.cni_seq.rotate_left(32));
        let with_policy = self.spec.policies.min(self.services.len());
        let i = rng.below(if with_policy > 0 { with_policy } else { self.services.len() });
        let s = &self.services[i];
        let name = format!("cni-{}-{:x}", s.name, self.cni_seq);
        let pod = self.detailed(Kind::Pod, json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": s.namespace, "labels": {"app": s.name, "version": format!("v{}", s.label_version)}},
            "spec": {"nodeName": HOST_NODE, "containers": [{"name": "main", "image": "registry.example/app:1"}]},
            "status": {"phase": "Pending"}
        }));
        (Write::Put(Kind::Pod, pod), s.namespace.clone(), name)
    }

    /// The [`Cluster::cni_pod`] pod deleted.
    pub fn cni_pod_gone(namespace: &str, name: &str) -> Write {
        Write::Delete(Kind::Pod, namespace.into(), name.into())
    }

    /// One churn operation, picked at random: a rolling endpoint replacement (pod created,
    /// slice updated, old pod deleted) 40%; scale up (pod, slice) 20%; scale down (slice,
    /// pod) 20%; a pod label change no service or policy cares about 20%.
    pub fn churn_op(&mut self) -> Vec<Write> {
        let i = self.pick();
        let roll = self.rng.below(10);
        match roll {
            0..=3 => {
                let (mut w, _) = self.replace_start(i);
                let (w2, gone) = self.replace_slice(i);
                w.extend(w2);
                w.extend(self.replace_finish(gone));
                w
            }
            4 | 5 => {
                let (mut w, _) = self.replace_start(i);
                w.push(Write::Put(Kind::EndpointSlice, self.slice_obj(i)));
                w
            }
            6 | 7 if self.services[i].endpoints.len() > 1 => {
                let (mut w, gone) = self.replace_slice(i);
                w.extend(self.replace_finish(gone));
                w
            }
            _ => self.label_change(i),
        }
    }

    /// A label change on one pod of service `i` that no service or policy selects on (the
    /// pod's `version` label): an event that should change nothing.
    pub fn label_change(&mut self, i: usize) -> Vec<Write> {
        self.services[i].label_version += 1;
        let k = self.rng.below(self.services[i].endpoints.len());
        let pod = self.services[i].endpoints[k].clone();
        vec![Write::Put(Kind::Pod, self.pod_obj(i, &pod))]
    }
}

/// An endpoint taken out of a slice whose pod is still to be deleted.
pub struct PodGone(usize, String, PodRef);

/// The whole cluster as manifest files (JSON documents, which are YAML), for the embedded
/// mode: `wasmplane run --manifests DIR`.
pub fn write_manifests(cluster: &Cluster, dir: &std::path::Path) -> std::io::Result<usize> {
    std::fs::create_dir_all(dir)?;
    let objects = cluster.objects();
    for (n, chunk) in objects.chunks(1000).enumerate() {
        let docs: Vec<String> = chunk.iter().map(|(_, v)| v.to_string()).collect();
        std::fs::write(dir.join(format!("cluster-{n:04}.yaml")), docs.join("\n---\n") + "\n")?;
    }
    Ok(objects.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64) -> Spec {
        Spec { services: 300, endpoints: 1.5, policies: 5, seed, full_objects: false }
    }

    fn run(seed: u64) -> (Vec<(Kind, Value)>, Vec<Write>) {
        let mut c = Cluster::new(spec(seed));
        let objects = c.objects();
        let churn: Vec<Write> = (0..200).flat_map(|_| c.churn_op()).collect();
        (objects, churn)
    }

    #[test]
    fn same_seed_same_cluster_and_churn() {
        let (a, b) = (run(7), run(7));
        assert_eq!(a, b);
        let other = run(8);
        assert_ne!(a.0, other.0, "another seed gives another cluster");
        assert_ne!(a.1, other.1);
    }

    /// A CNI pod is on the host's node without an address, labelled as the pods of a service
    /// a policy targets; making them leaves the churn that follows as it was.
    #[test]
    fn cni_pods_are_unaddressed_local_policy_targets_and_leave_the_churn_alone() {
        let (mut plain, mut with_cni) = (Cluster::new(spec(3)), Cluster::new(spec(3)));
        let mut names = std::collections::BTreeSet::new();
        for _ in 0..20 {
            let (write, ns, name) = with_cni.cni_pod();
            let Write::Put(Kind::Pod, pod) = write else { panic!("not a pod: {write:?}") };
            assert_eq!(pod["spec"]["nodeName"], HOST_NODE);
            assert!(pod["status"]["podIP"].is_null(), "{pod}");
            let app = pod["metadata"]["labels"]["app"].as_str().unwrap();
            let i: usize = app.strip_prefix("svc-").and_then(|i| i.parse().ok()).unwrap();
            assert!(i < 5, "a service one of the 5 policies targets: {app}");
            assert_eq!(
                (pod["metadata"]["namespace"].as_str(), pod["metadata"]["name"].as_str()),
                (Some(ns.as_str()), Some(name.as_str()))
            );
            assert_eq!(ns, with_cni.services[i].namespace);
            assert!(names.insert(name.clone()), "{name} twice");
            assert_eq!(Cluster::cni_pod_gone(&ns, &name), Write::Delete(Kind::Pod, ns, name));
        }
        let churn = |c: &mut Cluster| (0..100).flat_map(|_| c.churn_op()).collect::<Vec<_>>();
        assert_eq!(churn(&mut plain), churn(&mut with_cni));
    }

    #[test]
    fn shape() {
        let c = Cluster::new(spec(1));
        let objects = c.objects();
        let count = |k: Kind| objects.iter().filter(|(kind, _)| *kind == k).count();
        assert_eq!(count(Kind::Service), 300);
        assert_eq!(count(Kind::EndpointSlice), 300);
        assert_eq!(count(Kind::Pod), c.pods());
        assert!((400..=500).contains(&c.pods()), "1.5 endpoints per service on average: {}", c.pods());
        assert_eq!(count(Kind::NetworkPolicy), 5);
        // Pod addresses are unique and inside the cluster CIDR's /24 of their node.
        let ips: std::collections::BTreeSet<_> = objects
            .iter()
            .filter(|(k, _)| *k == Kind::Pod)
            .map(|(_, v)| v["status"]["podIP"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ips.len(), c.pods());
        assert!(ips.iter().all(|ip| ip.starts_with("10.64.")));
    }
}
