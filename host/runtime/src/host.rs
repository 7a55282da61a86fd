//! The store state of a guest and the capabilities the host links for it.
//!
//! Each capability is one WIT interface with its host implementation here: `log` (tracing),
//! `lookups` (read-only queries of the node-local model) and `settings` (the module's own). WASI is linked only so that
//! guests built with Rust's std instantiate; its context grants nothing.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker, ResourceTable};
use wasmtime::{Engine, ResourceLimiter};
use wasmtime_wasi::{Deterministic, HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView};

use crate::bindings::service::ServiceTranslation;
use crate::bindings::service::wasmplane::dataplane::{log, lookups, settings, types as wit};
use crate::convert;

/// Read-only queries a guest granted `lookups` may make of the node-local model.
pub trait Lookups: Send + Sync {
    fn pods_matching(
        &self,
        namespace: Option<&str>,
        namespace_selector: Option<&wasmplane_model::LabelSelector>,
        pod_selector: &wasmplane_model::LabelSelector,
    ) -> Vec<wasmplane_model::Pod>;
    fn namespace(&self, name: &str) -> Option<wasmplane_model::Namespace>;
}

/// Lookups over an empty cluster.
pub struct NoLookups;

impl Lookups for NoLookups {
    fn pods_matching(
        &self,
        _: Option<&str>,
        _: Option<&wasmplane_model::LabelSelector>,
        _: &wasmplane_model::LabelSelector,
    ) -> Vec<wasmplane_model::Pod> {
        Vec::new()
    }
    fn namespace(&self, _: &str) -> Option<wasmplane_model::Namespace> {
        None
    }
}

/// Caps memory and tables; remembers a denial so the error names the real cause.
pub(crate) struct GuestLimiter {
    pub memory_bytes: usize,
    pub table_elements: usize,
    pub memory_exceeded: bool,
}

impl ResourceLimiter for GuestLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            self.memory_exceeded = true;
            return Err(wasmtime::format_err!(
                "memory limit of {} bytes exceeded (wanted {desired})",
                self.memory_bytes
            ));
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= self.table_elements)
    }
}

pub struct GuestState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limiter: GuestLimiter,
    module: Arc<str>,
    lookups: Arc<dyn Lookups>,
    settings: Arc<str>,
}

impl GuestState {
    pub(crate) fn new(
        module: Arc<str>,
        memory_bytes: usize,
        table_elements: usize,
        capabilities: &Capabilities,
        stderr: wasmtime_wasi::p2::pipe::MemoryOutputPipe,
    ) -> Self {
        GuestState {
            wasi: sealed_wasi(stderr),
            table: ResourceTable::new(),
            limiter: GuestLimiter { memory_bytes, table_elements, memory_exceeded: false },
            module,
            lookups: capabilities.lookups.clone(),
            settings: capabilities.settings.clone(),
        }
    }
}

/// What a session's guest instances are given besides their input: the model to look up
/// and the module's settings.
#[derive(Clone)]
pub(crate) struct Capabilities {
    pub lookups: Arc<dyn Lookups>,
    pub settings: Arc<str>,
}

/// Settings of a module none were given for.
pub const NO_SETTINGS: &str = "{}";

/// A clock that stands still at the epoch: guests are pure functions of their input.
struct FrozenClock;

impl HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// WASI granting nothing: no preopens, env, args, stdio or sockets; frozen clocks; a fixed
/// random stream so the same input always gives the same output (hash maps included).
pub(crate) fn sealed_wasi(stderr: wasmtime_wasi::p2::pipe::MemoryOutputPipe) -> WasiCtx {
    WasiCtx::builder()
        // Captured, bounded: Rust panic messages land here and make trap reports readable.
        .stderr(stderr)
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .wall_clock(FrozenClock)
        .monotonic_clock(FrozenClock)
        .secure_random(Deterministic::new(vec![0x5a, 0x17, 0xc3, 0x88]))
        .insecure_random(Deterministic::new(vec![0x42, 0x99, 0x01, 0x7e]))
        .insecure_random_seed(0x5eed)
        .build()
}

