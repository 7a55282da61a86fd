//! Node-local inspection for operators (`wasmplane status`, `wasmplane service ls|get`, as
//! `cilium status` and `cilium service list`): the host's `GET /v1/status` and
//! `GET /v1/services` shown as text. The formatting is pure (JSON in, text out), apart from
//! the calls.

use anyhow::{Context, anyhow, bail};
use serde_json::Value;

use crate::cli::ApiArgs;

/// The HTTP client for the host's API. A host serving TLS with a private CA: WASMPLANE_CA_CERT
/// names the CA (PEM).
pub(crate) fn api_client() -> anyhow::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder();
    if let Some(ca) = std::env::var_os("WASMPLANE_CA_CERT") {
        let pem = crate::auth::read_pem(std::path::Path::new(&ca))?;
        builder = builder.add_root_certificate(reqwest::Certificate::from_pem(&pem).context("WASMPLANE_CA_CERT is not a PEM certificate")?);
    }
    builder.build().context("building the HTTP client")
}

/// `GET` of the API path `segments` (each escaped as one segment), as JSON; an error answer
/// is an error with the host's message.
async fn get_json(api: &ApiArgs, segments: &[&str], query: &[(&str, &str)]) -> anyhow::Result<Value> {
    let mut url = reqwest::Url::parse(&api.api).with_context(|| format!("--api {:?} is not a URL", api.api))?;
    url.path_segments_mut().map_err(|()| anyhow!("--api {:?} cannot have a path", api.api))?.pop_if_empty().extend(segments);
    let mut request = api_client()?.get(url.clone()).query(query);
    if let Some(token) = api.token()? {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.with_context(|| format!("calling {url}"))?;
    let status = response.status();
    let text = response.text().await.with_context(|| format!("reading the answer of {url}"))?;
    if !status.is_success() {
        let message = serde_json::from_str::<Value>(&text).ok().and_then(|v| v["error"].as_str().map(str::to_string)).unwrap_or(text);
        bail!("{status}: {message}");
    }
    serde_json::from_str(&text).with_context(|| format!("the answer of {url} is not JSON"))
}

/// Prints this node's summary; returns whether the host is ready.
pub async fn status(api: &ApiArgs) -> anyhow::Result<bool> {
    let summary = get_json(api, &["v1", "status"], &[]).await?;
    print!("{}", format_status(&summary));
    Ok(summary["ready"].as_bool().unwrap_or(false))
}

/// Prints the services of this node's model as a table (those of `namespace` only, if given).
pub async fn services(api: &ApiArgs, namespace: Option<&str>) -> anyhow::Result<()> {
    let query: Vec<(&str, &str)> = namespace.map(|ns| ("namespace", ns)).into_iter().collect();
    let list = get_json(api, &["v1", "services"], &query).await?;
    print!("{}", format_services(&list));
    Ok(())
}

/// Prints one service as this node has it: model view, applied rules, error (JSON).
pub async fn service(api: &ApiArgs, namespace: &str, name: &str) -> anyhow::Result<()> {
    let detail = get_json(api, &["v1", "services", namespace, name], &[]).await?;
    print!("{}", format_service(&detail));
    Ok(())
}

/// `key: value` lines, the values aligned.
fn aligned(lines: &[(String, String)]) -> String {
    let width = lines.iter().map(|(key, _)| key.len() + 1).max().unwrap_or(0);
    lines.iter().map(|(key, value)| format!("{:<width$}  {value}\n", format!("{key}:"))).collect()
}

/// A count field of `value` (`?` when absent: an older or other host).
fn count(value: &Value) -> String {
    value.as_u64().map_or_else(|| "?".to_string(), |n| n.to_string())
}

fn ago(seconds: &Value) -> String {
    seconds.as_u64().map_or_else(|| "never".to_string(), |s| format!("{s}s ago"))
}

/// A guest kind as a line's key.
fn kind_title(kind: &str) -> String {
    match kind {
        "service-translator" => "Service translator".into(),
        "network-policy" => "Network policy".into(),
        "gc" => "GC".into(),
        other => other.into(),
    }
}

/// `GET /v1/status` as aligned `key: value` lines.
pub fn format_status(status: &Value) -> String {
    let mut lines: Vec<(String, String)> = Vec::new();
    let mut line = |key: &str, value: String| lines.push((key.to_string(), value));
    line(
        "Ready",
        match (status["ready"].as_bool(), status["not_ready_reason"].as_str()) {
            (Some(true), _) => "yes".into(),
            (_, Some(reason)) => format!("no: {reason}"),
            _ => "no".into(),
        },
    );
    line("Node", status["node"].as_str().unwrap_or("?").into());
    let role = status["role"].as_str().unwrap_or("?");
    line(
        "Role",
        match status["leader"].as_bool() {
            Some(true) => format!("{role} (leader)"),
            Some(false) => format!("{role} (standby)"),
            None => role.into(),
        },
    );
    let kv = &status["kvstore"];
    let mut kvstore = kv["backend"].as_str().unwrap_or("?").to_string();
    if let Some(id) = kv["node_id"].as_u64() {
        kvstore += &format!(", node id {id}");
    }
    if !kv["heartbeat_age_seconds"].is_null() {
        kvstore += &format!(", operator heartbeat {}", ago(&kv["heartbeat_age_seconds"]));
    }
    line("Kvstore", kvstore);
    let model = &status["model"];
    line("Model", format!("revision {} ({} events, {} revisions since start)", count(&model["revision"]), count(&model["events_total"]), count(&model["revisions_total"])));
    let errors = status["service_errors"].as_u64().unwrap_or(0);
    let failing = if errors > 0 { format!(", {errors} failing translation") } else { String::new() };
    line("Services", format!("{}{failing}", count(&model["services"])));
    line("Local pods", count(&model["local_pods"]));
    line("Policies", count(&model["policies"]));
    let dp = &status["dataplane"];
    let held = if dp["held"].as_bool() == Some(true) { ", previous run's rules held" } else { "" };
    line("Dataplane", format!("{}, {} objects{held}", dp["mode"].as_str().unwrap_or("?"), count(&dp["objects"])));
    let failing_for = if dp["sync_failing_for_seconds"].is_null() { String::new() } else { format!(", FAILING for {}s", count(&dp["sync_failing_for_seconds"])) };
    line("Last sync", format!("{} ({} ok, {} failed){failing_for}", ago(&dp["last_sync_age_seconds"]), count(&dp["syncs_ok"]), count(&dp["syncs_failed"])));
    if let Some(modules) = status["modules"].as_object() {
        // The kinds this host knows in their usual order, then any other.
        const KNOWN: [&str; 3] = ["service-translator", "network-policy", "gc"];
        let known = KNOWN.iter().filter_map(|kind| modules.get_key_value(*kind));
        for (kind, module) in known.chain(modules.iter().filter(|(kind, _)| !KNOWN.contains(&kind.as_str()))) {
            line(&kind_title(kind), module.as_str().unwrap_or("?").into());
        }
    }
    for failed in status["failed_modules"].as_array().into_iter().flatten() {
        let error = failed["error"].as_str().unwrap_or("no error recorded");
        line("Failed module", format!("{} ({}): {error}", failed["name"].as_str().unwrap_or("?"), failed["kind"].as_str().unwrap_or("?")));
    }
    aligned(&lines)
}

/// A JSON list of strings joined with `,` (`<none>` when empty, as kubectl writes it).
fn joined(values: impl Iterator<Item = String>) -> String {
    let text = values.collect::<Vec<_>>().join(",");
    if text.is_empty() { "<none>".into() } else { text }
}

/// `GET /v1/services` as a table: NAMESPACE/NAME TYPE CLUSTER-IPS PORTS ENDPOINTS ERROR.
pub fn format_services(list: &Value) -> String {
    let mut rows = vec![["NAMESPACE/NAME", "TYPE", "CLUSTER-IPS", "PORTS", "ENDPOINTS", "ERROR"].map(String::from)];
    for s in list["services"].as_array().into_iter().flatten() {
        let ips = joined(s["cluster_ips"].as_array().into_iter().flatten().filter_map(|ip| ip.as_str().map(str::to_string)));
        // kubectl's form: port[:node port]/protocol.
        let ports = joined(s["ports"].as_array().into_iter().flatten().map(|p| {
            let node_port = p["node_port"].as_u64().map(|n| format!(":{n}")).unwrap_or_default();
            format!("{}{node_port}/{}", count(&p["port"]), p["protocol"].as_str().unwrap_or("?"))
        }));
        let e = &s["endpoints"];
        let endpoints = format!("{}/{}, local {}/{}", count(&e["ready"]), count(&e["total"]), count(&e["local_ready"]), count(&e["local"]));
        let service = s["service"].as_str().unwrap_or("?").to_string();
        let kind = s["type"].as_str().unwrap_or("?").to_string();
        rows.push([service, kind, ips, ports, endpoints, s["error"].as_str().unwrap_or_default().to_string()]);
    }
    let mut widths = [0; 6];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let line: String = row.iter().zip(widths).map(|(cell, width)| format!("{cell:<width$}   ")).collect();
        out += line.trim_end();
        out.push('\n');
    }
    out
}

