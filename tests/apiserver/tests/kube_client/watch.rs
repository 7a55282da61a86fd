//! kube's watcher and reflector against the server: every kind wasmplane watches,
//! relists after compaction, bookmarks, timeouts, selector transitions, pagination,
//! streaming lists.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event, watcher};
use kube::runtime::{WatchStreamExt as _, reflector};
use kube::{Resource, ResourceExt as _};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use wasmplane_test_apiserver::{TestApiServer, Verb};

use crate::common::{eventually, init_tracing, labels_patch, next, node, reflected, service, stored, watching};

type Events<K> = futures::stream::BoxStream<'static, Result<Event<K>, watcher::Error>>;

async fn next_event<K: Debug>(events: &mut Events<K>) -> Event<K> {
    match next(events).await {
        Ok(event) => event,
        Err(e) => panic!("watcher error: {e}"),
    }
}

/// Initial list of one object, then create, modify and delete through the API, each seen
/// by kube's watcher.
async fn watch_kind<K>(server: &TestApiServer, writes: Api<K>, make: fn(&str) -> Value)
where
    K: Resource<DynamicType = ()>
        + k8s_openapi::Resource
        + Clone
        + Debug
        + DeserializeOwned
        + Serialize
        + Send
        + Sync
        + 'static,
{
    let object = |name: &str| -> K { serde_json::from_value(make(name)).expect("object JSON") };
    let kind = K::KIND;
    server.create(&object("existing")).unwrap();
    let mut events: Events<K> = watcher(Api::all(server.client()), watcher::Config::default()).boxed();
    assert!(matches!(next_event(&mut events).await, Event::Init), "{kind}: Init");
    match next_event(&mut events).await {
        Event::InitApply(o) => assert_eq!(o.name_any(), "existing", "{kind}"),
        other => panic!("{kind}: expected InitApply, got {other:?}"),
    }
    assert!(matches!(next_event(&mut events).await, Event::InitDone), "{kind}: InitDone");

    writes.create(&PostParams::default(), &object("fresh")).await.unwrap();
    match next_event(&mut events).await {
        Event::Apply(o) => assert_eq!(o.name_any(), "fresh", "{kind}"),
        other => panic!("{kind}: expected Apply(fresh), got {other:?}"),
    }
    let patch = labels_patch(json!({ "changed": "yes" }));
    writes.patch("fresh", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    match next_event(&mut events).await {
        Event::Apply(o) => assert_eq!(o.labels().get("changed").map(String::as_str), Some("yes"), "{kind}"),
        other => panic!("{kind}: expected Apply(fresh, changed), got {other:?}"),
    }
    writes.delete("fresh", &DeleteParams::default()).await.unwrap();
    match next_event(&mut events).await {
        Event::Delete(o) => assert_eq!(o.name_any(), "fresh", "{kind}"),
        other => panic!("{kind}: expected Delete(fresh), got {other:?}"),
    }
}

#[tokio::test]
async fn watcher_sees_every_kind() {
    init_tracing();
    let server = TestApiServer::start().await;
    let client = server.client();
    watch_kind::<Service>(
        &server,
        Api::namespaced(client.clone(), "default"),
        |name| json!({ "metadata": { "name": name, "namespace": "default" }, "spec": { "ports": [{ "port": 80 }] } }),
    )
    .await;
    watch_kind::<EndpointSlice>(&server, Api::namespaced(client.clone(), "default"), |name| {
        json!({
            "metadata": { "name": name, "namespace": "default", "labels": { "kubernetes.io/service-name": "web" } },
            "addressType": "IPv4",
            "endpoints": [{ "addresses": ["10.1.0.1"], "conditions": { "ready": true } }],
            "ports": [{ "port": 8080 }],
        })
    })
    .await;
    watch_kind::<Node>(&server, Api::all(client.clone()), |name| json!({ "metadata": { "name": name } })).await;
    watch_kind::<Pod>(&server, Api::namespaced(client.clone(), "default"), |name| {
        json!({
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "nodeName": "n1", "containers": [{ "name": "c", "image": "i" }] },
        })
    })
    .await;
    watch_kind::<Namespace>(&server, Api::all(client.clone()), |name| json!({ "metadata": { "name": name } })).await;
    watch_kind::<NetworkPolicy>(
        &server,
        Api::namespaced(client.clone(), "default"),
        |name| json!({ "metadata": { "name": name, "namespace": "default" }, "spec": { "podSelector": {} } }),
    )
    .await;
    watch_kind::<Lease>(
        &server,
        Api::namespaced(client, "default"),
        |name| json!({ "metadata": { "name": name, "namespace": "default" }, "spec": { "holderIdentity": "a" } }),
    )
    .await;
}

