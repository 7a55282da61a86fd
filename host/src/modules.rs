//! Module operations across the cluster: the REST API's upload, activate, rollback and
//! delete, and every host's reaction to the shared index changing.
//!
//! A change is a transform of the [`SharedIndex`]: read it, transform it, apply the result
//! on this host first (an activation that fails here is refused before anyone else sees
//! it), then publish it with compare-and-swap; on a conflict, start over from the newer
//! index. Every host, the publisher included, applies what the watch delivers; one async
//! lock orders local publishes and watched revisions, so a host never goes back to an
//! older index.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde::Serialize;
use wasmplane_kvstore::Revision;
use wasmplane_runtime::GuestKind;

use crate::admission::Admission;
use crate::controller::{Controller, HostError, RollbackRequest};
use crate::module_store::{MAX_CAS_ATTEMPTS, ModuleStore, StoreError};
use crate::registry::{BUILTIN_VERSION, RegistryError, RollbackOutcome, SharedIndex};

#[derive(Debug, Serialize)]
pub struct UploadOutcome {
    pub name: String,
    pub version: u32,
    pub digest: String,
    pub kind: GuestKind,
    pub active: bool,
}

/// The version of a module settings are checked against: its kind, bytes and the signature
/// it was uploaded with.
struct SettingsVersion {
    kind: GuestKind,
    bytes: Bytes,
    signature: Option<String>,
}

pub struct Modules {
    store: ModuleStore,
    controller: Arc<Mutex<Controller>>,
    admission: Arc<Admission>,
    /// The index revision this host has applied; held across a publish.
    applied: tokio::sync::Mutex<Revision>,
}

/// Why a builtin module has no shadow to start, stop or promote.
const SHADOW_REFUSAL: &str = "cannot run in shadow (upload a module and shadow that)";

async fn blocking<T: Send + 'static>(
    controller: &Arc<Mutex<Controller>>,
    op: impl FnOnce(&mut Controller) -> Result<T, HostError> + Send + 'static,
) -> Result<T, HostError> {
    let controller = controller.clone();
    tokio::task::spawn_blocking(move || op(&mut controller.lock().unwrap_or_else(|p| p.into_inner())))
        .await
        .map_err(|e| HostError::Internal(format!("controller task failed: {e}")))?
}

impl Modules {
    pub fn new(store: ModuleStore, controller: Arc<Mutex<Controller>>, admission: Arc<Admission>) -> Modules {
        Modules { store, controller, admission, applied: tokio::sync::Mutex::new(0) }
    }

    pub fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    pub fn store(&self) -> &ModuleStore {
        &self.store
    }

    /// Applies the index as it is in the kvstore now; returns its revision (to watch from).
    pub async fn sync_now(&self) -> Result<Revision, HostError> {
        let mut applied = self.applied.lock().await;
        let (index, revision) = self.store.load().await?;
        self.apply(index, false).await?;
        *applied = revision;
        Ok(revision)
    }

    /// Follows the shared index for as long as the host runs.
    pub async fn follow(self: Arc<Self>, from: Revision) {
        let this = self.clone();
        self.store
            .watch(from, move |index, revision| {
                let this = this.clone();
                async move {
                    let mut applied = this.applied.lock().await;
                    if revision <= *applied {
                        return;
                    }
                    if let Err(e) = this.apply(index, false).await {
                        tracing::error!(revision, "applying the module index: {e}");
                    }
                    *applied = revision;
                }
            })
            .await
    }

    /// Makes sure this host has the bytes of every module the index puts in force, then
    /// applies it. `strict`: an activation failing here fails the call and leaves the
    /// previous index applied.
    async fn apply(&self, index: SharedIndex, strict: bool) -> Result<(), HostError> {
        let wanted = GuestKind::ALL
            .into_iter()
            .filter_map(|kind| index.in_force(kind))
            .chain(index.shadow.values().map(|s| (s.module.as_str(), s.version)));
        let digests: Vec<String> = wanted
            .filter_map(|(name, version)| Some(index.modules.get(name)?.version(version)?.digest.clone()))
            .collect();
        for digest in digests {
            let cached = {
                let digest = digest.clone();
                blocking(&self.controller, move |c| Ok(c.has_blob(&digest))).await?
            };
            if !cached {
                let bytes = self.store.get_blob(&digest).await?;
                blocking(&self.controller, move |c| c.cache_blob(&digest, &bytes)).await?;
            }
        }
        blocking(&self.controller, move |c| c.apply_shared(index, strict)).await
    }

