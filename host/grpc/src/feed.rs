//! The feed the host publishes the model's revisions into, and the stats it keeps.
//!
//! Publishing costs O(change): a [`Delta`] holds the `Arc`s of the service views the model
//! already made, and one `Arc<Delta>` goes into a bounded broadcast ring that every watch
//! reads from. No revision ever copies the whole model; only a watch that starts, or one that
//! fell so far behind that the ring dropped deltas it had not read, asks the host for a
//! [`Snapshot`] (and pays O(model) once, for that watch alone).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{broadcast, watch};
use tonic::Code;
use wasmplane_model::NodeLocalModel;
use wasmplane_model::ServiceView;
use wasmplane_model::state::{ModelUpdate, NodeContext, ServiceChange};

/// This node as a watch sees it: the guests' context, and, outside it (neither translates
/// any service again when it changes), whether the node is being deleted and the cluster's
/// service CIDRs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    pub context: NodeContext,
    pub being_deleted: bool,
    pub service_cidrs: Vec<ipnet::IpNet>,
}

impl NodeFacts {
    pub fn of(model: &NodeLocalModel) -> NodeFacts {
        NodeFacts {
            context: model.context.clone(),
            being_deleted: model.node_being_deleted,
            service_cidrs: model.service_cidrs.clone(),
        }
    }
}

impl From<NodeContext> for NodeFacts {
    fn from(context: NodeContext) -> Self {
        NodeFacts { context, ..NodeFacts::default() }
    }
}

/// The whole model at one revision, as a watch's first message (or a resync) needs it.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub revision: u64,
    pub node: NodeFacts,
    pub services: Vec<Arc<ServiceView>>,
}

impl Snapshot {
    /// The model as it is. O(services) `Arc` clones: call it under the host's model lock.
    pub fn of(model: &NodeLocalModel) -> Snapshot {
        Snapshot {
            revision: model.revision,
            node: NodeFacts::of(model),
            services: model.services.values().cloned().collect(),
        }
    }
}

/// What changed at `revision` (from `revision - 1`).
#[derive(Clone, Debug)]
pub struct Delta {
    pub revision: u64,
    /// The node's facts, if they changed at this revision.
    pub node: Option<NodeFacts>,
    /// Service views that changed; `view: None` is a delete.
    pub changes: Vec<ServiceChange>,
}

impl Delta {
    /// The delta of the update `model` has just applied. Call it for every non-empty update,
    /// including those that only touched pods or policies: the revision moved, and a watch
    /// that sees a revision skipped has to resync with a full snapshot.
    pub fn from_update(model: &NodeLocalModel, update: &ModelUpdate) -> Delta {
        Delta {
            revision: model.revision,
            node: (update.context_changed || update.node_being_deleted_changed || update.service_cidrs_changed)
                .then(|| NodeFacts::of(model)),
            changes: update.changed.clone(),
        }
    }
}

/// Where a watch gets the full model from.
///
/// The snapshot must be consistent with the published deltas: the state at
/// `snapshot.revision`, with every delta up to that revision already applied. Taking it
/// under the same lock under which the host updates the model (and publishes) guarantees it.
/// It is called on a blocking thread (never on an async worker), so a blocking lock is fine.
pub trait SnapshotSource: Send + Sync + 'static {
    fn snapshot(&self) -> Snapshot;
}

impl<F> SnapshotSource for F
where
    F: Fn() -> Snapshot + Send + Sync + 'static,
{
    fn snapshot(&self) -> Snapshot {
        self()
    }
}

/// Counters of the feed, for `/metrics` and the stats log line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedStats {
    /// Watches streaming now.
    pub subscribers: usize,
    /// Watches ever started.
    pub watches: u64,
    /// Revisions published by the host.
    pub published: u64,
    /// Complete snapshots sent (initial ones and resyncs).
    pub snapshots_sent: u64,
    /// Deltas sent, over all watches.
    pub deltas_sent: u64,
    /// Snapshots sent because a watch read so slowly that the ring dropped deltas it needed.
    pub resyncs_lagged: u64,
    /// Snapshots sent because the published revisions had a gap or went out of order: a bug
    /// in the host's publishing, made harmless by the resync but worth alerting on.
    pub resyncs_gap: u64,
    /// Watches refused before they started (not in `watches`).
    pub refused: RefusedWatches,
}

