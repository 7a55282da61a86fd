//! End-to-end performance harness (issue 10): filled in by the performance work.
fn main() {}
