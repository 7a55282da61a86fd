//! `wasmplane run --role operator`: the cluster-wide duties of `wasmplane-operator` (heartbeat,
//! policy-status aggregation, service sync, GC) run by the replica that holds the Kubernetes
//! Lease; in embedded mode the single process leads. GC decisions come from the GC guest in
//! force cluster-wide (an uploaded module of kind `gc`, else the builtin), which names what
//! to delete among the candidates it is offered.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use wasmplane_kvstore::KvStore;
use wasmplane_operator::{
    CandidateKind, DeciderError, GarbageCollector, GcCandidate, GcConfig, GcDecider, GcStats, HEARTBEAT_KEY,
    LeaderElectionConfig, LeaderElector, Leadership, MeshSliceConfig, Operator, OperatorConfig, PolicySummary,
    RemoteExports, ServiceSyncConfig, write_heartbeats,
};
use wasmplane_runtime::gc::{Candidate, CandidateKind as WitKind, GcSession};
use wasmplane_runtime::{GuestKind, Runtime};

use crate::clustermesh::{ExportFollowing, Following, RemoteClusters};
use crate::module_objects::ModuleObjectsConfig;
use crate::module_store::ModuleStore;
use crate::modules::Modules;

/// Name of the builtin GC guest.
pub use crate::controller::BUILTIN_GC;

#[derive(Clone, Debug)]
pub struct OperatorRoleConfig {
    /// This replica's identity in the Lease (the pod name in-cluster).
    pub identity: String,
    pub lease_namespace: String,
    pub lease_name: String,
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    /// Sync Services annotated for sharing under this cluster name (none: not synced).
    pub cluster_name: Option<String>,
    pub gc_interval: Duration,
    pub gc_deletes_per_second: f64,
    /// Reconcile `WasmModule` objects into the module index (with an API server).
    pub module_objects: crate::module_objects::ModuleObjectsConfig,
    /// The remote clusters whose endpoints of global Services get EndpointSlices here
    /// (`None`: none are written). Needs `cluster_name` and an API server.
    pub mesh_slices: Option<crate::clustermesh::ClusterMeshConfig>,
}

impl Default for OperatorRoleConfig {
    fn default() -> Self {
        OperatorRoleConfig {
            identity: "wasmplane-operator".into(),
            lease_namespace: "kube-system".into(),
            lease_name: "wasmplane-operator".into(),
            lease_duration: Duration::from_secs(15),
            heartbeat_interval: Duration::from_secs(60),
            cluster_name: None,
            gc_interval: Duration::from_secs(60),
            gc_deletes_per_second: 10.0,
            module_objects: crate::module_objects::ModuleObjectsConfig::default(),
            mesh_slices: None,
        }
    }
}

/// The GC guest as the collector's decider. Before each decision it makes sure it runs the
/// module the shared index has in force for `gc` (uploads reach the operator like any host).
struct WasmGcDecider {
    runtime: Arc<Runtime>,
    store: ModuleStore,
    handle: tokio::runtime::Handle,
    /// Digest (or the builtin's name) and settings of the module the session runs.
    current: Option<(String, GcSession)>,
    max_module_bytes: usize,
    /// This host's signatures and grants, checked on the version in force as the
    /// controller checks translators and policies.
    admission: Arc<crate::admission::Admission>,
}

/// The GC module the index puts in force (see [`WasmGcDecider::wanted`]).
struct Wanted {
    identity: String,
    name: String,
    settings: String,
    uploaded: Option<Uploaded>,
}

/// An uploaded GC module's bytes, and its name and signature for this host's admission.
struct Uploaded {
    name: String,
    bytes: bytes::Bytes,
    signature: Option<String>,
}

impl WasmGcDecider {
    /// What to run: `name@version`, an identity of the module and its settings (digest and
    /// settings: either changed needs a new session), the settings, and the uploaded bytes
    /// with what admission needs (none: the builtin, or the session in use is it).
    fn wanted(&self) -> Result<Wanted, DeciderError> {
        let store = self.store.clone();
        // Called on a blocking thread (the collector calls deciders off the async workers).
        let (index, _) =
            self.handle.block_on(store.load()).map_err(|e| DeciderError(format!("reading the module index: {e}")))?;
        let Some((name, version)) = index.in_force(GuestKind::Gc) else {
            let settings = index
                .settings
                .get(BUILTIN_GC)
                .map_or_else(|| wasmplane_runtime::NO_SETTINGS.to_string(), |v| v.to_string());
            return Ok(Wanted {
                identity: format!("{BUILTIN_GC} {settings}"),
                name: BUILTIN_GC.into(),
                settings,
                uploaded: None,
            });
        };
        let settings =
            index.settings.get(name).map_or_else(|| wasmplane_runtime::NO_SETTINGS.to_string(), |v| v.to_string());
        let record = index
            .modules
            .get(name)
            .and_then(|m| m.version(version))
            .ok_or_else(|| DeciderError(format!("module {name}@{version} is in force but not in the index")))?;
        let identity = format!("{} {settings}", record.digest);
        if self.current.as_ref().is_some_and(|(current, _)| *current == identity) {
            return Ok(Wanted { identity, name: name.to_string(), settings, uploaded: None });
        }
        let bytes = self
            .handle
            .block_on(self.store.get_blob(&record.digest))
            .map_err(|e| DeciderError(format!("fetching {name}@{version}: {e}")))?;
        Ok(Wanted {
            identity,
            name: format!("{name}@{version}"),
            settings,
            uploaded: Some(Uploaded { name: name.to_string(), bytes, signature: record.signature.clone() }),
        })
    }

