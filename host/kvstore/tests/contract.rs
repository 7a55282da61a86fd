//! The kvstore contract: one set of tests, run unchanged against every backend
//! (embedded in memory, embedded on disk, real etcd 3.4 from Debian's
//! `etcd-server`). Host code written against `Arc<dyn KvStore>` may rely on
//! exactly what is asserted here.

mod support;

use std::sync::Arc;
use std::time::Duration;

use wasmplane_kvstore::{Bytes, KvError, KvStore, LeaseKeeper, blob};

use support::{assert_quiet, next_event, next_events, summary};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// Generates one `#[tokio::test]` per (backend, contract test).
macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod embedded_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let f = crate::support::fixture(crate::support::Backend::Memory).await;
                    super::$name(f.store.clone()).await;
                }
            )*
        }
        mod embedded_disk {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let f = crate::support::fixture(crate::support::Backend::Disk).await;
                    super::$name(f.store.clone()).await;
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let f = crate::support::fixture(crate::support::Backend::Etcd).await;
                    super::$name(f.store.clone()).await;
                }
            )*
        }
    };
}

contract!(
    crud,
    prefix_list_and_delete,
    watch_from_revision,
    watch_resume_from_last_seen_revision,
    watch_from_compacted_revision_fails,
    lease_expiry_deletes_key_and_watcher_sees_it,
    lease_keepalive_and_revoke,
    concurrent_create_has_exactly_one_winner,
    compare_and_swap_conflicts,
    blob_round_trip_3_mib,
    too_large_is_typed,
);

async fn crud(store: Arc<dyn KvStore>) {
    let start = store.current_revision().await.expect("revision");
    assert!(start >= 1);
    let r1 = store.put("crud/k", b("v1"), None).await.expect("put");
    assert!(r1 > start, "a write bumps the revision");
    let kv = store.get("crud/k").await.expect("get").expect("present");
    assert_eq!(kv.value, b("v1"));
    assert_eq!((kv.create_revision, kv.mod_revision, kv.version, kv.lease), (r1, r1, 1, None));

    let r2 = store.put("crud/k", b("v2"), None).await.expect("put again");
    assert!(r2 > r1);
    let kv = store.get("crud/k").await.expect("get").expect("present");
    assert_eq!((kv.value, kv.create_revision, kv.mod_revision, kv.version), (b("v2"), r1, r2, 2));
    assert_eq!(store.current_revision().await.expect("revision"), r2);

    let deleted = store.delete("crud/k").await.expect("delete");
    assert_eq!(deleted.count, 1);
    assert!(deleted.revision > r2);
    assert_eq!(store.get("crud/k").await.expect("get"), None);
    let again = store.delete("crud/k").await.expect("delete absent");
    assert_eq!(again.count, 0);
    assert_eq!(again.revision, deleted.revision, "deleting nothing does not bump the revision");
    assert_eq!(store.get("crud/missing").await.expect("get"), None);
}

async fn prefix_list_and_delete(store: Arc<dyn KvStore>) {
    for key in ["p/a/2", "p/a/1", "p/ab", "p/b", "p/a/3"] {
        store.put(key, b(key), None).await.expect("put");
    }
    let listing = store.list_prefix("p/a/").await.expect("list");
    let keys: Vec<_> = listing.items.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["p/a/1", "p/a/2", "p/a/3"], "only the prefix, in key order");
    assert_eq!(listing.items[0].value, b("p/a/1"));
    assert_eq!(listing.revision, store.current_revision().await.expect("revision"));
    assert_eq!(store.list_prefix("p/").await.expect("list").items.len(), 5);
    assert!(store.list_prefix("none/").await.expect("list").items.is_empty());

    let before = listing.revision;
    let deleted = store.delete_prefix("p/a/").await.expect("delete prefix");
    assert_eq!(deleted.count, 3);
    assert_eq!(deleted.revision, before + 1, "one revision for the whole prefix");
    let rest: Vec<_> = store.list_prefix("p/").await.expect("list").items.into_iter().map(|kv| kv.key).collect();
    assert_eq!(rest, ["p/ab", "p/b"]);
}

