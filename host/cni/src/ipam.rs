//! Node-local IPv4 allocation from the node's pod CIDR, persisted in one JSON file that is
//! replaced atomically (write, fsync, rename, fsync dir) on every change, so a restart
//! recovers exactly what was handed out.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// One address handed out, keyed by container ID and interface name as the spec keys ADD.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocation {
    pub ip: Ipv4Addr,
    pub container_id: String,
    pub if_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// When it was handed out (seconds since the Unix epoch; none in state from before this
    /// was recorded): GC spares allocations younger than its grace period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_at: Option<u64>,
}

impl Allocation {
    fn is(&self, container_id: &str, if_name: &str) -> bool {
        self.container_id == container_id && self.if_name == if_name
    }
}

#[derive(Default, Serialize, Deserialize)]
struct StateFile {
    /// The last address handed out: the next search starts after it, so a released address
    /// is reused as late as possible (a stale conntrack entry or ARP cache on a peer does
    /// not meet a new pod at once).
    #[serde(default)]
    last: Option<Ipv4Addr>,
    #[serde(default)]
    allocations: Vec<Allocation>,
}

struct State {
    last: Option<Ipv4Addr>,
    by_ip: BTreeMap<Ipv4Addr, Allocation>,
    /// Bumped on every change; compared with [`Ipam::durable`].
    version: u64,
}

/// The allocator. Changes are made under one lock (two callers never get the same address)
/// and a caller returns only once its change is on disk.
pub struct Ipam {
    cidr: Ipv4Net,
    gateway: Ipv4Addr,
    path: PathBuf,
    state: Mutex<State>,
    /// The last state version known to be on disk; its lock is held while writing.
    durable: Mutex<u64>,
}

impl Ipam {
    /// Opens (or creates) the state in `state_dir`, recovering earlier allocations.
    pub fn open(state_dir: &Path, cidr: Ipv4Net) -> Result<Ipam, Error> {
        if cidr.prefix_len() > 30 {
            return Err(Error::InvalidConfig(format!(
                "pod CIDR {cidr} is too small (needs at least a /30)"
            )));
        }
        let cidr = cidr.trunc();
        fs::create_dir_all(state_dir).map_err(|source| Error::State {
            path: state_dir.into(),
            source,
        })?;
        let path = state_dir.join("allocations.json");
        let file: StateFile = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| Error::CorruptState {
                path: path.clone(),
                reason: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => StateFile::default(),
            Err(source) => return Err(Error::State { path, source }),
        };
        let mut by_ip = BTreeMap::new();
        for a in file.allocations {
            if !cidr.contains(&a.ip) {
                // Kept anyway: the pod still has that address; it just is not ours to hand
                // out again. Logged so a changed node CIDR is visible.
                tracing::warn!(ip = %a.ip, container = %a.container_id, %cidr, "recovered allocation lies outside the pod CIDR");
            }
            if let Some(dup) = by_ip.insert(a.ip, a) {
                return Err(Error::CorruptState {
                    path,
                    reason: format!(
                        "{} allocated twice (container {})",
                        dup.ip, dup.container_id
                    ),
                });
            }
        }
        tracing::info!(path = %path.display(), %cidr, recovered = by_ip.len(), "IPAM state opened");
        let gateway = first_host(cidr);
        Ok(Ipam {
            cidr,
            gateway,
            path,
            state: Mutex::new(State {
                last: file.last,
                by_ip,
                version: 0,
            }),
            durable: Mutex::new(0),
        })
    }

    pub fn cidr(&self) -> Ipv4Net {
        self.cidr
    }

    /// The first address of the CIDR: the pods' gateway, held by the node side.
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// The allocation of `(container_id, if_name)`, if any.
    pub fn get(&self, container_id: &str, if_name: &str) -> Option<Allocation> {
        self.lock()
            .by_ip
            .values()
            .find(|a| a.is(container_id, if_name))
            .cloned()
    }

    pub fn all(&self) -> Vec<Allocation> {
        self.lock().by_ip.values().cloned().collect()
    }

    /// Whether an ADD of a new container would get an address now.
    pub fn has_free(&self) -> bool {
        let state = self.lock();
        self.next_free(&state).is_some()
    }

