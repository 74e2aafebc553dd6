//! Text from peers made safe to show: the CLI's tables and the agent's human-format log
//! print descriptions, errors and operation IDs that a snapshotter or client chose, and
//! those must not move the cursor, recolour the terminal, or start a line of their own.
//!
//! [`escape_controls`] writes every control character visibly instead: C0 (including
//! CR, LF and TAB), DEL, C1 (which some terminals treat as escape sequences too), and the
//! Unicode bidirectional overrides and isolates (which reorder what a reader sees).
//! Everything else, including any other non-ASCII text, is left as it is.

use std::borrow::Cow;
use std::fmt::Write;

/// Whether `c` is shown escaped.
fn is_unsafe(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with each control character written as an escape: `\n`, `\r`, `\t`, `\x1b`
/// (other C0 and DEL as `\xNN`), `\u{9b}` (C1 and bidi controls). Borrowed when there
/// is nothing to escape.
pub fn escape_controls(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if is_unsafe(c) && (c as u32) < 0x80 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if is_unsafe(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_are_written_as_escapes_and_the_rest_is_kept() {
        assert_eq!(
            escape_controls("a\u{1b}[31mred\r\nfake\u{7}\u{9b}2J\u{202e}ß🦀\t\u{7f}"),
            "a\\x1b[31mred\\r\\nfake\\x07\\u{9b}2J\\u{202e}ß🦀\\t\\x7f"
        );
        assert!(matches!(
            escape_controls("plain ü"),
            Cow::Borrowed("plain ü")
        ));
    }
}
