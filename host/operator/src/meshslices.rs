//! EndpointSlices for other clusters' endpoints of a global Service (Cilium's clustermesh
//! EndpointSlice synchronization): what lets the cluster's DNS answer for a headless global
//! Service with the pods of every cluster, StatefulSet hostnames included.
//!
//! The leader follows this cluster's Services (from the operator's one Service watch,
//! `servicewatch`, shared with the service sync), the slices it wrote (by their
//! `endpointslice.kubernetes.io/managed-by` label) and the exports of the remote clusters
//! ([`RemoteExports`], fed by [`follow_cluster_exports`]), and keeps one slice per exported
//! slice of a remote cluster for each local Service that is global and synchronized: headless
//! ones by default, any other with `wasmplane.io/global-sync-endpoint-slices: "true"`
//! (`"false"` turns it off). Agents never balance to these slices (they import the same
//! endpoints from the remote etcd), and the service sync never exports them back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tracing::{debug, info, warn};
use wasmplane_kvstore::{Revision, SharedBatch, SharedChange, SharedStore};

use crate::per_cluster::PerCluster;
use crate::services::{SERVICE_NAME_LABEL, SharedService, SharedSlice};
use crate::servicewatch::{ServiceEvent, ServiceEvents, with_own_watch};

/// The `endpointslice.kubernetes.io/managed-by` value of the slices written here.
pub const MESH_SLICE_CONTROLLER: &str = "endpointslice-mesh-controller.wasmplane.io";
/// The label naming a slice's controller (set by every EndpointSlice controller).
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// The label naming the cluster a mesh slice's endpoints are in.
pub const SOURCE_CLUSTER_LABEL: &str = "wasmplane.io/cluster";
/// `"true"` / `"false"` on a global Service: whether its remote endpoints get slices here
/// (default: only for headless Services), Cilium's
/// `service.cilium.io/global-sync-endpoint-slices`.
pub const SYNC_SLICES_ANNOTATION: &str = "wasmplane.io/global-sync-endpoint-slices";
/// Kubernetes' label on a headless Service's slices, which proxies skip.
const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// Whether a slice with these labels is one of this controller's.
pub fn is_mesh_slice(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels.and_then(|l| l.get(MANAGED_BY_LABEL)).is_some_and(|v| v == MESH_SLICE_CONTROLLER)
}

/// A Service's namespace and name.
type ServiceRef = (String, String);

/// Each remote cluster's exports: cluster → Service → what it exports.
pub type ExportSet = BTreeMap<String, BTreeMap<ServiceRef, SharedService>>;

/// The remote clusters' exports, each cluster's replaced whole by its follower.
pub type RemoteExports = PerCluster<BTreeMap<ServiceRef, SharedService>>;

/// Where `cluster` keeps its exports in its own kvstore.
pub fn cluster_exports_prefix(clusters_prefix: &str, cluster: &str) -> String {
    format!("{clusters_prefix}{cluster}/services/")
}

/// Follows `cluster`'s exports (`shared`: its etcd's [`cluster_exports_prefix`], followed)
/// into `exports`, until the store's batches end. An export that does not decode, or names
/// another cluster or Service than its key, keeps the last good one of its key (the agent's
/// import does the same): only a delete removes an export.
pub async fn follow_cluster_exports(shared: SharedStore, cluster: String, exports: RemoteExports) {
    let mut batches = shared.batches();
    let mut followed = FollowedExports::new(cluster.clone());
    while let Some(batch) = batches.next().await {
        followed.apply(batch);
        exports.set(&cluster, followed.services.clone());
    }
}

/// One remote cluster's exports as followed: the last good export of every key.
struct FollowedExports {
    cluster: String,
    services: BTreeMap<ServiceRef, SharedService>,
    /// The revision of each key's bad value last warned about: a snapshot repeating it
    /// is not warned about again.
    warned: BTreeMap<String, Revision>,
}

impl FollowedExports {
    fn new(cluster: String) -> Self {
        FollowedExports { cluster, services: BTreeMap::new(), warned: BTreeMap::new() }
    }

