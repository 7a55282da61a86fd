//! Misbehaving guests: each feature builds one component that breaks a different rule, so
//! the host's tests can check that nothing it breaks reaches the dataplane.

#[cfg(not(any(
    feature = "wrong-world",
    feature = "wit-1-0-translator",
    feature = "wit-1-0-policy",
    feature = "wit-1-1-translator",
    feature = "archived-misbehaving",
    feature = "archived-wrong-signature"
)))]
mod translator {
    use wasmplane_sdk::service::exports::wasmplane::dataplane::service_translator::Guest;
    use wasmplane_sdk::types::*;

    struct Misbehaving;

    impl Guest for Misbehaving {
        #[allow(unreachable_code, unused_variables)]
        fn translate(
            _node: NodeContext,
            prefix: String,
            _svc: Service,
            _slices: Vec<EndpointSlice>,
        ) -> Result<Ruleset, GuestError> {
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

/// A translator built against `wasmplane:dataplane@1.0.0` as released (`wit/1.0.0/`), not
/// the SDK: a 1.0 guest must keep loading and running. It forwards each cluster IP port to
/// the first endpoint, masquerading off-cluster sources by the node context's cluster CIDRs
/// (1.0 has no `pod-traffic` match), and logs through the 1.0 `log` import.
#[cfg(feature = "wit-1-0-translator")]
mod translator_1_0 {
    wit_bindgen::generate!({ path: "../../wit/1.0.0", world: "service-translation" });

    use exports::wasmplane::dataplane::service_translator::Guest;
    use wasmplane::dataplane::types::*;

    struct Translator;

    impl Guest for Translator {
        fn translate(
            node: NodeContext,
            prefix: String,
            service: Service,
            slices: Vec<EndpointSlice>,
        ) -> Result<Ruleset, GuestError> {
            if service.labels.iter().any(|l| l.key == "wasmplane.io/decline") {
                return Err(GuestError { message: format!("declined {}/{}", service.namespace, service.name) });
            }
            wasmplane::dataplane::log::log(
                wasmplane::dataplane::log::Level::Debug,
                &format!("1.0 guest translating {}/{}", service.namespace, service.name),
            );
            let mut ruleset = Ruleset { chains: vec![], sets: vec![], map_elements: vec![], warnings: vec![] };
            let Some(backend) =
                slices.iter().flat_map(|s| &s.endpoints).find(|e| e.ready).and_then(|e| e.addresses.first())
            else {
                ruleset.warnings.push("no ready endpoint".into());
                return Ok(ruleset);
            };
            for port in &service.ports {
                let TargetPort::Number(target) = port.target_port else { continue };
                let chain = format!("{prefix}/{}", port.port);
                let mut rules: Vec<Rule> = node
                    .cluster_cidrs
                    .iter()
                    .map(|cidr| Rule {
                        matches: vec![RuleMatch::Source(AddressMatch { cidr: cidr.clone(), negate: true })],
                        statements: vec![],
                        verdict: Verdict::Masquerade,
                        comment: None,
                    })
                    .collect();
                rules.push(Rule {
                    matches: vec![],
                    statements: vec![RuleStatement::Dnat(DnatTarget { address: backend.clone(), port: target })],
                    verdict: Verdict::None,
                    comment: Some("wit 1.0".into()),
                });
                for ip in &service.cluster_ips {
                    ruleset.map_elements.push(MapElement {
                        map_name: "service-ips".into(),
                        key: vec![
                            KeyPart::Address(ip.clone()),
                            KeyPart::Protocol(port.protocol),
                            KeyPart::Port(port.port),
                        ],
                        verdict: Verdict::Goto(chain.clone()),
                    });
                }
                ruleset.chains.push(Chain { name: chain, rules });
            }
            Ok(ruleset)
        }
    }

    export!(Translator);
}

/// A network policy guest built against `wasmplane:dataplane@1.0.0` as released: accepts
/// the first `ipBlock` of the policy's rules as a source, in one chain.
#[cfg(feature = "wit-1-0-policy")]
mod policy_1_0 {
    wit_bindgen::generate!({ path: "../../wit/1.0.0", world: "network-policy-enforcement" });

    use exports::wasmplane::dataplane::network_policy::Guest;
    use wasmplane::dataplane::types::*;

    struct Policy;

    impl Guest for Policy {
        fn compile(
            _node: NodeContext,
            prefix: String,
            policy: NetworkPolicy,
            local_pods: Vec<Pod>,
        ) -> Result<Ruleset, GuestError> {
            let block = policy
                .ingress
                .iter()
                .chain(&policy.egress)
                .flatten()
                .flat_map(|r| &r.peers)
                .find_map(|p| p.ip_block.as_ref());
            let rules = block
                .map(|b| Rule {
                    matches: vec![RuleMatch::Source(AddressMatch { cidr: b.cidr.clone(), negate: false })],
                    statements: vec![RuleStatement::Counter],
                    verdict: Verdict::Accept,
                    comment: None,
                })
                .into_iter()
                .collect();
            let warnings = vec![format!("{} local pods", local_pods.len())];
            Ok(Ruleset {
                chains: vec![Chain { name: format!("{prefix}/ingress"), rules }],
                sets: vec![],
                map_elements: vec![],
                warnings,
            })
        }
    }

    export!(Policy);
}

/// A translator built against `wasmplane:dataplane@1.1.0` as released (`wit/1.1.0/`): a guest
/// of the minor before the host's keeps loading and running. Each cluster IP port goes to its
/// first ready endpoint, masquerading traffic not from pods (1.1's `pod-traffic` match).
#[cfg(feature = "wit-1-1-translator")]
mod translator_1_1 {
    wit_bindgen::generate!({ path: "../../wit/1.1.0", world: "service-translation" });

    use exports::wasmplane::dataplane::service_translator::Guest;
    use wasmplane::dataplane::types::*;

    struct Translator;

    impl Guest for Translator {
        fn translate(
            _node: NodeContext,
            prefix: String,
            service: Service,
            slices: Vec<EndpointSlice>,
        ) -> Result<Ruleset, GuestError> {
            let mut ruleset = Ruleset { chains: vec![], sets: vec![], map_elements: vec![], warnings: vec![] };
            let Some(backend) =
                slices.iter().flat_map(|s| &s.endpoints).find(|e| e.ready).and_then(|e| e.addresses.first())
            else {
                ruleset.warnings.push("no ready endpoint".into());
                return Ok(ruleset);
            };
            for port in &service.ports {
                let TargetPort::Number(target) = port.target_port else { continue };
                let chain = format!("{prefix}/{}", port.port);
                let not_from_pods =
                    RuleMatch::PodTraffic(PodTrafficMatch { family: AddressFamily::Ipv4, negate: true });
                let rules = vec![
                    Rule {
                        matches: vec![not_from_pods],
                        statements: vec![],
                        verdict: Verdict::Masquerade,
                        comment: None,
                    },
                    Rule {
                        matches: vec![],
                        statements: vec![RuleStatement::Dnat(DnatTarget { address: backend.clone(), port: target })],
                        verdict: Verdict::None,
                        comment: Some("wit 1.1".into()),
                    },
                ];
                for ip in &service.cluster_ips {
                    ruleset.map_elements.push(MapElement {
                        map_name: "service-ips".into(),
                        key: vec![
                            KeyPart::Address(ip.clone()),
                            KeyPart::Protocol(port.protocol),
                            KeyPart::Port(port.port),
                        ],
                        verdict: Verdict::Goto(chain.clone()),
                    });
                }
                ruleset.chains.push(Chain { name: chain, rules });
            }
            Ok(ruleset)
        }
    }

    export!(Translator);
}

/// An archived translator (package 1.2.0) that misbehaves on request, by the service's labels:
/// `wasmplane.io/garbage` returns bytes that are no archive; `wasmplane.io/bad-port` sends its
/// frontends to a chain of a port the service does not have; `wasmplane.io/decline` returns its
/// own error. Otherwise it rejects every cluster IP port (valid rules).
#[cfg(feature = "archived-misbehaving")]
mod archived_misbehaving {
    use wasmplane_sdk::archived::*;

    struct Raw;

    impl exports::wasmplane::dataplane::archived_service_translator::Guest for Raw {
        fn translate(input: Vec<u8>) -> Vec<u8> {
            // SAFETY: the host passes an archive of the inputs.
            let inputs = unsafe { inputs_in_place(&input) };
            let service = &inputs.service;
            let labelled = |key: &str| service.labels.iter().any(|l| &*l.key == key);
            if labelled("wasmplane.io/garbage") {
                return vec![0xff; 64];
            }
            if labelled("wasmplane.io/decline") {
                return encode_result(&Err(format!("declined {}/{}", &*service.namespace, &*service.name)), Vec::new());
            }
            let mut ruleset = Ruleset::default();
            for port in service.ports.iter() {
                let protocol = port.protocol.native();
                for ip in service.cluster_ips.iter() {
                    let key = [
                        KeyPart::Address(ip.as_ipaddr()),
                        KeyPart::Protocol(protocol),
                        KeyPart::Port(port.port.to_native()),
                    ];
                    let element = if labelled("wasmplane.io/bad-port") {
                        Element::new(
                            MapName::ServiceIps,
                            &key,
                            Verdict::Goto(ChainName { port: 9, role: ChainRole::Service }),
                        )
                    } else {
                        Element::new(MapName::NoEndpointServices, &key, Verdict::Reject)
                    };
                    ruleset.elements.push(element);
                }
            }
            encode_result(&Ok(ruleset), Vec::new())
        }
    }

    export_archived_service_translation!(Raw with_types_in wasmplane_sdk::archived);
}

/// `archived-service-translator` as a careless author might export it: strings, not archives.
#[cfg(feature = "archived-wrong-signature")]
mod archived_wrong_signature {
    wit_bindgen::generate!({
        inline: "
            package wasmplane:dataplane@1.2.0;
            interface archived-service-translator {
                translate: func(input: string) -> string;
            }
            world wrong-signature {
                export archived-service-translator;
            }
        ",
    });

    struct Wrong;
    impl exports::wasmplane::dataplane::archived_service_translator::Guest for Wrong {
        fn translate(input: String) -> String {
            input
        }
    }
    export!(Wrong);
}
