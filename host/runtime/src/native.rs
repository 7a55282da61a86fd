//! The default service translator compiled natively, as the reference a Wasm guest is
//! measured against (feature `native-translator`: the runtime bench and the performance
//! harness). It takes the same model views as [`crate::LoadedModule::translator`]'s sessions
//! and converts them with the same code ([`crate::convert`]), into the guest SDK's types
//! instead of the host's WIT types.

use wasmplane_guest_service_translator as translator;
use wasmplane_model as m;
use wasmplane_model::ToStd;
use wasmplane_model::state as ms;

pub use wasmplane_sdk::types as sdk;

mod to_sdk {
    use super::*;
    crate::convert::service_conversions!(wasmplane_sdk::types);
}

pub use to_sdk::{node_context, service, slices};

/// What a Wasm session's `translate` does, natively: model → SDK types, then the translation.
pub fn translate(
    context: &sdk::NodeContext,
    prefix: &str,
    view: &ms::ServiceView,
) -> Result<sdk::Ruleset, sdk::GuestError> {
    translator::translate(context, prefix, &service(&view.service), &slices(view))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{GuestKind, Limits, NoLookups, Runtime};
    use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext, ServiceView};

    /// A service that takes most of the translator's paths: two ports (one named target),
    /// a node port, affinity, local and remote, ready and terminating endpoints.
    fn view() -> ServiceView {
        let endpoint = |ip: &str, local: bool, ready: bool| LocalEndpoint {
            addresses: vec![ip.into()],
            ready,
            serving: true,
            terminating: !ready,
            node_name: Some(if local { "node-0" } else { "node-1" }.into()),
            zone: None,
            is_local: local,
        };
        ServiceView {
            service: m::Service {
                namespace: "shop".into(),
                name: "web".into(),
                service_type: m::ServiceType::NodePort,
                cluster_ips: vec!["10.96.0.10".into()],
                external_ips: vec!["203.0.113.5".into()],
                load_balancer_ips: vec![],
                ports: vec![
                    m::ServicePort {
                        name: "http".into(),
                        protocol: m::Protocol::Tcp,
                        port: 80,
                        node_port: 30080,
                        target_port: m::TargetPort::Number(8080),
                    },
                    m::ServicePort {
                        name: "dns".into(),
                        protocol: m::Protocol::Udp,
                        port: 53,
                        node_port: 0,
                        target_port: m::TargetPort::Name("dns".into()),
                    },
                ],
                session_affinity_timeout: Some(600),
                external_traffic_policy: m::TrafficPolicy::Local,
                internal_traffic_policy: m::TrafficPolicy::Cluster,
                health_check_node_port: 0,
                load_balancer_source_ranges: vec![],
                labels: [("app".into(), "web".into())].into_iter().collect(),
                global: false,
                cluster_affinity: m::ClusterAffinity::None,
                created_unix: None,
            }
            .into(),
            slices: vec![LocalSlice {
                name: "web-1".into(),
                endpoints: vec![
                    endpoint("10.244.0.5", true, true),
                    endpoint("10.244.1.6", false, true),
                    endpoint("10.244.1.7", false, false),
                ],
                ports: vec![
                    m::EndpointPort { name: "http".into(), protocol: m::Protocol::Tcp, port: 8080 },
                    m::EndpointPort { name: "dns".into(), protocol: m::Protocol::Udp, port: 5353 },
                ],
            }],
        }
    }

    /// The comparison is only fair if both sides do the same work: the native translator
    /// returns what the guest built for the typed world returns for the same view, rule for
    /// rule (the two sets of generated types print alike), and the shipped (archived) one the
    /// same rules, its map elements in another order.
    #[test]
    fn native_and_wasm_translate_alike() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let load = |bytes| runtime.load("t", bytes, Some(GuestKind::ServiceTranslator), usize::MAX).unwrap();
        let module = load(wasmplane_guest_artifacts::test_programs::TRANSLATOR_TYPED);
        let shipped = load(wasmplane_guest_artifacts::SERVICE_TRANSLATOR);
        let mut session = module.translator(Arc::new(NoLookups)).unwrap();
        let mut shipped = shipped.translator(Arc::new(NoLookups)).unwrap();
        let ctx = NodeContext {
            node_name: "node-0".into(),
            node_ips: vec!["192.168.0.1".into()],
            cluster_cidrs: vec!["10.244.0.0/16".into()],
            ..Default::default()
        };
        let view = view();
        let wasm = session.translate(&ctx, "svc/shop/web", &view).unwrap();
        let native = translate(&node_context(&ctx), "svc/shop/web", &view).unwrap();
        assert!(native.chains.len() > 2 && !native.map_elements.is_empty(), "the view takes several paths: {native:?}");
        assert_eq!(format!("{native:?}"), format!("{wasm:?}"));
        let sorted = |elements: Vec<String>| {
            let mut elements = elements;
            elements.sort();
            elements
        };
        let archived = shipped.translate(&ctx, "svc/shop/web", &view).unwrap();
        assert_eq!(format!("{:?}", archived.chains), format!("{:?}", native.chains));
        assert_eq!(
            sorted(archived.map_elements.iter().map(|e| format!("{e:?}")).collect()),
            sorted(native.map_elements.iter().map(|e| format!("{e:?}")).collect())
        );
        assert_eq!(format!("{:?}", service(&view.service)), format!("{:?}", crate::convert::service(&view.service)));
    }
}
