//! Network-policy guest (placeholder, being written).
