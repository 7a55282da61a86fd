//! `--role operator` through the whole host: embedded, the process leads and runs the
//! heartbeat and GC decided by the builtin GC guest (Wasm); against the test API server and
//! a real etcd, two replicas elect one leader on a Lease and the other takes over when the
//! leader stops.

mod support;

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use support::cluster::eventually;
use wasmplane::app::{HostConfig, KubernetesSource, KvstoreConfig, RunningHost, start};
use wasmplane::operator_role::OperatorRoleConfig;
use wasmplane_kvstore::{Bytes, KvStore};
use wasmplane_operator::{HEARTBEAT_KEY, LOCKS_PREFIX};
use wasmplane_test_apiserver::TestApiServer;
use wasmplane_test_etcd::Etcd;

async fn operator_state(host: &RunningHost) -> Value {
    reqwest::get(format!("{}/v1/operator", host.url())).await.unwrap().json().await.unwrap()
}

fn fast(identity: &str) -> OperatorRoleConfig {
    OperatorRoleConfig {
        identity: identity.into(),
        lease_duration: Duration::from_secs(2),
        heartbeat_interval: Duration::from_millis(200),
        gc_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_operator_leads_writes_the_heartbeat_and_collects_what_the_gc_guest_names() {
    let dir = tempfile::tempdir().unwrap();
    let host = start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(dir.path().into()),
        token: Some("operator-test-token-0123456789".into()),
        operator: Some(fast("solo")),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(operator_state(&host).await["leader"], true);
    // The operator role registers no node: it is not one.
    let (status, _) = (reqwest::get(format!("{}/v1/cluster/nodes", host.url())).await.unwrap().status(), ());
    assert_eq!(status, StatusCode::NOT_FOUND);

    let kv = host.modules.store().kv().clone();
    let _ = eventually(
        "the heartbeat",
        Duration::from_secs(20),
        || kv.get(HEARTBEAT_KEY),
        |hb| hb.as_ref().is_ok_and(|v| v.as_ref().is_some_and(|v| String::from_utf8_lossy(&v.value).contains("solo"))),
    )
    .await;

    // Two locks: one whose holder is no registered node and which has no lease (the guest
    // names it at once), one held under a live lease (kept).
    let orphan = format!("{LOCKS_PREFIX}orphaned");
    let held = format!("{LOCKS_PREFIX}held");
    kv.put(&orphan, Bytes::from_static(b"node-that-is-gone"), None).await.unwrap();
    let lease = kv.grant_lease(Duration::from_secs(60)).await.unwrap();
    kv.put(&held, Bytes::from_static(b"node-that-is-gone"), Some(lease.id)).await.unwrap();
    let _ = eventually(
        "the orphaned lock collected",
        Duration::from_secs(20),
        || kv.get(&orphan),
        |v| matches!(v, Ok(None)),
    )
    .await;
    assert!(kv.get(&held).await.unwrap().is_some(), "a lock under a live lease is never named");
    host.stop().await;
}

async fn replica(dir: &std::path::Path, identity: &str, server: &TestApiServer, etcd: &Etcd) -> RunningHost {
    start(HostConfig {
        kvstore: KvstoreConfig::etcd(vec![etcd.endpoint()]),
        kubernetes: Some(KubernetesSource::Url(server.url())),
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(dir.join(identity)),
        token: Some("operator-test-token-0123456789".into()),
        operator: Some(fast(identity)),
        ..Default::default()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_elect_one_leader_and_the_other_takes_over() {
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let server = TestApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let a = replica(dir.path(), "operator-a", &server, &etcd).await;
    let b = replica(dir.path(), "operator-b", &server, &etcd).await;
    let leaders = || async { (operator_state(&a).await["leader"] == true, operator_state(&b).await["leader"] == true) };
    let (a_leads, b_leads) = eventually("one leader", Duration::from_secs(10), leaders, |(a, b)| a != b).await;
    // Exactly one, and it stays one for a while (no flapping, never both).
    for _ in 0..10 {
        assert_eq!(leaders().await, (a_leads, b_leads), "leadership changed without a reason");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Two agents' realization of one policy, aggregated by the leader and served by it.
    let mut np = k8s_openapi::api::networking::v1::NetworkPolicy::default();
    np.metadata.name = Some("web".into());
    np.metadata.namespace = Some("shop".into());
    let uid = server.create(&np).unwrap().metadata.uid.unwrap();
    let kv: std::sync::Arc<dyn KvStore> = KvstoreConfig::etcd(vec![etcd.endpoint()]).open(None).await.unwrap();
    for (node, status) in [("node-1", r#"{"generation":1}"#), ("node-2", r#"{"generation":1,"error":"guest trapped"}"#)]
    {
        kv.put(
            &format!("/wasmplane/policystatus/{uid}/shop/web/{node}"),
            Bytes::copy_from_slice(status.as_bytes()),
            None,
        )
        .await
        .unwrap();
    }
    let leader_host = if a_leads { &a } else { &b };
    let summary = eventually(
        "the leader's summary",
        Duration::from_secs(10),
        || async {
            let r = reqwest::get(format!("{}/v1/policies/shop/web/status", leader_host.url())).await.unwrap();
            if r.status() == StatusCode::OK { r.json::<Value>().await.unwrap() } else { Value::Null }
        },
        |s| !s.is_null(),
    )
    .await;
    let text = summary.to_string();
    assert!(text.contains("node-2") && text.contains("guest trapped"), "the failing node is named: {summary}");

    let (leader, follower) = if a_leads { (a, b) } else { (b, a) };
    let follower_identity = if a_leads { "operator-b" } else { "operator-a" };
    let leader_identity = if a_leads { "operator-a" } else { "operator-b" };
    leader.stop().await;
    // The leader gave its Lease up as it stopped (a rolling update's SIGTERM): the follower
    // need not wait for it to expire.
    let leases = server.list::<k8s_openapi::api::coordination::v1::Lease>();
    assert_eq!(leases.len(), 1, "one Lease: {leases:?}");
    let holder = leases[0].spec.as_ref().and_then(|s| s.holder_identity.clone());
    assert_ne!(holder.as_deref(), Some(leader_identity), "released on stop: {:?}", leases[0].spec);
    // The follower takes over within about one lease duration (2 s) and writes the heartbeat.
    eventually("the follower leads", Duration::from_secs(20), || operator_state(&follower), |s| s["leader"] == true)
        .await;
    let _ = eventually(
        "the new leader's heartbeat",
        Duration::from_secs(20),
        || kv.get(HEARTBEAT_KEY),
        |hb| {
            hb.as_ref().is_ok_and(|v| {
                v.as_ref().is_some_and(|v| String::from_utf8_lossy(&v.value).contains(follower_identity))
            })
        },
    )
    .await;
    follower.stop().await;
}

/// The GC guest is checked like translators and policies: where signatures are required, a
/// GC module put in force without one (by anyone who can write the index) is not run, and
/// nothing is collected until the version carries a trusted signature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsigned_gc_module_in_the_index_is_not_run_where_signatures_are_required() {
    use wasmplane::admission;
    use wasmplane_runtime::{GuestKind, LoadedModule, ModuleInfo};
    let dir = tempfile::tempdir().unwrap();
    let (private, public) = admission::generate_key_pair().unwrap();
    let (private_path, public_path) = (dir.path().join("key"), dir.path().join("key.pub"));
    std::fs::write(&private_path, private).unwrap();
    std::fs::write(&public_path, public).unwrap();
    let host = start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(dir.path().join("data")),
        token: Some("operator-test-token-0123456789".into()),
        operator: Some(fast("solo")),
        trusted_keys: vec![public_path],
        ..Default::default()
    })
    .await
    .unwrap();
    let (store, kv) = (host.modules.store(), host.modules.store().kv().clone());
    // The builtin GC guest's own bytes under another name: it would collect the orphan.
    let bytes = wasmplane_guest_artifacts::GC;
    let info = ModuleInfo {
        digest: LoadedModule::digest_of(bytes),
        kind: GuestKind::Gc,
        interface: None,
        wit_version: "1.0.0".into(),
        size: bytes.len(),
        imports: vec![],
    };
    store.put_blob(&info.digest, bytes).await.unwrap();
    let publish = |signature: Option<String>| {
        let info = info.clone();
        async move {
            let (mut index, revision) = store.load().await.unwrap();
            index.add_version("written-to-etcd", GuestKind::Gc, &info, signature.as_deref()).unwrap();
            index.activate("written-to-etcd", Some(1)).unwrap();
            assert!(store.publish(revision, &index).await.unwrap().is_some());
        }
    };
    publish(None).await;
    let orphan = format!("{LOCKS_PREFIX}orphaned");
    kv.put(&orphan, Bytes::from_static(b"node-that-is-gone"), None).await.unwrap();
    // Seven GC intervals: the builtin would have collected it in the first.
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert!(kv.get(&orphan).await.unwrap().is_some(), "an unsigned GC module decided");

    let key = admission::read_private_key(&private_path).unwrap();
    publish(Some(admission::sign(&key, bytes))).await;
    let _ = eventually(
        "the orphaned lock collected by the signed module",
        Duration::from_secs(20),
        || kv.get(&orphan),
        |v| matches!(v, Ok(None)),
    )
    .await;
    host.stop().await;
}

/// `--clustermesh-sync-endpoint-slices`: the leader writes EndpointSlices of a remote
/// cluster's endpoints for this cluster's headless global Service (what DNS answers from),
/// following the remote cluster in its own etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_writes_slices_of_a_remote_clusters_endpoints_for_a_headless_global_service() {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let (etcd, east) =
        (Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)"), Etcd::start().await.unwrap());
    let server = TestApiServer::start().await;
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "db", "name": "pg", "annotations": {"wasmplane.io/global": "true"}},
        "spec": {"clusterIP": "None", "ports": [{"name": "sql", "port": 5432}]}
    }))
    .unwrap();
    server.create(&service).unwrap();
    let export = serde_json::json!({"cluster": "east", "namespace": "db", "name": "pg", "clusterIps": [], "ports": [{"name": "sql", "port": 5432, "protocol": "TCP"}],
        "endpointSlices": [{"ports": [{"name": "sql", "port": 5432, "protocol": "TCP"}], "addresses": ["10.245.0.7"], "hostnames": {"10.245.0.7": "pg-0"}}]});
    let east_kv = KvstoreConfig::etcd(vec![east.endpoint()]).open(None).await.unwrap();
    east_kv
        .put(&format!("{}east/services/db/pg", wasmplane_operator::CLUSTERS_PREFIX), export.to_string().into(), None)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mesh = wasmplane::clustermesh::ClusterMeshConfig {
        remotes: vec![wasmplane::clustermesh::RemoteEtcd {
            cluster: "east".into(),
            endpoints: vec![east.endpoint()],
            tls: None,
            user: None,
        }],
        ..Default::default()
    };
    let host = start(HostConfig {
        kvstore: KvstoreConfig::etcd(vec![etcd.endpoint()]),
        kubernetes: Some(KubernetesSource::Url(server.url())),
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(dir.path().into()),
        token: Some("operator-test-token-0123456789".into()),
        operator: Some(OperatorRoleConfig {
            cluster_name: Some("west".into()),
            mesh_slices: Some(mesh),
            ..fast("operator-a")
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    let slices = || async {
        server
            .list::<EndpointSlice>()
            .into_iter()
            .filter(|s| wasmplane_operator::is_mesh_slice(s.metadata.labels.as_ref()))
            .collect::<Vec<_>>()
    };
    let written =
        eventually("east's endpoints as a slice of db/pg", Duration::from_secs(15), slices, |s| s.len() == 1).await;
    let endpoint = &written[0].endpoints[0];
    assert_eq!((endpoint.addresses[0].as_str(), endpoint.hostname.as_deref()), ("10.245.0.7", Some("pg-0")));
    // East's export goes: so does the slice.
    east_kv.delete(&format!("{}east/services/db/pg", wasmplane_operator::CLUSTERS_PREFIX)).await.unwrap();
    eventually("the slice gone with the export", Duration::from_secs(15), slices, |s| s.is_empty()).await;
    host.stop().await;
}

/// The builtin GC guest takes its grace periods from its settings, checked by its own
/// validator where they are set; an uploaded GC module is checked with its settings where it
/// is put in force, and settings that reach the index another way decide nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_settings_are_checked_where_set_and_tune_the_grace_periods() {
    use wasmplane_runtime::{GuestKind, LoadedModule, ModuleInfo};
    let dir = tempfile::tempdir().unwrap();
    let token = "operator-test-token-0123456789";
    let host = start(HostConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(dir.path().into()),
        token: Some(token.into()),
        operator: Some(fast("solo")),
        ..Default::default()
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let put_settings = |name: &str, body: &str| {
        client
            .put(format!("{}/v1/modules/{name}/settings", host.url()))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    // The builtin GC guest is listed like the other builtins, in force (nothing else is).
    let module = |name: &str| {
        let url = format!("{}/v1/modules/{name}", host.url());
        async move { reqwest::get(url).await.unwrap().json::<Value>().await.unwrap() }
    };
    let listed: Value = reqwest::get(format!("{}/v1/modules", host.url())).await.unwrap().json().await.unwrap();
    let names: Vec<&str> = listed["modules"].as_array().unwrap().iter().filter_map(|m| m["name"].as_str()).collect();
    assert!(names.contains(&"default-gc"), "{listed}");
    let builtin = module("default-gc").await;
    assert_eq!(
        (builtin["kind"].as_str(), builtin["builtin"].as_bool(), builtin["status"].as_str()),
        (Some("gc"), Some(true), Some("active")),
        "{builtin}"
    );
    assert_eq!(
        builtin["versions"][0]["digest"].as_str(),
        Some(wasmplane_runtime::LoadedModule::digest_of(wasmplane_guest_artifacts::GC).as_str())
    );
    let refused = put_settings("default-gc", r#"{"graceSeconds": {"nodes": 60}}"#).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let reason = refused.text().await.unwrap();
    assert!(reason.contains("unknown variant `nodes`"), "the guest's reason: {reason}");

    // A lock held under a live lease is kept by default; an hour-long limit cut to 1 s
    // collects it.
    let kv = host.modules.store().kv().clone();
    let held = format!("{LOCKS_PREFIX}held");
    let lease = kv.grant_lease(Duration::from_secs(60)).await.unwrap();
    kv.put(&held, Bytes::from_static(b"node-that-is-gone"), Some(lease.id)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert!(kv.get(&held).await.unwrap().is_some(), "kept under the default limit");
    assert!(put_settings("default-gc", r#"{"lockHardLimitSeconds": 1}"#).await.unwrap().status().is_success());
    let _ = eventually(
        "the held lock collected past the new limit",
        Duration::from_secs(20),
        || kv.get(&held),
        |v| matches!(v, Ok(None)),
    )
    .await;

    // The same guest uploaded as another module, with settings it refuses written straight
    // into the index (as anyone who can write etcd could): activating it here is refused, and
    // put in force the same way, it decides nothing.
    let store = host.modules.store();
    let bytes = wasmplane_guest_artifacts::GC;
    let info = ModuleInfo {
        digest: LoadedModule::digest_of(bytes),
        kind: GuestKind::Gc,
        interface: None,
        wit_version: "1.0.0".into(),
        size: bytes.len(),
        imports: vec![],
    };
    store.put_blob(&info.digest, bytes).await.unwrap();
    let (mut index, revision) = store.load().await.unwrap();
    index.add_version("tuned-gc", GuestKind::Gc, &info, None).unwrap();
    index.set_settings("tuned-gc", Some(serde_json::json!({"grace": 1})));
    assert!(store.publish(revision, &index).await.unwrap().is_some());
    let activated =
        client.post(format!("{}/v1/modules/tuned-gc/activate", host.url())).bearer_auth(token).send().await.unwrap();
    assert_eq!(activated.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(activated.text().await.unwrap().contains("unknown field `grace`"));
    let (mut index, revision) = store.load().await.unwrap();
    index.activate("tuned-gc", Some(1)).unwrap();
    assert!(store.publish(revision, &index).await.unwrap().is_some());
    let _ = eventually(
        "the uploaded GC module in force",
        Duration::from_secs(20),
        || module("tuned-gc"),
        |m| m["status"] == "active",
    )
    .await;
    assert_eq!(module("default-gc").await["status"], "inactive");
    let orphan = format!("{LOCKS_PREFIX}orphaned");
    kv.put(&orphan, Bytes::from_static(b"node-that-is-gone"), None).await.unwrap();
    // Seven GC intervals: with settings it accepts, the guest collects it in the first.
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert!(kv.get(&orphan).await.unwrap().is_some(), "a GC module refusing its settings decided");
    // The operator says why GC stopped: the host refused the module's settings through its
    // validator before the guest was asked anything (the guest's own refusal reads otherwise).
    // Waited for, not assumed after the sleep above: a loaded machine can delay a cycle.
    let refused = |s: &Value| {
        s["gc"]["last_error"].as_str().is_some_and(|e| e.contains("GC module tuned-gc@1 refuses its settings"))
    };
    let gc = eventually("the refused settings reported", Duration::from_secs(20), || operator_state(&host), refused)
        .await["gc"]
        .clone();
    let error = gc["last_error"].as_str().unwrap_or_default();
    assert!(
        error.contains("GC module tuned-gc@1 refuses its settings") && error.contains("unknown field `grace`"),
        "{gc}"
    );
    assert!(gc["failed_cycles"].as_u64() >= Some(1) && gc["deleted"]["lock"].as_u64() >= Some(1), "{gc}");
    let metrics = reqwest::get(format!("{}/metrics", host.url())).await.unwrap().text().await.unwrap();
    for line in [
        "wasmplane_gc_cycles_total{result=\"failed\"}",
        "wasmplane_gc_deleted_total{kind=\"lock\"}",
        "wasmplane_gc_last_success_timestamp_seconds",
    ] {
        assert!(metrics.contains(line), "{line} in /metrics:\n{metrics}");
    }
    host.stop().await;
}
