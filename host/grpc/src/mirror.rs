//! A sink's copy of the model, rebuilt from a watch stream.
//!
//! [`Mirror::apply`] implements the client half of the protocol described in the proto:
//! replace everything on a snapshot, apply contiguous deltas, and refuse anything else (a
//! gap, a repeat, a delta in the middle of a snapshot) with a typed error, so a sink never
//! acts on a state the server did not have. On an error the sink should drop the stream and
//! watch again: the next snapshot replaces whatever the mirror holds.

use std::collections::BTreeMap;

use wasmplane_model::state::NodeContext;
use wasmplane_model::{ObjectKey, ServiceView};

use crate::convert::ConversionError;
use crate::feed::NodeFacts;
use crate::proto::{self, watch_response::Event};

/// What one message did to the mirror.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A part of a snapshot that is not complete yet: the mirror still shows the old state.
    SnapshotPart { revision: u64, part: u32 },
    /// A snapshot completed: the mirror is the model at `revision`.
    Snapshot { revision: u64, services: usize },
    /// A delta: the mirror is the model at `revision`.
    Delta { revision: u64, upserts: usize, deletes: usize, context_changed: bool },
}

impl Applied {
    /// The revision the mirror is complete at after this message, if it is.
    pub fn revision(&self) -> Option<u64> {
        match *self {
            Applied::SnapshotPart { .. } => None,
            Applied::Snapshot { revision, .. } | Applied::Delta { revision, .. } => Some(revision),
        }
    }
}

/// A message that breaks the protocol, or does not fit the model's types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MirrorError {
    #[error("watch response without an event")]
    Empty,
    #[error("delta {0} before any snapshot")]
    DeltaBeforeSnapshot(u64),
    #[error("delta {0} in the middle of a snapshot")]
    DeltaDuringSnapshot(u64),
    #[error("delta {got} does not follow revision {have}")]
    Gap { have: u64, got: u64 },
    #[error("snapshot part {got} of revision {revision} out of order: expected part {expected}")]
    PartOutOfOrder { revision: u64, got: u32, expected: u32 },
    #[error("snapshot part {part} of revision {got} continues a snapshot of revision {expected}")]
    PartOfAnotherSnapshot { part: u32, got: u64, expected: u64 },
    #[error(transparent)]
    Conversion(#[from] ConversionError),
}

#[derive(Clone, Debug)]
struct Building {
    revision: u64,
    next_part: u32,
    node: NodeFacts,
    services: BTreeMap<ObjectKey, ServiceView>,
}

/// The model as a sink sees it. Starts empty, without a revision.
#[derive(Clone, Debug, Default)]
pub struct Mirror {
    revision: Option<u64>,
    node: NodeFacts,
    services: BTreeMap<ObjectKey, ServiceView>,
    building: Option<Building>,
}

impl Mirror {
    pub fn new() -> Self {
        Self::default()
    }

    /// The revision of the last complete state; `None` before the first snapshot completes.
    pub fn revision(&self) -> Option<u64> {
        self.revision
    }

    pub fn context(&self) -> &NodeContext {
        &self.node.context
    }

    /// The node is being deleted: load balancers should drain it.
    pub fn node_being_deleted(&self) -> bool {
        self.node.being_deleted
    }

    /// The cluster's service CIDRs: an address in them that is no service's is dropped.
    pub fn service_cidrs(&self) -> &[ipnet::IpNet] {
        &self.node.service_cidrs
    }

    pub fn services(&self) -> &BTreeMap<ObjectKey, ServiceView> {
        &self.services
    }

    /// Applies one message of the stream. On an error the mirror is unchanged.
    pub fn apply(&mut self, response: proto::WatchResponse) -> Result<Applied, MirrorError> {
        match response.event.ok_or(MirrorError::Empty)? {
            Event::Snapshot(part) => self.apply_snapshot_part(part),
            Event::Delta(delta) => self.apply_delta(delta),
        }
    }

