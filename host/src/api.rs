//! The REST API (axum), versioned under `/v1`, plus health, readiness and metrics.
//!
//! Mutating calls need `Authorization: Bearer <token>`; reads are open to loopback peers
//! only, and need the token from anywhere else.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use wasmplane_model::{CompactString, Labels, ObjectKey, Pod, Protocol, ServiceType, ServiceView};
use wasmplane_runtime::{GuestKind, LoadError};

use crate::auth::{AuthError, Identity};
use crate::controller::{Controller, HostError};
use crate::module_store::StoreError;
use crate::modules::Modules;
use crate::registry::{ModuleStatus, RegistryError};
use crate::metrics::{Metrics, ResultLabels};
use crate::nft::policy::Direction;
use crate::nft::service_drops::ServiceDropReason;
use crate::policy_log::{DropEvent, DropReason};

#[derive(Clone)]
pub struct ApiState {
    pub controller: Arc<Mutex<Controller>>,
    pub metrics: Arc<Metrics>,
    pub token: Arc<String>,
    pub ready: Arc<AtomicBool>,
    pub max_module_bytes: usize,
    pub modules: Arc<Modules>,
    pub agent: Option<Arc<crate::agent::Agent>>,
    pub operator: Option<Arc<crate::operator_role::OperatorRole>>,
    /// Static token and, if configured, Kubernetes TokenReview + SubjectAccessReview.
    pub auth: Arc<crate::auth::Auth>,
    pub audit: Arc<crate::audit::Audit>,
    /// The policy verdicts read back from the kernel, when they are (`--policy-log-group`).
    pub policy_verdicts: Option<Arc<crate::policy_log::PolicyVerdictLog>>,    /// The CNI daemon, where this host serves it (`--cni-socket`); empty until it serves.
    pub cni: Option<crate::cni::ServingDaemon>,
}

pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<HostError> for ApiError {
    fn from(e: HostError) -> Self {
        let status = match &e {
            HostError::BadRequest(_) => StatusCode::BAD_REQUEST,
            HostError::NotFound(_) => StatusCode::NOT_FOUND,
            HostError::Conflict(_) => StatusCode::CONFLICT,
            HostError::Load(LoadError::TooLarge { .. }) => StatusCode::PAYLOAD_TOO_LARGE,
            HostError::Load(LoadError::NotWasm | LoadError::CoreModule) => StatusCode::BAD_REQUEST,
            HostError::Load(_) | HostError::ActivationFailed { .. } | HostError::SettingsRefused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            HostError::Admission(_) => StatusCode::FORBIDDEN,
            HostError::Store(StoreError::Kv(wasmplane_kvstore::KvError::Unavailable(_))) => StatusCode::SERVICE_UNAVAILABLE,
            HostError::Store(StoreError::Contended(_)) => StatusCode::CONFLICT,
            HostError::Store(StoreError::Refused(RegistryError::NotFound(_))) => StatusCode::NOT_FOUND,
            HostError::Store(StoreError::Refused(RegistryError::Conflict(_))) => StatusCode::CONFLICT,
            HostError::Store(StoreError::Refused(RegistryError::BadRequest(_))) => StatusCode::BAD_REQUEST,
            HostError::Write(_) | HostError::Storage(_) | HostError::Store(_) | HostError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, e.to_string())
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs a controller operation on a blocking thread (guest calls are synchronous).
async fn with_controller<T: Send + 'static>(
    state: &ApiState,
    op: impl FnOnce(&mut Controller) -> Result<T, HostError> + Send + 'static,
) -> ApiResult<T> {
    let controller = state.controller.clone();
    tokio::task::spawn_blocking(move || {
        let mut guard = controller.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        op(&mut guard)
    })
    .await
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("controller task failed: {e}")))?
    .map_err(ApiError::from)
}

pub fn router(state: ApiState) -> Router {
    let max_body = state.max_module_bytes + 1024;
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/modules", get(list_modules))
        .route("/v1/modules/{name}", get(get_module).put(upload_module).delete(delete_module))
        .route("/v1/modules/{name}/activate", post(activate_module))
        .route("/v1/modules/{name}/rollback", post(rollback_module))
        .route("/v1/modules/{name}/settings", get(module_settings).put(set_module_settings).delete(clear_module_settings))
        .route("/v1/modules/{name}/shadow", post(start_shadow).delete(stop_shadow))
        .route("/v1/modules/{name}/shadow-diff", get(shadow_diff))
        .route("/v1/modules/{name}/promote", post(promote_shadow))
        .route("/v1/state", get(node_state))
        .route("/v1/cluster/nodes", get(cluster_nodes))
        .route("/v1/cluster/services", get(cluster_services))
        .route("/v1/operator", get(operator_state))
        .route("/v1/policies", get(list_policies))
        .route("/v1/policies/audit", post(set_module_audit))
        .route("/v1/policies/verdicts", get(policy_verdicts))
        .route("/v1/drops", get(drops))
        .route("/v1/policies/{namespace}/{name}/audit", post(set_policy_audit))
        .route("/v1/policies/{namespace}/{name}/status", get(policy_status))
        .route("/v1/dataplane", get(dataplane))
        .route("/v1/status", get(status))
        .route("/v1/services", get(list_services))
        .route("/v1/services/{namespace}/{name}", get(service_detail))
        .route("/v1/pods", get(list_pods))
        .route("/v1/pods/{namespace}/{name}", get(pod_detail))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        // Outermost: sees every answer, refused authentication included.
        .layer(middleware::from_fn_with_state(state.clone(), crate::audit::audit_layer))
        .with_state(state)
}

async fn authenticate(State(state): State<ApiState>, ConnectInfo(peer): ConnectInfo<SocketAddr>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let open_probe = matches!(path, "/healthz" | "/readyz");
    let read_only = matches!(*request.method(), Method::GET | Method::HEAD);
    // The gRPC stream's rule too: an IPv4 loopback client on a dual-stack socket is loopback.
    let needs_token = !open_probe && (!read_only || !crate::grpc_auth::is_loopback(Some(peer)));
    if !needs_token {
        return next.run(request).await;
    }
    match state.auth.check(request.headers(), !read_only).await {
        Ok(identity) => {
            let mut response = next.run(request).await;
            // For the audit layer outside this one.
            response.extensions_mut().insert(identity);
            response
        }
        Err(e) => {
            let status = match &e {
                AuthError::Missing | AuthError::Invalid | AuthError::Rejected { .. } => StatusCode::UNAUTHORIZED,
                AuthError::Forbidden { .. } => StatusCode::FORBIDDEN,
                AuthError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            };
            tracing::debug!(%peer, "refused: {e}");
            let mut response = ApiError(status, e.to_string()).into_response();
            if status == StatusCode::UNAUTHORIZED {
                response.headers_mut().insert(header::WWW_AUTHENTICATE, "Bearer".parse().expect("static header"));
            }
            if let Some(user) = e.user() {
                response.extensions_mut().insert(Identity { user: user.to_string(), method: "kubernetes" });
            }
            response
        }
    }
}