    fn session(&mut self) -> Result<&mut GcSession, DeciderError> {
        let Wanted { identity, name, settings, uploaded } = self.wanted()?;
        if self.current.as_ref().is_none_or(|(current, _)| *current != identity) {
            let bytes: &[u8] = uploaded.as_ref().map_or(wasmplane_guest_artifacts::GC, |u| &u.bytes);
            let module = self
                .runtime
                .load_gc(&name, bytes, self.max_module_bytes)
                .map_err(|e| DeciderError(format!("loading GC module {name}: {e}")))?
                .with_settings(&settings);
            if let Some(u) = &uploaded {
                self.admission
                    .admit(&u.name, &module.info, &u.bytes, u.signature.as_deref())
                    .map_err(|e| DeciderError(format!("GC module {name} refused on this host: {e}")))?;
            }
            // Checked where they are set; settings that reach the index another way (written
            // to etcd by hand, a host of an older version) are refused here too.
            match module.validate_settings(&settings) {
                Ok(wasmplane_runtime::SettingsVerdict::Invalid(reason)) => {
                    return Err(DeciderError(format!("GC module {name} refuses its settings: {reason}")));
                }
                Err(e) => return Err(DeciderError(format!("GC module {name}: its settings validator failed: {e}"))),
                Ok(_) => {}
            }
            tracing::info!(module = %name, "GC decisions by this module");
            self.current = Some((identity, module.session()));
        }
        Ok(&mut self.current.as_mut().expect("just set").1)
    }
}

fn wit_kind(kind: CandidateKind) -> WitKind {
    match kind {
        CandidateKind::StaleNode => WitKind::StaleNode,
        CandidateKind::NodeStatus => WitKind::NodeStatus,
        CandidateKind::PolicyStatus => WitKind::PolicyStatus,
        CandidateKind::ServiceSync => WitKind::ServiceSync,
        CandidateKind::Lock => WitKind::Lock,
        CandidateKind::ModuleVersion => WitKind::ModuleVersion,
    }
}

impl GcDecider for WasmGcDecider {
    fn collect(&mut self, candidates: &[GcCandidate]) -> Result<Vec<String>, DeciderError> {
        let offered: Vec<Candidate> = candidates
            .iter()
            .map(|c| Candidate {
                key: c.key.clone(),
                kind: wit_kind(c.kind),
                age_seconds: c.age.as_secs(),
                owner_exists: c.owner_exists,
            })
            .collect();
        let result = self.session()?.collect(&offered);
        result.map_err(|e| {
            // A failed instance is not reused; a broken module is tried again next cycle.
            DeciderError(format!("GC guest: {e}"))
        })
    }
}

/// Collects module versions every `interval`, for as long as it runs (errors: next cycle).
async fn module_gc_loop(
    store: ModuleStore,
    decider: Arc<Mutex<dyn GcDecider>>,
    interval: Duration,
    deletes_per_second: f64,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Err(e) = crate::module_gc::collect_module_versions(&store, &decider, deletes_per_second).await {
            tracing::warn!("module version GC cycle failed: {e}");
        }
    }
}

/// The running operator role; dropping it stops every duty.
pub struct OperatorRole {
    operator: Option<Operator>,
    /// The remote clusters followed for the mesh EndpointSlices (by every replica: a new
    /// leader has their exports at hand).
    _remote_clusters: Option<crate::clustermesh::RemoteClusters>,
    /// Taken by [`OperatorRole::shutdown`], which releases its Lease.
    elector: Mutex<Option<LeaderElector>>,
    leadership: Leadership,
    embedded: Vec<tokio::task::JoinHandle<()>>,
    /// What GC did while this process led.
    gc_stats: Arc<GcStats>,
}

impl Drop for OperatorRole {
    fn drop(&mut self) {
        for task in &self.embedded {
            task.abort();
        }
    }
}

