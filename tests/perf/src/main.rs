//! End-to-end performance harness (issue 10): a synthetic cluster in the test Kubernetes API
//! server, the whole host against it (kube's real client; nftables in a network namespace
//! this harness creates and deletes), and one table of numbers. See BENCHMARKS.md.
//!
//! ```sh
//! CARGO_TARGET_DIR=/work/target-perf cargo run -p wasmplane-perf --release -- --quick
//! cargo run -p wasmplane-perf --release -- --sizes 1000,10000,50000
//! cargo run -p wasmplane-perf --release -- --write-manifests DIR --services 1000   # embedded mode input
//! ```
//!
//! Every size runs in a fresh worker process (this binary again, `--worker`), so peak RSS is
//! that size's alone; the cluster (test API server, generator, churn) runs in a third
//! process, so the host's RSS and CPU are the host's.

#![recursion_limit = "256"]

mod apiserver;
mod binary;
mod call_count;
mod cluster;
mod detail;
mod symbol_order;
mod worker;

use std::process::{Command, Stdio};

use anyhow::Context as _;
use serde_json::Value;

const USAGE: &str = "\
usage: wasmplane-perf [--sizes 1000,10000,50000] [--quick] [--endpoints 1.5] [--policies 0] [--minimal-objects]
                      [--seed 1] [--samples N] [--churn-rate OPS_PER_S] [--churn-seconds S]
                      [--record] [--no-page-out] [--reconcile-seconds 3600 (with --binary: 10)] [--min-sync-ms 0] [--json FILE] [--smaps-dir DIR]
       wasmplane-perf --binary target/x86_64-unknown-linux-gnu/release/wasmplane [--repeat N] [--sizes ...] [...]   (the shipped binary's memory)
       wasmplane-perf --symbol-order FILE [--sizes 1000] [--binary PATH] [...]   (functions the host ran, for lld)
       wasmplane-perf --write-manifests DIR [--services N] [--endpoints M] [--policies P] [--seed S]";

struct Args {
    sizes: Vec<usize>,
    quick: bool,
    endpoints: f64,
    policies: usize,
    full_objects: bool,
    seed: u64,
    samples: Option<usize>,
    churn_rate: f64,
    churn_seconds: Option<f64>,
    record: bool,
    json: Option<String>,
    services: usize,
    write_manifests: Option<String>,
    worker: Option<usize>,
    apiserver: Option<usize>,
    symbol_order: Option<String>,
    trace_code: Option<String>,
    count_calls: Option<String>,
    children_exe: Option<String>,
    binary: Option<String>,
    warm_binary: Option<String>,
    /// Rounds over all sizes (`--binary` only): memory differs from run to run by more than
    /// the changes it measures (BENCHMARKS.md, nineteenth run).
    repeat: usize,
    page_out: bool,
    reconcile_seconds: u64,
    /// The host's `--min-sync-period`, in milliseconds (0: off, the host's default).
    min_sync_ms: u64,
    /// With `--binary`: copy the host's `/proc/PID/smaps` here at the end of each run.
    smaps_dir: Option<String>,
}

fn parse() -> anyhow::Result<Args> {
    let mut a = Args {
        sizes: vec![1000, 10_000, 50_000],
        quick: false,
        endpoints: 1.5,
        policies: 0,
        full_objects: true,
        seed: 1,
        samples: None,
        churn_rate: 50.0,
        churn_seconds: None,
        record: false,
        json: None,
        services: 1000,
        write_manifests: None,
        worker: None,
        apiserver: None,
        symbol_order: None,
        trace_code: None,
        count_calls: None,
        children_exe: None,
        binary: None,
        warm_binary: None,
        repeat: 1,
        page_out: true,
        reconcile_seconds: 3600,
        min_sync_ms: 0,
        smaps_dir: None,
    };
    let mut sizes_given = false;
    let mut reconcile_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--sizes" => {
                a.sizes = value()?.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>()?;
                sizes_given = true;
            }
            "--quick" => a.quick = true,
            "--endpoints" => a.endpoints = value()?.parse()?,
            "--policies" => a.policies = value()?.parse()?,
            "--minimal-objects" => a.full_objects = false,
            "--seed" => a.seed = value()?.parse()?,
            "--samples" => a.samples = Some(value()?.parse()?),
            "--churn-rate" => a.churn_rate = value()?.parse()?,
            "--churn-seconds" => a.churn_seconds = Some(value()?.parse()?),
            "--record" => a.record = true,
            "--no-page-out" => a.page_out = false,
            "--reconcile-seconds" => {
                a.reconcile_seconds = value()?.parse()?;
                reconcile_given = true;
            }
            "--min-sync-ms" => a.min_sync_ms = value()?.parse()?,
            "--smaps-dir" => a.smaps_dir = Some(value()?),
            "--json" => a.json = Some(value()?),
            "--services" => a.services = value()?.parse()?,
            "--write-manifests" => a.write_manifests = Some(value()?),
            "--worker" => a.worker = Some(value()?.parse()?),
            "--apiserver" => a.apiserver = Some(value()?.parse()?),
            "--symbol-order" => a.symbol_order = Some(value()?),
            "--trace-code" => a.trace_code = Some(value()?),
            "--count-calls" => a.count_calls = Some(value()?),
            "--children-exe" => a.children_exe = Some(value()?),
            "--binary" => a.binary = Some(value()?),
            "--warm-binary" => a.warm_binary = Some(value()?),
            "--repeat" => a.repeat = value()?.parse::<usize>()?.max(1),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => anyhow::bail!("unknown argument {other}\n{USAGE}"),
        }
    }
    if a.quick && !sizes_given {
        a.sizes = vec![1000, 10_000];
    }
    anyhow::ensure!(a.repeat == 1 || a.binary.is_some(), "--repeat is for --binary runs\n{USAGE}");
    // The in-process table measures single changes, which a full reconcile would hold up;
    // the shipped binary's memory is measured as it runs in a cluster, with reconciles.
    if a.binary.is_some() && !reconcile_given && a.worker.is_none() {
        a.reconcile_seconds = BINARY_RECONCILE_SECONDS;
    }
    Ok(a)
}