/// Why this host is not ready before the model is asked (see [`readyz`]): the initial sync,
/// the kvstore's health.
fn unready_reason(state: &ApiState) -> Option<String> {
    if !state.ready.load(Ordering::Relaxed) {
        return Some("initial sync pending".into());
    }
    state.agent.as_ref().and_then(|a| a.unready_reason())
}

async fn readyz(State(state): State<ApiState>) -> impl IntoResponse {
    if let Some(reason) = unready_reason(&state) {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n"));
    }
    // Off the async workers: the controller may be busy with a long write.
    match with_controller(&state, |c| Ok(c.model().local_detection_pending())).await {
        Ok(Some(reason)) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
        Ok(None) => (StatusCode::OK, "ready\n".to_string()),
        Err(ApiError(status, message)) => (status, format!("not ready: {message}\n")),
    }
}

/// Whether this host runs the operator role and leads.
async fn operator_state(State(state): State<ApiState>) -> ApiResult<Response> {
    let Some(operator) = &state.operator else {
        return Err(ApiError(StatusCode::NOT_FOUND, "this host does not run the operator role".into()));
    };
    Ok(Json(json!({ "leader": operator.is_leader(), "gc": operator.gc_stats().status() })).into_response())
}

#[derive(Deserialize)]
struct PoliciesQuery {
    /// Also read the kernel's drop counters (one `nft list table`).
    counters: Option<bool>,
}

/// The policies this node enforces: generation, audit mode, targets, errors.
async fn list_policies(State(state): State<ApiState>, Query(query): Query<PoliciesQuery>) -> ApiResult<Response> {
    let body = with_controller(&state, move |c| {
        let counts = if query.counters.unwrap_or(false) {
            c.refresh_policy_metrics(true)?;
            Some(c.policy_drop_counts()?)
        } else {
            None
        };
        let policies: Vec<Value> = c
            .policies()
            .into_iter()
            .map(|p| {
                let mut v = serde_json::to_value(&p).unwrap_or(Value::Null);
                if let Some(counts) = &counts {
                    let (dropped, would_drop) = counts.get(&ObjectKey::new(&p.namespace, &p.name)).copied().unwrap_or_default();
                    v["dropped_packets"] = json!(dropped);
                    v["audit_would_drop_packets"] = json!(would_drop);
                }
                v
            })
            .collect();
        Ok(json!({ "policies": policies }))
    })
    .await?;
    Ok(Json(body).into_response())
}

#[derive(Deserialize)]
struct AuditQuery {
    enabled: bool,
}

/// Audit mode for one policy on this node: would-be drops are logged and counted, not enforced.
async fn set_policy_audit(State(state): State<ApiState>, Path((namespace, name)): Path<(String, String)>, Query(query): Query<AuditQuery>) -> ApiResult<Response> {
    let key = ObjectKey::new(&namespace, &name);
    with_controller(&state, move |c| c.set_policy_audit(Some(&key), query.enabled)).await?;
    Ok(Json(json!({ "policy": format!("{namespace}/{name}"), "audit": query.enabled })).into_response())
}

/// Audit mode for every policy on this node (the whole policy module).
async fn set_module_audit(State(state): State<ApiState>, Query(query): Query<AuditQuery>) -> ApiResult<Response> {
    with_controller(&state, move |c| c.set_policy_audit(None, query.enabled)).await?;
    Ok(Json(json!({ "audit": query.enabled })).into_response())
}

#[derive(Deserialize)]
struct VerdictsQuery {
    /// `namespace/name` of a pod on this node.
    pod: Option<String>,
    verdict: Option<crate::nft::policy::PolicyVerdict>,
    limit: Option<usize>,
    /// Only events logged at or after this time (ms since the epoch): what a follower polls.
    since_unix_ms: Option<u64>,
}

/// The packets policy dropped here, or in audit mode would have, newest first: the pod (by
/// name, from the model now), the direction, the addresses, protocol and port, and the
/// policies selecting the pod in that direction.
async fn policy_verdicts(State(state): State<ApiState>, Query(query): Query<VerdictsQuery>) -> ApiResult<Response> {
    let Some(log) = state.policy_verdicts.clone() else {
        return Err(ApiError(StatusCode::NOT_FOUND, "policy verdicts are not read on this host: it writes no kernel (--dataplane nftables), logs none (--policy-log-group 0) or could not bind the group (see its log)".into()));
    };
    let verdict = query.verdict;
    let limit = query.limit.unwrap_or(100).min(crate::policy_log::CAPACITY);
    let body = with_controller(&state, move |c| {
        let pod_of = local_pods_by_address(c);
        let wanted_addresses = addresses_of_pod(&pod_of, query.pod.as_deref())?;
        let since = query.since_unix_ms.unwrap_or(0);
        // Policy events only: the service side's are in `GET /v1/drops`.
        let events = log.recent(limit, |e| {
            e.at_unix_ms >= since
                && e.policy().is_some_and(|(v, _, pod)| verdict.is_none_or(|wanted| v == wanted) && wanted_addresses.as_ref().is_none_or(|a| a.contains(&pod)))
        });
        let events: Vec<Value> = events.iter().map(|event| event_json(c, &pod_of, None, event)).collect();
        Ok(json!({ "totals": log.totals(), "events": events }))
    })
    .await?;
    Ok(Json(body).into_response())
}

/// This node's pods by address (`namespace/name`), from the model now.
fn local_pods_by_address(c: &Controller) -> BTreeMap<IpAddr, String> {
    c.model()
        .local_pods
        .iter()
        .flat_map(|(key, pod)| pod.ips.iter().filter_map(|ip| ip.parse().ok()).map(move |ip: IpAddr| (ip, key.to_string())))
        .collect()
}

/// The addresses of `pod` (`namespace/name`) on this node, or `None` when no pod is asked
/// for; a pod that is not here is not found.
fn addresses_of_pod(pod_of: &BTreeMap<IpAddr, String>, pod: Option<&str>) -> Result<Option<Vec<IpAddr>>, HostError> {
    let Some(pod) = pod else { return Ok(None) };
    let addresses: Vec<IpAddr> = pod_of.iter().filter(|(_, key)| *key == pod).map(|(ip, _)| *ip).collect();
    if addresses.is_empty() {
        return Err(HostError::NotFound(format!("no pod {pod} on this node")));
    }
    Ok(Some(addresses))
}

