//! CNI daemon (placeholder, being written).
