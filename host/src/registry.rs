//! The module registry, in two halves:
//!
//! - [`SharedIndex`]: the cluster-wide truth, stored in the kvstore (see `module_store`):
//!   every uploaded module, its versions (by content digest), which version is active, the
//!   activation history rollback walks, and which module is in force per guest kind. Every
//!   change to it is a pure transform here, published with compare-and-swap, so two hosts
//!   changing modules at once never lose each other's change.
//! - [`Registry`]: one node's view: the shared index it last applied, its own status per
//!   module (a module can fail on one node's state and not on another's), the builtins
//!   shipped in this binary, and a cache of component bytes by digest.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use wasmplane_runtime::{GuestKind, ModuleInfo};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModuleVersion {
    pub version: u32,
    pub digest: String,
    pub size: usize,
    pub wit_version: String,
    pub imports: Vec<String>,
    /// Unix seconds.
    pub uploaded_at: u64,
    /// The `module sign` signature it was uploaded with: every host checks it against its
    /// own trusted keys before running the version, not only the host that took the upload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModuleStatus {
    /// Uploaded, not in force.
    Inactive,
    /// In force for its kind.
    Active,
    /// Its last activation or call failed on this node; see `last_error`.
    Failed,
}

/// One module as the REST API shows it: the shared record plus this node's status.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModuleRecord {
    pub name: String,
    pub kind: GuestKind,
    /// Shipped inside the host binary; cannot be replaced or deleted.
    pub builtin: bool,
    pub versions: Vec<ModuleVersion>,
    pub active_version: Option<u32>,
    /// Versions in the order they were activated; rollback walks it back.
    pub activation_history: Vec<u32>,
    pub status: ModuleStatus,
    pub last_error: Option<String>,
    #[serde(default)]
    pub calls: u64,
    #[serde(default)]
    pub failures: u64,
    /// Set when the host rolled this module back after it crashed too often.
    #[serde(default)]
    pub auto_rollback: Option<AutoRollback>,
    /// The version running in shadow, if any.
    #[serde(default)]
    pub shadow_version: Option<u32>,
    /// The module's settings, when it has any (`PUT /v1/modules/{name}/settings`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<serde_json::Value>,
}

impl ModuleRecord {
    pub fn version(&self, version: u32) -> Option<&ModuleVersion> {
        self.versions.iter().find(|v| v.version == version)
    }
}

/// A rollback the host did on its own, after the module exhausted its crash budget.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AutoRollback {
    pub from_version: u32,
    /// The version put back in force; `None`: the builtin.
    pub to_version: Option<u32>,
    pub reason: String,
    /// Unix seconds.
    pub at: u64,
}

/// A module in the shared index.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SharedModule {
    pub kind: GuestKind,
    pub versions: Vec<ModuleVersion>,
    pub active_version: Option<u32>,
    pub activation_history: Vec<u32>,
    #[serde(default)]
    pub auto_rollback: Option<AutoRollback>,
}

impl SharedModule {
    pub fn version(&self, version: u32) -> Option<&ModuleVersion> {
        self.versions.iter().find(|v| v.version == version)
    }
}

/// Why a change to the shared index was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    BadRequest(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollbackOutcome {
    /// The version is no longer in force: nothing to do.
    Stale,
    ToVersion(u32),
    ToBuiltin,
}

/// A module version running in shadow: on live state, output never written.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShadowRef {
    pub module: String,
    pub version: u32,
}

/// The cluster-wide module index. Builtins are not in it: every host has them, and a kind
/// with no entry in `in_force` runs its builtin.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SharedIndex {
    pub modules: BTreeMap<String, SharedModule>,
    /// The module in force per kind, if not the builtin.
    pub in_force: BTreeMap<GuestKind, String>,
    /// At most one shadow per kind.
    #[serde(default)]
    pub shadow: BTreeMap<GuestKind, ShadowRef>,
    /// Each module's settings (the guests' `settings` capability), builtins' too; a module
    /// without an entry reads `{}`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settings: BTreeMap<String, serde_json::Value>,
}

