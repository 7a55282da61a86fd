//! Wiring: configuration in, a running host out (REST API, sources, controller loops).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::oneshot;
use wasmplane_runtime::{Limits, Runtime};

use crate::api::{ApiState, router};
use crate::controller::{Controller, ControllerConfig};
use crate::dataplane::{Kernel, NetlinkNft, NftCommand, Recorder};
use crate::metrics::Metrics;
use crate::module_store::ModuleStore;
use crate::modules::Modules;
use wasmplane_sources::kube::{SourceEvent, WATCHED_KINDS, WatchStatus};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataplaneMode {
    /// Render transactions without touching the kernel (no privileges needed).
    Record,
    /// Apply transactions with `nft -f` (needs CAP_NET_ADMIN).
    Nftables,
}

/// Where the Kubernetes API is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubernetesSource {
    /// `KUBECONFIG`, `~/.kube/config`, or the in-cluster service account, as kubectl finds it.
    Infer,
    /// A kubeconfig file.
    Kubeconfig(PathBuf),
    /// A plain URL with no credentials (tests against the test API server).
    Url(String),
}

impl KubernetesSource {
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let config = match self {
            KubernetesSource::Infer => {
                kube::Config::infer().await.context("finding Kubernetes credentials (kubeconfig or in-cluster)")?
            }
            KubernetesSource::Kubeconfig(path) => {
                let kubeconfig = kube::config::Kubeconfig::read_from(path)
                    .with_context(|| format!("reading kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                    .await
                    .with_context(|| format!("using kubeconfig {}", path.display()))?
            }
            KubernetesSource::Url(url) => {
                kube::Config::new(url.parse().with_context(|| format!("Kubernetes API URL {url:?}"))?)
            }
        };
        crate::kube_client::client(config).context("building the Kubernetes client")
    }
}

/// Where hosts share state (modules today; node registry and status with the operator).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvstoreConfig {
    /// In this process: persisted in `data_dir/kvstore.redb`, in memory without a data dir.
    Embedded,
    /// An etcd cluster (v3 API), by client URLs; `https://` ones with TLS settings; as an
    /// etcd user, when etcd's authentication is on.
    Etcd {
        endpoints: Vec<String>,
        tls: Option<wasmplane_kvstore::EtcdTlsFiles>,
        user: Option<wasmplane_kvstore::EtcdUser>,
    },
}

impl KvstoreConfig {
    /// Plain-text etcd at these client URLs.
    pub fn etcd(endpoints: Vec<String>) -> KvstoreConfig {
        KvstoreConfig::Etcd { endpoints, tls: None, user: None }
    }

    /// `embedded`, or `etcd://host:port[,host:port…]` / `http(s)://…` endpoint lists.
    pub fn parse(text: &str) -> Result<KvstoreConfig, String> {
        if text == "embedded" {
            return Ok(KvstoreConfig::Embedded);
        }
        let endpoints = text
            .strip_prefix("etcd://")
            .map(|rest| rest.split(',').map(|e| format!("http://{e}")).collect::<Vec<_>>())
            .unwrap_or_else(|| text.split(',').map(str::to_string).collect());
        if endpoints
            .iter()
            .any(|e| !(e.starts_with("http://") || e.starts_with("https://")) || e.len() < "http://x".len())
        {
            return Err(format!("kvstore {text:?}: expected `embedded` or `etcd://host:port[,host:port...]`"));
        }
        Ok(KvstoreConfig::etcd(endpoints))
    }

    pub async fn open(
        &self,
        data_dir: Option<&std::path::Path>,
    ) -> anyhow::Result<Arc<dyn wasmplane_kvstore::KvStore>> {
        Ok(match self {
            KvstoreConfig::Embedded => match data_dir {
                Some(dir) => {
                    let path = dir.join("kvstore.redb");
                    Arc::new(
                        wasmplane_kvstore::EmbeddedStore::open(wasmplane_kvstore::EmbeddedConfig::persistent(&path))
                            .await
                            .with_context(|| format!("opening the embedded kvstore {}", path.display()))?,
                    )
                }
                None => Arc::new(wasmplane_kvstore::EmbeddedStore::in_memory()),
            },
            KvstoreConfig::Etcd { endpoints, tls, user } => Arc::new(
                wasmplane_kvstore::EtcdStore::connect(etcd_config(endpoints, tls.as_ref(), user.clone())?)
                    .await
                    .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))?,
            ),
        })
    }
}

/// The etcd client's settings with the TLS files read and checked (a missing or wrong file
/// stops the start, naming the file).
pub fn etcd_config(
    endpoints: &[String],
    tls: Option<&wasmplane_kvstore::EtcdTlsFiles>,
    user: Option<wasmplane_kvstore::EtcdUser>,
) -> anyhow::Result<wasmplane_kvstore::EtcdConfig> {
    let tls = tls.map(wasmplane_kvstore::EtcdTlsFiles::load).transpose().context("etcd TLS settings")?;
    let config = wasmplane_kvstore::EtcdConfig::new(endpoints.iter().cloned()).with_tls(tls).with_user(user);
    config.validate().with_context(|| format!("etcd at {}", endpoints.join(",")))?;
    Ok(config)
}

