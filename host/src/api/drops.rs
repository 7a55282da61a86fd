//! `GET /v1/drops` and `GET /v1/policies/verdicts`: the drops and policy verdicts read back
//! from the kernel, named by pod and service from the model now.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use wasmplane_model::{ObjectKey, Protocol, ServiceView};

use super::{Api, ApiError, ApiResult, ApiState, with_controller};
use crate::controller::{Controller, HostError};
use crate::nft::policy::{Direction, PolicyVerdict};
use crate::nft::service_drops::ServiceDropReason;
use crate::policy_log::{DropEvent, DropReason};

#[derive(Deserialize)]
pub(super) struct VerdictsQuery {
    /// `namespace/name` of a pod on this node.
    pod: Option<String>,
    verdict: Option<PolicyVerdict>,
    limit: Option<usize>,
    /// Only events logged at or after this time (ms since the epoch): what a follower polls.
    since_unix_ms: Option<u64>,
}

/// The packets policy dropped here, or in audit mode would have, and the connections
/// policies with allow logging allowed, newest first: the pod (by name, from the model now),
/// the direction, the addresses, protocol and port, and the policies selecting the pod in
/// that direction (an allowed one's also the `policy` that allowed it).
pub(super) async fn policy_verdicts(
    State(state): State<ApiState>,
    Api(Query(query)): Api<Query<VerdictsQuery>>,
) -> ApiResult<Response> {
    let Some(log) = state.policy_verdicts.clone() else {
        return Err(ApiError(StatusCode::NOT_FOUND, "policy verdicts are not read on this host: it writes no kernel (--dataplane nftables), logs none (--policy-log-group 0) or could not bind the group (see its log)".into()));
    };
    let verdict = query.verdict;
    let limit = query.limit.unwrap_or(100).min(crate::policy_log::CAPACITY);
    let body = with_controller(&state, move |c| {
        let pod_of = local_pods_by_address(c);
        let wanted_addresses = addresses_of_pod(&pod_of, query.pod.as_deref())?;
        let since = query.since_unix_ms.unwrap_or(0);
        let allows = AllowedBy::new(c);
        // Policy events only: the service side's are in `GET /v1/drops`.
        let events = log.recent(limit, |e| {
            let wanted_pod =
                |pod: Option<IpAddr>| wanted_addresses.as_ref().is_none_or(|a| pod.is_some_and(|pod| a.contains(&pod)));
            e.at_unix_ms >= since
                && match (e.policy(), e.allow()) {
                    (Some((v, _, pod)), _) => verdict.is_none_or(|wanted| v == wanted) && wanted_pod(Some(pod)),
                    (None, Some(_)) => {
                        verdict.is_none_or(|wanted| wanted == PolicyVerdict::Allow)
                            && wanted_pod(allows.of(e).and_then(|a| a.pod_address))
                    }
                    (None, None) => false,
                }
        });
        let events: Vec<Value> = events.iter().map(|event| event_json(c, &pod_of, None, &allows, event)).collect();
        Ok(json!({ "totals": log.totals(), "events": events }))
    })
    .await?;
    Ok(Json(body).into_response())
}

/// Resolves allow events to their policy, direction and pod, by the ids of the policies in
/// force now (hashed on the first allow event a read meets, not before).
pub(super) struct AllowedBy<'c> {
    controller: &'c Controller,
    ids: std::cell::OnceCell<BTreeMap<crate::nft::policy::PolicyLogId, ObjectKey>>,
}

