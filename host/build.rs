//! Link options that make the release `wasmplane` binary cost less memory where it runs
//! (BENCHMARKS.md, "Eleventh run": 21.9 → 14.6 MiB RSS at 10 services, the same saving at
//! every size).
//!
//! - **The code it runs, placed first and together.** `symbol-order.txt` names the functions
//!   a traced `wasmplane` ran (initial sync, changes, churn and scrapes against a synthetic
//!   1k-service cluster: `wasmplane-perf --symbol-order host/symbol-order.txt --binary
//!   target/release/wasmplane`). The kernel maps the cached neighbours of every code page a
//!   process faults in, so with hot code spread over the binary most of its text ends up
//!   resident. Names this build does not have are skipped: mangled names carry hashes of the
//!   toolchain and of each crate's resolved features and dependencies, so another toolchain
//!   or lockfile only lays the binary out less well. Regenerate the file when those change.
//!   `WASMPLANE_SYMBOL_ORDER=0` turns it off, `=PATH` uses another file.
//! - **Packed relative relocations** (DT_RELR, glibc 2.36 and later): the dynamic loader
//!   reads 0.9 MiB of `.rela.dyn` at every start, and those pages stay resident; packed,
//!   they are 16 KiB.
//!
//! Both only where lld links by default (x86_64 Linux, Rust 1.90 and later) and no other
//! linker is configured.

use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-env-changed=WASMPLANE_SYMBOL_ORDER");
    let env = |name: &str| std::env::var(name).unwrap_or_default();
    let custom_linker = std::env::var_os("RUSTC_LINKER").is_some() || env("CARGO_ENCODED_RUSTFLAGS").contains("link");
    if env("PROFILE") != "release" || env("TARGET") != "x86_64-unknown-linux-gnu" || custom_linker || !rustc_links_with_lld() {
        return;
    }
    if glibc_has_relr() {
        println!("cargo::rustc-link-arg-bin=wasmplane=-Wl,-z,pack-relative-relocs");
    }
    let order = match std::env::var("WASMPLANE_SYMBOL_ORDER") {
        Ok(v) if v == "0" => return,
        Ok(path) => PathBuf::from(path),
        Err(_) => PathBuf::from(env("CARGO_MANIFEST_DIR")).join("symbol-order.txt"),
    };
    println!("cargo::rerun-if-changed={}", order.display());
    if order.is_file() {
        println!("cargo::rustc-link-arg-bin=wasmplane=-Wl,--symbol-ordering-file={}", order.display());
        println!("cargo::rustc-link-arg-bin=wasmplane=-Wl,--no-warn-symbol-ordering");
    }
}

/// Rust 1.90 made lld the default linker on x86_64-unknown-linux-gnu.
fn rustc_links_with_lld() -> bool {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    // "rustc 1.95.0 (59807616e 2026-04-14)"
    version_of(&rustc, "--version").is_some_and(|v| v >= (1, 90))
}

/// Whether the C library here loads packed relative relocations. The binary runs where it is
/// built, or in the image, whose base is the build stage's.
fn glibc_has_relr() -> bool {
    // "glibc 2.36"
    version_of("getconf", "GNU_LIBC_VERSION").is_some_and(|v| v >= (2, 36))
}

/// (major, minor) from the second word of what `program arg` prints.
fn version_of(program: &str, arg: &str) -> Option<(u32, u32)> {
    let out = std::process::Command::new(program).arg(arg).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text.split_whitespace().nth(1)?.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}
