//! The node-local model over gRPC, for out-of-process sinks (kpng's "expected node-local
//! state" API): `wasmplane.model.v1.LocalModel/Watch` streams a full snapshot of the model,
//! then one delta per revision, contiguous; a client that reads too slowly gets a fresh
//! snapshot rather than a gap. The protocol is documented in
//! `proto/wasmplane/model/v1/model.proto`.
//!
//! Host side:
//!
//! ```no_run
//! # use std::sync::{Arc, Mutex};
//! # use wasmplane_model::{ClusterState, NodeLocalModel};
//! use wasmplane_grpc::{Delta, ModelFeed, Snapshot};
//! # async fn run(listener: tokio::net::TcpListener) {
//! let model = Arc::new(Mutex::new((ClusterState::new(), NodeLocalModel::new("node-a", vec![]))));
//! let source = model.clone();
//! let feed = ModelFeed::new(Arc::new(move || Snapshot::of(&source.lock().unwrap().1)), 1024);
//! tokio::spawn(wasmplane_grpc::serve(feed.clone(), listener, std::future::pending()));
//! // For every event, under the model lock:
//! # let event: wasmplane_model::ClusterEvent = todo!();
//! let mut guard = model.lock().unwrap();
//! let (cluster, local) = &mut *guard;
//! let touched = cluster.apply(event, "node-a");
//! let update = local.update(cluster, &touched);
//! if !update.is_empty() {
//!     feed.publish(Delta::from_update(local, &update));
//! }
//! # }
//! ```
//!
//! Who may watch is the embedder's call: give [`WatchService::authorize`] an [`Authorize`]
//! hook (it sees each call's peer address and metadata); without one, anyone who reaches the
//! port may.
//!
//! Sink side: [`LocalModelClient`] and [`Mirror`]; `examples/print_sink.rs` is a complete one.

pub mod convert;
pub mod feed;
pub mod mirror;
pub mod server;

/// The generated messages, client and server of `wasmplane.model.v1`.
pub mod proto {
    tonic::include_proto!("wasmplane.model.v1");
}

pub use convert::ConversionError;
pub use feed::{Delta, FeedStats, ModelFeed, NodeFacts, RefusedWatches, Snapshot, SnapshotSource};
pub use mirror::{Applied, Mirror, MirrorError};
pub use proto::local_model_client::LocalModelClient;
pub use proto::local_model_server::LocalModelServer;
pub use server::{Authorize, DEFAULT_SNAPSHOT_PART_BYTES, ServeError, WatchService, serve, serve_incoming, service};
/// The tonic this crate is built on, for embedders that implement [`Authorize`] or serve
/// over their own transport without depending on tonic themselves.
pub use tonic;
