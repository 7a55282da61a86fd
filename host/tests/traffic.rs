//! The service dataplane proven with real traffic: the host runs over a manifest dir with its
//! nft pointed into a "node" network namespace; pods, a client and an "external" machine are
//! namespaces on veths; real TCP/UDP servers in the pods say who answered and which source
//! address they saw. Every test builds its own topology (unique names, removed on drop, even
//! on panic) so tests run in parallel.
//!
//! Needs root (namespaces, nftables); skips LOUDLY otherwise.

mod support;

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::cluster::*;
use support::echo::*;
use support::netns::*;
use support::set_holds;
use wasmplane::app::{HostConfig, RunningHost};
use wasmplane::nft::NodePortAddresses;

/// `frontend` (`address . protocol . port`) is in a service map: load balanced as data (a
/// goto to a shard's by-count chain) or by a chain of the service's own.
fn serves(t: &str, frontend: &str) -> bool {
    t.contains(&format!("{frontend} : goto "))
}

/// Some frontend DNATs to `backend` on port 8080 (as data, or in a service's chain).
fn targets(t: &str, backend: &str) -> bool {
    // An endpoint map's element (`… : backend . 8080`, then ` }` or `, ` in a grouped
    // statement) or a DNAT rule.
    [" ", ","].iter().any(|after| t.contains(&format!(": {backend} . 8080{after}")))
        || t.contains(&format!("dnat ip to {backend}:8080"))
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// Who answered, how often; every attempt must have succeeded.
#[track_caller]
fn tally(what: &str, replies: &[std::io::Result<Reply>]) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for r in replies {
        match r {
            Ok(r) => *seen.entry(r.identity.clone()).or_insert(0) += 1,
            Err(e) => panic!("{what}: a request failed: {e} (all: {replies:?})"),
        }
    }
    seen
}

#[track_caller]
fn assert_backends(what: &str, replies: &[std::io::Result<Reply>], expected: &[&str]) {
    let seen = tally(what, replies);
    let names: Vec<&str> = seen.keys().map(String::as_str).collect();
    assert_eq!(names, expected, "{what}: backends that answered (counts {seen:?})");
}

#[track_caller]
fn assert_all(what: &str, replies: &[std::io::Result<Reply>], check: impl Fn(&Reply) -> bool) {
    for r in replies {
        let r = r.as_ref().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(check(r), "{what}: unexpected reply {r:?}");
    }
}

/// A connection attempt that must fail fast with "refused" (TCP RST or ICMP unreachable).
/// A datagram the node itself sends is rejected in its output path: the kernel then fails
/// the `send` itself with EPERM, which is as fast and as final.
#[track_caller]
/// "Fast" is the error's kind: a drop would end in a timeout (TimedOut/WouldBlock), never in
/// "refused"; no bound on the elapsed time, which a loaded machine can stretch.
fn assert_refused_fast(what: &str, result: std::io::Result<Reply>, started: Instant, local_sender: bool) {
    match result {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
        Err(e) if local_sender && e.kind() == ErrorKind::PermissionDenied => {}
        other => panic!("{what}: expected connection refused, got {other:?} after {:?}", started.elapsed()),
    }
}

const POD_A: &str = "10.244.0.11";
const POD_B: &str = "10.244.0.12";
const POD_C: &str = "10.244.0.13";
const POD_D: &str = "10.244.0.14";
const REMOTE_POD: &str = "10.244.1.21";
const CLIENT: &str = "10.244.0.100";
const CLIENT2: &str = "10.244.0.101";

// Enough fresh flows that missing one of 3 uniformly picked backends is ~1e-10.
const MANY: usize = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_ip_reaches_every_ready_backend_over_tcp_and_udp() {
    require_root!();
    let mut topo = Topology::new("cip");
    let pods: Vec<(String, &str)> = [(POD_A, "a"), (POD_B, "b"), (REMOTE_POD, "remote"), (POD_D, "unready")]
        .iter()
        .map(|(ip, id)| (topo.add_pod(ip), *id))
        .collect();
    let client = topo.add_pod(CLIENT);
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080, 9090])).collect();

    let cluster = Cluster::new();
    let web = Svc::new(
        "web",
        "10.96.0.10",
        vec![
            Port::new("http", "TCP", 80, 8080),
            Port::new("dns", "UDP", 53, 8080),
            // A named target port: the slice resolves it to 9090.
            Port::new("alt", "TCP", 81, 9090).named_target("alt-port"),
        ],
        vec![
            ready(POD_A, NODE),
            ready(POD_B, NODE),
            ready(REMOTE_POD, OTHER_NODE),
            Endpoint { ip: POD_D.into(), node: NODE, ready: false, serving: false, terminating: false },
        ],
    );
    cluster.put(&web);
    // Only terminating endpoints: the serving ones are used (connections drain), the
    // non-serving one never.
    let draining = Svc::new(
        "draining",
        "10.96.0.11",
        vec![Port::new("http", "TCP", 80, 8080)],
        vec![
            Endpoint { ip: POD_A.into(), node: NODE, ready: false, serving: true, terminating: true },
            Endpoint { ip: POD_B.into(), node: NODE, ready: false, serving: true, terminating: true },
            Endpoint { ip: POD_D.into(), node: NODE, ready: false, serving: false, terminating: true },
        ],
    );
    cluster.put(&draining);
    // internalTrafficPolicy Local: this node's endpoints only; with none here, drop.
    let mut node_local = Svc::new(
        "node-local",
        "10.96.0.12",
        vec![Port::new("http", "TCP", 80, 8080)],
        vec![ready(POD_A, NODE), ready(REMOTE_POD, OTHER_NODE)],
    );
    node_local.internal_local = true;
    cluster.put(&node_local);
    let mut elsewhere = Svc::new(
        "elsewhere",
        "10.96.0.13",
        vec![Port::new("http", "TCP", 80, 8080)],
        vec![ready(REMOTE_POD, OTHER_NODE)],
    );
    elsewhere.internal_local = true;
    cluster.put(&elsewhere);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "all services", |t| {
        serves(t, "10.96.0.10 . tcp . 80")
            && serves(t, "10.96.0.11 . tcp . 80")
            && t.contains("10.96.0.13 . tcp . 80 : drop")
    });
    // One service to a shard (the test config): the traffic below crosses several shard
    // tables, each with its own NAT chains, and the main table's checks.
    let table = topo.table();
    let shards = table
        .split("\ntable ")
        .filter(|t| t.starts_with("inet wasmplane-s") && t.contains(" : goto pick-by-count"))
        .count();
    assert!(shards > 1, "services in {shards} shard table(s):\n{table}");

    let replies = tcp_many(&client, addr("10.96.0.10", 80), MANY);
    assert_backends("TCP to the cluster IP", &replies, &["a", "b", "remote"]);
    assert_all("TCP to the cluster IP", &replies, |r| r.port == 8080 && r.peer == ip(CLIENT));

    let replies = udp_many(&client, addr("10.96.0.10", 53), MANY);
    assert_backends("UDP to the cluster IP", &replies, &["a", "b", "remote"]);
    assert_all("UDP to the cluster IP", &replies, |r| r.port == 8080 && r.peer == ip(CLIENT));

    let replies = tcp_many(&client, addr("10.96.0.10", 81), MANY);
    assert_backends("TCP to the named target port", &replies, &["a", "b", "remote"]);
    assert_all("TCP to the named target port", &replies, |r| r.port == 9090);

    // From the node itself (host network): off-cluster source, so masqueraded.
    let replies = tcp_many(&topo.node.name, addr("10.96.0.10", 80), MANY);
    assert_backends("TCP from the node", &replies, &["a", "b", "remote"]);
    assert_all("TCP from the node", &replies, |r| r.peer == ip(POD_GATEWAY));

    let replies = tcp_many(&client, addr("10.96.0.11", 80), MANY);
    assert_backends("TCP to a service with only terminating endpoints", &replies, &["a", "b"]);

    let replies = tcp_many(&client, addr("10.96.0.12", 80), 20);
    assert_backends("internalTrafficPolicy Local", &replies, &["a"]);
    let result = in_ns(&client, || tcp_ask(addr("10.96.0.13", 80), Duration::from_millis(300)));
    assert!(
        matches!(&result, Err(e) if e.kind() == ErrorKind::TimedOut),
        "internalTrafficPolicy Local, no local endpoint: {result:?}"
    );
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_port_load_balancer_ip_and_external_traffic_policy_local() {
    require_root!();
    let mut topo = Topology::new("np");
    let pods: Vec<(String, &str)> =
        [(POD_A, "a"), (POD_B, "b"), (REMOTE_POD, "remote")].iter().map(|(ip, id)| (topo.add_pod(ip), *id)).collect();
    let client = topo.add_pod(CLIENT);
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080])).collect();
    topo.external.exec(&["ip", "route", "add", &format!("{LOAD_BALANCER_IP}/32"), "via", NODE_EXTERNAL_IP]);

    let cluster = Cluster::new();
    let endpoints = vec![ready(POD_A, NODE), ready(POD_B, NODE), ready(REMOTE_POD, OTHER_NODE)];
    let mut open = Svc::new(
        "open",
        "10.96.0.20",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30080), Port::new("dns", "UDP", 80, 8080).node_port(30080)],
        endpoints.clone(),
    );
    open.service_type = "LoadBalancer";
    open.load_balancer_ip = Some(LOAD_BALANCER_IP);
    cluster.put(&open);
    let mut local = Svc::new(
        "local",
        "10.96.0.21",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30081), Port::new("dns", "UDP", 80, 8080).node_port(30081)],
        endpoints,
    );
    local.service_type = "NodePort";
    local.external_local = true;
    cluster.put(&local);
    let mut elsewhere = Svc::new(
        "elsewhere",
        "10.96.0.22",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30082)],
        vec![ready(REMOTE_POD, OTHER_NODE)],
    );
    elsewhere.service_type = "NodePort";
    elsewhere.external_local = true;
    cluster.put(&elsewhere);

    let host = start_host(cluster.config(topo.nft_command())).await;
    let applied = wait_applied(&host, "three services", |t| {
        t.contains("tcp . 30080 : goto nodeport-dispatch")
            && t.contains("svc/default/local/tcp/http/local")
            && t.contains("tcp . 30082 : drop")
    });
    // Policy Cluster is load balanced as data, the node port too: no chain of its own.
    assert!(
        !applied.lines().any(|l| l.contains(" chain ") && l.contains("svc/default/open")),
        "open has a chain:\n{applied}"
    );
    let ext = topo.external.name.clone();

    // Cluster policy: every endpoint, source masqueraded (replies must come back via us).
    let replies = tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30080), MANY);
    assert_backends("TCP NodePort, policy Cluster", &replies, &["a", "b", "remote"]);
    assert_all("TCP NodePort, policy Cluster", &replies, |r| r.peer == ip(POD_GATEWAY));
    let replies = udp_many(&ext, addr(NODE_EXTERNAL_IP, 30080), MANY);
    assert_backends("UDP NodePort, policy Cluster", &replies, &["a", "b", "remote"]);
    assert_all("UDP NodePort, policy Cluster", &replies, |r| r.peer == ip(POD_GATEWAY));
    let replies = tcp_many(&ext, addr(LOAD_BALANCER_IP, 80), MANY);
    assert_backends("TCP to the load balancer IP", &replies, &["a", "b", "remote"]);
    assert_all("TCP to the load balancer IP", &replies, |r| r.peer == ip(POD_GATEWAY));

    // Local policy: node-local endpoints only, and the client's own address arrives.
    let replies = tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30081), MANY);
    assert_backends("TCP NodePort, policy Local", &replies, &["a", "b"]);
    assert_all("TCP NodePort, policy Local", &replies, |r| r.peer == ip(EXTERNAL_CLIENT_IP));
    let replies = udp_many(&ext, addr(NODE_EXTERNAL_IP, 30081), MANY);
    assert_backends("UDP NodePort, policy Local", &replies, &["a", "b"]);
    assert_all("UDP NodePort, policy Local", &replies, |r| r.peer == ip(EXTERNAL_CLIENT_IP));
    // The policy is about external traffic: the cluster IP still uses every endpoint, and a
    // pod using the node port is short-circuited to the cluster chain (kube-proxy does the same).
    let replies = tcp_many(&client, addr("10.96.0.21", 80), MANY);
    assert_backends("cluster IP of a policy-Local service", &replies, &["a", "b", "remote"]);
    let replies = tcp_many(&client, addr(NODE_EXTERNAL_IP, 30081), MANY);
    assert_backends("a pod using the node port of a policy-Local service", &replies, &["a", "b", "remote"]);
    assert_all("a pod using the node port of a policy-Local service", &replies, |r| r.peer == ip(CLIENT));

    // Local policy without a local endpoint: dropped here (a load balancer would health-check
    // this node out), never sent to another node's endpoint.
    let result = topo.external.run(|| tcp_ask(addr(NODE_EXTERNAL_IP, 30082), Duration::from_millis(300)));
    assert!(
        matches!(&result, Err(e) if e.kind() == ErrorKind::TimedOut),
        "policy Local without local endpoints must drop: {result:?}"
    );
    host.stop().await;
}

