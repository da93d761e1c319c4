//! Codec tests: pinned wire bytes, decode(encode(x)) == x, and text rendering.

use super::consts::*;
use super::*;
use crate::build::*;
use crate::ir::*;
use crate::text;
use crate::tx::{Op, Transaction};
use nftkube_netlink::attr::{messages, Msg};
use nftkube_netlink::NLA_F_NESTED;
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
    let b = encode_batch(&tx_of(family, vec![op]), 1).unwrap();
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
            let padded = nftkube_netlink::align4(len).min(b.len());
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

// ---------------------------------------------------------------------------------------------------------
// The objects the pinned, round-trip and text tests share.

fn nat_prerouting() -> Chain {
    Chain::base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100)
}

fn service_ips() -> Set {
    Set {
        key: vec![
            DataType::Ipv4Addr,
            DataType::InetProto,
            DataType::InetService,
        ],
        ..Set::new("service-ips", vec![], vec![DataType::Verdict])
    }
}

fn aff() -> Set {
    Set {
        timeout_ms: Some(10_800_000),
        dynamic: true,
        size: Some(1024),
        ..Set::new("aff", vec![DataType::Ipv4Addr], vec![])
    }
}

fn svc_element() -> Element {
    Element {
        key: concat_key(&[vec![10, 96, 0, 10], vec![6], 80u16.to_be_bytes().to_vec()]).into(),
        value: Some(ElementValue::Verdict(Verdict::Goto("svc".into()))),
    }
}

fn svc_element_op() -> Op {
    Op::AddElements {
        set: "service-ips".into(),
        elements: vec![svc_element()],
    }
}

fn vmap_rule() -> Rule {
    RuleBuilder::new()
        .vmap(
            &[Field::IpDaddr, Field::L4Proto, Field::ThDport],
            "service-ips",
        )
        .build()
}

fn numgen_dnat_rule() -> Rule {
    RuleBuilder::new()
        .cmp(Field::L4Proto, CmpOp::Eq, vec![6])
        .numgen_eq(3, 0)
        .dnat(&"10.244.1.2".parse().unwrap(), 8080)
        .build()
}

fn mark_or_rule() -> Rule {
    RuleBuilder::new().mark_or(0x4000).build()
}

fn masq_rule() -> Rule {
    RuleBuilder::new().masquerade(true).build()
}

fn reject_rule() -> Rule {
    RuleBuilder::new()
        .cmp(Field::L4Proto, CmpOp::Eq, vec![6])
        .reject(RejectKind::TcpReset)
        .build()
}

fn ct_dnat_rule() -> Rule {
    RuleBuilder::new()
        .ct_has(CtKey::Status, CT_STATUS_DNAT)
        .build()
}

fn fib_rule() -> Rule {
    RuleBuilder::new()
        .expr(Expr::Fib {
            flags: FibFlags::DADDR,
            result: FibResult::ADDRTYPE,
            dreg: REG_1,
        })
        .expr(Expr::Cmp {
            sreg: REG_1,
            op: CmpOp::Eq,
            data: RTN_LOCAL.to_ne_bytes().to_vec(),
        })
        .build()
}

fn dynset_rule() -> Rule {
    RuleBuilder::new()
        .expr(Field::IpSaddr.load(REG_1))
        .expr(Expr::Dynset {
            set: "aff".into(),
            op: DynsetOp::Update,
            sreg_key: REG_1,
            sreg_data: None,
            timeout_ms: Some(10_000),
        })
        .build()
}

fn rule_op(rule: Rule) -> Op {
    Op::AddRule {
        chain: "c".into(),
        rule,
    }
}

// ---------------------------------------------------------------------------------------------------------
// Pinned bytes. Netlink headers and attribute headers are host-endian (these pins are for little-endian
// hosts); nf_tables integers inside attributes are big-endian. Layout of each line: `len type payload`.
// Every message is encoded with first_seq 1: BEGIN is seq 1, the object seq 2, END seq 3.
// Message type = NFNL_SUBSYS_NFTABLES (10) << 8 | NFT_MSG_*; nested attributes carry NLA_F_NESTED (0x8000,
// so a nested type 1 reads `0180`).

/// `create table` differs from `add table` by NLM_F_EXCL alone: the kernel then refuses an existing table
/// (EEXIST) instead of taking the message as an update of it.
#[test]
fn create_table_is_add_table_with_excl() {
    let flags = |op| {
        let m = one_message(Family::Ip, op);
        u16::from_ne_bytes([m[6], m[7]])
    };
    let (add, create) = (flags(Op::AddTable), flags(Op::CreateTable));
    assert_eq!(add & nftkube_netlink::NLM_F_EXCL, 0, "{add:#x}");
    assert_eq!(create, add | nftkube_netlink::NLM_F_EXCL, "{create:#x}");
    let body = |op| one_message(Family::Ip, op)[16..].to_vec();
    assert_eq!(body(Op::CreateTable), body(Op::AddTable));
}

/// `nft add table ip nftkube`: the whole batch.
#[cfg(target_endian = "little")]
#[test]
fn pinned_newtable_batch() {
    let b = encode_batch(&tx_of(Family::Ip, vec![Op::AddTable]), 1).unwrap();
    assert_pinned(
        &b.bytes,
        concat!(
            // BEGIN: len 20, type NFNL_MSG_BATCH_BEGIN 0x10, flags NLM_F_REQUEST only (no ACK), seq 1.
            "14000000 1000 0100 01000000 00000000",
            // nfgenmsg: family AF_UNSPEC, version 0, res_id NFNL_SUBSYS_NFTABLES (10, big-endian).
            "00 00 000a",
            // NEWTABLE: len 40, type 0x0a00, flags REQUEST|ACK|CREATE (0x405: the last object asks for
            // the ACK), seq 2.
            "28000000 000a 0504 02000000 00000000",
            "02 00 0000",                 // nfgenmsg: NFPROTO_IPV4, version 0, res_id 0
            "0c00 0100 6e66746b75626500", // NFTA_TABLE_NAME "nftkube\0"
            "0800 0200 00000000",         // NFTA_TABLE_FLAGS 0 (be32)
            // END: type NFNL_MSG_BATCH_END 0x11, seq 3, res_id 10 again.
            "14000000 1100 0100 03000000 00000000",
            "00 00 000a",
        ),
    );
    assert_eq!(b.ack_seq, 2);
    assert_eq!(b.seqs, vec![(2, 0)]);
}

/// `nft add chain ip nftkube nat-prerouting '{ type nat hook prerouting priority -100; policy accept; }'`
#[cfg(target_endian = "little")]
#[test]
fn pinned_base_chain() {
    assert_pinned(
        &one_message(Family::Ip, Op::AddChain(nat_prerouting())),
        concat!(
            "58000000 030a 0504 02000000 00000000", // NFT_MSG_NEWCHAIN (3), REQUEST|ACK|CREATE
            "02000000",
            "0c00 0100 6e66746b75626500", // NFTA_CHAIN_TABLE "nftkube"
            "1300 0300 6e61742d707265726f7574696e670000", // NFTA_CHAIN_NAME "nat-prerouting" (len 19, padded)
            "1400 0480",                                  // NFTA_CHAIN_HOOK, nested
            "    0800 0100 00000000", //   NFTA_HOOK_HOOKNUM NF_INET_PRE_ROUTING (0)
            "    0800 0200 ffffff9c", //   NFTA_HOOK_PRIORITY -100 (be32)
            "0800 0500 00000001",     // NFTA_CHAIN_POLICY NF_ACCEPT (1)
            "0800 0700 6e617400",     // NFTA_CHAIN_TYPE "nat"
        ),
    );
}

