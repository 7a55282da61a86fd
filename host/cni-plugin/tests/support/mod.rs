//! Shared by the integration tests and the benchmark: network namespaces standing in for a
//! node and its pods, a daemon started in-process whose node side lives in the node
//! namespace, the real `wasmplane-cni` binary, and real traffic (ICMP echo, TCP).
#![allow(dead_code)]

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use wasmplane_cni::{CniDaemon, DaemonConfig, DaemonHandle, PodCache, PodDirectory, PodInfo, PodNetworks};

pub const PLUGIN: &str = env!("CARGO_BIN_EXE_wasmplane-cni");

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Skips the calling test (loudly) when not root: namespaces need CAP_SYS_ADMIN.
#[macro_export]
macro_rules! require_root {
    () => {
        if !support::is_root() {
            // Straight to the stderr handle: libtest captures eprintln! of passing tests.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("SKIPPED test at {}:{}: needs root for network namespaces\n", file!(), line!()).as_bytes(),
            );
            return;
        }
    };
}

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

static NEXT: AtomicU32 = AtomicU32::new(0);

/// `wpcni-<pid>-<n>`: unique per process and call, so tests and runs can overlap.
pub fn unique(tag: &str) -> String {
    format!("wpcni-{}-{}{tag}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A named network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: String) -> Netns {
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run(&["ip", "netns", "add", &name]);
        Netns { name }
    }

    pub fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    #[track_caller]
    pub fn exec(&self, cmd: &[&str]) -> String {
        let mut argv = vec!["ip", "netns", "exec", &self.name];
        argv.extend_from_slice(cmd);
        run(&argv)
    }

    /// Whether `cmd` succeeds inside the namespace.
    pub fn try_exec(&self, cmd: &[&str]) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(cmd)
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    }

    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_ns(&self.path(), f)
    }

    /// The names of every interface in the namespace, sorted.
    pub fn links(&self) -> Vec<String> {
        let mut links: Vec<String> = self
            .exec(&["ip", "-o", "link", "show"])
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap().to_string())
            .collect();
        links.sort();
        links
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Runs `f` on a thread inside the namespace at `path`; sockets made there stay there.
pub fn in_ns<T: Send>(path: &str, f: impl FnOnce() -> T + Send) -> T {
    let file = File::open(path).unwrap_or_else(|e| panic!("opening netns {path}: {e}"));
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: plain syscall on a valid descriptor; only this short-lived thread moves.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns into {path}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// One ICMP echo request from inside `ns_path` to `to`; true if the matching reply came.
/// (No `ping` binary needed: a raw ICMP socket, which root may open.)
pub fn icmp_echo(ns_path: &str, to: Ipv4Addr, timeout: Duration) -> bool {
    in_ns(ns_path, || {
        // SAFETY: socket/sendto/recv/close on a descriptor this closure owns, with buffers
        // that outlive the calls.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP);
            assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
            let tv = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as u32,
            );
            let id = (std::process::id() as u16) ^ (NEXT.fetch_add(1, Ordering::Relaxed) as u16);
            let mut pkt = [0u8; 16];
            pkt[0] = 8; // echo request
            pkt[4..6].copy_from_slice(&id.to_be_bytes());
            pkt[6..8].copy_from_slice(&1u16.to_be_bytes());
            pkt[8..16].copy_from_slice(b"wpcni!!!");
            let sum = checksum(&pkt);
            pkt[2..4].copy_from_slice(&sum.to_be_bytes());
            let addr = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: 0,
                sin_addr: libc::in_addr { s_addr: u32::from(to).to_be() },
                sin_zero: [0; 8],
            };
            let sent = libc::sendto(
                fd,
                pkt.as_ptr().cast(),
                pkt.len(),
                0,
                (&addr as *const libc::sockaddr_in).cast(),
                size_of::<libc::sockaddr_in>() as u32,
            );
            let deadline = Instant::now() + timeout;
            let mut ok = false;
            while sent > 0 && Instant::now() < deadline {
                let mut buf = [0u8; 256];
                let n = libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0);
                if n < 28 {
                    continue;
                }
                // A raw socket sees the IP header first.
                let ihl = usize::from(buf[0] & 0x0f) * 4;
                let src = Ipv4Addr::new(buf[12], buf[13], buf[14], buf[15]);
                let icmp = &buf[ihl..n as usize];
                if icmp.len() >= 8 && icmp[0] == 0 && icmp[4..6] == id.to_be_bytes() && src == to {
                    ok = true;
                    break;
                }
            }
            libc::close(fd);
            ok
        }
    })
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A TCP server inside a namespace that answers one line per connection with its name.
pub fn tcp_server(ns_path: &str, port: u16, name: &'static str) -> std::thread::JoinHandle<()> {
    tcp_server_on(ns_path, SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)), name)
}

