//! Global services across clusters (Cilium's clustermesh global services): the endpoints that
//! other clusters' operators export to the kvstore (`wasmplane_operator::services`) become
//! slices of this cluster's Service of the same namespace and name. The model counts them
//! only while that Service is annotated `wasmplane.io/global: "true"`, so a cluster opts in
//! per Service on both sides: one exports it, the other balances to it.
//!
//! The agent follows the clusters' prefix read-only and turns each change of an export into
//! the events it makes (an upsert or delete of the slices it contributes), applied like the
//! API server's: the guests and the kernel see a change only when the endpoints changed. A
//! malformed export keeps what it last contributed; an unreachable kvstore keeps everything
//! (the shared cache follows again when it answers and applies the difference).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use futures::future::BoxFuture;
use wasmplane_kvstore::{
    EtcdConfig, KvStore, SharedBatch, SharedBatches, SharedChange, SharedEntry, SharedStore, SharedStoreConfig,
};
use wasmplane_model::{
    ClusterEvent, ClusterObject, CompactString, Endpoint, EndpointPort, EndpointSlice, ObjectKind, Protocol,
};
use wasmplane_operator::{
    CLUSTERS_PREFIX, NODE_INFO_PREFIX, RemoteNodes, SharedService, SharedSlice, follow_cluster_nodes,
};
use wasmplane_sources::kube::SourceEvent;

use crate::clustermesh::Following;
use crate::controller::Controller;
use crate::metrics::{ClusterLabels, ClusterMeshGauges};

/// Which clusters' exports an importer takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Clusters {
    /// Every cluster but these (this one, and those followed in their own kvstores).
    AllBut(Vec<String>),
    /// This one only (a remote cluster followed in its own kvstore).
    Only(String),
}

impl Clusters {
    fn takes(&self, cluster: &str) -> bool {
        match self {
            Clusters::AllBut(skipped) => !skipped.iter().any(|c| c == cluster),
            Clusters::Only(only) => only == cluster,
        }
    }
}

/// What one cluster's export of one service contributes here, by entry name
/// (`<cluster>/services/<namespace>/<name>` under the clusters' prefix).
#[derive(Debug)]
pub struct Importer {
    clusters: Clusters,
    contributed: BTreeMap<String, Vec<EndpointSlice>>,
}

impl Importer {
    pub fn new(clusters: Clusters) -> Self {
        Importer { clusters, contributed: BTreeMap::new() }
    }

    /// An entry was written (`Some`) or deleted (`None`): the events that bring the model's
    /// imported slices in line. Entries that are not another cluster's service export are
    /// ignored; a value that does not decode keeps what the entry contributed before.
    pub fn set(&mut self, name: &str, value: Option<&[u8]>) -> Vec<ClusterEvent> {
        let Some((cluster, namespace, service)) = parse_entry(name) else { return Vec::new() };
        if !self.clusters.takes(cluster) {
            return Vec::new();
        }
        let slices = match value.map(|value| SharedService::decode_export(value, cluster, namespace, service)) {
            None => Vec::new(),
            Some(Ok(shared)) => slices_of(&shared),
            Some(Err(e)) => {
                tracing::warn!(entry = name, "a shared service not taken, its last endpoints stay: {e}");
                return Vec::new();
            }
        };
        let before = if slices.is_empty() {
            self.contributed.remove(name).unwrap_or_default()
        } else {
            self.contributed.insert(name.to_string(), slices.clone()).unwrap_or_default()
        };
        diff(before, slices)
    }

    /// The whole prefix read again (after the follower lagged): the events for everything
    /// that differs from what was contributed.
    pub fn replace(&mut self, snapshot: &BTreeMap<String, SharedEntry>) -> Vec<ClusterEvent> {
        let mut events = Vec::new();
        let gone: Vec<String> = self.contributed.keys().filter(|name| !snapshot.contains_key(*name)).cloned().collect();
        for name in gone {
            events.extend(self.set(&name, None));
        }
        for (name, entry) in snapshot {
            events.extend(self.set(name, Some(&entry.value)));
        }
        events
    }

