//! Unit-test a guest against recorded traffic (native builds only).
//!
//! `wasmplane run --record FILE` writes every model revision as the service translator saw
//! it: for each changed service the node context, chain prefix, `Service` and
//! `EndpointSlice`s, in these very WIT types, plus what the translator in force produced live
//! (rendered by the host). [`Recording`] reads that file (the same format `wasmplane replay`
//! reads) and [`Recording::replay`] calls a guest's native translate function on every
//! recorded input, in order:
//!
//! ```ignore
//! use wasmplane_sdk::testing::Recording;
//!
//! #[test]
//! fn translates_recorded_traffic() {
//!     let recording = Recording::read("../../examples/recordings/shop.jsonl").unwrap();
//!     for call in recording.replay(|ctx, prefix, svc, slices| my_guest::translate(ctx, prefix, svc, slices)) {
//!         let rules = call.output.expect("every recorded service translates");
//!         assert!(rules.chains.iter().all(|c| c.name.starts_with(call.input.prefix.as_str())));
//!     }
//! }
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::types::{EndpointSlice, GuestError, NodeContext, Ruleset, Service};

/// The `format` a recording's header line names.
pub const FORMAT: &str = "wasmplane-recording";
/// The recording format version this SDK reads.
pub const FORMAT_VERSION: u32 = 1;

/// First line of a recording.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u32,
    /// WIT package of the inputs (`wasmplane:dataplane@1.2.0`; `@1.1.0`, `@1.0.0` from older hosts).
    pub wit: String,
    /// Version of the host that recorded.
    pub host: String,
    pub node: NodeContext,
}

/// What one translator call was given.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ServiceInput {
    /// `namespace/name`.
    pub key: String,
    pub prefix: String,
    pub service: Service,
    pub slices: Vec<EndpointSlice>,
}

/// What the live translator's call came to, as the host validated and rendered it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordedOutput {
    /// The host's rendered objects: `chains` (name → nft rule texts), `sets`, `elements`
    /// (`map`, `key`, `verdict`), `warnings`.
    Rules(serde_json::Value),
    /// Why the call gave no rules (the service kept its last good ones).
    Error(String),
}

impl RecordedOutput {
    /// Chain names and their rule counts, as applied live (none for an error).
    pub fn chains(&self) -> BTreeMap<String, usize> {
        match self {
            RecordedOutput::Rules(rules) => rules["chains"]
                .as_object()
                .map(|chains| {
                    chains.iter().map(|(name, rules)| (name.clone(), rules.as_array().map_or(0, Vec::len))).collect()
                })
                .unwrap_or_default(),
            RecordedOutput::Error(_) => BTreeMap::new(),
        }
    }
}

/// One model revision that changed services.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Revision {
    pub revision: u64,
    pub context: NodeContext,
    #[serde(default)]
    pub context_changed: bool,
    #[serde(default)]
    pub services: Vec<ServiceInput>,
    /// Services deleted in this revision (`namespace/name`).
    #[serde(default)]
    pub deleted: Vec<String>,
    /// The translator in force live (`name@version`).
    #[serde(default)]
    pub translator: Option<String>,
    /// Its settings, when it had any.
    #[serde(default)]
    pub translator_settings: Option<serde_json::Value>,
    #[serde(default)]
    pub outputs: Option<BTreeMap<String, RecordedOutput>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("not a wasmplane recording: {0}")]
    NotARecording(String),
    #[error("recording format version {0}, this SDK reads version {FORMAT_VERSION}")]
    UnsupportedVersion(u64),
    #[error("line {line}: {reason}")]
    BadLine { line: usize, reason: String },
}

/// A whole recording in memory.
#[derive(Clone, Debug)]
pub struct Recording {
    pub header: Header,
    pub revisions: Vec<Revision>,
}

/// One call of a replay: the recorded input, what the live translator made of it, and
/// what the function under test returned.
#[derive(Debug)]
pub struct Replayed<'a> {
    pub revision: &'a Revision,
    pub input: &'a ServiceInput,
    /// `None` when the recording holds no outputs.
    pub recorded: Option<&'a RecordedOutput>,
    pub output: Result<Ruleset, GuestError>,
}

