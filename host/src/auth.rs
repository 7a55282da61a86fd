//! Who may call the REST API, and over what: TLS (rustls) and authentication.
//!
//! A request carries `Authorization: Bearer <token>`. The static token (`--token-file`, or
//! `<data-dir>/token`) always works. With Kubernetes authentication on, any other bearer
//! token is sent to the API server in a TokenReview (authentication.k8s.io/v1); the user it
//! names must then pass a SubjectAccessReview (authorization.k8s.io/v1) for the configured
//! resource attributes (default: verb `update` on `modules.wasmplane.io` for mutating calls,
//! verb `get` for reads). Both answers are cached per token for a short time so a burst of
//! calls costs one review.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, header};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest as _, Sha256};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::server::TlsStream;

use crate::app::KubernetesSource;

/// The certificate chain and key of the REST API, PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Kubernetes TokenReview + SubjectAccessReview authentication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesAuthConfig {
    /// Where the API server is (the host's own credentials must allow creating
    /// tokenreviews and subjectaccessreviews: `system:auth-delegator`).
    pub source: KubernetesSource,
    /// SubjectAccessReview verb for mutating calls (reads ask `get`).
    pub verb: String,
    pub group: String,
    pub resource: String,
    /// Namespace of the resource attributes; none: cluster-wide.
    pub namespace: Option<String>,
    /// How long a review's answer is reused for the same token.
    pub cache_ttl: Duration,
}

impl KubernetesAuthConfig {
    pub fn new(source: KubernetesSource) -> KubernetesAuthConfig {
        KubernetesAuthConfig {
            source,
            verb: "update".into(),
            group: "wasmplane.io".into(),
            resource: "modules".into(),
            namespace: None,
            cache_ttl: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS certificate {path}: {reason}")]
    Cert { path: String, reason: String },
    #[error("TLS key {path}: {reason}")]
    Key { path: String, reason: String },
    #[error("TLS key {key} does not belong to the certificate {cert}: {reason}")]
    Mismatch { cert: String, key: String, reason: String },
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// How often the TLS files are read again unless configured otherwise: as the etcd
/// client's `tls_reload_interval`, so a rotated certificate is served within half a minute.
pub const DEFAULT_TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(30);

/// The certificate and key as last read: the PEM bytes (to see whether the files changed)
/// and what rustls serves.
struct LoadedCert {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    certified: Arc<CertifiedKey>,
}

/// The REST API's (and gRPC stream's) certificate: read from its PEM files at start and
/// read again by [`reload_tls`], so a rotated certificate (cert-manager, kubelet) is served
/// to new connections without a restart. Every handshake asks it for the certificate of
/// the moment.
pub struct ReloadingCert {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: RwLock<LoadedCert>,
}

/// Key material stays out of logs and panics.
impl std::fmt::Debug for ReloadingCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingCert").field("files", &self.files).finish_non_exhaustive()
    }
}

impl ReloadingCert {
    /// Reads the files (ring provider); the error names the file that cannot be used.
    pub fn load(files: &TlsFiles) -> Result<Arc<ReloadingCert>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let loaded = read_cert(files, &provider)?;
        Ok(Arc::new(ReloadingCert { files: files.clone(), provider, current: RwLock::new(loaded) }))
    }

    /// Reads the files again. `Ok(true)`: they changed and new handshakes are served what
    /// they hold; `Ok(false)`: unchanged. On an error (naming the file) the certificate
    /// served stays as it was: a file half written, or a key that does not match yet.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let (cert_pem, key_pem) = read_files(&self.files)?;
        {
            let current = self.current.read().unwrap_or_else(|p| p.into_inner());
            if current.cert_pem == cert_pem && current.key_pem == key_pem {
                return Ok(false);
            }
        }
        let certified = Arc::new(certified_key(&self.files, &cert_pem, &key_pem, &self.provider)?);
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = LoadedCert { cert_pem, key_pem, certified };
        Ok(true)
    }

    /// The certificate chain and key served now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).certified.clone()
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn read_files(files: &TlsFiles) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let cert_pem = std::fs::read(&files.cert)
        .map_err(|e| TlsError::Cert { path: files.cert.display().to_string(), reason: e.to_string() })?;
    let key_pem = std::fs::read(&files.key)
        .map_err(|e| TlsError::Key { path: files.key.display().to_string(), reason: e.to_string() })?;
    Ok((cert_pem, key_pem))
}

fn read_cert(files: &TlsFiles, provider: &CryptoProvider) -> Result<LoadedCert, TlsError> {
    let (cert_pem, key_pem) = read_files(files)?;
    let certified = Arc::new(certified_key(files, &cert_pem, &key_pem, provider)?);
    Ok(LoadedCert { cert_pem, key_pem, certified })
}

