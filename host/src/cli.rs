//! The command line: `wasmplane run` and `wasmplane module …` against the REST API.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

use crate::app::{DataplaneMode, HostConfig};

#[derive(Parser, Debug)]
#[command(
    name = "wasmplane",
    version,
    about = "Kubernetes networking control plane whose decisions are Wasm components"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
// Parsed once per process: the size of the `run` variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run the host.
    Run(RunArgs),
    /// Manage guest modules through a running host's REST API.
    Module {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: ModuleCommand,
    },
    /// Run a service translator offline over a recording (`run --record`) and print its outputs.
    Replay(crate::replay::ReplayArgs),
    /// Remove what `wasmplane run` wrote to this node, as kube-proxy's `--cleanup` does: its
    /// nftables tables (services, policy, host ports) and its routes to other nodes' pods.
    /// Run it in the node's network namespace once the agent is stopped (uninstalling, or
    /// moving to another proxy); pods' own interfaces stay, they go with the pods.
    Cleanup(CleanupArgs),
    /// This node's host at a glance, through its REST API (`cilium status`): ready or why
    /// not, the model's counts, the last sync, the modules in force. Exits 1 when not ready.
    Status {
        #[command(flatten)]
        api: ApiArgs,
    },
    /// This node's services as its host sees them, through its REST API (`cilium service
    /// list`): endpoints ready, total and local, and translation errors.
    Service {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: ServiceCommand,
    },
    /// This node's pods as its host sees them, through its REST API (`cilium endpoint
    /// list|get`): policy enforcement per direction, the policies selecting each, its drops.
    Pod {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: PodCommand,
    },
    /// The nodes this node's agent knows, through its REST API (`cilium node list`): this
    /// cluster's registered nodes and other clusters' followed ones, their IDs, addresses and
    /// pod CIDRs, and the route this node has to each one's pods.
    Node {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::inspect::NodeCommand,
    },
    /// This node's network policies and the packets they drop, through its REST API
    /// (`hubble observe --verdict DROPPED`): `ls` and `verdicts [-f]`.
    Policy {
        #[command(flatten)]
        api: ApiArgs,
        #[command(subcommand)]
        command: crate::inspect::PolicyCommand,
    },
    /// Every packet this node logged as dropped, through its REST API, oldest first: policy
    /// verdicts, and the service side's drops and rejects (no endpoints, no local endpoints,
    /// outside the source ranges, a cluster IP's unknown port, an unallocated address) with
    /// the service named (Cilium's "Service backend not found"). `-f` follows.
    Drops {
        #[command(flatten)]
        api: ApiArgs,
        #[command(flatten)]
        args: crate::inspect::DropsArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum ServiceCommand {
    /// One line per service.
    Ls {
        /// Only this namespace's.
        #[arg(long, short)]
        namespace: Option<String>,
    },
    /// One service: the model's view of it, the rules applied for it, its error.
    Get { namespace: String, name: String },
}

#[derive(Subcommand, Debug)]
pub enum PodCommand {
    /// One line per pod on this node: addresses, ingress and egress enforced or not, the
    /// policies selecting it.
    Ls {
        /// Only this namespace's.
        #[arg(long, short)]
        namespace: Option<String>,
    },
    /// One pod on this node: labels, each policy selecting it (directions, audit mode), where
    /// the CNI daemon took its addresses from, its latest drops.
    Get {
        #[arg(value_name = "NS/NAME")]
        pod: crate::inspect::NamespacedName,
        /// Also the kernel's counts of its dispatch chains: the new connections each
        /// selecting policy accepted, and those dropped, per direction.
        #[arg(long)]
        counters: bool,
    },
}

#[derive(clap::Args, Debug)]
pub struct CleanupArgs {
    /// The CNI configuration the agent installed (`/etc/cni/net.d/10-wasmplane.conflist`),
    /// removed too so that the runtime stops calling the plugin.
    #[arg(long)]
    pub cni_conf: Option<PathBuf>,
}

/// `wasmplane cleanup`: says what it removed; nothing to remove is no error.
pub async fn cleanup(args: CleanupArgs) -> anyhow::Result<()> {
    let mut kernel = crate::dataplane::NftCommand::new(vec!["nft".into()], Vec::new());
    let tables = tokio::task::spawn_blocking(move || crate::dataplane::remove_tables(&mut kernel))
        .await?
        .context("removing wasmplane's nftables tables")?;
    let listed = |removed: Vec<String>| if removed.is_empty() { "none".to_string() } else { removed.join(", ") };
    println!("nftables tables removed: {}", listed(tables.iter().map(ToString::to_string).collect()));
    let routes = wasmplane_operator::remove_routes(wasmplane_operator::DEFAULT_ROUTE_PROTOCOL)
        .await
        .context("removing wasmplane's routes")?;
    println!("routes removed: {}", listed(routes.iter().map(ToString::to_string).collect()));
    if let Some(conf) = args.cni_conf {
        match std::fs::remove_file(&conf) {
            Ok(()) => println!("CNI configuration removed: {}", conf.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("CNI configuration: {} was not there", conf.display())
            }
            Err(e) => return Err(e).with_context(|| format!("removing {}", conf.display())),
        }
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// kube-proxy's configuration file (a KubeProxyConfiguration: the `config.conf` key of
    /// its ConfigMap): the settings wasmplane has flags for are taken from it, unless given
    /// here as flags or environment variables; those it cannot honour are logged.
    #[arg(long, env = "WASMPLANE_KUBE_PROXY_CONFIG", value_name = "FILE")]
    pub kube_proxy_config: Option<PathBuf>,
    /// Address of the REST API.
    #[arg(long, env = "WASMPLANE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// How the log is written to stderr: `text`, a line per event for people, or `json`, an
    /// object per line for log collectors (kube-proxy's `--logging-format=json`).
    #[arg(long, env = "WASMPLANE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// This process's `oom_score_adj` (kube-proxy's `--oom-score-adj`, its default too): under
    /// memory pressure the kernel kills the node's networking last. Lowering it needs
    /// CAP_SYS_RESOURCE; without it the host logs a warning and runs as it is.
    #[arg(long, env = "WASMPLANE_OOM_SCORE_ADJ", default_value_t = -999, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    pub oom_score_adj: i32,
    /// Directory of Kubernetes YAML manifests standing in for the API server (embedded mode).
    #[arg(long, env = "WASMPLANE_MANIFESTS", conflicts_with_all = ["kubeconfig", "kubernetes"])]
    pub manifests: Option<PathBuf>,
    /// Watch the Kubernetes API server named in this kubeconfig.
    #[arg(long, env = "WASMPLANE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Watch the Kubernetes API server found as kubectl would ($KUBECONFIG, ~/.kube/config,
    /// or in-cluster service account).
    #[arg(long, conflicts_with = "kubeconfig")]
    pub kubernetes: bool,
    /// Where hosts share modules: `embedded` (in this process, kept in the data dir) or
    /// `etcd://host:port[,host:port...]`.
    #[arg(long, env = "WASMPLANE_KVSTORE", default_value = "embedded", value_parser = crate::app::KvstoreConfig::parse)]
    pub kvstore: crate::app::KvstoreConfig,
    /// The CA certificate (PEM) that signed etcd's; needed for `https://` etcd endpoints.
    #[arg(long, env = "WASMPLANE_ETCD_TRUSTED_CA_FILE")]
    pub etcd_trusted_ca_file: Option<PathBuf>,
    /// A client certificate (PEM) for an etcd that asks for one (`--client-cert-auth`).
    #[arg(long, env = "WASMPLANE_ETCD_CERT_FILE", requires_all = ["etcd_key_file", "etcd_trusted_ca_file"])]
    pub etcd_cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "WASMPLANE_ETCD_KEY_FILE", requires = "etcd_cert_file")]
    pub etcd_key_file: Option<PathBuf>,
    /// An etcd user, when etcd's authentication is on (its password: WASMPLANE_ETCD_PASSWORD,
    /// from the environment only). Use it over TLS.
    #[arg(long, env = "WASMPLANE_ETCD_USERNAME")]
    pub etcd_username: Option<String>,
    /// An etcd client configuration file instead of --kvstore and the --etcd-* files, in the
    /// format of Cilium's `etcd.config` (`endpoints`, `trusted-ca-file`, `cert-file`,
    /// `key-file`; relative paths from the file's directory).
    #[arg(long, env = "WASMPLANE_ETCD_CONFIG", conflicts_with_all = ["kvstore", "etcd_trusted_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_username"])]
    pub etcd_config: Option<PathBuf>,
    /// Serve the CNI daemon for the `wasmplane-cni` plugin on this unix socket (off when unset).
    #[arg(long, env = "WASMPLANE_CNI_SOCKET")]
    pub cni_socket: Option<PathBuf>,
    /// This node's pod CIDRs for CNI address allocation, at most one IPv4 and one IPv6, the
    /// primary family first (comma-separated or repeated; default: from this node's Node
    /// object's `spec.podCIDRs`).
    #[arg(long = "pod-cidr", env = "WASMPLANE_POD_CIDR", requires = "cni_socket", value_delimiter = ',')]
    pub pod_cidrs: Vec<ipnet::IpNet>,
    /// Chain the CNI daemon after the plugin that gives pods their addresses (AWS VPC CNI,
    /// Azure CNI, flannel...; Cilium's `cni-chaining-mode`): `wasmplane-cni` comes after it
    /// in the conflist, takes each pod's addresses from its result, and creates, allocates
    /// and turns on nothing (no pod CIDRs).
    #[arg(long, env = "WASMPLANE_CNI_CHAINED", requires = "cni_socket", conflicts_with = "pod_cidrs")]
    pub cni_chained: bool,
    /// MTU of the pods' interfaces (both veth ends): 576 to 65535, at least 1280 with an IPv6
    /// pod CIDR; 0: that of the device of the node's default route (IPv4's, else IPv6's),
    /// read when the CNI daemon starts, as Cilium and Calico do. Ignored when chained.
    #[arg(long, env = "WASMPLANE_CNI_MTU", requires = "cni_socket", default_value_t = 0)]
    pub cni_mtu: u32,
    /// gRPC listen address of the node-local model stream (off when unset).
    #[arg(long, env = "WASMPLANE_GRPC_LISTEN")]
    pub grpc_listen: Option<SocketAddr>,
    /// Address the load balancer health checks of `LoadBalancer` services with
    /// `externalTrafficPolicy: Local` are answered on, each on its `healthCheckNodePort`
    /// (kube-proxy's), or `off`.
    #[arg(long, env = "WASMPLANE_HEALTH_CHECK_BIND_ADDRESS", default_value = "0.0.0.0", value_parser = health_check_bind)]
    pub health_check_bind_address: HealthCheckBind,
    /// Address of the node's health for load balancers (`/healthz`, `/livez`; kube-proxy's
    /// `--healthz-bind-address`), or `off`.
    #[arg(long, env = "WASMPLANE_NODE_HEALTH_LISTEN", default_value = "0.0.0.0:10256", value_parser = node_health_listen)]
    pub node_health_listen: NodeHealthListen,
    /// Also serve `/metrics` alone on this address, without a token (kube-proxy's
    /// `--metrics-bind-address`, e.g. `0.0.0.0:10249`), for scrapers that should not reach
    /// the REST API. Unset: metrics only on the REST API (`--listen`), which asks clients
    /// off loopback for a token.
    #[arg(long, env = "WASMPLANE_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Record the translator's inputs and outputs of every model revision to this file
    /// (JSON lines; `wasmplane replay FILE` runs a module over it).
    #[arg(long, env = "WASMPLANE_RECORD")]
    pub record: Option<PathBuf>,
    /// Where modules, compiled code and the API token are kept.
    #[arg(long, env = "WASMPLANE_DATA_DIR", default_value = "/var/lib/wasmplane")]
    pub data_dir: PathBuf,
    /// This node's name (endpoints on it are local).
    #[arg(long, env = "NODE_NAME", default_value = "node-a")]
    pub node_name: String,
    /// Pod CIDRs of the cluster; with `--detect-local-mode ClusterCIDR` (the default), traffic
    /// from outside them to services is masqueraded.
    #[arg(
        long = "cluster-cidr",
        env = "WASMPLANE_CLUSTER_CIDRS",
        value_delimiter = ',',
        default_value = "10.244.0.0/16"
    )]
    pub cluster_cidrs: Vec<String>,
    /// Which traffic is the cluster's pods' (kube-proxy's `--detect-local-mode`): `ClusterCIDR`
    /// (sources in --cluster-cidr), `NodeCIDR` (sources in this node's pod CIDRs from its Node
    /// object, nothing to configure; traffic from other nodes' pods then counts as
    /// off-cluster), `InterfaceNamePrefix` (in through an interface named
    /// --pod-interface-name-prefix*) or `BridgeInterface` (in through --pod-bridge-interface).
    /// In the interface modes, guests built against WIT 1.0, which cannot say "pod traffic",
    /// still go by --cluster-cidr.
    #[arg(long, env = "WASMPLANE_DETECT_LOCAL_MODE", value_enum, default_value = "ClusterCIDR")]
    pub detect_local_mode: DetectLocalMode,
    /// The name prefix of the node's side of pods' interfaces (`veth`, Calico's `cali`), for
    /// `--detect-local-mode InterfaceNamePrefix` (kube-proxy's flag).
    #[arg(long, env = "WASMPLANE_POD_INTERFACE_NAME_PREFIX", value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// The bridge pods' interfaces are attached to (kubenet's `cbr0`), for
    /// `--detect-local-mode BridgeInterface` (kube-proxy's flag).
    #[arg(long, env = "WASMPLANE_POD_BRIDGE_INTERFACE", value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,
    /// Service CIDRs of the cluster (the API server's `--service-cluster-ip-range`), beside
    /// those of ServiceCIDR objects (Kubernetes 1.33): new connections to an address in them
    /// that is no service's are dropped, not routed off the node.
    #[arg(long = "service-cidr", env = "WASMPLANE_SERVICE_CIDRS", value_delimiter = ',')]
    pub service_cidrs: Vec<String>,
    /// Masquerade every connection to a cluster IP, from pods as from anywhere else
    /// (kube-proxy's `--masquerade-all`; by default only what leaves the cluster CIDRs for a
    /// service, node ports and hairpin traffic is).
    #[arg(long, env = "WASMPLANE_MASQUERADE_ALL")]
    pub masquerade_all: bool,
    /// Masquerade what this node's pods send out of the cluster, as every CNI that routes pod
    /// addresses does (nothing outside routes them back): `auto` is on when this host serves
    /// the CNI and is not chained (the plugin before a chained one does its own).
    #[arg(long, env = "WASMPLANE_EGRESS_MASQUERADE", value_enum, default_value = "auto")]
    pub egress_masquerade: EgressMasqueradeMode,
    /// Destinations pods reach with their own address besides the cluster CIDRs and this
    /// node's pod CIDRs (the kubelet's and ip-masq-agent's non-masquerade CIDRs): a peered
    /// network that routes the pod CIDRs, say.
    #[arg(long = "non-masquerade-cidr", env = "WASMPLANE_NON_MASQUERADE_CIDRS", value_delimiter = ',')]
    pub non_masquerade_cidrs: Vec<ipnet::IpNet>,
    /// Connections tracked per CPU: the node's conntrack table is raised to this times the
    /// CPUs, at least --conntrack-min, never lowered (kube-proxy's; 0: leave it).
    #[arg(long, default_value_t = 32768)]
    pub conntrack_max_per_core: u64,
    /// The smallest table --conntrack-max-per-core raises to.
    #[arg(long, default_value_t = 131072)]
    pub conntrack_min: u64,
    /// Idle established TCP connections are forgotten after this (kube-proxy's 24 h; the
    /// kernel's is 5 days; 0: leave it).
    #[arg(long, default_value_t = 86400)]
    pub conntrack_tcp_timeout_established_seconds: u64,
    /// Half-closed TCP connections (CLOSE_WAIT) are forgotten after this (kube-proxy's 1 h;
    /// the kernel's is 60 s; 0: leave it).
    #[arg(long, default_value_t = 3600)]
    pub conntrack_tcp_timeout_close_wait_seconds: u64,
    /// UDP flows that saw packets one way only (a DNS query) are forgotten after this
    /// (kube-proxy's --conntrack-udp-timeout; 0: leave the kernel's 30 s).
    #[arg(long, default_value_t = 0)]
    pub conntrack_udp_timeout_seconds: u64,
    /// UDP flows that saw replies are forgotten after this idle time (kube-proxy's
    /// --conntrack-udp-timeout-stream; 0: leave the kernel's 120 s).
    #[arg(long, default_value_t = 0)]
    pub conntrack_udp_timeout_stream_seconds: u64,
    /// Out-of-window TCP packets are not marked INVALID (kube-proxy's
    /// --conntrack-tcp-be-liberal): for networks that reorder or retransmit heavily.
    #[arg(long)]
    pub conntrack_tcp_be_liberal: bool,
    /// The NFLOG group policy drops and audit verdicts are logged to, rate-limited per pod,
    /// and read back for `GET /v1/policies/verdicts` (0: not logged; audit verdicts then go
    /// to the kernel log). Another NFLOG reader (ulogd) must use another group.
    #[arg(long, env = "WASMPLANE_POLICY_LOG_GROUP", default_value_t = 1001)]
    pub policy_log_group: u16,
    /// Packets a second each log rule passes to that group, after a burst of twice as many:
    /// per pod and direction for policy verdicts and logged allows, per frontend (address,
    /// protocol, port) for service drops (`GET /v1/drops`); each service drop rule and each
    /// policy's allow chain at most ten times that. What a flood of logged packets costs the
    /// host is bounded by it.
    #[arg(long, env = "WASMPLANE_POLICY_LOG_RATE", default_value_t = crate::nft::policy::DEFAULT_LOG_RATE, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub policy_log_rate: u32,
    /// Render the dataplane (`record`) or write it to the kernel (`nftables`).
    #[arg(long, env = "WASMPLANE_DATAPLANE", value_enum, default_value = "record")]
    pub dataplane: DataplaneMode,
    /// File holding the bearer token for mutating API calls (default: <data-dir>/token, created if missing).
    #[arg(long, env = "WASMPLANE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Largest module accepted, in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_module_bytes: usize,
    /// Per-call time limit of a guest, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub guest_timeout_ms: u64,
    /// Linear-memory limit of a guest, in MiB (at most 4096: guests have 32-bit memories).
    #[arg(long, default_value_t = 64, value_parser = guest_memory_mib)]
    pub guest_memory_mib: usize,
    /// Seconds between full reconciles of the dataplane (after one that took over a second,
    /// at least 100× its duration, so big tables are reconciled less often).
    #[arg(long, default_value_t = 60)]
    pub reconcile_seconds: u64,
    /// The shortest average interval between applying changes from the Kubernetes API (kube-proxy's
    /// `minSyncPeriod`), as a Go duration (`1s`, `500ms`): what arrives meanwhile is applied
    /// together; the first change after a quiet period, and one more right after it, are not
    /// delayed. `0s` (the default) applies each batch at once, which already takes together
    /// whatever queued while the previous one was written.
    #[arg(long, env = "WASMPLANE_MIN_SYNC_PERIOD", default_value = "0s", value_parser = crate::kube_proxy_config::parse_go_duration)]
    pub min_sync_period: std::time::Duration,
    /// Keep the code resident after the initial sync. By default the host hands the code and
    /// read-only data of its binary, the compiled guests and the shared libraries back to the
    /// kernel then (most of it ran only at start-up); this is for tracing which code the host
    /// runs at all.
    #[arg(long)]
    pub no_page_out: bool,
    /// Write incremental changes with `nft -f` too, instead of netlink batches (full syncs
    /// always go through `nft -f`).
    #[arg(long)]
    pub nft_text_only: bool,
    /// Services per nftables shard table: the next full sync spreads services over
    /// services/N tables (a power of two, at most 64), so a change's commit validates one
    /// shard, not every service. Ignored with `--nft-text-only` (one table).
    #[arg(long, default_value_t = crate::nft::Layout::DEFAULT_SERVICES_PER_SHARD)]
    pub nft_services_per_shard: usize,
    /// Where node ports are served (kube-proxy's `--nodeport-addresses`): `all` local
    /// addresses but loopback; `primary`, the node's first address of each family as its
    /// Node object lists them (kube-proxy's nftables default); or CIDRs, the local addresses
    /// inside them (read again at each reconcile).
    #[arg(long, env = "WASMPLANE_NODEPORT_ADDRESSES", default_value = "all")]
    pub nodeport_addresses: crate::nft::NodePortAddresses,
    /// Require every upload to be signed by one of these ed25519 public keys (repeatable;
    /// a file holds one key: 64 hex characters or SPKI PEM). None: signatures not required.
    #[arg(long = "trusted-key", env = "WASMPLANE_TRUSTED_KEYS", value_delimiter = ',')]
    pub trusted_keys: Vec<PathBuf>,
    /// YAML map of module name (or "*") to the capabilities it may import (`log`,
    /// `lookups`). Without it every module is granted every capability.
    #[arg(long, env = "WASMPLANE_GRANTS")]
    pub grants: Option<PathBuf>,
    /// Serve the REST API and the gRPC stream over TLS with this certificate chain (PEM).
    #[arg(long, env = "WASMPLANE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The TLS private key (PEM: PKCS#8, RSA or SEC1).
    #[arg(long, env = "WASMPLANE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Also accept Kubernetes bearer tokens: checked by TokenReview, authorized by
    /// SubjectAccessReview (API server from --kubeconfig, else found as kubectl would).
    #[arg(long, env = "WASMPLANE_KUBERNETES_AUTH")]
    pub kubernetes_auth: bool,
    /// SubjectAccessReview verb for mutating calls (reads ask `get`).
    #[arg(long, default_value = "update")]
    pub auth_verb: String,
    /// SubjectAccessReview API group.
    #[arg(long, default_value = "wasmplane.io")]
    pub auth_group: String,
    /// SubjectAccessReview resource.
    #[arg(long, default_value = "modules")]
    pub auth_resource: String,
    /// SubjectAccessReview namespace (default: cluster-wide).
    #[arg(long)]
    pub auth_namespace: Option<String>,
    /// Seconds a TokenReview/SubjectAccessReview answer is reused for the same token.
    #[arg(long, default_value_t = 10)]
    pub auth_cache_seconds: u64,
    /// Crashes (trap, limit, invalid output) of the module in force tolerated within
    /// `--crash-window-seconds` before it is rolled back to its last good version.
    #[arg(long, default_value_t = 5)]
    pub crash_budget: usize,
    #[arg(long, default_value_t = 60)]
    pub crash_window_seconds: u64,
    /// Program routes to other nodes' pod CIDRs (via their registered node IPs) in this
    /// host's namespace.
    #[arg(long, env = "WASMPLANE_NODE_ROUTES")]
    pub node_routes: bool,
    /// `/readyz` fails when the operator's kvstore heartbeat is older than this many seconds
    /// (0: not followed; the operator writes it every minute).
    #[arg(long, default_value_t = 0)]
    pub heartbeat_max_age_seconds: u64,
    /// `agent` (every node: dataplane, CNI, node registration) or `operator` (cluster-wide
    /// duties, one leader among replicas by a coordination.k8s.io Lease; embedded: this
    /// process leads).
    #[arg(long, value_enum, default_value = "agent")]
    pub role: Role,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME", default_value = "wasmplane-operator")]
    pub identity: String,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-system")]
    pub lease_namespace: String,
    /// This cluster's name among those sharing the kvstore. Operator: export Services
    /// annotated `wasmplane.io/shared` or `wasmplane.io/global` (with their ready endpoints)
    /// under it. Agent: other clusters' endpoints become backends of this cluster's Services
    /// annotated `wasmplane.io/global: "true"`.
    #[arg(long, env = "WASMPLANE_CLUSTER_NAME")]
    pub cluster_name: Option<String>,
    /// Agent: another cluster followed in its own etcd (Cilium's clustermesh), as
    /// `NAME=http://HOST:PORT[,http://HOST:PORT…]`; repeatable. Its exported endpoints join
    /// this cluster's global Services. `https://` ones use this host's etcd TLS files (one CA
    /// for the mesh, as Cilium's shared clustermesh client certificate); other settings per
    /// cluster: --clustermesh-config. Needs --cluster-name.
    #[arg(long = "remote-cluster", value_parser = parse_remote_cluster)]
    pub remote_clusters: Vec<(String, Vec<String>)>,
    /// Agent: Cilium's clustermesh configuration directory, one etcd client configuration
    /// file (the --etcd-config format) per remote cluster, named after it; this cluster's own
    /// file is skipped. Needs --cluster-name.
    #[arg(long, env = "WASMPLANE_CLUSTERMESH_CONFIG")]
    pub clustermesh_config: Option<PathBuf>,
    /// Operator: write EndpointSlices for the remote clusters' endpoints of this cluster's
    /// global Services (headless ones, or any annotated
    /// `wasmplane.io/global-sync-endpoint-slices: "true"`), so that DNS answers with them
    /// (Cilium's clustermesh EndpointSlice synchronization). The remote clusters are those of
    /// --remote-cluster and --clustermesh-config. Needs --cluster-name.
    #[arg(long)]
    pub clustermesh_sync_endpoint_slices: bool,
    /// Seconds between GC cycles (operator).
    #[arg(long, default_value_t = 60)]
    pub gc_interval_seconds: u64,
    /// Most kvstore deletions per second GC makes (operator).
    #[arg(long, default_value_t = 10.0)]
    pub gc_deletes_per_second: f64,
    /// Operator: speak plain HTTP to the registries `WasmModule` objects name (a registry
    /// inside the cluster's network). Credentials: WASMPLANE_REGISTRY_USERNAME/PASSWORD, or
    /// --module-registry-docker-config.
    #[arg(long)]
    pub module_registry_plain_http: bool,
    /// Operator: a CA certificate (PEM) to trust for those registries besides the system's.
    #[arg(long)]
    pub module_registry_ca: Option<PathBuf>,
    /// Operator: Docker's config.json with credentials for those registries, per registry
    /// (a mounted `kubernetes.io/dockerconfigjson` Secret's `.dockerconfigjson`, as
    /// Kubewarden's --docker-config-json-path). WASMPLANE_REGISTRY_USERNAME/PASSWORD, when
    /// set, are used for every registry instead.
    #[arg(long, env = "WASMPLANE_MODULE_REGISTRY_DOCKER_CONFIG", value_name = "PATH")]
    pub module_registry_docker_config: Option<PathBuf>,
}

