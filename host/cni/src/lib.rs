//! The CNI daemon inside the host.
//!
//! The thin `wasmplane-cni` executable turns one CNI invocation into one `POST /v1/cni` on
//! a unix socket; this crate answers it: it waits (bounded) until the pod is in the host's
//! watch cache, allocates an address from each of the node's pod CIDRs (IPv4, IPv6 or both;
//! persisted), creates the veth pair into the pod's network namespace with its addresses
//! and routes (and the MTU given, or that of the node's default route's device), reports the addresses to the host at once, and replies with the spec's result or error object. Of spec 1.1.0
//! it answers STATUS (not available while the watch cache has not synced or the pod CIDR is
//! full) and GC (releases the addresses and interfaces of attachments the runtime no longer
//! has, sparing young ones).
//!
//! Chained after another plugin ([`DaemonConfig::chained`], Cilium's generic-veth chaining),
//! that plugin gives pods their interface and addresses: ADD reports the addresses of its
//! `prevResult` to the host and hands that result back; nothing is allocated or created.
//! What each ADD reported is recorded (persisted beside the allocations, see [`ChainedAttachments`]), so
//! DEL takes exactly that out of the model again, with or without a `prevResult`, and GC
//! takes out that of attachments the runtime no longer lists (sparing young ones, as above).
//!
//! ```no_run
//! # async fn f() -> Result<(), wasmplane_cni::Error> {
//! use std::sync::Arc;
//! use wasmplane_cni::{CniDaemon, DaemonConfig, PodCache, PodNetworks};
//! let cidrs = vec!["10.244.1.0/24".parse().unwrap(), "fd00:10:244:1::/64".parse().unwrap()];
//! let config = DaemonConfig::new(cidrs, "/var/lib/wasmplane/cni".into());
//! let daemon = CniDaemon::new(config, Arc::new(PodCache::new()), Arc::new(PodNetworks::new()))?;
//! let handle = daemon.spawn().await?; // serves until...
//! handle.shutdown().await;
//! # Ok(()) }
//! ```

mod chained;
mod durable;
mod error;
mod ipam;
mod link;
mod mtu;
mod pods;
mod protocol;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ipnet::IpNet;
use serde_json::Value;

pub use chained::{CHAINED_STATE_FILE, ChainedAttachment, ChainedAttachments};
pub use error::{CniErrorReply, Error, code};
pub use ipam::{Allocation, Ipam, Pool};
pub use link::host_if_name;
pub use mtu::{PodMtu, check_mtu};
pub use pods::{AnyPod, BoxFuture, PodCache, PodDirectory, PodInfo, PodNetworkSink, PodNetworks};
pub use protocol::{
    Attachment, CniRequest, Command, DEFAULT_SOCKET, NetConf, PodAddress, PodNetwork, PodRef, SUPPORTED_VERSIONS,
    parse_pod_args, version_at_least,
};

/// How the daemon runs on this node.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// The unix socket the plugin talks to.
    pub socket_path: PathBuf,
    /// Where allocations (when chained: the attachments reported) are persisted.
    pub state_dir: PathBuf,
    /// The node's pod CIDRs (`spec.podCIDRs`: one per family, the primary family first);
    /// the first address of each is the pods' gateway of that family.
    pub pod_cidrs: Vec<IpNet>,
    /// How long ADD waits for a pod that is not in the watch cache yet.
    pub pod_wait_timeout: Duration,
    /// The network namespace to do the node side in; `None` (production): the daemon's own.
    /// Tests point it at a namespace standing in for the node.
    pub host_netns: Option<PathBuf>,
    /// MTU of both veth ends (checked by [`check_mtu`]); `None`: that of the device of the
    /// node's default route (IPv4's, else IPv6's; the lowest metric's), read when the daemon
    /// starts, or the kernel default when the node has none. Ignored when chained.
    pub mtu: Option<u32>,
    /// Turn on forwarding in the node namespace at start (IPv6's too with an IPv6 pod CIDR):
    /// pods reach each other and the world through the node's routing (as the reference
    /// bridge plugin's isGateway).
    pub enable_ip_forward: bool,
    /// GC keeps allocations (chained: reported attachments) younger than this even when the
    /// runtime does not list them: its list may have been taken before an ADD that finished
    /// since.
    pub gc_grace: Duration,
    /// Chained after the plugin that gives pods their interface and addresses (AWS VPC CNI,
    /// flannel...): the daemon learns a pod's addresses from its ADD's `prevResult` and
    /// allocates, creates and turns on nothing; that plugin owns the node's networking.
    /// Takes no pod CIDRs.
    pub chained: bool,
}

impl DaemonConfig {
    pub fn new(pod_cidrs: Vec<IpNet>, state_dir: PathBuf) -> DaemonConfig {
        DaemonConfig {
            socket_path: DEFAULT_SOCKET.into(),
            state_dir,
            pod_cidrs,
            pod_wait_timeout: Duration::from_secs(10),
            host_netns: None,
            mtu: None,
            enable_ip_forward: true,
            gc_grace: Duration::from_secs(60),
            chained: false,
        }
    }
}

/// The daemon: configuration, allocator (chained: what ADDs reported), and the host's two
/// hooks.
pub struct CniDaemon {
    config: DaemonConfig,
    /// None when chained: the other plugin allocates.
    ipam: Option<Arc<Ipam>>,
    /// Only when chained.
    chained: Option<Arc<ChainedAttachments>>,
    pods: Arc<dyn PodDirectory>,
    sink: Arc<dyn PodNetworkSink>,
    /// One operation at a time per (container, interface): a DEL racing an ADD retry must
    /// not interleave with it.
    in_flight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The pods' MTU, settled by [`CniDaemon::spawn`]; never when chained.
    pod_mtu: OnceLock<PodMtu>,
}

impl CniDaemon {
    /// Opens the allocation state (recovering earlier allocations); when chained, the record
    /// of the attachments reported instead.
    pub fn new(
        config: DaemonConfig,
        pods: Arc<dyn PodDirectory>,
        sink: Arc<dyn PodNetworkSink>,
    ) -> Result<Arc<CniDaemon>, Error> {
        let (ipam, chained) = if config.chained {
            if !config.pod_cidrs.is_empty() {
                return Err(Error::InvalidConfig(format!(
                    "pod CIDRs {:?} given to a chained daemon, which allocates nothing",
                    config.pod_cidrs
                )));
            }
            (None, Some(Arc::new(ChainedAttachments::open(&config.state_dir)?)))
        } else {
            if let Some(mtu) = config.mtu {
                check_mtu(mtu, &config.pod_cidrs)?;
            }
            (Some(Arc::new(Ipam::open(&config.state_dir, &config.pod_cidrs)?)), None)
        };
        Ok(Arc::new(CniDaemon {
            config,
            ipam,
            chained,
            pods,
            sink,
            in_flight: Mutex::default(),
            pod_mtu: OnceLock::new(),
        }))
    }

