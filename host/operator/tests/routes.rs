//! Routes to other nodes' pod CIDRs, programmed in real network namespaces.
//!
//! Three "nodes" are namespaces joined by veths to a bridge in a fourth; each
//! runs a registry and a route sync into its namespace over one embedded
//! kvstore. Checked with iproute2 in the namespaces: routes appear for the other
//! nodes, come back after being deleted by hand, leave when a node leaves, and a
//! route we do not own is never touched. Needs root; skips loudly otherwise.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use wasmplane_kvstore::{EmbeddedStore, KvStore};
use wasmplane_operator::{DEFAULT_ROUTE_PROTOCOL, NodeRegistry, NodeRegistryConfig, RouteConfig, RouteSync};

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Namespaces made by this test, deleted on drop (also when it fails).
struct Namespaces(Vec<String>);

impl Namespaces {
    fn add(&mut self, name: String) -> String {
        ip(&["netns", "add", &name]);
        self.0.push(name.clone());
        name
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// `(destination, gateway)` of the routes of protocol `proto` in `ns`.
fn routes(ns: &str, proto: &str) -> BTreeSet<(String, String)> {
    ip(&["-n", ns, "route", "show", "proto", proto])
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let via = words.iter().position(|w| *w == "via")?;
            Some((words[0].to_owned(), words.get(via + 1)?.to_string()))
        })
        .collect()
}

fn route(dst: &str, via: &str) -> (String, String) {
    (dst.to_owned(), via.to_owned())
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_follow_the_node_registry_in_namespaces() {
    init_tracing();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // Straight to the stderr handle: libtest captures eprintln! of passing tests.
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"SKIPPED routes_follow_the_node_registry_in_namespaces: needs root to create network namespaces\n",
        );
        return;
    }
    let tag = format!("wpop{}", std::process::id() % 100_000);
    let mut namespaces = Namespaces(Vec::new());
    let switch = namespaces.add(format!("{tag}sw"));
    ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]);
    ip(&["-n", &switch, "link", "set", "br0", "up"]);
    let mut node_ns = Vec::new();
    for i in 1..=3 {
        let ns = namespaces.add(format!("{tag}n{i}"));
        let port = format!("sw{i}");
        ip(&["-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", &switch]);
        ip(&["-n", &switch, "link", "set", &port, "master", "br0", "up"]);
        ip(&["-n", &ns, "addr", "add", &format!("192.168.77.{i}/24"), "dev", "eth0"]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        node_ns.push(ns);
    }
    // A route someone else owns, to a CIDR node 4 will claim.
    ip(&["-n", &node_ns[0], "route", "add", "10.244.9.0/24", "via", "192.168.77.3", "proto", "static"]);

    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let registry_config = NodeRegistryConfig { lease_ttl: Duration::from_secs(2), ..NodeRegistryConfig::default() };
    let mut registries = Vec::new();
    let mut syncs = Vec::new();
    for i in 1..=3u32 {
        let registry = Arc::new(
            NodeRegistry::join(
                store.clone(),
                registry_config.clone(),
                &format!("node-{i}"),
                vec![format!("192.168.77.{i}").parse().unwrap()],
                vec![format!("10.244.{i}.0/24").parse().unwrap()],
            )
            .await
            .expect("join"),
        );
        let config = RouteConfig {
            netns: Some(PathBuf::from(format!("/run/netns/{}", node_ns[i as usize - 1]))),
            protocol: DEFAULT_ROUTE_PROTOCOL,
            resync_interval: Duration::from_millis(500),
        };
        syncs.push(RouteSync::start(registry.clone(), config).await.expect("route sync starts"));
        registries.push(registry);
    }
    let proto = DEFAULT_ROUTE_PROTOCOL.to_string();
    let (n1, n2, n3) = (&node_ns[0], &node_ns[1], &node_ns[2]);

    // Each node routes the others' CIDRs, never its own.
    let expect_n1 = BTreeSet::from([route("10.244.2.0/24", "192.168.77.2"), route("10.244.3.0/24", "192.168.77.3")]);
    let expect_n2 = BTreeSet::from([route("10.244.1.0/24", "192.168.77.1"), route("10.244.3.0/24", "192.168.77.3")]);
    let expect_n3 = BTreeSet::from([route("10.244.1.0/24", "192.168.77.1"), route("10.244.2.0/24", "192.168.77.2")]);
    eventually("every node routes the others' pod CIDRs", || {
        routes(n1, &proto) == expect_n1 && routes(n2, &proto) == expect_n2 && routes(n3, &proto) == expect_n3
    })
    .await;
    // The process's own namespace was not touched.
    let host_routes = ip(&["route", "show", "proto", &proto]);
    assert!(!host_routes.contains("10.244."), "routes leaked into the host namespace: {host_routes}");

    // A route deleted behind our back comes back at the next reconcile.
    ip(&["-n", n1, "route", "del", "10.244.2.0/24"]);
    eventually("the deleted route is repaired", || routes(n1, &proto) == expect_n1).await;

    // Node 4 claims a CIDR node 1 already has a foreign route for: node 1 reports
    // it and leaves the foreign route alone; node 2 routes it.
    let node4 = NodeRegistry::join(
        store.clone(),
        registry_config.clone(),
        "node-4",
        vec!["192.168.77.4".parse().unwrap()],
        vec!["10.244.9.0/24".parse().unwrap()],
    )
    .await
    .expect("join node-4");
    eventually("node 2 routes node 4's CIDR", || routes(n2, &proto).contains(&route("10.244.9.0/24", "192.168.77.4")))
        .await;
    eventually("node 1 reports the conflicting route", || {
        syncs[0].report().errors.iter().any(|e| e.contains("10.244.9.0/24"))
    })
    .await;
    assert_eq!(routes(n1, "static"), BTreeSet::from([route("10.244.9.0/24", "192.168.77.3")]));
    assert_eq!(routes(n1, &proto), expect_n1);

    // Node 3 leaves: its CIDR is unrouted everywhere; node 4 leaves too.
    let node3 = registries.remove(2);
    drop(syncs.remove(2));
    // The route sync's follower holds the registry until its abort lands.
    eventually("the route sync released node 3's registry", || Arc::strong_count(&node3) == 1).await;
    Arc::try_unwrap(node3).ok().expect("only holder").leave().await.unwrap();
    node4.leave().await.unwrap();
    eventually("node 3's and node 4's routes are gone", || {
        routes(n1, &proto) == BTreeSet::from([route("10.244.2.0/24", "192.168.77.2")])
            && routes(n2, &proto) == BTreeSet::from([route("10.244.1.0/24", "192.168.77.1")])
    })
    .await;
    // The foreign route survived all of it.
    assert_eq!(routes(n1, "static"), BTreeSet::from([route("10.244.9.0/24", "192.168.77.3")]));
    drop(syncs);
    drop(namespaces);
}
