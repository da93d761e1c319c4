//! Codec tests: pinned wire bytes, decode(encode(x)) == x, and text rendering.

use super::consts::*;
use super::*;
use crate::netlink::attr::{messages, Msg};
use crate::netlink::NLA_F_NESTED;
use crate::nft::build::*;
use crate::nft::ir::*;
use crate::nft::tx::{Op, Transaction};
use std::fmt::Write;

const TABLE: &str = "nftkube";

fn tx_of(family: Family, ops: Vec<Op>) -> Transaction {
    let mut tx = Transaction::default();
    for op in ops {
        tx.push(family, TABLE, op);
    }
    tx
}

/// The object messages of a batch (BEGIN and END dropped), copied out.
fn object_messages(bytes: &[u8]) -> Vec<(u16, u16, u32, Vec<u8>)> {
    messages(bytes)
        .filter(|m| m.msg_type != NFNL_MSG_BATCH_BEGIN && m.msg_type != NFNL_MSG_BATCH_END)
        .map(|m: Msg<'_>| (m.msg_type, m.flags, m.seq, m.payload.to_vec()))
        .collect()
}

/// Encodes one op and returns the raw bytes of its only object message (header included).
fn one_message(family: Family, op: Op) -> Vec<u8> {
    let b = encode_batch(&tx_of(family, vec![op]), 1);
    let msgs: Vec<Msg<'_>> = messages(&b.bytes).collect();
    assert_eq!(msgs.len(), 3, "BEGIN, one object, END");
    let begin_len = u32::from_ne_bytes(b.bytes[0..4].try_into().unwrap()) as usize;
    let len = u32::from_ne_bytes(b.bytes[begin_len..begin_len + 4].try_into().unwrap()) as usize;
    b.bytes[begin_len..begin_len + len].to_vec()
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// A pinned hex string with its layout whitespace removed.
fn pinned(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// Lays a message out the way the pinned constants are written: header, nfgenmsg, then one line per
/// attribute (nested attributes open a line of their own and indent their content). Printed when a pin
/// does not match, so the difference is readable.
fn layout(msg: &[u8]) -> String {
    fn attrs(out: &mut String, mut b: &[u8], depth: usize) {
        while b.len() >= 4 {
            let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
            let kind = u16::from_ne_bytes([b[2], b[3]]);
            if len < 4 || len > b.len() {
                let _ = writeln!(out, "{:w$}\"{}\", // malformed", "", hex(b), w = 4 * depth);
                return;
            }
            let padded = crate::netlink::align4(len).min(b.len());
            if kind & NLA_F_NESTED != 0 {
                let _ = writeln!(
                    out,
                    "{:w$}\"{} {}\", // type {} nested, len {len}",
                    "",
                    hex(&b[0..2]),
                    hex(&b[2..4]),
                    kind & !NLA_F_NESTED,
                    w = 4 * depth
                );
                attrs(out, &b[4..len], depth + 1);
            } else {
                let _ = writeln!(
                    out,
                    "{:w$}\"{} {} {}\", // type {kind}, len {len}",
                    "",
                    hex(&b[0..2]),
                    hex(&b[2..4]),
                    hex(&b[4..padded]),
                    w = 4 * depth
                );
            }
            b = &b[padded..];
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\"{} {} {} {} {}\", // nlmsghdr",
        hex(&msg[0..4]),
        hex(&msg[4..6]),
        hex(&msg[6..8]),
        hex(&msg[8..12]),
        hex(&msg[12..16])
    );
    let _ = writeln!(out, "\"{}\", // nfgenmsg", hex(&msg[16..20]));
    attrs(&mut out, &msg[20..], 1);
    out
}

#[track_caller]
fn assert_pinned(actual: &[u8], want: &str) {
    let want = pinned(want);
    if hex(actual) != want {
        panic!(
            "bytes differ from the pin\nactual:\n{}\nactual hex: {}\npinned hex: {want}",
            layout(actual),
            hex(actual)
        );
    }
}

#[test]
fn print_layouts() {
    for (name, fam, op) in golden_ops() {
        println!("== {name}\n{}", layout(&one_message(fam, op)));
    }
}

fn golden_ops() -> Vec<(&'static str, Family, Op)> {
    vec![]
}
