//! Network policy through the whole host: pods and a NetworkPolicy from the manifest
//! source, the builtin policy guest, the host's writer in a node namespace, real TCP from
//! pod namespaces. Enforcement, audit mode (would-be drops counted, nothing dropped), a label
//! change flipping reachability, and the policy going away. The truth tables over many
//! cases are in `policy_traffic.rs`; this proves the wiring.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use support::cluster::*;
use support::echo::*;
use support::netns::*;

const WEB: &str = "10.244.0.11";
const CLIENT: &str = "10.244.0.100";
const OTHER: &str = "10.244.0.101";
const PROBE: Duration = Duration::from_millis(500);

fn pods(other_app: &str) -> String {
    [("web", WEB, "web"), ("client", CLIENT, "client"), ("other", OTHER, other_app)]
        .iter()
        .map(|(name, ip, app)| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{ name: {name}, namespace: default, labels: {{ app: {app} }} }}\nspec: {{ nodeName: {NODE}, containers: [{{ name: c, image: x, ports: [{{ name: http, containerPort: 8080 }}] }}] }}\nstatus: {{ phase: Running, podIP: {ip}, podIPs: [{{ ip: {ip} }}] }}\n---\n"
            )
        })
        .collect()
}

const POLICY: &str = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: { name: web-from-client, namespace: default, uid: 6f1c-uid, generation: 1 }
spec:
  podSelector: { matchLabels: { app: web } }
  policyTypes: [Ingress]
  ingress:
    - from: [{ podSelector: { matchLabels: { app: client } } }]
      ports: [{ protocol: TCP, port: http }]
";

fn reaches(ns: &str) -> bool {
    in_ns(ns, || tcp_ask(SocketAddr::new(WEB.parse().unwrap(), 8080), PROBE)).is_ok()
}

/// [`reaches`] where the answer should be yes: a longer wait, which a drop still fails, so a
/// loaded machine's slow answer is not taken for a drop.
fn allowed(ns: &str) -> bool {
    in_ns(ns, || tcp_ask(SocketAddr::new(WEB.parse().unwrap(), 8080), Duration::from_secs(5))).is_ok()
}

