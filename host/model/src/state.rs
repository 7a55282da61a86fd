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

use crate::CompactString;
use crate::objects::*;

#[derive(Clone, Debug)]
pub enum ClusterObject {
    Service(Service),
    EndpointSlice(EndpointSlice),
    Node(Node),
    Namespace(Namespace),
    Pod(Pod),
    NetworkPolicy(NetworkPolicy),
    ServiceCidr(ServiceCidr),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum ObjectKind {
    Service,
    EndpointSlice,
    Node,
    Namespace,
    Pod,
    NetworkPolicy,
    ServiceCidr,
}

impl ClusterObject {
    /// Gives back the spare capacity of its vectors. Conversions collect through filters and
    /// pushes, which leave room for four entries where most objects have one, and the cluster
    /// index keeps every object for the life of the host (~1 KiB a service at 10k services).
    pub fn shrink_to_fit(&mut self) {
        match self {
            ClusterObject::Service(s) => {
                for ips in [&mut s.cluster_ips, &mut s.external_ips, &mut s.load_balancer_ips] {
                    ips.shrink_to_fit();
                }
                s.ports.shrink_to_fit();
                s.load_balancer_source_ranges.shrink_to_fit();
            }
            ClusterObject::EndpointSlice(slice) => {
                slice.endpoints.shrink_to_fit();
                for e in &mut slice.endpoints {
                    e.addresses.shrink_to_fit();
                    e.for_zones.shrink_to_fit();
                    e.for_nodes.shrink_to_fit();
                }
                slice.ports.shrink_to_fit();
            }
            ClusterObject::Node(n) => {
                n.addresses.shrink_to_fit();
                n.pod_cidrs.shrink_to_fit();
            }
            ClusterObject::Pod(p) => {
                p.ips.shrink_to_fit();
                p.ports.shrink_to_fit();
            }
            // Labels are exact already; policies and service CIDRs are few.
            ClusterObject::Namespace(_) | ClusterObject::NetworkPolicy(_) | ClusterObject::ServiceCidr(_) => {}
        }
    }

    pub fn kind(&self) -> ObjectKind {
        match self {
            ClusterObject::Service(_) => ObjectKind::Service,
            ClusterObject::EndpointSlice(_) => ObjectKind::EndpointSlice,
            ClusterObject::Node(_) => ObjectKind::Node,
            ClusterObject::Namespace(_) => ObjectKind::Namespace,
            ClusterObject::Pod(_) => ObjectKind::Pod,
            ClusterObject::NetworkPolicy(_) => ObjectKind::NetworkPolicy,
            ClusterObject::ServiceCidr(_) => ObjectKind::ServiceCidr,
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
            ClusterObject::ServiceCidr(c) => ObjectKey::cluster(&c.name),
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
    /// Policies whose targets, peers or spec may differ.
    pub policies: BTreeSet<ObjectKey>,
    /// Pods on this node (before or after the change) that changed.
    pub local_pods: BTreeSet<ObjectKey>,
    /// This node's own object changed: the node context of every call may differ.
    pub node_context: bool,
    /// The cluster's service CIDRs may differ.
    pub service_cidrs: bool,
}

impl Touched {
    pub fn merge(&mut self, other: Touched) {
        self.services.extend(other.services);
        self.policies.extend(other.policies);
        self.local_pods.extend(other.local_pods);
        self.node_context |= other.node_context;
        self.service_cidrs |= other.service_cidrs;
    }
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
            && self.policies.is_empty()
            && self.local_pods.is_empty()
            && !self.node_context
            && !self.service_cidrs
    }
}

/// Every object the sources reported, with the indexes the model needs.
#[derive(Debug, Default, Clone)]
pub struct ClusterState {
    /// Shared with the node-local views (`ServiceView::service`): one copy per service.
    pub services: BTreeMap<ObjectKey, Arc<Service>>,
    pub endpoint_slices: BTreeMap<ObjectKey, EndpointSlice>,
    pub nodes: BTreeMap<CompactString, Node>,
    pub namespaces: BTreeMap<CompactString, Namespace>,
    /// Ordered by namespace first, so one namespace's pods are a range.
    pub pods: BTreeMap<ObjectKey, Arc<Pod>>,
    pub network_policies: BTreeMap<ObjectKey, NetworkPolicy>,
    pub service_cidrs: BTreeMap<CompactString, ServiceCidr>,
    /// Service key → the EndpointSlices labelled with it, sorted. A service has one or a few:
    /// a vector holds them in ~50 bytes each, a `BTreeSet` took a ~560-byte node per service.
    slices_by_service: HashMap<ObjectKey, Vec<ObjectKey>>,
    /// Policies with a namespace selector in some peer: the only ones a change in another
    /// namespace's labels can concern.
    cross_namespace_policies: BTreeSet<ObjectKey>,
    /// Every policy by what a pod must carry for the policy to select it or name it.
    policy_index: PolicyIndex,
    /// Pods by the labels policy peers select on: a policy view's peer pods without reading
    /// every pod of the namespaces a peer selects.
    peer_pods: PeerPodIndex,
}

/// Policies by a label a pod must carry for them to select it or name it as a peer (one
/// `matchLabels` pair per selector: the pod must carry all of them), so that a pod change
/// tests the few policies that may concern it. Testing every policy of the pod's namespace
/// was most of the model's time per pod event with one policy per service, and every
/// cross-namespace policy half of a label change's at 10k policies.
#[derive(Debug, Default, Clone)]
struct PolicyIndex {
    /// Peers with a namespace selector: they may name a pod of any namespace.
    any_namespace: LabelIndex,
    /// By the policy's namespace: its own pod selector, and its peers without a namespace
    /// selector.
    by_namespace: HashMap<CompactString, LabelIndex>,
}

/// Policies by a label their selector requires, and those whose selector requires none.
#[derive(Debug, Default, Clone)]
struct LabelIndex {
    /// Label key → value → policies, sorted. A value has one or a few: a vector holds them in
    /// ~50 bytes each, where a `BTreeSet` takes a ~560-byte node per value (0.65 MiB more at
    /// 1k policies).
    by_label: HashMap<CompactString, HashMap<CompactString, Vec<ObjectKey>>>,
    any_pod: BTreeSet<ObjectKey>,
}

impl LabelIndex {
    fn insert(&mut self, key: &ObjectKey, requirement: Option<(&CompactString, &CompactString)>) {
        match requirement {
            Some((k, v)) => {
                let keys = self.by_label.entry(k.clone()).or_default().entry(v.clone()).or_default();
                if let Err(at) = keys.binary_search(key) {
                    keys.insert(at, key.clone());
                }
            }
            None => {
                self.any_pod.insert(key.clone());
            }
        }
    }

    fn remove(&mut self, key: &ObjectKey, requirement: Option<(&CompactString, &CompactString)>) {
        let Some((k, v)) = requirement else {
            self.any_pod.remove(key);
            return;
        };
        let Some(values) = self.by_label.get_mut(k) else { return };
        if let Some(keys) = values.get_mut(v) {
            if let Ok(at) = keys.binary_search(key) {
                keys.remove(at);
            }
            if keys.is_empty() {
                values.remove(v);
            }
        }
        if values.is_empty() {
            self.by_label.remove(k);
        }
    }

    fn is_empty(&self) -> bool {
        self.by_label.is_empty() && self.any_pod.is_empty()
    }

    /// Every policy whose selector a pod labelled `labels` may match.
    fn candidates<'a>(&'a self, labels: &'a Labels) -> impl Iterator<Item = &'a ObjectKey> {
        let by_label = labels.iter().filter_map(|(k, v)| self.by_label.get(k)?.get(v)).flatten();
        self.any_pod.iter().chain(by_label)
    }
}

/// Pods by a label that policy peers select on: for every label key that some peer's pod
/// selector requires (its first `matchLabels` pair, as [`PolicyIndex`] files it), value → the
/// pods carrying it, in key order. A policy view then reads the pods its peers name. Scanning
/// the namespaces a peer selects read every pod of the cluster for a namespace selector that
/// matches them all: ~5 ms per view at 10k services, for each new pod on this node that a
/// policy selects. Only keys some peer requires are filed, so a cluster without policies
/// pays nothing; the lists share the cluster's pods (a pointer each), and every replaced
/// pod is replaced here too.
#[derive(Debug, Default, Clone)]
struct PeerPodIndex {
    /// Label key → how many peers of the cluster's policies require it.
    wanted: HashMap<CompactString, usize>,
    by_label: HashMap<CompactString, HashMap<CompactString, Vec<Arc<Pod>>>>,
}

/// Where `key`'s pod is in a list of pods in key order (`Err`: where it would go).
fn pod_position(pods: &[Arc<Pod>], key: &ObjectKey) -> Result<usize, usize> {
    pods.binary_search_by(|p| (p.namespace.as_str(), p.name.as_str()).cmp(&(key.namespace.as_str(), key.name.as_str())))
}

impl PeerPodIndex {
    /// The label each peer of `policy` requires a pod to carry (its key), where it has one.
    fn required_keys(policy: &NetworkPolicy) -> impl Iterator<Item = &CompactString> {
        policy.peers().filter_map(|peer| peer.pod_selector.as_ref()?.required_label().map(|(key, _)| key))
    }

    /// Files the keys `policy`'s peers require; a key new to the index files every pod
    /// carrying it (once: later policies requiring it only count).
    fn want(&mut self, policy: &NetworkPolicy, pods: &BTreeMap<ObjectKey, Arc<Pod>>) {
        for key in Self::required_keys(policy) {
            let count = self.wanted.entry(key.clone()).or_default();
            *count += 1;
            if *count == 1 {
                let values = self.by_label.entry(key.clone()).or_default();
                // In key order, so every list is sorted as it is built.
                for pod in pods.values() {
                    if let Some(value) = pod.labels.get(key) {
                        values.entry(value.clone()).or_default().push(pod.clone());
                    }
                }
            }
        }
    }

    /// Undoes [`want`](Self::want) for a policy gone or replaced; a key no peer requires any
    /// more is dropped with its lists.
    fn unwant(&mut self, policy: &NetworkPolicy) {
        for key in Self::required_keys(policy) {
            if let Some(count) = self.wanted.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    self.wanted.remove(key);
                    self.by_label.remove(key);
                }
            }
        }
    }

