//! A Kubernetes API server for tests, speaking the real list/watch HTTP protocol so that
//! kube's own, unmodified client (`kube::Client`, `Api`, `runtime::watcher`, `reflector`)
//! runs against it exactly as against a cluster.
//!
//! No real API server can be installed where wasmplane's tests run, and a mocked client
//! would test the mock. This server keeps what clients depend on:
//!
//! - one global, monotonically increasing `resourceVersion` (like an etcd revision), set on
//!   every object and every list;
//! - LIST with label/field selectors and `limit`/`continue` pagination over a consistent
//!   snapshot;
//! - WATCH streams of JSON lines replayed from an event history, with selector transitions
//!   (an object that stops matching is DELETED for that watcher), BOOKMARKs,
//!   `timeoutSeconds`, and the in-stream `410 Expired` ERROR after compaction that makes
//!   kube relist;
//! - streaming lists (`sendInitialEvents`, the `WatchList` feature, on by default since 1.32)
//!   with the server's checks of their parameters, or refused as a server without the
//!   feature refuses them ([`Builder::watch_list`]);
//! - create/update/patch (merge, strategic, JSON, server-side apply)/delete with the
//!   Status errors kube interprets (404, 409 AlreadyExists/Conflict, ...), `/status`
//!   subresources, generation and finalizers.
//!
//! Tests drive it through [`TestApiServer`]: seed and change objects without HTTP,
//! compact the history, cut watches, simulate an outage, and count requests.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use k8s_openapi::api::core::v1::Service;
//! use kube::Api;
//! use wasmplane_test_apiserver::{TestApiServer, Verb};
//!
//! let server = TestApiServer::start().await;
//! let mut svc = Service::default();
//! svc.metadata.name = Some("web".into());
//! svc.metadata.namespace = Some("default".into());
//! server.create(&svc)?;
//!
//! let services: Api<Service> = Api::namespaced(server.client(), "default");
//! assert_eq!(services.list(&Default::default()).await?.items.len(), 1);
//! assert_eq!(server.request_count::<Service>(Verb::List), 1);
//! # Ok(()) }
//! ```
//!
//! Serving another kind is one line, from its k8s-openapi type (scope and names come from
//! the type) or by hand for kinds without one:
//!
//! ```no_run
//! # async fn demo() {
//! use k8s_openapi::api::apps::v1::Deployment;
//! use wasmplane_test_apiserver::{ResourceType, TestApiServer};
//!
//! let server = TestApiServer::builder()
//!     .resource(ResourceType::of::<Deployment>())
//!     .resource(ResourceType::new("example.com", "v1", "widgets", "Widget", true))
//!     .start()
//!     .await;
//! # }
//! ```
//!
//! Simplifications (none that kube's list/watch machinery can observe): strategic merge
//! patch and server-side apply behave as JSON merge patch (lists replaced whole, no field
//! ownership or `managedFields`: an apply that omits a field keeps it); lists always read
//! the current state whatever `resourceVersion` they ask for; field selectors accept any
//! dotted path; no admission or defaulting (no ClusterIP allocation, namespaces need not
//! exist and their deletion does not cascade, status given on create is kept, deletes are
//! immediate unless finalizers are set); `dryRun` is refused rather than ignored.

mod error;
mod http;
mod patch;
mod resource;
mod reviews;
mod selector;
mod store;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::oneshot;

pub use crate::error::ApiError;
pub use crate::http::{RequestRecord, Verb};
pub use crate::patch::PatchKind;
pub use crate::resource::{ResourceKey, ResourceType, default_resources};
pub use crate::selector::{FieldSelector, LabelSelector};

use crate::http::{Shared, lock};
use crate::store::{Filter, Store, WriteScope};

/// A k8s-openapi object the typed helpers can store and return.
pub trait Object: k8s_openapi::Resource + Serialize + DeserializeOwned {}
impl<K: k8s_openapi::Resource + Serialize + DeserializeOwned> Object for K {}

/// Configuration before start. `TestApiServer::start()` is `builder().start()`.
#[derive(Debug, Clone)]
pub struct Builder {
    resources: Vec<ResourceType>,
    bookmark_interval: Duration,
    history_limit: usize,
    watch_list: bool,
}

impl Default for Builder {
    fn default() -> Self {
        Self {
            resources: default_resources(),
            // A real server bookmarks about once a minute; tests want to see them quickly.
            bookmark_interval: Duration::from_secs(1),
            history_limit: 100_000,
            watch_list: true,
        }
    }
}

