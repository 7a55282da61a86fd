//! Node-local inspection for operators (`wasmplane status`, `wasmplane service ls|get`,
//! `wasmplane pod ls|get`, `wasmplane node ls`, `wasmplane policy
//! ls|verdicts|audit|log-allowed`, `wasmplane drops`, as `cilium status`, `cilium service
//! list`, `cilium endpoint list|get`, `cilium node list` and `hubble observe --verdict
//! DROPPED`): the host's `GET /v1/status`, `GET /v1/services`, `GET /v1/pods`, `GET
//! /v1/cluster/nodes`, `GET /v1/policies[/verdicts]` and `GET /v1/drops` shown as text, and
//! the policy toggles (`POST /v1/policies[/{ns}/{name}]/audit|log-allowed`). The formatting
//! is pure (JSON in, text out), apart from the calls.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use serde_json::Value;

use crate::cli::ApiArgs;

/// The HTTP client for the host's API. A host serving TLS with a private CA: WASMPLANE_CA_CERT
/// names the CA (PEM).
pub(crate) fn api_client() -> anyhow::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder();
    if let Some(ca) = std::env::var_os("WASMPLANE_CA_CERT") {
        let pem = crate::auth::read_pem(std::path::Path::new(&ca))?;
        builder = builder.add_root_certificate(
            reqwest::Certificate::from_pem(&pem).context("WASMPLANE_CA_CERT is not a PEM certificate")?,
        );
    }
    builder.build().context("building the HTTP client")
}

/// `GET` of the API path `segments` (each escaped as one segment), as JSON; an error answer
/// is an error with the host's message.
async fn get_json(api: &ApiArgs, segments: &[&str], query: &[(&str, &str)]) -> anyhow::Result<Value> {
    call_json(api, reqwest::Method::GET, segments, query).await
}