/// Module names are DNS labels: they appear in URLs, metrics, logs and kvstore keys.
pub fn valid_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn not_found(name: &str) -> RegistryError {
    RegistryError::NotFound(format!("no module named {name:?}"))
}

impl SharedIndex {
    /// The `(module, version)` in force for `kind`, `None` meaning the builtin.
    pub fn in_force(&self, kind: GuestKind) -> Option<(&str, u32)> {
        let name = self.in_force.get(&kind)?;
        let version = self.modules.get(name)?.active_version?;
        Some((name.as_str(), version))
    }

    /// Sets (`None`: clears) a module's settings.
    pub fn set_settings(&mut self, name: &str, settings: Option<serde_json::Value>) {
        match settings {
            Some(value) => self.settings.insert(name.to_string(), value),
            None => self.settings.remove(name),
        };
    }

    /// Records a new version (or returns the existing one with the same digest).
    /// Records `info` as the next version of `name` (the existing one for the same bytes,
    /// which takes `signature` if it had none).
    pub fn add_version(
        &mut self,
        name: &str,
        kind: GuestKind,
        info: &ModuleInfo,
        signature: Option<&str>,
    ) -> Result<u32, RegistryError> {
        let module = self.modules.entry(name.to_string()).or_insert_with(|| SharedModule {
            kind,
            versions: vec![],
            active_version: None,
            activation_history: vec![],
            auto_rollback: None,
        });
        if module.kind != kind {
            return Err(RegistryError::Conflict(format!("module {name:?} is a {} module, not {kind}", module.kind)));
        }
        if let Some(existing) = module.versions.iter_mut().find(|v| v.digest == info.digest) {
            if existing.signature.is_none() {
                existing.signature = signature.map(str::to_string);
            }
            return Ok(existing.version);
        }
        let version = module.versions.last().map_or(1, |v| v.version + 1);
        module.versions.push(ModuleVersion {
            version,
            digest: info.digest.clone(),
            size: info.size,
            wit_version: info.wit_version.clone(),
            imports: info.imports.clone(),
            uploaded_at: now(),
            signature: signature.map(str::to_string),
        });
        Ok(version)
    }

    /// Puts `name@version` in force for its kind (latest version if `None`).
    pub fn activate(&mut self, name: &str, version: Option<u32>) -> Result<u32, RegistryError> {
        let module = self.modules.get(name).ok_or_else(|| not_found(name))?;
        let version = match version {
            Some(v) => module
                .version(v)
                .map(|v| v.version)
                .ok_or_else(|| RegistryError::NotFound(format!("module {name:?} has no version {v}")))?,
            None => module
                .versions
                .last()
                .map(|v| v.version)
                .ok_or_else(|| RegistryError::NotFound(format!("module {name:?} has no versions")))?,
        };
        self.set_in_force(name, version);
        let module = self.modules.get_mut(name).expect("checked above");
        module.activation_history.push(version);
        Ok(version)
    }

    /// Re-activates the version that was in force before the current one.
    pub fn rollback(&mut self, name: &str) -> Result<u32, RegistryError> {
        let module = self.modules.get(name).ok_or_else(|| not_found(name))?;
        let history = &module.activation_history;
        if history.len() < 2 {
            return Err(RegistryError::Conflict(format!(
                "module {name:?} has no earlier activated version to roll back to"
            )));
        }
        let previous = history[history.len() - 2];
        self.set_in_force(name, previous);
        self.modules.get_mut(name).expect("checked above").activation_history.pop();
        Ok(previous)
    }

    /// Takes `name@version` out of force after it crashed too often: back to the last
    /// version before it in the activation history, else to the builtin.
    pub fn auto_rollback(&mut self, name: &str, version: u32, reason: &str) -> RollbackOutcome {
        let Some(module) = self.modules.get(name) else { return RollbackOutcome::Stale };
        if self.in_force(module.kind) != Some((name, version)) {
            return RollbackOutcome::Stale;
        }
        let kind = module.kind;
        let previous = module.activation_history.iter().rev().copied().find(|v| *v != version);
        let module = self.modules.get_mut(name).expect("checked above");
        module.auto_rollback =
            Some(AutoRollback { from_version: version, to_version: previous, reason: reason.to_string(), at: now() });
        match previous {
            Some(good) => {
                while module.activation_history.last().is_some_and(|v| *v != good) {
                    module.activation_history.pop();
                }
                self.set_in_force(name, good);
                RollbackOutcome::ToVersion(good)
            }
            None => {
                self.activate_builtin(kind);
                RollbackOutcome::ToBuiltin
            }
        }
    }

