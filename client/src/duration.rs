//! Go duration strings (`"4h0m0s"`, `"90s"`, `"1.5h"`, `"100ms"`).
//!
//! Velero passes `metav1.Duration.String()` as is, so the API speaks Go's format on the
//! wire. [`GoDuration`] parses every form Go's `time.ParseDuration` accepts for
//! non-negative values and formats exactly as Go's `Duration.String()` does, so a value
//! read back from the agent compares equal, as text, to what Velero would print.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A non-negative duration carried as a Go duration string.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration(pub Duration);

impl GoDuration {
    pub const fn from_secs(secs: u64) -> Self {
        GoDuration(Duration::from_secs(secs))
    }

    pub const fn from_millis(ms: u64) -> Self {
        GoDuration(Duration::from_millis(ms))
    }
}

impl From<Duration> for GoDuration {
    fn from(d: Duration) -> Self {
        GoDuration(d)
    }
}

impl From<GoDuration> for Duration {
    fn from(d: GoDuration) -> Self {
        d.0
    }
}

/// Why a duration string was refused; the message quotes the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {reason}")]
pub struct ParseDurationError {
    input: String,
    reason: &'static str,
}

impl FromStr for GoDuration {
    type Err = ParseDurationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |reason| ParseDurationError {
            input: s.to_string(),
            reason,
        };
        let mut rest = s.strip_prefix('+').unwrap_or(s);
        if rest.starts_with('-') {
            return Err(fail("must not be negative"));
        }
        if rest == "0" {
            return Ok(GoDuration(Duration::ZERO));
        }
        if rest.is_empty() {
            return Err(fail("empty"));
        }
        let mut total: u128 = 0;
        while !rest.is_empty() {
            let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
            let int_part = &rest[..int_len];
            rest = &rest[int_len..];
            let mut frac_part = "";
            if let Some(after_dot) = rest.strip_prefix('.') {
                let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
                frac_part = &after_dot[..frac_len];
                rest = &after_dot[frac_len..];
            }
            if int_part.is_empty() && frac_part.is_empty() {
                return Err(fail("expected a number"));
            }
            let unit_len = rest
                .bytes()
                .take_while(|b| !b.is_ascii_digit() && *b != b'.')
                .count();
            let unit = &rest[..unit_len];
            rest = &rest[unit_len..];
            let nanos_per_unit: u128 = match unit {
                "ns" => 1,
                "us" | "µs" | "μs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                "" => return Err(fail("missing unit (one of ns, us, ms, s, m, h)")),
                _ => return Err(fail("unknown unit (use ns, us, ms, s, m or h)")),
            };
            let int: u128 = if int_part.is_empty() {
                0
            } else {
                int_part.parse().map_err(|_| fail("number too large"))?
            };
            let mut value = int
                .checked_mul(nanos_per_unit)
                .ok_or_else(|| fail("too large"))?;
            // Fractional digits beyond nanosecond precision are dropped, as Go does.
            let mut scale = nanos_per_unit;
            for digit in frac_part.bytes() {
                scale /= 10;
                if scale == 0 {
                    break;
                }
                value += u128::from(digit - b'0') * scale;
            }
            total = total.checked_add(value).ok_or_else(|| fail("too large"))?;
        }
        // Go's Duration is an int64 of nanoseconds.
        if total > i64::MAX as u128 {
            return Err(fail("too large"));
        }
        Ok(GoDuration(Duration::from_nanos(total as u64)))
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        if nanos == 0 {
            return f.write_str("0s");
        }
        if nanos < 1_000 {
            return write!(f, "{nanos}ns");
        }
        if nanos < 1_000_000 {
            return write!(f, "{}µs", fraction(nanos, 1_000));
        }
        if nanos < 1_000_000_000 {
            return write!(f, "{}ms", fraction(nanos, 1_000_000));
        }
        let hours = nanos / 3_600_000_000_000;
        let minutes = (nanos / 60_000_000_000) % 60;
        let sec_nanos = nanos % 60_000_000_000;
        let seconds = fraction(sec_nanos, 1_000_000_000);
        if hours > 0 {
            write!(f, "{hours}h{minutes}m{seconds}s")
        } else if minutes > 0 {
            write!(f, "{minutes}m{seconds}s")
        } else {
            write!(f, "{seconds}s")
        }
    }
}

/// `value / unit` as a decimal with trailing zeros of the fraction removed.
fn fraction(value: u128, unit: u128) -> String {
    let whole = value / unit;
    let rest = value % unit;
    if rest == 0 {
        return whole.to_string();
    }
    let width = unit.ilog10() as usize;
    let digits = format!("{rest:0width$}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Duration {
        s.parse::<GoDuration>().expect(s).0
    }

    #[test]
    fn parses_the_forms_velero_prints() {
        assert_eq!(parse("4h0m0s"), Duration::from_secs(4 * 3600));
        assert_eq!(parse("90s"), Duration::from_secs(90));
        assert_eq!(parse("1m30s"), Duration::from_secs(90));
        assert_eq!(parse("1.5h"), Duration::from_secs(5400));
        assert_eq!(parse("100ms"), Duration::from_millis(100));
        assert_eq!(parse("2us"), Duration::from_micros(2));
        assert_eq!(parse("2µs"), Duration::from_micros(2));
        assert_eq!(parse("0"), Duration::ZERO);
        assert_eq!(parse(".5s"), Duration::from_millis(500));
    }

    #[test]
    fn formats_like_go_duration_string() {
        let cases = [
            (Duration::from_secs(4 * 3600), "4h0m0s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(100), "100ms"),
            (Duration::from_micros(1500), "1.5ms"),
            (Duration::from_nanos(12), "12ns"),
            (Duration::ZERO, "0s"),
            (Duration::from_secs(3600 + 1), "1h0m1s"),
        ];
        for (d, text) in cases {
            assert_eq!(GoDuration(d).to_string(), text);
            assert_eq!(parse(text), d, "round trip of {text}");
        }
    }

    #[test]
    fn refuses_bad_input_naming_it() {
        for bad in ["", "10", "5 minutes", "-1s", "1d", "h", "99999999999h"] {
            let err = bad.parse::<GoDuration>().expect_err(bad);
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }
}
