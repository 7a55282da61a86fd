//! Kubernetes label-selector semantics.

use crate::types::{Label, LabelSelector, SelectorOperator};

fn label_value<'a>(labels: &'a [Label], key: &str) -> Option<&'a str> {
    labels.iter().find(|l| l.key == key).map(|l| l.value.as_str())
}

/// Whether `labels` satisfy `selector`; an empty selector matches everything.
pub fn matches(selector: &LabelSelector, labels: &[Label]) -> bool {
    let labels_ok =
        selector.match_labels.iter().all(|want| label_value(labels, &want.key) == Some(want.value.as_str()));
    labels_ok
        && selector.match_expressions.iter().all(|req| {
            let value = label_value(labels, &req.key);
            match req.operator {
                SelectorOperator::In => value.is_some_and(|v| req.values.iter().any(|w| w == v)),
                SelectorOperator::NotIn => value.is_none_or(|v| !req.values.iter().any(|w| w == v)),
                SelectorOperator::Exists => value.is_some(),
                SelectorOperator::DoesNotExist => value.is_none(),
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::SelectorRequirement;

    fn label(k: &str, v: &str) -> Label {
        Label { key: k.into(), value: v.into() }
    }

    #[test]
    fn empty_selector_matches_everything() {
        let sel = LabelSelector { match_labels: vec![], match_expressions: vec![] };
        assert!(matches(&sel, &[]));
        assert!(matches(&sel, &[label("a", "b")]));
    }

    #[test]
    fn match_labels_and_expressions() {
        let sel = LabelSelector {
            match_labels: vec![label("app", "web")],
            match_expressions: vec![
                SelectorRequirement {
                    key: "tier".into(),
                    operator: SelectorOperator::In,
                    values: vec!["fe".into(), "be".into()],
                },
                SelectorRequirement { key: "canary".into(), operator: SelectorOperator::DoesNotExist, values: vec![] },
            ],
        };
        assert!(matches(&sel, &[label("app", "web"), label("tier", "fe")]));
        assert!(!matches(&sel, &[label("app", "web"), label("tier", "db")]));
        assert!(!matches(&sel, &[label("app", "web"), label("tier", "fe"), label("canary", "1")]));
        assert!(!matches(&sel, &[label("tier", "fe")]));
    }

    #[test]
    fn not_in_matches_missing_key() {
        let sel = LabelSelector {
            match_labels: vec![],
            match_expressions: vec![SelectorRequirement {
                key: "env".into(),
                operator: SelectorOperator::NotIn,
                values: vec!["prod".into()],
            }],
        };
        assert!(matches(&sel, &[]));
        assert!(matches(&sel, &[label("env", "dev")]));
        assert!(!matches(&sel, &[label("env", "prod")]));
    }
}
