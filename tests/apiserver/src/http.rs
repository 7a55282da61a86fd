//! The HTTP side: path routing, the verbs, discovery, and watch streams.
//!
//! One fallback handler parses paths itself rather than declaring axum routes, because
//! Kubernetes paths are ambiguous by shape (`/api/v1/namespaces/x/status` is the status
//! of Namespace `x`, `/api/v1/namespaces/x/pods` the pods in it) and resolving that needs
//! the registered resource types.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use futures::StreamExt as _;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::ApiError;
use crate::patch::PatchKind;
use crate::resource::{ResourceKey, ResourceType};
use crate::selector::{FieldSelector, LabelSelector};
use crate::store::{
    Event, EventType, Filter, Store, Stored, WatchFrom, WatchStart, WireEvent, WriteScope, bookmark_object,
};

/// The API verbs, as counted per resource (see [`crate::TestApiServer::request_count`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
}

/// One API request as served, for tests that check what a client asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub verb: Verb,
    /// `services`, `leases.coordination.k8s.io` (as [`ResourceKey`]'s `Display`).
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// The query parameters, in order (`resourceVersion`, `labelSelector`, `limit`, ...).
    pub query: Vec<(String, String)>,
}

impl RequestRecord {
    /// The first value of a query parameter.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// How many request records are kept (the counters are not bounded).
const REQUEST_LOG_LIMIT: usize = 10_000;

#[derive(Default)]
pub(crate) struct RequestStats {
    pub counts: BTreeMap<(Verb, String), u64>,
    pub log: VecDeque<RequestRecord>,
}

/// State shared by the HTTP handlers, the watch streams and the test handle.
pub(crate) struct Shared {
    pub store: Mutex<Store>,
    pub unavailable: AtomicBool,
    pub requests: Mutex<RequestStats>,
    pub bookmark_interval: Duration,
    /// Streaming lists allowed (the `WatchList` feature).
    pub watch_list: bool,
    pub addr: SocketAddr,
    pub reviews: Mutex<crate::reviews::Reviews>,
}

/// Lock ignoring poison: a panicking test thread must not turn every later request into
/// a second panic; the store's invariants hold between operations.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    pub fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    fn record(&self, verb: Verb, target: &Target, params: &Params) {
        let resource = target.rt.key.to_string();
        let mut requests = lock(&self.requests);
        *requests.counts.entry((verb, resource.clone())).or_default() += 1;
        if requests.log.len() >= REQUEST_LOG_LIMIT {
            requests.log.pop_front();
        }
        requests.log.push_back(RequestRecord {
            verb,
            resource,
            namespace: target.namespace.clone(),
            name: target.name.clone(),
            query: params.0.clone(),
        });
    }
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(handle).with_state(shared)
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let method = request.method().clone();
    let uri = request.uri().clone();
    if method == Method::POST
        && matches!(uri.path(), crate::reviews::TOKEN_REVIEWS | crate::reviews::SUBJECT_ACCESS_REVIEWS)
    {
        let body = match axum::body::to_bytes(request.into_body(), 1 << 20).await {
            Ok(body) => body,
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        };
        return crate::reviews::answer(&mut lock(&shared.reviews), uri.path(), &body);
    }
    let response = dispatch(&shared, request).await.unwrap_or_else(IntoResponse::into_response);
    tracing::debug!(%method, %uri, status = response.status().as_u16(), "test apiserver request");
    response
}

/// Query parameters, in order (repeated keys are possible in principle; the first wins).
struct Params(Vec<(String, String)>);

impl Params {
    fn parse(uri: &Uri) -> Result<Self, ApiError> {
        Query::<Vec<(String, String)>>::try_from_uri(uri)
            .map(|Query(pairs)| Self(pairs))
            .map_err(|e| ApiError::BadRequest(format!("invalid query: {e}")))
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }

    fn number(&self, key: &str) -> Result<Option<u64>, ApiError> {
        self.get(key)
            .filter(|v| !v.is_empty())
            .map(|v| v.parse::<u64>().map_err(|_| ApiError::BadRequest(format!("invalid {key}: {v:?}"))))
            .transpose()
    }