/// `nft add map ip nftkube service-ips '{ type ipv4_addr . inet_proto . inet_service : verdict; }'`
/// (`nft --debug=mnl` sends the same flags, key type, key length and data type).
#[cfg(target_endian = "little")]
#[test]
fn pinned_verdict_map() {
    assert_pinned(
        &one_message(Family::Ip, Op::AddSet(service_ips())),
        concat!(
            "78000000 090a 0504 02000000 00000000", // NFT_MSG_NEWSET (9)
            "02000000",
            "0c00 0100 6e66746b75626500",         // NFTA_SET_TABLE
            "1000 0200 736572766963652d69707300", // NFTA_SET_NAME "service-ips"
            "0800 0300 00000008",                 // NFTA_SET_FLAGS NFT_SET_MAP
            // NFTA_SET_KEY_TYPE: nft's concatenated type, 6 bits per component:
            // ipv4_addr 7 << 12 | inet_proto 12 << 6 | inet_service 13 = 0x730d.
            "0800 0400 0000730d",
            "0800 0500 0000000c", // NFTA_SET_KEY_LEN 12: each component padded to 4 bytes
            "0800 0600 ffffff00", // NFTA_SET_DATA_TYPE NFT_DATA_VERDICT (no data length for verdicts)
            "0800 0a00 e3f4a443", // NFTA_SET_ID: FNV-1a of the name, any stable number will do
            // NFTA_SET_USERDATA, as nft 1.0.6 writes it: key and data byte order (0: a concatenation),
            // "the key is a concatenation" (typeof concat, no components), no interval data.
            "2000 0d00 000400000000010400000000030800040d0000000100060400000000",
        ),
    );
}

/// `nft add element ip nftkube service-ips '{ 10.96.0.10 . tcp . 80 : goto svc }'`
#[cfg(target_endian = "little")]
#[test]
fn pinned_verdict_element() {
    assert_pinned(
        &one_message(Family::Ip, svc_element_op()),
        concat!(
            "64000000 0c0a 0504 02000000 00000000", // NFT_MSG_NEWSETELEM (12), REQUEST|ACK|CREATE
            "02000000",
            "0c00 0100 6e66746b75626500", // NFTA_SET_ELEM_LIST_TABLE
            "1000 0200 736572766963652d69707300", // NFTA_SET_ELEM_LIST_SET "service-ips"
            "3400 0380",                  // NFTA_SET_ELEM_LIST_ELEMENTS, nested
            "    3000 0180",              //   NFTA_LIST_ELEM
            "        1400 0180",          //     NFTA_SET_ELEM_KEY
            // NFTA_DATA_VALUE, 12 bytes: 10.96.0.10 | 6 (tcp) + 3 bytes padding | 80 big-endian + 2 padding.
            "            1000 0100 0a60000a 06000000 00500000",
            "        1800 0280",                  //     NFTA_SET_ELEM_DATA
            "            1400 0280",              //       NFTA_DATA_VERDICT
            "                0800 0100 fffffffc", //         NFTA_VERDICT_CODE -4 = NFT_GOTO
            "                0800 0200 73766300", //         NFTA_VERDICT_CHAIN "svc"
        ),
    );
}

/// `nft add rule ip nftkube c ip daddr . meta l4proto . th dport vmap @service-ips`
#[cfg(target_endian = "little")]
#[test]
fn pinned_vmap_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(vmap_rule())),
        concat!(
            // NFT_MSG_NEWRULE (6), flags REQUEST|ACK|CREATE|APPEND (0xc05).
            "ec000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",         // NFTA_RULE_TABLE
            "0600 0200 63000000",                 // NFTA_RULE_CHAIN "c"
            "c400 0480",                          // NFTA_RULE_EXPRESSIONS
            "    3400 0180",                      //   NFTA_LIST_ELEM
            "        0c00 0100 7061796c6f616400", // NFTA_EXPR_NAME "payload"
            "        2400 0280",                  // NFTA_EXPR_DATA
            "            0800 0100 00000001",     //   DREG NFT_REG_1
            "            0800 0200 00000001",     //   BASE network header
            "            0800 0300 00000010",     //   OFFSET 16 (ip daddr)
            "            0800 0400 00000004",     //   LEN 4
            "    2400 0180",
            "        0900 0100 6d65746100000000", // "meta"
            "        1400 0280",
            "            0800 0200 00000010", //   KEY NFT_META_L4PROTO (16)
            "            0800 0100 00000009", //   DREG NFT_REG32_01 (9): the 2nd 4-byte slot
            "    3400 0180",
            "        0c00 0100 7061796c6f616400", // "payload"
            "        2400 0280",
            "            0800 0100 0000000a", //   DREG NFT_REG32_02 (10)
            "            0800 0200 00000002", //   BASE transport header
            "            0800 0300 00000002", //   OFFSET 2 (dport)
            "            0800 0400 00000002", //   LEN 2
            "    3400 0180",
            "        0b00 0100 6c6f6f6b75700000", // "lookup"
            "        2400 0280",
            "            1000 0100 736572766963652d69707300", // SET "service-ips"
            "            0800 0200 00000001", //   SREG NFT_REG_1: the 12-byte key starts there
            "            0800 0300 00000000", //   DREG NFT_REG_VERDICT: a verdict map
        ),
    );
}

/// `nft add rule ip nftkube c meta l4proto tcp numgen random mod 3 == 0 dnat to 10.244.1.2:8080`
#[cfg(target_endian = "little")]
#[test]
fn pinned_numgen_dnat_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(numgen_dnat_rule())),
        concat!(
            "64010000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "3c01 0480",
            "    2400 0180",
            "        0900 0100 6d65746100000000", // "meta"
            "        1400 0280",
            "            0800 0200 00000010", //   KEY l4proto
            "            0800 0100 00000001", //   DREG 1
            "    2c00 0180",
            "        0800 0100 636d7000", // "cmp"
            "        2000 0280",
            "            0800 0100 00000001",     //   SREG 1
            "            0800 0200 00000000",     //   OP NFT_CMP_EQ
            "            0c00 0380",              //   DATA
            "                0500 0100 06000000", //     NFTA_DATA_VALUE: 1 byte, 6 (tcp)
            "    2c00 0180",
            "        0b00 0100 6e756d67656e0000", // "numgen"
            "        1c00 0280",
            "            0800 0100 00000001", //   DREG 1
            "            0800 0200 00000003", //   MODULUS 3
            "            0800 0300 00000001", //   TYPE NFT_NG_RANDOM (no OFFSET: it is 0)
            "    2c00 0180",
            "        0800 0100 636d7000", // "cmp"
            "        2000 0280",
            "            0800 0100 00000001",
            "            0800 0200 00000000", //   OP EQ
            "            0c00 0380",
            "                0800 0100 00000000", //     0 as a host-endian u32: numgen writes host order
            "    2c00 0180",
            "        0e00 0100 696d6d656469617465000000", // "immediate"
            "        1800 0280",
            "            0800 0100 00000001",     //   DREG 1
            "            0c00 0280",              //   DATA
            "                0800 0100 0af40102", //     10.244.1.2
            "    2c00 0180",
            "        0e00 0100 696d6d656469617465000000", // "immediate"
            "        1800 0280",
            "            0800 0100 00000002", //   DREG NFT_REG_2
            "            0c00 0280",
            "                0600 0100 1f900000", //     8080 big-endian (len 6, padded)
            "    3800 0180",
            "        0800 0100 6e617400", // "nat"
            "        2c00 0280",
            "            0800 0100 00000001", //   TYPE NFT_NAT_DNAT
            "            0800 0200 00000002", //   FAMILY NFPROTO_IPV4
            "            0800 0300 00000001", //   REG_ADDR_MIN 1
            "            0800 0500 00000002", //   REG_PROTO_MIN 2
            "            0800 0700 00000003", //   FLAGS MAP_IPS | PROTO_SPECIFIED (as the kernel dumps)
        ),
    );
}