impl Recording {
    pub fn read(path: impl AsRef<Path>) -> Result<Recording, RecordingError> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|source| RecordingError::Io { path: path.to_path_buf(), source })?;
        Recording::parse(&text)
    }

    pub fn parse(text: &str) -> Result<Recording, RecordingError> {
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
        let (_, first) = lines.next().ok_or_else(|| RecordingError::NotARecording("empty".into()))?;
        let value: serde_json::Value = serde_json::from_str(first)
            .map_err(|e| RecordingError::NotARecording(format!("line 1 is not JSON: {e}")))?;
        if value.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(RecordingError::NotARecording(format!("line 1 has no \"format\": \"{FORMAT}\"")));
        }
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(FORMAT_VERSION) => {}
            Some(v) => return Err(RecordingError::UnsupportedVersion(v)),
            None => return Err(RecordingError::NotARecording("the header has no version".into())),
        }
        let header: Header =
            serde_json::from_value(value).map_err(|e| RecordingError::BadLine { line: 1, reason: e.to_string() })?;
        let revisions = lines
            .map(|(i, line)| {
                serde_json::from_str(line).map_err(|e| RecordingError::BadLine { line: i + 1, reason: e.to_string() })
            })
            .collect::<Result<_, _>>()?;
        Ok(Recording { header, revisions })
    }

    /// Every recorded call, in the order the host made them.
    pub fn inputs(&self) -> impl Iterator<Item = (&Revision, &ServiceInput)> {
        self.revisions.iter().flat_map(|r| r.services.iter().map(move |s| (r, s)))
    }

    /// Calls `translate` (a guest's native translate function) on every recorded input, with
    /// [`crate::settings::raw`] answering the settings recorded with its revision (`{}` when
    /// none were).
    pub fn replay<F>(&self, mut translate: F) -> Vec<Replayed<'_>>
    where
        F: FnMut(&NodeContext, &str, &Service, &[EndpointSlice]) -> Result<Ruleset, GuestError>,
    {
        self.inputs()
            .map(|(revision, input)| {
                crate::settings::set_for_tests(
                    &revision.translator_settings.as_ref().map_or_else(|| "{}".to_string(), |s| s.to_string()),
                );
                Replayed {
                    revision,
                    input,
                    recorded: revision.outputs.as_ref().and_then(|o| o.get(&input.key)),
                    output: translate(&revision.context, &input.prefix, &input.service, &input.slices),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_checked() {
        assert!(matches!(Recording::parse(""), Err(RecordingError::NotARecording(_))));
        assert!(matches!(Recording::parse("{\"format\": \"x\"}"), Err(RecordingError::NotARecording(_))));
        assert!(matches!(
            Recording::parse("{\"format\": \"wasmplane-recording\", \"version\": 2}"),
            Err(RecordingError::UnsupportedVersion(2))
        ));
    }

    #[test]
    fn revisions_are_read_in_the_host_shape() {
        let text = r#"{"format":"wasmplane-recording","version":1,"wit":"wasmplane:dataplane@1.0.0","host":"0.1.0","node":{"node_name":"n","node_ips":[],"cluster_cidrs":[],"pod_cidrs":[]},"started_unix_ms":1}
{"revision":2,"context":{"node_name":"n","node_ips":[],"cluster_cidrs":[],"pod_cidrs":[]},"services":[],"deleted":["a/b"],"translator":"t@1","outputs":{"a/c":{"error":"no"},"a/d":{"rules":{"chains":{"svc/a/d/x":["counter","accept"]}}}}}
"#;
        let r = Recording::parse(text).unwrap();
        assert_eq!(r.header.node.node_name, "n");
        assert_eq!(r.revisions[0].deleted, vec!["a/b".to_string()]);
        let outputs = r.revisions[0].outputs.as_ref().unwrap();
        assert_eq!(outputs["a/c"], RecordedOutput::Error("no".into()));
        assert_eq!(outputs["a/d"].chains(), BTreeMap::from([("svc/a/d/x".to_string(), 2)]));
        let bad = format!("{}\n{{\"revision\": \"x\"}}\n", text.lines().next().unwrap());
        assert!(matches!(Recording::parse(&bad), Err(RecordingError::BadLine { line: 2, .. })));
    }

    #[test]
    fn each_call_reads_the_settings_recorded_with_its_revision() {
        let service = r#"{"key":"shop/db","prefix":"svc/shop/db","service":{"namespace":"shop","name":"db","service_type":"ClusterIp","cluster_ips":["10.96.0.22"],"external_ips":[],"load_balancer_ips":[],"ports":[],"session_affinity_timeout":null,"external_traffic_policy":"Cluster","internal_traffic_policy":"Cluster","labels":[]},"slices":[]}"#;
        let context = r#"{"node_name":"n","node_ips":[],"cluster_cidrs":[],"pod_cidrs":[]}"#;
        let text = format!(
            "{{\"format\":\"wasmplane-recording\",\"version\":1,\"wit\":\"wasmplane:dataplane@1.0.0\",\"host\":\"0.1.0\",\"node\":{context},\"started_unix_ms\":1}}\n\
             {{\"revision\":2,\"context\":{context},\"services\":[{service}],\"translator\":\"t@1\",\"translator_settings\":{{\"label\":\"tier\"}}}}\n\
             {{\"revision\":3,\"context\":{context},\"services\":[{service}],\"translator\":\"t@1\"}}\n"
        );
        let recording = Recording::parse(&text).unwrap();
        let mut seen = Vec::new();
        recording.replay(|_, _, _, _| {
            seen.push(crate::settings::raw());
            Err(GuestError { message: "unused".into() })
        });
        assert_eq!(seen, [r#"{"label":"tier"}"#, "{}"]);
    }
}
