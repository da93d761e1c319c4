//! ctnetlink messages, encoded and decoded without I/O: the dump request (with an optional kernel-side
//! filter), the exact-tuple DELETE, the filtered DELETE, and NEW (creating entries, for tests and benchmarks).
//!
//! A DELETE without a tuple flushes the whole conntrack table. Every DELETE this module can encode carries
//! `CTA_TUPLE_ORIG`, by construction: [`encode_delete`] takes a complete dumped [`Entry`], and
//! [`encode_filtered_delete`] takes a [`DeleteFilter`] whose constructor demands a destination address and a
//! protocol. [`delete_has_tuple`] checks encoded bytes (the socket refuses to send a DELETE without one).
//! Kernels before 6.12 answer a DELETE that has a partial tuple with EINVAL (they take the exact-tuple path,
//! which needs the whole tuple), so even the filtered form can never become a flush there.

use nftkube_netlink::attr::{messages, Attr, Attrs};
use nftkube_netlink::{MsgBuilder, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The ctnetlink subsystem of nfnetlink.
pub(crate) const NFNL_SUBSYS_CTNETLINK: u16 = 1;
/// ctnetlink: create an entry.
pub(crate) const IPCTNL_MSG_CT_NEW: u16 = 0;
/// ctnetlink: get or dump entries.
pub(crate) const IPCTNL_MSG_CT_GET: u16 = 1;
/// ctnetlink: delete entries.
pub(crate) const IPCTNL_MSG_CT_DELETE: u16 = 2;

/// IPv4 (nfgenmsg family).
pub const AF_INET: u8 = 2;
/// IPv6 (nfgenmsg family).
pub(crate) const AF_INET6: u8 = 10;

// enum ctattr_type
/// The original direction's tuple.
pub(crate) const CTA_TUPLE_ORIG: u16 = 1;
/// The reply direction's tuple.
pub(crate) const CTA_TUPLE_REPLY: u16 = 2;
/// The entry's status bits.
pub(crate) const CTA_STATUS: u16 = 3;
/// Seconds left before the entry expires.
pub(crate) const CTA_TIMEOUT: u16 = 7;
/// The entry's mark.
pub(crate) const CTA_MARK: u16 = 8;
/// The entry's id.
pub(crate) const CTA_ID: u16 = 12;
/// The entry's zone (both directions).
pub(crate) const CTA_ZONE: u16 = 18;
/// A filter for dumps and deletes (5.8+).
pub(crate) const CTA_FILTER: u16 = 25;
// enum ctattr_tuple
/// Tuple: the addresses.
pub(crate) const CTA_TUPLE_IP: u16 = 1;
/// Tuple: protocol and ports.
pub(crate) const CTA_TUPLE_PROTO: u16 = 2;
/// Tuple: a zone of this direction only.
pub(crate) const CTA_TUPLE_ZONE: u16 = 3;
// enum ctattr_ip
/// IPv4 source address.
pub(crate) const CTA_IP_V4_SRC: u16 = 1;
/// IPv4 destination address.
pub(crate) const CTA_IP_V4_DST: u16 = 2;
/// IPv6 source address.
pub(crate) const CTA_IP_V6_SRC: u16 = 3;
/// IPv6 destination address.
pub(crate) const CTA_IP_V6_DST: u16 = 4;
// enum ctattr_l4proto
/// Layer-4 protocol number.
pub(crate) const CTA_PROTO_NUM: u16 = 1;
/// Source port.
pub(crate) const CTA_PROTO_SRC_PORT: u16 = 2;
/// Destination port.
pub(crate) const CTA_PROTO_DST_PORT: u16 = 3;
// enum ctattr_filter
/// Filter: which fields of the original tuple must match.
pub(crate) const CTA_FILTER_ORIG_FLAGS: u16 = 1;
// CTA_FILTER_F_* (net/netfilter/nf_internals.h): which fields of the filter tuple count.
/// Filter field: destination address.
pub(crate) const CTA_FILTER_F_IP_DST: u32 = 1 << 1;
/// Filter field: protocol number.
pub(crate) const CTA_FILTER_F_PROTO_NUM: u32 = 1 << 3;
/// Filter field: destination port.
pub(crate) const CTA_FILTER_F_PROTO_DST_PORT: u32 = 1 << 5;

/// TCP.
pub const IPPROTO_TCP: u8 = 6;
/// UDP.
pub const IPPROTO_UDP: u8 = 17;
/// SCTP.
pub(crate) const IPPROTO_SCTP: u8 = 132;

/// The netlink message type of a ctnetlink message.
pub(crate) const fn msg_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_CTNETLINK << 8) | msg
}

