//! A small vocabulary for writing rules: packet fields and the expression sequences that test or act on them.
//! The renderer speaks in these terms; what comes out is plain `Expr` data.

use super::ir::*;
use std::net::IpAddr;

/// A packet field a rule can load into registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `ip saddr`.
    IpSaddr,
    /// `ip daddr`.
    IpDaddr,
    /// `ip6 saddr`.
    Ip6Saddr,
    /// `ip6 daddr`.
    Ip6Daddr,
    /// `meta l4proto`.
    L4Proto,
    /// `th sport`.
    ThSport,
    /// `th dport`.
    ThDport,
    /// `meta mark`.
    Mark,
    /// The connection's original destination (`ct original ip daddr`): the service address, even after DNAT.
    CtOriginalDaddr,
    /// The same for IPv6 (`ct original ip6 daddr`).
    CtOriginalDaddr6,
    /// The connection's original destination port (`ct original proto-dst`): the service port.
    CtOriginalProtoDst,
}

impl Field {
    /// The source address field of `ip`'s family.
    pub fn saddr(ip: &IpAddr) -> Field {
        if ip.is_ipv4() {
            Field::IpSaddr
        } else {
            Field::Ip6Saddr
        }
    }
    /// The destination address field of `ip`'s family.
    pub fn daddr(ip: &IpAddr) -> Field {
        if ip.is_ipv4() {
            Field::IpDaddr
        } else {
            Field::Ip6Daddr
        }
    }

    /// The type of the value it loads.
    pub fn data_type(self) -> DataType {
        match self {
            Field::IpSaddr | Field::IpDaddr => DataType::Ipv4Addr,
            Field::Ip6Saddr | Field::Ip6Daddr => DataType::Ipv6Addr,
            Field::L4Proto => DataType::InetProto,
            Field::ThSport | Field::ThDport => DataType::InetService,
            Field::Mark => DataType::Mark,
            Field::CtOriginalDaddr => DataType::Ipv4Addr,
            Field::CtOriginalDaddr6 => DataType::Ipv6Addr,
            Field::CtOriginalProtoDst => DataType::InetService,
        }
    }

    /// The expression that loads this field into `dreg`.
    pub fn load(self, dreg: u32) -> Expr {
        let payload = |base, offset, len| Expr::Payload {
            base,
            offset,
            len,
            dreg,
        };
        match self {
            Field::IpSaddr => payload(PayloadBase::Network, 12, 4),
            Field::IpDaddr => payload(PayloadBase::Network, 16, 4),
            Field::Ip6Saddr => payload(PayloadBase::Network, 8, 16),
            Field::Ip6Daddr => payload(PayloadBase::Network, 24, 16),
            Field::ThSport => payload(PayloadBase::Transport, 0, 2),
            Field::ThDport => payload(PayloadBase::Transport, 2, 2),
            Field::L4Proto => Expr::Meta {
                key: MetaKey::L4Proto,
                dreg,
            },
            Field::Mark => Expr::Meta {
                key: MetaKey::Mark,
                dreg,
            },
            Field::CtOriginalDaddr => Expr::CtOriginal {
                key: CtKey::DstIp,
                dreg,
            },
            Field::CtOriginalDaddr6 => Expr::CtOriginal {
                key: CtKey::DstIp6,
                dreg,
            },
            Field::CtOriginalProtoDst => Expr::CtOriginal {
                key: CtKey::ProtoDst,
                dreg,
            },
        }
    }
}

/// Loads the fields as one concatenated key starting at REG_1, each in the next free 4-byte registers.
pub fn load_concat(fields: &[Field]) -> Vec<Expr> {
    load_concat_at(fields, 0).0
}

