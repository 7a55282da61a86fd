//! The nftables side of network policy: validating a policy guest's output, composing the
//! per-pod dispatch chains, and the host's static part (maps and base chains).
//!
//! Shape, in the same `inet wasmplane` table and through the same [`ObjectRules`] /
//! `object_delta` writer as services:
//!
//! ```text
//! forward hook, priority 0   policy-egress:  ct established,related accept; ip saddr vmap @pod-egress
//! input hook,   priority 0   policy-egress-local: the same, for pod → node traffic
//! forward hook, priority 10  policy-ingress: ct established,related accept; ip daddr vmap @pod-ingress
//!   @pod-egress / @pod-ingress (and …6): pod address → goto polpod/<addr>/<direction>
//!   polpod/<addr>/<direction>: counter jump pol/<ns>/<policy>/<direction> for every policy selecting
//!                              the pod, then `counter drop` (or, audit: count + accept), the
//!                              verdict logged to NFLOG first at a bounded rate (policy_log.rs)
//!   pol/<ns>/<policy>/…:       the guest's chains: accept what the policy allows, else return
//!   polallow/<id>/<direction>: with allow logging on for the policy, where its chains' accepts
//!                              go instead: log to NFLOG (rate-limited per pod), then accept
//! ```
//!
//! Egress and ingress are separate base chains because `accept` ends only the base chain it
//! is reached from: a packet an egress policy accepts must still meet the destination's
//! ingress policies. Peer pods live in the policy's named sets, so a peer appearing or
//! changing its address is an element delta (`object_delta` keeps sets whose declaration is
//! unchanged and writes only element differences).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use serde::Serialize;
use wasmplane_model::{ObjectKey, ToCompactString, format_compact};
use wasmplane_runtime::wit;

use super::{FAMILY, InvalidOutput, ObjectRules, TABLE, Validator};

/// Prefix of every policy's objects: `pol/<namespace>/<name>`.
pub const POLICY_PREFIX: &str = "pol";
/// Prefix of sets shared by every policy that declares them (`wasmplane_sdk::shared`): the
/// policy controller keeps one object per such set, holding the union of its declarers'
/// elements, and the policies' chains refer to it. `_` is no namespace character, so no
/// policy's own prefix starts with it.
pub const SHARED_SET_PREFIX: &str = "pol/_shared/";
/// Prefix of the host-built per-pod dispatch chains: `polpod/<address>/<direction>`.
pub const DISPATCH_PREFIX: &str = "polpod";
/// Prefix of the host-built chains logging what a policy allows:
/// `polallow/<policy id>/<ingress|egress|any>`. Not under `pol/`: guests own those names.
pub const ALLOW_LOG_PREFIX: &str = "polallow";
/// Limits on one policy's output beyond the runtime's output cap.
const MAX_CHAINS: usize = 64;
const MAX_SETS: usize = 4096;
const MAX_SET_ELEMENTS: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
    /// The host map of this direction for an address family.
    pub fn map(self, v6: bool) -> &'static str {
        match (self, v6) {
            (Direction::Ingress, false) => "pod-ingress",
            (Direction::Ingress, true) => "pod-ingress6",
            (Direction::Egress, false) => "pod-egress",
            (Direction::Egress, true) => "pod-egress6",
        }
    }
    fn from_name(name: &str) -> Option<Direction> {
        match name {
            "ingress" => Some(Direction::Ingress),
            "egress" => Some(Direction::Egress),
            _ => None,
        }
    }
    fn from_map(name: &str) -> Option<Direction> {
        match name {
            "pod-ingress" => Some(Direction::Ingress),
            "pod-egress" => Some(Direction::Egress),
            _ => None,
        }
    }
}

/// The chain prefix a policy's objects must live under.
pub fn policy_prefix(key: &ObjectKey) -> String {
    format!("{POLICY_PREFIX}/{}/{}", key.namespace, key.name)
}

/// Whether a chain or set name is one the policy side manages (not static, may go stale).
pub fn is_policy_object(name: &str) -> bool {
    name.starts_with("pol/") || name.starts_with("polpod/") || name.starts_with("polallow/")
}

/// The dataplane key of a policy's objects. Namespaces cannot contain `:`, so these never
/// collide with a service's key in the writer's one map of objects.
pub fn policy_object_key(key: &ObjectKey) -> ObjectKey {
    ObjectKey::new(format!("networkpolicy:{}", key.namespace), &key.name)
}

/// The dataplane key of one pod address's dispatch chain in one direction.
pub fn dispatch_object_key(direction: Direction, addr: &IpAddr) -> ObjectKey {
    ObjectKey::new("networkpolicy-dispatch:", format!("{addr}/{}", direction.name()))
}

/// A dispatch chain's name: IPv6 colons are not identifier characters, dashes are.
pub fn dispatch_chain(direction: Direction, addr: &IpAddr) -> String {
    format!("{DISPATCH_PREFIX}/{}/{}", addr.to_string().replace(':', "-"), direction.name())
}

/// One policy's validated output: its chains and own sets (no map elements: the host
/// composes those), the shared sets it declares (with its elements of them), and which of
/// its chains each selected local pod address jumps to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyRules {
    pub rules: ObjectRules,
    pub shared: BTreeMap<String, super::SetRules>,
    pub targets: BTreeMap<(Direction, IpAddr), String>,
}

/// The dataplane key of a shared set's object (see [`SHARED_SET_PREFIX`]).
pub fn shared_set_object_key(name: &str) -> ObjectKey {
    ObjectKey::new("networkpolicy-set:", name)
}

/// The object of a shared set: the set alone, declared with `elements`.
pub fn shared_set_object(name: &str, set: &super::SetRules) -> ObjectRules {
    let mut object = ObjectRules::default();
    object.sets.insert(name.to_string(), set.clone());
    object
}

