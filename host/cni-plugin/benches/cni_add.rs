//! 100 concurrent CNI ADDs (then DELs), each into a fresh pod namespace: the real
//! `wasmplane-cni` binary through the in-process daemon, beside Debian's reference
//! `bridge` + `host-local` plugins (package containernetworking-plugins) in the same run.
//! Latency is per invocation: process spawn to exit, as a runtime sees it.
//!
//! `cargo bench -p wasmplane-cni-plugin --bench cni_add` (root; `WPCNI_BENCH_N` to change 100).

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Netns, Node, Reply, run_plugin, unique};

const REFERENCE_DIR: &str = "/usr/lib/cni";

struct Row {
    name: &'static str,
    command: &'static str,
    ok: usize,
    distinct_ips: usize,
    latencies: Vec<Duration>,
    wall: Duration,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Runs `f(i)` for every pod at once on its own thread; the replies and the wall time.
fn concurrently(n: usize, f: impl Fn(usize) -> Reply + Sync) -> (Vec<Reply>, Duration) {
    let started = Instant::now();
    let replies = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let f = &f;
                s.spawn(move || f(i))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    (replies, started.elapsed())
}

fn row(name: &'static str, command: &'static str, replies: &[Reply], wall: Duration) -> Row {
    let mut latencies: Vec<Duration> = replies.iter().map(|r| r.elapsed).collect();
    latencies.sort();
    let ips: HashSet<Ipv4Addr> =
        replies.iter().filter(|r| r.ok && command.starts_with("ADD")).map(|r| r.ip()).collect();
    if let Some(bad) = replies.iter().find(|r| !r.ok) {
        eprintln!("{name} {command}: a failure: {} {}", bad.json, bad.stderr);
    }
    Row { name, command, ok: replies.iter().filter(|r| r.ok).count(), distinct_ips: ips.len(), latencies, wall }
}

/// Pods sent one at a time after the concurrent burst: the unloaded latency.
const SEQUENTIAL: usize = 20;

/// Concurrent ADDs then DELs over pods `0..n`, then one at a time over `n..n+SEQUENTIAL`.
fn measure(name: &'static str, n: usize, invoke: impl Fn(&str, usize) -> Reply + Sync) -> Vec<Row> {
    let (adds, add_wall) = concurrently(n, |i| invoke("ADD", i));
    let (dels, del_wall) = concurrently(n, |i| invoke("DEL", i));
    let started = Instant::now();
    let seq_adds: Vec<Reply> = (n..n + SEQUENTIAL).map(|i| invoke("ADD", i)).collect();
    let seq_add_wall = started.elapsed();
    let started = Instant::now();
    let seq_dels: Vec<Reply> = (n..n + SEQUENTIAL).map(|i| invoke("DEL", i)).collect();
    let seq_del_wall = started.elapsed();
    vec![
        row(name, "ADD", &adds, add_wall),
        row(name, "DEL", &dels, del_wall),
        row(name, "ADD 1x", &seq_adds, seq_add_wall),
        row(name, "DEL 1x", &seq_dels, seq_del_wall),
    ]
}

/// Our plugin and daemon on a node with `cidrs` (comma-separated: dual stack).
fn ours(n: usize, name: &'static str, cidrs: &str) -> Vec<Row> {
    let mut node = Node::new(cidrs);
    node.stop();
    // Benchmarks have no watch: every pod is known.
    node.start_with(Arc::new(wasmplane_cni::AnyPod));
    let pods: Vec<Netns> = (0..n + SEQUENTIAL).map(|i| Netns::new(unique(&format!("-b{i}")))).collect();
    measure(name, n, |command, i| node.cni(command, &format!("bench-{i}"), &pods[i].path(), &format!("b{i}")))
}

fn reference(n: usize) -> Vec<Row> {
    let node = Netns::new(unique("-refnode"));
    node.exec(&["ip", "link", "set", "lo", "up"]);
    let pods: Vec<Netns> = (0..n + SEQUENTIAL).map(|i| Netns::new(unique(&format!("-rb{i}")))).collect();
    let dir = tempfile::tempdir().unwrap();
    let config: Value = json!({
        "cniVersion": "1.0.0",
        "name": "wpref",
        "type": "bridge",
        "bridge": "wpref0",
        "isGateway": true,
        "ipMasq": false,
        "ipam": {"type": "host-local", "subnet": "10.244.21.0/24", "dataDir": dir.path().join("host-local")},
    });
    let bridge = format!("{REFERENCE_DIR}/bridge");
    let node_path = node.path();
    measure("bridge + host-local (ref)", n, |command, i| {
        let (ctr, netns) = (format!("ref-{i}"), pods[i].path());
        let env = [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", &ctr),
            ("CNI_NETNS", &netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", REFERENCE_DIR),
        ];
        // The plugin runs in the node namespace, as a runtime on that node would run it.
        run_plugin(&bridge, &env, &config, Some(&node_path))
    })
}

fn main() {
    if !support::is_root() {
        eprintln!("SKIPPED cni_add benchmark: needs root for network namespaces");
        return;
    }
    if !Path::new(REFERENCE_DIR).join("bridge").exists() || !Path::new(REFERENCE_DIR).join("host-local").exists() {
        eprintln!(
            "SKIPPED cni_add benchmark: reference plugins missing in {REFERENCE_DIR} (apt-get install containernetworking-plugins)"
        );
        return;
    }
    let n: usize = std::env::var("WPCNI_BENCH_N").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    println!(
        "{n} concurrent CNI invocations, then {SEQUENTIAL} one at a time (\"1x\"); each pod in a fresh network namespace; latency = plugin spawn to exit\n"
    );
    let mut rows = ours(n, "wasmplane-cni + daemon", "10.244.20.0/24");
    rows.extend(ours(n, "wasmplane-cni, dual stack", "10.244.22.0/24,fd00:10:244:22::/64"));
    rows.extend(reference(n));
    println!(
        "{:<28} {:<6} {:>7} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "plugin", "cmd", "ok", "IPs", "p50", "p99", "max", "wall"
    );
    for r in &rows {
        let ips = if r.command.starts_with("ADD") { r.distinct_ips.to_string() } else { "-".into() };
        println!(
            "{:<28} {:<6} {:>7} {:>6} {:>10} {:>10} {:>10} {:>10}",
            r.name,
            r.command,
            format!("{}/{}", r.ok, r.latencies.len()),
            ips,
            ms(percentile(&r.latencies, 50.0)),
            ms(percentile(&r.latencies, 99.0)),
            ms(*r.latencies.last().unwrap_or(&Duration::ZERO)),
            ms(r.wall)
        );
    }
}
