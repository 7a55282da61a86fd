//! The clock behind every guest call's deadline.
//!
//! Guests are stopped by epoch interruption: a call may run until the engine's epoch passes
//! its deadline, and a thread advances the epoch every [`EPOCH_TICK`]. That thread ticks only
//! while some guest code runs and parks otherwise, so an idle host does not wake 200 times a
//! second for nothing. Deadlines are relative to the epoch when the call starts, which does
//! not move while no guest runs, so parking shortens no deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::Thread;

use wasmtime::Engine;

use crate::EPOCH_TICK;

#[derive(Default)]
struct Shared {
    /// Guest calls (and instantiations) in progress.
    running: AtomicUsize,
    stop: AtomicBool,
    ticks: AtomicU64,
}

/// The ticking thread of one engine. It stops when the last handle (the runtime, its
/// modules and their sessions) is dropped.
pub(crate) struct EpochTicker {
    shared: Arc<Shared>,
    thread: Thread,
}

impl EpochTicker {
    pub(crate) fn start(engine: Engine) -> std::io::Result<Arc<EpochTicker>> {
        let shared = Arc::new(Shared::default());
        let state = shared.clone();
        let handle = std::thread::Builder::new().name("wasm-epoch".into()).spawn(move || {
            while !state.stop.load(Ordering::Acquire) {
                if state.running.load(Ordering::Acquire) == 0 {
                    // `running` unparks: a wake-up that comes before this park is not lost.
                    std::thread::park();
                    continue;
                }
                std::thread::sleep(EPOCH_TICK);
                engine.increment_epoch();
                state.ticks.fetch_add(1, Ordering::Relaxed);
            }
        })?;
        Ok(Arc::new(EpochTicker { shared, thread: handle.thread().clone() }))
    }

    /// Keeps the epoch advancing until the guard is dropped: held around anything that runs
    /// guest code (instantiation and calls). The guard holds the ticker itself, so a session
    /// may take it and then borrow itself mutably for the call.
    pub(crate) fn running(self: &Arc<Self>) -> Running {
        if self.shared.running.fetch_add(1, Ordering::AcqRel) == 0 {
            self.thread.unpark();
        }
        Running(self.clone())
    }

    /// How many times the epoch has advanced.
    pub(crate) fn ticks(&self) -> u64 {
        self.shared.ticks.load(Ordering::Relaxed)
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// See [`EpochTicker::running`].
pub(crate) struct Running(Arc<EpochTicker>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.shared.running.fetch_sub(1, Ordering::AcqRel);
    }
}
