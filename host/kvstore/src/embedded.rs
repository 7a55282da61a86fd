//! Embedded backend: etcd's semantics inside the process, for single-process
//! mode and tests.
//!
//! The authoritative state lives in memory behind one mutex (key map, global
//! revision, a bounded history of events for watches, leases). Every change is
//! first committed to a `redb` database (when a path is configured) and only then
//! applied in memory, so what readers and watchers see is always on disk and a
//! failed disk write changes nothing.
//!
//! Persisted: keys with their metadata, the revision counter and the lease table.
//! Not persisted: the event history — after a reopen history starts at the
//! current revision, so a watch from an older revision gets
//! [`KvError::Compacted`] and relists, exactly as after an etcd compaction.
//! Leases survive a reopen with a fresh full TTL (what etcd does when a new
//! leader takes over): keys of an owner that comes back and keeps its lease alive
//! stay; keys of one that does not vanish one TTL after the restart.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::view::WatchView;
use crate::{
    Bytes, Created, DEFAULT_MAX_REQUEST_BYTES, Deleted, KeyValue, KvError, KvStore, Lease, LeaseId, Listing, Result,
    Revision, WatchEvent, WatchStream,
};

const KV_TABLE: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
const META_TABLE: TableDefinition<&str, i64> = TableDefinition::new("meta");
/// Lease id → TTL in milliseconds.
const LEASE_TABLE: TableDefinition<i64, u64> = TableDefinition::new("leases");
const META_REVISION: &str = "revision";
const META_NEXT_LEASE: &str = "next_lease_id";

/// Most history entries a watch takes per lock acquisition, so a watcher
/// catching up on a long history does not stall writers.
const WATCH_SCAN_BATCH: usize = 4096;

/// Options of the embedded store.
#[derive(Debug, Clone)]
pub struct EmbeddedConfig {
    /// Database file; `None` keeps everything in memory only.
    pub path: Option<PathBuf>,
    /// Largest key + value accepted (etcd's default so both backends agree).
    pub max_request_bytes: usize,
    /// History kept for watches, in events; older revisions are compacted.
    pub history_max_events: usize,
    /// History kept for watches, in bytes of keys and values.
    pub history_max_bytes: usize,
    /// fsync every commit (like etcd). Off trades crash safety for speed: a
    /// crash may lose the last commits but never corrupts the file.
    pub durable: bool,
}

impl EmbeddedConfig {
    /// A store that lives and dies with the process.
    pub fn in_memory() -> Self {
        EmbeddedConfig {
            path: None,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            history_max_events: 100_000,
            history_max_bytes: 64 * 1024 * 1024,
            durable: true,
        }
    }

    /// A store persisted to `path` (created if missing).
    pub fn persistent(path: impl Into<PathBuf>) -> Self {
        EmbeddedConfig { path: Some(path.into()), ..Self::in_memory() }
    }
}

/// [`KvStore`] inside the process, optionally persisted with redb. Cheap to
/// clone; the database file is closed when the last clone and the last watch
/// stream are dropped.
#[derive(Clone)]
pub struct EmbeddedStore {
    shared: Arc<Shared>,
}

struct Shared {
    core: Mutex<Core>,
    /// Latest revision; watchers wait on it.
    revision_tx: watch::Sender<Revision>,
    /// Wakes the lease reaper when deadlines change or the store goes away.
    lease_wakeup: Arc<Notify>,
    config: EmbeddedConfig,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.lease_wakeup.notify_one();
        // Non-durable commits only reach the disk with a later durable one;
        // make a clean close keep everything.
        let core = self.core.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some(db) = &core.db
            && !self.config.durable
        {
            let flushed = db.begin_write().map_err(storage_err).and_then(|txn| txn.commit().map_err(storage_err));
            match flushed {
                Ok(()) => debug!("embedded kvstore flushed on close"),
                Err(e) => warn!(error = %e, "flushing the embedded kvstore on close failed"),
            }
        }
    }
}

struct Core {
    state: State,
    db: Option<redb::Database>,
    reaper_started: bool,
}

