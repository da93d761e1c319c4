//! The nf_tables codec against the running kernel: tables holding every expression kind and every set key
//! kind are committed in a fresh network namespace, dumped back, and must compare equal to what was sent
//! (the sync engine relies on that: a restarted agent adopts an unchanged table with zero changes).
//! `nft list ruleset` serves as an independent oracle that the kernel holds what we think it holds.
//!
//! Root only: these tests fail (never skip) when not run as root.

use nftkube::nft::build::{concat_key, ip_bytes, load_concat, Field, RuleBuilder};
use nftkube::nft::ir::*;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::text;
use nftkube::nft::tx::{Op, Transaction};
use nftkube_sandbox::netns::{self, NetNs};
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::process::Command;

const TABLE: &str = "nftkube-codec";

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        panic!(
            "codec_kernel tests must run as root: they create network namespaces and program nf_tables \
             (run `cargo test -p kernel-tests --test codec_kernel` as root)"
        );
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn ip4(s: &str) -> Vec<u8> {
    ip_bytes(&ip(s))
}

fn port(p: u16) -> Vec<u8> {
    p.to_be_bytes().to_vec()
}

fn set(name: &str, key: Vec<DataType>, data: Vec<DataType>) -> Set {
    Set::new(name, key, data)
}

/// A numgen slot, as the typeof declarations of sets keyed by one say it.
fn slot() -> TypeofExpr {
    TypeofExpr::NumgenRandom {
        modulus: 3,
        offset: 0,
    }
}

fn key(k: Vec<u8>) -> Element {
    Element {
        key: k.into(),
        value: None,
    }
}

fn verdict_el(k: Vec<u8>, v: Verdict) -> Element {
    Element {
        key: k.into(),
        value: Some(ElementValue::Verdict(v)),
    }
}

fn data_el(k: Vec<u8>, d: Vec<u8>) -> Element {
    Element {
        key: k.into(),
        value: Some(ElementValue::Data(d.into())),
    }
}

fn rules(t: &mut TableState, chain: Chain, rules: Vec<Rule>) {
    t.add_chain(chain).rules = rules;
}

fn elements(t: &mut TableState, set: &str, els: Vec<Element>) {
    t.set_mut(set).elements.extend(els);
}

/// An interface name as nft compares it: NUL-padded to IFNAMSIZ (16 bytes).
fn ifname(name: &str) -> Vec<u8> {
    let mut b = name.as_bytes().to_vec();
    b.resize(16, 0);
    b
}

fn cmp(sreg: u32, op: CmpOp, data: Vec<u8>) -> Expr {
    Expr::Cmp { sreg, op, data }
}

fn nat(
    kind: NatKind,
    family: Family,
    addr: Option<u32>,
    proto: Option<u32>,
    extra: NatFlags,
) -> Expr {
    let mut flags = extra;
    if addr.is_some() {
        flags |= NatFlags::MAP_IPS;
    }
    if proto.is_some() {
        flags |= NatFlags::PROTO_SPECIFIED;
    }
    Expr::Nat {
        kind,
        family,
        reg_addr: addr,
        reg_proto: proto,
        flags,
    }
}

const MARK: u32 = 0x4000;

/// `dnat <family> addr . port to <fields> . numgen random mod n map @map`: the endpoint slot (a host-endian
/// numgen value) is appended to the key in the next free register, and the map's `addr . port` value feeds
/// the nat expression (the one-rule load-balancing shape).
///
/// The slot component of such a map's key is typed `mark` (4 bytes, host order), not `integer`: nft 1.0.6
/// aborts `nft list ruleset` (mergesort.c: concat_expr_msort_value: Assertion `ilen > 0') on a map whose
/// concatenated key has an `integer` component and two or more elements, since `integer` has no size of
/// its own without typeof userdata.
fn dnat_slot_map(fields: &[Field], n: u32, map: &str, family: Family) -> Vec<Expr> {
    let mut exprs = load_concat(fields);
    let slot: u32 = fields
        .iter()
        .map(|f| f.data_type().len().div_ceil(4) as u32)
        .sum();
    exprs.push(Expr::Numgen {
        dreg: reg_at_slot(slot),
        modulus: n,
        random: true,
        offset: 0,
    });
    exprs.push(Expr::Lookup {
        set: map.into(),
        sreg: REG_1,
        dreg: Some(REG_1),
        invert: false,
    });
    let addr_slots = if family == Family::Ip6 { 4 } else { 1 };
    exprs.push(nat(
        NatKind::Dnat,
        family,
        Some(REG_1),
        Some(reg_at_slot(addr_slots)),
        NatFlags::EMPTY,
    ));
    exprs
}

/// A comment longer than what the kernel keeps (127 bytes), with a two-byte character across byte 127:
/// RuleBuilder cuts it the way the encoder does, so the rule still reads back equal.
fn long_comment() -> String {
    format!("{}/{}:{}", "n".repeat(63), "s".repeat(61), "é".repeat(15))
}

