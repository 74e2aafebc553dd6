//! An operation's mutable state as one column (migration 12): its errors, retries,
//! counts, texts, times and rate, in a fixed little-endian layout of its own. A sweep
//! reads and writes it for every operation it polls, and one value costs one column
//! where 17 columns cost 17; what SQL selects or counts by (identity, phase,
//! `cancel_requested`) stays in columns. The layout is hand-written because a generic
//! serializer cost several times as much per state. It is:
//!
//! - byte 0: the layout's version, [`LAYOUT`];
//! - bytes 1–2: which of the optional times (and the rate) are present, a bit each in
//!   [`Optional`]'s order;
//! - `nCompleted`, `nTotal` and the rate's anchor count (i64), the attempts (u32);
//! - every optional value (i64; the rate as f64 bits), in the same order, an absent one
//!   as 0;
//! - four texts, each its length (u32) then its UTF-8 bytes: the error, the units, the
//!   description, the last transient error.
//!
//! A state's size depends on its texts alone, so SQLite rewrites a poll's change in
//! place. Layout 1 left absent values out; migration 13 rewrites it as layout 2. A
//! value that does not decode is read as a new operation's state with the reason
//! ([`read_column`]), so one damaged row stops nothing else.

use crate::phase::OperationState;
use crate::rate::Rate;

/// The layout written: byte 0 of every packed state.
const LAYOUT: u8 = 2;
/// The layout that left absent optional values out; read, never written.
const LAYOUT_SPARSE: u8 = 1;

/// The bytes before the texts: version, presence, three counts, attempts and every
/// optional value.
const FIXED: usize = 1 + 2 + 3 * 8 + 4 + OPTIONALS * 8;

/// How many optional values there are: one presence bit each.
const OPTIONALS: usize = Optional::RateSeen as usize + 1;

/// The optional values, in the order of their presence bits and of their bytes.
#[derive(Clone, Copy)]
enum Optional {
    Started,
    Updated,
    PluginUpdated,
    Progressed,
    NextAttempt,
    RetryingSince,
    Rate,
    RateAt,
    RateSeen,
}

/// The optional values of `state` and `rate`, in [`Optional`]'s order.
fn optionals(state: &OperationState, rate: &Rate) -> [Option<i64>; OPTIONALS] {
    let mut values = [None; OPTIONALS];
    values[Optional::Started as usize] = state.started_ms;
    values[Optional::Updated as usize] = state.updated_ms;
    values[Optional::PluginUpdated as usize] = state.plugin_updated_ms;
    values[Optional::Progressed as usize] = state.progressed_ms;
    values[Optional::NextAttempt as usize] = state.next_attempt_ms;
    values[Optional::RetryingSince as usize] = state.retrying_since_ms;
    values[Optional::Rate as usize] = rate.per_second.map(|r| r.to_bits() as i64);
    values[Optional::RateAt as usize] = rate.anchor_ms;
    values[Optional::RateSeen as usize] = rate.seen_ms;
    values
}

/// `state` (but its phase and creation time, which are columns) and `rate`, packed.
pub fn pack(state: &OperationState, rate: &Rate) -> rusqlite::Result<Vec<u8>> {
    let mut out = Vec::new();
    pack_into(&mut out, state, rate)?;
    Ok(out)
}

/// [`pack`] into `out`, cleared first: a sweep packs thousands into one buffer.
pub fn pack_into(out: &mut Vec<u8>, state: &OperationState, rate: &Rate) -> rusqlite::Result<()> {
    let texts = [
        &state.error,
        &state.operation_units,
        &state.description,
        &state.last_error,
    ];
    let text_len: usize = texts.iter().map(|t| t.len()).sum();
    // The fixed part is laid out on the stack and copied once: a copy per value into
    // the list cost three times as much.
    let mut fixed = [0u8; FIXED];
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        fixed[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    };
    let optionals = optionals(state, rate);
    let present = optionals
        .iter()
        .enumerate()
        .fold(0u16, |bits, (i, v)| bits | (u16::from(v.is_some()) << i));
    put(&[LAYOUT]);
    put(&present.to_le_bytes());
    for n in [state.n_completed, state.n_total, rate.anchor_n] {
        put(&n.to_le_bytes());
    }
    put(&state.attempts.to_le_bytes());
    for v in optionals {
        put(&v.unwrap_or(0).to_le_bytes());
    }
    out.clear();
    out.reserve(at + 4 * 4 + text_len);
    out.extend_from_slice(&fixed[..at]);
    for text in texts {
        let len = u32::try_from(text.len()).map_err(|_| {
            rusqlite::Error::ToSqlConversionFailure(
                format!("an operation's text of {} bytes is too long", text.len()).into(),
            )
        })?;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    }
    Ok(())
}

