//! Embedded-only behaviour: persistence across a reopen, and watches falling
//! behind compaction (explicit or from the bounded history).

mod support;

use std::time::Duration;

use wasmplane_kvstore::{Bytes, EmbeddedConfig, EmbeddedStore, KvError, KvStore};

use support::{assert_quiet, init_tracing, next_event, next_events, summary};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_revision_and_leases_survive_a_reopen() {
    init_tracing();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");

    let (revision, lease, blob_digest) = {
        let store = EmbeddedStore::open(EmbeddedConfig::persistent(&path)).await.expect("open");
        store.put("keep/a", b("1"), None).await.expect("put");
        store.put("keep/a", b("2"), None).await.expect("put");
        store.put("keep/gone", b("x"), None).await.expect("put");
        store.delete("keep/gone").await.expect("delete");
        let lease = store.grant_lease(Duration::from_secs(30)).await.expect("lease");
        store.put("keep/leased", b("l"), Some(lease.id)).await.expect("put");
        let data = vec![42u8; 1024 * 1024 + 7];
        let digest = wasmplane_kvstore::blob::put_blob(&store, "mods", &data).await.expect("blob");
        (store.current_revision().await.expect("revision"), lease, digest)
    };

    let store = EmbeddedStore::open(EmbeddedConfig::persistent(&path)).await.expect("reopen");
    assert_eq!(store.current_revision().await.expect("revision"), revision);
    let a = store.get("keep/a").await.expect("get").expect("present");
    assert_eq!((a.value, a.version), (b("2"), 2));
    assert_eq!(store.get("keep/gone").await.expect("get"), None);
    let leased = store.get("keep/leased").await.expect("get").expect("present");
    assert_eq!(leased.lease, Some(lease.id));
    store.keep_alive(lease.id).await.expect("the lease survived the reopen");
    let blob = wasmplane_kvstore::blob::get_blob(&store, "mods", &blob_digest).await.expect("blob survived");
    assert_eq!(blob.len(), 1024 * 1024 + 7);

    // Revisions continue; history before the reopen counts as compacted.
    assert_eq!(store.put("keep/b", b("b"), None).await.expect("put"), revision + 1);
    assert_eq!(
        store.watch_prefix("keep/", Some(revision)).await.err(),
        Some(KvError::Compacted { compact_revision: revision })
    );
    let mut watch = store.watch_prefix("keep/", Some(revision + 1)).await.expect("watch");
    assert_eq!(next_event(&mut watch, "first write after reopen").await.key, "keep/b");

    // A new lease does not reuse an old id.
    let new_lease = store.grant_lease(Duration::from_secs(30)).await.expect("lease");
    assert!(new_lease.id > lease.id);
    store.revoke_lease(lease.id).await.expect("revoke restored lease");
    assert_eq!(store.get("keep/leased").await.expect("get"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_restored_on_reopen_expire_if_not_renewed() {
    init_tracing();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    {
        let store = EmbeddedStore::open(EmbeddedConfig::persistent(&path)).await.expect("open");
        let lease = store.grant_lease(Duration::from_millis(800)).await.expect("lease");
        store.put("exp/k", b("v"), Some(lease.id)).await.expect("put");
    }
    let store = EmbeddedStore::open(EmbeddedConfig::persistent(&path)).await.expect("reopen");
    assert!(store.get("exp/k").await.expect("get").is_some(), "a fresh TTL after reopen");
    let mut watch = store.watch_prefix("exp/", None).await.expect("watch");
    let event = next_event(&mut watch, "expiry of the restored lease").await;
    assert!(event.is_delete());
}

/// The consumer stops reading; writes, deletes and a compaction happen; when it
/// reads again it gets exactly the difference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_watcher_behind_compaction_gets_exact_diff() {
    init_tracing();
    let store = EmbeddedStore::in_memory();
    store.put("d/keep", b("k"), None).await.expect("put");
    store.put("d/gone-old", b("g"), None).await.expect("put");
    let (_, mut watch) = store.list_and_watch("d/").await.expect("list and watch");
    store.put("d/change", b("v1"), None).await.expect("put");
    next_event(&mut watch, "delivered put").await;

    store.put("d/change", b("v2"), None).await.expect("put");
    store.put("d/new", b("n"), None).await.expect("put");
    store.delete("d/gone-old").await.expect("delete");
    store.put("d/tmp", b("t"), None).await.expect("put");
    store.delete("d/tmp").await.expect("delete");
    let now = store.current_revision().await.expect("revision");
    store.compact(now).await.expect("compact");

    let diff = next_events(&mut watch, 3, "the diff").await;
    assert_eq!(
        summary(&diff),
        [("d/change".into(), Some("v2".into())), ("d/new".into(), Some("n".into())), ("d/gone-old".into(), None),]
    );
    assert_eq!(diff[2].mod_revision, now);
    assert_quiet(&mut watch, Duration::from_millis(100)).await;
    store.put("d/after", b("a"), None).await.expect("put");
    assert_eq!(next_event(&mut watch, "after the diff").await.key, "d/after");
}

/// History is bounded; a watcher that falls further behind relists on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_history_compacts_and_watchers_relist() {
    init_tracing();
    let mut config = EmbeddedConfig::in_memory();
    config.history_max_events = 10;
    let store = EmbeddedStore::open(config).await.expect("open");
    let mut watch = store.watch_prefix("h/", None).await.expect("watch");
    for i in 0..50 {
        store.put(&format!("h/{}", i % 5), b(&i.to_string()), None).await.expect("put");
    }
    let events = next_events(&mut watch, 5, "one put per key").await;
    let mut latest: Vec<_> = summary(&events);
    latest.sort();
    assert_eq!(latest, (45..50).map(|i| (format!("h/{}", i % 5), Some(i.to_string()))).collect::<Vec<_>>());
    assert_quiet(&mut watch, Duration::from_millis(100)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_durable_mode_persists_on_clean_close() {
    init_tracing();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("fast.redb");
    let mut config = EmbeddedConfig::persistent(&path);
    config.durable = false;
    {
        let store = EmbeddedStore::open(config.clone()).await.expect("open");
        store.put("f/k", b("v"), None).await.expect("put");
    }
    let store = EmbeddedStore::open(config).await.expect("reopen");
    assert_eq!(store.get("f/k").await.expect("get").map(|kv| kv.value), Some(b("v")));
}
