//! Benchmark: what our layer costs on top of etcd-client, and what the embedded
//! backend does. Prints a markdown table.
//!
//! - put latency: sequential puts (one in flight), p50/p99, through
//!   `EtcdStore::put` and through `etcd_client::Client::put`, interleaved in
//!   rounds so machine noise hits both alike;
//! - watch throughput: a watch replaying N pre-written events from a revision,
//!   through `EtcdStore::watch_prefix` (seed listing, per-watch view, channel) and
//!   through a raw etcd-client watch stream;
//! - the embedded backend in memory, on disk (fsync per commit) and on disk
//!   without fsync.
//!
//! Run: `cargo bench -p wasmplane-kvstore --bench kvstore` (needs Debian's
//! `etcd-server`). `KVSTORE_BENCH_PUTS` and `KVSTORE_BENCH_EVENTS` resize it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use wasmplane_kvstore::{Bytes, EmbeddedConfig, EmbeddedStore, EtcdConfig, EtcdStore, KvStore};
use wasmplane_test_etcd::Etcd;

const VALUE_SIZE: usize = 128;
const ROUNDS: usize = 4;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

struct Latency {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

fn latency(mut samples: Vec<Duration>) -> Latency {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    let total: Duration = samples.iter().sum();
    Latency { p50: at(0.50), p99: at(0.99), mean: total / samples.len() as u32 }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

struct Row {
    backend: &'static str,
    path: &'static str,
    put: Option<Latency>,
    watch_events_per_sec: Option<f64>,
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let puts = env_usize("KVSTORE_BENCH_PUTS", 2000);
    let events = env_usize("KVSTORE_BENCH_EVENTS", 20_000);
    let value = Bytes::from(vec![b'x'; VALUE_SIZE]);
    let mut rows = Vec::new();

    // --- etcd: ours vs etcd-client, same server, same run ---
    let etcd = Etcd::start().await?;
    let ours = EtcdStore::connect(EtcdConfig::new([etcd.endpoint()])).await?;
    let mut direct = etcd_client::Client::connect([etcd.endpoint()], None).await?;

    // Warm-up: connections, server caches.
    for i in 0..100 {
        ours.put(&format!("bench/warm/{i}"), value.clone(), None).await?;
        direct.put(format!("bench/warm/{i}"), value.to_vec(), None).await?;
    }
    let mut ours_samples = Vec::with_capacity(puts);
    let mut direct_samples = Vec::with_capacity(puts);
    let per_round = puts / ROUNDS;
    for _ in 0..ROUNDS {
        for i in 0..per_round {
            let key = format!("bench/put/{}", i % 100);
            let start = Instant::now();
            ours.put(&key, value.clone(), None).await?;
            ours_samples.push(start.elapsed());
        }
        for i in 0..per_round {
            let key = format!("bench/put/{}", i % 100);
            let start = Instant::now();
            direct.put(key, value.to_vec(), None).await?;
            direct_samples.push(start.elapsed());
        }
    }

    // Pre-write the events a watch will replay, many in flight.
    let start_revision = ours.current_revision().await? + 1;
    futures::stream::iter(0..events)
        .map(|i| {
            let mut client = direct.clone();
            let value = value.to_vec();
            async move { client.put(format!("bench/watch/{}", i % 1000), value, None).await }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;

    let mut ours_rate = Vec::new();
    let mut direct_rate = Vec::new();
    for _ in 0..3 {
        ours_rate.push(watch_ours(&ours, start_revision, events).await?);
        direct_rate.push(watch_direct(&mut direct, start_revision, events).await?);
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    rows.push(Row {
        backend: "etcd",
        path: "wasmplane-kvstore",
        put: Some(latency(ours_samples)),
        watch_events_per_sec: Some(best(&ours_rate)),
    });
    rows.push(Row {
        backend: "etcd",
        path: "etcd-client directly",
        put: Some(latency(direct_samples)),
        watch_events_per_sec: Some(best(&direct_rate)),
    });
    drop(etcd);

    // --- embedded ---
    let dir = tempfile::tempdir()?;
    let memory: Arc<dyn KvStore> = Arc::new(EmbeddedStore::in_memory());
    let disk: Arc<dyn KvStore> =
        Arc::new(EmbeddedStore::open(EmbeddedConfig::persistent(dir.path().join("durable.redb"))).await?);
    let mut fast_config = EmbeddedConfig::persistent(dir.path().join("fast.redb"));
    fast_config.durable = false;
    let fast: Arc<dyn KvStore> = Arc::new(EmbeddedStore::open(fast_config).await?);
    for (path, store, n) in
        [("in memory", memory, puts), ("redb, fsync per commit", disk, puts.min(500)), ("redb, no fsync", fast, puts)]
    {
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            let start = Instant::now();
            store.put(&format!("bench/put/{}", i % 100), value.clone(), None).await?;
            samples.push(start.elapsed());
        }
        let from = store.current_revision().await? + 1;
        for i in 0..events {
            store.put(&format!("bench/watch/{}", i % 1000), value.clone(), None).await?;
        }
        let mut rates = Vec::new();
        for _ in 0..3 {
            rates.push(watch_ours(store.as_ref(), from, events).await?);
        }
        rows.push(Row {
            backend: "embedded",
            path,
            put: Some(latency(samples)),
            watch_events_per_sec: Some(best(&rates)),
        });
    }

    print_table(&rows, puts, events);
    Ok(())
}

/// Events per second for a watch through our layer replaying `n` events.
async fn watch_ours(store: &dyn KvStore, from: i64, n: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut stream = store.watch_prefix("bench/watch/", Some(from)).await?;
    let mut seen = 0;
    while seen < n {
        match tokio::time::timeout(Duration::from_secs(30), stream.next()).await {
            Ok(Some(Ok(_))) => seen += 1,
            other => anyhow::bail!("watch stopped after {seen} of {n} events: {other:?}"),
        }
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// The same through a raw etcd-client watch stream.
async fn watch_direct(client: &mut etcd_client::Client, from: i64, n: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    let options = etcd_client::WatchOptions::new().with_prefix().with_start_revision(from);
    let mut stream = client.watch("bench/watch/", Some(options)).await?;
    let mut seen = 0;
    while seen < n {
        match tokio::time::timeout(Duration::from_secs(30), stream.message()).await {
            Ok(Ok(Some(resp))) => seen += resp.events().len(),
            other => anyhow::bail!("raw watch stopped after {seen} of {n} events: {other:?}"),
        }
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

fn print_table(rows: &[Row], puts: usize, events: usize) {
    println!();
    println!(
        "kvstore benchmark: {puts} sequential puts of {VALUE_SIZE} B (embedded fsync: at most 500), \
         watch replay of {events} events (best of 3)"
    );
    println!();
    println!("| backend | path | put p50 | put p99 | put mean | watch events/s |");
    println!("|---|---|---:|---:|---:|---:|");
    for row in rows {
        let (p50, p99, mean) = match &row.put {
            Some(l) => (ms(l.p50), ms(l.p99), ms(l.mean)),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let watch = row.watch_events_per_sec.map(|r| format!("{r:.0}")).unwrap_or_else(|| "-".into());
        println!("| {} | {} | {p50} | {p99} | {mean} | {watch} |", row.backend, row.path);
    }
    if let (Some(ours), Some(direct)) = (rows.first(), rows.get(1))
        && let (Some(o), Some(d)) = (&ours.put, &direct.put)
    {
        println!();
        println!("| ratio (ours / etcd-client) | put p50 | put p99 | watch throughput |");
        println!("|---|---:|---:|---:|");
        let watch_ratio = match (ours.watch_events_per_sec, direct.watch_events_per_sec) {
            (Some(o), Some(d)) if d > 0.0 => format!("{:.2}", o / d),
            _ => "-".into(),
        };
        println!(
            "| etcd | {:.2} | {:.2} | {watch_ratio} |",
            o.p50.as_secs_f64() / d.p50.as_secs_f64(),
            o.p99.as_secs_f64() / d.p99.as_secs_f64(),
        );
    }
}
