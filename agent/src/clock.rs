//! Time as the agent keeps it: milliseconds since the Unix epoch ([`UnixMs`]), the unit
//! of every time column in the database. Conversions to and from timestamps and
//! durations happen here, once, so the core and the store pass typed times.

use std::time::Duration;

use rusqlite::types::{FromSql, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use time::OffsetDateTime;

/// A point in time, in milliseconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnixMs(pub i64);

impl UnixMs {
    /// Now: the one place the agent reads the wall clock.
    pub fn now() -> UnixMs {
        UnixMs::of(OffsetDateTime::now_utc())
    }

    /// The millisecond of `t` (rounded down).
    pub fn of(t: OffsetDateTime) -> UnixMs {
        UnixMs(t.unix_timestamp_nanos().div_euclid(1_000_000) as i64)
    }

    /// As a timestamp; a time the agent stored is always in range (else the epoch).
    pub fn time(self) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp_nanos(i128::from(self.0) * 1_000_000)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH)
    }

    /// The raw milliseconds, for the pure phase machine.
    pub fn ms(self) -> i64 {
        self.0
    }

    /// `d` before this, or the earliest time there is.
    pub fn before(self, d: Duration) -> UnixMs {
        UnixMs(self.0.saturating_sub(millis(d)))
    }
}

/// `d` in whole milliseconds, at most `i64::MAX`.
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl ToSql for UnixMs {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        self.0.to_sql()
    }
}

impl FromSql for UnixMs {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
        i64::column_result(value).map(UnixMs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_to_the_millisecond_and_durations_saturate() {
        let t = OffsetDateTime::from_unix_timestamp_nanos(1_700_000_000_123_456_789).unwrap();
        let ms = UnixMs::of(t);
        assert_eq!(ms, UnixMs(1_700_000_000_123));
        assert_eq!(ms.time().unix_timestamp_nanos(), 1_700_000_000_123_000_000);
        assert_eq!(
            UnixMs::of(OffsetDateTime::UNIX_EPOCH - time::Duration::nanoseconds(1)),
            UnixMs(-1)
        );
        assert_eq!(UnixMs(i64::MAX).time(), OffsetDateTime::UNIX_EPOCH);
        assert_eq!(millis(Duration::MAX), i64::MAX);
        assert_eq!(UnixMs(10).before(Duration::from_millis(4)), UnixMs(6));
        assert_eq!(
            UnixMs(i64::MIN).before(Duration::from_secs(1)),
            UnixMs(i64::MIN)
        );
    }
}