/// [`get_json`] with another method (`POST` of the policy toggles).
async fn call_json(
    api: &ApiArgs,
    method: reqwest::Method,
    segments: &[&str],
    query: &[(&str, &str)],
) -> anyhow::Result<Value> {
    let mut url = reqwest::Url::parse(&api.api).with_context(|| format!("--api {:?} is not a URL", api.api))?;
    url.path_segments_mut()
        .map_err(|()| anyhow!("--api {:?} cannot have a path", api.api))?
        .pop_if_empty()
        .extend(segments);
    let mut request = api_client()?.request(method, url.clone()).query(query);
    if let Some(token) = api.token()? {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.with_context(|| format!("calling {url}"))?;
    let status = response.status();
    let text = response.text().await.with_context(|| format!("reading the answer of {url}"))?;
    if !status.is_success() {
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or(text);
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
    line(
        "Model",
        format!(
            "revision {} ({} events, {} revisions since start)",
            count(&model["revision"]),
            count(&model["events_total"]),
            count(&model["revisions_total"])
        ),
    );
    let errors = status["service_errors"].as_u64().unwrap_or(0);
    let failing = if errors > 0 { format!(", {errors} failing translation") } else { String::new() };
    line("Services", format!("{}{failing}", count(&model["services"])));
    line("Local pods", count(&model["local_pods"]));
    // Since the host started, when it reads them (`GET /v1/policies/verdicts`).
    let verdicts = &status["policy_verdicts"];
    let logged = if verdicts.is_null() {
        String::new()
    } else {
        format!(", {} packets denied, {} audited since start", count(&verdicts["deny"]), count(&verdicts["audit"]))
    };
    line("Policies", format!("{}{logged}", count(&model["policies"])));
    let cni = &status["cni"];
    if !cni.is_null() {
        line("CNI", format_cni(cni));
    }
    let dp = &status["dataplane"];
    let held = if dp["held"].as_bool() == Some(true) { ", previous run's rules held" } else { "" };
    line("Dataplane", format!("{}, {} objects{held}", dp["mode"].as_str().unwrap_or("?"), count(&dp["objects"])));
    let failing_for = if dp["sync_failing_for_seconds"].is_null() {
        String::new()
    } else {
        format!(", FAILING for {}s", count(&dp["sync_failing_for_seconds"]))
    };
    line(
        "Last sync",
        format!(
            "{} ({} ok, {} failed){failing_for}",
            ago(&dp["last_sync_age_seconds"]),
            count(&dp["syncs_ok"]),
            count(&dp["syncs_failed"])
        ),
    );
    // Why writes fail, while they do; an old refusal is only in the JSON.
    if let Some(error) =
        dp["last_write_error"]["message"].as_str().filter(|_| !dp["sync_failing_for_seconds"].is_null())
    {
        line("Last sync error", error.to_string());
    }
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
        line(
            "Failed module",
            format!("{} ({}): {error}", failed["name"].as_str().unwrap_or("?"), failed["kind"].as_str().unwrap_or("?")),
        );
    }
    aligned(&lines)
}

/// A JSON list of strings joined with `,` (`<none>` when empty, as kubectl writes it).
fn joined(values: impl Iterator<Item = String>) -> String {
    let text = values.collect::<Vec<_>>().join(",");
    if text.is_empty() { "<none>".into() } else { text }
}

/// The CNI daemon in one line: serving or not, chained or our own addresses per pod CIDR,
/// the pods' MTU.
fn format_cni(cni: &Value) -> String {
    if cni["serving"].as_bool() != Some(true) {
        return "not serving yet (waiting for this node's pod CIDRs)".into();
    }
    if cni["chained"].as_bool() == Some(true) {
        let chained = "serving, chained (addresses and MTU are the other plugin's)";
        // The pods it knows the addresses of; a host before the count says nothing of them.
        return match cni["attachments"].as_u64() {
            Some(1) => format!("{chained}, 1 attachment"),
            Some(n) => format!("{chained}, {n} attachments"),
            None => chained.into(),
        };
    }
    let pools = cni["pools"].as_array().into_iter().flatten().map(|p| {
        format!("{} {}/{} allocated", p["cidr"].as_str().unwrap_or("?"), count(&p["allocated"]), count(&p["capacity"]))
    });
    let mtu = cni["mtu"].as_u64().map_or("the kernel's default MTU".to_string(), |m| format!("MTU {m}"));
    std::iter::once("serving".to_string()).chain(pools).chain([mtu]).collect::<Vec<_>>().join(", ")
}

/// `GET /v1/services` as a table: NAMESPACE/NAME TYPE CLUSTER-IPS PORTS ENDPOINTS ERROR.
pub fn format_services(list: &Value) -> String {
    let mut rows = vec![["NAMESPACE/NAME", "TYPE", "CLUSTER-IPS", "PORTS", "ENDPOINTS", "ERROR"].map(String::from)];
    for s in list["services"].as_array().into_iter().flatten() {
        let ips =
            joined(s["cluster_ips"].as_array().into_iter().flatten().filter_map(|ip| ip.as_str().map(str::to_string)));
        // kubectl's form: port[:node port]/protocol.
        let ports = joined(s["ports"].as_array().into_iter().flatten().map(|p| {
            let node_port = p["node_port"].as_u64().map(|n| format!(":{n}")).unwrap_or_default();
            format!("{}{node_port}/{}", count(&p["port"]), p["protocol"].as_str().unwrap_or("?"))
        }));
        let e = &s["endpoints"];
        let endpoints = format!(
            "{}/{}, local {}/{}",
            count(&e["ready"]),
            count(&e["total"]),
            count(&e["local_ready"]),
            count(&e["local"])
        );
        let service = s["service"].as_str().unwrap_or("?").to_string();
        let kind = s["type"].as_str().unwrap_or("?").to_string();
        rows.push([service, kind, ips, ports, endpoints, s["error"].as_str().unwrap_or_default().to_string()]);
    }
    table(&rows)
}

/// Rows as columns padded to their widest cell, three spaces apart (the first row is the header).
fn table<Row: AsRef<[String]>>(rows: &[Row]) -> String {
    let mut widths: Vec<usize> = Vec::new();
    for row in rows {
        for (column, cell) in row.as_ref().iter().enumerate() {
            if widths.len() <= column {
                widths.push(0);
            }
            widths[column] = widths[column].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let line: String = row.as_ref().iter().zip(&widths).map(|(cell, width)| format!("{cell:<width$}   ")).collect();
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

/// A pod or a policy as `namespace/name` on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespacedName {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for NamespacedName {
    type Err = String;

    fn from_str(text: &str) -> Result<NamespacedName, String> {
        match text.split_once('/') {
            Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(NamespacedName { namespace: namespace.into(), name: name.into() })
            }
            _ => Err(format!("{text:?} is not NAMESPACE/NAME")),
        }
    }
}

/// Prints the pods on this node as a table (those of `namespace` only, if given).
pub async fn pods(api: &ApiArgs, namespace: Option<&str>) -> anyhow::Result<()> {
    let query: Vec<(&str, &str)> = namespace.map(|ns| ("namespace", ns)).into_iter().collect();
    let list = get_json(api, &["v1", "pods"], &query).await?;
    print!("{}", format_pods(&list));
    Ok(())
}

/// Prints one pod of this node: addresses, labels, the policies selecting it, its latest drops.
pub async fn pod(api: &ApiArgs, pod: &NamespacedName, counters: bool) -> anyhow::Result<()> {
    let query: &[(&str, &str)] = if counters { &[("counters", "true")] } else { &[] };
    let detail = get_json(api, &["v1", "pods", &pod.namespace, &pod.name], query).await?;
    print!("{}", format_pod(&detail));
    Ok(())
}

/// A pod's addresses, `(host network)` after them when they are the node's.
fn pod_ips(pod: &Value) -> String {
    let ips = joined(pod["ips"].as_array().into_iter().flatten().filter_map(|ip| ip.as_str().map(str::to_string)));
    if pod["host_network"].as_bool() == Some(true) { format!("{ips} (host network)") } else { ips }
}

/// How one direction of a pod is decided: `enforced` when a policy not in audit mode selects
/// it, `audit` when only policies in audit mode do (nothing is dropped), `-` when none does.
fn pod_direction(pod: &Value, direction: &str) -> &'static str {
    let selecting: Vec<&Value> = pod["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["policy_types"].as_array().is_some_and(|types| types.iter().any(|t| t == direction)))
        .collect();
    if selecting.iter().any(|p| p["audit"] != true) {
        "enforced"
    } else if selecting.is_empty() {
        "-"
    } else {
        "audit"
    }
}

/// A selecting policy's name, `(audit)` after it in audit mode.
fn policy_name(policy: &Value) -> String {
    let name = policy["name"].as_str().unwrap_or("?");
    if policy["audit"] == true { format!("{name} (audit)") } else { name.to_string() }
}

/// `GET /v1/pods` as a table: POD IPS INGRESS EGRESS POLICIES (`cilium endpoint list`).
pub fn format_pods(list: &Value) -> String {
    let mut rows = vec![["POD", "IPS", "INGRESS", "EGRESS", "POLICIES"].map(String::from)];
    for p in list["pods"].as_array().into_iter().flatten() {
        let pod = format!("{}/{}", p["namespace"].as_str().unwrap_or("?"), p["name"].as_str().unwrap_or("?"));
        let policies = joined(p["policies"].as_array().into_iter().flatten().map(policy_name));
        rows.push([pod, pod_ips(p), pod_direction(p, "ingress").into(), pod_direction(p, "egress").into(), policies]);
    }
    table(&rows)
}

/// `GET /v1/pods/{namespace}/{name}` as aligned `key: value` lines (a `Policy` line per
/// selecting policy), then its latest drops, oldest first (`cilium endpoint get`).
pub fn format_pod(detail: &Value) -> String {
    let mut lines: Vec<(String, String)> = Vec::new();
    let mut line = |key: &str, value: String| lines.push((key.to_string(), value));
    line("Pod", format!("{}/{}", detail["namespace"].as_str().unwrap_or("?"), detail["name"].as_str().unwrap_or("?")));
    line("Node", detail["node"].as_str().unwrap_or("?").into());
    line("IPs", pod_ips(detail));
    line(
        "Labels",
        joined(
            detail["labels"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(key, value)| format!("{key}={}", value.as_str().unwrap_or("?"))),
        ),
    );
    line("Ingress", pod_direction(detail, "ingress").into());
    line("Egress", pod_direction(detail, "egress").into());
    for policy in detail["policies"].as_array().into_iter().flatten() {
        let types = policy["policy_types"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(",");
        let mode = if policy["audit"] == true { "audit" } else { "enforce" };
        let error = policy["error"].as_str().map(|e| format!(", newest generation refused: {e}")).unwrap_or_default();
        line("Policy", format!("{} ({types}, {mode}{error})", policy["name"].as_str().unwrap_or("?")));
    }
    for allocation in detail["cni_allocations"].as_array().into_iter().flatten() {
        let addresses = allocation["addresses"].as_array().into_iter().flatten().map(|a| {
            format!("{} from {}", a["ip"].as_str().unwrap_or("?"), a["pod_cidr"].as_str().unwrap_or("no pod CIDR now"))
        });
        line(
            "CNI",
            format!(
                "{} (container {}, {})",
                addresses.collect::<Vec<_>>().join(", "),
                allocation["container_id"].as_str().unwrap_or("?"),
                allocation["interface"].as_str().unwrap_or("?")
            ),
        );
    }
    if let Some(counts) = detail.get("policy_counts") {
        for (key, direction) in [("Ingress counts", "ingress"), ("Egress counts", "egress")] {
            if counts.is_null() {
                line(key, "not read on this host (it writes no kernel)".into());
            } else if let Some(value) = counts[direction].as_object() {
                line(key, direction_counts(value));
            }
        }
    }
    let drops = detail["recent_drops"].as_array();
    line(
        "Recent drops",
        match drops.map(Vec::len) {
            None => "not read on this host".into(),
            Some(0) => "none logged".into(),
            Some(n) => format!("{n}, oldest first:"),
        },
    );
    let mut out = aligned(&lines);
    // The host answers newest first.
    out.extend(drops.into_iter().flatten().rev().map(|event| format_drop(event) + "\n"));
    out
}

/// One direction of `policy_counts`: `POLICY accepted N, …; dropped N` (`would drop` in
/// audit mode, when any).
fn direction_counts(counts: &serde_json::Map<String, Value>) -> String {
    let accepted = counts
        .get("policies")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|p| format!("{} accepted {}", p["policy"].as_str().unwrap_or("?"), p["accepted"]));
    let mut parts = vec![accepted.collect::<Vec<_>>().join(", ")];
    parts.push(format!("dropped {}", counts.get("dropped").unwrap_or(&Value::Null)));
    if counts.get("would_drop").and_then(Value::as_u64).is_some_and(|n| n > 0) {
        parts.push(format!("would drop {}", counts["would_drop"]));
    }
    parts.retain(|p| !p.is_empty());
    parts.join("; ")
}

/// `wasmplane node …`: the nodes this node's agent knows (this cluster's registry, and other
/// clusters' it follows), through its host's REST API.
#[derive(clap::Subcommand, Debug)]
pub enum NodeCommand {
    /// One line per node (`cilium node list`): ID, addresses, pod CIDRs, the route this node
    /// has to its pods; then this node's route errors and the operator's heartbeat age.
    Ls,
}

/// Runs a `wasmplane node` command against the host of `api`.
pub async fn node(api: &ApiArgs, command: NodeCommand) -> anyhow::Result<()> {
    node_to(api, command, &mut std::io::stdout()).await
}

/// [`node`], printing to `out` (for tests to read what a person would see).
pub async fn node_to(
    api: &ApiArgs,
    command: NodeCommand,
    out: &mut (impl std::io::Write + Send),
) -> anyhow::Result<()> {
    match command {
        NodeCommand::Ls => {
            // A host that does not register in the kvstore answers 404 with why.
            let answer = get_json(api, &["v1", "cluster", "nodes"], &[]).await?;
            write!(out, "{}", format_nodes(&answer))?;
            Ok(())
        }
    }
}

/// The strings of a JSON list (none for anything else).
fn strings(list: &Value) -> impl Iterator<Item = &str> {
    list.as_array().into_iter().flatten().filter_map(Value::as_str)
}

/// Whether two CIDRs are one network: the routes are to the network of a pod CIDR, which a
/// node may have published with host bits set.
fn same_network(a: &str, b: &str) -> bool {
    match (a.parse::<ipnet::IpNet>(), b.parse::<ipnet::IpNet>()) {
        (Ok(a), Ok(b)) => a.trunc() == b.trunc(),
        _ => a == b,
    }
}

/// How this node reaches `node`'s pods: `via` the gateways of the applied routes to its pod
/// CIDRs through one of its addresses (of a CIDR two nodes claim, only one node's is routed),
/// the CIDRs without one named; `-` when none is routed to it.
fn node_route(node: &Value, applied: &[Value]) -> String {
    let addresses: Vec<&str> = strings(&node["nodeIps"]).collect();
    let (mut vias, mut unrouted) = (Vec::new(), Vec::new());
    for cidr in strings(&node["podCidrs"]) {
        let route = applied.iter().find(|r| {
            r["cidr"].as_str().is_some_and(|c| same_network(c, cidr))
                && r["via"].as_str().is_some_and(|via| addresses.contains(&via))
        });
        match route.and_then(|r| r["via"].as_str()) {
            Some(via) if !vias.contains(&via) => vias.push(via),
            Some(_) => {}
            None => unrouted.push(cidr),
        }
    }
    if vias.is_empty() {
        return "-".into();
    }
    let missing = if unrouted.is_empty() { String::new() } else { format!(" (none to {})", unrouted.join(",")) };
    format!("via {}{missing}", vias.join(","))
}

/// `GET /v1/cluster/nodes` as a table (`cilium node list`): NAME ID ADDRESSES POD CIDRS ROUTE
/// (`(this node)` for its own), CLUSTER first when other clusters' nodes are followed (`-` for
/// this cluster's, which come first), each cluster's by name; then a line for this node's
/// route errors and one for the operator's heartbeat age, when there are.
pub fn format_nodes(answer: &Value) -> String {
    let this = answer["node"].as_str();
    let applied = answer["routes"]["applied"].as_array().map_or(&[][..], Vec::as_slice);
    let local = answer["nodes"].as_object().into_iter().flatten().map(|(name, info)| (None, name, info));
    let remote = answer["remote_nodes"].as_object().into_iter().flatten().flat_map(|(cluster, nodes)| {
        nodes.as_object().into_iter().flatten().map(move |(name, info)| (Some(cluster.as_str()), name, info))
    });
    let mut nodes: Vec<(Option<&str>, &String, &Value)> = local.chain(remote).collect();
    nodes.sort_by_key(|(cluster, name, _)| (*cluster, *name));
    let clusters = nodes.iter().any(|(cluster, _, _)| cluster.is_some());
    let mut header = vec!["NAME", "ID", "ADDRESSES", "POD CIDRS", "ROUTE"];
    if clusters {
        header.insert(0, "CLUSTER");
    }
    let mut rows = vec![header.into_iter().map(String::from).collect::<Vec<_>>()];
    for (cluster, name, info) in nodes {
        let route = if cluster.is_none() && this == Some(name.as_str()) {
            "(this node)".to_string()
        } else {
            node_route(info, applied)
        };
        let mut row = vec![
            name.clone(),
            count(&info["id"]),
            joined(strings(&info["nodeIps"]).map(str::to_string)),
            joined(strings(&info["podCidrs"]).map(str::to_string)),
            route,
        ];
        if clusters {
            row.insert(0, cluster.unwrap_or("-").to_string());
        }
        rows.push(row);
    }
    let mut lines: Vec<(String, String)> = Vec::new();
    // `null`: this host programs no routes, so `-` says nothing about the network.
    if answer["routes"].is_null() {
        lines.push(("Routes".into(), "not programmed by this host (--node-routes)".into()));
    }
    let errors: Vec<&str> = strings(&answer["routes"]["errors"]).collect();
    if !errors.is_empty() {
        lines.push(("Route errors".into(), errors.join("; ")));
    }
    if !answer["heartbeat_age_seconds"].is_null() {
        lines.push(("Operator heartbeat".into(), ago(&answer["heartbeat_age_seconds"])));
    }
    table(&rows) + &aligned(&lines)
}

/// `wasmplane policy …`: this node's network policies, through its host's REST API.
#[derive(clap::Subcommand, Debug)]
pub enum PolicyCommand {
    /// One line per policy enforced (or audited) on this node: generation enforced / desired,
    /// mode, pods selected per direction, error.
    Ls {
        /// Also the packets each policy dropped and, in audit mode, would have dropped (the
        /// host reads the kernel's counters for it).
        #[arg(long)]
        counters: bool,
    },
    /// The packets policy dropped on this node, or in audit mode would have, oldest first
    /// (`hubble observe --verdict DROPPED`): pod, direction, addresses, protocol, the
    /// policies selecting the pod. The host keeps the last 1,024.
    Verdicts {
        /// Only those of this pod (on this node).
        #[arg(long, value_name = "NS/NAME")]
        pod: Option<String>,
        /// Only drops (deny), would-be drops of policies in audit mode (audit) or
        /// connections accepted by policies with allow logging on (allow).
        #[arg(long)]
        verdict: Option<VerdictFilter>,
        /// How many of the newest to show.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// Then keep printing new ones as they come (every second), until Ctrl-C.
        #[arg(long, short)]
        follow: bool,
    },
    /// Audit mode on (or `--off`) for one policy or every policy on this node: what it
    /// would drop is accepted and logged as `audit` (Calico's staged, Cilium's audit mode).
    Audit(PolicyToggle),
    /// Allow logging on (or `--off`) for one policy or every policy on this node: the
    /// connections it accepts are logged as `allow` (`policy verdicts --verdict allow`).
    LogAllowed(PolicyToggle),
}

/// Which policies a `policy audit|log-allowed` switches, and which way.
#[derive(clap::Args, Debug, PartialEq, Eq)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["policy", "all"])))]
pub struct PolicyToggle {
    /// The policy.
    #[arg(value_name = "NS/NAME")]
    pub policy: Option<NamespacedName>,
    /// Every policy on this node, those that come later included.
    #[arg(long)]
    pub all: bool,
    /// Switch it off instead.
    #[arg(long)]
    pub off: bool,
}

impl PolicyToggle {
    /// The API path of the toggle `what` (`audit`, `log-allowed`) and the query.
    fn request<'a>(&'a self, what: &'a str) -> (Vec<&'a str>, [(&'static str, &'static str); 1]) {
        let mut segments = vec!["v1", "policies"];
        if let Some(policy) = &self.policy {
            segments.extend([policy.namespace.as_str(), policy.name.as_str()]);
        }
        segments.push(what);
        (segments, [("enabled", if self.off { "false" } else { "true" })])
    }
}

/// The line `policy audit|log-allowed` prints: what the host says now holds.
pub fn format_toggle(what: &str, field: &str, answer: &Value) -> String {
    let state = match answer[field].as_bool() {
        Some(true) => "on",
        Some(false) => "off",
        None => "?",
    };
    let line = match answer["policy"].as_str() {
        Some(policy) => format!("{policy}: {what} {state}\n"),
        None => format!("every policy on this node: {what} {state}\n"),
    };
    match answer["warning"].as_str() {
        Some(warning) => format!("{line}warning: {warning}\n"),
        None => line,
    }
}

/// A verdict to filter on (`deny`, `audit`), as `GET /v1/policies/verdicts?verdict=` names it.
pub use crate::nft::policy::PolicyVerdict as VerdictFilter;

const VERDICTS_PATH: [&str; 3] = ["v1", "policies", "verdicts"];

/// Runs a `wasmplane policy` command against the host of `api`.
pub async fn policy(api: &ApiArgs, command: PolicyCommand) -> anyhow::Result<()> {
    policy_to(api, command, &mut std::io::stdout()).await
}

/// [`policy`], printing to `out` (for tests to read what a person would see).
pub async fn policy_to(
    api: &ApiArgs,
    command: PolicyCommand,
    out: &mut (impl std::io::Write + Send),
) -> anyhow::Result<()> {
    match command {
        PolicyCommand::Ls { counters } => {
            let query: &[(&str, &str)] = if counters { &[("counters", "true")] } else { &[] };
            let list = get_json(api, &["v1", "policies"], query).await?;
            write!(out, "{}", format_policies(&list, counters))?;
            Ok(())
        }
        PolicyCommand::Verdicts { pod, verdict, limit, follow } => {
            let filters: Vec<(&str, &str)> = pod
                .as_deref()
                .map(|pod| ("pod", pod))
                .into_iter()
                .chain(verdict.map(|v| ("verdict", v.name())))
                .collect();
            show_events(api, &VERDICTS, &filters, limit, follow, out).await
        }
        PolicyCommand::Audit(toggle) => toggle_to(api, &toggle, "audit", "audit", out).await,
        PolicyCommand::LogAllowed(toggle) => toggle_to(api, &toggle, "log-allowed", "log_allowed", out).await,
    }
}

/// Posts `toggle` to the host's `…/<what>` and prints what holds after it (the answer's
/// `field`): for one policy, allow logging switched off while it is on for every policy
/// stays on, and the line says so.
async fn toggle_to(
    api: &ApiArgs,
    toggle: &PolicyToggle,
    what: &str,
    field: &str,
    out: &mut (impl std::io::Write + Send),
) -> anyhow::Result<()> {
    let (segments, query) = toggle.request(what);
    let answer = call_json(api, reqwest::Method::POST, &segments, &query).await?;
    write!(out, "{}", format_toggle(what, field, &answer))?;
    Ok(())
}

/// Options of `wasmplane drops`.
#[derive(clap::Args, Debug)]
pub struct DropsArgs {
    /// Only the drops of this service's addresses and ports (in this node's model).
    #[arg(long, value_name = "NS/NAME")]
    pub service: Option<String>,
    /// Only those of this pod (on this node): its policy verdicts, the service drops of what
    /// it sent.
    #[arg(long, value_name = "NS/NAME")]
    pub pod: Option<String>,
    /// Only those of one reason: a policy's (deny, audit) or the service side's.
    #[arg(long)]
    pub reason: Option<DropReason>,
    /// How many of the newest to show.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// Then keep printing new ones as they come (every second), until Ctrl-C.
    #[arg(long, short)]
    pub follow: bool,
}

pub use crate::policy_log::DropReason;

/// Runs `wasmplane drops` against the host of `api`.
pub async fn drops(api: &ApiArgs, args: DropsArgs) -> anyhow::Result<()> {
    drops_to(api, args, &mut std::io::stdout()).await
}

/// [`drops`], printing to `out`.
pub async fn drops_to(api: &ApiArgs, args: DropsArgs, out: &mut (impl std::io::Write + Send)) -> anyhow::Result<()> {
    let filters: Vec<(&str, &str)> = [
        ("service", args.service.as_deref()),
        ("pod", args.pod.as_deref()),
        ("reason", args.reason.map(DropReason::name)),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k, v?)))
    .collect();
    show_events(api, &DROPS, &filters, args.limit, args.follow, out).await
}