#[derive(Default)]
struct State {
    kv: BTreeMap<String, Record>,
    revision: Revision,
    /// History holds every event with a revision above this.
    compact_revision: Revision,
    history: VecDeque<HistoryEntry>,
    history_bytes: usize,
    leases: HashMap<LeaseId, LeaseEntry>,
    next_lease_id: LeaseId,
}

#[derive(Clone)]
struct Record {
    value: Bytes,
    create_revision: Revision,
    mod_revision: Revision,
    version: i64,
    lease: Option<LeaseId>,
}

struct HistoryEntry {
    key: String,
    value: Option<Bytes>,
    revision: Revision,
    /// The key's modification revision before this event (0: absent), so the
    /// key set at an older revision can be rebuilt to seed a watch.
    prev_mod_revision: Revision,
}

struct LeaseEntry {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

enum Op {
    Put { key: String, value: Bytes, lease: Option<LeaseId> },
    Delete { key: String },
}

enum LeaseOp {
    Grant { id: LeaseId, ttl: Duration },
    Remove { id: LeaseId },
}

fn storage_err(e: impl std::fmt::Display) -> KvError {
    KvError::Storage(e.to_string())
}

impl EmbeddedStore {
    /// A store kept only in memory. Needs no runtime until a lease is granted.
    pub fn in_memory() -> Self {
        Self::from_state(State::fresh(), None, EmbeddedConfig::in_memory())
    }

    /// Opens (or creates) the store described by `config`.
    pub async fn open(config: EmbeddedConfig) -> Result<Self> {
        let Some(path) = config.path.clone() else {
            return Ok(Self::from_state(State::fresh(), None, config));
        };
        let (state, db) = tokio::task::spawn_blocking(move || load(&path))
            .await
            .map_err(|e| KvError::Backend(format!("opening the embedded store panicked: {e}")))??;
        let has_leases = !state.leases.is_empty();
        info!(
            path = ?config.path,
            revision = state.revision,
            keys = state.kv.len(),
            leases = state.leases.len(),
            "embedded kvstore opened"
        );
        let store = Self::from_state(state, Some(db), config);
        if has_leases {
            store.ensure_reaper();
        }
        Ok(store)
    }

    fn from_state(state: State, db: Option<redb::Database>, config: EmbeddedConfig) -> Self {
        let (revision_tx, _) = watch::channel(state.revision);
        EmbeddedStore {
            shared: Arc::new(Shared {
                core: Mutex::new(Core { state, db, reaper_started: false }),
                revision_tx,
                lease_wakeup: Arc::new(Notify::new()),
                config,
            }),
        }
    }

    /// Runs `f` on the locked core; off the async threads when it may touch
    /// the disk.
    async fn exec<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Core, &Shared) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        exec(self.shared.clone(), f).await
    }

    fn check_size(&self, key: &str, value: &Bytes) -> Result<()> {
        let size = key.len() + value.len();
        let limit = self.shared.config.max_request_bytes;
        if size > limit {
            return Err(KvError::TooLarge { size, limit });
        }
        Ok(())
    }

    /// Starts the task expiring leases, once.
    fn ensure_reaper(&self) {
        let mut core = self.shared.lock();
        if core.reaper_started {
            return;
        }
        core.reaper_started = true;
        drop(core);
        tokio::spawn(reap_leases(Arc::downgrade(&self.shared), self.shared.lease_wakeup.clone()));
    }
}

