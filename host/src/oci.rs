//! Modules in OCI registries, as Kubewarden users keep their policies: `module publish`
//! pushes a component as a Wasm OCI artifact (the CNCF layout: config
//! `application/vnd.wasm.config.v0+json`, one `application/wasm` layer), `module pull` and
//! `module push NAME oci://…` fetch one (Kubewarden's and wasm-to-oci's layer type too).
//!
//! It runs in the CLI and, for `WasmModule` objects, in the leading operator
//! (`module_objects`), never on nodes: they need no registry access or credentials, and what
//! reaches the module index is an ordinary upload, admitted like any other.
//! A signature made by `module sign` travels as an annotation of the Wasm layer, so the
//! manifest digest covers it and `module push` sends it on for the host to verify.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine as _;
use futures::TryStreamExt as _;
use serde::Deserialize;
use tokio::io::AsyncWriteExt as _;

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::manifest::{OciDescriptor, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

/// The layer of a component in the CNCF Wasm OCI artifact layout.
pub const WASM_LAYER: &str = "application/wasm";
/// The config of that layout.
pub const WASM_CONFIG: &str = "application/vnd.wasm.config.v0+json";
/// Layer types of other tools' Wasm artifacts that `pull` also reads (Kubewarden's policies,
/// wasm-to-oci).
const OTHER_WASM_LAYERS: &[&str] =
    &["application/vnd.wasm.content.layer.v1+wasm", "application/vnd.module.wasm.content.layer.v1+wasm"];
/// The annotation of the Wasm layer that carries a `module sign` signature.
pub const SIGNATURE_ANNOTATION: &str = "dev.wasmplane.signature";

/// What can go wrong between the CLI and a registry.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("{reference:?} is not an OCI reference (oci://REGISTRY/REPOSITORY[:TAG|@DIGEST]): {reason}")]
    BadReference { reference: String, reason: String },
    #[error("{reference} holds no Wasm component: its layers are {layers:?} (expected one of type {WASM_LAYER})")]
    NotAComponent { reference: String, layers: Vec<String> },
    #[error("{reference} holds {count} Wasm layers; a module artifact has exactly one")]
    SeveralComponents { reference: String, count: usize },
    #[error("{reference}: the component is {size} bytes, more than the {max} allowed (or its manifest declared)")]
    TooLarge { reference: String, size: i64, max: u64 },
    #[error("not a WebAssembly component (a core module or another file): {0}")]
    NotComponentBytes(String),
    #[error("registry: {0}")]
    Registry(#[from] oci_client::errors::OciDistributionError),
    /// The blob's transfer broke off, or its bytes do not match its digest.
    #[error("fetching the component of {reference}: {source}")]
    Transfer { reference: String, source: std::io::Error },
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    /// A Docker config file (`--registry-docker-config`) that cannot be read or is not one.
    #[error("Docker config {path}: {reason}")]
    DockerConfig { path: String, reason: String },
}

/// How to reach registries: the CLI's `--plain-http`, `--registry-ca` and credentials.
#[derive(Clone, Default)]
pub struct RegistryOptions {
    /// Speak HTTP, not HTTPS (a registry on the same machine or in a test).
    pub plain_http: bool,
    /// A CA (PEM) to trust besides the system's, for a registry with a private CA.
    pub ca_file: Option<PathBuf>,
    /// Basic credentials for every registry; none: the Docker config's for the registry, or
    /// anonymous (and the registry's token dance for public pulls).
    pub credentials: Option<(String, String)>,
    /// Docker's `config.json` (`docker login`'s, or a `kubernetes.io/dockerconfigjson`
    /// Secret's `.dockerconfigjson`): credentials per registry, below `credentials`.
    pub docker_config: Option<PathBuf>,
}

/// The options end up in logged configurations: the user, never the password.
impl std::fmt::Debug for RegistryOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryOptions")
            .field("plain_http", &self.plain_http)
            .field("ca_file", &self.ca_file)
            .field("credentials", &self.credentials.as_ref().map(|(user, _)| (user, "<redacted>")))
            .field("docker_config", &self.docker_config)
            .finish()
    }
}

