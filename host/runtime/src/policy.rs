//! Network-policy guest sessions (issue 6): one policy in, its filter objects out.
//!
//! A policy module is validated exactly like every other ([`Runtime::load`] with
//! [`GuestKind::NetworkPolicy`]: header, world, version, granted imports, linking) and then
//! instantiated through the `network-policy-enforcement` bindings below. Those bindings reuse
//! the service world's types, `log` and `lookups` (bindgen `with:`), so a policy guest's
//! imports are served by the host implementations already in the runtime's linker
//! (`host.rs`) and its rulesets are the very type the nftables writer takes.
//!
//! Calls run under the runtime's [`Limits`]: epoch deadline, memory limiter, output cap. A
//! guest error (the guest declined the policy) keeps the instance; anything else drops it.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use wasmplane_model as m;
use wasmplane_model::state::{NodeContext, PolicyView};

use crate::host::{GuestSlot, GuestState, Lookups, Sandbox};
use crate::validation::SettingsValidator;
use crate::{CallError, GuestKind, LoadError, ModuleInfo, Runtime, SettingsVerdict, convert, wit};
use wasmplane_model::ToStd;

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "network-policy-enforcement",
        // Shared with the service world: one set of types (with their serde derive), one
        // implementation of each capability in the linker.
        with: {
            "wasmplane:dataplane/types@1.2.0": crate::bindings::service::wasmplane::dataplane::types,
            "wasmplane:dataplane/log@1.2.0": crate::bindings::service::wasmplane::dataplane::log,
            "wasmplane:dataplane/lookups@1.2.0": crate::bindings::service::wasmplane::dataplane::lookups,
            "wasmplane:dataplane/settings@1.2.0": crate::bindings::service::wasmplane::dataplane::settings,
        },
    });
}

use bindings::{NetworkPolicyEnforcement, NetworkPolicyEnforcementPre};

/// A validated, compiled network-policy component ready to instantiate.
pub struct PolicyModule {
    pub info: ModuleInfo,
    name: Arc<str>,
    pre: PolicyPre,
    sandbox: Sandbox,
    settings: Arc<str>,
    /// Its `settings-validation` export, if it has one.
    validator: Option<SettingsValidator>,
}

impl Runtime {
    /// Validates and compiles a network-policy component.
    pub fn load_policy(&self, name: &str, bytes: &[u8], max_size: usize) -> Result<PolicyModule, LoadError> {
        let checked = self.checked(bytes, Some(GuestKind::NetworkPolicy), max_size)?;
        let pre = checked.instance_pre(self)?;
        let validator = SettingsValidator::find(&pre, checked.settings_validation.as_deref());
        let info = checked.info;
        let pre = if crate::wit_1_0::is_1_0(&info.wit_version) {
            let export = format!("{}/{}@{}", crate::WIT_PACKAGE, GuestKind::NetworkPolicy, info.wit_version);
            PolicyPre::V1_0(
                crate::wit_1_0::Export::find(&pre, &export, "compile")
                    .ok_or_else(|| LoadError::Link(format!("{export} exports no `compile`")))?,
            )
        } else {
            PolicyPre::Current(NetworkPolicyEnforcementPre::new(pre).map_err(|e| LoadError::Link(format!("{e:#}")))?)
        };
        tracing::debug!(module = name, digest = %info.digest, "network-policy module loaded");
        Ok(PolicyModule {
            info,
            name: Arc::from(name),
            pre,
            sandbox: self.sandbox(),
            settings: Arc::from(crate::host::NO_SETTINGS),
            validator,
        })
    }
}

impl PolicyModule {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The settings its guests read (a JSON document; `{}` until set).
    pub fn with_settings(mut self, settings: &str) -> Self {
        self.settings = Arc::from(settings);
        self
    }

    /// What the module's own `settings-validation` export says of `settings`; see
    /// [`LoadedModule::validate_settings`](crate::LoadedModule::validate_settings).
    pub fn validate_settings(&self, settings: &str) -> Result<SettingsVerdict, CallError> {
        crate::validation::verdict(self.validator.as_ref(), &self.sandbox, &self.name, settings)
    }

