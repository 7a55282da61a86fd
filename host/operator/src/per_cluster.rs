//! What each remote cluster gives (its nodes, its exports), one value per cluster, replaced
//! whole by the cluster's follower and watched as a whole by whoever acts on it.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::watch;

/// One value per remote cluster, watched. Cheap to clone: every cluster's follower holds one.
pub struct PerCluster<T>(Arc<watch::Sender<BTreeMap<String, T>>>);

impl<T> Clone for PerCluster<T> {
    fn clone(&self) -> Self {
        PerCluster(self.0.clone())
    }
}

impl<T: Clone + PartialEq> PerCluster<T> {
    /// Empty, and a receiver of every change.
    pub fn new() -> (PerCluster<T>, watch::Receiver<BTreeMap<String, T>>) {
        let (tx, rx) = watch::channel(BTreeMap::new());
        (PerCluster(Arc::new(tx)), rx)
    }

    /// `cluster`'s value now (receivers are told only if it changed).
    pub fn set(&self, cluster: &str, value: T) {
        self.0.send_if_modified(|all| {
            let changed = all.get(cluster) != Some(&value);
            all.insert(cluster.to_string(), value);
            changed
        });
    }

    /// Forgets `cluster` (no longer followed): what it gave goes.
    pub fn remove(&self, cluster: &str) {
        self.0.send_if_modified(|all| all.remove(cluster).is_some());
    }

    /// Every cluster's value now.
    pub fn get(&self) -> BTreeMap<String, T> {
        self.0.borrow().clone()
    }

    /// A receiver of every change from now on.
    pub fn subscribe(&self) -> watch::Receiver<BTreeMap<String, T>> {
        self.0.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receivers_are_told_of_changes_only() {
        let (per_cluster, mut rx) = PerCluster::new();
        per_cluster.set("east", 1);
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        per_cluster.set("east", 1);
        assert!(!rx.has_changed().unwrap(), "the same value again is no change");
        per_cluster.remove("west");
        assert!(!rx.has_changed().unwrap(), "nothing to remove");
        per_cluster.remove("east");
        assert!(rx.has_changed().unwrap());
        assert!(per_cluster.get().is_empty());
    }
}
