//! Rates and ETAs: pure functions of the progress samples the poller sees. A rate is a
//! time-weighted moving average (a sample [`RATE_HALF_LIFE_SECONDS`] old counts half), so
//! a steady pace reads as itself however often it is polled; it lives in the operation's
//! row, so a restart keeps it.
//!
//! Invariants (each tested below):
//! - one sample only anchors; `nCompleted` going backwards anchors anew; a sample no
//!   later than the anchor changes nothing;
//! - every rate is finite and at least zero, and no count a snapshotter reports
//!   overflows;
//! - the ETA counts on the agent's clock, from when it saw the anchor: an ETA is read
//!   against the reader's clock, not the snapshotter's.

use opmon_client::RATE_HALF_LIFE_SECONDS;

/// 9999-12-31T23:59:59Z, the last time RFC 3339 writes with four digits.
const MAX_ETA_MS: i64 = 253_402_300_799_000;

/// An operation's smoothed rate and the sample it was last moved by.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rate {
    /// Units per second; `None` until two samples have been seen.
    pub per_second: Option<f64>,
    /// `nCompleted` at the anchor.
    pub anchor_n: i64,
    /// When the anchor was sampled (Unix ms, the sample's clock); `None` before the
    /// first sample.
    pub anchor_ms: Option<i64>,
    /// When the agent saw the anchor (Unix ms, the agent's clock): what the ETA counts
    /// from.
    pub seen_ms: Option<i64>,
}

impl Rate {
    /// The rate after a sample of `n` units at `at_ms`, seen by the agent at `seen_ms`.
    pub fn sample(self, n: i64, at_ms: i64, seen_ms: i64) -> Rate {
        let anchored = Rate {
            per_second: None,
            anchor_n: n,
            anchor_ms: Some(at_ms),
            seen_ms: Some(seen_ms),
        };
        let Some(anchor_ms) = self.anchor_ms else {
            return anchored;
        };
        if n < self.anchor_n {
            return anchored;
        }
        if at_ms <= anchor_ms {
            return self;
        }
        // Differences of any two i64 (a snapshotter may report any) fit in i128.
        let dt_ms = (i128::from(at_ms) - i128::from(anchor_ms)) as f64;
        let instant = (i128::from(n) - i128::from(self.anchor_n)) as f64 * 1000.0 / dt_ms;
        let per_second = match self.per_second {
            None => instant,
            Some(previous) => {
                // The weight of the new sample grows with the time it covers.
                let keep = 0.5f64.powf(dt_ms / 1000.0 / RATE_HALF_LIFE_SECONDS);
                previous * keep + instant * (1.0 - keep)
            }
        };
        Rate {
            per_second: per_second.is_finite().then_some(per_second.max(0.0)),
            anchor_n: n,
            anchor_ms: Some(at_ms),
            seen_ms: Some(seen_ms),
        }
    }

    /// When `n_total` will be reached at this rate, counted from when the agent saw the
    /// anchor (Unix ms, the agent's clock);
    /// `None` without a total beyond the anchor, without a rate or with a zero one.
    pub fn eta_ms(&self, n_total: i64) -> Option<i64> {
        let rate = self.per_second.filter(|r| *r > 0.0)?;
        let seen_ms = self.seen_ms?;
        if n_total <= self.anchor_n {
            return None;
        }
        let ms = (i128::from(n_total) - i128::from(self.anchor_n)) as f64 / rate * 1000.0;
        let eta = seen_ms as f64 + ms.ceil();
        // Past the year 9999 (a crawl towards a huge total) is as good as unknown.
        (eta.is_finite() && eta <= MAX_ETA_MS as f64).then_some(eta as i64)
    }
}