/// `GET /v1/services/{namespace}/{name}` as indented JSON.
pub fn format_service(detail: &Value) -> String {
    let mut text = serde_json::to_string_pretty(detail).unwrap_or_else(|_| detail.to_string());
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn status_lines_are_aligned_and_say_what_fails() {
        let status = json!({
            "ready": false, "not_ready_reason": "initial sync pending", "node": "node-a", "role": "operator", "leader": true,
            "kvstore": { "backend": "etcd", "node_id": null, "heartbeat_age_seconds": null },
            "model": { "revision": 7, "services": 3, "local_pods": 2, "policies": 1, "events_total": 12, "revisions_total": 7 },
            "dataplane": { "mode": "nftables", "objects": 5, "held": false, "last_sync_age_seconds": 4, "sync_failing_for_seconds": 9, "syncs_ok": 3, "syncs_failed": 1 },
            "modules": { "gc": "default-gc@1", "service-translator": "flaky@2" },
            "failed_modules": [{ "name": "broken", "kind": "network-policy", "error": "trap" }],
            "service_errors": 2,
        });
        let text = format_status(&status);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Ready:               no: initial sync pending", "{text}");
        assert!(lines.contains(&"Role:                operator (leader)"), "{text}");
        assert!(lines.contains(&"Kvstore:             etcd"), "{text}");
        assert!(lines.contains(&"Services:            3, 2 failing translation"), "{text}");
        assert!(lines.contains(&"Last sync:           4s ago (3 ok, 1 failed), FAILING for 9s"), "{text}");
        let translator = lines.iter().position(|l| *l == "Service translator:  flaky@2");
        let gc = lines.iter().position(|l| *l == "GC:                  default-gc@1");
        assert!(translator.is_some() && translator < gc, "the translator first: {text}");
        assert!(lines.contains(&"Failed module:       broken (network-policy): trap"), "{text}");
        // Every value starts in the same column.
        assert!(lines.iter().all(|l| l.get(19..21) == Some("  ") && !l[21..].starts_with(' ')), "{text}");
    }

    #[test]
    fn services_table_has_kubectl_ports_and_endpoint_counts() {
        let list = json!({ "services": [
            { "service": "shop/web", "type": "NodePort", "cluster_ips": ["10.96.0.20", "fd00::20"], "ports": [{ "port": 80, "protocol": "TCP", "node_port": 30080 }, { "port": 53, "protocol": "UDP", "node_port": null }],
              "endpoints": { "total": 3, "ready": 2, "local": 2, "local_ready": 1 }, "error": null },
            { "service": "other/x", "type": "ClusterIP", "cluster_ips": [], "ports": [], "endpoints": { "total": 0, "ready": 0, "local": 0, "local_ready": 0 }, "error": "invalid IP" },
        ]});
        let text = format_services(&list);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[0], "NAMESPACE/NAME   TYPE        CLUSTER-IPS           PORTS                 ENDPOINTS        ERROR", "{text}");
        assert_eq!(lines[1], "shop/web         NodePort    10.96.0.20,fd00::20   80:30080/TCP,53/UDP   2/3, local 1/2", "{text}");
        assert_eq!(lines[2], "other/x          ClusterIP   <none>                <none>                0/0, local 0/0   invalid IP", "{text}");
    }
}
