//! Recording the node-local model's changes as the service translator sees them.
//!
//! `wasmplane run --record FILE` writes JSON lines: one [`Header`] (format version, WIT
//! package, node context), then one [`RevisionRecord`] per model revision that changed
//! services: for each changed service exactly what the translator is called with (node
//! context, chain prefix, `Service`, `EndpointSlice`s, in the WIT types' serde form), the
//! services deleted, and what the translator in force made of it (validated, rendered
//! [`ObjectRules`], or the error that kept the last good rules). `wasmplane replay`
//! (`replay.rs`) and the SDK's test harness (`wasmplane_sdk::testing`) read the same file.
//!
//! Lines are flushed one revision at a time: a host stopped at any point leaves a file
//! whose every complete line is valid.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use wasmplane_model::state::ModelUpdate;
use wasmplane_model::{NodeLocalModel, ObjectKey};
use wasmplane_runtime::{WIT_PACKAGE, WIT_VERSION, convert, wit};

use crate::controller::{ModelObserver, TranslatorInForce};
use crate::nft::{self, ObjectRules};

/// The `format` of a recording's header line.
pub const FORMAT: &str = "wasmplane-recording";
/// The version of the line format written here; readers refuse any other.
pub const FORMAT_VERSION: u32 = 1;

/// First line of a recording.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub version: u32,
    /// The WIT package the inputs are shaped by (`wasmplane:dataplane@1.0.0`).
    pub wit: String,
    /// Version of the host that recorded.
    pub host: String,
    /// The node context when recording started.
    pub node: wit::NodeContext,
    /// How the recording node detected pod traffic (`pod-traffic` matches render by it);
    /// absent: by source address.
    #[serde(default, skip_serializing_if = "crate::nft::PodTraffic::is_source_address")]
    pub pod_traffic: crate::nft::PodTraffic,
    pub started_unix_ms: u64,
}

/// What one service translator call is given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServiceInput {
    /// `namespace/name`.
    pub key: String,
    pub prefix: String,
    pub service: wit::Service,
    pub slices: Vec<wit::EndpointSlice>,
}

impl ServiceInput {
    pub fn object_key(&self) -> ObjectKey {
        ObjectKey::new(&self.service.namespace, &self.service.name)
    }
}

/// What a translation came to: the validated, rendered rules or why there are none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// [`ObjectRules`] in its serialized form (compared as such).
    Rules(serde_json::Value),
    Error(String),
}

impl Outcome {
    pub fn of(result: &Result<ObjectRules, String>) -> Outcome {
        match result {
            Ok(rules) => Outcome::rules(rules),
            Err(e) => Outcome::Error(e.clone()),
        }
    }

    pub fn rules(rules: &ObjectRules) -> Outcome {
        // ObjectRules is plain maps and strings: serializing it cannot fail.
        Outcome::Rules(serde_json::to_value(rules).expect("ObjectRules serializes"))
    }
}

/// One model revision that changed services.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RevisionRecord {
    pub revision: u64,
    /// The node context every call of this revision sees.
    pub context: wit::NodeContext,
    /// The context changed: every service is in `services`.
    #[serde(default)]
    pub context_changed: bool,
    #[serde(default)]
    pub services: Vec<ServiceInput>,
    /// Services gone in this revision (`namespace/name`).
    #[serde(default)]
    pub deleted: Vec<String>,
    /// The translator in force live (`name@version`), when outputs were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub translator: Option<String>,
    /// Its settings, when it had any (none: `{}`, and in recordings of older hosts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub translator_settings: Option<serde_json::Value>,
    /// What the live translator produced per service (`namespace/name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<BTreeMap<String, Outcome>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: empty file, not a wasmplane recording")]
    Empty { path: PathBuf },
    #[error("{path}: not a wasmplane recording (line 1: {reason})")]
    NotARecording { path: PathBuf, reason: String },
    #[error("{path}: recording format version {found}, this wasmplane reads version {FORMAT_VERSION}")]
    UnsupportedVersion { path: PathBuf, found: u64 },
    #[error("{path}: recorded against {found}, this wasmplane implements {WIT_PACKAGE}@{WIT_VERSION}")]
    WitMismatch { path: PathBuf, found: String },
    #[error("{path}:{line}: {reason}")]
    BadLine { path: PathBuf, line: usize, reason: String },
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn input(key: &ObjectKey, view: &wasmplane_model::state::ServiceView) -> ServiceInput {
    ServiceInput {
        key: key.to_string(),
        prefix: nft::service_prefix(key),
        service: convert::service(&view.service),
        slices: convert::slices(view),
    }
}

