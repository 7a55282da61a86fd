//! `deploy/`: the kustomization renders, every object is exactly the typed Kubernetes kind it
//! claims to be (no unknown or misspelled field survives), and the security properties
//! hold: the agent's capabilities are exactly the expected set, nothing is privileged, RBAC
//! has no wildcard and grants each service account exactly what it needs, the operator runs
//! 2 replicas with a leader-election Lease, every container has resource limits and probes
//! on a declared port, and the flags are ones `wasmplane run` accepts.
//!
//! Each check is also run against mutated manifests (`*_is_caught` tests), so a check that
//! silently passes everything fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Container, Namespace, PodSpec, PodTemplateSpec, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Deserialize as _;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use wasmplane_test_deploy::{deploy_dir, workspace};

const NAMESPACE: &str = "wasmplane-system";
const AGENT: &str = "wasmplane-agent";
const OPERATOR: &str = "wasmplane-operator";
/// The agent container's added capabilities, exactly: NET_ADMIN for nftables, routes, veth
/// pairs and addresses; SYS_ADMIN for setns(2) into pod network namespaces.
const AGENT_CAPABILITIES: &[&str] = &["NET_ADMIN", "SYS_ADMIN"];
/// The node paths the agent mounts, exactly.
const AGENT_HOST_PATHS: &[&str] =
    &["/etc/cni/net.d", "/opt/cni/bin", "/run/netns", "/run/wasmplane", "/var/lib/wasmplane"];
/// Flags the manifests use that host/src/cli.rs may not define yet (the operator role is
/// added by the integrator). Tolerated when absent, reported.
const PENDING_FLAGS: &[&str] = &["role"];
/// The only Secret the manifests may reference; it is created by the cluster admin, never
/// part of the kustomization.
const TOKEN_SECRET: &str = "wasmplane-api-token";

// ---------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------

/// One rendered object and the file it came from.
#[derive(Clone, Debug)]
struct Doc {
    source: String,
    value: Value,
}

fn parse_documents(text: &str, source: &str) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for (i, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(document).map_err(|e| format!("{source}: YAML document {i}: {e}"))?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// What `kubectl kustomize` prints for this kustomization: its `resources`, in order. Any
/// other kustomization feature (transformers, generators, patches) would change objects,
/// which this renderer does not model, so it is refused rather than ignored.
fn render(dir: &Path, read: &dyn Fn(&Path) -> Result<String, String>) -> Result<Vec<Doc>, String> {
    let text = read(&dir.join("kustomization.yaml"))?;
    let kustomization = parse_documents(&text, "kustomization.yaml")?;
    let [kustomization] = kustomization.as_slice() else {
        return Err("kustomization.yaml: expected exactly one document".into());
    };
    let Some(fields) = kustomization.as_object() else {
        return Err("kustomization.yaml: not a mapping".into());
    };
    for key in fields.keys() {
        if !["apiVersion", "kind", "resources"].contains(&key.as_str()) {
            return Err(format!(
                "kustomization.yaml: `{key}` is not supported by this test's renderer (it would change the objects)"
            ));
        }
    }
    if kustomization["apiVersion"] != "kustomize.config.k8s.io/v1beta1" || kustomization["kind"] != "Kustomization" {
        return Err("kustomization.yaml: not a kustomize.config.k8s.io/v1beta1 Kustomization".into());
    }
    let resources = kustomization["resources"].as_array().ok_or("kustomization.yaml: `resources` is not a list")?;
    let mut docs = Vec::new();
    for resource in resources {
        let name = resource.as_str().ok_or("kustomization.yaml: a resource is not a string")?;
        if name.contains("://") || name.starts_with('/') || name.split('/').any(|part| part == "..") {
            return Err(format!("kustomization.yaml: resource {name} is not a file inside deploy/"));
        }
        let text = read(&dir.join(name))?;
        for value in parse_documents(&text, name)? {
            docs.push(Doc { source: name.to_string(), value });
        }
    }
    Ok(docs)
}

fn read_file(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))
}

fn rendered() -> Vec<Doc> {
    render(&deploy_dir(), &read_file).unwrap_or_else(|e| panic!("rendering deploy/: {e}"))
}

// ---------------------------------------------------------------------------------------
// Strict typed parsing
// ---------------------------------------------------------------------------------------

/// Parses `value` as `T`, then serializes it back and compares with `value`: k8s-openapi
/// ignores unknown fields, so a misspelled or unknown field is exactly one that does not
/// survive the round trip. Wrong types and missing required fields fail the parse itself.
fn strict<T: DeserializeOwned + Serialize>(value: &Value, what: &str) -> Result<T, String> {
    let typed: T =
        serde_json::from_value(value.clone()).map_err(|e| format!("{what}: not a valid object of its kind: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("{what}: serializing back: {e}"))?;
    let mut differences = Vec::new();
    diff("", value, &back, &mut differences);
    if differences.is_empty() { Ok(typed) } else { Err(format!("{what}: {}", differences.join("; "))) }
}

fn diff(path: &str, original: &Value, typed: &Value, out: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, v) in a {
                let at = format!("{path}.{key}");
                match b.get(key) {
                    Some(w) => diff(&at, v, w, out),
                    None => out.push(format!("unknown field {at}")),
                }
            }
            for key in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("field {path}.{key} appeared in the round trip"));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                diff(&format!("{path}[{i}]"), v, w, out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: {a} reads back as {b}")),
    }
}

#[derive(Default)]
struct Objects {
    namespaces: Vec<Namespace>,
    service_accounts: Vec<ServiceAccount>,
    config_maps: Vec<ConfigMap>,
    services: Vec<Service>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    daemon_sets: Vec<DaemonSet>,
    deployments: Vec<Deployment>,
    pod_disruption_budgets: Vec<PodDisruptionBudget>,
    custom_resource_definitions: Vec<CustomResourceDefinition>,
    /// (kind, namespace, name) of every object, for namespace checks.
    all: Vec<(String, Option<String>, String)>,
}

