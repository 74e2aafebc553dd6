//! Log lines that a peer or a plugin can make repeat once per failure (a refused peer, a
//! descriptor error, a plugin's output, an operation failed for one cause): each key gets
//! [`LogThrottle::PER_WINDOW`] lines in every [`LogThrottle::WINDOW`], then one line says
//! how many were not logged. That count is written when the key's window ends, when its
//! lines end ([`LogThrottles::finish`]), or when the throttle is dropped, by the caller's
//! summary under the caller's target.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// Writes the line saying that `unlogged` occurrences for `key` (`None`: for keys past
/// [`LogThrottles::MAX_KEYS`]) in a window of `window` were not logged one by one.
type KeyedSummary<K> = Box<dyn Fn(Option<&K>, u32, Duration) + Send + Sync>;

/// A [`LogThrottle`] per key, so that one cause cannot silence another. Keys may come
/// from peers (plugin names), so at most [`LogThrottles::MAX_KEYS`] are counted apart;
/// occurrences of further keys share one budget, summed up with the key `None`.
pub struct LogThrottles<K> {
    shared: Arc<Shared<K>>,
}

impl<K> Clone for LogThrottles<K> {
    fn clone(&self) -> Self {
        LogThrottles {
            shared: self.shared.clone(),
        }
    }
}

struct Shared<K> {
    windows: Mutex<HashMap<Option<K>, Window>>,
    summary: KeyedSummary<K>,
}

#[derive(Clone, Copy)]
struct Window {
    start: Instant,
    logged: u32,
    unlogged: u32,
    /// A timer will write the summary of the window that opened at `start`.
    armed: bool,
}

impl Window {
    fn at(start: Instant) -> Window {
        Window {
            start,
            logged: 0,
            unlogged: 0,
            armed: false,
        }
    }
}

impl<K> Shared<K> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Option<K>, Window>> {
        self.windows.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<K: Eq + Hash> Shared<K> {
    /// The count of `key`'s window opened at `start`, once it has ended, if not yet said.
    fn ended(&self, key: Option<K>, start: Instant) {
        let unlogged = {
            let mut windows = self.lock();
            match windows.get_mut(&key) {
                Some(window) if window.start == start => {
                    window.armed = false;
                    std::mem::take(&mut window.unlogged)
                }
                _ => return,
            }
        };
        if unlogged > 0 {
            (self.summary)(key.as_ref(), unlogged, LogThrottle::WINDOW);
        }
    }
}

impl<K> Drop for Shared<K> {
    fn drop(&mut self) {
        let windows = std::mem::take(&mut *self.lock());
        for (key, window) in windows {
            if window.unlogged > 0 {
                (self.summary)(key.as_ref(), window.unlogged, LogThrottle::WINDOW);
            }
        }
    }
}

impl<K: Eq + Hash + Clone + Send + Sync + 'static> LogThrottles<K> {
    /// Keys counted apart; past this, the keys whose window has nothing left to say are
    /// forgotten, and if none is, the new key shares the `None` budget.
    pub const MAX_KEYS: usize = 64;

    /// A throttle whose summaries `summary` writes.
    pub fn new(summary: impl Fn(Option<&K>, u32, Duration) + Send + Sync + 'static) -> Self {
        LogThrottles {
            shared: Arc::new(Shared {
                windows: Mutex::new(HashMap::new()),
                summary: Box::new(summary),
            }),
        }
    }

    /// Whether this occurrence for `key` gets its own line, how many occurrences of the
    /// key's window that just ended are unlogged and unsaid, and, if this one is not
    /// logged, the window a timer should sum up.
    fn note_at(&self, key: K, now: Instant) -> (bool, u32, Option<(Option<K>, Instant)>) {
        let mut windows = self.shared.lock();
        let mut slot = Some(key);
        if windows.len() >= Self::MAX_KEYS && !windows.contains_key(&slot) {
            windows.retain(|_, w| {
                w.armed || w.unlogged > 0 || now.duration_since(w.start) < LogThrottle::WINDOW
            });
            if windows.len() >= Self::MAX_KEYS {
                slot = None;
            }
        }
        let window = windows.entry(slot.clone()).or_insert(Window::at(now));
        let mut ended_unlogged = 0;
        if now.duration_since(window.start) >= LogThrottle::WINDOW {
            ended_unlogged = window.unlogged;
            *window = Window::at(now);
        }
        if window.logged < LogThrottle::PER_WINDOW {
            window.logged += 1;
            return (true, ended_unlogged, None);
        }
        window.unlogged = window.unlogged.saturating_add(1);
        let timer = (!window.armed).then_some((slot, window.start));
        window.armed = true;
        (false, ended_unlogged, timer)
    }