/// The address family byte of `nfgenmsg` for an address.
pub(crate) fn family_of(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => AF_INET,
        IpAddr::V6(_) => AF_INET6,
    }
}

fn nfgenmsg(family: u8) -> [u8; 4] {
    // family, version NFNETLINK_V0, res_id 0 (big-endian u16)
    [family, 0, 0, 0]
}

/// One direction of a connection: addresses, layer-4 protocol and ports (0 for protocols without ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Layer-4 protocol number.
    pub proto: u8,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
}

impl Tuple {
    /// A tuple (note the order: each address with its port).
    pub fn new(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, proto: u8) -> Tuple {
        Tuple {
            src,
            dst,
            proto,
            sport,
            dport,
        }
    }

    /// The tuple of the other direction for a connection without NAT.
    pub fn inverse(&self) -> Tuple {
        Tuple {
            src: self.dst,
            dst: self.src,
            proto: self.proto,
            sport: self.dport,
            dport: self.sport,
        }
    }

    /// The address family (AF_INET or AF_INET6).
    pub fn family(&self) -> u8 {
        family_of(&self.src)
    }
}

impl std::fmt::Display for Tuple {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sock = |ip: &IpAddr, p: u16| match ip {
            IpAddr::V4(a) => format!("{a}:{p}"),
            IpAddr::V6(a) => format!("[{a}]:{p}"),
        };
        write!(
            f,
            "proto {} {} -> {}",
            self.proto,
            sock(&self.src, self.sport),
            sock(&self.dst, self.dport)
        )
    }
}

/// Where an entry's zone was reported, so a delete names it the same way the kernel will look it up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ZoneScope {
    /// Zone 0 (the default zone), or a zone that applies to the reply direction only: nothing to send.
    #[default]
    None,
    /// `CTA_ZONE`: the zone applies to both directions.
    Both(u16),
    /// `CTA_TUPLE_ZONE` inside the original tuple: the zone applies to the original direction only.
    Orig(u16),
}

impl ZoneScope {
    /// The zone's id (0: the default zone).
    pub fn id(&self) -> u16 {
        match self {
            ZoneScope::None => 0,
            ZoneScope::Both(z) | ZoneScope::Orig(z) => *z,
        }
    }
}

/// One conntrack entry as a dump reports it (the fields cleanup needs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Entry {
    /// The original direction.
    pub orig: Tuple,
    /// The reply direction (after NAT, its source is the endpoint).
    pub reply: Tuple,
    /// The entry's zone, as reported.
    pub zone: ZoneScope,
    /// The kernel's id of the entry (`CTA_ID`): a hash of the entry's address and original tuple. A delete
    /// carrying it fails with ENOENT if the tuple now belongs to a newer entry allocated elsewhere (one that
    /// reuses the freed slot has the same id, so this narrows the race, it does not close it).
    pub id: Option<u32>,
    /// The entry's mark.
    pub mark: u32,
    /// The entry's status bits (IPS_*).
    pub status: u32,
    /// Seconds left.
    pub timeout: u32,
}

fn put_ip(m: &mut MsgBuilder, v4: u16, v6: u16, ip: &IpAddr) {
    match ip {
        IpAddr::V4(a) => m.attr(v4, &a.octets()),
        IpAddr::V6(a) => m.attr(v6, &a.octets()),
    };
}

/// `CTA_TUPLE_*` content: CTA_TUPLE_IP { src, dst }, CTA_TUPLE_PROTO { num, sport, dport }.
fn put_tuple(m: &mut MsgBuilder, t: &Tuple) {
    m.nested(CTA_TUPLE_IP, |m| {
        put_ip(m, CTA_IP_V4_SRC, CTA_IP_V6_SRC, &t.src);
        put_ip(m, CTA_IP_V4_DST, CTA_IP_V6_DST, &t.dst);
    });
    m.nested(CTA_TUPLE_PROTO, |m| {
        m.attr_u8(CTA_PROTO_NUM, t.proto);
        if has_ports(t.proto) {
            m.attr(CTA_PROTO_SRC_PORT, &t.sport.to_be_bytes());
            m.attr(CTA_PROTO_DST_PORT, &t.dport.to_be_bytes());
        }
    });
}

