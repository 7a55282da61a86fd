//! Policy realization status: per node in the kvstore, one summary per policy in
//! the API server.
//!
//! Agents write `<prefix><uid>/<namespace>/<name>/<node>` = [`NodePolicyStatus`]
//! ([`NodeStatusWriter`] skips unchanged writes). Every operator replica follows
//! the prefix and keeps the per-policy aggregate in memory
//! ([`PolicyStatusAggregator::summary`], for the REST API); only the leader
//! writes it to the API server, as an annotation on the NetworkPolicy (JSON
//! merge patch), under two limits:
//! - per policy, at most one write per `per_policy_interval`: a burst of node
//!   updates for one policy coalesces into one write;
//! - overall, at most `max_writes_per_second`;
//!
//! and only when the summary differs from what the object already carries (on
//! gaining leadership the leader lists the policies once to learn that). So
//! API-server writes follow #policies and how often their summaries change,
//! never #policies × #nodes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{Instrument, debug, warn};
use wasmplane_kvstore::{Bytes, KvStore, WatchEvent};

use crate::error::{Error, Result, api_status};
use crate::leader::Leadership;

/// Where per-node policy status lives by default.
pub const POLICY_STATUS_PREFIX: &str = "/wasmplane/policystatus/";
/// The NetworkPolicy annotation carrying the summary.
pub const POLICY_STATUS_ANNOTATION: &str = "wasmplane.io/policy-status";
/// Failing nodes listed by name in a summary; the rest are only counted.
pub const MAX_LISTED_FAILURES: usize = 10;

/// One policy, as the status keys name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyRef {
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

/// What one node reports about one policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePolicyStatus {
    /// The policy's `metadata.generation` the node enforces.
    pub generation: i64,
    /// Why the node does not enforce it; `None` when it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl NodePolicyStatus {
    pub fn ok(generation: i64) -> Self {
        NodePolicyStatus { generation, error: None }
    }

    pub fn failed(generation: i64, error: impl Into<String>) -> Self {
        NodePolicyStatus { generation, error: Some(error.into()) }
    }
}

/// A failing node in a summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailingNode {
    pub node: String,
    pub generation: i64,
    pub error: String,
}

/// The cluster-wide status of one policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicySummary {
    pub uid: String,
    /// Nodes reporting.
    pub nodes: u32,
    /// Nodes enforcing each generation without error.
    pub enforcing: BTreeMap<i64, u32>,
    /// Nodes reporting an error.
    pub failing_count: u32,
    /// The first failing nodes by name (at most [`MAX_LISTED_FAILURES`]).
    pub failing: Vec<FailingNode>,
}

impl PolicySummary {
    /// Summarises the node statuses of one policy.
    pub fn of<'a>(uid: &str, statuses: impl IntoIterator<Item = (&'a String, &'a NodePolicyStatus)>) -> Self {
        let mut summary = PolicySummary {
            uid: uid.into(),
            nodes: 0,
            enforcing: BTreeMap::new(),
            failing_count: 0,
            failing: Vec::new(),
        };
        for (node, status) in statuses {
            summary.nodes += 1;
            match &status.error {
                None => *summary.enforcing.entry(status.generation).or_default() += 1,
                Some(error) => {
                    summary.failing_count += 1;
                    if summary.failing.len() < MAX_LISTED_FAILURES {
                        summary.failing.push(FailingNode {
                            node: node.clone(),
                            generation: status.generation,
                            error: error.clone(),
                        });
                    }
                }
            }
        }
        summary
    }
}

/// The status key of one node for one policy.
pub fn status_key(prefix: &str, policy: &PolicyRef, node: &str) -> String {
    format!("{prefix}{}/{}/{}/{node}", policy.uid, policy.namespace, policy.name)
}

/// Splits a status key into policy and node.
pub fn parse_status_key(prefix: &str, key: &str) -> Option<(PolicyRef, String)> {
    let rest = key.strip_prefix(prefix)?;
    let mut parts = rest.split('/');
    let (uid, namespace, name, node) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || [uid, namespace, name, node].iter().any(|p| p.is_empty()) {
        return None;
    }
    Some((PolicyRef { uid: uid.into(), namespace: namespace.into(), name: name.into() }, node.into()))
}

/// Agent side: writes this node's status per policy, only when it changed.
pub struct NodeStatusWriter {
    store: Arc<dyn KvStore>,
    prefix: String,
    node: String,
    written: tokio::sync::Mutex<HashMap<PolicyRef, NodePolicyStatus>>,
}

impl NodeStatusWriter {
    pub fn new(store: Arc<dyn KvStore>, prefix: impl Into<String>, node: impl Into<String>) -> Self {
        NodeStatusWriter { store, prefix: prefix.into(), node: node.into(), written: Default::default() }
    }

