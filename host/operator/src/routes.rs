//! Routes to other nodes' pod CIDRs, via their node IPs.
//!
//! The desired set is computed from the node registry's view (every other
//! node's pod CIDRs, each via that node's address of the same family) and
//! applied with rtnetlink in the main table. Every route we add carries our own
//! route protocol number, which is how we recognise ours: only routes with that
//! protocol are ever replaced or deleted, and a route to the same destination
//! owned by someone else is reported, not overwritten.
//!
//! A netlink socket belongs to the network namespace of the thread that opened
//! it, so the kernel side runs on one dedicated thread with a current-thread
//! runtime, which `setns`es first when told to work in a namespace; the rest of
//! the process stays where it is.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt as _;
use ipnet::IpNet;
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol};
use rtnetlink::{Handle, RouteMessageBuilder};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{Instrument, debug, info, warn};

use crate::error::{Error, Result};
use crate::nodes::{NodeInfo, NodeRegistry, decode_all, decode_node_info};
use crate::per_cluster::PerCluster;
use wasmplane_kvstore::{SharedBatch, SharedChange, SharedStore};

/// The route protocol marking wasmplane's routes (`ip route show proto 149`).
/// Unassigned in iproute2's `rt_protos`.
pub const DEFAULT_ROUTE_PROTOCOL: u8 = 149;

/// Where and how routes are programmed.
#[derive(Debug, Clone)]
pub struct RouteConfig {
    /// Network namespace to program (a path such as `/run/netns/x`); `None`:
    /// the process's own.
    pub netns: Option<PathBuf>,
    /// Route protocol marking our routes.
    pub protocol: u8,
    /// Period of the full reconcile that repairs drift (routes deleted or
    /// changed behind our back).
    pub resync_interval: Duration,
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig { netns: None, protocol: DEFAULT_ROUTE_PROTOCOL, resync_interval: Duration::from_secs(60) }
    }
}

/// Destination CIDR → gateway.
pub type RouteSet = BTreeMap<IpNet, IpAddr>;

/// Other clusters' nodes (Cilium's clustermesh with native routing and
/// `auto-direct-node-routes`): cluster name → node name → its info.
pub type RemoteNodeSet = BTreeMap<String, BTreeMap<String, NodeInfo>>;

/// The routes `local` needs: each other node's pod CIDRs via its first node IP of
/// the same family, this cluster's nodes first, then each remote cluster's in
/// name order. A CIDR claimed twice goes to the node with the lower ID; one
/// equal to or overlapping a local pod CIDR is never routed away, nor is a
/// remote cluster's that overlaps a CIDR already routed (clusters of a mesh must
/// have disjoint pod CIDRs: the first one keeps it).
pub fn desired_routes(local: &NodeInfo, nodes: &BTreeMap<String, NodeInfo>, remote: &RemoteNodeSet) -> RouteSet {
    let mut routes = RouteSet::new();
    add_cluster_routes(&mut routes, local, nodes, None);
    for (cluster, nodes) in remote {
        add_cluster_routes(&mut routes, local, nodes, Some(cluster));
    }
    routes
}

/// Adds one cluster's routes (`cluster`: a remote one) to `routes`.
fn add_cluster_routes(
    routes: &mut RouteSet,
    local: &NodeInfo,
    nodes: &BTreeMap<String, NodeInfo>,
    cluster: Option<&str>,
) {
    let own = &local.pod_cidrs;
    // This cluster's nodes are others only by name; a remote one may reuse it.
    let mut by_id: Vec<&NodeInfo> = nodes.values().filter(|n| cluster.is_some() || n.name != local.name).collect();
    by_id.sort_by_key(|n| (n.id, n.name.clone()));
    let remote_routes = cluster.map(|_| routes.clone());
    for node in by_id {
        for cidr in &node.pod_cidrs {
            let cidr = cidr.trunc();
            if own.iter().any(|o| o.contains(&cidr) || cidr.contains(o)) {
                warn!(cluster, node = %node.name, %cidr, "pod CIDR overlaps this node's own; not routed");
                continue;
            }
            // Against the routes of the clusters before this one only: within a
            // cluster, a CIDR claimed twice is the rule below.
            if let Some((taken, via)) =
                remote_routes.iter().flatten().find(|(r, _)| r.contains(&cidr) || cidr.contains(*r))
            {
                warn!(cluster, node = %node.name, %cidr, overlaps = %taken, %via, "pod CIDR overlaps another cluster's; not routed");
                continue;
            }
            let gateway = node.node_ips.iter().find(|ip| ip.is_ipv4() == cidr.addr().is_ipv4());
            let Some(gateway) = gateway else {
                warn!(cluster, node = %node.name, %cidr, "no node IP of the CIDR's family; not routed");
                continue;
            };
            if let Some(previous) = routes.get(&cidr) {
                warn!(cluster, node = %node.name, %cidr, via = %previous, "pod CIDR claimed twice; keeping the lower node ID's");
                continue;
            }
            routes.insert(cidr, *gateway);
        }
    }
}