/// A module as a registry holds it.
#[derive(Debug)]
pub struct Artifact {
    pub component: Vec<u8>,
    /// The `module sign` signature the artifact carries, if any.
    pub signature: Option<String>,
    /// The manifest's digest: pull `REPOSITORY@DIGEST` to get exactly this again.
    pub manifest_digest: String,
}

/// `oci://REGISTRY/REPOSITORY:TAG` (or Kubewarden's `registry://…`) as a reference; `None`
/// when `source` names a file instead.
pub fn reference_of(source: &str) -> Option<Result<Reference, OciError>> {
    let rest = source.strip_prefix("oci://").or_else(|| source.strip_prefix("registry://"))?;
    Some(
        rest.parse::<Reference>()
            .map_err(|e| OciError::BadReference { reference: source.into(), reason: e.to_string() }),
    )
}

/// A registry client (the CLI's, the operator's).
pub struct Registry {
    client: Client,
    /// `RegistryOptions::credentials`: every registry's, before the Docker config.
    credentials: Option<RegistryAuth>,
    docker_config: Option<DockerConfig>,
}

impl Registry {
    pub fn new(options: &RegistryOptions) -> Result<Registry, OciError> {
        let mut config = ClientConfig {
            protocol: if options.plain_http { ClientProtocol::Http } else { ClientProtocol::Https },
            ..ClientConfig::default()
        };
        if let Some(path) = &options.ca_file {
            let data =
                std::fs::read(path).map_err(|source| OciError::Io { path: path.display().to_string(), source })?;
            config.extra_root_certificates.push(Certificate { encoding: CertificateEncoding::Pem, data });
        }
        let credentials =
            options.credentials.as_ref().map(|(user, password)| RegistryAuth::Basic(user.clone(), password.clone()));
        let docker_config = options.docker_config.as_deref().map(DockerConfig::read).transpose()?;
        Ok(Registry { client: Client::new(config), credentials, docker_config })
    }

    /// The credentials for `reference`'s registry: the explicit ones, else the Docker
    /// config's for that registry, else none. (The client keeps the first it is given per
    /// registry, so one `Registry` uses one per registry.)
    async fn auth(&self, reference: &Reference) -> RegistryAuth {
        match (&self.credentials, &self.docker_config) {
            (Some(credentials), _) => credentials.clone(),
            // Where the requests go: a mirror's credentials for a mirrored reference.
            (None, Some(docker_config)) => docker_config.auth(reference.resolve_registry()).await,
            (None, None) => RegistryAuth::Anonymous,
        }
    }

    /// Fetches the component (at most `max_bytes`, checked against the manifest before a
    /// byte of it is fetched) and its signature; every blob is checked against its digest,
    /// and the manifest against a `@sha256:…` reference.
    pub async fn pull(&self, reference: &Reference, max_bytes: u64) -> Result<Artifact, OciError> {
        let auth = self.auth(reference).await;
        let (manifest, manifest_digest) = self.client.pull_image_manifest(reference, &auth).await?;
        let wasm: Vec<&OciDescriptor> = manifest
            .layers
            .iter()
            .filter(|l| l.media_type == WASM_LAYER || OTHER_WASM_LAYERS.contains(&l.media_type.as_str()))
            .collect();
        let layer = match wasm.as_slice() {
            [one] => *one,
            [] => {
                return Err(OciError::NotAComponent {
                    reference: reference.whole(),
                    layers: manifest.layers.iter().map(|l| l.media_type.clone()).collect(),
                });
            }
            several => return Err(OciError::SeveralComponents { reference: reference.whole(), count: several.len() }),
        };
        if u64::try_from(layer.size).map_or(true, |size| size > max_bytes) {
            return Err(OciError::TooLarge { reference: reference.whole(), size: layer.size, max: max_bytes });
        }
        // Streamed with the cap enforced as it arrives: a registry that sends more than its
        // manifest declared is cut off, not buffered. The stream checks the digest at its end.
        let mut component = Vec::with_capacity(usize::try_from(layer.size).unwrap_or_default());
        let mut blob = self.client.pull_blob_stream(reference, layer).await?;
        let limit = max_bytes.min(layer.size as u64);
        while let Some(chunk) =
            blob.try_next().await.map_err(|e| OciError::Transfer { reference: reference.whole(), source: e })?
        {
            if (component.len() + chunk.len()) as u64 > limit {
                return Err(OciError::TooLarge {
                    reference: reference.whole(),
                    size: (component.len() + chunk.len()) as i64,
                    max: limit,
                });
            }
            component.extend_from_slice(&chunk);
        }
        let signature = layer.annotations.as_ref().and_then(|a| a.get(SIGNATURE_ANNOTATION)).cloned();
        Ok(Artifact { component, signature, manifest_digest })
    }

