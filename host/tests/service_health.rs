//! Load balancer health checks through the whole host (`service_health.rs`): a
//! `LoadBalancer` service with `externalTrafficPolicy: Local` from the manifest source, its
//! `healthCheckNodePort` answered over real HTTP on loopback as kube-proxy answers it, and
//! the answer following the endpoints, the port and the service. No kernel: the dataplane is
//! only rendered, so this runs without root.

mod support;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::time::Duration;

use serde_json::Value;
use support::cluster::*;
use wasmplane::app::DataplaneMode;

/// A port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port()
}

/// Status, endpoint weight header and body of a check on `port`; `None`: nothing listens.
async fn ask(port: u16) -> Option<(u16, String, Value)> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(2)).pool_max_idle_per_host(0).build().unwrap();
    let response = client.get(format!("http://127.0.0.1:{port}/healthz")).send().await.ok()?;
    let weight = response
        .headers()
        .get("x-load-balancing-endpoint-weight")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    assert_eq!(response.headers().get("content-type").unwrap(), "application/json");
    Some((response.status().as_u16(), weight, response.json().await.unwrap()))
}

fn lb(name: &'static str, cluster_ip: &'static str, health_port: u16, endpoints: Vec<Endpoint>) -> Svc {
    let mut svc = Svc::new(name, cluster_ip, vec![Port::new("http", "TCP", 80, 8080).node_port(30080)], endpoints);
    svc.service_type = "LoadBalancer";
    svc.external_local = true;
    svc.load_balancer_ip = Some("198.51.100.10");
    svc.health_check_node_port = Some(health_port);
    svc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_traffic_load_balancer_is_health_checked_by_its_local_endpoints() {
    let cluster = Cluster::new();
    let first_port = free_port();
    let unready_here = Endpoint { ready: false, serving: false, terminating: true, ..ready("10.244.0.12", NODE) };
    let endpoints = vec![ready("10.244.0.11", NODE), ready("10.244.1.11", OTHER_NODE), unready_here.clone()];
    cluster.put(&lb("web", "10.96.0.40", first_port, endpoints));
    let config = wasmplane::app::HostConfig {
        dataplane: DataplaneMode::Record,
        health_check_bind: Some(Ipv4Addr::LOCALHOST.into()),
        ..cluster.config(vec![])
    };
    let host = start_host(config).await;

    // One ready endpoint here (the other node's and the terminating one do not count).
    let (status, weight, body) = eventually(
        "the health check served",
        Duration::from_secs(10),
        || ask(first_port),
        |a| a.as_ref().is_some_and(|(s, ..)| *s == 200),
    )
    .await
    .unwrap();
    assert_eq!((status, weight.as_str()), (200, "1"), "{body}");
    assert_eq!(body["service"]["namespace"], "default", "{body}");
    assert_eq!(body["service"]["name"], "web", "{body}");
    assert_eq!(
        (body["localEndpoints"].as_u64(), body["serviceProxyHealthy"].as_bool()),
        (Some(1), Some(true)),
        "{body}"
    );

    // The endpoint here stops being ready: the load balancer must stop sending here.
    cluster.put(&lb("web", "10.96.0.40", first_port, vec![ready("10.244.1.11", OTHER_NODE), unready_here.clone()]));
    let (status, weight, body) = eventually(
        "503 without local endpoints",
        Duration::from_secs(10),
        || ask(first_port),
        |a| a.as_ref().is_some_and(|(s, ..)| *s == 503),
    )
    .await
    .unwrap();
    assert_eq!((status, weight.as_str(), body["localEndpoints"].as_u64()), (503, "0", Some(0)), "{body}");

    // A new port: served there, and the old one closed.
    let second_port = free_port();
    cluster.put(&lb("web", "10.96.0.40", second_port, vec![ready("10.244.0.11", NODE), ready("10.244.0.13", NODE)]));
    let (status, weight, _) =
        eventually("the new port", Duration::from_secs(10), || ask(second_port), |a| a.is_some()).await.unwrap();
    assert_eq!((status, weight.as_str()), (200, "2"));
    eventually("the old port closed", Duration::from_secs(10), || ask(first_port), Option::is_none).await;

    // A port something else holds: retried until it is free.
    let held = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let held_port = held.local_addr().unwrap().port();
    cluster.put(&lb("api", "10.96.0.41", held_port, vec![ready("10.244.0.21", NODE)]));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let refused = reqwest::Client::new()
        .get(format!("http://{}/", SocketAddr::from((Ipv4Addr::LOCALHOST, held_port))))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(refused.is_err(), "the test's listener holds the port and never answers HTTP");
    drop(held);
    let (status, _, body) =
        eventually("the freed port served", Duration::from_secs(15), || ask(held_port), |a| a.is_some()).await.unwrap();
    assert_eq!((status, body["service"]["name"].as_str()), (200, Some("api")), "{body}");

    // The service goes: so does its check.
    cluster.remove("web");
    eventually("the removed service's port closed", Duration::from_secs(10), || ask(second_port), Option::is_none)
        .await;
    assert!(ask(held_port).await.is_some(), "the other service's check stays");
    host.stop().await;
    assert!(ask(held_port).await.is_none(), "a stopped host answers no check");
}

/// The node's health (`/healthz`; kube-proxy's port 10256) and each service check's
/// `serviceProxyHealthy` follow whether the kernel takes the host's writes: a stand-in `nft`
/// that refuses every write while a flag file exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_writes_make_the_node_unhealthy_until_they_are_taken_again() {
    let cluster = Cluster::new();
    let refuse = cluster.data_dir().with_file_name("refuse-writes");
    let nft = cluster.data_dir().with_file_name("nft.sh");
    // Listings print nothing (no table of ours yet); `-f -` reads the transaction.
    std::fs::write(&nft, format!("[ -e '{}' ] && exit 1\ncat > /dev/null\nexit 0\n", refuse.display())).unwrap();
    let (node_port, check_port) = (free_port(), free_port());
    cluster.put(&lb("web", "10.96.0.40", check_port, vec![ready("10.244.0.11", NODE)]));
    let config = wasmplane::app::HostConfig {
        nft_netlink: false,
        reconcile_interval: Duration::from_millis(300),
        health_check_bind: Some(Ipv4Addr::LOCALHOST.into()),
        node_health_listen: Some((Ipv4Addr::LOCALHOST, node_port).into()),
        ..cluster.config(vec!["sh".into(), nft.display().to_string()])
    };
    let host = start_host(config).await;
    let node = || async move {
        let response = reqwest::get(format!("http://127.0.0.1:{node_port}/healthz")).await.ok()?;
        Some((response.status().as_u16(), response.json::<Value>().await.unwrap()))
    };
    let (_, body) =
        eventually("the node healthy", Duration::from_secs(10), node, |a| a.as_ref().is_some_and(|(s, _)| *s == 200))
            .await
            .unwrap();
    assert!(body["lastUpdated"].as_str().is_some_and(|t| t.ends_with('Z')), "{body}");
    assert_eq!(body["nodeEligible"], true, "{body}");
    let (status, _, body) = ask(check_port).await.unwrap();
    assert_eq!((status, body["serviceProxyHealthy"].as_bool()), (200, Some(true)), "{body}");

    // Writes refused (a change, then the reconciles): unhealthy once they have been for
    // twice the reconcile interval; the service still has its endpoint here.
    std::fs::write(&refuse, "").unwrap();
    cluster.put(&lb("web", "10.96.0.40", check_port, vec![ready("10.244.0.11", NODE), ready("10.244.0.12", NODE)]));
    eventually("the node unhealthy", Duration::from_secs(10), node, |a| a.as_ref().is_some_and(|(s, _)| *s == 503))
        .await;
    let (status, _, body) = ask(check_port).await.unwrap();
    assert_eq!(
        (status, body["serviceProxyHealthy"].as_bool(), body["localEndpoints"].as_u64()),
        (503, Some(false), Some(2)),
        "{body}"
    );

    // Taken again at the next reconcile: healthy.
    std::fs::remove_file(&refuse).unwrap();
    eventually("the node healthy again", Duration::from_secs(10), node, |a| a.as_ref().is_some_and(|(s, _)| *s == 200))
        .await;
    assert_eq!(ask(check_port).await.unwrap().0, 200);

    // The cluster autoscaler marks this node for removal: load balancers drain it through
    // /healthz, while /livez and the service's own check stay as they were.
    let tainted = NODES_YAML.replacen("spec: { podCIDR: 10.244.0.0/24,", "spec: { taints: [{ key: ToBeDeletedByClusterAutoscaler, value: \"1700000000\", effect: NoSchedule }], podCIDR: 10.244.0.0/24,", 1);
    assert_ne!(tainted, NODES_YAML);
    cluster.put_file(
        "cluster.yaml",
        &format!("{tainted}---\napiVersion: v1\nkind: Namespace\nmetadata: {{ name: default }}\n"),
    );
    let (_, body) =
        eventually("the node drained", Duration::from_secs(10), node, |a| a.as_ref().is_some_and(|(s, _)| *s == 503))
            .await
            .unwrap();
    assert_eq!(body["nodeEligible"], false, "{body}");
    let live = reqwest::get(format!("http://127.0.0.1:{node_port}/livez")).await.unwrap();
    assert_eq!(live.status().as_u16(), 200);
    assert!(live.json::<Value>().await.unwrap().get("nodeEligible").is_none());
    assert_eq!(ask(check_port).await.unwrap().0, 200);
    host.stop().await;
}
