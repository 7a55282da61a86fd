//! Node-local address allocation from the node's pod CIDRs (one per family: IPv4, IPv6, or
//! both for a dual-stack node), persisted in one JSON file (`allocations.json`) that is
//! replaced atomically (write, fsync, rename) on every change, so a restart recovers exactly
//! what was handed out and a dual-stack ADD costs one write, not one per family.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::Mutex;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::durable::DurableFile;
use crate::error::Error;

/// The addresses one attachment holds, keyed by container ID and interface name as the
/// spec keys ADD.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "StoredAllocation", into = "StoredAllocation")]
pub struct Allocation {
    /// One address per pool, in the pools' order (the node's primary family first). Fewer
    /// when the allocation predates a pool: a pod keeps what it was given.
    pub ips: Vec<IpAddr>,
    pub container_id: String,
    pub if_name: String,
    pub pod_namespace: Option<String>,
    pub pod_name: Option<String>,
    /// When it was handed out (seconds since the Unix epoch; none in state from before this
    /// was recorded): GC spares allocations younger than its grace period.
    pub allocated_at: Option<u64>,
}

impl Allocation {
    fn key(&self) -> (String, String) {
        (self.container_id.clone(), self.if_name.clone())
    }
}

/// An allocation as the state file (and `GET /v1/allocations`) holds it: `ip` is the first
/// address, the only field state from before dual stack has, and what such a daemon reads
/// back after a downgrade; `ips` lists them all.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredAllocation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ip: Option<IpAddr>,
    #[serde(default)]
    ips: Vec<IpAddr>,
    container_id: String,
    if_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    allocated_at: Option<u64>,
}

impl From<StoredAllocation> for Allocation {
    fn from(s: StoredAllocation) -> Allocation {
        Allocation {
            ips: if s.ips.is_empty() { s.ip.into_iter().collect() } else { s.ips },
            container_id: s.container_id,
            if_name: s.if_name,
            pod_namespace: s.pod_namespace,
            pod_name: s.pod_name,
            allocated_at: s.allocated_at,
        }
    }
}

impl From<Allocation> for StoredAllocation {
    fn from(a: Allocation) -> StoredAllocation {
        StoredAllocation {
            ip: a.ips.first().copied(),
            ips: a.ips,
            container_id: a.container_id,
            if_name: a.if_name,
            pod_namespace: a.pod_namespace,
            pod_name: a.pod_name,
            allocated_at: a.allocated_at,
        }
    }
}

/// One pod CIDR: its first address is the pods' gateway, held by the node side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    pub cidr: IpNet,
    pub gateway: IpAddr,
}

impl Pool {
    /// Pods it can address at most: all but the network address, the gateway and IPv4's
    /// broadcast (saturating for IPv6's large prefixes).
    pub fn capacity(&self) -> u64 {
        let host_bits = u32::from(self.cidr.max_prefix_len() - self.cidr.prefix_len());
        let reserved = if self.cidr.addr().is_ipv4() { 3 } else { 2 };
        1u64.checked_shl(host_bits).map_or(u64::MAX, |size| size - reserved)
    }

    fn new(cidr: IpNet) -> Result<Pool, Error> {
        // Network, gateway and one pod (and IPv4's broadcast).
        let longest = if cidr.addr().is_ipv4() { 30 } else { 126 };
        if cidr.prefix_len() > longest {
            return Err(Error::InvalidConfig(format!("pod CIDR {cidr} is too small (needs at least a /{longest})")));
        }
        let cidr = cidr.trunc();
        Ok(Pool { cidr, gateway: nth_address(cidr, as_u128(cidr.network()) + 1) })
    }

    /// The first address after `last` that no one holds, wrapping around; never the
    /// network, gateway or (IPv4) broadcast address.
    fn free_after(&self, last: Option<IpAddr>, taken: &HashSet<IpAddr>) -> Option<IpAddr> {
        let first = as_u128(self.gateway) + 1;
        let end = as_u128(self.cidr.broadcast()) - u128::from(self.cidr.addr().is_ipv4());
        if first > end {
            return None;
        }
        let size = end - first + 1;
        let start = match last.map(as_u128) {
            Some(l) if (first..=end).contains(&l) => l - first + 1,
            _ => 0,
        };
        (0..size).map(|i| nth_address(self.cidr, first + (start + i) % size)).find(|ip| !taken.contains(ip))
    }
}