/// The command line, with the settings of `run --kube-proxy-config FILE` in it, and what the
/// file sets that wasmplane leaves (for the log, once it is set up). Clap's errors, `--help`
/// and `--version` exit the process as with `Cli::parse()`.
pub fn parse_cli() -> anyhow::Result<(Cli, Vec<String>)> {
    let args: Vec<OsString> = std::env::args_os().collect();
    let matches = Cli::command().get_matches_from(&args);
    with_kube_proxy_config(Cli::command(), &args, &matches)
}

/// Parses `args` again with the kube-proxy configuration's flags right after `run`, leaving
/// out each flag the user gave (on the command line or in its environment variable): a list
/// flag given replaces the file's list, it is not added to it.
fn with_kube_proxy_config(
    command: clap::Command,
    args: &[OsString],
    matches: &clap::ArgMatches,
) -> anyhow::Result<(Cli, Vec<String>)> {
    let Some(("run", run)) = matches.subcommand() else { return Ok((Cli::from_arg_matches(matches)?, Vec::new())) };
    let Some(file) = run.get_one::<PathBuf>("kube_proxy_config") else {
        return Ok((Cli::from_arg_matches(matches)?, Vec::new()));
    };
    let settings = crate::kube_proxy_config::read(file)?;
    let run_command = command.find_subcommand("run").context("no `run` command")?;
    let given_by_user = |flag: &str| {
        let long = flag.trim_start_matches("--").split('=').next().unwrap_or_default();
        run_command
            .get_arguments()
            .find(|arg| arg.get_long() == Some(long))
            .and_then(|arg| run.value_source(arg.get_id().as_str()))
            .is_some_and(|source| {
                matches!(source, clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable)
            })
    };
    let from_file: Vec<String> = settings.args.into_iter().filter(|flag| !given_by_user(flag)).collect();
    let after_run = args.iter().skip(1).position(|arg| arg == "run").context("`run` is not on the command line")? + 2;
    let merged = args[..after_run]
        .iter()
        .cloned()
        .chain(from_file.iter().map(OsString::from))
        .chain(args[after_run..].iter().cloned());
    let matches = command
        .try_get_matches_from(merged)
        .with_context(|| format!("{}: its settings as `wasmplane run {}`", file.display(), from_file.join(" ")))?;
    let warnings = settings.warnings.into_iter().map(|warning| format!("{}: {warning}", file.display())).collect();
    Ok((Cli::from_arg_matches(&matches)?, warnings))
}