/// A logged event with what is looked up when it is read: a policy event's pod (by name)
/// and the policies selecting it in that direction; a service event's source pod and, given
/// `frontends`, its service and port name (`null` when no service has the address now).
fn event_json(c: &Controller, pod_of: &BTreeMap<IpAddr, String>, frontends: Option<&ServiceFrontends>, event: &DropEvent) -> Value {
    let mut v = serde_json::to_value(event).unwrap_or(Value::Null);
    let name_of = |addr: &IpAddr| pod_of.get(addr).map_or(Value::Null, |k| Value::String(k.clone()));
    match event.policy() {
        Some((_, direction, pod_address)) => {
            let policies: Vec<String> = c.policies_selecting(direction, pod_address).iter().map(ToString::to_string).collect();
            v["pod"] = name_of(&pod_address);
            v["policies"] = json!(policies);
        }
        None => {
            v["pod"] = name_of(&event.source);
            if let Some(frontends) = frontends {
                let service = frontends.resolve(event);
                v["service"] = json!(service.map(|(key, _)| key.to_string()));
                v["port_name"] = json!(service.and_then(|(_, port)| port));
            }
        }
    }
    v
}

/// The services of this node's model by what their drops are logged with: a frontend
/// (cluster, external or load balancer address, protocol, port), a node port, an address
/// alone. Only for the events a read names: it takes one pass over the services, and none
/// when no service drop is among them.
struct ServiceFrontends<'a> {
    ports: HashMap<(IpAddr, Protocol, u16), (&'a ObjectKey, &'a str)>,
    node_ports: HashMap<(Protocol, u16), (&'a ObjectKey, &'a str)>,
    addresses: HashMap<IpAddr, &'a ObjectKey>,
}

impl<'a> ServiceFrontends<'a> {
    /// What [`ServiceFrontends::resolve`] needs to answer for `events`: the services with
    /// their destinations, and those with the node ports of their no-endpoint drops. Each
    /// address and node port answers with the first service (by name) that has it.
    fn of<'e>(services: &'a BTreeMap<ObjectKey, Arc<ServiceView>>, events: impl IntoIterator<Item = &'e DropEvent>) -> ServiceFrontends<'a> {
        let mut frontends = ServiceFrontends { ports: HashMap::new(), node_ports: HashMap::new(), addresses: HashMap::new() };
        let mut destinations = HashSet::new();
        let mut wanted_node_ports = HashSet::new();
        for event in events {
            let Some(reason) = event.service_reason() else { continue };
            destinations.insert(event.destination);
            if let (true, Some(port)) = (Self::may_be_node_port(reason), event_port(event)) {
                wanted_node_ports.insert(port);
            }
        }
        if destinations.is_empty() {
            return frontends;
        }
        for (key, view) in services {
            let service = &view.service;
            let addresses: Vec<IpAddr> = service
                .cluster_ips
                .iter()
                .chain(&service.external_ips)
                .chain(&service.load_balancer_ips)
                .filter_map(|ip| ip.parse().ok())
                .filter(|ip| destinations.contains(ip))
                .collect();
            for port in &service.ports {
                for address in &addresses {
                    frontends.ports.entry((*address, port.protocol, port.port)).or_insert((key, &port.name));
                }
                if port.node_port != 0 && wanted_node_ports.contains(&(port.protocol, port.node_port)) {
                    frontends.node_ports.entry((port.protocol, port.node_port)).or_insert((key, &port.name));
                }
            }
            for address in addresses {
                frontends.addresses.entry(address).or_insert(key);
            }
        }
        frontends
    }

    /// A drop of no endpoints may have come through a node port (the destination is then the
    /// node's address, no service's).
    fn may_be_node_port(reason: ServiceDropReason) -> bool {
        matches!(reason, ServiceDropReason::NoEndpoints | ServiceDropReason::NoLocalEndpoints)
    }

    /// The service a service drop was for, and the name of its port: by destination address
    /// and port; else by address alone (a port none of its services has, no port name); else,
    /// for a drop of no endpoints, by node port (the destination is the node's address).
    fn resolve(&self, event: &DropEvent) -> Option<(&'a ObjectKey, Option<&'a str>)> {
        let reason = event.service_reason()?;
        let port = event_port(event);
        if let Some(&(key, name)) = port.and_then(|(protocol, port)| self.ports.get(&(event.destination, protocol, port))) {
            return Some((key, Some(name)));
        }
        if let Some(&key) = self.addresses.get(&event.destination) {
            return Some((key, None));
        }
        port.filter(|_| Self::may_be_node_port(reason)).and_then(|port| self.node_ports.get(&port)).map(|&(key, name)| (key, Some(name)))
    }
}

/// A logged packet's protocol and destination port, when it is one services have.
fn event_port(event: &DropEvent) -> Option<(Protocol, u16)> {
    Protocol::parse(&event.protocol.to_ascii_uppercase()).zip(event.destination_port)
}

#[derive(Deserialize)]
struct DropsQuery {
    /// `namespace/name` of a service of this node's model: the service drops of its
    /// addresses and ports.
    service: Option<String>,
    /// `namespace/name` of a pod on this node: its policy verdicts and the service drops of
    /// what it sent.
    pod: Option<String>,
    reason: Option<DropReason>,
    limit: Option<usize>,
    /// Only events logged at or after this time (ms since the epoch): what a follower polls.
    since_unix_ms: Option<u64>,
}

/// Every logged drop, newest first (`wasmplane drops`): the policy verdicts as
/// `GET /v1/policies/verdicts` has them, and the service side's drops and rejects with their
/// reason, named by service and port from the model now. Each has its `kind` (`policy`,
/// `service`) and `reason` (`deny`, `audit`, or the service's).
async fn drops(State(state): State<ApiState>, Query(query): Query<DropsQuery>) -> ApiResult<Response> {
    let Some(log) = state.policy_verdicts.clone() else {
        return Err(ApiError(StatusCode::NOT_FOUND, "drops are not read on this host: it writes no kernel (--dataplane nftables), logs none (--policy-log-group 0) or could not bind the group (see its log)".into()));
    };
    let limit = query.limit.unwrap_or(100).min(crate::policy_log::CAPACITY);
    let body = with_controller(&state, move |c| {
        let pod_of = local_pods_by_address(c);
        let pod_addresses = addresses_of_pod(&pod_of, query.pod.as_deref())?;
        let services = &c.model().services;
        let service = match &query.service {
            None => None,
            Some(text) => Some(
                text.split_once('/')
                    .map(|(namespace, name)| ObjectKey::new(namespace, name))
                    .filter(|key| services.contains_key(key))
                    .ok_or_else(|| HostError::NotFound(format!("no service {text} in this node's model")))?,
            ),
        };
        let since = query.since_unix_ms.unwrap_or(0);
        let keep = |e: &DropEvent| {
            e.at_unix_ms >= since
                && query.reason.is_none_or(|reason| e.cause.reason() == reason)
                && pod_addresses.as_ref().is_none_or(|a| a.contains(&pod_side(e)))
        };
        // By service, which service an event is for decides: every candidate is resolved.
        let (events, frontends) = match &service {
            None => {
                let events = log.recent(limit, keep);
                let frontends = ServiceFrontends::of(services, &events);
                (events, frontends)
            }
            Some(wanted) => {
                let candidates = log.recent(crate::policy_log::CAPACITY, |e| e.service_reason().is_some() && keep(e));
                let frontends = ServiceFrontends::of(services, &candidates);
                let events = candidates.into_iter().filter(|e| frontends.resolve(e).is_some_and(|(key, _)| key == wanted)).take(limit).collect();
                (events, frontends)
            }
        };
        let events: Vec<Value> = events.iter().map(|event| drop_json(c, &pod_of, &frontends, event)).collect();
        Ok(json!({ "totals": { "policy_verdicts": log.totals(), "service_drops": log.service_totals() }, "events": events }))
    })
    .await?;
    Ok(Json(body).into_response())
}

