//! The agent's part of the cluster (issue 7): register this node in the kvstore (cluster-wide
//! node ID, node addresses and pod CIDRs under a lease), program routes to the other nodes'
//! pod CIDRs, and follow the operator's heartbeat so `/readyz` says when the kvstore side of
//! the cluster has gone quiet. The duties themselves live in `wasmplane-operator`; this wires
//! them to the host's model.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use ipnet::IpNet;
use wasmplane_kvstore::KvStore;
use wasmplane_model::ToStd;
use wasmplane_model::state::NodeContext;
use wasmplane_operator::policystatus::POLICY_STATUS_PREFIX;
use wasmplane_operator::{CLUSTERS_PREFIX, HEARTBEAT_KEY, HeartbeatMonitor, NodePolicyStatus, NodeRegistry, NodeRegistryConfig, NodeStatusWriter, PolicyRef, RouteConfig, RouteSync};

use crate::controller::{Controller, ModelObserver};
use crate::service_import::{Clusters, ImportSummary, ServiceImport};

#[derive(Clone, Debug)]
#[derive(Default)]
pub struct AgentConfig {
    /// Program routes to other nodes' pod CIDRs (off on a developer machine: they would go
    /// into its own routing table).
    pub routes: bool,
    /// Where routes go; `None`: the host's own namespace. Tests point it elsewhere.
    pub route_netns: Option<PathBuf>,
    /// The operator's heartbeat older than this makes `/readyz` fail; `None`: not followed.
    pub heartbeat_max_age: Option<Duration>,
    pub registry: NodeRegistryConfig,
    /// This cluster's name among those sharing the kvstore (`--cluster-name`): when set,
    /// other clusters' exported endpoints become backends of this cluster's global Services.
    pub cluster_name: Option<String>,
    /// Other clusters followed in their own etcd (`--remote-cluster`, `--clustermesh-config`),
    /// as Cilium's clustermesh does.
    pub remote_clusters: Vec<RemoteEtcd>,
}

/// Another cluster's etcd, followed read-only for its exported services.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteEtcd {
    pub cluster: String,
    pub endpoints: Vec<String>,
    pub tls: Option<wasmplane_kvstore::EtcdTlsFiles>,
}

/// Cilium's clustermesh configuration directory: one etcd client configuration file per
/// remote cluster, named after it (a mounted Secret, so `..data` links and dot-entries are
/// skipped). The directory may also hold the certificates and keys those files name, so, as
/// Cilium does, a file is a cluster's configuration when it has `endpoints:`. This cluster's
/// own file, which a shared Secret usually holds, is skipped.
pub fn read_clustermesh_dir(dir: &std::path::Path, own_cluster: &str) -> anyhow::Result<Vec<RemoteEtcd>> {
    let mut remotes = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading the clustermesh configuration directory {}", dir.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        // `metadata` follows the Secret's symlinks; directories are its timestamped copies.
        if name.starts_with('.') || name == own_cluster || !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            continue;
        }
        let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        if !text.windows(b"endpoints:".len()).any(|w| w == b"endpoints:") {
            continue;
        }
        let config = wasmplane_kvstore::EtcdConfigFile::parse(&path, &text)?;
        remotes.push(RemoteEtcd { cluster: name.to_string(), endpoints: config.endpoints, tls: config.tls });
    }
    remotes.sort_by(|a, b| a.cluster.cmp(&b.cluster));
    Ok(remotes)
}


/// The agent duties of one running host. Dropping it stops route programming (routes stay)
/// and the heartbeat follower.
pub struct Agent {
    pub registry: Arc<NodeRegistry>,
    pub routes: Option<RouteSync>,
    pub heartbeat: Option<HeartbeatMonitor>,
    /// Other clusters' services: from this cluster's kvstore, and from each remote cluster's.
    pub service_imports: Vec<ServiceImport>,
    /// `--cluster-name`, for [`Agent::imports`].
    cluster_name: Option<String>,
    publisher: tokio::task::JoinHandle<()>,
    status_writer: tokio::task::JoinHandle<()>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.publisher.abort();
        self.status_writer.abort();
    }
}