/// [`tcp_server`] on `addr` (`[::]:port` for IPv6).
pub fn tcp_server_on(ns_path: &str, addr: SocketAddr, name: &'static str) -> std::thread::JoinHandle<()> {
    let listener = in_ns(ns_path, || TcpListener::bind(addr).expect("bind"));
    listener.set_nonblocking(false).unwrap();
    std::thread::spawn(move || {
        // Serves a bounded number of connections, then stops (tests make only a few).
        for stream in listener.incoming().take(8) {
            let Ok(mut s) = stream else { continue };
            let peer = s.peer_addr().map(|a| a.ip().to_string()).unwrap_or_default();
            let _ = writeln!(s, "{name} saw {peer}");
        }
    })
}

/// Connects from inside `ns_path` and returns the server's line.
pub fn tcp_ask(ns_path: &str, to: SocketAddr) -> std::io::Result<String> {
    let mut stream = in_ns(ns_path, || TcpStream::connect_timeout(&to, Duration::from_secs(2)))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    stream.read_to_string(&mut line)?;
    Ok(line.trim().to_string())
}

/// What a plugin run printed and how it exited.
#[derive(Debug)]
pub struct Reply {
    pub ok: bool,
    pub json: Value,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Reply {
    /// Every address of the result, in its order.
    pub fn ips(&self) -> Vec<IpAddr> {
        self.json["ips"]
            .as_array()
            .unwrap_or_else(|| panic!("no ips in {}", self.json))
            .iter()
            .map(|ip| ip["address"].as_str().unwrap().split('/').next().unwrap().parse().unwrap())
            .collect()
    }

    pub fn ip(&self) -> Ipv4Addr {
        let addr = self.json["ips"][0]["address"].as_str().unwrap_or_else(|| panic!("no ips in {}", self.json));
        addr.split('/').next().unwrap().parse().unwrap()
    }

    pub fn code(&self) -> u64 {
        self.json["code"].as_u64().unwrap_or_else(|| panic!("not an error object: {self:?}"))
    }
}

/// Runs a CNI plugin binary with `env` and `config` on stdin.
pub fn run_plugin(bin: &str, env: &[(&str, &str)], config: &Value, pre_exec_netns: Option<&str>) -> Reply {
    let mut cmd = Command::new(bin);
    cmd.env_clear().env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    if let Some(ns) = pre_exec_netns {
        let file = File::open(ns).unwrap();
        let fd = file.as_raw_fd();
        use std::os::unix::process::CommandExt as _;
        // SAFETY: only async-signal-safe setns between fork and exec; `file` outlives spawn.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
            });
        }
        let reply = spawn_and_wait(cmd, config);
        drop(file);
        return reply;
    }
    spawn_and_wait(cmd, config)
}

fn spawn_and_wait(mut cmd: Command, config: &Value) -> Reply {
    let started = Instant::now();
    let mut child = cmd.spawn().expect("spawning plugin");
    // A plugin may exit without reading stdin (VERSION): a broken pipe here is fine.
    let _ = child.stdin.take().unwrap().write_all(config.to_string().as_bytes());
    let out = child.wait_with_output().unwrap();
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = if stdout.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("plugin printed non-JSON {stdout:?}: {e}"))
    };
    Reply { ok: out.status.success(), json, stderr: String::from_utf8_lossy(&out.stderr).into_owned(), elapsed }
}

