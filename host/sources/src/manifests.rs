//! A directory of Kubernetes manifests standing in for the API server (embedded mode).
//!
//! Every `*.yaml`, `*.yml` and `*.json` file below the directory is read, in path order.
//! A malformed document is reported with its file and position and skipped; every other
//! document stays in force, so one typo does not withdraw the whole cluster. An object
//! defined twice (the same kind, namespace and name) is taken from its first document in
//! path order; the later ones are reported and skipped. Kinds
//! wasmplane does not use (Deployments, ConfigMaps, ...) are ignored, so an ordinary
//! application's manifests can be pointed at as they are.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize as _;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use wasmplane_model::ObjectKey;
use wasmplane_model::state::{ClusterObject, ObjectKind};

use crate::convert::object_from_json;

/// One document that was skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} document {document}: {reason}", file.display())]
pub struct ManifestError {
    pub file: PathBuf,
    /// 1-based position of the document in its file (`---`-separated); 0 when the file
    /// as a whole is unusable (not UTF-8).
    pub document: usize,
    pub reason: String,
}

/// Everything one load of a directory produced.
#[derive(Debug, Clone, Default)]
pub struct ManifestSet {
    pub objects: Vec<ClusterObject>,
    pub errors: Vec<ManifestError>,
    /// Manifest files read.
    pub files: usize,
}

/// Loads every manifest file below `dir`, in a stable order.
///
/// I/O errors (the directory or a file cannot be read) fail the whole load: a partial
/// read would look like deleted objects. Content errors are collected in
/// [`ManifestSet::errors`] (and logged) instead.
pub fn load_dir(dir: &Path) -> io::Result<ManifestSet> {
    Ok(parse_files(&read_files(dir)?))
}

/// Sends the directory's contents now, then again whenever they change; returns when the
/// receiver is dropped.
///
/// The directory is polled (a SHA-256 over the relative paths and contents every
/// `interval`) rather than watched with inotify on purpose: polling works on every file
/// system (network mounts, overlay, bind mounts) and sees ConfigMap volumes, which update
/// by swapping a `..data` symlink that inotify watches on the files miss. Nothing is sent
/// while the directory cannot be read, so a transient failure keeps the last good set.
/// After the first, a change is sent once two polls in a row read it alike ([`Settling`]).
pub async fn watch_dir(dir: PathBuf, interval: Duration, tx: mpsc::Sender<ManifestSet>) {
    let mut settling = Settling::default();
    let mut last_failure: Option<String> = None;
    loop {
        let scan = {
            let (dir, settling) = (dir.clone(), settling.clone());
            tokio::task::spawn_blocking(move || scan(&dir, &settling)).await
        };
        let failure = match scan {
            Ok(Ok((fingerprint, set))) => {
                let settled = settling.observe(fingerprint);
                if let Some(set) = set.filter(|_| settled) {
                    tracing::debug!(dir = %dir.display(), fingerprint = %hex::encode(&fingerprint[..8]), "manifests changed");
                    if tx.send(set).await.is_err() {
                        return;
                    }
                }
                None
            }
            Ok(Err(e)) => Some(format!("reading manifests: {e}")),
            Err(e) => Some(format!("manifest scan failed: {e}")),
        };
        // Once per distinct failure, not once per poll.
        if let Some(f) = &failure
            && last_failure.as_ref() != Some(f)
        {
            tracing::warn!(dir = %dir.display(), "{f} (keeping the last good set, retrying)");
        }
        last_failure = failure;
        tokio::select! {
            _ = tx.closed() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// One poll: the contents' fingerprint, and their objects when `settling` would send them.
fn scan(dir: &Path, settling: &Settling) -> io::Result<([u8; 32], Option<ManifestSet>)> {
    let files = read_files(dir)?;
    let print = fingerprint(&files);
    Ok((print, settling.would_send(print).then(|| parse_files(&files))))
}

/// When a change of the directory is sent: the first contents at once, and after that a
/// change only once two polls in a row read it alike. A file caught halfway through being
/// written (an editor saving in place, `cp`) reads differently at the next poll, and a half
/// that happens to parse would otherwise look like deleted objects for one poll interval,
/// their rules taken out of the kernel and put back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settling {
    /// What was sent last.
    sent: Option<[u8; 32]>,
    /// What the previous poll read, when it differed from what was sent.
    pending: Option<[u8; 32]>,
}

impl Settling {
    /// Whether contents with `print` would be sent now.
    pub fn would_send(&self, print: [u8; 32]) -> bool {
        self.sent.is_none() || (self.sent != Some(print) && self.pending == Some(print))
    }

    /// One poll's reading; true when it is to be sent.
    pub fn observe(&mut self, print: [u8; 32]) -> bool {
        let send = self.would_send(print);
        if send {
            self.sent = Some(print);
            self.pending = None;
        } else {
            self.pending = (self.sent != Some(print)).then_some(print);
        }
        send
    }
}

/// A manifest file read into memory, so that what is hashed is exactly what is parsed.
struct ManifestFile {
    path: PathBuf,
    relative: PathBuf,
    bytes: Vec<u8>,
}

fn with_path(e: io::Error, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn read_files(dir: &Path) -> io::Result<Vec<ManifestFile>> {
    let mut paths = Vec::new();
    walk(dir, &mut paths, &mut HashSet::new())?;
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let bytes = std::fs::read(&path).map_err(|e| with_path(e, &path))?;
            let relative = path.strip_prefix(dir).unwrap_or(&path).to_path_buf();
            Ok(ManifestFile { path, relative, bytes })
        })
        .collect()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>, visited: &mut HashSet<PathBuf>) -> io::Result<()> {
    // Symlinks are followed (ConfigMap files are symlinks); this stops a loop of them.
    if !visited.insert(dir.canonicalize().map_err(|e| with_path(e, dir))?) {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).map_err(|e| with_path(e, dir))? {
        let entry = entry.map_err(|e| with_path(e, dir))?;
        // Dot-entries are hidden files and, in ConfigMap and Secret volumes, the `..data`
        // and `..<timestamp>` directories behind the visible symlinks: reading those would
        // load every manifest twice.
        if entry.file_name().as_encoded_bytes().starts_with(b".") {
            continue;
        }
        let path = entry.path();
        let meta = match std::fs::metadata(&path) {
            Ok(meta) => meta,
            // A dangling symlink: a file being removed by a ConfigMap update.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(with_path(e, &path)),
        };
        if meta.is_dir() {
            walk(&path, out, visited)?;
        } else if meta.is_file() && matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml" | "json")) {
            out.push(path);
        }
    }
    Ok(())
}