    /// The pod `key` went from `old` to `new` (`None`: it did not exist, or is gone).
    fn update(&mut self, key: &ObjectKey, old: Option<&Arc<Pod>>, new: Option<&Arc<Pod>>) {
        // The pod's label keys, each once, not the index's: a pod carries a few labels, and
        // the policies of a cluster may select on many keys (100 keys cost 3× a pod event).
        if self.by_label.is_empty() {
            return;
        }
        let old_keys = old.into_iter().flat_map(|p| p.labels.keys());
        let new_only = new
            .into_iter()
            .flat_map(|p| p.labels.keys())
            .filter(|k| !old.is_some_and(|p| p.labels.contains_key(k.as_str())));
        for label in old_keys.chain(new_only) {
            let Some(values) = self.by_label.get_mut(label) else { continue };
            let (before, after) = (old.and_then(|p| p.labels.get(label)), new.and_then(|p| p.labels.get(label)));
            if let Some(value) = before
                && let Some(pods) = values.get_mut(value)
                && let Ok(at) = pod_position(pods, key)
            {
                // The same value: the newer pod in the same place.
                if let (true, Some(new)) = (before == after, new) {
                    pods[at] = new.clone();
                    continue;
                }
                pods.remove(at);
                if pods.is_empty() {
                    values.remove(value);
                }
            }
            if let (Some(value), Some(new)) = (after, new) {
                let pods = values.entry(value.clone()).or_default();
                match pod_position(pods, key) {
                    Ok(at) => pods[at] = new.clone(),
                    Err(at) => pods.insert(at, new.clone()),
                }
            }
        }
    }

    /// The pods labelled `key=value`, or `None` when no peer requires `key` (not filed).
    fn pods(&self, key: &str, value: &str) -> Option<&[Arc<Pod>]> {
        self.by_label.get(key).map(|values| values.get(value).map_or(&[][..], Vec::as_slice))
    }
}

/// Where a selector of a policy looks for pods: its own namespace, or any.
enum Scope {
    OwnNamespace,
    AnyNamespace,
}

impl PolicyIndex {
    /// The policy's selectors of pods, each with where it looks and one label it requires
    /// (`None`: it requires none). A peer that is an ipBlock selects no pod.
    fn requirements(policy: &NetworkPolicy) -> impl Iterator<Item = (Scope, Option<(&CompactString, &CompactString)>)> {
        let target = (Scope::OwnNamespace, policy.pod_selector.required_label());
        let peers = policy.peers().filter_map(move |peer| match (&peer.namespace_selector, &peer.pod_selector) {
            (Some(_), pods) => Some((Scope::AnyNamespace, pods.as_ref().and_then(LabelSelector::required_label))),
            (None, Some(pods)) => Some((Scope::OwnNamespace, pods.required_label())),
            (None, None) => None,
        });
        std::iter::once(target).chain(peers)
    }

    fn insert(&mut self, key: &ObjectKey, policy: &NetworkPolicy) {
        for (scope, requirement) in Self::requirements(policy) {
            match scope {
                Scope::AnyNamespace => self.any_namespace.insert(key, requirement),
                Scope::OwnNamespace => {
                    self.by_namespace.entry(policy.namespace.clone()).or_default().insert(key, requirement)
                }
            }
        }
    }

    fn remove(&mut self, key: &ObjectKey, policy: &NetworkPolicy) {
        for (scope, requirement) in Self::requirements(policy) {
            match scope {
                Scope::AnyNamespace => self.any_namespace.remove(key, requirement),
                Scope::OwnNamespace => {
                    if let Some(index) = self.by_namespace.get_mut(&policy.namespace) {
                        index.remove(key, requirement);
                        if index.is_empty() {
                            self.by_namespace.remove(&policy.namespace);
                        }
                    }
                }
            }
        }
    }

    /// Every policy that may select `pod` or name it as a peer (some more than once).
    fn candidates<'a>(&'a self, pod: &'a Pod) -> impl Iterator<Item = &'a ObjectKey> {
        let own_namespace =
            self.by_namespace.get(&pod.namespace).into_iter().flat_map(|index| index.candidates(&pod.labels));
        own_namespace.chain(self.any_namespace.candidates(&pod.labels))
    }
}

/// The objects of one namespace in a map keyed by [`ObjectKey`].
fn in_namespace<'a, V>(
    map: &'a BTreeMap<ObjectKey, V>,
    namespace: &str,
) -> impl Iterator<Item = (&'a ObjectKey, &'a V)> {
    map.range(ObjectKey::new(namespace, "")..).take_while(move |(k, _)| k.namespace == namespace)
}

impl ClusterState {
    pub fn new() -> Self {
        Self::default()
    }

    /// The service's slices: its own, and other clusters' when the service is global; with a
    /// cluster affinity, the preferred side's alone while it has a ready endpoint.
    pub fn slices_of(&self, service: &ObjectKey) -> impl Iterator<Item = &EndpointSlice> {
        let all =
            || self.slices_by_service.get(service).into_iter().flatten().filter_map(|k| self.endpoint_slices.get(k));
        let (global, affinity) =
            self.services.get(service).map_or((false, ClusterAffinity::None), |s| (s.global, s.cluster_affinity));
        let prefer_remote = match affinity {
            _ if !global => None,
            ClusterAffinity::None => None,
            ClusterAffinity::Local => Some(false),
            ClusterAffinity::Remote => Some(true),
        };
        // Only a side that can serve is preferred; else both are used, as without affinity.
        let only_remote = prefer_remote
            .filter(|remote| all().any(|s| s.cluster.is_some() == *remote && s.endpoints.iter().any(|e| e.ready)));
        all().filter(move |slice| match only_remote {
            Some(remote) => slice.cluster.is_some() == remote,
            None => global || slice.cluster.is_none(),
        })
    }

    pub fn pods_in<'a>(&'a self, namespace: &'a str) -> impl Iterator<Item = &'a Arc<Pod>> {
        in_namespace(&self.pods, namespace).map(|(_, p)| p)
    }

    /// The pods some peer of `policy` selects, in key order, each once.
    pub fn peer_pods_of(&self, policy: &NetworkPolicy) -> Vec<Arc<Pod>> {
        let peers: Vec<&PolicyPeer> = policy.peers().filter(|p| p.ip_block.is_none()).collect();
        let mut found: Vec<&Arc<Pod>> = Vec::new();
        // Peers requiring a label: the pods filed under it, wherever they are.
        let mut unfiled: Vec<&PolicyPeer> = Vec::new();
        for peer in peers {
            let filed = peer
                .pod_selector
                .as_ref()
                .and_then(LabelSelector::required_label)
                .and_then(|(k, v)| self.peer_pods.pods(k, v));
            match filed {
                Some(pods) => found.extend(
                    pods.iter()
                        .filter(|pod| peer.selects(&policy.namespace, pod, self.namespace_labels(&pod.namespace))),
                ),
                None => unfiled.push(peer),
            }
        }
        // The others (no pod selector, or expressions only): the pods of the namespaces they
        // select. Pods are ordered by namespace, each namespace's labels matched once.
        if !unfiled.is_empty() {
            let mut namespaces: Vec<&str> = vec![&policy.namespace];
            if unfiled.iter().any(|p| p.namespace_selector.is_some()) {
                namespaces.extend(self.namespaces.keys().map(|n| n.as_str()).filter(|n| *n != policy.namespace));
            }
            for namespace in namespaces {
                let labels = self.namespace_labels(namespace);
                let selecting: Vec<&PolicyPeer> = unfiled
                    .iter()
                    .copied()
                    .filter(|p| p.selects_namespace(&policy.namespace, namespace, labels))
                    .collect();
                if !selecting.is_empty() {
                    found.extend(
                        self.pods_in(namespace)
                            .filter(|pod| selecting.iter().any(|peer| peer.selects_in_namespace(pod))),
                    );
                }
            }
        }
        fn key(pod: &Pod) -> (&str, &str) {
            (&pod.namespace, &pod.name)
        }
        found.sort_unstable_by(|a, b| key(a).cmp(&key(b)));
        found.dedup_by(|a, b| key(a) == key(b));
        found.into_iter().cloned().collect()
    }

    pub fn namespace_labels(&self, namespace: &str) -> Option<&Labels> {
        self.namespaces.get(namespace).map(|n| &n.labels)
    }

    /// Policies a pod (as it was, or as it is) matters to: those that select it or name it.
    fn policies_involving(&self, pod: &Pod, into: &mut BTreeSet<ObjectKey>) {
        let labels = self.namespace_labels(&pod.namespace);
        for key in self.policy_index.candidates(pod) {
            if !into.contains(key) && self.network_policies.get(key).is_some_and(|policy| policy.involves(pod, labels))
            {
                into.insert(key.clone());
            }
        }
    }

    /// Policies whose namespace selectors match `labels` (old or new labels of a namespace).
    fn policies_selecting_namespace(&self, labels: &Labels, into: &mut BTreeSet<ObjectKey>) {
        for key in &self.cross_namespace_policies {
            let Some(policy) = self.network_policies.get(key) else { continue };
            if policy.peers().any(|peer| peer.namespace_selector.as_ref().is_some_and(|s| s.matches(labels))) {
                into.insert(key.clone());
            }
        }
    }

    /// Applies one event; `node_name` is this node, whose own Node object feeds the context.
    pub fn apply(&mut self, mut event: ClusterEvent, node_name: &str) -> Touched {
        if let ClusterEvent::Upsert(object) = &mut event {
            object.shrink_to_fit();
        }
        let mut touched = Touched::default();
        match event {
            ClusterEvent::Upsert(object) => match object {
                ClusterObject::Service(s) => {
                    touched.services.insert(s.key());
                    self.services.insert(s.key(), Arc::new(s));
                }
                ClusterObject::EndpointSlice(slice) => {
                    let key = slice.key();
                    let old_service = self.endpoint_slices.get(&key).map(EndpointSlice::service_key);
                    if let Some(old_service) = old_service.filter(|s| *s != slice.service_key()) {
                        self.unindex_slice(&old_service, &key);
                        touched.services.insert(old_service);
                    }
                    touched.services.insert(slice.service_key());
                    // Most services have one slice: a first push would reserve four keys (192 bytes).
                    let slices =
                        self.slices_by_service.entry(slice.service_key()).or_insert_with(|| Vec::with_capacity(1));
                    if let Err(at) = slices.binary_search(&key) {
                        slices.insert(at, key.clone());
                    }
                    self.endpoint_slices.insert(key, slice);
                }
                ClusterObject::Node(n) => {
                    touched.node_context = n.name == node_name;
                    self.nodes.insert(n.name.clone(), n);
                }
                ClusterObject::Namespace(n) => {
                    let old = self.namespaces.insert(n.name.clone(), n.clone());
                    if old.as_ref().map(|o| &o.labels) != Some(&n.labels) {
                        if let Some(old) = &old {
                            self.policies_selecting_namespace(&old.labels, &mut touched.policies);
                        }
                        self.policies_selecting_namespace(&n.labels, &mut touched.policies);
                    }
                }
                ClusterObject::Pod(p) => {
                    let key = p.key();
                    let pod = Arc::new(p.clone());
                    let old = self.pods.insert(key.clone(), pod.clone());
                    self.peer_pods.update(&key, old.as_ref(), Some(&pod));
                    if old.as_deref() != Some(&p) {
                        if let Some(old) = &old {
                            self.policies_involving(old, &mut touched.policies);
                        }
                        self.policies_involving(&p, &mut touched.policies);
                        let on_node = |pod: &Pod| pod.node_name.as_deref() == Some(node_name);
                        if on_node(&p) || old.as_deref().is_some_and(on_node) {
                            touched.local_pods.insert(key);
                        }
                    }
                }
                ClusterObject::NetworkPolicy(p) => {
                    let key = p.key();
                    if p.has_namespace_selectors() {
                        self.cross_namespace_policies.insert(key.clone());
                    } else {
                        self.cross_namespace_policies.remove(&key);
                    }
                    // The new policy's keys first: a key both require is not dropped and
                    // filed again.
                    self.peer_pods.want(&p, &self.pods);
                    if let Some(old) = self.network_policies.get(&key) {
                        self.policy_index.remove(&key, old);
                        self.peer_pods.unwant(old);
                    }
                    self.policy_index.insert(&key, &p);
                    touched.policies.insert(key.clone());
                    self.network_policies.insert(key, p);
                }
                ClusterObject::ServiceCidr(c) => {
                    touched.service_cidrs = self.service_cidrs.get(&c.name) != Some(&c);
                    self.service_cidrs.insert(c.name.clone(), c);
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
                    if let Some(old) = self.namespaces.remove(&key.name) {
                        self.policies_selecting_namespace(&old.labels, &mut touched.policies);
                    }
                }
                ObjectKind::Pod => {
                    if let Some(old) = self.pods.remove(&key) {
                        self.peer_pods.update(&key, Some(&old), None);
                        self.policies_involving(&old, &mut touched.policies);
                        if old.node_name.as_deref() == Some(node_name) {
                            touched.local_pods.insert(key);
                        }
                    }
                }
                ObjectKind::NetworkPolicy => {
                    if let Some(old) = self.network_policies.remove(&key) {
                        self.cross_namespace_policies.remove(&key);
                        self.policy_index.remove(&key, &old);
                        self.peer_pods.unwant(&old);
                        touched.policies.insert(key);
                    }
                }
                ObjectKind::ServiceCidr => {
                    touched.service_cidrs = self.service_cidrs.remove(&key.name).is_some();
                }
            },
        }
        touched
    }