/// gRPC's status codes: `Ok` (0) to `Unauthenticated` (16).
const STATUS_CODES: usize = 17;

/// Where a refusal with `code` is counted. A code beyond gRPC's (none exists today) counts
/// as `Unknown`, which is also what [`Code::from_i32`] makes of it.
fn code_slot(code: Code) -> usize {
    usize::try_from(i32::from(code)).ok().filter(|&slot| slot < STATUS_CODES).unwrap_or(Code::Unknown as usize)
}

/// Watches refused before they started, by the status code they were answered with: the
/// [`crate::Authorize`] hook's refusals (`Unauthenticated`, `PermissionDenied`, ...) and
/// `Unavailable` for calls that came while the feed or server was shutting down.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct RefusedWatches([u64; STATUS_CODES]);

impl RefusedWatches {
    pub fn get(&self, code: Code) -> u64 {
        self.0[code_slot(code)]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// The codes refused at least once, with their counts, in code order.
    pub fn iter(&self) -> impl Iterator<Item = (Code, u64)> + '_ {
        self.0
            .iter()
            .enumerate()
            .filter(|(_, count)| **count > 0)
            .map(|(slot, count)| (Code::from_i32(slot as i32), *count))
    }
}

impl std::fmt::Debug for RefusedWatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) watches: AtomicU64,
    pub(crate) published: AtomicU64,
    pub(crate) snapshots_sent: AtomicU64,
    pub(crate) deltas_sent: AtomicU64,
    pub(crate) resyncs_lagged: AtomicU64,
    pub(crate) resyncs_gap: AtomicU64,
    refused: [AtomicU64; STATUS_CODES],
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn refused(&self, code: Code) {
        Counters::bump(&self.refused[code_slot(code)]);
    }
}

pub(crate) struct Inner {
    pub(crate) deltas: broadcast::Sender<Arc<Delta>>,
    pub(crate) source: Arc<dyn SnapshotSource>,
    pub(crate) counters: Counters,
    /// Set once by [`ModelFeed::close`]; every watch ends when it sees it.
    pub(crate) closed: watch::Sender<bool>,
    /// The last revision published (0: none yet; the model's first revision is 1), to warn
    /// about out-of-order publishing where it happens rather than only in the watches.
    last_published: AtomicU64,
}

/// The node-local model's revisions, fanned out to every watch. Cheap to clone.
#[derive(Clone)]
pub struct ModelFeed {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for ModelFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFeed").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl ModelFeed {
    /// `capacity` is how many revisions a watch may fall behind before it is resynced with a
    /// full snapshot instead: size it so that a burst of changes (a rollout, a relist) fits,
    /// since every resync costs a full model transfer. It should also cover the revisions
    /// made while one snapshot is being sent, or a client of a large, busy model may resync
    /// again right after each snapshot. Clamped to at least 1.
    pub fn new(source: Arc<dyn SnapshotSource>, capacity: usize) -> Self {
        let (deltas, _) = broadcast::channel(capacity.max(1));
        let (closed, _) = watch::channel(false);
        ModelFeed {
            inner: Arc::new(Inner {
                deltas,
                source,
                counters: Counters::default(),
                closed,
                last_published: AtomicU64::new(0),
            }),
        }
    }

    /// Hands one revision to every watch. Call it for every revision, in revision order
    /// (from the task that updates the model, or under its lock): watches rely on deltas
    /// being contiguous and resync when they are not. Never blocks and never waits for a
    /// watch; with no watch, the delta is simply dropped.
    pub fn publish(&self, delta: Delta) {
        let previous = self.inner.last_published.swap(delta.revision, Ordering::Relaxed);
        if previous != 0 && delta.revision != previous + 1 {
            tracing::warn!(
                previous,
                revision = delta.revision,
                "model revisions published out of order; watches will resync"
            );
        }
        Counters::bump(&self.inner.counters.published);
        // An error only means nobody is watching right now.
        let _ = self.inner.deltas.send(Arc::new(delta));
    }

