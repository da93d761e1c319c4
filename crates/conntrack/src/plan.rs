//! From model changes to a [`StaleFilter`]: which frontends to look at and which endpoints serve them.
//!
//! [`Pending`] keeps the changes of syncs whose commit failed, so that the cleanup after the next successful
//! commit still sees them. [`FrontendIndex`] remembers the UDP / SCTP frontends as of the previous cleanup:
//! a frontend that disappeared (a deleted service, a removed port, a changed port number or address) is known
//! only from there, since the model no longer has it.

use super::filter::{cleaned, Frontend, NodePort, StaleFilter};
use nftkube_model::{
    Changes, ClusterState, NamespacedName, Protocol, ServicePort, ServicePortName,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};

/// Which frontend kinds the data path programs, hence which are cleaned. A kind the rules do not program
/// must not be cleaned: an external IP nothing DNATs may be a real remote host with its own flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FrontendKinds {
    /// Services' external IPs.
    pub(crate) external_ips: bool,
    /// Load balancer ingress IPs.
    pub(crate) load_balancer_ips: bool,
    /// NodePorts.
    pub(crate) node_ports: bool,
}

impl FrontendKinds {
    /// What the renderer programs today: ClusterIPs only.
    pub(crate) const CLUSTER_IP_ONLY: FrontendKinds = FrontendKinds {
        external_ips: false,
        load_balancer_ips: false,
        node_ports: false,
    };
    /// Every kind.
    pub const ALL: FrontendKinds = FrontendKinds {
        external_ips: true,
        load_balancer_ips: true,
        node_ports: true,
    };
}

/// The frontends of one UDP / SCTP service port.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PortFrontends {
    /// Its addresses (ClusterIP, external and load balancer IPs the rules program), with its port.
    pub(crate) frontends: Vec<Frontend>,
    /// Its NodePort, if programmed.
    pub node_port: Option<NodePort>,
}

/// The frontends of a service port, or `None` for protocols that are not cleaned (TCP).
pub(crate) fn frontends_of(sp: &ServicePort, kinds: FrontendKinds) -> Option<PortFrontends> {
    if !cleaned(sp.protocol) {
        return None;
    }
    let mut ips: Vec<IpAddr> = sp.cluster_ips.clone();
    if kinds.external_ips {
        ips.extend(&sp.external_ips);
    }
    if kinds.load_balancer_ips {
        ips.extend(&sp.load_balancer_ips);
    }
    ips.sort();
    ips.dedup();
    Some(PortFrontends {
        frontends: ips
            .into_iter()
            .map(|ip| Frontend {
                ip,
                port: sp.port,
                proto: sp.protocol,
            })
            .collect(),
        node_port: sp
            .node_port
            .filter(|_| kinds.node_ports)
            .map(|port| NodePort {
                port,
                proto: sp.protocol,
            }),
    })
}

/// Changes not yet cleaned up, merged across failed syncs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pending {
    changes: Changes,
}

impl Pending {
    /// Nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Nothing pending.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// Adds a round of changes. Sets are united; stale endpoints are kept once each.
    pub(crate) fn merge(&mut self, c: &Changes) {
        let p = &mut self.changes;
        p.changed_services
            .extend(c.changed_services.iter().cloned());
        p.deleted_udp_cluster_ips
            .extend(c.deleted_udp_cluster_ips.iter().copied());
        p.newly_active_services
            .extend(c.newly_active_services.iter().cloned());
        for se in &c.stale_endpoints {
            if !p.stale_endpoints.contains(se) {
                p.stale_endpoints.push(se.clone());
            }
        }
    }

    /// The changes pending.
    pub(crate) fn changes(&self) -> &Changes {
        &self.changes
    }

    /// Forgets them (they were handled).
    pub(crate) fn clear(&mut self) {
        self.changes = Changes::default();
    }
}

/// UDP / SCTP frontends as of the previous cleanup, with reverse lookups.
#[derive(Debug, Clone, Default)]
pub struct FrontendIndex {
    by_port: BTreeMap<ServicePortName, PortFrontends>,
    owners: HashMap<Frontend, ServicePortName>,
    node_port_owners: HashMap<NodePort, ServicePortName>,
    /// (address, protocol) → number of frontends on it.
    ip_refs: HashMap<(IpAddr, Protocol), usize>,
}

