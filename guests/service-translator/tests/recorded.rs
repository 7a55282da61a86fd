//! The native translator over traffic recorded by a live host (`wasmplane run --record`):
//! what a guest author does with `wasmplane_sdk::testing`. The fixture is written by the
//! host's `record_replay` test (see examples/recordings/README.md).

use std::collections::BTreeMap;

use wasmplane_guest_service_translator::translate;
use wasmplane_sdk::testing::{RecordedOutput, Recording};
use wasmplane_sdk::types::*;

fn recording() -> Recording {
    Recording::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/recordings/shop.jsonl"))
        .expect("the fixture reads")
}

#[test]
fn recorded_services_translate_natively_as_they_did_live() {
    let recording = recording();
    assert_eq!(recording.header.node.node_name, "node-a");
    let replayed = recording.replay(translate);
    assert!(replayed.len() >= 4, "the fixture holds calls: {}", replayed.len());
    let mut compared = 0;
    for call in &replayed {
        let rules = call
            .output
            .as_ref()
            .unwrap_or_else(|e| panic!("{} (revision {}): {}", call.input.key, call.revision.revision, e.message));
        assert!(rules.chains.iter().all(|c| c.name.starts_with(&call.input.prefix)), "{}: {rules:?}", call.input.key);
        // Where the default translator ran live (built for Wasm), the native build makes the
        // same chains with the same number of rules.
        if let (Some(recorded), Some(true)) =
            (call.recorded, call.revision.translator.as_deref().map(|t| t.starts_with("default-service-translator@")))
        {
            assert!(matches!(recorded, RecordedOutput::Rules(_)), "{recorded:?}");
            let native: BTreeMap<String, usize> =
                rules.chains.iter().map(|c| (c.name.clone(), c.rules.len())).collect();
            assert_eq!(native, recorded.chains(), "{} at revision {}", call.input.key, call.revision.revision);
            compared += 1;
        }
    }
    assert!(compared >= 3, "only {compared} calls compared with live output");
}

#[test]
fn ready_recorded_endpoints_are_dnat_targets() {
    let recording = recording();
    for call in recording.replay(translate) {
        let rules = call.output.unwrap();
        // DNAT in a chain, or a backend in the host's map (load balancing as data).
        let in_chains =
            rules.chains.iter().flat_map(|c| &c.rules).flat_map(|r| &r.statements).filter_map(|s| match s {
                RuleStatement::Dnat(t) => Some(t.address.as_str()),
                _ => None,
            });
        let as_data =
            rules.map_elements.iter().filter(|e| e.map_name == "service-backends").filter_map(|e| match &e.key[..] {
                [_, _, _, KeyPart::Address(a), _] => Some(a.as_str()),
                _ => None,
            });
        let targets: Vec<&str> = in_chains.chain(as_data).collect();
        for endpoint in call.input.slices.iter().flat_map(|s| &s.endpoints).filter(|e| e.ready) {
            assert!(
                targets.contains(&endpoint.addresses[0].as_str()),
                "{}: {} is no DNAT target",
                call.input.key,
                endpoint.addresses[0]
            );
        }
    }
}