async fn watch_from_revision(store: Arc<dyn KvStore>) {
    let _ra = store.put("w/a", b("a"), None).await.expect("put");
    let rb = store.put("w/b", b("b"), None).await.expect("put");
    let rc = store.put("w/c", b("c"), None).await.expect("put");
    store.put("other/x", b("x"), None).await.expect("put outside the prefix");

    let mut watch = store.watch_prefix("w/", Some(rb)).await.expect("watch");
    let events = next_events(&mut watch, 2, "history from rb").await;
    assert_eq!(summary(&events), [("w/b".into(), Some("b".into())), ("w/c".into(), Some("c".into()))]);
    assert_eq!((events[0].mod_revision, events[1].mod_revision), (rb, rc));

    let rd = store.put("w/d", b("d"), None).await.expect("put");
    let event = next_event(&mut watch, "live put").await;
    assert_eq!((event.key.as_str(), event.mod_revision), ("w/d", rd));
    let del = store.delete("w/a").await.expect("delete");
    let event = next_event(&mut watch, "live delete").await;
    assert!(event.is_delete());
    assert_eq!((event.key.as_str(), event.mod_revision), ("w/a", del.revision));

    // From the beginning of history.
    let mut all = store.watch_prefix("w/", Some(1)).await.expect("watch from 1");
    let first = next_event(&mut all, "first event in history").await;
    assert_eq!((first.key.as_str(), first.value.clone()), ("w/a", Some(b("a"))));

    // From "now": only later changes.
    let mut now = store.watch_prefix("w/", None).await.expect("watch now");
    let re = store.put("w/e", b("e"), None).await.expect("put");
    let event = next_event(&mut now, "put after watch from now").await;
    assert_eq!((event.key.as_str(), event.mod_revision), ("w/e", re));
    assert_quiet(&mut now, Duration::from_millis(200)).await;
}

async fn watch_resume_from_last_seen_revision(store: Arc<dyn KvStore>) {
    let mut watch = store.watch_prefix("r/", None).await.expect("watch");
    for i in 0..3 {
        store.put(&format!("r/{i}"), b("v"), None).await.expect("put");
    }
    let seen = next_events(&mut watch, 3, "first batch").await;
    let last = seen.last().map(|e| e.mod_revision).expect("events");
    drop(watch);

    // Missed while not watching.
    store.put("r/3", b("v"), None).await.expect("put");
    store.delete("r/0").await.expect("delete");

    let mut resumed = store.watch_prefix("r/", Some(last + 1)).await.expect("resume");
    let events = next_events(&mut resumed, 2, "missed events").await;
    assert_eq!(summary(&events), [("r/3".into(), Some("v".into())), ("r/0".into(), None)]);
    assert!(events.iter().all(|e| e.mod_revision > last), "nothing replayed twice");
    assert_quiet(&mut resumed, Duration::from_millis(200)).await;
}

async fn watch_from_compacted_revision_fails(store: Arc<dyn KvStore>) {
    let r1 = store.put("c/a", b("1"), None).await.expect("put");
    store.put("c/a", b("2"), None).await.expect("put");
    let r3 = store.put("c/b", b("3"), None).await.expect("put");
    store.compact(r3).await.expect("compact");
    store.compact(r1).await.expect("compacting below the compaction point is a no-op");

    match store.watch_prefix("c/", Some(r1)).await {
        Err(KvError::Compacted { compact_revision }) => assert_eq!(compact_revision, r3),
        Err(e) => panic!("expected Compacted, got {e}"),
        Ok(_) => panic!("expected Compacted, got a watch"),
    }
    assert!(matches!(store.watch_prefix("c/", Some(1)).await, Err(KvError::Compacted { .. })));
    // After a relist, watching from the listing's revision works.
    let (listing, mut watch) = store.list_and_watch("c/").await.expect("list and watch");
    assert_eq!(listing.items.len(), 2);
    let r4 = store.put("c/c", b("4"), None).await.expect("put");
    let event = next_event(&mut watch, "put after relist").await;
    assert_eq!((event.key.as_str(), event.mod_revision), ("c/c", r4));
    assert!(matches!(store.compact(r4 + 100).await, Err(KvError::InvalidArgument(_))));
}

