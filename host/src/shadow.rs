//! Shadow runs: a module version runs on live state beside the one in force; its output is
//! kept here and never written. [`diff`] says exactly what promoting it would change in
//! the dataplane: chains, rules, sets and map elements added and removed, per object.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use wasmplane_model::{CompactString, ObjectKey};
use wasmplane_runtime::TranslatorSession;

use crate::nft::{ElementKey, ObjectRules};

/// A version running in shadow on this node.
pub struct ShadowRun {
    pub name: String,
    pub version: u32,
    pub session: TranslatorSession,
    /// What the shadow wants per service (last successful output).
    pub outputs: BTreeMap<ObjectKey, ObjectRules>,
    /// Services the shadow could not translate, with why.
    pub errors: BTreeMap<ObjectKey, String>,
    pub calls: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Element {
    pub map: String,
    pub key: String,
    pub verdict: String,
}

/// What promoting the shadow would change for one object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ObjectDiff {
    pub chains_added: Vec<String>,
    pub chains_removed: Vec<String>,
    /// Per chain present before and after: rules only in the shadow's version / only in
    /// the applied one. A chain that is only reordered lists every rule in `reordered`.
    pub rules_added: BTreeMap<String, Vec<String>>,
    pub rules_removed: BTreeMap<String, Vec<String>>,
    pub reordered: Vec<String>,
    pub sets_added: Vec<String>,
    pub sets_removed: Vec<String>,
    pub sets_changed: Vec<String>,
    pub elements_added: Vec<Element>,
    pub elements_removed: Vec<Element>,
}

impl ObjectDiff {
    pub fn is_empty(&self) -> bool {
        *self == ObjectDiff::default()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ShadowDiff {
    pub module: String,
    pub version: u32,
    /// Objects whose dataplane would change, keyed `namespace/name`.
    pub objects: BTreeMap<String, ObjectDiff>,
    /// Objects the shadow failed on (promoting it would keep their current rules).
    pub errors: BTreeMap<String, String>,
    pub unchanged_objects: usize,
}

fn rules_only_in(a: &[String], b: &[String]) -> Vec<String> {
    // Multiset difference: a rule given twice and kept once counts once.
    let mut remaining: BTreeMap<&str, usize> = BTreeMap::new();
    for rule in b {
        *remaining.entry(rule).or_default() += 1;
    }
    a.iter()
        .filter(|rule| match remaining.get_mut(rule.as_str()) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .cloned()
        .collect()
}

/// The change from `applied` to `wanted` for one object.
pub fn object_diff(applied: &ObjectRules, wanted: &ObjectRules) -> ObjectDiff {
    let mut diff = ObjectDiff::default();
    for (chain, rules) in &wanted.chains {
        match applied.chains.get(chain) {
            None => diff.chains_added.push(chain.clone()),
            Some(old) if old == rules => {}
            Some(old) => {
                let (added, removed) = (rules_only_in(rules, old), rules_only_in(old, rules));
                if added.is_empty() && removed.is_empty() {
                    diff.reordered.push(chain.clone());
                }
                if !added.is_empty() {
                    diff.rules_added.insert(chain.clone(), added);
                }
                if !removed.is_empty() {
                    diff.rules_removed.insert(chain.clone(), removed);
                }
            }
        }
    }
    diff.chains_removed = applied.chains.keys().filter(|c| !wanted.chains.contains_key(*c)).cloned().collect();
    for (set, body) in &wanted.sets {
        match applied.sets.get(set) {
            None => diff.sets_added.push(set.clone()),
            Some(old) if old != body => diff.sets_changed.push(set.clone()),
            Some(_) => {}
        }
    }
    diff.sets_removed = applied.sets.keys().filter(|s| !wanted.sets.contains_key(*s)).cloned().collect();
    let element = |((map, key), verdict): (&ElementKey, &CompactString)| Element {
        map: map.to_string(),
        key: key.to_string(),
        verdict: verdict.to_string(),
    };
    diff.elements_added =
        wanted.elements.iter().filter(|(k, v)| applied.elements.get(*k) != Some(*v)).map(element).collect();
    diff.elements_removed =
        applied.elements.iter().filter(|(k, v)| wanted.elements.get(*k) != Some(*v)).map(element).collect();
    diff
}

/// The dataplane difference between what is applied and what the shadow wants.
pub fn diff(shadow: &ShadowRun, applied: &BTreeMap<ObjectKey, std::sync::Arc<ObjectRules>>) -> ShadowDiff {
    let empty = ObjectRules::default();
    let keys: BTreeSet<&ObjectKey> = applied.keys().chain(shadow.outputs.keys()).collect();
    let mut objects = BTreeMap::new();
    let mut unchanged_objects = 0;
    for key in keys {
        if shadow.errors.contains_key(key) {
            continue;
        }
        let before = applied.get(key).map_or(&empty, |r| r.as_ref());
        let after = shadow.outputs.get(key).unwrap_or(&empty);
        let d = object_diff(before, after);
        if d.is_empty() {
            unchanged_objects += 1;
        } else {
            objects.insert(key.to_string(), d);
        }
    }
    ShadowDiff {
        module: shadow.name.clone(),
        version: shadow.version,
        objects,
        errors: shadow.errors.iter().map(|(k, e)| (k.to_string(), e.clone())).collect(),
        unchanged_objects,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(chains: &[(&str, &[&str])], elements: &[(&str, &str, &str)]) -> ObjectRules {
        ObjectRules {
            chains: chains.iter().map(|(c, r)| (c.to_string(), r.iter().map(|s| s.to_string()).collect())).collect(),
            sets: BTreeMap::new(),
            elements: elements.iter().map(|(m, k, v)| (((*m).into(), (*k).into()), (*v).into())).collect(),
            warnings: vec![],
            service_prefix: None,
            created_unix: None,
        }
    }

    #[test]
    fn diff_names_chains_rules_and_elements_on_both_sides() {
        let applied = rules(
            &[("svc/a", &["r1", "r2", "r2"]), ("svc/a/old", &["x"]), ("svc/a/same", &["s1", "s2"])],
            &[("service-ips", "k1", "goto svc/a"), ("service-ips", "k2", "goto svc/a")],
        );
        let wanted = rules(
            &[("svc/a", &["r1", "r2", "r3"]), ("svc/a/new", &["y"]), ("svc/a/same", &["s2", "s1"])],
            &[("service-ips", "k1", "goto svc/a"), ("service-ips", "k2", "goto svc/a/new")],
        );
        let d = object_diff(&applied, &wanted);
        assert_eq!(d.chains_added, ["svc/a/new"]);
        assert_eq!(d.chains_removed, ["svc/a/old"]);
        assert_eq!(d.rules_added["svc/a"], ["r3"]);
        assert_eq!(d.rules_removed["svc/a"], ["r2"], "one of the two identical rules goes");
        assert_eq!(d.reordered, ["svc/a/same"]);
        assert_eq!(
            d.elements_added,
            [Element { map: "service-ips".into(), key: "k2".into(), verdict: "goto svc/a/new".into() }]
        );
        assert_eq!(
            d.elements_removed,
            [Element { map: "service-ips".into(), key: "k2".into(), verdict: "goto svc/a".into() }]
        );
        assert!(object_diff(&applied, &applied).is_empty());
    }
}
