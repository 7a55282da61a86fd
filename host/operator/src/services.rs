//! Service sync: Services annotated for sharing are written to the kvstore
//! under this cluster's prefix, with their ready endpoints, for other clusters
//! to import (and merge into their global Services).
//!
//! A Service is exported when annotated `wasmplane.io/shared: "true"`, or
//! `wasmplane.io/global: "true"` without `wasmplane.io/shared: "false"`
//! (Cilium's semantics: global implies shared unless shared is false).
//!
//! The leader's duty follows Services (from the operator's one Service watch,
//! `servicewatch`, shared with the mesh slice sync) and EndpointSlices
//! (those labelled with their Service, with a kube watcher of its own) in one
//! loop, keeping per Service what each of its slices contributes. An event
//! recomputes that one Service's value and writes it only if it changed.
//! Nothing is written until both kinds have been listed once: a value built
//! from Services without their slices would wipe the endpoints other clusters
//! use. Every (re)list of either kind replaces that kind's whole index and ends
//! with a full reconcile against the kvstore prefix: keys for Services that are
//! gone or no longer shared are deleted, so entries left stale while the
//! operator was down (or while a watch was broken) are cleaned up. Only keys under
//! `<root><cluster>/services/` are ever written or deleted, and only when
//! their content differs.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};
use wasmplane_kvstore::{Bytes, KvStore};

use crate::error::{Error, Result};
use crate::servicewatch::{ServiceEvent, ServiceEvents, with_own_watch};

/// The annotation marking a Service for sharing (value `"true"`): exported to the kvstore.
/// `"false"` on a global Service keeps its own endpoints out of other clusters (Cilium's
/// `service.cilium.io/shared`).
pub const SHARED_SERVICE_ANNOTATION: &str = "wasmplane.io/shared";
/// The annotation marking a Service global (value `"true"`, Cilium's
/// `service.cilium.io/global`): its endpoints in every cluster that exports the same
/// namespace and name are its backends here, and it is exported unless also annotated
/// `wasmplane.io/shared: "false"`.
pub const GLOBAL_SERVICE_ANNOTATION: &str = "wasmplane.io/global";
/// Root of the per-cluster prefixes.
pub const CLUSTERS_PREFIX: &str = "/wasmplane/clusters/";
/// The label naming an EndpointSlice's Service (set by the EndpointSlice controller).
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Where and what to sync.
#[derive(Debug, Clone)]
pub struct ServiceSyncConfig {
    /// This cluster's name, unique among the clusters sharing the kvstore.
    pub cluster_name: String,
    pub clusters_prefix: String,
    /// The sharing annotation ([`SHARED_SERVICE_ANNOTATION`]).
    pub annotation: String,
    /// The global annotation ([`GLOBAL_SERVICE_ANNOTATION`]).
    pub global_annotation: String,
}

impl ServiceSyncConfig {
    pub fn new(cluster_name: impl Into<String>) -> Self {
        ServiceSyncConfig {
            cluster_name: cluster_name.into(),
            clusters_prefix: CLUSTERS_PREFIX.into(),
            annotation: SHARED_SERVICE_ANNOTATION.into(),
            global_annotation: GLOBAL_SERVICE_ANNOTATION.into(),
        }
    }

    /// The prefix holding this cluster's services.
    pub fn services_prefix(&self) -> String {
        format!("{}{}/services/", self.clusters_prefix, self.cluster_name)
    }

    fn key(&self, namespace: &str, name: &str) -> String {
        format!("{}{namespace}/{name}", self.services_prefix())
    }
}

/// A port of a shared service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedPort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub port: i32,
    pub protocol: String,
}

/// What other clusters learn about a shared Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedService {
    pub cluster: String,
    pub namespace: String,
    pub name: String,
    pub cluster_ips: Vec<String>,
    pub ports: Vec<SharedPort>,
    /// The Service's ready endpoints, one entry per EndpointSlice that has any (sorted by
    /// slice name): what a global Service in another cluster balances to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoint_slices: Vec<SharedSlice>,
}

