//! What an upload must satisfy beyond being a valid component of a known world: signatures
//! by trusted keys and imports granted to the module (issue 9). Checked on the host that
//! receives the upload, before anything is stored.
//!
//! **Signatures.** What is signed is the message `wasmplane-module-v1\n<digest>`, where
//! `<digest>` is the component's `sha256:<hex>` digest as the host reports it. Signing the
//! digest rather than the bytes keeps the signature small and lets any tool sign (`printf
//! 'wasmplane-module-v1\nsha256:…' | openssl pkeyutl -sign -rawin …`); the context prefix keeps
//! a wasmplane signature from meaning anything elsewhere. Verification recomputes the digest
//! from the uploaded bytes, so a tampered component fails. The signature travels base64
//! encoded (64 bytes) in the `X-Wasmplane-Signature` header. The name is not signed: a signed
//! component may be uploaded under any name, its imports are still checked per name.
//!
//! **Keys.** A key file holds one key: 64 hex characters (the raw 32-byte ed25519 key, the
//! seed for a private key) or PEM (`PUBLIC KEY` SPKI for public keys, `PRIVATE KEY` PKCS#8 for
//! private keys, as `openssl genpkey -algorithm ed25519` writes them).
//!
//! **Grants.** A YAML map from module name (or `"*"`, every module) to the capability
//! interfaces it may import: `log`, `lookups`. A module gets the union of its own entry and
//! `"*"`. Without a grants file every module gets every known capability. WASI imports are
//! always granted: the runtime links them with an empty context (no files, sockets,
//! environment; see the runtime's `host.rs`), and std-built guests import them even unused.
//! The shared `types` interface holds only types and is always granted, and so is
//! `settings`: a module reading its own settings reaches nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use base64::Engine as _;
use ed25519_dalek::pkcs8::{DecodePrivateKey as _, DecodePublicKey as _, EncodePrivateKey as _, EncodePublicKey as _};
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use wasmplane_runtime::ModuleInfo;

/// The capabilities (host interfaces of the `wasmplane:dataplane` package) a grant can name.
pub const CAPABILITIES: [&str; 2] = ["log", "lookups"];

/// The package prefix of host interfaces (`wasmplane:dataplane/log@1.0.0`).
const PACKAGE_PREFIX: &str = "wasmplane:dataplane/";

/// Prefix of the signed message (domain separation).
const SIGNING_CONTEXT: &str = "wasmplane-module-v1\n";

/// Why an upload was refused by policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("{0}")]
    Refused(String),
    #[error(
        "module {module:?} is not signed: this host requires an ed25519 signature by a trusted key in the X-Wasmplane-Signature header (make one with `wasmplane module sign`)"
    )]
    Unsigned { module: String },
    #[error("the X-Wasmplane-Signature header is not a base64-encoded 64-byte ed25519 signature: {reason}")]
    MalformedSignature { reason: String },
    #[error(
        "the signature of module {module:?} ({digest}) does not verify with any of the {keys} trusted key(s): signed by another key, or the bytes changed after signing"
    )]
    BadSignature { module: String, digest: String, keys: usize },
    #[error(
        "module {module:?} imports {import}, but capability {capability:?} is not granted to it (granted: {granted})"
    )]
    NotGranted { module: String, import: String, capability: String, granted: String },
}

/// Errors reading keys or grants (configuration, at start-up or in the CLI).
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// The admission policy of this host.
#[derive(Debug, Default)]
pub struct Admission {
    /// Empty: signatures are not required.
    trusted_keys: Vec<VerifyingKey>,
    /// None: every known capability is granted to every module.
    grants: Option<BTreeMap<String, BTreeSet<String>>>,
}

/// The message a module signature covers.
pub fn signed_message(digest: &str) -> Vec<u8> {
    format!("{SIGNING_CONTEXT}{digest}").into_bytes()
}

/// Signs a component; returns the base64 signature to send as `X-Wasmplane-Signature`.
pub fn sign(key: &SigningKey, bytes: &[u8]) -> String {
    let digest = wasmplane_runtime::LoadedModule::digest_of(bytes);
    base64::engine::general_purpose::STANDARD.encode(key.sign(&signed_message(&digest)).to_bytes())
}

fn read_text(path: &Path) -> Result<String, KeyError> {
    std::fs::read_to_string(path).map_err(|source| KeyError::Read { path: path.display().to_string(), source })
}

fn invalid(path: &Path, reason: impl std::fmt::Display) -> KeyError {
    KeyError::Invalid { path: path.display().to_string(), reason: reason.to_string() }
}

fn raw_key(path: &Path, text: &str) -> Result<[u8; 32], KeyError> {
    let bytes =
        hex::decode(text.trim()).map_err(|e| invalid(path, format!("expected 64 hex characters or PEM: {e}")))?;
    bytes.try_into().map_err(|b: Vec<u8>| invalid(path, format!("expected a 32-byte key, found {} bytes", b.len())))
}

