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

use std::collections::BTreeMap;

use futures::TryStreamExt as _;

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
const OTHER_WASM_LAYERS: &[&str] = &["application/vnd.wasm.content.layer.v1+wasm", "application/vnd.module.wasm.content.layer.v1+wasm"];
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
}

/// How to reach registries: the CLI's `--plain-http`, `--registry-ca` and credentials.
#[derive(Clone, Debug, Default)]
pub struct RegistryOptions {
    /// Speak HTTP, not HTTPS (a registry on the same machine or in a test).
    pub plain_http: bool,
    /// A CA (PEM) to trust besides the system's, for a registry with a private CA.
    pub ca_file: Option<std::path::PathBuf>,
    /// Basic credentials; none: anonymous (and the registry's token dance for public pulls).
    pub credentials: Option<(String, String)>,
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
    Some(rest.parse::<Reference>().map_err(|e| OciError::BadReference { reference: source.into(), reason: e.to_string() }))
}

/// A registry client (the CLI's, the operator's).
pub struct Registry {
    client: Client,
    auth: RegistryAuth,
}

impl Registry {
    pub fn new(options: &RegistryOptions) -> Result<Registry, OciError> {
        let mut config = ClientConfig {
            protocol: if options.plain_http { ClientProtocol::Http } else { ClientProtocol::Https },
            ..ClientConfig::default()
        };
        if let Some(path) = &options.ca_file {
            let data = std::fs::read(path).map_err(|source| OciError::Io { path: path.display().to_string(), source })?;
            config.extra_root_certificates.push(Certificate { encoding: CertificateEncoding::Pem, data });
        }
        let auth = match &options.credentials {
            Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
            None => RegistryAuth::Anonymous,
        };
        Ok(Registry { client: Client::new(config), auth })
    }

    /// Fetches the component (at most `max_bytes`, checked against the manifest before a
    /// byte of it is fetched) and its signature; every blob is checked against its digest,
    /// and the manifest against a `@sha256:…` reference.
    pub async fn pull(&self, reference: &Reference, max_bytes: u64) -> Result<Artifact, OciError> {
        let (manifest, manifest_digest) = self.client.pull_image_manifest(reference, &self.auth).await?;
        let wasm: Vec<&OciDescriptor> = manifest.layers.iter().filter(|l| l.media_type == WASM_LAYER || OTHER_WASM_LAYERS.contains(&l.media_type.as_str())).collect();
        let layer = match wasm.as_slice() {
            [one] => *one,
            [] => return Err(OciError::NotAComponent { reference: reference.whole(), layers: manifest.layers.iter().map(|l| l.media_type.clone()).collect() }),
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
        while let Some(chunk) = blob.try_next().await.map_err(|e| OciError::Transfer { reference: reference.whole(), source: e })? {
            if (component.len() + chunk.len()) as u64 > limit {
                return Err(OciError::TooLarge { reference: reference.whole(), size: (component.len() + chunk.len()) as i64, max: limit });
            }
            component.extend_from_slice(&chunk);
        }
        let signature = layer.annotations.as_ref().and_then(|a| a.get(SIGNATURE_ANNOTATION)).cloned();
        Ok(Artifact { component, signature, manifest_digest })
    }

    /// Pushes `component` (with its signature, if given) as a Wasm OCI artifact; returns the
    /// manifest's URL.
    pub async fn publish(&self, reference: &Reference, component: Vec<u8>, signature: Option<&str>) -> Result<String, OciError> {
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
        let pushed = self.client.push(reference, &[layer], config, &self.auth, Some(manifest)).await?;
        Ok(pushed.manifest_url)
    }
}

/// A component, not a core module or another file: the header's version and layer fields
/// (`0d 00 01 00`) say so.
fn check_component(bytes: &[u8]) -> Result<(), OciError> {
    match bytes.get(..8) {
        Some([0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00]) => Ok(()),
        Some([0x00, 0x61, 0x73, 0x6d, ..]) => Err(OciError::NotComponentBytes("a core Wasm module; build it as a component (wasm32-wasip2)".into())),
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
        let r = reference_of("registry://ghcr.io/org/policy@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef").unwrap().unwrap();
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
}