/// Single-change samples per size: each costs one incremental `nft -f`, which at 50k is
/// seconds (nft's cache fill), so fewer there.
fn samples(a: &Args) -> usize {
    // A change costs a few milliseconds at every size now (it was half a second at 50k when
    // fewer samples were taken there): the same count everywhere.
    a.samples.unwrap_or(if a.quick { 20 } else { 50 })
}

fn churn_seconds(a: &Args) -> f64 {
    a.churn_seconds.unwrap_or(if a.quick { 10.0 } else { 30.0 })
}

fn main() -> anyhow::Result<std::process::ExitCode> {
    // The worker compiles guests in a child process of this binary, as `wasmplane` does.
    if let Some(exit) = wasmplane_runtime::compiler::serve_if_compiler_process() {
        return Ok(exit);
    }
    run()?;
    Ok(std::process::ExitCode::SUCCESS)
}

fn run() -> anyhow::Result<()> {
    let a = parse()?;
    let spec = |services| cluster::Spec {
        services,
        endpoints: a.endpoints,
        policies: a.policies,
        seed: a.seed,
        full_objects: a.full_objects,
    };
    if let Some(services) = a.apiserver {
        return apiserver::serve(spec(services));
    }
    if let Some(dir) = &a.write_manifests {
        let c = cluster::Cluster::new(spec(a.services));
        let n = cluster::write_manifests(&c, std::path::Path::new(dir))?;
        println!(
            "{n} objects ({} services, {} pods, {} nodes) written to {dir}; run the host as node {}",
            c.services(),
            c.pods(),
            c.nodes(),
            cluster::HOST_NODE
        );
        return Ok(());
    }
    if let Some(services) = a.worker {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("WASMPLANE_PERF_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .with_writer(std::io::stderr)
            .init();
        let opts = worker::Opts {
            services,
            endpoints: a.endpoints,
            policies: a.policies,
            full_objects: a.full_objects,
            seed: a.seed,
            samples: samples(&a),
            churn_rate: a.churn_rate,
            churn_seconds: churn_seconds(&a),
            record: a.record,
            trace_code: a.trace_code.as_ref().map(Into::into),
            count_calls: a.count_calls.as_ref().map(Into::into),
            children_exe: a.children_exe.as_ref().map(Into::into),
            page_out: a.page_out,
            reconcile_seconds: a.reconcile_seconds,
            min_sync_period: std::time::Duration::from_millis(a.min_sync_ms),
            smaps_dir: a.smaps_dir.as_ref().map(Into::into),
        };
        let result = match &a.binary {
            Some(path) => binary::run_size(
                opts,
                binary::Binary { path: path.into(), warm_with: a.warm_binary.as_ref().map(Into::into) },
            )?,
            None => worker::run_size(opts)?,
        };
        println!("RESULT {result}");
        return Ok(());
    }

    if !a.record && !worker::is_root() {
        eprintln!(
            "not root: no network namespace can be made; the dataplane runs in Record mode (nothing reaches a kernel)"
        );
    }
    if let Some(path) = &a.symbol_order {
        return symbol_order(&a, path);
    }
    // The order file matters only to the shipped binary's memory, which `--binary` measures.
    // (A wrapper script, say, has no compiler to read: then the check is skipped, said so.)
    let stale_order = a.binary.as_ref().and_then(|binary| {
        symbol_order::stale_order(std::path::Path::new(binary), std::path::Path::new(symbol_order::CHECKOUT_ORDER_FILE))
            .unwrap_or_else(|e| {
                Some(format!("could not check {binary} against {}: {e:#}", symbol_order::CHECKOUT_ORDER_FILE))
            })
    });
    if let Some(warning) = &stale_order {
        eprintln!("WARNING: {warning}");
    }
    let mut results = Vec::new();
    for (round, &services) in (0..a.repeat).flat_map(|round| a.sizes.iter().map(move |size| (round, size))) {
        eprintln!(
            "== {services} services{} ==",
            if a.repeat > 1 { format!(", round {} of {}", round + 1, a.repeat) } else { String::new() }
        );
        let mut cmd = worker_command(&a, services, &std::env::current_exe()?);
        if let Some(binary) = &a.binary {
            cmd.args(["--binary", binary]);
        }
        let out = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).output().context("running a worker")?;
        match worker_result(&out.stdout)? {
            Some(r) => results.push(r),
            None => eprintln!("size {services} failed ({})", out.status),
        }
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
    }
    println!("{}", if a.binary.is_some() { binary_table(&results) } else { table(&results) });
    if a.repeat > 1 {
        println!("\n{}", binary_spread_table(&a.sizes, &results));
    }
    if let Some(warning) = &stale_order {
        println!("\nWARNING: {warning}");
    }
    Ok(())
}

