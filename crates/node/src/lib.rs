//! What the node itself has: its addresses and which of them are primary, read over rtnetlink in the calling
//! thread's network namespace. NodePorts are served on these (kube-proxy's `--nodeport-addresses`).
#![forbid(unsafe_code)]

use netlink_packet_core::{DecodeError, Parseable, ParseableParametrized};
use netlink_packet_route::address::{
    AddressAttribute, AddressHeader, AddressMessage, AddressScope,
};
use netlink_packet_route::route::{RouteAttribute, RouteHeader, RouteLwEnCapType, RouteMessage};
use netlink_packet_route::RouteNetlinkMessage;
pub use nftkube_model::NodeAddress;
use nftkube_netlink::route::{attributes, RouteSocket, RTM_NEWADDR, RTM_NEWROUTE};
use std::io;

// The attributes a node read decodes (linux/if_addr.h, rtnetlink.h); see `netlink::route` for why not all.
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_MULTIPATH: u16 = 9;
const RTA_TABLE: u16 = 15;
/// `struct ifaddrmsg` and `struct rtmsg`, before the attributes.
const IFADDRMSG_LEN: usize = 8;
const RTMSG_LEN: usize = 12;

/// The answers of a dump: (message type, payload).
fn dump(what: &str, request: RouteNetlinkMessage) -> io::Result<Vec<(u16, Vec<u8>)>> {
    RouteSocket::open()?
        .dump(what, request)
        .map_err(|e| io::Error::other(format!("rtnetlink dump: {e}")))
}

/// Decodes what `f` makes of each answer; one that does not decode is skipped with a warning rather than
/// failing the whole read: one exotic route or address must not freeze the NodePort addresses at their
/// last value.
fn decode_each<T>(
    what: &str,
    answers: &[(u16, Vec<u8>)],
    f: impl Fn(u16, &[u8]) -> Result<Option<T>, DecodeError>,
) -> Vec<T> {
    answers
        .iter()
        .filter_map(|(t, p)| match f(*t, p) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(what, "skipping an answer that does not decode: {e}");
                None
            }
        })
        .collect()
}

/// One read of the node: its addresses and the links its default routes leave through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeView {
    /// Every global address on the node's links.
    pub addresses: Vec<NodeAddress>,
    /// The links the main table's default routes leave through (the primary links).
    pub primary_links: Vec<u32>,
}

/// Reading the node over rtnetlink failed; which of the two dumps did.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("reading the node's addresses over rtnetlink: {0}")]
    /// The address dump failed.
    Addresses(io::Error),
    #[error("reading the node's default routes over rtnetlink: {0}")]
    /// The route dump failed.
    Routes(io::Error),
}

/// Reads the node's addresses and its primary links, in the calling thread's network namespace.
pub fn read() -> Result<NodeView, ReadError> {
    Ok(NodeView {
        addresses: addresses().map_err(ReadError::Addresses)?,
        primary_links: default_route_links().map_err(ReadError::Routes)?,
    })
}

/// Global-scope addresses of every link (no loopback, no link-local).
pub fn addresses() -> io::Result<Vec<NodeAddress>> {
    let request = RouteNetlinkMessage::GetAddress(AddressMessage::default());
    Ok(global_addresses(&dump("dumping addresses", request)?))
}

/// The global-scope, non-loopback addresses among an address dump's answers.
fn global_addresses(answers: &[(u16, Vec<u8>)]) -> Vec<NodeAddress> {
    decode_each("reading addresses", answers, |t, p| {
        if t != RTM_NEWADDR {
            return Ok(None);
        }
        let header = AddressHeader::parse(p)?;
        if matches!(header.scope, AddressScope::Host | AddressScope::Link) {
            return Ok(None);
        }
        // IFA_LOCAL is the address itself; IFA_ADDRESS is the peer's on point-to-point links. Only the one
        // used is decoded.
        let (mut local, mut address) = (None, None);
        for nla in attributes(p, IFADDRMSG_LEN, &[IFA_LOCAL, IFA_ADDRESS]) {
            let nla = nla?;
            match nla.kind() {
                IFA_LOCAL => local = Some(nla),
                _ => address = Some(nla),
            }
        }
        let ip = match local.or(address) {
            Some(nla) => match AddressAttribute::parse(&nla)? {
                AddressAttribute::Local(ip) | AddressAttribute::Address(ip) => Some(ip),
                _ => None,
            },
            None => None,
        };
        Ok(ip.filter(|ip| !ip.is_loopback()).map(|ip| NodeAddress {
            ifindex: header.index,
            ip,
        }))
    })
}

/// Links that carry a default route in the main table: the node's primary interfaces.
pub(crate) fn default_route_links() -> io::Result<Vec<u32>> {
    let request = RouteNetlinkMessage::GetRoute(RouteMessage::default());
    Ok(links_of_default_routes(&dump("dumping routes", request)?))
}