/// What a new operation starts with: nothing reported, no rate.
pub fn initial() -> rusqlite::Result<Vec<u8>> {
    pack(&OperationState::default(), &Rate::default())
}

/// Why a stored state did not decode.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UnpackError(String);

/// The bytes of a packed state, read from the front.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let end = self.at + N;
        let taken = self
            .bytes
            .get(self.at..end)
            .and_then(|b| <[u8; N]>::try_from(b).ok())
            .ok_or_else(|| format!("cut short at byte {}", self.at))?;
        self.at = end;
        Ok(taken)
    }

    fn i64(&mut self) -> Result<i64, String> {
        self.take::<8>().map(i64::from_le_bytes)
    }

    fn text(&mut self, what: &str) -> Result<String, String> {
        let len = u32::from_le_bytes(self.take::<4>()?) as usize;
        let start = self.at;
        let bytes = self
            .bytes
            .get(start..start.saturating_add(len))
            .ok_or_else(|| format!("cut short in the {what} at byte {start}"))?;
        self.at = start + len;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|e| format!("the {what} is not UTF-8: {e}"))
    }
}

/// Fills `state`'s packed fields (not its phase or creation time) from `bytes`;
/// returns the rate. Read through [`read_column`] where a query gives the bytes.
fn unpack_into(bytes: &[u8], state: &mut OperationState) -> Result<Rate, UnpackError> {
    let error = |why: String| {
        UnpackError(format!(
            "an operation's packed state ({} bytes) does not decode: {why}",
            bytes.len()
        ))
    };
    let mut r = Reader { bytes, at: 0 };
    let [layout] = r.take::<1>().map_err(error)?;
    if layout != LAYOUT && layout != LAYOUT_SPARSE {
        return Err(error(format!(
            "layout {layout}, not {LAYOUT} (or {LAYOUT_SPARSE})"
        )));
    }
    let present = u16::from_le_bytes(r.take::<2>().map_err(error)?);
    if present >> OPTIONALS != 0 {
        return Err(error(format!("unknown presence bits {present:#x}")));
    }
    let mut read = || -> Result<Rate, String> {
        state.n_completed = r.i64()?;
        state.n_total = r.i64()?;
        let anchor_n = r.i64()?;
        state.attempts = u32::from_le_bytes(r.take::<4>()?);
        let mut optional = |o: Optional| -> Result<Option<i64>, String> {
            let is_present = present & (1 << o as u16) != 0;
            if !is_present && layout == LAYOUT_SPARSE {
                return Ok(None);
            }
            let value = r.i64()?;
            Ok(is_present.then_some(value))
        };
        state.started_ms = optional(Optional::Started)?;
        state.updated_ms = optional(Optional::Updated)?;
        state.plugin_updated_ms = optional(Optional::PluginUpdated)?;
        state.progressed_ms = optional(Optional::Progressed)?;
        state.next_attempt_ms = optional(Optional::NextAttempt)?;
        state.retrying_since_ms = optional(Optional::RetryingSince)?;
        let per_second = optional(Optional::Rate)?.map(|bits| f64::from_bits(bits as u64));
        let anchor_ms = optional(Optional::RateAt)?;
        let seen_ms = optional(Optional::RateSeen)?;
        state.error = r.text("error")?;
        state.operation_units = r.text("units")?;
        state.description = r.text("description")?;
        state.last_error = r.text("last error")?;
        if r.at != bytes.len() {
            return Err(format!("{} bytes left over", bytes.len() - r.at));
        }
        Ok(Rate {
            per_second,
            anchor_n,
            anchor_ms,
            seen_ms,
        })
    };
    read().map_err(error)
}

/// Column `index` of `row` unpacked into `state`; a value that is not a packed state is
/// the column's conversion error.
pub fn from_column(
    row: &rusqlite::Row<'_>,
    index: usize,
    state: &mut OperationState,
) -> rusqlite::Result<Rate> {
    read_column(row, index, state).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(index, rusqlite::types::Type::Blob, Box::new(e))
    })
}

