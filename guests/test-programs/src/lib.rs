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
            // The validator programs: the translator behaves, their validators do not.
            #[cfg(any(feature = "trapping-validator", feature = "wrong-validator"))]
            return Ok(Ruleset { chains: vec![], sets: vec![], map_elements: vec![], warnings: vec![] });
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

    #[cfg(feature = "trapping-validator")]
    fn validate_settings(settings: &str) -> Result<(), String> {
        panic!("this validator always traps (settings {settings})");
    }

    #[cfg(feature = "trapping-validator")]
    wasmplane_sdk::export_settings_validator!(validate_settings);
}

/// `settings-validation` as a careless author might export it: `validate` answers a bool.
#[cfg(feature = "wrong-validator")]
mod wrong_validator {
    wit_bindgen::generate!({
        inline: "
            package wasmplane:dataplane@1.0.0;
            interface settings-validation {
                validate: func(settings: string) -> bool;
            }
            world wrong-validator {
                export settings-validation;
            }
        ",
    });

    struct Wrong;
    impl exports::wasmplane::dataplane::settings_validation::Guest for Wrong {
        fn validate(_settings: String) -> bool {
            true
        }
    }
    export!(Wrong);
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