    /// A session calling `compile`; `lookups` answers the guest's `lookups` imports.
    pub fn session(&self, lookups: Arc<dyn Lookups>) -> PolicySession {
        let capabilities = crate::host::Capabilities { lookups, settings: self.settings.clone() };
        let (sandbox, name) = (self.sandbox.clone(), self.name.clone());
        PolicySession(match &self.pre {
            PolicyPre::Current(pre) => {
                PolicyGuest::Current { pre: pre.clone(), slot: GuestSlot::new(sandbox, name, capabilities) }
            }
            PolicyPre::V1_0(export) => {
                PolicyGuest::V1_0 { export: export.clone(), slot: GuestSlot::new(sandbox, name, capabilities) }
            }
        })
    }
}

/// A policy guest of this host's WIT version, or of 1.0 (`wit_1_0.rs`).
enum PolicyPre {
    Current(NetworkPolicyEnforcementPre<GuestState>),
    V1_0(crate::wit_1_0::Export<crate::wit_1_0::Compile>),
}

enum PolicyGuest {
    Current {
        pre: NetworkPolicyEnforcementPre<GuestState>,
        slot: GuestSlot<NetworkPolicyEnforcement>,
    },
    V1_0 {
        export: crate::wit_1_0::Export<crate::wit_1_0::Compile>,
        slot: GuestSlot<crate::wit_1_0::Checked<crate::wit_1_0::Compile>>,
    },
}

/// Runs `compile` on one instance, reused across calls until a call fails (a trapped
/// instance cannot be entered again, so the next call gets a fresh one).
pub struct PolicySession(PolicyGuest);

impl PolicySession {
    /// Compiles the policy of `view` for the local pods it selects.
    pub fn compile(
        &mut self,
        context: &NodeContext,
        chain_prefix: &str,
        view: &PolicyView,
    ) -> Result<wit::Ruleset, CallError> {
        let ctx = convert::node_context(context);
        let policy = network_policy(&view.policy);
        let local: Vec<wit::Pod> = view.local_pods.iter().map(|p| convert::pod(p)).collect();
        self.compile_wit(&ctx, chain_prefix, &policy, &local)
    }

    /// Like [`compile`](Self::compile) with inputs already in WIT form.
    pub fn compile_wit(
        &mut self,
        ctx: &wit::NodeContext,
        chain_prefix: &str,
        policy: &wit::NetworkPolicy,
        local_pods: &[wit::Pod],
    ) -> Result<wit::Ruleset, CallError> {
        match &mut self.0 {
            PolicyGuest::Current { pre, slot } => slot.call(
                |store| pre.instantiate(store),
                |bindings, store| {
                    bindings.wasmplane_dataplane_network_policy().call_compile(
                        store,
                        ctx,
                        chain_prefix,
                        policy,
                        local_pods,
                    )
                },
                crate::loader::accept_ruleset,
            ),
            PolicyGuest::V1_0 { export, slot } => slot.call(
                |store| export.instantiate(store),
                |func, store| func.call(store, (ctx, chain_prefix, policy, local_pods)),
                crate::loader::accept_ruleset,
            ),
        }
    }
}

// ---- model → WIT ----------------------------------------------------------------------------

fn labels(l: &m::Labels) -> Vec<wit::Label> {
    l.iter().map(|(k, v)| wit::Label { key: k.to_std(), value: v.to_std() }).collect()
}

pub fn selector(s: &m::LabelSelector) -> wit::LabelSelector {
    wit::LabelSelector {
        match_labels: labels(&s.match_labels),
        match_expressions: s
            .match_expressions
            .iter()
            .map(|r| wit::SelectorRequirement {
                key: r.key.to_std(),
                operator: match r.operator {
                    m::SelectorOperator::In => wit::SelectorOperator::In,
                    m::SelectorOperator::NotIn => wit::SelectorOperator::NotIn,
                    m::SelectorOperator::Exists => wit::SelectorOperator::Exists,
                    m::SelectorOperator::DoesNotExist => wit::SelectorOperator::DoesNotExist,
                },
                values: r.values.to_std(),
            })
            .collect(),
    }
}

fn rule(r: &m::PolicyRule) -> wit::PolicyRule {
    wit::PolicyRule {
        ports: r
            .ports
            .iter()
            .map(|p| wit::PolicyPort {
                protocol: convert::protocol(p.protocol),
                port: match &p.port {
                    m::PolicyPortNumber::Any => wit::PolicyPortNumber::Any,
                    m::PolicyPortNumber::Number(n) => wit::PolicyPortNumber::Number(*n),
                    m::PolicyPortNumber::Name(n) => wit::PolicyPortNumber::Name(n.to_std()),
                },
                end_port: p.end_port,
            })
            .collect(),
        peers: r
            .peers
            .iter()
            .map(|p| wit::PolicyPeer {
                pod_selector: p.pod_selector.as_ref().map(selector),
                namespace_selector: p.namespace_selector.as_ref().map(selector),
                ip_block: p
                    .ip_block
                    .as_ref()
                    .map(|b| wit::IpBlock { cidr: b.cidr.to_std(), except: b.except.to_std() }),
            })
            .collect(),
    }
}