/// Column `index` of `row` unpacked into `state`. If it is not a packed state (a row
/// damaged outside the agent), `state`'s packed fields are left as a new operation's
/// and the error says why: the callers go on with the other operations, and a poll
/// writes the state afresh from the snapshotter's answer.
pub fn read_column(
    row: &rusqlite::Row<'_>,
    index: usize,
    state: &mut OperationState,
) -> Result<Rate, UnpackError> {
    use rusqlite::types::ValueRef;
    let read = match row.get_ref(index) {
        Ok(ValueRef::Blob(bytes)) => unpack_into(bytes, state),
        Ok(other) => Err(UnpackError(format!(
            "an operation's state is stored as {}, not as a packed state",
            other.data_type()
        ))),
        Err(e) => Err(UnpackError(format!(
            "an operation's state cannot be read: {e}"
        ))),
    };
    read.inspect_err(|_| {
        let (phase, created_ms) = (state.phase, state.created_ms);
        *state = OperationState {
            phase,
            created_ms,
            ..OperationState::default()
        };
    })
}

/// `state` and `rate` in layout 1, as migration 12 packed them before layout 2: the
/// test of migration 13 starts from it.
#[cfg(test)]
pub fn pack_sparse(state: &OperationState, rate: &Rate) -> Vec<u8> {
    let optionals = optionals(state, rate);
    let present = optionals
        .iter()
        .enumerate()
        .fold(0u16, |bits, (i, v)| bits | (u16::from(v.is_some()) << i));
    let mut out = vec![LAYOUT_SPARSE];
    out.extend_from_slice(&present.to_le_bytes());
    for n in [state.n_completed, state.n_total, rate.anchor_n] {
        out.extend_from_slice(&n.to_le_bytes());
    }
    out.extend_from_slice(&state.attempts.to_le_bytes());
    for v in optionals.into_iter().flatten() {
        out.extend_from_slice(&v.to_le_bytes());
    }
    for text in [
        &state.error,
        &state.operation_units,
        &state.description,
        &state.last_error,
    ] {
        out.extend_from_slice(&(text.len() as u32).to_le_bytes());
        out.extend_from_slice(text.as_bytes());
    }
    out
}

/// `bytes` unpacked into a state of phase New created at 0, and its rate.
#[cfg(test)]
pub fn unpack(bytes: &[u8]) -> Result<(OperationState, Rate), UnpackError> {
    let mut state = OperationState::default();
    let rate = unpack_into(bytes, &mut state)?;
    Ok((state, rate))
}

#[cfg(test)]
mod tests {
    use super::*;
    use opmon_client::OperationPhase;

    #[test]
    fn every_field_comes_back_and_phase_and_creation_are_not_packed() {
        let state = OperationState {
            phase: OperationPhase::InProgress,
            error: "é error".into(),
            n_completed: -3,
            n_total: i64::MAX,
            operation_units: "bytes".into(),
            description: "copying \u{0}".into(),
            created_ms: 77,
            started_ms: Some(0),
            updated_ms: Some(i64::MIN),
            plugin_updated_ms: None,
            progressed_ms: Some(5),
            attempts: u32::MAX,
            last_error: "transient".into(),
            next_attempt_ms: Some(9),
            retrying_since_ms: Some(8),
        };
        let rate = Rate {
            per_second: Some(1.5),
            anchor_n: 4,
            anchor_ms: Some(6),
            seen_ms: None,
        };
        let (back, back_rate) = unpack(&pack(&state, &rate).expect("packs")).expect("decodes");
        assert_eq!(back_rate, rate);
        assert_eq!(back.phase, OperationPhase::New);
        assert_eq!(back.created_ms, 0);
        let mut expected = state;
        expected.phase = OperationPhase::New;
        expected.created_ms = 0;
        assert_eq!(back, expected);
        let (fresh, fresh_rate) = unpack(&initial().expect("packs")).expect("decodes");
        assert_eq!(
            (fresh, fresh_rate),
            (OperationState::default(), Rate::default())
        );
    }

