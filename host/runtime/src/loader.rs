//! Validating, compiling and running guest components.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use wasmtime::component::types::{ComponentItem, Type};
use wasmtime::component::{Component, ComponentExportIndex, Func, InstancePre, TypedFunc};

use crate::archived::{ArchivedOutput, ParsedContext};
use crate::bindings::service::{ServiceTranslation, ServiceTranslationPre};
use crate::host::{GuestSlot, GuestState, Lookups, Sandbox, check_output_size};
use crate::validation::{SETTINGS_VALIDATION, SettingsValidator};
use crate::{CallError, Limits, Runtime, SettingsVerdict, archived, convert, wit, wit_1_0};
use wasmplane_model::state::{NodeContext, ServiceView};

/// The WIT package every guest world belongs to.
pub const WIT_PACKAGE: &str = "wasmplane:dataplane";
/// The package version this host implements; guests built against it or an older 1.x load
/// (1.0 through `wit_1_0.rs`). A newer minor is refused at load ([`LoadError::NewerVersion`]).
pub const WIT_VERSION: &str = "1.2.0";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GuestKind {
    ServiceTranslator,
    NetworkPolicy,
    Gc,
}

impl GuestKind {
    pub const ALL: [GuestKind; 3] = [GuestKind::ServiceTranslator, GuestKind::NetworkPolicy, GuestKind::Gc];

    /// The interface a component of this kind exports.
    pub fn interface(self) -> &'static str {
        match self {
            GuestKind::ServiceTranslator => "service-translator",
            GuestKind::NetworkPolicy => "network-policy",
            GuestKind::Gc => "gc",
        }
    }

    pub fn parse(s: &str) -> Option<GuestKind> {
        GuestKind::ALL.into_iter().find(|k| k.interface() == s)
    }

    /// The kind of a component exporting `interface` of the package: a kind's own, or the
    /// archived service translator's (1.2.0).
    pub fn of_export(interface: &str) -> Option<GuestKind> {
        match interface {
            ARCHIVED_TRANSLATOR => Some(GuestKind::ServiceTranslator),
            other => GuestKind::parse(other),
        }
    }
}

/// The interface of a service translator that takes and returns archives (`archived.rs`).
pub const ARCHIVED_TRANSLATOR: &str = "archived-service-translator";

impl fmt::Display for GuestKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.interface())
    }
}

/// Why a module was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LoadError {
    #[error("module is {size} bytes, over the limit of {max}")]
    TooLarge { size: usize, max: usize },
    #[error("not a WebAssembly binary (bad magic number)")]
    NotWasm,
    #[error(
        "this is a core WebAssembly module, not a component: build for wasm32-wasip2 or run `wasm-tools component new`"
    )]
    CoreModule,
    #[error("component does not compile: {0}")]
    Compile(String),
    #[error(
        "component implements no known wasmplane world (it exports {exports:?}; expected one of {expected:?} from {WIT_PACKAGE}@{WIT_VERSION} or an older 1.x)"
    )]
    UnknownWorld { exports: Vec<String>, expected: Vec<String> },
    #[error("component was uploaded as kind {declared} but implements {found}")]
    KindMismatch { declared: GuestKind, found: GuestKind },
    #[error("component targets {WIT_PACKAGE}@{found}, this host implements {WIT_VERSION} (major version 1)")]
    UnsupportedVersion { found: String },
    #[error(
        "component targets {WIT_PACKAGE}@{found}, newer than this host's {WIT_VERSION}: build it against {} or older, or upgrade the host",
        minor_line(WIT_VERSION)
    )]
    NewerVersion { found: String },
    #[error("component imports {0}, which this host does not grant")]
    ForbiddenImport(String),
    #[error("component does not link against the host: {0}")]
    Link(String),
    #[error("this host cannot run {0} guests yet")]
    KindNotRunnable(GuestKind),
    #[error("component exports {export} with a signature this host cannot call: {reason}")]
    SettingsValidation { export: String, reason: String },
}