fn parse_objects(docs: &[Doc], errors: &mut Vec<String>) -> Objects {
    let mut o = Objects::default();
    for doc in docs {
        let api_version = doc.value["apiVersion"].as_str().unwrap_or_default();
        let kind = doc.value["kind"].as_str().unwrap_or_default();
        let name = doc.value["metadata"]["name"].as_str().unwrap_or_default();
        let what = format!("{}: {kind}/{name}", doc.source);
        let v = &doc.value;
        let parsed = match (api_version, kind) {
            ("v1", "Namespace") => strict(v, &what).map(|x| o.namespaces.push(x)),
            ("v1", "ServiceAccount") => strict(v, &what).map(|x| o.service_accounts.push(x)),
            ("v1", "ConfigMap") => strict(v, &what).map(|x| o.config_maps.push(x)),
            ("v1", "Service") => strict(v, &what).map(|x| o.services.push(x)),
            ("rbac.authorization.k8s.io/v1", "ClusterRole") => strict(v, &what).map(|x| o.cluster_roles.push(x)),
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                strict(v, &what).map(|x| o.cluster_role_bindings.push(x))
            }
            ("rbac.authorization.k8s.io/v1", "Role") => strict(v, &what).map(|x| o.roles.push(x)),
            ("rbac.authorization.k8s.io/v1", "RoleBinding") => strict(v, &what).map(|x| o.role_bindings.push(x)),
            ("apps/v1", "DaemonSet") => strict(v, &what).map(|x| o.daemon_sets.push(x)),
            ("apps/v1", "Deployment") => strict(v, &what).map(|x| o.deployments.push(x)),
            ("policy/v1", "PodDisruptionBudget") => strict(v, &what).map(|x| o.pod_disruption_budgets.push(x)),
            ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
                strict(v, &what).map(|x| o.custom_resource_definitions.push(x))
            }
            // Notably Secret: the API token must never be part of the manifests.
            _ => Err(format!("{what}: {api_version} {kind} is not a kind deploy/ is expected to contain")),
        };
        match parsed {
            Ok(()) => o.all.push((
                kind.to_string(),
                doc.value["metadata"]["namespace"].as_str().map(str::to_string),
                name.to_string(),
            )),
            Err(e) => errors.push(e),
        }
    }
    o
}

// ---------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------

/// Every violation found in the rendered documents; empty when the manifests are fine.
fn validate(docs: &[Doc], cli_flags: &BTreeSet<String>) -> Vec<String> {
    let mut v = Vec::new();
    let o = parse_objects(docs, &mut v);
    check_namespaces(&o, &mut v);
    for w in workloads(&o) {
        check_pod(&w, &mut v);
        check_args(&w, cli_flags, &mut v);
    }
    check_agent(&o, &mut v);
    check_operator(&o, &mut v);
    check_rbac(&o, &mut v);
    check_references(&o, &mut v);
    check_service(&o, &mut v);
    check_crds(&o, &mut v);
    v
}

struct Workload<'a> {
    kind: &'static str,
    name: String,
    namespace: Option<String>,
    template: &'a PodTemplateSpec,
}

impl Workload<'_> {
    fn spec(&self) -> &PodSpec {
        static EMPTY: std::sync::OnceLock<PodSpec> = std::sync::OnceLock::new();
        self.template.spec.as_ref().unwrap_or_else(|| EMPTY.get_or_init(PodSpec::default))
    }

    fn all_containers(&self) -> impl Iterator<Item = (&Container, bool)> {
        let spec = self.spec();
        spec.init_containers.iter().flatten().map(|c| (c, true)).chain(spec.containers.iter().map(|c| (c, false)))
    }

    fn labels(&self) -> BTreeMap<String, String> {
        self.template.metadata.as_ref().and_then(|m| m.labels.clone()).unwrap_or_default()
    }
}

fn workloads(o: &Objects) -> Vec<Workload<'_>> {
    let mut out = Vec::new();
    for ds in &o.daemon_sets {
        if let Some(spec) = &ds.spec {
            out.push(Workload {
                kind: "DaemonSet",
                name: ds.metadata.name.clone().unwrap_or_default(),
                namespace: ds.metadata.namespace.clone(),
                template: &spec.template,
            });
        }
    }
    for d in &o.deployments {
        if let Some(spec) = &d.spec {
            out.push(Workload {
                kind: "Deployment",
                name: d.metadata.name.clone().unwrap_or_default(),
                namespace: d.metadata.namespace.clone(),
                template: &spec.template,
            });
        }
    }
    out
}

fn check_namespaces(o: &Objects, v: &mut Vec<String>) {
    if !o.namespaces.iter().any(|n| n.metadata.name.as_deref() == Some(NAMESPACE)) {
        v.push(format!("no Namespace {NAMESPACE}"));
    }
    for (kind, namespace, name) in &o.all {
        let cluster_scoped =
            matches!(kind.as_str(), "Namespace" | "ClusterRole" | "ClusterRoleBinding" | "CustomResourceDefinition");
        match (cluster_scoped, namespace.as_deref()) {
            (true, None) | (false, Some(NAMESPACE)) => {}
            (true, Some(ns)) => v.push(format!("{kind}/{name} is cluster-scoped but names namespace {ns}")),
            (false, ns) => v.push(format!("{kind}/{name} is in namespace {ns:?}, not {NAMESPACE}")),
        }
    }
}

/// The value of `--flag=VALUE` or `--flag VALUE` in `args`.
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let eq = format!("--{flag}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if let Some(value) = a.strip_prefix(&eq) {
            Some(value)
        } else if a == &format!("--{flag}") {
            args.get(i + 1).map(String::as_str)
        } else {
            None
        }
    })
}

