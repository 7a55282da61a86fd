//! The service side's drops and rejects, logged to the policy verdict log's NFLOG group and
//! read back through the whole host: services from the manifest source, the host's writer in
//! a node namespace, real connections from a pod and an "external" namespace, and
//! `GET /v1/drops` naming the service and port each drop was for (`wasmplane drops` too).
//!
//! Needs root (namespaces, nftables); skips LOUDLY otherwise.

mod support;

use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::cluster::*;
use support::echo::*;
use support::netns::*;
use support::set_holds;
use wasmplane::app::{HostConfig, RunningHost};

const POD_A: &str = "10.244.0.11";
const CLIENT: &str = "10.244.0.100";
const REMOTE_POD: &str = "10.244.1.21";
const EMPTY: &str = "10.96.0.40";
const WEB: &str = "10.96.0.41";
const UNALLOCATED: &str = "10.96.0.99";
const GROUP: u16 = 1001;

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// The client as a pod of the model (its drops are named by it).
const CLIENT_POD: &str = "\
apiVersion: v1
kind: Pod
metadata: { name: client, namespace: default, labels: { app: client } }
spec: { nodeName: node-a, containers: [{ name: c, image: x }] }
status: { phase: Running, podIP: 10.244.0.100, podIPs: [{ ip: 10.244.0.100 }] }
";