/// The chain and key from PEM text, refused unless the key is the certificate's.
fn certified_key(
    files: &TlsFiles,
    cert_pem: &[u8],
    key_pem: &[u8],
    provider: &CryptoProvider,
) -> Result<CertifiedKey, TlsError> {
    let cert_error = |reason: String| TlsError::Cert { path: files.cert.display().to_string(), reason };
    let key_error = |reason: String| TlsError::Key { path: files.key.display().to_string(), reason };
    let certs = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cert_error(e.to_string()))?;
    if certs.is_empty() {
        return Err(cert_error("no CERTIFICATE in the file".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| key_error(e.to_string()))?;
    let signing_key = provider.key_provider.load_private_key(key).map_err(|e| key_error(e.to_string()))?;
    let certified = CertifiedKey::new(certs, signing_key);
    match certified.keys_match() {
        // ring tells the public key of every key it loads; with one that cannot, rustls
        // itself (`with_single_cert`) serves the pair unchecked too.
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(certified),
        Err(e @ rustls::Error::InconsistentKeys(_)) => Err(TlsError::Mismatch {
            cert: files.cert.display().to_string(),
            key: files.key.display().to_string(),
            reason: e.to_string(),
        }),
        // The end-entity certificate does not parse.
        Err(e) => Err(cert_error(e.to_string())),
    }
}

/// A rustls server configuration serving `cert` (ring provider, HTTP/1.1). Copies made of
/// it (the gRPC one) share `cert`, so one reload covers all of them.
pub fn server_config(cert: &Arc<ReloadingCert>) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let mut config = rustls::ServerConfig::builder_with_provider(cert.provider.clone())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(cert.clone());
    // The router speaks HTTP/1.1 only (axum built without http2).
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Reads the TLS files again every `interval` ([`ReloadingCert::reload`]), as the etcd
/// client does with its own. Ends when the certificate is no longer served (the host
/// stopped and its listeners with it).
pub async fn reload_tls(cert: Weak<ReloadingCert>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(cert) = cert.upgrade() else { return };
        let files = cert.files();
        match cert.reload() {
            Ok(true) => {
                tracing::info!(cert = %files.cert.display(), key = %files.key.display(), "TLS certificate files changed: new connections are served the new certificate")
            }
            Ok(false) => {}
            Err(e) => tracing::warn!("TLS certificate not reloaded, still serving the previous one: {e}"),
        }
    }
}

/// Longest a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A TLS listener for `axum::serve`: handshakes run in their own tasks, so a slow or
/// silent client never holds up the accept loop; failed handshakes are logged and dropped.
pub struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    acceptor_task: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let acceptor_task = tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: back off rather than spin.
                        tracing::warn!("TLS accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local, acceptor_task })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor_task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The acceptor task is gone (aborted on drop): no more connections.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// Who made a request, as established by [`Auth::check`]; also what the audit log records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// `static-token`, or the Kubernetes username.
    pub user: String,
    /// `token` (the static token) or `kubernetes` (TokenReview).
    pub method: &'static str,
}

/// Why a request was not let in.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing bearer token: this call needs `Authorization: Bearer <token>`")]
    Missing,
    #[error("invalid bearer token: this call needs `Authorization: Bearer <token>`")]
    Invalid,
    #[error("bearer token rejected by the Kubernetes TokenReview{}", reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Rejected { reason: Option<String> },
    #[error("user {user:?} may not {verb} {resource} (SubjectAccessReview denied{})", reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Forbidden { user: String, verb: String, resource: String, reason: Option<String> },
    #[error("cannot check the bearer token with the Kubernetes API: {0}")]
    Unavailable(String),
}

impl AuthError {
    /// The identity to record for a refused request, when it is known.
    pub fn user(&self) -> Option<&str> {
        match self {
            AuthError::Forbidden { user, .. } => Some(user),
            _ => None,
        }
    }
}

/// Most cached review answers; the cache is cleared when full (tokens are few in practice).
const CACHE_CAPACITY: usize = 4096;

struct KubeAuth {
    client: kube::Client,
    config: KubernetesAuthConfig,
    /// (sha256 of the token, verb) → answer and when it was given.
    cache: Mutex<HashMap<([u8; 32], String), CachedAnswer>>,
}

/// A review's answer and when it was given.
type CachedAnswer = (Result<Identity, AuthError>, Instant);

/// The authentication policy of the REST API.
pub struct Auth {
    token_digest: [u8; 32],
    kube: Option<KubeAuth>,
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

impl Auth {
    /// The static token only.
    pub fn static_token(token: &str) -> Auth {
        Auth { token_digest: Sha256::digest(token.as_bytes()).into(), kube: None }
    }