    fn filter(&self, namespace: Option<&str>) -> Result<Filter, ApiError> {
        Ok(Filter {
            namespace: namespace.map(str::to_owned),
            labels: LabelSelector::parse(self.get("labelSelector").unwrap_or_default())?,
            fields: FieldSelector::parse(self.get("fieldSelector").unwrap_or_default())?,
        })
    }
}

/// A resolved resource path.
struct Target {
    rt: ResourceType,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
    /// The legacy `/watch/` path prefix.
    watch_prefix: bool,
}

fn resolve(store: &Store, group: &str, version: &str, rest: &[&str]) -> Result<Target, ApiError> {
    let not_found = || ApiError::PathNotFound(format!("/{}", rest.join("/")));
    let (watch_prefix, rest) = match rest {
        ["watch", rest @ ..] => (true, rest),
        rest => (false, rest),
    };
    let lookup = |plural: &str| store.resource_type(&ResourceKey::new(group, version, plural)).ok();
    // `namespaces/{ns}/{plural}` only if `{plural}` is a registered resource; otherwise this
    // is the Namespace object itself (`namespaces/{name}/status`).
    let (namespace, rt, tail) = match rest {
        ["namespaces", ns, plural, tail @ ..] if lookup(plural).is_some() => {
            let rt = lookup(plural).ok_or_else(not_found)?;
            if !rt.namespaced {
                return Err(not_found());
            }
            (Some((*ns).to_owned()), rt, tail)
        }
        [plural, tail @ ..] => (None, lookup(plural).ok_or_else(not_found)?, tail),
        [] => return Err(not_found()),
    };
    let (name, subresource) = match tail {
        [] => (None, None),
        [name] => (Some((*name).to_owned()), None),
        [name, "status"] if rt.status_subresource => (Some((*name).to_owned()), Some("status".to_owned())),
        _ => return Err(not_found()),
    };
    // A namespaced object is only addressable inside its namespace.
    if rt.namespaced && namespace.is_none() && name.is_some() {
        return Err(not_found());
    }
    Ok(Target { rt, namespace, name, subresource, watch_prefix })
}

