//! The host side of the CNI split: the daemon (`wasmplane_cni`) answers the thin plugin
//! from this host's watch cache, and the addresses it hands out reach the node-local model
//! at once, before the kubelet reports them through the API server.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use wasmplane_cni::{BoxFuture, PodDirectory, PodInfo, PodNetworkSink, PodRef};
/// The plugin's request, for tools that speak to this host's daemon (the perf harness).
pub use wasmplane_cni::{CniRequest, Command as CniCommand};
use wasmplane_model::ObjectKey;

use crate::controller::{Controller, ModelObserver};

/// Where the CNI daemon listens and keeps its allocations.
#[derive(Clone, Debug)]
pub struct CniConfig {
    pub socket: PathBuf,
    /// This node's pod CIDRs (one per family, the primary family first); when empty, those
    /// of this node's Node object (`spec.podCIDRs`).
    pub pod_cidrs: Vec<ipnet::IpNet>,
    /// Allocation state (default: `<data-dir>/cni`).
    pub state_dir: Option<PathBuf>,
    /// How long an ADD waits for its pod to reach the watch cache.
    pub pod_wait: Duration,
    /// The network namespace of the node side; `None` (production): the host's own. Tests
    /// point it at a namespace standing in for the node.
    pub node_netns: Option<PathBuf>,
    /// Chained after the plugin that gives pods their addresses (`--cni-chained`): no pod
    /// CIDRs, nothing allocated or created.
    pub chained: bool,
    /// The pods' MTU (`--cni-mtu`); `None`: that of the node's default route's device,
    /// detected when the daemon starts. Ignored when chained.
    pub mtu: Option<u32>,
}

/// Wakes pod lookups on every model revision.
struct RevisionSignal(tokio::sync::watch::Sender<u64>);

impl ModelObserver for RevisionSignal {
    fn model_changed(&self, model: &wasmplane_model::NodeLocalModel, _update: &wasmplane_model::state::ModelUpdate) {
        self.0.send_replace(model.revision);
    }
}

/// The watch cache, as the CNI daemon sees it: a pod is there once the cluster state has it.
pub struct ModelPods {
    controller: Weak<Mutex<Controller>>,
    revisions: tokio::sync::watch::Receiver<u64>,
    /// The host's readiness (`/readyz`): every watched kind listed once.
    synced: Arc<AtomicBool>,
}

impl ModelPods {
    pub fn new(controller: &Arc<Mutex<Controller>>, synced: Arc<AtomicBool>) -> ModelPods {
        let (tx, revisions) = tokio::sync::watch::channel(0);
        controller.lock().unwrap_or_else(|p| p.into_inner()).add_observer(Box::new(RevisionSignal(tx)));
        ModelPods { controller: Arc::downgrade(controller), revisions, synced }
    }

    fn lookup(&self, pod: &PodRef) -> Option<PodInfo> {
        let controller = self.controller.upgrade()?;
        let controller = controller.lock().unwrap_or_else(|p| p.into_inner());
        controller.cluster().pods.get(&ObjectKey::new(&pod.namespace, &pod.name))?;
        // The model keeps no UIDs: a pod of that name is the one asked for.
        Some(PodInfo { namespace: pod.namespace.clone(), name: pod.name.clone(), uid: pod.uid.clone() })
    }
}

impl PodDirectory for ModelPods {
    fn wait_for_pod<'a>(&'a self, pod: &'a PodRef, timeout: Duration) -> BoxFuture<'a, Option<PodInfo>> {
        Box::pin(async move {
            let deadline = Instant::now() + timeout;
            let mut revisions = self.revisions.clone();
            loop {
                if let Some(found) = self.lookup(pod) {
                    return Some(found);
                }
                let left = deadline.checked_duration_since(Instant::now())?;
                // A revision may carry the pod; re-check at least every 100 ms regardless.
                let _ = tokio::time::timeout(left.min(Duration::from_millis(100)), revisions.changed()).await;
            }
        })
    }

    fn synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }
}

/// Addresses from the daemon into the model.
pub struct ModelPodNetworks {
    controller: Weak<Mutex<Controller>>,
}

impl ModelPodNetworks {
    pub fn new(controller: &Arc<Mutex<Controller>>) -> ModelPodNetworks {
        ModelPodNetworks { controller: Arc::downgrade(controller) }
    }

    /// Applies the change (the model, then the dataplane) off the async runtime; the
    /// returned task ends when it is written.
    fn update(
        &self,
        namespace: &str,
        name: &str,
        ips: Option<&[IpAddr]>,
        released: &[IpAddr],
    ) -> Option<tokio::task::JoinHandle<()>> {
        let controller = self.controller.upgrade()?;
        let key = ObjectKey::new(namespace, name);
        let ips = ips.map(|ips| ips.iter().map(IpAddr::to_string).collect::<Vec<_>>());
        let released: Vec<String> = released.iter().map(IpAddr::to_string).collect();
        // Guest calls are synchronous: off the async runtime.
        Some(tokio::task::spawn_blocking(move || {
            let mut controller = controller.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = controller.set_pod_network(&key, ips, &released) {
                tracing::error!(pod = %key, "applying the pod's addresses: {e}");
            }
        }))
    }
}

