//! Replaying a recording (`record.rs`) through a service translator, offline.
//!
//! The module runs in the real runtime under the same limits as live (epoch deadline,
//! memory cap, output cap) and its output goes through the same validation and rendering,
//! so what `wasmplane replay` prints is what the host would have applied, with no cluster
//! and no kernel. Where the recording holds the live outputs, each revision says whether
//! the replayed ones are the same.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;
use wasmplane_runtime::{
    CallError, GuestKind, Limits, LoadError, LoadedModule, NoLookups, Runtime, RuntimeError, TranslatorSession,
};

use crate::controller::BUILTIN_SERVICE_TRANSLATOR;
use crate::nft::{self, ObjectRules};
use crate::record::{Outcome, RecordError, RecordingReader, RevisionRecord};

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Recording(#[from] RecordError),
    #[error("reading module {path}: {source}")]
    ReadModule { path: PathBuf, source: std::io::Error },
    #[error("module {name}: {source}")]
    Load { name: String, source: LoadError },
    #[error("module {name} is a {kind} module; replay runs service translators")]
    NotATranslator { name: String, kind: GuestKind },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
}

/// One service translator session over recorded inputs.
pub struct Replayer {
    name: String,
    loaded: LoadedModule,
    session: TranslatorSession,
    /// Each revision runs with the settings recorded with it (not given by hand).
    recorded_settings: bool,
    /// How `pod-traffic` matches render: as on the node that recorded.
    pod_traffic: nft::PodTraffic,
}

/// One revision as replayed.
#[derive(Clone, Debug)]
pub struct Replayed {
    pub revision: u64,
    /// Per service (`namespace/name`): validated rules, or why there are none.
    pub outputs: BTreeMap<String, Result<ObjectRules, String>>,
    pub deleted: Vec<String>,
    /// The translator that produced the recorded outputs, if any were recorded.
    pub recorded_translator: Option<String>,
    /// Services whose replayed outcome differs from the recorded one (`None`: no outputs
    /// recorded, nothing to compare).
    pub differing: Option<Vec<String>>,
}

impl Replayed {
    pub fn outcomes(&self) -> BTreeMap<String, Outcome> {
        self.outputs.iter().map(|(k, r)| (k.clone(), Outcome::of(r))).collect()
    }

    pub fn matches_recording(&self) -> Option<bool> {
        self.differing.as_ref().map(Vec::is_empty)
    }
}

impl Replayer {
    /// `module`: a component's name and bytes; `None`: the builtin default translator. Each
    /// revision runs with the settings the live translator had when it was recorded.
    pub fn new(runtime: &Runtime, module: Option<(&str, &[u8])>) -> Result<Replayer, ReplayError> {
        let mut replayer = Self::with_settings(runtime, module, wasmplane_runtime::NO_SETTINGS)?;
        replayer.recorded_settings = true;
        Ok(replayer)
    }

    /// [`Replayer::new`] with the module's settings (a JSON document) for every revision, as
    /// the host would give them: the way to try settings on a recording before setting them.
    pub fn with_settings(
        runtime: &Runtime,
        module: Option<(&str, &[u8])>,
        settings: &str,
    ) -> Result<Replayer, ReplayError> {
        let (name, bytes) =
            module.unwrap_or((BUILTIN_SERVICE_TRANSLATOR, wasmplane_guest_artifacts::SERVICE_TRANSLATOR));
        // Loaded like an upload (kind, world, imports checked); the size cap is the upload's concern.
        let loaded = runtime
            .load(name, bytes, Some(GuestKind::ServiceTranslator), usize::MAX)
            .map_err(|source| ReplayError::Load { name: name.into(), source })?
            .with_settings(settings);
        let kind = loaded.info.kind;
        // What the host would refuse before storing them; the calls below still show what they do.
        if let Ok(wasmplane_runtime::SettingsVerdict::Invalid(reason)) = loaded.validate_settings(settings) {
            tracing::warn!(module = name, "the module's own validator refuses these settings: {reason}");
        }
        // Service translators get no lookups live either (controller.rs).
        let session = loaded
            .translator(Arc::new(NoLookups))
            .ok_or_else(|| ReplayError::NotATranslator { name: name.into(), kind })?;
        tracing::info!(module = name, digest = %loaded.info.digest, "replaying with");
        Ok(Replayer {
            name: name.to_string(),
            loaded,
            session,
            recorded_settings: false,
            pod_traffic: Default::default(),
        })
    }

