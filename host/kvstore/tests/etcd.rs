//! etcd-only behaviour: what happens when the server goes away, comes back, or
//! compacts history a watcher still needed.

mod support;

use std::time::Duration;

use wasmplane_kvstore::{Bytes, KvError};
use wasmplane_test_etcd::{Etcd, TcpProxy};

use support::{assert_quiet, etcd_store, init_tracing, next_event, next_events, retry_unavailable, summary};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// Writes before a kill and after a restart reach the watcher exactly once each;
/// nothing can be written while etcd is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_resumes_across_kill_and_restart() {
    init_tracing();
    let mut etcd = Etcd::start().await.expect("etcd");
    let store = etcd_store(etcd.endpoint()).await;
    let mut watch = store.watch_prefix("res/", None).await.expect("watch");

    store.put("res/1", b("before-1"), None).await.expect("put");
    store.put("res/2", b("before-2"), None).await.expect("put");
    let before = next_events(&mut watch, 2, "writes before the kill").await;
    assert_eq!(
        summary(&before),
        [("res/1".into(), Some("before-1".into())), ("res/2".into(), Some("before-2".into()))]
    );

    etcd.kill().await.expect("kill");
    match store.put("res/during", b("x"), None).await {
        Err(KvError::Unavailable(_)) => {}
        other => panic!("a write with etcd down must be Unavailable, got {other:?}"),
    }
    // Let the watch notice the outage and go through a few reconnect attempts.
    tokio::time::sleep(Duration::from_millis(700)).await;
    etcd.restart().await.expect("restart");

    retry_unavailable(|| store.put("res/3", b("after-3"), None)).await;
    store.delete("res/1").await.expect("delete");
    let after = next_events(&mut watch, 2, "writes after the restart").await;
    assert_eq!(
        summary(&after),
        [("res/3".into(), Some("after-3".into())), ("res/1".into(), None)],
        "no event missed or replayed across the restart"
    );
    assert!(after[0].mod_revision > before[1].mod_revision);
    assert_quiet(&mut watch, Duration::from_millis(500)).await;
}

/// A watcher cut off while others write, delete and compact: when it comes back
/// its history is gone, so it relists and emits exactly the difference between
/// what it had delivered and the store now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_forces_relist_with_exact_diff() {
    init_tracing();
    let etcd = Etcd::start().await.expect("etcd");
    let proxy = TcpProxy::start(etcd.client_addr()).await.expect("proxy");
    let writer = etcd_store(etcd.endpoint()).await;
    let watcher = etcd_store(proxy.endpoint()).await;

    // Known to the watcher from before its start (seeded, never delivered)...
    writer.put("cmp/keep", b("k"), None).await.expect("put");
    writer.put("cmp/gone-old", b("g"), None).await.expect("put");
    let (listing, mut watch) = watcher.list_and_watch("cmp/").await.expect("list and watch");
    assert_eq!(listing.items.len(), 2);
    // ...and delivered by it.
    writer.put("cmp/change", b("v1"), None).await.expect("put");
    writer.put("cmp/gone-new", b("g"), None).await.expect("put");
    let delivered = next_events(&mut watch, 2, "events before the cut").await;
    assert_eq!(delivered.len(), 2);

    // The watcher stops receiving; meanwhile history moves on and is compacted.
    proxy.cut().await;
    writer.put("cmp/change", b("v2"), None).await.expect("put");
    writer.put("cmp/new", b("n"), None).await.expect("put");
    writer.delete("cmp/gone-old").await.expect("delete");
    writer.delete("cmp/gone-new").await.expect("delete");
    writer.put("cmp/tmp", b("t"), None).await.expect("put");
    writer.delete("cmp/tmp").await.expect("delete");
    writer.put("other/noise", b("x"), None).await.expect("put");
    let change_rev = writer.put("cmp/change", b("v3"), None).await.expect("put");
    let compacted = writer.current_revision().await.expect("revision");
    writer.compact(compacted).await.expect("compact");
    proxy.restore();

    let diff = next_events(&mut watch, 4, "the relist diff").await;
    assert_eq!(
        summary(&diff),
        [
            ("cmp/new".into(), Some("n".into())),
            ("cmp/change".into(), Some("v3".into())),
            ("cmp/gone-new".into(), None),
            ("cmp/gone-old".into(), None),
        ],
        "exactly the difference: puts by revision, then deletes"
    );
    assert_eq!(diff[1].mod_revision, change_rev);
    assert!(diff[2].mod_revision >= compacted && diff[3].mod_revision >= compacted);
    assert!(diff.windows(2).all(|w| w[0].mod_revision <= w[1].mod_revision), "revisions never go backwards");
    assert_quiet(&mut watch, Duration::from_millis(300)).await;

    // And it keeps watching from the listing's revision.
    let rev = writer.put("cmp/later", b("l"), None).await.expect("put");
    let event = next_event(&mut watch, "a write after the relist").await;
    assert_eq!((event.key.as_str(), event.mod_revision), ("cmp/later", rev));
}

/// A watch started while etcd is down is refused (its seed listing fails) with
/// a retryable error; one started before keeps waiting and delivers once etcd
/// is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_errors_are_unavailable() {
    init_tracing();
    let mut etcd = Etcd::start().await.expect("etcd");
    let store = etcd_store(etcd.endpoint()).await;
    let mut watch = store.watch_prefix("out/", None).await.expect("watch");
    etcd.stop().await.expect("stop");
    let err = store.list_prefix("out/").await.expect_err("etcd is down");
    assert!(err.is_retryable(), "{err}");
    assert!(matches!(store.watch_prefix("out/", None).await, Err(KvError::Unavailable(_))));
    assert!(matches!(store.grant_lease(Duration::from_secs(5)).await, Err(KvError::Unavailable(_))));
    etcd.restart().await.expect("restart");
    retry_unavailable(|| store.put("out/k", b("v"), None)).await;
    let event = next_event(&mut watch, "a write after the outage").await;
    assert_eq!(event.key, "out/k");
}