/// Length-prefixed fields, so that no two different directories hash alike; relative
/// paths, so that the same contents mounted elsewhere hash alike.
fn fingerprint(files: &[ManifestFile]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for file in files {
        let relative = file.relative.as_os_str().as_encoded_bytes();
        hasher.update((relative.len() as u64).to_le_bytes());
        hasher.update(relative);
        hasher.update((file.bytes.len() as u64).to_le_bytes());
        hasher.update(&file.bytes);
    }
    hasher.finalize().into()
}

/// Where each object of a load was first defined: file and document.
type FirstDefinitions<'a> = HashMap<(ObjectKind, ObjectKey), (&'a Path, usize)>;

fn parse_files(files: &[ManifestFile]) -> ManifestSet {
    let mut set = ManifestSet { files: files.len(), ..Default::default() };
    let mut first = FirstDefinitions::new();
    for file in files {
        parse_file(&mut set, &mut first, file);
    }
    for e in &set.errors {
        tracing::warn!(file = %e.file.display(), document = e.document, "skipping manifest document: {}", e.reason);
    }
    set
}

fn parse_file<'a>(set: &mut ManifestSet, first: &mut FirstDefinitions<'a>, file: &'a ManifestFile) {
    let text = match std::str::from_utf8(&file.bytes) {
        Ok(text) => text,
        Err(e) => {
            return set.errors.push(ManifestError {
                file: file.path.clone(),
                document: 0,
                reason: format!("not UTF-8: {e}"),
            });
        }
    };
    let is_json = file.path.extension().is_some_and(|e| e == "json");
    if is_json {
        // JSON is parsed as JSON: exact line numbers, and no YAML corner cases (tabs).
        for (n, value) in serde_json::Deserializer::from_str(text).into_iter::<Value>().enumerate() {
            match value {
                Ok(value) => push_document(set, first, &file.path, n + 1, value),
                Err(e) => {
                    set.errors.push(ManifestError {
                        file: file.path.clone(),
                        document: n + 1,
                        reason: format!("invalid JSON: {e}"),
                    });
                    break;
                }
            }
        }
        return;
    }
    for (n, (first_line, document)) in split_yaml(text).into_iter().enumerate() {
        match yaml_values(document) {
            Ok(values) => {
                for value in values {
                    push_document(set, first, &file.path, n + 1, value);
                }
            }
            Err(e) => {
                // Parse again at the document's place in the file, so that the error's line
                // numbers are the file's.
                let placed = format!("{}{document}", "\n".repeat(first_line - 1));
                let e = yaml_values(&placed).err().unwrap_or(e);
                set.errors.push(ManifestError {
                    file: file.path.clone(),
                    document: n + 1,
                    reason: format!("invalid YAML: {e}"),
                });
            }
        }
    }
}