/// `spec.externalIPs`: an external IP and a service port, reached from outside (routed to this
/// node) or from a pod, are load balanced like the cluster IP and masqueraded;
/// other ports of the address are not served (the address is not the node's); with `externalTrafficPolicy: Local` only this
/// node's endpoints answer and see the client's own address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_ips_are_served_like_the_cluster_ip() {
    require_root!();
    const SHARED_IP: &str = "198.51.100.60";
    const LOCAL_IP: &str = "198.51.100.61";
    let mut topo = Topology::new("xip");
    let pods: Vec<(String, &str)> =
        [(POD_A, "a"), (POD_B, "b"), (REMOTE_POD, "remote")].iter().map(|(ip, id)| (topo.add_pod(ip), *id)).collect();
    let client = topo.add_pod(CLIENT);
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080, 8081])).collect();
    for external_ip in [SHARED_IP, LOCAL_IP] {
        topo.external.exec(&["ip", "route", "add", &format!("{external_ip}/32"), "via", NODE_EXTERNAL_IP]);
    }

    let cluster = Cluster::new();
    let endpoints = vec![ready(POD_A, NODE), ready(POD_B, NODE), ready(REMOTE_POD, OTHER_NODE)];
    let mut shared = Svc::new(
        "shared",
        "10.96.0.60",
        vec![Port::new("http", "TCP", 80, 8080), Port::new("dns", "UDP", 80, 8080)],
        endpoints.clone(),
    );
    shared.external_ips = vec![SHARED_IP];
    cluster.put(&shared);
    let mut local =
        Svc::new("local", "10.96.0.61", vec![Port::new("http", "TCP", 80, 8080).node_port(30061)], endpoints);
    local.service_type = "NodePort";
    local.external_local = true;
    local.external_ips = vec![LOCAL_IP];
    cluster.put(&local);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "both services", |t| {
        t.contains(&format!("{SHARED_IP} . udp . 80")) && t.contains(&format!("{LOCAL_IP} . tcp . 80"))
    });
    let ext = topo.external.name.clone();

    let replies = tcp_many(&ext, addr(SHARED_IP, 80), MANY);
    assert_backends("TCP to the external IP from outside", &replies, &["a", "b", "remote"]);
    assert_all("TCP to the external IP from outside", &replies, |r| r.peer == ip(POD_GATEWAY));
    assert_backends(
        "UDP to the external IP from outside",
        &udp_many(&ext, addr(SHARED_IP, 80), MANY),
        &["a", "b", "remote"],
    );
    let replies = tcp_many(&client, addr(SHARED_IP, 80), MANY);
    assert_backends("TCP to the external IP from a pod", &replies, &["a", "b", "remote"]);
    // Policy Cluster masquerades all traffic to external destinations, a pod's too (kube-proxy).
    assert_all("TCP to the external IP from a pod", &replies, |r| r.peer == ip(POD_GATEWAY));
    // Only the service's ports: the address is not this node's, so nothing else answers.
    let other_port = in_ns(&ext, || tcp_ask(addr(SHARED_IP, 8081), Duration::from_millis(300)));
    assert!(other_port.is_err(), "a port the service does not have must not reach a pod: {other_port:?}");

    let replies = tcp_many(&ext, addr(LOCAL_IP, 80), MANY);
    assert_backends("policy Local from outside", &replies, &["a", "b"]);
    assert_all("policy Local from outside", &replies, |r| r.peer == ip(EXTERNAL_CLIENT_IP));

    // Removed from the service: no longer served.
    shared.external_ips = vec![];
    cluster.put(&shared);
    wait_applied(&host, "the external IP gone", |t| !t.contains(SHARED_IP));
    let removed = in_ns(&ext, || tcp_ask(addr(SHARED_IP, 80), Duration::from_millis(300)));
    assert!(removed.is_err(), "a removed external IP must not be served: {removed:?}");
    host.stop().await;
}

/// `--service-cidr`: a new connection to an address of a service CIDR that is no service's
/// is dropped on the node (kube-proxy's "unallocated ClusterIPs"), where the node's routes
/// would otherwise take it elsewhere; once a service has the address, it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unallocated_service_addresses_do_not_leave_the_node() {
    require_root!();
    const UNALLOCATED: &str = "10.96.0.99";
    let mut topo = Topology::new("cidr");
    let pod = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let _server = Server::start(&pod, "a", &[8080]);
    // Something beyond the node answers for the address, as a default route may lead to.
    topo.external.exec(&["ip", "addr", "add", &format!("{UNALLOCATED}/32"), "dev", "eth0"]);
    topo.node.exec(&["ip", "route", "add", &format!("{UNALLOCATED}/32"), "via", EXTERNAL_CLIENT_IP]);
    let _outside = Server::start(&topo.external.name, "outside", &[80]);
    assert_backends(
        "before the host runs: the connection leaves the node",
        &tcp_many(&client, addr(UNALLOCATED, 80), 3),
        &["outside"],
    );

    let cluster = Cluster::new();
    cluster.put(&Svc::new("web", "10.96.0.60", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]));
    let host =
        start_host(HostConfig { service_cidrs: vec!["10.96.0.0/16".into()], ..cluster.config(topo.nft_command()) })
            .await;
    wait_applied(&host, "the service", |t| serves(t, "10.96.0.60 . tcp . 80"));
    let table = topo.table();
    assert!(set_holds(&table, "service-cidrs", "10.96.0.0/16"), "{table}");
    assert!(
        dropped(&client, addr(UNALLOCATED, 80), false),
        "TCP from a pod to an unallocated service address must be dropped"
    );
    assert!(
        dropped(&client, addr(UNALLOCATED, 80), true),
        "UDP from a pod to an unallocated service address must be dropped"
    );
    let from_node = topo.node.run(|| tcp_ask(addr(UNALLOCATED, 80), Duration::from_millis(300)));
    assert!(from_node.is_err(), "the node's own connection must not leave either: {from_node:?}");
    assert_backends("a service's address", &tcp_many(&client, addr("10.96.0.60", 80), 3), &["a"]);

    // A service takes the address: served from then on.
    cluster.put(&Svc::new("taken", UNALLOCATED, vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]));
    wait_applied(&host, "the address taken", |t| serves(t, &format!("{UNALLOCATED} . tcp . 80")));
    assert_backends("the address once a service has it", &tcp_many(&client, addr(UNALLOCATED, 80), 3), &["a"]);
    host.stop().await;
}

/// Whether a request from inside `ns` to `to` goes unanswered (dropped, not refused).
fn dropped(ns: &str, to: SocketAddr, udp: bool) -> bool {
    let result =
        in_ns(
            ns,
            || if udp { udp_ask(to, Duration::from_millis(300)) } else { tcp_ask(to, Duration::from_millis(300)) },
        );
    matches!(&result, Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock))
}

/// `spec.loadBalancerSourceRanges`: new connections to the load balancer address from
/// outside the ranges are dropped before DNAT, as in kube-proxy; the cluster IP and the node
/// port stay open to all. Ranges changed and removed while the host runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancer_source_ranges_admit_only_their_sources() {
    require_root!();
    let mut topo = Topology::new("fw");
    let pod = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let _server = Server::start(&pod, "a", &[8080]);
    topo.external.exec(&["ip", "route", "add", &format!("{LOAD_BALANCER_IP}/32"), "via", NODE_EXTERNAL_IP]);

    let cluster = Cluster::new();
    let mut guarded = Svc::new(
        "guarded",
        "10.96.0.30",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30090), Port::new("dns", "UDP", 80, 8080).node_port(30090)],
        vec![ready(POD_A, NODE)],
    );
    guarded.service_type = "LoadBalancer";
    guarded.load_balancer_ip = Some(LOAD_BALANCER_IP);
    // The external network only; the second range lies inside the first (merged, not refused).
    guarded.source_ranges = vec!["192.168.77.0/24", "192.168.77.0/25"];
    cluster.put(&guarded);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the firewall", |t| {
        set_holds(t, "firewall-allowed", &format!("{LOAD_BALANCER_IP} . tcp . 80 . 192.168.77.0/24"))
    });
    let table = topo.table();
    assert!(set_holds(&table, "firewall-ips", &format!("{LOAD_BALANCER_IP} . udp . 80")), "{table}");

    let ext = topo.external.name.clone();
    let lb = addr(LOAD_BALANCER_IP, 80);
    assert_backends("TCP from inside the ranges", &tcp_many(&ext, lb, 5), &["a"]);
    assert_backends("UDP from inside the ranges", &udp_many(&ext, lb, 5), &["a"]);
    assert!(dropped(&client, lb, false), "TCP from a pod, outside the ranges, must be dropped");
    assert!(dropped(&client, lb, true), "UDP from a pod, outside the ranges, must be dropped");
    // Only the load balancer address is closed (kube-proxy's scope as well).
    assert_backends("the cluster IP from the pod", &tcp_many(&client, addr("10.96.0.30", 80), 5), &["a"]);
    assert_backends("the node port from the pod", &tcp_many(&client, addr(NODE_EXTERNAL_IP, 30090), 5), &["a"]);

    // The ranges changed while running: the pods in, the external network out.
    guarded.source_ranges = vec!["10.244.0.0/16"];
    cluster.put(&guarded);
    wait_applied(&host, "the new ranges", |t| {
        set_holds(t, "firewall-allowed", &format!("{LOAD_BALANCER_IP} . tcp . 80 . 10.244.0.0/16"))
            && !t.contains("192.168.77.0/24")
    });
    assert_backends("TCP from the pod, now inside the ranges", &tcp_many(&client, lb, 5), &["a"]);
    assert!(dropped(&ext, lb, false), "TCP from the external network, now outside the ranges, must be dropped");
    assert_backends("the node port from outside the ranges", &tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30090), 5), &["a"]);

    // No ranges: open to every source again, and nothing of the firewall is left.
    guarded.source_ranges = vec![];
    cluster.put(&guarded);
    wait_applied(&host, "the firewall gone", |t| !t.contains("add element inet wasmplane firewall-"));
    assert_backends("TCP from the external network, no ranges", &tcp_many(&ext, lb, 5), &["a"]);
    assert_backends("TCP from the pod, no ranges", &tcp_many(&client, lb, 5), &["a"]);
    let table = topo.table();
    assert!(!set_holds(&table, "firewall-ips", &format!("{LOAD_BALANCER_IP} . tcp . 80")), "{table}");
    host.stop().await;
}

/// The same firewall for an IPv6 load balancer address: its IPv6 ranges admit the external
/// network and not the pods (the IPv6 sets and rule of `firewall-check`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancer_source_ranges_of_ipv6() {
    require_root!();
    const LB6: &str = "2001:db8:77::10";
    let mut topo = Topology::new("fw6");
    topo.enable_ipv6();
    let a6 = "fd00:10:244::11";
    let pod = topo.add_dual_stack_pod(POD_A, a6);
    let client = topo.add_dual_stack_pod(CLIENT, "fd00:10:244::100");
    let _server = Server::start_dual_stack(&pod, "a", &[8080]);
    topo.node.exec(&["ip", "-6", "addr", "add", "fd00:77::1/64", "dev", "ext0", "nodad"]);
    topo.external.exec(&["ip", "-6", "addr", "add", "fd00:77::2/64", "dev", "eth0", "nodad"]);
    topo.external.exec(&["ip", "-6", "route", "add", &format!("{LB6}/128"), "via", "fd00:77::1"]);

    let cluster = Cluster::new();
    let mut guarded =
        Svc::new("guarded6", "fd00:96::36", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(a6, NODE)]);
    guarded.service_type = "LoadBalancer";
    guarded.load_balancer_ip = Some(LB6);
    // An IPv4 range besides, which an IPv6 address leaves aside.
    guarded.source_ranges = vec!["fd00:77::/64", "10.244.0.0/16"];
    cluster.put(&guarded);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the firewall", |t| {
        set_holds(t, "firewall-allowed6", &format!("{LB6} . tcp . 80 . fd00:77::/64"))
    });
    let lb = addr(LB6, 80);
    assert_backends("IPv6 TCP from inside the ranges", &tcp_many(&topo.external.name, lb, 5), &["a"]);
    assert!(dropped(&client, lb, false), "IPv6 TCP from a pod, outside the ranges, must be dropped");
    host.stop().await;
}

