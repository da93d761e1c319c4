//! The fast path against serde-saphyr: whenever `fast::parse` accepts a document, serde-saphyr (with our
//! options) must return the same value. Hand-written shapes, then generated documents (a grammar of the
//! subset, rendered in random styles, with random scalars and random single-byte damage).

use super::{fast, parse_document_full};
use proptest::prelude::*;

/// Whether the fast path took `text`; fails if it took it and serde-saphyr disagrees.
fn agrees(text: &str) -> bool {
    let Some(fast) = fast::parse(text) else {
        return false;
    };
    match parse_document_full(text) {
        Ok(full) => assert_eq!(fast, full, "fast path and serde-saphyr differ on {text:?}"),
        Err(e) => panic!("fast path accepted what serde-saphyr rejects ({e}): {text:?}"),
    }
    true
}

#[test]
fn ordinary_shapes_are_taken_and_equal() {
    let docs = [
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: a\n  namespace: default\n  labels:\n    app.kubernetes.io/name: x\nspec:\n  clusterIP: 10.96.0.1\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: a-x, namespace: n, labels: {kubernetes.io/service-name: a}}\naddressType: IPv4\nports: [{name: p80, port: 8080, protocol: TCP}]\nendpoints:\n  - addresses: [\"10.244.0.1\"]\n    conditions: {ready: true}\n  - addresses: ['10.244.0.2']\n    conditions:\n      ready: false\n",
        "# a comment\n\na: 1 # trailing\nb:   'it''s'\nc: \"q\\\"uote\\n\"\nd:\ne: ~\nf: []\ng: {}\nh: -5\ni: fd00:96::10\nj: nginx:1.25\nk: http://example.com/a#b\n",
        "- a\n- b: 1\n  c: 2\n-\n- - \n",
        "list:\n- x\n- y\nnext: z\n",
        "a:\n  - b:\n    - c\n    d: e\n",
        "x",
        "[a, {b: c}, [d, e], 'f']",
        "",
        "# only a comment\n",
        "  a: 1\n  b:\n    c: 2\n",
        "a: yes\nb: Off\nc: y\nd: null\ne: NULL\nf: 0\ng: 12:30\nh: inf\n",
    ];
    for doc in docs {
        // `- - ` is outside the subset: that document must decline, every other must be taken.
        let taken = agrees(doc);
        assert_eq!(taken, !doc.contains("- - "), "{doc:?}");
    }
}

#[test]
fn shapes_outside_the_subset_decline() {
    let long_quoted_key = format!("\"{}\": 1", "x".repeat(1030));
    let docs: [&str; 28] = [
        "a: &x 1\nb: *x\n",
        "a: !!str 1\n",
        "a: |\n  text\n",
        "a: >\n  text\n",
        "a: multi\n  line\n",
        "? a\n: b\n",
        "a: 1\na: 2\n",
        "<<: {a: 1}\n",
        "a:\tb\n",
        "a: b\r\n",
        "a: \u{e9}\n",
        "a: 0777\n",
        "a: 0x1F\n",
        "a: 1_000\n",
        "a: 1.5\n",
        "a: .inf\n",
        "80: x\n",
        "yes: x\n",
        "a: [1,\n  2]\n",
        "a: b: c\n",
        "a: [b, ]\n",
        "a: {b}\n",
        "a: \"\\x41\"\n",
        "%YAML 1.2\na: 1\n",
        // Implicit keys are at most 1024 characters (found by the fuzz target).
        &long_quoted_key,
        &format!("{{{long_quoted_key}}}"),
        &format!("a{}: 1", " ".repeat(1030)),
        "---\na: 1\n",
    ];
    for doc in docs {
        assert!(fast::parse(doc).is_none(), "must decline: {doc:?}");
        // Whatever serde-saphyr makes of it, the document still parses through the public entry point
        // exactly as serde-saphyr alone parses it.
        assert_eq!(
            super::parse_document(doc).ok(),
            parse_document_full(doc).ok()
        );
    }
}