    pub fn config(&self) -> &DaemonConfig {
        &self.config
    }

    /// The pods' MTU and where it came from, once [`CniDaemon::spawn`] settled it; never
    /// when chained (the other plugin's interfaces are not ours to size).
    pub fn pod_mtu(&self) -> Option<&PodMtu> {
        self.pod_mtu.get()
    }

    /// The MTU both veth ends get; `None`: the kernel default (and always when chained).
    pub fn mtu(&self) -> Option<u32> {
        if self.config.chained {
            return None;
        }
        // Not spawned (requests handled directly): as configured, nothing detected.
        self.pod_mtu.get().map_or(self.config.mtu, PodMtu::mtu)
    }

    /// As configured, or detected from the node's default route (once: at start).
    async fn settle_mtu(&self) -> Result<PodMtu, Error> {
        if let Some(mtu) = self.config.mtu {
            return Ok(PodMtu::Configured(mtu));
        }
        let device = link::default_route_device(self.config.host_netns.clone()).await?;
        Ok(PodMtu::detected(device, &self.config.pod_cidrs))
    }

    /// The daemon at a glance (the host's `GET /v1/status`): chained or not, the pods' MTU,
    /// per pod CIDR how many of its addresses are handed out, and when chained how many
    /// attachments' addresses it reported.
    pub fn summary(&self) -> DaemonSummary {
        let allocations = self.ipam().map(Ipam::all).unwrap_or_default();
        let pools = self
            .pools()
            .iter()
            .map(|pool| PoolUsage {
                cidr: pool.cidr.to_string(),
                allocated: allocations.iter().filter(|a| a.ips.iter().any(|ip| pool.cidr.contains(ip))).count(),
                capacity: pool.capacity(),
            })
            .collect();
        let attachments = self.chained_attachments().map(ChainedAttachments::len);
        DaemonSummary { chained: self.config.chained, mtu: self.mtu(), pools, attachments }
    }

    /// The allocator; none when chained.
    pub fn ipam(&self) -> Option<&Ipam> {
        self.ipam.as_deref()
    }

    /// The attachments whose addresses a chained ADD reported; none when not chained.
    pub fn chained_attachments(&self) -> Option<&ChainedAttachments> {
        self.chained.as_deref()
    }

    /// The chained attachments, for the code of a chained daemon.
    fn chained_store(&self) -> Result<&Arc<ChainedAttachments>, Error> {
        self.chained
            .as_ref()
            .ok_or_else(|| Error::Internal("a daemon that is not chained records no chained attachments".into()))
    }

    /// The pod CIDRs with their gateways; none when chained.
    fn pools(&self) -> &[Pool] {
        self.ipam.as_deref().map_or(&[], Ipam::pools)
    }

    /// The allocator, for the code of a daemon that is not chained.
    fn allocator(&self) -> Result<&Arc<Ipam>, Error> {
        self.ipam.as_ref().ok_or_else(|| Error::Internal("a chained daemon has no allocator".into()))
    }

    /// Binds the socket (replacing a stale one) and serves until the handle is shut down.
    /// Must run inside a tokio runtime.
    pub async fn spawn(self: Arc<Self>) -> Result<DaemonHandle, Error> {
        // Chained, the primary plugin owns the node's networking, forwarding included.
        if self.config.enable_ip_forward && !self.config.chained {
            let ipv6 = self.pools().iter().any(|p| p.cidr.addr().is_ipv6());
            link::enable_forwarding(self.config.host_netns.clone(), ipv6).await?;
        }
        if !self.config.chained {
            let mtu = self.settle_mtu().await?;
            let _ = self.pod_mtu.set(mtu);
        } else if let Some(mtu) = self.config.mtu {
            tracing::warn!(mtu, "chained: the pods' interfaces are the other plugin's, the MTU given is ignored");
        }
        self.release_stale().await?;
        let path = self.config.socket_path.clone();
        let listener = bind(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = self.router();
        let task = tokio::spawn(async move {
            if let Err(e) =
                axum::serve(listener, app).with_graceful_shutdown(async move { rx.await.unwrap_or(()) }).await
            {
                tracing::error!(error = %e, "CNI socket server failed");
            }
        });
        let cidrs: Vec<String> = self.pools().iter().map(|p| p.cidr.to_string()).collect();
        let mtu = self.pod_mtu().map_or_else(|| "the other plugin's".to_string(), PodMtu::to_string);
        tracing::info!(socket = %path.display(), ?cidrs, chained = self.config.chained, %mtu, "CNI daemon listening");
        Ok(DaemonHandle { stop: Some(tx), task, socket_path: path })
    }

    /// Releases allocations whose node-side interface is gone: their pod's namespace was
    /// destroyed (which takes the veth pair with it) while no DEL reached us, e.g. the
    /// daemon was down. Run before serving, so no ADD is between allocation and veth.
    async fn release_stale(&self) -> Result<(), Error> {
        let Some(ipam) = &self.ipam else {
            return Ok(());
        };
        let allocations = ipam.all();
        if allocations.is_empty() {
            return Ok(());
        }
        let present = link::link_names(self.config.host_netns.clone()).await?;
        for a in allocations {
            let host_if = host_if_name(&a.container_id, &a.if_name);
            if present.contains(&host_if) {
                continue;
            }
            tracing::warn!(ips = ?a.ips, container = %a.container_id, %host_if, "releasing the addresses of a pod whose interface is gone");
            let (ipam, ctr, ifn) = (ipam.clone(), a.container_id.clone(), a.if_name.clone());
            blocking(move || ipam.release(&ctr, &ifn)).await?;
            if let (Some(ns), Some(name)) = (&a.pod_namespace, &a.pod_name) {
                self.sink.pod_network_removed(ns, name, &a.ips);
            }
        }
        Ok(())
    }

    /// `GET /healthz`, `POST /v1/cni` (body: [`CniRequest`]) and `GET /v1/allocations`
    /// (the pod CIDRs, their gateways, every allocation and the pods' MTU, none when
    /// chained; then the attachments reported: for debugging a node).
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/v1/cni", post(cni_handler))
            .route("/v1/allocations", get(allocations_handler))
            .with_state(self.clone())
    }

