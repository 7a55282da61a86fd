//! `describe`: what loading a component would report of it, read from its import and export
//! sections without compiling it (how the host lists a builtin where it never runs).

use wasmplane_guest_artifacts as artifacts;
use wasmplane_runtime::{Limits, LoadError, Runtime, describe};

#[test]
fn describing_a_component_finds_what_loading_it_finds() {
    let rt = Runtime::new(Limits::default(), None).unwrap();
    let components = [
        ("service-translator", artifacts::SERVICE_TRANSLATOR),
        ("network-policy", artifacts::NETWORK_POLICY),
        ("gc", artifacts::GC),
        // Imports the host's `settings` interface and exports a validator beside its world.
        ("port-filter", artifacts::examples::PORT_FILTER_TRANSLATOR),
        ("trap", artifacts::test_programs::TRAP),
    ];
    for (name, bytes) in components {
        let loaded = rt.settings_check(name, bytes, None, usize::MAX).unwrap_or_else(|e| panic!("{name}: {e}")).info;
        assert_eq!(describe(bytes).unwrap(), loaded, "{name}");
    }
    let port_filter = describe(artifacts::examples::PORT_FILTER_TRANSLATOR).unwrap();
    assert!(port_filter.imports.iter().any(|i| i.starts_with("wasmplane:dataplane/settings@")), "{port_filter:?}");
}

#[test]
fn describing_refuses_what_is_no_known_world() {
    assert_eq!(describe(b"not wasm at all"), Err(LoadError::NotWasm));
    assert_eq!(describe(b"\0asm\x01\0\0\0"), Err(LoadError::CoreModule));
    match describe(artifacts::test_programs::WRONG_WORLD) {
        Err(LoadError::UnknownWorld { exports, .. }) => assert!(!exports.is_empty(), "the exports it has are named"),
        other => panic!("expected an unknown world, got {other:?}"),
    }
}
