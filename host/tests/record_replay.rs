//! Record and replay: a host records its model changes while manifests change and a module
//! is uploaded; the recording, replayed offline through the real runtime (library and
//! `wasmplane replay`), gives exactly what the live host applied at every revision.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use wasmplane::app::{DataplaneMode, HostConfig, RunningHost, start};
use wasmplane::record::{Outcome, RecordError, RecordingReader, RevisionRecord};
use wasmplane::replay::{ReplayError, Replayer};
use wasmplane_guest_artifacts as artifacts;
use wasmplane_runtime::{Limits, Runtime};

const TOKEN: &str = "record-replay-token-0123456789abcdef";
const DEFAULT: &str = "default-service-translator@1";
const PORT_FILTER: &str = "port-filter@1";

const NODE: &str = "\
apiVersion: v1
kind: Node
metadata: { name: node-a }
spec: { podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24] }
status: { addresses: [{ type: InternalIP, address: 192.168.77.1 }] }
";

fn service(
    name: &str,
    ip: &str,
    port: u16,
    target: u16,
    expose: bool,
    endpoints: Option<&[(&str, &str, bool)]>,
) -> String {
    let labels = if expose { ", labels: { wasmplane.io/expose: \"true\" }" } else { "" };
    let mut yaml = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{ name: {name}, namespace: shop{labels} }}\n\
         spec:\n  clusterIP: {ip}\n  clusterIPs: [{ip}]\n  ports: [{{ name: p, port: {port}, targetPort: {target}, protocol: TCP }}]\n"
    );
    if let Some(endpoints) = endpoints {
        yaml += &format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{ name: {name}-x1, namespace: shop, labels: {{ kubernetes.io/service-name: {name} }} }}\n\
             addressType: IPv4\nports: [{{ name: p, port: {target}, protocol: TCP }}]\nendpoints:\n"
        );
        for (addr, node, ready) in endpoints {
            yaml += &format!("  - {{ addresses: [{addr}], conditions: {{ ready: {ready} }}, nodeName: {node} }}\n");
        }
    }
    yaml
}

/// One state of the live host: its revision, translator in force and applied objects.
#[derive(Debug)]
struct Snapshot {
    revision: u64,
    translator: String,
    objects: BTreeMap<String, Value>,
}

struct Live {
    host: RunningHost,
    client: reqwest::Client,
    dir: tempfile::TempDir,
    snapshots: Vec<Snapshot>,
}