    /// Endpoints contributed now, by cluster.
    fn endpoints_by_cluster(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for slice in self.contributed.values().flatten() {
            *counts.entry(slice.cluster.as_deref().unwrap_or_default().to_string()).or_default() +=
                slice.endpoints.len();
        }
        counts
    }

    /// Every other cluster's export that contributes endpoints now.
    pub fn imported(&self) -> Vec<ImportedService> {
        self.contributed
            .values()
            .filter_map(|slices| {
                let first = slices.first()?;
                Some(ImportedService {
                    cluster: first.cluster.as_deref().unwrap_or_default().to_string(),
                    namespace: first.namespace.to_string(),
                    name: first.service_name.to_string(),
                    endpoints: slices
                        .iter()
                        .flat_map(|s| s.endpoints.iter().map(|e| e.addresses[0].to_string()))
                        .collect(),
                })
            })
            .collect()
    }
}

/// `GET /v1/cluster/services`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ImportSummary {
    /// This cluster's name.
    pub cluster: String,
    /// Remote clusters followed in their own etcd.
    pub remote_clusters: Vec<RemoteCluster>,
    pub imported: Vec<ImportedService>,
}

/// A remote cluster followed in its own etcd.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RemoteCluster {
    pub name: String,
    /// Its etcd answered and its exports are followed (after that, an outage keeps what was
    /// imported while the follower reconnects); false: still trying to reach it.
    pub connected: bool,
}

/// One other cluster's export of a service, as imported here (the model uses it only where
/// the service is global).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ImportedService {
    pub cluster: String,
    pub namespace: String,
    pub name: String,
    pub endpoints: Vec<String>,
}

/// `<cluster>/services/<namespace>/<name>`.
fn parse_entry(name: &str) -> Option<(&str, &str, &str)> {
    let (cluster, rest) = name.split_once("/services/")?;
    let (namespace, service) = rest.split_once('/')?;
    (!cluster.is_empty()
        && !cluster.contains('/')
        && !namespace.is_empty()
        && !service.is_empty()
        && !service.contains('/'))
    .then_some((cluster, namespace, service))
}

/// The model slices of one export: one per exported slice, named `<service>@<cluster>.<n>`
/// (`@` is not allowed in Kubernetes names, so they never collide with this cluster's).
/// Addresses that are not IP addresses and ports without a known protocol or a port number
/// are left out: another cluster's mistake must not reach the guests.
fn slices_of(shared: &SharedService) -> Vec<EndpointSlice> {
    shared
        .endpoint_slices
        .iter()
        .filter_map(|slice| imported_slice(shared, slice))
        .enumerate()
        .map(|(n, mut slice)| {
            slice.name = format!("{}@{}.{n}", shared.name, shared.cluster).into();
            slice
        })
        .collect()
}

fn imported_slice(shared: &SharedService, slice: &SharedSlice) -> Option<EndpointSlice> {
    let ports: Vec<EndpointPort> = slice
        .ports
        .iter()
        .filter_map(|p| {
            Some(EndpointPort {
                name: p.name.as_deref().unwrap_or_default().into(),
                protocol: Protocol::parse(&p.protocol)?,
                port: u16::try_from(p.port).ok().filter(|port| *port != 0)?,
            })
        })
        .collect();
    let mut endpoints: Vec<Endpoint> = slice
        .addresses
        .iter()
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .map(|ip| Endpoint {
            addresses: vec![CompactString::from(ip.to_string())],
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
            for_zones: Vec::new(),
            for_nodes: Vec::new(),
        })
        .collect();
    if ports.is_empty() || endpoints.is_empty() {
        return None;
    }
    endpoints.sort_by(|a, b| a.addresses.cmp(&b.addresses));
    endpoints.dedup();
    Some(EndpointSlice {
        namespace: shared.namespace.as_str().into(),
        name: CompactString::default(),
        service_name: shared.name.as_str().into(),
        endpoints,
        ports,
        trigger_time: None,
        cluster: Some(shared.cluster.as_str().into()),
    })
}