/// serde-saphyr refuses more than 96 comments in a row where it looks ahead (found by the fuzz target).
#[test]
fn long_runs_of_comments_decline() {
    let crash =
        "# \n-  #Z \n-  #\n#\n#\n\n#\n#a\n#a\n #Z \n-  #\n".to_owned() + &"#\n#a\n".repeat(60);
    assert!(parse_document_full(&crash).is_err());
    assert!(fast::parse(&crash).is_none());
    // Where serde-saphyr does not look ahead, long runs are fine for it; the fast path declines them all.
    let run = |n: usize| format!("- a #x\n{}- b\n", "# c\n\n".repeat(n));
    assert!(fast::parse(&run(200)).is_none());
    assert!(agrees(&run(20)), "a run of 20 comments is taken");
}

#[test]
fn nesting_past_the_cap_declines_and_hostile_depth_stays_linear() {
    let mut deep = String::new();
    for i in 0..fast::MAX_DEPTH + 1 {
        deep.push_str(&format!("{}a:\n", " ".repeat(i)));
    }
    assert!(fast::parse(&deep).is_none());
    assert!(fast::parse(&"[".repeat(100_000)).is_none());
    assert!(fast::parse(&"- ".repeat(50_000)).is_none());
    let ok = format!("{}1{}", "[".repeat(20), "]".repeat(20));
    assert!(agrees(&ok));
}

/// A generated document's tree, with the style each collection is written in.
#[derive(Debug, Clone)]
enum Tree {
    Scalar(String),
    Seq(Vec<Tree>, Style),
    Map(Vec<(String, Tree)>, Style),
}

#[derive(Debug, Clone, Copy)]
struct Style {
    flow: bool,
    /// Extra indentation of nested block content (1–3).
    step: usize,
    /// A block sequence that is a mapping value sits at its key's column.
    flush: bool,
}

fn style() -> impl Strategy<Value = Style> {
    (any::<bool>(), 1..4usize, any::<bool>()).prop_map(|(flow, step, flush)| Style {
        flow,
        step,
        flush,
    })
}

/// Scalars from an alphabet that reaches every typing rule, quoted ones, and a few fixed words.
fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[0-9._+\\-eExo:yntrufals~a-z]{1,8}",
        1 => "[0-9a-z .:#'\"\\-]{0,6}".prop_map(|s| format!("'{s}'")),
        1 => "[0-9a-z .:#'\\\\\"nt/x\\-]{0,6}".prop_map(|s| format!("\"{s}\"")),
        1 => prop::sample::select(vec![
            "yes", "No", "ON", "y", "n", "~", "null", "Null", "NULL", "true", "False", "0", "-0", "00",
            "0o17", "0b11", "1e3", ".5", "-.inf", ".NaN", "10.96.0.1", "1.2", "9223372036854775808",
            "18446744073709551616", "-9223372036854775809", "a b", "a #b", "a#b", "x:y", "{a}", "[a]",
            "&a", "*a", "!t", "|", ">", "@", "`", "%", "?", "- a", "-a", "-1", "<<",
        ])
        .prop_map(str::to_owned),
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["a", "b", "c", "name", "app.kubernetes.io/name", "x-y"])
            .prop_map(str::to_owned),
        1 => scalar(),
    ]
}

fn tree() -> impl Strategy<Value = Tree> {
    scalar()
        .prop_map(Tree::Scalar)
        .prop_recursive(5, 40, 4, |inner| {
            prop_oneof![
                (prop::collection::vec(inner.clone(), 0..4), style())
                    .prop_map(|(items, s)| Tree::Seq(items, s)),
                (prop::collection::vec((key(), inner), 0..4), style())
                    .prop_map(|(entries, s)| Tree::Map(entries, s)),
            ]
        })
}

/// The tree in flow style, on one line.
fn flow(t: &Tree, out: &mut String) {
    match t {
        Tree::Scalar(s) => out.push_str(s),
        Tree::Seq(items, _) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                flow(item, out);
            }
            out.push(']');
        }
        Tree::Map(entries, _) => {
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(k);
                out.push_str(": ");
                flow(v, out);
            }
            out.push('}');
        }
    }
}

/// Whether `t` is written on the line of its key or `-`.
fn inline(t: &Tree) -> bool {
    match t {
        Tree::Scalar(_) => true,
        Tree::Seq(v, s) => s.flow || v.is_empty(),
        Tree::Map(v, s) => s.flow || v.is_empty(),
    }
}