/// `--nodeport-addresses`: node ports served on the node's primary address only (moving
/// with the Node object), or on the local addresses inside given networks (read again at
/// each reconcile), never on the node's other addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_ports_are_served_only_on_the_chosen_addresses() {
    require_root!();
    const SECOND_IP: &str = "192.168.77.9";
    const THIRD_IP: &str = "192.168.77.10";
    let mut topo = Topology::new("npa");
    let pod = topo.add_pod(POD_A);
    let _server = Server::start(&pod, "a", &[8080]);
    topo.node.exec(&["ip", "addr", "add", &format!("{SECOND_IP}/24"), "dev", "ext0"]);
    let cluster = Cluster::new();
    let mut svc = Svc::new(
        "np",
        "10.96.0.35",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30095)],
        vec![ready(POD_A, NODE)],
    );
    svc.service_type = "NodePort";
    cluster.put(&svc);
    let ext = topo.external.name.clone();
    let serves = |ip: &str| {
        in_ns(&ext, || tcp_ask(addr(ip, 30095), Duration::from_millis(500))).is_ok_and(|r| r.identity == "a")
    };

    let host = start_host(HostConfig {
        node_port_addresses: NodePortAddresses::Primary,
        ..cluster.config(topo.nft_command())
    })
    .await;
    wait_applied(&host, "the node port", |t| {
        set_holds(t, "nodeport-ips", NODE_EXTERNAL_IP) && t.contains("tcp . 30095")
    });
    assert!(serves(NODE_EXTERNAL_IP), "the node's primary address");
    assert!(!serves(SECOND_IP), "another local address of the node");
    // The Node object names another address: node ports follow it.
    cluster
        .put_file("cluster.yaml", &NODES_YAML.replace("address: 192.168.77.1 }", &format!("address: {SECOND_IP} }}")));
    wait_applied(&host, "the node's new address", |t| set_holds(t, "nodeport-ips", SECOND_IP));
    assert!(serves(SECOND_IP) && !serves(NODE_EXTERNAL_IP), "the node's new primary address only");
    host.stop().await;

    // Networks: the interfaces' addresses inside them, followed as they come and go (no
    // reconcile in this test's time).
    let config = HostConfig {
        node_port_addresses: "192.168.77.8/30".parse().unwrap(),
        reconcile_interval: Duration::from_secs(3600),
        ..cluster.config(topo.nft_command())
    };
    let host = start_host(config).await;
    wait_applied(&host, "the node port", |t| {
        set_holds(t, "nodeport-ips", SECOND_IP) && !set_holds(t, "nodeport-ips", NODE_EXTERNAL_IP)
    });
    assert!(serves(SECOND_IP) && !serves(NODE_EXTERNAL_IP), "the local address inside the network only");
    topo.node.exec(&["ip", "addr", "add", &format!("{THIRD_IP}/24"), "dev", "ext0"]);
    wait_applied(&host, "a new local address inside the network", |t| set_holds(t, "nodeport-ips", THIRD_IP));
    assert!(serves(THIRD_IP));
    topo.node.exec(&["ip", "addr", "del", &format!("{THIRD_IP}/24"), "dev", "ext0"]);
    wait_applied(&host, "the address gone", |t| {
        !set_holds(t, "nodeport-ips", THIRD_IP) && set_holds(t, "nodeport-ips", SECOND_IP)
    });
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_affinity_client_ip_sticks() {
    require_root!();
    let mut topo = Topology::new("aff");
    let pods: Vec<(String, &str)> = [(POD_A, "a"), (POD_B, "b"), (POD_C, "c"), (POD_D, "d")]
        .iter()
        .map(|(ip, id)| (topo.add_pod(ip), *id))
        .collect();
    let (client, client2) = (topo.add_pod(CLIENT), topo.add_pod(CLIENT2));
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080])).collect();

    let cluster = Cluster::new();
    let mut sticky = Svc::new(
        "sticky",
        "10.96.0.30",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30030), Port::new("dns", "UDP", 80, 8080)],
        vec![ready(POD_A, NODE), ready(POD_B, NODE), ready(POD_C, NODE)],
    );
    sticky.service_type = "NodePort";
    sticky.affinity_seconds = Some(600);
    cluster.put(&sticky);
    let host = start_host(cluster.config(topo.nft_command())).await;
    // Affinity as data: no chain of the service's own, the frontends go to the shard's
    // affinity chain for 600 s, counted as 3 backends.
    let t = wait_applied(&host, "the sticky service", |t| {
        t.contains("10.96.0.30 . udp . 80 : goto affinity-600-pick-by-count")
    });
    assert!(
        t.contains("10.96.0.30 . tcp . 80 : goto affinity-600-pick-by-count") && !t.contains("svc/default/sticky"),
        "{t}"
    );
    assert!(
        set_holds(&t, "frontends-3", "10.96.0.30 . tcp . 80") && set_holds(&t, "frontends-3", "10.96.0.30 . udp . 80"),
        "{t}"
    );

    let one = |what: &str, replies: Vec<std::io::Result<Reply>>| -> String {
        let seen = tally(what, &replies);
        assert_eq!(seen.len(), 1, "{what}: affinity must pin one backend, saw {seen:?}");
        seen.into_keys().next().unwrap()
    };
    let tcp1 = one("client 1, TCP", tcp_many(&client, addr("10.96.0.30", 80), 30));
    let udp1 = one("client 1, UDP", udp_many(&client, addr("10.96.0.30", 80), 30));
    one("client 2, TCP", tcp_many(&client2, addr("10.96.0.30", 80), 30));
    // The node port remembers its clients too (chains of its own for the timeout).
    assert!(
        t.contains("tcp . 30030 : goto nodeport-affinity-600-pick-by-count")
            && set_holds(&t, "nodeports-3", "tcp . 30030"),
        "{t}"
    );
    let ext = topo.external.name.clone();
    one("external client, TCP node port", tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30030), 30));

    // A full reconcile rewrites every chain in one transaction but keeps the affinity sets'
    // dynamic elements; adding an endpoint leaves existing endpoints' affinity alone.
    host.controller.lock().unwrap().reconcile().unwrap();
    sticky.endpoints.push(ready(POD_D, NODE));
    cluster.put(&sticky);
    wait_applied(&host, "the fourth endpoint", |t| targets(t, POD_D));
    assert_eq!(one("client 1, TCP, after reconcile and scale-up", tcp_many(&client, addr("10.96.0.30", 80), 30)), tcp1);
    assert_eq!(one("client 1, UDP, after reconcile and scale-up", udp_many(&client, addr("10.96.0.30", 80), 30)), udp1);

    // Client 1's backend goes: it is sent to another one and sticks to that.
    let gone_ip =
        [(POD_A, "a"), (POD_B, "b"), (POD_C, "c"), (POD_D, "d")].into_iter().find(|(_, id)| *id == tcp1).unwrap().0;
    sticky.endpoints.retain(|e| e.ip != gone_ip);
    cluster.put(&sticky);
    wait_applied(&host, "client 1's backend gone", |t| !targets(t, gone_ip));
    let moved = one("client 1, TCP, its backend gone", tcp_many(&client, addr("10.96.0.30", 80), 30));
    assert_ne!(moved, tcp1, "sent to the backend that left");

    // Switching affinity off and on again changes the service's sets (deleted, declared
    // anew) in incremental transactions the kernel must accept.
    sticky.affinity_seconds = None;
    cluster.put(&sticky);
    wait_applied(&host, "affinity off", |t| t.contains("10.96.0.30 . tcp . 80 : goto pick-by-count"));
    let all: Vec<&str> = ["a", "b", "c", "d"].into_iter().filter(|id| *id != tcp1).collect();
    assert_backends("client 1 without affinity", &tcp_many(&client, addr("10.96.0.30", 80), MANY), &all);
    // Another timeout: new to the shard, its chains come with a full sync.
    sticky.affinity_seconds = Some(30);
    cluster.put(&sticky);
    wait_applied(&host, "affinity on", |t| t.contains("10.96.0.30 . tcp . 80 : goto affinity-30-pick-by-count"));
    one("client 1, TCP, affinity on again", tcp_many(&client, addr("10.96.0.30", 80), 30));
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_without_endpoints_rejects_fast() {
    require_root!();
    let mut topo = Topology::new("rej");
    let pod_a = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let _server = Server::start(&pod_a, "a", &[8080]);

    let cluster = Cluster::new();
    let mut empty = Svc::new(
        "empty",
        "10.96.0.40",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30040), Port::new("dns", "UDP", 80, 8080).node_port(30040)],
        vec![],
    );
    empty.service_type = "NodePort";
    cluster.put(&empty);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "reject elements", |t| {
        t.contains("10.96.0.40 . tcp . 80 : goto reject-chain") && t.contains("udp . 30040 : goto reject-chain")
    });

    let check_rejected = |stage: &str| {
        for (what, ns, to) in [
            ("pod → cluster IP", &client, addr("10.96.0.40", 80)),
            ("node → cluster IP", &topo.node.name, addr("10.96.0.40", 80)),
            ("external → node port", &topo.external.name, addr(NODE_EXTERNAL_IP, 30040)),
        ] {
            let local = *ns == topo.node.name;
            let started = Instant::now();
            let tcp = in_ns(ns, || tcp_ask(to, TIMEOUT));
            assert_refused_fast(&format!("{stage}: TCP {what}"), tcp, started, local);
            let started = Instant::now();
            let udp = in_ns(ns, || udp_ask(to, TIMEOUT));
            assert_refused_fast(&format!("{stage}: UDP {what}"), udp, started, local);
        }
    };
    check_rejected("no endpoints");

    empty.endpoints = vec![ready(POD_A, NODE)];
    cluster.put(&empty);
    wait_applied(&host, "an endpoint", |t| targets(t, POD_A));
    assert_backends("TCP once an endpoint is ready", &tcp_many(&client, addr("10.96.0.40", 80), 5), &["a"]);
    assert_backends("UDP once an endpoint is ready", &udp_many(&client, addr("10.96.0.40", 80), 5), &["a"]);
    assert_backends(
        "node port once an endpoint is ready",
        &tcp_many(&topo.external.name, addr(NODE_EXTERNAL_IP, 30040), 5),
        &["a"],
    );
    // A port the service does not have: the cluster IP is ours, so the connection is refused
    // at once (kube-proxy's `cluster-ips` set) rather than routed on to time out.
    for (what, ns) in [("pod", &client), ("node", &topo.node.name)] {
        let started = Instant::now();
        let tcp = in_ns(ns, || tcp_ask(addr("10.96.0.40", 81), TIMEOUT));
        assert_refused_fast(&format!("TCP {what} → cluster IP, unknown port"), tcp, started, *ns == topo.node.name);
    }

    // Not ready (and not serving) is as good as none.
    empty.endpoints = vec![Endpoint { ip: POD_A.into(), node: NODE, ready: false, serving: false, terminating: false }];
    cluster.put(&empty);
    wait_applied(&host, "reject again", |t| t.contains("10.96.0.40 . tcp . 80 : goto reject-chain"));
    check_rejected("endpoint not ready");
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_moves_new_traffic_and_keeps_established_connections() {
    require_root!();
    let mut topo = Topology::new("scale");
    let pods: Vec<(String, &str)> = [(POD_A, "a"), (POD_B, "b"), (POD_C, "c"), (POD_D, "d"), ("10.244.0.15", "e")]
        .iter()
        .map(|(ip, id)| (topo.add_pod(ip), *id))
        .collect();
    let client = topo.add_pod(CLIENT);
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080])).collect();

    let cluster = Cluster::new();
    let mut scaled = Svc::new(
        "scaled",
        "10.96.0.50",
        vec![Port::new("http", "TCP", 80, 8080)],
        vec![ready(POD_A, NODE), ready(POD_B, NODE)],
    );
    let steady = Svc::new(
        "steady",
        "10.96.0.51",
        vec![Port::new("http", "TCP", 80, 8080)],
        vec![ready(POD_C, NODE), ready(POD_D, NODE)],
    );
    cluster.put(&scaled);
    cluster.put(&steady);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "both services", |t| serves(t, "10.96.0.50 . tcp . 80") && serves(t, "10.96.0.51 . tcp . 80"));

    // Established connections: one to the untouched service, and to each current backend of
    // the scaled one (one of which is about to be removed).
    let mut to_steady = Conn::open(&client, addr("10.96.0.51", 80), TIMEOUT).unwrap();
    let steady_backend = to_steady.ask().unwrap().identity;
    let mut to_scaled: BTreeMap<String, Conn> = BTreeMap::new();
    for _ in 0..200 {
        let mut c = Conn::open(&client, addr("10.96.0.50", 80), TIMEOUT).unwrap();
        let id = c.ask().unwrap().identity;
        to_scaled.entry(id).or_insert(c);
        if to_scaled.len() == 2 {
            break;
        }
    }
    assert_eq!(to_scaled.keys().collect::<Vec<_>>(), ["a", "b"]);

    scaled.endpoints.push(ready("10.244.0.15", NODE));
    cluster.put(&scaled);
    wait_applied(&host, "scale-up", |t| targets(t, "10.244.0.15"));
    assert_backends("after scale-up", &tcp_many(&client, addr("10.96.0.50", 80), MANY), &["a", "b", "e"]);

    scaled.endpoints = vec![ready(POD_A, NODE)];
    cluster.put(&scaled);
    wait_applied(&host, "scale-down", |t| !targets(t, POD_B) && !targets(t, "10.244.0.15"));
    assert_backends("after scale-down", &tcp_many(&client, addr("10.96.0.50", 80), 30), &["a"]);

    // Nothing established was dropped: the untouched service's connection, and (like
    // kube-proxy, which leaves TCP conntrack alone) those to kept and removed backends.
    assert_eq!(to_steady.ask().unwrap().identity, steady_backend, "connection to the untouched service");
    for (id, conn) in &mut to_scaled {
        assert_eq!(&conn.ask().unwrap_or_else(|e| panic!("established connection to {id}: {e}")).identity, id);
    }
    assert_backends("the untouched service", &tcp_many(&client, addr("10.96.0.51", 80), MANY), &["c", "d"]);
    host.stop().await;
}

