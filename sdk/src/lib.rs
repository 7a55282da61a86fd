//! The crate a wasmplane guest author depends on.
//!
//! A guest is a `cdylib` built for `wasm32-wasip2` that implements one of the guest worlds
//! of `wit/wasmplane.wit` and exports it with the matching macro:
//!
//! ```ignore
//! use wasmplane_sdk::service::exports::wasmplane::dataplane::service_translator::Guest;
//! use wasmplane_sdk::types::*;
//!
//! struct MyTranslator;
//! impl Guest for MyTranslator {
//!     fn translate(node: NodeContext, prefix: String, svc: Service, slices: Vec<EndpointSlice>)
//!         -> Result<Ruleset, GuestError> { /* ... */ }
//! }
//! wasmplane_sdk::export_service_translator!(MyTranslator);
//! ```
//!
//! A guest may also check its settings itself, before the host stores them:
//! [`export_settings_validator!`] exports a plain validation function beside the guest.
//!
//! Besides the bindings it offers the helpers most guests need: label-selector matching,
//! CIDR parsing, rule builders and logging through the host. All helpers are plain Rust and
//! also compile natively, so guest logic can be unit-tested with `cargo test`.
//!
//! To tell traffic from pods from other traffic, match it as the node detects it
//! ([`RuleBuilder::from_pods`], [`RuleBuilder::not_from_pods`]: the `pod-traffic` match of
//! package 1.1.0, following kube-proxy's `--detect-local-mode`) rather than by the node
//! context's `cluster_cidrs`, which only the source-address modes go by.

pub mod service {
    #[cfg(all(target_arch = "wasm32", not(feature = "serde")))]
    wit_bindgen::generate!({
        path: "../wit",
        world: "service-translation",
        pub_export_macro: true,
        export_macro_name: "export_service_translator",
        default_bindings_module: "wasmplane_sdk::service",
        additional_derives: [PartialEq, Eq, Hash],
    });
    // Natively the types are also serde: `testing` reads recordings in the host's shape.
    // (Not in Wasm builds unless feature `serde` asks: guests carry no serde code they never
    // use.)
    #[cfg(any(not(target_arch = "wasm32"), feature = "serde"))]
    wit_bindgen::generate!({
        path: "../wit",
        world: "service-translation",
        pub_export_macro: true,
        export_macro_name: "export_service_translator",
        default_bindings_module: "wasmplane_sdk::service",
        additional_derives: [PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize],
    });
}

pub mod policy {
    wit_bindgen::generate!({
        path: "../wit",
        world: "network-policy-enforcement",
        pub_export_macro: true,
        export_macro_name: "export_network_policy",
        default_bindings_module: "wasmplane_sdk::policy",
        with: {
            "wasmplane:dataplane/types@1.2.0": crate::service::wasmplane::dataplane::types,
            "wasmplane:dataplane/log@1.2.0": crate::service::wasmplane::dataplane::log,
            "wasmplane:dataplane/lookups@1.2.0": crate::service::wasmplane::dataplane::lookups,
            "wasmplane:dataplane/settings@1.2.0": crate::service::wasmplane::dataplane::settings,
        },
    });
}

pub mod gc {
    wit_bindgen::generate!({
        path: "../wit",
        world: "garbage-collection",
        pub_export_macro: true,
        export_macro_name: "export_gc",
        default_bindings_module: "wasmplane_sdk::gc",
        with: {
            "wasmplane:dataplane/log@1.2.0": crate::service::wasmplane::dataplane::log,
            "wasmplane:dataplane/settings@1.2.0": crate::service::wasmplane::dataplane::settings,
        },
    });
}

/// A service translator that reads its inputs in place and returns a string-free ruleset, one
/// archive each way (`archived-service-translation`, package 1.2.0; feature `archived`): what
/// the typed world does at the cost of native code (BENCHMARKS.md, fiftieth run).
///
/// The types are `wasmplane-archive`'s, re-exported here. Implement [`archived::Translator`]
/// and export it with [`export_archived_translator!`]:
///
/// ```ignore
/// use wasmplane_sdk::archived::{ArchivedInputs, Element, KeyPart, MapName, Ruleset, TranslateResult, Verdict};
///
/// struct MyTranslator;
/// impl wasmplane_sdk::archived::Translator for MyTranslator {
///     fn translate(inputs: &ArchivedInputs<'_>) -> TranslateResult {
///         let mut ruleset = Ruleset::default();
///         for ip in inputs.service.cluster_ips.iter() {
///             let key = [KeyPart::Address(ip.as_ipaddr())];
///             ruleset.elements.push(Element::new(MapName::ClusterIps, &key, Verdict::None));
///         }
///         Ok(ruleset)
///     }
/// }
/// wasmplane_sdk::export_archived_translator!(MyTranslator);
/// ```
///
/// The maps are those `service-translator` documents, by number ([`archived::MapName`]); the
/// host names a port's chains and affinity sets itself ([`archived::ChainName`],
/// [`archived::SetName`]). Natively, [`archived::translate_archive`] runs a translator on an
/// archive as the export does, for unit tests.
#[cfg(feature = "archived")]
pub mod archived {
    pub use wasmplane_archive::*;

