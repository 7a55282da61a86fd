//! Modules declared as cluster objects, as Kubewarden users declare policies: a `WasmModule`
//! (`wasmplane.io/v1alpha1`, cluster-scoped; CRD in `deploy/crd-wasmmodule.yaml`) names a
//! component in an OCI registry and its kind, and the leading operator pulls it, uploads it
//! to the cluster's module index like `PUT /v1/modules` (the same admission: signatures,
//! size, world, imports) and puts it in force. Every node follows the index, so nodes still
//! need no registry access. The object's status says what is in force or why not.
//!
//! - A finalizer (`wasmplane.io/module`) makes deleting the object delete the module (its
//!   kind falls back to the builtin), even when the operator was down at the time.
//! - A change of the object's spec pulls again; a tag that moves in the registry is not
//!   followed (pin `@sha256:…` or change the object, as with Kubewarden's policy server).
//!   The index is checked against every ready object periodically: a module deleted or
//!   replaced by hand (REST, CLI) is put back.
//! - A pull or admission failure leaves the module in force as it was (the last good one)
//!   and is retried with backoff; the status says why.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::watcher;
use kube::{Resource as _, ResourceExt as _};
use serde::{Deserialize, Serialize};
use wasmplane_runtime::GuestKind;

use crate::controller::HostError;
use crate::modules::Modules;
use crate::oci::{OciError, Registry, RegistryOptions, reference_of};

pub const GROUP: &str = "wasmplane.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "WasmModule";
pub const PLURAL: &str = "wasmmodules";
/// Held by every `WasmModule` until its module is deleted.
pub const FINALIZER: &str = "wasmplane.io/module";

pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// `spec` of a `WasmModule`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WasmModuleSpec {
    /// `service-translator`, `network-policy` or `gc`.
    pub kind: String,
    /// `oci://REGISTRY/REPOSITORY:TAG`, `…@sha256:DIGEST`, or Kubewarden's `registry://…`.
    pub module: String,
    /// Put the pulled version in force (default); `false` stores it only.
    #[serde(default = "in_force_by_default")]
    pub active: bool,
    /// The module's settings (its guests' `settings` capability); none: `{}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<serde_json::Value>,
}

fn in_force_by_default() -> bool {
    true
}

/// `status` of a `WasmModule`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WasmModuleStatus {
    /// The spec generation this status is about.
    pub observed_generation: Option<i64>,
    /// `Ready` (the module's version is stored, and in force if `spec.active`) or `Failed`.
    pub phase: String,
    /// Why not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The component's digest in the module index (`sha256:…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The OCI manifest pulled: `REPOSITORY@` this pulls exactly the same again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_digest: Option<String>,
    /// The module's version in the index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
}

/// Why a `WasmModule` is not ready.
#[derive(Debug, thiserror::Error)]
pub enum ModuleObjectError {
    #[error("spec: {0}")]
    Spec(String),
    #[error(transparent)]
    Registry(#[from] OciError),
    #[error(transparent)]
    Upload(#[from] HostError),
    #[error("writing the status: {0}")]
    Status(#[source] kube::Error),
    #[error(transparent)]
    Finalizer(Box<kube::runtime::finalizer::Error<ModuleObjectError>>),
}

/// How the operator reaches registries for `WasmModule` objects.
#[derive(Clone, Debug)]
pub struct ModuleObjectsConfig {
    pub registry: RegistryOptions,
    /// The largest component pulled (the host's upload limit).
    pub max_module_bytes: u64,
    /// Delay before a failed object is tried again.
    pub retry: Duration,
    /// How often a ready object is checked against the index (a module deleted or replaced
    /// by hand is pulled back: the object is the truth, as for any GitOps-managed object).
    pub resync: Duration,
}

impl Default for ModuleObjectsConfig {
    fn default() -> Self {
        ModuleObjectsConfig {
            registry: RegistryOptions::default(),
            max_module_bytes: 16 << 20,
            retry: Duration::from_secs(30),
            resync: Duration::from_secs(300),
        }
    }
}

struct Context {
    api: Api<DynamicObject>,
    modules: Arc<Modules>,
    registry: Registry,
    config: ModuleObjectsConfig,
}

/// Reconciles every `WasmModule` until the watch ends (the caller restarts it while leading).
pub async fn run(client: kube::Client, modules: Arc<Modules>, config: ModuleObjectsConfig) -> anyhow::Result<()> {
    let resource = api_resource();
    let api: Api<DynamicObject> = Api::all_with(client, &resource);
    let registry = Registry::new(&config.registry)?;
    if let Err(kube::Error::Api(status)) = api.list_metadata(&kube::api::ListParams::default().limit(1)).await
        && status.code == 404
    {
        // Not an error: a cluster that declares no modules need not install the CRD.
        tracing::info!(
            "no WasmModule CRD (deploy/crd-wasmmodule.yaml): declarative modules off; looking again in a minute"
        );
        tokio::time::sleep(Duration::from_secs(60)).await;
        return Ok(());
    }
    let context = Arc::new(Context { api: api.clone(), modules, registry, config });
    Controller::new_with(api, watcher::Config::default(), resource)
        .run(reconcile, error_policy, context)
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => tracing::debug!(module = %object.name, "WasmModule reconciled"),
                Err(e) => tracing::debug!("WasmModule not reconciled: {e}"),
            }
        })
        .await;
    Ok(())
}