/// Two services with one frontend (address, protocol, port): no allocator checks the
/// manifests of the embedded mode, nor `externalIPs` in a cluster. The first keeps serving
/// it, though the second, without endpoints, would reject it through another map (the node's
/// own connections meet that check before their DNAT); once the first is gone the second has
/// it, without being translated again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_service_on_one_frontend_does_not_take_it_over() {
    require_root!();
    const CLUSTER_IP: &str = "10.96.0.70";
    let mut topo = Topology::new("dupf");
    let pod_a = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let _server = Server::start(&pod_a, "a", &[8080]);

    let cluster = Cluster::new();
    cluster.put(&Svc {
        created: Some("2026-01-01T00:00:00Z"),
        ..Svc::new("web", CLUSTER_IP, vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)])
    });
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the first service", |t| serves(t, &format!("{CLUSTER_IP} . tcp . 80")));
    // "dup" sorts before "web", and a full sync offers services in key order. Its second
    // port is its own.
    cluster.put(&Svc {
        created: Some("2026-06-01T00:00:00Z"),
        ..Svc::new(
            "dup",
            CLUSTER_IP,
            vec![Port::new("http", "TCP", 80, 8080), Port::new("other", "TCP", 81, 8080)],
            vec![],
        )
    });
    let frontend_reject = format!("{CLUSTER_IP} . tcp . 80 : goto reject-chain");
    wait_applied(&host, "the second service's own port", |t| {
        t.contains(&format!("{CLUSTER_IP} . tcp . 81 : goto reject-chain"))
    });
    let node = topo.node.name.clone();
    let check_served = |stage: &str| {
        assert_backends(&format!("{stage}: from the node"), &tcp_many(&node, addr(CLUSTER_IP, 80), 5), &["a"]);
        assert_backends(&format!("{stage}: from a pod"), &tcp_many(&client, addr(CLUSTER_IP, 80), 5), &["a"]);
    };
    check_served("a second service");
    let table = topo.table();
    assert!(!table.contains(&frontend_reject), "{table}");
    let controller = || host.controller.lock().unwrap_or_else(|p| p.into_inner());
    let dup = wasmplane_model::ObjectKey::new("default", "dup");
    let warnings = controller().dataplane().applied()[&dup].warnings.clone();
    let refused = format!("frontend {CLUSTER_IP} . tcp . 80 already belongs to default/web");
    assert!(warnings.contains(&refused), "{warnings:?}");
    // A periodic reconcile keeps it so.
    controller().reconcile().unwrap();
    check_served("after a reconcile");
    // So does a restart, which offers both at once in key order: the older service keeps it.
    host.stop().await;
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "both services after a restart", |t| {
        t.contains(&format!("{CLUSTER_IP} . tcp . 81 : goto reject-chain"))
    });
    check_served("after a restart");
    let controller = || host.controller.lock().unwrap_or_else(|p| p.into_inner());
    let warnings = controller().dataplane().applied()[&dup].warnings.clone();
    assert!(warnings.contains(&refused), "after a restart: {warnings:?}");

    cluster.remove("web");
    wait_applied(&host, "the second service's reject", |t| t.contains(&frontend_reject));
    let table = topo.table();
    assert!(table.contains(&frontend_reject), "{table}");
    let started = Instant::now();
    let result = in_ns(&node, || tcp_ask(addr(CLUSTER_IP, 80), TIMEOUT));
    assert_refused_fast("from the node, the frontend now the second service's", result, started, true);
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_service_removes_its_rules() {
    require_root!();
    let mut topo = Topology::new("del");
    let pod_a = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let _server = Server::start(&pod_a, "a", &[8080]);

    let cluster = Cluster::new();
    let mut gone = Svc::new(
        "gone",
        "10.96.0.60",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30060)],
        vec![ready(POD_A, NODE)],
    );
    gone.service_type = "NodePort";
    cluster.put(&gone);
    cluster.put(&Svc::new("kept", "10.96.0.61", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]));
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "both services", |t| serves(t, "10.96.0.60 . tcp . 80") && serves(t, "10.96.0.61 . tcp . 80"));
    assert_backends("before deletion", &tcp_many(&client, addr("10.96.0.60", 80), 3), &["a"]);
    assert_backends(
        "node port before deletion",
        &tcp_many(&topo.external.name, addr(NODE_EXTERNAL_IP, 30060), 3),
        &["a"],
    );

    cluster.remove("gone");
    wait_applied(&host, "deletion", |t| !t.contains("svc/default/gone") && !t.contains("10.96.0.60"));
    let table = topo.table();
    for gone in ["svc/default/gone", "10.96.0.60", "30060"] {
        assert!(!table.contains(gone), "{gone} still in the kernel:\n{table}");
    }
    // The cluster IP is now routed into the void, the node port is a closed local port.
    let result = in_ns(&client, || tcp_ask(addr("10.96.0.60", 80), Duration::from_millis(300)));
    assert!(matches!(&result, Err(e) if e.kind() == ErrorKind::TimedOut), "cluster IP after deletion: {result:?}");
    let result = topo.external.run(|| tcp_ask(addr(NODE_EXTERNAL_IP, 30060), TIMEOUT));
    assert!(
        matches!(&result, Err(e) if e.kind() == ErrorKind::ConnectionRefused),
        "node port after deletion: {result:?}"
    );
    assert_backends("the other service", &tcp_many(&client, addr("10.96.0.61", 80), 3), &["a"]);
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hairpin_traffic_is_masqueraded() {
    require_root!();
    let mut topo = Topology::new("hair");
    let pod_a = topo.add_pod(POD_A);
    let pod_b = topo.add_pod(POD_B);
    let _server_a = Server::start(&pod_a, "a", &[8080]);
    let _server_b = Server::start(&pod_b, "b", &[8080]);
    let cluster = Cluster::new();
    let ports = || vec![Port::new("http", "TCP", 80, 8080), Port::new("dns", "UDP", 80, 8080)];
    cluster.put(&Svc::new("self", "10.96.0.70", ports(), vec![ready(POD_A, NODE), ready(POD_B, NODE)]));
    // A second service in front of pod a: the hairpin pair is shared, and stays when one
    // service stops naming it.
    cluster.put(&Svc::new("also", "10.96.0.71", ports(), vec![ready(POD_A, NODE)]));
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the services", |t| serves(t, "10.96.0.70 . udp . 80") && serves(t, "10.96.0.71 . udp . 80"));

    // The pod reaches its own service and lands on itself. Without masquerade its reply
    // would go straight back over loopback, un-NATed, and the connection would never open.
    // Landing on the other pod, it keeps its own address (only hairpin is masqueraded).
    let check = |what: &str, replies: &[std::io::Result<Reply>]| {
        assert_backends(what, replies, &["a", "b"]);
        assert_all(what, replies, |r| r.peer == ip(if r.identity == "a" { POD_GATEWAY } else { POD_A }));
    };
    check("hairpin TCP", &tcp_many(&pod_a, addr("10.96.0.70", 80), 24));
    check("hairpin UDP", &udp_many(&pod_a, addr("10.96.0.70", 80), 24));

    cluster.remove("self");
    wait_applied(&host, "deletion", |t| !t.contains("10.96.0.70"));
    let replies = tcp_many(&pod_a, addr("10.96.0.71", 80), 5);
    assert_backends("hairpin through the other service", &replies, &["a"]);
    assert_all("hairpin through the other service", &replies, |r| r.peer == ip(POD_GATEWAY));
    let table = topo.table();
    assert!(!table.contains("10.244.0.12 . 10.244.0.12") && table.contains("10.244.0.11 . 10.244.0.11"), "{table}");
    host.stop().await;
}

const POD_A6: &str = "fd00:10:244::11";
const POD_B6: &str = "fd00:10:244::12";

/// A node with IPv6 on and pods a and b of both families ([`POD_A`]/[`POD_A6`],
/// [`POD_B`]/[`POD_B6`]), each serving its name on 8080; the servers stop when dropped.
fn dual_stack_pods(tag: &str) -> (Topology, String, String, [Server; 2]) {
    let mut topo = Topology::new(tag);
    topo.enable_ipv6();
    let pod_a = topo.add_dual_stack_pod(POD_A, POD_A6);
    let pod_b = topo.add_dual_stack_pod(POD_B, POD_B6);
    let servers = [Server::start_dual_stack(&pod_a, "a", &[8080]), Server::start_dual_stack(&pod_b, "b", &[8080])];
    (topo, pod_a, pod_b, servers)
}

/// kube-proxy's conntrack settings, applied by the host at start in the node's namespace:
/// a day for idle established TCP connections, an hour for half-closed ones (the kernel's
/// 5 days and 60 s before); the UDP timeouts and TCP's "be liberal" when asked for; the table
/// size, read-only outside the initial namespace, left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conntrack_timeouts_are_set_as_kube_proxy_sets_them() {
    require_root!();
    let topo = Topology::new("ctt");
    let sysctl =
        |name: &str| topo.node.exec(&["sysctl", "-n", &format!("net.netfilter.{name}")]).trim().parse::<u64>().unwrap();
    let (established, close_wait, max) =
        ("nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait", "nf_conntrack_max");
    let (udp, udp_stream, be_liberal) =
        ("nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream", "nf_conntrack_tcp_be_liberal");
    let kernels = [sysctl(established), sysctl(close_wait), sysctl(udp), sysctl(udp_stream), sysctl(be_liberal)];
    assert_eq!(kernels, [432000, 60, 30, 120, 0], "a new namespace has the kernel's");
    let max_before = sysctl(max);
    let cluster = Cluster::new();
    let tuning = wasmplane::conntrack_tuning::ConntrackTuning {
        max_per_core: 1 << 30,
        udp_timeout: Duration::from_secs(45),
        udp_stream_timeout: Duration::from_secs(150),
        tcp_be_liberal: true,
        ..Default::default()
    };
    let host = start_host(HostConfig { conntrack: Some(tuning), ..cluster.config(topo.nft_command()) }).await;
    assert_eq!(
        [sysctl(established), sysctl(close_wait), sysctl(udp), sysctl(udp_stream), sysctl(be_liberal)],
        [86400, 3600, 45, 150, 1]
    );
    assert_eq!(sysctl(max), max_before, "only the initial namespace sets the table size");
    host.stop().await;
}

