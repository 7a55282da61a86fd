//! A module's own check of its settings: the optional `settings-validation` export
//! (Kubewarden's `validate_settings`).
//!
//! Optional, so it is in none of the kind worlds the typed bindings are generated from (a
//! component without it must keep loading): the loader finds it in the component's type,
//! refuses it with any other signature ([`check_export`]), and calls it through a typed
//! function looked up by export index on a fresh instance. A call runs in the sandbox every
//! guest call runs in (epoch deadline, memory limiter, the output cap applied to the
//! message), with no lookups (the verdict must not depend on this node's state) and the
//! settings under test as the module's settings (a validator reading them through the
//! `settings` capability sees the same document).

use std::sync::Arc;

use wasmtime::Engine;
use wasmtime::component::types::{ComponentItem, Type};
use wasmtime::component::{ComponentExportIndex, InstancePre, TypedFunc};

use crate::CallError;
use crate::host::{Capabilities, GuestSlot, GuestState, NoLookups, Sandbox, check_output_size};

/// The interface's name in the `wasmplane:dataplane` package.
pub const SETTINGS_VALIDATION: &str = "settings-validation";

/// The signature `validate` must have, as the load error names it.
const SIGNATURE: &str = "validate: func(settings: string) -> result<_, string>";

/// Longest refusal message kept, like a guest error's.
const MAX_MESSAGE_CHARS: usize = 1024;

/// What a module says of a settings document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SettingsVerdict {
    /// It can run with them.
    Valid,
    /// Refused, with the module's reason (naming the setting).
    Invalid(String),
    /// The module does not export `settings-validation`: only running it can tell.
    NotImplemented,
}

/// Why the type of an exported `settings-validation` is not the one this host calls.
pub(crate) fn check_export(engine: &Engine, item: &ComponentItem) -> Result<(), String> {
    let wrong = |what: &str| Err(format!("{what}; expected `{SIGNATURE}`"));
    let ComponentItem::ComponentInstance(instance) = item else {
        return wrong("it is not an interface");
    };
    let Some(ComponentItem::ComponentFunc(func)) = instance.get_export(engine, "validate").map(|e| e.ty) else {
        return wrong("it has no function `validate`");
    };
    let params: Vec<Type> = func.params().map(|(_, ty)| ty).collect();
    let results: Vec<Type> = func.results().collect();
    let string_error = |ty: &Type| matches!(ty, Type::Result(r) if r.ok().is_none() && r.err() == Some(Type::String));
    if func.async_()
        || !matches!(params.as_slice(), [Type::String])
        || !matches!(results.as_slice(), [result] if string_error(result))
    {
        let params: Vec<String> = params.iter().map(describe).collect();
        let results: Vec<String> = results.iter().map(describe).collect();
        let async_ = if func.async_() { "async " } else { "" };
        return wrong(&format!("`validate` is `{async_}func({}) -> ({})`", params.join(", "), results.join(", ")));
    }
    Ok(())
}

/// A WIT type as the load error shows it (wasmtime's own names are private).
pub(crate) fn describe(ty: &Type) -> String {
    let optional = |ty: Option<Type>| ty.as_ref().map_or_else(|| "_".to_string(), describe);
    match ty {
        Type::Bool => "bool".into(),
        Type::S8 | Type::S16 | Type::S32 | Type::S64 => "signed integer".into(),
        Type::U8 | Type::U16 | Type::U32 | Type::U64 => "unsigned integer".into(),
        Type::Float32 | Type::Float64 => "float".into(),
        Type::Char => "char".into(),
        Type::String => "string".into(),
        Type::List(list) => format!("list<{}>", describe(&list.ty())),
        Type::Option(option) => format!("option<{}>", describe(&option.ty())),
        Type::Result(result) => format!("result<{}, {}>", optional(result.ok()), optional(result.err())),
        Type::Record(_) => "record".into(),
        Type::Tuple(_) => "tuple".into(),
        Type::Variant(_) => "variant".into(),
        Type::Enum(_) => "enum".into(),
        Type::Flags(_) => "flags".into(),
        _ => "resource or async type".into(),
    }
}

