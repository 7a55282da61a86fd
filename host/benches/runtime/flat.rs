//! The zero-copy boundary prototype (`bench-flat` build of the default translator,
//! `guests/service-translator/src/flat.rs`): the inputs archived straight from the model, read
//! in place by the guest; the result archived by the guest, validated and read in place by
//! the host. Native runs the same translation on the same archive, so the two differ by the
//! boundary alone. Timed in interleaved rounds beside today's typed call and native translator.

use std::net::IpAddr;
use std::time::Duration;

use wasmplane_guest_service_translator::flat;
use wasmplane_model as m;
use wasmplane_model::state::{NodeContext, ServiceView};
use wasmplane_runtime::native;
use wasmplane_sdk::types as sdk;

use super::{bench_guest, best_of, percentile};

mod bindings {
    wasmtime::component::bindgen!({ path: "../guests/service-translator/bench-flat.wit", world: "flat-translation" });
}

/// Best rounds over every service (totals), and the sizes of one service's archives.
pub struct FlatBoundary {
    /// The services of the bench's cluster (load balancing as data).
    pub as_data: PathTimes,
    /// The parts apart: model → archive, and validating a result archive.
    pub encode: Duration,
    pub validate: Duration,
    /// Natively, the whole round trip but the Wasm: model → archive, translation, the result
    /// archived and validated.
    pub round_trip_native: Duration,
    /// The Wasm call for an ExternalName service (the guest returns an empty result at once),
    /// its archive made beforehand: the fixed cost of a call.
    pub empty_call: Duration,
    pub bytes_in: usize,
    pub bytes_out: usize,
    /// One zero-copy Wasm call at a time after 20 ms idle, as one change makes it: p50, p90.
    pub isolated_p50: Duration,
    pub isolated_p90: Duration,
    /// The same services as LoadBalancers with externalTrafficPolicy Local: every port with
    /// chains of its own (three), the path the rest of the table does not take.
    pub chains: PathTimes,
}

/// Best interleaved rounds of one set of services, translated the four ways (totals).
pub struct PathTimes {
    /// Today's call: `TranslatorSession::translate` (model → WIT, typed boundary).
    pub typed: Duration,
    /// Today's native reference: model → SDK types + `translate`.
    pub native: Duration,
    /// Model → archive, then `flat::translate` on it in place, natively.
    pub flat_native: Duration,
    /// Model → archive, the Wasm call (one list each way), the result validated in place.
    pub flat_wasm: Duration,
}

type Store = wasmtime::Store<super::BenchGuestState>;
type Translator = bindings::exports::wasmplane::bench_flat::flat_translator::Guest;

fn address(text: &str) -> IpAddr {
    text.parse().unwrap_or_else(|e| panic!("the bench's address {text:?}: {e}"))
}

/// Headless markers are no address: such a service has no cluster IP in the archive.
fn addresses(list: &[m::CompactString]) -> Vec<IpAddr> {
    list.iter().filter(|ip| !ip.is_empty() && ip.as_str() != "None").map(|ip| address(ip)).collect()
}

fn nets(list: &[m::CompactString]) -> Vec<flat::Net> {
    list.iter()
        .map(|cidr| {
            let (ip, len) = cidr.split_once('/').unwrap_or_else(|| panic!("the bench's CIDR {cidr:?}"));
            flat::Net { address: address(ip), prefix_len: len.parse().unwrap() }
        })
        .collect()
}

fn protocol(p: m::Protocol) -> flat::Protocol {
    match p {
        m::Protocol::Tcp => flat::Protocol::Tcp,
        m::Protocol::Udp => flat::Protocol::Udp,
        m::Protocol::Sctp => flat::Protocol::Sctp,
    }
}

