//! Guests built against `wasmplane:dataplane@1.0.0` (`wit/1.0.0/`), which keep loading as the
//! package's versioning promises.
//!
//! 1.1.0 added a case to `rule-match` (`pod-traffic`). Everything a guest is given is the same
//! in both versions; only what translators and policy guests return differs, and only in
//! type: wasmtime types a variant by its cases, so a 1.0 `rule-match` is not a 1.1 one even
//! though each 1.0 value is a 1.1 value. A 1.0 guest's `translate` or `compile` is therefore
//! called with the host's inputs as they are, and its ruleset is read in the 1.0 shape (the
//! types below, which are 1.0's structurally) and taken into 1.1's case for case. Imports need
//! nothing: the linker serves a 1.0 import with the 1.1 interface (semver-compatible names,
//! unchanged types).

use std::marker::PhantomData;

use wasmtime::component::{
    ComponentExportIndex, ComponentNamedList, ComponentType, Func, InstancePre, Lift, Lower, TypedFunc,
};

use crate::host::GuestState;
use crate::wit;

/// Whether a guest exporting `version` of its interface is a 1.0 guest (any 1.0.x).
pub fn is_1_0(version: &str) -> bool {
    version.starts_with("1.0.")
}

/// 1.0's `rule-match`: 1.1's without `pod-traffic`.
#[derive(ComponentType, Lift, Debug)]
#[component(variant)]
pub(crate) enum RuleMatch {
    #[component(name = "source")]
    Source(wit::AddressMatch),
    #[component(name = "destination")]
    Destination(wit::AddressMatch),
    #[component(name = "protocol")]
    Protocol(wit::Protocol),
    #[component(name = "destination-port")]
    DestinationPort(u16),
    #[component(name = "destination-port-range")]
    DestinationPortRange((u16, u16)),
    #[component(name = "source-in-set")]
    SourceInSet(String),
    #[component(name = "destination-in-set")]
    DestinationInSet(String),
    #[component(name = "destination-is-local")]
    DestinationIsLocal,
    #[component(name = "connection-established")]
    ConnectionEstablished,
    #[component(name = "random")]
    Random((u32, u32)),
}

#[derive(ComponentType, Lift, Debug)]
#[component(record)]
pub(crate) struct Rule {
    matches: Vec<RuleMatch>,
    statements: Vec<wit::RuleStatement>,
    verdict: wit::Verdict,
    comment: Option<String>,
}

#[derive(ComponentType, Lift, Debug)]
#[component(record)]
pub(crate) struct Chain {
    name: String,
    rules: Vec<Rule>,
}

/// 1.0's `ruleset`: its chains' rules hold 1.0 matches; the rest is 1.1's.
#[derive(ComponentType, Lift, Debug)]
#[component(record)]
pub(crate) struct Ruleset {
    chains: Vec<Chain>,
    sets: Vec<wit::SetDeclaration>,
    #[component(name = "map-elements")]
    map_elements: Vec<wit::MapElement>,
    warnings: Vec<String>,
}

impl From<RuleMatch> for wit::RuleMatch {
    fn from(m: RuleMatch) -> wit::RuleMatch {
        match m {
            RuleMatch::Source(a) => wit::RuleMatch::Source(a),
            RuleMatch::Destination(a) => wit::RuleMatch::Destination(a),
            RuleMatch::Protocol(p) => wit::RuleMatch::Protocol(p),
            RuleMatch::DestinationPort(p) => wit::RuleMatch::DestinationPort(p),
            RuleMatch::DestinationPortRange(r) => wit::RuleMatch::DestinationPortRange(r),
            RuleMatch::SourceInSet(s) => wit::RuleMatch::SourceInSet(s),
            RuleMatch::DestinationInSet(s) => wit::RuleMatch::DestinationInSet(s),
            RuleMatch::DestinationIsLocal => wit::RuleMatch::DestinationIsLocal,
            RuleMatch::ConnectionEstablished => wit::RuleMatch::ConnectionEstablished,
            RuleMatch::Random(r) => wit::RuleMatch::Random(r),
        }
    }
}

impl From<Ruleset> for wit::Ruleset {
    fn from(r: Ruleset) -> wit::Ruleset {
        let rule = |r: Rule| wit::Rule {
            matches: r.matches.into_iter().map(Into::into).collect(),
            statements: r.statements,
            verdict: r.verdict,
            comment: r.comment,
        };
        wit::Ruleset {
            chains: r
                .chains
                .into_iter()
                .map(|c| wit::Chain { name: c.name, rules: c.rules.into_iter().map(rule).collect() })
                .collect(),
            sets: r.sets,
            map_elements: r.map_elements,
            warnings: r.warnings,
        }
    }
}

/// What a 1.0 guest's function returns.
type GuestResult = (Result<Ruleset, wit::GuestError>,);

/// A 1.0 function's parameters, whatever they borrow from.
pub(crate) trait Signature {
    type Params<'a>: ComponentNamedList + Lower;
}

/// `translate` as a 1.0 translator exports it.
pub(crate) enum Translate {}

impl Signature for Translate {
    type Params<'a> = (&'a wit::NodeContext, &'a str, &'a wit::Service, &'a [wit::EndpointSlice]);
}

/// `compile` as a 1.0 policy guest exports it.
pub(crate) enum Compile {}

impl Signature for Compile {
    type Params<'a> = (&'a wit::NodeContext, &'a str, &'a wit::NetworkPolicy, &'a [wit::Pod]);
}

/// The function a 1.0 guest exports for its kind (`translate`, `compile`: `S`), found when the
/// module loads.
pub(crate) struct Export<S> {
    pre: InstancePre<GuestState>,
    func: ComponentExportIndex,
    signature: PhantomData<S>,
}

impl<S> Clone for Export<S> {
    fn clone(&self) -> Self {
        Export { pre: self.pre.clone(), func: self.func, signature: PhantomData }
    }
}

/// One instance's function, its type checked as `S`'s.
pub(crate) struct Checked<S> {
    func: Func,
    signature: PhantomData<S>,
}

impl<S: Signature> Export<S> {
    /// `function` of the interface the component exports as `interface` (its full name).
    pub fn find(pre: &InstancePre<GuestState>, interface: &str, function: &str) -> Option<Export<S>> {
        let component = pre.component();
        let instance = component.get_export_index(None, interface)?;
        let func = component.get_export_index(Some(&instance), function)?;
        Some(Export { pre: pre.clone(), func, signature: PhantomData })
    }

    /// A new instance's function, its type checked against 1.0's.
    pub fn instantiate(&self, store: &mut wasmtime::Store<GuestState>) -> wasmtime::Result<Checked<S>> {
        let instance = self.pre.instantiate(&mut *store)?;
        let func = instance.get_func(&mut *store, self.func).ok_or_else(|| {
            wasmtime::format_err!("the component exports no function at the index it had when loaded")
        })?;
        func.typed::<S::Params<'_>, GuestResult>(&*store)?;
        Ok(Checked { func, signature: PhantomData })
    }
}

impl<S: Signature> Checked<S> {
    /// Calls it; the ruleset comes back in today's types.
    pub fn call(
        &self,
        store: &mut wasmtime::Store<GuestState>,
        params: S::Params<'_>,
    ) -> wasmtime::Result<Result<wit::Ruleset, wit::GuestError>> {
        // SAFETY: the type was checked as `S`'s when this instance was made (`Export::instantiate`).
        let typed: TypedFunc<S::Params<'_>, GuestResult> = unsafe { TypedFunc::new_unchecked(self.func) };
        let (result,) = typed.call(store, params)?;
        Ok(result.map(Into::into))
    }
}
