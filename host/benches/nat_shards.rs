//! What service shards cost on the packet path: a new connection's first packet runs the
//! NAT chains of every shard table in turn until one DNATs it (the kernel stops at the
//! first NAT binding), and a connection to no service at all runs them all.
//!
//! In a fresh network namespace per layout, N synthetic services (one TCP port each, DNAT
//! to a listener on 127.0.0.1:8080, service IPs routed to `lo`) are written by the host's
//! writer, once in one table and once in shards as the host lays them out; then, from
//! inside the namespace, M TCP connections are opened and closed one after another (each
//! timed; median and 99th percentile):
//! - to service IPs spread over every shard (DNAT by the nat output hook);
//! - to 127.0.0.1:8081 directly, which no service matches (every shard's chains run).
//!
//! Then the same services load balanced as data (the default translator's shape), each
//! frontend with K backends (127.0.0.1 … 127.0.0.K), in the host's layout: a frontend goes
//! to its shard's `pick-by-count` chain, which tries the count sets in turn (see
//! `nft::CountedKeys`), so a connection to a frontend of K backends makes K set lookups.
//!
//! `cargo bench --workspace --bench nat_shards` (needs root; `WASMPLANE_BENCH_SERVICES`,
//! default 10000; `WASMPLANE_BENCH_CONNECTIONS`, default 3000).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use wasmplane::dataplane::{Dataplane, NftCommand};
use wasmplane::nft::{self, Layout, ObjectRules};
use wasmplane_model::ObjectKey;
use wasmplane_runtime::wit::{KeyPart, MapElement, Protocol, Ruleset, Verdict};

mod support;
use support::{Netns, is_root};

fn service_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 96 + (i / 65536) as u8, (i / 256 % 256) as u8, (i % 256) as u8)
}

fn services(n: usize) -> BTreeMap<ObjectKey, ObjectRules> {
    (0..n)
        .map(|i| {
            let chain = format!("svc/bench/s{i}/tcp/http");
            let mut rules = ObjectRules::default();
            rules.chains.insert(chain.clone(), vec!["meta l4proto tcp dnat ip to 127.0.0.1:8080".into()]);
            rules.elements.insert(
                ("service-ips".into(), wasmplane_model::format_compact!("{} . tcp . 80", service_ip(i))),
                wasmplane_model::format_compact!("goto {chain}"),
            );
            (ObjectKey::new("bench", format!("s{i}")), rules)
        })
        .collect()
}

/// `n` services load balanced as data, each over `backends` backends on port 8080, as the
/// host validates and renders a translator's output.
fn services_as_data(n: usize, backends: usize) -> BTreeMap<ObjectKey, ObjectRules> {
    (0..n)
        .map(|i| {
            let key = ObjectKey::new("bench", format!("s{i}"));
            let map_elements = (1..=backends)
                .map(|b| MapElement {
                    map_name: "service-backends".into(),
                    key: vec![
                        KeyPart::Address(service_ip(i).to_string()),
                        KeyPart::Protocol(Protocol::Tcp),
                        KeyPart::Port(80),
                        KeyPart::Address(format!("127.0.0.{b}")),
                        KeyPart::Port(8080),
                    ],
                    verdict: Verdict::None,
                })
                .collect();
            let out = Ruleset { chains: vec![], sets: vec![], map_elements, warnings: vec![] };
            let rules =
                nft::validate_service_output(&key, &out, nft::PodDetection::new(&nft::PodTraffic::default(), &[]))
                    .expect("a valid ruleset");
            (key, rules)
        })
        .collect()
}