fn check_pod(w: &Workload, v: &mut Vec<String>) {
    let id = format!("{}/{}", w.kind, w.name);
    let spec = w.spec();
    if w.template.spec.is_none() {
        v.push(format!("{id}: no pod spec"));
    }
    if spec.host_pid == Some(true) || spec.host_ipc == Some(true) {
        v.push(format!("{id}: hostPID/hostIPC"));
    }
    let is_agent = w.kind == "DaemonSet" && w.name == AGENT;
    if !is_agent && spec.host_network == Some(true) {
        v.push(format!("{id}: hostNetwork, which only the agent needs"));
    }
    let host_paths: BTreeSet<&str> =
        spec.volumes.iter().flatten().filter_map(|vol| vol.host_path.as_ref()).map(|h| h.path.as_str()).collect();
    let allowed: BTreeSet<&str> = if is_agent { AGENT_HOST_PATHS.iter().copied().collect() } else { BTreeSet::new() };
    if host_paths != allowed {
        v.push(format!("{id}: hostPath volumes {host_paths:?}, expected {allowed:?}"));
    }
    if w.kind == "Deployment" && spec.security_context.as_ref().and_then(|s| s.run_as_non_root) != Some(true) {
        v.push(format!("{id}: pod does not set runAsNonRoot: true"));
    }
    for (c, init) in w.all_containers() {
        let cid = format!("{id} container {}", c.name);
        let sc = c.security_context.clone().unwrap_or_default();
        if sc.privileged == Some(true) {
            v.push(format!("{cid}: privileged: true"));
        }
        let caps = sc.capabilities.clone().unwrap_or_default();
        if !caps.drop.iter().flatten().any(|d| d == "ALL") {
            v.push(format!("{cid}: capabilities do not drop ALL"));
        }
        let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
        let expected: BTreeSet<&str> = if is_agent && c.name == "agent" && !init {
            AGENT_CAPABILITIES.iter().copied().collect()
        } else {
            BTreeSet::new()
        };
        if added != expected {
            v.push(format!("{cid}: capabilities added {added:?}, expected exactly {expected:?}"));
        }
        // With CAP_SYS_ADMIN the kernel allows escalation regardless; everywhere else it is off.
        if !added.contains("SYS_ADMIN") && sc.allow_privilege_escalation != Some(false) {
            v.push(format!("{cid}: allowPrivilegeEscalation is not false"));
        }
        if sc.read_only_root_filesystem != Some(true) {
            v.push(format!("{cid}: root filesystem is writable"));
        }
        let resources = c.resources.clone().unwrap_or_default();
        for (what, map) in [("limits", &resources.limits), ("requests", &resources.requests)] {
            for resource in ["cpu", "memory"] {
                if !map.as_ref().is_some_and(|m| m.contains_key(resource)) {
                    v.push(format!("{cid}: no {resource} in resources.{what}"));
                }
            }
        }
        if init {
            continue;
        }
        let ports = c.ports.clone().unwrap_or_default();
        let listen_port = flag_value(c.args.as_deref().unwrap_or_default(), "listen")
            .and_then(|l| l.rsplit(':').next())
            .and_then(|p| p.parse::<i32>().ok());
        for (what, probe, path) in
            [("readinessProbe", &c.readiness_probe, "/readyz"), ("livenessProbe", &c.liveness_probe, "/healthz")]
        {
            let Some(http) = probe.as_ref().and_then(|p| p.http_get.as_ref()) else {
                v.push(format!("{cid}: no {what} with httpGet"));
                continue;
            };
            if http.path.as_deref() != Some(path) {
                v.push(format!("{cid}: {what} path {:?}, expected {path}", http.path));
            }
            let declared = ports.iter().find(|p| match &http.port {
                IntOrString::Int(n) => p.container_port == *n,
                IntOrString::String(name) => p.name.as_deref() == Some(name.as_str()),
            });
            match declared {
                None => v.push(format!("{cid}: {what} port {:?} is not a declared container port", http.port)),
                Some(p) if listen_port.is_some_and(|l| l != p.container_port) => {
                    v.push(format!("{cid}: {what} port {} is not the --listen port {listen_port:?}", p.container_port))
                }
                Some(_) => {}
            }
        }
    }
}

/// Flag names (without `--`) of `wasmplane run`, read from the clap derive in
/// host/src/cli.rs: `long = "name"`, or plain `long` on a field (snake_case → kebab-case).
fn run_flags_from_cli(source: &str) -> BTreeSet<String> {
    let start = source.find("pub struct RunArgs").expect("host/src/cli.rs has no RunArgs");
    let body = &source[start..];
    let body = &body[..body.find("\n}").expect("RunArgs is closed")];
    let mut flags = BTreeSet::new();
    let mut attributes = String::new();
    for line in body.lines().skip(1).map(str::trim) {
        if line.starts_with("#[") {
            attributes.push_str(line);
            attributes.push(' ');
        } else if let Some(field) = line.strip_prefix("pub ").and_then(|f| f.split(':').next()) {
            if let Some(i) = attributes.find("long = \"") {
                let rest = &attributes[i + "long = \"".len()..];
                flags.insert(rest[..rest.find('"').unwrap_or(0)].to_string());
            } else if attributes.split(|c: char| !(c.is_alphanumeric() || c == '_')).any(|word| word == "long") {
                flags.insert(field.trim().replace('_', "-"));
            }
            attributes.clear();
        } else if !line.starts_with("///") && !line.is_empty() {
            // A multi-line attribute continues.
            attributes.push_str(line);
            attributes.push(' ');
        }
    }
    flags
}

fn cli_flags() -> BTreeSet<String> {
    run_flags_from_cli(&read_file(&workspace().join("host/src/cli.rs")).unwrap())
}

fn check_args(w: &Workload, cli_flags: &BTreeSet<String>, v: &mut Vec<String>) {
    for (c, _) in w.all_containers() {
        let cid = format!("{}/{} container {}", w.kind, w.name, c.name);
        let args = c.args.clone().unwrap_or_default();
        let env: BTreeSet<&str> = c.env.iter().flatten().map(|e| e.name.as_str()).collect();
        for arg in c.command.iter().flatten().chain(&args) {
            // `$(VAR)` is expanded by the kubelet only for declared variables.
            let mut rest = arg.as_str();
            while let Some(i) = rest.find("$(") {
                let end = rest[i..].find(')').map(|e| i + e).unwrap_or(rest.len());
                let name = &rest[i + 2..end];
                if !env.contains(name) {
                    v.push(format!("{cid}: {arg} refers to undeclared variable {name}"));
                }
                rest = &rest[end..];
            }
        }
        let runs_wasmplane =
            c.command.as_ref().and_then(|c| c.first()).is_some_and(|p| p.rsplit('/').next() == Some("wasmplane"));
        if !runs_wasmplane {
            continue;
        }
        if args.first().map(String::as_str) != Some("run") {
            v.push(format!("{cid}: wasmplane is not started with `run`"));
        }
        for arg in args.iter().filter_map(|a| a.strip_prefix("--")) {
            let flag = arg.split('=').next().unwrap_or_default();
            if !cli_flags.contains(flag) && !PENDING_FLAGS.contains(&flag) {
                v.push(format!("{cid}: --{flag} is not a flag of `wasmplane run` (host/src/cli.rs)"));
            }
        }
        if !args.iter().any(|a| a == "--kubernetes") {
            v.push(format!("{cid}: does not watch the cluster (--kubernetes)"));
        }
        if !flag_value(&args, "kvstore").is_some_and(|k| k.starts_with("etcd://") || k.starts_with("$(")) {
            v.push(format!("{cid}: --kvstore does not come from the etcd configuration"));
        }
        if !flag_value(&args, "token-file").is_some_and(|path| {
            c.volume_mounts.iter().flatten().any(|m| {
                path.starts_with(&format!("{}/", m.mount_path))
                    && w.spec().volumes.iter().flatten().any(|vol| {
                        vol.name == m.name
                            && vol.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some(TOKEN_SECRET)
                    })
            })
        }) {
            v.push(format!("{cid}: --token-file is not in the mounted Secret {TOKEN_SECRET}"));
        }
    }
}