/// An API path serving logged events (newest first, `limit`, `since_unix_ms`), and how its
/// events and answers are printed.
struct EventSource {
    path: &'static [&'static str],
    format_event: fn(&Value) -> String,
    format_answer: fn(&Value) -> String,
}

const VERDICTS: EventSource =
    EventSource { path: &VERDICTS_PATH, format_event: format_verdict, format_answer: format_verdicts };
const DROPS: EventSource =
    EventSource { path: &["v1", "drops"], format_event: format_drop, format_answer: format_drops };

/// Prints the newest `limit` events of `source` that pass `filters`, oldest first; with
/// `follow`, then the new ones every second, each once, until Ctrl-C.
async fn show_events(
    api: &ApiArgs,
    source: &EventSource,
    filters: &[(&str, &str)],
    limit: usize,
    follow: bool,
    out: &mut (impl std::io::Write + Send),
) -> anyhow::Result<()> {
    let limit = limit.to_string();
    // Before following: a host that reads no log (404) or a pod not on this node says so here.
    let answer = get_json(api, source.path, &with_limit(filters, &limit)).await?;
    if !follow {
        write!(out, "{}", (source.format_answer)(&answer))?;
        return Ok(());
    }
    // Registered before anything is shown, so that a Ctrl-C during a request is not lost.
    let mut interrupt =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).context("listening for Ctrl-C")?;
    let mut printed = PrintedEvents::default();
    show_new(out, source, &answer, &mut printed)?;
    // Every event the host keeps from the newest printed millisecond on, so that more
    // than `limit` in one second are not cut and what was printed is not sent again.
    let all = crate::policy_log::CAPACITY.to_string();
    let poll = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let since = printed_since(&printed);
            let mut query = with_limit(filters, &all);
            query.extend(since.as_deref().map(|since| ("since_unix_ms", since)));
            let answer = get_json(api, source.path, &query).await?;
            show_new(out, source, &answer, &mut printed)?;
        }
    };
    tokio::select! {
        _ = interrupt.recv() => Ok(()),
        result = poll => result,
    }
}

