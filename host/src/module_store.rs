//! Modules in the kvstore, so an upload to one host reaches every host through the watch.
//!
//! - `/wasmplane/modules/index`: the [`SharedIndex`] as JSON, changed only by
//!   compare-and-swap on its revision (read, transform, swap; retry on conflict).
//! - `/wasmplane/modules/blobs/…`: component bytes, content-addressed and chunked (etcd caps
//!   a request at 1.5 MiB), written before the index names them.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use wasmplane_kvstore::{Bytes, KvError, KvStore, Revision, blob};

use crate::registry::{RegistryError, SharedIndex};

pub const INDEX_KEY: &str = "/wasmplane/modules/index";
pub const BLOB_PREFIX: &str = "/wasmplane/modules/blobs/";

/// Compare-and-swap attempts before an update gives up under contention.
pub const MAX_CAS_ATTEMPTS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("kvstore: {0}")]
    Kv(#[from] KvError),
    #[error("the module index in the kvstore is not valid JSON: {0}")]
    Corrupt(String),
    #[error(transparent)]
    Refused(#[from] RegistryError),
    #[error("the module index kept changing under {0} attempts to update it")]
    Contended(usize),
    #[error("blob {digest} from the kvstore does not match its digest")]
    Tampered { digest: String },
}

#[derive(Clone)]
pub struct ModuleStore {
    kv: Arc<dyn KvStore>,
}

fn blob_digest(digest: &str) -> &str {
    digest.trim_start_matches("sha256:")
}

impl ModuleStore {
    pub fn new(kv: Arc<dyn KvStore>) -> ModuleStore {
        ModuleStore { kv }
    }

    pub fn kv(&self) -> &Arc<dyn KvStore> {
        &self.kv
    }

    /// The index and the revision it was read at (0: never written).
    pub async fn load(&self) -> Result<(SharedIndex, Revision), StoreError> {
        match self.kv.get(INDEX_KEY).await? {
            None => Ok((SharedIndex::default(), 0)),
            Some(kv) => Ok((
                serde_json::from_slice(&kv.value).map_err(|e| StoreError::Corrupt(e.to_string()))?,
                kv.mod_revision,
            )),
        }
    }

    /// Publishes `new` if the index is still at `revision`: the new revision, or `None` if
    /// someone changed it first.
    pub async fn publish(&self, revision: Revision, new: &SharedIndex) -> Result<Option<Revision>, StoreError> {
        let value = Bytes::from(serde_json::to_vec(new).expect("the index serialises"));
        if revision == 0 {
            let created = self.kv.create(INDEX_KEY, value, None).await?;
            return Ok(created.won.then_some(created.revision));
        }
        match self.kv.compare_and_swap(INDEX_KEY, revision, value, None).await {
            Ok(revision) => Ok(Some(revision)),
            Err(KvError::Conflict { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn put_blob(&self, digest: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let stored = blob::put_blob(self.kv.as_ref(), BLOB_PREFIX, bytes).await?;
        debug_assert_eq!(stored, blob_digest(digest));
        Ok(())
    }

    /// Makes sure the whole blob is there: reads it back and, if it is missing, partial or
    /// wrong, deletes what is left and writes it again. For the two sides of the race
    /// between an upload of bytes another version already has (its `put_blob` is skipped)
    /// and the module GC deleting that blob: the upload checks after publishing its
    /// version, the GC restores when it sees a reference after deleting, so whichever looks
    /// last repairs what the other did.
    pub async fn ensure_blob(&self, digest: &str, bytes: &[u8]) -> Result<bool, StoreError> {
        if self.get_blob(digest).await.is_ok() {
            return Ok(false);
        }
        blob::delete_blob(self.kv.as_ref(), BLOB_PREFIX, blob_digest(digest)).await?;
        self.put_blob(digest, bytes).await?;
        tracing::warn!(digest, "module blob was missing or incomplete after a concurrent GC; written again");
        Ok(true)
    }

    /// The bytes of a blob, checked against their digest.
    pub async fn get_blob(&self, digest: &str) -> Result<Bytes, StoreError> {
        let bytes = blob::get_blob(self.kv.as_ref(), BLOB_PREFIX, blob_digest(digest)).await?;
        if blob::digest_of(&bytes) != blob_digest(digest) {
            return Err(StoreError::Tampered { digest: digest.to_string() });
        }
        Ok(bytes)
    }

    /// Calls `on_change` with every new version of the index, from `after` on, until the
    /// callback's future says stop. Survives kvstore outages: the stream resumes from the
    /// last revision seen (the backends relist after compaction).
    pub async fn watch<F, Fut>(&self, mut after: Revision, mut on_change: F)
    where
        F: FnMut(SharedIndex, Revision) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let mut delay = Duration::from_millis(100);
        loop {
            let mut stream = match self.kv.watch_prefix(INDEX_KEY, Some(after + 1)).await {
                Ok(stream) => stream,
                // The history from `after` on is gone (a restarted embedded store keeps none;
                // etcd compacts): read the index as it is now and watch from the compaction
                // point on. Retrying from `after` would fail the same way forever.
                Err(KvError::Compacted { compact_revision }) if compact_revision > after => {
                    match self.load().await {
                        Ok((index, revision)) => {
                            tracing::info!(
                                after,
                                compact_revision,
                                revision,
                                "module index history compacted; read it anew"
                            );
                            if revision > after {
                                on_change(index, revision).await;
                            }
                            after = compact_revision.max(revision);
                        }
                        Err(e) => {
                            tracing::warn!(
                                "re-reading the module index after a compaction: {e}; retrying in {delay:?}"
                            );
                            tokio::time::sleep(delay).await;
                            delay = (delay * 2).min(Duration::from_secs(5));
                        }
                    }
                    continue;
                }
                Err(e) => {
                    tracing::warn!("watching the module index: {e}; retrying in {delay:?}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            delay = Duration::from_millis(100);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(event) if event.key == INDEX_KEY => {
                        after = event.mod_revision;
                        let index = match &event.value {
                            None => SharedIndex::default(),
                            Some(value) => match serde_json::from_slice(value) {
                                Ok(index) => index,
                                Err(e) => {
                                    tracing::error!(
                                        revision = after,
                                        "ignoring a module index that is not valid JSON: {e}"
                                    );
                                    continue;
                                }
                            },
                        };
                        on_change(index, after).await;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!("module index watch interrupted: {e}; resuming after revision {after}");
                        break;
                    }
                }
            }
            tokio::time::sleep(delay).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmplane_kvstore::{EmbeddedConfig, EmbeddedStore};

    async fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<(SharedIndex, Revision)>) -> (SharedIndex, Revision) {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the watch delivered nothing within 5 s")
            .unwrap()
    }

    /// A host restarted on its data directory watches the index from where its last run
    /// read it, but a reopened embedded store keeps no history: the watch must read the index
    /// anew and go on from there instead of failing on the compacted revision forever.
    #[tokio::test]
    async fn the_index_watch_recovers_from_compacted_history() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.redb");
        let index = |n: usize| {
            let mut index = SharedIndex::default();
            index.in_force.insert(wasmplane_runtime::GuestKind::ServiceTranslator, format!("translator-{n}"));
            index
        };
        let first = {
            let store =
                ModuleStore::new(Arc::new(EmbeddedStore::open(EmbeddedConfig::persistent(&path)).await.unwrap()));
            let first = store.publish(0, &index(1)).await.unwrap().unwrap();
            let second = store.publish(first, &index(2)).await.unwrap().unwrap();
            store.kv().put("/unrelated", Bytes::from_static(b"x"), None).await.unwrap();
            assert!(second > first);
            first
        };
        let store = ModuleStore::new(Arc::new(EmbeddedStore::open(EmbeddedConfig::persistent(&path)).await.unwrap()));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let watcher = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .watch(first, move |index, revision| {
                        let tx = tx.clone();
                        async move {
                            let _ = tx.send((index, revision));
                        }
                    })
                    .await
            })
        };
        // What changed while the history was lost: the index as it is now.
        let (seen, revision) = next(&mut rx).await;
        assert_eq!(seen, index(2));
        // And later changes, through the watch.
        let third = store.publish(revision, &index(3)).await.unwrap().unwrap();
        let (seen, at) = next(&mut rx).await;
        assert_eq!((seen, at), (index(3), third));
        watcher.abort();
    }
}