fn agent_workload<'a>(o: &'a Objects) -> Option<Workload<'a>> {
    workloads(o).into_iter().find(|w| w.kind == "DaemonSet" && w.name == AGENT)
}

fn check_agent(o: &Objects, v: &mut Vec<String>) {
    let Some(w) = agent_workload(o) else {
        v.push(format!("no DaemonSet {AGENT}"));
        return;
    };
    let spec = w.spec();
    if spec.host_network != Some(true) {
        v.push(format!("DaemonSet {AGENT}: not on the host network"));
    }
    if spec.service_account_name.as_deref() != Some(AGENT) {
        v.push(format!("DaemonSet {AGENT}: service account {:?}", spec.service_account_name));
    }
    if !spec
        .tolerations
        .iter()
        .flatten()
        .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none() && t.effect.is_none())
    {
        v.push(format!("DaemonSet {AGENT}: does not tolerate every taint (operator: Exists), so some nodes would get no pod network"));
    }
    let host_path_of = |volume: &str| {
        spec.volumes
            .iter()
            .flatten()
            .find(|vol| vol.name == volume)
            .and_then(|vol| vol.host_path.as_ref())
            .map(|h| h.path.clone())
    };
    let mounts = |c: &Container| -> BTreeMap<String, Option<String>> {
        c.volume_mounts.iter().flatten().map(|m| (m.mount_path.clone(), host_path_of(&m.name))).collect()
    };
    let Some(agent) = spec.containers.iter().find(|c| c.name == "agent") else {
        v.push(format!("DaemonSet {AGENT}: no container named agent"));
        return;
    };
    let args = agent.args.clone().unwrap_or_default();
    let agent_mounts = mounts(agent);
    if flag_value(&args, "dataplane") != Some("nftables") {
        v.push(format!("DaemonSet {AGENT}: --dataplane is not nftables"));
    }
    let netns = agent.volume_mounts.iter().flatten().find(|m| m.mount_path == "/run/netns");
    if !netns.is_some_and(|m| {
        host_path_of(&m.name).as_deref() == Some("/run/netns")
            && m.mount_propagation.as_deref() == Some("HostToContainer")
    }) {
        v.push(format!("DaemonSet {AGENT}: /run/netns is not the node's, with HostToContainer propagation"));
    }
    let socket = flag_value(&args, "cni-socket").map(Path::new);
    match socket.and_then(Path::parent) {
        Some(dir) if agent_mounts.get(dir.to_str().unwrap_or_default()) == Some(&Some(dir.display().to_string())) => {}
        _ => v.push(format!(
            "DaemonSet {AGENT}: --cni-socket {socket:?} is not in a directory mounted from the same node path"
        )),
    }
    match flag_value(&args, "data-dir") {
        Some(dir) if agent_mounts.get(dir).is_some_and(Option::is_some) => {}
        dir => v.push(format!("DaemonSet {AGENT}: --data-dir {dir:?} is not kept on the node")),
    }
    // The init container installs the plugin and its configuration on the node.
    let installed = spec.init_containers.iter().flatten().any(|c| {
        let m = mounts(c);
        let script = c.command.iter().flatten().chain(c.args.iter().flatten()).cloned().collect::<Vec<_>>().join(" ");
        m.values().any(|p| p.as_deref() == Some("/opt/cni/bin"))
            && m.values().any(|p| p.as_deref() == Some("/etc/cni/net.d"))
            && script.contains("wasmplane-cni")
            && script.contains(".conflist")
    });
    if !installed {
        v.push(format!("DaemonSet {AGENT}: no init container installs wasmplane-cni and its conflist on the node"));
    }
    // The conflist points the plugin at the agent's socket.
    let conflists: Vec<&String> = o
        .config_maps
        .iter()
        .flat_map(|cm| cm.data.iter().flatten())
        .filter(|(k, _)| k.ends_with(".conflist"))
        .map(|(_, text)| text)
        .collect();
    if conflists.is_empty() {
        v.push("no CNI .conflist in a ConfigMap".into());
    }
    for text in conflists {
        match serde_json::from_str::<Value>(text) {
            Err(e) => v.push(format!("conflist is not JSON: {e}")),
            Ok(conf) => {
                let plugin = conf["plugins"].as_array().and_then(|p| p.iter().find(|p| p["type"] == "wasmplane-cni"));
                match plugin {
                    None => v.push("conflist has no wasmplane-cni plugin".into()),
                    Some(p) => {
                        if p["daemonSocket"].as_str().map(Path::new) != socket {
                            v.push(format!(
                                "conflist daemonSocket {} is not the agent's --cni-socket {socket:?}",
                                p["daemonSocket"]
                            ));
                        }
                        if p["daemonTimeoutSeconds"].as_u64().unwrap_or(0) == 0 {
                            v.push("conflist daemonTimeoutSeconds is not a positive integer".into());
                        }
                    }
                }
                if conf["cniVersion"].as_str().is_none() || conf["name"].as_str().is_none() {
                    v.push("conflist lacks cniVersion or name".into());
                }
            }
        }
    }
}

fn check_operator(o: &Objects, v: &mut Vec<String>) {
    let Some(d) = o.deployments.iter().find(|d| d.metadata.name.as_deref() == Some(OPERATOR)) else {
        v.push(format!("no Deployment {OPERATOR}"));
        return;
    };
    let spec = d.spec.clone().unwrap_or_default();
    if spec.replicas != Some(2) {
        v.push(format!("Deployment {OPERATOR}: replicas {:?}, expected 2", spec.replicas));
    }
    let pod = spec.template.spec.clone().unwrap_or_default();
    if pod.service_account_name.as_deref() != Some(OPERATOR) {
        v.push(format!("Deployment {OPERATOR}: service account {:?}", pod.service_account_name));
    }
    if !pod.containers.iter().any(|c| flag_value(c.args.as_deref().unwrap_or_default(), "role") == Some("operator")) {
        v.push(format!("Deployment {OPERATOR}: not started with --role operator"));
    }
}

/// (scope: None = cluster-wide, Some(namespace)), API group, resource → verbs.
type Grants = BTreeMap<(Option<String>, String, String), BTreeSet<String>>;

fn add_rules(grants: &mut Grants, scope: Option<String>, rules: &[PolicyRule]) {
    for rule in rules {
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                grants
                    .entry((scope.clone(), group.clone(), resource.clone()))
                    .or_default()
                    .extend(rule.verbs.iter().cloned());
            }
        }
    }
}

