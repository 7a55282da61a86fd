//! The guests as Wasm components, built by this crate's build script.
//!
//! - top level: the default guests embedded into the host (`SERVICE_TRANSLATOR`, ...);
//! - [`examples`]: custom guests from `examples/`, built only against the SDK;
//! - `test_programs` (feature `test-programs`): misbehaving guests for the host's tests.

include!(concat!(env!("OUT_DIR"), "/guests.rs"));
