//! The test API server driven by kube's own, unmodified client: `Api`, `watcher`,
//! `reflector`, discovery. One test binary (kube is slow to link), several modules.

mod common;
mod crud;
mod watch;
mod writes;
