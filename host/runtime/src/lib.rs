//! wasmplane's Wasm runtime.
//!
//! One [`Runtime`] owns one wasmtime [`Engine`] (pooling allocator, epoch interruption) and a
//! linker with exactly the capabilities a guest may import. [`Runtime::load`] validates and
//! compiles a component (cached on disk by content hash) into a [`LoadedModule`] holding an
//! `InstancePre`; guest calls go through short-lived sessions with per-call limits:
//!
//! - time: an epoch deadline (a ticker thread advances the epoch every [`EPOCH_TICK`]);
//! - memory: a resource limiter capping linear memory and tables;
//! - output: a cap on the size of what a call returns.
//!
//! A guest that breaks a limit or traps is stopped with a [`CallError`]; the host stays up.
//! A module of any kind may also export `settings-validation` (optional): its
//! `validate_settings` says whether it accepts a settings document ([`SettingsVerdict`]).
//! WASI is linked with an empty context: no preopened directories, environment, arguments,
//! network or stdio, and clocks that stand still, unless a module is granted more.

pub mod archived;
mod bindings;
pub mod compiler;
pub mod convert;
mod epoch;
pub mod gc;
mod host;
mod loader;
#[cfg(feature = "native-translator")]
pub mod native;
pub mod policy;
mod validation;
mod wit_1_0;

use std::path::PathBuf;
use std::time::Duration;

use wasmtime::component::Linker;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

pub use bindings::service::wasmplane::dataplane::types as wit;
pub use compiler::CompilerCommand;
pub use host::{GuestState, Lookups, NO_SETTINGS, NoLookups};
pub use loader::{GuestKind, LoadError, LoadedModule, ModuleInfo, WIT_PACKAGE, WIT_VERSION, describe};
pub use validation::{SETTINGS_VALIDATION, SettingsCheck, SettingsVerdict};

/// How often the epoch advances; deadlines are whole ticks.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Address space reserved per guest memory: all a 32-bit memory can address, wasmtime's own
/// default. `engine_config` says why.
const GUEST_MEMORY_RESERVATION: u64 = 4 << 30;

/// Per-call sandbox limits.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Wall-clock budget of one guest call.
    pub call_timeout: Duration,
    /// Maximum linear memory of one guest instance.
    pub memory_bytes: usize,
    /// Maximum table elements of one guest instance.
    pub table_elements: usize,
    /// Maximum size of one call's output, in rules + elements + declared objects.
    pub max_output_objects: usize,
    /// Maximum total bytes of strings in one call's output.
    pub max_output_bytes: usize,
    /// Instances alive at once (pool size).
    pub max_instances: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            call_timeout: Duration::from_millis(500),
            memory_bytes: 64 << 20,
            table_elements: 20_000,
            max_output_objects: 100_000,
            max_output_bytes: 16 << 20,
            max_instances: 64,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("configuring the Wasm engine: {0}")]
    Engine(String),
}

/// Why a guest call produced no usable output.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CallError {
    #[error("guest exceeded its time limit of {0:?}")]
    Timeout(Duration),
    #[error("guest exceeded its memory limit of {0} bytes")]
    MemoryLimit(usize),
    #[error("guest trapped: {0}")]
    Trap(String),
    #[error("guest returned an error: {0}")]
    Guest(String),
    #[error("guest output too large: {0}")]
    OutputTooLarge(String),
    #[error("instantiating the guest failed: {0}")]
    Instantiate(String),
    /// The host refused the inputs before the call (an archived translator is given only
    /// addresses that parse).
    #[error("{0}")]
    Input(String),
    /// An archived translator's result that does not check (its bytes, or a number naming
    /// nothing).
    #[error("invalid guest output: {0}")]
    InvalidOutput(String),
}

/// The Wasm engine and everything shared by all modules.
pub struct Runtime {
    /// The engine, its deadline clock and the limits, shared with every module and session.
    sandbox: host::Sandbox,
    linker: Linker<GuestState>,
    cache_dir: Option<PathBuf>,
    /// Compiles in a child process when set (`compiler.rs`); in this one otherwise.
    compiler: Option<CompilerCommand>,
}

/// The engine configuration for `limits`. Compiling and running engines must agree on it: the
/// compiled code depends on it (bounds checks follow the memory reservation). Public for
/// what must run a component exactly as the host would outside a [`Runtime`] (the runtime
/// bench's serialized-boundary guest).
pub fn engine_config(limits: &Limits) -> Config {
    let mut pool = PoolingAllocationConfig::default();
    pool.total_component_instances(limits.max_instances)
        .total_core_instances(limits.max_instances * 8)
        .total_memories(limits.max_instances * 2)
        .total_tables(limits.max_instances * 4)
        .max_memory_size(limits.memory_bytes)
        .table_elements(limits.table_elements)
        .total_stacks(limits.max_instances);
    let mut config = Config::new();
    config
        .wasm_component_model(true)
        .epoch_interruption(true)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
        // A 32-bit memory inside 4 GiB of reserved address space (plus the guard) needs no
        // bounds check on any load or store: page faults catch what is out of bounds. That is
        // address space, not memory: the memory limit is `max_memory_size` above. Measured
        // (runtime bench): the default translator's own work goes from 1.3× native to
        // 1.0×; with a reservation of the memory limit alone, every access is checked.
        .memory_reservation(GUEST_MEMORY_RESERVATION);
    config
}

impl Runtime {
    /// `cache_dir`: where compiled components are kept between runs (`None`: no disk cache).
    pub fn new(limits: Limits, cache_dir: Option<PathBuf>) -> Result<Runtime, RuntimeError> {
        // The host's engine only loads code compiled elsewhere (a throwaway engine or a child
        // process, `loader.rs`), so it is built without a compiler: Cranelift's ISA and
        // settings are never set up in the host.
        let mut config = engine_config(&limits);
        config.enable_compiler(false);
        let engine = Engine::new(&config).map_err(|e| RuntimeError::Engine(format!("{e:#}")))?;
        let linker = host::linker(&engine).map_err(|e| RuntimeError::Engine(format!("{e:#}")))?;
        if let Some(dir) = &cache_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| RuntimeError::Engine(format!("creating {}: {e}", dir.display())))?;
        }
        let ticker = epoch::EpochTicker::start(engine.clone())
            .map_err(|e| RuntimeError::Engine(format!("starting the epoch ticker: {e}")))?;
        Ok(Runtime { sandbox: host::Sandbox { engine, ticker, limits }, linker, cache_dir, compiler: None })
    }

    /// How many times the epoch has advanced: it does only while guest code runs
    /// (`epoch.rs`), about once per [`EPOCH_TICK`].
    pub fn epoch_ticks(&self) -> u64 {
        self.sandbox.ticker.ticks()
    }

    /// Compiles components with `command` in a child process from now on (`compiler.rs`).
    pub fn compile_in_child(mut self, command: CompilerCommand) -> Runtime {
        self.compiler = Some(command);
        self
    }

    pub(crate) fn sandbox(&self) -> host::Sandbox {
        self.sandbox.clone()
    }

    pub fn engine(&self) -> &Engine {
        &self.sandbox.engine
    }

    pub fn limits(&self) -> &Limits {
        &self.sandbox.limits
    }
}

/// Returns free heap pages to the kernel: glibc keeps what a burst of large transient
/// allocations freed (a compilation, a full sync) otherwise.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}

pub use archived::ArchivedOutput;
pub use loader::{Translated, TranslatorSession};
