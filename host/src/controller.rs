//! The controller: cluster state in, guests run on what changed, validated rules out.
//!
//! One `Controller` behind a mutex owns the model, the module registry, the active guest
//! session and the dataplane writer. Guest calls are synchronous; callers run controller
//! operations on blocking threads.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use wasmplane_model::state::{ClusterEvent, ClusterObject, ModelUpdate, NoLocalEndpoints, ServiceView, Touched};
use wasmplane_model::{ClusterState, CompactString, IntoModel, NodeLocalModel, ObjectKey, Pod, ToStd};
use wasmplane_runtime::{
    CallError, GuestKind, LoadError, LoadedModule, ModuleInfo, NoLookups, Runtime, SettingsVerdict, TranslatorSession,
};
use wasmplane_sources::kube::SourceEvent;

use crate::dataplane::{Dataplane, Kernel, SyncStats, WriteError};
use crate::metrics::Metrics;
use crate::nft::{self, ObjectRules};
use crate::policy::PolicyController;
use crate::registry::{ModuleRecord, Registry, RegistryError, SharedIndex, valid_module_name};
use crate::shadow::ShadowRun;

/// The builtin service translator's module name.
pub const BUILTIN_SERVICE_TRANSLATOR: &str = "default-service-translator";
/// The network-policy guest shipped in the host.
pub const BUILTIN_NETWORK_POLICY: &str = "default-network-policy";
/// The GC guest shipped in the host: run by the operator role only, so never compiled by a
/// controller unless its settings are checked.
pub const BUILTIN_GC: &str = "default-gc";

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("activation of {module} failed, the previous module stays in force: {reason}")]
    ActivationFailed { module: String, reason: String },
    /// The module's own validator (`settings-validation`) refused the settings.
    #[error("settings refused by {module}: {reason}")]
    SettingsRefused { module: String, reason: String },
    #[error("writing the dataplane: {0}")]
    Write(#[from] WriteError),
    #[error("storage: {0}")]
    Storage(#[from] std::io::Error),
    #[error("module store: {0}")]
    Store(#[from] crate::module_store::StoreError),
    #[error("upload refused: {0}")]
    Admission(#[from] crate::admission::AdmissionError),
    #[error("{0}")]
    Internal(String),
}

impl From<RegistryError> for HostError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::NotFound(m) => HostError::NotFound(m),
            RegistryError::Conflict(m) => HostError::Conflict(m),
            RegistryError::BadRequest(m) => HostError::BadRequest(m),
        }
    }
}

struct ActiveTranslator {
    name: String,
    version: u32,
    /// The settings its session runs with.
    settings: Arc<str>,
    session: TranslatorSession,
}

/// The service translator in force, as observers are told of it.
#[derive(Clone, Copy, Debug)]
pub struct TranslatorInForce<'a> {
    pub name: &'a str,
    pub version: u32,
    /// Its settings document (`{}` when none).
    pub settings: &'a str,
}

/// Told about every model revision, in order, while the controller lock is held (so a
/// reader taking that lock sees a model consistent with what it was told).
pub trait ModelObserver: Send {
    fn model_changed(&self, model: &NodeLocalModel, update: &ModelUpdate);
    /// Then what the translator in force made of that revision's services: new rules (`None`:
    /// deleted) in `changes`, a failure in `errors` (the recorder in `record.rs` keeps both).
    fn translated(
        &self,
        _translator: Option<TranslatorInForce<'_>>,
        _changes: &[(ObjectKey, Option<ObjectRules>)],
        _errors: &BTreeMap<ObjectKey, String>,
    ) {
    }
}

/// kube-proxy's `--detect-local-mode`: which traffic comes from pods (not masqueraded to a
/// cluster IP, short-circuited to the cluster's endpoints for externalTrafficPolicy Local).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LocalDetection {
    /// From the configured cluster CIDRs (`--cluster-cidr`).
    #[default]
    ClusterCidr,
    /// From this node's pod CIDRs, from its Node object: nothing to configure.
    NodeCidr,
    /// In through an interface whose name starts with this (`--pod-interface-name-prefix`).
    /// Guests built against WIT 1.0, which cannot say "pod traffic", get the configured
    /// cluster CIDRs as in `ClusterCidr`.
    InterfaceNamePrefix(String),
    /// In through this bridge (`--pod-bridge-interface`); 1.0 guests as above.
    BridgeInterface(String),
}

impl LocalDetection {
    /// How the dataplane's rules tell pod traffic: by the `cluster-cidrs` sets (which hold
    /// the cluster's or the node's pod CIDRs) or by interface.
    pub fn pod_traffic(&self) -> nft::PodTraffic {
        match self {
            LocalDetection::ClusterCidr | LocalDetection::NodeCidr => nft::PodTraffic::SourceAddress,
            LocalDetection::InterfaceNamePrefix(prefix) => nft::PodTraffic::InterfacePrefix(prefix.clone()),
            LocalDetection::BridgeInterface(bridge) => nft::PodTraffic::Bridge(bridge.clone()),
        }
    }
}

pub struct ControllerConfig {
    pub node_name: String,
    pub cluster_cidrs: Vec<String>,
    /// Where local traffic comes from (`--detect-local-mode`).
    pub local_detection: LocalDetection,
    /// The cluster's service CIDRs: unallocated addresses in them are dropped.
    pub service_cidrs: Vec<String>,
    /// Masquerade every connection to a cluster IP (kube-proxy's `--masquerade-all`).
    pub masquerade_all: bool,
    /// Masquerade pods' traffic out of the cluster (`--egress-masquerade`); with no sources,
    /// they are this node's pod CIDRs from its Node object.
    pub egress_masquerade: Option<nft::EgressMasquerade>,
    pub max_module_bytes: usize,
    pub crash_budget: CrashBudget,
    /// Services per nftables shard table (see `nft::Layout`).
    pub services_per_shard: usize,
    /// Where node ports are served (`--nodeport-addresses`).
    pub node_port_addresses: nft::NodePortAddresses,
    /// Signatures and grants, checked before any uploaded version runs here.
    pub admission: Arc<crate::admission::Admission>,
    /// Where policy drops and audit verdicts are logged (`--policy-log-group`; `None`: not).
    pub policy_verdict_log: Option<nft::policy::VerdictLog>,
}

pub struct Controller {
    runtime: Arc<Runtime>,
    metrics: Arc<Metrics>,
    cluster: ClusterState,
    model: NodeLocalModel,
    registry: Registry,
    translator: Option<ActiveTranslator>,
    dataplane: Dataplane,
    /// Last translation error per service (its last good rules stay applied).
    service_errors: BTreeMap<ObjectKey, String>,
    max_module_bytes: usize,
    /// Checked again on every version the shared index puts in force, wherever it was
    /// uploaded: whoever can write the kvstore (another host with laxer settings, a stolen
    /// etcd credential) cannot run here what this host's keys and grants do not allow.
    admission: Arc<crate::admission::Admission>,
    observers: Vec<Box<dyn ModelObserver>>,
    crash_budget: CrashBudget,
    /// Crashes of the translator in force within the budget's window.
    recent_crashes: std::collections::VecDeque<Instant>,
    /// Asked once per activation; cleared when another version is put in force.
    rollback_requested: bool,
    rollback_sink: Option<tokio::sync::mpsc::UnboundedSender<RollbackRequest>>,
    /// Egress masquerade is on without configured pod CIDRs: its sources follow the Node's.
    egress_follows_node: bool,
    /// A translator version running beside the one in force, output never written.
    shadow: Option<ShadowRun>,
    /// Pod addresses the CNI daemon assigned, used until the API server reports them.
    cni_ips: BTreeMap<ObjectKey, Vec<CompactString>>,
    /// Network policy: the builtin policy guest on the policies each update touches.
    policy: PolicyController,
    /// Services whose `Local` traffic policies find no endpoint here (see
    /// [`ServiceView::without_local_endpoints`]), kept per change for the gauges.
    without_local: BTreeMap<ObjectKey, NoLocalEndpoints>,
    /// Slice changes of the batch being applied, by service, with when each was triggered:
    /// observed as network programming latency once their service's rules are written.
    trigger_times: Vec<(ObjectKey, SystemTime)>,
    /// Trigger times before this are not observed: the initial list holds changes made
    /// before this host could program them (kube-proxy's `trackerStartTime`).
    programming_since: SystemTime,
}