async fn get(host: &RunningHost, path_and_query: &str) -> (StatusCode, Value) {
    let response = reqwest::get(format!("{}{path_and_query}", host.url())).await.unwrap();
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// `GET /v1/drops{query}` until one of its events passes `wanted` (the kernel's log reaches
/// the host a moment after the packet); that event.
async fn drop_event(host: &RunningHost, query: &str, wanted: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..50 {
        let (status, answer) = get(host, &format!("/v1/drops{query}")).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        if let Some(event) = answer["events"].as_array().and_then(|events| events.iter().find(|e| wanted(e))) {
            return event.clone();
        }
        last = answer;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("GET /v1/drops{query}: no such event within 5 s: {last}");
}

/// A service event's (reason, service, port name, destination, destination port).
fn described(event: &Value) -> (&str, Option<&str>, Option<&str>, &str, Option<u64>) {
    (
        event["reason"].as_str().unwrap_or("?"),
        event["service"].as_str(),
        event["port_name"].as_str(),
        event["destination"].as_str().unwrap_or("?"),
        event["destination_port"].as_u64(),
    )
}

#[track_caller]
fn assert_refused<T: std::fmt::Debug>(what: &str, result: std::io::Result<T>, started: Instant) {
    match result {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
        other => panic!("{what}: expected connection refused, got {other:?} after {:?}", started.elapsed()),
    }
}

/// One UDP datagram from inside `ns` to `to`, from a port the kernel picks: what came back
/// (an ICMP port unreachable reads as "connection refused") and the source port it left from.
fn udp_probe(ns: &str, to: SocketAddr) -> (std::io::Result<usize>, u16) {
    in_ns(ns, || {
        let socket = UdpSocket::bind(if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }).unwrap();
        let source_port = socket.local_addr().unwrap().port();
        socket.connect(to).unwrap();
        socket.set_read_timeout(Some(TIMEOUT)).unwrap();
        let answer = socket.send(b"who\n").and_then(|_| socket.recv(&mut [0u8; 512]));
        (answer, source_port)
    })
}

/// Whether a TCP connection from inside `ns` to `to` goes unanswered (dropped, not refused).
fn dropped(ns: &str, to: SocketAddr) -> bool {
    let result = in_ns(ns, || tcp_ask(to, Duration::from_millis(300)));
    matches!(&result, Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_drops_are_logged_with_their_reason_and_named_by_service() {
    require_root!();
    let mut topo = Topology::new("sdrop");
    let pod_a = topo.add_pod(POD_A);
    let client = topo.add_pod(CLIENT);
    let _server = Server::start(&pod_a, "a", &[8080]);
    topo.external.exec(&["ip", "route", "add", &format!("{LOAD_BALANCER_IP}/32"), "via", NODE_EXTERNAL_IP]);
    let ext = topo.external.name.clone();

    let cluster = Cluster::new();
    cluster.put_file("pods.yaml", CLIENT_POD);
    // No endpoint at all: rejected, on the cluster IP and the node port.
    let mut empty = Svc::new("empty", EMPTY, vec![Port::new("http", "TCP", 80, 8080).node_port(30040)], vec![]);
    empty.service_type = "NodePort";
    cluster.put(&empty);
    // Served on 80, so 81 is a port none of its services has.
    cluster.put(&Svc::new("web", WEB, vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A, NODE)]));
    // Traffic policy Local, its only endpoint on the other node: the node port drops.
    let mut elsewhere = Svc::new(
        "elsewhere",
        "10.96.0.42",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30082)],
        vec![ready(REMOTE_POD, OTHER_NODE)],
    );
    elsewhere.service_type = "NodePort";
    elsewhere.external_local = true;
    cluster.put(&elsewhere);
    // A load balancer open to the external network only.
    let mut guarded =
        Svc::new("guarded", "10.96.0.43", vec![Port::new("https", "TCP", 443, 8080)], vec![ready(POD_A, NODE)]);
    guarded.service_type = "LoadBalancer";
    guarded.load_balancer_ip = Some(LOAD_BALANCER_IP);
    guarded.source_ranges = vec!["192.168.77.0/24"];
    cluster.put(&guarded);
    let host = start_host(HostConfig {
        policy_log_group: GROUP,
        service_cidrs: vec!["10.96.0.0/16".into()],
        ..cluster.config(topo.nft_command())
    })
    .await;
    wait_applied(&host, "the services", |t| {
        t.contains(&format!("{EMPTY} . tcp . 80 : goto reject-chain"))
            && t.contains("tcp . 30082 : goto drop-chain")
            && set_holds(t, "firewall-ips", &format!("{LOAD_BALANCER_IP} . tcp . 443"))
            && t.contains(&format!("{WEB} . tcp . 80 : goto"))
    });
    let table = topo.table();
    assert!(table.contains("log prefix \"wasmplane-service no-endpoints\" group 1001"), "{table}");

    // Served traffic logs nothing, and no drop is logged before one happens.
    assert_backends("the served port", &tcp_many(&client, addr(WEB, 80), 5), &["a"]);
    assert_backends(
        "the load balancer from inside its ranges",
        &tcp_many(&ext, addr(LOAD_BALANCER_IP, 443), 3),
        &["a"],
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, nothing) = get(&host, "/v1/drops").await;
    assert_eq!(nothing["events"], json!([]), "served traffic logs no drop: {nothing}");
    assert!(
        nothing["totals"]["service_drops"].as_object().is_some_and(|t| t.len() == 5 && t.values().all(|n| n == 0)),
        "{nothing}"
    );

    // No endpoints: a real connect is refused, and the drop names the service and port.
    let started = Instant::now();
    assert_refused("pod → a service without endpoints", in_ns(&client, || tcp_ask(addr(EMPTY, 80), TIMEOUT)), started);
    let event = drop_event(&host, "?service=default/empty", |e| e["reason"] == "no-endpoints").await;
    assert_eq!(described(&event), ("no-endpoints", Some("default/empty"), Some("http"), EMPTY, Some(80)), "{event}");
    assert_eq!(
        (event["kind"].as_str(), event["source"].as_str(), event["pod"].as_str(), event["protocol"].as_str()),
        (Some("service"), Some(CLIENT), Some("default/client"), Some("tcp")),
        "{event}"
    );
    // Its node port, from outside: named by the node port.
    let started = Instant::now();
    assert_refused(
        "external → the node port of a service without endpoints",
        in_ns(&ext, || tcp_ask(addr(NODE_EXTERNAL_IP, 30040), TIMEOUT)),
        started,
    );
    let event = drop_event(&host, "?reason=no-endpoints", |e| e["destination_port"] == 30040).await;
    assert_eq!(
        described(&event),
        ("no-endpoints", Some("default/empty"), Some("http"), NODE_EXTERNAL_IP, Some(30040)),
        "{event}"
    );

    // A cluster IP's port no service has: refused, logged as such, the service named.
    let started = Instant::now();
    assert_refused("pod → a cluster IP's unknown port", in_ns(&client, || tcp_ask(addr(WEB, 81), TIMEOUT)), started);
    let event = drop_event(&host, "?reason=unknown-port", |_| true).await;
    assert_eq!(described(&event), ("unknown-port", Some("default/web"), None, WEB, Some(81)), "{event}");

    // An address of the service CIDR that is no service's: dropped, no service to name.
    assert!(dropped(&client, addr(UNALLOCATED, 80)), "an unallocated service address is dropped");
    let event = drop_event(&host, "?reason=unallocated", |_| true).await;
    assert_eq!(described(&event), ("unallocated", None, None, UNALLOCATED, Some(80)), "{event}");

    // Outside the load balancer's source ranges.
    assert!(dropped(&client, addr(LOAD_BALANCER_IP, 443)), "a pod is outside the ranges");
    let event = drop_event(&host, "?service=default/guarded", |_| true).await;
    assert_eq!(
        described(&event),
        ("source-range", Some("default/guarded"), Some("https"), LOAD_BALANCER_IP, Some(443)),
        "{event}"
    );

    // Traffic policy Local, no endpoint here: the node port drops (through the drop chain).
    assert!(dropped(&ext, addr(NODE_EXTERNAL_IP, 30082)), "no local endpoint: dropped");
    let event = drop_event(&host, "?reason=no-local-endpoints", |_| true).await;
    assert_eq!(
        described(&event),
        ("no-local-endpoints", Some("default/elsewhere"), Some("http"), NODE_EXTERNAL_IP, Some(30082)),
        "{event}"
    );
    assert_eq!(event["source"], EXTERNAL_CLIENT_IP, "{event}");

    // Served traffic still logs nothing: the served port, after all these drops.
    let (_, before) = get(&host, "/v1/drops?limit=1024").await;
    assert_backends("the served port again", &tcp_many(&client, addr(WEB, 80), 5), &["a"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, after) = get(&host, "/v1/drops?limit=1024").await;
    assert_eq!(after["totals"], before["totals"], "a served connection logged a drop: {after}");
    assert!(
        after["events"].as_array().unwrap().iter().all(|e| e["destination_port"] != 80 || e["destination"] != WEB),
        "{after}"
    );

    // Filters: the client pod's drops are those it sent; limit and since cut the newest.
    let (_, of_client) = get(&host, "/v1/drops?pod=default/client&limit=1024").await;
    let events = of_client["events"].as_array().unwrap();
    assert!(!events.is_empty() && events.iter().all(|e| e["source"] == CLIENT), "{of_client}");
    assert!(
        events.iter().any(|e| e["reason"] == "unknown-port")
            && !events.iter().any(|e| e["reason"] == "no-local-endpoints"),
        "{of_client}"
    );
    let (_, newest) = get(&host, "/v1/drops?limit=1").await;
    assert_eq!(newest["events"].as_array().map(Vec::len), Some(1), "{newest}");
    assert_eq!(newest["events"][0]["reason"], "no-local-endpoints", "newest first: {newest}");
    let newest_ms = newest["events"][0]["at_unix_ms"].as_u64().unwrap();
    let (_, since) = get(&host, &format!("/v1/drops?since_unix_ms={newest_ms}&limit=1024")).await;
    let since = since["events"].as_array().unwrap().clone();
    assert!(!since.is_empty() && since.len() < after["events"].as_array().unwrap().len(), "{since:?}");
    assert!(since.iter().all(|e| e["at_unix_ms"].as_u64() >= Some(newest_ms)), "{since:?}");
    let (_, later) = get(&host, &format!("/v1/drops?since_unix_ms={}", newest_ms + 60_000)).await;
    assert_eq!(later["events"], json!([]), "{later}");
    let (_, unknown_ports) = get(&host, "/v1/drops?reason=unknown-port&limit=1024").await;
    assert!(
        unknown_ports["events"].as_array().unwrap().iter().all(|e| e["reason"] == "unknown-port"),
        "{unknown_ports}"
    );

    // Bad filters: a reason of no such name, a service or pod that is not here.
    let (status, answer) = get(&host, "/v1/drops?reason=dropped").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    let (status, answer) = get(&host, "/v1/drops?service=default/nowhere").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    assert!(answer["error"].as_str().is_some_and(|e| e.contains("no service default/nowhere")), "{answer}");
    let (status, _) = get(&host, "/v1/drops?service=nonsense").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = get(&host, "/v1/drops?pod=default/nobody").await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // The policy verdicts stay the policy's; the status and the metrics count by reason.
    let (_, verdicts) = get(&host, "/v1/policies/verdicts?limit=1024").await;
    assert_eq!(verdicts["events"], json!([]), "service drops are no policy verdicts: {verdicts}");
    assert_eq!(verdicts["totals"], json!({ "deny": 0, "audit": 0, "allow": 0, "lost": 0 }), "{verdicts}");
    let (_, status) = get(&host, "/v1/status").await;
    assert!(
        status["service_drops"]["unknown-port"].as_u64() >= Some(1)
            && status["service_drops"]["no-endpoints"].as_u64() >= Some(2),
        "{status}"
    );
    let metrics = reqwest::get(format!("{}/metrics", host.url())).await.unwrap().text().await.unwrap();
    let logged = |reason: &str| {
        metrics.lines().find_map(|l| {
            l.strip_prefix(&format!("wasmplane_service_drops_logged_total{{reason=\"{reason}\"}} "))?
                .parse::<u64>()
                .ok()
        })
    };
    assert!(logged("source-range") >= Some(1) && logged("unallocated") >= Some(1), "{metrics}");

    // The CLI: one line per drop, the service named.
    let api = wasmplane::cli::ApiArgs { api: host.url(), token: None, token_file: None };
    let args = wasmplane::inspect::DropsArgs {
        service: Some("default/empty".into()),
        pod: None,
        reason: None,
        limit: 5,
        follow: false,
    };
    let mut printed = Vec::new();
    wasmplane::inspect::drops_to(&api, args, &mut printed).await.unwrap();
    let printed = String::from_utf8(printed).unwrap();
    assert!(
        printed.contains(&format!("REJECT  service  default/empty:http  {CLIENT}:"))
            && printed.contains(&format!(" -> {EMPTY}:80 tcp  reason: no-endpoints")),
        "{printed}"
    );
    assert!(
        printed.lines().last().is_some_and(
            |l| l.contains("shown; since the host started: deny 0, audit 0") && l.contains("no-endpoints ")
        ),
        "{printed}"
    );
    host.stop().await;
}

