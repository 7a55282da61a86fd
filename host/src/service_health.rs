//! Load balancer health checks: kube-proxy's `healthCheckNodePort` servers, and its node
//! health server (`/healthz`, `/livez`; kube-proxy's port 10256).
//!
//! A cloud load balancer in front of a `LoadBalancer` service with `externalTrafficPolicy:
//! Local` sends traffic only to nodes that have endpoints of the service, and learns which
//! from an HTTP check on the service's `healthCheckNodePort` on every node. This node answers
//! it as kube-proxy does: any path, `200` while the service has ready endpoints here and the
//! host has finished its initial sync, `503` otherwise, with the count in the JSON body and
//! in `X-Load-Balancing-Endpoint-Weight`.
//!
//! The model says what to serve ([`ServiceView::health_check`]); an observer of the
//! controller keeps the desired checks by port, and [`serve`] opens and closes one listener
//! per port as that changes. A port two services claim goes to the first by key, and a port
//! that cannot be bound (in use) is retried every [`RETRY`].
//!
//! Both report the host's own health ([`ProxyHealth`]): a load balancer should also avoid a
//! node whose dataplane has stopped following the cluster. The node server answers for
//! `externalTrafficPolicy: Cluster` services, whose load balancers check every node there,
//! and its `/healthz` drains a node that is being deleted (KEP-3836).
//!
//! [`ServiceView::health_check`]: wasmplane_model::ServiceView::health_check

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::watch;
use tokio::task::JoinSet;
use wasmplane_model::state::{HealthCheck, ModelUpdate};
use wasmplane_model::{NodeLocalModel, ObjectKey};

use crate::controller::{Controller, ModelObserver};
use crate::dataplane::WriteHealth;

/// How often a port that could not be bound is tried again.
pub const RETRY: Duration = Duration::from_secs(5);

/// What one port answers for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub service: ObjectKey,
    pub local_endpoints: usize,
}

/// The checks this node serves, by port.
pub type Checks = BTreeMap<u16, Check>;

/// The services with a health check, and the checks by port they make.
#[derive(Default)]
struct Desired {
    by_service: BTreeMap<ObjectKey, HealthCheck>,
}

impl Desired {
    /// Applies the services whose views changed; true when a service's check did.
    fn apply<'a>(&mut self, changed: impl IntoIterator<Item = (&'a ObjectKey, Option<HealthCheck>)>) -> bool {
        let mut moved = false;
        for (key, check) in changed {
            moved |= match check {
                Some(check) => self.by_service.insert(key.clone(), check.clone()).is_none_or(|old| old != check),
                None => self.by_service.remove(key).is_some(),
            };
        }
        moved
    }

    fn checks(&self) -> Checks {
        let mut by_port = Checks::new();
        // In key order: a port two services claim (a hand-written manifest; the API server
        // refuses it) stays with the first.
        for (service, check) in &self.by_service {
            match by_port.get(&check.port) {
                Some(owner) => {
                    tracing::warn!(port = check.port, service = %service, owner = %owner.service, "health check port already served for another service")
                }
                None => {
                    by_port
                        .insert(check.port, Check { service: service.clone(), local_endpoints: check.local_endpoints });
                }
            }
        }
        by_port
    }
}

struct HealthObserver {
    desired: Mutex<Desired>,
    checks: watch::Sender<Arc<Checks>>,
}

impl ModelObserver for HealthObserver {
    fn model_changed(&self, _model: &NodeLocalModel, update: &ModelUpdate) {
        let mut desired = self.desired.lock().unwrap_or_else(|p| p.into_inner());
        if desired.apply(update.changed.iter().map(|c| (&c.key, c.view.as_ref().and_then(|v| v.health_check())))) {
            let checks = desired.checks();
            self.checks.send_if_modified(|current| {
                let modified = **current != checks;
                if modified {
                    *current = Arc::new(checks);
                }
                modified
            });
        }
    }
}

/// Follows the controller's model: the checks this node serves, now and as they change.
pub fn follow(controller: &Arc<Mutex<Controller>>) -> watch::Receiver<Arc<Checks>> {
    let mut controller = controller.lock().unwrap_or_else(|p| p.into_inner());
    let mut desired = Desired::default();
    desired.apply(controller.model().services.iter().map(|(key, view)| (key, view.health_check())));
    let (tx, rx) = watch::channel(Arc::new(desired.checks()));
    controller.add_observer(Box::new(HealthObserver { desired: Mutex::new(desired), checks: tx }));
    rx
}