    /// Watches streaming now.
    pub fn subscribers(&self) -> usize {
        self.inner.deltas.receiver_count()
    }

    pub fn stats(&self) -> FeedStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FeedStats {
            subscribers: self.subscribers(),
            watches: get(&c.watches),
            published: get(&c.published),
            snapshots_sent: get(&c.snapshots_sent),
            deltas_sent: get(&c.deltas_sent),
            resyncs_lagged: get(&c.resyncs_lagged),
            resyncs_gap: get(&c.resyncs_gap),
            refused: RefusedWatches(std::array::from_fn(|slot| get(&c.refused[slot]))),
        }
    }

    /// Ends every watch (their streams finish cleanly) and refuses new ones. Needed before a
    /// graceful server shutdown when the service was added to a server by hand: a watch
    /// never ends on its own, so the server would wait for it forever. [`crate::serve`] does
    /// the equivalent for its own watches.
    pub fn close(&self) {
        self.inner.closed.send_replace(true);
    }

    pub fn is_closed(&self) -> bool {
        *self.inner.closed.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty(revision: u64) -> Snapshot {
        Snapshot { revision, node: NodeFacts::default(), services: vec![] }
    }

    #[test]
    fn a_delta_carries_the_node_when_it_starts_or_stops_being_deleted() {
        use wasmplane_model::state::{ClusterEvent, ClusterObject, ClusterState};
        use wasmplane_model::{Labels, Node};
        let (mut cluster, mut model) = (ClusterState::new(), NodeLocalModel::new("node-a", vec![]));
        let mut publish = |being_deleted: bool| {
            let node = Node {
                name: "node-a".into(),
                addresses: vec!["192.168.0.1".into()],
                pod_cidrs: vec![],
                labels: Labels::new(),
                being_deleted,
            };
            let touched = cluster.apply(ClusterEvent::Upsert(ClusterObject::Node(node)), "node-a");
            let update = model.update(&cluster, &touched);
            Delta::from_update(&model, &update)
        };
        let first = publish(false).node.expect("the node's addresses arrived");
        assert!(!first.being_deleted);
        let draining = publish(true).node.expect("being deleted changed: the node is sent");
        assert_eq!((draining.being_deleted, &draining.context), (true, &first.context));
        assert!(!publish(false).node.unwrap().being_deleted);
    }

    #[test]
    fn publishing_without_watches_is_fine_and_counted() {
        let feed = ModelFeed::new(Arc::new(|| empty(0)), 4);
        for revision in 1..=10 {
            feed.publish(Delta { revision, node: None, changes: vec![] });
        }
        assert_eq!(feed.subscribers(), 0);
        assert_eq!(feed.stats().published, 10);
        assert!(!feed.is_closed());
        feed.close();
        assert!(feed.is_closed());
    }

    #[test]
    fn snapshot_and_delta_follow_the_model() {
        use wasmplane_model::{ClusterEvent, ClusterObject, ClusterState, Service, ServicePort};
        let mut cluster = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let service = Service::cluster_ip("default", "web", "10.96.0.10", vec![ServicePort::tcp("http", 80, 8080)]);
        let touched = cluster.apply(ClusterEvent::Upsert(ClusterObject::Service(service)), "node-a");
        let update = model.update(&cluster, &touched);
        let delta = Delta::from_update(&model, &update);
        assert_eq!(delta.revision, 1);
        assert!(delta.node.is_none());
        assert_eq!(delta.changes.len(), 1);
        let snapshot = Snapshot::of(&model);
        assert_eq!(snapshot.revision, 1);
        assert_eq!(snapshot.services.len(), 1);
        assert!(Arc::ptr_eq(&snapshot.services[0], delta.changes[0].view.as_ref().unwrap()), "no copy of the views");
    }
}