/// What the host learned about a module while loading it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModuleInfo {
    /// `sha256:<hex>` of the component bytes.
    pub digest: String,
    pub kind: GuestKind,
    /// The interface it exports for its kind, when not the kind's own (`archived-service-translator`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    pub wit_version: String,
    pub size: usize,
    pub imports: Vec<String>,
}

enum Runner {
    ServiceTranslator(ServiceTranslationPre<GuestState>),
    /// Built against 1.0.0 (`wit_1_0.rs`).
    ServiceTranslator1_0(wit_1_0::Export<wit_1_0::Translate>),
    /// `archived-service-translator` (1.2.0, `archived.rs`).
    ArchivedServiceTranslator(ArchivedExport),
}

/// An archived translator's `translate`, found when the module loads.
#[derive(Clone)]
struct ArchivedExport {
    pre: InstancePre<GuestState>,
    func: ComponentExportIndex,
}

/// `translate(input: list<u8>) -> list<u8>`.
type ArchivedTranslate<'a> = TypedFunc<(&'a [u8],), (Vec<u8>,)>;

impl ArchivedExport {
    fn find(pre: &InstancePre<GuestState>, interface: &str) -> Option<ArchivedExport> {
        let component = pre.component();
        let instance = component.get_export_index(None, interface)?;
        let func = component.get_export_index(Some(&instance), "translate")?;
        Some(ArchivedExport { pre: pre.clone(), func })
    }

    /// A new instance's `translate`, its type checked.
    fn instantiate(&self, store: &mut wasmtime::Store<GuestState>) -> wasmtime::Result<Func> {
        let instance = self.pre.instantiate(&mut *store)?;
        let func = instance.get_func(&mut *store, self.func).ok_or_else(|| {
            wasmtime::format_err!("the component exports no function at the index it had when loaded")
        })?;
        func.typed::<(&[u8],), (Vec<u8>,)>(&*store)?;
        Ok(func)
    }
}

/// A validated, compiled component ready to instantiate.
pub struct LoadedModule {
    pub info: ModuleInfo,
    name: Arc<str>,
    runner: Runner,
    sandbox: Sandbox,
    /// What its sessions' guests read through the `settings` capability.
    settings: Arc<str>,
    /// Its `settings-validation` export, if it has one.
    validator: Option<SettingsValidator>,
}

/// What [`Runtime::checked`] found: the compiled component, what the host reports of it,
/// and the full name of its `settings-validation` export if it has one.
pub(crate) struct Checked {
    pub component: Component,
    pub info: ModuleInfo,
    pub settings_validation: Option<String>,
}

impl Checked {
    /// Links the component against the host's capabilities.
    pub fn instance_pre(&self, runtime: &Runtime) -> Result<InstancePre<GuestState>, LoadError> {
        runtime.linker.instantiate_pre(&self.component).map_err(|e| LoadError::Link(format!("{e:#}")))
    }
}

pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn check_header(bytes: &[u8]) -> Result<(), LoadError> {
    const MAGIC: &[u8] = b"\0asm";
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(LoadError::NotWasm);
    }
    // Bytes 4..8: version and layer; layer 0 is a core module, 1 a component.
    match &bytes[4..8] {
        [1, 0, 0, 0] => Err(LoadError::CoreModule),
        [_, _, 1, 0] => Ok(()),
        _ => Err(LoadError::NotWasm),
    }
}

/// `wasmplane:dataplane/service-translator@1.0.0` → (`service-translator`, `1.0.0`).
fn split_name(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix(WIT_PACKAGE)?.strip_prefix('/')?;
    rest.split_once('@')
}

/// `MAJOR.MINOR.PATCH`, plain digits: a pre-release or build metadata is no release to judge.
fn parse_version(version: &str) -> Option<(u64, u64, u64)> {
    let mut parts = version
        .split('.')
        .map(|p| if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) { p.parse().ok() } else { None });
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(Some(major)), Some(Some(minor)), Some(Some(patch)), None) => Some((major, minor, patch)),
        _ => None,
    }
}

/// `1.1.0` → `1.1`: what a guest may be built against, any patch.
fn minor_line(version: &str) -> &str {
    version.rsplit_once('.').map_or(version, |(line, _)| line)
}