    fn apply(&mut self, batch: SharedBatch) {
        match batch {
            SharedBatch::Snapshot(all) => {
                // Keys missing from a snapshot were deleted meanwhile.
                self.services.retain(|(namespace, service), _| all.contains_key(&format!("{namespace}/{service}")));
                self.warned.retain(|name, _| all.contains_key(name));
                for (name, entry) in &all {
                    self.upsert(name, &entry.value, entry.mod_revision);
                }
            }
            SharedBatch::Changes(changes) => {
                for change in changes {
                    match &change {
                        SharedChange::Upsert { name, value, mod_revision } => self.upsert(name, value, *mod_revision),
                        SharedChange::Delete { name } => {
                            self.warned.remove(name);
                            if let Some((namespace, service)) = name.split_once('/') {
                                self.services.remove(&(namespace.to_string(), service.to_string()));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Takes the value of `name` (`<namespace>/<service>`) if it is a good export of that
    /// Service; a bad one leaves what the key had.
    fn upsert(&mut self, name: &str, value: &[u8], revision: Revision) {
        let Some((namespace, service)) = name.split_once('/') else { return };
        match SharedService::decode_export(value, &self.cluster, namespace, service) {
            Ok(export) => {
                self.warned.remove(name);
                self.services.insert((namespace.to_string(), service.to_string()), export);
            }
            Err(e) => {
                if self.first_warning(name, revision) {
                    let kept = self.services.contains_key(&(namespace.to_string(), service.to_string()));
                    warn!(
                        cluster = self.cluster,
                        key = name,
                        kept,
                        "an export not taken, its last good one stays: {e}"
                    );
                }
            }
        }
    }

    /// Whether the bad value of `name` at `revision` is news (one warning per revision).
    fn first_warning(&mut self, name: &str, revision: Revision) -> bool {
        self.warned.insert(name.to_string(), revision) != Some(revision)
    }
}

/// Whether `service` gets slices for its remote endpoints: global, and headless or
/// annotated to (the annotation, when set, decides).
fn synchronized(service: &Service, global_annotation: &str) -> bool {
    let annotations = service.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key)).map(String::as_str);
    if annotation(global_annotation) != Some("true") {
        return false;
    }
    match annotation(SYNC_SLICES_ANNOTATION) {
        Some(value) => value == "true",
        None => is_headless(service),
    }
}

fn is_headless(service: &Service) -> bool {
    service.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()) == Some("None")
}

/// The slice of one remote cluster's exported slice (`index`: its place in the export) for
/// the local `service`; `None` when it has no address of one family.
fn mesh_slice(service: &Service, cluster: &str, index: usize, export: &SharedSlice) -> Option<EndpointSlice> {
    let (namespace, name) = (service.metadata.namespace.clone()?, service.metadata.name.clone()?);
    let first: IpAddr = export.addresses.first()?.parse().ok()?;
    let addresses: Vec<&String> = export
        .addresses
        .iter()
        .filter(|a| a.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv4() == first.is_ipv4()))
        .collect();
    let mut labels = BTreeMap::from([
        (SERVICE_NAME_LABEL.to_string(), name.clone()),
        (MANAGED_BY_LABEL.to_string(), MESH_SLICE_CONTROLLER.to_string()),
        (SOURCE_CLUSTER_LABEL.to_string(), cluster.to_string()),
    ]);
    if is_headless(service) {
        labels.insert(HEADLESS_LABEL.to_string(), String::new());
    }
    let owner = service.metadata.uid.clone().map(|uid| OwnerReference {
        api_version: "v1".into(),
        kind: "Service".into(),
        name: name.clone(),
        uid,
        controller: Some(true),
        block_owner_deletion: None,
    });
    Some(EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{name}-{cluster}-{index}")),
            namespace: Some(namespace),
            labels: Some(labels),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        address_type: if first.is_ipv4() { "IPv4" } else { "IPv6" }.into(),
        endpoints: addresses
            .into_iter()
            .map(|address| Endpoint {
                addresses: vec![address.clone()],
                // Only ready endpoints are exported.
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                hostname: export.hostnames.get(address).cloned(),
                ..Default::default()
            })
            .collect(),
        ports: Some(
            export
                .ports
                .iter()
                .map(|p| EndpointPort {
                    name: p.name.clone(),
                    port: Some(p.port),
                    protocol: Some(p.protocol.clone()),
                    app_protocol: None,
                })
                .collect(),
        ),
    })
}

/// Every mesh slice wanted now, by namespace and name.
fn wanted_slices(
    services: &BTreeMap<ServiceRef, Arc<Service>>,
    exports: &ExportSet,
    global_annotation: &str,
) -> BTreeMap<ServiceRef, EndpointSlice> {
    let mut wanted = BTreeMap::new();
    for (service_ref, service) in services.iter().filter(|(_, s)| synchronized(s, global_annotation)) {
        for (cluster, exported) in exports {
            let Some(export) = exported.get(service_ref) else { continue };
            for (index, slice) in export.endpoint_slices.iter().enumerate() {
                if let Some(slice) = mesh_slice(service, cluster, index, slice) {
                    wanted.insert((service_ref.0.clone(), slice.metadata.name.clone().unwrap_or_default()), slice);
                }
            }
        }
    }
    wanted
}

/// What a mesh slice says (labels, address type, endpoints, ports, owner), for comparing
/// the one wanted with the one there.
type SliceContent<'a> = (
    &'a Option<BTreeMap<String, String>>,
    &'a str,
    &'a [Endpoint],
    &'a Option<Vec<EndpointPort>>,
    &'a Option<Vec<OwnerReference>>,
);

fn content(slice: &EndpointSlice) -> SliceContent<'_> {
    (&slice.metadata.labels, &slice.address_type, &slice.endpoints, &slice.ports, &slice.metadata.owner_references)
}

