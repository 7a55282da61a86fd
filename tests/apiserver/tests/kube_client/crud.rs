//! Lists with selectors, get/create/replace/delete round trips and their errors,
//! discovery, outages.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Discovery, ResourceExt as _};
use serde_json::json;
use wasmplane_test_apiserver::{TestApiServer, Verb};

use crate::common::{init_tracing, node, service};

fn names<K: kube::Resource>(items: &[K]) -> Vec<String> {
    items.iter().map(|o| o.meta().name.clone().unwrap_or_default()).collect()
}

fn api_code(error: kube::Error) -> (u16, String) {
    match error {
        kube::Error::Api(status) => (status.code, status.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn list_with_label_and_field_selectors() {
    init_tracing();
    let server = TestApiServer::start().await;
    server.create(&service("default", "web", &[("app", "web"), ("tier", "front")])).unwrap();
    server.create(&service("default", "db", &[("app", "db")])).unwrap();
    server.create(&service("default", "plain", &[])).unwrap();
    server.create(&service("other", "elsewhere", &[("app", "web")])).unwrap();
    let services: Api<Service> = Api::namespaced(server.client(), "default");

    let select = |selector: &'static str| {
        let services = services.clone();
        async move {
            let list = services.list(&ListParams::default().labels(selector)).await.unwrap();
            assert!(list.metadata.resource_version.is_some());
            names(&list.items)
        }
    };
    assert_eq!(select("app=web").await, ["web"]);
    assert_eq!(select("app==web,tier=front").await, ["web"]);
    assert_eq!(select("app in (web, db)").await, ["db", "web"]);
    assert_eq!(select("app notin (web)").await, ["db", "plain"]);
    assert_eq!(select("app!=db").await, ["plain", "web"]);
    assert_eq!(select("app").await, ["db", "web"]);
    assert_eq!(select("!app").await, ["plain"]);
    assert_eq!(select("").await, ["db", "plain", "web"]);

    let by_name = services.list(&ListParams::default().fields("metadata.name=db")).await.unwrap();
    assert_eq!(names(&by_name.items), ["db"]);
    let not_name = services.list(&ListParams::default().fields("metadata.name!=db")).await.unwrap();
    assert_eq!(names(&not_name.items), ["plain", "web"]);

    let everywhere: Api<Service> = Api::all(server.client());
    let all = everywhere.list(&ListParams::default().labels("app=web")).await.unwrap();
    assert_eq!(names(&all.items), ["web", "elsewhere"]);
    let other_ns = everywhere.list(&ListParams::default().fields("metadata.namespace=other")).await.unwrap();
    assert_eq!(names(&other_ns.items), ["elsewhere"]);

    // Every item carries its version; the list's version is the global one.
    let list = everywhere.list(&ListParams::default()).await.unwrap();
    assert!(list.items.iter().all(|s| s.resource_version().is_some()));
    assert_eq!(list.metadata.resource_version.unwrap(), server.current_resource_version().to_string());

    // A bad selector is a 400 Status, not a hang or a 500.
    let (code, reason) = api_code(services.list(&ListParams::default().labels("app in web")).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (400, "BadRequest"));
}

#[tokio::test]
async fn pods_by_node_name() {
    let server = TestApiServer::start().await;
    for (name, node) in [("a", "n1"), ("b", "n2"), ("c", "n1")] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "nodeName": node, "containers": [{ "name": "c", "image": "i" }] },
            "status": { "podIP": "10.1.0.1" },
        }))
        .unwrap();
        server.create(&pod).unwrap();
    }
    let pods: Api<Pod> = Api::all(server.client());
    let on_n1 = pods.list(&ListParams::default().fields("spec.nodeName=n1")).await.unwrap();
    assert_eq!(names(&on_n1.items), ["a", "c"]);
    // Test-control writes keep status, so tests can seed pod IPs.
    assert_eq!(on_n1.items[0].status.as_ref().unwrap().pod_ip.as_deref(), Some("10.1.0.1"));
}

