//! The network-policy controller: runs the policy guest on the policies a model update
//! touched, keeps each policy's last good output, and composes the per-pod dispatch chains
//! (the union of every policy selecting a pod address, default deny, or audit) as dataplane
//! objects for the same writer the services use.
//!
//! What a change costs: the model's indexes (`ClusterState`: pod → policies, namespace
//! labels → policies) already narrow a model update to the policies whose view (the policy,
//! its selected local pods, its peer pods) really changed; only those are compiled. A peer
//! pod's label or IP change then reaches the kernel as element deltas of that policy's peer
//! sets (its chains are equal, so `object_delta` leaves them alone), and only the dispatch
//! chains of addresses whose set of policies changed are rewritten.
//!
//! Peers many policies name alike live in *shared sets* (`render::SHARED_SET_PREFIX`, named
//! by the guest from what selects their members): one dataplane object per set, holding the
//! union of what its declaring policies give it, so that the kernel holds one set per
//! distinct selection of peers instead of one per policy rule (it finds sets by name in a
//! list: thousands make loading quadratic).
//!
//! Ordering is the writer's business: one sync's deltas are phased across all its objects
//! (`nft::objects_delta`: every flush before any deletion, every chain declared before any
//! rule), so a policy chain and the dispatch chains that jump to it can come, change or go
//! in one transaction, in any order.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use serde::Serialize;
use wasmplane_model::state::{ModelUpdate, PolicyView};
use wasmplane_model::{
    ClusterState, CompactString, Labels, NetworkPolicy, NodeLocalModel, ObjectKey, Pod, PolicyPortNumber, ToStd,
};
use wasmplane_runtime::policy::{PodLookups, PolicyModule, PolicySession};
use wasmplane_runtime::{CallError, wit};

use crate::nft::policy::{self as render, Direction, DispatchEntry, PolicyRules, VerdictLog};
use crate::nft::{ObjectRules, PodDetection, SetRules};

/// A pod's policy counts (`GET /v1/pods/{ns}/{name}?counters=true`), by direction.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PodPolicyCounts {
    pub ingress: Option<DirectionCounts>,
    pub egress: Option<DirectionCounts>,
}

/// New connections' packets in one direction of a pod: per policy what it accepted (first,
/// in the dispatch chain's order), and what none accepted: dropped, or in audit mode would
/// have been.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DirectionCounts {
    pub policies: Vec<PolicyAccepted>,
    pub dropped: u64,
    pub would_drop: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyAccepted {
    #[serde(serialize_with = "serialize_display")]
    pub policy: ObjectKey,
    pub accepted: u64,
}

fn serialize_display<S: serde::Serializer>(value: &impl std::fmt::Display, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(value)
}

/// Allow logging asked for where the dispatch chains log nowhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("allow logging has nothing to log to: this host logs no policy verdicts (--policy-log-group 0)")]
pub struct NoVerdictLog;

/// Who a logged allowed connection is owed to (see [`PolicyController::allowed_by`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AllowedBy {
    pub policy: Option<ObjectKey>,
    pub direction: Option<Direction>,
    pub pod_address: Option<IpAddr>,
}

/// Why a policy has no fresh rules (its last good ones, if any, stay applied).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
pub enum PolicyError {
    #[error("the policy guest failed: {0}")]
    Guest(String),
    #[error("the policy guest declined the policy: {0}")]
    Declined(String),
    #[error("{0}")]
    Invalid(String),
}

struct Compiled {
    generation: u64,
    rules: PolicyRules,
}

/// One policy as `GET /v1/policies` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicyStatus {
    pub namespace: String,
    pub name: String,
    /// The generation whose rules are enforced (or audited) on this node.
    pub enforced_generation: Option<u64>,
    /// The generation the model has now.
    pub desired_generation: u64,
    pub audit: bool,
    /// The connections it allows are logged (`GET /v1/policies/verdicts?verdict=allow`).
    pub log_allowed: bool,
    /// Selected local pod addresses, per direction.
    pub ingress_targets: usize,
    pub egress_targets: usize,
    pub error: Option<String>,
    pub warnings: Vec<String>,
}

/// What one call changed, for the writer and for metrics.
#[derive(Debug, Default)]
pub struct PolicyChanges {
    /// Per dataplane object: new rules, or `None` when it goes. Order matters (see above).
    pub changes: Vec<(ObjectKey, Option<ObjectRules>)>,
    pub compiled: usize,
    pub failed: usize,
    pub dispatch_changed: usize,
    /// Each guest call (input, call, validation), for the guest call metrics.
    pub guest_calls: Vec<GuestCall>,
}

/// One call of the policy guest: how long, and how it ended (the translator's outcome labels:
/// `ok`, `error` when the guest declined, `crash`, `invalid` output).
#[derive(Debug, Clone)]
pub struct GuestCall {
    pub seconds: f64,
    pub outcome: &'static str,
    /// Why the call failed, for the module's status.
    pub error: Option<String>,
}

/// `error` as a message that names its policy (a guest's own messages do; a trap does not).
fn naming_policy(key: &ObjectKey, error: &PolicyError) -> String {
    let message = error.to_string();
    let name = format!("networkpolicy {key}");
    if message.contains(&name) { message } else { format!("{name}: {message}") }
}

pub struct PolicyController {
    module: String,
    session: PolicySession,
    lookups: Arc<PodLookups>,
    compiled: BTreeMap<ObjectKey, Compiled>,
    errors: BTreeMap<ObjectKey, PolicyError>,
    /// Policies in audit mode; `audit_all`: the whole module is.
    audit: BTreeSet<ObjectKey>,
    audit_all: bool,
    /// Policies whose allowed connections are logged; `log_allowed_all`: every policy's are.
    log_allowed: BTreeSet<ObjectKey>,
    log_allowed_all: bool,
    /// Address and direction → the policies selecting it (from their last good output).
    by_target: BTreeMap<(Direction, IpAddr), BTreeSet<ObjectKey>>,
    /// What each dispatch object is built from now.
    dispatch: BTreeMap<(Direction, IpAddr), Vec<DispatchEntry>>,
    /// Shared set name → the policies declaring it (in their last good output).
    shared_users: BTreeMap<String, BTreeSet<ObjectKey>>,
    /// What each shared set's object holds now.
    shared_sets: BTreeMap<String, SetRules>,
    /// Where the dispatch chains log their drops and audit verdicts (`None`: not logged).
    verdict_log: Option<VerdictLog>,
}

impl PolicyController {
    pub fn new(module: &PolicyModule) -> PolicyController {
        let lookups = PodLookups::new();
        PolicyController {
            module: module.name().to_string(),
            session: module.session(lookups.clone()),
            lookups,
            compiled: BTreeMap::new(),
            errors: BTreeMap::new(),
            audit: BTreeSet::new(),
            audit_all: false,
            log_allowed: BTreeSet::new(),
            log_allowed_all: false,
            by_target: BTreeMap::new(),
            dispatch: BTreeMap::new(),
            shared_users: BTreeMap::new(),
            shared_sets: BTreeMap::new(),
            verdict_log: None,
        }
    }