/// One worker run of `exe` at one size.
fn worker_command(a: &Args, services: usize, exe: &std::path::Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args([
        "--worker",
        &services.to_string(),
        "--endpoints",
        &a.endpoints.to_string(),
        "--policies",
        &a.policies.to_string(),
        "--seed",
        &a.seed.to_string(),
    ]);
    cmd.args([
        "--samples",
        &samples(a).to_string(),
        "--churn-rate",
        &a.churn_rate.to_string(),
        "--churn-seconds",
        &churn_seconds(a).to_string(),
    ]);
    if a.record {
        cmd.arg("--record");
    }
    if !a.full_objects {
        cmd.arg("--minimal-objects");
    }
    if !a.page_out {
        cmd.arg("--no-page-out");
    }
    cmd.args(["--reconcile-seconds", &a.reconcile_seconds.to_string()]);
    cmd.args(["--min-sync-ms", &a.min_sync_ms.to_string()]);
    if let Some(dir) = &a.smaps_dir {
        cmd.args(["--smaps-dir", dir]);
    }
    cmd
}

fn worker_result(stdout: &[u8]) -> anyhow::Result<Option<Value>> {
    let text = String::from_utf8_lossy(stdout);
    Ok(text.lines().find_map(|l| l.strip_prefix("RESULT ")).map(serde_json::from_str).transpose()?)
}