/// The pod address a logged drop is filed under: a policy event's pod, a service event's
/// sender.
fn pod_side(event: &DropEvent) -> IpAddr {
    event.policy().map_or(event.source, |(_, _, pod)| pod)
}

/// A logged drop as `GET /v1/drops` shows it: [`event_json`] with its `kind` and `reason`.
fn drop_json(c: &Controller, pod_of: &BTreeMap<IpAddr, String>, frontends: &ServiceFrontends, event: &DropEvent) -> Value {
    let mut v = event_json(c, pod_of, Some(frontends), event);
    v["kind"] = json!(event.cause.kind());
    v["reason"] = json!(event.cause.reason());
    v
}

/// A policy's realization status over every node, as the operator aggregates it.
async fn policy_status(State(state): State<ApiState>, Path((namespace, name)): Path<(String, String)>) -> ApiResult<Response> {
    let Some(operator) = &state.operator else {
        return Err(ApiError(StatusCode::NOT_FOUND, "policy status is aggregated by the operator role (--role operator)".into()));
    };
    match operator.policy_status(&namespace, &name) {
        Some(summary) => Ok(Json(summary).into_response()),
        None => Err(ApiError(StatusCode::NOT_FOUND, format!("no status reported for policy {namespace}/{name}"))),
    }
}

/// This node's registration and what the agent knows of the others.
async fn cluster_nodes(State(state): State<ApiState>) -> ApiResult<Response> {
    let Some(agent) = &state.agent else {
        return Err(ApiError(StatusCode::NOT_FOUND, "this host does not register in the kvstore".into()));
    };
    let routes = agent.routes.as_ref().map(|r| {
        let report = r.report();
        json!({
            "applied": report.applied.iter().map(|(cidr, via)| json!({ "cidr": cidr.to_string(), "via": via.to_string() })).collect::<Vec<_>>(),
            "errors": report.errors,
            "reconciles": report.reconciles,
        })
    });
    Ok(Json(json!({
        "node": agent.registry.name(),
        "node_id": agent.registry.node_id(),
        "nodes": agent.registry.nodes(),
        "routes": routes,
        // Other clusters' nodes, followed for their routes.
        "remote_nodes": agent.routes.as_ref().map(|r| r.remote_nodes().get()),
        "heartbeat_age_seconds": agent.heartbeat.as_ref().and_then(|h| h.age()).map(|a| a.as_secs()),
    }))
    .into_response())
}

/// What other clusters export that this one imports (global services).
async fn cluster_services(State(state): State<ApiState>) -> ApiResult<Response> {
    let Some(imports) = state.agent.as_ref().and_then(|a| a.imports()) else {
        return Err(ApiError(StatusCode::NOT_FOUND, "this host imports no other cluster's services (--cluster-name)".into()));
    };
    Ok(Json(imports).into_response())
}

pub(crate) async fn metrics(State(state): State<ApiState>) -> impl IntoResponse {
    // Audit-mode gauges are cheap: fresh at every scrape (the packet counts are read by
    // the periodic task, or by `GET /v1/policies?counters=true`).
    let _ = with_controller(&state, |c| c.refresh_policy_metrics(false)).await;
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.encode())
}

async fn list_modules(State(state): State<ApiState>) -> ApiResult<Response> {
    let modules = with_controller(&state, |c| Ok(c.modules())).await?;
    Ok(Json(json!({ "modules": modules })).into_response())
}

async fn get_module(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    let module = with_controller(&state, move |c| c.module(&name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))).await?;
    Ok(Json(module).into_response())
}

#[derive(Deserialize)]
struct UploadQuery {
    kind: Option<String>,
    activate: Option<bool>,
    /// Run the new version in shadow instead of activating it.
    shadow: Option<bool>,
}

async fn upload_module(State(state): State<ApiState>, Path(name): Path<String>, Query(q): Query<UploadQuery>, headers: HeaderMap, body: Bytes) -> ApiResult<Response> {
    let kind_text = q.kind.or_else(|| headers.get("x-wasmplane-kind").and_then(|v| v.to_str().ok()).map(str::to_string));
    let Some(kind_text) = kind_text else {
        return Err(ApiError(StatusCode::BAD_REQUEST, "say which kind of guest this is: ?kind=service-translator|network-policy|gc".into()));
    };
    let Some(kind) = GuestKind::parse(&kind_text) else {
        return Err(ApiError(StatusCode::BAD_REQUEST, format!("unknown kind {kind_text:?}; known: service-translator, network-policy, gc")));
    };
    if body.is_empty() {
        return Err(ApiError(StatusCode::BAD_REQUEST, "empty body: send the component bytes".into()));
    }
    let shadow = q.shadow.unwrap_or(false);
    let activate = q.activate.unwrap_or(!shadow);
    if shadow && activate {
        return Err(ApiError(StatusCode::BAD_REQUEST, "a version is either activated or run in shadow, not both".into()));
    }
    let signature = headers.get("x-wasmplane-signature").and_then(|v| v.to_str().ok()).map(str::to_string);
    let result = state.modules.upload(&name, kind, body, activate, signature.as_deref()).await;
    let label = if result.is_ok() { "accepted" } else { "refused" };
    state.metrics.module_uploads.get_or_create(&crate::metrics::ResultLabels { result: label.into() }).inc();
    let outcome = result?;
    if shadow {
        state.modules.start_shadow(&name, Some(outcome.version)).await?;
        return Ok((StatusCode::CREATED, Json(json!({ "name": outcome.name, "version": outcome.version, "digest": outcome.digest, "kind": outcome.kind, "active": false, "shadow": true }))).into_response());
    }
    Ok((StatusCode::CREATED, Json(outcome)).into_response())
}