impl OperatorRole {
    /// `client`: the API server (leader election on a Lease, status writes, service sync);
    /// none (embedded): this process leads, and runs the heartbeat and GC only.
    /// `modules`: the cluster's module index, where `WasmModule` objects are uploaded.
    pub async fn start(
        kv: Arc<dyn KvStore>,
        client: Option<kube::Client>,
        runtime: Arc<Runtime>,
        modules: Arc<Modules>,
        max_module_bytes: usize,
        config: OperatorRoleConfig,
    ) -> anyhow::Result<OperatorRole> {
        let decider: Arc<Mutex<dyn GcDecider>> = Arc::new(Mutex::new(WasmGcDecider {
            runtime,
            store: ModuleStore::new(kv.clone()),
            handle: tokio::runtime::Handle::current(),
            current: None,
            max_module_bytes,
            admission: modules.admission().clone(),
        }));
        let module_gc = {
            let (store, decider, interval, rate) =
                (ModuleStore::new(kv.clone()), decider.clone(), config.gc_interval, config.gc_deletes_per_second);
            move || module_gc_loop(store.clone(), decider.clone(), interval, rate)
        };
        let gc_stats = Arc::new(GcStats::default());
        let gc = GcConfig {
            interval: config.gc_interval,
            deletes_per_second: config.gc_deletes_per_second,
            service_sync: config.cluster_name.clone().map(ServiceSyncConfig::new),
            stats: gc_stats.clone(),
            ..GcConfig::default()
        };
        match client {
            Some(client) => {
                let election = LeaderElectionConfig::new(&config.lease_namespace, &config.lease_name, &config.identity)
                    .with_lease_duration(config.lease_duration);
                let elector = LeaderElector::start(client.clone(), election).context("starting leader election")?;
                let leadership = elector.leadership();
                let (mut remote_clusters, mut mesh_slices) = (None, None);
                if let (Some(mesh), Some(cluster)) = (&config.mesh_slices, &config.cluster_name) {
                    let (exports, received) = RemoteExports::new();
                    let follow = move |name: &str, etcd| {
                        Box::new(ExportFollowing::start(name, etcd, exports.clone())) as Box<dyn Following>
                    };
                    remote_clusters = Some(RemoteClusters::start(mesh.clone(), cluster, Box::new(follow)).await?);
                    mesh_slices = Some(MeshSliceConfig::new(received));
                }
                let operator_config = OperatorConfig {
                    heartbeat_interval: config.heartbeat_interval,
                    service_sync: config.cluster_name.clone().map(ServiceSyncConfig::new),
                    mesh_slices,
                    gc,
                    ..OperatorConfig::new(config.identity.clone())
                };
                let operator = Operator::start(kv, client.clone(), leadership.clone(), Some(decider), operator_config)
                    .await
                    .context("starting the operator duties")?;
                let module_gc = {
                    let leadership = leadership.clone();
                    tokio::spawn(async move {
                        leadership.run_while_leading("module-gc", Duration::from_secs(1), module_gc).await
                    })
                };
                let module_objects = {
                    let leadership = leadership.clone();
                    let objects = ModuleObjectsConfig {
                        max_module_bytes: max_module_bytes as u64,
                        ..config.module_objects.clone()
                    };
                    let duty = move || {
                        let (client, modules, objects) = (client.clone(), modules.clone(), objects.clone());
                        async move {
                            if let Err(e) = crate::module_objects::run(client, modules, objects).await {
                                tracing::warn!("WasmModule objects: {e}");
                            }
                        }
                    };
                    tokio::spawn(async move {
                        leadership.run_while_leading("module-objects", Duration::from_secs(5), duty).await
                    })
                };
                Ok(OperatorRole {
                    operator: Some(operator),
                    _remote_clusters: remote_clusters,
                    elector: Mutex::new(Some(elector)),
                    leadership,
                    embedded: vec![module_gc, module_objects],
                    gc_stats,
                })
            }
            None => {
                let mut collector = GarbageCollector::new(kv.clone(), None, decider, gc).context("configuring GC")?;
                let embedded = vec![
                    tokio::spawn(write_heartbeats(
                        kv,
                        HEARTBEAT_KEY.into(),
                        config.identity.clone(),
                        config.heartbeat_interval,
                    )),
                    tokio::spawn(async move { collector.run().await }),
                    tokio::spawn(module_gc()),
                ];
                Ok(OperatorRole {
                    operator: None,
                    _remote_clusters: None,
                    elector: Mutex::new(None),
                    leadership: Leadership::always(),
                    embedded,
                    gc_stats,
                })
            }
        }
    }

    /// Stops campaigning and, when leading, stops the duties and releases the Lease, so that
    /// another replica leads at once instead of when the lease expires (client-go's
    /// `ReleaseOnCancel`, what a rolling update of the operator needs). A second call does
    /// nothing more.
    pub async fn shutdown(&self) {
        let elector = self.elector.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(elector) = elector
            && let Err(e) = elector.shutdown().await
        {
            tracing::warn!("releasing the leader lease: {e}");
        }
        for task in &self.embedded {
            task.abort();
        }
    }

    /// GC's counts over this process's leading terms (`GET /v1/operator`, `/metrics`).
    pub fn gc_stats(&self) -> &Arc<GcStats> {
        &self.gc_stats
    }

    pub fn is_leader(&self) -> bool {
        self.leadership.is_leader()
    }

    /// A policy's status aggregated over every node (`None`: unknown, or embedded mode).
    pub fn policy_status(&self, namespace: &str, name: &str) -> Option<PolicySummary> {
        self.operator.as_ref()?.policy_status(namespace, name)
    }
}
