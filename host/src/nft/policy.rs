//! Validation and rendering of network-policy output (issue 6): filled in by the policy work.
