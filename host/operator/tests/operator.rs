//! The whole operator role on two replicas over real etcd and the test API
//! server: only the leader's duties write (heartbeat identity, GC calls); after
//! the leader dies the other replica takes over and the two never run a duty at
//! the same time. The service sync and the mesh slice sync run on one Service
//! watch, both following it through deletions, relists and restarts.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use tokio::time::Instant;
use wasmplane_kvstore::{Bytes, EtcdConfig, EtcdStore, KvStore, SharedStore, SharedStoreConfig};
use wasmplane_operator::{
    CLUSTERS_PREFIX, DeciderError, GLOBAL_SERVICE_ANNOTATION, GcCandidate, GcConfig, GcDecider, HEARTBEAT_KEY,
    Heartbeat, LOCKS_PREFIX, LeaderElectionConfig, LeaderElector, MeshSliceConfig, Operator, OperatorConfig,
    RemoteExports, SHARED_SERVICE_ANNOTATION, ServiceSyncConfig, SharedService, cluster_exports_prefix,
    follow_cluster_exports, is_mesh_slice,
};
use wasmplane_test_apiserver::{TestApiServer, Verb};
use wasmplane_test_etcd::{Etcd, TcpProxy};

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Records each GC call: (replica, start, end).
#[derive(Clone, Default)]
struct CallLog(Arc<Mutex<Vec<(String, Instant, Instant)>>>);

struct Recorder {
    replica: String,
    log: CallLog,
}

impl GcDecider for Recorder {
    fn collect(&mut self, _: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
        let start = Instant::now();
        // Long enough that two replicas collecting at once would overlap.
        std::thread::sleep(Duration::from_millis(30));
        self.log.0.lock().unwrap().push((self.replica.clone(), start, Instant::now()));
        Ok(Vec::new())
    }
}

struct Replica {
    elector: LeaderElector,
    operator: Operator,
}

async fn replica(etcd: &Etcd, server: &TestApiServer, identity: &str, log: &CallLog) -> Replica {
    let store: Arc<dyn KvStore> =
        Arc::new(EtcdStore::connect(EtcdConfig::new([etcd.endpoint()])).await.expect("connect"));
    let elector = LeaderElector::start(
        server.client(),
        LeaderElectionConfig::new("kube-system", "wasmplane-operator", identity)
            .with_lease_duration(Duration::from_secs(2)),
    )
    .unwrap();
    let config = OperatorConfig {
        heartbeat_interval: Duration::from_millis(100),
        gc: GcConfig { interval: Duration::from_millis(100), ..GcConfig::default() },
        restart_delay: Duration::from_millis(100),
        ..OperatorConfig::new(identity)
    };
    let decider = Arc::new(Mutex::new(Recorder { replica: identity.into(), log: log.clone() }));
    let operator = Operator::start(store, server.client(), elector.leadership(), Some(decider), config)
        .await
        .expect("operator starts");
    Replica { elector, operator }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_operator_replicas_fail_over_without_running_a_duty_twice() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let server = TestApiServer::start().await;
    let observer = EtcdStore::connect(EtcdConfig::new([etcd.endpoint()])).await.unwrap();
    let mut heartbeats = observer.watch_prefix(HEARTBEAT_KEY, None).await.unwrap();
    // Something for GC to be offered (the recorder names nothing).
    observer.put(&format!("{LOCKS_PREFIX}x"), Bytes::from_static(b"x"), None).await.unwrap();
    let log = CallLog::default();
    let a = replica(&etcd, &server, "replica-a", &log).await;
    let b = replica(&etcd, &server, "replica-b", &log).await;

    let deadline = Instant::now() + Duration::from_secs(15);
    while !a.elector.is_leader() && !b.elector.is_leader() {
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (leader, follower, leader_name, follower_name) =
        if a.elector.is_leader() { (a, b, "replica-a", "replica-b") } else { (b, a, "replica-b", "replica-a") };
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Both replicas aggregate status; only the leader writes anything.
    assert!(leader.operator.policy_status("ns", "none").is_none());

    // The leader crashes (no lease release).
    let killed = Instant::now();
    drop(leader);
    let mut identities = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(15), heartbeats.next())
            .await
            .expect("heartbeats keep coming")
            .unwrap()
            .unwrap();
        let beat: Heartbeat = serde_json::from_slice(&event.value.expect("never deleted")).unwrap();
        let done = beat.identity == follower_name;
        identities.push(beat.identity);
        if done {
            break;
        }
    }
    let took = killed.elapsed();
    assert!(follower.elector.is_leader());
    // On expiry of the 2 s lease, not never: generous, for a loaded machine.
    assert!(took < Duration::from_secs(10), "takeover took {took:?}");
    // Heartbeats: the old leader's, then the new one's, never interleaved.
    let first_b = identities.iter().position(|i| i == follower_name).unwrap();
    assert!(first_b >= 5, "the leader wrote heartbeats before: {identities:?}");
    assert!(identities[..first_b].iter().all(|i| i == leader_name));
    tokio::time::sleep(Duration::from_millis(500)).await;

    // GC: both replicas collected, one at a time, the old leader entirely before
    // the new one.
    let calls = log.0.lock().unwrap().clone();
    let last_a = calls.iter().filter(|c| c.0 == leader_name).map(|c| c.2).max().expect("the first leader collected");
    let first_b = calls.iter().filter(|c| c.0 == follower_name).map(|c| c.1).min().expect("the new leader collects");
    assert!(last_a <= first_b, "GC ran on both replicas at once: {calls:?}");
    drop(follower);
}