/// The services a revision hands the translator, exactly as `Controller::run_update` picks
/// them: every service when the node context changed, else the changed ones.
fn revision_of(model: &NodeLocalModel, update: &ModelUpdate) -> RevisionRecord {
    let mut services = Vec::new();
    let mut deleted = Vec::new();
    if update.context_changed {
        services.extend(model.services.iter().map(|(k, v)| input(k, v)));
    }
    for change in &update.changed {
        match &change.view {
            None => deleted.push(change.key.to_string()),
            Some(view) if !update.context_changed => services.push(input(&change.key, view)),
            Some(_) => {}
        }
    }
    RevisionRecord {
        revision: model.revision,
        context: convert::node_context(&model.context),
        context_changed: update.context_changed,
        services,
        deleted,
        translator: None,
        translator_settings: None,
        outputs: None,
    }
}

struct Writer {
    path: PathBuf,
    out: BufWriter<File>,
    /// The revision seen by `model_changed`, written once its outputs are known.
    pending: Option<RevisionRecord>,
    /// A write failed: recording stopped (the host goes on).
    broken: bool,
}

impl Writer {
    fn write_line<T: Serialize>(&mut self, value: &T) {
        if self.broken {
            return;
        }
        let result = serde_json::to_writer(&mut self.out, value)
            .map_err(std::io::Error::from)
            .and_then(|_| self.out.write_all(b"\n"))
            .and_then(|_| self.out.flush());
        if let Err(e) = result {
            tracing::error!(path = %self.path.display(), "writing the recording failed, recording stopped: {e}");
            self.broken = true;
        }
    }

    fn flush_pending(&mut self) {
        if let Some(record) = self.pending.take() {
            self.write_line(&record);
        }
    }
}

/// Records every model revision that changes services, with the live translator's output.
/// Registered with `Controller::add_observer`.
pub struct ChangeRecorder {
    writer: Mutex<Writer>,
}

impl ChangeRecorder {
    /// Creates (truncates) `path` and writes the header. Services already in `model` (a
    /// recorder attached late) are written as a first revision, without outputs.
    pub fn create(
        path: &Path,
        model: &NodeLocalModel,
        pod_traffic: &crate::nft::PodTraffic,
    ) -> Result<ChangeRecorder, RecordError> {
        let io = |source| RecordError::Io { path: path.to_path_buf(), source };
        let file = File::create(path).map_err(io)?;
        let mut writer = Writer { path: path.to_path_buf(), out: BufWriter::new(file), pending: None, broken: false };
        let header = Header {
            format: FORMAT.into(),
            version: FORMAT_VERSION,
            wit: format!("{WIT_PACKAGE}@{WIT_VERSION}"),
            host: env!("CARGO_PKG_VERSION").into(),
            node: convert::node_context(&model.context),
            pod_traffic: pod_traffic.clone(),
            started_unix_ms: now_unix_ms(),
        };
        writer.write_line(&header);
        if !model.services.is_empty() {
            let snapshot = ModelUpdate { context_changed: true, ..Default::default() };
            writer.write_line(&revision_of(model, &snapshot));
        }
        if writer.broken {
            return Err(io(std::io::Error::other("writing the header failed")));
        }
        tracing::info!(path = %path.display(), "recording model changes");
        Ok(ChangeRecorder { writer: Mutex::new(writer) })
    }
}

impl ModelObserver for ChangeRecorder {
    fn model_changed(&self, model: &NodeLocalModel, update: &ModelUpdate) {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        // A revision whose outputs never came is still worth its inputs.
        writer.flush_pending();
        let record = revision_of(model, update);
        if !record.services.is_empty() || !record.deleted.is_empty() {
            writer.pending = Some(record);
        }
    }

    fn translated(
        &self,
        translator: Option<TranslatorInForce<'_>>,
        changes: &[(ObjectKey, Option<ObjectRules>)],
        errors: &BTreeMap<ObjectKey, String>,
    ) {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mut record) = writer.pending.take() else { return };
        let rules: HashMap<String, &ObjectRules> =
            changes.iter().filter_map(|(k, r)| r.as_ref().map(|r| (k.to_string(), r))).collect();
        let mut outputs = BTreeMap::new();
        for input in &record.services {
            // Every changed service either has new rules or a fresh error (run_update).
            let outcome = match rules.get(&input.key) {
                Some(rules) => Outcome::rules(rules),
                None => match errors.get(&input.object_key()) {
                    Some(e) => Outcome::Error(e.clone()),
                    None => continue,
                },
            };
            outputs.insert(input.key.clone(), outcome);
        }
        record.translator = translator.map(|t| format!("{}@{}", t.name, t.version));
        // Settings are JSON documents the host wrote: they parse.
        record.translator_settings = translator
            .filter(|t| t.settings != wasmplane_runtime::NO_SETTINGS)
            .and_then(|t| serde_json::from_str(t.settings).ok());
        record.outputs = Some(outputs);
        tracing::debug!(
            revision = record.revision,
            services = record.services.len(),
            deleted = record.deleted.len(),
            "revision recorded"
        );
        writer.write_line(&record);
    }
}