/// Model → archive: strings borrowed from the model, addresses parsed to integers.
pub fn encode(ctx: &NodeContext, prefix: &str, view: &ServiceView) -> Vec<u8> {
    let s = &view.service;
    let inputs = flat::Inputs {
        node: flat::NodeContext {
            node_name: &ctx.node_name,
            node_ips: addresses(&ctx.node_ips),
            cluster_cidrs: nets(&ctx.cluster_cidrs),
            pod_cidrs: nets(&ctx.pod_cidrs),
        },
        chain_prefix: prefix,
        service: flat::Service {
            namespace: &s.namespace,
            name: &s.name,
            service_type: match s.service_type {
                m::ServiceType::ClusterIP => flat::ServiceType::ClusterIp,
                m::ServiceType::NodePort => flat::ServiceType::NodePort,
                m::ServiceType::LoadBalancer => flat::ServiceType::LoadBalancer,
                m::ServiceType::ExternalName => flat::ServiceType::ExternalName,
            },
            cluster_ips: addresses(&s.cluster_ips),
            external_ips: addresses(&s.external_ips),
            load_balancer_ips: addresses(&s.load_balancer_ips),
            ports: s
                .ports
                .iter()
                .map(|p| flat::ServicePort {
                    name: &p.name,
                    protocol: protocol(p.protocol),
                    port: p.port,
                    node_port: p.node_port,
                    target_port: match &p.target_port {
                        m::TargetPort::Number(n) => flat::TargetPort::Number(*n),
                        m::TargetPort::Name(n) => flat::TargetPort::Name(n),
                    },
                })
                .collect(),
            session_affinity_timeout: s.session_affinity_timeout,
            external_traffic_local: s.external_traffic_policy == m::TrafficPolicy::Local,
            internal_traffic_local: s.internal_traffic_policy == m::TrafficPolicy::Local,
            labels: s.labels.iter().map(|(key, value)| flat::Label { key, value }).collect(),
        },
        slices: view
            .slices
            .iter()
            .map(|slice| flat::Slice {
                name: &slice.name,
                endpoints: slice
                    .endpoints
                    .iter()
                    .map(|e| flat::Endpoint {
                        addresses: addresses(&e.addresses),
                        ready: e.ready,
                        serving: e.serving,
                        terminating: e.terminating,
                        node_name: e.node_name.as_deref(),
                        zone: e.zone.as_deref(),
                        is_local: e.is_local,
                    })
                    .collect(),
                ports: slice
                    .ports
                    .iter()
                    .map(|p| flat::EndpointPort { name: &p.name, protocol: protocol(p.protocol), port: p.port })
                    .collect(),
            })
            .collect(),
    };
    flat::encode_inputs(&inputs, Vec::with_capacity(512))
}

pub fn flat_boundary(
    session: &mut wasmplane_runtime::TranslatorSession,
    ctx: &NodeContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
) -> FlatBoundary {
    let (mut store, component, linker) = bench_guest(wasmplane_guest_artifacts::test_programs::TRANSLATOR_BENCH_FLAT);
    let guest = bindings::FlatTranslation::instantiate(&mut store, &component, &linker).unwrap();
    let translator = guest.wasmplane_bench_flat_flat_translator();

    let sizes = check_every_service(&mut store, translator, ctx, sdk_ctx, views, prefixes);

    let unmeasured = || PathTimes {
        typed: Duration::MAX,
        native: Duration::MAX,
        flat_native: Duration::MAX,
        flat_wasm: Duration::MAX,
    };
    let mut result = FlatBoundary {
        as_data: unmeasured(),
        encode: Duration::MAX,
        validate: Duration::MAX,
        round_trip_native: Duration::MAX,
        empty_call: Duration::MAX,
        bytes_in: sizes.0,
        bytes_out: sizes.1,
        isolated_p50: Duration::MAX,
        isolated_p90: Duration::MAX,
        chains: unmeasured(),
    };
    let outputs: Vec<Vec<u8>> = views
        .iter()
        .zip(prefixes)
        .map(|(v, p)| translator.call_translate(&mut store, &encode(ctx, p, v)).unwrap())
        .collect();
    let external_name: Vec<Vec<u8>> = views
        .iter()
        .zip(prefixes)
        .map(|(v, p)| {
            let mut service = (*v.service).clone();
            service.service_type = m::ServiceType::ExternalName;
            encode(ctx, p, &ServiceView { service: service.into(), slices: v.slices.clone() })
        })
        .collect();
    // The parts apart, in the same rounds as the four ways.
    let mut parts = (Duration::MAX, Duration::MAX, Duration::MAX, Duration::MAX);
    let as_data = time_paths(session, &mut store, translator, ctx, sdk_ctx, views, prefixes, |store| {
        let min = |best: &mut Duration, d: Duration| *best = (*best).min(d);
        let (round_trip_native, empty_call, encoded, validate) = &mut parts;
        min(
            round_trip_native,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    // SAFETY: `encode` made the archive.
                    let output = unsafe { flat::translate_archive(&encode(ctx, p, v)) };
                    assert!(std::hint::black_box(flat::validate_result(&output).unwrap()).is_ok());
                }
            }),
        );
        min(
            empty_call,
            best_of(1, || {
                for input in &external_name {
                    let output = translator.call_translate(&mut *store, input).unwrap();
                    assert!(std::hint::black_box(flat::validate_result(&output).unwrap()).is_ok());
                }
            }),
        );
        min(
            encoded,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    std::hint::black_box(encode(ctx, p, v));
                }
            }),
        );
        min(
            validate,
            best_of(1, || {
                for output in &outputs {
                    std::hint::black_box(flat::validate_result(output).unwrap());
                }
            }),
        );
    });
    result.as_data = as_data;
    (result.round_trip_native, result.empty_call, result.encode, result.validate) = parts;
    // As `isolated_calls` times today's call and native.
    let mut isolated: Vec<Duration> = views
        .iter()
        .zip(prefixes)
        .take(100)
        .map(|(v, p)| {
            std::thread::sleep(Duration::from_millis(20));
            let t = std::time::Instant::now();
            let output = translator.call_translate(&mut store, &encode(ctx, p, v)).unwrap();
            assert!(std::hint::black_box(flat::validate_result(&output).unwrap()).is_ok());
            t.elapsed()
        })
        .collect();
    isolated.sort();
    result.isolated_p50 = percentile(&isolated, 50);
    result.isolated_p90 = percentile(&isolated, 90);

    let in_chains = chain_views(views);
    check_every_service(&mut store, translator, ctx, sdk_ctx, &in_chains, prefixes);
    result.chains = time_paths(session, &mut store, translator, ctx, sdk_ctx, &in_chains, prefixes, |_| ());
    result
}

