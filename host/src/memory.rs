//! Process memory with glibc's allocator, which the host's RSS depends on more than on
//! anything it holds (BENCHMARKS.md: up to 15 MiB between runs at 1k services).

/// Caps glibc's malloc arenas at two unless `MALLOC_ARENA_MAX` says otherwise. glibc gives
/// threads that contend their own arena (up to 8 per core) and never returns their free
/// pages; the host's threads (tokio workers, blocking pool, Cranelift's) all allocate.
/// Measured: 8–14 MiB less RSS at 1k services, the same change latency. Call before any
/// thread is started.
pub fn limit_malloc_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// Returns free heap pages to the kernel (after a burst of large transient allocations).
/// The runtime's, which calls it after each compilation.
pub use wasmplane_runtime::release_free_memory;