/// Whether a component may name `version` of the package (in an export or an import): this
/// host's major, and a minor no newer than its own. A newer minor's names pass the linker's
/// semver matching, but its types may not be this host's: it would fail at its first call.
fn check_version(version: &str) -> Result<(), LoadError> {
    let (major, minor, _) = parse_version(WIT_VERSION).expect("WIT_VERSION is MAJOR.MINOR.PATCH");
    match parse_version(version) {
        Some((m, n, _)) if m == major && n <= minor => Ok(()),
        Some((m, _, _)) if m == major => Err(LoadError::NewerVersion { found: version.to_string() }),
        _ => Err(LoadError::UnsupportedVersion { found: version.to_string() }),
    }
}

/// An archived translator's export: of a version that has it, and its `translate` of the one
/// signature the host calls (the typed worlds' bindings check theirs when the module loads).
fn check_archived_export(engine: &wasmtime::Engine, version: &str, item: &ComponentItem) -> Result<(), String> {
    if parse_version(version).is_some_and(|(major, minor, _)| major == 1 && minor < 2) {
        return Err(format!("the archived service translator exists since {WIT_PACKAGE}@1.2.0, not {version}"));
    }
    let expected = "expected `translate: func(input: list<u8>) -> list<u8>`";
    let ComponentItem::ComponentInstance(instance) = item else {
        return Err(format!("it is not an interface; {expected}"));
    };
    let Some(ComponentItem::ComponentFunc(func)) = instance.get_export(engine, "translate").map(|e| e.ty) else {
        return Err(format!("it has no function `translate`; {expected}"));
    };
    let bytes = |ty: &Type| matches!(ty, Type::List(list) if list.ty() == Type::U8);
    let params: Vec<Type> = func.params().map(|(_, ty)| ty).collect();
    let results: Vec<Type> = func.results().collect();
    if func.async_() || !matches!(params.as_slice(), [p] if bytes(p)) || !matches!(results.as_slice(), [r] if bytes(r))
    {
        let describe = |types: &[Type]| types.iter().map(crate::validation::describe).collect::<Vec<_>>().join(", ");
        return Err(format!("`translate` is `func({}) -> ({})`; {expected}", describe(&params), describe(&results)));
    }
    Ok(())
}

/// What a component may export for its kind, for an error that names none of them.
fn expected_exports() -> Vec<String> {
    let kinds = GuestKind::ALL.iter().map(|k| k.interface());
    kinds.chain([ARCHIVED_TRANSLATOR]).map(|i| format!("{WIT_PACKAGE}/{i}")).collect()
}

/// The interfaces of the package a component may import.
fn granted_interface(iface: &str) -> bool {
    matches!(iface, "types" | "log" | "lookups" | "settings")
}

/// What [`Runtime::load`] would report of a component (kind, WIT version, size, imports, digest),
/// read from its top-level import and export sections without compiling it: for a module
/// listed where it never runs (the builtin GC guest on an agent). Checks no more than that and
/// the package versions it names (as loading does: its one caller lists a guest of this build,
/// never a stored module, so a refusal hides nothing): loading it may still fail.
pub fn describe(bytes: &[u8]) -> Result<ModuleInfo, LoadError> {
    check_header(bytes)?;
    let malformed = |e: wasmparser::BinaryReaderError| LoadError::Compile(format!("reading the component: {e}"));
    let (mut found, mut exports, mut imports) = (None, Vec::new(), Vec::new());
    // Nested modules and components have sections of their own: only depth 0 is the component's.
    let mut depth = 0usize;
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        match payload.map_err(malformed)? {
            wasmparser::Payload::ModuleSection { .. } | wasmparser::Payload::ComponentSection { .. } => depth += 1,
            wasmparser::Payload::End(_) => depth = depth.saturating_sub(1),
            wasmparser::Payload::ComponentImportSection(section) if depth == 0 => {
                for import in section {
                    imports.push(import.map_err(malformed)?.name.name.to_string());
                }
            }
            wasmparser::Payload::ComponentExportSection(section) if depth == 0 => {
                for export in section {
                    let name = export.map_err(malformed)?.name.name;
                    if let Some((SETTINGS_VALIDATION, version)) = split_name(name) {
                        check_version(version)?;
                    } else if let Some((iface, version)) = split_name(name)
                        && let Some(kind) = GuestKind::of_export(iface)
                    {
                        found = Some((kind, iface.to_string(), version.to_string()));
                    }
                    exports.push(name.to_string());
                }
            }
            _ => {}
        }
    }
    let Some((kind, iface, wit_version)) = found else {
        return Err(LoadError::UnknownWorld { exports, expected: expected_exports() });
    };
    check_version(&wit_version)?;
    for (_, version) in imports.iter().filter_map(|i| split_name(i)).filter(|(iface, _)| granted_interface(iface)) {
        check_version(version)?;
    }
    let interface = (iface != kind.interface()).then_some(iface);
    Ok(ModuleInfo { digest: digest(bytes), kind, interface, wit_version, size: bytes.len(), imports })
}