/// Why an export read from a kvstore is not taken.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("does not decode: {0}")]
    Decode(#[from] serde_json::Error),
    #[error("its content names another ({0})")]
    NamesAnother(String),
}

impl SharedService {
    /// The export stored for `cluster`'s Service `namespace`/`name`, checked to be that one:
    /// whoever reads another cluster's exports takes nothing it did not ask for.
    pub fn decode_export(
        value: &[u8],
        cluster: &str,
        namespace: &str,
        name: &str,
    ) -> std::result::Result<SharedService, ExportError> {
        let shared: SharedService = serde_json::from_slice(value)?;
        if (shared.cluster.as_str(), shared.namespace.as_str(), shared.name.as_str()) != (cluster, namespace, name) {
            return Err(ExportError::NamesAnother(format!("{}/{}/{}", shared.cluster, shared.namespace, shared.name)));
        }
        Ok(shared)
    }
}

/// The ready endpoints of one EndpointSlice of a shared Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedSlice {
    /// The slice's ports (`name` is the Service port's name, empty when it has none).
    pub ports: Vec<SharedPort>,
    /// The first address of every endpoint that is ready (not terminating).
    pub addresses: Vec<String>,
    /// The hostnames of those that have one (a StatefulSet's pods), by address: what
    /// another cluster's DNS needs for a headless Service (see [`crate::meshslices`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub hostnames: BTreeMap<String, String>,
}

/// Whether `service` is exported: `shared: "true"`, or `global: "true"` without
/// `shared: "false"`.
fn is_exported(config: &ServiceSyncConfig, service: &Service) -> bool {
    let Some(annotations) = service.metadata.annotations.as_ref() else {
        return false;
    };
    let shared = annotations.get(&config.annotation).map(String::as_str);
    let global = annotations.get(&config.global_annotation).map(String::as_str);
    shared == Some("true") || (global == Some("true") && shared != Some("false"))
}

/// The shared form of `service` without its endpoints (the sync adds those from
/// its EndpointSlices), or `None` if it is not exported (see the module doc).
pub fn shared_service(config: &ServiceSyncConfig, service: &Service) -> Option<SharedService> {
    if !is_exported(config, service) {
        return None;
    }
    let spec = service.spec.clone().unwrap_or_default();
    let cluster_ips = spec
        .cluster_ips
        .or_else(|| spec.cluster_ip.map(|ip| vec![ip]))
        .unwrap_or_default()
        .into_iter()
        .filter(|ip| !ip.is_empty() && ip != "None")
        .collect();
    Some(SharedService {
        cluster: config.cluster_name.clone(),
        namespace: service.metadata.namespace.clone()?,
        name: service.metadata.name.clone()?,
        cluster_ips,
        ports: spec
            .ports
            .unwrap_or_default()
            .into_iter()
            .map(|p| SharedPort { name: p.name, port: p.port, protocol: p.protocol.unwrap_or_else(|| "TCP".into()) })
            .collect(),
        endpoint_slices: Vec::new(),
    })
}