fn yaml_values(text: &str) -> Result<Vec<Value>, serde_yaml::Error> {
    serde_yaml::Deserializer::from_str(text).map(Value::deserialize).collect()
}

/// Splits a YAML stream at its `---` (and `...`) lines into documents with their first
/// line (1-based), so that a syntax error spoils only its own document: libyaml cannot
/// resume a stream after one. A `---` at the start of a line always starts a document in
/// YAML, even inside a block scalar, so this agrees with the parser. Comments and
/// directives before a `---` stay with the document that follows; parts with nothing
/// else are not documents.
fn split_yaml(text: &str) -> Vec<(usize, &str)> {
    let mut documents = Vec::new();
    let (mut start, mut start_line, mut has_content, mut offset) = (0, 1, false, 0);
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let marker =
            |m: &str| line.strip_prefix(m).filter(|rest| rest.trim().is_empty() || rest.starts_with([' ', '\t']));
        let (begins, ends) = (marker("---"), marker("..."));
        if begins.is_some() && has_content {
            documents.push((start_line, &text[start..offset]));
            (start, start_line, has_content) = (offset, i + 1, false);
        }
        offset += line.len();
        let body = begins.unwrap_or(line).trim();
        if ends.is_none() && !body.is_empty() && !body.starts_with('#') && !line.starts_with('%') {
            has_content = true;
        }
        if ends.is_some() {
            if has_content {
                documents.push((start_line, &text[start..offset]));
            }
            (start, start_line, has_content) = (offset, i + 2, false);
        }
    }
    if has_content {
        documents.push((start_line, &text[start..]));
    }
    documents
}

