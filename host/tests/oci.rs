//! Modules through a real OCI registry (Debian's `docker-registry`): `module publish` pushes
//! a component as a Wasm artifact, `module pull` and `module push NAME oci://…` fetch it,
//! its signature travels with it to a host that requires signatures, every blob is checked
//! against its digest, and artifacts that are not one module are refused with the reason.

mod support;

use std::path::Path;
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::secrets::RegistryAuth;
use serde_json::Value;
use support::registry::OciRegistry;
use support::rest::{WEB_SERVICE, documents, endpoint_slice, limited_config, write_manifest};
use wasmplane::admission;
use wasmplane::app::{HostConfig, start};
use wasmplane::cli::{ApiArgs, ModuleCommand, RegistryArgs, module_command};
use wasmplane_guest_artifacts as artifacts;
use wasmplane_runtime::LoadedModule;

const TOKEN: &str = "oci-test-token-0123456789abcdef";
/// The private registries' one user's password, and its bcrypt (cost 4) as `htpasswd -B`
/// writes it.
const PASSWORD: &str = "wasmplane-registry-pw";
const BCRYPT: &str = "$2b$04$bKSA1Lo4rJLrduJIiUyTY.JiwnBKLC6TprjkFp68zyJ9/YEj4M3Be";

fn plain_http() -> RegistryArgs {
    RegistryArgs { plain_http: true, ..RegistryArgs::default() }
}

fn no_api() -> ApiArgs {
    ApiArgs { api: "http://unused".into(), token: None, token_file: None }
}

async fn publish(file: &Path, reference: &str) -> anyhow::Result<()> {
    module_command(
        no_api(),
        ModuleCommand::Publish { file: file.into(), reference: reference.into(), registry: plain_http() },
    )
    .await
}

async fn pull(reference: &str, out: &Path) -> anyhow::Result<()> {
    module_command(
        no_api(),
        ModuleCommand::Pull { reference: reference.into(), out: out.into(), registry: plain_http() },
    )
    .await
}

/// The manifest as the registry serves it, and its digest.
async fn manifest(registry: &OciRegistry, repository: &str, tag: &str) -> (Value, String) {
    let r = reqwest::Client::new()
        .get(format!("http://{}/v2/{repository}/manifests/{tag}", registry.addr()))
        .header("Accept", "application/vnd.oci.image.manifest.v1+json")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let digest = r.headers()["docker-content-digest"].to_str().unwrap().to_string();
    (r.json().await.unwrap(), digest)
}

