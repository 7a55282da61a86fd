//! The agent's cluster duties through the whole host, on a real etcd: each host registers
//! its node (IDs 1 and 2, kept across a restart), programs a route to the other node's pod
//! CIDR in its own network namespace (made by the test), drops it when that node's lease
//! runs out, and reports the kvstore unhealthy in `/readyz` while the operator's heartbeat
//! is stale. And the kvstore over TLS with client certificates, this cluster's etcd and a
//! remote cluster's, each with its own CA (the only tests here that need no root).

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use support::cluster::{NODES_YAML, eventually, wait_for};
use support::netns::{Netns, require_root};
use support::rest::node_config;
use wasmplane::agent::AgentConfig;
use wasmplane::app::{HostConfig, KvstoreConfig, RunningHost, start};
use wasmplane::cli::ApiArgs;
use wasmplane::clustermesh::ClusterMeshConfig;
use wasmplane::inspect::NodeCommand;
use wasmplane_kvstore::EtcdTlsFiles;
use wasmplane_operator::{CLUSTERS_PREFIX, HEARTBEAT_KEY, NodeRegistryConfig, write_heartbeats};
use wasmplane_test_etcd::{Etcd, TestPki};

async fn host(dir: &Path, node: &str, etcd: &Etcd, netns: &Netns, heartbeat_max_age: Option<Duration>) -> RunningHost {
    start(HostConfig {
        agent: Some(AgentConfig {
            routes: true,
            route_netns: Some(format!("/var/run/netns/{}", netns.name).into()),
            heartbeat_max_age,
            // A node that stops renewing is gone within seconds (production: 15 s).
            registry: NodeRegistryConfig { lease_ttl: Duration::from_secs(2), ..Default::default() },
            cluster_name: None,
            clustermesh: Default::default(),
        }),
        ..node_config(dir, node, etcd, "agent-test-token-0123456789", "nodes.yaml", NODES_YAML)
    })
    .await
    .unwrap()
}

async fn nodes_view(host: &RunningHost) -> Value {
    reqwest::get(format!("{}/v1/cluster/nodes", host.url())).await.unwrap().json().await.unwrap()
}

/// What `wasmplane node ls` prints against `host`'s API.
async fn node_ls(host: &RunningHost) -> String {
    let api = ApiArgs { api: host.url(), token: None, token_file: None };
    let mut shown = Vec::new();
    wasmplane::inspect::node_to(&api, NodeCommand::Ls, &mut shown).await.unwrap();
    String::from_utf8(shown).unwrap()
}

/// A table's lines as their cells (three spaces apart).
fn cells(table: &str) -> Vec<Vec<&str>> {
    table.lines().map(|l| l.split("   ").map(str::trim).filter(|c| !c.is_empty()).collect()).collect()
}

