//! The whole operator role on two replicas over real etcd and the test API
//! server: only the leader's duties write (heartbeat identity, GC calls); after
//! the leader dies the other replica takes over and the two never run a duty at
//! the same time.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use tokio::time::Instant;
use wasmplane_kvstore::{Bytes, EtcdConfig, EtcdStore, KvStore};
use wasmplane_operator::{
    DeciderError, GcCandidate, GcConfig, GcDecider, HEARTBEAT_KEY, Heartbeat, LOCKS_PREFIX,
    LeaderElectionConfig, LeaderElector, Operator, OperatorConfig,
};
use wasmplane_test_apiserver::TestApiServer;
use wasmplane_test_etcd::Etcd;

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
        self.log
            .0
            .lock()
            .unwrap()
            .push((self.replica.clone(), start, Instant::now()));
        Ok(Vec::new())
    }
}

struct Replica {
    elector: LeaderElector,
    operator: Operator,
}

async fn replica(etcd: &Etcd, server: &TestApiServer, identity: &str, log: &CallLog) -> Replica {
    let store: Arc<dyn KvStore> = Arc::new(
        EtcdStore::connect(EtcdConfig::new([etcd.endpoint()]))
            .await
            .expect("connect"),
    );
    let elector = LeaderElector::start(
        server.client(),
        LeaderElectionConfig::new("kube-system", "wasmplane-operator", identity)
            .with_lease_duration(Duration::from_secs(2)),
    )
    .unwrap();
    let config = OperatorConfig {
        heartbeat_interval: Duration::from_millis(100),
        gc: GcConfig {
            interval: Duration::from_millis(100),
            ..GcConfig::default()
        },
        restart_delay: Duration::from_millis(100),
        ..OperatorConfig::new(identity)
    };
    let decider = Arc::new(Mutex::new(Recorder {
        replica: identity.into(),
        log: log.clone(),
    }));
    let operator = Operator::start(
        store,
        server.client(),
        elector.leadership(),
        Some(decider),
        config,
    )
    .await
    .expect("operator starts");
    Replica { elector, operator }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_operator_replicas_fail_over_without_running_a_duty_twice() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let server = TestApiServer::start().await;
    let observer = EtcdStore::connect(EtcdConfig::new([etcd.endpoint()]))
        .await
        .unwrap();
    let mut heartbeats = observer.watch_prefix(HEARTBEAT_KEY, None).await.unwrap();
    // Something for GC to be offered (the recorder names nothing).
    observer
        .put(&format!("{LOCKS_PREFIX}x"), Bytes::from_static(b"x"), None)
        .await
        .unwrap();
    let log = CallLog::default();
    let a = replica(&etcd, &server, "replica-a", &log).await;
    let b = replica(&etcd, &server, "replica-b", &log).await;

    let deadline = Instant::now() + Duration::from_secs(5);
    while !a.elector.is_leader() && !b.elector.is_leader() {
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (leader, follower, leader_name, follower_name) = if a.elector.is_leader() {
        (a, b, "replica-a", "replica-b")
    } else {
        (b, a, "replica-b", "replica-a")
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Both replicas aggregate status; only the leader writes anything.
    assert!(leader.operator.policy_status("ns", "none").is_none());

    // The leader crashes (no lease release).
    let killed = Instant::now();
    drop(leader);
    let mut identities = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(8), heartbeats.next())
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
    assert!(took < Duration::from_secs(5), "takeover took {took:?}");
    // Heartbeats: the old leader's, then the new one's, never interleaved.
    let first_b = identities.iter().position(|i| i == follower_name).unwrap();
    assert!(
        first_b >= 5,
        "the leader wrote heartbeats before: {identities:?}"
    );
    assert!(identities[..first_b].iter().all(|i| i == leader_name));
    tokio::time::sleep(Duration::from_millis(500)).await;

    // GC: both replicas collected, one at a time, the old leader entirely before
    // the new one.
    let calls = log.0.lock().unwrap().clone();
    let last_a = calls
        .iter()
        .filter(|c| c.0 == leader_name)
        .map(|c| c.2)
        .max()
        .expect("the first leader collected");
    let first_b = calls
        .iter()
        .filter(|c| c.0 == follower_name)
        .map(|c| c.1)
        .min()
        .expect("the new leader collects");
    assert!(
        last_a <= first_b,
        "GC ran on both replicas at once: {calls:?}"
    );
    drop(follower);
}
