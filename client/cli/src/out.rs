//! Writing to the terminal or a pipe. A reader that goes away (`opmon … | head`) ends
//! the CLI the way it ends `cat` or `grep`: by SIGPIPE, which a shell reports as status
//! 141 and `set -o pipefail` treats like any other tool's. (Rust ignores SIGPIPE, so
//! `println!` would panic instead; the socket to the agent still needs it ignored, which
//! is why it is restored only at the moment of dying.)

use std::io::Write;

/// Writes `text` to standard output and flushes it.
pub fn emit(text: &str) -> Result<(), String> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => die_of_sigpipe(),
        Err(e) => Err(format!("writing to standard output: {e}")),
    }
}

/// Writes a line to standard error; if nobody reads it there is nobody to tell.
pub fn warn(text: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{text}");
}

/// Ends the process as a write to a closed pipe ends a tool that does not ignore
/// SIGPIPE.
fn die_of_sigpipe() -> ! {
    use nix::sys::signal::{raise, signal, SigHandler, Signal};
    // SAFETY: restoring the default action of a signal runs no handler code.
    unsafe {
        let _ = signal(Signal::SIGPIPE, SigHandler::SigDfl);
    }
    let _ = raise(Signal::SIGPIPE);
    // Not reached unless SIGPIPE is blocked: exit with the status a shell would show.
    std::process::exit(128 + 13)
}
