//! The archived boundary (`archived-service-translation`, package 1.2.0; the shipped default
//! translator): the inputs archived straight from the model, read in place by the guest; the
//! result archived by the guest, checked and read in place by the host. Native runs the same
//! translation on the same archive, so the two differ by the boundary alone. Timed in
//! interleaved rounds beside the typed world's call of the same translator and today's native
//! translator, and then with the host's validation after each (what a service's change
//! costs up to the rules it hands the dataplane).

use std::time::Duration;

use wasmplane::nft;
use wasmplane_guest_service_translator::archived;
use wasmplane_model as m;
use wasmplane_model::ObjectKey;
use wasmplane_model::state::{NodeContext, ServiceView};
use wasmplane_runtime::archived::ParsedContext;
use wasmplane_runtime::{Translated, TranslatorSession, native};
use wasmplane_sdk::types as sdk;

use super::{best_of, percentile};

/// Best rounds over every service (totals), and the sizes of one service's archives.
pub struct ArchivedBoundary {
    /// The services of the bench's cluster (load balancing as data).
    pub as_data: PathTimes,
    /// The parts apart: model → archive, and checking a result archive.
    pub encode: Duration,
    pub check: Duration,
    /// Natively, the whole round trip but the Wasm: model → archive, translation, the result
    /// archived and checked.
    pub round_trip_native: Duration,
    /// The Wasm call for an ExternalName service (the guest returns an empty result at once):
    /// the fixed cost of a call.
    pub empty_call: Duration,
    pub bytes_in: usize,
    pub bytes_out: usize,
    /// One archived Wasm call at a time after 20 ms idle, as one change makes it: p50, p90.
    pub isolated_p50: Duration,
    pub isolated_p90: Duration,
    /// The same services as LoadBalancers with externalTrafficPolicy Local: every port with
    /// chains of its own (three), the path the rest of the table does not take.
    pub chains: PathTimes,
}

/// Best interleaved rounds of one set of services, translated each way (totals).
pub struct PathTimes {
    /// The typed world's call of the same translator (`TRANSLATOR_TYPED`; model → WIT).
    pub typed: Duration,
    /// Today's native reference: model → SDK types + `translate`.
    pub native: Duration,
    /// Model → archive, then `archived::translate` on it in place, natively.
    pub archived_native: Duration,
    /// The shipped call: `translate_output` (model → archive, the Wasm call, the result checked).
    pub archived_wasm: Duration,
    /// `archived_wasm`, then the result in the typed world's terms (`translate`: names made,
    /// addresses as text), as a caller that reads typed rulesets gets it.
    pub archived_wasm_typed: Duration,
    /// The host's validation of every service's result into the rules it writes, from the
    /// typed world's ruleset (`nft::validate_service_output`) and from the archive
    /// (`nft::validate_archived_service_output`).
    pub validate_typed: Duration,
    pub validate_archived: Duration,
}

fn key_of(prefix: &str) -> ObjectKey {
    let mut parts = prefix.trim_start_matches("svc/").splitn(2, '/');
    ObjectKey::new(parts.next().unwrap(), parts.next().unwrap())
}

fn pods() -> nft::PodDetection<'static> {
    static TRAFFIC: std::sync::LazyLock<nft::PodTraffic> = std::sync::LazyLock::new(nft::PodTraffic::default);
    nft::PodDetection::new(&TRAFFIC, &[])
}

pub fn archived_boundary(
    typed: &mut TranslatorSession,
    shipped: &mut TranslatorSession,
    ctx: &NodeContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
) -> ArchivedBoundary {
    let parsed = ParsedContext::new(ctx);
    let sizes = check_every_service(typed, shipped, ctx, &parsed, sdk_ctx, views, prefixes);
    let results: Vec<Vec<u8>> = views
        .iter()
        .zip(prefixes)
        .map(|(v, p)| {
            let input = encode(&parsed, p, v);
            // SAFETY: `encode` made the archive.
            unsafe { archived::translate_archive(&input) }
        })
        .collect();
    let external_name: Vec<ServiceView> = views
        .iter()
        .map(|v| {
            let mut service = (*v.service).clone();
            service.service_type = m::ServiceType::ExternalName;
            ServiceView { service: service.into(), slices: v.slices.clone() }
        })
        .collect();
    // The parts apart, in the same rounds as the ways.
    let mut parts = (Duration::MAX, Duration::MAX, Duration::MAX, Duration::MAX);
    let as_data = time_paths(typed, shipped, ctx, &parsed, sdk_ctx, views, prefixes, |shipped| {
        let min = |best: &mut Duration, d: Duration| *best = (*best).min(d);
        let (round_trip_native, empty_call, encoded, check) = &mut parts;
        min(
            round_trip_native,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    // SAFETY: `encode` made the archive.
                    let output = unsafe { archived::translate_archive(&encode(&parsed, p, v)) };
                    assert!(std::hint::black_box(archived::validate_result(&output).unwrap()).is_ok());
                }
            }),
        );
        min(
            empty_call,
            best_of(1, || {
                for (v, p) in external_name.iter().zip(prefixes) {
                    std::hint::black_box(shipped.translate_output(ctx, p, v).unwrap());
                }
            }),
        );
        min(
            encoded,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    std::hint::black_box(encode(&parsed, p, v));
                }
            }),
        );
        min(
            check,
            best_of(1, || {
                for output in &results {
                    std::hint::black_box(archived::validate_result(output).unwrap());
                }
            }),
        );
    });
    let (round_trip_native, empty_call, encode_time, check) = parts;
    // As `isolated_calls` times the typed call and native.
    let mut isolated: Vec<Duration> = views
        .iter()
        .zip(prefixes)
        .take(100)
        .map(|(v, p)| {
            std::thread::sleep(Duration::from_millis(20));
            let t = std::time::Instant::now();
            std::hint::black_box(shipped.translate_output(ctx, p, v).unwrap());
            t.elapsed()
        })
        .collect();
    isolated.sort();

    let in_chains = chain_views(views);
    check_every_service(typed, shipped, ctx, &parsed, sdk_ctx, &in_chains, prefixes);
    let chains = time_paths(typed, shipped, ctx, &parsed, sdk_ctx, &in_chains, prefixes, |_| ());
    ArchivedBoundary {
        as_data,
        encode: encode_time,
        check,
        round_trip_native,
        empty_call,
        bytes_in: sizes.0,
        bytes_out: sizes.1,
        isolated_p50: percentile(&isolated, 50),
        isolated_p90: percentile(&isolated, 90),
        chains,
    }
}