impl Builder {
    /// Serve one more resource type (in addition to [`default_resources`]).
    pub fn resource(mut self, resource: ResourceType) -> Self {
        self.resources.push(resource);
        self
    }

    /// How often watches with `allowWatchBookmarks=true` get a BOOKMARK (default 1 s).
    pub fn bookmark_interval(mut self, interval: Duration) -> Self {
        self.bookmark_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// How many events the history keeps before the oldest are compacted away (default
    /// 100 000); resuming a watch from a compacted version gets `410 Expired`.
    pub fn history_limit(mut self, events: usize) -> Self {
        self.history_limit = events;
        self
    }

    /// Whether watches may ask for streaming lists (`sendInitialEvents`; default true, as
    /// the `WatchList` feature since Kubernetes 1.32). Off, such a watch gets `422 Invalid`,
    /// as from a server with the feature off.
    pub fn watch_list(mut self, enabled: bool) -> Self {
        self.watch_list = enabled;
        self
    }

    /// Bind 127.0.0.1 on a free port and serve.
    pub async fn try_start(self) -> std::io::Result<TestApiServer> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(self.resources, self.history_limit)),
            unavailable: AtomicBool::new(false),
            requests: Mutex::new(Default::default()),
            bookmark_interval: self.bookmark_interval,
            watch_list: self.watch_list,
            addr,
            reviews: Mutex::new(Default::default()),
        });
        let (shutdown, stopped) = oneshot::channel::<()>();
        let app = http::router(shared.clone());
        tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async {
                let _ = stopped.await;
            });
            if let Err(error) = serve.await {
                tracing::warn!(%error, "test apiserver stopped with an error");
            }
        });
        tracing::debug!(%addr, "test apiserver listening");
        Ok(TestApiServer { _guard: Arc::new(Guard { shared: shared.clone(), shutdown: Some(shutdown) }), shared, addr })
    }

    /// [`Builder::try_start`], panicking if no loopback port can be bound.
    pub async fn start(self) -> TestApiServer {
        match self.try_start().await {
            Ok(server) => server,
            Err(e) => panic!("test apiserver cannot listen on 127.0.0.1: {e}"),
        }
    }
}

/// Stops the server when the last handle is dropped.
struct Guard {
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Watch streams never finish on their own within a test; end them so the graceful
        // shutdown does not wait for them.
        self.shared.store().close_watches();
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// A running test API server. Cheap to clone; stops when the last clone is dropped.
///
/// The test-control methods act on the store directly: they work while the server is
/// [unavailable](Self::set_unavailable), are not counted as requests, and produce the same
/// watch events as the equivalent API calls. They write whole objects including `status`
/// (so tests can seed pod IPs or node addresses), and default a namespaced object's
/// namespace to `default`.
#[derive(Clone)]
pub struct TestApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// Held only for its `Drop`: the last handle gone stops the server.
    _guard: Arc<Guard>,
}

impl std::fmt::Debug for TestApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestApiServer").field("addr", &self.addr).finish_non_exhaustive()
    }
}

fn to_value<K: Serialize>(object: &K) -> Result<Value, ApiError> {
    serde_json::to_value(object).map_err(|e| ApiError::BadRequest(format!("cannot serialize object: {e}")))
}

fn from_value<K: DeserializeOwned>(value: Value) -> Result<K, ApiError> {
    serde_json::from_value(value).map_err(|e| ApiError::BadRequest(format!("stored object does not decode: {e}")))
}

/// The namespace a test-control write goes to: the object's, or `default`.
fn object_namespace(object: &Value) -> String {
    object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .filter(|ns| !ns.is_empty())
        .unwrap_or("default")
        .to_owned()
}

fn object_name(object: &Value) -> Result<String, ApiError> {
    object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| ApiError::Invalid("metadata.name is required".into()))
}

impl TestApiServer {
    /// Start with the [default resources](default_resources) and a 1 s bookmark interval.
    pub async fn start() -> Self {
        Builder::default().start().await
    }

    pub fn builder() -> Builder {
        Builder::default()
    }

    /// `http://127.0.0.1:{port}`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kube client configuration for this server (plain HTTP, no auth, namespace `default`).
    pub fn config(&self) -> kube::Config {
        let uri = self.url().parse().unwrap_or_else(|e| panic!("own URL {} does not parse: {e}", self.url()));
        kube::Config::new(uri)
    }

