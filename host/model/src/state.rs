//! Cluster state (everything the sources saw) and the node-local model derived from it.
//!
//! The sources push [`ClusterEvent`]s into [`ClusterState`], which keeps the objects and the
//! indexes that say which services an event touches. [`NodeLocalModel::update`] recomputes
//! only those services' node-local views and reports the ones that really changed: an
//! EndpointSlice rewrite with identical endpoints, a node heartbeat or an annotation on a
//! service produce no revision, so nothing downstream (guests, kernel) runs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde::Serialize;

use crate::objects::*;

#[derive(Clone, Debug)]
pub enum ClusterObject {
    Service(Service),
    EndpointSlice(EndpointSlice),
    Node(Node),
    Namespace(Namespace),
    Pod(Pod),
    NetworkPolicy(NetworkPolicy),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum ObjectKind {
    Service,
    EndpointSlice,
    Node,
    Namespace,
    Pod,
    NetworkPolicy,
}

impl ClusterObject {
    pub fn kind(&self) -> ObjectKind {
        match self {
            ClusterObject::Service(_) => ObjectKind::Service,
            ClusterObject::EndpointSlice(_) => ObjectKind::EndpointSlice,
            ClusterObject::Node(_) => ObjectKind::Node,
            ClusterObject::Namespace(_) => ObjectKind::Namespace,
            ClusterObject::Pod(_) => ObjectKind::Pod,
            ClusterObject::NetworkPolicy(_) => ObjectKind::NetworkPolicy,
        }
    }
    pub fn key(&self) -> ObjectKey {
        match self {
            ClusterObject::Service(s) => s.key(),
            ClusterObject::EndpointSlice(s) => s.key(),
            ClusterObject::Node(n) => ObjectKey::cluster(&n.name),
            ClusterObject::Namespace(n) => ObjectKey::cluster(&n.name),
            ClusterObject::Pod(p) => ObjectKey::new(&p.namespace, &p.name),
            ClusterObject::NetworkPolicy(p) => ObjectKey::new(&p.namespace, &p.name),
        }
    }
}

#[derive(Clone, Debug)]
pub enum ClusterEvent {
    Upsert(ClusterObject),
    Delete(ObjectKind, ObjectKey),
}

/// What an event may have changed, for the node-local model to recompute.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Touched {
    pub services: BTreeSet<ObjectKey>,
    /// This node's own object changed: the node context of every call may differ.
    pub node_context: bool,
}

impl Touched {
    pub fn merge(&mut self, other: Touched) {
        self.services.extend(other.services);
        self.node_context |= other.node_context;
    }
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.node_context
    }
}

/// Every object the sources reported, with the indexes the model needs.
#[derive(Debug, Default, Clone)]
pub struct ClusterState {
    pub services: BTreeMap<ObjectKey, Service>,
    pub endpoint_slices: BTreeMap<ObjectKey, EndpointSlice>,
    pub nodes: BTreeMap<String, Node>,
    pub namespaces: BTreeMap<String, Namespace>,
    pub pods: BTreeMap<ObjectKey, Pod>,
    pub network_policies: BTreeMap<ObjectKey, NetworkPolicy>,
    /// Service key → the EndpointSlices labelled with it.
    slices_by_service: HashMap<ObjectKey, BTreeSet<ObjectKey>>,
}

impl ClusterState {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn slices_of(&self, service: &ObjectKey) -> impl Iterator<Item = &EndpointSlice> {
        self.slices_by_service
            .get(service)
            .into_iter()
            .flatten()
            .filter_map(|k| self.endpoint_slices.get(k))
    }