const POD_A6: &str = "fd00:10:244::11";
const CLIENT6: &str = "fd00:10:244::100";
const EMPTY6: &str = "fd00:96::40";
const WEB6: &str = "fd00:96::41";
/// In `fd00:96::/108`, the IPv6 service CIDR [`Topology::enable_ipv6`] routes to the node.
const UNALLOCATED6: &str = "fd00:96::99";

/// The client as a dual-stack pod of the model (its IPv6 drops are named by it too).
const CLIENT_POD6: &str = "\
apiVersion: v1
kind: Pod
metadata: { name: client, namespace: default, labels: { app: client } }
spec: { nodeName: node-a, containers: [{ name: c, image: x }] }
status: { phase: Running, podIP: 10.244.0.100, podIPs: [{ ip: 10.244.0.100 }, { ip: 'fd00:10:244::100' }] }
";

/// The same drops over IPv6, from a dual-stack pod: an IPv6 cluster IP without endpoints
/// (TCP and UDP), another port of a served IPv6 cluster IP, an address of the IPv6 service
/// CIDR that is no service's; each logged with its IPv6 addresses and named by service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_service_drops_are_logged_with_their_ipv6_addresses() {
    require_root!();
    let mut topo = Topology::new("sdrop6");
    topo.enable_ipv6();
    let pod_a = topo.add_dual_stack_pod(POD_A, POD_A6);
    let client = topo.add_dual_stack_pod(CLIENT, CLIENT6);
    let _server = Server::start_dual_stack(&pod_a, "a", &[8080]);

    let cluster = Cluster::new();
    cluster.put_file("pods.yaml", CLIENT_POD6);
    cluster.put(&Svc::new(
        "empty6",
        EMPTY6,
        vec![Port::new("http", "TCP", 80, 8080), Port::new("dns", "UDP", 53, 8080)],
        vec![],
    ));
    cluster.put(&Svc::new("web6", WEB6, vec![Port::new("http", "TCP", 80, 8080)], vec![ready(POD_A6, NODE)]));
    let config = HostConfig {
        policy_log_group: GROUP,
        service_cidrs: vec!["10.96.0.0/16".into(), "fd00:96::/108".into()],
        ..cluster.config(topo.nft_command())
    };
    let host = start_host(config).await;
    wait_applied(&host, "the services", |t| {
        t.contains(&format!("{EMPTY6} . tcp . 80 : goto reject-chain"))
            && t.contains(&format!("{EMPTY6} . udp . 53 : goto reject-chain"))
            && t.contains(&format!("{WEB6} . tcp . 80 : goto"))
    });
    let table = topo.table();
    assert!(set_holds(&table, "service-cidrs6", "fd00:96::/108"), "{table}");

    // Served IPv6 traffic logs nothing.
    assert_backends("the served IPv6 port", &tcp_many(&client, addr(WEB6, 80), 5), &["a"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, nothing) = get(&host, "/v1/drops").await;
    assert_eq!(nothing["events"], json!([]), "served IPv6 traffic logs no drop: {nothing}");

    // No endpoints, over TCP: refused, logged with the pod's IPv6 address.
    let started = Instant::now();
    assert_refused(
        "pod → an IPv6 cluster IP without endpoints",
        in_ns(&client, || tcp_ask(addr(EMPTY6, 80), TIMEOUT)),
        started,
    );
    let event =
        drop_event(&host, "?service=default/empty6", |e| e["reason"] == "no-endpoints" && e["protocol"] == "tcp").await;
    assert_eq!(described(&event), ("no-endpoints", Some("default/empty6"), Some("http"), EMPTY6, Some(80)), "{event}");
    assert_eq!(
        (event["kind"].as_str(), event["source"].as_str(), event["pod"].as_str()),
        (Some("service"), Some(CLIENT6), Some("default/client")),
        "{event}"
    );
    assert!(event["source_port"].as_u64().is_some_and(|p| p != 0), "{event}");

    // No endpoints, over UDP: the ICMPv6 port unreachable refuses it; both ports logged.
    let started = Instant::now();
    let (answer, source_port) = udp_probe(&client, addr(EMPTY6, 53));
    assert_refused("UDP pod → an IPv6 cluster IP without endpoints", answer, started);
    let event = drop_event(&host, "?service=default/empty6", |e| e["protocol"] == "udp").await;
    assert_eq!(described(&event), ("no-endpoints", Some("default/empty6"), Some("dns"), EMPTY6, Some(53)), "{event}");
    assert_eq!(
        (event["source"].as_str(), event["source_port"].as_u64(), event["pod"].as_str()),
        (Some(CLIENT6), Some(u64::from(source_port)), Some("default/client")),
        "{event}"
    );

    // A port of the IPv6 cluster IP that no service has: refused, the service named.
    let started = Instant::now();
    assert_refused(
        "pod → an IPv6 cluster IP's unknown port",
        in_ns(&client, || tcp_ask(addr(WEB6, 81), TIMEOUT)),
        started,
    );
    let event = drop_event(&host, "?reason=unknown-port", |_| true).await;
    assert_eq!(described(&event), ("unknown-port", Some("default/web6"), None, WEB6, Some(81)), "{event}");
    assert_eq!((event["source"].as_str(), event["protocol"].as_str()), (Some(CLIENT6), Some("tcp")), "{event}");

    // An address of the IPv6 service CIDR that is no service's: dropped, no service named.
    assert!(dropped(&client, addr(UNALLOCATED6, 80)), "an unallocated IPv6 service address is dropped");
    let event = drop_event(&host, "?reason=unallocated", |_| true).await;
    assert_eq!(described(&event), ("unallocated", None, None, UNALLOCATED6, Some(80)), "{event}");
    assert_eq!((event["source"].as_str(), event["protocol"].as_str()), (Some(CLIENT6), Some("tcp")), "{event}");

    // The client's drops, by pod: every one from its IPv6 address.
    let (_, of_client) = get(&host, "/v1/drops?pod=default/client&limit=1024").await;
    let events = of_client["events"].as_array().unwrap();
    assert!(events.len() >= 4 && events.iter().all(|e| e["source"] == CLIENT6), "{of_client}");

    // Served IPv6 traffic still logs nothing after the drops.
    let (_, before) = get(&host, "/v1/drops?limit=1024").await;
    assert_backends("the served IPv6 port again", &tcp_many(&client, addr(WEB6, 80), 5), &["a"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, after) = get(&host, "/v1/drops?limit=1024").await;
    assert_eq!(after["totals"], before["totals"], "a served IPv6 connection logged a drop: {after}");
    host.stop().await;
}

/// UDP over IPv4: a datagram to a cluster IP's UDP port of a service without endpoints is
/// rejected (the client reads the ICMP port unreachable as "refused") and logged as UDP with
/// both its ports; one to a UDP port the cluster IP does not have is an unknown port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_udp_reject_is_logged_with_its_protocol_and_ports() {
    require_root!();
    let mut topo = Topology::new("sdropu");
    let client = topo.add_pod(CLIENT);
    let cluster = Cluster::new();
    cluster.put_file("pods.yaml", CLIENT_POD);
    cluster.put(&Svc::new("dns", EMPTY, vec![Port::new("dns", "UDP", 53, 5353)], vec![]));
    let host = start_host(HostConfig { policy_log_group: GROUP, ..cluster.config(topo.nft_command()) }).await;
    wait_applied(&host, "the service", |t| t.contains(&format!("{EMPTY} . udp . 53 : goto reject-chain")));

    let started = Instant::now();
    let (answer, source_port) = udp_probe(&client, addr(EMPTY, 53));
    assert_refused("UDP pod → a service without endpoints", answer, started);
    let event = drop_event(&host, "?service=default/dns", |e| e["reason"] == "no-endpoints").await;
    assert_eq!(described(&event), ("no-endpoints", Some("default/dns"), Some("dns"), EMPTY, Some(53)), "{event}");
    assert_eq!(
        (
            event["kind"].as_str(),
            event["protocol"].as_str(),
            event["source"].as_str(),
            event["source_port"].as_u64(),
            event["pod"].as_str()
        ),
        (Some("service"), Some("udp"), Some(CLIENT), Some(u64::from(source_port)), Some("default/client")),
        "{event}"
    );

    // The same cluster IP on a UDP port it does not have.
    let started = Instant::now();
    let (answer, source_port) = udp_probe(&client, addr(EMPTY, 54));
    assert_refused("UDP pod → a cluster IP's unknown port", answer, started);
    let event = drop_event(&host, "?reason=unknown-port", |_| true).await;
    assert_eq!(described(&event), ("unknown-port", Some("default/dns"), None, EMPTY, Some(54)), "{event}");
    assert_eq!(
        (event["protocol"].as_str(), event["source_port"].as_u64()),
        (Some("udp"), Some(u64::from(source_port))),
        "{event}"
    );
    host.stop().await;
}

