//! The heartbeat: written by the leader's duty, judged stale by agents when it
//! stops, over real etcd and the embedded store.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;
use wasmplane_kvstore::{Bytes, EmbeddedStore, EtcdConfig, EtcdStore, KvStore};
use wasmplane_operator::{
    HEARTBEAT_KEY, Heartbeat, HeartbeatMonitor, Leadership, heartbeat_is_stale, write_heartbeats,
};
use wasmplane_test_etcd::Etcd;

const INTERVAL: Duration = Duration::from_millis(200);
// Ten intervals: a write delayed on a loaded machine is no gap.
const MAX_AGE: Duration = Duration::from_secs(2);

async fn eventually(what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < Duration::from_secs(15), "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

async fn scenario(store: Arc<dyn KvStore>) {
    let monitor = HeartbeatMonitor::start(store.clone(), HEARTBEAT_KEY, MAX_AGE).await.expect("monitor");
    assert!(monitor.is_stale(), "no heartbeat yet");

    let leadership = Leadership::always();
    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            leadership
                .run_while_leading("heartbeat", Duration::from_millis(100), move || {
                    write_heartbeats(store.clone(), HEARTBEAT_KEY.into(), "operator-0".into(), INTERVAL)
                })
                .await
        })
    };
    eventually("the heartbeat is fresh", || !monitor.is_stale()).await;
    // It stays fresh while written: several intervals later, sequence advanced.
    tokio::time::sleep(INTERVAL * 4).await;
    assert!(!monitor.is_stale());
    let last = monitor.last().expect("a heartbeat seen");
    assert_eq!(last.identity, "operator-0");
    assert!(last.sequence >= 3, "sequence {}", last.sequence);

    // The leader stops writing: stale after about MAX_AGE.
    writer.abort();
    let _ = writer.await;
    let stopped = Instant::now();
    eventually("the heartbeat goes stale", || monitor.is_stale()).await;
    assert!(stopped.elapsed() >= MAX_AGE - INTERVAL, "stale too early: {:?}", stopped.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_over_real_etcd() {
    let etcd = Etcd::start().await.expect("etcd");
    let store = EtcdStore::connect(EtcdConfig::new([etcd.endpoint()])).await.expect("connect");
    scenario(Arc::new(store)).await;
}

#[tokio::test]
async fn heartbeat_over_the_embedded_store() {
    scenario(Arc::new(EmbeddedStore::in_memory())).await;
}

#[tokio::test]
async fn a_monitor_started_late_uses_the_written_time() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let old = Heartbeat { identity: "op".into(), unix_millis: now_ms - 10_000, sequence: 7 };
    store.put(HEARTBEAT_KEY, Bytes::from(serde_json::to_vec(&old).unwrap()), None).await.unwrap();
    let monitor = HeartbeatMonitor::start(store.clone(), HEARTBEAT_KEY, MAX_AGE).await.unwrap();
    assert!(monitor.is_stale(), "a 10 s old heartbeat is stale");
    let fresh = Heartbeat { identity: "op".into(), unix_millis: now_ms, sequence: 8 };
    store.put(HEARTBEAT_KEY, Bytes::from(serde_json::to_vec(&fresh).unwrap()), None).await.unwrap();
    eventually("a new write makes it fresh", || !monitor.is_stale()).await;
    // A longer key under the same prefix is not the heartbeat.
    let other = Heartbeat { identity: "other".into(), unix_millis: now_ms, sequence: 99 };
    store.put(&format!("{HEARTBEAT_KEY}-other"), Bytes::from(serde_json::to_vec(&other).unwrap()), None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(monitor.last().map(|h| h.sequence), Some(8));

    let now = SystemTime::now();
    assert!(heartbeat_is_stale(None, now, MAX_AGE));
    assert!(heartbeat_is_stale(Some(&old), now, MAX_AGE));
    assert!(!heartbeat_is_stale(Some(&fresh), now, Duration::from_secs(60)));
}
