//! An example custom service translator, built only against `wasmplane-sdk`.
//!
//! It exposes only services labelled `wasmplane.io/expose=true`, and only their TCP ports:
//! a site policy ("nothing reaches a service unless its owners opted in") that kube-proxy
//! cannot express. Each exposed port gets a chain that picks an endpoint uniformly.
//!
//! Settings (`PUT /v1/modules/port-filter/settings`): `{"label": "team", "value": "edge"}`
//! exposes the services labelled `team=edge` instead; anything else in them is refused, and
//! so is one of the two without the other. It exports its check ([`validate_settings`]), so
//! the host refuses bad settings before storing them, even with no service to translate.
//!
//! Build: `cargo build --release --target wasm32-wasip2 -p port-filter-translator`
//! Upload: `wasmplane module push port-filter target/wasm32-wasip2/release/port_filter_translator.wasm --kind service-translator`

use wasmplane_sdk::RuleBuilder;
use wasmplane_sdk::builders::service_map_element;
use wasmplane_sdk::types::*;

pub const EXPOSE_LABEL: &str = "wasmplane.io/expose";

/// Which label exposes a service.
#[derive(Debug, PartialEq, Eq)]
pub struct Settings {
    pub label: String,
    pub value: String,
}

/// The document as given: both keys or neither (the default), nothing else.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    label: Option<String>,
    value: Option<String>,
}

impl Settings {
    /// The module's settings document; a mistake is an error naming it, so the host refuses
    /// the settings instead of running with a filter nobody asked for.
    pub fn parse(document: &str) -> Result<Settings, String> {
        let given: Document = serde_json::from_str(document).map_err(|e| format!("port-filter settings: {e}"))?;
        match (given.label, given.value) {
            (Some(label), Some(value)) => Ok(Settings { label, value }),
            (None, None) => Ok(Settings { label: EXPOSE_LABEL.to_string(), value: "true".to_string() }),
            // Half a filter: exposing `team=true` or `wasmplane.io/expose=edge` is never
            // what was meant.
            (Some(_), None) => Err("port-filter settings: `label` given without `value`".to_string()),
            (None, Some(_)) => Err("port-filter settings: `value` given without `label`".to_string()),
        }
    }
}

/// The module's own check of its settings (exported as `settings-validation`): the host asks
/// it before it stores settings or puts the module in force with them.
pub fn validate_settings(document: &str) -> Result<(), String> {
    Settings::parse(document).map(|_| ())
}

pub fn translate(prefix: &str, service: &Service, slices: &[EndpointSlice], settings: &Settings) -> Ruleset {
    let mut out = Ruleset { chains: vec![], sets: vec![], map_elements: vec![], warnings: vec![] };
    let exposed = service.labels.iter().any(|l| l.key == settings.label && l.value == settings.value);
    if !exposed {
        out.warnings.push(format!("not exposed: label {}={} is missing", settings.label, settings.value));
        return out;
    }
    for port in service.ports.iter().filter(|p| p.protocol == Protocol::Tcp) {
        let backends: Vec<(String, u16)> = slices
            .iter()
            .flat_map(|s| {
                let target = s.ports.iter().find(|p| p.name == port.name).map(|p| p.port);
                s.endpoints
                    .iter()
                    .filter(|e| e.ready)
                    .filter_map(move |e| Some((e.addresses.first()?.clone(), target?)))
            })
            .collect();
        let chain = format!("{prefix}/tcp/{}", port.port);
        let verdict_map = if backends.is_empty() { "no-endpoint-services" } else { "service-ips" };
        let n = backends.len() as u32;
        let rules = backends
            .iter()
            .enumerate()
            .map(|(i, (addr, target))| {
                let left = n - i as u32;
                let rule = if left > 1 { RuleBuilder::new().random(left, 0) } else { RuleBuilder::new() };
                rule.protocol(Protocol::Tcp).dnat(addr, *target).build()
            })
            .collect();
        for ip in &service.cluster_ips {
            let verdict = if backends.is_empty() { Verdict::Reject } else { Verdict::Goto(chain.clone()) };
            out.map_elements.push(service_map_element(verdict_map, ip, Protocol::Tcp, port.port, verdict));
        }
        if !backends.is_empty() {
            out.chains.push(Chain { name: chain, rules });
        }
    }
    out
}

#[cfg(target_family = "wasm")]
mod export {
    use wasmplane_sdk::service::exports::wasmplane::dataplane::service_translator::Guest;
    use wasmplane_sdk::types::*;

    struct PortFilter;

    impl Guest for PortFilter {
        fn translate(
            _node: NodeContext,
            prefix: String,
            svc: Service,
            slices: Vec<EndpointSlice>,
        ) -> Result<Ruleset, GuestError> {
            wasmplane_sdk::log::debug(&format!("port-filter: {}/{}", svc.namespace, svc.name));
            let settings =
                super::Settings::parse(&wasmplane_sdk::settings::raw()).map_err(|message| GuestError { message })?;
            Ok(super::translate(&prefix, &svc, &slices, &settings))
        }
    }

    wasmplane_sdk::export_service_translator!(PortFilter);
    wasmplane_sdk::export_settings_validator!(super::validate_settings);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_default_to_the_expose_label_and_refuse_what_they_do_not_know() {
        assert_eq!(Settings::parse("{}"), Ok(Settings { label: EXPOSE_LABEL.into(), value: "true".into() }));
        assert_eq!(
            Settings::parse(r#"{"label": "team", "value": "edge"}"#),
            Ok(Settings { label: "team".into(), value: "edge".into() })
        );
        assert!(Settings::parse(r#"{"lable": "team"}"#).unwrap_err().contains("lable"));
        assert!(Settings::parse(r#"{"label": 5}"#).is_err());
    }

    #[test]
    fn the_exported_validator_refuses_missing_ill_typed_and_unknown_keys() {
        assert_eq!(validate_settings("{}"), Ok(()));
        assert_eq!(validate_settings(r#"{"label": "team", "value": "edge"}"#), Ok(()));
        let refused = |document: &str| validate_settings(document).expect_err(document);
        assert!(refused(r#"{"label": "team"}"#).contains("`value`"));
        assert!(refused(r#"{"value": "edge"}"#).contains("`label`"));
        assert!(refused(r#"{"label": "team", "value": true}"#).contains("invalid type: boolean"));
        assert!(refused(r#"{"label": "team", "value": "edge", "port": 80}"#).contains("unknown field `port`"));
        assert!(refused("[]").contains("port-filter settings"));
        assert!(refused("null").contains("port-filter settings"));
    }
}