/// Validates and renders one policy's output. `local_addresses`: the addresses of the local
/// pods the policy selects, the only ones its map elements may name (a guest cannot take
/// over another pod's traffic). Chains may only accept, return or fall through (a drop in
/// one policy would cut what another allows: policies combine as a union), and may not
/// rewrite or remember packets. Rules matching pod traffic where `pods` has no detector
/// are left out, as for services (see [`super::PodDetection`]).
pub fn validate_policy_output(
    key: &ObjectKey,
    out: &wit::Ruleset,
    local_addresses: &BTreeSet<IpAddr>,
    pods: super::PodDetection,
) -> Result<PolicyRules, InvalidOutput> {
    let object = format!("networkpolicy {key}");
    let prefix = policy_prefix(key);
    let fail = |reason: String| Err(InvalidOutput { object: object.clone(), reason });
    if out.chains.len() > MAX_CHAINS {
        return fail(format!("{} chains (limit {MAX_CHAINS})", out.chains.len()));
    }
    if out.sets.len() > MAX_SETS {
        return fail(format!("{} sets (limit {MAX_SETS})", out.sets.len()));
    }
    if let Some(set) = out.sets.iter().find(|s| s.elements.len() > MAX_SET_ELEMENTS) {
        return fail(format!("set {:?} has {} elements (limit {MAX_SET_ELEMENTS})", set.name, set.elements.len()));
    }
    if let Some(set) = out.sets.iter().find(|s| s.timeout_seconds.is_some()) {
        return fail(format!("set {:?}: policy sets hold peers, they do not expire", set.name));
    }
    for chain in &out.chains {
        for rule in &chain.rules {
            match &rule.verdict {
                wit::Verdict::None
                | wit::Verdict::Accept
                | wit::Verdict::Return
                | wit::Verdict::Jump(_)
                | wit::Verdict::Goto(_) => {}
                other => {
                    return fail(format!(
                        "chain {:?}: verdict {other:?} (policy chains accept or fall through)",
                        chain.name
                    ));
                }
            }
            if let Some(s) =
                rule.statements.iter().find(|s| !matches!(s, wit::RuleStatement::Counter | wit::RuleStatement::Log(_)))
            {
                return fail(format!("chain {:?}: statement {s:?} is not allowed in a policy", chain.name));
            }
        }
    }
    // Everything else (names under the prefix, addresses, references) as for services:
    // render chains and sets through the shared validator, without the map elements.
    let without_elements = wit::Ruleset {
        chains: out.chains.clone(),
        sets: out.sets.clone(),
        map_elements: vec![],
        warnings: out.warnings.clone(),
    };
    let (rules, shared) = validate_rendered(&object, &prefix, &without_elements, pods)?;
    let mut targets = BTreeMap::new();
    for element in &out.map_elements {
        let Some(direction) = Direction::from_map(&element.map_name) else {
            return fail(format!("unknown map {:?} (known: pod-ingress, pod-egress)", element.map_name));
        };
        let [wit::KeyPart::Address(a)] = element.key.as_slice() else {
            return fail(format!("map {:?}: key {:?} is not one address", element.map_name, element.key));
        };
        let Ok(addr) = a.parse::<IpAddr>() else { return fail(format!("{a:?} is not an IP address")) };
        if !local_addresses.contains(&addr) {
            return fail(format!("map {:?}: {addr} is not a local pod this policy selects", element.map_name));
        }
        let (wit::Verdict::Jump(chain) | wit::Verdict::Goto(chain)) = &element.verdict else {
            return fail(format!(
                "map {:?}: verdict {:?} (must jump to one of the policy's chains)",
                element.map_name, element.verdict
            ));
        };
        if !rules.chains.contains_key(chain) {
            return fail(format!("map {:?}: target chain {chain:?} is not declared by this policy", element.map_name));
        }
        if targets.insert((direction, addr), chain.clone()).is_some() {
            return fail(format!("map {:?}: {addr} given twice", element.map_name));
        }
    }
    Ok(PolicyRules { rules, shared, targets })
}

/// The policy's own chains and sets, and apart from them the shared sets it declares.
fn validate_rendered(
    object: &str,
    prefix: &str,
    out: &wit::Ruleset,
    pods: super::PodDetection,
) -> Result<(ObjectRules, BTreeMap<String, super::SetRules>), InvalidOutput> {
    let mut v = Validator {
        object,
        pods,
        prefix,
        shared_sets: Some(SHARED_SET_PREFIX),
        chains: BTreeSet::new(),
        sets: BTreeMap::new(),
    };
    for chain in &out.chains {
        v.own_name("chain", &chain.name)?;
        if !v.chains.insert(&chain.name) {
            return v.fail(format!("chain {:?} declared twice", chain.name));
        }
        if chain.rules.len() > super::MAX_RULES_PER_CHAIN {
            return v.fail(format!(
                "chain {:?} has {} rules (limit {})",
                chain.name,
                chain.rules.len(),
                super::MAX_RULES_PER_CHAIN
            ));
        }
    }
    let mut rules = ObjectRules::with_guest_warnings(out.warnings.iter().map(String::as_str));
    let mut shared = BTreeMap::new();
    for set in &out.sets {
        let (ty, elements) = v.address_set(set)?;
        let set_rules = super::SetRules { declaration: format!("type {ty};"), elements, expires: false };
        let sets = if v.is_shared_set(&set.name) { &mut shared } else { &mut rules.sets };
        sets.insert(set.name.clone(), set_rules);
    }
    for chain in &out.chains {
        rules.chains.insert(chain.name.clone(), v.chain_rules(chain)?);
    }
    Ok((rules, shared))
}

/// One policy selecting a pod address in one direction, as the dispatch chain sees it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DispatchEntry {
    /// The policy's chain for this address and direction.
    pub chain: String,
    pub audit: bool,
}

/// Log prefix of audit-mode would-be drops in the kernel log, when no verdict log is kept.
pub const AUDIT_LOG_PREFIX: &str = "wasmplane-policy-audit";

/// Where the dispatch chains log the packets they drop, or in audit mode would drop: the
/// NFLOG group the host's listener reads (`--policy-log-group`), at most `per_second`
/// packets a second per pod address and direction (after a burst of `burst`), so a flood
/// of denied packets costs the host a bounded number of log messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerdictLog {
    pub group: u16,
    pub per_second: u32,
    pub burst: u32,
}

/// Packets a second each log rule passes on by default (`--policy-log-rate`).
pub const DEFAULT_LOG_RATE: u32 = 10;

impl VerdictLog {
    pub fn new(group: u16) -> VerdictLog {
        VerdictLog { group, per_second: 0, burst: 0 }.with_rate(DEFAULT_LOG_RATE)
    }

    /// At most `per_second` packets a second per rule, after a burst of twice as many.
    pub fn with_rate(self, per_second: u32) -> VerdictLog {
        VerdictLog { per_second, burst: per_second.saturating_mul(2), ..self }
    }

    /// The statements that log a packet with `prefix`, metered per `key` (an nft expression
    /// of the packet: `ip daddr`) in the dynamic set `set` at this rate, and then for the
    /// whole rule at [`METERED_RULE_FACTOR`] times it; above either, the rule ends there.
    pub fn metered_log(self, set: &str, key: &str, prefix: &str) -> String {
        format!(
            "update @{set} {{ {key} limit rate {}/second burst {} packets }} limit rate {}/second burst {} packets log group {} prefix \"{prefix}\"",
            self.per_second,
            self.burst,
            self.per_second.saturating_mul(METERED_RULE_FACTOR),
            self.burst.saturating_mul(METERED_RULE_FACTOR),
            self.group
        )
    }
}

/// How many times one key's rate a metered log rule passes on in all
/// ([`VerdictLog::metered_log`]): what a flood across many keys costs the host.
pub const METERED_RULE_FACTOR: u32 = 10;

/// First word of a verdict log prefix: `wasmplane-policy <deny|audit> <direction> <address>`.
pub const VERDICT_LOG_PREFIX: &str = "wasmplane-policy";

/// What a dispatch chain did with a packet it logged (also the API's and the CLI's filter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PolicyVerdict {
    /// Dropped: no policy selecting the pod allowed it.
    Deny,
    /// Accepted, but only because the policies selecting the pod are in audit mode.
    Audit,
    /// Accepted by a policy with allow logging on (the first packet of a connection: what
    /// conntrack knows never reaches the policy chains).
    Allow,
}

impl PolicyVerdict {
    pub fn name(self) -> &'static str {
        match self {
            PolicyVerdict::Deny => "deny",
            PolicyVerdict::Audit => "audit",
            PolicyVerdict::Allow => "allow",
        }
    }
}

