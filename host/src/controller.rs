//! The controller: cluster state in, guests run on what changed, validated rules out.
//!
//! One `Controller` behind a mutex owns the model, the module registry, the active guest
//! session and the dataplane writer. Guest calls are synchronous; callers run controller
//! operations on blocking threads.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use wasmplane_model::state::{ClusterObject, ModelUpdate, ServiceView, Touched};
use wasmplane_model::{ClusterState, NodeLocalModel, ObjectKey};
use wasmplane_sources::kube::SourceEvent;
use wasmplane_runtime::{GuestKind, LoadError, LoadedModule, NoLookups, Runtime, TranslatorSession};

use crate::dataplane::{Dataplane, Kernel, WriteError};
use crate::metrics::Metrics;
use crate::nft::{self, ObjectRules};
use crate::registry::{ModuleRecord, Registry, valid_module_name};

/// The builtin service translator's module name.
pub const BUILTIN_SERVICE_TRANSLATOR: &str = "default-service-translator";

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
    #[error("writing the dataplane: {0}")]
    Write(#[from] WriteError),
    #[error("storage: {0}")]
    Storage(#[from] std::io::Error),
}

struct ActiveTranslator {
    name: String,
    version: u32,
    session: TranslatorSession,
}

/// Told about every model revision, in order, while the controller lock is held (so a
/// reader taking that lock sees a model consistent with what it was told).
pub trait ModelObserver: Send {
    fn model_changed(&self, model: &NodeLocalModel, update: &ModelUpdate);
}

pub struct ControllerConfig {
    pub node_name: String,
    pub cluster_cidrs: Vec<String>,
    pub max_module_bytes: usize,
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
    observers: Vec<Box<dyn ModelObserver>>,
}

#[derive(Debug, Serialize)]
pub struct UploadOutcome {
    pub name: String,
    pub version: u32,
    pub digest: String,
    pub kind: GuestKind,
    pub active: bool,
}

fn translate_one(session: &mut TranslatorSession, model: &NodeLocalModel, key: &ObjectKey, view: &ServiceView) -> Result<ObjectRules, String> {
    let out = session.translate(&model.context, &nft::service_prefix(key), view).map_err(|e| e.to_string())?;
    nft::validate_service_output(key, &out).map_err(|e| e.to_string())
}

impl Controller {
    pub fn new(runtime: Arc<Runtime>, metrics: Arc<Metrics>, kernel: Box<dyn Kernel>, data_dir: Option<&Path>, config: ControllerConfig) -> Result<Controller, HostError> {
        let mut registry = Registry::open(data_dir)?;
        let builtin = runtime.load(BUILTIN_SERVICE_TRANSLATOR, wasmplane_guest_artifacts::SERVICE_TRANSLATOR, Some(GuestKind::ServiceTranslator), usize::MAX)?;
        registry.add_builtin(BUILTIN_SERVICE_TRANSLATOR, GuestKind::ServiceTranslator, &builtin.info);
        let mut controller = Controller {
            runtime,
            metrics,
            cluster: ClusterState::new(),
            model: NodeLocalModel::new(&config.node_name, config.cluster_cidrs),
            registry,
            translator: None,
            dataplane: Dataplane::new(kernel),
            service_errors: BTreeMap::new(),
            max_module_bytes: config.max_module_bytes,
            observers: Vec::new(),
        };
        // The module that was in force before a restart, else the builtin.
        let wanted = controller.registry.in_force(GuestKind::ServiceTranslator).map(str::to_string);
        let restored = wanted.and_then(|name| {
            let version = controller.registry.get(&name)?.active_version?;
            match controller.activate_version(&name, version, false) {
                Ok(()) => Some(()),
                Err(e) => {
                    tracing::error!(module = %name, "could not restore the module in force, using the builtin: {e}");
                    None
                }
            }
        });
        if restored.is_none() {
            controller.activate_version(BUILTIN_SERVICE_TRANSLATOR, 1, true)?;
        }
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
        self.registry.list().cloned().collect()
    }

    pub fn module(&self, name: &str) -> Option<ModuleRecord> {
        self.registry.get(name).cloned()
    }

    pub fn in_force(&self, kind: GuestKind) -> Option<String> {
        self.registry.in_force(kind).map(str::to_string)
    }

    /// A relist or manifest reload: the whole state, applied as its difference.
    pub fn replace_objects(&mut self, objects: Vec<ClusterObject>) -> Result<(), HostError> {
        self.metrics.events.inc_by(objects.len() as u64);
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
            self.dataplane.release()?;
        }
        Ok(())
    }

    /// A batch from the Kubernetes watchers, applied as one model update (one revision at
    /// most, however many events it holds).
    pub fn apply_source(&mut self, batch: Vec<SourceEvent>) -> Result<(), HostError> {
        let node = self.model.node_name().to_string();
        let mut touched = Touched::default();
        for event in batch {
            match event {
                SourceEvent::Events(events) => {
                    self.metrics.events.inc_by(events.len() as u64);
                    for event in events {
                        touched.merge(self.cluster.apply(event, &node));
                    }
                }
                SourceEvent::Relisted { kind, objects, unconvertible } => {
                    self.metrics.events.inc_by(objects.len() as u64);
                    touched.merge(self.cluster.replace_kind(kind, objects, &unconvertible, &node));
                }
            }
        }
        let update = self.model.update(&self.cluster, &touched);
        self.run_update(update)
    }

    pub fn add_observer(&mut self, observer: Box<dyn ModelObserver>) {
        self.observers.push(observer);
    }

    pub fn cluster(&self) -> &ClusterState {
        &self.cluster
    }

    fn run_update(&mut self, update: ModelUpdate) -> Result<(), HostError> {
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
        let changed: Vec<(ObjectKey, Option<Arc<ServiceView>>)> = if update.context_changed {
            // Every call sees the node context: all services are due.
            let mut all: Vec<_> = self.model.services.iter().map(|(k, v)| (k.clone(), Some(v.clone()))).collect();
            all.extend(update.changed.into_iter().filter(|c| c.view.is_none()).map(|c| (c.key, None)));
            all
        } else {
            update.changed.into_iter().map(|c| (c.key, c.view)).collect()
        };
        let mut changes = Vec::with_capacity(changed.len());
        for (key, view) in changed {
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
        self.sync(changes)
    }

    fn translate(&mut self, key: &ObjectKey, view: &ServiceView) -> Result<ObjectRules, String> {
        let active = self.translator.as_mut().ok_or("no service translator is active")?;
        let started = Instant::now();
        let result = translate_one(&mut active.session, &self.model, key, view);
        self.metrics.guest_call_seconds.observe(started.elapsed().as_secs_f64());
        let outcome = match &result {
            Ok(_) => "ok",
            Err(e) if e.starts_with("invalid guest output") => "invalid",
            Err(_) => "error",
        };
        if outcome == "invalid" {
            self.metrics.invalid_outputs.inc();
        }
        self.metrics.guest_call(&active.name, "service-translator", outcome);
        let name = active.name.clone();
        if let Some(record) = self.registry.get_mut(&name) {
            record.calls += 1;
        }
        if let Err(e) = &result {
            self.registry.mark_failed(&name, e);
        }
        result
    }

    fn sync(&mut self, changes: Vec<(ObjectKey, Option<ObjectRules>)>) -> Result<(), HostError> {
        if changes.is_empty() {
            return Ok(());
        }
        match self.dataplane.sync(changes) {
            Ok(stats) => {
                self.metrics.syncs.get_or_create(&crate::metrics::ResultLabels { result: "ok".into() }).inc();
                self.metrics.sync_statements.inc_by(stats.statements as u64);
                Ok(())
            }
            Err(e) => {
                self.metrics.syncs.get_or_create(&crate::metrics::ResultLabels { result: "error".into() }).inc();
                Err(e.into())
            }
        }
    }

    /// Periodic full reconcile: rewrites our table from what we want, repairing drift.
    pub fn reconcile(&mut self) -> Result<(), HostError> {
        self.dataplane.full_sync(None)?;
        Ok(())
    }

    fn load(&self, name: &str, version: u32) -> Result<LoadedModule, HostError> {
        let record = self.registry.get(name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))?;
        let entry = record.version(version).ok_or_else(|| HostError::NotFound(format!("module {name:?} has no version {version}")))?;
        let bytes = if record.builtin {
            wasmplane_guest_artifacts::SERVICE_TRANSLATOR.to_vec()
        } else {
            self.registry.read_blob(&entry.digest)?
        };
        Ok(self.runtime.load(name, &bytes, Some(record.kind), usize::MAX)?)
    }

    /// Hot swap: run `name@version` over the whole current state; only if every service
    /// translates does it replace the module in force, in one full transaction.
    fn activate_version(&mut self, name: &str, version: u32, push_history: bool) -> Result<(), HostError> {
        let module = self.load(name, version)?;
        let failed = |this: &mut Self, reason: String| {
            this.registry.mark_failed(name, &reason);
            let _ = this.registry.save();
            HostError::ActivationFailed { module: format!("{name}@{version}"), reason }
        };
        let Some(mut session) = module.translator(Arc::new(NoLookups)) else {
            return Err(failed(self, format!("{} modules cannot be activated yet", module.info.kind)));
        };
        let mut outputs = BTreeMap::new();
        for (key, view) in &self.model.services {
            match translate_one(&mut session, &self.model, key, view) {
                Ok(rules) => {
                    outputs.insert(key.clone(), rules);
                }
                Err(reason) => {
                    self.metrics.guest_call(name, "service-translator", "error");
                    return Err(failed(self, format!("service {key}: {reason}")));
                }
            }
        }
        if let Some(record) = self.registry.get_mut(name) {
            record.calls += outputs.len() as u64;
        }
        self.dataplane.full_sync(Some(outputs))?;
        self.service_errors.clear();
        self.translator = Some(ActiveTranslator { name: name.to_string(), version, session });
        self.registry.mark_active(name, version, push_history);
        self.registry.save()?;
        tracing::info!(module = name, version, "service translator in force");
        Ok(())
    }

    pub fn upload(&mut self, name: &str, kind: GuestKind, bytes: &[u8], activate: bool) -> Result<UploadOutcome, HostError> {
        if !valid_module_name(name) {
            return Err(HostError::BadRequest(format!("module name {name:?} must be a DNS label (a-z, 0-9, '-', at most 63)")));
        }
        if let Some(existing) = self.registry.get(name) {
            if existing.builtin {
                return Err(HostError::Conflict(format!("{name:?} is a builtin module; upload under another name")));
            }
            if existing.kind != kind {
                return Err(HostError::Conflict(format!("module {name:?} is a {} module, not {kind}", existing.kind)));
            }
        }
        let module = self.runtime.load(name, bytes, Some(kind), self.max_module_bytes)?;
        let version = self.registry.add_version(name, kind, &module.info, bytes)?;
        self.registry.save()?;
        let digest = module.info.digest.clone();
        if activate {
            self.activate_version(name, version, true)?;
        }
        Ok(UploadOutcome { name: name.into(), version, digest, kind, active: activate })
    }

    pub fn activate(&mut self, name: &str, version: Option<u32>) -> Result<u32, HostError> {
        let record = self.registry.get(name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))?;
        let version = version.or(record.versions.last().map(|v| v.version)).ok_or_else(|| HostError::NotFound(format!("module {name:?} has no versions")))?;
        self.activate_version(name, version, true)?;
        Ok(version)
    }

    /// Re-activates the version that was in force before the current one.
    pub fn rollback(&mut self, name: &str) -> Result<u32, HostError> {
        let record = self.registry.get(name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))?;
        let history = &record.activation_history;
        if history.len() < 2 {
            return Err(HostError::Conflict(format!("module {name:?} has no earlier activated version to roll back to")));
        }
        let previous = history[history.len() - 2];
        self.activate_version(name, previous, false)?;
        if let Some(record) = self.registry.get_mut(name) {
            record.activation_history.pop();
        }
        self.registry.save()?;
        Ok(previous)
    }

    pub fn delete(&mut self, name: &str) -> Result<(), HostError> {
        let record = self.registry.get(name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))?;
        if record.builtin {
            return Err(HostError::Conflict(format!("{name:?} is a builtin module and cannot be deleted")));
        }
        let was_in_force = self.registry.in_force(record.kind) == Some(name);
        if was_in_force {
            // Fall back to the builtin before the module disappears, so rules never lapse.
            self.activate_version(BUILTIN_SERVICE_TRANSLATOR, 1, true)?;
        }
        self.registry.remove(name);
        self.registry.save()?;
        Ok(())
    }

    pub fn is_active(&self, name: &str) -> bool {
        self.translator.as_ref().is_some_and(|t| t.name == name)
    }

    pub fn active_translator(&self) -> Option<(String, u32)> {
        self.translator.as_ref().map(|t| (t.name.clone(), t.version))
    }
}
