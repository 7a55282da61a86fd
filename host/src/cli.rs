//! The command line: `wasmplane run` and `wasmplane module …` against the REST API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

use crate::app::{DataplaneMode, HostConfig};

#[derive(Parser, Debug)]
#[command(name = "wasmplane", version, about = "Kubernetes networking control plane whose decisions are Wasm components")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
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
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Address of the REST API.
    #[arg(long, env = "WASMPLANE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
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
    /// gRPC listen address of the node-local model stream (off when unset).
    #[arg(long, env = "WASMPLANE_GRPC_LISTEN")]
    pub grpc_listen: Option<SocketAddr>,
    /// Where modules, compiled code and the API token are kept.
    #[arg(long, env = "WASMPLANE_DATA_DIR", default_value = "/var/lib/wasmplane")]
    pub data_dir: PathBuf,
    /// This node's name (endpoints on it are local).
    #[arg(long, env = "NODE_NAME", default_value = "node-a")]
    pub node_name: String,
    /// Pod CIDRs of the cluster; traffic from outside them to services is masqueraded.
    #[arg(long = "cluster-cidr", env = "WASMPLANE_CLUSTER_CIDRS", value_delimiter = ',', default_value = "10.244.0.0/16")]
    pub cluster_cidrs: Vec<String>,
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
    /// Linear-memory limit of a guest, in MiB.
    #[arg(long, default_value_t = 64)]
    pub guest_memory_mib: usize,
    /// Seconds between full reconciles of the dataplane.
    #[arg(long, default_value_t = 60)]
    pub reconcile_seconds: u64,
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
        file: PathBuf,
        #[arg(long, default_value = "service-translator")]
        kind: String,
        /// Store the version without putting it in force.
        #[arg(long)]
        no_activate: bool,
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
    /// Go back to the version in force before the current one.
    Rollback { name: String },
    /// Delete a module (its kind falls back to the builtin if it was in force).
    Rm { name: String },
}

impl RunArgs {
    pub fn into_config(self) -> anyhow::Result<HostConfig> {
        let token = match &self.token_file {
            Some(path) => Some(std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?.trim().to_string()),
            None => None,
        };
        let limits = wasmplane_runtime::Limits {
            call_timeout: Duration::from_millis(self.guest_timeout_ms),
            memory_bytes: self.guest_memory_mib << 20,
            ..Default::default()
        };
        Ok(HostConfig {
            listen: self.listen,
            manifests: self.manifests,
            kubernetes: match (self.kubeconfig, self.kubernetes) {
                (Some(path), _) => Some(crate::app::KubernetesSource::Kubeconfig(path)),
                (None, true) => Some(crate::app::KubernetesSource::Infer),
                (None, false) => None,
            },
            grpc_listen: self.grpc_listen,
            data_dir: Some(self.data_dir),
            node_name: self.node_name,
            cluster_cidrs: self.cluster_cidrs,
            dataplane: self.dataplane,
            token,
            limits,
            max_module_bytes: self.max_module_bytes,
            reconcile_interval: Duration::from_secs(self.reconcile_seconds.max(1)),
            ..Default::default()
        })
    }
}

impl ApiArgs {
    fn token(&self) -> anyhow::Result<Option<String>> {
        if let Some(t) = &self.token {
            return Ok(Some(t.clone()));
        }
        match &self.token_file {
            Some(p) => Ok(Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?.trim().to_string())),
            None => Ok(None),
        }
    }
}

/// Runs one `wasmplane module …` command and prints the API's answer.
pub async fn module_command(api: ApiArgs, command: ModuleCommand) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let base = api.api.trim_end_matches('/').to_string();
    let token = api.token()?;
    let with_auth = |rb: reqwest::RequestBuilder| match &token {
        Some(t) => rb.bearer_auth(t),
        None => rb,
    };
    let request = match &command {
        ModuleCommand::Push { name, file, kind, no_activate } => {
            let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            client.put(format!("{base}/v1/modules/{name}")).query(&[("kind", kind.as_str()), ("activate", if *no_activate { "false" } else { "true" })]).body(bytes)
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
        ModuleCommand::Rollback { name } => client.post(format!("{base}/v1/modules/{name}/rollback")),
        ModuleCommand::Rm { name } => client.delete(format!("{base}/v1/modules/{name}")),
    };
    let response = with_auth(request).send().await.with_context(|| format!("calling {base}"))?;
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    let pretty = serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|v| serde_json::to_string_pretty(&v).ok()).unwrap_or(text);
    if status.is_success() {
        if !pretty.is_empty() {
            println!("{pretty}");
        }
        Ok(())
    } else {
        bail!("{status}: {pretty}")
    }
}
