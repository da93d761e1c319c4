//! ctnetlink codec tests: pinned bytes (each with the equivalent `conntrack` command), decoding, and the
//! "never a DELETE without a tuple" guard.
//!
//! Layout of each pinned line: `len type payload`. Netlink and attribute headers are host-endian (these pins
//! are for little-endian hosts); addresses, ports, ids and timeouts are big-endian; CTA_FILTER flags are
//! host-endian (NLA_U32). Message type = NFNL_SUBSYS_CTNETLINK (1) << 8 | IPCTNL_MSG_*; nested attributes
//! carry NLA_F_NESTED (0x8000, so a nested type 1 reads `0180`).

use super::wire::*;
use nftkube_netlink::attr::{messages, Attrs};
use nftkube_netlink::{MsgBuilder, NLM_F_ACK, NLM_F_REQUEST};
use std::fmt::Write;
use std::net::IpAddr;

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

fn assert_pinned(bytes: &[u8], pin: &str) {
    let want: String = pin.chars().filter(|c| !c.is_whitespace()).collect();
    assert_eq!(hex(bytes), want, "encoded bytes differ from the pin");
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn entry(orig: Tuple, reply: Tuple, zone: ZoneScope, id: Option<u32>) -> Entry {
    Entry {
        orig,
        reply,
        zone,
        id,
        mark: 0,
        status: 0,
        timeout: 0,
    }
}

fn client_to_vip() -> Tuple {
    Tuple::new(ip("10.244.0.2"), 40000, ip("10.96.0.10"), 53, IPPROTO_UDP)
}

fn dnat_reply() -> Tuple {
    Tuple::new(ip("10.244.2.2"), 5353, ip("10.244.0.2"), 40000, IPPROTO_UDP)
}

/// `conntrack -D -p udp --orig-src 10.244.0.2 --orig-dst 10.96.0.10 --sport 40000 --dport 53`, narrowed to
/// the entry with id 0x01020304 (the tool has no id option; with it a delete misses most entries that
/// replaced the dumped one under the same tuple).
#[cfg(target_endian = "little")]
#[test]
fn pinned_delete_by_exact_tuple() {
    let e = entry(
        client_to_vip(),
        dnat_reply(),
        ZoneScope::None,
        Some(0x01020304),
    );
    assert_pinned(
        &encode_delete(&e, 1, true),
        concat!(
            "50000000 0201 0500 01000000 00000000", // len 80, IPCTNL_MSG_CT_DELETE, REQUEST|ACK, seq 1
            "02 00 0000",                           // nfgenmsg: AF_INET, version 0, res_id 0
            "3400 0180",                            // CTA_TUPLE_ORIG
            "    1400 0180",                        //   CTA_TUPLE_IP
            "        0800 0100 0af40002",           //     CTA_IP_V4_SRC 10.244.0.2
            "        0800 0200 0a60000a",           //     CTA_IP_V4_DST 10.96.0.10
            "    1c00 0280",                        //   CTA_TUPLE_PROTO
            "        0500 0100 11000000",           //     CTA_PROTO_NUM 17 (udp), padded
            "        0600 0200 9c400000",           //     CTA_PROTO_SRC_PORT 40000
            "        0600 0300 00350000",           //     CTA_PROTO_DST_PORT 53
            "0800 0c00 01020304",                   // CTA_ID
        ),
    );
}

/// `conntrack -D -w 7 -p udp --orig-src 10.244.0.2 --orig-dst 10.96.0.10 --sport 40000 --dport 53`: the zone
/// goes in CTA_ZONE; a zone of the original direction only goes inside the tuple (CTA_TUPLE_ZONE).
#[cfg(target_endian = "little")]
#[test]
fn pinned_delete_with_zone() {
    let both = entry(client_to_vip(), dnat_reply(), ZoneScope::Both(7), None);
    assert_pinned(
        &encode_delete(&both, 2, false),
        concat!(
            "50000000 0201 0100 02000000 00000000", // len 80, REQUEST only (no ACK), seq 2
            "02000000",
            "3400 0180",
            "    1400 0180 0800 0100 0af40002 0800 0200 0a60000a",
            "    1c00 0280 0500 0100 11000000 0600 0200 9c400000 0600 0300 00350000",
            "0600 1200 00070000", // CTA_ZONE 7 (be16), padded
        ),
    );
    let orig = entry(client_to_vip(), dnat_reply(), ZoneScope::Orig(7), None);
    assert_pinned(
        &encode_delete(&orig, 2, false),
        concat!(
            "50000000 0201 0100 02000000 00000000",
            "02000000",
            "3c00 0180",
            "    1400 0180 0800 0100 0af40002 0800 0200 0a60000a",
            "    1c00 0280 0500 0100 11000000 0600 0200 9c400000 0600 0300 00350000",
            "    0600 0300 00070000", //   CTA_TUPLE_ZONE 7
        ),
    );
}

/// `conntrack -D -f ipv6 -p udp --orig-src fd00:244::2 --orig-dst fd00:96::10 --sport 1 --dport 53`
#[cfg(target_endian = "little")]
#[test]
fn pinned_delete_ipv6() {
    let o = Tuple::new(ip("fd00:244::2"), 1, ip("fd00:96::10"), 53, IPPROTO_UDP);
    let e = entry(o, o.inverse(), ZoneScope::None, None);
    assert_pinned(
        &encode_delete(&e, 1, true),
        concat!(
            "60000000 0201 0500 01000000 00000000",
            "0a 00 0000", // AF_INET6
            "4c00 0180",
            "    2c00 0180",
            "        1400 0300 fd000244000000000000000000000002", // CTA_IP_V6_SRC
            "        1400 0400 fd000096000000000000000000000010", // CTA_IP_V6_DST
            "    1c00 0280 0500 0100 11000000 0600 0200 00010000 0600 0300 00350000",
        ),
    );
}

/// `conntrack -L -f ipv4 -p udp --orig-dst 10.96.0.10`: a dump filtered in the kernel (CTA_FILTER, 5.8+).
#[cfg(target_endian = "little")]
#[test]
fn pinned_dump_filtered_by_destination() {
    assert_pinned(
        &encode_dump(&DumpFilter::dst(ip("10.96.0.10"), IPPROTO_UDP), 7),
        concat!(
            "3c000000 0101 0103 07000000 00000000", // IPCTNL_MSG_CT_GET, REQUEST|DUMP (0x301), seq 7
            "02000000",
            "1c00 0180", // CTA_TUPLE_ORIG: only the fields the filter names
            "    0c00 0180 0800 0200 0a60000a", //   CTA_TUPLE_IP { CTA_IP_V4_DST }
            "    0c00 0280 0500 0100 11000000", //   CTA_TUPLE_PROTO { CTA_PROTO_NUM udp }
            "0c00 1980", // CTA_FILTER (25)
            "    0800 0100 0a000000", //   CTA_FILTER_ORIG_FLAGS IP_DST | PROTO_NUM
        ),
    );
}

/// `conntrack -L -f ipv6 -p udp` and `conntrack -L -f ipv6`.
#[cfg(target_endian = "little")]
#[test]
fn pinned_dump_by_protocol_and_family() {
    assert_pinned(
        &encode_dump(&DumpFilter::proto(AF_INET6, IPPROTO_UDP), 1),
        concat!(
            "30000000 0101 0103 01000000 00000000",
            "0a000000",
            "1000 0180 0c00 0280 0500 0100 11000000",
            "0c00 1980 0800 0100 08000000", // PROTO_NUM only
        ),
    );
    assert_pinned(
        &encode_dump(&DumpFilter::family(AF_INET6), 1),
        "14000000 0101 0103 01000000 00000000 0a000000",
    );
}

/// Semantically `conntrack -D -f ipv4 -p udp --orig-dst 10.96.0.10 --dport 53`, done by the kernel in one
/// message (6.12+: a DELETE with CTA_FILTER is a filtered flush). Older kernels see a partial tuple and answer
/// EINVAL: never a flush.
#[cfg(target_endian = "little")]
#[test]
fn pinned_filtered_delete() {
    assert_pinned(
        &encode_filtered_delete(
            &DeleteFilter::to_socket(ip("10.96.0.10"), 53, IPPROTO_UDP),
            3,
        ),
        concat!(
            "44000000 0201 0500 03000000 00000000",
            "02000000",
            "2400 0180",
            "    0c00 0180 0800 0200 0a60000a",
            "    1400 0280 0500 0100 11000000 0600 0300 00350000",
            "0c00 1980 0800 0100 2a000000", // IP_DST | PROTO_NUM | PROTO_DST_PORT
        ),
    );
}

/// `conntrack -I -p udp -s 10.0.0.1 -d 10.0.0.2 --sport 1000 --dport 53 -t 60` (reply tuple: the inverse).
#[cfg(target_endian = "little")]
#[test]
fn pinned_new() {
    let o = Tuple::new(ip("10.0.0.1"), 1000, ip("10.0.0.2"), 53, IPPROTO_UDP);
    assert_pinned(
        &encode_new(&NewEntry::plain(o, 60), 1, true),
        concat!(
            "84000000 0001 0506 01000000 00000000", // IPCTNL_MSG_CT_NEW, REQUEST|ACK|EXCL|CREATE (0x605)
            "02000000",
            "3400 0180",
            "    1400 0180 0800 0100 0a000001 0800 0200 0a000002",
            "    1c00 0280 0500 0100 11000000 0600 0200 03e80000 0600 0300 00350000",
            "3400 0280", // CTA_TUPLE_REPLY
            "    1400 0180 0800 0100 0a000002 0800 0200 0a000001",
            "    1c00 0280 0500 0100 11000000 0600 0200 00350000 0600 0300 03e80000",
            "0800 0700 0000003c", // CTA_TIMEOUT 60 s
        ),
    );
}

fn v4(ip: IpAddr) -> [u8; 4] {
    match ip {
        IpAddr::V4(a) => a.octets(),
        IpAddr::V6(_) => panic!("not IPv4"),
    }
}

/// A dump answer as the kernel writes it (zone, id, mark, status, timeout) decodes back.
#[test]
fn decode_dumped_entry() {
    let orig = client_to_vip();
    let reply = dnat_reply();
    let mut m = MsgBuilder::new(msg_type(IPCTNL_MSG_CT_NEW), 2, 9);
    m.raw(&[AF_INET, 0, 0, 0]);
    for (kind, t) in [(CTA_TUPLE_ORIG, orig), (CTA_TUPLE_REPLY, reply)] {
        m.nested(kind, |m| {
            m.nested(CTA_TUPLE_IP, |m| {
                m.attr(CTA_IP_V4_SRC, &v4(t.src));
                m.attr(CTA_IP_V4_DST, &v4(t.dst));
            });
            m.nested(CTA_TUPLE_PROTO, |m| {
                m.attr_u8(CTA_PROTO_NUM, 17);
                m.attr(CTA_PROTO_SRC_PORT, &t.sport.to_be_bytes());
                m.attr(CTA_PROTO_DST_PORT, &t.dport.to_be_bytes());
            });
        });
    }
    m.attr_be32(CTA_STATUS, 0x1a8);
    m.attr_be32(CTA_TIMEOUT, 29);
    m.attr_be32(CTA_MARK, 0x4000);
    m.attr_be32(CTA_ID, 0xdeadbeef);
    m.attr(CTA_ZONE, &3u16.to_be_bytes());
    let bytes = m.finish().unwrap();
    let msg = messages(&bytes).next().unwrap();
    let e = decode_entry(msg.payload).unwrap();
    assert_eq!(e.orig, orig);
    assert_eq!(e.reply, reply);
    assert_eq!(e.zone, ZoneScope::Both(3));
    assert_eq!(e.id, Some(0xdeadbeef));
    assert_eq!((e.mark, e.status, e.timeout), (0x4000, 0x1a8, 29));
    // Without a tuple there is no entry.
    assert!(decode_entry(&[2, 0, 0, 0]).is_none());
    assert!(decode_entry(&[]).is_none());
}

#[test]
fn new_entries_decode_back_for_both_families() {
    for (src, dst) in [("10.0.0.1", "10.0.0.2"), ("fd00::1", "fd00::2")] {
        let o = Tuple::new(ip(src), 1234, ip(dst), 53, IPPROTO_SCTP);
        let bytes = encode_new(&NewEntry::plain(o, 5), 1, false);
        let msg = messages(&bytes).next().unwrap();
        let e = decode_entry(msg.payload).unwrap();
        assert_eq!((e.orig, e.reply), (o, o.inverse()));
        assert_eq!(e.zone, ZoneScope::None);
        // ICMP-like protocols carry no ports.
        let icmp = Tuple::new(ip(src), 0, ip(dst), 0, 1);
        let bytes = encode_new(&NewEntry::plain(icmp, 5), 1, false);
        let e = decode_entry(messages(&bytes).next().unwrap().payload).unwrap();
        assert_eq!(e.orig, icmp);
    }
}

#[test]
fn every_delete_carries_a_tuple_and_a_flush_is_refused() {
    let e = entry(client_to_vip(), dnat_reply(), ZoneScope::None, Some(1));
    let mut many = Vec::new();
    for i in 0..3 {
        many.extend(encode_delete(&e, i, i == 2));
    }
    assert!(delete_has_tuple(&many));
    assert!(delete_has_tuple(&encode_filtered_delete(
        &DeleteFilter::to_ip(ip("fd00:96::10"), IPPROTO_UDP),
        1
    )));
    // Non-delete messages pass.
    assert!(delete_has_tuple(&encode_dump(
        &DumpFilter::family(AF_INET),
        1
    )));

    // `conntrack -F`: a DELETE with no tuple. Alone, or hidden after valid deletes, or with only a filter.
    let mut flush = MsgBuilder::new(msg_type(IPCTNL_MSG_CT_DELETE), NLM_F_REQUEST | NLM_F_ACK, 5);
    flush.raw(&[AF_INET, 0, 0, 0]);
    let flush = flush.finish().unwrap();
    assert!(!delete_has_tuple(&flush));
    let mut hidden = many.clone();
    hidden.extend(&flush);
    assert!(!delete_has_tuple(&hidden));
    let mut filter_only = MsgBuilder::new(msg_type(IPCTNL_MSG_CT_DELETE), NLM_F_REQUEST, 5);
    filter_only.raw(&[AF_INET, 0, 0, 0]);
    filter_only.attr_be32(CTA_MARK, 1);
    filter_only.nested(CTA_FILTER, |m| {
        m.attr_u32(CTA_FILTER_ORIG_FLAGS, CTA_FILTER_F_IP_DST);
    });
    assert!(!delete_has_tuple(&filter_only.finish().unwrap()));
    // Truncated or empty input is refused too.
    assert!(!delete_has_tuple(&many[..many.len() - 3]));
    assert!(!delete_has_tuple(&[]));
}

#[test]
fn delete_names_exactly_the_dumped_original_tuple() {
    let e = entry(
        Tuple::new(
            ip("fd00:244:0:1::2"),
            5353,
            ip("fd00:96::10"),
            53,
            IPPROTO_UDP,
        ),
        dnat_reply(),
        ZoneScope::Orig(9),
        Some(42),
    );
    let bytes = encode_delete(&e, 1, true);
    let msg = messages(&bytes).next().unwrap();
    assert_eq!(msg.payload[0], AF_INET6);
    let attrs = Attrs(&msg.payload[4..]);
    assert!(
        attrs.get(CTA_TUPLE_REPLY).is_none(),
        "only the original tuple"
    );
    let orig = attrs.get(CTA_TUPLE_ORIG).unwrap().nested();
    let ipn = orig.get(CTA_TUPLE_IP).unwrap().nested();
    assert_eq!(ipn.get(CTA_IP_V6_SRC).unwrap().payload.len(), 16);
    assert_eq!(
        orig.get(CTA_TUPLE_ZONE).unwrap().payload,
        9u16.to_be_bytes()
    );
    assert_eq!(attrs.get(CTA_ID).unwrap().be32(), Some(42));
}

#[test]
fn dump_filter_matches_like_the_kernel() {
    let e = entry(client_to_vip(), dnat_reply(), ZoneScope::None, None);
    assert!(DumpFilter::family(AF_INET).matches(&e));
    assert!(!DumpFilter::family(AF_INET6).matches(&e));
    assert!(DumpFilter::proto(AF_INET, IPPROTO_UDP).matches(&e));
    assert!(!DumpFilter::proto(AF_INET, IPPROTO_TCP).matches(&e));
    assert!(DumpFilter::dst(ip("10.96.0.10"), IPPROTO_UDP).matches(&e));
    assert!(!DumpFilter::dst(ip("10.96.0.11"), IPPROTO_UDP).matches(&e));
    assert!(DeleteFilter::to_ip(ip("10.96.0.10"), IPPROTO_UDP).matches(&e));
    assert!(DeleteFilter::to_socket(ip("10.96.0.10"), 53, IPPROTO_UDP).matches(&e));
    assert!(!DeleteFilter::to_socket(ip("10.96.0.10"), 54, IPPROTO_UDP).matches(&e));
}

/// kube-proxy counts deleted entries per family: each family's count only grows, and a cleanup that looked
/// at nothing counts nothing (nor a run of the reconciler).
#[test]
fn deleted_entries_are_counted_per_family() {
    let m = super::Metrics::default();
    let report = super::CleanupReport {
        dumps: 1,
        deleted: 5,
        deleted_v6: 2,
        ..Default::default()
    };
    m.record(&report);
    m.record(&super::CleanupReport::default());
    let s = m.snapshot();
    assert_eq!(
        (
            s.entries_deleted,
            s.entries_deleted_v4,
            s.entries_deleted_v6,
            s.cleanups
        ),
        (5, 3, 2, 1)
    );
}
