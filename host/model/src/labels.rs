//! Kubernetes labels as a sorted vector ([`VecMap`]).
//!
//! Objects carry one or two labels each, and the host keeps every pod, service, node and
//! namespace of the cluster (pods for policy peers), some twice (the cluster index and the
//! node-local views): a `BTreeMap` leaf (~540 bytes) each was the largest part of them.

use crate::CompactString;
use crate::vec_map::VecMap;

/// `key=value` labels, sorted by key, keys unique; serialized as a JSON map.
pub type Labels = VecMap<CompactString, CompactString>;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn s(v: &str) -> CompactString {
        v.into()
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
        let collected_map: BTreeMap<CompactString, CompactString> = steps.iter().map(|(k, v)| (s(k), s(v))).collect();
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
