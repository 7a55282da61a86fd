//! Runtime benchmark: compile, cached load, instantiate, and the default translator's
//! per-call cost as Wasm vs the same Rust compiled natively, measured in one run.
//!
//! `cargo bench --workspace --bench runtime`
//!
//! Both sides get the same inputs and pay for the same conversion: the Wasm side converts the
//! model to WIT types (`TranslatorSession::translate`), the native side converts it to the
//! SDK's (identical) types, per call; chain prefixes are computed once for both. The Wasm side
//! also pays what only it has: lowering the inputs into the guest, lifting the ruleset back
//! out and freeing the guest's copies. The breakdown rows split that cost, and the last table
//! times the guest's own work apart from all of it (`guest_work`).
//!
//! `WASMPLANE_BENCH_GUEST=path.wasm` runs a component from a file instead of the embedded
//! translator (to compare guest builds without rebuilding the host);
//! `WASMPLANE_BENCH_SIZES=1000,10000` sets the service counts.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext, ServiceView};
use wasmplane_model::*;
use wasmplane_runtime::{GuestKind, Limits, NoLookups, Runtime, convert, wit};
use wasmplane_sdk::types as sdk;

fn synthetic(n: usize) -> Vec<ServiceView> {
    (0..n)
        .map(|i| {
            let service = Service {
                namespace: format!("ns{}", i % 50).into(),
                name: format!("svc{i}").into(),
                service_type: ServiceType::ClusterIP,
                cluster_ips: vec![format!("10.96.{}.{}", i / 250, i % 250 + 1).into()],
                external_ips: vec![],
                load_balancer_ips: vec![],
                ports: vec![ServicePort { name: "http".into(), protocol: Protocol::Tcp, port: 80, node_port: 0, target_port: TargetPort::Number(8080) }],
                session_affinity_timeout: None,
                external_traffic_policy: TrafficPolicy::Cluster,
                internal_traffic_policy: TrafficPolicy::Cluster,
                labels: Labels::new(),
            };
            let endpoints = (0..3)
                .map(|e| LocalEndpoint {
                    addresses: vec![format!("10.244.{}.{}", (i * 3 + e) / 250 % 250, (i * 3 + e) % 250 + 1).into()],
                    ready: true,
                    serving: true,
                    terminating: false,
                    node_name: Some(format!("node-{e}").into()),
                    zone: None,
                    is_local: e == 0,
                })
                .collect();
            ServiceView {
                service: service.into(),
                slices: vec![LocalSlice { name: format!("svc{i}-x").into(), endpoints, ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }] }],
            }
        })
        .collect()
}

/// Model → SDK types: the native path gets the same inputs the guest sees.
fn to_sdk(view: &ServiceView) -> (sdk::Service, Vec<sdk::EndpointSlice>) {
    let proto = |p: Protocol| match p {
        Protocol::Tcp => sdk::Protocol::Tcp,
        Protocol::Udp => sdk::Protocol::Udp,
        Protocol::Sctp => sdk::Protocol::Sctp,
    };
    let s = &view.service;
    let service = sdk::Service {
        namespace: s.namespace.to_std(),
        name: s.name.to_std(),
        service_type: sdk::ServiceType::ClusterIp,
        cluster_ips: s.cluster_ips.to_std(),
        external_ips: vec![],
        load_balancer_ips: vec![],
        ports: s
            .ports
            .iter()
            .map(|p| sdk::ServicePort { name: p.name.to_std(), protocol: proto(p.protocol), port: p.port, node_port: 0, target_port: sdk::TargetPort::Number(8080) })
            .collect(),
        session_affinity_timeout: None,
        external_traffic_policy: sdk::TrafficPolicy::Cluster,
        internal_traffic_policy: sdk::TrafficPolicy::Cluster,
        labels: vec![],
    };
    let slices = view
        .slices
        .iter()
        .map(|sl| sdk::EndpointSlice {
            name: sl.name.to_std(),
            endpoints: sl
                .endpoints
                .iter()
                .map(|e| sdk::Endpoint {
                    addresses: e.addresses.to_std(),
                    ready: e.ready,
                    serving: e.serving,
                    terminating: e.terminating,
                    node_name: e.node_name.to_std(),
                    zone: None,
                    is_local: e.is_local,
                })
                .collect(),
            ports: sl.ports.iter().map(|p| sdk::EndpointPort { name: p.name.to_std(), protocol: proto(p.protocol), port: p.port }).collect(),
        })
        .collect();
    (service, slices)
}

