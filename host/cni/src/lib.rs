//! The CNI daemon inside the host.
//!
//! The thin `wasmplane-cni` executable turns one CNI invocation into one `POST /v1/cni` on
//! a unix socket; this crate answers it: it waits (bounded) until the pod is in the host's
//! watch cache, allocates an address from the node's pod CIDR (persisted), creates the veth
//! pair into the pod's network namespace with its address and routes, reports the address
//! to the host at once, and replies with the spec's result or error object.
//!
//! ```no_run
//! # async fn f() -> Result<(), wasmplane_cni::Error> {
//! use std::sync::Arc;
//! use wasmplane_cni::{CniDaemon, DaemonConfig, PodCache, PodNetworks};
//! let config = DaemonConfig::new("10.244.1.0/24".parse().unwrap(), "/var/lib/wasmplane/cni".into());
//! let daemon = CniDaemon::new(config, Arc::new(PodCache::new()), Arc::new(PodNetworks::new()))?;
//! let handle = daemon.spawn().await?; // serves until...
//! handle.shutdown().await;
//! # Ok(()) }
//! ```

mod error;
mod ipam;
mod link;
mod pods;
mod protocol;

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ipnet::Ipv4Net;
use serde_json::Value;

pub use error::{CniErrorReply, Error, code};
pub use ipam::{Allocation, Ipam};
pub use link::host_if_name;
pub use pods::{AnyPod, BoxFuture, PodCache, PodDirectory, PodInfo, PodNetworkSink, PodNetworks};
pub use protocol::{
    CniRequest, Command, DEFAULT_SOCKET, NetConf, PodNetwork, PodRef, SUPPORTED_VERSIONS,
    parse_pod_args,
};

/// How the daemon runs on this node.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// The unix socket the plugin talks to.
    pub socket_path: PathBuf,
    /// Where allocations are persisted.
    pub state_dir: PathBuf,
    /// The node's pod CIDR (`spec.podCIDR`); its first address is the pods' gateway.
    pub pod_cidr: Ipv4Net,
    /// How long ADD waits for a pod that is not in the watch cache yet.
    pub pod_wait_timeout: Duration,
    /// The network namespace to do the node side in; `None` (production): the daemon's own.
    /// Tests point it at a namespace standing in for the node.
    pub host_netns: Option<PathBuf>,
    /// MTU of both veth ends; `None`: the kernel default.
    pub mtu: Option<u32>,
    /// Turn on IPv4 forwarding in the node namespace at start: pods reach each other and
    /// the world through the node's routing (as the reference bridge plugin's isGateway).
    pub enable_ip_forward: bool,
}

impl DaemonConfig {
    pub fn new(pod_cidr: Ipv4Net, state_dir: PathBuf) -> DaemonConfig {
        DaemonConfig {
            socket_path: DEFAULT_SOCKET.into(),
            state_dir,
            pod_cidr,
            pod_wait_timeout: Duration::from_secs(10),
            host_netns: None,
            mtu: None,
            enable_ip_forward: true,
        }
    }
}

/// The daemon: configuration, allocator, and the host's two hooks.
pub struct CniDaemon {
    config: DaemonConfig,
    ipam: Arc<Ipam>,
    pods: Arc<dyn PodDirectory>,
    sink: Arc<dyn PodNetworkSink>,
    /// One operation at a time per (container, interface): a DEL racing an ADD retry must
    /// not interleave with it.
    in_flight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl CniDaemon {
    /// Opens the allocation state (recovering earlier allocations).
    pub fn new(
        config: DaemonConfig,
        pods: Arc<dyn PodDirectory>,
        sink: Arc<dyn PodNetworkSink>,
    ) -> Result<Arc<CniDaemon>, Error> {
        let ipam = Arc::new(Ipam::open(&config.state_dir, config.pod_cidr)?);
        Ok(Arc::new(CniDaemon {
            config,
            ipam,
            pods,
            sink,
            in_flight: Mutex::default(),
        }))
    }

    pub fn config(&self) -> &DaemonConfig {
        &self.config
    }

    pub fn ipam(&self) -> &Ipam {
        &self.ipam
    }

    /// Binds the socket (replacing a stale one) and serves until the handle is shut down.
    /// Must run inside a tokio runtime.
    pub async fn spawn(self: Arc<Self>) -> Result<DaemonHandle, Error> {
        if self.config.enable_ip_forward {
            link::enable_ip_forward(self.config.host_netns.clone()).await?;
        }
        self.release_stale().await?;
        let path = self.config.socket_path.clone();
        let listener = bind(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let app = self.router();
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(async move { rx.await.unwrap_or(()) })
                .await
            {
                tracing::error!(error = %e, "CNI socket server failed");
            }
        });
        tracing::info!(socket = %path.display(), cidr = %self.ipam.cidr(), gateway = %self.ipam.gateway(), "CNI daemon listening");
        Ok(DaemonHandle {
            stop: Some(tx),
            task,
            socket_path: path,
        })
    }