/// What `slice` contributes to its Service: its ports and the first address of
/// each ready, not terminating endpoint; `None` when it has no such endpoint or
/// no port.
fn shared_slice(slice: &EndpointSlice) -> Option<SharedSlice> {
    // kube-proxy ignores FQDN slices too: a hostname is nothing to DNAT to.
    if slice.address_type == "FQDN" {
        return None;
    }
    let ports: Vec<SharedPort> = slice
        .ports
        .iter()
        .flatten()
        .filter_map(|p| {
            Some(SharedPort {
                name: p.name.clone().filter(|n| !n.is_empty()),
                // A port without a number means "all ports": nothing to balance to.
                port: p.port?,
                protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
            })
        })
        .collect();
    let mut hostnames = BTreeMap::new();
    let addresses: Vec<String> = slice
        .endpoints
        .iter()
        .filter(|e| {
            let conditions = e.conditions.as_ref();
            // Kubernetes: a nil `ready` means ready (unknown state).
            conditions.and_then(|c| c.ready) != Some(false) && conditions.and_then(|c| c.terminating) != Some(true)
        })
        .filter_map(|e| {
            let address = e.addresses.first()?;
            if let Some(hostname) = e.hostname.as_ref().filter(|h| !h.is_empty()) {
                hostnames.insert(address.clone(), hostname.clone());
            }
            Some(address.clone())
        })
        .collect();
    if ports.is_empty() || addresses.is_empty() {
        return None;
    }
    Some(SharedSlice { ports, addresses, hostnames })
}

/// A Service's namespace and name.
type ServiceRef = (String, String);

fn service_ref(service: &Service) -> Option<ServiceRef> {
    Some((service.metadata.namespace.clone()?, service.metadata.name.clone()?))
}

/// Exported Services, as shared without endpoints.
type ServiceIndex = BTreeMap<ServiceRef, SharedService>;

/// Records `service` in `index` (or removes it when no longer exported); returns
/// its reference.
fn index_service(config: &ServiceSyncConfig, index: &mut ServiceIndex, service: &Service) -> Option<ServiceRef> {
    let service_ref = service_ref(service)?;
    match shared_service(config, service) {
        Some(shared) => index.insert(service_ref.clone(), shared),
        None => index.remove(&service_ref),
    };
    Some(service_ref)
}

/// What the EndpointSlices of every Service contribute (shared or not yet: a
/// Service annotated later needs its slices at once).
#[derive(Debug, Default)]
struct SliceIndex {
    /// `(namespace, slice name)` → the Service of a slice that contributes.
    owners: HashMap<(String, String), String>,
    /// Service → slice name → contribution; slice names sort the export.
    by_service: BTreeMap<ServiceRef, BTreeMap<String, SharedSlice>>,
}

impl SliceIndex {
    /// Records `slice`; returns the Services whose endpoints may have changed
    /// (its Service, and the previous one if its label moved).
    fn apply(&mut self, slice: &EndpointSlice) -> Vec<ServiceRef> {
        let (Some(namespace), Some(name)) = (&slice.metadata.namespace, &slice.metadata.name) else {
            return Vec::new();
        };
        let mut touched: Vec<ServiceRef> = self.remove(namespace, name).into_iter().collect();
        let labels = slice.metadata.labels.as_ref();
        // Another cluster's endpoints (see `meshslices`): never exported back as this one's.
        let service = labels
            .filter(|labels| !crate::meshslices::is_mesh_slice(Some(labels)))
            .and_then(|labels| labels.get(SERVICE_NAME_LABEL))
            .filter(|s| !s.is_empty());
        if let Some(service) = service {
            let service_ref = (namespace.clone(), service.clone());
            if let Some(contribution) = shared_slice(slice) {
                self.owners.insert((namespace.clone(), name.clone()), service.clone());
                self.by_service.entry(service_ref.clone()).or_default().insert(name.clone(), contribution);
            }
            if !touched.contains(&service_ref) {
                touched.push(service_ref);
            }
        }
        touched
    }

    /// Forgets a slice; returns its Service if it contributed.
    fn remove(&mut self, namespace: &str, name: &str) -> Option<ServiceRef> {
        let service = self.owners.remove(&(namespace.to_owned(), name.to_owned()))?;
        let service_ref = (namespace.to_owned(), service);
        if let Some(slices) = self.by_service.get_mut(&service_ref) {
            slices.remove(name);
            if slices.is_empty() {
                self.by_service.remove(&service_ref);
            }
        }
        Some(service_ref)
    }

