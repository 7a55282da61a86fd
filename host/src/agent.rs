//! The agent's part of the cluster (issue 7): register this node in the kvstore (cluster-wide
//! node ID, node addresses and pod CIDRs under a lease), program routes to the other nodes'
//! pod CIDRs, and follow the operator's heartbeat so `/readyz` says when the kvstore side of
//! the cluster has gone quiet. The duties themselves live in `wasmplane-operator`; this wires
//! them to the host's model.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ipnet::IpNet;
use wasmplane_kvstore::KvStore;
use wasmplane_model::ToStd;
use wasmplane_model::state::NodeContext;
use wasmplane_operator::policystatus::POLICY_STATUS_PREFIX;
use wasmplane_operator::{
    CLUSTERS_PREFIX, HEARTBEAT_KEY, HeartbeatMonitor, NodePolicyStatus, NodeRegistry, NodeRegistryConfig,
    NodeStatusWriter, PolicyRef, RouteConfig, RouteSync,
};

use crate::clustermesh::{ClusterMeshConfig, Following, RemoteClusters};
use crate::controller::{Controller, ModelObserver};
use crate::service_import::{Clusters, ImportSummary, RemoteImport, ServiceImport};

#[derive(Clone, Debug, Default)]
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
    pub clustermesh: ClusterMeshConfig,
}

/// The agent duties of one running host. Dropping it stops route programming (routes stay)
/// and the heartbeat follower.
pub struct Agent {
    pub registry: Arc<NodeRegistry>,
    pub routes: Option<RouteSync>,
    pub heartbeat: Option<HeartbeatMonitor>,
    /// Other clusters' services found in this cluster's kvstore.
    pub service_import: Option<ServiceImport>,
    /// Other clusters' services, each cluster followed in its own etcd.
    pub remote_clusters: Option<RemoteClusters>,
    /// `--cluster-name`, for [`Agent::imports`].
    cluster_name: Option<String>,
    publisher: tokio::task::JoinHandle<()>,
    status_writer: tokio::task::JoinHandle<()>,
    /// Hands the remote clusters' pod CIDRs to pod egress masquerade (routes to them on).
    remote_pod_cidrs: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.publisher.abort();
        self.status_writer.abort();
        if let Some(task) = &self.remote_pod_cidrs {
            task.abort();
        }
    }
}

/// Other clusters' pod CIDRs, routed to natively (`--node-routes`), are left out of pod egress
/// masquerade: a pod reaches their pods with its own address, which their policies match (as
/// Cilium's native-routing CIDR spans every cluster of a mesh).
async fn keep_remote_pod_addresses(
    mut nodes: tokio::sync::watch::Receiver<wasmplane_operator::RemoteNodeSet>,
    controller: std::sync::Weak<Mutex<Controller>>,
) {
    loop {
        let cidrs: Vec<IpNet> = nodes
            .borrow_and_update()
            .values()
            .flat_map(BTreeMap::values)
            .flat_map(|node| node.pod_cidrs.iter().copied())
            .collect();
        let Some(controller) = controller.upgrade() else { return };
        let written = tokio::task::spawn_blocking(move || {
            controller.lock().unwrap_or_else(|p| p.into_inner()).remote_pod_cidrs_changed(cidrs)
        })
        .await;
        if let Ok(Err(e)) = written {
            // The next reconcile writes them.
            tracing::warn!("writing the remote clusters' pod CIDRs for egress masquerade: {e}");
        }
        if nodes.changed().await.is_err() {
            return;
        }
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
                (None, Some(generation)) if generation == p.desired_generation => {
                    NodePolicyStatus::ok(generation as i64)
                }
                (Some(error), _) => NodePolicyStatus::failed(p.desired_generation as i64, error),
                (None, _) => NodePolicyStatus::failed(p.desired_generation as i64, "not compiled yet"),
            };
            Some((policy, status))
        })
        .collect()
}

/// Writes this node's policy status after each model revision (only what changed).
async fn write_policy_status(
    writer: NodeStatusWriter,
    controller: std::sync::Weak<Mutex<Controller>>,
    mut revisions: tokio::sync::watch::Receiver<u64>,
) {
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
    (
        context.node_ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
        context.pod_cidrs.iter().filter_map(|c| c.parse().ok()).collect(),
    )
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
    pub async fn start(
        kv: Arc<dyn KvStore>,
        controller: &Arc<Mutex<Controller>>,
        config: AgentConfig,
        gauges: crate::metrics::ClusterMeshGauges,
    ) -> anyhow::Result<Agent> {
        let (tx, mut contexts) = {
            let mut c = controller.lock().unwrap_or_else(|p| p.into_inner());
            let (tx, rx) = tokio::sync::watch::channel(c.model().context.clone());
            c.add_observer(Box::new(ContextSignal(tx.clone())));
            (tx, rx)
        };
        drop(tx);
        let context = contexts.borrow_and_update().clone();
        let (node_ips, pod_cidrs) = addresses_of(&context);
        let registry = Arc::new(
            NodeRegistry::join(kv.clone(), config.registry.clone(), &context.node_name, node_ips, pod_cidrs).await?,
        );
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
            Some(
                RouteSync::start(
                    registry.clone(),
                    RouteConfig { netns: config.route_netns.clone(), ..RouteConfig::default() },
                )
                .await?,
            )
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
        let remote_pod_cidrs = routes.as_ref().filter(|_| config.cluster_name.is_some()).map(|routes| {
            tokio::spawn(keep_remote_pod_addresses(routes.remote_nodes().subscribe(), Arc::downgrade(controller)))
        });
        let (mut service_import, mut remote_clusters) = (None, None);
        if let Some(cluster) = &config.cluster_name {
            let (weak, remote_gauges, nodes) =
                (Arc::downgrade(controller), gauges.clone(), routes.as_ref().map(RouteSync::remote_nodes));
            let import = move |name: &str, etcd| {
                Box::new(RemoteImport::start(name, etcd, weak.clone(), remote_gauges.clone(), nodes.clone()))
                    as Box<dyn Following>
            };
            let remotes = RemoteClusters::start(config.clustermesh.clone(), cluster, Box::new(import)).await?;
            // This cluster's kvstore may hold other clusters' exports too (one etcd shared);
            // those with an etcd of their own are read there only.
            let skipped = std::iter::once(cluster.clone()).chain(remotes.names()).collect();
            service_import = Some(
                ServiceImport::start(kv, controller, Clusters::AllBut(skipped), CLUSTERS_PREFIX, gauges.clone())
                    .await?,
            );
            remote_clusters = Some(remotes);
        }
        Ok(Agent {
            registry,
            routes,
            heartbeat,
            service_import,
            remote_clusters,
            cluster_name: config.cluster_name.clone(),
            publisher,
            status_writer,
            remote_pod_cidrs,
        })
    }

    /// Other clusters' endpoints imported here (`None`: no `--cluster-name`, nothing imported).
    pub fn imports(&self) -> Option<ImportSummary> {
        let (remote_clusters, mut imported) =
            self.remote_clusters.as_ref().map(RemoteClusters::summaries).unwrap_or_default();
        imported.extend(self.service_import.iter().flat_map(ServiceImport::imported));
        Some(ImportSummary { cluster: self.cluster_name.clone()?, remote_clusters, imported })
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
