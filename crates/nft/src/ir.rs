//! nf_tables objects as typed data: what we want in the kernel and what we read back from it.
//!
//! Rules are lists of the kernel's own expressions (payload, meta, cmp, lookup, ...), so the codec is a direct
//! translation and a rule read back from the kernel compares equal to the rule we rendered. Human-readable nft
//! syntax is produced from this data by `text.rs`; it is never parsed.

pub use super::bytes::ElementBytes;
pub use super::udata::TypeofExpr;
use super::wire::consts::{
    NFTA_FIB_F_DADDR, NFTA_FIB_F_IIF, NFTA_FIB_F_MARK, NFTA_FIB_F_OIF, NFTA_FIB_F_SADDR,
    NFT_FIB_RESULT_ADDRTYPE, NFT_FIB_RESULT_OIF, NFT_TABLE_F_DORMANT, NF_NAT_RANGE_MAP_IPS,
    NF_NAT_RANGE_PERSISTENT, NF_NAT_RANGE_PROTO_RANDOM, NF_NAT_RANGE_PROTO_RANDOM_FULLY,
    NF_NAT_RANGE_PROTO_SPECIFIED,
};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::{BitOr, BitOrAssign};
use std::sync::Arc;

/// Declares a word of kernel flag bits: a `u32` newtype whose named bits are associated consts, declared
/// beside it with the kernel's numbers from `wire::consts`. Bits without a name here (a rule read back from
/// the kernel or written by another tool) are kept as read, so that a comparison still sees them.
macro_rules! flag_word {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u32);

        impl $name {
            /// No flag set.
            pub const EMPTY: $name = $name(0);

            /// The word as the kernel stores it.
            pub fn bits(self) -> u32 {
                self.0
            }
            /// The kernel's word, bits without a name included.
            pub fn from_bits_retain(bits: u32) -> Self {
                $name(bits)
            }
            /// Whether every flag of `other` is set.
            pub fn contains(self, other: Self) -> bool {
                self.0 & other.0 == other.0
            }
            /// Whether no flag is set.
            pub fn is_empty(self) -> bool {
                self.0 == 0
            }
            /// These flags without those of `other`.
            pub fn difference(self, other: Self) -> Self {
                $name(self.0 & !other.0)
            }
        }

        impl BitOr for $name {
            type Output = $name;
            fn bitor(self, other: $name) -> $name {
                $name(self.0 | other.0)
            }
        }

        impl BitOrAssign for $name {
            fn bitor_assign(&mut self, other: $name) {
                self.0 |= other.0;
            }
        }
    };
}

/// nf_tables address family of a table (`NFPROTO_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// `inet`: IPv4 and IPv6 in one table.
    Inet,
    /// `ip`: IPv4.
    Ip,
    /// `ip6`: IPv6.
    Ip6,
}

impl Family {
    /// The NFPROTO_* number the kernel uses for it.
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Inet => 1,
            Family::Ip => 2,
            Family::Ip6 => 10,
        }
    }
    /// The family of an NFPROTO_* number.
    pub(crate) fn from_nfproto(v: u8) -> Option<Family> {
        match v {
            1 => Some(Family::Inet),
            2 => Some(Family::Ip),
            10 => Some(Family::Ip6),
            _ => None,
        }
    }
    /// Its name in nft syntax.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Inet => "inet",
            Family::Ip => "ip",
            Family::Ip6 => "ip6",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// A netfilter hook a base chain attaches to.
pub enum Hook {
    /// Before routing, as packets arrive.
    Prerouting,
    /// Packets for this host.
    Input,
    /// Packets routed through this host.
    Forward,
    /// Packets this host sends.
    Output,
    /// After routing, as packets leave.
    Postrouting,
}

impl Hook {
    /// The NF_INET_* hook number.
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Input => 1,
            Hook::Forward => 2,
            Hook::Output => 3,
            Hook::Postrouting => 4,
        }
    }
    /// The hook of an NF_INET_* number.
    pub(crate) fn from_number(v: u32) -> Option<Hook> {
        [
            Hook::Prerouting,
            Hook::Input,
            Hook::Forward,
            Hook::Output,
            Hook::Postrouting,
        ]
        .into_iter()
        .find(|h| h.number() == v)
    }
    /// Its name in nft syntax.
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// A base chain's type.
pub enum ChainType {
    /// `filter`.
    Filter,
    /// `nat`: sees the first packet of each connection only.
    Nat,
    /// `route`: re-routes when marks or addresses change (output hook).
    Route,
}

