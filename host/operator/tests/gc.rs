//! The GC duty over real etcd (Debian's etcd 3.4 through the test harness) and
//! the test API server (kube's real client): candidates are judged against the
//! node registry, NetworkPolicies and Services; only keys that were offered
//! and named are deleted, at the configured rate; the default GC guest's logic
//! (native build of `guests/gc`) decides in the last test.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use tokio::time::Instant;
use wasmplane_kvstore::{Bytes, EtcdConfig, EtcdStore, KvStore};
use wasmplane_operator::policystatus::POLICY_STATUS_PREFIX;
use wasmplane_operator::{
    CandidateKind, DeciderError, GarbageCollector, GcCandidate, GcConfig, GcDecider, GcStats, LOCKS_PREFIX,
    SHARED_SERVICE_ANNOTATION, ServiceSyncConfig,
};
use wasmplane_test_apiserver::TestApiServer;
use wasmplane_test_etcd::Etcd;

const IDS: &str = "/wasmplane/nodes/ids/";
const INFO: &str = "/wasmplane/nodes/info/";

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A decider that names a fixed list of keys and records what it was offered.
struct Scripted {
    names: Vec<String>,
    offered: Arc<Mutex<Vec<GcCandidate>>>,
}

impl GcDecider for Scripted {
    fn collect(&mut self, candidates: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
        *self.offered.lock().unwrap() = candidates.to_vec();
        Ok(self.names.clone())
    }
}

async fn put(store: &dyn KvStore, key: &str, value: &str) {
    store.put(key, Bytes::copy_from_slice(value.as_bytes()), None).await.unwrap();
}

async fn keys(store: &dyn KvStore, prefix: &str) -> BTreeSet<String> {
    let listing = store.list_prefix(prefix).await.unwrap();
    listing.items.into_iter().map(|kv| kv.key).collect()
}

fn shared_service(name: &str) -> Service {
    let mut svc = Service {
        spec: Some(ServiceSpec { cluster_ip: Some("10.96.0.10".into()), ..Default::default() }),
        ..Default::default()
    };
    svc.metadata.name = Some(name.into());
    svc.metadata.namespace = Some("default".into());
    svc.metadata.annotations = Some(BTreeMap::from([(SHARED_SERVICE_ANNOTATION.to_owned(), "true".to_owned())]));
    svc
}

