//! What a chained daemon told the host: per attachment, the pod and the addresses its ADD
//! reported. DEL and GC take exactly these out of the model again, also when the DEL has no
//! `prevResult` or never comes (the runtime crashed, the node rebooted). Persisted beside the
//! allocator's state (`chained-attachments.json` in the state directory, replaced atomically
//! on every change), so a restarted daemon still knows them.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::durable::DurableFile;
use crate::error::Error;

/// The state file's name in the daemon's state directory.
pub const CHAINED_STATE_FILE: &str = "chained-attachments.json";

/// One attachment a chained ADD reported to the host, keyed by container ID and interface
/// name as the spec keys ADD.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChainedAttachment {
    pub container_id: String,
    pub if_name: String,
    pub pod_namespace: String,
    pub pod_name: String,
    /// As reported (the previous plugin's `ips`, in its order).
    pub ips: Vec<IpAddr>,
    /// When its ADD reported them (seconds since the Unix epoch): GC spares attachments
    /// younger than its grace period.
    pub added_at: u64,
}

impl ChainedAttachment {
    fn key(&self) -> (String, String) {
        (self.container_id.clone(), self.if_name.clone())
    }

    fn same_pod(&self, other: &ChainedAttachment) -> bool {
        self.pod_namespace == other.pod_namespace && self.pod_name == other.pod_name
    }
}

#[derive(Default, Serialize, Deserialize)]
struct StateFile {
    #[serde(default)]
    attachments: Vec<ChainedAttachment>,
}

struct State {
    by_key: BTreeMap<(String, String), ChainedAttachment>,
    /// Bumped on every change; what [`DurableFile::flush_to`] makes durable.
    version: u64,
}

/// The chained attachments. A caller returns only once its change is on disk.
pub struct ChainedAttachments {
    file: DurableFile,
    state: Mutex<State>,
}

impl ChainedAttachments {
    /// Opens (or creates) the state in `state_dir`, recovering the attachments recorded
    /// before.
    pub fn open(state_dir: &Path) -> Result<ChainedAttachments, Error> {
        let (file, contents) = DurableFile::open::<StateFile>(state_dir, CHAINED_STATE_FILE)?;
        let mut by_key = BTreeMap::new();
        for a in contents.attachments {
            if let Some(dup) = by_key.insert(a.key(), a) {
                return Err(Error::CorruptState {
                    path: file.path().into(),
                    reason: format!("container {} interface {} recorded twice", dup.container_id, dup.if_name),
                });
            }
        }
        tracing::info!(path = %file.path().display(), recovered = by_key.len(), "chained attachments opened");
        Ok(ChainedAttachments { file, state: Mutex::new(State { by_key, version: 0 }) })
    }

    pub fn get(&self, container_id: &str, if_name: &str) -> Option<ChainedAttachment> {
        self.lock().by_key.get(&(container_id.to_string(), if_name.to_string())).cloned()
    }

    pub fn all(&self) -> Vec<ChainedAttachment> {
        self.lock().by_key.values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.lock().by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records `a` (replacing an earlier record of its attachment), and drops the records of
    /// the same pod's other attachments: the host keeps one set of addresses per pod, the
    /// last ADD's, so an older sandbox's record no longer describes the model, and its GC
    /// would take out the new sandbox's addresses should they be the same. Returns those
    /// dropped. On a failed write nothing changes.
    pub fn record(&self, a: ChainedAttachment) -> Result<Vec<ChainedAttachment>, Error> {
        let (previous, superseded, version) = {
            let mut state = self.lock();
            let superseded_keys: Vec<_> = state
                .by_key
                .values()
                .filter(|other| other.same_pod(&a) && other.key() != a.key())
                .map(ChainedAttachment::key)
                .collect();
            let superseded: Vec<_> = superseded_keys.iter().filter_map(|k| state.by_key.remove(k)).collect();
            let previous = state.by_key.insert(a.key(), a.clone());
            state.version += 1;
            (previous, superseded, state.version)
        };
        if let Err(e) = self.flush_to(version) {
            // Not recorded: put back what was (should a concurrent flush have written the
            // change, the disk is behind memory until the next write, as with the allocator).
            let mut state = self.lock();
            match previous {
                Some(p) => state.by_key.insert(a.key(), p),
                None => state.by_key.remove(&a.key()),
            };
            for s in superseded {
                state.by_key.entry(s.key()).or_insert(s);
            }
            state.version += 1;
            return Err(e);
        }
        Ok(superseded)
    }

    /// Forgets the attachment; `None` if it had no record. Returns once the state on disk
    /// no longer holds it; flushed even when nothing was removed here, so a DEL retried
    /// after a failed write makes the earlier removal durable.
    pub fn remove(&self, container_id: &str, if_name: &str) -> Result<Option<ChainedAttachment>, Error> {
        let (removed, version) = {
            let mut state = self.lock();
            let removed = state.by_key.remove(&(container_id.to_string(), if_name.to_string()));
            if removed.is_some() {
                state.version += 1;
            }
            (removed, state.version)
        };
        self.flush_to(version)?;
        Ok(removed)
    }

    fn flush_to(&self, version: u64) -> Result<(), Error> {
        self.file.flush_to(version, || {
            let state = self.lock();
            (StateFile { attachments: state.by_key.values().cloned().collect() }, state.version)
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing panics half-way through a change under this lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attachment(container_id: &str, pod: &str, ip: &str) -> ChainedAttachment {
        ChainedAttachment {
            container_id: container_id.into(),
            if_name: "eth0".into(),
            pod_namespace: "ns".into(),
            pod_name: pod.into(),
            ips: vec![ip.parse().unwrap()],
            added_at: 100,
        }
    }

    /// Records survive re-opening the directory; a removal too; the file is the documented
    /// one, beside (not inside) the allocator's.
    #[test]
    fn records_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChainedAttachments::open(dir.path()).unwrap();
        assert!(store.is_empty());
        let (a, b) = (attachment("a", "pa", "10.0.0.2"), attachment("b", "pb", "10.0.0.3"));
        assert_eq!(store.record(a.clone()).unwrap(), []);
        store.record(b.clone()).unwrap();
        assert_eq!(store.remove("b", "eth0").unwrap(), Some(b));
        assert_eq!(store.remove("b", "eth0").unwrap(), None);
        drop(store);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [CHAINED_STATE_FILE]);
        let reopened = ChainedAttachments::open(dir.path()).unwrap();
        assert_eq!(reopened.all(), [a]);
    }

    /// A pod's new sandbox replaces the record of its old one (the host holds the new
    /// addresses); a repeated ADD of one attachment replaces its own record.
    #[test]
    fn a_pods_new_attachment_supersedes_its_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChainedAttachments::open(dir.path()).unwrap();
        let old = attachment("old", "p", "10.0.0.2");
        store.record(old.clone()).unwrap();
        store.record(attachment("other", "q", "10.0.0.4")).unwrap();
        let new = attachment("new", "p", "10.0.0.2");
        assert_eq!(store.record(new.clone()).unwrap(), [old]);
        let mut again = new.clone();
        again.added_at = 200;
        assert_eq!(store.record(again.clone()).unwrap(), []);
        assert_eq!(store.get("new", "eth0"), Some(again));
        assert_eq!(store.len(), 2);
        assert_eq!(store.get("old", "eth0"), None);
    }

    #[test]
    fn corrupt_state_is_an_error_not_a_reset() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(CHAINED_STATE_FILE), b"{not json").unwrap();
        assert!(matches!(ChainedAttachments::open(dir.path()), Err(Error::CorruptState { .. })));
    }
}