#[derive(Deserialize)]
struct ActivateQuery {
    version: Option<u32>,
}

async fn activate_module(State(state): State<ApiState>, Path(name): Path<String>, Query(q): Query<ActivateQuery>) -> ApiResult<Response> {
    let version = state.modules.activate(&name, q.version).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

/// The module's settings document (`{}` when none).
async fn module_settings(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    let record = with_controller(&state, move |c| c.module(&name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))).await?;
    Ok(Json(record.settings.unwrap_or_else(|| json!({}))).into_response())
}

/// Any JSON document; the module's guests read it through the `settings` capability.
async fn set_module_settings(State(state): State<ApiState>, Path(name): Path<String>, body: axum::body::Bytes) -> ApiResult<Response> {
    let settings: Value = serde_json::from_slice(&body).map_err(|e| HostError::BadRequest(format!("settings must be a JSON document: {e}")))?;
    state.modules.set_settings(&name, Some(settings.clone())).await?;
    Ok(Json(json!({ "name": name, "settings": settings })).into_response())
}

async fn clear_module_settings(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    state.modules.set_settings(&name, None).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn rollback_module(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    let version = state.modules.rollback(&name).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

async fn start_shadow(State(state): State<ApiState>, Path(name): Path<String>, Query(q): Query<ActivateQuery>) -> ApiResult<Response> {
    let version = state.modules.start_shadow(&name, q.version).await?;
    Ok(Json(json!({ "name": name, "shadow_version": version })).into_response())
}

async fn stop_shadow(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    state.modules.stop_shadow(&name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn shadow_diff(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    let diff = with_controller(&state, move |c| c.shadow_diff(&name)).await?;
    Ok(Json(diff).into_response())
}

async fn promote_shadow(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    let version = state.modules.promote(&name).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

async fn delete_module(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    state.modules.delete(&name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn node_state(State(state): State<ApiState>) -> ApiResult<Response> {
    let body = with_controller(&state, |c| {
        Ok(json!({
            "revision": c.model().revision,
            "model": c.model(),
            "service_errors": c.service_errors().iter().map(|(k, v)| (k.to_string(), v.clone())).collect::<std::collections::BTreeMap<_, _>>(),
        }))
    })
    .await?;
    Ok(Json(body).into_response())
}

#[derive(Deserialize)]
struct DataplaneQuery {
    format: Option<String>,
}

async fn dataplane(State(state): State<ApiState>, Query(q): Query<DataplaneQuery>) -> ApiResult<Response> {
    let json_format = q.format.as_deref() == Some("json");
    with_controller(&state, move |c| {
        let dp = c.dataplane();
        Ok(if json_format {
            let objects: std::collections::BTreeMap<String, _> = dp.applied().iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
            Json(json!({
                "mode": dp.mode(),
                "revision": c.model().revision,
                "translator": c.active_translator().map(|(n, v)| format!("{n}@{v}")),
                "objects": objects,
            }))
            .into_response()
        } else {
            ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], dp.render()).into_response()
        })
    })
    .await
}

/// Unix seconds and age in seconds of `t` (`None`: never).
fn unix_and_age(t: Option<std::time::SystemTime>) -> (Option<u64>, Option<u64>) {
    let Some(t) = t else { return (None, None) };
    let unix = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).ok();
    (unix, Some(t.elapsed().map_or(0, |d| d.as_secs())))
}

/// This node's summary (`wasmplane status`): counts and last outcomes only, never the model
/// or the dataplane themselves, so that it stays cheap at any number of services.
async fn status(State(state): State<ApiState>) -> ApiResult<Response> {
    let early_reason = unready_reason(&state);
    let metrics = state.metrics.clone();
    let mut summary = with_controller(&state, move |c| {
        let model = c.model();
        let dp = c.dataplane();
        let not_ready_reason = early_reason.or_else(|| model.local_detection_pending().map(str::to_string));
        let mut in_force = std::collections::BTreeMap::new();
        let mut failed_modules = Vec::new();
        for module in c.modules() {
            match (module.status, module.active_version) {
                (ModuleStatus::Active, Some(version)) => {
                    in_force.insert(module.kind.to_string(), format!("{}@{version}", module.name));
                }
                (ModuleStatus::Failed, _) => failed_modules.push(json!({ "name": module.name, "kind": module.kind, "error": module.last_error })),
                _ => {}
            }
        }
        let syncs = |result: &str| metrics.syncs.get(&ResultLabels { result: result.into() }).map_or(0, |c| c.get());
        let (last_sync, last_sync_age) = unix_and_age(dp.health.last_written());
        let (failing_since, failing_for) = unix_and_age(dp.health.failing_since());
        let last_error = dp.health.last_error().map(|(at, message)| {
            let (at, age) = unix_and_age(Some(at));
            json!({ "at_unix_seconds": at, "age_seconds": age, "message": message })
        });
        Ok(json!({
            "ready": not_ready_reason.is_none(),
            "not_ready_reason": not_ready_reason,
            "node": model.node_name(),
            "model": {
                "revision": model.revision,
                "services": model.services.len(),
                "local_pods": model.local_pods.len(),
                "policies": model.policies.len(),
                "events_total": metrics.events.get(),
                "revisions_total": metrics.revisions.get(),
            },
            "dataplane": {
                "mode": dp.mode(),
                "objects": dp.applied().len(),
                // The previous run's rules are kept until this one has state to write.
                "held": dp.is_held(),
                "last_sync_unix_seconds": last_sync,
                "last_sync_age_seconds": last_sync_age,
                // Set while the kernel refuses writes (the last write failed).
                "sync_failing_since_unix_seconds": failing_since,
                "sync_failing_for_seconds": failing_for,
                // Every transaction, full and incremental.
                "syncs_ok": syncs("ok"),
                "syncs_failed": syncs("error"),
                // Kept after writes succeed again.
                "last_write_error": last_error,
            },
            "modules": in_force,
            "failed_modules": failed_modules,
            "service_errors": c.service_errors().len(),
        }))
    })
    .await?;
    // The operator role replaces the agent's in this host (see `app.rs`).
    summary["policy_verdicts"] = json!(state.policy_verdicts.as_ref().map(|log| log.totals()));
    summary["service_drops"] = json!(state.policy_verdicts.as_ref().map(|log| log.service_totals()));
    // Configured but not serving yet: waiting for this node's pod CIDRs (or it failed to start).
    summary["cni"] = match &state.cni {
        None => Value::Null,
        Some(serving) => match serving.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(daemon) => {
                let mut summary = json!(daemon.summary());
                summary["serving"] = json!(true);
                summary
            }
            None => json!({ "serving": false }),
        },
    };
    summary["role"] = json!(if state.operator.is_some() { "operator" } else { "agent" });
    summary["leader"] = json!(state.operator.as_ref().map(|o| o.is_leader()));
    summary["kvstore"] = json!({
        "backend": state.modules.store().kv().backend(),
        // Registered as a node (the agent role).
        "node_id": state.agent.as_ref().map(|a| a.registry.node_id()),
        "heartbeat_age_seconds": state.agent.as_ref().and_then(|a| a.heartbeat.as_ref()).and_then(|h| h.age()).map(|a| a.as_secs()),
    });
    Ok(Json(summary).into_response())
}

#[derive(Deserialize)]
struct ServicesQuery {
    namespace: Option<String>,
}

#[derive(Serialize)]
struct ServiceList<'a> {
    services: Vec<ServiceRow<'a>>,
}

/// One service as `GET /v1/services` lists it.
#[derive(Serialize)]
struct ServiceRow<'a> {
    service: String,
    #[serde(rename = "type")]
    service_type: ServiceType,
    cluster_ips: &'a [CompactString],
    ports: Vec<PortRow<'a>>,
    endpoints: EndpointCounts,
    /// The last translation error (its last good rules stay applied).
    error: Option<&'a str>,
}

#[derive(Serialize)]
struct PortRow<'a> {
    name: &'a str,
    port: u16,
    protocol: Protocol,
    node_port: Option<u16>,
}