    /// The contributions to `service`, sorted by slice name.
    fn slices(&self, service: &ServiceRef) -> Vec<SharedSlice> {
        self.by_service.get(service).map(|slices| slices.values().cloned().collect()).unwrap_or_default()
    }
}

/// The sync's picture of the cluster and of what it wrote.
struct SyncState {
    config: ServiceSyncConfig,
    services: ServiceIndex,
    slices: SliceIndex,
    /// Whether each watcher has completed its first list: until both have,
    /// nothing is written (the picture is half-built).
    services_listed: bool,
    slices_listed: bool,
    /// The index being rebuilt by a (re)list under way, swapped in at its end.
    services_relist: Option<ServiceIndex>,
    slices_relist: Option<SliceIndex>,
    /// What the kvstore holds under our prefix, as far as we know.
    stored: BTreeMap<String, Bytes>,
}

impl SyncState {
    fn ready(&self) -> bool {
        self.services_listed && self.slices_listed
    }

    /// The key and value of an exported Service, with its endpoints.
    fn encode(&self, service_ref: &ServiceRef) -> Option<(String, Bytes)> {
        let mut shared = self.services.get(service_ref)?.clone();
        shared.endpoint_slices = self.slices.slices(service_ref);
        let key = self.config.key(&shared.namespace, &shared.name);
        let value = serde_json::to_vec(&shared).expect("a shared service always encodes");
        Some((key, Bytes::from(value)))
    }

    async fn on_service(&mut self, store: &dyn KvStore, event: ServiceEvent) -> Result<()> {
        match event {
            Event::Init => self.services_relist = Some(ServiceIndex::new()),
            Event::InitApply(service) => {
                if let Some(buffer) = self.services_relist.as_mut() {
                    index_service(&self.config, buffer, &service);
                }
            }
            Event::InitDone => {
                // Replaced whole: Services deleted while the watch was down go.
                self.services = self.services_relist.take().unwrap_or_default();
                if !self.services_listed {
                    debug!("services listed");
                }
                self.services_listed = true;
                self.sync_all(store).await?;
            }
            Event::Apply(service) => {
                if let Some(service_ref) = index_service(&self.config, &mut self.services, &service) {
                    self.sync_one(store, &service_ref).await?;
                }
            }
            Event::Delete(service) => {
                if let Some(service_ref) = service_ref(&service) {
                    self.services.remove(&service_ref);
                    self.sync_one(store, &service_ref).await?;
                }
            }
        }
        Ok(())
    }

    async fn on_slice(&mut self, store: &dyn KvStore, event: Event<EndpointSlice>) -> Result<()> {
        match event {
            Event::Init => self.slices_relist = Some(SliceIndex::default()),
            Event::InitApply(slice) => {
                if let Some(buffer) = self.slices_relist.as_mut() {
                    buffer.apply(&slice);
                }
            }
            Event::InitDone => {
                // Replaced whole: slices deleted while the watch was down go.
                self.slices = self.slices_relist.take().unwrap_or_default();
                if !self.slices_listed {
                    debug!("endpoint slices listed");
                }
                self.slices_listed = true;
                self.sync_all(store).await?;
            }
            Event::Apply(slice) => {
                for service_ref in self.slices.apply(&slice) {
                    self.sync_one(store, &service_ref).await?;
                }
            }
            Event::Delete(slice) => {
                if let (Some(namespace), Some(name)) = (&slice.metadata.namespace, &slice.metadata.name)
                    && let Some(service_ref) = self.slices.remove(namespace, name)
                {
                    self.sync_one(store, &service_ref).await?;
                }
            }
        }
        Ok(())
    }

    /// Writes (or deletes) one Service's value, once the picture is complete.
    async fn sync_one(&mut self, store: &dyn KvStore, service_ref: &ServiceRef) -> Result<()> {
        if !self.ready() {
            return Ok(());
        }
        match self.encode(service_ref) {
            Some((key, value)) => put_if_changed(store, &mut self.stored, key, value).await,
            None => {
                let key = self.config.key(&service_ref.0, &service_ref.1);
                delete_if_stored(store, &mut self.stored, &key).await
            }
        }
    }