async fn lease_expiry_deletes_key_and_watcher_sees_it(store: Arc<dyn KvStore>) {
    let lease = store.grant_lease(Duration::from_secs(1)).await.expect("grant");
    assert!(lease.ttl >= Duration::from_secs(1));
    let mut watch = store.watch_prefix("l/", None).await.expect("watch");
    let put_rev = store.put("l/owned", b("mine"), Some(lease.id)).await.expect("put with lease");
    store.put("l/free", b("free"), None).await.expect("put without lease");
    let kv = store.get("l/owned").await.expect("get").expect("present");
    assert_eq!(kv.lease, Some(lease.id));
    next_events(&mut watch, 2, "the two puts").await;

    // Not kept alive: expires (etcd checks expiry about every 500 ms).
    let event = next_event(&mut watch, "the lease expiry delete").await;
    assert_eq!(event.key, "l/owned");
    assert!(event.is_delete());
    assert!(event.mod_revision > put_rev);
    assert_eq!(store.get("l/owned").await.expect("get"), None);
    assert!(store.get("l/free").await.expect("get").is_some(), "unleased key stays");

    assert_eq!(store.keep_alive(lease.id).await, Err(KvError::LeaseNotFound(lease.id)));
    assert_eq!(store.put("l/late", b("x"), Some(lease.id)).await, Err(KvError::LeaseNotFound(lease.id)));
    assert_eq!(store.revoke_lease(lease.id).await, Err(KvError::LeaseNotFound(lease.id)));
}

async fn lease_keepalive_and_revoke(store: Arc<dyn KvStore>) {
    let keeper = LeaseKeeper::grant(store.clone(), Duration::from_secs(1)).await.expect("grant");
    store.put("k/a", b("a"), Some(keeper.id())).await.expect("put");
    store.put("k/b", b("b"), Some(keeper.id())).await.expect("put");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(store.get("k/a").await.expect("get").is_some(), "kept-alive lease outlives its TTL");
    assert_eq!(keeper.status(), wasmplane_kvstore::LeaseStatus::Alive);

    let mut watch = store.watch_prefix("k/", None).await.expect("watch");
    keeper.revoke().await.expect("revoke");
    let events = next_events(&mut watch, 2, "revocation deletes").await;
    assert!(events.iter().all(|e| e.is_delete()));
    assert_eq!(events[0].mod_revision, events[1].mod_revision, "one revision for the revocation");
    assert!(store.list_prefix("k/").await.expect("list").items.is_empty());
}

async fn concurrent_create_has_exactly_one_winner(store: Arc<dyn KvStore>) {
    const CONTENDERS: usize = 32;
    let barrier = Arc::new(tokio::sync::Barrier::new(CONTENDERS));
    let mut tasks = Vec::new();
    for i in 0..CONTENDERS {
        let store = store.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let created = store.create("race/leader", b(&format!("node-{i}")), None).await.expect("create");
            (i, created)
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("task"));
    }
    let winners: Vec<_> = outcomes.iter().filter(|(_, c)| c.won).collect();
    assert_eq!(winners.len(), 1, "exactly one winner: {outcomes:?}");
    let (winner, won) = winners[0];
    let kv = store.get("race/leader").await.expect("get").expect("present");
    assert_eq!(kv.value, b(&format!("node-{winner}")));
    assert_eq!(kv.mod_revision, won.revision);
    assert!(
        outcomes.iter().filter(|(_, c)| !c.won).all(|(_, c)| c.revision == won.revision),
        "losers learn the winner's revision"
    );
}