fn bound_to(subjects: &Option<Vec<Subject>>, account: &str) -> bool {
    subjects
        .iter()
        .flatten()
        .any(|s| s.kind == "ServiceAccount" && s.name == account && s.namespace.as_deref() == Some(NAMESPACE))
}

/// What `account` (in NAMESPACE) may do, through every binding.
fn grants_of(o: &Objects, account: &str) -> Grants {
    let cluster_role = |name: &str| o.cluster_roles.iter().find(|r| r.metadata.name.as_deref() == Some(name));
    let mut grants = Grants::new();
    for b in o.cluster_role_bindings.iter().filter(|b| bound_to(&b.subjects, account)) {
        if let Some(role) = cluster_role(&b.role_ref.name).filter(|_| b.role_ref.kind == "ClusterRole") {
            add_rules(&mut grants, None, role.rules.as_deref().unwrap_or_default());
        }
    }
    for b in o.role_bindings.iter().filter(|b| bound_to(&b.subjects, account)) {
        let scope = b.metadata.namespace.clone();
        let rules = match b.role_ref.kind.as_str() {
            "ClusterRole" => cluster_role(&b.role_ref.name).and_then(|r| r.rules.clone()),
            _ => o
                .roles
                .iter()
                .find(|r| r.metadata.name.as_deref() == Some(b.role_ref.name.as_str()) && r.metadata.namespace == scope)
                .and_then(|r| r.rules.clone()),
        };
        add_rules(&mut grants, scope, rules.as_deref().unwrap_or_default());
    }
    grants
}

fn expected_agent_grants() -> Grants {
    let mut g = Grants::new();
    let read = ["get", "list", "watch"];
    let mut put = |group: &str, resource: &str, verbs: &[&str]| {
        g.insert((None, group.into(), resource.into()), verbs.iter().map(|v| v.to_string()).collect());
    };
    for resource in ["services", "nodes", "pods", "namespaces"] {
        put("", resource, &read);
    }
    put("discovery.k8s.io", "endpointslices", &read);
    put("networking.k8s.io", "networkpolicies", &read);
    put("networking.k8s.io", "servicecidrs", &read);
    put("authentication.k8s.io", "tokenreviews", &["create"]);
    put("authorization.k8s.io", "subjectaccessreviews", &["create"]);
    g
}

fn expected_operator_grants() -> Grants {
    let mut g = expected_agent_grants();
    // The per-policy status summary is a merge patch of an annotation on the policy.
    g.get_mut(&(None, "networking.k8s.io".into(), "networkpolicies".into())).unwrap().insert("patch".into());
    g.insert(
        (Some(NAMESPACE.into()), "coordination.k8s.io".into(), "leases".into()),
        ["get", "create", "update"].map(String::from).into(),
    );
    // Slices of other clusters' endpoints (--clustermesh-sync-endpoint-slices).
    g.get_mut(&(None, "discovery.k8s.io".into(), "endpointslices".into()))
        .unwrap()
        .extend(["create", "update", "delete"].map(String::from));
    // WasmModule objects: read, finalizer added and removed, status written.
    g.insert(
        (None, "wasmplane.io".into(), "wasmmodules".into()),
        ["get", "list", "watch", "patch"].map(String::from).into(),
    );
    g.insert((None, "wasmplane.io".into(), "wasmmodules/status".into()), ["patch"].map(String::from).into());
    g
}

/// The WasmModule CRD is the resource the operator watches (`host/src/module_objects.rs`):
/// group, version, plural, kind, cluster scope, a status subresource (the operator patches
/// `/status`) and a structural schema requiring `spec.kind` and `spec.module`.
fn check_crds(o: &Objects, v: &mut Vec<String>) {
    let host = read_file(&workspace().join("host/src/module_objects.rs")).unwrap_or_default();
    let constant = |name: &str| {
        host.lines()
            .find_map(|l| l.strip_prefix(&format!("pub const {name}: &str = \"")))
            .and_then(|rest| rest.strip_suffix("\";"))
            .unwrap_or_default()
            .to_string()
    };
    let [crd] = o.custom_resource_definitions.as_slice() else {
        v.push(format!("expected one CustomResourceDefinition, found {}", o.custom_resource_definitions.len()));
        return;
    };
    let spec = &crd.spec;
    let (group, plural, kind) = (constant("GROUP"), constant("PLURAL"), constant("KIND"));
    if (spec.group.as_str(), spec.names.plural.as_str(), spec.names.kind.as_str())
        != (group.as_str(), plural.as_str(), kind.as_str())
    {
        v.push(format!(
            "CRD {}/{}/{} is not the host's {group}/{plural}/{kind}",
            spec.group, spec.names.plural, spec.names.kind
        ));
    }
    if crd.metadata.name.as_deref() != Some(&format!("{plural}.{group}")) {
        v.push(format!("CRD named {:?}, not {plural}.{group}", crd.metadata.name));
    }
    if spec.scope != "Cluster" {
        v.push(format!("CRD scope {}, the operator watches a cluster-scoped resource", spec.scope));
    }
    let version = constant("VERSION");
    match spec.versions.iter().find(|x| x.name == version) {
        None => v.push(format!("CRD has no version {version}")),
        Some(x) => {
            if !(x.served && x.storage) {
                v.push(format!("CRD version {version} is not served and stored"));
            }
            if x.subresources.as_ref().and_then(|s| s.status.as_ref()).is_none() {
                v.push("CRD has no status subresource".into());
            }
            let required = x
                .schema
                .as_ref()
                .and_then(|s| s.open_api_v3_schema.as_ref())
                .and_then(|s| s.properties.as_ref())
                .and_then(|p| p.get("spec"))
                .and_then(|s| s.required.clone())
                .unwrap_or_default();
            if required != ["kind", "module"] {
                v.push(format!("CRD spec requires {required:?}, not kind and module"));
            }
        }
    }
}