    /// Applies one event; `node_name` is this node, whose own Node object feeds the context.
    pub fn apply(&mut self, event: ClusterEvent, node_name: &str) -> Touched {
        let mut touched = Touched::default();
        match event {
            ClusterEvent::Upsert(object) => match object {
                ClusterObject::Service(s) => {
                    touched.services.insert(s.key());
                    self.services.insert(s.key(), s);
                }
                ClusterObject::EndpointSlice(slice) => {
                    let key = slice.key();
                    let old_service = self.endpoint_slices.get(&key).map(EndpointSlice::service_key);
                    if let Some(old_service) = old_service.filter(|s| *s != slice.service_key()) {
                        self.unindex_slice(&old_service, &key);
                        touched.services.insert(old_service);
                    }
                    touched.services.insert(slice.service_key());
                    self.slices_by_service.entry(slice.service_key()).or_default().insert(key.clone());
                    self.endpoint_slices.insert(key, slice);
                }
                ClusterObject::Node(n) => {
                    touched.node_context = n.name == node_name;
                    self.nodes.insert(n.name.clone(), n);
                }
                ClusterObject::Namespace(n) => {
                    self.namespaces.insert(n.name.clone(), n);
                }
                ClusterObject::Pod(p) => {
                    self.pods.insert(ObjectKey::new(&p.namespace, &p.name), p);
                }
                ClusterObject::NetworkPolicy(p) => {
                    self.network_policies.insert(ObjectKey::new(&p.namespace, &p.name), p);
                }
            },
            ClusterEvent::Delete(kind, key) => match kind {
                ObjectKind::Service => {
                    if self.services.remove(&key).is_some() {
                        touched.services.insert(key);
                    }
                }
                ObjectKind::EndpointSlice => {
                    if let Some(old) = self.endpoint_slices.remove(&key) {
                        self.unindex_slice(&old.service_key(), &key);
                        touched.services.insert(old.service_key());
                    }
                }
                ObjectKind::Node => {
                    touched.node_context = key.name == node_name && self.nodes.contains_key(&key.name);
                    self.nodes.remove(&key.name);
                }
                ObjectKind::Namespace => {
                    self.namespaces.remove(&key.name);
                }
                ObjectKind::Pod => {
                    self.pods.remove(&key);
                }
                ObjectKind::NetworkPolicy => {
                    self.network_policies.remove(&key);
                }
            },
        }
        touched
    }

    /// Replaces the whole state with `objects` (a relist or a manifest reload) as the minimal
    /// set of upserts and deletes.
    pub fn replace_all(&mut self, objects: Vec<ClusterObject>, node_name: &str) -> Touched {
        let mut incoming: BTreeMap<(ObjectKind, ObjectKey), ClusterObject> = BTreeMap::new();
        for object in objects {
            incoming.insert((object.kind(), object.key()), object);
        }
        let mut existing: Vec<(ObjectKind, ObjectKey)> = Vec::new();
        existing.extend(self.services.keys().map(|k| (ObjectKind::Service, k.clone())));
        existing.extend(self.endpoint_slices.keys().map(|k| (ObjectKind::EndpointSlice, k.clone())));
        existing.extend(self.nodes.keys().map(|k| (ObjectKind::Node, ObjectKey::cluster(k))));
        existing.extend(self.namespaces.keys().map(|k| (ObjectKind::Namespace, ObjectKey::cluster(k))));
        existing.extend(self.pods.keys().map(|k| (ObjectKind::Pod, k.clone())));
        existing.extend(self.network_policies.keys().map(|k| (ObjectKind::NetworkPolicy, k.clone())));
        let mut touched = Touched::default();
        for (kind, key) in existing {
            if !incoming.contains_key(&(kind, key.clone())) {
                touched.merge(self.apply(ClusterEvent::Delete(kind, key), node_name));
            }
        }
        for (_, object) in incoming {
            if !self.contains_equal(&object) {
                touched.merge(self.apply(ClusterEvent::Upsert(object), node_name));
            }
        }
        touched
    }

    fn contains_equal(&self, object: &ClusterObject) -> bool {
        match object {
            ClusterObject::Service(s) => self.services.get(&s.key()) == Some(s),
            ClusterObject::EndpointSlice(s) => self.endpoint_slices.get(&s.key()) == Some(s),
            ClusterObject::Node(n) => self.nodes.get(&n.name) == Some(n),
            ClusterObject::Namespace(n) => self.namespaces.get(&n.name) == Some(n),
            ClusterObject::Pod(p) => self.pods.get(&ObjectKey::new(&p.namespace, &p.name)) == Some(p),
            ClusterObject::NetworkPolicy(p) => self.network_policies.get(&ObjectKey::new(&p.namespace, &p.name)) == Some(p),
        }
    }

    fn unindex_slice(&mut self, service: &ObjectKey, slice: &ObjectKey) {
        if let Some(set) = self.slices_by_service.get_mut(service) {
            set.remove(slice);
            if set.is_empty() {
                self.slices_by_service.remove(service);
            }
        }
    }
}

/// Facts about this node passed to every guest call.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeContext {
    pub node_name: String,
    pub node_ips: Vec<String>,
    pub cluster_cidrs: Vec<String>,
    pub pod_cidrs: Vec<String>,
}

/// An endpoint as this node sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LocalEndpoint {
    pub addresses: Vec<String>,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<String>,
    pub zone: Option<String>,
    pub is_local: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LocalSlice {
    pub name: String,
    pub endpoints: Vec<LocalEndpoint>,
    pub ports: Vec<EndpointPort>,
}