/// Reads a trusted public key (hex or SPKI PEM).
pub fn read_public_key(path: &Path) -> Result<VerifyingKey, KeyError> {
    let text = read_text(path)?;
    if text.trim_start().starts_with("-----BEGIN") {
        return VerifyingKey::from_public_key_pem(text.trim())
            .map_err(|e| invalid(path, format!("not an ed25519 public key PEM: {e}")));
    }
    VerifyingKey::from_bytes(&raw_key(path, &text)?)
        .map_err(|e| invalid(path, format!("not an ed25519 public key: {e}")))
}

/// Reads a private key (hex seed or PKCS#8 PEM).
pub fn read_private_key(path: &Path) -> Result<SigningKey, KeyError> {
    let text = read_text(path)?;
    if text.trim_start().starts_with("-----BEGIN") {
        return SigningKey::from_pkcs8_pem(text.trim())
            .map_err(|e| invalid(path, format!("not an ed25519 private key PEM: {e}")));
    }
    Ok(SigningKey::from_bytes(&raw_key(path, &text)?))
}

/// A fresh key pair as PEM texts (private PKCS#8, public SPKI).
pub fn generate_key_pair() -> std::io::Result<(String, String)> {
    let mut seed = [0u8; 32];
    use std::io::Read as _;
    std::fs::File::open("/dev/urandom")?.read_exact(&mut seed)?;
    let key = SigningKey::from_bytes(&seed);
    let private = key.to_pkcs8_pem(Default::default()).map_err(std::io::Error::other)?.to_string();
    let public = key.verifying_key().to_public_key_pem(Default::default()).map_err(std::io::Error::other)?;
    Ok((private, public))
}

/// Reads a grants file: `{ "<module>" | "*": [capability, …] }`.
pub fn read_grants(path: &Path) -> Result<BTreeMap<String, BTreeSet<String>>, KeyError> {
    let text = read_text(path)?;
    let raw: BTreeMap<String, Option<Vec<String>>> = serde_yaml::from_str(&text).map_err(|e| {
        invalid(path, format!("expected a map of module name (or \"*\") to a list of capabilities: {e}"))
    })?;
    let mut grants = BTreeMap::new();
    for (module, capabilities) in raw {
        let mut set = BTreeSet::new();
        for c in capabilities.unwrap_or_default() {
            // Accept the full interface name too (`wasmplane:dataplane/log`).
            let short = c.strip_prefix(PACKAGE_PREFIX).unwrap_or(&c).split('@').next().unwrap_or_default().to_string();
            if !CAPABILITIES.contains(&short.as_str()) {
                return Err(invalid(
                    path,
                    format!("module {module:?}: unknown capability {c:?} (known: {})", CAPABILITIES.join(", ")),
                ));
            }
            set.insert(short);
        }
        grants.insert(module, set);
    }
    Ok(grants)
}

impl Admission {
    /// Admits every valid component (no signature required, every import granted).
    pub fn permissive() -> Admission {
        Admission::default()
    }

    /// `trusted_keys` empty: no signature required; `grants` none: every capability granted.
    pub fn new(trusted_keys: Vec<VerifyingKey>, grants: Option<BTreeMap<String, BTreeSet<String>>>) -> Admission {
        Admission { trusted_keys, grants }
    }

    /// From the host's configuration: key files and an optional grants file.
    pub fn from_files(key_files: &[std::path::PathBuf], grants_file: Option<&Path>) -> Result<Admission, KeyError> {
        let keys = key_files.iter().map(|p| read_public_key(p)).collect::<Result<Vec<_>, _>>()?;
        let grants = grants_file.map(read_grants).transpose()?;
        Ok(Admission::new(keys, grants))
    }

    pub fn requires_signatures(&self) -> bool {
        !self.trusted_keys.is_empty()
    }

    /// The capabilities granted to `module`.
    pub fn granted(&self, module: &str) -> BTreeSet<String> {
        match &self.grants {
            None => CAPABILITIES.iter().map(|c| c.to_string()).collect(),
            Some(grants) => ["*", module].iter().filter_map(|k| grants.get(*k)).flatten().cloned().collect(),
        }
    }

    /// Checks one upload; `signature` is what came with it, if anything.
    pub fn admit(
        &self,
        name: &str,
        info: &ModuleInfo,
        bytes: &[u8],
        signature: Option<&str>,
    ) -> Result<(), AdmissionError> {
        self.check_signature(name, bytes, signature)?;
        self.check_imports(name, info)
    }