/// Endpoints of a service as this node's model has them (one per endpoint of each slice).
#[derive(Serialize, Default)]
struct EndpointCounts {
    total: usize,
    ready: usize,
    /// On this node.
    local: usize,
    local_ready: usize,
}

fn service_row<'a>(key: &ObjectKey, view: &'a ServiceView, error: Option<&'a str>) -> ServiceRow<'a> {
    let mut endpoints = EndpointCounts::default();
    for endpoint in view.slices.iter().flat_map(|slice| &slice.endpoints) {
        endpoints.total += 1;
        endpoints.ready += usize::from(endpoint.ready);
        endpoints.local += usize::from(endpoint.is_local);
        endpoints.local_ready += usize::from(endpoint.is_local && endpoint.ready);
    }
    let service = &view.service;
    ServiceRow {
        service: key.to_string(),
        service_type: service.service_type,
        cluster_ips: &service.cluster_ips,
        ports: service.ports.iter().map(|p| PortRow { name: &p.name, port: p.port, protocol: p.protocol, node_port: (p.node_port != 0).then_some(p.node_port) }).collect(),
        endpoints,
        error,
    }
}

/// The services of this node's model, one row each (`?namespace=NS`: those of one namespace).
async fn list_services(State(state): State<ApiState>, Query(query): Query<ServicesQuery>) -> ApiResult<Response> {
    // Shared views taken under the lock, rows built after it.
    let services = with_controller(&state, move |c| {
        let errors = c.service_errors();
        let services = &c.model().services;
        let selected: Box<dyn Iterator<Item = (&ObjectKey, &Arc<ServiceView>)>> = match &query.namespace {
            // Keys sort by namespace first: one namespace is one range.
            Some(namespace) => Box::new(services.range(ObjectKey::new(namespace, "")..).take_while(|(key, _)| key.namespace == namespace.as_str())),
            None => Box::new(services.iter()),
        };
        Ok(selected.map(|(key, view)| (key.clone(), view.clone(), errors.get(key).cloned())).collect::<Vec<_>>())
    })
    .await?;
    let rows = services.iter().map(|(key, view, error)| service_row(key, view, error.as_deref())).collect();
    Ok(Json(ServiceList { services: rows }).into_response())
}

/// One service: the model's view of it, the rules applied for it (and the host's firewall
/// of its load balancer addresses), its translation error.
async fn service_detail(State(state): State<ApiState>, Path((namespace, name)): Path<(String, String)>) -> ApiResult<Response> {
    let key = ObjectKey::new(&namespace, &name);
    let body = with_controller(&state, move |c| {
        let view = c.model().services.get(&key).ok_or_else(|| HostError::NotFound(format!("no service {key} in this node's model")))?;
        let applied = c.dataplane().applied();
        Ok(json!({
            "service": key.to_string(),
            "revision": c.model().revision,
            "translator": c.active_translator().map(|(n, v)| format!("{n}@{v}")),
            "model": view,
            "rules": applied.get(&key),
            "firewall": applied.get(&crate::nft::firewall_object_key(&key)),
            "error": c.service_errors().get(&key),
        }))
    })
    .await?;
    Ok(Json(body).into_response())
}

#[derive(Deserialize)]
struct PodsQuery {
    namespace: Option<String>,
}

/// How many of a pod's latest drops `GET /v1/pods/{ns}/{name}` shows.
const POD_RECENT_DROPS: usize = 10;

#[derive(Serialize)]
struct PodList {
    pods: Vec<PodRow>,
}

/// One pod of this node as `GET /v1/pods` lists it (`cilium endpoint list`).
#[derive(Serialize)]
struct PodRow {
    namespace: CompactString,
    name: CompactString,
    ips: Vec<CompactString>,
    host_network: bool,
    /// Some policy selects it in that direction: its dispatch chain decides what passes.
    ingress_enforced: bool,
    egress_enforced: bool,
    /// Some policy selecting it is in audit mode.
    audit: bool,
    policies: Vec<SelectingPolicy>,
    /// What the CNI daemon handed out for it; `null` when this host hands out no addresses
    /// (no `--cni-socket`, not serving yet, or chained after another plugin).
    cni_allocations: Option<Vec<CniAllocation>>,
}

/// A policy selecting a pod of this node, as its last good rules do (what the pod's
/// dispatch chains run).
#[derive(Serialize)]
struct SelectingPolicy {
    name: String,
    /// The directions it selects the pod in.
    policy_types: BTreeSet<Direction>,
    /// Its would-be drops are logged and counted, not dropped.
    audit: bool,
    /// Why its newest generation was refused (the last good rules stay enforced).
    error: Option<String>,
}

/// One pod of this node (`cilium endpoint get`): its row, node, labels and latest drops.
#[derive(Serialize)]
struct PodDetail {
    #[serde(flatten)]
    row: PodRow,
    node: Option<CompactString>,
    labels: Labels,
    /// Its latest drops, newest first, as `GET /v1/drops?pod=` has them; `null` when this
    /// host reads no drops.
    recent_drops: Option<Vec<Value>>,
}