    /// Logs with `line` within `key`'s budget; the count of what a window left out is
    /// written once it ends.
    pub fn log(&self, key: K, line: impl FnOnce()) {
        let shown = key.clone();
        let (own_line, unlogged, timer) = self.note_at(key, Instant::now());
        if unlogged > 0 {
            (self.shared.summary)(Some(&shown), unlogged, LogThrottle::WINDOW);
        }
        if let (Some((slot, start)), Ok(runtime)) = (timer, tokio::runtime::Handle::try_current()) {
            let shared = Arc::downgrade(&self.shared);
            runtime.spawn(async move {
                tokio::time::sleep_until(start + LogThrottle::WINDOW).await;
                if let Some(shared) = shared.upgrade() {
                    shared.ended(slot, start);
                }
            });
        }
        if own_line {
            line();
        }
    }

    /// Writes now the counts every key's window has left out so far (at shutdown, for a
    /// throttle that is never dropped).
    pub fn flush(&self) {
        let counts: Vec<(Option<K>, u32)> = self
            .shared
            .lock()
            .iter_mut()
            .filter(|(_, w)| w.unlogged > 0)
            .map(|(key, w)| (key.clone(), std::mem::take(&mut w.unlogged)))
            .collect();
        for (key, unlogged) in counts {
            (self.shared.summary)(key.as_ref(), unlogged, LogThrottle::WINDOW);
        }
    }

    /// `key`'s lines have ended (a stream closed): the count its window left out is
    /// written now, and the key is forgotten.
    pub fn finish(&self, key: &K) {
        let key = Some(key.clone());
        let window = self.shared.lock().remove(&key);
        if let Some(window) = window.filter(|w| w.unlogged > 0) {
            (self.shared.summary)(key.as_ref(), window.unlogged, LogThrottle::WINDOW);
        }
    }
}

/// One throttle for one kind of line (a [`LogThrottles`] of a single key).
pub struct LogThrottle {
    inner: LogThrottles<()>,
}

/// Writes the line saying that `unlogged` occurrences in a window of `window` were not
/// logged one by one.
pub type Summary = fn(unlogged: u32, window: Duration);

impl LogThrottle {
    pub const PER_WINDOW: u32 = 20;
    pub const WINDOW: Duration = Duration::from_secs(10);

    /// A throttle whose summaries `summary` writes.
    pub fn new(summary: Summary) -> LogThrottle {
        LogThrottle::starting(Instant::now(), summary)
    }

    /// A throttle whose first window opens at `start`.
    pub fn starting(start: Instant, summary: Summary) -> LogThrottle {
        let inner =
            LogThrottles::new(move |_: Option<&()>, unlogged, window| summary(unlogged, window));
        inner.shared.lock().insert(Some(()), Window::at(start));
        LogThrottle { inner }
    }

    /// Whether this occurrence gets its own line, and how many occurrences the window
    /// that just ended left unlogged (for the caller to say in one line).
    pub fn note(&self, now: Instant) -> (bool, u32) {
        let (own_line, unlogged, _) = self.inner.note_at((), now);
        (own_line, unlogged)
    }

    /// Logs with `line` within the budget; the count of what a window left out is
    /// written once it ends.
    pub fn log(&self, line: impl FnOnce()) {
        self.inner.log((), line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn one_key_does_not_silence_another_and_keys_past_the_most_share_one_budget() {
        static SAID: AtomicU32 = AtomicU32::new(0);
        let log = LogThrottles::<u32>::new(|_, unlogged, _| {
            SAID.fetch_add(unlogged, Ordering::Relaxed);
        });
        let now = Instant::now();
        let logged = |key| {
            (0..LogThrottle::PER_WINDOW + 3)
                .filter(|_| log.note_at(key, now).0)
                .count() as u32
        };
        assert_eq!(logged(1), LogThrottle::PER_WINDOW);
        assert_eq!(logged(2), LogThrottle::PER_WINDOW);
        for key in 3..LogThrottles::<u32>::MAX_KEYS as u32 + 10 {
            log.note_at(key, now);
        }
        // Keys past the most count against the `None` budget.
        assert!(log.shared.lock().contains_key(&None));
        assert_eq!(log.shared.lock().len(), LogThrottles::<u32>::MAX_KEYS + 1);
        log.finish(&1);
        assert_eq!(SAID.load(Ordering::Relaxed), 3);
        drop(log);
        assert_eq!(SAID.load(Ordering::Relaxed), 6);
    }
}
