//! The parts of each watched kind that wasmplane reads, as the types its watchers and manifest
//! directories deserialize into.
//!
//! The API server sends whole objects. Deserializing into these types skips what wasmplane
//! does not read while parsing (serde passes over unknown fields) instead of building
//! k8s-openapi's complete types only to drop them: no `managedFields`, annotations, container
//! specs, probes, volumes or node images are allocated, and each kind has a small deserializer
//! instead of k8s-openapi's (`PodSpec`'s alone is ~120 KiB of code the host ran on every pod
//! event). Of the annotations only those in [`READ_ANNOTATIONS`] are kept. Cilium's slim
//! types and client-go's managed-fields transform do the same. Nested
//! parts wasmplane reads whole (`ServiceSpec`, `NetworkPolicySpec`, `Endpoint`) are
//! k8s-openapi's own types.
//!
//! A slim type implements k8s-openapi's `Resource` with its full type's constants (kind, group,
//! version, URL path), so kube's `Api` and watcher treat it as that kind.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// Set by the EndpointSlice controller on each slice it writes: when the change (of a pod or
/// the service) that this version reflects happened. kube-proxy's network programming SLI
/// starts there.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";
/// On a Service, `"true"`: other clusters' endpoints of the same namespace and name are its
/// backends too (the operator's `GLOBAL_SERVICE_ANNOTATION`, Cilium's `service.cilium.io/global`).
pub const GLOBAL_SERVICE_ANNOTATION: &str = "wasmplane.io/global";
/// On a global Service, `local` or `remote`: which cluster's endpoints it prefers while any is
/// ready (Cilium's `service.cilium.io/affinity`); `none` or absent: none.
pub const CLUSTER_AFFINITY_ANNOTATION: &str = "wasmplane.io/affinity";
/// The annotations wasmplane reads; others (a `last-applied-configuration` can be as large as
/// the object) are skipped while parsing.
pub const READ_ANNOTATIONS: &[&str] =
    &[TRIGGER_TIME_ANNOTATION, GLOBAL_SERVICE_ANNOTATION, CLUSTER_AFFINITY_ANNOTATION];

/// The metadata fields wasmplane reads; the rest are skipped while parsing. Kept as
/// k8s-openapi's `ObjectMeta` (what kube's `Resource` hands out), with everything else unset.
fn metadata<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ObjectMeta, D::Error> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Read {
        name: Option<String>,
        namespace: Option<String>,
        uid: Option<String>,
        generation: Option<i64>,
        /// The watcher resumes from the last object's version.
        resource_version: Option<String>,
        labels: Option<BTreeMap<String, String>>,
        #[serde(default)]
        annotations: Option<ReadAnnotations>,
        /// A node being deleted is drained by load balancers.
        deletion_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
        /// Of two services claiming one frontend, the older keeps it. One that does not
        /// parse (a hand-written manifest) is no age, not a broken object.
        creation_timestamp: Option<String>,
    }
    let read = Read::deserialize(deserializer)?;
    Ok(ObjectMeta {
        name: read.name,
        namespace: read.namespace,
        uid: read.uid,
        generation: read.generation,
        resource_version: read.resource_version,
        labels: read.labels,
        annotations: read.annotations.map(|a| a.0).filter(|a| !a.is_empty()),
        deletion_timestamp: read.deletion_timestamp,
        creation_timestamp: read
            .creation_timestamp
            .and_then(|t| t.parse().ok())
            .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time),
        ..ObjectMeta::default()
    })
}

/// The annotations in [`READ_ANNOTATIONS`]; the keys of the others are compared in place and
/// their values skipped, nothing allocated for them.
struct ReadAnnotations(BTreeMap<String, String>);

impl<'de> Deserialize<'de> for ReadAnnotations {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Annotations;
        impl<'de> Visitor<'de> for Annotations {
            type Value = ReadAnnotations;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of annotations")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ReadAnnotations, A::Error> {
                let mut kept = BTreeMap::new();
                while let Some(key) = map.next_key_seed(ReadKey)? {
                    match key {
                        Some(key) => kept.insert(key.to_string(), map.next_value::<String>()?),
                        None => map.next_value::<IgnoredAny>().map(|_| None)?,
                    };
                }
                Ok(ReadAnnotations(kept))
            }
        }
        deserializer.deserialize_map(Annotations)
    }
}

