//! Who may watch the node-local model over gRPC (`--grpc-listen`), and over what.
//!
//! The stream carries every Service, endpoint, pod and policy of the node, so it follows the
//! REST API's rule for reads: loopback peers watch without a token, anyone else needs
//! `authorization: Bearer <token>` metadata that [`Auth::check`] accepts for a read (the
//! static token, or a Kubernetes token allowed verb `get`). With the REST API's TLS files
//! set, the stream is served over TLS with the same certificate.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::HeaderMap;
use futures::future::BoxFuture;
use tokio::net::TcpListener;
use tokio_rustls::rustls;
use wasmplane_grpc::tonic::Status;
use wasmplane_grpc::tonic::transport::server::TcpIncoming;
use wasmplane_grpc::{Authorize, WatchService};

use crate::auth::{Auth, AuthError, TlsListener};

/// The REST API's read rule as a gRPC [`Authorize`] hook.
pub struct GrpcAuth {
    auth: Arc<Auth>,
}

impl GrpcAuth {
    /// Checks tokens with `auth`, the REST API's own (one cache of Kubernetes reviews).
    pub fn new(auth: Arc<Auth>) -> GrpcAuth {
        GrpcAuth { auth }
    }
}

impl Authorize for GrpcAuth {
    fn authorize<'a>(&'a self, peer: Option<SocketAddr>, headers: &'a HeaderMap) -> BoxFuture<'a, Result<(), Status>> {
        Box::pin(async move {
            if is_loopback(peer) {
                return Ok(());
            }
            self.auth.check(headers, false).await.map(|_| ()).map_err(|e| status_of(&e))
        })
    }
}

/// Whether the peer is on this host. An unknown peer is not: it has to show a token.
pub fn is_loopback(peer: Option<SocketAddr>) -> bool {
    // Canonical: on a dual-stack socket an IPv4 loopback client shows as ::ffff:127.0.0.1.
    peer.is_some_and(|p| p.ip().to_canonical().is_loopback())
}

/// The gRPC answer for a refused token, as the REST API's 401 / 403 / 503.
pub fn status_of(error: &AuthError) -> Status {
    let message = error.to_string();
    match error {
        AuthError::Missing | AuthError::Invalid | AuthError::Rejected { .. } => Status::unauthenticated(message),
        AuthError::Forbidden { .. } => Status::permission_denied(message),
        AuthError::Unavailable(_) => Status::unavailable(message),
    }
}

/// The REST API's TLS configuration with the ALPN gRPC needs: HTTP/2 only (the REST one
/// offers HTTP/1.1 only, and a gRPC client that finds no `h2` gives up). The copy shares
/// the REST one's certificate resolver, so a reloaded certificate is served on both.
pub fn grpc_tls_config(rest: &rustls::ServerConfig) -> Arc<rustls::ServerConfig> {
    let mut config = rest.clone();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// Serves `service` on `listener` until `shutdown`, over TLS when `tls` is set. The peer
/// address reaches the service's authorizer either way: tonic takes it from the TCP stream
/// inside the TLS one (its connect info for rustls streams).
pub async fn serve(
    service: WatchService,
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    match tls {
        None => wasmplane_grpc::serve_incoming(service, TcpIncoming::from(listener), shutdown).await?,
        Some(config) => {
            // Handshakes run in their own tasks (a slow client holds up no one), as for REST.
            let listener = TlsListener::new(listener, config)?;
            let incoming = futures::stream::unfold(listener, |mut listener| async move {
                let (stream, _peer) = axum::serve::Listener::accept(&mut listener).await;
                Some((Ok::<_, std::io::Error>(stream), listener))
            });
            wasmplane_grpc::serve_incoming(service, incoming, shutdown).await?
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use wasmplane_grpc::tonic::Code;

    use super::*;

    const TOKEN: &str = "grpc-auth-test-token";

    fn with_token(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", format!("Bearer {token}").parse().unwrap());
        headers
    }

    async fn answer(peer: Option<&str>, headers: &HeaderMap) -> Result<(), (Code, String)> {
        let hook = GrpcAuth::new(Arc::new(Auth::static_token(TOKEN)));
        let peer = peer.map(|p| p.parse().unwrap());
        hook.authorize(peer, headers).await.map_err(|s| (s.code(), s.message().to_string()))
    }

    #[test]
    fn auth_errors_map_to_grpc_codes_with_their_text() {
        let cases = [
            (AuthError::Missing, Code::Unauthenticated),
            (AuthError::Invalid, Code::Unauthenticated),
            (AuthError::Rejected { reason: Some("token expired".into()) }, Code::Unauthenticated),
            (
                AuthError::Forbidden {
                    user: "bob".into(),
                    verb: "get".into(),
                    resource: "modules.wasmplane.io".into(),
                    reason: None,
                },
                Code::PermissionDenied,
            ),
            (AuthError::Unavailable("connection refused".into()), Code::Unavailable),
        ];
        for (error, code) in cases {
            let status = status_of(&error);
            assert_eq!(status.code(), code, "{error:?}");
            assert_eq!(status.message(), error.to_string());
        }
        assert!(
            status_of(&AuthError::Rejected { reason: Some("token expired".into()) })
                .message()
                .contains("token expired")
        );
        assert!(
            status_of(&AuthError::Forbidden {
                user: "bob".into(),
                verb: "get".into(),
                resource: "modules.wasmplane.io".into(),
                reason: None
            })
            .message()
            .contains("\"bob\" may not get")
        );
    }

    #[test]
    fn loopback_is_v4_v6_and_mapped_v4_only() {
        for local in ["127.0.0.1:5000", "127.1.2.3:5000", "[::1]:5000", "[::ffff:127.0.0.1]:5000"] {
            assert!(is_loopback(Some(local.parse().unwrap())), "{local}");
        }
        for remote in ["10.244.250.2:5000", "0.0.0.0:5000", "[::]:5000", "[fd00::1]:5000", "[::ffff:10.0.0.1]:5000"] {
            assert!(!is_loopback(Some(remote.parse().unwrap())), "{remote}");
        }
        assert!(!is_loopback(None), "an unknown peer must show a token");
    }

    #[tokio::test]
    async fn loopback_watches_without_a_token_others_need_one() {
        let none = HeaderMap::new();
        assert_eq!(answer(Some("127.0.0.1:40000"), &none).await, Ok(()));
        assert_eq!(answer(Some("[::1]:40000"), &none).await, Ok(()));
        // Even a wrong token does not lock out a loopback reader (as REST reads).
        assert_eq!(answer(Some("127.0.0.1:40000"), &with_token("wrong")).await, Ok(()));

        for peer in [Some("10.244.250.2:40000"), Some("[fd00::2]:40000"), None] {
            let (code, message) = answer(peer, &none).await.expect_err("no token from afar");
            assert_eq!(code, Code::Unauthenticated, "{peer:?}");
            assert!(message.contains("missing bearer token"), "{message}");
            let (code, message) = answer(peer, &with_token("wrong-token")).await.expect_err("a wrong token from afar");
            assert_eq!(code, Code::Unauthenticated, "{peer:?}");
            assert!(message.contains("invalid bearer token"), "{message}");
            let mut not_bearer = HeaderMap::new();
            not_bearer.insert("authorization", format!("Basic {TOKEN}").parse().unwrap());
            assert_eq!(answer(peer, &not_bearer).await.map_err(|e| e.0), Err(Code::Unauthenticated), "{peer:?}");
            assert_eq!(answer(peer, &with_token(TOKEN)).await, Ok(()), "{peer:?}");
        }
    }
}