    /// Deletes a module; if it was in force, its kind falls back to the builtin.
    pub fn remove(&mut self, name: &str) -> Result<(), RegistryError> {
        let module = self.modules.remove(name).ok_or_else(|| not_found(name))?;
        if self.in_force.get(&module.kind).map(String::as_str) == Some(name) {
            self.in_force.remove(&module.kind);
        }
        if self.shadow.get(&module.kind).is_some_and(|s| s.module == name) {
            self.shadow.remove(&module.kind);
        }
        // Its settings go with it: a module uploaded again under the name starts without.
        self.settings.remove(name);
        Ok(())
    }

    /// Whether GC must never offer `name@version`: in force, in shadow, or the newest
    /// version (kept so version numbers only ever grow).
    pub fn version_protected(&self, name: &str, version: u32) -> bool {
        let Some(module) = self.modules.get(name) else { return false };
        self.in_force(module.kind) == Some((name, version))
            || self.shadow.get(&module.kind).is_some_and(|s| s.module == name && s.version == version)
            || module.versions.last().is_some_and(|v| v.version == version)
    }

    /// Removes one version (GC); returns its digest. Refused for a protected version.
    pub fn remove_version(&mut self, name: &str, version: u32) -> Result<String, RegistryError> {
        if self.version_protected(name, version) {
            return Err(RegistryError::Conflict(format!(
                "{name}@{version} is in force, in shadow or the newest version"
            )));
        }
        let module = self.modules.get_mut(name).ok_or_else(|| not_found(name))?;
        let position = module
            .versions
            .iter()
            .position(|v| v.version == version)
            .ok_or_else(|| RegistryError::NotFound(format!("module {name:?} has no version {version}")))?;
        let removed = module.versions.remove(position);
        module.activation_history.retain(|v| *v != version);
        Ok(removed.digest)
    }

    /// Whether any version of any module has this digest.
    pub fn references(&self, digest: &str) -> bool {
        self.modules.values().any(|m| m.versions.iter().any(|v| v.digest == digest))
    }

    /// Runs `name@version` (latest if `None`) in shadow, replacing any shadow of its kind.
    pub fn start_shadow(&mut self, name: &str, version: Option<u32>) -> Result<u32, RegistryError> {
        let module = self.modules.get(name).ok_or_else(|| not_found(name))?;
        let version = match version {
            Some(v) => module
                .version(v)
                .map(|v| v.version)
                .ok_or_else(|| RegistryError::NotFound(format!("module {name:?} has no version {v}")))?,
            None => module
                .versions
                .last()
                .map(|v| v.version)
                .ok_or_else(|| RegistryError::NotFound(format!("module {name:?} has no versions")))?,
        };
        if self.in_force(module.kind) == Some((name, version)) {
            return Err(RegistryError::Conflict(format!(
                "{name}@{version} is already in force; shadow another version"
            )));
        }
        self.shadow.insert(module.kind, ShadowRef { module: name.to_string(), version });
        Ok(version)
    }

    /// The shadow of `name`, if it runs one.
    pub fn shadow_of(&self, name: &str) -> Option<&ShadowRef> {
        let kind = self.modules.get(name)?.kind;
        self.shadow.get(&kind).filter(|s| s.module == name)
    }

    pub fn stop_shadow(&mut self, name: &str) -> Result<(), RegistryError> {
        let kind = self.modules.get(name).ok_or_else(|| not_found(name))?.kind;
        match self.shadow.get(&kind) {
            Some(s) if s.module == name => {
                self.shadow.remove(&kind);
                Ok(())
            }
            _ => Err(RegistryError::NotFound(format!("module {name:?} runs no shadow"))),
        }
    }

