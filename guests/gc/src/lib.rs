//! The default garbage-collection guest: given the kvstore entries the host
//! offers as candidates, names the ones to delete.
//!
//! The host only offers entries it knows how to judge (with their age and
//! whether the object they belong to still exists) and deletes at a bounded
//! rate only keys it offered; this guest decides *which*. The default policy
//! never deletes an entry whose owner still exists, except a lock held far
//! past any sane lifetime, and waits a grace period per kind so a brief
//! absence (a rebooting node, a policy being recreated, an operator
//! restarting) does not lose state:
//!
//! | kind             | deleted when the owner is gone and older than |
//! |------------------|-----------------------------------------------|
//! | `stale-node`     | 1 h (a node ID must survive a reboot)          |
//! | `node-status`    | 5 min                                          |
//! | `policy-status`  | 1 min                                          |
//! | `service-sync`   | 1 min                                          |
//! | `lock`           | 0 s (its holder is gone), or 1 h regardless    |
//! | `module-version` | 24 h (the rollback window)                     |
//!
//! Settings (`PUT /v1/modules/default-gc/settings`) change them per kind, in seconds, and the
//! lock limit: `{"graceSeconds": {"node-status": 900}, "lockHardLimitSeconds": 7200}`.
//! Anything else is refused, by the exported check the host asks before storing them.

use std::collections::{BTreeMap, BTreeSet};

pub use wasmplane_sdk::gc::exports::wasmplane::dataplane::gc::{Candidate, CandidateKind};

#[cfg(target_family = "wasm")]
mod export {
    use wasmplane_sdk::gc::exports::wasmplane::dataplane::gc::{Candidate, Guest};

    struct DefaultGc;

    impl Guest for DefaultGc {
        fn collect(candidates: Vec<Candidate>) -> Vec<String> {
            match super::Settings::parse(&wasmplane_sdk::settings::raw()) {
                Ok(settings) => super::collect(&candidates, &settings),
                // The host checks them before storing them; should bad ones arrive anyway,
                // deleting nothing is the safe answer.
                Err(e) => {
                    wasmplane_sdk::log::warn(&format!("{e}; nothing is collected"));
                    Vec::new()
                }
            }
        }
    }

    wasmplane_sdk::export_gc!(DefaultGc);
    wasmplane_sdk::export_settings_validator!(super::validate_settings);
}

/// The grace periods and the lock limit in force.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    grace: BTreeMap<Kind, u64>,
    pub lock_hard_limit_seconds: u64,
}

/// A candidate kind as the settings name it (the WIT enum's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Kind {
    StaleNode,
    NodeStatus,
    PolicyStatus,
    ServiceSync,
    Lock,
    ModuleVersion,
}

impl From<CandidateKind> for Kind {
    fn from(kind: CandidateKind) -> Kind {
        match kind {
            CandidateKind::StaleNode => Kind::StaleNode,
            CandidateKind::NodeStatus => Kind::NodeStatus,
            CandidateKind::PolicyStatus => Kind::PolicyStatus,
            CandidateKind::ServiceSync => Kind::ServiceSync,
            CandidateKind::Lock => Kind::Lock,
            CandidateKind::ModuleVersion => Kind::ModuleVersion,
        }
    }
}

/// The document as given.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Document {
    #[serde(default)]
    grace_seconds: BTreeMap<Kind, u64>,
    lock_hard_limit_seconds: Option<u64>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings { grace: BTreeMap::new(), lock_hard_limit_seconds: LOCK_HARD_LIMIT_SECONDS }
    }
}

impl Settings {
    /// The module's settings document; a mistake is an error naming it.
    pub fn parse(document: &str) -> Result<Settings, String> {
        let given: Document = serde_json::from_str(document).map_err(|e| format!("default-gc settings: {e}"))?;
        Ok(Settings {
            grace: given.grace_seconds,
            lock_hard_limit_seconds: given.lock_hard_limit_seconds.unwrap_or(LOCK_HARD_LIMIT_SECONDS),
        })
    }

    /// Grace period, in seconds, after which an entry of `kind` whose owner is gone
    /// is deleted.
    pub fn grace_seconds(&self, kind: CandidateKind) -> u64 {
        self.grace.get(&Kind::from(kind)).copied().unwrap_or_else(|| default_grace_seconds(kind))
    }
}

/// The module's own check of its settings (exported as `settings-validation`).
pub fn validate_settings(document: &str) -> Result<(), String> {
    Settings::parse(document).map(|_| ())
}

/// Grace period, in seconds, after which an entry of `kind` whose owner is gone
/// is deleted, unless the settings say otherwise.
pub fn default_grace_seconds(kind: CandidateKind) -> u64 {
    match kind {
        CandidateKind::StaleNode => 3600,
        CandidateKind::NodeStatus => 300,
        CandidateKind::PolicyStatus => 60,
        CandidateKind::ServiceSync => 60,
        CandidateKind::Lock => 0,
        CandidateKind::ModuleVersion => 24 * 3600,
    }
}