/// Protocols whose tuples carry ports (the kernel's nf_ct_port_nlattr_to_tuple users).
fn has_ports(proto: u8) -> bool {
    matches!(
        proto,
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP | 33 /* DCCP */ | 136 /* UDPLITE */
    )
}

/// What a dump asks the kernel to leave out. The l3 family (nfgenmsg) is honoured by every kernel; `proto`
/// and `dst` go into `CTA_FILTER` (Linux 5.8+; older kernels ignore it and send everything, which the caller
/// filters again in user space anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DumpFilter {
    /// The address family (AF_INET, AF_INET6).
    pub family: u8,
    /// Only this layer-4 protocol.
    pub proto: Option<u8>,
    /// Original destination address (needs `proto`: the kernel parses the tuple filter per protocol).
    pub dst: Option<IpAddr>,
}

impl DumpFilter {
    /// Every entry of a family.
    pub fn family(family: u8) -> DumpFilter {
        DumpFilter {
            family,
            proto: None,
            dst: None,
        }
    }
    /// The entries of one protocol in a family.
    pub fn proto(family: u8, proto: u8) -> DumpFilter {
        DumpFilter {
            family,
            proto: Some(proto),
            dst: None,
        }
    }
    /// The entries of one protocol sent to `dst`.
    pub fn dst(dst: IpAddr, proto: u8) -> DumpFilter {
        DumpFilter {
            family: family_of(&dst),
            proto: Some(proto),
            dst: Some(dst),
        }
    }
    /// Whether a dumped entry passes this filter (what the kernel should have done).
    pub fn matches(&self, e: &Entry) -> bool {
        e.orig.family() == self.family
            && self.proto.is_none_or(|p| e.orig.proto == p)
            && self.dst.is_none_or(|d| e.orig.dst == d)
    }
}

/// `IPCTNL_MSG_CT_GET` with NLM_F_DUMP: every entry of the filter's family, optionally filtered in the kernel.
pub(crate) fn encode_dump(filter: &DumpFilter, seq: u32) -> Vec<u8> {
    let mut m = MsgBuilder::new(msg_type(IPCTNL_MSG_CT_GET), NLM_F_REQUEST | NLM_F_DUMP, seq);
    m.raw(&nfgenmsg(filter.family));
    if let Some(proto) = filter.proto {
        let mut flags = CTA_FILTER_F_PROTO_NUM;
        m.nested(CTA_TUPLE_ORIG, |m| {
            if let Some(dst) = &filter.dst {
                flags |= CTA_FILTER_F_IP_DST;
                m.nested(CTA_TUPLE_IP, |m| {
                    put_ip(m, CTA_IP_V4_DST, CTA_IP_V6_DST, dst)
                });
            }
            m.nested(CTA_TUPLE_PROTO, |m| {
                m.attr_u8(CTA_PROTO_NUM, proto);
            });
        });
        m.nested(CTA_FILTER, |m| {
            m.attr_u32(CTA_FILTER_ORIG_FLAGS, flags);
        });
    }
    // A few fixed-size attributes: far below any length limit.
    m.finish()
        .expect("a conntrack message is a few hundred bytes")
}

/// `IPCTNL_MSG_CT_DELETE` of exactly one entry: its original tuple, its zone, and its id (so that an entry
/// that replaced it under the same tuple after the dump is usually left alone, see [`Entry::id`]). Asks for an
/// ACK when `ack`.
pub(crate) fn encode_delete(e: &Entry, seq: u32, ack: bool) -> Vec<u8> {
    let flags = NLM_F_REQUEST | if ack { NLM_F_ACK } else { 0 };
    let mut m = MsgBuilder::new(msg_type(IPCTNL_MSG_CT_DELETE), flags, seq);
    m.raw(&nfgenmsg(e.orig.family()));
    m.nested(CTA_TUPLE_ORIG, |m| {
        put_tuple(m, &e.orig);
        if let ZoneScope::Orig(z) = e.zone {
            m.attr(CTA_TUPLE_ZONE, &z.to_be_bytes());
        }
    });
    if let ZoneScope::Both(z) = e.zone {
        m.attr(CTA_ZONE, &z.to_be_bytes());
    }
    if let Some(id) = e.id {
        m.attr_be32(CTA_ID, id);
    }
    // A few fixed-size attributes: far below any length limit.
    m.finish()
        .expect("a conntrack message is a few hundred bytes")
}