#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Where modules (and later cluster-wide state) are shared with other hosts.
    pub kvstore: KvstoreConfig,
    pub listen: SocketAddr,
    pub manifests: Option<PathBuf>,
    /// Watch a Kubernetes API server (takes precedence over `manifests`).
    pub kubernetes: Option<KubernetesSource>,
    /// Serve the CNI daemon (none: not served).
    pub cni: Option<crate::cni::CniConfig>,
    /// Register this node in the kvstore, program routes, follow the heartbeat (none: not).
    pub agent: Option<crate::agent::AgentConfig>,
    /// Run the operator role (cluster-wide duties, leader-elected) instead of the agent's:
    /// no node registration, no CNI, and the dataplane only rendered.
    pub operator: Option<crate::operator_role::OperatorRoleConfig>,
    /// Where the gRPC node-local model stream listens (none: not served).
    pub grpc_listen: Option<SocketAddr>,
    /// Where load balancer health checks (`healthCheckNodePort`) are answered, on each
    /// service's port (none: not served; `service_health.rs`). Not in the operator role.
    pub health_check_bind: Option<std::net::IpAddr>,
    /// Where the node's health is answered for load balancers (`/healthz`, `/livez`;
    /// kube-proxy's `--healthz-bind-address`, port 10256). None: not served.
    pub node_health_listen: Option<SocketAddr>,
    /// Where `/metrics` is served alone, without a token (kube-proxy's
    /// `--metrics-bind-address`; `metrics_server.rs`). None: only on the REST API.
    pub metrics_listen: Option<SocketAddr>,
    /// How often the events/revisions stats line is logged.
    pub stats_interval: Duration,
    pub data_dir: Option<PathBuf>,
    pub node_name: String,
    pub cluster_cidrs: Vec<String>,
    /// Where local traffic comes from (`--detect-local-mode`).
    pub local_detection: crate::controller::LocalDetection,
    /// The cluster's service CIDRs (`--service-cidr`), beside the ServiceCIDR objects':
    /// new connections to an address in them that is no service's are dropped.
    pub service_cidrs: Vec<String>,
    /// kube-proxy's `--masquerade-all`: every connection to a cluster IP leaves masqueraded,
    /// whatever its source and the translator in force.
    pub masquerade_all: bool,
    /// Masquerade pods' traffic out of the cluster (`--egress-masquerade`); with no
    /// sources, this node's pod CIDRs from its Node object.
    pub egress_masquerade: Option<crate::nft::EgressMasquerade>,
    /// kube-proxy's conntrack settings, applied at start in `nftables` mode (the CLI's
    /// default: kube-proxy's values); `None`: the node's own.
    pub conntrack: Option<crate::conntrack_tuning::ConntrackTuning>,
    /// The NFLOG group the policy dispatch chains log their drops and audit verdicts to,
    /// read back in `nftables` mode for `GET /v1/policies/verdicts` (`--policy-log-group`);
    /// 0: not logged (audit verdicts go to the kernel log).
    pub policy_log_group: u16,
    /// Packets a second each of its log rules passes (`--policy-log-rate`).
    pub policy_log_rate: u32,
    pub dataplane: DataplaneMode,
    pub token: Option<String>,
    pub limits: Limits,
    pub max_module_bytes: usize,
    /// Crashes of the module in force tolerated per window before it is rolled back.
    pub crash_budget: crate::controller::CrashBudget,
    pub reconcile_interval: Duration,
    /// Cluster changes are applied at most once per this period on average, in bursts of
    /// two (`--min-sync-period`, kube-proxy's `minSyncPeriod`; `sync_pacer.rs`). Zero: each
    /// batch at once.
    pub min_sync_period: Duration,
    pub manifest_poll: Duration,
    /// How nft is run in `nftables` mode (tests point it into a network namespace).
    pub nft_command: Vec<String>,
    /// How conntrack is run in `nftables` mode (UDP/SCTP flow cleanup), in the same network
    /// namespace as `nft_command`. Empty: `nft_command` with `conntrack` in place of `nft`.
    pub conntrack_command: Vec<String>,
    /// Send incremental transactions as netlink batches (`nft::netlink`) in the namespace
    /// `nft_command` runs in; false: every transaction through `nft -f`.
    pub nft_netlink: bool,
    /// Services per nftables shard table (see `nft::Layout`).
    pub nft_services_per_shard: usize,
    /// Where node ports are served (kube-proxy's `--nodeport-addresses`).
    pub node_port_addresses: crate::nft::NodePortAddresses,
    /// Public keys (files) of which one must have signed every upload; empty: unsigned
    /// uploads are accepted.
    pub trusted_keys: Vec<PathBuf>,
    /// YAML grants of capabilities per module; none: every known capability to every module.
    pub grants: Option<PathBuf>,
    /// Serve the REST API over TLS with this certificate and key (PEM).
    pub tls: Option<crate::auth::TlsFiles>,
    /// How often the TLS files are read again (rotated certificates).
    pub tls_reload_interval: Duration,
    /// Accept Kubernetes bearer tokens (TokenReview + SubjectAccessReview) beside the static token.
    pub kubernetes_auth: Option<crate::auth::KubernetesAuthConfig>,
    /// Record every model revision's translator inputs and outputs to this file (`record.rs`).
    pub record: Option<PathBuf>,
    /// Compile guests in a child process with this command (the `wasmplane` binary passes
    /// itself), so the compiler's code and memory never stay with the host; `None`: in process.
    pub compiler: Option<wasmplane_runtime::CompilerCommand>,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            kvstore: KvstoreConfig::Embedded,
            listen: "127.0.0.1:8080".parse().expect("static address"),
            manifests: None,
            kubernetes: None,
            grpc_listen: None,
            health_check_bind: None,
            node_health_listen: None,
            metrics_listen: None,
            cni: None,
            agent: Some(crate::agent::AgentConfig::default()),
            operator: None,
            stats_interval: Duration::from_secs(60),
            data_dir: None,
            node_name: "node-a".into(),
            cluster_cidrs: vec!["10.244.0.0/16".into()],
            local_detection: crate::controller::LocalDetection::ClusterCidr,
            service_cidrs: Vec::new(),
            masquerade_all: false,
            egress_masquerade: None,
            conntrack: None,
            policy_log_group: 0,
            policy_log_rate: crate::nft::policy::DEFAULT_LOG_RATE,
            dataplane: DataplaneMode::Record,
            token: None,
            limits: Limits::default(),
            max_module_bytes: 16 << 20,
            crash_budget: Default::default(),
            reconcile_interval: Duration::from_secs(60),
            min_sync_period: Duration::ZERO,
            manifest_poll: Duration::from_secs(1),
            nft_command: vec!["nft".into()],
            conntrack_command: Vec::new(),
            nft_netlink: true,
            nft_services_per_shard: crate::nft::Layout::DEFAULT_SERVICES_PER_SHARD,
            node_port_addresses: crate::nft::NodePortAddresses::All,
            trusted_keys: Vec::new(),
            grants: None,
            tls: None,
            tls_reload_interval: crate::auth::DEFAULT_TLS_RELOAD_INTERVAL,
            kubernetes_auth: None,
            record: None,
            compiler: None,
        }
    }
}