/// `nft add rule ip nftkube c meta mark set meta mark or 0x4000`
#[cfg(target_endian = "little")]
#[test]
fn pinned_mark_or_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(mark_or_rule())),
        concat!(
            "b8000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "9000 0480",
            "    2400 0180",
            "        0900 0100 6d65746100000000", // "meta"
            "        1400 0280",
            "            0800 0200 00000003", //   KEY NFT_META_MARK
            "            0800 0100 00000001", //   DREG 1
            "    4400 0180",
            "        0c00 0100 6269747769736500", // "bitwise": reg1 = (reg1 & mask) ^ xor
            "        3400 0280",
            "            0800 0100 00000001",     //   SREG 1
            "            0800 0200 00000001",     //   DREG 1
            "            0800 0300 00000004",     //   LEN 4
            "            0c00 0480",              //   MASK
            "                0800 0100 ffbfffff", //     !0x4000, host-endian (the mark is host order)
            "            0c00 0580",              //   XOR
            "                0800 0100 00400000", //     0x4000, host-endian
            "    2400 0180",
            "        0900 0100 6d65746100000000", // "meta"
            "        1400 0280",
            "            0800 0200 00000003", //   KEY mark
            "            0800 0300 00000001", //   SREG 1: a meta store, not a load
        ),
    );
}

/// `nft add rule ip nftkube c masquerade fully-random`
#[cfg(target_endian = "little")]
#[test]
fn pinned_masquerade_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(masq_rule())),
        concat!(
            "48000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "2000 0480",
            "    1c00 0180",
            "        0900 0100 6d61737100000000", // "masq"
            "        0c00 0280",
            "            0800 0100 00000010", //   FLAGS NF_NAT_RANGE_PROTO_RANDOM_FULLY
        ),
    );
}

/// The redirect of userspace mode, `... redirect to :ip daddr . meta l4proto . th dport map @relay-ports`,
/// whose map lookup leaves the port in register 1: nft --debug=netlink shows `[ redir proto_min reg 1 flags
/// 0x2 ]` (no proto_max: nft sends the minimum alone).
#[cfg(target_endian = "little")]
#[test]
fn pinned_redirect_expression() {
    let rule = Rule {
        exprs: vec![Expr::Redir {
            reg_proto: Some(REG_1),
            flags: NatFlags::PROTO_SPECIFIED,
        }],
        comment: None,
    };
    assert_pinned(
        &one_message(Family::Ip, rule_op(rule)),
        concat!(
            "50000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "2800 0480",
            "    2400 0180",
            "        0a00 0100 7265646972000000", // "redir"
            "        1400 0280",
            "            0800 0100 00000001", //   REG_PROTO_MIN 1
            "            0800 0300 00000002", //   FLAGS NF_NAT_RANGE_PROTO_SPECIFIED
        ),
    );
}

/// `nft add rule ip nftkube c meta l4proto tcp reject with tcp reset`
#[cfg(target_endian = "little")]
#[test]
fn pinned_reject_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(reject_rule())),
        concat!(
            "a0000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "7800 0480",
            "    2400 0180",
            "        0900 0100 6d65746100000000", // "meta" l4proto => reg 1
            "        1400 0280",
            "            0800 0200 00000010",
            "            0800 0100 00000001",
            "    2c00 0180",
            "        0800 0100 636d7000", // "cmp" reg 1 == 6
            "        2000 0280",
            "            0800 0100 00000001",
            "            0800 0200 00000000",
            "            0c00 0380",
            "                0500 0100 06000000",
            "    2400 0180",
            "        0b00 0100 72656a6563740000", // "reject"
            "        1400 0280",
            "            0800 0100 00000001", //   TYPE NFT_REJECT_TCP_RST
            "            0500 0200 00000000", //   ICMP_CODE: a u8 (len 5), unused for a reset
        ),
    );
}

/// `nft add rule ip nftkube c ct status dnat`
#[cfg(target_endian = "little")]
#[test]
fn pinned_ct_status_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(ct_dnat_rule())),
        concat!(
            "bc000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "9400 0480",
            "    2000 0180",
            "        0700 0100 63740000", // "ct"
            "        1400 0280",
            "            0800 0100 00000001", //   DREG 1
            "            0800 0200 00000002", //   KEY NFT_CT_STATUS
            "    4400 0180",
            "        0c00 0100 6269747769736500", // "bitwise"
            "        3400 0280",
            "            0800 0100 00000001",
            "            0800 0200 00000001",
            "            0800 0300 00000004",
            "            0c00 0480",
            "                0800 0100 20000000", //     MASK IPS_DST_NAT (1 << 5), host-endian
            "            0c00 0580",
            "                0800 0100 00000000", //     XOR 0
            "    2c00 0180",
            "        0800 0100 636d7000", // "cmp"
            "        2000 0280",
            "            0800 0100 00000001",
            "            0800 0200 00000001", //   OP NFT_CMP_NEQ
            "            0c00 0380",
            "                0800 0100 00000000", //     != 0
        ),
    );
}

/// `nft add rule ip nftkube c fib daddr type local`
#[cfg(target_endian = "little")]
#[test]
fn pinned_fib_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(fib_rule())),
        concat!(
            "80000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "5800 0480",
            "    2800 0180",
            "        0800 0100 66696200", // "fib"
            "        1c00 0280",
            "            0800 0100 00000001", //   DREG 1
            "            0800 0200 00000003", //   RESULT NFT_FIB_RESULT_ADDRTYPE
            "            0800 0300 00000002", //   FLAGS NFTA_FIB_F_DADDR
            "    2c00 0180",
            "        0800 0100 636d7000", // "cmp"
            "        2000 0280",
            "            0800 0100 00000001",
            "            0800 0200 00000000", //   OP EQ
            "            0c00 0380",
            "                0800 0100 02000000", //     RTN_LOCAL (2), host-endian
        ),
    );
}

/// `nft add rule ip nftkube c update @aff '{ ip saddr timeout 10s }'`
#[cfg(target_endian = "little")]
#[test]
fn pinned_dynset_rule() {
    assert_pinned(
        &one_message(Family::Ip, rule_op(dynset_rule())),
        concat!(
            "98000000 060a 050c 02000000 00000000",
            "02000000",
            "0c00 0100 6e66746b75626500",
            "0600 0200 63000000",
            "7000 0480",
            "    3400 0180",
            "        0c00 0100 7061796c6f616400", // "payload" network + 12, 4 bytes (ip saddr) => reg 1
            "        2400 0280",
            "            0800 0100 00000001",
            "            0800 0200 00000001",
            "            0800 0300 0000000c",
            "            0800 0400 00000004",
            "    3800 0180",
            "        0b00 0100 64796e7365740000", // "dynset"
            "        2800 0280",
            "            0800 0100 61666600", //   SET_NAME "aff"
            "            0800 0300 00000001", //   OP NFT_DYNSET_OP_UPDATE
            "            0800 0400 00000001", //   SREG_KEY 1
            "            0c00 0600 00000000 00002710", // TIMEOUT 10000 ms, be64
        ),
    );
}

#[test]
#[should_panic(expected = "bytes differ from the pin")]
fn a_wrong_pin_fails() {
    assert_pinned(&one_message(Family::Ip, Op::AddTable), "00");
}

// ---------------------------------------------------------------------------------------------------------
// Batch framing.

/// With a generation, BATCH_BEGIN carries it as NFNL_BATCH_GENID (attribute 1, u32 big-endian) after its
/// nfgenmsg, and the object messages are the same bytes as without.
#[test]
fn a_generation_checked_batch_carries_the_genid_on_begin() {
    let tx = tx_of(Family::Ip, vec![Op::AddTable]);
    let plain = encode_batch(&tx, 7).unwrap();
    let checked = encode_batch_at(&tx, 7, Some(0x0102_0304)).unwrap();
    let begin = messages(&checked.bytes).next().unwrap();
    assert_eq!(begin.msg_type, NFNL_MSG_BATCH_BEGIN);
    assert_eq!(
        begin.payload,
        [0, 0, 0, 10, 8, 0, 1, 0, 1, 2, 3, 4],
        "nfgenmsg, then len 8, type 1, the generation big-endian"
    );
    assert_eq!(
        object_messages(&plain.bytes),
        object_messages(&checked.bytes)
    );
    assert_eq!(checked.ack_seq, plain.ack_seq);
}

