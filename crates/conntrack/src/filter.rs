//! Which conntrack entries are stale: a pure predicate over dumped entries.
//!
//! kube-proxy's rule, per service frontend: a UDP (or SCTP) flow whose *original destination* is a service
//! frontend (ClusterIP, external IP or load-balancer IP with the service port; or any node address with the
//! NodePort) and whose *reply source* is not a serving endpoint `ip:port` of that service port is stale. It
//! either points at an endpoint that is gone or no longer serving, or was never DNATed at all (reply source ==
//! original destination: the "black hole" entry created while the service had no endpoint). A flow that
//! points at a serving endpoint is never stale, whatever happened before: that is what keeps an agent restart
//! from wiping healthy flows.
//!
//! Two more targets cover services that are gone: every flow of a protocol to an address (a deleted UDP
//! ClusterIP, what `conntrack -D --orig-dst IP -p udp` does) and every flow to a removed frontend `ip:port`.
//!
//! TCP is never matched (TCP ends its own flows; kube-proxy leaves it alone), whatever the targets say.

use super::wire::{Entry, IPPROTO_SCTP, IPPROTO_UDP};
use nftkube_model::Protocol;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

/// A service address: original destination `ip:port` for `proto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    /// The address.
    pub ip: IpAddr,
    /// The port.
    pub port: u16,
    /// The protocol.
    pub proto: Protocol,
}

/// A NodePort: original destination port `port` for `proto`, on any node address (or on the addresses of
/// [`StaleFilter::node_port_addresses`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodePort {
    /// The node port.
    pub port: u16,
    /// The protocol.
    pub proto: Protocol,
}

/// Protocols whose conntrack entries are cleaned (connectionless, or with associations that outlive
/// endpoints): UDP and SCTP.
pub(crate) fn cleaned(proto: Protocol) -> bool {
    matches!(proto, Protocol::Udp | Protocol::Sctp)
}

fn proto_of(num: u8) -> Option<Protocol> {
    match num {
        IPPROTO_UDP => Some(Protocol::Udp),
        IPPROTO_SCTP => Some(Protocol::Sctp),
        _ => None,
    }
}

/// Why an entry is stale (for logs and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Its original destination is an address whose service is gone.
    DeletedIp,
    /// Its original destination is a removed frontend.
    RemovedFrontend,
    /// Its original destination is a frontend and its reply source is not a serving endpoint.
    NotServing,
    /// Its original destination port is a NodePort and its reply source is not a serving endpoint.
    NodePortNotServing,
}

/// The set of stale-entry targets of one cleanup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StaleFilter {
    ips: HashSet<(IpAddr, Protocol)>,
    removed: HashSet<Frontend>,
    frontends: HashMap<Frontend, HashSet<SocketAddr>>,
    node_ports: HashMap<NodePort, HashSet<SocketAddr>>,
    /// Node addresses NodePorts are served on; empty means every address (kube-proxy's default for
    /// `--nodeport-addresses`).
    pub node_port_addresses: Vec<IpAddr>,
}

impl StaleFilter {
    /// A filter that matches nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Matches nothing.
    pub fn is_empty(&self) -> bool {
        self.ips.is_empty()
            && self.removed.is_empty()
            && self.frontends.is_empty()
            && self.node_ports.is_empty()
    }

    /// Every `proto` flow whose original destination is `ip` (any port). Ignored for TCP.
    pub fn delete_all_to_ip(&mut self, ip: IpAddr, proto: Protocol) {
        if cleaned(proto) {
            self.ips.insert((ip, proto));
        }
    }

    /// Every flow whose original destination is `fe` (a frontend that no service has any more). A frontend
    /// that is also given serving endpoints with [`Self::frontend`] is judged by those instead.
    pub(crate) fn delete_all_to(&mut self, fe: Frontend) {
        if cleaned(fe.proto) {
            self.removed.insert(fe);
        }
    }

    /// Flows to `fe` whose reply source is not one of `serving`. Calling it again for the same frontend adds
    /// endpoints (never removes any).
    pub fn frontend(&mut self, fe: Frontend, serving: impl IntoIterator<Item = SocketAddr>) {
        if cleaned(fe.proto) {
            self.frontends.entry(fe).or_default().extend(serving);
        }
    }