    /// Pushes `component` (with its signature, if given) as a Wasm OCI artifact; returns the
    /// manifest's URL.
    pub async fn publish(
        &self,
        reference: &Reference,
        component: Vec<u8>,
        signature: Option<&str>,
    ) -> Result<String, OciError> {
        check_component(&component)?;
        let annotations = signature.map(|s| BTreeMap::from([(SIGNATURE_ANNOTATION.to_string(), s.trim().to_string())]));
        let layer = ImageLayer::new(component, WASM_LAYER.into(), annotations);
        let config = serde_json::json!({
            "created": k8s_openapi::jiff::Timestamp::now().to_string(),
            "architecture": "wasm",
            "os": "wasip2",
            "layerDigests": [layer.sha256_digest()],
        });
        let config = Config::new(config.to_string().into_bytes(), WASM_CONFIG.into(), None);
        let mut manifest = OciImageManifest::build(std::slice::from_ref(&layer), &config, None);
        manifest.artifact_type = Some(WASM_LAYER.into());
        let auth = self.auth(reference).await;
        let pushed = self.client.push(reference, &[layer], config, &auth, Some(manifest)).await?;
        Ok(pushed.manifest_url)
    }
}

/// Docker Hub's registry, under each of its names: the key its credentials are found by.
const DOCKER_HUB: &str = "docker.io";
/// The server URL docker gives credential helpers for Docker Hub (they store it so).
const DOCKER_HUB_SERVER: &str = "https://index.docker.io/v1/";
/// How long a credential helper may take: one waiting on a keychain prompt does not hold a
/// pull (or the operator's reconciler) forever.
const HELPER_TIMEOUT: Duration = Duration::from_secs(10);

/// Docker's `config.json` as read once: credentials per registry (`host[:port]`), from
/// credential helpers (`credHelpers`, `credsStore`) or the file's own `auths`.
pub struct DockerConfig {
    path: PathBuf,
    auths: HashMap<String, AuthEntry>,
    cred_helpers: HashMap<String, String>,
    creds_store: Option<String>,
}

/// An `auths` entry, decoded.
enum AuthEntry {
    Basic(String, String),
    /// An OAuth refresh token (`docker login` to ACR and the like): the client speaks only
    /// basic credentials and tokens it obtains itself.
    IdentityToken,
    /// No credentials (Docker Desktop writes `{}` for registries whose secret is in its store).
    Empty,
}

/// The file as docker writes it; every other field (`HttpHeaders`, `proxies`…) is ignored.
#[derive(Deserialize)]
struct ConfigFile {
    auths: Option<BTreeMap<String, Option<AuthFile>>>,
    #[serde(rename = "credHelpers")]
    cred_helpers: Option<BTreeMap<String, String>>,
    #[serde(rename = "credsStore")]
    creds_store: Option<String>,
}

#[derive(Deserialize)]
struct AuthFile {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
    identitytoken: Option<String>,
}

/// What a credential helper answers to `get`.
#[derive(Deserialize)]
struct HelperAnswer {
    #[serde(rename = "Username")]
    username: String,
    #[serde(rename = "Secret")]
    secret: String,
}

/// `auth` is base64 of `user:password`; some tools leave out the padding.
const AUTH_BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new()
        .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
);

impl DockerConfig {
    /// Reads and checks `path`: an unreadable file, or one that is not a Docker config, is an
    /// error (credentials silently missing would look like the registry's fault).
    pub fn read(path: &Path) -> Result<DockerConfig, OciError> {
        let text = std::fs::read(path)
            .map_err(|e| OciError::DockerConfig { path: path.display().to_string(), reason: e.to_string() })?;
        DockerConfig::parse(path, &text)
    }

