//! A strictly linear parser for the block subset of YAML that ordinary Kubernetes manifests use, about
//! ten times faster than serde-saphyr on them (`benches/manifests.rs`).
//!
//! It returns exactly the value serde-saphyr (with `super`'s options) returns for the same text, or
//! declines (`None`) as soon as it meets anything outside the subset, and the caller parses the document
//! with serde-saphyr, which also words the errors. The subset:
//! - block mappings and sequences, `- key: v` compact mappings, a sequence at its key's indentation;
//! - plain scalars on one line, typed as serde-saphyr types them where that is certain (`scalar.rs`);
//!   single- and double-quoted scalars on one line (a few escapes);
//! - flow collections that open and close on one line (`flow.rs`), comments, blank lines.
//!
//! It declines: anchors, aliases, tags, block scalars (`|`, `>`), multi-line scalars and flow
//! collections, explicit keys (`?`), merge keys, duplicate keys, non-string keys, directives, tabs, carriage
//! returns, anything non-ASCII or non-printable, nesting deeper than [`MAX_DEPTH`], long runs of comments
//! (`MAX_COMMENT_RUN`), and numbers other than plain decimal integers. Every line is looked at once (a few
//! constant passes), and containers are built on an explicit stack, so the work is linear in the text and the
//! fallback at most doubles it.

use serde_json::{Map, Value};

use super::{flow, scalar};

/// Deepest nesting accepted, block and flow together: well inside serde-saphyr's limit (`super::MAX_DEPTH`),
/// so that a document it would reject for depth is never accepted here.
pub(crate) const MAX_DEPTH: usize = 32;

/// Comments in a row (comment lines, and the one that may end the line before them) accepted. Past 32 (its
/// budget's default) or 96 (its parser's), serde-saphyr stops at some places where it looks ahead ("too many
/// buffered comments").
const MAX_COMMENT_RUN: usize = 24;

/// The value of `text` (one document), or `None` if it is outside the subset.
pub fn parse(text: &str) -> Option<Value> {
    if !text
        .bytes()
        .all(|c| c == b'\n' || (b' '..=b'~').contains(&c))
    {
        return None;
    }
    let mut parser = Parser::default();
    let mut comments = 0;
    for line in text.split('\n') {
        let content = line.trim_start_matches(' ');
        if content.is_empty() {
            continue;
        }
        if content.starts_with('#') {
            comments += 1;
            if comments > MAX_COMMENT_RUN {
                return None;
            }
            continue;
        }
        // A `#` may start a comment that opens the next run.
        comments = usize::from(content.contains('#'));
        let indent = line.len() - content.len();
        if indent == 0 && (line.starts_with("---") || line.starts_with("...")) {
            return None;
        }
        parser.line(indent, content)?;
    }
    parser.finish()
}

enum Node {
    /// The mapping so far and the key whose value comes on the next lines, if any.
    Map(Map<String, Value>, Option<String>),
    /// The items so far; `true` while a `-` waits for its value on the next lines.
    Seq(Vec<Value>, bool),
}

/// An open block collection and the column its entries start at.
struct Frame {
    indent: usize,
    node: Node,
}

impl Frame {
    fn waiting(&self) -> bool {
        matches!(self.node, Node::Map(_, Some(_)) | Node::Seq(_, true))
    }

    /// A key or `-` with nothing after it and nothing under it: its value is null.
    fn settle(&mut self) -> Option<()> {
        if self.waiting() {
            self.attach(Value::Null)?;
        }
        Some(())
    }

    /// Gives the waiting key or `-` its value.
    fn attach(&mut self, value: Value) -> Option<()> {
        match &mut self.node {
            Node::Map(map, key) => insert(map, key.take()?, value),
            Node::Seq(items, waiting) => {
                *waiting = false;
                items.push(value);
                Some(())
            }
        }
    }

    fn into_value(self) -> Value {
        match self.node {
            Node::Map(map, _) => Value::Object(map),
            Node::Seq(items, _) => Value::Array(items),
        }
    }
}

