//! What each service port contributes (set elements, and which shared chains it needs), and the endpoint
//! selection rules (readiness fallback, topology hints, traffic policies). The fixed objects are in
//! `base.rs`, the `lb-*`, `pick` and firewall chains in `chains.rs`.
//!
//! The shape is chosen so that the kernel loads it in linear time and so that services come and go, and
//! endpoints change, by **set elements only** (docs/kernel-facts.md, "Why set elements only", shape D):
//! - `services` (reached from nat prerouting and output) looks up `daddr . l4proto . dport` in plain sets,
//!   one per shared `lb…` chain (ClusterIP, external, NodePort, externalTrafficPolicy Local; with or without
//!   affinity), and goes to the chain of the set that holds it: one lookup for a ClusterIP, a few for the
//!   rarer kinds, whatever the number of services. Membership is data, so a service added or removed never
//!   makes the kernel re-validate the table; only frontends with a chain of their own (more than 32
//!   endpoints, loadBalancerSourceRanges) are verdict elements of `service-ips`.
//! - `lb…` marks for masquerade when the source is outside the cluster CIDR (or always, with
//!   masquerade-all) and jumps to `pick`, which draws an endpoint:
//!   `dnat to daddr . l4proto . dport . numgen random mod m offset o` looked up in `service-endpoints`, where
//!   a frontend with n endpoints repeats them over the first n·⌊m/n⌋ slots of the draw of the smallest m ≥ n
//!   (`chains::DRAWS`). A draw either finds each endpoint with probability exactly 1/n or misses; after two
//!   rounds of misses, a search by count (the `pick-over-*` and `pick-bit-*` sets) ends in a rule drawing
//!   `mod n` among the same slots. An endpoint count is thus data: a change of count replaces the service's
//!   slot elements and set memberships and nothing else.
//! - postrouting masquerades marked packets and hairpin connections (an endpoint reaching itself through its
//!   service: `ct status dnat` and `saddr . daddr` in `hairpin-endpoints`).
//! - filter forward and output reject whatever still goes to a ClusterIP after NAT: a service with no
//!   endpoints, or a port that is no service port (TCP: reset; others: ICMP port unreachable); external
//!   frontends and NodePorts without endpoints are rejected through the plain sets `no-endpoint-services`
//!   and `no-endpoint-nodeports`.
//!
//! No per-service chain or rule exists, so adding a service never adds a rule (rules make the kernel
//! re-validate the whole table), and no anonymous set is bound per service (quadratic in the kernel).

use super::chains::*;
use super::claims::{FrontendKind, Precedence};
use super::common::*;
use super::names::*;
use super::{Piece, RenderConfig};
use nftkube_model::NodePortAddresses;
use nftkube_model::{Cidr, Endpoint, IpFamily, ServicePort, TrafficPolicy};
use nftkube_nft::build::{concat_key, ip_bytes, push_field};
use nftkube_nft::ir::*;
use std::net::IpAddr;

/// Topology hints, as kube-proxy applies them to cluster-wide endpoint sets: when every endpoint has node hints
/// and some are for this node, only those; else when every endpoint has zone hints and some are for this
/// node's zone, only those; else all of them.
pub(super) fn topology_filter(eps: Vec<Endpoint>, cfg: &RenderConfig) -> Vec<Endpoint> {
    if eps.is_empty() {
        return eps;
    }
    if eps.iter().all(|e| !e.node_hints.is_empty()) {
        let mine: Vec<Endpoint> = eps
            .iter()
            .filter(|e| e.node_hints.contains(&cfg.node_name))
            .cloned()
            .collect();
        if !mine.is_empty() {
            return mine;
        }
    }
    if let Some(zone) = &cfg.node_zone {
        if eps.iter().all(|e| !e.zone_hints.is_empty()) {
            let mine: Vec<Endpoint> = eps
                .iter()
                .filter(|e| e.zone_hints.contains(zone))
                .cloned()
                .collect();
            if !mine.is_empty() {
                return mine;
            }
        }
    }
    eps
}

/// Ready endpoints of the family; when none is ready, the serving ones that are terminating (kube-proxy's
/// fallback so that a rolling update does not black-hole a service).
pub fn usable_endpoints(all: &[Endpoint], f: IpFamily) -> Vec<Endpoint> {
    let ready = ready_endpoints(all, f);
    if !ready.is_empty() {
        return ready;
    }
    terminating_fallback(all, f)
}

/// The endpoints of cluster-wide traffic, as kube-proxy's `CategorizeEndpoints` picks them: the ready ones
/// narrowed by topology hints; when none is ready anywhere, the serving terminating ones, whatever their
/// hints (a hint describes where traffic should go when there is a choice; in the fallback there is none).
fn cluster_endpoints(all: &[Endpoint], f: IpFamily, cfg: &RenderConfig) -> Vec<Endpoint> {
    let ready = ready_endpoints(all, f);
    if !ready.is_empty() {
        return topology_filter(ready, cfg);
    }
    terminating_fallback(all, f)
}

fn ready_endpoints(all: &[Endpoint], f: IpFamily) -> Vec<Endpoint> {
    all.iter()
        .filter(|e| IpFamily::of(&e.ip) == f && e.ready)
        .cloned()
        .collect()
}

fn terminating_fallback(all: &[Endpoint], f: IpFamily) -> Vec<Endpoint> {
    all.iter()
        .filter(|e| IpFamily::of(&e.ip) == f && e.serving && e.terminating)
        .cloned()
        .collect()
}

/// What one service port contributes, in both families.
pub(super) fn service_pieces(
    svc: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &RenderConfig,
) -> Vec<Piece> {
    let local_endpoints: Vec<Endpoint> = endpoints
        .iter()
        .filter(|e| {
            !cfg.node_name.is_empty() && e.node_name.as_deref() == Some(cfg.node_name.as_str())
        })
        .cloned()
        .collect();
    let mut pieces = Vec::new();
    for f in [IpFamily::V4, IpFamily::V6] {
        let mut all = cluster_endpoints(endpoints, f, cfg);
        let mut local = usable_endpoints(&local_endpoints, f);
        cap_endpoints(svc, f, &mut all);
        cap_endpoints(svc, f, &mut local);
        let mut family = FamilyPieces {
            svc,
            cfg,
            f,
            precedence: Precedence::of(svc, FrontendKind::ClusterIp),
            family: nft_family(f),
            all: &all,
            local: &local,
            pieces: &mut pieces,
        };
        family.add();
    }
    // Kept for the life of the service in the sync index: no spare capacity.
    pieces.shrink_to_fit();
    pieces
}