    /// Reconciles the whole prefix, once the picture is complete.
    async fn sync_all(&mut self, store: &dyn KvStore) -> Result<()> {
        if !self.ready() {
            return Ok(());
        }
        let desired: BTreeMap<String, Bytes> =
            self.services.keys().filter_map(|service_ref| self.encode(service_ref)).collect();
        info!(services = desired.len(), "reconciling shared services");
        reconcile(store, &mut self.stored, desired).await
    }
}

/// One event of either kind (a slice's boxed: it is much larger than the rest).
enum Update {
    Service(ServiceEvent),
    /// The Service watch stopped feeding this duty.
    ServicesEnded,
    Slice(Box<std::result::Result<Event<EndpointSlice>, watcher::Error>>),
}

/// The leader's duty: syncs shared Services into the kvstore until an error
/// (the kvstore unreachable); the caller restarts it, which takes complete
/// lists again and reconciles. Run it through [`crate::Leadership::run_while_leading`]. This
/// runs it on a Service watch of its own; [`crate::Operator`] runs it on the
/// one it shares with the mesh slice sync.
pub async fn sync_services(store: Arc<dyn KvStore>, client: kube::Client, config: ServiceSyncConfig) -> Result<()> {
    with_own_watch(client.clone(), |services| sync_services_from(store, client, config, services)).await
}

/// [`sync_services`] on a subscription to a shared Service watch: it starts with
/// the complete list, as a watcher of its own would.
pub(crate) async fn sync_services_from(
    store: Arc<dyn KvStore>,
    client: kube::Client,
    config: ServiceSyncConfig,
    services: ServiceEvents,
) -> Result<()> {
    let prefix = config.services_prefix();
    let listing = store.list_prefix(&prefix).await.map_err(|e| Error::kv("listing synced services", e))?;
    let mut state = SyncState {
        config,
        services: ServiceIndex::new(),
        slices: SliceIndex::default(),
        services_listed: false,
        slices_listed: false,
        services_relist: None,
        slices_relist: None,
        stored: listing.items.into_iter().map(|kv| (kv.key, kv.value)).collect(),
    };
    let services = services.map(Update::Service).chain(futures::stream::once(async { Update::ServicesEnded })).boxed();
    // Only slices that name their Service can contribute.
    let slices =
        watcher::watcher(Api::<EndpointSlice>::all(client), watcher::Config::default().labels(SERVICE_NAME_LABEL))
            .default_backoff()
            .map(|event| Update::Slice(Box::new(event)))
            .boxed();
    let mut updates = futures::stream::select(services, slices);
    while let Some(update) = updates.next().await {
        match update {
            Update::Service(event) => state.on_service(store.as_ref(), event).await?,
            Update::ServicesEnded => break,
            Update::Slice(event) => match *event {
                Ok(event) => state.on_slice(store.as_ref(), event).await?,
                // The watcher retries with backoff on its own.
                Err(e) => warn!(error = %e, "endpoint slice watch error"),
            },
        }
    }
    Err(Error::Internal("the service watch ended".into()))
}

async fn reconcile(
    store: &dyn KvStore,
    stored: &mut BTreeMap<String, Bytes>,
    desired: BTreeMap<String, Bytes>,
) -> Result<()> {
    let stale: Vec<String> = stored.keys().filter(|k| !desired.contains_key(*k)).cloned().collect();
    for key in stale {
        info!(%key, "removing a stale shared service");
        delete_if_stored(store, stored, &key).await?;
    }
    for (key, value) in desired {
        put_if_changed(store, stored, key, value).await?;
    }
    Ok(())
}

