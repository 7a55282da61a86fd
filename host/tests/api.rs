//! The REST API end to end: a real host on loopback, driven over HTTP.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use support::rest::{
    API_SERVICE, SHOP_NAMESPACE, WEB_SERVICE, documents, endpoint_slice, error_of, json_answer, limited_config,
    upload_request, write_manifest,
};
use wasmplane::app::{HostConfig, RunningHost, start};
use wasmplane_guest_artifacts as artifacts;

const TOKEN: &str = "test-token-0123456789abcdef";

/// The `shop` namespace: web (two endpoints) and api (one, and labelled for the example filter).
fn manifests() -> String {
    documents(&[
        SHOP_NAMESPACE,
        WEB_SERVICE,
        &endpoint_slice("web", "http", 8080, &[("10.244.0.11", "node-a"), ("10.244.1.11", "node-b")]),
        API_SERVICE,
        &endpoint_slice("api", "https", 8443, &[("10.244.0.21", "node-a")]),
    ])
}

struct TestHost {
    host: Option<RunningHost>,
    client: reqwest::Client,
    dir: tempfile::TempDir,
}

fn config(dir: &Path) -> HostConfig {
    limited_config(dir, TOKEN, Duration::from_millis(200))
}

impl TestHost {
    async fn start() -> TestHost {
        let dir = tempfile::tempdir().unwrap();
        write_manifest(&dir.path().join("manifests"), "shop.yaml", &manifests());
        let host = start(config(dir.path())).await.unwrap();
        // No connection reuse: a server that answers 413 before reading a large body closes
        // the connection, and a pooled client would then fail its next request.
        let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
        let t = TestHost { host: Some(host), client, dir };
        t.wait_until("initial manifest sync", |dp| dp.contains("10.96.0.20 . tcp . 80")).await;
        t
    }

