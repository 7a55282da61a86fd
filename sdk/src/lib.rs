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
            "wasmplane:dataplane/types@1.1.0": crate::service::wasmplane::dataplane::types,
            "wasmplane:dataplane/log@1.1.0": crate::service::wasmplane::dataplane::log,
            "wasmplane:dataplane/lookups@1.1.0": crate::service::wasmplane::dataplane::lookups,
            "wasmplane:dataplane/settings@1.1.0": crate::service::wasmplane::dataplane::settings,
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
            "wasmplane:dataplane/log@1.1.0": crate::service::wasmplane::dataplane::log,
            "wasmplane:dataplane/settings@1.1.0": crate::service::wasmplane::dataplane::settings,
        },
    });
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
