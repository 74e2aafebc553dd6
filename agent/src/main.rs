//! The `opmon-agent` binary: parse settings, set up logging, run.

use clap::Parser;
use opmon_agent::config::Args;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OPMON_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let settings = match args.resolve() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("opmon-agent: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("opmon-agent: starting the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(opmon_agent::run(settings)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("opmon-agent: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