/// The `ip` table: every expression kind, every set key kind, in chains whose hooks allow them.
fn ip_table() -> TableState {
    use DataType::{InetProto, InetService, Ipv4Addr, Mark};
    let mut t = TableState::new(Family::Ip, TABLE);
    t.add_set(set(
        "service-ips",
        vec![Ipv4Addr, InetProto, InetService],
        vec![DataType::Verdict],
    ));
    t.add_set(set("cluster-ips", vec![Ipv4Addr], vec![]));
    t.add_set(set("hairpin", vec![Ipv4Addr, Ipv4Addr], vec![]));
    t.add_set(set("protos", vec![InetProto], vec![]));
    t.add_set(set("ports", vec![InetService], vec![]));
    t.add_set(set("marks", vec![Mark], vec![]));
    // Integer keys have no nft type name: declared typeof, as nft itself writes them (else no listing reloads).
    t.add_set(Set::typed("slots-seen", vec![slot()], vec![]));
    t.add_set(set(
        "eps",
        vec![Ipv4Addr, InetService],
        vec![Ipv4Addr, InetService],
    ));
    t.add_set(Set::typed("slots", vec![slot()], vec![TypeofExpr::IpDaddr]));
    t.add_set(set("mark-map", vec![Ipv4Addr], vec![Mark]));
    t.add_set(Set::typed(
        "eps-slots",
        vec![TypeofExpr::IpDaddr, TypeofExpr::ThDport, slot()],
        vec![TypeofExpr::IpDaddr, TypeofExpr::ThDport],
    ));
    t.add_set(set("proto-vmap", vec![InetProto], vec![DataType::Verdict]));
    t.add_set(Set {
        timeout_ms: Some(3 * 3600 * 1000),
        dynamic: true,
        size: Some(4096),
        ..set("aff", vec![Ipv4Addr], vec![])
    });
    t.add_set(Set {
        timeout_ms: Some(60_000),
        dynamic: true,
        // Without one, kernels give dynamic sets 65535 (and dump it).
        size: Some(65535),
        ..set("aff-map", vec![Ipv4Addr], vec![Ipv4Addr])
    });
    t.add_set(Set {
        dynamic: true,
        size: Some(1000),
        ..set("seen", vec![Ipv4Addr, InetService], vec![])
    });

    elements(
        &mut t,
        "service-ips",
        vec![
            verdict_el(
                concat_key(&[ip4("10.96.0.10"), vec![6], port(80)]),
                Verdict::Goto("svc-a".into()),
            ),
            verdict_el(
                concat_key(&[ip4("10.96.0.11"), vec![17], port(53)]),
                Verdict::Jump("svc-b".into()),
            ),
            verdict_el(
                concat_key(&[ip4("10.96.0.12"), vec![6], port(443)]),
                Verdict::Drop,
            ),
            verdict_el(
                concat_key(&[ip4("10.96.0.13"), vec![132], port(9)]),
                Verdict::Accept,
            ),
            verdict_el(
                concat_key(&[ip4("10.96.0.14"), vec![6], port(1)]),
                Verdict::Return,
            ),
            verdict_el(
                concat_key(&[ip4("10.96.0.15"), vec![6], port(2)]),
                Verdict::Continue,
            ),
        ],
    );
    elements(
        &mut t,
        "cluster-ips",
        vec![key(ip4("10.96.0.10")), key(ip4("10.96.0.11"))],
    );
    elements(
        &mut t,
        "hairpin",
        vec![key(concat_key(&[ip4("10.244.1.2"), ip4("10.244.1.2")]))],
    );
    elements(&mut t, "protos", vec![key(vec![6]), key(vec![17])]);
    elements(&mut t, "ports", vec![key(port(80)), key(port(443))]);
    elements(&mut t, "marks", vec![key(MARK.to_ne_bytes().to_vec())]);
    // Slot values that read the same in either byte order: nft 1.1.7 loads `typeof numgen ... { 1 }` as
    // 16777216 (its own bug with a lone numgen key; nftkube's slots are always inside a concatenation).
    elements(
        &mut t,
        "slots-seen",
        [0u32, 0x0100_0001]
            .iter()
            .map(|i| key(i.to_ne_bytes().to_vec()))
            .collect(),
    );
    elements(
        &mut t,
        "eps",
        vec![data_el(
            concat_key(&[ip4("10.96.0.20"), port(80)]),
            concat_key(&[ip4("10.244.1.3"), port(8080)]),
        )],
    );
    elements(
        &mut t,
        "eps-slots",
        (0..3u32)
            .map(|i| {
                data_el(
                    concat_key(&[ip4("10.96.0.30"), port(80), i.to_ne_bytes().to_vec()]),
                    concat_key(&[ip4(&format!("10.244.2.{i}")), port(8080)]),
                )
            })
            .collect(),
    );
    elements(
        &mut t,
        "slots",
        vec![
            data_el(0u32.to_ne_bytes().to_vec(), ip4("10.244.1.2")),
            data_el(0x0100_0001u32.to_ne_bytes().to_vec(), ip4("10.244.1.3")),
        ],
    );
    elements(
        &mut t,
        "mark-map",
        vec![data_el(ip4("10.244.0.1"), 0x10u32.to_ne_bytes().to_vec())],
    );
    elements(
        &mut t,
        "proto-vmap",
        vec![
            verdict_el(vec![6], Verdict::Accept),
            verdict_el(vec![47], Verdict::Drop),
        ],
    );
    elements(&mut t, "aff", vec![key(ip4("192.0.2.1"))]);
    elements(
        &mut t,
        "aff-map",
        vec![data_el(ip4("192.0.2.2"), ip4("10.244.1.2"))],
    );
    elements(
        &mut t,
        "seen",
        vec![key(concat_key(&[ip4("192.0.2.3"), port(22)]))],
    );

    let tcp = || RuleBuilder::new().cmp(Field::L4Proto, CmpOp::Eq, vec![6]);
    rules(
        &mut t,
        Chain::base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100),
        vec![
            RuleBuilder::new()
                .vmap(
                    &[Field::IpDaddr, Field::L4Proto, Field::ThDport],
                    "service-ips",
                )
                .build(),
            // dnat ip addr . port to ip daddr . th dport map @eps: a data map feeding nat registers.
            tcp()
                .expr(Field::IpDaddr.load(REG_1))
                .expr(Field::ThDport.load(reg32(1)))
                .expr(Expr::Lookup {
                    set: "eps".into(),
                    sreg: REG_1,
                    dreg: Some(REG_1),
                    invert: false,
                })
                .expr(nat(
                    NatKind::Dnat,
                    Family::Ip,
                    Some(REG_1),
                    Some(reg32(1)),
                    NatFlags::EMPTY,
                ))
                .comment("data map")
                .build(),
            dnat_slot_map(
                &[Field::IpDaddr, Field::ThDport],
                3,
                "eps-slots",
                Family::Ip,
            )
            .into_iter()
            .fold(tcp(), |b, e| b.expr(e))
            .comment(long_comment())
            .build(),
            // dnat to numgen random mod 2 map @slots
            RuleBuilder::new()
                .expr(Expr::Numgen {
                    dreg: REG_1,
                    modulus: 2,
                    random: true,
                    offset: 0,
                })
                .expr(Expr::Lookup {
                    set: "slots".into(),
                    sreg: REG_1,
                    dreg: Some(REG_1),
                    invert: false,
                })
                .expr(nat(
                    NatKind::Dnat,
                    Family::Ip,
                    Some(REG_1),
                    None,
                    NatFlags::EMPTY,
                ))
                .build(),
            RuleBuilder::new()
                .expr(Expr::Fib {
                    flags: FibFlags::DADDR,
                    result: FibResult::ADDRTYPE,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Eq, RTN_LOCAL.to_ne_bytes().to_vec()))
                .expr(Expr::Counter)
                .build(),
            RuleBuilder::new()
                .expr(Expr::Fib {
                    flags: FibFlags::SADDR | FibFlags::IIF,
                    result: FibResult::OIF,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Eq, vec![0; 4]))
                .expr(Expr::Counter)
                .build(),
            RuleBuilder::new()
                .expr(Field::IpSaddr.load(REG_1))
                .expr(Expr::Dynset {
                    set: "aff".into(),
                    op: DynsetOp::Update,
                    sreg_key: REG_1,
                    sreg_data: None,
                    timeout_ms: Some(10_000),
                })
                .build(),
            RuleBuilder::new()
                .expr(Field::IpSaddr.load(REG_1))
                .expr(Field::IpDaddr.load(REG_2))
                .expr(Expr::Dynset {
                    set: "aff-map".into(),
                    op: DynsetOp::Add,
                    sreg_key: REG_1,
                    sreg_data: Some(REG_2),
                    timeout_ms: None,
                })
                .build(),
            RuleBuilder::new()
                .expr(Expr::Meta {
                    key: MetaKey::IifName,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Eq, ifname("lo")))
                .expr(Expr::Meta {
                    key: MetaKey::Iif,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Eq, 1u32.to_ne_bytes().to_vec()))
                // (meta nfproto only in the inet table: nft refuses it in an ip table's listing.)
                .expr(Expr::Counter)
                .build(),
            RuleBuilder::new()
                .expr(Expr::Ct {
                    key: CtKey::Mark,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Gte, 0x100u32.to_ne_bytes().to_vec()))
                .verdict(Verdict::Continue)
                .build(),
            // An anonymous set (created with the rule) and ct keys of the original direction.
            RuleBuilder::new()
                .transport_protocol()
                .expr(Expr::CtOriginal {
                    key: CtKey::DstIp,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Eq, vec![10, 96, 0, 10]))
                .verdict(Verdict::Continue)
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::regular("svc-a"),
        vec![
            tcp()
                .numgen_eq(2, 0)
                .dnat(&ip("10.244.1.2"), 8080)
                .comment("default/web:http")
                .build(),
            tcp()
                .expr(Expr::Numgen {
                    dreg: REG_1,
                    modulus: 2,
                    random: false,
                    offset: 5,
                })
                .expr(cmp(REG_1, CmpOp::Eq, 5u32.to_ne_bytes().to_vec()))
                .dnat(&ip("10.244.1.3"), 8080)
                .build(),
            RuleBuilder::new()
                .expr(Expr::Immediate {
                    dreg: REG_1,
                    data: ip4("10.244.1.4"),
                })
                .expr(nat(
                    NatKind::Dnat,
                    Family::Ip,
                    Some(REG_1),
                    None,
                    NatFlags::EMPTY,
                ))
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::regular("svc-b"),
        vec![
            RuleBuilder::new()
                .cmp(Field::L4Proto, CmpOp::Eq, vec![17])
                .dnat(&ip("10.244.1.5"), 53)
                .build(),
            RuleBuilder::new().verdict(Verdict::Return).build(),
        ],
    );
    // Userspace mode's redirect: `meta l4proto { tcp, udp } redirect to :daddr . l4proto . dport map @m`.
    t.add_set(set(
        "relay-ports",
        vec![
            DataType::Ipv4Addr,
            DataType::InetProto,
            DataType::InetService,
        ],
        vec![DataType::InetService],
    ));
    elements(
        &mut t,
        "relay-ports",
        vec![data_el(
            concat_key(&[ip4("10.96.0.12"), vec![17], port(53)]),
            port(40053),
        )],
    );
    rules(
        &mut t,
        Chain::base("nat-output", ChainType::Nat, Hook::Output, -100),
        vec![
            RuleBuilder::new()
                .in_set(&[Field::IpDaddr], "cluster-ips", false)
                .verdict(Verdict::Goto("svc-b".into()))
                .build(),
            RuleBuilder::new()
                .redirect_map(
                    &[Field::IpDaddr, Field::L4Proto, Field::ThDport],
                    "relay-ports",
                )
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100),
        vec![
            RuleBuilder::new()
                .ct_has(CtKey::Status, CT_STATUS_DNAT)
                .in_set(&[Field::IpSaddr, Field::IpDaddr], "hairpin", false)
                .mark_or(MARK)
                .comment("hairpin")
                .build(),
            RuleBuilder::new()
                .mark_has(MARK, false)
                .verdict(Verdict::Return)
                .build(),
            RuleBuilder::new().mark_xor(MARK).build(),
            RuleBuilder::new().masquerade(true).build(),
            RuleBuilder::new().masquerade(false).build(),
            // meta mark set ip saddr map @mark-map
            RuleBuilder::new()
                .expr(Field::IpSaddr.load(REG_1))
                .expr(Expr::Lookup {
                    set: "mark-map".into(),
                    sreg: REG_1,
                    dreg: Some(REG_1),
                    invert: false,
                })
                .expr(Expr::MetaSet {
                    key: MetaKey::Mark,
                    sreg: REG_1,
                })
                .build(),
            RuleBuilder::new()
                .expr(Expr::Meta {
                    key: MetaKey::OifName,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Neq, ifname("lo")))
                .expr(Expr::Meta {
                    key: MetaKey::Oif,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Neq, 1u32.to_ne_bytes().to_vec()))
                .expr(Expr::Immediate {
                    dreg: REG_1,
                    data: ip4("192.0.2.100"),
                })
                .expr(nat(
                    NatKind::Snat,
                    Family::Ip,
                    Some(REG_1),
                    None,
                    NatFlags::PERSISTENT,
                ))
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::base("filter-forward", ChainType::Filter, Hook::Forward, -10),
        vec![
            RuleBuilder::new()
                .ct_has(CtKey::State, CT_STATE_INVALID)
                .verdict(Verdict::Drop)
                .build(),
            RuleBuilder::new()
                .ct_has(CtKey::State, CT_STATE_ESTABLISHED | CT_STATE_RELATED)
                .verdict(Verdict::Accept)
                .build(),
            RuleBuilder::new()
                .prefix(Field::IpSaddr, &ip("10.244.0.0"), 16, true)
                .in_set(&[Field::IpSaddr, Field::IpDaddr], "hairpin", true)
                .expr(Expr::Counter)
                .build(),
            RuleBuilder::new()
                .in_set(&[Field::ThDport], "ports", false)
                .in_set(&[Field::L4Proto], "protos", false)
                .in_set(&[Field::Mark], "marks", false)
                .expr(Expr::Counter)
                .build(),
            RuleBuilder::new()
                .expr(Expr::Numgen {
                    dreg: REG_1,
                    modulus: 3,
                    random: false,
                    offset: 0,
                })
                .expr(Expr::Lookup {
                    set: "slots-seen".into(),
                    sreg: REG_1,
                    dreg: None,
                    invert: false,
                })
                .expr(Expr::Counter)
                .build(),
            RuleBuilder::new()
                .expr(Field::L4Proto.load(REG_1))
                .expr(Expr::Lookup {
                    set: "proto-vmap".into(),
                    sreg: REG_1,
                    dreg: Some(REG_VERDICT),
                    invert: false,
                })
                .build(),
            RuleBuilder::new()
                .expr(load_concat(&[Field::IpSaddr, Field::ThDport])[0].clone())
                .expr(load_concat(&[Field::IpSaddr, Field::ThDport])[1].clone())
                .expr(Expr::Dynset {
                    set: "seen".into(),
                    op: DynsetOp::Add,
                    sreg_key: REG_1,
                    sreg_data: None,
                    timeout_ms: None,
                })
                .build(),
            RuleBuilder::new()
                .in_set(&[Field::IpDaddr], "cluster-ips", false)
                .verdict(Verdict::Jump("reject-chain".into()))
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::regular("reject-chain"),
        vec![
            tcp().reject(RejectKind::TcpReset).build(),
            RuleBuilder::new()
                .cmp(Field::L4Proto, CmpOp::Eq, vec![17])
                .reject(RejectKind::IcmpUnreach(ICMP_PORT_UNREACH))
                .build(),
            RuleBuilder::new()
                .reject(RejectKind::IcmpUnreach(1))
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::base("filter-output", ChainType::Filter, Hook::Output, -10),
        vec![RuleBuilder::new()
            .in_set(&[Field::IpDaddr], "cluster-ips", false)
            .verdict(Verdict::Goto("reject-chain".into()))
            .comment("no endpoints, or not a service port")
            .build()],
    );
    t
}

/// The `ip6` table: 16-byte addresses in concatenations (NFT_REG_2 after an address), v6 NAT, ICMPv6.
fn ip6_table() -> TableState {
    use DataType::{InetProto, InetService, Ipv6Addr};
    let v6 = |s: &str| ip_bytes(&ip(s));
    let mut t = TableState::new(Family::Ip6, TABLE);
    t.add_set(set(
        "service-ips",
        vec![Ipv6Addr, InetProto, InetService],
        vec![DataType::Verdict],
    ));
    t.add_set(set("cluster-ips", vec![Ipv6Addr], vec![]));
    t.add_set(Set::typed(
        "eps-slots",
        vec![TypeofExpr::Ip6Daddr, TypeofExpr::ThDport, slot()],
        vec![TypeofExpr::Ip6Daddr, TypeofExpr::ThDport],
    ));
    elements(
        &mut t,
        "eps-slots",
        (0..2u32)
            .map(|i| {
                data_el(
                    concat_key(&[v6("fd00:96::30"), port(80), i.to_ne_bytes().to_vec()]),
                    concat_key(&[v6(&format!("fd00:244::2:{i}")), port(8080)]),
                )
            })
            .collect(),
    );
    t.add_set(set("hairpin", vec![Ipv6Addr, Ipv6Addr], vec![]));
    t.add_set(set(
        "eps",
        vec![Ipv6Addr, InetService],
        vec![Ipv6Addr, InetService],
    ));
    t.add_set(Set {
        timeout_ms: Some(10_800_000),
        dynamic: true,
        size: Some(65535),
        ..set("aff", vec![Ipv6Addr], vec![])
    });
    elements(
        &mut t,
        "service-ips",
        vec![verdict_el(
            concat_key(&[v6("fd00:96::10"), vec![6], port(80)]),
            Verdict::Goto("svc".into()),
        )],
    );
    elements(&mut t, "cluster-ips", vec![key(v6("fd00:96::10"))]);
    elements(
        &mut t,
        "hairpin",
        vec![key(concat_key(&[v6("fd00:244::2"), v6("fd00:244::2")]))],
    );
    elements(
        &mut t,
        "eps",
        vec![data_el(
            concat_key(&[v6("fd00:96::20"), port(80)]),
            concat_key(&[v6("fd00:244::3"), port(8080)]),
        )],
    );
    let tcp = || RuleBuilder::new().cmp(Field::L4Proto, CmpOp::Eq, vec![6]);
    rules(
        &mut t,
        Chain::base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100),
        vec![
            RuleBuilder::new()
                .vmap(
                    &[Field::Ip6Daddr, Field::L4Proto, Field::ThDport],
                    "service-ips",
                )
                .build(),
            dnat_slot_map(
                &[Field::Ip6Daddr, Field::ThDport],
                2,
                "eps-slots",
                Family::Ip6,
            )
            .into_iter()
            .fold(tcp(), |b, e| b.expr(e))
            .build(),
            tcp()
                .expr(Field::Ip6Daddr.load(REG_1))
                .expr(Field::ThDport.load(REG_2))
                .expr(Expr::Lookup {
                    set: "eps".into(),
                    sreg: REG_1,
                    dreg: Some(REG_1),
                    invert: false,
                })
                .expr(nat(
                    NatKind::Dnat,
                    Family::Ip6,
                    Some(REG_1),
                    Some(REG_2),
                    NatFlags::EMPTY,
                ))
                .build(),
            RuleBuilder::new()
                .expr(Field::Ip6Saddr.load(REG_1))
                .expr(Expr::Dynset {
                    set: "aff".into(),
                    op: DynsetOp::Update,
                    sreg_key: REG_1,
                    sreg_data: None,
                    timeout_ms: Some(10_000),
                })
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::regular("svc"),
        vec![
            tcp().numgen_eq(2, 0).dnat(&ip("fd00:244::2"), 8080).build(),
            tcp().dnat(&ip("fd00:244::3"), 8080).build(),
        ],
    );
    rules(
        &mut t,
        Chain::base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100),
        vec![
            RuleBuilder::new()
                .ct_has(CtKey::Status, CT_STATUS_DNAT)
                .in_set(&[Field::Ip6Saddr, Field::Ip6Daddr], "hairpin", false)
                .mark_or(MARK)
                .build(),
            RuleBuilder::new()
                .mark_has(MARK, false)
                .verdict(Verdict::Return)
                .build(),
            RuleBuilder::new().mark_xor(MARK).build(),
            RuleBuilder::new().masquerade(true).build(),
        ],
    );
    rules(
        &mut t,
        Chain::base("filter-forward", ChainType::Filter, Hook::Forward, -10),
        vec![
            RuleBuilder::new()
                .prefix(Field::Ip6Saddr, &ip("fd00:244::"), 56, true)
                .in_set(&[Field::Ip6Daddr], "cluster-ips", false)
                .verdict(Verdict::Goto("reject-chain".into()))
                .build(),
            RuleBuilder::new()
                .expr(Expr::Fib {
                    flags: FibFlags::DADDR,
                    result: FibResult::ADDRTYPE,
                    dreg: REG_1,
                })
                .expr(cmp(REG_1, CmpOp::Eq, RTN_LOCAL.to_ne_bytes().to_vec()))
                .expr(Expr::Counter)
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::regular("reject-chain"),
        vec![
            tcp().reject(RejectKind::TcpReset).build(),
            RuleBuilder::new()
                .reject(RejectKind::IcmpUnreach(ICMPV6_PORT_UNREACH))
                .build(),
        ],
    );
    t
}

/// The `inet` table: both NAT families side by side, icmpx rejects.
fn inet_table() -> TableState {
    let mut t = TableState::new(Family::Inet, TABLE);
    t.add_set(set("v4", vec![DataType::Ipv4Addr], vec![]));
    elements(&mut t, "v4", vec![key(ip4("10.96.0.1"))]);
    let nfproto = |p: u8| {
        RuleBuilder::new()
            .expr(Expr::Meta {
                key: MetaKey::NfProto,
                dreg: REG_1,
            })
            .expr(cmp(REG_1, CmpOp::Eq, vec![p]))
    };
    rules(
        &mut t,
        Chain::base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100),
        vec![
            nfproto(2)
                .in_set(&[Field::IpDaddr], "v4", false)
                .cmp(Field::L4Proto, CmpOp::Eq, vec![6])
                .dnat(&ip("10.244.1.2"), 80)
                .build(),
            nfproto(10)
                .cmp(Field::L4Proto, CmpOp::Eq, vec![6])
                .dnat(&ip("fd00:244::2"), 80)
                .build(),
        ],
    );
    rules(
        &mut t,
        Chain::base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100),
        vec![RuleBuilder::new().masquerade(true).build()],
    );
    rules(
        &mut t,
        Chain::base("filter-input", ChainType::Filter, Hook::Input, 0),
        vec![
            RuleBuilder::new()
                .cmp(Field::L4Proto, CmpOp::Eq, vec![6])
                .reject(RejectKind::TcpReset)
                .build(),
            RuleBuilder::new()
                .cmp(Field::L4Proto, CmpOp::Eq, vec![17])
                .reject(RejectKind::IcmpxUnreach(1))
                .build(),
            RuleBuilder::new()
                .reject(RejectKind::IcmpxUnreach(3))
                .build(),
        ],
    );
    t
}

/// Creating a table from nothing, in the order the kernel needs: chains and sets before the elements
/// and rules that name them.
fn create_tx(tx: &mut Transaction, t: &TableState) {
    let (f, n) = (t.family, t.name.as_str());
    tx.push(f, n, Op::AddTable);
    for c in t.chains.values() {
        tx.push(f, n, Op::AddChain(c.chain.clone()));
    }
    for s in t.sets.values() {
        tx.push(f, n, Op::AddSet(s.set.clone()));
    }
    for s in t.sets.values() {
        if !s.elements.is_empty() {
            tx.push(
                f,
                n,
                Op::AddElements {
                    set: s.set.name.clone(),
                    elements: s.elements.iter().cloned().collect(),
                },
            );
        }
    }
    for c in t.chains.values() {
        for r in &c.rules {
            tx.push(
                f,
                n,
                Op::AddRule {
                    chain: c.chain.name.clone(),
                    rule: r.clone(),
                },
            );
        }
    }
}

/// Exhaustive on purpose: a new Expr variant does not compile here until the tables above use it.
fn variant(e: &Expr) -> &'static str {
    match e {
        Expr::Payload { .. } => "payload",
        Expr::Meta { .. } => "meta load",
        Expr::MetaSet { .. } => "meta set",
        Expr::Cmp { .. } => "cmp",
        Expr::Bitwise { .. } => "bitwise",
        Expr::Immediate { .. } => "immediate",
        Expr::Verdict(_) => "verdict",
        Expr::Lookup { dreg: None, .. } => "lookup set",
        Expr::Lookup {
            dreg: Some(REG_VERDICT),
            ..
        } => "lookup vmap",
        Expr::Lookup { dreg: Some(_), .. } => "lookup data map",
        Expr::Numgen { .. } => "numgen",
        Expr::Dynset {
            timeout_ms: Some(_),
            ..
        } => "dynset with timeout",
        Expr::Dynset { .. } => "dynset",
        Expr::Nat {
            family: Family::Ip6,
            ..
        } => "nat v6",
        Expr::Nat { .. } => "nat v4",
        Expr::Masq { .. } => "masq",
        Expr::Redir { .. } => "redir",
        Expr::Reject(RejectKind::TcpReset) => "reject tcp reset",
        Expr::Reject(RejectKind::IcmpUnreach(_)) => "reject icmp",
        Expr::Reject(RejectKind::IcmpxUnreach(_)) => "reject icmpx",
        Expr::Ct { .. } => "ct",
        Expr::CtOriginal { .. } => "ct original",
        Expr::LookupAnon { .. } => "lookup anonymous set",
        Expr::Fib { .. } => "fib",
        Expr::Counter => "counter",
    }
}

const ALL_VARIANTS: &[&str] = &[
    "payload",
    "meta load",
    "meta set",
    "cmp",
    "bitwise",
    "immediate",
    "verdict",
    "lookup set",
    "lookup vmap",
    "lookup data map",
    "numgen",
    "dynset with timeout",
    "dynset",
    "nat v6",
    "nat v4",
    "masq",
    "redir",
    "reject tcp reset",
    "reject icmp",
    "reject icmpx",
    "ct",
    "ct original",
    "lookup anonymous set",
    "fib",
    "counter",
];

fn key_kind(t: &DataType) -> &'static str {
    match t {
        DataType::Ipv4Addr => "ipv4_addr",
        DataType::Ipv6Addr => "ipv6_addr",
        DataType::InetProto => "inet_proto",
        DataType::InetService => "inet_service",
        DataType::Mark => "mark",
        DataType::Integer(_) => "integer",
        DataType::Verdict => "verdict",
    }
}

