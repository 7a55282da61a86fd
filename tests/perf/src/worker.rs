//! One size, in its own process: the cluster process (test API server) started beside, the
//! whole host started in this process against it (kube's real client, list/watch), nftables
//! in a network namespace made for the run, and the measurements taken. Returns one JSON
//! object of results.

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::{Value, json};
use wasmplane::app::{DataplaneMode, HostConfig, KubernetesSource, RunningHost};
use wasmplane::cni::{CniCommand, CniRequest};
use wasmplane::metrics::ResultLabels;

use crate::cluster::{CLUSTER_CIDR, CNI_POD_CIDR, HOST_NODE};

#[derive(Clone, Debug)]
pub struct Opts {
    pub services: usize,
    pub endpoints: f64,
    pub policies: usize,
    /// Objects as a real cluster's API server sends them (`crate::detail`), not only the
    /// fields the host reads.
    pub full_objects: bool,
    pub seed: u64,
    pub samples: usize,
    pub churn_rate: f64,
    pub churn_seconds: f64,
    pub record: bool,
    /// Write the functions the host ran to this file (`crate::symbol_order`).
    pub trace_code: Option<std::path::PathBuf>,
    /// With `--binary` and `trace_code`: of the functions named in this file, write those the
    /// host calls after its start-up instead (`crate::call_count`).
    pub count_calls: Option<std::path::PathBuf>,
    /// The binary the cluster and compiler processes run (default: this one). A traced worker
    /// runs from a copy of the binary and starts them from the original.
    pub children_exe: Option<std::path::PathBuf>,
    /// Hand the start-up code of the binary, the compiled guests and the libraries back to the
    /// kernel after the initial sync, as `wasmplane run` does (off: `--no-page-out`, to compare).
    pub page_out: bool,
    /// The host's full reconcile interval: an hour by default, so that no full sync falls
    /// inside a measurement.
    pub reconcile_seconds: u64,
    /// The host's `--min-sync-period` (zero: off).
    pub min_sync_period: Duration,
    /// With `--binary`: where the host's `/proc/PID/smaps` is copied at the end of each run,
    /// to see which mappings hold its memory.
    pub smaps_dir: Option<std::path::PathBuf>,
}

/// The cluster process and its command pipe.
pub(crate) struct ClusterProc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl ClusterProc {
    pub(crate) fn start(o: &Opts) -> anyhow::Result<(ClusterProc, Vec<String>)> {
        let mut child = Command::new(children_exe(o)?)
            .args([
                "--apiserver",
                &o.services.to_string(),
                "--endpoints",
                &o.endpoints.to_string(),
                "--policies",
                &o.policies.to_string(),
                "--seed",
                &o.seed.to_string(),
            ])
            .args((!o.full_objects).then_some("--minimal-objects"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the cluster process")?;
        let mut p = ClusterProc {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
        };
        let ready = p.read()?;
        anyhow::ensure!(ready.first().map(String::as_str) == Some("ready"), "cluster process: {ready:?}");
        Ok((p, ready))
    }

    fn read(&mut self) -> anyhow::Result<Vec<String>> {
        let mut line = String::new();
        anyhow::ensure!(self.stdout.read_line(&mut line)? > 0, "the cluster process ended");
        Ok(line.split_whitespace().map(str::to_string).collect())
    }

    pub(crate) fn call(&mut self, command: &str) -> anyhow::Result<Vec<String>> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        let reply = self.read()?;
        anyhow::ensure!(matches!(reply.first().map(String::as_str), Some("ok" | "done")), "{command}: {reply:?}");
        Ok(reply)
    }
}

impl Drop for ClusterProc {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The network namespace the host's nft writes into; deleted on drop.
pub(crate) struct Netns(pub String);

impl Netns {
    pub(crate) fn new() -> anyhow::Result<Netns> {
        Netns::named(&format!("wpperf{}", std::process::id()))
    }

    /// Where `ip netns` keeps it.
    pub(crate) fn path(&self) -> String {
        format!("/var/run/netns/{}", self.0)
    }

    /// The command line that runs `tool` inside this namespace.
    pub(crate) fn command(&self, tool: &str) -> Vec<String> {
        ["ip", "netns", "exec", &self.0, tool].map(String::from).to_vec()
    }