/// The time of a sample: the snapshotter's `updated` when it reported one (Go's zero
/// time is none), else `now_ms`.
pub fn sample_time(reported: Option<time::OffsetDateTime>, now_ms: i64) -> i64 {
    reported
        .filter(|t| !crate::phase::is_go_zero(*t))
        .map(|t| t.unix_timestamp_nanos().div_euclid(1_000_000) as i64)
        .unwrap_or(now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(points: &[(i64, i64)]) -> Rate {
        points
            .iter()
            .fold(Rate::default(), |r, &(n, at)| r.sample(n, at, at + SKEW))
    }

    /// How far the agent's clock is ahead of the snapshotter's in these tests.
    const SKEW: i64 = 100_000;

    #[test]
    fn counts_at_the_ends_of_the_range_overflow_nothing() {
        let r = samples(&[(i64::MIN, 10_000), (i64::MAX, 11_000)]);
        let rate = r.per_second.expect("a rate");
        // 2^64 - 1 units in one second.
        assert!(rate.is_finite() && rate > 1.8e19, "{rate}");
        assert_eq!(r.anchor_n, i64::MAX);
        let low = samples(&[(i64::MIN, 10_000), (i64::MIN + 1, 11_000)]);
        assert_eq!(low.eta_ms(i64::MAX), None, "past the year 9999");
        // One unit over 2^64 ms.
        let r = Rate::default()
            .sample(0, i64::MIN, 0)
            .sample(1, i64::MAX, 0);
        assert!(r.per_second.is_some_and(|p| p > 0.0 && p < 1e-16), "{r:?}");
    }

    #[test]
    fn the_first_sample_only_anchors() {
        let r = samples(&[(500, 10_000)]);
        assert_eq!(r.per_second, None);
        assert_eq!((r.anchor_n, r.anchor_ms), (500, Some(10_000)));
        assert_eq!(r.eta_ms(1000), None);
    }

    #[test]
    fn a_steady_pace_reads_as_itself_however_it_is_sampled() {
        let r = samples(&[
            (0, 0),
            (1000, 1000),
            (3000, 3000),
            (3100, 3100),
            (9000, 9000),
        ]);
        let rate = r.per_second.unwrap();
        assert!((rate - 1000.0).abs() < 1e-9, "{rate}");
        // 1000 left at 1000/s: a second after the agent saw the last sample.
        assert_eq!(r.eta_ms(10_000), Some(9000 + SKEW + 1000));
    }

    #[test]
    fn the_average_lies_between_the_paces_seen_and_leans_to_the_recent() {
        let r = samples(&[(0, 0), (1000, 1000), (1500, 2000)]);
        let rate = r.per_second.unwrap();
        assert!(rate > 500.0 && rate < 1000.0, "{rate}");
        // One second of 20 s half-life: the old rate keeps most of its weight.
        let keep = 0.5f64.powf(1.0 / RATE_HALF_LIFE_SECONDS);
        assert!((rate - (1000.0 * keep + 500.0 * (1.0 - keep))).abs() < 1e-9);
        // A long gap weighs the new pace almost alone.
        let later = r.sample(1500 + 100 * 600, 2000 + 600_000, 0);
        assert!((later.per_second.unwrap() - 100.0).abs() < 0.01);
    }

    #[test]
    fn going_backwards_starts_over() {
        let r = samples(&[(0, 0), (1000, 1000), (200, 2000)]);
        assert_eq!(r.per_second, None);
        assert_eq!((r.anchor_n, r.anchor_ms), (200, Some(2000)));
        let r = r.sample(1200, 3000, 3000);
        assert!((r.per_second.unwrap() - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn an_unchanged_clock_changes_nothing_and_the_next_sample_measures_from_the_anchor() {
        let r = samples(&[(0, 0), (1000, 1000)]);
        assert_eq!(r.sample(5000, 1000, 7), r);
        assert_eq!(r.sample(5000, 500, 7), r, "a clock that went back");
        let next = r.sample(3000, 2000, 7);
        // 2000 units in the second since the anchor, not 3000 or 5000.
        let keep = 0.5f64.powf(1.0 / RATE_HALF_LIFE_SECONDS);
        assert!((next.per_second.unwrap() - (1000.0 * keep + 2000.0 * (1.0 - keep))).abs() < 1e-9);
    }

    #[test]
    fn no_eta_without_a_total_a_rate_or_movement() {
        let r = samples(&[(0, 0), (1000, 1000)]);
        assert_eq!(r.eta_ms(0), None, "no total");
        assert_eq!(r.eta_ms(1000), None, "at the total");
        let stopped = samples(&[(0, 0), (0, 1000)]);
        assert_eq!(stopped.per_second, Some(0.0));
        assert_eq!(stopped.eta_ms(1000), None, "zero rate");
        let crawl = samples(&[(0, 0), (1, 1_000_000_000)]);
        assert_eq!(crawl.eta_ms(i64::MAX), None, "beyond any timestamp");
    }

    #[test]
    fn go_zero_time_is_no_time() {
        let zero = time::macros::datetime!(0001-01-01 00:00:00 UTC);
        assert_eq!(sample_time(Some(zero), 42), 42);
        assert_eq!(sample_time(None, 42), 42);
        let t = time::macros::datetime!(2026-11-22 10:00:00.5 UTC);
        assert_eq!(sample_time(Some(t), 42), 1_795_341_600_500);
    }
}
