//! Facts about the node that rules depend on, as plain values: its addresses and where NodePorts are
//! served. The node crate reads them over rtnetlink; render takes them from here, with no I/O of its own.

use super::Cidr;
use std::net::IpAddr;

/// One address configured on one of the node's links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeAddress {
    /// The link's interface index.
    pub ifindex: u32,
    /// The address.
    pub ip: IpAddr,
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