/// Prints the events of an answer not yet `printed`, oldest first.
fn show_new(
    out: &mut impl std::io::Write,
    source: &EventSource,
    answer: &Value,
    printed: &mut PrintedEvents,
) -> std::io::Result<()> {
    let (fresh, next) = new_events(events_of(answer), printed);
    fresh.iter().try_for_each(|event| writeln!(out, "{}", (source.format_event)(event)))?;
    *printed = next;
    out.flush()
}

/// The newest millisecond `printed` has shown, as a query value (events of it may still come).
fn printed_since(printed: &PrintedEvents) -> Option<String> {
    printed.newest_ms.map(|ms| ms.to_string())
}

/// `filters` and a `limit`, as one query.
fn with_limit<'a>(filters: &[(&'a str, &'a str)], limit: &'a str) -> Vec<(&'a str, &'a str)> {
    filters.iter().copied().chain([("limit", limit)]).collect()
}

/// `GET /v1/policies[?counters=true]` as a table: NAMESPACE/NAME GENERATION (enforced/desired,
/// `-` for none enforced) MODE TARGETS [DROPS WOULD-DROP] ERROR (the guest's warnings too).
pub fn format_policies(list: &Value, counters: bool) -> String {
    let mut header = vec!["NAMESPACE/NAME", "GENERATION", "MODE", "TARGETS"];
    if counters {
        header.extend(["DROPS", "WOULD-DROP"]);
    }
    header.push("ERROR");
    let mut rows = vec![header.into_iter().map(String::from).collect::<Vec<_>>()];
    for p in list["policies"].as_array().into_iter().flatten() {
        let name = format!("{}/{}", p["namespace"].as_str().unwrap_or("?"), p["name"].as_str().unwrap_or("?"));
        let enforced =
            if p["enforced_generation"].is_null() { "-".to_string() } else { count(&p["enforced_generation"]) };
        let mode = match (p["audit"].as_bool(), p["log_allowed"].as_bool() == Some(true)) {
            (Some(true), false) => "audit",
            (Some(true), true) => "audit, log-allowed",
            (Some(false), false) => "enforce",
            (Some(false), true) => "enforce, log-allowed",
            (None, _) => "?",
        };
        let targets = format!("ingress {}, egress {}", count(&p["ingress_targets"]), count(&p["egress_targets"]));
        let mut row = vec![name, format!("{enforced}/{}", count(&p["desired_generation"])), mode.to_string(), targets];
        if counters {
            row.extend([count(&p["dropped_packets"]), count(&p["audit_would_drop_packets"])]);
        }
        let warnings =
            p["warnings"].as_array().into_iter().flatten().filter_map(Value::as_str).map(|w| format!("warning: {w}"));
        row.push(p["error"].as_str().map(str::to_string).into_iter().chain(warnings).collect::<Vec<_>>().join("; "));
        rows.push(row);
    }
    table(&rows)
}

/// The events of a `GET /v1/policies/verdicts` or `GET /v1/drops` answer, newest first as
/// the host sends them.
fn events_of(answer: &Value) -> &[Value] {
    answer["events"].as_array().map_or(&[], Vec::as_slice)
}

/// `HH:MM:SS.mmm` in UTC (Unix time has no leap seconds: a day is always 86,400 s).
fn utc_clock(unix_ms: u64) -> String {
    let ms = unix_ms % 86_400_000;
    format!("{:02}:{:02}:{:02}.{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000)
}

/// `address:port`, `[address]:port` for IPv6, the bare address without a port.
fn socket_text(address: &Value, port: &Value) -> String {
    let address = address.as_str().unwrap_or("?");
    match port.as_u64() {
        None => address.to_string(),
        Some(port) if address.contains(':') => format!("[{address}]:{port}"),
        Some(port) => format!("{address}:{port}"),
    }
}

/// One verdict event as a line (no newline): time (UTC), verdict, direction, pod (its address
/// when the host knows no pod there now), source -> destination, protocol, policies.
pub fn format_verdict(event: &Value) -> String {
    let time = event["at_unix_ms"].as_u64().map_or_else(|| "??:??:??.???".to_string(), utc_clock);
    let verdict = event["verdict"].as_str().unwrap_or("?").to_uppercase();
    let direction = event["direction"].as_str().unwrap_or("?");
    let pod = event["pod"].as_str().or_else(|| event["pod_address"].as_str()).unwrap_or("?");
    let source = socket_text(&event["source"], &event["source_port"]);
    let destination = socket_text(&event["destination"], &event["destination_port"]);
    let protocol = event["protocol"].as_str().unwrap_or("?");
    let policies =
        joined(event["policies"].as_array().into_iter().flatten().filter_map(|p| p.as_str().map(str::to_string)));
    // An allow names the policy that accepted it (`<unknown>`: it is gone from this node).
    let allowed_by = if event["verdict"] == "allow" {
        format!("  allowed by: {}", event["policy"].as_str().unwrap_or("<unknown>"))
    } else {
        String::new()
    };
    format!(
        "{time}  {verdict:<5}  {direction:<7}  {pod}  {source} -> {destination} {protocol}{allowed_by}  policies: {policies}"
    )
}

/// A `GET /v1/policies/verdicts` answer: its events oldest first, one line each, then the
/// host's totals since it started.
pub fn format_verdicts(answer: &Value) -> String {
    format_events(answer, format_verdict, &policy_totals(&answer["totals"]))
}

/// One event of `GET /v1/drops` as a line: a policy's as [`format_verdict`]; the service
/// side's as time (UTC), REJECT or DROP, `service`, the service (and port name, `<unknown>`
/// when no service has the address now), source -> destination, protocol, reason.
pub fn format_drop(event: &Value) -> String {
    if event["kind"] != "service" {
        return format_verdict(event);
    }
    let time = event["at_unix_ms"].as_u64().map_or_else(|| "??:??:??.???".to_string(), utc_clock);
    let reason = event["reason"].as_str().unwrap_or("?");
    // What the sender sees: a refused connection, or none at all.
    let verdict = if matches!(reason, "no-endpoints" | "unknown-port") { "REJECT" } else { "DROP" };
    let service = match (event["service"].as_str(), event["port_name"].as_str()) {
        (None, _) => "<unknown>".to_string(),
        (Some(service), Some(port)) if !port.is_empty() => format!("{service}:{port}"),
        (Some(service), _) => service.to_string(),
    };
    let source = socket_text(&event["source"], &event["source_port"]);
    let destination = socket_text(&event["destination"], &event["destination_port"]);
    let protocol = event["protocol"].as_str().unwrap_or("?");
    format!("{time}  {verdict:<5}  service  {service}  {source} -> {destination} {protocol}  reason: {reason}")
}

/// A `GET /v1/drops` answer: its events oldest first, one line each, then the host's totals
/// since it started, policy verdicts and service drops by reason.
pub fn format_drops(answer: &Value) -> String {
    let totals = &answer["totals"];
    let by_reason: String = totals["service_drops"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(reason, n)| format!(", {reason} {}", count(n)))
        .collect();
    format_events(answer, format_drop, &(policy_totals(&totals["policy_verdicts"]) + &by_reason))
}

/// An answer's events oldest first, one line each, then `totals`.
fn format_events(answer: &Value, format_event: fn(&Value) -> String, totals: &str) -> String {
    let events = events_of(answer);
    let mut out: String = events.iter().rev().map(|event| format_event(event) + "\n").collect();
    out += &format!("{} shown; since the host started: {totals}\n", events.len());
    out
}

/// The policy verdict totals as text (`deny N, audit N[, lost N]`).
fn policy_totals(totals: &Value) -> String {
    let lost = match totals["lost"].as_u64() {
        Some(lost) if lost > 0 => format!(", lost {lost}"),
        _ => String::new(),
    };
    // A host without allow logging answers no `allow` total.
    let allow = totals.get("allow").map(|n| format!(", allow {}", count(n))).unwrap_or_default();
    format!("deny {}, audit {}{allow}{lost}", count(&totals["deny"]), count(&totals["audit"]))
}

/// What `--follow` has printed: the newest millisecond and, per event of that millisecond,
/// how many times (several events can share a millisecond, identical ones too).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrintedEvents {
    newest_ms: Option<u64>,
    at_newest: BTreeMap<String, usize>,
}

