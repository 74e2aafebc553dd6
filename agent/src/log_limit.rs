//! Log lines a peer or a plugin can make repeat (a refused connection, a plugin's
//! output, operations failing for one cause): each [`LogLimit`] writes at most
//! [`LogLimit::PER_WINDOW`] lines in a [`LogLimit::WINDOW`]; when the window ends (or at
//! [`LogLimit::flush`]) one line says how many were left out. One limit per kind of
//! line: the log stays bounded, whichever peer fills it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

pub struct LogLimit {
    /// What its lines are about, for the count's line ("refused connections").
    what: &'static str,
    window: Arc<Mutex<Window>>,
}

struct Window {
    start: Option<Instant>,
    logged: u32,
    unlogged: u32,
    /// A task will say the count when the window ends.
    counting: bool,
}

impl LogLimit {
    pub const PER_WINDOW: u32 = 20;
    pub const WINDOW: Duration = Duration::from_secs(10);

    pub fn new(what: &'static str) -> LogLimit {
        LogLimit {
            what,
            window: Arc::new(Mutex::new(Window {
                start: None,
                logged: 0,
                unlogged: 0,
                counting: false,
            })),
        }
    }

    /// Whether a line at `now` is written, and how many lines were left out before it
    /// (for the caller to say).
    fn note(&self, now: Instant) -> (bool, u32) {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let mut left_out = 0;
        if w.start
            .is_none_or(|start| now.duration_since(start) >= Self::WINDOW)
        {
            left_out = std::mem::take(&mut w.unlogged);
            w.start = Some(now);
            w.logged = 0;
        }
        if w.logged < Self::PER_WINDOW {
            w.logged += 1;
            return (true, left_out);
        }
        w.unlogged = w.unlogged.saturating_add(1);
        if !w.counting {
            if let (Some(start), Ok(runtime)) = (w.start, tokio::runtime::Handle::try_current()) {
                w.counting = true;
                let (what, window) = (self.what, self.window.clone());
                runtime.spawn(async move {
                    tokio::time::sleep_until(start + Self::WINDOW).await;
                    let n = {
                        let mut w = window.lock().unwrap_or_else(|p| p.into_inner());
                        w.counting = false;
                        std::mem::take(&mut w.unlogged)
                    };
                    say_left_out(what, n);
                });
            }
        }
        (false, left_out)
    }

    /// Writes `line` unless the window is full (then counts it).
    pub fn log(&self, line: impl FnOnce()) {
        let (written, left_out) = self.note(Instant::now());
        say_left_out(self.what, left_out);
        if written {
            line();
        }
    }

    /// Says now how many lines were left out since the last count (when its lines end).
    pub fn flush(&self) {
        let left_out = {
            let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::take(&mut w.unlogged)
        };
        say_left_out(self.what, left_out);
    }
}

fn say_left_out(what: &str, n: u32) {
    if n > 0 {
        tracing::warn!(
            unlogged = n,
            "{n} more lines of {what} were not logged one by one"
        );
    }
}

impl Drop for LogLimit {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_writes_its_share_and_the_next_line_counts_the_rest() {
        let limit = LogLimit::new("tests");
        let start = Instant::now();
        let written = (0..LogLimit::PER_WINDOW + 5)
            .filter(|_| limit.note(start).0)
            .count();
        assert_eq!(written, LogLimit::PER_WINDOW as usize);
        assert_eq!(limit.note(start + LogLimit::WINDOW), (true, 5));
        assert_eq!(limit.note(start + LogLimit::WINDOW), (true, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_count_is_said_when_the_window_ends_without_another_line() {
        let limit = LogLimit::new("tests");
        for _ in 0..LogLimit::PER_WINDOW + 3 {
            limit.log(|| {});
        }
        tokio::time::sleep(LogLimit::WINDOW + Duration::from_millis(1)).await;
        let w = limit.window.lock().unwrap();
        assert_eq!(
            (w.unlogged, w.counting),
            (0, false),
            "the window's count was said"
        );
    }
}
