//! What the node itself has: its addresses and which of them are primary, read over rtnetlink in the calling
//! thread's network namespace. NodePorts are served on these (kube-proxy's `--nodeport-addresses`).

use crate::model::Cidr;
use crate::netlink::attr::Attrs;
use crate::netlink::{align4, MsgBuilder, NlSocket, NLM_F_DUMP, NLM_F_REQUEST};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const RTM_NEWADDR: u16 = 20;
const RTM_GETADDR: u16 = 22;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_MULTIPATH: u16 = 9;
const RTA_TABLE: u16 = 15;
const RT_TABLE_MAIN: u32 = 254;
const RT_SCOPE_HOST: u8 = 254;
const RT_SCOPE_LINK: u8 = 253;
const RTMSG_LEN: usize = 12;
const RTNH_LEN: usize = 8;

/// One address configured on one of the node's links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeAddress {
    pub ifindex: u32,
    pub ip: IpAddr,
}

fn parse_ip(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))),
        16 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?))),
        _ => None,
    }
}

fn dump(msg: u16, family: u8, header_len: usize) -> io::Result<Vec<(u16, Vec<u8>)>> {
    let mut sock = NlSocket::open(libc::NETLINK_ROUTE)?;
    let seq = sock.reserve_seq(1);
    let mut m = MsgBuilder::new(msg, NLM_F_REQUEST | NLM_F_DUMP, seq);
    let mut header = vec![0u8; header_len];
    header[0] = family;
    m.raw(&header);
    sock.dump(&m.finish()?)
        .map_err(|e| io::Error::other(format!("rtnetlink dump: {e}")))
}

/// One read of the node: its addresses and the links its default routes leave through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeView {
    pub addresses: Vec<NodeAddress>,
    pub primary_links: Vec<u32>,
}

/// Reading the node over rtnetlink failed; which of the two dumps did.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("reading the node's addresses over rtnetlink: {0}")]
    Addresses(io::Error),
    #[error("reading the node's default routes over rtnetlink: {0}")]
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
    // struct ifaddrmsg { family, prefixlen, flags, scope, index: u32 }
    let mut out = Vec::new();
    for (t, p) in dump(RTM_GETADDR, libc::AF_UNSPEC as u8, 8)? {
        if t != RTM_NEWADDR || p.len() < 8 {
            continue;
        }
        let scope = p[3];
        let ifindex = u32::from_ne_bytes(p[4..8].try_into().unwrap());
        if scope == RT_SCOPE_HOST || scope == RT_SCOPE_LINK {
            continue;
        }
        let attrs = Attrs(&p[8..]);
        let ip = attrs
            .get(IFA_LOCAL)
            .or_else(|| attrs.get(IFA_ADDRESS))
            .and_then(|a| parse_ip(a.payload));
        if let Some(ip) = ip.filter(|ip| !ip.is_loopback()) {
            out.push(NodeAddress { ifindex, ip });
        }
    }
    Ok(out)
}

/// Links that carry a default route in the main table: the node's primary interfaces.
pub fn default_route_links() -> io::Result<Vec<u32>> {
    Ok(links_of_default_routes(&dump(
        RTM_GETROUTE,
        libc::AF_UNSPEC as u8,
        RTMSG_LEN,
    )?))
}

/// The links the default routes of the main table leave through, each once, from a route dump's messages.
fn links_of_default_routes(msgs: &[(u16, Vec<u8>)]) -> Vec<u32> {
    let mut out = Vec::new();
    for (t, p) in msgs {
        let Some(route) = (*t == RTM_NEWROUTE).then(|| Route::parse(p)).flatten() else {
            continue;
        };
        if route.dst_len != 0 || route.table() != RT_TABLE_MAIN {
            continue;
        }
        for link in route.links() {
            if !out.contains(&link) {
                out.push(link);
            }
        }
    }
    out
}