pub struct RunningHost {
    pub addr: SocketAddr,
    pub token: String,
    pub controller: Arc<Mutex<Controller>>,
    pub metrics: Arc<Metrics>,
    pub ready: Arc<AtomicBool>,
    pub watch_status: Option<Arc<WatchStatus>>,
    pub modules: Arc<Modules>,
    /// This node's registration, routes and heartbeat follower (when configured).
    pub agent: Option<Arc<crate::agent::Agent>>,
    /// The operator role's duties (with `--role operator`).
    pub operator: Option<Arc<crate::operator_role::OperatorRole>>,
    /// Where the gRPC model stream listens, if it is served.
    pub grpc_addr: Option<SocketAddr>,
    /// Where `--metrics-listen` serves the metrics, once bound (`None` while its port is
    /// taken, or when not asked for).
    pub metrics_addr: Option<SocketAddr>,
    /// Whether the REST API is served over TLS (`https://` in [`RunningHost::url`]).
    pub tls: bool,
    /// Where the runtime keeps the compiled guests, which it maps from there (with a data dir).
    pub compiled_guests: Option<PathBuf>,
    /// The policy verdicts read back from the kernel (`--policy-log-group`, `nftables` mode).
    pub policy_verdicts: Option<Arc<crate::policy_log::PolicyVerdictLog>>,
    model_feed: Option<wasmplane_grpc::ModelFeed>,
    shutdown: Option<oneshot::Sender<()>>,
    /// The CNI daemon's task and what tells it to stop.
    cni: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
    server: tokio::task::JoinHandle<()>,
    loops: Vec<tokio::task::JoinHandle<()>>,
}

/// How long [`RunningHost::stop`] lets the CNI daemon finish the requests it took.
const CNI_STOP_TIMEOUT: Duration = Duration::from_secs(5);

impl RunningHost {
    pub fn url(&self) -> String {
        format!("{}://{}", if self.tls { "https" } else { "http" }, self.addr)
    }

    /// Stops gracefully, as on SIGTERM: the operator role hands its Lease over first (the
    /// next leader starts at once), the CNI daemon answers the requests it took and removes
    /// its socket, the REST API finishes the requests in flight, gRPC watchers are told the
    /// stream ends. The dataplane stays in the kernel, as kube-proxy leaves its rules: pods
    /// keep their traffic until the next host adopts them.
    pub async fn stop(mut self) {
        if let Some(operator) = &self.operator {
            operator.shutdown().await;
        }
        if let Some((stop, mut task)) = self.cni.take() {
            let _ = stop.send(());
            // An ADD may be waiting for its pod to reach the watch cache: not for long.
            if tokio::time::timeout(CNI_STOP_TIMEOUT, &mut task).await.is_err() {
                tracing::warn!("the CNI daemon did not finish its requests in {CNI_STOP_TIMEOUT:?}; stopping it");
                task.abort();
            }
        }
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(feed) = &self.model_feed {
            feed.close();
        }
        for l in &self.loops {
            l.abort();
        }
        let _ = (&mut self.server).await;
    }
}