fn all_tables() -> Vec<TableState> {
    vec![ip_table(), ip6_table(), inet_table()]
}

#[test]
fn the_test_tables_cover_every_expression_and_key_kind() {
    let tables = all_tables();
    let used: BTreeSet<&str> = tables
        .iter()
        .flat_map(|t| t.chains.values())
        .flat_map(|c| &c.rules)
        .flat_map(|r| &r.exprs)
        .map(variant)
        .collect();
    let all: BTreeSet<&str> = ALL_VARIANTS.iter().copied().collect();
    assert_eq!(used, all);
    let keys: BTreeSet<&str> = tables
        .iter()
        .flat_map(|t| t.sets.values())
        .flat_map(|s| &s.set.key)
        .map(key_kind)
        .collect();
    for k in [
        "ipv4_addr",
        "ipv6_addr",
        "inet_proto",
        "inet_service",
        "mark",
        "integer",
    ] {
        assert!(keys.contains(k), "no set keyed by {k}: {keys:?}");
    }
}

/// Runs `f` with an nf_tables socket inside a fresh namespace; the namespace is removed afterwards (also
/// when `f` panics).
fn in_fresh_netns<T: Send>(tag: &str, f: impl FnOnce(&NetNs, &mut NftSocket) -> T + Send) -> T {
    require_root();
    let ns = NetNs::create(&netns::unique_name(tag)).expect("create network namespace");
    let nsr = &ns;
    let out = ns
        .run(move || {
            let mut sock = NftSocket::open().expect("open nf_tables socket");
            f(nsr, &mut sock)
        })
        .expect("enter network namespace");
    // Whatever the codec committed must list and reload under every nft, as the agent's states must.
    kernel_tests::assert_listable(&ns);
    ns.delete().expect("delete network namespace");
    out
}

