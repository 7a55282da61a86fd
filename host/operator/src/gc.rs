//! Garbage collection of kvstore entries: the host lists candidates, a decider
//! (the GC guest) names what to delete, the host deletes.
//!
//! Guarantees, whatever the decider answers:
//! - only keys this cycle offered are deleted; anything else it names is
//!   reported as refused and left alone;
//! - each deletion is conditioned on the revision the key had when offered
//!   (`delete_if_revision`), so an entry rewritten meanwhile (a node coming
//!   back, a policy recreated) survives;
//! - deletions go through a token bucket (`deletes_per_second`, `burst`), so a
//!   decider naming everything cannot flood the kvstore;
//! - an owner whose existence cannot be established (the API server is
//!   unreachable) is never reported as gone: those kinds are skipped that cycle.
//!
//! Candidates and how their owner is judged:
//! - `stale-node`: a node ID key (`<ids>/<id>` = node name); owner: the node's
//!   info key (kept alive by its lease) exists;
//! - `node-status` / `policy-status`: a per-node policy status key; the owner is
//!   gone when the node is not registered (`node-status`) or no NetworkPolicy
//!   has the status' UID (`policy-status`);
//! - `service-sync`: a key under this cluster's shared-services prefix; owner:
//!   the Service exists and is still annotated for sharing;
//! - `lock`: a key under the locks prefix; owner: the key is attached to a lease
//!   (its holder keeps it alive) or its value names a registered node.
//!
//! Ages are measured by this replica's clock from when it first saw the entry at
//! its current revision (etcd keeps no timestamps): a new leader starts every
//! age at zero, which can only delay a deletion, never hasten it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;
use kube::api::ListParams;
use tokio::time::Instant;
use tracing::{debug, info, warn};
use wasmplane_kvstore::{KvError, KvStore, Revision};

use crate::error::{Error, Result};
use crate::nodes::{NODE_IDS_PREFIX, NODE_INFO_PREFIX};
use crate::policystatus::{POLICY_STATUS_PREFIX, parse_status_key};
use crate::services::{ServiceSyncConfig, shared_service};

/// Where locks live by default.
pub const LOCKS_PREFIX: &str = "/wasmplane/locks/";

/// What kind of entry a candidate is (the WIT `candidate-kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CandidateKind {
    StaleNode,
    NodeStatus,
    PolicyStatus,
    ServiceSync,
    Lock,
    ModuleVersion,
}

impl CandidateKind {
    /// The WIT case's name (`stale-node`), as the REST API and metric labels show it.
    pub fn as_str(self) -> &'static str {
        match self {
            CandidateKind::StaleNode => "stale-node",
            CandidateKind::NodeStatus => "node-status",
            CandidateKind::PolicyStatus => "policy-status",
            CandidateKind::ServiceSync => "service-sync",
            CandidateKind::Lock => "lock",
            CandidateKind::ModuleVersion => "module-version",
        }
    }
}

impl serde::Serialize for CandidateKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// One entry offered to the decider (the WIT `candidate`, plus the revision the
/// host deletes at).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcCandidate {
    pub key: String,
    pub kind: CandidateKind,
    /// Time since this replica first saw the entry at its current revision.
    pub age: Duration,
    /// Whether the object the entry belongs to still exists.
    pub owner_exists: bool,
    /// The key's modification revision when offered.
    pub mod_revision: Revision,
}

/// Why a decider gave no answer.
#[derive(Debug, Clone, thiserror::Error)]
#[error("GC decider failed: {0}")]
pub struct DeciderError(pub String);

/// Names the candidates to delete: the GC guest (through a thin adapter over
/// its Wasm session), or any native implementation. Called off the async
/// runtime (a guest call blocks for up to its time limit).
pub trait GcDecider: Send + 'static {
    fn collect(&mut self, candidates: &[GcCandidate]) -> std::result::Result<Vec<String>, DeciderError>;
}

