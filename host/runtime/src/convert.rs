//! Model types to WIT types (what is lowered into a guest) and back for selectors.
//!
//! The service conversions are one body for two sets of types that wit-bindgen generates from
//! the same WIT: the host's, lowered into a guest, and the guest SDK's, which the native
//! reference translator takes ([`crate::native`]), so both sides of a Wasm/native
//! comparison pay for the same conversion.

use wasmplane_model as m;
use wasmplane_model::ToStd;
use wasmplane_model::state as ms;

/// Model → `$types` for what a service translator takes (`$types`: a module of the
/// `wasmplane:dataplane/types` interface's generated types). The caller's scope names
/// `m` (the model), `ms` (its state) and `ToStd`, as here.
macro_rules! service_conversions {
    ($types:path) => {
        use $types as wit;

        pub fn protocol(p: m::Protocol) -> wit::Protocol {
            match p {
                m::Protocol::Tcp => wit::Protocol::Tcp,
                m::Protocol::Udp => wit::Protocol::Udp,
                m::Protocol::Sctp => wit::Protocol::Sctp,
            }
        }

        fn labels(l: &m::Labels) -> Vec<wit::Label> {
            l.iter().map(|(k, v)| wit::Label { key: k.to_std(), value: v.to_std() }).collect()
        }

        fn policy(p: m::TrafficPolicy) -> wit::TrafficPolicy {
            match p {
                m::TrafficPolicy::Cluster => wit::TrafficPolicy::Cluster,
                m::TrafficPolicy::Local => wit::TrafficPolicy::Local,
            }
        }

        pub fn node_context(c: &ms::NodeContext) -> wit::NodeContext {
            wit::NodeContext {
                node_name: c.node_name.to_std(),
                node_ips: c.node_ips.to_std(),
                cluster_cidrs: c.cluster_cidrs.to_std(),
                pod_cidrs: c.pod_cidrs.to_std(),
            }
        }

        pub fn service(s: &m::Service) -> wit::Service {
            wit::Service {
                namespace: s.namespace.to_std(),
                name: s.name.to_std(),
                service_type: match s.service_type {
                    m::ServiceType::ClusterIP => wit::ServiceType::ClusterIp,
                    m::ServiceType::NodePort => wit::ServiceType::NodePort,
                    m::ServiceType::LoadBalancer => wit::ServiceType::LoadBalancer,
                    m::ServiceType::ExternalName => wit::ServiceType::ExternalName,
                },
                cluster_ips: s.cluster_ips.to_std(),
                external_ips: s.external_ips.to_std(),
                load_balancer_ips: s.load_balancer_ips.to_std(),
                ports: s
                    .ports
                    .iter()
                    .map(|p| wit::ServicePort {
                        name: p.name.to_std(),
                        protocol: protocol(p.protocol),
                        port: p.port,
                        node_port: p.node_port,
                        target_port: match &p.target_port {
                            m::TargetPort::Number(n) => wit::TargetPort::Number(*n),
                            m::TargetPort::Name(n) => wit::TargetPort::Name(n.to_std()),
                        },
                    })
                    .collect(),
                session_affinity_timeout: s.session_affinity_timeout,
                external_traffic_policy: policy(s.external_traffic_policy),
                internal_traffic_policy: policy(s.internal_traffic_policy),
                labels: labels(&s.labels),
            }
        }

        pub fn slices(view: &ms::ServiceView) -> Vec<wit::EndpointSlice> {
            view.slices
                .iter()
                .map(|s| wit::EndpointSlice {
                    name: s.name.to_std(),
                    endpoints: s
                        .endpoints
                        .iter()
                        .map(|e| wit::Endpoint {
                            addresses: e.addresses.to_std(),
                            ready: e.ready,
                            serving: e.serving,
                            terminating: e.terminating,
                            node_name: e.node_name.to_std(),
                            zone: e.zone.to_std(),
                            is_local: e.is_local,
                        })
                        .collect(),
                    ports: s
                        .ports
                        .iter()
                        .map(|p| wit::EndpointPort {
                            name: p.name.to_std(),
                            protocol: protocol(p.protocol),
                            port: p.port,
                        })
                        .collect(),
                })
                .collect()
        }
    };
}
#[cfg(feature = "native-translator")]
pub(crate) use service_conversions;

service_conversions!(crate::bindings::service::wasmplane::dataplane::types);

pub fn pod(p: &m::Pod) -> wit::Pod {
    wit::Pod {
        namespace: p.namespace.to_std(),
        name: p.name.to_std(),
        ips: p.ips.to_std(),
        node_name: p.node_name.to_std(),
        labels: labels(&p.labels),
        ports: p
            .ports
            .iter()
            .map(|c| wit::ContainerPort { name: c.name.to_std(), protocol: protocol(c.protocol), port: c.port })
            .collect(),
        host_network: p.host_network,
    }
}

