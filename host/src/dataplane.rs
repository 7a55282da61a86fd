//! The service dataplane writer: what is applied per object, and how changes reach the
//! kernel (or, in recording mode, a buffer) as one transaction per sync.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::process::{Command, Stdio};
use std::sync::Arc;

use wasmplane_model::ObjectKey;

use crate::nft::{self, ObjectRules};

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("running nft: {0}")]
    Spawn(std::io::Error),
    #[error("nft rejected the transaction: {0}")]
    Rejected(String),
}

/// Where transactions go.
pub trait Kernel: Send {
    fn apply(&mut self, transaction: &str) -> Result<(), WriteError>;
    /// Chains and sets of our table currently in the kernel (for reconciliation).
    fn list_objects(&mut self) -> Result<(Vec<String>, Vec<String>), WriteError>;
    fn mode(&self) -> &'static str;
}

/// Recording mode: renders what would be applied, for hosts without privileges.
#[derive(Default)]
pub struct Recorder {
    pub transactions: Vec<String>,
}

impl Kernel for Recorder {
    fn apply(&mut self, transaction: &str) -> Result<(), WriteError> {
        // Only the recent past is interesting; keep memory bounded.
        if self.transactions.len() >= 64 {
            self.transactions.remove(0);
        }
        self.transactions.push(transaction.to_string());
        Ok(())
    }
    fn list_objects(&mut self) -> Result<(Vec<String>, Vec<String>), WriteError> {
        Ok((Vec::new(), Vec::new()))
    }
    fn mode(&self) -> &'static str {
        "record"
    }
}

/// Writes through `nft -f -` (see `nft.rs` for why text).
pub struct NftCommand {
    /// The command that runs nft, e.g. `["nft"]` or `["ip", "netns", "exec", "node", "nft"]`.
    pub command: Vec<String>,
}

impl NftCommand {
    fn nft(&self) -> Command {
        let mut cmd = Command::new(&self.command[0]);
        cmd.args(&self.command[1..]);
        cmd
    }
}

impl Kernel for NftCommand {
    fn apply(&mut self, transaction: &str) -> Result<(), WriteError> {
        let mut child = self
            .nft()
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(WriteError::Spawn)?;
        child.stdin.take().expect("piped").write_all(transaction.as_bytes()).map_err(WriteError::Spawn)?;
        let output = child.wait_with_output().map_err(WriteError::Spawn)?;
        if output.status.success() {
            Ok(())
        } else {
            Err(WriteError::Rejected(String::from_utf8_lossy(&output.stderr).chars().take(4096).collect()))
        }
    }

    fn list_objects(&mut self) -> Result<(Vec<String>, Vec<String>), WriteError> {
        let output = self
            .nft()
            .args(["list", "table", nft::FAMILY, nft::TABLE])
            .stderr(Stdio::null())
            .output()
            .map_err(WriteError::Spawn)?;
        if !output.status.success() {
            // No table yet: nothing of ours exists.
            return Ok((Vec::new(), Vec::new()));
        }
        let text = String::from_utf8_lossy(&output.stdout);
        let mut chains = Vec::new();
        let mut sets = Vec::new();
        for line in text.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("chain ") {
                chains.push(rest.trim_end_matches(" {").trim_matches('"').to_string());
            } else if let Some(rest) = line.strip_prefix("set ") {
                sets.push(rest.trim_end_matches(" {").trim_matches('"').to_string());
            }
        }
        Ok((chains, sets))
    }

    fn mode(&self) -> &'static str {
        "nftables"
    }
}

/// What is applied, per object, and the map keys each object owns.
pub struct Dataplane {
    kernel: Box<dyn Kernel>,
    applied: BTreeMap<ObjectKey, Arc<ObjectRules>>,
    element_owner: HashMap<(String, String), ObjectKey>,
    /// False until a full sync succeeded (and after a failed write): the next sync is full.
    in_sync: bool,
    pub last_transaction: String,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    pub full: bool,
    pub objects: usize,
    pub statements: usize,
}

impl Dataplane {
    pub fn new(kernel: Box<dyn Kernel>) -> Self {
        Dataplane { kernel, applied: BTreeMap::new(), element_owner: HashMap::new(), in_sync: false, last_transaction: String::new() }
    }

