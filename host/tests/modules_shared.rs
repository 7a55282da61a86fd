//! Modules are shared through the kvstore: two hosts on one real etcd (Debian's
//! `etcd-server`, started on loopback by the harness). What one host's REST API is told,
//! the other one does, through the watch.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use support::rest::{API_SERVICE, WEB_SERVICE, documents, node_config, upload_request};
use wasmplane::app::{RunningHost, start};
use wasmplane_guest_artifacts as artifacts;
use wasmplane_test_etcd::Etcd;

const TOKEN: &str = "shared-modules-token-0123456789";

async fn host(dir: &Path, node: &str, etcd: &Etcd) -> RunningHost {
    start(node_config(dir, node, etcd, TOKEN, "shop.yaml", &documents(&[WEB_SERVICE, API_SERVICE]))).await.unwrap()
}

async fn get_json(client: &reqwest::Client, host: &RunningHost, path: &str) -> Value {
    client.get(format!("{}{path}", host.url())).send().await.unwrap().json().await.unwrap()
}

/// The module (as `name@version`) in force on `host`, once it is `expected`.
async fn wait_for_translator(client: &reqwest::Client, host: &RunningHost, expected: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let dp = get_json(client, host, "/v1/dataplane?format=json").await;
        if dp["translator"] == expected {
            return dp;
        }
        assert!(Instant::now() < deadline, "{} never ran {expected}; last dataplane: {dp}", host.url());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_uploaded_to_one_host_is_active_on_the_other() {
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let a = host(dir.path(), "node-a", &etcd).await;
    let b = host(dir.path(), "node-b", &etcd).await;
    let client = reqwest::Client::new();
    wait_for_translator(&client, &b, "default-service-translator@1").await;

    // Upload (and activate) through A only.
    let r = upload_request(&client, &a.url(), "port-filter", "service-translator", artifacts::examples::PORT_FILTER_TRANSLATOR).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED, "{}", r.text().await.unwrap());

    // B fetched the bytes from etcd, compiled them and runs them on its own state: the
    // example filter keeps only services labelled wasmplane.io/expose.
    let dp = wait_for_translator(&client, &b, "port-filter@1").await;
    let objects = dp["objects"].as_object().unwrap();
    assert!(objects.contains_key("shop/api"), "{dp}");
    assert!(objects.get("shop/web").is_none_or(|web| web["chains"].as_object().is_none_or(|c| c.is_empty())), "{dp}");
    let module = get_json(&client, &b, "/v1/modules/port-filter").await;
    assert_eq!(module["status"], "active", "{module}");
    assert_eq!(module["versions"].as_array().unwrap().len(), 1);

    // A second version uploaded to B, then a rollback asked of A: both follow each time.
    let r = upload_request(&client, &b.url(), "port-filter", "service-translator", artifacts::SERVICE_TRANSLATOR).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    wait_for_translator(&client, &a, "port-filter@2").await;
    let r = client.post(format!("{}/v1/modules/port-filter/rollback", a.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    wait_for_translator(&client, &b, "port-filter@1").await;

    // Deleting it on B puts the builtin back in force on A.
    let r = client.delete(format!("{}/v1/modules/port-filter", b.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    wait_for_translator(&client, &a, "default-service-translator@1").await;
    let r = client.get(format!("{}/v1/modules/port-filter", a.url())).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_started_later_runs_what_the_cluster_has_in_force() {
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let a = host(dir.path(), "node-a", &etcd).await;
    let client = reqwest::Client::new();
    let r = upload_request(&client, &a.url(), "port-filter", "service-translator", artifacts::examples::PORT_FILTER_TRANSLATOR).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    // C joins afterwards with an empty data dir: it loads the module from etcd at start.
    let c = host(dir.path(), "node-c", &etcd).await;
    wait_for_translator(&client, &c, "port-filter@1").await;
    a.stop().await;
    c.stop().await;
}
