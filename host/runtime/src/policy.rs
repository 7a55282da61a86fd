//! Network-policy guest sessions (issue 6): filled in by the policy work.
