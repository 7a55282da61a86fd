//! A map as a sorted vector, for the small maps the host keeps one of per object.
//!
//! A `BTreeMap` allocates a whole B-tree leaf for even one entry: ~540 bytes for
//! `String → String` (labels), ~800 for a service's map elements, and the host keeps one
//! per pod, service and node for the life of the process. A vector holds exactly its
//! entries, and lookups are a binary search over a handful of keys. The API is the subset
//! of `BTreeMap`'s the host uses, with the same meaning: sorted iteration, unique keys, the
//! last insert of a key wins, the same JSON.
//!
//! Inserting a new key moves the entries after it: build large maps with `collect` or
//! `extend` (one sort), not key by key.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Entries sorted by key, keys unique.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VecMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for VecMap<K, V> {
    fn default() -> Self {
        VecMap(Vec::new())
    }
}

impl<K, V> VecMap<K, V> {
    pub const fn new() -> Self {
        VecMap(Vec::new())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Entries in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&K, &V)> + ExactSizeIterator {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &K> + ExactSizeIterator {
        self.0.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &V> + ExactSizeIterator {
        self.0.iter().map(|(_, v)| v)
    }

    /// Entries in key order, their values to change in place (keys stay, and so the order).
    pub fn iter_mut(&mut self) -> impl DoubleEndedIterator<Item = (&K, &mut V)> + ExactSizeIterator {
        self.0.iter_mut().map(|(k, v)| (&*k, v))
    }

    /// Keeps the entries `keep` accepts, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.0.retain_mut(|(k, v)| keep(k, v));
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

impl<K: Ord, V> VecMap<K, V> {
    fn position<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.0.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    pub fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.position(key).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key<Q: Ord + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.position(key).is_ok()
    }

    /// Sets `key` to `value`; returns the value it replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.position(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    pub fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.position(key).ok().map(|i| self.0.remove(i).1)
    }

    /// Sorts by key, keeps the last of equal keys (what inserting them in order does) and
    /// gives back spare room.
    fn normalize(mut entries: Vec<(K, V)>) -> Self {
        // Stable: equal keys stay in insertion order.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries.reverse();
        entries.dedup_by(|later, earlier| later.0 == earlier.0);
        entries.reverse();
        entries.shrink_to_fit();
        VecMap(entries)
    }
}

impl<K: Ord, V> FromIterator<(K, V)> for VecMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self::normalize(iter.into_iter().collect())
    }
}

impl<K: Ord, V> Extend<(K, V)> for VecMap<K, V> {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        let mut entries = std::mem::take(&mut self.0);
        entries.extend(iter);
        *self = Self::normalize(entries);
    }
}

impl<K: Ord, V, const N: usize> From<[(K, V); N]> for VecMap<K, V> {
    fn from(entries: [(K, V); N]) -> Self {
        entries.into_iter().collect()
    }
}

/// From the form Kubernetes and protobuf give (already sorted, keys unique).
impl<K: Clone, V: Clone> From<&BTreeMap<K, V>> for VecMap<K, V> {
    fn from(map: &BTreeMap<K, V>) -> Self {
        VecMap(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

impl<K, V> IntoIterator for VecMap<K, V> {
    type Item = (K, V);
    type IntoIter = std::vec::IntoIter<(K, V)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a, K, V> IntoIterator for &'a VecMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

/// `map[key]`: the value, panicking when the key is absent (as `BTreeMap` does).
impl<K: Ord + Borrow<Q> + fmt::Debug, Q: Ord + fmt::Debug + ?Sized, V> std::ops::Index<&Q> for VecMap<K, V> {
    type Output = V;
    fn index(&self, key: &Q) -> &V {
        self.get(key).unwrap_or_else(|| panic!("no key {key:?} in the map"))
    }
}

impl<K: fmt::Debug, V: fmt::Debug> fmt::Debug for VecMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: Serialize, V: Serialize> Serialize for VecMap<K, V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de, K: Ord + Deserialize<'de>, V: Deserialize<'de>> Deserialize<'de> for VecMap<K, V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<K, V>::deserialize(deserializer)?;
        Ok(map.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every operation gives what a `BTreeMap` gives for the same steps, for a key type
    /// other than labels' (the dataplane's (map, key) pairs).
    #[test]
    fn behaves_like_a_btree_map_with_tuple_keys() {
        let k = |m: &str, key: &str| (m.to_string(), key.to_string());
        let steps =
            [(k("service-ips", "b"), 1), (k("hairpin", "a"), 2), (k("service-ips", "a"), 3), (k("hairpin", "a"), 4)];
        let mut map = VecMap::new();
        let mut btree = BTreeMap::new();
        for (key, v) in steps.clone() {
            assert_eq!(map.insert(key.clone(), v), btree.insert(key, v));
        }
        assert!(map.iter().eq(btree.iter()), "{map:?} vs {btree:?}");
        assert_eq!(map.get(&k("hairpin", "a")), Some(&4));
        assert_eq!(map[&k("service-ips", "a")], 3);
        let collected: VecMap<_, _> = steps.iter().cloned().collect();
        assert_eq!(collected, map, "collect keeps the last value of a key, as inserts do");
        let mut extended = VecMap::from([(k("z", "z"), 9), (k("hairpin", "a"), 0)]);
        extended.extend(steps.iter().cloned());
        btree.insert(k("z", "z"), 9);
        assert!(extended.iter().eq(btree.iter()), "extend: later entries win: {extended:?}");
        map.retain(|(m, _), v| {
            *v += 10;
            m == "service-ips"
        });
        btree.retain(|(m, _), v| {
            *v += 10;
            m == "service-ips"
        });
        assert!(map.iter().eq(btree.iter()), "{map:?} vs {btree:?}");
        assert_eq!(map.remove(&k("service-ips", "a")), btree.remove(&k("service-ips", "a")));
        assert!(map.keys().eq(btree.keys()) && map.values().eq(btree.values()));
    }

    #[test]
    fn collect_gives_back_spare_room() {
        let map: VecMap<u32, u32> = (0..100).filter(|i| i % 10 == 0).map(|i| (i, i)).collect();
        assert_eq!(map.0.capacity(), 10);
    }
}
