//! A shared store: every node's view of a prefix, plus the keys this node owns.
//!
//! The shape follows Cilium's `JoinSharedStore`: all nodes write their own keys
//! under a common prefix (node records, per-node status) and read everybody's.
//!
//! - The cache is filled by a listing and kept current by a watch from the
//!   listing's revision; the backends already resume watches and turn compaction
//!   into a diff, and if a watch ends anyway the store relists and applies the
//!   difference, so the cache converges to the store's content after any failure.
//! - Local keys are attached to a lease owned by this node, so they disappear
//!   when the node dies. They are written again (all of them) whenever the lease
//!   is replaced, after the store was unreachable and answers again (it may have
//!   been restored from an old backup or lost our writes), periodically (to
//!   repair anything unforeseen), and individually as soon as the cache shows one
//!   of them missing or different (someone deleted or overwrote it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{Instrument, debug, info, warn};

use crate::lease::renew_interval;
use crate::{Backoff, Bytes, KvError, KvStore, Lease, LeaseId, Listing, Result, Revision, WatchEvent, WatchStream};

/// How a [`SharedStore`] joins its prefix.
#[derive(Debug, Clone)]
pub struct SharedStoreConfig {
    /// Common prefix of all entries, e.g. `wasmplane/nodes/`. Entry names are the
    /// keys with this prefix removed.
    pub prefix: String,
    /// TTL of the lease holding this node's local keys: how long they outlive
    /// the node. etcd rounds it up to whole seconds.
    pub lease_ttl: Duration,
    /// Period of the unconditional re-write of all local keys.
    pub sync_interval: Duration,
    /// Retry delays after failures.
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// Changes buffered per subscriber before it lags (and must re-snapshot). Every slot is
    /// allocated up front (~90 bytes each): bursts larger than this are rare (a cluster
    /// starting) and a lagging subscriber only reads the cache again.
    pub change_buffer: usize,
}

impl SharedStoreConfig {
    pub fn new(prefix: impl Into<String>) -> Self {
        SharedStoreConfig {
            prefix: prefix.into(),
            lease_ttl: Duration::from_secs(15),
            sync_interval: Duration::from_secs(300),
            retry_min: Duration::from_millis(50),
            retry_max: Duration::from_secs(2),
            change_buffer: 256,
        }
    }
}

/// One entry of the shared cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedEntry {
    pub value: Bytes,
    pub mod_revision: Revision,
}

/// A change of the shared cache, as seen by subscribers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedChange {
    Upsert { name: String, value: Bytes, mod_revision: Revision },
    Delete { name: String },
}

/// What [`SharedBatches::next`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedBatch {
    /// Every entry now: the first batch, and the next one after the follower fell behind
    /// (what it missed is in it).
    Snapshot(BTreeMap<String, SharedEntry>),
    /// The changes since the previous batch, in order: every one that had arrived.
    Changes(Vec<SharedChange>),
}

/// A follower of a [`SharedStore`] in batches ([`SharedStore::batches`]). It does not keep
/// the store alive: once the store is dropped, [`SharedBatches::next`] ends.
pub struct SharedBatches {
    inner: std::sync::Weak<Inner>,
    /// None until the first snapshot, and after falling behind.
    changes: Option<broadcast::Receiver<SharedChange>>,
}

impl SharedBatches {
    /// The next batch; `None` once the store is gone.
    pub async fn next(&mut self) -> Option<SharedBatch> {
        use broadcast::error::{RecvError, TryRecvError};
        let Some(changes) = &mut self.changes else {
            return self.snapshot();
        };
        let mut batch = match changes.recv().await {
            Ok(change) => vec![change],
            Err(RecvError::Lagged(missed)) => {
                debug!(missed, "fell behind the shared store's changes: reading it whole again");
                return self.snapshot();
            }
            Err(RecvError::Closed) => return None,
        };
        loop {
            match changes.try_recv() {
                Ok(change) => batch.push(change),
                // The snapshot holds what this batch had too.
                Err(TryRecvError::Lagged(_)) => return self.snapshot(),
                Err(TryRecvError::Empty | TryRecvError::Closed) => {
                    return Some(SharedBatch::Changes(batch));
                }
            }
        }
    }

    fn snapshot(&mut self) -> Option<SharedBatch> {
        let inner = self.inner.upgrade()?;
        let cache = lock(&inner.cache);
        self.changes = Some(inner.changes.subscribe());
        Some(SharedBatch::Snapshot(cache.clone()))
    }
}