impl PodNetworkSink for ModelPodNetworks {
    /// Done once the pod's addresses are in the model and its rules (policy dispatch, peer
    /// sets, host ports) in the kernel: the ADD answers after that.
    fn pod_network_added(&self, namespace: &str, name: &str, ips: &[IpAddr]) -> BoxFuture<'static, ()> {
        let written = self.update(namespace, name, Some(ips), &[]);
        Box::pin(async move {
            if let Some(written) = written {
                let _ = written.await;
            }
        })
    }

    fn pod_network_removed(&self, namespace: &str, name: &str, ips: &[IpAddr]) {
        self.update(namespace, name, None, ips);
    }
}

/// The daemon's configuration: the host's, with the pod CIDRs it settled on.
fn daemon_config(
    config: &CniConfig,
    pod_cidrs: Vec<ipnet::IpNet>,
    data_dir: Option<PathBuf>,
) -> wasmplane_cni::DaemonConfig {
    let state_dir = config
        .state_dir
        .clone()
        .or_else(|| data_dir.map(|d| d.join("cni")))
        .unwrap_or_else(|| PathBuf::from("/var/lib/wasmplane/cni"));
    let mut daemon_config = wasmplane_cni::DaemonConfig::new(pod_cidrs, state_dir);
    daemon_config.socket_path = config.socket.clone();
    daemon_config.pod_wait_timeout = config.pod_wait;
    daemon_config.host_netns = config.node_netns.clone();
    daemon_config.chained = config.chained;
    daemon_config.mtu = config.mtu;
    daemon_config
}

/// The daemon while it serves, for the host's status (`GET /v1/status`).
pub type ServingDaemon = Arc<Mutex<Option<Arc<wasmplane_cni::CniDaemon>>>>;

/// Starts the daemon once the pod CIDRs are known (from the flag, or from this node's Node
/// object when the watch delivers it), at once when `chained` after the plugin that gives
/// pods their addresses (it needs none). `synced`: the host's readiness, for STATUS.
pub async fn run(
    config: CniConfig,
    data_dir: Option<PathBuf>,
    controller: Arc<Mutex<Controller>>,
    synced: Arc<AtomicBool>,
    serving: ServingDaemon,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let chained = config.chained;
    let pod_cidrs = if chained {
        Vec::new()
    } else if config.pod_cidrs.is_empty() {
        loop {
            let known: Vec<ipnet::IpNet> = {
                let c = controller.lock().unwrap_or_else(|p| p.into_inner());
                c.model().context.pod_cidrs.iter().filter_map(|c| c.parse().ok()).collect()
            };
            if !known.is_empty() {
                break known;
            }
            tokio::select! {
                _ = &mut stop => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    } else {
        config.pod_cidrs.clone()
    };
    let daemon_config = daemon_config(&config, pod_cidrs.clone(), data_dir);
    let daemon = match wasmplane_cni::CniDaemon::new(
        daemon_config,
        Arc::new(ModelPods::new(&controller, synced)),
        Arc::new(ModelPodNetworks::new(&controller)),
    ) {
        Ok(daemon) => daemon,
        Err(e) => {
            tracing::error!("starting the CNI daemon: {e}");
            return;
        }
    };
    match daemon.clone().spawn().await {
        Ok(handle) => {
            let mtu = daemon.pod_mtu().map_or_else(|| "the other plugin's".to_string(), ToString::to_string);
            tracing::info!(socket = %config.socket.display(), ?pod_cidrs, chained, %mtu, "CNI daemon serving");
            *serving.lock().unwrap_or_else(|p| p.into_inner()) = Some(daemon.clone());
            // Serve until the host stops (or drops) us; then the requests taken are answered
            // and the socket goes, so the plugin is told at once that no daemon listens.
            let _ = stop.await;
            serving.lock().unwrap_or_else(|p| p.into_inner()).take();
            handle.shutdown().await;
            tracing::info!("CNI daemon stopped");
        }
        Err(e) => tracing::error!("starting the CNI daemon: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the host was given reaches the daemon: the MTU as given, or none to detect.
    #[test]
    fn the_daemon_gets_the_hosts_settings() {
        let mut config = CniConfig {
            socket: "/run/x.sock".into(),
            pod_cidrs: Vec::new(),
            state_dir: None,
            pod_wait: Duration::from_secs(3),
            node_netns: Some("/var/run/netns/n".into()),
            chained: false,
            mtu: Some(1450),
        };
        let cidrs = vec!["10.244.1.0/24".parse().unwrap()];
        let d = daemon_config(&config, cidrs.clone(), Some("/data".into()));
        assert_eq!(
            (d.socket_path, d.state_dir, d.pod_cidrs),
            ("/run/x.sock".into(), "/data/cni".into(), cidrs.clone())
        );
        assert_eq!(
            (d.pod_wait_timeout, d.host_netns, d.chained, d.mtu),
            (Duration::from_secs(3), Some("/var/run/netns/n".into()), false, Some(1450))
        );
        config.mtu = None;
        config.chained = true;
        let d = daemon_config(&config, Vec::new(), None);
        assert_eq!((d.chained, d.mtu, d.state_dir), (true, None, "/var/lib/wasmplane/cni".into()));
    }
}
