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

use std::collections::BTreeSet;

pub use wasmplane_sdk::gc::exports::wasmplane::dataplane::gc::{Candidate, CandidateKind};

#[cfg(target_family = "wasm")]
mod export {
    use wasmplane_sdk::gc::exports::wasmplane::dataplane::gc::{Candidate, Guest};

    struct DefaultGc;

    impl Guest for DefaultGc {
        fn collect(candidates: Vec<Candidate>) -> Vec<String> {
            super::collect(&candidates)
        }
    }

    wasmplane_sdk::export_gc!(DefaultGc);
}

/// Grace period, in seconds, after which an entry of `kind` whose owner is gone
/// is deleted.
pub fn grace_seconds(kind: CandidateKind) -> u64 {
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
pub fn should_delete(candidate: &Candidate) -> bool {
    if candidate.kind == CandidateKind::Lock && candidate.age_seconds >= LOCK_HARD_LIMIT_SECONDS {
        return true;
    }
    !candidate.owner_exists && candidate.age_seconds >= grace_seconds(candidate.kind)
}

/// The keys to delete, each once, in the order offered.
pub fn collect(candidates: &[Candidate]) -> Vec<String> {
    let mut named = BTreeSet::new();
    candidates
        .iter()
        .filter(|c| should_delete(c) && named.insert(c.key.as_str()))
        .map(|c| c.key.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(
        key: &str,
        kind: CandidateKind,
        age_seconds: u64,
        owner_exists: bool,
    ) -> Candidate {
        Candidate {
            key: key.into(),
            kind,
            age_seconds,
            owner_exists,
        }
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
        let offered: Vec<Candidate> = kinds
            .iter()
            .enumerate()
            .map(|(i, k)| candidate(&format!("k{i}"), *k, 10 * 24 * 3600, true))
            .collect();
        assert!(collect(&offered).is_empty());
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
            candidate(
                "mod-old",
                CandidateKind::ModuleVersion,
                2 * 24 * 3600,
                false,
            ),
        ];
        assert_eq!(
            collect(&offered),
            vec!["node-old", "ns-old", "ps-old", "svc-old", "mod-old"]
        );
    }

    #[test]
    fn locks_go_when_their_holder_is_gone_or_they_are_wedged() {
        let offered = vec![
            candidate("lock-orphan", CandidateKind::Lock, 0, false),
            candidate("lock-held", CandidateKind::Lock, 30, true),
            candidate(
                "lock-wedged",
                CandidateKind::Lock,
                LOCK_HARD_LIMIT_SECONDS,
                true,
            ),
        ];
        assert_eq!(collect(&offered), vec!["lock-orphan", "lock-wedged"]);
    }

    #[test]
    fn a_key_offered_twice_is_named_once() {
        let offered = vec![
            candidate("k", CandidateKind::PolicyStatus, 100, false),
            candidate("k", CandidateKind::NodeStatus, 1000, false),
        ];
        assert_eq!(collect(&offered), vec!["k"]);
    }
}
