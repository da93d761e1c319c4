//! What the node itself has: its addresses and which of them are primary, read over rtnetlink in the calling
//! thread's network namespace. NodePorts are served on these (kube-proxy's `--nodeport-addresses`).

use crate::model::Cidr;
use crate::netlink::attr::Attrs;
use crate::netlink::{MsgBuilder, NlSocket, NLM_F_DUMP, NLM_F_REQUEST};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const RTM_NEWADDR: u16 = 20;
const RTM_GETADDR: u16 = 22;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_TABLE: u16 = 15;
const RT_TABLE_MAIN: u32 = 254;
const RT_SCOPE_HOST: u8 = 254;
const RT_SCOPE_LINK: u8 = 253;

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
    // struct rtmsg { family, dst_len, src_len, tos, table, protocol, scope, type, flags: u32 }
    let mut out = Vec::new();
    for (t, p) in dump(RTM_GETROUTE, libc::AF_UNSPEC as u8, 12)? {
        if t != RTM_NEWROUTE || p.len() < 12 || p[1] != 0 {
            continue;
        }
        let attrs = Attrs(&p[12..]);
        let table = attrs
            .get(RTA_TABLE)
            .and_then(|a| a.u32_ne())
            .unwrap_or(p[4] as u32);
        if table != RT_TABLE_MAIN {
            continue;
        }
        if let Some(oif) = attrs.get(RTA_OIF).and_then(|a| a.u32_ne()) {
            if !out.contains(&oif) {
                out.push(oif);
            }
        }
    }
    Ok(out)
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