impl FrontendIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many service ports it has.
    pub fn len(&self) -> usize {
        self.by_port.len()
    }

    /// No service ports.
    pub fn is_empty(&self) -> bool {
        self.by_port.is_empty()
    }

    /// The frontends of a service port.
    pub fn get(&self, spn: &ServicePortName) -> Option<&PortFrontends> {
        self.by_port.get(spn)
    }

    /// The current owner of a frontend.
    pub(crate) fn owner(&self, fe: &Frontend) -> Option<&ServicePortName> {
        self.owners.get(fe)
    }

    /// The current owner of a NodePort.
    pub(crate) fn node_port_owner(&self, np: &NodePort) -> Option<&ServicePortName> {
        self.node_port_owners.get(np)
    }

    /// Whether some service port still has this address for this protocol.
    pub(crate) fn ip_in_use(&self, ip: IpAddr, proto: Protocol) -> bool {
        self.ip_refs.contains_key(&(ip, proto))
    }

    fn ports_of<'a>(
        &'a self,
        key: &'a NamespacedName,
    ) -> impl Iterator<Item = &'a ServicePortName> + 'a {
        self.by_port.keys().filter(move |n| &n.service == key)
    }

    fn remove(&mut self, spn: &ServicePortName) -> Option<PortFrontends> {
        let old = self.by_port.remove(spn)?;
        for fe in &old.frontends {
            if self.owners.get(fe) == Some(spn) {
                self.owners.remove(fe);
            }
            if let Some(n) = self.ip_refs.get_mut(&(fe.ip, fe.proto)) {
                *n -= 1;
                if *n == 0 {
                    self.ip_refs.remove(&(fe.ip, fe.proto));
                }
            }
        }
        if let Some(np) = &old.node_port {
            if self.node_port_owners.get(np) == Some(spn) {
                self.node_port_owners.remove(np);
            }
        }
        Some(old)
    }

    fn insert(&mut self, spn: ServicePortName, pf: PortFrontends) {
        for fe in &pf.frontends {
            self.owners.insert(*fe, spn.clone());
            *self.ip_refs.entry((fe.ip, fe.proto)).or_default() += 1;
        }
        if let Some(np) = pf.node_port {
            self.node_port_owners.insert(np, spn.clone());
        }
        self.by_port.insert(spn, pf);
    }

    /// Brings one service up to date with `state`; returns the frontends and NodePorts it had and no longer
    /// has (some may belong to another service now: check [`Self::owner`]).
    pub(crate) fn refresh(
        &mut self,
        key: &NamespacedName,
        state: &ClusterState,
        kinds: FrontendKinds,
    ) -> (Vec<Frontend>, Vec<NodePort>) {
        let old_names: Vec<ServicePortName> = self.ports_of(key).cloned().collect();
        let mut old: Vec<PortFrontends> = Vec::new();
        for n in &old_names {
            old.extend(self.remove(n));
        }
        let mut new_fes = BTreeSet::new();
        let mut new_nps = BTreeSet::new();
        for sp in state.service_ports(key) {
            if let Some(pf) = frontends_of(sp, kinds) {
                new_fes.extend(pf.frontends.iter().copied());
                new_nps.extend(pf.node_port);
                self.insert(sp.name.clone(), pf);
            }
        }
        let mut removed_fes: Vec<Frontend> = old
            .iter()
            .flat_map(|pf| pf.frontends.iter().copied())
            .filter(|fe| !new_fes.contains(fe))
            .collect();
        removed_fes.sort();
        removed_fes.dedup();
        let mut removed_nps: Vec<NodePort> = old
            .iter()
            .filter_map(|pf| pf.node_port)
            .filter(|np| !new_nps.contains(np))
            .collect();
        removed_nps.sort();
        removed_nps.dedup();
        (removed_fes, removed_nps)
    }
}

/// Serving endpoints (`ip:port`) of one service port, in the current state.
pub(crate) fn serving_endpoints(state: &ClusterState, spn: &ServicePortName) -> Vec<SocketAddr> {
    state
        .service_endpoints(&spn.service)
        .remove(spn)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.serving)
        .map(|e| SocketAddr::new(e.ip, e.port))
        .collect()
}