fn encode(parsed: &ParsedContext, prefix: &str, view: &ServiceView) -> Vec<u8> {
    wasmplane_runtime::archived::encode(parsed, prefix, view).unwrap()
}

/// Every service: the shipped guest's archive holds what native computes on the same
/// archive, that is the typed translator's ruleset, and both validate to the same rules. The
/// sizes of the last one's archives.
#[allow(clippy::too_many_arguments)]
fn check_every_service(
    typed: &mut TranslatorSession,
    shipped: &mut TranslatorSession,
    ctx: &NodeContext,
    parsed: &ParsedContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
) -> (usize, usize) {
    let mut sizes = (0, 0);
    for (view, prefix) in views.iter().zip(prefixes) {
        let input = encode(parsed, prefix, view);
        // SAFETY: `encode` made the archive.
        let inputs = unsafe { archived::inputs_in_place(&input) };
        let on_archive = archived::translate(inputs).unwrap();
        let Translated::Archived(output) = shipped.translate_output(ctx, prefix, view).unwrap() else {
            panic!("the shipped translator is an archived one");
        };
        let from_guest: archived::Ruleset =
            archived::rkyv::deserialize::<_, archived::rkyv::rancor::Error>(output.ruleset()).unwrap();
        assert_eq!(from_guest, on_archive, "the archived guest's ruleset for {prefix}");
        let typed_ruleset = native::translate(sdk_ctx, prefix, view).unwrap();
        assert_eq!(
            archived::typed(&on_archive, inputs),
            archived::canonical(typed_ruleset),
            "the ruleset for {prefix}"
        );
        let key = key_of(prefix);
        let from_typed = nft::validate_service_output(&key, &typed.translate(ctx, prefix, view).unwrap(), pods());
        let from_archive = nft::validate_archived_service_output(&key, output.ruleset(), &output.names(), pods());
        assert_eq!(from_archive, from_typed, "the rules validated from {prefix}'s two rulesets");
        sizes = (input.len(), archived::encode_result(&Ok(on_archive), Vec::new()).len());
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

/// Each way over `views`, in interleaved rounds; `also` times more in each round.
#[allow(clippy::too_many_arguments)]
fn time_paths(
    typed: &mut TranslatorSession,
    shipped: &mut TranslatorSession,
    ctx: &NodeContext,
    parsed: &ParsedContext,
    sdk_ctx: &sdk::NodeContext,
    views: &[ServiceView],
    prefixes: &[String],
    mut also: impl FnMut(&mut TranslatorSession),
) -> PathTimes {
    let keys: Vec<ObjectKey> = prefixes.iter().map(|p| key_of(p)).collect();
    let typed_outputs: Vec<_> = views.iter().zip(prefixes).map(|(v, p)| typed.translate(ctx, p, v).unwrap()).collect();
    let archived_outputs: Vec<_> =
        views.iter().zip(prefixes).map(|(v, p)| shipped.translate_output(ctx, p, v).unwrap()).collect();
    let mut times = PathTimes {
        typed: Duration::MAX,
        native: Duration::MAX,
        archived_native: Duration::MAX,
        archived_wasm: Duration::MAX,
        archived_wasm_typed: Duration::MAX,
        validate_typed: Duration::MAX,
        validate_archived: Duration::MAX,
    };
    for _round in 0..5 {
        let min = |best: &mut Duration, d: Duration| *best = (*best).min(d);
        min(
            &mut times.typed,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    std::hint::black_box(typed.translate(ctx, p, v).unwrap());
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
            &mut times.archived_native,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    let input = encode(parsed, p, v);
                    // SAFETY: `encode` made the archive.
                    std::hint::black_box(unsafe { archived::translate(archived::inputs_in_place(&input)) }.unwrap());
                }
            }),
        );
        min(
            &mut times.archived_wasm,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    std::hint::black_box(shipped.translate_output(ctx, p, v).unwrap());
                }
            }),
        );
        min(
            &mut times.archived_wasm_typed,
            best_of(1, || {
                for (v, p) in views.iter().zip(prefixes) {
                    std::hint::black_box(shipped.translate(ctx, p, v).unwrap());
                }
            }),
        );
        min(
            &mut times.validate_typed,
            best_of(1, || {
                for (out, key) in typed_outputs.iter().zip(&keys) {
                    std::hint::black_box(nft::validate_service_output(key, out, pods()).unwrap());
                }
            }),
        );
        min(
            &mut times.validate_archived,
            best_of(1, || {
                for (out, key) in archived_outputs.iter().zip(&keys) {
                    std::hint::black_box(nft::validate_translated(key, out, pods()).unwrap());
                }
            }),
        );
        also(shipped);
    }
    times
}
