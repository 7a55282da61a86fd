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

use anyhow::Context as _;
use wasmplane_operator::{CLUSTERS_PREFIX, RemoteNodes};

use crate::controller::Controller;
use crate::metrics::ClusterMeshGauges;
use crate::service_import::{ImportedService, RemoteCluster, ServiceImport};

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
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading the clustermesh configuration directory {}", dir.display()))? {
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
        remotes.push(RemoteEtcd { cluster: name.to_string(), endpoints: config.endpoints, tls: config.tls, user: config.user });
    }
    remotes.sort_by(|a, b| a.cluster.cmp(&b.cluster));
    Ok(remotes)
}

/// Every remote cluster wanted now: the static ones and the directory's, each with its etcd
/// settings (TLS files read and checked).
fn wanted(config: &ClusterMeshConfig, own_cluster: &str) -> anyhow::Result<BTreeMap<String, wasmplane_kvstore::EtcdConfig>> {
    let mut remotes = config.remotes.clone();
    if let Some(dir) = &config.dir {
        remotes.extend(read_clustermesh_dir(dir, own_cluster)?);
    }
    let mut wanted = BTreeMap::new();
    for remote in remotes {
        let etcd = crate::app::etcd_config(&remote.endpoints, remote.tls.as_ref(), remote.user.clone()).with_context(|| format!("remote cluster {}", remote.cluster))?;
        if wanted.insert(remote.cluster.clone(), etcd).is_some() {
            anyhow::bail!("remote cluster {:?} is configured twice (--remote-cluster and --clustermesh-config)", remote.cluster);
        }
    }
    Ok(wanted)
}

struct Followed {
    /// What it connected with: another endpoint, user or certificate needs a new connection.
    etcd: wasmplane_kvstore::EtcdConfig,
    import: ServiceImport,
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
    /// The clusters configured now; a file that does not parse or a certificate that cannot
    /// be read stops the start. Later, such a mistake is logged and changes nothing.
    /// `nodes`: where the remote clusters' nodes go when this node routes to their pods.
    pub async fn start(config: ClusterMeshConfig, own_cluster: &str, controller: &Arc<Mutex<Controller>>, gauges: ClusterMeshGauges, nodes: Option<RemoteNodes>) -> anyhow::Result<RemoteClusters> {
        let followed = Arc::new(Mutex::new(BTreeMap::new()));
        let initial = wanted(&config, own_cluster)?;
        reconcile(&followed, initial, controller, &gauges, nodes.as_ref()).await;
        let watcher = config.dir.is_some() || config.remotes.iter().any(|r| r.tls.is_some());
        let watcher = watcher.then(|| {
            let (followed, weak, own_cluster) = (followed.clone(), Arc::downgrade(controller), own_cluster.to_string());
            tokio::spawn(async move {
                let poll = if config.poll.is_zero() { ClusterMeshConfig::DEFAULT_POLL } else { config.poll };
                loop {
                    tokio::time::sleep(poll).await;
                    let Some(controller) = weak.upgrade() else { return };
                    match wanted(&config, &own_cluster) {
                        Ok(now) => reconcile(&followed, now, &controller, &gauges, nodes.as_ref()).await,
                        Err(e) => tracing::error!("clustermesh configuration: {e:#}; the remote clusters followed stay as they are"),
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
        (followed.values().filter_map(|f| f.import.remote()).collect(), followed.values().flat_map(|f| f.import.imported()).collect())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts, reconnects and drops imports so that `wanted` is followed. Nothing here waits
/// while holding the map (REST reads it); only the imports dropped are awaited, after.
async fn reconcile(followed: &Mutex<BTreeMap<String, Followed>>, mut wanted: BTreeMap<String, wasmplane_kvstore::EtcdConfig>, controller: &Arc<Mutex<Controller>>, gauges: &ClusterMeshGauges, nodes: Option<&RemoteNodes>) {
    let gone: Vec<Followed> = {
        let mut followed = lock(followed);
        let gone_names: Vec<String> = followed.keys().filter(|name| !wanted.contains_key(*name)).cloned().collect();
        let gone = gone_names.iter().filter_map(|name| followed.remove(name)).collect();
        for (name, etcd) in std::mem::take(&mut wanted) {
            match followed.get_mut(&name) {
                Some(current) if current.etcd.same_connection(&etcd) => {}
                Some(current) => {
                    tracing::info!(cluster = name, "remote cluster's settings or certificates changed: reconnecting");
                    current.import.reconnect(etcd.clone(), controller, CLUSTERS_PREFIX, gauges.clone());
                    current.etcd = etcd;
                }
                None => {
                    tracing::info!(cluster = name, endpoints = etcd.endpoints.join(","), "following a remote cluster");
                    let import = ServiceImport::start_remote(name.clone(), etcd.clone(), controller, CLUSTERS_PREFIX, gauges.clone(), nodes.cloned());
                    followed.insert(name, Followed { etcd, import });
                }
            }
        }
        gone
    };
    for old in gone {
        tracing::info!(cluster = old.import.remote().map(|r| r.name).unwrap_or_default(), "remote cluster no longer configured: its endpoints go");
        old.import.retract(controller, gauges).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_holds_one_file_per_cluster_beside_certificates() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("east", "endpoints:\n- https://east.mesh:2379\ntrusted-ca-file: common-ca.crt\ncert-file: common.crt\nkey-file: common.key\n");
        write("west", "endpoints: [https://west.mesh:2379]\n");
        write("common-ca.crt", "-----BEGIN CERTIFICATE-----\n");
        std::fs::create_dir(dir.path().join("..2026_11_27")).unwrap();
        write("..data_tmp", "endpoints: [https://ignored:2379]\n");
        let remotes = read_clustermesh_dir(dir.path(), "west").unwrap();
        assert_eq!(remotes, [RemoteEtcd {
            cluster: "east".into(),
            endpoints: vec!["https://east.mesh:2379".into()],
            tls: Some(wasmplane_kvstore::EtcdTlsFiles { trusted_ca_file: dir.path().join("common-ca.crt"), cert_file: Some(dir.path().join("common.crt")), key_file: Some(dir.path().join("common.key")) }),
            user: None,
        }]);
        write("south", "endpoints: [https://south.mesh:2379]\ninsecure-skip-tls-verify: true\n");
        let refused = format!("{:#}", read_clustermesh_dir(dir.path(), "west").unwrap_err());
        assert!(refused.contains("south") && refused.contains("insecure-skip-tls-verify"), "{refused}");
    }

    #[test]
    fn a_cluster_named_twice_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("east"), "endpoints: [http://10.0.0.1:2379]\n").unwrap();
        let remote = RemoteEtcd { cluster: "east".into(), endpoints: vec!["http://10.0.0.2:2379".into()], tls: None, user: None };
        let config = ClusterMeshConfig { remotes: vec![remote], dir: Some(dir.path().into()), poll: Duration::ZERO };
        let twice = wanted(&config, "west").expect_err("east twice").to_string();
        assert!(twice.contains("\"east\" is configured twice"), "{twice}");
    }
}