/// How the collector works.
#[derive(Debug, Clone)]
pub struct GcConfig {
    /// Time between two cycles.
    pub interval: Duration,
    /// Steady deletion rate.
    pub deletes_per_second: f64,
    /// Deletions allowed back to back before the rate applies.
    pub burst: u32,
    /// Most candidates offered per cycle (the rest wait for later cycles), so
    /// one guest call stays within its limits.
    pub max_candidates: usize,
    pub node_ids_prefix: String,
    pub node_info_prefix: String,
    pub policy_status_prefix: String,
    pub locks_prefix: String,
    /// This cluster's service sync; `None`: no service-sync candidates.
    pub service_sync: Option<ServiceSyncConfig>,
    /// Where each cycle is counted (shared by the collectors of every leading term).
    pub stats: Arc<GcStats>,
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig {
            interval: Duration::from_secs(60),
            deletes_per_second: 10.0,
            burst: 10,
            max_candidates: 10_000,
            node_ids_prefix: NODE_IDS_PREFIX.into(),
            node_info_prefix: NODE_INFO_PREFIX.into(),
            policy_status_prefix: POLICY_STATUS_PREFIX.into(),
            locks_prefix: LOCKS_PREFIX.into(),
            service_sync: None,
            stats: Arc::default(),
        }
    }
}

/// What one cycle did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Candidates offered to the decider.
    pub offered: usize,
    /// Keys deleted.
    pub deleted: Vec<String>,
    /// The kind of each key in `deleted`, in its order.
    pub deleted_kinds: Vec<CandidateKind>,
    /// Keys the decider named that were not offered: never deleted.
    pub refused: Vec<String>,
    /// Named keys not deleted because they changed (or vanished) since offered.
    pub changed: Vec<String>,
}

/// What GC has done since this process started, every leading term together: for
/// `GET /v1/operator` and `/metrics` (a GC that fails every cycle, a decider that refuses its
/// settings, shows here instead of only in the log).
#[derive(Debug, Default)]
pub struct GcStats(Mutex<GcStatus>);

/// A reading of [`GcStats`].
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct GcStatus {
    /// Cycles run, and how many of them failed (listing, the decider, a delete).
    pub cycles: u64,
    pub failed_cycles: u64,
    /// When the last cycle ended, and the last one that did not fail (Unix seconds).
    pub last_cycle_unix: Option<u64>,
    pub last_success_unix: Option<u64>,
    /// Why the last cycle failed; `None` once a cycle succeeds again.
    pub last_error: Option<String>,
    /// Candidates offered to the decider in the last cycle that succeeded.
    pub last_offered: usize,
    /// Keys deleted, by kind.
    pub deleted: BTreeMap<CandidateKind, u64>,
    /// Keys the decider named that were not offered (never deleted).
    pub refused: u64,
    /// Keys named but kept because they changed since they were offered.
    pub changed: u64,
}

impl GcStats {
    pub fn status(&self) -> GcStatus {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn record(&self, cycle: std::result::Result<&GcReport, &Error>) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let mut status = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        status.cycles += 1;
        status.last_cycle_unix = Some(now);
        match cycle {
            Ok(report) => {
                status.last_success_unix = Some(now);
                status.last_error = None;
                status.last_offered = report.offered;
                for kind in &report.deleted_kinds {
                    *status.deleted.entry(*kind).or_default() += 1;
                }
                status.refused += report.refused.len() as u64;
                status.changed += report.changed.len() as u64;
            }
            Err(e) => {
                status.failed_cycles += 1;
                status.last_error = Some(e.to_string());
            }
        }
    }
}

/// A token bucket: `burst` tokens, refilled at `rate` per second.
struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    fn new(rate: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        TokenBucket { rate, burst, tokens: burst, last: Instant::now() }
    }

    async fn acquire(&mut self) {
        loop {
            let now = Instant::now();
            self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(self.burst);
            self.last = now;
            if self.tokens >= 1.0 {
                self.tokens -= 1.0;
                return;
            }
            let wait = (1.0 - self.tokens) / self.rate;
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
    }
}

/// The GC duty's state: keep one per replica and run it while leading.
pub struct GarbageCollector {
    store: Arc<dyn KvStore>,
    client: Option<kube::Client>,
    decider: Arc<Mutex<dyn GcDecider>>,
    config: GcConfig,
    /// key → (revision, when first seen at that revision).
    first_seen: HashMap<String, (Revision, Instant)>,
    bucket: TokenBucket,
}

