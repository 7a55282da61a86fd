//! Where guests are compiled: in this process, or in a child process of the host's own binary.
//!
//! Compiling a component runs Cranelift: its code (~4 MiB of the binary's text) and its
//! scratch memory (~10 MiB at the peak for the three default guests, freed afterwards but
//! left in the host's malloc arenas) stay charged to whichever process compiled. A host that
//! compiles in a child keeps neither: the child exits and only the compiled artifact comes
//! back. It also keeps a compiler crash on untrusted input out of the host.
//!
//! The protocol is one request per child: the component's bytes on stdin, the compiled
//! artifact (`Engine::precompile_component`) on stdout, exit status 0; otherwise a message on
//! stderr and a non-zero status. The child builds its engine from the same [`Limits`] (passed
//! as arguments), so the artifact fits the host's engine; wasmtime refuses one that does not.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::Limits;

/// The first argument by which a binary recognises a compile request (see
/// [`serve_if_compiler_process`]).
pub const COMPILE_SUBCOMMAND: &str = "compile-guest";

/// A program that compiles components for this host: typically the host's own binary
/// (`std::env::current_exe()`), whose `main` calls [`serve_if_compiler_process`] first.
#[derive(Clone, Debug)]
pub struct CompilerCommand {
    program: PathBuf,
    args: Vec<OsString>,
}

impl CompilerCommand {
    /// `program args…` followed by the limits, in the form the child reads.
    pub fn new(program: impl Into<PathBuf>, args: impl IntoIterator<Item = impl Into<OsString>>) -> CompilerCommand {
        CompilerCommand { program: program.into(), args: args.into_iter().map(Into::into).collect() }
    }

    /// This process's own binary with [`COMPILE_SUBCOMMAND`].
    pub fn current_exe() -> std::io::Result<CompilerCommand> {
        Ok(CompilerCommand::new(std::env::current_exe()?, [COMPILE_SUBCOMMAND]))
    }

    /// Compiles `bytes` in a child process; returns the artifact or why there is none.
    pub(crate) fn compile(&self, bytes: &[u8], limits: &Limits) -> Result<Vec<u8>, String> {
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .args(limit_args(limits))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the compiler process {}: {e}", self.program.display()))?;
        // Before it has the component: it compiles nothing before reading all of stdin.
        offer_to_oom_killer(child.id());
        // The child reads all of stdin before it writes anything, so writing first cannot
        // deadlock. A child that died early shows in its status and stderr below, not here.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(bytes);
        }
        let out = child.wait_with_output().map_err(|e| format!("waiting for the compiler process: {e}"))?;
        if out.status.success() {
            return Ok(out.stdout);
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        let message: String = stderr.trim().chars().take(2048).collect();
        Err(if message.is_empty() { format!("the compiler process failed ({})", out.status) } else { message })
    }
}

/// The compiler child's `oom_score_adj`: the OOM killer's first pick. It inherits the host's
/// (kube-proxy's -999, `--oom-score-adj`), which would shield Cranelift's scratch memory for
/// an uploaded component, whatever its size, and leave the node's pods to be killed instead.
/// Killed, it costs one failed compile, reported as such; the modules in force stay.
pub const COMPILER_OOM_SCORE_ADJ: i32 = 1000;

/// Raises the child `pid`'s `oom_score_adj` to [`COMPILER_OOM_SCORE_ADJ`] (raising needs no
/// privilege); a child that is gone or a system without the file is left as it is.
fn offer_to_oom_killer(pid: u32) {
    if let Err(e) = std::fs::write(format!("/proc/{pid}/oom_score_adj"), COMPILER_OOM_SCORE_ADJ.to_string()) {
        tracing::debug!(pid, "cannot raise the compiler process's oom_score_adj: {e}");
    }
}

/// The engine settings that must match between the compiling and the running engine travel as
/// `name=value` arguments.
fn limit_args(limits: &Limits) -> [String; 3] {
    [
        format!("memory-bytes={}", limits.memory_bytes),
        format!("table-elements={}", limits.table_elements),
        format!("max-instances={}", limits.max_instances),
    ]
}

