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
use std::sync::{Arc, Mutex};
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
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// A rustls server configuration from PEM files (ring provider, HTTP/1.1).
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let cert_error = |reason: String| TlsError::Cert { path: files.cert.display().to_string(), reason };
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| cert_error(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| cert_error(e.to_string()))?;
    if certs.is_empty() {
        return Err(cert_error("no CERTIFICATE in the file".into()));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| TlsError::Key { path: files.key.display().to_string(), reason: e.to_string() })?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    // The router speaks HTTP/1.1 only (axum built without http2).
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
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
    headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).map(str::trim)
}

impl Auth {
    /// The static token only.
    pub fn static_token(token: &str) -> Auth {
        Auth { token_digest: Sha256::digest(token.as_bytes()).into(), kube: None }
    }

    /// The static token plus Kubernetes reviews.
    pub async fn with_kubernetes(token: &str, config: KubernetesAuthConfig) -> anyhow::Result<Auth> {
        let client = config.source.client().await?;
        Ok(Auth { token_digest: Sha256::digest(token.as_bytes()).into(), kube: Some(KubeAuth { client, config, cache: Mutex::new(HashMap::new()) }) })
    }

    /// Checks the request's bearer token; `mutating` picks the SubjectAccessReview verb.
    pub async fn check(&self, headers: &HeaderMap, mutating: bool) -> Result<Identity, AuthError> {
        let Some(given) = bearer(headers) else {
            return Err(if headers.contains_key(header::AUTHORIZATION) { AuthError::Invalid } else { AuthError::Missing });
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
        let review = TokenReview { spec: TokenReviewSpec { token: Some(token.to_string()), audiences: None }, ..Default::default() };
        let reviewed = kube::Api::<TokenReview>::all(self.client.clone()).create(&Default::default(), &review).await.map_err(unavailable)?;
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
        let decided = kube::Api::<SubjectAccessReview>::all(self.client.clone()).create(&Default::default(), &access).await.map_err(unavailable)?;
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