    wit_bindgen::generate!({
        path: "../wit",
        world: "archived-service-translation",
        pub_export_macro: true,
        export_macro_name: "export_archived_service_translation",
        default_bindings_module: "wasmplane_sdk::archived",
        with: {
            "wasmplane:dataplane/log@1.2.0": crate::service::wasmplane::dataplane::log,
            "wasmplane:dataplane/lookups@1.2.0": crate::service::wasmplane::dataplane::lookups,
            "wasmplane:dataplane/settings@1.2.0": crate::service::wasmplane::dataplane::settings,
            "wasmplane:dataplane/types@1.2.0": crate::service::wasmplane::dataplane::types,
        },
    });

    /// A service translator of the archived world.
    pub trait Translator {
        /// Rules for one service, from its inputs read in place.
        fn translate(inputs: &ArchivedInputs<'_>) -> TranslateResult;
    }

    /// What the export does with the host's archive: `T` on it, its result archived.
    ///
    /// # Safety
    /// `input` must be an archive of [`Inputs`] (the host's, or one made with
    /// [`encode_inputs`]).
    pub unsafe fn translate_archive<T: Translator>(input: &[u8]) -> Vec<u8> {
        // SAFETY: the caller's contract.
        let inputs = unsafe { inputs_in_place(input) };
        encode_result(&T::translate(inputs), Vec::with_capacity(1024))
    }
}

/// Exports a [`archived::Translator`] as the `archived-service-translation` world (feature
/// `archived`).
#[cfg(feature = "archived")]
#[macro_export]
macro_rules! export_archived_translator {
    ($translator:ty) => {
        const _: () = {
            struct ArchivedExport;
            impl $crate::archived::exports::wasmplane::dataplane::archived_service_translator::Guest for ArchivedExport {
                fn translate(input: ::std::vec::Vec<u8>) -> ::std::vec::Vec<u8> {
                    // SAFETY: the host passes an archive of the inputs (`wasmplane_runtime::archived`).
                    unsafe { $crate::archived::translate_archive::<$translator>(&input) }
                }
            }
            $crate::archived::export_archived_service_translation!(ArchivedExport with_types_in $crate::archived);
        };
    };
}

/// The optional `settings-validation` export (see [`export_settings_validator!`]).
pub mod validation {
    wit_bindgen::generate!({
        path: "../wit",
        world: "settings-validator",
        pub_export_macro: true,
        export_macro_name: "export_settings_validation",
        default_bindings_module: "wasmplane_sdk::validation",
    });
}

/// Exports a settings validator beside the guest's kind (Kubewarden's `validate_settings`):
/// a plain `fn(&str) -> Result<(), String>` given the settings document (`{}` when none),
/// returning why they are refused, naming the setting. The host calls it before it stores
/// settings and before it puts a version in force with the settings it has, so bad
/// settings are refused even where nothing is there to translate. Natively it is the plain
/// function: unit-test it by calling it.
///
/// ```ignore
/// pub fn validate_settings(settings: &str) -> Result<(), String> {
///     Settings::parse(settings).map(|_| ())
/// }
/// wasmplane_sdk::export_service_translator!(MyTranslator);
/// wasmplane_sdk::export_settings_validator!(validate_settings);
/// ```
#[macro_export]
macro_rules! export_settings_validator {
    ($validate:path) => {
        const _: () = {
            struct SettingsValidator;
            impl $crate::validation::exports::wasmplane::dataplane::settings_validation::Guest for SettingsValidator {
                fn validate(settings: ::std::string::String) -> ::std::result::Result<(), ::std::string::String> {
                    $validate(&settings)
                }
            }
    $crate::validation::export_settings_validation!(SettingsValidator with_types_in $crate::validation);
        };
    };
}

/// The shared WIT types (services, endpoints, rules, ...).
pub mod types {
    pub use crate::service::wasmplane::dataplane::types::*;
}

pub mod builders;
pub mod cidr;
pub mod log;
pub mod lookups;
pub mod selector;
pub mod settings;
pub mod shared;
/// Replaying host recordings through native guest code (`cargo test`).
#[cfg(not(target_arch = "wasm32"))]
pub mod testing;

pub use builders::RuleBuilder;
pub use cidr::Cidr;

pub use gc::export_gc;
pub use policy::export_network_policy;
pub use service::export_service_translator;
