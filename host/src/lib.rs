//! The wasmplane host: sources → node-local model → Wasm guests → validated dataplane.
//!
//! - [`controller`]: runs guests on what changed, keeps the last good output;
//! - [`nft`] / [`dataplane`]: validation of guest output, nftables transactions;
//! - [`registry`]: uploaded modules, versions, status;
//! - [`api`]: the REST API; [`app`]: wiring; [`cli`]: the command line.

pub mod api;
pub mod app;
pub mod cli;
pub mod controller;
pub mod dataplane;
pub mod metrics;
pub mod nft;
pub mod registry;
