//! The node registry (agent side).
//!
//! - Node IDs: `<ids prefix><id>` holds the node name, one key per ID, created
//!   with compare-and-create, so of two nodes racing for one ID exactly one gets
//!   it. A node first looks for a key holding its own name, so it keeps its ID
//!   across restarts without persisting anything locally. ID keys have no lease:
//!   an ID outlives a node's absence (a reboot must not renumber it); freeing the
//!   IDs of decommissioned nodes is a GC decision ([`release_node_id`]).
//! - Node info: `<info prefix><name>` holds [`NodeInfo`] as JSON, attached to the
//!   node's lease and kept alive through a [`SharedStore`], which also keeps every
//!   node's view of all the others (the routes follow it). A node that dies
//!   disappears from the prefix when its lease expires.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};
use wasmplane_kvstore::{Bytes, KvStore, SharedBatches, SharedStore, SharedStoreConfig};

use crate::error::{Error, Result};

/// Where node IDs live by default.
pub const NODE_IDS_PREFIX: &str = "/wasmplane/nodes/ids/";
/// Where node info lives by default.
pub const NODE_INFO_PREFIX: &str = "/wasmplane/nodes/info/";

/// What a node publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeInfo {
    pub name: String,
    /// Cluster-wide node ID (first free positive integer at first registration).
    pub id: u32,
    /// Addresses other nodes reach this node at (route gateways).
    pub node_ips: Vec<IpAddr>,
    /// Pod CIDRs allocated to this node.
    pub pod_cidrs: Vec<IpNet>,
}

/// How a node registers.
#[derive(Debug, Clone)]
pub struct NodeRegistryConfig {
    pub ids_prefix: String,
    pub info_prefix: String,
    /// TTL of the lease holding the node info: how long it outlives the node.
    pub lease_ttl: Duration,
}

impl Default for NodeRegistryConfig {
    fn default() -> Self {
        NodeRegistryConfig {
            ids_prefix: NODE_IDS_PREFIX.into(),
            info_prefix: NODE_INFO_PREFIX.into(),
            lease_ttl: Duration::from_secs(15),
        }
    }
}

/// Allocation attempts before giving up (each is one listing plus a few
/// compare-and-creates); only a store changing faster than we can read it
/// exhausts them.
const ALLOCATION_ROUNDS: usize = 100;
/// Compare-and-creates per listing before relisting.
const CREATES_PER_ROUND: usize = 32;

/// Returns this node's ID: the one already registered under its name, or the
/// first free positive integer, claimed with compare-and-create.
pub async fn allocate_node_id(store: &dyn KvStore, ids_prefix: &str, node: &str) -> Result<u32> {
    if node.is_empty() {
        return Err(Error::InvalidConfig("node name is empty".into()));
    }
    for _ in 0..ALLOCATION_ROUNDS {
        let listing = store.list_prefix(ids_prefix).await.map_err(|e| Error::kv("listing node IDs", e))?;
        let mut taken = BTreeSet::new();
        let mut mine = None;
        for kv in &listing.items {
            let Some(id) = kv.key.strip_prefix(ids_prefix).and_then(|s| s.parse::<u32>().ok()).filter(|id| *id > 0)
            else {
                warn!(key = %kv.key, "ignoring a malformed node ID key");
                continue;
            };
            taken.insert(id);
            if kv.value.as_ref() == node.as_bytes() {
                // Lowest wins should an earlier crash have left two.
                mine = Some(mine.map_or(id, |m: u32| m.min(id)));
            }
        }
        if let Some(id) = mine {
            debug!(node, id, "node ID already registered");
            return Ok(id);
        }
        let mut candidate = 1u32;
        for _ in 0..CREATES_PER_ROUND {
            while taken.contains(&candidate) {
                candidate = candidate
                    .checked_add(1)
                    .ok_or_else(|| Error::NodeIdAllocation { node: node.into(), reason: "no free ID left".into() })?;
            }
            let key = format!("{ids_prefix}{candidate}");
            let created = store
                .create(&key, Bytes::copy_from_slice(node.as_bytes()), None)
                .await
                .map_err(|e| Error::kv(format!("claiming node ID {candidate}"), e))?;
            if created.won {
                info!(node, id = candidate, "allocated node ID");
                return Ok(candidate);
            }
            // Someone else got it; try the next free one we know of.
            taken.insert(candidate);
        }
    }
    Err(Error::NodeIdAllocation {
        node: node.into(),
        reason: format!("the ID space kept changing for {ALLOCATION_ROUNDS} rounds"),
    })
}