/// A model policy as the guest sees it.
pub fn network_policy(p: &m::NetworkPolicy) -> wit::NetworkPolicy {
    wit::NetworkPolicy {
        namespace: p.namespace.to_std(),
        name: p.name.to_std(),
        generation: p.generation,
        pod_selector: selector(&p.pod_selector),
        ingress: p.ingress.as_ref().map(|rules| rules.iter().map(rule).collect()),
        egress: p.egress.as_ref().map(|rules| rules.iter().map(rule).collect()),
    }
}

// ---- lookups over a set of pods ------------------------------------------------------------

/// What one compile may see: the pods it may name (for a policy: its view's peer pods, plus
/// every pod when an egress named port must be resolved on any destination) and the labels
/// of every namespace. Swapped per call by the host, so the session (which holds the
/// `Arc<dyn Lookups>`) never sees cluster state other than what the caller chose to give.
#[derive(Default)]
pub struct PodLookups {
    snapshot: RwLock<PodSnapshot>,
}

/// The pods a call may see, and the labels of every namespace by name.
type PodSnapshot = (Vec<Arc<m::Pod>>, Arc<BTreeMap<m::CompactString, m::Labels>>);

impl PodLookups {
    pub fn new() -> Arc<PodLookups> {
        Arc::new(PodLookups::default())
    }

    /// Replaces what the next calls see.
    pub fn replace(&self, pods: Vec<Arc<m::Pod>>, namespaces: Arc<BTreeMap<m::CompactString, m::Labels>>) {
        *self.snapshot.write().unwrap_or_else(|e| e.into_inner()) = (pods, namespaces);
    }
}

impl Lookups for PodLookups {
    fn pods_matching(
        &self,
        namespace: Option<&str>,
        namespace_selector: Option<&m::LabelSelector>,
        pod_selector: &m::LabelSelector,
    ) -> Vec<m::Pod> {
        let guard = self.snapshot.read().unwrap_or_else(|e| e.into_inner());
        let (pods, namespaces) = &*guard;
        pods.iter()
            .filter(|p| {
                !p.host_network && namespace.is_none_or(|n| n == p.namespace) && pod_selector.matches(&p.labels)
            })
            // A namespace this node does not know has no labels to match.
            .filter(|p| namespace_selector.is_none_or(|s| namespaces.get(&p.namespace).is_some_and(|l| s.matches(l))))
            .map(|p| m::Pod::clone(p))
            .collect()
    }

