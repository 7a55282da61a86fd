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
    let r = upload_request(
        &client,
        &a.url(),
        "port-filter",
        "service-translator",
        artifacts::examples::PORT_FILTER_TRANSLATOR,
    )
    .bearer_auth(TOKEN)
    .send()
    .await
    .unwrap();
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
    let r = upload_request(&client, &b.url(), "port-filter", "service-translator", artifacts::SERVICE_TRANSLATOR)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    wait_for_translator(&client, &a, "port-filter@2").await;
    let r =
        client.post(format!("{}/v1/modules/port-filter/rollback", a.url())).bearer_auth(TOKEN).send().await.unwrap();
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
    let r = upload_request(
        &client,
        &a.url(),
        "port-filter",
        "service-translator",
        artifacts::examples::PORT_FILTER_TRANSLATOR,
    )
    .bearer_auth(TOKEN)
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    // C joins afterwards with an empty data dir: it loads the module from etcd at start.
    let c = host(dir.path(), "node-c", &etcd).await;
    wait_for_translator(&client, &c, "port-filter@1").await;
    a.stop().await;
    c.stop().await;
}

/// Whoever can write the kvstore (here a host without `--trusted-key`; equally a stolen etcd
/// credential) cannot run an unsigned module on a host that requires signatures: each host
/// checks the signature recorded with the version against its own keys before running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_requiring_signatures_refuses_an_unsigned_module_another_host_put_in_force() {
    use wasmplane::admission;
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let (private, public) = admission::generate_key_pair().unwrap();
    let (private_path, public_path) = (dir.path().join("key"), dir.path().join("key.pub"));
    std::fs::write(&private_path, private).unwrap();
    std::fs::write(&public_path, public).unwrap();
    let key = admission::read_private_key(&private_path).unwrap();
    let lax = host(dir.path(), "node-a", &etcd).await;
    let strict = start(wasmplane::app::HostConfig {
        trusted_keys: vec![public_path],
        ..node_config(dir.path(), "node-b", &etcd, TOKEN, "shop.yaml", &documents(&[WEB_SERVICE, API_SERVICE]))
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();

    // Unsigned, through the lax host: it runs there; the strict host keeps the builtin and
    // says why in the module's status.
    let r = upload_request(
        &client,
        &lax.url(),
        "port-filter",
        "service-translator",
        artifacts::examples::PORT_FILTER_TRANSLATOR,
    )
    .bearer_auth(TOKEN)
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    wait_for_translator(&client, &lax, "port-filter@1").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let module = loop {
        let module = get_json(&client, &strict, "/v1/modules/port-filter").await;
        if module["status"] == "failed" {
            break module;
        }
        assert!(Instant::now() < deadline, "the strict host never refused it: {module}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(module["last_error"].as_str().unwrap_or_default().contains("is not signed"), "{module}");
    assert_eq!(
        get_json(&client, &strict, "/v1/dataplane?format=json").await["translator"],
        "default-service-translator@1"
    );

    // Signed with the trusted key, through the same lax host: both run it.
    let bytes = artifacts::SERVICE_TRANSLATOR;
    let r = upload_request(&client, &lax.url(), "port-filter", "service-translator", bytes)
        .header("x-wasmplane-signature", admission::sign(&key, bytes))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    wait_for_translator(&client, &strict, "port-filter@2").await;
    wait_for_translator(&client, &lax, "port-filter@2").await;

    // A signature recorded for other bytes does not carry over: rolling back to the unsigned
    // version is refused on the strict host again, which keeps the signed one.
    let r =
        client.post(format!("{}/v1/modules/port-filter/rollback", lax.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    wait_for_translator(&client, &lax, "port-filter@1").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(get_json(&client, &strict, "/v1/dataplane?format=json").await["translator"], "port-filter@2");
    lax.stop().await;
    strict.stop().await;
}

/// Module settings (Kubewarden's policy settings): one document per module, set through
/// any host, read by the module's guests on every host; settings its guest refuses are
/// refused and the ones in force stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn module_settings_reach_every_hosts_guests_and_bad_ones_are_refused() {
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let web = WEB_SERVICE.replace(
        "metadata: { name: web, namespace: shop }",
        "metadata: { name: web, namespace: shop, labels: { tier: front } }",
    );
    let node = |name: &'static str| {
        start(node_config(dir.path(), name, &etcd, TOKEN, "shop.yaml", &documents(&[&web, API_SERVICE])))
    };
    let (a, b) = (node("node-a").await.unwrap(), node("node-b").await.unwrap());
    let client = reqwest::Client::new();
    let r = upload_request(
        &client,
        &a.url(),
        "port-filter",
        "service-translator",
        artifacts::examples::PORT_FILTER_TRANSLATOR,
    )
    .bearer_auth(TOKEN)
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    // Which services a host exposes (the example warns about the others), once it is
    // `expected`.
    let wait_exposed = |host: &RunningHost, expected: &'static [&'static str]| {
        let (client, url) = (client.clone(), host.url());
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let dp: Value =
                    client.get(format!("{url}/v1/dataplane?format=json")).send().await.unwrap().json().await.unwrap();
                let objects = dp["objects"].as_object().cloned().unwrap_or_default();
                let mut names: Vec<String> = objects
                    .iter()
                    .filter(|(_, o)| !o["warnings"].to_string().contains("not exposed"))
                    .map(|(k, _)| k.clone())
                    .collect();
                names.sort();
                if dp["translator"] == "port-filter@1" && names == expected {
                    return;
                }
                assert!(Instant::now() < deadline, "{url} exposes {names:?}, not {expected:?}: {dp}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    wait_exposed(&b, &["shop/api"]).await;

    // Settings through A (with the CLI, from YAML): B's guests read them too.
    let settings = serde_json::json!({"label": "tier", "value": "front"});
    let put = |host: &RunningHost, body: String| {
        client.put(format!("{}/v1/modules/port-filter/settings", host.url())).bearer_auth(TOKEN).body(body).send()
    };
    let file = dir.path().join("settings.yaml");
    std::fs::write(&file, "label: tier\nvalue: front\n").unwrap();
    let api = wasmplane::cli::ApiArgs { api: a.url(), token: Some(TOKEN.into()), token_file: None };
    wasmplane::cli::module_command(
        api,
        wasmplane::cli::ModuleCommand::Settings { name: "port-filter".into(), file: Some(file), clear: false },
    )
    .await
    .unwrap();
    wait_exposed(&a, &["shop/web"]).await;
    wait_exposed(&b, &["shop/web"]).await;
    assert_eq!(get_json(&client, &b, "/v1/modules/port-filter/settings").await, settings);
    assert_eq!(get_json(&client, &b, "/v1/modules/port-filter").await["settings"], settings);

    // Settings the guest refuses: 422 naming the mistake; those in force stay, everywhere.
    let r = put(&b, r#"{"lable": "tier"}"#.into()).await.unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(r.text().await.unwrap().contains("lable"));
    assert_eq!(get_json(&client, &a, "/v1/modules/port-filter/settings").await, settings);
    // Not JSON, no token, no such module.
    assert_eq!(put(&a, "label: tier".into()).await.unwrap().status(), StatusCode::BAD_REQUEST);
    let r = client.put(format!("{}/v1/modules/port-filter/settings", a.url())).body("{}").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = client
        .put(format!("{}/v1/modules/nothing/settings", a.url()))
        .bearer_auth(TOKEN)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    wait_exposed(&b, &["shop/web"]).await;

    // Cleared: the guest's default again.
    let r =
        client.delete(format!("{}/v1/modules/port-filter/settings", b.url())).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    wait_exposed(&a, &["shop/api"]).await;
    assert_eq!(get_json(&client, &a, "/v1/modules/port-filter/settings").await, serde_json::json!({}));
    a.stop().await;
    b.stop().await;
}

/// A module that exports its own settings check (`settings-validation`, the example's) is
/// asked before anything is stored: on a host with no service at all, where running the
/// module says nothing, bad settings are refused with its message and the old ones stay;
/// and for a module not in force, an upload with settings, and an activation under
/// settings the version refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_the_module_refuses_are_refused_with_nothing_to_translate() {
    use support::rest::{SHOP_NAMESPACE, error_of, json_answer};
    let etcd = Etcd::start().await.expect("etcd-server must be installed (scripts/setup.sh)");
    let dir = tempfile::tempdir().unwrap();
    let host = start(node_config(dir.path(), "node-a", &etcd, TOKEN, "empty.yaml", SHOP_NAMESPACE)).await.unwrap();
    let client = reqwest::Client::new();
    let settings_url = |name: &str| format!("{}/v1/modules/{name}/settings", host.url());
    let put = |name: &str, body: &str| client.put(settings_url(name)).bearer_auth(TOKEN).body(body.to_string());
    let r = upload_request(
        &client,
        &host.url(),
        "port-filter",
        "service-translator",
        artifacts::examples::PORT_FILTER_TRANSLATOR,
    )
    .bearer_auth(TOKEN)
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED, "{}", r.text().await.unwrap());
    assert!(host.controller.lock().unwrap().model().services.is_empty(), "the host has nothing to translate");

    let good = serde_json::json!({"label": "tier", "value": "front"});
    let (status, _) = json_answer(put("port-filter", &good.to_string())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(get_json(&client, &host, "/v1/modules/port-filter/settings").await, good);
    for (bad, says) in [
        (r#"{"label": "tier", "value": "front", "port": 80}"#, "unknown field `port`"),
        (r#"{"label": "tier", "value": 7}"#, "invalid type: integer `7`"),
        (r#"{"label": "tier"}"#, "`label` given without `value`"),
    ] {
        let (status, body) = json_answer(put("port-filter", bad)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{bad}: {body}");
        assert!(error_of(&body).contains(says), "{bad}: {body}");
        assert_eq!(
            get_json(&client, &host, "/v1/modules/port-filter/settings").await,
            good,
            "the settings in force stay"
        );
    }
    let (status, _) = json_answer(client.delete(settings_url("port-filter")).bearer_auth(TOKEN)).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{{}} is valid: the default label");

    // Not in force (uploaded but not activated): its validator is asked all the same.
    let r = client
        .put(format!("{}/v1/modules/idle-filter?kind=service-translator&activate=false", host.url()))
        .bearer_auth(TOKEN)
        .body(artifacts::examples::PORT_FILTER_TRANSLATOR.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let (status, body) = json_answer(put("idle-filter", r#"{"lable": "tier"}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(error_of(&body).contains("unknown field `lable`"), "{body}");
    assert_eq!(get_json(&client, &host, "/v1/modules/idle-filter/settings").await, serde_json::json!({}));

    // A validator that traps vouches for nothing: refused, saying so.
    let r = client
        .put(format!("{}/v1/modules/crashy?kind=service-translator&activate=false", host.url()))
        .bearer_auth(TOKEN)
        .body(artifacts::test_programs::TRAPPING_VALIDATOR.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let (status, body) = json_answer(put("crashy", "{}")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(
        error_of(&body).contains("its settings validator failed: guest trapped")
            && error_of(&body).contains("this validator always traps"),
        "{body}"
    );

    // An upload with settings its version refuses (what a WasmModule's spec does): nothing
    // is stored, not even the version.
    let refused = host
        .modules
        .upload_with_settings(
            "fresh",
            wasmplane_runtime::GuestKind::ServiceTranslator,
            artifacts::examples::PORT_FILTER_TRANSLATOR.into(),
            true,
            None,
            Some(Some(serde_json::json!({"lable": 1}))),
        )
        .await;
    assert!(
        refused.as_ref().is_err_and(|e| e.to_string().contains("unknown field `lable`")),
        "{:?}",
        refused.map(|o| o.version)
    );
    let r = client.get(format!("{}/v1/modules/fresh", host.url())).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    // Activation: a module without a validator takes any settings; a version of it with
    // one that refuses them does not go in force (uploaded and activated, or activated
    // later), and the one in force stays.
    let r = upload_request(&client, &host.url(), "mixed", "service-translator", artifacts::SERVICE_TRANSLATOR)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(json_answer(put("mixed", r#"{"anything": 1}"#)).await.0, StatusCode::OK);
    let (status, body) = json_answer(
        upload_request(
            &client,
            &host.url(),
            "mixed",
            "service-translator",
            artifacts::examples::PORT_FILTER_TRANSLATOR,
        )
        .bearer_auth(TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(error_of(&body).contains("unknown field `anything`"), "{body}");
    let (status, body) =
        json_answer(client.post(format!("{}/v1/modules/mixed/activate?version=2", host.url())).bearer_auth(TOKEN))
            .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(error_of(&body).contains("settings refused by mixed"), "{body}");
    assert_eq!(get_json(&client, &host, "/v1/dataplane?format=json").await["translator"], "mixed@1");
    host.stop().await;
}
