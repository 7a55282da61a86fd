//! nftables writer benchmark: the full ruleset our writer renders for N services (3 endpoints
//! each, rules from the default translator running as Wasm), loaded into a fresh network
//! namespace, then one-service changes on top, in one run; each size twice: services in
//! shard tables as the host lays them out (`nft::Layout`), and all of them in one table:
//!
//! - render: validating the guest output and rendering the full `nft -f` document (CPU only);
//! - `nft -f` (reference): that document loaded by one plain `nft -f` into an empty namespace;
//! - writer full sync: `Dataplane::full_sync` through `nft` (first sync: list + one transaction);
//! - list chains+sets: what every full sync reads to find stale tables, chains and sets;
//! - reconcile: a periodic full reconcile over the loaded table (list + flush/refill);
//! - one-service change: one endpoint of one service replaced, `Dataplane::sync` → kernel
//!   (median of 5, the incremental transaction only), as the host writes it (a netlink
//!   batch, `nft::netlink`), and the same kind of transaction through `nft -f` beside it.
//!
//! `cargo bench -p wasmplane --bench nft_writer` (needs root; sizes from
//! `WASMPLANE_BENCH_SIZES`, default `1000,10000`).

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmplane::dataplane::{Dataplane, Kernel as _, NetlinkNft, NftCommand};
use wasmplane::nft::{self, ObjectRules};
use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext, ServiceView};
use wasmplane_model::*;
use wasmplane_runtime::{GuestKind, Limits, NoLookups, Runtime, TranslatorSession};

mod support;
use support::{Netns, is_root};

fn view(i: usize, endpoint_base: usize) -> ServiceView {
    let cluster_ip = format!("10.{}.{}.{}", 96 + i / 62_500, i / 250 % 250, i % 250 + 1);
    let ports = vec![ServicePort::tcp("http", 80, 8080)];
    let service = Service::cluster_ip(&format!("ns{}", i % 50), &format!("svc{i}"), &cluster_ip, ports);
    let endpoints = (0..3)
        .map(|e| {
            let n = endpoint_base + i * 3 + e;
            LocalEndpoint {
                addresses: vec![format!("10.{}.{}.{}", 128 + n / 62_500, n / 250 % 250, n % 250 + 1).into()],
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some(format!("node-{e}").into()),
                zone: None,
                is_local: e == 0,
            }
        })
        .collect();
    ServiceView {
        service: service.into(),
        slices: vec![LocalSlice {
            name: format!("svc{i}-x").into(),
            endpoints,
            ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
        }],
    }
}

fn rules(session: &mut TranslatorSession, ctx: &NodeContext, view: &ServiceView) -> (ObjectKey, ObjectRules) {
    let key = ObjectKey::new(&view.service.namespace, &view.service.name);
    let out = session.translate(ctx, &nft::service_prefix(&key), view).expect("translate");
    let cluster_cidrs = wasmplane::dataplane::parse_cidrs("cluster-cidrs", &ctx.cluster_cidrs);
    let rules =
        nft::validate_service_output(&key, &out, nft::PodDetection::new(&nft::PodTraffic::default(), &cluster_cidrs))
            .expect("valid output");
    (key, rules)
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}