/// A key given twice declines (serde-saphyr's policy is an error).
fn insert(map: &mut Map<String, Value>, key: String, value: Value) -> Option<()> {
    map.insert(key, value).is_none().then_some(())
}

#[derive(Default)]
struct Parser {
    stack: Vec<Frame>,
    /// The document's value once its root is closed (a root scalar, or the root collection at the end).
    root: Option<Value>,
}

impl Parser {
    /// One line with content (not blank, not only a comment): `content` starts at column `indent`.
    fn line(&mut self, indent: usize, content: &str) -> Option<()> {
        loop {
            let Some(top) = self.stack.last_mut() else {
                return self.open(indent, content);
            };
            if top.waiting() {
                // A sequence may sit at its key's own indentation.
                let under = indent > top.indent
                    || (indent == top.indent
                        && matches!(top.node, Node::Map(..))
                        && is_entry(content));
                if under {
                    return self.open(indent, content);
                }
                top.settle()?;
            }
            if top.indent < indent {
                return None; // a continuation line, or bad indentation
            }
            if top.indent > indent || self.ends_keyed_sequence(indent, content) {
                self.close()?;
                continue;
            }
            return self.entry(content);
        }
    }

    /// A sequence at its key's indentation ends at the next key of that mapping.
    fn ends_keyed_sequence(&self, indent: usize, content: &str) -> bool {
        let n = self.stack.len();
        n >= 2
            && matches!(self.stack[n - 1].node, Node::Seq(..))
            && matches!(self.stack[n - 2].node, Node::Map(..))
            && self.stack[n - 2].indent == indent
            && !is_entry(content)
    }

    /// Opens the collection that `content` starts at column `indent` (a root, or a waiting value).
    fn open(&mut self, indent: usize, content: &str) -> Option<()> {
        if is_entry(content) {
            self.push(indent, Node::Seq(Vec::new(), false))?;
            return self.seq_entry(content);
        }
        match split_key(content)? {
            Some((key, rest)) => self.open_map(indent, key, rest),
            None if self.stack.is_empty() && self.root.is_none() => {
                // A root scalar or flow collection on one line: nothing may follow it.
                self.root = Some(inline_value(content, MAX_DEPTH)?);
                Some(())
            }
            None => None, // a value on the line after its key, or a second root
        }
    }

    /// Opens a mapping whose first entry is `key: rest`.
    fn open_map(&mut self, indent: usize, key: String, rest: &str) -> Option<()> {
        self.push(indent, Node::Map(Map::new(), None))?;
        self.map_entry(key, rest)
    }

    fn push(&mut self, indent: usize, node: Node) -> Option<()> {
        if self.root.is_some() || self.stack.len() >= MAX_DEPTH {
            return None;
        }
        self.stack.push(Frame { indent, node });
        Some(())
    }

    /// One entry of the innermost collection, whose column `content` starts at.
    fn entry(&mut self, content: &str) -> Option<()> {
        match self.stack.last()?.node {
            Node::Map(..) => {
                let (key, rest) = split_key(content)??;
                self.map_entry(key, rest)
            }
            Node::Seq(..) => self.seq_entry(content),
        }
    }

    /// `key: rest` in the innermost collection, a mapping; an empty `rest` waits for the next lines.
    fn map_entry(&mut self, key: String, rest: &str) -> Option<()> {
        let depth_left = MAX_DEPTH.checked_sub(self.stack.len())?;
        let Node::Map(map, waiting) = &mut self.stack.last_mut()?.node else {
            return None;
        };
        if rest.is_empty() {
            *waiting = Some(key);
            return Some(());
        }
        insert(map, key, inline_value(rest, depth_left)?)
    }

