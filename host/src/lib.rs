//! The wasmplane host: sources → node-local model → Wasm guests → validated dataplane.
//!
//! - [`controller`]: runs guests on what changed, keeps the last good output;
//! - [`nft`] / [`dataplane`]: validation of guest output, nftables transactions;
//! - [`registry`]: uploaded modules, versions, status; [`module_store`]: the same in the
//!   kvstore, shared by every host; [`modules`]: module operations across the cluster;
//! - [`api`]: the REST API; [`app`]: wiring; [`cli`]: the command line.

pub mod admission;
pub mod agent;
pub mod api;
pub mod app;
pub mod audit;
pub mod auth;
pub mod cli;
pub mod clustermesh;
pub mod cni;
pub mod conntrack_tuning;
pub mod controller;
pub mod dataplane;
pub mod grpc_auth;
pub mod inspect;
pub mod kube_client;
pub mod kube_proxy_config;
pub mod memory;
pub mod metrics;
pub mod metrics_server;
pub mod module_gc;
pub mod module_objects;
pub mod module_store;
pub mod modules;
pub mod nft;
pub mod oci;
pub mod operator_role;
pub mod policy;
pub mod policy_log;
pub mod record;
pub mod registry;
pub mod replay;
pub mod service_health;
pub mod service_import;
pub mod shadow;
pub mod sync_pacer;