fn check_rbac(o: &Objects, v: &mut Vec<String>) {
    let mut all_rules: Vec<(String, &PolicyRule)> = Vec::new();
    for r in &o.cluster_roles {
        all_rules.extend(
            r.rules
                .iter()
                .flatten()
                .map(|rule| (format!("ClusterRole/{}", r.metadata.name.as_deref().unwrap_or_default()), rule)),
        );
        if r.aggregation_rule.is_some() {
            v.push(format!("ClusterRole/{}: aggregation rule", r.metadata.name.as_deref().unwrap_or_default()));
        }
    }
    for r in &o.roles {
        all_rules.extend(
            r.rules
                .iter()
                .flatten()
                .map(|rule| (format!("Role/{}", r.metadata.name.as_deref().unwrap_or_default()), rule)),
        );
    }
    for (role, rule) in all_rules {
        let fields = [&rule.api_groups, &rule.resources, &rule.resource_names, &rule.non_resource_urls];
        if rule.verbs.iter().chain(fields.into_iter().flatten().flatten()).any(|x| x.contains('*')) {
            v.push(format!("{role}: wildcard in rule {rule:?}"));
        }
        if rule.resources.iter().flatten().any(|r| r == "secrets" || r.starts_with("secrets/")) {
            v.push(format!("{role}: grants access to secrets"));
        }
        if rule.verbs.iter().any(|verb| matches!(verb.as_str(), "escalate" | "bind" | "impersonate")) {
            v.push(format!("{role}: grants {:?}", rule.verbs));
        }
        if rule.non_resource_urls.is_some() {
            v.push(format!("{role}: non-resource URLs"));
        }
    }
    for (account, expected) in [(AGENT, expected_agent_grants()), (OPERATOR, expected_operator_grants())] {
        let actual = grants_of(o, account);
        if actual != expected {
            let describe = |g: &Grants, h: &Grants| {
                g.iter()
                    .filter(|(k, verbs)| h.get(*k) != Some(verbs))
                    .map(|((scope, group, resource), verbs)| format!("{scope:?} {group}/{resource} {verbs:?}"))
                    .collect::<Vec<_>>()
            };
            v.push(format!(
                "ServiceAccount {account}: grants differ: unexpected {:?}, missing {:?}",
                describe(&actual, &expected),
                describe(&expected, &actual)
            ));
        }
    }
    // Every binding points at a role and at service accounts that exist here.
    let check_binding = |kind: &str,
                         name: &str,
                         role_ref: &RoleRef,
                         subjects: &Option<Vec<Subject>>,
                         v: &mut Vec<String>| {
        let role_exists = match role_ref.kind.as_str() {
            "ClusterRole" => o.cluster_roles.iter().any(|r| r.metadata.name.as_deref() == Some(role_ref.name.as_str())),
            "Role" => o.roles.iter().any(|r| r.metadata.name.as_deref() == Some(role_ref.name.as_str())),
            _ => false,
        };
        if !role_exists || role_ref.api_group != "rbac.authorization.k8s.io" {
            v.push(format!("{kind}/{name}: roleRef {} {} is not defined here", role_ref.kind, role_ref.name));
        }
        for s in subjects.iter().flatten() {
            let exists = s.kind == "ServiceAccount"
                && o.service_accounts.iter().any(|a| {
                    a.metadata.name.as_deref() == Some(s.name.as_str()) && a.metadata.namespace == s.namespace
                });
            if !exists {
                v.push(format!("{kind}/{name}: subject {} {} is not a ServiceAccount defined here", s.kind, s.name));
            }
        }
    };
    for b in &o.cluster_role_bindings {
        check_binding(
            "ClusterRoleBinding",
            b.metadata.name.as_deref().unwrap_or_default(),
            &b.role_ref,
            &b.subjects,
            v,
        );
    }
    for b in &o.role_bindings {
        check_binding("RoleBinding", b.metadata.name.as_deref().unwrap_or_default(), &b.role_ref, &b.subjects, v);
    }
}

/// ServiceAccounts, ConfigMap keys and Secrets the pods refer to.
fn check_references(o: &Objects, v: &mut Vec<String>) {
    let config_key = |name: &str, key: &str| {
        o.config_maps.iter().any(|cm| {
            cm.metadata.name.as_deref() == Some(name) && cm.data.as_ref().is_some_and(|d| d.contains_key(key))
        })
    };
    for w in workloads(o) {
        let id = format!("{}/{}", w.kind, w.name);
        let spec = w.spec();
        let account = spec.service_account_name.as_deref().unwrap_or("default");
        if !o
            .service_accounts
            .iter()
            .any(|a| a.metadata.name.as_deref() == Some(account) && a.metadata.namespace == w.namespace)
        {
            v.push(format!("{id}: ServiceAccount {account} is not defined here"));
        }
        for vol in spec.volumes.iter().flatten() {
            if let Some(cm) = &vol.config_map {
                for item in cm.items.iter().flatten() {
                    if !config_key(&cm.name, &item.key) {
                        v.push(format!(
                            "{id}: volume {} wants ConfigMap {} key {}, which is missing",
                            vol.name, cm.name, item.key
                        ));
                    }
                }
                if cm.items.is_none()
                    && !o.config_maps.iter().any(|c| c.metadata.name.as_deref() == Some(cm.name.as_str()))
                {
                    v.push(format!("{id}: ConfigMap {} is missing", cm.name));
                }
            }
            if let Some(secret) = &vol.secret
                && secret.secret_name.as_deref() != Some(TOKEN_SECRET)
            {
                v.push(format!("{id}: Secret {:?} is not the API token's", secret.secret_name));
            }
        }
        for (c, _) in w.all_containers() {
            for e in c.env.iter().flatten() {
                if let Some(r) = e
                    .value_from
                    .as_ref()
                    .and_then(|f| f.config_map_key_ref.as_ref())
                    // An optional key may be left out: the variable is then not set.
                    && r.optional != Some(true)
                    && !config_key(&r.name, &r.key)
                {
                    v.push(format!(
                        "{id} container {}: env {} wants ConfigMap {} key {}, which is missing",
                        c.name, e.name, r.name, r.key
                    ));
                }
                if e.value_from.as_ref().is_some_and(|f| f.secret_key_ref.is_some()) {
                    v.push(format!(
                        "{id} container {}: env {} comes from a Secret (mount the token file instead)",
                        c.name, e.name
                    ));
                }
            }
        }
    }
    for cm in &o.config_maps {
        if let Some(kvstore) = cm.data.as_ref().and_then(|d| d.get("kvstore"))
            && !(kvstore.starts_with("etcd://") && kvstore.len() > "etcd://".len())
        {
            v.push(format!("ConfigMap {:?}: kvstore {kvstore:?} is not etcd://host:port[,…]", cm.metadata.name));
        }
    }
}