#[test]
fn batch_framing_flags_and_sequence_numbers() {
    let mut tx = tx_of(
        Family::Ip,
        vec![
            Op::AddTable,
            Op::AddChain(nat_prerouting()),
            Op::AddSet(service_ips()),
            svc_element_op(),
            rule_op(vmap_rule()),
            Op::FlushChain("c".into()),
            Op::DeleteElements {
                set: "service-ips".into(),
                elements: vec![svc_element()],
            },
            Op::DeleteSet("service-ips".into()),
            Op::DeleteChain("c".into()),
        ],
    );
    tx.push(Family::Ip6, TABLE, Op::DeleteTable);
    let first = 0xffff_fffe; // sequence numbers wrap
    let b = encode_batch(&tx, first).unwrap();
    let msgs: Vec<Msg<'_>> = messages(&b.bytes).collect();
    assert_eq!(msgs.len(), tx.changes.len() + 2);
    assert_eq!(seq_count(&tx), msgs.len() as u32);
    let total: usize = messages(&b.bytes)
        .map(|m| nftkube_netlink::align4(m.payload.len() + 16))
        .sum();
    assert_eq!(total, b.bytes.len(), "messages tile the batch");

    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(m.seq, first.wrapping_add(i as u32));
        assert_eq!(m.pid, 0);
    }
    let (begin, end) = (msgs[0], msgs[msgs.len() - 1]);
    for (m, t) in [(begin, NFNL_MSG_BATCH_BEGIN), (end, NFNL_MSG_BATCH_END)] {
        assert_eq!(m.msg_type, t);
        assert_eq!(
            m.flags,
            nftkube_netlink::NLM_F_REQUEST,
            "no ACK on BEGIN/END"
        );
        assert_eq!(m.payload, [0, 0, 0, 10], "res_id NFNL_SUBSYS_NFTABLES");
    }

    use nftkube_netlink::{NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST};
    let objects = &msgs[1..msgs.len() - 1];
    let expect: Vec<(u16, u16)> = vec![
        (NFT_MSG_NEWTABLE, NLM_F_CREATE),
        (NFT_MSG_NEWCHAIN, NLM_F_CREATE),
        (NFT_MSG_NEWSET, NLM_F_CREATE),
        (NFT_MSG_NEWSETELEM, NLM_F_CREATE),
        (NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND),
        (NFT_MSG_DELRULE, 0),
        (NFT_MSG_DELSETELEM, 0),
        (NFT_MSG_DELSET, 0),
        (NFT_MSG_DELCHAIN, 0),
        (NFT_MSG_DELTABLE, 0),
    ];
    for (k, (m, (t, f))) in objects.iter().zip(&expect).enumerate() {
        let last = k + 1 == objects.len();
        assert_eq!(m.msg_type, (NFNL_SUBSYS_NFTABLES << 8) | t, "message {k}");
        let ack = if last { NLM_F_ACK } else { 0 };
        assert_eq!(m.flags, NLM_F_REQUEST | f | ack, "message {k}");
        let family = if last { 10 } else { 2 };
        assert_eq!(m.payload[..4], [family, 0, 0, 0], "message {k} nfgenmsg");
        assert_eq!(b.change_index(m.seq), Some(k));
    }
    assert_eq!(b.ack_seq, objects.last().unwrap().seq);
    assert_eq!(b.change_index(begin.seq), None);
    assert_eq!(b.change_index(end.seq), None);
}

#[test]
fn big_element_lists_are_split_and_map_back_to_their_change() {
    let elements: Vec<Element> = (0..10_000u32)
        .map(|i| Element {
            key: concat_key(&[i.to_be_bytes().to_vec(), vec![6], vec![0, 80]]).into(),
            value: Some(ElementValue::Verdict(Verdict::Goto(
                format!("service-{i}").into(),
            ))),
        })
        .collect();
    let tx = tx_of(
        Family::Ip,
        vec![
            Op::AddElements {
                set: "service-ips".into(),
                elements: elements.clone(),
            },
            rule_op(vmap_rule()),
        ],
    );
    let b = encode_batch(&tx, 1).unwrap();
    let objects = object_messages(&b.bytes);
    assert!(objects.len() > 3, "{} messages", objects.len());
    assert_eq!(seq_count(&tx), objects.len() as u32 + 2);
    let mut decoded = Vec::new();
    for (t, flags, seq, payload) in &objects[..objects.len() - 1] {
        assert_eq!(*t & 0xff, NFT_MSG_NEWSETELEM);
        assert_eq!(flags & nftkube_netlink::NLM_F_ACK, 0);
        assert_eq!(b.change_index(*seq), Some(0));
        // The element list is one attribute: its 16-bit length must not overflow.
        assert!(payload.len() < 65_000, "{}", payload.len());
        let (table, set, els) = decode_elements(payload).unwrap();
        assert_eq!((table.as_str(), set.as_str()), (TABLE, "service-ips"));
        decoded.extend(els);
    }
    assert_eq!(decoded, elements);
    let (_, _, last_seq, _) = objects.last().unwrap();
    assert_eq!(b.change_index(*last_seq), Some(1));
    assert_eq!(b.ack_seq, *last_seq);
}

// ---------------------------------------------------------------------------------------------------------
// Round trips: what we encode decodes to the same value.

fn single_payload(family: Family, op: Op) -> (u16, Vec<u8>) {
    let b = encode_batch(&tx_of(family, vec![op]), 7).unwrap();
    let objects = object_messages(&b.bytes);
    assert_eq!(objects.len(), 1);
    let (t, _, _, payload) = objects.into_iter().next().unwrap();
    assert_eq!(payload[0], family.nfproto());
    (t & 0xff, payload)
}

fn roundtrip_rule(family: Family, rule: &Rule) -> Rule {
    let (t, p) = single_payload(
        family,
        Op::AddRule {
            chain: "some-chain".into(),
            rule: rule.clone(),
        },
    );
    assert_eq!(t, NFT_MSG_NEWRULE);
    let (table, chain, got) = decode_rule(&p).unwrap();
    assert_eq!((table.as_str(), chain.as_str()), (TABLE, "some-chain"));
    got
}