/// The bearer token: configured, else kept in the data dir, else made up for this run.
fn resolve_token(config: &HostConfig) -> anyhow::Result<String> {
    if let Some(token) = &config.token {
        anyhow::ensure!(token.len() >= 16, "the API token must be at least 16 characters");
        return Ok(token.clone());
    }
    let mut bytes = [0u8; 24];
    use std::io::Read as _;
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).context("reading /dev/urandom")?;
    let fresh = hex::encode(bytes);
    let Some(dir) = &config.data_dir else { return Ok(fresh) };
    let path = dir.join("token");
    match std::fs::read_to_string(&path) {
        Ok(existing) if existing.trim().len() >= 16 => Ok(existing.trim().to_string()),
        _ => {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("writing {}", path.display()))?;
            file.write_all(fresh.as_bytes())?;
            Ok(fresh)
        }
    }
}

pub async fn start(config: HostConfig) -> anyhow::Result<RunningHost> {
    if let Some(dir) = &config.data_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating data dir {}", dir.display()))?;
    }
    let token = resolve_token(&config)?;
    // Configuration errors first, before anything is opened or bound.
    let admission = Arc::new(
        crate::admission::Admission::from_files(&config.trusted_keys, config.grants.as_deref())
            .context("loading trusted keys and grants")?,
    );
    if admission.requires_signatures() {
        tracing::info!(keys = config.trusted_keys.len(), "uploads must be signed by a trusted key");
    }
    let tls_cert = config.tls.as_ref().map(crate::auth::ReloadingCert::load).transpose()?;
    let tls_config = tls_cert.as_ref().map(crate::auth::server_config).transpose()?;
    let auth = match &config.kubernetes_auth {
        Some(k) => crate::auth::Auth::with_kubernetes(&token, k.clone())
            .await
            .context("setting up Kubernetes authentication")?,
        None => crate::auth::Auth::static_token(&token),
    };
    let mut metrics = Metrics::new();
    let audit_failures = prometheus_client::metrics::counter::Counter::default();
    metrics.registry.register(
        "audit_write_failures",
        "Audit records that could not be written to the kvstore",
        audit_failures.clone(),
    );
    let metrics = Arc::new(metrics);
    let compiled_guests = config.data_dir.as_ref().map(|d| d.join("compiled"));
    let mut runtime = Runtime::new(config.limits.clone(), compiled_guests.clone())?;
    if let Some(command) = &config.compiler {
        runtime = runtime.compile_in_child(command.clone());
    }
    let runtime = Arc::new(runtime);
    let operator_role = config.operator.is_some();
    // The operator keeps a model (for its REST API) but never writes a node's kernel.
    let dataplane = if operator_role { DataplaneMode::Record } else { config.dataplane };
    let kernel: Box<dyn Kernel> = match dataplane {
        DataplaneMode::Record => Box::new(Recorder::default()),
        DataplaneMode::Nftables => {
            if let Some(tuning) = config.conntrack.clone() {
                let netns = NetlinkNft::netns_of_command(&config.nft_command);
                let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
                // As kube-proxy: what cannot be set is logged, and the dataplane works with
                // the node's own settings.
                match tokio::task::spawn_blocking(move || tuning.apply(netns.as_deref(), cpus)).await? {
                    Ok(outcomes) => {
                        for outcome in outcomes {
                            match outcome {
                                crate::conntrack_tuning::Outcome::Failed { .. } => {
                                    tracing::warn!(?outcome, "conntrack setting left as it is")
                                }
                                _ => tracing::info!(?outcome, "conntrack setting"),
                            }
                        }
                    }
                    Err(e) => tracing::warn!("conntrack settings left as they are: {e}"),
                }
            }
            let text = NftCommand::new(config.nft_command.clone(), config.conntrack_command.clone());
            if config.nft_netlink {
                let netns = NetlinkNft::netns_of_command(&config.nft_command);
                Box::new(NetlinkNft::open(text, netns.as_deref()).with_context(|| {
                    format!(
                        "opening the nf_tables netlink socket in {}",
                        netns.as_ref().map_or("this network namespace".into(), |p| p.display().to_string())
                    )
                })?)
            } else {
                Box::new(text)
            }
        }
    };
    // Read in the namespace the dataplane is written in, before any policy chain logs there.
    let policy_verdicts = if dataplane == DataplaneMode::Nftables && config.policy_log_group != 0 {
        let (log, group, netns) = (
            crate::policy_log::PolicyVerdictLog::new(),
            config.policy_log_group,
            NetlinkNft::netns_of_command(&config.nft_command),
        );
        let reader = std::sync::Arc::downgrade(&log);
        match tokio::task::spawn_blocking(move || crate::policy_log::listen(netns.as_deref(), group, reader)).await? {
            Ok(()) => {
                metrics.export_policy_verdicts(&log);
                Some(log)
            }
            // Policy works without it: only the API's view of the verdicts is missing.
            Err(e) => {
                tracing::warn!("policy verdicts are logged but not read here: {e}");
                None
            }
        }
    } else {
        None
    };
    let controller_config = ControllerConfig {
        node_name: config.node_name.clone(),
        cluster_cidrs: config.cluster_cidrs.clone(),
        local_detection: config.local_detection,
        service_cidrs: config.service_cidrs.clone(),
        masquerade_all: config.masquerade_all,
        egress_masquerade: config.egress_masquerade.clone(),
        max_module_bytes: config.max_module_bytes,
        crash_budget: config.crash_budget,
        // Shards pay off only for netlink batches: nft 1.0.6 fills its cache table by table,
        // so through `nft -f` a change got slower with shards (9.5 s against 1.8 s at 50k).
        services_per_shard: if config.nft_netlink { config.nft_services_per_shard } else { usize::MAX },
        node_port_addresses: config.node_port_addresses.clone(),
        admission: admission.clone(),
        policy_verdict_log: (config.policy_log_group != 0)
            .then(|| crate::nft::policy::VerdictLog::new(config.policy_log_group).with_rate(config.policy_log_rate)),
    };
    let data_dir = config.data_dir.clone();
    let controller = {
        let (runtime, metrics) = (runtime.clone(), metrics.clone());
        tokio::task::spawn_blocking(move || {
            Controller::new(runtime, metrics, kernel, data_dir.as_deref(), controller_config)
        })
        .await??
    };
    let controller = Arc::new(Mutex::new(controller));
    if let Some(path) = &config.record {
        // Before any source runs: the first recorded revision holds the whole initial state.
        let mut c = controller.lock().unwrap_or_else(|p| p.into_inner());
        let recorder = crate::record::ChangeRecorder::create(path, c.model(), c.dataplane().pod_traffic())
            .context("starting the recording (--record)")?;
        c.add_observer(Box::new(recorder));
    }
    // The gRPC feed observes the model before any source can change it, so that every
    // revision is published (and counted) and none only reaches watchers in a snapshot.
    let feed = config.grpc_listen.map(|_| model_feed_of(&controller));
    let kv = config.kvstore.open(config.data_dir.as_deref()).await?;
    let modules = Arc::new(Modules::new(ModuleStore::new(kv), controller.clone(), admission.clone()));
    // Modules in force cluster-wide are in force here before any source state is applied.
    let index_revision = modules.sync_now().await.context("loading the module index from the kvstore")?;
    let ready = Arc::new(AtomicBool::new(config.manifests.is_none() && config.kubernetes.is_none()));
    let mut loops = Vec::new();
    let mut watch_status = None;
    if let Some(cert) = &tls_cert {
        loops.push(tokio::spawn(crate::auth::reload_tls(Arc::downgrade(cert), config.tls_reload_interval)));
    }

    if let Some(source) = &config.kubernetes {
        let client = source.client().await?;
        let status = Arc::new(WatchStatus::default());
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        loops.extend(wasmplane_sources::kube::spawn_watchers(client, tx, status.clone()));
        loops.push(tokio::spawn(apply_watch_events(rx, controller.clone(), ready.clone(), config.min_sync_period)));
        watch_status = Some(status);
    } else if let Some(dir) = config.manifests.clone() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        loops.push(tokio::spawn(wasmplane_sources::manifests::watch_dir(dir.clone(), config.manifest_poll, tx)));
        let (controller, ready) = (controller.clone(), ready.clone());
        loops.push(tokio::spawn(async move {
            while let Some(set) = rx.recv().await {
                for e in &set.errors {
                    tracing::warn!("manifest skipped: {e}");
                }
                tracing::info!(files = set.files, objects = set.objects.len(), errors = set.errors.len(), dir = %dir.display(), "manifests loaded");
                let controller = controller.clone();
                let result = tokio::task::spawn_blocking(move || {
                    controller.lock().unwrap_or_else(|p| p.into_inner()).replace_objects(set.objects)
                })
                .await;
                match result {
                    Ok(Ok(())) => ready.store(true, Ordering::Relaxed),
                    Ok(Err(e)) => tracing::error!("applying manifests: {e}"),
                    Err(e) => tracing::error!("manifest task failed: {e}"),
                }
            }
        }));
    }

    // One policy (and one cache of Kubernetes reviews) for the REST API and the gRPC stream.
    let auth = Arc::new(auth);
    let (mut grpc_addr, mut model_feed) = (None, None);
    if let (Some(listen), Some(feed)) = (config.grpc_listen, feed) {
        metrics.export_model_feed(feed.clone());
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding the gRPC listener {listen}"))?;
        let addr = listener.local_addr()?;
        grpc_addr = Some(addr);
        // The stream is the node's whole model: the REST API's rule for reads, and its TLS.
        let serving = wasmplane_grpc::WatchService::new(feed.clone())
            .authorize(Arc::new(crate::grpc_auth::GrpcAuth::new(auth.clone())));
        let grpc_tls = tls_config.as_deref().map(crate::grpc_auth::grpc_tls_config);
        tracing::info!(%addr, tls = grpc_tls.is_some(), kubernetes_auth = config.kubernetes_auth.is_some(), "serving the node-local model over gRPC: loopback clients need no token, others a bearer token");
        loops.push(tokio::spawn(async move {
            if let Err(e) = crate::grpc_auth::serve(serving, listener, grpc_tls, std::future::pending()).await {
                tracing::error!("gRPC model server failed: {e:#}");
            }
        }));
        model_feed = Some(feed);
    }

    if !operator_role && (config.health_check_bind.is_some() || config.node_health_listen.is_some()) {
        // Apart: a guard in the initializer below would live to its end, and `follow_node` locks too.
        let writes = controller.lock().unwrap_or_else(|p| p.into_inner()).dataplane().health.clone();
        let health = crate::service_health::ProxyHealth {
            ready: ready.clone(),
            writes,
            timeout: 2 * config.reconcile_interval,
            node_being_deleted: crate::service_health::follow_node(&controller),
        };
        if let Some(bind) = config.health_check_bind {
            loops.push(tokio::spawn(crate::service_health::serve(
                bind,
                crate::service_health::follow(&controller),
                health.clone(),
            )));
        }
        if let Some(listen) = config.node_health_listen {
            loops.push(tokio::spawn(crate::service_health::serve_node(listen, health)));
        }
    }

    loops.push(tokio::spawn(modules.clone().follow(index_revision)));
    let agent = match config.agent.clone().filter(|_| !operator_role) {
        Some(agent_config) => Some(Arc::new(
            crate::agent::Agent::start(
                modules.store().kv().clone(),
                &controller,
                agent_config,
                metrics.clustermesh.clone(),
            )
            .await
            .context("registering this node in the kvstore")?,
        )),
        None => None,
    };
    let operator = match config.operator.clone() {
        Some(operator_config) => {
            let client = match &config.kubernetes {
                Some(source) => Some(source.client().await?),
                None => None,
            };
            let role = crate::operator_role::OperatorRole::start(
                modules.store().kv().clone(),
                client,
                runtime.clone(),
                modules.clone(),
                config.max_module_bytes,
                operator_config,
            )
            .await?;
            metrics.export_gc(role.gc_stats().clone());
            Some(Arc::new(role))
        }
        None => None,
    };
    let cni_daemon = crate::cni::ServingDaemon::default();
    let cni = config.cni.clone().filter(|_| !operator_role).map(|cni| {
        let (stop, stopped) = oneshot::channel();
        (
            stop,
            tokio::spawn(crate::cni::run(
                cni,
                config.data_dir.clone(),
                controller.clone(),
                ready.clone(),
                cni_daemon.clone(),
                stopped,
            )),
        )
    });
    {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        controller.lock().unwrap_or_else(|p| p.into_inner()).set_rollback_sink(tx);
        loops.push(tokio::spawn(modules.clone().handle_rollbacks(rx)));
    }
    loops.push(tokio::spawn(log_stats(metrics.clone(), config.stats_interval)));

    if dataplane == DataplaneMode::Nftables && config.node_port_addresses.needs_local_addresses() {
        // Node ports on the interfaces' addresses inside networks: they follow an address
        // that comes or goes at once (kube-proxy reads them at its next sync).
        let changed = Arc::new(tokio::sync::Notify::new());
        let weak = Arc::downgrade(&changed);
        let netns = NetlinkNft::netns_of_command(&config.nft_command);
        if let Err(e) = crate::dataplane::watch_interface_addresses(netns.as_deref(), move || {
            weak.upgrade().map(|n| n.notify_one()).is_some()
        }) {
            // Not fatal: the periodic reconcile still reads them again.
            tracing::warn!(
                "not watching the node's interface addresses for --nodeport-addresses (they follow at each reconcile): {e}"
            );
        }
        let controller = controller.clone();
        loops.push(tokio::spawn(async move {
            loop {
                changed.notified().await;
                // A burst (an interface coming up with several addresses) is read once.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let controller = controller.clone();
                match tokio::task::spawn_blocking(move || {
                    controller.lock().unwrap_or_else(|p| p.into_inner()).interface_addresses_changed()
                })
                .await
                {
                    Ok(Ok(true)) => tracing::info!("node ports moved with the node's interface addresses"),
                    Ok(Err(e)) => tracing::error!("writing node ports after an address change: {e}"),
                    _ => {}
                }
            }
        }));
    }
    {
        let controller = controller.clone();
        let interval = config.reconcile_interval;
        loops.push(tokio::spawn(async move {
            // A full reconcile holds the controller (changes wait) for as long as the kernel
            // takes to reload the table: 0.5 s at 1k services, 34 s at 50k. So the pause
            // after one that took over a second is the configured interval or 100× what it
            // took, whichever is longer: reconciles stay ≤ 1% of the time (kube-proxy's
            // nftables mode does a full sync once an hour).
            let mut pause = interval;
            loop {
                tokio::time::sleep(pause).await;
                let started = std::time::Instant::now();
                let controller = controller.clone();
                let result = tokio::task::spawn_blocking(move || {
                    let mut controller = controller.lock().unwrap_or_else(|p| p.into_inner());
                    // Would-be drops of audited policies reach /metrics once per interval
                    // (reading the counters lists the whole table: only when asked for).
                    if controller.any_policy_audited()
                        && let Err(e) = controller.refresh_policy_metrics(true)
                    {
                        tracing::warn!("reading policy counters: {e}");
                    }
                    controller.reconcile()
                })
                .await;
                if let Ok(Err(e)) = result {
                    tracing::error!("periodic reconcile failed: {e}");
                }
                let took = started.elapsed();
                pause = if took > Duration::from_secs(1) { interval.max(took * 100) } else { interval };
                if pause > interval {
                    tracing::debug!(?took, next_in = ?pause, "periodic reconcile");
                }
            }
        }));
    }

    let state = ApiState {
        policy_verdicts: policy_verdicts.clone(),
        cni: cni.is_some().then(|| cni_daemon.clone()),
        controller: controller.clone(),
        metrics: metrics.clone(),
        token: Arc::new(token.clone()),
        ready: ready.clone(),
        max_module_bytes: config.max_module_bytes,
        modules: modules.clone(),
        agent: agent.clone(),
        operator: operator.clone(),
        auth,
        audit: Arc::new(crate::audit::Audit::new(
            modules.store().kv().clone(),
            config.node_name.clone(),
            audit_failures,
        )),
    };
    let mut metrics_addr = None;
    if let Some(listen) = config.metrics_listen {
        let proxy_mode = controller.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).dataplane().mode();
        let (bound, task) = crate::metrics_server::start(listen, state.clone(), proxy_mode).await;
        metrics_addr = bound;
        loops.push(task);
    }
    let listener =
        tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let addr = listener.local_addr()?;
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let app = router(state).into_make_service_with_connect_info::<SocketAddr>();
    let shutdown = async {
        let _ = shutdown_rx.await;
    };
    let tls = tls_config.is_some();
    let server = match tls_config {
        Some(tls_config) => {
            use axum::serve::ListenerExt as _;
            // tap_io: axum's ConnectInfo<SocketAddr> is implemented for tapped listeners.
            let listener = crate::auth::TlsListener::new(listener, tls_config)?.tap_io(|_| {});
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                    tracing::error!("REST API server failed: {e}");
                }
            })
        }
        None => tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::error!("REST API server failed: {e}");
            }
        }),
    };
    Ok(RunningHost {
        addr,
        token,
        controller,
        metrics,
        ready,
        watch_status,
        modules,
        agent,
        operator,
        grpc_addr,
        metrics_addr,
        tls,
        compiled_guests,
        policy_verdicts,
        model_feed,
        shutdown: Some(shutdown_tx),
        cni,
        server,
        loops,
    })
}

