//! A directory of Kubernetes manifests standing in for the API server (embedded mode).
//!
//! A malformed document is reported with its file and position and skipped; everything
//! else stays in force. The directory is polled rather than watched with inotify: polling
//! works on every file system, including ConfigMap mounts that swap a symlink.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize as _;
use sha2::{Digest, Sha256};
use wasmplane_model::state::ClusterObject;

use crate::convert::object_from_json;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestError {
    pub file: PathBuf,
    /// 1-based position of the document in its file.
    pub document: usize,
    pub reason: String,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} document {}: {}", self.file.display(), self.document, self.reason)
    }
}

#[derive(Debug, Default)]
pub struct ManifestSet {
    pub objects: Vec<ClusterObject>,
    pub errors: Vec<ManifestError>,
    pub files: usize,
}

fn manifest_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            manifest_files(&path, out)?;
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json")) {
            out.push(path);
        }
    }
    Ok(())
}

fn sorted_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    manifest_files(dir, &mut files)?;
    files.sort();
    Ok(files)
}

fn push_document(set: &mut ManifestSet, file: &Path, document: usize, value: serde_json::Value) {
    if value.is_null() {
        return;
    }
    if value.get("kind").and_then(|k| k.as_str()) == Some("List") {
        for item in value.get("items").and_then(|i| i.as_array()).cloned().unwrap_or_default() {
            push_document(set, file, document, item);
        }
        return;
    }
    match object_from_json(value) {
        Ok(Some(object)) => set.objects.push(object),
        Ok(None) => {}
        Err(e) => set.errors.push(ManifestError { file: file.to_path_buf(), document, reason: e.to_string() }),
    }
}

/// Loads every `*.yaml`, `*.yml` and `*.json` below `dir`, in a stable order.
pub fn load_dir(dir: &Path) -> std::io::Result<ManifestSet> {
    let mut set = ManifestSet::default();
    for file in sorted_files(dir)? {
        set.files += 1;
        let text = match std::fs::read_to_string(&file) {
            Ok(t) => t,
            Err(e) => {
                set.errors.push(ManifestError { file, document: 0, reason: e.to_string() });
                continue;
            }
        };
        for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            match serde_json::Value::deserialize(doc) {
                Ok(value) => push_document(&mut set, &file, i + 1, value),
                Err(e) => {
                    set.errors.push(ManifestError { file: file.clone(), document: i + 1, reason: e.to_string() });
                    // The YAML stream cannot be resumed past a syntax error.
                    break;
                }
            }
        }
    }
    for e in &set.errors {
        tracing::warn!("skipping manifest: {e}");
    }
    Ok(set)
}

fn fingerprint(dir: &Path) -> std::io::Result<Vec<u8>> {
    let mut hasher = Sha256::new();
    for file in sorted_files(dir)? {
        hasher.update(file.as_os_str().as_encoded_bytes());
        hasher.update([0]);
        hasher.update(std::fs::read(&file).unwrap_or_default());
        hasher.update([0]);
    }
    Ok(hasher.finalize().to_vec())
}

/// Sends the directory's contents now and again whenever they change; returns when the
/// receiver is gone.
pub async fn watch_dir(dir: PathBuf, interval: Duration, tx: tokio::sync::mpsc::Sender<ManifestSet>) {
    let mut last: Option<Vec<u8>> = None;
    loop {
        let scan = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || fingerprint(&dir).and_then(|f| Ok((f, load_dir(&dir)?)))).await
        };
        match scan {
            Ok(Ok((print, set))) if last.as_ref() != Some(&print) => {
                last = Some(print);
                if tx.send(set).await.is_err() {
                    return;
                }
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(dir = %dir.display(), "reading manifests: {e}"),
            Err(e) => tracing::warn!("manifest scan failed: {e}"),
        }
        if tx.is_closed() {
            return;
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n---\napiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: a}}\n- {apiVersion: v1, kind: Namespace, metadata: {name: b}}\n";

    #[test]
    fn loads_documents_and_reports_bad_ones_without_losing_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("good.yaml"), GOOD).unwrap();
        std::fs::write(dir.path().join("broken.yaml"), "apiVersion: v1\nkind: Namespace\nmetadata: {name: ok}\n---\nkind: [unclosed\n").unwrap();
        std::fs::write(dir.path().join("invalid.yml"), "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{port: 80, protocol: FOO}]}\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        let set = load_dir(dir.path()).unwrap();
        assert_eq!(set.files, 3);
        assert_eq!(set.objects.len(), 4, "shop, a, b from good.yaml and ok from broken.yaml");
        assert_eq!(set.errors.len(), 2);
        assert!(set.errors[0].file.ends_with("broken.yaml") && set.errors[0].document == 2, "{:?}", set.errors);
        assert!(set.errors[1].to_string().contains("invalid.yml document 1: Service default/s: port 0: invalid protocol"), "{}", set.errors[1]);
    }

    #[test]
    fn example_cluster_loads_cleanly() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/manifests");
        let set = load_dir(&dir).unwrap();
        assert!(set.errors.is_empty(), "{:?}", set.errors);
        let services = set.objects.iter().filter(|o| matches!(o, ClusterObject::Service(_))).count();
        assert!(services >= 4, "{services}");
    }

    #[tokio::test]
    async fn watch_sends_on_change_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), GOOD).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let task = tokio::spawn(watch_dir(dir.path().to_path_buf(), Duration::from_millis(20), tx));
        assert_eq!(rx.recv().await.unwrap().objects.len(), 3);
        assert!(tokio::time::timeout(Duration::from_millis(150), rx.recv()).await.is_err(), "nothing changed");
        std::fs::write(dir.path().join("b.yaml"), "apiVersion: v1\nkind: Namespace\nmetadata: {name: new}\n").unwrap();
        let set = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await.unwrap().unwrap();
        assert_eq!(set.objects.len(), 4);
        drop(rx);
        tokio::time::timeout(Duration::from_secs(2), task).await.unwrap().unwrap();
    }
}
