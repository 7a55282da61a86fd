//! The REST API (axum), versioned under `/v1`, plus health, readiness and metrics.
//!
//! Mutating calls need `Authorization: Bearer <token>`; reads are open to loopback peers
//! only, and need the token from anywhere else.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use wasmplane_runtime::{GuestKind, LoadError};

use crate::auth::{AuthError, Identity};
use crate::controller::{Controller, HostError};
use crate::metrics::Metrics;
use crate::module_store::StoreError;
use crate::modules::Modules;
use crate::registry::RegistryError;

mod drops;
mod pods;
mod policies;
mod services;
mod status;

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
    pub policy_verdicts: Option<Arc<crate::policy_log::PolicyVerdictLog>>,
    /// The CNI daemon, where this host serves it (`--cni-socket`); empty until it serves.
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
            HostError::Load(_) | HostError::ActivationFailed { .. } | HostError::SettingsRefused { .. } => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            HostError::Admission(_) => StatusCode::FORBIDDEN,
            HostError::Store(StoreError::Kv(wasmplane_kvstore::KvError::Unavailable(_))) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            HostError::Store(StoreError::Contended(_)) => StatusCode::CONFLICT,
            HostError::Store(StoreError::Refused(RegistryError::NotFound(_))) => StatusCode::NOT_FOUND,
            HostError::Store(StoreError::Refused(RegistryError::Conflict(_))) => StatusCode::CONFLICT,
            HostError::Store(StoreError::Refused(RegistryError::BadRequest(_))) => StatusCode::BAD_REQUEST,
            HostError::Write(_) | HostError::Storage(_) | HostError::Store(_) | HostError::Internal(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        ApiError(status, e.to_string())
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// An axum extractor (`Query`, `Path`) whose rejection is answered as every other error of
/// this API is: `{"error": …}` with the rejection's status, not axum's plain-text body
/// (clients, the CLI included, read the JSON).
struct Api<E>(E);

impl<E, S> axum::extract::FromRequestParts<S> for Api<E>
where
    E: axum::extract::FromRequestParts<S>,
    E::Rejection: Into<ApiError>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        E::from_request_parts(parts, state).await.map(Api).map_err(Into::into)
    }
}

impl From<axum::extract::rejection::QueryRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::QueryRejection) -> ApiError {
        ApiError(rejection.status(), rejection.body_text())
    }
}

impl From<axum::extract::rejection::PathRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::PathRejection) -> ApiError {
        ApiError(rejection.status(), rejection.body_text())
    }
}

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
    let max_body = max_request_body(&state);
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/modules", get(list_modules))
        .route("/v1/modules/{name}", get(get_module).put(upload_module).delete(delete_module))
        .route("/v1/modules/{name}/activate", post(activate_module))
        .route("/v1/modules/{name}/rollback", post(rollback_module))
        .route(
            "/v1/modules/{name}/settings",
            get(module_settings).put(set_module_settings).delete(clear_module_settings),
        )
        .route("/v1/modules/{name}/shadow", post(start_shadow).delete(stop_shadow))
        .route("/v1/modules/{name}/shadow-diff", get(shadow_diff))
        .route("/v1/modules/{name}/promote", post(promote_shadow))
        .route("/v1/state", get(node_state))
        .route("/v1/cluster/nodes", get(cluster_nodes))
        .route("/v1/cluster/services", get(cluster_services))
        .route("/v1/operator", get(operator_state))
        .route("/v1/policies", get(policies::list_policies))
        .route("/v1/policies/audit", post(policies::set_module_audit))
        .route("/v1/policies/log-allowed", post(policies::set_module_log_allowed))
        .route("/v1/policies/verdicts", get(drops::policy_verdicts))
        .route("/v1/drops", get(drops::drops))
        .route("/v1/policies/{namespace}/{name}/audit", post(policies::set_policy_audit))
        .route("/v1/policies/{namespace}/{name}/log-allowed", post(policies::set_policy_log_allowed))
        .route("/v1/policies/{namespace}/{name}/status", get(policies::policy_status))
        .route("/v1/dataplane", get(dataplane))
        .route("/v1/status", get(status::status))
        .route("/v1/services", get(services::list_services))
        .route("/v1/services/{namespace}/{name}", get(services::service_detail))
        .route("/v1/pods", get(pods::list_pods))
        .route("/v1/pods/{namespace}/{name}", get(pods::pod_detail))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), refuse_oversized))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        // Outermost: sees every answer, refused authentication included.
        .layer(middleware::from_fn_with_state(state.clone(), crate::audit::audit_layer))
        .with_state(state)
}