/// How many times lowering these arguments calls the guest's `cabi_realloc`: wasmtime calls
/// it once for the spilled parameter area and once for every string and every list, empty
/// or not (`lower_string`, `lower_list`). Each is a call into the guest.
fn lowered_allocations(ctx: &wit::NodeContext, service: &wit::Service, slices: &[wit::EndpointSlice]) -> usize {
    let strings = |l: &[String]| 1 + l.len();
    let params_area_and_prefix = 2;
    let ctx = 1 + strings(&ctx.node_ips) + strings(&ctx.cluster_cidrs) + strings(&ctx.pod_cidrs);
    let ports: usize = service.ports.iter().map(|p| 1 + usize::from(matches!(p.target_port, wit::TargetPort::Name(_)))).sum();
    let service = 2
        + strings(&service.cluster_ips)
        + strings(&service.external_ips)
        + strings(&service.load_balancer_ips)
        + 1
        + ports
        + 1
        + 2 * service.labels.len();
    let slices = 1 + slices
        .iter()
        .map(|s| {
            let endpoints: usize =
                s.endpoints.iter().map(|e| strings(&e.addresses) + usize::from(e.node_name.is_some()) + usize::from(e.zone.is_some())).sum();
            1 + 1 + endpoints + 1 + s.ports.len()
        })
        .sum::<usize>();
    params_area_and_prefix + ctx + service + slices
}

/// The guest's own work, with no boundary: the `bench-repeat` build of the default translator
/// translates each service `REPEAT` times in one call instead of once, so the difference
/// between the two runs is `REPEAT - 1` translations of inputs already in the guest, their
/// rulesets built and freed there. Native: the same function on inputs already converted.
/// Returns (Wasm, native) per translation.
fn guest_work(runtime: &Runtime, ctx: &NodeContext, sdk_ctx: &sdk::NodeContext, views: &[ServiceView], prefixes: &[String]) -> (Duration, Duration) {
    const REPEAT: u32 = 11;
    let module = runtime
        .load("repeat", wasmplane_guest_artifacts::test_programs::TRANSLATOR_BENCH_REPEAT, Some(GuestKind::ServiceTranslator), usize::MAX)
        .unwrap();
    let mut session = module.translator(Arc::new(NoLookups)).unwrap();
    session.instantiate_now().unwrap();
    let with_label = |repeat: u32| -> Vec<ServiceView> {
        views
            .iter()
            .map(|v| {
                let mut service = (*v.service).clone();
                service.labels.insert(wasmplane_guest_service_translator::BENCH_REPEAT_LABEL.into(), repeat.to_compact_string());
                ServiceView { service: service.into(), slices: v.slices.clone() }
            })
            .collect()
    };
    let mut run = |views: &[ServiceView]| {
        best_of(3, || {
            for (v, p) in views.iter().zip(prefixes) {
                std::hint::black_box(session.translate(ctx, p, v).unwrap());
            }
        })
    };
    let once = run(&with_label(1));
    let repeated = run(&with_label(REPEAT));
    let translations = views.len() as u32 * (REPEAT - 1);
    let wasm = repeated.saturating_sub(once) / translations;
    let inputs: Vec<_> = views.iter().map(to_sdk).collect();
    let native = best_of(3, || {
        for _ in 0..REPEAT - 1 {
            for ((svc, slices), p) in inputs.iter().zip(prefixes) {
                std::hint::black_box(wasmplane_guest_service_translator::translate(sdk_ctx, p, svc, slices).unwrap());
            }
        }
    }) / translations;
    (wasm, native)
}

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .min()
        .unwrap()
}

