//! wasmplane's pure core: typed cluster objects, the cluster state with its indexes, and the
//! node-local model that says what changed for this node. No I/O: sources feed it events,
//! the runtime reads views out of it.

mod labels;
pub mod objects;
pub mod state;
mod strings;
mod vec_map;

/// The model's string type (see `strings`).
pub use compact_str::{CompactString, ToCompactString, format_compact};
pub use objects::*;
pub use state::{ClusterEvent, ClusterObject, ClusterState, NodeLocalModel, ObjectKind, PolicyView, ServiceView};
pub use strings::{IntoModel, ToStd};
pub use vec_map::VecMap;