    /// One CNI command: `Ok(Some(result))` for ADD, `Ok(None)` for the others. The error
    /// carries the CNI version to reply in.
    pub async fn handle(&self, req: &CniRequest) -> Result<Option<Value>, (String, Error)> {
        let conf = NetConf::parse(&req.config).map_err(|e| (version_of(&req.config), e))?;
        let version = conf.cni_version.clone();
        self.dispatch(req, &conf).await.map_err(|e| (version, e))
    }

    async fn dispatch(&self, req: &CniRequest, conf: &NetConf) -> Result<Option<Value>, Error> {
        let since = req.command.since();
        if !version_at_least(&conf.cni_version, since) {
            return Err(Error::IncompatibleVersion(format!(
                "{} ({} needs {since} or later)",
                conf.cni_version,
                req.command.as_str()
            )));
        }
        let chained = self.config.chained;
        match req.command {
            Command::Status => return self.status().map(|()| None),
            Command::Gc => return self.gc(conf).await.map(|()| None),
            _ => {}
        }
        validate_env(req)?;
        self.exclusively(&req.container_id, &req.if_name, async {
            match req.command {
                Command::Add if chained => self.add_chained(req, conf).await.map(Some),
                Command::Add => self.add(req, conf).await.map(Some),
                Command::Del if chained => self.del_chained(req, conf).await.map(|()| None),
                Command::Del => self.remove_attachment(&req.container_id, &req.if_name).await.map(|_| None),
                // Chained, nothing of ours to check beyond what the pod stands on.
                Command::Check if chained => conf.previous_addresses().map(|_| None),
                Command::Check => self.check(req, conf).await.map(|()| None),
                Command::Status | Command::Gc => unreachable!("answered above"),
            }
        })
        .await
    }

