//! Patches (apply, merge, JSON, strategic), status subresources, optimistic concurrency:
//! what leader election and status writers rely on.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use wasmplane_test_apiserver::{TestApiServer, Verb};

use crate::common::{init_tracing, service};

fn lease_apply(holder: &str, renew: &str) -> serde_json::Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": { "name": "wasmplane-operator" },
        "spec": { "holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renew },
    })
}

#[tokio::test]
async fn lease_apply_merge_and_replace() {
    init_tracing();
    let server = TestApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(server.client(), "kube-system");
    let apply = PatchParams::apply("wasmplane").force();

    // Server-side apply creates what does not exist.
    let created = leases
        .patch("wasmplane-operator", &apply, &Patch::Apply(lease_apply("a", "2025-01-01T00:00:00.000000Z")))
        .await
        .unwrap();
    let spec = created.spec.as_ref().unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("a"));
    assert_eq!(created.namespace().as_deref(), Some("kube-system"));
    assert!(created.uid().is_some());

    // Apply again: an update of the same object.
    let renewed = leases
        .patch("wasmplane-operator", &apply, &Patch::Apply(lease_apply("a", "2025-01-01T00:00:05.000000Z")))
        .await
        .unwrap();
    assert_eq!(renewed.uid(), created.uid());
    assert!(renewed.resource_version() != created.resource_version());

    // Merge patch, with a resourceVersion precondition: current works, stale is 409.
    let take_over = json!({
        "metadata": { "resourceVersion": renewed.resource_version() },
        "spec": { "holderIdentity": "b", "leaseTransitions": 1 },
    });
    let taken = leases.patch("wasmplane-operator", &PatchParams::default(), &Patch::Merge(&take_over)).await.unwrap();
    assert_eq!(taken.spec.as_ref().unwrap().holder_identity.as_deref(), Some("b"));
    assert_eq!(taken.spec.as_ref().unwrap().lease_duration_seconds, Some(15), "merge keeps other fields");
    let err = leases.patch("wasmplane-operator", &PatchParams::default(), &Patch::Merge(&take_over)).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.is_conflict()), "{err:?}");

    // Replace: current version works, the same (now stale) version conflicts.
    let mut mine = leases.get("wasmplane-operator").await.unwrap();
    mine.spec.as_mut().unwrap().holder_identity = Some("c".into());
    let replaced = leases.replace("wasmplane-operator", &PostParams::default(), &mine).await.unwrap();
    assert_eq!(replaced.spec.as_ref().unwrap().holder_identity.as_deref(), Some("c"));
    let err = leases.replace("wasmplane-operator", &PostParams::default(), &mine).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.is_conflict() && s.code == 409), "{err:?}");

    // JSON patch (kube's `Patch::Json` needs a feature the workspace does not enable, so
    // this one goes through `Client::request`), with a test operation as an optimistic lock.
    let json_patch = || {
        let ops = json!([
            { "op": "test", "path": "/spec/holderIdentity", "value": "c" },
            { "op": "replace", "path": "/spec/holderIdentity", "value": "d" },
        ]);
        axum::http::Request::patch("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/wasmplane-operator")
            .header("content-type", "application/json-patch+json")
            .body(serde_json::to_vec(&ops).unwrap())
            .unwrap()
    };
    let client = server.client();
    let patched: Lease = client.request(json_patch()).await.unwrap();
    assert_eq!(patched.spec.as_ref().unwrap().holder_identity.as_deref(), Some("d"));
    let err = client.request::<Lease>(json_patch()).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 422), "{err:?}");

    assert_eq!(server.request_count::<Lease>(Verb::Patch), 6);
    assert_eq!(server.request_count::<Lease>(Verb::Update), 2);
    assert_eq!(
        server.get::<Lease>("kube-system", "wasmplane-operator").unwrap().resource_version(),
        patched.resource_version()
    );
}

#[tokio::test]
async fn status_subresource() {
    init_tracing();
    let server = TestApiServer::start().await;
    let services: Api<Service> = Api::namespaced(server.client(), "default");
    let created = services.create(&PostParams::default(), &service("default", "lb", &[])).await.unwrap();

    let status = json!({ "status": { "loadBalancer": { "ingress": [{ "ip": "192.0.2.1" }] } } });
    let with_status = services.patch_status("lb", &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    let ip = |s: &Service| {
        s.status
            .as_ref()
            .and_then(|st| st.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .and_then(|i| i[0].ip.clone())
    };
    assert_eq!(ip(&with_status).as_deref(), Some("192.0.2.1"));
    assert_eq!(with_status.metadata.generation, created.metadata.generation, "status is not spec");

    // A write to the main resource cannot change status...
    let mut main = with_status.clone();
    main.status = None;
    main.labels_mut().insert("x".into(), "y".into());
    let replaced = services.replace("lb", &PostParams::default(), &main).await.unwrap();
    assert_eq!(ip(&replaced).as_deref(), Some("192.0.2.1"));
    assert_eq!(replaced.labels().get("x").map(String::as_str), Some("y"));

    // ...and a write to /status cannot change anything else.
    let mut status_only = replaced.clone();
    status_only.labels_mut().clear();
    status_only.status = Some(Default::default());
    let replaced = services.replace_status("lb", &PostParams::default(), &status_only).await.unwrap();
    assert_eq!(replaced.labels().get("x").map(String::as_str), Some("y"));
    assert_eq!(ip(&replaced), None);

    // Strategic merge patches are accepted (as merge patches).
    let strategic = json!({ "metadata": { "labels": { "s": "t" } } });
    let patched = services.patch("lb", &PatchParams::default(), &Patch::Strategic(&strategic)).await.unwrap();
    assert_eq!(patched.labels().get("s").map(String::as_str), Some("t"));
}