/// What a service translator needs for one service on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServiceView {
    pub service: Service,
    pub slices: Vec<LocalSlice>,
}

/// One service whose view changed; `view` is `None` when it left the model.
#[derive(Clone, Debug)]
pub struct ServiceChange {
    pub key: ObjectKey,
    pub view: Option<Arc<ServiceView>>,
}

/// The node-local model: per-service views for this node, with a revision that moves only
/// when one of them (or the node context) really changes.
#[derive(Debug, Clone, Serialize)]
pub struct NodeLocalModel {
    pub revision: u64,
    pub context: NodeContext,
    #[serde(serialize_with = "keys_as_strings")]
    pub services: BTreeMap<ObjectKey, Arc<ServiceView>>,
    /// Cluster CIDRs are configuration, not cluster state.
    #[serde(skip)]
    configured_cluster_cidrs: Vec<String>,
}

/// JSON maps need string keys: `namespace/name`.
fn keys_as_strings<S: serde::Serializer, V: Serialize>(map: &BTreeMap<ObjectKey, V>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(map.iter().map(|(k, v)| (k.to_string(), v)))
}

/// The result of one model update.
#[derive(Debug, Default)]
pub struct ModelUpdate {
    pub changed: Vec<ServiceChange>,
    pub context_changed: bool,
}

impl ModelUpdate {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && !self.context_changed
    }
}

impl NodeLocalModel {
    pub fn new(node_name: &str, cluster_cidrs: Vec<String>) -> Self {
        NodeLocalModel {
            revision: 0,
            context: NodeContext { node_name: node_name.to_string(), cluster_cidrs: cluster_cidrs.clone(), ..Default::default() },
            services: BTreeMap::new(),
            configured_cluster_cidrs: cluster_cidrs,
        }
    }

    pub fn node_name(&self) -> &str {
        &self.context.node_name
    }

    /// Recomputes what `touched` names and bumps the revision if anything differs.
    pub fn update(&mut self, cluster: &ClusterState, touched: &Touched) -> ModelUpdate {
        let mut update = ModelUpdate::default();
        if touched.node_context {
            let context = self.compute_context(cluster);
            if context != self.context {
                self.context = context;
                update.context_changed = true;
            }
        }
        for key in &touched.services {
            let view = cluster.services.get(key).filter(|s| s.is_proxied()).map(|s| self.view_of(cluster, s));
            match (self.services.get(key), view) {
                (Some(old), Some(new)) if **old == new => {}
                (None, None) => {}
                (_, Some(new)) => {
                    let new = Arc::new(new);
                    self.services.insert(key.clone(), new.clone());
                    update.changed.push(ServiceChange { key: key.clone(), view: Some(new) });
                }
                (Some(_), None) => {
                    self.services.remove(key);
                    update.changed.push(ServiceChange { key: key.clone(), view: None });
                }
            }
        }
        if !update.is_empty() {
            self.revision += 1;
        }
        update
    }

    fn compute_context(&self, cluster: &ClusterState) -> NodeContext {
        let node = cluster.nodes.get(self.node_name());
        NodeContext {
            node_name: self.context.node_name.clone(),
            node_ips: node.map(|n| n.addresses.clone()).unwrap_or_default(),
            pod_cidrs: node.map(|n| n.pod_cidrs.clone()).unwrap_or_default(),
            cluster_cidrs: self.configured_cluster_cidrs.clone(),
        }
    }

    fn view_of(&self, cluster: &ClusterState, service: &Service) -> ServiceView {
        let mut slices: Vec<LocalSlice> = cluster
            .slices_of(&service.key())
            .map(|slice| {
                let mut endpoints: Vec<LocalEndpoint> = slice
                    .endpoints
                    .iter()
                    .map(|e| LocalEndpoint {
                        addresses: e.addresses.clone(),
                        ready: e.ready,
                        serving: e.serving,
                        terminating: e.terminating,
                        is_local: e.node_name.as_deref() == Some(self.node_name()),
                        node_name: e.node_name.clone(),
                        zone: e.zone.clone(),
                    })
                    .collect();
                // Order carries no meaning; sorting makes equal sets compare equal.
                endpoints.sort_by(|a, b| a.addresses.cmp(&b.addresses));
                LocalSlice { name: slice.name.clone(), endpoints, ports: slice.ports.clone() }
            })
            .collect();
        slices.sort_by(|a, b| a.name.cmp(&b.name));
        ServiceView { service: service.clone(), slices }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, ip: &str) -> Service {
        Service {
            namespace: "default".into(),
            name: name.into(),
            service_type: ServiceType::ClusterIP,
            cluster_ips: vec![ip.into()],
            external_ips: vec![],
            load_balancer_ips: vec![],
            ports: vec![ServicePort { name: "http".into(), protocol: Protocol::Tcp, port: 80, node_port: 0, target_port: TargetPort::Number(8080) }],
            session_affinity_timeout: None,
            external_traffic_policy: TrafficPolicy::Cluster,
            internal_traffic_policy: TrafficPolicy::Cluster,
            labels: Labels::new(),
        }
    }