/// The prefix a dispatch chain logs with; [`parse_verdict_prefix`] reads it back.
pub fn verdict_prefix(verdict: PolicyVerdict, direction: Direction, addr: &IpAddr) -> String {
    format!("{VERDICT_LOG_PREFIX} {} {} {addr}", verdict.name(), direction.name())
}

/// What a logged packet's prefix says: which verdict, for which pod address and direction.
/// `None` for anyone else's prefix in the same group.
pub fn parse_verdict_prefix(prefix: &str) -> Option<(PolicyVerdict, Direction, IpAddr)> {
    let mut words = prefix.split(' ');
    if words.next()? != VERDICT_LOG_PREFIX {
        return None;
    }
    let verdict = match words.next()? {
        "deny" => PolicyVerdict::Deny,
        "audit" => PolicyVerdict::Audit,
        _ => return None,
    };
    let direction = Direction::from_name(words.next()?)?;
    let addr = words.next()?.parse().ok()?;
    words.next().is_none().then_some((verdict, direction, addr))
}

/// A policy as its allow log names it: the first 64 bits of the SHA-256 of `namespace/name`,
/// 16 hex digits. A namespace (63) and a policy name (253) do not fit NFLOG's 127-byte
/// prefix, and chain names have a limit of their own; the reader maps the id back from the
/// policies in force ([`PolicyLogId::of`] of each). Stable across host versions: the
/// kernel keeps the rules of the host that wrote them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyLogId(pub u64);

impl PolicyLogId {
    pub fn of(key: &ObjectKey) -> PolicyLogId {
        use sha2::Digest as _;
        let digest = sha2::Sha256::new()
            .chain_update(key.namespace.as_bytes())
            .chain_update(b"/")
            .chain_update(key.name.as_bytes())
            .finalize();
        PolicyLogId(u64::from_be_bytes(digest[..8].try_into().expect("a SHA-256 digest has 8 bytes")))
    }

    fn parse(text: &str) -> Option<PolicyLogId> {
        (text.len() == 16).then(|| u64::from_str_radix(text, 16).ok()).flatten().map(PolicyLogId)
    }
}

impl std::fmt::Display for PolicyLogId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl Serialize for PolicyLogId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// What an allow chain's direction is written as when the policy's targets of both
/// directions reach the chain (a guest sharing a chain between them): the reader infers it.
const ANY_DIRECTION: &str = "any";

/// The host's allow-logging chain of a policy for one direction (`None`: both reach it).
pub fn allow_chain(id: PolicyLogId, direction: Option<Direction>) -> String {
    format!("{ALLOW_LOG_PREFIX}/{id}/{}", direction.map_or(ANY_DIRECTION, Direction::name))
}

/// The prefix an allow chain logs with: `wasmplane-policy allow <direction|any> <id>` (at
/// most 45 bytes, whatever the policy's name); [`parse_allow_prefix`] reads it back.
pub fn allow_prefix(id: PolicyLogId, direction: Option<Direction>) -> String {
    format!("{VERDICT_LOG_PREFIX} allow {} {id}", direction.map_or(ANY_DIRECTION, Direction::name))
}

/// The direction (`None`: to be inferred) and policy of an allow chain's prefix; `None` for
/// any other prefix.
pub fn parse_allow_prefix(prefix: &str) -> Option<(Option<Direction>, PolicyLogId)> {
    let mut words = prefix.split(' ');
    if words.next()? != VERDICT_LOG_PREFIX || words.next()? != "allow" {
        return None;
    }
    let direction = match words.next()? {
        ANY_DIRECTION => None,
        name => Some(Direction::from_name(name)?),
    };
    let id = PolicyLogId::parse(words.next()?)?;
    words.next().is_none().then_some((direction, id))
}

/// A rendered rule split before its comment, which `nft::Validator::rule` writes last and
/// quoted with no quote inside: (the rule up to its verdict, ` comment "…"` or nothing).
fn split_comment(rule: &str) -> (&str, &str) {
    if let Some(inner) = rule.strip_suffix('"')
        && let Some(open) = inner.rfind('"')
        && let Some(body) = rule[..open].strip_suffix(" comment ")
    {
        return (body, &rule[body.len()..]);
    }
    (rule, "")
}

/// The chain a rendered rule's `jump` or `goto` verdict targets.
fn verdict_target(rule: &str) -> Option<&str> {
    let (body, _) = split_comment(rule);
    let (before, target) = body.rsplit_once(' ')?;
    (before.ends_with(" jump") || before.ends_with(" goto") || before == "jump" || before == "goto").then_some(target)
}

/// Which directions reach each of a policy's chains: its targets' chains, and what they jump
/// or go to, transitively.
fn chain_directions<'a>(
    rules: &'a ObjectRules,
    targets: &'a BTreeMap<(Direction, IpAddr), String>,
) -> BTreeMap<&'a str, BTreeSet<Direction>> {
    let mut reached: BTreeMap<&str, BTreeSet<Direction>> = BTreeMap::new();
    let mut work: Vec<(&str, Direction)> =
        targets.iter().map(|((direction, _), chain)| (chain.as_str(), *direction)).collect();
    while let Some((chain, direction)) = work.pop() {
        if !reached.entry(chain).or_default().insert(direction) {
            continue;
        }
        for rule in rules.chains.get(chain).into_iter().flatten() {
            if let Some(next) = verdict_target(rule).filter(|next| rules.chains.contains_key(*next)) {
                work.push((next, direction));
            }
        }
    }
    reached
}

/// A policy's object with allow logging: each `accept` of its chains goes to the host's
/// allow chain of the chain's direction instead, which logs the packet to `log`'s group (at
/// most `log.per_second` a second per pod and direction, see [`allow_log_rules`], in rules
/// of their own so that above the rate the packet is still accepted) and accepts it. A
/// chain both directions reach goes to the `any` chain, whose direction the reader infers.
/// Everything else is the validated output as it was: only the verdicts the validator
/// rendered change.
pub fn allow_logged_object(key: &ObjectKey, policy: &PolicyRules, log: VerdictLog) -> ObjectRules {
    let id = PolicyLogId::of(key);
    let directions = chain_directions(&policy.rules, &policy.targets);
    let mut object = policy.rules.clone();
    let mut used: BTreeSet<Option<Direction>> = BTreeSet::new();
    for (chain, rules) in &mut object.chains {
        let direction = match directions.get(chain.as_str()).map(|d| d.iter().collect::<Vec<_>>()).as_deref() {
            Some([only]) => Some(**only),
            _ => None,
        };
        for rule in rules.iter_mut() {
            let (body, comment) = split_comment(rule);
            // The verdict is the rendered body's last word; no match or statement ends in a
            // bare `accept` (names carry no spaces, log prefixes are quoted).
            let Some(before) = body.strip_suffix("accept").filter(|b| b.is_empty() || b.ends_with(' ')) else {
                continue;
            };
            *rule = format!("{before}goto {}{comment}", allow_chain(id, direction));
            used.insert(direction);
        }
    }
    for direction in used {
        let mut rules = allow_log_rules(direction, &allow_prefix(id, direction), log);
        rules.push("accept".to_string());
        object.chains.insert(allow_chain(id, direction), rules);
    }
    object
}