fn routes_in(ns: &Netns) -> String {
    ns.exec(&["ip", "-4", "route", "show"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_register_route_to_each_other_and_forget_a_node_that_leaves() {
    require_root!("network namespaces, routes");
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    // Two node namespaces on one link: each can reach the other's node IP, the gateway of
    // the route to its pods.
    let tag = std::process::id();
    let (ns_a, ns_b) = (Netns::new(format!("agent-a-{tag}")), Netns::new(format!("agent-b-{tag}")));
    let (veth_a, veth_b) = (format!("ag{tag}a"), format!("ag{tag}b"));
    support::netns::run(&[
        "ip", "link", "add", &veth_a, "netns", &ns_a.name, "type", "veth", "peer", "name", &veth_b, "netns", &ns_b.name,
    ]);
    for (ns, dev, ip) in [(&ns_a, &veth_a, "192.168.77.1/24"), (&ns_b, &veth_b, "192.168.77.3/24")] {
        ns.exec(&["ip", "addr", "add", ip, "dev", dev]);
        ns.exec(&["ip", "link", "set", dev, "up"]);
    }

    let a = host(dir.path(), "node-a", &etcd, &ns_a, None).await;
    let b = host(dir.path(), "node-b", &etcd, &ns_b, None).await;
    let a_view = nodes_view(&a).await;
    let b_view = nodes_view(&b).await;
    assert_eq!(
        (a_view["node_id"].as_u64(), b_view["node_id"].as_u64()),
        (Some(1), Some(2)),
        "first free positive integers: {a_view} {b_view}"
    );

    // Each routes the other's pod CIDR via the other's node IP, once the manifests
    // published the addresses.
    wait_for(
        "node-a's route to node-b's pods",
        Duration::from_secs(10),
        || routes_in(&ns_a),
        |r| r.contains("10.244.1.0/24 via 192.168.77.3"),
    );
    wait_for(
        "node-b's route to node-a's pods",
        Duration::from_secs(10),
        || routes_in(&ns_b),
        |r| r.contains("10.244.0.0/24 via 192.168.77.1"),
    );
    assert!(!routes_in(&ns_a).contains("10.244.0.0/24 via"), "a node never routes its own pod CIDR away");
    let view = eventually(
        "node-a's view of node-b",
        Duration::from_secs(10),
        || nodes_view(&a),
        |v| v["nodes"]["node-b"]["podCidrs"][0] == "10.244.1.0/24",
    )
    .await;
    assert_eq!(view["routes"]["applied"][0]["cidr"], "10.244.1.0/24", "{view}");
    // `wasmplane node ls` on node-a: both nodes, node-b's pods routed via its address.
    let table = node_ls(&a).await;
    assert_eq!(
        cells(&table),
        [
            vec!["NAME", "ID", "ADDRESSES", "POD CIDRS", "ROUTE"],
            vec!["node-a", "1", "192.168.77.1", "10.244.0.0/24", "(this node)"],
            vec!["node-b", "2", "192.168.77.3", "10.244.1.0/24", "via 192.168.77.3"],
        ],
        "{table}"
    );

    // node-b stops (its lease is no longer renewed): node-a's route to it goes.
    b.stop().await;
    wait_for(
        "node-a's route to node-b removed",
        Duration::from_secs(15),
        || routes_in(&ns_a),
        |r| !r.contains("10.244.1.0/24"),
    );

    // node-b comes back: same ID (kept in the kvstore under its name), route back.
    let b = host(dir.path(), "node-b", &etcd, &ns_b, None).await;
    assert_eq!(nodes_view(&b).await["node_id"].as_u64(), Some(2));
    wait_for(
        "node-a's route to node-b again",
        Duration::from_secs(10),
        || routes_in(&ns_a),
        |r| r.contains("10.244.1.0/24 via 192.168.77.3"),
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_the_kvstore_unhealthy_while_the_heartbeat_is_stale() {
    require_root!("network namespaces");
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let ns = Netns::new(format!("agent-hb-{}", std::process::id()));
    let host = host(dir.path(), "node-a", &etcd, &ns, Some(Duration::from_secs(2))).await;
    let readyz = || async {
        reqwest::get(format!("{}/readyz", host.url()))
            .await
            .map(|r| async { (r.status(), r.text().await.unwrap()) })
            .unwrap()
            .await
    };
    let (status, body) = eventually("unready without an operator", Duration::from_secs(10), readyz, |(s, _)| {
        *s == StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    assert!(body.contains("heartbeat"), "{status}: {body}");

    // An operator's heartbeat (the operator crate's own writer) makes it ready.
    let kv: Arc<dyn wasmplane_kvstore::KvStore> = KvstoreConfig::etcd(vec![etcd.endpoint()]).open(None).await.unwrap();
    let writer =
        tokio::spawn(write_heartbeats(kv, HEARTBEAT_KEY.into(), "operator-0".into(), Duration::from_millis(500)));
    eventually("ready with a fresh heartbeat", Duration::from_secs(10), readyz, |(s, _)| *s == StatusCode::OK).await;
    // The operator stops: stale again after the max age.
    writer.abort();
    let (_, body) = eventually("unready once the heartbeat is stale", Duration::from_secs(10), readyz, |(s, _)| {
        *s == StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    assert!(body.contains("heartbeat is"), "{body}");
    host.stop().await;
}

/// What an etcd started with `start_tls` asks of a client: its CA, and a certificate of it.
fn client_tls(pki: &TestPki) -> EtcdTlsFiles {
    EtcdTlsFiles {
        trusted_ca_file: pki.ca.clone(),
        cert_file: Some(pki.client_cert.clone()),
        key_file: Some(pki.client_key.clone()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kvstore_and_remote_clusters_are_reached_over_tls_and_the_clustermesh_directory_is_followed() {
    let mut etcd = Etcd::start_tls().await.expect("etcd-server must be installed (scripts/setup.sh)");
    // This cluster's etcd has its authentication on: the host is an etcd user allowed
    // `/wasmplane/` only, which is all it may need.
    etcd.enable_auth("root-pw", "agent", "agent-pw", "/wasmplane/").await.unwrap();
    let agent_user = Some(wasmplane_kvstore::EtcdUser { name: "agent".into(), password: "agent-pw".into() });
    let east = Etcd::start_tls().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let stranger = TestPki::generate(&dir.path().join("stranger"), "stranger").unwrap();
    // Cilium's clustermesh directory: one file per cluster, and the files they name.
    let mesh = dir.path().join("mesh");
    std::fs::create_dir(&mesh).unwrap();
    let east_pki = east.pki().unwrap();
    let install = |client: &TestPki| {
        std::fs::copy(&east_pki.ca, mesh.join("east-ca.crt")).unwrap();
        std::fs::copy(&client.client_cert, mesh.join("east.crt")).unwrap();
        std::fs::copy(&client.client_key, mesh.join("east.key")).unwrap();
    };
    let east_file = format!(
        "endpoints: [{}]\ntrusted-ca-file: east-ca.crt\ncert-file: east.crt\nkey-file: east.key\n",
        east.endpoint()
    );
    // "north" is east's etcd reached with this cluster's CA and certificate, which east's
    // etcd does not trust (and whose CA does not vouch for east's server).
    let own_pki = etcd.pki().unwrap();
    std::fs::write(
        mesh.join("north"),
        format!(
            "endpoints: [{}]\ntrusted-ca-file: {}\ncert-file: {}\nkey-file: {}\n",
            east.endpoint(),
            own_pki.ca.display(),
            own_pki.client_cert.display(),
            own_pki.client_key.display()
        ),
    )
    .unwrap();

    let base = node_config(dir.path(), "node-a", &etcd, "agent-tls-token-0123456789", "nodes.yaml", NODES_YAML);
    // The Service here that east's endpoints join.
    support::rest::write_manifest(
        &dir.path().join("node-a-manifests"),
        "web.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: { name: web, namespace: default, annotations: { wasmplane.io/global: \"true\" } }\nspec: { clusterIP: 10.96.1.10, ports: [{ port: 80, targetPort: 8080, protocol: TCP }] }\n",
    );
    let own = KvstoreConfig::Etcd {
        endpoints: vec![etcd.endpoint()],
        tls: Some(client_tls(own_pki)),
        user: agent_user.clone(),
    };
    let config = |kvstore: KvstoreConfig| HostConfig {
        kvstore,
        agent: Some(AgentConfig {
            cluster_name: Some("west".into()),
            clustermesh: ClusterMeshConfig {
                dir: Some(mesh.clone()),
                poll: Duration::from_millis(200),
                ..Default::default()
            },
            ..Default::default()
        }),
        ..base.clone()
    };

    // A TLS file that is not there stops the start, naming it.
    let mut missing = client_tls(own_pki);
    missing.key_file = Some(dir.path().join("absent-key.pem"));
    let refused = start(config(KvstoreConfig::Etcd {
        endpoints: vec![etcd.endpoint()],
        tls: Some(missing),
        user: agent_user.clone(),
    }))
    .await
    .err()
    .expect("a missing key file is refused");
    assert!(format!("{refused:#}").contains("absent-key.pem"), "{refused:#}");

    let host = start(config(own.clone())).await.unwrap();
    // The node registered itself in this cluster's etcd, over TLS.
    assert_eq!(nodes_view(&host).await["node_id"].as_u64(), Some(1));
    let registered =
        own.open(None).await.unwrap().list_prefix(wasmplane_operator::nodes::NODE_INFO_PREFIX).await.unwrap();
    assert_eq!(
        registered.items.iter().map(|kv| kv.key.as_str()).collect::<Vec<_>>(),
        [format!("{}node-a", wasmplane_operator::nodes::NODE_INFO_PREFIX)]
    );

    // East exports a service in its own etcd; nobody follows east yet.
    let export = serde_json::json!({"cluster": "east", "namespace": "default", "name": "web", "clusterIps": ["10.96.1.10"], "ports": [{"port": 80, "protocol": "TCP"}], "endpointSlices": [{"ports": [{"port": 8080, "protocol": "TCP"}], "addresses": ["10.245.0.7"]}]});
    let east_kv = KvstoreConfig::Etcd { endpoints: vec![east.endpoint()], tls: Some(client_tls(east_pki)), user: None }
        .open(None)
        .await
        .unwrap();
    east_kv.put(&format!("{CLUSTERS_PREFIX}east/services/default/web"), export.to_string().into(), None).await.unwrap();
    let services = || async {
        reqwest::get(format!("{}/v1/cluster/services", host.url())).await.unwrap().json::<Value>().await.unwrap()
    };
    let imported_from_east =
        serde_json::json!([{"cluster": "east", "namespace": "default", "name": "web", "endpoints": ["10.245.0.7"]}]);
    let view = services().await;
    assert_eq!(
        (&view["remote_clusters"], &view["imported"]),
        (&serde_json::json!([{"name": "north", "connected": false}]), &serde_json::json!([])),
        "{view}"
    );

    // East's file appears (as a Secret's update would bring it): followed over TLS.
    install(east_pki);
    std::fs::write(mesh.join("east"), &east_file).unwrap();
    let connected =
        |east: bool| serde_json::json!([{"name": "east", "connected": east}, {"name": "north", "connected": false}]);
    let view = eventually("east followed once its file is there", Duration::from_secs(15), services, |v| {
        v["imported"] == imported_from_east
    })
    .await;
    assert_eq!(view["remote_clusters"], connected(true), "north's handshake fails: {view}");
    // The model's own count: the REST view lists imports, this is what the guests get.
    let east_endpoints = || {
        let controller = host.controller.lock().unwrap();
        controller
            .cluster()
            .slices_of(&wasmplane_model::ObjectKey::new("default", "web"))
            .filter(|s| s.cluster.as_deref() == Some("east"))
            .map(|s| s.endpoints.len())
            .sum::<usize>()
    };
    assert_eq!(east_endpoints(), 1);

    // Its client certificate is rotated (to one east does not trust): reconnected, and what
    // it had imported stays while the new connection fails, as in an outage.
    install(&stranger);
    let view = eventually("east reconnected with the new certificate", Duration::from_secs(15), services, |v| {
        v["remote_clusters"] == connected(false)
    })
    .await;
    assert_eq!(view["imported"], imported_from_east, "{view}");
    install(east_pki);
    eventually("east connected again", Duration::from_secs(15), services, |v| v["remote_clusters"] == connected(true))
        .await;

    // East's file goes: its endpoints go with it.
    std::fs::remove_file(mesh.join("east")).unwrap();
    let view =
        eventually("east dropped", Duration::from_secs(15), services, |v| v["imported"] == serde_json::json!([])).await;
    assert_eq!(view["remote_clusters"], serde_json::json!([{"name": "north", "connected": false}]), "{view}");
    assert_eq!(east_endpoints(), 0, "east's endpoints left the model with its file");
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_clusters_nodes_are_routed_while_their_cluster_is_followed() {
    require_root!("network namespaces, routes");
    let (etcd, east) =
        (Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)"), Etcd::start().await.unwrap());
    let dir = tempfile::tempdir().unwrap();
    // West's node-a and a node of east on one link (native routing between the clusters).
    let tag = std::process::id();
    let (ns_a, ns_e) = (Netns::new(format!("mesh-a-{tag}")), Netns::new(format!("mesh-e-{tag}")));
    let (veth_a, veth_e) = (format!("mr{tag}a"), format!("mr{tag}e"));
    support::netns::run(&[
        "ip", "link", "add", &veth_a, "netns", &ns_a.name, "type", "veth", "peer", "name", &veth_e, "netns", &ns_e.name,
    ]);
    for (ns, dev, ip) in [(&ns_a, &veth_a, "192.168.78.1/24"), (&ns_e, &veth_e, "192.168.78.5/24")] {
        ns.exec(&["ip", "addr", "add", ip, "dev", dev]);
        ns.exec(&["ip", "link", "set", dev, "up"]);
    }
    let mesh = dir.path().join("mesh");
    std::fs::create_dir(&mesh).unwrap();
    let host = start(HostConfig {
        agent: Some(AgentConfig {
            routes: true,
            route_netns: Some(format!("/var/run/netns/{}", ns_a.name).into()),
            cluster_name: Some("west".into()),
            clustermesh: ClusterMeshConfig {
                dir: Some(mesh.clone()),
                poll: Duration::from_millis(200),
                ..Default::default()
            },
            ..Default::default()
        }),
        // Pod egress masquerade keeps the pod's address to east's pods (outside this
        // cluster's CIDR here).
        egress_masquerade: Some(wasmplane::nft::EgressMasquerade {
            sources: vec!["10.244.0.0/24".parse().unwrap()],
            keep_source: vec!["10.244.0.0/21".parse().unwrap()],
            ..Default::default()
        }),
        ..node_config(dir.path(), "node-a", &etcd, "agent-mesh-token-0123456789", "nodes.yaml", NODES_YAML)
    })
    .await
    .unwrap();
    // The IPv4 destinations this node's pods reach with their own address.
    let kept = || {
        let dataplane = host.controller.lock().unwrap().dataplane().render();
        dataplane
            .lines()
            .find(|l| l.starts_with("add element ") && l.contains(" egress-keep-source {"))
            .unwrap_or_default()
            .to_string()
    };
    assert!(kept().contains("10.244.0.0/21") && !kept().contains("10.244.8.0/24"), "{}", kept());

    // East's node registers in east's own etcd, as east's agent does (the same name as a
    // node of west: clusters name their nodes independently).
    let east_kv = KvstoreConfig::etcd(vec![east.endpoint()]).open(None).await.unwrap();
    let lease = NodeRegistryConfig { lease_ttl: Duration::from_secs(2), ..Default::default() };
    let east_node = wasmplane_operator::NodeRegistry::join(
        east_kv.clone(),
        lease.clone(),
        "node-a",
        vec!["192.168.78.5".parse().unwrap()],
        vec!["10.244.8.0/24".parse().unwrap()],
    )
    .await
    .unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert!(!routes_in(&ns_a).contains("10.244.8.0/24"), "east is not followed yet");

    // East's clustermesh file appears: its node's pod CIDR is routed via its node IP.
    std::fs::write(mesh.join("east"), format!("endpoints: [{}]\n", east.endpoint())).unwrap();
    wait_for(
        "a route to east's pods",
        Duration::from_secs(15),
        || routes_in(&ns_a),
        |r| r.contains("10.244.8.0/24 via 192.168.78.5"),
    );
    let view = nodes_view(&host).await;
    assert_eq!(view["remote_nodes"]["east"]["node-a"]["podCidrs"], serde_json::json!(["10.244.8.0/24"]), "{view}");
    // `wasmplane node ls`: east's node in its own rows, not taken for this one of its name.
    let table = eventually(
        "east's node routed in node ls",
        Duration::from_secs(10),
        || node_ls(&host),
        |t| t.contains("via 192.168.78.5"),
    )
    .await;
    assert_eq!(
        cells(&table),
        [
            vec!["CLUSTER", "NAME", "ID", "ADDRESSES", "POD CIDRS", "ROUTE"],
            vec!["-", "node-a", "1", "192.168.77.1", "10.244.0.0/24", "(this node)"],
            vec!["east", "node-a", "1", "192.168.78.5", "10.244.8.0/24", "via 192.168.78.5"],
        ],
        "{table}"
    );
    wait_for("east's pod CIDR kept from egress masquerade", Duration::from_secs(15), kept, |k| {
        k.contains("10.244.8.0/24")
    });

    // The node's pod CIDR changes: the route follows. A node of east overlapping west's own
    // pod CIDRs (10.244.0.0/24 is node-a's) is not routed away.
    east_node.update(vec!["192.168.78.5".parse().unwrap()], vec!["10.244.9.0/24".parse().unwrap()]).await.unwrap();
    let overlapping = wasmplane_operator::NodeRegistry::join(
        east_kv.clone(),
        lease.clone(),
        "node-o",
        vec!["192.168.78.6".parse().unwrap()],
        vec!["10.244.0.0/25".parse().unwrap()],
    )
    .await
    .unwrap();
    wait_for(
        "the route follows east's node",
        Duration::from_secs(15),
        || routes_in(&ns_a),
        |r| r.contains("10.244.9.0/24 via 192.168.78.5") && !r.contains("10.244.8.0/24"),
    );
    eventually(
        "west sees east's second node",
        Duration::from_secs(10),
        || nodes_view(&host),
        |v| !v["remote_nodes"]["east"]["node-o"].is_null(),
    )
    .await;
    assert!(!routes_in(&ns_a).contains("10.244.0.0/25"), "{}", routes_in(&ns_a));
    wait_for("east's new pod CIDR kept", Duration::from_secs(15), kept, |k| {
        k.contains("10.244.9.0/24") && !k.contains("10.244.8.0/24")
    });
    overlapping.leave().await.unwrap();

    // East's node leaves its cluster: the route goes. It comes back; then east's file goes,
    // and with it the routes to east's pods, though the node is still registered there.
    east_node.leave().await.unwrap();
    wait_for(
        "the route to east's node removed",
        Duration::from_secs(15),
        || routes_in(&ns_a),
        |r| !r.contains("10.244.9.0/24"),
    );
    let _east_node = wasmplane_operator::NodeRegistry::join(
        east_kv.clone(),
        lease,
        "node-a",
        vec!["192.168.78.5".parse().unwrap()],
        vec!["10.244.9.0/24".parse().unwrap()],
    )
    .await
    .unwrap();
    wait_for(
        "the route back",
        Duration::from_secs(15),
        || routes_in(&ns_a),
        |r| r.contains("10.244.9.0/24 via 192.168.78.5"),
    );
    std::fs::remove_file(mesh.join("east")).unwrap();
    wait_for(
        "east's routes gone with its file",
        Duration::from_secs(15),
        || routes_in(&ns_a),
        |r| !r.contains("10.244.9.0/24"),
    );
    wait_for("east's pods masqueraded to again", Duration::from_secs(15), kept, |k| !k.contains("10.244.9.0/24"));
    assert_eq!(nodes_view(&host).await["remote_nodes"], serde_json::json!({}));
    host.stop().await;
}