/// Full reconciles while the host is traced for the order file: several during the traced
/// run, as the host's default of 60 s makes them over hours.
const TRACED_RECONCILE_SECONDS: u64 = 5;

/// Full reconciles while `--binary` measures the shipped binary: two or three in a run, so
/// that its memory is what a host in a cluster holds (their code faults back in), without
/// making them a large part of its CPU row.
const BINARY_RECONCILE_SECONDS: u64 = 10;

/// `--symbol-order FILE`: traced workers at the first size, run from a private copy of the
/// host's binary (see `symbol_order`), write the functions the host ran to FILE. The host is
/// this harness's in-process worker, or with `--binary` that binary run as a child. Two runs:
/// one keeps all the code it ran resident, the other pages it out after the initial sync as
/// the host does, so that only what it ran afterwards is resident at the end. With `--binary`
/// a third run counts the calls into the functions on those pages once the host is past its
/// start-up (`call_count`): a page also holds start-up code, and laid out together they
/// would share pages again in every later trace. That code goes first in FILE, then the
/// start-up code: what faults back in after the page-out is then code the host runs again.
fn symbol_order(a: &Args, path: &str) -> anyhow::Result<()> {
    let services = a.sizes[0];
    anyhow::ensure!(worker::is_root(), "--symbol-order needs root (a loop device, a network namespace)");
    anyhow::ensure!(a.page_out, "--symbol-order traces with the page-out and without it by itself: drop --no-page-out");
    if a.binary.is_some() {
        call_count::mount_tracefs()?;
    }
    let this = std::env::current_exe()?;
    let original = a.binary.as_ref().map_or_else(|| this.clone(), Into::into);
    let size = std::fs::metadata(&original)?.len();
    let volume = symbol_order::PrivateVolume::new(2 * size + (64 << 20))?;
    let copy = volume.path().join("traced");
    std::fs::copy(&original, &copy).with_context(|| format!("copying {}", original.display()))?;
    // Written pages stay dirty in the page cache until written back, and only clean ones
    // can be dropped.
    std::fs::File::open(&copy)?.sync_all()?;
    let traces = tempfile::tempdir()?;
    let mut lists = Vec::new();
    // The third run counts the calls into the first one's functions (`--binary` only).
    let counted = a.binary.is_some();
    for (name, page_out, count) in [
        ("after the initial sync", true, false),
        ("in all", false, false),
        ("after the initial sync, by calls", true, true),
    ]
    .into_iter()
    .filter(|r| !r.2 || counted)
    {
        symbol_order::drop_cached_pages(&copy)?;
        let mut cmd = if a.binary.is_some() {
            let mut cmd = worker_command(a, services, &this);
            cmd.arg("--binary").arg(&copy).arg("--warm-binary").arg(&original);
            cmd
        } else {
            let mut cmd = worker_command(a, services, &copy);
            cmd.arg("--children-exe").arg(&original);
            cmd
        };
        let trace = traces.path().join(format!("{}", lists.len()));
        cmd.arg("--trace-code").arg(&trace);
        // Full reconciles run all along in a cluster (the host's default is every 60 s): their
        // code is steady code, and traced without them it would sit among the start-up code
        // and fault back in at the first one (nineteenth run: 1.2 MiB). The later flag wins.
        cmd.args(["--reconcile-seconds", &TRACED_RECONCILE_SECONDS.to_string()]);
        if count {
            cmd.arg("--count-calls").arg(traces.path().join("0"));
        }
        if !page_out {
            cmd.arg("--no-page-out");
        }
        eprintln!("== {services} services, traced: the code run {name} ==");
        let out = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).output().context("running the traced worker")?;
        let result =
            worker_result(&out.stdout)?.with_context(|| format!("the traced worker failed ({})", out.status))?;
        if count {
            println!(
                "code run {name}: {} of {} functions called ({} could not be probed, kept)",
                result["called_functions"], result["probed_functions"], result["unprobed_functions"]
            );
        } else {
            println!(
                "code run {name}: {} functions on {} MiB of touched code pages; host RSS steady {} MiB",
                result["traced_functions"],
                mib(&result, "traced_code_kib"),
                mib(&result, "rss_steady_kib")
            );
        }
        lists.push(std::fs::read_to_string(&trace)?);
    }
    // With calls counted, the code run after the sync is what the host called, not every
    // function on the pages it touched: start-up code on those pages goes with the rest.
    let after_sync = lists.get(2).unwrap_or(&lists[0]);
    let names = symbol_order::steady_first(after_sync, &lists[1]);
    std::fs::write(path, symbol_order::provenance(&original)? + &names)?;
    println!("{path}: {} functions", names.lines().count());
    Ok(())
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