    pub fn mode(&self) -> &'static str {
        self.kernel.mode()
    }

    pub fn applied(&self) -> &BTreeMap<ObjectKey, Arc<ObjectRules>> {
        &self.applied
    }

    /// Map keys another object already owns are refused (first owner wins) with a warning.
    fn claim_elements(&self, key: &ObjectKey, mut rules: ObjectRules) -> ObjectRules {
        let mut conflicts = Vec::new();
        rules.elements.retain(|k, _| match self.element_owner.get(k) {
            Some(owner) if owner != key => {
                conflicts.push(format!("{} {{ {} }} already belongs to {owner}", k.0, k.1));
                false
            }
            _ => true,
        });
        rules.warnings.extend(conflicts);
        rules
    }

    /// Applies a set of per-object changes (`None`: the object is gone) as one transaction.
    pub fn sync(&mut self, changes: Vec<(ObjectKey, Option<ObjectRules>)>) -> Result<SyncStats, WriteError> {
        let mut next = self.applied.clone();
        for (key, rules) in changes.iter().cloned() {
            match rules {
                Some(r) => {
                    let r = self.claim_elements(&key, r);
                    next.insert(key, Arc::new(r));
                }
                None => {
                    next.remove(&key);
                }
            }
        }
        if !self.in_sync {
            return self.write_full(next);
        }
        let empty = ObjectRules::default();
        let mut transaction = String::new();
        // Objects leaving first, so elements and names they free can be reused by others.
        let mut ordered: Vec<&ObjectKey> = changes.iter().map(|(k, _)| k).collect();
        ordered.sort_by_key(|k| next.contains_key(*k));
        ordered.dedup();
        for key in &ordered {
            let old = self.applied.get(*key).map_or(&empty, |r| r);
            let new = next.get(*key).map_or(&empty, |r| r);
            nft::object_delta(old, new, &mut transaction);
        }
        let statements = transaction.lines().count();
        if statements > 0 {
            if let Err(e) = self.kernel.apply(&transaction) {
                self.in_sync = false;
                return Err(e);
            }
        }
        self.last_transaction = transaction;
        self.commit(next);
        Ok(SyncStats { full: false, objects: ordered.len(), statements })
    }

    /// Rewrites the whole table from what we want (periodic reconcile, first sync, hot swap).
    pub fn full_sync(&mut self, objects: Option<BTreeMap<ObjectKey, ObjectRules>>) -> Result<SyncStats, WriteError> {
        let next = match objects {
            Some(objects) => {
                self.element_owner.clear();
                let mut next = BTreeMap::new();
                for (key, rules) in objects {
                    let rules = Self::claim_pending(&next, rules);
                    next.insert(key, Arc::new(rules));
                }
                next
            }
            None => self.applied.clone(),
        };
        self.write_full(next)
    }

    fn claim_pending(pending: &BTreeMap<ObjectKey, Arc<ObjectRules>>, mut rules: ObjectRules) -> ObjectRules {
        let mut conflicts = Vec::new();
        rules.elements.retain(|k, _| match pending.iter().find(|(_, r)| r.elements.contains_key(k)) {
            Some((owner, _)) => {
                conflicts.push(format!("{} {{ {} }} already belongs to {owner}", k.0, k.1));
                false
            }
            None => true,
        });
        rules.warnings.extend(conflicts);
        rules
    }

    fn write_full(&mut self, next: BTreeMap<ObjectKey, Arc<ObjectRules>>) -> Result<SyncStats, WriteError> {
        let (kernel_chains, kernel_sets) = self.kernel.list_objects()?;
        let stale_chains: Vec<String> = kernel_chains
            .into_iter()
            .filter(|c| !nft::is_static_chain(c) && !next.values().any(|r| r.chains.contains_key(c)))
            .collect();
        let stale_sets: Vec<String> =
            kernel_sets.into_iter().filter(|s| s.starts_with("svc/") && !next.values().any(|r| r.sets.contains_key(s))).collect();
        let transaction = nft::full_transaction(next.values().map(|r| &**r), &stale_chains, &stale_sets);
        self.kernel.apply(&transaction).inspect_err(|_| self.in_sync = false)?;
        let stats = SyncStats { full: true, objects: next.len(), statements: transaction.lines().count() };
        self.last_transaction = transaction;
        self.in_sync = true;
        self.commit(next);
        Ok(stats)
    }

    fn commit(&mut self, next: BTreeMap<ObjectKey, Arc<ObjectRules>>) {
        self.element_owner.clear();
        for (key, rules) in &next {
            for k in rules.elements.keys() {
                self.element_owner.insert(k.clone(), key.clone());
            }
        }
        self.applied = next;
    }

    /// The full table as it is applied now, as an `nft -f` document.
    pub fn render(&self) -> String {
        nft::full_transaction(self.applied.values().map(|r| &**r), &[], &[])
    }
}