async fn authenticate(
    State(state): State<ApiState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
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
            let drained = drain_refused_body(request, max_request_body(&state)).await;
            let mut response = refusal(status, e.to_string(), drained);
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

/// A body larger than the API takes is refused with the limit in the answer (the body
/// limit's own refusal names none), and read to be dropped as a refused request's is when it
/// is at most [`OVERSIZED_DRAIN_FACTOR`] times the limit. A declared length is judged before
/// any handler runs. A body of unknown length (chunked) is read here, up to the limit, and
/// handed on whole: otherwise the handler's extractor would stop reading at the limit and the
/// connection would close on unread input, which can reset it before the 413 is read. Only a
/// client that passed authentication gets here.
async fn refuse_oversized(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    let limit = max_request_body(&state);
    let too_large = |size: String| {
        format!(
            "a request body of {size} is larger than the upload limit of {} bytes (--max-module-bytes)",
            state.max_module_bytes
        )
    };
    if let Some(declared) = declared_length(request.headers()).filter(|&n| n > limit as u64) {
        // drain_refused_body leaves a body declared over its bound unread itself.
        let drained = drain_refused_body(request, limit.saturating_mul(OVERSIZED_DRAIN_FACTOR as usize)).await;
        return refusal(StatusCode::PAYLOAD_TOO_LARGE, too_large(format!("{declared} bytes")), drained);
    }
    // Declared within the limit (or known otherwise): the handler's body limit holds.
    if http_body::Body::size_hint(request.body()).exact().is_some() {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    match read_bounded(body, limit).await {
        Ok(bytes) => next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await,
        Err(BoundedRead::TooLarge { drained }) => {
            refusal(StatusCode::PAYLOAD_TOO_LARGE, too_large("unknown length".into()), drained)
        }
        // The client went away mid-body: nobody reads more than this.
        Err(BoundedRead::Failed) => {
            refusal(StatusCode::BAD_REQUEST, "the request body could not be read".into(), false)
        }
    }
}

/// The answer to a request refused with its body perhaps not read to the end (`drained`:
/// it was): such a connection is closed, as its unread rest cannot be told from the next
/// request.
fn refusal(status: StatusCode, message: String, drained: bool) -> Response {
    let mut response = ApiError(status, message).into_response();
    if !drained {
        response.headers_mut().insert(header::CONNECTION, "close".parse().expect("static header"));
    }
    response
}

/// Why a body of unknown length was not handed on.
enum BoundedRead {
    /// Longer than the limit; `drained`: the rest was read and dropped (within
    /// [`OVERSIZED_DRAIN_FACTOR`] times the limit and [`REFUSED_BODY_DRAIN_TIME`]).
    TooLarge { drained: bool },
    /// The body stream failed: the client went away mid-body.
    Failed,
}

/// Reads a body of at most `limit` bytes, as the handler's extractor would have (no time
/// bound of its own); a longer one is drained as a refused body is.
async fn read_bounded(body: axum::body::Body, limit: usize) -> Result<Bytes, BoundedRead> {
    let mut body = body.into_data_stream();
    let mut buffer = bytes::BytesMut::new();
    let read = loop {
        match futures::StreamExt::next(&mut body).await {
            None => return Ok(buffer.freeze()),
            Some(Err(_)) => return Err(BoundedRead::Failed),
            Some(Ok(chunk)) if buffer.len() + chunk.len() > limit => break buffer.len() + chunk.len(),
            Some(Ok(chunk)) => buffer.extend_from_slice(&chunk),
        }
    };
    // Not kept while the rest is drained.
    drop(buffer);
    let drained = drain(&mut body, read, limit.saturating_mul(OVERSIZED_DRAIN_FACTOR as usize)).await;
    Err(BoundedRead::TooLarge { drained })
}

/// Reads the rest of a body and drops it, `read` bytes of it already read: whether it ended
/// within `bound` bytes in all and [`REFUSED_BODY_DRAIN_TIME`].
async fn drain(body: &mut axum::body::BodyDataStream, mut read: usize, bound: usize) -> bool {
    let to_the_end = async {
        while let Some(chunk) = futures::StreamExt::next(body).await {
            let Ok(chunk) = chunk else { return false };
            read += chunk.len();
            if read > bound {
                return false;
            }
        }
        true
    };
    tokio::time::timeout(REFUSED_BODY_DRAIN_TIME, to_the_end).await.unwrap_or(false)
}

/// How far past the body limit an oversized body is still read to be dropped.
const OVERSIZED_DRAIN_FACTOR: u64 = 4;

/// The `Content-Length` a request declares, if any.
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
}

/// Longest the host keeps reading the body of a request it refused.
const REFUSED_BODY_DRAIN_TIME: Duration = Duration::from_secs(10);

/// The largest request body the API takes: a module at the upload limit and its framing.
fn max_request_body(state: &ApiState) -> usize {
    state.max_module_bytes + 1024
}

/// Reads and drops the body of a request refused before its handler read it, so the answer
/// reaches a client that is still sending: closing a connection with unread input makes the
/// kernel reset it, and the reset can discard the answer before the client reads it (the
/// "lingering close" of RFC 9112 §9.6). Bounded by the API's body limit and
/// [`REFUSED_BODY_DRAIN_TIME`]; a client that asked `Expect: 100-continue` has sent nothing
/// and is not invited to. Whether the whole body was read (the connection can be kept).
async fn drain_refused_body(request: Request, limit: usize) -> bool {
    let headers = request.headers();
    if headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue")) {
        return false;
    }
    if declared_length(headers).is_some_and(|n| n > limit as u64) {
        return false;
    }
    drain(&mut request.into_body().into_data_stream(), 0, limit).await
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
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "this host imports no other cluster's services (--cluster-name)".into(),
        ));
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