/// A joined shared store. Dropping it stops its tasks (local keys then expire
/// with the lease); [`SharedStore::close`] removes them at once.
pub struct SharedStore {
    inner: Arc<Inner>,
    tasks: Vec<JoinHandle<()>>,
}

struct Inner {
    store: Arc<dyn KvStore>,
    config: SharedStoreConfig,
    cache: Mutex<BTreeMap<String, SharedEntry>>,
    changes: broadcast::Sender<SharedChange>,
    local: Mutex<Local>,
    /// Serialises writes of local keys, so a background re-write never
    /// resurrects a key deleted meanwhile.
    write_lock: tokio::sync::Mutex<()>,
    /// Wakes the local-key task (a local key changed or looks damaged).
    local_wakeup: Notify,
    full_rewrites: AtomicU64,
    /// Joined by [`SharedStore::follow`]: no lease, no local keys.
    read_only: bool,
}

#[derive(Default)]
struct Local {
    desired: BTreeMap<String, Bytes>,
    lease: Option<LeaseId>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Critical sections here never leave data half-updated.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SharedStore {
    /// Joins the prefix: lists it (so the cache is complete when this returns;
    /// fails if the store is unreachable) and starts following it and
    /// maintaining this node's local keys.
    pub async fn join(store: Arc<dyn KvStore>, config: SharedStoreConfig) -> Result<Self> {
        Self::start(store, config, false).await
    }

    /// Follows the prefix without joining it: the same cache and changes as
    /// [`SharedStore::join`], but no lease is taken and no key written (a reader
    /// of what others publish, e.g. other clusters' services). Local-key writes
    /// fail with [`KvError::InvalidArgument`].
    pub async fn follow(store: Arc<dyn KvStore>, config: SharedStoreConfig) -> Result<Self> {
        Self::start(store, config, true).await
    }

    async fn start(store: Arc<dyn KvStore>, config: SharedStoreConfig, read_only: bool) -> Result<Self> {
        let (listing, stream) = store.list_and_watch(&config.prefix).await?;
        let (changes, _) = broadcast::channel(config.change_buffer.max(1));
        let inner = Arc::new(Inner {
            store,
            config,
            cache: Mutex::new(BTreeMap::new()),
            changes,
            local: Mutex::new(Local::default()),
            write_lock: tokio::sync::Mutex::new(()),
            local_wakeup: Notify::new(),
            full_rewrites: AtomicU64::new(0),
            read_only,
        });
        inner.replace(listing);
        let span = tracing::info_span!("shared_store", prefix = inner.config.prefix);
        let mut tasks = vec![tokio::spawn(follow(inner.clone(), stream).instrument(span.clone()))];
        if !read_only {
            tasks.push(tokio::spawn(maintain_local(inner.clone()).instrument(span)));
        }
        Ok(SharedStore { inner, tasks })
    }

    /// Every entry under the prefix (names without the prefix).
    pub fn snapshot(&self) -> BTreeMap<String, SharedEntry> {
        lock(&self.inner.cache).clone()
    }

    /// One entry.
    pub fn get(&self, name: &str) -> Option<SharedEntry> {
        lock(&self.inner.cache).get(name).cloned()
    }

    /// A snapshot and the changes after it, with nothing missed in between. A
    /// receiver that lags (`RecvError::Lagged`) should subscribe again.
    pub fn subscribe(&self) -> (BTreeMap<String, SharedEntry>, broadcast::Receiver<SharedChange>) {
        let cache = lock(&self.inner.cache);
        (cache.clone(), self.inner.changes.subscribe())
    }

    /// Follows the entries in batches: all of them first, then each burst of changes as
    /// one batch, and all of them again after falling behind. For consumers that rebuild
    /// something from the entries (routes, imported services), so that none of them has
    /// to handle a lagging receiver itself.
    pub fn batches(&self) -> SharedBatches {
        SharedBatches { inner: Arc::downgrade(&self.inner), changes: None }
    }

    /// Sets a local key (owned by this node, attached to its lease). The value is
    /// recorded first, so even if writing it now fails it is written as soon as
    /// the store allows; the error only reports that this first attempt failed.
    pub async fn update_local(&self, name: &str, value: Bytes) -> Result<()> {
        self.inner.writable()?;
        let _guard = self.inner.write_lock.lock().await;
        let lease = {
            let mut local = lock(&self.inner.local);
            local.desired.insert(name.to_owned(), value.clone());
            local.lease
        };
        let Some(lease) = lease else {
            // No lease yet: the local-key task writes it once it has one.
            self.inner.local_wakeup.notify_one();
            return Ok(());
        };
        let result = self.inner.store.put(&self.inner.key(name), value, Some(lease)).await;
        if result.is_err() {
            self.inner.local_wakeup.notify_one();
        }
        result.map(|_| ())
    }

    /// Removes a local key.
    pub async fn delete_local(&self, name: &str) -> Result<()> {
        self.inner.writable()?;
        let _guard = self.inner.write_lock.lock().await;
        lock(&self.inner.local).desired.remove(name);
        self.inner.store.delete(&self.inner.key(name)).await.map(|_| ())
    }

    /// Names and values of this node's local keys.
    pub fn local_keys(&self) -> BTreeMap<String, Bytes> {
        lock(&self.inner.local).desired.clone()
    }

    /// The lease currently holding the local keys.
    pub fn lease(&self) -> Option<LeaseId> {
        lock(&self.inner.local).lease
    }

    /// How many times all local keys were written (first write included): grows
    /// after lease loss, reconnects and every sync interval.
    pub fn full_rewrites(&self) -> u64 {
        self.inner.full_rewrites.load(Ordering::Relaxed)
    }

    /// Leaves: stops the tasks and revokes the lease, deleting the local keys.
    pub async fn close(mut self) -> Result<()> {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        let lease = lock(&self.inner.local).lease.take();
        match lease {
            Some(lease) => match self.inner.store.revoke_lease(lease).await {
                Ok(()) | Err(KvError::LeaseNotFound(_)) => Ok(()),
                Err(e) => Err(e),
            },
            None => Ok(()),
        }
    }
}

impl Drop for SharedStore {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Inner {
    fn writable(&self) -> Result<()> {
        if self.read_only {
            return Err(KvError::InvalidArgument(format!(
                "{} is followed read-only: no local keys",
                self.config.prefix
            )));
        }
        Ok(())
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.config.prefix)
    }