async fn reconcile(object: Arc<DynamicObject>, context: Arc<Context>) -> Result<Action, ModuleObjectError> {
    finalizer(&context.api, FINALIZER, object, |event| async {
        match event {
            Event::Apply(object) => apply(&object, &context).await,
            Event::Cleanup(object) => cleanup(&object, &context).await,
        }
    })
    .await
    .map_err(|e| ModuleObjectError::Finalizer(Box::new(e)))
}

fn error_policy(object: Arc<DynamicObject>, error: &ModuleObjectError, context: Arc<Context>) -> Action {
    tracing::warn!(module = %object.name_any(), "WasmModule: {error}");
    // What the object names was refused: pulling it again soon would get the same answer, and
    // a change of the object reconciles at once anyway (a tag republished is seen at resync).
    Action::requeue(if error.is_refusal() { context.config.resync } else { context.config.retry })
}

impl ModuleObjectError {
    /// The spec, or the component it names, is wrong (not the registry or the API server
    /// failing for a while).
    fn is_refusal(&self) -> bool {
        match self {
            ModuleObjectError::Spec(_) => true,
            ModuleObjectError::Upload(e) => matches!(
                e,
                HostError::BadRequest(_) | HostError::Conflict(_) | HostError::Load(_) | HostError::Admission(_)
            ),
            ModuleObjectError::Registry(e) => !matches!(e, OciError::Registry(_) | OciError::Transfer { .. }),
            ModuleObjectError::Finalizer(e) => match e.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e) | kube::runtime::finalizer::Error::CleanupFailed(e) => {
                    e.is_refusal()
                }
                _ => false,
            },
            ModuleObjectError::Status(_) => false,
        }
    }
}

async fn apply(object: &DynamicObject, context: &Context) -> Result<Action, ModuleObjectError> {
    let name = object.name_any();
    let generation = object.meta().generation;
    let status: Option<WasmModuleStatus> =
        object.data.get("status").and_then(|s| serde_json::from_value(s.clone()).ok());
    let outcome: Result<WasmModuleStatus, ModuleObjectError> = async {
        let spec: WasmModuleSpec = serde_json::from_value(object.data.get("spec").cloned().unwrap_or_default()).map_err(|e| ModuleObjectError::Spec(e.to_string()))?;
        let kind = GuestKind::parse(&spec.kind).ok_or_else(|| ModuleObjectError::Spec(format!("unknown kind {:?} (service-translator, network-policy or gc)", spec.kind)))?;
        let reference = reference_of(&spec.module).ok_or_else(|| ModuleObjectError::Spec(format!("module {:?} is not oci://… or registry://…", spec.module)))??;
        if let Some(done) = status.as_ref().filter(|s| s.phase == "Ready" && s.observed_generation == generation) {
            // Pulled for this generation: pull again only if the index lost it meanwhile.
            if in_index(context, &name, done, &spec).await {
                return Ok(done.clone());
            }
        }
        let artifact = context.registry.pull(&reference, context.config.max_module_bytes).await?;
        let uploaded = context.modules.upload_with_settings(&name, kind, artifact.component.into(), spec.active, artifact.signature.as_deref(), Some(spec.settings.clone())).await?;
        tracing::info!(module = %name, version = uploaded.version, digest = %uploaded.digest, active = spec.active, "WasmModule pulled from {}", spec.module);
        Ok(WasmModuleStatus {
            observed_generation: generation,
            phase: "Ready".into(),
            message: None,
            digest: Some(uploaded.digest),
            manifest_digest: Some(artifact.manifest_digest),
            version: Some(uploaded.version),
        })
    }
    .await;
    let (next, result) = match outcome {
        Ok(ready) => (ready, Ok(Action::requeue(context.config.resync))),
        // What was in force stays; the status says why the object is not.
        Err(e) => (
            WasmModuleStatus {
                observed_generation: generation,
                phase: "Failed".into(),
                message: Some(e.to_string()),
                ..status.clone().unwrap_or_default()
            },
            Err(e),
        ),
    };
    if status.as_ref() != Some(&next) {
        context
            .api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(serde_json::json!({ "status": next })))
            .await
            .map_err(ModuleObjectError::Status)?;
    }
    result
}

