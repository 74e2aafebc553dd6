//! JSON written byte for byte as Go's `encoding/json` writes it, for the files Velero
//! reads: an `Encoder` with its defaults, as Velero's `encode.ToJSONGzip` and its restore
//! controller use it.
//!
//! serde_json's compact output already agrees with Go's on structure, integers and most
//! of string escaping (`\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f` — Go writes the last two
//! this way since 1.22, and Velero is built with a newer Go — and `\u00xx` in lowercase
//! hex for the other control characters). Two differences are made up here: Go escapes
//! `<`, `>` and `&` (`\u003c`, `\u003e`, `\u0026`, its HTML-safe default) and U+2028 and
//! U+2029 (`\u2028`, `\u2029`); and `Encoder.Encode` ends the value with a newline.
//! Floats and maps, where the two differ further, do not occur in what is written here.

use std::io;

use serde::Serialize;
use serde_json::ser::{Formatter, Serializer};

/// serde_json's compact formatter, with Go's extra escapes in strings.
struct GoFormatter;

impl Formatter for GoFormatter {
    fn write_string_fragment<W>(&mut self, writer: &mut W, fragment: &str) -> io::Result<()>
    where
        W: ?Sized + io::Write,
    {
        let bytes = fragment.as_bytes();
        let mut start = 0;
        let mut i = 0;
        while i < bytes.len() {
            let (escaped, len): (&[u8], usize) = match bytes[i] {
                b'<' => (b"\\u003c", 1),
                b'>' => (b"\\u003e", 1),
                b'&' => (b"\\u0026", 1),
                // U+2028 and U+2029 are E2 80 A8 and E2 80 A9 in UTF-8.
                0xE2 if bytes.get(i + 1) == Some(&0x80) && bytes.get(i + 2) == Some(&0xA8) => {
                    (b"\\u2028", 3)
                }
                0xE2 if bytes.get(i + 1) == Some(&0x80) && bytes.get(i + 2) == Some(&0xA9) => {
                    (b"\\u2029", 3)
                }
                _ => {
                    i += 1;
                    continue;
                }
            };
            writer.write_all(&bytes[start..i])?;
            writer.write_all(escaped)?;
            i += len;
            start = i;
        }
        writer.write_all(&bytes[start..])
    }
}

/// `value` as Go's `json.Marshal(value)` returns it: compact, HTML-safe, no newline (how
/// Velero writes each item of a backup tarball).
pub fn marshal<T: Serialize + ?Sized>(value: &T) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut serializer = Serializer::with_formatter(&mut out, GoFormatter);
    value.serialize(&mut serializer).map_err(io::Error::from)?;
    Ok(out)
}

/// Writes `value` as Go's `json.NewEncoder(writer).Encode(value)` does: compact,
/// HTML-safe, followed by a newline.
pub fn encode<W: io::Write, T: Serialize + ?Sized>(mut writer: W, value: &T) -> io::Result<()> {
    let mut serializer = Serializer::with_formatter(&mut writer, GoFormatter);
    value.serialize(&mut serializer).map_err(io::Error::from)?;
    writer.write_all(b"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded<T: Serialize + ?Sized>(value: &T) -> String {
        let mut out = Vec::new();
        encode(&mut out, value).unwrap();
        String::from_utf8(out).unwrap()
    }

    // The expected texts are what Go 1.22+ prints for
    // json.NewEncoder(os.Stdout).Encode(v) with the same values.

    #[test]
    fn html_characters_and_line_separators_are_escaped_as_go_escapes_them() {
        assert_eq!(
            encoded("a<b>&c\u{2028}d\u{2029}e"),
            "\"a\\u003cb\\u003e\\u0026c\\u2028d\\u2029e\"\n"
        );
        // Other characters of the same lead byte (U+2026 …) pass as they are.
        assert_eq!(encoded("…€"), "\"…€\"\n");
    }

    #[test]
    fn marshal_is_encode_without_the_newline() {
        let value = serde_json::json!({"b": "<x>", "a": "&"});
        assert_eq!(
            String::from_utf8(marshal(&value).unwrap()).unwrap(),
            "{\"a\":\"\\u0026\",\"b\":\"\\u003cx\\u003e\"}"
        );
    }

    #[test]
    fn control_characters_use_go_short_forms_and_lowercase_hex() {
        assert_eq!(
            encoded("\u{8}\u{c}\n\r\t\u{1}\u{1f}\u{7f}\"\\/"),
            "\"\\b\\f\\n\\r\\t\\u0001\\u001f\u{7f}\\\"\\\\/\"\n"
        );
    }

    #[test]
    fn structures_are_compact_and_end_with_a_newline() {
        let value = serde_json::json!([{"a": [1, -2], "b": null, "c": "x"}, []]);
        assert_eq!(
            encoded(&value),
            "[{\"a\":[1,-2],\"b\":null,\"c\":\"x\"},[]]\n"
        );
    }
}