/// The dynamic sets metering each pod's logged allows per direction, keyed by the pod's
/// address (destination for ingress, source for egress) and remembered for a minute:
/// declared by the skeleton whether or not anything is logged. A pod that finds its set full
/// is not logged (the per-chain limit would soon stop it anyway).
pub const ALLOW_METER_SETS: [(&str, &str); 4] = [
    ("policy-allow-log-ingress", "ipv4_addr; flags dynamic,timeout; timeout 60s; size 4096"),
    ("policy-allow-log-ingress6", "ipv6_addr; flags dynamic,timeout; timeout 60s; size 4096"),
    ("policy-allow-log-egress", "ipv4_addr; flags dynamic,timeout; timeout 60s; size 4096"),
    ("policy-allow-log-egress6", "ipv6_addr; flags dynamic,timeout; timeout 60s; size 4096"),
];

/// An allow chain's log rules. Of one direction: one rule per address family, each metering
/// the pod (so one pod's flood of connections leaves the log to the policy's other pods) and
/// then limited for the chain (a flood across many pods), as the service drop log does. Of
/// both (`None`), where which address is the pod's is unknown: one rule limited for the
/// chain only.
fn allow_log_rules(direction: Option<Direction>, prefix: &str, log: VerdictLog) -> Vec<String> {
    let Some(direction) = direction else {
        return vec![format!(
            "limit rate {}/second burst {} packets log group {} prefix \"{prefix}\"",
            log.per_second, log.burst, log.group
        )];
    };
    let (sets, pod) = match direction {
        Direction::Ingress => ((ALLOW_METER_SETS[0].0, ALLOW_METER_SETS[1].0), "daddr"),
        Direction::Egress => ((ALLOW_METER_SETS[2].0, ALLOW_METER_SETS[3].0), "saddr"),
    };
    [("ip", sets.0), ("ip6", sets.1)]
        .into_iter()
        .map(|(family, set)| log.metered_log(set, &format!("{family} {pod}"), prefix))
        .collect()
}

/// The dispatch object of one pod address in one direction: the chain that applies the
/// union of every policy selecting it, and the map element pointing the address at it.
/// `entries` empty: no policy selects the address (the object goes away; traffic passes).
///
/// Enforcing policies decide: their chains are jumped to, then the rest is dropped (and
/// counted). When only audit-mode policies select the address, their chains are tried the
/// same way, but what none allows is counted, logged and accepted: the would-be drops.
/// (With an enforcing policy present, an audit policy changes nothing: its would-be drops
/// are dropped anyway, its allowances are not granted.) With `log`, what falls through to
/// the end is logged to its NFLOG group first, rate-limited; without, audit mode logs to the
/// kernel log as before and drops are only counted.
pub fn dispatch_object(
    direction: Direction,
    addr: &IpAddr,
    entries: &[DispatchEntry],
    log: Option<VerdictLog>,
) -> Option<ObjectRules> {
    if entries.is_empty() {
        return None;
    }
    let chain = dispatch_chain(direction, addr);
    let enforcing: BTreeSet<&str> = entries.iter().filter(|e| !e.audit).map(|e| e.chain.as_str()).collect();
    // A dispatch chain ends in deny or audit only (allows are the policy chains' business).
    let audit = enforcing.is_empty();
    let verdict = if audit { PolicyVerdict::Audit } else { PolicyVerdict::Deny };
    let deciding: BTreeSet<&str> =
        if enforcing.is_empty() { entries.iter().map(|e| e.chain.as_str()).collect() } else { enforcing };
    // Counted: a packet reaching one jump and not the next was accepted by that policy
    // ([`DispatchCounts`]), which is what a pod's per-policy counts read.
    let mut rules: Vec<String> = deciding.iter().map(|c| format!("counter jump {c}")).collect();
    if let Some(log) = log {
        // Its own rule: above the rate, `limit` ends this rule only, and the verdict follows.
        rules.push(format!(
            "limit rate {}/second burst {} packets log group {} prefix \"{}\"",
            log.per_second,
            log.burst,
            log.group,
            verdict_prefix(verdict, direction, addr)
        ));
    }
    rules.push(match (audit, log) {
        (true, Some(_)) => "counter accept comment \"audit\"".to_string(),
        (true, None) => {
            format!("counter log prefix \"{AUDIT_LOG_PREFIX} {} {addr}: \" accept comment \"audit\"", direction.name())
        }
        (false, _) => "counter drop comment \"deny\"".to_string(),
    });
    let mut object = ObjectRules::default();
    object.elements.insert(
        (direction.map(addr.is_ipv6()).to_compact_string(), addr.to_compact_string()),
        format_compact!("goto {chain}"),
    );
    object.chains.insert(chain, rules);
    Some(object)
}

/// The host maps of the policy side.
pub const POLICY_MAPS: [(&str, &str); 4] = [
    ("pod-ingress", "ipv4_addr"),
    ("pod-ingress6", "ipv6_addr"),
    ("pod-egress", "ipv4_addr"),
    ("pod-egress6", "ipv6_addr"),
];

/// The policy side's static part of the table (maps and base chains), for `nft::skeleton`
/// to include. `flush_first`: also empty the maps (a full sync refills them in the same
/// transaction; `flush table` does not empty maps).
pub fn skeleton(out: &mut String, flush_first: bool) {
    let t = format!("{FAMILY} {TABLE}");
    for (name, ty) in POLICY_MAPS {
        writeln!(out, "add map {t} {name} {{ type {ty} : verdict; }}").unwrap();
    }
    // Dynamic: never flushed, a full sync keeps what they count.
    for (name, declaration) in ALLOW_METER_SETS {
        writeln!(out, "add set {t} {name} {{ type {declaration}; }}").unwrap();
    }
    let established = "ct state established,related accept";
    let base: [(&str, &str, &[&str]); 3] = [
        (
            "policy-egress",
            "type filter hook forward priority 0; policy accept;",
            &[established, "ip saddr vmap @pod-egress", "ip6 saddr vmap @pod-egress6"],
        ),
        // Pod → node: egress policies govern it as well (ipBlock of the node's address).
        // Neighbour discovery is no pod traffic (ARP, its IPv4 twin, never meets a rule): a
        // pod under an egress policy must still resolve its gateway and answer the node's
        // solicitations, else its IPv6 fails once a neighbour entry expires (Calico and
        // Cilium let it through as well).
        (
            "policy-egress-local",
            "type filter hook input priority 0; policy accept;",
            &[
                established,
                "icmpv6 type { nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255 accept",
                "ip saddr vmap @pod-egress",
                "ip6 saddr vmap @pod-egress6",
            ],
        ),
        (
            "policy-ingress",
            "type filter hook forward priority 10; policy accept;",
            &[established, "ip daddr vmap @pod-ingress", "ip6 daddr vmap @pod-ingress6"],
        ),
    ];
    for (name, hook, _) in &base {
        writeln!(out, "add chain {t} {name} {{ {hook} }}").unwrap();
    }
    if flush_first {
        for (map, _) in POLICY_MAPS {
            writeln!(out, "flush map {t} {map}").unwrap();
        }
    }
    for (name, _, rules) in &base {
        writeln!(out, "flush chain {t} {name}").unwrap();
        for rule in rules.iter() {
            writeln!(out, "add rule {t} {name} {rule}").unwrap();
        }
    }
}

