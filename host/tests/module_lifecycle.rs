//! Module lifecycle through the HTTP API: shadow runs with their exact dataplane diff and
//! promotion, and automatic rollback after a module exhausts its crash budget.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use support::rest::{API_SERVICE, WEB_SERVICE, config, documents, endpoint_slice, json_answer, write_manifest};
use wasmplane::app::{HostConfig, RunningHost, start};
use wasmplane::controller::CrashBudget;
use wasmplane_guest_artifacts as artifacts;

const TOKEN: &str = "lifecycle-token-0123456789abcdef";

/// The `shop` namespace: web (one endpoint) and api (labelled for the example filter).
fn manifests() -> String {
    documents(&[WEB_SERVICE, &endpoint_slice("web", "http", 8080, &[("10.244.0.11", "node-a")]), API_SERVICE])
}

struct Host {
    host: RunningHost,
    client: reqwest::Client,
    dir: tempfile::TempDir,
}

impl Host {
    async fn start(crash_budget: CrashBudget) -> Host {
        let dir = tempfile::tempdir().unwrap();
        write_manifest(&dir.path().join("manifests"), "shop.yaml", &manifests());
        let host = start(HostConfig {
            crash_budget,
            ..config(&dir.path().join("manifests"), &dir.path().join("data"), TOKEN)
        })
        .await
        .unwrap();
        let h = Host { host, client: reqwest::Client::new(), dir };
        h.wait_for("initial sync", |dp| dp["objects"].get("shop/web").is_some()).await;
        h
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.host.url())
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        json_answer(self.client.get(self.url(path))).await
    }

    async fn send(&self, method: reqwest::Method, path: &str, body: Option<&[u8]>) -> (StatusCode, Value) {
        let mut request = self.client.request(method, self.url(path)).bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.body(body.to_vec());
        }
        json_answer(request).await
    }

    async fn dataplane(&self) -> Value {
        self.get("/v1/dataplane?format=json").await.1
    }

    async fn wait_for(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let dp = self.dataplane().await;
            if done(&dp) {
                return dp;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; dataplane: {dp}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn chains_of(dp: &Value, object: &str) -> Vec<String> {
    dp["objects"][object]["chains"].as_object().map(|c| c.keys().cloned().collect()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_run_shows_the_exact_diff_and_promotion_applies_it() {
    let h = Host::start(CrashBudget::default()).await;
    let before = h.dataplane().await;
    let web_chains = chains_of(&before, "shop/web");
    assert!(
        before["objects"]["shop/web"]["elements"].to_string().contains("service-endpoints"),
        "web is load balanced as data: {before}"
    );

    // The example filter, in shadow: it would drop every unlabelled service (web).
    let (status, body) = h
        .send(
            reqwest::Method::PUT,
            "/v1/modules/port-filter?kind=service-translator&shadow=true",
            Some(artifacts::examples::PORT_FILTER_TRANSLATOR),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["shadow"], true);
    assert_eq!(h.dataplane().await, before, "a shadow never writes");
    let (_, module) = h.get("/v1/modules/port-filter").await;
    assert_eq!((module["shadow_version"].as_u64(), module["status"].as_str()), (Some(1), Some("inactive")), "{module}");

    let (status, diff) = h.get("/v1/modules/port-filter/shadow-diff").await;
    assert_eq!(status, StatusCode::OK, "{diff}");
    let web = &diff["objects"]["shop/web"];
    let mut removed: Vec<String> =
        web["chains_removed"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    removed.sort();
    let mut expected = web_chains.clone();
    expected.sort();
    assert_eq!(removed, expected, "every chain of web goes: {diff}");
    let applied_elements = before["objects"]["shop/web"]["elements"].as_array().unwrap();
    assert_eq!(web["elements_removed"].as_array().unwrap(), applied_elements, "and exactly its map elements: {diff}");
    assert!(web["chains_added"].as_array().unwrap().is_empty());

    // The diff follows live state: a new unlabelled service appears in it.
    std::fs::write(
        h.dir.path().join("manifests/more.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: { name: cart, namespace: shop }\nspec:\n  clusterIP: 10.96.0.30\n  ports: [{ port: 9000 }]\n",
    )
    .unwrap();
    h.wait_for("cart", |dp| dp["objects"].get("shop/cart").is_some()).await;
    let live = h.dataplane().await;
    let (_, diff) = h.get("/v1/modules/port-filter/shadow-diff").await;
    assert!(diff["objects"].get("shop/cart").is_some(), "{diff}");

    // Promote: what is applied now is what the diff said.
    let (status, body) = h.send(reqwest::Method::POST, "/v1/modules/port-filter/promote", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let after = h.wait_for("promotion", |dp| dp["translator"] == "port-filter@1").await;
    assert!(chains_of(&after, "shop/web").is_empty(), "{after}");
    assert!(chains_of(&after, "shop/cart").is_empty(), "{after}");
    // Exact: for every object, applied after = applied before − removed + added.
    for object in ["shop/web", "shop/api", "shop/cart"] {
        let d = &diff["objects"][object];
        let names = |v: &Value| -> BTreeSet<String> {
            v.as_array().map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect()).unwrap_or_default()
        };
        let mut expected: BTreeSet<String> = chains_of(&live, object).into_iter().collect();
        expected.retain(|c| !names(&d["chains_removed"]).contains(c));
        expected.extend(names(&d["chains_added"]));
        assert_eq!(chains_of(&after, object).into_iter().collect::<BTreeSet<_>>(), expected, "{object}: {diff}");
        let elements = |v: &Value| -> BTreeSet<String> {
            v.as_array().map(|a| a.iter().map(|e| e.to_string()).collect()).unwrap_or_default()
        };
        let mut expected = elements(&live["objects"][object]["elements"]);
        expected.retain(|e| !elements(&d["elements_removed"]).contains(e));
        expected.extend(elements(&d["elements_added"]));
        assert_eq!(elements(&after["objects"][object]["elements"]), expected, "{object}: {diff}");
    }
    let (status, _) = h.get("/v1/modules/port-filter/shadow-diff").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "the shadow ended with the promotion");
    h.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_that_keeps_crashing_is_rolled_back_to_its_last_good_version() {
    let h = Host::start(CrashBudget { max_crashes: 3, window: Duration::from_secs(60) }).await;
    // v1: the default translation; v2: fine until a service carries the crash label.
    let upload =
        |bytes: &'static [u8]| h.send(reqwest::Method::PUT, "/v1/modules/flaky?kind=service-translator", Some(bytes));
    assert_eq!(upload(artifacts::SERVICE_TRANSLATOR).await.0, StatusCode::CREATED);
    let (status, body) = upload(artifacts::test_programs::TRAP_ON_LABEL).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    h.wait_for("v2 in force", |dp| dp["translator"] == "flaky@2").await;

    // Five labelled services: five traps in one sync, over the budget of three.
    let crashing: String = (0..5)
        .map(|i| format!("apiVersion: v1\nkind: Service\nmetadata: {{ name: boom{i}, namespace: shop, labels: {{ wasmplane.io/crash: \"yes\" }} }}\nspec:\n  clusterIP: 10.96.1.{i}\n  ports: [{{ port: 80 }}]\n---\n"))
        .collect();
    write_manifest(&h.dir.path().join("manifests"), "crash.yaml", &crashing);

    let dp = h.wait_for("the rollback", |dp| dp["translator"] == "flaky@1").await;
    // Version 1 serves again, including the services version 2 crashed on.
    // (They have no endpoints: their rules are the reject elements.)
    for i in 0..5 {
        let elements = dp["objects"][format!("shop/boom{i}")]["elements"].to_string();
        assert!(
            elements.contains(&format!("10.96.1.{i} . tcp . 80")) && elements.contains("no-endpoint-services"),
            "boom{i}: {dp}"
        );
    }
    assert!(dp["objects"]["shop/web"]["elements"].to_string().contains("service-endpoints"), "{dp}");
    let (_, module) = h.get("/v1/modules/flaky").await;
    let rollback = &module["auto_rollback"];
    assert_eq!((rollback["from_version"].as_u64(), rollback["to_version"].as_u64()), (Some(2), Some(1)), "{module}");
    assert!(rollback["reason"].as_str().unwrap().contains("crash label"), "{module}");
    assert_eq!(module["active_version"], 1);
    let metrics = h.client.get(h.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("wasmplane_module_auto_rollbacks_total{module=\"flaky\"} 1"), "{metrics}");
    h.host.stop().await;
}

/// A LoadBalancer service open to `ranges` only, `labels` as YAML flow mapping entries.
fn guarded_service(ranges: &str, labels: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{ name: guarded, namespace: shop, labels: {{ {labels} }} }}\n\
         spec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.40\n  ports: [{{ port: 443 }}]\n  loadBalancerSourceRanges: [{ranges}]\n\
         status:\n  loadBalancer: {{ ingress: [{{ ip: 203.0.113.40 }}] }}\n"
    )
}

/// `spec.loadBalancerSourceRanges` is enforced by the host, not by the translator: a hot
/// swap keeps the firewall, a translator that traps on the service does not keep its old
/// ranges in force, and the firewall goes with the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_balancer_firewall_is_the_hosts_whatever_the_translator_does() {
    let h = Host::start(CrashBudget { max_crashes: 100, window: Duration::from_secs(60) }).await;
    let guarded = h.dir.path().join("manifests/guarded.yaml");
    std::fs::write(&guarded, guarded_service("198.51.100.0/24", "")).unwrap();
    let allowed = |dp: &Value| dp["objects"]["firewall:shop/guarded"]["elements"].to_string();
    let dp = h.wait_for("the firewall", |dp| allowed(dp).contains("203.0.113.40 . tcp . 443 . 198.51.100.0/24")).await;
    assert!(allowed(&dp).contains("firewall-ips"), "{dp}");
    assert!(
        dp["objects"]["shop/guarded"]["elements"].to_string().contains("203.0.113.40 . tcp . 443"),
        "the translator serves the address: {dp}"
    );

    // A hot swap rewrites the whole table: the firewall goes in with it.
    let (status, body) = h
        .send(
            reqwest::Method::PUT,
            "/v1/modules/flaky?kind=service-translator",
            Some(artifacts::test_programs::TRAP_ON_LABEL),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let dp = h.wait_for("the new translator in force", |dp| dp["translator"] == "flaky@1").await;
    assert!(allowed(&dp).contains("198.51.100.0/24"), "{dp}");
    let last_good = dp["objects"]["shop/guarded"].clone();

    // The translator traps on the service from now on: its last good rules stay, and the
    // firewall follows the new ranges all the same.
    std::fs::write(&guarded, guarded_service("192.0.2.0/24", "wasmplane.io/crash: \"yes\"")).unwrap();
    let dp = h.wait_for("the new ranges", |dp| allowed(dp).contains("203.0.113.40 . tcp . 443 . 192.0.2.0/24")).await;
    assert!(!allowed(&dp).contains("198.51.100.0/24"), "{dp}");
    let (_, module) = h.get("/v1/modules/flaky").await;
    assert!(module["failures"].as_u64() > Some(0), "the translator did trap on it: {module}");
    assert_eq!(dp["objects"]["shop/guarded"], last_good, "the service keeps its last good rules");

    std::fs::remove_file(&guarded).unwrap();
    h.wait_for("the firewall gone with the service", |dp| {
        dp["objects"].get("firewall:shop/guarded").is_none() && dp["objects"].get("shop/guarded").is_none()
    })
    .await;
    h.host.stop().await;
}

/// The network programming latency counts what reached the kernel: of two services whose
/// slices changed in one reload, the one the translator traps on keeps its last good rules
/// and is not observed; the other is.
/// kube-proxy's slice cache sees no change in a slice whose trigger time alone moved, so its
/// SLI does not observe it, even when the same sync programs another slice of the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_annotation_only_change_beside_a_real_one_is_not_observed() {
    let h = Host::start(CrashBudget { max_crashes: 100, window: Duration::from_secs(60) }).await;
    let manifests = |stamp: k8s_openapi::jiff::Timestamp, second_endpoint: &str| {
        let triggered_slice = |name: &str, ip: &str| {
            let annotation = format!(
                "namespace: shop, annotations: {{ endpoints.kubernetes.io/last-change-trigger-time: \"{stamp}\" }},"
            );
            endpoint_slice("web", "http", 8080, &[(ip, "node-a")])
                .replacen("namespace: shop,", &annotation, 1)
                .replacen("name: web-abc", &format!("name: web-{name}"), 1)
        };
        documents(&[WEB_SERVICE, &triggered_slice("a", "10.244.0.61"), &triggered_slice("b", second_endpoint)])
    };
    let count = || async {
        let metrics = h.client.get(h.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let line = metrics
            .lines()
            .find_map(|l| l.strip_prefix("wasmplane_network_programming_duration_seconds_count "))
            .map(str::to_string);
        line.unwrap_or_else(|| panic!("no programming latency in {metrics}")).parse::<u64>().unwrap()
    };
    let wait_count = |want: u64| async move {
        let deadline = Instant::now() + Duration::from_secs(15);
        while count().await < want && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    };
    // Renamed in (`write_manifest`): a poll that read half a file would program (and count) more.
    let dir = h.dir.path().join("manifests");
    write_manifest(&dir, "sli.yaml", &manifests(k8s_openapi::jiff::Timestamp::now(), "10.244.0.62"));
    wait_count(2).await;
    assert_eq!(count().await, 2, "both new slices were programmed");

    // In one file, so in one sync: slice a's trigger time moves alone, slice b's endpoint
    // changes. Only b's change is observed.
    write_manifest(&dir, "sli.yaml", &manifests(k8s_openapi::jiff::Timestamp::now(), "10.244.0.63"));
    h.wait_for("b's new endpoint", |dp| dp.to_string().contains("10.244.0.63")).await;
    wait_count(3).await;
    // Observations of one sync land together; give a wrongly counted one time to show.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(count().await, 3);
    h.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_the_translator_fails_on_is_not_counted_as_programmed() {
    let h = Host::start(CrashBudget { max_crashes: 100, window: Duration::from_secs(60) }).await;
    let (status, body) = h
        .send(
            reqwest::Method::PUT,
            "/v1/modules/flaky?kind=service-translator",
            Some(artifacts::test_programs::TRAP_ON_LABEL),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    h.wait_for("the new translator in force", |dp| dp["translator"] == "flaky@1").await;

    let now = k8s_openapi::jiff::Timestamp::now();
    let service = |name: &str, ip: &str, labels: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{ name: {name}, namespace: shop, labels: {{ {labels} }} }}\nspec:\n  clusterIP: {ip}\n  ports: [{{ name: http, port: 80 }}]\n"
        )
    };
    let triggered_slice = |name: &str, ip: &str| {
        let annotation =
            format!("namespace: shop, annotations: {{ endpoints.kubernetes.io/last-change-trigger-time: \"{now}\" }},");
        endpoint_slice(name, "http", 8080, &[(ip, "node-a")]).replacen("namespace: shop,", &annotation, 1)
    };
    let manifests = documents(&[
        &service("calm", "10.96.0.50", ""),
        &triggered_slice("calm", "10.244.0.50"),
        &service("crashy", "10.96.0.51", "wasmplane.io/crash: \"yes\""),
        &triggered_slice("crashy", "10.244.0.51"),
    ]);
    write_manifest(&h.dir.path().join("manifests"), "triggered.yaml", &manifests);
    // (This translator writes no rules of its own: an object with none is its output.)
    let dp = h.wait_for("calm's rules", |dp| dp["objects"].get("shop/calm").is_some()).await;
    assert!(dp["objects"].get("shop/crashy").is_none(), "{dp}");
    let (_, module) = h.get("/v1/modules/flaky").await;
    assert!(module["failures"].as_u64() > Some(0), "the translator did trap on crashy: {module}");

    let count = || async {
        let metrics = h.client.get(h.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let line = metrics
            .lines()
            .find_map(|l| l.strip_prefix("wasmplane_network_programming_duration_seconds_count "))
            .map(str::to_string);
        line.unwrap_or_else(|| panic!("no programming latency in {metrics}")).parse::<u64>().unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while count().await == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(count().await, 1, "calm's change is programmed, crashy's is not");
    h.host.stop().await;
}

/// A translator built against WIT 1.0.0 as released (`wit/1.0.0/`) is uploaded, listed with
/// its version and put in force like any other: its rules reach the dataplane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_translator_built_against_wit_1_0_is_uploaded_and_runs() {
    let h = Host::start(CrashBudget::default()).await;
    let (status, body) = h
        .send(
            reqwest::Method::PUT,
            "/v1/modules/old-abi?kind=service-translator",
            Some(artifacts::test_programs::TRANSLATOR_WIT_1_0),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (_, module) = h.get("/v1/modules/old-abi").await;
    let versions = module["versions"].as_array().expect("versions");
    assert_eq!(versions.last().and_then(|v| v["wit_version"].as_str()), Some("1.0.0"), "{module}");
    let dp = h
        .wait_for("the 1.0 guest's rules", |dp| chains_of(dp, "shop/web").iter().any(|c| c == "svc/shop/web/80"))
        .await;
    let rules = dp["objects"]["shop/web"]["chains"]["svc/shop/web/80"].to_string();
    assert!(
        rules.contains("ip saddr != 10.244.0.0/16 jump mark-for-masquerade")
            && rules.contains("dnat ip to 10.244.0.11:8080")
            && rules.contains("wit 1.0"),
        "{rules}"
    );
}

/// A translator built against a newer minor than the host's (its 1.0 names rewritten to 1.3.0,
/// same length) is refused at upload with why, instead of failing at its first call; nothing is
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_translator_built_against_a_newer_wit_minor_is_refused_at_upload() {
    let h = Host::start(CrashBudget::default()).await;
    let mut newer = artifacts::test_programs::TRANSLATOR_WIT_1_0.to_vec();
    let (from, to) = (b"@1.0.0", b"@1.3.0");
    for i in 0..=newer.len() - from.len() {
        if &newer[i..i + from.len()] == from {
            newer[i..i + to.len()].copy_from_slice(to);
        }
    }
    let (_, before) = h.get("/v1/modules").await;
    let (status, body) = h.send(reqwest::Method::PUT, "/v1/modules/newer?kind=service-translator", Some(&newer)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(error.contains("wasmplane:dataplane@1.3.0, newer than this host's 1.2.0"), "{body}");
    assert_eq!(h.get("/v1/modules").await.1, before, "nothing stored");
    assert_eq!(h.get("/v1/modules/newer").await.0, StatusCode::NOT_FOUND);
    h.host.stop().await;
}