impl Runtime {
    /// Validates and compiles `bytes`. `expected`: the kind the uploader declared.
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        expected: Option<GuestKind>,
        max_size: usize,
    ) -> Result<LoadedModule, LoadError> {
        let checked = self.checked(bytes, expected, max_size)?;
        let pre = checked.instance_pre(self)?;
        let validator = SettingsValidator::find(&pre, checked.settings_validation.as_deref());
        let info = checked.info;
        let runner = match info.kind {
            GuestKind::ServiceTranslator if wit_1_0::is_1_0(&info.wit_version) => {
                let export = format!("{WIT_PACKAGE}/{}@{}", GuestKind::ServiceTranslator, info.wit_version);
                Runner::ServiceTranslator1_0(
                    wit_1_0::Export::find(&pre, &export, "translate")
                        .ok_or_else(|| LoadError::Link(format!("{export} exports no `translate`")))?,
                )
            }
            GuestKind::ServiceTranslator if info.interface.as_deref() == Some(ARCHIVED_TRANSLATOR) => {
                let export = format!("{WIT_PACKAGE}/{ARCHIVED_TRANSLATOR}@{}", info.wit_version);
                Runner::ArchivedServiceTranslator(
                    ArchivedExport::find(&pre, &export)
                        .ok_or_else(|| LoadError::Link(format!("{export} exports no `translate`")))?,
                )
            }
            GuestKind::ServiceTranslator => Runner::ServiceTranslator(
                ServiceTranslationPre::new(pre).map_err(|e| LoadError::Link(format!("{e:#}")))?,
            ),
            other => return Err(LoadError::KindNotRunnable(other)),
        };
        Ok(LoadedModule {
            info,
            name: Arc::from(name),
            runner,
            sandbox: self.sandbox(),
            settings: Arc::from(crate::host::NO_SETTINGS),
            validator,
        })
    }

    /// Every check a module of any kind passes (size, header, a known world of a supported
    /// version, the declared kind, granted imports only, an optional settings validator of
    /// the one signature the host calls) and its compiled form.
    pub(crate) fn checked(
        &self,
        bytes: &[u8],
        expected: Option<GuestKind>,
        max_size: usize,
    ) -> Result<Checked, LoadError> {
        if bytes.len() > max_size {
            return Err(LoadError::TooLarge { size: bytes.len(), max: max_size });
        }
        check_header(bytes)?;
        let digest = digest(bytes);
        let component = self.compile_cached(&digest, bytes)?;
        let ty = component.component_type();

        let mut found = None;
        let mut settings_validation = None;
        let mut exports = Vec::new();
        for (export, item) in ty.exports(self.engine()) {
            exports.push(export.to_string());
            if let Some((SETTINGS_VALIDATION, version)) = split_name(export) {
                check_version(version)?;
                crate::validation::check_export(self.engine(), &item.ty)
                    .map_err(|reason| LoadError::SettingsValidation { export: export.to_string(), reason })?;
                settings_validation = Some(export.to_string());
                continue;
            }
            if let (Some((iface, version)), ComponentItem::ComponentInstance(_)) = (split_name(export), &item.ty)
                && let Some(kind) = GuestKind::of_export(iface)
            {
                if iface == ARCHIVED_TRANSLATOR {
                    check_archived_export(self.engine(), version, &item.ty)
                        .map_err(|reason| LoadError::Link(format!("{export}: {reason}")))?;
                }
                found = Some((kind, iface.to_string(), version.to_string()));
            }
        }
        let Some((kind, iface, version)) = found else {
            return Err(LoadError::UnknownWorld { exports, expected: expected_exports() });
        };
        check_version(&version)?;
        if let Some(declared) = expected
            && declared != kind
        {
            return Err(LoadError::KindMismatch { declared, found: kind });
        }
        let mut imports = Vec::new();
        for (import, _) in ty.imports(self.engine()) {
            match split_name(import) {
                _ if import.starts_with("wasi:") => {}
                Some((iface, version)) if granted_interface(iface) => check_version(version)?,
                _ => return Err(LoadError::ForbiddenImport(import.to_string())),
            }
            imports.push(import.to_string());
        }
        let interface = (iface != kind.interface()).then_some(iface);
        Ok(Checked {
            component,
            info: ModuleInfo { digest, kind, interface, wit_version: version, size: bytes.len(), imports },
            settings_validation,
        })
    }

    /// Loads the machine code compiled earlier for the same bytes and engine, or compiles.
    fn compile_cached(&self, digest: &str, bytes: &[u8]) -> Result<Component, LoadError> {
        let Some(dir) = &self.cache_dir else {
            return self.load_code(&self.compile(bytes)?);
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.engine().precompile_compatibility_hash().hash(&mut hasher);
        let path = dir.join(format!("{}-{:016x}.cwasm", digest.trim_start_matches("sha256:"), hasher.finish()));
        if path.exists() {
            // SAFETY: the cache directory is written only by this host (below), from components
            // it compiled itself with a compatible engine; the file name binds both.
            match unsafe { Component::deserialize_file(self.engine(), &path) } {
                Ok(component) => return Ok(component),
                Err(e) => tracing::warn!(path = %path.display(), "discarding unusable compiled module: {e:#}"),
            }
        }
        let code = self.compile(bytes)?;
        match write_atomically(&path, &code) {
            // Loaded from the file, as every later start loads it: mapped rather than copied
            // into anonymous memory, so the 1.2 MiB of the default guests' code is clean page
            // cache the kernel can reclaim and share, not memory only swap could free
            // (BENCHMARKS.md, eleventh run; RSS is the same).
            // SAFETY: as above; this host wrote the file just now.
            Ok(()) => match unsafe { Component::deserialize_file(self.engine(), &path) } {
                Ok(component) => return Ok(component),
                Err(e) => tracing::warn!(path = %path.display(), "loading the compiled module just cached: {e:#}"),
            },
            Err(e) => tracing::warn!(path = %path.display(), "could not cache compiled module: {e}"),
        }
        self.load_code(&code)
    }

    /// Compiles in a child process (when configured) or on a throwaway engine of the same
    /// configuration, and loads the result into the host's. Cranelift keeps its scratch state
    /// (register allocator and arena buffers, ~20 MiB after the three default guests) with the
    /// engine that compiled: on the host's engine it stayed for the life of the process.
    /// Returns the machine code (a serialized component).
    fn compile(&self, bytes: &[u8]) -> Result<Vec<u8>, LoadError> {
        let code = match &self.compiler {
            Some(command) => command.compile(bytes, self.limits()).map_err(LoadError::Compile)?,
            None => {
                let compiler = wasmtime::Engine::new(&crate::engine_config(self.limits()))
                    .map_err(|e| LoadError::Compile(format!("{e:#}")))?;
                let code = compiler.precompile_component(bytes).map_err(|e| LoadError::Compile(format!("{e:#}")))?;
                drop(compiler);
                crate::release_free_memory();
                code
            }
        };
        Ok(code)
    }

    /// Loads machine code `compile` returned into the host's engine.
    fn load_code(&self, code: &[u8]) -> Result<Component, LoadError> {
        // SAFETY: `code` was compiled just now by an engine of this configuration: in this
        // process, or by the host's own binary in a child (`compiler.rs`). wasmtime checks the
        // artifact's header against this engine and refuses a mismatch.
        unsafe { Component::deserialize(self.engine(), code) }.map_err(|e| LoadError::Compile(format!("{e:#}")))
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write as _;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    // Synced before the rename: after a crash the name holds the whole file or nothing, and the
    // pages the host then maps are clean page cache, which the kernel can reclaim when the host
    // hands its start-up code back (the host's `memory::page_out_code`); dirty ones it keeps.
    let write = || {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| e.to_string())
}

impl LoadedModule {
    /// The digest a module with these bytes gets (`sha256:<hex>`).
    pub fn digest_of(bytes: &[u8]) -> String {
        digest(bytes)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The settings its guests read (a JSON document; `{}` until set).
    pub fn with_settings(mut self, settings: &str) -> Self {
        self.set_settings(settings);
        self
    }

    /// [`with_settings`](Self::with_settings) in place: for sessions made after it.
    pub fn set_settings(&mut self, settings: &str) {
        self.settings = Arc::from(settings);
    }

    /// The settings its sessions give their guests.
    pub fn settings(&self) -> &Arc<str> {
        &self.settings
    }

    /// What the module's own `settings-validation` export says of `settings` (a JSON
    /// document), on a fresh instance under the runtime's limits; a trap or a broken limit
    /// is an error, not a verdict.
    pub fn validate_settings(&self, settings: &str) -> Result<SettingsVerdict, CallError> {
        crate::validation::verdict(self.validator.as_ref(), &self.sandbox, &self.name, settings)
    }

    /// A session running service translations; fails if this is another kind.
    pub fn translator(&self, lookups: Arc<dyn Lookups>) -> Option<TranslatorSession> {
        let capabilities = crate::host::Capabilities { lookups, settings: self.settings.clone() };
        let (sandbox, name) = (self.sandbox.clone(), self.name.clone());
        Some(TranslatorSession {
            context: None,
            parsed_context: None,
            translator: match &self.runner {
                Runner::ServiceTranslator(pre) => {
                    Translator::Current { pre: pre.clone(), slot: GuestSlot::new(sandbox, name, capabilities) }
                }
                Runner::ServiceTranslator1_0(export) => {
                    Translator::V1_0 { export: export.clone(), slot: GuestSlot::new(sandbox, name, capabilities) }
                }
                Runner::ArchivedServiceTranslator(export) => {
                    Translator::Archived { export: export.clone(), slot: GuestSlot::new(sandbox, name, capabilities) }
                }
            },
        })
    }
}

/// Runs translations on one instance, reused across calls until a call fails (a trapped
/// instance cannot be entered again, so the next call gets a fresh one).
pub struct TranslatorSession {
    translator: Translator,
    /// The node context of the last call, as the model has it and in WIT form: it changes
    /// rarely, and a full sync translates every service with the same one.
    context: Option<(NodeContext, wit::NodeContext)>,
    /// The same for an archived translator: its addresses parsed.
    parsed_context: Option<ParsedContext>,
}

/// What a translator returned, checked against the limits (and for an archive, its layout).
pub enum Translated {
    Typed(wit::Ruleset),
    Archived(ArchivedOutput),
}

impl Translated {
    /// The ruleset in the typed world's terms (an archive's names made from its inputs).
    pub fn into_typed(self) -> Result<wit::Ruleset, CallError> {
        match self {
            Translated::Typed(ruleset) => Ok(ruleset),
            Translated::Archived(output) => output.to_typed().map_err(CallError::InvalidOutput),
        }
    }
}

/// `context` in WIT form, converted again only when it differs from the cached one.
fn cached_context<'c>(
    cache: &'c mut Option<(NodeContext, wit::NodeContext)>,
    context: &NodeContext,
) -> &'c wit::NodeContext {
    if cache.as_ref().is_none_or(|(model, _)| model != context) {
        *cache = Some((context.clone(), convert::node_context(context)));
    }
    &cache.as_ref().expect("filled above").1
}