/// An event as the host logged it: without the pod's name, the policies, the service and
/// its port name, which the host looks up at each read and may change between two polls.
fn event_identity(event: &Value) -> String {
    let mut logged = event.clone();
    if let Some(fields) = logged.as_object_mut() {
        for looked_up in ["pod", "policies", "service", "port_name"] {
            fields.remove(looked_up);
        }
    }
    logged.to_string()
}

/// The events of `newest_first` (a verdicts answer) not yet `printed`, oldest first, and what
/// is printed once they are: older than the newest printed millisecond never again, of that
/// millisecond only the copies beyond those printed.
pub fn new_events(newest_first: &[Value], printed: &PrintedEvents) -> (Vec<Value>, PrintedEvents) {
    let mut fresh = Vec::new();
    let mut next = printed.clone();
    // Copies of each event of `next.newest_ms` in this answer so far.
    let mut in_answer: BTreeMap<String, usize> = BTreeMap::new();
    for event in newest_first.iter().rev() {
        let at = event["at_unix_ms"].as_u64().unwrap_or(0);
        let identity = event_identity(event);
        match next.newest_ms {
            Some(newest) if at < newest => continue,
            Some(newest) if at == newest => {
                let copies = in_answer.entry(identity.clone()).or_default();
                *copies += 1;
                let printed_copies = next.at_newest.entry(identity).or_default();
                if *copies <= *printed_copies {
                    continue;
                }
                *printed_copies += 1;
            }
            _ => {
                next.newest_ms = Some(at);
                next.at_newest = BTreeMap::from([(identity.clone(), 1)]);
                in_answer = BTreeMap::from([(identity, 1)]);
            }
        }
        fresh.push(event.clone());
    }
    (fresh, next)
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
            "dataplane": { "mode": "nftables", "objects": 5, "held": false, "last_sync_age_seconds": 4, "sync_failing_for_seconds": 9, "syncs_ok": 3, "syncs_failed": 1,
                "last_write_error": { "at_unix_seconds": 1, "age_seconds": 2, "message": "nft: Error: Could not process rule: No such file or directory" } },
            "modules": { "gc": "default-gc@1", "service-translator": "flaky@2" },
            "failed_modules": [{ "name": "broken", "kind": "network-policy", "error": "trap" }],
            "service_errors": 2,
            "policy_verdicts": { "deny": 40, "audit": 3, "lost": 0 },
        });
        let text = format_status(&status);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Ready:               no: initial sync pending", "{text}");
        assert!(lines.contains(&"Role:                operator (leader)"), "{text}");
        assert!(lines.contains(&"Kvstore:             etcd"), "{text}");
        assert!(lines.contains(&"Services:            3, 2 failing translation"), "{text}");
        assert!(lines.contains(&"Policies:            1, 40 packets denied, 3 audited since start"), "{text}");
        assert!(lines.contains(&"Last sync:           4s ago (3 ok, 1 failed), FAILING for 9s"), "{text}");
        assert!(
            lines.contains(&"Last sync error:     nft: Error: Could not process rule: No such file or directory"),
            "{text}"
        );
        // Writes that succeed again: the old refusal is not a status line.
        let mut recovered = status.clone();
        recovered["dataplane"]["sync_failing_for_seconds"] = json!(null);
        assert!(!format_status(&recovered).contains("Last sync error"));
        let translator = lines.iter().position(|l| *l == "Service translator:  flaky@2");
        let gc = lines.iter().position(|l| *l == "GC:                  default-gc@1");
        assert!(translator.is_some() && translator < gc, "the translator first: {text}");
        assert!(lines.contains(&"Failed module:       broken (network-policy): trap"), "{text}");
        // Every value starts in the same column.
        assert!(lines.iter().all(|l| l.get(19..21) == Some("  ") && !l[21..].starts_with(' ')), "{text}");
    }

    /// The CNI line: our addresses per pod CIDR and the MTU; chained, with the attachments
    /// it reported; not serving yet.
    #[test]
    fn the_cni_line_says_how_full_each_pod_cidr_is() {
        let serving = json!({ "serving": true, "chained": false, "mtu": 1400, "pools": [{ "cidr": "10.244.1.0/24", "allocated": 5, "capacity": 253 }, { "cidr": "fd00::/64", "allocated": 5, "capacity": 18446744073709551615u64 }] });
        assert_eq!(
            format_cni(&serving),
            "serving, 10.244.1.0/24 5/253 allocated, fd00::/64 5/18446744073709551615 allocated, MTU 1400"
        );
        assert_eq!(
            format_cni(&json!({ "serving": true, "chained": false, "mtu": null, "pools": [] })),
            "serving, the kernel's default MTU"
        );
        assert_eq!(
            format_cni(&json!({ "serving": true, "chained": true, "mtu": null, "pools": [] })),
            "serving, chained (addresses and MTU are the other plugin's)"
        );
        let chained = |attachments: u64| {
            format_cni(
                &json!({ "serving": true, "chained": true, "mtu": null, "pools": [], "attachments": attachments }),
            )
        };
        assert_eq!(chained(12), "serving, chained (addresses and MTU are the other plugin's), 12 attachments");
        assert_eq!(chained(1), "serving, chained (addresses and MTU are the other plugin's), 1 attachment");
        assert_eq!(chained(0), "serving, chained (addresses and MTU are the other plugin's), 0 attachments");
        assert_eq!(format_cni(&json!({ "serving": false })), "not serving yet (waiting for this node's pod CIDRs)");
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
        assert_eq!(
            lines[0], "NAMESPACE/NAME   TYPE        CLUSTER-IPS           PORTS                 ENDPOINTS        ERROR",
            "{text}"
        );
        assert_eq!(
            lines[1], "shop/web         NodePort    10.96.0.20,fd00::20   80:30080/TCP,53/UDP   2/3, local 1/2",
            "{text}"
        );
        assert_eq!(
            lines[2],
            "other/x          ClusterIP   <none>                <none>                0/0, local 0/0   invalid IP",
            "{text}"
        );
    }

    #[test]
    fn policies_table_shows_generations_mode_targets_and_errors() {
        let list = json!({ "policies": [
            { "namespace": "default", "name": "web-from-client", "enforced_generation": 3, "desired_generation": 4, "audit": false, "ingress_targets": 2, "egress_targets": 0, "error": null, "warnings": [] },
            { "namespace": "shop", "name": "db", "enforced_generation": null, "desired_generation": 1, "audit": true, "ingress_targets": 0, "egress_targets": 1, "error": "port \"x\" unknown", "warnings": ["endPort ignored"] },
        ]});
        let text = format_policies(&list, false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[0], "NAMESPACE/NAME            GENERATION   MODE      TARGETS               ERROR", "{text}");
        assert_eq!(lines[1], "default/web-from-client   3/4          enforce   ingress 2, egress 0", "{text}");
        assert_eq!(
            lines[2],
            "shop/db                   -/1          audit     ingress 0, egress 1   port \"x\" unknown; warning: endPort ignored",
            "{text}"
        );
        assert!(!text.contains("DROPS"), "no counters asked: {text}");
    }

    #[test]
    fn policies_table_with_counters_has_drops_and_would_be_drops() {
        let list = json!({ "policies": [
            { "namespace": "default", "name": "web", "enforced_generation": 1, "desired_generation": 1, "audit": true, "ingress_targets": 1, "egress_targets": 1, "error": null, "warnings": [],
              "dropped_packets": 0, "audit_would_drop_packets": 1234 },
            // An answer without counters (an older host): unknown, not zero.
            { "namespace": "default", "name": "old", "enforced_generation": 2, "desired_generation": 2, "audit": false, "ingress_targets": 0, "egress_targets": 0, "error": null, "warnings": [] },
        ]});
        let text = format_policies(&list, true);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0], "NAMESPACE/NAME   GENERATION   MODE      TARGETS               DROPS   WOULD-DROP   ERROR",
            "{text}"
        );
        assert_eq!(lines[1], "default/web      1/1          audit     ingress 1, egress 1   0       1234", "{text}");
        assert_eq!(lines[2], "default/old      2/2          enforce   ingress 0, egress 0   ?       ?", "{text}");
        assert_eq!(
            format_policies(&json!({ "policies": [] }), true),
            "NAMESPACE/NAME   GENERATION   MODE   TARGETS   DROPS   WOULD-DROP   ERROR\n"
        );
    }

    #[test]
    fn policies_table_says_which_log_what_they_allow() {
        let list = json!({ "policies": [
            { "namespace": "default", "name": "web", "enforced_generation": 1, "desired_generation": 1, "audit": false, "log_allowed": true, "ingress_targets": 1, "egress_targets": 0, "error": null, "warnings": [] },
            { "namespace": "default", "name": "db", "enforced_generation": 1, "desired_generation": 1, "audit": true, "log_allowed": true, "ingress_targets": 1, "egress_targets": 0, "error": null, "warnings": [] },
        ]});
        let text = format_policies(&list, false);
        let modes: Vec<&str> = text
            .lines()
            .skip(1)
            .map(|l| l.split("   ").map(str::trim).filter(|c| !c.is_empty()).nth(2).unwrap())
            .collect();
        assert_eq!(modes, ["enforce, log-allowed", "audit, log-allowed"], "{text}");
    }

    /// An event as the host answers it; `at` is milliseconds into 2024-05-01 UTC.
    fn verdict_event(
        at: u64,
        verdict: &str,
        direction: &str,
        pod: Option<&str>,
        from: (&str, Option<u16>),
        to: (&str, Option<u16>),
        policies: &[&str],
    ) -> Value {
        const MAY_FIRST_2024_MS: u64 = 1_714_521_600_000;
        let pod_address = if direction == "ingress" { to.0 } else { from.0 };
        json!({ "at_unix_ms": MAY_FIRST_2024_MS + at, "verdict": verdict, "direction": direction, "pod_address": pod_address, "pod": pod, "source": from.0, "destination": to.0,
                "protocol": if from.1.is_some() { "tcp" } else { "icmp" }, "source_port": from.1, "destination_port": to.1, "policies": policies })
    }

    const HMS_MS: u64 = ((13 * 60 + 4) * 60 + 5) * 1000 + 67;

    #[test]
    fn verdict_lines_have_utc_time_addresses_and_policies() {
        let ipv4 = verdict_event(
            HMS_MS,
            "deny",
            "ingress",
            Some("default/web"),
            ("10.244.0.101", Some(54728)),
            ("10.244.0.11", Some(8080)),
            &["default/web-from-client"],
        );
        assert_eq!(
            format_verdict(&ipv4),
            "13:04:05.067  DENY   ingress  default/web  10.244.0.101:54728 -> 10.244.0.11:8080 tcp  policies: default/web-from-client"
        );
        let ipv6 = verdict_event(
            86_399_999,
            "audit",
            "egress",
            Some("shop/db"),
            ("fd00::10", Some(40000)),
            ("2001:db8::1", Some(443)),
            &["shop/a", "shop/b"],
        );
        assert_eq!(
            format_verdict(&ipv6),
            "23:59:59.999  AUDIT  egress   shop/db  [fd00::10]:40000 -> [2001:db8::1]:443 tcp  policies: shop/a,shop/b"
        );
        let no_ports =
            verdict_event(0, "deny", "egress", Some("shop/db"), ("fd00::10", None), ("2001:db8::1", None), &["shop/a"]);
        assert_eq!(
            format_verdict(&no_ports),
            "00:00:00.000  DENY   egress   shop/db  fd00::10 -> 2001:db8::1 icmp  policies: shop/a"
        );
        // The pod is gone (or not known yet): its address instead, and no policy selects it now.
        let unknown_pod =
            verdict_event(1, "deny", "ingress", None, ("10.0.0.1", Some(1)), ("10.244.0.99", Some(80)), &[]);
        assert_eq!(
            format_verdict(&unknown_pod),
            "00:00:00.001  DENY   ingress  10.244.0.99  10.0.0.1:1 -> 10.244.0.99:80 tcp  policies: <none>"
        );
        // An allow says which policy accepted it.
        let mut allow = verdict_event(
            2,
            "allow",
            "ingress",
            Some("default/web"),
            ("10.244.0.100", Some(5)),
            ("10.244.0.11", Some(8080)),
            &["default/a", "default/b"],
        );
        allow["policy"] = json!("default/b");
        assert_eq!(
            format_verdict(&allow),
            "00:00:00.002  ALLOW  ingress  default/web  10.244.0.100:5 -> 10.244.0.11:8080 tcp  allowed by: default/b  policies: default/a,default/b"
        );
        allow["policy"] = Value::Null;
        assert!(format_verdict(&allow).contains("  allowed by: <unknown>  "), "{}", format_verdict(&allow));
    }

    #[test]
    fn verdicts_are_shown_oldest_first_with_the_totals() {
        let older = verdict_event(
            1000,
            "deny",
            "ingress",
            Some("default/web"),
            ("10.0.0.1", Some(1)),
            ("10.244.0.11", Some(80)),
            &["default/web"],
        );
        let newer = verdict_event(
            2000,
            "audit",
            "ingress",
            Some("default/web"),
            ("10.0.0.2", Some(2)),
            ("10.244.0.11", Some(80)),
            &["default/web"],
        );
        let answer = json!({ "totals": { "deny": 7, "audit": 1, "lost": 0 }, "events": [newer, older] });
        let text = format_verdicts(&answer);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("00:00:01.000  DENY ") && lines[1].starts_with("00:00:02.000  AUDIT "), "{text}");
        assert_eq!(lines[2], "2 shown; since the host started: deny 7, audit 1", "{text}");
        let lost = json!({ "totals": { "deny": 0, "audit": 0, "lost": 3 }, "events": [] });
        assert_eq!(format_verdicts(&lost), "0 shown; since the host started: deny 0, audit 0, lost 3\n");
        let allows = json!({ "totals": { "deny": 1, "audit": 0, "allow": 12, "lost": 0 }, "events": [] });
        assert_eq!(format_verdicts(&allows), "0 shown; since the host started: deny 1, audit 0, allow 12\n");
    }

    #[test]
    fn drop_lines_show_policy_verdicts_as_before_and_service_drops_by_service_and_reason() {
        let service_event = |at: u64, reason: &str, service: Option<&str>, port_name: Option<&str>, to: (&str, u16)| {
            json!({ "kind": "service", "reason": reason, "at_unix_ms": at, "source": "10.244.0.100", "source_port": 40000, "destination": to.0,
                    "destination_port": to.1, "protocol": "tcp", "pod": "default/client", "service": service, "port_name": port_name })
        };
        let no_endpoints =
            service_event(HMS_MS, "no-endpoints", Some("default/empty"), Some("http"), ("10.96.0.40", 80));
        assert_eq!(
            format_drop(&no_endpoints),
            "13:04:05.067  REJECT  service  default/empty:http  10.244.0.100:40000 -> 10.96.0.40:80 tcp  reason: no-endpoints"
        );
        let unknown_port = service_event(1, "unknown-port", Some("default/web"), None, ("10.96.0.41", 81));
        assert_eq!(
            format_drop(&unknown_port),
            "00:00:00.001  REJECT  service  default/web  10.244.0.100:40000 -> 10.96.0.41:81 tcp  reason: unknown-port"
        );
        let unallocated = service_event(2, "unallocated", None, None, ("10.96.0.99", 80));
        assert_eq!(
            format_drop(&unallocated),
            "00:00:00.002  DROP   service  <unknown>  10.244.0.100:40000 -> 10.96.0.99:80 tcp  reason: unallocated"
        );
        let mut policy = verdict_event(
            3,
            "deny",
            "ingress",
            Some("default/web"),
            ("10.0.0.1", Some(1)),
            ("10.244.0.11", Some(80)),
            &["default/web"],
        );
        policy["kind"] = json!("policy");
        policy["reason"] = json!("deny");
        assert_eq!(format_drop(&policy), format_verdict(&policy), "a policy event as `policy verdicts` prints it");

        let answer = json!({ "events": [unallocated, policy, no_endpoints],
            "totals": { "policy_verdicts": { "deny": 1, "audit": 0, "lost": 0 }, "service_drops": { "no-endpoints": 4, "unallocated": 1 } } });
        let text = format_drops(&answer);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(
            lines[0].contains("reason: no-endpoints") && lines[2].contains("reason: unallocated"),
            "oldest first: {text}"
        );
        assert_eq!(lines[3], "3 shown; since the host started: deny 1, audit 0, no-endpoints 4, unallocated 1");
        // What a follower compares: the looked-up service and port name are not the event.
        let mut renamed = unknown_port.clone();
        renamed["service"] = json!(null);
        assert_eq!(event_identity(&renamed), event_identity(&unknown_port));
    }

    #[test]
    fn follow_prints_each_event_once_even_within_a_millisecond() {
        let at = |ms: u64, source_port: u16| {
            verdict_event(
                ms,
                "deny",
                "ingress",
                Some("default/web"),
                ("10.0.0.1", Some(source_port)),
                ("10.244.0.11", Some(80)),
                &["default/web"],
            )
        };
        let ports = |events: &[Value]| events.iter().map(|e| e["source_port"].as_u64().unwrap()).collect::<Vec<_>>();
        // Newest first, as the host answers: 5 ms has two events.
        let (first, printed) = new_events(&[at(5, 2), at(5, 1), at(3, 0)], &PrintedEvents::default());
        assert_eq!(ports(&first), [0, 1, 2], "all of them, oldest first");
        // The next poll: a third event in 5 ms, one in 6 ms, and one older than anything printed
        // (which the host cannot have logged since, but a poll must never print twice).
        let (second, printed) = new_events(&[at(6, 4), at(5, 3), at(5, 2), at(5, 1), at(4, 9), at(3, 0)], &printed);
        assert_eq!(ports(&second), [3, 4], "only the new ones");
        let (third, printed) = new_events(&[at(6, 4), at(5, 3)], &printed);
        assert!(third.is_empty(), "{third:?}");
        // Identical events in one millisecond (a burst of one flow): each copy once.
        let (burst, printed) = new_events(&[at(7, 5), at(7, 5), at(6, 4)], &printed);
        assert_eq!(ports(&burst), [5, 5]);
        let (more, printed) = new_events(&[at(7, 5), at(7, 5), at(7, 5), at(6, 4)], &printed);
        assert_eq!(ports(&more), [5], "the third copy only");
        // The pod's name and the policies are looked up at each read: a change is no new event.
        let mut renamed = at(7, 5);
        renamed["pod"] = Value::Null;
        renamed["policies"] = json!([]);
        let (again, _) = new_events(&[renamed.clone(), renamed.clone(), renamed], &printed);
        assert!(again.is_empty(), "{again:?}");
    }

    /// A pod row as the host answers it; `policies` as (name, directions, audit).
    fn pod_row(pod: &str, ips: &[&str], host_network: bool, policies: &[(&str, &[&str], bool)]) -> Value {
        let (namespace, name) = pod.split_once('/').unwrap();
        let policies: Vec<Value> = policies
            .iter()
            .map(|(name, types, audit)| json!({ "name": name, "policy_types": types, "audit": audit, "error": null }))
            .collect();
        json!({ "namespace": namespace, "name": name, "ips": ips, "host_network": host_network, "policies": policies, "cni_allocations": null })
    }

    #[test]
    fn pods_table_says_per_direction_enforced_audit_or_not() {
        let list = json!({ "pods": [
            pod_row("default/web-1", &["10.244.0.41", "fd00::41"], false, &[("default/web-ingress", &["ingress"], false), ("default/web-egress", &["egress"], true)]),
            pod_row("default/db", &["10.244.0.42"], false, &[("default/audited", &["ingress", "egress"], true), ("default/strict", &["ingress"], false)]),
            pod_row("kube-system/agent", &["192.168.1.10"], true, &[]),
        ]});
        let text = format_pods(&list);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(
            lines[0], "POD                 IPS                           INGRESS    EGRESS   POLICIES",
            "{text}"
        );
        assert_eq!(
            lines[1],
            "default/web-1       10.244.0.41,fd00::41          enforced   audit    default/web-ingress,default/web-egress (audit)",
            "{text}"
        );
        // One policy enforcing a direction enforces it, whatever the audit ones.
        assert_eq!(
            lines[2],
            "default/db          10.244.0.42                   enforced   audit    default/audited (audit),default/strict",
            "{text}"
        );
        assert_eq!(lines[3], "kube-system/agent   192.168.1.10 (host network)   -          -        <none>", "{text}");
        assert_eq!(format_pods(&json!({ "pods": [] })), "POD   IPS   INGRESS   EGRESS   POLICIES\n");
    }

    #[test]
    fn pod_lines_are_aligned_with_a_line_per_policy_then_the_drops_oldest_first() {
        let mut detail = pod_row(
            "default/web-1",
            &["10.244.0.41"],
            false,
            &[("default/web-ingress", &["ingress"], false), ("default/web-all", &["ingress", "egress"], true)],
        );
        detail["node"] = json!("node-a");
        detail["labels"] = json!({ "app": "web", "tier": "front" });
        detail["policies"][1]["error"] = json!("port \"x\" unknown");
        detail["cni_allocations"] = json!([{ "container_id": "c1", "interface": "eth0", "allocated_at_unix_seconds": 7,
            "addresses": [{ "ip": "10.244.0.41", "pod_cidr": "10.244.0.0/24" }, { "ip": "fd00::41", "pod_cidr": null }] }]);
        let older = verdict_event(
            1000,
            "deny",
            "ingress",
            Some("default/web-1"),
            ("10.0.0.1", Some(1)),
            ("10.244.0.41", Some(80)),
            &["default/web-ingress"],
        );
        let newer = verdict_event(
            2000,
            "deny",
            "ingress",
            Some("default/web-1"),
            ("10.0.0.2", Some(2)),
            ("10.244.0.41", Some(80)),
            &["default/web-ingress"],
        );
        detail["recent_drops"] = json!([newer, older]);
        let text = format_pod(&detail);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "Pod:           default/web-1",
                "Node:          node-a",
                "IPs:           10.244.0.41",
                "Labels:        app=web,tier=front",
                "Ingress:       enforced",
                "Egress:        audit",
                "Policy:        default/web-ingress (ingress, enforce)",
                "Policy:        default/web-all (ingress,egress, audit, newest generation refused: port \"x\" unknown)",
                "CNI:           10.244.0.41 from 10.244.0.0/24, fd00::41 from no pod CIDR now (container c1, eth0)",
                "Recent drops:  2, oldest first:",
                format_drop(&older).as_str(),
                format_drop(&newer).as_str(),
            ],
            "{text}"
        );
        // A host that reads no drops, or none logged; no CNI of ours: no CNI line.
        detail["recent_drops"] = json!(null);
        detail["cni_allocations"] = json!(null);
        let text = format_pod(&detail);
        assert!(text.ends_with("Recent drops:  not read on this host\n") && !text.contains("CNI:"), "{text}");
        detail["recent_drops"] = json!([]);
        assert!(format_pod(&detail).ends_with("Recent drops:  none logged\n"));
        // With `--counters`: a line per direction a policy selects it in.
        detail["policy_counts"] = json!({
            "ingress": { "policies": [{ "policy": "default/web-ingress", "accepted": 7 }, { "policy": "default/web-all", "accepted": 0 }], "dropped": 3, "would_drop": 0 },
            "egress": { "policies": [{ "policy": "default/web-all", "accepted": 2 }], "dropped": 0, "would_drop": 4 }
        });
        let text = format_pod(&detail);
        assert!(
            text.contains("Ingress counts:  default/web-ingress accepted 7, default/web-all accepted 0; dropped 3\n"),
            "{text}"
        );
        assert!(text.contains("Egress counts:   default/web-all accepted 2; dropped 0; would drop 4\n"), "{text}");
        detail["policy_counts"]["egress"] = json!(null);
        assert!(!format_pod(&detail).contains("Egress counts"));
        detail["policy_counts"] = json!(null);
        assert!(format_pod(&detail).contains("Ingress counts:  not read on this host (it writes no kernel)\n"));
    }

    #[test]
    fn pod_command_line_takes_namespace_slash_name() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            command: crate::cli::PodCommand,
        }
        use clap::{CommandFactory, Parser};
        Cli::command().debug_assert();
        let parsed = Cli::try_parse_from(["pod", "get", "default/web-1"]).unwrap();
        assert!(
            matches!(&parsed.command, crate::cli::PodCommand::Get { pod, counters: false } if *pod == NamespacedName { namespace: "default".into(), name: "web-1".into() }),
            "{:?}",
            parsed.command
        );
        assert!(matches!(
            Cli::try_parse_from(["pod", "get", "default/web-1", "--counters"]).unwrap().command,
            crate::cli::PodCommand::Get { counters: true, .. }
        ));
        assert!(
            matches!(Cli::try_parse_from(["pod", "ls", "-n", "shop"]).unwrap().command, crate::cli::PodCommand::Ls { namespace: Some(ns) } if ns == "shop")
        );
        for wrong in ["web-1", "/web-1", "default/", "a/b/c"] {
            assert!(Cli::try_parse_from(["pod", "get", wrong]).is_err(), "{wrong}");
        }
    }

    /// A node's entry as the registry publishes it.
    fn node_info(name: &str, id: u32, ips: &[&str], pod_cidrs: &[&str]) -> Value {
        json!({ "name": name, "id": id, "nodeIps": ips, "podCidrs": pod_cidrs })
    }

    #[test]
    fn nodes_table_marks_this_node_and_shows_the_route_to_each_others_pods() {
        let answer = json!({
            "node": "node-a", "node_id": 1,
            "nodes": {
                "node-c": node_info("node-c", 3, &["192.168.77.4"], &["10.244.2.0/24"]),
                "node-a": node_info("node-a", 1, &["192.168.77.1"], &["10.244.0.0/24"]),
                "node-b": node_info("node-b", 2, &["192.168.77.3", "fd00::3"], &["10.244.1.0/24", "fd10:1::/64"]),
                // Claims node-b's CIDR with a higher ID: the route is node-b's, not its.
                "node-d": node_info("node-d", 4, &["192.168.77.5"], &["10.244.1.0/24"]),
            },
            "routes": { "applied": [{ "cidr": "10.244.1.0/24", "via": "192.168.77.3" }, { "cidr": "fd10:1::/64", "via": "fd00::3" }], "errors": [], "reconciles": 3 },
            "remote_nodes": {}, "heartbeat_age_seconds": null,
        });
        let text = format_nodes(&answer);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "NAME     ID   ADDRESSES              POD CIDRS                   ROUTE",
                "node-a   1    192.168.77.1           10.244.0.0/24               (this node)",
                "node-b   2    192.168.77.3,fd00::3   10.244.1.0/24,fd10:1::/64   via 192.168.77.3,fd00::3",
                "node-c   3    192.168.77.4           10.244.2.0/24               -",
                "node-d   4    192.168.77.5           10.244.1.0/24               -",
            ],
            "{text}"
        );
    }

    #[test]
    fn nodes_table_shows_other_clusters_nodes_route_errors_and_the_heartbeat() {
        let mut answer = json!({
            "node": "node-a", "node_id": 1,
            "nodes": { "node-a": node_info("node-a", 1, &["192.168.77.1"], &["10.244.0.0/24"]), "node-b": node_info("node-b", 2, &["192.168.77.3", "fd00::3"], &["10.244.1.0/24", "fd10:1::/64"]) },
            "routes": {
                "applied": [{ "cidr": "10.244.1.0/24", "via": "192.168.77.3" }, { "cidr": "10.244.8.0/24", "via": "192.168.78.5" }],
                "errors": ["fd10:1::/64 via fd00::3: Network is unreachable (os error 101)", "10.244.9.0/24 via 192.168.78.6: File exists (os error 17)"], "reconciles": 9,
            },
            // East names a node as this one is named; its pod CIDR published with host bits.
            "remote_nodes": { "east": { "node-e": node_info("node-e", 2, &["192.168.78.6"], &["10.244.9.0/24"]), "node-a": node_info("node-a", 1, &["192.168.78.5"], &["10.244.8.1/24"]) } },
            "heartbeat_age_seconds": 7,
        });
        let text = format_nodes(&answer);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "CLUSTER   NAME     ID   ADDRESSES              POD CIDRS                   ROUTE",
                "-         node-a   1    192.168.77.1           10.244.0.0/24               (this node)",
                "-         node-b   2    192.168.77.3,fd00::3   10.244.1.0/24,fd10:1::/64   via 192.168.77.3 (none to fd10:1::/64)",
                "east      node-a   1    192.168.78.5           10.244.8.1/24               via 192.168.78.5",
                "east      node-e   2    192.168.78.6           10.244.9.0/24               -",
                "Route errors:        fd10:1::/64 via fd00::3: Network is unreachable (os error 101); 10.244.9.0/24 via 192.168.78.6: File exists (os error 17)",
                "Operator heartbeat:  7s ago",
            ],
            "{text}"
        );
        // A host that programs no routes: said, rather than a `-` that would mean no route.
        answer["routes"] = json!(null);
        answer["heartbeat_age_seconds"] = json!(null);
        let text = format_nodes(&answer);
        assert!(
            text.ends_with("   -\nRoutes:  not programmed by this host (--node-routes)\n")
                && !text.contains("heartbeat"),
            "{text}"
        );
    }

    #[test]
    fn policy_command_line_parses() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            command: PolicyCommand,
        }
        use clap::{CommandFactory, Parser};
        Cli::command().debug_assert();
        let parsed =
            Cli::try_parse_from(["policy", "verdicts", "--pod", "default/web", "--verdict", "audit", "-f"]).unwrap();
        assert!(
            matches!(&parsed.command, PolicyCommand::Verdicts { pod: Some(pod), verdict: Some(VerdictFilter::Audit), limit: 20, follow: true } if pod == "default/web"),
            "{:?}",
            parsed.command
        );
        assert!(matches!(
            Cli::try_parse_from(["policy", "ls", "--counters"]).unwrap().command,
            PolicyCommand::Ls { counters: true }
        ));
        assert!(
            Cli::try_parse_from(["policy", "verdicts", "--verdict", "dropped"]).is_err(),
            "deny, audit or allow only"
        );
        assert!(matches!(
            Cli::try_parse_from(["policy", "verdicts", "--verdict", "allow"]).unwrap().command,
            PolicyCommand::Verdicts { verdict: Some(VerdictFilter::Allow), .. }
        ));

        let one = NamespacedName { namespace: "default".into(), name: "web".into() };
        let Cli { command: PolicyCommand::Audit(toggle) } =
            Cli::try_parse_from(["policy", "audit", "default/web"]).unwrap()
        else {
            panic!("not audit")
        };
        assert_eq!(toggle, PolicyToggle { policy: Some(one.clone()), all: false, off: false });
        assert_eq!(toggle.request("audit"), (vec!["v1", "policies", "default", "web", "audit"], [("enabled", "true")]));
        let Cli { command: PolicyCommand::LogAllowed(toggle) } =
            Cli::try_parse_from(["policy", "log-allowed", "--all", "--off"]).unwrap()
        else {
            panic!("not log-allowed")
        };
        assert_eq!(toggle, PolicyToggle { policy: None, all: true, off: true });
        assert_eq!(toggle.request("log-allowed"), (vec!["v1", "policies", "log-allowed"], [("enabled", "false")]));
        for wrong in [
            &["policy", "audit"][..],
            &["policy", "audit", "default/web", "--all"],
            &["policy", "log-allowed", "web"],
            &["policy", "log-allowed", "a/b/c", "--off"],
        ] {
            assert!(Cli::try_parse_from(wrong).is_err(), "{wrong:?}: one policy or --all");
        }
    }

    #[test]
    fn a_toggle_prints_what_holds_after_it() {
        assert_eq!(
            format_toggle("audit", "audit", &json!({ "policy": "default/web", "audit": true })),
            "default/web: audit on\n"
        );
        assert_eq!(
            format_toggle("log-allowed", "log_allowed", &json!({ "log_allowed": false })),
            "every policy on this node: log-allowed off\n"
        );
        // Off for one while on for every policy: the host says it stays on.
        assert_eq!(
            format_toggle("log-allowed", "log_allowed", &json!({ "policy": "shop/db", "log_allowed": true })),
            "shop/db: log-allowed on\n"
        );
    }
}