/// One value of every expression shape, with the variations of each that change the bytes.
fn all_exprs() -> Vec<Expr> {
    let mut v = Vec::new();
    for (base, offset, len) in [
        (PayloadBase::LinkLayer, 12, 2),
        (PayloadBase::Network, 16, 4),
        (PayloadBase::Network, 24, 16),
        (PayloadBase::Transport, 2, 2),
    ] {
        v.push(Expr::Payload {
            base,
            offset,
            len,
            dreg: reg32(3),
        });
    }
    for key in [
        MetaKey::Mark,
        MetaKey::L4Proto,
        MetaKey::NfProto,
        MetaKey::Iif,
        MetaKey::Oif,
        MetaKey::IifName,
        MetaKey::OifName,
        MetaKey::NfTrace,
    ] {
        v.push(Expr::Meta { key, dreg: REG_2 });
    }
    v.push(Expr::MetaSet {
        key: MetaKey::Mark,
        sreg: REG_1,
    });
    v.push(Expr::MetaSet {
        key: MetaKey::NfTrace,
        sreg: REG_1,
    });
    for op in [
        CmpOp::Eq,
        CmpOp::Neq,
        CmpOp::Lt,
        CmpOp::Lte,
        CmpOp::Gt,
        CmpOp::Gte,
    ] {
        v.push(Expr::Cmp {
            sreg: reg32(1),
            op,
            data: vec![1, 2, 3],
        });
    }
    v.push(Expr::Cmp {
        sreg: REG_1,
        op: CmpOp::Eq,
        data: vec![0xfe; 16],
    });
    v.push(Expr::Bitwise {
        sreg: REG_1,
        dreg: REG_2,
        len: 16,
        mask: vec![0xff; 16],
        xor: vec![0; 16],
    });
    v.push(Expr::Immediate {
        dreg: REG_2,
        data: vec![0x1f, 0x90],
    });
    v.push(Expr::Immediate {
        dreg: REG_1,
        data: vec![0xfd; 16],
    });
    for verdict in [
        Verdict::Accept,
        Verdict::Drop,
        Verdict::Continue,
        Verdict::Return,
        Verdict::Jump("a-chain".into()),
        Verdict::Goto("another-chain".into()),
    ] {
        v.push(Expr::Verdict(verdict));
    }
    for (dreg, invert) in [
        (None, false),
        (None, true),
        (Some(REG_VERDICT), false),
        (Some(REG_1), false),
    ] {
        v.push(Expr::Lookup {
            set: "s".into(),
            sreg: REG_1,
            dreg,
            invert,
        });
    }
    for (random, offset) in [(true, 0), (false, 0), (true, 7)] {
        v.push(Expr::Numgen {
            dreg: REG_1,
            modulus: 5,
            random,
            offset,
        });
    }
    for (op, sreg_data, timeout_ms) in [
        (DynsetOp::Add, None, None),
        (DynsetOp::Update, None, Some(10_000)),
        (DynsetOp::Update, Some(REG_2), Some(3_600_000)),
    ] {
        v.push(Expr::Dynset {
            set: "dyn".into(),
            op,
            sreg_key: REG_1,
            sreg_data,
            timeout_ms,
        });
    }
    for (kind, family, reg_addr, reg_proto, flags) in [
        (
            NatKind::Dnat,
            Family::Ip,
            Some(REG_1),
            Some(REG_2),
            NatFlags::MAP_IPS | NatFlags::PROTO_SPECIFIED,
        ),
        (
            NatKind::Dnat,
            Family::Ip6,
            Some(REG_1),
            Some(REG_2),
            NatFlags::MAP_IPS | NatFlags::PROTO_SPECIFIED,
        ),
        (
            NatKind::Dnat,
            Family::Ip,
            Some(REG_1),
            Some(reg32(1)),
            NatFlags::MAP_IPS | NatFlags::PROTO_SPECIFIED,
        ),
        (
            NatKind::Snat,
            Family::Ip,
            Some(REG_1),
            None,
            NatFlags::MAP_IPS,
        ),
        (NatKind::Snat, Family::Ip6, None, None, NatFlags::EMPTY),
        (
            NatKind::Snat,
            Family::Ip,
            Some(REG_1),
            None,
            NatFlags::MAP_IPS | NatFlags::PERSISTENT | NatFlags::PROTO_RANDOM,
        ),
    ] {
        v.push(Expr::Nat {
            kind,
            family,
            reg_addr,
            reg_proto,
            flags,
        });
    }
    v.push(Expr::Masq {
        flags: NatFlags::EMPTY,
    });
    v.push(Expr::Redir {
        reg_proto: Some(REG_1),
        flags: NatFlags::PROTO_SPECIFIED,
    });
    v.push(Expr::Redir {
        reg_proto: None,
        flags: NatFlags::EMPTY,
    });
    v.push(Expr::Masq {
        flags: NatFlags::PROTO_RANDOM_FULLY,
    });
    for kind in [
        RejectKind::TcpReset,
        RejectKind::IcmpUnreach(ICMP_PORT_UNREACH),
        RejectKind::IcmpUnreach(ICMPV6_PORT_UNREACH),
        RejectKind::IcmpxUnreach(1),
        RejectKind::IcmpxUnreach(0),
    ] {
        v.push(Expr::Reject(kind));
    }
    for key in [CtKey::State, CtKey::Status, CtKey::Mark] {
        v.push(Expr::Ct { key, dreg: REG_1 });
    }
    for key in [CtKey::DstIp, CtKey::DstIp6, CtKey::ProtoDst] {
        v.push(Expr::CtOriginal {
            key,
            dreg: reg32(1),
        });
    }
    v.push(Expr::Fib {
        flags: FibFlags::DADDR,
        result: FibResult::ADDRTYPE,
        dreg: REG_1,
    });
    v.push(Expr::Fib {
        flags: FibFlags::SADDR | FibFlags::IIF,
        result: FibResult::OIF,
        dreg: reg32(2),
    });
    v.push(Expr::Counter);
    v
}

#[test]
fn flag_bits_without_a_name_are_kept() {
    // NF_NAT_RANGE_NETMAP, NFTA_FIB_F_PRESENT and an unnamed fib result: read from another tool's rule, they
    // must survive decoding, so that the rule does not compare equal to ours.
    let netmap = NatFlags::from_bits_retain(1 << 6);
    let present = FibFlags::from_bits_retain(1 << 5);
    let rule = Rule {
        exprs: vec![
            Expr::Masq {
                flags: netmap | NatFlags::PERSISTENT,
            },
            Expr::Fib {
                flags: FibFlags::DADDR | present,
                result: FibResult::from_number(7),
                dreg: REG_1,
            },
        ],
        comment: None,
    };
    let got = roundtrip_rule(Family::Ip, &rule);
    assert_eq!(got, rule);
    let Expr::Masq { flags } = got.exprs[0] else {
        panic!("{got:?}")
    };
    assert_eq!(flags.bits(), (1 << 6) | NF_NAT_RANGE_PERSISTENT);
    assert!(flags.contains(NatFlags::PERSISTENT) && !flags.contains(NatFlags::PROTO_RANDOM));
    assert_ne!(
        got.exprs[0],
        Expr::Masq {
            flags: NatFlags::PERSISTENT
        }
    );
    let Expr::Fib { flags, result, .. } = got.exprs[1] else {
        panic!("{got:?}")
    };
    assert_eq!(
        (flags.bits(), result.number()),
        ((1 << 5) | NFTA_FIB_F_DADDR, 7)
    );
}

/// Exhaustive on purpose: a new Expr variant does not compile here until it is added to `all_exprs`.
fn variant(e: &Expr) -> usize {
    match e {
        Expr::Payload { .. } => 0,
        Expr::Meta { .. } => 1,
        Expr::MetaSet { .. } => 2,
        Expr::Cmp { .. } => 3,
        Expr::Bitwise { .. } => 4,
        Expr::Immediate { .. } => 5,
        Expr::Verdict(_) => 6,
        Expr::Lookup { .. } => 7,
        Expr::Numgen { .. } => 8,
        Expr::Dynset { .. } => 9,
        Expr::Nat { .. } => 10,
        Expr::Masq { .. } => 11,
        Expr::Reject(_) => 12,
        Expr::Ct { .. } => 13,
        Expr::Fib { .. } => 14,
        Expr::Counter => 15,
        Expr::CtOriginal { .. } => 16,
        // Decoded as a lookup of the kernel's name for the set, resolved when a table is read: see
        // `anonymous_sets_go_in_the_batch_before_their_rule`.
        Expr::LookupAnon { .. } => 17,
        Expr::Redir { .. } => 18,
    }
}
const VARIANTS: usize = 19;

#[test]
fn anonymous_sets_go_in_the_batch_before_their_rule() {
    let rule = crate::build::RuleBuilder::new()
        .transport_protocol()
        .verdict(Verdict::Accept)
        .build();
    let mut tx = Transaction::default();
    tx.push(
        Family::Ip,
        "t",
        Op::AddRule {
            chain: "c".into(),
            rule,
        },
    );
    let batch = encode_batch(&tx, 1).unwrap();
    let types: Vec<u16> = messages(&batch.bytes).map(|m| m.msg_type & 0xff).collect();
    assert_eq!(
        types,
        [
            NFNL_MSG_BATCH_BEGIN & 0xff,
            NFT_MSG_NEWSET,
            NFT_MSG_NEWSETELEM,
            NFT_MSG_NEWRULE,
            NFNL_MSG_BATCH_END & 0xff
        ]
    );
}