    /// Dispatch chains that log what they drop, or would drop in audit mode, to `log`'s group.
    pub fn with_verdict_log(mut self, log: Option<VerdictLog>) -> PolicyController {
        self.verdict_log = log;
        self
    }

    pub fn verdict_log(&self) -> Option<VerdictLog> {
        self.verdict_log
    }

    /// The policies whose last good rules select `addr` in `direction`: those a verdict the
    /// pod's dispatch chain logged is owed to.
    pub fn policies_selecting(&self, direction: Direction, addr: IpAddr) -> Vec<ObjectKey> {
        self.by_target.get(&(direction, addr)).map(|keys| keys.iter().cloned().collect()).unwrap_or_default()
    }

    pub fn module(&self) -> &str {
        &self.module
    }

    /// Runs the guest on the policies `update` names (all of them when the node context
    /// changed) and returns the dataplane changes. `detection`: how the dataplane detects pod
    /// traffic now (the guest's `pod-traffic` matches render by it), after the update: a
    /// family that gains or loses its detector moves the context, so every policy is redone.
    pub fn apply(
        &mut self,
        cluster: &ClusterState,
        model: &NodeLocalModel,
        update: &ModelUpdate,
        detection: PodDetection,
    ) -> PolicyChanges {
        let work: Vec<(ObjectKey, Option<Arc<PolicyView>>)> = if update.context_changed {
            let mut keys: BTreeSet<ObjectKey> = model.policies.keys().cloned().collect();
            keys.extend(self.compiled.keys().cloned());
            keys.into_iter().map(|k| (k.clone(), model.policies.get(&k).cloned())).collect()
        } else {
            update.policies.iter().map(|c| (c.key.clone(), c.view.clone())).collect()
        };
        self.run(cluster, model, work, detection)
    }

    /// Compiles every policy of the model again (a new module, a reconcile), `detection` as in
    /// [`PolicyController::apply`].
    pub fn recompile_all(
        &mut self,
        cluster: &ClusterState,
        model: &NodeLocalModel,
        detection: PodDetection,
    ) -> PolicyChanges {
        let mut keys: BTreeSet<ObjectKey> = model.policies.keys().cloned().collect();
        keys.extend(self.compiled.keys().cloned());
        let work = keys.into_iter().map(|k| (k.clone(), model.policies.get(&k).cloned())).collect();
        self.run(cluster, model, work, detection)
    }

    /// Puts one policy in or out of audit mode: only dispatch chains change.
    pub fn set_audit(&mut self, policy: &ObjectKey, audit: bool) -> PolicyChanges {
        let changed = if audit { self.audit.insert(policy.clone()) } else { self.audit.remove(policy) };
        let mut out = PolicyChanges::default();
        if changed {
            let affected: BTreeSet<(Direction, IpAddr)> =
                self.compiled.get(policy).map(|c| c.rules.targets.keys().copied().collect()).unwrap_or_default();
            self.recompose(affected, &mut out);
        }
        out
    }

    /// The whole module in audit mode (every policy's would-be drops counted, none enforced).
    pub fn set_audit_all(&mut self, audit: bool) -> PolicyChanges {
        let mut out = PolicyChanges::default();
        if self.audit_all != audit {
            self.audit_all = audit;
            let all: BTreeSet<(Direction, IpAddr)> = self.by_target.keys().copied().collect();
            self.recompose(all, &mut out);
        }
        out
    }

    pub fn is_audit(&self, policy: &ObjectKey) -> bool {
        self.audit_all || self.audit.contains(policy)
    }

    /// Logs (or stops logging) the connections one policy allows: only its own object is
    /// rewritten (its accepts go to its allow chains, or back). Refused when the dispatch
    /// chains log nowhere (`--policy-log-group 0`): there would be nothing to log to.
    pub fn set_log_allowed(&mut self, policy: &ObjectKey, enabled: bool) -> Result<PolicyChanges, NoVerdictLog> {
        self.verdict_log.ok_or(NoVerdictLog)?;
        let was = self.logs_allowed(policy);
        if enabled {
            self.log_allowed.insert(policy.clone());
        } else {
            self.log_allowed.remove(policy);
        }
        let mut out = PolicyChanges::default();
        if was != self.logs_allowed(policy) {
            self.rewrite_policy_objects([policy], &mut out);
        }
        Ok(out)
    }

    /// Allow logging for every policy on this node; a policy on its own keeps it when this
    /// goes off. Only the objects of policies whose logging changed are rewritten.
    pub fn set_log_allowed_all(&mut self, enabled: bool) -> Result<PolicyChanges, NoVerdictLog> {
        self.verdict_log.ok_or(NoVerdictLog)?;
        let mut out = PolicyChanges::default();
        if self.log_allowed_all != enabled {
            self.log_allowed_all = enabled;
            let changed: Vec<ObjectKey> =
                self.compiled.keys().filter(|k| !self.log_allowed.contains(*k)).cloned().collect();
            self.rewrite_policy_objects(&changed, &mut out);
        }
        Ok(out)
    }

    pub fn logs_allowed(&self, policy: &ObjectKey) -> bool {
        self.log_allowed_all || self.log_allowed.contains(policy)
    }

    /// Where a policy's allowed connections are logged, if they are.
    fn allow_log_of(&self, policy: &ObjectKey) -> Option<VerdictLog> {
        self.verdict_log.filter(|_| self.logs_allowed(policy))
    }

    /// The object written for a policy's rules: as validated, or with its accepts logged.
    fn policy_object(&self, key: &ObjectKey, rules: &PolicyRules) -> ObjectRules {
        match self.allow_log_of(key) {
            Some(log) => render::allow_logged_object(key, rules, log),
            None => rules.rules.clone(),
        }
    }

