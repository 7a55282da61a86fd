//! Logging through the host's `tracing` (the `log` capability).
//!
//! On a native build (unit tests) messages go to stderr instead, so guest logic that logs
//! can be tested without a host.

use crate::service::wasmplane::dataplane::log as host;

pub use host::Level;

pub fn log(level: Level, message: &str) {
    #[cfg(target_family = "wasm")]
    host::log(level, message);
    #[cfg(not(target_family = "wasm"))]
    eprintln!("[{level:?}] {message}");
}

pub fn debug(message: &str) {
    log(Level::Debug, message)
}
pub fn info(message: &str) {
    log(Level::Info, message)
}
pub fn warn(message: &str) {
    log(Level::Warn, message)
}