/// What a cleanup has to look at, before the current endpoints are looked up: names and addresses only, so
/// targets kept for a retry are judged against the endpoints of the time they are retried.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Targets {
    /// Deleted UDP ClusterIPs.
    pub(crate) ips: BTreeSet<IpAddr>,
    /// Frontends a service lost.
    pub(crate) frontends: BTreeSet<Frontend>,
    /// NodePorts a service lost.
    pub(crate) node_ports: BTreeSet<NodePort>,
    /// Service ports whose flows are judged by their serving endpoints.
    pub(crate) judged: BTreeSet<ServicePortName>,
}

impl Targets {
    /// Nothing to look at.
    pub fn is_empty(&self) -> bool {
        self.ips.is_empty()
            && self.frontends.is_empty()
            && self.node_ports.is_empty()
            && self.judged.is_empty()
    }

    /// Adds another round's targets.
    pub(crate) fn merge(&mut self, other: Targets) {
        self.ips.extend(other.ips);
        self.frontends.extend(other.frontends);
        self.node_ports.extend(other.node_ports);
        self.judged.extend(other.judged);
    }
}

/// Updates `index` for the changed services and returns what they ask to clean:
/// - deleted UDP ClusterIPs (every UDP flow to them, unless a UDP frontend uses the address again);
/// - frontends and NodePorts a service lost (every flow to them, unless another service has them now);
/// - service ports that went from no serving endpoint to some, or lost an endpoint: flows to their frontends
///   whose reply source is not a serving endpoint.
///
/// Costs O(changed services), never O(cluster).
pub(crate) fn collect_targets(
    changes: &Changes,
    index: &mut FrontendIndex,
    state: &ClusterState,
    kinds: FrontendKinds,
) -> Targets {
    let mut t = Targets::default();
    let mut services: BTreeSet<&NamespacedName> = changes.changed_services.iter().collect();
    services.extend(changes.newly_active_services.iter().map(|n| &n.service));
    services.extend(changes.stale_endpoints.iter().map(|(n, _)| &n.service));
    for key in services {
        let (fes, nps) = index.refresh(key, state, kinds);
        t.frontends.extend(fes);
        t.node_ports.extend(nps);
    }
    t.ips
        .extend(changes.deleted_udp_cluster_ips.iter().copied());
    t.judged.extend(
        changes
            .newly_active_services
            .iter()
            .chain(changes.stale_endpoints.iter().map(|(n, _)| n))
            .filter(|n| cleaned(n.protocol))
            .cloned(),
    );
    t
}

/// Turns targets into a filter with the current owners and serving endpoints. O(targets).
pub fn resolve(t: &Targets, index: &FrontendIndex, state: &ClusterState) -> StaleFilter {
    let mut f = StaleFilter::new();
    let mut judged: BTreeSet<&ServicePortName> = t.judged.iter().collect();
    for fe in &t.frontends {
        match index.owner(fe) {
            Some(owner) => {
                judged.insert(owner);
            }
            None => f.delete_all_to(*fe),
        }
    }
    for np in &t.node_ports {
        match index.node_port_owners.get(np) {
            Some(owner) => {
                judged.insert(owner);
            }
            None => f.node_port(*np, []),
        }
    }
    for ip in &t.ips {
        if !index.ip_in_use(*ip, Protocol::Udp) {
            f.delete_all_to_ip(*ip, Protocol::Udp);
        }
    }
    for spn in judged {
        let Some(pf) = index.get(spn) else {
            continue; // gone: its frontends are among the removed ones
        };
        let serving = serving_endpoints(state, spn);
        for fe in &pf.frontends {
            f.frontend(*fe, serving.iter().copied());
        }
        if let Some(np) = pf.node_port {
            f.node_port(np, serving.iter().copied());
        }
    }
    f
}

/// [`collect_targets`] then [`resolve`].
pub fn build_filter(
    changes: &Changes,
    index: &mut FrontendIndex,
    state: &ClusterState,
    kinds: FrontendKinds,
) -> StaleFilter {
    let t = collect_targets(changes, index, state, kinds);
    resolve(&t, index, state)
}

#[cfg(test)]
mod tests {
    use super::super::wire::{Entry, Tuple, ZoneScope, IPPROTO_UDP};
    use super::*;
    use nftkube_model::{IpFamily, SliceEndpoint, SliceInfo, SlicePort};

