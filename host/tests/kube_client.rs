//! The host's own Kubernetes client stack (kube_client.rs) against tiny API servers: TLS and
//! a bearer token taken from a kubeconfig, and bodies and objects larger than its bounded
//! read buffer arriving whole.

mod support;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::header;
use axum::response::IntoResponse as _;
use futures::{SinkExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ListParams, WatchEvent, WatchParams};
use rustls_pki_types::pem::PemObject as _;
use serde_json::json;
use support::tls::{self, Issued};
use tokio_rustls::rustls;
use wasmplane::app::KubernetesSource;
use wasmplane::kube_client::{READ_BUFFER_MAX, client};

const TOKEN: &str = "kube-client-test-token-0123456789";
const WAIT: Duration = Duration::from_secs(10);

// hyper panics when a connection's buffer limit is below its least (8 KiB).
const _: () = assert!(READ_BUFFER_MAX >= 8192);

/// A CA, and a server certificate for 127.0.0.1 it signed with its key.
fn issue(ca_name: &str) -> Issued {
    tls::issue(ca_name, &["127.0.0.1"], &format!("kube-apiserver ({ca_name})"))
}

/// What the server saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    uri: String,
    authorization: Option<String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn record(log: &Log, request: &Request) {
    let authorization = request.headers().get(header::AUTHORIZATION).map(|v| v.to_str().unwrap().to_string());
    log.lock().unwrap().push(Seen { uri: request.uri().to_string(), authorization });
}

fn namespace(name: &str) -> serde_json::Value {
    json!({"metadata": {"name": name, "uid": format!("uid-{name}"), "resourceVersion": "1"}})
}

/// An HTTPS API server on 127.0.0.1 with `issued`'s certificate answering `GET
/// /api/v1/namespaces` with one namespace, `default`; its address and what it saw.
async fn tls_server(issued: &Issued) -> (std::net::SocketAddr, Log) {
    let certs = vec![rustls_pki_types::CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).unwrap()];
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let log = Log::default();
    let seen = log.clone();
    let app = axum::Router::new().route(
        "/api/v1/namespaces",
        axum::routing::get(move |request: Request| async move {
            record(&seen, &request);
            axum::Json(json!({"apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": "1"}, "items": [namespace("default")]}))
        }),
    );
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // The host's own TLS listener for axum: the least code for an HTTPS server here.
    let listener = wasmplane::auth::TlsListener::new(tcp, Arc::new(config)).unwrap();
    let addr = axum::serve::Listener::local_addr(&listener).unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, log)
}

/// A kubeconfig as `kubectl config view --raw` writes one: the server's address, the CA to
/// trust inline, and a bearer token.
fn write_kubeconfig(dir: &std::path::Path, name: &str, addr: std::net::SocketAddr, ca_pem: &str) -> std::path::PathBuf {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: https://{addr}
    certificate-authority-data: {ca}
users:
- name: test
  user:
    token: {TOKEN}
contexts:
- name: test
  context:
    cluster: test
    user: test
current-context: test
"
        ),
    )
    .unwrap();
    path
}

/// The rustls error somewhere in `error`'s chain. An io::Error's `source` skips the error
/// it wraps (its Display shows that one), so io::Errors are looked into instead.
fn rustls_error(error: &(dyn std::error::Error + 'static)) -> Option<rustls::Error> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls.clone());
        }
        next = match e.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeconfig_client_verifies_the_servers_ca_and_sends_its_bearer_token() {
    let dir = tempfile::tempdir().unwrap();
    let issued = issue("cluster CA");
    let (addr, log) = tls_server(&issued).await;

    let trusting = write_kubeconfig(dir.path(), "trusting", addr, &issued.ca_pem);
    let client = KubernetesSource::Kubeconfig(trusting).client().await.unwrap();
    let list = tokio::time::timeout(WAIT, kube::Api::<Namespace>::all(client).list(&ListParams::default()))
        .await
        .expect("listed in time")
        .unwrap();
    let names: Vec<_> = list.items.iter().map(|n| n.metadata.name.clone().unwrap()).collect();
    assert_eq!(names, ["default"]);
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].uri.starts_with("/api/v1/namespaces"), "{seen:?}");
    assert_eq!(seen[0].authorization.as_deref(), Some(format!("Bearer {TOKEN}").as_str()));

    // The same server, with a kubeconfig that trusts another CA: no connection, so no request
    // (and no token) reaches the server.
    let other = issue("another CA");
    let distrusting = write_kubeconfig(dir.path(), "distrusting", addr, &other.ca_pem);
    let client = KubernetesSource::Kubeconfig(distrusting).client().await.unwrap();
    let error = tokio::time::timeout(WAIT, kube::Api::<Namespace>::all(client).list(&ListParams::default()))
        .await
        .expect("failed in time")
        .unwrap_err();
    assert_eq!(
        rustls_error(&error),
        Some(rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer)),
        "not a TLS error about the server's certificate: {error:?}"
    );
    assert_eq!(log.lock().unwrap().len(), 1, "{:?}", log.lock().unwrap());
}