/// Frees a decommissioned node's ID, only if it still belongs to `node`.
pub async fn release_node_id(store: &dyn KvStore, ids_prefix: &str, node: &str, id: u32) -> Result<bool> {
    let key = format!("{ids_prefix}{id}");
    let Some(kv) = store.get(&key).await.map_err(|e| Error::kv(format!("reading node ID {id}"), e))? else {
        return Ok(false);
    };
    if kv.value.as_ref() != node.as_bytes() {
        return Ok(false);
    }
    match store.delete_if_revision(&key, kv.mod_revision).await {
        Ok(_) => Ok(true),
        Err(wasmplane_kvstore::KvError::Conflict { .. }) => Ok(false),
        Err(e) => Err(Error::kv(format!("releasing node ID {id}"), e)),
    }
}

/// This node's membership: its ID, its published info, and the view of every
/// node. Dropping it stops the keep-alive (the info expires with the lease);
/// [`NodeRegistry::leave`] removes it at once.
pub struct NodeRegistry {
    shared: SharedStore,
    name: String,
    id: u32,
    /// Addresses and CIDRs change at run time; name and ID never do.
    local: Mutex<NodeInfo>,
}

impl NodeRegistry {
    /// Allocates (or finds) the node ID, then publishes the node info under a
    /// lease. The view of other nodes is complete when this returns.
    pub async fn join(
        store: Arc<dyn KvStore>,
        config: NodeRegistryConfig,
        name: &str,
        node_ips: Vec<IpAddr>,
        pod_cidrs: Vec<IpNet>,
    ) -> Result<Self> {
        let id = allocate_node_id(store.as_ref(), &config.ids_prefix, name).await?;
        let mut shared_config = SharedStoreConfig::new(config.info_prefix.clone());
        shared_config.lease_ttl = config.lease_ttl;
        let shared =
            SharedStore::join(store, shared_config).await.map_err(|e| Error::kv("joining the node info prefix", e))?;
        let local = NodeInfo { name: name.into(), id, node_ips, pod_cidrs };
        let registry = NodeRegistry { shared, name: name.into(), id, local: Mutex::new(local) };
        registry.publish().await?;
        Ok(registry)
    }

    async fn publish(&self) -> Result<()> {
        let value =
            serde_json::to_vec(&self.local()).map_err(|e| Error::Internal(format!("encoding node info: {e}")))?;
        // A failed first write is retried by the shared store's own loop.
        if let Err(e) = self.shared.update_local(&self.name, Bytes::from(value)).await {
            warn!(error = %e, "publishing node info failed; it is retried in the background");
        }
        Ok(())
    }

    pub fn node_id(&self) -> u32 {
        self.id
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What this node publishes.
    pub fn local(&self) -> NodeInfo {
        self.local.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Changes this node's addresses or pod CIDRs.
    pub async fn update(&self, node_ips: Vec<IpAddr>, pod_cidrs: Vec<IpNet>) -> Result<()> {
        {
            let mut local = self.local.lock().unwrap_or_else(PoisonError::into_inner);
            local.node_ips = node_ips;
            local.pod_cidrs = pod_cidrs;
        }
        self.publish().await
    }

    /// Every registered node (this one included once its write landed).
    pub fn nodes(&self) -> BTreeMap<String, NodeInfo> {
        decode_all(self.shared.snapshot().into_iter().map(|(k, e)| (k, e.value)))
    }

    /// Every node's entry, then the changes in batches ([`SharedStore::batches`]); decode
    /// them with [`decode_node_info`].
    pub fn batches(&self) -> SharedBatches {
        self.shared.batches()
    }

    /// Leaves the cluster now: revokes the lease, so the info disappears at
    /// once. The node ID stays reserved for this name.
    pub async fn leave(self) -> Result<()> {
        self.shared.close().await.map_err(|e| Error::kv("revoking the node lease", e))
    }
}

/// Decodes one node-info value; `None` (logged) for a malformed one.
pub fn decode_node_info(name: &str, value: &[u8]) -> Option<NodeInfo> {
    match serde_json::from_slice::<NodeInfo>(value) {
        Ok(info) if info.name == name => Some(info),
        Ok(info) => {
            warn!(key = name, claimed = %info.name, "node info under another node's name; ignored");
            None
        }
        Err(e) => {
            warn!(key = name, error = %e, "malformed node info; ignored");
            None
        }
    }
}

pub(crate) fn decode_all(entries: impl Iterator<Item = (String, Bytes)>) -> BTreeMap<String, NodeInfo> {
    entries.filter_map(|(name, value)| decode_node_info(&name, &value).map(|info| (name, info))).collect()
}