impl GarbageCollector {
    /// `client`: to judge policy-status and service-sync owners; without it those
    /// are not offered.
    pub fn new(
        store: Arc<dyn KvStore>,
        client: Option<kube::Client>,
        decider: Arc<Mutex<dyn GcDecider>>,
        config: GcConfig,
    ) -> Result<Self> {
        if !(config.deletes_per_second.is_finite() && config.deletes_per_second > 0.0) {
            return Err(Error::InvalidConfig("GC deletes_per_second must be positive".into()));
        }
        if config.interval.is_zero() {
            return Err(Error::InvalidConfig("GC interval must be positive".into()));
        }
        let bucket = TokenBucket::new(config.deletes_per_second, config.burst);
        Ok(GarbageCollector { store, client, decider, config, first_seen: HashMap::new(), bucket })
    }

    /// Runs a cycle every interval, forever (errors are logged and the next
    /// cycle retries). Run it through [`crate::Leadership::run_while_leading`]
    /// with a shared collector, e.g. behind a `tokio::sync::Mutex`.
    pub async fn run(&mut self) {
        let mut ticks = tokio::time::interval(self.config.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match self.run_once().await {
                Ok(report) if report.deleted.is_empty() && report.refused.is_empty() => {
                    debug!(offered = report.offered, "GC cycle: nothing deleted")
                }
                Ok(report) => info!(
                    offered = report.offered,
                    deleted = report.deleted.len(),
                    refused = report.refused.len(),
                    changed = report.changed.len(),
                    "GC cycle"
                ),
                Err(e) => warn!(error = %e, "GC cycle failed"),
            }
        }
    }

    /// One cycle: list candidates, ask the decider, delete what it named among
    /// them at the configured rate. Counted in [`GcConfig::stats`].
    pub async fn run_once(&mut self) -> Result<GcReport> {
        let cycle = self.cycle().await;
        self.config.stats.record(cycle.as_ref());
        cycle
    }

    async fn cycle(&mut self) -> Result<GcReport> {
        let candidates = self.candidates().await?;
        let mut report = GcReport { offered: candidates.len(), ..GcReport::default() };
        if candidates.is_empty() {
            return Ok(report);
        }
        let decider = self.decider.clone();
        let offered = candidates.clone();
        let named = tokio::task::spawn_blocking(move || {
            decider.lock().unwrap_or_else(PoisonError::into_inner).collect(&offered)
        })
        .await
        .map_err(|e| Error::Internal(format!("GC decider task: {e}")))?
        .map_err(|e| Error::Gc(e.0))?;
        let by_key: HashMap<&str, &GcCandidate> = candidates.iter().map(|c| (c.key.as_str(), c)).collect();
        let mut done = HashSet::new();
        for key in named {
            if !done.insert(key.clone()) {
                continue;
            }
            let Some(candidate) = by_key.get(key.as_str()) else {
                warn!(%key, "the GC decider named a key that was not offered; refused");
                report.refused.push(key);
                continue;
            };
            self.bucket.acquire().await;
            match self.store.delete_if_revision(&candidate.key, candidate.mod_revision).await {
                Ok(_) => {
                    debug!(key = %candidate.key, kind = ?candidate.kind, "GC deleted");
                    self.first_seen.remove(&candidate.key);
                    report.deleted.push(key);
                    report.deleted_kinds.push(candidate.kind);
                }
                Err(KvError::Conflict { .. }) => {
                    debug!(key = %candidate.key, "changed since offered; kept");
                    report.changed.push(key);
                }
                Err(e) => return Err(Error::kv(format!("GC deleting {key}"), e)),
            }
        }
        Ok(report)
    }

    /// Lists every candidate, with owners judged from one consistent look at
    /// the registry and (if a client was given) the API server.
    pub async fn candidates(&mut self) -> Result<Vec<GcCandidate>> {
        let now = Instant::now();
        let list = |prefix: String| {
            let store = self.store.clone();
            async move { store.list_prefix(&prefix).await.map_err(|e| Error::kv(format!("GC listing {prefix}"), e)) }
        };
        let info = list(self.config.node_info_prefix.clone()).await?;
        let registered: BTreeSet<String> = info
            .items
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(&self.config.node_info_prefix))
            .map(str::to_owned)
            .collect();
        let live_policies = self.live_policy_uids().await;
        let shared_services = self.shared_services().await;