/// `--remote-cluster NAME=URL[,URL…]`.
fn parse_remote_cluster(text: &str) -> Result<(String, Vec<String>), String> {
    let (name, urls) = text.split_once('=').ok_or("expected NAME=http://HOST:PORT[,…]")?;
    let urls: Vec<String> = urls.split(',').map(str::trim).filter(|u| !u.is_empty()).map(String::from).collect();
    if name.is_empty() || name.contains('/') || urls.is_empty() {
        return Err(format!("expected NAME=http://HOST:PORT[,…], got {text:?}"));
    }
    Ok((name.to_string(), urls))
}

/// `--egress-masquerade`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EgressMasqueradeMode {
    Auto,
    On,
    Off,
}

/// `--log-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `--detect-local-mode`, spelt as kube-proxy's.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DetectLocalMode {
    #[value(name = "ClusterCIDR")]
    ClusterCidr,
    #[value(name = "NodeCIDR")]
    NodeCidr,
    #[value(name = "InterfaceNamePrefix")]
    InterfaceNamePrefix,
    #[value(name = "BridgeInterface")]
    BridgeInterface,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Agent,
    Operator,
}

#[derive(clap::Args, Debug)]
pub struct ApiArgs {
    /// REST API of the host.
    #[arg(long, env = "WASMPLANE_API", default_value = "http://127.0.0.1:8080", global = true)]
    pub api: String,
    /// Bearer token (or WASMPLANE_TOKEN).
    #[arg(long, env = "WASMPLANE_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// File holding the bearer token.
    #[arg(long, env = "WASMPLANE_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum ModuleCommand {
    /// Upload a component as a new version of NAME (and activate it).
    Push {
        name: String,
        /// A file (with the signature `module sign` wrote beside it, if any), or a module in
        /// an OCI registry, `oci://REGISTRY/REPOSITORY:TAG` or `…@sha256:DIGEST` (with the
        /// signature it was published with, if any).
        source: String,
        #[arg(long, default_value = "service-translator")]
        kind: String,
        /// Store the version without putting it in force.
        #[arg(long)]
        no_activate: bool,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Push a component to an OCI registry as a Wasm artifact (with FILE.sig, if `module
    /// sign` made one), for `module push NAME oci://…` or `module pull` on any machine.
    Publish {
        file: PathBuf,
        /// `oci://REGISTRY/REPOSITORY:TAG`.
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Fetch a component from an OCI registry into OUT (and its signature into OUT.sig).
    Pull {
        /// `oci://REGISTRY/REPOSITORY:TAG` or `…@sha256:DIGEST`.
        reference: String,
        #[arg(long, short)]
        out: PathBuf,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// List modules.
    Ls,
    /// Show one module.
    Get { name: String },
    /// Put a version (default: the newest) in force.
    Activate {
        name: String,
        #[arg(long)]
        version: Option<u32>,
    },
    /// Show a module's settings, or set them from FILE (JSON or YAML), or clear them.
    Settings {
        name: String,
        /// The settings document; `-` reads standard input.
        file: Option<PathBuf>,
        #[arg(long, conflicts_with = "file")]
        clear: bool,
    },
    /// Go back to the version in force before the current one.
    Rollback { name: String },
    /// Delete a module (its kind falls back to the builtin if it was in force).
    Rm { name: String },
    /// Sign a component with an ed25519 private key: writes FILE.sig, which `push` sends.
    Sign {
        /// Private key: PKCS#8 PEM (as `keygen` or `openssl genpkey -algorithm ed25519`
        /// write) or the 32-byte seed as 64 hex characters.
        #[arg(long)]
        key: PathBuf,
        file: PathBuf,
    },
    /// Make an ed25519 key pair: OUT (private, PKCS#8 PEM, mode 0600) and OUT.pub (SPKI
    /// PEM, for the host's --trusted-key).
    Keygen { out: PathBuf },
    /// Check a component as a host would, offline (Kubewarden's `kwctl inspect`): its kind,
    /// WIT version, digest, size and imports, whether it checks its own settings, and with
    /// --settings what it says of them (fails if it refuses them).
    Inspect {
        file: PathBuf,
        /// A settings document (JSON or YAML) to put to the module's own validator.
        #[arg(long)]
        settings: Option<PathBuf>,
    },
}

/// How the CLI reaches an OCI registry.
#[derive(clap::Args, Clone, Default)]
pub struct RegistryArgs {
    /// Speak plain HTTP to the registry (one on this machine; never across a network).
    #[arg(long)]
    pub plain_http: bool,
    /// A CA certificate (PEM) to trust for the registry besides the system's.
    #[arg(long)]
    pub registry_ca: Option<PathBuf>,
    /// Registry user for basic authentication (with WASMPLANE_REGISTRY_PASSWORD).
    #[arg(long, env = "WASMPLANE_REGISTRY_USERNAME")]
    pub registry_username: Option<String>,
    /// Taken from the environment only, so it shows in no process list.
    #[arg(skip = std::env::var("WASMPLANE_REGISTRY_PASSWORD").ok())]
    pub registry_password: Option<String>,
    /// Docker's config.json (`docker login`'s, kwctl's): the registry's credentials from its
    /// `auths`, `credHelpers` or `credsStore`, unless WASMPLANE_REGISTRY_USERNAME/PASSWORD
    /// are set. Default: $DOCKER_CONFIG/config.json or ~/.docker/config.json, if it exists.
    #[arg(long, value_name = "PATH")]
    pub registry_docker_config: Option<PathBuf>,
    /// That default, found when the command line is parsed: a `RegistryArgs` built in code
    /// reads no file of the machine it runs on.
    #[arg(skip = default_docker_config(|name| std::env::var_os(name)))]
    pub default_docker_config: Option<PathBuf>,
}

/// The password stays out of debug output.
impl std::fmt::Debug for RegistryArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryArgs")
            .field("plain_http", &self.plain_http)
            .field("registry_ca", &self.registry_ca)
            .field("registry_username", &self.registry_username)
            .field("registry_password", &self.registry_password.as_ref().map(|_| "<redacted>"))
            .field("registry_docker_config", &self.registry_docker_config)
            .field("default_docker_config", &self.default_docker_config)
            .finish()
    }
}

/// Where docker and kwctl look for their config: `$DOCKER_CONFIG/config.json`, else
/// `~/.docker/config.json`; only a file that exists.
fn default_docker_config(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let dir = match env("DOCKER_CONFIG").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env("HOME").filter(|h| !h.is_empty())?).join(".docker"),
    };
    Some(dir.join("config.json")).filter(|file| file.is_file())
}

impl RegistryArgs {
    fn options(&self) -> anyhow::Result<crate::oci::RegistryOptions> {
        let credentials = match (&self.registry_username, &self.registry_password) {
            (Some(user), Some(password)) => Some((user.clone(), password.clone())),
            (None, None) => None,
            _ => bail!(
                "registry credentials need both WASMPLANE_REGISTRY_USERNAME (or --registry-username) and WASMPLANE_REGISTRY_PASSWORD"
            ),
        };
        let docker_config = self.registry_docker_config.clone().or_else(|| self.default_docker_config.clone());
        Ok(crate::oci::RegistryOptions {
            plain_http: self.plain_http,
            ca_file: self.registry_ca.clone(),
            credentials,
            docker_config,
        })
    }

    fn connect(&self) -> anyhow::Result<crate::oci::Registry> {
        let options = self.options()?;
        match crate::oci::Registry::new(&options) {
            // As docker: the default config, when unreadable, is warned about and done without;
            // a file named by --registry-docker-config must be read.
            Err(e @ crate::oci::OciError::DockerConfig { .. }) if self.registry_docker_config.is_none() => {
                tracing::warn!("{e}: going on without it");
                Ok(crate::oci::Registry::new(&crate::oci::RegistryOptions { docker_config: None, ..options })?)
            }
            registry => Ok(registry?),
        }
    }
}

