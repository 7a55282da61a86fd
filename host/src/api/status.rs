//! `GET /v1/status`: this node's summary (`wasmplane status`), counts and last outcomes only.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{ApiResult, ApiState, unready_reason, with_controller};
use crate::metrics::ResultLabels;
use crate::registry::ModuleStatus;

/// Unix seconds and age in seconds of `t` (`None`: never).
fn unix_and_age(t: Option<std::time::SystemTime>) -> (Option<u64>, Option<u64>) {
    let Some(t) = t else { return (None, None) };
    let unix = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).ok();
    (unix, Some(t.elapsed().map_or(0, |d| d.as_secs())))
}

/// This node's summary (`wasmplane status`): counts and last outcomes only, never the model
/// or the dataplane themselves, so that it stays cheap at any number of services.
pub(super) async fn status(State(state): State<ApiState>) -> ApiResult<Response> {
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
                (ModuleStatus::Failed, _) => {
                    failed_modules.push(json!({ "name": module.name, "kind": module.kind, "error": module.last_error }))
                }
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