#[test]
fn every_expression_variant_round_trips() {
    let exprs = all_exprs();
    let mut seen = [false; VARIANTS];
    for e in &exprs {
        seen[variant(e)] = true;
    }
    seen[17] = true; // LookupAnon: see anonymous_sets_go_in_the_batch_before_their_rule
    assert!(seen.iter().all(|s| *s), "variants covered: {seen:?}");
    // One at a time, so a failure names the expression...
    for e in &exprs {
        let rule = Rule {
            exprs: vec![e.clone()],
            comment: None,
        };
        assert_eq!(roundtrip_rule(Family::Ip, &rule), rule, "{e:?}");
    }
    // ...and all in one rule, in every family.
    let rule = Rule {
        exprs: exprs.clone(),
        comment: Some("every expression".into()),
    };
    for family in [Family::Ip, Family::Ip6, Family::Inet] {
        assert_eq!(roundtrip_rule(family, &rule), rule);
    }
}

#[test]
fn builder_rules_round_trip() {
    let ip4: std::net::IpAddr = "10.244.1.2".parse().unwrap();
    let ip6: std::net::IpAddr = "fd00:10:244::2".parse().unwrap();
    let net6: std::net::IpAddr = "fd00:10:244::".parse().unwrap();
    let rules = vec![
        vmap_rule(),
        numgen_dnat_rule(),
        mark_or_rule(),
        masq_rule(),
        reject_rule(),
        ct_dnat_rule(),
        fib_rule(),
        dynset_rule(),
        RuleBuilder::new().masquerade(false).build(),
        RuleBuilder::new().mark_xor(0x4000).build(),
        RuleBuilder::new()
            .mark_has(0x4000, false)
            .verdict(Verdict::Return)
            .build(),
        RuleBuilder::new()
            .prefix(Field::IpSaddr, &"10.244.0.0".parse().unwrap(), 16, true)
            .mark_or(0x4000)
            .comment("from outside the cluster CIDR")
            .build(),
        RuleBuilder::new()
            .prefix(Field::Ip6Saddr, &net6, 56, false)
            .build(),
        RuleBuilder::new()
            .in_set(&[Field::Ip6Saddr, Field::Ip6Daddr], "hairpin", false)
            .in_set(&[Field::ThSport], "ports", true)
            .build(),
        RuleBuilder::new()
            .cmp(Field::L4Proto, CmpOp::Eq, vec![17])
            .dnat(&ip6, 53)
            .comment("ns/dns:dns")
            .build(),
        RuleBuilder::new().dnat(&ip4, 1).build(),
        RuleBuilder::new()
            .ct_has(CtKey::State, CT_STATE_ESTABLISHED | CT_STATE_RELATED)
            .verdict(Verdict::Accept)
            .build(),
        RuleBuilder::new()
            .vmap(
                &[Field::Ip6Daddr, Field::L4Proto, Field::ThDport],
                "service-ips",
            )
            .build(),
    ];
    for r in &rules {
        assert_eq!(&roundtrip_rule(Family::Ip, r), r);
    }
}

#[test]
fn concatenated_loads_use_the_registers_the_kernel_dumps() {
    // 16-byte aligned slots are dumped as NFT_REG_1..4, the others as NFT_REG32_xx.
    let regs = |fields: &[Field]| -> Vec<u32> {
        load_concat(fields)
            .iter()
            .map(|e| match e {
                Expr::Payload { dreg, .. } | Expr::Meta { dreg, .. } => *dreg,
                other => panic!("{other:?}"),
            })
            .collect()
    };
    assert_eq!(
        regs(&[Field::IpDaddr, Field::L4Proto, Field::ThDport]),
        vec![REG_1, reg32(1), reg32(2)]
    );
    // ip6 daddr fills slots 0..3, so l4proto lands on slot 4 = NFT_REG_2 and dport on slot 5.
    assert_eq!(
        regs(&[Field::Ip6Daddr, Field::L4Proto, Field::ThDport]),
        vec![REG_1, REG_2, reg32(5)]
    );
    assert_eq!(
        key_len(&[
            DataType::Ipv6Addr,
            DataType::InetProto,
            DataType::InetService
        ]),
        24
    );
}

#[test]
fn numgen_compares_are_host_endian() {
    let r = RuleBuilder::new().numgen_eq(4, 2).build();
    assert_eq!(
        r.exprs[1],
        Expr::Cmp {
            sreg: REG_1,
            op: CmpOp::Eq,
            data: 2u32.to_ne_bytes().to_vec(),
        }
    );
    assert_eq!(roundtrip_rule(Family::Ip, &r), r);
}

#[test]
fn comments_round_trip_and_are_cut_like_the_kernel_keeps_them() {
    let mut r = masq_rule();
    r.comment = Some("default/kubernetes:https".into());
    assert_eq!(roundtrip_rule(Family::Ip, &r), r);
    assert_eq!(
        comment_udata("ab"),
        vec![NFTNL_UDATA_RULE_COMMENT, 3, b'a', b'b', 0]
    );

    // Longer than 127 bytes: the encoder stores the first 127, so only a comment already cut that way
    // reads back equal. RuleBuilder cuts it.
    r.comment = Some("x".repeat(300));
    assert_eq!(
        roundtrip_rule(Family::Ip, &r).comment,
        Some("x".repeat(127))
    );
    let built = RuleBuilder::new()
        .masquerade(true)
        .comment("x".repeat(300))
        .build();
    assert_eq!(built.comment, Some("x".repeat(127)));
    assert_eq!(roundtrip_rule(Family::Ip, &built), built);

    // A multi-byte character across the cut: cut before it, never inside (that would not decode as text).
    let long = format!("{}é{}", "a".repeat(126), "b".repeat(10));
    assert_eq!(stored_comment(&long), "a".repeat(126));
    let built = RuleBuilder::new().comment(long).build();
    assert_eq!(built.comment, Some("a".repeat(126)));
    assert_eq!(roundtrip_rule(Family::Ip, &built), built);
    assert_eq!(stored_comment("é"), "é");
    assert_eq!(stored_comment(""), "");
}

fn all_sets() -> Vec<Set> {
    let set = Set::new;
    use DataType::*;
    vec![
        service_ips(),
        aff(),
        set("v4", vec![Ipv4Addr], vec![]),
        set("v6", vec![Ipv6Addr], vec![]),
        set("protos", vec![InetProto], vec![]),
        set("ports", vec![InetService], vec![]),
        set("marks", vec![Mark], vec![]),
        set("ints", vec![Integer(4)], vec![]),
        set("shorts", vec![Integer(2)], vec![]),
        set("hairpin", vec![Ipv4Addr, Ipv4Addr], vec![]),
        set("hairpin6", vec![Ipv6Addr, Ipv6Addr], vec![]),
        set(
            "service-ips6",
            vec![Ipv6Addr, InetProto, InetService],
            vec![Verdict],
        ),
        set(
            "eps",
            vec![Ipv4Addr, InetService],
            vec![Ipv4Addr, InetService],
        ),
        set("slots", vec![Integer(4)], vec![Ipv4Addr]),
        set("mark-map", vec![Ipv4Addr], vec![Mark]),
        set("proto-vmap", vec![InetProto], vec![Verdict]),
        Set {
            timeout_ms: Some(60_000),
            dynamic: true,
            ..set("dyn-map", vec![Ipv4Addr], vec![Ipv4Addr])
        },
        Set {
            size: Some(1024),
            ..set("bounded", vec![Ipv4Addr], vec![])
        },
        Set {
            dynamic: true,
            ..set("dyn-no-timeout", vec![Ipv6Addr, InetService], vec![])
        },
        Set::typed(
            "typeof-slots",
            vec![
                TypeofExpr::Ip6Daddr,
                TypeofExpr::MetaL4proto,
                TypeofExpr::ThDport,
                TypeofExpr::NumgenRandom {
                    modulus: 131072,
                    offset: 0,
                },
            ],
            vec![TypeofExpr::Ip6Daddr, TypeofExpr::ThDport],
        ),
    ]
}

#[test]
fn sets_round_trip() {
    for family in [Family::Ip, Family::Ip6, Family::Inet] {
        for s in all_sets() {
            let (t, p) = single_payload(family, Op::AddSet(s.clone()));
            assert_eq!(t, NFT_MSG_NEWSET);
            let (table, got, flags) = decode_set(&p).unwrap();
            assert_eq!(table, TABLE);
            assert_eq!(got, s);
            assert_eq!(flags, set_flags(&s));
        }
    }
}

