//! Network namespaces, a node topology made of them, and running code inside one.
//!
//! Code runs inside a namespace on a short-lived thread that `setns`es into it: sockets made
//! there belong to that namespace for their whole life, so they can be used afterwards from
//! any thread. No extra crates or helper binaries are needed (`setns` comes from the libc
//! std already links).

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

mod sys {
    use std::os::raw::c_int;
    unsafe extern "C" {
        pub fn setns(fd: c_int, nstype: c_int) -> c_int;
    }
    pub const CLONE_NEWNET: c_int = 0x4000_0000;
}

pub fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

/// Returns from the test, loudly, unless it runs as root; `$needs`: what for (network
/// namespaces and nftables unless said).
#[allow(unused_macros)]
macro_rules! require_root {
    () => {
        $crate::support::netns::require_root!("network namespaces, nftables")
    };
    ($needs:literal) => {
        if !$crate::support::netns::is_root() {
            eprintln!(concat!("\n!!!!!!!! SKIPPED {}: needs root (", $needs, ") !!!!!!!!\n"), module_path!());
            return;
        }
    };
}
#[allow(unused_imports)]
pub(crate) use require_root;

/// Runs `cmd` (argv) and panics with its output when it fails.
#[track_caller]
pub fn run(cmd: &[&str]) -> String {
    let out = Command::new(cmd[0]).args(&cmd[1..]).output().unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `f` on a thread inside network namespace `ns` and returns what it returns.
pub fn in_ns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let file = File::open(format!("/var/run/netns/{ns}")).unwrap_or_else(|e| panic!("opening netns {ns}: {e}"));
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: plain syscall on a valid descriptor; it only changes this thread's
            // network namespace, and the thread ends when `f` returns.
            let rc = unsafe { sys::setns(file.as_raw_fd(), sys::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns into {ns}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// A named network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: String) -> Netns {
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run(&["ip", "netns", "add", &name]);
        let ns = Netns { name };
        // Fresh namespaces: loopback up, no reverse-path filtering (veths are added later and
        // inherit `default`).
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns.sysctl("net.ipv4.conf.all.rp_filter", "0");
        ns.sysctl("net.ipv4.conf.default.rp_filter", "0");
        ns
    }

    /// Runs a command inside the namespace (`ip netns exec`).
    #[track_caller]
    pub fn exec(&self, cmd: &[&str]) -> String {
        let mut argv = vec!["ip", "netns", "exec", &self.name];
        argv.extend_from_slice(cmd);
        run(&argv)
    }

    pub fn sysctl(&self, key: &str, value: &str) {
        self.exec(&["sysctl", "-qw", &format!("{key}={value}")]);
    }

    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_ns(&self.name, f)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Namespace names unique to this process and call, so tests (and test runs) can overlap.
pub fn unique_prefix(tag: &str) -> String {
    format!("wpt{}-{}-{tag}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The address every pod's default gateway answers on (one /32 on each node-side veth).
pub const POD_GATEWAY: &str = "169.254.1.1";
/// The same for IPv6 (see [`Topology::add_dual_stack_pod`]).
pub const POD_GATEWAY6: &str = "fd00:ffff::1";
/// The name prefix of the node's side of every pod's veth (`vp0`, `vp1`…), which no other
/// interface of the node has (`ext0`, `svc0`): kube-proxy's `--pod-interface-name-prefix`.
pub const POD_VETH_PREFIX: &str = "vp";
/// The node's address on the "external" network, and the external client's.
pub const NODE_EXTERNAL_IP: &str = "192.168.77.1";
pub const EXTERNAL_CLIENT_IP: &str = "192.168.77.2";
/// An address outside every local subnet that the external namespace routes to the node,
/// used as a LoadBalancer ingress IP / externalIP.
pub const LOAD_BALANCER_IP: &str = "203.0.113.10";

/// A node made of namespaces:
///
/// ```text
///  pod ns (eth0 10.244.0.x/32, default via 169.254.1.1) ──veth── node ns (vpN, route x/32)
///    (or, bridged: vpN a port of a bridge holding 169.254.1.1, route x/32 via the bridge)
///  external ns (192.168.77.2/24) ──veth── node ns (ext0 192.168.77.1/24)
///  node ns: ip_forward, service CIDR 10.96.0.0/12 routed to an empty bridge (no dummy links
///           here) so cluster IPs are routable; nftables rules are written here.
/// ```
pub struct Topology {
    pub prefix: String,
    // Field order is drop order: pods and the external namespace go before the node.
    pods: Vec<Netns>,
    /// The bridges [`Topology::add_bridged_pod`] made in the node.
    bridges: Vec<String>,
    pub external: Netns,
    pub node: Netns,
}

impl Topology {
    pub fn new(tag: &str) -> Topology {
        let prefix = unique_prefix(tag);
        let node = Netns::new(format!("{prefix}-node"));
        node.sysctl("net.ipv4.ip_forward", "1");
        node.exec(&["ip", "link", "add", "svc0", "type", "bridge"]);
        node.exec(&["ip", "link", "set", "svc0", "up"]);
        node.exec(&["ip", "route", "add", "10.96.0.0/12", "dev", "svc0"]);

        let external = Netns::new(format!("{prefix}-ext"));
        node.exec(&["ip", "link", "add", "ext0", "type", "veth", "peer", "name", "eth0", "netns", &external.name]);
        node.exec(&["ip", "addr", "add", &format!("{NODE_EXTERNAL_IP}/24"), "dev", "ext0"]);
        node.exec(&["ip", "link", "set", "ext0", "up"]);
        external.exec(&["ip", "addr", "add", &format!("{EXTERNAL_CLIENT_IP}/24"), "dev", "eth0"]);
        external.exec(&["ip", "link", "set", "eth0", "up"]);
        external.exec(&["ip", "route", "add", "default", "via", NODE_EXTERNAL_IP]);
        Topology { prefix, pods: Vec::new(), bridges: Vec::new(), external, node }
    }

    /// IPv6 forwarding in the node, without duplicate address detection (addresses are
    /// usable at once), and the IPv6 service CIDR routed like the IPv4 one. Before pods.
    pub fn enable_ipv6(&self) {
        for ns in [&self.node, &self.external] {
            ns.sysctl("net.ipv6.conf.all.accept_dad", "0");
            ns.sysctl("net.ipv6.conf.default.accept_dad", "0");
        }
        self.node.sysctl("net.ipv6.conf.all.forwarding", "1");
        self.node.exec(&["ip", "-6", "route", "add", "fd00:96::/108", "dev", "svc0"]);
    }

    /// A pod with an IPv6 address `ip6` besides `ip`, its IPv6 default route through
    /// [`POD_GATEWAY6`] on the node's veth (the address masquerade gives hairpin flows).
    pub fn add_dual_stack_pod(&mut self, ip: &str, ip6: &str) -> String {
        let name = self.add_pod(ip);
        let veth = format!("{POD_VETH_PREFIX}{}", self.pods.len() - 1);
        self.node.exec(&["ip", "-6", "addr", "add", &format!("{POD_GATEWAY6}/128"), "dev", &veth, "nodad"]);
        self.node.exec(&["ip", "-6", "route", "add", &format!("{ip6}/128"), "dev", &veth]);
        let pod = self.pods.last().unwrap();
        pod.exec(&["ip", "-6", "addr", "add", &format!("{ip6}/128"), "dev", "eth0", "nodad"]);
        pod.exec(&["ip", "-6", "route", "add", POD_GATEWAY6, "dev", "eth0"]);
        pod.exec(&["ip", "-6", "route", "add", "default", "via", POD_GATEWAY6, "dev", "eth0"]);
        name
    }

    /// A pod namespace with address `ip` (10.244.x.y), wired to the node: its node-side veth
    /// is `vpN` ([`POD_VETH_PREFIX`], N the pod's index). Returns its name.
    pub fn add_pod(&mut self, ip: &str) -> String {
        self.wire_pod(ip, None)
    }

    /// A pod as [`Topology::add_pod`] whose node-side veth is a port of bridge `bridge` (made
    /// at its first pod, with the gateway address on it; kubenet's `cbr0`): the node sees the
    /// pod's traffic come in on the bridge, not on the veth.
    pub fn add_bridged_pod(&mut self, ip: &str, bridge: &str) -> String {
        self.wire_pod(ip, Some(bridge))
    }

    fn wire_pod(&mut self, ip: &str, bridge: Option<&str>) -> String {
        let index = self.pods.len();
        let pod = Netns::new(format!("{}-p{index}", self.prefix));
        let veth = format!("{POD_VETH_PREFIX}{index}");
        self.node.exec(&["ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &pod.name]);
        let link = match bridge {
            None => {
                self.node.exec(&["ip", "addr", "add", &format!("{POD_GATEWAY}/32"), "dev", &veth]);
                &veth
            }
            Some(bridge) => {
                if !self.bridges.iter().any(|b| b == bridge) {
                    self.node.exec(&["ip", "link", "add", bridge, "type", "bridge"]);
                    self.node.exec(&["ip", "addr", "add", &format!("{POD_GATEWAY}/32"), "dev", bridge]);
                    self.node.exec(&["ip", "link", "set", bridge, "up"]);
                    self.bridges.push(bridge.to_string());
                }
                self.node.exec(&["ip", "link", "set", &veth, "master", bridge]);
                bridge
            }
        };
        self.node.exec(&["ip", "link", "set", &veth, "up"]);
        self.node.exec(&["ip", "route", "add", &format!("{ip}/32"), "dev", link]);
        pod.exec(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        pod.exec(&["ip", "link", "set", "eth0", "up"]);
        pod.exec(&["ip", "route", "add", POD_GATEWAY, "dev", "eth0", "scope", "link"]);
        pod.exec(&["ip", "route", "add", "default", "via", POD_GATEWAY, "dev", "eth0"]);
        let name = pod.name.clone();
        self.pods.push(pod);
        name
    }

    /// `nft` inside the node namespace, as the host is configured to run it.
    pub fn nft_command(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.node.name, "nft"].map(String::from).to_vec()
    }

    /// `nft <args>` in the node namespace; stdout, or the error text.
    pub fn nft(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.node.name, "nft"])
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// Our tables as the kernel has them (the main one and the service shards; the node
    /// namespace has no others). Empty when there are none.
    pub fn table(&self) -> String {
        self.nft(&["list", "ruleset"]).unwrap_or_default()
    }
}
