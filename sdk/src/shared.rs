//! Sets shared by every policy that declares them (see the `network-policy` interface in
//! `wit/wasmplane.wit`).
//!
//! The kernel finds a table's named sets by name in a list, so loading thousands of them is
//! quadratic (BENCHMARKS.md, "Network policy"). Many policies name the same peers ("from
//! the monitoring namespace", "from app=frontend"): one set per distinct peer selection,
//! shared by all of them, keeps the count to what is really distinct, as Calico's IP sets
//! per selector do. A shared set holds the union of what its declarers give it, so its name
//! must identify its members completely: derive it from a canonical form of what selects
//! them ([`selector_key`]), never from something two different selections could share.

use sha2::{Digest, Sha256};

use crate::types::LabelSelector;

/// Every shared set's name starts with this. `_` cannot occur in a namespace name, so it
/// cannot collide with a policy's own prefix `pol/<namespace>/<name>`.
pub const SHARED_SET_PREFIX: &str = "pol/_shared/";

/// The name of a shared set: `pol/_shared/<kind>/<128 bits of SHA-256 of key, hex>/<family>`.
/// `key` must identify the members completely (see [`selector_key`]); `family` is `v4` or `v6`.
pub fn shared_set_name(kind: &str, key: &[u8], family: &str) -> String {
    let digest = Sha256::digest(key);
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{SHARED_SET_PREFIX}{kind}/{hex}/{family}")
}

/// Appends a canonical, unambiguous encoding of `selector` to `out`: two selectors get the
/// same bytes only if they have the same requirements (labels and expressions sorted,
/// values sorted and deduplicated, every string length-prefixed).
pub fn selector_key(selector: &LabelSelector, out: &mut Vec<u8>) {
    let mut labels: Vec<(&str, &str)> =
        selector.match_labels.iter().map(|l| (l.key.as_str(), l.value.as_str())).collect();
    labels.sort_unstable();
    labels.dedup();
    put_len(out, labels.len());
    for (key, value) in labels {
        put_str(out, key);
        put_str(out, value);
    }
    let mut expressions: Vec<(&str, u8, Vec<&str>)> = selector
        .match_expressions
        .iter()
        .map(|r| {
            let mut values: Vec<&str> = r.values.iter().map(String::as_str).collect();
            values.sort_unstable();
            values.dedup();
            (r.key.as_str(), r.operator as u8, values)
        })
        .collect();
    expressions.sort_unstable();
    expressions.dedup();
    put_len(out, expressions.len());
    for (key, operator, values) in expressions {
        put_str(out, key);
        out.push(operator);
        put_len(out, values.len());
        for v in values {
            put_str(out, v);
        }
    }
}

/// Appends a length-prefixed string (see [`selector_key`]).
pub fn put_str(out: &mut Vec<u8>, s: &str) {
    put_bytes(out, s.as_bytes());
}

/// Appends length-prefixed bytes (a key of several parts: each part this way).
pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.extend_from_slice(bytes);
}

fn put_len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(n as u64).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Label, SelectorOperator, SelectorRequirement};

    fn label(k: &str, v: &str) -> Label {
        Label { key: k.into(), value: v.into() }
    }

    fn key(selector: &LabelSelector) -> Vec<u8> {
        let mut out = Vec::new();
        selector_key(selector, &mut out);
        out
    }

    #[test]
    fn order_does_not_matter_requirements_do() {
        let expression = |values: &[&str]| SelectorRequirement {
            key: "tier".into(),
            operator: SelectorOperator::In,
            values: values.iter().map(|v| v.to_string()).collect(),
        };
        let a = LabelSelector {
            match_labels: vec![label("app", "web"), label("env", "prod")],
            match_expressions: vec![expression(&["fe", "be"])],
        };
        let b = LabelSelector {
            match_labels: vec![label("env", "prod"), label("app", "web")],
            match_expressions: vec![expression(&["be", "fe", "be"])],
        };
        assert_eq!(key(&a), key(&b));
        let c = LabelSelector { match_labels: a.match_labels.clone(), match_expressions: vec![expression(&["fe"])] };
        assert_ne!(key(&a), key(&c));
        let not_in = LabelSelector {
            match_labels: a.match_labels.clone(),
            match_expressions: vec![SelectorRequirement {
                operator: SelectorOperator::NotIn,
                ..expression(&["fe", "be"])
            }],
        };
        assert_ne!(key(&a), key(&not_in));
    }

    #[test]
    fn strings_cannot_run_into_each_other() {
        // Without length prefixes "ab" + "c" and "a" + "bc" would encode alike.
        let one = LabelSelector { match_labels: vec![label("ab", "c")], match_expressions: vec![] };
        let two = LabelSelector { match_labels: vec![label("a", "bc")], match_expressions: vec![] };
        assert_ne!(key(&one), key(&two));
    }

    #[test]
    fn names_are_valid_and_distinct() {
        let name = shared_set_name("peers", b"x", "v4");
        assert!(name.starts_with("pol/_shared/peers/") && name.ends_with("/v4"), "{name}");
        assert_eq!(name.len(), "pol/_shared/peers//v4".len() + 32);
        assert_ne!(name, shared_set_name("peers", b"y", "v4"));
        assert_eq!(name, shared_set_name("peers", b"x", "v4"));
    }
}