fn diff(before: Vec<EndpointSlice>, after: Vec<EndpointSlice>) -> Vec<ClusterEvent> {
    let mut events: Vec<ClusterEvent> = before
        .iter()
        .filter(|old| !after.iter().any(|new| new.name == old.name))
        .map(|old| ClusterEvent::Delete(ObjectKind::EndpointSlice, old.key()))
        .collect();
    events.extend(
        after
            .into_iter()
            .filter(|new| !before.contains(new))
            .map(|new| ClusterEvent::Upsert(ClusterObject::EndpointSlice(new))),
    );
    events
}

/// Follows other clusters' exports in this cluster's kvstore and applies them to the model
/// until dropped.
pub struct ServiceImport {
    importer: Arc<Mutex<Importer>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ServiceImport {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ServiceImport {
    /// Reads the clusters' prefix of `kv` (fails if it does not answer) and applies what it
    /// holds before returning, then follows it.
    pub async fn start(
        kv: Arc<dyn KvStore>,
        controller: &Arc<Mutex<Controller>>,
        clusters: Clusters,
        clusters_prefix: &str,
        gauges: ClusterMeshGauges,
    ) -> anyhow::Result<ServiceImport> {
        let importer = Arc::new(Mutex::new(Importer::new(clusters)));
        let store = SharedStore::follow(kv, SharedStoreConfig::new(clusters_prefix)).await?;
        let mut counted = Counted::new(gauges);
        let mut batches = store.batches();
        if let Some(first) = batches.next().await {
            apply(controller, take(first, &importer, &mut counted)).await;
        }
        // The task owns the store: aborting it stops the follower too.
        let task = tokio::spawn(follow(store, batches, importer.clone(), Arc::downgrade(controller), counted));
        Ok(ServiceImport { importer, task })
    }

    /// Every export this import contributes endpoints from.
    pub fn imported(&self) -> Vec<ImportedService> {
        self.importer.lock().unwrap_or_else(|p| p.into_inner()).imported()
    }
}

/// A remote cluster followed in its own etcd (Cilium's clustermesh: each cluster keeps its
/// own): its exports alone are imported, and its node registry goes to `nodes` when given
/// (this node routes to the remote nodes' pod CIDRs).
pub struct RemoteImport {
    remote: Remote,
    task: tokio::task::JoinHandle<()>,
}

/// What a remote import keeps across reconnects.
struct Remote {
    cluster: String,
    importer: Arc<Mutex<Importer>>,
    connected: Arc<AtomicBool>,
    controller: Weak<Mutex<Controller>>,
    gauges: ClusterMeshGauges,
    nodes: Option<RemoteNodes>,
}

impl Drop for RemoteImport {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RemoteImport {
    /// Connected in the background, again and again until it answers: a remote cluster that
    /// is down delays nothing here.
    pub fn start(
        cluster: &str,
        etcd: EtcdConfig,
        controller: Weak<Mutex<Controller>>,
        gauges: ClusterMeshGauges,
        nodes: Option<RemoteNodes>,
    ) -> RemoteImport {
        let remote = Remote {
            cluster: cluster.to_string(),
            importer: Arc::new(Mutex::new(Importer::new(Clusters::Only(cluster.to_string())))),
            connected: Arc::new(AtomicBool::new(false)),
            controller,
            gauges,
            nodes,
        };
        let task = remote.follow(etcd);
        RemoteImport { remote, task }
    }
}

impl Remote {
    /// Connects to the cluster's etcd (retrying in the background) and follows its exports,
    /// and its nodes when wanted, over that one connection.
    fn follow(&self, etcd: EtcdConfig) -> tokio::task::JoinHandle<()> {
        let (cluster, importer, connected, controller, nodes) = (
            self.cluster.clone(),
            self.importer.clone(),
            self.connected.clone(),
            self.controller.clone(),
            self.nodes.clone(),
        );
        let ready = self.gauges.remote_cluster_ready.get_or_create(&ClusterLabels { cluster: cluster.clone() }).clone();
        ready.set(0);
        let mut counted = Counted::new(self.gauges.clone());
        // This import's own cluster: a gauge it set before a reconnect is its to update.
        counted.clusters = vec![cluster.clone()];
        tokio::spawn(async move {
            let routed = nodes.is_some();
            let (services, node_registry) = crate::clustermesh::connect_until_answered(
                &cluster,
                &etcd,
                &connected,
                |kv: Arc<dyn KvStore>| async move {
                    let services = SharedStore::follow(kv.clone(), SharedStoreConfig::new(CLUSTERS_PREFIX)).await?;
                    let node_registry = if routed {
                        Some(SharedStore::follow(kv, SharedStoreConfig::new(NODE_INFO_PREFIX)).await?)
                    } else {
                        None
                    };
                    Ok((services, node_registry))
                },
            )
            .await;
            tracing::info!(cluster, "following the remote cluster's services");
            ready.set(1);
            let batches = services.batches();
            let services = follow(services, batches, importer, controller, counted);
            match (node_registry, nodes) {
                // One connection for both; the task's abort (reconnect, retract) ends both.
                (Some(registry), Some(nodes)) => {
                    tokio::join!(services, follow_cluster_nodes(registry, cluster, nodes));
                }
                _ => services.await,
            }
        })
    }
}

impl Following for RemoteImport {
    /// What was imported stays until the new connection lists the exports and only the
    /// difference is applied, as after an outage.
    fn reconnect(&mut self, etcd: EtcdConfig) {
        self.task.abort();
        self.remote.connected.store(false, Ordering::Relaxed);
        self.task = self.remote.follow(etcd);
    }

    /// Takes back every endpoint this import gave the model, and the cluster's nodes.
    fn retract(self: Box<Self>) -> BoxFuture<'static, ()> {
        self.task.abort();
        let events = {
            let mut importer = self.remote.importer.lock().unwrap_or_else(|p| p.into_inner());
            let events = importer.replace(&BTreeMap::new());
            let mut counted = Counted::new(self.remote.gauges.clone());
            counted.clusters = vec![self.remote.cluster.clone()];
            counted.update(&importer);
            events
        };
        self.remote.gauges.remote_cluster_ready.remove(&ClusterLabels { cluster: self.remote.cluster.clone() });
        if let Some(nodes) = &self.remote.nodes {
            nodes.remove(&self.remote.cluster);
        }
        let controller = self.remote.controller.clone();
        Box::pin(async move {
            if let Some(controller) = controller.upgrade() {
                apply(&controller, events).await;
            }
        })
    }

    fn status(&self) -> RemoteCluster {
        RemoteCluster { name: self.remote.cluster.clone(), connected: self.remote.connected.load(Ordering::Relaxed) }
    }

    fn imported(&self) -> Vec<ImportedService> {
        self.remote.importer.lock().unwrap_or_else(|p| p.into_inner()).imported()
    }
}

/// The model events of one batch of exports, the gauges counted again.
fn take(batch: SharedBatch, importer: &Mutex<Importer>, counted: &mut Counted) -> Vec<ClusterEvent> {
    let mut importer = importer.lock().unwrap_or_else(|p| p.into_inner());
    let events = match batch {
        SharedBatch::Snapshot(all) => importer.replace(&all),
        SharedBatch::Changes(changes) => changes
            .into_iter()
            .flat_map(|change| match change {
                SharedChange::Upsert { name, value, .. } => importer.set(&name, Some(&value)),
                SharedChange::Delete { name } => importer.set(&name, None),
            })
            .collect(),
    };
    counted.update(&importer);
    events
}

/// The imported-endpoints gauges of the clusters one import takes.
struct Counted {
    gauges: ClusterMeshGauges,
    /// Clusters whose gauge this import has set, so one that is gone is set to 0.
    clusters: Vec<String>,
}

impl Counted {
    fn new(gauges: ClusterMeshGauges) -> Self {
        Counted { gauges, clusters: Vec::new() }
    }

    fn update(&mut self, importer: &Importer) {
        let counts = importer.endpoints_by_cluster();
        for gone in self.clusters.iter().filter(|c| !counts.contains_key(*c)) {
            self.gauges.imported_endpoints.get_or_create(&ClusterLabels { cluster: gone.clone() }).set(0);
        }
        for (cluster, endpoints) in &counts {
            self.gauges
                .imported_endpoints
                .get_or_create(&ClusterLabels { cluster: cluster.clone() })
                .set(*endpoints as i64);
        }
        self.clusters = counts.into_keys().collect();
    }
}

/// Each batch (a relist's difference, many exports at once) is one model update.
async fn follow(
    store: SharedStore,
    mut batches: SharedBatches,
    importer: Arc<Mutex<Importer>>,
    controller: std::sync::Weak<Mutex<Controller>>,
    mut counted: Counted,
) {
    // Holds the store: the batches end when it is dropped.
    let _store = store;
    while let Some(batch) = batches.next().await {
        let events = take(batch, &importer, &mut counted);
        let Some(controller) = controller.upgrade() else { return };
        apply(&controller, events).await;
    }
}

async fn apply(controller: &Arc<Mutex<Controller>>, events: Vec<ClusterEvent>) {
    if events.is_empty() {
        return;
    }
    let count = events.len();
    let controller = controller.clone();
    let result = tokio::task::spawn_blocking(move || {
        controller.lock().unwrap_or_else(|p| p.into_inner()).apply_source(vec![SourceEvent::Events(events)])
    })
    .await;
    match result {
        Ok(Ok(())) => tracing::debug!(events = count, "other clusters' endpoints applied"),
        // The model took them; only writing failed, and the periodic reconcile retries.
        Ok(Err(e)) => tracing::error!("applying other clusters' endpoints: {e}"),
        Err(e) => tracing::error!("applying other clusters' endpoints: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmplane_operator::SharedPort;

    fn export(cluster: &str, slices: &[(&[&str], u16)]) -> Vec<u8> {
        let shared = SharedService {
            cluster: cluster.into(),
            namespace: "shop".into(),
            name: "web".into(),
            cluster_ips: vec!["10.96.0.10".into()],
            ports: vec![SharedPort { name: Some("http".into()), port: 80, protocol: "TCP".into() }],
            endpoint_slices: slices
                .iter()
                .map(|(addresses, port)| SharedSlice {
                    ports: vec![SharedPort {
                        name: Some("http".into()),
                        port: i32::from(*port),
                        protocol: "TCP".into(),
                    }],
                    addresses: addresses.iter().map(|a| a.to_string()).collect(),
                    hostnames: Default::default(),
                })
                .collect(),
        };
        serde_json::to_vec(&shared).unwrap()
    }

    fn summary(events: &[ClusterEvent]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                ClusterEvent::Upsert(ClusterObject::EndpointSlice(s)) => {
                    format!(
                        "+{} {}",
                        s.name,
                        s.endpoints.iter().map(|e| e.addresses[0].as_str()).collect::<Vec<_>>().join(",")
                    )
                }
                ClusterEvent::Delete(_, key) => format!("-{}", key.name),
                other => panic!("unexpected event {other:?}"),
            })
            .collect()
    }

    #[test]
    fn the_annotation_is_the_operators() {
        assert_eq!(wasmplane_sources::slim::GLOBAL_SERVICE_ANNOTATION, wasmplane_operator::GLOBAL_SERVICE_ANNOTATION);
    }

    #[test]
    fn exports_become_slices_and_only_changes_become_events() {
        let mut importer = Importer::new(Clusters::AllBut(vec!["west".into()]));
        let east = "east/services/shop/web";
        let events = importer.set(east, Some(&export("east", &[(&["10.245.0.7", "10.245.0.8"], 8080)])));
        assert_eq!(summary(&events), ["+web@east.0 10.245.0.7,10.245.0.8"]);
        let ClusterEvent::Upsert(ClusterObject::EndpointSlice(slice)) = &events[0] else { unreachable!() };
        assert_eq!(
            (slice.namespace.as_str(), slice.service_name.as_str(), slice.cluster.as_deref()),
            ("shop", "web", Some("east"))
        );
        assert!(slice.endpoints.iter().all(|e| e.ready && e.node_name.is_none()), "never local here");

        assert!(
            importer.set(east, Some(&export("east", &[(&["10.245.0.7", "10.245.0.8"], 8080)]))).is_empty(),
            "unchanged"
        );
        let events = importer.set(east, Some(&export("east", &[(&["10.245.0.7"], 8080), (&["10.245.1.9"], 9090)])));
        assert_eq!(summary(&events), ["+web@east.0 10.245.0.7", "+web@east.1 10.245.1.9"]);
        let imports = importer.imported();
        assert_eq!(imports.len(), 1);
        let east_web = &imports[0];
        assert_eq!(
            (east_web.cluster.as_str(), east_web.namespace.as_str(), east_web.name.as_str()),
            ("east", "shop", "web")
        );
        assert_eq!(east_web.endpoints, ["10.245.0.7", "10.245.1.9"]);

        // Our own export and keys that are no service export are not imported.
        assert!(importer.set("west/services/shop/web", Some(&export("west", &[(&["10.244.0.5"], 8080)]))).is_empty());
        assert!(importer.set("east/heartbeat", Some(b"1")).is_empty());

        // Garbage keeps what was there; an export without endpoints, or gone, removes it.
        assert!(importer.set(east, Some(b"{not json")).is_empty());
        assert!(
            importer.set(east, Some(&export("other", &[(&["10.245.0.1"], 8080)]))).is_empty(),
            "content of another name"
        );
        assert_eq!(importer.imported()[0].endpoints.len(), 2);
        assert_eq!(summary(&importer.set(east, Some(&export("east", &[])))), ["-web@east.0", "-web@east.1"]);
        importer.set(east, Some(&export("east", &[(&["10.245.0.7"], 8080)])));
        assert_eq!(summary(&importer.set(east, None)), ["-web@east.0"]);
        assert!(importer.imported().is_empty());
    }

    /// A remote cluster's own kvstore gives that cluster's exports alone; the shared one
    /// leaves them to it.
    #[test]
    fn each_import_takes_its_clusters() {
        let mut remote = Importer::new(Clusters::Only("east".into()));
        assert!(remote.set("north/services/shop/web", Some(&export("north", &[(&["10.246.0.7"], 8080)]))).is_empty());
        assert_eq!(remote.set("east/services/shop/web", Some(&export("east", &[(&["10.245.0.7"], 8080)]))).len(), 1);
        let mut shared = Importer::new(Clusters::AllBut(vec!["west".into(), "east".into()]));
        assert!(shared.set("east/services/shop/web", Some(&export("east", &[(&["10.245.0.7"], 8080)]))).is_empty());
        assert_eq!(shared.set("north/services/shop/web", Some(&export("north", &[(&["10.246.0.7"], 8080)]))).len(), 1);
    }

    #[test]
    fn invalid_addresses_and_ports_are_left_out() {
        let mut importer = Importer::new(Clusters::AllBut(vec!["west".into()]));
        let events = importer.set(
            "east/services/shop/web",
            Some(&export("east", &[(&["10.245.0.7", "not-an-ip", "10.245.0.7"], 8080), (&["10.245.0.9"], 0)])),
        );
        assert_eq!(summary(&events), ["+web@east.0 10.245.0.7"]);
    }

    #[test]
    fn a_reread_applies_the_difference() {
        let mut importer = Importer::new(Clusters::AllBut(vec!["west".into()]));
        importer.set("east/services/shop/web", Some(&export("east", &[(&["10.245.0.7"], 8080)])));
        importer.set("north/services/shop/web", Some(&export("north", &[(&["10.246.0.7"], 8080)])));
        let entry = |value: Vec<u8>| SharedEntry { value: value.into(), mod_revision: 1 };
        let snapshot = BTreeMap::from([
            ("east/services/shop/web".to_string(), entry(export("east", &[(&["10.245.0.7"], 8080)]))),
            ("south/services/shop/web".to_string(), entry(export("south", &[(&["10.247.0.7"], 8080)]))),
        ]);
        assert_eq!(summary(&importer.replace(&snapshot)), ["-web@north.0", "+web@south.0 10.247.0.7"]);
    }
}