    fn slice(name: &str, service: &str, ips: &[(&str, &str)]) -> EndpointSlice {
        EndpointSlice {
            namespace: "default".into(),
            name: name.into(),
            service_name: service.into(),
            endpoints: ips
                .iter()
                .map(|(ip, node)| Endpoint {
                    addresses: vec![ip.to_string()],
                    ready: true,
                    serving: true,
                    terminating: false,
                    node_name: Some(node.to_string()),
                    zone: None,
                })
                .collect(),
            ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
        }
    }

    fn apply(state: &mut ClusterState, model: &mut NodeLocalModel, obj: ClusterObject) -> ModelUpdate {
        let touched = state.apply(ClusterEvent::Upsert(obj), "node-a");
        model.update(state, &touched)
    }

    #[test]
    fn revisions_move_only_on_real_change() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec!["10.244.0.0/16".into()]);
        let u = apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        assert_eq!(u.changed.len(), 1);
        assert_eq!(model.revision, 1);

        let u = apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice("web-1", "web", &[("10.244.1.2", "node-a"), ("10.244.2.2", "node-b")])));
        assert_eq!(u.changed.len(), 1);
        assert_eq!(model.revision, 2);
        let view = &model.services[&ObjectKey::new("default", "web")];
        assert!(view.slices[0].endpoints.iter().any(|e| e.is_local && e.addresses[0] == "10.244.1.2"));
        assert!(view.slices[0].endpoints.iter().any(|e| !e.is_local && e.addresses[0] == "10.244.2.2"));

        // Same endpoints in another order: no revision.
        let u = apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice("web-1", "web", &[("10.244.2.2", "node-b"), ("10.244.1.2", "node-a")])));
        assert!(u.is_empty());
        assert_eq!(model.revision, 2);

        // Another node's heartbeat: no revision.
        let node_b = Node { name: "node-b".into(), addresses: vec!["192.168.0.2".into()], pod_cidrs: vec![], labels: Labels::new() };
        assert!(apply(&mut state, &mut model, ClusterObject::Node(node_b)).is_empty());

        // Our own node's addresses: a context change and a revision.
        let node_a = Node { name: "node-a".into(), addresses: vec!["192.168.0.1".into()], pod_cidrs: vec!["10.244.1.0/24".into()], labels: Labels::new() };
        let u = apply(&mut state, &mut model, ClusterObject::Node(node_a));
        assert!(u.context_changed);
        assert_eq!(model.context.node_ips, vec!["192.168.0.1".to_string()]);
        assert_eq!(model.revision, 3);
    }

    #[test]
    fn headless_services_are_not_in_the_model_and_deletes_are_reported() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let mut headless = service("db", "None");
        headless.cluster_ips = vec!["None".into()];
        assert!(apply(&mut state, &mut model, ClusterObject::Service(headless)).is_empty());
        apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        let touched = state.apply(ClusterEvent::Delete(ObjectKind::Service, ObjectKey::new("default", "web")), "node-a");
        let u = model.update(&state, &touched);
        assert_eq!(u.changed.len(), 1);
        assert!(u.changed[0].view.is_none());
        assert!(model.services.is_empty());
    }

    #[test]
    fn replace_all_is_minimal() {
        let mut state = ClusterState::new();
        let objects = vec![
            ClusterObject::Service(service("web", "10.96.0.10")),
            ClusterObject::Service(service("api", "10.96.0.11")),
            ClusterObject::EndpointSlice(slice("web-1", "web", &[("10.244.1.2", "node-a")])),
        ];
        let t = state.replace_all(objects.clone(), "node-a");
        assert_eq!(t.services.len(), 2);
        assert!(state.replace_all(objects.clone(), "node-a").is_empty());
        let t = state.replace_all(objects[..2].to_vec(), "node-a");
        assert_eq!(t.services.into_iter().collect::<Vec<_>>(), vec![ObjectKey::new("default", "web")]);
        assert_eq!(state.slices_of(&ObjectKey::new("default", "web")).count(), 0);
    }
}
