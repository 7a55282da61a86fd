//! Read-only lookups in the host's model (the `lookups` capability), behind a trait so guest
//! logic can run natively in tests against a recorded cluster ([`StaticLookups`]).

use crate::selector;
use crate::types::{LabelSelector, Namespace, Pod};

/// What a guest may ask the host about the cluster.
pub trait Lookups {
    /// Pods matching both selectors. `namespace_selector: None` means the pods of
    /// `namespace` (of every namespace when that is `None` too). Host-network pods are never
    /// returned: policies neither select them nor name them as peers.
    fn pods_matching(
        &self,
        namespace: Option<&str>,
        namespace_selector: Option<&LabelSelector>,
        pod_selector: &LabelSelector,
    ) -> Vec<Pod>;
    fn namespace(&self, name: &str) -> Option<Namespace>;
}

/// The host's model, through the imported `lookups` interface (only inside a Wasm guest).
pub struct HostLookups;

#[cfg(target_family = "wasm")]
impl Lookups for HostLookups {
    fn pods_matching(
        &self,
        namespace: Option<&str>,
        namespace_selector: Option<&LabelSelector>,
        pod_selector: &LabelSelector,
    ) -> Vec<Pod> {
        crate::service::wasmplane::dataplane::lookups::pods_matching(namespace, namespace_selector, pod_selector)
    }
    fn namespace(&self, name: &str) -> Option<Namespace> {
        crate::service::wasmplane::dataplane::lookups::get_namespace(name)
    }
}

/// A recorded cluster answering like the host does (for native tests of guest logic).
#[derive(Clone, Debug, Default)]
pub struct StaticLookups {
    pub pods: Vec<Pod>,
    pub namespaces: Vec<Namespace>,
}

impl Lookups for StaticLookups {
    fn pods_matching(
        &self,
        namespace: Option<&str>,
        namespace_selector: Option<&LabelSelector>,
        pod_selector: &LabelSelector,
    ) -> Vec<Pod> {
        self.pods
            .iter()
            .filter(|p| !p.host_network && selector::matches(pod_selector, &p.labels))
            .filter(|p| match namespace_selector {
                // A namespace the cluster does not know has no labels to match.
                Some(sel) => {
                    namespace.is_none_or(|n| n == p.namespace)
                        && self.namespace(&p.namespace).is_some_and(|ns| selector::matches(sel, &ns.labels))
                }
                None => namespace.is_none_or(|n| n == p.namespace),
            })
            .cloned()
            .collect()
    }

    fn namespace(&self, name: &str) -> Option<Namespace> {
        self.namespaces.iter().find(|n| n.name == name).cloned()
    }
}