impl ChainType {
    /// Its name in nft syntax (and in the kernel).
    pub fn as_str(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
            ChainType::Route => "route",
        }
    }
    /// The type of a name.
    pub fn parse(s: &str) -> Option<ChainType> {
        match s {
            "filter" => Some(ChainType::Filter),
            "nat" => Some(ChainType::Nat),
            "route" => Some(ChainType::Route),
            _ => None,
        }
    }
}

/// What a base chain does with a packet that no rule decided on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Policy {
    /// Drop the packet.
    Drop,
    /// Let the packet through.
    Accept,
}

impl Policy {
    /// The netfilter verdict number the kernel stores (NF_DROP, NF_ACCEPT).
    pub fn number(self) -> u32 {
        match self {
            Policy::Drop => 0,
            Policy::Accept => 1,
        }
    }
    /// The policy of a verdict number.
    pub(crate) fn from_number(v: u32) -> Option<Policy> {
        match v {
            0 => Some(Policy::Drop),
            1 => Some(Policy::Accept),
            _ => None,
        }
    }
    /// Its name in nft syntax.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Drop => "drop",
            Policy::Accept => "accept",
        }
    }
}

/// Where a base chain attaches. Our base chains always have policy accept: we only ever add behaviour for
/// traffic we own and let everything else through to other tables. The policy and the device are modelled
/// anyway, so that a chain read back from the kernel with another policy (or bound to a device) compares
/// unequal and gets repaired.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BaseHook {
    /// The hook.
    pub hook: Hook,
    /// The chain type.
    pub chain_type: ChainType,
    /// The priority among the hook's chains (lower runs first).
    pub priority: i32,
    /// The policy.
    pub policy: Policy,
    /// The device of an ingress / egress (netdev) hook; None on the hooks we use.
    pub(crate) device: Option<String>,
}

impl BaseHook {
    /// Whether a chain attached as `self` can become `other` by an update (NEWCHAIN on the existing chain):
    /// the kernel changes a base chain's policy in place, but refuses another type, hook, priority or device
    /// (EOPNOTSUPP), so those need the chain replaced.
    pub fn updatable_to(&self, other: &BaseHook) -> bool {
        (self.hook, self.chain_type, self.priority, &self.device)
            == (other.hook, other.chain_type, other.priority, &other.device)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// A chain's declaration: its name and, for a base chain, where it attaches.
pub struct Chain {
    /// The chain's name.
    pub name: String,
    /// Where it attaches (None: a regular chain, reached by jumps and gotos).
    pub base: Option<BaseHook>,
}

impl Chain {
    /// A chain attached to a hook.
    pub fn base(name: &str, chain_type: ChainType, hook: Hook, priority: i32) -> Chain {
        Chain {
            name: name.into(),
            base: Some(BaseHook {
                hook,
                chain_type,
                priority,
                policy: Policy::Accept,
                device: None,
            }),
        }
    }

    /// A chain reached only by jump, goto or verdict-map element.
    pub fn regular(name: &str) -> Chain {
        Chain {
            name: name.into(),
            base: None,
        }
    }
}

/// nft data types, used for set keys and values: they fix the byte length and how `nft` displays a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DataType {
    /// `ipv4_addr`.
    Ipv4Addr,
    /// `ipv6_addr`.
    Ipv6Addr,
    /// `inet_proto`: a layer-4 protocol number.
    InetProto,
    /// `inet_service`: a port (network byte order).
    InetService,
    /// `mark`: a packet or connection mark.
    Mark,
    /// A plain integer of the given byte length (numgen output, counters, ...), host byte order.
    Integer(u8),
    /// `verdict`: the value of a verdict map.
    Verdict,
}

impl DataType {
    /// nft's type number (`enum datatypes` in nftables' datatype.h).
    pub(crate) fn nft_id(self) -> u32 {
        match self {
            DataType::Verdict => 1,
            DataType::Integer(_) => 4,
            DataType::Ipv4Addr => 7,
            DataType::Ipv6Addr => 8,
            DataType::InetProto => 12,
            DataType::InetService => 13,
            DataType::Mark => 19,
        }
    }
    /// Byte length of a value (0 for verdicts, which are not bytes).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(self) -> usize {
        match self {
            DataType::Verdict => 0,
            DataType::Integer(n) => n as usize,
            DataType::Ipv4Addr => 4,
            DataType::Ipv6Addr => 16,
            DataType::InetProto => 1,
            DataType::InetService => 2,
            DataType::Mark => 4,
        }
    }
    /// nft's name for the type.
    pub fn name(self) -> &'static str {
        match self {
            DataType::Verdict => "verdict",
            DataType::Integer(_) => "integer",
            DataType::Ipv4Addr => "ipv4_addr",
            DataType::Ipv6Addr => "ipv6_addr",
            DataType::InetProto => "inet_proto",
            DataType::InetService => "inet_service",
            DataType::Mark => "mark",
        }
    }
    /// The type of nft's type number; `len` is the byte length an integer has.
    pub(crate) fn from_nft_id(id: u32, len: usize) -> Option<DataType> {
        Some(match id {
            1 => DataType::Verdict,
            4 => DataType::Integer(len as u8),
            7 => DataType::Ipv4Addr,
            8 => DataType::Ipv6Addr,
            12 => DataType::InetProto,
            13 => DataType::InetService,
            19 => DataType::Mark,
            _ => return None,
        })
    }
}