/// Reads a recording line by line: the header at once, then revisions as an iterator.
pub struct RecordingReader<R> {
    path: PathBuf,
    header: Header,
    lines: std::io::Lines<R>,
    line: usize,
}

impl RecordingReader<BufReader<File>> {
    pub fn open(path: &Path) -> Result<Self, RecordError> {
        let file = File::open(path).map_err(|source| RecordError::Io { path: path.to_path_buf(), source })?;
        RecordingReader::new(path, BufReader::new(file))
    }
}

impl<R: BufRead> RecordingReader<R> {
    /// `path` only names the source in errors.
    pub fn new(path: &Path, reader: R) -> Result<Self, RecordError> {
        let path = path.to_path_buf();
        let mut lines = reader.lines();
        let first = match lines.next() {
            None => return Err(RecordError::Empty { path }),
            Some(Err(source)) => return Err(RecordError::Io { path, source }),
            Some(Ok(line)) => line,
        };
        let header = parse_header(&path, &first)?;
        Ok(RecordingReader { path, header, lines, line: 1 })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Checks the header step by step, so the error says what is wrong: not ours, another
/// format version, another WIT major version, or a malformed header.
fn parse_header(path: &Path, line: &str) -> Result<Header, RecordError> {
    let not_ours = |reason: String| RecordError::NotARecording { path: path.to_path_buf(), reason };
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| not_ours(format!("not JSON: {e}")))?;
    if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
        return Err(not_ours(format!("no \"format\": \"{FORMAT}\" header")));
    }
    let version = value
        .get("version")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| not_ours("the header has no format version".into()))?;
    if version != u64::from(FORMAT_VERSION) {
        return Err(RecordError::UnsupportedVersion { path: path.to_path_buf(), found: version });
    }
    let wit = value.get("wit").and_then(|v| v.as_str()).unwrap_or_default();
    let major = |v: &str| v.split('.').next().map(str::to_string);
    let compatible = wit
        .strip_prefix(WIT_PACKAGE)
        .and_then(|rest| rest.strip_prefix('@'))
        .is_some_and(|v| major(v) == major(WIT_VERSION));
    if !compatible {
        return Err(RecordError::WitMismatch { path: path.to_path_buf(), found: wit.to_string() });
    }
    serde_json::from_value(value).map_err(|e| not_ours(format!("malformed header: {e}")))
}

impl<R: BufRead> Iterator for RecordingReader<R> {
    type Item = Result<RevisionRecord, RecordError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let line = match self.lines.next()? {
                Ok(line) => line,
                Err(source) => return Some(Err(RecordError::Io { path: self.path.clone(), source })),
            };
            self.line += 1;
            if line.trim().is_empty() {
                continue;
            }
            return Some(serde_json::from_str(&line).map_err(|e| RecordError::BadLine {
                path: self.path.clone(),
                line: self.line,
                reason: format!("not a revision record: {e}"),
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_line(version: u32, wit: &str) -> String {
        let mut h = serde_json::to_value(Header {
            format: FORMAT.into(),
            version,
            wit: wit.into(),
            host: "0".into(),
            node: wit::NodeContext {
                node_name: "n".into(),
                node_ips: vec![],
                cluster_cidrs: vec![],
                pod_cidrs: vec![],
            },
            pod_traffic: Default::default(),
            started_unix_ms: 0,
        })
        .unwrap();
        h["version"] = version.into();
        h.to_string()
    }

    fn read(text: &str) -> Result<Vec<RevisionRecord>, RecordError> {
        RecordingReader::new(Path::new("r.jsonl"), text.as_bytes())?.collect()
    }

    #[test]
    fn headers_are_checked_with_a_reason() {
        assert!(matches!(read(""), Err(RecordError::Empty { .. })));
        assert!(matches!(read("\u{7f}ELF garbage"), Err(RecordError::NotARecording { .. })));
        assert!(matches!(read("{\"format\":\"other\"}"), Err(RecordError::NotARecording { .. })));
        let e = read(&header_line(7, "wasmplane:dataplane@1.0.0")).unwrap_err();
        assert!(matches!(e, RecordError::UnsupportedVersion { found: 7, .. }), "{e}");
        assert!(e.to_string().contains("version 7") && e.to_string().contains("reads version 1"), "{e}");
        assert!(matches!(read(&header_line(1, "wasmplane:dataplane@2.0.0")), Err(RecordError::WitMismatch { .. })));
        assert!(read(&header_line(1, "wasmplane:dataplane@1.4.0")).unwrap().is_empty());
    }

    #[test]
    fn a_bad_line_is_named_by_number() {
        let text = format!("{}\n\n{{\"revision\": 3, \"context\": 5}}\n", header_line(1, "wasmplane:dataplane@1.0.0"));
        match read(&text) {
            Err(RecordError::BadLine { line, .. }) => assert_eq!(line, 3),
            other => panic!("expected a bad line, got {other:?}"),
        }
    }
}