/// Another tool's artifact: `layers` as given, pushed with the registry client itself.
async fn push_foreign(registry: &OciRegistry, repository: &str, layers: Vec<ImageLayer>) {
    let client = oci_client::Client::new(ClientConfig { protocol: ClientProtocol::Http, ..ClientConfig::default() });
    let reference = format!("{}/{repository}:v1", registry.addr()).parse().unwrap();
    let config = Config::new(b"{}".to_vec(), "application/vnd.wasm.config.v1+json".into(), None);
    client.push(&reference, &layers, config, &RegistryAuth::Anonymous, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_travel_through_an_oci_registry_with_their_signatures() {
    let registry = OciRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let oci = |path: &str| format!("oci://{}/{path}", registry.addr());
    let module = artifacts::examples::PORT_FILTER_TRANSLATOR;
    let file = dir.path().join("port_filter.wasm");
    std::fs::write(&file, module).unwrap();

    // Published unsigned: the CNCF Wasm artifact layout.
    publish(&file, &oci("modules/port-filter:unsigned")).await.unwrap();
    let (unsigned_manifest, _) = manifest(&registry, "modules/port-filter", "unsigned").await;
    assert_eq!(unsigned_manifest["config"]["mediaType"], "application/vnd.wasm.config.v0+json", "{unsigned_manifest}");
    assert_eq!(unsigned_manifest["artifactType"], "application/wasm");
    let layers = unsigned_manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);
    assert_eq!(
        (layers[0]["mediaType"].as_str(), layers[0]["digest"].as_str()),
        (Some("application/wasm"), Some(LoadedModule::digest_of(module).as_str()))
    );
    assert!(layers[0].get("annotations").is_none(), "no signature to carry: {unsigned_manifest}");

    // Pulled back: the same bytes, and no signature file.
    let pulled = dir.path().join("pulled.wasm");
    std::fs::write(dir.path().join("pulled.wasm.sig"), "stale\n").unwrap();
    pull(&oci("modules/port-filter:unsigned"), &pulled).await.unwrap();
    assert_eq!(std::fs::read(&pulled).unwrap(), module);
    assert!(!dir.path().join("pulled.wasm.sig").exists(), "a stale signature would be sent with other bytes");

    // Signed, then published again: the signature is an annotation of the Wasm layer.
    let (private, public) = admission::generate_key_pair().unwrap();
    let (key, public_key) = (dir.path().join("release-key"), dir.path().join("release-key.pub"));
    std::fs::write(&key, private).unwrap();
    std::fs::write(&public_key, public).unwrap();
    module_command(no_api(), ModuleCommand::Sign { key: key.clone(), file: file.clone() }).await.unwrap();
    let signature = std::fs::read_to_string(dir.path().join("port_filter.wasm.sig")).unwrap();
    publish(&file, &oci("modules/port-filter:v1")).await.unwrap();
    let (signed_manifest, signed_digest) = manifest(&registry, "modules/port-filter", "v1").await;
    assert_eq!(signed_manifest["layers"][0]["annotations"]["dev.wasmplane.signature"], signature.trim());
    pull(&oci("modules/port-filter:v1"), &pulled).await.unwrap();
    assert_eq!(std::fs::read_to_string(dir.path().join("pulled.wasm.sig")).unwrap().trim(), signature.trim());

    // A host that requires signatures: the unsigned artifact is refused, the signed one
    // admitted, by tag and by the manifest's digest.
    let manifests = dir.path().join("manifests");
    write_manifest(
        &manifests,
        "shop.yaml",
        &documents(&[WEB_SERVICE, &endpoint_slice("web", "http", 8080, &[("10.244.0.11", "node-a")])]),
    );
    let host = start(HostConfig {
        trusted_keys: vec![public_key],
        ..limited_config(dir.path(), TOKEN, Duration::from_millis(500))
    })
    .await
    .unwrap();
    let api = || ApiArgs { api: host.url(), token: Some(TOKEN.into()), token_file: None };
    let push = |name: &str, source: String| ModuleCommand::Push {
        name: name.into(),
        source,
        kind: "service-translator".into(),
        no_activate: false,
        registry: plain_http(),
    };
    let refused =
        module_command(api(), push("from-oci", oci("modules/port-filter:unsigned"))).await.unwrap_err().to_string();
    assert!(refused.contains("403") && refused.contains("is not signed"), "{refused}");
    module_command(api(), push("from-oci", oci("modules/port-filter:v1"))).await.unwrap();
    let pinned = format!("modules/port-filter@{signed_digest}");
    module_command(api(), push("pinned", oci(&pinned))).await.unwrap();
    for name in ["from-oci", "pinned"] {
        let record: Value =
            reqwest::get(format!("{}/v1/modules/{name}", host.url())).await.unwrap().json().await.unwrap();
        assert_eq!(record["versions"][0]["digest"], LoadedModule::digest_of(module), "{record}");
    }
    // A digest the repository does not have is not another module's.
    let absent = format!("modules/port-filter@{}", LoadedModule::digest_of(b"no such manifest"));
    let e = module_command(api(), push("absent", oci(&absent))).await.unwrap_err();
    assert!(format!("{e:#}").contains("pulling"), "{e:#}");
    host.stop().await;

    // Bytes changed in the registry's storage: the digest check refuses them.
    let blob = registry.blob_path(&LoadedModule::digest_of(module));
    let mut corrupt = std::fs::read(&blob).unwrap();
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0xff;
    std::fs::write(&blob, corrupt).unwrap();
    let e = pull(&oci("modules/port-filter:v1"), &dir.path().join("corrupt.wasm")).await.unwrap_err();
    assert!(format!("{e:#}").to_lowercase().contains("digest"), "{e:#}");
    assert!(!dir.path().join("corrupt.wasm").exists(), "nothing written from a failed pull");

    // Other tools' artifacts: Kubewarden's Wasm layer type is read; an image without a Wasm
    // layer, or with two, is not a module.
    let kubewarden = artifacts::SERVICE_TRANSLATOR;
    push_foreign(
        &registry,
        "kubewarden/policy",
        vec![ImageLayer::new(kubewarden.to_vec(), "application/vnd.wasm.content.layer.v1+wasm".into(), None)],
    )
    .await;
    pull(&oci("kubewarden/policy:v1"), &pulled).await.unwrap();
    assert_eq!(std::fs::read(&pulled).unwrap(), kubewarden);
    push_foreign(&registry, "images/app", vec![ImageLayer::oci_v1(b"not wasm".to_vec(), None)]).await;
    let e = pull(&oci("images/app:v1"), &pulled).await.unwrap_err();
    assert!(format!("{e:#}").contains("holds no Wasm component"), "{e:#}");
    let two = |bytes: &[u8]| ImageLayer::new(bytes.to_vec(), "application/wasm".into(), None);
    push_foreign(&registry, "images/two", vec![two(module), two(kubewarden)]).await;
    let e = pull(&oci("images/two:v1"), &pulled).await.unwrap_err();
    assert!(format!("{e:#}").contains("2 Wasm layers"), "{e:#}");

    // Only components are published; references must say oci://.
    let core = dir.path().join("core.wasm");
    std::fs::write(&core, [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00]).unwrap();
    let e = publish(&core, &oci("modules/core:v1")).await.unwrap_err();
    assert!(format!("{e:#}").contains("core Wasm module"), "{e:#}");
    let e = publish(&file, &format!("{}/modules/x:v1", registry.addr())).await.unwrap_err();
    assert!(e.to_string().contains("not an OCI reference"), "{e}");
}

/// A registry serving TLS with its own CA and letting one user in: the CLI trusts the CA
/// it is given (`--registry-ca`) and sends basic credentials; without either it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_registry_with_its_own_ca_and_basic_credentials() {
    let registry = OciRegistry::start_tls_with_user("ci", BCRYPT);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("port_filter.wasm");
    std::fs::write(&file, artifacts::examples::PORT_FILTER_TRANSLATOR).unwrap();
    let reference = format!("oci://{}/private/port-filter:v1", registry.addr());
    let publish = |registry: RegistryArgs| {
        module_command(no_api(), ModuleCommand::Publish { file: file.clone(), reference: reference.clone(), registry })
    };
    let trusted = |user: Option<&str>, password: Option<&str>| RegistryArgs {
        registry_ca: Some(registry.ca_file()),
        registry_username: user.map(Into::into),
        registry_password: password.map(Into::into),
        ..RegistryArgs::default()
    };

    let untrusted = publish(RegistryArgs {
        registry_username: Some("ci".into()),
        registry_password: Some(PASSWORD.into()),
        ..RegistryArgs::default()
    })
    .await
    .unwrap_err();
    assert!(
        format!("{untrusted:?}").to_lowercase().contains("certificate"),
        "the registry's CA is not the system's: {untrusted:?}"
    );
    let anonymous = publish(trusted(None, None)).await.unwrap_err();
    assert!(format!("{anonymous:?}").to_lowercase().contains("unauthorized"), "{anonymous:?}");
    let wrong = publish(trusted(Some("ci"), Some("not-the-password"))).await.unwrap_err();
    assert!(format!("{wrong:?}").to_lowercase().contains("unauthorized"), "{wrong:?}");

    publish(trusted(Some("ci"), Some(PASSWORD))).await.unwrap();
    let out = dir.path().join("pulled.wasm");
    let pull = |registry: RegistryArgs| {
        module_command(no_api(), ModuleCommand::Pull { reference: reference.clone(), out: out.clone(), registry })
    };
    assert!(pull(trusted(None, None)).await.is_err(), "pulls need the credentials too");
    pull(trusted(Some("ci"), Some(PASSWORD))).await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), artifacts::examples::PORT_FILTER_TRANSLATOR);
}