/// kube-proxy's `--masquerade-all`: a pod reaching a cluster IP arrives from the node's
/// address on the endpoint's link (the gateway), not its own, in both families and on
/// either endpoint; a connection straight to a pod, no service between, keeps its source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masquerade_all_hides_every_client_of_a_cluster_ip() {
    require_root!();
    let (topo, _pod_a, pod_b, _servers) = dual_stack_pods("mall");
    let (a6, b6) = (POD_A6, POD_B6);
    let cluster = Cluster::new();
    let ports = || vec![Port::new("http", "TCP", 80, 8080), Port::new("dns", "UDP", 80, 8080)];
    cluster.put(&Svc::new("four", "10.96.0.72", ports(), vec![ready(POD_A, NODE), ready(POD_B, NODE)]));
    cluster.put(&Svc::new("six", "fd00:96::72", ports(), vec![ready(a6, NODE), ready(b6, NODE)]));
    let host = start_host(HostConfig { masquerade_all: true, ..cluster.config(topo.nft_command()) }).await;
    wait_applied(&host, "the services", |t| serves(t, "10.96.0.72 . udp . 80") && serves(t, "fd00:96::72 . udp . 80"));
    assert!(topo.table().contains("ct original ip daddr @cluster-ips"), "{}", topo.table());

    for (service, gateway) in [("10.96.0.72", POD_GATEWAY), ("fd00:96::72", POD_GATEWAY6)] {
        let check = |what: &str, replies: &[std::io::Result<Reply>]| {
            assert_backends(what, replies, &["a", "b"]);
            // Dual-stack servers see IPv4 clients as `::ffff:a.b.c.d`.
            assert_all(what, replies, |r| r.peer.to_canonical() == ip(gateway));
        };
        check(&format!("TCP to {service}"), &tcp_many(&pod_b, addr(service, 80), 24));
        check(&format!("UDP to {service}"), &udp_many(&pod_b, addr(service, 80), 24));
    }
    let direct = in_ns(&pod_b, || tcp_ask(addr(POD_A, 8080), Duration::from_secs(2))).map(|r| r.peer.to_canonical());
    assert_eq!(direct.unwrap(), ip(POD_B), "no service, no masquerade");
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_cluster_ip_reaches_every_backend_and_masquerades_only_hairpin() {
    require_root!();
    let (topo, pod_a, pod_b, _servers) = dual_stack_pods("six");
    let (a6, b6) = (POD_A6, POD_B6);
    let cluster = Cluster::new();
    let ports = vec![Port::new("http", "TCP", 80, 8080), Port::new("dns", "UDP", 80, 8080)];
    cluster.put(&Svc::new("six", "fd00:96::70", ports, vec![ready(a6, NODE), ready(b6, NODE)]));
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the service", |t| serves(t, "fd00:96::70 . udp . 80"));
    let table = topo.table();
    assert!(
        table.contains(&format!("{a6} . {a6}")) && table.contains("ct status dnat ip6 saddr . ip6 daddr @hairpin6"),
        "{table}"
    );

    // From pod a: landing on itself it sees the node's gateway address (hairpin), landing on
    // b it keeps its own; the same from pod b the other way round.
    for (client, me, own_address) in [(&pod_a, "a", a6), (&pod_b, "b", b6)] {
        let check = |what: &str, replies: &[std::io::Result<Reply>]| {
            assert_backends(what, replies, &["a", "b"]);
            assert_all(what, replies, |r| r.peer == ip(if r.identity == me { POD_GATEWAY6 } else { own_address }));
        };
        check(&format!("IPv6 TCP from {me}"), &tcp_many(client, addr("fd00:96::70", 80), 24));
        check(&format!("IPv6 UDP from {me}"), &udp_many(client, addr("fd00:96::70", 80), 24));
    }
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_reconcile_repairs_hand_made_damage() {
    require_root!();
    let mut topo = Topology::new("drift");
    let pods: Vec<(String, &str)> =
        [(POD_A, "a"), (POD_B, "b")].iter().map(|(ip, id)| (topo.add_pod(ip), *id)).collect();
    let client = topo.add_pod(CLIENT);
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080])).collect();
    let cluster = Cluster::new();
    cluster.put(&Svc::new(
        "drift",
        "10.96.0.80",
        vec![Port::new("http", "TCP", 80, 8080)],
        vec![ready(POD_A, NODE), ready(POD_B, NODE)],
    ));
    let mut config = cluster.config(topo.nft_command());
    config.reconcile_interval = Duration::from_millis(300);
    let host = start_host(config).await;
    wait_applied(&host, "the service", |t| serves(t, "10.96.0.80 . tcp . 80"));
    assert_backends("before any damage", &tcp_many(&client, addr("10.96.0.80", 80), MANY), &["a", "b"]);

    // What is done by hand (one nft transaction), and how the repaired tables look. The
    // service lives in its shard table; the main table holds the shared checks.
    let shard = host.controller.lock().unwrap().dataplane().layout().table_of("svc/default/drift");
    type Damage = (&'static str, String, &'static dyn Fn(&str) -> bool);
    let damage: &[Damage] = &[
        (
            "the service's map element, its count and one of its backends deleted",
            format!(
                "delete element {shard} service-ips {{ 10.96.0.80 . tcp . 80 }}\n\
                 delete element {shard} frontends-2 {{ 10.96.0.80 . tcp . 80 }}\n\
                 delete element {shard} service-endpoints {{ 10.96.0.80 . tcp . 80 . 1 }}\n"
            ),
            &|t| {
                t.contains("10.96.0.80 . tcp . 80 : goto pick-by-count")
                    && set_holds(t, "frontends-2", "10.96.0.80 . tcp . 80")
                    && t.contains("10.96.0.80 . tcp . 80 . 1 : ")
            },
        ),
        (
            "the by-count chain deleted (the map element first, as nft insists)",
            format!(
                "delete element {shard} service-ips {{ 10.96.0.80 . tcp . 80 }}\n\
                 flush chain {shard} pick-by-count\n\
                 delete chain {shard} pick-by-count\n"
            ),
            &|t| {
                t.contains("chain pick-by-count {")
                    && t.contains("@frontends-2 goto pick-2")
                    && t.contains("10.96.0.80 . tcp . 80 : goto pick-by-count")
            },
        ),
        ("a base chain flushed", format!("flush chain {shard} nat-prerouting\n"), &|t| {
            t.split("chain nat-prerouting {").skip(1).all(|c| c.split('}').next().unwrap().contains("jump services"))
        }),
        ("the shard table deleted", format!("delete table {shard}\n"), &|t| {
            t.contains("10.96.0.80 . tcp . 80 : goto pick-by-count")
                && set_holds(t, "frontends-2", "10.96.0.80 . tcp . 80")
        }),
        ("the main table deleted", "delete table inet wasmplane\n".into(), &|t| {
            t.contains("table inet wasmplane {") && t.contains("chain masquerading {")
        }),
    ];
    for (what, commands, repaired) in damage {
        // One nft transaction, so a reconcile cannot land between its statements.
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), commands).unwrap();
        topo.nft(&["-f", file.path().to_str().unwrap()]).unwrap_or_else(|e| panic!("{what}: {e}"));
        wait_for(
            &format!("the reconcile to repair: {what}"),
            Duration::from_secs(10),
            || topo.table(),
            |t| repaired(t),
        );
        assert_backends(
            &format!("after repairing: {what}"),
            &tcp_many(&client, addr("10.96.0.80", 80), MANY),
            &["a", "b"],
        );
    }
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_the_host_leaves_no_window_without_rules() {
    require_root!();
    let mut topo = Topology::new("restart");
    let pods: Vec<(String, &str)> =
        [(POD_A, "a"), (POD_B, "b")].iter().map(|(ip, id)| (topo.add_pod(ip), *id)).collect();
    let client = topo.add_pod(CLIENT);
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080])).collect();
    let cluster = Cluster::new();
    cluster.put(&Svc::new(
        "always",
        "10.96.0.90",
        vec![Port::new("http", "TCP", 80, 8080), Port::new("dns", "UDP", 80, 8080)],
        vec![ready(POD_A, NODE), ready(POD_B, NODE)],
    ));
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the service", |t| serves(t, "10.96.0.90 . udp . 80"));

    // A client that never stops: fresh TCP and UDP flows back to back, every failure kept.
    let stop = Arc::new(AtomicBool::new(false));
    let successes = Arc::new(AtomicUsize::new(0));
    let looper = {
        let (stop, successes, client) = (stop.clone(), successes.clone(), client.clone());
        std::thread::spawn(move || {
            in_ns(&client, || {
                let mut failures = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    for (proto, result) in [
                        ("tcp", tcp_ask(addr("10.96.0.90", 80), Duration::from_secs(1))),
                        ("udp", udp_ask(addr("10.96.0.90", 80), Duration::from_secs(1))),
                    ] {
                        match result {
                            Ok(_) => {
                                successes.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(e) => failures.push(format!("{proto}: {e}")),
                        }
                    }
                }
                failures
            })
        })
    };
    let wait_successes = |what: &str, more: usize| {
        let target = successes.load(Ordering::SeqCst) + more;
        wait_for(what, Duration::from_secs(10), || successes.load(Ordering::SeqCst), |n| *n >= target);
    };
    wait_successes("the client loop to run", 20);

    host.stop().await;
    let table = topo.table();
    assert!(
        table.contains("10.96.0.90 . tcp . 80 : goto pick-by-count")
            && set_holds(&table, "frontends-2", "10.96.0.90 . tcp . 80"),
        "rules must stay while the host is down"
    );
    wait_successes("traffic while the host is down", 20);

    let host = start_host(cluster.config(topo.nft_command())).await;
    // Before the new host has read its sources, it must not have replaced working rules
    // with its (still empty) view of the cluster.
    let table = topo.table();
    assert!(
        table.contains("10.96.0.90 . tcp . 80 : goto pick-by-count")
            && set_holds(&table, "frontends-2", "10.96.0.90 . tcp . 80"),
        "rules right after restart:\n{table}"
    );
    wait_applied(&host, "the new host's first sync", |t| serves(t, "10.96.0.90 . udp . 80"));
    // The first sync is one full transaction: the last one written is full, and no change
    // went in as a netlink batch (full transactions go through `nft -f`). The kept start of
    // the transaction ends in the shards' skeletons, before the services' elements.
    let first = host.controller.lock().unwrap().dataplane().last_transaction.clone();
    assert!(
        first.starts_with("add table inet wasmplane\n") && first.contains("flush table inet wasmplane\n"),
        "the first sync is one full transaction:\n{first}"
    );
    let batches = host
        .metrics
        .dataplane_transactions
        .get_or_create(&wasmplane::metrics::PathLabels { path: "netlink".into() })
        .get();
    assert_eq!(batches, 0, "the first sync is one full transaction, not a start from nothing and changes");
    wait_successes("traffic after the restart", 20);

    stop.store(true, Ordering::SeqCst);
    let failures = looper.join().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} requests failed across the restart: {failures:?}",
        failures.len(),
        failures.len() + successes.load(Ordering::SeqCst)
    );
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sctp_services_load_and_dnat() {
    require_root!();
    let mut topo = Topology::new("sctp");
    let pod_a = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let cluster = Cluster::new();
    cluster.put(&Svc::new(
        "assoc",
        "10.96.0.100",
        vec![Port::new("sig", "SCTP", 7777, 7070)],
        vec![ready(POD_A, NODE)],
    ));
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the SCTP service", |t| serves(t, "10.96.0.100 . sctp . 7777"));
    let table = topo.table();
    assert!(
        table.contains("10.96.0.100 . sctp . 7777 : goto pick-by-count")
            && set_holds(&table, "frontends-1", "10.96.0.100 . sctp . 7777")
            && table.contains("10.96.0.100 . sctp . 7777 . 0 : 10.244.0.11 . 7070"),
        "{table}"
    );

    // No SCTP sockets on this kernel; raw sockets show the INIT arriving DNATed.
    use support::sctp::*;
    let listener = match in_ns(&pod_a, raw_socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "\n!!!!!!!! sctp_services_load_and_dnat: no raw SCTP sockets ({e}); only checked that the rules load !!!!!!!!\n"
            );
            host.stop().await;
            return;
        }
    };
    let sender = in_ns(&client, raw_socket).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let seen = loop {
        assert!(Instant::now() < deadline, "the SCTP INIT never reached the backend");
        send_init(&sender, Ipv4Addr::new(10, 96, 0, 100), 40001, 7777).unwrap();
        let mut buf = [0u8; 1500];
        // Until the read times out (then send again: nothing guarantees the first got through).
        let found = std::iter::from_fn(|| listener.recv(&mut buf).ok().map(|n| parse_received(&buf[..n])))
            .flatten()
            .find(|s| s.src_port == 40001);
        if let Some(seen) = found {
            break seen;
        }
    };
    assert_eq!(
        seen,
        SeenInit {
            source: CLIENT.parse().unwrap(),
            destination: POD_A.parse().unwrap(),
            src_port: 40001,
            dst_port: 7070
        }
    );
    host.stop().await;
}