fn mib(v: &Value, key: &str) -> String {
    format!("{:.1}", f(v, key) / 1024.0)
}

type Row = (&'static str, Box<dyn Fn(&Value) -> String>);

/// The in-process worker's results: rows are measurements, columns sizes (Markdown).
fn table(results: &[Value]) -> String {
    let rows: Vec<Row> = vec![
        (
            "cluster: services / pods (endpoints) / nodes",
            Box::new(|v| format!("{} / {} / {}", v["services"], v["pods"], v["nodes"])),
        ),
        (
            "dataplane (statements of the applied ruleset, as one `nft -f` document)",
            Box::new(|v| format!("{} ({})", v["mode"].as_str().unwrap_or("?"), v["ruleset_lines"])),
        ),
        (
            "initial sync: `start()` → every kind listed, one full transaction in the kernel (s)",
            Box::new(|v| format!("{:.2}", f(v, "initial_sync_s"))),
        ),
        (
            "  host CPU / child processes' CPU (nft, the guest compiler) during it (s)",
            Box::new(|v| format!("{:.2} / {:.2}", f(v, "initial_sync_cpu_s"), f(v, "initial_sync_nft_cpu_s"))),
        ),
        (
            "  Wasm guest time: total (s), share of the sync",
            Box::new(|v| {
                format!(
                    "{:.3}, {:.1}%",
                    f(v, "initial_sync_guest_s"),
                    100.0 * f(v, "initial_sync_guest_s") / f(v, "initial_sync_s")
                )
            }),
        ),
        (
            "  full load of that ruleset into an empty namespace: our writer (list, render, one transaction: how it went) / one plain `nft -f` of the same document (s)",
            Box::new(|v| {
                if v["load_writer_s"].is_null() {
                    "— (record mode)".into()
                } else {
                    format!(
                        "{:.2} ({}) / {:.2} = {:.2}×",
                        f(v, "load_writer_s"),
                        v["load_writer_path"].as_str().unwrap_or("?"),
                        f(v, "load_nft_f_s"),
                        f(v, "load_writer_s") / f(v, "load_nft_f_s")
                    )
                }
            }),
        ),
        (
            "default translator per call, Wasm / the same Rust native, both from the model, over this node's services (µs, best of 3 passes)",
            Box::new(|v| {
                format!(
                    "{:.2} / {:.2} = {:.2}×",
                    f(v, "translator_wasm_us"),
                    f(v, "translator_native_us"),
                    f(v, "translator_wasm_us") / f(v, "translator_native_us")
                )
            }),
        ),
        (
            "one endpoint change, slice write → applied in the kernel: p50 / p99 (ms)",
            Box::new(|v| format!("{:.1} / {:.1}", f(v, "change_p50_ms"), f(v, "change_p99_ms"))),
        ),
        ("  samples (p99 of n<100 is the max)", Box::new(|v| format!("{}", v["change_samples"]))),
        (
            "  p50 by stage: API server write / host apply (model, guests, dataplane) / dataplane transaction / guest calls (ms)",
            Box::new(|v| {
                format!(
                    "{:.2} / {:.2} / {:.2} / {:.3}",
                    f(v, "change_write_p50_ms"),
                    f(v, "change_apply_p50_ms"),
                    f(v, "change_dataplane_p50_ms"),
                    f(v, "change_guest_p50_ms")
                )
            }),
        ),
        (
            "  the host's own SLI metric for the same changes (wasmplane_network_programming_duration_seconds, from the slice's trigger time): p50 (ms); changes observed",
            Box::new(|v| {
                if v["change_sli_samples"].is_null() {
                    "—".into()
                } else {
                    format!("{:.2}; {}", f(v, "change_sli_p50_ms"), v["change_sli_samples"])
                }
            }),
        ),
        ("  Wasm guest share of that latency", Box::new(|v| format!("{:.2}%", 100.0 * f(v, "change_guest_share")))),
        (
            "CNI ADD of a pod on this node through the host's daemon (the plugin's request → reply: veth, address, routes): p50 / p99 (ms)",
            Box::new(|v| {
                if v["cni_samples"].is_null() {
                    "— (record mode)".into()
                } else {
                    format!("{:.1} / {:.1}", f(v, "cni_add_p50_ms"), f(v, "cni_add_p99_ms"))
                }
            }),
        ),
        (
            "  ADD → the pod's ingress policy in the kernel, its address from the daemon (no API server write): p50 / p99 (ms); DEL p50 (ms); pods",
            Box::new(|v| {
                if v["cni_samples"].is_null() {
                    "—".into()
                } else if v["cni_policy_p50_ms"].is_null() {
                    format!("— (no policies); {:.1}; {}", f(v, "cni_del_p50_ms"), v["cni_samples"])
                } else {
                    format!(
                        "{:.1} / {:.1}; {:.1}; {}",
                        f(v, "cni_policy_p50_ms"),
                        f(v, "cni_policy_p99_ms"),
                        f(v, "cni_del_p50_ms"),
                        v["cni_samples"]
                    )
                }
            }),
        ),
        (
            "churn: ops (rate × s) / watch events",
            Box::new(|v| {
                format!(
                    "{} ({}/s × {}s) / {}",
                    v["churn_ops"], v["churn_rate_ops"], v["churn_seconds"], v["churn_events"]
                )
            }),
        ),
        (
            "  model revisions / events",
            Box::new(|v| {
                format!(
                    "{} / {} = {:.1}%",
                    v["churn_revisions"],
                    v["churn_events"],
                    100.0 * f(v, "churn_revisions") / f(v, "churn_events")
                )
            }),
        ),
        (
            "  nft transactions; drained after churn end (s)",
            Box::new(|v| {
                format!(
                    "{}; {:.2}{}",
                    v["churn_syncs"],
                    f(v, "churn_drain_s"),
                    if v["churn_converged"] == true { "" } else { " (not converged)" }
                )
            }),
        ),
        (
            "  CPU s per 1,000 events: host process / nft processes",
            Box::new(|v| format!("{:.3} / {:.3}", f(v, "cpu_per_1k_events_s"), f(v, "nft_cpu_per_1k_events_s"))),
        ),
        (
            "no-op events (pod label changes nothing selects, same rate): revisions / events; transactions",
            Box::new(|v| {
                format!(
                    "{} / {} = {:.1}%; {}",
                    v["noop_revisions"],
                    v["noop_events"],
                    100.0 * f(v, "noop_revisions") / f(v, "noop_events"),
                    v["noop_syncs"]
                )
            }),
        ),
        (
            "host RSS: steady after sync / end (MiB)",
            Box::new(|v| format!("{} / {}", mib(v, "rss_steady_kib"), mib(v, "rss_end_kib"))),
        ),
        ("  of the steady RSS: heap in use (glibc `mallinfo2`, MiB)", Box::new(|v| mib(v, "heap_in_use_steady_kib"))),
        (
            "  of the steady RSS: anonymous / file-backed (code, read-only data) (MiB)",
            Box::new(|v| format!("{} / {}", mib(v, "rss_anon_steady_kib"), mib(v, "rss_file_steady_kib"))),
        ),
        (
            "host peak RSS (VmHWM): after sync / end (MiB)",
            Box::new(|v| format!("{} / {}", mib(v, "hwm_sync_kib"), mib(v, "hwm_end_kib"))),
        ),
    ];
    render(&rows, results)
}

/// `--binary`'s results: the shipped binary's memory, read from outside.
fn binary_table(results: &[Value]) -> String {
    let rows: Vec<Row> = vec![
        (
            "cluster: services / pods (endpoints) / nodes",
            Box::new(|v| format!("{} / {} / {}", v["services"], v["pods"], v["nodes"])),
        ),
        ("dataplane", Box::new(|v| v["mode"].as_str().unwrap_or("?").to_string())),
        ("start → ready (initial sync applied) (s)", Box::new(|v| format!("{:.2}", f(v, "initial_sync_s")))),
        (
            "host CPU (s): until ready (its children: nft, the guest compiler) / after, per 1,000 events",
            Box::new(|v| {
                format!(
                    "{:.2} ({:.2}) / {:.3}",
                    f(v, "cpu_sync_s"),
                    f(v, "children_cpu_sync_s"),
                    f(v, "cpu_after_sync_s") / f(v, "events_after_sync") * 1000.0
                )
            }),
        ),
        (
            "RSS 3 s after the sync / at the end of the run / 3 s after that (MiB)",
            Box::new(|v| {
                format!("{} / {} / {}", mib(v, "rss_steady_kib"), mib(v, "rss_end_kib"), mib(v, "rss_idle_kib"))
            }),
        ),
        (
            "  anonymous / file-backed: after the sync; end; 3 s after (MiB)",
            Box::new(|v| {
                format!(
                    "{} / {}; {} / {}; {} / {}",
                    mib(v, "rss_anon_steady_kib"),
                    mib(v, "rss_file_steady_kib"),
                    mib(v, "rss_anon_end_kib"),
                    mib(v, "rss_file_end_kib"),
                    mib(v, "rss_anon_idle_kib"),
                    mib(v, "rss_file_idle_kib")
                )
            }),
        ),
        (
            "  the binary's resident code / read-only data / relocated data (in a file of its own after the sync; anonymous in the read-only mappings before): steady; end (MiB)",
            Box::new(|v| {
                format!(
                    "{} / {} / {}; {} / {} / {}",
                    mib(v, "binary_code_steady_kib"),
                    mib(v, "binary_rodata_steady_kib"),
                    mib(v, "relocated_steady_kib"),
                    mib(v, "binary_code_end_kib"),
                    mib(v, "binary_rodata_end_kib"),
                    mib(v, "relocated_end_kib")
                )
            }),
        ),
        (
            "  the compiled guests' resident code and read-only data: steady; end (MiB)",
            Box::new(|v| format!("{}; {}", mib(v, "guests_code_steady_kib"), mib(v, "guests_code_end_kib"))),
        ),
        (
            "PSS (shared pages divided) / private: steady (MiB)",
            Box::new(|v| format!("{} / {}", mib(v, "pss_steady_kib"), mib(v, "private_steady_kib"))),
        ),
        (
            "peak RSS (VmHWM): after sync / end (MiB)",
            Box::new(|v| format!("{} / {}", mib(v, "hwm_sync_kib"), mib(v, "hwm_end_kib"))),
        ),
        (
            "events received in all (initial sync, changes, churn, no-op); all taken in",
            Box::new(|v| format!("{}, {}", v["events"], if v["converged"] == true { "yes" } else { "no" })),
        ),
    ];
    render(&rows, results)
}

/// A row of numbers: its name and how to read it from one run's result.
type NumberRow = (&'static str, Box<dyn Fn(&Value) -> f64>);

/// `--binary --repeat N`: the memory and CPU rows over the rounds, per size, as median
/// (min–max).
fn binary_spread_table(sizes: &[usize], results: &[Value]) -> String {
    let kib = |key: &'static str| move |v: &Value| f(v, key) / 1024.0;
    let rows: Vec<NumberRow> = vec![
        ("RSS at the end of the run (MiB)", Box::new(kib("rss_end_kib"))),
        ("RSS 3 s after the sync (MiB)", Box::new(kib("rss_steady_kib"))),
        ("  anonymous / file-backed at the end (MiB): anonymous", Box::new(kib("rss_anon_end_kib"))),
        ("  anonymous / file-backed at the end (MiB): file-backed", Box::new(kib("rss_file_end_kib"))),
        ("peak RSS (MiB)", Box::new(kib("hwm_end_kib"))),
        (
            "host CPU per 1,000 events after the sync (s)",
            Box::new(|v| f(v, "cpu_after_sync_s") / f(v, "events_after_sync") * 1000.0),
        ),
    ];
    let mut out = String::from("| median (min–max) over the rounds |");
    for services in sizes {
        out += &format!(" {services} services |");
    }
    out += &format!("\n|---|{}\n", "---|".repeat(sizes.len()));
    for (name, value) in &rows {
        out += &format!("| {name} |");
        for &services in sizes {
            let mut values: Vec<f64> =
                results.iter().filter(|v| v["services"].as_u64() == Some(services as u64)).map(value).collect();
            out += &match spread(&mut values) {
                Some((median, min, max)) => format!(" {median:.2} ({min:.2}–{max:.2}), n={} |", values.len()),
                None => " – |".to_string(),
            };
        }
        out += "\n";
    }
    out
}

/// Median, minimum and maximum (`None` for no values).
fn spread(values: &mut [f64]) -> Option<(f64, f64, f64)> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = match n {
        0 => return None,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    };
    Some((median, values[0], values[n - 1]))
}

fn render(rows: &[Row], results: &[Value]) -> String {
    let mut out = String::from("| measurement |");
    for v in results {
        out += &format!(" {} services |", v["services"]);
    }
    out += "\n|---|";
    out += &"---|".repeat(results.len());
    out += "\n";
    for (name, cell) in rows {
        out += &format!("| {name} |");
        for v in results {
            out += &format!(" {} |", cell(v));
        }
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn spread_is_median_min_max() {
        assert_eq!(super::spread(&mut []), None);
        assert_eq!(super::spread(&mut [3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
        assert_eq!(super::spread(&mut [4.0, 1.0, 2.0, 3.0]), Some((2.5, 1.0, 4.0)));
    }

    /// Each size's cell holds only that size's rounds.
    #[test]
    fn spread_table_keeps_sizes_apart() {
        let run = |services: u64, rss_mib: u64| json!({"services": services, "rss_end_kib": rss_mib * 1024, "rss_steady_kib": 0, "rss_anon_end_kib": 0, "rss_file_end_kib": 0, "hwm_end_kib": 0, "cpu_after_sync_s": 1.0, "events_after_sync": 2000});
        let results = [run(10, 5), run(1000, 9), run(10, 7), run(1000, 11), run(10, 6), run(1000, 10)];
        let table = super::binary_spread_table(&[10, 1000], &results);
        let end_row = table.lines().find(|l| l.starts_with("| RSS at the end")).unwrap();
        assert_eq!(end_row, "| RSS at the end of the run (MiB) | 6.00 (5.00–7.00), n=3 | 10.00 (9.00–11.00), n=3 |");
        assert!(table.contains("| host CPU per 1,000 events after the sync (s) | 0.50 (0.50–0.50), n=3 |"), "{table}");
    }
}