    /// Reads the module at `path` (named by its file stem); `None`: the builtin. `settings`:
    /// for every revision; `None`: those recorded with each.
    pub fn from_file(runtime: &Runtime, path: Option<&Path>, settings: Option<&str>) -> Result<Replayer, ReplayError> {
        let module = match path {
            Some(path) => {
                let bytes = std::fs::read(path)
                    .map_err(|source| ReplayError::ReadModule { path: path.to_path_buf(), source })?;
                let name =
                    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into());
                Some((name, bytes))
            }
            None => None,
        };
        let module = module.as_ref().map(|(name, bytes)| (name.as_str(), bytes.as_slice()));
        match settings {
            Some(settings) => Replayer::with_settings(runtime, module, settings),
            None => Replayer::new(runtime, module),
        }
    }

    /// Runs the next calls with the settings `record` was recorded with, when it has
    /// outputs (the revision a late recorder starts with has none: the settings stay).
    fn follow_settings(&mut self, record: &RevisionRecord) {
        if !self.recorded_settings || record.translator.is_none() {
            return;
        }
        let recorded = record
            .translator_settings
            .as_ref()
            .map_or_else(|| wasmplane_runtime::NO_SETTINGS.to_string(), |s| s.to_string());
        if **self.loaded.settings() != *recorded {
            tracing::debug!(revision = record.revision, settings = recorded, "the recorded settings changed");
            self.loaded.set_settings(&recorded);
            // A translator when constructed, so it still is one.
            self.session = self.loaded.translator(Arc::new(NoLookups)).expect("a service translator");
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs the translator on every service input of `record`, validating like live.
    pub fn revision(&mut self, record: &RevisionRecord) -> Replayed {
        self.follow_settings(record);
        // Pods detected as on the node then: by source address, in the families of the
        // cluster CIDRs its context had (those its dataplane had, see `Controller::run_update`).
        let cluster_cidrs = crate::dataplane::parse_cidrs("cluster-cidrs", &record.context.cluster_cidrs);
        let pods = nft::PodDetection::new(&self.pod_traffic, &cluster_cidrs);
        let mut outputs = BTreeMap::new();
        for input in &record.services {
            let key = input.object_key();
            // Same calls, same error texts as Controller::translate_one.
            let result = self
                .session
                .translate_wit(&record.context, &input.prefix, &input.service, &input.slices)
                .map_err(|e: CallError| e.to_string())
                .and_then(|out| nft::validate_translated(&key, &out, pods).map_err(|e| e.to_string()));
            if let Err(e) = &result {
                tracing::debug!(revision = record.revision, service = %key, "replayed call failed: {e}");
            }
            outputs.insert(input.key.clone(), result);
        }
        let differing = record.outputs.as_ref().map(|recorded| {
            let mut differing: Vec<String> = outputs
                .iter()
                .filter(|(k, r)| recorded.get(*k) != Some(&Outcome::of(r)))
                .map(|(k, _)| k.clone())
                .collect();
            differing.extend(recorded.keys().filter(|k| !outputs.contains_key(*k)).cloned());
            differing
        });
        Replayed {
            revision: record.revision,
            outputs,
            deleted: record.deleted.clone(),
            recorded_translator: record.translator.clone(),
            differing,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Per revision: the nftables statements that create each service's objects.
    #[default]
    Text,
    /// One JSON object per revision per line.
    Json,
}

/// Totals of one replay.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReplaySummary {
    pub revisions: usize,
    pub calls: usize,
    pub errors: usize,
    /// Revisions that had recorded outputs to compare with.
    pub compared: usize,
    /// Of those, revisions where the replayed outputs differ.
    pub differing: usize,
}

/// The JSON line of one revision.
#[derive(Serialize)]
struct JsonLine<'a> {
    revision: u64,
    translator: &'a str,
    outputs: BTreeMap<String, Outcome>,
    deleted: &'a [String],
    recorded_translator: Option<&'a str>,
    matches_recording: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    differing: Option<&'a [String]>,
}

fn write_text(out: &mut dyn Write, translator: &str, r: &Replayed) -> std::io::Result<()> {
    let comparison = match (&r.differing, &r.recorded_translator) {
        (None, _) => String::new(),
        (Some(d), Some(t)) if d.is_empty() => format!("; same as recorded live ({t})"),
        (Some(d), t) => format!("; differs from recorded live ({}): {}", t.as_deref().unwrap_or("?"), d.join(", ")),
    };
    writeln!(
        out,
        "# revision {} ({translator}): {} services, {} deleted{comparison}",
        r.revision,
        r.outputs.len(),
        r.deleted.len()
    )?;
    for (key, result) in &r.outputs {
        match result {
            Ok(rules) => {
                writeln!(out, "## {key}")?;
                // The statements that create this object from nothing, as the writer renders them.
                let mut text = String::new();
                nft::object_delta(&ObjectRules::default(), rules, &mut text, nft::Layout::default());
                out.write_all(text.as_bytes())?;
                for w in &rules.warnings {
                    writeln!(out, "# warning: {w}")?;
                }
            }
            Err(e) => writeln!(out, "## {key}: error (its last good rules stay): {e}")?,
        }
    }
    for key in &r.deleted {
        writeln!(out, "## {key}: deleted")?;
    }
    Ok(())
}

/// Replays every revision of `reader` and prints each in `format`.
pub fn replay<R: BufRead>(
    reader: RecordingReader<R>,
    replayer: &mut Replayer,
    format: OutputFormat,
    out: &mut dyn Write,
) -> Result<ReplaySummary, ReplayError> {
    let mut summary = ReplaySummary::default();
    replayer.pod_traffic = reader.header().pod_traffic.clone();
    for record in reader {
        let record = record?;
        let replayed = replayer.revision(&record);
        summary.revisions += 1;
        summary.calls += replayed.outputs.len();
        summary.errors += replayed.outputs.values().filter(|r| r.is_err()).count();
        if let Some(matches) = replayed.matches_recording() {
            summary.compared += 1;
            summary.differing += usize::from(!matches);
        }
        match format {
            OutputFormat::Json => {
                let line = JsonLine {
                    revision: replayed.revision,
                    translator: replayer.name(),
                    outputs: replayed.outcomes(),
                    deleted: &replayed.deleted,
                    recorded_translator: replayed.recorded_translator.as_deref(),
                    matches_recording: replayed.matches_recording(),
                    differing: replayed.differing.as_deref(),
                };
                serde_json::to_writer(&mut *out, &line).map_err(std::io::Error::from)?;
                out.write_all(b"\n")?;
            }
            OutputFormat::Text => write_text(out, replayer.name(), &replayed)?,
        }
    }
    out.flush()?;
    Ok(summary)
}

/// `wasmplane replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// A recording written by `wasmplane run --record FILE`.
    pub file: PathBuf,
    /// The service translator component to run (default: the builtin translator).
    #[arg(long)]
    pub module: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,
    /// Fail if any revision's output differs from the one recorded live.
    #[arg(long)]
    pub check: bool,
    /// Per-call time limit of the guest, in milliseconds (as `run`).
    #[arg(long, default_value_t = 500)]
    pub guest_timeout_ms: u64,
    /// Linear-memory limit of the guest, in MiB (as `run`).
    #[arg(long, default_value_t = 64, value_parser = crate::cli::guest_memory_mib)]
    pub guest_memory_mib: usize,
    /// The module's settings (JSON or YAML), as `module settings` would set them, for every
    /// revision (default: the settings recorded with each, those the live translator had).
    #[arg(long)]
    pub settings: Option<PathBuf>,
}

/// Runs `wasmplane replay`: outputs on stdout, the summary on stderr.
pub fn command(args: ReplayArgs) -> anyhow::Result<()> {
    // Header checked before the engine starts: a wrong file fails at once.
    let reader = RecordingReader::open(&args.file)?;
    let limits = Limits {
        call_timeout: Duration::from_millis(args.guest_timeout_ms),
        memory_bytes: args.guest_memory_mib << 20,
        ..Default::default()
    };
    let runtime = Runtime::new(limits, None).context("starting the Wasm runtime")?;
    let settings = args.settings.as_deref().map(crate::cli::settings_document).transpose()?;
    let mut replayer = Replayer::from_file(&runtime, args.module.as_deref(), settings.as_deref())?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let summary = replay(reader, &mut replayer, args.format, &mut out)?;
    eprintln!(
        "replayed {} revisions ({} calls, {} errors) with {}; {} of {} compared revisions differ from the recording",
        summary.revisions,
        summary.calls,
        summary.errors,
        replayer.name(),
        summary.differing,
        summary.compared
    );
    anyhow::ensure!(
        !args.check || summary.differing == 0,
        "{} revisions differ from the recorded live output",
        summary.differing
    );
    Ok(())
}
