//! A bare TLS client handshake, for tests of what the host's TLS ports serve.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject as _;
use tokio_rustls::rustls;

/// A handshake with `addr` trusting only `ca_pem` and offering `alpn`: the protocol the
/// server picked, or why the handshake failed (within 10 s).
pub async fn handshake(addr: SocketAddr, ca_pem: &str, alpn: &[&[u8]]) -> Result<Option<Vec<u8>>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(rustls_pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls_pki_types::ServerName::IpAddress(addr.ip().into());
    let connecting = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp);
    let tls = tokio::time::timeout(Duration::from_secs(10), connecting).await.map_err(|_| "timed out".to_string())?.map_err(|e| e.to_string())?;
    Ok(tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec))
}