    /// Puts the shadowed version in force and ends the shadow.
    pub fn promote_shadow(&mut self, name: &str) -> Result<u32, RegistryError> {
        let version = self
            .shadow_of(name)
            .map(|s| s.version)
            .ok_or_else(|| RegistryError::NotFound(format!("module {name:?} runs no shadow to promote")))?;
        self.stop_shadow(name)?;
        self.activate(name, Some(version))
    }

    /// The builtin of `kind` is back in force.
    pub fn activate_builtin(&mut self, kind: GuestKind) {
        if let Some(previous) = self.in_force.remove(&kind)
            && let Some(module) = self.modules.get_mut(&previous)
        {
            module.active_version = None;
        }
    }

    fn set_in_force(&mut self, name: &str, version: u32) {
        let kind = self.modules[name].kind;
        if let Some(previous) = self.in_force.insert(kind, name.to_string())
            && previous != name
            && let Some(module) = self.modules.get_mut(&previous)
        {
            module.active_version = None;
        }
        self.modules.get_mut(name).expect("caller checked").active_version = Some(version);
    }

    /// Digests of every version of every module: what the blob store must keep.
    pub fn digests(&self) -> impl Iterator<Item = &str> {
        self.modules.values().flat_map(|m| m.versions.iter().map(|v| v.digest.as_str()))
    }
}

/// What this node knows of one module beyond the shared index.
#[derive(Clone, Debug, Default)]
struct LocalStatus {
    failed: bool,
    last_error: Option<String>,
    calls: u64,
    failures: u64,
}

/// A builtin module: shipped in the binary, present on every host.
struct Builtin {
    kind: GuestKind,
    version: ModuleVersion,
    bytes: &'static [u8],
}

/// One node's view of the modules.
pub struct Registry {
    shared: SharedIndex,
    builtins: BTreeMap<String, Builtin>,
    local: HashMap<String, LocalStatus>,
    /// What is in force on this node per kind; can differ from `shared` when activating
    /// the shared choice failed here.
    active: BTreeMap<GuestKind, (String, u32)>,
    /// The settings the module in force per kind was activated with.
    active_settings: BTreeMap<GuestKind, String>,
    blobs: BlobCache,
}

/// Component bytes by digest: on disk under the data dir, else in memory.
enum BlobCache {
    Disk(PathBuf),
    Memory(HashMap<String, Vec<u8>>),
}

/// The one version a builtin module has: its bytes are the binary's, never uploaded.
pub const BUILTIN_VERSION: u32 = 1;

impl Registry {
    /// `dir`: the data dir (blobs are cached in `dir/modules/blobs`); `None` keeps them in memory.
    pub fn open(dir: Option<&Path>) -> std::io::Result<Registry> {
        let blobs = match dir {
            Some(dir) => {
                let blobs = dir.join("modules").join("blobs");
                std::fs::create_dir_all(&blobs)?;
                BlobCache::Disk(blobs)
            }
            None => BlobCache::Memory(HashMap::new()),
        };
        Ok(Registry {
            shared: SharedIndex::default(),
            builtins: BTreeMap::new(),
            local: HashMap::new(),
            active: BTreeMap::new(),
            active_settings: BTreeMap::new(),
            blobs,
        })
    }

    pub fn add_builtin(&mut self, name: &str, kind: GuestKind, info: &ModuleInfo, bytes: &'static [u8]) {
        let version = ModuleVersion {
            version: BUILTIN_VERSION,
            digest: info.digest.clone(),
            size: info.size,
            wit_version: info.wit_version.clone(),
            imports: info.imports.clone(),
            uploaded_at: now(),
            signature: None,
        };
        self.builtins.insert(name.to_string(), Builtin { kind, version, bytes });
    }

    /// The builtin module of `kind`, if this binary ships one.
    pub fn builtin_of(&self, kind: GuestKind) -> Option<&str> {
        self.builtins.iter().find(|(_, b)| b.kind == kind).map(|(name, _)| name.as_str())
    }

