//! Issue 9's security features through the HTTP API of a real host: module signatures,
//! capability grants, the audit log in the kvstore, TLS, and Kubernetes TokenReview +
//! SubjectAccessReview authentication (against the test API server).

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use support::rest::{
    WEB_SERVICE, documents, endpoint_slice, error_of, json_answer, limited_config, upload_request, write_manifest,
};
use wasmplane::admission;
use wasmplane::app::{HostConfig, KubernetesSource, RunningHost, start};
use wasmplane::audit::AuditRecord;
use wasmplane::auth::{KubernetesAuthConfig, TlsFiles};
use wasmplane_guest_artifacts as artifacts;
use wasmplane_runtime::Limits;

const TOKEN: &str = "test-token-0123456789abcdef";

fn base_config(dir: &Path) -> HostConfig {
    write_manifest(
        &dir.join("manifests"),
        "shop.yaml",
        &documents(&[WEB_SERVICE, &endpoint_slice("web", "http", 8080, &[("10.244.0.11", "node-a")])]),
    );
    limited_config(dir, TOKEN, Duration::from_millis(500))
}

fn plain_client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap()
}

async fn upload(
    client: &reqwest::Client,
    host: &RunningHost,
    name: &str,
    bytes: &[u8],
    token: Option<&str>,
    signature: Option<&str>,
) -> (StatusCode, Value) {
    let mut rb = upload_request(client, &host.url(), name, "service-translator", bytes);
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    if let Some(s) = signature {
        rb = rb.header("X-Wasmplane-Signature", s);
    }
    json_answer(rb).await
}

async fn module_names(client: &reqwest::Client, host: &RunningHost) -> Vec<String> {
    let modules: Value = client.get(format!("{}/v1/modules", host.url())).send().await.unwrap().json().await.unwrap();
    modules["modules"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap().to_string()).collect()
}

/// Appends a custom section: still a valid component, different bytes (a tampered upload
/// that passes every structural check and must be caught by the signature alone).
fn tampered(bytes: &[u8]) -> Vec<u8> {
    let name = b"tampered";
    let payload = b"evil";
    let mut out = bytes.to_vec();
    out.push(0); // custom section id
    out.push((1 + name.len() + payload.len()) as u8);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(payload);
    out
}

async fn audit_records(host: &RunningHost) -> Vec<(String, AuditRecord)> {
    let listing = host.modules.store().kv().list_prefix("/wasmplane/audit/").await.unwrap();
    listing.items.iter().map(|kv| (kv.key.clone(), serde_json::from_slice(&kv.value).unwrap())).collect()
}