    /// Releases allocations whose node-side interface is gone: their pod's namespace was
    /// destroyed (which takes the veth pair with it) while no DEL reached us, e.g. the
    /// daemon was down. Run before serving, so no ADD is between allocation and veth.
    async fn release_stale(&self) -> Result<(), Error> {
        let allocations = self.ipam.all();
        if allocations.is_empty() {
            return Ok(());
        }
        let present = link::link_names(self.config.host_netns.clone()).await?;
        for a in allocations {
            let host_if = host_if_name(&a.container_id, &a.if_name);
            if present.contains(&host_if) {
                continue;
            }
            tracing::warn!(ip = %a.ip, container = %a.container_id, %host_if, "releasing the address of a pod whose interface is gone");
            let (ipam, ctr, ifn) = (self.ipam.clone(), a.container_id.clone(), a.if_name.clone());
            blocking(move || ipam.release(&ctr, &ifn)).await?;
            if let (Some(ns), Some(name)) = (&a.pod_namespace, &a.pod_name) {
                self.sink.pod_network_removed(ns, name, &[IpAddr::V4(a.ip)]);
            }
        }
        Ok(())
    }

    /// `GET /healthz`, `POST /v1/cni` (body: [`CniRequest`]) and `GET /v1/allocations`
    /// (the pod CIDR, gateway and every allocation: for debugging a node).
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/v1/cni", post(cni_handler))
            .route("/v1/allocations", get(allocations_handler))
            .with_state(self.clone())
    }

    /// One CNI command: `Ok(Some(result))` for ADD, `Ok(None)` for DEL and CHECK. The error
    /// carries the CNI version to reply in.
    pub async fn handle(&self, req: &CniRequest) -> Result<Option<Value>, (String, Error)> {
        let conf = NetConf::parse(&req.config).map_err(|e| (version_of(&req.config), e))?;
        let version = conf.cni_version.clone();
        self.dispatch(req, &conf).await.map_err(|e| (version, e))
    }

    async fn dispatch(&self, req: &CniRequest, conf: &NetConf) -> Result<Option<Value>, Error> {
        validate_env(req)?;
        if req.command == Command::Check && conf.cni_version.starts_with("0.3") {
            return Err(Error::IncompatibleVersion(format!(
                "{} (CHECK needs 0.4.0 or later)",
                conf.cni_version
            )));
        }
        let key = format!("{}/{}", req.container_id, req.if_name);
        let lock = self
            .in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_default()
            .clone();
        let guard = lock.lock().await;
        let result = match req.command {
            Command::Add => self.add(req, conf).await.map(Some),
            Command::Del => self.del(req).await.map(|()| None),
            Command::Check => self.check(req, conf).await.map(|()| None),
        };
        drop(guard);
        drop(lock);
        let mut map = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&key).is_some_and(|l| Arc::strong_count(l) == 1) {
            map.remove(&key);
        }
        result
    }

    async fn add(&self, req: &CniRequest, conf: &NetConf) -> Result<Value, Error> {
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
        let (ipam, ctr, ifn, owner) = (
            self.ipam.clone(),
            req.container_id.clone(),
            req.if_name.clone(),
            pod.clone(),
        );
        let (alloc, new) = blocking(move || {
            ipam.allocate(
                &ctr,
                &ifn,
                owner
                    .as_ref()
                    .map(|p| (p.namespace.as_str(), p.name.as_str())),
            )
        })
        .await?;
        let spec = self.link_spec(req, alloc.ip);
        match link::setup(spec).await {
            Ok(net) => {
                if let Some(p) = &pod {
                    self.sink
                        .pod_network_added(&p.namespace, &p.name, &[IpAddr::V4(net.ip)]);
                }
                Ok(net.to_result(&conf.cni_version))
            }
            Err(e) => {
                if new {
                    // Nothing of this ADD is left in the kernel (setup undoes itself), so the
                    // address goes back too; a retry starts clean.
                    let (ipam, ctr, ifn) = (
                        self.ipam.clone(),
                        req.container_id.clone(),
                        req.if_name.clone(),
                    );
                    if let Err(release) = blocking(move || ipam.release(&ctr, &ifn)).await {
                        tracing::error!(error = %release, ip = %alloc.ip, "releasing the address of a failed ADD");
                    }
                }
                Err(e)
            }
        }
    }

    async fn del(&self, req: &CniRequest) -> Result<(), Error> {
        let host_if = host_if_name(&req.container_id, &req.if_name);
        let removed = link::teardown(self.config.host_netns.clone(), host_if.clone()).await?;
        let (ipam, ctr, ifn) = (
            self.ipam.clone(),
            req.container_id.clone(),
            req.if_name.clone(),
        );
        let released = blocking(move || ipam.release(&ctr, &ifn)).await?;
        tracing::debug!(%host_if, removed, released = ?released.as_ref().map(|a| a.ip), "DEL");
        // Only what this DEL released leaves the model (nothing, for a repeated DEL).
        if let Some(Allocation {
            ip,
            pod_namespace: Some(ns),
            pod_name: Some(name),
            ..
        }) = &released
        {
            self.sink.pod_network_removed(ns, name, &[IpAddr::V4(*ip)]);
        }
        Ok(())
    }

    async fn check(&self, req: &CniRequest, conf: &NetConf) -> Result<(), Error> {
        let alloc = self
            .ipam
            .get(&req.container_id, &req.if_name)
            .ok_or_else(|| Error::UnknownContainer {
                container_id: req.container_id.clone(),
                if_name: req.if_name.clone(),
            })?;
        if let Some(prev) = &conf.prev_result {
            let want = format!("{}/32", alloc.ip);
            let listed = prev["ips"]
                .as_array()
                .is_some_and(|ips| ips.iter().any(|ip| ip["address"] == want.as_str()));
            if !listed {
                return Err(Error::CheckFailed(format!(
                    "prevResult does not list {want}, the address wasmplane allocated"
                )));
            }
        }
        link::check(self.link_spec(req, alloc.ip)).await
    }

    fn link_spec(&self, req: &CniRequest, ip: std::net::Ipv4Addr) -> link::LinkSpec {
        link::LinkSpec {
            host_netns: self.config.host_netns.clone(),
            pod_netns: PathBuf::from(&req.netns),
            host_if: host_if_name(&req.container_id, &req.if_name),
            pod_if: req.if_name.clone(),
            ip,
            gateway: self.ipam.gateway(),
            mtu: self.config.mtu,
        }
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
    // A socket left by a previous run refuses the bind; nobody listens on it any more.
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    // Only root (the runtime calling the plugin) may drive pod networking.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Runs file I/O (IPAM persistence, with its fsyncs) off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("IPAM task: {e}")))?
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
    if bad.is_empty() {
        Ok(())
    } else {
        Err(Error::InvalidEnv(bad.join(", ")))
    }
}

fn version_of(config: &Value) -> String {
    config
        .get("cniVersion")
        .and_then(Value::as_str)
        .filter(|v| SUPPORTED_VERSIONS.contains(v))
        .unwrap_or("1.0.0")
        .to_string()
}

async fn allocations_handler(State(daemon): State<Arc<CniDaemon>>) -> axum::Json<Value> {
    axum::Json(serde_json::json!({
        "podCIDR": daemon.ipam.cidr().to_string(),
        "gateway": daemon.ipam.gateway().to_string(),
        "allocations": daemon.ipam.all(),
    }))
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
        Err(e) => Err((
            version_of(&req.config),
            Error::Internal(format!("CNI task failed: {e}")),
        )),
    };
    let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
    let pod = req
        .args
        .split(';')
        .filter(|kv| kv.starts_with("K8S_POD_"))
        .collect::<Vec<_>>()
        .join(" ");
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
