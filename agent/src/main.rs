//! The `opmon-agent` binary: settings, logging, run.

use opmon_agent::config::{self, LogFormat};
use opmon_agent::reload::Reload;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter};

/// The human format's fields with control characters escaped in every value.
///
/// tracing-subscriber 0.3.23 escapes ESC, BEL, BS, FF, DEL and C1 in the message only,
/// and CR and LF nowhere; a field like `error = %e` carrying a snapshotter's text could
/// otherwise recolour a terminal or forge a log line of its own. Field values are
/// written as the default formatter writes them (`name=value`, the message bare), then
/// escaped with the same rule the CLI uses.
fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|writer, field, value| {
        let text = format!("{value:?}");
        let text = opmon_client::text::escape_controls(&text);
        if field.name() == "message" {
            write!(writer, "{text}")
        } else {
            write!(writer, "{}={text}", field.name())
        }
    })
    .delimited(" ")
}

fn main() -> std::process::ExitCode {
    let (settings, command_line) = match config::load() {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("opmon-agent: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if command_line.print_config() {
        print!("{}", settings.describe());
        return std::process::ExitCode::SUCCESS;
    }
    // The level was validated with the settings. The filter sits behind a reload
    // handle so SIGHUP can change it.
    let filter = EnvFilter::try_new(&settings.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    // Colours only for a person at a terminal, never into files or the journal.
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    match settings.log_format {
        LogFormat::Json => registry.with(logs.json()).init(),
        LogFormat::Human => registry.with(logs.fmt_fields(escaped_fields())).init(),
    }
    let reload_with = Reload {
        command_line,
        set_log_level: Box::new(move |level| {
            let filter = EnvFilter::try_new(level).map_err(|e| e.to_string())?;
            handle.reload(filter).map_err(|e| e.to_string())
        }),
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("opmon-agent: starting the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(opmon_agent::run(settings, reload_with)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("opmon-agent: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