/// Many events (and one object) larger than the read buffer, to be read in many pieces.
const EVENTS: usize = 2000;
const LARGE: usize = 200 * 1024;

/// An annotation value that no shift, repeat or lost piece leaves unchanged: counters.
fn large_value() -> String {
    let mut value = String::with_capacity(LARGE + 8);
    let mut i = 0u32;
    while value.len() < LARGE {
        value.push_str(&format!("{i:07x}."));
        i += 1;
    }
    value.truncate(LARGE);
    value
}

fn large_namespace() -> serde_json::Value {
    json!({"metadata": {"name": "large", "uid": "uid-large", "resourceVersion": "2", "annotations": {"example.com/large": large_value()}}})
}

fn small_name(i: usize) -> String {
    format!("namespace-{i:04}")
}

/// A plain-HTTP API server on 127.0.0.1 answering every watch of namespaces with
/// [`EVENTS`] small ADDED events and then one of a namespace with a [`LARGE`] annotation,
/// streamed (chunked) in small pieces with pauses between some, and every list with the same
/// namespaces in one body (with a length); its URL and what it saw.
async fn large_server() -> (String, Log) {
    let log = Log::default();
    let seen = log.clone();
    let app = axum::Router::new().fallback(move |request: Request| async move {
        record(&seen, &request);
        let watch = request.uri().query().is_some_and(|q| q.split('&').any(|p| p == "watch=true"));
        if !watch {
            let items: Vec<_> = (0..EVENTS).map(|i| namespace(&small_name(i))).chain([large_namespace()]).collect();
            return axum::Json(json!({"apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": "2"}, "items": items})).into_response();
        }
        // A small channel: pieces are handed to hyper (and written) a few at a time.
        let (mut tx, rx) = futures::channel::mpsc::channel::<Result<bytes::Bytes, Infallible>>(1);
        tokio::spawn(async move {
            for batch in (0..EVENTS).collect::<Vec<_>>().chunks(100) {
                let mut piece = String::new();
                for &i in batch {
                    piece.push_str(&json!({"type": "ADDED", "object": namespace(&small_name(i))}).to_string());
                    piece.push('\n');
                }
                if tx.send(Ok(piece.into())).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let large = format!("{}\n", json!({"type": "ADDED", "object": large_namespace()}));
            for piece in large.as_bytes().chunks(4096) {
                if tx.send(Ok(bytes::Bytes::copy_from_slice(piece))).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        });
        axum::response::Response::builder().header(header::CONTENT_TYPE, "application/json").body(Body::from_stream(rx)).unwrap()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, log)
}

/// The names `namespaces` carry, checking the large one's annotation on the way.
fn names_checking_the_large_one(namespaces: &[Namespace]) -> Vec<String> {
    let expected = large_value();
    namespaces
        .iter()
        .map(|n| {
            let name = n.metadata.name.clone().unwrap();
            if name == "large" {
                let value = n
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("example.com/large"))
                    .expect("the large annotation");
                assert_eq!(value.len(), LARGE);
                assert!(*value == expected, "the large annotation arrived changed");
            }
            name
        })
        .collect()
}

fn expected_names() -> Vec<String> {
    (0..EVENTS).map(small_name).chain(["large".to_string()]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_much_larger_than_the_read_buffer_delivers_every_event_and_the_large_object_whole() {
    let (url, log) = large_server().await;
    let client = client(kube::Config::new(url.parse().unwrap())).unwrap();
    let api = kube::Api::<Namespace>::all(client);
    let events = tokio::time::timeout(WAIT, async {
        api.watch(&WatchParams::default(), "0").await.unwrap().try_collect::<Vec<_>>().await
    })
    .await
    .expect("watched in time")
    .unwrap();
    let added: Vec<Namespace> = events
        .into_iter()
        .map(|e| match e {
            WatchEvent::Added(n) => n,
            other => panic!("unexpected event {other:?}"),
        })
        .collect();
    assert_eq!(names_checking_the_large_one(&added), expected_names());
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].uri.contains("watch=true"), "not a watch: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_much_larger_than_the_read_buffer_arrives_whole() {
    let (url, _log) = large_server().await;
    let client = client(kube::Config::new(url.parse().unwrap())).unwrap();
    let list = tokio::time::timeout(WAIT, kube::Api::<Namespace>::all(client).list(&ListParams::default()))
        .await
        .expect("listed in time")
        .unwrap();
    assert_eq!(names_checking_the_large_one(&list.items), expected_names());
}