fn nft_list_ruleset(ns: &NetNs) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns.name(), "nft", "list", "ruleset"])
        .output()
        .expect("run ip netns exec ... nft list ruleset");
    assert!(
        out.status.success(),
        "nft list ruleset failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("nft output is UTF-8")
}

#[track_caller]
fn assert_same_table(got: &TableState, want: &TableState) {
    if got == want {
        return;
    }
    // Point at the first difference rather than printing two whole tables.
    for (name, w) in &want.sets {
        match got.sets.get(name) {
            None => panic!("set {name} missing from the dump"),
            Some(g) => {
                assert_eq!(g.set, w.set, "set {name}");
                assert_eq!(g.elements, w.elements, "elements of set {name}");
            }
        }
    }
    for (name, w) in &want.chains {
        match got.chains.get(name) {
            None => panic!("chain {name} missing from the dump"),
            Some(g) => {
                assert_eq!(g.chain, w.chain, "chain {name}");
                for (i, (gr, wr)) in g.rules.iter().zip(&w.rules).enumerate() {
                    assert_eq!(
                        gr,
                        wr,
                        "rule {i} of chain {name}: {}",
                        text::render_rule(wr, want)
                    );
                }
                assert_eq!(g.rules.len(), w.rules.len(), "rules in chain {name}");
            }
        }
    }
    assert_eq!(got, want);
}

