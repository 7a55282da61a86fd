//! The Kubernetes watchers end to end: the host's kube-rs watchers against the test API
//! server (real list/watch HTTP protocol), read back through the host's REST API.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::{NetworkPolicy, ServiceCIDR};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use wasmplane::app::{HostConfig, KubernetesSource, RunningHost, start};
use wasmplane_test_apiserver::{ResourceType, TestApiServer, Verb};

const TOKEN: &str = "kube-watch-test-token-0123456789";

/// Every kind the host watches that the test API server serves by default, as it names them
/// (ServiceCIDRs are not: the server stands for one before Kubernetes 1.33, which the host
/// must take as having none, else it would never be ready).
const KINDS: [&str; 6] =
    ["services", "endpointslices.discovery.k8s.io", "nodes", "namespaces", "pods", "networkpolicies.networking.k8s.io"];

/// Requests for `resource`'s whole state so far: lists, and watches that stream it.
fn state_requests(server: &TestApiServer, resource: &str) -> (usize, usize) {
    let requests = server.requests();
    let of = |verb: Verb| requests.iter().filter(move |r| r.verb == verb && r.resource == resource);
    (of(Verb::List).count(), of(Verb::Watch).filter(|r| r.param("sendInitialEvents") == Some("true")).count())
}

fn object<K: DeserializeOwned>(value: Value) -> K {
    serde_json::from_value(value).expect("a valid object")
}

fn namespace(name: &str, team: &str) -> Namespace {
    object(json!({"metadata": {"name": name, "labels": {"team": team}}}))
}

fn node(name: &str, ip: &str, cidr: &str) -> Node {
    object(json!({
        "metadata": {"name": name},
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]}
    }))
}

fn service(name: &str, ip: &str, port: u16) -> Service {
    object(json!({
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                 "ports": [{"name": "http", "protocol": "TCP", "port": port, "targetPort": 8080}]}
    }))
}

fn slice(name: &str, service: &str, endpoints: &[(&str, &str)]) -> EndpointSlice {
    object(json!({
        "metadata": {"name": name, "namespace": "shop", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": endpoints.iter().map(|(ip, node)| json!({
            "addresses": [ip], "nodeName": node, "conditions": {"ready": true, "serving": true, "terminating": false}
        })).collect::<Vec<_>>(),
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}]
    }))
}

/// `slice` as the EndpointSlice controller writes it: with the time of the change it reflects.
fn triggered(mut slice: EndpointSlice, time: SystemTime) -> EndpointSlice {
    let time = k8s_openapi::jiff::Timestamp::try_from(time).unwrap().to_string();
    slice.metadata.annotations = Some([("endpoints.kubernetes.io/last-change-trigger-time".to_string(), time)].into());
    slice
}

fn pod(name: &str, app: &str, node: &str, ip: &str) -> Pod {
    object(json!({
        "metadata": {"name": name, "namespace": "shop", "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "example", "ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    }))
}

fn policy(name: &str, app: &str) -> NetworkPolicy {
    object(json!({
        "metadata": {"name": name, "namespace": "shop", "generation": 1},
        "spec": {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]}
    }))
}

/// A small cluster with one object of every kind that matters to node-a.
fn seed(server: &TestApiServer) {
    server.create(&namespace("shop", "blue")).unwrap();
    server.create(&node("node-a", "192.168.0.1", "10.244.1.0/24")).unwrap();
    server.create(&node("node-b", "192.168.0.2", "10.244.2.0/24")).unwrap();
    server.create(&service("web", "10.96.0.10", 80)).unwrap();
    server.create(&slice("web-1", "web", &[("10.244.1.5", "node-a"), ("10.244.2.5", "node-b")])).unwrap();
    server.create(&pod("web-a", "web", "node-a", "10.244.1.5")).unwrap();
    server.create(&pod("web-b", "web", "node-b", "10.244.2.5")).unwrap();
    server.create(&policy("web-ingress", "web")).unwrap();
}