/// Records one document's object, expanding lists; `kubectl get -o yaml` writes `List`,
/// the API `ServiceList` and the like, whose items may omit `apiVersion` and `kind`.
fn push_document<'a>(
    set: &mut ManifestSet,
    first: &mut FirstDefinitions<'a>,
    file: &'a Path,
    document: usize,
    value: Value,
) {
    let skip = |set: &mut ManifestSet, reason: String| {
        set.errors.push(ManifestError { file: file.to_path_buf(), document, reason })
    };
    let Value::Object(object) = &value else {
        if !value.is_null() {
            skip(set, "not a Kubernetes object (a mapping with apiVersion and kind)".into());
        }
        return;
    };
    let text = |field: &str| object.get(field).and_then(Value::as_str).filter(|s| !s.is_empty());
    let (Some(api_version), Some(kind)) = (text("apiVersion"), text("kind")) else {
        return skip(set, "not a Kubernetes object: apiVersion and kind are required".into());
    };
    if let Some(item_kind) = kind.strip_suffix("List")
        && let Some(items) = object.get("items").and_then(Value::as_array)
    {
        for (i, mut item) in items.iter().cloned().enumerate() {
            if let Some(item) = item.as_object_mut()
                && !item_kind.is_empty()
            {
                item.entry("apiVersion").or_insert_with(|| api_version.into());
                item.entry("kind").or_insert_with(|| item_kind.into());
            }
            let before = set.errors.len();
            push_document(set, first, file, document, item);
            for e in &mut set.errors[before..] {
                e.reason = format!("items[{i}]: {}", e.reason);
            }
        }
        return;
    }
    match object_from_json(value) {
        Ok(Some(object)) => match first.entry((object.kind(), object.key())) {
            Entry::Vacant(entry) => {
                entry.insert((file, document));
                set.objects.push(object);
            }
            Entry::Occupied(entry) => {
                let (first_file, first_document) = entry.get();
                skip(
                    set,
                    format!(
                        "{:?} {} is defined again: the one in {} document {first_document} is used",
                        object.kind(),
                        object.key(),
                        first_file.display()
                    ),
                );
            }
        },
        Ok(None) => {}
        Err(e) => skip(set, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmplane_model::state::ObjectKind;

    fn write(dir: &Path, name: &str, text: &str) {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(path, text).unwrap();
    }

    /// The first contents go at once; after that, only what two polls in a row read alike:
    /// a file caught halfway through a write (read once) is never sent.
    #[test]
    fn a_change_is_sent_once_two_polls_read_it_alike() {
        let (whole, half, edited) = ([1; 32], [2; 32], [3; 32]);
        let mut settling = Settling::default();
        let polls = [whole, whole, half, whole, half, edited, edited, edited].map(|print| settling.observe(print));
        assert_eq!(polls, [true, false, false, false, false, false, true, false]);
    }

    /// Through the poller: a set written and left is sent one poll after it is first read;
    /// a half that stays for only one poll never is.
    #[tokio::test]
    async fn the_poller_sends_settled_contents_only() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a.yaml", MULTI);
        let (tx, mut rx) = mpsc::channel(8);
        // Polls a second apart; the half is there from half a second after one poll to half a
        // second after the next: exactly one poll reads it, with half a second to spare.
        let interval = Duration::from_secs(1);
        tokio::spawn(watch_dir(dir.path().to_path_buf(), interval, tx));
        let first = rx.recv().await.unwrap();
        assert!(!first.objects.is_empty());
        tokio::time::sleep(interval / 2).await;
        write(dir.path(), "a.yaml", &MULTI[..MULTI.len() / 2]);
        tokio::time::sleep(interval).await;
        write(dir.path(), "a.yaml", MULTI);
        assert!(tokio::time::timeout(interval * 3, rx.recv()).await.is_err(), "the half was sent");
        // An edit that stays is sent.
        write(dir.path(), "b.yaml", MULTI.replace("name: ", "name: b-").as_str());
        let edited = tokio::time::timeout(interval * 5, rx.recv()).await.expect("the edit is sent").unwrap();
        assert_eq!(edited.files, 2);
    }

    fn keys(set: &ManifestSet) -> Vec<String> {
        set.objects.iter().map(|o| format!("{:?} {}", o.kind(), o.key())).collect()
    }

    const MULTI: &str = "\
# The shop namespace and its web service.
---
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: shop}
spec: {replicas: 2}
---
# an empty document
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.20
  ports: [{name: http, port: 80, targetPort: 8080}]
";

    #[test]
    fn multi_document_files_lists_and_json() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a.yaml", MULTI);
        write(
            dir.path(),
            "sub/list.yml",
            "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: a}}\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}\n---\napiVersion: v1\nkind: NamespaceList\nitems: [{metadata: {name: b}}]\n",
        );
        write(dir.path(), "z.json", r#"{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}"#);
        write(dir.path(), "notes.txt", "not a manifest");
        let set = load_dir(dir.path()).unwrap();
        assert!(set.errors.is_empty(), "{:?}", set.errors);
        assert_eq!(set.files, 3);
        assert_eq!(keys(&set), vec!["Namespace shop", "Service shop/web", "Namespace a", "Namespace b", "Node node-a"]);
    }

    #[test]
    fn an_object_defined_twice_is_taken_from_its_first_document_and_the_later_reported() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a.yaml", MULTI);
        // The same service again in a later file (another cluster IP), and once more in a
        // list; a service of the same name in another namespace is another object.
        let again = MULTI.replace("10.96.0.20", "10.96.0.99");
        write(dir.path(), "b.yaml", &again);
        write(
            dir.path(),
            "c.yaml",
            "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Service, metadata: {name: web, namespace: shop}, spec: {clusterIP: 10.96.0.98, ports: [{port: 80}]}}\n- {apiVersion: v1, kind: Service, metadata: {name: web, namespace: other}, spec: {clusterIP: 10.96.0.97, ports: [{port: 80}]}}\n",
        );
        let set = load_dir(dir.path()).unwrap();
        assert_eq!(keys(&set), vec!["Namespace shop", "Service shop/web", "Service other/web"]);
        let ClusterObject::Service(web) = &set.objects[1] else { panic!("{:?}", set.objects[1]) };
        assert_eq!(web.cluster_ips.iter().map(|ip| ip.as_str()).collect::<Vec<_>>(), ["10.96.0.20"], "the first one");
        let used =
            |document: usize| format!("the one in {} document {document} is used", dir.path().join("a.yaml").display());
        let reported: Vec<(String, usize, String)> = set
            .errors
            .iter()
            .map(|e| (e.file.file_name().unwrap().to_string_lossy().into_owned(), e.document, e.reason.clone()))
            .collect();
        assert_eq!(
            reported,
            [
                ("b.yaml".to_string(), 1, format!("Namespace shop is defined again: {}", used(1))),
                ("b.yaml".to_string(), 3, format!("Service shop/web is defined again: {}", used(3))),
                ("c.yaml".to_string(), 1, format!("items[0]: Service shop/web is defined again: {}", used(3))),
            ]
        );
    }

    #[test]
    fn malformed_yaml_is_reported_and_the_rest_stays() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "broken.yaml",
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: before}\n---\napiVersion: v1\nkind: [unclosed\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: after}\n",
        );
        write(dir.path(), "good.yaml", "apiVersion: v1\nkind: Namespace\nmetadata: {name: good}\n");
        write(
            dir.path(),
            "list.json",
            r#"{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "j"}} {"apiVersion": "#,
        );
        let set = load_dir(dir.path()).unwrap();
        assert_eq!(keys(&set), vec!["Namespace before", "Namespace after", "Namespace good", "Namespace j"]);
        assert_eq!(set.errors.len(), 2, "{:?}", set.errors);
        let yaml = &set.errors[0];
        assert_eq!((yaml.file.as_path(), yaml.document), (dir.path().join("broken.yaml").as_path(), 2));
        assert!(
            yaml.reason.starts_with("invalid YAML") && yaml.reason.contains("line 7"),
            "line numbers are the file's: {yaml}"
        );
        assert!(yaml.to_string().contains("broken.yaml document 2: invalid YAML"), "{yaml}");
        assert_eq!(
            (set.errors[1].document, set.errors[1].reason.starts_with("invalid JSON")),
            (2, true),
            "{}",
            set.errors[1]
        );
    }

    #[test]
    fn invalid_objects_are_reported_with_their_field() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "shop.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {ports: [{port: 80, protocol: FOO}]}\n---\n\
             apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n---\n\
             just a string\n---\n\
             metadata: {name: no-kind}\n---\n\
             apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: ok}}\n- {apiVersion: v1, kind: Pod, metadata: {name: p}, spec: {containers: [{name: c, ports: [{containerPort: 0}]}]}}\n",
        );
        let set = load_dir(dir.path()).unwrap();
        assert_eq!(keys(&set), vec!["Namespace shop", "Namespace ok"]);
        let errors: Vec<String> = set.errors.iter().map(|e| format!("{} {}", e.document, e.reason)).collect();
        assert_eq!(
            errors,
            vec![
                "1 Service shop/web: spec.ports[0] has invalid protocol \"FOO\" (TCP, UDP or SCTP)",
                "3 not a Kubernetes object (a mapping with apiVersion and kind)",
                "4 not a Kubernetes object: apiVersion and kind are required",
                "5 items[1]: Pod default/p: spec.containers[0].ports[0].containerPort is 0, not a port number (1-65535)",
            ]
        );
    }

    #[test]
    fn yaml_documents_split_where_the_parser_splits_them() {
        let text =
            "# head\n%YAML 1.2\n---\na: 1\n--- # c\nb: |\n  --- not a marker\n  x\n---\n---\n...\nc: 3\n...\n# tail\n";
        let docs = split_yaml(text);
        assert_eq!(docs.iter().map(|(line, _)| *line).collect::<Vec<_>>(), vec![1, 5, 12]);
        let values: Vec<Value> = docs.iter().flat_map(|(_, d)| yaml_values(d).unwrap()).collect();
        assert_eq!(
            values,
            vec![
                serde_json::json!({"a": 1}),
                serde_json::json!({"b": "--- not a marker\nx\n"}),
                serde_json::json!({"c": 3})
            ]
        );
        assert!(split_yaml("").is_empty() && split_yaml("# nothing\n---\n").is_empty());
        assert_eq!(split_yaml("a: 1\r\n---\r\nb: 2"), vec![(1, "a: 1\r\n"), (2, "---\r\nb: 2")]);
    }

    #[cfg(unix)]
    #[test]
    fn configmap_volumes_are_read_once() {
        // The kubelet's layout: visible symlinks into `..data`, itself a symlink to a
        // timestamped directory swapped on update.
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "..2025_01_01_00_00_00.1/ns.yaml",
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop}\n",
        );
        std::os::unix::fs::symlink("..2025_01_01_00_00_00.1", dir.path().join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/ns.yaml", dir.path().join("ns.yaml")).unwrap();
        std::os::unix::fs::symlink("..data/gone.yaml", dir.path().join("gone.yaml")).unwrap();
        std::os::unix::fs::symlink(".", dir.path().join("loop")).unwrap();
        let set = load_dir(dir.path()).unwrap();
        assert_eq!((set.files, keys(&set)), (1, vec!["Namespace shop".to_string()]));
    }

    #[test]
    fn missing_directory_is_an_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = load_dir(&dir.path().join("absent")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("absent"), "{e}");
    }

    #[test]
    fn example_cluster_loads_cleanly() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/manifests");
        let set = load_dir(&dir).unwrap();
        assert!(set.errors.is_empty(), "{:?}", set.errors);
        assert_eq!(set.files, 4);
        let count = |kind| set.objects.iter().filter(|o| o.kind() == kind).count();
        assert_eq!(count(ObjectKind::Node), 2);
        assert_eq!(count(ObjectKind::Namespace), 3);
        assert_eq!(count(ObjectKind::Service), 6);
        assert_eq!(count(ObjectKind::EndpointSlice), 4);
        assert_eq!(count(ObjectKind::Pod), 8);
        assert_eq!(count(ObjectKind::NetworkPolicy), 2);
        let services: Vec<_> = set
            .objects
            .iter()
            .filter_map(|o| match o {
                ClusterObject::Service(s) if s.is_proxied() => Some(s.name.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(services, vec!["web", "api", "checkout", "dns"], "db is headless, payments ExternalName");
        // Every endpoint is a pod the example declares.
        let pod_ips: HashSet<&str> = set
            .objects
            .iter()
            .filter_map(|o| if let ClusterObject::Pod(p) = o { Some(p) } else { None })
            .flat_map(|p| p.ips.iter().map(|s| s.as_str()))
            .collect();
        for object in &set.objects {
            if let ClusterObject::EndpointSlice(s) = object {
                for address in s.endpoints.iter().flat_map(|e| &e.addresses) {
                    assert!(pod_ips.contains(address.as_str()), "{} has {address}, which no pod has", s.name);
                }
            }
        }
    }

    #[tokio::test]
    async fn watch_sends_on_change_only() {
        let dir = tempfile::tempdir().unwrap();
        let ns = |name: &str| format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}}}\n");
        write(dir.path(), "a.yaml", &ns("a"));
        let (tx, mut rx) = mpsc::channel(4);
        let task = tokio::spawn(watch_dir(dir.path().to_path_buf(), Duration::from_millis(50), tx));
        let first = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!(keys(&first), vec!["Namespace a"]);

        // Rewriting a file with the same bytes is no change.
        write(dir.path(), "a.yaml", &ns("a"));
        assert!(tokio::time::timeout(Duration::from_millis(300), rx.recv()).await.is_err(), "nothing changed");

        write(dir.path(), "a.yaml", &ns("b"));
        let changed = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!(keys(&changed), vec!["Namespace b"]);
        write(dir.path(), "c.yaml", &ns("c"));
        let added = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!((added.files, keys(&added)), (2, vec!["Namespace b".to_string(), "Namespace c".to_string()]));
        assert!(tokio::time::timeout(Duration::from_millis(200), rx.recv()).await.is_err(), "sent once per change");

        drop(rx);
        tokio::time::timeout(Duration::from_secs(5), task).await.expect("returns once the receiver is gone").unwrap();
    }

    #[test]
    fn fingerprint_covers_paths_and_contents_not_location() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for dir in [a.path(), b.path()] {
            write(dir, "x.yaml", "a: 1\n");
        }
        let print = |dir: &Path| fingerprint(&read_files(dir).unwrap());
        assert_eq!(print(a.path()), print(b.path()));
        std::fs::rename(b.path().join("x.yaml"), b.path().join("y.yaml")).unwrap();
        assert_ne!(print(a.path()), print(b.path()));
    }
}