fn check_service(o: &Objects, v: &mut Vec<String>) {
    if !o.services.iter().any(|s| s.metadata.name.as_deref() == Some("wasmplane-api")) {
        v.push("no Service wasmplane-api (the REST API)".into());
    }
    for s in &o.services {
        let name = s.metadata.name.clone().unwrap_or_default();
        let spec = s.spec.clone().unwrap_or_default();
        let selector = spec.selector.clone().unwrap_or_default();
        let all = workloads(o);
        let selected: Vec<&Workload> = all
            .iter()
            .filter(|w| !selector.is_empty() && selector.iter().all(|(k, val)| w.labels().get(k) == Some(val)))
            .collect();
        if selected.is_empty() {
            v.push(format!("Service/{name}: selects no pods"));
        }
        for port in spec.ports.iter().flatten() {
            let target = port.target_port.clone().unwrap_or(IntOrString::Int(port.port));
            for w in &selected {
                let declared =
                    w.spec().containers.iter().flat_map(|c| c.ports.iter().flatten()).any(|p| match &target {
                        IntOrString::Int(n) => p.container_port == *n,
                        IntOrString::String(n) => p.name.as_deref() == Some(n.as_str()),
                    });
                if !declared {
                    v.push(format!("Service/{name}: targetPort {target:?} is not declared by {}/{}", w.kind, w.name));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[test]
fn deploy_manifests_are_valid_and_least_privilege() {
    let docs = rendered();
    let flags = cli_flags();
    let violations = validate(&docs, &flags);
    assert!(violations.is_empty(), "deploy/ violations:\n  {}", violations.join("\n  "));
    let missing: Vec<&&str> = PENDING_FLAGS.iter().filter(|f| !flags.contains(**f)).collect();
    if !missing.is_empty() {
        println!("flags the manifests use that host/src/cli.rs does not define yet: {missing:?}");
    }
    println!("deploy/: {} objects valid", docs.len());
}

#[test]
fn kubectl_kustomize_renders_the_same_objects() {
    let available = Command::new("kubectl").args(["version", "--client"]).output().is_ok_and(|o| o.status.success());
    if !available {
        println!("kubectl not found: `kubectl kustomize deploy/` comparison skipped");
        return;
    }
    let output =
        Command::new("kubectl").arg("kustomize").arg(deploy_dir()).output().expect("running kubectl kustomize");
    assert!(output.status.success(), "kubectl kustomize deploy/ failed: {}", String::from_utf8_lossy(&output.stderr));
    let key = |v: &Value| {
        format!("{} {} {} {}", v["apiVersion"], v["kind"], v["metadata"]["namespace"], v["metadata"]["name"])
    };
    let by_key = |values: Vec<Value>| values.into_iter().map(|v| (key(&v), v)).collect::<BTreeMap<_, _>>();
    let kubectl = by_key(parse_documents(&String::from_utf8(output.stdout).unwrap(), "kubectl kustomize").unwrap());
    let ours = rendered();
    let count = ours.len();
    let ours = by_key(ours.into_iter().map(|d| d.value).collect());
    assert_eq!(ours.len(), count, "two objects with the same kind, namespace and name");
    assert_eq!(kubectl.keys().collect::<Vec<_>>(), ours.keys().collect::<Vec<_>>());
    for (k, v) in &ours {
        assert_eq!(&kubectl[k], v, "{k}: kubectl kustomize renders it differently");
    }
    // And kubectl's rendering passes the same checks.
    let docs: Vec<Doc> = kubectl.into_values().map(|value| Doc { source: "kubectl kustomize".into(), value }).collect();
    let violations = validate(&docs, &cli_flags());
    assert!(violations.is_empty(), "{violations:#?}");
}

#[test]
fn conflist_keys_are_the_plugins() {
    // The keys deploy/ sets are the ones wasmplane-cni reads (host/cni-plugin/src/main.rs).
    let plugin = read_file(&workspace().join("host/cni-plugin/src/main.rs")).unwrap();
    for key in ["daemonSocket", "daemonTimeoutSeconds"] {
        assert!(plugin.contains(&format!("\"{key}\"")), "wasmplane-cni no longer reads {key}");
    }
}

#[test]
fn cli_flag_parser_reads_run_args() {
    let flags = cli_flags();
    for flag in [
        "listen",
        "kubernetes",
        "kvstore",
        "cni-socket",
        "data-dir",
        "node-name",
        "cluster-cidr",
        "dataplane",
        "token-file",
        "kubernetes-auth",
    ] {
        assert!(flags.contains(flag), "--{flag} not found in host/src/cli.rs: {flags:?}");
    }
    // Fields without `long` are not flags; ApiArgs' flags are not run's.
    assert!(!flags.contains("api"));
}

#[test]
fn renderer_refuses_what_it_does_not_model() {
    let files = BTreeMap::from([(
        "kustomization.yaml",
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: other\nresources: [a.yaml]\n",
    )]);
    let read = |p: &Path| {
        files
            .get(p.file_name().unwrap().to_str().unwrap())
            .map(|s| s.to_string())
            .ok_or_else(|| format!("{} missing", p.display()))
    };
    let e = render(Path::new("/x"), &read).unwrap_err();
    assert!(e.contains("namespace"), "{e}");
}

// Mutations: each must be caught.

fn mutated(kind: &str, name: &str, change: impl FnOnce(&mut Value)) -> Vec<String> {
    let mut docs = rendered();
    let doc = docs
        .iter_mut()
        .find(|d| d.value["kind"] == kind && d.value["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name}"));
    change(&mut doc.value);
    validate(&docs, &cli_flags())
}

fn assert_caught(violations: Vec<String>, expected: &str) {
    assert!(
        violations.iter().any(|v| v.contains(expected)),
        "expected a violation containing {expected:?}, got {violations:#?}"
    );
}

fn pod(doc: &mut Value) -> &mut Value {
    &mut doc["spec"]["template"]["spec"]
}

#[test]
fn misspelled_field_is_caught() {
    let text = read_file(&deploy_dir().join("agent.yaml")).unwrap();
    assert!(text.contains("hostNetwork: true"));
    let broken = text.replace("hostNetwork: true", "hostNetwrok: true");
    let read = |p: &Path| {
        if p.ends_with("agent.yaml") { Ok(broken.clone()) } else { read_file(p) }
    };
    let docs = render(&deploy_dir(), &read).unwrap();
    let violations = validate(&docs, &cli_flags());
    assert_caught(violations.clone(), "unknown field .spec.template.spec.hostNetwrok");
    // The object is rejected whole: nothing reads the misspelled value as if it were right.
    assert_caught(violations, "no DaemonSet wasmplane-agent");
}

#[test]
fn crd_mismatch_is_caught() {
    assert_caught(
        mutated("CustomResourceDefinition", "wasmmodules.wasmplane.io", |d| {
            d["spec"]["scope"] = "Namespaced".into();
        }),
        "CRD scope Namespaced",
    );
    assert_caught(
        mutated("CustomResourceDefinition", "wasmmodules.wasmplane.io", |d| {
            d["spec"]["names"]["plural"] = "modules".into();
        }),
        "is not the host's wasmplane.io/wasmmodules/WasmModule",
    );
    assert_caught(
        mutated("CustomResourceDefinition", "wasmmodules.wasmplane.io", |d| {
            d["spec"]["versions"][0]["subresources"] = serde_json::json!({});
        }),
        "no status subresource",
    );
}

#[test]
fn wrong_type_is_caught() {
    assert_caught(
        mutated("Deployment", OPERATOR, |d| d["spec"]["replicas"] = "two".into()),
        "not a valid object of its kind",
    );
}

#[test]
fn unknown_kind_is_caught() {
    assert_caught(
        mutated("ConfigMap", "wasmplane-config", |d| {
            d["kind"] = "Secret".into();
        }),
        "not a kind deploy/ is expected to contain",
    );
}

#[test]
fn extra_capability_is_caught() {
    assert_caught(
        mutated("DaemonSet", AGENT, |d| {
            pod(d)["containers"][0]["securityContext"]["capabilities"]["add"]
                .as_array_mut()
                .unwrap()
                .push("NET_RAW".into())
        }),
        "capabilities added",
    );
    assert_caught(
        mutated("Deployment", OPERATOR, |d| {
            pod(d)["containers"][0]["securityContext"]["capabilities"]["add"] = serde_json::json!(["NET_ADMIN"])
        }),
        "capabilities added",
    );
}

#[test]
fn privileged_is_caught() {
    assert_caught(
        mutated("DaemonSet", AGENT, |d| pod(d)["initContainers"][0]["securityContext"]["privileged"] = true.into()),
        "privileged: true",
    );
}

#[test]
fn extra_host_path_is_caught() {
    assert_caught(
        mutated("DaemonSet", AGENT, |d| {
            pod(d)["volumes"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({"name": "root", "hostPath": {"path": "/"}}))
        }),
        "hostPath volumes",
    );
}

#[test]
fn wildcard_rbac_is_caught() {
    assert_caught(mutated("ClusterRole", AGENT, |d| d["rules"][0]["verbs"] = serde_json::json!(["*"])), "wildcard");
    assert_caught(
        mutated("ClusterRole", OPERATOR, |d| d["rules"][0]["resources"] = serde_json::json!(["*"])),
        "wildcard",
    );
}

#[test]
fn extra_grant_is_caught() {
    assert_caught(
        mutated("ClusterRole", AGENT, |d| d["rules"][0]["verbs"].as_array_mut().unwrap().push("delete".into())),
        "grants differ",
    );
    assert_caught(
        mutated("ClusterRole", AGENT, |d| {
            d["rules"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}))
        }),
        "secrets",
    );
}

#[test]
fn operator_without_leases_is_caught() {
    assert_caught(
        mutated("RoleBinding", "wasmplane-operator-leader-election", |d| {
            d["subjects"][0]["name"] = "someone-else".into()
        }),
        "missing",
    );
    assert_caught(
        mutated("Role", "wasmplane-operator-leader-election", |d| d["rules"][0]["verbs"] = serde_json::json!(["get"])),
        "leases",
    );
}

#[test]
fn operator_replicas_are_caught() {
    assert_caught(mutated("Deployment", OPERATOR, |d| d["spec"]["replicas"] = 1.into()), "replicas");
    assert_caught(
        mutated("Deployment", OPERATOR, |d| {
            let args = pod(d)["containers"][0]["args"].as_array_mut().unwrap();
            args.retain(|a| a != "--role" && a != "operator");
        }),
        "--role operator",
    );
}

#[test]
fn missing_limits_are_caught() {
    assert_caught(
        mutated("DaemonSet", AGENT, |d| {
            pod(d)["initContainers"][0]["resources"].as_object_mut().unwrap().remove("limits").map(drop).unwrap()
        }),
        "no cpu in resources.limits",
    );
    assert_caught(
        mutated("Deployment", OPERATOR, |d| {
            pod(d)["containers"][0]["resources"]["limits"].as_object_mut().unwrap().remove("memory").map(drop).unwrap()
        }),
        "no memory in resources.limits",
    );
}

#[test]
fn probe_on_undeclared_port_is_caught() {
    assert_caught(
        mutated("DaemonSet", AGENT, |d| pod(d)["containers"][0]["livenessProbe"]["httpGet"]["port"] = "metrics".into()),
        "not a declared container port",
    );
    assert_caught(
        mutated("Deployment", OPERATOR, |d| pod(d)["containers"][0]["readinessProbe"]["httpGet"]["port"] = 9999.into()),
        "not a declared container port",
    );
    assert_caught(
        mutated("Deployment", OPERATOR, |d| {
            pod(d)["containers"][0].as_object_mut().unwrap().remove("readinessProbe").map(drop).unwrap()
        }),
        "no readinessProbe",
    );
}

#[test]
fn unknown_flag_is_caught() {
    assert_caught(
        mutated("DaemonSet", AGENT, |d| {
            pod(d)["containers"][0]["args"].as_array_mut().unwrap().push("--listne=0.0.0.0:1".into())
        }),
        "--listne is not a flag",
    );
    assert_caught(
        mutated("DaemonSet", AGENT, |d| {
            pod(d)["containers"][0]["args"].as_array_mut().unwrap().push("--kvstore=$(ETCD)".into())
        }),
        "undeclared variable ETCD",
    );
}

#[test]
fn broken_cni_wiring_is_caught() {
    assert_caught(
        mutated("ConfigMap", "wasmplane-config", |d| {
            let text = d["data"]["10-wasmplane.conflist"]
                .as_str()
                .unwrap()
                .replace("/run/wasmplane/cni.sock", "/tmp/cni.sock");
            d["data"]["10-wasmplane.conflist"] = text.into();
        }),
        "daemonSocket",
    );
    assert_caught(mutated("DaemonSet", AGENT, |d| pod(d)["tolerations"] = serde_json::json!([])), "taint");
}

#[test]
fn service_to_undeclared_port_is_caught() {
    assert_caught(
        mutated("Service", "wasmplane-api", |d| d["spec"]["ports"][0]["targetPort"] = "http".into()),
        "targetPort",
    );
    assert_caught(
        mutated("Service", "wasmplane-api", |d| {
            d["spec"]["selector"]["app.kubernetes.io/component"] = "nothing".into()
        }),
        "selects no pods",
    );
}