/// Keeps the first `MAX_ENDPOINTS` of a frontend's endpoints (the slot space of one count): the rest are
/// logged and counted, never dropped silently.
fn cap_endpoints(svc: &ServicePort, f: IpFamily, eps: &mut Vec<Endpoint>) {
    if eps.len() <= MAX_ENDPOINTS {
        return;
    }
    let over = eps.len() - MAX_ENDPOINTS;
    tracing::warn!(
        service = %svc.name, family = ?f, endpoints = eps.len(), left_out = over,
        "more endpoints than one frontend can hold; the first {MAX_ENDPOINTS} are used"
    );
    nftkube_metrics::ENDPOINTS_OVER_CAP.inc_by(over as u64);
    eps.truncate(MAX_ENDPOINTS);
}

/// Where a frontend's packets go: the chain that chooses its endpoint and, for a shared chain, the set that
/// dispatches to it (see `chains::dispatch_set`).
struct Lb {
    chain: String,
    set: Option<&'static str>,
    /// A NodePort's: keyed by protocol and port alone.
    node_port: bool,
}

/// The pieces of one service port in one family, section by section.
struct FamilyPieces<'a> {
    svc: &'a ServicePort,
    cfg: &'a RenderConfig,
    f: IpFamily,
    /// The claim of the frontend whose elements are being added (see `claims`).
    precedence: Precedence,
    family: Family,
    /// The endpoints chosen among (readiness fallback and topology hints applied).
    all: &'a [Endpoint],
    /// This node's endpoints (readiness fallback applied).
    local: &'a [Endpoint],
    pieces: &'a mut Vec<Piece>,
}