/// The packets of a listed rule's counter (`counter packets N bytes M`), if it has one.
fn rule_packets(line: &str) -> Option<u64> {
    let words: Vec<&str> = line.split_whitespace().collect();
    words.windows(2).find(|w| w[0] == "packets").and_then(|w| w[1].parse::<u64>().ok())
}

/// Counters of the dispatch chains' final rules in a `nft list table` listing: per
/// dispatch chain, the packets dropped (`deny`) or, in audit mode, that would have been.
pub fn final_rule_counters(listing: &str) -> BTreeMap<String, (bool, u64)> {
    let mut out = BTreeMap::new();
    let mut chain: Option<String> = None;
    for line in listing.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("chain ") {
            let name = rest.trim_end_matches(" {").trim_matches('"');
            chain = name.starts_with(&format!("{DISPATCH_PREFIX}/")).then(|| name.to_string());
            continue;
        }
        let Some(name) = &chain else { continue };
        let audit = line.ends_with("comment \"audit\"");
        if !(audit || line.ends_with("comment \"deny\"")) {
            continue;
        }
        if let Some(packets) = rule_packets(line) {
            out.insert(name.clone(), (audit, packets));
        }
    }
    out
}

/// What one dispatch chain's counters say, from its `nft list chain` listing: each policy
/// chain it jumps to, in order, with the packets that policy accepted, and the packets that
/// reached the final verdict (dropped, or in audit mode would have been). Only what
/// conntrack has not seen established reaches a dispatch chain: these count new
/// connections' first packets (and their retransmissions), not traffic. A packet goes on to
/// the next jump unless the chain before accepted it, so a policy is credited with what it
/// accepted first: `union` semantics, in the chain's (name) order. Since the chain was last
/// written (a change to the policies selecting the address rewrites it, from zero).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DispatchCounts {
    pub accepted: Vec<(String, u64)>,
    pub audit: bool,
    pub final_packets: u64,
}

