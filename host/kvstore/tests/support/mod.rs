//! Shared test helpers: backends under test, and patient-but-bounded waits on
//! watch streams (every wait has a deadline, so a bug fails a test instead of
//! hanging it).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use wasmplane_kvstore::{
    EmbeddedConfig, EmbeddedStore, EtcdConfig, EtcdStore, KvError, KvStore, WatchEvent, WatchStream,
};
use wasmplane_test_etcd::Etcd;

/// Default deadline for an expected event.
pub const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A store under test and whatever must outlive it (temp dir, etcd process).
pub struct Fixture {
    pub store: Arc<dyn KvStore>,
    pub etcd: Option<Etcd>,
    pub dir: Option<tempfile::TempDir>,
}

#[derive(Debug, Clone, Copy)]
pub enum Backend {
    Memory,
    Disk,
    Etcd,
}

/// Etcd client settings for tests: short deadlines so outages show up fast.
pub fn etcd_config(endpoint: String) -> EtcdConfig {
    let mut config = EtcdConfig::new([endpoint]);
    config.request_timeout = Duration::from_secs(2);
    config.connect_timeout = Duration::from_millis(500);
    config.retry_max = Duration::from_millis(500);
    config
}

pub async fn etcd_store(endpoint: String) -> Arc<dyn KvStore> {
    Arc::new(EtcdStore::connect(etcd_config(endpoint)).await.expect("etcd client"))
}

pub async fn fixture(backend: Backend) -> Fixture {
    init_tracing();
    match backend {
        Backend::Memory => Fixture { store: Arc::new(EmbeddedStore::in_memory()), etcd: None, dir: None },
        Backend::Disk => {
            let dir = tempfile::tempdir().expect("temp dir");
            let config = EmbeddedConfig::persistent(dir.path().join("kv.redb"));
            let store = EmbeddedStore::open(config).await.expect("open embedded store");
            Fixture { store: Arc::new(store), etcd: None, dir: Some(dir) }
        }
        Backend::Etcd => {
            let etcd = Etcd::start().await.expect("etcd must start (apt-get install etcd-server)");
            let store = etcd_store(etcd.endpoint()).await;
            Fixture { store, etcd: Some(etcd), dir: None }
        }
    }
}

/// The next event, or a panic naming what was awaited.
pub async fn next_event(stream: &mut WatchStream, what: &str) -> WatchEvent {
    match tokio::time::timeout(EVENT_TIMEOUT, stream.next()).await {
        Ok(Some(Ok(event))) => event,
        Ok(Some(Err(e))) => panic!("watch failed while waiting for {what}: {e}"),
        Ok(None) => panic!("watch ended while waiting for {what}"),
        Err(_) => panic!("no event within {EVENT_TIMEOUT:?} while waiting for {what}"),
    }
}

pub async fn next_events(stream: &mut WatchStream, n: usize, what: &str) -> Vec<WatchEvent> {
    let mut events = Vec::with_capacity(n);
    for i in 0..n {
        events.push(next_event(stream, &format!("{what} (event {}/{n})", i + 1)).await);
    }
    events
}

/// Asserts nothing arrives for `quiet`.
pub async fn assert_quiet(stream: &mut WatchStream, quiet: Duration) {
    if let Ok(item) = tokio::time::timeout(quiet, stream.next()).await {
        panic!("expected no more events, got {item:?}");
    }
}

/// (key, value as string or None, revision) for compact assertions.
pub fn summary(events: &[WatchEvent]) -> Vec<(String, Option<String>)> {
    events.iter().map(|e| (e.key.clone(), e.value.as_ref().map(|v| String::from_utf8_lossy(v).into_owned()))).collect()
}

/// Retries `f` while the store reports itself unavailable (e.g. etcd restarting).
pub async fn retry_unavailable<T, F, Fut>(mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, KvError>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(KvError::Unavailable(e)) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "store unavailable; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("operation failed: {e}"),
        }
    }
}

/// Polls `check` until it is true or the deadline passes.
pub async fn eventually(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !check() {
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