    fn key(name: &str) -> NamespacedName {
        NamespacedName::new("ns", name)
    }
    fn spn(svc: &str, port: &str, proto: Protocol) -> ServicePortName {
        ServicePortName {
            service: key(svc),
            port: port.into(),
            protocol: proto,
        }
    }
    fn port(svc: &str, name: &str, proto: Protocol, port: u16, ip: &str) -> ServicePort {
        ServicePort::cluster_ip(spn(svc, name, proto), vec![ip.parse().unwrap()], port)
    }
    fn slice(svc: &str, eps: &[(&str, bool)]) -> SliceInfo {
        SliceInfo {
            namespace: "ns".into(),
            name: format!("{svc}-a").into(),
            service: svc.into(),
            address_type: IpFamily::V4,
            ports: vec![
                SlicePort {
                    name: "udp".into(),
                    port: 5353,
                    protocol: Protocol::Udp,
                },
                SlicePort {
                    name: "tcp".into(),
                    port: 8080,
                    protocol: Protocol::Tcp,
                },
            ],
            endpoints: eps
                .iter()
                .map(|(ip, serving)| {
                    SliceEndpoint::new(ip.parse().unwrap(), *serving, *serving, false)
                })
                .collect(),
        }
    }
    fn echo(ip: &str) -> Vec<ServicePort> {
        vec![
            port("echo", "tcp", Protocol::Tcp, 80, ip),
            port("echo", "udp", Protocol::Udp, 53, ip),
        ]
    }
    fn udp(client: &str, orig_dst: &str, reply_src: &str) -> Entry {
        let (c, d, r): (SocketAddr, SocketAddr, SocketAddr) = (
            client.parse().unwrap(),
            orig_dst.parse().unwrap(),
            reply_src.parse().unwrap(),
        );
        Entry {
            orig: Tuple::new(c.ip(), c.port(), d.ip(), d.port(), IPPROTO_UDP),
            reply: Tuple::new(r.ip(), r.port(), c.ip(), c.port(), IPPROTO_UDP),
            zone: ZoneScope::None,
            id: None,
            mark: 0,
            status: 0,
            timeout: 30,
        }
    }

    /// A cleaner's view: state, index, and the filter of each round.
    struct World {
        st: ClusterState,
        index: FrontendIndex,
    }
    impl World {
        fn new() -> World {
            World {
                st: ClusterState::new(),
                index: FrontendIndex::new(),
            }
        }
        fn round(&mut self) -> StaleFilter {
            let ch = self.st.take_changes();
            build_filter(
                &ch,
                &mut self.index,
                &self.st,
                FrontendKinds::CLUSTER_IP_ONLY,
            )
        }
    }

    const CLIENT: &str = "10.244.0.2:40000";

