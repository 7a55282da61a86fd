//! Cluster-wide duties of wasmplane (issue 7).
//!
//! - [`leader`]: leader election on a Kubernetes Lease, and running duties only
//!   while leading ([`Leadership::run_while_leading`]); [`Leadership::always`]
//!   for embedded mode.
//! - [`nodes`]: the node registry (agent side): a cluster-wide node ID per node,
//!   allocated by compare-and-create, and the node's addresses and pod CIDRs
//!   published under a lease.
//! - [`routes`]: routes to other nodes' pod CIDRs via their node IPs, programmed
//!   with rtnetlink from the registry and marked with our own route protocol.
//! - [`heartbeat`]: the leader's heartbeat key and the staleness check agents
//!   use for `/readyz`.
//! - [`policystatus`]: per-node policy status written by agents, aggregated by
//!   the leader into one rate-limited write per policy.
//! - [`services`]: Services annotated for sharing, synced into the kvstore
//!   under this cluster's prefix, stale entries cleaned on every relist.
//! - [`operator`]: the operator role in one call ([`Operator::start`]): every
//!   duty above that the leader runs, the service sync and the mesh slice sync
//!   on one Service watch (`servicewatch`).
//! - [`gc`]: the GC duty: candidates from the kvstore, a decider (the GC
//!   guest) naming what to delete, deletions of offered keys only, rate-limited.

pub mod error;
pub mod gc;
pub mod heartbeat;
pub mod leader;
pub mod meshslices;
pub mod nodes;
pub mod operator;
pub mod per_cluster;
pub mod policystatus;
pub mod routes;
pub mod services;
mod servicewatch;

pub use error::{Error, Result};
pub use gc::{
    CandidateKind, DeciderError, GarbageCollector, GcCandidate, GcConfig, GcDecider, GcReport, GcStats, GcStatus,
    LOCKS_PREFIX,
};
pub use heartbeat::{HEARTBEAT_KEY, Heartbeat, HeartbeatMonitor, heartbeat_is_stale, write_heartbeats};
pub use leader::{LeaderElectionConfig, LeaderElector, Leadership};
pub use meshslices::{
    ExportSet, MESH_SLICE_CONTROLLER, MeshSliceConfig, RemoteExports, SYNC_SLICES_ANNOTATION, cluster_exports_prefix,
    follow_cluster_exports, is_mesh_slice, sync_mesh_slices,
};
pub use nodes::{NODE_INFO_PREFIX, NodeInfo, NodeRegistry, NodeRegistryConfig, allocate_node_id, release_node_id};
pub use operator::{Operator, OperatorConfig};
pub use per_cluster::PerCluster;
pub use policystatus::{
    AggregatorConfig, NodePolicyStatus, NodeStatusWriter, PolicyRef, PolicyStatusAggregator, PolicySummary,
    read_summary,
};
pub use routes::{
    DEFAULT_ROUTE_PROTOCOL, RemoteNodeSet, RemoteNodes, RouteConfig, RoutePlanner, RouteSync, RouteSyncReport,
    desired_routes, follow_cluster_nodes, remove_routes,
};
pub use services::{
    CLUSTERS_PREFIX, ExportError, GLOBAL_SERVICE_ANNOTATION, SHARED_SERVICE_ANNOTATION, ServiceSyncConfig, SharedPort,
    SharedService, SharedSlice, sync_services,
};
