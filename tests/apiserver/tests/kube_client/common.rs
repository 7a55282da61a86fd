//! Helpers shared by the kube-client tests.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Node, Service};
use kube::ResourceExt as _;
use kube::runtime::reflector::Store;
use serde_json::{Value, json};
use wasmplane_test_apiserver::TestApiServer;

/// Logs from `RUST_LOG=wasmplane_test_apiserver=debug,kube=debug` when a test misbehaves.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub const WAIT: Duration = Duration::from_secs(20);

pub fn service(namespace: &str, name: &str, labels: &[(&str, &str)]) -> Service {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": namespace, "labels": labels },
        "spec": { "clusterIP": "10.96.0.10", "ports": [{ "port": 80, "protocol": "TCP" }] },
    }))
    .expect("service JSON")
}

pub fn node(name: &str) -> Node {
    serde_json::from_value(json!({ "metadata": { "name": name } })).expect("node JSON")
}

/// The next item of a stream, failing the test if none comes in time.
pub async fn next<S>(stream: &mut S) -> S::Item
where
    S: Stream + Unpin,
{
    match tokio::time::timeout(WAIT, stream.next()).await {
        Ok(Some(item)) => item,
        Ok(None) => panic!("stream ended"),
        Err(_) => panic!("no stream item within {WAIT:?}"),
    }
}

/// Poll a condition until it holds, failing the test after [`WAIT`].
pub async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !condition().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until `count` watch streams are open on the server.
pub async fn watching(server: &TestApiServer, count: usize) {
    eventually(&format!("{count} open watches"), || async { server.open_watches() >= count }).await;
}

/// name → resourceVersion of what a reflector holds.
pub fn reflected<K>(store: &Store<K>) -> BTreeMap<String, String>
where
    K: kube::Resource<DynamicType = ()> + Clone + Debug + 'static,
{
    store.state().iter().map(|o| (o.name_any(), o.resource_version().unwrap_or_default())).collect()
}

/// name → resourceVersion of what the server holds.
pub fn stored(server: &TestApiServer) -> BTreeMap<String, String> {
    server.list::<Service>().iter().map(|o| (o.name_any(), o.resource_version().unwrap_or_default())).collect()
}

pub fn labels_patch(labels: Value) -> Value {
    json!({ "metadata": { "labels": labels } })
}
