//! Mesh EndpointSlices through kube's real watchers and writes, on the test API server: a
//! remote cluster's exports, followed in its own (real) etcd, become slices of the local
//! headless global Service, with hostnames; they follow the exports, come back when deleted
//! by hand, and go with the annotation or the remote cluster; other slices are never touched.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use wasmplane_kvstore::{EtcdConfig, EtcdStore, KvStore, SharedStore, SharedStoreConfig};
use wasmplane_operator::{
    CLUSTERS_PREFIX, GLOBAL_SERVICE_ANNOTATION, MeshSliceConfig, RemoteExports, cluster_exports_prefix,
    follow_cluster_exports, is_mesh_slice, sync_mesh_slices,
};
use wasmplane_test_apiserver::TestApiServer;
use wasmplane_test_etcd::Etcd;

fn headless(name: &str, global: bool) -> Service {
    let mut svc = Service {
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            ports: Some(vec![ServicePort { name: Some("sql".into()), port: 5432, ..Default::default() }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    svc.metadata.name = Some(name.into());
    svc.metadata.namespace = Some("db".into());
    if global {
        svc.metadata.annotations = Some([(GLOBAL_SERVICE_ANNOTATION.to_string(), "true".to_string())].into());
    }
    svc
}

fn export(addresses: &[(&str, &str)]) -> String {
    serde_json::json!({
        "cluster": "east", "namespace": "db", "name": "pg", "clusterIps": [], "ports": [{"name": "sql", "port": 5432, "protocol": "TCP"}],
        "endpointSlices": [{
            "ports": [{"name": "sql", "port": 5432, "protocol": "TCP"}],
            "addresses": addresses.iter().map(|(a, _)| a).collect::<Vec<_>>(),
            "hostnames": addresses.iter().map(|(a, h)| (a.to_string(), h.to_string())).collect::<std::collections::BTreeMap<_, _>>(),
        }]
    })
    .to_string()
}

/// An endpoint's address and hostname.
type Named = (String, Option<String>);

/// The mesh slices the API server holds: name → (address, hostname) of each endpoint.
fn mesh_slices(server: &TestApiServer) -> Vec<(String, Vec<Named>)> {
    let endpoints = |e: &Vec<Endpoint>| e.iter().map(|e| (e.addresses[0].clone(), e.hostname.clone())).collect();
    server
        .list::<EndpointSlice>()
        .iter()
        .filter(|s| is_mesh_slice(s.metadata.labels.as_ref()))
        .map(|s| (s.metadata.name.clone().unwrap(), endpoints(&s.endpoints)))
        .collect()
}

async fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !ok() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_clusters_exports_become_slices_of_the_local_headless_global_service() {
    let server = TestApiServer::start().await;
    let east = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let east_kv: Arc<dyn KvStore> = Arc::new(EtcdStore::connect(EtcdConfig::new([east.endpoint()])).await.unwrap());
    let key = format!("{CLUSTERS_PREFIX}east/services/db/pg");
    east_kv.put(&key, export(&[("10.245.0.7", "pg-0"), ("10.245.0.8", "pg-1")]).into(), None).await.unwrap();
    server.create(&headless("pg", true)).unwrap();
    // A slice of the EndpointSlice controller's, of the same Service: never touched.
    let mut own: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "db", "name": "pg-abcde", "labels": {"kubernetes.io/service-name": "pg", "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["10.244.0.5"], "hostname": "pg-2"}]
    }))
    .unwrap();
    own = server.create(&own).unwrap();

    let (exports, received) = RemoteExports::new();
    let followed =
        SharedStore::follow(east_kv.clone(), SharedStoreConfig::new(cluster_exports_prefix(CLUSTERS_PREFIX, "east")))
            .await
            .unwrap();
    let follower = tokio::spawn(follow_cluster_exports(followed, "east".into(), exports.clone()));
    let config = MeshSliceConfig { resync_interval: Duration::from_millis(500), ..MeshSliceConfig::new(received) };
    let sync = tokio::spawn(sync_mesh_slices(server.client(), config));

    let first = || {
        vec![(
            "pg-east-0".to_string(),
            vec![
                ("10.245.0.7".to_string(), Some("pg-0".to_string())),
                ("10.245.0.8".to_string(), Some("pg-1".to_string())),
            ],
        )]
    };
    until("east's endpoints as a slice of db/pg", || mesh_slices(&server) == first()).await;
    let slice = server.get::<EndpointSlice>("db", "pg-east-0").unwrap();
    let labels = slice.metadata.labels.as_ref().unwrap();
    assert_eq!(
        (labels["kubernetes.io/service-name"].as_str(), labels["wasmplane.io/cluster"].as_str()),
        ("pg", "east")
    );
    assert!(labels.contains_key("service.kubernetes.io/headless"), "proxies skip it, as the Service's own slices");
    let uid = server.get::<Service>("db", "pg").unwrap().metadata.uid;
    assert_eq!(slice.metadata.owner_references.as_ref().unwrap()[0].uid, uid.unwrap(), "deleted with its Service");

    // East's export changes: the slice follows.
    east_kv.put(&key, export(&[("10.245.0.8", "pg-1"), ("10.245.0.9", "pg-3")]).into(), None).await.unwrap();
    let second = || {
        vec![(
            "pg-east-0".to_string(),
            vec![
                ("10.245.0.8".to_string(), Some("pg-1".to_string())),
                ("10.245.0.9".to_string(), Some("pg-3".to_string())),
            ],
        )]
    };
    until("the slice following east's export", || mesh_slices(&server) == second()).await;

    // Deleted by hand: written again.
    server.delete::<EndpointSlice>("db", "pg-east-0").unwrap();
    until("the slice back", || mesh_slices(&server) == second()).await;

    // The Service is no longer global: its mesh slice goes. Global again: back.
    let mut local = headless("pg", false);
    local.metadata.resource_version = server.get::<Service>("db", "pg").unwrap().metadata.resource_version;
    server.update(&local).unwrap();
    until("the slice gone with the annotation", || mesh_slices(&server).is_empty()).await;
    let mut global = headless("pg", true);
    global.metadata.resource_version = server.get::<Service>("db", "pg").unwrap().metadata.resource_version;
    server.update(&global).unwrap();
    until("the slice back with the annotation", || mesh_slices(&server) == second()).await;

    // East is no longer followed: its slices go.
    follower.abort();
    exports.remove("east");
    until("the slice gone with east", || mesh_slices(&server).is_empty()).await;
    assert_eq!(
        server.get::<EndpointSlice>("db", "pg-abcde").unwrap().metadata.resource_version,
        own.metadata.resource_version,
        "the controller's own slice untouched"
    );
    assert!(!sync.is_finished(), "the sync runs on");
    sync.abort();
}
