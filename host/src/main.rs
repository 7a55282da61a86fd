use anyhow::Context as _;
use tracing_subscriber::EnvFilter;
use wasmplane::cli::{Command, LogFormat, PodCommand, ServiceCommand};

fn main() -> std::process::ExitCode {
    // A compile request from a running host: nothing else of the host starts in that process.
    if let Some(exit) = wasmplane_runtime::compiler::serve_if_compiler_process() {
        return exit;
    }
    match start_and_run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprint!("{}", error_report(&error));
            std::process::ExitCode::FAILURE
        }
    }
}

/// An error as a command line tool reports it: the error, then each cause. Never the
/// backtrace that returning it from `main` would print under `RUST_BACKTRACE=1`, which
/// operators set for the host's panics, not for a mistyped flag.
fn error_report(error: &anyhow::Error) -> String {
    let mut report = format!("error: {error}\n");
    let mut said = error.to_string();
    for cause in error.chain().skip(1) {
        // Library errors often print their source in their own message too.
        let cause = cause.to_string();
        if !said.contains(&cause) {
            report.push_str(&format!("  caused by: {cause}\n"));
        }
        said = cause;
    }
    report
}

fn start_and_run() -> anyhow::Result<()> {
    // Before the runtime starts any thread.
    wasmplane::memory::configure_malloc();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    if let Some(workers) = wasmplane::memory::worker_threads(std::env::var_os("TOKIO_WORKER_THREADS").as_deref(), cores)
    {
        runtime.worker_threads(workers);
    }
    runtime.enable_all().build().context("starting the tokio runtime")?.block_on(run())
}

/// The log on stderr, filtered by `RUST_LOG` (default `info`).
fn init_logging(format: LogFormat) {
    let logs = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr);
    match format {
        // Colours only for a terminal: log collectors (kubectl logs) would show the escapes.
        LogFormat::Text => logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        // The event's fields at the top level beside `timestamp`, `level`, `target` and the
        // innermost span, as collectors index them.
        LogFormat::Json => logs.json().flatten_event(true).with_span_list(false).init(),
    }
}

async fn run() -> anyhow::Result<()> {
    let (cli, kube_proxy_warnings) = wasmplane::cli::parse_cli()?;
    init_logging(match &cli.command {
        Command::Run(args) => args.log_format,
        _ => LogFormat::Text,
    });
    for warning in &kube_proxy_warnings {
        tracing::warn!("{warning}");
    }
    match cli.command {
        Command::Run(args) => {
            // Before anything is printed: a SIGTERM that follows the REST API line must find
            // the handler in place, not the default action that kills the process.
            let mut signals = TerminationSignals::install()?;
            if let Err(e) = wasmplane::memory::set_oom_score_adj(args.oom_score_adj) {
                tracing::warn!(
                    "could not set oom_score_adj to {} (lowering it needs CAP_SYS_RESOURCE): {e}",
                    args.oom_score_adj
                );
            }
            let page_out = !args.no_page_out;
            let config = args.into_config()?;
            let data_dir = config.data_dir.clone();
            let host = wasmplane::app::start(config).await.context("starting wasmplane")?;
            announce(format_args!(
                "wasmplane REST API: {}  (try {}/v1/dataplane and {}/v1/modules)",
                host.url(),
                host.url(),
                host.url()
            ));
            if page_out {
                tokio::spawn(page_out_start_up_code(
                    host.ready.clone(),
                    host.compiled_guests.clone(),
                    data_dir.clone(),
                ));
            }
            if let Some(dir) = data_dir {
                announce(format_args!("API token for mutating calls: {}", dir.join("token").display()));
            }
            let signal = signals.next().await;
            tracing::info!(signal, "shutting down");
            // Inside the pod's grace period (30 s in deploy/): the kubelet kills after it.
            if tokio::time::timeout(STOP_TIMEOUT, host.stop()).await.is_err() {
                tracing::warn!("not stopped within {STOP_TIMEOUT:?}; exiting");
            }
            Ok(())
        }
        Command::Module { api, command } => wasmplane::cli::module_command(api, command).await,
        Command::Replay(args) => wasmplane::replay::command(args),
        Command::Cleanup(args) => wasmplane::cli::cleanup(args).await,
        Command::Status { api } => {
            if !wasmplane::inspect::status(&api).await? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Service { api, command } => match command {
            ServiceCommand::Ls { namespace } => wasmplane::inspect::services(&api, namespace.as_deref()).await,
            ServiceCommand::Get { namespace, name } => wasmplane::inspect::service(&api, &namespace, &name).await,
        },
        Command::Pod { api, command } => match command {
            PodCommand::Ls { namespace } => wasmplane::inspect::pods(&api, namespace.as_deref()).await,
            PodCommand::Get { pod, counters } => wasmplane::inspect::pod(&api, &pod, counters).await,
        },
        Command::Node { api, command } => wasmplane::inspect::node(&api, command).await,
        Command::Policy { api, command } => wasmplane::inspect::policy(&api, command).await,
        Command::Drops { api, args } => wasmplane::inspect::drops(&api, args).await,
    }
}

/// A line for whoever started the host, on stdout. A closed stdout (the reader went away) is
/// no reason to stop a running dataplane, as `println!` would by panicking.
fn announce(line: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if let Err(e) = writeln!(std::io::stdout(), "{line}") {
        tracing::warn!("could not print to stdout ({e}): {line}");
    }
}

/// How long a graceful stop may take before the process exits anyway.
const STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// SIGTERM (what the kubelet and systemd send to stop a process) and SIGINT (Ctrl-C), caught
/// from the moment they are installed on.
struct TerminationSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl TerminationSignals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            terminate: signal(SignalKind::terminate()).context("handling SIGTERM")?,
            interrupt: signal(SignalKind::interrupt()).context("handling SIGINT")?,
        })
    }

    /// Waits for the first of them and names it.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

/// Once the initial sync is applied, hands the resident code and read-only data of the binary,
/// the compiled guests and the shared libraries back to the kernel: most of it ran only at
/// start-up, and what the host still runs faults back in (BENCHMARKS.md, fifteenth and
/// sixteenth runs). The binary's relocated data is first moved into a file in `data_dir`, so
/// that it can be handed back too (nineteenth run).
async fn page_out_start_up_code(
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    compiled_guests: Option<std::path::PathBuf>,
    data_dir: Option<std::path::PathBuf>,
) {
    while !ready.load(std::sync::atomic::Ordering::Relaxed) {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    let paged = tokio::task::spawn_blocking(move || {
        let relocated = match data_dir.map(|dir| wasmplane::memory::file_back_relocated_data(&dir)) {
            Some(Ok(bytes)) => bytes / 1024,
            // A read-only or in-memory data directory: that data just stays anonymous.
            Some(Err(e)) => {
                tracing::info!("the binary's relocated data stays in anonymous memory: {e}");
                0
            }
            None => 0,
        };
        wasmplane::memory::page_out_code(compiled_guests.as_deref()).map(|paged| (paged, relocated))
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|result| result);
    match paged {
        Ok((paged, relocated_kib)) => tracing::info!(
            mappings = paged.mappings,
            binary_kib = paged.binary_kib,
            relocated_kib,
            guests_kib = paged.guests_kib,
            libraries_kib = paged.libraries_kib,
            "start-up code paged out"
        ),
        // A kernel before 5.4, or no right to advise on the file: the code just stays resident.
        Err(e) => tracing::debug!("paging out start-up code: {e}"),
    }
}