/// Why a guest call gave no rules.
#[derive(Debug, Clone)]
enum CallFailure {
    /// The guest broke the rules (trap, limit, invalid output): counts against its crash budget.
    Crash(String),
    /// The guest declined this object with its own error: its decision, not a crash.
    Declined(String),
}

impl CallFailure {
    fn message(&self) -> &str {
        match self {
            CallFailure::Crash(m) | CallFailure::Declined(m) => m,
        }
    }
}

/// Rendered for `dataplane`: its `pod-traffic` detection (by the cluster CIDRs it has now),
/// and its drop chain for no-endpoint drops when it logs service drops (see
/// `nft::service_drops`).
fn translate_one(
    session: &mut TranslatorSession,
    model: &NodeLocalModel,
    key: &ObjectKey,
    view: &ServiceView,
    dataplane: &Dataplane,
) -> Result<ObjectRules, CallFailure> {
    let out = session.translate_output(&model.context, &nft::service_prefix(key), view).map_err(|e| match e {
        // The host refusing the object's inputs is no failure of the guest's.
        CallError::Guest(_) | CallError::Input(_) => CallFailure::Declined(e.to_string()),
        other => CallFailure::Crash(other.to_string()),
    })?;
    let mut rules = nft::validate_translated(key, &out, dataplane.pod_detection())
        .map_err(|e| CallFailure::Crash(e.to_string()))?;
    rules.created_unix = view.service.created_unix;
    if dataplane.logs_service_drops() {
        nft::service_drops::route_drops_through_log(&mut rules);
    }
    Ok(rules)
}

/// What the host makes of a module's verdict on the settings it would run with: refused
/// settings, or a validator that traps or breaks a limit, are refused; a module without a
/// validator has no say here (running it on this host's state is the check).
fn settings_verdict(module: &str, verdict: Result<SettingsVerdict, CallError>) -> Result<(), HostError> {
    let refused = |reason| Err(HostError::SettingsRefused { module: module.to_string(), reason });
    match verdict {
        Ok(SettingsVerdict::Valid | SettingsVerdict::NotImplemented) => Ok(()),
        Ok(SettingsVerdict::Invalid(reason)) => refused(reason),
        Err(e) => refused(format!("its settings validator failed: {e}")),
    }
}

/// How many crashes of the module in force are tolerated within a window before it is
/// rolled back to its last good version.
#[derive(Clone, Copy, Debug)]
pub struct CrashBudget {
    pub max_crashes: usize,
    pub window: std::time::Duration,
}

impl Default for CrashBudget {
    fn default() -> Self {
        CrashBudget { max_crashes: 5, window: std::time::Duration::from_secs(60) }
    }
}

/// The module in force ran out of its crash budget: the module layer rolls it back
/// cluster-wide (see `modules.rs`).
#[derive(Debug, Clone)]
pub struct RollbackRequest {
    pub kind: GuestKind,
    pub module: String,
    pub version: u32,
    pub reason: String,
}

impl Controller {
    pub fn new(
        runtime: Arc<Runtime>,
        metrics: Arc<Metrics>,
        kernel: Box<dyn Kernel>,
        data_dir: Option<&Path>,
        config: ControllerConfig,
    ) -> Result<Controller, HostError> {
        let mut registry = Registry::open(data_dir)?;
        let builtin = runtime.load(
            BUILTIN_SERVICE_TRANSLATOR,
            wasmplane_guest_artifacts::SERVICE_TRANSLATOR,
            Some(GuestKind::ServiceTranslator),
            usize::MAX,
        )?;
        registry.add_builtin(
            BUILTIN_SERVICE_TRANSLATOR,
            GuestKind::ServiceTranslator,
            &builtin.info,
            wasmplane_guest_artifacts::SERVICE_TRANSLATOR,
        );
        let policy_module =
            runtime.load_policy(BUILTIN_NETWORK_POLICY, wasmplane_guest_artifacts::NETWORK_POLICY, usize::MAX)?;
        registry.add_builtin(
            BUILTIN_NETWORK_POLICY,
            GuestKind::NetworkPolicy,
            &policy_module.info,
            wasmplane_guest_artifacts::NETWORK_POLICY,
        );
        // Listed and configured here, run by the operator: described, not compiled.
        registry.add_builtin(
            BUILTIN_GC,
            GuestKind::Gc,
            &wasmplane_runtime::describe(wasmplane_guest_artifacts::GC)?,
            wasmplane_guest_artifacts::GC,
        );
        let health = metrics.dataplane_health.clone();
        let service_cidrs = crate::dataplane::parse_cidrs("service-cidrs", &config.service_cidrs);
        let model = match config.local_detection {
            LocalDetection::NodeCidr => {
                NodeLocalModel::new(&config.node_name, Vec::new()).with_node_cidr_local_detection()
            }
            LocalDetection::ClusterCidr
            | LocalDetection::InterfaceNamePrefix(_)
            | LocalDetection::BridgeInterface(_) => {
                NodeLocalModel::new(&config.node_name, config.cluster_cidrs.clone().into_model())
            }
        }
        .with_service_cidrs(service_cidrs.clone());
        // The model's context decides which CIDRs are local; the dataplane starts from it.
        let dataplane = Dataplane::new(kernel)
            .with_cluster_cidrs(&model.context.cluster_cidrs)
            .with_pod_traffic(config.local_detection.pod_traffic());
        let mut controller = Controller {
            runtime,
            metrics,
            cluster: ClusterState::new(),
            model,
            registry,
            translator: None,
            dataplane: dataplane
                .with_services_per_shard(config.services_per_shard)
                .with_service_cidrs(service_cidrs)
                .with_masquerade_all(config.masquerade_all)
                .with_egress_masquerade(config.egress_masquerade.clone())
                .with_node_port_addresses(config.node_port_addresses)
                .with_service_drop_log(config.policy_verdict_log)
                .with_health(health),
            service_errors: BTreeMap::new(),
            max_module_bytes: config.max_module_bytes,
            admission: config.admission,
            observers: Vec::new(),
            crash_budget: config.crash_budget,
            recent_crashes: Default::default(),
            rollback_requested: false,
            rollback_sink: None,
            egress_follows_node: config.egress_masquerade.as_ref().is_some_and(|egress| egress.sources.is_empty()),
            shadow: None,
            cni_ips: BTreeMap::new(),
            policy: PolicyController::new(&policy_module).with_verdict_log(config.policy_verdict_log),
            without_local: BTreeMap::new(),
            trigger_times: Vec::new(),
            programming_since: SystemTime::now(),
        };
        controller.registry.mark_active(GuestKind::NetworkPolicy, BUILTIN_NETWORK_POLICY, 1);
        // The builtin until the shared module index (kvstore) says otherwise (compiled above
        // already: a second load would compile it again when there is no disk cache).
        controller.activate_loaded(BUILTIN_SERVICE_TRANSLATOR, 1, builtin)?;
        Ok(controller)
    }