    /// Records this node's status for `policy`; writes only if it changed.
    pub async fn set(&self, policy: &PolicyRef, status: NodePolicyStatus) -> Result<()> {
        let mut written = self.written.lock().await;
        if written.get(policy) == Some(&status) {
            return Ok(());
        }
        let key = status_key(&self.prefix, policy, &self.node);
        let value = serde_json::to_vec(&status).map_err(|e| Error::Internal(format!("encoding status: {e}")))?;
        self.store.put(&key, Bytes::from(value), None).await.map_err(|e| Error::kv(format!("writing {key}"), e))?;
        written.insert(policy.clone(), status);
        Ok(())
    }

    /// Removes this node's status for a policy it no longer has.
    pub async fn remove(&self, policy: &PolicyRef) -> Result<()> {
        let mut written = self.written.lock().await;
        let key = status_key(&self.prefix, policy, &self.node);
        self.store.delete(&key).await.map_err(|e| Error::kv(format!("deleting {key}"), e))?;
        written.remove(policy);
        Ok(())
    }
}

/// Reads the summary of one policy straight from the kvstore (one listing):
/// for nodes that do not run the aggregator.
pub async fn read_summary(store: &dyn KvStore, prefix: &str, policy: &PolicyRef) -> Result<PolicySummary> {
    let policy_prefix = format!("{prefix}{}/{}/{}/", policy.uid, policy.namespace, policy.name);
    let listing = store.list_prefix(&policy_prefix).await.map_err(|e| Error::kv("listing policy status", e))?;
    let statuses: BTreeMap<String, NodePolicyStatus> = listing
        .items
        .iter()
        .filter_map(|kv| {
            let (_, node) = parse_status_key(prefix, &kv.key)?;
            Some((node, serde_json::from_slice(&kv.value).ok()?))
        })
        .collect();
    Ok(PolicySummary::of(&policy.uid, &statuses))
}

/// How the aggregator writes.
#[derive(Debug, Clone)]
pub struct AggregatorConfig {
    pub prefix: String,
    pub annotation: String,
    /// Least time between two writes for one policy.
    pub per_policy_interval: Duration,
    /// Most writes per second overall.
    pub max_writes_per_second: u32,
}

impl Default for AggregatorConfig {
    fn default() -> Self {
        AggregatorConfig {
            prefix: POLICY_STATUS_PREFIX.into(),
            annotation: POLICY_STATUS_ANNOTATION.into(),
            per_policy_interval: Duration::from_secs(5),
            max_writes_per_second: 20,
        }
    }
}

#[derive(Default)]
struct PolicyState {
    nodes: BTreeMap<String, NodePolicyStatus>,
    /// Revision of the latest status change (picks the newest incarnation of
    /// a recreated policy).
    last_change: i64,
    /// The annotation value the API server has, as far as we know.
    written: Option<String>,
    last_write: Option<Instant>,
    dirty: bool,
}

#[derive(Default)]
struct State {
    policies: HashMap<PolicyRef, PolicyState>,
    /// Whether the first listing has been applied.
    synced: bool,
}

struct Shared {
    state: Mutex<State>,
    wakeup: Notify,
    writes: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Operator side: follows every node's status and writes the summaries.
/// Dropping it stops both.
pub struct PolicyStatusAggregator {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl PolicyStatusAggregator {
    /// Lists the status prefix (failing if the store is unreachable), follows it,
    /// and writes summaries to the API server while `leadership` is held.
    pub async fn start(
        store: Arc<dyn KvStore>,
        client: kube::Client,
        leadership: Leadership,
        config: AggregatorConfig,
    ) -> Result<Self> {
        if config.max_writes_per_second == 0 {
            return Err(Error::InvalidConfig("max_writes_per_second must be positive".into()));
        }
        let (listing, stream) =
            store.list_and_watch(&config.prefix).await.map_err(|e| Error::kv("listing policy status", e))?;
        let shared = Arc::new(Shared { state: Mutex::default(), wakeup: Notify::new(), writes: Default::default() });
        {
            let mut state = shared.state();
            for kv in listing.items {
                apply_event(
                    &mut state,
                    &config.prefix,
                    WatchEvent { key: kv.key, value: Some(kv.value), mod_revision: kv.mod_revision },
                );
            }
            state.synced = true;
        }
        let follower = {
            let (shared, config) = (shared.clone(), config.clone());
            tokio::spawn(follow(store, stream, shared, config).instrument(tracing::info_span!("policy_status")))
        };
        let writer = {
            let shared = shared.clone();
            tokio::spawn(
                async move {
                    leadership
                        .run_while_leading("policy-status", Duration::from_secs(1), move || {
                            write_summaries(shared.clone(), client.clone(), config.clone())
                        })
                        .await
                }
                .instrument(tracing::info_span!("policy_status_writer")),
            )
        };
        Ok(PolicyStatusAggregator { shared, tasks: vec![follower, writer] })
    }

