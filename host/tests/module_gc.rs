//! GC of module versions on the embedded kvstore: only versions nobody runs are offered
//! (never the one in force, in shadow or the newest), only what the decider names among
//! them is removed from the index, at the configured rate, and a removed version's blob goes
//! with it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wasmplane::app::KvstoreConfig;
use wasmplane::module_gc::{candidate_key, candidates, collect_module_versions};
use wasmplane::module_store::{BLOB_PREFIX, ModuleStore};
use wasmplane::registry::SharedIndex;
use wasmplane_kvstore::blob;
use wasmplane_operator::{DeciderError, GcCandidate, GcDecider};
use wasmplane_runtime::{GuestKind, ModuleInfo};

/// Names a fixed list, and remembers what it was offered.
struct Naming {
    names: Vec<String>,
    offered: Vec<String>,
}

impl GcDecider for Naming {
    fn collect(&mut self, candidates: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
        self.offered = candidates.iter().map(|c| c.key.clone()).collect();
        Ok(self.names.clone())
    }
}

fn info(bytes: &[u8]) -> ModuleInfo {
    ModuleInfo {
        digest: format!("sha256:{}", blob::digest_of(bytes)),
        kind: GuestKind::ServiceTranslator,
        interface: None,
        wit_version: "1.0.0".into(),
        size: bytes.len(),
        imports: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_unused_versions_are_offered_and_only_named_ones_go() {
    let dir = tempfile::tempdir().unwrap();
    let store = ModuleStore::new(KvstoreConfig::Embedded.open(Some(dir.path())).await.unwrap());
    // m: v1 and v2 activated in turn (v2 in force, v1 its rollback target), v3 never
    // activated, v4 newest; v5 of another module shares v3's bytes.
    let bytes: Vec<Vec<u8>> = (1..=4).map(|i| format!("component {i}").into_bytes()).collect();
    let mut index = SharedIndex::default();
    for b in &bytes {
        store.put_blob(&info(b).digest, b).await.unwrap();
        index.add_version("m", GuestKind::ServiceTranslator, &info(b), None).unwrap();
    }
    index.activate("m", Some(1)).unwrap();
    index.activate("m", Some(2)).unwrap();
    index.add_version("other", GuestKind::ServiceTranslator, &info(&bytes[2]), None).unwrap();
    index.add_version("other", GuestKind::ServiceTranslator, &info(b"other newest"), None).unwrap();
    store.put_blob(&info(b"other newest").digest, b"other newest").await.unwrap();
    assert!(store.publish(0, &index).await.unwrap().is_some());

    let offered: Vec<(String, bool)> =
        candidates(&index, u64::MAX).into_iter().map(|c| (c.key, c.owner_exists)).collect();
    assert_eq!(
        offered,
        vec![(candidate_key("m", 1), true), (candidate_key("m", 3), false), (candidate_key("other", 1), false)],
        "in force (m@2) and newest (m@4, other@2) never offered; a rollback target is offered as owned"
    );

    // The decider names v1, v3, the version in force and a key it was never offered.
    let names =
        vec![candidate_key("m", 1), candidate_key("m", 3), candidate_key("m", 2), "/wasmplane/locks/x".to_string()];
    let naming = Arc::new(Mutex::new(Naming { names, offered: vec![] }));
    let decider: Arc<Mutex<dyn GcDecider>> = naming.clone();
    let started = Instant::now();
    let report = collect_module_versions(&store, &decider, 4.0).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(250), "two removals at 4/s are spaced: {:?}", started.elapsed());
    assert_eq!(report.removed, vec![candidate_key("m", 1), candidate_key("m", 3)]);
    assert_eq!(report.refused, vec![candidate_key("m", 2), "/wasmplane/locks/x".to_string()]);

    let (after, _) = store.load().await.unwrap();
    let versions: Vec<u32> = after.modules["m"].versions.iter().map(|v| v.version).collect();
    assert_eq!(versions, vec![2, 4]);
    assert_eq!(after.in_force(GuestKind::ServiceTranslator), Some(("m", 2)), "what is in force is untouched");
    assert_eq!(after.modules["m"].activation_history, vec![2]);
    // v1's bytes are gone; v3's are still used by other@1; the rest stay.
    assert!(store.get_blob(&info(&bytes[0]).digest).await.is_err(), "the removed version's blob is deleted");
    for kept in [&bytes[1], &bytes[2], &bytes[3]] {
        assert_eq!(&store.get_blob(&info(kept).digest).await.unwrap()[..], &kept[..]);
    }
    assert_eq!(report.blobs_deleted, vec![info(&bytes[0]).digest]);
}

/// The race between the module GC deleting a blob and an upload of the same bytes (whose
/// `put_blob` is skipped while the blob exists): both sides end with `ensure_blob`, which
/// repairs a blob that is missing or half deleted (manifest without chunks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_deleted_or_half_deleted_under_an_upload_is_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let store = ModuleStore::new(KvstoreConfig::Embedded.open(Some(dir.path())).await.unwrap());
    let bytes = b"component shared by two versions".to_vec();
    let digest = info(&bytes).digest;
    store.put_blob(&digest, &bytes).await.unwrap();
    assert!(!store.ensure_blob(&digest, &bytes).await.unwrap(), "an intact blob is left alone");

    // GC deleted it after the upload's put_blob was skipped.
    blob::delete_blob(store.kv().as_ref(), BLOB_PREFIX, digest.trim_start_matches("sha256:")).await.unwrap();
    assert!(store.get_blob(&digest).await.is_err());
    assert!(store.ensure_blob(&digest, &bytes).await.unwrap());
    assert_eq!(&store.get_blob(&digest).await.unwrap()[..], &bytes[..]);

    // Half deleted: the manifest is there (so `put_blob` would skip), the chunks are not.
    let manifest = blob::manifest_key(BLOB_PREFIX, digest.trim_start_matches("sha256:"));
    store.kv().delete_prefix(&format!("{manifest}/")).await.unwrap();
    assert!(store.kv().get(&manifest).await.unwrap().is_some());
    assert!(store.get_blob(&digest).await.is_err());
    assert!(store.ensure_blob(&digest, &bytes).await.unwrap());
    assert_eq!(&store.get_blob(&digest).await.unwrap()[..], &bytes[..]);
}
