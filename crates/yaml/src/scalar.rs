//! Scalars for the fast path: plain scalars typed exactly as serde-saphyr types them with our options
//! (YAML 1.1 booleans, legacy octal), quoted scalars on one line. Every function answers `None` for
//! anything it is not certain about, and the document goes to serde-saphyr.

use serde_json::Value;

/// The value serde-saphyr gives an untagged plain scalar (already trimmed), when it is certain.
///
/// serde-saphyr tries, in order: null (`~`, `null`, `Null`, `NULL`), a YAML 1.1 boolean (`yes`, `on`, `y`,
/// ... in any case), an integer (decimal, `0x`, `0o`, `0b`, legacy octal `0777`, underscores), a float
/// (Rust's syntax plus `.inf` / `.nan`), and a string otherwise. Here: null and booleans exactly, plain
/// decimal integers, and strings that can be none of the others; any other number-like text declines.
pub(crate) fn plain(text: &str) -> Option<Value> {
    if matches!(text, "" | "~" | "null" | "Null" | "NULL") {
        return Some(Value::Null);
    }
    if let Some(b) = yaml11_bool(text) {
        return Some(Value::Bool(b));
    }
    let first = *text.as_bytes().first()?;
    match first {
        b'0'..=b'9' => digit_first(text),
        b'-' => negative_integer(text),
        // `+1`, `.5`, `.inf`: numbers of forms not handled here.
        b'+' | b'.' => None,
        // No integer or float starts otherwise: Rust's float syntax also reads `inf` and `nan`, but
        // serde-saphyr rejects those non-finite results and keeps the text.
        _ => Some(Value::String(text.to_owned())),
    }
}

/// A plain mapping key: kept only when it is a string for certain (serde-saphyr reads a key like `80` or
/// `yes` through its own rules), and never the merge key `<<` or anything with a colon.
pub(crate) fn plain_key(text: &str) -> Option<String> {
    if text.len() > MAX_KEY || text.starts_with('<') || text.contains(':') {
        return None;
    }
    match plain(text)? {
        Value::String(s) => Some(s),
        _ => None,
    }
}

/// YAML forbids implicit keys longer than 1024 characters (serde-saphyr's scanner looks that far ahead for
/// the colon); stay well below, counting from the key's first character to its colon.
pub(crate) const MAX_KEY: usize = 1000;

/// A quoted mapping key at the start of `s` (see [`quoted`]), no longer than a plain one may be.
pub(crate) fn quoted_key(s: &str) -> Option<(String, &str)> {
    let (key, rest) = quoted(s)?;
    (s.len() - rest.len() <= MAX_KEY).then_some((key, rest))
}

fn yaml11_bool(t: &str) -> Option<bool> {
    let is = |w: &str| t.eq_ignore_ascii_case(w);
    if is("true") || is("yes") || is("y") || is("on") {
        Some(true)
    } else if is("false") || is("no") || is("n") || is("off") {
        Some(false)
    } else {
        None
    }
}

/// Text starting with a digit: `0`, a decimal without leading zero that fits 64 bits, or a string that
/// no number syntax accepts (a dotted quad, a time `12:30`, a path).
fn digit_first(t: &str) -> Option<Value> {
    let b = t.as_bytes();
    if t == "0" || (b[0] != b'0' && b.len() <= 19 && b.iter().all(u8::is_ascii_digit)) {
        return t.parse::<u64>().ok().map(Value::from);
    }
    let dots = b.iter().filter(|&&c| c == b'.').count();
    let dotted = dots >= 2 && b.iter().all(|&c| c.is_ascii_digit() || c == b'.');
    // Integer digits are [0-9a-fA-F_] after a sign and a radix prefix; floats [0-9.eE+-]. Any other
    // character makes both fail.
    let foreign = b
        .iter()
        .any(|&c| !(c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'+' | b'-')));
    (dotted || foreign).then(|| Value::String(t.to_owned()))
}

/// `-` and a decimal without leading zero that fits in an i64.
fn negative_integer(t: &str) -> Option<Value> {
    let digits = &t.as_bytes()[1..];
    let decimal = !digits.is_empty()
        && digits[0] != b'0'
        && digits.len() <= 18
        && digits.iter().all(u8::is_ascii_digit);
    if !decimal {
        return None;
    }
    t.parse::<i64>().ok().map(Value::from)
}

/// A quoted scalar at the start of `s` (which starts with `'` or `"`), ending on the same line: its
/// value and what follows the closing quote. Double-quoted escapes beyond `\\ \" \/ \n \t \r \0` decline.
pub(crate) fn quoted(s: &str) -> Option<(String, &str)> {
    let b = s.as_bytes();
    let single = b[0] == b'\'';
    let mut out = String::new();
    let mut run = 1; // start of the literal run not yet copied
    let mut i = 1;
    while i < b.len() {
        match (b[i], single) {
            (b'\n', _) => return None,
            (b'\'', true) if b.get(i + 1) == Some(&b'\'') => {
                out.push_str(&s[run..=i]);
                i += 2;
                run = i;
            }
            (b'\'', true) | (b'"', false) => {
                out.push_str(&s[run..i]);
                return Some((out, &s[i + 1..]));
            }
            (b'\\', false) => {
                out.push_str(&s[run..i]);
                out.push(escape(*b.get(i + 1)?)?);
                i += 2;
                run = i;
            }
            _ => i += 1,
        }
    }
    None
}

fn escape(c: u8) -> Option<char> {
    Some(match c {
        b'\\' => '\\',
        b'"' => '"',
        b'/' => '/',
        b'n' => '\n',
        b't' => '\t',
        b'r' => '\r',
        b'0' => '\0',
        _ => return None,
    })
}

/// Whether a plain scalar may start with `s` (YAML's indicators may not start one, except `-` before a
/// digit here).
pub(crate) fn may_start_plain(s: &str) -> bool {
    let b = s.as_bytes();
    match b.first() {
        None => false,
        Some(b'-') => b.get(1).is_some_and(u8::is_ascii_digit),
        Some(c) => !b"?:,[]{}#&*!|>'\"%@`".contains(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_scalars_typed_or_declined() {
        let cases = [
            ("80", Some(json!(80))),
            ("0", Some(json!(0))),
            ("-12", Some(json!(-12))),
            ("yes", Some(json!(true))),
            ("Off", Some(json!(false))),
            ("~", Some(json!(null))),
            ("10.96.0.1", Some(json!("10.96.0.1"))),
            ("12:30", Some(json!("12:30"))),
            ("nginx:1.25", Some(json!("nginx:1.25"))),
            ("inf", Some(json!("inf"))),
            ("0777", None),
            ("0x1F", None),
            ("1_000", None),
            ("1.5", None),
            ("1e3", None),
            (".inf", None),
            ("+1", None),
            ("-0", None),
            ("99999999999999999999", None),
        ];
        for (text, want) in cases {
            assert_eq!(plain(text), want, "{text}");
        }
    }

    #[test]
    fn quoted_scalars_on_one_line() {
        assert_eq!(quoted("'it''s' x"), Some(("it's".into(), " x")));
        assert_eq!(quoted(r#""a\"b\\c" #"#), Some(("a\"b\\c".into(), " #")));
        assert_eq!(quoted("\"a\nb\""), None);
        assert_eq!(quoted(r#""\x41""#), None);
        assert_eq!(quoted("'open"), None);
    }
}
