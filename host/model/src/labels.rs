//! Kubernetes labels as a sorted vector.
//!
//! Objects carry one or two labels each, and the host keeps every pod, service, node and
//! namespace of the cluster (pods for policy peers), some twice (the cluster index and the
//! node-local views). A `BTreeMap<String, String>` allocates a whole B-tree leaf (~540 bytes)
//! for even one entry; a vector holds exactly its entries. Lookups are a binary search over
//! a handful of keys. The API is the subset of `BTreeMap`'s the host uses, with the same
//! meaning (sorted iteration, unique keys, the last insert of a key wins), and it serializes
//! as the same JSON map.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `key=value` labels, sorted by key, keys unique.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels(Vec<(String, String)>);

impl Labels {
    pub const fn new() -> Labels {
        Labels(Vec::new())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(key))
    }

    pub fn get(&self, key: &str) -> Option<&String> {
        self.position(key).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.position(key).is_ok()
    }

    /// Sets `key` to `value`; returns the value it replaced.
    pub fn insert(&mut self, key: String, value: String) -> Option<String> {
        match self.position(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    pub fn remove(&mut self, key: &str) -> Option<String> {
        self.position(key).ok().map(|i| self.0.remove(i).1)
    }

    /// Entries in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (&String, &String)> + ExactSizeIterator {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &String> + ExactSizeIterator {
        self.0.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl DoubleEndedIterator<Item = &String> + ExactSizeIterator {
        self.0.iter().map(|(_, v)| v)
    }
}

impl FromIterator<(String, String)> for Labels {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Labels {
        let mut entries: Vec<(String, String)> = iter.into_iter().collect();
        // Stable sort, then keep the last of equal keys: what inserting them in order does.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries.reverse();
        entries.dedup_by(|later, earlier| later.0 == earlier.0);
        entries.reverse();
        entries.shrink_to_fit();
        Labels(entries)
    }
}

/// Kubernetes' and protobuf's form of labels (already sorted, keys unique).
impl From<&std::collections::BTreeMap<String, String>> for Labels {
    fn from(map: &std::collections::BTreeMap<String, String>) -> Labels {
        Labels(map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

impl<const N: usize> From<[(String, String); N]> for Labels {
    fn from(entries: [(String, String); N]) -> Labels {
        entries.into_iter().collect()
    }
}

impl Extend<(String, String)> for Labels {
    fn extend<I: IntoIterator<Item = (String, String)>>(&mut self, iter: I) {
        for (key, value) in iter {
            self.insert(key, value);
        }
    }
}

impl IntoIterator for Labels {
    type Item = (String, String);
    type IntoIter = std::vec::IntoIter<(String, String)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a Labels {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (String, String)>, fn(&'a (String, String)) -> (&'a String, &'a String)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

/// `labels["app"]`: the value, panicking when the key is absent (as `BTreeMap` does).
impl std::ops::Index<&str> for Labels {
    type Output = String;
    fn index(&self, key: &str) -> &String {
        self.get(key).unwrap_or_else(|| panic!("no label {key:?}"))
    }
}

impl fmt::Debug for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Labels {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Labels, D::Error> {
        let map = std::collections::BTreeMap::<String, String>::deserialize(deserializer)?;
        Ok(map.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn s(v: &str) -> String {
        v.to_string()
    }

    /// Every operation gives what a `BTreeMap` gives for the same steps.
    #[test]
    fn behaves_like_a_btree_map() {
        let steps = [("tier", "web"), ("app", "shop"), ("zone", "a"), ("app", "cart"), ("b", "1")];
        let mut labels = Labels::new();
        let mut map = BTreeMap::new();
        for (k, v) in steps {
            assert_eq!(labels.insert(s(k), s(v)), map.insert(s(k), s(v)));
        }
        assert!(labels.iter().eq(map.iter()), "{labels:?} vs {map:?}");
        assert_eq!(Labels::from(&map), labels);
        assert_eq!(labels.len(), 4);
        assert_eq!(labels.get("app"), Some(&s("cart")));
        assert_eq!(labels.get("apps"), None);
        assert!(labels.contains_key("zone") && !labels.contains_key("z"));
        assert_eq!(labels.remove("tier"), map.remove("tier"));
        assert_eq!(labels.remove("tier"), None);
        assert!(labels.keys().eq(map.keys()) && labels.values().eq(map.values()));
        let collected: Labels = steps.iter().map(|(k, v)| (s(k), s(v))).collect();
        let collected_map: BTreeMap<String, String> = steps.iter().map(|(k, v)| (s(k), s(v))).collect();
        assert!(collected.iter().eq(collected_map.iter()), "the last value of a key wins: {collected:?}");
        assert_eq!(format!("{collected:?}"), format!("{collected_map:?}"));
    }

    #[test]
    fn serializes_as_a_json_map() {
        let labels = Labels::from([(s("b"), s("2")), (s("a"), s("1"))]);
        let json = serde_json::to_string(&labels).unwrap();
        assert_eq!(json, r#"{"a":"1","b":"2"}"#);
        assert_eq!(serde_json::from_str::<Labels>(&json).unwrap(), labels);
        assert!(serde_json::from_str::<Labels>(r#"["a"]"#).is_err());
    }
}