    /// Runs `op` as the only operation on the attachment `(container_id, if_name)`.
    async fn exclusively<T>(&self, container_id: &str, if_name: &str, op: impl std::future::Future<Output = T>) -> T {
        let key = format!("{container_id}/{if_name}");
        let lock = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).entry(key.clone()).or_default().clone();
        let guard = lock.lock().await;
        let result = op.await;
        drop(guard);
        drop(lock);
        let mut map = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&key).is_some_and(|l| Arc::strong_count(l) == 1) {
            map.remove(&key);
        }
        result
    }

    /// STATUS: whether an ADD can be served now.
    fn status(&self) -> Result<(), Error> {
        if !self.pods.synced() {
            return Err(Error::NotAvailable(
                "the watch cache has not synced yet (an ADD would wait for its pod)".into(),
            ));
        }
        if let Some(cidr) = self.ipam.as_ref().and_then(|ipam| ipam.exhausted()) {
            return Err(Error::NotAvailable(format!("no free address left in the pod CIDR {cidr}")));
        }
        Ok(())
    }

    /// GC: releases every attachment the runtime no longer lists (and older than the
    /// grace period), as a DEL would; chained, takes their reported addresses out of the
    /// model. Goes on past failures and reports them together.
    async fn gc(&self, conf: &NetConf) -> Result<(), Error> {
        // Without the list nothing is known to be valid: releasing everything is not GC.
        let valid = conf
            .valid_attachments
            .as_ref()
            .ok_or_else(|| Error::InvalidConfig("GC needs cni.dev/valid-attachments".into()))?;
        let staleness = Staleness::new(valid, self.config.gc_grace);
        let (released, failures) = if self.config.chained {
            self.gc_chained(&staleness).await?
        } else {
            self.gc_allocations(&staleness).await?
        };
        if failures.is_empty() {
            tracing::debug!(released, valid = valid.len(), "GC");
            Ok(())
        } else {
            Err(Error::GcIncomplete(format!("released {released}, failed {}: {}", failures.len(), failures.join("; "))))
        }
    }

    /// GC of the allocator: how many it released, and what failed.
    async fn gc_allocations(&self, staleness: &Staleness<'_>) -> Result<(usize, Vec<String>), Error> {
        let ipam = self.allocator()?;
        Ok(self
            .gc_stale(
                staleness,
                ipam.all(),
                |ctr, ifn| ipam.get(ctr, ifn),
                |a| async move { self.remove_attachment(&a.container_id, &a.if_name).await },
                |a| tracing::info!(ips = ?a.ips, container = %a.container_id, if_name = %a.if_name, "GC released a stale attachment"),
            )
            .await)
    }

    /// GC of the chained attachments: the addresses of each stale one leave the model, as a
    /// DEL would take them out. How many, and what failed.
    async fn gc_chained(&self, staleness: &Staleness<'_>) -> Result<(usize, Vec<String>), Error> {
        let store = self.chained_store()?;
        Ok(self
            .gc_stale(
                staleness,
                store.all(),
                |ctr, ifn| store.get(ctr, ifn),
                |a| async move { self.forget_chained(store, a).await.map(Some) },
                |a| tracing::info!(ips = ?a.ips, container = %a.container_id, if_name = %a.if_name, namespace = %a.pod_namespace, pod = %a.pod_name, "GC took a stale chained attachment's addresses out of the model"),
            )
            .await)
    }

    /// Releases each record of `records` that is stale: `current` looks it up again and
    /// `release` releases that (`None`: nothing was left to release); `released` logs what
    /// was. How many were released, and what failed.
    async fn gc_stale<R: Recorded, F: std::future::Future<Output = Result<Option<R>, Error>>>(
        &self,
        staleness: &Staleness<'_>,
        records: Vec<R>,
        current: impl Fn(&str, &str) -> Option<R>,
        release: impl Fn(R) -> F,
        released: impl Fn(&R),
    ) -> (usize, Vec<String>) {
        let mut failures = Vec::new();
        let mut count = 0;
        let now = SystemTime::now();
        let stale: Vec<R> = records.into_iter().filter(|a| staleness.of(a, now)).collect();
        for stale in stale {
            let (ctr, ifn) = stale.attachment();
            // Under the attachment's lock, looked at again: an ADD may have run meanwhile.
            let result = self
                .exclusively(ctr, ifn, async {
                    match current(ctr, ifn) {
                        Some(current) if staleness.of(&current, SystemTime::now()) => release(current).await,
                        _ => Ok(None),
                    }
                })
                .await;
            match result {
                Ok(Some(a)) => {
                    released(&a);
                    count += 1;
                }
                Ok(None) => {}
                Err(e) => failures.push(format!("{ctr}/{ifn}: {e}")),
            }
        }
        (count, failures)
    }

    /// Takes a chained attachment's reported addresses out of the model and its record out of
    /// the store. The model first: should the write fail, the runtime's retried DEL (or the
    /// next GC) finds no record but has nothing left to take out; the sink forgets a pod only
    /// while it has exactly these addresses, so doing it twice is harmless.
    async fn forget_chained(
        &self,
        store: &Arc<ChainedAttachments>,
        a: ChainedAttachment,
    ) -> Result<ChainedAttachment, Error> {
        self.sink.pod_network_removed(&a.pod_namespace, &a.pod_name, &a.ips);
        let (store, ctr, ifn) = (store.clone(), a.container_id.clone(), a.if_name.clone());
        blocking(move || store.remove(&ctr, &ifn)).await?;
        Ok(a)
    }

    /// The pod named in `CNI_ARGS` (if any), once it is in the watch cache.
    async fn pod_in_cache(&self, req: &CniRequest) -> Result<Option<PodRef>, Error> {
        let pod = parse_pod_args(&req.args)?;
        if let Some(p) = &pod {
            let timeout = self.config.pod_wait_timeout;
            if self.pods.wait_for_pod(p, timeout).await.is_none() {
                return Err(Error::PodNotInCache {
                    namespace: p.namespace.clone(),
                    name: p.name.clone(),
                    waited: timeout,
                });
            }
        }
        Ok(pod)
    }

    /// Chained ADD: the addresses the previous plugin gave the pod go to the host, and its
    /// result goes back unchanged but for the version (the spec's rule for a plugin that
    /// changes nothing).
    async fn add_chained(&self, req: &CniRequest, conf: &NetConf) -> Result<Value, Error> {
        let ips = conf.previous_addresses()?;
        if let Some(p) = self.pod_in_cache(req).await? {
            // Recorded before the host has them: a record without addresses in the model
            // (the write done, the daemon gone) costs a no-op removal later; addresses
            // without a record would stay in the model for good.
            let record = ChainedAttachment {
                container_id: req.container_id.clone(),
                if_name: req.if_name.clone(),
                pod_namespace: p.namespace.clone(),
                pod_name: p.name.clone(),
                ips: ips.clone(),
                added_at: unix_seconds(SystemTime::now()),
            };
            let store = self.chained_store()?.clone();
            let superseded = blocking(move || store.record(record)).await?;
            for old in superseded {
                tracing::debug!(container = %old.container_id, if_name = %old.if_name, namespace = %p.namespace, pod = %p.name, "chained ADD supersedes the pod's earlier attachment");
            }
            self.sink.pod_network_added(&p.namespace, &p.name, &ips).await;
        }
        let mut result = conf.prev_result.clone().unwrap_or_default();
        result["cniVersion"] = conf.cni_version.clone().into();
        Ok(result)
    }

    /// Chained DEL: the addresses its ADD reported leave the model (the interface is the
    /// other plugin's), whether or not the runtime passes the cached `prevResult`. Without a
    /// record (an attachment added by a daemon from before records were kept, or already
    /// deleted) those of the `prevResult`; without either (or an unreadable one) nothing
    /// changes: DEL must succeed whatever is left. A repeated DEL changes nothing either, as
    /// the sink forgets a pod only while it has exactly these addresses.
    async fn del_chained(&self, req: &CniRequest, conf: &NetConf) -> Result<(), Error> {
        let pod = parse_pod_args(&req.args)?;
        let store = self.chained_store()?;
        if let Some(recorded) = store.get(&req.container_id, &req.if_name) {
            let a = self.forget_chained(store, recorded).await?;
            tracing::debug!(container = %a.container_id, if_name = %a.if_name, namespace = %a.pod_namespace, pod = %a.pod_name, ips = ?a.ips, "chained DEL took the recorded addresses out of the model");
            return Ok(());
        }
        let Some(pod) = pod else {
            return Ok(());
        };
        if conf.prev_result.is_none() {
            tracing::debug!(container = %req.container_id, namespace = %pod.namespace, pod = %pod.name, "chained DEL of an unrecorded attachment without prevResult: nothing to remove");
            return Ok(());
        }
        match conf.previous_addresses() {
            Ok(ips) => self.sink.pod_network_removed(&pod.namespace, &pod.name, &ips),
            Err(e) => {
                tracing::warn!(container = %req.container_id, namespace = %pod.namespace, pod = %pod.name, error = %e, "chained DEL: the prevResult's addresses are unreadable, the model keeps the pod's")
            }
        }
        Ok(())
    }

    async fn add(&self, req: &CniRequest, conf: &NetConf) -> Result<Value, Error> {
        let pod = self.pod_in_cache(req).await?;
        let ipam = self.allocator()?.clone();
        let (allocator, ctr, ifn, owner) = (ipam.clone(), req.container_id.clone(), req.if_name.clone(), pod.clone());
        let (alloc, new) = blocking(move || {
            allocator.allocate(&ctr, &ifn, owner.as_ref().map(|p| (p.namespace.as_str(), p.name.as_str())))
        })
        .await?;
        let spec = self.link_spec(req, &alloc);
        match link::setup(spec).await {
            Ok(net) => {
                if let Some(p) = &pod {
                    self.sink.pod_network_added(&p.namespace, &p.name, &net.ips()).await;
                }
                Ok(net.to_result(&conf.cni_version))
            }
            Err(e) => {
                if new {
                    // Nothing of this ADD is left in the kernel (setup undoes itself), so the
                    // address goes back too; a retry starts clean.
                    let (ctr, ifn) = (req.container_id.clone(), req.if_name.clone());
                    if let Err(release) = blocking(move || ipam.release(&ctr, &ifn)).await {
                        tracing::error!(error = %release, ips = ?alloc.ips, "releasing the addresses of a failed ADD");
                    }
                }
                Err(e)
            }
        }
    }

    /// DEL (and GC of a stale attachment): the node side of the veth (the pod side goes
    /// with it) and the address. Returns the allocation it released.
    async fn remove_attachment(&self, container_id: &str, if_name: &str) -> Result<Option<Allocation>, Error> {
        let host_if = host_if_name(container_id, if_name);
        let ipam = self.allocator()?.clone();
        let removed = link::teardown(self.config.host_netns.clone(), host_if.clone()).await?;
        let (ctr, ifn) = (container_id.to_string(), if_name.to_string());
        let released = blocking(move || ipam.release(&ctr, &ifn)).await?;
        tracing::debug!(%host_if, removed, released = ?released.as_ref().map(|a| &a.ips), "attachment removed");
        // Only what this call released leaves the model (nothing, for a repeated DEL).
        if let Some(Allocation { ips, pod_namespace: Some(ns), pod_name: Some(name), .. }) = &released {
            self.sink.pod_network_removed(ns, name, ips);
        }
        Ok(released)
    }

    async fn check(&self, req: &CniRequest, conf: &NetConf) -> Result<(), Error> {
        let alloc = self.allocator()?.get(&req.container_id, &req.if_name).ok_or_else(|| Error::UnknownContainer {
            container_id: req.container_id.clone(),
            if_name: req.if_name.clone(),
        })?;
        let spec = self.link_spec(req, &alloc);
        if let Some(prev) = &conf.prev_result {
            for a in &spec.addresses {
                let want = format!("{}/{}", a.ip, a.host_prefix());
                let listed =
                    prev["ips"].as_array().is_some_and(|ips| ips.iter().any(|ip| ip["address"] == want.as_str()));
                if !listed {
                    return Err(Error::CheckFailed(format!(
                        "prevResult does not list {want}, an address wasmplane allocated"
                    )));
                }
            }
        }
        link::check(spec).await
    }

    fn link_spec(&self, req: &CniRequest, alloc: &Allocation) -> link::LinkSpec {
        link::LinkSpec {
            host_netns: self.config.host_netns.clone(),
            pod_netns: PathBuf::from(&req.netns),
            host_if: host_if_name(&req.container_id, &req.if_name),
            pod_if: req.if_name.clone(),
            addresses: self.pod_addresses(alloc),
            mtu: self.mtu(),
        }
    }

    /// The allocation's addresses with their family's gateway. An address of a family the
    /// node no longer has a pod CIDR of (recovered from older state) has no gateway here and
    /// is left out.
    fn pod_addresses(&self, alloc: &Allocation) -> Vec<PodAddress> {
        alloc
            .ips
            .iter()
            .filter_map(|ip| {
                let pool = self.pools().iter().find(|p| p.cidr.addr().is_ipv4() == ip.is_ipv4());
                if pool.is_none() {
                    tracing::warn!(%ip, container = %alloc.container_id, "no pod CIDR of this address's family: left unconfigured");
                }
                pool.map(|p| PodAddress { ip: *ip, gateway: p.gateway })
            })
            .collect()
    }
}

