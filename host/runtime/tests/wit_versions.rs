//! Guests of every WIT version this host runs: the SDK's (this version) and one built against
//! `wasmplane:dataplane@1.0.0` as released (`wit/1.0.0/`), whose output differs in type only.

use std::sync::Arc;

use wasmplane_guest_artifacts as artifacts;
use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext, ServiceView};
use wasmplane_model::*;
use wasmplane_runtime::{CallError, GuestKind, Limits, LoadError, NoLookups, Runtime, WIT_VERSION, describe, wit};

fn view(ready: bool) -> ServiceView {
    ServiceView {
        service: Service::cluster_ip("shop", "web", "10.96.0.20", vec![ServicePort::tcp("http", 80, 8080)]).into(),
        slices: vec![LocalSlice {
            name: "web-1".into(),
            endpoints: vec![LocalEndpoint {
                addresses: vec!["10.244.0.11".into()],
                ready,
                serving: ready,
                terminating: false,
                node_name: None,
                zone: None,
                is_local: false,
            }],
            ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
        }],
    }
}

#[test]
fn a_translator_built_against_1_0_loads_and_runs() {
    let rt = Runtime::new(Limits::default(), None).unwrap();
    let module = rt
        .load("old", artifacts::test_programs::TRANSLATOR_WIT_1_0, Some(GuestKind::ServiceTranslator), usize::MAX)
        .expect("a 1.0 guest loads");
    assert_eq!(module.info.wit_version, "1.0.0");
    assert!(module.info.imports.iter().any(|i| i == "wasmplane:dataplane/log@1.0.0"), "{:?}", module.info.imports);
    let mut session = module.translator(Arc::new(NoLookups)).unwrap();
    let context = NodeContext { cluster_cidrs: vec!["10.244.0.0/16".into()], ..Default::default() };
    let out = session.translate(&context, "svc/shop/web", &view(true)).expect("translates");
    // Its 1.0 output, in this version's types, as it gave it.
    assert_eq!(out.chains.len(), 1);
    let rules = &out.chains[0].rules;
    assert_eq!(out.chains[0].name, "svc/shop/web/80");
    assert!(
        matches!(&rules[0].matches[..], [wit::RuleMatch::Source(a)] if a.cidr == "10.244.0.0/16" && a.negate),
        "{rules:?}"
    );
    assert!(matches!(rules[0].verdict, wit::Verdict::Masquerade));
    assert!(
        matches!(&rules[1].statements[..], [wit::RuleStatement::Dnat(t)] if t.address == "10.244.0.11" && t.port == 8080),
        "{rules:?}"
    );
    assert_eq!(rules[1].comment.as_deref(), Some("wit 1.0"));
    assert_eq!(out.map_elements.len(), 1);
    assert!(matches!(&out.map_elements[0].verdict, wit::Verdict::Goto(c) if c == "svc/shop/web/80"));
    assert_eq!(session.translate(&context, "svc/shop/web", &view(false)).unwrap().warnings, ["no ready endpoint"]);
    // Its own error keeps the session, as for any guest.
    let mut declined = view(true);
    std::sync::Arc::make_mut(&mut declined.service).labels.insert("wasmplane.io/decline".into(), "yes".into());
    assert_eq!(
        session.translate(&context, "svc/shop/web", &declined).unwrap_err(),
        CallError::Guest("declined shop/web".into())
    );
    assert!(session.translate(&context, "svc/shop/web", &view(true)).is_ok());
}

#[test]
fn the_sdks_guests_are_of_this_version() {
    let rt = Runtime::new(Limits::default(), None).unwrap();
    let module = rt.load("new", artifacts::SERVICE_TRANSLATOR, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap();
    assert_eq!((module.info.wit_version.as_str(), WIT_VERSION), ("1.2.0", "1.2.0"));
    let policy = rt.load_policy("np", artifacts::NETWORK_POLICY, usize::MAX).unwrap();
    assert_eq!(policy.info.wit_version, WIT_VERSION);
}

/// `bytes` with every `from` replaced by `to` (of the same length, so the binary stays valid:
/// component import and export names are plain strings in their sections).
fn renamed(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut out = bytes.to_vec();
    let mut replaced = 0;
    let mut at = 0;
    while let Some(i) = out[at..].windows(from.len()).position(|w| w == from.as_bytes()) {
        out[at + i..at + i + to.len()].copy_from_slice(to.as_bytes());
        at += i + to.len();
        replaced += 1;
    }
    assert!(replaced > 0, "no {from} in the component");
    out
}

/// Its names would pass the linker's semver matching, and it would fail at its first call with
/// a type error: it is refused at load, saying why.
#[test]
fn a_guest_built_against_a_newer_minor_is_refused_at_load() {
    let rt = Runtime::new(Limits::default(), None).unwrap();
    let newer = renamed(artifacts::test_programs::TRANSLATOR_WIT_1_0, "@1.0.0", "@1.3.0");
    let refused = LoadError::NewerVersion { found: "1.3.0".into() };
    assert_eq!(rt.load("newer", &newer, Some(GuestKind::ServiceTranslator), usize::MAX).err(), Some(refused.clone()));
    assert_eq!(describe(&newer), Err(refused.clone()));
    assert_eq!(
        refused.to_string(),
        "component targets wasmplane:dataplane@1.3.0, newer than this host's 1.2.0: build it against 1.2 or older, or upgrade the host"
    );
}

#[test]
fn a_guest_importing_a_newer_minor_is_refused_at_load() {
    // Only its `log` import is of the newer minor; the world it exports is 1.0's.
    let rt = Runtime::new(Limits::default(), None).unwrap();
    let refused = LoadError::NewerVersion { found: "1.3.0".into() };
    let import = renamed(
        artifacts::test_programs::TRANSLATOR_WIT_1_0,
        "wasmplane:dataplane/log@1.0.0",
        "wasmplane:dataplane/log@1.3.0",
    );
    assert_eq!(
        rt.load("newer-import", &import, Some(GuestKind::ServiceTranslator), usize::MAX).err(),
        Some(refused.clone())
    );
    assert_eq!(describe(&import), Err(refused));
}