    /// The static token plus Kubernetes reviews.
    pub async fn with_kubernetes(token: &str, config: KubernetesAuthConfig) -> anyhow::Result<Auth> {
        let client = config.source.client().await?;
        Ok(Auth {
            token_digest: Sha256::digest(token.as_bytes()).into(),
            kube: Some(KubeAuth { client, config, cache: Mutex::new(HashMap::new()) }),
        })
    }

    /// Checks the request's bearer token; `mutating` picks the SubjectAccessReview verb.
    pub async fn check(&self, headers: &HeaderMap, mutating: bool) -> Result<Identity, AuthError> {
        let Some(given) = bearer(headers) else {
            return Err(if headers.contains_key(header::AUTHORIZATION) {
                AuthError::Invalid
            } else {
                AuthError::Missing
            });
        };
        // Compare digests so the time taken says nothing about the token.
        let digest: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        if digest == self.token_digest {
            return Ok(Identity { user: "static-token".into(), method: "token" });
        }
        match &self.kube {
            None => Err(AuthError::Invalid),
            Some(kube) if !given.is_empty() => kube.check(given, digest, mutating).await,
            Some(_) => Err(AuthError::Invalid),
        }
    }
}

impl KubeAuth {
    async fn check(&self, token: &str, digest: [u8; 32], mutating: bool) -> Result<Identity, AuthError> {
        let verb = if mutating { self.config.verb.clone() } else { "get".to_string() };
        let key = (digest, verb.clone());
        {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((answer, at)) = cache.get(&key)
                && at.elapsed() < self.config.cache_ttl
            {
                return answer.clone();
            }
        }
        let answer = self.review(token, &verb).await;
        // An unreachable API server is not an answer: retried on the next call.
        if !matches!(answer, Err(AuthError::Unavailable(_))) {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() >= CACHE_CAPACITY {
                cache.clear();
            }
            cache.insert(key, (answer.clone(), Instant::now()));
        }
        answer
    }

    async fn review(&self, token: &str, verb: &str) -> Result<Identity, AuthError> {
        let unavailable = |e: kube::Error| AuthError::Unavailable(e.to_string());
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), audiences: None },
            ..Default::default()
        };
        let reviewed = kube::Api::<TokenReview>::all(self.client.clone())
            .create(&Default::default(), &review)
            .await
            .map_err(unavailable)?;
        let status = reviewed.status.unwrap_or_default();
        let user = status.user.unwrap_or_default();
        let username = user.username.clone().unwrap_or_default();
        if status.authenticated != Some(true) || username.is_empty() {
            return Err(AuthError::Rejected { reason: status.error.filter(|e| !e.is_empty()) });
        }
        let c = &self.config;
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(username.clone()),
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(verb.to_string()),
                    group: Some(c.group.clone()),
                    resource: Some(c.resource.clone()),
                    namespace: c.namespace.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let decided = kube::Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&Default::default(), &access)
            .await
            .map_err(unavailable)?;
        let status = decided.status.unwrap_or_default();
        if status.allowed && status.denied != Some(true) {
            return Ok(Identity { user: username, method: "kubernetes" });
        }
        let resource = if c.group.is_empty() { c.resource.clone() } else { format!("{}.{}", c.resource, c.group) };
        let reason = status.reason.or(status.evaluation_error).filter(|r| !r.is_empty());
        Err(AuthError::Forbidden { user: username, verb: verb.to_string(), resource, reason })
    }
}