    /// The summary of a policy by namespace and name (its newest incarnation).
    pub fn summary(&self, namespace: &str, name: &str) -> Option<PolicySummary> {
        let state = self.shared.state();
        state
            .policies
            .iter()
            .filter(|(p, s)| p.namespace == namespace && p.name == name && !s.nodes.is_empty())
            .max_by_key(|(_, s)| s.last_change)
            .map(|(p, s)| PolicySummary::of(&p.uid, &s.nodes))
    }

    /// API-server writes done by this replica.
    pub fn writes(&self) -> u64 {
        self.shared.writes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for PolicyStatusAggregator {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn apply_event(state: &mut State, prefix: &str, event: WatchEvent) -> bool {
    let Some((policy, node)) = parse_status_key(prefix, &event.key) else {
        debug!(key = %event.key, "ignoring a malformed policy status key");
        return false;
    };
    let status = match event.value.as_deref().map(serde_json::from_slice::<NodePolicyStatus>) {
        None => None,
        Some(Ok(status)) => Some(status),
        Some(Err(e)) => {
            warn!(key = %event.key, error = %e, "malformed policy status; counted as absent");
            None
        }
    };
    let entry = state.policies.entry(policy).or_default();
    let changed = match status {
        Some(status) => entry.nodes.insert(node, status.clone()) != Some(status),
        None => entry.nodes.remove(&node).is_some(),
    };
    if changed {
        entry.last_change = event.mod_revision;
        entry.dirty = true;
    }
    changed
}

async fn follow(
    store: Arc<dyn KvStore>,
    mut stream: wasmplane_kvstore::WatchStream,
    shared: Arc<Shared>,
    config: AggregatorConfig,
) {
    loop {
        while let Some(event) = stream.next().await {
            match event {
                Ok(event) => {
                    if apply_event(&mut shared.state(), &config.prefix, event) {
                        shared.wakeup.notify_one();
                    }
                }
                Err(e) => {
                    warn!(error = %e, "policy status watch ended");
                    break;
                }
            }
        }
        // Terminal watch error: relist and apply the difference.
        tokio::time::sleep(Duration::from_secs(1)).await;
        match store.list_and_watch(&config.prefix).await {
            Ok((listing, s)) => {
                let mut state = shared.state();
                let present: std::collections::HashSet<String> =
                    listing.items.iter().map(|kv| kv.key.clone()).collect();
                let mut gone = Vec::new();
                for (policy, ps) in &state.policies {
                    for node in ps.nodes.keys() {
                        let key = status_key(&config.prefix, policy, node);
                        if !present.contains(&key) {
                            gone.push(key);
                        }
                    }
                }
                for key in gone {
                    apply_event(
                        &mut state,
                        &config.prefix,
                        WatchEvent { key, value: None, mod_revision: listing.revision },
                    );
                }
                for kv in listing.items {
                    apply_event(
                        &mut state,
                        &config.prefix,
                        WatchEvent { key: kv.key, value: Some(kv.value), mod_revision: kv.mod_revision },
                    );
                }
                drop(state);
                shared.wakeup.notify_one();
                stream = s;
            }
            Err(e) => debug!(error = %e, "policy status relist failed"),
        }
    }
}

/// The leader's duty: learns what the API server already carries, then writes
/// summaries that differ, within the rate limits.
async fn write_summaries(shared: Arc<Shared>, client: kube::Client, config: AggregatorConfig) {
    let all: Api<NetworkPolicy> = Api::all(client.clone());
    // What the previous leader wrote: without this, every failover would
    // rewrite every policy.
    loop {
        match all.list(&ListParams::default()).await {
            Ok(list) => {
                let mut state = shared.state();
                let mut known: HashMap<PolicyRef, String> = HashMap::new();
                for np in list.items {
                    let (Some(uid), Some(ns), Some(name)) =
                        (np.metadata.uid.clone(), np.metadata.namespace.clone(), np.metadata.name.clone())
                    else {
                        continue;
                    };
                    if let Some(value) = np.metadata.annotations.as_ref().and_then(|a| a.get(&config.annotation)) {
                        known.insert(PolicyRef { uid, namespace: ns, name }, value.clone());
                    }
                }
                for (policy, ps) in state.policies.iter_mut() {
                    ps.written = known.remove(policy);
                    ps.dirty = true;
                }
                break;
            }
            Err(e) => {
                warn!(error = %e, "listing NetworkPolicies failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    let write_gap = Duration::from_secs(1) / config.max_writes_per_second;
    loop {
        let next = next_write(&shared, &config);
        let (policy, value) = match next {
            NextWrite::Now(policy, value) => (policy, value),
            NextWrite::At(when) => {
                tokio::select! {
                    () = tokio::time::sleep_until(when) => {}
                    () = shared.wakeup.notified() => {}
                }
                continue;
            }
            NextWrite::Idle => {
                shared.wakeup.notified().await;
                continue;
            }
        };
        let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), &policy.namespace);
        let patch = serde_json::json!({"metadata": {"annotations": {config.annotation.clone(): value.clone()}}});
        let result = api.patch(&policy.name, &PatchParams::default(), &Patch::Merge(&patch)).await;
        shared.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        {
            let mut state = shared.state();
            if let Some(ps) = state.policies.get_mut(&policy) {
                ps.last_write = Some(Instant::now());
                match result {
                    Ok(_) => {
                        debug!(namespace = %policy.namespace, name = %policy.name, "policy status written");
                        ps.written = value;
                    }
                    Err(e) if api_status(&e) == Some(404) => {
                        // The policy is gone; its statuses are for GC to remove.
                        ps.written = value;
                    }
                    Err(e) => {
                        warn!(namespace = %policy.namespace, name = %policy.name, error = %e, "policy status not written; retrying later");
                        ps.dirty = true;
                    }
                }
            }
        }
        tokio::time::sleep(write_gap).await;
    }
}

enum NextWrite {
    /// Write this annotation value (`None`: remove it) now.
    Now(PolicyRef, Option<String>),
    At(Instant),
    Idle,
}

/// Picks the next policy to write: dirty, with its per-policy interval passed,
/// and a summary different from what the server has. Clears `dirty` on the one
/// it returns and on those needing no write.
fn next_write(shared: &Shared, config: &AggregatorConfig) -> NextWrite {
    let now = Instant::now();
    let mut state = shared.state();
    let mut earliest: Option<Instant> = None;
    let mut drop_empty = Vec::new();
    let mut chosen = None;
    for (policy, ps) in state.policies.iter_mut() {
        if !ps.dirty {
            continue;
        }
        if let Some(last) = ps.last_write {
            let due = last + config.per_policy_interval;
            if due > now {
                earliest = Some(earliest.map_or(due, |e: Instant| e.min(due)));
                continue;
            }
        }
        let value = if ps.nodes.is_empty() {
            None
        } else {
            Some(serde_json::to_string(&PolicySummary::of(&policy.uid, &ps.nodes)).expect("a summary always encodes"))
        };
        ps.dirty = false;
        if value == ps.written {
            if ps.nodes.is_empty() {
                drop_empty.push(policy.clone());
            }
            continue;
        }
        chosen = Some((policy.clone(), value));
        break;
    }
    for policy in drop_empty {
        state.policies.remove(&policy);
    }
    match (chosen, earliest) {
        (Some((policy, value)), _) => NextWrite::Now(policy, value),
        (None, Some(when)) => NextWrite::At(when),
        (None, None) => NextWrite::Idle,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_keys_round_trip() {
        let p = PolicyRef { uid: "u1".into(), namespace: "ns".into(), name: "deny".into() };
        let key = status_key(POLICY_STATUS_PREFIX, &p, "node-7");
        assert_eq!(key, "/wasmplane/policystatus/u1/ns/deny/node-7");
        assert_eq!(parse_status_key(POLICY_STATUS_PREFIX, &key), Some((p, "node-7".into())));
        assert_eq!(parse_status_key(POLICY_STATUS_PREFIX, "/wasmplane/policystatus/u1/ns/deny"), None);
        assert_eq!(parse_status_key(POLICY_STATUS_PREFIX, "/wasmplane/policystatus/u1/ns/deny/n/x"), None);
    }

    #[test]
    fn summary_counts_generations_and_failures() {
        let mut nodes = BTreeMap::new();
        nodes.insert("a".to_string(), NodePolicyStatus::ok(2));
        nodes.insert("b".to_string(), NodePolicyStatus::ok(2));
        nodes.insert("c".to_string(), NodePolicyStatus::ok(1));
        nodes.insert("d".to_string(), NodePolicyStatus::failed(2, "guest trapped"));
        let s = PolicySummary::of("u", &nodes);
        assert_eq!(s.nodes, 4);
        assert_eq!(s.enforcing, BTreeMap::from([(1, 1), (2, 2)]));
        assert_eq!(s.failing_count, 1);
        assert_eq!(s.failing[0].node, "d");
    }
}
