//! The object store: objects as JSON per resource type, one global resourceVersion, an
//! event history for watch resumption, and the live watch subscriptions.
//!
//! Objects are immutable once stored: the store, the history (as an event's object and as
//! the next event's previous state), list snapshots and watch preludes share one `Arc` of
//! each version instead of copies, so a large cluster is held once (at 50k services with
//! objects as a real cluster sends them, copies took more than 24 GB).
//!
//! Each version is serialized once, when it is stored ([`Stored`]): lists and watches
//! write those bytes instead of serializing the object for every reader, as a real API
//! server's watch cache does (`cachingObject`), so a benchmark's initial sync shows the
//! client's cost rather than this server's.
//!
//! Everything lives behind one mutex, taken briefly by each operation. That single lock
//! is what makes the protocol guarantees easy to keep: a list snapshot and its
//! resourceVersion are consistent, and a watch registered at version V receives every
//! event after V exactly once (replay from history and live delivery happen under the
//! same lock, so nothing falls into the gap between them).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Deref;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::value::RawValue;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::error::{ApiError, failure_status};
use crate::patch::PatchKind;
use crate::resource::{ResourceKey, ResourceType};
use crate::selector::{FieldSelector, LabelSelector};

/// `namespace` is empty for cluster-scoped objects.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ObjectName {
    pub namespace: String,
    pub name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One stored version of an object: its value, and its JSON as written to every reader.
#[derive(Debug)]
pub(crate) struct Stored {
    value: Value,
    json: Box<RawValue>,
}

impl Stored {
    pub fn new(value: Value) -> Arc<Stored> {
        // A `Value` always serializes: its map keys are strings.
        let json = serde_json::value::to_raw_value(&value).expect("a JSON value serializes");
        Arc::new(Stored { value, json })
    }

    pub fn json(&self) -> &RawValue {
        &self.json
    }
}

impl Deref for Stored {
    type Target = Value;

    fn deref(&self) -> &Value {
        &self.value
    }
}

/// One change, as kept in the history and handed to watchers.
#[derive(Debug)]
pub(crate) struct Event {
    pub rv: u64,
    pub resource: ResourceKey,
    pub event_type: EventType,
    /// The object after the change; for a delete, its last state at the delete's version.
    pub object: Arc<Stored>,
    /// The object before a modification, so a selector-filtered watcher can tell that an
    /// object started or stopped matching.
    pub previous: Option<Arc<Stored>>,
}

/// What a request may see: its namespace (if any) and its selectors.
#[derive(Debug, Clone, Default)]
pub(crate) struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, object: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && object.pointer("/metadata/namespace").and_then(Value::as_str) != Some(ns.as_str())
        {
            return false;
        }
        self.labels.matches(object) && self.fields.matches(object)
    }
}

/// How a write treats `status` (see [`ResourceType::status_subresource`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteScope {
    /// A write to the main resource over HTTP: keeps the stored status.
    Main,
    /// A write to `/status`: changes only the status.
    Status,
    /// A test-control write: changes everything, so tests can seed status.
    Everything,
}

/// One page of a list.
#[derive(Debug)]
pub(crate) struct ListPage {
    pub resource_version: u64,
    pub items: Vec<Arc<Stored>>,
    pub continue_token: Option<String>,
    pub remaining: Option<usize>,
}