/// How the mesh slice sync is set.
#[derive(Clone, Debug)]
pub struct MeshSliceConfig {
    /// Every remote cluster's exports ([`RemoteExports::subscribe`]).
    pub exports: watch::Receiver<ExportSet>,
    /// The global annotation ([`crate::GLOBAL_SERVICE_ANNOTATION`]).
    pub global_annotation: String,
    /// Period of the full reconcile that repairs slices changed behind the sync's back.
    pub resync_interval: Duration,
}

impl MeshSliceConfig {
    pub fn new(exports: watch::Receiver<ExportSet>) -> Self {
        MeshSliceConfig {
            exports,
            global_annotation: crate::GLOBAL_SERVICE_ANNOTATION.into(),
            resync_interval: Duration::from_secs(60),
        }
    }
}

enum Update {
    Service(ServiceEvent),
    /// The Service watch stopped feeding this duty.
    ServicesEnded,
    Slice(Box<std::result::Result<Event<EndpointSlice>, watcher::Error>>),
    Exports,
    Resync,
}

/// The leader's duty: keeps the mesh slices in line with this cluster's Services and the
/// remote clusters' exports (the watches retry on their own, with backoff). Nothing is written until
/// both watches have listed once (a half-built picture would delete slices DNS serves).
/// Run it through [`crate::Leadership::run_while_leading`]. This runs it on a Service watch
/// of its own; [`crate::Operator`] runs it on the one it shares with the service sync.
pub async fn sync_mesh_slices(client: kube::Client, config: MeshSliceConfig) {
    with_own_watch(client.clone(), |services| sync_mesh_slices_from(client, config, services)).await
}

/// [`sync_mesh_slices`] on a subscription to a shared Service watch (which starts with the
/// complete list, as a watcher of its own would); returns when the subscription ends.
pub(crate) async fn sync_mesh_slices_from(client: kube::Client, config: MeshSliceConfig, services: ServiceEvents) {
    let mut exports = config.exports.clone();
    let slices_api: Api<EndpointSlice> = Api::all(client.clone());
    let services = services.map(Update::Service).chain(futures::stream::once(async { Update::ServicesEnded })).boxed();
    let mine = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MESH_SLICE_CONTROLLER}"));
    let slices = watcher::watcher(slices_api, mine).default_backoff().map(|e| Update::Slice(Box::new(e))).boxed();
    let changed_exports = futures::stream::unfold(exports.clone(), |mut exports| async move {
        exports.changed().await.ok().map(|()| (Update::Exports, exports))
    })
    .boxed();
    let mut resync = tokio::time::interval(config.resync_interval);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ticks = futures::stream::unfold(resync, |mut resync| async move {
        resync.tick().await;
        Some((Update::Resync, resync))
    })
    .boxed();
    let mut updates = futures::stream::select_all([services, slices, changed_exports, ticks]);
    let mut state = MeshState { global_annotation: config.global_annotation.clone(), ..MeshState::default() };
    while let Some(update) = updates.next().await {
        let mut following = state.take(update);
        // A burst (a relist, many exports at once) is one reconcile.
        while let Some(Some(update)) = futures::FutureExt::now_or_never(updates.next()) {
            following &= state.take(update);
        }
        if !following {
            warn!("the Service watch ended");
            return;
        }
        if state.ready() {
            let exports = exports.borrow_and_update().clone();
            state.reconcile(&client, &config, &exports).await;
        }
    }
}

