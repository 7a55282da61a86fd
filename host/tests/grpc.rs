//! The host's gRPC model stream, wired to the real controller: a tonic client mirrors the
//! node-local model while manifests change, and always agrees with `/v1/state`. Secured as
//! the REST API's reads are: TLS with the REST API's certificate, no token from loopback, a
//! bearer token from anywhere else (a client in another network namespace, as root).

mod support;

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use support::netns::{Netns, require_root, run, unique_prefix};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use wasmplane::app::{HostConfig, RunningHost, start};
use wasmplane::auth::TlsFiles;
use wasmplane_grpc::proto::watch_response::Event;
use wasmplane_grpc::proto::{self, WatchRequest};
use wasmplane_grpc::{LocalModelClient, Mirror};

const TOKEN: &str = "grpc-test-token-0123456789abcdef";
const WAIT: Duration = Duration::from_secs(10);

fn service_yaml(name: &str, ip: &str, endpoints: &[&str]) -> String {
    let eps: String = endpoints
        .iter()
        .map(|ip| format!("  - addresses: [\"{ip}\"]\n    nodeName: node-a\n    conditions: {{ready: true}}\n"))
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  clusterIP: {ip}\n  clusterIPs: [{ip}]\n  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP}}]\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n{eps}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_sink_mirrors_the_model_through_changes() {
    let dir = tempfile::tempdir().unwrap();
    let manifests = dir.path().join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    std::fs::write(manifests.join("web.yaml"), service_yaml("web", "10.96.0.10", &["10.244.1.2"])).unwrap();
    let host = start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        grpc_listen: Some("127.0.0.1:0".parse().unwrap()),
        manifests: Some(manifests.clone()),
        data_dir: Some(dir.path().join("data")),
        token: Some(TOKEN.into()),
        manifest_poll: Duration::from_millis(50),
        service_cidrs: vec!["10.96.0.0/16".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let addr = host.grpc_addr.expect("gRPC is served");
    let mut client = LocalModelClient::connect(format!("http://{addr}")).await.unwrap();
    let mut stream = client.watch(WatchRequest {}).await.unwrap().into_inner();
    let mut mirror = Mirror::new();

    // Reads until the mirror is complete at a revision where `cond` holds.
    async fn until(stream: &mut tonic_stream::Stream, mirror: &mut Mirror, what: &str, cond: impl Fn(&Mirror) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if mirror.revision().is_some() && cond(mirror) {
                return;
            }
            let message = tokio::time::timeout_at(deadline.into(), stream.message()).await;
            let message = message
                .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
                .expect("stream healthy")
                .expect("stream open");
            mirror.apply(message).expect("the stream keeps the protocol: no gap, no repeat");
        }
    }
    let endpoints = |m: &Mirror, name: &str| -> Vec<String> {
        m.services()
            .iter()
            .find(|(k, _)| k.name == name)
            .map(|(_, v)| {
                v.slices.iter().flat_map(|s| s.endpoints.iter().map(|e| e.addresses[0].to_string())).collect()
            })
            .unwrap_or_default()
    };

    until(&mut stream, &mut mirror, "the initial state", |m| endpoints(m, "web") == ["10.244.1.2"]).await;

    // Scale up, add a service, delete one: each arrives as a delta.
    std::fs::write(manifests.join("web.yaml"), service_yaml("web", "10.96.0.10", &["10.244.1.2", "10.244.1.3"]))
        .unwrap();
    until(&mut stream, &mut mirror, "scale up", |m| endpoints(m, "web").len() == 2).await;
    std::fs::write(manifests.join("api.yaml"), service_yaml("api", "10.96.0.11", &["10.244.1.9"])).unwrap();
    until(&mut stream, &mut mirror, "new service", |m| endpoints(m, "api") == ["10.244.1.9"]).await;
    std::fs::remove_file(manifests.join("web.yaml")).unwrap();
    until(&mut stream, &mut mirror, "deleted service", |m| !m.services().keys().any(|k| k.name == "web")).await;

    // The cluster's service CIDRs (what the host drops when no service has the address):
    // the configured one from the start, a ServiceCIDR object's added and taken away.
    let cidrs = |m: &Mirror| m.service_cidrs().iter().map(ToString::to_string).collect::<Vec<_>>();
    assert_eq!(cidrs(&mirror), ["10.96.0.0/16"]);
    let service_cidr = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16, \"fd00:96::/108\"]}\n";
    std::fs::write(manifests.join("service-cidr.yaml"), service_cidr).unwrap();
    until(&mut stream, &mut mirror, "the ServiceCIDR object's ranges", |m| {
        cidrs(m) == ["10.96.0.0/16", "fd00:96::/108"]
    })
    .await;
    std::fs::remove_file(manifests.join("service-cidr.yaml")).unwrap();
    until(&mut stream, &mut mirror, "the object's ranges gone, the configured one kept", |m| {
        cidrs(m) == ["10.96.0.0/16"]
    })
    .await;

    // The mirror is exactly the host's model at the same revision.
    let state: serde_json::Value =
        reqwest::get(format!("{}/v1/state", host.url())).await.unwrap().json().await.unwrap();
    assert_eq!(Some(state["revision"].as_u64().unwrap()), mirror.revision());
    let host_services: Vec<String> = state["model"]["services"].as_object().unwrap().keys().cloned().collect();
    let mirror_services: Vec<String> = mirror.services().keys().map(|k| k.to_string()).collect();
    assert_eq!(host_services, mirror_services);

    host.stop().await;
    // Stopping the host ends the stream cleanly.
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("stream ends after stop");
    assert!(matches!(end, Ok(None) | Err(_)));
}