    /// Replaces the whole state with `objects` (a manifest reload) as the minimal set of
    /// upserts and deletes.
    pub fn replace_all(&mut self, objects: Vec<ClusterObject>, node_name: &str) -> Touched {
        self.replace(None, objects, &[], node_name)
    }

    /// Replaces every object of one kind (a relist after a watch expired) as the minimal set
    /// of upserts and deletes; objects of other kinds in `objects` are ignored. Objects in
    /// `keep` exist at the source but could not be read this time: their last good version
    /// stays rather than being deleted.
    pub fn replace_kind(
        &mut self,
        kind: ObjectKind,
        objects: Vec<ClusterObject>,
        keep: &[ObjectKey],
        node_name: &str,
    ) -> Touched {
        self.replace(Some(kind), objects, keep, node_name)
    }

    fn replace(
        &mut self,
        only: Option<ObjectKind>,
        objects: Vec<ClusterObject>,
        keep: &[ObjectKey],
        node_name: &str,
    ) -> Touched {
        let wanted = |kind: ObjectKind| only.is_none_or(|k| k == kind);
        let mut incoming: BTreeMap<(ObjectKind, ObjectKey), ClusterObject> = BTreeMap::new();
        for object in objects.into_iter().filter(|o| wanted(o.kind())) {
            incoming.insert((object.kind(), object.key()), object);
        }
        let mut existing: Vec<(ObjectKind, ObjectKey)> = Vec::new();
        if wanted(ObjectKind::Service) {
            existing.extend(self.services.keys().map(|k| (ObjectKind::Service, k.clone())));
        }
        if wanted(ObjectKind::EndpointSlice) {
            // Imported slices come from the kvstore, never in a listing of this cluster's.
            existing.extend(
                self.endpoint_slices
                    .iter()
                    .filter(|(_, s)| s.cluster.is_none())
                    .map(|(k, _)| (ObjectKind::EndpointSlice, k.clone())),
            );
        }
        if wanted(ObjectKind::Node) {
            existing.extend(self.nodes.keys().map(|k| (ObjectKind::Node, ObjectKey::cluster(k))));
        }
        if wanted(ObjectKind::Namespace) {
            existing.extend(self.namespaces.keys().map(|k| (ObjectKind::Namespace, ObjectKey::cluster(k))));
        }
        if wanted(ObjectKind::Pod) {
            existing.extend(self.pods.keys().map(|k| (ObjectKind::Pod, k.clone())));
        }
        if wanted(ObjectKind::NetworkPolicy) {
            existing.extend(self.network_policies.keys().map(|k| (ObjectKind::NetworkPolicy, k.clone())));
        }
        if wanted(ObjectKind::ServiceCidr) {
            existing.extend(self.service_cidrs.keys().map(|k| (ObjectKind::ServiceCidr, ObjectKey::cluster(k))));
        }
        let mut touched = Touched::default();
        for (kind, key) in existing {
            if !incoming.contains_key(&(kind, key.clone())) && !keep.contains(&key) {
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
            ClusterObject::Service(s) => self.services.get(&s.key()).map(|x| &**x) == Some(s),
            ClusterObject::EndpointSlice(s) => self.endpoint_slices.get(&s.key()) == Some(s),
            ClusterObject::Node(n) => self.nodes.get(&n.name) == Some(n),
            ClusterObject::Namespace(n) => self.namespaces.get(&n.name) == Some(n),
            ClusterObject::Pod(p) => self.pods.get(&p.key()).map(|x| &**x) == Some(p),
            ClusterObject::NetworkPolicy(p) => self.network_policies.get(&p.key()) == Some(p),
            ClusterObject::ServiceCidr(c) => self.service_cidrs.get(&c.name) == Some(c),
        }
    }

    fn unindex_slice(&mut self, service: &ObjectKey, slice: &ObjectKey) {
        if let Some(slices) = self.slices_by_service.get_mut(service) {
            slices.retain(|k| k != slice);
            if slices.is_empty() {
                self.slices_by_service.remove(service);
            }
        }
    }
}

/// Facts about this node passed to every guest call.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeContext {
    pub node_name: CompactString,
    pub node_ips: Vec<CompactString>,
    pub cluster_cidrs: Vec<CompactString>,
    pub pod_cidrs: Vec<CompactString>,
    /// The node's `topology.kubernetes.io/zone`; used by the host for topology hints.
    pub zone: Option<CompactString>,
}

/// An endpoint as this node sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LocalEndpoint {
    pub addresses: Vec<CompactString>,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub node_name: Option<CompactString>,
    pub zone: Option<CompactString>,
    pub is_local: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LocalSlice {
    pub name: CompactString,
    pub endpoints: Vec<LocalEndpoint>,
    pub ports: Vec<EndpointPort>,
}

/// What a service translator needs for one service on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServiceView {
    /// The cluster index's copy, shared.
    pub service: Arc<Service>,
    pub slices: Vec<LocalSlice>,
}

/// A load balancer health check this node answers for a service (kube-proxy's
/// `healthCheckNodePort` server): a load balancer sends traffic for an
/// `externalTrafficPolicy: Local` service only to the nodes that report local endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    /// Ready endpoints on this node, one per address and port, as kube-proxy counts them.
    pub local_endpoints: usize,
}

impl ServiceView {
    /// The health check this node answers for the service, if any: a `LoadBalancer` service
    /// with `externalTrafficPolicy: Local` and a `healthCheckNodePort` (kube-proxy serves
    /// exactly those; the API server allocates the port only for them).
    pub fn health_check(&self) -> Option<HealthCheck> {
        let s = &self.service;
        if s.service_type != ServiceType::LoadBalancer
            || s.external_traffic_policy != TrafficPolicy::Local
            || s.health_check_node_port == 0
        {
            return None;
        }
        let local_endpoints: BTreeSet<(&str, u16)> = self
            .slices
            .iter()
            .flat_map(|slice| {
                let ready =
                    slice.endpoints.iter().filter(|e| e.ready && e.is_local).filter_map(|e| e.addresses.first());
                ready.flat_map(|address| slice.ports.iter().map(move |p| (address.as_str(), p.port)))
            })
            .collect();
        Some(HealthCheck { port: s.health_check_node_port, local_endpoints: local_endpoints.len() })
    }

    /// How many of the service's ports a `Local` traffic policy finds nothing to send to on
    /// this node (kube-proxy's `sync_proxy_rules_no_local_endpoints_total`, which counts
    /// service ports): internal traffic, and external traffic of a service reachable from
    /// outside (node port, load balancer or external address). Such traffic is dropped here.
    /// A port's endpoints are those of the slices carrying its name; ready local ones
    /// count, or serving terminating ones when none is ready (kube-proxy's fallback).
    pub fn without_local_endpoints(&self) -> NoLocalEndpoints {
        let s = &self.service;
        let internal = s.internal_traffic_policy == TrafficPolicy::Local;
        let external = s.external_traffic_policy == TrafficPolicy::Local
            && (matches!(s.service_type, ServiceType::NodePort | ServiceType::LoadBalancer)
                || !s.external_ips.is_empty());
        if !internal && !external {
            return NoLocalEndpoints::default();
        }
        let has_local = |port: &ServicePort| {
            self.slices
                .iter()
                .filter(|slice| slice.ports.iter().any(|p| p.name == port.name))
                .flat_map(|slice| &slice.endpoints)
                .any(|e| e.is_local && (e.ready || e.serving))
        };
        let without = s.ports.iter().filter(|port| !has_local(port)).count();
        NoLocalEndpoints { internal: if internal { without } else { 0 }, external: if external { without } else { 0 } }
    }
}

/// See [`ServiceView::without_local_endpoints`]: service ports, per traffic policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    pub internal: usize,
    pub external: usize,
}

/// One service whose view changed; `view` is `None` when it left the model.
#[derive(Clone, Debug)]
pub struct ServiceChange {
    pub key: ObjectKey,
    pub view: Option<Arc<ServiceView>>,
}

/// What a policy compiler needs for one policy on this node: the policy, the pods on this
/// node it applies to, and every pod its peers select (with IPs and named ports), so that a
/// peer pod's IP change is a change of this view and nothing else.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyView {
    pub policy: NetworkPolicy,
    pub local_pods: Vec<Arc<Pod>>,
    pub peer_pods: Vec<Arc<Pod>>,
}

/// One policy whose view changed; `view` is `None` when it no longer applies on this node.
#[derive(Clone, Debug)]
pub struct PolicyChange {
    pub key: ObjectKey,
    pub view: Option<Arc<PolicyView>>,
}

/// One pod on this node that changed; `pod` is `None` when it left the node.
#[derive(Clone, Debug)]
pub struct PodChange {
    pub key: ObjectKey,
    pub pod: Option<Arc<Pod>>,
}