/// Bits of nft's concatenated type number per component.
const TYPE_BITS: u32 = 6;

/// The nft type number of a (possibly concatenated) key: each component shifted in, as nft does.
pub(crate) fn concat_type_id(types: &[DataType]) -> u32 {
    types
        .iter()
        .fold(0, |acc, t| (acc << TYPE_BITS) | t.nft_id())
}

/// Byte length of a key: a single component as is, concatenations with each component padded to 4 bytes.
pub fn key_len(types: &[DataType]) -> usize {
    if types.len() == 1 {
        types[0].len()
    } else {
        types.iter().map(|t| nftkube_netlink::align4(t.len())).sum()
    }
}

/// Decodes a concatenated nft type number given the total key length. Only succeeds when the components
/// are types we know and their lengths add up.
pub(crate) fn split_type_id(mut id: u32, len: usize) -> Option<Vec<DataType>> {
    let mut ids = Vec::new();
    while id != 0 {
        ids.push(id & ((1 << TYPE_BITS) - 1));
        id >>= TYPE_BITS;
    }
    ids.reverse();
    if ids.len() == 1 {
        return DataType::from_nft_id(ids[0], len).map(|t| vec![t]);
    }
    let types: Option<Vec<DataType>> = ids.iter().map(|&i| DataType::from_nft_id(i, 4)).collect();
    let types = types?;
    (key_len(&types) == len).then_some(types)
}

/// A named set or map.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Set {
    /// The set's name.
    pub name: String,
    /// The key's types (several: a concatenation).
    pub key: Vec<DataType>,
    /// Value types for a map: `[Verdict]` for a verdict map, data types otherwise; empty for a plain set.
    pub data: Vec<DataType>,
    /// Elements expire after this many milliseconds unless refreshed (dynamic sets).
    pub timeout_ms: Option<u64>,
    /// Updated from the packet path (`update @set`): nft's "dynamic" flag.
    pub dynamic: bool,
    /// The most elements it may hold (`size`). Dynamic sets need one: nft gives them 65535 when unsaid, so a
    /// listing of a set created without one would not reload into the same set.
    pub size: Option<u32>,
    /// Declared `typeof` these expressions rather than by type names: written to the set's user data as nft
    /// does, so that nft can list the set and load its listing again (a numgen slot has no type name).
    pub key_typeof: Option<Vec<TypeofExpr>>,
    /// As `key_typeof`, for a map's values.
    pub data_typeof: Option<Vec<TypeofExpr>>,
}

impl Set {
    /// A set (empty `data`) or map declared by type names, static, without timeout or size.
    pub fn new(name: &str, key: Vec<DataType>, data: Vec<DataType>) -> Set {
        Set {
            name: name.into(),
            key,
            data,
            timeout_ms: None,
            dynamic: false,
            size: None,
            key_typeof: None,
            data_typeof: None,
        }
    }

    /// A map declared `typeof key : data`.
    pub fn typed(name: &str, key: Vec<TypeofExpr>, data: Vec<TypeofExpr>) -> Set {
        let types = |e: &[TypeofExpr]| e.iter().map(|x| x.data_type()).collect();
        Set {
            key_typeof: Some(key.clone()),
            data_typeof: (!data.is_empty()).then(|| data.clone()),
            ..Set::new(name, types(&key), types(&data))
        }
    }