async fn dispatch(shared: &Arc<Shared>, request: Request) -> Result<Response, ApiError> {
    if shared.unavailable.load(Ordering::SeqCst) {
        return Err(ApiError::Unavailable);
    }
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_owned();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (group, version, rest) = match segments.as_slice() {
        ["version"] => return Ok(Json(version_info()).into_response()),
        ["api"] => return Ok(Json(core_versions(shared.addr)).into_response()),
        ["apis"] => return Ok(Json(api_groups(&shared.store())).into_response()),
        ["apis", group] => {
            return api_group(&shared.store(), group).map(|g| Json(g).into_response());
        }
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(ApiError::PathNotFound(path)),
    };
    if rest.is_empty() {
        return resource_list(&shared.store(), group, version).map(|l| Json(l).into_response());
    }
    let target = resolve(&shared.store(), group, version, rest)?;
    let params = Params::parse(&parts.uri)?;
    let metadata_only = wants_partial_metadata(&parts.headers);
    let key = target.rt.key.clone();
    let ns = target.namespace.as_deref();
    let scope = if target.subresource.is_some() { WriteScope::Status } else { WriteScope::Main };
    if params.get("dryRun").is_some() {
        // Silently writing on a dry run would be worse than refusing it.
        return Err(ApiError::BadRequest("dryRun is not supported by the test API server".into()));
    }

    let named = target.name.as_deref();
    let verb = match (&parts.method, named) {
        (&Method::GET, None) if target.watch_prefix || params.flag("watch") => Verb::Watch,
        (&Method::GET, None) => Verb::List,
        (&Method::GET, Some(_)) => Verb::Get,
        (&Method::POST, None) if target.subresource.is_none() => Verb::Create,
        (&Method::PUT, Some(_)) => Verb::Update,
        (&Method::PATCH, Some(_)) => Verb::Patch,
        (&Method::DELETE, Some(_)) if target.subresource.is_none() => Verb::Delete,
        (&Method::DELETE, None) => Verb::DeleteCollection,
        (method, _) => {
            return Err(ApiError::MethodNotAllowed(format!("{method} is not supported on {path}")));
        }
    };
    shared.record(verb, &target, &params);

    match (verb, named) {
        (Verb::Watch, _) => watch(shared, &target, &params, metadata_only),
        (Verb::List, _) => list(shared, &target, &params, metadata_only),
        (Verb::Get, Some(name)) => {
            let object = shared.store().get(&key, ns, name)?;
            Ok(Json(present(&object, metadata_only)).into_response())
        }
        (Verb::Create, _) => {
            if target.rt.namespaced && ns.is_none() {
                return Err(ApiError::MethodNotAllowed(format!("create {key} needs a namespace in the path")));
            }
            let object = json_body(body).await?;
            let created = shared.store().create(&key, ns, object)?;
            Ok((StatusCode::CREATED, Json(present(&created, metadata_only))).into_response())
        }
        (Verb::Update, Some(name)) => {
            let object = json_body(body).await?;
            let updated = shared.store().update(&key, ns, name, object, scope)?;
            Ok(Json(present(&updated, metadata_only)).into_response())
        }
        (Verb::Patch, Some(name)) => {
            let content_type =
                parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
            let kind = PatchKind::from_content_type(content_type)?;
            let patch = kind.parse_body(&read_body(body).await?)?;
            let (object, created) = shared.store().patch(&key, ns, name, kind, &patch, scope)?;
            let code = if created { StatusCode::CREATED } else { StatusCode::OK };
            Ok((code, Json(present(&object, metadata_only))).into_response())
        }
        (Verb::Delete, Some(name)) => {
            let bytes = read_body(body).await?;
            let options: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes)
                    .map_err(|e| ApiError::BadRequest(format!("invalid DeleteOptions: {e}")))?
            };
            let preconditions = options.get("preconditions").cloned().unwrap_or(Value::Null);
            let (object, pending) = shared.store().delete(&key, ns, name, &preconditions)?;
            // 202: accepted, but finalizers keep the object until they are removed.
            let code = if pending { StatusCode::ACCEPTED } else { StatusCode::OK };
            Ok((code, Json(present(&object, metadata_only))).into_response())
        }
        (Verb::DeleteCollection, _) => {
            let filter = params.filter(ns)?;
            let items = shared.store().delete_collection(&key, &filter)?;
            let rv = shared.store().current_rv();
            Ok(Json(list_body(&target.rt, rv, None, None, items, false)).into_response())
        }
        // The verb table above gives these verbs a name.
        (Verb::Get | Verb::Update | Verb::Patch | Verb::Delete, None) => {
            Err(ApiError::MethodNotAllowed(format!("{} is not supported on {path}", parts.method)))
        }
    }
}

async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, 64 << 20)
        .await
        .map_err(|e| ApiError::BadRequest(format!("cannot read the request body: {e}")))
}

async fn json_body(body: Body) -> Result<Value, ApiError> {
    let bytes = read_body(body).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

/// kube's metadata-only API (`Api::get_metadata`, `metadata_watcher`) asks for this.
fn wants_partial_metadata(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|accept| accept.contains("as=PartialObjectMetadata"))
}

/// An object as the request asked for it: whole (its stored JSON), or only its metadata.
fn present(object: &Stored, metadata_only: bool) -> Presented<'_> {
    if metadata_only {
        Presented::Metadata(json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": object.get("metadata").cloned().unwrap_or_else(|| json!({})),
        }))
    } else {
        Presented::Whole(object.json())
    }
}

enum Presented<'a> {
    Whole(&'a RawValue),
    Metadata(Value),
}

impl Serialize for Presented<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Presented::Whole(json) => json.serialize(serializer),
            Presented::Metadata(value) => value.serialize(serializer),
        }
    }
}

impl fmt::Display for Presented<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Presented::Whole(json) => f.write_str(json.get()),
            Presented::Metadata(value) => fmt::Display::fmt(value, f),
        }
    }
}

