//! `GET /v1/services` and `GET /v1/services/{namespace}/{name}`: the services of this node's
//! model, with their endpoint counts, applied rules and translation errors.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;
use wasmplane_model::{CompactString, ObjectKey, Protocol, ServiceType, ServiceView};

use super::{Api, ApiResult, ApiState, with_controller};
use crate::controller::HostError;

#[derive(Deserialize)]
pub(super) struct ServicesQuery {
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
        ports: service
            .ports
            .iter()
            .map(|p| PortRow {
                name: &p.name,
                port: p.port,
                protocol: p.protocol,
                node_port: (p.node_port != 0).then_some(p.node_port),
            })
            .collect(),
        endpoints,
        error,
    }
}

/// The services of this node's model, one row each (`?namespace=NS`: those of one namespace).
pub(super) async fn list_services(
    State(state): State<ApiState>,
    Api(Query(query)): Api<Query<ServicesQuery>>,
) -> ApiResult<Response> {
    // Shared views taken under the lock, rows built after it.
    let services = with_controller(&state, move |c| {
        let errors = c.service_errors();
        let services = &c.model().services;
        let selected: Box<dyn Iterator<Item = (&ObjectKey, &Arc<ServiceView>)>> = match &query.namespace {
            // Keys sort by namespace first: one namespace is one range.
            Some(namespace) => Box::new(
                services
                    .range(ObjectKey::new(namespace, "")..)
                    .take_while(|(key, _)| key.namespace == namespace.as_str()),
            ),
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
pub(super) async fn service_detail(
    State(state): State<ApiState>,
    Api(Path((namespace, name))): Api<Path<(String, String)>>,
) -> ApiResult<Response> {
    let key = ObjectKey::new(&namespace, &name);
    let body = with_controller(&state, move |c| {
        let view = c
            .model()
            .services
            .get(&key)
            .ok_or_else(|| HostError::NotFound(format!("no service {key} in this node's model")))?;
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