impl WasiView for GuestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl log::Host for GuestState {
    fn log(&mut self, level: log::Level, message: String) {
        // Bounded so a chatty guest cannot flood the host's log.
        let message: String = message.chars().take(2048).collect();
        let module = &*self.module;
        match level {
            log::Level::Trace => tracing::trace!(target: "guest", module, "{message}"),
            log::Level::Debug => tracing::debug!(target: "guest", module, "{message}"),
            log::Level::Info => tracing::info!(target: "guest", module, "{message}"),
            log::Level::Warn => tracing::warn!(target: "guest", module, "{message}"),
            log::Level::Error => tracing::error!(target: "guest", module, "{message}"),
        }
    }
}

impl lookups::Host for GuestState {
    fn pods_matching(
        &mut self,
        namespace: Option<String>,
        namespace_selector: Option<wit::LabelSelector>,
        pod_selector: wit::LabelSelector,
    ) -> Vec<wit::Pod> {
        let ns_sel = namespace_selector.map(convert::selector_from_wit);
        let pod_sel = convert::selector_from_wit(pod_selector);
        self.lookups.pods_matching(namespace.as_deref(), ns_sel.as_ref(), &pod_sel).iter().map(convert::pod).collect()
    }

    fn get_namespace(&mut self, name: String) -> Option<wit::Namespace> {
        self.lookups.namespace(&name).map(|n| convert::namespace(&n))
    }
}

impl settings::Host for GuestState {
    fn get(&mut self) -> String {
        self.settings.to_string()
    }
}

impl wit::Host for GuestState {}

pub(crate) fn linker(engine: &Engine) -> wasmtime::Result<Linker<GuestState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    ServiceTranslation::add_to_linker::<_, HasSelf<_>>(&mut linker, |state| state)?;
    Ok(linker)
}

/// Bytes of guest stderr kept for error messages (panic messages land there).
const STDERR_CAPTURE: usize = 4096;

/// A call's time limit in whole epoch ticks.
fn deadline_ticks(limits: &crate::Limits) -> u64 {
    limits.call_timeout.as_nanos().div_ceil(crate::EPOCH_TICK.as_nanos()).max(1) as u64
}

/// A store for one guest instance of any kind: memory limiter, epoch deadline that traps,
/// and the guest's captured stderr.
pub(crate) fn new_store(
    engine: &Engine,
    name: Arc<str>,
    limits: &crate::Limits,
    capabilities: &Capabilities,
) -> (wasmtime::Store<GuestState>, wasmtime_wasi::p2::pipe::MemoryOutputPipe) {
    let stderr = wasmtime_wasi::p2::pipe::MemoryOutputPipe::new(STDERR_CAPTURE);
    let state = GuestState::new(name, limits.memory_bytes, limits.table_elements, capabilities, stderr.clone());
    let mut store = wasmtime::Store::new(engine, state);
    store.limiter(|s| &mut s.limiter);
    store.set_epoch_deadline(deadline_ticks(limits));
    store.epoch_deadline_trap();
    (store, stderr)
}

/// What every module and session of one runtime shares: the engine, the clock behind its
/// deadlines and the limits.
#[derive(Clone)]
pub(crate) struct Sandbox {
    pub engine: Engine,
    pub ticker: Arc<crate::epoch::EpochTicker>,
    pub limits: crate::Limits,
}

/// One guest instance of any kind and its store.
struct LiveInstance<B> {
    store: wasmtime::Store<GuestState>,
    bindings: B,
    stderr: wasmtime_wasi::p2::pipe::MemoryOutputPipe,
}

/// A session's guest instance, reused across calls until one fails (a trapped instance
/// cannot be entered again, so the next call gets a fresh one), and what making one takes.
pub(crate) struct GuestSlot<B> {
    sandbox: Sandbox,
    name: Arc<str>,
    capabilities: Capabilities,
    live: Option<LiveInstance<B>>,
}

impl<B> GuestSlot<B> {
    pub fn new(sandbox: Sandbox, name: Arc<str>, capabilities: Capabilities) -> GuestSlot<B> {
        GuestSlot { sandbox, name, capabilities, live: None }
    }