/// A watcher feeding a reflector in the background, its errors collected.
struct Reflected {
    reader: reflector::Store<Service>,
    errors: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Reflected {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn reflect(server: &TestApiServer, config: watcher::Config) -> Reflected {
    let (reader, writer) = reflector::store();
    let errors = Arc::new(Mutex::new(Vec::new()));
    let seen = errors.clone();
    let stream = reflector(writer, watcher(Api::<Service>::all(server.client()), config)).default_backoff();
    let task = tokio::spawn(async move {
        stream
            .for_each(|event| {
                if let Err(e) = event {
                    seen.lock().unwrap().push(e.to_string());
                }
                futures::future::ready(())
            })
            .await;
    });
    Reflected { reader, errors, task }
}

#[tokio::test]
async fn relist_after_compaction_loses_nothing() {
    init_tracing();
    let server = TestApiServer::start().await;
    for name in ["s0", "s1", "s2"] {
        server.create(&service("default", name, &[])).unwrap();
    }
    let reflected_view = reflect(&server, watcher::Config::default());
    reflected_view.reader.wait_until_ready().await.unwrap();
    assert_eq!(reflected(&reflected_view.reader), stored(&server));
    watching(&server, 1).await;
    assert_eq!(server.request_count::<Service>(Verb::List), 1);

    // The API server goes away; meanwhile things change and the history is compacted.
    server.set_unavailable(true);
    assert_eq!(server.open_watches(), 0);
    server.delete::<Service>("default", "s1").unwrap();
    server.create(&service("default", "s3", &[])).unwrap();
    server.patch::<Service>("default", "s0", &labels_patch(json!({ "new": "label" }))).unwrap();
    server.compact();
    server.close_watches();
    server.set_unavailable(false);

    // kube resumes from its old version, gets the in-stream 410, relists, and its view
    // is the server's, including the delete it never saw as an event.
    eventually("the reflector to match the server", || async { reflected(&reflected_view.reader) == stored(&server) })
        .await;
    assert!(!reflected_view.reader.state().iter().any(|s| s.name_any() == "s1"));
    assert_eq!(server.request_count::<Service>(Verb::List), 2, "exactly one relist");
    let errors = reflected_view.errors.lock().unwrap().clone();
    assert!(errors.iter().any(|e| e.contains("too old resource version")), "{errors:?}");
}

#[tokio::test]
async fn compact_and_close_watches_force_a_relist() {
    init_tracing();
    let server = TestApiServer::start().await;
    server.create(&service("default", "a", &[])).unwrap();
    // Without bookmarks the watcher's version stays at its last Service event, so changes
    // to other kinds make it "too old" after a compaction.
    let reflected_view = reflect(&server, watcher::Config::default().disable_bookmarks());
    reflected_view.reader.wait_until_ready().await.unwrap();
    watching(&server, 1).await;
    server.create(&node("n1")).unwrap();
    server.compact();
    server.close_watches();
    eventually("a relist", || async { server.request_count::<Service>(Verb::List) == 2 }).await;
    server.create(&service("default", "b", &[])).unwrap();
    eventually("the reflector to match the server", || async { reflected(&reflected_view.reader) == stored(&server) })
        .await;
    let errors = reflected_view.errors.lock().unwrap().clone();
    assert!(errors.iter().any(|e| e.contains("410") || e.contains("too old")), "{errors:?}");
}

#[tokio::test]
async fn bookmarks_arrive_and_timeout_ends_the_stream() {
    init_tracing();
    let server = TestApiServer::builder().bookmark_interval(Duration::from_millis(100)).start().await;
    let services: Api<Service> = Api::namespaced(server.client(), "default");
    let list = services.list(&ListParams::default()).await.unwrap();
    let from = list.metadata.resource_version.unwrap();
    // Another kind moves the global version; bookmarks report it.
    server.create(&node("n1")).unwrap();
    let global = server.current_resource_version().to_string();

    let started = Instant::now();
    let stream = services.watch(&WatchParams::default().timeout(1), &from).await.unwrap();
    let events: Vec<WatchEvent<Service>> =
        tokio::time::timeout(Duration::from_secs(10), stream.try_collect()).await.expect("stream ends").unwrap();
    let elapsed = started.elapsed();
    // Ends at timeoutSeconds (1 s), not at the 10 s above; the upper bound is generous for a loaded machine.
    assert!(elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(8), "{elapsed:?}");
    let bookmarks: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            WatchEvent::Bookmark(b) => Some(b.metadata.resource_version.clone()),
            _ => None,
        })
        .collect();
    assert!(bookmarks.len() >= 3, "{events:?}");
    assert!(bookmarks.iter().all(|rv| *rv == global), "{bookmarks:?}");