    #[test]
    fn a_blob_that_is_cut_short_or_not_utf8_is_an_error_not_a_state() {
        let state = OperationState {
            description: "copying".into(),
            ..OperationState::default()
        };
        let bytes = pack(&state, &Rate::default()).expect("packs");
        for len in 0..bytes.len() {
            let e = unpack(&bytes[..len]).expect_err("a prefix does not decode");
            assert!(e.to_string().contains(&format!("({len} bytes)")), "{e}");
        }
        let mut bad = bytes.clone();
        let at = bad
            .iter()
            .position(|&b| b == b'c')
            .expect("the text is there");
        bad[at] = 0xff;
        let e = unpack(&bad).expect_err("not UTF-8");
        assert!(e.to_string().contains("description is not UTF-8"), "{e}");
        let mut longer = bytes.clone();
        longer.push(0);
        let e = unpack(&longer).expect_err("a byte too many");
        assert!(e.to_string().contains("1 bytes left over"), "{e}");
        let mut other = bytes.clone();
        other[0] = 3;
        let e = unpack(&other).expect_err("another layout");
        assert!(e.to_string().contains("layout 3, not 2 (or 1)"), "{e}");
        let mut bits = bytes;
        bits[2] = 0x80;
        let e = unpack(&bits).expect_err("a bit no field has");
        assert!(
            e.to_string().contains("unknown presence bits 0x8000"),
            "{e}"
        );
    }

    #[test]
    fn a_state_is_as_long_whatever_times_it_has_and_a_rate_keeps_its_bits() {
        let fresh = initial().expect("packs");
        // Layout, presence, three counts, attempts, nine optional values, four empty
        // texts: absent values take their place, so a write of new times and counts
        // is a cell of the same size, which SQLite overwrites where it stands.
        assert_eq!(fresh.len(), 1 + 2 + 3 * 8 + 4 + 9 * 8 + 4 * 4);
        let rate = Rate {
            per_second: Some(f64::MIN_POSITIVE),
            anchor_n: 3,
            anchor_ms: Some(i64::MAX),
            seen_ms: Some(-1),
        };
        let timed = OperationState {
            started_ms: Some(1),
            updated_ms: Some(2),
            plugin_updated_ms: Some(3),
            progressed_ms: Some(4),
            next_attempt_ms: Some(5),
            retrying_since_ms: Some(6),
            ..OperationState::default()
        };
        let packed = pack(&timed, &rate).expect("packs");
        assert_eq!(packed.len(), fresh.len());
        assert_eq!(unpack(&packed).expect("decodes"), (timed, rate));
    }

    /// Layout 1, as migration 12 wrote it before layout 2: absent values left out.
    #[test]
    fn the_sparse_layout_of_before_is_still_read() {
        let mut sparse = vec![1u8];
        // Present: started (bit 0) and the rate (bit 6).
        sparse.extend_from_slice(&(1u16 | 1 << 6).to_le_bytes());
        for n in [7i64, 9, 2] {
            sparse.extend_from_slice(&n.to_le_bytes());
        }
        sparse.extend_from_slice(&4u32.to_le_bytes());
        sparse.extend_from_slice(&1_000i64.to_le_bytes());
        sparse.extend_from_slice(&2.5f64.to_bits().to_le_bytes());
        for text in ["", "bytes", "copying", "timeout"] {
            sparse.extend_from_slice(&(text.len() as u32).to_le_bytes());
            sparse.extend_from_slice(text.as_bytes());
        }
        let (state, rate) = unpack(&sparse).expect("layout 1 decodes");
        assert_eq!(
            state,
            OperationState {
                n_completed: 7,
                n_total: 9,
                attempts: 4,
                started_ms: Some(1_000),
                operation_units: "bytes".into(),
                description: "copying".into(),
                last_error: "timeout".into(),
                ..OperationState::default()
            }
        );
        assert_eq!(
            rate,
            Rate {
                per_second: Some(2.5),
                anchor_n: 2,
                ..Rate::default()
            }
        );
        // Read as layout 2, the same bytes are short of the absent values.
        let mut as_fixed = sparse.clone();
        as_fixed[0] = 2;
        assert!(unpack(&as_fixed).is_err());
        for len in 0..sparse.len() {
            assert!(unpack(&sparse[..len]).is_err(), "a prefix of {len} bytes");
        }
        // Written again, it is layout 2, of the fixed size.
        let again = pack(&state, &rate).expect("packs");
        assert_eq!((again[0], again.len()), (2, FIXED + 4 * 4 + 19));
        assert_eq!(unpack(&again).expect("decodes"), (state, rate));
    }
}