/// The host's health as kube-proxy's health server reports it: healthy once the initial
/// sync is done, and until writes have been refused for longer than `timeout` (kube-proxy:
/// twice its sync period; here twice the reconcile interval, as a refused change waits for
/// the next reconcile at the latest).
#[derive(Clone)]
pub struct ProxyHealth {
    pub ready: Arc<AtomicBool>,
    pub writes: Arc<WriteHealth>,
    pub timeout: Duration,
    /// This node is going away (see [`follow_node`]): `/healthz` drains it, `/livez` does not.
    pub node_being_deleted: Arc<AtomicBool>,
}

impl ProxyHealth {
    pub fn healthy(&self, now: SystemTime) -> bool {
        self.ready.load(Ordering::Relaxed)
            && self
                .writes
                .failing_since()
                .is_none_or(|since| now.duration_since(since).unwrap_or_default() < self.timeout)
    }
}

/// Keeps `being_deleted` equal to the model's [`NodeLocalModel::node_being_deleted`].
struct NodeEligibility(Arc<AtomicBool>);

impl ModelObserver for NodeEligibility {
    fn model_changed(&self, model: &NodeLocalModel, _update: &ModelUpdate) {
        self.0.store(model.node_being_deleted, Ordering::Relaxed);
    }
}

/// Follows the controller's model: whether this node is being deleted, now and as it changes.
pub fn follow_node(controller: &Arc<Mutex<Controller>>) -> Arc<AtomicBool> {
    let mut controller = controller.lock().unwrap_or_else(|p| p.into_inner());
    let being_deleted = Arc::new(AtomicBool::new(controller.model().node_being_deleted));
    controller.add_observer(Box::new(NodeEligibility(being_deleted.clone())));
    being_deleted
}

/// RFC 3339, or empty for never.
fn timestamp(t: Option<SystemTime>) -> String {
    t.and_then(|t| k8s_openapi::jiff::Timestamp::try_from(t).ok()).map(|t| t.to_string()).unwrap_or_default()
}

/// The node's health for load balancers (`/healthz`, and any other path): 200 or 503, with
/// when the kernel last took a write; 503 too while the node is being deleted
/// (`nodeEligible: false`), so that load balancers drain it first.
async fn answer_node(State(health): State<ProxyHealth>) -> Response {
    let eligible = !health.node_being_deleted.load(Ordering::Relaxed);
    node_answer(&health, Some(eligible))
}

/// The host's liveness (`/livez`): as `/healthz`, whether or not the node is being deleted.
async fn answer_live(State(health): State<ProxyHealth>) -> Response {
    node_answer(&health, None)
}

fn node_answer(health: &ProxyHealth, eligible: Option<bool>) -> Response {
    let now = SystemTime::now();
    let healthy = health.healthy(now) && eligible != Some(false);
    let mut body = serde_json::json!({
        "lastUpdated": timestamp(health.writes.last_written()),
        "currentTime": timestamp(Some(now)),
    });
    if let Some(eligible) = eligible {
        body["nodeEligible"] = eligible.into();
    }
    json_answer(if healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, &body)
}

/// A JSON answer with the headers kube-proxy's health servers send.
fn json_answer(status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("application/json")),
            (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        ],
        body.to_string(),
    )
        .into_response()
}

/// Serves the node's health on `listen` (retried every [`RETRY`] while the address is taken)
/// until the task is aborted.
pub async fn serve_node(listen: SocketAddr, health: ProxyHealth) {
    // Warned once: where kube-proxy still runs, the port stays taken until it goes.
    let mut warned = false;
    let listener = loop {
        match tokio::net::TcpListener::bind(listen).await {
            Ok(listener) => break listener,
            Err(e) if !warned => {
                tracing::warn!(%listen, "cannot serve the node's health (retrying every {RETRY:?}): {e}")
            }
            Err(e) => tracing::debug!(%listen, "cannot serve the node's health yet: {e}"),
        }
        warned = true;
        tokio::time::sleep(RETRY).await;
    };
    tracing::info!(%listen, "serving the node's health for load balancers");
    let app =
        axum::Router::new().route("/livez", axum::routing::get(answer_live)).fallback(answer_node).with_state(health);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!(%listen, "node health server failed: {e}");
    }
}