impl FamilyPieces<'_> {
    fn add(&mut self) {
        let cluster = self.of_family(&self.svc.cluster_ips);
        let mut external = match self.cfg.serve_external_ips {
            true => self.of_family(&self.svc.external_ips),
            false => Vec::new(),
        };
        external.extend(self.of_family(&self.svc.load_balancer_ips));
        external.sort();
        external.dedup();
        external.retain(|ip| !cluster.contains(ip));
        if cluster.is_empty() && external.is_empty() {
            return;
        }
        // ClientIP affinity: every frontend of the service records its connections' endpoints.
        let record = self.svc.session_affinity_timeout.map(|seconds| {
            let chain = super::affinity_chain(self.family, seconds);
            let target = chain.chain.name.clone();
            self.pieces.push(Piece::Chain {
                family: self.family,
                chain,
            });
            target
        });
        if record.is_some() {
            let protocol = vec![self.svc.protocol.number()];
            self.element(SET_AFFINITY_PROTOCOLS, protocol, None);
        }
        self.cluster_ips(&cluster, record.as_deref());
        self.external_ips(&external, record.as_deref());
        self.node_port(record.as_deref());
        self.hairpin();
    }

    fn of_family(&self, ips: &[IpAddr]) -> Vec<IpAddr> {
        ips.iter()
            .copied()
            .filter(|ip| IpFamily::of(ip) == self.f)
            .collect()
    }

    fn etp_local(&self) -> bool {
        self.svc.external_traffic_policy == TrafficPolicy::Local
    }

    /// Endpoints exist, none on this node, and a Local policy applies (`itp`: internal, else external).
    fn none_local(&self, local_policy: bool) -> bool {
        local_policy && self.local.is_empty() && !self.all.is_empty()
    }

    fn element(&mut self, set: &'static str, key: Vec<u8>, value: Option<ElementValue>) {
        self.pieces.push(Piece::Element {
            family: self.family,
            set: PieceSet::named(set),
            element: Element {
                key: key.into(),
                value,
            },
            precedence: self.precedence,
        });
    }

    fn goto(&mut self, set: &'static str, key: &[Vec<u8>], chain: &str) {
        let verdict = ElementValue::Verdict(Verdict::Goto(chain.into()));
        self.element(set, concat_key(key), Some(verdict));
    }

    fn member(&mut self, set: &'static str, key: &[Vec<u8>]) {
        self.element(set, concat_key(key), None);
    }

    /// The endpoints `eps` in their slots, under the frontend (or port) `key`: with a shared `lb*` chain
    /// (`lb.set`), endpoint k at slots k, k + n, … of its draw (`chains::shared_slots`) and the frontend's way
    /// through the `pick` chains' search; with a chain of its own count n, endpoint k at slot k of region n.
    fn slots(&mut self, lb: &Lb, key: &[Vec<u8>], eps: &[Endpoint], local: bool) {
        let node_port = lb.node_port;
        let set = match node_port {
            true => MAP_NODEPORT_ENDPOINTS,
            false => MAP_SERVICE_ENDPOINTS,
        };
        if lb.set.is_some() && !eps.is_empty() {
            // The frontend's way through the `pick` chains to the rule of its count: one `-over-` set per
            // group of eight counts passed, then the `-bit-` sets of its place within its group.
            let place = (eps.len() - 1) as u32;
            for group in 0..place / PICK_GROUP {
                self.member(pick_over_set(node_port, local, group as usize), key);
            }
            for bit in [4, 2, 1] {
                if (place % PICK_GROUP) & bit != 0 {
                    self.member(pick_bit_set(node_port, local, bit), key);
                }
            }
        }
        let n = eps.len() as u32;
        let (first, filled) = match lb.set {
            Some(_) => shared_slots(n, local),
            None => (region(n, local), n),
        };
        // `concat_key(key . slot)` and `concat_key(ip . port)`, built in two buffers reused for every
        // slot: a million endpoints made ten million small allocations here.
        let mut full = Vec::with_capacity(64);
        for part in key {
            push_field(&mut full, part);
        }
        let frontend = full.len();
        let mut endpoint = Vec::with_capacity(20);
        let set = PieceSet::named(set);
        for (k, ep) in (0..filled).zip(eps.iter().cycle()) {
            full.truncate(frontend);
            push_field(&mut full, &(first + k).to_ne_bytes());
            endpoint.clear();
            match ep.ip {
                IpAddr::V4(ip) => push_field(&mut endpoint, &ip.octets()),
                IpAddr::V6(ip) => push_field(&mut endpoint, &ip.octets()),
            }
            push_field(&mut endpoint, &ep.port.to_be_bytes());
            self.pieces.push(Piece::Element {
                family: self.family,
                set,
                element: Element {
                    key: full.as_slice().into(),
                    value: Some(ElementValue::Data(endpoint.as_slice().into())),
                },
                precedence: self.precedence,
            });
        }
    }

    /// Where frontends of `kind` with these counts are dispatched: the shared chain of the kind (a skeleton
    /// chain, reached through its dispatch set), or a chain of their own count, as a piece.
    fn lb(&mut self, kind: LbKind, all: usize, local: usize) -> Lb {
        let affinity = self.svc.session_affinity_timeout.is_some();
        let counts = Counts::of(all, local);
        if counts == Counts::Shared {
            return Lb {
                chain: lb_name(kind, counts, affinity),
                set: Some(dispatch_set(kind, affinity)),
                node_port: kind.is_node_port(),
            };
        }
        let chain = super::lb_chain(self.family, kind, counts, affinity, self.cfg);
        let target = chain.chain.name.clone();
        self.pieces.push(Piece::Chain {
            family: self.family,
            chain,
        });
        Lb {
            chain: target,
            set: None,
            node_port: kind.is_node_port(),
        }
    }

    /// The frontend `key` is dispatched to `lb`, or through `firewall` first. Only the exceptions (a chain of
    /// its own) are verdict elements; see `base::add_dispatch`.
    fn dispatch(&mut self, key: &[Vec<u8>], lb: &Lb, firewall: Option<&str>) {
        let (exceptions, other, first) = match lb.node_port {
            false => (MAP_SERVICE_IPS, SET_OTHER_SERVICE_IPS, SET_LB_IPS),
            true => (
                MAP_SERVICE_NODEPORTS,
                SET_OTHER_SERVICE_NODEPORTS,
                SET_LB_NP_PORTS,
            ),
        };
        match (firewall, lb.set) {
            (None, Some(set)) => {
                self.member(set, key);
                if set == first {
                    return; // tried before `other`
                }
            }
            (Some(chain), _) => self.goto(exceptions, key, chain),
            (None, None) => self.goto(exceptions, key, &lb.chain),
        }
        self.member(other, key);
    }

    fn frontend(&self, ip: &IpAddr) -> Vec<Vec<u8>> {
        let proto = vec![self.svc.protocol.number()];
        vec![ip_bytes(ip), proto, self.svc.port.to_be_bytes().to_vec()]
    }

    /// ClusterIPs (internalTrafficPolicy). Every frontend is dispatched to its `lb*` chain whatever its
    /// endpoint count, zero included, so that a change of count changes elements only. Without endpoints
    /// a ClusterIP's packet leaves NAT untouched and is rejected in filter (every port of a ClusterIP is
    /// ours); internalTrafficPolicy Local without a local endpoint, while endpoints exist elsewhere: dropped.
    fn cluster_ips(&mut self, cluster: &[IpAddr], record: Option<&str>) {
        for ip in cluster {
            self.element(SET_CLUSTER_IPS, ip_bytes(ip), None);
        }
        if cluster.is_empty() {
            return;
        }
        self.precedence = Precedence::of(self.svc, FrontendKind::ClusterIp);
        let itp_local = self.svc.internal_traffic_policy == TrafficPolicy::Local;
        let internal = if itp_local { self.local } else { self.all };
        let lb = self.lb(LbKind::Cluster, internal.len(), 0);
        for ip in cluster {
            let key = self.frontend(ip);
            self.slots(&lb, &key, internal, false);
            self.dispatch(&key, &lb, None);
            if self.none_local(itp_local) {
                self.member(SET_NO_LOCAL_ENDPOINTS, &key);
            }
            if let Some(r) = record {
                self.goto(MAP_AFFINITY_SERVICES, &key, r);
            }
        }
    }

    /// External and LoadBalancer IPs (externalTrafficPolicy; loadBalancerSourceRanges). Without endpoints
    /// they are rejected in filter, per port (external addresses may serve other things on other ports).
    fn external_ips(&mut self, external: &[IpAddr], record: Option<&str>) {
        if external.is_empty() {
            return;
        }
        let kind = if self.etp_local() {
            LbKind::LocalExternal
        } else {
            LbKind::External
        };
        let lb = self.lb(kind, self.all.len(), self.local.len());
        let firewall = self.firewall(&lb.chain);
        for ip in external {
            self.precedence = Precedence::of_address(self.svc, ip);
            let key = self.frontend(ip);
            self.slots(&lb, &key, self.all, false);
            if self.etp_local() {
                self.slots(&lb, &key, self.local, true);
            }
            let through = match &firewall {
                Some(fw) if self.svc.load_balancer_ips.contains(ip) => Some(fw.as_str()),
                _ => None,
            };
            self.dispatch(&key, &lb, through);
            if self.all.is_empty() {
                self.member(SET_NO_ENDPOINT_SERVICES, &key);
            } else if self.none_local(self.etp_local()) {
                self.member(SET_NO_LOCAL_ENDPOINTS, &key);
            }
            if let Some(r) = record {
                self.goto(MAP_AFFINITY_SERVICES, &key, r);
            }
        }
    }

    /// loadBalancerSourceRanges filter the LoadBalancer IPs (not external IPs, not the NodePort) before
    /// DNAT, in a chain of this service's own that goes on to `target`.
    fn firewall(&mut self, target: &str) -> Option<String> {
        let ranges: Vec<&Cidr> = self
            .svc
            .load_balancer_source_ranges
            .iter()
            .filter(|c| c.family() == self.f)
            .collect();
        if ranges.is_empty() {
            return None;
        }
        let pass = Verdict::Goto(target.into());
        let chain = firewall_chain_state(self.svc, self.f, &ranges, pass, self.cfg);
        let name = chain.chain.name.clone();
        self.pieces.push(Piece::Chain {
            family: self.family,
            chain: std::sync::Arc::new(chain),
        });
        Some(name)
    }

    /// The NodePort, keyed by protocol and port (externalTrafficPolicy), where NodePorts are served.
    fn node_port(&mut self, record: Option<&str>) {
        let Some(np) = self.svc.node_port else { return };
        if self.cfg.nodeport_addresses == NodePortAddresses::None {
            return;
        }
        let kind = if self.etp_local() {
            LbKind::LocalNodePort
        } else {
            LbKind::NodePort
        };
        let lb = self.lb(kind, self.all.len(), self.local.len());
        self.precedence = Precedence::of(self.svc, FrontendKind::NodePort);
        let key = vec![vec![self.svc.protocol.number()], np.to_be_bytes().to_vec()];
        self.slots(&lb, &key, self.all, false);
        if self.etp_local() {
            self.slots(&lb, &key, self.local, true);
        }
        self.dispatch(&key, &lb, None);
        if self.all.is_empty() {
            self.member(SET_NO_ENDPOINT_NODEPORTS, &key);
        } else if self.none_local(self.etp_local()) {
            self.member(SET_NO_LOCAL_NODEPORTS, &key);
        }
        if let Some(r) = record {
            self.goto(MAP_AFFINITY_NODEPORTS, &key, r);
        }
    }

    /// An endpoint reaching itself through the service is masqueraded (`saddr . daddr`). Usually only this
    /// node's endpoints can: a pod's connection to a ClusterIP, an external or a load-balancer address is
    /// NATed on the pod's own node, and NodePort traffic from other nodes is masqueraded on its way in. The
    /// exception is a NodePort with externalTrafficPolicy Local, which sends pods of other nodes to every
    /// endpoint unmasqueraded (their own included). Elsewhere, endpoints on other nodes get no element: at a
    /// million endpoints that halved the kernel's elements. An endpoint whose node is unknown (no
    /// `nodeName`, or no node name of ours) counts as this node's.
    fn hairpin(&mut self) {
        let node = self.cfg.node_name.as_str();
        let every = node.is_empty() || (self.svc.node_port.is_some() && self.etp_local());
        let here = |e: &&Endpoint| every || e.node_name.as_deref().is_none_or(|n| n == node);
        let mut hairpin: Vec<&Endpoint> = self
            .all
            .iter()
            .filter(here)
            .chain(self.local.iter())
            .collect();
        hairpin.sort();
        hairpin.dedup();
        for ep in hairpin {
            let key = concat_key(&[ip_bytes(&ep.ip), ip_bytes(&ep.ip)]);
            self.element(SET_HAIRPIN, key, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::*;
    use nftkube_model::*;
    use std::collections::BTreeMap;

    /// The dispatch sets (and exception maps) holding the TCP frontend `ip . tcp . port`.
    fn dispatch_of(t: &TableState, ip: &str, port: u16) -> Vec<&'static str> {
        let ip: IpAddr = ip.parse().unwrap();
        let key = concat_key(&[ip_bytes(&ip), vec![6], port.to_be_bytes().to_vec()]);
        DISPATCH_SETS
            .into_iter()
            .filter(|s| t.sets[*s].elements.iter().any(|e| *e.key == *key))
            .collect()
    }

    fn svc(name: &str, ip: &str, port: u16, proto: Protocol) -> (ServicePortName, ServicePort) {
        let spn = ServicePortName {
            service: NamespacedName::new("ns", name),
            port: "p".into(),
            protocol: proto,
        };
        let sp = ServicePort::cluster_ip(spn.clone(), vec![ip.parse().unwrap()], port);
        (spn, sp)
    }

    fn ep(ip: &str, port: u16, ready: bool) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            port,
            ready,
            serving: ready,
            terminating: false,
            node_name: None,
            zone: None,
            zone_hints: vec![],
            node_hints: vec![],
        }
    }

    #[test]
    fn endpoints_past_the_cap_are_counted_not_dropped_silently() {
        let (spn, sp) = svc("big", "10.96.0.1", 80, Protocol::Tcp);
        let eps: Vec<Endpoint> = (0..MAX_ENDPOINTS as u32 + 3)
            .map(|i| {
                ep(
                    &std::net::Ipv4Addr::from(0x0a00_0000 + i).to_string(),
                    8080,
                    true,
                )
            })
            .collect();
        let before = nftkube_metrics::ENDPOINTS_OVER_CAP.get();
        let pieces = service_pieces(&sp, &eps, &RenderConfig::default());
        assert!(nftkube_metrics::ENDPOINTS_OVER_CAP.get() >= before + 3);
        let slots = pieces
            .iter()
            .filter(|p| matches!(p, Piece::Element { set, .. } if set.has_slot_keys()))
            .count();
        assert_eq!(slots, MAX_ENDPOINTS, "{spn}");
    }

    #[test]
    fn endpoints_fill_their_draw_and_dispatch_goes_to_the_kind_chain() {
        let (spn, sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let eps: EndpointsMap = [(
            spn.clone(),
            vec![
                ep("10.0.0.1", 8080, true),
                ep("10.0.0.2", 8080, true),
                ep("10.0.0.3", 8080, true),
            ],
        )]
        .into();
        let tables = render(&services, &eps, &RenderConfig::default());
        let v4 = &tables[0];
        let text = nftkube_nft::text::render_table(v4);
        assert_eq!(dispatch_of(v4, "10.96.0.1", 80), [SET_LB_IPS]);
        // Three endpoints fill six of the eight slots of the first draw: the third at slots 2 and 5.
        let (first, filled) = shared_slots(3, false);
        assert_eq!((first, filled), (0, 6));
        for slot in [2, 5] {
            let element = format!("10.96.0.1 . tcp . 80 . {slot} : 10.0.0.3 . 8080");
            assert!(text.contains(&element), "{text}");
        }
        for rule in [
            "dnat ip addr . port to ip daddr . meta l4proto . th dport . numgen random mod 8 map @service-endpoints",
            "dnat ip addr . port to ip daddr . meta l4proto . th dport . numgen random mod 3 map @service-endpoints",
        ] {
            assert!(text.contains(rule), "{text}");
        }
        assert_eq!(v4.sets[MAP_SERVICE_ENDPOINTS].elements.len(), 6);
        assert_eq!(v4.sets[SET_HAIRPIN].elements.len(), 3);
        // The skeleton's shared chains only; no chain per count, none per service, no verdict element.
        let skeleton = &crate::skeleton(&RenderConfig::default())[0];
        assert_eq!(
            v4.chains.keys().collect::<Vec<_>>(),
            skeleton.chains.keys().collect::<Vec<_>>()
        );
        assert!(v4.sets[MAP_SERVICE_IPS].elements.is_empty());
        // The v6 table exists but holds no service.
        assert!(tables[1].sets[SET_LB_IPS].elements.is_empty());
    }

    /// `affinity-record` returns at once for a protocol no affinity frontend has: the protocols of the services
    /// with ClientIP affinity are in `affinity-protocols`, once each however many services share one.
    #[test]
    fn affinity_protocols_hold_the_protocols_of_affinity_services_only() {
        let protocols = |services: &[(&str, Protocol, bool)]| -> Vec<Vec<u8>> {
            let mut map = ServiceMap::new();
            let mut eps = EndpointsMap::new();
            for (i, (name, protocol, affinity)) in services.iter().enumerate() {
                let (spn, mut sp) = svc(name, &format!("10.96.0.{}", i + 1), 80, *protocol);
                sp.session_affinity_timeout = affinity.then_some(60);
                eps.insert(spn.clone(), vec![ep("10.0.0.1", 8080, true)]);
                map.insert(spn, sp);
            }
            let t = &render(&map, &eps, &RenderConfig::default())[0];
            t.sets[SET_AFFINITY_PROTOCOLS]
                .elements
                .iter()
                .map(|e| e.key.to_vec())
                .collect()
        };
        assert!(protocols(&[("a", Protocol::Tcp, false)]).is_empty());
        assert_eq!(
            protocols(&[
                ("a", Protocol::Tcp, true),
                ("b", Protocol::Tcp, true),
                ("c", Protocol::Udp, false),
            ]),
            [vec![6]]
        );
        assert_eq!(
            protocols(&[("a", Protocol::Tcp, false), ("b", Protocol::Udp, true)]),
            [vec![17]]
        );
        let skeleton = &crate::skeleton(&RenderConfig::default())[0];
        let text = nftkube_nft::text::render_table(skeleton);
        let record = text.split("chain affinity-record {\n").nth(1).unwrap();
        let first = record.lines().next().unwrap().trim();
        assert_eq!(first, "meta l4proto != @affinity-protocols return");
    }

    #[test]
    fn service_without_ready_endpoints_is_dispatched_to_no_slot_and_listed_for_rejection() {
        let (spn, sp) = svc("a", "10.96.0.1", 80, Protocol::Udp);
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let eps: EndpointsMap = [(spn.clone(), vec![ep("10.0.0.1", 8080, false)])].into();
        let t = &render(&services, &eps, &RenderConfig::default())[0];
        // Dispatched like any ClusterIP (so that its first endpoint adds elements only), but no rule of
        // `pick` finds a slot: NAT leaves the packet alone and filter rejects it by its ClusterIP.
        assert_eq!(t.sets[SET_LB_IPS].elements.len(), 1);
        assert!(t.sets[MAP_SERVICE_ENDPOINTS].elements.is_empty());
        assert!(t.sets[SET_NO_LOCAL_ENDPOINTS].elements.is_empty());
        assert_eq!(t.sets[SET_CLUSTER_IPS].elements.len(), 1);
    }

    /// Issue 14 part 6: a service going from n to m endpoints (zero included, local or not) changes the
    /// elements of its own slots and membership sets, and nothing else: no verdict element, no chain.
    #[test]
    fn endpoint_count_changes_are_data_only() {
        let (spn, mut sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        sp.external_ips = vec!["192.168.250.10".parse().unwrap()];
        sp.node_port = Some(30080);
        sp.session_affinity_timeout = Some(60);
        let cfg = RenderConfig {
            node_name: "n1".into(),
            nodeport_addresses: NodePortAddresses::AllLocal,
            ..RenderConfig::default()
        };
        let endpoint = |i: u8, node: &str| {
            let mut e = ep(&format!("10.0.0.{i}"), 8080, true);
            e.node_name = Some(node.into());
            e
        };
        let mut data_sets = vec![
            MAP_SERVICE_ENDPOINTS,
            MAP_NODEPORT_ENDPOINTS,
            SET_HAIRPIN,
            SET_NO_ENDPOINT_SERVICES,
            SET_NO_ENDPOINT_NODEPORTS,
            SET_NO_LOCAL_ENDPOINTS,
            SET_NO_LOCAL_NODEPORTS,
        ];
        data_sets.extend(PICK_OVER_SETS.iter().chain(&PICK_BIT_SETS).flatten());
        for (etp, itp) in [
            (TrafficPolicy::Cluster, TrafficPolicy::Cluster),
            (TrafficPolicy::Local, TrafficPolicy::Local),
        ] {
            sp.external_traffic_policy = etp;
            sp.internal_traffic_policy = itp;
            let services: ServiceMap = [(spn.clone(), sp.clone())].into();
            let structure = |n: u8, local: u8| {
                let eps: Vec<_> = (1..=n)
                    .map(|i| endpoint(i, if i <= local { "n1" } else { "n2" }))
                    .collect();
                let mut t = render(&services, &[(spn.clone(), eps)].into(), &cfg).remove(0);
                for set in &data_sets {
                    t.sets.get_mut(*set).unwrap().elements.clear();
                }
                t
            };
            let first = structure(0, 0);
            for (n, local) in [
                (1, 0),
                (1, 1),
                (3, 1),
                (7, 7),
                (9, 9),
                (32, 2),
                (2, 0),
                (0, 0),
            ] {
                assert_eq!(
                    structure(n, local),
                    first,
                    "{n} endpoints, {local} local, {etp:?}"
                );
            }
        }
    }

    /// A rule `dnat … numgen random mod m offset o map @service-endpoints` as the table's one frontend sees it:
    /// the endpoints (address and port bytes) of the slots among o..o + m it holds.
    struct Draw {
        modulus: u32,
        found: Vec<Vec<u8>>,
    }

    /// The walk of a new connection through the rendered `pick` chains, as the kernel takes it: a rule
    /// `… @<set> goto <chain>` or `… @<set> dnat …` applies when the frontend is in the set (the table holds
    /// one frontend, so: when the set has an element), and a `dnat` rule whose lookup misses lets the next
    /// rule run. Follows the misses of draws that can miss to the end (`search`: skips the draws `pick`
    /// starts with, as when all of them miss). Returns every `dnat` rule reached, in order (the last one
    /// finds a slot for every value), and the number of set lookups made on the way.
    fn walk_pick(t: &TableState, search: bool) -> (Vec<Draw>, usize) {
        let text = nftkube_nft::text::render_table(t);
        let slots: BTreeMap<u32, Vec<u8>> = t.sets[MAP_SERVICE_ENDPOINTS]
            .elements
            .iter()
            .map(|e| {
                let slot = e.key[e.key.len() - 4..].try_into().unwrap();
                let Some(ElementValue::Data(endpoint)) = &e.value else {
                    panic!("an endpoint slot without an endpoint")
                };
                (u32::from_ne_bytes(slot), endpoint.to_vec())
            })
            .collect();
        let chain_body = |name: &str| -> Vec<String> {
            let body = text
                .split(&format!("chain {name} {{\n"))
                .nth(1)
                .and_then(|rest| rest.split("\n\t}").next())
                .unwrap_or_else(|| panic!("no chain {name}:\n{text}"));
            body.lines().map(|l| l.trim().to_owned()).collect()
        };
        let number_after = |rule: &str, word: &str| -> Option<u32> {
            let rest = rule.split(word).nth(1)?;
            rest.split(' ').next()?.parse().ok()
        };
        let mut chain = "pick".to_owned();
        let (mut draws, mut lookups) = (Vec::new(), 0);
        let skip = |chain: &str| match (search, chain) {
            (true, "pick") => 1 + DRAWS.len() * DRAW_ROUNDS,
            _ => 0,
        };
        'chains: loop {
            for rule in chain_body(&chain).into_iter().skip(skip(&chain)) {
                if let Some(set) = rule.split(" @").nth(1).and_then(|r| r.split(' ').next()) {
                    if !rule.starts_with("dnat") {
                        lookups += 1;
                        if t.sets[set].elements.is_empty() {
                            continue;
                        }
                    }
                }
                if let Some(next) = rule.split(" goto ").nth(1) {
                    chain = next.to_owned();
                    continue 'chains;
                }
                let modulus = number_after(&rule, "numgen random mod ").unwrap();
                let offset = number_after(&rule, " offset ").unwrap_or(0);
                let found: Vec<Vec<u8>> = (offset..offset + modulus)
                    .filter_map(|slot| slots.get(&slot).cloned())
                    .collect();
                let always = found.len() == modulus as usize;
                draws.push(Draw { modulus, found });
                if always {
                    return (draws, lookups);
                }
            }
            panic!("the walk fell out of chain {chain}");
        }
    }

    /// A frontend with n ≤ 32 endpoints: every `pick` rule that can find one of its slots finds each of its
    /// n endpoints equally often (so each is chosen with probability exactly 1/n, whichever rule chooses), a
    /// draw hits at least half the time, and a connection that misses every draw reaches the rule of count n
    /// in at most six set lookups.
    #[test]
    fn every_shared_count_draws_uniformly_and_walks_to_its_own_rule() {
        let (spn, sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        let services: ServiceMap = [(spn.clone(), sp)].into();
        for n in 1..=33u32 {
            let eps: Vec<_> = (1..=n)
                .map(|i| ep(&format!("10.0.1.{i}"), 80, true))
                .collect();
            let t = &render(
                &services,
                &[(spn.clone(), eps)].into(),
                &RenderConfig::default(),
            )[0];
            let holds = |set: &str| !t.sets[set].elements.is_empty();
            let over: Vec<bool> = PICK_OVER_SETS[0].iter().map(|s| holds(s)).collect();
            let expected: Vec<bool> = (0..3).map(|g| n <= 32 && n > 8 * (g + 1)).collect();
            assert_eq!(over, expected, "{n} endpoints");
            assert!(PICK_OVER_SETS[1..]
                .iter()
                .chain(&PICK_BIT_SETS[1..])
                .flatten()
                .all(|s| !holds(s)));
            if n > 32 {
                assert!(PICK_BIT_SETS[0].iter().all(|s| !holds(s)), "{n} endpoints");
                continue;
            }
            let slots = t.sets[MAP_SERVICE_ENDPOINTS].elements.len();
            assert!(
                slots <= n.max(8) as usize,
                "{n} endpoints fill {slots} slots: copies beyond eight slots cost a big cluster's memory"
            );
            let (draws, _) = walk_pick(t, false);
            let (search, lookups) = walk_pick(t, true);
            for d in draws.iter().chain(&search).filter(|d| !d.found.is_empty()) {
                let mut times: BTreeMap<&[u8], usize> = BTreeMap::new();
                for endpoint in &d.found {
                    *times.entry(endpoint).or_default() += 1;
                }
                assert_eq!(times.len(), n as usize, "{n} endpoints, mod {}", d.modulus);
                let each = d.found.len() / n as usize;
                assert!(
                    times.values().all(|&k| k == each),
                    "{n} endpoints: {times:?}"
                );
            }
            let first_hit = draws.iter().find(|d| !d.found.is_empty()).unwrap();
            assert!(
                2 * first_hit.found.len() >= first_hit.modulus as usize,
                "{n}"
            );
            let last = search.last().unwrap();
            assert_eq!(
                last.modulus, n,
                "{n} endpoints: the search ends in the count's rule"
            );
            assert!(lookups <= 6, "{n} endpoints: {lookups} set lookups");
        }
    }

    #[test]
    fn terminating_serving_endpoints_are_the_fallback() {
        let mut e = ep("10.0.0.1", 8080, false);
        e.serving = true;
        e.terminating = true;
        assert_eq!(
            usable_endpoints(&[e.clone()], IpFamily::V4),
            vec![e.clone()]
        );
        let ready = ep("10.0.0.2", 8080, true);
        assert_eq!(
            usable_endpoints(&[e, ready.clone()], IpFamily::V4),
            vec![ready]
        );
    }

    #[test]
    fn topology_narrows_ready_endpoints_but_not_the_terminating_fallback() {
        let cfg = RenderConfig {
            node_zone: Some("a".into()),
            ..RenderConfig::default()
        };
        let in_zone = |ip: &str, zone: &str, ready: bool| Endpoint {
            serving: true,
            terminating: !ready,
            zone_hints: vec![zone.into()],
            ..ep(ip, 8080, ready)
        };
        let ready = [
            in_zone("10.0.0.1", "a", true),
            in_zone("10.0.0.2", "b", true),
        ];
        assert_eq!(
            cluster_endpoints(&ready, IpFamily::V4, &cfg),
            vec![ready[0].clone()]
        );
        // No endpoint is ready: every serving terminating one takes over, hints or not (kube-proxy's
        // CategorizeEndpoints falls back after topology, not before).
        let leaving = [
            in_zone("10.0.0.1", "b", false),
            in_zone("10.0.0.2", "b", false),
        ];
        assert_eq!(
            cluster_endpoints(&leaving, IpFamily::V4, &cfg),
            leaving.to_vec()
        );
        let leaving = [
            in_zone("10.0.0.1", "a", false),
            in_zone("10.0.0.2", "b", false),
        ];
        assert_eq!(
            cluster_endpoints(&leaving, IpFamily::V4, &cfg),
            leaving.to_vec()
        );
    }

    #[test]
    fn masquerade_rule_follows_config() {
        let mut cfg = RenderConfig::default();
        let lb = |cfg: &RenderConfig| {
            lb_chain_state(Family::Ip, LbKind::Cluster, Counts::Shared, false, cfg)
        };
        // jump pick; the drop of internalTrafficPolicy Local without a local endpoint.
        assert_eq!(lb(&cfg).rules.len(), 2);
        cfg.cluster_cidrs = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()];
        let t = TableState::new(Family::Ip, TABLE);
        let rules = lb(&cfg).rules;
        assert_eq!(rules.len(), 3, "only the v4 CIDR applies to the ip table");
        assert_eq!(
            nftkube_nft::text::render_rule(&rules[0], &t),
            "ip saddr != 10.0.0.0/8 meta mark set meta mark | 0x00004000 comment \"not from a pod\""
        );
        // External and LoadBalancer IPs (externalTrafficPolicy Cluster): pods' traffic is marked too.
        let ext = lb_chain_state(Family::Ip, LbKind::External, Counts::Shared, false, &cfg);
        assert_eq!(
            nftkube_nft::text::render_rule(&ext.rules[0], &t),
            "meta mark set meta mark | 0x00004000"
        );
        cfg.masquerade_all = true;
        assert_eq!(
            nftkube_nft::text::render_rule(&lb(&cfg).rules[0], &t),
            "meta mark set meta mark | 0x00004000"
        );
        // externalTrafficPolicy Local: masquerade-all leaves pods' short-circuit unmarked, as kube-proxy's
        // masquerade-all rule matches the ClusterIP only.
        let etp = lb_chain_state(
            Family::Ip,
            LbKind::LocalExternal,
            Counts::Shared,
            false,
            &cfg,
        );
        assert_eq!(
            nftkube_nft::text::render_rule(&etp.rules[0], &t),
            "ip saddr 10.0.0.0/8 jump pick comment \"from a pod: every endpoint\""
        );
    }

    /// The `AllowServiceExternalIPs` feature gate off: externalIPs are not served, LoadBalancer IPs and
    /// the ClusterIP still are.
    #[test]
    fn external_ips_are_not_served_when_the_gate_is_off() {
        let (spn, mut sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        sp.external_ips = vec!["192.168.250.10".parse().unwrap()];
        sp.load_balancer_ips = vec!["192.168.250.20".parse().unwrap()];
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let eps: EndpointsMap = [(spn.clone(), vec![ep("10.0.0.1", 8080, true)])].into();
        let cfg = RenderConfig {
            serve_external_ips: false,
            ..RenderConfig::default()
        };
        let t = &render(&services, &eps, &cfg)[0];
        let text = nftkube_nft::text::render_table(t);
        assert!(!text.contains("192.168.250.10"), "{text}");
        assert_eq!(
            dispatch_of(t, "192.168.250.20", 80),
            [SET_LB_EXT_IPS, SET_OTHER_SERVICE_IPS]
        );
        assert_eq!(dispatch_of(t, "10.96.0.1", 80), [SET_LB_IPS]);
    }

    #[test]
    fn external_and_load_balancer_ips_dispatch_like_cluster_ips_and_reject_per_port_without_endpoints(
    ) {
        let (spn, mut sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        sp.external_ips = vec!["192.168.250.10".parse().unwrap()];
        sp.load_balancer_ips = vec![
            "192.168.250.20".parse().unwrap(),
            "10.96.0.1".parse().unwrap(),
        ];
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let eps: EndpointsMap = [(
            spn.clone(),
            vec![ep("10.0.0.1", 8080, true), ep("10.0.0.2", 8080, true)],
        )]
        .into();
        let t = &render(&services, &eps, &RenderConfig::default())[0];
        let text = nftkube_nft::text::render_table(t);
        assert_eq!(dispatch_of(t, "10.96.0.1", 80), [SET_LB_IPS]);
        assert_eq!(
            dispatch_of(t, "192.168.250.10", 80),
            [SET_LB_EXT_IPS, SET_OTHER_SERVICE_IPS]
        );
        let second = shared_slots(2, false).0 + 1;
        assert!(
            text.contains(&format!(
                "192.168.250.20 . tcp . 80 . {second} : 10.0.0.2 . 8080"
            )),
            "{text}"
        );
        // External addresses are not ClusterIPs: never rejected wholesale.
        assert_eq!(t.sets[SET_CLUSTER_IPS].elements.len(), 1);
        // Without a cluster CIDR, external traffic is always masqueraded; ClusterIP traffic never.
        assert_eq!(t.chains["lb-ext"].rules.len(), 2);
        assert_eq!(t.chains["lb"].rules.len(), 2);
        assert!(t.sets[SET_NO_ENDPOINT_SERVICES].elements.is_empty());

        let none: EndpointsMap = EndpointsMap::new();
        let t = &render(&services, &none, &RenderConfig::default())[0];
        let text = nftkube_nft::text::render_table(t);
        assert_eq!(t.sets[SET_NO_ENDPOINT_SERVICES].elements.len(), 2, "{text}");
        assert!(text.contains("192.168.250.20 . tcp . 80"), "{text}");
        assert!(
            text.contains("@no-endpoint-services goto reject-chain"),
            "{text}"
        );
        // Still dispatched, so that a first endpoint adds elements only.
        assert_eq!(t.sets[SET_LB_IPS].elements.len(), 1);
        assert_eq!(t.sets[SET_LB_EXT_IPS].elements.len(), 2);
    }

    /// Hairpin elements for the endpoints that can reach themselves through this node's rules: its own and
    /// those of unknown node; every endpoint for a NodePort with externalTrafficPolicy Local (pods of other
    /// nodes reach every endpoint through it, unmasqueraded), or when the node's name is not known.
    #[test]
    fn hairpin_elements_only_where_an_endpoint_can_reach_itself() {
        let (spn, mut sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        let endpoint = |ip: &str, node: Option<&str>| {
            let mut e = ep(ip, 8080, true);
            e.node_name = node.map(Into::into);
            e
        };
        let eps: EndpointsMap = [(
            spn.clone(),
            vec![
                endpoint("10.0.0.1", Some("n1")),
                endpoint("10.0.0.2", Some("n2")),
                endpoint("10.0.0.3", None),
            ],
        )]
        .into();
        let hairpin = |sp: &ServicePort, node: &str| -> Vec<u8> {
            let cfg = RenderConfig {
                node_name: node.into(),
                ..RenderConfig::default()
            };
            let services: ServiceMap = [(spn.clone(), sp.clone())].into();
            render(&services, &eps, &cfg)[0].sets[SET_HAIRPIN]
                .elements
                .iter()
                .map(|e| e.key[3])
                .collect()
        };
        assert_eq!(
            hairpin(&sp, "n1"),
            [1, 3],
            "ClusterIP: this node's and unknown"
        );
        assert_eq!(hairpin(&sp, ""), [1, 2, 3], "no node name: every endpoint");
        sp.node_port = Some(30080);
        assert_eq!(hairpin(&sp, "n1"), [1, 3], "NodePort, policy Cluster");
        sp.external_traffic_policy = TrafficPolicy::Local;
        assert_eq!(hairpin(&sp, "n1"), [1, 2, 3], "NodePort, policy Local");
    }

    #[test]
    fn local_policies_use_local_slots_and_drop_without_local_endpoints() {
        let (spn, mut sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        sp.external_ips = vec!["192.168.250.10".parse().unwrap()];
        sp.external_traffic_policy = TrafficPolicy::Local;
        sp.internal_traffic_policy = TrafficPolicy::Local;
        let mut local = ep("10.0.0.1", 8080, true);
        local.node_name = Some("n1".into());
        let mut remote = ep("10.0.0.2", 8080, true);
        remote.node_name = Some("n2".into());
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let cfg = RenderConfig {
            node_name: "n1".into(),
            ..RenderConfig::default()
        };
        let eps: EndpointsMap = [(spn.clone(), vec![local.clone(), remote.clone()])].into();
        let t = &render(&services, &eps, &cfg)[0];
        let text = nftkube_nft::text::render_table(t);
        // ClusterIP: only the local endpoint (internalTrafficPolicy Local).
        assert_eq!(dispatch_of(t, "10.96.0.1", 80), [SET_LB_IPS]);
        let only = region(1, false);
        assert!(
            text.contains(&format!("10.96.0.1 . tcp . 80 . {only} : 10.0.0.1 . 8080")),
            "{text}"
        );
        // External: both endpoints for the short-circuit, the local one in the local slots.
        assert_eq!(
            dispatch_of(t, "192.168.250.10", 80),
            [SET_LB_ETP_IPS, SET_OTHER_SERVICE_IPS]
        );
        let local_slot = region(1, true);
        assert_eq!(local_slot, 0x8001_0000);
        assert!(
            text.contains(&format!(
                "192.168.250.10 . tcp . 80 . {local_slot} : 10.0.0.1 . 8080"
            )),
            "{text}"
        );
        assert!(
            text.contains("numgen random mod 1 offset 2147549184"),
            "{text}"
        );
        assert!(text.contains("jump pick-local comment"), "{text}");
        // No local endpoint: ClusterIP traffic and outside traffic dropped by `no-local-endpoints`.
        let eps: EndpointsMap = [(spn.clone(), vec![remote])].into();
        let t = &render(&services, &eps, &cfg)[0];
        let text = nftkube_nft::text::render_table(t);
        assert_eq!(t.sets[SET_NO_LOCAL_ENDPOINTS].elements.len(), 2, "{text}");
        assert!(
            text.contains("@no-local-endpoints drop comment \"from outside: no local endpoint\""),
            "{text}"
        );
    }

    #[test]
    fn dual_stack_services_land_in_both_tables() {
        let (spn, mut sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        sp.cluster_ips.push("fd00:96::1".parse().unwrap());
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let eps: EndpointsMap = [(
            spn.clone(),
            vec![ep("10.0.0.1", 8080, true), ep("fd00::1", 8080, true)],
        )]
        .into();
        let tables = render(&services, &eps, &RenderConfig::default());
        assert_eq!(tables[0].sets[MAP_SERVICE_ENDPOINTS].elements.len(), 1);
        assert_eq!(tables[1].sets[MAP_SERVICE_ENDPOINTS].elements.len(), 1);
        assert!(tables[0].chains.contains_key("lb") && tables[1].chains.contains_key("lb"));
    }
}