/// Publishes every model revision to gRPC watchers.
struct FeedObserver(wasmplane_grpc::ModelFeed);

impl crate::controller::ModelObserver for FeedObserver {
    fn model_changed(&self, model: &wasmplane_model::NodeLocalModel, update: &wasmplane_model::state::ModelUpdate) {
        self.0.publish(wasmplane_grpc::Delta::from_update(model, update));
    }
}

/// Revisions a gRPC watcher may fall behind before it is resynced with a full snapshot.
const MODEL_FEED_CAPACITY: usize = 1024;

/// The gRPC feed of the model: deltas published under the controller lock, snapshots taken
/// under it, so a watcher never sees a gap or a duplicate.
fn model_feed_of(controller: &Arc<Mutex<Controller>>) -> wasmplane_grpc::ModelFeed {
    // Weak: the controller owns the observer that owns the feed; a strong reference back
    // would keep all of it alive forever.
    let weak = Arc::downgrade(controller);
    let source = move || match weak.upgrade() {
        Some(controller) => wasmplane_grpc::Snapshot::of(controller.lock().unwrap_or_else(|p| p.into_inner()).model()),
        None => wasmplane_grpc::Snapshot { revision: 0, node: Default::default(), services: Vec::new() },
    };
    let feed = wasmplane_grpc::ModelFeed::new(Arc::new(source), MODEL_FEED_CAPACITY);
    controller.lock().unwrap_or_else(|p| p.into_inner()).add_observer(Box::new(FeedObserver(feed.clone())));
    feed
}

