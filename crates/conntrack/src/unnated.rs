//! Black holes left by drift: flows to a service frontend that were never DNATed.
//!
//! While our rules are missing (a table deleted or made dormant, a ruleset flushed, a dispatch element or
//! rule removed), connections to a ClusterIP, external IP, LoadBalancer IP or NodePort still get conntrack
//! entries, only without DNAT. Once the rules are back, a new connection whose tuple matches such an entry
//! (a client reusing its source port) follows the entry instead of the rules and goes nowhere, for as long as
//! the entry lives (a TCP SYN_SENT entry ~2 minutes, UDP as long as the client keeps sending). After a repair
//! the agent deletes every TCP, UDP and SCTP entry whose original destination is one of our frontends and
//! whose status lacks IPS_DST_NAT, each by its exact tuple. No healthy flow can match: traffic to a frontend
//! is either DNATed by our rules or dropped / rejected before it is confirmed.

use super::wire::{Entry, AF_INET, AF_INET6, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};
use super::{DumpFilter, FrontendKinds};
use nftkube_model::NodePortAddresses;
use nftkube_model::{ClusterState, Protocol};
use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;

/// Conntrack status bit: the connection was destination-NATed (`IPS_DST_NAT`).
pub(crate) const IPS_DST_NAT: u32 = 1 << 5;

/// Every frontend the rules program, by original destination.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frontends {
    /// (address, port, IP protocol number).
    sockets: HashSet<(IpAddr, u16, u8)>,
    /// (NodePort, IP protocol number), on `node_addresses`.
    node_ports: HashSet<(u16, u8)>,
    node_addresses: HashSet<IpAddr>,
}

fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => IPPROTO_TCP,
        Protocol::Udp => IPPROTO_UDP,
        Protocol::Sctp => IPPROTO_SCTP,
    }
}

fn family_of(ip: &IpAddr) -> u8 {
    if ip.is_ipv4() {
        AF_INET
    } else {
        AF_INET6
    }
}

impl Frontends {
    /// The frontends of every service in `state`, of the kinds the rules program. NodePorts count on the
    /// addresses they are served on: `nodeport` as resolved for the rules, `node_ips` for "every local
    /// address" (loopback never serves NodePorts).
    pub fn of(
        state: &ClusterState,
        kinds: FrontendKinds,
        nodeport: &NodePortAddresses,
        node_ips: &[IpAddr],
    ) -> Frontends {
        let mut f = Frontends::default();
        for sp in state.service_map().values() {
            let proto = proto_number(sp.protocol);
            let mut ips = sp.cluster_ips.clone();
            if kinds.external_ips {
                ips.extend(&sp.external_ips);
            }
            if kinds.load_balancer_ips {
                ips.extend(&sp.load_balancer_ips);
            }
            f.sockets
                .extend(ips.into_iter().map(|ip| (ip, sp.port, proto)));
            if let Some(np) = sp.node_port.filter(|_| kinds.node_ports) {
                f.node_ports.insert((np, proto));
            }
        }
        f.node_addresses = match nodeport {
            NodePortAddresses::AllLocal => node_ips
                .iter()
                .filter(|ip| !ip.is_loopback())
                .copied()
                .collect(),
            NodePortAddresses::Only(v) => v.iter().copied().collect(),
            NodePortAddresses::None => HashSet::new(),
        };
        f
    }

    /// Nothing to look for.
    pub fn is_empty(&self) -> bool {
        self.sockets.is_empty() && (self.node_ports.is_empty() || self.node_addresses.is_empty())
    }

    /// Whether `e` is a flow to one of our frontends that was never DNATed.
    pub(crate) fn is_black_hole(&self, e: &Entry) -> bool {
        let o = &e.orig;
        if e.status & IPS_DST_NAT != 0 {
            return false;
        }
        self.sockets.contains(&(o.dst, o.dport, o.proto))
            || (self.node_ports.contains(&(o.dport, o.proto))
                && self.node_addresses.contains(&o.dst))
    }