        // (key, kind, owner_exists, revision)
        let mut found: Vec<(String, CandidateKind, bool, Revision)> = Vec::new();
        for kv in list(self.config.node_ids_prefix.clone()).await?.items {
            let name = String::from_utf8_lossy(&kv.value).into_owned();
            let owner = registered.contains(&name);
            found.push((kv.key, CandidateKind::StaleNode, owner, kv.mod_revision));
        }
        for kv in list(self.config.policy_status_prefix.clone()).await?.items {
            let Some((policy, node)) = parse_status_key(&self.config.policy_status_prefix, &kv.key) else {
                continue;
            };
            if !registered.contains(&node) {
                found.push((kv.key, CandidateKind::NodeStatus, false, kv.mod_revision));
            } else if let Some(live) = &live_policies {
                let owner = live.contains(&policy.uid);
                found.push((kv.key, CandidateKind::PolicyStatus, owner, kv.mod_revision));
            }
        }
        if let (Some(sync), Some(shared)) = (&self.config.service_sync, &shared_services) {
            let prefix = sync.services_prefix();
            for kv in list(prefix.clone()).await?.items {
                let Some(rest) = kv.key.strip_prefix(&prefix) else {
                    continue;
                };
                let owner = shared.contains(rest);
                found.push((kv.key, CandidateKind::ServiceSync, owner, kv.mod_revision));
            }
        }
        for kv in list(self.config.locks_prefix.clone()).await?.items {
            let holder = String::from_utf8_lossy(&kv.value);
            let owner = kv.lease.is_some() || registered.contains(holder.trim());
            found.push((kv.key, CandidateKind::Lock, owner, kv.mod_revision));
        }

        // Ages: forget keys gone or rewritten, start new ones at zero.
        let present: HashSet<&str> = found.iter().map(|(k, ..)| k.as_str()).collect();
        self.first_seen.retain(|k, _| present.contains(k.as_str()));
        let mut candidates = Vec::with_capacity(found.len().min(self.config.max_candidates));
        for (key, kind, owner_exists, mod_revision) in found {
            let seen = self.first_seen.entry(key.clone()).or_insert((mod_revision, now));
            if seen.0 != mod_revision {
                *seen = (mod_revision, now);
            }
            let age = now.duration_since(seen.1);
            if candidates.len() < self.config.max_candidates {
                candidates.push(GcCandidate { key, kind, age, owner_exists, mod_revision });
            }
        }
        Ok(candidates)
    }

    /// UIDs of every NetworkPolicy; `None` when unknown (no client, or the
    /// listing failed: then no policy is judged gone).
    async fn live_policy_uids(&self) -> Option<HashSet<String>> {
        let client = self.client.clone()?;
        let api: Api<NetworkPolicy> = Api::all(client);
        match api.list(&ListParams::default()).await {
            Ok(list) => Some(list.items.into_iter().filter_map(|p| p.metadata.uid).collect()),
            Err(e) => {
                warn!(error = %e, "GC: listing NetworkPolicies failed; policy statuses not judged");
                None
            }
        }
    }

    /// `<namespace>/<name>` of every Service annotated for sharing; `None` when
    /// unknown.
    async fn shared_services(&self) -> Option<BTreeSet<String>> {
        let sync = self.config.service_sync.as_ref()?;
        let client = self.client.clone()?;
        let api: Api<Service> = Api::all(client);
        match api.list(&ListParams::default()).await {
            Ok(list) => Some(
                list.items
                    .iter()
                    .filter_map(|s| shared_service(sync, s))
                    .map(|s| format!("{}/{}", s.namespace, s.name))
                    .collect(),
            ),
            Err(e) => {
                warn!(error = %e, "GC: listing Services failed; shared services not judged");
                None
            }
        }
    }
}

/// Counts candidates per kind (for logs and tests).
pub fn count_by_kind(candidates: &[GcCandidate]) -> BTreeMap<CandidateKind, usize> {
    let mut counts = BTreeMap::new();
    for c in candidates {
        *counts.entry(c.kind).or_default() += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn token_bucket_allows_a_burst_then_the_rate() {
        let mut bucket = TokenBucket::new(10.0, 3);
        let start = Instant::now();
        for _ in 0..3 {
            bucket.acquire().await;
        }
        assert!(start.elapsed() < Duration::from_millis(1));
        for _ in 0..10 {
            bucket.acquire().await;
        }
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(990) && elapsed <= Duration::from_millis(1100), "{elapsed:?}");
    }
}