fn per_call(d: Duration, n: usize) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6 / n as f64)
}

fn main() {
    let bytes: Cow<'static, [u8]> = match std::env::var_os("WASMPLANE_BENCH_GUEST") {
        Some(path) => Cow::Owned(std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.to_string_lossy()))),
        None => Cow::Borrowed(wasmplane_guest_artifacts::SERVICE_TRANSLATOR),
    };
    let sizes: Vec<usize> = std::env::var("WASMPLANE_BENCH_SIZES")
        .map(|s| s.split(',').map(|n| n.trim().parse().expect("WASMPLANE_BENCH_SIZES: numbers")).collect())
        .unwrap_or_else(|_| vec![1_000, 10_000]);
    let bytes = &*bytes;
    let cache = tempfile::tempdir().unwrap();
    let limits = Limits { call_timeout: Duration::from_secs(5), ..Default::default() };
    let runtime = Runtime::new(limits.clone(), Some(cache.path().to_path_buf())).unwrap();
    let uncached = Runtime::new(limits, None).unwrap();

    println!("default service translator: {} KiB component\n", bytes.len() / 1024);
    println!("| measurement | time |");
    println!("|---|---|");
    let compile = best_of(3, || uncached.load("t", bytes, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap());
    println!("| compile (cranelift, no cache) | {:.1} ms |", compile.as_secs_f64() * 1e3);
    runtime.load("t", bytes, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap();
    let cached = best_of(5, || runtime.load("t", bytes, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap());
    println!("| load from on-disk cache | {:.2} ms |", cached.as_secs_f64() * 1e3);
    let module = runtime.load("t", bytes, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap();
    let instantiate = best_of(50, || {
        let mut s = module.translator(Arc::new(NoLookups)).unwrap();
        s.instantiate_now().unwrap();
        s
    });
    println!("| instantiate (pooling allocator) | {:.1} µs |", instantiate.as_secs_f64() * 1e6);

    let ctx = NodeContext { node_name: "node-0".into(), node_ips: vec!["192.168.0.1".into()], cluster_cidrs: vec!["10.244.0.0/16".into()], pod_cidrs: vec![], zone: None };
    let sdk_ctx = sdk::NodeContext { node_name: ctx.node_name.to_std(), node_ips: ctx.node_ips.to_std(), cluster_cidrs: ctx.cluster_cidrs.to_std(), pod_cidrs: vec![] };
    let mut breakdown = Vec::new();
    println!("\n| services | Wasm total | Wasm per call | native total | native per call | Wasm/native |");
    println!("|---|---|---|---|---|---|");
    for &n in &sizes {
        let views = synthetic(n);
        let prefixes: Vec<String> = views.iter().map(|v| format!("svc/{}/{}", v.service.namespace, v.service.name)).collect();
        let mut session = module.translator(Arc::new(NoLookups)).unwrap();
        session.instantiate_now().unwrap();
        let wasm = best_of(3, || {
            for (v, p) in views.iter().zip(&prefixes) {
                std::hint::black_box(session.translate(&ctx, p, v).unwrap());
            }
        });
        let native = best_of(3, || {
            for (view, p) in views.iter().zip(&prefixes) {
                // The same model → SDK-type conversion the Wasm side makes (model → WIT).
                let (svc, slices) = to_sdk(view);
                std::hint::black_box(wasmplane_guest_service_translator::translate(&sdk_ctx, p, &svc, &slices).unwrap());
            }
        });
        println!(
            "| {n} | {:.1} ms | {} | {:.1} ms | {} | {:.2}× |",
            wasm.as_secs_f64() * 1e3,
            per_call(wasm, n),
            native.as_secs_f64() * 1e3,
            per_call(native, n),
            wasm.as_secs_f64() / native.as_secs_f64()
        );

        // Where the Wasm call's time goes.
        let convert = best_of(3, || {
            for v in &views {
                std::hint::black_box((convert::node_context(&ctx), convert::service(&v.service), convert::slices(v)));
            }
        });
        // Same inputs already converted, but an ExternalName service: the guest returns an
        // empty ruleset at once, so this is lowering the inputs + the call + lifting nothing.
        let inputs: Vec<_> = views
            .iter()
            .map(|v| {
                let mut service = convert::service(&v.service);
                service.service_type = wit::ServiceType::ExternalName;
                (service, convert::slices(v))
            })
            .collect();
        let wit_ctx = convert::node_context(&ctx);
        let boundary = best_of(3, || {
            for ((service, slices), p) in inputs.iter().zip(&prefixes) {
                std::hint::black_box(session.translate_wit(&wit_ctx, p, service, slices).unwrap());
            }
        });
        // The fixed cost of a call: ExternalName, no slices.
        let empty: Vec<_> = inputs.iter().map(|(s, _)| s.clone()).collect();
        let call = best_of(3, || {
            for (service, p) in empty.iter().zip(&prefixes) {
                std::hint::black_box(session.translate_wit(&wit_ctx, p, service, &[]).unwrap());
            }
        });
        let output = best_of(3, || {
            for (v, p) in views.iter().zip(&prefixes) {
                let (svc, slices) = to_sdk(v);
                let ruleset = wasmplane_guest_service_translator::translate(&sdk_ctx, p, &svc, &slices).unwrap();
                std::hint::black_box(ruleset.clone());
            }
        });
        // Per call, how many of those lowerings each of the two ExternalName runs made.
        let with_slices = inputs.iter().map(|(s, sl)| lowered_allocations(&wit_ctx, s, sl)).sum::<usize>() as f64 / n as f64;
        let without = empty.iter().map(|s| lowered_allocations(&wit_ctx, s, &[])).sum::<usize>() as f64 / n as f64;
        let (work_wasm, work_native) = guest_work(&runtime, &ctx, &sdk_ctx, &views, &prefixes);
        breakdown.push((n, convert, boundary, call, output.saturating_sub(native), native, with_slices, without, work_wasm, work_native));
    }
    println!("\n| services | model → WIT | lowering the inputs + call + empty result (ExternalName) | fixed cost of a call (ExternalName, no slices) | native clone of the ruleset (≈ lifting it) |");
    println!("|---|---|---|---|---|");
    for (n, convert, boundary, call, output, ..) in &breakdown {
        println!("| {n} | {} | {} | {} | {} |", per_call(*convert, *n), per_call(*boundary, *n), per_call(*call, *n), per_call(*output, *n));
    }
    // The two ExternalName runs differ only in the slices, so their difference over the
    // difference in lowerings is what one lowered string or list costs (the host's copy, the
    // call into the guest's allocator, the guest's bindings taking it over and freeing it).
    // What is left of the fixed cost is entering and leaving the guest.
    println!("\n| services | guest allocations per call: with slices / without | one lowered string or list | the call itself (fixed cost less its lowerings) | native call, in lowered strings or lists |");
    println!("|---|---|---|---|---|");
    for (n, _, boundary, call, _, native, with_slices, without, ..) in &breakdown {
        let per_call_us = |d: &Duration| d.as_secs_f64() * 1e6 / *n as f64;
        let per_allocation = (per_call_us(boundary) - per_call_us(call)) / (with_slices - without);
        println!(
            "| {n} | {with_slices:.0} / {without:.0} | {:.0} ns | {:.2} µs | {:.0} |",
            per_allocation * 1e3,
            per_call_us(call) - without * per_allocation,
            per_call_us(native) / per_allocation
        );
    }
    // What no interface can remove: the translation itself, compiled to Wasm vs natively.
    println!("\n| services | guest's own work per translation, Wasm (no boundary) | native | Wasm/native |");
    println!("|---|---|---|---|");
    for (n, .., work_wasm, work_native) in &breakdown {
        println!(
            "| {n} | {:.2} µs | {:.2} µs | {:.2}× |",
            work_wasm.as_secs_f64() * 1e6,
            work_native.as_secs_f64() * 1e6,
            work_wasm.as_secs_f64() / work_native.as_secs_f64()
        );
    }
}