/// The tree in block style where its style says so, its first line starting at column `indent` (the
/// caller has written that line's indentation, or a `- ` before it).
fn block(t: &Tree, indent: usize, out: &mut String) {
    if inline(t) {
        flow(t, out);
        out.push('\n');
        return;
    }
    let pad = |n: usize| " ".repeat(n);
    match t {
        Tree::Scalar(_) => unreachable!(),
        Tree::Seq(items, s) => {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&pad(indent));
                }
                match item {
                    _ if inline(item) => {
                        out.push_str("- ");
                        block(item, indent + 2, out);
                    }
                    Tree::Map(..) => {
                        out.push_str("- ");
                        block(item, indent + 2, out);
                    }
                    _ => {
                        out.push_str("-\n");
                        out.push_str(&pad(indent + s.step));
                        block(item, indent + s.step, out);
                    }
                }
            }
        }
        Tree::Map(entries, s) => {
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&pad(indent));
                }
                out.push_str(k);
                out.push(':');
                if inline(v) {
                    out.push(' ');
                    block(v, indent, out);
                    continue;
                }
                out.push('\n');
                let child = match v {
                    Tree::Seq(..) if s.flush => indent,
                    _ => indent + s.step,
                };
                out.push_str(&pad(child));
                block(v, child, out);
            }
        }
    }
}

/// One byte of damage: inserted, replaced or removed at a position.
#[derive(Debug, Clone)]
enum Damage {
    Insert(usize, u8),
    Replace(usize, u8),
    Remove(usize),
}

fn damage() -> impl Strategy<Value = Damage> {
    let byte = prop::sample::select(b" \n\t\r-:#'\"[]{},&*!|>?%@~0a.".to_vec());
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(p, b)| Damage::Insert(p, b)),
        (any::<usize>(), byte).prop_map(|(p, b)| Damage::Replace(p, b)),
        any::<usize>().prop_map(Damage::Remove),
    ]
}

fn apply(text: &str, damage: &[Damage]) -> String {
    let mut b = text.as_bytes().to_vec();
    for d in damage {
        let at = |p: usize, len: usize| if len == 0 { 0 } else { p % len };
        match *d {
            Damage::Insert(p, c) => b.insert(at(p, b.len() + 1), c),
            Damage::Replace(p, c) if !b.is_empty() => {
                let i = at(p, b.len());
                b[i] = c;
            }
            Damage::Remove(p) if !b.is_empty() => {
                b.remove(at(p, b.len()));
            }
            _ => {}
        }
    }
    String::from_utf8(b).expect("ASCII damage to ASCII text")
}

fn render(t: &Tree) -> String {
    let mut text = String::new();
    block(t, 0, &mut text);
    text
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn generated_documents_agree(t in tree()) {
        agrees(&render(&t));
    }

    #[test]
    fn damaged_documents_agree(t in tree(), d in prop::collection::vec(damage(), 1..4)) {
        agrees(&apply(&render(&t), &d));
    }
}

/// The generator is not vacuous: documents of ordinary scalars in every style are taken.
#[test]
fn ordinary_generated_documents_are_taken() {
    use proptest::test_runner::TestRunner;
    let ordinary = "[a-z][a-z0-9.-]{0,6}|[1-9][0-9]{0,4}|10\\.96\\.[0-9]\\.[0-9]";
    let leaf = ordinary.prop_map(Tree::Scalar);
    let tree = leaf.prop_recursive(4, 30, 4, |inner| {
        // Keys starting with `k`: never a boolean or null word (those keys decline by design).
        let names = prop::collection::btree_map("k[a-z]{0,5}", inner.clone(), 1..4)
            .prop_map(|m| m.into_iter().collect::<Vec<_>>());
        prop_oneof![
            (prop::collection::vec(inner, 1..4), style()).prop_map(|(v, s)| Tree::Seq(v, s)),
            (names, style()).prop_map(|(v, s)| Tree::Map(v, s)),
        ]
    });
    let mut runner = TestRunner::deterministic();
    for _ in 0..500 {
        let t = tree.new_tree(&mut runner).unwrap().current();
        let text = render(&t);
        assert!(agrees(&text), "ordinary document declined: {text:?}");
    }
}