/// A translator of this host's WIT version, of 1.0 (`wit_1_0.rs`), or an archived one
/// (`archived.rs`).
enum Translator {
    Current { pre: ServiceTranslationPre<GuestState>, slot: GuestSlot<ServiceTranslation> },
    V1_0 { export: wit_1_0::Export<wit_1_0::Translate>, slot: GuestSlot<wit_1_0::Checked<wit_1_0::Translate>> },
    Archived { export: ArchivedExport, slot: GuestSlot<Func> },
}

impl TranslatorSession {
    /// Instantiates now rather than on the first call (benchmarks, warm-up).
    pub fn instantiate_now(&mut self) -> Result<(), CallError> {
        match &mut self.translator {
            Translator::Current { pre, slot } => slot.instantiate_now(|store| pre.instantiate(store)),
            Translator::V1_0 { export, slot } => slot.instantiate_now(|store| export.instantiate(store)),
            Translator::Archived { export, slot } => slot.instantiate_now(|store| export.instantiate(store)),
        }
    }

    /// Translates one service, in the typed world's terms. On any error but the guest's own
    /// the instance is dropped.
    pub fn translate(
        &mut self,
        context: &NodeContext,
        chain_prefix: &str,
        view: &ServiceView,
    ) -> Result<wit::Ruleset, CallError> {
        self.translate_output(context, chain_prefix, view)?.into_typed()
    }