    /// The dumps that see every entry that can match: per family and protocol where the kernel filters by
    /// protocol (`proto_filter(family)`), else the whole family.
    pub fn dumps(&self, proto_filter: impl Fn(u8) -> bool) -> Vec<DumpFilter> {
        let mut scopes: BTreeSet<(u8, u8)> = self
            .sockets
            .iter()
            .map(|(ip, _, p)| (family_of(ip), *p))
            .collect();
        for ip in &self.node_addresses {
            scopes.extend(self.node_ports.iter().map(|(_, p)| (family_of(ip), *p)));
        }
        let mut out = Vec::new();
        for family in [AF_INET, AF_INET6] {
            let protos: Vec<u8> = scopes
                .iter()
                .filter(|(f, _)| *f == family)
                .map(|(_, p)| *p)
                .collect();
            if protos.is_empty() {
                continue;
            }
            if proto_filter(family) {
                out.extend(protos.into_iter().map(|p| DumpFilter::proto(family, p)));
            } else {
                out.push(DumpFilter::family(family));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::wire::{Tuple, ZoneScope};
    use super::*;
    use nftkube_model::*;

    fn entry(dst: &str, dport: u16, proto: u8, reply_src: &str, status: u32) -> Entry {
        let client: IpAddr = "10.244.1.5".parse().unwrap();
        let dst: IpAddr = dst.parse().unwrap();
        let reply_src: IpAddr = reply_src.parse().unwrap();
        Entry {
            orig: Tuple::new(client, 40000, dst, dport, proto),
            reply: Tuple::new(reply_src, dport, client, 40000, proto),
            zone: ZoneScope::None,
            id: None,
            mark: 0,
            status,
            timeout: 100,
        }
    }

    fn state() -> ClusterState {
        let mut s = ClusterState::new();
        let spn = |port: &str, protocol| ServicePortName {
            service: NamespacedName::new("ns", "web"),
            port: port.into(),
            protocol,
        };
        let mut tcp = ServicePort::cluster_ip(
            spn("tcp", Protocol::Tcp),
            vec!["10.96.0.10".parse().unwrap()],
            80,
        );
        tcp.node_port = Some(30080);
        tcp.external_ips = vec!["192.0.2.7".parse().unwrap()];
        let udp = ServicePort::cluster_ip(
            spn("udp", Protocol::Udp),
            vec!["fd00:96::10".parse().unwrap()],
            53,
        );
        s.apply_service(NamespacedName::new("ns", "web"), vec![tcp, udp]);
        s
    }

    #[test]
    fn only_undnated_flows_to_our_frontends_are_black_holes() {
        let node: IpAddr = "192.168.1.2".parse().unwrap();
        let f = Frontends::of(
            &state(),
            FrontendKinds::ALL,
            &NodePortAddresses::Only(vec![node]),
            &[node],
        );
        const NAT: u32 = IPS_DST_NAT | 0x8; // DNATed and confirmed
                                            // Never DNATed: the reply comes from the frontend itself.
        assert!(f.is_black_hole(&entry("10.96.0.10", 80, IPPROTO_TCP, "10.96.0.10", 0x8)));
        assert!(f.is_black_hole(&entry("192.0.2.7", 80, IPPROTO_TCP, "192.0.2.7", 0)));
        assert!(f.is_black_hole(&entry("192.168.1.2", 30080, IPPROTO_TCP, "192.168.1.2", 0)));
        assert!(f.is_black_hole(&entry("fd00:96::10", 53, IPPROTO_UDP, "fd00:96::10", 0)));
        // DNATed: healthy, whatever the endpoint.
        assert!(!f.is_black_hole(&entry("10.96.0.10", 80, IPPROTO_TCP, "10.244.2.9", NAT)));
        // Another port, protocol or address: not ours.
        assert!(!f.is_black_hole(&entry("10.96.0.10", 81, IPPROTO_TCP, "10.96.0.10", 0)));
        assert!(!f.is_black_hole(&entry("10.96.0.10", 80, IPPROTO_UDP, "10.96.0.10", 0)));
        assert!(!f.is_black_hole(&entry("10.96.0.11", 80, IPPROTO_TCP, "10.96.0.11", 0)));
        // A NodePort on an address it is not served on.
        assert!(!f.is_black_hole(&entry("192.168.9.9", 30080, IPPROTO_TCP, "192.168.9.9", 0)));

        // External IPs are not ours unless the rules program them.
        let cluster_only = Frontends::of(
            &state(),
            FrontendKinds::CLUSTER_IP_ONLY,
            &NodePortAddresses::None,
            &[],
        );
        assert!(!cluster_only.is_black_hole(&entry("192.0.2.7", 80, IPPROTO_TCP, "192.0.2.7", 0)));
        assert!(!cluster_only.is_black_hole(&entry(
            "192.168.1.2",
            30080,
            IPPROTO_TCP,
            "192.168.1.2",
            0
        )));
    }

    #[test]
    fn dumps_cover_every_family_and_protocol_in_use() {
        let node: IpAddr = "192.168.1.2".parse().unwrap();
        let f = Frontends::of(
            &state(),
            FrontendKinds::ALL,
            &NodePortAddresses::AllLocal,
            &[node, "127.0.0.1".parse().unwrap()],
        );
        assert_eq!(
            f.dumps(|_| true),
            vec![
                DumpFilter::proto(AF_INET, IPPROTO_TCP),
                DumpFilter::proto(AF_INET6, IPPROTO_UDP),
            ]
        );
        assert_eq!(
            f.dumps(|fam| fam == AF_INET),
            vec![
                DumpFilter::proto(AF_INET, IPPROTO_TCP),
                DumpFilter::family(AF_INET6),
            ]
        );
        assert!(Frontends::default().dumps(|_| true).is_empty());
        assert!(Frontends::default().is_empty());
    }
}