    /// Instantiates now rather than on the first call (benchmarks, warm-up).
    pub fn instantiate_now(
        &mut self,
        instantiate: impl FnOnce(&mut wasmtime::Store<GuestState>) -> wasmtime::Result<B>,
    ) -> Result<(), crate::CallError> {
        let GuestSlot { sandbox, name, capabilities, live } = self;
        let _ticking = sandbox.ticker.running();
        live_instance(live, sandbox, name, capabilities, instantiate).map(|_| ())
    }

    /// One call under the sandbox's limits (a fresh deadline, the epoch ticking while it
    /// runs); `accept` checks what the guest returned. Any failure but the guest's own error
    /// ([`CallError::Guest`](crate::CallError::Guest)) drops the instance.
    pub fn call<T, U>(
        &mut self,
        instantiate: impl FnOnce(&mut wasmtime::Store<GuestState>) -> wasmtime::Result<B>,
        call: impl FnOnce(&B, &mut wasmtime::Store<GuestState>) -> wasmtime::Result<T>,
        accept: impl FnOnce(T, &crate::Limits) -> Result<U, crate::CallError>,
    ) -> Result<U, crate::CallError> {
        let GuestSlot { sandbox, name, capabilities, live } = self;
        let _ticking = sandbox.ticker.running();
        let instance = live_instance(live, sandbox, name, capabilities, instantiate)?;
        instance.store.set_epoch_deadline(deadline_ticks(&sandbox.limits));
        let outcome = match call(&instance.bindings, &mut instance.store) {
            Ok(value) => accept(value, &sandbox.limits),
            Err(e) => Err(classify(e, &instance.store, &instance.stderr, &sandbox.limits)),
        };
        if matches!(outcome, Err(ref e) if !matches!(e, crate::CallError::Guest(_))) {
            *live = None;
        }
        outcome
    }
}

/// The instance in `slot`, instantiated on a fresh store when there is none.
fn live_instance<'s, B>(
    slot: &'s mut Option<LiveInstance<B>>,
    sandbox: &Sandbox,
    name: &Arc<str>,
    capabilities: &Capabilities,
    instantiate: impl FnOnce(&mut wasmtime::Store<GuestState>) -> wasmtime::Result<B>,
) -> Result<&'s mut LiveInstance<B>, crate::CallError> {
    if slot.is_none() {
        let (mut store, stderr) = new_store(&sandbox.engine, name.clone(), &sandbox.limits, capabilities);
        let bindings = instantiate(&mut store).map_err(|e| crate::CallError::Instantiate(format!("{e:#}")))?;
        *slot = Some(LiveInstance { store, bindings, stderr });
    }
    Ok(slot.as_mut().expect("just instantiated"))
}

/// A guest's output against the size limits: `objects` (counted as `unit`) and `bytes`.
pub(crate) fn check_output_size(
    objects: usize,
    bytes: usize,
    unit: &str,
    limits: &crate::Limits,
) -> Result<(), crate::CallError> {
    if objects > limits.max_output_objects || bytes > limits.max_output_bytes {
        return Err(crate::CallError::OutputTooLarge(format!(
            "{objects} {unit} / {bytes} bytes (limits {} / {})",
            limits.max_output_objects, limits.max_output_bytes
        )));
    }
    Ok(())
}

/// Why a guest call failed: its memory limit, its time limit, or a trap (with what the guest
/// wrote to stderr, e.g. a panic message).
fn classify(
    error: wasmtime::Error,
    store: &wasmtime::Store<GuestState>,
    stderr: &wasmtime_wasi::p2::pipe::MemoryOutputPipe,
    limits: &crate::Limits,
) -> crate::CallError {
    use crate::CallError;
    if store.data().limiter.memory_exceeded {
        return CallError::MemoryLimit(limits.memory_bytes);
    }
    if error.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt) {
        return CallError::Timeout(limits.call_timeout);
    }
    let stderr = String::from_utf8_lossy(&stderr.contents()).trim().to_string();
    let root = format!("{error:#}");
    let root = root.lines().next().unwrap_or_default().to_string();
    if stderr.is_empty() { CallError::Trap(root) } else { CallError::Trap(format!("{root}; guest stderr: {stderr}")) }
}
