//! Link options that make the release `wasmplane` binary cost less memory where it runs
//! (BENCHMARKS.md, "Eleventh run": 21.9 → 14.6 MiB RSS at 10 services, the same saving at
//! every size).
//!
//! - **The code it runs, placed first and together.** `symbol-order.txt` names the functions
//!   a traced `wasmplane` ran (initial sync, changes, churn and scrapes against a synthetic
//!   1k-service cluster: `wasmplane-perf --symbol-order host/symbol-order.txt --binary
//!   target/x86_64-unknown-linux-gnu/release/wasmplane`): those it called after its
//!   start-up first (1.3 MiB of code, counted per function: "Eighteenth run" and
//!   "Twenty-first run"), then the start-up code, which the host pages out once the sync
//!   is applied ("Fifteenth run").
//!   The kernel maps the cached neighbours of every code page a process faults in, so with
//!   hot code spread over the binary most of its text ends up resident.
//!   Names this build does not have are skipped: mangled names carry hashes of the
//!   toolchain and of each crate's resolved features and dependencies, so another toolchain
//!   or lockfile only lays the binary out less well. The file's first line names the build
//!   it was traced from, and a release build of another toolchain or lockfile warns.
//!   `WASMPLANE_SYMBOL_ORDER=0` turns it off, `=PATH` uses another file.
//!   The list is traced from the shipped build, which is static (`deploy/Dockerfile`:
//!   `--target x86_64-unknown-linux-gnu`, `-C target-feature=+crt-static`), so the C
//!   library's functions are laid out with the rest ("Twentieth run"). Naming the target
//!   changes every crate's hash, so a build without `--target` matches few names, and one
//!   that is not static warns.
//! - **Packed relative relocations** (DT_RELR, glibc 2.36 and later): the dynamic loader
//!   reads 0.9 MiB of `.rela.dyn` at every start, and those pages stay resident; packed,
//!   they are 16 KiB.
//!
//! Both only where lld links by default (x86_64 Linux, Rust 1.90 and later) and no other
//! linker is configured.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rerun-if-env-changed=WASMPLANE_SYMBOL_ORDER");
    let env = |name: &str| std::env::var(name).unwrap_or_default();
    let custom_linker = std::env::var_os("RUSTC_LINKER").is_some() || env("CARGO_ENCODED_RUSTFLAGS").contains("link");
    if env("PROFILE") != "release" || env("TARGET") != "x86_64-unknown-linux-gnu" || custom_linker {
        return;
    }
    // "rustc 1.95.0 (59807616e 2026-04-14)"; 1.90 made lld the default linker here.
    let Some(rustc_version) = output(&std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()), "--version") else {
        return;
    };
    if major_minor(&rustc_version).is_none_or(|v| v < (1, 90)) {
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
        if !env("CARGO_CFG_TARGET_FEATURE").split(',').any(|feature| feature == "crt-static") {
            println!(
                "cargo::warning={} was traced from the static build: this dynamic one is laid out less well and maps the C library besides (build as deploy/Dockerfile does: RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build --release --target x86_64-unknown-linux-gnu)",
                order.display()
            );
        }
        warn_if_stale(&order, &rustc_version);
    }
}

/// Warns when the order was traced from a build by another compiler or of another lockfile
/// (its first line, written by `wasmplane-perf --symbol-order`): lld would skip most names
/// without a word, and the binary would lose the layout.
fn warn_if_stale(order: &Path, rustc_version: &str) {
    let lock = Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default()).join("../Cargo.lock");
    println!("cargo::rerun-if-changed={}", lock.display());
    let (Ok(text), Ok(lock)) = (std::fs::read_to_string(order), std::fs::read(&lock)) else { return };
    let this_build = format!("# traced from a build by {rustc_version} of Cargo.lock {:016x} (FNV-1a)", fnv1a(&lock));
    let traced = text.lines().next().unwrap_or_default();
    if traced != this_build {
        println!(
            "cargo::warning={} is from another build (its first line: {traced:?}; this build would write {this_build:?}): the binary may be laid out less well until it is regenerated (BENCHMARKS.md, \"Reproducing\")",
            order.display()
        );
    }
}

/// 64-bit FNV-1a, as `wasmplane-perf` computes it (its test checks the standard vectors).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

/// Whether the C library here loads packed relative relocations. The binary runs where it is
/// built, or in the image, whose base is the build stage's.
fn glibc_has_relr() -> bool {
    // "glibc 2.36"
    output("getconf", "GNU_LIBC_VERSION").and_then(|v| major_minor(&v)).is_some_and(|v| v >= (2, 36))
}

/// What `program arg` prints, trimmed.
fn output(program: &str, arg: &str) -> Option<String> {
    let out = std::process::Command::new(program).arg(arg).output().ok()?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// (major, minor) from the second word of a version line.
fn major_minor(line: &str) -> Option<(u32, u32)> {
    let mut parts = line.split_whitespace().nth(1)?.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}