    pub fn model(&self) -> &NodeLocalModel {
        &self.model
    }

    pub fn dataplane(&self) -> &Dataplane {
        &self.dataplane
    }

    pub fn service_errors(&self) -> &BTreeMap<ObjectKey, String> {
        &self.service_errors
    }

    pub fn modules(&self) -> Vec<ModuleRecord> {
        self.registry.list()
    }

    pub fn module(&self, name: &str) -> Option<ModuleRecord> {
        self.registry.get(name)
    }

    pub fn in_force(&self, kind: GuestKind) -> Option<String> {
        self.registry.in_force(kind).map(str::to_string)
    }

    /// A relist or manifest reload: the whole state, applied as its difference.
    pub fn replace_objects(&mut self, mut objects: Vec<ClusterObject>) -> Result<(), HostError> {
        self.metrics.events.inc_by(objects.len() as u64);
        objects.iter_mut().for_each(|o| self.fill_pod_ips(o));
        objects.iter().for_each(|o| self.note_trigger_time(o));
        let node = self.model.node_name().to_string();
        let touched = self.cluster.replace_all(objects, &node);
        let update = self.model.update(&self.cluster, &touched);
        self.run_update(update)?;
        // A manifest set is the complete state: an unchanged (or empty) one still ends the
        // hold on the rules a previous run left in the kernel.
        self.release_dataplane()
    }

    /// The sources have delivered a complete state: write it even if nothing changed.
    pub fn release_dataplane(&mut self) -> Result<(), HostError> {
        if self.dataplane.is_held() {
            self.full_write(Dataplane::release)?;
        }
        Ok(())
    }

    /// A batch from the Kubernetes watchers, applied as one model update (one revision at
    /// most, however many events it holds).
    pub fn apply_source(&mut self, batch: Vec<SourceEvent>) -> Result<(), HostError> {
        let started = Instant::now();
        let node = self.model.node_name().to_string();
        let mut touched = Touched::default();
        for event in batch {
            match event {
                SourceEvent::Events(events) => {
                    self.metrics.events.inc_by(events.len() as u64);
                    for mut event in events {
                        if let ClusterEvent::Upsert(object) = &mut event {
                            self.fill_pod_ips(object);
                            self.note_trigger_time(object);
                        }
                        touched.merge(self.cluster.apply(event, &node));
                    }
                }
                SourceEvent::Relisted { kind, mut objects, unconvertible } => {
                    self.metrics.events.inc_by(objects.len() as u64);
                    objects.iter_mut().for_each(|o| self.fill_pod_ips(o));
                    objects.iter().for_each(|o| self.note_trigger_time(o));
                    touched.merge(self.cluster.replace_kind(kind, objects, &unconvertible, &node));
                }
            }
        }
        let update = self.model.update(&self.cluster, &touched);
        let result = self.run_update(update);
        self.metrics.source_apply_seconds.observe(started.elapsed().as_secs_f64());
        result
    }

    /// The CNI daemon gave a pod these addresses (`Some`), or released `released` (`None`):
    /// the model has them at once, not only when the kubelet reports them.
    pub fn set_pod_network(
        &mut self,
        key: &ObjectKey,
        ips: Option<Vec<String>>,
        released: &[String],
    ) -> Result<(), HostError> {
        let ips = ips.map(IntoModel::into_model);
        let was_released = |ip: &_| released.iter().any(|r| r == ip);
        match &ips {
            Some(ips) => {
                self.cni_ips.insert(key.clone(), ips.clone());
            }
            // A recreated pod may have new addresses already: forget only the released ones.
            None if self.cni_ips.get(key).is_some_and(|current| current.iter().all(was_released)) => {
                self.cni_ips.remove(key);
            }
            None => return Ok(()),
        }
        let Some(pod) = self.cluster.pods.get(key) else { return Ok(()) };
        let mut pod = (**pod).clone();
        match ips {
            Some(ips) if pod.ips != ips => pod.ips = ips,
            None if pod.ips.iter().any(was_released) => pod.ips.clear(),
            _ => return Ok(()),
        }
        let node = self.model.node_name().to_string();
        let touched = self.cluster.apply(ClusterEvent::Upsert(ClusterObject::Pod(pod)), &node);
        let update = self.model.update(&self.cluster, &touched);
        self.run_update(update)
    }

    /// A pod the API server reports without addresses yet keeps the ones the CNI daemon gave it.
    fn fill_pod_ips(&self, object: &mut ClusterObject) {
        if let ClusterObject::Pod(pod) = object
            && pod.ips.is_empty()
            && let Some(ips) = self.cni_ips.get(&pod.key())
        {
            pod.ips = ips.clone();
        }
    }

    /// Notes a slice's trigger time for the network programming latency: a time this host
    /// has not seen for the slice (a relist repeats unchanged slices), from after it started.
    fn note_trigger_time(&mut self, object: &ClusterObject) {
        let ClusterObject::EndpointSlice(slice) = object else { return };
        let Some(time) = slice.trigger_time.filter(|time| *time >= self.programming_since) else { return };
        // As kube-proxy's slice cache: a relist repeats the time, and an update of the
        // annotation alone changed nothing to program (even when the same batch changes
        // another slice of the service).
        let old = self.cluster.endpoint_slices.get(&slice.key());
        if !old.is_some_and(|old| old.trigger_time == Some(time) || old.same_but_trigger_time(slice)) {
            self.trigger_times.push((slice.service_key(), time));
        }
    }

    /// kube-proxy's SLI: from each trigger time to now, for the services whose rules a
    /// transaction just wrote. A change that needed no new rules, or whose translation
    /// failed, was not programmed and is not observed. `written` is sorted.
    fn observe_programming(&self, trigger_times: Vec<(ObjectKey, SystemTime)>, written: &[ObjectKey]) {
        let now = SystemTime::now();
        for (service, time) in trigger_times.into_iter().filter(|(service, _)| written.binary_search(service).is_ok()) {
            // A trigger time ahead of this node's clock (skew) counts as no time.
            let latency = now.duration_since(time).unwrap_or_default();
            tracing::debug!(%service, seconds = latency.as_secs_f64(), "network programmed");
            self.metrics.network_programming_seconds.observe(latency.as_secs_f64());
        }
    }

    /// Where crash-budget rollbacks are asked for.
    pub fn set_rollback_sink(&mut self, sink: tokio::sync::mpsc::UnboundedSender<RollbackRequest>) {
        self.rollback_sink = Some(sink);
    }

    pub fn add_observer(&mut self, observer: Box<dyn ModelObserver>) {
        self.observers.push(observer);
    }

    pub fn cluster(&self) -> &ClusterState {
        &self.cluster
    }

