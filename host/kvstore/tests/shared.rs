//! Shared store: nodes see each other's local keys, and a node's keys come back
//! after the store lost them or was unreachable.

mod support;

use std::sync::Arc;
use std::time::Duration;

use wasmplane_kvstore::{
    Bytes, EmbeddedStore, KvStore, SharedBatch, SharedBatches, SharedChange, SharedEntry, SharedStore,
    SharedStoreConfig,
};
use wasmplane_test_etcd::Etcd;

use support::{etcd_store, eventually, init_tracing};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn config(ttl: Duration) -> SharedStoreConfig {
    let mut config = SharedStoreConfig::new("cluster/nodes/");
    config.lease_ttl = ttl;
    config.retry_max = Duration::from_millis(300);
    config
}

async fn two_nodes_see_each_other(a_store: Arc<dyn KvStore>, b_store: Arc<dyn KvStore>) {
    // Something already there before anybody joins.
    a_store.put("cluster/nodes/old", b("static"), None).await.expect("put");
    let a = SharedStore::join(a_store.clone(), config(Duration::from_secs(5))).await.expect("join a");
    let node_b = SharedStore::join(b_store.clone(), config(Duration::from_secs(5))).await.expect("join b");
    assert_eq!(a.get("old").map(|e| e.value), Some(b("static")), "join lists first");
    let (_, mut b_changes) = node_b.subscribe();

    a.update_local("a", b("10.0.0.1")).await.expect("local a");
    node_b.update_local("b", b("10.0.0.2")).await.expect("local b");
    eventually("both nodes see both keys", Duration::from_secs(10), || {
        let (sa, sb) = (a.snapshot(), node_b.snapshot());
        sa.contains_key("a") && sa.contains_key("b") && sb.contains_key("a") && sb.contains_key("b")
    })
    .await;
    assert_eq!(node_b.get("a").map(|e| e.value), Some(b("10.0.0.1")));
    let kv = b_store.get("cluster/nodes/a").await.expect("get").expect("stored");
    assert_eq!(kv.lease, a.lease(), "local keys hang on the node's lease");

    a.update_local("a", b("10.0.0.9")).await.expect("update a");
    a.close().await.expect("close a");
    eventually("b sees a's key vanish", Duration::from_secs(10), || !node_b.snapshot().contains_key("a")).await;
    // The change stream told the same story.
    let mut seen = Vec::new();
    while let Ok(change) = b_changes.try_recv() {
        seen.push(change);
    }
    let about_a: Vec<_> = seen
        .iter()
        .filter(|c| matches!(c, SharedChange::Upsert { name, .. } | SharedChange::Delete { name } if name == "a"))
        .collect();
    assert!(
        matches!(about_a.last(), Some(SharedChange::Delete { .. })),
        "changes about a end with its deletion: {about_a:?}"
    );
    assert!(about_a.iter().any(|c| matches!(c, SharedChange::Upsert { value, .. } if *value == b("10.0.0.9"))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_two_nodes_see_each_others_local_keys() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    two_nodes_see_each_other(etcd_store(etcd.endpoint()).await, etcd_store(etcd.endpoint()).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_two_nodes_see_each_others_local_keys() {
    init_tracing();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    two_nodes_see_each_other(store.clone(), store).await;
}

/// A follower sees what the joined nodes publish and changes after, but takes no
/// lease and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_reads_without_writing() {
    init_tracing();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let node = SharedStore::join(store.clone(), config(Duration::from_secs(5))).await.expect("join");
    node.update_local("a", b("1")).await.expect("write a");
    // Written once the node's lease is granted.
    eventually("a written", Duration::from_secs(5), || node.get("a").is_some()).await;
    let follower = SharedStore::follow(store.clone(), config(Duration::from_secs(5))).await.expect("follow");
    assert_eq!(follower.get("a").map(|e| e.value), Some(b("1")), "the listing reached the follower");
    let (_, mut changes) = follower.subscribe();
    node.update_local("b", b("2")).await.expect("write b");
    match tokio::time::timeout(Duration::from_secs(5), changes.recv()).await {
        Ok(Ok(SharedChange::Upsert { name, value, .. })) => assert_eq!((name.as_str(), value), ("b", b("2"))),
        other => panic!("expected b's upsert, got {other:?}"),
    }
    let refused = follower.update_local("c", b("3")).await.expect_err("a follower has no local keys");
    assert!(refused.to_string().contains("read-only"), "{refused}");
    assert!(follower.delete_local("a").await.is_err());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(follower.lease(), None, "no lease taken");
    let keys: Vec<String> =
        store.list_prefix("cluster/nodes/").await.expect("list").items.into_iter().map(|kv| kv.key).collect();
    assert_eq!(keys, ["cluster/nodes/a", "cluster/nodes/b"], "nothing written by the follower");
}

/// Batches: everything first, then bursts of changes, and everything again after falling
/// behind (what was missed is in it); the follower ends when the store is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_start_whole_come_in_bursts_and_start_whole_again_after_a_lag() {
    init_tracing();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let writer = SharedStore::join(store.clone(), config(Duration::from_secs(5))).await.expect("join");
    writer.update_local("a", b("1")).await.expect("write a");
    let mut follow_config = config(Duration::from_secs(5));
    follow_config.change_buffer = 4;
    let follower = SharedStore::follow(store.clone(), follow_config).await.expect("follow");
    eventually("a listed", Duration::from_secs(5), || follower.get("a").is_some()).await;
    let mut batches = follower.batches();
    let names = |entries: &std::collections::BTreeMap<String, SharedEntry>| entries.keys().cloned().collect::<Vec<_>>();
    match next(&mut batches).await {
        Some(SharedBatch::Snapshot(all)) => assert_eq!(names(&all), ["a"]),
        other => panic!("the first batch is everything: {other:?}"),
    }
    writer.update_local("b", b("2")).await.expect("write b");
    writer.delete_local("a").await.expect("delete a");
    let mut seen = Vec::new();
    while seen.len() < 2 {
        match next(&mut batches).await {
            Some(SharedBatch::Changes(changes)) => seen.extend(changes),
            other => panic!("changes expected: {other:?}"),
        }
    }
    assert!(matches!(&seen[0], SharedChange::Upsert { name, .. } if name == "b"), "{seen:?}");
    assert_eq!(seen[1], SharedChange::Delete { name: "a".into() });

    // More changes than the follower's buffer while nobody reads: the next batch is
    // everything, with all of them in it.
    for i in 0..12 {
        writer.update_local(&format!("k{i:02}"), b("x")).await.expect("write");
    }
    eventually("all written", Duration::from_secs(5), || follower.snapshot().len() == 13).await;
    match next(&mut batches).await {
        Some(SharedBatch::Snapshot(all)) => assert_eq!(all.len(), 13, "{:?}", names(&all)),
        other => panic!("a lagging follower starts whole again: {other:?}"),
    }
    drop(follower);
    assert_eq!(next(&mut batches).await, None, "the store is gone");
}

async fn next(batches: &mut SharedBatches) -> Option<SharedBatch> {
    tokio::time::timeout(Duration::from_secs(5), batches.next()).await.expect("a batch in time")
}

/// After etcd was down (longer than a renewal period) and came back, the node
/// re-writes all its local keys; the other node keeps seeing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_keys_rewritten_after_etcd_restart() {
    init_tracing();
    let mut etcd = Etcd::start().await.expect("etcd");
    let a_store = etcd_store(etcd.endpoint()).await;
    let a = SharedStore::join(a_store.clone(), config(Duration::from_secs(3))).await.expect("join a");
    let observer = SharedStore::join(etcd_store(etcd.endpoint()).await, config(Duration::from_secs(3)))
        .await
        .expect("join observer");
    a.update_local("a", b("up")).await.expect("local");
    a.update_local("a2", b("up")).await.expect("local");
    eventually("observer sees a's keys", Duration::from_secs(10), || observer.snapshot().len() == 2).await;
    let before = a_store.get("cluster/nodes/a").await.expect("get").expect("stored");
    let rewrites = a.full_rewrites();

    etcd.kill().await.expect("kill");
    // Longer than the 1 s renewal period, shorter than the 3 s TTL.
    tokio::time::sleep(Duration::from_millis(1800)).await;
    etcd.restart().await.expect("restart");

    eventually("a re-wrote its keys", Duration::from_secs(15), || a.full_rewrites() > rewrites).await;
    let after = support::retry_unavailable(|| a_store.get("cluster/nodes/a")).await.expect("still stored");
    assert!(after.mod_revision > before.mod_revision, "written again after the restart");
    assert_eq!(after.value, b("up"));
    eventually("observer has both keys after the restart", Duration::from_secs(10), || {
        let snap = observer.snapshot();
        snap.len() == 2 && snap.get("a").is_some_and(|e| e.mod_revision == after.mod_revision)
    })
    .await;
}

/// Losing the lease (revoked behind the node's back, like an expiry during a
/// long partition) deletes the keys; the node grants a new lease and writes them
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_keys_restored_after_lease_loss() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let store = etcd_store(etcd.endpoint()).await;
    let a = SharedStore::join(store.clone(), config(Duration::from_secs(5))).await.expect("join");
    a.update_local("a", b("v")).await.expect("local");
    eventually("lease granted and key written", Duration::from_secs(10), || a.get("a").is_some()).await;
    let old_lease = a.lease().expect("lease");
    store.revoke_lease(old_lease).await.expect("revoke behind its back");
    eventually("key back under a new lease", Duration::from_secs(10), || {
        a.lease().is_some_and(|l| l != old_lease) && a.get("a").is_some()
    })
    .await;
    let kv = store.get("cluster/nodes/a").await.expect("get").expect("rewritten");
    assert_eq!(kv.lease, a.lease());

    // Someone deletes one of our keys: repaired promptly, same lease.
    store.delete("cluster/nodes/a").await.expect("delete");
    eventually("deleted key repaired", Duration::from_secs(10), || a.get("a").is_some()).await;
    a.delete_local("a").await.expect("delete local");
    eventually("deleted local key stays gone", Duration::from_secs(5), || a.get("a").is_none()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(store.get("cluster/nodes/a").await.expect("get").is_none());
}