/// Credentials from Docker's config.json (`docker login`'s, a `kubernetes.io/dockerconfigjson`
/// Secret's), chosen by the reference's registry and nothing else: the registry's entry lets
/// the CLI publish and the client pull; a wrong password there is refused; entries for other
/// registries (another port of the same host among them) leave it anonymous, and refused;
/// explicit credentials come first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_config_credentials_are_the_registrys_own() {
    use base64::Engine as _;
    use wasmplane::oci::{Registry, RegistryOptions, reference_of};
    let registry = OciRegistry::start_tls_with_user("ci", BCRYPT);
    let dir = tempfile::tempdir().unwrap();
    let module = artifacts::examples::PORT_FILTER_TRANSLATOR;
    let file = dir.path().join("port_filter.wasm");
    std::fs::write(&file, module).unwrap();
    let reference = format!("oci://{}/private/port-filter:v1", registry.addr());
    let auth =
        |user: &str, password: &str| base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let docker_config = |name: &str, auths: Value| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            serde_json::json!({"auths": auths, "HttpHeaders": {"User-Agent": "Docker-Client/27"}}).to_string(),
        )
        .unwrap();
        path
    };
    // The registry's host on a port no registry listens on (ephemeral ports are high).
    let other_port = "127.0.0.1:1";
    let right = docker_config(
        "right.json",
        serde_json::json!({ format!("https://{}", registry.addr()): {"auth": auth("ci", PASSWORD)}, "ghcr.io": {"auth": auth("someone", "else")} }),
    );
    let wrong = docker_config(
        "wrong.json",
        serde_json::json!({ registry.addr(): {"username": "ci", "password": "not-the-password"} }),
    );
    let elsewhere = docker_config(
        "elsewhere.json",
        serde_json::json!({ other_port: {"auth": auth("ci", PASSWORD)}, "https://index.docker.io/v1/": {"auth": auth("ci", PASSWORD)} }),
    );
    let cli = |docker_config: &Path| RegistryArgs {
        registry_ca: Some(registry.ca_file()),
        registry_docker_config: Some(docker_config.into()),
        ..RegistryArgs::default()
    };
    let publish = |registry: RegistryArgs, tag: &str| {
        module_command(
            no_api(),
            ModuleCommand::Publish {
                file: file.clone(),
                reference: reference.replace(":v1", &format!(":{tag}")),
                registry,
            },
        )
    };
    let client = |docker_config: &Path| {
        Registry::new(&RegistryOptions {
            ca_file: Some(registry.ca_file()),
            docker_config: Some(docker_config.into()),
            ..RegistryOptions::default()
        })
        .unwrap()
    };
    let target = reference_of(&reference).unwrap().unwrap();
    let unauthorized = |e: String| assert!(e.to_lowercase().contains("unauthorized"), "{e}");

    // Only the Docker config: through the CLI to the registry, and back with the client.
    publish(cli(&right), "v1").await.unwrap();
    let artifact = client(&right).pull(&target, 1 << 20).await.unwrap();
    assert_eq!(artifact.component, module);

    // A wrong password for this registry: refused.
    unauthorized(format!("{:?}", publish(cli(&wrong), "v2").await.unwrap_err()));
    unauthorized(format!("{:?}", client(&wrong).pull(&target, 1 << 20).await.unwrap_err()));
    // Entries for other registries only: anonymous here, refused.
    unauthorized(format!("{:?}", publish(cli(&elsewhere), "v2").await.unwrap_err()));
    unauthorized(format!("{:?}", client(&elsewhere).pull(&target, 1 << 20).await.unwrap_err()));

    // Explicit credentials (WASMPLANE_REGISTRY_USERNAME/PASSWORD) come before the file.
    let explicit = |docker_config: &Path, password: &str| RegistryArgs {
        registry_username: Some("ci".into()),
        registry_password: Some(password.into()),
        ..cli(docker_config)
    };
    publish(explicit(&wrong, PASSWORD), "v2").await.unwrap();
    unauthorized(format!("{:?}", publish(explicit(&right, "not-the-password"), "v3").await.unwrap_err()));
    let out = dir.path().join("pulled.wasm");
    module_command(
        no_api(),
        ModuleCommand::Pull { reference: reference.replace(":v1", ":v2"), out: out.clone(), registry: cli(&right) },
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), module);
}