/// The node-local model: what this node's dataplane depends on (per-service views, the
/// policies that select its pods, its pods), with a revision that moves only when some of
/// it really changes.
#[derive(Debug, Clone, Serialize)]
pub struct NodeLocalModel {
    pub revision: u64,
    pub context: NodeContext,
    #[serde(serialize_with = "keys_as_strings")]
    pub services: BTreeMap<ObjectKey, Arc<ServiceView>>,
    #[serde(serialize_with = "keys_as_strings")]
    pub policies: BTreeMap<ObjectKey, Arc<PolicyView>>,
    #[serde(serialize_with = "keys_as_strings")]
    pub local_pods: BTreeMap<ObjectKey, Arc<Pod>>,
    /// Cluster CIDRs are configuration, not cluster state.
    #[serde(skip)]
    configured_cluster_cidrs: Vec<CompactString>,
    /// kube-proxy's `--detect-local-mode NodeCIDR`: traffic from this node's pod CIDRs is
    /// the local traffic, and they stand for the cluster CIDRs in the guests' context.
    #[serde(skip)]
    local_is_node_cidrs: bool,
    /// This node is going away ([`Node::being_deleted`]): not part of the guests' context,
    /// so that draining a node does not translate every service again.
    pub node_being_deleted: bool,
    /// The configured service CIDRs and every ServiceCIDR object's ranges, sorted and
    /// without repeats: the host drops what is in them and no service's (not part of the
    /// guests' context either).
    pub service_cidrs: Vec<ipnet::IpNet>,
    /// `--service-cidr`: configuration, always part of [`Self::service_cidrs`].
    #[serde(skip)]
    configured_service_cidrs: Vec<ipnet::IpNet>,
}

/// JSON maps need string keys: `namespace/name`.
fn keys_as_strings<S: serde::Serializer, V: Serialize>(map: &BTreeMap<ObjectKey, V>, s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(map.iter().map(|(k, v)| (k.to_string(), v)))
}

/// The result of one model update: exactly what differs from the previous revision.
#[derive(Debug, Default)]
pub struct ModelUpdate {
    pub changed: Vec<ServiceChange>,
    pub policies: Vec<PolicyChange>,
    pub pods: Vec<PodChange>,
    pub context_changed: bool,
    /// [`NodeLocalModel::node_being_deleted`] changed (nothing a guest sees).
    pub node_being_deleted_changed: bool,
    /// [`NodeLocalModel::service_cidrs`] changed (nothing a guest sees).
    pub service_cidrs_changed: bool,
}

impl ModelUpdate {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty()
            && self.policies.is_empty()
            && self.pods.is_empty()
            && !self.context_changed
            && !self.node_being_deleted_changed
            && !self.service_cidrs_changed
    }
}

/// Applies `new` at `key` in `map`, returning the change if it is a real one.
fn replace_if_changed<V: PartialEq>(
    map: &mut BTreeMap<ObjectKey, Arc<V>>,
    key: &ObjectKey,
    new: Option<V>,
) -> Option<Option<Arc<V>>> {
    match (map.get(key), new) {
        (Some(old), Some(new)) if **old == new => None,
        (None, None) => None,
        (_, Some(new)) => {
            let new = Arc::new(new);
            map.insert(key.clone(), new.clone());
            Some(Some(new))
        }
        (Some(_), None) => {
            map.remove(key);
            Some(None)
        }
    }
}

impl NodeLocalModel {
    pub fn new(node_name: &str, cluster_cidrs: Vec<CompactString>) -> Self {
        NodeLocalModel {
            revision: 0,
            context: NodeContext {
                node_name: node_name.into(),
                cluster_cidrs: cluster_cidrs.clone(),
                ..Default::default()
            },
            services: BTreeMap::new(),
            policies: BTreeMap::new(),
            local_pods: BTreeMap::new(),
            configured_cluster_cidrs: cluster_cidrs,
            local_is_node_cidrs: false,
            node_being_deleted: false,
            service_cidrs: Vec::new(),
            configured_service_cidrs: Vec::new(),
        }
    }

    /// Local traffic is traffic from this node's pod CIDRs (its Node object's), not from
    /// the configured cluster CIDRs (kube-proxy's `--detect-local-mode NodeCIDR`).
    pub fn with_node_cidr_local_detection(mut self) -> Self {
        self.local_is_node_cidrs = true;
        self.context.cluster_cidrs = Vec::new();
        self
    }

    /// Why local traffic cannot be told apart yet, if it cannot: with NodeCIDR detection,
    /// until this node's Node object has a pod CIDR (kube-proxy waits for it at start).
    pub fn local_detection_pending(&self) -> Option<&'static str> {
        (self.local_is_node_cidrs && self.context.cluster_cidrs.is_empty())
            .then_some("--detect-local-mode NodeCIDR: this node's Node object has no pod CIDR yet, so traffic from outside the cluster to cluster IPs is not masqueraded")
    }

    /// Service CIDRs that are configuration rather than cluster state (`--service-cidr`):
    /// the ServiceCIDR objects' ranges are added to them.
    pub fn with_service_cidrs(mut self, mut cidrs: Vec<ipnet::IpNet>) -> Self {
        cidrs.sort();
        cidrs.dedup();
        self.service_cidrs = cidrs.clone();
        self.configured_service_cidrs = cidrs;
        self
    }

    pub fn node_name(&self) -> &str {
        &self.context.node_name
    }

    /// Recomputes what `touched` names and bumps the revision if anything differs.
    pub fn update(&mut self, cluster: &ClusterState, touched: &Touched) -> ModelUpdate {
        let mut update = ModelUpdate::default();
        let mut services: Vec<ObjectKey> = touched.services.iter().cloned().collect();
        if touched.node_context {
            let being_deleted = cluster.nodes.get(self.node_name()).is_some_and(|n| n.being_deleted);
            if being_deleted != self.node_being_deleted {
                self.node_being_deleted = being_deleted;
                update.node_being_deleted_changed = true;
            }
            let context = self.compute_context(cluster);
            if context != self.context {
                // Topology hints are read against the node's zone: every view may differ.
                if context.zone != self.context.zone {
                    services = cluster
                        .services
                        .keys()
                        .chain(self.services.keys())
                        .cloned()
                        .collect::<BTreeSet<_>>()
                        .into_iter()
                        .collect();
                }
                self.context = context;
                update.context_changed = true;
            }
        }
        if touched.service_cidrs {
            let objects = cluster.service_cidrs.values().flat_map(|c| c.cidrs.iter().copied());
            let mut cidrs: Vec<ipnet::IpNet> = self.configured_service_cidrs.iter().copied().chain(objects).collect();
            cidrs.sort();
            cidrs.dedup();
            if cidrs != self.service_cidrs {
                self.service_cidrs = cidrs;
                update.service_cidrs_changed = true;
            }
        }
        for key in &services {
            let view = cluster.services.get(key).filter(|s| s.is_proxied()).map(|s| self.view_of(cluster, s));
            if let Some(view) = replace_if_changed(&mut self.services, key, view) {
                update.changed.push(ServiceChange { key: key.clone(), view });
            }
        }
        for key in &touched.local_pods {
            let pod = cluster
                .pods
                .get(key)
                .filter(|p| p.node_name.as_deref() == Some(self.node_name()))
                .map(|p| Pod::clone(p));
            if let Some(pod) = replace_if_changed(&mut self.local_pods, key, pod) {
                update.pods.push(PodChange { key: key.clone(), pod });
            }
        }
        for key in &touched.policies {
            let view = cluster.network_policies.get(key).and_then(|p| self.policy_view(cluster, p));
            if let Some(view) = replace_if_changed(&mut self.policies, key, view) {
                update.policies.push(PolicyChange { key: key.clone(), view });
            }
        }
        if !update.is_empty() {
            self.revision += 1;
        }
        update
    }

    fn compute_context(&self, cluster: &ClusterState) -> NodeContext {
        let node = cluster.nodes.get(self.node_name());
        let pod_cidrs = node.map(|n| n.pod_cidrs.clone()).unwrap_or_default();
        NodeContext {
            node_name: self.context.node_name.clone(),
            node_ips: node.map(|n| n.addresses.clone()).unwrap_or_default(),
            cluster_cidrs: if self.local_is_node_cidrs {
                pod_cidrs.clone()
            } else {
                self.configured_cluster_cidrs.clone()
            },
            pod_cidrs,
            zone: node.and_then(|n| n.zone()).map(CompactString::from),
        }
    }

    /// `None` when the policy selects no pod on this node: it then has nothing to enforce here.
    fn policy_view(&self, cluster: &ClusterState, policy: &NetworkPolicy) -> Option<PolicyView> {
        // This node's pods, already brought up to date by `update`: a few per namespace,
        // where the namespace may hold thousands.
        let local_pods: Vec<Arc<Pod>> = in_namespace(&self.local_pods, &policy.namespace)
            .map(|(_, p)| p)
            .filter(|p| policy.selects(p))
            .cloned()
            .collect();
        if local_pods.is_empty() {
            return None;
        }
        let peer_pods = cluster.peer_pods_of(policy);
        Some(PolicyView { policy: policy.clone(), local_pods, peer_pods })
    }

    fn view_of(&self, cluster: &ClusterState, service: &Arc<Service>) -> ServiceView {
        let topology = self.topology(cluster, service);
        let mut slices: Vec<LocalSlice> = cluster
            .slices_of(&service.key())
            .map(|slice| {
                let mut endpoints: Vec<LocalEndpoint> = slice
                    .endpoints
                    .iter()
                    .map(|e| (e, e.node_name.as_deref() == Some(self.node_name())))
                    // Hints narrow the cluster-wide endpoints to this node's or zone's; local
                    // ones stay for externalTrafficPolicy/internalTrafficPolicy Local.
                    .filter(|(e, is_local)| *is_local || topology.is_none_or(|t| t.selects(e)))
                    .map(|(e, is_local)| LocalEndpoint {
                        addresses: e.addresses.clone(),
                        ready: e.ready,
                        serving: e.serving,
                        terminating: e.terminating,
                        is_local,
                        node_name: e.node_name.clone(),
                        zone: e.zone.clone(),
                    })
                    .collect();
                // Order carries no meaning; sorting makes equal sets compare equal.
                endpoints.sort_by(|a, b| a.addresses.cmp(&b.addresses));
                // Filtered, so collected with spare room; views live as long as the service.
                endpoints.shrink_to_fit();
                LocalSlice { name: slice.name.clone(), endpoints, ports: slice.ports.clone() }
            })
            .collect();
        slices.sort_by(|a, b| a.name.cmp(&b.name));
        slices.shrink_to_fit();
        ServiceView { service: service.clone(), slices }
    }

    /// The hints to filter by, kube-proxy's rule: node hints when every ready endpoint
    /// carries them and some is hinted for this node (`PreferSameNode`), else zone hints when
    /// the node has a zone, every ready endpoint carries them and some is hinted for this
    /// zone. Otherwise hints are ignored and every endpoint is used.
    fn topology<'a>(&'a self, cluster: &ClusterState, service: &Service) -> Option<Topology<'a>> {
        let key = service.key();
        let zone = self.context.zone.as_deref();
        let (mut all_node_hints, mut for_node, mut all_zone_hints, mut for_zone, mut any_ready) =
            (true, false, true, false, false);
        for e in cluster.slices_of(&key).flat_map(|s| s.endpoints.iter()).filter(|e| e.ready) {
            any_ready = true;
            all_node_hints &= !e.for_nodes.is_empty();
            for_node |= e.for_nodes.iter().any(|n| n == self.node_name());
            all_zone_hints &= !e.for_zones.is_empty();
            for_zone |= zone.is_some_and(|zone| e.for_zones.iter().any(|z| z == zone));
        }
        if !any_ready {
            return None;
        }
        if all_node_hints && for_node {
            return Some(Topology::Node(self.node_name()));
        }
        zone.filter(|_| all_zone_hints && for_zone).map(Topology::Zone)
    }
}

