//! Garbage-collection guest sessions (issue 7): the host offers candidates, the
//! guest's `collect` names the keys to delete.
//!
//! A GC module is validated exactly like any other ([`Runtime::load`] with
//! [`GuestKind::Gc`]: header, world, version, granted imports, linking), then
//! instantiated through its own bindings. Calls run under the runtime's
//! [`Limits`]: the epoch deadline, the memory limiter, and an output cap (keys
//! named count as objects, their bytes as output bytes). What the guest names
//! is only a proposal: the caller deletes nothing it did not offer.

use std::sync::Arc;

use crate::host::{GuestSlot, GuestState, NoLookups, Sandbox, check_output_size};
use crate::validation::SettingsValidator;
use crate::{CallError, GuestKind, LoadError, ModuleInfo, Runtime, SettingsVerdict};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "garbage-collection",
        // The log capability is the one every guest kind shares (already in the linker).
        with: {
            "wasmplane:dataplane/log@1.2.0": crate::bindings::service::wasmplane::dataplane::log,
            "wasmplane:dataplane/settings@1.2.0": crate::bindings::service::wasmplane::dataplane::settings,
        },
    });
}

pub use bindings::exports::wasmplane::dataplane::gc::{Candidate, CandidateKind};
use bindings::{GarbageCollection, GarbageCollectionPre};

/// A validated, compiled GC component ready to instantiate.
pub struct GcModule {
    pub info: ModuleInfo,
    name: Arc<str>,
    pre: GarbageCollectionPre<GuestState>,
    sandbox: Sandbox,
    settings: Arc<str>,
    /// Its `settings-validation` export, if it has one.
    validator: Option<SettingsValidator>,
}

impl Runtime {
    /// Validates and compiles a GC component.
    pub fn load_gc(&self, name: &str, bytes: &[u8], max_size: usize) -> Result<GcModule, LoadError> {
        let checked = self.checked(bytes, Some(GuestKind::Gc), max_size)?;
        let pre = checked.instance_pre(self)?;
        let validator = SettingsValidator::find(&pre, checked.settings_validation.as_deref());
        let pre = GarbageCollectionPre::new(pre).map_err(|e| LoadError::Link(format!("{e:#}")))?;
        Ok(GcModule {
            info: checked.info,
            name: Arc::from(name),
            pre,
            sandbox: self.sandbox(),
            settings: Arc::from(crate::host::NO_SETTINGS),
            validator,
        })
    }
}

impl GcModule {
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

    /// A session calling `collect`.
    pub fn session(&self) -> GcSession {
        // GC guests import no lookups: nothing to query.
        let capabilities = crate::host::Capabilities { lookups: Arc::new(NoLookups), settings: self.settings.clone() };
        GcSession { pre: self.pre.clone(), slot: GuestSlot::new(self.sandbox.clone(), self.name.clone(), capabilities) }
    }
}

/// Runs `collect` on one instance, reused until a call fails (a trapped
/// instance cannot be entered again).
pub struct GcSession {
    pre: GarbageCollectionPre<GuestState>,
    slot: GuestSlot<GarbageCollection>,
}

impl GcSession {
    /// Asks the guest which of `candidates` to delete. On any error the
    /// instance is dropped and nothing is named.
    pub fn collect(&mut self, candidates: &[Candidate]) -> Result<Vec<String>, CallError> {
        let pre = &self.pre;
        self.slot.call(
            |store| pre.instantiate(store),
            |bindings, store| bindings.wasmplane_dataplane_gc().call_collect(store, candidates),
            |keys, limits| {
                let bytes: usize = keys.iter().map(String::len).sum();
                check_output_size(keys.len(), bytes, "keys", limits).map(|_| keys)
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Limits;

    fn candidate(key: &str, kind: CandidateKind, age_seconds: u64, owner_exists: bool) -> Candidate {
        Candidate { key: key.into(), kind, age_seconds, owner_exists }
    }

    fn offered() -> Vec<Candidate> {
        vec![
            candidate("/ids/1", CandidateKind::StaleNode, 7200, true),
            candidate("/ids/2", CandidateKind::StaleNode, 7200, false),
            candidate("/ids/3", CandidateKind::StaleNode, 60, false),
            candidate("/status/a", CandidateKind::PolicyStatus, 120, false),
            candidate("/status/b", CandidateKind::NodeStatus, 120, false),
            candidate("/locks/x", CandidateKind::Lock, 0, false),
            candidate("/locks/y", CandidateKind::Lock, 10, true),
        ]
    }

    #[test]
    fn the_shipped_gc_guest_names_what_its_policy_says() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let module = runtime.load_gc("gc", wasmplane_guest_artifacts::GC, 8 << 20).expect("the default GC guest loads");
        assert_eq!(module.info.kind, GuestKind::Gc);
        let mut session = module.session();
        let named = session.collect(&offered()).expect("collect");
        assert_eq!(named, vec!["/ids/2", "/status/a", "/locks/x"]);
        // The instance is reused and answers the same.
        assert_eq!(session.collect(&offered()).unwrap(), named);
        assert_eq!(session.collect(&[]).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn output_over_the_limit_is_refused_and_the_session_recovers() {
        let limits = Limits { max_output_objects: 2, ..Limits::default() };
        let runtime = Runtime::new(limits, None).unwrap();
        let module = runtime.load_gc("gc", wasmplane_guest_artifacts::GC, 8 << 20).unwrap();
        let mut session = module.session();
        assert!(matches!(session.collect(&offered()), Err(CallError::OutputTooLarge(_))));
        let small = &offered()[..2];
        assert_eq!(session.collect(small).unwrap(), vec!["/ids/2"]);
    }

    #[test]
    fn another_kind_is_not_loaded_as_gc() {
        let runtime = Runtime::new(Limits::default(), None).unwrap();
        let err = runtime.load_gc("st", wasmplane_guest_artifacts::SERVICE_TRANSLATOR, 8 << 20).err().expect("refused");
        assert!(
            matches!(err, LoadError::KindMismatch { declared: GuestKind::Gc, found: GuestKind::ServiceTranslator }),
            "{err:?}"
        );
        assert!(matches!(runtime.load_gc("junk", b"not wasm at all", 1 << 20), Err(LoadError::NotWasm)));
    }
}
