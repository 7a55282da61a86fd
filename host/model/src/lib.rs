//! wasmplane's pure core: typed cluster objects, the cluster state with its indexes, and the
//! node-local model that says what changed for this node. No I/O: sources feed it events,
//! the runtime reads views out of it.

mod labels;
mod strings;
mod vec_map;
pub mod objects;
pub mod state;

/// The model's string type (see `strings`).
pub use compact_str::{CompactString, ToCompactString, format_compact};
pub use strings::{IntoModel, ToStd};
pub use objects::*;
pub use vec_map::VecMap;
pub use state::{ClusterEvent, ClusterObject, ClusterState, NodeLocalModel, ObjectKind, PolicyView, ServiceView};