#[derive(Default)]
struct MeshState {
    global_annotation: String,
    /// The synchronized Services (see [`synchronized`]).
    services: BTreeMap<ServiceRef, Arc<Service>>,
    slices: BTreeMap<ServiceRef, EndpointSlice>,
    services_relist: Option<BTreeMap<ServiceRef, Arc<Service>>>,
    slices_relist: Option<BTreeMap<ServiceRef, EndpointSlice>>,
    services_listed: bool,
    slices_listed: bool,
}

fn key_of(meta: &ObjectMeta) -> Option<ServiceRef> {
    Some((meta.namespace.clone()?, meta.name.clone()?))
}

/// Applies one watch event to an index and its relist buffer, keeping only the objects
/// `wanted` (others are dropped, as if deleted); `true` once a list is done.
fn apply_event<K>(
    index: &mut BTreeMap<ServiceRef, K>,
    relist: &mut Option<BTreeMap<ServiceRef, K>>,
    event: Event<K>,
    meta: impl Fn(&K) -> &ObjectMeta,
    wanted: impl Fn(&K) -> bool,
) -> bool {
    match event {
        Event::Init => *relist = Some(BTreeMap::new()),
        Event::InitApply(object) => {
            if let (Some(buffer), Some(key)) = (relist.as_mut(), key_of(meta(&object)))
                && wanted(&object)
            {
                buffer.insert(key, object);
            }
        }
        Event::InitDone => {
            *index = relist.take().unwrap_or_default();
            return true;
        }
        Event::Apply(object) => {
            if let Some(key) = key_of(meta(&object)) {
                if wanted(&object) {
                    index.insert(key, object);
                } else {
                    index.remove(&key);
                }
            }
        }
        Event::Delete(object) => {
            if let Some(key) = key_of(meta(&object)) {
                index.remove(&key);
            }
        }
    }
    false
}

impl MeshState {
    fn ready(&self) -> bool {
        self.services_listed && self.slices_listed
    }

    /// Takes one update; `false` once the Service watch has ended.
    fn take(&mut self, update: Update) -> bool {
        match update {
            // Only those synchronized are kept: at most a few of a large cluster's.
            Update::Service(event) => {
                self.services_listed |= apply_event(
                    &mut self.services,
                    &mut self.services_relist,
                    event,
                    |s: &Arc<Service>| &s.metadata,
                    |s| synchronized(s, &self.global_annotation),
                )
            }
            Update::ServicesEnded => return false,
            Update::Slice(event) => match *event {
                Ok(event) => {
                    self.slices_listed |= apply_event(
                        &mut self.slices,
                        &mut self.slices_relist,
                        event,
                        |s: &EndpointSlice| &s.metadata,
                        |_| true,
                    )
                }
                Err(e) => warn!("watching mesh EndpointSlices: {e}"),
            },
            Update::Exports | Update::Resync => {}
        }
        true
    }