/// Loads the fields as one concatenated key starting at 4-byte register slot `slot`; returns the expressions
/// and the first slot after the key.
pub(crate) fn load_concat_at(fields: &[Field], mut slot: u32) -> (Vec<Expr>, u32) {
    let exprs = fields
        .iter()
        .map(|f| {
            let reg = reg_at_slot(slot);
            slot += nftkube_netlink::align4(f.data_type().len()) as u32 / 4;
            f.load(reg)
        })
        .collect();
    (exprs, slot)
}

/// The bytes of an address as the kernel sees it in a packet.
pub fn ip_bytes(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// Builds a concatenated key value: each component padded to 4 bytes (when more than one component).
pub fn concat_key(parts: &[Vec<u8>]) -> Vec<u8> {
    if parts.len() == 1 {
        return parts[0].clone();
    }
    let mut out = Vec::new();
    for p in parts {
        push_field(&mut out, p);
    }
    out
}

/// Appends one field of a concatenation, padded to 4 bytes as nft lays concatenations out (see
/// [`concat_key`]; for keys built field by field into a reused buffer).
pub fn push_field(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(field);
    out.resize(nftkube_netlink::align4(out.len()), 0);
}

fn family_of(ip: &IpAddr) -> Family {
    if ip.is_ipv4() {
        Family::Ip
    } else {
        Family::Ip6
    }
}

fn addr_fields(family: Family) -> (Field, Field) {
    if family == Family::Ip6 {
        (Field::Ip6Saddr, Field::Ip6Daddr)
    } else {
        (Field::IpSaddr, Field::IpDaddr)
    }
}

/// `dnat` to the `addr . port` held in registers from 4-byte slot `slot`.
fn nat_from(family: Family, slot: u32) -> Expr {
    let addr_slots = if family == Family::Ip6 { 4 } else { 1 };
    Expr::Nat {
        kind: NatKind::Dnat,
        family,
        reg_addr: Some(reg_at_slot(slot)),
        reg_proto: Some(reg_at_slot(slot + addr_slots)),
        flags: NatFlags::MAP_IPS | NatFlags::PROTO_SPECIFIED,
    }
}

/// Accumulates the expressions of one rule.
#[derive(Debug, Default, Clone)]
pub struct RuleBuilder {
    exprs: Vec<Expr>,
    comment: Option<String>,
}

impl RuleBuilder {
    /// An empty rule.
    pub fn new() -> Self {
        Self::default()
    }

    /// A comment, cut to what the kernel stores (so the rule read back compares equal).
    pub fn comment(mut self, c: impl Into<String>) -> Self {
        let c: String = c.into();
        self.comment = Some(crate::wire::stored_comment(&c).to_owned());
        self
    }

    /// `field op value`.
    pub fn cmp(mut self, field: Field, op: CmpOp, value: Vec<u8>) -> Self {
        self.exprs.push(field.load(REG_1));
        self.exprs.push(Expr::Cmp {
            sreg: REG_1,
            op,
            data: value,
        });
        self
    }

    /// `field [!=] addr/prefix`: a masked compare, as nft writes prefix matches.
    pub fn prefix(mut self, field: Field, network: &IpAddr, prefix: u8, negate: bool) -> Self {
        let len = field.data_type().len();
        let mut mask = vec![0u8; len];
        for (i, byte) in mask.iter_mut().enumerate() {
            let bits = (prefix as i32 - 8 * i as i32).clamp(0, 8);
            *byte = if bits == 0 { 0 } else { 0xffu8 << (8 - bits) };
        }
        let net: Vec<u8> = ip_bytes(network)
            .iter()
            .zip(&mask)
            .map(|(a, m)| a & m)
            .collect();
        self.exprs.push(field.load(REG_1));
        self.exprs.push(Expr::Bitwise {
            sreg: REG_1,
            dreg: REG_1,
            len: len as u32,
            mask,
            xor: vec![0; len],
        });
        self.exprs.push(Expr::Cmp {
            sreg: REG_1,
            op: if negate { CmpOp::Neq } else { CmpOp::Eq },
            data: net,
        });
        self
    }

    /// `fields @set` (or `!= @set`).
    pub fn in_set(mut self, fields: &[Field], set: &str, invert: bool) -> Self {
        self.exprs.extend(load_concat(fields));
        self.exprs.push(Expr::Lookup {
            set: set.to_owned(),
            sreg: REG_1,
            dreg: None,
            invert,
        });
        self
    }

    /// `fields vmap @map`.
    pub fn vmap(mut self, fields: &[Field], map: &str) -> Self {
        self.exprs.extend(load_concat(fields));
        self.exprs.push(Expr::Lookup {
            set: map.to_owned(),
            sreg: REG_1,
            dreg: Some(REG_VERDICT),
            invert: false,
        });
        self
    }

    /// `meta mark set meta mark | bits`.
    pub fn mark_or(mut self, bits: u32) -> Self {
        self.exprs.push(Field::Mark.load(REG_1));
        self.exprs.push(Expr::Bitwise {
            sreg: REG_1,
            dreg: REG_1,
            len: 4,
            mask: (!bits).to_ne_bytes().to_vec(),
            xor: bits.to_ne_bytes().to_vec(),
        });
        self.exprs.push(Expr::MetaSet {
            key: MetaKey::Mark,
            sreg: REG_1,
        });
        self
    }

    /// `meta mark set meta mark ^ bits` (clears bits known to be set).
    pub fn mark_xor(mut self, bits: u32) -> Self {
        self.exprs.push(Field::Mark.load(REG_1));
        self.exprs.push(Expr::Bitwise {
            sreg: REG_1,
            dreg: REG_1,
            len: 4,
            mask: u32::MAX.to_ne_bytes().to_vec(),
            xor: bits.to_ne_bytes().to_vec(),
        });
        self.exprs.push(Expr::MetaSet {
            key: MetaKey::Mark,
            sreg: REG_1,
        });
        self
    }

    /// `ct status <bit>` / `ct state <bits>`: any of the bits set.
    pub fn ct_has(self, key: CtKey, bits: u32) -> Self {
        self.flags(Expr::Ct { key, dreg: REG_1 }, bits, true)
    }

    /// `ct state|status & bits == 0`: none of the bits set.
    pub fn ct_lacks(self, key: CtKey, bits: u32) -> Self {
        self.flags(Expr::Ct { key, dreg: REG_1 }, bits, false)
    }

    /// A 32-bit value loaded into REG_1 by `load`, masked with `bits`: any set (`set`) or none.
    fn flags(mut self, load: Expr, bits: u32, set: bool) -> Self {
        self.exprs.push(load);
        self.exprs.push(Expr::Bitwise {
            sreg: REG_1,
            dreg: REG_1,
            len: 4,
            mask: bits.to_ne_bytes().to_vec(),
            xor: vec![0; 4],
        });
        self.exprs.push(Expr::Cmp {
            sreg: REG_1,
            op: if set { CmpOp::Neq } else { CmpOp::Eq },
            data: vec![0; 4],
        });
        self
    }

    /// `fib saddr type local`: the packet comes from this host itself.
    pub fn saddr_is_local(self) -> Self {
        self.fib_local(FibFlags::SADDR)
    }

    /// `fib daddr type local`: the destination is one of this host's addresses.
    pub fn daddr_is_local(self) -> Self {
        self.fib_local(FibFlags::DADDR)
    }

    fn fib_local(mut self, which: FibFlags) -> Self {
        self.exprs.push(Expr::Fib {
            flags: which,
            result: FibResult::ADDRTYPE,
            dreg: REG_1,
        });
        self.exprs.push(Expr::Cmp {
            sreg: REG_1,
            op: CmpOp::Eq,
            data: RTN_LOCAL.to_ne_bytes().to_vec(),
        });
        self
    }

    /// `meta mark & bits == 0` (when `set` is false) or `!= 0`.
    pub fn mark_has(self, bits: u32, set: bool) -> Self {
        self.flags(Field::Mark.load(REG_1), bits, set)
    }

    /// `iifname [!=] "name"` (exact, `prefix == false`) or `iifname [!=] "name*"` (a prefix).
    pub fn iifname(mut self, name: &str, prefix: bool, negate: bool) -> Self {
        let mut data = name.as_bytes().to_vec();
        if !prefix {
            data.push(0); // the terminator makes it exact
        }
        self.exprs.push(Expr::Meta {
            key: MetaKey::IifName,
            dreg: REG_1,
        });
        self.exprs.push(Expr::Cmp {
            sreg: REG_1,
            op: if negate { CmpOp::Neq } else { CmpOp::Eq },
            data,
        });
        self
    }

    /// `numgen random mod modulus == value`.
    pub fn numgen_eq(mut self, modulus: u32, value: u32) -> Self {
        self.exprs.push(Expr::Numgen {
            dreg: REG_1,
            modulus,
            random: true,
            offset: 0,
        });
        self.exprs.push(Expr::Cmp {
            sreg: REG_1,
            op: CmpOp::Eq,
            data: value.to_ne_bytes().to_vec(),
        });
        self
    }

    /// `dnat to addr:port`.
    pub fn dnat(mut self, addr: &IpAddr, port: u16) -> Self {
        self.exprs.push(Expr::Immediate {
            dreg: REG_1,
            data: ip_bytes(addr),
        });
        self.exprs.push(Expr::Immediate {
            dreg: REG_2,
            data: port.to_be_bytes().to_vec(),
        });
        self.exprs.push(Expr::Nat {
            kind: NatKind::Dnat,
            family: family_of(addr),
            reg_addr: Some(REG_1),
            reg_proto: Some(REG_2),
            flags: NatFlags::MAP_IPS | NatFlags::PROTO_SPECIFIED,
        });
        self
    }

    /// `dnat <family> addr . port to <fields> . numgen random mod n offset o map @map`: the numgen value (one of
    /// the slots o..o+n) is appended to the key in the next free register, and the map's `addr . port` value
    /// feeds the nat expression.
    pub fn dnat_map_offset(
        mut self,
        fields: &[Field],
        n: u32,
        offset: u32,
        map: &str,
        family: Family,
    ) -> Self {
        self.exprs.extend(load_concat(fields));
        let slot: u32 = fields
            .iter()
            .map(|f| nftkube_netlink::align4(f.data_type().len()) as u32 / 4)
            .sum();
        self.exprs.push(Expr::Numgen {
            dreg: reg_at_slot(slot),
            modulus: n,
            random: true,
            offset,
        });
        self.exprs.push(Expr::Lookup {
            set: map.to_owned(),
            sreg: REG_1,
            dreg: Some(REG_1),
            invert: false,
        });
        let addr_slots = if family == Family::Ip6 { 4 } else { 1 };
        self.exprs.push(Expr::Nat {
            kind: NatKind::Dnat,
            family,
            reg_addr: Some(REG_1),
            reg_proto: Some(reg_at_slot(addr_slots)),
            flags: NatFlags::MAP_IPS | NatFlags::PROTO_SPECIFIED,
        });
        self
    }

    /// ClientIP affinity, the hit: `dnat to saddr . daddr . l4proto . dport map @affinity`, the endpoint this
    /// client was sent to last time. A miss ends the rule (the lookup fails) and the next rule picks. The entry
    /// is refreshed by `affinity_record` after DNAT, on every new connection, hit or miss.
    pub fn affinity_hit(mut self, family: Family, affinity: &str) -> Self {
        let (saddr, daddr) = addr_fields(family);
        self.exprs
            .extend(load_concat(&[saddr, daddr, Field::L4Proto, Field::ThDport]));
        self.exprs.push(Expr::Lookup {
            set: affinity.to_owned(),
            sreg: REG_1,
            dreg: Some(REG_1),
            invert: false,
        });
        self.exprs.push(nat_from(family, 0));
        self
    }

    /// `meta l4proto { tcp, udp } redirect to :fields map @map`: the relay's port for this frontend. The
    /// protocol match comes first, as nft requires before a transport port mapping.
    pub fn redirect_map(mut self, fields: &[Field], map: &str) -> Self {
        self.exprs.push(Field::L4Proto.load(REG_1));
        self.exprs.push(Expr::LookupAnon {
            set: AnonSet {
                key: DataType::InetProto,
                key_typeof: TypeofExpr::MetaL4proto,
                elements: [6u8, 17].iter().map(|p| vec![*p].into()).collect(),
            },
            sreg: REG_1,
        });
        self.exprs.extend(load_concat(fields));
        self.exprs.push(Expr::Lookup {
            set: map.to_owned(),
            sreg: REG_1,
            dreg: Some(REG_1),
            invert: false,
        });
        self.exprs.push(Expr::Redir {
            reg_proto: Some(REG_1),
            flags: NatFlags::PROTO_SPECIFIED,
        });
        self
    }

    /// `meta l4proto { tcp, udp, sctp }`. Before `ct original proto-dst` in a concatenation this is what lets
    /// nft 1.0.6 type that port when it loads a listing again (with a single protocol, or none, it cannot).
    pub fn transport_protocol(mut self) -> Self {
        self.exprs.push(Field::L4Proto.load(REG_1));
        self.exprs.push(Expr::LookupAnon {
            set: AnonSet {
                key: DataType::InetProto,
                key_typeof: TypeofExpr::MetaL4proto,
                elements: [6u8, 17, 132].iter().map(|p| vec![*p].into()).collect(),
            },
            sreg: REG_1,
        });
        self
    }

    /// ClientIP affinity, the record (after DNAT): `update @affinity { saddr . ct original daddr . l4proto .
    /// ct original proto-dst timeout T : daddr . dport }`, the endpoint this connection went to under the key
    /// of the frontend it was sent to.
    pub fn affinity_record(mut self, family: Family, affinity: &str, timeout_ms: u64) -> Self {
        let (saddr, daddr) = addr_fields(family);
        let original = if family == Family::Ip6 {
            Field::CtOriginalDaddr6
        } else {
            Field::CtOriginalDaddr
        };
        let key = [saddr, original, Field::L4Proto, Field::CtOriginalProtoDst];
        let (loads, data_slot) = load_concat_at(&key, 0);
        self.exprs.extend(loads);
        let (loads, _) = load_concat_at(&[daddr, Field::ThDport], data_slot);
        self.exprs.extend(loads);
        self.exprs.push(Expr::Dynset {
            set: affinity.to_owned(),
            op: DynsetOp::Update,
            sreg_key: REG_1,
            sreg_data: Some(reg_at_slot(data_slot)),
            timeout_ms: Some(timeout_ms),
        });
        self
    }

    /// `masquerade [fully-random]`.
    pub fn masquerade(mut self, fully_random: bool) -> Self {
        self.exprs.push(Expr::Masq {
            flags: if fully_random {
                NatFlags::PROTO_RANDOM_FULLY
            } else {
                NatFlags::EMPTY
            },
        });
        self
    }

    /// `reject` of this kind.
    pub fn reject(mut self, kind: RejectKind) -> Self {
        self.exprs.push(Expr::Reject(kind));
        self
    }

    /// A verdict.
    pub fn verdict(mut self, v: Verdict) -> Self {
        self.exprs.push(Expr::Verdict(v));
        self
    }

    /// Any expression.
    pub fn expr(mut self, e: Expr) -> Self {
        self.exprs.push(e);
        self
    }

    /// The rule.
    pub fn build(self) -> Rule {
        Rule {
            exprs: self.exprs,
            comment: self.comment,
        }
    }
}
