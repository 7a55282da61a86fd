//! The host's gRPC model stream, wired to the real controller: a tonic client mirrors the
//! node-local model while manifests change, and always agrees with `/v1/state`.

use std::time::{Duration, Instant};

use wasmplane::app::{HostConfig, start};
use wasmplane_grpc::proto::WatchRequest;
use wasmplane_grpc::{LocalModelClient, Mirror};

const TOKEN: &str = "grpc-test-token-0123456789abcdef";

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
            let message = message.unwrap_or_else(|_| panic!("timed out waiting for {what}")).expect("stream healthy").expect("stream open");
            mirror.apply(message).expect("the stream keeps the protocol: no gap, no repeat");
        }
    }
    let endpoints = |m: &Mirror, name: &str| -> Vec<String> {
        m.services()
            .iter()
            .find(|(k, _)| k.name == name)
            .map(|(_, v)| v.slices.iter().flat_map(|s| s.endpoints.iter().map(|e| e.addresses[0].to_string())).collect())
            .unwrap_or_default()
    };

    until(&mut stream, &mut mirror, "the initial state", |m| endpoints(m, "web") == ["10.244.1.2"]).await;

    // Scale up, add a service, delete one: each arrives as a delta.
    std::fs::write(manifests.join("web.yaml"), service_yaml("web", "10.96.0.10", &["10.244.1.2", "10.244.1.3"])).unwrap();
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
    until(&mut stream, &mut mirror, "the ServiceCIDR object's ranges", |m| cidrs(m) == ["10.96.0.0/16", "fd00:96::/108"]).await;
    std::fs::remove_file(manifests.join("service-cidr.yaml")).unwrap();
    until(&mut stream, &mut mirror, "the object's ranges gone, the configured one kept", |m| cidrs(m) == ["10.96.0.0/16"]).await;

    // The mirror is exactly the host's model at the same revision.
    let state: serde_json::Value = reqwest::get(format!("{}/v1/state", host.url())).await.unwrap().json().await.unwrap();
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