    /// `- ...` in the innermost collection, a sequence.
    fn seq_entry(&mut self, content: &str) -> Option<()> {
        let depth_left = MAX_DEPTH.checked_sub(self.stack.len())?;
        let top = self.stack.last_mut()?;
        let Node::Seq(items, waiting) = &mut top.node else {
            return None;
        };
        if !is_entry(content) {
            return None;
        }
        let after = &content[1..];
        let rest = after.trim_start_matches(' ');
        if rest.is_empty() || rest.starts_with('#') {
            *waiting = true;
            return Some(());
        }
        if is_entry(rest) {
            return None; // `- - x`
        }
        match split_key(rest)? {
            None => {
                items.push(inline_value(rest, depth_left)?);
                Some(())
            }
            // `- key: v`: a mapping whose keys sit at the column of this first one.
            Some((key, value)) => {
                *waiting = true;
                let indent = top.indent + 1 + (after.len() - rest.len());
                self.open_map(indent, key, value)
            }
        }
    }

    /// Closes the innermost collection into its parent (or the root).
    fn close(&mut self) -> Option<()> {
        let mut frame = self.stack.pop()?;
        frame.settle()?;
        let value = frame.into_value();
        match self.stack.last_mut() {
            Some(parent) => parent.attach(value),
            None => {
                self.root = Some(value);
                Some(())
            }
        }
    }

    fn finish(mut self) -> Option<Value> {
        while !self.stack.is_empty() {
            self.close()?;
        }
        // A document of only comments and blank lines is null.
        Some(self.root.unwrap_or(Value::Null))
    }
}

/// A block sequence entry: `-` then a space or the end of the line.
fn is_entry(content: &str) -> bool {
    content == "-" || content.starts_with("- ")
}

/// `key: rest` (rest without its leading spaces; empty when only a comment or nothing follows), `None`
/// inside when the line is not a mapping entry, `None` outside when it is one the fast path cannot take.
fn split_key(content: &str) -> Option<Option<(String, &str)>> {
    if content.starts_with(['[', '{']) {
        // A flow collection: a value (one used as a key makes `inline_value` decline).
        return Some(None);
    }
    let (key, after) = if content.starts_with(['\'', '"']) {
        let (key, after) = scalar::quoted_key(content)?;
        if !(after == ":" || after.starts_with(": ")) {
            return Some(None);
        }
        (key, &after[1..])
    } else {
        let Some(colon) = key_colon(content) else {
            return Some(None);
        };
        if colon > scalar::MAX_KEY {
            return None;
        }
        let text = content[..colon].trim_end_matches(' ');
        if !scalar::may_start_plain(text) {
            return None;
        }
        (scalar::plain_key(text)?, &content[colon + 1..])
    };
    let rest = after.trim_start_matches(' ');
    let rest = if rest.starts_with('#') { "" } else { rest };
    if !rest.is_empty() && !after.starts_with(' ') {
        return None;
    }
    Some(Some((key, rest)))
}

/// Where the `: ` (or a final `:`) of a plain key is, if the line has one before any comment.
fn key_colon(content: &str) -> Option<usize> {
    let b = content.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b':' if i + 1 == b.len() || b[i + 1] == b' ' => return Some(i),
            b'#' if i > 0 && b[i - 1] == b' ' => return None,
            _ => {}
        }
    }
    None
}

/// A value that starts and ends on this line (`rest` is non-empty and not a comment): a quoted or plain
/// scalar or a flow collection, optionally followed by a comment.
fn inline_value(rest: &str, depth_left: usize) -> Option<Value> {
    let (value, tail) = match rest.as_bytes()[0] {
        b'\'' | b'"' => {
            let (s, tail) = scalar::quoted(rest)?;
            (Value::String(s), tail)
        }
        b'[' | b'{' => flow::parse(rest, depth_left)?,
        _ => return plain_value(rest),
    };
    let after = tail.trim_start_matches(' ');
    let ends = after.is_empty() || (after.starts_with('#') && tail.starts_with(' '));
    ends.then_some(value)
}

/// A plain scalar in block context, up to a comment or the end of the line.
fn plain_value(rest: &str) -> Option<Value> {
    if !scalar::may_start_plain(rest) {
        return None;
    }
    let end = rest.find(" #").unwrap_or(rest.len());
    let text = rest[..end].trim_end_matches(' ');
    // `a: b: c` is an error for serde-saphyr; `a: b:` is a key in a place a value should be.
    if text.contains(": ") || text.ends_with(':') {
        return None;
    }
    scalar::plain(text)
}
