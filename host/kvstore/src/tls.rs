//! TLS to etcd: a trusted CA and, for etcd's `--client-cert-auth`, a client certificate;
//! and etcd's own users (`--auth`: a user name and password).
//!
//! Files are read and checked once, when the store is configured, so a wrong path or a
//! file that holds no certificate is an error at start naming the file, not a handshake
//! failure on every request later. The same three settings come from the command line or
//! from an etcd client configuration file in the format Cilium's agents read for the
//! kvstore and for each cluster of a clustermesh ([`EtcdConfigFile`]).

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS settings for etcd could not be used.
#[derive(Debug, thiserror::Error)]
pub enum EtcdTlsError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
}

/// Where the PEM files are. Without `cert_file`/`key_file` the client only checks the
/// server (etcd without `--client-cert-auth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTlsFiles {
    pub trusted_ca_file: PathBuf,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// Checked PEM contents, ready for the etcd client.
#[derive(Clone)]
pub struct EtcdTls {
    pub(crate) ca_pem: Vec<u8>,
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Where it was read from, to read again (rotation).
    pub(crate) files: Option<EtcdTlsFiles>,
}

/// Key material stays out of logs and panics.
impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls").field("client_certificate", &self.identity.is_some()).finish_non_exhaustive()
    }
}

impl EtcdTlsFiles {
    /// Reads the files and checks that each holds what it should: at least one
    /// certificate in the CA and certificate files, one private key in the key file.
    pub fn load(&self) -> Result<EtcdTls, EtcdTlsError> {
        let ca_pem = read(&self.trusted_ca_file)?;
        require_certificate(&self.trusted_ca_file, &ca_pem)?;
        let identity = match (&self.cert_file, &self.key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => {
                let cert_pem = read(cert)?;
                require_certificate(cert, &cert_pem)?;
                let key_pem = read(key)?;
                if PrivateKeyDer::from_pem_slice(&key_pem).is_err() {
                    return Err(EtcdTlsError::Pem {
                        path: key.clone(),
                        what: "no private key (PEM: PKCS#8, RSA or SEC1)".into(),
                    });
                }
                Some((cert_pem, key_pem))
            }
            (Some(only), None) | (None, Some(only)) => {
                return Err(EtcdTlsError::Config {
                    path: only.clone(),
                    reason: "a client certificate needs both its certificate and its key file".into(),
                });
            }
        };
        Ok(EtcdTls { ca_pem, identity, files: Some(self.clone()) })
    }
}

impl EtcdTls {
    /// Whether a client certificate is presented.
    pub fn has_client_certificate(&self) -> bool {
        self.identity.is_some()
    }

    /// The same CA and client certificate and key, byte for byte.
    pub fn same_material(&self, other: &EtcdTls) -> bool {
        self.ca_pem == other.ca_pem && self.identity == other.identity
    }

    pub(crate) fn options(&self) -> etcd_client::TlsOptions {
        let options = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(&self.ca_pem));
        match &self.identity {
            Some((cert, key)) => options.identity(etcd_client::Identity::from_pem(cert, key)),
            None => options,
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, EtcdTlsError> {
    std::fs::read(path).map_err(|source| EtcdTlsError::Read { path: path.to_owned(), source })
}

fn require_certificate(path: &Path, pem: &[u8]) -> Result<(), EtcdTlsError> {
    let mut certificates = CertificateDer::pem_slice_iter(pem);
    match certificates.next() {
        Some(Ok(_)) => Ok(()),
        Some(Err(e)) => Err(EtcdTlsError::Pem { path: path.to_owned(), what: format!("not a PEM certificate: {e}") }),
        None => {
            Err(EtcdTlsError::Pem { path: path.to_owned(), what: "no certificate (PEM `BEGIN CERTIFICATE`)".into() })
        }
    }
}

/// An etcd user (etcd's role-based access control): the password travels to etcd, so use it
/// over TLS.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUser {
    pub name: String,
    pub password: String,
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser").field("name", &self.name).finish_non_exhaustive()
    }
}

/// An etcd client configuration file, as Cilium's agents read it (`etcd.config`, and one
/// file per remote cluster in the clustermesh directory):
///
/// ```yaml
/// endpoints:
/// - https://etcd.example:2379
/// trusted-ca-file: /var/lib/etcd-secrets/ca.crt
/// cert-file: /var/lib/etcd-secrets/client.crt
/// key-file: /var/lib/etcd-secrets/client.key
/// ```
///
/// Relative paths are taken from the file's directory (a mounted Secret holds both).
/// Unknown keys are refused: an ignored `insecure-skip-tls-verify` or `username` would
/// silently connect differently than its author meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfigFile {
    pub endpoints: Vec<String>,
    pub tls: Option<EtcdTlsFiles>,
    /// `username` and `password`, as etcd's own client configuration names them.
    pub user: Option<EtcdUser>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
struct RawConfigFile {
    endpoints: Vec<String>,
    trusted_ca_file: Option<PathBuf>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    username: Option<String>,
    password: Option<String>,
}

impl EtcdConfigFile {
    pub fn read(path: &Path) -> Result<EtcdConfigFile, EtcdTlsError> {
        let text = read(path)?;
        Self::parse(path, &text)
    }

