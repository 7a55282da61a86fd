use anyhow::Context as _;
use clap::Parser as _;
use tracing_subscriber::EnvFilter;
use wasmplane::cli::{Cli, Command};

fn main() -> anyhow::Result<std::process::ExitCode> {
    // A compile request from a running host: nothing else of the host starts in that process.
    if let Some(exit) = wasmplane_runtime::compiler::serve_if_compiler_process() {
        return Ok(exit);
    }
    // Before the runtime starts any thread.
    wasmplane::memory::limit_malloc_arenas();
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the tokio runtime")?.block_on(run())?;
    Ok(std::process::ExitCode::SUCCESS)
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Run(args) => {
            let config = args.into_config()?;
            let data_dir = config.data_dir.clone();
            let host = wasmplane::app::start(config).await.context("starting wasmplane")?;
            println!("wasmplane REST API: {}  (try {}/v1/dataplane and {}/v1/modules)", host.url(), host.url(), host.url());
            if let Some(dir) = data_dir {
                println!("API token for mutating calls: {}", dir.join("token").display());
            }
            tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")?;
            tracing::info!("shutting down");
            host.stop().await;
            Ok(())
        }
        Command::Module { api, command } => wasmplane::cli::module_command(api, command).await,
        Command::Replay(args) => wasmplane::replay::command(args),
    }
}