#[test]
fn every_expression_and_set_kind_reads_back_equal() {
    let tables = all_tables();
    let mut tx = Transaction::default();
    for t in &tables {
        create_tx(&mut tx, t);
    }
    let listing = in_fresh_netns("codec", |ns, sock| {
        sock.commit(&tx)
            .unwrap_or_else(|e| panic!("commit refused: {e}"));
        for want in &tables {
            let got = sock
                .dump_table(want.family, &want.name)
                .expect("dump table")
                .unwrap_or_else(|| panic!("table {} {} missing", want.family.as_str(), want.name));
            assert_same_table(&got, want);
        }
        // A table that does not exist reads back as None, not as an empty table.
        assert!(sock
            .dump_table(Family::Ip, "no-such-table")
            .expect("dump")
            .is_none());
        nft_list_ruleset(ns)
    });

    // The oracle: nft parses what the kernel holds and shows the shapes we meant.
    for fragment in [
        "table ip nftkube-codec",
        "table ip6 nftkube-codec",
        "table inet nftkube-codec",
        "type ipv4_addr . inet_proto . inet_service : verdict",
        "type ipv6_addr . inet_proto . inet_service : verdict",
        "ip daddr . meta l4proto . th dport vmap @service-ips",
        "ip6 daddr . meta l4proto . th dport vmap @service-ips",
        "10.96.0.10 . tcp . 80 : goto svc-a",
        "numgen random mod 2 0 dnat to 10.244.1.2:8080",
        // nft 1.0.6 spells `dnat ip addr . port to ...` this way (and folds the l4proto match in).
        "dnat ip to ip daddr . tcp dport map @eps",
        "dnat ip6 to ip6 daddr . tcp dport map @eps",
        "meta mark set ip saddr map @mark-map",
        "add @seen { ip saddr . th dport }",
        "10.96.0.11 . udp . 53 : jump svc-b",
        "tcp : accept, gre : drop",
        "dnat to numgen random mod 2 map @slots",
        "masquerade fully-random",
        "meta mark set meta mark | 0x00004000",
        "ct status dnat",
        "fib daddr type local",
        "update @aff { ip saddr timeout 10s }",
        "update @aff { ip6 saddr timeout 10s }",
        "add @aff-map { ip saddr : ip daddr }",
        "reject with tcp reset",
        "reject with icmpx",
        "ip saddr != 10.244.0.0/16",
        "ip6 saddr != fd00:244::/56",
        "ct state established,related accept",
        "numgen random mod 2 0 dnat to [fd00:244::2]:8080",
        "meta nfproto ipv6 meta l4proto tcp dnat ip6 to [fd00:244::2]:80",
        "ip daddr @v4 meta l4proto tcp dnat ip to 10.244.1.2:80",
        "comment \"default/web:http\"",
    ] {
        assert!(
            listing.contains(fragment),
            "`nft list ruleset` lacks `{fragment}`:\n{listing}"
        );
    }
}

