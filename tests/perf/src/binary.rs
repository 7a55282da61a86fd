//! The shipped `wasmplane` binary, measured from outside (BENCHMARKS.md, eleventh run).
//!
//! The in-process worker (`worker.rs`) runs the host's library inside this harness: its RSS
//! includes the harness, and its code is laid out as this binary's, not the shipped one's.
//! Here the worker enters a network namespace of its own, starts the cluster process and
//! `wasmplane run` as a child against it (a kubeconfig, nftables, the REST API on the
//! namespace's loopback), drives the same kinds of change, churn and no-op events through
//! the cluster, and reads the child's memory from /proc. Latency is the in-process worker's
//! job (it sees the applied dataplane without polling an API).
//!
//! With `trace_code` it writes the functions the child ran (`symbol_order`): the order the
//! release build links with (`host/build.rs`); with `count_calls` too, those of a list it
//! called after its start-up (`call_count`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::{Value, json};

use crate::cluster::{CLUSTER_CIDR, HOST_NODE};
use crate::worker::{ClusterProc, Netns, Opts, is_root, kib_field, memory_of};

const TOKEN: &str = "perf-harness-token-0123456789";

/// Which binary runs as the host, and with what beforehand.
pub struct Binary {
    pub path: PathBuf,
    /// Run this binary first against the same data directory until ready, so the traced run
    /// finds the guests compiled: the compile child would run the traced copy and bring
    /// Cranelift's pages into its page cache, where fault-around maps them into the host.
    pub warm_with: Option<PathBuf>,
}