/// Which endpoints hints send this node's traffic to.
#[derive(Clone, Copy)]
enum Topology<'a> {
    Node(&'a str),
    Zone(&'a str),
}

impl Topology<'_> {
    fn selects(self, e: &Endpoint) -> bool {
        match self {
            Topology::Node(node) => e.for_nodes.iter().any(|n| n == node),
            Topology::Zone(zone) => e.for_zones.iter().any(|z| z == zone),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, ip: &str) -> Service {
        Service::cluster_ip("default", name, ip, vec![ServicePort::tcp("http", 80, 8080)])
    }

    fn slice(name: &str, service: &str, ips: &[(&str, &str)]) -> EndpointSlice {
        EndpointSlice {
            namespace: "default".into(),
            name: name.into(),
            service_name: service.into(),
            endpoints: ips
                .iter()
                .map(|(ip, node)| Endpoint {
                    addresses: vec![(*ip).into()],
                    ready: true,
                    serving: true,
                    terminating: false,
                    node_name: Some((*node).into()),
                    zone: None,
                    for_zones: vec![],
                    for_nodes: vec![],
                })
                .collect(),
            ports: vec![EndpointPort { name: "http".into(), protocol: Protocol::Tcp, port: 8080 }],
            trigger_time: None,
            cluster: None,
        }
    }

    /// The first address of every endpoint of `default/{service}`'s view, in slice order.
    fn endpoint_addresses(model: &NodeLocalModel, service: &str) -> Vec<String> {
        model.services[&ObjectKey::new("default", service)]
            .slices
            .iter()
            .flat_map(|s| s.endpoints.iter().map(|e| e.addresses[0].to_string()))
            .collect()
    }

    fn apply(state: &mut ClusterState, model: &mut NodeLocalModel, obj: ClusterObject) -> ModelUpdate {
        let touched = state.apply(ClusterEvent::Upsert(obj), "node-a");
        model.update(state, &touched)
    }

    /// Other clusters' slices are backends of a service only while it is global; a relist of
    /// this cluster's slices keeps them.
    #[test]
    fn imported_slices_count_only_for_global_services() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let endpoints = |model: &NodeLocalModel| endpoint_addresses(model, "web");
        apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice("web-1", "web", &[("10.244.1.2", "node-a")])));
        let remote =
            EndpointSlice { cluster: Some("east".into()), ..slice("web@east", "web", &[("10.245.0.7", "east-1")]) };
        let u = apply(&mut state, &mut model, ClusterObject::EndpointSlice(remote.clone()));
        assert!(u.is_empty(), "not global: another cluster's slice changes nothing here");
        assert_eq!(endpoints(&model), ["10.244.1.2"]);

        let u = apply(
            &mut state,
            &mut model,
            ClusterObject::Service(Service { global: true, ..service("web", "10.96.0.10") }),
        );
        assert_eq!(u.changed.len(), 1);
        assert_eq!(endpoints(&model), ["10.244.1.2", "10.245.0.7"]);
        assert!(!model.services[&ObjectKey::new("default", "web")].slices[1].endpoints[0].is_local);

        // This cluster's slices relisted, the imported one not among them: it stays.
        let touched = state.replace_kind(
            ObjectKind::EndpointSlice,
            vec![ClusterObject::EndpointSlice(slice("web-2", "web", &[("10.244.1.3", "node-a")]))],
            &[],
            "node-a",
        );
        model.update(&state, &touched);
        assert_eq!(endpoints(&model), ["10.244.1.3", "10.245.0.7"]);

        let touched = state.apply(ClusterEvent::Delete(ObjectKind::EndpointSlice, remote.key()), "node-a");
        assert_eq!(model.update(&state, &touched).changed.len(), 1);
        assert_eq!(endpoints(&model), ["10.244.1.3"]);
    }

    /// A global service's cluster affinity: the preferred side while it has a ready
    /// endpoint, both sides when it has none.
    #[test]
    fn cluster_affinity_prefers_a_side_that_can_serve() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let endpoints = |model: &NodeLocalModel| endpoint_addresses(model, "web");
        let global = |affinity| Service { global: true, cluster_affinity: affinity, ..service("web", "10.96.0.10") };
        apply(&mut state, &mut model, ClusterObject::Service(global(ClusterAffinity::Local)));
        let local = slice("web-1", "web", &[("10.244.1.2", "node-a")]);
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(local.clone()));
        apply(
            &mut state,
            &mut model,
            ClusterObject::EndpointSlice(EndpointSlice {
                cluster: Some("east".into()),
                ..slice("web@east.0", "web", &[("10.245.0.7", "east-1")])
            }),
        );
        assert_eq!(endpoints(&model), ["10.244.1.2"], "local affinity, a local endpoint ready");
        apply(&mut state, &mut model, ClusterObject::Service(global(ClusterAffinity::Remote)));
        assert_eq!(endpoints(&model), ["10.245.0.7"], "remote affinity");
        apply(&mut state, &mut model, ClusterObject::Service(global(ClusterAffinity::None)));
        assert_eq!(endpoints(&model), ["10.244.1.2", "10.245.0.7"], "no affinity");

        // The local endpoint stops being ready: local affinity falls back to every endpoint.
        apply(&mut state, &mut model, ClusterObject::Service(global(ClusterAffinity::Local)));
        let mut unready = local;
        unready.endpoints[0].ready = false;
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(unready));
        assert_eq!(endpoints(&model), ["10.244.1.2", "10.245.0.7"], "local affinity without a ready local endpoint");
        // Not global: the affinity means nothing, other clusters' slices stay out.
        apply(
            &mut state,
            &mut model,
            ClusterObject::Service(Service { global: false, ..global(ClusterAffinity::Remote) }),
        );
        assert_eq!(endpoints(&model), ["10.244.1.2"]);
    }

    /// `--detect-local-mode NodeCIDR`: the guests' cluster CIDRs are the node's pod CIDRs,
    /// and follow them.
    #[test]
    fn node_cidr_local_detection_follows_the_node() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]).with_node_cidr_local_detection();
        assert!(model.context.cluster_cidrs.is_empty());
        assert!(model.local_detection_pending().is_some(), "no Node yet");
        assert_eq!(
            NodeLocalModel::new("node-a", vec![]).local_detection_pending(),
            None,
            "ClusterCIDR detection waits for nothing"
        );
        let node = |cidr: &str| Node {
            name: "node-a".into(),
            addresses: vec!["192.168.0.1".into()],
            pod_cidrs: vec![cidr.into()],
            labels: Labels::new(),
            being_deleted: false,
        };
        let u = apply(&mut state, &mut model, ClusterObject::Node(node("10.244.3.0/24")));
        assert!(u.context_changed);
        assert_eq!(model.context.cluster_cidrs, ["10.244.3.0/24"]);
        apply(&mut state, &mut model, ClusterObject::Node(node("10.244.4.0/24")));
        assert_eq!(model.context.cluster_cidrs, ["10.244.4.0/24"]);
        assert_eq!(model.local_detection_pending(), None);

        let mut configured = NodeLocalModel::new("node-a", vec!["10.244.0.0/16".into()]);
        apply(&mut state, &mut configured, ClusterObject::Node(node("10.244.4.0/24")));
        assert_eq!(configured.context.cluster_cidrs, ["10.244.0.0/16"], "ClusterCIDR: the configured ones");
    }

    #[test]
    fn revisions_move_only_on_real_change() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec!["10.244.0.0/16".into()]);
        let u = apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        assert_eq!(u.changed.len(), 1);
        assert_eq!(model.revision, 1);

        let u = apply(
            &mut state,
            &mut model,
            ClusterObject::EndpointSlice(slice("web-1", "web", &[("10.244.1.2", "node-a"), ("10.244.2.2", "node-b")])),
        );
        assert_eq!(u.changed.len(), 1);
        assert_eq!(model.revision, 2);
        let view = &model.services[&ObjectKey::new("default", "web")];
        assert!(view.slices[0].endpoints.iter().any(|e| e.is_local && e.addresses[0] == "10.244.1.2"));
        assert!(view.slices[0].endpoints.iter().any(|e| !e.is_local && e.addresses[0] == "10.244.2.2"));

        // Same endpoints in another order: no revision.
        let u = apply(
            &mut state,
            &mut model,
            ClusterObject::EndpointSlice(slice("web-1", "web", &[("10.244.2.2", "node-b"), ("10.244.1.2", "node-a")])),
        );
        assert!(u.is_empty());
        assert_eq!(model.revision, 2);

        // Another node's heartbeat: no revision.
        let node_b = Node {
            name: "node-b".into(),
            addresses: vec!["192.168.0.2".into()],
            pod_cidrs: vec![],
            labels: Labels::new(),
            being_deleted: false,
        };
        assert!(apply(&mut state, &mut model, ClusterObject::Node(node_b)).is_empty());

        // Our own node's addresses: a context change and a revision.
        let node_a = Node {
            name: "node-a".into(),
            addresses: vec!["192.168.0.1".into()],
            pod_cidrs: vec!["10.244.1.0/24".into()],
            labels: Labels::new(),
            being_deleted: false,
        };
        let u = apply(&mut state, &mut model, ClusterObject::Node(node_a.clone()));
        assert!(u.context_changed);
        assert_eq!(model.context.node_ips, vec!["192.168.0.1".to_string()]);
        assert_eq!(model.revision, 3);

        // Our node starts being deleted: a revision for the health checks, nothing for guests.
        let leaving = Node { being_deleted: true, ..node_a };
        let u = apply(&mut state, &mut model, ClusterObject::Node(leaving.clone()));
        assert!(u.node_being_deleted_changed && !u.context_changed && u.changed.is_empty(), "{u:?}");
        assert!(model.node_being_deleted);
        assert_eq!(model.revision, 4);
        assert!(apply(&mut state, &mut model, ClusterObject::Node(leaving)).is_empty());
        let touched = state.apply(ClusterEvent::Delete(ObjectKind::Node, ObjectKey::new("", "node-a")), "node-a");
        assert!(model.update(&state, &touched).node_being_deleted_changed);
        assert!(!model.node_being_deleted, "no Node object says nothing, as when there never was one");
    }

    #[test]
    fn stored_objects_and_views_keep_no_spare_capacity() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        // As a conversion that pushes or filters leaves them: room for more than they hold.
        let mut web = service("web", "10.96.0.10");
        web.cluster_ips.reserve(7);
        web.ports.reserve(7);
        apply(&mut state, &mut model, ClusterObject::Service(web));
        let mut web_1 = slice("web-1", "web", &[("10.244.1.2", "node-a"), ("10.244.2.2", "node-b")]);
        web_1.endpoints.reserve(7);
        web_1.endpoints[0].addresses.reserve(7);
        web_1.ports.reserve(7);
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(web_1));
        let mut pod = Pod {
            namespace: "default".into(),
            name: "p".into(),
            ips: Vec::with_capacity(8),
            node_name: None,
            labels: Labels::new(),
            ports: Vec::with_capacity(8),
            host_network: false,
        };
        pod.ips.push("10.244.1.2".into());
        apply(&mut state, &mut model, ClusterObject::Pod(pod));

        let key = ObjectKey::new("default", "web");
        let stored = &state.services[&key];
        assert_eq!((stored.cluster_ips.capacity(), stored.ports.capacity()), (1, 1));
        let stored = &state.endpoint_slices[&ObjectKey::new("default", "web-1")];
        assert_eq!(
            (stored.endpoints.capacity(), stored.endpoints[0].addresses.capacity(), stored.ports.capacity()),
            (2, 1, 1)
        );
        let stored = &state.pods[&ObjectKey::new("default", "p")];
        assert_eq!((stored.ips.capacity(), stored.ports.capacity()), (1, 0));
        // The view filters endpoints (topology) into vectors of its own.
        let view = &model.services[&key];
        assert_eq!((view.slices.capacity(), view.slices[0].endpoints.capacity()), (1, 2));
    }

    #[test]
    fn a_health_check_counts_ready_local_endpoints_per_address_and_port() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let mut lb = service("web", "10.96.0.10");
        lb.service_type = ServiceType::LoadBalancer;
        lb.external_traffic_policy = TrafficPolicy::Local;
        lb.health_check_node_port = 31000;
        apply(&mut state, &mut model, ClusterObject::Service(lb.clone()));
        let key = ObjectKey::new("default", "web");
        assert_eq!(model.services[&key].health_check(), Some(HealthCheck { port: 31000, local_endpoints: 0 }));

        let mut web_1 =
            slice("web-1", "web", &[("10.244.1.2", "node-a"), ("10.244.1.3", "node-a"), ("10.244.2.2", "node-b")]);
        web_1.ports.push(EndpointPort { name: "metrics".into(), protocol: Protocol::Tcp, port: 9090 });
        web_1.endpoints[1].ready = false;
        web_1.endpoints[1].terminating = true;
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(web_1));
        // The same endpoint in a second slice (as during a slice's rollover) counts once.
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice("web-2", "web", &[("10.244.1.2", "node-a")])));
        // 10.244.1.2 on two ports; 10.244.1.3 is not ready, 10.244.2.2 is on another node.
        assert_eq!(model.services[&key].health_check(), Some(HealthCheck { port: 31000, local_endpoints: 2 }));

        for other in [
            Service { external_traffic_policy: TrafficPolicy::Cluster, ..lb.clone() },
            Service { service_type: ServiceType::NodePort, ..lb.clone() },
            Service { health_check_node_port: 0, ..lb.clone() },
        ] {
            apply(&mut state, &mut model, ClusterObject::Service(other.clone()));
            assert_eq!(model.services[&key].health_check(), None, "{other:?}");
        }
    }

    #[test]
    fn service_cidrs_are_the_union_of_the_objects_and_not_the_guests_business() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let cidr = |name: &str, cidrs: &[&str]| {
            ClusterObject::ServiceCidr(ServiceCidr {
                name: name.into(),
                cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            })
        };
        let nets = |cidrs: &[&str]| cidrs.iter().map(|c| c.parse().unwrap()).collect::<Vec<ipnet::IpNet>>();
        apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        let u = apply(&mut state, &mut model, cidr("kubernetes", &["fd00:96::/108", "10.96.0.0/16"]));
        assert!(u.service_cidrs_changed && !u.context_changed && u.changed.is_empty(), "{u:?}");
        assert_eq!(model.service_cidrs, nets(&["10.96.0.0/16", "fd00:96::/108"]));
        // A second range, one repeated: sorted, once each.
        apply(&mut state, &mut model, cidr("extra", &["10.96.0.0/16", "10.100.0.0/16"]));
        assert_eq!(model.service_cidrs, nets(&["10.96.0.0/16", "10.100.0.0/16", "fd00:96::/108"]));
        let revision = model.revision;
        assert!(
            apply(&mut state, &mut model, cidr("extra", &["10.96.0.0/16", "10.100.0.0/16"])).is_empty(),
            "the same object again"
        );
        assert_eq!(model.revision, revision);
        // A relist without one of them deletes it.
        let touched = state.replace_kind(
            ObjectKind::ServiceCidr,
            vec![cidr("kubernetes", &["fd00:96::/108", "10.96.0.0/16"])],
            &[],
            "node-a",
        );
        assert!(model.update(&state, &touched).service_cidrs_changed);
        assert_eq!(model.service_cidrs, nets(&["10.96.0.0/16", "fd00:96::/108"]));
        let touched =
            state.apply(ClusterEvent::Delete(ObjectKind::ServiceCidr, ObjectKey::cluster("kubernetes")), "node-a");
        assert!(model.update(&state, &touched).service_cidrs_changed && model.service_cidrs.is_empty());

        // Configured ranges (`--service-cidr`) are there from the start and stay when the
        // objects go; an object repeating one changes nothing.
        let mut state = ClusterState::new();
        let mut model =
            NodeLocalModel::new("node-a", vec![]).with_service_cidrs(nets(&["10.96.0.0/16", "10.96.0.0/16"]));
        assert_eq!(model.service_cidrs, nets(&["10.96.0.0/16"]));
        assert!(!apply(&mut state, &mut model, cidr("kubernetes", &["10.96.0.0/16"])).service_cidrs_changed);
        assert!(
            apply(&mut state, &mut model, cidr("kubernetes", &["10.96.0.0/16", "fd00:96::/108"])).service_cidrs_changed
        );
        assert_eq!(model.service_cidrs, nets(&["10.96.0.0/16", "fd00:96::/108"]));
        let touched =
            state.apply(ClusterEvent::Delete(ObjectKind::ServiceCidr, ObjectKey::cluster("kubernetes")), "node-a");
        assert!(model.update(&state, &touched).service_cidrs_changed);
        assert_eq!(model.service_cidrs, nets(&["10.96.0.0/16"]));
    }

    #[test]
    fn local_traffic_policies_without_local_endpoints() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let key = ObjectKey::new("default", "web");
        let mut web = service("web", "10.96.0.10");
        web.internal_traffic_policy = TrafficPolicy::Local;
        web.external_traffic_policy = TrafficPolicy::Local;
        apply(&mut state, &mut model, ClusterObject::Service(web.clone()));
        // A ClusterIP service has no external traffic: only the internal policy counts.
        assert_eq!(model.services[&key].without_local_endpoints(), NoLocalEndpoints { internal: 1, external: 0 });
        web.service_type = ServiceType::NodePort;
        apply(&mut state, &mut model, ClusterObject::Service(web.clone()));
        assert_eq!(model.services[&key].without_local_endpoints(), NoLocalEndpoints { internal: 1, external: 1 });

        // Another node's endpoint does not help; a local one that is terminating but serving does.
        let mut slice_ab = slice("web-1", "web", &[("10.244.2.2", "node-b"), ("10.244.1.2", "node-a")]);
        slice_ab.endpoints[1].ready = false;
        slice_ab.endpoints[1].serving = false;
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice_ab.clone()));
        assert_eq!(model.services[&key].without_local_endpoints(), NoLocalEndpoints { internal: 1, external: 1 });
        slice_ab.endpoints[1].serving = true;
        slice_ab.endpoints[1].terminating = true;
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice_ab.clone()));
        assert_eq!(model.services[&key].without_local_endpoints(), NoLocalEndpoints::default());

        // Counted per port, as kube-proxy counts: a second port whose slice has no local
        // endpoint counts alone.
        web.ports.push(ServicePort::tcp("metrics", 9090, 9090));
        apply(&mut state, &mut model, ClusterObject::Service(web.clone()));
        assert_eq!(
            model.services[&key].without_local_endpoints(),
            NoLocalEndpoints { internal: 1, external: 1 },
            "no slice carries the metrics port"
        );
        let metrics = EndpointSlice {
            ports: vec![EndpointPort { name: "metrics".into(), protocol: Protocol::Tcp, port: 9090 }],
            ..slice("web-2", "web", &[("10.244.1.3", "node-a")])
        };
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(metrics));
        assert_eq!(model.services[&key].without_local_endpoints(), NoLocalEndpoints::default());
        slice_ab.endpoints[1].serving = false;
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice_ab));
        assert_eq!(
            model.services[&key].without_local_endpoints(),
            NoLocalEndpoints { internal: 1, external: 1 },
            "http alone"
        );

        // Cluster policies never count.
        let cluster = Service {
            internal_traffic_policy: TrafficPolicy::Cluster,
            external_traffic_policy: TrafficPolicy::Cluster,
            ..web
        };
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(slice("web-1", "web", &[("10.244.2.2", "node-b")])));
        apply(&mut state, &mut model, ClusterObject::Service(cluster));
        assert_eq!(model.services[&key].without_local_endpoints(), NoLocalEndpoints::default());
    }

    #[test]
    fn headless_services_are_not_in_the_model_and_deletes_are_reported() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let mut headless = service("db", "None");
        headless.cluster_ips = vec!["None".into()];
        assert!(apply(&mut state, &mut model, ClusterObject::Service(headless)).is_empty());
        apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        let touched =
            state.apply(ClusterEvent::Delete(ObjectKind::Service, ObjectKey::new("default", "web")), "node-a");
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
    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|&(k, v)| (k.into(), v.into())).collect()
    }

    fn pod(namespace: &str, name: &str, ip: &str, node: &str, app: &str) -> ClusterObject {
        ClusterObject::Pod(Pod {
            namespace: namespace.into(),
            name: name.into(),
            ips: vec![ip.into()],
            node_name: Some((*node).into()),
            labels: labels(&[("app", app)]),
            ports: vec![],
            host_network: false,
        })
    }

    fn namespace(name: &str, team: &str) -> ClusterObject {
        ClusterObject::Namespace(Namespace { name: name.into(), labels: labels(&[("team", team)]) })
    }

    /// `web` pods in `namespace` accept traffic from `app=client` pods of `team=<from_team>` namespaces.
    fn policy(namespace: &str, from_team: Option<&str>) -> ClusterObject {
        let select = |pairs: &[(&str, &str)]| LabelSelector { match_labels: labels(pairs), match_expressions: vec![] };
        ClusterObject::NetworkPolicy(NetworkPolicy {
            namespace: namespace.into(),
            name: "allow-clients".into(),
            uid: CompactString::default(),
            generation: 1,
            pod_selector: select(&[("app", "web")]),
            ingress: Some(vec![PolicyRule {
                ports: vec![],
                peers: vec![PolicyPeer {
                    pod_selector: Some(select(&[("app", "client")])),
                    namespace_selector: from_team.map(|t| select(&[("team", t)])),
                    ip_block: None,
                }],
            }]),
            egress: None,
        })
    }

    #[test]
    fn policies_follow_local_targets_and_peer_pods() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        for o in [namespace("shop", "blue"), namespace("tools", "red"), policy("shop", Some("red"))] {
            apply(&mut state, &mut model, o);
        }
        // No web pod on this node yet: the policy has nothing to enforce here.
        assert!(model.policies.is_empty());

        let u = apply(&mut state, &mut model, pod("shop", "web-1", "10.244.1.5", "node-a", "web"));
        assert_eq!(u.pods.len(), 1);
        assert_eq!(u.policies.len(), 1);
        let key = ObjectKey::new("shop", "allow-clients");
        assert_eq!(model.policies[&key].local_pods.len(), 1);
        assert!(model.policies[&key].peer_pods.is_empty());

        // A pod of this node the policy does not select, and one it selects on another node:
        // neither is a local target.
        apply(&mut state, &mut model, pod("shop", "db-1", "10.244.1.6", "node-a", "db"));
        apply(&mut state, &mut model, pod("shop", "web-2", "10.244.2.6", "node-b", "web"));
        assert_eq!(model.policies[&key].local_pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["web-1"]);
        for name in ["db-1", "web-2"] {
            let touched = state.apply(ClusterEvent::Delete(ObjectKind::Pod, ObjectKey::new("shop", name)), "node-a");
            model.update(&state, &touched);
        }

        // A client in a red namespace on another node: a peer of the policy.
        let u = apply(&mut state, &mut model, pod("tools", "client-1", "10.244.2.7", "node-b", "client"));
        assert_eq!(u.policies.len(), 1);
        assert!(u.pods.is_empty(), "a pod on another node is not a local pod");
        assert_eq!(model.policies[&key].peer_pods[0].ips, vec!["10.244.2.7".to_string()]);

        // A pod nobody selects, on another node: no revision at all.
        let revision = model.revision;
        assert!(apply(&mut state, &mut model, pod("tools", "batch-1", "10.244.2.8", "node-b", "batch")).is_empty());
        assert_eq!(model.revision, revision);

        // Relabelling the namespace away from red removes the peer.
        let u = apply(&mut state, &mut model, namespace("tools", "green"));
        assert_eq!(u.policies.len(), 1);
        assert!(model.policies[&key].peer_pods.is_empty());

        // The local web pod going away withdraws the policy from this node.
        let touched = state.apply(ClusterEvent::Delete(ObjectKind::Pod, ObjectKey::new("shop", "web-1")), "node-a");
        let u = model.update(&state, &touched);
        assert!(u.policies[0].view.is_none());
        assert!(u.pods[0].pod.is_none());
        assert!(model.policies.is_empty() && model.local_pods.is_empty());
    }

    #[test]
    fn same_namespace_peers_do_not_see_other_namespaces() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        for o in [
            namespace("shop", "blue"),
            namespace("tools", "red"),
            policy("shop", None),
            pod("shop", "web-1", "10.244.1.5", "node-a", "web"),
        ] {
            apply(&mut state, &mut model, o);
        }
        let revision = model.revision;
        assert!(apply(&mut state, &mut model, pod("tools", "client-1", "10.244.2.7", "node-b", "client")).is_empty());
        assert_eq!(model.revision, revision);
        apply(&mut state, &mut model, pod("shop", "client-2", "10.244.2.9", "node-b", "client"));
        let view = &model.policies[&ObjectKey::new("shop", "allow-clients")];
        assert_eq!(view.peer_pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), vec!["client-2"]);
    }

    /// The view visits only the namespaces some peer selects; its peer pods must still be
    /// exactly the pods the peers' definition (`PolicyPeer::selects`) selects, in key order.
    #[test]
    fn peer_pods_are_the_pods_some_peer_selects() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let select = |pairs: &[(&str, &str)]| LabelSelector { match_labels: labels(pairs), match_expressions: vec![] };
        let peer = |pod: Option<&[(&str, &str)]>, namespace: Option<&[(&str, &str)]>| PolicyPeer {
            pod_selector: pod.map(select),
            namespace_selector: namespace.map(select),
            ip_block: None,
        };
        let mut policy = NetworkPolicy {
            namespace: "shop".into(),
            name: "mixed".into(),
            uid: CompactString::default(),
            generation: 1,
            pod_selector: select(&[("app", "web")]),
            ingress: Some(vec![PolicyRule {
                ports: vec![],
                peers: vec![peer(Some(&[("app", "client")]), None), peer(None, Some(&[("team", "red")]))],
            }]),
            egress: Some(vec![PolicyRule {
                ports: vec![],
                peers: vec![peer(Some(&[("app", "db")]), Some(&[("team", "blue")]))],
            }]),
        };
        // `shop` has pods but no Namespace object: only the same-namespace peer reaches it.
        let mut objects = vec![
            namespace("tools", "red"),
            namespace("data", "blue"),
            namespace("misc", "green"),
            pod("shop", "web-1", "10.244.1.5", "node-a", "web"),
        ];
        for (i, ns) in ["shop", "tools", "data", "misc", "nowhere"].iter().enumerate() {
            for (j, app) in ["client", "db", "web", "batch"].iter().enumerate() {
                objects.push(pod(ns, &format!("{app}-{i}{j}"), &format!("10.244.{i}.{}", 10 + j), "node-b", app));
            }
        }
        let mut host = pod("tools", "host-net", "192.168.0.9", "node-b", "batch");
        if let ClusterObject::Pod(p) = &mut host {
            p.host_network = true;
        }
        objects.push(host);
        for o in objects {
            apply(&mut state, &mut model, o);
        }
        for round in 0..2 {
            apply(&mut state, &mut model, ClusterObject::NetworkPolicy(policy.clone()));
            let expected: Vec<&str> = state
                .pods
                .values()
                .filter(|pod| {
                    policy
                        .peers()
                        .any(|peer| peer.selects(&policy.namespace, pod, state.namespace_labels(&pod.namespace)))
                })
                .map(|p| p.name.as_str())
                .collect();
            let view = &model.policies[&ObjectKey::new("shop", "mixed")];
            let got: Vec<&str> = view.peer_pods.iter().map(|p| p.name.as_str()).collect();
            assert_eq!(got, expected, "round {round}");
            let mut names = got.clone();
            names.sort_unstable();
            let want = if round == 0 {
                vec!["batch-13", "client-00", "client-10", "db-11", "db-21", "web-12"]
            } else {
                vec!["client-00"]
            };
            assert_eq!(names, want, "round {round}");
            // Second round: only same-namespace peers left, in a namespace with no object.
            policy.ingress =
                Some(vec![PolicyRule { ports: vec![], peers: vec![peer(Some(&[("app", "client")]), None)] }]);
            policy.egress = None;
        }
    }

    /// The peer pod index follows pods (new, relabelled, deleted) and policies (a key that two
    /// policies require stays filed while either does): every view's peer pods stay what the
    /// peers' definition selects, and nothing stays filed once no policy requires it.
    #[test]
    fn the_peer_pod_index_follows_pods_and_policies() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let select = |pairs: &[(&str, &str)]| LabelSelector { match_labels: labels(pairs), match_expressions: vec![] };
        let peer = |pod: &[(&str, &str)], namespace: Option<&[(&str, &str)]>| PolicyPeer {
            pod_selector: Some(select(pod)),
            namespace_selector: namespace.map(select),
            ip_block: None,
        };
        let policy = |name: &str, peers: Vec<PolicyPeer>| NetworkPolicy {
            namespace: "shop".into(),
            name: name.into(),
            uid: CompactString::default(),
            generation: 1,
            pod_selector: select(&[("app", "web")]),
            ingress: Some(vec![PolicyRule { ports: vec![], peers }]),
            egress: None,
        };
        let mut objects = vec![
            namespace("shop", "green"),
            namespace("tools", "red"),
            namespace("data", "blue"),
            pod("shop", "web-1", "10.244.1.5", "node-a", "web"),
        ];
        for (i, ns) in ["shop", "tools", "data"].iter().enumerate() {
            for (j, app) in ["client", "db", "batch"].iter().enumerate() {
                objects.push(pod(ns, &format!("{app}-{i}{j}"), &format!("10.244.{i}.{}", 10 + j), "node-b", app));
            }
        }
        objects.push(ClusterObject::NetworkPolicy(policy(
            "any-client",
            vec![peer(&[("app", "client")], Some(&[])), peer(&[("app", "db")], None)],
        )));
        objects.push(ClusterObject::NetworkPolicy(policy(
            "red-client",
            vec![peer(&[("app", "client")], Some(&[("team", "red")]))],
        )));
        for o in objects {
            apply(&mut state, &mut model, o);
        }
        let check = |state: &ClusterState, model: &NodeLocalModel, step: &str| {
            for (key, policy) in &state.network_policies {
                let expected: Vec<&Pod> = state
                    .pods
                    .values()
                    .filter(|pod| {
                        policy
                            .peers()
                            .any(|peer| peer.selects(&policy.namespace, pod, state.namespace_labels(&pod.namespace)))
                    })
                    .map(|p| &**p)
                    .collect();
                // Whole pods: a peer's new address must be in the view, not its old one.
                let got: Vec<&Pod> = model.policies[key].peer_pods.iter().map(|p| &**p).collect();
                assert_eq!(got, expected, "{step}: {key}");
            }
        };
        let delete = |state: &mut ClusterState, model: &mut NodeLocalModel, kind: ObjectKind, ns: &str, name: &str| {
            let touched = state.apply(ClusterEvent::Delete(kind, ObjectKey::new(ns, name)), "node-a");
            model.update(state, &touched);
        };
        check(&state, &model, "initial");
        assert_eq!(model.policies[&ObjectKey::new("shop", "red-client")].peer_pods.len(), 1);
        apply(&mut state, &mut model, pod("tools", "batch-12", "10.244.1.12", "node-b", "client"));
        check(&state, &model, "relabelled to a peer");
        apply(&mut state, &mut model, pod("data", "client-new", "10.244.2.99", "node-b", "client"));
        check(&state, &model, "a new peer");
        apply(&mut state, &mut model, pod("data", "client-new", "10.244.2.100", "node-b", "client"));
        check(&state, &model, "a peer's new address");
        apply(&mut state, &mut model, pod("tools", "client-10", "10.244.1.10", "node-b", "batch"));
        check(&state, &model, "relabelled away");
        delete(&mut state, &mut model, ObjectKind::Pod, "data", "client-20");
        check(&state, &model, "a peer deleted");
        // A second key, which pods gain and lose as a label of their own (not a new value).
        apply(
            &mut state,
            &mut model,
            ClusterObject::NetworkPolicy(policy("gold", vec![peer(&[("tier", "gold")], Some(&[]))])),
        );
        let with_tier = |ip: &str, tier: Option<&str>| {
            let ClusterObject::Pod(mut pod) = pod("data", "batch-22", ip, "node-b", "batch") else { unreachable!() };
            if let Some(tier) = tier {
                pod.labels.insert("tier".into(), tier.into());
            }
            ClusterObject::Pod(pod)
        };
        apply(&mut state, &mut model, with_tier("10.244.2.12", Some("gold")));
        check(&state, &model, "a pod gains a label key a peer requires");
        assert_eq!(model.policies[&ObjectKey::new("shop", "gold")].peer_pods.len(), 1);
        apply(&mut state, &mut model, with_tier("10.244.2.13", Some("gold")));
        check(&state, &model, "that pod's new address");
        apply(&mut state, &mut model, with_tier("10.244.2.13", None));
        check(&state, &model, "the pod loses the key");
        assert!(model.policies[&ObjectKey::new("shop", "gold")].peer_pods.is_empty());
        delete(&mut state, &mut model, ObjectKind::NetworkPolicy, "shop", "gold");
        delete(&mut state, &mut model, ObjectKind::NetworkPolicy, "shop", "any-client");
        apply(&mut state, &mut model, pod("tools", "db-11", "10.244.1.11", "node-b", "client"));
        check(&state, &model, "one of two policies requiring `app` gone");
        assert_eq!(
            model.policies[&ObjectKey::new("shop", "red-client")].peer_pods.len(),
            2,
            "batch-12 and db-11, relabelled"
        );
        delete(&mut state, &mut model, ObjectKind::NetworkPolicy, "shop", "red-client");
        assert!(state.peer_pods.by_label.is_empty() && state.peer_pods.wanted.is_empty(), "{:?}", state.peer_pods);
    }

    /// A pod change touches exactly the policies that select or name it (before or after):
    /// the policy index only narrows the search.
    #[test]
    fn a_pod_change_touches_every_policy_naming_it_and_no_other() {
        let mut state = ClusterState::new();
        let select = |pairs: &[(&str, &str)]| LabelSelector { match_labels: labels(pairs), match_expressions: vec![] };
        let tier_in = LabelSelector {
            match_labels: Labels::new(),
            match_expressions: vec![SelectorRequirement {
                key: "app".into(),
                operator: SelectorOperator::In,
                values: vec!["db".into()],
            }],
        };
        let peer = |pod: Option<LabelSelector>, namespace: Option<LabelSelector>| PolicyPeer {
            pod_selector: pod,
            namespace_selector: namespace,
            ip_block: None,
        };
        let peers: Vec<Vec<PolicyPeer>> = vec![
            vec![peer(Some(select(&[("app", "client")])), None)],
            vec![peer(Some(select(&[("app", "client")])), Some(select(&[("team", "red")])))],
            vec![peer(Some(select(&[("app", "db")])), Some(select(&[])))],
            vec![peer(Some(tier_in.clone()), Some(select(&[])))],
            vec![peer(None, Some(select(&[("team", "blue")])))],
            vec![
                peer(Some(select(&[("app", "web")])), None),
                peer(Some(select(&[("app", "client"), ("tier", "x")])), Some(select(&[]))),
            ],
        ];
        for o in [namespace("shop", "blue"), namespace("tools", "red")] {
            state.apply(ClusterEvent::Upsert(o), "node-a");
        }
        let mut policies = Vec::new();
        for (i, peers) in peers.into_iter().enumerate() {
            for ns in ["shop", "tools"] {
                let policy = NetworkPolicy {
                    namespace: ns.into(),
                    name: format!("p{i}").into(),
                    uid: CompactString::default(),
                    generation: 1,
                    // Targets by a label, and by expressions only (any pod, to the index).
                    pod_selector: match i {
                        1 => tier_in.clone(),
                        4 => LabelSelector {
                            match_labels: Labels::new(),
                            match_expressions: vec![SelectorRequirement {
                                key: "app".into(),
                                operator: SelectorOperator::NotIn,
                                values: vec!["batch".into()],
                            }],
                        },
                        _ => select(&[("app", "web")]),
                    },
                    ingress: Some(vec![PolicyRule { ports: vec![], peers: peers.clone() }]),
                    egress: None,
                };
                state.apply(ClusterEvent::Upsert(ClusterObject::NetworkPolicy(policy.clone())), "node-a");
                policies.push(policy);
            }
        }
        let naming = |state: &ClusterState, pod: &Pod| -> BTreeSet<ObjectKey> {
            policies
                .iter()
                .filter(|p| p.involves(pod, state.namespace_labels(&pod.namespace)))
                .map(|p| p.key())
                .collect()
        };
        // One pod per namespace, relabelled in turn: the old and the new labels count.
        let mut current: BTreeMap<&str, Pod> = BTreeMap::new();
        for (ns, app) in [
            ("shop", "client"),
            ("shop", "db"),
            ("tools", "db"),
            ("tools", "client"),
            ("tools", "web"),
            ("tools", "batch"),
            ("shop", "batch"),
        ] {
            let ClusterObject::Pod(mut pod) = pod(ns, "x", "10.244.1.9", "node-b", app) else { unreachable!() };
            if app == "client" && ns == "tools" {
                pod.labels.insert("tier".into(), "x".into());
            }
            let mut want = naming(&state, &pod);
            assert_eq!(
                want.is_empty(),
                (ns, app) == ("tools", "batch"),
                "only a batch pod of a red namespace is nobody's peer"
            );
            if let Some(old) = current.get(ns) {
                want.extend(naming(&state, old));
            }
            let touched = state.apply(ClusterEvent::Upsert(ClusterObject::Pod(pod.clone())), "node-a");
            assert_eq!(touched.policies, want, "{ns}/{app}");
            current.insert(ns, pod);
        }
        // A policy whose peer changes its required label is found by the new one.
        let mut moved = policies[2].clone();
        moved.ingress.as_mut().unwrap()[0].peers = vec![peer(Some(select(&[("app", "cache")])), Some(select(&[])))];
        state.apply(ClusterEvent::Upsert(ClusterObject::NetworkPolicy(moved.clone())), "node-a");
        let touched = state.apply(ClusterEvent::Upsert(pod("tools", "y", "10.244.1.10", "node-b", "cache")), "node-a");
        assert!(touched.policies.contains(&moved.key()), "{:?}", touched.policies);
    }

    #[test]
    fn topology_hints_narrow_remote_endpoints_to_the_node_zone() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        let mut hinted =
            slice("web-1", "web", &[("10.244.1.2", "node-a"), ("10.244.2.2", "node-b"), ("10.244.3.2", "node-c")]);
        for (e, zone) in hinted.endpoints.iter_mut().zip(["zone-b", "zone-a", "zone-b"]) {
            e.for_zones = vec![zone.into()];
        }
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(hinted));
        let addresses = |model: &NodeLocalModel| -> Vec<CompactString> {
            model.services[&ObjectKey::new("default", "web")].slices[0]
                .endpoints
                .iter()
                .map(|e| e.addresses[0].clone())
                .collect()
        };
        // No zone on the node yet: hints are ignored.
        assert_eq!(addresses(&model).len(), 3);
        let node = Node {
            name: "node-a".into(),
            addresses: vec![],
            pod_cidrs: vec![],
            labels: labels(&[(ZONE_LABEL, "zone-a")]),
            being_deleted: false,
        };
        let u = apply(&mut state, &mut model, ClusterObject::Node(node));
        assert!(u.context_changed);
        assert_eq!(u.changed.len(), 1, "a zone change re-reads every service's hints");
        // zone-a: the remote endpoint hinted for zone-a, plus the local one (for Local policies).
        assert_eq!(addresses(&model), vec!["10.244.1.2".to_string(), "10.244.2.2".to_string()]);
    }

    #[test]
    fn node_hints_narrow_endpoints_to_this_nodes_before_zone_hints() {
        let mut state = ClusterState::new();
        let mut model = NodeLocalModel::new("node-a", vec![]);
        let node = Node {
            name: "node-a".into(),
            addresses: vec![],
            pod_cidrs: vec![],
            labels: labels(&[(ZONE_LABEL, "zone-a")]),
            being_deleted: false,
        };
        apply(&mut state, &mut model, ClusterObject::Node(node));
        apply(&mut state, &mut model, ClusterObject::Service(service("web", "10.96.0.10")));
        // What the EndpointSlice controller writes for `trafficDistribution: PreferSameNode`:
        // each endpoint hinted for its own node, and for its zone as a fallback.
        let hinted = |ready_here: bool, unhinted: bool| {
            let mut s =
                slice("web-1", "web", &[("10.244.1.2", "node-b"), ("10.244.2.2", "node-c"), ("10.244.3.2", "node-d")]);
            for (e, (node, zone)) in
                s.endpoints.iter_mut().zip([("node-a", "zone-a"), ("node-c", "zone-a"), ("node-d", "zone-b")])
            {
                e.for_nodes = vec![node.into()];
                e.for_zones = vec![zone.into()];
            }
            s.endpoints[0].ready = ready_here;
            if unhinted {
                s.endpoints[2].for_nodes.clear();
            }
            s
        };
        let addresses = |model: &NodeLocalModel| -> Vec<String> {
            model.services[&ObjectKey::new("default", "web")].slices[0]
                .endpoints
                .iter()
                .map(|e| e.addresses[0].to_string())
                .collect()
        };
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(hinted(true, false)));
        assert_eq!(addresses(&model), ["10.244.1.2"], "node hints first: the endpoint hinted for this node only");
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(hinted(false, false)));
        // (The unready one stays in the view, as in kube-proxy: readiness is the translator's.)
        assert_eq!(
            addresses(&model),
            ["10.244.1.2", "10.244.2.2"],
            "no ready endpoint hinted for this node: the zone's"
        );
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(hinted(true, true)));
        assert_eq!(
            addresses(&model),
            ["10.244.1.2", "10.244.2.2"],
            "a ready endpoint without node hints: zone hints apply"
        );
        let mut elsewhere = hinted(true, false);
        elsewhere.endpoints[0].for_nodes = vec!["node-b".into()];
        apply(&mut state, &mut model, ClusterObject::EndpointSlice(elsewhere));
        assert_eq!(
            addresses(&model),
            ["10.244.1.2", "10.244.2.2"],
            "no endpoint hinted for this node: zone hints apply"
        );
    }
}