/// What GC judges: an attachment, and when its ADD recorded it.
trait Recorded {
    fn attachment(&self) -> (&str, &str);
    /// Seconds since the Unix epoch; `None`: from before times were recorded.
    fn recorded_at(&self) -> Option<u64>;
}

impl Recorded for Allocation {
    fn attachment(&self) -> (&str, &str) {
        (&self.container_id, &self.if_name)
    }
    fn recorded_at(&self) -> Option<u64> {
        self.allocated_at
    }
}

impl Recorded for ChainedAttachment {
    fn attachment(&self) -> (&str, &str) {
        (&self.container_id, &self.if_name)
    }
    fn recorded_at(&self) -> Option<u64> {
        Some(self.added_at)
    }
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |t| t.as_secs())
}

/// Which allocations (chained: reported attachments) GC releases: of no attachment the
/// runtime lists, and older than the grace period (an ADD that finished after the runtime
/// took its list is not stale). Allocations from before their time was recorded count as
/// old.
struct Staleness<'a> {
    valid: HashSet<(&'a str, &'a str)>,
    grace: Duration,
}

impl<'a> Staleness<'a> {
    fn new(valid: &'a [Attachment], grace: Duration) -> Self {
        let valid = valid.iter().map(|a| (a.container_id.as_str(), a.if_name.as_str())).collect();
        Staleness { valid, grace }
    }

    /// Whether `a` is stale at `now`.
    fn of(&self, a: &impl Recorded, now: SystemTime) -> bool {
        let now = unix_seconds(now);
        !self.valid.contains(&a.attachment())
            && a.recorded_at().is_none_or(|at| now.saturating_sub(at) >= self.grace.as_secs())
    }
}

/// A running daemon; [`DaemonHandle::shutdown`] stops it and removes the socket.
pub struct DaemonHandle {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    socket_path: PathBuf,
}

impl DaemonHandle {
    pub fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    /// Stops accepting, lets requests in flight finish, removes the socket file.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt as _;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Bound and made private beside the path, then renamed over it: the socket appears
    // listening and mode 0600 at once (a client racing the bind was refused, and one racing
    // the chmod could connect with the umask's mode), and a socket a previous run left is
    // replaced in the same step.
    let mut staging = path.as_os_str().to_owned();
    staging.push(format!(".{}.new", std::process::id()));
    let staging = PathBuf::from(staging);
    match std::fs::remove_file(&staging) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(&staging)?;
    // Only root (the runtime calling the plugin) may drive pod networking.
    std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&staging, path)?;
    Ok(listener)
}

/// Runs file I/O (persisting the state, with its fsyncs) off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, Error> + Send + 'static) -> Result<T, Error> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::Internal(format!("state task: {e}")))?
}

fn validate_env(req: &CniRequest) -> Result<(), Error> {
    let mut bad = Vec::new();
    if req.container_id.is_empty() {
        bad.push("CNI_CONTAINERID (empty)");
    }
    if req.if_name.is_empty()
        || req.if_name.len() > 15
        || req.if_name.contains(['/', ' '])
        || req.if_name == "."
        || req.if_name == ".."
    {
        bad.push("CNI_IFNAME (not a valid interface name)");
    }
    if req.command != Command::Del && req.netns.is_empty() {
        bad.push("CNI_NETNS (empty)");
    }
    if bad.is_empty() { Ok(()) } else { Err(Error::InvalidEnv(bad.join(", "))) }
}

fn version_of(config: &Value) -> String {
    config
        .get("cniVersion")
        .and_then(Value::as_str)
        .filter(|v| SUPPORTED_VERSIONS.contains(v))
        .unwrap_or("1.0.0")
        .to_string()
}

/// See [`CniDaemon::summary`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DaemonSummary {
    pub chained: bool,
    /// `None`: the kernel's default (and always when chained).
    pub mtu: Option<u32>,
    pub pools: Vec<PoolUsage>,
    /// Chained: how many attachments' addresses it reported (and DEL or GC has not taken
    /// out yet). Left out when not chained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attachments: Option<usize>,
}

/// One pod CIDR: its addresses handed out, and how many pods it can address at most.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PoolUsage {
    pub cidr: String,
    pub allocated: usize,
    pub capacity: u64,
}

async fn allocations_handler(State(daemon): State<Arc<CniDaemon>>) -> axum::Json<Value> {
    let pools: Vec<Value> = daemon
        .pools()
        .iter()
        .map(|p| serde_json::json!({"podCIDR": p.cidr.to_string(), "gateway": p.gateway.to_string()}))
        .collect();
    let allocations = daemon.ipam().map(Ipam::all).unwrap_or_default();
    let mut reply = serde_json::json!({"pools": pools, "allocations": allocations, "chained": daemon.config.chained, "mtu": daemon.mtu()});
    if let Some(store) = daemon.chained_attachments() {
        reply["chainedAttachments"] = serde_json::json!(store.all());
    }
    axum::Json(reply)
}