/// One route of a dump: the `struct rtmsg` fields we use and its attributes.
struct Route<'a> {
    dst_len: u8,
    /// `rtm_table`: only 8 bits, so RTA_TABLE overrides it when present.
    header_table: u8,
    attrs: Attrs<'a>,
}

impl<'a> Route<'a> {
    // struct rtmsg { family, dst_len, src_len, tos, table, protocol, scope, type, flags: u32 }
    fn parse(p: &'a [u8]) -> Option<Route<'a>> {
        Some(Route {
            dst_len: *p.get(1)?,
            header_table: *p.get(4)?,
            attrs: Attrs(p.get(RTMSG_LEN..)?),
        })
    }

    fn table(&self) -> u32 {
        self.attrs
            .get(RTA_TABLE)
            .and_then(|a| a.u32_ne())
            .unwrap_or(self.header_table as u32)
    }

    /// RTA_OIF for a single next hop; a route with several (ECMP) has none and lists them in RTA_MULTIPATH.
    fn links(&self) -> Vec<u32> {
        let oif = self.attrs.get(RTA_OIF).and_then(|a| a.u32_ne());
        let hops = self.attrs.get(RTA_MULTIPATH).map(|a| a.payload);
        oif.into_iter()
            .chain(hops.into_iter().flat_map(next_hop_links))
            .collect()
    }
}

/// The `rtnh_ifindex` of each `struct rtnexthop { len: u16, flags: u8, hops: u8, ifindex: i32 }` in an
/// RTA_MULTIPATH payload; each is followed by its own attributes (gateway...) within `len`, padded to 4.
/// A next hop the kernel marks dead or link-down still counts: its link is an uplink all the same, and
/// NodePorts should not come and go with a cable's carrier.
fn next_hop_links(mut payload: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    while payload.len() >= RTNH_LEN {
        let len = u16::from_ne_bytes([payload[0], payload[1]]) as usize;
        if len < RTNH_LEN || len > payload.len() {
            // Malformed: keep what was whole rather than guess where the next one starts.
            break;
        }
        out.push(u32::from_ne_bytes(payload[4..8].try_into().unwrap()));
        payload = &payload[align4(len).min(payload.len())..];
    }
    out
}

/// Where NodePorts are served, after kube-proxy's `--nodeport-addresses`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum NodePortAddresses {
    /// Every local address but loopback (a zero CIDR was given): matched with `fib daddr type local`.
    AllLocal,
    /// These addresses only.
    Only(Vec<IpAddr>),
    /// Not served (no address matched).
    #[default]
    None,
}