/// Writes `objects` into a fresh network namespace with `per_shard` services to a shard,
/// then times new connections to every 1/256th service and to a port no service has.
fn measure(objects: &BTreeMap<ObjectKey, ObjectRules>, per_shard: usize, count: usize) -> (Layout, Timings, Timings) {
    let n = objects.len();
    let ns = Netns::new(format!("wpnat{}", std::process::id()));
    ns.exec(&["ip", "link", "set", "lo", "up"]);
    ns.exec(&["ip", "route", "add", "10.96.0.0/12", "dev", "lo"]);
    let mut dataplane =
        Dataplane::new(Box::new(NftCommand::new(ns.nft_command(), Vec::new()))).with_services_per_shard(per_shard);
    dataplane.full_sync(Some(objects.clone())).expect("loading the services");
    let layout = dataplane.layout();
    // Services from every shard, in turn.
    let targets: Vec<SocketAddr> =
        (0..n).step_by((n / 256).max(1)).map(|i| SocketAddr::from((service_ip(i), 80))).collect();
    let (to_service, to_nothing) = ns.run(|| {
        // Every 127.0.0.K backend on 8080; 8081 for the connections to no service.
        let listeners =
            [("0.0.0.0", 8080), ("127.0.0.1", 8081)].map(|address| TcpListener::bind(address).expect("listening"));
        // Accepted connections are dropped at once (the listener's backlog keeps up).
        let stop = std::sync::atomic::AtomicBool::new(false);
        // Set however the scope ends: the acceptors loop until it is (a panic in the scope
        // waited for them forever and kept the namespace).
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        std::thread::scope(|s| {
            let _stop = StopOnDrop(&stop);
            for listener in &listeners {
                listener.set_nonblocking(true).unwrap();
                let stop = &stop;
                s.spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match listener.accept() {
                            Ok(_) => {}
                            Err(_) => std::thread::sleep(Duration::from_micros(50)),
                        }
                    }
                });
            }
            connections(&targets, count / 10); // warm-up
            let to_service = connections(&targets, count);
            let to_nothing = connections(&[SocketAddr::from(([127, 0, 0, 1], 8081))], count);
            (to_service, to_nothing)
        })
    });
    (layout, to_service, to_nothing)
}

/// One kind of connection, timed: median and 99th percentile of the ones that were set up
/// (a median: one SYN retransmitted after a second, a port reused while its old flow
/// lingers, would dominate a mean), and the ones that failed.
struct Timings {
    p50: Duration,
    p99: Duration,
    failed: usize,
    first_error: Option<String>,
}

/// Opens and closes `count` connections to `targets` in turn. A failure is counted and
/// reported, not fatal: one run of 10,000 connections to one address and port failed a
/// connect with `Broken pipe` (not reproduced since).
fn connections(targets: &[SocketAddr], count: usize) -> Timings {
    let (mut times, mut failed, mut first_error) = (Vec::with_capacity(count), 0, None);
    for k in 0..count {
        let target = targets[k % targets.len()];
        let started = Instant::now();
        match TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
            Ok(stream) => {
                drop(stream);
                times.push(started.elapsed());
            }
            Err(e) => {
                failed += 1;
                first_error.get_or_insert_with(|| format!("connect {target}: {e}"));
            }
        }
    }
    assert!(!times.is_empty(), "no connection was set up: {first_error:?}");
    times.sort();
    Timings { p50: times[times.len() / 2], p99: times[times.len() * 99 / 100], failed, first_error }
}

fn micros(t: &Timings) -> String {
    let mut text = format!("{:.1} / {:.1} µs", t.p50.as_secs_f64() * 1e6, t.p99.as_secs_f64() * 1e6);
    if let Some(error) = &t.first_error {
        text.push_str(&format!(" ({} failed, first: {error})", t.failed));
    }
    text
}

fn main() {
    if !is_root() {
        eprintln!("\n!!!!!!!! nat_shards bench SKIPPED: needs root (network namespaces, nftables) !!!!!!!!\n");
        return;
    }
    let env = |name: &str, default: usize| std::env::var(name).map(|v| v.parse().expect(name)).unwrap_or(default);
    let n = env("WASMPLANE_BENCH_SERVICES", 10_000);
    let count = env("WASMPLANE_BENCH_CONNECTIONS", 3_000);
    let objects = services(n);
    println!(
        "New TCP connections through the service NAT chains, {n} services, {count} connections each (one connection: open + close, p50 / p99)\n"
    );
    println!("| layout | to a service (DNAT) | to no service (every shard's NAT chains) |");
    println!("|---|---|---|");
    for per_shard in [usize::MAX, Layout::DEFAULT_SERVICES_PER_SHARD] {
        let (layout, to_service, to_nothing) = measure(&objects, per_shard, count);
        let name = if layout.shards == 1 { "one table".to_string() } else { format!("{} shards", layout.shards) };
        println!("| {name} | {} | {} |", micros(&to_service), micros(&to_nothing));
    }
    println!(
        "\nLoad balanced as data, the host's layout: a frontend of K backends costs a new connection K set lookups\n"
    );
    println!("| backends per frontend | to a service (DNAT) | to no service |");
    println!("|---|---|---|");
    for backends in [1, 8, nft::MAX_PICK] {
        let (_, to_service, to_nothing) =
            measure(&services_as_data(n, backends), Layout::DEFAULT_SERVICES_PER_SHARD, count);
        println!("| {backends} | {} | {} |", micros(&to_service), micros(&to_nothing));
    }
}