fn as_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The address numbered `n` in `cidr`'s family (`n` lies inside it).
fn nth_address(cidr: IpNet, n: u128) -> IpAddr {
    match cidr {
        IpNet::V4(_) => IpAddr::V4(Ipv4Addr::from(n as u32)),
        IpNet::V6(_) => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

#[derive(Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StateFile {
    /// The last address handed out per family: the next search starts after it, so a
    /// released address is reused as late as possible (a stale conntrack entry or neighbour
    /// cache on a peer does not meet a new pod at once). `last` is IPv4's, as before dual
    /// stack.
    #[serde(default)]
    last: Option<Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_v6: Option<Ipv6Addr>,
    #[serde(default)]
    allocations: Vec<Allocation>,
}

struct State {
    /// Per pool, in the pools' order.
    last: Vec<Option<IpAddr>>,
    by_key: BTreeMap<(String, String), Allocation>,
    taken: HashSet<IpAddr>,
    /// Bumped on every change; what [`DurableFile::flush_to`] makes durable.
    version: u64,
}

/// The allocator. Changes are made under one lock (two callers never get the same address)
/// and a caller returns only once its change is on disk.
pub struct Ipam {
    pools: Vec<Pool>,
    file: DurableFile,
    state: Mutex<State>,
}

impl Ipam {
    /// Opens (or creates) the state in `state_dir`, recovering earlier allocations. `cidrs`:
    /// one per family, the node's primary family first (its pods' first address).
    pub fn open(state_dir: &Path, cidrs: &[IpNet]) -> Result<Ipam, Error> {
        let pools = cidrs.iter().map(|c| Pool::new(*c)).collect::<Result<Vec<_>, _>>()?;
        match pools.as_slice() {
            [] => return Err(Error::InvalidConfig("no pod CIDR".into())),
            [a, b] if a.cidr.addr().is_ipv4() == b.cidr.addr().is_ipv4() => {
                return Err(Error::InvalidConfig(format!(
                    "two pod CIDRs of one family ({} and {}): at most one IPv4 and one IPv6",
                    a.cidr, b.cidr
                )));
            }
            [_] | [_, _] => {}
            _ => return Err(Error::InvalidConfig(format!("{} pod CIDRs: at most one IPv4 and one IPv6", pools.len()))),
        }
        let (durable, file) = DurableFile::open::<StateFile>(state_dir, "allocations.json")?;
        let path = durable.path();
        let corrupt = |reason: String| Error::CorruptState { path: path.into(), reason };
        let (mut by_key, mut taken) = (BTreeMap::new(), HashSet::new());
        for a in file.allocations {
            if a.ips.is_empty() {
                return Err(corrupt(format!("container {} holds no address", a.container_id)));
            }
            for ip in &a.ips {
                if !pools.iter().any(|p| p.cidr.contains(ip)) {
                    // Kept anyway: the pod still has that address; it just is not ours to
                    // hand out again. Logged so a changed node CIDR is visible.
                    tracing::warn!(%ip, container = %a.container_id, "recovered allocation lies outside the pod CIDRs");
                }
                if !taken.insert(*ip) {
                    return Err(corrupt(format!("{ip} allocated twice (container {})", a.container_id)));
                }
            }
            if let Some(dup) = by_key.insert(a.key(), a) {
                return Err(corrupt(format!(
                    "container {} interface {} allocated twice",
                    dup.container_id, dup.if_name
                )));
            }
        }
        let last = pools
            .iter()
            .map(|p| match p.cidr {
                IpNet::V4(_) => file.last.map(IpAddr::V4),
                IpNet::V6(_) => file.last_v6.map(IpAddr::V6),
            })
            .collect();
        let cidrs: Vec<String> = pools.iter().map(|p| p.cidr.to_string()).collect();
        tracing::info!(path = %path.display(), ?cidrs, recovered = by_key.len(), "IPAM state opened");
        Ok(Ipam { pools, file: durable, state: Mutex::new(State { last, by_key, taken, version: 0 }) })
    }

    /// The pod CIDRs with their gateways, the primary family first.
    pub fn pools(&self) -> &[Pool] {
        &self.pools
    }

    /// The allocation of `(container_id, if_name)`, if any.
    pub fn get(&self, container_id: &str, if_name: &str) -> Option<Allocation> {
        self.lock().by_key.get(&(container_id.to_string(), if_name.to_string())).cloned()
    }

    pub fn all(&self) -> Vec<Allocation> {
        self.lock().by_key.values().cloned().collect()
    }

    /// The pod CIDR with no free address left, if any: an ADD of a new container fails
    /// then.
    pub fn exhausted(&self) -> Option<IpNet> {
        let state = self.lock();
        self.pools
            .iter()
            .zip(&state.last)
            .find(|(pool, last)| pool.free_after(**last, &state.taken).is_none())
            .map(|(pool, _)| pool.cidr)
    }

    /// Allocates an address of every pool for `(container_id, if_name)`; returns the
    /// existing allocation (and `false`) if that key already holds one, so a repeated ADD
    /// never takes a second. Returns once the allocation is on disk.
    pub fn allocate(
        &self,
        container_id: &str,
        if_name: &str,
        pod: Option<(&str, &str)>,
    ) -> Result<(Allocation, bool), Error> {
        let (alloc, version) = {
            let mut state = self.lock();
            let key = (container_id.to_string(), if_name.to_string());
            if let Some(a) = state.by_key.get(&key) {
                // Possibly not yet durable (its ADD is still flushing): wait for that too.
                let (a, v) = (a.clone(), state.version);
                drop(state);
                self.flush_to(v)?;
                return Ok((a, false));
            }
            let mut ips = Vec::with_capacity(self.pools.len());
            for (pool, last) in self.pools.iter().zip(&state.last) {
                ips.push(
                    pool.free_after(*last, &state.taken)
                        .ok_or(Error::PoolExhausted { cidr: pool.cidr, allocated: state.by_key.len() })?,
                );
            }
            let alloc = Allocation {
                ips,
                container_id: container_id.into(),
                if_name: if_name.into(),
                pod_namespace: pod.map(|p| p.0.to_string()),
                pod_name: pod.map(|p| p.1.to_string()),
                allocated_at: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()
                    .map(|t| t.as_secs()),
            };
            state.last = alloc.ips.iter().map(|ip| Some(*ip)).collect();
            state.taken.extend(alloc.ips.iter().copied());
            state.by_key.insert(key, alloc.clone());
            state.version += 1;
            (alloc, state.version)
        };
        if let Err(e) = self.flush_to(version) {
            // Not handed out: take it back. (Should a concurrent flush have written it, the
            // disk holds one allocation too many, which a restart keeps: a leak, never a
            // duplicate.)
            let mut state = self.lock();
            state.remove(&alloc.key());
            state.version += 1;
            return Err(e);
        }
        Ok((alloc, true))
    }

    /// Releases the addresses of `(container_id, if_name)`; `None` if it held none. Returns
    /// once the state on disk no longer holds them.
    pub fn release(&self, container_id: &str, if_name: &str) -> Result<Option<Allocation>, Error> {
        let (released, version) = {
            let mut state = self.lock();
            let released = state.remove(&(container_id.to_string(), if_name.to_string()));
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

    /// Makes every change up to `version` durable (see [`DurableFile::flush_to`]).
    fn flush_to(&self, version: u64) -> Result<(), Error> {
        self.file.flush_to(version, || {
            let state = self.lock();
            let mut file = StateFile { allocations: state.by_key.values().cloned().collect(), ..StateFile::default() };
            for ip in state.last.iter().flatten() {
                match *ip {
                    IpAddr::V4(v4) => file.last = Some(v4),
                    IpAddr::V6(v6) => file.last_v6 = Some(v6),
                }
            }
            (file, state.version)
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing panics half-way through a change under this lock, so the state is
        // consistent even if some unrelated panic poisoned it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    fn remove(&mut self, key: &(String, String)) -> Option<Allocation> {
        let released = self.by_key.remove(key)?;
        for ip in &released.ips {
            self.taken.remove(ip);
        }
        Some(released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn cidrs(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn allocates_distinct_addresses_and_skips_gateway() {
        let dir = tempfile::tempdir().unwrap();
        let ipam = Ipam::open(dir.path(), &cidrs(&["10.244.9.0/29"])).unwrap();
        assert_eq!(ipam.pools()[0].gateway, ip("10.244.9.1"));
        let ips: Vec<_> = (0..5).map(|i| ipam.allocate(&format!("c{i}"), "eth0", None).unwrap().0.ips[0]).collect();
        assert_eq!(ips.iter().collect::<HashSet<_>>().len(), 5);
        for a in &ips {
            assert!(*a > ip("10.244.9.1") && *a < ip("10.244.9.7"), "{a}");
        }
        // /29: .2-.6 usable, all taken.
        assert_eq!(ipam.exhausted(), Some(cidrs(&["10.244.9.0/29"])[0]));
        assert!(matches!(ipam.allocate("c9", "eth0", None), Err(Error::PoolExhausted { .. })));
        // Same key again: same address, not a new one.
        let (again, new) = ipam.allocate("c0", "eth0", None).unwrap();
        assert_eq!((again.ips[0], new), (ips[0], false));
    }

    #[test]
    fn survives_reopen_and_reuses_late() {
        let dir = tempfile::tempdir().unwrap();
        let pool = cidrs(&["10.244.9.0/24"]);
        let ipam = Ipam::open(dir.path(), &pool).unwrap();
        let a = ipam.allocate("a", "eth0", Some(("ns", "pa"))).unwrap().0;
        let b = ipam.allocate("b", "eth0", None).unwrap().0;
        assert_eq!(ipam.release("a", "eth0").unwrap().unwrap().ips, a.ips);
        assert_eq!(ipam.release("a", "eth0").unwrap(), None);
        drop(ipam);
        let ipam = Ipam::open(dir.path(), &pool).unwrap();
        assert_eq!(ipam.get("b", "eth0").unwrap().ips, b.ips);
        assert!(ipam.get("a", "eth0").is_none());
        let c = ipam.allocate("c", "eth0", None).unwrap().0;
        assert!(c.ips != a.ips && c.ips != b.ips, "a released address is not reused at once: {c:?}");
    }

    #[test]
    fn concurrent_allocations_are_distinct_and_all_durable() {
        let dir = tempfile::tempdir().unwrap();
        let pool = cidrs(&["10.244.9.0/24"]);
        let ipam = Ipam::open(dir.path(), &pool).unwrap();
        let ips: Vec<IpAddr> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..64)
                .map(|i| {
                    let ipam = &ipam;
                    s.spawn(move || ipam.allocate(&format!("c{i}"), "eth0", None).unwrap().0.ips[0])
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ips.iter().collect::<HashSet<_>>().len(), 64);
        // Every caller returned only after its allocation was on disk.
        let reopened = Ipam::open(dir.path(), &pool).unwrap();
        let on_disk: HashSet<IpAddr> = reopened.all().iter().map(|a| a.ips[0]).collect();
        assert_eq!(on_disk, ips.into_iter().collect());
    }

    #[test]
    fn corrupt_state_is_an_error_not_a_reset() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("allocations.json"), b"{not json").unwrap();
        assert!(matches!(Ipam::open(dir.path(), &cidrs(&["10.244.9.0/24"])), Err(Error::CorruptState { .. })));
    }

    /// Dual stack: one address of each family per attachment, in the pools' order (the
    /// primary family first), both freed by one release, each family's search going on
    /// after its own last address across a restart.
    #[test]
    fn dual_stack_allocates_one_address_per_family() {
        let dir = tempfile::tempdir().unwrap();
        let pools = cidrs(&["fd00:10:244:9::/64", "10.244.9.0/24"]);
        let ipam = Ipam::open(dir.path(), &pools).unwrap();
        assert_eq!(ipam.pools()[0].gateway, ip("fd00:10:244:9::1"));
        assert_eq!(ipam.pools()[1].gateway, ip("10.244.9.1"));
        let a = ipam.allocate("a", "eth0", None).unwrap().0;
        assert_eq!(a.ips, [ip("fd00:10:244:9::2"), ip("10.244.9.2")]);
        let b = ipam.allocate("b", "eth0", None).unwrap().0;
        assert_eq!(b.ips, [ip("fd00:10:244:9::3"), ip("10.244.9.3")]);
        ipam.release("a", "eth0").unwrap();
        drop(ipam);
        let ipam = Ipam::open(dir.path(), &pools).unwrap();
        assert_eq!(ipam.get("b", "eth0").unwrap().ips, b.ips);
        let c = ipam.allocate("c", "eth0", None).unwrap().0;
        assert_eq!(c.ips, [ip("fd00:10:244:9::4"), ip("10.244.9.4")], "a's addresses are not reused at once");
        // One family full: no allocation at all (not a pod with half its addresses).
        let dir = tempfile::tempdir().unwrap();
        let small = Ipam::open(dir.path(), &cidrs(&["10.244.9.0/24", "fd00::/126"])).unwrap();
        small.allocate("x", "eth0", None).unwrap();
        small.allocate("x2", "eth0", None).unwrap();
        assert_eq!(small.exhausted(), Some(cidrs(&["fd00::/126"])[0]));
        let e = small.allocate("y", "eth0", None).unwrap_err();
        assert!(e.to_string().contains("fd00::/126"), "{e}");
        assert_eq!(small.all().len(), 2);
    }

    #[test]
    fn pod_cidrs_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let refused = |list: &[&str]| match Ipam::open(dir.path(), &cidrs(list)) {
            Err(Error::InvalidConfig(e)) => e,
            other => panic!("{list:?}: {:?}", other.map(|_| ())),
        };
        assert!(refused(&[]).contains("no pod CIDR"));
        assert!(refused(&["10.244.0.0/24", "10.245.0.0/24"]).contains("one family"));
        assert!(refused(&["10.244.0.0/31"]).contains("/30"));
        assert!(refused(&["fd00::/127"]).contains("/126"));
        // A /126 has the network, the gateway and two pod addresses (no broadcast in IPv6).
        let ipam = Ipam::open(dir.path(), &cidrs(&["fd00::/126"])).unwrap();
        ipam.allocate("a", "eth0", None).unwrap();
        assert_eq!(ipam.allocate("b", "eth0", None).unwrap().0.ips, [ip("fd00::3")]);
        assert!(ipam.exhausted().is_some());
    }

    /// State written before dual stack (one `ip` per allocation, `last` an IPv4 address)
    /// is read as it was; what is written now still carries `ip` for an older daemon.
    #[test]
    fn reads_and_keeps_the_single_stack_state_format() {
        let dir = tempfile::tempdir().unwrap();
        let old = r#"{"last": "10.244.9.7", "allocations": [
            {"ip": "10.244.9.7", "containerId": "old", "ifName": "eth0", "podNamespace": "ns", "podName": "p"}]}"#;
        fs::write(dir.path().join("allocations.json"), old).unwrap();
        let pools = cidrs(&["10.244.9.0/24", "fd00:1::/64"]);
        let ipam = Ipam::open(dir.path(), &pools).unwrap();
        let recovered = ipam.get("old", "eth0").unwrap();
        assert_eq!((recovered.ips.as_slice(), recovered.allocated_at), (&[ip("10.244.9.7")][..], None));
        let new = ipam.allocate("new", "eth0", None).unwrap().0;
        assert_eq!(new.ips, [ip("10.244.9.8"), ip("fd00:1::2")], "the IPv4 search goes on after the old last");
        let written: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.path().join("allocations.json")).unwrap()).unwrap();
        assert_eq!(written["last"], "10.244.9.8");
        assert_eq!(written["lastV6"], "fd00:1::2");
        let new_entry = &written["allocations"][0];
        assert_eq!((new_entry["containerId"].as_str(), new_entry["ip"].as_str()), (Some("new"), Some("10.244.9.8")));
        assert_eq!(new_entry["ips"], serde_json::json!(["10.244.9.8", "fd00:1::2"]));
    }
}