    pub fn is_builtin(&self, name: &str) -> bool {
        self.builtins.contains_key(name)
    }

    pub fn shared(&self) -> &SharedIndex {
        &self.shared
    }

    pub fn set_shared(&mut self, shared: SharedIndex) {
        self.local.retain(|name, _| shared.modules.contains_key(name) || self.builtins.contains_key(name));
        self.shared = shared;
    }

    /// The kind of a module (shared or builtin).
    pub fn kind_of(&self, name: &str) -> Option<GuestKind> {
        self.builtins.get(name).map(|b| b.kind).or_else(|| self.shared.modules.get(name).map(|m| m.kind))
    }

    /// The digest of `name@version`, if it exists.
    pub fn digest_of(&self, name: &str, version: u32) -> Option<&str> {
        if let Some(b) = self.builtins.get(name) {
            return (version == 1).then_some(b.version.digest.as_str());
        }
        self.shared.modules.get(name)?.version(version).map(|v| v.digest.as_str())
    }

    /// What should be in force for `kind` according to the shared index.
    pub fn wanted(&self, kind: GuestKind) -> Option<(String, u32)> {
        match self.shared.in_force(kind) {
            Some((name, version)) => Some((name.to_string(), version)),
            None => self.builtin_of(kind).map(|name| (name.to_string(), 1)),
        }
    }

    /// What is in force on this node for `kind`.
    pub fn active(&self, kind: GuestKind) -> Option<(&str, u32)> {
        self.active.get(&kind).map(|(n, v)| (n.as_str(), *v))
    }

    pub fn in_force(&self, kind: GuestKind) -> Option<&str> {
        self.active(kind).map(|(n, _)| n)
    }

    /// The settings document `name`'s guests read now (`{}` when none were given).
    pub fn settings_of(&self, name: &str) -> String {
        self.shared
            .settings
            .get(name)
            .map_or_else(|| wasmplane_runtime::NO_SETTINGS.to_string(), |value| value.to_string())
    }

    /// Whether what is in force for `kind` is not what the index wants: another module or
    /// version, or other settings. Returns what it wants.
    pub fn to_activate(&self, kind: GuestKind) -> Option<(String, u32)> {
        let (name, version) = self.wanted(kind)?;
        let current = self.active(kind) == Some((name.as_str(), version))
            && self.active_settings.get(&kind).is_some_and(|s| *s == self.settings_of(&name));
        (!current).then_some((name, version))
    }

    /// `name@version` is in force for `kind`, with the module's settings as they are now
    /// (read at its activation, from the same index).
    pub fn mark_active(&mut self, kind: GuestKind, name: &str, version: u32) {
        self.active_settings.insert(kind, self.settings_of(name));
        self.active.insert(kind, (name.to_string(), version));
        let status = self.local.entry(name.to_string()).or_default();
        status.failed = false;
        status.last_error = None;
    }

    pub fn mark_failed(&mut self, name: &str, error: &str) {
        let status = self.local.entry(name.to_string()).or_default();
        status.failures += 1;
        status.failed = true;
        status.last_error = Some(error.to_string());
    }

    pub fn count_calls(&mut self, name: &str, calls: u64) {
        self.local.entry(name.to_string()).or_default().calls += calls;
    }

    /// A module as the API shows it.
    pub fn get(&self, name: &str) -> Option<ModuleRecord> {
        let local = self.local.get(name).cloned().unwrap_or_default();
        let kind = self.kind_of(name)?;
        let active_here = match kind {
            // GC runs in the operator, maybe elsewhere: in force is what the cluster's index
            // puts in force (the builtin where it names none).
            GuestKind::Gc => self.wanted(kind).filter(|(n, _)| n == name).map(|(_, v)| v),
            _ => self.active.values().find(|(n, _)| n == name).map(|(_, v)| *v),
        };
        let (builtin, versions, history, auto_rollback) = match self.builtins.get(name) {
            Some(b) => (true, vec![b.version.clone()], active_here.into_iter().collect(), None),
            None => {
                let m = self.shared.modules.get(name)?;
                (false, m.versions.clone(), m.activation_history.clone(), m.auto_rollback.clone())
            }
        };
        let status = if active_here.is_some() {
            ModuleStatus::Active
        } else if local.failed {
            ModuleStatus::Failed
        } else {
            ModuleStatus::Inactive
        };
        Some(ModuleRecord {
            name: name.to_string(),
            kind,
            builtin,
            versions,
            active_version: active_here,
            activation_history: history,
            status,
            last_error: local.last_error,
            calls: local.calls,
            failures: local.failures,
            auto_rollback,
            shadow_version: self.shared.shadow_of(name).map(|s| s.version),
            settings: self.shared.settings.get(name).cloned(),
        })
    }