    /// `path` names the file in errors and anchors relative paths.
    pub fn parse(path: &Path, text: &[u8]) -> Result<EtcdConfigFile, EtcdTlsError> {
        let invalid = |reason: String| EtcdTlsError::Config { path: path.to_owned(), reason };
        let raw: RawConfigFile = serde_yaml::from_slice(text).map_err(|e| invalid(e.to_string()))?;
        if raw.endpoints.is_empty() {
            return Err(invalid("no endpoints".into()));
        }
        let base = path.parent().unwrap_or(Path::new(""));
        let anchored = |file: Option<PathBuf>| file.map(|file| base.join(file));
        let tls = match anchored(raw.trusted_ca_file) {
            Some(trusted_ca_file) => Some(EtcdTlsFiles {
                trusted_ca_file,
                cert_file: anchored(raw.cert_file),
                key_file: anchored(raw.key_file),
            }),
            None if raw.cert_file.is_some() || raw.key_file.is_some() => {
                return Err(invalid(
                    "cert-file and key-file need trusted-ca-file (the CA that signed etcd's certificate)".into(),
                ));
            }
            None => None,
        };
        let user = match (raw.username, raw.password) {
            (Some(name), Some(password)) => Some(EtcdUser { name, password }),
            (None, None) => None,
            _ => return Err(invalid("username and password go together".into())),
        };
        Ok(EtcdConfigFile { endpoints: raw.endpoints, tls, user })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_files_in_ciliums_format_anchor_relative_paths_in_their_directory() {
        let text = b"endpoints:\n- https://10.0.0.1:2379\n- https://10.0.0.2:2379\ntrusted-ca-file: ca.crt\ncert-file: /abs/client.crt\nkey-file: client.key\n";
        let config = EtcdConfigFile::parse(Path::new("/etc/mesh/east"), text).unwrap();
        assert_eq!(config.endpoints, ["https://10.0.0.1:2379", "https://10.0.0.2:2379"]);
        assert_eq!(
            config.tls,
            Some(EtcdTlsFiles {
                trusted_ca_file: "/etc/mesh/ca.crt".into(),
                cert_file: Some("/abs/client.crt".into()),
                key_file: Some("/etc/mesh/client.key".into()),
            })
        );
        let plain = EtcdConfigFile::parse(Path::new("x"), b"endpoints: [http://a:2379]").unwrap();
        assert_eq!((plain.tls, plain.user), (None, None));
        let user = EtcdConfigFile::parse(
            Path::new("x"),
            b"endpoints: [https://a:2379]\ntrusted-ca-file: ca\nusername: agent\npassword: s3cret\n",
        )
        .unwrap();
        assert_eq!(user.user, Some(EtcdUser { name: "agent".into(), password: "s3cret".into() }));
        assert!(!format!("{user:?}").contains("s3cret"), "{user:?}");
    }

    #[test]
    fn config_files_refuse_what_they_cannot_honour() {
        let refused =
            |text: &str| EtcdConfigFile::parse(Path::new("/etc/mesh/east"), text.as_bytes()).unwrap_err().to_string();
        let unknown = refused("endpoints: [https://a:2379]\ninsecure-skip-tls-verify: true\n");
        assert!(unknown.contains("/etc/mesh/east") && unknown.contains("insecure-skip-tls-verify"), "{unknown}");
        assert!(refused("endpoints: []\n").contains("no endpoints"));
        assert!(refused("endpoints: [https://a:2379]\ncert-file: c\nkey-file: k\n").contains("need trusted-ca-file"));
        assert!(refused("trusted-ca-file: ca\n").contains("endpoints"));
        assert!(refused("endpoints: [https://a:2379]\nusername: agent\n").contains("go together"));
    }

    #[test]
    fn loading_checks_each_file_holds_what_it_should() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not a certificate\n").unwrap();
        let files = |ca: &Path, cert: Option<&Path>, key: Option<&Path>| EtcdTlsFiles {
            trusted_ca_file: ca.to_owned(),
            cert_file: cert.map(Path::to_owned),
            key_file: key.map(Path::to_owned),
        };
        let error = files(&ca, None, None).load().unwrap_err().to_string();
        assert!(error.contains("ca.pem") && error.contains("no certificate"), "{error}");
        let missing = files(&dir.path().join("absent.pem"), None, None).load().unwrap_err().to_string();
        assert!(missing.contains("absent.pem"), "{missing}");
        let pki = wasmplane_test_etcd::TestPki::generate(dir.path(), "unit").unwrap();
        let good = files(&pki.ca, Some(&pki.client_cert), Some(&pki.client_key)).load().unwrap();
        assert!(good.has_client_certificate());
        assert!(!format!("{good:?}").contains("PRIVATE"));
        let bad_key = files(&pki.ca, Some(&pki.client_cert), Some(&pki.ca)).load().unwrap_err().to_string();
        assert!(bad_key.contains("no private key"), "{bad_key}");
        assert!(files(&pki.ca, None, None).load().is_ok());
        // What needs a new connection: other TLS material, endpoints or user.
        let other = wasmplane_test_etcd::TestPki::generate(dir.path(), "other").unwrap();
        let config = |pki: &wasmplane_test_etcd::TestPki| {
            crate::EtcdConfig::new(["https://a:2379"])
                .with_tls(Some(files(&pki.ca, Some(&pki.client_cert), Some(&pki.client_key)).load().unwrap()))
        };
        assert!(config(&pki).same_connection(&config(&pki)));
        assert!(!config(&pki).same_connection(&config(&other)), "a rotated certificate");
        assert!(
            !config(&pki)
                .same_connection(&crate::EtcdConfig { endpoints: vec!["https://b:2379".into()], ..config(&pki) })
        );
        assert!(
            !config(&pki)
                .same_connection(&config(&pki).with_user(Some(EtcdUser { name: "u".into(), password: "p".into() })))
        );
        let half = files(&pki.ca, Some(&pki.client_cert), None).load().unwrap_err().to_string();
        assert!(half.contains("both its certificate and its key"), "{half}");
    }
}