/// Most watch events a single model update takes; bounds the lock hold time under a burst.
const MAX_BATCH: usize = 1024;

/// Most watch events a batch takes after waiting for `--min-sync-period`: what queued meanwhile
/// goes in whole (the channel holds 1,024 more), unless a burst outruns even this.
const MAX_PACED_BATCH: usize = 16 * MAX_BATCH;

/// Feeds watcher output to the controller in batches: whatever has queued up while the
/// previous batch was applied goes in as one model update, so a burst of events costs one
/// revision and one dataplane transaction. With `min_sync_period`, batches also wait for the
/// pacer (`sync_pacer.rs`) and take what arrived while they waited. Ready once every kind's
/// first list is applied.
/// How long the watch streams must be quiet before the heap's free pages go back to the
/// kernel (`malloc_trim`): applying a batch frees what it built, in pages partly used
/// until a trim. Once per quiet spell, so that a steady stream of changes pays nothing;
/// full syncs trim as well (`Dataplane`). BENCHMARKS.md, forty-first run: 0.1 MiB at 1k
/// services once the churn is over.
const QUIET_BEFORE_TRIM: Duration = Duration::from_secs(1);

async fn apply_watch_events(
    mut rx: tokio::sync::mpsc::Receiver<SourceEvent>,
    controller: Arc<Mutex<Controller>>,
    ready: Arc<AtomicBool>,
    min_sync_period: Duration,
) {
    let mut pacer = crate::sync_pacer::SyncPacer::new(min_sync_period, std::time::Instant::now());
    let mut listed = std::collections::BTreeSet::new();
    // Until every kind has been listed, nothing is applied: Services without their
    // EndpointSlices would be written as "no endpoints" and reject traffic for a moment.
    // The first complete state goes in as one update, one revision, one transaction.
    let mut initial: Vec<SourceEvent> = Vec::new();
    // A batch was applied since the heap was last trimmed (see `QUIET_BEFORE_TRIM`).
    let mut trim_when_quiet = false;
    loop {
        let trim = || async {
            let _ = tokio::task::spawn_blocking(crate::memory::release_free_memory).await;
        };
        let Some(first) = next_or_when_quiet(&mut rx, &mut trim_when_quiet, QUIET_BEFORE_TRIM, trim).await else {
            break;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(more) => batch.push(more),
                Err(_) => break,
            }
        }
        listed.extend(
            batch.iter().filter_map(|e| if let SourceEvent::Relisted { kind, .. } = e { Some(*kind) } else { None }),
        );
        let complete = WATCHED_KINDS.iter().all(|k| listed.contains(k));
        if !ready.load(Ordering::Relaxed) && !complete {
            initial.append(&mut batch);
            continue;
        }
        let first_sync = !ready.load(Ordering::Relaxed);
        if first_sync {
            initial.append(&mut batch);
            batch = std::mem::take(&mut initial);
        } else {
            let wait = pacer.delay(std::time::Instant::now());
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
                while batch.len() < MAX_PACED_BATCH {
                    match rx.try_recv() {
                        Ok(more) => batch.push(more),
                        Err(_) => break,
                    }
                }
            }
        }
        pacer.ran(std::time::Instant::now());
        trim_when_quiet = true;
        let applying = controller.clone();
        let result = tokio::task::spawn_blocking(move || {
            let mut controller = applying.lock().unwrap_or_else(|p| p.into_inner());
            controller.apply_source(batch)?;
            // Written even when the cluster is empty, ending the hold on old rules.
            if first_sync { controller.release_dataplane() } else { Ok(()) }
        })
        .await;
        match result {
            Ok(Ok(())) => {}
            // The model took the change; only writing it failed. The periodic reconcile retries.
            Ok(Err(e)) => tracing::error!("applying cluster changes: {e}"),
            Err(e) => tracing::error!("cluster change task failed: {e}"),
        }
        if first_sync {
            tracing::info!("initial sync of every watched kind done: ready");
            ready.store(true, Ordering::Relaxed);
        }
    }
}