/// What a listener needs to answer.
#[derive(Clone)]
struct Answering {
    port: u16,
    checks: watch::Receiver<Arc<Checks>>,
    /// kube-proxy's `serviceProxyHealthy`.
    health: ProxyHealth,
}

async fn answer(State(a): State<Answering>) -> Response {
    let check = a.checks.borrow().get(&a.port).cloned();
    let healthy = a.health.healthy(SystemTime::now());
    let (namespace, name, count) = match &check {
        Some(c) => (c.service.namespace.as_str(), c.service.name.as_str(), c.local_endpoints),
        None => ("", "", 0),
    };
    let status = if count > 0 && healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = serde_json::json!({
        "service": { "namespace": namespace, "name": name },
        "localEndpoints": count,
        "serviceProxyHealthy": healthy,
    });
    let mut response = json_answer(status, &body);
    response
        .headers_mut()
        .insert(HeaderName::from_static("x-load-balancing-endpoint-weight"), HeaderValue::from(count));
    response
}

/// One port's server, until its check goes.
struct Listening {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Serves every check on `bind` until `checks` closes (the controller is gone) or the task
/// is aborted; the servers go with it.
pub async fn serve(bind: IpAddr, mut checks: watch::Receiver<Arc<Checks>>, health: ProxyHealth) {
    let mut servers: JoinSet<()> = JoinSet::new();
    let mut open: HashMap<u16, Listening> = HashMap::new();
    // Ports already warned about while taken: once each, until they are served.
    let mut warned: HashSet<u16> = HashSet::new();
    let mut retry = tokio::time::interval(RETRY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let wanted = checks.borrow_and_update().clone();
        // Dropping a `Listening` stops its server gracefully: idle keep-alive connections close.
        open.retain(|port, _| wanted.contains_key(port));
        warned.retain(|port| wanted.contains_key(port));
        for (&port, check) in wanted.iter() {
            if open.contains_key(&port) {
                continue;
            }
            let addr = SocketAddr::new(bind, port);
            let listener = match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => listener,
                Err(e) => {
                    if warned.insert(port) {
                        tracing::warn!(%addr, service = %check.service, "cannot serve the health check (retrying every {RETRY:?}): {e}");
                    } else {
                        tracing::debug!(%addr, service = %check.service, "cannot serve the health check yet: {e}");
                    }
                    continue;
                }
            };
            warned.remove(&port);
            tracing::info!(%addr, service = %check.service, "serving the load balancer health check");
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let app = axum::Router::new().fallback(answer).with_state(Answering {
                port,
                checks: checks.clone(),
                health: health.clone(),
            });
            servers.spawn(async move {
                let shutdown = async move {
                    let _ = stopped.await;
                };
                if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                    tracing::warn!(%addr, "health check server failed: {e}");
                }
            });
            open.insert(port, Listening { stop: Some(stop) });
        }
        let all_bound = wanted.keys().all(|port| open.contains_key(port));
        tokio::select! {
            changed = checks.changed() => if changed.is_err() { return },
            _ = retry.tick(), if !all_bound => {}
            // Reap finished servers so the set does not grow.
            Some(_) = servers.join_next(), if !servers.is_empty() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(port: u16, local_endpoints: usize) -> Option<HealthCheck> {
        Some(HealthCheck { port, local_endpoints })
    }

    #[test]
    fn a_port_stays_with_the_first_service_claiming_it_and_passes_on_when_it_goes() {
        let (a, b, c) = (ObjectKey::new("shop", "a"), ObjectKey::new("shop", "b"), ObjectKey::new("shop", "c"));
        let mut desired = Desired::default();
        assert!(desired.apply([(&b, check(31000, 1)), (&c, check(31001, 0))]));
        assert!(desired.apply([(&a, check(31000, 2))]));
        let checks = desired.checks();
        assert_eq!(checks[&31000], Check { service: a.clone(), local_endpoints: 2 });
        assert_eq!(checks[&31001], Check { service: c.clone(), local_endpoints: 0 });
        // The same check again is no change; a view change without a check is none either.
        assert!(!desired.apply([(&a, check(31000, 2)), (&ObjectKey::new("shop", "plain"), None)]));
        assert!(desired.apply([(&a, None)]));
        assert_eq!(desired.checks()[&31000], Check { service: b, local_endpoints: 1 });
        assert!(desired.apply([(&c, check(31001, 3))]));
        assert_eq!(desired.checks()[&31001].local_endpoints, 3);
    }
}
