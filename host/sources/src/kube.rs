//! Kubernetes watchers (kube-rs): the kinds wasmplane needs, read as [`crate::slim`] types
//! and converted to model types. ServiceCIDRs (Kubernetes 1.33) are optional: a server that
//! does not serve them counts as having none, and is asked again every ten minutes.
//!
//! Each kind runs its own `kube::runtime::watcher`, which gets the kind's state, watches from
//! its resourceVersion, re-watches on timeouts and gets the state again on `410 Gone`, with
//! backoff on errors. The state comes as a streaming list (a watch with `sendInitialEvents`,
//! on by default since Kubernetes 1.32): one object per event, where a list would send pages
//! of 500 in one body each. A server that refuses it (the `WatchList` feature off, or before
//! 1.27) is asked with lists from then on, as client-go's `WatchListClient` falls back.
//! A (re)list reaches the host as one [`SourceEvent::Relisted`] of the whole kind, which
//! the cluster state applies as its difference, so a relist that changes nothing produces
//! no revision; everything else arrives as single upserts and deletes.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Mutex;
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource, ResourceExt as _};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use wasmplane_model::ObjectKey;
use wasmplane_model::state::{ClusterEvent, ClusterObject, ObjectKind};

use crate::convert::{self, ConvertError};
use crate::slim;

/// Labels that take a Service (and its EndpointSlices) away from the default proxy, as in
/// kube-proxy: another proxy implementation owns `service-proxy-name`, and headless
/// services have nothing to proxy.
pub const SERVICE_LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The slices of proxied Services, except the operator's mesh slices (its
/// `MESH_SLICE_CONTROLLER`): another cluster's endpoints, which agents import from that
/// cluster's etcd themselves (Cilium's agents skip them alike).
pub const SLICE_LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless,endpointslice.kubernetes.io/managed-by!=endpointslice-mesh-controller.wasmplane.io";

/// What the watchers tell the host.
#[derive(Debug)]
pub enum SourceEvent {
    /// Changes seen on a watch, in order.
    Events(Vec<ClusterEvent>),
    /// The complete current set of one kind after a list (initial, or a relist after the
    /// watch expired). `unconvertible` names objects that exist but could not be
    /// converted: the host keeps their last good version instead of deleting them.
    Relisted { kind: ObjectKind, objects: Vec<ClusterObject>, unconvertible: Vec<ObjectKey> },
}

/// Which kinds have finished their initial list, and counters for the stats line.
#[derive(Debug, Default)]
pub struct WatchStatus {
    inner: Mutex<WatchStatusInner>,
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct WatchStatusInner {
    pub listed: BTreeSet<ObjectKind>,
    /// Kinds whose state comes by lists: the server refused streaming lists.
    pub refused_streaming: BTreeSet<ObjectKind>,
    pub relists: u64,
    pub watch_errors: u64,
    pub conversion_errors: u64,
    pub last_error: Option<String>,
}

impl WatchStatus {
    pub fn snapshot(&self) -> WatchStatusInner {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn update(&self, f: impl FnOnce(&mut WatchStatusInner)) {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

/// Every kind wasmplane watches.
pub const WATCHED_KINDS: [ObjectKind; 7] = [
    ObjectKind::Service,
    ObjectKind::EndpointSlice,
    ObjectKind::Node,
    ObjectKind::Namespace,
    ObjectKind::Pod,
    ObjectKind::NetworkPolicy,
    ObjectKind::ServiceCidr,
];

/// How long a server that does not serve an optional kind is left before it is asked again
/// (it may have been upgraded).
const NOT_SERVED_RETRY: Duration = Duration::from_secs(600);

/// Starts one watcher per kind; they run until `tx` is closed.
pub fn spawn_watchers(
    client: kube::Client,
    tx: mpsc::Sender<SourceEvent>,
    status: std::sync::Arc<WatchStatus>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let proxied = || watcher::Config::default().labels(SERVICE_LABEL_SELECTOR);
    let all = watcher::Config::default;
    vec![
        spawn(
            Api::<slim::Service>::all(client.clone()),
            proxied(),
            ObjectKind::Service,
            |s| convert::service(s).map(ClusterObject::Service),
            tx.clone(),
            status.clone(),
        ),
        spawn(
            Api::<slim::EndpointSlice>::all(client.clone()),
            watcher::Config::default().labels(SLICE_LABEL_SELECTOR),
            ObjectKind::EndpointSlice,
            |s| convert::endpoint_slice(s).map(ClusterObject::EndpointSlice),
            tx.clone(),
            status.clone(),
        ),
        spawn(
            Api::<slim::Node>::all(client.clone()),
            all(),
            ObjectKind::Node,
            |n| convert::node(n).map(ClusterObject::Node),
            tx.clone(),
            status.clone(),
        ),
        spawn(
            Api::<slim::Namespace>::all(client.clone()),
            all(),
            ObjectKind::Namespace,
            |n| convert::namespace(n).map(ClusterObject::Namespace),
            tx.clone(),
            status.clone(),
        ),
        spawn(
            Api::<slim::Pod>::all(client.clone()),
            all(),
            ObjectKind::Pod,
            |p| convert::pod(p).map(ClusterObject::Pod),
            tx.clone(),
            status.clone(),
        ),
        spawn(
            Api::<slim::NetworkPolicy>::all(client.clone()),
            all(),
            ObjectKind::NetworkPolicy,
            |p| convert::network_policy(p).map(ClusterObject::NetworkPolicy),
            tx.clone(),
            status.clone(),
        ),
        spawn(
            Api::<slim::ServiceCidr>::all(client),
            all(),
            ObjectKind::ServiceCidr,
            |c| convert::service_cidr(c).map(ClusterObject::ServiceCidr),
            tx,
            status,
        ),
    ]
}

/// Kinds a server may not serve (older Kubernetes): a 404 for them means none.
fn optional(kind: ObjectKind) -> bool {
    kind == ObjectKind::ServiceCidr
}

fn key_of<K: Resource>(object: &K) -> ObjectKey {
    ObjectKey::new(object.namespace().unwrap_or_default(), object.name_any())
}

fn spawn<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: ObjectKind,
    convert: fn(&K) -> Result<ClusterObject, ConvertError>,
    tx: mpsc::Sender<SourceEvent>,
    status: std::sync::Arc<WatchStatus>,
) -> tokio::task::JoinHandle<()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
{
    tokio::spawn(async move {
        let mut streaming = true;
        loop {
            let config = if streaming { config.clone().streaming_lists() } else { config.clone() };
            match watch(api.clone(), config, kind, convert, &tx, &status).await {
                Ended::StreamingRefused(e) => {
                    tracing::info!(?kind, "the API server refuses streaming lists; listing instead: {e}");
                    status.update(|s| {
                        s.refused_streaming.insert(kind);
                    });
                    streaming = false;
                }
                Ended::NotServed(e) => {
                    let first = !status.snapshot().listed.contains(&kind);
                    if first {
                        tracing::info!(
                            ?kind,
                            "the API server does not serve this kind (before Kubernetes 1.33?): taken as none, asked again every {NOT_SERVED_RETRY:?}: {e}"
                        );
                        if tx
                            .send(SourceEvent::Relisted { kind, objects: Vec::new(), unconvertible: Vec::new() })
                            .await
                            .is_err()
                        {
                            return;
                        }
                        status.update(|s| {
                            s.listed.insert(kind);
                        });
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(NOT_SERVED_RETRY) => {}
                        _ = tx.closed() => return,
                    }
                }
                Ended::HostGone => return,
            }
        }
    })
}

/// Why [`watch`] returned.
enum Ended {
    /// The host stopped listening.
    HostGone,
    /// The server refused the request for a streaming list as invalid (only asked for
    /// with streaming lists).
    StreamingRefused(kube::Error),
    /// The server does not serve this (optional) kind.
    NotServed(kube::Error),
}

/// Whether `e` says the server has no such resource (404).
fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 404)
}

/// Whether `e` is a server's refusal of a streaming list's parameters: `422 Invalid` for
/// `sendInitialEvents` without the `WatchList` feature, or `resourceVersionMatch` on a watch
/// before 1.27 (400 from some proxies).
fn refuses_streaming(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if matches!(status.code, 400 | 422))
}