/// Wakes the status writer on every model revision.
struct RevisionSignal(tokio::sync::watch::Sender<u64>);

impl ModelObserver for RevisionSignal {
    fn model_changed(&self, model: &wasmplane_model::NodeLocalModel, _update: &wasmplane_model::state::ModelUpdate) {
        self.0.send_replace(model.revision);
    }
}

/// This node's realization of every policy it enforces, as the operator aggregates it:
/// the generation whose rules are in force, or why not. Policies without a uid (from a
/// manifest that names none) are not reported: the status key needs one.
fn realization(controller: &Controller) -> Vec<(PolicyRef, NodePolicyStatus)> {
    let model = controller.model();
    controller
        .policies()
        .into_iter()
        .filter_map(|p| {
            let key = wasmplane_model::ObjectKey::new(&p.namespace, &p.name);
            let uid = model.policies.get(&key)?.policy.uid.clone();
            if uid.is_empty() {
                return None;
            }
            let policy = PolicyRef { uid: uid.to_std(), namespace: p.namespace, name: p.name };
            let status = match (p.error, p.enforced_generation) {
                (None, Some(generation)) if generation == p.desired_generation => NodePolicyStatus::ok(generation as i64),
                (Some(error), _) => NodePolicyStatus::failed(p.desired_generation as i64, error),
                (None, _) => NodePolicyStatus::failed(p.desired_generation as i64, "not compiled yet"),
            };
            Some((policy, status))
        })
        .collect()
}

/// Writes this node's policy status after each model revision (only what changed).
async fn write_policy_status(writer: NodeStatusWriter, controller: std::sync::Weak<Mutex<Controller>>, mut revisions: tokio::sync::watch::Receiver<u64>) {
    let mut reported: std::collections::BTreeSet<PolicyRef> = Default::default();
    loop {
        let Some(strong) = controller.upgrade() else { return };
        let now = realization(&strong.lock().unwrap_or_else(|p| p.into_inner()));
        drop(strong);
        let current: std::collections::BTreeSet<PolicyRef> = now.iter().map(|(p, _)| p.clone()).collect();
        for (policy, status) in now {
            if let Err(e) = writer.set(&policy, status).await {
                tracing::warn!(policy = %format!("{}/{}", policy.namespace, policy.name), "writing policy status: {e}");
                // Written again after the next revision.
                reported.remove(&policy);
                continue;
            }
            reported.insert(policy);
        }
        for gone in reported.difference(&current).cloned().collect::<Vec<_>>() {
            if writer.remove(&gone).await.is_ok() {
                reported.remove(&gone);
            }
        }
        if revisions.changed().await.is_err() {
            return;
        }
    }
}

/// Node addresses and pod CIDRs as the registry wants them (unparsable entries skipped:
/// the model keeps them as the API server wrote them).
fn addresses_of(context: &NodeContext) -> (Vec<IpAddr>, Vec<IpNet>) {
    (context.node_ips.iter().filter_map(|ip| ip.parse().ok()).collect(), context.pod_cidrs.iter().filter_map(|c| c.parse().ok()).collect())
}

/// Passes this node's context on when a model revision changes it.
struct ContextSignal(tokio::sync::watch::Sender<NodeContext>);

impl ModelObserver for ContextSignal {
    fn model_changed(&self, model: &wasmplane_model::NodeLocalModel, _update: &wasmplane_model::state::ModelUpdate) {
        self.0.send_if_modified(|current| {
            if *current == model.context {
                return false;
            }
            *current = model.context.clone();
            true
        });
    }
}