/// `validate` takes the document and returns the refusal, if any.
type ValidateFunc = TypedFunc<(String,), (Result<(), String>,)>;

/// The export of one loaded module, ready to call.
#[derive(Clone)]
pub(crate) struct SettingsValidator {
    pre: InstancePre<GuestState>,
    validate: ComponentExportIndex,
}

impl SettingsValidator {
    /// The validator of the component behind `pre`, which exports the interface as `export`
    /// (checked by [`check_export`]); `None` if it does not.
    pub fn find(pre: &InstancePre<GuestState>, export: Option<&str>) -> Option<SettingsValidator> {
        let component = pre.component();
        let instance = component.get_export_index(None, export?)?;
        let validate = component.get_export_index(Some(&instance), "validate")?;
        Some(SettingsValidator { pre: pre.clone(), validate })
    }

    /// Runs `validate(settings)` on a fresh instance of module `name`.
    pub fn run(&self, sandbox: &Sandbox, name: &Arc<str>, settings: &str) -> Result<SettingsVerdict, CallError> {
        let capabilities = Capabilities { lookups: Arc::new(NoLookups), settings: Arc::from(settings) };
        let mut slot = GuestSlot::<ValidateFunc>::new(sandbox.clone(), name.clone(), capabilities);
        let (pre, index) = (&self.pre, &self.validate);
        slot.call(
            |store| pre.instantiate(&mut *store)?.get_typed_func(&mut *store, index),
            |validate, store| validate.call(store, (settings.to_string(),)).map(|(verdict,)| verdict),
            |verdict, limits| match verdict {
                Ok(()) => Ok(SettingsVerdict::Valid),
                Err(message) => {
                    check_output_size(1, message.len(), "messages", limits)?;
                    Ok(SettingsVerdict::Invalid(message.chars().take(MAX_MESSAGE_CHARS).collect()))
                }
            },
        )
    }
}

/// What a module without a validator, or with one, says of `settings`.
pub(crate) fn verdict(
    validator: Option<&SettingsValidator>,
    sandbox: &Sandbox,
    name: &Arc<str>,
    settings: &str,
) -> Result<SettingsVerdict, CallError> {
    match validator {
        Some(validator) => validator.run(sandbox, name, settings),
        None => Ok(SettingsVerdict::NotImplemented),
    }
}

/// A module of any kind checked and linked for its settings check alone (no kind's bindings:
/// what the host asks before storing settings for it).
pub struct SettingsCheck {
    pub info: crate::ModuleInfo,
    name: Arc<str>,
    sandbox: Sandbox,
    validator: Option<SettingsValidator>,
}

impl crate::Runtime {
    /// Loads `bytes` (every check an upload passes, `expected` its kind) for
    /// [`SettingsCheck::validate`].
    pub fn settings_check(
        &self,
        name: &str,
        bytes: &[u8],
        expected: Option<crate::GuestKind>,
        max_size: usize,
    ) -> Result<SettingsCheck, crate::LoadError> {
        let checked = self.checked(bytes, expected, max_size)?;
        let pre = checked.instance_pre(self)?;
        let validator = SettingsValidator::find(&pre, checked.settings_validation.as_deref());
        Ok(SettingsCheck { info: checked.info, name: Arc::from(name), sandbox: self.sandbox(), validator })
    }
}

impl SettingsCheck {
    /// Whether the module exports `settings-validation`.
    pub fn validates_settings(&self) -> bool {
        self.validator.is_some()
    }

    /// What the module's own `settings-validation` export says of `settings`.
    pub fn validate(&self, settings: &str) -> Result<SettingsVerdict, CallError> {
        verdict(self.validator.as_ref(), &self.sandbox, &self.name, settings)
    }
}