/// The largest component the CLI fetches from a registry (hosts refuse above their own cap,
/// 16 MiB by default).
const MAX_PULLED_BYTES: u64 = 64 << 20;

/// `--guest-memory-mib`: a 32-bit Wasm memory addresses at most 4 GiB, and the runtime reserves
/// exactly that per memory (no bounds checks), so a larger limit could never be reached.
pub fn guest_memory_mib(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(mib @ 1..=4096) => Ok(mib),
        Ok(_) => Err("a guest's memory limit must be 1..=4096 MiB (guests have 32-bit memories)".into()),
        Err(e) => Err(format!("{e}")),
    }
}

/// `--health-check-bind-address`: an address, or `off`.
#[derive(Clone, Copy, Debug)]
pub struct HealthCheckBind(pub Option<std::net::IpAddr>);

pub fn health_check_bind(value: &str) -> Result<HealthCheckBind, String> {
    match value {
        "off" => Ok(HealthCheckBind(None)),
        address => {
            address.parse().map(|ip| HealthCheckBind(Some(ip))).map_err(|e| format!("{e}: an IP address, or `off`"))
        }
    }
}

/// `--node-health-listen`: an address and port, or `off`.
#[derive(Clone, Copy, Debug)]
pub struct NodeHealthListen(pub Option<SocketAddr>);

pub fn node_health_listen(value: &str) -> Result<NodeHealthListen, String> {
    match value {
        "off" => Ok(NodeHealthListen(None)),
        address => address
            .parse()
            .map(|a| NodeHealthListen(Some(a)))
            .map_err(|e| format!("{e}: an address and port, or `off`")),
    }
}

/// `FILE.wasm` → `FILE.wasm.sig`.
pub fn signature_path(file: &std::path::Path) -> PathBuf {
    let mut path = file.as_os_str().to_owned();
    path.push(".sig");
    PathBuf::from(path)
}

/// `module inspect`: what a host would make of `file`, and of `settings` for it.
pub fn inspect(file: &std::path::Path, settings: Option<&std::path::Path>) -> anyhow::Result<serde_json::Value> {
    use wasmplane_runtime::SettingsVerdict;
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let name = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "module".into());
    let runtime = wasmplane_runtime::Runtime::new(wasmplane_runtime::Limits::default(), None)
        .context("starting the Wasm runtime")?;
    let module = runtime
        .settings_check(&name, &bytes, None, usize::MAX)
        .with_context(|| format!("{}: a host would refuse it", file.display()))?;
    let info = &module.info;
    let mut report = serde_json::json!({
        "file": file.display().to_string(),
        "kind": info.kind,
        "witVersion": info.wit_version,
        "digest": info.digest,
        "size": info.size,
        "imports": info.imports,
        "validatesSettings": module.validates_settings(),
        "signature": signature_path(file).exists().then(|| signature_path(file).display().to_string()),
    });
    if let Some(path) = settings {
        let document = settings_document(path)?;
        report["settings"] = match module
            .validate(&document)
            .with_context(|| format!("{}: its settings validator failed", file.display()))?
        {
            SettingsVerdict::Valid => serde_json::json!({ "accepted": true }),
            SettingsVerdict::Invalid(reason) => serde_json::json!({ "refused": reason }),
            SettingsVerdict::NotImplemented => {
                serde_json::json!({ "unchecked": "the module does not check its settings: only running it on a host's state tells" })
            }
        };
    }
    Ok(report)
}

/// `module sign`, `keygen` and `inspect`: local, no API call. False for the other commands.
fn local_command(command: &ModuleCommand) -> anyhow::Result<bool> {
    match command {
        ModuleCommand::Sign { key, file } => {
            let key = crate::admission::read_private_key(key)?;
            let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            let out = signature_path(file);
            std::fs::write(&out, format!("{}\n", crate::admission::sign(&key, &bytes)))
                .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "{} signed ({}): {}",
                file.display(),
                wasmplane_runtime::LoadedModule::digest_of(&bytes),
                out.display()
            );
            Ok(true)
        }
        ModuleCommand::Keygen { out } => {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            let (private, public) = crate::admission::generate_key_pair().context("generating a key pair")?;
            let public_path = PathBuf::from(format!("{}.pub", out.display()));
            // create_new: never overwrite a key someone may still rely on.
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(out)
                .with_context(|| format!("creating {}", out.display()))?;
            file.write_all(private.as_bytes())?;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&public_path)
                .with_context(|| format!("creating {}", public_path.display()))?
                .write_all(public.as_bytes())?;
            println!(
                "private key: {}\npublic key:  {} (give it to the host with --trusted-key)",
                out.display(),
                public_path.display()
            );
            Ok(true)
        }
        ModuleCommand::Inspect { file, settings } => {
            let report = inspect(file, settings.as_deref())?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            if let Some(reason) = report.get("settings").and_then(|s| s.get("refused")).and_then(|r| r.as_str()) {
                bail!("{} refuses the settings: {reason}", file.display());
            }
            Ok(true)
        }
        _ => Ok(false),
    }
}

impl RunArgs {
    /// What `--egress-masquerade` and `--non-masquerade-cidr` make of pod egress: the pods
    /// keep their address inside the cluster CIDRs and what is added to them.
    fn egress_masquerade(&self) -> anyhow::Result<Option<crate::nft::EgressMasquerade>> {
        let on = match self.egress_masquerade {
            EgressMasqueradeMode::On => true,
            EgressMasqueradeMode::Off => false,
            EgressMasqueradeMode::Auto => self.cni_socket.is_some() && !self.cni_chained,
        };
        if !on {
            if !self.non_masquerade_cidrs.is_empty() {
                // Said outright, off and these CIDRs contradict each other. Left to auto, the
                // shared ConfigMap's key may be meant for other nodes' agents: said, not fatal.
                anyhow::ensure!(
                    self.egress_masquerade != EgressMasqueradeMode::Off,
                    "--non-masquerade-cidr has no use with --egress-masquerade off"
                );
                tracing::warn!(cidrs = ?self.non_masquerade_cidrs, "--non-masquerade-cidr unused: egress masquerade is off here (auto: this host is not the pods' CNI, or is chained)");
            }
            return Ok(None);
        }
        let mut keep_source = Vec::new();
        for cidr in &self.cluster_cidrs {
            keep_source.push(cidr.parse::<ipnet::IpNet>().with_context(|| format!("--cluster-cidr {cidr:?}"))?);
        }
        keep_source.extend(&self.non_masquerade_cidrs);
        Ok(Some(crate::nft::EgressMasquerade { sources: self.pod_cidrs.clone(), keep_source, ..Default::default() }))
    }

    /// `--detect-local-mode` with its interface flag. As kube-proxy, the mode's flag must be
    /// there and a name; the other mode's flag is not looked at (kube-proxy ignores it
    /// silently; here it is said, in case it was meant to be used).
    fn local_detection(&self) -> anyhow::Result<crate::controller::LocalDetection> {
        use crate::controller::LocalDetection;
        let (prefix, bridge) = (self.pod_interface_name_prefix.as_deref(), self.pod_bridge_interface.as_deref());
        let name = |flag: &str, value: Option<&str>, mode: &str| -> anyhow::Result<String> {
            let value = value.with_context(|| format!("--detect-local-mode {mode} needs --{flag}"))?;
            match crate::nft::PodTraffic::interface_name_problem(value, flag == "pod-interface-name-prefix") {
                Some(why) => bail!("--{flag} {value:?}: {why}"),
                None => Ok(value.to_string()),
            }
        };
        let mode = clap::ValueEnum::to_possible_value(&self.detect_local_mode)
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        // The flag the mode reads, if any; the others are said to be unused.
        let reads = match self.detect_local_mode {
            DetectLocalMode::ClusterCidr | DetectLocalMode::NodeCidr => None,
            DetectLocalMode::InterfaceNamePrefix => Some("pod-interface-name-prefix"),
            DetectLocalMode::BridgeInterface => Some("pod-bridge-interface"),
        };
        for (flag, value) in [("pod-interface-name-prefix", prefix), ("pod-bridge-interface", bridge)] {
            if let Some(value) = value.filter(|_| reads != Some(flag)) {
                tracing::warn!(value, "--{flag} ignored: it is for another --detect-local-mode than {mode}");
            }
        }
        Ok(match self.detect_local_mode {
            DetectLocalMode::ClusterCidr => LocalDetection::ClusterCidr,
            DetectLocalMode::NodeCidr => LocalDetection::NodeCidr,
            DetectLocalMode::InterfaceNamePrefix => {
                LocalDetection::InterfaceNamePrefix(name("pod-interface-name-prefix", prefix, &mode)?)
            }
            DetectLocalMode::BridgeInterface => {
                LocalDetection::BridgeInterface(name("pod-bridge-interface", bridge, &mode)?)
            }
        })
    }

    pub fn into_config(self) -> anyhow::Result<HostConfig> {
        let egress_masquerade = self.egress_masquerade()?;
        let local_detection = self.local_detection()?;
        let token = match &self.token_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        if (!self.remote_clusters.is_empty() || self.clustermesh_config.is_some()) && self.cluster_name.is_none() {
            bail!("--remote-cluster and --clustermesh-config need --cluster-name: this cluster's name among them");
        }
        if self.clustermesh_sync_endpoint_slices && (self.role != Role::Operator || self.cluster_name.is_none()) {
            bail!("--clustermesh-sync-endpoint-slices is the operator's (--role operator) and needs --cluster-name");
        }
        // Checked against the pod CIDRs given here; the daemon checks again against those it
        // ends up with (the Node object's).
        let cni_mtu = match self.cni_mtu {
            0 => None,
            mtu => Some(wasmplane_cni::check_mtu(mtu, &self.pod_cidrs).map(|()| mtu).context("--cni-mtu")?),
        };
        let kvstore = self.kvstore_config()?;
        let clustermesh = self.clustermesh(&kvstore);
        // The operator pulls `WasmModule` objects' components with the CLI's credentials, or
        // its Docker config's (only one named: a pod has no ~/.docker of its own).
        let module_registry = RegistryArgs {
            plain_http: self.module_registry_plain_http,
            registry_ca: self.module_registry_ca.clone(),
            registry_username: std::env::var("WASMPLANE_REGISTRY_USERNAME").ok(),
            registry_password: std::env::var("WASMPLANE_REGISTRY_PASSWORD").ok(),
            registry_docker_config: self.module_registry_docker_config.clone(),
            default_docker_config: None,
        }
        .options()?;
        // Checked at start, not at the first WasmModule: a wrong path or file fails the rollout.
        if let Some(path) = &module_registry.docker_config {
            crate::oci::DockerConfig::read(path)?;
        }
        let limits = wasmplane_runtime::Limits {
            call_timeout: Duration::from_millis(self.guest_timeout_ms),
            memory_bytes: self.guest_memory_mib << 20,
            ..Default::default()
        };
        let kubeconfig = self.kubeconfig.clone();
        Ok(HostConfig {
            kvstore,
            listen: self.listen,
            manifests: self.manifests,
            kubernetes: match (self.kubeconfig, self.kubernetes) {
                (Some(path), _) => Some(crate::app::KubernetesSource::Kubeconfig(path)),
                (None, true) => Some(crate::app::KubernetesSource::Infer),
                (None, false) => None,
            },
            grpc_listen: self.grpc_listen,
            health_check_bind: self.health_check_bind_address.0,
            node_health_listen: self.node_health_listen.0,
            metrics_listen: self.metrics_listen,
            record: self.record,
            // This binary answers compile requests itself (`main.rs`).
            compiler: Some(
                wasmplane_runtime::CompilerCommand::current_exe()
                    .context("locating this binary to compile guests with")?,
            ),
            cni: self.cni_socket.map(|socket| crate::cni::CniConfig {
                socket,
                pod_cidrs: self.pod_cidrs,
                state_dir: None,
                pod_wait: Duration::from_secs(10),
                node_netns: None,
                chained: self.cni_chained,
                mtu: cni_mtu,
            }),
            data_dir: Some(self.data_dir),
            egress_masquerade,
            node_name: self.node_name,
            cluster_cidrs: self.cluster_cidrs,
            local_detection,
            service_cidrs: self.service_cidrs,
            masquerade_all: self.masquerade_all,
            policy_log_group: self.policy_log_group,
            policy_log_rate: self.policy_log_rate,
            conntrack: Some(crate::conntrack_tuning::ConntrackTuning {
                max_per_core: self.conntrack_max_per_core,
                min: self.conntrack_min,
                tcp_established_timeout: Duration::from_secs(self.conntrack_tcp_timeout_established_seconds),
                tcp_close_wait_timeout: Duration::from_secs(self.conntrack_tcp_timeout_close_wait_seconds),
                udp_timeout: Duration::from_secs(self.conntrack_udp_timeout_seconds),
                udp_stream_timeout: Duration::from_secs(self.conntrack_udp_timeout_stream_seconds),
                tcp_be_liberal: self.conntrack_tcp_be_liberal,
            }),
            dataplane: self.dataplane,
            token,
            limits,
            max_module_bytes: self.max_module_bytes,
            reconcile_interval: Duration::from_secs(self.reconcile_seconds.max(1)),
            min_sync_period: self.min_sync_period,
            nft_netlink: !self.nft_text_only,
            nft_services_per_shard: self.nft_services_per_shard,
            node_port_addresses: self.nodeport_addresses,
            trusted_keys: self.trusted_keys,
            grants: self.grants,
            tls: match (self.tls_cert, self.tls_key) {
                (Some(cert), Some(key)) => Some(crate::auth::TlsFiles { cert, key }),
                _ => None,
            },
            kubernetes_auth: self.kubernetes_auth.then(|| crate::auth::KubernetesAuthConfig {
                verb: self.auth_verb,
                group: self.auth_group,
                resource: self.auth_resource,
                namespace: self.auth_namespace,
                cache_ttl: Duration::from_secs(self.auth_cache_seconds),
                ..crate::auth::KubernetesAuthConfig::new(match &kubeconfig {
                    Some(path) => crate::app::KubernetesSource::Kubeconfig(path.clone()),
                    None => crate::app::KubernetesSource::Infer,
                })
            }),
            crash_budget: crate::controller::CrashBudget {
                max_crashes: self.crash_budget,
                window: Duration::from_secs(self.crash_window_seconds.max(1)),
            },
            operator: (self.role == Role::Operator).then(|| crate::operator_role::OperatorRoleConfig {
                identity: self.identity.clone(),
                lease_namespace: self.lease_namespace.clone(),
                cluster_name: self.cluster_name.clone(),
                gc_interval: Duration::from_secs(self.gc_interval_seconds.max(1)),
                gc_deletes_per_second: self.gc_deletes_per_second,
                module_objects: crate::module_objects::ModuleObjectsConfig {
                    registry: module_registry.clone(),
                    ..Default::default()
                },
                mesh_slices: self.clustermesh_sync_endpoint_slices.then(|| clustermesh.clone()),
                ..Default::default()
            }),
            agent: Some(crate::agent::AgentConfig {
                routes: self.node_routes,
                heartbeat_max_age: (self.heartbeat_max_age_seconds > 0)
                    .then(|| Duration::from_secs(self.heartbeat_max_age_seconds)),
                cluster_name: self.cluster_name.clone(),
                clustermesh,
                ..Default::default()
            }),
            ..Default::default()
        })
    }
}