    /// Read-transform-apply-publish, retried on conflict.
    async fn update<T: Send + 'static>(
        &self,
        transform: impl Fn(&mut SharedIndex) -> Result<T, RegistryError>,
    ) -> Result<T, HostError> {
        let mut applied = self.applied.lock().await;
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (index, revision) = self.store.load().await?;
            let mut changed = index.clone();
            let outcome = transform(&mut changed)?;
            if changed == index {
                return Ok(outcome);
            }
            self.apply(changed.clone(), true).await?;
            if let Some(published) = self.store.publish(revision, &changed).await? {
                *applied = published;
                return Ok(outcome);
            }
            tracing::debug!("module index changed concurrently; retrying on the newer one");
        }
        Err(StoreError::Contended(MAX_CAS_ATTEMPTS).into())
    }

    /// `signature`: what came with the upload, checked by the host's [`Admission`] policy.
    pub async fn upload(
        &self,
        name: &str,
        kind: GuestKind,
        bytes: Bytes,
        activate: bool,
        signature: Option<&str>,
    ) -> Result<UploadOutcome, HostError> {
        self.upload_with_settings(name, kind, bytes, activate, signature, None).await
    }

    /// [`Modules::upload`] that also sets the module's settings (`Some(None)`: clears them),
    /// in the same change as the activation: the new version starts with them, and if it
    /// fails with them neither is taken. Settings the new version's own validator refuses
    /// are refused before anything is stored.
    pub async fn upload_with_settings(
        &self,
        name: &str,
        kind: GuestKind,
        bytes: Bytes,
        activate: bool,
        signature: Option<&str>,
        settings: Option<Option<serde_json::Value>>,
    ) -> Result<UploadOutcome, HostError> {
        let info = {
            let (name, bytes) = (name.to_string(), bytes.clone());
            blocking(&self.controller, move |c| c.check_upload(&name, kind, &bytes)).await?
        };
        self.admission.admit(name, &info, &bytes, signature)?;
        if let Some(settings) = &settings {
            let version = SettingsVersion { kind, bytes: bytes.clone(), signature: signature.map(str::to_string) };
            self.check_settings(name, settings.as_ref(), Some(version)).await?;
        }
        // Bytes first: an index naming a version must always find its blob.
        self.store.put_blob(&info.digest, &bytes).await?;
        {
            let (digest, bytes) = (info.digest.clone(), bytes.clone());
            blocking(&self.controller, move |c| c.cache_blob(&digest, &bytes)).await?;
        }
        // Recorded first, activated second: a version that fails to activate stays listed
        // (with its failure in the status) and can be activated later.
        let version = self.update(|index| index.add_version(name, kind, &info, signature)).await?;
        // The blob may have been deleted by the module GC between our `put_blob` (skipped
        // when the bytes were already stored for an older version) and the publish.
        self.store.ensure_blob(&info.digest, &bytes).await?;
        if activate || settings.is_some() {
            self.update(|index| {
                if let Some(settings) = &settings {
                    index.set_settings(name, settings.clone());
                }
                if activate { index.activate(name, Some(version)) } else { Ok(version) }
            })
            .await?;
        }
        Ok(UploadOutcome { name: name.to_string(), version, digest: info.digest, kind, active: activate })
    }

    pub async fn activate(&self, name: &str, version: Option<u32>) -> Result<u32, HostError> {
        if let Some(kind) = self.builtin_kind(name).await? {
            if let Some(v) = version.filter(|v| *v != BUILTIN_VERSION) {
                return Err(HostError::NotFound(format!(
                    "module {name:?} has no version {v}: a builtin module has only version {BUILTIN_VERSION}"
                )));
            }
            return self
                .update(|index| {
                    index.activate_builtin(kind);
                    Ok(BUILTIN_VERSION)
                })
                .await;
        }
        self.update(|index| index.activate(name, version)).await
    }

    /// Sets (`None`: clears) a module's settings, builtins' too. The module's own validator,
    /// if it exports one, is asked first ([`Modules::check_settings`]); then the change is
    /// applied here first like any other: if the module in force fails with them, they are
    /// refused (its error says why) and the settings in force stay.
    pub async fn set_settings(&self, name: &str, settings: Option<serde_json::Value>) -> Result<(), HostError> {
        let (index, _) = self.store.load().await?;
        if self.builtin_kind(name).await?.is_none() && !index.modules.contains_key(name) {
            return Err(HostError::NotFound(format!("no module named {name:?}")));
        }
        let version = self.settings_version(&index, name).await?;
        self.check_settings(name, settings.as_ref(), version).await?;
        self.update(|index| {
            index.set_settings(name, settings.clone());
            Ok(())
        })
        .await
    }

    pub async fn rollback(&self, name: &str) -> Result<u32, HostError> {
        self.refuse_builtin(name, "has no earlier version to roll back to (activate it to put it back in force)")
            .await?;
        self.update(|index| index.rollback(name)).await
    }

    pub async fn delete(&self, name: &str) -> Result<(), HostError> {
        self.refuse_builtin(name, "cannot be deleted").await?;
        self.update(|index| index.remove(name)).await
    }

    /// Runs `name@version` (latest if `None`) in shadow on every host.
    pub async fn start_shadow(&self, name: &str, version: Option<u32>) -> Result<u32, HostError> {
        self.refuse_builtin(name, SHADOW_REFUSAL).await?;
        self.update(|index| index.start_shadow(name, version)).await
    }

    pub async fn stop_shadow(&self, name: &str) -> Result<(), HostError> {
        self.refuse_builtin(name, SHADOW_REFUSAL).await?;
        self.update(|index| index.stop_shadow(name)).await
    }

    /// Puts the shadowed version in force everywhere.
    pub async fn promote(&self, name: &str) -> Result<u32, HostError> {
        self.refuse_builtin(name, SHADOW_REFUSAL).await?;
        self.update(|index| index.promote_shadow(name)).await
    }

    /// A builtin module is in the host's binary, not in the shared index that uploads,
    /// rollbacks and shadows change: a call meant for an uploaded module is refused for it
    /// by what it is, not answered "no module named" for a module the API lists.
    async fn refuse_builtin(&self, name: &str, refusal: &str) -> Result<(), HostError> {
        match self.builtin_kind(name).await? {
            Some(_) => Err(HostError::Conflict(format!("{name:?} is a builtin module and {refusal}"))),
            None => Ok(()),
        }
    }

    /// Carries out the rollbacks the controller asks for when a module exhausts its crash
    /// budget: cluster-wide, through the index, so every host stops running it.
    pub async fn handle_rollbacks(
        self: Arc<Self>,
        mut requests: tokio::sync::mpsc::UnboundedReceiver<RollbackRequest>,
    ) {
        while let Some(request) = requests.recv().await {
            let RollbackRequest { module, version, reason, .. } = request;
            match self.update(|index| Ok(index.auto_rollback(&module, version, &reason))).await {
                Ok(RollbackOutcome::Stale) => {
                    tracing::info!(module, version, "crash-budget rollback not needed: no longer in force")
                }
                Ok(outcome) => {
                    tracing::warn!(module, version, ?outcome, "rolled back after exhausting the crash budget: {reason}")
                }
                Err(e) => tracing::error!(module, version, "crash-budget rollback failed: {e}"),
            }
        }
    }

    /// Refuses `settings` (`None`: cleared, the guests read `{}`) if `version` of `name`
    /// (`None`: the builtin) refuses them through its own validator
    /// (`Controller::check_settings`), before the index is written.
    async fn check_settings(
        &self,
        name: &str,
        settings: Option<&serde_json::Value>,
        version: Option<SettingsVersion>,
    ) -> Result<(), HostError> {
        let document = settings.map_or_else(|| wasmplane_runtime::NO_SETTINGS.to_string(), |value| value.to_string());
        let name = name.to_string();
        blocking(&self.controller, move |c| {
            let version = version.as_ref().map(|v| (v.kind, &v.bytes[..], v.signature.as_deref()));
            c.check_settings(&name, version, &document)
        })
        .await
    }

    /// The version of the uploaded module `name` that settings set now are for: the one in
    /// force, else the latest (what activating without a version picks); `None` for a
    /// builtin.
    async fn settings_version(&self, index: &SharedIndex, name: &str) -> Result<Option<SettingsVersion>, HostError> {
        let Some(module) = index.modules.get(name) else { return Ok(None) };
        let in_force = module.active_version.and_then(|v| module.version(v));
        let Some(version) = in_force.or(module.versions.last()) else {
            return Err(HostError::NotFound(format!("module {name:?} has no versions")));
        };
        let bytes = self.store.get_blob(&version.digest).await?;
        Ok(Some(SettingsVersion { kind: module.kind, bytes, signature: version.signature.clone() }))
    }

    async fn builtin_kind(&self, name: &str) -> Result<Option<GuestKind>, HostError> {
        let name = name.to_string();
        blocking(&self.controller, move |c| Ok(c.builtin_kind(&name))).await
    }
}