fn parse_limit_args(args: &[String]) -> Result<Limits, String> {
    let mut limits = Limits::default();
    for arg in args {
        let (name, value) = arg.split_once('=').ok_or_else(|| format!("expected name=value, got {arg:?}"))?;
        let number = |v: &str| v.parse::<u64>().map_err(|e| format!("{name}: {e}"));
        match name {
            "memory-bytes" => limits.memory_bytes = number(value)? as usize,
            "table-elements" => limits.table_elements = number(value)? as usize,
            "max-instances" => {
                limits.max_instances = u32::try_from(number(value)?).map_err(|e| format!("{name}: {e}"))?
            }
            _ => return Err(format!("unknown argument {name}")),
        }
    }
    Ok(limits)
}

/// The child side, first thing in a binary's `main`: when this process was started with
/// [`COMPILE_SUBCOMMAND`] (as [`CompilerCommand::current_exe`] starts it), serves that one
/// request (a component on stdin, the artifact on stdout) and returns the exit code to end
/// with; `None` otherwise.
pub fn serve_if_compiler_process() -> Option<std::process::ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    (args.first().map(String::as_str) == Some(COMPILE_SUBCOMMAND)).then(|| child_main(&args[1..]))
}

fn child_main(args: &[String]) -> std::process::ExitCode {
    match compile_stdio(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            std::process::ExitCode::from(2)
        }
    }
}

fn compile_stdio(args: &[String]) -> Result<(), String> {
    let limits = parse_limit_args(args)?;
    let mut bytes = Vec::new();
    std::io::stdin().read_to_end(&mut bytes).map_err(|e| format!("reading the component: {e}"))?;
    let engine = wasmtime::Engine::new(&crate::engine_config(&limits)).map_err(|e| format!("{e:#}"))?;
    let code = engine.precompile_component(&bytes).map_err(|e| format!("{e:#}"))?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(&code).and_then(|_| stdout.flush()).map_err(|e| format!("writing the compiled component: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_round_trip_through_arguments() {
        let limits = Limits { memory_bytes: 32 << 20, table_elements: 777, max_instances: 9, ..Limits::default() };
        let parsed = parse_limit_args(&limit_args(&limits)).unwrap();
        assert_eq!((parsed.memory_bytes, parsed.table_elements, parsed.max_instances), (32 << 20, 777, 9));
        assert!(parse_limit_args(&["memory-bytes".into()]).unwrap_err().contains("name=value"));
        assert!(parse_limit_args(&["fuel=1".into()]).unwrap_err().contains("unknown argument fuel"));
        assert!(parse_limit_args(&["max-instances=99999999999".into()]).is_err());
    }

    /// The child is the OOM killer's first pick from before it reads the component. A
    /// stand-in compiler reports its own score once it has read stdin.
    #[test]
    fn the_compiler_child_is_the_oom_killers_first_pick() {
        let reporter = CompilerCommand::new(
            "sh",
            ["-c", "cat >/dev/null; echo score $(cat /proc/self/oom_score_adj) >&2; exit 3", "sh"],
        );
        let message = reporter.compile(b"component bytes", &Limits::default()).unwrap_err();
        assert_eq!(message, format!("score {COMPILER_OOM_SCORE_ADJ}"));
    }

    /// Why the child builds its engine with `engine_config`: code compiled for another memory
    /// reservation assumes other bounds (it would need explicit checks), and wasmtime refuses
    /// to load it into the host's engine.
    #[test]
    fn an_artifact_of_another_configuration_is_refused() {
        let mut other = crate::engine_config(&Limits::default());
        other.memory_reservation(64 << 20);
        let code = wasmtime::Engine::new(&other).unwrap().precompile_component(wasmplane_guest_artifacts::GC).unwrap();
        let host = wasmtime::Engine::new(&crate::engine_config(&Limits::default())).unwrap();
        // SAFETY: compiled just above; the point is that the mismatch is caught.
        let refused = unsafe { wasmtime::component::Component::deserialize(&host, &code) };
        assert!(refused.is_err(), "an artifact compiled for a 64 MiB reservation loaded into a 4 GiB one");
        let same = wasmtime::Engine::new(&other).unwrap();
        // SAFETY: as above, same configuration.
        assert!(unsafe { wasmtime::component::Component::deserialize(&same, &code) }.is_ok());
    }
}