    fn namespace(&self, name: &str) -> Option<m::Namespace> {
        let guard = self.snapshot.read().unwrap_or_else(|e| e.into_inner());
        guard.1.get(name).map(|labels| m::Namespace { name: name.into(), labels: labels.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Limits;
    use wasmplane_model::Protocol;

    fn labels(pairs: &[(&str, &str)]) -> m::Labels {
        pairs.iter().map(|&(k, v)| (k.into(), v.into())).collect()
    }

    fn sel(pairs: &[(&str, &str)]) -> m::LabelSelector {
        m::LabelSelector { match_labels: labels(pairs), match_expressions: vec![] }
    }

    fn pod(ns: &str, name: &str, ip: &str, app: &str) -> Arc<m::Pod> {
        Arc::new(m::Pod {
            namespace: ns.into(),
            name: name.into(),
            ips: vec![ip.into()],
            node_name: Some("node-a".into()),
            labels: labels(&[("app", app)]),
            ports: vec![m::ContainerPort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 8080,
                host_port: None,
                host_ip: None,
            }],
            host_network: false,
        })
    }

    fn namespaces() -> Arc<BTreeMap<m::CompactString, m::Labels>> {
        Arc::new(BTreeMap::from([("a".into(), labels(&[("team", "blue")])), ("b".into(), labels(&[("team", "red")]))]))
    }

    /// web in `a` accepts clients of blue namespaces on 8080; egress of web to `b` only.
    fn view(ip_block: Option<&str>) -> PolicyView {
        let policy = m::NetworkPolicy {
            namespace: "a".into(),
            name: "p".into(),
            uid: Default::default(),
            generation: 3,
            pod_selector: sel(&[("app", "web")]),
            ingress: Some(vec![m::PolicyRule {
                ports: vec![m::PolicyPort {
                    protocol: Protocol::Tcp,
                    port: m::PolicyPortNumber::Number(8080),
                    end_port: None,
                }],
                peers: vec![m::PolicyPeer {
                    pod_selector: Some(sel(&[("app", "client")])),
                    namespace_selector: Some(sel(&[("team", "blue")])),
                    ip_block: None,
                }],
            }]),
            egress: Some(vec![m::PolicyRule {
                ports: vec![],
                peers: vec![m::PolicyPeer {
                    pod_selector: None,
                    namespace_selector: ip_block.is_none().then(|| sel(&[("team", "red")])),
                    ip_block: ip_block.map(|c| m::IpBlock { cidr: c.into(), except: vec![] }),
                }],
            }]),
        };
        PolicyView { policy, local_pods: vec![pod("a", "web-0", "10.244.1.10", "web")], peer_pods: vec![] }
    }

    fn context() -> NodeContext {
        NodeContext { node_name: "node-a".into(), cluster_cidrs: vec!["10.244.0.0/16".into()], ..Default::default() }
    }

    fn cluster() -> Vec<Arc<m::Pod>> {
        vec![
            pod("a", "web-0", "10.244.1.10", "web"),
            pod("a", "client-0", "10.244.1.12", "client"),
            pod("b", "client-0", "10.244.2.12", "client"),
            pod("b", "db-0", "10.244.2.11", "db"),
        ]
    }

    /// The peer set the first rule of `chain` matches on.
    fn peer_set<'a>(r: &'a wit::Ruleset, chain: &str) -> &'a wit::SetDeclaration {
        let rule = &r.chains.iter().find(|c| c.name == chain).unwrap_or_else(|| panic!("no chain {chain}")).rules[0];
        let name = rule
            .matches
            .iter()
            .find_map(|m| match m {
                wit::RuleMatch::SourceInSet(s) | wit::RuleMatch::DestinationInSet(s) => Some(s),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{rule:?} matches no set"));
        r.sets.iter().find(|s| s.name == *name).unwrap_or_else(|| panic!("no set {name} in {:?}", r.sets))
    }

    /// A policy guest built against 1.0.0 as released (`wit/1.0.0/`) loads, and its
    /// output comes back in this version's types.
    #[test]
    fn a_policy_guest_built_against_1_0_loads_and_runs() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let module = runtime
            .load_policy("old", wasmplane_guest_artifacts::test_programs::POLICY_WIT_1_0, 8 << 20)
            .expect("a 1.0 policy guest loads");
        assert_eq!(module.info.wit_version, "1.0.0");
        let mut session = module.session(PodLookups::new());
        let out = session.compile(&context(), "pol/a/p", &view(Some("192.0.2.0/24"))).expect("compile");
        assert_eq!(out.chains[0].name, "pol/a/p/ingress");
        assert!(
            matches!(&out.chains[0].rules[0].matches[..], [wit::RuleMatch::Source(a)] if a.cidr == "192.0.2.0/24" && !a.negate),
            "{out:?}"
        );
        assert_eq!(out.warnings, ["1 local pods"]);
    }

    #[test]
    fn the_shipped_policy_guest_compiles_through_host_lookups() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let module = runtime
            .load_policy("np", wasmplane_guest_artifacts::NETWORK_POLICY, 8 << 20)
            .expect("the default policy guest loads");
        assert_eq!(module.info.kind, GuestKind::NetworkPolicy);
        let lookups = PodLookups::new();
        lookups.replace(cluster(), namespaces());
        let mut session = module.session(lookups.clone());
        let out = session.compile(&context(), "pol/a/p", &view(None)).expect("compile");
        let chains: Vec<&str> = out.chains.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(chains, vec!["pol/a/p/ingress", "pol/a/p/egress"]);
        // The peer sets come from the host's answers to the guest's lookups.
        assert_eq!(peer_set(&out, "pol/a/p/ingress").elements, vec!["10.244.1.12".to_string()]);
        assert_eq!(
            peer_set(&out, "pol/a/p/egress").elements,
            vec!["10.244.2.11".to_string(), "10.244.2.12".to_string()]
        );
        let elements: Vec<(&str, &wit::Verdict)> =
            out.map_elements.iter().map(|e| (e.map_name.as_str(), &e.verdict)).collect();
        assert_eq!(
            elements,
            vec![
                ("pod-ingress", &wit::Verdict::Jump("pol/a/p/ingress".into())),
                ("pod-egress", &wit::Verdict::Jump("pol/a/p/egress".into()))
            ]
        );
        // The same instance, new cluster state: b relabelled blue, its client becomes a peer.
        let mut relabelled = (*namespaces()).clone();
        relabelled.insert("b".into(), labels(&[("team", "blue")]));
        lookups.replace(cluster(), Arc::new(relabelled));
        let out = session.compile(&context(), "pol/a/p", &view(None)).unwrap();
        assert_eq!(
            peer_set(&out, "pol/a/p/ingress").elements,
            vec!["10.244.1.12".to_string(), "10.244.2.12".to_string()]
        );
        assert!(peer_set(&out, "pol/a/p/egress").elements.is_empty());
    }