    /// Flows whose original destination port is `np` (on a node address) and whose reply source is not one
    /// of `serving`.
    pub fn node_port(&mut self, np: NodePort, serving: impl IntoIterator<Item = SocketAddr>) {
        if cleaned(np.proto) {
            self.node_ports.entry(np).or_default().extend(serving);
        }
    }

    /// Address families (`AF_INET` / `AF_INET6`) and protocol numbers an entry must have to possibly match:
    /// what a dump may ask the kernel to filter on. `None` for the address means "any" (NodePorts).
    pub(crate) fn dump_scopes(&self) -> DumpScopes {
        let mut s = DumpScopes::default();
        for (ip, p) in &self.ips {
            s.add(Some(*ip), *p);
        }
        for fe in self.removed.iter().chain(self.frontends.keys()) {
            s.add(Some(fe.ip), fe.proto);
        }
        for np in self.node_ports.keys() {
            if self.node_port_addresses.is_empty() {
                s.any_address.insert(np.proto);
            } else {
                for ip in &self.node_port_addresses {
                    s.add(Some(*ip), np.proto);
                }
            }
        }
        s
    }

    /// Targets that select whole address or frontend ranges, with no per-entry judgement (a kernel-side
    /// filtered delete can express them): (ip, proto, port or None for all ports). Frontends that another
    /// target judges by serving endpoints are left out.
    pub(crate) fn delete_all_targets(&self) -> Vec<(IpAddr, Protocol, Option<u16>)> {
        let mut v: Vec<_> = self
            .ips
            .iter()
            .map(|(ip, p)| (*ip, *p, None))
            .chain(
                self.removed
                    .iter()
                    .filter(|fe| !self.frontends.contains_key(fe))
                    .filter(|fe| !self.ips.contains(&(fe.ip, fe.proto)))
                    .map(|fe| (fe.ip, fe.proto, Some(fe.port))),
            )
            .collect();
        v.sort();
        v
    }

    /// Drops one delete-all target (a kernel-side filtered delete took care of it).
    pub(crate) fn forget_delete_all(&mut self, ip: IpAddr, proto: Protocol, port: Option<u16>) {
        match port {
            None => {
                self.ips.remove(&(ip, proto));
            }
            Some(port) => {
                self.removed.remove(&Frontend { ip, port, proto });
            }
        }
    }

    #[cfg(test)]
    /// True if every target is a delete-all target (no per-entry judgement needed).
    pub(crate) fn only_delete_all(&self) -> bool {
        self.node_ports.is_empty()
            && self
                .frontends
                .keys()
                .all(|fe| self.ips.contains(&(fe.ip, fe.proto)))
    }

    /// Whether `e` is stale, and why. Only UDP and SCTP entries can be.
    pub(crate) fn check(&self, e: &Entry) -> Option<Reason> {
        let proto = proto_of(e.orig.proto)?;
        if self.ips.contains(&(e.orig.dst, proto)) {
            return Some(Reason::DeletedIp);
        }
        let reply_src = SocketAddr::new(e.reply.src, e.reply.sport);
        let fe = Frontend {
            ip: e.orig.dst,
            port: e.orig.dport,
            proto,
        };
        if let Some(serving) = self.frontends.get(&fe) {
            return (!serving.contains(&reply_src)).then_some(Reason::NotServing);
        }
        if self.removed.contains(&fe) {
            return Some(Reason::RemovedFrontend);
        }
        let np = NodePort {
            port: e.orig.dport,
            proto,
        };
        if let Some(serving) = self.node_ports.get(&np) {
            let on_node = self.node_port_addresses.is_empty()
                || self.node_port_addresses.contains(&e.orig.dst);
            if on_node && !serving.contains(&reply_src) {
                return Some(Reason::NodePortNotServing);
            }
        }
        None
    }

    /// Whether the entry is stale (see `check` for why).
    pub(crate) fn is_stale(&self, e: &Entry) -> bool {
        self.check(e).is_some()
    }