    /// Translates one service: what the guest returned, checked; an archived translator's
    /// result stays an archive, which the dataplane reads in place.
    pub fn translate_output(
        &mut self,
        context: &NodeContext,
        chain_prefix: &str,
        view: &ServiceView,
    ) -> Result<Translated, CallError> {
        if let Translator::Archived { export, slot } = &mut self.translator {
            let parsed = ParsedContext::cached(&mut self.parsed_context, context);
            let input = archived::encode(parsed, chain_prefix, view)?;
            return call_archived(export, slot, input);
        }
        let service = convert::service(&view.service);
        let slices = convert::slices(view);
        // Out of the session for the call, which borrows it whole.
        let mut cache = self.context.take();
        let result = self.translate_wit(cached_context(&mut cache, context), chain_prefix, &service, &slices);
        self.context = cache;
        result
    }

    /// Like [`translate_output`](Self::translate_output) with inputs already in WIT form (a
    /// recording's). An archived translator is given them archived, through the model's types.
    pub fn translate_wit(
        &mut self,
        ctx: &wit::NodeContext,
        chain_prefix: &str,
        service: &wit::Service,
        slices: &[wit::EndpointSlice],
    ) -> Result<Translated, CallError> {
        match &mut self.translator {
            Translator::Current { pre, slot } => slot
                .call(
                    |store| pre.instantiate(store),
                    |bindings, store| {
                        bindings.wasmplane_dataplane_service_translator().call_translate(
                            store,
                            ctx,
                            chain_prefix,
                            service,
                            slices,
                        )
                    },
                    accept_ruleset,
                )
                .map(Translated::Typed),
            Translator::V1_0 { export, slot } => slot
                .call(
                    |store| export.instantiate(store),
                    |func, store| func.call(store, (ctx, chain_prefix, service, slices)),
                    accept_ruleset,
                )
                .map(Translated::Typed),
            Translator::Archived { export, slot } => {
                let (context, view) = (convert::node_context_from_wit(ctx), convert::view_from_wit(service, slices));
                let parsed = ParsedContext::cached(&mut self.parsed_context, &context);
                let input = archived::encode(parsed, chain_prefix, &view)?;
                call_archived(export, slot, input)
            }
        }
    }
}

