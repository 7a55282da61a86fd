//! The cluster side, in its own process (so its memory and CPU are not the host's): the test
//! API server seeded with the synthetic cluster, driven by line commands on stdin.
//!
//! Protocol (one line each way):
//! - out, once seeded: `ready <url> <objects> <pods> <nodes> <seed-seconds>`
//! - `prepare` → `ok <service-index> <namespace> <name> <new-ip>`: a new pod for one random
//!   service (written); the next `change` puts it in the slice
//! - `change <service-index>` → `ok`: the EndpointSlice write (new endpoint in, oldest out)
//! - `finish` → `ok`: the replaced endpoint's pod deleted
//! - `cni-pod` → `ok <namespace> <name>`: a pod on the host's node without an address yet
//!   (written), for a CNI ADD; `cni-pod-gone <namespace> <name>` → `ok`: deleted
//! - `churn <ops-per-second> <seconds>` → `done <ops> <writes>`
//! - `noop <ops-per-second> <seconds>` → `done <ops> <writes>`: pod label changes only
//! - `quit`

use std::io::{BufRead as _, Write as _};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use wasmplane_test_apiserver::{ResourceKey, TestApiServer};

use crate::cluster::{Cluster, Kind, PodGone, Spec, Write};

fn key(kind: Kind) -> ResourceKey {
    let (group, version, plural) = kind.api();
    ResourceKey::new(group, version, plural)
}

fn apply(server: &TestApiServer, writes: Vec<Write>) -> anyhow::Result<usize> {
    let n = writes.len();
    for w in writes {
        match w {
            Write::Put(kind, mut value) => {
                if matches!(kind, Kind::EndpointSlice) {
                    // As the EndpointSlice controller writes a slice: triggered now, where the
                    // host's network programming SLI starts. Stamped here, at the write: the
                    // generated cluster and churn stay the same for a seed.
                    value["metadata"]["annotations"]["endpoints.kubernetes.io/last-change-trigger-time"] =
                        serde_json::json!(k8s_openapi::jiff::Timestamp::now().to_string());
                }
                server.apply_value(&key(kind), value).map_err(|e| anyhow::anyhow!("writing a {kind:?}: {e}"))?;
            }
            Write::Delete(kind, ns, name) => {
                server
                    .delete_value(&key(kind), &ns, &name)
                    .map_err(|e| anyhow::anyhow!("deleting {kind:?} {ns}/{name}: {e}"))?;
            }
        }
    }
    Ok(n)
}

pub fn serve(spec: Spec) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    // Room for the whole seeded cluster in the event history (no compaction during a run).
    let server = runtime.block_on(TestApiServer::builder().history_limit(2_000_000).start());
    let started = Instant::now();
    let mut cluster = Cluster::new(spec);
    let objects = cluster.objects();
    let count = objects.len();
    for (kind, value) in objects {
        server.create_value(&key(kind), value).map_err(|e| anyhow::anyhow!("seeding a {kind:?}: {e}"))?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "ready {} {count} {} {} {:.2}",
        server.url(),
        cluster.pods(),
        cluster.nodes(),
        started.elapsed().as_secs_f64()
    )?;
    out.flush()?;
    let mut pending: Option<usize> = None;
    let mut gone: Option<PodGone> = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading a command")?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["prepare"] => {
                let i = cluster.pick();
                let (writes, ip) = cluster.replace_start(i);
                apply(&server, writes)?;
                let (ns, name) = cluster.service_key(i);
                pending = Some(i);
                writeln!(out, "ok {i} {ns} {name} {ip}")?;
            }
            ["change", i] => {
                let i: usize = i.parse()?;
                anyhow::ensure!(pending == Some(i), "change without prepare");
                let (writes, g) = cluster.replace_slice(i);
                apply(&server, writes)?;
                gone = Some(g);
                writeln!(out, "ok")?;
            }
            ["finish"] => {
                if let Some(g) = gone.take() {
                    apply(&server, cluster.replace_finish(g))?;
                }
                pending = None;
                writeln!(out, "ok")?;
            }
            ["cni-pod"] => {
                let (write, ns, name) = cluster.cni_pod();
                apply(&server, vec![write])?;
                writeln!(out, "ok {ns} {name}")?;
            }
            ["cni-pod-gone", ns, name] => {
                apply(&server, vec![Cluster::cni_pod_gone(ns, name)])?;
                writeln!(out, "ok")?;
            }
            [verb @ ("churn" | "noop"), rate, seconds] => {
                let (rate, seconds): (f64, f64) = (rate.parse()?, seconds.parse()?);
                let interval = Duration::from_secs_f64(1.0 / rate);
                let start = Instant::now();
                let (mut ops, mut writes) = (0u64, 0usize);
                while start.elapsed().as_secs_f64() < seconds {
                    let op = if *verb == "churn" {
                        cluster.churn_op()
                    } else {
                        let i = cluster.pick();
                        cluster.label_change(i)
                    };
                    writes += apply(&server, op)?;
                    ops += 1;
                    // Paced against the start, so slow writes do not lower the rate.
                    let next = interval * ops as u32;
                    if let Some(wait) = next.checked_sub(start.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
                writeln!(out, "done {ops} {writes}")?;
            }
            ["quit"] | [] => break,
            other => anyhow::bail!("unknown command {other:?}"),
        }
        out.flush()?;
    }
    drop(server);
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}