    /// Whether some target of this filter concerns `e`'s original destination (its address, its frontend
    /// or its NodePort on a node address), whatever the verdict.
    pub(crate) fn judges(&self, e: &Entry) -> bool {
        let Some(proto) = proto_of(e.orig.proto) else {
            return false;
        };
        let fe = Frontend {
            ip: e.orig.dst,
            port: e.orig.dport,
            proto,
        };
        let np = NodePort {
            port: e.orig.dport,
            proto,
        };
        let on_node =
            self.node_port_addresses.is_empty() || self.node_port_addresses.contains(&e.orig.dst);
        self.ips.contains(&(e.orig.dst, proto))
            || self.frontends.contains_key(&fe)
            || self.removed.contains(&fe)
            || (on_node && self.node_ports.contains_key(&np))
    }
}

/// What a cleanup needs to see: per (address, protocol) pair, or per protocol for any address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DumpScopes {
    /// (original destination, protocol) pairs.
    pub addresses: std::collections::BTreeSet<(IpAddr, Protocol)>,
    /// Protocols whose entries must be seen whatever their destination (NodePorts on every address).
    pub(crate) any_address: std::collections::BTreeSet<Protocol>,
}

impl DumpScopes {
    fn add(&mut self, ip: Option<IpAddr>, p: Protocol) {
        if let Some(ip) = ip {
            self.addresses.insert((ip, p));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::wire::{Tuple, ZoneScope, IPPROTO_TCP};
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }
    fn fe(s: &str, proto: Protocol) -> Frontend {
        let a = sa(s);
        Frontend {
            ip: a.ip(),
            port: a.port(),
            proto,
        }
    }

    /// A flow from `client` to `orig_dst` that the kernel answers from `reply_src` (DNAT when they differ).
    fn entry(proto: u8, client: &str, orig_dst: &str, reply_src: &str) -> Entry {
        let (c, d, r) = (sa(client), sa(orig_dst), sa(reply_src));
        Entry {
            orig: Tuple::new(c.ip(), c.port(), d.ip(), d.port(), proto),
            reply: Tuple::new(r.ip(), r.port(), c.ip(), c.port(), proto),
            zone: ZoneScope::None,
            id: Some(1),
            mark: 0,
            status: 0,
            timeout: 30,
        }
    }
    fn udp(client: &str, orig_dst: &str, reply_src: &str) -> Entry {
        entry(IPPROTO_UDP, client, orig_dst, reply_src)
    }

    #[test]
    fn newly_active_deletes_black_holes_and_keeps_serving_flows() {
        let mut f = StaleFilter::new();
        f.frontend(
            fe("10.96.0.10:53", Protocol::Udp),
            [sa("10.244.1.2:5353"), sa("10.244.2.2:5353")],
        );
        // Un-NATed: reply source == original destination.
        let hole = udp("10.244.0.2:40000", "10.96.0.10:53", "10.96.0.10:53");
        assert_eq!(f.check(&hole), Some(Reason::NotServing));
        // Healthy flows to either serving endpoint stay.
        assert!(!f.is_stale(&udp("10.244.0.2:40001", "10.96.0.10:53", "10.244.1.2:5353")));
        assert!(!f.is_stale(&udp("10.244.0.2:40002", "10.96.0.10:53", "10.244.2.2:5353")));
        // The endpoint address with another port is not that endpoint.
        assert!(f.is_stale(&udp("10.244.0.2:40003", "10.96.0.10:53", "10.244.1.2:5354")));
        // Another port of the same address, another address: not this frontend.
        assert!(!f.is_stale(&udp("10.244.0.2:40004", "10.96.0.10:54", "10.96.0.10:54")));
        assert!(!f.is_stale(&udp("10.244.0.2:40005", "10.96.0.11:53", "10.96.0.11:53")));
    }

    #[test]
    fn stale_endpoint_flows_go_surviving_ones_stay() {
        let mut f = StaleFilter::new();
        // 10.244.2.2 was removed: only .1 and .3 serve.
        f.frontend(
            fe("10.96.0.10:53", Protocol::Udp),
            [sa("10.244.1.2:5353"), sa("10.244.3.2:5353")],
        );
        assert!(f.is_stale(&udp("10.244.0.2:40000", "10.96.0.10:53", "10.244.2.2:5353")));
        assert!(!f.is_stale(&udp("10.244.0.2:40001", "10.96.0.10:53", "10.244.3.2:5353")));
        // No serving endpoint at all: every flow of the frontend is stale.
        let mut none = StaleFilter::new();
        none.frontend(fe("10.96.0.10:53", Protocol::Udp), []);
        assert!(none.is_stale(&udp("10.244.0.2:40001", "10.96.0.10:53", "10.244.3.2:5353")));
    }

    #[test]
    fn tcp_is_never_stale() {
        let mut f = StaleFilter::new();
        f.delete_all_to_ip(ip("10.96.0.10"), Protocol::Udp);
        f.frontend(fe("10.96.0.10:80", Protocol::Udp), []);
        let tcp = entry(
            IPPROTO_TCP,
            "10.244.0.2:40000",
            "10.96.0.10:80",
            "10.244.9.9:8080",
        );
        assert_eq!(f.check(&tcp), None);
        // TCP targets are refused outright.
        let mut t = StaleFilter::new();
        t.delete_all_to_ip(ip("10.96.0.10"), Protocol::Tcp);
        t.frontend(fe("10.96.0.10:80", Protocol::Tcp), []);
        t.node_port(
            NodePort {
                port: 30080,
                proto: Protocol::Tcp,
            },
            [],
        );
        assert!(t.is_empty());
    }

    #[test]
    fn deleted_ip_takes_every_udp_port_but_not_sctp_or_other_ips() {
        let mut f = StaleFilter::new();
        f.delete_all_to_ip(ip("10.96.0.53"), Protocol::Udp);
        assert_eq!(
            f.check(&udp("10.244.0.2:1", "10.96.0.53:53", "10.244.1.2:53")),
            Some(Reason::DeletedIp)
        );
        assert!(f.is_stale(&udp("10.244.0.2:1", "10.96.0.53:9999", "10.96.0.53:9999")));
        assert!(!f.is_stale(&entry(
            IPPROTO_SCTP,
            "10.244.0.2:1",
            "10.96.0.53:53",
            "10.244.1.2:53"
        )));
        assert!(!f.is_stale(&udp("10.244.0.2:1", "10.96.0.54:53", "10.244.1.2:53")));
        // A flow *from* the address is not a flow *to* it.
        assert!(!f.is_stale(&udp("10.96.0.53:53", "10.244.0.2:1", "10.244.0.2:1")));
    }

    #[test]
    fn removed_frontend_unless_someone_serves_it_now() {
        let mut f = StaleFilter::new();
        f.delete_all_to(fe("10.96.0.10:53", Protocol::Sctp));
        let e = entry(
            IPPROTO_SCTP,
            "10.244.0.2:1",
            "10.96.0.10:53",
            "10.244.1.2:5353",
        );
        assert_eq!(f.check(&e), Some(Reason::RemovedFrontend));
        assert_eq!(
            f.delete_all_targets(),
            vec![(ip("10.96.0.10"), Protocol::Sctp, Some(53))]
        );
        assert!(f.only_delete_all());
        // Another service took the frontend over: judged by its endpoints.
        f.frontend(fe("10.96.0.10:53", Protocol::Sctp), [sa("10.244.1.2:5353")]);
        assert_eq!(f.check(&e), None);
        assert!(f.delete_all_targets().is_empty());
        assert!(!f.only_delete_all());
    }

    #[test]
    fn node_port_matching() {
        let np = NodePort {
            port: 30053,
            proto: Protocol::Udp,
        };
        let mut f = StaleFilter::new();
        f.node_port(np, [sa("10.244.1.2:5353")]);
        // To any node address on the NodePort, reply from a non-serving source: stale.
        assert_eq!(
            f.check(&udp(
                "192.168.200.2:4000",
                "192.168.200.1:30053",
                "10.244.2.2:5353"
            )),
            Some(Reason::NodePortNotServing)
        );
        // Never DNATed (reply source is the node itself): stale.
        assert!(f.is_stale(&udp(
            "192.168.200.2:4000",
            "192.168.200.1:30053",
            "192.168.200.1:30053"
        )));
        // Pointing at the serving endpoint: kept.
        assert!(!f.is_stale(&udp(
            "192.168.200.2:4000",
            "192.168.200.1:30053",
            "10.244.1.2:5353"
        )));
        // Another port, or TCP on the same port: not this NodePort.
        assert!(!f.is_stale(&udp(
            "192.168.200.2:4000",
            "192.168.200.1:30054",
            "10.244.2.2:5353"
        )));
        assert!(!f.is_stale(&entry(
            IPPROTO_TCP,
            "192.168.200.2:4000",
            "192.168.200.1:30053",
            "10.244.2.2:8080"
        )));
        // IPv6 node addresses too.
        assert!(f.is_stale(&udp(
            "[fd00:200::2]:4000",
            "[fd00:200::1]:30053",
            "[fd00:244:0:2::2]:5353"
        )));
        assert_eq!(
            f.dump_scopes().any_address,
            [Protocol::Udp].into_iter().collect()
        );
        assert!(!f.only_delete_all());

        // Restricted to some node addresses (--nodeport-addresses): other destinations are not NodePort flows.
        f.node_port_addresses = vec![ip("192.168.200.1")];
        assert!(f.is_stale(&udp(
            "192.168.200.2:4000",
            "192.168.200.1:30053",
            "10.244.2.2:5353"
        )));
        assert!(!f.is_stale(&udp(
            "10.244.0.2:4000",
            "203.0.113.7:30053",
            "203.0.113.7:30053"
        )));
        assert!(f.dump_scopes().any_address.is_empty());
        assert!(f
            .dump_scopes()
            .addresses
            .contains(&(ip("192.168.200.1"), Protocol::Udp)));
    }

    #[test]
    fn frontend_targets_win_over_node_ports_and_removed() {
        let mut f = StaleFilter::new();
        let front = fe("10.96.0.10:30053", Protocol::Udp);
        f.frontend(front, [sa("10.244.1.2:5353")]);
        f.node_port(
            NodePort {
                port: 30053,
                proto: Protocol::Udp,
            },
            [],
        );
        // The ClusterIP frontend's serving set decides for flows to it.
        assert!(!f.is_stale(&udp("10.244.0.2:1", "10.96.0.10:30053", "10.244.1.2:5353")));
        // Serving sets accumulate.
        f.frontend(front, [sa("10.244.2.2:5353")]);
        assert!(!f.is_stale(&udp("10.244.0.2:1", "10.96.0.10:30053", "10.244.2.2:5353")));
    }

    #[test]
    fn forgetting_delete_all_targets_keeps_judged_ones() {
        let mut f = StaleFilter::new();
        f.delete_all_to_ip(ip("10.96.0.53"), Protocol::Udp);
        f.delete_all_to(fe("10.96.0.54:53", Protocol::Udp));
        f.frontend(fe("10.96.0.10:53", Protocol::Udp), [sa("10.244.1.2:5353")]);
        assert_eq!(
            f.delete_all_targets(),
            vec![
                (ip("10.96.0.53"), Protocol::Udp, None),
                (ip("10.96.0.54"), Protocol::Udp, Some(53))
            ]
        );
        assert!(!f.only_delete_all());
        let scopes = f.dump_scopes();
        assert_eq!(scopes.addresses.len(), 3);
        assert!(scopes.any_address.is_empty());
        f.forget_delete_all(ip("10.96.0.53"), Protocol::Udp, None);
        f.forget_delete_all(ip("10.96.0.54"), Protocol::Udp, Some(53));
        assert!(!f.is_stale(&udp("10.244.0.2:1", "10.96.0.53:53", "10.96.0.53:53")));
        assert!(!f.is_stale(&udp("10.244.0.2:1", "10.96.0.54:53", "10.96.0.54:53")));
        assert!(f.is_stale(&udp("10.244.0.2:1", "10.96.0.10:53", "10.96.0.10:53")));
        assert!(f.delete_all_targets().is_empty());
        assert_eq!(f.dump_scopes().addresses.len(), 1);
    }
}