async fn put_if_changed(
    store: &dyn KvStore,
    stored: &mut BTreeMap<String, Bytes>,
    key: String,
    value: Bytes,
) -> Result<()> {
    if stored.get(&key) == Some(&value) {
        return Ok(());
    }
    store.put(&key, value.clone(), None).await.map_err(|e| Error::kv(format!("writing {key}"), e))?;
    debug!(%key, "shared service written");
    stored.insert(key, value);
    Ok(())
}

async fn delete_if_stored(store: &dyn KvStore, stored: &mut BTreeMap<String, Bytes>, key: &str) -> Result<()> {
    if !stored.contains_key(key) {
        return Ok(());
    }
    store.delete(key).await.map_err(|e| Error::kv(format!("deleting {key}"), e))?;
    debug!(%key, "shared service removed");
    stored.remove(key);
    Ok(())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    use super::*;

    fn annotated(annotations: &[(&str, &str)]) -> Service {
        let mut service = Service::default();
        service.metadata.namespace = Some("default".into());
        service.metadata.name = Some("web".into());
        if !annotations.is_empty() {
            service.metadata.annotations =
                Some(annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        }
        service
    }

    #[test]
    fn export_rule_follows_ciliums_shared_and_global() {
        let config = ServiceSyncConfig::new("c1");
        let (shared, global) = (SHARED_SERVICE_ANNOTATION, GLOBAL_SERVICE_ANNOTATION);
        let cases: &[(&[(&str, &str)], bool)] = &[
            (&[], false),
            (&[(shared, "true")], true),
            (&[(shared, "false")], false),
            (&[(shared, "yes")], false),
            (&[(global, "true")], true),
            (&[(global, "false")], false),
            (&[(global, "true"), (shared, "false")], false),
            (&[(global, "true"), (shared, "true")], true),
            (&[(global, "false"), (shared, "true")], true),
            (&[(global, "true"), (shared, "")], true),
        ];
        for (annotations, exported) in cases {
            let service = annotated(annotations);
            assert_eq!(shared_service(&config, &service).is_some(), *exported, "{annotations:?}");
        }
    }

    fn endpoint(ip: &str, ready: Option<bool>, terminating: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into(), "fd00::1".into()],
            conditions: Some(EndpointConditions { ready, terminating, ..Default::default() }),
            ..Default::default()
        }
    }

    fn slice(name: &str, service: &str, ports: Vec<EndpointPort>, endpoints: Vec<Endpoint>) -> EndpointSlice {
        let mut slice =
            EndpointSlice { address_type: "IPv4".into(), endpoints, ports: Some(ports), ..Default::default() };
        slice.metadata.namespace = Some("default".into());
        slice.metadata.name = Some(name.into());
        slice.metadata.labels = Some(BTreeMap::from([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())]));
        slice
    }

    fn port(name: Option<&str>, port: Option<i32>, protocol: Option<&str>) -> EndpointPort {
        EndpointPort { name: name.map(Into::into), port, protocol: protocol.map(Into::into), ..Default::default() }
    }

    #[test]
    fn an_export_is_taken_only_for_the_service_it_is_stored_for() {
        let export = br#"{"cluster": "east", "namespace": "db", "name": "pg", "clusterIps": [], "ports": []}"#;
        assert_eq!(SharedService::decode_export(export, "east", "db", "pg").unwrap().name, "pg");
        let other = SharedService::decode_export(export, "east", "db", "mysql").unwrap_err();
        assert!(matches!(other, ExportError::NamesAnother(ref named) if named == "east/db/pg"), "{other}");
        assert!(matches!(SharedService::decode_export(export, "west", "db", "pg"), Err(ExportError::NamesAnother(_))));
        assert!(matches!(SharedService::decode_export(b"{", "east", "db", "pg"), Err(ExportError::Decode(_))));
    }

    #[test]
    fn another_clusters_endpoints_are_never_exported_as_this_ones() {
        let mut index = SliceIndex::default();
        let mut mesh = slice(
            "web-east-0",
            "web",
            vec![port(Some("http"), Some(80), None)],
            vec![endpoint("10.245.0.7", None, None)],
        );
        mesh.metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(crate::meshslices::MANAGED_BY_LABEL.into(), crate::meshslices::MESH_SLICE_CONTROLLER.into());
        index.apply(&mesh);
        let own = slice(
            "web-abcde",
            "web",
            vec![port(Some("http"), Some(80), None)],
            vec![endpoint("10.244.0.7", None, None)],
        );
        index.apply(&own);
        let service = ("default".to_string(), "web".to_string());
        let exported: Vec<Vec<String>> = index.slices(&service).into_iter().map(|s| s.addresses).collect();
        assert_eq!(exported, [["10.244.0.7"]]);
    }

    #[test]
    fn a_slice_contributes_its_ready_endpoints_and_numbered_ports() {
        let s = slice(
            "web-1",
            "web",
            vec![
                port(Some(""), Some(80), None),
                port(Some("dns"), Some(53), Some("UDP")),
                port(Some("all"), None, Some("TCP")),
            ],
            vec![
                endpoint("10.0.0.1", None, None),
                endpoint("10.0.0.2", Some(true), Some(false)),
                endpoint("10.0.0.3", Some(false), None),
                endpoint("10.0.0.4", Some(true), Some(true)),
                Endpoint { addresses: vec!["10.0.0.5".into()], hostname: Some("web-5".into()), ..Default::default() },
                Endpoint {
                    addresses: vec!["10.0.0.6".into()],
                    hostname: Some("web-6".into()),
                    conditions: Some(EndpointConditions { ready: Some(false), ..Default::default() }),
                    ..Default::default()
                },
            ],
        );
        assert_eq!(
            shared_slice(&s),
            Some(SharedSlice {
                ports: vec![
                    SharedPort { name: None, port: 80, protocol: "TCP".into() },
                    SharedPort { name: Some("dns".into()), port: 53, protocol: "UDP".into() },
                ],
                addresses: vec!["10.0.0.1".into(), "10.0.0.2".into(), "10.0.0.5".into()],
                hostnames: BTreeMap::from([("10.0.0.5".into(), "web-5".into())]),
            })
        );
        let unready =
            slice("web-2", "web", vec![port(None, Some(80), None)], vec![endpoint("10.0.0.3", Some(false), None)]);
        assert_eq!(shared_slice(&unready), None);
        let portless = slice("web-3", "web", vec![port(None, None, None)], vec![endpoint("10.0.0.1", None, None)]);
        assert_eq!(shared_slice(&portless), None);
        let mut fqdn =
            slice("web-4", "web", vec![port(None, Some(80), None)], vec![endpoint("db.example.com", None, None)]);
        fqdn.address_type = "FQDN".into();
        assert_eq!(shared_slice(&fqdn), None);
    }

    #[test]
    fn a_slice_moving_to_another_service_leaves_the_first() {
        let mut index = SliceIndex::default();
        let web = ("default".to_owned(), "web".to_owned());
        let api = ("default".to_owned(), "api".to_owned());
        let ports = || vec![port(None, Some(80), None)];
        let ready = || vec![endpoint("10.0.0.1", None, None)];
        assert_eq!(index.apply(&slice("s", "web", ports(), ready())), vec![web.clone()]);
        assert_eq!(index.slices(&web).len(), 1);
        assert_eq!(index.apply(&slice("s", "api", ports(), ready())), vec![web.clone(), api.clone()]);
        assert!(index.slices(&web).is_empty());
        assert_eq!(index.slices(&api).len(), 1);
        // No longer contributing: forgotten, its Service recomputed.
        assert_eq!(index.apply(&slice("s", "api", ports(), vec![])), vec![api.clone()]);
        assert!(index.slices(&api).is_empty());
        assert_eq!(index.remove("default", "s"), None);
    }
}