/// `GET path` on the daemon's socket with a hand-written request; status line and body.
pub fn http_get(socket: &std::path::Path, path: &str) -> (String, String) {
    let mut s = std::os::unix::net::UnixStream::connect(socket).expect("connecting to the daemon");
    write!(s, "GET {path} HTTP/1.1\r\nHost: wasmplane\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("HTTP response");
    (head.lines().next().unwrap_or_default().to_string(), body.to_string())
}

/// A node namespace with the CNI daemon running in-process, its node side in that namespace.
pub struct Node {
    /// The pod CIDRs, the primary family first (none when chained).
    pub cidrs: Vec<ipnet::IpNet>,
    /// The daemon is chained after another plugin ([`Node::new_chained`]).
    pub chained: bool,
    pub pods: Arc<PodCache>,
    pub sink: Arc<PodNetworks>,
    pub wait: Duration,
    /// The daemon's GC grace period (none unless a test sets one).
    pub gc_grace: Duration,
    /// The pods' MTU given to the daemon; `None`: detected from the node namespace.
    pub mtu: Option<u32>,
    pub daemon: Option<Arc<CniDaemon>>,
    handle: Option<DaemonHandle>,
    pub rt: tokio::runtime::Runtime,
    pub dir: tempfile::TempDir,
    // Last: deleted after the daemon stopped.
    pub ns: Netns,
}

impl Node {
    /// `cidrs`: comma-separated, the primary family first.
    pub fn new(cidrs: &str) -> Node {
        Node::with(cidrs.split(',').map(|c| c.parse().unwrap()).collect(), false)
    }

    /// A daemon chained after another plugin: no pod CIDRs; tests hand each ADD the
    /// `prevResult` that plugin would have made.
    pub fn new_chained() -> Node {
        Node::with(Vec::new(), true)
    }

    fn with(cidrs: Vec<ipnet::IpNet>, chained: bool) -> Node {
        let mut node = Node::unstarted_with(cidrs, chained);
        node.start();
        node
    }

    /// [`Node::new`] without starting the daemon: the test prepares the node namespace (a
    /// default route, say) or the configuration first, then calls [`Node::start`].
    pub fn unstarted(cidrs: &str) -> Node {
        Node::unstarted_with(cidrs.split(',').map(|c| c.parse().unwrap()).collect(), false)
    }

    fn unstarted_with(cidrs: Vec<ipnet::IpNet>, chained: bool) -> Node {
        let ns = Netns::new(unique("-node"));
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        // Forwarding stays off here: the daemon must turn it on (pod-to-pod traffic tests it).
        assert_eq!(ns.exec(&["sysctl", "-n", "net.ipv4.ip_forward"]).trim(), "0");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        Node {
            cidrs,
            chained,
            pods: Arc::new(PodCache::new()),
            sink: Arc::new(PodNetworks::new()),
            wait: Duration::from_secs(5),
            gc_grace: Duration::ZERO,
            mtu: None,
            daemon: None,
            handle: None,
            rt,
            dir: tempfile::tempdir().unwrap(),
            ns,
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("run/cni.sock")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn start(&mut self) {
        self.start_with(self.pods.clone());
    }

    pub fn start_with(&mut self, pods: Arc<dyn PodDirectory>) {
        let mut config = DaemonConfig::new(self.cidrs.clone(), self.state_dir());
        config.socket_path = self.socket();
        config.host_netns = Some(self.ns.path().into());
        config.pod_wait_timeout = self.wait;
        config.gc_grace = self.gc_grace;
        config.chained = self.chained;
        config.mtu = self.mtu;
        let daemon = CniDaemon::new(config, pods, self.sink.clone()).expect("daemon");
        self.handle = Some(self.rt.block_on(daemon.clone().spawn()).expect("spawn daemon"));
        self.daemon = Some(daemon);
    }

    pub fn stop(&mut self) {
        if let Some(h) = self.handle.take() {
            self.rt.block_on(h.shutdown());
        }
        self.daemon = None;
    }

    pub fn restart(&mut self) {
        self.stop();
        self.start();
    }

    pub fn know_pod(&self, namespace: &str, name: &str) {
        self.pods.insert(PodInfo { namespace: namespace.into(), name: name.into(), uid: None });
    }

    pub fn config(&self, version: &str) -> Value {
        json!({"cniVersion": version, "name": "wasmplane", "type": "wasmplane-cni", "daemonSocket": self.socket()})
    }

    /// Runs the real plugin binary: `command` for `container` in `netns` as pod `pod`.
    pub fn cni(&self, command: &str, container: &str, netns: &str, pod: &str) -> Reply {
        self.cni_with(command, container, netns, pod, &self.config("1.0.0"))
    }

    pub fn cni_with(&self, command: &str, container: &str, netns: &str, pod: &str, config: &Value) -> Reply {
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=test;K8S_POD_NAME={pod}");
        let env = [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", container),
            ("CNI_NETNS", netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", &args),
            ("CNI_PATH", "/usr/lib/cni"),
        ];
        run_plugin(PLUGIN, &env, config, None)
    }

    /// Runs the real plugin binary for a command about the network (STATUS, GC): no
    /// container, interface or namespace.
    pub fn network(&self, command: &str, config: &Value) -> Reply {
        run_plugin(PLUGIN, &[("CNI_COMMAND", command), ("CNI_PATH", "/usr/lib/cni")], config, None)
    }

    /// Interfaces named `wp*` in the node namespace.
    pub fn host_links(&self) -> Vec<String> {
        self.ns.links().into_iter().filter(|n| n.starts_with("wp")).collect()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}
