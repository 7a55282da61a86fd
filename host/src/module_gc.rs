//! GC of module versions (issue 7), run by the operator beside the kvstore GC: versions
//! nobody runs are offered to the same GC guest; what it names is removed from the shared
//! index (compare-and-swap) at a bounded rate, and a removed version's blob goes once no
//! other version refers to the same bytes.
//!
//! Never offered: the version in force, the one in shadow, a module's newest version (so
//! version numbers only grow). A version still in a module's activation history (a rollback
//! target) is offered with `owner-exists`: the default guest keeps those, a custom one may
//! trim history. Age is the time since upload, from the index, so it survives failovers.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use wasmplane_kvstore::blob;
use wasmplane_operator::{CandidateKind, GcCandidate, GcDecider};

use crate::module_store::{BLOB_PREFIX, MAX_CAS_ATTEMPTS, ModuleStore, StoreError};
use crate::registry::SharedIndex;

/// Candidate keys name a version inside the index: `/wasmplane/modules/index#<name>@<version>`.
pub fn candidate_key(name: &str, version: u32) -> String {
    format!("{}#{name}@{version}", crate::module_store::INDEX_KEY)
}

fn parse_candidate_key(key: &str) -> Option<(&str, u32)> {
    let (name, version) = key.strip_prefix(crate::module_store::INDEX_KEY)?.strip_prefix('#')?.rsplit_once('@')?;
    Some((name, version.parse().ok()?))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The versions GC may offer, with their age at `now` (unix seconds).
pub fn candidates(index: &SharedIndex, now: u64) -> Vec<GcCandidate> {
    let mut out = Vec::new();
    for (name, module) in &index.modules {
        for version in &module.versions {
            if index.version_protected(name, version.version) {
                continue;
            }
            out.push(GcCandidate {
                key: candidate_key(name, version.version),
                kind: CandidateKind::ModuleVersion,
                age: Duration::from_secs(now.saturating_sub(version.uploaded_at)),
                owner_exists: module.activation_history.contains(&version.version),
                mod_revision: 0,
            });
        }
    }
    out
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct ModuleGcReport {
    pub offered: usize,
    /// Versions removed, as candidate keys.
    pub removed: Vec<String>,
    /// Keys the guest named that were not offered (never acted on).
    pub refused: Vec<String>,
    /// Blobs deleted (digests).
    pub blobs_deleted: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ModuleGcError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("GC decider: {0}")]
    Decider(String),
}

/// One cycle: offer, ask, remove what was named (one index update per version, spaced to
/// stay under `deletes_per_second`), then drop blobs no version refers to any more.
pub async fn collect_module_versions(
    store: &ModuleStore,
    decider: &Arc<Mutex<dyn GcDecider>>,
    deletes_per_second: f64,
) -> Result<ModuleGcReport, ModuleGcError> {
    let (index, _) = store.load().await?;
    let offered = candidates(&index, unix_now());
    let mut report = ModuleGcReport { offered: offered.len(), ..Default::default() };
    if offered.is_empty() {
        return Ok(report);
    }
    let named = {
        let (decider, offered) = (decider.clone(), offered.clone());
        tokio::task::spawn_blocking(move || decider.lock().unwrap_or_else(PoisonError::into_inner).collect(&offered))
            .await
            .map_err(|e| ModuleGcError::Decider(e.to_string()))?
            .map_err(|e| ModuleGcError::Decider(e.0))?
    };
    let spacing = Duration::from_secs_f64(1.0 / deletes_per_second.max(0.001));
    for key in named {
        let Some((name, version)) = offered.iter().any(|c| c.key == key).then(|| parse_candidate_key(&key)).flatten()
        else {
            tracing::warn!(%key, "the GC guest named a module version it was not offered; kept");
            report.refused.push(key);
            continue;
        };
        if !report.removed.is_empty() {
            tokio::time::sleep(spacing).await;
        }
        if let Some(digest) = remove_version(store, name, version).await? {
            report.removed.push(key);
            // Bytes shared with another version (the same component uploaded twice) stay.
            let (index, _) = store.load().await?;
            if !index.references(&digest) {
                // Kept in memory until the index is read again: an upload of the same bytes
                // may publish a version naming them meanwhile (see `ModuleStore::ensure_blob`).
                let bytes = store.get_blob(&digest).await.ok();
                blob::delete_blob(store.kv().as_ref(), BLOB_PREFIX, digest.trim_start_matches("sha256:"))
                    .await
                    .map_err(StoreError::from)?;
                let (index, _) = store.load().await?;
                match bytes {
                    Some(bytes) if index.references(&digest) => {
                        store.ensure_blob(&digest, &bytes).await?;
                        tracing::info!(%digest, "blob named again by a concurrent upload: restored");
                    }
                    _ => report.blobs_deleted.push(digest),
                }
            }
        }
    }
    if !report.removed.is_empty() {
        tracing::info!(
            offered = report.offered,
            removed = report.removed.len(),
            blobs = report.blobs_deleted.len(),
            "module versions collected"
        );
    }
    Ok(report)
}

/// Removes `name@version` from the index by compare-and-swap; `None` if it is gone or became
/// protected meanwhile (activated, shadowed) — then nothing is removed.
async fn remove_version(store: &ModuleStore, name: &str, version: u32) -> Result<Option<String>, StoreError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (mut index, revision) = store.load().await?;
        let digest = match index.remove_version(name, version) {
            Ok(digest) => digest,
            Err(e) => {
                tracing::info!(module = name, version, "not collected: {e}");
                return Ok(None);
            }
        };
        if store.publish(revision, &index).await?.is_some() {
            return Ok(Some(digest));
        }
    }
    Err(StoreError::Contended(MAX_CAS_ATTEMPTS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_keys_round_trip() {
        let key = candidate_key("port-filter", 12);
        assert_eq!(parse_candidate_key(&key), Some(("port-filter", 12)));
        assert_eq!(parse_candidate_key("/wasmplane/locks/x"), None);
        assert_eq!(parse_candidate_key("/wasmplane/modules/index#x@notanumber"), None);
    }
}
