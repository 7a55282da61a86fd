//! `GET /v1/policies` and the policies' audit mode, allow logging and aggregated status; their verdicts
//! (`GET /v1/policies/verdicts`) are served with the drops.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use wasmplane_model::ObjectKey;

use super::{Api, ApiError, ApiResult, ApiState, with_controller};

#[derive(Deserialize)]
pub(super) struct PoliciesQuery {
    /// Also read the kernel's drop counters (one `nft list table`).
    counters: Option<bool>,
}

/// The policies this node enforces: generation, audit mode, targets, errors.
pub(super) async fn list_policies(
    State(state): State<ApiState>,
    Api(Query(query)): Api<Query<PoliciesQuery>>,
) -> ApiResult<Response> {
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
                    let (dropped, would_drop) =
                        counts.get(&ObjectKey::new(&p.namespace, &p.name)).copied().unwrap_or_default();
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
pub(super) struct AuditQuery {
    enabled: bool,
}

/// Audit mode for one policy on this node: would-be drops are logged and counted, not enforced.
pub(super) async fn set_policy_audit(
    State(state): State<ApiState>,
    Api(Path((namespace, name))): Api<Path<(String, String)>>,
    Api(Query(query)): Api<Query<AuditQuery>>,
) -> ApiResult<Response> {
    let key = ObjectKey::new(&namespace, &name);
    // Off for one policy while every policy is audited stays on: the answer says what holds.
    let (audit, exists) = with_controller(&state, move |c| {
        c.set_policy_audit(Some(&key), query.enabled)?;
        Ok((c.policy_audited(&key), c.policy_exists(&key)))
    })
    .await?;
    Ok(Json(toggled(&namespace, &name, "audit", audit, exists)).into_response())
}

/// What holds for one policy after a switch. A policy the cluster does not have keeps the
/// setting (so that a new policy can start in audit mode, with no moment enforced), and the
/// answer says so: a misspelt name would otherwise look applied.
fn toggled(namespace: &str, name: &str, field: &str, enabled: bool, exists: bool) -> Value {
    let mut answer = json!({ "policy": format!("{namespace}/{name}"), (field): enabled, "exists": exists });
    if !exists && enabled {
        answer["warning"] = json!(format!(
            "the cluster has no NetworkPolicy {namespace}/{name}: the setting is kept for it until switched off"
        ));
    }
    answer
}

/// Audit mode for every policy on this node (the whole policy module).
pub(super) async fn set_module_audit(
    State(state): State<ApiState>,
    Api(Query(query)): Api<Query<AuditQuery>>,
) -> ApiResult<Response> {
    with_controller(&state, move |c| c.set_policy_audit(None, query.enabled)).await?;
    Ok(Json(json!({ "audit": query.enabled })).into_response())
}

/// Allow logging for one policy on this node: the connections it accepts are logged to the
/// verdict log (`GET /v1/policies/verdicts?verdict=allow`); 409 where none is kept.
pub(super) async fn set_policy_log_allowed(
    State(state): State<ApiState>,
    Api(Path((namespace, name))): Api<Path<(String, String)>>,
    Api(Query(query)): Api<Query<AuditQuery>>,
) -> ApiResult<Response> {
    let key = ObjectKey::new(&namespace, &name);
    // Off for one policy while on for every policy stays on: the answer says what holds.
    let (log_allowed, exists) = with_controller(&state, move |c| {
        c.set_policy_log_allowed(Some(&key), query.enabled)?;
        Ok((c.policy_logs_allowed(&key), c.policy_exists(&key)))
    })
    .await?;
    Ok(Json(toggled(&namespace, &name, "log_allowed", log_allowed, exists)).into_response())
}

/// Allow logging for every policy on this node.
pub(super) async fn set_module_log_allowed(
    State(state): State<ApiState>,
    Api(Query(query)): Api<Query<AuditQuery>>,
) -> ApiResult<Response> {
    with_controller(&state, move |c| c.set_policy_log_allowed(None, query.enabled)).await?;
    Ok(Json(json!({ "log_allowed": query.enabled })).into_response())
}

/// A policy's realization status over every node, as the operator aggregates it.
pub(super) async fn policy_status(
    State(state): State<ApiState>,
    Api(Path((namespace, name))): Api<Path<(String, String)>>,
) -> ApiResult<Response> {
    let Some(operator) = &state.operator else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "policy status is aggregated by the operator role (--role operator)".into(),
        ));
    };
    match operator.policy_status(&namespace, &name) {
        Some(summary) => Ok(Json(summary).into_response()),
        None => Err(ApiError(StatusCode::NOT_FOUND, format!("no status reported for policy {namespace}/{name}"))),
    }
}