async fn get_module(State(state): State<ApiState>, Api(Path(name)): Api<Path<String>>) -> ApiResult<Response> {
    let module = with_controller(&state, move |c| {
        c.module(&name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))
    })
    .await?;
    Ok(Json(module).into_response())
}

#[derive(Deserialize)]
struct UploadQuery {
    kind: Option<String>,
    activate: Option<bool>,
    /// Run the new version in shadow instead of activating it.
    shadow: Option<bool>,
}

async fn upload_module(
    State(state): State<ApiState>,
    Api(Path(name)): Api<Path<String>>,
    Api(Query(q)): Api<Query<UploadQuery>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let kind_text =
        q.kind.or_else(|| headers.get("x-wasmplane-kind").and_then(|v| v.to_str().ok()).map(str::to_string));
    let Some(kind_text) = kind_text else {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "say which kind of guest this is: ?kind=service-translator|network-policy|gc".into(),
        ));
    };
    let Some(kind) = GuestKind::parse(&kind_text) else {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("unknown kind {kind_text:?}; known: service-translator, network-policy, gc"),
        ));
    };
    if body.is_empty() {
        return Err(ApiError(StatusCode::BAD_REQUEST, "empty body: send the component bytes".into()));
    }
    let shadow = q.shadow.unwrap_or(false);
    let activate = q.activate.unwrap_or(!shadow);
    if shadow && activate {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "a version is either activated or run in shadow, not both".into(),
        ));
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

async fn activate_module(
    State(state): State<ApiState>,
    Api(Path(name)): Api<Path<String>>,
    Api(Query(q)): Api<Query<ActivateQuery>>,
) -> ApiResult<Response> {
    let version = state.modules.activate(&name, q.version).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

/// The module's settings document (`{}` when none).
async fn module_settings(State(state): State<ApiState>, Api(Path(name)): Api<Path<String>>) -> ApiResult<Response> {
    let record = with_controller(&state, move |c| {
        c.module(&name).ok_or_else(|| HostError::NotFound(format!("no module named {name:?}")))
    })
    .await?;
    Ok(Json(record.settings.unwrap_or_else(|| json!({}))).into_response())
}

/// Any JSON document; the module's guests read it through the `settings` capability.
async fn set_module_settings(
    State(state): State<ApiState>,
    Api(Path(name)): Api<Path<String>>,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    let settings: Value = serde_json::from_slice(&body)
        .map_err(|e| HostError::BadRequest(format!("settings must be a JSON document: {e}")))?;
    state.modules.set_settings(&name, Some(settings.clone())).await?;
    Ok(Json(json!({ "name": name, "settings": settings })).into_response())
}

async fn clear_module_settings(
    State(state): State<ApiState>,
    Api(Path(name)): Api<Path<String>>,
) -> ApiResult<Response> {
    state.modules.set_settings(&name, None).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn rollback_module(State(state): State<ApiState>, Api(Path(name)): Api<Path<String>>) -> ApiResult<Response> {
    let version = state.modules.rollback(&name).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

async fn start_shadow(
    State(state): State<ApiState>,
    Api(Path(name)): Api<Path<String>>,
    Api(Query(q)): Api<Query<ActivateQuery>>,
) -> ApiResult<Response> {
    let version = state.modules.start_shadow(&name, q.version).await?;
    Ok(Json(json!({ "name": name, "shadow_version": version })).into_response())
}

async fn stop_shadow(State(state): State<ApiState>, Api(Path(name)): Api<Path<String>>) -> ApiResult<Response> {
    state.modules.stop_shadow(&name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn shadow_diff(State(state): State<ApiState>, Api(Path(name)): Api<Path<String>>) -> ApiResult<Response> {
    let diff = with_controller(&state, move |c| c.shadow_diff(&name)).await?;
    Ok(Json(diff).into_response())
}

async fn promote_shadow(State(state): State<ApiState>, Api(Path(name)): Api<Path<String>>) -> ApiResult<Response> {
    let version = state.modules.promote(&name).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

async fn delete_module(State(state): State<ApiState>, Api(Path(name)): Api<Path<String>>) -> ApiResult<Response> {
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

async fn dataplane(State(state): State<ApiState>, Api(Query(q)): Api<Query<DataplaneQuery>>) -> ApiResult<Response> {
    let json_format = q.format.as_deref() == Some("json");
    with_controller(&state, move |c| {
        let dp = c.dataplane();
        Ok(if json_format {
            let objects: std::collections::BTreeMap<String, _> =
                dp.applied().iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
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