    /// Creates, replaces and deletes slices until the API server holds what is wanted. A
    /// write that fails is logged and tried again at the next change or resync.
    async fn reconcile(&mut self, client: &kube::Client, config: &MeshSliceConfig, exports: &ExportSet) {
        let wanted = wanted_slices(&self.services, exports, &config.global_annotation);
        let (mut created, mut replaced, mut deleted) = (0, 0, 0);
        for ((namespace, name), slice) in &wanted {
            let api: Api<EndpointSlice> = Api::namespaced(client.clone(), namespace);
            let written = match self.slices.get(&(namespace.clone(), name.clone())) {
                Some(there) if content(there) == content(slice) => continue,
                Some(there) => {
                    let mut slice = slice.clone();
                    slice.metadata.resource_version = there.metadata.resource_version.clone();
                    replaced += 1;
                    api.replace(name, &PostParams::default(), &slice).await
                }
                None => {
                    created += 1;
                    api.create(&PostParams::default(), slice).await
                }
            };
            match written {
                // The watch brings it too; recorded now so that the next reconcile does not
                // write it again before the event arrives.
                Ok(slice) => {
                    self.slices.insert((namespace.clone(), name.clone()), slice);
                }
                Err(e) => warn!(namespace, name, "writing a mesh EndpointSlice: {e}"),
            }
        }
        let stale: Vec<ServiceRef> = self.slices.keys().filter(|key| !wanted.contains_key(*key)).cloned().collect();
        for (namespace, name) in stale {
            let api: Api<EndpointSlice> = Api::namespaced(client.clone(), &namespace);
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {
                    deleted += 1;
                    self.slices.remove(&(namespace, name));
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    self.slices.remove(&(namespace, name));
                }
                Err(e) => warn!(namespace, name, "deleting a mesh EndpointSlice: {e}"),
            }
        }
        if created + replaced + deleted > 0 {
            info!(created, replaced, deleted, slices = wanted.len(), "mesh EndpointSlices written");
        } else {
            debug!(slices = wanted.len(), "mesh EndpointSlices up to date");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::SharedPort;

    fn service(name: &str, cluster_ip: &str, annotations: &[(&str, &str)]) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "db", "name": name, "uid": format!("uid-{name}"),
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>()},
            "spec": {"clusterIP": cluster_ip, "ports": [{"name": "sql", "port": 5432}]}
        }))
        .unwrap()
    }

    fn export(cluster: &str, name: &str, addresses: &[&str], hostnames: &[(&str, &str)]) -> SharedService {
        SharedService {
            cluster: cluster.into(),
            namespace: "db".into(),
            name: name.into(),
            cluster_ips: vec![],
            ports: vec![],
            endpoint_slices: vec![SharedSlice {
                ports: vec![SharedPort { name: Some("sql".into()), port: 5432, protocol: "TCP".into() }],
                addresses: addresses.iter().map(|a| a.to_string()).collect(),
                hostnames: hostnames.iter().map(|(a, h)| (a.to_string(), h.to_string())).collect(),
            }],
        }
    }

    #[test]
    fn headless_global_services_get_their_remote_endpoints_as_slices() {
        let global = ("wasmplane.io/global", "true");
        let services: BTreeMap<ServiceRef, Arc<Service>> = [
            service("pg", "None", &[global]),
            service("web", "10.96.0.10", &[global]),
            service("api", "10.96.0.11", &[global, (SYNC_SLICES_ANNOTATION, "true")]),
            service("cache", "None", &[global, (SYNC_SLICES_ANNOTATION, "false")]),
            service("local", "None", &[]),
        ]
        .into_iter()
        .map(|s| ((s.metadata.namespace.clone().unwrap(), s.metadata.name.clone().unwrap()), Arc::new(s)))
        .collect();
        let east: BTreeMap<ServiceRef, SharedService> = ["pg", "web", "api", "cache", "local"]
            .into_iter()
            .map(|name| {
                (
                    ("db".to_string(), name.to_string()),
                    export("east", name, &["10.245.0.7", "10.245.0.8", "fd00::9"], &[("10.245.0.7", "pg-0")]),
                )
            })
            .collect();
        let wanted = wanted_slices(&services, &ExportSet::from([("east".to_string(), east)]), "wasmplane.io/global");
        assert_eq!(
            wanted.keys().map(|(_, n)| n.as_str()).collect::<Vec<_>>(),
            ["api-east-0", "pg-east-0"],
            "headless by default, others by annotation, never without global"
        );
        let pg = &wanted[&("db".to_string(), "pg-east-0".to_string())];
        let labels = pg.metadata.labels.as_ref().unwrap();
        assert_eq!(
            (
                labels[SERVICE_NAME_LABEL].as_str(),
                labels[SOURCE_CLUSTER_LABEL].as_str(),
                labels.contains_key(HEADLESS_LABEL)
            ),
            ("pg", "east", true)
        );
        assert!(is_mesh_slice(Some(labels)));
        assert_eq!(pg.address_type, "IPv4");
        let endpoints: Vec<(&str, Option<&str>)> =
            pg.endpoints.iter().map(|e| (e.addresses[0].as_str(), e.hostname.as_deref())).collect();
        assert_eq!(
            endpoints,
            [("10.245.0.7", Some("pg-0")), ("10.245.0.8", None)],
            "one family per slice, hostnames kept"
        );
        assert_eq!(pg.metadata.owner_references.as_ref().unwrap()[0].uid, "uid-pg");
        let api = &wanted[&("db".to_string(), "api-east-0".to_string())];
        assert!(!api.metadata.labels.as_ref().unwrap().contains_key(HEADLESS_LABEL));
    }

    #[test]
    fn a_bad_export_keeps_the_last_good_one_until_deleted() {
        use wasmplane_kvstore::{Bytes, SharedEntry};
        let good = |address: &str| Bytes::from(serde_json::to_vec(&export("east", "pg", &[address], &[])).unwrap());
        let addresses = |followed: &FollowedExports| -> BTreeMap<String, Vec<String>> {
            followed
                .services
                .iter()
                .map(|((_, name), s)| (name.clone(), s.endpoint_slices[0].addresses.clone()))
                .collect()
        };
        let pg = |address: &str| BTreeMap::from([("pg".to_string(), vec![address.to_string()])]);
        let upsert = |name: &str, value: Bytes, mod_revision: Revision| SharedChange::Upsert {
            name: name.into(),
            value,
            mod_revision,
        };
        let mut followed = FollowedExports::new("east".into());
        followed.apply(SharedBatch::Changes(vec![upsert("db/pg", good("10.245.0.7"), 2)]));
        assert_eq!(addresses(&followed), pg("10.245.0.7"));

        // Garbage, and an export naming another Service: the last good export stays.
        let other = Bytes::from(serde_json::to_vec(&export("east", "mysql", &["10.245.0.9"], &[])).unwrap());
        followed.apply(SharedBatch::Changes(vec![
            upsert("db/pg", Bytes::from_static(b"{not json"), 3),
            upsert("db/pg", other, 4),
        ]));
        assert_eq!(addresses(&followed), pg("10.245.0.7"), "a bad value deleted the last good export");
        assert_eq!(followed.warned.get("db/pg"), Some(&4));
        // A snapshot (the follower fell behind) with the bad value again: still kept, and
        // no second warning for that revision.
        let entry = |value: Bytes, mod_revision: Revision| SharedEntry { value, mod_revision };
        followed.apply(SharedBatch::Snapshot(BTreeMap::from([(
            "db/pg".to_string(),
            entry(Bytes::from_static(b"{not json"), 4),
        )])));
        assert_eq!(addresses(&followed), pg("10.245.0.7"), "a bad value in a snapshot deleted the last good export");
        assert!(!followed.first_warning("db/pg", 4), "warned again about the same revision");
        assert!(followed.first_warning("db/pg", 9));

        // A good value again is taken; a real delete removes it.
        followed.apply(SharedBatch::Changes(vec![upsert("db/pg", good("10.245.0.8"), 5)]));
        assert_eq!(addresses(&followed), pg("10.245.0.8"));
        assert!(followed.warned.is_empty());
        followed.apply(SharedBatch::Changes(vec![SharedChange::Delete { name: "db/pg".into() }]));
        assert!(followed.services.is_empty());

        // A key missing from a snapshot was deleted meanwhile: gone, bad value or not.
        followed.apply(SharedBatch::Changes(vec![
            upsert("db/pg", good("10.245.0.7"), 6),
            upsert("db/pg", Bytes::from_static(b"{"), 7),
        ]));
        followed.apply(SharedBatch::Snapshot(BTreeMap::new()));
        assert!(followed.services.is_empty() && followed.warned.is_empty());
        // A bad value with no good one before: nothing to keep.
        followed
            .apply(SharedBatch::Snapshot(BTreeMap::from([("db/pg".to_string(), entry(Bytes::from_static(b"{"), 8))])));
        assert!(followed.services.is_empty());
    }
}