    fn parse(path: &Path, text: &[u8]) -> Result<DockerConfig, OciError> {
        let error = |reason: String| OciError::DockerConfig { path: path.display().to_string(), reason };
        let file: ConfigFile = serde_json::from_slice(text).map_err(|e| {
            error(match e.classify() {
                // serde's message for a value of the wrong type quotes the value: it may be a secret.
                serde_json::error::Category::Data => {
                    format!("a value of the wrong type at line {} column {}", e.line(), e.column())
                }
                _ => format!("not JSON: {e}"),
            })
        })?;
        let mut auths = HashMap::new();
        for (server, entry) in file.auths.unwrap_or_default() {
            let key = registry_key(&server);
            let entry = match entry {
                Some(entry) => AuthEntry::of(entry)
                    .map_err(|()| error(format!("the `auth` of {server:?} is not base64 of USER:PASSWORD")))?,
                None => AuthEntry::Empty,
            };
            // Two spellings of one registry (`docker.io`, `https://index.docker.io/v1/`): the
            // one with credentials counts.
            if !matches!(
                (auths.get(&key), &entry),
                (Some(AuthEntry::Basic(..)), _) | (Some(AuthEntry::IdentityToken), AuthEntry::Empty)
            ) {
                auths.insert(key, entry);
            }
        }
        let cred_helpers = file
            .cred_helpers
            .unwrap_or_default()
            .into_iter()
            .map(|(server, helper)| (registry_key(&server), helper))
            .collect();
        Ok(DockerConfig {
            path: path.to_path_buf(),
            auths,
            cred_helpers,
            creds_store: file.creds_store.filter(|s| !s.is_empty()),
        })
    }

    /// The credentials for `registry` (`host[:port]`, any of Docker Hub's names): its
    /// credential helper's (`credHelpers`, else `credsStore`), else its `auths` entry's, else
    /// anonymous. Helpers are looked up on this process's PATH.
    pub async fn auth(&self, registry: &str) -> RegistryAuth {
        self.auth_with_helpers_in(registry, std::env::var_os("PATH").as_deref()).await
    }

    /// [`DockerConfig::auth`] with helpers looked up in `search_path` (PATH syntax).
    async fn auth_with_helpers_in(&self, registry: &str, search_path: Option<&OsStr>) -> RegistryAuth {
        let key = registry_key(registry);
        if let Some(helper) = self.cred_helpers.get(&key).or(self.creds_store.as_ref())
            && let Some((user, secret)) = ask_helper(helper, &key, search_path).await
        {
            tracing::debug!(
                registry = key,
                helper,
                user,
                "registry credentials from the Docker config's credential helper"
            );
            return RegistryAuth::Basic(user, secret);
        }
        match self.auths.get(&key) {
            Some(AuthEntry::Basic(user, password)) => {
                tracing::debug!(registry = key, user, config = %self.path.display(), "registry credentials from the Docker config");
                RegistryAuth::Basic(user.clone(), password.clone())
            }
            Some(AuthEntry::IdentityToken) => {
                if first_time(format!("identitytoken {key}")) {
                    tracing::warn!(registry = key, config = %self.path.display(), "the Docker config holds an identity token for {key}, which is not supported (only a user and password): anonymous there");
                }
                RegistryAuth::Anonymous
            }
            Some(AuthEntry::Empty) | None => RegistryAuth::Anonymous,
        }
    }
}

impl AuthEntry {
    /// Docker's reading: `auth` (decoded) over `username`/`password`; an identity token only
    /// when there is no password beside it.
    fn of(entry: AuthFile) -> Result<AuthEntry, ()> {
        let (user, password) = match entry.auth.filter(|a| !a.trim().is_empty()) {
            Some(auth) => {
                let decoded = String::from_utf8(AUTH_BASE64.decode(auth.trim()).map_err(drop)?).map_err(drop)?;
                let (user, password) = decoded.split_once(':').ok_or(())?;
                (user.to_string(), password.to_string())
            }
            None => (entry.username.unwrap_or_default(), entry.password.unwrap_or_default()),
        };
        Ok(if !user.is_empty() && !password.is_empty() {
            AuthEntry::Basic(user, password)
        } else if entry.identitytoken.is_some_and(|t| !t.is_empty()) {
            AuthEntry::IdentityToken
        } else {
            AuthEntry::Empty
        })
    }
}