async fn cni_handler(State(daemon): State<Arc<CniDaemon>>, body: Bytes) -> Response {
    let started = Instant::now();
    let req: CniRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            let version = serde_json::from_slice::<Value>(&body)
                .ok()
                .map(|v| version_of(&v["config"]))
                .unwrap_or_else(|| "1.0.0".into());
            return error_response(&version, &Error::Decode(e.to_string()));
        }
    };
    // Run to completion even if the plugin gives up and disconnects: a half-done ADD
    // (address persisted, veth made, per-container lock released early) must not race
    // the DEL or retry that follows.
    let req = Arc::new(req);
    let task = tokio::spawn({
        let req = req.clone();
        async move { daemon.handle(&req).await }
    });
    let result = match task.await {
        Ok(r) => r,
        Err(e) => Err((version_of(&req.config), Error::Internal(format!("CNI task failed: {e}")))),
    };
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    let pod = req.args.split(';').filter(|kv| kv.starts_with("K8S_POD_")).collect::<Vec<_>>().join(" ");
    match result {
        Ok(reply) => {
            tracing::info!(command = req.command.as_str(), container = %req.container_id, if_name = %req.if_name, %pod, elapsed_ms, "CNI ok");
            match reply {
                Some(v) => (StatusCode::OK, axum::Json(v)).into_response(),
                None => StatusCode::OK.into_response(),
            }
        }
        Err((version, e)) => {
            tracing::warn!(command = req.command.as_str(), container = %req.container_id, if_name = %req.if_name, %pod, elapsed_ms, code = e.code(), error = %e, "CNI failed");
            error_response(&version, &e)
        }
    }
}