    async fn restart(&mut self) {
        self.host.take().unwrap().stop().await;
        self.host = Some(start(config(self.dir.path())).await.unwrap());
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.host.as_ref().unwrap().url())
    }

    async fn dataplane(&self) -> String {
        self.client.get(self.url("/v1/dataplane")).send().await.unwrap().text().await.unwrap()
    }

    async fn wait_until(&self, what: &str, cond: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let dp = self.dataplane().await;
            if cond(&dp) {
                return dp;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; dataplane:\n{dp}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn upload(&self, name: &str, kind: &str, bytes: &[u8]) -> (StatusCode, Value) {
        json_answer(upload_request(&self.client, &self.url(""), name, kind, bytes).bearer_auth(TOKEN)).await
    }

    async fn post(&self, path: &str) -> (StatusCode, Value) {
        json_answer(self.client.post(self.url(path)).bearer_auth(TOKEN)).await
    }

    async fn get_json(&self, path: &str) -> (StatusCode, Value) {
        json_answer(self.client.get(self.url(path))).await
    }

    async fn healthy(&self) -> bool {
        let r = self.client.get(self.url("/healthz")).send().await.unwrap();
        r.status() == StatusCode::OK
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_translator_renders_cluster_ip_services() {
    let t = TestHost::start().await;
    let dp = t.dataplane().await;
    // Load balancing as data: the frontend goes to the shard's by-count chain, which finds
    // it counted as two backends and goes to the pick chain that draws among the
    // frontend's numbered backends; off-cluster sources are masqueraded; endpoints are in
    // the host's hairpin set.
    assert!(support::set_holds(&dp, "service-ips", "10.96.0.20 . tcp . 80 : goto pick-by-count"), "{dp}");
    assert!(support::set_holds(&dp, "frontends-2", "10.96.0.20 . tcp . 80"), "{dp}");
    assert!(
        dp.contains(
            "add rule inet wasmplane-s0 pick-by-count ip daddr . meta l4proto . th dport @frontends-2 goto pick-2"
        ),
        "{dp}"
    );
    assert!(support::set_holds(&dp, "service-endpoints", "10.96.0.20 . tcp . 80 . 0 : 10.244.0.11 . 8080"), "{dp}");
    assert!(support::set_holds(&dp, "service-endpoints", "10.96.0.20 . tcp . 80 . 1 : 10.244.1.11 . 8080"), "{dp}");
    assert!(dp.contains("add rule inet wasmplane-s0 pick-2 dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 2 map @service-endpoints"), "{dp}");
    assert!(support::set_holds(&dp, "masquerade-off-cluster", "10.96.0.20 . tcp . 80"), "{dp}");
    assert!(support::set_holds(&dp, "cluster-cidrs", "10.244.0.0/16"), "{dp}");
    assert!(support::set_holds(&dp, "hairpin", "10.244.1.11 . 10.244.1.11"), "{dp}");
    let (_, state) = t.get_json("/v1/state").await;
    assert!(state["revision"].as_u64().unwrap() >= 1);
    let (status, modules) = t.get_json("/v1/modules").await;
    assert_eq!(status, StatusCode::OK);
    let builtin =
        modules["modules"].as_array().unwrap().iter().find(|m| m["name"] == "default-service-translator").unwrap();
    assert_eq!(builtin["status"], "active");
    assert!(builtin["calls"].as_u64().unwrap() >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploading_and_activating_a_module_changes_the_dataplane_and_rollback_restores_it() {
    let t = TestHost::start().await;
    let (status, body) =
        t.upload("port-filter", "service-translator", artifacts::examples::PORT_FILTER_TRANSLATOR).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["version"], 1);
    let dp = t.dataplane().await;
    // The example exposes only labelled services: api stays, web is gone.
    assert!(dp.contains("10.96.0.21 . tcp . 443 : goto svc/shop/api/tcp/443"), "{dp}");
    assert!(!dp.contains("10.96.0.20"), "{dp}");
    let (_, module) = t.get_json("/v1/modules/port-filter").await;
    assert_eq!(module["status"], "active");
    assert!(module["versions"][0]["digest"].as_str().unwrap().starts_with("sha256:"));

    // Version 2 of the same module: the default translation's bytes.
    let (status, body) = t.upload("port-filter", "service-translator", artifacts::SERVICE_TRANSLATOR).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["version"], 2);
    assert!(t.dataplane().await.contains("10.96.0.20 . tcp . 80"));

    let (status, body) = t.post("/v1/modules/port-filter/rollback").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["active_version"], 1);
    let dp = t.dataplane().await;
    assert!(!dp.contains("10.96.0.20"), "rollback must restore version 1's output:\n{dp}");
    let (status, _) = t.post("/v1/modules/port-filter/rollback").await;
    assert_eq!(status, StatusCode::CONFLICT, "nothing earlier to roll back to");

    // Explicit activation of a version, then deletion falls back to the builtin.
    let (status, _) = t.post("/v1/modules/port-filter/activate?version=2").await;
    assert_eq!(status, StatusCode::OK);
    let r = t.client.delete(t.url("/v1/modules/port-filter")).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let (_, builtin) = t.get_json("/v1/modules/default-service-translator").await;
    assert_eq!(builtin["status"], "active");
    assert!(t.dataplane().await.contains("10.96.0.20 . tcp . 80"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_uploads_are_refused_with_clear_errors_and_change_nothing() {
    let t = TestHost::start().await;
    let before = t.dataplane().await;
    let core_module = b"\0asm\x01\0\0\0".to_vec();
    let cases: Vec<(&str, &str, Vec<u8>, StatusCode, &str)> = vec![
        (
            "garbage",
            "service-translator",
            b"definitely not wasm".to_vec(),
            StatusCode::BAD_REQUEST,
            "not a WebAssembly binary",
        ),
        (
            "core",
            "service-translator",
            core_module,
            StatusCode::BAD_REQUEST,
            "core WebAssembly module, not a component",
        ),
        (
            "wrong",
            "service-translator",
            artifacts::test_programs::WRONG_WORLD.to_vec(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "implements no known wasmplane world",
        ),
        (
            "kind",
            "network-policy",
            artifacts::SERVICE_TRANSLATOR.to_vec(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "uploaded as kind network-policy but implements service-translator",
        ),
        ("huge", "service-translator", vec![0u8; 5 << 20], StatusCode::PAYLOAD_TOO_LARGE, ""),
        ("nokind", "", artifacts::SERVICE_TRANSLATOR.to_vec(), StatusCode::BAD_REQUEST, "unknown kind"),
        (
            "Bad_Name",
            "service-translator",
            artifacts::SERVICE_TRANSLATOR.to_vec(),
            StatusCode::BAD_REQUEST,
            "DNS label",
        ),
    ];
    for (name, kind, bytes, want, message) in cases {
        let (status, body) = t.upload(name, kind, &bytes).await;
        assert_eq!(status, want, "{name}: {body}");
        assert!(error_of(&body).contains(message), "{name}: {message:?} not in {body}");
    }
    // Unauthenticated and wrongly authenticated mutations.
    let url = t.url("/v1/modules/sneaky?kind=service-translator");
    let r = t.client.put(&url).body(artifacts::SERVICE_TRANSLATOR.to_vec()).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(r.text().await.unwrap().contains("missing bearer token"));
    let r = t
        .client
        .put(&url)
        .bearer_auth("wrong-token-wrong-token")
        .body(artifacts::SERVICE_TRANSLATOR.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let r = t.client.post(t.url("/v1/modules/default-service-translator/rollback")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    let (_, modules) = t.get_json("/v1/modules").await;
    let names: Vec<&str> = modules["modules"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["default-gc", "default-network-policy", "default-service-translator"], "only the builtins");
    assert_eq!(t.dataplane().await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_meant_for_uploaded_modules_are_refused_for_a_builtin_by_what_it_is() {
    let t = TestHost::start().await;
    let before = t.dataplane().await;
    let builtin = "/v1/modules/default-service-translator";
    // (method, path, status, what the error says): never "no module named" for a module the
    // API lists.
    let cases = [
        ("POST", format!("{builtin}/rollback"), StatusCode::CONFLICT, "builtin module and has no earlier version"),
        ("POST", format!("{builtin}/shadow"), StatusCode::CONFLICT, "builtin module and cannot run in shadow"),
        ("DELETE", format!("{builtin}/shadow"), StatusCode::CONFLICT, "builtin module and cannot run in shadow"),
        ("POST", format!("{builtin}/promote"), StatusCode::CONFLICT, "builtin module and cannot run in shadow"),
        ("DELETE", builtin.to_string(), StatusCode::CONFLICT, "builtin module and cannot be deleted"),
        ("POST", format!("{builtin}/activate?version=2"), StatusCode::NOT_FOUND, "has no version 2"),
    ];
    for (method, path, want, message) in cases {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let (status, body) = json_answer(t.client.request(method.clone(), t.url(&path)).bearer_auth(TOKEN)).await;
        assert_eq!(status, want, "{method} {path}: {body}");
        assert!(error_of(&body).contains(message), "{method} {path}: {message:?} not in {body}");
    }
    assert_eq!(t.dataplane().await, before, "a refused call changes nothing");

    // Its one version is version 1: activating it by number puts it back in force.
    let (status, body) =
        t.upload("port-filter", "service-translator", artifacts::examples::PORT_FILTER_TRANSLATOR).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    t.wait_until("the uploaded module in force", |dp| !dp.contains("10.96.0.20")).await;
    let (status, body) = t.post(&format!("{builtin}/activate?version=2")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(!t.dataplane().await.contains("10.96.0.20"), "the uploaded module stays in force");
    let (status, body) = t.post(&format!("{builtin}/activate?version=1")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["active_version"], 1);
    t.wait_until("the builtin back in force", |dp| dp.contains("10.96.0.20 . tcp . 80")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_string_that_does_not_parse_is_refused_in_the_apis_json() {
    let t = TestHost::start().await;
    let before = t.dataplane().await;
    // (method, path, what the error names): a missing field, a value of the wrong type.
    let cases = [
        ("POST", "/v1/policies/audit", "enabled"),
        ("POST", "/v1/policies/shop/web/audit?enabled=maybe", "enabled"),
        ("POST", "/v1/modules/default-service-translator/activate?version=latest", "version"),
        ("GET", "/v1/drops?limit=-1", "limit"),
        ("GET", "/v1/policies?counters=yes", "counters"),
    ];
    for (method, path, field) in cases {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let (status, body) = json_answer(t.client.request(method.clone(), t.url(path)).bearer_auth(TOKEN)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{method} {path}: {body}");
        let error = error_of(&body);
        assert!(error.contains("query string") && error.contains(field), "{method} {path}: {body}");
    }
    assert_eq!(t.dataplane().await, before, "a refused call changes nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_does_not_decode_is_refused_in_the_apis_json() {
    let t = TestHost::start().await;
    let before = t.dataplane().await;
    // %FF decodes to a byte that is not UTF-8, in a module name and in a namespace.
    let cases = [
        ("GET", "/v1/modules/%FF"),
        ("DELETE", "/v1/modules/%FF"),
        ("POST", "/v1/modules/%FF/rollback"),
        ("GET", "/v1/services/%FF/web"),
        ("POST", "/v1/policies/%FF/web/audit?enabled=true"),
    ];
    for (method, path) in cases {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let (status, body) = json_answer(t.client.request(method.clone(), t.url(path)).bearer_auth(TOKEN)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{method} {path}: {body}");
        assert!(error_of(&body).contains("UTF-8"), "{method} {path}: {body}");
    }
    assert_eq!(t.dataplane().await, before, "a refused call changes nothing");
}

/// Sends `head` (its blank line included) and `first` on a connection of its own, then after
/// 300 ms `second`, and reads the answer: the host answers while `second` is still to come.
async fn send_with_a_pause(addr: &str, head: &str, first: &[u8], second: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    tcp.write_all(second).await.expect("the host closed the connection on an unread body");
    let mut answer = vec![0u8; 4096];
    let n = tcp.read(&mut answer).await.expect("the answer was lost to a connection reset");
    String::from_utf8_lossy(&answer[..n]).into_owned()
}

/// A refused upload is answered, not reset: the host reads (and drops) the body of a request
/// it refuses before answering, so a client still sending it reads the 401 instead of a
/// connection reset (RFC 9112 §9.6: closing with unread input resets the connection, and the
/// reset can discard the answer before the client reads it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_uploads_are_answered_while_the_body_is_still_being_sent() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = TestHost::start().await;
    let addr = t.url("").trim_start_matches("http://").trim_end_matches('/').to_string();
    // Sends `head` and a body of `first` then `second` bytes, with a pause between them (the
    // host answers while the second is still to come), and reads the answer.
    let send_in_two_parts = |head: String, (first, second): (usize, usize)| {
        let head = format!("{head}Host: {addr}\r\nContent-Length: {}\r\n\r\n", first + second);
        let addr = addr.clone();
        async move { send_with_a_pause(&addr, &head, &vec![0u8; first], &vec![0u8; second]).await }
    };
    // Larger than the socket buffers, within the upload limit (4 MiB here).
    let text =
        send_in_two_parts("PUT /v1/modules/sneaky?kind=service-translator HTTP/1.1\r\n".into(), (1 << 20, 2 << 20))
            .await;
    assert!(text.starts_with("HTTP/1.1 401"), "{text}");
    assert!(text.contains("missing bearer token"), "{text}");
    // Authenticated but larger than the upload limit: 413, also read to the end.
    let text = send_in_two_parts(
        format!("PUT /v1/modules/huge?kind=service-translator HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n"),
        (1 << 20, 4 << 20),
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("larger than the upload limit of 4194304 bytes"), "{text}");

    // A client that waits for `100 Continue` is refused at once and not invited to send.
    let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "PUT /v1/modules/sneaky?kind=service-translator HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        3 << 20
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut answer))
        .await
        .expect("no answer without the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");

    // Through the client, many times, as the CLI uploads.
    let url = t.url("/v1/modules/sneaky?kind=service-translator");
    for round in 0..8 {
        let r = t
            .client
            .put(&url)
            .body(vec![0u8; 3 << 20])
            .send()
            .await
            .unwrap_or_else(|e| panic!("round {round}: the refusal was not answered: {e:?}"));
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "round {round}");
    }
    assert!(t.healthy().await);
}

/// An upload of unknown length (`Transfer-Encoding: chunked`, as `curl -T -` sends one) is
/// taken whole within the limit, and past it gets the same 413 naming the limit as a declared
/// length does, read to the end: the client still sending its second part reads the answer
/// instead of a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_uploads_are_taken_within_the_limit_and_answered_past_it() {
    let t = TestHost::start().await;
    let addr = t.url("").trim_start_matches("http://").trim_end_matches('/').to_string();
    // Sends `body` as chunks of at most 64 KiB, pausing 300 ms after `pause_after` bytes.
    let send_chunked = |path: &str, body: Vec<u8>, pause_after: usize| {
        let head = format!(
            "PUT {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
        );
        let framed = |part: &[u8]| -> Vec<u8> {
            part.chunks(64 << 10).flat_map(|c| [format!("{:x}\r\n", c.len()).as_bytes(), c, b"\r\n"].concat()).collect()
        };
        let (first, rest) = body.split_at(pause_after.min(body.len()));
        let (first, second) = (framed(first), [framed(rest), b"0\r\n\r\n".to_vec()].concat());
        let addr = addr.clone();
        async move { send_with_a_pause(&addr, &head, &first, &second).await }
    };
    let module = artifacts::examples::PORT_FILTER_TRANSLATOR.to_vec();
    let text = send_chunked("/v1/modules/port-filter?kind=service-translator", module, 64 << 10).await;
    assert!(text.starts_with("HTTP/1.1 201"), "{text}");
    let (_, listed) = t.get_json("/v1/modules/port-filter").await;
    assert_eq!(listed["status"], "active", "{listed}");
    assert_eq!(listed["versions"][0]["size"], artifacts::examples::PORT_FILTER_TRANSLATOR.len(), "{listed}");

    // 5 MiB against the 4 MiB limit, the last 4 MiB after the pause.
    let text = send_chunked("/v1/modules/huge?kind=service-translator", vec![0u8; 5 << 20], 1 << 20).await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("of unknown length is larger than the upload limit of 4194304 bytes"), "{text}");
    assert!(!text.to_ascii_lowercase().contains("connection: close"), "drained, so the connection stays: {text}");
    let (status, _) = t.get_json("/v1/modules/huge").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(t.healthy().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_guests_are_stopped_and_the_last_good_dataplane_stays() {
    let t = TestHost::start().await;
    let before = t.dataplane().await;
    let cases: [(&str, &[u8], &str); 4] = [
        ("looper", artifacts::test_programs::LOOP_FOREVER, "time limit"),
        ("hoarder", artifacts::test_programs::ALLOCATE_FOREVER, "memory limit"),
        ("trapper", artifacts::test_programs::TRAP, "this guest always traps"),
        ("liar", artifacts::test_programs::INVALID_OUTPUT, "outside this object's namespace"),
    ];
    for (name, bytes, message) in cases {
        let started = Instant::now();
        let (status, body) = t.upload(name, "service-translator", bytes).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{name}: {body}");
        assert!(error_of(&body).contains(message), "{name}: {message:?} not in {body}");
        assert!(error_of(&body).contains("previous module stays in force"), "{body}");
        // The 200 ms call limit did the stopping (the error says so); the bound, which includes
        // compiling the guest, only catches a stop far later, with room for a loaded machine.
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{name} was not stopped promptly: {:?}",
            started.elapsed()
        );
        assert!(t.healthy().await);
        let (_, module) = t.get_json(&format!("/v1/modules/{name}")).await;
        assert_eq!(module["status"], "failed", "{module}");
        assert!(module["last_error"].as_str().unwrap().contains(message));
        assert_eq!(t.dataplane().await, before, "{name} changed the dataplane");
    }
    let (_, builtin) = t.get_json("/v1/modules/default-service-translator").await;
    assert_eq!(builtin["status"], "active");
    let metrics = t.client.get(t.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("wasmplane_model_events_total"), "{metrics}");
    assert!(metrics.contains("result=\"refused\""), "{metrics}");
    let translator_calls_timed = metrics.lines().find_map(|l| {
        l.strip_prefix("wasmplane_guest_call_seconds_count{kind=\"service-translator\"} ")?.parse::<u64>().ok()
    });
    assert!(translator_calls_timed.is_some_and(|n| n > 0), "translator calls timed by kind: {metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_changes_flow_through_and_modules_survive_a_restart() {
    let mut t = TestHost::start().await;
    let extra = r#"
apiVersion: v1
kind: Service
metadata: { name: cart, namespace: shop }
spec:
  clusterIP: 10.96.0.30
  ports: [{ port: 9000, targetPort: 9000 }]
"#;
    std::fs::write(t.dir.path().join("manifests/cart.yaml"), extra).unwrap();
    // No endpoints: the service rejects instead of blackholing.
    t.wait_until("the new service", |dp| {
        support::set_holds(dp, "no-endpoint-services", "10.96.0.30 . tcp . 9000 : goto reject-chain")
    })
    .await;

    let (status, _) = t.upload("port-filter", "service-translator", artifacts::examples::PORT_FILTER_TRANSLATOR).await;
    assert_eq!(status, StatusCode::CREATED);
    t.restart().await;
    let dp = t.wait_until("resync after restart", |dp| dp.contains("10.96.0.21 . tcp . 443")).await;
    assert!(!dp.contains("10.96.0.20"), "the uploaded module must still be in force:\n{dp}");
    let (_, module) = t.get_json("/v1/modules/port-filter").await;
    assert_eq!(module["status"], "active");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_and_dataplane_are_readable_as_json() {
    let t = TestHost::start().await;
    let (status, dp) = t.get_json("/v1/dataplane?format=json").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(dp["mode"], "record");
    assert_eq!(dp["translator"], "default-service-translator@1");
    let web = &dp["objects"]["shop/web"];
    assert!(
        web["elements"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["map"] == "service-ips" && e["key"] == "10.96.0.20 . tcp . 80"),
        "{web}"
    );
    let (_, state) = t.get_json("/v1/state").await;
    assert_eq!(state["model"]["services"]["shop/web"]["service"]["cluster_ips"][0], "10.96.0.20");
    assert_eq!(state["model"]["context"]["node_name"], "node-a");
    let r = t.client.get(t.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_pushes_lists_and_removes_modules() {
    use wasmplane::cli::{ApiArgs, ModuleCommand, module_command};
    let t = TestHost::start().await;
    let file = t.dir.path().join("port_filter.wasm");
    std::fs::write(&file, artifacts::examples::PORT_FILTER_TRANSLATOR).unwrap();
    let api = |token: Option<&str>| ApiArgs {
        api: t.host.as_ref().unwrap().url(),
        token: token.map(str::to_string),
        token_file: None,
    };
    let push = || ModuleCommand::Push {
        name: "cli-filter".into(),
        source: file.display().to_string(),
        kind: "service-translator".into(),
        no_activate: false,
        registry: Default::default(),
    };
    let refused = module_command(api(None), push()).await.unwrap_err().to_string();
    assert!(refused.contains("401") && refused.contains("missing bearer token"), "{refused}");
    module_command(api(Some(TOKEN)), push()).await.unwrap();
    assert!(!t.dataplane().await.contains("10.96.0.20"));
    module_command(api(None), ModuleCommand::Ls).await.unwrap();
    module_command(api(Some(TOKEN)), ModuleCommand::Rm { name: "cli-filter".into() }).await.unwrap();
    assert!(t.dataplane().await.contains("10.96.0.20 . tcp . 80"), "the builtin is back in force");
    let missing = module_command(api(Some(TOKEN)), ModuleCommand::Rollback { name: "cli-filter".into() })
        .await
        .unwrap_err()
        .to_string();
    assert!(missing.contains("404"), "{missing}");
}

/// kube-proxy's operational metrics: service ports whose `Local` traffic policy finds no
/// endpoint on this node (by policy), the time of the last write the kernel accepted, full writes timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_policies_without_endpoints_and_write_times_are_in_the_metrics() {
    let t = TestHost::start().await;
    let metric = |text: &str, name: &str| -> f64 {
        let line = text.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')));
        line.unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}")).trim().parse().unwrap()
    };
    let metrics = || async { t.client.get(t.url("/metrics")).send().await.unwrap().text().await.unwrap() };
    let text = metrics().await;
    let last_sync = metric(&text, "wasmplane_dataplane_last_sync_timestamp_seconds");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!((now - 60.0..=now + 1.0).contains(&last_sync), "last sync {last_sync}, now {now}");
    assert!(metric(&text, "wasmplane_dataplane_full_sync_seconds_count") >= 1.0, "the first write is a full one");

    // A NodePort service with both traffic policies Local and two ports; its only slice
    // serves http, on `node`. Counted per port, as kube-proxy counts: metrics never has a
    // local endpoint.
    let local = |node: &str| {
        documents(&[
            "apiVersion: v1\nkind: Service\nmetadata: { name: local, namespace: shop }\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.40\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Local\n  ports: [{ name: http, port: 80, targetPort: 8080, nodePort: 30040 }, { name: metrics, port: 9090, nodePort: 30041 }]\n",
            &endpoint_slice("local", "http", 8080, &[("10.244.1.40", node)]),
        ])
    };
    let policy = |text: &str, p: &str| {
        metric(text, &format!("wasmplane_model_service_ports_without_local_endpoints{{traffic_policy=\"{p}\"}}"))
    };
    let until = |what: &'static str, want: f64| {
        let metrics = &metrics;
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let text = metrics().await;
                if text.contains("traffic_policy")
                    && policy(&text, "internal") == want
                    && policy(&text, "external") == want
                {
                    return;
                }
                assert!(Instant::now() < deadline, "{what}: {text}");
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    };
    std::fs::write(t.dir.path().join("manifests/local.yaml"), local("node-b")).unwrap();
    until("no endpoint on node-a", 2.0).await;
    std::fs::write(t.dir.path().join("manifests/local.yaml"), local("node-a")).unwrap();
    until("an http endpoint on node-a", 1.0).await;
    std::fs::write(t.dir.path().join("manifests/local.yaml"), local("node-b")).unwrap();
    until("the endpoint moved away", 2.0).await;
    std::fs::remove_file(t.dir.path().join("manifests/local.yaml")).unwrap();
    until("the service gone", 0.0).await;
}

/// kube-proxy waits for its Node's pod CIDR in NodeCIDR mode; here `/readyz` says the host
/// cannot tell local traffic apart until the Node has one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_waits_for_the_nodes_pod_cidr_in_node_cidr_mode() {
    let dir = tempfile::tempdir().unwrap();
    write_manifest(&dir.path().join("manifests"), "shop.yaml", &manifests());
    let host = start(HostConfig {
        local_detection: wasmplane::controller::LocalDetection::NodeCidr,
        node_name: "node-a".into(),
        ..config(dir.path())
    })
    .await
    .unwrap();
    let readyz = || async {
        reqwest::get(format!("{}/readyz", host.url()))
            .await
            .map(|r| async { (r.status(), r.text().await.unwrap()) })
            .unwrap()
            .await
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let (status, body) = loop {
        let (status, body) = readyz().await;
        if !body.contains("initial sync") {
            break (status, body);
        }
        assert!(Instant::now() < deadline, "never synced: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("no pod CIDR yet"), "{body}");

    write_manifest(
        &dir.path().join("manifests"),
        "node.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: { name: node-a }\nspec: { podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24] }\n",
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while readyz().await.0 != StatusCode::OK {
        assert!(Instant::now() < deadline, "not ready with the Node's pod CIDR: {}", readyz().await.1);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    host.stop().await;
}

/// `--metrics-listen` (kube-proxy's `--metrics-bind-address`): the metrics alone, on an
/// address of their own, without a token; a port still taken (by the kube-proxy this host
/// replaces) is asked for again until it is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_alone_on_a_listener_of_their_own() {
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_manifest(&dir.path().join("manifests"), "shop.yaml", &manifests());
    let host =
        start(HostConfig { metrics_listen: Some("127.0.0.1:0".parse().unwrap()), ..config(dir.path()) }).await.unwrap();
    let metrics_addr = host.metrics_addr.expect("a free port is bound at start");
    assert_ne!(metrics_addr, host.addr);
    let answer = client.get(format!("http://{metrics_addr}/metrics")).send().await.unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    assert!(answer.text().await.unwrap().contains("wasmplane_model_events_total"));
    // kube-proxy's `/proxyMode`: this test host records its dataplane instead of writing one.
    let mode = client.get(format!("http://{metrics_addr}/proxyMode")).send().await.unwrap();
    assert_eq!(mode.headers()["content-type"], "text/plain; charset=utf-8");
    assert_eq!(mode.text().await.unwrap(), "record");
    for path in ["/v1/status", "/v1/modules", "/healthz"] {
        assert_eq!(
            client.get(format!("http://{metrics_addr}{path}")).send().await.unwrap().status(),
            StatusCode::NOT_FOUND,
            "{path}"
        );
    }
    host.stop().await;

    let blocker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = blocker.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_manifest(&dir.path().join("manifests"), "shop.yaml", &manifests());
    let host = start(HostConfig { metrics_listen: Some(taken), ..config(dir.path()) }).await.unwrap();
    assert_eq!(host.metrics_addr, None, "the port is taken");
    assert!(
        client.get(format!("{}/healthz", host.url())).send().await.unwrap().status().is_success(),
        "the host serves anyway"
    );
    drop(blocker);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.get(format!("http://{taken}/metrics")).send().await {
            Ok(answer) if answer.status() == StatusCode::OK => break,
            _ => assert!(Instant::now() < deadline, "metrics not served on {taken} once it was free"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    host.stop().await;
}

/// `--policy-log-rate`: the rate and burst of every log rule, the service side's and the
/// policy dispatch chains' alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_rate_reaches_every_log_rule() {
    // A pod of this node (node-a) that a policy selects: its dispatch chain logs denies.
    const POD_AND_POLICY: &str = "
apiVersion: v1
kind: Pod
metadata: { name: web-1, namespace: shop, labels: { app: web } }
spec: { nodeName: node-a, containers: [{ name: c, image: x }] }
status: { phase: Running, podIP: 10.244.0.11, podIPs: [{ ip: 10.244.0.11 }] }
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: { name: web-ingress, namespace: shop, uid: web-ingress-uid, generation: 1 }
spec:
  podSelector: { matchLabels: { app: web } }
  policyTypes: [Ingress]
  ingress: [{ from: [{ podSelector: { matchLabels: { app: client } } }] }]
";
    let dir = tempfile::tempdir().unwrap();
    write_manifest(&dir.path().join("manifests"), "shop.yaml", &documents(&[&manifests(), POD_AND_POLICY]));
    let host = start(HostConfig {
        policy_log_group: 1001,
        policy_log_rate: 50,
        node_name: "node-a".into(),
        ..config(dir.path())
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = client.get(format!("{}/v1/dataplane", host.url())).send().await.unwrap().text().await.unwrap();
        if text.contains("10.96.0.20 . tcp . 80") && text.contains("wasmplane-policy deny") {
            break text;
        }
        assert!(Instant::now() < deadline, "no initial sync: {text}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let log_rules: Vec<&str> = text.lines().filter(|l| l.contains(" log group 1001 ")).collect();
    assert!(!log_rules.is_empty(), "{text}");
    // The policy side's limit is the rule's own; the service side's is each frontend's (its
    // meter), the node as a whole held to ten times it.
    let (service, policy): (Vec<&str>, Vec<&str>) = log_rules.iter().partition(|l| l.contains("wasmplane-service "));
    assert!(policy.iter().all(|l| l.contains("limit rate 50/second burst 100 packets log group 1001")), "{policy:#?}");
    assert!(
        service.iter().all(|l| l.contains("th dport limit rate 50/second burst 100 packets }")
            && l.contains("limit rate 500/second burst 1000 packets log group 1001")),
        "{service:#?}"
    );
    for prefix in ["wasmplane-service no-endpoints", "wasmplane-policy deny ingress 10.244.0.11"] {
        assert!(log_rules.iter().any(|l| l.contains(prefix)), "no {prefix:?} log rule: {log_rules:#?}");
    }
    host.stop().await;
}
