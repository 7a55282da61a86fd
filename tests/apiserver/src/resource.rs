//! Resource types the server knows: group, version, plural, kind and scope.

use std::any::TypeId;
use std::fmt;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints, Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;

/// The identity of a resource type in URLs: `(group, version, plural)`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceKey {
    /// API group, empty for the core group.
    pub group: String,
    pub version: String,
    /// Lower-case plural, the URL path segment (`services`, `endpointslices`).
    pub plural: String,
}

impl ResourceKey {
    pub fn new(group: &str, version: &str, plural: &str) -> Self {
        Self { group: group.to_owned(), version: version.to_owned(), plural: plural.to_owned() }
    }

    /// The key of a k8s-openapi type.
    pub fn of<K: k8s_openapi::Resource>() -> Self {
        Self::new(K::GROUP, K::VERSION, K::URL_PATH_SEGMENT)
    }
}

impl fmt::Display for ResourceKey {
    /// `plural` for the core group, `plural.group` otherwise, as kubectl and error messages name it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() { f.write_str(&self.plural) } else { write!(f, "{}.{}", self.plural, self.group) }
    }
}

/// A resource type the server serves.
///
/// Registering one is a single line, usually from its k8s-openapi type:
/// `TestApiServer::builder().resource(ResourceType::of::<Deployment>())`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceType {
    pub key: ResourceKey,
    /// `Service`, `EndpointSlice`, ...
    pub kind: String,
    /// Namespaced resources live under `/namespaces/{ns}/`; cluster-scoped ones do not.
    pub namespaced: bool,
    /// With a status subresource (the default), writes to the main resource keep the stored
    /// `status` and writes to `/status` change nothing else, as on a real server. Harmless for
    /// kinds without a `status` field (Lease, EndpointSlice): there is nothing to keep.
    pub status_subresource: bool,
}

impl ResourceType {
    /// Describe a resource type by hand (for kinds without a k8s-openapi type, e.g. CRDs).
    pub fn new(group: &str, version: &str, plural: &str, kind: &str, namespaced: bool) -> Self {
        Self {
            key: ResourceKey::new(group, version, plural),
            kind: kind.to_owned(),
            namespaced,
            status_subresource: true,
        }
    }

    /// Describe the resource type of a k8s-openapi type; its scope comes from `K::Scope`.
    pub fn of<K>() -> Self
    where
        K: k8s_openapi::Resource,
        K::Scope: 'static,
    {
        let namespaced = TypeId::of::<K::Scope>() == TypeId::of::<k8s_openapi::NamespaceResourceScope>();
        Self::new(K::GROUP, K::VERSION, K::URL_PATH_SEGMENT, K::KIND, namespaced)
    }

    /// Serve this type without a `/status` subresource: the main resource writes everything.
    pub fn without_status_subresource(mut self) -> Self {
        self.status_subresource = false;
        self
    }

    /// `v1` or `group/version`, the `apiVersion` of its objects.
    pub fn api_version(&self) -> String {
        if self.key.group.is_empty() {
            self.key.version.clone()
        } else {
            format!("{}/{}", self.key.group, self.key.version)
        }
    }

    /// `ServiceList`, the kind of a list response.
    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }
}

/// What [`crate::TestApiServer::start`] registers: everything wasmplane's watchers, writers and
/// operator touch.
pub fn default_resources() -> Vec<ResourceType> {
    vec![
        ResourceType::of::<Service>(),
        ResourceType::of::<Pod>(),
        ResourceType::of::<Node>(),
        ResourceType::of::<Namespace>(),
        ResourceType::of::<Endpoints>(),
        ResourceType::of::<ConfigMap>(),
        ResourceType::of::<EndpointSlice>(),
        ResourceType::of::<NetworkPolicy>(),
        ResourceType::of::<Lease>(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_and_names_come_from_the_type() {
        let svc = ResourceType::of::<Service>();
        assert!(svc.namespaced);
        assert_eq!(svc.key.to_string(), "services");
        assert_eq!(svc.api_version(), "v1");
        let node = ResourceType::of::<Node>();
        assert!(!node.namespaced);
        let lease = ResourceType::of::<Lease>();
        assert_eq!(lease.key.to_string(), "leases.coordination.k8s.io");
        assert_eq!(lease.api_version(), "coordination.k8s.io/v1");
        assert_eq!(lease.list_kind(), "LeaseList");
    }
}