/// kube-proxy deletes the conntrack entries of UDP flows whose endpoint went away, so a
/// long-lived UDP client (a DNS resolver) moves to a live endpoint at once instead of sending
/// into the void until its entry times out (120 s for an assured UDP flow). The host does the
/// same through `conntrack -D` in the node namespace after the transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_udp_flow_to_a_removed_endpoint_moves_to_a_live_one() {
    require_root!();
    let mut topo = Topology::new("udpct");
    let pods: Vec<(String, &str)> =
        [(POD_A, "a"), (POD_B, "b")].iter().map(|(ip, id)| (topo.add_pod(ip), *id)).collect();
    let client = topo.add_pod(CLIENT);
    let _servers: Vec<Server> = pods.iter().map(|(ns, id)| Server::start(ns, id, &[8080])).collect();
    let cluster = Cluster::new();
    let mut dns = Svc::new(
        "dns",
        "10.96.0.53",
        vec![Port::new("dns", "UDP", 53, 8080)],
        vec![ready(POD_A, NODE), ready(POD_B, NODE)],
    );
    cluster.put(&dns);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the service", |t| serves(t, "10.96.0.53 . udp . 53"));

    let socket = in_ns(&client, || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        s.connect(addr("10.96.0.53", 53)).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s
    });
    let ask = || {
        socket.send(b"who").unwrap();
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).split_whitespace().next().unwrap().to_string()
    };
    let first = ask();
    let removed = if first == "a" { POD_A } else { POD_B };
    dns.endpoints.retain(|e| e.ip != removed);
    cluster.put(&dns);
    wait_applied(&host, "the endpoint removed", |t| !targets(t, removed));
    assert_ne!(ask(), first, "the flow still reaches the removed endpoint");
    host.stop().await;
}

/// A global Service (Cilium's clustermesh global services, `wasmplane.io/global`): the
/// endpoints another cluster's operator exports to its own etcd are backends here beside this
/// cluster's own, follow that cluster's changes, and leave when the Service here stops being
/// global. The other cluster ("east") is its own etcd, API server and the whole host in the
/// operator role; this one ("west") follows east's etcd (`--remote-cluster`). East's pod is a
/// namespace routed from this node (clustermesh needs the pod networks routed to each other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_service_balances_to_another_clusters_endpoints() {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use wasmplane::app::{KubernetesSource, KvstoreConfig};
    use wasmplane_test_apiserver::TestApiServer;
    use wasmplane_test_etcd::Etcd;

    require_root!();
    const EAST_POD: &str = "10.245.0.7";
    const EAST_POD_STARTING: &str = "10.245.0.8";
    let (mut east_etcd, west_etcd) =
        (Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)"), Etcd::start().await.unwrap());
    let east_api = TestApiServer::start().await;
    let east_service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default", "annotations": {"wasmplane.io/global": "true"}},
        "spec": {"clusterIP": "10.100.0.50", "clusterIPs": ["10.100.0.50"], "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}
    }))
    .unwrap();
    let east_slice = |ready: bool| -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-east1", "namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [EAST_POD], "conditions": {"ready": ready}, "nodeName": "east-1"},
                {"addresses": [EAST_POD_STARTING], "conditions": {"ready": false}, "nodeName": "east-1"},
            ]
        }))
        .unwrap()
    };
    east_api.create(&east_service).unwrap();
    east_api.create(&east_slice(true)).unwrap();
    let east_dir = tempfile::tempdir().unwrap();
    let east = wasmplane::app::start(HostConfig {
        kvstore: KvstoreConfig::etcd(vec![east_etcd.endpoint()]),
        kubernetes: Some(KubernetesSource::Url(east_api.url())),
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(east_dir.path().into()),
        token: Some("east-operator-token-0123456789".into()),
        operator: Some(wasmplane::operator_role::OperatorRoleConfig {
            identity: "east-operator".into(),
            cluster_name: Some("east".into()),
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .expect("east's operator");

    // East's export written, then east's etcd down: west must start without it.
    let export_key = "/wasmplane/clusters/east/services/default/web";
    let east_client = east_etcd.client().await.unwrap();
    let _ = eventually(
        "east's export",
        Duration::from_secs(20),
        || {
            let mut client = east_client.clone();
            async move {
                client
                    .get(export_key, None)
                    .await
                    .ok()
                    .and_then(|r| r.kvs().first().and_then(|kv| kv.value_str().ok().map(String::from)))
            }
        },
        |value| value.as_ref().is_some_and(|v| v.contains(EAST_POD)),
    )
    .await;
    east_etcd.stop().await.unwrap();

    let mut topo = Topology::new("glob");
    let west_pod = topo.add_pod(POD_A);
    let east_pod = topo.add_pod(EAST_POD);
    let client = topo.add_pod(CLIENT);
    let _servers = [Server::start(&west_pod, "west", &[8080]), Server::start(&east_pod, "east", &[8080])];
    let cluster = Cluster::new();
    let svc = Svc::new("web", "10.96.0.50", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]);
    let global = |yaml: String| {
        yaml.replacen(
            "metadata: { name: web, namespace: default }",
            "metadata: { name: web, namespace: default, annotations: { wasmplane.io/global: \"true\" } }",
            1,
        )
    };
    cluster.put_file("svc-web.yaml", &global(svc.yaml()));
    let west = start_host(HostConfig {
        kvstore: KvstoreConfig::etcd(vec![west_etcd.endpoint()]),
        agent: Some(wasmplane::agent::AgentConfig {
            cluster_name: Some("west".into()),
            clustermesh: wasmplane::clustermesh::ClusterMeshConfig {
                remotes: vec![wasmplane::clustermesh::RemoteEtcd {
                    cluster: "east".into(),
                    endpoints: vec![east_etcd.endpoint()],
                    tls: None,
                    user: None,
                }],
                ..Default::default()
            },
            ..Default::default()
        }),
        ..cluster.config(topo.nft_command())
    })
    .await;
    let to = addr("10.96.0.50", 80);
    wait_applied(&west, "west's own endpoint", |t| targets(t, POD_A));
    assert_backends("west's alone while east's etcd is down", &tcp_many(&client, to, MANY), &["west"]);
    let imports: serde_json::Value =
        reqwest::get(format!("{}/v1/cluster/services", west.url())).await.unwrap().json().await.unwrap();
    assert_eq!(imports["remote_clusters"], serde_json::json!([{"name": "east", "connected": false}]), "{imports}");
    let metric = |name: &'static str| {
        let url = format!("{}/metrics", west.url());
        async move {
            let text = reqwest::get(url).await.unwrap().text().await.unwrap();
            text.lines().find_map(|l| {
                l.strip_prefix(&format!("wasmplane_clustermesh_{name}{{cluster=\"east\"}} "))
                    .map(|v| v.trim().to_string())
            })
        }
    };
    assert_eq!(metric("remote_cluster_ready").await.as_deref(), Some("0"));
    east_etcd.restart().await.unwrap();

    wait_applied(&west, "east's ready endpoint", |t| targets(t, EAST_POD));
    assert_backends("both clusters' endpoints", &tcp_many(&client, to, MANY), &["east", "west"]);
    assert!(!targets(&applied(&west), EAST_POD_STARTING), "east's endpoint that is not ready is no backend");
    let imports: serde_json::Value =
        reqwest::get(format!("{}/v1/cluster/services", west.url())).await.unwrap().json().await.unwrap();
    assert_eq!(
        imports,
        serde_json::json!({"cluster": "west", "remote_clusters": [{"name": "east", "connected": true}], "imported": [{"cluster": "east", "namespace": "default", "name": "web", "endpoints": [EAST_POD]}]})
    );
    assert_eq!(
        (metric("remote_cluster_ready").await.as_deref(), metric("imported_endpoints").await.as_deref()),
        (Some("1"), Some("1"))
    );

    // East's pod stops being ready: its endpoint leaves west's rules.
    east_api.update(&east_slice(false)).unwrap();
    wait_applied(&west, "east's endpoint gone", |t| !targets(t, EAST_POD));
    assert_backends("west's alone", &tcp_many(&client, to, MANY), &["west"]);
    assert_eq!(metric("imported_endpoints").await.as_deref(), Some("0"), "east's endpoint is not ready");
    east_api.update(&east_slice(true)).unwrap();
    wait_applied(&west, "east's endpoint back", |t| targets(t, EAST_POD));

    // The Service here is no longer global: east's endpoints are not its backends, though
    // east still exports them.
    cluster.put(&svc);
    wait_applied(&west, "east's endpoint gone with the annotation", |t| !targets(t, EAST_POD));
    assert_backends("west's alone, not global", &tcp_many(&client, to, MANY), &["west"]);

    // Global with a cluster affinity: the preferred side alone while it has a ready endpoint.
    let with_affinity = |affinity: &str| {
        svc.yaml().replacen("metadata: { name: web, namespace: default }", &format!("metadata: {{ name: web, namespace: default, annotations: {{ wasmplane.io/global: \"true\", wasmplane.io/affinity: {affinity} }} }}"), 1)
    };
    cluster.put_file("svc-web.yaml", &with_affinity("remote"));
    wait_applied(&west, "remote affinity", |t| targets(t, EAST_POD) && !targets(t, POD_A));
    assert_backends("remote affinity", &tcp_many(&client, to, MANY), &["east"]);
    cluster.put_file("svc-web.yaml", &with_affinity("local"));
    wait_applied(&west, "local affinity", |t| targets(t, POD_A) && !targets(t, EAST_POD));
    assert_backends("local affinity", &tcp_many(&client, to, MANY), &["west"]);

    // Global again, with no endpoint of its own: east's alone serve it.
    let empty = Svc { endpoints: vec![], ..svc.clone() };
    cluster.put_file("svc-web.yaml", &global(empty.yaml()));
    wait_applied(&west, "east's endpoint alone", |t| targets(t, EAST_POD) && !targets(t, POD_A));
    assert_backends("east's alone", &tcp_many(&client, to, MANY), &["east"]);

    // East deletes its Service: its operator removes the export, west's rules follow.
    east_api.delete::<Service>("default", "web").unwrap();
    wait_applied(&west, "east's export removed", |t| !targets(t, EAST_POD));
    west.stop().await;
    east.stop().await;
}

/// kube-proxy's `--detect-local-mode NodeCIDR`: the node's pod CIDR (its Node object's,
/// node-a's 10.244.0.0/24), not a configured cluster CIDR, says which clients are local. A
/// pod in it keeps its source to a cluster IP; a client from another node's pod CIDR
/// (10.244.1.0/24) and one from outside are masqueraded. When the Node's pod CIDR moves,
/// the rules follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_cidr_local_detection_masquerades_what_is_not_this_nodes_pods() {
    require_root!();
    const OTHER_NODES_POD: &str = "10.244.1.50";
    let mut topo = Topology::new("ncidr");
    let pod_a = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let other = topo.add_pod(OTHER_NODES_POD);
    let _server = Server::start(&pod_a, "a", &[8080]);
    let cluster = Cluster::new();
    cluster.put(&Svc::new("web", "10.96.0.61", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]));
    let host = start_host(HostConfig {
        cluster_cidrs: vec![],
        local_detection: wasmplane::controller::LocalDetection::NodeCidr,
        ..cluster.config(topo.nft_command())
    })
    .await;
    wait_applied(&host, "the service and node-a's pod CIDR", |t| {
        serves(t, "10.96.0.61 . tcp . 80") && t.contains("cluster-cidrs { 10.244.0.0/24 }")
    });
    let to = addr("10.96.0.61", 80);
    let peer_seen_from = |ns: &str| in_ns(ns, || tcp_ask(to, TIMEOUT)).expect("an answer").peer;
    assert_eq!(peer_seen_from(&client), ip(CLIENT), "a pod of this node keeps its source");
    assert_eq!(peer_seen_from(&other), ip(POD_GATEWAY), "another node's pod is masqueraded");
    assert_eq!(peer_seen_from(&topo.external.name), ip(POD_GATEWAY), "an external client is masqueraded");

    // node-a's pod CIDR becomes 10.244.1.0/24: now the other client is the local one.
    cluster.put_file(
        "cluster.yaml",
        &NODES_YAML.replacen(
            "podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24]",
            "podCIDR: 10.244.1.0/24, podCIDRs: [10.244.1.0/24]",
            1,
        ),
    );
    wait_applied(&host, "the moved pod CIDR", |t| t.contains("cluster-cidrs { 10.244.1.0/24 }"));
    assert_eq!(peer_seen_from(&other), ip(OTHER_NODES_POD));
    assert_eq!(peer_seen_from(&client), ip(POD_GATEWAY));
    host.stop().await;
}

/// A cluster CIDR that holds none of the pods: in the interface modes of
/// `--detect-local-mode`, only the interface they come in on can make them local.
const NO_PODS_CIDR: &str = "10.99.0.0/16";