impl Agent {
    /// Registers this node (allocating its ID on first start, keeping it after), then keeps
    /// its published addresses in step with its Node object.
    /// `gauges`: where the imports of other clusters' services are counted.
    pub async fn start(kv: Arc<dyn KvStore>, controller: &Arc<Mutex<Controller>>, config: AgentConfig, gauges: crate::metrics::ClusterMeshGauges) -> anyhow::Result<Agent> {
        let (tx, mut contexts) = {
            let mut c = controller.lock().unwrap_or_else(|p| p.into_inner());
            let (tx, rx) = tokio::sync::watch::channel(c.model().context.clone());
            c.add_observer(Box::new(ContextSignal(tx.clone())));
            (tx, rx)
        };
        drop(tx);
        let context = contexts.borrow_and_update().clone();
        let (node_ips, pod_cidrs) = addresses_of(&context);
        let registry = Arc::new(NodeRegistry::join(kv.clone(), config.registry.clone(), &context.node_name, node_ips, pod_cidrs).await?);
        tracing::info!(node = %context.node_name, id = registry.node_id(), "registered in the kvstore");
        let publisher = {
            let registry = registry.clone();
            tokio::spawn(async move {
                while contexts.changed().await.is_ok() {
                    let (node_ips, pod_cidrs) = addresses_of(&contexts.borrow_and_update());
                    let local = registry.local();
                    if local.node_ips == node_ips && local.pod_cidrs == pod_cidrs {
                        continue;
                    }
                    if let Err(e) = registry.update(node_ips, pod_cidrs).await {
                        tracing::warn!("publishing this node's addresses: {e}");
                    }
                }
            })
        };
        let routes = if config.routes {
            Some(RouteSync::start(registry.clone(), RouteConfig { netns: config.route_netns.clone(), ..RouteConfig::default() }).await?)
        } else {
            None
        };
        let status_writer = {
            let (tx, revisions) = tokio::sync::watch::channel(0);
            controller.lock().unwrap_or_else(|p| p.into_inner()).add_observer(Box::new(RevisionSignal(tx)));
            let writer = NodeStatusWriter::new(kv.clone(), POLICY_STATUS_PREFIX, context.node_name.clone());
            tokio::spawn(write_policy_status(writer, Arc::downgrade(controller), revisions))
        };
        let heartbeat = match config.heartbeat_max_age {
            Some(max_age) => Some(HeartbeatMonitor::start(kv.clone(), HEARTBEAT_KEY, max_age).await?),
            None => None,
        };
        let mut service_imports = Vec::new();
        if let Some(cluster) = &config.cluster_name {
            // This cluster's kvstore may hold other clusters' exports too (one etcd shared);
            // those with an etcd of their own are read there only.
            let mut skipped = vec![cluster.clone()];
            skipped.extend(config.remote_clusters.iter().map(|remote| remote.cluster.clone()));
            // Files and schemes are checked now: the follower retries only what can recover.
            let remotes = config.remote_clusters.iter().map(|remote| Ok((remote, crate::app::etcd_config(&remote.endpoints, remote.tls.as_ref()).with_context(|| format!("remote cluster {}", remote.cluster))?))).collect::<anyhow::Result<Vec<_>>>()?;
            service_imports.push(ServiceImport::start(kv, controller, Clusters::AllBut(skipped), CLUSTERS_PREFIX, gauges.clone()).await?);
            for (remote, etcd) in remotes {
                service_imports.push(ServiceImport::start_remote(remote.cluster.clone(), etcd, controller, CLUSTERS_PREFIX, gauges.clone()));
            }
        }
        Ok(Agent { registry, routes, heartbeat, service_imports, cluster_name: config.cluster_name.clone(), publisher, status_writer })
    }

    /// Other clusters' endpoints imported here (`None`: no `--cluster-name`, nothing imported).
    pub fn imports(&self) -> Option<ImportSummary> {
        Some(ImportSummary {
            cluster: self.cluster_name.clone()?,
            remote_clusters: self.service_imports.iter().filter_map(ServiceImport::remote).collect(),
            imported: self.service_imports.iter().flat_map(ServiceImport::imported).collect(),
        })
    }

    /// Why this agent is not ready, if it is not: the operator's heartbeat is stale.
    pub fn unready_reason(&self) -> Option<String> {
        let heartbeat = self.heartbeat.as_ref()?;
        if !heartbeat.is_stale() {
            return None;
        }
        Some(match heartbeat.age() {
            Some(age) => format!("kvstore unhealthy: the operator's heartbeat is {}s old", age.as_secs()),
            None => "kvstore unhealthy: no operator heartbeat seen".to_string(),
        })
    }
}