/// The index still has the status's version of `name` (in force, when it should be) and
/// the object's settings.
async fn in_index(context: &Context, name: &str, status: &WasmModuleStatus, spec: &WasmModuleSpec) -> bool {
    let Ok((index, _)) = context.modules.store().load().await else { return false };
    let Some(module) = index.modules.get(name) else { return false };
    let Some(version) = status.version.and_then(|v| module.version(v)) else { return false };
    Some(&version.digest) == status.digest.as_ref()
        && (!spec.active || module.active_version == Some(version.version))
        && index.settings.get(name) == spec.settings.as_ref()
}

async fn cleanup(object: &DynamicObject, context: &Context) -> Result<Action, ModuleObjectError> {
    let name = object.name_any();
    match context.modules.delete(&name).await {
        Ok(()) => tracing::info!(module = %name, "WasmModule deleted: module removed"),
        // Never uploaded (its pull failed), or removed by hand: nothing left to do.
        Err(HostError::NotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_defaults_and_refusals() {
        let spec: WasmModuleSpec =
            serde_json::from_value(serde_json::json!({"kind": "gc", "module": "oci://r/m:v1"})).unwrap();
        assert!(spec.active, "in force unless told otherwise");
        assert!(
            serde_json::from_value::<WasmModuleSpec>(serde_json::json!({"kind": "gc"})).is_err(),
            "a module is required"
        );
        assert!(
            serde_json::from_value::<WasmModuleSpec>(
                serde_json::json!({"kind": "gc", "module": "oci://r/m:v1", "activ": false})
            )
            .is_err(),
            "a misspelt field is an error, not ignored"
        );
    }

    /// A refused object is tried again at the resync, a failing registry soon.
    #[test]
    fn refusals_are_told_from_outages() {
        let spec = || ModuleObjectError::Spec("unknown kind".into());
        assert!(spec().is_refusal());
        assert!(ModuleObjectError::Upload(HostError::BadRequest("implements network-policy".into())).is_refusal());
        assert!(
            ModuleObjectError::Registry(OciError::NotAComponent { reference: "r/m:v1".into(), layers: vec![] })
                .is_refusal()
        );
        assert!(
            !ModuleObjectError::Registry(OciError::Transfer {
                reference: "r/m:v1".into(),
                source: std::io::ErrorKind::ConnectionReset.into()
            })
            .is_refusal()
        );
        assert!(!ModuleObjectError::Upload(HostError::Internal("index contended".into())).is_refusal());
        assert!(
            ModuleObjectError::Finalizer(Box::new(kube::runtime::finalizer::Error::ApplyFailed(spec()))).is_refusal()
        );
    }

    #[test]
    fn the_resource_is_cluster_scoped_wasmmodules() {
        let resource = api_resource();
        assert_eq!(
            (resource.api_version.as_str(), resource.plural.as_str(), resource.kind.as_str()),
            ("wasmplane.io/v1alpha1", "wasmmodules", "WasmModule")
        );
    }
}
