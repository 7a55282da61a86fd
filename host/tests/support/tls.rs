//! Certificates for tests' TLS servers, and a bare TLS client handshake, for tests of what
//! the host's TLS ports serve.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject as _;
use tokio_rustls::rustls;

/// A handshake with `addr` trusting only `ca_pem` and offering `alpn`: the protocol the
/// server picked, or why the handshake failed (within 10 s).
pub async fn handshake(addr: SocketAddr, ca_pem: &str, alpn: &[&[u8]]) -> Result<Option<Vec<u8>>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls_pki_types::CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls_pki_types::ServerName::IpAddress(addr.ip().into());
    let connecting = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp);
    let tls = tokio::time::timeout(Duration::from_secs(10), connecting)
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec))
}

/// A CA, and a server certificate it signed with its key.
pub struct Issued {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A new CA named `ca_name`, and a server certificate for `sans` named `common_name` it
/// signed.
pub fn issue(ca_name: &str, sans: &[&str], common_name: &str) -> Issued {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, ca_name);
    ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap()).unwrap();
    let mut params = rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    params.distinguished_name.push(rcgen::DnType::CommonName, common_name);
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    Issued { ca_pem: ca.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
}