pub fn run_size(o: Opts, binary: Binary) -> anyhow::Result<Value> {
    let nftables = !o.record && is_root();
    let netns = if nftables { Some(Netns::new()?) } else { None };
    if let Some(ns) = &netns {
        // Before any thread starts: threads and children inherit the namespace, so the
        // cluster process, the host and this process's HTTP client share its loopback.
        enter(ns)?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let result = runtime.block_on(measure(&o, &binary, nftables));
    drop(netns);
    result
}

fn enter(ns: &Netns) -> anyhow::Result<()> {
    let file = std::fs::File::open(format!("/var/run/netns/{}", ns.0)).context("opening the network namespace")?;
    // SAFETY: setns on an open namespace file; this process has one thread so far.
    let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
    anyhow::ensure!(rc == 0, "setns({}): {}", ns.0, std::io::Error::last_os_error());
    Ok(())
}

/// `wasmplane run` as a child process, and its REST API.
struct HostProc {
    child: Child,
    api: String,
    http: reqwest::Client,
}

impl HostProc {
    fn start(binary: &Path, dir: &Path, nftables: bool, o: &Opts) -> anyhow::Result<HostProc> {
        // As a binary installed on a node is: on disk, its page cache clean. A copy made just
        // before the run is dirty until written back (half a minute), and the host's page-out
        // (MADV_PAGEOUT) cannot reclaim dirty file pages: its first runs kept ~1.1 MiB more
        // read-only data resident than later ones (BENCHMARKS.md, thirty-fourth run).
        std::fs::File::open(binary)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("writing {} back to disk", binary.display()))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(binary)
            .args([
                "run",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--node-name",
                HOST_NODE,
                "--cluster-cidr",
                CLUSTER_CIDR,
            ])
            .arg("--kubeconfig")
            .arg(dir.join("kubeconfig"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--token-file")
            .arg(dir.join("token"))
            .args([
                "--dataplane",
                if nftables { "nftables" } else { "record" },
                "--reconcile-seconds",
                &o.reconcile_seconds.to_string(),
            ])
            .arg(format!("--min-sync-period={}ms", o.min_sync_period.as_millis()))
            .args(if o.page_out { &[][..] } else { &["--no-page-out"][..] })
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(HostProc { child, api: format!("http://127.0.0.1:{port}"), http: reqwest::Client::new() })
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Until `/readyz` answers 200: the initial sync is applied.
    async fn ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!("the host exited before it was ready ({status})");
            }
            if self.http.get(format!("{}/readyz", self.api)).send().await.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "the host was not ready within {timeout:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Cluster events the host has received, from `/metrics` (as a Prometheus scrape would
    /// read them: the scrape is part of what the host runs).
    async fn events(&self) -> anyhow::Result<u64> {
        let text = self.http.get(format!("{}/metrics", self.api)).send().await?.error_for_status()?.text().await?;
        let value = text
            .lines()
            .find_map(|l| l.strip_prefix("wasmplane_model_events_total "))
            .context("no wasmplane_model_events_total in /metrics")?;
        Ok(value.trim().parse::<f64>()? as u64)
    }

    /// Waits until the host has received `events` events. False on timeout.
    async fn settle(&self, events: u64, timeout: Duration) -> anyhow::Result<bool> {
        let deadline = Instant::now() + timeout;
        while self.events().await? < events {
            if Instant::now() > deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(true)
    }

    /// SIGTERM, then SIGKILL after 10 s.
    fn stop(mut self) -> anyhow::Result<()> {
        // SAFETY: a signal to our own child, which has not been waited for.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("warning: the host did not stop within 10 s of SIGTERM; killed");
        Ok(())
    }
}

impl Drop for HostProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Proportional and private memory from `/proc/PID/smaps_rollup`, in KiB: what the process
/// holds with shared file pages divided among the processes that map them, and alone.
fn smaps_rollup(pid: &str) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name| kib_field(&text, name);
    (field("Pss:"), field("Private_Clean:") + field("Private_Dirty:"))
}

/// Resident KiB of the process's own binary, by mapping: code (`r-xp`) and read-only data
/// (`r--p`: constants, unwind tables, relocations, and the relocated data made read-only
/// after start, whose pages count as anonymous).
fn binary_resident(pid: &str) -> (u64, u64) {
    let mappings = wasmplane::memory::binary_mappings(pid).unwrap_or_default();
    let read_only = || mappings.iter().filter(|m| !m.writable);
    (
        read_only().filter(|m| m.executable).map(|m| m.resident_kib).sum(),
        read_only().filter(|m| !m.executable).map(|m| m.resident_kib).sum(),
    )
}

/// Resident KiB of the read-only mappings of files in the host's data directory: the compiled
/// guests (code and read-only data, from its cache of compiled components in `compiled/`),
/// and the binary's relocated data once the host has moved it into an unnamed file there
/// (`memory::file_back_relocated_data`; before that it is among the binary's read-only
/// mappings, as anonymous pages).
fn data_dir_resident(pid: &str, data_dir: &Path) -> (u64, u64) {
    // As /proc names the files: links resolved.
    let compiled = data_dir.canonicalize().unwrap_or_else(|_| data_dir.to_path_buf()).join("compiled");
    let mappings = wasmplane::memory::mappings_under(pid, data_dir).unwrap_or_default();
    let read_only = || mappings.iter().filter(|m| !m.writable);
    let guests = read_only().filter(|m| Path::new(&m.file).starts_with(&compiled)).map(|m| m.resident_kib).sum();
    let relocated = read_only()
        .filter(|m| !Path::new(&m.file).starts_with(&compiled) && m.file.ends_with(" (deleted)"))
        .map(|m| m.resident_kib)
        .sum();
    (guests, relocated)
}

async fn measure(o: &Opts, binary: &Binary, nftables: bool) -> anyhow::Result<Value> {
    let (mut cluster, ready) = ClusterProc::start(o)?;
    let (pods, nodes) = (ready[3].parse::<u64>()?, ready[4].parse::<u64>()?);
    let dir = tempfile::tempdir()?;
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: perf\n  cluster:\n    server: {}\nusers:\n- name: perf\n  user: {{}}\ncontexts:\n- name: perf\n  context:\n    cluster: perf\n    user: perf\ncurrent-context: perf\n",
        ready[1]
    );
    std::fs::write(dir.path().join("kubeconfig"), kubeconfig)?;
    std::fs::write(dir.path().join("token"), TOKEN)?;
    let timeout = Duration::from_secs(3600);

    if let Some(warm) = &binary.warm_with {
        let mut host = HostProc::start(warm, dir.path(), nftables, o)?;
        host.ready(timeout).await?;
        host.stop()?;
    }
    let started = Instant::now();
    let mut host = HostProc::start(&binary.path, dir.path(), nftables, o)?;
    host.ready(timeout).await?;
    let sync_seconds = started.elapsed().as_secs_f64();
    let pid = host.pid();
    let hwm_sync = memory_of(&pid).hwm;
    let (cpu_sync, children_cpu_sync) = crate::worker::cpu_of(&pid);
    eprintln!("[{}] {} ready in {sync_seconds:.2} s", o.services, binary.path.display());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let steady = memory_of(&pid);
    let (pss_steady, private_steady) = smaps_rollup(&pid);
    let (code_steady, rodata_steady) = binary_resident(&pid);
    let data_dir = dir.path().join("data");
    let (guests_steady, relocated_steady) = data_dir_resident(&pid, &data_dir);
    // Start-up is over (the sync applied, its code paged out): what is called from here on.
    let counting = match &o.count_calls {
        Some(path) => {
            let candidates = crate::call_count::read_list(path)?;
            let counter = crate::call_count::CallCounter::start(&pid, &candidates)?;
            Some((candidates, counter))
        }
        None => None,
    };

    // The single changes, churn and no-op events of the in-process worker, each step waited
    // for by its event count.
    let mut events = host.events().await?;
    let events_at_sync = events;
    for _ in 0..o.samples {
        // One event each: the new pod, the slice write, the replaced pod's deletion.
        let prepared = cluster.call("prepare")?;
        for command in ["", &format!("change {}", prepared[1]), "finish"] {
            if !command.is_empty() {
                cluster.call(command)?;
            }
            events += 1;
            host.settle(events, timeout).await?;
        }
    }
    // `done <ops> <writes>`: one event per write.
    let churn = cluster.call(&format!("churn {} {}", o.churn_rate, o.churn_seconds))?;
    events += churn[2].parse::<u64>()?;
    let churn_converged = host.settle(events, timeout).await?;
    let noop = cluster.call(&format!("noop {} {}", o.churn_rate, (o.churn_seconds / 3.0).max(1.0)))?;
    events += noop[2].parse::<u64>()?;
    let noop_converged = host.settle(events, timeout).await?;
    let end = memory_of(&pid);
    let (cpu_end, _) = crate::worker::cpu_of(&pid);
    let (pss_end, private_end) = smaps_rollup(&pid);
    let (code_end, rodata_end) = binary_resident(&pid);
    let (guests_end, relocated_end) = data_dir_resident(&pid, &data_dir);
    if let Some(dir) = &o.smaps_dir {
        let to = dir.join(format!("smaps-{}-{}.txt", o.services, std::process::id()));
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::copy(format!("/proc/{pid}/smaps"), &to))
            .with_context(|| format!("copying the host's smaps to {}", to.display()))?;
    }
    // As after the sync: what the host holds once it has been idle a while (its steady state
    // between bursts), not in the middle of applying the last of them.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = memory_of(&pid);

    let mut result = json!({
        "services": o.services, "pods": pods, "nodes": nodes,
        "mode": if nftables { "nftables" } else { "record" },
        "binary": binary.path.display().to_string(),
        "initial_sync_s": sync_seconds, "events": events, "converged": churn_converged && noop_converged,
        "rss_steady_kib": steady.rss, "rss_anon_steady_kib": steady.anon, "rss_file_steady_kib": steady.file,
        "pss_steady_kib": pss_steady, "private_steady_kib": private_steady,
        "binary_code_steady_kib": code_steady, "binary_rodata_steady_kib": rodata_steady,
        "hwm_sync_kib": hwm_sync, "rss_end_kib": end.rss, "hwm_end_kib": end.hwm,
        "rss_anon_end_kib": end.anon, "rss_file_end_kib": end.file,
        "rss_idle_kib": idle.rss, "rss_anon_idle_kib": idle.anon, "rss_file_idle_kib": idle.file,
        "binary_code_end_kib": code_end, "binary_rodata_end_kib": rodata_end,
        "guests_code_steady_kib": guests_steady, "guests_code_end_kib": guests_end,
        "relocated_steady_kib": relocated_steady, "relocated_end_kib": relocated_end,
        "pss_end_kib": pss_end, "private_end_kib": private_end,
        "cpu_sync_s": cpu_sync, "children_cpu_sync_s": children_cpu_sync, "cpu_after_sync_s": cpu_end - cpu_sync, "events_after_sync": events - events_at_sync,
    });
    match (&o.trace_code, counting) {
        (Some(path), Some((candidates, mut counter))) => {
            let called = counter.called(&candidates)?;
            std::fs::write(path, called.iter().map(|f| format!("{f}\n")).collect::<String>())?;
            let (probed, unprobed) = counter.probed();
            result["called_functions"] = called.len().into();
            result["probed_functions"] = probed.into();
            result["unprobed_functions"] = unprobed.into();
        }
        (Some(path), None) => crate::symbol_order::write_trace(&pid, path, &mut result)?,
        (None, _) => {}
    }
    host.stop()?;
    drop(cluster);
    Ok(result)
}

#[cfg(test)]
mod tests {
    /// The parsers read this test process's own /proc files: its binary has code and
    /// read-only data resident, and it holds memory alone.
    #[test]
    fn reads_a_live_process() {
        let (code, rodata) = super::binary_resident("self");
        assert!(code > 0 && rodata > 0, "code {code} KiB, read-only data {rodata} KiB");
        let (pss, private) = super::smaps_rollup("self");
        assert!(pss > 0 && private > 0 && private <= pss + 4, "PSS {pss} KiB, private {private} KiB");
    }
}