/// A list response, serialized straight from the store's objects (no copy of the list).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ListBody {
    kind: String,
    api_version: String,
    metadata: Value,
    items: ListItems,
}

struct ListItems {
    objects: Vec<Arc<Stored>>,
    metadata_only: bool,
}

impl Serialize for ListItems {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.objects.iter().map(|o| present(o, self.metadata_only)))
    }
}

fn list_body(
    rt: &ResourceType,
    rv: u64,
    continue_token: Option<String>,
    remaining: Option<usize>,
    objects: Vec<Arc<Stored>>,
    metadata_only: bool,
) -> ListBody {
    let (kind, api_version) = if metadata_only {
        ("PartialObjectMetadataList".to_owned(), "meta.k8s.io/v1".to_owned())
    } else {
        (rt.list_kind(), rt.api_version())
    };
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if let Some(token) = continue_token {
        metadata["continue"] = Value::String(token);
    }
    if let Some(remaining) = remaining {
        metadata["remainingItemCount"] = json!(remaining);
    }
    ListBody { kind, api_version, metadata, items: ListItems { objects, metadata_only } }
}

/// LIST. `resourceVersion`/`resourceVersionMatch` are accepted and answered with the
/// current state, which satisfies "NotOlderThan" and "Any"; exact historical reads are not
/// served (no client of ours needs them).
fn list(shared: &Shared, target: &Target, params: &Params, metadata_only: bool) -> Result<Response, ApiError> {
    let filter = params.filter(target.namespace.as_deref())?;
    let limit = params.number("limit")?.and_then(|l| usize::try_from(l).ok());
    let continue_token = params.get("continue").filter(|c| !c.is_empty());
    let page = shared.store().list(&target.rt.key, &filter, limit, continue_token)?;
    let body =
        list_body(&target.rt, page.resource_version, page.continue_token, page.remaining, page.items, metadata_only);
    Ok(Json(body).into_response())
}