/// An annotation's key: which of [`READ_ANNOTATIONS`] it is, if any.
struct ReadKey;

impl<'de> DeserializeSeed<'de> for ReadKey {
    type Value = Option<&'static str>;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for ReadKey {
    type Value = Option<&'static str>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an annotation key")
    }
    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Self::Value, E> {
        Ok(READ_ANNOTATIONS.iter().find(|read| **read == key).copied())
    }
}

/// Implements k8s-openapi's `Resource` and `Metadata` for a slim type with its full type's
/// constants; kube's blanket `Resource` impl then covers it.
macro_rules! slim_of {
    ($slim:ty, $full:ty) => {
        impl k8s_openapi::Resource for $slim {
            const API_VERSION: &'static str = <$full as k8s_openapi::Resource>::API_VERSION;
            const GROUP: &'static str = <$full as k8s_openapi::Resource>::GROUP;
            const KIND: &'static str = <$full as k8s_openapi::Resource>::KIND;
            const VERSION: &'static str = <$full as k8s_openapi::Resource>::VERSION;
            const URL_PATH_SEGMENT: &'static str = <$full as k8s_openapi::Resource>::URL_PATH_SEGMENT;
            type Scope = <$full as k8s_openapi::Resource>::Scope;
        }

        impl k8s_openapi::Metadata for $slim {
            type Ty = ObjectMeta;
            fn metadata(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn metadata_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Service {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
    pub spec: Option<core::ServiceSpec>,
    pub status: Option<ServiceStatus>,
}
slim_of!(Service, core::Service);

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceStatus {
    pub load_balancer: Option<core::LoadBalancerStatus>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct EndpointSlice {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub endpoints: Vec<discovery::Endpoint>,
    pub ports: Option<Vec<discovery::EndpointPort>>,
}
slim_of!(EndpointSlice, discovery::EndpointSlice);

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Node {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
    pub spec: Option<NodeSpec>,
    pub status: Option<NodeStatus>,
}
slim_of!(Node, core::Node);

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    #[serde(rename = "podCIDR")]
    pub pod_cidr: Option<String>,
    #[serde(rename = "podCIDRs")]
    pub pod_cidrs: Option<Vec<String>>,
    pub taints: Option<Vec<TaintKey>>,
}

/// Of a taint only its key (the cluster autoscaler's marks a node it is removing).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct TaintKey {
    pub key: String,
}

/// Of a node's status (conditions, images, capacity, ...) only its addresses.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct NodeStatus {
    pub addresses: Option<Vec<core::NodeAddress>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Namespace {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
}
slim_of!(Namespace, core::Namespace);

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Pod {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
    pub spec: Option<PodSpec>,
    pub status: Option<PodStatus>,
}
slim_of!(Pod, core::Pod);

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    pub node_name: Option<String>,
    pub host_network: Option<bool>,
    #[serde(default)]
    pub containers: Vec<Container>,
}

/// Of a container only its ports: policies name them.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Container {
    pub ports: Option<Vec<core::ContainerPort>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    pub phase: Option<PodPhase>,
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pub pod_ips: Option<Vec<core::PodIP>>,
}

/// `status.phase`, as far as the host needs it: `Succeeded` and `Failed` are terminal (the
/// pod's addresses are released).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum PodPhase {
    Succeeded,
    Failed,
    /// `Pending`, `Running`, `Unknown`.
    #[serde(other)]
    Live,
}

impl PodPhase {
    pub fn is_finished(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

/// A ServiceCIDR: its ranges (`spec.cidrs`), not its status conditions.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ServiceCidr {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
    pub spec: Option<networking::ServiceCIDRSpec>,
}
slim_of!(ServiceCidr, networking::ServiceCIDR);

#[derive(Clone, Debug, Default, Deserialize)]
pub struct NetworkPolicy {
    #[serde(default, deserialize_with = "metadata")]
    pub metadata: ObjectMeta,
    pub spec: Option<networking::NetworkPolicySpec>,
}
slim_of!(NetworkPolicy, networking::NetworkPolicy);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt as _;
    use serde_json::json;