pub fn namespace(n: &m::Namespace) -> wit::Namespace {
    wit::Namespace { name: n.name.to_std(), labels: labels(&n.labels) }
}

pub fn selector_from_wit(s: wit::LabelSelector) -> m::LabelSelector {
    m::LabelSelector {
        match_labels: s.match_labels.into_iter().map(|l| (l.key.into(), l.value.into())).collect(),
        match_expressions: s
            .match_expressions
            .into_iter()
            .map(|r| m::SelectorRequirement {
                key: r.key.into(),
                operator: match r.operator {
                    wit::SelectorOperator::In => m::SelectorOperator::In,
                    wit::SelectorOperator::NotIn => m::SelectorOperator::NotIn,
                    wit::SelectorOperator::Exists => m::SelectorOperator::Exists,
                    wit::SelectorOperator::DoesNotExist => m::SelectorOperator::DoesNotExist,
                },
                values: r.values.into_iter().map(Into::into).collect(),
            })
            .collect(),
    }
}

/// WIT → model for what a service translator takes: a recording's inputs (WIT) given to an
/// archived translator, which is given the model's archive. Kept to what translation reads.
pub fn node_context_from_wit(c: &wit::NodeContext) -> ms::NodeContext {
    let texts = |list: &[String]| list.iter().map(|s| m::CompactString::from(s.as_str())).collect();
    ms::NodeContext {
        node_name: c.node_name.as_str().into(),
        node_ips: texts(&c.node_ips),
        cluster_cidrs: texts(&c.cluster_cidrs),
        pod_cidrs: texts(&c.pod_cidrs),
        zone: None,
    }
}

fn protocol_from_wit(p: wit::Protocol) -> m::Protocol {
    match p {
        wit::Protocol::Tcp => m::Protocol::Tcp,
        wit::Protocol::Udp => m::Protocol::Udp,
        wit::Protocol::Sctp => m::Protocol::Sctp,
    }
}

fn policy_from_wit(p: wit::TrafficPolicy) -> m::TrafficPolicy {
    match p {
        wit::TrafficPolicy::Cluster => m::TrafficPolicy::Cluster,
        wit::TrafficPolicy::Local => m::TrafficPolicy::Local,
    }
}

/// See [`node_context_from_wit`].
pub fn view_from_wit(s: &wit::Service, slices: &[wit::EndpointSlice]) -> ms::ServiceView {
    let texts = |list: &[String]| list.iter().map(|s| m::CompactString::from(s.as_str())).collect();
    let service = m::Service {
        service_type: match s.service_type {
            wit::ServiceType::ClusterIp => m::ServiceType::ClusterIP,
            wit::ServiceType::NodePort => m::ServiceType::NodePort,
            wit::ServiceType::LoadBalancer => m::ServiceType::LoadBalancer,
            wit::ServiceType::ExternalName => m::ServiceType::ExternalName,
        },
        cluster_ips: texts(&s.cluster_ips),
        external_ips: texts(&s.external_ips),
        load_balancer_ips: texts(&s.load_balancer_ips),
        session_affinity_timeout: s.session_affinity_timeout,
        external_traffic_policy: policy_from_wit(s.external_traffic_policy),
        internal_traffic_policy: policy_from_wit(s.internal_traffic_policy),
        labels: s.labels.iter().map(|l| (l.key.as_str().into(), l.value.as_str().into())).collect(),
        ..m::Service::cluster_ip(
            &s.namespace,
            &s.name,
            "",
            (s.ports.iter())
                .map(|p| m::ServicePort {
                    name: p.name.as_str().into(),
                    protocol: protocol_from_wit(p.protocol),
                    port: p.port,
                    node_port: p.node_port,
                    target_port: match &p.target_port {
                        wit::TargetPort::Number(n) => m::TargetPort::Number(*n),
                        wit::TargetPort::Name(n) => m::TargetPort::Name(n.as_str().into()),
                    },
                })
                .collect(),
        )
    };
    let slices = (slices.iter())
        .map(|slice| ms::LocalSlice {
            name: slice.name.as_str().into(),
            endpoints: (slice.endpoints.iter())
                .map(|e| ms::LocalEndpoint {
                    addresses: texts(&e.addresses),
                    ready: e.ready,
                    serving: e.serving,
                    terminating: e.terminating,
                    node_name: e.node_name.as_deref().map(Into::into),
                    zone: e.zone.as_deref().map(Into::into),
                    is_local: e.is_local,
                })
                .collect(),
            ports: (slice.ports.iter())
                .map(|p| m::EndpointPort {
                    name: p.name.as_str().into(),
                    protocol: protocol_from_wit(p.protocol),
                    port: p.port,
                })
                .collect(),
        })
        .collect();
    ms::ServiceView { service: std::sync::Arc::new(service), slices }
}
