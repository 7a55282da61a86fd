//! Node-local inspection (`GET /v1/status`, `GET /v1/services[/{namespace}/{name}]`,
//! `GET /v1/pods[/{namespace}/{name}]`, `GET /v1/cluster/nodes` and the CLI's `wasmplane::inspect`) against a real host
//! on loopback over a manifest dir.

mod support;

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::rest::{
    API_SERVICE, SHOP_NAMESPACE, WEB_SERVICE, documents, endpoint_slice, error_of, json_answer, limited_config,
    write_manifest,
};
use wasmplane::app::{HostConfig, RunningHost, start};
use wasmplane::cli::ApiArgs;

const TOKEN: &str = "inspect-token-0123456789abcdef";

/// `shop/web`'s endpoints: ready on this node (node-a), not ready on this node, ready on node-b.
const WEB_SLICE: &str = "
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: { name: web-abc, namespace: shop, labels: { kubernetes.io/service-name: web } }
addressType: IPv4
ports: [{ name: http, port: 8080, protocol: TCP }]
endpoints:
  - { addresses: [10.244.0.11], conditions: { ready: true }, nodeName: node-a }
  - { addresses: [10.244.0.12], conditions: { ready: false }, nodeName: node-a }
  - { addresses: [10.244.1.11], conditions: { ready: true }, nodeName: node-b }
";

/// `other/edge`: a node port.
const EDGE_SERVICE: &str = "
apiVersion: v1
kind: Service
metadata: { name: edge, namespace: other }
spec:
  type: NodePort
  clusterIP: 10.96.0.30
  ports: [{ name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP }]
";

/// `other/broken`: an external IP that is a network, which the builtin translator refuses.
const BROKEN_SERVICE: &str = "
apiVersion: v1
kind: Service
metadata: { name: broken, namespace: other }
spec:
  clusterIP: 10.96.0.31
  externalIPs: [192.0.2.0/24]
  ports: [{ port: 80, protocol: TCP }]
";

/// A pod on this node, one on node-b, and a policy selecting the local one.
const PODS_AND_POLICY: &str = "
apiVersion: v1
kind: Pod
metadata: { name: web-1, namespace: default, labels: { app: web } }
spec: { nodeName: node-a, containers: [{ name: c, image: x }] }
status: { phase: Running, podIP: 10.244.0.41, podIPs: [{ ip: 10.244.0.41 }] }
---
apiVersion: v1
kind: Pod
metadata: { name: web-2, namespace: default, labels: { app: web } }
spec: { nodeName: node-b, containers: [{ name: c, image: x }] }
status: { phase: Running, podIP: 10.244.1.41, podIPs: [{ ip: 10.244.1.41 }] }
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: { name: web-ingress, namespace: default, uid: web-ingress-uid, generation: 1 }
spec:
  podSelector: { matchLabels: { app: web } }
  policyTypes: [Ingress]
  ingress: [{ from: [{ podSelector: { matchLabels: { app: client } } }] }]
";

fn manifests() -> String {
    documents(&[
        SHOP_NAMESPACE,
        WEB_SERVICE,
        WEB_SLICE,
        API_SERVICE,
        &endpoint_slice("api", "https", 8443, &[("10.244.1.21", "node-b")]),
        "apiVersion: v1\nkind: Namespace\nmetadata: { name: other }\n",
        EDGE_SERVICE,
        BROKEN_SERVICE,
        PODS_AND_POLICY,
    ])
}

struct Host {
    host: RunningHost,
    client: reqwest::Client,
    dir: tempfile::TempDir,
}

impl Host {
    /// A host over [`manifests`], once its status says it is ready with all four services.
    async fn start() -> Host {
        Host::start_with(|config| config, Host::synced).await
    }

    /// The status of a host over [`manifests`] that is ready with all four services.
    fn synced(status: &Value) -> bool {
        status["ready"] == true
            && status["model"]["services"] == 4
            && status["model"]["local_pods"] == 1
            && status["model"]["policies"] == 1
            && status["service_errors"] == 1
    }

    /// A host over [`manifests`] with its `config` changed, once its status is `until`.
    async fn start_with(config: impl FnOnce(HostConfig) -> HostConfig, until: impl Fn(&Value) -> bool) -> Host {
        let dir = tempfile::tempdir().unwrap();
        write_manifest(&dir.path().join("manifests"), "cluster.yaml", &manifests());
        let host = start(config(limited_config(dir.path(), TOKEN, Duration::from_millis(500)))).await.unwrap();
        let h = Host { host, client: reqwest::Client::new(), dir };
        h.wait_for_status("the initial sync", until).await;
        h
    }

