//! The kvstore: how wasmplane nodes share state.
//!
//! One interface, [`KvStore`], with two backends that honour the same contract
//! (the contract tests in `tests/contract.rs` run unchanged against both):
//!
//! - [`EtcdStore`]: a real etcd cluster through `etcd-client`, for multi-node
//!   deployments. Reconnects on its own; every watch resumes from its last
//!   delivered revision after a disconnect and turns a compaction into a relist
//!   plus an exact diff, so a consumer never loses an update.
//! - [`EmbeddedStore`]: the same semantics in-process (global revision counter,
//!   prefix watches with history, leases, transactions), persisted with `redb` or
//!   purely in memory, for single-process mode and tests.
//!
//! On top of the interface:
//! - [`SharedStore`]: a local cache of a prefix kept in sync by list+watch, plus
//!   "local keys" owned by this node, attached to a lease and re-written after a
//!   reconnect or lease loss (the shape of Cilium's `JoinSharedStore`).
//! - [`blob`]: content-addressed, chunked values (Wasm modules), because etcd caps
//!   a request at about 1.5 MiB.
//! - [`LeaseKeeper`]: a keep-alive task for a lease, for callers that manage
//!   leased keys themselves.
//!
//! Revisions are etcd's: one global, strictly increasing counter bumped by every
//! write (a transaction or a lease expiry deleting several keys bumps it once).

pub mod blob;
mod embedded;
mod error;
mod etcd;
mod lease;
mod shared;
mod tls;
mod view;

use std::pin::Pin;
use std::time::Duration;

pub use bytes::Bytes;
pub use embedded::{EmbeddedConfig, EmbeddedStore};
pub use error::{KvError, Result};
pub use etcd::{EtcdConfig, EtcdStore};
pub use lease::{LeaseKeeper, LeaseStatus};
pub use shared::{SharedBatch, SharedBatches, SharedChange, SharedEntry, SharedStore, SharedStoreConfig};
pub use tls::{EtcdConfigFile, EtcdTls, EtcdTlsError, EtcdTlsFiles, EtcdUser};

/// A store revision (etcd's `int64`). 0 means "none" (e.g. the modification
/// revision of an absent key).
pub type Revision = i64;

/// A lease identifier, as granted by the store.
pub type LeaseId = i64;

/// Largest request the stores accept by default: etcd's default
/// `--max-request-bytes` (1.5 MiB). The embedded backend enforces it too.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1536 * 1024;

/// One stored key with its metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Bytes,
    /// Revision of the write that created the key (since its last deletion).
    pub create_revision: Revision,
    /// Revision of the last write to the key; what compare-and-swap compares.
    pub mod_revision: Revision,
    /// Number of writes since creation (1 after the creating write).
    pub version: i64,
    /// Lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// The result of a prefix listing: a consistent snapshot at one revision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Listing {
    /// Keys in ascending byte order.
    pub items: Vec<KeyValue>,
    /// Store revision the snapshot was taken at; watch from `revision + 1` to
    /// follow every later change.
    pub revision: Revision,
}

/// One change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    pub key: String,
    /// The new value; `None` for a deletion.
    pub value: Option<Bytes>,
    /// Revision of the change. Events arrive in non-decreasing revision order.
    /// Deletions synthesised by a relist after compaction carry the listing's
    /// revision (the real deletion revision is no longer known).
    pub mod_revision: Revision,
}

impl WatchEvent {
    /// Whether this event deletes the key.
    pub fn is_delete(&self) -> bool {
        self.value.is_none()
    }
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub id: LeaseId,
    /// The time-to-live the store granted (etcd rounds up to whole seconds).
    pub ttl: Duration,
}

/// Outcome of [`KvStore::create`] (put-if-not-exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Created {
    /// True when this call created the key; false when it already existed.
    pub won: bool,
    /// When won: the revision of the write. Otherwise: the existing key's
    /// modification revision.
    pub revision: Revision,
}

/// Outcome of a delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deleted {
    /// Number of keys removed.
    pub count: u64,
    /// Store revision after the delete (unchanged when nothing was removed).
    pub revision: Revision,
}

/// A watch: an endless stream of changes under a prefix, in revision order.
///
/// Backends deal with disconnects and compaction inside the stream; an `Err` item
/// is terminal (the store was closed or cannot be used any more) and the stream
/// ends after it.
pub type WatchStream = Pin<Box<dyn futures::Stream<Item = Result<WatchEvent>> + Send>>;

