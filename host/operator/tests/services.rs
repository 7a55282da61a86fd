//! Service sync from the test API server (kube's real watcher) into the kvstore:
//! only annotated Services, changes followed, and stale entries removed after
//! the operator was down; other clusters' keys never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use tokio::time::Instant;
use wasmplane_kvstore::{Bytes, EmbeddedStore, KvStore};
use wasmplane_operator::{
    Leadership, SHARED_SERVICE_ANNOTATION, ServiceSyncConfig, SharedService, sync_services,
};
use wasmplane_test_apiserver::TestApiServer;

fn service(name: &str, ip: &str, shared: bool) -> Service {
    let mut svc = Service {
        spec: Some(ServiceSpec {
            cluster_ip: Some(ip.into()),
            cluster_ips: Some(vec![ip.into()]),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    svc.metadata.name = Some(name.into());
    svc.metadata.namespace = Some("default".into());
    if shared {
        svc.metadata.annotations = Some(BTreeMap::from([(
            SHARED_SERVICE_ANNOTATION.to_owned(),
            "true".to_owned(),
        )]));
    }
    svc
}

fn start_sync(
    store: Arc<dyn KvStore>,
    server: &TestApiServer,
    config: ServiceSyncConfig,
) -> tokio::task::JoinHandle<()> {
    let client = server.client();
    tokio::spawn(async move {
        Leadership::always()
            .run_while_leading("service-sync", Duration::from_millis(200), move || {
                let (store, client, config) = (store.clone(), client.clone(), config.clone());
                async move {
                    if let Err(e) = sync_services(store, client, config).await {
                        tracing::warn!(error = %e, "service sync failed");
                    }
                }
            })
            .await
    })
}

async fn synced_names(store: &dyn KvStore, prefix: &str) -> BTreeSet<String> {
    let listing = store.list_prefix(prefix).await.unwrap();
    listing
        .items
        .iter()
        .map(|kv| kv.key.strip_prefix(prefix).unwrap().to_owned())
        .collect()
}

async fn eventually_names(store: &dyn KvStore, prefix: &str, expected: &[&str]) {
    let expected: BTreeSet<String> = expected.iter().map(|s| s.to_string()).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = synced_names(store, prefix).await;
        if now == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "synced services {now:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_services_are_synced_and_stale_ones_cleaned() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let server = TestApiServer::start().await;
    server
        .create(&service("svc-a", "10.96.0.10", true))
        .unwrap();
    server
        .create(&service("svc-b", "10.96.0.11", true))
        .unwrap();
    server
        .create(&service("svc-c", "10.96.0.12", false))
        .unwrap();

    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let config = ServiceSyncConfig::new("cluster-1");
    let prefix = config.services_prefix();
    // Left over from before: a deleted service of ours, and another cluster's.
    store
        .put(
            &format!("{prefix}default/gone"),
            Bytes::from_static(b"{}"),
            None,
        )
        .await
        .unwrap();
    let foreign = "/wasmplane/clusters/cluster-2/services/default/svc-a";
    store
        .put(foreign, Bytes::from_static(b"theirs"), None)
        .await
        .unwrap();

    let sync = start_sync(store.clone(), &server, config.clone());
    eventually_names(store.as_ref(), &prefix, &["default/svc-a", "default/svc-b"]).await;
    let value = store
        .get(&format!("{prefix}default/svc-a"))
        .await
        .unwrap()
        .unwrap()
        .value;
    let shared: SharedService = serde_json::from_slice(&value).unwrap();
    assert_eq!(shared.cluster, "cluster-1");
    assert_eq!(shared.cluster_ips, vec!["10.96.0.10".to_string()]);
    assert_eq!(shared.ports[0].port, 80);

    // Changes follow: unshare b, delete a, share c.
    server
        .patch::<Service>(
            "default",
            "svc-b",
            &serde_json::json!({"metadata": {"annotations": {SHARED_SERVICE_ANNOTATION: null}}}),
        )
        .unwrap();
    server.delete::<Service>("default", "svc-a").unwrap();
    server
        .patch::<Service>(
            "default",
            "svc-c",
            &serde_json::json!({"metadata": {"annotations": {SHARED_SERVICE_ANNOTATION: "true"}}}),
        )
        .unwrap();
    eventually_names(store.as_ref(), &prefix, &["default/svc-c"]).await;

    // The operator is down while things change; on return it cleans up.
    sync.abort();
    let _ = sync.await;
    server.delete::<Service>("default", "svc-c").unwrap();
    server
        .create(&service("svc-d", "10.96.0.13", true))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        synced_names(store.as_ref(), &prefix).await,
        BTreeSet::from(["default/svc-c".to_string()])
    );
    let sync = start_sync(store.clone(), &server, config);
    eventually_names(store.as_ref(), &prefix, &["default/svc-d"]).await;

    assert_eq!(
        store.get(foreign).await.unwrap().unwrap().value.as_ref(),
        b"theirs",
        "another cluster's key was touched"
    );
    sync.abort();
}