async fn exec<T: Send + 'static>(
    shared: Arc<Shared>,
    f: impl FnOnce(&mut Core, &Shared) -> Result<T> + Send + 'static,
) -> Result<T> {
    if shared.config.path.is_some() {
        tokio::task::spawn_blocking(move || {
            let mut core = shared.lock();
            f(&mut core, &shared)
        })
        .await
        .map_err(|e| KvError::Backend(format!("embedded store operation panicked: {e}")))?
    } else {
        let mut core = shared.lock();
        f(&mut core, &shared)
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Core> {
        // A panic while holding the lock cannot leave a half-applied change:
        // memory is only touched after the disk commit, in infallible code.
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn fresh() -> Self {
        State {
            // Like etcd: an empty store is at revision 1; the first write is 2.
            revision: 1,
            next_lease_id: 1,
            ..State::default()
        }
    }

    fn to_key_value(key: &str, record: &Record) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: record.value.clone(),
            create_revision: record.create_revision,
            mod_revision: record.mod_revision,
            version: record.version,
            lease: record.lease,
        }
    }

    fn under<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a String, &'a Record)> + 'a {
        self.kv
            .range::<str, _>((std::ops::Bound::Included(prefix), std::ops::Bound::Unbounded))
            .take_while(move |(key, _)| key.starts_with(prefix))
    }

    fn list(&self, prefix: &str) -> Listing {
        Listing {
            items: self.under(prefix).map(|(key, record)| Self::to_key_value(key, record)).collect(),
            revision: self.revision,
        }
    }

    /// Key → modification revision under `prefix` as of `revision`, rebuilt by
    /// undoing history newer than it. Caller checks `revision >= compact_revision`.
    fn keys_at(&self, prefix: &str, revision: Revision) -> HashMap<String, Revision> {
        let mut keys: HashMap<String, Revision> =
            self.under(prefix).map(|(key, record)| (key.clone(), record.mod_revision)).collect();
        for entry in self.history.iter().rev().take_while(|e| e.revision > revision) {
            if !entry.key.starts_with(prefix) {
                continue;
            }
            if entry.prev_mod_revision == 0 {
                keys.remove(&entry.key);
            } else {
                keys.insert(entry.key.clone(), entry.prev_mod_revision);
            }
        }
        keys
    }

    fn lease_alive(&self, id: LeaseId, now: Instant) -> bool {
        self.leases.get(&id).is_some_and(|l| l.deadline > now)
    }

    fn mod_revision(&self, key: &str) -> Revision {
        self.kv.get(key).map(|r| r.mod_revision).unwrap_or(0)
    }

    /// Drops the oldest revisions until history fits its limits.
    fn trim_history(&mut self, max_events: usize, max_bytes: usize) {
        while self.history.len() > max_events || self.history_bytes > max_bytes {
            let Some(oldest) = self.history.front().map(|e| e.revision) else {
                break;
            };
            self.compact_to(oldest);
        }
    }

    fn compact_to(&mut self, revision: Revision) {
        while self.history.front().is_some_and(|e| e.revision <= revision) {
            if let Some(entry) = self.history.pop_front() {
                self.history_bytes -= entry_size(&entry);
            }
        }
        self.compact_revision = self.compact_revision.max(revision);
    }
}

fn entry_size(entry: &HistoryEntry) -> usize {
    entry.key.len() + entry.value.as_ref().map_or(0, Bytes::len)
}

impl Core {
    /// Commits key operations (all at one new revision) and lease changes:
    /// to disk first, then to memory. Deleting an absent key is a no-op; when
    /// nothing changes the revision stays.
    fn commit(&mut self, shared: &Shared, ops: Vec<Op>, lease_ops: Vec<LeaseOp>) -> Result<Revision> {
        let state = &self.state;
        let new_revision = state.revision + 1;
        let mut changes: Vec<(String, Option<Record>, Revision)> = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    let prev = state.kv.get(&key);
                    let record = Record {
                        value,
                        create_revision: prev.map_or(new_revision, |p| p.create_revision),
                        mod_revision: new_revision,
                        version: prev.map_or(1, |p| p.version + 1),
                        lease,
                    };
                    let prev_mod = prev.map_or(0, |p| p.mod_revision);
                    changes.push((key, Some(record), prev_mod));
                }
                Op::Delete { key } => {
                    if let Some(prev) = state.kv.get(&key) {
                        let prev_mod = prev.mod_revision;
                        changes.push((key, None, prev_mod));
                    }
                }
            }
        }
        if changes.is_empty() && lease_ops.is_empty() {
            return Ok(state.revision);
        }
        let revision = if changes.is_empty() { state.revision } else { new_revision };

        if let Some(db) = &self.db {
            persist(db, shared.config.durable, &changes, &lease_ops, revision, state.next_lease_id)?;
        }

        // Memory (infallible from here on).
        let now = Instant::now();
        let state = &mut self.state;
        for op in &lease_ops {
            match *op {
                LeaseOp::Grant { id, ttl } => {
                    state.leases.insert(id, LeaseEntry { ttl, deadline: now + ttl, keys: BTreeSet::new() });
                }
                LeaseOp::Remove { id } => {
                    state.leases.remove(&id);
                }
            }
        }
        for (key, record, prev_mod_revision) in changes {
            let old_lease = state.kv.get(&key).and_then(|r| r.lease);
            if let Some(old) = old_lease
                && let Some(lease) = state.leases.get_mut(&old)
            {
                lease.keys.remove(&key);
            }
            let value = record.as_ref().map(|r| r.value.clone());
            match record {
                Some(record) => {
                    if let Some(new) = record.lease
                        && let Some(lease) = state.leases.get_mut(&new)
                    {
                        lease.keys.insert(key.clone());
                    }
                    state.kv.insert(key.clone(), record);
                }
                None => {
                    state.kv.remove(&key);
                }
            }
            let entry = HistoryEntry { key, value, revision, prev_mod_revision };
            state.history_bytes += entry_size(&entry);
            state.history.push_back(entry);
        }
        if revision != state.revision {
            state.revision = revision;
            state.trim_history(shared.config.history_max_events, shared.config.history_max_bytes);
            shared.revision_tx.send_replace(revision);
        }
        Ok(revision)
    }
}

