//! nf_tables objects as typed data: what we want in the kernel and what we read back from it.
//!
//! Rules are lists of the kernel's own expressions (payload, meta, cmp, lookup, ...), so the codec is a direct
//! translation and a rule read back from the kernel compares equal to the rule we rendered. Human-readable nft
//! syntax is produced from this data by `text.rs`; it is never parsed.

pub use super::bytes::ElementBytes;
pub use super::udata::TypeofExpr;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// nf_tables address family of a table (`NFPROTO_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    Inet,
    Ip,
    Ip6,
}

impl Family {
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Inet => 1,
            Family::Ip => 2,
            Family::Ip6 => 10,
        }
    }
    pub fn from_nfproto(v: u8) -> Option<Family> {
        match v {
            1 => Some(Family::Inet),
            2 => Some(Family::Ip),
            10 => Some(Family::Ip6),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Inet => "inet",
            Family::Ip => "ip",
            Family::Ip6 => "ip6",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl Hook {
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Input => 1,
            Hook::Forward => 2,
            Hook::Output => 3,
            Hook::Postrouting => 4,
        }
    }
    pub fn from_number(v: u32) -> Option<Hook> {
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
pub enum ChainType {
    Filter,
    Nat,
    Route,
}

impl ChainType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
            ChainType::Route => "route",
        }
    }
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
    Drop,
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
    pub fn from_number(v: u32) -> Option<Policy> {
        match v {
            0 => Some(Policy::Drop),
            1 => Some(Policy::Accept),
            _ => None,
        }
    }
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
    pub hook: Hook,
    pub chain_type: ChainType,
    pub priority: i32,
    pub policy: Policy,
    /// The device of an ingress / egress (netdev) hook; None on the hooks we use.
    pub device: Option<String>,
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
pub struct Chain {
    pub name: String,
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
    Ipv4Addr,
    Ipv6Addr,
    InetProto,
    InetService,
    Mark,
    /// A plain integer of the given byte length (numgen output, counters, ...), host byte order.
    Integer(u8),
    Verdict,
}