/// A watch's `sendInitialEvents` and `resourceVersionMatch` as a real server checks them
/// (`ValidateListOptions` in apimachinery), with the `WatchList` feature `enabled` or not.
fn check_streaming_list(params: &Params, enabled: bool) -> Result<(), ApiError> {
    let invalid = |field: &str, why: &str| {
        Err(ApiError::Invalid(format!("ListOptions.meta.k8s.io \"\" is invalid: {field}: Forbidden: {why}")))
    };
    let Some(send_initial_events) = params.get("sendInitialEvents") else {
        return match params.get("resourceVersionMatch").filter(|m| !m.is_empty()) {
            Some(_) => invalid(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
            ),
            None => Ok(()),
        };
    };
    if !enabled {
        return invalid(
            "sendInitialEvents",
            "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
        );
    }
    if params.get("resourceVersionMatch") != Some("NotOlderThan") {
        return invalid(
            "resourceVersionMatch",
            "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        );
    }
    if matches!(send_initial_events, "true" | "1") && !params.flag("allowWatchBookmarks") {
        return invalid("allowWatchBookmarks", "sendInitialEvents requires setting allowWatchBookmarks to true");
    }
    Ok(())
}

/// Without `timeoutSeconds` a real server picks 30 to 60 minutes; the lower bound will do.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
const MAX_WATCH_TIMEOUT_SECONDS: u64 = 24 * 3600;

/// WATCH: a chunked stream of JSON lines, one event per line, produced by a task.
fn watch(shared: &Arc<Shared>, target: &Target, params: &Params, metadata_only: bool) -> Result<Response, ApiError> {
    let filter = params.filter(target.namespace.as_deref())?;
    check_streaming_list(params, shared.watch_list)?;
    let from = match params.get("resourceVersion").unwrap_or_default() {
        "" | "0" => WatchFrom::Current,
        v => WatchFrom::Version(v.parse().map_err(|_| ApiError::BadRequest(format!("invalid resourceVersion {v:?}")))?),
    };
    let timeout = match params.number("timeoutSeconds")? {
        Some(0) | None => DEFAULT_WATCH_TIMEOUT,
        // Clamped: an absurd value must not overflow the deadline arithmetic.
        Some(seconds) => Duration::from_secs(seconds.min(MAX_WATCH_TIMEOUT_SECONDS)),
    };
    // Checked again under the store lock, which `set_unavailable` also takes: a watch that
    // raced with the start of an outage must not survive it.
    let mut store = shared.store();
    if shared.unavailable.load(Ordering::SeqCst) {
        return Err(ApiError::Unavailable);
    }
    let start = store.watch(&target.rt.key, &filter, from, params.flag("sendInitialEvents"))?;
    drop(store);
    let (out, body) = mpsc::channel::<Bytes>(64);
    let stream = WatchStream {
        shared: shared.clone(),
        rt: target.rt.clone(),
        filter,
        bookmarks: params.flag("allowWatchBookmarks"),
        metadata_only,
        deadline: tokio::time::Instant::now() + timeout,
        processed_rv: match from {
            WatchFrom::Version(v) => v.max(start.resource_version),
            WatchFrom::Current => start.resource_version,
        },
        out,
    };
    tokio::spawn(stream.run(start));
    let body = Body::from_stream(ReceiverStream::new(body).map(Ok::<Bytes, Infallible>));
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// One open watch: forwards store events through its filter to the HTTP body.
struct WatchStream {
    shared: Arc<Shared>,
    rt: ResourceType,
    filter: Filter,
    bookmarks: bool,
    metadata_only: bool,
    deadline: tokio::time::Instant,
    /// The highest version this stream has accounted for (sent or filtered out); a
    /// bookmark never goes below it, so a client's resume point only moves forward.
    processed_rv: u64,
    out: mpsc::Sender<Bytes>,
}

impl WatchStream {
    /// Append one event line to `out`.
    fn write_line(&self, out: &mut String, event_type: &str, object: &Stored) {
        let metadata_only = self.metadata_only && matches!(event_type, "ADDED" | "MODIFIED" | "DELETED");
        // Writing to a String cannot fail.
        let _ = writeln!(out, "{{\"type\":\"{event_type}\",\"object\":{}}}", present(object, metadata_only));
    }

    /// Write one event line; false when the client has gone away.
    async fn send(&self, event_type: &str, object: &Stored) -> bool {
        let mut line = String::new();
        self.write_line(&mut line, event_type, object);
        self.out.send(Bytes::from(line)).await.is_ok()
    }

    /// Write the prelude's lines in chunks of ~64 KiB, as a real server writes what is
    /// pending before it flushes (a streaming list's initial events are many at once); false
    /// when the client has gone away.
    async fn send_prelude(&self, prelude: &[WireEvent]) -> bool {
        const CHUNK: usize = 64 << 10;
        let mut chunk = String::new();
        for event in prelude {
            self.write_line(&mut chunk, event.event_type, &event.object);
            if chunk.len() >= CHUNK && self.out.send(Bytes::from(std::mem::take(&mut chunk))).await.is_err() {
                return false;
            }
        }
        chunk.is_empty() || self.out.send(Bytes::from(chunk)).await.is_ok()
    }

    /// What this watcher sees of a change, given its selectors (real apiserver semantics):
    /// an object that starts matching is ADDED, one that stops matching is DELETED (as its
    /// last matching state, at the change's version), others are dropped.
    fn translate(&self, event: &Event) -> Option<(&'static str, Arc<Stored>)> {
        let matches_now = self.filter.matches(&event.object);
        match event.event_type {
            EventType::Added => matches_now.then(|| ("ADDED", event.object.clone())),
            EventType::Deleted => {
                let before = event.previous.as_ref().unwrap_or(&event.object);
                self.filter.matches(before).then(|| ("DELETED", event.object.clone()))
            }
            EventType::Modified => {
                let matched_before = event.previous.as_ref().is_some_and(|p| self.filter.matches(p));
                match (matched_before, matches_now) {
                    (true, true) => Some(("MODIFIED", event.object.clone())),
                    (false, true) => Some(("ADDED", event.object.clone())),
                    (true, false) => {
                        let mut last = Value::clone(event.previous.as_deref().unwrap_or(&event.object));
                        last["metadata"]["resourceVersion"] = Value::String(event.rv.to_string());
                        Some(("DELETED", Stored::new(last)))
                    }
                    (false, false) => None,
                }
            }
        }
    }

    async fn forward(&mut self, event: &Event) -> bool {
        self.processed_rv = self.processed_rv.max(event.rv);
        match self.translate(event) {
            Some((event_type, object)) => self.send(event_type, &object).await,
            None => true,
        }
    }

    /// A bookmark at the current global version. Every event up to that version is
    /// already in our channel (the store sends under its lock), so drain those first:
    /// the bookmark must not vouch for events the client has not been sent.
    /// Returns (client still there, subscription still open).
    async fn bookmark(&mut self, events: &mut mpsc::UnboundedReceiver<Arc<Event>>) -> (bool, bool) {
        let rv = self.shared.store().current_rv();
        let mut open = true;
        loop {
            match events.try_recv() {
                Ok(event) => {
                    if !self.forward(&event).await {
                        return (false, open);
                    }
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        self.processed_rv = self.processed_rv.max(rv);
        let object = Stored::new(bookmark_object(&self.rt, self.processed_rv));
        (self.send("BOOKMARK", &object).await, open)
    }

    async fn run(mut self, start: WatchStart) {
        if !self.send_prelude(&start.prelude).await {
            return;
        }
        // No subscription: the prelude was the whole answer (410 Expired).
        let Some(mut events) = start.events else {
            return;
        };
        let period = self.shared.bookmark_interval;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = self.out.closed() => return,
                () = tokio::time::sleep_until(self.deadline) => {
                    tracing::debug!(resource = %self.rt.key, "watch reached timeoutSeconds");
                    return;
                }
                event = events.recv() => match event {
                    Some(event) => if !self.forward(&event).await { return },
                    // close_watches() or an outage: end the stream cleanly.
                    None => return,
                },
                _ = ticker.tick(), if self.bookmarks => {
                    let (client, open) = self.bookmark(&mut events).await;
                    if !client || !open {
                        return;
                    }
                }
            }
        }
    }
}

fn version_info() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-wasmplane-test",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn core_versions(addr: SocketAddr) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": addr.to_string() }],
    })
}