#[tokio::test]
async fn create_get_replace_delete_round_trip() {
    init_tracing();
    let server = TestApiServer::start().await;
    let services: Api<Service> = Api::namespaced(server.client(), "default");

    let created = services.create(&PostParams::default(), &service("default", "web", &[])).await.unwrap();
    let meta = &created.metadata;
    assert_eq!(meta.namespace.as_deref(), Some("default"));
    assert!(meta.uid.is_some() && meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    let rv1: u64 = meta.resource_version.as_deref().unwrap().parse().unwrap();

    // Create again: 409 AlreadyExists.
    let err = services.create(&PostParams::default(), &service("default", "web", &[])).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.is_already_exists()), "{err:?}");
    assert_eq!(api_code(err).0, 409);

    // Get, get_opt on a missing name, 404.
    assert_eq!(services.get("web").await.unwrap().uid(), created.uid());
    assert!(services.get_opt("missing").await.unwrap().is_none());
    let err = services.get("missing").await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.is_not_found()), "{err:?}");

    // Replace with the current version: a new version, a new generation for a spec change.
    let mut changed = created.clone();
    changed.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.99".into());
    let replaced = services.replace("web", &PostParams::default(), &changed).await.unwrap();
    let rv2: u64 = replaced.resource_version().unwrap().parse().unwrap();
    assert!(rv2 > rv1);
    assert_eq!(replaced.metadata.generation, Some(2));
    assert_eq!(replaced.uid(), created.uid());

    // Replace with the stale version: 409 Conflict.
    let err = services.replace("web", &PostParams::default(), &changed).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.is_conflict()), "{err:?}");

    // Replace of a missing object: 404.
    let mut ghost = service("default", "ghost", &[]);
    ghost.metadata.resource_version = Some("1".into());
    let err = services.replace("ghost", &PostParams::default(), &ghost).await.unwrap_err();
    assert_eq!(api_code(err).0, 404);

    // Delete returns the object; a second delete is 404.
    let deleted = services.delete("web", &DeleteParams::default()).await.unwrap();
    assert_eq!(deleted.left().map(|s| s.name_any()).as_deref(), Some("web"));
    let err = services.delete("web", &DeleteParams::default()).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.is_not_found()), "{err:?}");
    assert!(server.get::<Service>("default", "web").is_none());

    // Delete preconditions are honoured.
    let again = services.create(&PostParams::default(), &service("default", "web", &[])).await.unwrap();
    let stale = DeleteParams {
        preconditions: Some(kube::api::Preconditions { resource_version: Some("1".into()), uid: None }),
        ..Default::default()
    };
    assert_eq!(api_code(services.delete("web", &stale).await.unwrap_err()).0, 409);
    let current = DeleteParams {
        preconditions: Some(kube::api::Preconditions { resource_version: again.resource_version(), uid: again.uid() }),
        ..Default::default()
    };
    services.delete("web", &current).await.unwrap();

    // Cluster-scoped kinds live outside namespaces.
    let nodes: Api<Node> = Api::all(server.client());
    nodes.create(&PostParams::default(), &node("n1")).await.unwrap();
    assert_eq!(nodes.get("n1").await.unwrap().metadata.namespace, None);
    assert_eq!(server.list::<Node>().len(), 1);

    assert_eq!(server.request_count::<Service>(Verb::Create), 3);
    assert_eq!(server.request_count::<Service>(Verb::Delete), 4);
    assert_eq!(server.request_count::<Node>(Verb::Create), 1);
}

#[tokio::test]
async fn generate_name_and_finalizers() {
    let server = TestApiServer::start().await;
    let services: Api<Service> = Api::namespaced(server.client(), "default");
    let mut generated = service("default", "", &[]);
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("web-".into());
    let created = services.create(&PostParams::default(), &generated).await.unwrap();
    assert!(created.name_any().starts_with("web-") && created.name_any().len() == 9, "{}", created.name_any());

    let mut guarded = service("default", "guarded", &[]);
    guarded.metadata.finalizers = Some(vec!["example.com/keep".into()]);
    services.create(&PostParams::default(), &guarded).await.unwrap();
    let pending = services.delete("guarded", &DeleteParams::default()).await.unwrap();
    let marked = pending.left().expect("pending deletion returns the object");
    assert!(marked.metadata.deletion_timestamp.is_some());
    let patch = json!({ "metadata": { "finalizers": null } });
    services.patch("guarded", &Default::default(), &kube::api::Patch::Merge(&patch)).await.unwrap();
    assert!(services.get_opt("guarded").await.unwrap().is_none());
}

#[tokio::test]
async fn discovery_and_version() {
    let server = TestApiServer::start().await;
    let client = server.client();
    let version = client.apiserver_version().await.unwrap();
    assert_eq!((version.major.as_str(), version.minor.as_str()), ("1", "33"));
    let discovery = Discovery::new(client).run().await.unwrap();
    for group in ["", "coordination.k8s.io", "discovery.k8s.io", "networking.k8s.io"] {
        assert!(discovery.has_group(group), "group {group:?} not discovered");
    }
    let (lease, caps) = discovery
        .groups()
        .flat_map(|g| g.recommended_resources())
        .find(|(r, _)| r.kind == "Lease")
        .expect("Lease discovered");
    assert_eq!(lease.plural, "leases");
    assert_eq!(caps.scope, kube::discovery::Scope::Namespaced);
}

#[tokio::test]
async fn outage_gives_503_and_clients_recover() {
    init_tracing();
    let server = TestApiServer::start().await;
    server.create(&service("default", "web", &[])).unwrap();
    server.set_unavailable(true);

    // Without kube's retry layer the 503 Status is visible.
    let mut config = server.config();
    config.default_retry = false;
    let no_retry: Api<Service> = Api::namespaced(kube::Client::try_from(config).unwrap(), "default");
    let (code, reason) = api_code(no_retry.list(&ListParams::default()).await.unwrap_err());
    assert_eq!((code, reason.as_str()), (503, "ServiceUnavailable"));

    // With it (kube's default) a request spanning a short outage succeeds.
    let services: Api<Service> = Api::namespaced(server.client(), "default");
    let pending = tokio::spawn(async move { services.list(&ListParams::default()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.set_unavailable(false);
    let list = pending.await.unwrap().unwrap();
    assert_eq!(names(&list.items), ["web"]);
}

#[tokio::test]
async fn stops_when_dropped() {
    let server = TestApiServer::start().await;
    let clone = server.clone();
    let addr = server.addr();
    drop(server);
    // A clone keeps it alive.
    assert!(tokio::net::TcpStream::connect(addr).await.is_ok());
    drop(clone);
    let mut refused = false;
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused, "still listening after the last handle was dropped");
}