/// The counts of dispatch chain `chain` in `listing` (a `nft list chain` or `list table`
/// print); `None` when the listing has no such chain or its rules carry no counters (the
/// chain was written by a host that did not count its jumps).
pub fn dispatch_counts(listing: &str, chain: &str) -> Option<DispatchCounts> {
    let mut lines = listing.lines().map(str::trim).skip_while(|line| {
        line.strip_prefix("chain ").map(|rest| rest.trim_end_matches(" {").trim_matches('"')) != Some(chain)
    });
    lines.next()?;
    let mut reached: Vec<(String, u64)> = Vec::new();
    let mut out = DispatchCounts::default();
    let mut ended = false;
    for line in lines.take_while(|line| *line != "}") {
        if let Some(target) =
            line.strip_prefix("jump ").or_else(|| line.rsplit_once(" jump ").map(|(_, target)| target))
        {
            reached.push((target.to_string(), rule_packets(line)?));
        } else if line.ends_with("comment \"audit\"") || line.ends_with("comment \"deny\"") {
            out.audit = line.ends_with("comment \"audit\"");
            out.final_packets = rule_packets(line)?;
            ended = true;
        }
    }
    if !ended {
        return None;
    }
    // The kernel sums each rule's per-CPU counters as it dumps them, one rule after the
    // other: a packet in flight can be in a later count and not yet in an earlier one.
    let next: Vec<u64> = reached.iter().skip(1).map(|(_, packets)| *packets).chain([out.final_packets]).collect();
    out.accepted = reached
        .into_iter()
        .zip(next)
        .map(|((target, packets), after)| (target, packets.saturating_sub(after)))
        .collect();
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Policies' rules with pod traffic detected by source address, the default, on a
    /// dual-stack node (a detector in each family).
    fn validate_policy_output(
        key: &ObjectKey,
        out: &wit::Ruleset,
        local: &BTreeSet<IpAddr>,
    ) -> Result<PolicyRules, InvalidOutput> {
        super::validate_policy_output(
            key,
            out,
            local,
            super::super::PodDetection::new(&super::super::PodTraffic::default(), &dual_stack()),
        )
    }

    /// Cluster CIDRs of both families.
    fn dual_stack() -> Vec<ipnet::IpNet> {
        vec!["10.244.0.0/16".parse().unwrap(), "fd00:10:244::/56".parse().unwrap()]
    }

    fn key() -> ObjectKey {
        ObjectKey::new("a", "p")
    }

    fn addr(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn accept(matches: Vec<wit::RuleMatch>) -> wit::Rule {
        wit::Rule { matches, statements: vec![], verdict: wit::Verdict::Accept, comment: None }
    }

    fn output() -> wit::Ruleset {
        wit::Ruleset {
            chains: vec![wit::Chain {
                name: "pol/a/p/ingress".into(),
                rules: vec![accept(vec![
                    wit::RuleMatch::SourceInSet("pol/a/p/ingress/0/peers/v4".into()),
                    wit::RuleMatch::Protocol(wit::Protocol::Tcp),
                    wit::RuleMatch::DestinationPortRange((8000, 8010)),
                ])],
            }],
            sets: vec![wit::SetDeclaration {
                name: "pol/a/p/ingress/0/peers/v4".into(),
                family: wit::AddressFamily::Ipv4,
                timeout_seconds: None,
                elements: vec!["10.244.1.12".into()],
            }],
            map_elements: vec![wit::MapElement {
                map_name: "pod-ingress".into(),
                key: vec![wit::KeyPart::Address("10.244.1.10".into())],
                verdict: wit::Verdict::Jump("pol/a/p/ingress".into()),
            }],
            warnings: vec![],
        }
    }

    fn local() -> BTreeSet<IpAddr> {
        [addr("10.244.1.10")].into()
    }

    #[test]
    fn valid_output_renders_chains_sets_and_targets() {
        let p = validate_policy_output(&key(), &output(), &local()).unwrap();
        assert_eq!(
            p.rules.chains["pol/a/p/ingress"],
            vec!["ip saddr @pol/a/p/ingress/0/peers/v4 meta l4proto tcp th dport 8000-8010 accept"]
        );
        let set = &p.rules.sets["pol/a/p/ingress/0/peers/v4"];
        assert_eq!(set.declaration, "type ipv4_addr;");
        assert_eq!(set.elements, BTreeSet::from(["10.244.1.12".to_string()]));
        assert!(p.rules.elements.is_empty(), "map elements are composed by the host");
        assert!(p.shared.is_empty());
        assert_eq!(
            p.targets,
            BTreeMap::from([((Direction::Ingress, addr("10.244.1.10")), "pol/a/p/ingress".to_string())])
        );
    }

    #[test]
    fn shared_sets_are_kept_apart_from_the_policy_own() {
        let mut out = output();
        let shared = format!("{SHARED_SET_PREFIX}peers/0123abcd/v4");
        out.sets[0].name = shared.clone();
        out.chains[0].rules[0].matches[0] = wit::RuleMatch::SourceInSet(shared.clone());
        let p = validate_policy_output(&key(), &out, &local()).unwrap();
        assert!(p.rules.sets.is_empty());
        assert_eq!(p.shared[&shared].elements, BTreeSet::from(["10.244.1.12".to_string()]));
        assert!(p.rules.chains["pol/a/p/ingress"][0].starts_with(&format!("ip saddr @{shared} ")));
        // The guests' SDK names shared sets under the same prefix.
        assert_eq!(SHARED_SET_PREFIX, wasmplane_sdk::shared::SHARED_SET_PREFIX);
        // The prefix alone names nothing shared: it is outside the policy's namespace.
        out.sets[0].name = SHARED_SET_PREFIX.into();
        assert!(validate_policy_output(&key(), &out, &local()).unwrap_err().reason.contains("outside"));
    }

    #[test]
    fn output_beyond_the_policy_is_refused() {
        let refused = |f: &dyn Fn(&mut wit::Ruleset), why: &str| {
            let mut out = output();
            f(&mut out);
            let err = validate_policy_output(&key(), &out, &local()).expect_err(why);
            assert!(err.to_string().contains("networkpolicy a/p"), "{err}");
            err.reason
        };
        let r = refused(
            &|o| o.map_elements[0].key = vec![wit::KeyPart::Address("10.244.9.9".into())],
            "another pod's address",
        );
        assert!(r.contains("not a local pod"), "{r}");
        let r = refused(&|o| o.chains[0].name = "svc/a/web/x".into(), "a chain outside the prefix");
        assert!(r.contains("outside"), "{r}");
        let r = refused(&|o| o.chains[0].rules[0].verdict = wit::Verdict::Drop, "a drop");
        assert!(r.contains("Drop"), "{r}");
        refused(
            &|o| {
                o.chains[0].rules[0]
                    .statements
                    .push(wit::RuleStatement::Dnat(wit::DnatTarget { address: "1.1.1.1".into(), port: 1 }))
            },
            "dnat",
        );
        refused(&|o| o.map_elements[0].map_name = "service-ips".into(), "a service map");
        refused(&|o| o.map_elements[0].verdict = wit::Verdict::Accept, "accept in the map");
        refused(&|o| o.map_elements[0].verdict = wit::Verdict::Jump("pol/a/p/other".into()), "undeclared target");
        refused(&|o| o.sets[0].elements.push("fd00::1".into()), "wrong family");
        refused(&|o| o.sets[0].timeout_seconds = Some(5), "expiring set");
        refused(
            &|o| o.chains[0].rules[0].matches.push(wit::RuleMatch::SourceInSet("pol/a/p/nope".into())),
            "undeclared set",
        );
        refused(
            &|o| o.chains.extend((0..MAX_CHAINS).map(|i| wit::Chain { name: format!("pol/a/p/c{i}"), rules: vec![] })),
            "too many chains",
        );
        // A policy named like another's prefix: `pol/a/p` does not own `pol/a/pq`.
        refused(&|o| o.chains[0].name = "pol/a/pq/ingress".into(), "a sibling's prefix");
    }

    #[test]
    fn dispatch_is_the_union_of_enforcing_policies_then_drop() {
        let a = addr("10.244.1.10");
        let entries = vec![
            DispatchEntry { chain: "pol/a/q/ingress".into(), audit: false },
            DispatchEntry { chain: "pol/a/p/ingress".into(), audit: false },
            DispatchEntry { chain: "pol/a/r/ingress".into(), audit: true },
        ];
        let o = dispatch_object(Direction::Ingress, &a, &entries, None).unwrap();
        assert_eq!(
            o.chains["polpod/10.244.1.10/ingress"],
            vec!["counter jump pol/a/p/ingress", "counter jump pol/a/q/ingress", "counter drop comment \"deny\""]
        );
        assert_eq!(o.elements[&("pod-ingress".into(), "10.244.1.10".into())], "goto polpod/10.244.1.10/ingress");
        let audit_only = dispatch_object(Direction::Egress, &addr("fd00::a"), &entries[2..], None).unwrap();
        let chain = &audit_only.chains["polpod/fd00--a/egress"];
        assert_eq!(chain[0], "counter jump pol/a/r/ingress");
        assert!(
            chain[1].starts_with("counter log prefix") && chain[1].ends_with("accept comment \"audit\""),
            "{chain:?}"
        );
        assert!(audit_only.elements.contains_key(&("pod-egress6".into(), "fd00::a".into())));
        assert!(dispatch_object(Direction::Egress, &a, &[], None).is_none());
    }

    /// With a verdict log, what falls through is logged to the group first, rate-limited, in
    /// a rule of its own, and the prefix reads back as the verdict, direction and address.
    #[test]
    fn dispatch_logs_its_verdict_to_the_group_before_deciding() {
        let log = Some(VerdictLog { group: 7, per_second: 5, burst: 9 });
        let entries = vec![
            DispatchEntry { chain: "pol/a/p/ingress".into(), audit: false },
            DispatchEntry { chain: "pol/a/r/ingress".into(), audit: true },
        ];
        let denying = dispatch_object(Direction::Ingress, &addr("10.244.1.10"), &entries, log).unwrap();
        assert_eq!(
            denying.chains["polpod/10.244.1.10/ingress"],
            vec![
                "counter jump pol/a/p/ingress",
                "limit rate 5/second burst 9 packets log group 7 prefix \"wasmplane-policy deny ingress 10.244.1.10\"",
                "counter drop comment \"deny\""
            ]
        );
        let auditing = dispatch_object(Direction::Egress, &addr("fd00::a"), &entries[1..], log).unwrap();
        let chain = &auditing.chains["polpod/fd00--a/egress"];
        assert_eq!(
            chain[1],
            "limit rate 5/second burst 9 packets log group 7 prefix \"wasmplane-policy audit egress fd00::a\""
        );
        assert_eq!(chain[2], "counter accept comment \"audit\"", "the group, not the kernel log too");
        assert_eq!(
            parse_verdict_prefix("wasmplane-policy audit egress fd00::a"),
            Some((PolicyVerdict::Audit, Direction::Egress, addr("fd00::a")))
        );
        assert_eq!(
            parse_verdict_prefix("wasmplane-policy deny ingress 10.244.1.10"),
            Some((PolicyVerdict::Deny, Direction::Ingress, addr("10.244.1.10")))
        );
        for foreign in [
            "ulogd 1 2 3",
            "wasmplane-policy deny sideways 10.0.0.1",
            "wasmplane-policy deny ingress 10.0.0.1 extra",
            "wasmplane-policy-audit ingress 10.0.0.1: ",
        ] {
            assert_eq!(parse_verdict_prefix(foreign), None, "{foreign}");
        }
    }

    /// A policy's pod-traffic match follows the node's detection mode, as a service's does;
    /// by source address it looks the main table's sets up, where policy chains are.
    #[test]
    fn pod_traffic_matches_render_as_the_node_detects_pod_traffic() {
        use super::super::PodTraffic;
        let mut out = output();
        let pod_traffic = |family, negate| wit::RuleMatch::PodTraffic(wit::PodTrafficMatch { family, negate });
        out.chains[0].rules = vec![
            accept(vec![pod_traffic(wit::AddressFamily::Ipv4, false), wit::RuleMatch::Protocol(wit::Protocol::Tcp)]),
            accept(vec![pod_traffic(wit::AddressFamily::Ipv4, true)]),
            accept(vec![pod_traffic(wit::AddressFamily::Ipv6, false)]),
            accept(vec![
                pod_traffic(wit::AddressFamily::Ipv6, true),
                wit::RuleMatch::SourceInSet("pol/a/p/ingress/0/peers/v4".into()),
            ]),
        ];
        for (mode, wanted) in [
            (
                PodTraffic::SourceAddress,
                [
                    "ip saddr @cluster-cidrs meta l4proto tcp accept",
                    "ip saddr != @cluster-cidrs accept",
                    "ip6 saddr @cluster-cidrs6 accept",
                    "ip6 saddr != @cluster-cidrs6 ip saddr @pol/a/p/ingress/0/peers/v4 accept",
                ],
            ),
            (
                PodTraffic::InterfacePrefix("veth".into()),
                [
                    "iifname \"veth*\" meta l4proto tcp accept",
                    "iifname != \"veth*\" accept",
                    "iifname \"veth*\" accept",
                    "iifname != \"veth*\" ip saddr @pol/a/p/ingress/0/peers/v4 accept",
                ],
            ),
            (
                PodTraffic::Bridge("cbr0".into()),
                [
                    "iifname \"cbr0\" meta l4proto tcp accept",
                    "iifname != \"cbr0\" accept",
                    "iifname \"cbr0\" accept",
                    "iifname != \"cbr0\" ip saddr @pol/a/p/ingress/0/peers/v4 accept",
                ],
            ),
        ] {
            let p = super::validate_policy_output(
                &key(),
                &out,
                &local(),
                super::super::PodDetection::new(&mode, &dual_stack()),
            )
            .unwrap();
            assert_eq!(p.rules.chains["pol/a/p/ingress"], wanted, "{mode:?}");
            // The sets looked up are the host's, not the policy's own to declare.
            assert_eq!(p.rules.sets.keys().collect::<Vec<_>>(), ["pol/a/p/ingress/0/peers/v4"], "{mode:?}");
            // The incremental path sends the chain as a netlink batch, not through nft -f.
            let chain: String =
                wanted.iter().map(|r| format!("add rule {FAMILY} {TABLE} pol/a/p/ingress {r}\n")).collect();
            super::super::netlink::encode_transaction(&chain, 1).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        }
    }

    /// By source address, a family without a cluster CIDR has no pod detector: a policy's
    /// rules matching its pod traffic (either way) are left out, the rest of the chain stays
    /// (kube-proxy writes no rule for a detector it does not have). By interface nothing is.
    #[test]
    fn pod_traffic_rules_of_a_family_without_a_detector_are_left_out() {
        use super::super::{PodDetection, PodTraffic};
        let mut out = output();
        let pod_traffic = |family, negate| wit::RuleMatch::PodTraffic(wit::PodTrafficMatch { family, negate });
        out.chains[0].rules = vec![
            accept(vec![pod_traffic(wit::AddressFamily::Ipv4, false)]),
            accept(vec![pod_traffic(wit::AddressFamily::Ipv6, false)]),
            accept(vec![pod_traffic(wit::AddressFamily::Ipv6, true), wit::RuleMatch::Protocol(wit::Protocol::Tcp)]),
            accept(vec![wit::RuleMatch::SourceInSet("pol/a/p/ingress/0/peers/v4".into())]),
        ];
        let v4_only: Vec<ipnet::IpNet> = vec!["10.244.0.0/16".parse().unwrap()];
        let source = PodTraffic::SourceAddress;
        let rendered = |pods: PodDetection<'_>| {
            super::validate_policy_output(&key(), &out, &local(), pods).unwrap().rules.chains["pol/a/p/ingress"].clone()
        };
        assert_eq!(
            rendered(PodDetection::new(&source, &v4_only)),
            ["ip saddr @cluster-cidrs accept", "ip saddr @pol/a/p/ingress/0/peers/v4 accept"]
        );
        assert_eq!(rendered(PodDetection::new(&source, &[])), ["ip saddr @pol/a/p/ingress/0/peers/v4 accept"]);
        for mode in [PodTraffic::InterfacePrefix("veth".into()), PodTraffic::Bridge("cbr0".into())] {
            assert_eq!(rendered(PodDetection::new(&mode, &v4_only)).len(), 4, "{mode:?}");
            assert_eq!(rendered(PodDetection::new(&mode, &[])).len(), 4, "{mode:?}");
        }
        // Left out, not unchecked: a rule of an undetected family is validated all the same.
        out.chains[0].rules.push(wit::Rule {
            matches: vec![pod_traffic(wit::AddressFamily::Ipv6, false)],
            statements: vec![],
            verdict: wit::Verdict::Jump("pol/a/p/nowhere".into()),
            comment: None,
        });
        assert!(
            super::validate_policy_output(&key(), &out, &local(), PodDetection::new(&source, &v4_only))
                .unwrap_err()
                .reason
                .contains("does not declare")
        );
    }

    #[test]
    fn counters_are_read_from_a_listing() {
        let listing = "table inet wasmplane {\n\tchain polpod/10.244.1.10/ingress {\n\t\tjump pol/a/p/ingress\n\t\tcounter packets 7 bytes 420 drop comment \"deny\"\n\t}\n\tchain polpod/10.244.1.11/egress {\n\t\tcounter packets 2 bytes 120 log prefix \"wasmplane-policy-audit egress 10.244.1.11: \" accept comment \"audit\"\n\t}\n\tchain svc/x {\n\t\tcounter packets 9 bytes 1 drop comment \"deny\"\n\t}\n}\n";
        let c = final_rule_counters(listing);
        assert_eq!(
            c,
            BTreeMap::from([
                ("polpod/10.244.1.10/ingress".to_string(), (false, 7)),
                ("polpod/10.244.1.11/egress".to_string(), (true, 2))
            ])
        );
    }

    /// Each policy is credited with what reached its jump and not the next; the last with
    /// what did not reach the final verdict. A chain of an older host (no jump counters) and
    /// an absent one say nothing.
    #[test]
    fn a_dispatch_chains_counters_credit_each_policy_with_what_it_accepted() {
        let listing = "table inet wasmplane {\n\tchain polpod/10.244.1.10/ingress {\n\t\tcounter packets 12 bytes 720 jump pol/a/p/ingress\n\t\tcounter packets 5 bytes 300 jump pol/a/q/ingress\n\t\tlimit rate 10/second burst 20 packets log group 1001 prefix \"wasmplane-policy deny ingress 10.244.1.10\"\n\t\tcounter packets 2 bytes 120 drop comment \"deny\"\n\t}\n\tchain polpod/10.244.1.11/egress {\n\t\tjump pol/a/p/egress\n\t\tcounter packets 2 bytes 120 drop comment \"deny\"\n\t}\n\tchain polpod/10.244.1.12/egress {\n\t\tcounter packets 4 bytes 240 jump pol/a/r/egress\n\t\tcounter packets 1 bytes 60 accept comment \"audit\"\n\t}\n}\n";
        assert_eq!(
            dispatch_counts(listing, "polpod/10.244.1.10/ingress"),
            Some(DispatchCounts {
                accepted: vec![("pol/a/p/ingress".into(), 7), ("pol/a/q/ingress".into(), 3)],
                audit: false,
                final_packets: 2
            })
        );
        assert_eq!(
            dispatch_counts(listing, "polpod/10.244.1.12/egress"),
            Some(DispatchCounts { accepted: vec![("pol/a/r/egress".into(), 3)], audit: true, final_packets: 1 })
        );
        assert_eq!(dispatch_counts(listing, "polpod/10.244.1.11/egress"), None, "jumps without counters");
        assert_eq!(dispatch_counts(listing, "polpod/10.244.1.13/egress"), None, "no such chain");
        // What the dispatch chain is written as is what is read back.
        let entries = [DispatchEntry { chain: "pol/a/p/ingress".into(), audit: false }];
        let object =
            dispatch_object(Direction::Ingress, &addr("10.244.1.10"), &entries, Some(VerdictLog::new(1001))).unwrap();
        let rules = &object.chains["polpod/10.244.1.10/ingress"];
        let written = format!(
            "chain polpod/10.244.1.10/ingress {{\n{}\n}}\n",
            rules.iter().map(|r| r.replace("counter ", "counter packets 3 bytes 9 ")).collect::<Vec<_>>().join("\n")
        );
        assert_eq!(
            dispatch_counts(&written, "polpod/10.244.1.10/ingress"),
            Some(DispatchCounts { accepted: vec![("pol/a/p/ingress".into(), 0)], audit: false, final_packets: 3 }),
            "{written}"
        );
    }

    fn allow_policy(chains: &[(&str, &[&str])], targets: &[(Direction, &str, &str)]) -> PolicyRules {
        let mut rules = ObjectRules::default();
        for (name, body) in chains {
            rules.chains.insert(name.to_string(), body.iter().map(|r| r.to_string()).collect());
        }
        let targets = targets.iter().map(|(d, a, c)| ((*d, addr(a)), c.to_string())).collect();
        PolicyRules { rules, shared: BTreeMap::new(), targets }
    }

    const LOG: VerdictLog = VerdictLog { group: 7, per_second: 5, burst: 9 };

    #[test]
    fn allow_logging_sends_each_accept_to_the_allow_chain_of_its_direction() {
        let policy = allow_policy(
            &[
                (
                    "pol/a/p/ingress",
                    &[
                        "ip saddr @pol/a/p/peers tcp dport 80 accept comment \"from web\"",
                        "jump pol/a/p/more",
                        "counter",
                    ],
                ),
                ("pol/a/p/more", &["udp dport 53 accept"]),
                ("pol/a/p/egress", &["ip daddr 10.0.0.1 accept"]),
            ],
            &[
                (Direction::Ingress, "10.244.0.5", "pol/a/p/ingress"),
                (Direction::Egress, "10.244.0.5", "pol/a/p/egress"),
            ],
        );
        let object = allow_logged_object(&key(), &policy, LOG);
        let id = PolicyLogId::of(&key());
        let (ingress, egress) = (allow_chain(id, Some(Direction::Ingress)), allow_chain(id, Some(Direction::Egress)));
        assert_eq!(
            object.chains["pol/a/p/ingress"],
            vec![
                format!("ip saddr @pol/a/p/peers tcp dport 80 goto {ingress} comment \"from web\""),
                "jump pol/a/p/more".to_string(),
                "counter".to_string()
            ]
        );
        assert_eq!(
            object.chains["pol/a/p/more"],
            vec![format!("udp dport 53 goto {ingress}")],
            "reached from ingress only"
        );
        assert_eq!(object.chains["pol/a/p/egress"], vec![format!("ip daddr 10.0.0.1 goto {egress}")]);
        // Each family's rule meters the pod (the destination of ingress), then the chain at 10×.
        let metered = |set: &str, key: &str, direction: Direction| {
            format!(
                "update @{set} {{ {key} limit rate 5/second burst 9 packets }} limit rate 50/second burst 90 packets log group 7 prefix \"{}\"",
                allow_prefix(id, Some(direction))
            )
        };
        assert_eq!(
            object.chains[&ingress],
            [
                metered("policy-allow-log-ingress", "ip daddr", Direction::Ingress),
                metered("policy-allow-log-ingress6", "ip6 daddr", Direction::Ingress),
                "accept".to_string()
            ]
        );
        assert_eq!(
            object.chains[&egress],
            [
                metered("policy-allow-log-egress", "ip saddr", Direction::Egress),
                metered("policy-allow-log-egress6", "ip6 saddr", Direction::Egress),
                "accept".to_string()
            ],
            "egress meters the source"
        );
        assert_eq!(object.chains.len(), 5, "{:?}", object.chains.keys());
        assert!(is_policy_object(&ingress) && ingress.len() <= 64, "{ingress}");
        assert_eq!(
            (object.sets.clone(), object.elements.clone()),
            (policy.rules.sets.clone(), policy.rules.elements.clone())
        );
    }

    #[test]
    fn a_chain_both_directions_reach_logs_to_the_any_chain() {
        let policy = allow_policy(
            &[("pol/a/p/both", &["tcp dport 443 accept"])],
            &[(Direction::Ingress, "10.244.0.5", "pol/a/p/both"), (Direction::Egress, "10.244.0.6", "pol/a/p/both")],
        );
        let object = allow_logged_object(&key(), &policy, LOG);
        let any = allow_chain(PolicyLogId::of(&key()), None);
        assert!(any.ends_with("/any"), "{any}");
        assert_eq!(object.chains["pol/a/p/both"], vec![format!("tcp dport 443 goto {any}")]);
        assert_eq!(object.chains.len(), 2);
        // Which address is the pod's is unknown here: limited for the chain only.
        assert_eq!(
            object.chains[&any],
            [
                format!(
                    "limit rate 5/second burst 9 packets log group 7 prefix \"{}\"",
                    allow_prefix(PolicyLogId::of(&key()), None)
                ),
                "accept".to_string()
            ]
        );
    }

    #[test]
    fn a_policy_without_accepts_gets_no_allow_chain() {
        let policy = allow_policy(
            &[("pol/a/p/ingress", &["counter", "jump pol/a/p/x"])],
            &[(Direction::Ingress, "10.244.0.5", "pol/a/p/ingress")],
        );
        assert_eq!(allow_logged_object(&key(), &policy, LOG), policy.rules);
    }

    #[test]
    fn allow_prefixes_read_back() {
        let id = PolicyLogId::of(&ObjectKey::new(
            "a-very-long-namespace-name-indeed",
            "and-a-policy-name-just-as-long-as-it-can-be",
        ));
        for direction in [Some(Direction::Ingress), Some(Direction::Egress), None] {
            let prefix = allow_prefix(id, direction);
            assert!(prefix.len() < 64, "{prefix}");
            assert_eq!(parse_allow_prefix(&prefix), Some((direction, id)), "{prefix}");
        }
        assert_eq!(PolicyLogId::of(&key()), PolicyLogId::of(&key()));
        assert_ne!(PolicyLogId::of(&key()), PolicyLogId::of(&ObjectKey::new("a", "q")));
        for bad in [
            "wasmplane-policy deny ingress 10.0.0.1",
            "wasmplane-policy allow sideways 0123456789abcdef",
            "wasmplane-policy allow any 0123",
            "wasmplane-policy allow any 0123456789abcdef extra",
            "other allow any 0123456789abcdef",
        ] {
            assert_eq!(parse_allow_prefix(bad), None, "{bad}");
        }
        assert_eq!(parse_verdict_prefix(&allow_prefix(id, None)), None, "an allow is no deny or audit");
    }
}