/// One call of an archived translator with `input`, its result checked (a result that does
/// not check drops the instance, as a trap does).
fn call_archived(export: &ArchivedExport, slot: &mut GuestSlot<Func>, input: Vec<u8>) -> Result<Translated, CallError> {
    let output = slot.call(
        |store| export.instantiate(store),
        |func, store| {
            // SAFETY: the type was checked when this instance was made (`ArchivedExport::instantiate`).
            let typed: ArchivedTranslate<'_> = unsafe { TypedFunc::new_unchecked(*func) };
            typed.call(store, (&input,)).map(|(output,)| output)
        },
        ArchivedOutput::check,
    )?;
    Ok(Translated::Archived(ArchivedOutput::checked(input, output)))
}

/// Counts the objects and string bytes a call returned.
pub fn output_cost(r: &wit::Ruleset) -> (usize, usize) {
    let mut objects = r.chains.len() + r.sets.len() + r.map_elements.len() + r.warnings.len();
    let mut bytes = r.warnings.iter().map(String::len).sum::<usize>();
    for chain in &r.chains {
        objects += chain.rules.len();
        bytes += chain.name.len();
        for rule in &chain.rules {
            objects += rule.matches.len() + rule.statements.len();
            bytes += rule.comment.as_ref().map_or(0, String::len) + 16;
        }
    }
    for set in &r.sets {
        objects += set.elements.len();
        bytes += set.name.len() + set.elements.iter().map(String::len).sum::<usize>();
    }
    for e in &r.map_elements {
        bytes += e.map_name.len() + 8 * e.key.len() + 16;
    }
    (objects, bytes)
}

