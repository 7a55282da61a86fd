//! The other clusters an agent follows in their own etcds (Cilium's clustermesh): those named
//! with `--remote-cluster`, and those of `--clustermesh-config DIR`, a directory read again
//! every few seconds, as Cilium's agents watch theirs: a cluster whose file appears is
//! followed, one whose file goes is dropped with every endpoint it gave, and one whose
//! endpoints, user or certificate files change (a rotated client certificate) is reconnected
//! with what it had imported kept until the new connection lists.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use futures::future::BoxFuture;
use wasmplane_kvstore::{EtcdConfig, EtcdStore, KvError, KvStore, SharedStore, SharedStoreConfig};
use wasmplane_operator::{CLUSTERS_PREFIX, RemoteExports, cluster_exports_prefix, follow_cluster_exports};

use crate::service_import::{ImportedService, RemoteCluster};

/// Another cluster's etcd, followed read-only for its exported services.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteEtcd {
    pub cluster: String,
    pub endpoints: Vec<String>,
    pub tls: Option<wasmplane_kvstore::EtcdTlsFiles>,
    /// An etcd user of the remote cluster (its file's `username` and `password`).
    pub user: Option<wasmplane_kvstore::EtcdUser>,
}

/// Where the agent finds the clusters it follows.
#[derive(Clone, Debug, Default)]
pub struct ClusterMeshConfig {
    /// `--remote-cluster`: followed for as long as the host runs.
    pub remotes: Vec<RemoteEtcd>,
    /// `--clustermesh-config`: followed as it changes.
    pub dir: Option<PathBuf>,
    /// How often the directory and every certificate file are read again.
    pub poll: Duration,
}

impl ClusterMeshConfig {
    pub const DEFAULT_POLL: Duration = Duration::from_secs(10);
}

/// Cilium's clustermesh configuration directory: one etcd client configuration file per
/// remote cluster, named after it (a mounted Secret, so `..data` links and dot-entries are
/// skipped). The directory may also hold the certificates and keys those files name, so, as
/// Cilium does, a file is a cluster's configuration when it has `endpoints:`. This cluster's
/// own file, which a shared Secret usually holds, is skipped.
pub fn read_clustermesh_dir(dir: &Path, own_cluster: &str) -> anyhow::Result<Vec<RemoteEtcd>> {
    let mut remotes = Vec::new();
    for entry in std::fs::read_dir(dir)
        .with_context(|| format!("reading the clustermesh configuration directory {}", dir.display()))?
    {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        // `metadata` follows the Secret's symlinks; directories are its timestamped copies.
        if name.starts_with('.') || name == own_cluster || !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            continue;
        }
        let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        if !text.windows(b"endpoints:".len()).any(|w| w == b"endpoints:") {
            continue;
        }
        let config = wasmplane_kvstore::EtcdConfigFile::parse(&path, &text)?;
        remotes.push(RemoteEtcd {
            cluster: name.to_string(),
            endpoints: config.endpoints,
            tls: config.tls,
            user: config.user,
        });
    }
    remotes.sort_by(|a, b| a.cluster.cmp(&b.cluster));
    Ok(remotes)
}

/// Every remote cluster wanted now: the static ones and the directory's, each with its etcd
/// settings (TLS files read and checked).
fn wanted(config: &ClusterMeshConfig, own_cluster: &str) -> anyhow::Result<BTreeMap<String, EtcdConfig>> {
    let mut remotes = config.remotes.clone();
    if let Some(dir) = &config.dir {
        remotes.extend(read_clustermesh_dir(dir, own_cluster)?);
    }
    let mut wanted = BTreeMap::new();
    for remote in remotes {
        let etcd = crate::app::etcd_config(&remote.endpoints, remote.tls.as_ref(), remote.user.clone())
            .with_context(|| format!("remote cluster {}", remote.cluster))?;
        if wanted.insert(remote.cluster.clone(), etcd).is_some() {
            anyhow::bail!(
                "remote cluster {:?} is configured twice (--remote-cluster and --clustermesh-config)",
                remote.cluster
            );
        }
    }
    Ok(wanted)
}

/// What a host does with one remote cluster it follows: an agent imports its services (and
/// its nodes, for routes), the operator its exports (for EndpointSlices). What it took stays
/// through a reconnect and is taken back by `retract`.
pub trait Following: Send {
    /// Follows the cluster with other settings (endpoints, user, certificates).
    fn reconnect(&mut self, etcd: EtcdConfig);
    /// Stops following and takes back what the cluster gave.
    fn retract(self: Box<Self>) -> BoxFuture<'static, ()>;
    /// The cluster and whether its etcd has answered.
    fn status(&self) -> RemoteCluster;
    /// The exports it gives this host's model.
    fn imported(&self) -> Vec<ImportedService> {
        Vec::new()
    }
}