async fn compare_and_swap_conflicts(store: Arc<dyn KvStore>) {
    let r1 = store.put("cas/k", b("v1"), None).await.expect("put");
    let r2 = store.compare_and_swap("cas/k", r1, b("v2"), None).await.expect("cas");
    assert!(r2 > r1);
    assert_eq!(
        store.compare_and_swap("cas/k", r1, b("v3"), None).await,
        Err(KvError::Conflict { key: "cas/k".into(), current_revision: r2 })
    );
    assert_eq!(store.get("cas/k").await.expect("get").expect("present").value, b("v2"));

    // Expected 0 means "absent".
    assert!(matches!(store.compare_and_swap("cas/k", 0, b("x"), None).await, Err(KvError::Conflict { .. })));
    let created = store.compare_and_swap("cas/new", 0, b("n"), None).await.expect("cas create");
    assert_eq!(store.get("cas/new").await.expect("get").expect("present").mod_revision, created);

    assert_eq!(
        store.delete_if_revision("cas/k", r1).await,
        Err(KvError::Conflict { key: "cas/k".into(), current_revision: r2 })
    );
    let deleted_at = store.delete_if_revision("cas/k", r2).await.expect("delete if revision");
    assert!(deleted_at > created);
    assert_eq!(store.get("cas/k").await.expect("get"), None);

    let lost = store.create("cas/new", b("again"), None).await.expect("create existing");
    assert_eq!((lost.won, lost.revision), (false, created));
}

async fn blob_round_trip_3_mib(store: Arc<dyn KvStore>) {
    // Deterministic, incompressible-looking content.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let data: Vec<u8> = (0..3 * 1024 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let digest = blob::put_blob(store.as_ref(), "modules/", &data).await.expect("put blob");
    assert_eq!(digest, blob::digest_of(&data));
    let manifest = blob::get_blob_manifest(store.as_ref(), "modules", &digest).await.expect("manifest");
    assert_eq!((manifest.size, manifest.chunks), (data.len() as u64, 6));
    let chunks = store.list_prefix(&format!("modules/{digest}/")).await.expect("list chunks");
    assert!(chunks.items.iter().all(|kv| kv.value.len() <= blob::CHUNK_SIZE));

    let back = blob::get_blob(store.as_ref(), "modules/", &digest).await.expect("get blob");
    assert_eq!(back.as_ref(), data.as_slice());
    let rev = store.current_revision().await.expect("revision");
    assert_eq!(blob::put_blob(store.as_ref(), "modules/", &data).await.expect("again"), digest);
    assert_eq!(store.current_revision().await.expect("revision"), rev, "re-upload is a no-op");

    // Damage one chunk: reading must notice.
    store.put(&blob::chunk_key("modules", &digest, 2), b("garbage"), None).await.expect("damage");
    assert!(matches!(blob::get_blob(store.as_ref(), "modules/", &digest).await, Err(KvError::Corrupt { .. })));
    let unknown = blob::digest_of(b"never stored");
    assert!(matches!(blob::get_blob(store.as_ref(), "modules/", &unknown).await, Err(KvError::NotFound(_))));
    blob::delete_blob(store.as_ref(), "modules/", &digest).await.expect("delete blob");
    assert!(store.list_prefix("modules/").await.expect("list").items.is_empty());
}

async fn too_large_is_typed(store: Arc<dyn KvStore>) {
    let big = Bytes::from(vec![7u8; 2 * 1024 * 1024]);
    match store.put("big/k", big.clone(), None).await {
        Err(KvError::TooLarge { size, .. }) => assert!(size >= big.len()),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(matches!(store.create("big/k", big, None).await, Err(KvError::TooLarge { .. })));
    // Just under etcd's limit goes through.
    let fits = Bytes::from(vec![7u8; 1024 * 1024]);
    store.put("big/k", fits, None).await.expect("1 MiB fits");
    assert!(matches!(store.put("big/other", b("x"), Some(0x7777)).await, Err(KvError::LeaseNotFound(0x7777))));
}