/// What the last reconcile did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteSyncReport {
    /// Routes of ours present after the reconcile.
    pub applied: RouteSet,
    /// Routes that could not be applied or removed, with the reason.
    pub errors: Vec<String>,
    /// Reconciles done so far.
    pub reconciles: u64,
}

/// Programs routes from a desired set on a dedicated thread.
///
/// Nothing is touched until the first desired set arrives (a restarting agent
/// must not delete working routes before it knows the cluster). Dropping it
/// stops the worker and leaves the routes in place: pods keep their
/// connectivity across an agent restart.
pub struct RoutePlanner {
    desired: watch::Sender<Option<RouteSet>>,
    report: watch::Receiver<RouteSyncReport>,
}

impl RoutePlanner {
    /// Starts the worker thread; fails if the namespace cannot be entered or no
    /// netlink socket can be opened there.
    pub async fn start(config: RouteConfig) -> Result<Self> {
        let (desired_tx, desired_rx) = watch::channel(None);
        let (report_tx, report_rx) = watch::channel(RouteSyncReport::default());
        let (ready_tx, ready_rx) = oneshot::channel();
        let span = tracing::info_span!("routes", netns = ?config.netns);
        std::thread::Builder::new()
            .name("wp-routes".into())
            .spawn(move || route_worker(config, desired_rx, report_tx, ready_tx, span))
            .map_err(|e| Error::Internal(format!("spawning the route worker: {e}")))?;
        ready_rx.await.map_err(|_| Error::Internal("route worker ended during start-up".into()))??;
        Ok(RoutePlanner { desired: desired_tx, report: report_rx })
    }

    /// Replaces the desired set.
    pub fn set_desired(&self, routes: RouteSet) {
        self.desired.send_if_modified(|current| {
            let changed = current.as_ref() != Some(&routes);
            *current = Some(routes);
            changed
        });
    }

    /// The last reconcile's outcome.
    pub fn report(&self) -> RouteSyncReport {
        self.report.borrow().clone()
    }

    /// Follows reconcile outcomes.
    pub fn subscribe(&self) -> watch::Receiver<RouteSyncReport> {
        self.report.clone()
    }
}

/// Keeps this node's routes in line with the node registry and the remote
/// clusters' nodes it is given. Dropping it stops following (routes stay).
pub struct RouteSync {
    planner: Arc<RoutePlanner>,
    remote: RemoteNodes,
    follower: JoinHandle<()>,
}

impl RouteSync {
    /// Starts the route worker and follows `registry`.
    pub async fn start(registry: Arc<NodeRegistry>, config: RouteConfig) -> Result<Self> {
        let planner = Arc::new(RoutePlanner::start(config).await?);
        let (remote, remote_rx) = RemoteNodes::new();
        let span = tracing::info_span!("route_sync", node = %registry.name());
        let follower = tokio::spawn(follow_registry(registry, remote_rx, planner.clone()).instrument(span));
        Ok(RouteSync { planner, remote, follower })
    }

    /// Where other clusters' nodes are given (see [`follow_cluster_nodes`]).
    pub fn remote_nodes(&self) -> RemoteNodes {
        self.remote.clone()
    }

    pub fn report(&self) -> RouteSyncReport {
        self.planner.report()
    }

    pub fn subscribe(&self) -> watch::Receiver<RouteSyncReport> {
        self.planner.subscribe()
    }
}