fn fmt(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{} µs", d.as_micros())
    } else if d < Duration::from_secs(1) {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

fn main() {
    if !is_root() {
        eprintln!("\n!!!!!!!! nft_writer bench SKIPPED: needs root (network namespaces, nftables) !!!!!!!!\n");
        return;
    }
    let sizes: Vec<usize> = std::env::var("WASMPLANE_BENCH_SIZES")
        .unwrap_or_else(|_| "1000,10000".into())
        .split(',')
        .map(|s| s.trim().parse().expect("WASMPLANE_BENCH_SIZES: comma-separated numbers"))
        .collect();
    let runtime = Runtime::new(Limits { call_timeout: Duration::from_secs(5), ..Default::default() }, None).unwrap();
    let module = runtime
        .load("t", wasmplane_guest_artifacts::SERVICE_TRANSLATOR, Some(GuestKind::ServiceTranslator), usize::MAX)
        .unwrap();
    let mut session = module.translator(Arc::new(NoLookups)).unwrap();
    let ctx =
        NodeContext { node_name: "node-0".into(), cluster_cidrs: vec!["10.244.0.0/16".into()], ..Default::default() };

    println!(
        "nftables writer: full syncs as `nft -f` text through `ip netns exec`, changes as netlink batches; each size and layout in a fresh namespace\n"
    );
    println!(
        "| services | layout | statements | render | `nft -f` (reference, one table) | writer full sync | list chains+sets | reconcile | one-service change, netlink (median of 5) | same change through `nft -f` | netlink change / full load |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut batch_kinds = Vec::new();
    for n in sizes {
        let objects: BTreeMap<ObjectKey, ObjectRules> =
            (0..n).map(|i| rules(&mut session, &ctx, &view(i, 0))).collect();
        let (document, render) = timed(|| {
            nft::full_transaction(
                objects.values(),
                &nft::Stale::default(),
                nft::Layout::default(),
                &nft::NodeNetworks { cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()], ..Default::default() },
            )
        });
        let statements = document.lines().count();

        let reference_ns = Netns::new(format!("wpbench{}-ref", std::process::id()));
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), &document).unwrap();
        let (status, reference) = timed(|| {
            Command::new("ip").args(["netns", "exec", &reference_ns.0, "nft", "-f"]).arg(file.path()).status().unwrap()
        });
        assert!(status.success(), "reference load failed");
        drop(reference_ns);

        // The host's layout (services in shard tables) against all services in one table.
        for per_shard in [nft::Layout::DEFAULT_SERVICES_PER_SHARD, usize::MAX] {
            let ns = Netns::new(format!("wpbench{}-writer", std::process::id()));
            let netns = NetlinkNft::netns_of_command(&ns.nft_command());
            let kernel = NetlinkNft::open(NftCommand::new(ns.nft_command(), Vec::new()), netns.as_deref())
                .expect("netlink socket");
            let mut dataplane = Dataplane::new(Box::new(kernel))
                .with_services_per_shard(per_shard)
                .with_cluster_cidrs(&ctx.cluster_cidrs.to_std());
            let (result, full) = timed(|| dataplane.full_sync(Some(objects.clone())));
            result.expect("writer full sync");
            let layout = dataplane.layout();
            let mut lister = NftCommand::new(ns.nft_command(), Vec::new());
            let (listed, list) = timed(|| lister.list_objects().unwrap());
            // Services are data (no chains of their own): the listing is the tables' skeletons.
            assert!(listed.chains.len() >= nft::MAX_PICK, "listing found {} chains", listed.chains.len());
            let (result, reconcile) = timed(|| dataplane.full_sync(None));
            result.expect("reconcile");

            let mut changes = Vec::new();
            let mut text_changes = Vec::new();
            for k in 0..5 {
                let i = k * n / 5 + 7;
                let mut v = view(i, 0);
                // One endpoint replaced: one numbered backend changes, one hairpin pair goes, one comes.
                v.slices[0].endpoints[2].addresses = vec![format!("10.250.{}.{}", k, i % 250 + 1).into()];
                let (key, r) = rules(&mut session, &ctx, &v);
                let (stats, t) = timed(|| dataplane.sync(vec![(key.clone(), Some(r))]).expect("incremental sync"));
                assert!(!stats.full && stats.statements > 0);
                changes.push(t);

                // The same kind of change through `nft -f`, then undone (untimed), so the
                // writer's view and the kernel stay equal.
                let applied = dataplane.applied()[&key].clone();
                v.slices[0].endpoints[1].addresses = vec![format!("10.251.{}.{}", k, i % 250 + 1).into()];
                let (_, other) = rules(&mut session, &ctx, &v);
                let (mut forward, mut back) = (String::new(), String::new());
                nft::object_delta(&applied, &other, &mut forward, layout);
                nft::object_delta(&other, &applied, &mut back, layout);
                let (result, t) = timed(|| lister.apply(&forward));
                result.expect("change through nft -f");
                text_changes.push(t);
                lister.apply(&back).expect("undoing the nft -f change");
            }
            // What one netlink batch costs by kind: the kernel validates the whole jump graph
            // of a table (every rule reachable from its base chains) when a batch adds
            // anything with a `validate` operation (a jump or goto, dnat, reject, a verdict
            // map element...) to it.
            let mut probe = NetlinkNft::open(NftCommand::new(ns.nft_command(), Vec::new()), netns.as_deref())
                .expect("netlink socket");
            let median = |mut v: Vec<Duration>| {
                v.sort();
                v[v.len() / 2]
            };
            let mut timed_batch = |add: String, undo: String| {
                let (result, t) = timed(|| probe.apply(&add));
                result.expect("probe batch");
                probe.apply(&undo).expect("undoing the probe batch");
                t
            };
            let shard = layout.table_of("svc/probe/probe");
            let element = median(
                (0..5)
                    .map(|k| {
                        timed_batch(
                            format!("add element inet wasmplane cluster-ips {{ 10.252.0.{} }}\n", k + 1),
                            format!("delete element inet wasmplane cluster-ips {{ 10.252.0.{} }}\n", k + 1),
                        )
                    })
                    .collect(),
            );
            let plain_rule = median(
                (0..5)
                    .map(|k| {
                        timed_batch(
                            format!(
                                "add chain {shard} svc/probe/probe/{k}\nadd rule {shard} svc/probe/probe/{k} counter\n"
                            ),
                            format!("delete chain {shard} svc/probe/probe/{k}\n"),
                        )
                    })
                    .collect(),
            );
            let verdict_element = median(
                (0..5)
                    .map(|k| {
                        timed_batch(
                            format!("add element {shard} service-ips {{ 10.252.1.{} . tcp . 80 : goto mark-for-masquerade }}\n", k + 1),
                            format!("delete element {shard} service-ips {{ 10.252.1.{} . tcp . 80 }}\n", k + 1),
                        )
                    })
                    .collect(),
            );
            let layout_name =
                if layout.shards == 1 { "one table".to_string() } else { format!("{} shards", layout.shards) };
            batch_kinds.push((n, layout_name.clone(), element, plain_rule, verdict_element));

            changes.sort();
            text_changes.sort();
            let change = changes[changes.len() / 2];
            let text_change = text_changes[text_changes.len() / 2];
            println!(
                "| {n} | {layout_name} | {statements} | {} | {} | {} | {} | {} | {} | {} | {:.4} |",
                fmt(render),
                fmt(reference),
                fmt(full),
                fmt(list),
                fmt(reconcile),
                fmt(change),
                fmt(text_change),
                change.as_secs_f64() / reference.as_secs_f64()
            );
        }
    }
    println!(
        "\nOne netlink batch by kind (median of 5): the kernel's commit validates the whole jump graph after anything with a jump, goto, dnat, reject or verdict element\n"
    );
    println!(
        "| services | layout | set element, no verdict (main table) | new chain + `counter` rule (a shard) | map element `goto` (a shard) |"
    );
    println!("|---|---|---|---|---|");
    for (n, layout, element, plain_rule, verdict_element) in batch_kinds {
        println!("| {n} | {layout} | {} | {} | {} |", fmt(element), fmt(plain_rule), fmt(verdict_element));
    }
}