fn error_response(version: &str, e: &Error) -> Response {
    let status = match e.code() {
        code::TRY_AGAIN_LATER => StatusCode::SERVICE_UNAVAILABLE,
        c if c < 100 => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, axum::Json(e.to_cni(version))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The socket appears listening and private in one step, replacing one a previous run
    /// left, and nothing is left beside it.
    #[tokio::test]
    async fn the_socket_appears_listening_and_private() {
        use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cni.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(std::os::unix::net::UnixStream::connect(&path).is_err(), "a stale socket: nobody listens");
        let _listener = bind(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        std::os::unix::net::UnixStream::connect(&path).expect("listening");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["cni.sock"]);
    }

    fn allocation(container_id: &str, allocated_at: Option<u64>) -> Allocation {
        Allocation {
            ips: vec![std::net::IpAddr::from([10, 244, 0, 9])],
            container_id: container_id.into(),
            if_name: "eth0".into(),
            pod_namespace: None,
            pod_name: None,
            allocated_at,
        }
    }

    #[test]
    fn gc_releases_what_the_runtime_does_not_list_and_is_not_young() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let valid = [
            Attachment { container_id: "kept".into(), if_name: "eth0".into() },
            // Unknown to the daemon: no error, nothing to do.
            Attachment { container_id: "ghost".into(), if_name: "eth0".into() },
        ];
        let allocations = vec![
            allocation("kept", Some(100)),
            allocation("gone", Some(100)),
            allocation("young", Some(990)),
            allocation("unrecorded", None),
        ];
        let staleness = Staleness::new(&valid, Duration::from_secs(60));
        // A chained daemon's records are judged alike.
        let chained = |container_id: &str, added_at: u64| ChainedAttachment {
            container_id: container_id.into(),
            if_name: "eth0".into(),
            pod_namespace: "ns".into(),
            pod_name: "p".into(),
            ips: Vec::new(),
            added_at,
        };
        let stale: Vec<bool> = [chained("kept", 100), chained("gone", 100), chained("young", 990)]
            .iter()
            .map(|a| staleness.of(a, now))
            .collect();
        assert_eq!(stale, [false, true, false]);
        let stale: Vec<String> =
            allocations.into_iter().filter(|a| staleness.of(a, now)).map(|a| a.container_id).collect();
        assert_eq!(stale, ["gone", "unrecorded"]);
        // Another interface of a listed container is not listed.
        let mut other_if = allocation("kept", Some(100));
        other_if.if_name = "net1".into();
        assert!(Staleness::new(&valid, Duration::ZERO).of(&other_if, now));
    }

    struct Unsynced;

    impl PodDirectory for Unsynced {
        fn wait_for_pod<'a>(&'a self, _pod: &'a PodRef, _timeout: Duration) -> BoxFuture<'a, Option<PodInfo>> {
            Box::pin(async { None })
        }
        fn synced(&self) -> bool {
            false
        }
    }

    fn network_request(command: Command, config: Value) -> CniRequest {
        CniRequest {
            command,
            container_id: String::new(),
            netns: String::new(),
            if_name: String::new(),
            args: String::new(),
            path: String::new(),
            config,
        }
    }

    /// STATUS and GC: spec 1.1.0 only, no attachment needed; STATUS says why ADD cannot be
    /// served; GC without the runtime's list is refused, not taken as "nothing is valid".
    #[tokio::test]
    async fn status_and_gc_requests() {
        let dir = tempfile::tempdir().unwrap();
        let config = DaemonConfig::new(vec!["10.244.9.0/30".parse().unwrap()], dir.path().into());
        let sink = Arc::new(PodNetworks::new());
        let daemon = CniDaemon::new(config.clone(), Arc::new(AnyPod), sink.clone()).unwrap();
        let v11 = json!({"cniVersion": "1.1.0", "name": "k8s"});
        let code = |r: Result<Option<Value>, (String, Error)>| r.err().map(|(_, e)| e.code());
        assert_eq!(code(daemon.handle(&network_request(Command::Status, v11.clone())).await), None);
        let v10 = json!({"cniVersion": "1.0.0", "name": "k8s"});
        assert_eq!(
            code(daemon.handle(&network_request(Command::Status, v10.clone())).await),
            Some(code::INCOMPATIBLE_VERSION)
        );
        assert_eq!(code(daemon.handle(&network_request(Command::Gc, v10)).await), Some(code::INCOMPATIBLE_VERSION));
        let no_list = daemon.handle(&network_request(Command::Gc, v11.clone())).await.unwrap_err();
        assert_eq!((no_list.0.as_str(), no_list.1.code()), ("1.1.0", code::INVALID_CONFIG));

        // A /30 has one pod address: taken, the node cannot add pods.
        daemon.ipam().unwrap().allocate("c1", "eth0", None).unwrap();
        let full = daemon.handle(&network_request(Command::Status, v11.clone())).await.unwrap_err().1;
        assert_eq!(full.code(), code::NOT_AVAILABLE);
        assert!(full.to_string().contains("10.244.9.0/30"), "{full}");
        daemon.ipam().unwrap().release("c1", "eth0").unwrap();

        let unsynced = CniDaemon::new(config, Arc::new(Unsynced), sink).unwrap();
        let e = unsynced.handle(&network_request(Command::Status, v11)).await.unwrap_err().1;
        assert_eq!(e.code(), code::NOT_AVAILABLE);
        assert!(e.to_string().contains("watch cache"), "{e}");
    }

    /// A DEL or GC request for the chained attachment `(container_id, eth0)` of pod `ns/pod`,
    /// in spec 1.1.0.
    fn chained_request(command: Command, container_id: &str, pod: &str, prev: Option<&Value>) -> CniRequest {
        let mut r = CniRequest::for_pod(command, container_id, "/var/run/netns/x", "ns", pod);
        r.config["cniVersion"] = json!("1.1.0");
        if let Some(prev) = prev {
            r.config["prevResult"] = prev.clone();
        }
        r
    }

    fn prev_result(ips: &[&str]) -> Value {
        let ips: Vec<Value> = ips.iter().map(|ip| json!({"address": ip, "interface": 0})).collect();
        json!({"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}], "ips": ips})
    }

    fn gc_request(valid: &[&str]) -> CniRequest {
        let valid: Vec<Value> = valid.iter().map(|c| json!({"containerID": c, "ifname": "eth0"})).collect();
        network_request(Command::Gc, json!({"cniVersion": "1.1.0", "name": "k8s", "cni.dev/valid-attachments": valid}))
    }

    fn chained_config(state_dir: &Path, gc_grace: Duration) -> DaemonConfig {
        let mut config = DaemonConfig::new(Vec::new(), state_dir.into());
        config.chained = true;
        config.gc_grace = gc_grace;
        config
    }

    fn ip_list(ips: &[&str]) -> Vec<std::net::IpAddr> {
        ips.iter().map(|ip| ip.split('/').next().unwrap().parse().unwrap()).collect()
    }

    /// Chained GC (spec 1.1.0, for every plugin of the chain): the addresses an ADD reported
    /// leave the model once the runtime no longer lists the attachment and it is older than
    /// the grace period; listed or young ones stay. The record survives a restart of the
    /// daemon, and a pod's new sandbox supersedes the record of its old one (whose GC would
    /// otherwise take out the new sandbox's addresses, when they are the same).
    #[tokio::test]
    async fn chained_gc_takes_out_what_the_runtime_no_longer_lists() {
        let dir = tempfile::tempdir().unwrap();
        let sink = Arc::new(PodNetworks::new());
        let young = CniDaemon::new(chained_config(dir.path(), Duration::from_secs(60)), Arc::new(AnyPod), sink.clone())
            .unwrap();
        let (a, b) = (["10.244.4.9/24", "fd00:10:244:4::9/64"], ["10.244.4.10/24"]);
        young.handle(&chained_request(Command::Add, "ctr-a", "a", Some(&prev_result(&a)))).await.unwrap();
        young.handle(&chained_request(Command::Add, "ctr-b", "b", Some(&prev_result(&b)))).await.unwrap();
        assert_eq!(young.summary().attachments, Some(2));
        // GC needs the runtime's list, as unchained.
        let no_list = network_request(Command::Gc, json!({"cniVersion": "1.1.0", "name": "k8s"}));
        assert_eq!(young.handle(&no_list).await.unwrap_err().1.code(), code::INVALID_CONFIG);
        // Unlisted but young: kept.
        assert_eq!(young.handle(&gc_request(&[])).await.unwrap(), None);
        assert_eq!((sink.get("ns", "a"), sink.get("ns", "b")), (Some(ip_list(&a)), Some(ip_list(&b))));
        drop(young);

        // Restarted (the same directory), now past the grace period.
        let daemon =
            CniDaemon::new(chained_config(dir.path(), Duration::ZERO), Arc::new(AnyPod), sink.clone()).unwrap();
        let recorded: Vec<_> = daemon
            .chained_attachments()
            .unwrap()
            .all()
            .into_iter()
            .map(|r| (r.container_id, r.pod_name, r.ips))
            .collect();
        assert_eq!(recorded, [("ctr-a".into(), "a".into(), ip_list(&a)), ("ctr-b".into(), "b".into(), ip_list(&b))]);
        assert_eq!(daemon.handle(&gc_request(&["ctr-b", "ctr-unknown"])).await.unwrap(), None);
        assert_eq!(sink.get("ns", "a"), None, "a's addresses out of the model");
        assert_eq!(sink.get("ns", "b"), Some(ip_list(&b)), "listed: kept");
        assert!(daemon.chained_attachments().unwrap().get("ctr-a", "eth0").is_none(), "a's record gone");
        assert_eq!(daemon.summary().attachments, Some(1));

        // b's new sandbox got the same address; the runtime lists only that one.
        daemon.handle(&chained_request(Command::Add, "ctr-b2", "b", Some(&prev_result(&b)))).await.unwrap();
        assert_eq!(daemon.handle(&gc_request(&["ctr-b2"])).await.unwrap(), None);
        assert_eq!(sink.get("ns", "b"), Some(ip_list(&b)), "the new sandbox's addresses stay");
        let left: Vec<_> = daemon.chained_attachments().unwrap().all().into_iter().map(|r| r.container_id).collect();
        assert_eq!(left, ["ctr-b2"]);
        drop(daemon);
        let reopened = ChainedAttachments::open(dir.path()).unwrap();
        assert_eq!(reopened.all().len(), 1, "GC's removals are on disk too");
    }

    /// Chained DEL without the cached `prevResult` (or without the pod in `CNI_ARGS`) takes
    /// out the addresses ADD reported, also after a restart; an attachment the daemon has no
    /// record of changes nothing.
    #[tokio::test]
    async fn chained_del_without_prev_result_takes_out_the_recorded_addresses() {
        let dir = tempfile::tempdir().unwrap();
        let sink = Arc::new(PodNetworks::new());
        let config = chained_config(dir.path(), Duration::from_secs(60));
        let daemon = CniDaemon::new(config.clone(), Arc::new(AnyPod), sink.clone()).unwrap();
        let (p, q) = (["10.244.4.9/24"], ["fd00:10:244:4::7/64"]);
        daemon.handle(&chained_request(Command::Add, "ctr-p", "p", Some(&prev_result(&p)))).await.unwrap();
        daemon.handle(&chained_request(Command::Add, "ctr-q", "q", Some(&prev_result(&q)))).await.unwrap();
        assert_eq!(daemon.handle(&chained_request(Command::Del, "ctr-unknown", "p", None)).await.unwrap(), None);
        assert_eq!(sink.get("ns", "p"), Some(ip_list(&p)));

        assert_eq!(daemon.handle(&chained_request(Command::Del, "ctr-p", "p", None)).await.unwrap(), None);
        assert_eq!(sink.get("ns", "p"), None);
        assert!(daemon.chained_attachments().unwrap().get("ctr-p", "eth0").is_none());
        drop(daemon);

        let daemon = CniDaemon::new(config, Arc::new(AnyPod), sink.clone()).unwrap();
        let mut no_pod = chained_request(Command::Del, "ctr-q", "q", None);
        no_pod.args = String::new();
        assert_eq!(daemon.handle(&no_pod).await.unwrap(), None);
        assert_eq!(sink.get("ns", "q"), None, "the record names the pod");
        assert!(daemon.chained_attachments().unwrap().is_empty());
        assert!(ChainedAttachments::open(dir.path()).unwrap().is_empty(), "DEL's removals are on disk");
    }

    /// A given MTU must suit the pod CIDRs' families: refused when the daemon is made, before
    /// anything is served. Chained it is ignored, not checked.
    #[test]
    fn a_given_mtu_is_checked_against_the_pod_cidrs() {
        let dir = tempfile::tempdir().unwrap();
        let sink = Arc::new(PodNetworks::new());
        let daemon = |cidrs: &[&str], chained: bool, mtu: u32| {
            let mut config =
                DaemonConfig::new(cidrs.iter().map(|c| c.parse().unwrap()).collect(), dir.path().join("state"));
            config.chained = chained;
            config.mtu = Some(mtu);
            CniDaemon::new(config, Arc::new(AnyPod), sink.clone())
        };
        let dual = ["10.244.9.0/24", "fd00:10:244:9::/64"];
        let e = daemon(&dual, false, 1279).err().expect("too small for IPv6");
        assert!(matches!(e, Error::InvalidMtu { mtu: 1279, .. }) && e.code() == code::INVALID_CONFIG, "{e:?}");
        assert!(e.to_string().contains("1280"), "{e}");
        assert!(matches!(daemon(&dual[..1], false, 575), Err(Error::InvalidMtu { mtu: 575, .. })));
        assert!(matches!(daemon(&dual[..1], false, 70000), Err(Error::InvalidMtu { .. })));
        let ok = daemon(&dual, false, 1280).unwrap();
        assert_eq!((ok.mtu(), ok.pod_mtu()), (Some(1280), None), "as given; settled at spawn");
        let chained = daemon(&[], true, 1).unwrap();
        assert_eq!(chained.mtu(), None, "chained: ignored");
    }

    /// Chained: ADD reports the prevResult's addresses and returns it in the request's
    /// version, with nothing allocated (only the attachment recorded); without addresses it
    /// is refused; DEL takes the addresses out of the model, repeatedly without harm;
    /// STATUS has no pools to look at. (No namespace is touched, so this runs unprivileged.)
    #[tokio::test]
    async fn chained_daemon_follows_the_previous_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let mut config = DaemonConfig::new(Vec::new(), state_dir.clone());
        config.chained = true;
        let sink = Arc::new(PodNetworks::new());
        let daemon = CniDaemon::new(config.clone(), Arc::new(AnyPod), sink.clone()).unwrap();
        assert!(daemon.ipam().is_none());
        let prev = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/p"}],
            "ips": [{"address": "10.244.4.9/24", "gateway": "10.244.4.1", "interface": 0}, {"address": "fd00:10:244:4::9/64", "interface": 0}]});
        let request = |command: Command, prev: Option<&Value>| {
            let mut r = CniRequest::for_pod(command, "ctr", "/var/run/netns/p", "ns", "p");
            r.config["cniVersion"] = json!("1.1.0");
            if let Some(prev) = prev {
                r.config["prevResult"] = prev.clone();
            }
            r
        };
        let result = daemon.handle(&request(Command::Add, Some(&prev))).await.unwrap().unwrap();
        let mut want = prev.clone();
        want["cniVersion"] = json!("1.1.0");
        assert_eq!(result, want);
        let ips: Vec<std::net::IpAddr> = vec!["10.244.4.9".parse().unwrap(), "fd00:10:244:4::9".parse().unwrap()];
        assert_eq!(sink.get("ns", "p"), Some(ips));
        let names: Vec<_> = std::fs::read_dir(&state_dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [CHAINED_STATE_FILE], "a chained daemon keeps no allocation state");
        assert_eq!(daemon.handle(&request(Command::Check, Some(&prev))).await.unwrap(), None);

        let refused = daemon.handle(&request(Command::Add, None)).await.unwrap_err();
        assert_eq!((refused.0.as_str(), refused.1.code()), ("1.1.0", code::INVALID_CONFIG));
        assert!(refused.1.to_string().contains("chained"), "{}", refused.1);
        let no_ips = json!({"cniVersion": "1.0.0", "ips": []});
        assert_eq!(
            daemon.handle(&request(Command::Check, Some(&no_ips))).await.unwrap_err().1.code(),
            code::INVALID_CONFIG
        );

        let status = json!({"cniVersion": "1.1.0", "name": "k8s"});
        assert!(daemon.handle(&network_request(Command::Status, status)).await.is_ok());

        // DEL with the cached result: the addresses go; again: fine.
        for _ in 0..2 {
            assert_eq!(daemon.handle(&request(Command::Del, Some(&prev))).await.unwrap(), None);
            assert_eq!(sink.get("ns", "p"), None);
        }

        // STATUS waits for the watch cache as unchained.
        let unsynced = CniDaemon::new(config.clone(), Arc::new(Unsynced), sink.clone()).unwrap();
        let status = json!({"cniVersion": "1.1.0", "name": "k8s"});
        assert_eq!(
            unsynced.handle(&network_request(Command::Status, status)).await.unwrap_err().1.code(),
            code::NOT_AVAILABLE
        );

        // Pod CIDRs make no sense chained: refused, not ignored.
        config.pod_cidrs = vec!["10.244.4.0/24".parse().unwrap()];
        let e = CniDaemon::new(config, Arc::new(AnyPod), sink).err().expect("pod CIDRs refused");
        assert_eq!(e.code(), code::INVALID_CONFIG);
    }
}