    fn run_update(&mut self, update: ModelUpdate) -> Result<(), HostError> {
        let trigger_times = std::mem::take(&mut self.trigger_times);
        if update.is_empty() {
            return Ok(());
        }
        self.metrics.revisions.inc();
        self.metrics.services.set(self.model.services.len() as i64);
        self.metrics.policies.set(self.model.policies.len() as i64);
        self.metrics.local_pods.set(self.model.local_pods.len() as i64);
        for observer in &self.observers {
            observer.model_changed(&self.model, &update);
        }
        // The tables' static part first: services' and policies' `pod-traffic` rules render
        // by the cluster CIDRs the dataplane has (a family without one has no detector by
        // source address), and a context change redoes every service and policy below.
        // Node ports may move with the node's addresses (`--nodeport-addresses primary`).
        let node_ports_moved = update.context_changed && self.dataplane.set_node_ips(&self.model.context.node_ips);
        let service_cidrs_moved =
            update.service_cidrs_changed && self.dataplane.set_service_cidrs(&self.model.service_cidrs);
        // With `--detect-local-mode NodeCIDR` they follow the node's pod CIDRs.
        let cluster_cidrs_moved =
            update.context_changed && self.dataplane.set_cluster_cidrs(&self.model.context.cluster_cidrs);
        let egress_sources_moved = update.context_changed
            && self.egress_follows_node
            && self.dataplane.set_egress_sources(&self.model.context.pod_cidrs);
        let policy_changes = self.policy.apply(&self.cluster, &self.model, &update, self.dataplane.pod_detection());
        for call in &policy_changes.guest_calls {
            self.metrics.guest_call_time("network-policy", call.seconds);
            if call.outcome == "invalid" {
                self.metrics.invalid_outputs.inc();
            }
            self.metrics.guest_call(self.policy.module(), "network-policy", call.outcome);
            // The module's own record (the API's `calls`, `failures`, `last_error`), as for
            // the translator's calls.
            if let Some(error) = &call.error {
                self.registry.mark_failed(self.policy.module(), error);
            }
        }
        if !policy_changes.guest_calls.is_empty() {
            self.registry.count_calls(self.policy.module(), policy_changes.guest_calls.len() as u64);
        }
        if policy_changes.compiled + policy_changes.failed > 0 {
            tracing::debug!(
                compiled = policy_changes.compiled,
                failed = policy_changes.failed,
                dispatch = policy_changes.dispatch_changed,
                "policies recompiled"
            );
        }
        // This node's pods that changed: their host ports, written by the host.
        let hostport_changes: Vec<_> =
            update.pods.iter().filter_map(|change| self.hostport_change(&change.key, change.pod.as_deref())).collect();
        let changed: Vec<(ObjectKey, Option<Arc<ServiceView>>)> = if update.context_changed {
            // Every call sees the node context: all services are due.
            let mut all: Vec<_> = self.model.services.iter().map(|(k, v)| (k.clone(), Some(v.clone()))).collect();
            all.extend(update.changed.into_iter().filter(|c| c.view.is_none()).map(|c| (c.key, None)));
            all
        } else {
            update.changed.into_iter().map(|c| (c.key, c.view)).collect()
        };
        if let Some(mut shadow) = self.shadow.take() {
            self.run_shadow(&mut shadow, &changed);
            self.shadow = Some(shadow);
        }
        let mut changes = Vec::with_capacity(changed.len());
        let mut firewall_changes = Vec::new();
        for (key, view) in changed {
            firewall_changes.extend(self.firewall_change(&key, view.as_deref()));
            self.note_local_endpoints(&key, view.as_deref());
            match view {
                None => {
                    self.service_errors.remove(&key);
                    changes.push((key, None));
                }
                Some(view) => match self.translate(&key, &view) {
                    Ok(rules) => {
                        self.service_errors.remove(&key);
                        changes.push((key, Some(rules)));
                    }
                    Err(reason) => {
                        tracing::warn!(service = %key, "translation failed, keeping its last good rules: {reason}");
                        self.service_errors.insert(key, reason);
                    }
                },
            }
        }
        let translator = self.translator.as_ref().map(|t| TranslatorInForce {
            name: &t.name,
            version: t.version,
            settings: &t.settings,
        });
        self.observers.iter().for_each(|o| o.translated(translator, &changes, &self.service_errors));
        // The host's own objects after the translator's (whose are what observers record).
        changes.extend(firewall_changes);
        changes.extend(hostport_changes);
        // Policy objects after the services': their own order (see `policy.rs`) is kept.
        changes.extend(policy_changes.changes);
        if (node_ports_moved || service_cidrs_moved || cluster_cidrs_moved || egress_sources_moved)
            && changes.is_empty()
        {
            // No object changed, but the tables' static part did: written in full.
            return self.reconcile();
        }
        let mut written: Vec<ObjectKey> =
            if trigger_times.is_empty() { Vec::new() } else { changes.iter().map(|(key, _)| key.clone()).collect() };
        written.sort_unstable();
        self.sync(changes)?;
        self.observe_programming(trigger_times, &written);
        Ok(())
    }

    /// Follows whether the service's `Local` traffic policies find endpoints here, and
    /// moves the gauges by the difference (not recounted: at scale most `Local` services may
    /// have no endpoint on a given node).
    fn note_local_endpoints(&mut self, key: &ObjectKey, view: Option<&ServiceView>) {
        let now = view.map(ServiceView::without_local_endpoints).unwrap_or_default();
        let before = if now == NoLocalEndpoints::default() {
            self.without_local.remove(key)
        } else {
            self.without_local.insert(key.clone(), now)
        };
        let before = before.unwrap_or_default();
        for (policy, was, is) in
            [("internal", before.internal, now.internal), ("external", before.external, now.external)]
        {
            if was != is {
                let gauge = self
                    .metrics
                    .service_ports_without_local_endpoints
                    .get_or_create(&crate::metrics::TrafficPolicyLabels { traffic_policy: policy.into() });
                gauge.inc_by(is as i64 - was as i64);
            }
        }
    }

    /// A full write of the tables (`write`: a full sync or the release), timed and counted
    /// with the incremental ones.
    fn full_write(
        &mut self,
        write: impl FnOnce(&mut Dataplane) -> Result<SyncStats, WriteError>,
    ) -> Result<SyncStats, WriteError> {
        let started = Instant::now();
        let result = write(&mut self.dataplane);
        self.metrics.dataplane_full_sync_seconds.observe(started.elapsed().as_secs_f64());
        self.count_sync(result.is_ok());
        result
    }

    fn count_sync(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.metrics.syncs.get_or_create(&crate::metrics::ResultLabels { result: result.into() }).inc();
    }

    /// The change of a service's load balancer firewall (see [`nft::firewall_rules`]), when
    /// its service (`None`: gone) or the node's addresses changed it. The host writes it
    /// itself, whatever translator is in force: a guest cannot open it, and one that fails
    /// on the service does not keep its old ranges in force.
    fn firewall_change(&self, key: &ObjectKey, view: Option<&ServiceView>) -> Option<(ObjectKey, Option<ObjectRules>)> {
        self.host_object_change(nft::firewall_object_key(key), view.and_then(|view| self.firewall_of(view)))
    }

    /// One of the host's own objects (`key`) as a change, if `wanted` is not what the
    /// dataplane has for it.
    fn host_object_change(
        &self,
        key: ObjectKey,
        wanted: Option<ObjectRules>,
    ) -> Option<(ObjectKey, Option<ObjectRules>)> {
        (self.dataplane.wanted(&key) != wanted.as_ref()).then_some((key, wanted))
    }

    fn firewall_of(&self, view: &ServiceView) -> Option<ObjectRules> {
        nft::firewall_rules(&view.service.firewalled_frontends(&self.model.context.node_ips))
    }

    /// The change of a pod's host ports (see [`nft::hostport_rules`]) when the pod changed on
    /// this node (`None`: gone or moved away). The host writes them whatever translator is
    /// in force. The model's pods carry the addresses the CNI daemon gave before the API
    /// server reports them (see `fill_pod_ips`), so host ports work from the CNI ADD on.
    fn hostport_change(&self, key: &ObjectKey, pod: Option<&Pod>) -> Option<(ObjectKey, Option<ObjectRules>)> {
        self.host_object_change(
            nft::hostport_object_key(key),
            pod.and_then(|pod| nft::hostport_rules(pod, self.model.node_name())),
        )
    }

    /// Every policy: the generation enforced here, audit mode, errors (`GET /v1/policies`).
    pub fn policies(&self) -> Vec<crate::policy::PolicyStatus> {
        self.policy.status(&self.model)
    }