    /// A pod as the API server sends it: everything wasmplane does not read is skipped, what
    /// it reads is there, and kube sees the kind k8s-openapi's `Pod` is.
    #[test]
    fn reads_what_wasmplane_uses_and_skips_the_rest() {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": "web-1", "namespace": "shop", "uid": "u-1", "resourceVersion": "42", "generation": 3,
                "labels": {"app": "web"}, "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                "managedFields": [{"manager": "kubelet", "operation": "Update", "fieldsV1": {"f:status": {}}}],
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": "r-1"}]
            },
            "spec": {
                "nodeName": "node-a", "hostNetwork": false,
                "containers": [{"name": "main", "image": "app:1", "env": [{"name": "A", "value": "b"}], "ports": [{"name": "http", "containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}}}],
                "volumes": [{"name": "data", "emptyDir": {}}], "tolerations": [{"operator": "Exists"}]
            },
            "status": {"phase": "Running", "podIP": "10.244.1.5", "podIPs": [{"ip": "10.244.1.5"}], "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        assert_eq!(
            (pod.name_any(), pod.namespace(), pod.resource_version()),
            ("web-1".into(), Some("shop".into()), Some("42".into()))
        );
        assert_eq!(pod.labels()["app"], "web");
        assert!(
            pod.metadata.annotations.is_none()
                && pod.metadata.managed_fields.is_none()
                && pod.metadata.owner_references.is_none()
        );
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(
            (spec.node_name.as_deref(), spec.containers[0].ports.as_ref().unwrap()[0].container_port),
            (Some("node-a"), 8080)
        );
        assert_eq!(pod.status.as_ref().unwrap().pod_ips.as_ref().unwrap()[0].ip, "10.244.1.5");
        assert_eq!(
            <Pod as kube::Resource>::url_path(&(), Some("shop")),
            <core::Pod as kube::Resource>::url_path(&(), Some("shop"))
        );
        assert_eq!(<EndpointSlice as kube::Resource>::url_path(&(), None), "/apis/discovery.k8s.io/v1/endpointslices");
        assert_eq!(<Node as kube::Resource>::url_path(&(), None), "/api/v1/nodes");
    }

    /// Of the annotations only those wasmplane reads are kept.
    #[test]
    fn keeps_only_the_annotations_it_reads() {
        let slice: EndpointSlice = serde_json::from_slice(
            br#"{"metadata": {"name": "web-1", "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{\"big\": [1, 2, 3]}",
                "endpoints.kubernetes.io/last-change-trigger-time": "2026-11-27T14:00:00.123456789Z",
                "note": "x"}}, "endpoints": []}"#,
        )
        .unwrap();
        let annotations = slice.metadata.annotations.unwrap();
        assert_eq!(annotations.len(), 1, "{annotations:?}");
        assert_eq!(annotations[TRIGGER_TIME_ANNOTATION], "2026-11-27T14:00:00.123456789Z");
        // An escaped key is still compared by its text; null annotations are none.
        let slice: EndpointSlice = serde_json::from_slice(
            br#"{"metadata": {"annotations": {"endpoints.kubernetes.io\/last-change-trigger-time": "t"}}}"#,
        )
        .unwrap();
        assert_eq!(slice.metadata.annotations.unwrap()[TRIGGER_TIME_ANNOTATION], "t");
        let slice: EndpointSlice = serde_json::from_value(json!({"metadata": {"annotations": null}})).unwrap();
        assert!(slice.metadata.annotations.is_none());
        let e =
            serde_json::from_value::<EndpointSlice>(json!({"metadata": {"annotations": {TRIGGER_TIME_ANNOTATION: 5}}}))
                .unwrap_err();
        assert!(e.to_string().contains("expected a string"), "{e}");
    }

    /// What is read still has to be well-formed.
    #[test]
    fn rejects_malformed_fields_it_reads() {
        let e = serde_json::from_value::<Pod>(json!({"metadata": {"name": "p"}, "status": {"podIPs": "10.244.1.5"}}))
            .unwrap_err();
        assert!(e.to_string().contains("expected a sequence"), "{e}");
        let e = serde_json::from_value::<Node>(json!({"metadata": {"labels": ["a"]}})).unwrap_err();
        assert!(e.to_string().contains("expected a map"), "{e}");
    }
}