/// The generated client's stream type, named once.
mod tonic_stream {
    pub type Stream = tonic::Streaming<wasmplane_grpc::proto::WatchResponse>;
}

// ---- security: TLS and tokens ----

/// A self-signed certificate for `names` (IP addresses and DNS names), written where the
/// host reads it; and its PEM, for clients to trust.
fn self_signed(dir: &Path, names: &[&str]) -> (TlsFiles, String) {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    let files = TlsFiles { cert: dir.join("tls.crt"), key: dir.join("tls.key") };
    std::fs::write(&files.cert, cert.pem()).unwrap();
    std::fs::write(&files.key, signing_key.serialize_pem()).unwrap();
    (files, cert.pem())
}

/// A host with one service, serving gRPC on `grpc_listen`, over TLS with `tls`.
async fn secured_host(dir: &Path, grpc_listen: SocketAddr, tls: Option<TlsFiles>) -> RunningHost {
    let manifests = dir.join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    std::fs::write(manifests.join("web.yaml"), service_yaml("web", "10.96.0.10", &["10.244.1.2"])).unwrap();
    start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        grpc_listen: Some(grpc_listen),
        manifests: Some(manifests),
        data_dir: Some(dir.join("data")),
        token: Some(TOKEN.into()),
        manifest_poll: Duration::from_millis(50),
        service_cidrs: vec!["10.96.0.0/16".into()],
        tls,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// Connects (trusting `ca` for `https://`) and starts a watch, with `token` as bearer.
async fn watch(
    url: &str,
    ca: Option<&str>,
    token: Option<&str>,
) -> Result<tonic::Streaming<proto::WatchResponse>, String> {
    let attempt = async {
        let mut endpoint = Channel::from_shared(url.to_string()).map_err(|e| e.to_string())?;
        if let Some(ca) = ca {
            endpoint = endpoint
                .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))
                .map_err(|e| e.to_string())?;
        }
        let channel = endpoint.connect().await.map_err(|e| format!("connect: {e:?}"))?;
        let mut request = tonic::Request::new(WatchRequest {});
        if let Some(token) = token {
            request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        LocalModelClient::new(channel)
            .watch(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    };
    tokio::time::timeout(WAIT, attempt).await.unwrap_or_else(|_| Err("timed out".into()))
}

/// The first message must be the start of a snapshot holding the manifests' service.
async fn expect_snapshot(stream: &mut tonic::Streaming<proto::WatchResponse>, who: &str) {
    let deadline = Instant::now() + WAIT;
    let mut mirror = Mirror::new();
    // Until the manifests are loaded (a snapshot of the empty model may come first).
    while !mirror.services().keys().any(|k| k.name == "web") {
        let message = tokio::time::timeout_at(deadline.into(), stream.message())
            .await
            .unwrap_or_else(|_| panic!("{who}: no snapshot in time"));
        let message = message
            .unwrap_or_else(|e| panic!("{who}: stream failed: {e}"))
            .unwrap_or_else(|| panic!("{who}: stream ended"));
        if mirror.revision().is_none() {
            assert!(
                matches!(message.event, Some(Event::Snapshot(_))),
                "{who}: the first message is not a snapshot: {message:?}"
            );
        }
        mirror.apply(message).unwrap_or_else(|e| panic!("{who}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_is_served_over_tls_and_loopback_needs_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let (files, ca) = self_signed(dir.path(), &["127.0.0.1", "localhost"]);
    let host = secured_host(dir.path(), "127.0.0.1:0".parse().unwrap(), Some(files)).await;
    let addr = host.grpc_addr.expect("gRPC is served");

    // Over TLS, trusting the host's certificate, from loopback: no token needed (so the peer
    // address reached the check through the TLS stream).
    let mut stream = watch(&format!("https://{addr}"), Some(&ca), None).await.expect("a loopback TLS client may watch");
    expect_snapshot(&mut stream, "loopback TLS client").await;
    // A token does no harm.
    let mut stream = watch(&format!("https://{addr}"), Some(&ca), Some(TOKEN)).await.expect("with the token too");
    expect_snapshot(&mut stream, "loopback TLS client with the token").await;

    // Plain text to the TLS port, and TLS without trusting the certificate, both fail.
    let plain = watch(&format!("http://{addr}"), None, None).await;
    assert!(plain.is_err(), "plain text must not be served on the TLS port");
    let untrusting = async {
        let endpoint =
            Channel::from_shared(format!("https://{addr}")).unwrap().tls_config(ClientTlsConfig::new()).unwrap();
        endpoint.connect().await
    };
    assert!(
        tokio::time::timeout(WAIT, untrusting).await.expect("an answer in time").is_err(),
        "an untrusted certificate must fail"
    );

    // gRPC gets HTTP/2; the REST API on the same certificate still offers HTTP/1.1 only.
    assert_eq!(support::tls::handshake(addr, &ca, &[b"h2", b"http/1.1"]).await.unwrap().as_deref(), Some(&b"h2"[..]));
    assert_eq!(
        support::tls::handshake(host.addr, &ca, &[b"h2", b"http/1.1"]).await.unwrap().as_deref(),
        Some(&b"http/1.1"[..])
    );
    host.stop().await;
}

/// Deletes a link on drop (its peer goes with it).
struct Link(String);

impl Drop for Link {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", &self.0]).output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_another_host_grpc_needs_the_token() {
    require_root!("network namespaces, veth");
    // "Another host": a namespace joined to ours by a veth pair, in a /30 of its own per
    // process (so concurrent runs do not share a subnet).
    let subnet = (std::process::id() % 64) * 4;
    let (ours, theirs) = (format!("10.244.250.{}", subnet + 1), format!("10.244.250.{}", subnet + 2));
    let ns = Netns::new(unique_prefix("grpc"));
    let link = Link(format!("wg{}", std::process::id()));
    run(&["ip", "link", "add", &link.0, "type", "veth", "peer", "name", "eth0", "netns", &ns.name]);
    run(&["ip", "addr", "add", &format!("{ours}/30"), "dev", &link.0]);
    run(&["ip", "link", "set", &link.0, "up"]);
    ns.exec(&["ip", "addr", "add", &format!("{theirs}/30"), "dev", "eth0"]);
    ns.exec(&["ip", "link", "set", "eth0", "up"]);

    for tls in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (files, ca) = self_signed(dir.path(), &["127.0.0.1", &ours]);
        // Only on the veth: nothing beyond this test's namespace can reach it.
        let host = secured_host(dir.path(), SocketAddr::new(ours.parse().unwrap(), 0), tls.then_some(files)).await;
        let addr = host.grpc_addr.expect("gRPC is served");
        let url = format!("{}://{addr}", if tls { "https" } else { "http" });
        let ca = tls.then_some(ca);
        let theirs: IpAddr = theirs.parse().unwrap();

        // The client runs on a thread inside the namespace, on a runtime of its own there.
        let outcome = tokio::task::block_in_place(|| {
            ns.run(|| {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                runtime.block_on(async {
                    let local = tokio::net::UdpSocket::bind("0.0.0.0:0").await.unwrap();
                    local.connect(addr).await.unwrap();
                    assert_eq!(local.local_addr().unwrap().ip(), theirs, "the client is not in the other namespace");

                    let ca = ca.as_deref();
                    let missing = watch(&url, ca, None)
                        .await
                        .map(|_| ())
                        .expect_err("no token from another host must be refused");
                    let wrong = watch(&url, ca, Some("wrong-token-wrong-token"))
                        .await
                        .map(|_| ())
                        .expect_err("a wrong token must be refused");
                    let mut stream = watch(&url, ca, Some(TOKEN))
                        .await
                        .unwrap_or_else(|e| panic!("the host's token must be let in: {e}"));
                    expect_snapshot(&mut stream, "client in the other namespace").await;
                    (missing, wrong)
                })
            })
        });
        let (missing, wrong) = outcome;
        assert!(
            missing.starts_with(&format!("{:?}: missing bearer token", Code::Unauthenticated)),
            "tls={tls}: {missing}"
        );
        assert!(wrong.starts_with(&format!("{:?}: invalid bearer token", Code::Unauthenticated)), "tls={tls}: {wrong}");
        host.stop().await;
    }
    drop(link);
    drop(ns);
}

/// The value of the sample `series` (name and labels) in the host's `/metrics`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_served_watches_are_in_the_metrics() {
    require_root!("network namespaces, veth");
    // Another host, as in `from_another_host_grpc_needs_the_token`, on a subnet and link of
    // its own so the two tests can run at once.
    let subnet = (std::process::id() % 64) * 4;
    let (ours, theirs) = (format!("10.244.251.{}", subnet + 1), format!("10.244.251.{}", subnet + 2));
    let ns = Netns::new(unique_prefix("grpcm"));
    let link = Link(format!("wm{}", std::process::id()));
    run(&["ip", "link", "add", &link.0, "type", "veth", "peer", "name", "eth0", "netns", &ns.name]);
    run(&["ip", "addr", "add", &format!("{ours}/30"), "dev", &link.0]);
    run(&["ip", "link", "set", &link.0, "up"]);
    ns.exec(&["ip", "addr", "add", &format!("{theirs}/30"), "dev", "eth0"]);
    ns.exec(&["ip", "link", "set", "eth0", "up"]);

    let dir = tempfile::tempdir().unwrap();
    let host = secured_host(dir.path(), SocketAddr::new(ours.parse().unwrap(), 0), None).await;
    let url = format!("http://{}", host.grpc_addr.expect("gRPC is served"));
    let scrape = || async {
        reqwest::get(format!("{}/metrics", host.url())).await.unwrap().error_for_status().unwrap().text().await.unwrap()
    };
    let before = scrape().await;
    assert_eq!(
        sample(&before, "wasmplane_grpc_watches_refused_total{code=\"unauthenticated\"}"),
        Some(0.0),
        "{before}"
    );

    let refused = tokio::task::block_in_place(|| {
        ns.run(|| {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(watch(&url, None, None)).map(|_| ())
        })
    });
    let refused = refused.expect_err("no token from another host must be refused");
    assert!(refused.starts_with(&format!("{:?}:", Code::Unauthenticated)), "{refused}");

    let mut stream =
        watch(&url, None, Some(TOKEN)).await.unwrap_or_else(|e| panic!("the host's token must be let in: {e}"));
    expect_snapshot(&mut stream, "client with the token").await;
    let serving = scrape().await;
    for (series, at_least) in [
        ("wasmplane_grpc_watches_total", 1.0),
        ("wasmplane_grpc_snapshots_sent_total", 1.0),
        ("wasmplane_grpc_subscribers", 1.0),
        ("wasmplane_grpc_revisions_published_total", 1.0),
    ] {
        let value = sample(&serving, series).unwrap_or_else(|| panic!("{series} not in /metrics:\n{serving}"));
        assert!(value >= at_least, "{series} is {value}:\n{serving}");
    }
    assert_eq!(
        sample(&serving, "wasmplane_grpc_watches_refused_total{code=\"unauthenticated\"}"),
        Some(1.0),
        "{serving}"
    );
    assert_eq!(
        sample(&serving, "wasmplane_grpc_watches_refused_total{code=\"permission_denied\"}"),
        Some(0.0),
        "{serving}"
    );

    // The server notices the client went away (a reset stream) and drops the watch.
    drop(stream);
    let deadline = Instant::now() + WAIT;
    loop {
        let after = scrape().await;
        if sample(&after, "wasmplane_grpc_subscribers") == Some(0.0) {
            break;
        }
        assert!(Instant::now() < deadline, "the dropped watch is still counted:\n{after}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    host.stop().await;
    drop(link);
    drop(ns);
}
