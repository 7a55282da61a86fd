//! Operator duties (placeholder, being written).
