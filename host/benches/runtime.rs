//! Runtime benchmark: compile, cached load, instantiate, and the default translator's
//! per-call cost as Wasm vs the same Rust compiled natively, measured in one run: the shipped
//! translator (the archived world, package 1.2.0) and the same one built for the typed world.
//!
//! `cargo bench --workspace --bench runtime`
//!
//! Both sides get the same inputs and pay for the same conversion: the typed Wasm side converts
//! the model to WIT types (`TranslatorSession::translate`), the native side converts it to the
//! SDK's (identical) types with the same code (`wasmplane_runtime::native`), per call; chain
//! prefixes are computed once for both. The shipped (archived) side archives the model
//! instead (`TranslatorSession::translate_output`). The typed Wasm side
//! also pays what only it has: lowering the inputs into the guest, lifting the ruleset back
//! out and freeing the guest's copies. The breakdown rows split that cost, and a table times
//! the guest's own work apart from all of it (`guest_work`). Another times single calls
//! after idling, as one change in the host makes them (`isolated_calls`). The last ones time
//! the same translation across a boundary of one serialized buffer each way instead of typed
//! values (`serialized_boundary`): what a WIT 2.0 of that shape would cost; typed, with
//! many services per call (`batched_boundary`); and one archive each way, read in place on
//! both sides (`archived::archived_boundary`, the shipped world), with the host's validation
//! after each way.
//!
//! `WASMPLANE_BENCH_GUEST=path.wasm` runs a component from a file instead of the embedded
//! translator (to compare guest builds without rebuilding the host);
//! `WASMPLANE_BENCH_SIZES=1000,10000` sets the service counts.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext, ServiceView};
use wasmplane_model::*;
use wasmplane_runtime::{GuestKind, Limits, NoLookups, Runtime, convert, native, wit};
use wasmplane_sdk::types as sdk;

#[path = "runtime/archived.rs"]
mod archived;

/// The host side of `guests/service-translator/bench-encoded.wit`.
mod encoded {
    wasmtime::component::bindgen!({ path: "../guests/service-translator/bench-encoded.wit", world: "encoded-translation" });
}

/// The host side of `guests/service-translator/bench-batch/batch.wit`, on the runtime's WIT
/// types.
mod batch {
    wasmtime::component::bindgen!({
        path: "../guests/service-translator/bench-batch",
        world: "batch-translation",
        with: { "wasmplane:dataplane/types@1.2.0": wasmplane_runtime::wit },
    });
}

fn synthetic(n: usize) -> Vec<ServiceView> {
    (0..n)
        .map(|i| {
            let cluster_ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
            let ports = vec![ServicePort::tcp("http", 80, 8080)];
            let service = Service::cluster_ip(&format!("ns{}", i % 50), &format!("svc{i}"), &cluster_ip, ports);
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
                slices: vec![LocalSlice {
                    name: format!("svc{i}-x").into(),
                    endpoints,
                    ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
                }],
            }
        })
        .collect()
}

/// Model → SDK types: the native path gets the same inputs the guest sees, through the
/// conversion the Wasm path makes (`wasmplane_runtime::native`).
fn to_sdk(view: &ServiceView) -> (sdk::Service, Vec<sdk::EndpointSlice>) {
    (native::service(&view.service), native::slices(view))
}