    #[test]
    fn startup_keeps_flows_to_serving_endpoints() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true), ("10.244.2.2", true)]));
        let f = w.round();
        // The initial snapshot reports the service as newly active: only flows that do not point at a serving
        // endpoint go (those left from a previous agent's time or an un-NATed black hole).
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.2.2:5353")));
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.96.0.10:53")));
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.9.9:5353")));
        assert_eq!(w.index.len(), 1, "only the UDP port is indexed");
        // Nothing changed: nothing to clean.
        assert!(w.round().is_empty());
    }

    #[test]
    fn service_without_endpoints_at_startup_is_left_alone() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        let f = w.round();
        assert!(f.is_empty(), "{f:?}");
    }

    #[test]
    fn zero_to_one_endpoint_cleans_black_holes() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        assert!(w.round().is_empty());
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true)]));
        let f = w.round();
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.96.0.10:53")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
    }

    #[test]
    fn removed_endpoint_flows_go_to_the_survivors() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true), ("10.244.2.2", true)]));
        w.round();
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true)]));
        let f = w.round();
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.2.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
        // No longer serving counts as removed.
        w.st.apply_slice(slice(
            "echo",
            &[("10.244.1.2", false), ("10.244.3.2", true)],
        ));
        let f = w.round();
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.3.2:5353")));
        // Adding an endpoint to a service that has some is no reason to look.
        w.st.apply_slice(slice("echo", &[("10.244.3.2", true), ("10.244.4.2", true)]));
        assert!(w.round().is_empty());
    }

    #[test]
    fn deleted_service_takes_its_ip() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        w.st.apply_service(
            key("other"),
            vec![port("other", "udp", Protocol::Udp, 53, "10.96.0.11")],
        );
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true)]));
        w.st.apply_slice(slice("other", &[("10.244.1.2", true)]));
        w.round();
        w.st.delete_service(&key("echo"));
        let f = w.round();
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:9", "10.96.0.10:9")));
        // Other services' flows stay.
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.11:53", "10.244.1.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.11:53", "10.96.0.11:53")));
        assert!(f.only_delete_all(), "{f:?}");
    }

    #[test]
    fn removed_or_renumbered_port_takes_its_frontend_only() {
        let mut w = World::new();
        w.st.apply_service(
            key("dns"),
            vec![
                port("dns", "a", Protocol::Udp, 53, "10.96.0.53"),
                port("dns", "b", Protocol::Udp, 54, "10.96.0.53"),
            ],
        );
        w.round();
        // Port b removed: 10.96.0.53 is still in use (no deleted IP), but :54 is gone.
        w.st.apply_service(
            key("dns"),
            vec![port("dns", "a", Protocol::Udp, 53, "10.96.0.53")],
        );
        let f = w.round();
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.53:54", "10.244.1.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.53:53", "10.244.1.2:5353")));
        // Port a renumbered 53 → 5300 (same name): flows to :53 are stale.
        w.st.apply_service(
            key("dns"),
            vec![port("dns", "a", Protocol::Udp, 5300, "10.96.0.53")],
        );
        let f = w.round();
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.53:53", "10.244.1.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.53:5300", "10.244.1.2:5353")));
    }

    #[test]
    fn frontend_taken_over_by_another_service_is_judged_by_its_endpoints() {
        let mut w = World::new();
        w.st.apply_service(
            key("old"),
            vec![port("old", "udp", Protocol::Udp, 53, "10.96.0.10")],
        );
        w.st.apply_slice(slice("old", &[("10.244.1.2", true)]));
        w.round();
        w.st.delete_service(&key("old"));
        w.st.apply_service(
            key("new"),
            vec![port("new", "udp", Protocol::Udp, 53, "10.96.0.10")],
        );
        w.st.apply_slice(slice("new", &[("10.244.2.2", true)]));
        let f = w.round();
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.2.2:5353")));
    }

    #[test]
    fn pending_merges_failed_rounds() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true), ("10.244.2.2", true)]));
        w.round();
        let mut pending = Pending::new();
        // Round 1 fails: .2 removed.
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true)]));
        pending.merge(&w.st.take_changes());
        // Round 2 fails too: a service without endpoints added.
        w.st.apply_service(
            key("x"),
            vec![port("x", "udp", Protocol::Udp, 53, "10.96.0.99")],
        );
        pending.merge(&w.st.take_changes());
        // Round 3 succeeds with nothing new of its own.
        pending.merge(&w.st.take_changes());
        let f = build_filter(
            pending.changes(),
            &mut w.index,
            &w.st,
            FrontendKinds::CLUSTER_IP_ONLY,
        );
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.2.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
        // Merging is idempotent.
        let once = pending.clone();
        let c = pending.changes().clone();
        pending.merge(&c);
        assert_eq!(pending, once);
        pending.clear();
        assert!(pending.is_empty());
    }

    #[test]
    fn targets_of_a_failed_cleanup_are_judged_by_the_endpoints_of_the_retry() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true), ("10.244.2.2", true)]));
        w.round();
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true)]));
        let ch = w.st.take_changes();
        // The cleanup after this commit fails: its targets are kept.
        let kept = collect_targets(&ch, &mut w.index, &w.st, FrontendKinds::CLUSTER_IP_ONLY);
        assert_eq!(kept.judged.len(), 1);
        // Before the retry an endpoint is added (and the next commit's own changes say nothing stale).
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true), ("10.244.3.2", true)]));
        let mut t = collect_targets(
            &w.st.take_changes(),
            &mut w.index,
            &w.st,
            FrontendKinds::CLUSTER_IP_ONLY,
        );
        assert!(t.is_empty());
        t.merge(kept);
        let f = resolve(&t, &w.index, &w.st);
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.2.2:5353")));
        // The endpoint added since serves: its flows are not deleted by the retried targets.
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.3.2:5353")));
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));

        // A deleted service's targets, retried after its address was taken by a new service: judged too.
        w.st.delete_service(&key("echo"));
        let kept = collect_targets(
            &w.st.take_changes(),
            &mut w.index,
            &w.st,
            FrontendKinds::CLUSTER_IP_ONLY,
        );
        assert!(resolve(&kept, &w.index, &w.st).only_delete_all());
        w.st.apply_service(
            key("new"),
            vec![port("new", "udp", Protocol::Udp, 53, "10.96.0.10")],
        );
        w.st.apply_slice(SliceInfo {
            name: "new-a".into(),
            ..slice("new", &[("10.244.3.2", true)])
        });
        let mut t = collect_targets(
            &w.st.take_changes(),
            &mut w.index,
            &w.st,
            FrontendKinds::CLUSTER_IP_ONLY,
        );
        t.merge(kept);
        let f = resolve(&t, &w.index, &w.st);
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.3.2:5353")));
        assert!(f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.1.2:5353")));
    }

    #[test]
    fn endpoint_back_before_cleanup_is_kept() {
        let mut w = World::new();
        w.st.apply_service(key("echo"), echo("10.96.0.10"));
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true), ("10.244.2.2", true)]));
        w.round();
        let mut pending = Pending::new();
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true)]));
        pending.merge(&w.st.take_changes()); // failed sync
        w.st.apply_slice(slice("echo", &[("10.244.1.2", true), ("10.244.2.2", true)]));
        pending.merge(&w.st.take_changes());
        let f = build_filter(
            pending.changes(),
            &mut w.index,
            &w.st,
            FrontendKinds::CLUSTER_IP_ONLY,
        );
        // The endpoint reported stale in round 1 serves again: its flows are healthy.
        assert!(!f.is_stale(&udp(CLIENT, "10.96.0.10:53", "10.244.2.2:5353")));
    }

    #[test]
    fn frontend_kinds_and_node_ports() {
        let mut sp = port("svc", "udp", Protocol::Udp, 53, "10.96.0.10");
        sp.external_ips = vec!["203.0.113.10".parse().unwrap()];
        sp.load_balancer_ips = vec!["198.51.100.10".parse().unwrap()];
        sp.node_port = Some(30053);
        let only = frontends_of(&sp, FrontendKinds::CLUSTER_IP_ONLY).unwrap();
        assert_eq!(only.frontends.len(), 1);
        assert_eq!(only.node_port, None);
        let all = frontends_of(&sp, FrontendKinds::ALL).unwrap();
        let ips: Vec<String> = all.frontends.iter().map(|f| f.ip.to_string()).collect();
        assert_eq!(ips, ["10.96.0.10", "198.51.100.10", "203.0.113.10"]);
        assert_eq!(
            all.node_port,
            Some(NodePort {
                port: 30053,
                proto: Protocol::Udp
            })
        );
        assert!(frontends_of(
            &port("svc", "tcp", Protocol::Tcp, 80, "10.96.0.10"),
            FrontendKinds::ALL
        )
        .is_none());

        // A NodePort service end to end through build_filter (kinds = ALL, as once the renderer has them).
        let mut st = ClusterState::new();
        let mut index = FrontendIndex::new();
        st.apply_service(key("svc"), vec![sp.clone()]);
        st.take_changes();
        st.apply_slice(SliceInfo {
            name: "svc-a".into(),
            ..slice("svc", &[("10.244.1.2", true)])
        });
        let ch = st.take_changes();
        let f = build_filter(&ch, &mut index, &st, FrontendKinds::ALL);
        assert!(f.is_stale(&udp(
            "192.168.200.2:4000",
            "192.168.200.1:30053",
            "192.168.200.1:30053"
        )));
        assert!(!f.is_stale(&udp(
            "192.168.200.2:4000",
            "192.168.200.1:30053",
            "10.244.1.2:5353"
        )));
        assert!(f.is_stale(&udp(
            "192.168.200.2:4000",
            "203.0.113.10:53",
            "203.0.113.10:53"
        )));
        // The NodePort removed from the service: every flow to it goes.
        let mut no_np = sp.clone();
        no_np.node_port = None;
        st.apply_service(key("svc"), vec![no_np]);
        let ch = st.take_changes();
        let f = build_filter(&ch, &mut index, &st, FrontendKinds::ALL);
        assert!(f.is_stale(&udp(
            "192.168.200.2:4000",
            "192.168.200.1:30053",
            "10.244.1.2:5353"
        )));
        assert!(!f.is_stale(&udp(
            "192.168.200.2:4000",
            "10.96.0.10:53",
            "10.244.1.2:5353"
        )));
    }
}