    fn check_signature(&self, name: &str, bytes: &[u8], signature: Option<&str>) -> Result<(), AdmissionError> {
        if self.trusted_keys.is_empty() {
            return Ok(());
        }
        let Some(text) = signature.map(str::trim).filter(|s| !s.is_empty()) else {
            return Err(AdmissionError::Unsigned { module: name.to_string() });
        };
        let raw = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|e| AdmissionError::MalformedSignature { reason: e.to_string() })?;
        let signature = Signature::from_slice(&raw)
            .map_err(|_| AdmissionError::MalformedSignature { reason: format!("{} bytes", raw.len()) })?;
        // Recomputed here from the bytes, not taken from anything the uploader said.
        let digest = wasmplane_runtime::LoadedModule::digest_of(bytes);
        let message = signed_message(&digest);
        if self.trusted_keys.iter().any(|key| key.verify_strict(&message, &signature).is_ok()) {
            return Ok(());
        }
        Err(AdmissionError::BadSignature { module: name.to_string(), digest, keys: self.trusted_keys.len() })
    }

    fn check_imports(&self, name: &str, info: &ModuleInfo) -> Result<(), AdmissionError> {
        let granted = self.granted(name);
        for import in &info.imports {
            if import.starts_with("wasi:") {
                continue;
            }
            let capability =
                import.strip_prefix(PACKAGE_PREFIX).and_then(|rest| rest.split('@').next()).unwrap_or(import);
            // A module's own settings are no capability over anything else: always readable.
            if capability == "types" || capability == "settings" || granted.contains(capability) {
                continue;
            }
            let granted = if granted.is_empty() {
                "nothing".to_string()
            } else {
                granted.iter().cloned().collect::<Vec<_>>().join(", ")
            };
            return Err(AdmissionError::NotGranted {
                module: name.to_string(),
                import: import.clone(),
                capability: capability.to_string(),
                granted,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(imports: &[&str], bytes: &[u8]) -> ModuleInfo {
        ModuleInfo {
            digest: wasmplane_runtime::LoadedModule::digest_of(bytes),
            kind: wasmplane_runtime::GuestKind::ServiceTranslator,
            interface: None,
            wit_version: "1.0.0".into(),
            size: bytes.len(),
            imports: imports.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn signatures_verify_only_for_the_signed_bytes_and_trusted_keys() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let other = SigningKey::from_bytes(&[8; 32]);
        let admission = Admission::new(vec![key.verifying_key()], None);
        let bytes = b"component bytes";
        let i = info(&[], bytes);
        assert!(admission.admit("m", &i, bytes, Some(&sign(&key, bytes))).is_ok());
        assert!(matches!(admission.admit("m", &i, bytes, None), Err(AdmissionError::Unsigned { .. })));
        assert!(matches!(
            admission.admit("m", &i, bytes, Some(&sign(&other, bytes))),
            Err(AdmissionError::BadSignature { .. })
        ));
        assert!(matches!(
            admission.admit("m", &i, b"component bytez", Some(&sign(&key, bytes))),
            Err(AdmissionError::BadSignature { .. })
        ));
        assert!(matches!(
            admission.admit("m", &i, bytes, Some("not base64!")),
            Err(AdmissionError::MalformedSignature { .. })
        ));
    }

    #[test]
    fn grants_are_the_union_of_the_module_entry_and_the_wildcard() {
        let grants = BTreeMap::from([
            ("*".to_string(), BTreeSet::from(["log".to_string()])),
            ("p".to_string(), BTreeSet::from(["lookups".to_string()])),
        ]);
        let admission = Admission::new(vec![], Some(grants));
        let imports = [
            "wasi:io/streams@0.2.0",
            "wasmplane:dataplane/types@1.0.0",
            "wasmplane:dataplane/log@1.0.0",
            "wasmplane:dataplane/lookups@1.0.0",
        ];
        assert!(admission.admit("p", &info(&imports, b"x"), b"x", None).is_ok());
        let refused = admission.admit("q", &info(&imports, b"x"), b"x", None).unwrap_err();
        assert!(refused.to_string().contains("wasmplane:dataplane/lookups@1.0.0"), "{refused}");
        assert!(Admission::permissive().admit("q", &info(&imports, b"x"), b"x", None).is_ok());
    }

    #[test]
    fn keys_read_as_hex_or_pem() {
        let dir = tempfile::tempdir().unwrap();
        let (private, public) = generate_key_pair().unwrap();
        std::fs::write(dir.path().join("k"), &private).unwrap();
        std::fs::write(dir.path().join("k.pub"), &public).unwrap();
        let key = read_private_key(&dir.path().join("k")).unwrap();
        assert_eq!(read_public_key(&dir.path().join("k.pub")).unwrap(), key.verifying_key());
        std::fs::write(dir.path().join("h.pub"), hex::encode(key.verifying_key().as_bytes())).unwrap();
        assert_eq!(read_public_key(&dir.path().join("h.pub")).unwrap(), key.verifying_key());
        std::fs::write(dir.path().join("bad"), "abcd").unwrap();
        assert!(read_public_key(&dir.path().join("bad")).unwrap_err().to_string().contains("32-byte"));
    }
}