    fn rewrite_policy_objects<'k>(&self, keys: impl IntoIterator<Item = &'k ObjectKey>, out: &mut PolicyChanges) {
        for key in keys {
            if let Some(compiled) = self.compiled.get(key) {
                out.changes.push((render::policy_object_key(key), Some(self.policy_object(key, &compiled.rules))));
            }
        }
    }

    /// The policies in force here by the id their allow log names them with.
    pub fn log_ids(&self) -> BTreeMap<render::PolicyLogId, ObjectKey> {
        self.compiled.keys().map(|k| (render::PolicyLogId::of(k), k.clone())).collect()
    }

    /// Who an allow event is owed to: the policy (`ids`: [`PolicyController::log_ids`]), the
    /// direction and the pod. A chain the policy's targets of both directions share logs
    /// with no direction: it is ingress when the policy selects the destination here in
    /// ingress, else egress when it selects the source in egress. (A connection between two
    /// local pods such a policy selects both ways is logged by each pass and read as ingress
    /// both times.) `None` in a field the event does not tell (its policy is gone).
    pub fn allowed_by(
        &self,
        ids: &BTreeMap<render::PolicyLogId, ObjectKey>,
        direction: Option<Direction>,
        id: render::PolicyLogId,
        source: IpAddr,
        destination: IpAddr,
    ) -> AllowedBy {
        let policy = ids.get(&id).cloned();
        let selects = |d: Direction, addr: IpAddr| {
            policy.as_ref().is_some_and(|p| self.by_target.get(&(d, addr)).is_some_and(|keys| keys.contains(p)))
        };
        let direction = direction.or_else(|| {
            if selects(Direction::Ingress, destination) {
                Some(Direction::Ingress)
            } else {
                selects(Direction::Egress, source).then_some(Direction::Egress)
            }
        });
        let pod_address = direction.map(|d| if d == Direction::Ingress { destination } else { source });
        AllowedBy { policy, direction, pod_address }
    }

    /// Every dataplane object of the policy side as it should be now (for a full sync).
    pub fn objects(&self) -> Vec<(ObjectKey, ObjectRules)> {
        let mut out: Vec<(ObjectKey, ObjectRules)> = self
            .compiled
            .iter()
            .map(|(k, c)| (render::policy_object_key(k), self.policy_object(k, &c.rules)))
            .collect();
        for ((direction, addr), entries) in &self.dispatch {
            if let Some(rules) = render::dispatch_object(*direction, addr, entries, self.verdict_log) {
                out.push((render::dispatch_object_key(*direction, addr), rules));
            }
        }
        out.extend(
            self.shared_sets
                .iter()
                .map(|(name, set)| (render::shared_set_object_key(name), render::shared_set_object(name, set))),
        );
        out
    }

    /// Which generation of each policy this node enforces (for the per-node realization
    /// status the operator aggregates).
    pub fn realization(&self) -> BTreeMap<ObjectKey, u64> {
        self.compiled.iter().map(|(k, c)| (k.clone(), c.generation)).collect()
    }

    /// Also lists the policies set to audit or allow logging that this node has no rules of
    /// (not created yet, or selecting no pod here): the setting waits for them, and is seen.
    pub fn status(&self, model: &NodeLocalModel) -> Vec<PolicyStatus> {
        let mut keys: BTreeSet<&ObjectKey> = model.policies.keys().collect();
        keys.extend(self.compiled.keys());
        keys.extend(self.errors.keys());
        keys.extend(self.audit.iter().chain(&self.log_allowed));
        keys.into_iter()
            .map(|k| {
                let compiled = self.compiled.get(k);
                let count =
                    |d: Direction| compiled.map_or(0, |c| c.rules.targets.keys().filter(|(dir, _)| *dir == d).count());
                PolicyStatus {
                    namespace: k.namespace.to_std(),
                    name: k.name.to_std(),
                    enforced_generation: compiled.map(|c| c.generation),
                    desired_generation: model.policies.get(k).map_or(0, |v| v.policy.generation),
                    audit: self.is_audit(k),
                    log_allowed: self.logs_allowed(k),
                    ingress_targets: count(Direction::Ingress),
                    egress_targets: count(Direction::Egress),
                    error: self.errors.get(k).map(|e| e.to_string()),
                    warnings: compiled.map(|c| c.rules.rules.warnings.clone()).unwrap_or_default(),
                }
            })
            .collect()
    }

    /// Drops (enforced) and would-be drops (audit) per policy, from the dispatch chains'
    /// counters in a `nft list table` listing. A packet no policy of a pod allowed counts
    /// for every policy selecting that pod.
    pub fn drop_counts(&self, listing: &str) -> BTreeMap<ObjectKey, (u64, u64)> {
        let counters = render::final_rule_counters(listing);
        let mut out: BTreeMap<ObjectKey, (u64, u64)> = BTreeMap::new();
        for ((direction, addr), policies) in &self.by_target {
            let Some((audit, packets)) = counters.get(&render::dispatch_chain(*direction, addr)) else { continue };
            for policy in policies {
                let entry = out.entry(policy.clone()).or_default();
                if *audit { entry.1 += packets } else { entry.0 += packets }
            }
        }
        out
    }

    /// The dispatch chains of a pod's addresses (those some policy selects), to list for
    /// [`PolicyController::pod_counts`].
    pub fn dispatch_chains_of(&self, addresses: &[IpAddr]) -> Vec<String> {
        addresses
            .iter()
            .flat_map(|addr| [Direction::Ingress, Direction::Egress].map(|direction| (direction, *addr)))
            .filter(|target| self.dispatch.contains_key(target))
            .map(|(direction, addr)| render::dispatch_chain(direction, &addr))
            .collect()
    }

    /// A pod's counts per direction from its dispatch chains in `listing` (summed over its
    /// addresses): what each policy accepted, and what was dropped or, in audit mode, would
    /// have been (see [`render::DispatchCounts`]). A direction no policy selects the pod in
    /// is `None`; so is one whose chains the listing lacks or a host before these counters
    /// wrote.
    pub fn pod_counts(&self, listing: &str, addresses: &[IpAddr]) -> PodPolicyCounts {
        let direction_counts = |direction: Direction| {
            let mut out: Option<DirectionCounts> = None;
            for addr in addresses.iter().filter(|addr| self.dispatch.contains_key(&(direction, **addr))) {
                let counts = render::dispatch_counts(listing, &render::dispatch_chain(direction, addr))?;
                let policies = self.by_target.get(&(direction, *addr));
                let total = out.get_or_insert_with(DirectionCounts::default);
                for (chain, accepted) in counts.accepted {
                    // A policy's chains are under its prefix, and nothing but its own.
                    let policy = policies
                        .into_iter()
                        .flatten()
                        .find(|key| chain.starts_with(&format!("{}/", render::policy_prefix(key))));
                    let Some(policy) = policy else { continue };
                    match total.policies.iter_mut().find(|p| &p.policy == policy) {
                        Some(p) => p.accepted += accepted,
                        None => total.policies.push(PolicyAccepted { policy: policy.clone(), accepted }),
                    }
                }
                if counts.audit {
                    total.would_drop += counts.final_packets
                } else {
                    total.dropped += counts.final_packets
                }
            }
            out
        };
        PodPolicyCounts { ingress: direction_counts(Direction::Ingress), egress: direction_counts(Direction::Egress) }
    }

    fn run(
        &mut self,
        cluster: &ClusterState,
        model: &NodeLocalModel,
        work: Vec<(ObjectKey, Option<Arc<PolicyView>>)>,
        detection: PodDetection,
    ) -> PolicyChanges {
        let mut out = PolicyChanges::default();
        if work.is_empty() {
            return out;
        }
        let namespaces: Arc<BTreeMap<CompactString, Labels>> =
            Arc::new(cluster.namespaces.iter().map(|(name, ns)| (name.clone(), ns.labels.clone())).collect());
        let mut affected: BTreeSet<(Direction, IpAddr)> = BTreeSet::new();
        let mut affected_sets: BTreeSet<String> = BTreeSet::new();
        let mut removed: Vec<ObjectKey> = Vec::new();
        for (key, view) in work {
            let old_targets: BTreeSet<(Direction, IpAddr)> =
                self.compiled.get(&key).map(|c| c.rules.targets.keys().copied().collect()).unwrap_or_default();
            let old_shared: BTreeSet<String> =
                self.compiled.get(&key).map(|c| c.rules.shared.keys().cloned().collect()).unwrap_or_default();
            // Whatever happens to the policy (compiled, failed, withdrawn), what it gives
            // its shared sets may change.
            affected_sets.extend(old_shared.iter().cloned());
            let Some(view) = view else {
                // The policy selects no pod here any more (or is gone): its rules go.
                self.errors.remove(&key);
                if self.compiled.remove(&key).is_some() {
                    tracing::debug!(policy = %key, "network policy withdrawn from this node");
                    remove_user(&mut self.by_target, &old_targets, &key);
                    remove_user(&mut self.shared_users, &old_shared, &key);
                    affected.extend(old_targets);
                    removed.push(key);
                }
                continue;
            };
            let started = std::time::Instant::now();
            let compiled = self.compile(cluster, model, &key, &view, namespaces.clone(), detection);
            let outcome = match &compiled {
                Ok(_) => "ok",
                Err(PolicyError::Declined(_)) => "error",
                Err(PolicyError::Guest(_)) => "crash",
                Err(PolicyError::Invalid(_)) => "invalid",
            };
            out.guest_calls.push(GuestCall {
                seconds: started.elapsed().as_secs_f64(),
                outcome,
                error: compiled.as_ref().err().map(|e| naming_policy(&key, e)),
            });
            match compiled.and_then(|rules| self.check_shared(&key, rules)) {
                Ok(rules) => {
                    out.compiled += 1;
                    self.errors.remove(&key);
                    let new_targets: BTreeSet<(Direction, IpAddr)> = rules.targets.keys().copied().collect();
                    // With allow logging the object also depends on the targets (which chain
                    // logs which direction): the same rules and targets render the same
                    // object, else the written objects are compared (the new one rendered once).
                    let old = self.compiled.get(&key);
                    let changed = match self.allow_log_of(&key) {
                        Some(log) => {
                            let same_inputs =
                                old.is_some_and(|c| c.rules.rules == rules.rules && c.rules.targets == rules.targets);
                            (!same_inputs).then(|| render::allow_logged_object(&key, &rules, log)).filter(|object| {
                                old.is_none_or(|c| render::allow_logged_object(&key, &c.rules, log) != *object)
                            })
                        }
                        None => (!old.is_some_and(|c| c.rules.rules == rules.rules)).then(|| rules.rules.clone()),
                    };
                    if let Some(object) = changed {
                        out.changes.push((render::policy_object_key(&key), Some(object)));
                    }
                    remove_user(&mut self.shared_users, &old_shared, &key);
                    for name in rules.shared.keys() {
                        self.shared_users.entry(name.clone()).or_default().insert(key.clone());
                        affected_sets.insert(name.clone());
                    }
                    remove_user(&mut self.by_target, &old_targets, &key);
                    for t in &new_targets {
                        self.by_target.entry(*t).or_default().insert(key.clone());
                    }
                    affected.extend(old_targets.symmetric_difference(&new_targets).copied());
                    // A target whose chain name changed needs its dispatch rewritten too.
                    if let Some(old) = self.compiled.get(&key) {
                        affected.extend(
                            new_targets.iter().filter(|t| old.rules.targets.get(t) != rules.targets.get(t)).copied(),
                        );
                    }
                    self.compiled.insert(key.clone(), Compiled { generation: view.policy.generation, rules });
                }
                Err(e) => {
                    // The last good rules (if any) stay; the error is visible in status.
                    // (Their shared sets' elements are recomposed: see `recompose_shared`.)
                    out.failed += 1;
                    tracing::warn!(policy = %key, module = %self.module, "network policy not compiled, last good rules stay: {e}");
                    self.errors.insert(key.clone(), e);
                }
            }
        }
        self.recompose(affected, &mut out);
        self.recompose_shared(affected_sets, &mut out);
        for key in removed {
            out.changes.push((render::policy_object_key(&key), None));
        }
        out
    }

    /// Refuses output declaring a shared set otherwise than the policies already using it
    /// (one set in the kernel has one type).
    fn check_shared(&self, key: &ObjectKey, rules: PolicyRules) -> Result<PolicyRules, PolicyError> {
        for (name, set) in &rules.shared {
            let other = self.shared_users.get(name).into_iter().flatten().find(|k| *k != key);
            if let Some(other) = other
                && let Some(theirs) = self.compiled.get(other).and_then(|c| c.rules.shared.get(name))
                && theirs.declaration != set.declaration
            {
                return Err(PolicyError::Invalid(format!(
                    "shared set {name:?} is declared as {:?}, but as {:?} by networkpolicy {other}",
                    set.declaration, theirs.declaration
                )));
            }
        }
        Ok(rules)
    }

    /// Rebuilds the objects of `affected` shared sets whose elements changed: the union of
    /// what their declarers give them. A policy whose last compile failed keeps its last
    /// good rules, but its elements (perhaps stale) count only when no declarer is fresh:
    /// a failure in one policy must not widen what another allows.
    fn recompose_shared(&mut self, affected: BTreeSet<String>, out: &mut PolicyChanges) {
        for name in affected {
            let users: Vec<&ObjectKey> = self.shared_users.get(&name).into_iter().flatten().collect();
            let fresh: Vec<&ObjectKey> = users.iter().copied().filter(|k| !self.errors.contains_key(*k)).collect();
            let declarers = if fresh.is_empty() { users } else { fresh };
            let mut union: Option<SetRules> = None;
            for set in declarers.into_iter().filter_map(|k| self.compiled.get(k)?.rules.shared.get(&name)) {
                match &mut union {
                    Some(u) => u.elements.extend(set.elements.iter().cloned()),
                    None => union = Some(set.clone()),
                }
            }
            if self.shared_sets.get(&name) == union.as_ref() {
                continue;
            }
            let key = render::shared_set_object_key(&name);
            match union {
                Some(set) => {
                    out.changes.push((key, Some(render::shared_set_object(&name, &set))));
                    self.shared_sets.insert(name, set);
                }
                None => {
                    out.changes.push((key, None));
                    self.shared_sets.remove(&name);
                }
            }
        }
    }

    /// Rebuilds the dispatch objects of `affected` addresses whose entries changed.
    fn recompose(&mut self, affected: BTreeSet<(Direction, IpAddr)>, out: &mut PolicyChanges) {
        for target @ (direction, addr) in affected {
            let mut entries: Vec<DispatchEntry> = self
                .by_target
                .get(&target)
                .into_iter()
                .flatten()
                .filter_map(|k| {
                    let chain = self.compiled.get(k)?.rules.targets.get(&target)?.clone();
                    Some(DispatchEntry { chain, audit: self.is_audit(k) })
                })
                .collect();
            entries.sort();
            if self.dispatch.get(&target).map_or(entries.is_empty(), |old| *old == entries) {
                continue;
            }
            out.dispatch_changed += 1;
            let rules = render::dispatch_object(direction, &addr, &entries, self.verdict_log);
            if entries.is_empty() {
                self.dispatch.remove(&target);
            } else {
                self.dispatch.insert(target, entries);
            }
            out.changes.push((render::dispatch_object_key(direction, &addr), rules));
        }
    }

    fn compile(
        &mut self,
        cluster: &ClusterState,
        model: &NodeLocalModel,
        key: &ObjectKey,
        view: &PolicyView,
        namespaces: Arc<BTreeMap<CompactString, Labels>>,
        detection: PodDetection,
    ) -> Result<PolicyRules, PolicyError> {
        // The guest sees the pods the view says matter, and every pod only when a named
        // egress port with no peers must be resolved on any destination.
        let mut pods: Vec<Arc<Pod>> = view.peer_pods.iter().chain(view.local_pods.iter()).cloned().collect();
        if resolves_on_every_pod(&view.policy) {
            pods = cluster.pods.values().cloned().collect();
        }
        self.lookups.replace(pods, namespaces);
        let prefix = render::policy_prefix(key);
        let result = self.session.compile(&model.context, &prefix, view);
        let out: wit::Ruleset = result.map_err(|e| match e {
            CallError::Guest(m) => PolicyError::Declined(m),
            other => PolicyError::Guest(other.to_string()),
        })?;
        let local: BTreeSet<IpAddr> =
            view.local_pods.iter().flat_map(|p| p.ips.iter()).filter_map(|ip| ip.parse().ok()).collect();
        render::validate_policy_output(key, &out, &local, detection).map_err(|e| PolicyError::Invalid(e.to_string()))
    }
}