impl Live {
    fn write(&self, file: &str, text: &str) {
        // Renamed in, so a poll never reads half a file.
        let tmp = self.dir.path().join(format!(".{file}"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("manifests").join(file)).unwrap();
    }

    async fn dataplane(&self) -> Value {
        self.client
            .get(format!("{}/v1/dataplane?format=json", self.host.url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits for a revision past the last snapshot where `done` holds, and keeps it.
    async fn snapshot(&mut self, what: &str, done: impl Fn(&Value) -> bool) {
        let after = self.snapshots.last().map_or(0, |s| s.revision);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let dp = self.dataplane().await;
            if dp["revision"].as_u64().unwrap() > after && done(&dp) {
                let objects = dp["objects"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                let snapshot = Snapshot {
                    revision: dp["revision"].as_u64().unwrap(),
                    translator: dp["translator"].as_str().unwrap().to_string(),
                    objects,
                };
                self.snapshots.push(snapshot);
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; dataplane: {dp}");
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    }
}

fn rules_text(dp: &Value, object: &str) -> String {
    dp["objects"][object].to_string()
}

/// A host over `dir`'s manifests, recording to `recording`, its dataplane kept in memory.
async fn recording_host(dir: &Path, recording: &Path) -> RunningHost {
    start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        manifests: Some(dir.join("manifests")),
        data_dir: Some(dir.join("data")),
        token: Some(TOKEN.into()),
        dataplane: DataplaneMode::Record,
        manifest_poll: Duration::from_millis(40),
        record: Some(recording.to_path_buf()),
        ..Default::default()
    })
    .await
    .unwrap()
}

/// Runs the host over changing manifests with `--record`, uploads the example module
/// halfway; returns the recording and what the host applied at each step.
async fn record_live() -> (tempfile::TempDir, PathBuf, Vec<Snapshot>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("manifests")).unwrap();
    let web = [("10.244.0.11", "node-a", true), ("10.244.1.11", "node-b", true)];
    let api = [("10.244.0.21", "node-a", true)];
    let shop = |web: &[(&str, &str, bool)], api: &[(&str, &str, bool)], db: bool| {
        let mut yaml = NODE.to_string();
        yaml += &service("web", "10.96.0.20", 80, 8080, false, Some(web));
        yaml += &service("api", "10.96.0.21", 443, 8443, true, Some(api));
        if db {
            yaml += &service("db", "10.96.0.22", 5432, 5432, false, None);
        }
        yaml
    };
    std::fs::write(dir.path().join("manifests/shop.yaml"), shop(&web, &api, true)).unwrap();
    let recording = dir.path().join("recording.jsonl");
    let host = recording_host(dir.path(), &recording).await;
    let mut live = Live { host, client: reqwest::Client::new(), dir, snapshots: Vec::new() };

    live.snapshot("initial state", |dp| dp["objects"].get("shop/db").is_some()).await;
    // Endpoints change: one more, one no longer ready.
    let web2 = [("10.244.0.11", "node-a", true), ("10.244.0.12", "node-a", true), ("10.244.1.11", "node-b", false)];
    live.write("shop.yaml", &shop(&web2, &api, true));
    live.snapshot("web endpoints", |dp| rules_text(dp, "shop/web").contains("10.244.0.12")).await;
    live.write(
        "cache.yaml",
        &service("cache", "10.96.0.23", 6379, 6379, true, Some(&[("10.244.0.31", "node-a", true)])),
    );
    live.snapshot("cache added", |dp| dp["objects"].get("shop/cache").is_some()).await;

    // The example module in force: not a model revision, but what later revisions get.
    let response = live
        .client
        .put(format!("{}/v1/modules/port-filter?kind=service-translator", live.host.url()))
        .bearer_auth(TOKEN)
        .body(artifacts::examples::PORT_FILTER_TRANSLATOR.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED, "{}", response.text().await.unwrap());
    assert_eq!(live.dataplane().await["translator"], PORT_FILTER);

    let api2 = [("10.244.0.21", "node-a", true), ("10.244.1.21", "node-b", true)];
    live.write("shop.yaml", &shop(&web2, &api2, true));
    live.snapshot("api endpoints", |dp| rules_text(dp, "shop/api").contains("10.244.1.21")).await;
    live.write("shop.yaml", &shop(&web2, &api2, false));
    live.snapshot("db deleted", |dp| dp["objects"].get("shop/db").is_none()).await;
    std::fs::remove_file(live.dir.path().join("manifests/cache.yaml")).unwrap();
    live.snapshot("cache deleted", |dp| dp["objects"].get("shop/cache").is_none()).await;

    let Live { host, dir, snapshots, .. } = live;
    host.stop().await;
    (dir, recording, snapshots)
}

fn read_all(path: &Path) -> Vec<RevisionRecord> {
    RecordingReader::open(path).unwrap().collect::<Result<_, _>>().unwrap()
}

/// Replays every revision with `replayer`; returns per revision whether it matched the
/// recorded outputs, and the dataplane state (key → rules) it builds up after each.
fn replay_states(
    replayer: &mut Replayer,
    revisions: &[RevisionRecord],
) -> Vec<(u64, Option<bool>, BTreeMap<String, Value>)> {
    let mut state = BTreeMap::new();
    let mut out = Vec::new();
    for record in revisions {
        let replayed = replayer.revision(record);
        for (key, outcome) in replayed.outcomes() {
            match outcome {
                Outcome::Rules(rules) => {
                    state.insert(key, rules);
                }
                // Live keeps the last good rules of a service that failed.
                Outcome::Error(e) => panic!("revision {}: {key} failed in replay: {e}", record.revision),
            }
        }
        for key in &replayed.deleted {
            state.remove(key);
        }
        out.push((record.revision, replayed.matches_recording(), state.clone()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recording_replays_offline_to_what_the_live_host_applied() {
    let (dir, recording, snapshots) = record_live().await;
    let revisions = read_all(&recording);
    let header = RecordingReader::open(&recording).unwrap().header().clone();
    assert_eq!(
        (header.format.as_str(), header.version, header.wit.as_str()),
        ("wasmplane-recording", 1, "wasmplane:dataplane@1.2.0")
    );
    assert_eq!(header.node.node_name, "node-a");

    // What was recorded: the initial state whole, then exactly the changed services.
    let inputs = |r: &RevisionRecord| r.services.iter().map(|s| s.key.clone()).collect::<Vec<_>>();
    assert_eq!(revisions.len(), 6, "{revisions:#?}");
    assert_eq!(inputs(&revisions[0]), vec!["shop/api", "shop/db", "shop/web"]);
    assert_eq!(revisions[0].context.node_ips, vec!["192.168.77.1".to_string()], "the node context as the guest got it");
    assert_eq!(inputs(&revisions[1]), vec!["shop/web"]);
    let web = &revisions[1].services[0];
    assert_eq!(web.prefix, "svc/shop/web");
    assert_eq!(
        web.slices[0].endpoints.iter().map(|e| (e.addresses[0].as_str(), e.ready, e.is_local)).collect::<Vec<_>>(),
        vec![("10.244.0.11", true, true), ("10.244.0.12", true, true), ("10.244.1.11", false, false)]
    );
    assert_eq!(inputs(&revisions[2]), vec!["shop/cache"]);
    assert_eq!(inputs(&revisions[3]), vec!["shop/api"]);
    assert_eq!((inputs(&revisions[4]), revisions[4].deleted.clone()), (vec![], vec!["shop/db".to_string()]));
    assert_eq!(revisions[5].deleted, vec!["shop/cache".to_string()]);
    let translators: Vec<&str> = revisions.iter().map(|r| r.translator.as_deref().unwrap()).collect();
    assert_eq!(translators, vec![DEFAULT, DEFAULT, DEFAULT, PORT_FILTER, PORT_FILTER, PORT_FILTER]);
    let revision_numbers: Vec<u64> = revisions.iter().map(|r| r.revision).collect();
    assert_eq!(
        revision_numbers,
        snapshots.iter().map(|s| s.revision).collect::<Vec<_>>(),
        "one recorded revision per change"
    );

    // Offline, in the real runtime, with each translator the host had in force.
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let mut default = Replayer::new(&runtime, None).unwrap();
    let mut port_filter =
        Replayer::new(&runtime, Some(("port-filter", artifacts::examples::PORT_FILTER_TRANSLATOR))).unwrap();
    let by_default = replay_states(&mut default, &revisions);
    let by_port_filter = replay_states(&mut port_filter, &revisions);
    for (i, snapshot) in snapshots.iter().enumerate() {
        let (replayed, other) = if snapshot.translator == DEFAULT {
            (&by_default[i], &by_port_filter[i])
        } else {
            (&by_port_filter[i], &by_default[i])
        };
        assert_eq!(replayed.0, snapshot.revision);
        // Same outputs as the live translator at this revision, and the same applied state.
        assert_eq!(
            replayed.1,
            Some(true),
            "revision {}: replayed outputs differ from the recorded ones",
            snapshot.revision
        );
        assert_eq!(
            replayed.2, snapshot.objects,
            "revision {}: replayed state differs from what the host applied",
            snapshot.revision
        );
        // The other translator is told apart wherever it ran on something it treats differently.
        if !revisions[i].services.is_empty() {
            assert_eq!(other.1, Some(false), "revision {}: a different translator went unnoticed", snapshot.revision);
        }
    }
    // After the upload the live dataplane is all port-filter's: exposed services only.
    let last = snapshots.last().unwrap();
    assert!(last.objects["shop/web"]["chains"].as_object().unwrap().is_empty());
    assert!(!last.objects["shop/api"]["chains"].as_object().unwrap().is_empty());

    check_cli(&recording, dir.path());
    if std::env::var_os("WASMPLANE_UPDATE_RECORDINGS").is_some() {
        // Refreshes the fixture the SDK harness test reads.
        std::fs::copy(&recording, fixture()).unwrap();
    }
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/recordings/shop.jsonl")
}

fn wasmplane(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wasmplane")).args(args).env("RUST_LOG", "warn").output().unwrap();
    (out.status.success(), String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
}

/// `wasmplane replay` prints each revision's outputs, as JSON lines or nft text.
fn check_cli(recording: &Path, dir: &Path) {
    let file = recording.to_str().unwrap();
    let (ok, stdout, stderr) = wasmplane(&["replay", file, "--format", "json"]);
    assert!(ok, "{stderr}");
    let lines: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 6, "{stdout}");
    assert!(lines.iter().all(|l| l["translator"] == "default-service-translator"));
    let matches: Vec<bool> = lines.iter().map(|l| l["matches_recording"].as_bool().unwrap()).collect();
    assert_eq!(matches, vec![true, true, true, false, true, true], "{stdout}");
    assert_eq!(lines[3]["differing"], serde_json::json!(["shop/api"]));
    assert!(lines[0]["outputs"]["shop/web"]["rules"]["elements"].to_string().contains("service-endpoints"), "{stdout}");
    assert_eq!(lines[4]["deleted"], serde_json::json!(["shop/db"]));
    assert!(stderr.contains("replayed 6 revisions") && stderr.contains("1 of 6 compared revisions differ"), "{stderr}");

    let module = dir.join("port-filter.wasm");
    std::fs::write(&module, artifacts::examples::PORT_FILTER_TRANSLATOR).unwrap();
    let (ok, text, stderr) = wasmplane(&["replay", file, "--module", module.to_str().unwrap(), "--format", "text"]);
    assert!(ok, "{stderr}");
    assert!(
        text.contains("# revision")
            && text.contains("(port-filter): 1 services, 0 deleted; same as recorded live (port-filter@1)"),
        "{text}"
    );
    assert!(text.contains("add rule inet wasmplane-s0 svc/shop/api/tcp/443") && text.contains("10.244.1.21"), "{text}");
    assert!(text.contains("## shop/db: deleted"), "{text}");
    assert!(
        text.contains("differs from recorded live (default-service-translator@1): shop/api, shop/db, shop/web"),
        "{text}"
    );

    // --settings: the module's settings tried on the recording before they are set.
    let settings = dir.join("settings.yaml");
    std::fs::write(&settings, "label: tier\nvalue: front\n").unwrap();
    let (ok, json, stderr) = wasmplane(&[
        "replay",
        file,
        "--module",
        module.to_str().unwrap(),
        "--settings",
        settings.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(ok, "{stderr}");
    assert!(
        json.contains("not exposed: label tier=front is missing")
            && !json.contains("wasmplane.io/expose=true is missing"),
        "{json}"
    );
    std::fs::write(&settings, "lable: tier\n").unwrap();
    let (_, _, stderr) =
        wasmplane(&["replay", file, "--module", module.to_str().unwrap(), "--settings", settings.to_str().unwrap()]);
    assert!(
        stderr.contains("calls, ") && !stderr.contains(" 0 errors"),
        "settings the guest refuses fail its calls: {stderr}"
    );

    // --check: a module whose output differs from what ran live fails the run.
    let (ok, _, stderr) = wasmplane(&["replay", file, "--check"]);
    assert!(!ok && stderr.contains("1 revisions differ from the recorded live output"), "{stderr}");
}

#[test]
fn unreadable_recordings_fail_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let garbage = write("garbage.jsonl", "PK\u{3}\u{4} not json at all\n");
    let future = write(
        "future.jsonl",
        "{\"format\":\"wasmplane-recording\",\"version\":99,\"wit\":\"wasmplane:dataplane@1.0.0\"}\n",
    );
    let other_wit = write(
        "wit.jsonl",
        "{\"format\":\"wasmplane-recording\",\"version\":1,\"wit\":\"wasmplane:dataplane@2.0.0\"}\n",
    );
    let header = std::fs::read_to_string(fixture()).unwrap().lines().next().unwrap().to_string();
    let truncated = write("truncated.jsonl", &format!("{header}\n{{\"revision\": 4, \"context\": {{\"node_na\n"));

    assert!(matches!(RecordingReader::open(&garbage), Err(RecordError::NotARecording { .. })));
    assert!(matches!(RecordingReader::open(&future), Err(RecordError::UnsupportedVersion { found: 99, .. })));
    assert!(matches!(RecordingReader::open(&other_wit), Err(RecordError::WitMismatch { .. })));
    let lines: Vec<_> = RecordingReader::open(&truncated).unwrap().collect();
    assert!(matches!(lines.as_slice(), [Err(RecordError::BadLine { line: 2, .. })]), "{lines:?}");

    for (path, expected) in [
        (&garbage, "not a wasmplane recording (line 1: not JSON"),
        (&future, "recording format version 99, this wasmplane reads version 1"),
        (&other_wit, "recorded against wasmplane:dataplane@2.0.0, this wasmplane implements wasmplane:dataplane@1.2.0"),
        (&truncated, "truncated.jsonl:2: not a revision record"),
    ] {
        let (ok, stdout, stderr) = wasmplane(&["replay", path.to_str().unwrap()]);
        assert!(!ok, "{path:?} replayed: {stdout}");
        assert!(stderr.contains(expected), "{path:?}: expected {expected:?} in {stderr}");
    }
    let (ok, _, stderr) = wasmplane(&["replay", fixture().to_str().unwrap(), "--module", "/nonexistent/m.wasm"]);
    assert!(!ok && stderr.contains("reading module /nonexistent/m.wasm"), "{stderr}");
    // Reported as a command line tool does, with its causes, and no backtrace even where
    // RUST_BACKTRACE is set for the host's panics.
    let out = Command::new(env!("CARGO_BIN_EXE_wasmplane"))
        .args(["replay", fixture().to_str().unwrap(), "--module", "/nonexistent/m.wasm"])
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.starts_with("error: ") && stderr.contains("reading module /nonexistent/m.wasm"), "{stderr}");
    assert_eq!(stderr.matches("No such file or directory").count(), 1, "each cause once: {stderr}");
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr}");
    // Not a service translator: refused when loaded, like an upload.
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    assert!(matches!(Replayer::new(&runtime, Some(("gc", artifacts::GC))), Err(ReplayError::Load { .. })));
}

/// The committed fixture (read by the SDK harness test in guests/service-translator) stays
/// readable by this host and replays without errors. Regenerate it with
/// `WASMPLANE_UPDATE_RECORDINGS=1 cargo test --workspace --test record_replay`.
#[test]
fn the_committed_fixture_replays() {
    let revisions = read_all(&fixture());
    assert!(revisions.iter().any(|r| r.translator.as_deref() == Some(DEFAULT)));
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let mut default = Replayer::new(&runtime, None).unwrap();
    for record in &revisions {
        let replayed = default.revision(record);
        assert!(replayed.outputs.values().all(Result::is_ok), "revision {}: {:?}", record.revision, replayed.outputs);
    }
}

/// The settings of the translator in force are recorded with its outputs, and replay runs
/// each revision with them unless told otherwise: a recording made with settings replays to
/// what was applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recordings_carry_the_settings_in_force() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("manifests")).unwrap();
    let recording = dir.path().join("recording.jsonl");
    let host = recording_host(dir.path(), &recording).await;
    let mut live = Live { host, client: reqwest::Client::new(), dir, snapshots: Vec::new() };
    let front = |endpoint: &str| {
        let yaml = service("front", "10.96.0.30", 80, 8080, false, Some(&[(endpoint, "node-a", true)]));
        format!("{NODE}{}", yaml.replacen("namespace: shop }", "namespace: shop, labels: { tier: front } }", 1))
    };
    live.write("shop.yaml", &front("10.244.0.41"));
    live.snapshot("initial state", |dp| dp["objects"].get("shop/front").is_some()).await;
    let upload = live
        .client
        .put(format!("{}/v1/modules/port-filter?kind=service-translator", live.host.url()))
        .bearer_auth(TOKEN)
        .body(artifacts::examples::PORT_FILTER_TRANSLATOR.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(upload.status(), StatusCode::CREATED);
    let settings = live
        .client
        .put(format!("{}/v1/modules/port-filter/settings", live.host.url()))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"label": "tier", "value": "front"}))
        .send()
        .await
        .unwrap();
    assert!(settings.status().is_success(), "{}", settings.text().await.unwrap());
    live.write("shop.yaml", &front("10.244.0.42"));
    live.snapshot("the endpoint moved, exposed by the settings", |dp| {
        rules_text(dp, "shop/front").contains("10.244.0.42")
    })
    .await;
    let Live { host, snapshots, .. } = live;
    host.stop().await;

    let revisions = read_all(&recording);
    let last = revisions.last().unwrap();
    assert_eq!(
        (last.translator.as_deref(), last.translator_settings.clone()),
        (Some(PORT_FILTER), Some(serde_json::json!({"label": "tier", "value": "front"})))
    );
    assert_eq!(revisions[0].translator_settings, None, "the builtin ran without settings");
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let module = Some(("port-filter", artifacts::examples::PORT_FILTER_TRANSLATOR));
    let replayed = Replayer::new(&runtime, module).unwrap().revision(last);
    assert_eq!(replayed.matches_recording(), Some(true), "with the recorded settings");
    assert!(
        serde_json::to_string(&replayed.outcomes()["shop/front"]).unwrap().contains("10.244.0.42"),
        "exposed by the label the settings name"
    );
    assert_eq!(snapshots.last().unwrap().revision, last.revision);
    let without = Replayer::with_settings(&runtime, module, "{}").unwrap().revision(last);
    assert_eq!(without.matches_recording(), Some(false), "settings given by hand are used instead");
}
