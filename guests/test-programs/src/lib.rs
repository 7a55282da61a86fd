//! Misbehaving guests: each feature builds one component that breaks a different rule, so
//! the host's tests can check that nothing it breaks reaches the dataplane.

#[cfg(not(feature = "wrong-world"))]
mod translator {
    use wasmplane_sdk::service::exports::wasmplane::dataplane::service_translator::Guest;
    use wasmplane_sdk::types::*;

    struct Misbehaving;

    impl Guest for Misbehaving {
        #[allow(unreachable_code, unused_variables)]
        fn translate(_node: NodeContext, prefix: String, _svc: Service, _slices: Vec<EndpointSlice>) -> Result<Ruleset, GuestError> {
            #[cfg(feature = "loop-forever")]
            loop {
                std::hint::black_box(());
            }
            #[cfg(feature = "allocate-forever")]
            {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(std::hint::black_box(vec![1u8; 1 << 20]));
                }
            }
            #[cfg(feature = "trap")]
            panic!("this guest always traps");
            // trap-on-label: well behaved (no rules) until a service carries the label, so it
            // activates fine and fails later: what a crash budget is for.
            #[cfg(feature = "trap-on-label")]
            {
                if _svc.labels.iter().any(|l| l.key == "wasmplane.io/crash") {
                    panic!("crash label on {}/{}", _svc.namespace, _svc.name);
                }
                return Ok(Ruleset { chains: vec![], sets: vec![], map_elements: vec![], warnings: vec![] });
            }
            // invalid-output: a chain outside the namespace the host gave this service.
            Ok(Ruleset {
                chains: vec![Chain { name: "evil/elsewhere".into(), rules: vec![] }],
                sets: vec![],
                map_elements: vec![],
                warnings: vec![],
            })
        }
    }

    wasmplane_sdk::export_service_translator!(Misbehaving);
}

#[cfg(feature = "wrong-world")]
mod other_world {
    wit_bindgen::generate!({
        inline: "
            package test:other@0.1.0;
            world other {
                export hello: func() -> string;
            }
        ",
    });

    struct Other;
    impl Guest for Other {
        fn hello() -> String {
            "I implement no wasmplane world".into()
        }
    }
    export!(Other);
}
