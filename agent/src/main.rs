//! The `opmon-agent` binary: settings, logging, run.

use opmon_agent::config::{self, LogFormat};
use opmon_agent::reload::Reload;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter};

/// The human format's fields with control characters escaped in every value (not only
/// the message), so a peer's text in a field cannot recolour a terminal or forge a line.
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

/// mimalloc rather than glibc's malloc: the poll path allocates on one thread and frees
/// on another, which glibc serves from locked arena bins (the bench's `instructions` row).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's options, by their place in `mi_option_t` (mimalloc.h of libmimalloc-sys
/// 0.1.49, mimalloc 3.3), which the crate names only in part.
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Memory freed goes back to the system at once and arenas are committed as used, as
/// glibc does, to keep the resident size low (the bench's RSS rows). Runs from
/// `.init_array`, before Rust's first allocation makes an arena; an option the operator
/// sets (`MIMALLOC_PURGE_DELAY`, `MIMALLOC_ARENA_EAGER_COMMIT`) is left to mimalloc.
#[cfg(all(target_os = "linux", not(test)))]
extern "C" fn tune_allocator() {
    for (option, variable) in [
        (MI_OPTION_ARENA_EAGER_COMMIT, c"MIMALLOC_ARENA_EAGER_COMMIT"),
        (MI_OPTION_PURGE_DELAY, c"MIMALLOC_PURGE_DELAY"),
    ] {
        // SAFETY: `getenv` reads the environment the process started with (no thread
        // runs yet to change it); `mi_option_set` takes a valid member of the enum and
        // a value it documents (0: no eager commit, no delay).
        unsafe {
            if nix::libc::getenv(variable.as_ptr()).is_null() {
                libmimalloc_sys::mi_option_set(option, 0);
            }
        }
    }
}

#[cfg(all(target_os = "linux", not(test)))]
#[used]
#[link_section = ".init_array"]
static TUNE_ALLOCATOR: extern "C" fn() = tune_allocator;

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
    let journal = stderr_is_journal();
    match settings.log_format {
        LogFormat::Json => registry
            .with(
                logs.json()
                    .map_event_format(|inner| Prioritized { inner, journal }),
            )
            .init(),
        LogFormat::Human => registry
            .with(
                logs.fmt_fields(escaped_fields())
                    .map_event_format(|inner| Prioritized { inner, journal }),
            )
            .init(),
    }
    let reload_with = Reload {
        command_line,
        set_log_level: Box::new(move |level| {
            let filter = EnvFilter::try_new(level).map_err(|e| e.to_string())?;
            handle.reload(filter).map_err(|e| e.to_string())
        }),
    };
    // The blocking pool is bounded so that the agent's own tasks are known (`caps::TASKS`).
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(opmon_agent::caps::BLOCKING_THREADS)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("opmon-agent: starting the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(opmon_agent::run(settings, reload_with)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Once: in the log when errors are logged, else on stderr as it stands.
            if tracing::enabled!(tracing::Level::ERROR) {
                tracing::error!("{e}");
            } else {
                eprintln!("opmon-agent: {e}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether stderr is connected to the journal: systemd sets `JOURNAL_STREAM` to the
/// device and inode of the stream it gave (sd-daemon(3)); a child that inherited the
/// variable with another stderr does not match.
fn stderr_is_journal() -> bool {
    let Ok(stream) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.split_once(':') else {
        return false;
    };
    match nix::sys::stat::fstat(std::io::stderr()) {
        Ok(st) => {
            dev.parse::<u64>().ok() == Some(st.st_dev) && ino.parse::<u64>().ok() == Some(st.st_ino)
        }
        Err(_) => false,
    }
}

/// An event format that, when the log goes to the journal, starts each line with its
/// syslog priority as sd-daemon(3) defines (`<3>` error, `<4>` warning, `<6>` info,
/// `<7>` debug and trace), so `journalctl -p warning` selects by level.
struct Prioritized<F> {
    inner: F,
    journal: bool,
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for Prioritized<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        if self.journal {
            let priority = match *event.metadata().level() {
                tracing::Level::ERROR => 3,
                tracing::Level::WARN => 4,
                tracing::Level::INFO => 6,
                _ => 7,
            };
            write!(writer, "<{priority}>")?;
        }
        self.inner.format_event(ctx, writer, event)
    }
}

#[cfg(test)]
mod tests {
    /// Prints the two options as this process reads them; run by the test below in a
    /// process of its own.
    #[test]
    #[ignore = "run by mimalloc_option_numbers_are_the_options_named"]
    fn print_mimalloc_options() {
        for number in [
            super::MI_OPTION_ARENA_EAGER_COMMIT,
            super::MI_OPTION_PURGE_DELAY,
        ] {
            // SAFETY: a valid option number; reading an option has no other effect.
            let value = unsafe { libmimalloc_sys::mi_option_get(number) };
            println!("mimalloc option {number} = {value}");
        }
    }

    /// The option numbers name the options meant: mimalloc reads `MIMALLOC_<NAME>` when
    /// it starts, so in a process started with those variables each number must read
    /// back the value given its name.
    #[test]
    fn mimalloc_option_numbers_are_the_options_named() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let out = std::process::Command::new(exe)
            .args(["--exact", "tests::print_mimalloc_options", "--ignored"])
            .args(["--nocapture", "--test-threads", "1"])
            .env("MIMALLOC_ARENA_EAGER_COMMIT", "3")
            .env("MIMALLOC_PURGE_DELAY", "77")
            .output()
            .expect("running the test binary again");
        let text = String::from_utf8_lossy(&out.stdout);
        for (number, value) in [
            (super::MI_OPTION_ARENA_EAGER_COMMIT, 3),
            (super::MI_OPTION_PURGE_DELAY, 77),
        ] {
            let line = format!("mimalloc option {number} = {value}");
            assert!(text.contains(&line), "wanted {line:?} in:\n{text}");
        }
    }
}