    /// The policies selecting a pod address in a direction, from their last good rules: those
    /// a logged verdict of that address's dispatch chain is owed to.
    pub fn policies_selecting(
        &self,
        direction: crate::nft::policy::Direction,
        addr: std::net::IpAddr,
    ) -> Vec<ObjectKey> {
        self.policy.policies_selecting(direction, addr)
    }

    /// Puts one policy (or, with `None`, every policy) in or out of audit mode: would-be
    /// drops are logged and counted, not enforced.
    pub fn set_policy_audit(&mut self, policy: Option<&ObjectKey>, audit: bool) -> Result<(), HostError> {
        let changes = match policy {
            Some(key) => self.policy.set_audit(key, audit),
            None => self.policy.set_audit_all(audit),
        };
        self.sync(changes.changes)
    }

    /// Logs (or stops logging) the connections one policy (or, with `None`, every policy)
    /// allows; a conflict where policy verdicts are logged nowhere.
    pub fn set_policy_log_allowed(&mut self, policy: Option<&ObjectKey>, enabled: bool) -> Result<(), HostError> {
        let changes = match policy {
            Some(key) => self.policy.set_log_allowed(key, enabled),
            None => self.policy.set_log_allowed_all(enabled),
        }
        .map_err(|e| HostError::Conflict(e.to_string()))?;
        self.sync(changes.changes)
    }

    /// Whether the cluster has this NetworkPolicy (whether or not it selects a pod here).
    pub fn policy_exists(&self, policy: &ObjectKey) -> bool {
        self.cluster.network_policies.contains_key(policy)
    }

    /// Whether a policy is in audit mode on this node (by itself or with every policy).
    pub fn policy_audited(&self, policy: &ObjectKey) -> bool {
        self.policy.is_audit(policy)
    }

    /// Whether one policy's allowed connections are logged here now.
    pub fn policy_logs_allowed(&self, policy: &ObjectKey) -> bool {
        self.policy.logs_allowed(policy)
    }

    /// The policy controller, for what reading its logged verdicts needs.
    pub fn policy_controller(&self) -> &PolicyController {
        &self.policy
    }

    /// Packets dropped (enforced) and that would have been (audit) per policy, from the
    /// kernel's counters (one `nft list table`: on demand, it is slow at scale).
    pub fn policy_drop_counts(&mut self) -> Result<BTreeMap<ObjectKey, (u64, u64)>, HostError> {
        let listing = self.dataplane.list_table()?;
        Ok(self.policy.drop_counts(&listing))
    }

    /// Puts each policy's audit mode, and with `counters` its drops and would-be drops (one
    /// `nft list table`), into the metrics.
    pub fn refresh_policy_metrics(&mut self, counters: bool) -> Result<(), HostError> {
        use crate::metrics::{PolicyLabels, PolicyPacketLabels};
        self.metrics.policy_audit.clear();
        for p in self.policy.status(&self.model) {
            self.metrics
                .policy_audit
                .get_or_create(&PolicyLabels { namespace: p.namespace.clone(), name: p.name.clone() })
                .set(i64::from(p.audit));
        }
        if counters {
            let counts = self.policy_drop_counts()?;
            self.metrics.policy_packets.clear();
            for (key, (dropped, would_drop)) in counts {
                for (verdict, packets) in [("dropped", dropped), ("would_drop", would_drop)] {
                    let labels = PolicyPacketLabels {
                        namespace: key.namespace.to_std(),
                        name: key.name.to_std(),
                        verdict: verdict.into(),
                    };
                    self.metrics.policy_packets.get_or_create(&labels).set(packets as i64);
                }
            }
        }
        Ok(())
    }

    /// Whether any policy is in audit mode here (then the counters are worth reading).
    pub fn any_policy_audited(&self) -> bool {
        self.policy.status(&self.model).iter().any(|p| p.audit)
    }

    /// A pod's policy counts from the kernel's counters of its dispatch chains (one `nft
    /// list chain` each, at most four); `None` where this host writes no kernel.
    pub fn pod_policy_counts(
        &mut self,
        addresses: &[std::net::IpAddr],
    ) -> Result<Option<crate::policy::PodPolicyCounts>, HostError> {
        let chains = self.policy.dispatch_chains_of(addresses);
        let Some(listing) = self.dataplane.list_chains(&chains)? else { return Ok(None) };
        Ok(Some(self.policy.pod_counts(&listing, addresses)))
    }

    /// Which generation of each policy this node enforces.
    pub fn policy_realization(&self) -> BTreeMap<ObjectKey, u64> {
        self.policy.realization()
    }

    fn translate(&mut self, key: &ObjectKey, view: &ServiceView) -> Result<ObjectRules, String> {
        let active = self.translator.as_mut().ok_or("no service translator is active")?;
        let started = Instant::now();
        let result = translate_one(&mut active.session, &self.model, key, view, &self.dataplane);
        self.metrics.guest_call_time("service-translator", started.elapsed().as_secs_f64());
        let outcome = match &result {
            Ok(_) => "ok",
            Err(CallFailure::Crash(e)) if e.starts_with("invalid guest output") => "invalid",
            Err(CallFailure::Crash(_)) => "crash",
            Err(CallFailure::Declined(_)) => "error",
        };
        if outcome == "invalid" {
            self.metrics.invalid_outputs.inc();
        }
        self.metrics.guest_call(&active.name, "service-translator", outcome);
        let (name, version) = (active.name.clone(), active.version);
        self.registry.count_calls(&name, 1);
        match result {
            Ok(rules) => Ok(rules),
            Err(failure) => {
                self.registry.mark_failed(&name, failure.message());
                if let CallFailure::Crash(reason) = &failure {
                    self.count_crash(&name, version, reason);
                }
                Err(failure.message().to_string())
            }
        }
    }

    /// Counts a crash of the module in force; past the budget, asks for its rollback once.
    fn count_crash(&mut self, name: &str, version: u32, reason: &str) {
        let now = Instant::now();
        let window = self.crash_budget.window;
        self.recent_crashes.push_back(now);
        while self.recent_crashes.front().is_some_and(|t| now.duration_since(*t) > window) {
            self.recent_crashes.pop_front();
        }
        if self.recent_crashes.len() <= self.crash_budget.max_crashes || self.rollback_requested {
            return;
        }
        self.rollback_requested = true;
        let reason = format!(
            "{} crashes within {:?} (budget {}), last: {reason}",
            self.recent_crashes.len(),
            window,
            self.crash_budget.max_crashes
        );
        tracing::error!(module = name, version, "crash budget exhausted, rolling back: {reason}");
        self.metrics.auto_rollbacks.get_or_create(&crate::metrics::ModuleLabels { module: name.to_string() }).inc();
        match &self.rollback_sink {
            Some(sink) => {
                let _ = sink.send(RollbackRequest {
                    kind: GuestKind::ServiceTranslator,
                    module: name.to_string(),
                    version,
                    reason,
                });
            }
            None => tracing::warn!(module = name, "no rollback handler is wired; the module stays in force"),
        }
    }