impl<'c> AllowedBy<'c> {
    pub(super) fn new(controller: &'c Controller) -> AllowedBy<'c> {
        AllowedBy { controller, ids: std::cell::OnceCell::new() }
    }

    fn of(&self, event: &DropEvent) -> Option<crate::policy::AllowedBy> {
        let (direction, id) = event.allow()?;
        let policies = self.controller.policy_controller();
        let ids = self.ids.get_or_init(|| policies.log_ids());
        Some(policies.allowed_by(ids, direction, id, event.source, event.destination))
    }
}

/// This node's pods by address (`namespace/name`), from the model now.
pub(super) fn local_pods_by_address(c: &Controller) -> BTreeMap<IpAddr, String> {
    c.model()
        .local_pods
        .iter()
        .flat_map(|(key, pod)| {
            pod.ips.iter().filter_map(|ip| ip.parse().ok()).map(move |ip: IpAddr| (ip, key.to_string()))
        })
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
fn event_json(
    c: &Controller,
    pod_of: &BTreeMap<IpAddr, String>,
    frontends: Option<&ServiceFrontends>,
    allows: &AllowedBy,
    event: &DropEvent,
) -> Value {
    let mut v = serde_json::to_value(event).unwrap_or(Value::Null);
    let name_of = |addr: &IpAddr| pod_of.get(addr).map_or(Value::Null, |k| Value::String(k.clone()));
    let selecting = |direction: Direction, pod_address: IpAddr| -> Vec<String> {
        c.policies_selecting(direction, pod_address).iter().map(ToString::to_string).collect()
    };
    match (event.policy(), allows.of(event)) {
        (Some((_, direction, pod_address)), _) => {
            v["pod"] = name_of(&pod_address);
            v["policies"] = json!(selecting(direction, pod_address));
        }
        (None, Some(allowed)) => {
            // The fields of a policy verdict, and the policy that allowed it.
            v["verdict"] = json!(PolicyVerdict::Allow);
            v["direction"] = json!(allowed.direction);
            v["pod_address"] = json!(allowed.pod_address);
            v["pod"] = allowed.pod_address.as_ref().map_or(Value::Null, name_of);
            v["policy"] = json!(allowed.policy.as_ref().map(ToString::to_string));
            v["policies"] =
                json!(allowed.direction.zip(allowed.pod_address).map(|(d, pod)| selecting(d, pod)).unwrap_or_default());
            if let Some(object) = v.as_object_mut() {
                object.remove("policy_id");
            }
        }
        (None, None) => {
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
pub(super) struct ServiceFrontends<'a> {
    ports: HashMap<(IpAddr, Protocol, u16), (&'a ObjectKey, &'a str)>,
    node_ports: HashMap<(Protocol, u16), (&'a ObjectKey, &'a str)>,
    addresses: HashMap<IpAddr, &'a ObjectKey>,
}

impl<'a> ServiceFrontends<'a> {
    /// What [`ServiceFrontends::resolve`] needs to answer for `events`: the services with
    /// their destinations, and those with the node ports of their no-endpoint drops. Each
    /// address and node port answers with the first service (by name) that has it.
    pub(super) fn of<'e>(
        services: &'a BTreeMap<ObjectKey, Arc<ServiceView>>,
        events: impl IntoIterator<Item = &'e DropEvent>,
    ) -> ServiceFrontends<'a> {
        let mut frontends =
            ServiceFrontends { ports: HashMap::new(), node_ports: HashMap::new(), addresses: HashMap::new() };
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
        if let Some(&(key, name)) =
            port.and_then(|(protocol, port)| self.ports.get(&(event.destination, protocol, port)))
        {
            return Some((key, Some(name)));
        }
        if let Some(&key) = self.addresses.get(&event.destination) {
            return Some((key, None));
        }
        port.filter(|_| Self::may_be_node_port(reason))
            .and_then(|port| self.node_ports.get(&port))
            .map(|&(key, name)| (key, Some(name)))
    }
}

/// A logged packet's protocol and destination port, when it is one services have.
fn event_port(event: &DropEvent) -> Option<(Protocol, u16)> {
    Protocol::parse(&event.protocol.to_ascii_uppercase()).zip(event.destination_port)
}

#[derive(Deserialize)]
pub(super) struct DropsQuery {
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
pub(super) async fn drops(
    State(state): State<ApiState>,
    Api(Query(query)): Api<Query<DropsQuery>>,
) -> ApiResult<Response> {
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
        // Allowed connections are no drops.
        let keep = |e: &DropEvent| {
            e.cause.is_drop()
                && e.at_unix_ms >= since
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
        Ok(json!({ "totals": { "policy_verdicts": log.totals().drops(), "service_drops": log.service_totals() }, "events": events }))
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
pub(super) fn drop_json(
    c: &Controller,
    pod_of: &BTreeMap<IpAddr, String>,
    frontends: &ServiceFrontends,
    event: &DropEvent,
) -> Value {
    let mut v = event_json(c, pod_of, Some(frontends), &AllowedBy::new(c), event);
    v["kind"] = json!(event.cause.kind());
    v["reason"] = json!(event.cause.reason());
    v
}

/// The newest `limit` drops filed under one of `addresses` (see [`pod_side`]), as
/// `GET /v1/drops?pod=` picks them. A host-network pod's addresses are the node's: its drops
/// are those of the node's addresses.
pub(super) fn drops_of_pod(
    log: &crate::policy_log::PolicyVerdictLog,
    addresses: &[IpAddr],
    limit: usize,
) -> Vec<DropEvent> {
    log.recent(limit, |event| event.cause.is_drop() && addresses.contains(&pod_side(event)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy_log::{DropCause, PolicyVerdictLog};

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn logged(at_unix_ms: u64, cause: DropCause, source: &str, destination: &str) -> DropEvent {
        DropEvent {
            at_unix_ms,
            cause,
            source: ip(source),
            destination: ip(destination),
            protocol: "tcp".into(),
            source_port: Some(40000),
            destination_port: Some(80),
        }
    }

    /// A pod's drops: its policy verdicts (either direction) and the service drops of what it
    /// sent; not another pod's verdicts of what it sent, nor service drops of what it was sent.
    #[test]
    fn a_pods_drops_are_those_drops_list_files_under_it() {
        const POD: &str = "10.244.0.41";
        const OTHER: &str = "10.244.0.42";
        let policy = |direction, pod_address: &str| DropCause::Policy {
            verdict: PolicyVerdict::Deny,
            direction,
            pod_address: ip(pod_address),
        };
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
        use wasmplane_model::{Service, ServicePort};
        let service = |name: &str, cluster_ip: &str, ports: Vec<ServicePort>| {
            let key = ObjectKey::new("default", name);
            (
                key,
                Arc::new(ServiceView {
                    service: Arc::new(Service::cluster_ip("default", name, cluster_ip, ports)),
                    slices: Vec::new(),
                }),
            )
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
        let named =
            |event: &DropEvent| frontends.resolve(event).map(|(key, port)| (key.to_string(), port.map(str::to_string)));
        assert_eq!(named(&events[0]), Some(("default/b-shared".into(), Some("http".into()))), "by frontend");
        assert_eq!(named(&events[1]), Some(("default/a-shared".into(), None)), "by address: the first by name");
        assert_eq!(named(&events[2]), Some(("default/web".into(), Some("web".into()))), "by node port");
        assert_eq!(named(&events[3]), None, "only a drop of no endpoints comes through a node port");
        assert_eq!(named(&events[4]), None);
        assert_eq!(frontends.addresses.len(), 1, "only the events' destinations");
        assert!(!frontends.ports.keys().any(|(address, _, _)| *address == ip("10.96.0.30")));

        let policy = logged(
            1,
            DropCause::Policy {
                verdict: PolicyVerdict::Deny,
                direction: Direction::Ingress,
                pod_address: ip("10.96.0.10"),
            },
            "10.0.0.1",
            "10.96.0.10",
        );
        let none = ServiceFrontends::of(&services, [&policy]);
        assert!(
            none.ports.is_empty() && none.addresses.is_empty() && none.node_ports.is_empty(),
            "no service drop, nothing indexed"
        );
        assert_eq!(none.resolve(&policy), None);
    }
}