/// Each frontend's drops are logged at their own rate: a service flooded with datagrams it
/// rejects logs at most its burst and rate, and the drops of another service between them
/// are all logged. (With one rate for the whole node, the flood used up the log: the quiet
/// service's drops went unlogged.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooded_service_does_not_use_up_another_services_drop_log() {
    require_root!();
    const QUIET: &str = "10.96.0.44";
    let mut topo = Topology::new("sdropf");
    let client = topo.add_pod(CLIENT);
    // The kernel limits the ICMP errors it sends a peer (about one a second after a burst of
    // six), which would leave most of the flood's rejects unanswered; every one is answered here.
    topo.node.sysctl("net.ipv4.icmp_ratemask", "0");
    let cluster = Cluster::new();
    cluster.put_file("pods.yaml", CLIENT_POD);
    cluster.put(&Svc::new("noisy", EMPTY, vec![Port::new("dns", "UDP", 53, 5353)], vec![]));
    cluster.put(&Svc::new("quiet", QUIET, vec![Port::new("dns", "UDP", 53, 5353)], vec![]));
    let host = start_host(HostConfig { policy_log_group: GROUP, ..cluster.config(topo.nft_command()) }).await;
    wait_applied(&host, "the services", |t| {
        t.contains(&format!("{EMPTY} . udp . 53 : goto reject-chain"))
            && t.contains(&format!("{QUIET} . udp . 53 : goto reject-chain"))
    });

    // 20 datagrams to the noisy service for each one to the quiet one, five times: 100 in
    // a burst the default rate (10/s, bursts of 20) logs a fraction of.
    const ROUNDS: usize = 5;
    const FLOOD: usize = 20;
    let started = Instant::now();
    for _ in 0..ROUNDS {
        for _ in 0..FLOOD {
            assert_refused("UDP → the noisy service", udp_probe(&client, addr(EMPTY, 53)).0, started);
        }
        assert_refused("UDP → the quiet service", udp_probe(&client, addr(QUIET, 53)).0, started);
    }
    let flood_seconds = started.elapsed().as_secs_f64();
    // Every quiet drop reaches the host (the kernel sends the log within 100 ms).
    let count = |answer: &Value, service: &str| {
        answer["events"].as_array().map_or(0, |e| e.iter().filter(|e| e["service"] == service).count())
    };
    let mut answer = Value::Null;
    for _ in 0..50 {
        answer = get(&host, "/v1/drops?limit=1024").await.1;
        if count(&answer, "default/quiet") >= ROUNDS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        count(&answer, "default/quiet"),
        ROUNDS,
        "every drop of the quiet service is logged beside the flood: {answer}"
    );
    // The noisy one is held to its own rate: its burst, plus 10 a second while it lasted.
    let noisy = count(&answer, "default/noisy");
    let allowed = 20 + (10.0 * (flood_seconds + 0.5)).ceil() as usize;
    assert!(
        (1..=allowed).contains(&noisy),
        "{noisy} of {} noisy drops logged in {flood_seconds:.2} s (at most {allowed}): {answer}",
        ROUNDS * FLOOD
    );
    host.stop().await;
}