/// How many times lowering these arguments calls the guest's `cabi_realloc`: wasmtime calls
/// it once for the spilled parameter area and once for every string and every list, empty
/// or not (`lower_string`, `lower_list`). Each is a call into the guest.
fn lowered_allocations(ctx: &wit::NodeContext, service: &wit::Service, slices: &[wit::EndpointSlice]) -> usize {
    let strings = |l: &[String]| 1 + l.len();
    let params_area_and_prefix = 2;
    let ctx = 1 + strings(&ctx.node_ips) + strings(&ctx.cluster_cidrs) + strings(&ctx.pod_cidrs);
    let ports: usize =
        service.ports.iter().map(|p| 1 + usize::from(matches!(p.target_port, wit::TargetPort::Name(_)))).sum();
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
            let endpoints: usize = s
                .endpoints
                .iter()
                .map(|e| strings(&e.addresses) + usize::from(e.node_name.is_some()) + usize::from(e.zone.is_some()))
                .sum();
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
fn guest_work(
    runtime: &Runtime,
    ctx: &NodeContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
) -> (Duration, Duration) {
    const REPEAT: u32 = 11;
    let module = runtime
        .load(
            "repeat",
            wasmplane_guest_artifacts::test_programs::TRANSLATOR_BENCH_REPEAT,
            Some(GuestKind::ServiceTranslator),
            usize::MAX,
        )
        .unwrap();
    let mut session = module.translator(Arc::new(NoLookups)).unwrap();
    session.instantiate_now().unwrap();
    let with_label = |repeat: u32| -> Vec<ServiceView> {
        views
            .iter()
            .map(|v| {
                let mut service = (*v.service).clone();
                service
                    .labels
                    .insert(wasmplane_guest_service_translator::BENCH_REPEAT_LABEL.into(), repeat.to_compact_string());
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

/// The store of a bench-only build of the default translator: WASI granting nothing, as the
/// runtime's.
struct BenchGuestState {
    wasi: wasmtime_wasi::WasiCtx,
    table: wasmtime::component::ResourceTable,
}

impl wasmtime_wasi::WasiView for BenchGuestState {
    fn ctx(&mut self) -> wasmtime_wasi::WasiCtxView<'_> {
        wasmtime_wasi::WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// A bench-only build of the default translator (another world than the runtime loads),
/// compiled on an engine of the runtime's configuration (`engine_config`: the same code
/// generation, epoch checks and reservation), with its store and a linker of empty WASI.
fn bench_guest(
    component: &[u8],
) -> (wasmtime::Store<BenchGuestState>, wasmtime::component::Component, wasmtime::component::Linker<BenchGuestState>) {
    let engine = wasmtime::Engine::new(&wasmplane_runtime::engine_config(&Limits::default())).unwrap();
    let component = wasmtime::component::Component::new(&engine, component).unwrap();
    let mut linker = wasmtime::component::Linker::new(&engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).unwrap();
    let state = BenchGuestState { wasi: wasmtime_wasi::WasiCtx::builder().build(), table: Default::default() };
    let mut store = wasmtime::Store::new(&engine, state);
    // Epoch interruption is compiled in (as in the runtime); nothing advances this engine's
    // epoch, so the deadline is never reached.
    store.set_epoch_deadline(1);
    (store, component, linker)
}

/// Per call through one serialized buffer each way (`bench-encoded.wit`).
struct SerializedBoundary {
    /// Model → SDK types, postcard in, the Wasm call (one list lowered, the guest decodes,
    /// translates, encodes; one list lifted), postcard out.
    wasm: Duration,
    /// The same round trip natively: the same conversion, encoding and decoding, no Wasm.
    native: Duration,
    bytes_in: usize,
    bytes_out: usize,
    /// The four codec steps of that round trip apart, natively (totals over all services).
    encode_inputs: Duration,
    decode_inputs: Duration,
    encode_ruleset: Duration,
    decode_ruleset: Duration,
    /// The two decodes again into borrowed mirrors of the types (`borrowed`): strings read
    /// in place, only lists allocated. What a zero-copy reader could approach.
    decode_inputs_borrowed: Duration,
    decode_ruleset_borrowed: Duration,
}

/// The `bench-encoded` build of the default translator, on a [`bench_guest`]. Both sides pay
/// the model → SDK conversion, as in the typed rows.
fn serialized_boundary(sdk_ctx: &sdk::NodeContext, views: &[ServiceView], prefixes: &[String]) -> SerializedBoundary {
    use wasmplane_guest_service_translator::{EncodedInputs, decode_output, encode_inputs, translate_encoded};
    let (mut store, component, linker) =
        bench_guest(wasmplane_guest_artifacts::test_programs::TRANSLATOR_BENCH_ENCODED);
    let guest = encoded::EncodedTranslation::instantiate(&mut store, &component, &linker).unwrap();
    let translator = guest.wasmplane_bench_encoded_translator();
    let encode = |view: &ServiceView, prefix: &String| {
        let (service, slices) = to_sdk(view);
        encode_inputs(sdk_ctx, prefix, &service, &slices)
    };
    let decode = |out: &[u8]| decode_output(out).unwrap().unwrap();

    // Both ends of the buffer agree with the typed translation.
    let (service, slices) = to_sdk(&views[0]);
    let typed = wasmplane_guest_service_translator::translate(sdk_ctx, &prefixes[0], &service, &slices).unwrap();
    let input = encode(&views[0], &prefixes[0]);
    let output = translator.call_translate(&mut store, &input).unwrap();
    assert_eq!(decode(&output), typed, "the serialized guest's ruleset");
    assert_eq!(decode(&translate_encoded(&input)), typed, "the native serialized ruleset");

    let wasm = best_of(3, || {
        for (v, p) in views.iter().zip(prefixes) {
            let output = translator.call_translate(&mut store, &encode(v, p)).unwrap();
            std::hint::black_box(decode(&output));
        }
    });
    let native = best_of(3, || {
        for (v, p) in views.iter().zip(prefixes) {
            std::hint::black_box(decode(&translate_encoded(&encode(v, p))));
        }
    });

    let typed_inputs: Vec<_> = views.iter().map(to_sdk).collect();
    let encoded_inputs: Vec<_> = views.iter().zip(prefixes).map(|(v, p)| encode(v, p)).collect();
    let results: Vec<_> = typed_inputs
        .iter()
        .zip(prefixes)
        .map(|((s, sl), p)| wasmplane_guest_service_translator::translate(sdk_ctx, p, s, sl))
        .collect();
    let encoded_results: Vec<_> = results.iter().map(|r| postcard::to_allocvec(r).unwrap()).collect();
    SerializedBoundary {
        wasm,
        native,
        bytes_in: input.len(),
        bytes_out: output.len(),
        encode_inputs: best_of(3, || {
            for ((service, slices), p) in typed_inputs.iter().zip(prefixes) {
                std::hint::black_box(encode_inputs(sdk_ctx, p, service, slices));
            }
        }),
        decode_inputs: best_of(3, || {
            for input in &encoded_inputs {
                std::hint::black_box(postcard::from_bytes::<EncodedInputs>(input).unwrap());
            }
        }),
        encode_ruleset: best_of(3, || {
            for result in &results {
                std::hint::black_box(postcard::to_allocvec(result).unwrap());
            }
        }),
        decode_ruleset: best_of(3, || {
            for output in &encoded_results {
                std::hint::black_box(decode(output));
            }
        }),
        decode_inputs_borrowed: best_of(3, || {
            for input in &encoded_inputs {
                std::hint::black_box(postcard::from_bytes::<borrowed::Inputs>(input).unwrap());
            }
        }),
        decode_ruleset_borrowed: best_of(3, || {
            for output in &encoded_results {
                let ruleset = postcard::from_bytes::<Result<borrowed::Ruleset, borrowed::GuestError>>(output).unwrap();
                assert!(std::hint::black_box(ruleset).is_ok());
            }
        }),
    }
}

/// Batch sizes the batched boundary is timed at: one service per call (the call shape of
/// today's world, through the same bindings) up to a full sync's worth.
const BATCH_SIZES: [usize; 4] = [1, 16, 256, 4096];

/// The batched boundary against today's typed call and native, timed in interleaved rounds
/// (this VM's speed drifts by 2× within a minute, so only times taken side by side compare).
struct Batched {
    /// Best round: every service through `TranslatorSession::translate`, one per call.
    typed: Duration,
    /// Best round: every service natively (model → SDK types + translate).
    native: Duration,
    /// (services per call, best round) through `batch.wit`: model → WIT types (the node
    /// context once per call), lowering, the guest translating each, the results lifted.
    batched: Vec<(usize, Duration)>,
}

/// On a [`bench_guest`], as the serialized boundary.
fn batched_boundary(
    session: &mut wasmplane_runtime::TranslatorSession,
    ctx: &NodeContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
) -> Batched {
    use batch::exports::wasmplane::bench_batch::batch_translator::ServiceInputs;
    let (mut store, component, linker) = bench_guest(wasmplane_guest_artifacts::test_programs::TRANSLATOR_BENCH_BATCH);
    let guest = batch::BatchTranslation::instantiate(&mut store, &component, &linker).unwrap();
    let translator = guest.wasmplane_bench_batch_batch_translator();
    let inputs = |views: &[ServiceView], prefixes: &[String]| -> Vec<ServiceInputs> {
        views
            .iter()
            .zip(prefixes)
            .map(|(v, p)| ServiceInputs {
                chain_prefix: p.clone(),
                service: convert::service(&v.service),
                slices: convert::slices(v),
            })
            .collect()
    };

    // Every service's ruleset is today's call's, in order.
    let checked = views.len().min(64);
    let results = translator
        .call_translate_batch(&mut store, &convert::node_context(ctx), &inputs(&views[..checked], &prefixes[..checked]))
        .unwrap();
    assert_eq!(results.len(), checked, "one result per service");
    for ((result, view), prefix) in results.into_iter().zip(views).zip(prefixes) {
        assert_eq!(
            result.unwrap(),
            session.translate(ctx, prefix, view).unwrap(),
            "the batched guest's ruleset for {prefix}"
        );
    }

    let sizes: Vec<usize> = BATCH_SIZES.iter().copied().filter(|&size| size <= views.len()).collect();
    let mut result = Batched {
        typed: Duration::MAX,
        native: Duration::MAX,
        batched: sizes.iter().map(|&size| (size, Duration::MAX)).collect(),
    };
    for _round in 0..5 {
        result.typed = result.typed.min(best_of(1, || {
            for (v, p) in views.iter().zip(prefixes) {
                std::hint::black_box(session.translate(ctx, p, v).unwrap());
            }
        }));
        result.native = result.native.min(best_of(1, || {
            for (v, p) in views.iter().zip(prefixes) {
                std::hint::black_box(native::translate(sdk_ctx, p, v).unwrap());
            }
        }));
        for (size, best) in &mut result.batched {
            *best = (*best).min(best_of(1, || {
                for (views, prefixes) in views.chunks(*size).zip(prefixes.chunks(*size)) {
                    let results = translator
                        .call_translate_batch(&mut store, &convert::node_context(ctx), &inputs(views, prefixes))
                        .unwrap();
                    std::hint::black_box(results);
                }
            }));
        }
    }
    result
}

/// One call at a time after 20 ms idle, as one change arrives in the host (the hot loops
/// above keep code and data in the caches): the median and p90 over 100 calls, Wasm
/// (`TranslatorSession::translate`) and native (model → SDK types + translate).
fn isolated_calls(
    session: &mut wasmplane_runtime::TranslatorSession,
    ctx: &NodeContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
) -> Isolated {
    const CALLS: usize = 100;
    let idle = Duration::from_millis(20);
    let (mut wasm, mut native) = (Vec::with_capacity(CALLS), Vec::with_capacity(CALLS));
    for (view, prefix) in views.iter().zip(prefixes).take(CALLS) {
        std::thread::sleep(idle);
        let t = Instant::now();
        std::hint::black_box(session.translate(ctx, prefix, view).unwrap());
        wasm.push(t.elapsed());
        std::thread::sleep(idle);
        let t = Instant::now();
        let (service, slices) = to_sdk(view);
        std::hint::black_box(
            wasmplane_guest_service_translator::translate(sdk_ctx, prefix, &service, &slices).unwrap(),
        );
        native.push(t.elapsed());
    }
    wasm.sort();
    native.sort();
    Isolated {
        wasm_p50: percentile(&wasm, 50),
        wasm_p90: percentile(&wasm, 90),
        native_p50: percentile(&native, 50),
        native_p90: percentile(&native, 90),
    }
}

struct Isolated {
    wasm_p50: Duration,
    wasm_p90: Duration,
    native_p50: Duration,
    native_p90: Duration,
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

/// The `q`th percentile of sorted samples.
fn percentile(sorted: &[Duration], q: usize) -> Duration {
    sorted[(sorted.len() * q / 100).min(sorted.len() - 1)]
}

fn per_call(d: Duration, n: usize) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6 / n as f64)
}

fn main() {
    let bytes: Cow<'static, [u8]> = match std::env::var_os("WASMPLANE_BENCH_GUEST") {
        Some(path) => {
            Cow::Owned(std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.to_string_lossy())))
        }
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
    // The same translator in the typed world: what the breakdown below takes apart.
    let typed_module = runtime
        .load(
            "typed",
            wasmplane_guest_artifacts::test_programs::TRANSLATOR_TYPED,
            Some(GuestKind::ServiceTranslator),
            usize::MAX,
        )
        .unwrap();
    let instantiate = best_of(50, || {
        let mut s = module.translator(Arc::new(NoLookups)).unwrap();
        s.instantiate_now().unwrap();
        s
    });
    println!("| instantiate (pooling allocator) | {:.1} µs |", instantiate.as_secs_f64() * 1e6);

    let ctx = NodeContext {
        node_name: "node-0".into(),
        node_ips: vec!["192.168.0.1".into()],
        cluster_cidrs: vec!["10.244.0.0/16".into()],
        pod_cidrs: vec![],
        zone: None,
    };
    let sdk_ctx = native::node_context(&ctx);
    let mut breakdown = Vec::new();
    println!(
        "\n| services | Wasm total | Wasm per call | native total | native per call | Wasm/native | the typed world's call | typed/native |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &n in &sizes {
        let views = synthetic(n);
        let prefixes: Vec<String> =
            views.iter().map(|v| format!("svc/{}/{}", v.service.namespace, v.service.name)).collect();
        let mut shipped = module.translator(Arc::new(NoLookups)).unwrap();
        shipped.instantiate_now().unwrap();
        let mut session = typed_module.translator(Arc::new(NoLookups)).unwrap();
        session.instantiate_now().unwrap();
        let wasm = best_of(3, || {
            for (v, p) in views.iter().zip(&prefixes) {
                std::hint::black_box(shipped.translate_output(&ctx, p, v).unwrap());
            }
        });
        let typed = best_of(3, || {
            for (v, p) in views.iter().zip(&prefixes) {
                std::hint::black_box(session.translate(&ctx, p, v).unwrap());
            }
        });
        let native = best_of(3, || {
            for (view, p) in views.iter().zip(&prefixes) {
                // The same model → SDK-type conversion the Wasm side makes (model → WIT).
                std::hint::black_box(native::translate(&sdk_ctx, p, view).unwrap());
            }
        });
        println!(
            "| {n} | {:.1} ms | {} | {:.1} ms | {} | {:.2}× | {} | {:.2}× |",
            wasm.as_secs_f64() * 1e3,
            per_call(wasm, n),
            native.as_secs_f64() * 1e3,
            per_call(native, n),
            wasm.as_secs_f64() / native.as_secs_f64(),
            per_call(typed, n),
            typed.as_secs_f64() / native.as_secs_f64()
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
        let with_slices =
            inputs.iter().map(|(s, sl)| lowered_allocations(&wit_ctx, s, sl)).sum::<usize>() as f64 / n as f64;
        let without = empty.iter().map(|s| lowered_allocations(&wit_ctx, s, &[])).sum::<usize>() as f64 / n as f64;
        let (work_wasm, work_native) = guest_work(&runtime, &ctx, &sdk_ctx, &views, &prefixes);
        let serialized = serialized_boundary(&sdk_ctx, &views, &prefixes);
        let isolated = isolated_calls(&mut session, &ctx, &sdk_ctx, &views, &prefixes);
        let batched = batched_boundary(&mut session, &ctx, &sdk_ctx, &views, &prefixes);
        let archived = archived::archived_boundary(&mut session, &mut shipped, &ctx, &sdk_ctx, &views, &prefixes);
        breakdown.push(Breakdown {
            n,
            wasm,
            native,
            convert,
            boundary,
            call,
            ruleset_clone: output.saturating_sub(native),
            with_slices,
            without,
            work_wasm,
            work_native,
            serialized,
            isolated,
            batched,
            archived,
        });
    }
    println!(
        "\n| services | model → WIT | lowering the inputs + call + empty result (ExternalName) | fixed cost of a call (ExternalName, no slices) | native clone of the ruleset (≈ lifting it) |"
    );
    println!("|---|---|---|---|---|");
    for b in &breakdown {
        let n = b.n;
        println!(
            "| {n} | {} | {} | {} | {} |",
            per_call(b.convert, n),
            per_call(b.boundary, n),
            per_call(b.call, n),
            per_call(b.ruleset_clone, n)
        );
    }
    // The two ExternalName runs differ only in the slices, so their difference over the
    // difference in lowerings is what one lowered string or list costs (the host's copy, the
    // call into the guest's allocator, the guest's bindings taking it over and freeing it).
    // What is left of the fixed cost is entering and leaving the guest.
    println!(
        "\n| services | guest allocations per call: with slices / without | one lowered string or list | the call itself (fixed cost less its lowerings) | native call, in lowered strings or lists |"
    );
    println!("|---|---|---|---|---|");
    for b in &breakdown {
        let per_call_us = |d: Duration| d.as_secs_f64() * 1e6 / b.n as f64;
        let per_allocation = (per_call_us(b.boundary) - per_call_us(b.call)) / (b.with_slices - b.without);
        println!(
            "| {} | {:.0} / {:.0} | {:.0} ns | {:.2} µs | {:.0} |",
            b.n,
            b.with_slices,
            b.without,
            per_allocation * 1e3,
            per_call_us(b.call) - b.without * per_allocation,
            per_call_us(b.native) / per_allocation
        );
    }
    // What no interface can remove: the translation itself, compiled to Wasm vs natively.
    println!("\n| services | guest's own work per translation, Wasm (no boundary) | native | Wasm/native |");
    println!("|---|---|---|---|");
    for b in &breakdown {
        println!(
            "| {} | {:.2} µs | {:.2} µs | {:.2}× |",
            b.n,
            b.work_wasm.as_secs_f64() * 1e6,
            b.work_native.as_secs_f64() * 1e6,
            b.work_wasm.as_secs_f64() / b.work_native.as_secs_f64()
        );
    }
    // The same translation behind one serialized buffer each way (a WIT 2.0 of that shape),
    // against the typed call and the native call of the first table.
    println!(
        "\n| services | buffer in / out | typed Wasm per call | serialized Wasm per call | serialized, natively | native per call | serialized Wasm/native |"
    );
    println!("|---|---|---|---|---|---|---|");
    for b in &breakdown {
        let s = &b.serialized;
        println!(
            "| {} | {} / {} B | {} | {} | {} | {} | {:.2}× |",
            b.n,
            s.bytes_in,
            s.bytes_out,
            per_call(b.wasm, b.n),
            per_call(s.wasm, b.n),
            per_call(s.native, b.n),
            per_call(b.native, b.n),
            s.wasm.as_secs_f64() / b.native.as_secs_f64()
        );
    }
    // Many services per call, typed (a WIT 2.0 of that shape): what batching saves of the
    // boundary, against today's call and native timed in the same rounds. One service per
    // call is today's call shape without the runtime's per-call work (deadline, output
    // limits).
    println!(
        "\n| services | today's call (interleaved) | native (interleaved) | services per call | batched, per service | batched/native | batched/today's |"
    );
    println!("|---|---|---|---|---|---|---|");
    for b in &breakdown {
        let batched = &b.batched;
        for &(size, total) in &batched.batched {
            println!(
                "| {} | {} | {} | {size} | {} | {:.2}× | {:.2} |",
                b.n,
                per_call(batched.typed, b.n),
                per_call(batched.native, b.n),
                per_call(total, b.n),
                total.as_secs_f64() / batched.native.as_secs_f64(),
                total.as_secs_f64() / batched.typed.as_secs_f64()
            );
        }
    }
    // What one change in the host pays: a single call with cold caches.
    println!("\n| services | one call after 20 ms idle, Wasm: p50 / p90 | native: p50 / p90 | Wasm/native (p50) |");
    println!("|---|---|---|---|");
    for b in &breakdown {
        let i = &b.isolated;
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "| {} | {:.1} / {:.1} µs | {:.1} / {:.1} µs | {:.2}× |",
            b.n,
            us(i.wasm_p50),
            us(i.wasm_p90),
            us(i.native_p50),
            us(i.native_p90),
            i.wasm_p50.as_secs_f64() / i.native_p50.as_secs_f64()
        );
    }
    // Where the serialized round trip's time goes, and what reading both buffers in place
    // (borrowed strings) would leave: the serialized Wasm call with its two decodes replaced
    // by the borrowed ones (the guest's code runs at native speed, table above).
    println!(
        "\n| services | natively: encode inputs | decode inputs (borrowed) | encode ruleset | decode ruleset (borrowed) | serialized Wasm, both buffers read in place (estimate) | estimate/native |"
    );
    println!("|---|---|---|---|---|---|---|");
    for b in &breakdown {
        let s = &b.serialized;
        let in_place =
            s.wasm + s.decode_inputs_borrowed + s.decode_ruleset_borrowed - s.decode_inputs - s.decode_ruleset;
        println!(
            "| {} | {} | {} ({}) | {} | {} ({}) | {} | {:.2}× |",
            b.n,
            per_call(s.encode_inputs, b.n),
            per_call(s.decode_inputs, b.n),
            per_call(s.decode_inputs_borrowed, b.n),
            per_call(s.encode_ruleset, b.n),
            per_call(s.decode_ruleset, b.n),
            per_call(s.decode_ruleset_borrowed, b.n),
            per_call(in_place, b.n),
            in_place.as_secs_f64() / b.native.as_secs_f64()
        );
    }
    // The archived world (shipped): the estimate above, measured. Its native side runs the
    // same translation on the same archive; the next columns hold it against today's native
    // translator instead.
    println!(
        "\n| services | archive in / out | the typed call (interleaved) | native (interleaved) | model → archive | checking the result | fixed cost of a call (ExternalName) | archived, natively | the same round trip natively | archived Wasm | archived Wasm / archived native | archived Wasm / today's native | archived Wasm into the typed ruleset | the same / today's native |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for b in &breakdown {
        let f = &b.archived;
        println!(
            "| {} | {} / {} B | {} | {} | {} | {} | {} | {} | {} | {} | {:.2}× | {:.2}× | {} | {:.2}× |",
            b.n,
            f.bytes_in,
            f.bytes_out,
            per_call(f.as_data.typed, b.n),
            per_call(f.as_data.native, b.n),
            per_call(f.encode, b.n),
            per_call(f.check, b.n),
            per_call(f.empty_call, b.n),
            per_call(f.as_data.archived_native, b.n),
            per_call(f.round_trip_native, b.n),
            per_call(f.as_data.archived_wasm, b.n),
            f.as_data.archived_wasm.as_secs_f64() / f.as_data.archived_native.as_secs_f64(),
            f.as_data.archived_wasm.as_secs_f64() / f.as_data.native.as_secs_f64(),
            per_call(f.as_data.archived_wasm_typed, b.n),
            f.as_data.archived_wasm_typed.as_secs_f64() / f.as_data.native.as_secs_f64()
        );
    }
    println!(
        "\n| services, as LoadBalancers with externalTrafficPolicy Local (three chains a port) | the typed call | native | archived, natively | archived Wasm | typed call / native | archived Wasm / today's native | archived Wasm into the typed ruleset | the same / today's native |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for b in &breakdown {
        let c = &b.archived.chains;
        println!(
            "| {} | {} | {} | {} | {} | {:.2}× | {:.2}× | {} | {:.2}× |",
            b.n,
            per_call(c.typed, b.n),
            per_call(c.native, b.n),
            per_call(c.archived_native, b.n),
            per_call(c.archived_wasm, b.n),
            c.typed.as_secs_f64() / c.native.as_secs_f64(),
            c.archived_wasm.as_secs_f64() / c.native.as_secs_f64(),
            per_call(c.archived_wasm_typed, b.n),
            c.archived_wasm_typed.as_secs_f64() / c.native.as_secs_f64()
        );
    }
    // Up to the rules the host hands its dataplane: each way's translation, then the host's
    // validation of its result (native has no validation of its own: a native host would
    // validate the typed ruleset it returns, as for the typed call).
    println!(
        "\n| services: translation + validation | validating a typed ruleset | validating an archive | the typed call + validation | native + validation of its typed ruleset | archived Wasm + validation | typed / native | archived / native |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for b in &breakdown {
        for (path, t) in [("as data", &b.archived.as_data), ("three chains a port", &b.archived.chains)] {
            let typed = t.typed + t.validate_typed;
            let native = t.native + t.validate_typed;
            let archived = t.archived_wasm + t.validate_archived;
            println!(
                "| {} ({path}) | {} | {} | {} | {} | {} | {:.2}× | {:.2}× |",
                b.n,
                per_call(t.validate_typed, b.n),
                per_call(t.validate_archived, b.n),
                per_call(typed, b.n),
                per_call(native, b.n),
                per_call(archived, b.n),
                typed.as_secs_f64() / native.as_secs_f64(),
                archived.as_secs_f64() / native.as_secs_f64()
            );
        }
    }
    println!(
        "\n| services | one archived Wasm call after 20 ms idle: p50 / p90 | the typed call, the same (table above) | today's native, the same |"
    );
    println!("|---|---|---|---|");
    for b in &breakdown {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "| {} | {:.1} / {:.1} µs | {:.1} / {:.1} µs | {:.1} / {:.1} µs |",
            b.n,
            us(b.archived.isolated_p50),
            us(b.archived.isolated_p90),
            us(b.isolated.wasm_p50),
            us(b.isolated.wasm_p90),
            us(b.isolated.native_p50),
            us(b.isolated.native_p90)
        );
    }
}

/// Per service count, where a call's time goes (per-call times are totals over `n` calls).
struct Breakdown {
    n: usize,
    wasm: Duration,
    native: Duration,
    convert: Duration,
    /// Lowering the inputs + the call + an empty result (ExternalName).
    boundary: Duration,
    /// ExternalName without slices: the fixed cost of a call.
    call: Duration,
    /// A native clone of the ruleset (≈ lifting it).
    ruleset_clone: Duration,
    /// Guest allocations per call with slices / without.
    with_slices: f64,
    without: f64,
    /// The guest's own work per translation (not a total).
    work_wasm: Duration,
    work_native: Duration,
    serialized: SerializedBoundary,
    isolated: Isolated,
    batched: Batched,
    archived: archived::ArchivedBoundary,
}

/// Borrowed mirrors of the SDK's types, field for field and variant for variant (postcard
/// encodes by position): the same buffers decoded with every string read in place. Only the
/// serialized-boundary estimate uses them.
mod borrowed {
    // Decoded only, to time the decoding: nothing reads a field.
    #![allow(dead_code)]
    use serde::Deserialize;
    use wasmplane_sdk::types::{AddressFamily, Protocol, ServiceType, TrafficPolicy};

    pub type Inputs<'a> = (NodeContext<'a>, &'a str, Service<'a>, Vec<EndpointSlice<'a>>);

    #[derive(Deserialize)]
    pub struct NodeContext<'a> {
        pub node_name: &'a str,
        #[serde(borrow)]
        pub node_ips: Vec<&'a str>,
        #[serde(borrow)]
        pub cluster_cidrs: Vec<&'a str>,
        #[serde(borrow)]
        pub pod_cidrs: Vec<&'a str>,
    }

    #[derive(Deserialize)]
    pub struct Label<'a> {
        pub key: &'a str,
        pub value: &'a str,
    }

    #[derive(Deserialize)]
    pub enum TargetPort<'a> {
        Number(u16),
        Name(&'a str),
    }

    #[derive(Deserialize)]
    pub struct ServicePort<'a> {
        pub name: &'a str,
        pub protocol: Protocol,
        pub port: u16,
        pub node_port: u16,
        #[serde(borrow)]
        pub target_port: TargetPort<'a>,
    }

    #[derive(Deserialize)]
    pub struct Service<'a> {
        pub namespace: &'a str,
        pub name: &'a str,
        pub service_type: ServiceType,
        #[serde(borrow)]
        pub cluster_ips: Vec<&'a str>,
        #[serde(borrow)]
        pub external_ips: Vec<&'a str>,
        #[serde(borrow)]
        pub load_balancer_ips: Vec<&'a str>,
        #[serde(borrow)]
        pub ports: Vec<ServicePort<'a>>,
        pub session_affinity_timeout: Option<u32>,
        pub external_traffic_policy: TrafficPolicy,
        pub internal_traffic_policy: TrafficPolicy,
        #[serde(borrow)]
        pub labels: Vec<Label<'a>>,
    }

    #[derive(Deserialize)]
    pub struct Endpoint<'a> {
        #[serde(borrow)]
        pub addresses: Vec<&'a str>,
        pub ready: bool,
        pub serving: bool,
        pub terminating: bool,
        pub node_name: Option<&'a str>,
        pub zone: Option<&'a str>,
        pub is_local: bool,
    }

    #[derive(Deserialize)]
    pub struct EndpointPort<'a> {
        pub name: &'a str,
        pub protocol: Protocol,
        pub port: u16,
    }

    #[derive(Deserialize)]
    pub struct EndpointSlice<'a> {
        pub name: &'a str,
        #[serde(borrow)]
        pub endpoints: Vec<Endpoint<'a>>,
        #[serde(borrow)]
        pub ports: Vec<EndpointPort<'a>>,
    }

    #[derive(Deserialize)]
    pub struct AddressMatch<'a> {
        pub cidr: &'a str,
        pub negate: bool,
    }

    #[derive(Deserialize)]
    pub enum RuleMatch<'a> {
        Source(#[serde(borrow)] AddressMatch<'a>),
        Destination(#[serde(borrow)] AddressMatch<'a>),
        Protocol(Protocol),
        DestinationPort(u16),
        DestinationPortRange((u16, u16)),
        SourceInSet(&'a str),
        DestinationInSet(&'a str),
        DestinationIsLocal,
        ConnectionEstablished,
        Random((u32, u32)),
    }

    #[derive(Deserialize)]
    pub struct DnatTarget<'a> {
        pub address: &'a str,
        pub port: u16,
    }

    #[derive(Deserialize)]
    pub struct SetUpdate<'a> {
        pub set: &'a str,
        pub timeout_seconds: Option<u32>,
    }

    #[derive(Deserialize)]
    pub enum RuleStatement<'a> {
        Counter,
        Dnat(#[serde(borrow)] DnatTarget<'a>),
        AddSourceToSet(#[serde(borrow)] SetUpdate<'a>),
        Log(&'a str),
    }

    #[derive(Deserialize)]
    pub enum Verdict<'a> {
        None,
        Accept,
        Drop,
        Reject,
        Jump(&'a str),
        Goto(&'a str),
        Return,
        Masquerade,
    }

    #[derive(Deserialize)]
    pub struct Rule<'a> {
        #[serde(borrow)]
        pub matches: Vec<RuleMatch<'a>>,
        #[serde(borrow)]
        pub statements: Vec<RuleStatement<'a>>,
        #[serde(borrow)]
        pub verdict: Verdict<'a>,
        pub comment: Option<&'a str>,
    }

    #[derive(Deserialize)]
    pub struct Chain<'a> {
        pub name: &'a str,
        #[serde(borrow)]
        pub rules: Vec<Rule<'a>>,
    }

    #[derive(Deserialize)]
    pub struct SetDeclaration<'a> {
        pub name: &'a str,
        pub family: AddressFamily,
        pub timeout_seconds: Option<u32>,
        #[serde(borrow)]
        pub elements: Vec<&'a str>,
    }

    #[derive(Deserialize)]
    pub enum KeyPart<'a> {
        Address(&'a str),
        Protocol(Protocol),
        Port(u16),
    }

    #[derive(Deserialize)]
    pub struct MapElement<'a> {
        pub map_name: &'a str,
        #[serde(borrow)]
        pub key: Vec<KeyPart<'a>>,
        #[serde(borrow)]
        pub verdict: Verdict<'a>,
    }

    #[derive(Deserialize)]
    pub struct Ruleset<'a> {
        #[serde(borrow)]
        pub chains: Vec<Chain<'a>>,
        #[serde(borrow)]
        pub sets: Vec<SetDeclaration<'a>>,
        #[serde(borrow)]
        pub map_elements: Vec<MapElement<'a>>,
        #[serde(borrow)]
        pub warnings: Vec<&'a str>,
    }

    #[derive(Deserialize)]
    pub struct GuestError<'a> {
        pub message: &'a str,
    }
}