/// What a translator or policy guest returned: its ruleset within the size limits, or its
/// own error (which keeps the instance), cut to 1 KiB.
pub(crate) fn accept_ruleset(
    result: Result<wit::Ruleset, wit::GuestError>,
    limits: &Limits,
) -> Result<wit::Ruleset, CallError> {
    match result {
        Ok(ruleset) => check_ruleset_size(&ruleset, limits).map(|_| ruleset),
        Err(guest_error) => Err(CallError::Guest(guest_error.message.chars().take(1024).collect())),
    }
}

/// A ruleset (translator or policy output) against the size limits.
fn check_ruleset_size(r: &wit::Ruleset, limits: &Limits) -> Result<(), CallError> {
    let (objects, bytes) = output_cost(r);
    check_output_size(objects, bytes, "objects", limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_up_to_the_hosts_minor_are_accepted() {
        for ok in ["1.0.0", "1.1.0", "1.1.7", "1.2.0"] {
            assert_eq!(check_version(ok), Ok(()), "{ok}");
        }
        assert_eq!(check_version("1.3.0"), Err(LoadError::NewerVersion { found: "1.3.0".into() }));
        for refused in ["2.0.0", "0.9.0", "1.1", "1.x.0", "1.1.0-rc.1", "1.1.0+build", "1.+1.0", "", "1.1.0.0"] {
            assert_eq!(
                check_version(refused),
                Err(LoadError::UnsupportedVersion { found: refused.into() }),
                "{refused}"
            );
        }
        assert!(
            LoadError::NewerVersion { found: "1.3.0".into() }.to_string().contains("build it against 1.2 or older")
        );
    }

    /// The WIT node context is converted once and again only when the model's changes.
    #[test]
    fn the_node_context_is_converted_again_only_when_it_changes() {
        let a = NodeContext {
            node_name: "node-a".into(),
            node_ips: vec!["192.168.0.1".into()],
            cluster_cidrs: vec!["10.244.0.0/16".into()],
            ..Default::default()
        };
        let mut cache = None;
        assert_eq!(*cached_context(&mut cache, &a), convert::node_context(&a));
        // A marked conversion in the cache: what comes back for the same context is it.
        let marked = wit::NodeContext { node_name: "marked".into(), ..convert::node_context(&a) };
        cache = Some((a.clone(), marked.clone()));
        assert_eq!(*cached_context(&mut cache, &a.clone()), marked, "the same context: the cached conversion");
        for changed in [
            NodeContext { node_ips: vec!["192.168.0.2".into()], ..a.clone() },
            NodeContext { cluster_cidrs: vec![], ..a.clone() },
            NodeContext { pod_cidrs: vec!["10.244.1.0/24".into()], ..a.clone() },
            NodeContext { node_name: "node-b".into(), ..a.clone() },
        ] {
            assert_eq!(*cached_context(&mut cache, &changed), convert::node_context(&changed), "{changed:?}");
        }
    }
}
