//! `GET /v1/pods` and `GET /v1/pods/{namespace}/{name}`: this node's pods, with the policies
//! their dispatch chains run, their CNI allocations and latest drops.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use wasmplane_model::{CompactString, Labels, ObjectKey, Pod};

use super::drops::{ServiceFrontends, drop_json, drops_of_pod, local_pods_by_address};
use super::{Api, ApiResult, ApiState, with_controller};
use crate::controller::{Controller, HostError};
use crate::nft::policy::Direction;

#[derive(Deserialize)]
pub(super) struct PodsQuery {
    namespace: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct PodQuery {
    /// Also read the kernel's counters of the pod's dispatch chains (`policy_counts`).
    #[serde(default)]
    counters: bool,
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
    /// The connections it allows are logged.
    log_allowed: bool,
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
    /// With `?counters=true`: per direction, the new connections each selecting policy
    /// accepted and those dropped (`null` where this host writes no kernel); left out
    /// otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    policy_counts: Option<Option<crate::policy::PodPolicyCounts>>,
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

fn allocations_by_pod(
    allocations: Vec<wasmplane_cni::Allocation>,
    pools: &[wasmplane_cni::Pool],
) -> BTreeMap<ObjectKey, Vec<CniAllocation>> {
    let mut by_pod: BTreeMap<ObjectKey, Vec<CniAllocation>> = BTreeMap::new();
    for allocation in allocations {
        // State from before allocations named their pod cannot be told apart: left out.
        let (Some(namespace), Some(name)) = (&allocation.pod_namespace, &allocation.pod_name) else { continue };
        let addresses = allocation
            .ips
            .iter()
            .map(|ip| CniAddress {
                ip: *ip,
                pod_cidr: pools.iter().find(|pool| pool.cidr.contains(ip)).map(|pool| pool.cidr.to_string()),
            })
            .collect();
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
fn pod_row(
    c: &Controller,
    statuses: &BTreeMap<ObjectKey, crate::policy::PolicyStatus>,
    cni: Option<&BTreeMap<ObjectKey, Vec<CniAllocation>>>,
    pod: &Pod,
) -> PodRow {
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
            SelectingPolicy {
                name: key.to_string(),
                policy_types,
                audit: status.is_some_and(|s| s.audit),
                log_allowed: status.is_some_and(|s| s.log_allowed),
                error: status.and_then(|s| s.error.clone()),
            }
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
pub(super) async fn list_pods(
    State(state): State<ApiState>,
    Api(Query(query)): Api<Query<PodsQuery>>,
) -> ApiResult<Response> {
    let cni = cni_allocations(&state);
    let pods = with_controller(&state, move |c| {
        let statuses = policy_statuses(c);
        let local_pods = &c.model().local_pods;
        let selected: Box<dyn Iterator<Item = (&ObjectKey, &Arc<Pod>)>> = match &query.namespace {
            // Keys sort by namespace first: one namespace is one range.
            Some(namespace) => Box::new(
                local_pods
                    .range(ObjectKey::new(namespace, "")..)
                    .take_while(|(key, _)| key.namespace == namespace.as_str()),
            ),
            None => Box::new(local_pods.iter()),
        };
        Ok(selected.map(|(_, pod)| pod_row(c, &statuses, cni.as_ref(), pod)).collect())
    })
    .await?;
    Ok(Json(PodList { pods }).into_response())
}

/// One pod on this node: its row, labels and latest drops; any other pod is not found.
pub(super) async fn pod_detail(
    State(state): State<ApiState>,
    Api(Path((namespace, name))): Api<Path<(String, String)>>,
    Api(Query(query)): Api<Query<PodQuery>>,
) -> ApiResult<Response> {
    let key = ObjectKey::new(&namespace, &name);
    let cni = cni_allocations(&state);
    let log = state.policy_verdicts.clone();
    let detail = with_controller(&state, move |c| {
        let pod = c.model().local_pods.get(&key).ok_or_else(|| not_this_nodes_pod(c, &key))?;
        // A host-network pod's addresses are the node's, which no policy selects.
        let addresses: Vec<IpAddr> = pod.ips.iter().filter_map(|ip| ip.parse().ok()).collect();
        let policy_addresses: &[IpAddr] = if pod.host_network { &[] } else { &addresses };
        let recent_drops = log.map(|log| {
            let pod_of = local_pods_by_address(c);
            let drops = drops_of_pod(&log, &addresses, POD_RECENT_DROPS);
            let frontends = ServiceFrontends::of(&c.model().services, &drops);
            drops.iter().map(|event| drop_json(c, &pod_of, &frontends, event)).collect()
        });
        let (row, node, labels) =
            (pod_row(c, &policy_statuses(c), cni.as_ref(), pod), pod.node_name.clone(), pod.labels.clone());
        let policy_counts = if query.counters { Some(c.pod_policy_counts(policy_addresses)?) } else { None };
        Ok(PodDetail { row, node, labels, recent_drops, policy_counts })
    })
    .await?;
    Ok(Json(detail).into_response())
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
    use serde_json::json;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    /// Allocations by pod, each address with the pod CIDR it is from; unnamed ones left out.
    #[test]
    fn cni_allocations_name_their_pod_cidr() {
        let pools = [
            wasmplane_cni::Pool { cidr: "10.244.0.0/24".parse().unwrap(), gateway: ip("10.244.0.1") },
            wasmplane_cni::Pool { cidr: "fd00::/64".parse().unwrap(), gateway: ip("fd00::1") },
        ];
        let allocation = |container: &str, pod: Option<(&str, &str)>, ips: &[&str]| wasmplane_cni::Allocation {
            ips: ips.iter().map(|i| ip(i)).collect(),
            container_id: container.into(),
            if_name: "eth0".into(),
            pod_namespace: pod.map(|p| p.0.into()),
            pod_name: pod.map(|p| p.1.into()),
            allocated_at: Some(7),
        };
        let by_pod = allocations_by_pod(
            vec![
                allocation("c1", Some(("default", "web-1")), &["10.244.0.41", "fd00::41"]),
                allocation("c2", None, &["10.244.0.50"]),
                allocation("c3", Some(("default", "old")), &["10.9.0.5"]),
            ],
            &pools,
        );
        assert_eq!(by_pod.len(), 2, "{by_pod:?}");
        let web = &by_pod[&ObjectKey::new("default", "web-1")];
        assert_eq!(
            serde_json::to_value(web).unwrap(),
            json!([{ "container_id": "c1", "interface": "eth0", "allocated_at_unix_seconds": 7,
                     "addresses": [{ "ip": "10.244.0.41", "pod_cidr": "10.244.0.0/24" }, { "ip": "fd00::41", "pod_cidr": "fd00::/64" }] }])
        );
        assert_eq!(
            by_pod[&ObjectKey::new("default", "old")][0].addresses[0].pod_cidr,
            None,
            "outside today's pod CIDRs"
        );
    }
}
