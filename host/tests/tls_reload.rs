//! Certificate rotation (cert-manager, kubelet): the REST API's and the gRPC stream's
//! certificate is read again from its files, so new connections get the new certificate
//! without a restart; files that cannot be used (garbage, a key of another certificate)
//! leave the previous certificate served.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use support::tls::{self, Issued, handshake};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use wasmplane::app::{HostConfig, RunningHost, start};
use wasmplane::auth::TlsFiles;
use wasmplane_grpc::LocalModelClient;
use wasmplane_grpc::proto::WatchRequest;

const TOKEN: &str = "tls-reload-test-token-0123456789";
/// Short, so the test waits a few of them rather than the default 30 s.
const RELOAD_INTERVAL: Duration = Duration::from_millis(200);
const WAIT: Duration = Duration::from_secs(10);

/// A CA, and a server certificate for 127.0.0.1 and localhost it signed with its key.
fn issue(ca_name: &str) -> Issued {
    tls::issue(ca_name, &["127.0.0.1", "localhost"], &format!("wasmplane ({ca_name})"))
}

/// Replaces a file as a Secret volume update does: the new contents appear at once.
fn replace(path: &Path, contents: &str) {
    let staged = path.with_extension("new");
    std::fs::write(&staged, contents).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

fn install(files: &TlsFiles, cert_pem: &str, key_pem: &str) {
    replace(&files.cert, cert_pem);
    replace(&files.key, key_pem);
}

async fn host_with(dir: &Path, files: &TlsFiles) -> anyhow::Result<RunningHost> {
    start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        grpc_listen: Some("127.0.0.1:0".parse().unwrap()),
        data_dir: Some(dir.join("data")),
        token: Some(TOKEN.into()),
        tls: Some(files.clone()),
        tls_reload_interval: RELOAD_INTERVAL,
        ..Default::default()
    })
    .await
}

/// `GET /healthz` trusting only `ca_pem`; a fresh connection each time (no pool).
async fn rest_health(host: &RunningHost, ca_pem: &str) -> Result<StatusCode, String> {
    let ca = reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap();
    let client = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(ca)
        .pool_max_idle_per_host(0)
        .timeout(WAIT)
        .build()
        .unwrap();
    client.get(format!("{}/healthz", host.url())).send().await.map(|r| r.status()).map_err(|e| format!("{e:?}"))
}

/// Starts a watch of the model over gRPC trusting only `ca_pem` (loopback: no token).
async fn grpc_watch(host: &RunningHost, ca_pem: &str) -> Result<(), String> {
    let addr = host.grpc_addr.expect("gRPC is served");
    let attempt = async {
        let endpoint = Channel::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)))
            .map_err(|e| e.to_string())?;
        let channel = endpoint.connect().await.map_err(|e| format!("connect: {e:?}"))?;
        LocalModelClient::new(channel)
            .watch(WatchRequest {})
            .await
            .map(drop)
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    };
    tokio::time::timeout(WAIT, attempt).await.unwrap_or_else(|_| Err("timed out".into()))
}

/// Both ports serve a certificate `ca` signed: the REST API, the gRPC stream, and a bare
/// handshake with each one's ALPN.
async fn assert_served_by(host: &RunningHost, ca: &Issued, when: &str) {
    assert_eq!(rest_health(host, &ca.ca_pem).await, Ok(StatusCode::OK), "{when}: REST");
    grpc_watch(host, &ca.ca_pem).await.unwrap_or_else(|e| panic!("{when}: gRPC: {e}"));
    handshake(host.addr, &ca.ca_pem, &[b"http/1.1"]).await.unwrap_or_else(|e| panic!("{when}: REST handshake: {e}"));
    handshake(host.grpc_addr.unwrap(), &ca.ca_pem, &[b"h2"])
        .await
        .unwrap_or_else(|e| panic!("{when}: gRPC handshake: {e}"));
}