/// The host with `local_detection` (an interface mode) and [`NO_PODS_CIDR`], serving `web`'s
/// cluster IP 10.96.0.61 from pod a and `local`'s node port 30081 (externalTrafficPolicy
/// Local) from pod a and the remote pod; once the rules hold the host's off-cluster
/// masquerade as `rendered`.
async fn start_with_interface_detection(
    topo: &Topology,
    local_detection: wasmplane::controller::LocalDetection,
    rendered: &str,
) -> (Cluster, RunningHost) {
    let cluster = Cluster::new();
    cluster.put(&Svc::new("web", "10.96.0.61", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]));
    let mut local = Svc::new(
        "local",
        "10.96.0.62",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30081)],
        vec![ready(POD_A, NODE), ready(REMOTE_POD, OTHER_NODE)],
    );
    local.service_type = "NodePort";
    local.external_local = true;
    cluster.put(&local);
    let host = start_host(HostConfig {
        cluster_cidrs: vec![NO_PODS_CIDR.into()],
        local_detection,
        ..cluster.config(topo.nft_command())
    })
    .await;
    let masquerade = format!(
        "masquerade-check ip daddr . meta l4proto . th dport @masquerade-off-cluster {rendered} jump mark-for-masquerade"
    );
    let applied = wait_applied(&host, "the services", |t| {
        serves(t, "10.96.0.61 . tcp . 80") && t.contains("svc/default/local/tcp/http/local")
    });
    assert!(applied.contains(&masquerade), "no `{masquerade}` in:\n{applied}");
    assert!(
        applied.contains(&format!("cluster-cidrs {{ {NO_PODS_CIDR} }}")),
        "the configured cluster CIDR stays (WIT 1.0 guests'):\n{applied}"
    );
    (cluster, host)
}

/// `local`'s node port (see [`start_with_interface_detection`]): the pod `client` is
/// short-circuited to every endpoint with its own source (the guest's `pod-traffic` match),
/// the external client reaches this node's only, with its own source too (policy Local).
#[track_caller]
fn assert_policy_local_node_port(topo: &Topology, client: &str) {
    let replies = tcp_many(client, addr(NODE_EXTERNAL_IP, 30081), MANY);
    assert_backends("a pod at a policy-Local node port", &replies, &["a", "remote"]);
    assert_all("a pod at a policy-Local node port", &replies, |r| r.peer == ip(CLIENT));
    let replies = tcp_many(&topo.external.name, addr(NODE_EXTERNAL_IP, 30081), 12);
    assert_backends("external at a policy-Local node port", &replies, &["a"]);
    assert_all("external at a policy-Local node port", &replies, |r| r.peer == ip(EXTERNAL_CLIENT_IP));
}

/// kube-proxy's `--detect-local-mode InterfaceNamePrefix`: what comes in on an interface
/// named `vp…` (the node's side of every pod's veth) is the pods', whatever its source: the
/// cluster CIDR holds none of them. A pod keeps its source to a cluster IP, and at the node
/// port of a policy-Local service it is short-circuited to every endpoint (the guest's
/// `pod-traffic` match); the external client, in on `ext0`, is masqueraded to the cluster IP,
/// and reaches only this node's endpoint at that node port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interface_name_prefix_local_detection_keeps_pods_sources() {
    require_root!();
    let mut topo = Topology::new("ifpfx");
    let pod_a = topo.add_pod(POD_A);
    let remote = topo.add_pod(REMOTE_POD);
    let client = topo.add_pod(CLIENT);
    let _servers = [Server::start(&pod_a, "a", &[8080]), Server::start(&remote, "remote", &[8080])];
    let detection = wasmplane::controller::LocalDetection::InterfaceNamePrefix(POD_VETH_PREFIX.into());
    let (_cluster, host) =
        start_with_interface_detection(&topo, detection, &format!("iifname != \"{POD_VETH_PREFIX}*\"")).await;
    let peer_seen_from = |ns: &str, to: SocketAddr| in_ns(ns, || tcp_ask(to, TIMEOUT)).expect("an answer");
    assert_eq!(peer_seen_from(&client, addr("10.96.0.61", 80)).peer, ip(CLIENT), "a pod keeps its source");
    assert_eq!(
        peer_seen_from(&topo.external.name, addr("10.96.0.61", 80)).peer,
        ip(POD_GATEWAY),
        "the external client is masqueraded"
    );
    assert_policy_local_node_port(&topo, &client);
    host.stop().await;
}

/// kube-proxy's `--detect-local-mode BridgeInterface`: what comes in on the pods' bridge
/// (`cbr0`, kubenet's layout) is the pods', whatever its source; a pod on a veth of its own
/// (`vpN`, not on the bridge) is not, nor is the external client. As the prefix mode's test
/// otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_interface_local_detection_keeps_bridged_pods_sources() {
    require_root!();
    const BRIDGE: &str = "cbr0";
    const UNBRIDGED: &str = "10.244.0.102";
    let mut topo = Topology::new("ifbr");
    let pod_a = topo.add_bridged_pod(POD_A, BRIDGE);
    let remote = topo.add_bridged_pod(REMOTE_POD, BRIDGE);
    let client = topo.add_bridged_pod(CLIENT, BRIDGE);
    let unbridged = topo.add_pod(UNBRIDGED);
    let _servers = [Server::start(&pod_a, "a", &[8080]), Server::start(&remote, "remote", &[8080])];
    let detection = wasmplane::controller::LocalDetection::BridgeInterface(BRIDGE.into());
    let (_cluster, host) = start_with_interface_detection(&topo, detection, &format!("iifname != \"{BRIDGE}\"")).await;
    let peer_seen_from = |ns: &str, to: SocketAddr| in_ns(ns, || tcp_ask(to, TIMEOUT)).expect("an answer");
    assert_eq!(peer_seen_from(&client, addr("10.96.0.61", 80)).peer, ip(CLIENT), "a bridged pod keeps its source");
    assert_eq!(
        peer_seen_from(&unbridged, addr("10.96.0.61", 80)).peer,
        ip(POD_GATEWAY),
        "a pod off the bridge is masqueraded"
    );
    assert_eq!(
        peer_seen_from(&topo.external.name, addr("10.96.0.61", 80)).peer,
        ip(POD_GATEWAY),
        "the external client is masqueraded"
    );
    assert_policy_local_node_port(&topo, &client);
    host.stop().await;
}

/// The interface modes detect pods in every family, as kube-proxy's do, with no cluster
/// CIDR of it: on a dual-stack node whose `--cluster-cidr` is IPv4 only, an IPv6 client
/// from outside (in on `ext0`) reaching an IPv6 cluster IP is masqueraded, and an IPv6 pod
/// (behind its `vp…` veth) keeps its source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interface_name_prefix_local_detection_masquerades_ipv6_without_an_ipv6_cluster_cidr() {
    require_root!();
    let (topo, _pod_a, pod_b, _servers) = dual_stack_pods("ifpfx6");
    topo.node.exec(&["ip", "-6", "addr", "add", "fd00:77::1/64", "dev", "ext0", "nodad"]);
    topo.external.exec(&["ip", "-6", "addr", "add", "fd00:77::2/64", "dev", "eth0", "nodad"]);
    topo.external.exec(&["ip", "-6", "route", "add", "fd00:96::/108", "via", "fd00:77::1"]);
    let cluster = Cluster::new();
    // Pod a alone serves it: pod b, the client, never lands on itself (no hairpin).
    cluster.put(&Svc::new("six", "fd00:96::63", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A6, NODE)]));
    let detection = wasmplane::controller::LocalDetection::InterfaceNamePrefix(POD_VETH_PREFIX.into());
    let host = start_host(HostConfig {
        cluster_cidrs: vec![CLUSTER_CIDR.into()],
        local_detection: detection,
        ..cluster.config(topo.nft_command())
    })
    .await;
    let applied = wait_applied(&host, "the service", |t| serves(t, "fd00:96::63 . tcp . 80"));
    let masquerade = format!(
        "masquerade-check ip6 daddr . meta l4proto . th dport @masquerade-off-cluster6 iifname != \"{POD_VETH_PREFIX}*\" jump mark-for-masquerade"
    );
    assert!(applied.contains(&masquerade), "no `{masquerade}` in:\n{applied}");
    assert!(set_holds(&applied, "masquerade-off-cluster6", "fd00:96::63 . tcp . 80"), "{applied}");
    let to = addr("fd00:96::63", 80);
    let peer_seen_from = |ns: &str| in_ns(ns, || tcp_ask(to, TIMEOUT)).expect("an answer").peer;
    assert_eq!(peer_seen_from(&pod_b), ip(POD_B6), "an IPv6 pod keeps its source");
    assert_eq!(peer_seen_from(&topo.external.name), ip(POD_GATEWAY6), "the IPv6 external client is masqueraded");
    host.stop().await;
}