impl DataType {
    /// nft's type number (`enum datatypes` in nftables' datatype.h).
    pub fn nft_id(self) -> u32 {
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
    pub fn from_nft_id(id: u32, len: usize) -> Option<DataType> {
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
pub fn concat_type_id(types: &[DataType]) -> u32 {
    types
        .iter()
        .fold(0, |acc, t| (acc << TYPE_BITS) | t.nft_id())
}

/// Byte length of a key: a single component as is, concatenations with each component padded to 4 bytes.
pub fn key_len(types: &[DataType]) -> usize {
    if types.len() == 1 {
        types[0].len()
    } else {
        types.iter().map(|t| crate::netlink::align4(t.len())).sum()
    }
}

/// Decodes a concatenated nft type number given the total key length. Only succeeds when the components
/// are types we know and their lengths add up.
pub fn split_type_id(mut id: u32, len: usize) -> Option<Vec<DataType>> {
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
    pub name: String,
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

    pub fn is_map(&self) -> bool {
        !self.data.is_empty()
    }
    pub fn is_verdict_map(&self) -> bool {
        self.data == [DataType::Verdict]
    }
    /// NFT_SET_* flags as the kernel stores them.
    pub fn flags(&self) -> u32 {
        let mut f = 0;
        if self.is_map() {
            f |= SET_F_MAP;
        }
        if self.timeout_ms.is_some() {
            f |= SET_F_TIMEOUT;
        }
        if self.dynamic {
            f |= SET_F_EVAL;
        }
        f
    }
}

/// A dormant table's base chains are unhooked (`nft add table ... { flags dormant; }`).
pub const TABLE_F_DORMANT: u32 = 0x1;

pub const SET_F_ANONYMOUS: u32 = 0x1;
pub const SET_F_CONSTANT: u32 = 0x2;
pub const SET_F_INTERVAL: u32 = 0x4;
pub const SET_F_MAP: u32 = 0x8;
pub const SET_F_TIMEOUT: u32 = 0x10;
pub const SET_F_EVAL: u32 = 0x20;

/// One element: its key bytes (components padded to 4 bytes when concatenated) and, in maps, its value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Element {
    pub key: ElementBytes,
    pub value: Option<ElementValue>,
}

/// An element with a comment, as `nft add element ... { key comment "text" : value }` writes it: the text
/// goes into the element's user data (NFTA_SET_ELEM_USERDATA), which the kernel keeps and `nft list` shows.
/// Used where the kernel is the only record of who owns an element (the CNI portmap plugin).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommentedElement {
    pub element: Element,
    pub comment: String,
}

/// The longest element comment nft accepts in its own syntax (`NFT_USERDATA_MAXLEN` is larger, but a
/// longer comment would not reload from a listing).
pub const ELEMENT_COMMENT_MAX: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ElementValue {
    Verdict(Verdict),
    Data(ElementBytes),
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Accept,
    Drop,
    Continue,
    Return,
    /// Chain names are shared: every service of one kind has a dispatch element naming its `lb*` chain, and a
    /// shared name also keeps an element's value to 32 bytes (see `ElementBytes`).
    Jump(Arc<str>),
    Goto(Arc<str>),
}

impl Verdict {
    pub fn code(&self) -> i32 {
        match self {
            Verdict::Drop => 0,
            Verdict::Accept => 1,
            Verdict::Continue => -1,
            Verdict::Jump(_) => -3,
            Verdict::Goto(_) => -4,
            Verdict::Return => -5,
        }
    }
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
pub const REG_1: u32 = 1;
pub const REG_2: u32 = 2;
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
pub enum PayloadBase {
    LinkLayer,
    Network,
    Transport,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MetaKey {
    Mark,
    L4Proto,
    NfProto,
    Iif,
    Oif,
    IifName,
    OifName,
    /// The packet's trace bit (`meta nftrace set 1`): the kernel then reports its path (`nftkube trace --live`).
    NfTrace,
}

impl MetaKey {
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
    pub fn from_number(v: u32) -> Option<MetaKey> {
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
pub enum CtKey {
    State,
    Status,
    Mark,
    /// The connection's destination port (`ct original proto-dst`: the service port, even after DNAT).
    ProtoDst,
    /// The connection's destination address (`ct original ip daddr`, `ct original ip6 daddr`).
    DstIp,
    DstIp6,
}

impl CtKey {
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
    pub fn from_number(v: u32) -> Option<CtKey> {
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

/// Conntrack status bit for "this connection was destination-NATed" (IPS_DST_NAT).
pub const CT_STATUS_DNAT: u32 = 1 << 5;
/// `ct state` bits (NF_CT_STATE_BIT).
pub const CT_STATE_INVALID: u32 = 1;
pub const CT_STATE_ESTABLISHED: u32 = 1 << 1;
pub const CT_STATE_RELATED: u32 = 1 << 2;
pub const CT_STATE_NEW: u32 = 1 << 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CmpOp {
    Eq,
    Neq,
    Lt,
    Lte,
    Gt,
    Gte,
}

impl CmpOp {
    pub fn number(self) -> u32 {
        self as u32
    }
    pub fn from_number(v: u32) -> Option<CmpOp> {
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
pub enum NatKind {
    Snat,
    Dnat,
}

/// `NF_NAT_RANGE_*` flags.
/// The kernel adds MAP_IPS itself when an address register is given and dumps it back; we send it too so a
/// rule read back compares equal to the rule we rendered.
pub const NAT_F_MAP_IPS: u32 = 0x1;
pub const NAT_F_PROTO_SPECIFIED: u32 = 0x2;
pub const NAT_F_PROTO_RANDOM: u32 = 0x4;
pub const NAT_F_PERSISTENT: u32 = 0x8;
pub const NAT_F_PROTO_RANDOM_FULLY: u32 = 0x10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RejectKind {
    /// ICMP (v4) or ICMPv6 unreachable with this code, depending on the table family.
    IcmpUnreach(u8),
    TcpReset,
    /// Family-independent ICMPx code (inet tables).
    IcmpxUnreach(u8),
}

/// ICMP port unreachable (v4 code 3); ICMPv6's is 4; icmpx's is 1.
pub const ICMP_PORT_UNREACH: u8 = 3;
pub const ICMPV6_PORT_UNREACH: u8 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DynsetOp {
    Add,
    Update,
}

/// `fib` lookups: which address to look up, what to return.
pub const FIB_F_SADDR: u32 = 1;
pub const FIB_F_DADDR: u32 = 2;
pub const FIB_F_MARK: u32 = 4;
pub const FIB_F_IIF: u32 = 8;
pub const FIB_F_OIF: u32 = 16;
pub const FIB_RESULT_OIF: u32 = 1;
pub const FIB_RESULT_ADDRTYPE: u32 = 3;
/// `RTN_LOCAL`: what `fib daddr type local` compares the address type to.
pub const RTN_LOCAL: u32 = 2;

/// One nf_tables expression, as the kernel knows it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Expr {
    Payload {
        base: PayloadBase,
        offset: u32,
        len: u32,
        dreg: u32,
    },
    Meta {
        key: MetaKey,
        dreg: u32,
    },
    MetaSet {
        key: MetaKey,
        sreg: u32,
    },
    Cmp {
        sreg: u32,
        op: CmpOp,
        data: Vec<u8>,
    },
    /// `dreg = (sreg & mask) ^ xor` over `len` bytes.
    Bitwise {
        sreg: u32,
        dreg: u32,
        len: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    Immediate {
        dreg: u32,
        data: Vec<u8>,
    },
    /// A verdict: immediate into the verdict register.
    Verdict(Verdict),
    /// Set membership (`dreg` None) or map lookup into `dreg` (REG_VERDICT for a verdict map).
    Lookup {
        set: String,
        sreg: u32,
        dreg: Option<u32>,
        invert: bool,
    },
    Numgen {
        dreg: u32,
        modulus: u32,
        random: bool,
        offset: u32,
    },
    Dynset {
        set: String,
        op: DynsetOp,
        sreg_key: u32,
        sreg_data: Option<u32>,
        timeout_ms: Option<u64>,
    },
    Nat {
        kind: NatKind,
        family: Family,
        reg_addr: Option<u32>,
        reg_proto: Option<u32>,
        flags: u32,
    },
    Masq {
        flags: u32,
    },
    /// `redirect to :port` (the port from `reg_proto`): DNAT to the primary address of the incoming
    /// interface (127.0.0.1 / ::1 for local traffic).
    Redir {
        reg_proto: Option<u32>,
        flags: u32,
    },
    Reject(RejectKind),
    Ct {
        key: CtKey,
        dreg: u32,
    },
    /// A ct key of the original direction (`ct original ...`).
    CtOriginal {
        key: CtKey,
        dreg: u32,
    },
    /// Membership in a constant set that belongs to this rule alone (`meta l4proto { tcp, udp, sctp }`): nft
    /// writes such literal sets as anonymous sets created in the same batch as the rule.
    LookupAnon {
        set: AnonSet,
        sreg: u32,
    },
    Fib {
        flags: u32,
        result: u32,
        dreg: u32,
    },
    Counter,
}

impl Expr {
    /// The kernel's expression name.
    pub fn kernel_name(&self) -> &'static str {
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
    pub key: DataType,
    pub key_typeof: TypeofExpr,
    pub elements: Vec<ElementBytes>,
}

/// Name prefix the kernel gives anonymous sets (`__set%d`, the number chosen by the kernel).
pub const ANON_SET_NAME: &str = "__set%d";

/// A rule: the expressions in order, and an optional comment (kept in the rule's userdata as nft does).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub exprs: Vec<Expr>,
    pub comment: Option<String>,
}

/// A chain and its rules.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChainState {
    pub chain: Chain,
    pub rules: Vec<Rule>,
}

/// A set or map and its elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetState {
    pub set: Set,
    pub elements: BTreeSet<Element>,
}

/// The whole content of one of our tables, keyed by name so two states diff cheaply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableState {
    pub family: Family,
    pub name: String,
    /// NFT_TABLE_F_* flags: ours are always 0; read back, `TABLE_F_DORMANT` means every hook of the table is
    /// detached (all its rules silently off).
    pub flags: u32,
    pub sets: BTreeMap<String, SetState>,
    pub chains: BTreeMap<String, ChainState>,
}

impl TableState {
    pub fn new(family: Family, name: impl Into<String>) -> Self {
        TableState {
            family,
            name: name.into(),
            flags: 0,
            sets: BTreeMap::new(),
            chains: BTreeMap::new(),
        }
    }

    pub fn add_chain(&mut self, chain: Chain) -> &mut ChainState {
        let name = chain.name.clone();
        self.chains.entry(name).or_insert(ChainState {
            chain,
            rules: Vec::new(),
        })
    }

    pub fn chain_mut(&mut self, name: &str) -> &mut ChainState {
        self.chains
            .get_mut(name)
            .unwrap_or_else(|| panic!("chain {name} not declared"))
    }

    pub fn add_set(&mut self, set: Set) -> &mut SetState {
        let name = set.name.clone();
        self.sets.entry(name).or_insert(SetState {
            set,
            elements: BTreeSet::new(),
        })
    }

    pub fn set_mut(&mut self, name: &str) -> &mut SetState {
        self.sets
            .get_mut(name)
            .unwrap_or_else(|| panic!("set {name} not declared"))
    }
}