/// The links the default routes of the main table leave through, each once, from a route dump's answers.
fn links_of_default_routes(answers: &[(u16, Vec<u8>)]) -> Vec<u32> {
    let per_route = decode_each("reading routes", answers, |t, p| {
        if t != RTM_NEWROUTE {
            return Ok(None);
        }
        let header = RouteHeader::parse(p)?;
        if header.destination_prefix_length != 0 {
            return Ok(None);
        }
        // rtm_table has only 8 bits, so RTA_TABLE overrides it when present.
        let mut table = header.table as u32;
        let mut links = Vec::new();
        let param = (header.address_family, header.kind, RouteLwEnCapType::None);
        for nla in attributes(p, RTMSG_LEN, &[RTA_TABLE, RTA_OIF, RTA_MULTIPATH]) {
            match RouteAttribute::parse_with_param(&nla?, param)? {
                RouteAttribute::Table(t) => table = t,
                // A single next hop; a route with several (ECMP) lists them in RTA_MULTIPATH instead. A next
                // hop the kernel marks dead or link-down still counts: its link is an uplink all the same,
                // and NodePorts should not come and go with a cable's carrier.
                RouteAttribute::Oif(i) => links.push(i),
                RouteAttribute::MultiPath(hops) => {
                    links.extend(hops.iter().map(|h| h.interface_index))
                }
                _ => {}
            }
        }
        Ok((table == RouteHeader::RT_TABLE_MAIN as u32).then_some(links))
    });
    let mut out = Vec::new();
    for link in per_route.into_iter().flatten() {
        if !out.contains(&link) {
            out.push(link);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_netlink::{align4, MsgBuilder};

    const RT_TABLE_MAIN: u8 = 254;
    const RTNH_LEN: usize = 8;

    fn a(ifindex: u32, ip: &str) -> NodeAddress {
        NodeAddress {
            ifindex,
            ip: ip.parse().unwrap(),
        }
    }

    /// A message as a dump returns it (type, payload): the fixed header `header`, then the attributes `f`
    /// writes. Built byte by byte, independently of netlink-packet-route, whose parsers then decode it.
    fn raw(msg_type: u16, header: &[u8], f: impl FnOnce(&mut MsgBuilder)) -> (u16, Vec<u8>) {
        let mut m = MsgBuilder::new(msg_type, 0, 0);
        m.raw(header);
        f(&mut m);
        let bytes = m.finish().unwrap();
        (msg_type, bytes[16..].to_vec())
    }

    /// `struct rtmsg` (family, dst_len, src_len, tos, table, protocol boot, scope, type unicast, flags).
    fn route(
        family: u8,
        dst_len: u8,
        table: u8,
        f: impl FnOnce(&mut MsgBuilder),
    ) -> (u16, Vec<u8>) {
        raw(
            RTM_NEWROUTE,
            &[family, dst_len, 0, 0, table, 3, 0, 1, 0, 0, 0, 0],
            f,
        )
    }

    /// One `struct rtnexthop` with its RTA_GATEWAY, as in an RTA_MULTIPATH payload.
    fn next_hop(ifindex: u32, gateway: &[u8]) -> Vec<u8> {
        let gw_attr_len = 4 + gateway.len();
        let len = RTNH_LEN + gw_attr_len;
        let mut b = Vec::new();
        b.extend_from_slice(&(len as u16).to_ne_bytes());
        b.extend_from_slice(&[0, 0]); // flags, hops (weight - 1)
        b.extend_from_slice(&ifindex.to_ne_bytes());
        b.extend_from_slice(&(gw_attr_len as u16).to_ne_bytes());
        b.extend_from_slice(&5u16.to_ne_bytes()); // RTA_GATEWAY
        b.extend_from_slice(gateway);
        b.resize(align4(b.len()), 0);
        b
    }

    const V4: u8 = libc::AF_INET as u8;
    const V6: u8 = libc::AF_INET6 as u8;

    /// The two dump requests, against bytes written field by field: `ip address show` and `ip route show
    /// table all` (AF_UNSPEC, an all-zero `struct ifaddrmsg` / `struct rtmsg`).
    #[test]
    fn dump_requests_are_what_ip_sends() {
        use nftkube_netlink::route::encode;
        use nftkube_netlink::{NLM_F_DUMP, NLM_F_REQUEST};
        let flags = NLM_F_REQUEST | NLM_F_DUMP;
        for (request, msg_type, header_len) in [
            (
                RouteNetlinkMessage::GetAddress(AddressMessage::default()),
                22,
                8,
            ),
            (
                RouteNetlinkMessage::GetRoute(RouteMessage::default()),
                26,
                12,
            ),
        ] {
            let mut want = MsgBuilder::new(msg_type, flags, 9);
            want.raw(&vec![0u8; header_len]);
            assert_eq!(
                encode(request, flags, 9),
                want.finish().unwrap(),
                "{msg_type}"
            );
        }
    }

    #[test]
    fn multipath_default_routes_make_every_next_hop_link_primary() {
        let v4_hops = [
            next_hop(2, &[192, 168, 200, 2]),
            next_hop(7, &[192, 168, 201, 2]),
        ]
        .concat();
        let gw6 = |last| {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = last;
            g
        };
        let v6_hops = [next_hop(7, &gw6(1)), next_hop(9, &gw6(2))].concat();
        let msgs = [
            route(V4, 0, RT_TABLE_MAIN, |m| {
                m.attr_u32(RTA_TABLE, RT_TABLE_MAIN as u32);
                m.attr(RTA_MULTIPATH, &v4_hops);
            }),
            route(V6, 0, RT_TABLE_MAIN, |m| {
                m.attr_u32(RTA_TABLE, RT_TABLE_MAIN as u32);
                m.attr(RTA_MULTIPATH, &v6_hops);
            }),
        ];
        assert_eq!(links_of_default_routes(&msgs), vec![2, 7, 9]);
    }

    #[test]
    fn only_default_routes_of_the_main_table_count() {
        let msgs = [
            // A single-path default route: RTA_OIF.
            route(V4, 0, RT_TABLE_MAIN, |m| {
                m.attr_u32(RTA_OIF, 3);
            }),
            // Not a default route.
            route(V4, 24, RT_TABLE_MAIN, |m| {
                m.attr_u32(RTA_OIF, 4);
            }),
            // Another table, said by RTA_TABLE (rtm_table says RT_TABLE_COMPAT for tables above 255).
            route(V4, 0, 252, |m| {
                m.attr_u32(RTA_TABLE, 1000);
                m.attr(RTA_MULTIPATH, &next_hop(5, &[10, 0, 0, 1]));
            }),
            // Not a route message.
            raw(RTM_NEWADDR, &[V4, 24, 0, 0, 6, 0, 0, 0], |m| {
                m.attr(IFA_LOCAL, &[10, 0, 0, 1]);
            }),
        ];
        assert_eq!(links_of_default_routes(&msgs), vec![3]);
    }

    #[test]
    fn undecodable_routes_are_skipped_and_the_others_still_count() {
        let whole = next_hop(2, &[192, 168, 200, 2]);
        // A next hop whose length runs beyond the payload, one shorter than its own header.
        let mut too_long = next_hop(3, &[192, 168, 201, 2]);
        too_long[0..2].copy_from_slice(&200u16.to_ne_bytes());
        let mut too_short = next_hop(3, &[192, 168, 201, 2]);
        too_short[0..2].copy_from_slice(&4u16.to_ne_bytes());
        for tail in [too_long, too_short, vec![16, 0, 0, 0]] {
            let hops = [whole.clone(), tail].concat();
            let msgs = [
                route(V4, 0, RT_TABLE_MAIN, |m| {
                    m.attr(RTA_MULTIPATH, &hops);
                }),
                route(V6, 0, RT_TABLE_MAIN, |m| {
                    m.attr_u32(RTA_OIF, 9);
                }),
                // A truncated rtmsg.
                (RTM_NEWROUTE, vec![V4, 0, 0]),
            ];
            assert_eq!(links_of_default_routes(&msgs), vec![9]);
        }
    }

    #[test]
    fn addresses_are_global_and_not_loopback() {
        let addr = |family, scope, index: u32, f: &dyn Fn(&mut MsgBuilder)| {
            let mut header = vec![family, 24, 0, scope];
            header.extend_from_slice(&index.to_ne_bytes());
            raw(RTM_NEWADDR, &header, f)
        };
        let msgs = [
            addr(V4, 0, 2, &|m| {
                m.attr(IFA_LOCAL, &[192, 168, 200, 1]);
                m.attr(IFA_ADDRESS, &[192, 168, 200, 1]);
            }),
            // Point to point: IFA_LOCAL is ours, IFA_ADDRESS the peer's.
            addr(V4, 0, 4, &|m| {
                m.attr(IFA_LOCAL, &[10, 9, 0, 1]);
                m.attr(IFA_ADDRESS, &[10, 9, 0, 2]);
            }),
            // IPv6 carries IFA_ADDRESS only.
            addr(V6, 0, 2, &|m| {
                m.attr(
                    IFA_ADDRESS,
                    &"fd00:200::1"
                        .parse::<std::net::Ipv6Addr>()
                        .unwrap()
                        .octets(),
                );
            }),
            // Link-local and host scope, loopback.
            addr(V6, 253, 2, &|m| {
                m.attr(
                    IFA_ADDRESS,
                    &"fe80::1".parse::<std::net::Ipv6Addr>().unwrap().octets(),
                );
            }),
            addr(V4, 254, 1, &|m| {
                m.attr(IFA_LOCAL, &[127, 0, 0, 1]);
            }),
            addr(V4, 0, 1, &|m| {
                m.attr(IFA_LOCAL, &[127, 0, 0, 2]);
            }),
        ];
        assert_eq!(
            global_addresses(&msgs),
            vec![a(2, "192.168.200.1"), a(4, "10.9.0.1"), a(2, "fd00:200::1")]
        );
    }
}