/// One redb write transaction for one commit.
fn persist(
    db: &redb::Database,
    durable: bool,
    changes: &[(String, Option<Record>, Revision)],
    lease_ops: &[LeaseOp],
    revision: Revision,
    next_lease_id: LeaseId,
) -> Result<()> {
    let mut txn = db.begin_write().map_err(storage_err)?;
    if !durable {
        txn.set_durability(redb::Durability::None).map_err(storage_err)?;
    }
    {
        let mut kv = txn.open_table(KV_TABLE).map_err(storage_err)?;
        for (key, record, _) in changes {
            match record {
                Some(record) => {
                    kv.insert(key.as_str(), encode_record(record).as_slice()).map_err(storage_err)?;
                }
                None => {
                    kv.remove(key.as_str()).map_err(storage_err)?;
                }
            }
        }
        let mut leases = txn.open_table(LEASE_TABLE).map_err(storage_err)?;
        let mut next_lease = next_lease_id;
        for op in lease_ops {
            match *op {
                LeaseOp::Grant { id, ttl } => {
                    let millis = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
                    leases.insert(id, millis).map_err(storage_err)?;
                    next_lease = next_lease.max(id + 1);
                }
                LeaseOp::Remove { id } => {
                    leases.remove(id).map_err(storage_err)?;
                }
            }
        }
        let mut meta = txn.open_table(META_TABLE).map_err(storage_err)?;
        meta.insert(META_REVISION, revision).map_err(storage_err)?;
        meta.insert(META_NEXT_LEASE, next_lease).map_err(storage_err)?;
    }
    txn.commit().map_err(storage_err)
}

/// Record layout on disk: create, mod, version, lease (0 = none) as
/// little-endian i64, then the value.
fn encode_record(record: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + record.value.len());
    out.extend_from_slice(&record.create_revision.to_le_bytes());
    out.extend_from_slice(&record.mod_revision.to_le_bytes());
    out.extend_from_slice(&record.version.to_le_bytes());
    out.extend_from_slice(&record.lease.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&record.value);
    out
}

fn decode_record(key: &str, bytes: &[u8]) -> Result<Record> {
    let corrupt = || KvError::Corrupt {
        key: key.to_owned(),
        reason: format!("record of {} bytes is shorter than its header", bytes.len()),
    };
    let field = |i: usize| -> Result<i64> {
        let raw: [u8; 8] = bytes.get(i * 8..i * 8 + 8).and_then(|s| s.try_into().ok()).ok_or_else(corrupt)?;
        Ok(i64::from_le_bytes(raw))
    };
    let lease = field(3)?;
    Ok(Record {
        create_revision: field(0)?,
        mod_revision: field(1)?,
        version: field(2)?,
        lease: (lease != 0).then_some(lease),
        value: Bytes::copy_from_slice(&bytes[32..]),
    })
}