/// Reads a PEM file's text, for the CLI's `--ca-cert`-like settings.
pub fn read_pem(path: &Path) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context as _;
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for 127.0.0.1 and its key, PEM; and the certificate's DER.
    struct Pair {
        cert_pem: String,
        key_pem: String,
        der: Vec<u8>,
    }

    fn self_signed() -> Pair {
        let rcgen::CertifiedKey { cert, signing_key } =
            rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
        Pair { cert_pem: cert.pem(), key_pem: signing_key.serialize_pem(), der: cert.der().to_vec() }
    }

    fn tls_files(dir: &Path) -> TlsFiles {
        TlsFiles { cert: dir.join("tls.crt"), key: dir.join("tls.key") }
    }

    fn write(files: &TlsFiles, cert_pem: &str, key_pem: &str) {
        std::fs::write(&files.cert, cert_pem).unwrap();
        std::fs::write(&files.key, key_pem).unwrap();
    }

    fn served(cert: &ReloadingCert) -> Vec<u8> {
        cert.current().cert[0].to_vec()
    }

    #[test]
    fn a_key_not_matching_the_certificate_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let files = tls_files(dir.path());
        let (a, b) = (self_signed(), self_signed());
        write(&files, &a.cert_pem, &b.key_pem);
        let error = ReloadingCert::load(&files).expect_err("a key of another certificate");
        assert!(matches!(error, TlsError::Mismatch { .. }), "{error:?}");
        let message = error.to_string();
        assert!(
            message.contains(&files.key.display().to_string()) && message.contains(&files.cert.display().to_string()),
            "{message}"
        );
        write(&files, &a.cert_pem, &a.key_pem);
        assert_eq!(served(&ReloadingCert::load(&files).unwrap()), a.der);
    }

    #[test]
    fn unusable_files_at_start_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let files = tls_files(dir.path());
        let a = self_signed();
        let error = ReloadingCert::load(&files).expect_err("no files");
        assert!(
            matches!(&error, TlsError::Cert { path, .. } if *path == files.cert.display().to_string()),
            "{error:?}"
        );
        write(&files, "not a certificate", &a.key_pem);
        let error = ReloadingCert::load(&files).expect_err("no certificate in the file");
        assert!(
            matches!(&error, TlsError::Cert { path, .. } if *path == files.cert.display().to_string()),
            "{error:?}"
        );
        write(&files, &a.cert_pem, "not a key");
        let error = ReloadingCert::load(&files).expect_err("no key in the file");
        assert!(matches!(&error, TlsError::Key { path, .. } if *path == files.key.display().to_string()), "{error:?}");
    }

    #[test]
    fn reload_takes_a_new_pair_and_keeps_the_old_one_over_broken_files() {
        let dir = tempfile::tempdir().unwrap();
        let files = tls_files(dir.path());
        let (a, b, c) = (self_signed(), self_signed(), self_signed());
        write(&files, &a.cert_pem, &a.key_pem);
        let cert = ReloadingCert::load(&files).unwrap();
        assert!(!cert.reload().unwrap(), "unchanged files are not a change");
        assert_eq!(served(&cert), a.der);

        write(&files, &b.cert_pem, &b.key_pem);
        assert!(cert.reload().unwrap(), "a new pair is a change");
        assert_eq!(served(&cert), b.der);

        // Half way through a rotation: the new certificate, the old key.
        write(&files, &c.cert_pem, &b.key_pem);
        let error = cert.reload().expect_err("a key not matching the certificate");
        assert!(matches!(error, TlsError::Mismatch { .. }), "{error:?}");
        assert_eq!(served(&cert), b.der, "the previous certificate stays served");

        write(&files, &c.cert_pem[..c.cert_pem.len() / 2], &c.key_pem);
        let error = cert.reload().expect_err("a half-written certificate");
        assert!(
            matches!(&error, TlsError::Cert { path, .. } if *path == files.cert.display().to_string()),
            "{error:?}"
        );
        assert_eq!(served(&cert), b.der);

        std::fs::remove_file(&files.key).unwrap();
        let error = cert.reload().expect_err("a missing key");
        assert!(matches!(&error, TlsError::Key { path, .. } if *path == files.key.display().to_string()), "{error:?}");
        assert_eq!(served(&cert), b.der);

        write(&files, &c.cert_pem, &c.key_pem);
        assert!(cert.reload().unwrap());
        assert_eq!(served(&cert), c.der);
    }

    #[test]
    fn the_rest_and_grpc_configurations_share_the_reloading_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let files = tls_files(dir.path());
        let a = self_signed();
        write(&files, &a.cert_pem, &a.key_pem);
        let cert = ReloadingCert::load(&files).unwrap();
        let rest = server_config(&cert).unwrap();
        let grpc = crate::grpc_auth::grpc_tls_config(&rest);
        assert_eq!(rest.alpn_protocols, [b"http/1.1".to_vec()]);
        assert_eq!(grpc.alpn_protocols, [b"h2".to_vec()]);
        let ours: Arc<dyn ResolvesServerCert> = cert.clone();
        assert!(Arc::ptr_eq(&rest.cert_resolver, &ours) && Arc::ptr_eq(&grpc.cert_resolver, &ours));
    }

    #[tokio::test]
    async fn the_reload_task_follows_the_files_and_ends_with_the_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let files = tls_files(dir.path());
        let (a, b) = (self_signed(), self_signed());
        write(&files, &a.cert_pem, &a.key_pem);
        let cert = ReloadingCert::load(&files).unwrap();
        let task = tokio::spawn(reload_tls(Arc::downgrade(&cert), Duration::from_millis(20)));
        write(&files, &b.cert_pem, &b.key_pem);
        let deadline = Instant::now() + Duration::from_secs(5);
        while served(&cert) != b.der {
            assert!(Instant::now() < deadline, "the new certificate was not taken");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(cert);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the task ends once the certificate is dropped")
            .unwrap();
    }
}