/// `WasmModule` objects (Kubewarden's way of declaring policies): the operator pulls the
/// named component into the module index and in force, says so in the object's status,
/// refuses what does not fit (status Failed, nothing stored), follows a spec change to a new
/// version, and deletes the module with its object (finalizer). Against the test API server
/// (the CRD's resource registered) and a real registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm_module_objects_are_pulled_into_force_and_deleted_with_their_object() {
    use wasmplane::app::KubernetesSource;
    use wasmplane::module_objects::{FINALIZER, KIND, ModuleObjectsConfig, PLURAL};
    use wasmplane::oci::RegistryOptions;
    use wasmplane::operator_role::OperatorRoleConfig;
    use wasmplane_runtime::GuestKind;
    use wasmplane_test_apiserver::{ResourceKey, ResourceType, TestApiServer};

    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let registry = OciRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let oci = |path: &str| format!("oci://{}/{path}", registry.addr());
    let (v1, v2) = (artifacts::examples::PORT_FILTER_TRANSLATOR, artifacts::SERVICE_TRANSLATOR);
    for (bytes, tag) in [(v1, "v1"), (v2, "v2")] {
        let file = dir.path().join(format!("{tag}.wasm"));
        std::fs::write(&file, bytes).unwrap();
        publish(&file, &oci(&format!("modules/translator:{tag}"))).await.unwrap();
    }

    let server = TestApiServer::start().await;
    server.register(ResourceType::new("wasmplane.io", "v1alpha1", PLURAL, KIND, false));
    let key = ResourceKey::new("wasmplane.io", "v1alpha1", PLURAL);
    let host = start(HostConfig {
        kubernetes: Some(KubernetesSource::Url(server.url())),
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(dir.path().join("data")),
        token: Some(TOKEN.into()),
        operator: Some(OperatorRoleConfig {
            identity: "modules-operator".into(),
            lease_duration: Duration::from_secs(2),
            module_objects: ModuleObjectsConfig {
                registry: RegistryOptions { plain_http: true, ..Default::default() },
                retry: Duration::from_millis(300),
                resync: Duration::from_millis(300),
                ..Default::default()
            },
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    let object = |name: &str, kind: &str, module: &str| serde_json::json!({"apiVersion": "wasmplane.io/v1alpha1", "kind": KIND, "metadata": {"name": name}, "spec": {"kind": kind, "module": module}});
    let phase_of = |name: &'static str, phase: &'static str| {
        let server = &server;
        let key = &key;
        async move {
            support::cluster::eventually(
                &format!("{name} {phase}"),
                Duration::from_secs(20),
                || async { server.get_value(key, "", name) },
                |o| o.as_ref().is_some_and(|o| o["status"]["phase"] == phase),
            )
            .await
            .unwrap()
        }
    };
    let index = || async { host.modules.store().load().await.unwrap().0 };

    // Pulled, stored and in force; the status says which version and digest.
    server.create_value(&key, object("port-filter", "service-translator", &oci("modules/translator:v1"))).unwrap();
    let ready = phase_of("port-filter", "Ready").await;
    let status = &ready["status"];
    assert_eq!(
        (status["version"].as_u64(), status["digest"].as_str(), status["observedGeneration"].as_i64()),
        (Some(1), Some(LoadedModule::digest_of(v1).as_str()), Some(1)),
        "{ready}"
    );
    assert!(status["manifestDigest"].as_str().is_some_and(|d| d.starts_with("sha256:")), "{ready}");
    assert_eq!(ready["metadata"]["finalizers"], serde_json::json!([FINALIZER]));
    let in_force = index().await;
    assert_eq!(in_force.in_force(GuestKind::ServiceTranslator), Some(("port-filter", 1)));

    // Deleted by hand: the object puts it back.
    host.modules.delete("port-filter").await.unwrap();
    let _ = support::cluster::eventually("the module put back", Duration::from_secs(20), index, |i| {
        i.in_force(GuestKind::ServiceTranslator) == Some(("port-filter", 1))
    })
    .await;

    // Settings in the spec become the module's, with the version in force; settings changed
    // by hand are put back; settings the guest refuses fail the object and change nothing.
    let settings = serde_json::json!({"label": "tier", "value": "front"});
    server.patch_value(&key, "", "port-filter", &serde_json::json!({"spec": {"settings": settings}})).unwrap();
    let _ = support::cluster::eventually("the settings taken", Duration::from_secs(20), index, |i| {
        i.settings.get("port-filter") == Some(&settings)
    })
    .await;
    host.modules.set_settings("port-filter", None).await.unwrap();
    let _ = support::cluster::eventually("the settings put back", Duration::from_secs(20), index, |i| {
        i.settings.get("port-filter") == Some(&settings)
    })
    .await;
    // The guest checks its settings when it translates: give it a Service to translate.
    let service = serde_json::json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop"}, "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80, "protocol": "TCP"}]}});
    server.create_value(&ResourceKey::new("", "v1", "services"), service).unwrap();
    // A merge patch: the old keys nulled, one the guest does not know.
    server
        .patch_value(
            &key,
            "",
            "port-filter",
            &serde_json::json!({"spec": {"settings": {"lable": "tier", "label": null, "value": null}}}),
        )
        .unwrap();
    let refused = phase_of("port-filter", "Failed").await;
    assert!(refused["status"]["message"].as_str().unwrap().contains("lable"), "{refused}");
    assert_eq!(index().await.settings.get("port-filter"), Some(&settings), "the settings in force stay");
    server.patch_value(&key, "", "port-filter", &serde_json::json!({"spec": {"settings": null}})).unwrap();
    let _ = support::cluster::eventually("the settings cleared", Duration::from_secs(20), index, |i| {
        !i.settings.contains_key("port-filter")
    })
    .await;
    phase_of("port-filter", "Ready").await;

    // What does not fit is refused with the reason, and nothing is stored.
    server.create_value(&key, object("wrong-kind", "network-policy", &oci("modules/translator:v1"))).unwrap();
    server.create_value(&key, object("missing", "gc", &oci("modules/translator:v9"))).unwrap();
    let wrong = phase_of("wrong-kind", "Failed").await;
    assert!(wrong["status"]["message"].as_str().unwrap().contains("service-translator"), "{wrong}");
    let missing = phase_of("missing", "Failed").await;
    assert!(missing["status"]["message"].as_str().unwrap().contains("registry"), "{missing}");
    let after = index().await;
    assert!(!after.modules.contains_key("wrong-kind") && !after.modules.contains_key("missing"));
    assert_eq!(after.in_force(GuestKind::ServiceTranslator), Some(("port-filter", 1)), "the module in force stays");

    // A spec change pulls the new version and puts it in force.
    server
        .patch_value(&key, "", "port-filter", &serde_json::json!({"spec": {"module": oci("modules/translator:v2")}}))
        .unwrap();
    let _ = support::cluster::eventually(
        "version 2 ready",
        Duration::from_secs(20),
        || async { server.get_value(&key, "", "port-filter") },
        |o| {
            o.as_ref().is_some_and(|o| {
                o["status"]["version"] == 2
                    && o["status"]["phase"] == "Ready"
                    && o["status"]["observedGeneration"] == o["metadata"]["generation"]
            })
        },
    )
    .await;
    let updated = index().await;
    assert_eq!(updated.in_force(GuestKind::ServiceTranslator), Some(("port-filter", 2)));
    assert_eq!(updated.modules["port-filter"].version(2).map(|v| v.digest.clone()), Some(LoadedModule::digest_of(v2)));

    // Deleting the object deletes the module (the builtin is in force again), then the
    // finalizer lets the object go.
    server.delete_value(&key, "", "port-filter").unwrap();
    let _ = support::cluster::eventually(
        "the object gone",
        Duration::from_secs(20),
        || async { server.get_value(&key, "", "port-filter") },
        Option::is_none,
    )
    .await;
    let gone = index().await;
    assert!(!gone.modules.contains_key("port-filter"), "{:?}", gone.modules.keys().collect::<Vec<_>>());
    assert_eq!(gone.in_force(GuestKind::ServiceTranslator), None);
    // A failed object never stored anything; deleting it is no error.
    server.delete_value(&key, "", "missing").unwrap();
    let _ = support::cluster::eventually(
        "the failed object gone",
        Duration::from_secs(20),
        || async { server.get_value(&key, "", "missing") },
        Option::is_none,
    )
    .await;
    host.stop().await;
}