#[test]
fn set_flags_follow_the_kernels_rules() {
    // A timeout needs NFT_SET_TIMEOUT, and dynamically updated sets carry NFT_SET_EVAL.
    assert_eq!(set_flags(&aff()), NFT_SET_TIMEOUT | NFT_SET_EVAL);
    assert_eq!(set_flags(&service_ips()), NFT_SET_MAP);
    let (_, p) = single_payload(Family::Ip, Op::AddSet(aff()));
    let (_, attrs) = (p[0], nftkube_netlink::Attrs(&p[4..]));
    assert_eq!(
        attrs.get(NFTA_SET_TIMEOUT).and_then(|a| a.be64()),
        Some(10_800_000)
    );
    assert!(attrs.get(NFTA_SET_DATA_TYPE).is_none());
    assert!(attrs.get(NFTA_SET_DATA_LEN).is_none());
}

#[test]
fn elements_round_trip() {
    let cases: Vec<(&str, Vec<Element>)> = vec![
        ("service-ips", vec![svc_element()]),
        (
            "vmap",
            [
                Verdict::Accept,
                Verdict::Drop,
                Verdict::Continue,
                Verdict::Return,
                Verdict::Jump("j".into()),
                Verdict::Goto("g".repeat(200).into()),
            ]
            .into_iter()
            .enumerate()
            .map(|(i, v)| Element {
                key: vec![i as u8].into(),
                value: Some(ElementValue::Verdict(v)),
            })
            .collect(),
        ),
        (
            "v6",
            vec![Element {
                key: ip_bytes(&"fd00::1".parse().unwrap()).into(),
                value: None,
            }],
        ),
        (
            "eps",
            vec![Element {
                key: concat_key(&[vec![10, 96, 0, 1], vec![0, 53]]).into(),
                value: Some(ElementValue::Data(
                    concat_key(&[vec![10, 244, 0, 5], vec![0x1f, 0x90]]).into(),
                )),
            }],
        ),
        (
            "slots",
            (0..3u32)
                .map(|i| Element {
                    key: i.to_ne_bytes().into(),
                    value: Some(ElementValue::Data([10, 244, 0, i as u8].into())),
                })
                .collect(),
        ),
        ("empty", vec![]),
    ];
    for (name, elements) in cases {
        for add in [true, false] {
            let op = if add {
                Op::AddElements {
                    set: name.into(),
                    elements: elements.clone(),
                }
            } else {
                Op::DeleteElements {
                    set: name.into(),
                    elements: elements.clone(),
                }
            };
            let b = encode_batch(&tx_of(Family::Ip, vec![op]), 1).unwrap();
            let objects = object_messages(&b.bytes);
            if elements.is_empty() {
                assert!(objects.is_empty(), "no message for no elements");
                continue;
            }
            assert_eq!(objects.len(), 1);
            let (t, _, _, p) = &objects[0];
            let want = if add {
                NFT_MSG_NEWSETELEM
            } else {
                NFT_MSG_DELSETELEM
            };
            assert_eq!(t & 0xff, want);
            let (table, set, got) = decode_elements(p).unwrap();
            assert_eq!((table.as_str(), set.as_str()), (TABLE, name));
            assert_eq!(got, elements);
        }
    }
}

#[test]
fn chains_round_trip() {
    let mut chains = vec![Chain {
        name: "services".into(),
        base: None,
    }];
    for (hook, chain_type, priority) in [
        (Hook::Prerouting, ChainType::Nat, -100),
        (Hook::Input, ChainType::Filter, 0),
        (Hook::Forward, ChainType::Filter, -10),
        (Hook::Output, ChainType::Route, -150),
        (Hook::Output, ChainType::Nat, -100),
        (Hook::Postrouting, ChainType::Nat, 100),
        (Hook::Postrouting, ChainType::Filter, i32::MIN),
        (Hook::Input, ChainType::Filter, i32::MAX),
    ] {
        chains.push(Chain::base(
            &format!("{}-{}", chain_type.as_str(), hook.as_str()),
            chain_type,
            hook,
            priority,
        ));
    }
    // What drift can leave behind, read back as it is so that it compares unequal to ours.
    let mut dropping = Chain::base("dropping", ChainType::Filter, Hook::Forward, 0);
    dropping.base.as_mut().unwrap().policy = Policy::Drop;
    chains.push(dropping);
    let mut bound = Chain::base("bound", ChainType::Filter, Hook::Prerouting, 0);
    bound.base.as_mut().unwrap().device = Some("eth0".into());
    chains.push(bound);
    for family in [Family::Ip, Family::Ip6, Family::Inet] {
        for c in &chains {
            let (t, p) = single_payload(family, Op::AddChain(c.clone()));
            assert_eq!(t, NFT_MSG_NEWCHAIN);
            assert_eq!(decode_chain(&p).unwrap(), (TABLE.to_string(), c.clone()));
        }
    }
}

#[test]
fn tables_round_trip() {
    for family in [Family::Ip, Family::Ip6, Family::Inet] {
        let (t, p) = single_payload(family, Op::AddTable);
        assert_eq!(t, NFT_MSG_NEWTABLE);
        assert_eq!(decode_table(&p).unwrap(), (family, TABLE.to_string()));
        // Flags are sent explicitly, so that the same message wakes a dormant table.
        assert_eq!(decode_table_flags(&p).unwrap(), TableFlags::EMPTY);
    }
}

#[test]
fn unknown_expressions_decode_to_a_rule_that_never_matches_ours() {
    // A rule the kernel holds with an expression we do not model (here `log`) must not compare equal
    // to an empty rule of ours, and must say why.
    let mut m = nftkube_netlink::MsgBuilder::new(0, 0, 0);
    m.raw(&[2, 0, 0, 0]);
    m.attr_str(NFTA_RULE_TABLE, TABLE);
    m.attr_str(NFTA_RULE_CHAIN, "c");
    m.nested(NFTA_RULE_EXPRESSIONS, |m| {
        m.nested(NFTA_LIST_ELEM, |m| {
            m.attr_str(NFTA_EXPR_NAME, "log");
            m.nested(NFTA_EXPR_DATA, |_| {});
        });
    });
    let bytes = m.finish().unwrap();
    let (_, _, rule) = decode_rule(&bytes[16..]).unwrap();
    assert!(rule.exprs.is_empty());
    assert!(rule.comment.unwrap().contains("log"));
}

// ---------------------------------------------------------------------------------------------------------
// Text: the rules above in nft syntax (checked against `nft list ruleset` output for the same rules).

fn text_table() -> TableState {
    let mut t = TableState::new(Family::Ip, TABLE);
    t.add_set(service_ips());
    t.add_set(aff());
    t
}

#[test]
fn rules_render_as_nft_text() {
    let t = text_table();
    let cases = [
        (
            vmap_rule(),
            "ip daddr . meta l4proto . th dport vmap @service-ips",
        ),
        (
            numgen_dnat_rule(),
            "meta l4proto tcp numgen random mod 3 0 dnat to 10.244.1.2:8080",
        ),
        (mark_or_rule(), "meta mark set meta mark | 0x00004000"),
        (masq_rule(), "masquerade fully-random"),
        (reject_rule(), "meta l4proto tcp reject with tcp reset"),
        (ct_dnat_rule(), "ct status dnat"),
        (fib_rule(), "fib daddr type local"),
        (dynset_rule(), "update @aff { ip saddr timeout 10s }"),
        (
            RuleBuilder::new()
                .prefix(Field::IpSaddr, &"10.244.0.0".parse().unwrap(), 16, true)
                .mark_or(0x4000)
                .comment("from outside the cluster CIDR")
                .build(),
            "ip saddr != 10.244.0.0/16 meta mark set meta mark | 0x00004000 comment \"from outside the cluster CIDR\"",
        ),
        (
            RuleBuilder::new()
                .ct_has(CtKey::State, CT_STATE_ESTABLISHED | CT_STATE_RELATED)
                .verdict(Verdict::Accept)
                .build(),
            "ct state established,related accept",
        ),
        (
            RuleBuilder::new()
                .mark_has(0x4000, false)
                .verdict(Verdict::Return)
                .build(),
            "meta mark & 0x00004000 == 0x00000000 return",
        ),
    ];
    for (rule, want) in cases {
        assert_eq!(text::render_rule(&rule, &t), want);
        // What the kernel would hand back renders the same.
        assert_eq!(
            text::render_rule(&roundtrip_rule(Family::Ip, &rule), &t),
            want
        );
    }
}