impl RunArgs {
    /// `--kvstore` with the `--etcd-*` TLS files, or `--etcd-config`.
    fn kvstore_config(&self) -> anyhow::Result<crate::app::KvstoreConfig> {
        use crate::app::KvstoreConfig;
        if let Some(path) = &self.etcd_config {
            let file = wasmplane_kvstore::EtcdConfigFile::read(path)?;
            return Ok(KvstoreConfig::Etcd { endpoints: file.endpoints, tls: file.tls, user: file.user });
        }
        let tls = self.etcd_trusted_ca_file.clone().map(|trusted_ca_file| wasmplane_kvstore::EtcdTlsFiles {
            trusted_ca_file,
            cert_file: self.etcd_cert_file.clone(),
            key_file: self.etcd_key_file.clone(),
        });
        Ok(match (&self.kvstore, tls) {
            (KvstoreConfig::Etcd { endpoints, .. }, tls) => {
                KvstoreConfig::Etcd { endpoints: endpoints.clone(), tls, user: self.etcd_user()? }
            }
            (KvstoreConfig::Embedded, Some(_)) => {
                bail!("--etcd-trusted-ca-file is for an etcd --kvstore; the embedded one has no connection")
            }
            (KvstoreConfig::Embedded, None) => KvstoreConfig::Embedded,
        })
    }

    /// `--etcd-username` with WASMPLANE_ETCD_PASSWORD.
    fn etcd_user(&self) -> anyhow::Result<Option<wasmplane_kvstore::EtcdUser>> {
        let Some(name) = self.etcd_username.clone() else { return Ok(None) };
        let password = std::env::var("WASMPLANE_ETCD_PASSWORD")
            .map_err(|_| anyhow::anyhow!("--etcd-username needs WASMPLANE_ETCD_PASSWORD in the environment"))?;
        Ok(Some(wasmplane_kvstore::EtcdUser { name, password }))
    }

    /// `--remote-cluster` (TLS as this host's etcd) and `--clustermesh-config`.
    fn clustermesh(&self, kvstore: &crate::app::KvstoreConfig) -> crate::clustermesh::ClusterMeshConfig {
        let own_tls = match kvstore {
            crate::app::KvstoreConfig::Etcd { tls, .. } => tls.clone(),
            crate::app::KvstoreConfig::Embedded => None,
        };
        let remotes = self
            .remote_clusters
            .iter()
            .map(|(cluster, endpoints)| crate::clustermesh::RemoteEtcd {
                cluster: cluster.clone(),
                endpoints: endpoints.clone(),
                tls: endpoints.iter().any(|e| e.starts_with("https://")).then(|| own_tls.clone()).flatten(),
                user: None,
            })
            .collect();
        crate::clustermesh::ClusterMeshConfig {
            remotes,
            dir: self.clustermesh_config.clone(),
            poll: crate::clustermesh::ClusterMeshConfig::DEFAULT_POLL,
        }
    }
}

impl ApiArgs {
    pub(crate) fn token(&self) -> anyhow::Result<Option<String>> {
        if let Some(t) = &self.token {
            return Ok(Some(t.clone()));
        }
        match &self.token_file {
            Some(p) => Ok(Some(
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?.trim().to_string(),
            )),
            None => Ok(None),
        }
    }
}

/// A settings file (JSON, or YAML as most Kubernetes configuration is written) as the JSON
/// the API takes.
pub(crate) fn settings_document(file: &std::path::Path) -> anyhow::Result<String> {
    let text = if file == std::path::Path::new("-") {
        std::io::read_to_string(std::io::stdin()).context("reading settings from standard input")?
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?
    };
    // YAML is a superset of JSON: one parser takes both.
    let value: serde_json::Value =
        serde_yaml::from_str(&text).with_context(|| format!("{} is neither JSON nor YAML", file.display()))?;
    Ok(value.to_string())
}

/// `module publish` and `module pull`: between this machine and a registry, no host API.
async fn registry_command(command: &ModuleCommand) -> anyhow::Result<bool> {
    match command {
        ModuleCommand::Publish { file, reference, registry } => {
            let target = registry_reference(reference)?;
            let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            let signature = read_signature(file)?;
            let digest = wasmplane_runtime::LoadedModule::digest_of(&bytes);
            let url = registry
                .connect()?
                .publish(&target, bytes, signature.as_deref())
                .await
                .with_context(|| format!("publishing to {reference}"))?;
            println!(
                "{} ({digest}{}) published: {url}",
                file.display(),
                if signature.is_some() { ", signed" } else { "" }
            );
            Ok(true)
        }
        ModuleCommand::Pull { reference, out, registry } => {
            let artifact = pull(reference, registry).await?;
            std::fs::write(out, &artifact.component).with_context(|| format!("writing {}", out.display()))?;
            let signature_file = signature_path(out);
            match &artifact.signature {
                Some(signature) => std::fs::write(&signature_file, format!("{signature}\n"))
                    .with_context(|| format!("writing {}", signature_file.display()))?,
                // A signature left from an earlier pull would be sent with these bytes.
                None => match std::fs::remove_file(&signature_file) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(e).with_context(|| format!("removing {}", signature_file.display()));
                    }
                    _ => {}
                },
            }
            println!(
                "{reference} ({}): {} ({}{})",
                artifact.manifest_digest,
                out.display(),
                wasmplane_runtime::LoadedModule::digest_of(&artifact.component),
                if artifact.signature.is_some() { ", signature in .sig" } else { "" }
            );
            Ok(true)
        }
        _ => Ok(false),
    }
}

fn registry_reference(reference: &str) -> anyhow::Result<oci_client::Reference> {
    match crate::oci::reference_of(reference) {
        Some(parsed) => Ok(parsed?),
        None => bail!("{reference:?} is not an OCI reference: write oci://REGISTRY/REPOSITORY:TAG"),
    }
}

async fn pull(reference: &str, registry: &RegistryArgs) -> anyhow::Result<crate::oci::Artifact> {
    let source = registry_reference(reference)?;
    registry.connect()?.pull(&source, MAX_PULLED_BYTES).await.with_context(|| format!("pulling {reference}"))
}

