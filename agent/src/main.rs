//! The `opmon-agent` binary: settings, logging, run.

use opmon_agent::config::{self, LogFormat};

fn main() -> std::process::ExitCode {
    let (settings, print) = match config::load() {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("opmon-agent: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if print {
        print!("{}", settings.describe());
        return std::process::ExitCode::SUCCESS;
    }
    // The level was validated with the settings.
    let filter = tracing_subscriber::EnvFilter::try_new(&settings.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal, never into files or the journal.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match settings.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Human => logs.init(),
    }
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
            tracing::error!("{e}");
            eprintln!("opmon-agent: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