/// The next message of `rx` (`None` once it is closed). While `armed`, a wait longer than
/// `quiet` runs `when_quiet` once and disarms.
async fn next_or_when_quiet<T, F: std::future::Future<Output = ()>>(
    rx: &mut tokio::sync::mpsc::Receiver<T>,
    armed: &mut bool,
    quiet: Duration,
    when_quiet: impl FnOnce() -> F,
) -> Option<T> {
    if *armed {
        match tokio::time::timeout(quiet, rx.recv()).await {
            Ok(next) => return next,
            Err(_quiet) => {
                *armed = false;
                when_quiet().await;
            }
        }
    }
    rx.recv().await
}

/// The periodic stats line: how much came in, how little of it was a real change.
async fn log_stats(metrics: Arc<Metrics>, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.tick().await;
    let (mut last_events, mut last_revisions) = (0, 0);
    loop {
        ticker.tick().await;
        let (events, revisions) = (metrics.events.get(), metrics.revisions.get());
        tracing::info!(
            events_total = events,
            revisions_total = revisions,
            events = events - last_events,
            revisions = revisions - last_revisions,
            services = metrics.services.get(),
            policies = metrics.policies.get(),
            local_pods = metrics.local_pods.get(),
            "model stats (events in, revisions out)"
        );
        (last_events, last_revisions) = (events, revisions);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Armed, a wait with nothing to read runs `when_quiet` once and disarms; a message
    /// already waiting is read without it; unarmed, nothing runs.
    #[tokio::test]
    async fn a_quiet_spell_after_a_batch_runs_the_trim_once() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let runs = std::sync::atomic::AtomicUsize::new(0);
        let count = || async {
            runs.fetch_add(1, Ordering::Relaxed);
        };
        let quiet = Duration::from_millis(20);

        let mut armed = true;
        tx.send(1).await.unwrap();
        assert_eq!(next_or_when_quiet(&mut rx, &mut armed, quiet, count).await, Some(1));
        assert_eq!((runs.load(Ordering::Relaxed), armed), (0, true), "a waiting message is no quiet spell");

        let sender = tx.clone();
        let later = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            sender.send(2).await.unwrap();
        });
        assert_eq!(next_or_when_quiet(&mut rx, &mut armed, quiet, count).await, Some(2));
        assert_eq!((runs.load(Ordering::Relaxed), armed), (1, false), "the quiet spell ran it once, then waited on");
        later.await.unwrap();

        tx.send(3).await.unwrap();
        drop(tx);
        assert_eq!(next_or_when_quiet(&mut rx, &mut armed, quiet, count).await, Some(3));
        assert_eq!(next_or_when_quiet(&mut rx, &mut armed, quiet, count).await, None, "closed");
        assert_eq!(runs.load(Ordering::Relaxed), 1, "unarmed, nothing more ran");
    }
}