    #[test]
    fn a_declined_policy_is_a_guest_error_and_the_session_goes_on() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let module = runtime.load_policy("np", wasmplane_guest_artifacts::NETWORK_POLICY, 8 << 20).unwrap();
        let mut session = module.session(PodLookups::new());
        match session.compile(&context(), "pol/a/p", &view(Some("not-a-cidr"))) {
            Err(CallError::Guest(message)) => {
                assert!(message.contains("not-a-cidr") && message.contains("a/p"), "{message}")
            }
            other => panic!("expected a guest error, got {other:?}"),
        }
        let out = session.compile(&context(), "pol/a/p", &view(Some("192.168.0.0/16"))).unwrap();
        let egress = out.chains.iter().find(|c| c.name == "pol/a/p/egress").unwrap();
        assert_eq!(egress.rules.len(), 1);
        assert_eq!(
            egress.rules[0].matches,
            vec![wit::RuleMatch::Destination(wit::AddressMatch { cidr: "192.168.0.0/16".into(), negate: false })]
        );
    }

    #[test]
    fn output_over_the_limit_is_refused_and_the_session_recovers() {
        let runtime = Runtime::new(Limits { max_output_objects: 16, ..Limits::default() }, None).unwrap();
        let module = runtime.load_policy("np", wasmplane_guest_artifacts::NETWORK_POLICY, 8 << 20).unwrap();
        let lookups = PodLookups::new();
        let many: Vec<Arc<m::Pod>> =
            (0..20).map(|i| pod("a", &format!("c{i}"), &format!("10.244.1.{}", 100 + i), "client")).collect();
        lookups.replace(many, namespaces());
        let mut session = module.session(lookups.clone());
        assert!(matches!(session.compile(&context(), "pol/a/p", &view(None)), Err(CallError::OutputTooLarge(_))));
        lookups.replace(vec![], namespaces());
        assert!(session.compile(&context(), "pol/a/p", &view(None)).is_ok());
    }

    #[test]
    fn another_kind_is_not_loaded_as_a_policy_module() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let err =
            runtime.load_policy("st", wasmplane_guest_artifacts::SERVICE_TRANSLATOR, 8 << 20).err().expect("refused");
        assert!(
            matches!(
                err,
                LoadError::KindMismatch { declared: GuestKind::NetworkPolicy, found: GuestKind::ServiceTranslator }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn lookups_follow_peer_semantics() {
        let lookups = PodLookups::new();
        let mut pods = cluster();
        let mut host = m::Pod::clone(&pods[1]);
        host.host_network = true;
        host.name = "host-0".into();
        pods.push(Arc::new(host));
        lookups.replace(pods, namespaces());
        let names = |v: Vec<m::Pod>| v.into_iter().map(|p| format!("{}/{}", p.namespace, p.name)).collect::<Vec<_>>();
        assert_eq!(names(lookups.pods_matching(Some("a"), None, &sel(&[("app", "client")]))), vec!["a/client-0"]);
        assert_eq!(
            names(lookups.pods_matching(None, Some(&sel(&[("team", "red")])), &sel(&[]))),
            vec!["b/client-0", "b/db-0"]
        );
        assert_eq!(
            names(lookups.pods_matching(None, Some(&sel(&[])), &sel(&[("app", "client")]))),
            vec!["a/client-0", "b/client-0"]
        );
        assert_eq!(lookups.namespace("b").unwrap().labels, labels(&[("team", "red")]));
        assert!(lookups.namespace("zzz").is_none());
    }
}