/// The remainder of a paginated list, frozen when its first page was served.
#[derive(Debug)]
struct Snapshot {
    resource_version: u64,
    items: Vec<Arc<Stored>>,
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WatchFrom {
    /// `resourceVersion` unset or "0": the current objects as synthetic ADDED events first.
    Current,
    /// Events strictly after this version.
    Version(u64),
}

/// An event line to write before live events.
#[derive(Debug, Clone)]
pub(crate) struct WireEvent {
    pub event_type: &'static str,
    pub object: Arc<Stored>,
}

/// The start of a watch: lines to send first, then the live subscription (none when the
/// watch ended before it began, e.g. with a 410 ERROR).
pub(crate) struct WatchStart {
    pub prelude: Vec<WireEvent>,
    pub events: Option<mpsc::UnboundedReceiver<Arc<Event>>>,
    pub resource_version: u64,
}

struct Subscriber {
    resource: ResourceKey,
    sender: mpsc::UnboundedSender<Arc<Event>>,
}

/// How many abandoned pagination snapshots to keep before dropping the oldest.
const MAX_SNAPSHOTS: usize = 64;

pub(crate) struct Store {
    /// The last resourceVersion handed out, global across kinds like an etcd revision.
    rv: u64,
    types: BTreeMap<ResourceKey, ResourceType>,
    objects: HashMap<ResourceKey, BTreeMap<ObjectName, Arc<Stored>>>,
    history: VecDeque<Arc<Event>>,
    history_limit: usize,
    /// Watches may resume from any version >= this one; older ones get 410 Expired.
    compacted_rv: u64,
    subscribers: Vec<Subscriber>,
    snapshots: BTreeMap<u64, Snapshot>,
    next_snapshot: u64,
    /// Differs between server instances so uids are not reused across "restarts".
    uid_seed: u64,
    uid_counter: u64,
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// splitmix64: cheap, well-spread bits for uids and generated names without an RNG crate.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object.get("metadata")?.get(field)?.as_str()
}

fn metadata_mut(object: &mut Value) -> &mut Map<String, Value> {
    if !object.get("metadata").is_some_and(Value::is_object) {
        object["metadata"] = json!({});
    }
    match object.get_mut("metadata") {
        Some(Value::Object(map)) => map,
        // Unreachable: just made it an object above.
        _ => unreachable!("metadata is an object"),
    }
}

/// Everything except metadata and status: what `metadata.generation` tracks.
fn spec_part(object: &Value) -> Map<String, Value> {
    object
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| !matches!(k.as_str(), "metadata" | "status" | "apiVersion" | "kind"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn finalizers_pending(object: &Value) -> bool {
    object.pointer("/metadata/finalizers").and_then(Value::as_array).is_some_and(|f| !f.is_empty())
}

fn set_rv(object: &mut Value, rv: u64) {
    metadata_mut(object).insert("resourceVersion".into(), Value::String(rv.to_string()));
}

impl Store {
    pub fn new(types: impl IntoIterator<Item = ResourceType>, history_limit: usize) -> Self {
        let seed = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or_default()
            ^ u64::from(std::process::id());
        let mut store = Self {
            rv: 0,
            types: BTreeMap::new(),
            objects: HashMap::new(),
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            compacted_rv: 0,
            subscribers: Vec::new(),
            snapshots: BTreeMap::new(),
            next_snapshot: 1,
            uid_seed: mix(seed),
            uid_counter: 0,
        };
        for t in types {
            store.register(t);
        }
        store
    }

    pub fn register(&mut self, resource: ResourceType) {
        self.objects.entry(resource.key.clone()).or_default();
        self.types.insert(resource.key.clone(), resource);
    }

    pub fn types(&self) -> impl Iterator<Item = &ResourceType> {
        self.types.values()
    }

    pub fn resource_type(&self, key: &ResourceKey) -> Result<ResourceType, ApiError> {
        self.types
            .get(key)
            .cloned()
            .ok_or_else(|| ApiError::PathNotFound(format!("resource type {key} is not registered")))
    }

    pub fn current_rv(&self) -> u64 {
        self.rv
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn new_uid(&mut self) -> String {
        self.uid_counter += 1;
        let bits = mix(self.uid_seed ^ self.uid_counter);
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            (self.uid_seed >> 32) as u32,
            (bits >> 48) as u16,
            (bits >> 36) & 0xfff,
            (bits >> 24) & 0xfff,
            self.uid_counter & 0xffff_ffff_ffff
        )
    }

    /// A `generateName` suffix: five characters from Kubernetes' alphabet (no vowels).
    fn name_suffix(&mut self) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        self.uid_counter += 1;
        let mut bits = mix(self.uid_seed.wrapping_add(self.uid_counter));
        (0..5)
            .map(|_| {
                let c = ALPHABET[(bits % ALPHABET.len() as u64) as usize];
                bits /= ALPHABET.len() as u64;
                c as char
            })
            .collect()
    }

    /// Append to the history (compacting the oldest beyond the limit) and hand the event
    /// to every live watcher of its resource type.
    fn record(
        &mut self,
        resource: &ResourceKey,
        event_type: EventType,
        object: Arc<Stored>,
        previous: Option<Arc<Stored>>,
    ) {
        let rv = object
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|v| v.parse().ok())
            .unwrap_or(self.rv);
        let event = Arc::new(Event { rv, resource: resource.clone(), event_type, object, previous });
        self.history.push_back(event.clone());
        while self.history.len() > self.history_limit {
            if let Some(dropped) = self.history.pop_front() {
                self.compacted_rv = dropped.rv;
            }
        }
        // Watchers that went away (client disconnected) are pruned here.
        self.subscribers.retain(|s| s.resource != *resource || s.sender.send(event.clone()).is_ok());
    }

    /// Resolve the namespace an object belongs to: the path's, checked against the body's.
    fn namespace_for(rt: &ResourceType, path_ns: Option<&str>, object: &Value) -> Result<String, ApiError> {
        if !rt.namespaced {
            return Ok(String::new());
        }
        let body_ns = meta_str(object, "namespace").filter(|ns| !ns.is_empty());
        match (path_ns, body_ns) {
            (Some(p), Some(b)) if p != b => Err(ApiError::BadRequest(format!(
                "the namespace of the provided object ({b}) does not match the namespace sent on the request ({p})"
            ))),
            (Some(ns), _) | (None, Some(ns)) => Ok(ns.to_owned()),
            (None, None) => Err(ApiError::BadRequest(format!("{} is namespaced: a namespace is required", rt.key))),
        }
    }

    pub fn get(&self, key: &ResourceKey, namespace: Option<&str>, name: &str) -> Result<Arc<Stored>, ApiError> {
        let rt = self.resource_type(key)?;
        let id = ObjectName {
            namespace: if rt.namespaced { namespace.unwrap_or_default().to_owned() } else { String::new() },
            name: name.to_owned(),
        };
        self.objects
            .get(key)
            .and_then(|objects| objects.get(&id))
            .cloned()
            .ok_or_else(|| ApiError::not_found(key.to_string(), name))
    }

    /// All objects of a type matching the filter, in (namespace, name) order.
    pub fn matching(&self, key: &ResourceKey, filter: &Filter) -> Vec<Arc<Stored>> {
        self.objects
            .get(key)
            .map(|objects| objects.values().filter(|o| filter.matches(o)).cloned().collect())
            .unwrap_or_default()
    }

    pub fn create(
        &mut self,
        key: &ResourceKey,
        path_ns: Option<&str>,
        mut object: Value,
    ) -> Result<Arc<Stored>, ApiError> {
        let rt = self.resource_type(key)?;
        if !object.is_object() {
            return Err(ApiError::BadRequest("the request body must be a JSON object".into()));
        }
        let namespace = Self::namespace_for(&rt, path_ns, &object)?;
        let name = match meta_str(&object, "name").filter(|n| !n.is_empty()) {
            Some(name) => name.to_owned(),
            None => {
                let prefix = meta_str(&object, "generateName")
                    .filter(|g| !g.is_empty())
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        ApiError::Invalid(format!(
                            "{} is invalid: metadata.name: Required value: name or generateName is required",
                            rt.kind
                        ))
                    })?;
                loop {
                    let candidate = format!("{prefix}{}", self.name_suffix());
                    let id = ObjectName { namespace: namespace.clone(), name: candidate.clone() };
                    if !self.objects.get(key).is_some_and(|o| o.contains_key(&id)) {
                        break candidate;
                    }
                }
            }
        };
        let id = ObjectName { namespace: namespace.clone(), name: name.clone() };
        if self.objects.get(key).is_some_and(|o| o.contains_key(&id)) {
            return Err(ApiError::AlreadyExists { resource: key.to_string(), name });
        }
        let rv = self.next_rv();
        let uid = self.new_uid();
        object["apiVersion"] = Value::String(rt.api_version());
        object["kind"] = Value::String(rt.kind.clone());
        let meta = metadata_mut(&mut object);
        meta.insert("name".into(), Value::String(name));
        if rt.namespaced {
            meta.insert("namespace".into(), Value::String(namespace));
        } else {
            meta.remove("namespace");
        }
        meta.insert("uid".into(), Value::String(uid));
        meta.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
        meta.insert("generation".into(), json!(1));
        meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
        // Deletion state cannot be created, only reached through a delete.
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        let object = Stored::new(object);
        self.objects.entry(key.clone()).or_default().insert(id, object.clone());
        self.record(key, EventType::Added, object.clone(), None);
        Ok(object)
    }

    /// Replace an object. A non-empty `metadata.resourceVersion` in `object` is a
    /// precondition (409 if stale); an empty one means "whatever is stored".
    pub fn update(
        &mut self,
        key: &ResourceKey,
        path_ns: Option<&str>,
        name: &str,
        mut object: Value,
        scope: WriteScope,
    ) -> Result<Arc<Stored>, ApiError> {
        let rt = self.resource_type(key)?;
        if !object.is_object() {
            return Err(ApiError::BadRequest("the request body must be a JSON object".into()));
        }
        let namespace = Self::namespace_for(&rt, path_ns, &object)?;
        if let Some(body_name) = meta_str(&object, "name").filter(|n| !n.is_empty())
            && body_name != name
        {
            return Err(ApiError::BadRequest(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        let id = ObjectName { namespace: namespace.clone(), name: name.to_owned() };
        let old = self
            .objects
            .get(key)
            .and_then(|o| o.get(&id))
            .cloned()
            .ok_or_else(|| ApiError::not_found(key.to_string(), name))?;
        let old_rv = meta_str(&old, "resourceVersion").unwrap_or_default().to_owned();
        if let Some(wanted) = meta_str(&object, "resourceVersion").filter(|v| !v.is_empty())
            && wanted != old_rv
        {
            return Err(ApiError::Conflict { resource: key.to_string(), name: name.to_owned() });
        }

        // What each scope may change.
        match (scope, rt.status_subresource) {
            (WriteScope::Status, _) => {
                let status = object.get("status").cloned();
                object = Value::clone(&old);
                match status {
                    Some(status) => object["status"] = status,
                    None => {
                        if let Some(map) = object.as_object_mut() {
                            map.remove("status");
                        }
                    }
                }
            }
            (WriteScope::Main, true) => match old.get("status") {
                Some(status) => object["status"] = status.clone(),
                None => {
                    if let Some(map) = object.as_object_mut() {
                        map.remove("status");
                    }
                }
            },
            (WriteScope::Main, false) | (WriteScope::Everything, _) => {}
        }

        // Fields the server owns.
        object["apiVersion"] = Value::String(rt.api_version());
        object["kind"] = Value::String(rt.kind.clone());
        let old_meta = old.get("metadata").cloned().unwrap_or_else(|| json!({}));
        let meta = metadata_mut(&mut object);
        meta.insert("name".into(), Value::String(name.to_owned()));
        if rt.namespaced {
            meta.insert("namespace".into(), Value::String(namespace));
        }
        for owned in ["uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"] {
            match old_meta.get(owned) {
                Some(v) => meta.insert(owned.into(), v.clone()),
                None => meta.remove(owned),
            };
        }
        meta.insert("resourceVersion".into(), Value::String(old_rv));

        // A write that changes nothing is not an event and keeps the version, as on a
        // real server (so idempotent re-applies do not wake every watcher).
        if object == **old {
            return Ok(old);
        }
        if spec_part(&object) != spec_part(&old) {
            let generation = old.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(0) + 1;
            metadata_mut(&mut object).insert("generation".into(), json!(generation));
        }
        let rv = self.next_rv();
        set_rv(&mut object, rv);
        let object = Stored::new(object);

        // The last finalizer removed from an object being deleted completes the delete.
        if object.pointer("/metadata/deletionTimestamp").is_some() && !finalizers_pending(&object) {
            if let Some(objects) = self.objects.get_mut(key) {
                objects.remove(&id);
            }
            self.record(key, EventType::Deleted, object.clone(), Some(old));
            return Ok(object);
        }
        if let Some(objects) = self.objects.get_mut(key) {
            objects.insert(id, object.clone());
        }
        self.record(key, EventType::Modified, object.clone(), Some(old));
        Ok(object)
    }

    /// Patch an object. Returns the result and whether it was created (apply only).
    ///
    /// A `metadata.resourceVersion` that the patch leaves different from the stored one is
    /// a precondition failure, as on a real server: this is how a merge patch or a
    /// JSON-patch `test` carries optimistic concurrency.
    pub fn patch(
        &mut self,
        key: &ResourceKey,
        path_ns: Option<&str>,
        name: &str,
        kind: PatchKind,
        patch: &Value,
        scope: WriteScope,
    ) -> Result<(Arc<Stored>, bool), ApiError> {
        let rt = self.resource_type(key)?;
        let current = match self.get(key, path_ns, name) {
            Ok(current) => current,
            Err(ApiError::NotFound { .. }) if kind == PatchKind::Apply && scope != WriteScope::Status => {
                // Server-side apply creates what does not exist.
                let mut object = json!({});
                kind.apply_to(&mut object, patch)?;
                let meta = metadata_mut(&mut object);
                meta.insert("name".into(), Value::String(name.to_owned()));
                meta.remove("resourceVersion");
                if rt.namespaced
                    && let Some(ns) = path_ns
                {
                    meta.insert("namespace".into(), Value::String(ns.to_owned()));
                }
                return self.create(key, path_ns, object).map(|o| (o, true));
            }
            Err(e) => return Err(e),
        };
        let current_rv = meta_str(&current, "resourceVersion").unwrap_or_default().to_owned();
        let mut patched = Value::clone(&current);
        kind.apply_to(&mut patched, patch)?;
        match meta_str(&patched, "resourceVersion") {
            Some(rv) if !rv.is_empty() && rv != current_rv => {
                return Err(ApiError::Conflict { resource: key.to_string(), name: name.to_owned() });
            }
            _ => {}
        }
        // The precondition is checked; the write itself is unconditional under the lock.
        metadata_mut(&mut patched).insert("resourceVersion".into(), Value::String(current_rv));
        self.update(key, path_ns, name, patched, scope).map(|o| (o, false))
    }

    /// Delete an object. Returns it and whether the delete is still pending on finalizers
    /// (then it was only marked with a deletionTimestamp).
    pub fn delete(
        &mut self,
        key: &ResourceKey,
        path_ns: Option<&str>,
        name: &str,
        preconditions: &Value,
    ) -> Result<(Arc<Stored>, bool), ApiError> {
        let rt = self.resource_type(key)?;
        let previous = self.get(key, path_ns, name)?;
        let conflict = || ApiError::Conflict { resource: key.to_string(), name: name.to_owned() };
        if let Some(uid) = preconditions.get("uid").and_then(Value::as_str)
            && Some(uid) != meta_str(&previous, "uid")
        {
            return Err(conflict());
        }
        if let Some(rv) = preconditions.get("resourceVersion").and_then(Value::as_str)
            && Some(rv) != meta_str(&previous, "resourceVersion")
        {
            return Err(conflict());
        }
        let id = ObjectName {
            namespace: if rt.namespaced { path_ns.unwrap_or_default().to_owned() } else { String::new() },
            name: name.to_owned(),
        };
        let mut object = Value::clone(&previous);
        if finalizers_pending(&object) {
            if object.pointer("/metadata/deletionTimestamp").is_some() {
                return Ok((previous, true));
            }
            let meta = metadata_mut(&mut object);
            meta.insert("deletionTimestamp".into(), Value::String(now_rfc3339()));
            meta.insert("deletionGracePeriodSeconds".into(), json!(0));
            let rv = self.next_rv();
            set_rv(&mut object, rv);
            let object = Stored::new(object);
            if let Some(objects) = self.objects.get_mut(key) {
                objects.insert(id, object.clone());
            }
            self.record(key, EventType::Modified, object.clone(), Some(previous));
            return Ok((object, true));
        }
        if let Some(objects) = self.objects.get_mut(key) {
            objects.remove(&id);
        }
        // The DELETED event carries the deletion's version, so watchers advance past it.
        let rv = self.next_rv();
        set_rv(&mut object, rv);
        let object = Stored::new(object);
        self.record(key, EventType::Deleted, object.clone(), Some(previous));
        Ok((object, false))
    }

    /// Delete every object matching the filter; returns them (as deleted or marked).
    pub fn delete_collection(&mut self, key: &ResourceKey, filter: &Filter) -> Result<Vec<Arc<Stored>>, ApiError> {
        let mut deleted = Vec::new();
        for object in self.matching(key, filter) {
            let name = meta_str(&object, "name").unwrap_or_default().to_owned();
            let namespace = meta_str(&object, "namespace").map(str::to_owned);
            deleted.push(self.delete(key, namespace.as_deref(), &name, &Value::Null)?.0);
        }
        Ok(deleted)
    }

    pub fn list(
        &mut self,
        key: &ResourceKey,
        filter: &Filter,
        limit: Option<usize>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, ApiError> {
        self.resource_type(key)?;
        let (resource_version, snapshot_id, offset, items) = match continue_token {
            Some(token) => {
                let (id, offset) = token
                    .split_once(':')
                    .and_then(|(id, offset)| Some((id.parse::<u64>().ok()?, offset.parse::<usize>().ok()?)))
                    .ok_or_else(|| ApiError::BadRequest(format!("invalid continue token {token:?}")))?;
                let snapshot = self.snapshots.get(&id).ok_or_else(|| {
                    ApiError::Expired(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter."
                            .into(),
                    )
                })?;
                (snapshot.resource_version, Some(id), offset, None)
            }
            None => (self.rv, None, 0, Some(self.matching(key, filter))),
        };
        let all: &[Arc<Stored>] = match (&items, snapshot_id) {
            (Some(items), _) => items,
            (None, Some(id)) => self.snapshots.get(&id).map(|s| s.items.as_slice()).unwrap_or_default(),
            (None, None) => &[],
        };
        let start = offset.min(all.len());
        let end = match limit {
            Some(limit) if limit > 0 => (start + limit).min(all.len()),
            _ => all.len(),
        };
        let page = all[start..end].to_vec();
        let remaining = all.len() - end;
        let continue_token = if remaining == 0 {
            if let Some(id) = snapshot_id {
                self.snapshots.remove(&id);
            }
            None
        } else {
            let id = match snapshot_id {
                Some(id) => id,
                None => {
                    let id = self.next_snapshot;
                    self.next_snapshot += 1;
                    self.snapshots.insert(id, Snapshot { resource_version, items: items.unwrap_or_default() });
                    while self.snapshots.len() > MAX_SNAPSHOTS {
                        self.snapshots.pop_first();
                    }
                    id
                }
            };
            Some(format!("{id}:{end}"))
        };
        Ok(ListPage { resource_version, items: page, remaining: (remaining > 0).then_some(remaining), continue_token })
    }

    /// Start a watch: the prelude (initial state, or the 410 ERROR) and the subscription.
    pub fn watch(
        &mut self,
        key: &ResourceKey,
        filter: &Filter,
        from: WatchFrom,
        send_initial_events: bool,
    ) -> Result<WatchStart, ApiError> {
        let rt = self.resource_type(key)?;
        let (sender, receiver) = mpsc::unbounded_channel();
        let mut prelude = Vec::new();
        match from {
            WatchFrom::Version(v) if !send_initial_events => {
                if v < self.compacted_rv {
                    // In-stream, not HTTP: kube only relists on an ERROR *event* with code 410.
                    let message = format!("too old resource version: {v} ({})", self.compacted_rv);
                    prelude.push(WireEvent {
                        event_type: "ERROR",
                        object: Stored::new(failure_status(410, "Expired", &message)),
                    });
                    return Ok(WatchStart { prelude, events: None, resource_version: self.rv });
                }
                for event in self.history.iter().filter(|e| e.rv > v && e.resource == *key) {
                    // Cannot fail: the receiver is still in our hands.
                    let _ = sender.send(event.clone());
                }
            }
            _ => {
                prelude.extend(
                    self.matching(key, filter).into_iter().map(|object| WireEvent { event_type: "ADDED", object }),
                );
                if send_initial_events {
                    let mut bookmark = bookmark_object(&rt, self.rv);
                    bookmark["metadata"]["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
                    prelude.push(WireEvent { event_type: "BOOKMARK", object: Stored::new(bookmark) });
                }
            }
        }
        self.subscribers.push(Subscriber { resource: key.clone(), sender });
        Ok(WatchStart { prelude, events: Some(receiver), resource_version: self.rv })
    }

    /// Drop the event history (and pagination snapshots): resuming from any version older
    /// than now gets 410, as after an etcd compaction.
    pub fn compact(&mut self) {
        self.history.clear();
        self.snapshots.clear();
        self.compacted_rv = self.rv;
    }

    /// End every watch stream (their channels close; the streams finish cleanly).
    pub fn close_watches(&mut self) {
        self.subscribers.clear();
    }

    pub fn open_watches(&mut self) -> usize {
        self.subscribers.retain(|s| !s.sender.is_closed());
        self.subscribers.len()
    }
}

/// A BOOKMARK's object: only the type and the version it vouches for.
pub(crate) fn bookmark_object(rt: &ResourceType, rv: u64) -> Value {
    json!({
        "kind": rt.kind,
        "apiVersion": rt.api_version(),
        "metadata": { "resourceVersion": rv.to_string() },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::default_resources;

    fn svc_key() -> ResourceKey {
        ResourceKey::new("", "v1", "services")
    }

    fn svc(name: &str) -> Value {
        json!({"metadata": {"name": name}, "spec": {"ports": [{"port": 80}]}})
    }

    #[test]
    fn versions_are_global_and_server_owned() {
        let mut store = Store::new(default_resources(), 100);
        let a = store.create(&svc_key(), Some("ns"), svc("a")).unwrap();
        let node =
            store.create(&ResourceKey::new("", "v1", "nodes"), None, json!({"metadata": {"name": "n"}})).unwrap();
        assert_eq!(a["metadata"]["resourceVersion"], "1");
        assert_eq!(a["metadata"]["namespace"], "ns");
        assert_eq!(a["metadata"]["generation"], 1);
        assert_eq!(a["kind"], "Service");
        assert_eq!(node["metadata"]["resourceVersion"], "2");
        assert!(node["metadata"].get("namespace").is_none());
        assert_ne!(a["metadata"]["uid"], node["metadata"]["uid"]);
    }

    #[test]
    fn generation_tracks_spec_and_noop_is_not_a_write() {
        let mut store = Store::new(default_resources(), 100);
        let a = store.create(&svc_key(), Some("ns"), svc("a")).unwrap();
        let same = store.update(&svc_key(), Some("ns"), "a", Value::clone(&a), WriteScope::Main).unwrap();
        assert!(Arc::ptr_eq(&same, &a), "a write that changes nothing keeps the stored object");
        let mut labelled = Value::clone(&a);
        labelled["metadata"]["labels"] = json!({"x": "y"});
        let labelled = store.update(&svc_key(), Some("ns"), "a", labelled, WriteScope::Main).unwrap();
        assert_eq!(labelled["metadata"]["generation"], 1);
        assert_eq!(labelled["metadata"]["resourceVersion"], "2");
        assert_eq!(a["metadata"]["resourceVersion"], "1", "a stored version never changes");
        let mut changed = Value::clone(&labelled);
        changed["spec"]["ports"][0]["port"] = json!(81);
        let changed = store.update(&svc_key(), Some("ns"), "a", changed, WriteScope::Main).unwrap();
        assert_eq!(changed["metadata"]["generation"], 2);
        // Stale version.
        assert!(matches!(
            store.update(&svc_key(), Some("ns"), "a", Value::clone(&labelled), WriteScope::Main),
            Err(ApiError::Conflict { .. })
        ));
    }

    #[test]
    fn status_subresource_separates_writes() {
        let mut store = Store::new(default_resources(), 100);
        let mut a = svc("a");
        a["status"] = json!({"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}});
        let a = store.create(&svc_key(), Some("ns"), a).unwrap();
        let mut main = Value::clone(&a);
        main["status"] = json!({});
        main["spec"]["type"] = json!("NodePort");
        let main = store.update(&svc_key(), Some("ns"), "a", main, WriteScope::Main).unwrap();
        assert_eq!(main["status"], a["status"], "main writes keep status");
        let mut status = Value::clone(&main);
        status["status"] = json!({});
        status["spec"]["type"] = json!("ClusterIP");
        let status = store.update(&svc_key(), Some("ns"), "a", status, WriteScope::Status).unwrap();
        assert_eq!(status["status"], json!({}));
        assert_eq!(status["spec"]["type"], "NodePort", "status writes keep spec");
    }

    #[test]
    fn finalizers_defer_deletion() {
        let mut store = Store::new(default_resources(), 100);
        let mut a = svc("a");
        a["metadata"]["finalizers"] = json!(["x"]);
        store.create(&svc_key(), Some("ns"), a).unwrap();
        let (marked, pending) = store.delete(&svc_key(), Some("ns"), "a", &json!({})).unwrap();
        assert!(pending);
        assert!(marked["metadata"]["deletionTimestamp"].is_string());
        let mut cleared = Value::clone(&marked);
        cleared["metadata"]["finalizers"] = json!([]);
        store.update(&svc_key(), Some("ns"), "a", cleared, WriteScope::Main).unwrap();
        assert!(matches!(store.get(&svc_key(), Some("ns"), "a"), Err(ApiError::NotFound { .. })));
    }

    #[test]
    fn pagination_is_a_snapshot() {
        let mut store = Store::new(default_resources(), 100);
        for i in 0..5 {
            store.create(&svc_key(), Some("ns"), svc(&format!("s{i}"))).unwrap();
        }
        let first = store.list(&svc_key(), &Filter::default(), Some(2), None).unwrap();
        assert_eq!(first.items.len(), 2);
        assert_eq!(first.remaining, Some(3));
        store.delete(&svc_key(), Some("ns"), "s4", &json!({})).unwrap();
        let token = first.continue_token.unwrap();
        let second = store.list(&svc_key(), &Filter::default(), Some(2), Some(&token)).unwrap();
        let third = store.list(&svc_key(), &Filter::default(), Some(2), second.continue_token.as_deref()).unwrap();
        assert_eq!(third.items.len(), 1);
        assert_eq!(third.items[0]["metadata"]["name"], "s4", "the snapshot predates the delete");
        assert_eq!(third.resource_version, first.resource_version);
        assert!(third.continue_token.is_none());
    }

    #[test]
    fn one_version_is_held_once() {
        let mut store = Store::new(default_resources(), 100);
        let created = store.create(&svc_key(), Some("ns"), svc("a")).unwrap();
        let mut labelled = Value::clone(&created);
        labelled["metadata"]["labels"] = json!({"x": "y"});
        let updated = store.update(&svc_key(), Some("ns"), "a", labelled, WriteScope::Main).unwrap();
        let listed = store.list(&svc_key(), &Filter::default(), None, None).unwrap();
        assert!(Arc::ptr_eq(&listed.items[0], &updated), "a list shares the stored object");
        let mut replay =
            store.watch(&svc_key(), &Filter::default(), WatchFrom::Version(0), false).unwrap().events.unwrap();
        let added = replay.try_recv().unwrap();
        let modified = replay.try_recv().unwrap();
        assert!(Arc::ptr_eq(&added.object, &created), "the history shares the created version");
        assert!(Arc::ptr_eq(&modified.object, &updated));
        assert!(
            modified.previous.as_ref().is_some_and(|p| Arc::ptr_eq(p, &created)),
            "a modification's previous state is the version before, not a copy"
        );
        let prelude = store.watch(&svc_key(), &Filter::default(), WatchFrom::Current, false).unwrap().prelude;
        assert!(Arc::ptr_eq(&prelude[0].object, &updated), "a watch's initial events too");
    }

    #[test]
    fn each_version_is_serialized_as_stored() {
        let mut store = Store::new(default_resources(), 100);
        let created = store.create(&svc_key(), Some("ns"), svc("a")).unwrap();
        let (deleted, _) = store.delete(&svc_key(), Some("ns"), "a", &Value::Null).unwrap();
        for stored in [&created, &deleted] {
            let written: Value = serde_json::from_str(stored.json().get()).unwrap();
            assert_eq!(written, ***stored, "the written JSON is the stored value, metadata included");
        }
        assert_ne!(
            created.json().get(),
            deleted.json().get(),
            "the delete's own version is written, not the created one"
        );
    }

    #[test]
    fn history_limit_compacts() {
        let mut store = Store::new(default_resources(), 2);
        for i in 0..4 {
            store.create(&svc_key(), Some("ns"), svc(&format!("s{i}"))).unwrap();
        }
        let expired = store.watch(&svc_key(), &Filter::default(), WatchFrom::Version(1), false).unwrap();
        assert_eq!(expired.prelude[0].event_type, "ERROR");
        assert!(expired.events.is_none());
        let mut ok = store.watch(&svc_key(), &Filter::default(), WatchFrom::Version(2), false).unwrap();
        let events = ok.events.as_mut().unwrap();
        assert_eq!(events.try_recv().unwrap().rv, 3);
        assert_eq!(events.try_recv().unwrap().rv, 4);
    }
}
