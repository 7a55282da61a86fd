//! Model ↔ wire conversions.
//!
//! Model → proto is infallible (`From`): the server only ever encodes what the model holds.
//! Proto → model is checked (`TryFrom`): a sink written in Rust gets the host's own types
//! back, and a message from a newer or foreign server that does not fit them (a port above
//! 65535, an enum value this version does not know, a missing required message) is a typed
//! error instead of a silently wrong value.

use std::sync::Arc;

use wasmplane_model::state::{LocalEndpoint, LocalSlice, NodeContext};
use wasmplane_model::{
    ClusterAffinity, EndpointPort, IntoModel, ObjectKey, Protocol, Service, ServicePort, ServiceType, ServiceView,
    TargetPort, ToStd, TrafficPolicy,
};

use crate::feed::NodeFacts;
use crate::proto;

/// Why a message from the wire does not fit the model's types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConversionError {
    #[error("{0} is missing")]
    Missing(&'static str),
    #[error("{field} = {value} is not a known value")]
    UnknownEnum { field: &'static str, value: i32 },
    #[error("{field} = {value} is not a port number")]
    PortOutOfRange { field: &'static str, value: u32 },
    #[error("{field} = {value:?} is not a CIDR")]
    InvalidCidr { field: &'static str, value: String },
}

// ---- model → proto ----

impl From<&ObjectKey> for proto::ObjectKey {
    fn from(k: &ObjectKey) -> Self {
        proto::ObjectKey { namespace: k.namespace.to_std(), name: k.name.to_std() }
    }
}

impl From<&NodeFacts> for proto::NodeContext {
    fn from(node: &NodeFacts) -> Self {
        let c = &node.context;
        proto::NodeContext {
            node_name: c.node_name.to_std(),
            node_ips: c.node_ips.to_std(),
            cluster_cidrs: c.cluster_cidrs.to_std(),
            pod_cidrs: c.pod_cidrs.to_std(),
            zone: c.zone.to_std(),
            being_deleted: node.being_deleted,
            service_cidrs: node.service_cidrs.iter().map(ToString::to_string).collect(),
        }
    }
}

impl From<Protocol> for proto::Protocol {
    fn from(p: Protocol) -> Self {
        match p {
            Protocol::Tcp => proto::Protocol::Tcp,
            Protocol::Udp => proto::Protocol::Udp,
            Protocol::Sctp => proto::Protocol::Sctp,
        }
    }
}

impl From<ServiceType> for proto::ServiceType {
    fn from(t: ServiceType) -> Self {
        match t {
            ServiceType::ClusterIP => proto::ServiceType::ClusterIp,
            ServiceType::NodePort => proto::ServiceType::NodePort,
            ServiceType::LoadBalancer => proto::ServiceType::LoadBalancer,
            ServiceType::ExternalName => proto::ServiceType::ExternalName,
        }
    }
}

impl From<ClusterAffinity> for proto::ClusterAffinity {
    fn from(a: ClusterAffinity) -> Self {
        match a {
            ClusterAffinity::None => proto::ClusterAffinity::None,
            ClusterAffinity::Local => proto::ClusterAffinity::Local,
            ClusterAffinity::Remote => proto::ClusterAffinity::Remote,
        }
    }
}

impl From<TrafficPolicy> for proto::TrafficPolicy {
    fn from(p: TrafficPolicy) -> Self {
        match p {
            TrafficPolicy::Cluster => proto::TrafficPolicy::Cluster,
            TrafficPolicy::Local => proto::TrafficPolicy::Local,
        }
    }
}

impl From<&ServicePort> for proto::ServicePort {
    fn from(p: &ServicePort) -> Self {
        use proto::service_port::TargetPort as T;
        proto::ServicePort {
            name: p.name.to_std(),
            protocol: proto::Protocol::from(p.protocol).into(),
            port: p.port.into(),
            node_port: p.node_port.into(),
            target_port: Some(match &p.target_port {
                TargetPort::Number(n) => T::TargetPortNumber((*n).into()),
                TargetPort::Name(name) => T::TargetPortName(name.to_std()),
            }),
        }
    }
}

impl From<&Service> for proto::Service {
    fn from(s: &Service) -> Self {
        proto::Service {
            namespace: s.namespace.to_std(),
            name: s.name.to_std(),
            r#type: proto::ServiceType::from(s.service_type).into(),
            cluster_ips: s.cluster_ips.to_std(),
            external_ips: s.external_ips.to_std(),
            load_balancer_ips: s.load_balancer_ips.to_std(),
            ports: s.ports.iter().map(Into::into).collect(),
            session_affinity: s
                .session_affinity_timeout
                .map(|timeout_seconds| proto::SessionAffinity { timeout_seconds }),
            external_traffic_policy: proto::TrafficPolicy::from(s.external_traffic_policy).into(),
            internal_traffic_policy: proto::TrafficPolicy::from(s.internal_traffic_policy).into(),
            health_check_node_port: s.health_check_node_port.into(),
            load_balancer_source_ranges: s.load_balancer_source_ranges.iter().map(ToString::to_string).collect(),
            global: s.global,
            cluster_affinity: proto::ClusterAffinity::from(s.cluster_affinity).into(),
            created_unix: s.created_unix,
            labels: s.labels.iter().map(|(k, v)| (k.to_std(), v.to_std())).collect(),
        }
    }
}

impl From<&EndpointPort> for proto::EndpointPort {
    fn from(p: &EndpointPort) -> Self {
        proto::EndpointPort {
            name: p.name.to_std(),
            protocol: proto::Protocol::from(p.protocol).into(),
            port: p.port.into(),
        }
    }
}

impl From<&LocalEndpoint> for proto::LocalEndpoint {
    fn from(e: &LocalEndpoint) -> Self {
        proto::LocalEndpoint {
            addresses: e.addresses.to_std(),
            ready: e.ready,
            serving: e.serving,
            terminating: e.terminating,
            is_local: e.is_local,
            node_name: e.node_name.to_std(),
            zone: e.zone.to_std(),
        }
    }
}

impl From<&LocalSlice> for proto::LocalSlice {
    fn from(s: &LocalSlice) -> Self {
        proto::LocalSlice {
            name: s.name.to_std(),
            endpoints: s.endpoints.iter().map(Into::into).collect(),
            ports: s.ports.iter().map(Into::into).collect(),
        }
    }
}

impl From<&ServiceView> for proto::ServiceView {
    fn from(v: &ServiceView) -> Self {
        proto::ServiceView { service: Some((&*v.service).into()), slices: v.slices.iter().map(Into::into).collect() }
    }
}

impl From<&Arc<ServiceView>> for proto::ServiceView {
    fn from(v: &Arc<ServiceView>) -> Self {
        proto::ServiceView::from(&**v)
    }
}

// ---- proto → model ----

fn port(field: &'static str, value: u32) -> Result<u16, ConversionError> {
    u16::try_from(value).map_err(|_| ConversionError::PortOutOfRange { field, value })
}

fn protocol(field: &'static str, value: i32) -> Result<Protocol, ConversionError> {
    match proto::Protocol::try_from(value) {
        Ok(proto::Protocol::Tcp) => Ok(Protocol::Tcp),
        Ok(proto::Protocol::Udp) => Ok(Protocol::Udp),
        Ok(proto::Protocol::Sctp) => Ok(Protocol::Sctp),
        Ok(proto::Protocol::Unspecified) | Err(_) => Err(ConversionError::UnknownEnum { field, value }),
    }
}

fn traffic_policy(field: &'static str, value: i32) -> Result<TrafficPolicy, ConversionError> {
    match proto::TrafficPolicy::try_from(value) {
        Ok(proto::TrafficPolicy::Cluster) => Ok(TrafficPolicy::Cluster),
        Ok(proto::TrafficPolicy::Local) => Ok(TrafficPolicy::Local),
        Ok(proto::TrafficPolicy::Unspecified) | Err(_) => Err(ConversionError::UnknownEnum { field, value }),
    }
}

impl From<proto::ObjectKey> for ObjectKey {
    fn from(k: proto::ObjectKey) -> Self {
        ObjectKey { namespace: k.namespace.into_model(), name: k.name.into_model() }
    }
}

impl TryFrom<proto::NodeContext> for NodeFacts {
    type Error = ConversionError;
    fn try_from(c: proto::NodeContext) -> Result<Self, ConversionError> {
        let service_cidrs = c
            .service_cidrs
            .into_iter()
            .map(|cidr| {
                cidr.parse()
                    .map_err(|_| ConversionError::InvalidCidr { field: "NodeContext.service_cidrs", value: cidr })
            })
            .collect::<Result<_, _>>()?;
        let context = NodeContext {
            node_name: c.node_name.into_model(),
            node_ips: c.node_ips.into_model(),
            cluster_cidrs: c.cluster_cidrs.into_model(),
            pod_cidrs: c.pod_cidrs.into_model(),
            zone: c.zone.into_model(),
        };
        Ok(NodeFacts { context, being_deleted: c.being_deleted, service_cidrs })
    }
}

impl TryFrom<proto::ServicePort> for ServicePort {
    type Error = ConversionError;
    fn try_from(p: proto::ServicePort) -> Result<Self, ConversionError> {
        use proto::service_port::TargetPort as T;
        Ok(ServicePort {
            protocol: protocol("ServicePort.protocol", p.protocol)?,
            port: port("ServicePort.port", p.port)?,
            node_port: port("ServicePort.node_port", p.node_port)?,
            target_port: match p.target_port {
                Some(T::TargetPortNumber(n)) => TargetPort::Number(port("ServicePort.target_port_number", n)?),
                Some(T::TargetPortName(name)) => TargetPort::Name(name.into_model()),
                None => return Err(ConversionError::Missing("ServicePort.target_port")),
            },
            name: p.name.into_model(),
        })
    }
}

impl TryFrom<proto::Service> for Service {
    type Error = ConversionError;
    fn try_from(s: proto::Service) -> Result<Self, ConversionError> {
        let service_type = match proto::ServiceType::try_from(s.r#type) {
            Ok(proto::ServiceType::ClusterIp) => ServiceType::ClusterIP,
            Ok(proto::ServiceType::NodePort) => ServiceType::NodePort,
            Ok(proto::ServiceType::LoadBalancer) => ServiceType::LoadBalancer,
            Ok(proto::ServiceType::ExternalName) => ServiceType::ExternalName,
            Ok(proto::ServiceType::Unspecified) | Err(_) => {
                return Err(ConversionError::UnknownEnum { field: "Service.type", value: s.r#type });
            }
        };
        Ok(Service {
            service_type,
            external_traffic_policy: traffic_policy("Service.external_traffic_policy", s.external_traffic_policy)?,
            internal_traffic_policy: traffic_policy("Service.internal_traffic_policy", s.internal_traffic_policy)?,
            health_check_node_port: port("Service.health_check_node_port", s.health_check_node_port)?,
            load_balancer_source_ranges: s
                .load_balancer_source_ranges
                .into_iter()
                .map(|range| {
                    range.parse().map_err(|_| ConversionError::InvalidCidr {
                        field: "Service.load_balancer_source_ranges",
                        value: range,
                    })
                })
                .collect::<Result<_, _>>()?,
            ports: s.ports.into_iter().map(TryInto::try_into).collect::<Result<_, _>>()?,
            session_affinity_timeout: s.session_affinity.map(|a| a.timeout_seconds),
            namespace: s.namespace.into_model(),
            name: s.name.into_model(),
            cluster_ips: s.cluster_ips.into_model(),
            external_ips: s.external_ips.into_model(),
            load_balancer_ips: s.load_balancer_ips.into_model(),
            labels: s.labels.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
            global: s.global,
            cluster_affinity: match proto::ClusterAffinity::try_from(s.cluster_affinity) {
                Ok(proto::ClusterAffinity::None) => ClusterAffinity::None,
                Ok(proto::ClusterAffinity::Local) => ClusterAffinity::Local,
                Ok(proto::ClusterAffinity::Remote) => ClusterAffinity::Remote,
                Err(_) => {
                    return Err(ConversionError::UnknownEnum {
                        field: "Service.cluster_affinity",
                        value: s.cluster_affinity,
                    });
                }
            },
            created_unix: s.created_unix,
        })
    }
}

impl TryFrom<proto::EndpointPort> for EndpointPort {
    type Error = ConversionError;
    fn try_from(p: proto::EndpointPort) -> Result<Self, ConversionError> {
        Ok(EndpointPort {
            protocol: protocol("EndpointPort.protocol", p.protocol)?,
            port: port("EndpointPort.port", p.port)?,
            name: p.name.into_model(),
        })
    }
}

impl From<proto::LocalEndpoint> for LocalEndpoint {
    fn from(e: proto::LocalEndpoint) -> Self {
        LocalEndpoint {
            addresses: e.addresses.into_model(),
            ready: e.ready,
            serving: e.serving,
            terminating: e.terminating,
            is_local: e.is_local,
            node_name: e.node_name.into_model(),
            zone: e.zone.into_model(),
        }
    }
}

impl TryFrom<proto::LocalSlice> for LocalSlice {
    type Error = ConversionError;
    fn try_from(s: proto::LocalSlice) -> Result<Self, ConversionError> {
        Ok(LocalSlice {
            name: s.name.into_model(),
            endpoints: s.endpoints.into_iter().map(Into::into).collect(),
            ports: s.ports.into_iter().map(TryInto::try_into).collect::<Result<_, _>>()?,
        })
    }
}

impl TryFrom<proto::ServiceView> for ServiceView {
    type Error = ConversionError;
    fn try_from(v: proto::ServiceView) -> Result<Self, ConversionError> {
        Ok(ServiceView {
            service: Arc::new(v.service.ok_or(ConversionError::Missing("ServiceView.service"))?.try_into()?),
            slices: v.slices.into_iter().map(TryInto::try_into).collect::<Result<_, _>>()?,
        })
    }
}

/// Fixtures shared by the unit tests of this crate.
#[cfg(test)]
pub(crate) mod tests_support {
    use wasmplane_model::Labels;

    use super::*;

    /// A service view that exercises every field and enum value the wire has.
    pub(crate) fn sample_view() -> ServiceView {
        ServiceView {
            service: Service {
                namespace: "shop".into(),
                name: "web".into(),
                service_type: ServiceType::LoadBalancer,
                cluster_ips: vec!["10.96.0.10".into(), "fd00::10".into()],
                external_ips: vec!["203.0.113.7".into()],
                load_balancer_ips: vec!["198.51.100.1".into()],
                ports: vec![
                    ServicePort {
                        name: "http".into(),
                        protocol: Protocol::Tcp,
                        port: 80,
                        node_port: 30080,
                        target_port: TargetPort::Number(8080),
                    },
                    ServicePort {
                        name: "dns".into(),
                        protocol: Protocol::Udp,
                        port: 53,
                        node_port: 0,
                        target_port: TargetPort::Name("dns".into()),
                    },
                    ServicePort {
                        name: "sig".into(),
                        protocol: Protocol::Sctp,
                        port: 9000,
                        node_port: 0,
                        target_port: TargetPort::Number(9000),
                    },
                ],
                session_affinity_timeout: Some(10800),
                external_traffic_policy: TrafficPolicy::Local,
                internal_traffic_policy: TrafficPolicy::Cluster,
                health_check_node_port: 31999,
                load_balancer_source_ranges: vec!["192.0.2.0/24".parse().unwrap(), "2001:db8::/32".parse().unwrap()],
                labels: Labels::from([("app".into(), "web".into()), ("tier".into(), "front".into())]),
                global: true,
                cluster_affinity: ClusterAffinity::Remote,
                created_unix: Some(1_765_000_000),
            }
            .into(),
            slices: vec![LocalSlice {
                name: "web-abc".into(),
                endpoints: vec![
                    LocalEndpoint {
                        addresses: vec!["10.244.1.2".into()],
                        ready: true,
                        serving: true,
                        terminating: false,
                        node_name: Some("node-a".into()),
                        zone: Some("zone-a".into()),
                        is_local: true,
                    },
                    LocalEndpoint {
                        addresses: vec!["10.244.2.2".into()],
                        ready: false,
                        serving: true,
                        terminating: true,
                        node_name: None,
                        zone: None,
                        is_local: false,
                    },
                ],
                ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
            }],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::sample_view;
    use super::*;

    #[test]
    fn service_views_round_trip() {
        let view = sample_view();
        let wire = proto::ServiceView::from(&view);
        assert_eq!(ServiceView::try_from(wire).unwrap(), view);

        let mut plain = sample_view();
        std::sync::Arc::make_mut(&mut plain.service).session_affinity_timeout = None;
        std::sync::Arc::make_mut(&mut plain.service).service_type = ServiceType::ExternalName;
        assert_eq!(ServiceView::try_from(proto::ServiceView::from(&plain)).unwrap(), plain);
    }

    #[test]
    fn node_context_round_trips() {
        let context = NodeContext {
            node_name: "node-a".into(),
            node_ips: vec!["192.168.0.1".into()],
            cluster_cidrs: vec!["10.244.0.0/16".into()],
            pod_cidrs: vec!["10.244.1.0/24".into()],
            zone: Some("zone-a".into()),
        };
        for being_deleted in [false, true] {
            let node = NodeFacts {
                context: context.clone(),
                being_deleted,
                service_cidrs: vec!["10.96.0.0/16".parse().unwrap(), "fd00:96::/112".parse().unwrap()],
            };
            assert_eq!(NodeFacts::try_from(proto::NodeContext::from(&node)), Ok(node));
        }
        let mut wire = proto::NodeContext::from(&NodeFacts::from(context));
        wire.service_cidrs = vec!["10.96.0.0/33".into()];
        assert_eq!(
            NodeFacts::try_from(wire),
            Err(ConversionError::InvalidCidr { field: "NodeContext.service_cidrs", value: "10.96.0.0/33".into() })
        );
    }

    #[test]
    fn values_that_do_not_fit_are_typed_errors() {
        let mut wire = proto::ServiceView::from(&sample_view());
        wire.service.as_mut().unwrap().ports[0].port = 70000;
        assert_eq!(
            ServiceView::try_from(wire.clone()),
            Err(ConversionError::PortOutOfRange { field: "ServicePort.port", value: 70000 })
        );
        wire.service.as_mut().unwrap().ports[0].port = 80;
        wire.service.as_mut().unwrap().r#type = 42;
        assert_eq!(
            ServiceView::try_from(wire.clone()),
            Err(ConversionError::UnknownEnum { field: "Service.type", value: 42 })
        );
        wire.service.as_mut().unwrap().r#type = proto::ServiceType::ClusterIp.into();
        wire.slices[0].ports[0].protocol = proto::Protocol::Unspecified.into();
        assert_eq!(
            ServiceView::try_from(wire.clone()),
            Err(ConversionError::UnknownEnum { field: "EndpointPort.protocol", value: 0 })
        );
        wire.service = None;
        assert_eq!(ServiceView::try_from(wire), Err(ConversionError::Missing("ServiceView.service")));
    }
}