/// Why the rendering of a rule is known to differ from nft 1.0.6's listing (both spellings load), or None.
fn known_text_difference(family: Family, r: &Rule) -> Option<&'static str> {
    let has = |p: &dyn Fn(&Expr) -> bool| r.exprs.iter().any(p);
    if has(&|e| matches!(e, Expr::Lookup { dreg: Some(d), .. } if *d != REG_VERDICT))
        && has(&|e| matches!(e, Expr::Nat { .. }))
    {
        return Some(
            "nat through a data map: nft 1.0.6 lists `dnat ip to ip daddr . tcp dport map @m` and \
             folds the l4proto match into `tcp dport`",
        );
    }
    if has(&|e| {
        matches!(
            e,
            Expr::Meta {
                key: MetaKey::IifName
                    | MetaKey::OifName
                    | MetaKey::Iif
                    | MetaKey::Oif
                    | MetaKey::NfProto,
                ..
            }
        )
    }) {
        return Some("interface names render as hex, interface indexes and nfproto as numbers");
    }
    if has(&|e| {
        matches!(
            e,
            Expr::Reject(RejectKind::IcmpUnreach(c)) if *c != ICMP_PORT_UNREACH && *c != ICMPV6_PORT_UNREACH
        ) || matches!(e, Expr::Reject(RejectKind::IcmpxUnreach(c)) if *c != 1)
    }) {
        return Some("reject codes render as numbers (`reject with icmp type 1`), nft names them");
    }
    if family != Family::Inet && has(&|e| matches!(e, Expr::Reject(RejectKind::TcpReset))) {
        return Some("nft hides the `meta l4proto tcp` that a tcp reset implies in ip/ip6 tables");
    }
    None
}