    /// A fresh kube client for this server.
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config()).unwrap_or_else(|e| panic!("kube client for the test apiserver: {e}"))
    }

    /// Serve one more resource type from now on.
    pub fn register(&self, resource: ResourceType) {
        self.shared.store().register(resource);
    }

    // ---- typed test control ----

    /// Create an object (409 AlreadyExists if its name is taken); returns it as stored.
    pub fn create<K: Object>(&self, object: &K) -> Result<K, ApiError> {
        from_value(self.create_value(&ResourceKey::of::<K>(), to_value(object)?)?)
    }

    /// Replace an object; a `metadata.resourceVersion` in it must be current (409 otherwise).
    pub fn update<K: Object>(&self, object: &K) -> Result<K, ApiError> {
        from_value(self.update_value(&ResourceKey::of::<K>(), to_value(object)?)?)
    }

    /// Create or replace, whatever is stored (no version check).
    pub fn apply<K: Object>(&self, object: &K) -> Result<K, ApiError> {
        from_value(self.apply_value(&ResourceKey::of::<K>(), to_value(object)?)?)
    }

    /// JSON-merge-patch an object (status included).
    pub fn patch<K: Object>(&self, namespace: &str, name: &str, merge_patch: &Value) -> Result<K, ApiError> {
        from_value(self.patch_value(&ResourceKey::of::<K>(), namespace, name, merge_patch)?)
    }

    /// Delete an object (the namespace is ignored for cluster-scoped kinds). With finalizers
    /// it is only marked for deletion, as on a real server.
    pub fn delete<K: Object>(&self, namespace: &str, name: &str) -> Result<K, ApiError> {
        from_value(self.delete_value(&ResourceKey::of::<K>(), namespace, name)?)
    }

    pub fn get<K: Object>(&self, namespace: &str, name: &str) -> Option<K> {
        self.get_value(&ResourceKey::of::<K>(), namespace, name).and_then(|v| from_value(v).ok())
    }

    /// Every stored object of a kind, in (namespace, name) order.
    pub fn list<K: Object>(&self) -> Vec<K> {
        self.list_values(&ResourceKey::of::<K>()).into_iter().filter_map(|v| from_value(v).ok()).collect()
    }

    // ---- dynamic test control (kinds without a k8s-openapi type) ----

    pub fn create_value(&self, key: &ResourceKey, object: Value) -> Result<Value, ApiError> {
        let ns = object_namespace(&object);
        self.shared.store().create(key, Some(&ns), object).map(|stored| Value::clone(&stored))
    }

    pub fn update_value(&self, key: &ResourceKey, object: Value) -> Result<Value, ApiError> {
        let (ns, name) = (object_namespace(&object), object_name(&object)?);
        self.shared
            .store()
            .update(key, Some(&ns), &name, object, WriteScope::Everything)
            .map(|stored| Value::clone(&stored))
    }

    pub fn apply_value(&self, key: &ResourceKey, mut object: Value) -> Result<Value, ApiError> {
        let (ns, name) = (object_namespace(&object), object_name(&object)?);
        let mut store = self.shared.store();
        let stored = match store.get(key, Some(&ns), &name) {
            Ok(_) => {
                if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
                    meta.remove("resourceVersion");
                }
                store.update(key, Some(&ns), &name, object, WriteScope::Everything)
            }
            Err(ApiError::NotFound { .. }) => store.create(key, Some(&ns), object),
            Err(e) => Err(e),
        };
        stored.map(|stored| Value::clone(&stored))
    }

    pub fn patch_value(
        &self,
        key: &ResourceKey,
        namespace: &str,
        name: &str,
        merge_patch: &Value,
    ) -> Result<Value, ApiError> {
        let ns = if namespace.is_empty() { "default" } else { namespace };
        self.shared
            .store()
            .patch(key, Some(ns), name, PatchKind::Merge, merge_patch, WriteScope::Everything)
            .map(|(stored, _)| Value::clone(&stored))
    }

    pub fn delete_value(&self, key: &ResourceKey, namespace: &str, name: &str) -> Result<Value, ApiError> {
        self.shared.store().delete(key, Some(namespace), name, &Value::Null).map(|(stored, _)| Value::clone(&stored))
    }

    pub fn get_value(&self, key: &ResourceKey, namespace: &str, name: &str) -> Option<Value> {
        self.shared.store().get(key, Some(namespace), name).ok().map(|stored| Value::clone(&stored))
    }

    pub fn list_values(&self, key: &ResourceKey) -> Vec<Value> {
        self.shared.store().matching(key, &Filter::default()).into_iter().map(|stored| Value::clone(&stored)).collect()
    }

    // ---- faults and protocol events ----

    /// Drop the event history (like an etcd compaction): any watch resuming from a version
    /// older than the current one gets an in-stream `410 Expired` ERROR and must relist.
    /// Open watches are not affected; pending pagination continues expire.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// End every open watch stream cleanly, as an API server restart would; clients
    /// re-watch from their last seen version.
    pub fn close_watches(&self) {
        self.shared.store().close_watches();
    }

    /// While unavailable every request gets `503 ServiceUnavailable` and open watches are
    /// closed (a down server keeps no streams). Test-control methods keep working, so a
    /// test can change the state "behind the clients' backs".
    pub fn set_unavailable(&self, unavailable: bool) {
        // Under the store lock, so no watch can register between the flag and the close.
        let mut store = self.shared.store();
        self.shared.unavailable.store(unavailable, Ordering::SeqCst);
        if unavailable {
            store.close_watches();
        }
    }

    pub fn is_unavailable(&self) -> bool {
        self.shared.unavailable.load(Ordering::SeqCst)
    }

    /// Watch streams currently open (all kinds). Useful to wait until a watcher is
    /// actually watching before changing things.
    pub fn open_watches(&self) -> usize {
        self.shared.store().open_watches()
    }

    /// Wait until at least `count` watch streams are open; false if `timeout` passes first.
    /// Lets a test know a watcher has finished its initial list and is watching.
    pub async fn wait_for_open_watches(&self, count: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.open_watches() >= count {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The last resourceVersion handed out (0 before the first write).
    pub fn current_resource_version(&self) -> u64 {
        self.shared.store().current_rv()
    }

    // ---- request counters (HTTP requests served, not test-control calls, not 503s) ----

    /// Requests for a verb on a kind, e.g. `request_count::<Service>(Verb::List)`.
    pub fn request_count<K: k8s_openapi::Resource>(&self, verb: Verb) -> u64 {
        self.request_count_for(verb, &ResourceKey::of::<K>())
    }

    pub fn request_count_for(&self, verb: Verb, key: &ResourceKey) -> u64 {
        lock(&self.shared.requests).counts.get(&(verb, key.to_string())).copied().unwrap_or(0)
    }

    /// TokenReview: `token` authenticates as `user` in `groups` (unknown tokens do not).
    pub fn add_token(&self, token: &str, user: &str, groups: &[&str]) {
        lock(&self.shared.reviews)
            .tokens
            .insert(token.into(), (user.into(), groups.iter().map(|g| g.to_string()).collect()));
    }

    /// SubjectAccessReview: `user` may `verb` `resource` in API `group` (everything else is denied).
    pub fn allow(&self, user: &str, verb: &str, group: &str, resource: &str) {
        lock(&self.shared.reviews).allowed.insert((user.into(), verb.into(), group.into(), resource.into()));
    }

    /// Reviews answered so far: (TokenReviews, SubjectAccessReviews).
    pub fn review_counts(&self) -> (u64, u64) {
        lock(&self.shared.reviews).counts
    }

    /// All counters, keyed by verb and resource name (`services`, `leases.coordination.k8s.io`).
    pub fn request_counts(&self) -> BTreeMap<(Verb, String), u64> {
        lock(&self.shared.requests).counts.clone()
    }

    /// The last requests served (up to 10 000), oldest first: e.g. the `resourceVersion`
    /// each watch resumed from.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.requests).log.iter().cloned().collect()
    }

    /// The logged requests of one verb on one kind, oldest first.
    pub fn requests_of<K: k8s_openapi::Resource>(&self, verb: Verb) -> Vec<RequestRecord> {
        let resource = ResourceKey::of::<K>().to_string();
        lock(&self.shared.requests).log.iter().filter(|r| r.verb == verb && r.resource == resource).cloned().collect()
    }

    /// Clear the counters and the request log.
    pub fn reset_request_counts(&self) {
        let mut requests = lock(&self.shared.requests);
        requests.counts.clear();
        requests.log.clear();
    }
}