    // Without allowWatchBookmarks there are none.
    let quiet = services.watch(&WatchParams::default().timeout(1).disable_bookmarks(), &from).await.unwrap();
    let events: Vec<WatchEvent<Service>> = quiet.try_collect().await.unwrap();
    assert!(events.is_empty(), "{events:?}");
}

#[tokio::test]
async fn watcher_rewatches_after_timeout_without_relisting() {
    init_tracing();
    let server = TestApiServer::builder().bookmark_interval(Duration::from_millis(100)).start().await;
    server.create(&service("default", "a", &[])).unwrap();
    let mut events: Events<Service> = watcher(Api::all(server.client()), watcher::Config::default().timeout(1)).boxed();
    assert!(matches!(next_event(&mut events).await, Event::Init));
    assert!(matches!(next_event(&mut events).await, Event::InitApply(_)));
    assert!(matches!(next_event(&mut events).await, Event::InitDone));
    // Keep the watcher polled in the background while streams time out.
    let (sender, received) = tokio::sync::mpsc::unbounded_channel();
    let mut received = tokio_stream::wrappers::UnboundedReceiverStream::new(received);
    let pump = tokio::spawn(async move {
        while let Some(event) = events.next().await {
            if sender.send(event).is_err() {
                return;
            }
        }
    });

    // Another kind moves the global version: bookmarks carry it to kube, which resumes
    // from it when the stream times out.
    let node_rv = server.create(&node("n1")).unwrap().resource_version();
    eventually("a watch resumed from the bookmarked version", || async {
        server.requests_of::<Service>(Verb::Watch).iter().any(|r| r.param("resourceVersion") == node_rv.as_deref())
    })
    .await;

    // Services created across stream timeouts all arrive.
    for i in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        server.create(&service("default", &format!("late{i}"), &[])).unwrap();
    }
    for i in 0..3 {
        match next(&mut received).await {
            Ok(Event::Apply(s)) => assert_eq!(s.name_any(), format!("late{i}")),
            other => panic!("expected Apply(late{i}), got {other:?}"),
        }
    }
    pump.abort();
    assert_eq!(server.request_count::<Service>(Verb::List), 1, "no relist");
    let watches = server.requests_of::<Service>(Verb::Watch);
    assert!(watches.len() >= 3, "{watches:?}");
    let versions: Vec<u64> =
        watches.iter().map(|w| w.param("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0)).collect();
    assert!(
        versions.windows(2).all(|w| w[0] <= w[1]) && versions[0] > 0,
        "resume points only move forward: {versions:?}"
    );
    assert!(watches.iter().all(|w| w.param("timeoutSeconds") == Some("1")));
}

#[tokio::test]
async fn selector_transitions_are_deletes_and_adds() {
    init_tracing();
    let server = TestApiServer::start().await;
    let selector = "!service.kubernetes.io/headless";
    let headless = json!({ "service.kubernetes.io/headless": "" });
    server.create(&service("default", "a", &[])).unwrap();
    server.create(&service("default", "h", &[("service.kubernetes.io/headless", "")])).unwrap();
    let services: Api<Service> = Api::namespaced(server.client(), "default");
    let list = services.list(&ListParams::default().labels(selector)).await.unwrap();
    assert_eq!(list.items.len(), 1);
    let params = WatchParams::default().labels(selector).disable_bookmarks();
    let mut stream = services.watch(&params, &list.metadata.resource_version.unwrap()).await.unwrap().boxed();
    let mut expect = async |kind: &str, name: &str| -> Service {
        let (got, object) = match next(&mut stream).await.unwrap() {
            WatchEvent::Added(o) => ("ADDED", o),
            WatchEvent::Modified(o) => ("MODIFIED", o),
            WatchEvent::Deleted(o) => ("DELETED", o),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!((got, object.name_any().as_str()), (kind, name));
        object
    };

    // `a` becomes headless: it leaves the watcher's view.
    let changed = server.patch::<Service>("default", "a", &labels_patch(headless.clone())).unwrap();
    let gone = expect("DELETED", "a").await;
    assert_eq!(gone.resource_version(), changed.resource_version(), "the DELETED carries the change's version");
    // A headless create is invisible; `h` stops being headless: it enters.
    server.create(&service("default", "h2", &[("service.kubernetes.io/headless", "")])).unwrap();
    server.patch::<Service>("default", "h", &labels_patch(json!({ "service.kubernetes.io/headless": null }))).unwrap();
    expect("ADDED", "h").await;
    server.patch::<Service>("default", "a", &labels_patch(json!({ "service.kubernetes.io/headless": null }))).unwrap();
    expect("ADDED", "a").await;
    server.patch::<Service>("default", "a", &labels_patch(json!({ "other": "x" }))).unwrap();
    expect("MODIFIED", "a").await;
    server.delete::<Service>("default", "h2").unwrap();
    server.delete::<Service>("default", "h").unwrap();
    expect("DELETED", "h").await;

    // kube's watcher + reflector with the same selector ends with the same view.
    let (reader, writer) = reflector::store();
    let config = watcher::Config::default().labels(selector);
    let task =
        tokio::spawn(reflector(writer, watcher(Api::<Service>::all(server.client()), config)).for_each(|_| async {}));
    reader.wait_until_ready().await.unwrap();
    server.patch::<Service>("default", "a", &labels_patch(headless)).unwrap();
    eventually("a to leave the filtered view", || async { reader.state().is_empty() }).await;
    task.abort();
}

#[tokio::test]
async fn paginated_initial_list_is_complete() {
    init_tracing();
    let server = TestApiServer::start().await;
    for i in 0..1234 {
        server.create(&service("default", &format!("s{i:04}"), &[])).unwrap();
    }
    let (reader, writer) = reflector::store::<Service>();
    let task = tokio::spawn(
        reflector(writer, watcher(Api::all(server.client()), watcher::Config::default())).for_each(|_| async {}),
    );
    reader.wait_until_ready().await.unwrap();
    assert_eq!(reader.state().len(), 1234);
    assert_eq!(server.request_count::<Service>(Verb::List), 3, "pages of 500");
    task.abort();

    // Pages come from one snapshot: a delete between pages does not shift them.
    let services: Api<Service> = Api::namespaced(server.client(), "default");
    let first = services.list(&ListParams::default().limit(500)).await.unwrap();
    let token = first.metadata.continue_.clone().unwrap();
    assert_eq!(first.metadata.remaining_item_count, Some(734));
    server.delete::<Service>("default", "s0000").unwrap();
    server.delete::<Service>("default", "s1233").unwrap();
    let second = services.list(&ListParams::default().limit(500).continue_token(&token)).await.unwrap();
    let third = services
        .list(&ListParams::default().limit(500).continue_token(second.metadata.continue_.as_deref().unwrap()))
        .await
        .unwrap();
    assert!(third.metadata.continue_.is_none());
    let names: Vec<String> = [first.items, second.items, third.items].concat().iter().map(|s| s.name_any()).collect();
    assert_eq!(names.len(), 1234);
    assert_eq!(names.last().map(String::as_str), Some("s1233"));
    assert_eq!(first.metadata.resource_version, third.metadata.resource_version);

    // After a compaction a pending continue token has expired: 410.
    let again = services.list(&ListParams::default().limit(10)).await.unwrap();
    server.compact();
    let err = services
        .list(&ListParams::default().limit(10).continue_token(again.metadata.continue_.as_deref().unwrap()))
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 410), "expired continue");
}