/// Neither port serves a certificate `ca` signed.
async fn assert_not_served_by(host: &RunningHost, ca: &Issued, when: &str) {
    let rest = rest_health(host, &ca.ca_pem).await;
    assert!(rest.is_err(), "{when}: REST must refuse a client trusting only another CA: {rest:?}");
    assert!(grpc_watch(host, &ca.ca_pem).await.is_err(), "{when}: gRPC must refuse a client trusting only another CA");
    assert!(handshake(host.addr, &ca.ca_pem, &[b"http/1.1"]).await.is_err(), "{when}: REST handshake");
    assert!(handshake(host.grpc_addr.unwrap(), &ca.ca_pem, &[b"h2"]).await.is_err(), "{when}: gRPC handshake");
}

/// Waits until a client trusting only `ca` gets through to the REST API.
async fn until_served_by(host: &RunningHost, ca: &Issued, when: &str) {
    let deadline = Instant::now() + WAIT;
    while rest_health(host, &ca.ca_pem).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "{when}: the new certificate is not served after {WAIT:?} (reloads every {RELOAD_INTERVAL:?})"
        );
        tokio::time::sleep(RELOAD_INTERVAL / 4).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_on_rest_and_grpc_and_broken_files_are_not_taken() {
    let dir = tempfile::tempdir().unwrap();
    let files = TlsFiles { cert: dir.path().join("tls.crt"), key: dir.path().join("tls.key") };
    let (a, b, c) = (issue("CA A"), issue("CA B"), issue("CA C"));
    install(&files, &a.cert_pem, &a.key_pem);
    let host = host_with(dir.path(), &files).await.unwrap();
    assert_served_by(&host, &a, "at start").await;
    assert_not_served_by(&host, &b, "at start").await;

    // Rotation: a certificate from another CA. Within a reload interval or so, new
    // connections on both ports get it, and a client trusting only the old CA is refused.
    install(&files, &b.cert_pem, &b.key_pem);
    until_served_by(&host, &b, "after rotating to B").await;
    assert_served_by(&host, &b, "after rotating to B").await;
    assert_not_served_by(&host, &a, "after rotating to B").await;

    // Garbage where the certificate should be: not taken, B stays served.
    replace(&files.cert, "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n");
    tokio::time::sleep(RELOAD_INTERVAL * 3).await;
    assert_served_by(&host, &b, "with a garbage certificate file").await;

    // A rotation caught half way: the new certificate beside the old key. Not taken.
    install(&files, &c.cert_pem, &b.key_pem);
    tokio::time::sleep(RELOAD_INTERVAL * 3).await;
    assert_served_by(&host, &b, "with a key not matching the certificate").await;
    assert_not_served_by(&host, &c, "with a key not matching the certificate").await;

    // Once the pair is whole it is taken: refusals did not stop the reloading.
    replace(&files.key, &c.key_pem);
    until_served_by(&host, &c, "after completing the rotation to C").await;
    assert_served_by(&host, &c, "after completing the rotation to C").await;
    assert_not_served_by(&host, &b, "after completing the rotation to C").await;
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_certificate_files_at_start_stop_the_host_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let files = TlsFiles { cert: dir.path().join("tls.crt"), key: dir.path().join("tls.key") };
    let (a, b) = (issue("CA A"), issue("CA B"));

    let error = format!("{:#}", host_with(dir.path(), &files).await.err().expect("no certificate file"));
    assert!(error.contains(&files.cert.display().to_string()), "{error}");

    install(&files, &a.cert_pem, "garbage");
    let error = format!("{:#}", host_with(dir.path(), &files).await.err().expect("no key in the key file"));
    assert!(error.contains(&files.key.display().to_string()), "{error}");

    install(&files, &a.cert_pem, &b.key_pem);
    let error = format!("{:#}", host_with(dir.path(), &files).await.err().expect("a key of another certificate"));
    assert!(
        error.contains("does not belong to the certificate") && error.contains(&files.key.display().to_string()),
        "{error}"
    );

    install(&files, &a.cert_pem, &a.key_pem);
    let host = host_with(dir.path(), &files).await.unwrap();
    assert_served_by(&host, &a, "a matching pair").await;
    host.stop().await;
}