/// Takes `user` off the users of each of `keys` (a target address, a shared set), and the
/// keys left with none off `users`.
fn remove_user<K: Ord>(users: &mut BTreeMap<K, BTreeSet<ObjectKey>>, keys: &BTreeSet<K>, user: &ObjectKey) {
    for k in keys {
        if let Some(set) = users.get_mut(k) {
            set.remove(user);
            if set.is_empty() {
                users.remove(k);
            }
        }
    }
}

/// Whether a policy has an egress rule with a named port and no peers (any destination).
fn resolves_on_every_pod(policy: &NetworkPolicy) -> bool {
    policy
        .egress
        .iter()
        .flatten()
        .any(|r| r.peers.is_empty() && r.ports.iter().any(|p| matches!(p.port, PolicyPortNumber::Name(_))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmplane_model::state::{ClusterEvent, ClusterObject};
    use wasmplane_model::{LabelSelector, Namespace, PolicyPeer, PolicyPort, PolicyRule, Protocol};
    use wasmplane_runtime::{Limits, Runtime};

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|&(k, v)| (k.into(), v.into())).collect()
    }

    fn sel(pairs: &[(&str, &str)]) -> LabelSelector {
        LabelSelector { match_labels: labels(pairs), match_expressions: vec![] }
    }

    fn pod(ns: &str, name: &str, ip: &str, app: &str) -> ClusterObject {
        ClusterObject::Pod(Pod {
            namespace: ns.into(),
            name: name.into(),
            ips: vec![ip.into()],
            node_name: Some("node-a".into()),
            labels: labels(&[("app", app)]),
            ports: vec![],
            host_network: false,
        })
    }

    /// `name` in `a`: pods `app=<target>` accept TCP 80 from `app=client` pods.
    fn policy(name: &str, target: &str, generation: u64) -> ClusterObject {
        ClusterObject::NetworkPolicy(NetworkPolicy {
            namespace: "a".into(),
            name: name.into(),
            uid: Default::default(),
            generation,
            pod_selector: sel(&[("app", target)]),
            ingress: Some(vec![PolicyRule {
                ports: vec![PolicyPort { protocol: Protocol::Tcp, port: PolicyPortNumber::Number(80), end_port: None }],
                peers: vec![PolicyPeer {
                    pod_selector: Some(sel(&[("app", "client")])),
                    namespace_selector: None,
                    ip_block: None,
                }],
            }]),
            egress: None,
        })
    }

    struct World {
        cluster: ClusterState,
        model: NodeLocalModel,
        controller: PolicyController,
        _runtime: Runtime,
    }

    impl World {
        fn new() -> World {
            let runtime = Runtime::new(Limits::default(), None).unwrap();
            let module = runtime
                .load_policy("default-network-policy", wasmplane_guest_artifacts::NETWORK_POLICY, 8 << 20)
                .unwrap();
            let mut w = World {
                cluster: ClusterState::new(),
                model: NodeLocalModel::new("node-a", vec!["10.244.0.0/16".into()]),
                controller: PolicyController::new(&module),
                _runtime: runtime,
            };
            w.apply(ClusterObject::Namespace(Namespace { name: "a".into(), labels: labels(&[("team", "blue")]) }));
            w.apply(pod("a", "web-0", "10.244.1.10", "web"));
            w.apply(pod("a", "client-0", "10.244.1.12", "client"));
            w
        }

        fn apply(&mut self, object: ClusterObject) -> PolicyChanges {
            let touched = self.cluster.apply(ClusterEvent::Upsert(object), "node-a");
            let update = self.model.update(&self.cluster, &touched);
            self.controller.apply(&self.cluster, &self.model, &update, Self::pods())
        }

        /// Pods detected by source address, in the model's one cluster CIDR's family.
        fn pods() -> PodDetection<'static> {
            static BY_SOURCE: crate::nft::PodTraffic = crate::nft::PodTraffic::SourceAddress;
            PodDetection::new(&BY_SOURCE, &["10.244.0.0/16".parse().unwrap()])
        }

        fn delete_policy(&mut self, name: &str) -> PolicyChanges {
            let touched = self.cluster.apply(
                ClusterEvent::Delete(wasmplane_model::state::ObjectKind::NetworkPolicy, ObjectKey::new("a", name)),
                "node-a",
            );
            let update = self.model.update(&self.cluster, &touched);
            self.controller.apply(&self.cluster, &self.model, &update, Self::pods())
        }
    }

    /// Each change's object (shared sets as `shared set`) and whether it has chains.
    fn keys(c: &PolicyChanges) -> Vec<(String, bool)> {
        let name =
            |k: &ObjectKey| if k.namespace == "networkpolicy-set:" { "shared set".to_string() } else { k.to_string() };
        c.changes.iter().map(|(k, r)| (name(k), r.as_ref().is_some_and(|r| !r.chains.is_empty()))).collect()
    }

    #[test]
    fn a_policy_compiles_into_its_object_and_a_dispatch_chain() {
        let mut w = World::new();
        let c = w.apply(policy("p", "web", 1));
        assert_eq!(c.compiled, 1);
        assert_eq!(
            keys(&c),
            vec![
                ("networkpolicy:a/p".to_string(), true),
                ("networkpolicy-dispatch:/10.244.1.10/ingress".to_string(), true),
                ("shared set".to_string(), false)
            ],
            "the policy before the dispatch chain jumping to it; its peers in a shared set"
        );
        let dispatch = c.changes[1].1.as_ref().unwrap();
        assert_eq!(
            dispatch.chains["polpod/10.244.1.10/ingress"],
            vec!["counter jump pol/a/p/ingress", "counter drop comment \"deny\""]
        );
        assert_eq!(w.controller.realization(), BTreeMap::from([(ObjectKey::new("a", "p"), 1)]));
    }

    #[test]
    fn a_peer_label_change_recompiles_one_policy_and_changes_set_elements_only() {
        let mut w = World::new();
        w.apply(policy("p", "web", 1));
        w.apply(policy("other", "db", 1));
        let before = w.controller.objects();
        // A second client appears: a peer of p; `other` selects no pod here (no db), so it
        // is not in the model and does not run.
        let c = w.apply(pod("a", "client-1", "10.244.1.13", "client"));
        assert_eq!(c.compiled, 1, "only the policy whose peers changed runs");
        assert_eq!(c.dispatch_changed, 0);
        // The policy's own object is unchanged: its peers are in a shared set's object.
        assert_eq!(c.changes.len(), 1, "{:?}", c.changes);
        let (key, Some(rules)) = &c.changes[0] else { panic!("{:?}", c.changes) };
        assert!(key.to_string().starts_with("networkpolicy-set:/pol/_shared/peers/"), "{key}");
        let old = &before.iter().find(|(k, _)| k == key).unwrap().1;
        assert!(rules.chains.is_empty() && old.sets.keys().eq(rules.sets.keys()), "the same set, no chain");
        let set = rules.sets.values().next().unwrap();
        assert_eq!(set.elements, BTreeSet::from(["10.244.1.12".to_string(), "10.244.1.13".to_string()]));
        // An unrelated pod: nothing runs.
        let c = w.apply(pod("a", "batch-0", "10.244.1.20", "batch"));
        assert_eq!((c.compiled, c.changes.len()), (0, 0));
    }

    /// Feeds changes to a recording writer; the transaction it rendered.
    fn written(writer: &mut crate::dataplane::Dataplane, c: &PolicyChanges) -> String {
        writer.sync(c.changes.clone()).unwrap();
        writer.last_transaction.clone()
    }

    /// Line number of `statement` in `transaction` (panics if absent).
    fn line_of(transaction: &str, statement: &str) -> usize {
        transaction
            .lines()
            .position(|l| l == statement)
            .unwrap_or_else(|| panic!("{statement:?} not in\n{transaction}"))
    }

    #[test]
    fn policies_on_one_pod_combine_and_a_removed_one_goes_in_the_same_transaction() {
        let mut w = World::new();
        let mut writer = crate::dataplane::Dataplane::new(Box::new(crate::dataplane::Recorder::default()));
        written(&mut writer, &w.apply(policy("p", "web", 1)));
        let c = w.apply(policy("q", "web", 1));
        written(&mut writer, &c);
        let dispatch =
            c.changes.iter().find_map(|(k, r)| k.namespace.starts_with("networkpolicy-dispatch").then_some(r)).unwrap();
        assert_eq!(
            dispatch.as_ref().unwrap().chains["polpod/10.244.1.10/ingress"],
            vec!["counter jump pol/a/p/ingress", "counter jump pol/a/q/ingress", "counter drop comment \"deny\""]
        );
        let c = w.delete_policy("q");
        assert_eq!(
            keys(&c),
            vec![
                ("networkpolicy-dispatch:/10.244.1.10/ingress".to_string(), true),
                ("networkpolicy:a/q".to_string(), false)
            ]
        );
        assert!(c.changes[1].1.is_none(), "the policy goes at once");
        // One transaction: the dispatch chain stops jumping to q before q's chain goes.
        let t = written(&mut writer, &c);
        assert!(
            line_of(&t, "flush chain inet wasmplane polpod/10.244.1.10/ingress")
                < line_of(&t, "delete chain inet wasmplane pol/a/q/ingress"),
            "{t}"
        );
        assert!(
            line_of(&t, "delete chain inet wasmplane pol/a/q/ingress")
                < line_of(&t, "add rule inet wasmplane polpod/10.244.1.10/ingress counter jump pol/a/p/ingress")
        );
        // Nothing is left to clean up on the next call.
        assert!(w.apply(pod("a", "batch-0", "10.244.1.20", "batch")).changes.is_empty());
        // The last policy going: the dispatch object goes too (the pod is open again).
        let c = w.delete_policy("p");
        assert_eq!(
            keys(&c),
            vec![
                ("networkpolicy-dispatch:/10.244.1.10/ingress".to_string(), false),
                ("shared set".to_string(), false),
                ("networkpolicy:a/p".to_string(), false)
            ]
        );
        assert!(c.changes.iter().all(|(_, r)| r.is_none()));
    }

    #[test]
    fn a_dropped_chain_goes_in_the_same_transaction_as_the_dispatch_change() {
        let mut w = World::new();
        let mut writer = crate::dataplane::Dataplane::new(Box::new(crate::dataplane::Recorder::default()));
        written(&mut writer, &w.apply(policy("p", "web", 1)));
        // policyTypes Ingress → Egress: the ingress chain goes, the pod's ingress dispatch too.
        let ClusterObject::NetworkPolicy(mut egress) = policy("p", "web", 2) else { unreachable!() };
        egress.egress = egress.ingress.take();
        egress.egress.as_mut().unwrap()[0].peers.clear();
        let c = w.apply(ClusterObject::NetworkPolicy(egress));
        let object = c.changes.iter().find(|(k, _)| k.to_string() == "networkpolicy:a/p").unwrap().1.as_ref().unwrap();
        assert!(!object.chains.contains_key("pol/a/p/ingress"), "{:?}", object.chains.keys());
        assert!(object.chains.contains_key("pol/a/p/egress"));
        let t = written(&mut writer, &c);
        assert!(
            line_of(&t, "flush chain inet wasmplane polpod/10.244.1.10/ingress")
                < line_of(&t, "delete chain inet wasmplane pol/a/p/ingress"),
            "{t}"
        );
        assert!(w.controller.objects().iter().all(|(_, r)| !r.chains.contains_key("pol/a/p/ingress")));
    }

    #[test]
    fn audit_mode_changes_dispatch_only_and_counts_would_be_drops() {
        let mut w = World::new();
        w.apply(policy("p", "web", 1));
        let c = w.controller.set_audit(&ObjectKey::new("a", "p"), true);
        assert_eq!(c.changes.len(), 1);
        let chain = &c.changes[0].1.as_ref().unwrap().chains["polpod/10.244.1.10/ingress"];
        assert!(chain.last().unwrap().ends_with("accept comment \"audit\""), "{chain:?}");
        let listing = "chain polpod/10.244.1.10/ingress {\n jump pol/a/p/ingress\n counter packets 4 bytes 240 log prefix \"x\" accept comment \"audit\"\n}\n";
        assert_eq!(w.controller.drop_counts(listing), BTreeMap::from([(ObjectKey::new("a", "p"), (0, 4))]));
        let status = w.controller.status(&w.model);
        assert!(status[0].audit && status[0].enforced_generation == Some(1) && status[0].ingress_targets == 1);
        assert!(
            w.controller.set_audit(&ObjectKey::new("a", "p"), true).changes.is_empty(),
            "no change, nothing written"
        );
    }

    /// Audit mode set for a policy before it exists writes nothing, is listed, and the
    /// policy starts audited: no moment enforced.
    #[test]
    fn audit_mode_set_before_the_policy_exists_is_listed_and_holds_from_its_first_rules() {
        let mut w = World::new();
        let later = ObjectKey::new("a", "later");
        assert!(w.controller.set_audit(&later, true).changes.is_empty(), "nothing of it to rewrite");
        let status = w.controller.status(&w.model);
        assert_eq!(status.len(), 1, "{status:?}");
        assert!(status[0].name == "later" && status[0].audit && !status[0].log_allowed);
        assert_eq!(
            (status[0].enforced_generation, status[0].desired_generation, status[0].ingress_targets),
            (None, 0, 0)
        );

        let c = w.apply(policy("later", "web", 1));
        let dispatch = c.changes.iter().find_map(|(_, rules)| rules.as_ref()?.chains.get("polpod/10.244.1.10/ingress"));
        assert!(dispatch.unwrap().last().unwrap().ends_with("accept comment \"audit\""), "{:?}", c.changes);
        // Gone again: the setting stays listed until switched off.
        w.delete_policy("later");
        assert!(w.controller.status(&w.model)[0].audit);
        w.controller.set_audit(&later, false);
        assert!(w.controller.status(&w.model).is_empty());
    }

    /// Allow logging rewrites only that policy's object (its accepts go to its allow chain),
    /// and off again gives back the object exactly as validated; refused with no verdict log.
    #[test]
    fn allow_logging_rewrites_only_the_policys_object_and_back() {
        let mut w = World::new();
        let (p, q) = (ObjectKey::new("a", "p"), ObjectKey::new("a", "q"));
        assert_eq!(w.controller.set_log_allowed(&p, true).unwrap_err(), NoVerdictLog);
        assert_eq!(w.controller.set_log_allowed_all(true).unwrap_err(), NoVerdictLog);
        w.controller.verdict_log = Some(VerdictLog { group: 7, per_second: 5, burst: 9 });
        w.apply(policy("p", "web", 1));
        w.apply(policy("q", "web", 1));
        let before = w.controller.objects();
        let original =
            |key: &ObjectKey| before.iter().find(|(k, _)| *k == render::policy_object_key(key)).unwrap().1.clone();
        let on = w.controller.set_log_allowed(&p, true).unwrap();
        assert_eq!(on.changes.len(), 1, "{:?}", on.changes.iter().map(|c| &c.0).collect::<Vec<_>>());
        assert_eq!(on.changes[0].0, render::policy_object_key(&p));
        let logged = on.changes[0].1.clone().unwrap();
        let allow = render::allow_chain(render::PolicyLogId::of(&p), Some(Direction::Ingress));
        assert!(logged.chains.contains_key(&allow), "{:?}", logged.chains.keys());
        assert!(logged.chains["pol/a/p/ingress"].iter().any(|r| r.contains(&format!("goto {allow}"))), "{logged:?}");
        assert!(w.controller.logs_allowed(&p) && !w.controller.logs_allowed(&q));
        assert!(w.controller.set_log_allowed(&p, true).unwrap().changes.is_empty(), "no change, nothing written");
        assert!(w.controller.status(&w.model).iter().any(|s| s.name == "p" && s.log_allowed));
        // Recompiled while logged: the same rules and targets write nothing; another pod
        // selected (new targets, its chain still ingress only) renders the same object, so
        // only the dispatch objects change.
        let object_of = |changes: &PolicyChanges| {
            changes.changes.iter().find(|(k, _)| *k == render::policy_object_key(&p)).map(|(_, o)| o.clone())
        };
        assert_eq!(object_of(&w.apply(policy("p", "web", 2))), None, "the same object is not written again");
        let moved = w.apply(policy("p", "client", 3));
        assert_eq!(
            object_of(&moved),
            None,
            "the same object, other targets: {:?}",
            moved.changes.iter().map(|c| &c.0).collect::<Vec<_>>()
        );
        assert!(
            moved.changes.iter().any(|(k, _)| k.name.contains("10.244.1.12")),
            "client's dispatch written: {:?}",
            moved.changes.iter().map(|c| &c.0).collect::<Vec<_>>()
        );
        w.apply(policy("p", "web", 4));

        // Who an allow event is owed to: ingress at web (the policy's chain is ingress only;
        // a chain shared by both directions is read as ingress where it selects the destination).
        let (client, web): (IpAddr, IpAddr) = ("10.244.1.12".parse().unwrap(), "10.244.1.10".parse().unwrap());
        let ids = w.controller.log_ids();
        let id = render::PolicyLogId::of(&p);
        let by = w.controller.allowed_by(&ids, None, id, client, web);
        assert_eq!(
            by,
            AllowedBy { policy: Some(p.clone()), direction: Some(Direction::Ingress), pod_address: Some(web) }
        );
        assert_eq!(
            w.controller.allowed_by(&ids, None, id, web, client).direction,
            None,
            "it selects neither way round"
        );
        assert_eq!(
            w.controller.allowed_by(&ids, Some(Direction::Egress), id, web, client).pod_address,
            Some(web),
            "a direction given is taken"
        );
        assert_eq!(
            w.controller.allowed_by(&ids, None, render::PolicyLogId(1), client, web).policy,
            None,
            "a policy gone"
        );

        let off = w.controller.set_log_allowed(&p, false).unwrap();
        assert_eq!(off.changes, vec![(render::policy_object_key(&p), Some(original(&p)))], "back as validated");
        let all = w.controller.set_log_allowed_all(true).unwrap();
        assert_eq!(all.changes.len(), 2);
        w.controller.set_log_allowed(&q, true).unwrap();
        let all_off = w.controller.set_log_allowed_all(false).unwrap();
        assert_eq!(all_off.changes, vec![(render::policy_object_key(&p), Some(original(&p)))], "q keeps its own");
        assert!(w.controller.logs_allowed(&q));
    }

    /// A pod's counts name each policy its dispatch chain jumps to, from its chain alone; a
    /// direction no policy selects it in has none.
    #[test]
    fn a_pods_counts_name_the_policies_of_its_dispatch_chain() {
        let mut w = World::new();
        w.apply(policy("p", "web", 1));
        w.apply(policy("q", "web", 1));
        let web: IpAddr = "10.244.1.10".parse().unwrap();
        assert_eq!(
            w.controller.dispatch_chains_of(&[web, "10.244.9.9".parse().unwrap()]),
            vec!["polpod/10.244.1.10/ingress"]
        );
        let listing = "chain polpod/10.244.1.10/ingress {\n counter packets 9 bytes 1 jump pol/a/p/ingress\n counter packets 4 bytes 1 jump pol/a/q/ingress\n counter packets 1 bytes 1 drop comment \"deny\"\n}\n";
        let counts = w.controller.pod_counts(listing, &[web]);
        let accepted = |key: &str, accepted: u64| PolicyAccepted { policy: ObjectKey::new("a", key), accepted };
        assert_eq!(
            counts,
            PodPolicyCounts {
                ingress: Some(DirectionCounts {
                    policies: vec![accepted("p", 5), accepted("q", 3)],
                    dropped: 1,
                    would_drop: 0
                }),
                egress: None
            }
        );
        assert_eq!(
            serde_json::to_value(&counts).unwrap(),
            serde_json::json!({ "ingress": { "policies": [{ "policy": "a/p", "accepted": 5 }, { "policy": "a/q", "accepted": 3 }], "dropped": 1, "would_drop": 0 }, "egress": null })
        );
        // A listing without the chain (it went meanwhile) says nothing of that direction.
        assert_eq!(w.controller.pod_counts("", &[web]), PodPolicyCounts::default());
    }

    /// The shared peer set's object of the controller now (the only one in these tests).
    fn shared_set(w: &World) -> Option<(String, BTreeSet<String>)> {
        let objects = w.controller.objects();
        let mut sets = objects
            .iter()
            .filter(|(k, _)| k.namespace == "networkpolicy-set:")
            .map(|(_, r)| r.sets.iter().next().unwrap());
        let found = sets.next().map(|(name, set)| (name.clone(), set.elements.clone()));
        assert!(sets.next().is_none(), "one shared set");
        found
    }

    #[test]
    fn policies_with_the_same_peers_share_one_set_until_the_last_goes() {
        let mut w = World::new();
        w.apply(pod("a", "db-0", "10.244.1.11", "db"));
        let mut writer = crate::dataplane::Dataplane::new(Box::new(crate::dataplane::Recorder::default()));
        written(&mut writer, &w.apply(policy("p", "web", 1)));
        let (name, elements) = shared_set(&w).unwrap();
        assert_eq!(elements, BTreeSet::from(["10.244.1.12".to_string()]));
        // q allows the same peers to another pod: its chain uses the same set, no new set.
        let c = w.apply(policy("q", "db", 1));
        assert!(c.changes.iter().all(|(k, _)| k.namespace != "networkpolicy-set:"), "{:?}", keys(&c));
        let q = c.changes.iter().find(|(k, _)| k.to_string() == "networkpolicy:a/q").unwrap().1.as_ref().unwrap();
        assert!(q.sets.is_empty() && q.chains["pol/a/q/ingress"][0].contains(&format!("@{name} ")), "{q:?}");
        written(&mut writer, &c);
        // A new peer: one element added to the one set, nothing else written.
        let t = written(&mut writer, &w.apply(pod("a", "client-1", "10.244.1.13", "client")));
        assert_eq!(t, format!("add element inet wasmplane {name} {{ 10.244.1.13 }}\n"));
        // p goes: the set stays for q.
        let t = written(&mut writer, &w.delete_policy("p"));
        assert!(!t.contains("delete set"), "{t}");
        assert_eq!(shared_set(&w).unwrap().0, name);
        // q goes: the set goes in the same transaction, after the chain using it.
        let t = written(&mut writer, &w.delete_policy("q"));
        assert!(
            line_of(&t, "flush chain inet wasmplane pol/a/q/ingress")
                < line_of(&t, &format!("delete set inet wasmplane {name}")),
            "{t}"
        );
        assert!(shared_set(&w).is_none());
    }

    #[test]
    fn a_shared_set_declared_with_another_type_is_refused() {
        let mut w = World::new();
        w.apply(policy("p", "web", 1));
        let (name, _) = shared_set(&w).unwrap();
        let ipv6 = SetRules { declaration: "type ipv6_addr;".into(), ..Default::default() };
        let rules = PolicyRules { shared: BTreeMap::from([(name.clone(), ipv6)]), ..Default::default() };
        let err = w.controller.check_shared(&ObjectKey::new("a", "q"), rules.clone()).unwrap_err();
        assert!(err.to_string().contains("networkpolicy a/p"), "{err}");
        // Its only declarer may change it.
        assert!(w.controller.check_shared(&ObjectKey::new("a", "p"), rules).is_ok());
    }

    #[test]
    fn a_failing_policy_does_not_widen_a_shared_set() {
        let mut w = World::new();
        w.apply(pod("a", "db-0", "10.244.1.11", "db"));
        w.apply(policy("p", "web", 1));
        w.apply(policy("q", "db", 1));
        // q's next generation does not compile: its last good rules (client-0 a peer) stay.
        let ClusterObject::NetworkPolicy(mut bad) = policy("q", "db", 2) else { unreachable!() };
        bad.ingress.as_mut().unwrap()[0].peers.push(PolicyPeer {
            pod_selector: None,
            namespace_selector: None,
            ip_block: Some(wasmplane_model::IpBlock { cidr: "nonsense".into(), except: vec![] }),
        });
        assert_eq!(w.apply(ClusterObject::NetworkPolicy(bad)).failed, 1);
        assert_eq!(shared_set(&w).unwrap().1, BTreeSet::from(["10.244.1.12".to_string()]));
        // client-0 stops being a client: p, compiled fresh, decides the set's elements.
        let c = w.apply(pod("a", "client-0", "10.244.1.12", "batch"));
        assert_eq!(c.compiled, 1);
        assert!(shared_set(&w).unwrap().1.is_empty(), "q's stale peers left out");
        // p gone: q alone, its last good rules, as before sets were shared.
        w.delete_policy("p");
        assert_eq!(shared_set(&w).unwrap().1, BTreeSet::from(["10.244.1.12".to_string()]));
    }

    #[test]
    fn a_declined_policy_keeps_its_last_good_rules() {
        let mut w = World::new();
        w.apply(policy("p", "web", 1));
        let ClusterObject::NetworkPolicy(mut bad) = policy("p", "web", 2) else { unreachable!() };
        bad.ingress.as_mut().unwrap()[0].peers[0] = PolicyPeer {
            pod_selector: None,
            namespace_selector: None,
            ip_block: Some(wasmplane_model::IpBlock { cidr: "nonsense".into(), except: vec![] }),
        };
        let c = w.apply(ClusterObject::NetworkPolicy(bad));
        assert_eq!((c.failed, c.changes.len()), (1, 0));
        let status = w.controller.status(&w.model);
        assert_eq!((status[0].enforced_generation, status[0].desired_generation), (Some(1), 2));
        assert!(status[0].error.as_deref().unwrap().contains("nonsense"), "{status:?}");
        let c = w.apply(policy("p", "web", 3));
        assert_eq!(c.compiled, 1);
        assert!(w.controller.status(&w.model)[0].error.is_none());
    }
}