/// Starts following a cluster: its name and its etcd settings.
pub type StartFollowing = Box<dyn Fn(&str, EtcdConfig) -> Box<dyn Following> + Send + Sync>;

struct Followed {
    /// What it connected with: another endpoint, user or certificate needs a new connection.
    etcd: EtcdConfig,
    following: Box<dyn Following>,
}

/// Connects to a remote cluster's etcd and `join`s what is followed there, again and again
/// (backing off to 30 s) until both answer: a remote cluster that is down delays nothing.
/// `connected` is set once they have.
pub async fn connect_until_answered<T, F: Future<Output = Result<T, KvError>>>(
    cluster: &str,
    etcd: &EtcdConfig,
    connected: &AtomicBool,
    join: impl Fn(Arc<dyn KvStore>) -> F,
) -> T {
    let mut delay = Duration::from_millis(200);
    loop {
        let joined = async {
            let kv: Arc<dyn KvStore> = Arc::new(EtcdStore::connect(etcd.clone()).await?);
            join(kv).await
        };
        match joined.await {
            Ok(joined) => {
                connected.store(true, Ordering::Relaxed);
                return joined;
            }
            Err(e) => tracing::warn!(
                cluster,
                "remote cluster's etcd ({}) does not answer; trying again in {delay:?}: {e}",
                etcd.endpoints.join(",")
            ),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// The operator's following of a remote cluster: its exports, for the mesh EndpointSlices.
pub struct ExportFollowing {
    cluster: String,
    exports: RemoteExports,
    connected: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl ExportFollowing {
    pub fn start(cluster: &str, etcd: EtcdConfig, exports: RemoteExports) -> ExportFollowing {
        let connected = Arc::new(AtomicBool::new(false));
        let task = Self::task(cluster, etcd, &exports, &connected);
        ExportFollowing { cluster: cluster.to_string(), exports, connected, task }
    }

    fn task(
        cluster: &str,
        etcd: EtcdConfig,
        exports: &RemoteExports,
        connected: &Arc<AtomicBool>,
    ) -> tokio::task::JoinHandle<()> {
        let (cluster, exports, connected) = (cluster.to_string(), exports.clone(), connected.clone());
        tokio::spawn(async move {
            let prefix = cluster_exports_prefix(CLUSTERS_PREFIX, &cluster);
            let shared = connect_until_answered(&cluster, &etcd, &connected, |kv| {
                SharedStore::follow(kv, SharedStoreConfig::new(prefix.as_str()))
            })
            .await;
            tracing::info!(cluster, "following the remote cluster's exports");
            follow_cluster_exports(shared, cluster, exports).await;
        })
    }
}

impl Drop for ExportFollowing {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Following for ExportFollowing {
    fn reconnect(&mut self, etcd: EtcdConfig) {
        self.task.abort();
        self.connected.store(false, Ordering::Relaxed);
        self.task = Self::task(&self.cluster, etcd, &self.exports, &self.connected);
    }

    fn retract(self: Box<Self>) -> BoxFuture<'static, ()> {
        self.task.abort();
        self.exports.remove(&self.cluster);
        Box::pin(async {})
    }

    fn status(&self) -> RemoteCluster {
        RemoteCluster { name: self.cluster.clone(), connected: self.connected.load(Ordering::Relaxed) }
    }
}

/// The remote clusters followed now, kept in step with the configuration.
pub struct RemoteClusters {
    followed: Arc<Mutex<BTreeMap<String, Followed>>>,
    watcher: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for RemoteClusters {
    fn drop(&mut self) {
        if let Some(watcher) = &self.watcher {
            watcher.abort();
        }
    }
}

impl RemoteClusters {
    /// The clusters configured now, each followed by what `start` makes; a file that does not
    /// parse or a certificate that cannot be read stops the start. Later, such a mistake is
    /// logged and changes nothing.
    pub async fn start(
        config: ClusterMeshConfig,
        own_cluster: &str,
        start: StartFollowing,
    ) -> anyhow::Result<RemoteClusters> {
        let followed = Arc::new(Mutex::new(BTreeMap::new()));
        let initial = wanted(&config, own_cluster)?;
        reconcile(&followed, initial, &start).await;
        let watcher = config.dir.is_some() || config.remotes.iter().any(|r| r.tls.is_some());
        let watcher = watcher.then(|| {
            let (followed, own_cluster) = (followed.clone(), own_cluster.to_string());
            tokio::spawn(async move {
                let poll = if config.poll.is_zero() { ClusterMeshConfig::DEFAULT_POLL } else { config.poll };
                loop {
                    tokio::time::sleep(poll).await;
                    match wanted(&config, &own_cluster) {
                        Ok(now) => reconcile(&followed, now, &start).await,
                        Err(e) => tracing::error!(
                            "clustermesh configuration: {e:#}; the remote clusters followed stay as they are"
                        ),
                    }
                }
            })
        });
        Ok(RemoteClusters { followed, watcher })
    }

    /// The names of the clusters followed now.
    pub fn names(&self) -> Vec<String> {
        lock(&self.followed).keys().cloned().collect()
    }

    /// Each cluster followed and whether it answered, and what they give.
    pub fn summaries(&self) -> (Vec<RemoteCluster>, Vec<ImportedService>) {
        let followed = lock(&self.followed);
        (
            followed.values().map(|f| f.following.status()).collect(),
            followed.values().flat_map(|f| f.following.imported()).collect(),
        )
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts, reconnects and drops followings so that `wanted` is followed. Nothing here waits
/// while holding the map (REST reads it); only the followings dropped are awaited, after.
async fn reconcile(
    followed: &Mutex<BTreeMap<String, Followed>>,
    mut wanted: BTreeMap<String, EtcdConfig>,
    start: &StartFollowing,
) {
    let gone: Vec<(String, Followed)> = {
        let mut followed = lock(followed);
        let gone_names: Vec<String> = followed.keys().filter(|name| !wanted.contains_key(*name)).cloned().collect();
        let gone = gone_names.into_iter().filter_map(|name| followed.remove(&name).map(|f| (name, f))).collect();
        for (name, etcd) in std::mem::take(&mut wanted) {
            match followed.get_mut(&name) {
                Some(current) if current.etcd.same_connection(&etcd) => {}
                Some(current) => {
                    tracing::info!(cluster = name, "remote cluster's settings or certificates changed: reconnecting");
                    current.following.reconnect(etcd.clone());
                    current.etcd = etcd;
                }
                None => {
                    tracing::info!(cluster = name, endpoints = etcd.endpoints.join(","), "following a remote cluster");
                    let following = start(&name, etcd.clone());
                    followed.insert(name, Followed { etcd, following });
                }
            }
        }
        gone
    };
    for (cluster, old) in gone {
        tracing::info!(cluster, "remote cluster no longer configured: what it gave goes");
        old.following.retract().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_holds_one_file_per_cluster_beside_certificates() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write(
            "east",
            "endpoints:\n- https://east.mesh:2379\ntrusted-ca-file: common-ca.crt\ncert-file: common.crt\nkey-file: common.key\n",
        );
        write("west", "endpoints: [https://west.mesh:2379]\n");
        write("common-ca.crt", "-----BEGIN CERTIFICATE-----\n");
        std::fs::create_dir(dir.path().join("..2026_11_27")).unwrap();
        write("..data_tmp", "endpoints: [https://ignored:2379]\n");
        let remotes = read_clustermesh_dir(dir.path(), "west").unwrap();
        assert_eq!(
            remotes,
            [RemoteEtcd {
                cluster: "east".into(),
                endpoints: vec!["https://east.mesh:2379".into()],
                tls: Some(wasmplane_kvstore::EtcdTlsFiles {
                    trusted_ca_file: dir.path().join("common-ca.crt"),
                    cert_file: Some(dir.path().join("common.crt")),
                    key_file: Some(dir.path().join("common.key"))
                }),
                user: None,
            }]
        );
        write("south", "endpoints: [https://south.mesh:2379]\ninsecure-skip-tls-verify: true\n");
        let refused = format!("{:#}", read_clustermesh_dir(dir.path(), "west").unwrap_err());
        assert!(refused.contains("south") && refused.contains("insecure-skip-tls-verify"), "{refused}");
    }

    #[test]
    fn agents_do_not_watch_the_operators_mesh_slices() {
        let skipped = format!(
            "{}!={}",
            wasmplane_operator::meshslices::MANAGED_BY_LABEL,
            wasmplane_operator::MESH_SLICE_CONTROLLER
        );
        assert!(wasmplane_sources::kube::SLICE_LABEL_SELECTOR.split(',').any(|term| term == skipped), "{skipped}");
    }

    #[test]
    fn a_cluster_named_twice_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("east"), "endpoints: [http://10.0.0.1:2379]\n").unwrap();
        let remote = RemoteEtcd {
            cluster: "east".into(),
            endpoints: vec!["http://10.0.0.2:2379".into()],
            tls: None,
            user: None,
        };
        let config = ClusterMeshConfig { remotes: vec![remote], dir: Some(dir.path().into()), poll: Duration::ZERO };
        let twice = wanted(&config, "west").expect_err("east twice").to_string();
        assert!(twice.contains("\"east\" is configured twice"), "{twice}");
    }
}