/// Opens the database and loads it into memory.
fn load(path: &std::path::Path) -> Result<(State, redb::Database)> {
    // A store dropped a moment ago in this process may still be closing (a lease reaper
    // task can hold the last reference for a few microseconds): wait briefly for its lock
    // instead of failing a reopen.
    let mut attempts = 0;
    let db = loop {
        match redb::Database::create(path) {
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if attempts < 100 => {
                attempts += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => break other.map_err(storage_err)?,
        }
    };
    // Make sure every table exists so reads below need no special case.
    let txn = db.begin_write().map_err(storage_err)?;
    txn.open_table(KV_TABLE).map_err(storage_err)?;
    txn.open_table(META_TABLE).map_err(storage_err)?;
    txn.open_table(LEASE_TABLE).map_err(storage_err)?;
    txn.commit().map_err(storage_err)?;

    let mut state = State::fresh();
    let read = db.begin_read().map_err(storage_err)?;
    let meta = read.open_table(META_TABLE).map_err(storage_err)?;
    if let Some(revision) = meta.get(META_REVISION).map_err(storage_err)? {
        state.revision = revision.value();
    }
    if let Some(next) = meta.get(META_NEXT_LEASE).map_err(storage_err)? {
        state.next_lease_id = next.value();
    }
    // No history survives a restart: everything up to now counts as compacted
    // (a store that was never written has no history to lose).
    if state.revision > 1 {
        state.compact_revision = state.revision;
    }

    let now = Instant::now();
    let leases = read.open_table(LEASE_TABLE).map_err(storage_err)?;
    for row in leases.iter().map_err(storage_err)? {
        let (id, ttl) = row.map_err(storage_err)?;
        let ttl = Duration::from_millis(ttl.value());
        state.leases.insert(id.value(), LeaseEntry { ttl, deadline: now + ttl, keys: BTreeSet::new() });
    }
    let kv = read.open_table(KV_TABLE).map_err(storage_err)?;
    for row in kv.iter().map_err(storage_err)? {
        let (key, bytes) = row.map_err(storage_err)?;
        let key = key.value().to_owned();
        let mut record = decode_record(&key, bytes.value())?;
        if let Some(id) = record.lease {
            match state.leases.get_mut(&id) {
                Some(lease) => {
                    lease.keys.insert(key.clone());
                }
                None => {
                    warn!(key, lease = id, "key attached to an unknown lease; detaching");
                    record.lease = None;
                }
            }
        }
        state.kv.insert(key, record);
    }
    drop((meta, leases, kv, read));
    Ok((state, db))
}

/// Expires leases at their deadlines. Holds only a weak reference while
/// sleeping, so dropping the store ends it.
async fn reap_leases(shared: Weak<Shared>, wakeup: Arc<Notify>) {
    loop {
        let notified = wakeup.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let next_deadline = {
            let Some(strong) = shared.upgrade() else {
                return;
            };
            let core = strong.lock();
            core.state.leases.values().map(|l| l.deadline).min()
        };
        match next_deadline {
            Some(deadline) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => {}
                    _ = &mut notified => {}
                }
            }
            None => notified.await,
        }
        let Some(strong) = shared.upgrade() else {
            return;
        };
        let result = exec(strong, |core, shared| {
            let now = Instant::now();
            let expired: Vec<LeaseId> =
                core.state.leases.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| *id).collect();
            for id in expired {
                let keys: Vec<String> =
                    core.state.leases.get(&id).map(|l| l.keys.iter().cloned().collect()).unwrap_or_default();
                let count = keys.len();
                let ops = keys.into_iter().map(|key| Op::Delete { key }).collect();
                core.commit(shared, ops, vec![LeaseOp::Remove { id }])?;
                debug!(lease = id, keys = count, "lease expired");
            }
            Ok(())
        })
        .await;
        if let Err(e) = result {
            warn!(error = %e, "expiring leases failed; retrying");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A watch on the embedded store: pulls from the shared history when polled,
/// so a slow consumer costs no buffer; if it falls behind the history it
/// relists.
struct EmbeddedWatch {
    shared: Arc<Shared>,
    prefix: String,
    view: WatchView,
    pending: VecDeque<WatchEvent>,
    revision_rx: watch::Receiver<Revision>,
}

impl EmbeddedWatch {
    async fn next_event(&mut self) -> Option<Result<WatchEvent>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            // Mark the current revision seen *before* reading the history, so a
            // write landing after the read still wakes us.
            self.revision_rx.borrow_and_update();
            self.fill();
            if self.pending.is_empty() && self.revision_rx.changed().await.is_err() {
                return None;
            }
        }
    }

    fn fill(&mut self) {
        let core = self.shared.lock();
        let state = &core.state;
        let next = self.view.next_revision();
        if next > state.revision {
            return;
        }
        if next <= state.compact_revision {
            info!(
                prefix = self.prefix,
                next_revision = next,
                compact_revision = state.compact_revision,
                "watch fell behind compaction; relisting"
            );
            let listing = state.list(&self.prefix);
            self.pending.extend(self.view.resync(listing));
            return;
        }
        let start = state.history.partition_point(|e| e.revision < next);
        let mut batch = Vec::new();
        let mut last = None;
        for (scanned, entry) in state.history.range(start..).enumerate() {
            if scanned >= WATCH_SCAN_BATCH && last != Some(entry.revision) {
                break;
            }
            last = Some(entry.revision);
            if entry.key.starts_with(&self.prefix) {
                batch.push(WatchEvent {
                    key: entry.key.clone(),
                    value: entry.value.clone(),
                    mod_revision: entry.revision,
                });
            }
        }
        drop(core);
        self.pending.extend(self.view.accept_batch(batch));
        if let Some(last) = last {
            self.view.advance_to(last);
        }
    }
}