/// The text renderer against nft: every rule's rendering must appear verbatim as a line of
/// `nft list ruleset` (counters normalised), except the known differences above.
#[test]
fn rendered_text_matches_nft_listing() {
    let tables = all_tables();
    let mut tx = Transaction::default();
    for t in &tables {
        create_tx(&mut tx, t);
    }
    let listing = in_fresh_netns("codec-text", |ns, sock| {
        sock.commit(&tx)
            .unwrap_or_else(|e| panic!("commit refused: {e}"));
        nft_list_ruleset(ns)
    });
    // Tables are listed one after another; split the listing per table so that a rule is looked for
    // in its own table only.
    let mut per_table: Vec<(String, BTreeSet<String>)> = Vec::new();
    for line in listing.lines() {
        if let Some(head) = line.strip_prefix("table ") {
            per_table.push((head.trim_end_matches(" {").to_string(), BTreeSet::new()));
        } else if let Some((_, lines)) = per_table.last_mut() {
            lines.insert(line.trim().replace("counter packets 0 bytes 0", "counter"));
        }
    }
    let mut checked = 0;
    let mut wrong = Vec::new();
    for t in &tables {
        let head = format!("{} {}", t.family.as_str(), t.name);
        let lines = &per_table
            .iter()
            .find(|(h, _)| *h == head)
            .unwrap_or_else(|| panic!("table {head} not listed:\n{listing}"))
            .1;
        for c in t.chains.values() {
            for (i, r) in c.rules.iter().enumerate() {
                if known_text_difference(t.family, r).is_some() {
                    continue;
                }
                checked += 1;
                let text = text::render_rule(r, t);
                if !lines.contains(&text) {
                    wrong.push(format!("{head} chain {} rule {i}: {text}", c.chain.name));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "rendered rules not in `nft list ruleset`: {wrong:#?}\n{listing}"
    );
    assert!(checked > 40, "only {checked} rules compared");
}

/// A small committed table the rejection tests start from.
fn small_table() -> TableState {
    let mut t = TableState::new(Family::Ip, TABLE);
    t.add_set(set("cluster-ips", vec![DataType::Ipv4Addr], vec![]));
    elements(&mut t, "cluster-ips", vec![key(ip4("10.96.0.10"))]);
    rules(
        &mut t,
        Chain::base("filter-output", ChainType::Filter, Hook::Output, -10),
        vec![RuleBuilder::new()
            .in_set(&[Field::IpDaddr], "cluster-ips", false)
            .expr(Expr::Counter)
            .build()],
    );
    t
}

/// Commits `small_table`, then `bad` (which must fail); returns the error text and errno after checking
/// that the table is exactly as before.
fn reject_case(tag: &str, bad: Transaction) -> (String, Option<i32>) {
    let before = small_table();
    in_fresh_netns(tag, |_, sock| {
        let mut tx = Transaction::default();
        create_tx(&mut tx, &before);
        sock.commit(&tx)
            .unwrap_or_else(|e| panic!("commit refused: {e}"));
        assert_same_table(
            &sock.dump_table(Family::Ip, TABLE).unwrap().unwrap(),
            &before,
        );
        let err = sock
            .commit(&bad)
            .expect_err("a batch with a bad object must be refused");
        // Nothing of the batch was applied, not even the valid changes before and after the bad one.
        assert_same_table(
            &sock.dump_table(Family::Ip, TABLE).unwrap().unwrap(),
            &before,
        );
        assert!(sock.dump_table(Family::Ip6, TABLE).unwrap().is_none());
        (err.to_string(), err.errno())
    })
}

fn with_valid_neighbours(bad: Op) -> Transaction {
    let mut tx = Transaction::default();
    tx.push(Family::Ip6, TABLE, Op::AddTable);
    tx.push(Family::Ip, TABLE, Op::AddChain(Chain::regular("new-chain")));
    tx.push(
        Family::Ip,
        TABLE,
        Op::AddElements {
            set: "cluster-ips".into(),
            elements: vec![key(ip4("10.96.0.99"))],
        },
    );
    tx.push(Family::Ip, TABLE, bad);
    tx.push(
        Family::Ip,
        TABLE,
        Op::AddRule {
            chain: "filter-output".into(),
            rule: RuleBuilder::new().expr(Expr::Counter).build(),
        },
    );
    tx.push(
        Family::Ip,
        TABLE,
        Op::AddRule {
            chain: "new-chain".into(),
            rule: RuleBuilder::new().verdict(Verdict::Return).build(),
        },
    );
    tx
}

#[test]
fn a_rule_naming_a_missing_chain_rejects_the_whole_batch() {
    let (msg, errno) = reject_case(
        "codec-badrule",
        with_valid_neighbours(Op::AddRule {
            chain: "no-such-chain".into(),
            rule: RuleBuilder::new().expr(Expr::Counter).build(),
        }),
    );
    assert!(
        msg.contains("add rule to chain no-such-chain of table ip nftkube-codec"),
        "{msg}"
    );
    eprintln!("{msg}");
    assert_eq!(errno, Some(libc::ENOENT), "{msg}");
}

#[test]
fn a_set_with_a_zero_key_length_rejects_the_whole_batch() {
    let (msg, errno) = reject_case(
        "codec-badset",
        with_valid_neighbours(Op::AddSet(set("zero-key", vec![], vec![]))),
    );
    assert!(
        msg.contains("add set zero-key to table ip nftkube-codec"),
        "{msg}"
    );
    eprintln!("{msg}");
    assert_eq!(errno, Some(libc::EINVAL), "{msg}");
}

/// Thousands of elements: the encoder splits them over several NEWSETELEM messages and the kernel answers
/// the dump in several parts; the table still reads back equal.
#[test]
fn large_sets_read_back_equal() {
    let mut t = TableState::new(Family::Ip, TABLE);
    t.add_set(set(
        "service-ips",
        vec![
            DataType::Ipv4Addr,
            DataType::InetProto,
            DataType::InetService,
        ],
        vec![DataType::Verdict],
    ));
    t.add_set(set(
        "eps",
        vec![DataType::Ipv4Addr, DataType::InetService],
        vec![DataType::Ipv4Addr, DataType::InetService],
    ));
    let chains: Vec<String> = (0..20).map(|i| format!("service-{i:02}")).collect();
    for c in &chains {
        rules(
            &mut t,
            Chain::regular(c),
            vec![RuleBuilder::new().verdict(Verdict::Return).build()],
        );
    }
    rules(
        &mut t,
        Chain::base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100),
        vec![RuleBuilder::new()
            .vmap(
                &[Field::IpDaddr, Field::L4Proto, Field::ThDport],
                "service-ips",
            )
            .build()],
    );
    const N: u32 = 5000;
    let addr = |base: u32, i: u32| (base + i).to_be_bytes().to_vec();
    elements(
        &mut t,
        "service-ips",
        (0..N)
            .map(|i| {
                verdict_el(
                    concat_key(&[addr(0x0a60_0000, i), vec![6], port(80)]),
                    Verdict::Goto(chains[i as usize % chains.len()].as_str().into()),
                )
            })
            .collect(),
    );
    elements(
        &mut t,
        "eps",
        (0..N)
            .map(|i| {
                data_el(
                    concat_key(&[addr(0x0a60_0000, i), port(443)]),
                    concat_key(&[addr(0x0af4_0000, i), port(8443)]),
                )
            })
            .collect(),
    );
    let mut tx = Transaction::default();
    create_tx(&mut tx, &t);
    let messages = nftkube::nft::wire::seq_count(&tx) as usize - 2;
    assert!(
        messages > tx.changes.len() + 4,
        "elements split: {messages} messages for {} changes",
        tx.changes.len()
    );
    in_fresh_netns("codec-large", |_, sock| {
        let sent = sock
            .commit(&tx)
            .unwrap_or_else(|e| panic!("commit refused: {e}"));
        assert!(sent > 256 * 1024, "{sent} bytes");
        let got = sock.dump_table(Family::Ip, TABLE).unwrap().unwrap();
        assert_eq!(got.sets["service-ips"].elements.len(), N as usize);
        assert_same_table(&got, &t);
    });
}