/// Every service: the guest's archive holds what native computes on the same archive, and
/// that is the typed translator's ruleset. The sizes of the last one's archives.
fn check_every_service(
    store: &mut Store,
    translator: &Translator,
    ctx: &NodeContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
) -> (usize, usize) {
    let mut sizes = (0, 0);
    for (view, prefix) in views.iter().zip(prefixes) {
        let input = encode(ctx, prefix, view);
        // SAFETY: `encode` made the archive.
        let inputs = unsafe { flat::inputs_in_place(&input) };
        let on_archive = flat::translate(inputs).unwrap();
        let output = translator.call_translate(&mut *store, &input).unwrap();
        let archived = flat::validate_result(&output).unwrap();
        let from_guest: Result<flat::Ruleset, String> = rkyv::deserialize::<_, rkyv::rancor::Error>(archived).unwrap();
        assert_eq!(from_guest.as_ref(), Ok(&on_archive), "the flat guest's ruleset for {prefix}");
        let typed_ruleset = native::translate(sdk_ctx, prefix, view).unwrap();
        assert_eq!(flat::typed(&on_archive, inputs), flat::canonical(typed_ruleset), "the flat ruleset for {prefix}");
        sizes = (input.len(), output.len());
    }
    sizes
}

/// The services as LoadBalancers with externalTrafficPolicy Local, an address of their
/// first family and a node port on every port: each port then has a service, an external and
/// a local chain.
fn chain_views(views: &[ServiceView]) -> Vec<ServiceView> {
    (views.iter().enumerate())
        .map(|(i, view)| {
            let mut service = (*view.service).clone();
            let v6 = service.cluster_ips.first().is_some_and(|ip| ip.contains(':'));
            service.service_type = m::ServiceType::LoadBalancer;
            service.load_balancer_ips = vec![if v6 { "2001:db8::7" } else { "203.0.113.7" }.into()];
            service.external_traffic_policy = m::TrafficPolicy::Local;
            for (j, port) in service.ports.iter_mut().enumerate() {
                port.node_port = 30000 + ((i * 4 + j) % 2000) as u16;
            }
            ServiceView { service: service.into(), slices: view.slices.clone() }
        })
        .collect()
}

/// Today's call, today's native translator, the zero-copy translation natively and through
/// Wasm, over `views`, in interleaved rounds; `also` times more in each round.
#[allow(clippy::too_many_arguments)]
fn time_paths(
    session: &mut wasmplane_runtime::TranslatorSession,
    store: &mut Store,
    translator: &Translator,
    ctx: &NodeContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
    mut also: impl FnMut(&mut Store),
) -> PathTimes {
    let mut times =
        PathTimes { typed: Duration::MAX, native: Duration::MAX, flat_native: Duration::MAX, flat_wasm: Duration::MAX };
    for _round in 0..5 {
        let min = |best: &mut Duration, d: Duration| *best = (*best).min(d);
        min(
            &mut times.typed,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    std::hint::black_box(session.translate(ctx, p, v).unwrap());
                }
            }),
        );
        min(
            &mut times.native,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    std::hint::black_box(native::translate(sdk_ctx, p, v).unwrap());
                }
            }),
        );
        min(
            &mut times.flat_native,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    let input = encode(ctx, p, v);
                    // SAFETY: `encode` made the archive.
                    std::hint::black_box(unsafe { flat::translate(flat::inputs_in_place(&input)) }.unwrap());
                }
            }),
        );
        min(
            &mut times.flat_wasm,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    let output = translator.call_translate(&mut *store, &encode(ctx, p, v)).unwrap();
                    assert!(std::hint::black_box(flat::validate_result(&output).unwrap()).is_ok());
                }
            }),
        );
        also(store);
    }
    times
}