/// The kvstore interface. Object-safe: the host holds an `Arc<dyn KvStore>`.
///
/// Semantics shared by both backends (and checked by the contract tests):
/// - every write bumps the global revision once;
/// - `watch_prefix(p, Some(r))` delivers every change under `p` with revision
///   `>= r`, exactly once, in order, across reconnects; when the history it
///   needs is compacted away *while it runs*, it relists and emits the difference
///   against what it had delivered (puts for new or changed keys, deletes for
///   vanished ones) and continues, so a consumer that applies events to a map
///   always ends up with the store's content;
/// - starting a watch from an already-compacted revision fails with
///   [`KvError::Compacted`] (the caller's own state is too old: relist);
/// - keys attached to a lease are deleted (in one revision) when it expires or
///   is revoked, and watchers see those deletions.
#[async_trait::async_trait]
pub trait KvStore: Send + Sync + 'static {
    /// Short backend name for logs and metrics ("etcd", "embedded").
    fn backend(&self) -> &'static str;

    /// Reads one key.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>>;

    /// Writes a key, attached to `lease` if given (a put without a lease detaches
    /// the key from any previous lease). Returns the write's revision.
    async fn put(&self, key: &str, value: Bytes, lease: Option<LeaseId>) -> Result<Revision>;

    /// Deletes one key.
    async fn delete(&self, key: &str) -> Result<Deleted>;

    /// Deletes every key starting with `prefix`, in one revision.
    async fn delete_prefix(&self, prefix: &str) -> Result<Deleted>;

    /// Lists every key starting with `prefix`, as of one revision.
    async fn list_prefix(&self, prefix: &str) -> Result<Listing>;

    /// Watches every key starting with `prefix`, from revision `from` (inclusive)
    /// or, with `None`, from now. See the trait docs for resume and compaction.
    async fn watch_prefix(&self, prefix: &str, from: Option<Revision>) -> Result<WatchStream>;

    /// Grants a lease; keys attached to it vanish when it is not kept alive.
    async fn grant_lease(&self, ttl: Duration) -> Result<Lease>;

    /// Renews a lease for its full TTL. [`KvError::LeaseNotFound`] once expired.
    async fn keep_alive(&self, lease: LeaseId) -> Result<()>;

    /// Revokes a lease now, deleting its keys.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()>;

    /// Put-if-not-exists: creates `key` only when it is absent. Exactly one of
    /// many concurrent callers wins.
    async fn create(&self, key: &str, value: Bytes, lease: Option<LeaseId>) -> Result<Created>;

    /// Writes `key` only if its modification revision is `expected` (0: absent).
    /// Fails with [`KvError::Conflict`] otherwise. Returns the write's revision.
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Revision,
        value: Bytes,
        lease: Option<LeaseId>,
    ) -> Result<Revision>;

    /// Deletes `key` only if its modification revision is `expected`.
    /// Fails with [`KvError::Conflict`] otherwise. Returns the store revision
    /// after the delete.
    async fn delete_if_revision(&self, key: &str, expected: Revision) -> Result<Revision>;

    /// The store's current revision.
    async fn current_revision(&self) -> Result<Revision>;

    /// Discards history up to `revision` (watches started from it or earlier get
    /// [`KvError::Compacted`]; running ones behind it relist). Compacting to a
    /// revision already compacted is a no-op.
    async fn compact(&self, revision: Revision) -> Result<()>;

    /// Lists a prefix and watches it from just after the listing: the standard
    /// way to build a cache that never misses an update.
    async fn list_and_watch(&self, prefix: &str) -> Result<(Listing, WatchStream)> {
        let listing = self.list_prefix(prefix).await?;
        let stream = self.watch_prefix(prefix, Some(listing.revision + 1)).await?;
        Ok((listing, stream))
    }
}

/// Smallest key greater than every key starting with `prefix` (etcd's range end
/// for a prefix). An empty prefix (or one of only 0xff bytes) means "to the end",
/// spelled `\0` as etcd does.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Exponential backoff with jitter for reconnect loops, so that many clients
/// losing the same server do not come back in lockstep.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff { min, max, current: min }
    }

    pub(crate) fn reset(&mut self) {
        self.current = self.min;
    }

    /// The next delay: the current step plus up to 50% jitter.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let base = self.current;
        self.current = (self.current * 2).min(self.max);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let jitter_range = (base.as_millis() as u64 / 2).max(1);
        base + Duration::from_millis(u64::from(nanos) % jitter_range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_matches_etcd() {
        assert_eq!(prefix_end(b"a/"), b"a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b""), vec![0]);
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn backoff_grows_and_caps() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(40));
        let d1 = b.next_delay();
        assert!(d1 >= Duration::from_millis(10) && d1 < Duration::from_millis(15));
        b.next_delay();
        let d3 = b.next_delay();
        assert!(d3 >= Duration::from_millis(40) && d3 < Duration::from_millis(60));
        b.reset();
        assert!(b.next_delay() < Duration::from_millis(15));
    }
}