/// A lock older than this is deleted even if its holder seems alive: no duty
/// holds a lock for an hour, so the holder is wedged.
pub const LOCK_HARD_LIMIT_SECONDS: u64 = 3600;

/// Whether one candidate should be deleted.
pub fn should_delete(candidate: &Candidate, settings: &Settings) -> bool {
    if candidate.kind == CandidateKind::Lock && candidate.age_seconds >= settings.lock_hard_limit_seconds {
        return true;
    }
    !candidate.owner_exists && candidate.age_seconds >= settings.grace_seconds(candidate.kind)
}

/// The keys to delete, each once, in the order offered.
pub fn collect(candidates: &[Candidate], settings: &Settings) -> Vec<String> {
    let mut named = BTreeSet::new();
    candidates
        .iter()
        .filter(|c| should_delete(c, settings) && named.insert(c.key.as_str()))
        .map(|c| c.key.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(key: &str, kind: CandidateKind, age_seconds: u64, owner_exists: bool) -> Candidate {
        Candidate { key: key.into(), kind, age_seconds, owner_exists }
    }

    #[test]
    fn owners_that_exist_keep_their_entries() {
        let kinds = [
            CandidateKind::StaleNode,
            CandidateKind::NodeStatus,
            CandidateKind::PolicyStatus,
            CandidateKind::ServiceSync,
            CandidateKind::ModuleVersion,
        ];
        let offered: Vec<Candidate> =
            kinds.iter().enumerate().map(|(i, k)| candidate(&format!("k{i}"), *k, 10 * 24 * 3600, true)).collect();
        assert!(collect(&offered, &Settings::default()).is_empty());
    }

    #[test]
    fn orphans_go_after_their_grace_period() {
        let offered = vec![
            candidate("node-young", CandidateKind::StaleNode, 600, false),
            candidate("node-old", CandidateKind::StaleNode, 3600, false),
            candidate("ns-young", CandidateKind::NodeStatus, 299, false),
            candidate("ns-old", CandidateKind::NodeStatus, 300, false),
            candidate("ps-old", CandidateKind::PolicyStatus, 61, false),
            candidate("svc-young", CandidateKind::ServiceSync, 5, false),
            candidate("svc-old", CandidateKind::ServiceSync, 120, false),
            candidate("mod-young", CandidateKind::ModuleVersion, 3600, false),
            candidate("mod-old", CandidateKind::ModuleVersion, 2 * 24 * 3600, false),
        ];
        assert_eq!(collect(&offered, &Settings::default()), vec!["node-old", "ns-old", "ps-old", "svc-old", "mod-old"]);
    }

    #[test]
    fn locks_go_when_their_holder_is_gone_or_they_are_wedged() {
        let offered = vec![
            candidate("lock-orphan", CandidateKind::Lock, 0, false),
            candidate("lock-held", CandidateKind::Lock, 30, true),
            candidate("lock-wedged", CandidateKind::Lock, LOCK_HARD_LIMIT_SECONDS, true),
        ];
        assert_eq!(collect(&offered, &Settings::default()), vec!["lock-orphan", "lock-wedged"]);
    }

    #[test]
    fn a_key_offered_twice_is_named_once() {
        let offered = vec![
            candidate("k", CandidateKind::PolicyStatus, 100, false),
            candidate("k", CandidateKind::NodeStatus, 1000, false),
        ];
        assert_eq!(collect(&offered, &Settings::default()), vec!["k"]);
    }

    #[test]
    fn settings_change_grace_periods_and_the_lock_limit() {
        let settings = Settings::parse(
            r#"{"graceSeconds": {"node-status": 30, "stale-node": 86400}, "lockHardLimitSeconds": 60}"#,
        )
        .unwrap();
        let offered = vec![
            candidate("ns", CandidateKind::NodeStatus, 31, false),
            candidate("node", CandidateKind::StaleNode, 7200, false),
            candidate("ps", CandidateKind::PolicyStatus, 61, false),
            candidate("lock", CandidateKind::Lock, 60, true),
        ];
        assert_eq!(collect(&offered, &settings), vec!["ns", "ps", "lock"], "a node stays a day, a lock an hour less");
        assert_eq!(Settings::parse("{}").unwrap(), Settings::default());
    }

    #[test]
    fn settings_it_cannot_use_are_refused_naming_them() {
        for (document, named) in [
            (r#"{"graceSeconds": {"node": 30}}"#, "unknown variant `node`"),
            (r#"{"graceSeconds": {"node-status": -1}}"#, "invalid value"),
            (r#"{"grace": {}}"#, "unknown field `grace`"),
            ("7", "invalid type"),
        ] {
            let refused = validate_settings(document).unwrap_err();
            assert!(refused.starts_with("default-gc settings: ") && refused.contains(named), "{document}: {refused}");
        }
    }
}
