//! The host's REST API as the HTTP tests drive it: a host on loopback over a manifest dir
//! (the `shop` namespace's services below), and requests answered in JSON.

use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use wasmplane::app::{HostConfig, KvstoreConfig};
use wasmplane_runtime::Limits;
use wasmplane_test_etcd::Etcd;

/// The `shop` namespace.
pub const SHOP_NAMESPACE: &str = r#"
apiVersion: v1
kind: Namespace
metadata: { name: shop }
"#;

/// `shop/web`, unlabelled: 10.96.0.20, http 80 to 8080.
pub const WEB_SERVICE: &str = r#"
apiVersion: v1
kind: Service
metadata: { name: web, namespace: shop }
spec:
  clusterIP: 10.96.0.20
  ports: [{ name: http, port: 80, targetPort: 8080, protocol: TCP }]
"#;

/// `shop/api`, labelled `wasmplane.io/expose`: 10.96.0.21, https 443 to 8443.
pub const API_SERVICE: &str = r#"
apiVersion: v1
kind: Service
metadata: { name: api, namespace: shop, labels: { wasmplane.io/expose: "true" } }
spec:
  clusterIP: 10.96.0.21
  ports: [{ name: https, port: 443, targetPort: 8443, protocol: TCP }]
"#;

/// The EndpointSlice `{service}-abc` of the service `shop/{service}`: ready endpoints
/// (address, node) serving the port `port_name` on `port` (TCP).
pub fn endpoint_slice(service: &str, port_name: &str, port: u16, endpoints: &[(&str, &str)]) -> String {
    let mut yaml = format!(
        "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{ name: {service}-abc, namespace: shop, labels: {{ kubernetes.io/service-name: {service} }} }}
addressType: IPv4
ports: [{{ name: {port_name}, port: {port}, protocol: TCP }}]
endpoints:
"
    );
    for (address, node) in endpoints {
        yaml += &format!("  - {{ addresses: [{address}], conditions: {{ ready: true }}, nodeName: {node} }}\n");
    }
    yaml
}

/// Manifest documents as one multi-document YAML file.
pub fn documents(documents: &[&str]) -> String {
    documents.join("---\n")
}

/// Writes `file` (creating the directory `dir`) with `yaml`: written beside as a dot-file (the
/// host skips those) and renamed in, so a poll never reads half of it.
pub fn write_manifest(dir: &Path, file: &str, yaml: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, dir.join(file)).unwrap();
}

/// A host serving its API on loopback (any free port), mutations under the static `token`,
/// reading manifests from `manifests` (polled every 50 ms), keeping its data in `data_dir`.
pub fn config(manifests: &Path, data_dir: &Path, token: &str) -> HostConfig {
    HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        manifests: Some(manifests.into()),
        data_dir: Some(data_dir.into()),
        token: Some(token.into()),
        manifest_poll: Duration::from_millis(50),
        ..Default::default()
    }
}

/// [`config`] over `dir/manifests` and `dir/data`, with small guest limits (32 MiB, 16
/// instances, a call stopped after `call_timeout`) and uploads of at most 4 MiB.
pub fn limited_config(dir: &Path, token: &str, call_timeout: Duration) -> HostConfig {
    HostConfig {
        limits: Limits { call_timeout, memory_bytes: 32 << 20, max_instances: 16, ..Default::default() },
        max_module_bytes: 4 << 20,
        ..config(&dir.join("manifests"), &dir.join("data"), token)
    }
}

/// [`config`] for the node `node` of a cluster on `etcd`: manifests in `dir/{node}-manifests`
/// (`file` written there with `yaml`), data in `dir/{node}-data`.
pub fn node_config(dir: &Path, node: &str, etcd: &Etcd, token: &str, file: &str, yaml: &str) -> HostConfig {
    let manifests = dir.join(format!("{node}-manifests"));
    write_manifest(&manifests, file, yaml);
    HostConfig {
        kvstore: KvstoreConfig::etcd(vec![etcd.endpoint()]),
        node_name: node.into(),
        ..config(&manifests, &dir.join(format!("{node}-data")), token)
    }
}

/// `PUT /v1/modules/{name}?kind={kind}` with the module's bytes, to the API at `base`.
pub fn upload_request(
    client: &reqwest::Client,
    base: &str,
    name: &str,
    kind: &str,
    bytes: &[u8],
) -> reqwest::RequestBuilder {
    client.put(format!("{base}/v1/modules/{name}?kind={kind}")).body(bytes.to_vec())
}

/// Sends `request`: the answer's status and its JSON body (`Null` when it has none).
pub async fn json_answer(request: reqwest::RequestBuilder) -> (StatusCode, Value) {
    let r = request.send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The `error` of an error answer's body (empty when there is none).
pub fn error_of(body: &Value) -> String {
    body["error"].as_str().unwrap_or_default().to_string()
}
