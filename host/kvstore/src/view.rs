//! Per-watch bookkeeping shared by both backends: what the consumer has been told.
//!
//! A watch keeps, for every key under its prefix that the consumer knows about,
//! the modification revision it last delivered, plus the next revision it needs.
//! That is enough to
//! - resume after a disconnect from `next_revision` and drop anything already
//!   delivered (no duplicates), and
//! - survive compaction: relist, then emit exactly the difference between the
//!   listing and this view (no lost update, no spurious event).
//!
//! The view is seeded with the keys that existed just before the watch's start
//! revision, so a key the consumer learned from its own listing and that vanishes
//! during a compacted window still produces a delete.

use std::collections::HashMap;

use crate::{Listing, Revision, WatchEvent};

#[derive(Debug, Default)]
pub(crate) struct WatchView {
    /// The first revision not yet delivered.
    next_revision: Revision,
    /// Key → modification revision, as known to the consumer.
    keys: HashMap<String, Revision>,
}

impl WatchView {
    /// A view for a watch starting at `start` whose consumer knows `keys`
    /// (key and modification revision, as of `start - 1`).
    pub(crate) fn new(start: Revision, keys: impl IntoIterator<Item = (String, Revision)>) -> Self {
        WatchView { next_revision: start, keys: keys.into_iter().collect() }
    }

    pub(crate) fn next_revision(&self) -> Revision {
        self.next_revision
    }

    /// Filters one batch of events (all events of whole revisions, in order) down
    /// to the ones not delivered yet, records them, and advances the resume point.
    pub(crate) fn accept_batch(&mut self, events: Vec<WatchEvent>) -> Vec<WatchEvent> {
        let mut fresh = Vec::with_capacity(events.len());
        let mut last = None;
        for event in events {
            if event.mod_revision < self.next_revision {
                continue;
            }
            match &event.value {
                Some(_) => {
                    self.keys.insert(event.key.clone(), event.mod_revision);
                }
                None => {
                    self.keys.remove(&event.key);
                }
            }
            last = Some(event.mod_revision);
            fresh.push(event);
        }
        if let Some(rev) = last {
            self.next_revision = rev + 1;
        }
        fresh
    }

    /// Moves the resume point forward without events (e.g. a progress
    /// notification): nothing under the prefix changed up to `revision`.
    pub(crate) fn advance_to(&mut self, revision: Revision) {
        self.next_revision = self.next_revision.max(revision + 1);
    }

    /// Replaces the view by `listing` and returns the events that turn what the
    /// consumer knew into it: puts (in modification-revision order) for new or
    /// changed keys, then deletes (at the listing's revision) for vanished keys.
    /// The watch continues from `listing.revision + 1`.
    pub(crate) fn resync(&mut self, listing: Listing) -> Vec<WatchEvent> {
        let mut old = std::mem::take(&mut self.keys);
        let mut events = Vec::new();
        for kv in listing.items {
            let known = old.remove(&kv.key);
            self.keys.insert(kv.key.clone(), kv.mod_revision);
            if known != Some(kv.mod_revision) {
                events.push(WatchEvent { key: kv.key, value: Some(kv.value), mod_revision: kv.mod_revision });
            }
        }
        events.sort_by(|a, b| (a.mod_revision, &a.key).cmp(&(b.mod_revision, &b.key)));
        let mut vanished: Vec<String> = old.into_keys().collect();
        vanished.sort();
        events.extend(vanished.into_iter().map(|key| WatchEvent { key, value: None, mod_revision: listing.revision }));
        self.next_revision = self.next_revision.max(listing.revision + 1);
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Bytes, KeyValue};

    fn put(key: &str, rev: Revision) -> WatchEvent {
        WatchEvent { key: key.into(), value: Some(Bytes::from_static(b"v")), mod_revision: rev }
    }

    fn kv(key: &str, rev: Revision) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: Bytes::from_static(b"v"),
            create_revision: rev,
            mod_revision: rev,
            version: 1,
            lease: None,
        }
    }

    #[test]
    fn drops_replayed_events() {
        let mut view = WatchView::new(5, []);
        assert_eq!(view.accept_batch(vec![put("a", 5), put("b", 5)]).len(), 2);
        assert_eq!(view.next_revision(), 6);
        // A reconnect replaying revision 5 delivers nothing twice.
        assert_eq!(view.accept_batch(vec![put("a", 5), put("b", 5), put("c", 6)]), vec![put("c", 6)]);
        assert_eq!(view.next_revision(), 7);
    }

    #[test]
    fn resync_emits_exact_difference() {
        let mut view = WatchView::new(4, [("keep".into(), 2), ("change".into(), 3), ("gone".into(), 1)]);
        let events = view.resync(Listing { items: vec![kv("change", 9), kv("keep", 2), kv("new", 7)], revision: 10 });
        let summary: Vec<_> = events.iter().map(|e| (e.key.as_str(), e.is_delete(), e.mod_revision)).collect();
        assert_eq!(summary, vec![("new", false, 7), ("change", false, 9), ("gone", true, 10)]);
        assert_eq!(view.next_revision(), 11);
    }
}