    async fn wait_for_status(&self, what: &str, until: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, status) = self.get("/v1/status").await;
            if until(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; status: {status}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn readyz(&self) -> (StatusCode, String) {
        let r = self.client.get(self.url("/readyz")).send().await.unwrap();
        (r.status(), r.text().await.unwrap())
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.host.url())
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        json_answer(self.client.get(self.url(path))).await
    }

    fn api(&self) -> ApiArgs {
        ApiArgs { api: self.host.url(), token: None, token_file: None }
    }
}

/// The row of `service` in a `/v1/services` answer.
fn row<'a>(list: &'a Value, service: &str) -> &'a Value {
    list["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["service"] == service)
        .unwrap_or_else(|| panic!("no row for {service}: {list}"))
}

fn services_of(list: &Value) -> Vec<&str> {
    list["services"].as_array().unwrap().iter().map(|s| s["service"].as_str().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_summarises_the_node_in_counts() {
    let h = Host::start().await;
    let (status, summary) = h.get("/v1/status").await;
    assert_eq!(status, StatusCode::OK, "{summary}");
    assert_eq!(summary["ready"], true, "{summary}");
    assert_eq!(summary["not_ready_reason"], Value::Null, "{summary}");
    assert_eq!(summary["node"], "node-a");
    assert_eq!(summary["role"], "agent");
    assert_eq!(summary["leader"], Value::Null, "no operator role here: {summary}");
    let (_, state) = h.get("/v1/state").await;
    assert_eq!(summary["model"]["revision"], state["revision"], "{summary}");
    assert!(
        summary["model"]["revisions_total"].as_u64() >= Some(1)
            && summary["model"]["events_total"].as_u64() >= summary["model"]["revisions_total"].as_u64(),
        "{summary}"
    );
    // Counts, never the model itself.
    assert_eq!(summary["model"]["services"], json!(4));
    assert_eq!(summary["model"]["local_pods"], json!(1));
    assert_eq!(summary["model"]["policies"], json!(1));
    assert_eq!(summary["service_errors"], json!(1));
    let modules = &summary["modules"];
    assert_eq!(modules["service-translator"], "default-service-translator@1", "{summary}");
    assert_eq!(modules["network-policy"], "default-network-policy@1", "{summary}");
    assert_eq!(summary["failed_modules"], json!([]), "{summary}");
    let dp = &summary["dataplane"];
    assert_eq!(dp["mode"], "record", "{summary}");
    let (_, dataplane) = h.get("/v1/dataplane?format=json").await;
    assert_eq!(dp["objects"].as_u64(), Some(dataplane["objects"].as_object().unwrap().len() as u64), "{summary}");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let last_sync = dp["last_sync_unix_seconds"].as_u64().unwrap_or_else(|| panic!("a sync was written: {summary}"));
    assert!(now.abs_diff(last_sync) < 60, "{summary}");
    assert!(dp["last_sync_age_seconds"].as_u64() < Some(60), "{summary}");
    assert_eq!(dp["sync_failing_since_unix_seconds"], Value::Null, "{summary}");
    assert_eq!(dp["syncs_failed"], json!(0), "{summary}");
    assert_eq!(dp["last_write_error"], Value::Null, "{summary}");
    assert_eq!(summary["kvstore"]["backend"], "embedded", "{summary}");
    assert!(summary["kvstore"]["node_id"].is_u64(), "the agent registered this node: {summary}");
    h.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_list_counts_endpoints_and_shows_translation_errors() {
    let h = Host::start().await;
    let (status, list) = h.get("/v1/services").await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(services_of(&list), ["other/broken", "other/edge", "shop/api", "shop/web"], "{list}");
    let web = row(&list, "shop/web");
    assert_eq!(web["type"], "ClusterIP");
    assert_eq!(web["cluster_ips"], json!(["10.96.0.20"]));
    assert_eq!(web["ports"], json!([{ "name": "http", "port": 80, "protocol": "TCP", "node_port": null }]));
    assert_eq!(web["endpoints"], json!({ "total": 3, "ready": 2, "local": 2, "local_ready": 1 }), "{list}");
    assert_eq!(web["error"], Value::Null);
    assert_eq!(
        row(&list, "shop/api")["endpoints"],
        json!({ "total": 1, "ready": 1, "local": 0, "local_ready": 0 }),
        "{list}"
    );
    let edge = row(&list, "other/edge");
    assert_eq!((&edge["type"], &edge["ports"][0]["node_port"]), (&json!("NodePort"), &json!(30080)), "{list}");
    // The error as the controller keeps it, the one `/v1/state` shows.
    let (_, state) = h.get("/v1/state").await;
    let error = state["service_errors"]["other/broken"]
        .as_str()
        .unwrap_or_else(|| panic!("the translator refused other/broken: {state}"));
    assert!(error.contains("invalid IP"), "{error}");
    assert_eq!(row(&list, "other/broken")["error"], error, "{list}");

    let (_, other) = h.get("/v1/services?namespace=other").await;
    assert_eq!(services_of(&other), ["other/broken", "other/edge"], "{other}");
    let (_, shop) = h.get("/v1/services?namespace=shop").await;
    assert_eq!(services_of(&shop), ["shop/api", "shop/web"], "{shop}");
    // A namespace sorting between the others, and one that is a prefix of another.
    let (_, none) = h.get("/v1/services?namespace=p").await;
    assert_eq!(services_of(&none), Vec::<&str>::new(), "{none}");
    let (_, prefix) = h.get("/v1/services?namespace=sho").await;
    assert_eq!(services_of(&prefix), Vec::<&str>::new(), "{prefix}");
    h.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_service_shows_its_model_view_applied_rules_and_error() {
    let h = Host::start().await;
    let (_, state) = h.get("/v1/state").await;
    let (_, dataplane) = h.get("/v1/dataplane?format=json").await;

    let (status, web) = h.get("/v1/services/shop/web").await;
    assert_eq!(status, StatusCode::OK, "{web}");
    assert_eq!(web["service"], "shop/web");
    assert_eq!(web["model"], state["model"]["services"]["shop/web"], "the model's view, as /v1/state has it");
    assert_eq!(web["rules"], dataplane["objects"]["shop/web"], "the applied object, as /v1/dataplane has it");
    assert!(web["rules"]["elements"].to_string().contains("10.96.0.20 . tcp . 80"), "{web}");
    assert_eq!(web["error"], Value::Null);
    assert_eq!(web["translator"], "default-service-translator@1");

    let (status, broken) = h.get("/v1/services/other/broken").await;
    assert_eq!(status, StatusCode::OK, "{broken}");
    assert_eq!(broken["error"], state["service_errors"]["other/broken"], "{broken}");
    assert!(broken["error"].as_str().is_some_and(|e| e.contains("invalid IP")), "{broken}");
    assert_eq!(broken["rules"], Value::Null, "never translated, so nothing applied: {broken}");

    let (status, unknown) = h.get("/v1/services/shop/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{unknown}");
    assert!(error_of(&unknown).contains("shop/nope"), "{unknown}");
    h.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reads_and_formats_the_running_host() {
    let h = Host::start().await;
    let api = h.api();
    assert!(wasmplane::inspect::status(&api).await.unwrap(), "the host is ready");

    let (_, summary) = h.get("/v1/status").await;
    let text = wasmplane::inspect::format_status(&summary);
    let lines: Vec<&str> = text.lines().collect();
    for expected in [
        "Ready:               yes",
        "Node:                node-a",
        "Role:                agent",
        "Services:            4, 1 failing translation",
        "Local pods:          1",
        "Policies:            1",
        "Service translator:  default-service-translator@1",
    ] {
        assert!(lines.contains(&expected), "{expected:?} in:\n{text}");
    }

    let (_, list) = h.get("/v1/services?namespace=shop").await;
    let table = wasmplane::inspect::format_services(&list);
    let rows: Vec<Vec<&str>> =
        table.lines().map(|l| l.split("   ").map(str::trim).filter(|c| !c.is_empty()).collect()).collect();
    assert_eq!(rows.len(), 3, "{table}");
    assert_eq!(rows[0], ["NAMESPACE/NAME", "TYPE", "CLUSTER-IPS", "PORTS", "ENDPOINTS", "ERROR"], "{table}");
    assert_eq!(rows[1], ["shop/api", "ClusterIP", "10.96.0.21", "443/TCP", "1/1, local 0/0"], "{table}");
    assert_eq!(rows[2], ["shop/web", "ClusterIP", "10.96.0.20", "80/TCP", "2/3, local 1/2"], "{table}");
    let (_, other) = h.get("/v1/services?namespace=other").await;
    let table = wasmplane::inspect::format_services(&other);
    let broken = table.lines().find(|l| l.starts_with("other/broken ")).unwrap_or_else(|| panic!("{table}"));
    assert!(broken.ends_with(other["services"][0]["error"].as_str().unwrap()), "the error in the last column: {table}");
    assert!(table.lines().any(|l| l.starts_with("other/edge ") && l.contains(" 80:30080/TCP ")), "{table}");

    wasmplane::inspect::services(&api, Some("other")).await.unwrap();
    wasmplane::inspect::service(&api, "shop", "web").await.unwrap();
    let missing = wasmplane::inspect::service(&api, "shop", "nope").await.unwrap_err().to_string();
    assert!(missing.contains("404") && missing.contains("shop/nope"), "{missing}");
    let (_, web) = h.get("/v1/services/shop/web").await;
    let pretty = wasmplane::inspect::format_service(&web);
    assert_eq!(serde_json::from_str::<Value>(&pretty).unwrap(), web, "the whole answer, indented");
    assert!(pretty.lines().count() > 10, "{pretty}");
    h.host.stop().await;
}

/// Readiness is `/readyz`'s: in NodeCIDR mode both wait for the Node's pod CIDR, with the
/// same reason, and `wasmplane status` says so (and returns false) until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_is_ready_exactly_when_readyz_is() {
    let synced_without_pod_cidr = |status: &Value| {
        status["model"]["services"] == 4
            && status["not_ready_reason"].as_str().is_some_and(|r| !r.contains("initial sync"))
    };
    let h = Host::start_with(
        |config| HostConfig { local_detection: wasmplane::controller::LocalDetection::NodeCidr, ..config },
        synced_without_pod_cidr,
    )
    .await;
    let (_, summary) = h.get("/v1/status").await;
    assert_eq!(summary["ready"], false, "{summary}");
    let reason = summary["not_ready_reason"].as_str().unwrap();
    assert!(reason.contains("no pod CIDR yet"), "{reason}");
    assert_eq!(h.readyz().await, (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")));
    let api = h.api();
    assert!(!wasmplane::inspect::status(&api).await.unwrap(), "not ready yet");
    let text = wasmplane::inspect::format_status(&summary);
    assert_eq!(text.lines().next(), Some(format!("Ready:               no: {reason}").as_str()), "{text}");

    write_manifest(
        &h.dir.path().join("manifests"),
        "node.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: { name: node-a }\nspec: { podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24] }\n",
    );
    let summary = h.wait_for_status("the Node's pod CIDR", |status| status["ready"] == true).await;
    assert_eq!(summary["not_ready_reason"], Value::Null, "{summary}");
    assert_eq!(h.readyz().await, (StatusCode::OK, "ready\n".to_string()));
    assert!(wasmplane::inspect::status(&api).await.unwrap(), "ready now");
    h.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_cli_lists_policies_and_says_when_verdicts_are_not_read() {
    use wasmplane::inspect::{PolicyCommand, VerdictFilter, format_policies, policy, policy_to};
    let h = Host::start().await;
    let api = h.api();
    policy(&api, PolicyCommand::Ls { counters: false }).await.unwrap();
    let mut shown = Vec::new();
    policy_to(&api, PolicyCommand::Ls { counters: false }, &mut shown).await.unwrap();

    let (status, list) = h.get("/v1/policies").await;
    assert_eq!(status, StatusCode::OK, "{list}");
    let table = format_policies(&list, false);
    assert_eq!(
        table_cells(&table),
        [
            vec!["NAMESPACE/NAME", "GENERATION", "MODE", "TARGETS", "ERROR"],
            vec!["default/web-ingress", "1/1", "enforce", "ingress 1, egress 0"]
        ],
        "{table}"
    );
    assert_eq!(String::from_utf8(shown).unwrap(), table, "what `wasmplane policy ls` prints");

    // In audit mode, with the counters (a record dataplane has none: zero).
    let audit = h
        .client
        .post(h.url("/v1/policies/default/web-ingress/audit?enabled=true"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(audit.status(), StatusCode::OK);
    let mut shown = Vec::new();
    policy_to(&api, PolicyCommand::Ls { counters: true }, &mut shown).await.unwrap();
    let (_, counted) = h.get("/v1/policies?counters=true").await;
    let table = format_policies(&counted, true);
    assert_eq!(
        table_cells(&table)[1],
        ["default/web-ingress", "1/1", "audit", "ingress 1, egress 0", "0", "0"],
        "{table}"
    );
    assert_eq!(String::from_utf8(shown).unwrap(), table, "what `wasmplane policy ls --counters` prints");

    // A record dataplane reads no verdicts: the host's 404 and its reason, at once, also with --follow.
    let verdicts = |follow: bool| {
        policy(&api, PolicyCommand::Verdicts { pod: None, verdict: Some(VerdictFilter::Deny), limit: 5, follow })
    };
    let error = verdicts(false).await.unwrap_err().to_string();
    assert!(error.starts_with("404") && error.contains("policy verdicts are not read on this host"), "{error}");
    // Sooner than the first poll of a follow (a second): refused before following.
    let followed =
        tokio::time::timeout(Duration::from_millis(900), verdicts(true)).await.expect("refused before following");
    assert_eq!(followed.unwrap_err().to_string(), error);
    h.host.stop().await;
}

/// `policy audit` and `policy log-allowed` switch the host's modes with the token, say what
/// holds after, and are refused without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_cli_switches_audit_and_allow_logging() {
    use wasmplane::inspect::{NamespacedName, PolicyCommand, PolicyToggle, policy_to};
    // A log group to log allowed connections to (written into the rules; a record dataplane
    // reads no verdicts back).
    let h = Host::start_with(|config| HostConfig { policy_log_group: 1001, ..config }, Host::synced).await;
    let api = ApiArgs { token: Some(TOKEN.into()), ..h.api() };
    let web = || Some(NamespacedName { namespace: "default".into(), name: "web-ingress".into() });
    let run = |command: PolicyCommand| {
        let api = &api;
        async move {
            let mut shown = Vec::new();
            policy_to(api, command, &mut shown).await.map(|()| String::from_utf8(shown).unwrap())
        }
    };
    let policy_row = |list: &Value| {
        list["policies"].as_array().unwrap().iter().find(|p| p["name"] == "web-ingress").unwrap().clone()
    };

    assert_eq!(
        run(PolicyCommand::LogAllowed(PolicyToggle { policy: web(), all: false, off: false })).await.unwrap(),
        "default/web-ingress: log-allowed on\n"
    );
    let (_, list) = h.get("/v1/policies").await;
    assert_eq!(
        (policy_row(&list)["audit"].clone(), policy_row(&list)["log_allowed"].clone()),
        (json!(false), json!(true)),
        "{list}"
    );
    assert!(run(PolicyCommand::Ls { counters: false }).await.unwrap().contains("enforce, log-allowed"));

    assert_eq!(
        run(PolicyCommand::Audit(PolicyToggle { policy: None, all: true, off: false })).await.unwrap(),
        "every policy on this node: audit on\n"
    );
    let (_, list) = h.get("/v1/policies").await;
    assert_eq!(policy_row(&list)["audit"], true, "{list}");
    // Allow logging on for every policy, then off for one: it stays on, and the line says so.
    run(PolicyCommand::LogAllowed(PolicyToggle { policy: None, all: true, off: false })).await.unwrap();
    assert_eq!(
        run(PolicyCommand::LogAllowed(PolicyToggle { policy: web(), all: false, off: true })).await.unwrap(),
        "default/web-ingress: log-allowed on\n"
    );
    assert_eq!(
        run(PolicyCommand::LogAllowed(PolicyToggle { policy: None, all: true, off: true })).await.unwrap(),
        "every policy on this node: log-allowed off\n"
    );
    // Audit likewise: off for one while on for every policy stays on.
    assert_eq!(
        run(PolicyCommand::Audit(PolicyToggle { policy: web(), all: false, off: true })).await.unwrap(),
        "default/web-ingress: audit on\n"
    );
    assert_eq!(
        run(PolicyCommand::Audit(PolicyToggle { policy: None, all: true, off: true })).await.unwrap(),
        "every policy on this node: audit off\n"
    );
    let (_, list) = h.get("/v1/policies").await;
    assert_eq!(
        (policy_row(&list)["audit"].clone(), policy_row(&list)["log_allowed"].clone()),
        (json!(false), json!(false)),
        "{list}"
    );

    // A policy the cluster does not have (misspelt, or not created yet): kept, listed, and said.
    let misspelt = || Some(NamespacedName { namespace: "default".into(), name: "web-ingres".into() });
    assert_eq!(
        run(PolicyCommand::Audit(PolicyToggle { policy: misspelt(), all: false, off: false })).await.unwrap(),
        "default/web-ingres: audit on\nwarning: the cluster has no NetworkPolicy default/web-ingres: the setting is \
         kept for it until switched off\n"
    );
    let (_, list) = h.get("/v1/policies").await;
    let kept = list["policies"].as_array().unwrap().iter().find(|p| p["name"] == "web-ingres").cloned();
    assert_eq!(kept.as_ref().map(|p| (&p["audit"], &p["enforced_generation"])), Some((&json!(true), &Value::Null)));
    let table = run(PolicyCommand::Ls { counters: false }).await.unwrap();
    assert!(
        table_cells(&table).iter().any(|row| row == &["default/web-ingres", "-/0", "audit", "ingress 0, egress 0"]),
        "{table}"
    );
    assert_eq!(
        run(PolicyCommand::Audit(PolicyToggle { policy: misspelt(), all: false, off: true })).await.unwrap(),
        "default/web-ingres: audit off\n"
    );
    let (_, list) = h.get("/v1/policies").await;
    assert_eq!(list["policies"].as_array().unwrap().len(), 1, "{list}");

    // Without the token: the host's 401 and its reason, and nothing changes.
    let mut shown = Vec::new();
    let refused =
        policy_to(&h.api(), PolicyCommand::Audit(PolicyToggle { policy: web(), all: false, off: false }), &mut shown)
            .await
            .unwrap_err()
            .to_string();
    assert!(refused.starts_with("401") && refused.contains("missing bearer token"), "{refused}");
    let (_, list) = h.get("/v1/policies").await;
    assert_eq!(policy_row(&list)["audit"], false, "{list}");
    h.host.stop().await;
}

/// `--follow` against a stand-in for a host that reads verdicts (a real one needs a kernel):
/// the first request with the limit asked, then polls every second for every event kept since
/// the newest printed, with the same filters, printing each event once, until the host answers an error, which ends the
/// follow with its message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdicts_follow_polls_with_the_filters_and_prints_each_event_once() {
    use std::sync::{Arc, Mutex};
    use wasmplane::inspect::{PolicyCommand, VerdictFilter, policy_to};
    let event = |at_unix_ms: u64, source_port: u16| {
        json!({ "at_unix_ms": at_unix_ms, "verdict": "audit", "direction": "ingress", "pod_address": "10.244.0.41", "pod": "default/web-1", "source": "10.0.0.1",
                "destination": "10.244.0.41", "protocol": "tcp", "source_port": source_port, "destination_port": 80, "policies": ["default/web-ingress"] })
    };
    // Newest first, as the host answers; the second poll adds two events of one millisecond, the third nothing.
    let answers = [
        vec![event(1_000, 1)],
        vec![event(2_000, 3), event(2_000, 2), event(1_000, 1)],
        vec![event(2_000, 3), event(2_000, 2), event(1_000, 1)],
    ];
    let queries: Arc<Mutex<Vec<String>>> = Arc::default();
    let recorded = queries.clone();
    let app = axum::Router::new().route(
        "/v1/policies/verdicts",
        axum::routing::get(move |uri: axum::http::Uri| async move {
            let mut queries = recorded.lock().unwrap();
            queries.push(uri.query().unwrap_or_default().to_string());
            match answers.get(queries.len() - 1) {
                Some(events) => (
                    StatusCode::OK,
                    axum::Json(json!({ "totals": { "deny": 0, "audit": 3, "lost": 0 }, "events": events })),
                ),
                None => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({ "error": "shutting down" }))),
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api = ApiArgs { api: format!("http://{}", listener.local_addr().unwrap()), token: None, token_file: None };
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let started = Instant::now();
    let command = PolicyCommand::Verdicts {
        pod: Some("default/web-1".into()),
        verdict: Some(VerdictFilter::Audit),
        limit: 5,
        follow: true,
    };
    let mut printed = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), policy_to(&api, command, &mut printed))
        .await
        .expect("the host's error ends the follow");
    assert_eq!(ended.unwrap_err().to_string(), "503 Service Unavailable: shutting down");
    assert!(started.elapsed() >= Duration::from_secs(3), "a poll a second: {:?}", started.elapsed());
    // Polls ask only for what the newest printed millisecond and later hold.
    let asked = |since: u64| {
        format!("pod=default%2Fweb-1&verdict=audit&limit={}&since_unix_ms={since}", wasmplane::policy_log::CAPACITY)
    };
    assert_eq!(
        *queries.lock().unwrap(),
        ["pod=default%2Fweb-1&verdict=audit&limit=5".to_string(), asked(1_000), asked(2_000), asked(2_000)]
    );
    // Each event once, oldest first, and no totals line.
    let printed = String::from_utf8(printed).unwrap();
    assert_eq!(
        printed,
        "00:00:01.000  AUDIT  ingress  default/web-1  10.0.0.1:1 -> 10.244.0.41:80 tcp  policies: default/web-ingress\n\
         00:00:02.000  AUDIT  ingress  default/web-1  10.0.0.1:2 -> 10.244.0.41:80 tcp  policies: default/web-ingress\n\
         00:00:02.000  AUDIT  ingress  default/web-1  10.0.0.1:3 -> 10.244.0.41:80 tcp  policies: default/web-ingress\n"
    );
}

/// A second pod on this node, which no policy selects.
const CACHE_POD: &str = "
apiVersion: v1
kind: Pod
metadata: { name: cache-1, namespace: shop, labels: { app: cache } }
spec: { nodeName: node-a, containers: [{ name: c, image: x }] }
status: { phase: Running, podIP: 10.244.0.51, podIPs: [{ ip: 10.244.0.51 }] }
";

/// An egress-only policy selecting `shop/cache-1`.
const CACHE_EGRESS_POLICY: &str = "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: { name: cache-egress, namespace: shop, uid: cache-egress-uid, generation: 1 }
spec:
  podSelector: { matchLabels: { app: cache } }
  policyTypes: [Egress]
  egress: [{ ports: [{ port: 53, protocol: UDP }] }]
";

fn pods_of(list: &Value) -> Vec<String> {
    list["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| format!("{}/{}", p["namespace"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect()
}

fn pod_row<'a>(list: &'a Value, pod: &str) -> &'a Value {
    list["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| format!("{}/{}", p["namespace"].as_str().unwrap(), p["name"].as_str().unwrap()) == pod)
        .unwrap_or_else(|| panic!("no row for {pod}: {list}"))
}

/// The enforcement flags of a pod row: ingress, egress, audit.
fn enforcement(row: &Value) -> (Value, Value, Value) {
    (row["ingress_enforced"].clone(), row["egress_enforced"].clone(), row["audit"].clone())
}

/// `cilium endpoint list|get`: the pods on this node only, each with the policies its
/// dispatch chains run, per direction; another node's pod and an unknown one are not found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_this_nodes_with_the_policies_enforced_on_them() {
    let h = Host::start().await;
    let manifests = h.dir.path().join("manifests");
    write_manifest(&manifests, "cache.yaml", CACHE_POD);
    h.wait_for_status("the second local pod", |status| status["model"]["local_pods"] == 2).await;

    let (status, list) = h.get("/v1/pods").await;
    assert_eq!(status, StatusCode::OK, "{list}");
    assert_eq!(pods_of(&list), ["default/web-1", "shop/cache-1"], "this node's, not node-b's web-2: {list}");
    let web = pod_row(&list, "default/web-1");
    assert_eq!((&web["ips"], &web["host_network"]), (&json!(["10.244.0.41"]), &json!(false)), "{list}");
    assert_eq!(enforcement(web), (json!(true), json!(false), json!(false)), "{list}");
    assert_eq!(
        web["policies"],
        json!([{ "name": "default/web-ingress", "policy_types": ["ingress"], "audit": false, "log_allowed": false, "error": null }]),
        "{list}"
    );
    assert_eq!(web["cni_allocations"], Value::Null, "this host hands out no addresses: {list}");
    let cache = pod_row(&list, "shop/cache-1");
    assert_eq!(enforcement(cache), (json!(false), json!(false), json!(false)), "{list}");
    assert_eq!(cache["policies"], json!([]), "{list}");

    let (_, default) = h.get("/v1/pods?namespace=default").await;
    assert_eq!(pods_of(&default), ["default/web-1"], "{default}");
    let (_, shop) = h.get("/v1/pods?namespace=shop").await;
    assert_eq!(pods_of(&shop), ["shop/cache-1"], "{shop}");
    let (_, prefix) = h.get("/v1/pods?namespace=sho").await;
    assert_eq!(pods_of(&prefix), Vec::<String>::new(), "{prefix}");

    let (status, detail) = h.get("/v1/pods/default/web-1").await;
    assert_eq!(status, StatusCode::OK, "{detail}");
    assert_eq!(detail["labels"], json!({ "app": "web" }), "{detail}");
    assert_eq!(detail["node"], "node-a", "{detail}");
    assert_eq!(detail["policies"], web["policies"], "{detail}");
    assert_eq!(enforcement(&detail), enforcement(web), "{detail}");
    assert_eq!(detail["recent_drops"], Value::Null, "a record dataplane reads no drops: {detail}");
    assert!(detail.get("policy_counts").is_none(), "counts only when asked for: {detail}");
    let (status, counted) = h.get("/v1/pods/default/web-1?counters=true").await;
    assert_eq!(status, StatusCode::OK, "{counted}");
    assert_eq!(counted["policy_counts"], Value::Null, "a record dataplane has no counters to read: {counted}");
    let (status, wrong) = h.get("/v1/pods/default/web-1?counters=maybe").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{wrong}");

    let (status, remote) = h.get("/v1/pods/default/web-2").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{remote}");
    assert_eq!(
        error_of(&remote),
        "pod default/web-2 is not one of this node's pods (it is on node node-b)",
        "{remote}"
    );
    let (status, unknown) = h.get("/v1/pods/default/nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{unknown}");
    assert!(error_of(&unknown).contains("not one of this node's pods"), "{unknown}");

    // An egress-only policy for the cache: its egress is enforced, its ingress still not.
    write_manifest(&manifests, "cache-egress.yaml", CACHE_EGRESS_POLICY);
    let deadline = Instant::now() + Duration::from_secs(10);
    let list = loop {
        let (_, list) = h.get("/v1/pods").await;
        if pod_row(&list, "shop/cache-1")["egress_enforced"] == true {
            break list;
        }
        assert!(Instant::now() < deadline, "egress never enforced on shop/cache-1: {list}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let cache = pod_row(&list, "shop/cache-1");
    assert_eq!(enforcement(cache), (json!(false), json!(true), json!(false)), "{list}");
    assert_eq!(
        cache["policies"],
        json!([{ "name": "shop/cache-egress", "policy_types": ["egress"], "audit": false, "log_allowed": false, "error": null }]),
        "{list}"
    );
    assert_eq!(
        enforcement(pod_row(&list, "default/web-1")),
        (json!(true), json!(false), json!(false)),
        "the other pod as it was: {list}"
    );
    h.host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pod_cli_reads_and_formats_the_running_host() {
    use wasmplane::inspect::{NamespacedName, format_pod, format_pods};
    let h = Host::start().await;
    write_manifest(&h.dir.path().join("manifests"), "cache.yaml", CACHE_POD);
    h.wait_for_status("the second local pod", |status| status["model"]["local_pods"] == 2).await;

    let (_, list) = h.get("/v1/pods").await;
    let table = format_pods(&list);
    assert_eq!(
        table_cells(&table),
        [
            vec!["POD", "IPS", "INGRESS", "EGRESS", "POLICIES"],
            vec!["default/web-1", "10.244.0.41", "enforced", "-", "default/web-ingress"],
            vec!["shop/cache-1", "10.244.0.51", "-", "-", "<none>"],
        ],
        "{table}"
    );
    let (_, detail) = h.get("/v1/pods/default/web-1").await;
    let text = format_pod(&detail);
    let lines: Vec<&str> = text.lines().collect();
    for expected in [
        "Pod:           default/web-1",
        "Labels:        app=web",
        "Ingress:       enforced",
        "Egress:        -",
        "Policy:        default/web-ingress (ingress, enforce)",
        "Recent drops:  not read on this host",
    ] {
        assert!(lines.contains(&expected), "{expected:?} in:\n{text}");
    }

    // In audit mode nothing is dropped: the table says so.
    let audit = h
        .client
        .post(h.url("/v1/policies/default/web-ingress/audit?enabled=true"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(audit.status(), StatusCode::OK);
    let (_, list) = h.get("/v1/pods?namespace=default").await;
    assert_eq!(pod_row(&list, "default/web-1")["audit"], true, "{list}");
    let table = format_pods(&list);
    assert_eq!(
        table_cells(&table)[1],
        ["default/web-1", "10.244.0.41", "audit", "-", "default/web-ingress (audit)"],
        "{table}"
    );

    let api = h.api();
    wasmplane::inspect::pods(&api, Some("shop")).await.unwrap();
    wasmplane::inspect::pod(&api, &"default/web-1".parse::<NamespacedName>().unwrap(), false).await.unwrap();
    wasmplane::inspect::pod(&api, &"default/web-1".parse::<NamespacedName>().unwrap(), true).await.unwrap();
    let remote = wasmplane::inspect::pod(&api, &"default/web-2".parse::<NamespacedName>().unwrap(), false)
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(remote, "404 Not Found: pod default/web-2 is not one of this node's pods (it is on node node-b)");
    h.host.stop().await;
}

/// `wasmplane node ls` on this host, which registers in its embedded kvstore and programs no
/// routes; on a host that does not register, the host's 404 and its reason, as an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_cli_lists_this_node_or_says_the_host_does_not_register() {
    use wasmplane::inspect::{NodeCommand, node_to};
    let h = Host::start().await;
    let mut shown = Vec::new();
    node_to(&h.api(), NodeCommand::Ls, &mut shown).await.unwrap();
    let text = String::from_utf8(shown).unwrap();
    // No Node object in the manifests: neither addresses nor pod CIDRs published.
    assert_eq!(
        text,
        "NAME     ID   ADDRESSES   POD CIDRS   ROUTE\nnode-a   1    <none>      <none>      (this node)\nRoutes:  not programmed by this host (--node-routes)\n"
    );
    h.host.stop().await;

    let h = Host::start_with(|config| HostConfig { agent: None, ..config }, |status| status["ready"] == true).await;
    let error = node_to(&h.api(), NodeCommand::Ls, &mut Vec::new()).await.unwrap_err().to_string();
    assert_eq!(error, "404 Not Found: this host does not register in the kvstore");
    h.host.stop().await;
}

/// A table as `wasmplane` prints it, cell by cell (columns are three or more spaces apart).
fn table_cells(table: &str) -> Vec<Vec<String>> {
    table.lines().map(|l| l.split("   ").map(str::trim).filter(|c| !c.is_empty()).map(String::from).collect()).collect()
}