    /// Allocates an address for `(container_id, if_name)`; returns the existing one (and
    /// `false`) if that key already holds one, so a repeated ADD never takes a second.
    /// Returns once the allocation is on disk.
    pub fn allocate(
        &self,
        container_id: &str,
        if_name: &str,
        pod: Option<(&str, &str)>,
    ) -> Result<(Allocation, bool), Error> {
        let (alloc, version) = {
            let mut state = self.lock();
            if let Some(a) = state.by_ip.values().find(|a| a.is(container_id, if_name)) {
                // Possibly not yet durable (its ADD is still flushing): wait for that too.
                let (a, v) = (a.clone(), state.version);
                drop(state);
                self.flush_to(v)?;
                return Ok((a, false));
            }
            let ip = self.next_free(&state).ok_or(Error::PoolExhausted {
                cidr: self.cidr,
                allocated: state.by_ip.len(),
            })?;
            let alloc = Allocation {
                ip,
                container_id: container_id.into(),
                if_name: if_name.into(),
                pod_namespace: pod.map(|p| p.0.to_string()),
                pod_name: pod.map(|p| p.1.to_string()),
                allocated_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()
                    .map(|t| t.as_secs()),
            };
            state.last = Some(ip);
            state.by_ip.insert(ip, alloc.clone());
            state.version += 1;
            (alloc, state.version)
        };
        if let Err(e) = self.flush_to(version) {
            // Not handed out: take it back. (Should a concurrent flush have written it, the
            // disk holds one allocation too many, which a restart keeps: a leak, never a
            // duplicate.)
            let mut state = self.lock();
            state.by_ip.remove(&alloc.ip);
            state.version += 1;
            return Err(e);
        }
        Ok((alloc, true))
    }

    /// Releases the address of `(container_id, if_name)`; `None` if it held none. Returns
    /// once the state on disk no longer holds it.
    pub fn release(&self, container_id: &str, if_name: &str) -> Result<Option<Allocation>, Error> {
        let (released, version) = {
            let mut state = self.lock();
            let ip = state
                .by_ip
                .values()
                .find(|a| a.is(container_id, if_name))
                .map(|a| a.ip);
            let released = ip.and_then(|ip| state.by_ip.remove(&ip));
            if released.is_some() {
                state.version += 1;
            }
            (released, state.version)
        };
        // Flushed even when nothing was released here: a DEL retried after a failed flush
        // makes the earlier release durable. On failure the address stays released in
        // memory (putting it back could race with an allocation that took it); the disk
        // then holds it for a while longer, which is the safe direction.
        self.flush_to(version)?;
        Ok(released)
    }