#[test]
fn sets_and_elements_render_as_nft_text() {
    let mut t = text_table();
    t.set_mut("service-ips").elements.insert(svc_element());
    let out = text::render_table(&t);
    assert!(
        out.contains(
            "map service-ips {\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n"
        ),
        "{out}"
    );
    assert!(
        out.contains("elements = { 10.96.0.10 . tcp . 80 : goto svc }"),
        "{out}"
    );
    assert!(
        out.contains("flags dynamic,timeout\n\t\ttimeout 10800s\n"),
        "{out}"
    );
}

/// `nft add element ip nftkube ports-net '{ tcp . 8080 comment "c1 eth0" : 10.88.0.2 . 80 }'`: the bytes of
/// the element list are those `nft --debug=mnl` shows (nft 1.0.6 adds NFTA_SET_ELEM_LIST_SET_ID, which the
/// kernel needs only for a set created in the same batch).
#[cfg(target_endian = "little")]
#[test]
fn pinned_commented_element() {
    let element = CommentedElement {
        element: Element {
            key: concat_key(&[vec![6], 8080u16.to_be_bytes().to_vec()]).into(),
            value: Some(ElementValue::Data(
                concat_key(&[vec![10, 88, 0, 2], 80u16.to_be_bytes().to_vec()]).into(),
            )),
        },
        comment: "c1 eth0".into(),
    };
    let op = Op::AddCommentedElements {
        set: "ports-net".into(),
        elements: vec![element.clone()],
    };
    let bytes = one_message(Family::Ip, op);
    assert_pinned(
        &bytes,
        concat!(
            "68000000 0c0a 0504 02000000 00000000", // NFT_MSG_NEWSETELEM (12), REQUEST|ACK|CREATE
            "02000000",
            "0c00 0100 6e66746b75626500", // NFTA_SET_ELEM_LIST_TABLE
            "0e00 0200 706f7274732d6e657400 0000", // NFTA_SET_ELEM_LIST_SET "ports-net"
            "3800 0380",                  // NFTA_SET_ELEM_LIST_ELEMENTS
            "    3400 0180",              //   NFTA_LIST_ELEM
            "        1000 0180",          //     NFTA_SET_ELEM_KEY
            "            0c00 0100 06000000 1f900000", // tcp (padded) . 8080
            "        1000 0280",          //     NFTA_SET_ELEM_DATA
            "            0c00 0100 0a580002 00500000", // 10.88.0.2 . 80
            // NFTA_SET_ELEM_USERDATA: TLV comment (0), 8 bytes, "c1 eth0" NUL-terminated; padded to 4.
            "        0e00 0600 0008 63312065746830 00 0000",
        ),
    );
    // And back: the dump of that element carries the comment.
    let payload = &bytes[16..];
    let (table, set, read) = decode_commented_elements(payload).unwrap();
    assert_eq!((table.as_str(), set.as_str()), (TABLE, "ports-net"));
    assert_eq!(read, vec![(element.element, Some("c1 eth0".to_string()))]);
}

#[test]
fn delete_rule_names_table_chain_and_handle() {
    let (t, p) = single_payload(
        Family::Ip6,
        Op::DeleteRule {
            chain: "PREROUTING".into(),
            handle: 0x0102_0304_0506_0708,
        },
    );
    assert_eq!(t, NFT_MSG_DELRULE);
    let a = nftkube_netlink::Attrs(&p[4..]);
    assert_eq!(a.get(NFTA_RULE_TABLE).and_then(|x| x.str()), Some(TABLE));
    assert_eq!(
        a.get(NFTA_RULE_CHAIN).and_then(|x| x.str()),
        Some("PREROUTING")
    );
    assert_eq!(
        a.get(NFTA_RULE_HANDLE).and_then(|x| x.be64()),
        Some(0x0102_0304_0506_0708)
    );
}

/// A rule as iptables-nft 1.8 writes `-m comment --comment C ... -j TARGET`: the comment in an xtables
/// `match` (struct xt_comment_info, 256 bytes), a counter, then the verdict; `last` is the final expression.
fn iptables_rule(
    handle: u64,
    comment: &str,
    last: impl Fn(&mut nftkube_netlink::MsgBuilder),
) -> Vec<u8> {
    let mut m = nftkube_netlink::MsgBuilder::new(0, 0, 0);
    m.raw(&[2, 0, 0, 0]);
    m.attr_str(NFTA_RULE_TABLE, "nat");
    m.attr_str(NFTA_RULE_CHAIN, "PREROUTING");
    m.attr_be64(NFTA_RULE_HANDLE, handle);
    let mut info = comment.as_bytes().to_vec();
    info.resize(256, 0);
    m.nested(NFTA_RULE_EXPRESSIONS, |m| {
        m.nested(NFTA_LIST_ELEM, |m| {
            m.attr_str(NFTA_EXPR_NAME, "match");
            m.nested(NFTA_EXPR_DATA, |m| {
                m.attr_str(NFTA_MATCH_NAME, "comment");
                m.attr_be32(2, 0); // NFTA_MATCH_REV
                m.attr(NFTA_MATCH_INFO, &info);
            });
        });
        m.nested(NFTA_LIST_ELEM, |m| {
            m.attr_str(NFTA_EXPR_NAME, "counter");
            m.nested(NFTA_EXPR_DATA, |_| {});
        });
        m.nested(NFTA_LIST_ELEM, |m| last(m));
    });
    m.finish().unwrap()[16..].to_vec()
}

fn jump_to(m: &mut nftkube_netlink::MsgBuilder, code: i32, chain: &str) {
    m.attr_str(NFTA_EXPR_NAME, "immediate");
    m.nested(NFTA_EXPR_DATA, |m| {
        m.attr_be32(NFTA_IMMEDIATE_DREG, 0);
        m.nested(NFTA_IMMEDIATE_DATA, |m| {
            m.nested(NFTA_DATA_VERDICT, |m| {
                m.attr_be32(NFTA_VERDICT_CODE, code as u32);
                m.attr_str(NFTA_VERDICT_CHAIN, chain);
            });
        });
    });
}

#[test]
fn iptables_nft_rules_outline_their_comment_handle_and_jump() {
    let p = iptables_rule(10, "kubernetes service portals", |m| {
        jump_to(m, -3, "KUBE-SERVICES")
    });
    let (table, o) = decode_rule_outline(&p).unwrap();
    assert_eq!(
        (table.as_str(), o.chain.as_str(), o.handle),
        ("nat", "PREROUTING", 10)
    );
    assert_eq!(o.comment.as_deref(), Some("kubernetes service portals"));
    assert_eq!(o.targets, ["KUBE-SERVICES"]);
    assert_eq!(o.last_verdict, Some(Verdict::Jump("KUBE-SERVICES".into())));
    assert!(!o.unreadable);
}

#[test]
fn a_rule_ending_in_no_verdict_has_none_and_an_unknown_verdict_is_unreadable() {
    let p = iptables_rule(3, "x", |m| {
        m.attr_str(NFTA_EXPR_NAME, "counter");
        m.nested(NFTA_EXPR_DATA, |_| {});
    });
    let (_, o) = decode_rule_outline(&p).unwrap();
    assert_eq!(o.last_verdict, None);
    let p = iptables_rule(4, "x", |m| jump_to(m, 7, "KUBE-SERVICES"));
    let (_, o) = decode_rule_outline(&p).unwrap();
    assert!(o.unreadable, "an unknown verdict code may lead anywhere");
    assert_eq!(o.last_verdict, None);
}