/// A kernel-side filtered delete: every entry, in every zone (the kernel's filter does not look at zones),
/// whose original tuple has this destination address, protocol and, optionally, destination port. Only for
/// kernels a probe showed honour it (6.12+; IPv6 is broken on 6.18, see [`super::socket::Features`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeleteFilter {
    dst: IpAddr,
    proto: u8,
    dport: Option<u16>,
}

impl DeleteFilter {
    /// All flows of `proto` to `dst`. The destination address is mandatory: it is what keeps the message a
    /// tuple-carrying DELETE.
    pub(crate) fn to_ip(dst: IpAddr, proto: u8) -> DeleteFilter {
        DeleteFilter {
            dst,
            proto,
            dport: None,
        }
    }
    /// All flows of `proto` to `dst:dport`.
    pub(crate) fn to_socket(dst: IpAddr, dport: u16, proto: u8) -> DeleteFilter {
        DeleteFilter {
            dst,
            proto,
            dport: Some(dport),
        }
    }
    #[cfg(test)]
    /// Whether the filter selects the entry (by its original direction), as the kernel would.
    pub(crate) fn matches(&self, e: &Entry) -> bool {
        e.orig.dst == self.dst
            && e.orig.proto == self.proto
            && self.dport.is_none_or(|p| e.orig.dport == p)
    }
}

/// `IPCTNL_MSG_CT_DELETE` with `CTA_FILTER` and a partial original tuple (Linux 6.12+: a filtered flush).
/// Always carries `CTA_TUPLE_ORIG`.
pub(crate) fn encode_filtered_delete(f: &DeleteFilter, seq: u32) -> Vec<u8> {
    let mut m = MsgBuilder::new(
        msg_type(IPCTNL_MSG_CT_DELETE),
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
    );
    m.raw(&nfgenmsg(family_of(&f.dst)));
    let mut flags = CTA_FILTER_F_IP_DST | CTA_FILTER_F_PROTO_NUM;
    m.nested(CTA_TUPLE_ORIG, |m| {
        m.nested(CTA_TUPLE_IP, |m| {
            put_ip(m, CTA_IP_V4_DST, CTA_IP_V6_DST, &f.dst)
        });
        m.nested(CTA_TUPLE_PROTO, |m| {
            m.attr_u8(CTA_PROTO_NUM, f.proto);
            if let Some(p) = f.dport {
                flags |= CTA_FILTER_F_PROTO_DST_PORT;
                m.attr(CTA_PROTO_DST_PORT, &p.to_be_bytes());
            }
        });
    });
    m.nested(CTA_FILTER, |m| {
        m.attr_u32(CTA_FILTER_ORIG_FLAGS, flags);
    });
    // A few fixed-size attributes: far below any length limit.
    m.finish()
        .expect("a conntrack message is a few hundred bytes")
}

/// An entry to create with `IPCTNL_MSG_CT_NEW` (tests and benchmarks fill a table this way). `reply` may
/// differ from `orig.inverse()` to imitate a NATed connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewEntry {
    /// The original direction.
    pub orig: Tuple,
    /// The reply direction.
    pub reply: Tuple,
    /// Seconds before it expires.
    pub timeout_s: u32,
    /// Its mark.
    pub mark: u32,
    /// Its zone (both directions; 0: none).
    pub zone: u16,
}

impl NewEntry {
    /// A connection without NAT.
    pub fn plain(orig: Tuple, timeout_s: u32) -> NewEntry {
        NewEntry {
            orig,
            reply: orig.inverse(),
            timeout_s,
            mark: 0,
            zone: 0,
        }
    }
}

/// `IPCTNL_MSG_CT_NEW` with NLM_F_CREATE | NLM_F_EXCL: fails with EEXIST if the tuple is taken.
pub fn encode_new(e: &NewEntry, seq: u32, ack: bool) -> Vec<u8> {
    let flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL | if ack { NLM_F_ACK } else { 0 };
    let mut m = MsgBuilder::new(msg_type(IPCTNL_MSG_CT_NEW), flags, seq);
    m.raw(&nfgenmsg(e.orig.family()));
    m.nested(CTA_TUPLE_ORIG, |m| put_tuple(m, &e.orig));
    m.nested(CTA_TUPLE_REPLY, |m| put_tuple(m, &e.reply));
    m.attr_be32(CTA_TIMEOUT, e.timeout_s);
    if e.mark != 0 {
        m.attr_be32(CTA_MARK, e.mark);
    }
    if e.zone != 0 {
        m.attr(CTA_ZONE, &e.zone.to_be_bytes());
    }
    // A few fixed-size attributes: far below any length limit.
    m.finish()
        .expect("a conntrack message is a few hundred bytes")
}