#[tokio::test]
async fn streaming_list_sends_initial_events() {
    init_tracing();
    let server = TestApiServer::start().await;
    server.create(&service("default", "a", &[])).unwrap();
    server.create(&service("default", "b", &[])).unwrap();
    let mut events: Events<Service> =
        watcher(Api::all(server.client()), watcher::Config::default().streaming_lists()).boxed();
    assert!(matches!(next_event(&mut events).await, Event::Init));
    let mut initial = Vec::new();
    loop {
        match next_event(&mut events).await {
            Event::InitApply(s) => initial.push(s.name_any()),
            Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(initial, ["a", "b"]);
    server.create(&service("default", "c", &[])).unwrap();
    assert!(matches!(next_event(&mut events).await, Event::Apply(s) if s.name_any() == "c"));
    assert_eq!(server.request_count::<Service>(Verb::List), 0);
    assert_eq!(server.request_count::<Service>(Verb::Watch), 1);
}

/// A server without the `WatchList` feature refuses kube's streaming list with `422 Invalid`
/// (what kube reports as the watch failing to start); a list and watch still works.
#[tokio::test]
async fn streaming_list_refused_without_the_watch_list_feature() {
    init_tracing();
    let server = TestApiServer::builder().watch_list(false).start().await;
    server.create(&service("default", "a", &[])).unwrap();
    let mut streaming: Events<Service> =
        watcher(Api::all(server.client()), watcher::Config::default().streaming_lists()).boxed();
    match next(&mut streaming).await {
        Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) => {
            assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
            assert!(status.message.contains("WatchList feature gate"), "{}", status.message);
        }
        other => panic!("expected the watch to be refused, got {other:?}"),
    }
    let mut listing: Events<Service> = watcher(Api::all(server.client()), watcher::Config::default()).boxed();
    assert!(matches!(next_event(&mut listing).await, Event::Init));
    assert!(matches!(next_event(&mut listing).await, Event::InitApply(s) if s.name_any() == "a"));
    assert!(matches!(next_event(&mut listing).await, Event::InitDone));
}

/// The parameters a real server requires of a streaming list, and forbids without one.
#[tokio::test]
async fn streaming_list_parameters_are_checked() {
    let server = TestApiServer::start().await;
    let client = server.client();
    let watch = |query: &str| {
        axum::http::Request::get(format!("/api/v1/services?watch=true&timeoutSeconds=1&{query}"))
            .body(Vec::new())
            .unwrap()
    };
    for (query, field) in [
        ("sendInitialEvents=true&allowWatchBookmarks=true", "resourceVersionMatch"),
        ("sendInitialEvents=true&resourceVersionMatch=NotOlderThan", "allowWatchBookmarks"),
        ("resourceVersionMatch=NotOlderThan", "resourceVersionMatch"),
    ] {
        let err = client.request_text(watch(query)).await.unwrap_err();
        assert!(
            matches!(&err, kube::Error::Api(s) if s.code == 422 && s.message.contains(&format!("{field}: Forbidden"))),
            "{query}: {err:?}"
        );
    }
    let streamed = client
        .request_text(watch("sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan"))
        .await
        .unwrap();
    assert!(streamed.contains("k8s.io/initial-events-end"), "{streamed}");
}

#[tokio::test]
async fn metadata_watcher_gets_partial_objects() {
    let server = TestApiServer::start().await;
    server.create(&service("default", "a", &[("app", "web")])).unwrap();
    let api = Api::<PartialObjectMeta<Service>>::all(server.client());
    let mut events = watcher(api, watcher::Config::default()).boxed();
    assert!(matches!(next(&mut events).await.unwrap(), Event::Init));
    match next(&mut events).await.unwrap() {
        Event::InitApply(meta) => {
            assert_eq!(meta.name_any(), "a");
            assert_eq!(meta.labels().get("app").map(String::as_str), Some("web"));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(matches!(next(&mut events).await.unwrap(), Event::InitDone));
    server.delete::<Service>("default", "a").unwrap();
    assert!(matches!(next(&mut events).await.unwrap(), Event::Delete(m) if m.name_any() == "a"));
}

#[tokio::test]
async fn closed_watches_resume_without_loss() {
    init_tracing();
    let server = TestApiServer::start().await;
    let reflected_view = reflect(&server, watcher::Config::default());
    reflected_view.reader.wait_until_ready().await.unwrap();
    // Streams cut again and again (apiserver restarts) while objects come and go: kube
    // resumes from its last version each time and the history fills the gaps.
    for round in 0..5 {
        watching(&server, 1).await;
        server.create(&service("default", &format!("s{round}"), &[])).unwrap();
        server.close_watches();
        server.create(&service("default", &format!("t{round}"), &[])).unwrap();
        if round > 0 {
            server.delete::<Service>("default", &format!("s{}", round - 1)).unwrap();
        }
    }
    eventually("the reflector to match the server", || async { reflected(&reflected_view.reader) == stored(&server) })
        .await;
    assert_eq!(server.request_count::<Service>(Verb::List), 1, "resumed, never relisted");
    assert!(server.request_count::<Service>(Verb::Watch) >= 6);
}