/// Which registries have what, never the secrets.
impl std::fmt::Debug for DockerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let auths: BTreeMap<&str, &str> = self
            .auths
            .iter()
            .map(|(registry, entry)| {
                (
                    registry.as_str(),
                    match entry {
                        AuthEntry::Basic(..) => "basic",
                        AuthEntry::IdentityToken => "identitytoken",
                        AuthEntry::Empty => "none",
                    },
                )
            })
            .collect();
        f.debug_struct("DockerConfig")
            .field("path", &self.path)
            .field("auths", &auths)
            .field("cred_helpers", &self.cred_helpers)
            .field("creds_store", &self.creds_store)
            .finish()
    }
}

/// A registry as Docker config keys and references name it: `host[:port]`, lower case,
/// without scheme or path (`https://index.docker.io/v1/`, `http://r.example:5000/x`), Docker
/// Hub's names as one.
fn registry_key(server: &str) -> String {
    let server = server.trim().to_ascii_lowercase();
    let rest = server.strip_prefix("https://").or_else(|| server.strip_prefix("http://")).unwrap_or(&server);
    let host = rest.split('/').next().unwrap_or_default();
    match host {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" => DOCKER_HUB.to_string(),
        host => host.to_string(),
    }
}

/// True once per `what` in this process: warnings about the configuration, not every pull.
fn first_time(what: String) -> bool {
    static SEEN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(what)
}

/// `docker-credential-HELPER get` for `registry` (the docker-credential-helpers protocol:
/// the server URL on stdin, `{"Username", "Secret"}` on stdout). None when the helper has
/// nothing for it, is missing or fails: each logged, never the secret.
async fn ask_helper(helper: &str, registry: &str, search_path: Option<&OsStr>) -> Option<(String, String)> {
    let program = format!("docker-credential-{helper}");
    let Some(binary) = find_program(&program, search_path) else {
        if first_time(format!("helper {helper}")) {
            tracing::warn!(
                helper,
                "the Docker config names credential helper {program}, which is not on PATH: its credentials are not used"
            );
        }
        return None;
    };
    let server = if registry == DOCKER_HUB { DOCKER_HUB_SERVER } else { registry };
    let asked = async {
        let mut child = tokio::process::Command::new(&binary)
            .arg("get")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        if let Some(mut stdin) = child.stdin.take() {
            // A helper that exits without reading closes the pipe: its answer still counts.
            let _ = stdin.write_all(server.as_bytes()).await;
        }
        child.wait_with_output().await
    };
    let output = match tokio::time::timeout(HELPER_TIMEOUT, asked).await {
        Ok(Ok(output)) => output,
        Ok(Err(e)) => {
            tracing::warn!(helper, registry, "running {}: {e}", binary.display());
            return None;
        }
        Err(_) => {
            tracing::warn!(helper, registry, "{program} did not answer within {HELPER_TIMEOUT:?}");
            return None;
        }
    };
    if !output.status.success() {
        let message = String::from_utf8_lossy(if output.stdout.is_empty() { &output.stderr } else { &output.stdout })
            .trim()
            .chars()
            .take(200)
            .collect::<String>();
        if message.contains("credentials not found") {
            tracing::debug!(helper, registry, "{program} has no credentials for {server}");
        } else {
            tracing::warn!(helper, registry, "{program} failed ({}): {message}", output.status);
        }
        return None;
    }
    match serde_json::from_slice::<HelperAnswer>(&output.stdout) {
        // The helper's way of handing out an identity token, which the client cannot use.
        Ok(answer) if answer.username == "<token>" => {
            if first_time(format!("identitytoken {registry}")) {
                tracing::warn!(
                    helper,
                    registry,
                    "{program} holds an identity token for {registry}, which is not supported (only a user and password)"
                );
            }
            None
        }
        Ok(answer) if !answer.username.is_empty() && !answer.secret.is_empty() => {
            Some((answer.username, answer.secret))
        }
        Ok(_) => None,
        Err(_) => {
            tracing::warn!(helper, registry, "{program}'s answer is not {{\"Username\", \"Secret\"}}");
            None
        }
    }
}