fn write_key_pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let (private, public) = admission::generate_key_pair().unwrap();
    let (private_path, public_path) = (dir.join(name), dir.join(format!("{name}.pub")));
    std::fs::write(&private_path, private).unwrap();
    std::fs::write(&public_path, public).unwrap();
    (private_path, public_path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_unsigned_wrongly_signed_and_tampered_uploads() {
    let dir = tempfile::tempdir().unwrap();
    let (trusted_private, trusted_public) = write_key_pair(dir.path(), "trusted");
    let (other_private, _) = write_key_pair(dir.path(), "other");
    let host = start(HostConfig { trusted_keys: vec![trusted_public], ..base_config(dir.path()) }).await.unwrap();
    let client = plain_client();
    let trusted = admission::read_private_key(&trusted_private).unwrap();
    let other = admission::read_private_key(&other_private).unwrap();
    let module = artifacts::examples::PORT_FILTER_TRANSLATOR;
    let good = admission::sign(&trusted, module);

    let cases: Vec<(&str, Vec<u8>, Option<String>, &str)> = vec![
        ("unsigned", module.to_vec(), None, "is not signed"),
        (
            "wrongly-signed",
            module.to_vec(),
            Some(admission::sign(&other, module)),
            "does not verify with any of the 1 trusted key(s)",
        ),
        ("tampered", tampered(module), Some(good.clone()), "does not verify"),
        ("garbled", module.to_vec(), Some("not-a-signature".into()), "not a base64-encoded 64-byte ed25519 signature"),
    ];
    for (name, bytes, signature, message) in cases {
        let (status, body) = upload(&client, &host, name, &bytes, Some(TOKEN), signature.as_deref()).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{name}: {body}");
        assert!(error_of(&body).contains(message), "{name}: {message:?} not in {body}");
    }
    // The tampered bytes are a valid component: only the signature refused them.
    let (status, body) = upload(
        &client,
        &host,
        "tampered",
        &tampered(module),
        Some(TOKEN),
        Some(&admission::sign(&trusted, &tampered(module))),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "the tampered bytes, signed, are a valid module: {body}");
    let r = client.delete(format!("{}/v1/modules/tampered", host.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        module_names(&client, &host).await,
        vec!["default-gc", "default-network-policy", "default-service-translator"],
        "nothing refused was stored"
    );

    let (status, body) = upload(&client, &host, "port-filter", module, Some(TOKEN), Some(&good)).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["digest"], wasmplane_runtime::LoadedModule::digest_of(module));
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_makes_keys_signs_and_pushes_the_signature() {
    use wasmplane::cli::{ApiArgs, ModuleCommand, module_command};
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("release-key");
    module_command(
        ApiArgs { api: "http://unused".into(), token: None, token_file: None },
        ModuleCommand::Keygen { out: key.clone() },
    )
    .await
    .unwrap();
    let public = dir.path().join("release-key.pub");
    assert!(std::fs::read_to_string(&public).unwrap().contains("BEGIN PUBLIC KEY"));
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the private key is private");
    let again = module_command(
        ApiArgs { api: "http://unused".into(), token: None, token_file: None },
        ModuleCommand::Keygen { out: key.clone() },
    )
    .await;
    assert!(again.is_err(), "keygen never overwrites a key");

    let host = start(HostConfig { trusted_keys: vec![public], ..base_config(dir.path()) }).await.unwrap();
    let api = || ApiArgs { api: host.url(), token: Some(TOKEN.into()), token_file: None };
    let file = dir.path().join("port_filter.wasm");
    std::fs::write(&file, artifacts::examples::PORT_FILTER_TRANSLATOR).unwrap();
    let push = || ModuleCommand::Push {
        name: "cli-filter".into(),
        source: file.display().to_string(),
        kind: "service-translator".into(),
        no_activate: false,
        registry: Default::default(),
    };
    let refused = module_command(api(), push()).await.unwrap_err().to_string();
    assert!(refused.contains("403") && refused.contains("is not signed"), "{refused}");
    module_command(api(), ModuleCommand::Sign { key: key.clone(), file: file.clone() }).await.unwrap();
    assert!(dir.path().join("port_filter.wasm.sig").exists());
    module_command(api(), push()).await.unwrap();
    let (_, module) = {
        let r = plain_client().get(format!("{}/v1/modules/cli-filter", host.url())).send().await.unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    };
    assert_eq!(module["status"], "active", "{module}");
    host.stop().await;
}

/// The capability interfaces (`log`, `lookups`) a component imports, as the loader sees them.
fn capabilities_of(bytes: &[u8]) -> Vec<String> {
    let runtime = wasmplane_runtime::Runtime::new(Limits::default(), None).unwrap();
    let loaded = runtime.load("probe", bytes, None, 16 << 20).unwrap();
    loaded
        .info
        .imports
        .iter()
        .filter_map(|i| i.strip_prefix("wasmplane:dataplane/"))
        .map(|i| i.split('@').next().unwrap().to_string())
        .filter(|i| admission::CAPABILITIES.contains(&i.as_str()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ungranted_imports_are_refused_at_upload() {
    let dir = tempfile::tempdir().unwrap();
    let example = artifacts::examples::PORT_FILTER_TRANSLATOR;
    let example_caps = capabilities_of(example);
    assert!(example_caps.contains(&"log".to_string()), "the example logs: {example_caps:?}");
    // `trusted` gets everything, `*` nothing, `almost` everything the example imports but one.
    let missing = example_caps[0].clone();
    let almost: Vec<&String> = example_caps.iter().filter(|c| **c != missing).collect();
    let grants = format!("trusted: [log, lookups]\n\"*\": []\nalmost: {almost:?}\n");
    std::fs::write(dir.path().join("grants.yaml"), grants).unwrap();
    let host =
        start(HostConfig { grants: Some(dir.path().join("grants.yaml")), ..base_config(dir.path()) }).await.unwrap();
    let client = plain_client();

    let (status, body) = upload(&client, &host, "stingy", example, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let error = error_of(&body);
    assert!(
        error.contains("wasmplane:dataplane/")
            && error.contains("is not granted")
            && error.contains("granted: nothing"),
        "{error}"
    );
    let (status, body) = upload(&client, &host, "almost", example, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        error_of(&body).contains(&format!("wasmplane:dataplane/{missing}@")),
        "the refusal names the interface: {body}"
    );

    // The builtin translator's bytes, uploaded under a name granted nothing.
    let builtin_caps = capabilities_of(artifacts::SERVICE_TRANSLATOR);
    let (status, body) = upload(&client, &host, "stingy", artifacts::SERVICE_TRANSLATOR, Some(TOKEN), None).await;
    if builtin_caps.is_empty() {
        assert_eq!(status, StatusCode::CREATED, "imports no capability: {body}");
    } else {
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(error_of(&body).contains(&format!("wasmplane:dataplane/{}@", builtin_caps[0])), "{body}");
    }

    let (status, body) = upload(&client, &host, "trusted", example, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    host.stop().await;

    // A grants file naming an unknown capability stops the host at start.
    std::fs::write(dir.path().join("typo.yaml"), "\"*\": [logs]\n").unwrap();
    let refused = start(HostConfig { grants: Some(dir.path().join("typo.yaml")), ..base_config(dir.path()) })
        .await
        .err()
        .expect("bad grants must not start");
    assert!(format!("{refused:#}").contains("unknown capability \"logs\""), "{refused:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutating_calls_are_audited_in_the_kvstore() {
    let dir = tempfile::tempdir().unwrap();
    let host = start(base_config(dir.path())).await.unwrap();
    let client = plain_client();
    let module = artifacts::examples::PORT_FILTER_TRANSLATOR;

    let (status, _) = upload(&client, &host, "sneaky", module, None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, body) = upload(&client, &host, "port-filter", module, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, _) = upload(&client, &host, "broken", b"not wasm at all", Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let r =
        client.post(format!("{}/v1/modules/port-filter/rollback", host.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    let r = client.delete(format!("{}/v1/modules/port-filter", host.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    // Reads are not audited.
    let _ = client.get(format!("{}/v1/modules", host.url())).send().await.unwrap();

    let records = audit_records(&host).await;
    let summary: Vec<(String, String, String, u16)> =
        records.iter().map(|(_, r)| (r.user.clone(), r.method.clone(), r.path.clone(), r.status)).collect();
    assert_eq!(
        summary,
        vec![
            ("anonymous".into(), "PUT".into(), "/v1/modules/sneaky?kind=service-translator".into(), 401),
            ("static-token".into(), "PUT".into(), "/v1/modules/port-filter?kind=service-translator".into(), 201),
            ("static-token".into(), "PUT".into(), "/v1/modules/broken?kind=service-translator".into(), 400),
            ("static-token".into(), "POST".into(), "/v1/modules/port-filter/rollback".into(), 409),
            ("static-token".into(), "DELETE".into(), "/v1/modules/port-filter".into(), 204),
        ],
        "in order of time"
    );
    let (key, accepted) = &records[1];
    assert_eq!(accepted.digest.as_deref(), Some(body["digest"].as_str().unwrap()), "the upload's digest");
    assert_eq!(accepted.digest.as_deref(), Some(wasmplane_runtime::LoadedModule::digest_of(module).as_str()));
    assert_eq!(
        records[2].1.digest.as_deref(),
        Some(wasmplane_runtime::LoadedModule::digest_of(b"not wasm at all").as_str())
    );
    // The refused upload's body was read after the refusal, to be dropped: its record says
    // what was sent.
    assert_eq!(
        records[0].1.digest.as_deref(),
        Some(wasmplane_runtime::LoadedModule::digest_of(module).as_str()),
        "what the refused client sent"
    );
    assert_eq!(records[4].1.digest, None);
    assert_eq!(accepted.auth, "token");
    assert_eq!(accepted.node, "node-a");
    assert!(accepted.peer.starts_with("127.0.0.1:"), "{accepted:?}");
    assert_eq!(*key, format!("/wasmplane/audit/node-a/{:020}", accepted.time_unix_nanos));
    assert!(records.windows(2).all(|w| w[0].1.time_unix_nanos < w[1].1.time_unix_nanos));
    let metrics = client.get(format!("{}/metrics", host.url())).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("wasmplane_audit_write_failures_total 0"), "{metrics}");
    host.stop().await;
}

/// A self-signed certificate for 127.0.0.1 and localhost, written as PEM files.
fn self_signed(dir: &Path) -> (TlsFiles, reqwest::Certificate) {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    let files = TlsFiles { cert: dir.join("tls.crt"), key: dir.join("tls.key") };
    std::fs::write(&files.cert, cert.pem()).unwrap();
    std::fs::write(&files.key, signing_key.serialize_pem()).unwrap();
    (files, reqwest::Certificate::from_pem(cert.pem().as_bytes()).unwrap())
}

fn trusting_client(ca: &reqwest::Certificate) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(ca.clone())
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_only_tls_and_token_checks_hold_over_it() {
    let dir = tempfile::tempdir().unwrap();
    let (files, ca) = self_signed(dir.path());
    let host = start(HostConfig { tls: Some(files), ..base_config(dir.path()) }).await.unwrap();
    assert!(host.url().starts_with("https://127.0.0.1:"), "{}", host.url());
    let client = trusting_client(&ca);
    let r = client.get(format!("{}/healthz", host.url())).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);

    // Plain HTTP to the TLS port, and TLS without trusting the certificate, both fail.
    let plain = plain_client().get(format!("http://{}/healthz", host.addr)).send().await;
    assert!(
        plain.is_err() || !plain.as_ref().unwrap().status().is_success(),
        "plain HTTP must not be served: {plain:?}"
    );
    let untrusting = reqwest::Client::builder().tls_built_in_root_certs(false).build().unwrap();
    let err =
        untrusting.get(format!("{}/healthz", host.url())).send().await.expect_err("an untrusted certificate must fail");
    assert!(err.is_connect(), "{err:?}");

    let module = artifacts::examples::PORT_FILTER_TRANSLATOR;
    let (status, body) = upload(&client, &host, "port-filter", module, None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(error_of(&body).contains("missing bearer token"), "{body}");
    let (status, body) = upload(&client, &host, "port-filter", module, Some("wrong-token-wrong-token"), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(error_of(&body).contains("invalid bearer token"), "{body}");
    let (status, body) = upload(&client, &host, "port-filter", module, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    // The peer address still reaches the API over TLS (loopback reads need no token).
    let r = client.get(format!("{}/v1/modules/port-filter", host.url())).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let records = audit_records(&host).await;
    assert_eq!(records.iter().map(|(_, r)| r.status).collect::<Vec<_>>(), vec![401, 401, 201]);
    assert!(records.iter().all(|(_, r)| r.peer.starts_with("127.0.0.1:")), "{records:?}");
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_tokens_are_reviewed_and_authorized_over_tls() {
    let apiserver = wasmplane_test_apiserver::TestApiServer::start().await;
    apiserver.add_token("alice-token", "alice", &["devs"]);
    apiserver.add_token("bob-token", "bob", &["devs"]);
    apiserver.allow("alice", "update", "wasmplane.io", "modules");
    let dir = tempfile::tempdir().unwrap();
    let (files, ca) = self_signed(dir.path());
    let kubernetes_auth = KubernetesAuthConfig {
        cache_ttl: Duration::from_secs(60),
        ..KubernetesAuthConfig::new(KubernetesSource::Url(apiserver.url()))
    };
    let host =
        start(HostConfig { tls: Some(files), kubernetes_auth: Some(kubernetes_auth), ..base_config(dir.path()) })
            .await
            .unwrap();
    let client = trusting_client(&ca);
    let module = artifacts::examples::PORT_FILTER_TRANSLATOR;

    let (status, body) = upload(&client, &host, "by-alice", module, Some("alice-token"), None).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(apiserver.review_counts(), (1, 1));
    let r = client
        .post(format!("{}/v1/modules/by-alice/activate", host.url()))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(apiserver.review_counts(), (1, 1), "the answer for alice's token is cached");

    let (status, body) = upload(&client, &host, "by-bob", module, Some("bob-token"), None).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(error_of(&body).contains("user \"bob\" may not update modules.wasmplane.io"), "{body}");
    let (status, body) = upload(&client, &host, "by-mallory", module, Some("mallory-token"), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(error_of(&body).contains("rejected by the Kubernetes TokenReview"), "{body}");
    let (status, body) = upload(&client, &host, "by-nobody", module, None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    // The static token keeps working beside Kubernetes tokens, without a review.
    let before = apiserver.review_counts();
    let (status, body) = upload(&client, &host, "by-operator", module, Some(TOKEN), None).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(apiserver.review_counts(), before);

    let names = module_names(&client, &host).await;
    assert!(
        names.contains(&"by-alice".to_string())
            && !names.contains(&"by-bob".to_string())
            && !names.contains(&"by-mallory".to_string()),
        "{names:?}"
    );
    let records = audit_records(&host).await;
    let who: Vec<(String, String, u16)> =
        records.iter().map(|(_, r)| (r.user.clone(), r.auth.clone(), r.status)).collect();
    assert_eq!(
        who,
        vec![
            ("alice".into(), "kubernetes".into(), 201),
            ("alice".into(), "kubernetes".into(), 200),
            ("bob".into(), "kubernetes".into(), 403),
            ("anonymous".into(), "none".into(), 401),
            ("anonymous".into(), "none".into(), 401),
            ("static-token".into(), "token".into(), 201),
        ]
    );
    host.stop().await;
}

/// The compiled forms a runtime left in its cache directory.
fn cached_artifacts(dir: &Path) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn child_compiler(program: &str) -> wasmplane_runtime::CompilerCommand {
    wasmplane_runtime::CompilerCommand::new(program, [wasmplane_runtime::compiler::COMPILE_SUBCOMMAND])
}

/// Guests compile in a child process of the `wasmplane` binary (so Cranelift's code and
/// memory stay out of the host): the same artifact as compiling in process, the same errors,
/// a clear one when the compiler cannot start, and no child at all on a cache hit.
#[test]
fn guests_compile_in_a_child_process_of_the_host_binary() {
    use wasmplane_runtime::{LoadError, NoLookups, Runtime};
    let bytes = artifacts::SERVICE_TRANSLATOR;
    let (child_cache, local_cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let child = Runtime::new(Limits::default(), Some(child_cache.path().into()))
        .unwrap()
        .compile_in_child(child_compiler(env!("CARGO_BIN_EXE_wasmplane")));
    let local = Runtime::new(Limits::default(), Some(local_cache.path().into())).unwrap();
    let module = child.load("t", bytes, None, 16 << 20).unwrap();
    local.load("t", bytes, None, 16 << 20).unwrap();
    let (from_child, from_local) = (cached_artifacts(child_cache.path()), cached_artifacts(local_cache.path()));
    assert_eq!(from_child.len(), 1);
    assert!(
        from_child == from_local,
        "the child's artifact differs from the in-process one ({} / {} bytes)",
        from_child[0].len(),
        from_local[0].len()
    );
    // Loaded from the file it was just cached in, as every later start loads it: mapped
    // (reclaimable page cache), not copied into anonymous memory.
    let cache_file = std::fs::read_dir(child_cache.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert!(maps.contains(cache_file.to_str().unwrap()), "{} is not mapped:\n{maps}", cache_file.display());

    // The child's code runs: a service with one endpoint is balanced over it.
    let mut session = module.translator(std::sync::Arc::new(NoLookups)).unwrap();
    let view = wasmplane_model::state::ServiceView {
        service: wasmplane_model::Service::cluster_ip(
            "shop",
            "web",
            "10.96.0.10",
            vec![wasmplane_model::ServicePort::tcp("http", 80, 8080)],
        )
        .into(),
        slices: vec![wasmplane_model::state::LocalSlice {
            name: "web-1".into(),
            endpoints: vec![wasmplane_model::state::LocalEndpoint {
                addresses: vec!["10.244.0.11".into()],
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some("node-a".into()),
                zone: None,
                is_local: true,
            }],
            ports: vec![wasmplane_model::EndpointPort {
                name: "http".into(),
                protocol: wasmplane_model::Protocol::Tcp,
                port: 8080,
            }],
        }],
    };
    let context = wasmplane_model::state::NodeContext {
        node_name: "node-a".into(),
        node_ips: vec![],
        cluster_cidrs: vec!["10.244.0.0/16".into()],
        pod_cidrs: vec![],
        zone: None,
    };
    let ruleset = session.translate(&context, "svc/shop/web", &view).unwrap();
    assert!(format!("{ruleset:?}").contains("10.244.0.11"), "{ruleset:?}");

    // A component that does not compile: the child's message is the one the host would give.
    let mut broken = bytes[..8].to_vec();
    broken.extend_from_slice(&[0x01, 0xff, 0xff, 0xff, 0xff, 0x0f]);
    let uncached = Runtime::new(Limits::default(), None).unwrap();
    let (LoadError::Compile(in_child), LoadError::Compile(in_process)) = (
        Runtime::new(Limits::default(), None)
            .unwrap()
            .compile_in_child(child_compiler(env!("CARGO_BIN_EXE_wasmplane")))
            .load("b", &broken, None, 16 << 20)
            .err()
            .unwrap(),
        uncached.load("b", &broken, None, 16 << 20).err().unwrap(),
    ) else {
        panic!("both must be compile errors");
    };
    assert_eq!(in_child, in_process);

    // A compiler that cannot start is a load error naming it; a cache hit starts none.
    let missing = Runtime::new(Limits::default(), Some(child_cache.path().into()))
        .unwrap()
        .compile_in_child(child_compiler("/nonexistent/wasmplane"));
    assert!(missing.load("t", bytes, None, 16 << 20).is_ok(), "a cached artifact needs no compiler");
    let error = missing.load("p", artifacts::examples::PORT_FILTER_TRANSLATOR, None, 16 << 20).err().unwrap();
    assert!(
        matches!(&error, LoadError::Compile(m) if m.contains("starting the compiler process /nonexistent/wasmplane")),
        "{error}"
    );
}

/// `wasmplane run` (the README's main command) compiles its default guests through itself as
/// the compiler process and serves the translated dataplane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_binary_runs_with_guests_compiled_in_a_child() {
    use tokio::io::AsyncBufReadExt as _;
    let dir = tempfile::tempdir().unwrap();
    write_manifest(
        &dir.path().join("manifests"),
        "shop.yaml",
        &documents(&[WEB_SERVICE, &endpoint_slice("web", "http", 8080, &[("10.244.0.11", "node-a")])]),
    );
    let data = dir.path().join("data");
    let mut host =
        host_binary(&dir.path().join("manifests"), &["--data-dir", data.to_str().unwrap()], "warn,wasmplane=info");
    // The log line that says how much of its binary and of the compiled guests was resident
    // when the host paged them out after the initial sync; the rest of the log is drained so
    // the host never blocks on it.
    let (paged_tx, paged_rx) = tokio::sync::oneshot::channel::<(u64, u64)>();
    let mut log = tokio::io::BufReader::new(host.stderr.take().unwrap()).lines();
    tokio::spawn(async move {
        let mut paged_tx = Some(paged_tx);
        while let Ok(Some(line)) = log.next_line().await {
            if line.contains("start-up code paged out") {
                let kib = |field: &str| {
                    line.split(field)
                        .nth(1)
                        .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok())
                };
                if let (Some(binary), Some(guests), Some(tx)) =
                    (kib("binary_kib="), kib("guests_kib="), paged_tx.take())
                {
                    let _ = tx.send((binary, guests));
                }
            }
        }
    });
    let url = printed_rest_api(&mut host).await;
    let client = plain_client();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let dataplane = client.get(format!("{url}/v1/dataplane")).send().await.unwrap().text().await.unwrap();
        if dataplane.contains("10.244.0.11") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the web service was not translated: {dataplane}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cached_artifacts(&data.join("compiled")).len() >= 2, "the default guests' compiled forms are cached");
    // Each compile request's process is gone (waited for, not left as a zombie).
    let pid = host.id().unwrap();
    let children: String = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|task| std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default())
        .collect();
    assert_eq!(children.trim(), "", "the host keeps no compiler process");
    // After the initial sync the start-up code of the binary and of the compiled guests was
    // handed back to the kernel: what is resident of each now is less than what was before.
    // (Not by a set share: pages that other tests' compiler processes map from the same binary
    // stay. Only this host maps its compiled guests.)
    let (binary_kib, guests_kib) = tokio::time::timeout(Duration::from_secs(30), paged_rx)
        .await
        .expect("the host logged its page-out within 30 s")
        .unwrap();
    let reclaimable_kib = |mappings: Vec<wasmplane::memory::FileMapping>| {
        mappings.iter().filter(|m| m.reclaimable()).map(|m| m.resident_kib).sum::<u64>()
    };
    let binary_now = reclaimable_kib(wasmplane::memory::binary_mappings(&pid.to_string()).unwrap());
    let guests_now =
        reclaimable_kib(wasmplane::memory::mappings_under(&pid.to_string(), &data.join("compiled")).unwrap());
    assert!(
        binary_kib > 0 && binary_now < binary_kib,
        "the binary: {binary_kib} KiB resident when paged out, {binary_now} KiB now"
    );
    assert!(
        guests_kib > 0 && guests_now < guests_kib / 2,
        "the compiled guests: {guests_kib} KiB resident when paged out, {guests_now} KiB now"
    );
    // What the kubelet sends to stop a pod: the host stops gracefully and exits 0.
    terminate(&host);
    let status = tokio::time::timeout(Duration::from_secs(20), host.wait())
        .await
        .expect("the host exits within 20 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "a graceful stop on SIGTERM: {status}");
}

/// `wasmplane run` over `manifests` with `args` besides, stdout and stderr piped, killed when
/// dropped.
fn host_binary(manifests: &std::path::Path, args: &[&str], rust_log: &str) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_wasmplane"))
        .args(["run", "--listen", "127.0.0.1:0", "--node-name", "node-a", "--manifests"])
        .arg(manifests)
        .args(args)
        .env("RUST_LOG", rust_log)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// The REST API's address, from the line the host prints on stdout once it serves; the rest of
/// stdout is drained, as a terminal or the kubelet would, so the host's later lines find a reader.
async fn printed_rest_api(host: &mut tokio::process::Child) -> String {
    use tokio::io::AsyncBufReadExt as _;
    let mut lines = tokio::io::BufReader::new(host.stdout.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = line.strip_prefix("wasmplane REST API: ") {
                return rest.split_whitespace().next().unwrap().to_string();
            }
        }
        panic!("the host exited without printing its REST API");
    })
    .await
    .expect("the host printed its REST API within 60 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    url
}

/// SIGTERM, as the kubelet stops a container.
fn terminate(host: &tokio::process::Child) {
    let pid = host.id().expect("still running").to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
}

/// `--log-format json`: every line on stderr is one JSON object a log collector indexes
/// (level, target, the event's fields at the top level), from start-up to the graceful stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_binary_logs_json_objects_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    write_manifest(&dir.path().join("manifests"), "shop.yaml", &documents(&[WEB_SERVICE]));
    let data = dir.path().join("data");
    let mut host = host_binary(
        &dir.path().join("manifests"),
        &["--log-format", "json", "--data-dir", data.to_str().unwrap()],
        "info",
    );
    printed_rest_api(&mut host).await;
    terminate(&host);
    let output = tokio::time::timeout(Duration::from_secs(20), host.wait_with_output())
        .await
        .expect("the host exits within 20 s of SIGTERM")
        .unwrap();
    assert!(output.status.success(), "{}: {}", output.status, String::from_utf8_lossy(&output.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8(output.stderr)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON object ({e}): {line}")))
        .collect();
    assert!(lines.len() >= 2, "{lines:?}");
    for line in &lines {
        assert!(
            line["timestamp"].is_string()
                && line["level"].is_string()
                && line["target"].is_string()
                && line["message"].is_string(),
            "{line}"
        );
    }
    // The event's own fields beside the message, not nested.
    assert!(lines.iter().any(|l| l["message"] == "shutting down" && l["signal"] == "SIGTERM"), "{lines:?}");
}

/// Whether this process holds CAP_SYS_RESOURCE, which lowering an `oom_score_adj` takes.
fn may_lower_oom_score_adj() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap();
    effective & (1 << CAP_SYS_RESOURCE) != 0
}

/// kube-proxy's `--oom-score-adj`: the host sets its own before it serves, -999 unless told
/// otherwise (lowering it needs root; raising it, anyone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_binary_sets_its_oom_score_adj() {
    let dir = tempfile::tempdir().unwrap();
    let manifests = dir.path().join("manifests");
    write_manifest(&manifests, "shop.yaml", &documents(&[WEB_SERVICE]));
    let oom_score_adj = |host: &tokio::process::Child| {
        let text = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", host.id().expect("running"))).unwrap();
        text.trim().parse::<i32>().unwrap()
    };
    let inherited = std::fs::read_to_string("/proc/self/oom_score_adj").unwrap().trim().parse::<i32>().unwrap();
    let may_lower = may_lower_oom_score_adj();
    if !may_lower {
        eprintln!(
            "SKIPPED in part (no CAP_SYS_RESOURCE, as in some sandboxes even for root): -999 cannot be set here; checking the warning instead"
        );
    }
    for (i, (args, expected)) in
        [(vec!["--oom-score-adj", "500"], 500), (vec![], if may_lower { -999 } else { inherited })]
            .into_iter()
            .enumerate()
    {
        let data = dir.path().join(format!("data-{i}"));
        let mut host =
            host_binary(&manifests, &[args.as_slice(), &["--data-dir", data.to_str().unwrap()]].concat(), "warn");
        printed_rest_api(&mut host).await;
        assert_eq!(oom_score_adj(&host), expected, "{args:?}");
        terminate(&host);
        let output = tokio::time::timeout(Duration::from_secs(20), host.wait_with_output())
            .await
            .expect("the host exits within 20 s of SIGTERM")
            .unwrap();
        assert!(output.status.success(), "{}", output.status);
        let refused = String::from_utf8_lossy(&output.stderr).contains("could not set oom_score_adj to -999");
        assert_eq!(refused, args.is_empty() && !may_lower, "{}", String::from_utf8_lossy(&output.stderr));
    }
}

/// A host whose stdout reader went away (a closed terminal, a log pipe that died) keeps serving:
/// its start-up lines are logged as not printed instead of panicking the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_binary_keeps_running_when_its_stdout_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    write_manifest(&dir.path().join("manifests"), "shop.yaml", &documents(&[WEB_SERVICE]));
    let data = dir.path().join("data");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut host = tokio::process::Command::new(env!("CARGO_BIN_EXE_wasmplane"))
        .args([
            "run",
            "--listen",
            "127.0.0.1:0",
            "--node-name",
            "node-a",
            "--data-dir",
            data.to_str().unwrap(),
            "--manifests",
        ])
        .arg(dir.path().join("manifests"))
        .env("RUST_LOG", "warn")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // The REST API's line, from the warning that says it could not be printed.
    use tokio::io::AsyncBufReadExt as _;
    let mut log = tokio::io::BufReader::new(host.stderr.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = log.next_line().await.unwrap() {
            if let Some((_, rest)) = line.split_once("wasmplane REST API: ") {
                return rest.split_whitespace().next().unwrap().to_string();
            }
        }
        panic!("the host exited without saying where its REST API is");
    })
    .await
    .expect("the host logged its REST API within 60 s");
    tokio::spawn(async move { while let Ok(Some(_)) = log.next_line().await {} });
    let health = plain_client().get(format!("{url}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    terminate(&host);
    let status = tokio::time::timeout(Duration::from_secs(20), host.wait())
        .await
        .expect("the host exits within 20 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

/// `module inspect`: what a host would make of a component, offline, and what it says of
/// settings before they are set (Kubewarden's `kwctl inspect`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_inspects_a_component_and_its_settings_offline() {
    use wasmplane::cli::{ApiArgs, ModuleCommand, inspect, module_command};
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("port_filter.wasm");
    std::fs::write(&file, artifacts::examples::PORT_FILTER_TRANSLATOR).unwrap();
    let (good, bad) = (dir.path().join("good.yaml"), dir.path().join("bad.json"));
    std::fs::write(&good, "label: tier\nvalue: front\n").unwrap();
    std::fs::write(&bad, r#"{"lable": "tier"}"#).unwrap();
    let report = inspect(&file, Some(&good)).unwrap();
    assert_eq!(
        (report["kind"].as_str(), report["witVersion"].as_str(), report["validatesSettings"].as_bool()),
        (Some("service-translator"), Some("1.2.0"), Some(true)),
        "{report}"
    );
    assert_eq!(
        report["digest"],
        wasmplane_runtime::LoadedModule::digest_of(artifacts::examples::PORT_FILTER_TRANSLATOR)
    );
    assert!(
        report["imports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i.as_str().unwrap().contains("wasmplane:dataplane/settings")),
        "{report}"
    );
    assert_eq!(report["settings"], serde_json::json!({"accepted": true}));
    assert!(report["settings"]["refused"].is_null() && report["signature"].is_null());
    let refused = inspect(&file, Some(&bad)).unwrap();
    assert!(refused["settings"]["refused"].as_str().unwrap().contains("unknown field `lable`"), "{refused}");
    // The command fails on refused settings, naming the reason.
    let api = ApiArgs { api: "http://unused".into(), token: None, token_file: None };
    let failed = module_command(api, ModuleCommand::Inspect { file: file.clone(), settings: Some(bad) })
        .await
        .unwrap_err()
        .to_string();
    assert!(failed.contains("refuses the settings") && failed.contains("lable"), "{failed}");
    // A module that does not check its settings says so; something that is not a module is
    // refused as a host would refuse it.
    let builtin = dir.path().join("default.wasm");
    std::fs::write(&builtin, artifacts::SERVICE_TRANSLATOR).unwrap();
    let unchecked = inspect(&builtin, Some(&good)).unwrap();
    assert_eq!(
        (unchecked["validatesSettings"].as_bool(), unchecked["settings"]["unchecked"].is_string()),
        (Some(false), true),
        "{unchecked}"
    );
    let core = dir.path().join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
    assert!(format!("{:#}", inspect(&core, None).unwrap_err()).contains("a host would refuse it"));
}