/// The signature `module sign` wrote beside `file`, if any.
fn read_signature(file: &std::path::Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(signature_path(file)) {
        Ok(signature) => Ok(Some(signature.trim().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", signature_path(file).display())),
    }
}

/// Runs one `wasmplane module …` command and prints the API's answer.
pub async fn module_command(api: ApiArgs, command: ModuleCommand) -> anyhow::Result<()> {
    if local_command(&command)? || registry_command(&command).await? {
        return Ok(());
    }
    let client = crate::inspect::api_client()?;
    let base = api.api.trim_end_matches('/').to_string();
    let token = api.token()?;
    let with_auth = |rb: reqwest::RequestBuilder| match &token {
        Some(t) => rb.bearer_auth(t),
        None => rb,
    };
    let request = match &command {
        ModuleCommand::Push { name, source, kind, no_activate, registry } => {
            let (bytes, signature) = if crate::oci::reference_of(source).is_some() {
                let artifact = pull(source, registry).await?;
                eprintln!("pulled {source} ({})", artifact.manifest_digest);
                (artifact.component, artifact.signature)
            } else {
                let file = std::path::Path::new(source);
                (std::fs::read(file).with_context(|| format!("reading {}", file.display()))?, read_signature(file)?)
            };
            let rb = client
                .put(format!("{base}/v1/modules/{name}"))
                .query(&[("kind", kind.as_str()), ("activate", if *no_activate { "false" } else { "true" })])
                .body(bytes);
            match signature {
                Some(signature) => rb.header("x-wasmplane-signature", signature),
                None => rb,
            }
        }
        ModuleCommand::Ls => client.get(format!("{base}/v1/modules")),
        ModuleCommand::Get { name } => client.get(format!("{base}/v1/modules/{name}")),
        ModuleCommand::Activate { name, version } => {
            let rb = client.post(format!("{base}/v1/modules/{name}/activate"));
            match version {
                Some(v) => rb.query(&[("version", v)]),
                None => rb,
            }
        }
        ModuleCommand::Settings { name, clear: true, .. } => {
            client.delete(format!("{base}/v1/modules/{name}/settings"))
        }
        ModuleCommand::Settings { name, file: Some(file), .. } => {
            client.put(format!("{base}/v1/modules/{name}/settings")).body(settings_document(file)?)
        }
        ModuleCommand::Settings { name, file: None, .. } => client.get(format!("{base}/v1/modules/{name}/settings")),
        ModuleCommand::Rollback { name } => client.post(format!("{base}/v1/modules/{name}/rollback")),
        ModuleCommand::Rm { name } => client.delete(format!("{base}/v1/modules/{name}")),
        ModuleCommand::Sign { .. }
        | ModuleCommand::Keygen { .. }
        | ModuleCommand::Inspect { .. }
        | ModuleCommand::Publish { .. }
        | ModuleCommand::Pull { .. } => {
            unreachable!("answered without the host's API above")
        }
    };
    let response = with_auth(request).send().await.with_context(|| format!("calling {base}"))?;
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let pretty = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or(text);
    if status.is_success() {
        if !pretty.is_empty() {
            println!("{pretty}");
        }
        Ok(())
    } else {
        bail!("{status}: {pretty}")
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    /// `wasmplane run ARGS…`, parsed.
    fn run_args(args: &[&str]) -> Result<RunArgs, clap::Error> {
        match Cli::try_parse_from([&["wasmplane", "run"], args].concat())?.command {
            Command::Run(run) => Ok(run),
            _ => unreachable!("parsed as another command"),
        }
    }

    /// `--kube-proxy-config`'s file in a temporary directory, and the command line parsed as
    /// `main` does (with `command`, whose environment variables a test may point elsewhere).
    fn parse_with_kube_proxy_config(
        command: clap::Command,
        file_text: &str,
        args: &[&str],
    ) -> anyhow::Result<(RunArgs, Vec<String>)> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("config.conf");
        std::fs::write(&file, file_text)?;
        let args: Vec<OsString> = [&["wasmplane", "run", "--kube-proxy-config", file.to_str().unwrap()], args]
            .concat()
            .into_iter()
            .map(OsString::from)
            .collect();
        let matches = command.clone().try_get_matches_from(&args)?;
        let (cli, warnings) = with_kube_proxy_config(command, &args, &matches)?;
        let Command::Run(run) = cli.command else { panic!("parsed as another command") };
        // The file's name, the same in every run of the test.
        Ok((run, warnings.into_iter().map(|w| w.replace(&file.display().to_string(), "FILE")).collect()))
    }

    const KUBE_PROXY_CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16,fd00:10:244::/56\n\
        hostnameOverride: worker-1\niptables: {masqueradeAll: true, syncPeriod: 2m, minSyncPeriod: 1500ms}\nconntrack: {maxPerCore: 0, min: 1000, tcpEstablishedTimeout: 2h, tcpCloseWaitTimeout: 30m,\
        udpTimeout: 45s, udpStreamTimeout: 3m, tcpBeLiberal: true}\ndetectLocalMode: NodeCIDR\nnodePortAddresses: [10.0.0.0/8]\nhealthzBindAddress: 127.0.0.1:10266\n\
        logging: {format: json}\nmetricsBindAddress: 0.0.0.0:10249\n";

    /// Every flag the file maps to exists, and lands in the host's configuration.
    #[test]
    fn kube_proxy_config_settings_reach_the_host_config() {
        let (run, warnings) = parse_with_kube_proxy_config(Cli::command(), KUBE_PROXY_CONFIG, &[]).unwrap();
        assert_eq!(warnings, Vec::<String>::new());
        assert_eq!(run.metrics_listen, Some("0.0.0.0:10249".parse().unwrap()));
        assert_eq!(run.log_format, LogFormat::Json);
        let config = run.into_config().unwrap();
        assert_eq!(config.cluster_cidrs, ["10.244.0.0/16", "fd00:10:244::/56"]);
        assert_eq!(config.node_name, "worker-1");
        assert!(config.masquerade_all);
        assert_eq!(config.local_detection, crate::controller::LocalDetection::NodeCidr);
        assert_eq!(
            config.node_port_addresses,
            crate::nft::NodePortAddresses::Networks(vec!["10.0.0.0/8".parse().unwrap()])
        );
        assert_eq!(config.node_health_listen, Some("127.0.0.1:10266".parse().unwrap()));
        assert_eq!(config.reconcile_interval, Duration::from_secs(120));
        assert_eq!(config.min_sync_period, Duration::from_millis(1500));
        assert_eq!(
            config.conntrack,
            Some(crate::conntrack_tuning::ConntrackTuning {
                max_per_core: 0,
                min: 1000,
                tcp_established_timeout: Duration::from_secs(7200),
                tcp_close_wait_timeout: Duration::from_secs(1800),
                udp_timeout: Duration::from_secs(45),
                udp_stream_timeout: Duration::from_secs(180),
                tcp_be_liberal: true,
            })
        );
    }

    /// Flags on the command line win over the file, which wins over the defaults; a list flag
    /// given replaces the file's list.
    #[test]
    fn the_command_line_wins_over_the_kube_proxy_config() {
        let file = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16\nconntrack: {maxPerCore: 0, tcpEstablishedTimeout: 2h}\nhostnameOverride: worker-1\n";
        let config =
            |args: &[&str]| parse_with_kube_proxy_config(Cli::command(), file, args).unwrap().0.into_config().unwrap();
        let given = config(&["--cluster-cidr", "10.100.0.0/16"]);
        assert_eq!(given.cluster_cidrs, ["10.100.0.0/16"]);
        let conntrack = given.conntrack.unwrap();
        assert_eq!(
            (conntrack.max_per_core, conntrack.min, conntrack.tcp_established_timeout),
            (0, 131072, Duration::from_secs(7200)),
            "the file's, and the default"
        );
        assert_eq!(given.node_name, "worker-1");
        let given = config(&[
            "--cluster-cidr=10.100.0.0/16,fd00:100::/56",
            "--conntrack-max-per-core=100",
            "--node-name",
            "worker-2",
            "--conntrack-tcp-timeout-established-seconds",
            "60",
        ]);
        assert_eq!(given.cluster_cidrs, ["10.100.0.0/16", "fd00:100::/56"]);
        let conntrack = given.conntrack.unwrap();
        assert_eq!((conntrack.max_per_core, conntrack.tcp_established_timeout), (100, Duration::from_secs(60)));
        assert_eq!(given.node_name, "worker-2");
        assert_eq!(config(&[]).cluster_cidrs, ["10.244.0.0/16"]);
        // An environment variable is the user's too. PATH is set in every test run: it stands in
        // for NODE_NAME, which setting here would race with the other tests.
        let path = std::env::var("PATH").expect("PATH is set");
        let command = Cli::command().mut_subcommand("run", |run| run.mut_arg("node_name", |arg| arg.env("PATH")));
        assert_eq!(parse_with_kube_proxy_config(command.clone(), file, &[]).unwrap().0.node_name, path);
        assert_eq!(
            parse_with_kube_proxy_config(command, file, &["--node-name", "worker-3"]).unwrap().0.node_name,
            "worker-3"
        );
    }

    /// The file's interface detectLocalMode reaches the host's configuration; a flag given
    /// wins over the file's name or mode as over any field.
    #[test]
    fn kube_proxy_config_interface_local_detection_reaches_the_host_config() {
        use crate::controller::LocalDetection;
        let file = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16\ndetectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: cali}\n";
        let detection = |args: &[&str]| {
            parse_with_kube_proxy_config(Cli::command(), file, args).unwrap().0.into_config().unwrap().local_detection
        };
        assert_eq!(detection(&[]), LocalDetection::InterfaceNamePrefix("cali".into()));
        assert_eq!(
            detection(&["--pod-interface-name-prefix", "veth"]),
            LocalDetection::InterfaceNamePrefix("veth".into())
        );
        assert_eq!(
            detection(&["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0"]),
            LocalDetection::BridgeInterface("cbr0".into()),
            "the file's prefix then unused"
        );
        assert_eq!(detection(&["--detect-local-mode", "NodeCIDR"]), LocalDetection::NodeCidr);
        let bridge = file.replace(
            "InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: cali}",
            "BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}",
        );
        assert_eq!(
            parse_with_kube_proxy_config(Cli::command(), &bridge, &[])
                .unwrap()
                .0
                .into_config()
                .unwrap()
                .local_detection,
            LocalDetection::BridgeInterface("cbr0".into())
        );
    }

    #[test]
    fn a_kube_proxy_config_that_cannot_be_used_stops_the_start() {
        let refused = parse_with_kube_proxy_config(Cli::command(), "apiVersion: v1\nkind: ConfigMap\n", &[])
            .unwrap_err()
            .to_string();
        assert!(refused.contains("config.conf: apiVersion \"v1\", kind \"ConfigMap\""), "{refused}");
        // As kube-proxy refuses it: the mode without its bridge.
        let refused = format!("{:#}", parse_with_kube_proxy_config(Cli::command(), "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\ndetectLocalMode: BridgeInterface\n", &["--pod-bridge-interface", "cbr0"]).unwrap_err());
        assert!(
            refused.contains("config.conf: detectLocal.bridgeInterface: \"\": must not be empty"),
            "even with the flag given: {refused}"
        );
        // Without the option nothing is read.
        match with_kube_proxy_config(
            Cli::command(),
            &["wasmplane".into(), "run".into()],
            &Cli::command().get_matches_from(["wasmplane", "run"]),
        ) {
            Ok((Cli { command: Command::Run(run) }, warnings)) => assert_eq!(
                (run.kube_proxy_config, run.cluster_cidrs, warnings),
                (None, vec!["10.244.0.0/16".to_string()], vec![])
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn guest_memory_limit_is_bounded_by_a_32_bit_memory() {
        let memory = |value: &str| match Cli::try_parse_from(["wasmplane", "run", "--guest-memory-mib", value]) {
            Ok(Cli { command: Command::Run(args) }) => Ok(args.guest_memory_mib),
            Ok(_) => unreachable!("parsed as another command"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(memory("4096"), Ok(4096));
        assert!(memory("4097").unwrap_err().contains("1..=4096 MiB"));
        assert!(memory("0").is_err());
        assert!(memory("lots").is_err());
    }

    #[test]
    fn egress_masquerade_is_on_where_this_host_routes_the_pods() {
        let egress = |args: &[&str]| match Cli::try_parse_from([&["wasmplane", "run"], args].concat()) {
            Ok(Cli { command: Command::Run(args) }) => {
                args.into_config().map(|c| c.egress_masquerade).map_err(|e| format!("{e:#}"))
            }
            Ok(_) => unreachable!("parsed as another command"),
            Err(e) => Err(e.to_string()),
        };
        let net = |cidrs: &[&str]| cidrs.iter().map(|c| c.parse::<ipnet::IpNet>().unwrap()).collect::<Vec<_>>();
        assert_eq!(egress(&[]), Ok(None), "not the CNI: the pods' own CNI masquerades");
        let cni = ["--cni-socket", "/run/x.sock"];
        assert_eq!(
            egress(&cni),
            Ok(Some(crate::nft::EgressMasquerade {
                sources: vec![],
                keep_source: net(&["10.244.0.0/16"]),
                ..Default::default()
            }))
        );
        assert_eq!(
            egress(&[&cni[..], &["--cni-chained"]].concat()),
            Ok(None),
            "chained: the plugin before does its own"
        );
        assert_eq!(egress(&[&cni[..], &["--egress-masquerade", "off"]].concat()), Ok(None));
        let on = egress(&[
            "--egress-masquerade",
            "on",
            "--cni-socket",
            "/run/x.sock",
            "--pod-cidr",
            "10.244.3.0/24",
            "--cluster-cidr",
            "10.244.0.0/16,fd00:10:244::/56",
            "--non-masquerade-cidr",
            "192.168.0.0/16,172.16.0.0/12",
        ]);
        assert_eq!(
            on,
            Ok(Some(crate::nft::EgressMasquerade {
                sources: net(&["10.244.3.0/24"]),
                keep_source: net(&["10.244.0.0/16", "fd00:10:244::/56", "192.168.0.0/16", "172.16.0.0/12"]),
                ..Default::default()
            }))
        );
        let bad = egress(&["--egress-masquerade", "on", "--cluster-cidr", "10.244.0.0/33"]).unwrap_err();
        assert!(bad.contains("--cluster-cidr \"10.244.0.0/33\""), "{bad}");
        assert!(egress(&["--non-masquerade-cidr", "nonsense"]).is_err());
        let contradiction =
            egress(&["--egress-masquerade", "off", "--non-masquerade-cidr", "192.168.0.0/16"]).unwrap_err();
        assert!(
            contradiction.contains("--non-masquerade-cidr has no use with --egress-masquerade off"),
            "{contradiction}"
        );
        assert_eq!(
            egress(&["--non-masquerade-cidr", "192.168.0.0/16"]),
            Ok(None),
            "auto and off here: warned, not refused"
        );
    }

    /// Policy verdicts are logged to NFLOG group 1001 unless told otherwise; 0 turns it off.
    #[test]
    fn policy_log_group_reaches_the_config() {
        let group = |args: &[&str]| run_args(args).unwrap().into_config().unwrap().policy_log_group;
        assert_eq!(
            (group(&[]), group(&["--policy-log-group", "0"]), group(&["--policy-log-group", "7"])),
            (1001, 0, 7)
        );
        let rate =
            |args: &[&str]| run_args(args).map(|run| run.into_config().unwrap().policy_log_rate).map_err(|e| e.kind());
        assert_eq!((rate(&[]), rate(&["--policy-log-rate", "50"])), (Ok(10), Ok(50)));
        assert_eq!(rate(&["--policy-log-rate", "0"]), Err(clap::error::ErrorKind::ValueValidation));
    }

    /// `--min-sync-period` takes a Go duration, as kube-proxy's flag; off by default.
    #[test]
    fn min_sync_period_reaches_the_config() {
        let period = |args: &[&str]| {
            run_args(args).map(|run| run.into_config().unwrap().min_sync_period).map_err(|e| e.to_string())
        };
        assert_eq!(period(&[]), Ok(Duration::ZERO));
        assert_eq!(period(&["--min-sync-period", "1s"]), Ok(Duration::from_secs(1)));
        assert_eq!(period(&["--min-sync-period=250ms"]), Ok(Duration::from_millis(250)));
        let refused = period(&["--min-sync-period", "5"]).unwrap_err();
        assert!(refused.contains("a number without its unit"), "{refused}");
    }

    /// `--oom-score-adj`: kube-proxy's default, negative values on the command line, the
    /// kernel's range.
    #[test]
    fn oom_score_adj_defaults_to_kube_proxys() {
        let adj = |args: &[&str]| run_args(args).map(|run| run.oom_score_adj).map_err(|e| e.kind());
        assert_eq!(adj(&[]), Ok(-999));
        assert_eq!(adj(&["--oom-score-adj", "-500"]), Ok(-500));
        assert_eq!(adj(&["--oom-score-adj=1000"]), Ok(1000));
        assert_eq!(adj(&["--oom-score-adj", "-1001"]), Err(clap::error::ErrorKind::ValueValidation));
    }

    /// kube-proxy's conntrack flags reach the settings applied at start; the UDP timeouts and
    /// "be liberal" are left alone unless given, as kube-proxy leaves them.
    #[test]
    fn conntrack_flags_reach_the_tuning() {
        let tuning = |args: &[&str]| run_args(args).unwrap().into_config().unwrap().conntrack.unwrap();
        assert_eq!(tuning(&[]), crate::conntrack_tuning::ConntrackTuning::default());
        let given = tuning(&[
            "--conntrack-udp-timeout-seconds",
            "45",
            "--conntrack-udp-timeout-stream-seconds",
            "150",
            "--conntrack-tcp-be-liberal",
        ]);
        assert_eq!(
            (given.udp_timeout, given.udp_stream_timeout, given.tcp_be_liberal),
            (Duration::from_secs(45), Duration::from_secs(150), true)
        );
    }

    /// kube-proxy's spelling of `--detect-local-mode` and its interface flags, and where
    /// they land. As kube-proxy: the interface modes need their flag, a name; the other
    /// mode's flag is ignored (said in the log).
    #[test]
    fn detect_local_mode_as_kube_proxy_spells_it() {
        use crate::controller::LocalDetection;
        let mode = |args: &[&str]| {
            run_args(args)
                .map_err(|e| e.to_string())
                .and_then(|run| run.into_config().map(|c| c.local_detection).map_err(|e| format!("{e:#}")))
        };
        assert_eq!(mode(&[]), Ok(LocalDetection::ClusterCidr));
        assert_eq!(mode(&["--detect-local-mode", "NodeCIDR"]), Ok(LocalDetection::NodeCidr));
        assert_eq!(
            mode(&["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"]),
            Ok(LocalDetection::InterfaceNamePrefix("veth".into()))
        );
        assert_eq!(
            mode(&["--detect-local-mode=BridgeInterface", "--pod-bridge-interface=cbr0"]),
            Ok(LocalDetection::BridgeInterface("cbr0".into()))
        );
        assert_eq!(
            mode(&[
                "--detect-local-mode",
                "InterfaceNamePrefix",
                "--pod-interface-name-prefix",
                "cali",
                "--pod-bridge-interface",
                "cbr0"
            ]),
            Ok(LocalDetection::InterfaceNamePrefix("cali".into())),
            "the other mode's flag: ignored"
        );
        assert_eq!(
            mode(&["--pod-interface-name-prefix", "veth"]),
            Ok(LocalDetection::ClusterCidr),
            "ignored, as kube-proxy does"
        );
        assert_eq!(
            mode(&["--detect-local-mode", "InterfaceNamePrefix"]),
            Err("--detect-local-mode InterfaceNamePrefix needs --pod-interface-name-prefix".into())
        );
        assert_eq!(
            mode(&["--detect-local-mode", "BridgeInterface", "--pod-interface-name-prefix", "veth"]),
            Err("--detect-local-mode BridgeInterface needs --pod-bridge-interface".into())
        );
        assert_eq!(
            mode(&["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", ""]),
            Err("--pod-bridge-interface \"\": must not be empty".into())
        );
        assert_eq!(
            mode(&["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth*"]),
            Err("--pod-interface-name-prefix \"veth*\": no wildcard: a prefix matches every name it starts".into())
        );
        assert_eq!(
            mode(&["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "a-bridge-too-long"]),
            Err("--pod-bridge-interface \"a-bridge-too-long\": longer than 15 characters (the kernel's interface names have at most 15)".into())
        );
        // A prefix is written `"prefix*"`, which must fit as well: 14 at most, 15 for a bridge.
        assert!(
            mode(&["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "fifteen-chars-x"])
                .unwrap_err()
                .contains("longer than 14 characters")
        );
        assert!(
            mode(&["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "fourteen-chars"])
                .is_ok()
        );
        assert!(mode(&["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "fifteen-chars-x"]).is_ok());
        assert_eq!(
            mode(&["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr\"0"]),
            Err("--pod-bridge-interface \"cbr\\\"0\": only letters, digits, '-', '_' and '.' make an interface name"
                .into())
        );
        assert!(
            mode(&["--detect-local-mode", "interfacenameprefix", "--pod-interface-name-prefix", "veth"]).is_err(),
            "kube-proxy's spelling only"
        );
        let run = Cli::command().find_subcommand("run").cloned().expect("run");
        let env = |long: &str| {
            run.get_arguments()
                .find(|arg| arg.get_long() == Some(long))
                .and_then(|arg| arg.get_env())
                .map(|env| env.to_string_lossy().into_owned())
        };
        assert_eq!(env("pod-interface-name-prefix").as_deref(), Some("WASMPLANE_POD_INTERFACE_NAME_PREFIX"));
        assert_eq!(env("pod-bridge-interface").as_deref(), Some("WASMPLANE_POD_BRIDGE_INTERFACE"));
    }

    /// `--cni-chained` reaches the host's configuration; it needs the CNI socket and takes no
    /// pod CIDRs (the plugin before wasmplane's allocates).
    #[test]
    fn cni_chained_reaches_the_config() {
        let cni = |args: &[&str]| match Cli::try_parse_from([&["wasmplane", "run"], args].concat()) {
            Ok(Cli { command: Command::Run(args) }) => {
                args.into_config().map(|c| c.cni.map(|c| (c.socket, c.chained))).map_err(|e| e.to_string())
            }
            Ok(_) => unreachable!("parsed as another command"),
            Err(e) => Err(e.to_string()),
        };
        let socket = PathBuf::from("/run/wasmplane/cni.sock");
        assert_eq!(cni(&["--cni-socket", "/run/wasmplane/cni.sock"]), Ok(Some((socket.clone(), false))));
        assert_eq!(cni(&["--cni-socket", "/run/wasmplane/cni.sock", "--cni-chained"]), Ok(Some((socket, true))));
        assert!(cni(&["--cni-chained"]).unwrap_err().contains("--cni-socket"));
        let both = cni(&["--cni-socket", "/run/wasmplane/cni.sock", "--cni-chained", "--pod-cidr", "10.244.0.0/24"])
            .unwrap_err();
        assert!(both.contains("--pod-cidr"), "{both}");
    }

    /// `--cni-mtu`: 0 (the default) detects, at the daemon's start; an MTU is checked against
    /// the families of the pod CIDRs given and passed on as is; it needs the CNI socket.
    #[test]
    fn cni_mtu_is_checked_and_reaches_the_config() {
        let mtu = |args: &[&str]| match Cli::try_parse_from(
            [&["wasmplane", "run", "--cni-socket", "/run/x.sock"], args].concat(),
        ) {
            Ok(Cli { command: Command::Run(args) }) => {
                args.into_config().map(|c| c.cni.expect("the CNI").mtu).map_err(|e| format!("{e:#}"))
            }
            Ok(_) => unreachable!("parsed as another command"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(mtu(&[]), Ok(None), "detected by default");
        assert_eq!(mtu(&["--cni-mtu", "0"]), Ok(None));
        assert_eq!(mtu(&["--cni-mtu", "1450"]), Ok(Some(1450)));
        assert_eq!(mtu(&["--cni-mtu", "576"]), Ok(Some(576)));
        assert_eq!(mtu(&["--cni-mtu", "65535"]), Ok(Some(65535)));
        assert_eq!(mtu(&["--cni-mtu", "9001", "--pod-cidr", "10.244.1.0/24,fd00:10:244:1::/64"]), Ok(Some(9001)));
        let small = mtu(&["--cni-mtu", "575"]).unwrap_err();
        assert!(small.contains("--cni-mtu") && small.contains("576"), "{small}");
        let v6 = mtu(&["--cni-mtu", "1279", "--pod-cidr", "10.244.1.0/24,fd00:10:244:1::/64"]).unwrap_err();
        assert!(v6.contains("--cni-mtu") && v6.contains("1280") && v6.contains("fd00:10:244:1::/64"), "{v6}");
        assert_eq!(mtu(&["--cni-mtu", "1279", "--pod-cidr", "10.244.1.0/24"]), Ok(Some(1279)), "IPv4 only");
        let big = mtu(&["--cni-mtu", "65536"]).unwrap_err();
        assert!(big.contains("--cni-mtu") && big.contains("65535"), "{big}");
        assert!(mtu(&["--cni-mtu", "-1"]).is_err());
        assert!(mtu(&["--cni-mtu", "jumbo"]).is_err());
        // Chained it is ignored (the other plugin's interfaces), not refused.
        assert_eq!(mtu(&["--cni-chained", "--cni-mtu", "1400"]), Ok(Some(1400)));
        let alone =
            Cli::try_parse_from(["wasmplane", "run", "--cni-mtu", "1400"]).expect_err("needs the socket").to_string();
        assert!(alone.contains("--cni-socket"), "{alone}");
    }

    #[test]
    fn mesh_endpoint_slices_are_the_operators_and_follow_its_remote_clusters() {
        let run = |args: &[&str]| match Cli::try_parse_from([&["wasmplane", "run"], args].concat()) {
            Ok(Cli { command: Command::Run(args) }) => {
                args.into_config().map(|c| c.operator.and_then(|o| o.mesh_slices)).map_err(|e| e.to_string())
            }
            Ok(_) => unreachable!("parsed as another command"),
            Err(e) => Err(e.to_string()),
        };
        assert!(
            run(&["--clustermesh-sync-endpoint-slices", "--cluster-name", "west"])
                .unwrap_err()
                .contains("--role operator"),
            "an agent writes no slices"
        );
        assert!(
            run(&["--clustermesh-sync-endpoint-slices", "--role", "operator"]).unwrap_err().contains("--cluster-name")
        );
        assert_eq!(
            run(&["--role", "operator", "--cluster-name", "west", "--remote-cluster", "east=http://10.0.0.1:2379"])
                .unwrap()
                .map(|m| m.remotes.len()),
            None,
            "off unless asked"
        );
        let mesh = run(&[
            "--role",
            "operator",
            "--cluster-name",
            "west",
            "--remote-cluster",
            "east=http://10.0.0.1:2379",
            "--clustermesh-sync-endpoint-slices",
        ])
        .unwrap()
        .expect("mesh slices");
        assert_eq!(mesh.remotes.iter().map(|r| r.cluster.as_str()).collect::<Vec<_>>(), ["east"]);
    }

    #[test]
    fn remote_clusters_need_a_name_urls_and_this_clusters_name() {
        assert_eq!(
            parse_remote_cluster("east=http://10.0.0.1:2379, http://10.0.0.2:2379"),
            Ok(("east".into(), vec!["http://10.0.0.1:2379".into(), "http://10.0.0.2:2379".into()]))
        );
        assert!(parse_remote_cluster("east").is_err());
        assert!(parse_remote_cluster("=http://x:2379").is_err());
        assert!(parse_remote_cluster("east=").is_err());
        let run = |args: &[&str]| match Cli::try_parse_from([&["wasmplane", "run"], args].concat()) {
            Ok(Cli { command: Command::Run(args) }) => {
                args.into_config().map(|c| c.agent.unwrap().clustermesh).map_err(|e| e.to_string())
            }
            Ok(_) => unreachable!("parsed as another command"),
            Err(e) => Err(e.to_string()),
        };
        assert!(run(&["--remote-cluster", "east=http://10.0.0.1:2379"]).unwrap_err().contains("--cluster-name"));
        assert!(run(&["--clustermesh-config", "/etc/mesh"]).unwrap_err().contains("--cluster-name"));
        assert_eq!(
            run(&["--cluster-name", "west", "--remote-cluster", "east=http://10.0.0.1:2379"]).unwrap().remotes,
            [crate::clustermesh::RemoteEtcd {
                cluster: "east".into(),
                endpoints: vec!["http://10.0.0.1:2379".into()],
                tls: None,
                user: None
            }]
        );
        // https:// remotes use this host's etcd TLS files (one CA for the mesh).
        let tls = wasmplane_kvstore::EtcdTlsFiles {
            trusted_ca_file: "/ca.pem".into(),
            cert_file: Some("/c.pem".into()),
            key_file: Some("/k.pem".into()),
        };
        let shared = run(&[
            "--cluster-name",
            "west",
            "--kvstore",
            "https://10.0.0.9:2379",
            "--etcd-trusted-ca-file",
            "/ca.pem",
            "--etcd-cert-file",
            "/c.pem",
            "--etcd-key-file",
            "/k.pem",
            "--remote-cluster",
            "east=https://10.0.0.1:2379",
            "--remote-cluster",
            "north=http://10.0.0.3:2379",
            "--clustermesh-config",
            "/etc/mesh",
        ])
        .unwrap();
        assert_eq!(shared.remotes.iter().map(|r| r.tls.clone()).collect::<Vec<_>>(), [Some(tls), None]);
        assert_eq!(shared.dir, Some("/etc/mesh".into()), "read by the agent, again as it changes");
    }

    #[test]
    fn etcd_tls_comes_from_flags_or_an_etcd_config_file() {
        let kvstore = |args: &[&str]| match Cli::try_parse_from([&["wasmplane", "run"], args].concat()) {
            Ok(Cli { command: Command::Run(args) }) => args.into_config().map(|c| c.kvstore).map_err(|e| e.to_string()),
            Ok(_) => unreachable!("parsed as another command"),
            Err(e) => Err(e.to_string()),
        };
        use crate::app::KvstoreConfig;
        let tls = |cert: Option<&str>, key: Option<&str>| {
            Some(wasmplane_kvstore::EtcdTlsFiles {
                trusted_ca_file: "/ca.pem".into(),
                cert_file: cert.map(Into::into),
                key_file: key.map(Into::into),
            })
        };
        assert_eq!(
            kvstore(&["--kvstore", "https://10.0.0.9:2379", "--etcd-trusted-ca-file", "/ca.pem"]),
            Ok(KvstoreConfig::Etcd {
                endpoints: vec!["https://10.0.0.9:2379".into()],
                tls: tls(None, None),
                user: None
            })
        );
        assert_eq!(
            kvstore(&[
                "--kvstore",
                "https://10.0.0.9:2379",
                "--etcd-trusted-ca-file",
                "/ca.pem",
                "--etcd-cert-file",
                "/c.pem",
                "--etcd-key-file",
                "/k.pem"
            ]),
            Ok(KvstoreConfig::Etcd {
                endpoints: vec!["https://10.0.0.9:2379".into()],
                tls: tls(Some("/c.pem"), Some("/k.pem")),
                user: None
            })
        );
        assert!(kvstore(&["--etcd-trusted-ca-file", "/ca.pem"]).unwrap_err().contains("embedded"));
        assert!(
            kvstore(&[
                "--kvstore",
                "https://a:2379",
                "--etcd-trusted-ca-file",
                "/ca.pem",
                "--etcd-cert-file",
                "/c.pem"
            ])
            .is_err(),
            "a certificate without its key"
        );
        assert!(
            kvstore(&["--kvstore", "https://a:2379", "--etcd-cert-file", "/c.pem", "--etcd-key-file", "/k.pem"])
                .is_err(),
            "a certificate without the CA"
        );

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("etcd.config");
        std::fs::write(&file, "endpoints: [https://etcd-0:2379, https://etcd-1:2379]\ntrusted-ca-file: ca.crt\n")
            .unwrap();
        let file = file.to_str().unwrap();
        assert_eq!(
            kvstore(&["--etcd-config", file]),
            Ok(KvstoreConfig::Etcd {
                endpoints: vec!["https://etcd-0:2379".into(), "https://etcd-1:2379".into()],
                tls: Some(wasmplane_kvstore::EtcdTlsFiles {
                    trusted_ca_file: dir.path().join("ca.crt"),
                    cert_file: None,
                    key_file: None
                }),
                user: None
            })
        );
        assert!(kvstore(&["--etcd-config", file, "--kvstore", "etcd://a:2379"]).is_err(), "two sources of endpoints");
        assert!(
            kvstore(&["--etcd-config", "/nonexistent/etcd.config"]).unwrap_err().contains("/nonexistent/etcd.config")
        );
        // The password from the environment only (the test environment has none).
        if std::env::var_os("WASMPLANE_ETCD_PASSWORD").is_none() {
            assert!(
                kvstore(&[
                    "--kvstore",
                    "https://a:2379",
                    "--etcd-trusted-ca-file",
                    "/ca.pem",
                    "--etcd-username",
                    "agent"
                ])
                .unwrap_err()
                .contains("WASMPLANE_ETCD_PASSWORD")
            );
        }
        std::fs::write(
            dir.path().join("user.config"),
            "endpoints: [https://etcd-0:2379]\ntrusted-ca-file: ca.crt\nusername: agent\npassword: pw\n",
        )
        .unwrap();
        match kvstore(&["--etcd-config", dir.path().join("user.config").to_str().unwrap()]) {
            Ok(KvstoreConfig::Etcd { user, .. }) => {
                assert_eq!(user, Some(wasmplane_kvstore::EtcdUser { name: "agent".into(), password: "pw".into() }))
            }
            other => panic!("{other:?}"),
        }
    }

    /// `node ls`, with the API flags on either side of the subcommand (as the others take them).
    #[test]
    fn node_ls_parses_with_the_api_flags() {
        for args in [
            &["wasmplane", "node", "ls", "--api", "http://10.0.0.1:9463"][..],
            &["wasmplane", "node", "--api", "http://10.0.0.1:9463", "ls"],
        ] {
            match Cli::try_parse_from(args) {
                Ok(Cli { command: Command::Node { api, command: crate::inspect::NodeCommand::Ls } }) => {
                    assert_eq!(api.api, "http://10.0.0.1:9463", "{args:?}")
                }
                other => panic!("{args:?}: {other:?}"),
            }
        }
        assert!(Cli::try_parse_from(["wasmplane", "node"]).is_err(), "a subcommand is needed");
        assert!(Cli::try_parse_from(["wasmplane", "node", "ls", "node-b"]).is_err(), "ls takes no node");
    }

    #[test]
    fn registry_credentials_come_in_pairs() {
        let half = RegistryArgs { registry_username: Some("ci".into()), ..RegistryArgs::default() };
        let e = half.connect().err().expect("a user without a password").to_string();
        assert!(e.contains("WASMPLANE_REGISTRY_PASSWORD"), "{e}");
        let missing_ca = RegistryArgs { registry_ca: Some("/nonexistent/ca.pem".into()), ..RegistryArgs::default() };
        assert!(missing_ca.connect().err().expect("an unreadable CA").to_string().contains("/nonexistent/ca.pem"));
        assert!(RegistryArgs::default().connect().is_ok());
    }

    #[test]
    fn registry_docker_config_flags_and_default() {
        let dir = tempfile::tempdir().unwrap();
        let (docker_dir, home) = (dir.path().join("docker"), dir.path().join("home"));
        std::fs::create_dir_all(&docker_dir).unwrap();
        std::fs::create_dir_all(home.join(".docker")).unwrap();
        let env = |docker_config: Option<&PathBuf>| {
            let (docker_config, home) = (docker_config.cloned(), home.clone());
            move |name: &str| match name {
                "DOCKER_CONFIG" => docker_config.clone().map(PathBuf::into_os_string),
                "HOME" => Some(home.clone().into_os_string()),
                _ => None,
            }
        };
        // Only a file that exists; $DOCKER_CONFIG replaces ~/.docker, as in docker.
        assert_eq!(default_docker_config(env(None)), None);
        std::fs::write(home.join(".docker/config.json"), "{}").unwrap();
        assert_eq!(default_docker_config(env(None)), Some(home.join(".docker/config.json")));
        assert_eq!(default_docker_config(env(Some(&docker_dir))), None);
        std::fs::write(docker_dir.join("config.json"), "{}").unwrap();
        assert_eq!(default_docker_config(env(Some(&docker_dir))), Some(docker_dir.join("config.json")));

        let parsed = match Cli::try_parse_from([
            "wasmplane",
            "module",
            "pull",
            "oci://r.example/m:v1",
            "-o",
            "m.wasm",
            "--registry-docker-config",
            "/etc/docker/config.json",
        ]) {
            Ok(Cli { command: Command::Module { command: ModuleCommand::Pull { registry, .. }, .. } }) => registry,
            other => panic!("{other:?}"),
        };
        assert_eq!(parsed.registry_docker_config, Some(PathBuf::from("/etc/docker/config.json")));
        assert_eq!(
            parsed.options().unwrap().docker_config,
            Some(PathBuf::from("/etc/docker/config.json")),
            "the flag before the default"
        );

        // A file named by the flag must be read; the default one, unreadable, is done without.
        let malformed = dir.path().join("malformed.json");
        std::fs::write(&malformed, "{").unwrap();
        let named = RegistryArgs { registry_docker_config: Some(malformed.clone()), ..RegistryArgs::default() };
        assert!(
            named
                .connect()
                .err()
                .expect("a malformed named config")
                .to_string()
                .contains(&malformed.display().to_string())
        );
        let missing =
            RegistryArgs { registry_docker_config: Some("/nonexistent/config.json".into()), ..RegistryArgs::default() };
        assert!(
            missing.connect().err().expect("a missing named config").to_string().contains("/nonexistent/config.json")
        );
        let default = RegistryArgs { default_docker_config: Some(malformed), ..RegistryArgs::default() };
        assert!(default.connect().is_ok());

        let shown = format!(
            "{:?}",
            RegistryArgs {
                registry_username: Some("ci".into()),
                registry_password: Some("registry-secret".into()),
                ..RegistryArgs::default()
            }
        );
        assert!(shown.contains("ci") && !shown.contains("registry-secret"), "{shown}");

        // The operator's: a named file only, checked at start.
        let operator =
            |args: &[&str]| match Cli::try_parse_from([&["wasmplane", "run", "--role", "operator"], args].concat()) {
                Ok(Cli { command: Command::Run(args) }) => args
                    .into_config()
                    .map(|c| c.operator.expect("an operator").module_objects.registry.docker_config)
                    .map_err(|e| e.to_string()),
                Ok(_) => unreachable!("parsed as another command"),
                Err(e) => Err(e.to_string()),
            };
        assert_eq!(operator(&[]), Ok(None));
        let secret = docker_dir.join("config.json");
        assert_eq!(operator(&["--module-registry-docker-config", secret.to_str().unwrap()]), Ok(Some(secret)));
        assert!(
            operator(&["--module-registry-docker-config", "/nonexistent/.dockerconfigjson"])
                .unwrap_err()
                .contains("/nonexistent/.dockerconfigjson")
        );
    }
}
