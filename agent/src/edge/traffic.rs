//! The JSON-RPC traffic as the peer saw it: with the log filter `opmon_traffic=trace`,
//! each exchange (a call, a batch, a subscription notification) is one event under
//! [`TARGET`] whose field `exchange` is a JSON object, so the end-to-end suite checks
//! the OpenRPC documents against everything it does (tests/openrpc/traffic.py). Off,
//! a call costs one filter lookup.

use std::borrow::Cow;

use serde_json::value::RawValue;

/// The tracing target of traffic events.
pub const TARGET: &str = "opmon_traffic";

pub(crate) fn enabled() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::TRACE)
}

/// Logs one exchange; `request` and `response` are JSON texts.
pub(crate) fn exchange(request: &str, response: &RawValue) {
    tracing::trace!(
        target: TARGET,
        exchange = %format_args!(
            r#"{{"request":{},"response":{}}}"#,
            loggable(request),
            loggable(response.get())
        )
    );
}

/// `json` with the characters the log writes as Rust escapes (DEL and the C1 controls,
/// which serde_json leaves raw: `tracing-subscriber` guards terminals from them) written
/// as JSON escapes instead, so the logged text is still the same JSON.
fn loggable(json: &str) -> Cow<'_, str> {
    let guarded = |c: char| c == '\u{7f}' || ('\u{80}'..='\u{9f}').contains(&c);
    if !json.contains(guarded) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        match guarded(c) {
            true => out.push_str(&format!("\\u{:04x}", c as u32)),
            false => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Logs a notification of subscription method `method` whose result is `result`.
pub fn notification(method: &str, result: &RawValue) {
    if enabled() {
        let method = serde_json::to_string(method).unwrap_or_default();
        tracing::trace!(
            target: TARGET,
            exchange = %format_args!(
                r#"{{"notification":{method},"result":{}}}"#,
                loggable(result.get())
            )
        );
    }
}
