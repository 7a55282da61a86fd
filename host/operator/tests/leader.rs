//! Leader election against the test API server (kube's real client, the real
//! Lease resource with resourceVersion conflicts): one leader among replicas,
//! takeover after a crash within about one lease duration, immediate handover
//! on shutdown, step-down when the API server is unreachable, and a duty that
//! never runs on two replicas at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use tokio::time::Instant;
use wasmplane_operator::{LeaderElectionConfig, LeaderElector, Leadership};
use wasmplane_test_apiserver::TestApiServer;

const LEASE: Duration = Duration::from_secs(2);
const NAMESPACE: &str = "kube-system";
const LEASE_NAME: &str = "wasmplane-operator";

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn elector(server: &TestApiServer, identity: &str) -> LeaderElector {
    let config = LeaderElectionConfig::new(NAMESPACE, LEASE_NAME, identity).with_lease_duration(LEASE);
    LeaderElector::start(server.client(), config).expect("valid config")
}

/// One run of a duty on one replica.
#[derive(Debug, Clone)]
struct DutyRun {
    replica: String,
    start: Instant,
    stop: Option<Instant>,
}

#[derive(Clone, Default)]
struct DutyLog(Arc<Mutex<Vec<DutyRun>>>);

impl DutyLog {
    fn runs(&self) -> Vec<DutyRun> {
        self.0.lock().unwrap().clone()
    }

    /// Runs a duty that records when it starts and when it is stopped, while
    /// `leadership` holds.
    fn spawn_duty(&self, replica: &str, leadership: Leadership) -> tokio::task::JoinHandle<()> {
        let log = self.clone();
        let replica = replica.to_owned();
        tokio::spawn(async move {
            leadership
                .run_while_leading("recorder", Duration::from_millis(100), move || {
                    let log = log.clone();
                    let replica = replica.clone();
                    async move {
                        let index = {
                            let mut runs = log.0.lock().unwrap();
                            runs.push(DutyRun { replica, start: Instant::now(), stop: None });
                            runs.len() - 1
                        };
                        // Records the stop when the duty is cancelled (dropped).
                        struct StopRecorder(DutyLog, usize);
                        impl Drop for StopRecorder {
                            fn drop(&mut self) {
                                self.0.0.lock().unwrap()[self.1].stop = Some(Instant::now());
                            }
                        }
                        let _stop = StopRecorder(log, index);
                        std::future::pending::<()>().await
                    }
                })
                .await
        })
    }

    /// Fails if two runs on different replicas overlap in time.
    fn assert_never_concurrent(&self) {
        let mut runs = self.runs();
        runs.sort_by_key(|r| r.start);
        for pair in runs.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let a_stop = a.stop.unwrap_or_else(|| panic!("run {a:?} still going while {b:?} started"));
            assert!(a_stop <= b.start, "duty ran twice at once: {a:?} and {b:?}");
        }
    }
}

async fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if condition() {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

fn leaders(electors: &[(&str, &LeaderElector)]) -> Vec<String> {
    electors.iter().filter(|(_, e)| e.is_leader()).map(|(n, _)| n.to_string()).collect()
}

#[tokio::test]
async fn two_replicas_one_leader_and_takeover_after_the_leader_dies() {
    init_tracing();
    let server = TestApiServer::start().await;
    let log = DutyLog::default();
    let a = elector(&server, "replica-a");
    let b = elector(&server, "replica-b");
    let duty_a = log.spawn_duty("replica-a", a.leadership());
    let duty_b = log.spawn_duty("replica-b", b.leadership());

    wait_until(Duration::from_secs(5), || a.is_leader() || b.is_leader()).await.expect("a leader within 5 s");
    // For a while (several renewals), exactly one leads.
    for _ in 0..150 {
        let now = leaders(&[("a", &a), ("b", &b)]);
        assert_eq!(now.len(), 1, "exactly one leader expected, got {now:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lease: Lease = server.get(NAMESPACE, LEASE_NAME).expect("lease created");
    let (leader, follower, follower_name) = if a.is_leader() { (a, b, "replica-b") } else { (b, a, "replica-a") };
    let spec = lease.spec.expect("lease spec");
    assert_ne!(spec.holder_identity.as_deref(), Some(follower_name));
    assert_eq!(spec.lease_duration_seconds, Some(2));

    // Crash the leader: no release, the lease must expire.
    let killed = Instant::now();
    drop(leader);
    let took = wait_until(Duration::from_secs(8), || follower.is_leader()).await.expect("the follower takes over");
    // It waited for the lease to expire (at least L minus one renewal period)
    // and not much longer than one lease duration.
    assert!(took >= Duration::from_millis(1200), "took over too early ({took:?}): the lease was still valid");
    assert!(took <= LEASE + Duration::from_millis(1500), "takeover took {took:?}");
    tracing::info!(after = ?killed.elapsed(), "takeover");

    tokio::time::sleep(Duration::from_millis(500)).await;
    let lease: Lease = server.get(NAMESPACE, LEASE_NAME).expect("lease");
    let spec = lease.spec.expect("lease spec");
    assert_eq!(spec.holder_identity.as_deref(), Some(follower_name));
    assert_eq!(spec.lease_transitions, Some(1));

    let runs = log.runs();
    assert_eq!(runs.len(), 2, "one duty run per leadership term: {runs:?}");
    assert_eq!(runs[1].replica, follower_name);
    assert!(runs[0].stop.is_some(), "the dead leader's duty stopped");
    log.assert_never_concurrent();
    drop(follower);
    for duty in [duty_a, duty_b] {
        tokio::time::timeout(Duration::from_secs(2), duty).await.expect("duty runner ends with its elector").unwrap();
    }
    log.assert_never_concurrent();
}

#[tokio::test]
async fn graceful_shutdown_hands_over_without_waiting_for_expiry() {
    init_tracing();
    let server = TestApiServer::start().await;
    let log = DutyLog::default();
    let a = elector(&server, "replica-a");
    log.spawn_duty("replica-a", a.leadership());
    wait_until(Duration::from_secs(5), || a.is_leader()).await.expect("a leads");
    let b = elector(&server, "replica-b");
    log.spawn_duty("replica-b", b.leadership());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!b.is_leader());

    let stopped = Instant::now();
    a.shutdown().await.expect("release");
    let took = wait_until(Duration::from_secs(5), || b.is_leader()).await.expect("b takes over");
    // b only polls every L/3; without the release it would wait ~L.
    assert!(took < Duration::from_millis(1200), "handover took {took:?} after shutdown at {stopped:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    log.assert_never_concurrent();
    assert_eq!(log.runs().len(), 2);
}

#[tokio::test]
async fn leader_steps_down_when_it_cannot_renew() {
    init_tracing();
    let server = TestApiServer::start().await;
    let log = DutyLog::default();
    let a = elector(&server, "replica-a");
    let b = elector(&server, "replica-b");
    log.spawn_duty("replica-a", a.leadership());
    log.spawn_duty("replica-b", b.leadership());
    wait_until(Duration::from_secs(5), || a.is_leader() || b.is_leader()).await.expect("a leader");

    server.set_unavailable(true);
    let down = Instant::now();
    let stepped_down =
        wait_until(Duration::from_secs(5), || !a.is_leader() && !b.is_leader()).await.expect("the leader steps down");
    // Renew deadline is 2L/3; it must be gone well before the lease expires.
    assert!(stepped_down < LEASE, "stepped down after {stepped_down:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(log.runs().iter().all(|r| r.stop.is_some()), "duty still running after step-down: {:?}", log.runs());
    tracing::info!(after = ?down.elapsed(), "stepped down");

    // Nobody can lead while the API server is unreachable.
    tokio::time::sleep(LEASE).await;
    assert!(!a.is_leader() && !b.is_leader());

    server.set_unavailable(false);
    wait_until(Duration::from_secs(6), || a.is_leader() || b.is_leader()).await.expect("a leader again");
    for _ in 0..50 {
        assert!(!(a.is_leader() && b.is_leader()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    log.assert_never_concurrent();
}

#[tokio::test]
async fn five_racing_replicas_elect_exactly_one() {
    init_tracing();
    let server = TestApiServer::start().await;
    let names = ["r1", "r2", "r3", "r4", "r5"];
    let electors: Vec<LeaderElector> = names.iter().map(|n| elector(&server, n)).collect();
    let pairs: Vec<(&str, &LeaderElector)> = names.iter().copied().zip(electors.iter()).collect();
    wait_until(Duration::from_secs(5), || !leaders(&pairs).is_empty()).await.expect("a leader");
    for _ in 0..100 {
        let now = leaders(&pairs);
        assert_eq!(now.len(), 1, "exactly one leader expected, got {now:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn embedded_mode_always_leads() {
    let leadership = Leadership::always();
    assert!(leadership.is_leader());
    let log = DutyLog::default();
    let runner = log.spawn_duty("embedded", leadership.clone());
    wait_until(Duration::from_secs(2), || log.runs().len() == 1).await.expect("duty started");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(log.runs().len(), 1);
    assert!(log.runs()[0].stop.is_none(), "the duty keeps running");
    runner.abort();
}

#[test]
fn invalid_configurations_are_refused() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let server = TestApiServer::start().await;
        let mut config = LeaderElectionConfig::new(NAMESPACE, LEASE_NAME, "x").with_lease_duration(LEASE);
        config.renew_deadline = LEASE;
        assert!(LeaderElector::start(server.client(), config).is_err());
        let config = LeaderElectionConfig::new(NAMESPACE, LEASE_NAME, "");
        assert!(LeaderElector::start(server.client(), config).is_err());
    });
}
