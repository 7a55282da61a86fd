//! What the daemon needs from the host: whether a pod is in the watch cache yet, and where
//! to report a pod's addresses. Simple implementations for tests and embedded mode.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use crate::protocol::PodRef;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A pod as the host's watch cache knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub uid: Option<String>,
}

/// The host's watch cache, as seen by ADD.
pub trait PodDirectory: Send + Sync {
    /// Resolves as soon as the pod is known (with `pod.uid` when that is given: a pod
    /// recreated under the same name is not the one the runtime asks for until the watch
    /// has delivered it), or with `None` once `timeout` has passed.
    fn wait_for_pod<'a>(&'a self, pod: &'a PodRef, timeout: Duration) -> BoxFuture<'a, Option<PodInfo>>;

    /// Whether the cache has had the cluster's whole state once; before that an ADD may
    /// wait for its pod up to its timeout (STATUS reports the plugin not available).
    fn synced(&self) -> bool {
        true
    }
}

/// Where a pod's addresses go the moment its network exists (the node-local model).
pub trait PodNetworkSink: Send + Sync {
    /// The pod's interface exists with these addresses (also called again for a repeated
    /// ADD). ADD answers once the returned future is done: the host has the pod's addresses
    /// in force (its policy in the kernel) before the runtime starts the pod's containers.
    fn pod_network_added(&self, namespace: &str, name: &str, ips: &[IpAddr]) -> BoxFuture<'static, ()>;
    /// These addresses of the pod were released. A pod recreated under the same name may
    /// have been added (with other addresses) before the old sandbox's DEL arrives: an
    /// implementation forgets the pod only if it still has these addresses.
    fn pod_network_removed(&self, namespace: &str, name: &str, ips: &[IpAddr]);
}

/// A pod cache fed by whoever watches (the host's pod watcher, a test).
#[derive(Default)]
pub struct PodCache {
    pods: Mutex<BTreeMap<(String, String), PodInfo>>,
    changed: Notify,
}

impl PodCache {
    pub fn new() -> PodCache {
        PodCache::default()
    }

    pub fn insert(&self, pod: PodInfo) {
        self.lock().insert((pod.namespace.clone(), pod.name.clone()), pod);
        self.changed.notify_waiters();
    }

    pub fn remove(&self, namespace: &str, name: &str) -> Option<PodInfo> {
        self.lock().remove(&(namespace.to_string(), name.to_string()))
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<PodInfo> {
        self.lock().get(&(namespace.to_string(), name.to_string())).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), PodInfo>> {
        self.pods.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PodDirectory for PodCache {
    fn wait_for_pod<'a>(&'a self, pod: &'a PodRef, timeout: Duration) -> BoxFuture<'a, Option<PodInfo>> {
        Box::pin(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                // Register for the wake-up before looking, so an insert in between is not missed.
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(found) = self.get(&pod.namespace, &pod.name)
                    && (pod.uid.is_none() || found.uid.is_none() || pod.uid == found.uid)
                {
                    return Some(found);
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    return None;
                }
            }
        })
    }
}

/// A directory that knows every pod at once: for runtimes without a watch (embedded mode
/// on a bare node, benchmarks).
pub struct AnyPod;

impl PodDirectory for AnyPod {
    fn wait_for_pod<'a>(&'a self, pod: &'a PodRef, _timeout: Duration) -> BoxFuture<'a, Option<PodInfo>> {
        Box::pin(async move {
            Some(PodInfo { namespace: pod.namespace.clone(), name: pod.name.clone(), uid: pod.uid.clone() })
        })
    }
}

/// A sink that keeps the current addresses of every pod (readable by tests and by an
/// embedded host that polls it).
#[derive(Default)]
pub struct PodNetworks {
    ips: Mutex<BTreeMap<(String, String), Vec<IpAddr>>>,
}

impl PodNetworks {
    pub fn new() -> PodNetworks {
        PodNetworks::default()
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Vec<IpAddr>> {
        self.lock().get(&(namespace.to_string(), name.to_string())).cloned()
    }

    pub fn snapshot(&self) -> BTreeMap<(String, String), Vec<IpAddr>> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), Vec<IpAddr>>> {
        self.ips.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PodNetworkSink for PodNetworks {
    fn pod_network_added(&self, namespace: &str, name: &str, ips: &[IpAddr]) -> BoxFuture<'static, ()> {
        self.lock().insert((namespace.into(), name.into()), ips.to_vec());
        Box::pin(std::future::ready(()))
    }

    fn pod_network_removed(&self, namespace: &str, name: &str, ips: &[IpAddr]) {
        let mut map = self.lock();
        let key = (namespace.to_string(), name.to_string());
        if map.get(&key).is_some_and(|current| current.as_slice() == ips) {
            map.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_removal_of_a_predecessor_keeps_the_new_pod() {
        let sink = PodNetworks::new();
        let (old, new): (IpAddr, IpAddr) = ("10.244.0.2".parse().unwrap(), "10.244.0.3".parse().unwrap());
        // This sink records at the call; its future has nothing left to wait for.
        drop(sink.pod_network_added("ns", "web-0", &[old]));
        drop(sink.pod_network_added("ns", "web-0", &[new])); // recreated before the old DEL
        sink.pod_network_removed("ns", "web-0", &[old]);
        assert_eq!(sink.get("ns", "web-0"), Some(vec![new]));
        sink.pod_network_removed("ns", "web-0", &[new]);
        assert_eq!(sink.get("ns", "web-0"), None);
    }
    use std::sync::Arc;

    #[tokio::test]
    async fn wait_resolves_on_insert_and_times_out() {
        let cache = Arc::new(PodCache::new());
        let c = cache.clone();
        let want = |name: &str, uid: Option<&str>| PodRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.map(Into::into),
        };
        let p = want("p", Some("u"));
        let waiter = tokio::spawn(async move { c.wait_for_pod(&p, Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The old incarnation (another uid) does not satisfy the wait.
        cache.insert(PodInfo { namespace: "ns".into(), name: "p".into(), uid: Some("old".into()) });
        tokio::time::sleep(Duration::from_millis(50)).await;
        cache.insert(PodInfo { namespace: "ns".into(), name: "p".into(), uid: Some("u".into()) });
        assert_eq!(waiter.await.unwrap().unwrap().uid.as_deref(), Some("u"));
        let started = std::time::Instant::now();
        assert!(cache.wait_for_pod(&want("other", None), Duration::from_millis(100)).await.is_none());
        assert!(started.elapsed() >= Duration::from_millis(100));
    }
}
