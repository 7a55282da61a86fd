//! Service sync from the test API server (kube's real watchers) into the kvstore:
//! only exported Services (shared, or global and not unshared), with the ready
//! endpoints of their EndpointSlices; changes followed, stale entries and
//! endpoints removed after the operator (or a watch) was down, nothing written
//! before both kinds are listed; other clusters' keys never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use wasmplane_kvstore::{Bytes, EmbeddedStore, KvStore, WatchEvent};
use wasmplane_operator::{
    GLOBAL_SERVICE_ANNOTATION, Leadership, SHARED_SERVICE_ANNOTATION, ServiceSyncConfig, SharedPort, SharedService,
    sync_services,
};
use wasmplane_test_apiserver::{TestApiServer, Verb};

fn service(name: &str, ip: &str, shared: bool) -> Service {
    let annotations: &[(&str, &str)] = if shared { &[(SHARED_SERVICE_ANNOTATION, "true")] } else { &[] };
    annotated_service(name, ip, annotations)
}

fn annotated_service(name: &str, ip: &str, annotations: &[(&str, &str)]) -> Service {
    let mut svc = Service {
        spec: Some(ServiceSpec {
            cluster_ip: Some(ip.into()),
            cluster_ips: Some(vec![ip.into()]),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    svc.metadata.name = Some(name.into());
    svc.metadata.namespace = Some("default".into());
    if !annotations.is_empty() {
        svc.metadata.annotations = Some(annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    }
    svc
}

/// An endpoint: (address, ready, terminating).
type Ep<'a> = (&'a str, Option<bool>, Option<bool>);

const READY: Option<bool> = None; // nil `ready` means ready
const UNREADY: Option<bool> = Some(false);

/// A slice of `service` in `default` with port `http` 80 (protocol left to default).
fn endpoint_slice(name: &str, service: Option<&str>, endpoints: &[Ep]) -> EndpointSlice {
    let mut slice = EndpointSlice {
        address_type: "IPv4".into(),
        endpoints: endpoints
            .iter()
            .map(|(ip, ready, terminating)| Endpoint {
                addresses: vec![ip.to_string()],
                conditions: Some(EndpointConditions { ready: *ready, serving: Some(true), terminating: *terminating }),
                ..Default::default()
            })
            .collect(),
        ports: Some(vec![EndpointPort { name: Some("http".into()), port: Some(80), ..Default::default() }]),
        ..Default::default()
    };
    slice.metadata.name = Some(name.into());
    slice.metadata.namespace = Some("default".into());
    if let Some(service) = service {
        slice.metadata.labels = Some(BTreeMap::from([("kubernetes.io/service-name".to_owned(), service.to_owned())]));
    }
    slice
}

fn start_sync(
    store: Arc<dyn KvStore>,
    server: &TestApiServer,
    config: ServiceSyncConfig,
) -> tokio::task::JoinHandle<()> {
    start_sync_with(store, server.client(), config)
}

fn start_sync_with(
    store: Arc<dyn KvStore>,
    client: kube::Client,
    config: ServiceSyncConfig,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        Leadership::always()
            .run_while_leading("service-sync", Duration::from_millis(200), move || {
                let (store, client, config) = (store.clone(), client.clone(), config.clone());
                async move {
                    if let Err(e) = sync_services(store, client, config).await {
                        tracing::warn!(error = %e, "service sync failed");
                    }
                }
            })
            .await
    })
}

async fn synced_names(store: &dyn KvStore, prefix: &str) -> BTreeSet<String> {
    let listing = store.list_prefix(prefix).await.unwrap();
    listing.items.iter().map(|kv| kv.key.strip_prefix(prefix).unwrap().to_owned()).collect()
}

async fn eventually_names(store: &dyn KvStore, prefix: &str, expected: &[&str]) {
    let expected: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = synced_names(store, prefix).await;
        if now == expected {
            return;
        }
        assert!(Instant::now() < deadline, "synced services {now:?}, expected {expected:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_services_are_synced_and_stale_ones_cleaned() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let server = TestApiServer::start().await;
    server.create(&service("svc-a", "10.96.0.10", true)).unwrap();
    server.create(&service("svc-b", "10.96.0.11", true)).unwrap();
    server.create(&service("svc-c", "10.96.0.12", false)).unwrap();

    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let config = ServiceSyncConfig::new("cluster-1");
    let prefix = config.services_prefix();
    // Left over from before: a deleted service of ours, and another cluster's.
    store.put(&format!("{prefix}default/gone"), Bytes::from_static(b"{}"), None).await.unwrap();
    let foreign = "/wasmplane/clusters/cluster-2/services/default/svc-a";
    store.put(foreign, Bytes::from_static(b"theirs"), None).await.unwrap();

    let sync = start_sync(store.clone(), &server, config.clone());
    eventually_names(store.as_ref(), &prefix, &["default/svc-a", "default/svc-b"]).await;
    let value = store.get(&format!("{prefix}default/svc-a")).await.unwrap().unwrap().value;
    let shared: SharedService = serde_json::from_slice(&value).unwrap();
    assert_eq!(shared.cluster, "cluster-1");
    assert_eq!(shared.cluster_ips, vec!["10.96.0.10".to_string()]);
    assert_eq!(shared.ports[0].port, 80);

    // Changes follow: unshare b, delete a, share c.
    server
        .patch::<Service>(
            "default",
            "svc-b",
            &serde_json::json!({"metadata": {"annotations": {SHARED_SERVICE_ANNOTATION: null}}}),
        )
        .unwrap();
    server.delete::<Service>("default", "svc-a").unwrap();
    server
        .patch::<Service>(
            "default",
            "svc-c",
            &serde_json::json!({"metadata": {"annotations": {SHARED_SERVICE_ANNOTATION: "true"}}}),
        )
        .unwrap();
    eventually_names(store.as_ref(), &prefix, &["default/svc-c"]).await;

    // The operator is down while things change; on return it cleans up.
    sync.abort();
    let _ = sync.await;
    server.delete::<Service>("default", "svc-c").unwrap();
    server.create(&service("svc-d", "10.96.0.13", true)).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(synced_names(store.as_ref(), &prefix).await, BTreeSet::from(["default/svc-c".to_string()]));
    let sync = start_sync(store.clone(), &server, config);
    eventually_names(store.as_ref(), &prefix, &["default/svc-d"]).await;

    assert_eq!(
        store.get(foreign).await.unwrap().unwrap().value.as_ref(),
        b"theirs",
        "another cluster's key was touched"
    );
    sync.abort();
}

async fn stored_service(store: &dyn KvStore, key: &str) -> Option<SharedService> {
    let kv = store.get(key).await.unwrap()?;
    Some(serde_json::from_slice(&kv.value).expect("a stored shared service decodes"))
}

/// The exported addresses, one list per slice.
fn addresses(shared: &SharedService) -> Vec<Vec<String>> {
    shared.endpoint_slices.iter().map(|s| s.addresses.clone()).collect()
}

/// Waits until `key` holds a service whose slices export `expected`; returns it.
async fn eventually_endpoints(store: &dyn KvStore, key: &str, expected: &[&[&str]]) -> SharedService {
    let expected: Vec<Vec<String>> = expected.iter().map(|s| s.iter().map(|a| a.to_string()).collect()).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = stored_service(store, key).await;
        if let Some(shared) = &now
            && addresses(shared) == expected
        {
            return now.unwrap();
        }
        assert!(Instant::now() < deadline, "{key} holds {now:?}, expected endpoints {expected:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every change a kvstore watch has delivered so far.
async fn drain(events: &mut wasmplane_kvstore::WatchStream) -> Vec<WatchEvent> {
    let mut seen = Vec::new();
    let quiet = Duration::from_millis(200);
    while let Ok(Some(event)) = tokio::time::timeout(quiet, events.next()).await {
        seen.push(event.unwrap());
    }
    seen
}

fn http_port() -> SharedPort {
    SharedPort { name: Some("http".into()), port: 80, protocol: "TCP".into() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_service_exports_the_ready_endpoints_of_its_slices() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let server = TestApiServer::start().await;
    server.create(&service("web", "10.96.0.10", true)).unwrap();
    // Created before `web-a`: the export is sorted by slice name, not by age.
    server
        .create(&endpoint_slice(
            "web-b",
            Some("web"),
            &[
                ("10.1.0.3", Some(true), Some(false)),
                ("10.1.0.4", UNREADY, None),
                // Ready but terminating (as with publishNotReadyAddresses): not exported.
                ("10.1.0.5", Some(true), Some(true)),
            ],
        ))
        .unwrap();
    // Nothing ready: contributes nothing.
    server.create(&endpoint_slice("web-c", Some("web"), &[("10.1.0.6", UNREADY, None)])).unwrap();
    // No service-name label: belongs to no Service.
    server.create(&endpoint_slice("stray", None, &[("10.1.0.9", READY, None)])).unwrap();

    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let config = ServiceSyncConfig::new("cluster-1");
    let key = format!("{}default/web", config.services_prefix());
    let sync = start_sync(store.clone(), &server, config.clone());
    eventually_endpoints(store.as_ref(), &key, &[&["10.1.0.3"]]).await;

    // A slice created while watching, named before the first.
    server
        .create(&endpoint_slice("web-a", Some("web"), &[("10.1.0.1", READY, None), ("10.1.0.2", Some(true), None)]))
        .unwrap();
    let shared = eventually_endpoints(store.as_ref(), &key, &[&["10.1.0.1", "10.1.0.2"], &["10.1.0.3"]]).await;
    assert_eq!(shared.cluster_ips, vec!["10.96.0.10".to_string()]);
    assert_eq!(shared.ports, vec![http_port()]);
    for slice in &shared.endpoint_slices {
        assert_eq!(slice.ports, vec![http_port()], "protocol defaults to TCP");
    }

    // An endpoint added to web-b; one of web-a becomes unready; web-c gets a ready one.
    server
        .apply(&endpoint_slice(
            "web-b",
            Some("web"),
            &[
                ("10.1.0.3", Some(true), Some(false)),
                ("10.1.0.4", UNREADY, None),
                ("10.1.0.5", Some(true), Some(true)),
                ("10.1.0.7", READY, None),
            ],
        ))
        .unwrap();
    eventually_endpoints(store.as_ref(), &key, &[&["10.1.0.1", "10.1.0.2"], &["10.1.0.3", "10.1.0.7"]]).await;
    server
        .apply(&endpoint_slice("web-a", Some("web"), &[("10.1.0.1", READY, None), ("10.1.0.2", UNREADY, None)]))
        .unwrap();
    eventually_endpoints(store.as_ref(), &key, &[&["10.1.0.1"], &["10.1.0.3", "10.1.0.7"]]).await;
    server.apply(&endpoint_slice("web-c", Some("web"), &[("10.1.0.6", READY, None)])).unwrap();
    eventually_endpoints(store.as_ref(), &key, &[&["10.1.0.1"], &["10.1.0.3", "10.1.0.7"], &["10.1.0.6"]]).await;

    // Deleted slices take their endpoints with them; the Service stays exported.
    server.delete::<EndpointSlice>("default", "web-b").unwrap();
    eventually_endpoints(store.as_ref(), &key, &[&["10.1.0.1"], &["10.1.0.6"]]).await;
    server.delete::<EndpointSlice>("default", "web-a").unwrap();
    server.delete::<EndpointSlice>("default", "web-c").unwrap();
    let shared = eventually_endpoints(store.as_ref(), &key, &[]).await;
    assert_eq!(shared.name, "web");
    eventually_names(store.as_ref(), &config.services_prefix(), &["default/web"]).await;
    sync.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_services_are_exported_unless_unshared_and_others_slices_never_written() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let server = TestApiServer::start().await;
    let (shared, global) = (SHARED_SERVICE_ANNOTATION, GLOBAL_SERVICE_ANNOTATION);
    server.create(&annotated_service("global-only", "10.96.0.20", &[(global, "true")])).unwrap();
    server.create(&annotated_service("global-private", "10.96.0.21", &[(global, "true"), (shared, "false")])).unwrap();
    server.create(&annotated_service("plain", "10.96.0.22", &[])).unwrap();
    for (slice, svc, ip) in [
        ("global-only-1", "global-only", "10.2.0.1"),
        ("global-private-1", "global-private", "10.2.0.2"),
        ("plain-1", "plain", "10.2.0.3"),
    ] {
        server.create(&endpoint_slice(slice, Some(svc), &[(ip, READY, None)])).unwrap();
    }

    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let config = ServiceSyncConfig::new("cluster-1");
    let prefix = config.services_prefix();
    let mut writes = store.watch_prefix(&prefix, Some(store.current_revision().await.unwrap() + 1)).await.unwrap();
    let sync = start_sync(store.clone(), &server, config.clone());
    let global_only = format!("{prefix}default/global-only");
    eventually_endpoints(store.as_ref(), &global_only, &[&["10.2.0.1"]]).await;

    // The unexported Services' slices change, then the exported one's: once that last
    // change is written (one slice watch, events in order), the others have been seen.
    server
        .apply(&endpoint_slice("plain-1", Some("plain"), &[("10.2.0.3", READY, None), ("10.2.0.13", READY, None)]))
        .unwrap();
    server
        .apply(&endpoint_slice(
            "global-private-1",
            Some("global-private"),
            &[("10.2.0.2", READY, None), ("10.2.0.12", READY, None)],
        ))
        .unwrap();
    server
        .apply(&endpoint_slice(
            "global-only-1",
            Some("global-only"),
            &[("10.2.0.1", READY, None), ("10.2.0.11", READY, None)],
        ))
        .unwrap();
    eventually_endpoints(store.as_ref(), &global_only, &[&["10.2.0.1", "10.2.0.11"]]).await;
    let written: BTreeSet<String> = drain(&mut writes).await.into_iter().map(|e| e.key).collect();
    assert_eq!(written, BTreeSet::from([global_only.clone()]), "only the global Service is ever written");

    // Unsharing a global Service's own endpoints keeps it out; dropping the opt-out
    // exports it, with the endpoints its slice got while it was not exported.
    server
        .patch::<Service>(
            "default",
            "global-private",
            &serde_json::json!({"metadata": {"annotations": {shared: null}}}),
        )
        .unwrap();
    server
        .patch::<Service>(
            "default",
            "global-only",
            &serde_json::json!({"metadata": {"annotations": {global: "false"}}}),
        )
        .unwrap();
    eventually_names(store.as_ref(), &prefix, &["default/global-private"]).await;
    let exported =
        eventually_endpoints(store.as_ref(), &format!("{prefix}default/global-private"), &[&["10.2.0.2", "10.2.0.12"]])
            .await;
    assert_eq!(exported.cluster_ips, vec!["10.96.0.21".to_string()]);
    assert!(drain(&mut writes).await.iter().all(|e| !e.key.ends_with("/plain")), "the unannotated Service was written");
    sync.abort();
}

/// A TCP proxy in front of the test API server that holds EndpointSlice LIST requests
/// while its gate is closed, so that the sync's slice watcher cannot complete a list
/// while its Service watcher does.
struct GatedProxy {
    url: String,
    gate: watch::Sender<bool>,
}

impl GatedProxy {
    async fn start(upstream: SocketAddr) -> GatedProxy {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (gate, open) = watch::channel(true);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(proxy_connection(client, upstream, open.clone()));
            }
        });
        GatedProxy { url, gate }
    }

    fn client(&self) -> kube::Client {
        kube::Client::try_from(kube::Config::new(self.url.parse().unwrap())).unwrap()
    }

    fn set_open(&self, open: bool) {
        self.gate.send_replace(open);
    }
}

/// Forwards one connection; requests (GETs from kube: a head, no body) are read one by
/// one so that each can be held. Either side closing ends both.
async fn proxy_connection(client: TcpStream, upstream: SocketAddr, open: watch::Receiver<bool>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = async move {
        let mut buffer: Vec<u8> = Vec::new();
        loop {
            let head_end = loop {
                if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let mut chunk = [0u8; 4096];
                let n = client_read.read(&mut chunk).await?;
                if n == 0 {
                    return Ok::<(), std::io::Error>(());
                }
                buffer.extend_from_slice(&chunk[..n]);
            };
            let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
            let request_line = head.lines().next().unwrap_or_default();
            let is_watch = request_line.contains("watch=true") || request_line.contains("watch=1");
            if request_line.contains("/endpointslices") && !is_watch {
                let mut open = open.clone();
                let _ = open.wait_for(|open| *open).await;
            }
            let body_len: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buffer.len() < head_end + body_len {
                let mut chunk = [0u8; 4096];
                let n = client_read.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                buffer.extend_from_slice(&chunk[..n]);
            }
            let request: Vec<u8> = buffer.drain(..head_end + body_len).collect();
            server_write.write_all(&request).await?;
        }
    };
    tokio::select! {
        _ = requests => {}
        _ = tokio::io::copy(&mut server_read, &mut client_write) => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relists_correct_the_endpoints_and_nothing_is_written_before_both_lists() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let server = TestApiServer::start().await;
    let proxy = GatedProxy::start(server.addr()).await;
    server.create(&service("web", "10.96.0.30", true)).unwrap();
    server.create(&service("steady", "10.96.0.31", true)).unwrap();
    server.create(&endpoint_slice("web-a", Some("web"), &[("10.3.0.1", READY, None)])).unwrap();
    server.create(&endpoint_slice("web-b", Some("web"), &[("10.3.0.2", READY, None)])).unwrap();
    server.create(&endpoint_slice("steady-a", Some("steady"), &[("10.3.0.5", READY, None)])).unwrap();
    server.create(&service("quiet", "10.96.0.33", true)).unwrap();
    server.create(&service("gone", "10.96.0.34", true)).unwrap();
    server.create(&endpoint_slice("quiet-a", Some("quiet"), &[("10.3.0.6", READY, None)])).unwrap();

    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let config = ServiceSyncConfig::new("cluster-1");
    let prefix = config.services_prefix();
    let (web, steady) = (format!("{prefix}default/web"), format!("{prefix}default/steady"));
    let sync = start_sync_with(store.clone(), proxy.client(), config.clone());
    eventually_endpoints(store.as_ref(), &web, &[&["10.3.0.1"], &["10.3.0.2"]]).await;
    eventually_endpoints(store.as_ref(), &steady, &[&["10.3.0.5"]]).await;
    let quiet = format!("{prefix}default/quiet");
    eventually_endpoints(store.as_ref(), &quiet, &[&["10.3.0.6"]]).await;
    let all = ["default/gone", "default/quiet", "default/steady", "default/web"];
    eventually_names(store.as_ref(), &prefix, &all).await;

    // The watches break and the history is compacted meanwhile: the watchers relist,
    // and the slice and the Service deleted while they were away must go from the export.
    assert!(server.wait_for_open_watches(2, Duration::from_secs(10)).await);
    server.set_unavailable(true);
    server.delete::<EndpointSlice>("default", "web-b").unwrap();
    server.delete::<Service>("default", "gone").unwrap();
    server.compact();
    server.set_unavailable(false);
    eventually_endpoints(store.as_ref(), &web, &[&["10.3.0.1"]]).await;
    eventually_names(store.as_ref(), &prefix, &all[1..]).await;

    // The operator is down while slices change.
    sync.abort();
    let _ = sync.await;
    assert!(wait_until(|| server.open_watches() == 0).await, "the stopped sync's watches stay open");
    server
        .apply(&endpoint_slice("web-a", Some("web"), &[("10.3.0.1", READY, None), ("10.3.0.3", READY, None)]))
        .unwrap();
    server.create(&endpoint_slice("web-c", Some("web"), &[("10.3.0.4", READY, None)])).unwrap();

    // Restarted with the slice list held: the Service list completes alone, and nothing
    // may be written from that half-built picture (it would export no endpoints).
    proxy.set_open(false);
    server.reset_request_counts();
    let before = store.current_revision().await.unwrap();
    let mut writes = store.watch_prefix(&prefix, Some(before + 1)).await.unwrap();
    let sync = start_sync_with(store.clone(), proxy.client(), config.clone());
    assert!(wait_until(|| server.request_count::<Service>(Verb::Watch) >= 1).await, "the Service watcher never listed");
    // A Service change while the slices are still unlisted is not written either.
    server
        .patch::<Service>(
            "default",
            "steady",
            &serde_json::json!({"spec": {"clusterIP": "10.96.0.32", "clusterIPs": ["10.96.0.32"]}}),
        )
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.request_count::<EndpointSlice>(Verb::List), 0);
    assert_eq!(
        store.current_revision().await.unwrap(),
        before,
        "written before the slices were listed: {:?}",
        drain(&mut writes).await
    );

    proxy.set_open(true);
    let web_now = eventually_endpoints(store.as_ref(), &web, &[&["10.3.0.1", "10.3.0.3"], &["10.3.0.4"]]).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let steady_now = loop {
        let now = stored_service(store.as_ref(), &steady).await.unwrap();
        if now.cluster_ips == ["10.96.0.32"] {
            break now;
        }
        assert!(Instant::now() < deadline, "steady holds {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(addresses(&steady_now), vec![vec!["10.3.0.5".to_string()]]);
    let quiet_now = stored_service(store.as_ref(), &quiet).await.unwrap();
    assert_eq!(addresses(&quiet_now), vec![vec!["10.3.0.6".to_string()]]);

    // Exactly one write per changed Service, each already complete; `quiet`, unchanged,
    // is not rewritten.
    let written: Vec<(String, SharedService)> = drain(&mut writes)
        .await
        .into_iter()
        .map(|e| {
            let value = e.value.expect("nothing deleted");
            (e.key, serde_json::from_slice(&value).unwrap())
        })
        .collect();
    let mut expected = vec![(steady.clone(), steady_now), (web.clone(), web_now)];
    let mut sorted = written.clone();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    expected.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(sorted, expected, "writes after the restart: {written:?}");
    sync.abort();
}

async fn wait_until(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}
