//! The kvstore heartbeat: the leader writes one key every interval; agents
//! report the kvstore unhealthy in `/readyz` when it goes stale.
//!
//! Staleness is judged by the agent's own clock: [`HeartbeatMonitor`] notes when
//! it last saw the key change, so clock skew between the operator and the
//! agents does not matter. Only at start-up, before any change was seen, is the
//! wall-clock time written in the value used (see [`heartbeat_is_stale`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{Instrument, debug, warn};
use wasmplane_kvstore::{Bytes, KvStore};

use crate::error::{Error, Result};

/// The heartbeat key, by default.
pub const HEARTBEAT_KEY: &str = "/wasmplane/operator/heartbeat";

/// The heartbeat's value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Heartbeat {
    /// The operator replica that wrote it.
    pub identity: String,
    /// Wall-clock time of the write, milliseconds since the Unix epoch.
    pub unix_millis: u64,
    /// Counts the writes of this leadership term.
    pub sequence: u64,
}

fn unix_millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Whether `heartbeat` (read at wall-clock `now`) is older than `max_age`;
/// a missing heartbeat is stale. Skew-sensitive: prefer [`HeartbeatMonitor`].
pub fn heartbeat_is_stale(heartbeat: Option<&Heartbeat>, now: SystemTime, max_age: Duration) -> bool {
    match heartbeat {
        None => true,
        Some(hb) => unix_millis(now).saturating_sub(hb.unix_millis) > max_age.as_millis() as u64,
    }
}

/// The leader's duty: writes the heartbeat every `interval`, forever. Run it
/// through [`crate::Leadership::run_while_leading`].
pub async fn write_heartbeats(store: Arc<dyn KvStore>, key: String, identity: String, interval: Duration) {
    let mut sequence = 0u64;
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        sequence += 1;
        let beat = Heartbeat { identity: identity.clone(), unix_millis: unix_millis(SystemTime::now()), sequence };
        let value = serde_json::to_vec(&beat).expect("a heartbeat always encodes");
        match store.put(&key, Bytes::from(value), None).await {
            Ok(_) => debug!(sequence, "heartbeat written"),
            Err(e) => warn!(error = %e, "heartbeat not written"),
        }
    }
}

#[derive(Default)]
struct Seen {
    last: Option<Heartbeat>,
    /// When (our clock) the key last changed, or the start-up estimate.
    at: Option<Instant>,
}

/// Follows the heartbeat key and tells whether it is stale.
pub struct HeartbeatMonitor {
    seen: Arc<Mutex<Seen>>,
    max_age: Duration,
    task: JoinHandle<()>,
}

impl HeartbeatMonitor {
    /// Reads the key once (failing if the store is unreachable) and follows it.
    /// `max_age` is typically three heartbeat intervals.
    pub async fn start(store: Arc<dyn KvStore>, key: impl Into<String>, max_age: Duration) -> Result<Self> {
        let key = key.into();
        let (listing, stream) = store.list_and_watch(&key).await.map_err(|e| Error::kv("reading the heartbeat", e))?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        if let Some(kv) = listing.items.iter().find(|kv| kv.key == key)
            && let Ok(beat) = serde_json::from_slice::<Heartbeat>(&kv.value)
        {
            // Before seeing a change, the written time is all we have.
            let age = Duration::from_millis(unix_millis(SystemTime::now()).saturating_sub(beat.unix_millis));
            let mut s = seen.lock().unwrap_or_else(PoisonError::into_inner);
            s.at = Instant::now().checked_sub(age);
            s.last = Some(beat);
        }
        let span = tracing::info_span!("heartbeat_monitor", key = %key);
        let task = tokio::spawn(follow(store, key, stream, seen.clone()).instrument(span));
        Ok(HeartbeatMonitor { seen, max_age, task })
    }

    /// Whether no heartbeat was seen within `max_age`.
    pub fn is_stale(&self) -> bool {
        self.age().is_none_or(|age| age > self.max_age)
    }

    /// Time since the heartbeat last changed, if it was ever seen.
    pub fn age(&self) -> Option<Duration> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).at.map(|at| at.elapsed())
    }

    /// The last heartbeat seen.
    pub fn last(&self) -> Option<Heartbeat> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).last.clone()
    }
}

impl Drop for HeartbeatMonitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn follow(
    store: Arc<dyn KvStore>,
    key: String,
    mut stream: wasmplane_kvstore::WatchStream,
    seen: Arc<Mutex<Seen>>,
) {
    loop {
        while let Some(event) = stream.next().await {
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    warn!(error = %e, "heartbeat watch ended");
                    break;
                }
            };
            // The watch is on a prefix: ignore longer keys.
            if event.key != key {
                continue;
            }
            let mut s = seen.lock().unwrap_or_else(PoisonError::into_inner);
            match event.value {
                Some(value) => {
                    s.last = serde_json::from_slice(&value).ok();
                    s.at = Some(Instant::now());
                }
                None => {
                    s.last = None;
                    s.at = None;
                }
            }
        }
        // The stream ended (store closed or failed): retry; staleness keeps
        // growing meanwhile, which is the truth.
        tokio::time::sleep(Duration::from_secs(1)).await;
        match store.watch_prefix(&key, None).await {
            Ok(s) => stream = s,
            Err(e) => debug!(error = %e, "heartbeat re-watch failed"),
        }
    }
}