    fn named(name: &str) -> anyhow::Result<Netns> {
        let name = name.to_string();
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run(&["ip", "netns", "add", &name])?;
        let ns = Netns(name);
        run(&["ip", "netns", "exec", &ns.0, "ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

pub fn run(cmd: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(cmd[0]).args(&cmd[1..]).output().with_context(|| format!("running {cmd:?}"))?;
    anyhow::ensure!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// A process's memory from `/proc/PID/status`, in KiB.
pub(crate) struct Memory {
    /// VmRSS.
    pub rss: u64,
    /// VmHWM: the peak of `rss`.
    pub hwm: u64,
    /// RssFile: resident pages of mapped files. Most are this binary's code and read-only
    /// data; how many of them are mapped depends on the page cache and read-ahead as much as
    /// on what the host runs (the kernel maps cached neighbours of every page it faults in).
    pub file: u64,
    /// RssAnon: heap, stacks, guests' memories and compiled code, relocated data.
    pub anon: u64,
}

fn memory() -> Memory {
    memory_of("self")
}

/// `process`: `self` or a process ID.
pub(crate) fn memory_of(process: &str) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{process}/status")).unwrap_or_default();
    let field = |name| kib_field(&status, name);
    Memory { rss: field("VmRSS:"), hwm: field("VmHWM:"), file: field("RssFile:"), anon: field("RssAnon:") }
}

/// The number on the first line of a /proc file (`status`, `smaps_rollup`) that starts with
/// `name` (`"VmRSS:"`), in the file's unit (kB); 0 if there is none.
pub(crate) fn kib_field(text: &str, name: &str) -> u64 {
    text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// Bytes of heap the process's allocations hold (glibc's `mallinfo2`: arena chunks in use
/// plus mmapped blocks), in KiB: what of the RSS is live data rather than code, stacks or
/// free heap pages glibc kept.
fn heap_in_use_kib() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let info = unsafe { libc::mallinfo2() };
        ((info.uordblks + info.hblkhd) / 1024) as u64
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    0
}

/// CPU seconds of this process (utime+stime) and of its waited-for children (cutime+cstime:
/// the `nft` and `conntrack` runs of the host).
fn cpu() -> (f64, f64) {
    cpu_of("self")
}

/// A process's CPU seconds, its own (user + system) and its waited-for children's.
pub(crate) fn cpu_of(pid: &str) -> (f64, f64) {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    let ticks =
        *TICKS.get_or_init(|| run(&["getconf", "CLK_TCK"]).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(100.0));
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at field 3 (state).
    let rest: Vec<f64> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().map(|f| f.parse().unwrap_or(0.0)).collect())
        .unwrap_or_default();
    let f = |n: usize| rest.get(n - 3).copied().unwrap_or(0.0) / ticks;
    (f(14) + f(15), f(16) + f(17))
}

/// Counters the host exposes, read in-process (the same values as `/metrics`).
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    events: u64,
    revisions: u64,
    syncs: u64,
    statements: u64,
    guest_seconds: f64,
    guest_calls: u64,
    /// Host time applying source batches (model, guests, dataplane) and the dataplane's part.
    apply_seconds: f64,
    dataplane_seconds: f64,
    /// The host's network programming SLI (trigger time → rules written): sum and count.
    programming_seconds: f64,
    programmed: u64,
}

fn counters(host: &RunningHost) -> Counters {
    let m = &host.metrics;
    let text = m.encode();
    let metric = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Every series of a labelled metric (guest calls are by kind), summed.
    let labelled = |name: &str| -> f64 {
        text.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{')?.split_once("} ")?.1.trim().parse::<f64>().ok())
            .sum()
    };
    Counters {
        events: m.events.get(),
        revisions: m.revisions.get(),
        syncs: m.syncs.get_or_create(&ResultLabels { result: "ok".into() }).get(),
        statements: m.sync_statements.get(),
        guest_seconds: labelled("wasmplane_guest_call_seconds_sum"),
        guest_calls: labelled("wasmplane_guest_call_seconds_count") as u64,
        apply_seconds: metric("wasmplane_source_apply_seconds_sum"),
        dataplane_seconds: metric("wasmplane_dataplane_sync_seconds_sum"),
        programming_seconds: metric("wasmplane_network_programming_duration_seconds_sum"),
        programmed: metric("wasmplane_network_programming_duration_seconds_count") as u64,
    }
}

/// Waits until the host has received `events` events and finished applying them (the
/// controller lock is free after the counter got there). False on timeout.
async fn settle(host: &RunningHost, events: u64, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while host.metrics.events.get() < events {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let controller = host.controller.clone();
    tokio::task::spawn_blocking(move || drop(controller.lock().unwrap_or_else(|p| p.into_inner()))).await.is_ok()
}

/// Whether `text` holds `ip` as a whole address (not as the prefix of a longer one).
fn has_address(text: &str, ip: &str) -> bool {
    text.match_indices(ip).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + ip.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit() || c == '.') && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

/// Whether the service's rules the host has applied (written to the kernel and accepted)
/// send to `ip`. None while the controller is busy.
fn applied_has(host: &RunningHost, namespace: &str, name: &str, ip: &str) -> Option<bool> {
    let controller = host.controller.try_lock().ok()?;
    let key = wasmplane_model::ObjectKey::new(namespace, name);
    Some(controller.dataplane().applied().get(&key).is_some_and(|r| {
        r.chains.values().flatten().any(|rule| has_address(rule, ip))
            || r.sets.values().flat_map(|s| &s.elements).any(|e| has_address(e, ip))
            || r.elements.iter().any(|((_, k), v)| has_address(k, ip) || has_address(v, ip))
    }))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    // Nearest rank.
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

pub(crate) fn children_exe(o: &Opts) -> std::io::Result<std::path::PathBuf> {
    o.children_exe.clone().map_or_else(std::env::current_exe, Ok)
}

pub fn run_size(o: Opts) -> anyhow::Result<Value> {
    if o.trace_code.is_some() {
        crate::symbol_order::start_tracing()?;
    }
    // As the `wasmplane` binary does before its runtime starts.
    wasmplane::memory::configure_malloc();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let trace_code = o.trace_code.clone();
    let mut result = runtime.block_on(measure(o))?;
    if let Some(path) = trace_code {
        crate::symbol_order::write_trace("self", &path, &mut result)?;
    }
    Ok(result)
}

async fn measure(o: Opts) -> anyhow::Result<Value> {
    let rss_before = memory().rss;
    let (mut cluster, ready) = ClusterProc::start(&o)?;
    let (objects, pods, nodes, seed_seconds) =
        (ready[2].parse::<u64>()?, ready[3].parse::<u64>()?, ready[4].parse::<u64>()?, ready[5].parse::<f64>()?);
    eprintln!("[{}] cluster seeded: {objects} objects ({pods} pods, {nodes} nodes) in {seed_seconds:.1} s", o.services);
    let mode = if o.record || !is_root() { DataplaneMode::Record } else { DataplaneMode::Nftables };
    let netns = if mode == DataplaneMode::Nftables { Some(Netns::new()?) } else { None };
    let prefix = |tool: &str| match &netns {
        Some(ns) => ns.command(tool),
        None => vec![tool.to_string()],
    };
    let data = tempfile::tempdir()?;
    let config = HostConfig {
        listen: "127.0.0.1:0".parse()?,
        kubernetes: Some(KubernetesSource::Url(ready[1].clone())),
        data_dir: Some(data.path().to_path_buf()),
        node_name: HOST_NODE.into(),
        cluster_cidrs: vec![CLUSTER_CIDR.into()],
        dataplane: mode,
        token: Some("perf-harness-token-0123456789".into()),
        nft_command: prefix("nft"),
        conntrack_command: prefix("conntrack"),
        stats_interval: Duration::from_secs(3600),
        reconcile_interval: Duration::from_secs(o.reconcile_seconds),
        min_sync_period: o.min_sync_period,
        compiler: Some(wasmplane_runtime::CompilerCommand::new(
            children_exe(&o)?,
            [wasmplane_runtime::compiler::COMPILE_SUBCOMMAND],
        )),
        // The CNI daemon, as an agent serves it, with pod veths in the host's namespace.
        cni: netns
            .as_ref()
            .map(|ns| -> anyhow::Result<_> {
                Ok(wasmplane::cni::CniConfig {
                    socket: data.path().join("cni.sock"),
                    pod_cidrs: vec![CNI_POD_CIDR.parse()?],
                    state_dir: None,
                    pod_wait: Duration::from_secs(30),
                    node_netns: Some(ns.path().into()),
                    chained: false,
                    mtu: None,
                })
            })
            .transpose()?,
        ..Default::default()
    };
    let cni_socket = config.cni.as_ref().map(|c| c.socket.clone());

    // Initial sync: start → every kind listed, every service translated, one full
    // transaction accepted by the kernel.
    let (cpu0, child_cpu0) = cpu();
    let started = Instant::now();
    let host = wasmplane::app::start(config).await?;
    let deadline = Instant::now() + Duration::from_secs(3600);
    loop {
        if host.ready.load(std::sync::atomic::Ordering::Relaxed) {
            let applied = host.controller.try_lock().ok().map(|c| c.dataplane().applied().len());
            if applied.is_some_and(|n| n >= o.services) {
                break;
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "initial sync did not finish within an hour");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let sync_seconds = started.elapsed().as_secs_f64();
    let (cpu1, child_cpu1) = cpu();
    let after_sync = counters(&host);
    let hwm_sync = memory().hwm;
    eprintln!(
        "[{}] initial sync {sync_seconds:.2} s ({} events, guest {:.2} s in {} calls)",
        o.services, after_sync.events, after_sync.guest_seconds, after_sync.guest_calls
    );
    if o.page_out {
        wasmplane::memory::page_out_code(host.compiled_guests.as_deref()).context("paging out start-up code")?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let steady = memory();
    let heap_steady = heap_in_use_kib();

    // Single endpoint changes: one EndpointSlice write each (a new pod's address in, the
    // oldest endpoint out), timed from just before the write to the moment the controller's
    // applied dataplane (what the kernel accepted) has the new address for that service.
    let mut latencies = Vec::new();
    let (mut guest_in_changes, mut change_syncs) = (0.0, 0);
    // Per change, where the time went: the API server's write (until its reply), the host's
    // apply (model, guests, dataplane), the dataplane transaction alone, the guest calls.
    let (mut write_times, mut apply_times, mut dataplane_times, mut guest_times) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // What the host's own SLI metric said of the same change (it starts at the trigger time
    // the harness wrote into the slice, just before the write).
    let mut sli_times = Vec::new();
    for n in 0..o.samples {
        let reply = cluster.call("prepare")?;
        let (i, ns, name, ip) = (reply[1].clone(), reply[2].clone(), reply[3].clone(), reply[4].clone());
        // The new pod's event (one) in and applied before the measured write.
        let expected = after_sync.events + 3 * n as u64 + 1;
        if !settle(&host, expected, Duration::from_secs(600)).await {
            eprintln!(
                "[{}] warning: the pod event did not arrive ({} < {expected})",
                o.services,
                host.metrics.events.get()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = counters(&host);
        let t0 = Instant::now();
        cluster.call(&format!("change {i}"))?;
        let written = t0.elapsed().as_secs_f64();
        let limit = Duration::from_secs(900);
        loop {
            if applied_has(&host, &ns, &name, &ip) == Some(true) {
                break;
            }
            anyhow::ensure!(t0.elapsed() < limit, "change {n} ({ns}/{name} → {ip}) not applied within {limit:?}");
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        let latency = t0.elapsed().as_secs_f64();
        let after = counters(&host);
        guest_in_changes += after.guest_seconds - before.guest_seconds;
        change_syncs += after.syncs - before.syncs;
        latencies.push(latency);
        let (apply, dataplane, guest) = (
            after.apply_seconds - before.apply_seconds,
            after.dataplane_seconds - before.dataplane_seconds,
            after.guest_seconds - before.guest_seconds,
        );
        write_times.push(written);
        apply_times.push(apply);
        dataplane_times.push(dataplane);
        guest_times.push(guest);
        let sli = (after.programmed == before.programmed + 1)
            .then_some(after.programming_seconds - before.programming_seconds);
        sli_times.extend(sli);
        let ms = |s: f64| s * 1000.0;
        let sli = sli.map_or("not observed".into(), |s| format!("{:.2}", ms(s)));
        eprintln!(
            "[{}] change {n}: {:.2} ms (write {:.2}, host apply {:.2}: dataplane {:.2}, guest {:.3}; the host's SLI {sli})",
            o.services,
            ms(latency),
            ms(written),
            ms(apply),
            ms(dataplane),
            ms(guest)
        );
        cluster.call("finish")?;
        if !settle(&host, after_sync.events + 3 * (n as u64 + 1), Duration::from_secs(600)).await {
            eprintln!("[{}] warning: the pod deletion did not arrive", o.services);
        }
    }
    for times in
        [&mut latencies, &mut write_times, &mut apply_times, &mut dataplane_times, &mut guest_times, &mut sli_times]
    {
        times.sort_by(|a, b| a.total_cmp(b));
    }
    let latency_total: f64 = latencies.iter().sum();

    let cni = match &cni_socket {
        Some(socket) => Some(cni_adds(&host, &mut cluster, socket, &o).await.context("CNI ADDs")?),
        None => None,
    };

    // Churn at a fixed operation rate, then until the host has taken every event in.
    let before = counters(&host);
    let (cpu2, child_cpu2) = cpu();
    let reply = cluster.call(&format!("churn {} {}", o.churn_rate, o.churn_seconds))?;
    let churn_end = Instant::now();
    let (ops, writes): (u64, u64) = (reply[1].parse()?, reply[2].parse()?);
    let converged = settle(&host, before.events + writes, Duration::from_secs(1800)).await;
    let drain = churn_end.elapsed().as_secs_f64();
    let (cpu3, child_cpu3) = cpu();
    let after = counters(&host);
    let churn_events = after.events - before.events;
    eprintln!(
        "[{}] churn: {ops} ops, {writes} writes, {churn_events} events, {} revisions, {} syncs; drained {drain:.2} s after",
        o.services,
        after.revisions - before.revisions,
        after.syncs - before.syncs
    );

    // Events that should change nothing: pod label changes no service or policy selects on,
    // at the same rate, for a third of the churn time.
    let before_noop = counters(&host);
    let noop_seconds = (o.churn_seconds / 3.0).max(1.0);
    let reply = cluster.call(&format!("noop {} {noop_seconds}", o.churn_rate))?;
    let noop_writes: u64 = reply[2].parse()?;
    let noop_converged = settle(&host, before_noop.events + noop_writes, Duration::from_secs(600)).await;
    let after_noop = counters(&host);
    eprintln!(
        "[{}] no-op events: {} events, {} revisions, {} syncs",
        o.services,
        after_noop.events - before_noop.events,
        after_noop.revisions - before_noop.revisions,
        after_noop.syncs - before_noop.syncs
    );
    let end = memory();

    // The host's own rendering of what it applied (one statement a line), not `nft list
    // ruleset`: nft lists table by table, which took over 5 minutes at 50k services in 64
    // shard tables.
    let ruleset_lines = host.controller.lock().unwrap_or_else(|p| p.into_inner()).dataplane().render().lines().count();
    // After every memory reading: both load what the host holds a second time.
    let translator = translator_ratio(&host).context("timing the default translator")?;
    eprintln!(
        "[{}] default translator per call: Wasm {:.2} µs, native {:.2} µs",
        o.services, translator.wasm_us, translator.native_us
    );
    let load =
        if mode == DataplaneMode::Nftables { Some(writer_vs_nft(&host).context("timing full loads")?) } else { None };
    if let Some(l) = &load {
        eprintln!(
            "[{}] full load of the applied ruleset: our writer {:.2} s ({}), one nft -f {:.2} s",
            o.services, l.writer_s, l.writer_path, l.nft_f_s
        );
    }
    host.stop().await;
    drop(cluster);
    drop(netns);
    let per_k = |cpu: f64| if churn_events > 0 { cpu / churn_events as f64 * 1000.0 } else { f64::NAN };
    Ok(json!({
        "services": o.services, "pods": pods, "nodes": nodes, "objects": objects, "policies": o.policies,
        "mode": if mode == DataplaneMode::Nftables { "nftables" } else { "record" },
        "ruleset_lines": ruleset_lines,
        "initial_sync_s": sync_seconds,
        "initial_sync_cpu_s": cpu1 - cpu0, "initial_sync_nft_cpu_s": child_cpu1 - child_cpu0,
        "initial_sync_guest_s": after_sync.guest_seconds, "initial_sync_guest_calls": after_sync.guest_calls,
        "initial_events": after_sync.events,
        "change_samples": latencies.len(),
        "change_p50_ms": percentile(&latencies, 50.0) * 1000.0,
        "change_p99_ms": percentile(&latencies, 99.0) * 1000.0,
        "change_max_ms": latencies.last().copied().unwrap_or(f64::NAN) * 1000.0,
        "change_write_p50_ms": percentile(&write_times, 50.0) * 1000.0,
        "change_sli_p50_ms": percentile(&sli_times, 50.0) * 1000.0,
        "change_sli_samples": sli_times.len(),
        "change_apply_p50_ms": percentile(&apply_times, 50.0) * 1000.0,
        "change_dataplane_p50_ms": percentile(&dataplane_times, 50.0) * 1000.0,
        "change_guest_p50_ms": percentile(&guest_times, 50.0) * 1000.0,
        "change_guest_share": if latency_total > 0.0 { guest_in_changes / latency_total } else { f64::NAN },
        "change_syncs": change_syncs,
        "churn_rate_ops": o.churn_rate, "churn_seconds": o.churn_seconds, "churn_ops": ops, "churn_writes": writes,
        "churn_events": churn_events, "churn_revisions": after.revisions - before.revisions, "churn_syncs": after.syncs - before.syncs,
        "churn_statements": after.statements - before.statements,
        "churn_converged": converged, "churn_drain_s": drain,
        "churn_guest_s": after.guest_seconds - before.guest_seconds,
        "noop_seconds": noop_seconds, "noop_events": after_noop.events - before_noop.events, "noop_revisions": after_noop.revisions - before_noop.revisions,
        "noop_syncs": after_noop.syncs - before_noop.syncs, "noop_converged": noop_converged,
        "cpu_per_1k_events_s": per_k(cpu3 - cpu2), "nft_cpu_per_1k_events_s": per_k(child_cpu3 - child_cpu2),
        "rss_before_host_kib": rss_before, "rss_steady_kib": steady.rss, "rss_end_kib": end.rss, "heap_in_use_steady_kib": heap_steady,
        "rss_file_steady_kib": steady.file, "rss_anon_steady_kib": steady.anon,
        "hwm_sync_kib": hwm_sync, "hwm_end_kib": end.hwm,
        "translator_wasm_us": translator.wasm_us, "translator_native_us": translator.native_us, "translator_services": translator.services,
        "cni_samples": cni.as_ref().map(|c| c.add.len()),
        "cni_add_p50_ms": cni.as_ref().map(|c| percentile(&c.add, 50.0) * 1000.0),
        "cni_add_p99_ms": cni.as_ref().map(|c| percentile(&c.add, 99.0) * 1000.0),
        "cni_policy_p50_ms": cni.as_ref().filter(|c| !c.policy.is_empty()).map(|c| percentile(&c.policy, 50.0) * 1000.0),
        "cni_policy_p99_ms": cni.as_ref().filter(|c| !c.policy.is_empty()).map(|c| percentile(&c.policy, 99.0) * 1000.0),
        "cni_del_p50_ms": cni.as_ref().map(|c| percentile(&c.del, 50.0) * 1000.0),
        "load_writer_s": load.as_ref().map(|l| l.writer_s), "load_writer_path": load.as_ref().map(|l| l.writer_path), "load_nft_f_s": load.as_ref().map(|l| l.nft_f_s),
    }))
}

/// CNI ADDs and DELs through the host's daemon, in seconds, sorted.
struct CniTimes {
    /// ADD: the request sent → the daemon's reply (veth, address, routes in place).
    add: Vec<f64>,
    /// With policies: the same ADD sent → the pod's ingress policy in what the kernel accepted
    /// (its address reaches the model from the daemon, before the API server has it).
    policy: Vec<f64>,
    del: Vec<f64>,
}

/// `o.samples` pods, one at a time: the cluster writes a pod on this node without an address,
/// the host sees it, then the plugin's one request (ADD) on the daemon's socket for a network
/// namespace of the pod's own, as the kubelet's runtime would make it; then DEL and the pod
/// deleted. The pod is selected by a policy when there are policies (`Cluster::cni_pod`).
async fn cni_adds(
    host: &RunningHost,
    cluster: &mut ClusterProc,
    socket: &std::path::Path,
    o: &Opts,
) -> anyhow::Result<CniTimes> {
    let mut times = CniTimes { add: Vec::new(), policy: Vec::new(), del: Vec::new() };
    for n in 0..o.samples {
        let events = host.metrics.events.get();
        let reply = cluster.call("cni-pod")?;
        let (namespace, name) = (reply[1].clone(), reply[2].clone());
        anyhow::ensure!(
            settle(host, events + 1, Duration::from_secs(60)).await,
            "the pod {namespace}/{name} did not reach the host"
        );
        let pod_netns = Netns::named(&format!("wpperf{}-pod{n}", std::process::id()))?;
        let request = |command: CniCommand| {
            let socket = socket.to_path_buf();
            let request = CniRequest::for_pod(command, &format!("perf-{name}"), &pod_netns.path(), &namespace, &name);
            tokio::task::spawn_blocking(move || request.send_blocking(&socket))
        };
        let before = counters(host);
        let t0 = Instant::now();
        let (status, result) = request(CniCommand::Add).await??;
        let add = t0.elapsed().as_secs_f64();
        anyhow::ensure!(status == 200, "ADD {namespace}/{name}: {status} {result}");
        let ip: std::net::IpAddr = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .with_context(|| format!("ADD {namespace}/{name}: no address in {result}"))?;
        if o.policies > 0 {
            let key = wasmplane::nft::policy::dispatch_object_key(wasmplane::nft::policy::Direction::Ingress, &ip);
            loop {
                if host.controller.try_lock().is_ok_and(|c| c.dataplane().applied().contains_key(&key)) {
                    break;
                }
                anyhow::ensure!(
                    t0.elapsed() < Duration::from_secs(60),
                    "{namespace}/{name} ({ip}): its ingress policy was not applied within 60 s"
                );
                tokio::time::sleep(Duration::from_micros(500)).await;
            }
            times.policy.push(t0.elapsed().as_secs_f64());
        }
        times.add.push(add);
        let after = counters(host);
        eprintln!(
            "[{}] CNI pod {n}: ADD {:.2} ms, its policy applied {:.2} ms (dataplane {:.2} ms, guest {:.3} ms)",
            o.services,
            add * 1e3,
            times.policy.last().map_or(f64::NAN, |p| p * 1e3),
            (after.dataplane_seconds - before.dataplane_seconds) * 1e3,
            (after.guest_seconds - before.guest_seconds) * 1e3
        );
        let t = Instant::now();
        let (status, result) = request(CniCommand::Del).await??;
        times.del.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(status == 200, "DEL {namespace}/{name}: {status} {result}");
        let events = host.metrics.events.get();
        cluster.call(&format!("cni-pod-gone {namespace} {name}"))?;
        anyhow::ensure!(
            settle(host, events + 1, Duration::from_secs(60)).await,
            "the deletion of {namespace}/{name} did not reach the host"
        );
    }
    for v in [&mut times.add, &mut times.policy, &mut times.del] {
        v.sort_by(f64::total_cmp);
    }
    eprintln!(
        "[{}] CNI: ADD p50 {:.2} ms, ADD → policy applied p50 {:.2} ms, DEL p50 {:.2} ms ({} pods)",
        o.services,
        percentile(&times.add, 50.0) * 1e3,
        percentile(&times.policy, 50.0) * 1e3,
        percentile(&times.del, 50.0) * 1e3,
        times.add.len()
    );
    Ok(times)
}

/// The default translator's cost per call on this cluster's services (the host's model
/// views for this node), as Wasm in a session of its own and as the same Rust compiled
/// natively, both with the same conversion from the model (`wasmplane_runtime::native`).
struct TranslatorCost {
    services: usize,
    wasm_us: f64,
    native_us: f64,
}

fn translator_ratio(host: &RunningHost) -> anyhow::Result<TranslatorCost> {
    use wasmplane_runtime::{GuestKind, Limits, NoLookups, Runtime, native};
    let (context, views) = {
        let controller = host.controller.lock().unwrap_or_else(|p| p.into_inner());
        let model = controller.model();
        let views: Vec<_> =
            model.services.iter().map(|(key, view)| (wasmplane::nft::service_prefix(key), view.clone())).collect();
        (model.context.clone(), views)
    };
    anyhow::ensure!(!views.is_empty(), "the host has no services");
    let runtime = Runtime::new(Limits { call_timeout: Duration::from_secs(5), ..Default::default() }, None)?;
    let module = runtime.load(
        "translator",
        wasmplane_guest_artifacts::SERVICE_TRANSLATOR,
        Some(GuestKind::ServiceTranslator),
        usize::MAX,
    )?;
    let mut session = module
        .translator(std::sync::Arc::new(NoLookups))
        .context("the embedded translator is not a service translator")?;
    session.instantiate_now()?;
    let sdk_context = native::node_context(&context);
    // Best of three passes over every service, alternating the two sides.
    let (mut wasm, mut native_best) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        let t = Instant::now();
        for (prefix, view) in &views {
            std::hint::black_box(session.translate_output(&context, prefix, view)?);
        }
        wasm = wasm.min(t.elapsed());
        let t = Instant::now();
        for (prefix, view) in &views {
            std::hint::black_box(
                native::translate(&sdk_context, prefix, view)
                    .map_err(|e| anyhow::anyhow!("native translate: {e:?}"))?,
            );
        }
        native_best = native_best.min(t.elapsed());
    }
    let per_call = |d: Duration| d.as_secs_f64() * 1e6 / views.len() as f64;
    Ok(TranslatorCost { services: views.len(), wasm_us: per_call(wasm), native_us: per_call(native_best) })
}

/// What the host applied, loaded into an empty network namespace by our writer (a full sync:
/// list, render, one transaction) and, in another, by one plain `nft -f` of the same document.
struct FullLoad {
    writer_s: f64,
    /// How the writer's transaction reached the kernel: one netlink batch, or `nft -f`
    /// when the batch encoder does not cover a statement or the batch is too big.
    writer_path: &'static str,
    nft_f_s: f64,
}

fn writer_vs_nft(host: &RunningHost) -> anyhow::Result<FullLoad> {
    use wasmplane::dataplane::{Dataplane, NetlinkNft, NftCommand};
    let (objects, document) = {
        let controller = host.controller.lock().unwrap_or_else(|p| p.into_inner());
        let dataplane = controller.dataplane();
        let objects: std::collections::BTreeMap<_, _> =
            dataplane.applied().iter().map(|(key, rules)| (key.clone(), (**rules).clone())).collect();
        (objects, dataplane.render())
    };
    let reference = Netns::named(&format!("wpperf{}-nft", std::process::id()))?;
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), &document)?;
    let path = file.path().to_string_lossy().into_owned();
    let mut nft_f = reference.command("nft");
    nft_f.extend(["-f".to_string(), path]);
    let t = Instant::now();
    run(&nft_f.iter().map(String::as_str).collect::<Vec<_>>())?;
    let nft_f_s = t.elapsed().as_secs_f64();
    drop(reference);

    let ns = Netns::named(&format!("wpperf{}-writer", std::process::id()))?;
    let command = ns.command("nft");
    let kernel = NetlinkNft::open(
        NftCommand::new(command.clone(), Vec::new()),
        NetlinkNft::netns_of_command(&command).as_deref(),
    )?;
    let mut dataplane = Dataplane::new(Box::new(kernel)).with_cluster_cidrs(&[CLUSTER_CIDR.to_string()]);
    let t = Instant::now();
    let stats = dataplane.full_sync(Some(objects))?;
    Ok(FullLoad { writer_s: t.elapsed().as_secs_f64(), writer_path: stats.path, nft_f_s })
}

#[cfg(test)]
mod tests {
    #[test]
    fn whole_addresses_only() {
        assert!(super::has_address("dnat to 10.64.1.2:8080", "10.64.1.2"));
        assert!(!super::has_address("dnat to 10.64.1.23:8080", "10.64.1.2"));
        assert!(!super::has_address("dnat to 110.64.1.2:8080", "10.64.1.2"));
    }
}
