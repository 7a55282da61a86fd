//! The archived world (package 1.2.0) end to end below the API: the shipped translator, which
//! is an archived one, gives the dataplane the same rules as the same translator built for the
//! typed world, on every path; what an archived guest gets wrong is refused with why; guests
//! of the minors before keep loading.

use std::sync::Arc;

use wasmplane::nft::{self, ObjectRules, PodDetection, PodTraffic};
use wasmplane_guest_artifacts as artifacts;
use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext, ServiceView};
use wasmplane_model::*;
use wasmplane_runtime::{
    CallError, GuestKind, Limits, NoLookups, Runtime, Translated, TranslatorSession, WIT_VERSION, describe, wit,
};

fn session(runtime: &Runtime, bytes: &[u8]) -> TranslatorSession {
    let module = runtime.load("t", bytes, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap();
    module.translator(Arc::new(NoLookups)).unwrap()
}

fn context() -> NodeContext {
    NodeContext {
        node_name: "node-a".into(),
        node_ips: vec!["192.168.0.1".into(), "fd00::1".into()],
        cluster_cidrs: vec!["10.244.0.0/16".into(), "fd00:244::/64".into()],
        pod_cidrs: vec!["10.244.0.0/24".into()],
        zone: None,
    }
}

fn endpoint(address: &str, local: bool) -> LocalEndpoint {
    LocalEndpoint {
        addresses: vec![address.into()],
        ready: true,
        serving: true,
        terminating: false,
        node_name: Some(if local { "node-a" } else { "node-b" }.into()),
        zone: None,
        is_local: local,
    }
}

fn slice(endpoints: Vec<LocalEndpoint>, ports: &[(&str, u16)]) -> LocalSlice {
    LocalSlice {
        name: "web-1".into(),
        endpoints,
        ports: ports
            .iter()
            .map(|(name, port)| EndpointPort { name: (*name).into(), protocol: Protocol::Tcp, port: *port })
            .collect(),
    }
}

fn web(change: impl FnOnce(&mut Service)) -> Service {
    let mut service = Service::cluster_ip("shop", "web", "10.96.0.20", vec![ServicePort::tcp("http", 80, 8080)]);
    change(&mut service);
    service
}

/// Every path of the default translator, and the cases where it writes nothing or rejects.
fn cases() -> Vec<(&'static str, ServiceView)> {
    let three = || {
        slice(
            vec![endpoint("10.244.0.11", true), endpoint("10.244.1.12", false), endpoint("10.244.2.13", false)],
            &[("http", 8080)],
        )
    };
    let view = |service: Service, slices: Vec<LocalSlice>| ServiceView { service: service.into(), slices };
    let lb_local = |s: &mut Service| {
        s.service_type = ServiceType::LoadBalancer;
        s.load_balancer_ips = vec!["203.0.113.7".into()];
        s.external_traffic_policy = TrafficPolicy::Local;
        s.ports[0].node_port = 30080;
    };
    let many: Vec<LocalEndpoint> = (0..40).map(|i| endpoint(&format!("10.244.3.{}", i + 1), i % 7 == 0)).collect();
    vec![
        ("cluster IP, as data", view(web(|_| ()), vec![three()])),
        (
            "node port with affinity, as data",
            view(
                web(|s| {
                    s.service_type = ServiceType::NodePort;
                    s.ports[0].node_port = 30080;
                    s.session_affinity_timeout = Some(600);
                }),
                vec![three()],
            ),
        ),
        ("external IP, as data", view(web(|s| s.external_ips = vec!["198.51.100.9".into()]), vec![three()])),
        ("load balancer, externalTrafficPolicy Local: chains", view(web(lb_local), vec![three()])),
        (
            "the same with affinity and a second, unnamed port",
            view(
                web(|s| {
                    lb_local(s);
                    s.session_affinity_timeout = Some(10_800);
                    s.ports.push(ServicePort { name: "".into(), node_port: 30443, ..ServicePort::tcp("", 443, 8443) });
                }),
                vec![
                    slice(vec![endpoint("10.244.0.11", true), endpoint("10.244.1.12", false)], &[("http", 8080)]),
                    slice(vec![endpoint("10.244.0.11", true)], &[("", 8443)]),
                ],
            ),
        ),
        (
            "externalTrafficPolicy Local, no endpoint on this node",
            view(web(lb_local), vec![slice(vec![endpoint("10.244.1.12", false)], &[("http", 8080)])]),
        ),
        ("more than 32 backends: chains", view(web(|_| ()), vec![slice(many.clone(), &[("http", 8080)])])),
        (
            "more than 32, affinity, internalTrafficPolicy Local",
            view(
                web(|s| {
                    s.session_affinity_timeout = Some(86_400);
                    s.internal_traffic_policy = TrafficPolicy::Local;
                }),
                vec![slice(many, &[("http", 8080)])],
            ),
        ),
        (
            "dual-stack, IPv6 first",
            view(
                web(|s| s.cluster_ips = vec!["fd00:96::20".into(), "10.96.0.20".into()]),
                vec![slice(vec![endpoint("fd00:244::11", true), endpoint("10.244.0.11", true)], &[("http", 8080)])],
            ),
        ),
        ("no endpoints: rejected, with a warning", view(web(|_| ()), vec![])),
        (
            "internalTrafficPolicy Local, no local endpoint: dropped",
            view(
                web(|s| s.internal_traffic_policy = TrafficPolicy::Local),
                vec![slice(vec![endpoint("10.244.1.12", false)], &[("http", 8080)])],
            ),
        ),
        (
            "terminating endpoints only",
            view(
                web(|_| ()),
                vec![slice(
                    vec![LocalEndpoint { ready: false, terminating: true, ..endpoint("10.244.1.12", false) }],
                    &[("http", 8080)],
                )],
            ),
        ),
        ("named target port", view(web(|s| s.ports[0].target_port = TargetPort::Name("http".into())), vec![three()])),
        ("headless", view(web(|s| s.cluster_ips = vec!["None".into()]), vec![three()])),
        ("ExternalName", view(web(|s| s.service_type = ServiceType::ExternalName), vec![three()])),
    ]
}

fn validated(out: &Translated) -> ObjectRules {
    let traffic = PodTraffic::default();
    let cidrs = ["10.244.0.0/16".parse().unwrap(), "fd00:244::/64".parse().unwrap()];
    nft::validate_translated(&ObjectKey::new("shop", "web"), out, PodDetection::new(&traffic, &cidrs)).unwrap()
}

/// The typed ruleset with its map elements in one order (the archived translator gives its
/// hairpin addresses in numeric order, the typed one as text).
fn sorted(mut ruleset: wit::Ruleset) -> wit::Ruleset {
    ruleset.map_elements.sort_by_key(|e| format!("{e:?}"));
    ruleset
}

#[test]
fn the_shipped_translator_writes_what_the_typed_one_does_on_every_path() {
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let (mut shipped, mut typed) = (
        session(&runtime, artifacts::SERVICE_TRANSLATOR),
        session(&runtime, artifacts::test_programs::TRANSLATOR_TYPED),
    );
    let ctx = context();
    for (case, view) in cases() {
        let prefix = "svc/shop/web";
        let archived = shipped.translate_output(&ctx, prefix, &view).unwrap();
        assert!(matches!(archived, Translated::Archived(_)), "{case}: the shipped translator is archived");
        let from_typed = typed.translate_output(&ctx, prefix, &view).unwrap();
        assert!(matches!(from_typed, Translated::Typed(_)), "{case}");
        let rules = validated(&archived);
        assert_eq!(rules, validated(&from_typed), "{case}: the rules the dataplane gets");
        // In the typed world's terms too (what the CLI and the native comparison read).
        let (archived, from_typed) = (archived.into_typed().unwrap(), from_typed.into_typed().unwrap());
        assert_eq!(sorted(archived), sorted(from_typed), "{case}: the typed rulesets");
        let writes_rules = !rules.elements.is_empty() || !rules.chains.is_empty();
        assert_eq!(writes_rules, !matches!(case, "headless" | "ExternalName"), "{case}: {rules:?}");
    }
}

#[test]
fn the_shipped_translator_is_archived_and_of_this_version() {
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let module = runtime.load("t", artifacts::SERVICE_TRANSLATOR, None, usize::MAX).unwrap();
    assert_eq!(module.info.kind, GuestKind::ServiceTranslator);
    assert_eq!(module.info.interface.as_deref(), Some("archived-service-translator"));
    assert_eq!(module.info.wit_version, WIT_VERSION);
    let described = describe(artifacts::SERVICE_TRANSLATOR).unwrap();
    assert_eq!((described.kind, described.interface), (module.info.kind, module.info.interface.clone()));
    let typed = runtime.load("typed", artifacts::test_programs::TRANSLATOR_TYPED, None, usize::MAX).unwrap();
    assert_eq!(typed.info.interface, None, "a typed translator exports its kind's own interface");
}

#[test]
fn an_address_that_does_not_parse_refuses_the_service_before_the_call() {
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let mut shipped = session(&runtime, artifacts::SERVICE_TRANSLATOR);
    let bad = ServiceView { service: web(|s| s.cluster_ips = vec!["10.96.0.300".into()]).into(), slices: vec![] };
    assert_eq!(
        shipped.translate_output(&context(), "svc/shop/web", &bad).err(),
        Some(CallError::Input("service shop/web: invalid IP \"10.96.0.300\"".into()))
    );
    let endpoint = slice(vec![endpoint("10.244.0.x", false)], &[("http", 8080)]);
    let bad = ServiceView { service: web(|_| ()).into(), slices: vec![endpoint] };
    assert!(
        matches!(shipped.translate_output(&context(), "svc/shop/web", &bad), Err(CallError::Input(m)) if m.contains("10.244.0.x"))
    );
    let good = ServiceView { service: web(|_| ()).into(), slices: vec![] };
    assert!(shipped.translate_output(&context(), "svc/shop/web", &good).is_ok());
}

#[test]
fn what_an_archived_guest_gets_wrong_is_refused_with_why() {
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let mut guest = session(&runtime, artifacts::test_programs::ARCHIVED_MISBEHAVING);
    let labelled = |label: &str| ServiceView {
        service: web(|s| {
            s.labels.insert(label.into(), "yes".into());
        })
        .into(),
        slices: vec![],
    };
    let ctx = context();
    let garbage = guest.translate_output(&ctx, "svc/shop/web", &labelled("wasmplane.io/garbage"));
    assert!(
        matches!(&garbage, Err(CallError::InvalidOutput(m)) if m.contains("does not check")),
        "{:?}",
        garbage.err()
    );
    // The instance that returned it is dropped; the next call gets a fresh one.
    let fine = guest.translate_output(&ctx, "svc/shop/web", &labelled("other")).unwrap();
    let rules = validated(&fine);
    assert_eq!(rules.elements.len(), 1, "the cluster IP port rejected: {rules:?}");

    assert_eq!(
        guest.translate_output(&ctx, "svc/shop/web", &labelled("wasmplane.io/decline")).err(),
        Some(CallError::Guest("declined shop/web".into()))
    );

    let bad_port = guest.translate_output(&ctx, "svc/shop/web", &labelled("wasmplane.io/bad-port")).unwrap();
    let traffic = PodTraffic::default();
    let refused = nft::validate_translated(&ObjectKey::new("shop", "web"), &bad_port, PodDetection::new(&traffic, &[]))
        .unwrap_err();
    assert!(refused.reason.contains("port number 9, which the service does not have"), "{refused}");
    assert!(matches!(bad_port.into_typed(), Err(CallError::InvalidOutput(m)) if m.contains("port number 9")));
}

#[test]
fn an_archived_result_over_the_output_limit_is_refused() {
    let runtime = Runtime::new(Limits { max_output_objects: 3, ..Default::default() }, None).unwrap();
    let mut shipped = session(&runtime, artifacts::SERVICE_TRANSLATOR);
    let (_, view) = cases().into_iter().next().unwrap();
    let refused = shipped.translate_output(&context(), "svc/shop/web", &view);
    assert!(matches!(&refused, Err(CallError::OutputTooLarge(_))), "{:?}", refused.err());
}

/// An archived translator must be of a version that has the interface (one claiming 1.1.0, its
/// names rewritten, same length) and export `translate` of its signature: otherwise it is
/// refused at load, saying why, not at its first call.
#[test]
fn an_archived_translator_of_another_version_or_signature_is_refused_at_load() {
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let mut older = artifacts::test_programs::ARCHIVED_MISBEHAVING.to_vec();
    let (from, to) = (b"@1.2.0", b"@1.1.0");
    let mut renamed = 0;
    for i in 0..=older.len() - from.len() {
        if &older[i..i + from.len()] == from {
            older[i..i + to.len()].copy_from_slice(to);
            renamed += 1;
        }
    }
    assert!(renamed > 0);
    let refused = runtime.load("older", &older, None, usize::MAX).err().expect("refused");
    assert!(
        refused
            .to_string()
            .contains("the archived service translator exists since wasmplane:dataplane@1.2.0, not 1.1.0"),
        "{refused}"
    );
    let wrong = runtime.load("wrong", artifacts::test_programs::ARCHIVED_WRONG_SIGNATURE, None, usize::MAX);
    let refused = wrong.err().expect("refused").to_string();
    assert!(
        refused.contains(
            "`translate` is `func(string) -> (string)`; expected `translate: func(input: list<u8>) -> list<u8>`"
        ),
        "{refused}"
    );
}

/// A guest of the minor before the host's (1.1.0, built against `wit/1.1.0/` as released)
/// loads and runs, `pod-traffic` match and all.
#[test]
fn a_guest_built_against_1_1_keeps_loading() {
    let runtime = Runtime::new(Limits::default(), None).unwrap();
    let module = runtime.load("old", artifacts::test_programs::TRANSLATOR_WIT_1_1, None, usize::MAX).unwrap();
    assert_eq!((module.info.wit_version.as_str(), module.info.interface.as_deref()), ("1.1.0", None));
    let mut old = module.translator(Arc::new(NoLookups)).unwrap();
    let (_, view) = cases().into_iter().next().unwrap();
    let out = old.translate_output(&context(), "svc/shop/web", &view).unwrap();
    let rules = validated(&out);
    let chain = rules.chains.values().next().expect("one chain");
    assert!(
        chain.iter().any(|r| r.contains("masquerade"))
            && chain.iter().any(|r| r.contains("dnat ip to 10.244.0.11:8080")),
        "{chain:?}"
    );
}
