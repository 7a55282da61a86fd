//! The module registry: every uploaded module with its versions, which one is in force per
//! guest kind, and per-module status. Persisted in the data directory (component bytes by
//! digest plus an index), so a restart keeps modules.

use std::collections::BTreeMap;
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
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModuleStatus {
    /// Uploaded, not in force.
    Inactive,
    /// In force for its kind.
    Active,
    /// Its last activation or call failed; see `last_error`.
    Failed,
}

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
}

impl ModuleRecord {
    pub fn version(&self, version: u32) -> Option<&ModuleVersion> {
        self.versions.iter().find(|v| v.version == version)
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Index {
    modules: BTreeMap<String, ModuleRecord>,
    in_force: BTreeMap<GuestKind, String>,
}

pub struct Registry {
    dir: Option<PathBuf>,
    index: Index,
}

/// Module names are DNS labels: they appear in URLs, metrics and logs.
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

impl Registry {
    /// Opens (or starts) the registry in `dir/modules`; `None` keeps it in memory.
    pub fn open(dir: Option<&Path>) -> std::io::Result<Registry> {
        let dir = dir.map(|d| d.join("modules"));
        let mut index = Index::default();
        if let Some(dir) = &dir {
            std::fs::create_dir_all(dir.join("blobs"))?;
            match std::fs::read(dir.join("index.json")) {
                Ok(bytes) => {
                    index = serde_json::from_slice(&bytes)
                        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("modules/index.json: {e}")))?
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        // Builtins come from the binary, never from disk.
        index.modules.retain(|_, m| !m.builtin);
        Ok(Registry { dir, index })
    }

    pub fn add_builtin(&mut self, name: &str, kind: GuestKind, info: &ModuleInfo) {
        self.index.modules.insert(
            name.to_string(),
            ModuleRecord {
                name: name.to_string(),
                kind,
                builtin: true,
                versions: vec![ModuleVersion {
                    version: 1,
                    digest: info.digest.clone(),
                    size: info.size,
                    wit_version: info.wit_version.clone(),
                    imports: info.imports.clone(),
                    uploaded_at: now(),
                }],
                active_version: None,
                activation_history: vec![],
                status: ModuleStatus::Inactive,
                last_error: None,
                calls: 0,
                failures: 0,
            },
        );
    }

    pub fn get(&self, name: &str) -> Option<&ModuleRecord> {
        self.index.modules.get(name)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut ModuleRecord> {
        self.index.modules.get_mut(name)
    }

    pub fn list(&self) -> impl Iterator<Item = &ModuleRecord> {
        self.index.modules.values()
    }

    pub fn in_force(&self, kind: GuestKind) -> Option<&str> {
        self.index.in_force.get(&kind).map(String::as_str)
    }

    fn blob_path(&self, digest: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join("blobs").join(format!("{}.wasm", digest.trim_start_matches("sha256:"))))
    }

    pub fn read_blob(&self, digest: &str) -> std::io::Result<Vec<u8>> {
        match self.blob_path(digest) {
            Some(p) => std::fs::read(p),
            None => Err(std::io::Error::new(std::io::ErrorKind::NotFound, "in-memory registry keeps no bytes")),
        }
    }

    /// Records a new version (or returns the existing one with the same digest).
    pub fn add_version(&mut self, name: &str, kind: GuestKind, info: &ModuleInfo, bytes: &[u8]) -> std::io::Result<u32> {
        if let Some(path) = self.blob_path(&info.digest)
            && !path.exists()
        {
            write_atomically(&path, bytes)?;
        }
        let record = self.index.modules.entry(name.to_string()).or_insert_with(|| ModuleRecord {
            name: name.to_string(),
            kind,
            builtin: false,
            versions: vec![],
            active_version: None,
            activation_history: vec![],
            status: ModuleStatus::Inactive,
            last_error: None,
            calls: 0,
            failures: 0,
        });
        if let Some(existing) = record.versions.iter().find(|v| v.digest == info.digest) {
            return Ok(existing.version);
        }
        let version = record.versions.last().map_or(1, |v| v.version + 1);
        record.versions.push(ModuleVersion {
            version,
            digest: info.digest.clone(),
            size: info.size,
            wit_version: info.wit_version.clone(),
            imports: info.imports.clone(),
            uploaded_at: now(),
        });
        Ok(version)
    }

    /// `name@version` is now in force for its kind; whatever was in force before is not.
    pub fn mark_active(&mut self, name: &str, version: u32, push_history: bool) {
        let Some(kind) = self.index.modules.get(name).map(|m| m.kind) else { return };
        if let Some(previous) = self.index.in_force.insert(kind, name.to_string())
            && previous != name
            && let Some(prev) = self.index.modules.get_mut(&previous)
        {
            prev.active_version = None;
            if prev.status == ModuleStatus::Active {
                prev.status = ModuleStatus::Inactive;
            }
        }
        let record = self.index.modules.get_mut(name).expect("checked above");
        record.active_version = Some(version);
        record.status = ModuleStatus::Active;
        record.last_error = None;
        if push_history {
            record.activation_history.push(version);
        }
    }

    pub fn mark_failed(&mut self, name: &str, error: &str) {
        if let Some(record) = self.index.modules.get_mut(name) {
            record.failures += 1;
            record.last_error = Some(error.to_string());
            if record.active_version.is_none() {
                record.status = ModuleStatus::Failed;
            }
        }
    }

    pub fn remove(&mut self, name: &str) -> Option<ModuleRecord> {
        let record = self.index.modules.remove(name)?;
        if self.index.in_force.get(&record.kind).map(String::as_str) == Some(name) {
            self.index.in_force.remove(&record.kind);
        }
        Some(record)
    }

    pub fn save(&self) -> std::io::Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let bytes = serde_json::to_vec_pretty(&self.index).map_err(std::io::Error::other)?;
        write_atomically(&dir.join("index.json"), &bytes)
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(tmp, path)
}
