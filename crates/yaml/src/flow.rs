//! Flow collections (`[a, b]`, `{k: v, l: [x]}`) that open and close on one line, for the fast path.
//! An explicit stack, not recursion: nesting is bounded by the caller's depth budget.

use serde_json::{Map, Value};

use super::scalar;

enum Frame {
    Seq(Vec<Value>),
    /// The mapping so far and the key whose value is being read.
    Map(Map<String, Value>, Option<String>),
}

/// What the parser looks for next.
#[derive(Clone, Copy, PartialEq)]
enum Expect {
    /// Just after `[` or `{`: an item, or the closing bracket of an empty collection.
    FirstItem,
    /// After a comma: an item (a trailing comma declines).
    Item,
    /// After an item: a comma or the closing bracket.
    CommaOrClose,
}

/// Parses the flow collection that starts `s` (at `[` or `{`; `s` ends where its line ends): its value and
/// the rest of the line after the closing bracket. `depth` is how many more levels of nesting are allowed.
/// A collection that does not close on the line declines.
pub(crate) fn parse(s: &str, depth: usize) -> Option<(Value, &str)> {
    let b = s.as_bytes();
    let mut stack: Vec<Frame> = Vec::new();
    let mut i = 0;
    let mut expect = Expect::Item;
    loop {
        while b.get(i) == Some(&b' ') {
            i += 1;
        }
        let c = *b.get(i)?;
        if c == b'#' {
            return None; // a comment inside (the end of `s` is the end of the line)
        }
        if expect == Expect::CommaOrClose
            || (expect == Expect::FirstItem && matches!(c, b']' | b'}'))
        {
            match (c, stack.last()) {
                (b',', Some(_)) => {
                    expect = Expect::Item;
                    i += 1;
                    continue;
                }
                (b']', Some(Frame::Seq(_))) | (b'}', Some(Frame::Map(_, None))) => {}
                _ => return None,
            }
            i += 1;
            let value = match stack.pop()? {
                Frame::Seq(items) => Value::Array(items),
                Frame::Map(map, _) => Value::Object(map),
            };
            if stack.is_empty() {
                return Some((value, &s[i..]));
            }
            attach(&mut stack, value)?;
            expect = Expect::CommaOrClose;
            continue;
        }
        if let Some(Frame::Map(_, key @ None)) = stack.last_mut() {
            let (k, rest) = flow_key(&s[i..])?;
            *key = Some(k);
            i = s.len() - rest.len();
            continue;
        }
        match c {
            b'[' | b'{' => {
                if stack.len() >= depth {
                    return None;
                }
                stack.push(if c == b'[' {
                    Frame::Seq(Vec::new())
                } else {
                    Frame::Map(Map::new(), None)
                });
                i += 1;
                expect = Expect::FirstItem;
                continue;
            }
            _ if stack.is_empty() => return None,
            b'\'' | b'"' => {
                let (value, rest) = scalar::quoted(&s[i..])?;
                i = s.len() - rest.len();
                attach(&mut stack, Value::String(value))?;
            }
            _ => {
                let len = plain_len(&s[i..])?;
                let text = s[i..i + len].trim_end_matches(' ');
                i += len;
                attach(&mut stack, scalar::plain(text)?)?;
            }
        }
        expect = Expect::CommaOrClose;
    }
}

/// Adds a finished value to the innermost collection (under its pending key for a mapping; a key given
/// twice declines).
fn attach(stack: &mut [Frame], value: Value) -> Option<()> {
    match stack.last_mut()? {
        Frame::Seq(items) => items.push(value),
        Frame::Map(map, key) => {
            if map.insert(key.take()?, value).is_some() {
                return None;
            }
        }
    }
    Some(())
}

/// A mapping key at the start of `s`, then `: ` and the spaces after it: the key and what follows.
fn flow_key(s: &str) -> Option<(String, &str)> {
    let (key, rest) = if s.starts_with(['\'', '"']) {
        scalar::quoted_key(s)?
    } else {
        let b = s.as_bytes();
        let len = b.iter().position(|&c| c == b':')?;
        if len > scalar::MAX_KEY {
            return None;
        }
        let text = &s[..len];
        if text.bytes().any(|c| b",[]{}#".contains(&c)) {
            return None;
        }
        let text = text.trim_end_matches(' ');
        if !scalar::may_start_plain(text) {
            return None;
        }
        (scalar::plain_key(text)?, &s[len..])
    };
    // A value must follow after a space: `{a:b}` and `{a: }` decline.
    let rest = rest.strip_prefix(": ")?.trim_start_matches(' ');
    if rest.starts_with([',', '}', ']', '#']) || rest.is_empty() {
        return None;
    }
    Some((key, rest))
}

/// The length of a plain scalar in flow context at the start of `b`: up to a flow indicator, a comment
/// or the end of the line. A colon anywhere declines (a single-pair mapping, or a key without a space).
fn plain_len(s: &str) -> Option<usize> {
    if !scalar::may_start_plain(s) {
        return None;
    }
    let b = s.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b',' | b'[' | b']' | b'{' | b'}' => return Some(i),
            b'#' if b[i - 1] == b' ' => return None,
            b':' => return None,
            _ => {}
        }
    }
    Some(b.len())
}
