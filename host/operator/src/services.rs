//! Service sync: Services annotated for sharing are written to the kvstore
//! under this cluster's prefix, for other clusters to import.
//!
//! The leader's duty follows Services with kube's watcher. Every (re)list ends
//! with a full reconcile against the kvstore prefix: keys for Services that
//! are gone or no longer shared are deleted, so entries left stale while the
//! operator was down (or while the watch was broken) are cleaned up. Between
//! lists, events are applied one by one. Only keys under
//! `<root><cluster>/services/` are ever written or deleted, and only when
//! their content differs.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};
use wasmplane_kvstore::{Bytes, KvStore};

use crate::error::{Error, Result};

/// The annotation marking a Service for sharing (value `"true"`).
pub const SHARED_SERVICE_ANNOTATION: &str = "wasmplane.io/shared";
/// Root of the per-cluster prefixes.
pub const CLUSTERS_PREFIX: &str = "/wasmplane/clusters/";

/// Where and what to sync.
#[derive(Debug, Clone)]
pub struct ServiceSyncConfig {
    /// This cluster's name, unique among the clusters sharing the kvstore.
    pub cluster_name: String,
    pub clusters_prefix: String,
    pub annotation: String,
}

impl ServiceSyncConfig {
    pub fn new(cluster_name: impl Into<String>) -> Self {
        ServiceSyncConfig {
            cluster_name: cluster_name.into(),
            clusters_prefix: CLUSTERS_PREFIX.into(),
            annotation: SHARED_SERVICE_ANNOTATION.into(),
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
}

/// The shared form of `service`, or `None` if it is not annotated for sharing.
pub fn shared_service(config: &ServiceSyncConfig, service: &Service) -> Option<SharedService> {
    let annotations = service.metadata.annotations.as_ref()?;
    if annotations.get(&config.annotation).map(String::as_str) != Some("true") {
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
            .map(|p| SharedPort {
                name: p.name,
                port: p.port,
                protocol: p.protocol.unwrap_or_else(|| "TCP".into()),
            })
            .collect(),
    })
}

/// The leader's duty: syncs shared Services into the kvstore until an error
/// (the kvstore unreachable); the caller restarts it, which relists and
/// reconciles. Run it through [`crate::Leadership::run_while_leading`].
pub async fn sync_services(
    store: Arc<dyn KvStore>,
    client: kube::Client,
    config: ServiceSyncConfig,
) -> Result<()> {
    let prefix = config.services_prefix();
    let listing = store
        .list_prefix(&prefix)
        .await
        .map_err(|e| Error::kv("listing synced services", e))?;
    // What the kvstore holds under our prefix, as far as we know.
    let mut stored: BTreeMap<String, Bytes> = listing
        .items
        .into_iter()
        .map(|kv| (kv.key, kv.value))
        .collect();
    let api: Api<Service> = Api::all(client);
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut relisting: Option<BTreeMap<String, Bytes>> = None;
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                // The watcher retries with backoff on its own.
                warn!(error = %e, "service watch error");
                continue;
            }
        };
        match event {
            Event::Init => relisting = Some(BTreeMap::new()),
            Event::InitApply(service) => {
                if let (Some(buffer), Some((key, value))) =
                    (relisting.as_mut(), encode(&config, &service))
                {
                    buffer.insert(key, value);
                }
            }
            Event::InitDone => {
                let desired = relisting.take().unwrap_or_default();
                reconcile(store.as_ref(), &mut stored, desired).await?;
            }
            Event::Apply(service) => match encode(&config, &service) {
                Some((key, value)) => {
                    put_if_changed(store.as_ref(), &mut stored, key, value).await?
                }
                None => {
                    if let (Some(ns), Some(name)) =
                        (&service.metadata.namespace, &service.metadata.name)
                    {
                        delete_if_stored(store.as_ref(), &mut stored, &config.key(ns, name))
                            .await?;
                    }
                }
            },
            Event::Delete(service) => {
                if let (Some(ns), Some(name)) =
                    (&service.metadata.namespace, &service.metadata.name)
                {
                    delete_if_stored(store.as_ref(), &mut stored, &config.key(ns, name)).await?;
                }
            }
        }
    }
    Err(Error::Internal("the service watcher ended".into()))
}

fn encode(config: &ServiceSyncConfig, service: &Service) -> Option<(String, Bytes)> {
    let shared = shared_service(config, service)?;
    let key = config.key(&shared.namespace, &shared.name);
    let value = serde_json::to_vec(&shared).expect("a shared service always encodes");
    Some((key, Bytes::from(value)))
}

async fn reconcile(
    store: &dyn KvStore,
    stored: &mut BTreeMap<String, Bytes>,
    desired: BTreeMap<String, Bytes>,
) -> Result<()> {
    let stale: Vec<String> = stored
        .keys()
        .filter(|k| !desired.contains_key(*k))
        .cloned()
        .collect();
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
    store
        .put(&key, value.clone(), None)
        .await
        .map_err(|e| Error::kv(format!("writing {key}"), e))?;
    debug!(%key, "shared service written");
    stored.insert(key, value);
    Ok(())
}

async fn delete_if_stored(
    store: &dyn KvStore,
    stored: &mut BTreeMap<String, Bytes>,
    key: &str,
) -> Result<()> {
    if !stored.contains_key(key) {
        return Ok(());
    }
    store
        .delete(key)
        .await
        .map_err(|e| Error::kv(format!("deleting {key}"), e))?;
    debug!(%key, "shared service removed");
    stored.remove(key);
    Ok(())
}