async fn start_host(server: &TestApiServer, dir: &std::path::Path) -> RunningHost {
    start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        kubernetes: Some(KubernetesSource::Url(server.url())),
        data_dir: Some(dir.to_path_buf()),
        token: Some(TOKEN.into()),
        node_name: "node-a".into(),
        ..Default::default()
    })
    .await
    .expect("host starts")
}

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(host: &RunningHost) -> Api {
        Api { http: reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap(), base: host.url() }
    }
    async fn state(&self) -> Value {
        self.http.get(format!("{}/v1/state", self.base)).send().await.unwrap().json().await.unwrap()
    }
    async fn ready(&self) -> bool {
        self.http.get(format!("{}/readyz", self.base)).send().await.unwrap().status().is_success()
    }
    async fn metric(&self, name: &str) -> u64 {
        self.metric_value(name).await as u64
    }
    async fn metric_value(&self, name: &str) -> f64 {
        let text = self.http.get(format!("{}/metrics", self.base)).send().await.unwrap().text().await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("metric {name} not in /metrics"))
    }
    /// Polls the events counter until `n` more events than `since` arrived.
    async fn wait_events(&self, since: u64, n: u64, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.metric("wasmplane_model_events_total").await < since + n {
            assert!(Instant::now() < deadline, "{what}: events never arrived");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    /// Polls `/readyz` until it is ready; panics after 15 s.
    async fn wait_ready(&self, when: &str) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !self.ready().await {
            assert!(Instant::now() < deadline, "never became ready {when}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    /// Polls `/v1/state` until `cond` holds; panics with the last state after 10 s.
    async fn wait_state(&self, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let state = self.state().await;
            if cond(&state) {
                return state;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; state: {state:#}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

fn endpoints(state: &Value, service: &str) -> Vec<String> {
    let mut ips: Vec<String> = state["model"]["services"][service]["slices"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .map(|e| e["addresses"][0].as_str().unwrap().to_string())
        .collect();
    ips.sort();
    ips
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_only_after_the_initial_sync_of_every_kind() {
    let server = TestApiServer::start().await;
    seed(&server);
    // The API server is down when the host starts: it must not claim readiness.
    server.set_unavailable(true);
    let dir = tempfile::tempdir().unwrap();
    let host = start_host(&server, dir.path()).await;
    let api = Api::new(&host);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!api.ready().await, "ready before any list succeeded");
    assert_eq!(api.state().await["revision"], 0);

    server.set_unavailable(false);
    api.wait_ready("after the API server came back").await;
    // Readiness means every kind is in: nothing is still on its way, and the whole first
    // state went in as one revision (no service was ever seen without its endpoints).
    let state = api.state().await;
    assert_eq!(state["revision"], 1, "the initial sync took more than one revision");
    assert_eq!(endpoints(&state, "shop/web"), vec!["10.244.1.5", "10.244.2.5"]);
    assert_eq!(state["model"]["context"]["node_ips"], json!(["192.168.0.1"]));
    assert!(state["model"]["local_pods"]["shop/web-a"].is_object());
    assert!(state["model"]["local_pods"]["shop/web-b"].is_null(), "web-b runs on node-b");
    assert_eq!(state["model"]["policies"]["shop/web-ingress"]["local_pods"][0]["name"], "web-a");
    // Every kind's state came as a streaming list, none as a list.
    for kind in KINDS {
        let (lists, streams) = state_requests(&server, kind);
        assert!(lists == 0 && streams > 0, "{kind}: {lists} lists, {streams} streaming lists");
    }
    assert!(host.watch_status.as_ref().unwrap().snapshot().refused_streaming.is_empty());
    host.stop().await;
}

/// A server without streaming lists (the `WatchList` feature off, or before Kubernetes 1.27)
/// refuses the host's first request for each kind; the host lists instead and loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_streaming_lists_is_listed_instead() {
    let server = TestApiServer::builder().watch_list(false).start().await;
    seed(&server);
    let dir = tempfile::tempdir().unwrap();
    let host = start_host(&server, dir.path()).await;
    let api = Api::new(&host);
    api.wait_ready("listing instead of streaming").await;
    let state = api.state().await;
    assert_eq!(state["revision"], 1, "the initial sync took more than one revision");
    assert_eq!(endpoints(&state, "shop/web"), vec!["10.244.1.5", "10.244.2.5"]);
    assert_eq!(state["model"]["policies"]["shop/web-ingress"]["local_pods"][0]["name"], "web-a");
    for kind in KINDS {
        let (lists, streams) = state_requests(&server, kind);
        assert!(lists > 0 && streams == 1, "{kind}: {lists} lists, {streams} streaming lists (asked once, refused)");
    }
    let status = host.watch_status.as_ref().unwrap().snapshot();
    assert_eq!(status.refused_streaming.len(), 6, "{status:?}");
    assert_eq!(status.watch_errors, 0, "a refusal is no watch error: {status:?}");

    // Watching goes on after the lists.
    server.create(&service("late", "10.96.0.13", 80)).unwrap();
    api.wait_state("watching", |s| s["model"]["services"]["shop/late"].is_object()).await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_reaches_the_model_and_irrelevant_changes_make_no_revision() {
    let server = TestApiServer::start().await;
    seed(&server);
    let dir = tempfile::tempdir().unwrap();
    let host = start_host(&server, dir.path()).await;
    let api = Api::new(&host);
    api.wait_state("initial sync", |s| {
        !endpoints(s, "shop/web").is_empty() && s["model"]["policies"]["shop/web-ingress"].is_object()
    })
    .await;

    // Service: add, update, delete.
    server.create(&service("api", "10.96.0.11", 81)).unwrap();
    api.wait_state("service added", |s| s["model"]["services"]["shop/api"]["service"]["ports"][0]["port"] == 81).await;
    server.update(&service("api", "10.96.0.11", 82)).unwrap();
    api.wait_state("service updated", |s| s["model"]["services"]["shop/api"]["service"]["ports"][0]["port"] == 82)
        .await;
    server.delete::<Service>("shop", "api").unwrap();
    api.wait_state("service deleted", |s| s["model"]["services"]["shop/api"].is_null()).await;

    // EndpointSlice: scale up, down, delete.
    server
        .update(&slice("web-1", "web", &[("10.244.1.5", "node-a"), ("10.244.1.6", "node-a"), ("10.244.2.5", "node-b")]))
        .unwrap();
    api.wait_state("endpoint added", |s| endpoints(s, "shop/web").len() == 3).await;
    server.update(&slice("web-1", "web", &[("10.244.2.5", "node-b")])).unwrap();
    api.wait_state("endpoints removed", |s| endpoints(s, "shop/web") == ["10.244.2.5"]).await;
    server.delete::<EndpointSlice>("shop", "web-1").unwrap();
    api.wait_state("slice deleted", |s| endpoints(s, "shop/web").is_empty()).await;
    // The operator's slice of another cluster's endpoints is not watched (agents import them
    // from that cluster's etcd): the slice created after it arrives, it never does.
    let mut mesh = slice("web-east-0", "web", &[("10.245.0.7", "east-node")]);
    mesh.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("endpointslice.kubernetes.io/managed-by".into(), wasmplane_operator::MESH_SLICE_CONTROLLER.into());
    server.create(&mesh).unwrap();
    server.create(&slice("web-2", "web", &[("10.244.2.6", "node-b")])).unwrap();
    api.wait_state("the controller's slice after the mesh slice", |s| !endpoints(s, "shop/web").is_empty()).await;
    assert_eq!(endpoints(&api.state().await, "shop/web"), ["10.244.2.6"], "the mesh slice is not the agent's");
    server.delete::<EndpointSlice>("shop", "web-2").unwrap();
    api.wait_state("slice deleted", |s| endpoints(s, "shop/web").is_empty()).await;

    // Node: our own node's address changes the context; deleting it clears it.
    server.update(&node("node-a", "192.168.0.10", "10.244.1.0/24")).unwrap();
    api.wait_state("node updated", |s| s["model"]["context"]["node_ips"] == json!(["192.168.0.10"])).await;

    // Pod: a new local pod selected by the policy; relabel it away; delete it.
    server.create(&pod("web-a2", "web", "node-a", "10.244.1.7")).unwrap();
    api.wait_state("pod added", |s| {
        s["model"]["local_pods"]["shop/web-a2"].is_object()
            && s["model"]["policies"]["shop/web-ingress"]["local_pods"].as_array().unwrap().len() == 2
    })
    .await;
    server.update(&pod("web-a2", "batch", "node-a", "10.244.1.7")).unwrap();
    api.wait_state("pod relabelled", |s| {
        s["model"]["policies"]["shop/web-ingress"]["local_pods"].as_array().unwrap().len() == 1
    })
    .await;
    server.delete::<Pod>("shop", "web-a2").unwrap();
    api.wait_state("pod deleted", |s| s["model"]["local_pods"]["shop/web-a2"].is_null()).await;

    // A client pod anywhere in the namespace is a peer of the policy.
    server.create(&pod("client-b", "client", "node-b", "10.244.2.9")).unwrap();
    api.wait_state("peer added", |s| s["model"]["policies"]["shop/web-ingress"]["peer_pods"][0]["name"] == "client-b")
        .await;

    // NetworkPolicy: update (select nothing here), delete.
    server.update(&policy("web-ingress", "nothing")).unwrap();
    api.wait_state("policy no longer applies here", |s| s["model"]["policies"]["shop/web-ingress"].is_null()).await;
    server.update(&policy("web-ingress", "web")).unwrap();
    api.wait_state("policy applies again", |s| s["model"]["policies"]["shop/web-ingress"].is_object()).await;
    server.delete::<NetworkPolicy>("shop", "web-ingress").unwrap();
    api.wait_state("policy deleted", |s| s["model"]["policies"]["shop/web-ingress"].is_null()).await;

    // Namespace: add and delete reach the cluster state (seen through the events counter).
    let events = api.metric("wasmplane_model_events_total").await;
    server.create(&namespace("tools", "red")).unwrap();
    server.delete::<Namespace>("", "tools").unwrap();
    api.wait_events(events, 2, "namespace added and deleted").await;

    // Changes that do not concern node-a: events counted, no revision.
    let revision = api.state().await["revision"].as_u64().unwrap();
    let events = api.metric("wasmplane_model_events_total").await;
    server.update(&node("node-b", "192.168.0.20", "10.244.2.0/24")).unwrap();
    server.create(&pod("batch-b", "batch", "node-b", "10.244.2.11")).unwrap();
    let mut annotated = server.get::<Service>("shop", "web").unwrap();
    annotated.metadata.annotations = Some([("note".to_string(), "irrelevant".to_string())].into());
    server.update(&annotated).unwrap();
    api.wait_events(events, 3, "changes elsewhere").await;
    assert_eq!(api.state().await["revision"].as_u64().unwrap(), revision, "an irrelevant change produced a revision");
    assert!(api.metric("wasmplane_model_revisions_total").await < api.metric("wasmplane_model_events_total").await);
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_watch_relists_and_loses_nothing() {
    let server = TestApiServer::start().await;
    seed(&server);
    let dir = tempfile::tempdir().unwrap();
    let host = start_host(&server, dir.path()).await;
    let api = Api::new(&host);
    api.wait_state("initial sync", |s| !endpoints(s, "shop/web").is_empty()).await;
    let service_states = state_requests(&server, "services");
    let slice_states = state_requests(&server, "endpointslices.discovery.k8s.io");

    // Behind the watchers' backs: the server goes away, things change, history is compacted.
    server.set_unavailable(true);
    server.delete::<Service>("shop", "web").unwrap();
    server.create(&service("cart", "10.96.0.12", 80)).unwrap();
    server.create(&slice("cart-1", "cart", &[("10.244.1.8", "node-a")])).unwrap();
    server.delete::<Pod>("shop", "web-a").unwrap();
    server.compact();
    server.set_unavailable(false);

    // Resuming from their old versions gets each watcher an in-stream 410: it must relist.
    let state = api
        .wait_state("relisted state", |s| {
            s["model"]["services"]["shop/web"].is_null()
                && endpoints(s, "shop/cart") == ["10.244.1.8"]
                && s["model"]["local_pods"]["shop/web-a"].is_null()
        })
        .await;
    assert!(state["model"]["policies"]["shop/web-ingress"].is_null(), "the policy's only local pod is gone");
    assert!(state_requests(&server, "services").1 > service_states.1, "services were not relisted");
    assert!(
        state_requests(&server, "endpointslices.discovery.k8s.io").1 > slice_states.1,
        "endpoint slices were not relisted"
    );
    let status = host.watch_status.as_ref().unwrap().snapshot();
    assert!(status.relists >= 2, "relists not counted: {status:?}");

    // And the watches work again afterwards.
    server.create(&service("late", "10.96.0.13", 80)).unwrap();
    api.wait_state("watching again", |s| s["model"]["services"]["shop/late"].is_object()).await;
    host.stop().await;
}

/// `--min-sync-period` (kube-proxy's `minSyncPeriod`): after a quiet period a burst of
/// changes is applied as kube-proxy's bounded runner applies it, the first two at once and
/// the rest together once the period has passed; none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minimum_sync_period_applies_a_burst_of_changes_together() {
    const PERIOD: Duration = Duration::from_secs(3);
    const BURST: usize = 8;
    let server = TestApiServer::start().await;
    seed(&server);
    let dir = tempfile::tempdir().unwrap();
    let host = start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        kubernetes: Some(KubernetesSource::Url(server.url())),
        data_dir: Some(dir.path().to_path_buf()),
        token: Some(TOKEN.into()),
        node_name: "node-a".into(),
        min_sync_period: PERIOD,
        ..Default::default()
    })
    .await
    .expect("host starts");
    let api = Api::new(&host);
    api.wait_state("initial sync", |s| !endpoints(s, "shop/web").is_empty()).await;
    // The initial sync took one of the two applies a quiet period allows: let it come back.
    tokio::time::sleep(PERIOD + Duration::from_millis(500)).await;

    let revision = api.state().await["revision"].as_u64().unwrap();
    let started = Instant::now();
    for i in 0..BURST {
        server.create(&service(&format!("burst-{i}"), &format!("10.96.1.{}", i + 1), 80)).unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let first =
        api.wait_state("the burst's first change", |s| s["model"]["services"]["shop/burst-0"].is_object()).await;
    assert!(first["revision"].as_u64().unwrap() > revision);
    let state = api
        .wait_state("every change of the burst", |s| {
            (0..BURST).all(|i| s["model"]["services"][format!("shop/burst-{i}")].is_object())
        })
        .await;
    let waited = started.elapsed();
    let revisions = state["revision"].as_u64().unwrap() - revision;
    // Eight changes 40 ms apart, each a revision of its own without the pacing.
    assert!(revisions <= 3, "{revisions} revisions for {BURST} changes within one period");
    assert!(
        waited >= PERIOD - Duration::from_millis(500),
        "the burst's rest was applied after {waited:?}, within the period"
    );
    host.stop().await;
}

/// kube-proxy's network programming SLI: an EndpointSlice change is observed from its trigger
/// time to its service's rules written, once. Changes from before the host started, and
/// changes that need no new rules, are not observed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_programming_latency_runs_from_the_trigger_time_to_the_rules() {
    const COUNT: &str = "wasmplane_network_programming_duration_seconds_count";
    const SUM: &str = "wasmplane_network_programming_duration_seconds_sum";
    let server = TestApiServer::start().await;
    seed(&server);
    let before_start = SystemTime::now() - Duration::from_secs(3600);
    server
        .update(&triggered(slice("web-1", "web", &[("10.244.1.5", "node-a"), ("10.244.2.5", "node-b")]), before_start))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let host = start_host(&server, dir.path()).await;
    let started = SystemTime::now();
    let api = Api::new(&host);
    api.wait_state("initial sync", |s| endpoints(s, "shop/web").len() == 2).await;
    assert_eq!(api.metric(COUNT).await, 0, "the initial list's changes were made before this host could program them");

    // A change triggered a second and a half ago: its latency includes that time.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server
        .update(&triggered(
            slice("web-1", "web", &[("10.244.1.5", "node-a"), ("10.244.1.6", "node-a"), ("10.244.2.5", "node-b")]),
            started,
        ))
        .unwrap();
    api.wait_state("endpoint added", |s| endpoints(s, "shop/web").len() == 3).await;
    let until_observed = Instant::now() + Duration::from_secs(15);
    while api.metric(COUNT).await == 0 && Instant::now() < until_observed {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(api.metric(COUNT).await, 1);
    let latency = api.metric_value(SUM).await;
    assert!((1.5..60.0).contains(&latency), "latency {latency} s does not start at the trigger time");

    // A new trigger time with the same endpoints: no new rules, nothing observed.
    let events = api.metric("wasmplane_model_events_total").await;
    server
        .update(&triggered(
            slice("web-1", "web", &[("10.244.1.5", "node-a"), ("10.244.1.6", "node-a"), ("10.244.2.5", "node-b")]),
            SystemTime::now(),
        ))
        .unwrap();
    api.wait_events(events, 1, "annotation changed").await;
    // A real change, triggered before the host started: programmed, not observed.
    server.update(&triggered(slice("web-1", "web", &[("10.244.2.5", "node-b")]), before_start)).unwrap();
    api.wait_state("endpoints removed", |s| endpoints(s, "shop/web") == ["10.244.2.5"]).await;
    assert_eq!(api.metric(COUNT).await, 1);

    // A relist repeats every slice; only the one changed behind the watch is observed.
    server.create(&service("cart", "10.96.0.12", 80)).unwrap();
    api.wait_state("service added", |s| s["model"]["services"]["shop/cart"].is_object()).await;
    server.set_unavailable(true);
    server.create(&triggered(slice("cart-1", "cart", &[("10.244.1.8", "node-a")]), SystemTime::now())).unwrap();
    server.compact();
    server.set_unavailable(false);
    api.wait_state("relisted", |s| endpoints(s, "shop/cart") == ["10.244.1.8"]).await;
    let until_observed = Instant::now() + Duration::from_secs(15);
    while api.metric(COUNT).await == 1 && Instant::now() < until_observed {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(api.metric(COUNT).await, 2);
    host.stop().await;
}

fn service_cidr(name: &str, cidrs: &[&str]) -> ServiceCIDR {
    object(json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}}))
}

/// The service CIDR sets as the dataplane renders them, both families.
fn rendered_service_cidrs(host: &RunningHost) -> Vec<String> {
    let render = host.controller.lock().unwrap().dataplane().render();
    let mut cidrs: Vec<String> = render
        .lines()
        .filter(|l| l.starts_with("add element inet wasmplane service-cidrs"))
        .filter_map(|l| {
            l.split_once('{').and_then(|(_, rest)| rest.split_once('}')).map(|(inside, _)| inside.to_string())
        })
        .flat_map(|inside| inside.split(',').map(|c| c.trim().to_string()).collect::<Vec<_>>())
        .collect();
    cidrs.sort();
    cidrs
}

/// ServiceCIDR objects (Kubernetes 1.33) are watched like the other kinds and fill the
/// dataplane's service CIDRs; the other tests' server does not serve them, and the host is
/// ready all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_cidr_objects_reach_the_dataplane() {
    let server = TestApiServer::builder().resource(ResourceType::of::<ServiceCIDR>()).start().await;
    seed(&server);
    server.create(&service_cidr("kubernetes", &["10.96.0.0/16"])).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let host = start_host(&server, dir.path()).await;
    let api = Api::new(&host);
    api.wait_ready("with ServiceCIDRs served").await;
    api.wait_state("the initial range", |s| s["model"]["service_cidrs"] == json!(["10.96.0.0/16"])).await;
    assert_eq!(rendered_service_cidrs(&host), ["10.96.0.0/16"]);
    let (_, streams) = state_requests(&server, "servicecidrs.networking.k8s.io");
    assert!(streams > 0, "ServiceCIDRs are watched as the other kinds are");

    server.create(&service_cidr("secondary", &["10.100.0.0/16", "fd00:96::/108"])).unwrap();
    api.wait_state("a second object", |s| s["model"]["service_cidrs"].as_array().is_some_and(|c| c.len() == 3)).await;
    assert_eq!(rendered_service_cidrs(&host), ["10.100.0.0/16", "10.96.0.0/16", "fd00:96::/108"]);
    server.delete::<ServiceCIDR>("", "kubernetes").unwrap();
    api.wait_state("the first deleted", |s| s["model"]["service_cidrs"] == json!(["10.100.0.0/16", "fd00:96::/108"]))
        .await;
    assert_eq!(rendered_service_cidrs(&host), ["10.100.0.0/16", "fd00:96::/108"]);
    host.stop().await;
}