    fn name<'a>(&self, key: &'a str) -> Option<&'a str> {
        key.strip_prefix(self.config.prefix.as_str())
    }

    /// Replaces the cache by a listing, publishing the difference.
    fn replace(&self, listing: Listing) {
        let mut fresh = BTreeMap::new();
        for kv in listing.items {
            if let Some(name) = self.name(&kv.key) {
                fresh.insert(name.to_owned(), SharedEntry { value: kv.value, mod_revision: kv.mod_revision });
            }
        }
        let mut cache = lock(&self.cache);
        for (name, old) in cache.iter() {
            match fresh.get(name) {
                None => {
                    let _ = self.changes.send(SharedChange::Delete { name: name.clone() });
                }
                Some(new) if new.value != old.value => {
                    let _ = self.changes.send(SharedChange::Upsert {
                        name: name.clone(),
                        value: new.value.clone(),
                        mod_revision: new.mod_revision,
                    });
                }
                Some(_) => {}
            }
        }
        for (name, new) in &fresh {
            if !cache.contains_key(name) {
                let _ = self.changes.send(SharedChange::Upsert {
                    name: name.clone(),
                    value: new.value.clone(),
                    mod_revision: new.mod_revision,
                });
            }
        }
        *cache = fresh;
        drop(cache);
        self.local_wakeup.notify_one();
    }

    fn apply(&self, event: WatchEvent) {
        let Some(name) = self.name(&event.key).map(str::to_owned) else {
            return;
        };
        let mut cache = lock(&self.cache);
        let change = match event.value {
            Some(value) => {
                let entry = SharedEntry { value: value.clone(), mod_revision: event.mod_revision };
                match cache.insert(name.clone(), entry) {
                    // A re-write of the same value is not news to subscribers.
                    Some(old) if old.value == value => None,
                    _ => Some(SharedChange::Upsert { name: name.clone(), value, mod_revision: event.mod_revision }),
                }
            }
            None => cache.remove(&name).map(|_| SharedChange::Delete { name: name.clone() }),
        };
        let current = cache.get(&name).map(|e| e.value.clone());
        if let Some(change) = change {
            let _ = self.changes.send(change);
        }
        drop(cache);
        // One of ours deleted or overwritten (lease expired, someone else wrote
        // it): repair now rather than at the next sync.
        let damaged = lock(&self.local).desired.get(&name).is_some_and(|want| current.as_ref() != Some(want));
        if damaged {
            debug!(name, "local key missing or changed in the store; repairing");
            self.local_wakeup.notify_one();
        }
    }

    /// Local keys whose cached value differs from the desired one.
    fn damaged_local_keys(&self) -> Vec<String> {
        let desired = lock(&self.local).desired.clone();
        let cache = lock(&self.cache);
        desired
            .into_iter()
            .filter(|(name, value)| cache.get(name).map(|e| &e.value) != Some(value))
            .map(|(name, _)| name)
            .collect()
    }

    /// Writes the given local keys (all of them when `names` is `None`) with the
    /// lease, reading their values under the write lock.
    async fn write_local(&self, names: Option<Vec<String>>, lease: LeaseId) -> Result<usize> {
        let _guard = self.write_lock.lock().await;
        let batch: Vec<(String, Bytes)> = {
            let local = lock(&self.local);
            match names {
                None => local.desired.iter().map(|(n, v)| (n.clone(), v.clone())).collect(),
                Some(names) => {
                    names.into_iter().filter_map(|n| local.desired.get(&n).map(|v| (n, v.clone()))).collect()
                }
            }
        };
        for (name, value) in &batch {
            self.store.put(&self.key(name), value.clone(), Some(lease)).await?;
        }
        Ok(batch.len())
    }
}