/// One attachment the CNI daemon made for a pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
struct CniAllocation {
    container_id: String,
    interface: String,
    addresses: Vec<CniAddress>,
    allocated_at_unix_seconds: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
struct CniAddress {
    ip: IpAddr,
    /// The daemon's pod CIDR it is from; `null` when none of them holds it now (it was
    /// handed out before they changed).
    pod_cidr: Option<String>,
}

/// The CNI daemon's allocations by pod; `None` when this host hands out no addresses.
fn cni_allocations(state: &ApiState) -> Option<BTreeMap<ObjectKey, Vec<CniAllocation>>> {
    let daemon = state.cni.as_ref()?.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
    let ipam = daemon.ipam()?;
    Some(allocations_by_pod(ipam.all(), ipam.pools()))
}

fn allocations_by_pod(allocations: Vec<wasmplane_cni::Allocation>, pools: &[wasmplane_cni::Pool]) -> BTreeMap<ObjectKey, Vec<CniAllocation>> {
    let mut by_pod: BTreeMap<ObjectKey, Vec<CniAllocation>> = BTreeMap::new();
    for allocation in allocations {
        // State from before allocations named their pod cannot be told apart: left out.
        let (Some(namespace), Some(name)) = (&allocation.pod_namespace, &allocation.pod_name) else { continue };
        let addresses = allocation.ips.iter().map(|ip| CniAddress { ip: *ip, pod_cidr: pools.iter().find(|pool| pool.cidr.contains(ip)).map(|pool| pool.cidr.to_string()) }).collect();
        by_pod.entry(ObjectKey::new(namespace, name)).or_default().push(CniAllocation {
            container_id: allocation.container_id,
            interface: allocation.if_name,
            addresses,
            allocated_at_unix_seconds: allocation.allocated_at,
        });
    }
    by_pod
}

/// The policies as `GET /v1/policies` reports them, by key (for their audit mode and error).
fn policy_statuses(c: &Controller) -> BTreeMap<ObjectKey, crate::policy::PolicyStatus> {
    c.policies().into_iter().map(|p| (ObjectKey::new(&p.namespace, &p.name), p)).collect()
}

/// `pod`'s row. The policies are those of the dispatch chains of its addresses, so that
/// "enforced" means the kernel decides, not that some policy's selector matches.
fn pod_row(c: &Controller, statuses: &BTreeMap<ObjectKey, crate::policy::PolicyStatus>, cni: Option<&BTreeMap<ObjectKey, Vec<CniAllocation>>>, pod: &Pod) -> PodRow {
    let mut selecting: BTreeMap<ObjectKey, BTreeSet<Direction>> = BTreeMap::new();
    // A host-network pod's addresses are the node's, which no policy selects.
    if !pod.host_network {
        for ip in pod.ips.iter().filter_map(|ip| ip.parse::<IpAddr>().ok()) {
            for direction in [Direction::Ingress, Direction::Egress] {
                for key in c.policies_selecting(direction, ip) {
                    selecting.entry(key).or_default().insert(direction);
                }
            }
        }
    }
    let policies: Vec<SelectingPolicy> = selecting
        .into_iter()
        .map(|(key, policy_types)| {
            let status = statuses.get(&key);
            SelectingPolicy { name: key.to_string(), policy_types, audit: status.is_some_and(|s| s.audit), error: status.and_then(|s| s.error.clone()) }
        })
        .collect();
    let enforced = |direction: Direction| policies.iter().any(|p| p.policy_types.contains(&direction));
    PodRow {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        ips: pod.ips.clone(),
        host_network: pod.host_network,
        ingress_enforced: enforced(Direction::Ingress),
        egress_enforced: enforced(Direction::Egress),
        audit: policies.iter().any(|p| p.audit),
        policies,
        cni_allocations: cni.map(|by_pod| by_pod.get(&pod.key()).cloned().unwrap_or_default()),
    }
}

/// The pods on this node (`?namespace=NS`: of one namespace), by namespace and name, with
/// the policies their dispatch chains run.
async fn list_pods(State(state): State<ApiState>, Query(query): Query<PodsQuery>) -> ApiResult<Response> {
    let cni = cni_allocations(&state);
    let pods = with_controller(&state, move |c| {
        let statuses = policy_statuses(c);
        let local_pods = &c.model().local_pods;
        let selected: Box<dyn Iterator<Item = (&ObjectKey, &Arc<Pod>)>> = match &query.namespace {
            // Keys sort by namespace first: one namespace is one range.
            Some(namespace) => Box::new(local_pods.range(ObjectKey::new(namespace, "")..).take_while(|(key, _)| key.namespace == namespace.as_str())),
            None => Box::new(local_pods.iter()),
        };
        Ok(selected.map(|(_, pod)| pod_row(c, &statuses, cni.as_ref(), pod)).collect())
    })
    .await?;
    Ok(Json(PodList { pods }).into_response())
}

/// One pod on this node: its row, labels and latest drops; any other pod is not found.
async fn pod_detail(State(state): State<ApiState>, Path((namespace, name)): Path<(String, String)>) -> ApiResult<Response> {
    let key = ObjectKey::new(&namespace, &name);
    let cni = cni_allocations(&state);
    let log = state.policy_verdicts.clone();
    let detail = with_controller(&state, move |c| {
        let pod = c.model().local_pods.get(&key).ok_or_else(|| not_this_nodes_pod(c, &key))?;
        let recent_drops = log.map(|log| {
            let addresses: Vec<IpAddr> = pod.ips.iter().filter_map(|ip| ip.parse().ok()).collect();
            let pod_of = local_pods_by_address(c);
            let drops = drops_of_pod(&log, &addresses, POD_RECENT_DROPS);
            let frontends = ServiceFrontends::of(&c.model().services, &drops);
            drops.iter().map(|event| drop_json(c, &pod_of, &frontends, event)).collect()
        });
        Ok(PodDetail { row: pod_row(c, &policy_statuses(c), cni.as_ref(), pod), node: pod.node_name.clone(), labels: pod.labels.clone(), recent_drops })
    })
    .await?;
    Ok(Json(detail).into_response())
}

/// The newest `limit` drops filed under one of `addresses` (see [`pod_side`]), as
/// `GET /v1/drops?pod=` picks them. A host-network pod's addresses are the node's: its drops
/// are those of the node's addresses.
fn drops_of_pod(log: &crate::policy_log::PolicyVerdictLog, addresses: &[IpAddr], limit: usize) -> Vec<DropEvent> {
    log.recent(limit, |event| addresses.contains(&pod_side(event)))
}

/// Why `key` has no pod detail here: another node's pod, one not scheduled yet, or none.
fn not_this_nodes_pod(c: &Controller, key: &ObjectKey) -> HostError {
    let why = match c.cluster().pods.get(key).map(|pod| pod.node_name.as_deref()) {
        Some(Some(node)) => format!("it is on node {node}"),
        Some(None) => "it is not scheduled yet".to_string(),
        None => "no such pod is known".to_string(),
    };
    HostError::NotFound(format!("pod {key} is not one of this node's pods ({why})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::policy::PolicyVerdict;
    use crate::nft::service_drops::ServiceDropReason;
    use crate::policy_log::{DropCause, PolicyVerdictLog};

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn logged(at_unix_ms: u64, cause: DropCause, source: &str, destination: &str) -> DropEvent {
        DropEvent { at_unix_ms, cause, source: ip(source), destination: ip(destination), protocol: "tcp".into(), source_port: Some(40000), destination_port: Some(80) }
    }

    /// A pod's drops: its policy verdicts (either direction) and the service drops of what it
    /// sent; not another pod's verdicts of what it sent, nor service drops of what it was sent.
    #[test]
    fn a_pods_drops_are_those_drops_list_files_under_it() {
        const POD: &str = "10.244.0.41";
        const OTHER: &str = "10.244.0.42";
        let policy = |direction, pod_address: &str| DropCause::Policy { verdict: PolicyVerdict::Deny, direction, pod_address: ip(pod_address) };
        let service = DropCause::Service { reason: ServiceDropReason::NoEndpoints };
        let log = PolicyVerdictLog::new();
        log.record(logged(1, policy(Direction::Ingress, POD), "10.0.0.1", POD));
        log.record(logged(2, policy(Direction::Egress, POD), POD, "192.0.2.1"));
        log.record(logged(3, policy(Direction::Ingress, OTHER), POD, OTHER));
        log.record(logged(4, service, POD, "10.96.0.40"));
        log.record(logged(5, service, OTHER, POD));
        let at = |events: Vec<DropEvent>| events.iter().map(|e| e.at_unix_ms).collect::<Vec<_>>();
        assert_eq!(at(drops_of_pod(&log, &[ip(POD)], 10)), [4, 2, 1], "newest first");
        assert_eq!(at(drops_of_pod(&log, &[ip(POD)], 2)), [4, 2], "the newest only");
        assert_eq!(at(drops_of_pod(&log, &[ip("fd00::41"), ip(OTHER)], 10)), [5, 3], "any of its addresses");
    }

    /// A service drop is named by frontend, else by address, else (no endpoints) by node
    /// port; the first service by name wins a shared address. Only the events' destinations
    /// and node ports are indexed, none without a service drop among them.
    #[test]
    fn service_drops_are_named_from_only_what_their_events_need() {
        use wasmplane_model::{Protocol, Service, ServicePort};
        let service = |name: &str, cluster_ip: &str, ports: Vec<ServicePort>| {
            let key = ObjectKey::new("default", name);
            (key, Arc::new(ServiceView { service: Arc::new(Service::cluster_ip("default", name, cluster_ip, ports)), slices: Vec::new() }))
        };
        let node_port = ServicePort { node_port: 30080, ..ServicePort::tcp("web", 80, 8080) };
        let services: BTreeMap<_, _> = [
            service("b-shared", "10.96.0.10", vec![ServicePort::tcp("http", 80, 8080)]),
            service("a-shared", "10.96.0.10", vec![ServicePort::tcp("dns", 53, 53)]),
            service("web", "10.96.0.20", vec![node_port]),
            service("idle", "10.96.0.30", vec![ServicePort::tcp("x", 1, 1)]),
        ]
        .into_iter()
        .collect();
        let drop = |reason, destination: &str, port: u16| DropEvent {
            destination_port: Some(port),
            ..logged(1, DropCause::Service { reason }, "10.244.0.5", destination)
        };
        let events = [
            drop(ServiceDropReason::NoEndpoints, "10.96.0.10", 80),
            drop(ServiceDropReason::UnknownPort, "10.96.0.10", 81),
            drop(ServiceDropReason::NoEndpoints, "192.0.2.7", 30080),
            drop(ServiceDropReason::Unallocated, "192.0.2.7", 30080),
            drop(ServiceDropReason::NoEndpoints, "10.96.0.99", 80),
        ];
        let frontends = ServiceFrontends::of(&services, &events);
        let named = |event: &DropEvent| frontends.resolve(event).map(|(key, port)| (key.to_string(), port.map(str::to_string)));
        assert_eq!(named(&events[0]), Some(("default/b-shared".into(), Some("http".into()))), "by frontend");
        assert_eq!(named(&events[1]), Some(("default/a-shared".into(), None)), "by address: the first by name");
        assert_eq!(named(&events[2]), Some(("default/web".into(), Some("web".into()))), "by node port");
        assert_eq!(named(&events[3]), None, "only a drop of no endpoints comes through a node port");
        assert_eq!(named(&events[4]), None);
        assert_eq!(frontends.addresses.len(), 1, "only the events' destinations");
        assert!(!frontends.ports.keys().any(|(address, _, _)| *address == ip("10.96.0.30")));

        let policy = logged(1, DropCause::Policy { verdict: PolicyVerdict::Deny, direction: Direction::Ingress, pod_address: ip("10.96.0.10") }, "10.0.0.1", "10.96.0.10");
        let none = ServiceFrontends::of(&services, [&policy]);
        assert!(none.ports.is_empty() && none.addresses.is_empty() && none.node_ports.is_empty(), "no service drop, nothing indexed");
        assert_eq!(none.resolve(&policy), None);
    }

    /// Allocations by pod, each address with the pod CIDR it is from; unnamed ones left out.
    #[test]
    fn cni_allocations_name_their_pod_cidr() {
        let pools = [wasmplane_cni::Pool { cidr: "10.244.0.0/24".parse().unwrap(), gateway: ip("10.244.0.1") }, wasmplane_cni::Pool { cidr: "fd00::/64".parse().unwrap(), gateway: ip("fd00::1") }];
        let allocation = |container: &str, pod: Option<(&str, &str)>, ips: &[&str]| wasmplane_cni::Allocation {
            ips: ips.iter().map(|i| ip(i)).collect(),
            container_id: container.into(),
            if_name: "eth0".into(),
            pod_namespace: pod.map(|p| p.0.into()),
            pod_name: pod.map(|p| p.1.into()),
            allocated_at: Some(7),
        };
        let by_pod = allocations_by_pod(
            vec![allocation("c1", Some(("default", "web-1")), &["10.244.0.41", "fd00::41"]), allocation("c2", None, &["10.244.0.50"]), allocation("c3", Some(("default", "old")), &["10.9.0.5"])],
            &pools,
        );
        assert_eq!(by_pod.len(), 2, "{by_pod:?}");
        let web = &by_pod[&ObjectKey::new("default", "web-1")];
        assert_eq!(
            serde_json::to_value(web).unwrap(),
            json!([{ "container_id": "c1", "interface": "eth0", "allocated_at_unix_seconds": 7,
                     "addresses": [{ "ip": "10.244.0.41", "pod_cidr": "10.244.0.0/24" }, { "ip": "fd00::41", "pod_cidr": "fd00::/64" }] }])
        );
        assert_eq!(by_pod[&ObjectKey::new("default", "old")][0].addresses[0].pod_cidr, None, "outside today's pod CIDRs");
    }
}