impl Drop for RouteSync {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// The remote clusters' nodes routed to, each cluster's replaced whole by its follower.
pub type RemoteNodes = PerCluster<BTreeMap<String, NodeInfo>>;

/// Follows the node registry of another cluster (`shared`: its etcd's
/// [`crate::NODE_INFO_PREFIX`], followed) into `remote` under `cluster`, until
/// the store's batches end. Its nodes are kept through an outage (the store
/// relists), as this cluster's are.
pub async fn follow_cluster_nodes(shared: SharedStore, cluster: String, remote: RemoteNodes) {
    let mut batches = shared.batches();
    let mut nodes = BTreeMap::new();
    while let Some(batch) = batches.next().await {
        apply_batch(&mut nodes, batch);
        remote.set(&cluster, nodes.clone());
    }
}

/// One batch of a node registry's entries applied to `nodes`.
fn apply_batch(nodes: &mut BTreeMap<String, NodeInfo>, batch: SharedBatch) {
    match batch {
        SharedBatch::Snapshot(all) => {
            *nodes = decode_all(all.into_iter().map(|(name, entry)| (name, entry.value)));
        }
        SharedBatch::Changes(changes) => {
            for change in changes {
                match change {
                    SharedChange::Upsert { name, value, .. } => match decode_node_info(&name, &value) {
                        Some(info) => nodes.insert(name, info),
                        None => nodes.remove(&name),
                    },
                    SharedChange::Delete { name } => nodes.remove(&name),
                };
            }
        }
    }
}

async fn follow_registry(
    registry: Arc<NodeRegistry>,
    mut remote: watch::Receiver<RemoteNodeSet>,
    planner: Arc<RoutePlanner>,
) {
    let mut batches = registry.batches();
    let mut nodes = BTreeMap::new();
    // Nothing is planned before this cluster's registry has been read once.
    let Some(first) = batches.next().await else { return };
    apply_batch(&mut nodes, first);
    loop {
        let routes = desired_routes(&registry.local(), &nodes, &remote.borrow_and_update());
        planner.set_desired(routes);
        tokio::select! {
            batch = batches.next() => match batch {
                Some(batch) => apply_batch(&mut nodes, batch),
                None => return,
            },
            // The sender lives in the RouteSync that owns this task.
            Ok(()) = remote.changed() => {}
        }
    }
}

fn route_worker(
    config: RouteConfig,
    mut desired: watch::Receiver<Option<RouteSet>>,
    report: watch::Sender<RouteSyncReport>,
    ready: oneshot::Sender<Result<()>>,
    span: tracing::Span,
) {
    let _entered = span.enter();
    let started = (|| -> Result<(tokio::runtime::Runtime, Handle)> {
        if let Some(path) = &config.netns {
            enter_netns(path)?;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Internal(format!("route worker runtime: {e}")))?;
        // The socket is opened here, after setns: it belongs to the target namespace.
        let handle = runtime.block_on(async {
            let (connection, handle, _) =
                rtnetlink::new_connection().map_err(|e| Error::Internal(format!("opening a netlink socket: {e}")))?;
            tokio::spawn(connection);
            Ok::<_, Error>(handle)
        })?;
        Ok((runtime, handle))
    })();
    let (runtime, handle) = match started {
        Ok(started) => {
            let _ = ready.send(Ok(()));
            started
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    runtime.block_on(async move {
        let protocol = RouteProtocol::from(config.protocol);
        let mut reconciles = 0u64;
        loop {
            let wanted = desired.borrow_and_update().clone();
            if let Some(wanted) = wanted {
                let (applied, errors) = reconcile(&handle, protocol, &wanted).await;
                reconciles += 1;
                report.send_replace(RouteSyncReport { applied, errors, reconciles });
            }
            tokio::select! {
                changed = desired.changed() => if changed.is_err() {
                    debug!("route planner dropped; worker ends");
                    return;
                },
                () = tokio::time::sleep(config.resync_interval) => {}
            }
        }
    });
}

fn enter_netns(path: &PathBuf) -> Result<()> {
    let file =
        File::open(path).map_err(|e| Error::Netns { path: path.clone(), reason: format!("cannot open: {e}") })?;
    // SAFETY: a plain syscall on a descriptor we own; it changes only this
    // thread's network namespace, and this thread is dedicated to routes.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(Error::Netns { path: path.clone(), reason: format!("setns: {}", std::io::Error::last_os_error()) });
    }
    Ok(())
}

/// A route of ours found in the kernel.
struct OwnedRoute {
    gateway: Option<IpAddr>,
    message: RouteMessage,
}

/// Brings the kernel's routes of our protocol to `wanted`; returns what is
/// applied afterwards and the failures.
async fn reconcile(handle: &Handle, protocol: RouteProtocol, wanted: &RouteSet) -> (RouteSet, Vec<String>) {
    let mut errors = Vec::new();
    let mut current = match owned_routes(handle, protocol).await {
        Ok(current) => current,
        Err(e) => return (RouteSet::new(), vec![e.to_string()]),
    };
    let mut applied = RouteSet::new();
    for (cidr, gateway) in wanted {
        let existing = current.remove(cidr);
        if existing.as_ref().and_then(|r| r.gateway) == Some(*gateway) {
            applied.insert(*cidr, *gateway);
            continue;
        }
        // Replace only a route that is ours; a plain add fails (EEXIST) on
        // anyone else's route to the same destination, which we must not touch.
        match add_route(handle, protocol, *cidr, *gateway, existing.is_some()).await {
            Ok(()) => {
                info!(%cidr, via = %gateway, "route programmed");
                applied.insert(*cidr, *gateway);
            }
            Err(e) => {
                warn!(%cidr, via = %gateway, error = %e, "route not programmed");
                errors.push(format!("{cidr} via {gateway}: {e}"));
            }
        }
    }
    for (cidr, stale) in current {
        match delete_route(handle, stale.message).await {
            Ok(true) => info!(%cidr, "route removed"),
            Ok(false) => {}
            Err(e) => {
                warn!(%cidr, error = %e, "stale route not removed");
                errors.push(format!("removing {cidr}: {e}"));
                if let Some(gateway) = stale.gateway {
                    applied.insert(cidr, gateway);
                }
            }
        }
    }
    (applied, errors)
}

async fn add_route(
    handle: &Handle,
    protocol: RouteProtocol,
    cidr: IpNet,
    gateway: IpAddr,
    replace: bool,
) -> Result<()> {
    let invalid = |e: &dyn std::fmt::Display| Error::Internal(format!("route {cidr} via {gateway}: {e}"));
    let message = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(cidr.addr(), cidr.prefix_len())
        .map_err(|e| invalid(&e))?
        .gateway(gateway)
        .map_err(|e| invalid(&e))?
        .protocol(protocol)
        .table_id(u32::from(RouteHeader::RT_TABLE_MAIN))
        .build();
    let request = handle.route().add(message);
    let request = if replace { request.replace() } else { request };
    request.execute().await.map_err(|e| Error::netlink(format!("adding route {cidr} via {gateway}"), e))
}

/// Deletes every route of `protocol` in the main table of this process's network namespace
/// (`wasmplane cleanup`: what the route sync leaves behind when the agent is removed; routes
/// of any other protocol are never touched). Returns the destinations removed.
pub async fn remove_routes(protocol: u8) -> Result<Vec<IpNet>> {
    let (connection, handle, _) =
        rtnetlink::new_connection().map_err(|e| Error::Internal(format!("opening a netlink socket: {e}")))?;
    let connection = tokio::spawn(connection);
    let mut removed = Vec::new();
    let outcome = async {
        for (cidr, route) in owned_routes(&handle, RouteProtocol::from(protocol)).await? {
            if delete_route(&handle, route.message)
                .await
                .map_err(|e| Error::netlink(format!("removing the route to {cidr}"), e))?
            {
                removed.push(cidr);
            }
        }
        Ok(())
    }
    .await;
    connection.abort();
    outcome.map(|()| removed)
}

/// Deletes one route; `false` if it was gone already.
async fn delete_route(handle: &Handle, route: RouteMessage) -> std::result::Result<bool, rtnetlink::Error> {
    match handle.route().del(route).execute().await {
        Ok(()) => Ok(true),
        Err(e) if is_errno(&e, libc::ESRCH) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Our routes in the main table, IPv4 and IPv6.
async fn owned_routes(handle: &Handle, protocol: RouteProtocol) -> Result<BTreeMap<IpNet, OwnedRoute>> {
    let mut owned = BTreeMap::new();
    let queries = [RouteMessageBuilder::<Ipv4Addr>::new().build(), RouteMessageBuilder::<Ipv6Addr>::new().build()];
    for query in queries {
        let mut routes = handle.route().get(query).execute();
        while let Some(route) = routes.try_next().await.map_err(|e| Error::netlink("listing routes", e))? {
            if route.header.protocol != protocol || route_table(&route) != u32::from(RouteHeader::RT_TABLE_MAIN) {
                continue;
            }
            let Some(cidr) = destination(&route) else {
                continue;
            };
            let gateway = route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Gateway(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
                RouteAttribute::Gateway(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
                _ => None,
            });
            owned.insert(cidr, OwnedRoute { gateway, message: route });
        }
    }
    Ok(owned)
}

fn route_table(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table))
}

fn destination(route: &RouteMessage) -> Option<IpNet> {
    let len = route.header.destination_prefix_length;
    let addr = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
        RouteAttribute::Destination(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
        _ => None,
    })?;
    IpNet::new(addr, len).ok()
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -errno)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, id: u32, ips: &[&str], cidrs: &[&str]) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            id,
            node_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            pod_cidrs: cidrs.iter().map(|s| s.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn desired_routes_pair_families_and_skip_conflicts() {
        let me = node("a", 1, &["192.168.1.1"], &["10.244.1.0/24"]);
        let nodes: BTreeMap<String, NodeInfo> = [
            me.clone(),
            node("b", 2, &["fd00::2", "192.168.1.2"], &["10.244.2.0/24", "fd10:2::/64"]),
            // Claims b's CIDR with a higher ID, and overlaps ours: neither routed.
            node("c", 3, &["192.168.1.3"], &["10.244.2.0/24", "10.244.1.128/25"]),
            // No IPv6 address for its IPv6 CIDR.
            node("d", 4, &["192.168.1.4"], &["fd10:4::/64", "10.244.4.0/24"]),
        ]
        .into_iter()
        .map(|n| (n.name.clone(), n))
        .collect();
        let routes = desired_routes(&me, &nodes, &RemoteNodeSet::new());
        let expected: RouteSet =
            [("10.244.2.0/24", "192.168.1.2"), ("fd10:2::/64", "fd00::2"), ("10.244.4.0/24", "192.168.1.4")]
                .into_iter()
                .map(|(c, g)| (c.parse().unwrap(), g.parse().unwrap()))
                .collect();
        assert_eq!(routes, expected);
    }

    #[test]
    fn remote_clusters_nodes_are_routed_after_this_clusters_without_overlaps() {
        let me = node("a", 1, &["192.168.1.1"], &["10.244.1.0/24"]);
        let nodes: BTreeMap<String, NodeInfo> = [me.clone(), node("b", 2, &["192.168.1.2"], &["10.244.2.0/24"])]
            .into_iter()
            .map(|n| (n.name.clone(), n))
            .collect();
        let cluster = |list: Vec<NodeInfo>| -> BTreeMap<String, NodeInfo> {
            list.into_iter().map(|n| (n.name.clone(), n)).collect()
        };
        let remote: RemoteNodeSet = [
            (
                "east".to_string(),
                cluster(vec![
                    // Another cluster's node may have a local node's name (and ID).
                    node("a", 1, &["192.168.2.1"], &["10.245.1.0/24", "fd10:e1::/64"]),
                    // Inside this cluster's node b's CIDR: not routed away from b.
                    node("x", 2, &["192.168.2.2"], &["10.244.2.128/25"]),
                ]),
            ),
            (
                "north".to_string(),
                cluster(vec![
                    // Overlaps east's: east (first by name) keeps it.
                    node("n1", 1, &["192.168.3.1"], &["10.245.0.0/16"]),
                    node("n2", 2, &["192.168.3.2", "fd00::32"], &["10.246.2.0/24", "fd10:32::/64"]),
                    // Overlaps this node's own.
                    node("n3", 3, &["192.168.3.3"], &["10.244.1.64/26"]),
                ]),
            ),
        ]
        .into_iter()
        .collect();
        let routes = desired_routes(&me, &nodes, &remote);
        let expected: RouteSet = [
            ("10.244.2.0/24", "192.168.1.2"),
            ("10.245.1.0/24", "192.168.2.1"),
            ("10.246.2.0/24", "192.168.3.2"),
            ("fd10:32::/64", "fd00::32"),
        ]
        .into_iter()
        .map(|(c, g)| (c.parse().unwrap(), g.parse().unwrap()))
        .collect();
        assert_eq!(routes, expected, "east's fd10:e1::/64 has no IPv6 node IP");
    }
}