/// Runs one watcher for `kind` and forwards what it sees, until the host stops listening or
/// the server refuses a streaming list.
async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: ObjectKind,
    convert: fn(&K) -> Result<ClusterObject, ConvertError>,
    tx: &mpsc::Sender<SourceEvent>,
    status: &WatchStatus,
) -> Ended
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let streaming = config.initial_list_strategy == watcher::InitialListStrategy::StreamingList;
    let mut relisting: Option<(Vec<ClusterObject>, Vec<ObjectKey>)> = None;
    let stream = watcher::watcher(api, config).default_backoff();
    let mut stream = std::pin::pin!(stream.into_stream());
    let convert_logged = |object: &K| match convert(object) {
        Ok(converted) => Some(converted),
        Err(e) => {
            tracing::warn!(?kind, object = %key_of(object), "skipping an object that cannot be used, its last good version stays: {e}");
            status.update(|s| s.conversion_errors += 1);
            None
        }
    };
    while let Some(event) = stream.next().await {
        let out = match event {
            Ok(Event::Init) => {
                relisting = Some((Vec::new(), Vec::new()));
                None
            }
            Ok(Event::InitApply(object)) => {
                let (objects, unconvertible) = relisting.get_or_insert_with(Default::default);
                match convert_logged(&object) {
                    Some(converted) => objects.push(converted),
                    None => unconvertible.push(key_of(&object)),
                }
                None
            }
            Ok(Event::InitDone) => {
                let (objects, unconvertible) = relisting.take().unwrap_or_default();
                tracing::debug!(?kind, objects = objects.len(), "listed");
                status.update(|s| {
                    if !s.listed.insert(kind) {
                        s.relists += 1;
                    }
                });
                Some(SourceEvent::Relisted { kind, objects, unconvertible })
            }
            Ok(Event::Apply(object)) => {
                convert_logged(&object).map(|o| SourceEvent::Events(vec![ClusterEvent::Upsert(o)]))
            }
            Ok(Event::Delete(object)) => Some(SourceEvent::Events(vec![ClusterEvent::Delete(kind, key_of(&object))])),
            Err(watcher::Error::WatchStartFailed(e)) if streaming && refuses_streaming(&e) => {
                return Ended::StreamingRefused(e);
            }
            Err(watcher::Error::InitialListFailed(e) | watcher::Error::WatchStartFailed(e))
                if optional(kind) && not_found(&e) =>
            {
                return Ended::NotServed(e);
            }
            Err(e) => {
                // The watcher retries on its own (with backoff); a 410 is handled inside
                // it as a relist. Here it is only counted and reported.
                tracing::warn!(?kind, "watch error, retrying: {e}");
                status.update(|s| {
                    s.watch_errors += 1;
                    s.last_error = Some(format!("{kind:?}: {e}"));
                });
                None
            }
        };
        if let Some(out) = out
            && tx.send(out).await.is_err()
        {
            return Ended::HostGone;
        }
    }
    // The watcher's stream does not end; the host is going away.
    Ended::HostGone
}