fn group_json(group: &str, versions: &[String]) -> Value {
    let versions: Vec<Value> =
        versions.iter().map(|v| json!({ "groupVersion": format!("{group}/{v}"), "version": v })).collect();
    json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "preferredVersion": versions.first().cloned().unwrap_or(Value::Null),
        "versions": versions,
    })
}

fn groups(store: &Store) -> BTreeMap<String, Vec<String>> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for rt in store.types().filter(|rt| !rt.key.group.is_empty()) {
        let versions = groups.entry(rt.key.group.clone()).or_default();
        if !versions.contains(&rt.key.version) {
            versions.push(rt.key.version.clone());
        }
    }
    groups
}

fn api_groups(store: &Store) -> Value {
    let groups: Vec<Value> = groups(store).iter().map(|(g, versions)| group_json(g, versions)).collect();
    json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
}

fn api_group(store: &Store, group: &str) -> Result<Value, ApiError> {
    groups(store)
        .get(group)
        .map(|versions| group_json(group, versions))
        .ok_or_else(|| ApiError::PathNotFound(format!("/apis/{group}")))
}

fn resource_list(store: &Store, group: &str, version: &str) -> Result<Value, ApiError> {
    let mut resources = Vec::new();
    for rt in store.types().filter(|rt| rt.key.group == group && rt.key.version == version) {
        resources.push(json!({
            "name": rt.key.plural,
            "singularName": rt.kind.to_lowercase(),
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        }));
        if rt.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", rt.key.plural),
                "singularName": "",
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return Err(ApiError::PathNotFound(format!("{group}/{version}")));
    }
    let group_version = if group.is_empty() { version.to_owned() } else { format!("{group}/{version}") };
    Ok(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }))
}
