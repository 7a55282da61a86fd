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

fn plain_http() -> RegistryArgs {
    RegistryArgs { plain_http: true, ..RegistryArgs::default() }
}

fn no_api() -> ApiArgs {
    ApiArgs { api: "http://unused".into(), token: None, token_file: None }
}

async fn publish(file: &Path, reference: &str) -> anyhow::Result<()> {
    module_command(no_api(), ModuleCommand::Publish { file: file.into(), reference: reference.into(), registry: plain_http() }).await
}

async fn pull(reference: &str, out: &Path) -> anyhow::Result<()> {
    module_command(no_api(), ModuleCommand::Pull { reference: reference.into(), out: out.into(), registry: plain_http() }).await
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
    assert_eq!((layers[0]["mediaType"].as_str(), layers[0]["digest"].as_str()), (Some("application/wasm"), Some(LoadedModule::digest_of(module).as_str())));
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
    write_manifest(&manifests, "shop.yaml", &documents(&[WEB_SERVICE, &endpoint_slice("web", "http", 8080, &[("10.244.0.11", "node-a")])]));
    let host = start(HostConfig { trusted_keys: vec![public_key], ..limited_config(dir.path(), TOKEN, Duration::from_millis(500)) }).await.unwrap();
    let api = || ApiArgs { api: host.url(), token: Some(TOKEN.into()), token_file: None };
    let push = |name: &str, source: String| ModuleCommand::Push { name: name.into(), source, kind: "service-translator".into(), no_activate: false, registry: plain_http() };
    let refused = module_command(api(), push("from-oci", oci("modules/port-filter:unsigned"))).await.unwrap_err().to_string();
    assert!(refused.contains("403") && refused.contains("is not signed"), "{refused}");
    module_command(api(), push("from-oci", oci("modules/port-filter:v1"))).await.unwrap();
    let pinned = format!("modules/port-filter@{signed_digest}");
    module_command(api(), push("pinned", oci(&pinned))).await.unwrap();
    for name in ["from-oci", "pinned"] {
        let record: Value = reqwest::get(format!("{}/v1/modules/{name}", host.url())).await.unwrap().json().await.unwrap();
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
    push_foreign(&registry, "kubewarden/policy", vec![ImageLayer::new(kubewarden.to_vec(), "application/vnd.wasm.content.layer.v1+wasm".into(), None)]).await;
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
    // bcrypt (cost 4) of PASSWORD, as `htpasswd -B` writes it.
    const PASSWORD: &str = "wasmplane-registry-pw";
    const BCRYPT: &str = "$2b$04$bKSA1Lo4rJLrduJIiUyTY.JiwnBKLC6TprjkFp68zyJ9/YEj4M3Be";
    let registry = OciRegistry::start_tls_with_user("ci", BCRYPT);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("port_filter.wasm");
    std::fs::write(&file, artifacts::examples::PORT_FILTER_TRANSLATOR).unwrap();
    let reference = format!("oci://{}/private/port-filter:v1", registry.addr());
    let publish = |registry: RegistryArgs| module_command(no_api(), ModuleCommand::Publish { file: file.clone(), reference: reference.clone(), registry });
    let trusted = |user: Option<&str>, password: Option<&str>| RegistryArgs {
        registry_ca: Some(registry.ca_file()),
        registry_username: user.map(Into::into),
        registry_password: password.map(Into::into),
        ..RegistryArgs::default()
    };

    let untrusted = publish(RegistryArgs { registry_username: Some("ci".into()), registry_password: Some(PASSWORD.into()), ..RegistryArgs::default() }).await.unwrap_err();
    assert!(format!("{untrusted:?}").to_lowercase().contains("certificate"), "the registry's CA is not the system's: {untrusted:?}");
    let anonymous = publish(trusted(None, None)).await.unwrap_err();
    assert!(format!("{anonymous:?}").to_lowercase().contains("unauthorized"), "{anonymous:?}");
    let wrong = publish(trusted(Some("ci"), Some("not-the-password"))).await.unwrap_err();
    assert!(format!("{wrong:?}").to_lowercase().contains("unauthorized"), "{wrong:?}");

    publish(trusted(Some("ci"), Some(PASSWORD))).await.unwrap();
    let out = dir.path().join("pulled.wasm");
    let pull = |registry: RegistryArgs| module_command(no_api(), ModuleCommand::Pull { reference: reference.clone(), out: out.clone(), registry });
    assert!(pull(trusted(None, None)).await.is_err(), "pulls need the credentials too");
    pull(trusted(Some("ci"), Some(PASSWORD))).await.unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), artifacts::examples::PORT_FILTER_TRANSLATOR);
}