fn be16(a: &Attr<'_>) -> Option<u16> {
    Some(u16::from_be_bytes(a.payload.get(..2)?.try_into().ok()?))
}

fn ip_of(a: &Attr<'_>) -> Option<IpAddr> {
    match a.payload.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::from(
            <[u8; 4]>::try_from(a.payload).ok()?,
        ))),
        16 => Some(IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(a.payload).ok()?,
        ))),
        _ => None,
    }
}

/// Decodes a `CTA_TUPLE_*` payload; also returns its `CTA_TUPLE_ZONE`, if any. One pass over each level
/// (a dump of a big table decodes every entry).
fn decode_tuple(attrs: Attrs<'_>) -> Option<(Tuple, Option<u16>)> {
    let (mut src, mut dst, mut proto) = (None, None, None);
    let (mut sport, mut dport, mut zone) = (0, 0, None);
    for a in attrs.iter() {
        match a.kind {
            CTA_TUPLE_IP => {
                for ip in a.nested().iter() {
                    match ip.kind {
                        CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = ip_of(&ip),
                        CTA_IP_V4_DST | CTA_IP_V6_DST => dst = ip_of(&ip),
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for p in a.nested().iter() {
                    match p.kind {
                        CTA_PROTO_NUM => proto = p.u8(),
                        CTA_PROTO_SRC_PORT => sport = be16(&p).unwrap_or(0),
                        CTA_PROTO_DST_PORT => dport = be16(&p).unwrap_or(0),
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_ZONE => zone = be16(&a),
            _ => {}
        }
    }
    Some((
        Tuple {
            src: src?,
            dst: dst?,
            proto: proto?,
            sport,
            dport,
        },
        zone,
    ))
}

/// Decodes the payload (nfgenmsg + attributes) of one dumped conntrack message. `None` if it lacks a tuple.
pub fn decode_entry(payload: &[u8]) -> Option<Entry> {
    let (mut orig, mut reply, mut zone_attr) = (None, None, None);
    let (mut id, mut mark, mut status, mut timeout) = (None, 0, 0, 0);
    for a in Attrs(payload.get(4..)?).iter() {
        match a.kind {
            CTA_TUPLE_ORIG => orig = decode_tuple(a.nested()),
            CTA_TUPLE_REPLY => reply = decode_tuple(a.nested()),
            CTA_ZONE => zone_attr = be16(&a),
            CTA_ID => id = a.be32(),
            CTA_MARK => mark = a.be32().unwrap_or(0),
            CTA_STATUS => status = a.be32().unwrap_or(0),
            CTA_TIMEOUT => timeout = a.be32().unwrap_or(0),
            _ => {}
        }
    }
    let (orig, orig_zone) = orig?;
    let (reply, _) = reply?;
    let zone = match (zone_attr, orig_zone) {
        (Some(z), _) if z != 0 => ZoneScope::Both(z),
        (_, Some(z)) if z != 0 => ZoneScope::Orig(z),
        _ => ZoneScope::None,
    };
    Some(Entry {
        orig,
        reply,
        zone,
        id,
        mark,
        status,
        timeout,
    })
}

/// True unless `bytes` holds a ctnetlink DELETE without `CTA_TUPLE_ORIG` / `CTA_TUPLE_REPLY` (a flush of the
/// whole table) or cannot be parsed. Checked on everything the cleaner sends.
pub(crate) fn delete_has_tuple(bytes: &[u8]) -> bool {
    let mut seen = 0usize;
    let mut total = 0usize;
    for m in messages(bytes) {
        total += nftkube_netlink::align4(16 + m.payload.len());
        seen += 1;
        if m.msg_type != msg_type(IPCTNL_MSG_CT_DELETE) {
            continue;
        }
        let Some(attrs) = m.payload.get(4..).map(Attrs) else {
            return false;
        };
        if attrs.get(CTA_TUPLE_ORIG).is_none() && attrs.get(CTA_TUPLE_REPLY).is_none() {
            return false;
        }
    }
    // Every byte belongs to a parsed message (a truncated tail could hide anything).
    seen > 0 && total >= bytes.len()
}