async fn connect(etcd: &Etcd) -> Arc<dyn KvStore> {
    Arc::new(EtcdStore::connect(EtcdConfig::new([etcd.endpoint()])).await.expect("connect to etcd"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_deletes_exactly_the_offered_keys_the_decider_named_at_the_configured_rate() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let store = connect(&etcd).await;
    let server = TestApiServer::start().await;
    let mut policy = NetworkPolicy::default();
    policy.metadata.name = Some("live".into());
    policy.metadata.namespace = Some("ns".into());
    let live_uid = server.create(&policy).unwrap().metadata.uid.unwrap();
    server.create(&shared_service("svc-live")).unwrap();
    let sync = ServiceSyncConfig::new("cluster-1");
    let services = sync.services_prefix();

    // The registry: node-a is alive (info present), node-b is not.
    put(store.as_ref(), &format!("{IDS}1"), "node-a").await;
    put(store.as_ref(), &format!("{IDS}2"), "node-b").await;
    put(store.as_ref(), &format!("{INFO}node-a"), "{}").await;
    let ps = POLICY_STATUS_PREFIX;
    let status_ok = format!("{ps}{live_uid}/ns/live/node-a");
    let status_dead_node = format!("{ps}{live_uid}/ns/live/node-b");
    let status_dead_policy = format!("{ps}deleted-uid/ns/gone/node-a");
    for key in [&status_ok, &status_dead_node, &status_dead_policy] {
        put(store.as_ref(), key, r#"{"generation":1}"#).await;
    }
    let svc_live = format!("{services}default/svc-live");
    let svc_gone = format!("{services}default/svc-gone");
    let foreign = "/wasmplane/clusters/cluster-2/services/default/svc-gone".to_owned();
    for key in [&svc_live, &svc_gone, &foreign] {
        put(store.as_ref(), key, "{}").await;
    }
    let lease = store.grant_lease(Duration::from_secs(30)).await.unwrap();
    let lock_held = format!("{LOCKS_PREFIX}held");
    store.put(&lock_held, Bytes::from_static(b"node-x"), Some(lease.id)).await.unwrap();
    let lock_orphan = format!("{LOCKS_PREFIX}orphan");
    put(store.as_ref(), &lock_orphan, "node-b").await;
    let unrelated = "/elsewhere/data".to_owned();
    put(store.as_ref(), &unrelated, "x").await;

    // The decider names every orphan but svc-gone, plus keys never offered.
    let stale_id = format!("{IDS}2");
    let named = vec![
        stale_id.clone(),
        status_dead_node.clone(),
        status_dead_policy.clone(),
        lock_orphan.clone(),
        unrelated.clone(),
        foreign.clone(),
        format!("{INFO}node-a"),
        lock_orphan.clone(), // twice: deleted once
    ];
    let offered = Arc::new(Mutex::new(Vec::new()));
    let decider = Arc::new(Mutex::new(Scripted { names: named, offered: offered.clone() }));
    const RATE: f64 = 8.0;
    let config =
        GcConfig { deletes_per_second: RATE, burst: 1, service_sync: Some(sync.clone()), ..GcConfig::default() };
    let mut gc = GarbageCollector::new(store.clone(), Some(server.client()), decider, config).unwrap();

    // Watch deletions to time them as etcd sees them.
    let mut deletions = store.watch_prefix("/", None).await.unwrap();
    let started = Instant::now();
    let report = gc.run_once().await.expect("GC cycle");
    let took = started.elapsed();

    // What was offered, with the owners judged right.
    let offered: BTreeMap<String, (CandidateKind, bool)> =
        offered.lock().unwrap().iter().map(|c| (c.key.clone(), (c.kind, c.owner_exists))).collect();
    let expected_offer: BTreeMap<String, (CandidateKind, bool)> = [
        (format!("{IDS}1"), (CandidateKind::StaleNode, true)),
        (stale_id.clone(), (CandidateKind::StaleNode, false)),
        (status_ok.clone(), (CandidateKind::PolicyStatus, true)),
        (status_dead_node.clone(), (CandidateKind::NodeStatus, false)),
        (status_dead_policy.clone(), (CandidateKind::PolicyStatus, false)),
        (svc_live.clone(), (CandidateKind::ServiceSync, true)),
        (svc_gone.clone(), (CandidateKind::ServiceSync, false)),
        (lock_held.clone(), (CandidateKind::Lock, true)),
        (lock_orphan.clone(), (CandidateKind::Lock, false)),
    ]
    .into_iter()
    .collect();
    assert_eq!(offered, expected_offer);
    assert_eq!(report.offered, 9);

    // Exactly the named ∩ offered keys are gone; the rest is refused.
    let deleted: BTreeSet<String> = report.deleted.iter().cloned().collect();
    let expected_deleted =
        BTreeSet::from([stale_id.clone(), status_dead_node.clone(), status_dead_policy.clone(), lock_orphan.clone()]);
    assert_eq!(deleted, expected_deleted);
    assert_eq!(report.deleted.len(), 4, "each key deleted once");
    assert_eq!(
        report.refused.iter().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from([unrelated.clone(), foreign.clone(), format!("{INFO}node-a")])
    );
    let remaining = keys(store.as_ref(), "/").await;
    for key in &expected_deleted {
        assert!(!remaining.contains(key), "{key} not deleted");
    }
    for key in [
        format!("{IDS}1"),
        status_ok.clone(),
        svc_live.clone(),
        svc_gone.clone(),
        foreign.clone(),
        lock_held.clone(),
        unrelated.clone(),
        format!("{INFO}node-a"),
    ] {
        assert!(remaining.contains(&key), "{key} was deleted");
    }

    // etcd saw exactly those deletions, nothing else.
    let mut seen = BTreeSet::new();
    while seen.len() < 4 {
        let event = tokio::time::timeout(Duration::from_secs(15), deletions.next())
            .await
            .expect("deletion events")
            .unwrap()
            .unwrap();
        assert!(event.is_delete(), "GC wrote {}", event.key);
        seen.insert(event.key);
    }
    assert_eq!(seen, expected_deleted);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), deletions.next()).await.is_err(),
        "more changes than the four deletions"
    );
    // The rate: with a burst of 1, four deletions span at least three gaps of 1/RATE.
    let min_span = Duration::from_secs_f64(3.0 / RATE);
    assert!(took >= min_span - Duration::from_millis(20), "4 deletions in {took:?}, faster than {RATE}/s");
    // Not throttled far past the rate; generous, as each deletion is an etcd round trip on a loaded machine.
    assert!(took < min_span + Duration::from_secs(10), "took {took:?}");

    // A key rewritten after being offered is kept, even if named.
    let offered_once = Arc::new(Mutex::new(Vec::new()));
    struct Rewrites {
        store: Arc<dyn KvStore>,
        key: String,
        offered: Arc<Mutex<Vec<GcCandidate>>>,
    }
    impl GcDecider for Rewrites {
        fn collect(&mut self, candidates: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
            *self.offered.lock().unwrap() = candidates.to_vec();
            // The owner comes back while the guest decides.
            let (store, key) = (self.store.clone(), self.key.clone());
            tokio::runtime::Handle::current()
                .block_on(async move { store.put(&key, Bytes::from_static(b"node-b"), None).await })
                .map_err(|e| DeciderError(e.to_string()))?;
            Ok(vec![self.key.clone()])
        }
    }
    let decider =
        Arc::new(Mutex::new(Rewrites { store: store.clone(), key: svc_gone.clone(), offered: offered_once.clone() }));
    let mut gc = GarbageCollector::new(
        store.clone(),
        Some(server.client()),
        decider,
        GcConfig { service_sync: Some(sync), ..GcConfig::default() },
    )
    .unwrap();
    let report = gc.run_once().await.unwrap();
    assert!(report.deleted.is_empty(), "{report:?}");
    assert_eq!(report.changed, vec![svc_gone.clone()]);
    assert!(store.get(&svc_gone).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_rate_limit_holds_over_many_deletions_and_cycles() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let store = connect(&etcd).await;
    for i in 0..30 {
        put(store.as_ref(), &format!("{LOCKS_PREFIX}l{i:02}"), "gone").await;
    }
    // Names every orphaned lock it is offered.
    struct All;
    impl GcDecider for All {
        fn collect(&mut self, candidates: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
            Ok(candidates.iter().filter(|c| !c.owner_exists).map(|c| c.key.clone()).collect())
        }
    }
    const RATE: f64 = 40.0;
    const BURST: u32 = 5;
    // Shared by every collector below, as by the collectors of successive leading terms.
    let stats = Arc::new(GcStats::default());
    let config = GcConfig {
        deletes_per_second: RATE,
        burst: BURST,
        max_candidates: 20,
        interval: Duration::from_millis(50),
        stats: stats.clone(),
        ..GcConfig::default()
    };
    let mut gc = GarbageCollector::new(store.clone(), None, Arc::new(Mutex::new(All)), config).expect("valid config");
    let started = Instant::now();
    // At most max_candidates per cycle: two cycles for 30 locks.
    let first = gc.run_once().await.unwrap();
    assert_eq!((first.offered, first.deleted.len()), (20, 20));
    let second = gc.run_once().await.unwrap();
    assert_eq!((second.offered, second.deleted.len()), (10, 10));
    let took = started.elapsed();
    // The bucket carries over cycles: 30 deletions, 5 free, 25 at 40/s.
    let min = Duration::from_secs_f64(f64::from(30 - BURST) / RATE);
    assert!(took >= min - Duration::from_millis(20), "{took:?} for 30 deletions");
    // Generous: 30 etcd round trips on a loaded machine.
    assert!(took < min + Duration::from_secs(10), "{took:?}");
    assert!(keys(store.as_ref(), LOCKS_PREFIX).await.is_empty());
    let third = gc.run_once().await.unwrap();
    assert_eq!(third.offered, 0);

    // A decider error deletes nothing.
    struct Fails;
    impl GcDecider for Fails {
        fn collect(&mut self, _: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
            Err(DeciderError("guest trapped".into()))
        }
    }
    put(store.as_ref(), &format!("{LOCKS_PREFIX}kept"), "gone").await;
    let mut failing = GarbageCollector::new(
        store.clone(),
        None,
        Arc::new(Mutex::new(Fails)),
        GcConfig { stats: stats.clone(), ..GcConfig::default() },
    )
    .unwrap();
    assert!(failing.run_once().await.is_err());
    assert_eq!(keys(store.as_ref(), LOCKS_PREFIX).await.len(), 1);

    // Every cycle counted, the failure with its reason, until a cycle succeeds again.
    let status = stats.status();
    assert_eq!((status.cycles, status.failed_cycles), (4, 1), "{status:?}");
    assert_eq!(status.deleted, BTreeMap::from([(CandidateKind::Lock, 30)]));
    assert!(status.last_error.as_deref().is_some_and(|e| e.contains("guest trapped")), "{status:?}");
    assert!(status.last_success_unix.is_some() && status.last_cycle_unix >= status.last_success_unix);
    assert_eq!(status.last_offered, 0, "the last successful cycle offered nothing");
    gc.run_once().await.unwrap();
    let status = stats.status();
    assert_eq!((status.cycles, status.failed_cycles, status.last_error.clone()), (5, 1, None), "{status:?}");
    assert_eq!(status.deleted[&CandidateKind::Lock], 31, "the lock the failing cycle kept");
    assert!(
        GarbageCollector::new(
            store.clone(),
            None,
            Arc::new(Mutex::new(All)),
            GcConfig { deletes_per_second: 0.0, ..GcConfig::default() }
        )
        .is_err()
    );
}

/// The default GC guest's logic (the same Rust the Wasm component runs),
/// adapted to the operator's decider trait.
struct DefaultGuest;

impl GcDecider for DefaultGuest {
    fn collect(&mut self, candidates: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
        use wasmplane_guest_gc::{Candidate, CandidateKind as K};
        let offered: Vec<Candidate> = candidates
            .iter()
            .map(|c| Candidate {
                key: c.key.clone(),
                kind: match c.kind {
                    CandidateKind::StaleNode => K::StaleNode,
                    CandidateKind::NodeStatus => K::NodeStatus,
                    CandidateKind::PolicyStatus => K::PolicyStatus,
                    CandidateKind::ServiceSync => K::ServiceSync,
                    CandidateKind::Lock => K::Lock,
                    CandidateKind::ModuleVersion => K::ModuleVersion,
                },
                age_seconds: c.age.as_secs(),
                owner_exists: c.owner_exists,
            })
            .collect();
        Ok(wasmplane_guest_gc::collect(&offered, &wasmplane_guest_gc::Settings::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_guest_removes_orphaned_locks_and_spares_young_orphans() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let store = connect(&etcd).await;
    put(store.as_ref(), &format!("{INFO}node-a"), "{}").await;
    put(store.as_ref(), &format!("{IDS}1"), "node-a").await;
    put(store.as_ref(), &format!("{IDS}2"), "node-gone").await;
    put(store.as_ref(), &format!("{LOCKS_PREFIX}of-a"), "node-a").await;
    put(store.as_ref(), &format!("{LOCKS_PREFIX}of-gone"), "node-gone").await;
    put(store.as_ref(), &format!("{POLICY_STATUS_PREFIX}u/ns/p/node-gone"), "{}").await;
    let mut gc =
        GarbageCollector::new(store.clone(), None, Arc::new(Mutex::new(DefaultGuest)), GcConfig::default()).unwrap();
    let report = gc.run_once().await.unwrap();
    assert_eq!(report.offered, 5);
    // Only the lock of a gone holder has no grace period; the stale node ID
    // and the dead node's status are too young (ages start at this replica's
    // first sight).
    assert_eq!(report.deleted, vec![format!("{LOCKS_PREFIX}of-gone")]);
    assert_eq!(
        keys(store.as_ref(), "/wasmplane/").await,
        BTreeSet::from([
            format!("{INFO}node-a"),
            format!("{IDS}1"),
            format!("{IDS}2"),
            format!("{LOCKS_PREFIX}of-a"),
            format!("{POLICY_STATUS_PREFIX}u/ns/p/node-gone"),
        ])
    );
}