    fn sync(&mut self, changes: Vec<(ObjectKey, Option<ObjectRules>)>) -> Result<(), HostError> {
        if changes.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let result = self.dataplane.sync(changes);
        // A change the dataplane wrote in full (out of sync, or most of the table) is timed
        // as the full write it was.
        let seconds = started.elapsed().as_secs_f64();
        match &result {
            Ok(stats) if stats.full => self.metrics.dataplane_full_sync_seconds.observe(seconds),
            _ => self.metrics.dataplane_sync_seconds.observe(seconds),
        }
        self.count_sync(result.is_ok());
        match result {
            Ok(stats) => {
                self.metrics.sync_statements.inc_by(stats.statements as u64);
                if !stats.path.is_empty() {
                    self.metrics
                        .dataplane_transactions
                        .get_or_create(&crate::metrics::PathLabels { path: stats.path.into() })
                        .inc();
                }
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The node's interface addresses changed: with `--nodeport-addresses` networks, node
    /// ports follow them now (one full write when they moved), not at the next reconcile.
    /// Returns whether they moved.
    pub fn interface_addresses_changed(&mut self) -> Result<bool, HostError> {
        if !self.dataplane.interface_addresses_changed() {
            return Ok(false);
        }
        self.reconcile()?;
        Ok(true)
    }

    /// Periodic full reconcile: rewrites our table from what we want, repairing drift.
    /// Other clusters' pod CIDRs, routed to natively: pods reach them with their own address
    /// (pod egress masquerade leaves them out). Written at once when they move.
    pub fn remote_pod_cidrs_changed(&mut self, cidrs: Vec<ipnet::IpNet>) -> Result<(), HostError> {
        if self.dataplane.set_egress_remote_pod_cidrs(cidrs) {
            self.reconcile()?;
        }
        Ok(())
    }

    pub fn reconcile(&mut self) -> Result<(), HostError> {
        self.full_write(|dataplane| dataplane.full_sync(None))?;
        Ok(())
    }

    fn load(&self, name: &str, version: u32) -> Result<LoadedModule, HostError> {
        let kind =
            self.registry.kind_of(name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))?;
        let bytes = self.registry.module_bytes(name, version)?;
        let settings = self.registry.settings_of(name);
        let module = self.runtime.load(name, &bytes, Some(kind), usize::MAX)?.with_settings(&settings);
        self.admit(name, version, &module.info, &bytes)?;
        settings_verdict(name, module.validate_settings(&settings))?;
        Ok(module)
    }

    /// This host's admission on a version about to run (the builtins ship in the binary).
    fn admit(
        &self,
        name: &str,
        version: u32,
        info: &wasmplane_runtime::ModuleInfo,
        bytes: &[u8],
    ) -> Result<(), HostError> {
        if self.registry.is_builtin(name) {
            return Ok(());
        }
        let signature = self
            .registry
            .shared()
            .modules
            .get(name)
            .and_then(|m| m.version(version))
            .and_then(|v| v.signature.as_deref());
        Ok(self.admission.admit(name, info, bytes, signature)?)
    }

    /// Hot swap: run `name@version` over the whole current state; only if every service
    /// translates does it replace the module in force, in one full transaction.
    fn activate_version(&mut self, name: &str, version: u32) -> Result<(), HostError> {
        match self.load(name, version) {
            Ok(module) => self.activate_loaded(name, version, module),
            Err(e) => {
                self.registry.mark_failed(name, &e.to_string());
                Err(HostError::ActivationFailed { module: format!("{name}@{version}"), reason: e.to_string() })
            }
        }
    }

    /// [`activate_version`](Self::activate_version) with the module already compiled.
    fn activate_loaded(&mut self, name: &str, version: u32, module: LoadedModule) -> Result<(), HostError> {
        let failed = |this: &mut Self, reason: String| {
            this.registry.mark_failed(name, &reason);
            HostError::ActivationFailed { module: format!("{name}@{version}"), reason }
        };
        let Some(mut session) = module.translator(Arc::new(NoLookups)) else {
            return Err(failed(self, format!("{} modules cannot be activated yet", module.info.kind)));
        };
        let settings = module.settings().clone();
        let mut outputs = BTreeMap::new();
        for (key, view) in &self.model.services {
            match translate_one(&mut session, &self.model, key, view, &self.dataplane) {
                Ok(rules) => {
                    outputs.insert(key.clone(), rules);
                }
                Err(failure) => {
                    self.metrics.guest_call(name, "service-translator", "error");
                    return Err(failed(self, format!("service {key}: {}", failure.message())));
                }
            }
        }
        self.registry.count_calls(name, outputs.len() as u64);
        // A full sync replaces the whole table: the host's firewalls and host ports and the
        // policy side's objects go in with it.
        outputs.extend(
            self.model
                .services
                .iter()
                .filter_map(|(key, view)| Some((nft::firewall_object_key(key), self.firewall_of(view)?))),
        );
        let node = self.model.node_name();
        outputs.extend(
            self.model
                .local_pods
                .iter()
                .filter_map(|(key, pod)| Some((nft::hostport_object_key(key), nft::hostport_rules(pod, node)?))),
        );
        outputs.extend(self.policy.objects());
        self.full_write(|dataplane| dataplane.full_sync(Some(outputs)))?;
        self.service_errors.clear();
        self.translator = Some(ActiveTranslator { name: name.to_string(), version, settings, session });
        self.registry.mark_active(GuestKind::ServiceTranslator, name, version);
        self.recent_crashes.clear();
        self.rollback_requested = false;
        tracing::info!(module = name, version, "service translator in force");
        Ok(())
    }

    /// Hot swap of the network-policy guest: `name@version` compiles every policy first; only
    /// if none fails does it replace the one in force, in one full transaction.
    fn activate_policy_module(&mut self, name: &str, version: u32) -> Result<(), HostError> {
        let failed = |this: &mut Self, reason: String| {
            this.registry.mark_failed(name, &reason);
            HostError::ActivationFailed { module: format!("{name}@{version}"), reason }
        };
        let bytes = self
            .registry
            .module_bytes(name, version)
            .map_err(|e| HostError::Internal(format!("reading {name}@{version}: {e}")))?;
        let settings = self.registry.settings_of(name);
        let module = match self.runtime.load_policy(name, &bytes, usize::MAX) {
            Ok(module) => module.with_settings(&settings),
            Err(e) => return Err(failed(self, e.to_string())),
        };
        if let Err(e) = self
            .admit(name, version, &module.info, &bytes)
            .and_then(|_| settings_verdict(name, module.validate_settings(&settings)))
        {
            return Err(failed(self, e.to_string()));
        }
        let mut candidate = PolicyController::new(&module).with_verdict_log(self.policy.verdict_log());
        let compiled = candidate.recompile_all(&self.cluster, &self.model, self.dataplane.pod_detection());
        if compiled.failed > 0 {
            let errors: Vec<String> = candidate
                .status(&self.model)
                .into_iter()
                .filter_map(|s| s.error.map(|e| format!("{}/{}: {e}", s.namespace, s.name)))
                .take(3)
                .collect();
            return Err(failed(
                self,
                format!("{} of the policies failed to compile: {}", compiled.failed, errors.join("; ")),
            ));
        }
        let old = std::mem::replace(&mut self.policy, candidate);
        // Everything the old module wrote goes, the new module's objects come, in one full
        // transaction (its chains and dispatch may share names with the old ones).
        let old_keys: std::collections::BTreeSet<ObjectKey> = old.objects().into_iter().map(|(k, _)| k).collect();
        let mut wanted: BTreeMap<ObjectKey, ObjectRules> = self
            .dataplane
            .applied()
            .iter()
            .filter(|(k, _)| !old_keys.contains(*k))
            .map(|(k, v)| (k.clone(), (**v).clone()))
            .collect();
        wanted.extend(self.policy.objects());
        if let Err(e) = self.full_write(|dataplane| dataplane.full_sync(Some(wanted))) {
            self.policy = old;
            return Err(e.into());
        }
        self.registry.mark_active(GuestKind::NetworkPolicy, name, version);
        tracing::info!(module = name, version, "network-policy module in force");
        Ok(())
    }

    /// Checks an upload before it is stored: a valid name that is not a builtin's, the
    /// same kind as earlier versions, and a component that compiles and implements `kind`.
    pub fn check_upload(&self, name: &str, kind: GuestKind, bytes: &[u8]) -> Result<ModuleInfo, HostError> {
        if !valid_module_name(name) {
            return Err(HostError::BadRequest(format!(
                "module name {name:?} must be a DNS label (a-z, 0-9, '-', at most 63)"
            )));
        }
        if self.registry.is_builtin(name) {
            return Err(HostError::Conflict(format!("{name:?} is a builtin module; upload under another name")));
        }
        if let Some(existing) = self.registry.kind_of(name)
            && existing != kind
        {
            return Err(HostError::Conflict(format!("module {name:?} is a {existing} module, not {kind}")));
        }
        if kind == GuestKind::NetworkPolicy {
            return Ok(self.runtime.load_policy(name, bytes, self.max_module_bytes)?.info);
        }
        if kind == GuestKind::Gc {
            // GC guests run in the operator (its own bindings); the checks are the same.
            return Ok(self.runtime.load_gc(name, bytes, self.max_module_bytes)?.info);
        }
        Ok(self.runtime.load(name, bytes, Some(kind), self.max_module_bytes)?.info)
    }

    /// Asks a module what it says of `settings` through its own validator (the optional
    /// `settings-validation` export) before they are stored: no state is needed, so bad
    /// settings are refused on a node with nothing to translate, for a module not in force
    /// and for GC modules too. `version`: the kind, bytes and upload signature of the version
    /// they are for; `None` for the builtin `name`. This host's admission comes first: the
    /// validator is guest code like any other.
    pub fn check_settings(
        &self,
        name: &str,
        version: Option<(GuestKind, &[u8], Option<&str>)>,
        settings: &str,
    ) -> Result<(), HostError> {
        let shipped;
        let (kind, bytes) = match version {
            Some((kind, bytes, _)) => (kind, bytes),
            None => {
                let kind =
                    self.builtin_kind(name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))?;
                shipped = self.registry.module_bytes(name, 1)?;
                (kind, shipped.as_slice())
            }
        };
        let module = self.runtime.settings_check(name, bytes, Some(kind), usize::MAX)?;
        if let Some((_, bytes, signature)) = version {
            self.admission.admit(name, &module.info, bytes, signature)?;
        }
        settings_verdict(name, module.validate(settings))
    }

    pub fn has_blob(&self, digest: &str) -> bool {
        self.registry.has_blob(digest)
    }

    pub fn cache_blob(&mut self, digest: &str, bytes: &[u8]) -> Result<(), HostError> {
        Ok(self.registry.cache_blob(digest, bytes)?)
    }

    pub fn builtin_kind(&self, name: &str) -> Option<GuestKind> {
        self.registry.is_builtin(name).then(|| self.registry.kind_of(name)).flatten()
    }

    /// Takes a new shared module index: puts in force on this node what it names for each
    /// runnable kind (the builtin where it names none). `strict`: if an activation fails,
    /// the previous index stays and the error is returned (a change made here is refused
    /// before it is published); otherwise the node keeps its module in force and reports
    /// the failure in the module's status (a change made elsewhere that fails on this
    /// node's state).
    pub fn apply_shared(&mut self, index: SharedIndex, strict: bool) -> Result<(), HostError> {
        let previous = self.registry.shared().clone();
        self.registry.set_shared(index);
        let kind = GuestKind::ServiceTranslator;
        let active = self.registry.active(kind).map(|(n, v)| (n.to_string(), v));
        // Another module, another version, or the same with other settings.
        if let Some((name, version)) = self.registry.to_activate(kind)
            && let Err(e) = self.activate_version(&name, version)
        {
            if strict {
                self.registry.set_shared(previous);
                return Err(e);
            }
            tracing::error!(module = %name, version, "the module the cluster put in force failed on this node; keeping {active:?}: {e}");
        }
        let policy_kind = GuestKind::NetworkPolicy;
        if let Some((name, version)) = self.registry.to_activate(policy_kind)
            && let Err(e) = self.activate_policy_module(&name, version)
        {
            if strict {
                self.registry.set_shared(previous);
                return Err(e);
            }
            tracing::error!(module = %name, version, "the policy module the cluster put in force failed on this node; keeping the previous one: {e}");
        }
        // The operator runs the GC module, maybe elsewhere: a change made here is checked here.
        if strict && let Err(e) = self.check_gc_in_force(&previous) {
            self.registry.set_shared(previous);
            return Err(e);
        }
        let wanted_shadow = self.registry.shared().shadow.get(&kind).map(|s| (s.module.clone(), s.version));
        let running_shadow = self.shadow.as_ref().map(|s| (s.name.clone(), s.version));
        if wanted_shadow != running_shadow {
            self.shadow = None;
            if let Some((name, version)) = wanted_shadow
                && let Err(e) = self.start_shadow(&name, version)
            {
                if strict {
                    self.registry.set_shared(previous);
                    return Err(e);
                }
                tracing::error!(module = %name, version, "could not start the shadow run on this node: {e}");
            }
        }
        Ok(())
    }

    /// The uploaded GC module the index puts in force, when it or its settings changed from
    /// `previous`: this host's admission and the module's own check of its settings.
    fn check_gc_in_force(&self, previous: &SharedIndex) -> Result<(), HostError> {
        let index = self.registry.shared();
        let Some((name, version)) = index.in_force(GuestKind::Gc) else { return Ok(()) };
        if previous.in_force(GuestKind::Gc) == Some((name, version))
            && previous.settings.get(name) == index.settings.get(name)
        {
            return Ok(());
        }
        let bytes = self.registry.module_bytes(name, version)?;
        let signature = index.modules.get(name).and_then(|m| m.version(version)).and_then(|v| v.signature.as_deref());
        self.check_settings(name, Some((GuestKind::Gc, &bytes, signature)), &self.registry.settings_of(name))
    }

    /// Loads `name@version` and runs it over every service, keeping its output aside.
    fn start_shadow(&mut self, name: &str, version: u32) -> Result<(), HostError> {
        let module = self.load(name, version)?;
        let session = module
            .translator(Arc::new(NoLookups))
            .ok_or_else(|| HostError::BadRequest(format!("{} modules cannot run in shadow yet", module.info.kind)))?;
        let mut shadow = ShadowRun {
            name: name.to_string(),
            version,
            session,
            outputs: BTreeMap::new(),
            errors: BTreeMap::new(),
            calls: 0,
        };
        let all: Vec<_> = self.model.services.iter().map(|(k, v)| (k.clone(), Some(v.clone()))).collect();
        self.run_shadow(&mut shadow, &all);
        tracing::info!(
            module = name,
            version,
            services = shadow.outputs.len(),
            failed = shadow.errors.len(),
            "shadow run started"
        );
        self.shadow = Some(shadow);
        Ok(())
    }

    fn run_shadow(&self, shadow: &mut ShadowRun, changed: &[(ObjectKey, Option<Arc<ServiceView>>)]) {
        for (key, view) in changed {
            match view {
                None => {
                    shadow.outputs.remove(key);
                    shadow.errors.remove(key);
                }
                Some(view) => {
                    shadow.calls += 1;
                    let started = Instant::now();
                    let result = translate_one(&mut shadow.session, &self.model, key, view, &self.dataplane);
                    // Timed apart from the active translator's calls: a candidate's cost beside the one it would replace.
                    self.metrics.guest_call_time("service-translator-shadow", started.elapsed().as_secs_f64());
                    self.metrics.guest_call(
                        &shadow.name,
                        "service-translator-shadow",
                        if result.is_ok() { "ok" } else { "error" },
                    );
                    match result {
                        Ok(rules) => {
                            shadow.errors.remove(key);
                            shadow.outputs.insert(key.clone(), rules);
                        }
                        Err(failure) => {
                            shadow.outputs.remove(key);
                            shadow.errors.insert(key.clone(), failure.message().to_string());
                        }
                    }
                }
            }
        }
    }

    /// What promoting `name`'s shadow would change in this node's dataplane.
    pub fn shadow_diff(&self, name: &str) -> Result<crate::shadow::ShadowDiff, HostError> {
        match &self.shadow {
            Some(shadow) if shadow.name == name => Ok(crate::shadow::diff(shadow, self.dataplane.applied())),
            _ => Err(HostError::NotFound(format!("module {name:?} runs no shadow on this node"))),
        }
    }

    pub fn is_active(&self, name: &str) -> bool {
        self.translator.as_ref().is_some_and(|t| t.name == name)
    }

    pub fn active_translator(&self) -> Option<(String, u32)> {
        self.translator.as_ref().map(|t| (t.name.clone(), t.version))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A controller of `node-a` detecting local traffic by `local_detection` (with
    /// `--cluster-cidr` `cluster_cidrs`), whose writes are recorded, not applied.
    fn controller(local_detection: LocalDetection, cluster_cidrs: &[&str]) -> Controller {
        let runtime = Arc::new(Runtime::new(wasmplane_runtime::Limits::default(), None).unwrap());
        let config = ControllerConfig {
            node_name: "node-a".into(),
            cluster_cidrs: cluster_cidrs.iter().map(|c| c.to_string()).collect(),
            local_detection,
            service_cidrs: vec![],
            masquerade_all: false,
            egress_masquerade: None,
            max_module_bytes: usize::MAX,
            crash_budget: CrashBudget::default(),
            services_per_shard: nft::Layout::DEFAULT_SERVICES_PER_SHARD,
            node_port_addresses: nft::NodePortAddresses::All,
            admission: Arc::new(crate::admission::Admission::permissive()),
            policy_verdict_log: None,
        };
        Controller::new(runtime, Arc::new(Metrics::new()), Box::<crate::dataplane::Recorder>::default(), None, config)
            .unwrap()
    }

    /// `node-a` with these pod CIDRs, and an IPv6 NodePort service with externalTrafficPolicy
    /// Local and an endpoint here: a port the default translator keeps in chains, with its
    /// IPv6 `pod-traffic` rules.
    fn objects(pod_cidrs: &[&str]) -> Vec<ClusterObject> {
        let documents = [
            json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": "node-a" }, "spec": { "podCIDR": pod_cidrs.first(), "podCIDRs": pod_cidrs } }),
            json!({
                "apiVersion": "v1", "kind": "Service", "metadata": { "name": "web", "namespace": "shop" },
                "spec": {
                    "type": "NodePort", "clusterIP": "fd00:96::20", "clusterIPs": ["fd00:96::20"], "ipFamilies": ["IPv6"], "externalTrafficPolicy": "Local",
                    "ports": [{ "name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30080 }],
                },
            }),
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv6",
                "metadata": { "name": "web-abc", "namespace": "shop", "labels": { "kubernetes.io/service-name": "web" } },
                "ports": [{ "name": "http", "port": 8080, "protocol": "TCP" }],
                "endpoints": [{ "addresses": ["fd00:10:244:1::11"], "conditions": { "ready": true }, "nodeName": "node-a" }],
            }),
        ];
        documents.into_iter().map(|d| wasmplane_sources::convert::object_from_json(d).unwrap().unwrap()).collect()
    }

    /// With NodeCIDR detection the node's pod CIDRs decide where pods are detected: the
    /// dataplane has them before the services (and policies) are redone, so when the Node
    /// gains its first IPv6 pod CIDR the service's IPv6 `pod-traffic` rules and the host's
    /// IPv6 off-cluster masquerade appear in the same write, and when it loses it they go.
    #[test]
    fn pod_traffic_rules_follow_the_families_of_the_nodes_pod_cidrs() {
        let mut controller = controller(LocalDetection::NodeCidr, &[]);
        let ip6_rules = |c: &Controller| pod_traffic_rules(c, "@cluster-cidrs6");
        let v4_check = "ip daddr . meta l4proto . th dport @masquerade-off-cluster ip saddr != @cluster-cidrs jump mark-for-masquerade";
        let v6_check = "ip6 daddr . meta l4proto . th dport @masquerade-off-cluster6 ip6 saddr != @cluster-cidrs6 jump mark-for-masquerade";

        controller.replace_objects(objects(&["10.244.1.0/24"])).unwrap();
        assert_eq!(ip6_rules(&controller), Vec::<String>::new(), "no IPv6 pod CIDR: no IPv6 detector");
        assert_eq!(masquerade_checks(&controller), [v4_check]);

        controller.replace_objects(objects(&["10.244.1.0/24", "fd00:10:244:1::/64"])).unwrap();
        assert_eq!(
            ip6_rules(&controller),
            [
                "ip6 daddr fd00:96::20 meta l4proto tcp th dport 80 ip6 saddr != @cluster-cidrs6 jump mark-for-masquerade",
                "ip6 saddr @cluster-cidrs6 goto svc/shop/web/tcp/http",
            ]
        );
        assert_eq!(masquerade_checks(&controller), [v4_check, v6_check]);
        assert!(
            controller
                .dataplane()
                .render()
                .contains("add element inet wasmplane cluster-cidrs6 { fd00:10:244:1::/64 }")
        );

        controller.replace_objects(objects(&["10.244.1.0/24"])).unwrap();
        assert_eq!(ip6_rules(&controller), Vec::<String>::new(), "the IPv6 pod CIDR went: so did its detector");
        assert_eq!(masquerade_checks(&controller), [v4_check]);
    }

    /// The rules of `shop/web` that match pod traffic by `detector`, in chain order.
    fn pod_traffic_rules(c: &Controller, detector: &str) -> Vec<String> {
        let web = &c.dataplane().applied()[&ObjectKey::new("shop", "web")];
        web.chains.values().flatten().filter(|rule| rule.contains(detector)).cloned().collect()
    }

    /// The host's off-cluster masquerade rules, as its tables are now.
    fn masquerade_checks(c: &Controller) -> Vec<String> {
        let table = c.dataplane().render();
        table
            .lines()
            .filter_map(|l| l.split_once(" masquerade-check ").map(|(_, rule)| rule.to_string()))
            .filter(|rule| rule.contains("@masquerade-off-cluster"))
            .collect()
    }

    /// By interface pods are detected in every family, kube-proxy's way: a dual-stack node
    /// whose `--cluster-cidr` is IPv4 only has its IPv6 `pod-traffic` rules and IPv6
    /// off-cluster masquerade all the same.
    #[test]
    fn an_interface_mode_detects_pods_in_a_family_without_a_cluster_cidr() {
        let mut controller = controller(LocalDetection::InterfaceNamePrefix("vp".into()), &["10.244.0.0/16"]);
        controller.replace_objects(objects(&["10.244.1.0/24", "fd00:10:244:1::/64"])).unwrap();
        assert_eq!(
            pod_traffic_rules(&controller, "iifname"),
            [
                "ip6 daddr fd00:96::20 meta l4proto tcp th dport 80 iifname != \"vp*\" jump mark-for-masquerade",
                "iifname \"vp*\" goto svc/shop/web/tcp/http"
            ]
        );
        assert_eq!(
            masquerade_checks(&controller),
            [
                "ip daddr . meta l4proto . th dport @masquerade-off-cluster iifname != \"vp*\" jump mark-for-masquerade",
                "ip6 daddr . meta l4proto . th dport @masquerade-off-cluster6 iifname != \"vp*\" jump mark-for-masquerade",
            ]
        );
    }
}