/// Resolves the flag against the node's addresses. No CIDR: the primary addresses (those of links with a
/// default route), kube-proxy's default since 1.29. Loopback is never included: serving NodePorts on
/// 127.0.0.1 needs route_localnet, which nftkube does not turn on.
pub fn resolve_nodeport_addresses(
    cidrs: &[Cidr],
    addresses: &[NodeAddress],
    primary_links: &[u32],
) -> NodePortAddresses {
    if cidrs.iter().any(|c| c.prefix == 0) {
        return NodePortAddresses::AllLocal;
    }
    let mut ips: Vec<IpAddr> = addresses
        .iter()
        .filter(|a| {
            if cidrs.is_empty() {
                primary_links.contains(&a.ifindex)
            } else {
                cidrs.iter().any(|c| c.contains(&a.ip))
            }
        })
        .map(|a| a.ip)
        .collect();
    ips.sort();
    ips.dedup();
    if ips.is_empty() {
        NodePortAddresses::None
    } else {
        NodePortAddresses::Only(ips)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(ifindex: u32, ip: &str) -> NodeAddress {
        NodeAddress {
            ifindex,
            ip: ip.parse().unwrap(),
        }
    }

    /// A route message as a dump returns it (type, payload): `struct rtmsg` then the attributes `f` writes.
    fn route(
        family: u8,
        dst_len: u8,
        table: u8,
        f: impl FnOnce(&mut MsgBuilder),
    ) -> (u16, Vec<u8>) {
        let mut m = MsgBuilder::new(RTM_NEWROUTE, 0, 0);
        m.raw(&[family, dst_len, 0, 0, table, 3, 0, 1, 0, 0, 0, 0]);
        f(&mut m);
        let bytes = m.finish().unwrap();
        (RTM_NEWROUTE, bytes[16..].to_vec())
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
            route(V4, 0, RT_TABLE_MAIN as u8, |m| {
                m.attr_u32(RTA_TABLE, RT_TABLE_MAIN);
                m.attr(RTA_MULTIPATH, &v4_hops);
            }),
            route(V6, 0, RT_TABLE_MAIN as u8, |m| {
                m.attr_u32(RTA_TABLE, RT_TABLE_MAIN);
                m.attr(RTA_MULTIPATH, &v6_hops);
            }),
        ];
        assert_eq!(links_of_default_routes(&msgs), vec![2, 7, 9]);
    }

    #[test]
    fn only_default_routes_of_the_main_table_count() {
        let msgs = [
            // A single-path default route: RTA_OIF.
            route(V4, 0, RT_TABLE_MAIN as u8, |m| {
                m.attr_u32(RTA_OIF, 3);
            }),
            // Not a default route.
            route(V4, 24, RT_TABLE_MAIN as u8, |m| {
                m.attr_u32(RTA_OIF, 4);
            }),
            // Another table, said by RTA_TABLE (rtm_table says RT_TABLE_COMPAT for tables above 255).
            route(V4, 0, 252, |m| {
                m.attr_u32(RTA_TABLE, 1000);
                m.attr(RTA_MULTIPATH, &next_hop(5, &[10, 0, 0, 1]));
            }),
            // Not a route message.
            (RTM_NEWADDR, vec![V4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
        ];
        assert_eq!(links_of_default_routes(&msgs), vec![3]);
    }

    #[test]
    fn malformed_next_hops_end_the_list_without_a_panic() {
        let whole = next_hop(2, &[192, 168, 200, 2]);
        // A length beyond the payload, a length shorter than the header, a truncated header.
        let mut too_long = next_hop(3, &[192, 168, 201, 2]);
        too_long[0..2].copy_from_slice(&200u16.to_ne_bytes());
        let mut too_short = next_hop(3, &[192, 168, 201, 2]);
        too_short[0..2].copy_from_slice(&4u16.to_ne_bytes());
        for tail in [too_long, too_short, vec![16, 0, 0, 0]] {
            assert_eq!(next_hop_links(&[whole.clone(), tail].concat()), vec![2]);
        }
        // A truncated rtmsg is skipped.
        assert!(links_of_default_routes(&[(RTM_NEWROUTE, vec![V4, 0, 0])]).is_empty());
    }

    #[test]
    fn nodeport_addresses_follow_kube_proxy_semantics() {
        let addrs = [
            a(2, "192.168.200.1"),
            a(2, "fd00:200::1"),
            a(3, "10.244.0.1"),
        ];
        // Default: the primary links' addresses.
        assert_eq!(
            resolve_nodeport_addresses(&[], &addrs, &[2]),
            NodePortAddresses::Only(vec![
                "192.168.200.1".parse().unwrap(),
                "fd00:200::1".parse().unwrap()
            ])
        );
        // CIDRs select addresses.
        let cidrs = ["10.244.0.0/16".parse().unwrap()];
        assert_eq!(
            resolve_nodeport_addresses(&cidrs, &addrs, &[2]),
            NodePortAddresses::Only(vec!["10.244.0.1".parse().unwrap()])
        );
        // A zero CIDR: every local address.
        let all = ["0.0.0.0/0".parse().unwrap()];
        assert_eq!(
            resolve_nodeport_addresses(&all, &addrs, &[2]),
            NodePortAddresses::AllLocal
        );
        // Nothing matches: not served.
        let none = ["172.16.0.0/12".parse().unwrap()];
        assert_eq!(
            resolve_nodeport_addresses(&none, &addrs, &[2]),
            NodePortAddresses::None
        );
    }
}