    fn apply_snapshot_part(&mut self, part: proto::Snapshot) -> Result<Applied, MirrorError> {
        let services = part
            .services
            .into_iter()
            .map(|v| ServiceView::try_from(v).map(|v| (v.service.key(), v)))
            .collect::<Result<Vec<_>, _>>()?;
        // Part 0 always starts afresh, even over an unfinished snapshot: that is the rule
        // that lets a server restart a snapshot at any time.
        let mut building = if part.part == 0 {
            Building {
                revision: part.revision,
                next_part: 0,
                node: part.context.map(NodeFacts::try_from).transpose()?.unwrap_or_default(),
                services: BTreeMap::new(),
            }
        } else {
            match self.building.take() {
                Some(b) if b.revision != part.revision => {
                    let error = MirrorError::PartOfAnotherSnapshot {
                        part: part.part,
                        got: part.revision,
                        expected: b.revision,
                    };
                    self.building = Some(b);
                    return Err(error);
                }
                Some(b) if b.next_part != part.part => {
                    let error =
                        MirrorError::PartOutOfOrder { revision: part.revision, got: part.part, expected: b.next_part };
                    self.building = Some(b);
                    return Err(error);
                }
                Some(b) => b,
                None => {
                    return Err(MirrorError::PartOutOfOrder { revision: part.revision, got: part.part, expected: 0 });
                }
            }
        };
        building.services.extend(services);
        building.next_part = part.part + 1;
        if part.more {
            self.building = Some(building);
            return Ok(Applied::SnapshotPart { revision: part.revision, part: part.part });
        }
        self.building = None;
        self.revision = Some(building.revision);
        self.node = building.node;
        self.services = building.services;
        Ok(Applied::Snapshot { revision: building.revision, services: self.services.len() })
    }