/// A pod's `ports[].hostPort` manifest: `(containerPort, protocol, hostPort, hostIP)` each.
fn hostport_pod(name: &str, node: &str, ip: Option<&str>, ports: &[(u16, &str, u16, Option<&str>)]) -> String {
    let ports: Vec<String> = ports
        .iter()
        .map(|(port, protocol, host_port, host_ip)| {
            let host_ip = host_ip.map(|ip| format!(", hostIP: {ip}")).unwrap_or_default();
            format!("{{ containerPort: {port}, protocol: {protocol}, hostPort: {host_port}{host_ip} }}")
        })
        .collect();
    let status = ip
        .map(|ip| format!("status: {{ phase: Running, podIP: {ip}, podIPs: [{{ ip: {ip} }}] }}\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{ name: {name}, namespace: default }}\nspec: {{ nodeName: {node}, containers: [{{ name: c, image: x, ports: [{}] }}] }}\n{status}---\n",
        ports.join(", ")
    )
}

/// `hostPort` (the CNI portmap plugin's job elsewhere) from the Pod objects, written by the
/// host whatever translator is in force: a pod's host ports on every local address of the
/// node (TCP and UDP), one with `hostIP` on that address only, a pod reaching its own host
/// port masqueraded, loopback not served. Host ports come before node ports (a node port
/// that is also a pod's host port goes to that pod here), and node ports keep working beside
/// them. The pods come after the host started (incremental netlink batches); a pod's
/// addresses from the CNI daemon serve its host ports before the API server reports them;
/// a translator hot swap keeps them; a deleted pod's ports refuse at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostport_forwards_node_ports_of_its_pod_and_closes_when_the_pod_goes() {
    require_root!();
    const SECOND_IP: &str = "192.168.77.9";
    let mut topo = Topology::new("hostport");
    let pod_a = topo.add_pod(POD_A);
    let pod_b = topo.add_pod(POD_B);
    let pod_c = topo.add_pod(POD_C);
    let client = topo.add_pod(CLIENT);
    let _servers =
        [Server::start(&pod_a, "a", &[8080]), Server::start(&pod_b, "b", &[8080]), Server::start(&pod_c, "c", &[8080])];
    topo.node.exec(&["ip", "addr", "add", &format!("{SECOND_IP}/24"), "dev", "ext0"]);
    let cluster = Cluster::new();
    let mut node_port = Svc::new(
        "np",
        "10.96.0.80",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30070)],
        vec![ready(POD_C, NODE)],
    );
    node_port.service_type = "NodePort";
    cluster.put(&node_port);
    let mut taken = Svc::new(
        "taken",
        "10.96.0.81",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30071)],
        vec![ready(POD_C, NODE)],
    );
    taken.service_type = "NodePort";
    cluster.put(&taken);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the node ports", |t| {
        t.contains("tcp . 30070 : goto nodeport-dispatch") && t.contains("tcp . 30071 : goto nodeport-dispatch")
    });
    let ext = topo.external.name.clone();
    assert_backends("the node port before any host port", &tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30071), 3), &["c"]);

    // Pod a: host ports on every address; pod b: on the second address only, and no address
    // from the API server yet; a pod of another node: nothing here.
    let pod_a_yaml = hostport_pod(
        "a",
        NODE,
        Some(POD_A),
        &[(8080, "TCP", 18080, None), (8080, "UDP", 18053, Some("0.0.0.0")), (8080, "TCP", 30071, None)],
    );
    let others = hostport_pod("b", NODE, None, &[(8080, "TCP", 18081, Some(SECOND_IP))])
        + &hostport_pod("remote", OTHER_NODE, Some(REMOTE_POD), &[(8080, "TCP", 18082, None)]);
    cluster.put_file("pods.yaml", &format!("{pod_a_yaml}{others}"));
    wait_applied(&host, "pod a's host ports", |t| {
        set_holds(t, "hostports-any", "tcp . 18080 : 10.244.0.11 . 8080")
            && set_holds(t, "hostports-any", "udp . 18053 : 10.244.0.11 . 8080")
    });
    let b = wasmplane_model::ObjectKey::new("default", "b");
    host.controller.lock().unwrap().set_pod_network(&b, Some(vec![POD_B.to_string()]), &[]).unwrap();
    let applied = wait_applied(&host, "pod b's host port from its CNI address", |t| {
        set_holds(t, "hostports", &format!("{SECOND_IP} . tcp . 18081 : 10.244.0.12 . 8080"))
    });
    assert!(!applied.contains("18082") && !applied.contains(REMOTE_POD), "another node's pod:\n{applied}");
    let table = topo.table();
    assert!(
        set_holds(&table, "hostports-any", "tcp . 18080 : 10.244.0.11 . 8080")
            && set_holds(&table, "hairpin", "10.244.0.11 . 10.244.0.11"),
        "{table}"
    );
    let errors = host.metrics.syncs.get_or_create(&wasmplane::metrics::ResultLabels { result: "error".into() }).get();
    let batches = host
        .metrics
        .dataplane_transactions
        .get_or_create(&wasmplane::metrics::PathLabels { path: "netlink".into() })
        .get();
    assert!(
        errors == 0 && batches > 0,
        "every change written, as netlink batches: {errors} refused, {batches} batches"
    );

    // From outside, on any local address, TCP and UDP; the client keeps its address.
    for node_ip in [NODE_EXTERNAL_IP, SECOND_IP] {
        let replies = tcp_many(&ext, addr(node_ip, 18080), 5);
        assert_backends(&format!("TCP host port on {node_ip}"), &replies, &["a"]);
        assert_all("TCP host port", &replies, |r| r.port == 8080 && r.peer == ip(EXTERNAL_CLIENT_IP));
        assert_backends(&format!("UDP host port on {node_ip}"), &udp_many(&ext, addr(node_ip, 18053), 5), &["a"]);
    }
    // From another pod, from the node itself, and from the pod itself (masqueraded, or its
    // reply would go straight back to itself un-NATed).
    let replies = tcp_many(&client, addr(NODE_EXTERNAL_IP, 18080), 5);
    assert_backends("a pod to the host port", &replies, &["a"]);
    assert_all("a pod to the host port", &replies, |r| r.peer == ip(CLIENT));
    assert_backends("the node to its host port", &tcp_many(&topo.node.name, addr(NODE_EXTERNAL_IP, 18080), 5), &["a"]);
    let replies = tcp_many(&pod_a, addr(NODE_EXTERNAL_IP, 18080), 5);
    assert_backends("hairpin through the host port", &replies, &["a"]);
    assert_all("hairpin through the host port", &replies, |r| r.peer == ip(POD_GATEWAY));
    assert_backends("hairpin UDP through the host port", &udp_many(&pod_a, addr(NODE_EXTERNAL_IP, 18053), 5), &["a"]);
    // Loopback is not served (as node ports).
    let started = Instant::now();
    assert_refused_fast(
        "the host port on loopback",
        topo.node.run(|| tcp_ask(addr("127.0.0.1", 18080), TIMEOUT)),
        started,
        false,
    );

    // hostIP: that address only.
    assert_backends("the host port on its hostIP", &tcp_many(&ext, addr(SECOND_IP, 18081), 5), &["b"]);
    let started = Instant::now();
    assert_refused_fast(
        "the host port on another address",
        topo.external.run(|| tcp_ask(addr(NODE_EXTERNAL_IP, 18081), TIMEOUT)),
        started,
        false,
    );
    let started = Instant::now();
    assert_refused_fast(
        "another node's pod's host port",
        topo.external.run(|| tcp_ask(addr(NODE_EXTERNAL_IP, 18082), TIMEOUT)),
        started,
        false,
    );

    // Node ports beside them; one that is also pod a's host port goes to pod a on this node.
    assert_backends("a node port beside host ports", &tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30070), 5), &["c"]);
    assert_backends("a node port that is a host port", &tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30071), 5), &["a"]);

    // Pod a goes: its ports close at once (nothing listens on the node), the node port is
    // the service's again, pod b keeps its port.
    cluster.put_file("pods.yaml", &others);
    wait_applied(&host, "pod a's host ports gone", |t| {
        !t.contains("10.244.0.11 . 8080") && !t.contains("10.244.0.11 . 10.244.0.11")
    });
    let table = topo.table();
    for gone in ["18080", "18053", "10.244.0.11 . 10.244.0.11"] {
        assert!(!table.contains(gone), "{gone} still in the kernel:\n{table}");
    }
    let started = Instant::now();
    assert_refused_fast(
        "TCP host port after the pod went",
        topo.external.run(|| tcp_ask(addr(NODE_EXTERNAL_IP, 18080), TIMEOUT)),
        started,
        false,
    );
    let started = Instant::now();
    assert_refused_fast(
        "UDP host port after the pod went",
        topo.external.run(|| udp_ask(addr(NODE_EXTERNAL_IP, 18053), TIMEOUT)),
        started,
        false,
    );
    assert_backends(
        "the node port after the host port went",
        &tcp_many(&ext, addr(NODE_EXTERNAL_IP, 30071), 5),
        &["c"],
    );
    assert_backends("the other pod's host port", &tcp_many(&ext, addr(SECOND_IP, 18081), 3), &["b"]);

    // A hot swap of the translator rewrites the whole table: the host ports go in with it.
    let response = reqwest::Client::new()
        .put(format!("{}/v1/modules/swapped?kind=service-translator", host.url()))
        .bearer_auth(&host.token)
        .body(wasmplane_guest_artifacts::test_programs::TRAP_ON_LABEL.to_vec())
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "upload: {}", response.text().await.unwrap_or_default());
    let in_force = || host.controller.lock().unwrap_or_else(|p| p.into_inner()).active_translator();
    wait_for("the swapped translator in force", Duration::from_secs(10), in_force, |t| {
        t.as_ref().is_some_and(|(name, _)| name == "swapped")
    });
    let table = topo.table();
    assert!(set_holds(&table, "hostports", &format!("{SECOND_IP} . tcp . 18081 : 10.244.0.12 . 8080")), "{table}");
    assert_backends("a host port after a hot swap", &tcp_many(&ext, addr(SECOND_IP, 18081), 3), &["b"]);
    host.stop().await;
}

/// Host ports of a dual-stack pod: on the node's IPv6 address too (the pod's IPv6 address
/// behind it), an IPv6 `hostIP` on that address only, and a pod reaching its own host port
/// over IPv6 masqueraded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostport_of_a_dual_stack_pod_serves_ipv6_too() {
    require_root!();
    const NODE6: &str = "fd00:77::1";
    let (topo, pod_a, _pod_b, _servers) = dual_stack_pods("hostport6");
    topo.node.exec(&["ip", "-6", "addr", "add", &format!("{NODE6}/64"), "dev", "ext0", "nodad"]);
    topo.external.exec(&["ip", "-6", "addr", "add", "fd00:77::2/64", "dev", "eth0", "nodad"]);
    topo.external.exec(&["ip", "-6", "route", "add", "default", "via", NODE6]);
    let cluster = Cluster::new();
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{ name: a, namespace: default }}\n\
         spec: {{ nodeName: {NODE}, containers: [{{ name: c, image: x, ports: [{{ containerPort: 8080, hostPort: 18080 }}, {{ containerPort: 8080, hostPort: 18081, hostIP: \"{NODE6}\" }}] }}] }}\n\
         status: {{ phase: Running, podIP: {POD_A}, podIPs: [{{ ip: {POD_A} }}, {{ ip: \"{POD_A6}\" }}] }}\n"
    );
    cluster.put_file("pods.yaml", &pod);
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "pod a's host ports", |t| {
        set_holds(t, "hostports-any6", &format!("tcp . 18080 : {POD_A6} . 8080"))
            && set_holds(t, "hostports6", &format!("{NODE6} . tcp . 18081 : {POD_A6} . 8080"))
    });
    let ext = topo.external.name.clone();
    let replies = tcp_many(&ext, addr(NODE6, 18080), 5);
    assert_backends("the host port on the node's IPv6 address", &replies, &["a"]);
    assert_all("the host port on the node's IPv6 address", &replies, |r| r.peer == ip("fd00:77::2"));
    assert_backends(
        "the host port on the node's IPv4 address",
        &tcp_many(&ext, addr(NODE_EXTERNAL_IP, 18080), 5),
        &["a"],
    );
    assert_backends("the IPv6 hostIP", &tcp_many(&ext, addr(NODE6, 18081), 5), &["a"]);
    let started = Instant::now();
    assert_refused_fast(
        "the IPv6 hostIP's port on IPv4",
        topo.external.run(|| tcp_ask(addr(NODE_EXTERNAL_IP, 18081), TIMEOUT)),
        started,
        false,
    );
    let replies = tcp_many(&pod_a, addr(NODE6, 18080), 5);
    assert_backends("IPv6 hairpin through the host port", &replies, &["a"]);
    assert_all("IPv6 hairpin through the host port", &replies, |r| r.peer == ip(POD_GATEWAY6));
    host.stop().await;
}

/// Pod egress masquerade (`--egress-masquerade`, on where this host is the pods' CNI): a new
/// connection from a pod of this node out of the cluster leaves with the node's address (the
/// outside routes no pod address back); one to a pod or a service keeps the pod's address,
/// which policies on the other end match; a pod of another node's CIDR is left to its own
/// node. The sources follow this node's Node object (its pod CIDR 10.244.0.0/24); a
/// non-masquerade CIDR keeps the pod's address out there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_egress_out_of_the_cluster_leaves_with_the_nodes_address() {
    require_root!();
    let mut topo = Topology::new("egr");
    let server_pod = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let other_nodes_pod = topo.add_pod(REMOTE_POD);
    let _servers = [Server::start(&server_pod, "a", &[8080]), Server::start(&topo.external.name, "outside", &[8080])];
    let cluster = Cluster::new();
    cluster.put(&Svc::new("web", "10.96.0.10", vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]));
    let egress = |sources: &[&str], keep: &[&str]| wasmplane::nft::EgressMasquerade {
        sources: sources.iter().map(|c| c.parse().unwrap()).collect(),
        keep_source: keep.iter().map(|c| c.parse().unwrap()).collect(),
        ..Default::default()
    };
    let outside = addr(EXTERNAL_CLIENT_IP, 8080);
    let ask = |ns: &str, to: SocketAddr, udp: bool| {
        in_ns(ns, || if udp { udp_ask(to, Duration::from_secs(2)) } else { tcp_ask(to, Duration::from_secs(2)) })
            .map(|r| r.peer)
    };

    let host = start_host(HostConfig {
        egress_masquerade: Some(egress(&[], &[CLUSTER_CIDR])),
        ..cluster.config(topo.nft_command())
    })
    .await;
    wait_applied(&host, "the web service", |t| serves(t, "10.96.0.10 . tcp . 80"));
    // Until the Node object's pod CIDR is in force nothing is masqueraded (the outside routes
    // back to this test's node, so the connection works and tells the source).
    let _ = wait_for(
        "the pod CIDR's egress masqueraded",
        Duration::from_secs(10),
        || ask(&client, outside, false),
        |peer| matches!(peer, Ok(p) if *p == ip(NODE_EXTERNAL_IP)),
    );
    assert_eq!(ask(&client, outside, true).unwrap(), ip(NODE_EXTERNAL_IP), "UDP out of the cluster");
    assert_eq!(ask(&client, addr(POD_A, 8080), false).unwrap(), ip(CLIENT), "to a pod: the pod's own address");
    assert_eq!(
        ask(&client, addr("10.96.0.10", 80), false).unwrap(),
        ip(CLIENT),
        "to a service's pod: the pod's own address"
    );
    assert_eq!(
        ask(&other_nodes_pod, outside, false).unwrap(),
        ip(REMOTE_POD),
        "another node's pod CIDR is its node's to masquerade"
    );
    // From the node itself: not a pod, untouched.
    assert_eq!(ask(&topo.node.name, outside, false).unwrap(), ip(NODE_EXTERNAL_IP));
    host.stop().await;

    // The external network is a non-masquerade CIDR (it routes the pod CIDRs): the pod's
    // address reaches it; configured pod CIDRs need no Node object.
    let host = start_host(HostConfig {
        egress_masquerade: Some(egress(&["10.244.0.0/24"], &[CLUSTER_CIDR, "192.168.77.0/24"])),
        ..cluster.config(topo.nft_command())
    })
    .await;
    let _ = wait_for(
        "the non-masquerade CIDR in force",
        Duration::from_secs(10),
        || ask(&client, outside, false),
        |peer| matches!(peer, Ok(p) if *p == ip(CLIENT)),
    );
    assert!(topo.table().contains("192.168.77.0/24"), "{}", topo.table());
    host.stop().await;

    // Off: the rules go with a full write, the pod's address leaves as it is.
    let host = start_host(cluster.config(topo.nft_command())).await;
    wait_applied(&host, "the web service", |t| serves(t, "10.96.0.10 . tcp . 80"));
    wait_for("egress masquerade off", Duration::from_secs(10), || topo.table(), |t| !t.contains("@egress-sources"));
    assert_eq!(ask(&client, outside, false).unwrap(), ip(CLIENT));
    host.stop().await;
}