    /// Group commit: makes every change up to `version` durable. One writer at a time; a
    /// caller that waited while another wrote usually finds its change already on disk, so
    /// a burst of N changes costs a few fsyncs, not N.
    fn flush_to(&self, version: u64) -> Result<(), Error> {
        let mut durable = self.durable.lock().unwrap_or_else(|p| p.into_inner());
        if *durable >= version {
            return Ok(());
        }
        let (file, snapshot) = {
            let state = self.lock();
            (
                StateFile {
                    last: state.last,
                    allocations: state.by_ip.values().cloned().collect(),
                },
                state.version,
            )
        };
        self.persist(&file)?;
        *durable = snapshot;
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing panics half-way through a change under this lock, so the state is
        // consistent even if some unrelated panic poisoned it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The first free host address after `last`, wrapping around; never the network,
    /// gateway or broadcast address.
    fn next_free(&self, state: &State) -> Option<Ipv4Addr> {
        let first = u32::from(self.gateway) + 1;
        let last = u32::from(self.cidr.broadcast()) - 1;
        if first > last {
            return None;
        }
        let size = last - first + 1;
        let start = match state.last.map(u32::from) {
            Some(l) if (first..=last).contains(&l) => l - first + 1,
            _ => 0,
        };
        (0..size)
            .map(|i| Ipv4Addr::from(first + (start + i) % size))
            .find(|ip| !state.by_ip.contains_key(ip))
    }

    fn persist(&self, file: &StateFile) -> Result<(), Error> {
        let bytes = serde_json::to_vec_pretty(file)
            .map_err(|e| Error::Internal(format!("serialising IPAM state: {e}")))?;
        let tmp = self.path.with_extension("json.tmp");
        let err = |source| Error::State {
            path: self.path.clone(),
            source,
        };
        let mut f = File::create(&tmp).map_err(err)?;
        f.write_all(&bytes).map_err(err)?;
        // Content on disk before the rename: after a crash the file is the old state or the
        // new one, never empty or torn.
        f.sync_all().map_err(err)?;
        fs::rename(&tmp, &self.path).map_err(err)?;
        // The directory is not synced: a rename lost to a power cut leaves the previous
        // state, and every pod it lacks died with the machine anyway. A daemon restart
        // (the case that matters) sees the rename at once. Saves a journal commit per ADD.
        Ok(())
    }
}

/// The first usable address of `cidr`.
fn first_host(cidr: Ipv4Net) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(cidr.network()) + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn cidr(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn allocates_distinct_addresses_and_skips_gateway() {
        let dir = tempfile::tempdir().unwrap();
        let ipam = Ipam::open(dir.path(), cidr("10.244.9.0/29")).unwrap();
        assert_eq!(ipam.gateway(), "10.244.9.1".parse::<Ipv4Addr>().unwrap());
        let ips: Vec<_> = (0..5)
            .map(|i| ipam.allocate(&format!("c{i}"), "eth0", None).unwrap().0.ip)
            .collect();
        assert_eq!(ips.iter().collect::<HashSet<_>>().len(), 5);
        for ip in &ips {
            assert!(
                *ip > Ipv4Addr::new(10, 244, 9, 1) && *ip < Ipv4Addr::new(10, 244, 9, 7),
                "{ip}"
            );
        }
        // /29: .2-.6 usable, all taken.
        assert!(matches!(
            ipam.allocate("c9", "eth0", None),
            Err(Error::PoolExhausted { .. })
        ));
        // Same key again: same address, not a new one.
        let (again, new) = ipam.allocate("c0", "eth0", None).unwrap();
        assert_eq!((again.ip, new), (ips[0], false));
    }

    #[test]
    fn survives_reopen_and_reuses_late() {
        let dir = tempfile::tempdir().unwrap();
        let ipam = Ipam::open(dir.path(), cidr("10.244.9.0/24")).unwrap();
        let a = ipam.allocate("a", "eth0", Some(("ns", "pa"))).unwrap().0;
        let b = ipam.allocate("b", "eth0", None).unwrap().0;
        assert_eq!(ipam.release("a", "eth0").unwrap().unwrap().ip, a.ip);
        assert_eq!(ipam.release("a", "eth0").unwrap(), None);
        drop(ipam);
        let ipam = Ipam::open(dir.path(), cidr("10.244.9.0/24")).unwrap();
        assert_eq!(ipam.get("b", "eth0").unwrap().ip, b.ip);
        assert!(ipam.get("a", "eth0").is_none());
        let c = ipam.allocate("c", "eth0", None).unwrap().0;
        assert!(
            c.ip != a.ip && c.ip != b.ip,
            "a released address is not reused at once: {c:?}"
        );
    }

    #[test]
    fn concurrent_allocations_are_distinct_and_all_durable() {
        let dir = tempfile::tempdir().unwrap();
        let ipam = Ipam::open(dir.path(), cidr("10.244.9.0/24")).unwrap();
        let ips: Vec<Ipv4Addr> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..64)
                .map(|i| {
                    let ipam = &ipam;
                    s.spawn(move || ipam.allocate(&format!("c{i}"), "eth0", None).unwrap().0.ip)
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ips.iter().collect::<HashSet<_>>().len(), 64);
        // Every caller returned only after its allocation was on disk.
        let reopened = Ipam::open(dir.path(), cidr("10.244.9.0/24")).unwrap();
        let on_disk: HashSet<Ipv4Addr> = reopened.all().iter().map(|a| a.ip).collect();
        assert_eq!(on_disk, ips.into_iter().collect());
    }

    #[test]
    fn corrupt_state_is_an_error_not_a_reset() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("allocations.json"), b"{not json").unwrap();
        assert!(matches!(
            Ipam::open(dir.path(), cidr("10.244.9.0/24")),
            Err(Error::CorruptState { .. })
        ));
    }
}