/// Without a log group the ruleset has no log rule and no drop chain: the no-endpoint maps'
/// drops stay plain drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_log_group_nothing_is_logged_or_read() {
    require_root!();
    let topo = Topology::new("sdrop0");
    let cluster = Cluster::new();
    let mut elsewhere = Svc::new(
        "elsewhere",
        "10.96.0.42",
        vec![Port::new("http", "TCP", 80, 8080).node_port(30082)],
        vec![ready(REMOTE_POD, OTHER_NODE)],
    );
    elsewhere.service_type = "NodePort";
    elsewhere.external_local = true;
    cluster.put(&elsewhere);
    let host = start_host(HostConfig { policy_log_group: 0, ..cluster.config(topo.nft_command()) }).await;
    wait_applied(&host, "the service", |t| t.contains("tcp . 30082 : drop"));
    let table = topo.table();
    assert!(!table.contains(" log ") && !table.contains("drop-chain"), "{table}");
    let (status, answer) = get(&host, "/v1/drops").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{answer}");
    host.stop().await;
}

#[track_caller]
fn assert_backends(what: &str, replies: &[std::io::Result<Reply>], expected: &[&str]) {
    let mut seen: Vec<&str> =
        replies.iter().map(|r| r.as_ref().unwrap_or_else(|e| panic!("{what}: {e}")).identity.as_str()).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen, expected, "{what}");
}