    /// Whether it maps keys to values.
    pub(crate) fn is_map(&self) -> bool {
        !self.data.is_empty()
    }
    /// Whether it maps keys to verdicts.
    pub fn is_verdict_map(&self) -> bool {
        self.data == [DataType::Verdict]
    }
}

/// One element: its key bytes (components padded to 4 bytes when concatenated) and, in maps, its value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Element {
    /// The key bytes.
    pub key: ElementBytes,
    /// The value, in maps.
    pub value: Option<ElementValue>,
}

/// An element with a comment, as `nft add element ... { key comment "text" : value }` writes it: the text
/// goes into the element's user data (NFTA_SET_ELEM_USERDATA), which the kernel keeps and `nft list` shows.
/// Used where the kernel is the only record of who owns an element (the CNI portmap plugin).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommentedElement {
    /// The element.
    pub element: Element,
    /// Its comment (at most [`ELEMENT_COMMENT_MAX`] bytes).
    pub comment: String,
}

/// The longest element comment nft accepts in its own syntax (`NFT_USERDATA_MAXLEN` is larger, but a
/// longer comment would not reload from a listing).
pub(crate) const ELEMENT_COMMENT_MAX: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// A map element's value.
pub enum ElementValue {
    /// A verdict (verdict maps).
    Verdict(Verdict),
    /// Data bytes (data maps).
    Data(ElementBytes),
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// What happens to a packet next.
pub enum Verdict {
    /// Let it through this hook.
    Accept,
    /// Drop it.
    Drop,
    /// Go on with the next rule.
    Continue,
    /// Back to the chain that jumped here.
    Return,
    /// Chain names are shared: every service of one kind has a dispatch element naming its `lb*` chain, and a
    /// shared name also keeps an element's value to 32 bytes (see `ElementBytes`).
    Jump(Arc<str>),
    /// Continue in the named chain without coming back.
    Goto(Arc<str>),
}

impl Verdict {
    /// The kernel's verdict code (NF_DROP, NF_ACCEPT, NFT_CONTINUE, NFT_JUMP, NFT_GOTO, NFT_RETURN).
    pub(crate) fn code(&self) -> i32 {
        match self {
            Verdict::Drop => 0,
            Verdict::Accept => 1,
            Verdict::Continue => -1,
            Verdict::Jump(_) => -3,
            Verdict::Goto(_) => -4,
            Verdict::Return => -5,
        }
    }
    /// The chain a jump or goto names.
    pub fn chain(&self) -> Option<&str> {
        match self {
            Verdict::Jump(c) | Verdict::Goto(c) => Some(c),
            _ => None,
        }
    }
}

/// Kernel register numbers. `R1` is the 16-byte NFT_REG_1; `reg32(i)` the i-th 4-byte register, which
/// overlaps: R1 == reg32(0..4). Concatenated keys are loaded into consecutive 4-byte registers.
pub const REG_VERDICT: u32 = 0;
/// NFT_REG_1: the first 16-byte data register.
pub const REG_1: u32 = 1;
/// NFT_REG_2: the second 16-byte data register.
pub const REG_2: u32 = 2;
/// The i-th 4-byte data register (NFT_REG32_00 + i).
pub const fn reg32(i: u32) -> u32 {
    8 + i
}

/// The register that starts at a 4-byte slot, spelled the way the kernel dumps it: a 16-byte register
/// (NFT_REG_1..4) where the slot is 16-byte aligned, a 4-byte register otherwise. Encoding it the same way
/// makes rules read back from the kernel compare equal to ours.
pub fn reg_at_slot(slot: u32) -> u32 {
    if slot.is_multiple_of(4) {
        REG_1 + slot / 4
    } else {
        reg32(slot)
    }
}

/// The 4-byte slot a register starts at (for following concatenations).
pub fn reg_slot(reg: u32) -> Option<u32> {
    match reg {
        1..=4 => Some((reg - 1) * 4),
        8..=23 => Some(reg - 8),
        _ => None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// Where a payload offset counts from.
pub enum PayloadBase {
    /// The link-layer header.
    LinkLayer,
    /// The network header (IPv4, IPv6).
    Network,
    /// The transport header (TCP, UDP, SCTP).
    Transport,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// What a `meta` expression loads or sets.
pub enum MetaKey {
    /// The packet's mark.
    Mark,
    /// The layer-4 protocol.
    L4Proto,
    /// The layer-3 protocol (NFPROTO_*).
    NfProto,
    /// The input interface's index.
    Iif,
    /// The output interface's index.
    Oif,
    /// The input interface's name.
    IifName,
    /// The output interface's name.
    OifName,
    /// The packet's trace bit (`meta nftrace set 1`): the kernel then reports its path (`nftkube trace --live`).
    NfTrace,
}

impl MetaKey {
    /// The NFT_META_* number.
    pub fn number(self) -> u32 {
        match self {
            MetaKey::Mark => 3,
            MetaKey::Iif => 4,
            MetaKey::Oif => 5,
            MetaKey::IifName => 6,
            MetaKey::OifName => 7,
            MetaKey::NfTrace => 12,
            MetaKey::NfProto => 15,
            MetaKey::L4Proto => 16,
        }
    }
    /// The key of an NFT_META_* number.
    pub(crate) fn from_number(v: u32) -> Option<MetaKey> {
        [
            MetaKey::Mark,
            MetaKey::L4Proto,
            MetaKey::NfProto,
            MetaKey::Iif,
            MetaKey::Oif,
            MetaKey::IifName,
            MetaKey::OifName,
            MetaKey::NfTrace,
        ]
        .into_iter()
        .find(|k| k.number() == v)
    }
    /// Its name in nft syntax.
    pub fn as_str(self) -> &'static str {
        match self {
            MetaKey::Mark => "mark",
            MetaKey::L4Proto => "l4proto",
            MetaKey::NfProto => "nfproto",
            MetaKey::Iif => "iif",
            MetaKey::Oif => "oif",
            MetaKey::IifName => "iifname",
            MetaKey::OifName => "oifname",
            MetaKey::NfTrace => "nftrace",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// What a `ct` expression loads.
pub enum CtKey {
    /// The connection's state bits (`ct state`).
    State,
    /// The connection's status bits (`ct status`).
    Status,
    /// The connection's mark.
    Mark,
    /// The connection's destination port (`ct original proto-dst`: the service port, even after DNAT).
    ProtoDst,
    /// The connection's destination address (`ct original ip daddr`, `ct original ip6 daddr`).
    DstIp,
    /// The same for IPv6.
    DstIp6,
}

impl CtKey {
    /// The NFT_CT_* number.
    pub fn number(self) -> u32 {
        match self {
            CtKey::State => 0,
            CtKey::Status => 2,
            CtKey::Mark => 3,
            CtKey::ProtoDst => 12,
            CtKey::DstIp => 20,
            CtKey::DstIp6 => 22,
        }
    }
    /// The key of an NFT_CT_* number.
    pub(crate) fn from_number(v: u32) -> Option<CtKey> {
        [
            CtKey::State,
            CtKey::Status,
            CtKey::Mark,
            CtKey::ProtoDst,
            CtKey::DstIp,
            CtKey::DstIp6,
        ]
        .into_iter()
        .find(|k| k.number() == v)
    }
}

// The CT_STATE_*, CT_STATUS_DNAT, RTN_LOCAL and ICMP_* numbers below are data: values a rule loads and
// compares (or answers with), not flag words the IR stores, so they stay plain numbers.

/// Conntrack status bit for "this connection was destination-NATed" (IPS_DST_NAT).
pub const CT_STATUS_DNAT: u32 = 1 << 5;
/// `ct state` bits (NF_CT_STATE_BIT).
pub const CT_STATE_INVALID: u32 = 1;
/// `ct state established`.
pub const CT_STATE_ESTABLISHED: u32 = 1 << 1;
/// `ct state related`.
pub const CT_STATE_RELATED: u32 = 1 << 2;
/// `ct state new`.
pub const CT_STATE_NEW: u32 = 1 << 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// A comparison.
pub enum CmpOp {
    /// `==`.
    Eq,
    /// `!=`.
    Neq,
    /// `<`.
    Lt,
    /// `<=`.
    Lte,
    /// `>`.
    Gt,
    /// `>=`.
    Gte,
}

impl CmpOp {
    /// The NFT_CMP_* number.
    pub fn number(self) -> u32 {
        self as u32
    }
    /// The operator of an NFT_CMP_* number.
    pub(crate) fn from_number(v: u32) -> Option<CmpOp> {
        [
            CmpOp::Eq,
            CmpOp::Neq,
            CmpOp::Lt,
            CmpOp::Lte,
            CmpOp::Gt,
            CmpOp::Gte,
        ]
        .into_iter()
        .find(|o| o.number() == v)
    }
    /// Its nft syntax.
    pub fn as_str(self) -> &'static str {
        match self {
            CmpOp::Eq => "==",
            CmpOp::Neq => "!=",
            CmpOp::Lt => "<",
            CmpOp::Lte => "<=",
            CmpOp::Gt => ">",
            CmpOp::Gte => ">=",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// Which end of the connection NAT rewrites.
pub enum NatKind {
    /// The source.
    Snat,
    /// The destination.
    Dnat,
}

flag_word! {
    /// The NAT range flags (`NF_NAT_RANGE_*`) of the nat, masq and redir expressions.
    NatFlags
}

impl NatFlags {
    /// The address register is set. The kernel adds it itself when an address register is given and dumps
    /// it back; we send it too so a rule read back compares equal to the rule we rendered.
    pub const MAP_IPS: NatFlags = NatFlags(NF_NAT_RANGE_MAP_IPS);
    /// The port register is set.
    pub const PROTO_SPECIFIED: NatFlags = NatFlags(NF_NAT_RANGE_PROTO_SPECIFIED);
    /// `random`: random ports.
    pub(crate) const PROTO_RANDOM: NatFlags = NatFlags(NF_NAT_RANGE_PROTO_RANDOM);
    /// `persistent`: the same address for a client.
    pub const PERSISTENT: NatFlags = NatFlags(NF_NAT_RANGE_PERSISTENT);
    /// `fully-random`: ports fully randomised.
    pub const PROTO_RANDOM_FULLY: NatFlags = NatFlags(NF_NAT_RANGE_PROTO_RANDOM_FULLY);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// How `reject` answers.
pub enum RejectKind {
    /// ICMP (v4) or ICMPv6 unreachable with this code, depending on the table family.
    IcmpUnreach(u8),
    /// A TCP reset.
    TcpReset,
    /// Family-independent ICMPx code (inet tables).
    IcmpxUnreach(u8),
}

/// ICMP port unreachable (v4 code 3); ICMPv6's is 4; icmpx's is 1.
pub const ICMP_PORT_UNREACH: u8 = 3;
/// ICMPv6 port unreachable.
pub const ICMPV6_PORT_UNREACH: u8 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
/// What a `dynset` expression does with the key.
pub enum DynsetOp {
    /// Adds it if missing (`add @set`).
    Add,
    /// Adds it or refreshes its timeout (`update @set`).
    Update,
}

flag_word! {
    /// What a `fib` lookup is made by (`NFTA_FIB_F_*`): an address, and what else the route depends on.
    FibFlags
}

impl FibFlags {
    /// Look up the source address.
    pub const SADDR: FibFlags = FibFlags(NFTA_FIB_F_SADDR);
    /// Look up the destination address.
    pub const DADDR: FibFlags = FibFlags(NFTA_FIB_F_DADDR);
    /// Include the packet mark.
    pub(crate) const MARK: FibFlags = FibFlags(NFTA_FIB_F_MARK);
    /// Include the input interface.
    pub const IIF: FibFlags = FibFlags(NFTA_FIB_F_IIF);
    /// Include the output interface.
    pub(crate) const OIF: FibFlags = FibFlags(NFTA_FIB_F_OIF);
}

/// What a `fib` lookup returns (`NFT_FIB_RESULT_*`); a value we do not name is kept as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FibResult(u32);

impl FibResult {
    /// The output interface index (`oif`).
    pub const OIF: FibResult = FibResult(NFT_FIB_RESULT_OIF);
    /// The address type, an RTN_* number (`type`).
    pub const ADDRTYPE: FibResult = FibResult(NFT_FIB_RESULT_ADDRTYPE);

    /// The kernel's number.
    pub fn number(self) -> u32 {
        self.0
    }
    /// The result of a kernel number, named here or not.
    pub fn from_number(v: u32) -> Self {
        FibResult(v)
    }
}

/// `RTN_LOCAL`: what `fib daddr type local` compares the address type to.
pub const RTN_LOCAL: u32 = 2;

/// One nf_tables expression, as the kernel knows it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Expr {
    /// Loads `len` bytes at `offset` from a header into `dreg`.
    Payload {
        /// The header.
        base: PayloadBase,
        /// Byte offset in it.
        offset: u32,
        /// Bytes to load.
        len: u32,
        /// The destination register.
        dreg: u32,
    },
    /// Loads a meta key into `dreg`.
    Meta {
        /// The key.
        key: MetaKey,
        /// The destination register.
        dreg: u32,
    },
    /// Sets a meta key (the mark) from `sreg`.
    MetaSet {
        /// The key.
        key: MetaKey,
        /// The source register.
        sreg: u32,
    },
    /// Compares `sreg` with `data`; the rule stops here when false.
    Cmp {
        /// The register compared.
        sreg: u32,
        /// The operator.
        op: CmpOp,
        /// The value.
        data: Vec<u8>,
    },
    /// `dreg = (sreg & mask) ^ xor` over `len` bytes.
    Bitwise {
        /// The source register.
        sreg: u32,
        /// The destination register.
        dreg: u32,
        /// Bytes.
        len: u32,
        /// The mask.
        mask: Vec<u8>,
        /// The xor.
        xor: Vec<u8>,
    },
    /// Loads `data` into `dreg`.
    Immediate {
        /// The destination register.
        dreg: u32,
        /// The value.
        data: Vec<u8>,
    },
    /// A verdict: immediate into the verdict register.
    Verdict(Verdict),
    /// Set membership (`dreg` None) or map lookup into `dreg` (REG_VERDICT for a verdict map).
    Lookup {
        /// The set or map.
        set: String,
        /// The register(s) the key is read from.
        sreg: u32,
        /// Where a map's value goes (None: a membership test).
        dreg: Option<u32>,
        /// Matches when the key is *not* in the set.
        invert: bool,
    },
    /// Loads a number generator's next value (`numgen random|inc mod N offset O`) into `dreg`.
    Numgen {
        /// The destination register.
        dreg: u32,
        /// Values are `0..modulus` (plus `offset`).
        modulus: u32,
        /// Random (else incrementing).
        random: bool,
        /// Added to each value.
        offset: u32,
    },
    /// Adds or updates an element of a set from the packet path (`add @set { ... }`, `update @set { ... }`).
    Dynset {
        /// The set.
        set: String,
        /// Add or update.
        op: DynsetOp,
        /// The register(s) the key is read from.
        sreg_key: u32,
        /// The register(s) a map's value is read from.
        sreg_data: Option<u32>,
        /// The element's timeout (None: the set's).
        timeout_ms: Option<u64>,
    },
    /// Source or destination NAT to the address and port in registers.
    Nat {
        /// SNAT or DNAT.
        kind: NatKind,
        /// The family of the addresses.
        family: Family,
        /// The register with the address.
        reg_addr: Option<u32>,
        /// The register with the port.
        reg_proto: Option<u32>,
        /// NAT range flags.
        flags: NatFlags,
    },
    /// Source NAT to the outgoing interface's address.
    Masq {
        /// NAT range flags.
        flags: NatFlags,
    },
    /// `redirect to :port` (the port from `reg_proto`): DNAT to the primary address of the incoming
    /// interface (127.0.0.1 / ::1 for local traffic).
    Redir {
        /// The register with the port.
        reg_proto: Option<u32>,
        /// NAT range flags.
        flags: NatFlags,
    },
    /// Rejects the packet with an answer.
    Reject(RejectKind),
    /// Loads a ct key into `dreg`.
    Ct {
        /// The key.
        key: CtKey,
        /// The destination register.
        dreg: u32,
    },
    /// A ct key of the original direction (`ct original ...`).
    CtOriginal {
        /// The key.
        key: CtKey,
        /// The destination register.
        dreg: u32,
    },
    /// Membership in a constant set that belongs to this rule alone (`meta l4proto { tcp, udp, sctp }`): nft
    /// writes such literal sets as anonymous sets created in the same batch as the rule.
    LookupAnon {
        /// The set's content.
        set: AnonSet,
        /// The register(s) the key is read from.
        sreg: u32,
    },
    /// A routing lookup (`fib daddr type`, ...) into `dreg`.
    Fib {
        /// What to look up by.
        flags: FibFlags,
        /// What to return.
        result: FibResult,
        /// The destination register.
        dreg: u32,
    },
    /// Counts packets and bytes.
    Counter,
}

impl Expr {
    /// The kernel's expression name.
    pub(crate) fn kernel_name(&self) -> &'static str {
        match self {
            Expr::Payload { .. } => "payload",
            Expr::Meta { .. } | Expr::MetaSet { .. } => "meta",
            Expr::Cmp { .. } => "cmp",
            Expr::Bitwise { .. } => "bitwise",
            Expr::Immediate { .. } | Expr::Verdict(_) => "immediate",
            Expr::Lookup { .. } => "lookup",
            Expr::Numgen { .. } => "numgen",
            Expr::Dynset { .. } => "dynset",
            Expr::Nat { .. } => "nat",
            Expr::Masq { .. } => "masq",
            Expr::Redir { .. } => "redir",
            Expr::Reject(_) => "reject",
            Expr::Ct { .. } | Expr::CtOriginal { .. } => "ct",
            Expr::LookupAnon { .. } => "lookup",
            Expr::Fib { .. } => "fib",
            Expr::Counter => "counter",
        }
    }
}

/// The content of an anonymous set: a key type, how nft declares it, and its elements in order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AnonSet {
    /// The key's type.
    pub key: DataType,
    /// How nft declares the key.
    pub key_typeof: TypeofExpr,
    /// The elements' keys, in order.
    pub elements: Vec<ElementBytes>,
}

/// Name prefix the kernel gives anonymous sets (`__set%d`, the number chosen by the kernel).
pub(crate) const ANON_SET_NAME: &str = "__set%d";

/// A rule: the expressions in order, and an optional comment (kept in the rule's userdata as nft does).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    /// The expressions, in order.
    pub exprs: Vec<Expr>,
    /// The comment.
    pub comment: Option<String>,
}

/// A chain and its rules.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChainState {
    /// The chain's declaration.
    pub chain: Chain,
    /// Its rules, in order.
    pub rules: Vec<Rule>,
}

/// A set or map and its elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetState {
    /// The set's declaration.
    pub set: Set,
    /// Its elements.
    pub elements: BTreeSet<Element>,
}

flag_word! {
    /// A table's flags (`NFT_TABLE_F_*`).
    TableFlags
}

impl TableFlags {
    /// The table's base chains are unhooked (`nft add table ... { flags dormant; }`).
    pub const DORMANT: TableFlags = TableFlags(NFT_TABLE_F_DORMANT);
}

/// The whole content of one of our tables, keyed by name so two states diff cheaply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableState {
    /// The table's family.
    pub family: Family,
    /// The table's name.
    pub name: String,
    /// The table's flags: ours are always empty; read back, [`TableFlags::DORMANT`] means every hook of the
    /// table is detached (all its rules silently off).
    pub flags: TableFlags,
    /// Its sets and maps, by name.
    pub sets: BTreeMap<String, SetState>,
    /// Its chains, by name.
    pub chains: BTreeMap<String, ChainState>,
}

impl TableState {
    /// An empty table.
    pub fn new(family: Family, name: impl Into<String>) -> Self {
        TableState {
            family,
            name: name.into(),
            flags: TableFlags::EMPTY,
            sets: BTreeMap::new(),
            chains: BTreeMap::new(),
        }
    }

    /// Declares a chain (kept if already declared) and returns it.
    pub fn add_chain(&mut self, chain: Chain) -> &mut ChainState {
        let name = chain.name.clone();
        self.chains.entry(name).or_insert(ChainState {
            chain,
            rules: Vec::new(),
        })
    }

    /// A declared chain; panics when it is not (a render bug).
    pub fn chain_mut(&mut self, name: &str) -> &mut ChainState {
        self.chains
            .get_mut(name)
            .unwrap_or_else(|| panic!("chain {name} not declared"))
    }

    /// Declares a set (kept if already declared) and returns it.
    pub fn add_set(&mut self, set: Set) -> &mut SetState {
        let name = set.name.clone();
        self.sets.entry(name).or_insert(SetState {
            set,
            elements: BTreeSet::new(),
        })
    }

    /// A declared set; panics when it is not (a render bug).
    pub fn set_mut(&mut self, name: &str) -> &mut SetState {
        self.sets
            .get_mut(name)
            .unwrap_or_else(|| panic!("set {name} not declared"))
    }
}
