//! The REST API (axum), versioned under `/v1`, plus health, readiness and metrics.
//!
//! Mutating calls need `Authorization: Bearer <token>`; reads are open to loopback peers
//! only, and need the token from anywhere else.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use wasmplane_runtime::{GuestKind, LoadError};

use crate::controller::{Controller, HostError};
use crate::metrics::Metrics;

#[derive(Clone)]
pub struct ApiState {
    pub controller: Arc<Mutex<Controller>>,
    pub metrics: Arc<Metrics>,
    pub token: Arc<String>,
    pub ready: Arc<AtomicBool>,
    pub max_module_bytes: usize,
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
            HostError::Load(_) | HostError::ActivationFailed { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            HostError::Write(_) | HostError::Storage(_) => StatusCode::INTERNAL_SERVER_ERROR,
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
        .route("/v1/state", get(node_state))
        .route("/v1/dataplane", get(dataplane))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state)
}

fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let Some(given) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")) else {
        return false;
    };
    // Compare digests so the time taken says nothing about the token.
    Sha256::digest(given.trim().as_bytes()) == Sha256::digest(token.as_bytes())
}

async fn authenticate(State(state): State<ApiState>, ConnectInfo(peer): ConnectInfo<SocketAddr>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let open_probe = matches!(path, "/healthz" | "/readyz");
    let read_only = matches!(*request.method(), Method::GET | Method::HEAD);
    let needs_token = !open_probe && (!read_only || !peer.ip().is_loopback());
    if needs_token && !bearer_matches(request.headers(), &state.token) {
        let why = if request.headers().contains_key(header::AUTHORIZATION) { "invalid bearer token" } else { "missing bearer token" };
        let mut response = ApiError(StatusCode::UNAUTHORIZED, format!("{why}: this call needs `Authorization: Bearer <token>`")).into_response();
        response.headers_mut().insert(header::WWW_AUTHENTICATE, "Bearer".parse().expect("static header"));
        return response;
    }
    next.run(request).await
}

async fn readyz(State(state): State<ApiState>) -> impl IntoResponse {
    if state.ready.load(Ordering::Relaxed) { (StatusCode::OK, "ready\n") } else { (StatusCode::SERVICE_UNAVAILABLE, "not ready: initial sync pending\n") }
}

async fn metrics(State(state): State<ApiState>) -> impl IntoResponse {
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
    let activate = q.activate.unwrap_or(true);
    let metrics = state.metrics.clone();
    let result = with_controller(&state, move |c| c.upload(&name, kind, &body, activate)).await;
    let label = if result.is_ok() { "accepted" } else { "refused" };
    metrics.module_uploads.get_or_create(&crate::metrics::ResultLabels { result: label.into() }).inc();
    Ok((StatusCode::CREATED, Json(result?)).into_response())
}

#[derive(Deserialize)]
struct ActivateQuery {
    version: Option<u32>,
}

async fn activate_module(State(state): State<ApiState>, Path(name): Path<String>, Query(q): Query<ActivateQuery>) -> ApiResult<Response> {
    let module = name.clone();
    let version = with_controller(&state, move |c| c.activate(&module, q.version)).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

async fn rollback_module(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    let module = name.clone();
    let version = with_controller(&state, move |c| c.rollback(&module)).await?;
    Ok(Json(json!({ "name": name, "active_version": version })).into_response())
}

async fn delete_module(State(state): State<ApiState>, Path(name): Path<String>) -> ApiResult<Response> {
    with_controller(&state, move |c| c.delete(&name)).await?;
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