/// Applies watch events to the cache; relists and re-watches if the stream ends.
async fn follow(inner: Arc<Inner>, mut stream: WatchStream) {
    let mut backoff = Backoff::new(inner.config.retry_min, inner.config.retry_max);
    loop {
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => inner.apply(event),
                Err(e) => {
                    warn!(error = %e, "shared store watch failed");
                    break;
                }
            }
        }
        loop {
            tokio::time::sleep(backoff.next_delay()).await;
            match inner.store.list_and_watch(&inner.config.prefix).await {
                Ok((listing, next)) => {
                    info!(revision = listing.revision, "shared store relisted");
                    inner.replace(listing);
                    stream = next;
                    backoff.reset();
                    break;
                }
                Err(e) => debug!(error = %e, "shared store relist failed; retrying"),
            }
        }
    }
}

/// Owns the lease and keeps the local keys written.
async fn maintain_local(inner: Arc<Inner>) {
    let config = &inner.config;
    let mut backoff = Backoff::new(config.retry_min, config.retry_max);
    let mut lease: Option<Lease> = None;
    let mut rewrite_all = true;
    let mut unreachable = false;
    let mut last_full = Instant::now();
    let mut next_renew = Instant::now();
    loop {
        let current = match lease {
            Some(lease) => lease,
            None => match inner.store.grant_lease(config.lease_ttl).await {
                Ok(granted) => {
                    info!(lease = granted.id, ttl = ?granted.ttl, "shared store lease granted");
                    lock(&inner.local).lease = Some(granted.id);
                    lease = Some(granted);
                    rewrite_all = true;
                    next_renew = Instant::now() + renew_interval(granted.ttl);
                    granted
                }
                Err(e) => {
                    debug!(error = %e, "cannot grant lease; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            },
        };

        let full = rewrite_all || last_full.elapsed() >= config.sync_interval;
        let names = if full { None } else { Some(inner.damaged_local_keys()) };
        let needed = names.as_ref().is_none_or(|n| !n.is_empty());
        if needed {
            match inner.write_local(names, current.id).await {
                Ok(count) => {
                    if full {
                        rewrite_all = false;
                        last_full = Instant::now();
                        inner.full_rewrites.fetch_add(1, Ordering::Relaxed);
                        debug!(count, lease = current.id, "local keys written");
                    } else {
                        debug!(count, "local keys repaired");
                    }
                    backoff.reset();
                }
                Err(KvError::LeaseNotFound(_)) => {
                    warn!(lease = current.id, "lease lost; granting a new one");
                    lease = None;
                    lock(&inner.local).lease = None;
                    continue;
                }
                Err(e) => {
                    debug!(error = %e, "writing local keys failed; retrying");
                    unreachable = true;
                    rewrite_all = true;
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            }
        }

        let wait_until = next_renew.min(last_full + config.sync_interval);
        tokio::select! {
            _ = tokio::time::sleep_until(wait_until) => {}
            _ = inner.local_wakeup.notified() => continue,
        }
        if Instant::now() < next_renew {
            continue;
        }
        match inner.store.keep_alive(current.id).await {
            Ok(()) => {
                if unreachable {
                    info!("store reachable again; re-writing local keys");
                    unreachable = false;
                    rewrite_all = true;
                }
                next_renew = Instant::now() + renew_interval(current.ttl);
                backoff.reset();
            }
            Err(KvError::LeaseNotFound(_)) => {
                warn!(lease = current.id, "lease expired; granting a new one");
                lease = None;
                lock(&inner.local).lease = None;
            }
            Err(e) => {
                debug!(error = %e, "lease renewal failed; retrying");
                unreachable = true;
                next_renew = Instant::now() + backoff.next_delay().min(renew_interval(current.ttl));
            }
        }
    }
}