#[async_trait::async_trait]
impl KvStore for EmbeddedStore {
    fn backend(&self) -> &'static str {
        "embedded"
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let core = self.shared.lock();
        Ok(core.state.kv.get(key).map(|record| State::to_key_value(key, record)))
    }

    async fn put(&self, key: &str, value: Bytes, lease: Option<LeaseId>) -> Result<Revision> {
        self.check_size(key, &value)?;
        let key = key.to_owned();
        self.exec(move |core, shared| {
            if let Some(id) = lease
                && !core.state.lease_alive(id, Instant::now())
            {
                return Err(KvError::LeaseNotFound(id));
            }
            core.commit(shared, vec![Op::Put { key, value, lease }], Vec::new())
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<Deleted> {
        let key = key.to_owned();
        self.exec(move |core, shared| {
            let count = u64::from(core.state.kv.contains_key(&key));
            let revision = core.commit(shared, vec![Op::Delete { key }], Vec::new())?;
            Ok(Deleted { count, revision })
        })
        .await
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<Deleted> {
        let prefix = prefix.to_owned();
        self.exec(move |core, shared| {
            let ops: Vec<Op> = core.state.under(&prefix).map(|(key, _)| Op::Delete { key: key.clone() }).collect();
            let count = ops.len() as u64;
            let revision = core.commit(shared, ops, Vec::new())?;
            Ok(Deleted { count, revision })
        })
        .await
    }

    async fn list_prefix(&self, prefix: &str) -> Result<Listing> {
        Ok(self.shared.lock().state.list(prefix))
    }

    async fn watch_prefix(&self, prefix: &str, from: Option<Revision>) -> Result<WatchStream> {
        let revision_rx = self.shared.revision_tx.subscribe();
        let view = {
            let core = self.shared.lock();
            let state = &core.state;
            match from {
                None => WatchView::new(state.revision + 1, state.keys_at(prefix, state.revision)),
                Some(from) => {
                    let from = from.max(1);
                    if from - 1 > state.revision {
                        return Err(KvError::InvalidArgument(format!(
                            "watch from future revision {from} (current {})",
                            state.revision
                        )));
                    }
                    if from <= state.compact_revision {
                        return Err(KvError::Compacted { compact_revision: state.compact_revision });
                    }
                    WatchView::new(from, state.keys_at(prefix, from - 1))
                }
            }
        };
        let watch = EmbeddedWatch {
            shared: self.shared.clone(),
            prefix: prefix.to_owned(),
            view,
            pending: VecDeque::new(),
            revision_rx,
        };
        Ok(Box::pin(futures::stream::unfold(watch, |mut watch| async move {
            watch.next_event().await.map(|item| (item, watch))
        })))
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<Lease> {
        if ttl.is_zero() {
            return Err(KvError::InvalidArgument("lease TTL must be positive".into()));
        }
        self.ensure_reaper();
        let lease = self
            .exec(move |core, shared| {
                let id = core.state.next_lease_id;
                core.commit(shared, Vec::new(), vec![LeaseOp::Grant { id, ttl }])?;
                core.state.next_lease_id = id + 1;
                Ok(Lease { id, ttl })
            })
            .await?;
        self.shared.lease_wakeup.notify_one();
        Ok(lease)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        let mut core = self.shared.lock();
        let now = Instant::now();
        match core.state.leases.get_mut(&lease) {
            Some(entry) if entry.deadline > now => {
                entry.deadline = now + entry.ttl;
                Ok(())
            }
            _ => Err(KvError::LeaseNotFound(lease)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.exec(move |core, shared| {
            let Some(entry) = core.state.leases.get(&lease) else {
                return Err(KvError::LeaseNotFound(lease));
            };
            let ops = entry.keys.iter().map(|key| Op::Delete { key: key.clone() }).collect();
            core.commit(shared, ops, vec![LeaseOp::Remove { id: lease }])?;
            Ok(())
        })
        .await
    }

    async fn create(&self, key: &str, value: Bytes, lease: Option<LeaseId>) -> Result<Created> {
        self.check_size(key, &value)?;
        let key = key.to_owned();
        self.exec(move |core, shared| {
            if let Some(existing) = core.state.kv.get(&key) {
                return Ok(Created { won: false, revision: existing.mod_revision });
            }
            if let Some(id) = lease
                && !core.state.lease_alive(id, Instant::now())
            {
                return Err(KvError::LeaseNotFound(id));
            }
            let revision = core.commit(shared, vec![Op::Put { key, value, lease }], Vec::new())?;
            Ok(Created { won: true, revision })
        })
        .await
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: Revision,
        value: Bytes,
        lease: Option<LeaseId>,
    ) -> Result<Revision> {
        self.check_size(key, &value)?;
        let key = key.to_owned();
        self.exec(move |core, shared| {
            let current = core.state.mod_revision(&key);
            if current != expected {
                return Err(KvError::Conflict { key, current_revision: current });
            }
            if let Some(id) = lease
                && !core.state.lease_alive(id, Instant::now())
            {
                return Err(KvError::LeaseNotFound(id));
            }
            core.commit(shared, vec![Op::Put { key, value, lease }], Vec::new())
        })
        .await
    }

    async fn delete_if_revision(&self, key: &str, expected: Revision) -> Result<Revision> {
        let key = key.to_owned();
        self.exec(move |core, shared| {
            let current = core.state.mod_revision(&key);
            if current != expected {
                return Err(KvError::Conflict { key, current_revision: current });
            }
            core.commit(shared, vec![Op::Delete { key }], Vec::new())
        })
        .await
    }

    async fn current_revision(&self) -> Result<Revision> {
        Ok(self.shared.lock().state.revision)
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        let mut core = self.shared.lock();
        let state = &mut core.state;
        if revision > state.revision {
            return Err(KvError::InvalidArgument(format!(
                "cannot compact to future revision {revision} (current {})",
                state.revision
            )));
        }
        state.compact_to(revision);
        debug!(revision, "embedded history compacted");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips() {
        let record = Record {
            value: Bytes::from_static(b"hello"),
            create_revision: 2,
            mod_revision: 7,
            version: 3,
            lease: Some(9),
        };
        let decoded = decode_record("k", &encode_record(&record)).expect("decodes");
        assert_eq!(decoded.value, record.value);
        assert_eq!((decoded.create_revision, decoded.mod_revision, decoded.version, decoded.lease), (2, 7, 3, Some(9)));
        assert!(matches!(decode_record("k", &[1, 2, 3]), Err(KvError::Corrupt { .. })));
    }
}
