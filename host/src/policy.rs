//! Network-policy controller (issue 6): filled in by the policy work.