    fn apply_delta(&mut self, delta: proto::Delta) -> Result<Applied, MirrorError> {
        if self.building.is_some() {
            return Err(MirrorError::DeltaDuringSnapshot(delta.revision));
        }
        let have = self.revision.ok_or(MirrorError::DeltaBeforeSnapshot(delta.revision))?;
        if have.checked_add(1) != Some(delta.revision) {
            return Err(MirrorError::Gap { have, got: delta.revision });
        }
        // Convert everything before touching the state, so a bad delta leaves it intact.
        let upserts = delta
            .upserts
            .into_iter()
            // No kind: one this version does not know, which the protocol says to ignore.
            .filter_map(|object| {
                object.kind.map(|kind| match kind {
                    proto::object::Kind::Service(view) => ServiceView::try_from(view).map(|v| (v.service.key(), v)),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let deletes: Vec<ObjectKey> = delta
            .deletes
            .into_iter()
            .filter_map(|object| {
                object.kind.map(|kind| match kind {
                    proto::object_ref::Kind::Service(key) => key.into(),
                })
            })
            .collect();
        let node = delta.context.map(NodeFacts::try_from).transpose()?;
        let applied = Applied::Delta {
            revision: delta.revision,
            upserts: upserts.len(),
            deletes: deletes.len(),
            context_changed: node.is_some(),
        };
        if let Some(node) = node {
            self.node = node;
        }
        for key in &deletes {
            self.services.remove(key);
        }
        self.services.extend(upserts);
        self.revision = Some(delta.revision);
        Ok(applied)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use wasmplane_model::state::ServiceChange;

    use super::*;
    use crate::convert::tests_support::sample_view;
    use crate::feed::{Delta, Snapshot};
    use crate::server::{delta_to_proto, split_snapshot};

    fn snapshot_messages(revision: u64, views: &[ServiceView], part_bytes: usize) -> Vec<proto::WatchResponse> {
        let snapshot = Snapshot {
            revision,
            node: NodeContext { node_name: "node-a".into(), ..Default::default() }.into(),
            services: views.iter().cloned().map(Arc::new).collect(),
        };
        split_snapshot(&snapshot, part_bytes)
            .into_iter()
            .map(|p| proto::WatchResponse { event: Some(Event::Snapshot(p)) })
            .collect()
    }

    fn delta_message(delta: &Delta) -> proto::WatchResponse {
        proto::WatchResponse { event: Some(Event::Delta(delta_to_proto(delta))) }
    }

    fn named(name: &str) -> ServiceView {
        let mut v = sample_view();
        std::sync::Arc::make_mut(&mut v.service).name = name.into();
        v
    }

    #[test]
    fn snapshots_replace_and_deltas_apply() {
        let mut mirror = Mirror::new();
        let views: Vec<_> = (0..20).map(|i| named(&format!("svc-{i}"))).collect();
        let messages = snapshot_messages(5, &views, 2048);
        assert!(messages.len() > 1);
        for (i, m) in messages.iter().enumerate() {
            let applied = mirror.apply(m.clone()).unwrap();
            if i + 1 < messages.len() {
                assert!(matches!(applied, Applied::SnapshotPart { revision: 5, .. }));
                assert_eq!(mirror.revision(), None, "not complete before the last part");
            } else {
                assert_eq!(applied, Applied::Snapshot { revision: 5, services: 20 });
            }
        }
        assert_eq!(mirror.context().node_name, "node-a");

        let mut changed = named("svc-3");
        std::sync::Arc::make_mut(&mut changed.service).cluster_ips = vec!["10.96.9.9".into()];
        let delta = Delta {
            revision: 6,
            node: Some(NodeFacts {
                context: NodeContext { node_name: "node-a".into(), zone: Some("z".into()), ..Default::default() },
                being_deleted: true,
                service_cidrs: vec!["10.96.0.0/16".parse().unwrap()],
            }),
            changes: vec![
                ServiceChange { key: ObjectKey::new("shop", "svc-3"), view: Some(Arc::new(changed.clone())) },
                ServiceChange { key: ObjectKey::new("shop", "svc-4"), view: None },
            ],
        };
        assert_eq!(
            mirror.apply(delta_message(&delta)).unwrap(),
            Applied::Delta { revision: 6, upserts: 1, deletes: 1, context_changed: true }
        );
        assert_eq!(mirror.services().len(), 19);
        assert_eq!(mirror.services()[&ObjectKey::new("shop", "svc-3")], changed);
        assert_eq!(mirror.context().zone.as_deref(), Some("z"));
        assert!(mirror.node_being_deleted());
        assert_eq!(mirror.service_cidrs(), ["10.96.0.0/16".parse::<ipnet::IpNet>().unwrap()]);

        // A fresh snapshot forgets what it does not name.
        for m in snapshot_messages(9, &views[..2], 1 << 20) {
            mirror.apply(m).unwrap();
        }
        assert_eq!(mirror.revision(), Some(9));
        assert_eq!(mirror.services().len(), 2);
        assert_eq!(mirror.context().zone, None);
        assert!(!mirror.node_being_deleted());
    }

    #[test]
    fn protocol_violations_are_refused_without_changing_state() {
        let mut mirror = Mirror::new();
        let empty = |revision| Delta { revision, node: None, changes: vec![] };
        assert_eq!(mirror.apply(delta_message(&empty(1))), Err(MirrorError::DeltaBeforeSnapshot(1)));
        assert_eq!(mirror.apply(proto::WatchResponse { event: None }), Err(MirrorError::Empty));
        for m in snapshot_messages(3, &[named("a")], 1 << 20) {
            mirror.apply(m).unwrap();
        }
        assert_eq!(mirror.apply(delta_message(&empty(3))), Err(MirrorError::Gap { have: 3, got: 3 }));
        assert_eq!(mirror.apply(delta_message(&empty(5))), Err(MirrorError::Gap { have: 3, got: 5 }));
        assert_eq!(mirror.revision(), Some(3));
        mirror.apply(delta_message(&empty(4))).unwrap();

        let parts = snapshot_messages(8, &(0..10).map(|i| named(&format!("s{i}"))).collect::<Vec<_>>(), 1024);
        mirror.apply(parts[0].clone()).unwrap();
        assert_eq!(mirror.apply(delta_message(&empty(5))), Err(MirrorError::DeltaDuringSnapshot(5)));
        assert_eq!(
            mirror.apply(parts[2].clone()),
            Err(MirrorError::PartOutOfOrder { revision: 8, got: 2, expected: 1 })
        );
        assert_eq!(mirror.revision(), Some(4));
        assert_eq!(mirror.services().len(), 1);

        let mut bad = delta_message(&Delta {
            revision: 5,
            node: None,
            changes: vec![ServiceChange { key: ObjectKey::new("shop", "a"), view: Some(Arc::new(named("a"))) }],
        });
        let Some(Event::Delta(d)) = &mut bad.event else { unreachable!() };
        let Some(proto::object::Kind::Service(v)) = &mut d.upserts[0].kind else { unreachable!() };
        v.service.as_mut().unwrap().ports[0].port = 1 << 20;
        let mut fresh = Mirror::new();
        for m in snapshot_messages(4, &[named("a")], 1 << 20) {
            fresh.apply(m).unwrap();
        }
        assert!(matches!(fresh.apply(bad), Err(MirrorError::Conversion(_))));
        assert_eq!(fresh.revision(), Some(4));
    }

    #[test]
    fn unknown_object_kinds_are_ignored() {
        let mut mirror = Mirror::new();
        for m in snapshot_messages(1, &[], 1 << 20) {
            mirror.apply(m).unwrap();
        }
        let delta = proto::Delta {
            revision: 2,
            context: None,
            upserts: vec![proto::Object { kind: None }],
            deletes: vec![proto::ObjectRef { kind: None }],
        };
        let applied = mirror.apply(proto::WatchResponse { event: Some(Event::Delta(delta)) }).unwrap();
        assert_eq!(applied, Applied::Delta { revision: 2, upserts: 0, deletes: 0, context_changed: false });
    }
}