/// A Service in `namespace` with `annotations`; `cluster_ip` "None" makes it headless.
fn service(namespace: &str, name: &str, cluster_ip: &str, annotations: &[(&str, &str)]) -> Service {
    let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": namespace, "name": name, "annotations": annotations},
        "spec": {"clusterIP": cluster_ip, "ports": [{"name": "port", "port": 5432, "protocol": "TCP"}]}
    }))
    .unwrap()
}

/// A headless global Service in `db`: exported by the service sync, and given mesh slices
/// for the remote clusters' endpoints.
fn headless_global(name: &str) -> Service {
    service("db", name, "None", &[(GLOBAL_SERVICE_ANNOTATION, "true")])
}

/// East's export of its `db/<name>`, with one ready endpoint.
fn east_export(name: &str, address: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "cluster": "east", "namespace": "db", "name": name, "clusterIps": [],
            "ports": [{"name": "port", "port": 5432, "protocol": "TCP"}],
            "endpointSlices": [{"ports": [{"name": "port", "port": 5432, "protocol": "TCP"}], "addresses": [address]}]
        })
        .to_string(),
    )
}

/// What this cluster's service sync holds in the kvstore: `<namespace>/<name>` → the
/// addresses of each of its slices.
async fn synced(store: &dyn KvStore, prefix: &str) -> BTreeMap<String, Vec<Vec<String>>> {
    let listing = store.list_prefix(prefix).await.unwrap();
    listing
        .items
        .iter()
        .map(|kv| {
            let shared: SharedService = serde_json::from_slice(&kv.value).unwrap();
            let addresses = shared.endpoint_slices.into_iter().map(|s| s.addresses).collect();
            (kv.key.strip_prefix(prefix).unwrap().to_string(), addresses)
        })
        .collect()
}

/// The names of the mesh slices the API server holds.
fn mesh_slices(server: &TestApiServer) -> Vec<String> {
    server
        .list::<EndpointSlice>()
        .into_iter()
        .filter(|s| is_mesh_slice(s.metadata.labels.as_ref()))
        .map(|s| s.metadata.name.unwrap())
        .collect()
}