    pub fn list(&self) -> Vec<ModuleRecord> {
        let mut names: Vec<&String> = self.builtins.keys().chain(self.shared.modules.keys()).collect();
        names.sort();
        names.dedup();
        names.into_iter().filter_map(|n| self.get(n)).collect()
    }

    fn blob_path(dir: &Path, digest: &str) -> PathBuf {
        dir.join(format!("{}.wasm", digest.trim_start_matches("sha256:")))
    }

    pub fn has_blob(&self, digest: &str) -> bool {
        match &self.blobs {
            BlobCache::Disk(dir) => Self::blob_path(dir, digest).exists(),
            BlobCache::Memory(map) => map.contains_key(digest),
        }
    }

    /// Keeps component bytes (fetched from the kvstore or uploaded here) for loading.
    pub fn cache_blob(&mut self, digest: &str, bytes: &[u8]) -> std::io::Result<()> {
        match &mut self.blobs {
            BlobCache::Disk(dir) => {
                let path = Self::blob_path(dir, digest);
                if !path.exists() {
                    write_atomically(&path, bytes)?;
                }
            }
            BlobCache::Memory(map) => {
                map.entry(digest.to_string()).or_insert_with(|| bytes.to_vec());
            }
        }
        Ok(())
    }

    /// The bytes of `name@version`.
    pub fn module_bytes(&self, name: &str, version: u32) -> std::io::Result<Vec<u8>> {
        if let Some(b) = self.builtins.get(name) {
            return Ok(b.bytes.to_vec());
        }
        let not_here =
            || std::io::Error::new(std::io::ErrorKind::NotFound, format!("{name}@{version} is not in the registry"));
        let digest = self.digest_of(name, version).ok_or_else(not_here)?;
        match &self.blobs {
            BlobCache::Disk(dir) => std::fs::read(Self::blob_path(dir, digest)),
            BlobCache::Memory(map) => map.get(digest).cloned().ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("the bytes of {name}@{version} ({digest}) have not been fetched"),
                )
            }),
        }
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(digest: &str) -> ModuleInfo {
        ModuleInfo {
            digest: digest.into(),
            size: 10,
            wit_version: "1.0.0".into(),
            imports: vec![],
            kind: GuestKind::ServiceTranslator,
            interface: None,
        }
    }

    #[test]
    fn versions_are_content_addressed() {
        let mut index = SharedIndex::default();
        assert_eq!(index.add_version("m", GuestKind::ServiceTranslator, &info("sha256:a"), None), Ok(1));
        assert_eq!(index.add_version("m", GuestKind::ServiceTranslator, &info("sha256:b"), None), Ok(2));
        assert_eq!(
            index.add_version("m", GuestKind::ServiceTranslator, &info("sha256:a"), None),
            Ok(1),
            "same bytes, same version"
        );
        assert!(matches!(
            index.add_version("m", GuestKind::Gc, &info("sha256:c"), None),
            Err(RegistryError::Conflict(_))
        ));
        // A signature given again with the same bytes is recorded once; settings go with the module.
        index.add_version("m", GuestKind::ServiceTranslator, &info("sha256:a"), Some("sig")).unwrap();
        assert_eq!(index.modules["m"].version(1).unwrap().signature.as_deref(), Some("sig"));
        index.set_settings("m", Some(serde_json::json!({"a": 1})));
        index.remove("m").unwrap();
        assert!(index.settings.is_empty(), "removed with the module");
    }

    #[test]
    fn activation_rollback_and_removal_move_what_is_in_force() {
        let mut index = SharedIndex::default();
        index.add_version("m", GuestKind::ServiceTranslator, &info("sha256:a"), None).unwrap();
        index.add_version("m", GuestKind::ServiceTranslator, &info("sha256:b"), None).unwrap();
        index.add_version("n", GuestKind::ServiceTranslator, &info("sha256:c"), None).unwrap();
        assert_eq!(index.in_force(GuestKind::ServiceTranslator), None, "builtin until something is activated");
        assert!(matches!(index.rollback("m"), Err(RegistryError::Conflict(_))));
        assert_eq!(index.activate("m", Some(1)), Ok(1));
        assert_eq!(index.activate("m", None), Ok(2));
        assert_eq!(index.in_force(GuestKind::ServiceTranslator), Some(("m", 2)));
        assert_eq!(index.rollback("m"), Ok(1));
        assert_eq!(index.in_force(GuestKind::ServiceTranslator), Some(("m", 1)));
        index.activate("n", None).unwrap();
        assert_eq!(index.modules["m"].active_version, None, "one module in force per kind");
        assert_eq!(index.in_force(GuestKind::ServiceTranslator), Some(("n", 1)));
        index.remove("n").unwrap();
        assert_eq!(index.in_force(GuestKind::ServiceTranslator), None);
        assert!(matches!(index.activate("m", Some(9)), Err(RegistryError::NotFound(_))));
    }

    #[test]
    fn auto_rollback_returns_to_the_last_other_version_or_the_builtin() {
        let mut index = SharedIndex::default();
        for d in ["sha256:a", "sha256:b"] {
            index.add_version("m", GuestKind::ServiceTranslator, &info(d), None).unwrap();
        }
        index.activate("m", Some(1)).unwrap();
        index.activate("m", Some(2)).unwrap();
        index.activate("m", Some(2)).unwrap();
        assert_eq!(index.auto_rollback("m", 1, "stale"), RollbackOutcome::Stale, "v1 is not in force");
        assert_eq!(index.auto_rollback("m", 2, "crashed"), RollbackOutcome::ToVersion(1));
        assert_eq!(index.in_force(GuestKind::ServiceTranslator), Some(("m", 1)));
        assert_eq!(index.modules["m"].activation_history, vec![1]);
        assert_eq!(index.modules["m"].auto_rollback.as_ref().unwrap().reason, "crashed");
        assert_eq!(index.auto_rollback("m", 1, "crashed again"), RollbackOutcome::ToBuiltin, "nothing before v1");
        assert_eq!(index.in_force(GuestKind::ServiceTranslator), None);
    }

    #[test]
    fn registry_reports_local_status_over_the_shared_index() {
        let mut registry = Registry::open(None).unwrap();
        registry.add_builtin("builtin", GuestKind::ServiceTranslator, &info("sha256:z"), b"\0asm");
        let mut index = SharedIndex::default();
        index.add_version("m", GuestKind::ServiceTranslator, &info("sha256:a"), None).unwrap();
        index.activate("m", None).unwrap();
        registry.set_shared(index);
        assert_eq!(registry.wanted(GuestKind::ServiceTranslator), Some(("m".into(), 1)));
        registry.mark_active(GuestKind::ServiceTranslator, "builtin", 1);
        registry.mark_failed("m", "boom");
        let m = registry.get("m").unwrap();
        assert_eq!((m.status, m.active_version, m.last_error.as_deref()), (ModuleStatus::Failed, None, Some("boom")));
        assert_eq!(registry.get("builtin").unwrap().status, ModuleStatus::Active);
        assert!(registry.module_bytes("m", 1).is_err(), "bytes not fetched yet");
        registry.cache_blob("sha256:a", b"bytes").unwrap();
        assert_eq!(registry.module_bytes("m", 1).unwrap(), b"bytes");
        assert_eq!(registry.list().iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["builtin", "m"]);
    }
}