/// `name` in `search_path`'s directories, executable; a name with a `/` is no helper's.
fn find_program(name: &str, search_path: Option<&OsStr>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    if name.contains('/') {
        return None;
    }
    std::env::split_paths(search_path?)
        .map(|dir| dir.join(name))
        .find(|path| std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// A component, not a core module or another file: the header's version and layer fields
/// (`0d 00 01 00`) say so.
fn check_component(bytes: &[u8]) -> Result<(), OciError> {
    match bytes.get(..8) {
        Some([0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00]) => Ok(()),
        Some([0x00, 0x61, 0x73, 0x6d, ..]) => {
            Err(OciError::NotComponentBytes("a core Wasm module; build it as a component (wasm32-wasip2)".into()))
        }
        _ => Err(OciError::NotComponentBytes("no WebAssembly header".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_and_files() {
        assert!(reference_of("target/m.wasm").is_none());
        let r = reference_of("oci://127.0.0.1:5000/modules/port-filter:v1").unwrap().unwrap();
        assert_eq!((r.registry(), r.repository(), r.tag()), ("127.0.0.1:5000", "modules/port-filter", Some("v1")));
        let r = reference_of(
            "registry://ghcr.io/org/policy@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        )
        .unwrap()
        .unwrap();
        assert!(r.digest().is_some());
        // Repositories are lower case.
        assert!(matches!(reference_of("oci://127.0.0.1:5000/Modules/X"), Some(Err(OciError::BadReference { .. }))));
    }

    #[test]
    fn only_components_are_published() {
        assert!(check_component(&[0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00, 0x01]).is_ok());
        let core = check_component(&[0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00]).unwrap_err();
        assert!(core.to_string().contains("core Wasm module"), "{core}");
        assert!(check_component(b"#!/bin/sh\n").is_err());
    }

    fn basic(user: &str, password: &str) -> RegistryAuth {
        RegistryAuth::Basic(user.into(), password.into())
    }

    /// A config from `text`, helpers looked up nowhere unless a test says where.
    fn docker_config(text: &str) -> DockerConfig {
        DockerConfig::parse(Path::new("/test/config.json"), text.as_bytes()).unwrap()
    }

    async fn auth_of(config: &DockerConfig, registry: &str) -> RegistryAuth {
        config.auth_with_helpers_in(registry, Some(OsStr::new(""))).await
    }

    #[test]
    fn docker_config_keys_are_registries() {
        for (server, key) in [
            ("registry.example:5000", "registry.example:5000"),
            ("https://registry.example:5000", "registry.example:5000"),
            ("http://registry.example:5000/v2/some/path", "registry.example:5000"),
            ("HTTPS://Registry.Example/", "registry.example"),
            (" ghcr.io ", "ghcr.io"),
            ("127.0.0.1:5000", "127.0.0.1:5000"),
            ("https://index.docker.io/v1/", "docker.io"),
            ("index.docker.io", "docker.io"),
            ("registry-1.docker.io", "docker.io"),
            ("docker.io", "docker.io"),
        ] {
            assert_eq!(registry_key(server), key, "{server}");
        }
        // What lookups are made with: a reference's registry.
        let hub: Reference = "busybox:latest".parse().unwrap();
        assert_eq!(registry_key(hub.resolve_registry()), "docker.io");
    }

    #[tokio::test]
    async fn docker_config_entries_are_credentials_per_registry() {
        use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
        let text = serde_json::json!({
            "auths": {
                "https://index.docker.io/v1/": {"auth": STANDARD.encode("hubuser:hub:pass"), "email": "x@example.com"},
                "https://registry.example:5000": {"auth": STANDARD_NO_PAD.encode("ci:p")},
                "http://plain.example/v2/": {"username": "u2", "password": "p2"},
                "both.example": {"auth": STANDARD.encode("from-auth:a"), "username": "from-fields", "password": "f"},
                "acr.example": {"auth": STANDARD.encode("00000000-0000-0000-0000-000000000000:"), "identitytoken": "refresh-token"},
                "token-and-password.example": {"username": "t", "password": "tp", "identitytoken": "refresh-token"},
                "desktop.example": {},
                "null.example": null,
            },
            "HttpHeaders": {"User-Agent": "Docker-Client"},
            "currentContext": "default",
        })
        .to_string();
        let config = docker_config(&text);
        // Every name of Docker Hub; a password may hold colons.
        for hub in ["docker.io", "index.docker.io", "registry-1.docker.io"] {
            assert_eq!(auth_of(&config, hub).await, basic("hubuser", "hub:pass"), "{hub}");
        }
        assert_eq!(auth_of(&config, "registry.example:5000").await, basic("ci", "p"));
        assert_eq!(
            auth_of(&config, "registry.example").await,
            RegistryAuth::Anonymous,
            "another port is another registry"
        );
        assert_eq!(auth_of(&config, "plain.example").await, basic("u2", "p2"));
        assert_eq!(auth_of(&config, "both.example").await, basic("from-auth", "a"), "`auth` wins, as in docker");
        // An identity token cannot be used: anonymous (warned), not an error; beside a password it is not needed.
        assert_eq!(auth_of(&config, "acr.example").await, RegistryAuth::Anonymous);
        assert_eq!(auth_of(&config, "token-and-password.example").await, basic("t", "tp"));
        for nothing in ["desktop.example", "null.example", "ghcr.io"] {
            assert_eq!(auth_of(&config, nothing).await, RegistryAuth::Anonymous, "{nothing}");
        }
        // Two spellings of one registry: the one with credentials counts, in either order.
        let twice = docker_config(
            r#"{"auths": {"docker.io": {}, "https://index.docker.io/v1/": {"username": "a", "password": "b"}, "registry-1.docker.io": {}}}"#,
        );
        assert_eq!(auth_of(&twice, "docker.io").await, basic("a", "b"));
        // Nothing but unknown fields: a config without credentials, not an error.
        assert_eq!(auth_of(&docker_config(r#"{"psFormat": "table"}"#), "docker.io").await, RegistryAuth::Anonymous);
    }

    #[tokio::test]
    async fn explicit_credentials_come_before_the_docker_config() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, r#"{"auths": {"registry.example:5000": {"username": "from-config", "password": "c"}}}"#)
            .unwrap();
        let reference: Reference = "registry.example:5000/modules/m:v1".parse().unwrap();
        let elsewhere: Reference = "ghcr.io/org/m:v1".parse().unwrap();
        let with = |credentials: Option<(&str, &str)>| {
            Registry::new(&RegistryOptions {
                credentials: credentials.map(|(u, p)| (u.into(), p.into())),
                docker_config: Some(file.clone()),
                ..Default::default()
            })
            .unwrap()
        };
        let explicit = with(Some(("explicit", "e")));
        assert_eq!(
            (explicit.auth(&reference).await, explicit.auth(&elsewhere).await),
            (basic("explicit", "e"), basic("explicit", "e")),
            "explicit credentials are every registry's"
        );
        let config_only = with(None);
        assert_eq!(
            (config_only.auth(&reference).await, config_only.auth(&elsewhere).await),
            (basic("from-config", "c"), RegistryAuth::Anonymous)
        );
        let neither = Registry::new(&RegistryOptions::default()).unwrap();
        assert_eq!(neither.auth(&reference).await, RegistryAuth::Anonymous);
    }

    #[test]
    fn a_docker_config_that_is_not_one_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let error_of = |text: Option<&str>| {
            let file = dir.path().join("config.json");
            match text {
                Some(text) => std::fs::write(&file, text).unwrap(),
                None => drop(std::fs::remove_file(&file)),
            }
            let e = Registry::new(&RegistryOptions { docker_config: Some(file.clone()), ..Default::default() })
                .err()
                .expect("an error");
            assert!(matches!(e, OciError::DockerConfig { .. }), "{e:?}");
            let message = e.to_string();
            assert!(message.contains(&file.display().to_string()), "{message}");
            message
        };
        assert!(error_of(None).contains("No such file"));
        assert!(error_of(Some("{\"auths\": {")).contains("not JSON"));
        let bad_auth = error_of(Some(r#"{"auths": {"registry.example": {"auth": "not base64!!"}}}"#));
        assert!(bad_auth.contains("registry.example") && !bad_auth.contains("not base64!!"), "{bad_auth}");
        let no_colon = error_of(Some(&format!(
            r#"{{"auths": {{"registry.example": {{"auth": "{}"}}}}}}"#,
            AUTH_BASE64.encode("just-a-user")
        )));
        assert!(no_colon.contains("USER:PASSWORD"), "{no_colon}");
        // serde would quote a string where a map belongs: it may be a secret.
        let wrong_type = error_of(Some(r#"{"auths": {"registry.example": "c2VjcmV0OnNlY3JldA=="}}"#));
        assert!(wrong_type.contains("wrong type") && !wrong_type.contains("c2VjcmV0"), "{wrong_type}");
    }

    #[test]
    fn debug_output_holds_no_secret() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        let auth = AUTH_BASE64.encode("config-user:config-secret");
        std::fs::write(&file, format!(r#"{{"auths": {{"registry.example": {{"auth": "{auth}"}}, "other.example": {{"username": "u", "password": "plain-secret"}}}}, "credsStore": "pass"}}"#)).unwrap();
        let options = RegistryOptions {
            credentials: Some(("ci".into(), "explicit-secret".into())),
            docker_config: Some(file.clone()),
            ..Default::default()
        };
        let shown = format!("{options:?} {:?}", DockerConfig::read(&file).unwrap());
        for secret in ["explicit-secret", "config-secret", "plain-secret", auth.as_str()] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("\"ci\"") && shown.contains("registry.example") && shown.contains("pass"), "{shown}");
    }

    /// A credential helper speaking the docker-credential-helpers protocol, found in its own
    /// directory (the process's PATH is left alone).
    #[tokio::test]
    async fn credential_helpers_come_before_auths_and_fall_through_to_them() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let helper = dir.path().join("docker-credential-wptest");
        std::fs::write(
            &helper,
            "#!/bin/sh\n[ \"$1\" = get ] || exit 2\nserver=$(cat)\ncase \"$server\" in\n  helped.example:5000) echo '{\"ServerURL\":\"helped.example:5000\",\"Username\":\"u\",\"Secret\":\"s\"}' ;;\n  https://index.docker.io/v1/) echo '{\"Username\":\"hub\",\"Secret\":\"hub-s\"}' ;;\n  token.example) echo '{\"Username\":\"<token>\",\"Secret\":\"refresh\"}' ;;\n  *) echo 'credentials not found in native keychain'; exit 1 ;;\nesac\n",
        )
        .unwrap();
        std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
        let search_path = std::env::join_paths(["/nonexistent-dir".as_ref(), dir.path()]).unwrap();
        let config = docker_config(
            r#"{
                "auths": {"helped.example:5000": {"username": "file", "password": "f"}, "unhelped.example": {"username": "file", "password": "f"}, "token.example": {"username": "file", "password": "f"}},
                "credHelpers": {"https://helped.example:5000": "wptest", "unhelped.example": "wptest", "token.example": "wptest", "missing.example": "wpmissing"},
                "credsStore": "wptest"
            }"#,
        );
        let auth = |registry: &'static str| config.auth_with_helpers_in(registry, Some(&search_path));
        assert_eq!(auth("helped.example:5000").await, basic("u", "s"), "the helper's answer beats the file's");
        assert_eq!(
            auth("index.docker.io").await,
            basic("hub", "hub-s"),
            "credsStore, asked with Docker Hub's server URL"
        );
        assert_eq!(auth("unhelped.example").await, basic("file", "f"), "credentials not found: the file's");
        assert_eq!(auth("token.example").await, basic("file", "f"), "an identity token is no use: the file's");
        assert_eq!(auth("ghcr.io").await, RegistryAuth::Anonymous, "neither helper nor file");
        // A missing helper program: the file's entry, or anonymous.
        assert_eq!(auth("missing.example").await, RegistryAuth::Anonymous);
        let missing_store = docker_config(
            r#"{"auths": {"helped.example:5000": {"username": "file", "password": "f"}}, "credsStore": "wpmissing"}"#,
        );
        assert_eq!(
            missing_store.auth_with_helpers_in("helped.example:5000", Some(&search_path)).await,
            basic("file", "f")
        );
        // The same helper elsewhere on no path: not found.
        assert_eq!(config.auth_with_helpers_in("helped.example:5000", Some(OsStr::new(""))).await, basic("file", "f"));
        assert!(find_program("docker-credential-wptest", Some(&search_path)).is_some());
        assert!(
            find_program("../docker-credential-wptest", Some(&search_path)).is_none(),
            "a helper is a name, not a path"
        );
    }

    #[test]
    fn configuration_warnings_are_given_once() {
        assert!(first_time("helper test-once".into()));
        assert!(!first_time("helper test-once".into()));
    }
}