async fn eventually<Fut: Future<Output = bool>>(what: &str, mut done: impl FnMut() -> Fut) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Service LIST and WATCH requests served so far.
fn service_requests(server: &TestApiServer) -> (usize, usize) {
    let (lists, watches) = (server.requests_of::<Service>(Verb::List), server.requests_of::<Service>(Verb::Watch));
    assert!(
        lists.iter().chain(&watches).all(|r| r.namespace.is_none()),
        "every Service request is cluster-wide: {lists:?} {watches:?}"
    );
    (lists.len(), watches.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_sync_and_the_mesh_slice_sync_share_one_service_watch() {
    init_tracing();
    let server = TestApiServer::start().await;
    let (local, east) = (Etcd::start().await.expect("etcd"), Etcd::start().await.expect("etcd"));
    // The operator reaches its kvstore through a proxy, to make it unreachable for a while.
    let proxy = TcpProxy::start(local.client_addr()).await.expect("proxy");
    let observer = EtcdStore::connect(EtcdConfig::new([local.endpoint()])).await.unwrap();
    let east_kv: Arc<dyn KvStore> = Arc::new(EtcdStore::connect(EtcdConfig::new([east.endpoint()])).await.unwrap());
    for name in ["pg", "cache"] {
        east_kv
            .put(&format!("{CLUSTERS_PREFIX}east/services/db/{name}"), east_export(name, "10.245.0.7"), None)
            .await
            .unwrap();
        server.create(&headless_global(name)).unwrap();
    }
    server.create(&service("default", "web", "10.96.0.10", &[(SHARED_SERVICE_ANNOTATION, "true")])).unwrap();
    let web_slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "default", "name": "web-a", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["10.1.0.1"]}], "ports": [{"name": "port", "port": 5432}]
    }))
    .unwrap();
    server.create(&web_slice).unwrap();

    let (exports, received) = RemoteExports::new();
    let followed =
        SharedStore::follow(east_kv.clone(), SharedStoreConfig::new(cluster_exports_prefix(CLUSTERS_PREFIX, "east")))
            .await
            .unwrap();
    let follower = tokio::spawn(follow_cluster_exports(followed, "east".into(), exports));
    let store: Arc<dyn KvStore> = Arc::new(
        EtcdStore::connect(EtcdConfig {
            request_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(300),
            ..EtcdConfig::new([proxy.endpoint()])
        })
        .await
        .unwrap(),
    );
    let elector = LeaderElector::start(
        server.client(),
        LeaderElectionConfig::new("kube-system", "wasmplane-operator", "replica-a")
            .with_lease_duration(Duration::from_secs(4)),
    )
    .unwrap();
    let sync = ServiceSyncConfig::new("west");
    let prefix = sync.services_prefix();
    let config = OperatorConfig {
        service_sync: Some(sync),
        mesh_slices: Some(MeshSliceConfig {
            resync_interval: Duration::from_millis(500),
            ..MeshSliceConfig::new(received)
        }),
        restart_delay: Duration::from_millis(100),
        ..OperatorConfig::new("replica-a")
    };
    let operator =
        Operator::start(store, server.client(), elector.leadership(), None, config).await.expect("operator starts");

    // Both duties work: the shared Services in the kvstore, east's endpoints as slices here.
    let web = || ("default/web".to_string(), vec![vec!["10.1.0.1".to_string()]]);
    let headless = |name: &str| (format!("db/{name}"), Vec::new());
    let all = BTreeMap::from([web(), headless("cache"), headless("pg")]);
    eventually("the shared Services synced", || async { synced(&observer, &prefix).await == all }).await;
    eventually("east's endpoints as mesh slices", || async { mesh_slices(&server) == ["cache-east-0", "pg-east-0"] })
        .await;
    // On one Service list and watch.
    eventually("the Service watch open", || async { service_requests(&server).1 >= 1 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(service_requests(&server), (1, 1), "Service (lists, watches) of the operator");

    // A Service deleted: both duties see it.
    server.delete::<Service>("db", "pg").unwrap();
    let without_pg = BTreeMap::from([web(), headless("cache")]);
    eventually("pg's export gone", || async { synced(&observer, &prefix).await == without_pg }).await;
    eventually("pg's mesh slice gone", || async { mesh_slices(&server) == ["cache-east-0"] }).await;

    // A Service deleted while the watch is broken and the history compacted: the one watch
    // relists, and both duties take the relist, deletion included.
    server.set_unavailable(true);
    server.delete::<Service>("db", "cache").unwrap();
    server.compact();
    server.set_unavailable(false);
    eventually("cache's export gone after the relist", || async {
        synced(&observer, &prefix).await == BTreeMap::from([web()])
    })
    .await;
    eventually("cache's mesh slice gone after the relist", || async { mesh_slices(&server).is_empty() }).await;
    assert_eq!(service_requests(&server).0, 2, "one relist, of one watch");

    // The kvstore unreachable: the service sync fails and is restarted again and again, the
    // mesh slice sync goes on. Once the kvstore is back, the restarted service sync has the
    // whole current picture from the shared watch, without a list of its own.
    proxy.cut().await;
    server.delete::<Service>("default", "web").unwrap();
    server.create(&service("default", "api", "10.96.0.11", &[(SHARED_SERVICE_ANNOTATION, "true")])).unwrap();
    server.create(&headless_global("pg")).unwrap();
    eventually("pg's mesh slice back while the kvstore is away", || async { mesh_slices(&server) == ["pg-east-0"] })
        .await;
    // Long enough for the service sync to fail on the kvstore (a request timeout).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(synced(&observer, &prefix).await, BTreeMap::from([web()]), "written while cut off");
    proxy.restore();
    let api = ("default/api".to_string(), Vec::new());
    let after = BTreeMap::from([api, headless("pg")]);
    eventually("the restarted service sync caught up", || async { synced(&observer, &prefix).await == after }).await;
    assert_eq!(service_requests(&server).0, 2, "a restarted duty lists nothing itself");

    // Leadership lost: the watch stops with the duties.
    elector.shutdown().await.unwrap();
    eventually("every watch closed", || async { server.open_watches() == 0 }).await;
    drop(operator);
    follower.abort();
}