/// `GET /v1/policies/verdicts{query}` until `done` says so (the kernel's log reaches the host
/// a moment after the packet).
async fn verdicts_until(host: &wasmplane::app::RunningHost, query: &str, done: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..50 {
        last = reqwest::get(format!("{}/v1/policies/verdicts{query}", host.url())).await.unwrap().json().await.unwrap();
        if done(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("GET /v1/policies/verdicts{query}: not as expected within 5 s: {last}");
}

async fn policies(host: &wasmplane::app::RunningHost, query: &str) -> Value {
    reqwest::get(format!("{}/v1/policies{query}", host.url())).await.unwrap().json().await.unwrap()
}

/// Web (serving 8080), client and other, each a pod namespace of one node.
struct ThreePods {
    // Field order is drop order: the server stops before its namespace goes.
    _server: Server,
    topo: Topology,
    client: String,
    other: String,
}

impl ThreePods {
    fn new(tag: &str) -> ThreePods {
        let mut topo = Topology::new(tag);
        let web = topo.add_pod(WEB);
        let client = topo.add_pod(CLIENT);
        let other = topo.add_pod(OTHER);
        ThreePods { _server: Server::start(&web, "web", &[8080]), topo, client, other }
    }
}

/// Whether a dataplane listing sends web's traffic to its dispatch chain.
fn web_is_dispatched(listing: &str) -> bool {
    listing.contains(&format!("{WEB} : jump")) || listing.contains(&format!("{WEB} : goto"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_from_the_cluster_is_enforced_audited_and_follows_labels() {
    require_root!();
    let node = ThreePods::new("polh");
    let (topo, client, other) = (&node.topo, &node.client, &node.other);
    let cluster = Cluster::new();
    cluster.put_file("pods.yaml", &pods("other"));
    let host =
        start_host(wasmplane::app::HostConfig { policy_log_group: 1001, ..cluster.config(topo.nft_command()) }).await;
    wait_applied(&host, "the pods", |t| !t.is_empty());
    assert!(allowed(client) && allowed(other), "no policy selects web: everything reaches it");

    cluster.put_file("policy.yaml", POLICY);
    wait_applied(&host, "the policy", web_is_dispatched);
    assert!(allowed(client), "client is allowed");
    assert!(!reaches(other), "other is not: default deny for the selected pod");
    // A full reconcile rewrites the policy side too (dispatch chains jump to policy chains
    // of other objects: all declared before any rule).
    host.controller.lock().unwrap().reconcile().expect("a full sync with policies in force");
    assert!(allowed(client) && !reaches(other), "the same after a full reconcile");
    // What was dropped, read back from the kernel's NFLOG: other's connection to web, named by
    // pod and policy. Nothing of client's, which the policy allows.
    let denied = verdicts_until(&host, "?pod=default/web&verdict=deny", |v| {
        v["events"].as_array().is_some_and(|e| !e.is_empty())
    })
    .await;
    let event = &denied["events"][0];
    assert_eq!(
        (
            event["pod"].as_str(),
            event["direction"].as_str(),
            event["source"].as_str(),
            event["destination"].as_str(),
            event["protocol"].as_str(),
            event["destination_port"].as_u64()
        ),
        (Some("default/web"), Some("ingress"), Some(OTHER), Some(WEB), Some("tcp"), Some(8080)),
        "{denied}"
    );
    assert_eq!(event["policies"], serde_json::json!(["default/web-from-client"]), "{denied}");
    assert!(denied["events"].as_array().unwrap().iter().all(|e| e["source"] != CLIENT), "{denied}");
    assert!(denied["totals"]["deny"].as_u64() >= Some(1), "{denied}");
    // A follower's poll: only what was logged at or after the time it gives.
    let newest = denied["events"][0]["at_unix_ms"].as_u64().unwrap();
    let since_newest = verdicts_until(&host, &format!("?pod=default/web&since_unix_ms={newest}"), |_| true).await;
    assert!(
        since_newest["events"]
            .as_array()
            .is_some_and(|e| !e.is_empty() && e.iter().all(|e| e["at_unix_ms"].as_u64() >= Some(newest))),
        "{since_newest}"
    );
    let later = verdicts_until(&host, &format!("?pod=default/web&since_unix_ms={}", newest + 60_000), |_| true).await;
    assert_eq!(later["events"], serde_json::json!([]), "{later}");
    let status: Value = reqwest::get(format!("{}/v1/status", host.url())).await.unwrap().json().await.unwrap();
    assert!(status["policy_verdicts"]["deny"].as_u64() >= Some(1), "the status counts them too: {status}");
    let bad = reqwest::get(format!("{}/v1/policies/verdicts?verdict=dropped", host.url())).await.unwrap();
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST, "deny or audit only");
    let unknown = reqwest::get(format!("{}/v1/policies/verdicts?pod=default/nobody", host.url())).await.unwrap();
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    let listed = policies(&host, "").await;
    let policy = &listed["policies"][0];
    assert_eq!(
        (policy["name"].as_str(), policy["enforced_generation"].as_u64(), policy["audit"].as_bool()),
        (Some("web-from-client"), Some(1), Some(false)),
        "{listed}"
    );

    // This node's realization, for the operator to aggregate.
    let status_key = format!("/wasmplane/policystatus/6f1c-uid/default/web-from-client/{NODE}");
    let kv = host.modules.store().kv().clone();
    let mut written = None;
    for _ in 0..50 {
        written = kv.get(&status_key).await.unwrap();
        if written.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let written: Value =
        serde_json::from_slice(&written.expect("the node's policy status in the kvstore").value).unwrap();
    assert_eq!(written["generation"], 1, "{written}");
    assert!(written.get("error").is_none(), "{written}");

    // Audit: nothing dropped, would-be drops counted.
    let token = host.token.clone();
    let client_http = reqwest::Client::new();
    let audit = |enabled: bool| {
        client_http
            .post(format!("{}/v1/policies/default/web-from-client/audit?enabled={enabled}", host.url()))
            .bearer_auth(&token)
            .send()
    };
    assert_eq!(audit(true).await.unwrap().status(), StatusCode::OK);
    assert!(allowed(other), "audit mode does not drop");
    verdicts_until(&host, "?verdict=audit", |v| {
        v["events"].as_array().is_some_and(|e| e.iter().any(|e| e["source"] == OTHER && e["pod"] == "default/web"))
    })
    .await;
    let counted = policies(&host, "?counters=true").await;
    assert!(
        counted["policies"][0]["audit_would_drop_packets"].as_u64().unwrap_or(0) > 0,
        "would-be drops are counted: {counted}"
    );
    assert_eq!(counted["policies"][0]["audit"], true);
    let metrics = reqwest::get(format!("{}/metrics", host.url())).await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("wasmplane_policy_audit_mode{namespace=\"default\",name=\"web-from-client\"} 1"),
        "{metrics}"
    );
    let logged_denies = metrics
        .lines()
        .find_map(|l| l.strip_prefix("wasmplane_policy_verdicts_logged_total{verdict=\"deny\"} ")?.parse::<u64>().ok());
    assert!(logged_denies.is_some_and(|n| n >= 1), "logged verdicts in /metrics: {metrics}");
    // The policy guest's calls are counted with the translator's.
    let policy_calls = metrics
        .lines()
        .find(|l| {
            l.starts_with("wasmplane_guest_calls_total{")
                && l.contains("kind=\"network-policy\"")
                && l.contains("result=\"ok\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert!(policy_calls.is_some_and(|n| n >= 1.0), "policy guest calls in /metrics: {metrics}");
    // And timed apart from them: as many observations as calls, under the policy guest's kind.
    let counted_calls: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("wasmplane_guest_calls_total{") && l.contains("kind=\"network-policy\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let timed_calls = metrics.lines().find_map(|l| {
        l.strip_prefix("wasmplane_guest_call_seconds_count{kind=\"network-policy\"} ")?.parse::<f64>().ok()
    });
    assert_eq!(timed_calls, Some(counted_calls), "policy guest calls timed in /metrics: {metrics}");
    // And in the module's own record, as the translator's are.
    let module: Value =
        reqwest::get(format!("{}/v1/modules/default-network-policy", host.url())).await.unwrap().json().await.unwrap();
    assert_eq!(module["calls"].as_f64(), Some(counted_calls), "{module}");
    assert_eq!((module["failures"].as_u64(), &module["last_error"]), (Some(0), &Value::Null), "{module}");
    let would_drop = metrics
        .lines()
        .find(|l| {
            l.starts_with("wasmplane_policy_packets{") && l.contains("web-from-client") && l.contains("would_drop")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok());
    assert!(would_drop.is_some_and(|n| n > 0), "would-be drops in /metrics: {metrics}");
    let unauthenticated =
        client_http.post(format!("{}/v1/policies/audit?enabled=true", host.url())).send().await.unwrap();
    assert_eq!(unauthenticated.status(), StatusCode::UNAUTHORIZED, "audit changes need the token");
    assert_eq!(audit(false).await.unwrap().status(), StatusCode::OK);
    assert!(!reaches(other), "enforced again");

    // A label change flips reachability without touching the policy.
    cluster.put_file("pods.yaml", &pods("client"));
    support::cluster::wait_for(
        "other, relabelled client, reaches web",
        Duration::from_secs(10),
        || reaches(other),
        |r| *r,
    );
    assert!(allowed(client));

    // A policy the guest declines: counted against the module, named in its last error; the
    // policy in force stays.
    cluster.put_file(
        "bad.yaml",
        &POLICY
            .replace("web-from-client", "bad-block")
            .replace("podSelector: { matchLabels: { app: client } }", "ipBlock: { cidr: nonsense }"),
    );
    let mut module = Value::Null;
    for _ in 0..100 {
        module = reqwest::get(format!("{}/v1/modules/default-network-policy", host.url()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if module["failures"].as_u64() > Some(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last_error = module["last_error"].as_str().unwrap_or_default();
    assert!(last_error.contains("default/bad-block") && last_error.contains("nonsense"), "{module}");
    assert_eq!(module["status"], "active", "{module}");
    assert!(allowed(client), "the policy in force still allows client");
    cluster.remove_file("bad.yaml");

    // The policy goes: its rules go.
    cluster.remove_file("policy.yaml");
    wait_applied(&host, "the policy removed", |t| !t.contains("pol/default/web-from-client"));
    let mut gone = false;
    for _ in 0..50 {
        gone = kv.get(&status_key).await.unwrap().is_none();
        if gone {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the status of a policy this node no longer has is removed");
    cluster.put_file("pods.yaml", &pods("other"));
    support::cluster::wait_for("other reaches web again", Duration::from_secs(10), || reaches(other), |r| *r);
    // After a full reconcile nothing of the policy is left in the kernel.
    host.controller.lock().unwrap().reconcile().unwrap();
    let chains = topo.nft(&["list", "chains", "inet"]).unwrap();
    assert!(!chains.contains("pol/default/web-from-client") && !chains.contains("polpod/"), "{chains}");
    host.stop().await;
}

/// Allow logging through the REST API, on a kernel: turned on for one policy (the token
/// needed), client's allowed connection is logged as an allow owed to the policy, ingress, at
/// web; other's is still a deny; `/v1/drops` lists no allows; off again, nothing more is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_connections_are_logged_per_policy_on_request() {
    require_root!();
    let node = ThreePods::new("pola");
    let (topo, client, other) = (&node.topo, &node.client, &node.other);
    let cluster = Cluster::new();
    cluster.put_file("pods.yaml", &pods("other"));
    cluster.put_file("policy.yaml", POLICY);
    let host =
        start_host(wasmplane::app::HostConfig { policy_log_group: 1002, ..cluster.config(topo.nft_command()) }).await;
    wait_applied(&host, "the policy", web_is_dispatched);
    let http = reqwest::Client::new();
    let url = format!("{}/v1/policies/default/web-from-client/log-allowed", host.url());
    let unauthenticated = http.post(format!("{url}?enabled=true")).send().await.unwrap();
    assert_eq!(unauthenticated.status(), StatusCode::UNAUTHORIZED, "allow logging needs the token");
    let unauthenticated =
        http.post(format!("{}/v1/policies/log-allowed?enabled=true", host.url())).send().await.unwrap();
    assert_eq!(unauthenticated.status(), StatusCode::UNAUTHORIZED, "for every policy too");
    assert_eq!(policies(&host, "").await["policies"][0]["log_allowed"], false);
    let on = http.post(format!("{url}?enabled=true")).bearer_auth(&host.token).send().await.unwrap();
    assert_eq!(on.status(), StatusCode::OK);
    let on: Value = on.json().await.unwrap();
    assert_eq!(on["log_allowed"], true, "{on}");
    assert_eq!(policies(&host, "").await["policies"][0]["log_allowed"], true);
    wait_applied(&host, "the allow chain", |t| t.contains("polallow/"));

    assert!(allowed(client), "logging changes no verdict");
    assert!(!reaches(other), "other is still dropped");
    let allows = verdicts_until(&host, "?verdict=allow", |v| {
        v["events"].as_array().is_some_and(|e| e.iter().any(|e| e["source"] == CLIENT))
    })
    .await;
    let event = allows["events"].as_array().unwrap().iter().find(|e| e["source"] == CLIENT).unwrap();
    assert_eq!(
        (
            event["verdict"].as_str(),
            event["policy"].as_str(),
            event["direction"].as_str(),
            event["pod"].as_str(),
            event["destination_port"].as_u64()
        ),
        (Some("allow"), Some("default/web-from-client"), Some("ingress"), Some("default/web"), Some(8080)),
        "{allows}"
    );
    assert!(
        allows["events"].as_array().unwrap().iter().all(|e| e["source"] != OTHER),
        "other's connection is no allow: {allows}"
    );
    assert!(allows["totals"]["allow"].as_u64() >= Some(1), "{allows}");
    let denied = verdicts_until(&host, "?verdict=deny", |v| {
        v["events"].as_array().is_some_and(|e| e.iter().any(|e| e["source"] == OTHER))
    })
    .await;
    assert!(denied["events"].as_array().unwrap().iter().all(|e| e["source"] != CLIENT), "{denied}");
    let drops: Value = reqwest::get(format!("{}/v1/drops", host.url())).await.unwrap().json().await.unwrap();
    assert!(
        drops["events"].as_array().is_some_and(|e| e.iter().all(|e| e["verdict"] != "allow" && e["source"] != CLIENT)),
        "no allows among drops: {drops}"
    );

    let off = http.post(format!("{url}?enabled=false")).bearer_auth(&host.token).send().await.unwrap();
    assert_eq!(off.status(), StatusCode::OK);
    wait_applied(&host, "the allow chain gone", |t| !t.contains("polallow/"));
    let before = verdicts_until(&host, "?verdict=allow", |_| true).await["events"].as_array().unwrap().len();
    assert!(allowed(client));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = verdicts_until(&host, "?verdict=allow", |_| true).await["events"].as_array().unwrap().len();
    assert_eq!(after, before, "allow logging off: no new allow events");
    host.stop().await;

    // A host logging no verdicts has nothing to log allows to.
    let topo0 = Topology::new("pol0");
    let cluster0 = Cluster::new();
    cluster0.put_file("policy.yaml", POLICY);
    let host0 =
        start_host(wasmplane::app::HostConfig { policy_log_group: 0, ..cluster0.config(topo0.nft_command()) }).await;
    let refused = http
        .post(format!("{}/v1/policies/log-allowed?enabled=true", host0.url()))
        .bearer_auth(&host0.token)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    host0.stop().await;
}

/// The allow log is metered per pod: a client flooding one pod a policy selects uses up that
/// pod's log rate, not the policy's, and the connections to another pod of the same policy
/// are all still logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pods_flood_leaves_the_allow_log_to_the_policys_other_pods() {
    require_root!();
    let node = ThreePods::new("polm");
    let (topo, client, other) = (&node.topo, &node.client, &node.other);
    let _other_server = Server::start(other, "other", &[8080]);
    let cluster = Cluster::new();
    // "other" is app=web too: the policy selects both, and lets the client reach both.
    cluster.put_file("pods.yaml", &pods("web"));
    cluster.put_file("policy.yaml", POLICY);
    // Two a second per pod after a burst of four; the policy's allow chain passes on 20 and 40.
    let host = start_host(wasmplane::app::HostConfig {
        policy_log_group: 1003,
        policy_log_rate: 2,
        ..cluster.config(topo.nft_command())
    })
    .await;
    wait_applied(&host, "the policy on both pods", |t| web_is_dispatched(t) && t.contains(&format!("{OTHER} : goto")));
    let on = reqwest::Client::new()
        .post(format!("{}/v1/policies/default/web-from-client/log-allowed?enabled=true", host.url()))
        .bearer_auth(&host.token)
        .send()
        .await
        .unwrap();
    assert_eq!(on.status(), StatusCode::OK);
    wait_applied(&host, "the metered allow chain", |t| t.contains("update @policy-allow-log-ingress"));

    const FLOOD: usize = 20;
    let started = std::time::Instant::now();
    for i in 0..FLOOD {
        assert!(allowed(client), "flood connection {i} to web");
    }
    let flood_seconds = started.elapsed().as_secs_f64();
    let to_other = SocketAddr::new(OTHER.parse().unwrap(), 8080);
    for i in 0..3 {
        in_ns(client, || tcp_ask(to_other, Duration::from_secs(5)))
            .unwrap_or_else(|e| panic!("connection {i} to other: {e}"));
    }
    let count = |v: &Value, to: &str| {
        v["events"]
            .as_array()
            .map_or(0, |e| e.iter().filter(|e| e["source"] == CLIENT && e["destination"] == to).count())
    };
    let allows = verdicts_until(&host, "?verdict=allow&limit=1024", |v| count(v, OTHER) >= 3).await;
    assert_eq!(count(&allows, OTHER), 3, "every connection to the quiet pod is logged: {allows}");
    // Web's own meter: its burst and what refills while the flood lasts (and a packet's slack).
    let bound = 4 + (2.0 * flood_seconds).ceil() as usize + 1;
    let web = count(&allows, WEB);
    assert!(
        (1..=bound).contains(&web) && web < FLOOD,
        "web's {web} logged allows of {FLOOD} in {flood_seconds:.2} s, bound {bound}: {allows}"
    );
    host.stop().await;
}
