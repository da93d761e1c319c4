//! ClusterIP services: dispatch, load balancing, masquerade marking and rejection of unserved addresses.
//!
//! The shape is chosen so that the kernel loads it in linear time and so that services come and go, and
//! endpoints change, by **set elements only** (KERNEL-NOTES.md, "Candidate shapes", shape D):
//! - `services` (reached from nat prerouting and output) looks up `daddr . l4proto . dport` in the verdict
//!   map `service-ips`, whose element for a service port says `goto lb-<n>` where n is its endpoint count:
//!   one lookup per new connection whatever the number of services.
//! - `lb-<n>` (one chain per endpoint count in use, shared by every service with n endpoints) marks for
//!   masquerade when the source is outside the cluster CIDR (or always, with masquerade-all) and does
//!   `dnat to daddr . l4proto . dport . numgen random mod n` looked up in `service-endpoints`: slot k of a
//!   service maps to its k-th endpoint, so each endpoint is chosen with probability exactly 1/n.
//! - postrouting masquerades marked packets and hairpin connections (an endpoint reaching itself through its
//!   service: `ct status dnat` and `saddr . daddr` in `hairpin-endpoints`).
//! - filter forward and output reject whatever still goes to a ClusterIP after NAT: a service with no
//!   endpoints, or a port that is no service port (TCP: reset; others: ICMP port unreachable).
//!
//! No per-service chain or rule exists, so adding a service never adds a rule (rules make the kernel
//! re-validate the whole table), and no anonymous set is bound per service (quadratic in the kernel).

use super::names::*;
use super::{LocalDetector, Piece, RenderConfig};
use crate::model::{Cidr, Endpoint, IpFamily, ServicePort, TrafficPolicy};
use crate::nft::build::{concat_key, ip_bytes, Field, RuleBuilder};
use crate::nft::ir::*;
use crate::node::NodePortAddresses;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub(super) fn nft_family(f: IpFamily) -> Family {
    match f {
        IpFamily::V4 => Family::Ip,
        IpFamily::V6 => Family::Ip6,
    }
}

fn ip_family(f: Family) -> IpFamily {
    match f {
        Family::Ip6 => IpFamily::V6,
        _ => IpFamily::V4,
    }
}

fn addr_type(f: IpFamily) -> DataType {
    match f {
        IpFamily::V4 => DataType::Ipv4Addr,
        IpFamily::V6 => DataType::Ipv6Addr,
    }
}

fn saddr(f: IpFamily) -> Field {
    match f {
        IpFamily::V4 => Field::IpSaddr,
        IpFamily::V6 => Field::Ip6Saddr,
    }
}

fn daddr(f: IpFamily) -> Field {
    match f {
        IpFamily::V4 => Field::IpDaddr,
        IpFamily::V6 => Field::Ip6Daddr,
    }
}

fn base(name: &str, chain_type: ChainType, hook: Hook, priority: i32) -> Chain {
    Chain {
        name: name.into(),
        base: Some(BaseHook {
            hook,
            chain_type,
            priority,
        }),
    }
}

fn regular(name: &str) -> Chain {
    Chain {
        name: name.into(),
        base: None,
    }
}

/// Priorities as nft names them: dstnat -100, srcnat 100, filter 0 (we run just before filter).
const PRIO_DSTNAT: i32 = -100;
const PRIO_SRCNAT: i32 = 100;
const PRIO_FILTER_EARLY: i32 = -10;

/// The numgen slot is a host-endian 32-bit value; nft knows no fixed-size integer type for set keys, so the
/// kernel object calls it a mark (same size and byte order). `plan` prints it as `typeof numgen ...`.
const SLOT: DataType = DataType::Mark;

/// The objects every table has whatever the services: hooks, the fixed chains and the sets.
pub(super) fn skeleton(f: IpFamily, cfg: &RenderConfig) -> TableState {
    let mut t = TableState::new(nft_family(f), TABLE);
    let a = addr_type(f);
    let plain_set = |name: &str, key: Vec<DataType>, data: Vec<DataType>| Set {
        name: name.into(),
        key,
        data,
        timeout_ms: None,
        dynamic: false,
    };
    t.add_set(plain_set(SET_CLUSTER_IPS, vec![a], vec![]));
    t.add_set(plain_set(
        MAP_SERVICE_IPS,
        vec![a, DataType::InetProto, DataType::InetService],
        vec![DataType::Verdict],
    ));
    t.add_set(plain_set(
        MAP_SERVICE_ENDPOINTS,
        vec![a, DataType::InetProto, DataType::InetService, SLOT],
        vec![a, DataType::InetService],
    ));
    t.add_set(plain_set(SET_HAIRPIN, vec![a, a], vec![]));
    t.add_set(plain_set(
        MAP_NO_ENDPOINT_SERVICES,
        vec![a, DataType::InetProto, DataType::InetService],
        vec![DataType::Verdict],
    ));
    t.add_set(Set {
        name: MAP_AFFINITY.into(),
        key: vec![a, a, DataType::InetProto, DataType::InetService],
        data: vec![a, DataType::InetService],
        // Each element carries its service's own timeout (set by the rule); this is only the default.
        timeout_ms: Some(crate::render::MAX_AFFINITY_SECONDS as u64 * 1000),
        dynamic: true,
    });
    let port_key = vec![DataType::InetProto, DataType::InetService];
    t.add_set(plain_set(
        MAP_SERVICE_NODEPORTS,
        port_key.clone(),
        vec![DataType::Verdict],
    ));
    t.add_set(plain_set(
        MAP_NO_ENDPOINT_NODEPORTS,
        port_key,
        vec![DataType::Verdict],
    ));
    t.add_set(plain_set(
        MAP_NODEPORT_ENDPOINTS,
        vec![DataType::InetProto, DataType::InetService, SLOT],
        vec![a, DataType::InetService],
    ));
    // NodePorts: on which of the node's addresses (kube-proxy's --nodeport-addresses).
    let nodeport_match: Option<RuleBuilder> = match &cfg.nodeport_addresses {
        NodePortAddresses::None => None,
        NodePortAddresses::AllLocal => {
            let loopback: IpAddr = match f {
                IpFamily::V4 => Ipv4Addr::new(127, 0, 0, 0).into(),
                IpFamily::V6 => Ipv6Addr::LOCALHOST.into(),
            };
            let prefix = if f == IpFamily::V4 { 8 } else { 128 };
            Some(
                RuleBuilder::new()
                    .daddr_is_local()
                    .prefix(daddr(f), &loopback, prefix, true),
            )
        }
        NodePortAddresses::Only(ips) => {
            let set = t.add_set(plain_set(SET_NODEPORT_IPS, vec![a], vec![]));
            for ip in ips.iter().filter(|ip| IpFamily::of(ip) == f) {
                set.elements.insert(Element {
                    key: ip_bytes(ip),
                    value: None,
                });
            }
            Some(RuleBuilder::new().in_set(&[daddr(f)], SET_NODEPORT_IPS, false))
        }
    };

    let jump = |c: &str| RuleBuilder::new().verdict(Verdict::Jump(c.into())).build();
    t.add_chain(base(
        CHAIN_NAT_PREROUTING,
        ChainType::Nat,
        Hook::Prerouting,
        PRIO_DSTNAT,
    ))
    .rules = vec![jump(CHAIN_SERVICES)];
    t.add_chain(base(
        CHAIN_NAT_OUTPUT,
        ChainType::Nat,
        Hook::Output,
        PRIO_DSTNAT,
    ))
    .rules = vec![jump(CHAIN_SERVICES)];
    t.add_chain(base(
        CHAIN_NAT_POSTROUTING,
        ChainType::Nat,
        Hook::Postrouting,
        PRIO_SRCNAT,
    ))
    .rules = vec![jump(CHAIN_MASQUERADING)];
    t.add_chain(base(
        CHAIN_FILTER_FORWARD,
        ChainType::Filter,
        Hook::Forward,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![jump(CHAIN_FIREWALL), jump(CHAIN_CLUSTER_IPS_CHECK)];
    t.add_chain(base(
        CHAIN_FILTER_OUTPUT,
        ChainType::Filter,
        Hook::Output,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![jump(CHAIN_FIREWALL), jump(CHAIN_CLUSTER_IPS_CHECK)];
    t.add_chain(base(
        CHAIN_FILTER_INPUT,
        ChainType::Filter,
        Hook::Input,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![jump(CHAIN_FIREWALL)];
    // kubelet's KUBE-FIREWALL: packets carrying the drop mark are dropped; so is "martian" traffic to
    // 127.0.0.0/8 from elsewhere that is not part of a known or DNATed connection (with route_localnet on,
    // it could otherwise reach services bound to loopback).
    let mut firewall = vec![RuleBuilder::new()
        .mark_has(cfg.drop_bit, true)
        .verdict(Verdict::Drop)
        .comment("drop mark")
        .build()];
    if f == IpFamily::V4 {
        let localnet: IpAddr = Ipv4Addr::new(127, 0, 0, 0).into();
        firewall.push(
            RuleBuilder::new()
                .prefix(Field::IpDaddr, &localnet, 8, false)
                .prefix(Field::IpSaddr, &localnet, 8, true)
                .ct_lacks(CtKey::State, CT_STATE_ESTABLISHED | CT_STATE_RELATED)
                .ct_lacks(CtKey::Status, CT_STATUS_DNAT)
                .verdict(Verdict::Drop)
                .comment("martian localnet")
                .build(),
        );
    }
    t.add_chain(regular(CHAIN_FIREWALL)).rules = firewall;

    let mut services = vec![RuleBuilder::new()
        .vmap(&[daddr(f), Field::L4Proto, Field::ThDport], MAP_SERVICE_IPS)
        .build()];
    if let Some(m) = &nodeport_match {
        services.push(
            m.clone()
                .vmap(&[Field::L4Proto, Field::ThDport], MAP_SERVICE_NODEPORTS)
                .build(),
        );
        // A NodePort of a service without endpoints is not NATed: the packet is for this host, so it is
        // rejected on input.
        t.chain_mut(CHAIN_FILTER_INPUT)
            .rules
            .push(jump(CHAIN_NODEPORTS_CHECK));
        t.add_chain(regular(CHAIN_NODEPORTS_CHECK)).rules = vec![m
            .clone()
            .vmap(&[Field::L4Proto, Field::ThDport], MAP_NO_ENDPOINT_NODEPORTS)
            .build()];
    }
    t.add_chain(regular(CHAIN_SERVICES)).rules = services;

    let bit = cfg.masquerade_bit;
    t.add_chain(regular(CHAIN_MASQUERADING)).rules = vec![
        RuleBuilder::new()
            .ct_has(CtKey::Status, CT_STATUS_DNAT)
            .in_set(&[saddr(f), daddr(f)], SET_HAIRPIN, false)
            .mark_or(bit)
            .comment("hairpin: an endpoint reaching itself through its service")
            .build(),
        RuleBuilder::new()
            .mark_has(bit, false)
            .verdict(Verdict::Return)
            .build(),
        RuleBuilder::new().mark_xor(bit).build(),
        RuleBuilder::new()
            .masquerade(cfg.masquerade_fully_random)
            .build(),
    ];

    t.add_chain(regular(CHAIN_CLUSTER_IPS_CHECK)).rules = vec![
        RuleBuilder::new()
            .vmap(
                &[daddr(f), Field::L4Proto, Field::ThDport],
                MAP_NO_ENDPOINT_SERVICES,
            )
            .build(),
        RuleBuilder::new()
            .in_set(&[daddr(f)], SET_CLUSTER_IPS, false)
            .verdict(Verdict::Goto(CHAIN_REJECT.into()))
            .comment("no endpoints, or not a service port")
            .build(),
    ];
    // --service-cidr: an address in the service range that no Service has is dropped here rather than sent
    // on towards the default route.
    for cidr in cfg.service_cidrs.iter().filter(|c| c.family() == f) {
        t.chain_mut(CHAIN_CLUSTER_IPS_CHECK).rules.push(
            RuleBuilder::new()
                .prefix(daddr(f), &cidr.addr, cidr.prefix, false)
                .verdict(Verdict::Drop)
                .comment("unallocated service address")
                .build(),
        );
    }

    let unreach = match f {
        IpFamily::V4 => RejectKind::IcmpUnreach(ICMP_PORT_UNREACH),
        IpFamily::V6 => RejectKind::IcmpUnreach(ICMPV6_PORT_UNREACH),
    };
    t.add_chain(regular(CHAIN_REJECT)).rules = vec![
        RuleBuilder::new()
            .cmp(Field::L4Proto, CmpOp::Eq, vec![6])
            .reject(RejectKind::TcpReset)
            .build(),
        RuleBuilder::new().reject(unreach).build(),
    ];
    t
}

/// Which frontends an `lb-*` chain serves: they differ in masquerading and in the key of their endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LbKind {
    /// `lb-<n>`: ClusterIPs. Masqueraded when from outside the cluster CIDR (never without one, as kube-proxy).
    Cluster,
    /// `lb-ext-<n>`: external and LoadBalancer IPs. Masqueraded unless from the cluster CIDR (always without
    /// one: the reply must come back through this node).
    External,
    /// `lb-np-<n>`: NodePorts, keyed by protocol and port alone. Always masqueraded (externalTrafficPolicy
    /// Cluster).
    NodePort,
    /// `lb-etp-<local>-<n>`: external and LoadBalancer IPs of an externalTrafficPolicy Local service: traffic
    /// from pods and from the node itself goes to all n endpoints (short-circuit), outside traffic only to
    /// the `local` endpoints on this node, keeping its source address; none → dropped.
    LocalExternal(u32),
    /// `lb-np-etp-<local>-<n>`: the same for the NodePort of such a service.
    LocalNodePort(u32),
    /// `lb-aff-<seconds>-<n>`: ClusterIPs of a service with ClientIP affinity of that timeout.
    ClusterAffinity(u32),
    /// `lb-ext-aff-<seconds>-<n>`: external and LoadBalancer IPs of such a service.
    ExternalAffinity(u32),
}

/// Slots of a service's node-local endpoints start here (the first ones hold all its endpoints).
pub const LOCAL_SLOTS: u32 = 1 << 16;

/// An `lb-*` chain: masquerade marking, then the uniform choice among n endpoint slots.
pub fn lb_chain_state(family: Family, n: u32, kind: LbKind, cfg: &RenderConfig) -> ChainState {
    let f = ip_family(family);
    let frontend_key = vec![daddr(f), Field::L4Proto, Field::ThDport];
    let port_key = vec![Field::L4Proto, Field::ThDport];
    let (name, key, map) = match kind {
        LbKind::Cluster => (lb_chain(n), frontend_key, MAP_SERVICE_ENDPOINTS),
        LbKind::External => (lb_external_chain(n), frontend_key, MAP_SERVICE_ENDPOINTS),
        LbKind::NodePort => (lb_nodeport_chain(n), port_key, MAP_NODEPORT_ENDPOINTS),
        LbKind::LocalExternal(l) => (
            format!("{LB_CHAIN_PREFIX}etp-{l}-{n}"),
            frontend_key,
            MAP_SERVICE_ENDPOINTS,
        ),
        LbKind::LocalNodePort(l) => (
            format!("{LB_CHAIN_PREFIX}np-etp-{l}-{n}"),
            port_key,
            MAP_NODEPORT_ENDPOINTS,
        ),
        LbKind::ClusterAffinity(t) => (
            format!("{LB_CHAIN_PREFIX}aff-{t}-{n}"),
            frontend_key,
            MAP_SERVICE_ENDPOINTS,
        ),
        LbKind::ExternalAffinity(t) => (
            format!("{LB_CHAIN_PREFIX}ext-aff-{t}-{n}"),
            frontend_key,
            MAP_SERVICE_ENDPOINTS,
        ),
    };
    // "From a pod" and "not from a pod", if the detector can tell in this family.
    let from_pod = |negate: bool| local_traffic(f, cfg, negate);
    let mut rules = Vec::new();
    if let LbKind::LocalExternal(local) | LbKind::LocalNodePort(local) = kind {
        // Pods reach every endpoint (keeping their address unless masquerade-all: their traffic is treated
        // as cluster traffic); so does the node itself, masqueraded.
        if let Some(mut pod) = from_pod(false) {
            if cfg.masquerade_all {
                pod = pod.mark_or(cfg.masquerade_bit);
            }
            rules.push(
                pod.dnat_map(&key, n, map, family)
                    .comment("from a pod: every endpoint")
                    .build(),
            );
        }
        rules.push(
            RuleBuilder::new()
                .saddr_is_local()
                .mark_or(cfg.masquerade_bit)
                .dnat_map(&key, n, map, family)
                .comment("from the node: every endpoint")
                .build(),
        );
        rules.push(if local > 0 {
            RuleBuilder::new()
                .dnat_map_offset(&key, local, LOCAL_SLOTS, map, family)
                .comment("from outside: local endpoints, source kept")
                .build()
        } else {
            RuleBuilder::new()
                .verdict(Verdict::Drop)
                .comment("from outside: no local endpoint")
                .build()
        });
        return ChainState {
            chain: regular(&name),
            rules,
        };
    }
    let external = matches!(kind, LbKind::External | LbKind::ExternalAffinity(_));
    let not_pod = from_pod(true);
    let always = cfg.masquerade_all || kind == LbKind::NodePort || (external && not_pod.is_none());
    if always {
        rules.push(RuleBuilder::new().mark_or(cfg.masquerade_bit).build());
    } else if let Some(not_pod) = not_pod {
        rules.push(
            not_pod
                .mark_or(cfg.masquerade_bit)
                .comment("not from a pod")
                .build(),
        );
    }
    match kind {
        LbKind::ClusterAffinity(t) | LbKind::ExternalAffinity(t) => {
            let ms = t as u64 * 1000;
            rules.push(
                RuleBuilder::new()
                    .affinity_hit(family, MAP_AFFINITY, ms)
                    .comment("ClientIP affinity: the endpoint this client had")
                    .build(),
            );
            rules.push(
                RuleBuilder::new()
                    .affinity_pick(family, n, map, MAP_AFFINITY, ms)
                    .comment("ClientIP affinity: choose and remember")
                    .build(),
            );
        }
        _ => rules.push(RuleBuilder::new().dnat_map(&key, n, map, family).build()),
    }
    ChainState {
        chain: regular(&name),
        rules,
    }
}

/// The start of a rule matching traffic from this node's pods (`negate`: not from them), per the configured
/// detector; None when it cannot tell in this family (no cluster CIDR of the family given).
fn local_traffic(f: IpFamily, cfg: &RenderConfig, negate: bool) -> Option<RuleBuilder> {
    match &cfg.local_detector {
        LocalDetector::ClusterCidr => {
            let cidr = cfg.cluster_cidrs.iter().find(|c| c.family() == f)?;
            Some(RuleBuilder::new().prefix(saddr(f), &cidr.addr, cidr.prefix, negate))
        }
        LocalDetector::InterfaceNamePrefix(p) => Some(RuleBuilder::new().iifname(p, true, negate)),
        LocalDetector::BridgeInterface(b) => Some(RuleBuilder::new().iifname(b, false, negate)),
    }
}

/// `fw-<id>`: sources in the service's loadBalancerSourceRanges go on to its endpoints, others are dropped.
/// When a range contains one of the node's addresses, the LoadBalancer IPs themselves are allowed as sources
/// too (kube-proxy's rule for load balancers that hairpin through the node).
fn firewall_chain_state(
    svc: &ServicePort,
    f: IpFamily,
    ranges: &[&Cidr],
    target: &str,
    cfg: &RenderConfig,
) -> ChainState {
    let family_name = if f == IpFamily::V4 { "ip" } else { "ip6" };
    let mut rules: Vec<Rule> = ranges
        .iter()
        .map(|c| {
            RuleBuilder::new()
                .prefix(saddr(f), &c.addr, c.prefix, false)
                .verdict(Verdict::Goto(target.into()))
                .build()
        })
        .collect();
    let node_in_range = cfg
        .node_ips
        .iter()
        .any(|ip| ranges.iter().any(|c| c.contains(ip)));
    if node_in_range {
        for ip in svc
            .load_balancer_ips
            .iter()
            .filter(|ip| IpFamily::of(ip) == f)
        {
            rules.push(
                RuleBuilder::new()
                    .cmp(saddr(f), CmpOp::Eq, ip_bytes(ip))
                    .verdict(Verdict::Goto(target.into()))
                    .build(),
            );
        }
    }
    rules.push(
        RuleBuilder::new()
            .verdict(Verdict::Drop)
            .comment("not in loadBalancerSourceRanges")
            .build(),
    );
    ChainState {
        chain: regular(&firewall_chain(
            &svc.name,
            family_name,
            &format!("{rules:?}"),
        )),
        rules,
    }
}

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
pub(super) fn usable_endpoints(all: &[Endpoint], f: IpFamily) -> Vec<Endpoint> {
    let of_family = || all.iter().filter(move |e| IpFamily::of(&e.ip) == f);
    let ready: Vec<Endpoint> = of_family().filter(|e| e.ready).cloned().collect();
    if !ready.is_empty() {
        return ready;
    }
    of_family()
        .filter(|e| e.serving && e.terminating)
        .cloned()
        .collect()
}

/// Everything one service port adds to the tables, in every family it has a frontend in: its ClusterIPs,
/// external IPs, LoadBalancer ingress IPs and NodePort.
pub(super) fn service_pieces(
    svc: &ServicePort,
    endpoints: &[Endpoint],
    cfg: &RenderConfig,
) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let local_endpoints: Vec<Endpoint> = endpoints
        .iter()
        .filter(|e| {
            !cfg.node_name.is_empty() && e.node_name.as_deref() == Some(cfg.node_name.as_str())
        })
        .cloned()
        .collect();
    let node_port = svc
        .node_port
        .filter(|_| cfg.nodeport_addresses != NodePortAddresses::None);
    for f in [IpFamily::V4, IpFamily::V6] {
        let family = nft_family(f);
        let of_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
            ips.iter()
                .copied()
                .filter(|ip| IpFamily::of(ip) == f)
                .collect()
        };
        let cluster = of_family(&svc.cluster_ips);
        let mut external = of_family(&svc.external_ips);
        external.extend(of_family(&svc.load_balancer_ips));
        external.sort();
        external.dedup();
        external.retain(|ip| !cluster.contains(ip));
        if cluster.is_empty() && external.is_empty() {
            continue;
        }
        let element =
            |set: &'static str, key: Vec<u8>, value: Option<ElementValue>| Piece::Element {
                family,
                set,
                element: Element { key, value },
            };
        let proto = vec![svc.protocol.number()];
        let frontend =
            |ip: &IpAddr| vec![ip_bytes(ip), proto.clone(), svc.port.to_be_bytes().to_vec()];
        let node_port_key = |np: u16| vec![proto.clone(), np.to_be_bytes().to_vec()];
        let goto = |chain: &str| Some(ElementValue::Verdict(Verdict::Goto(chain.into())));
        // Slot elements: endpoint k of `eps` at slot `offset + k` of the frontend (or port) `key`.
        let slots = |set: &'static str,
                     key: &[Vec<u8>],
                     eps: &[Endpoint],
                     offset: u32,
                     out: &mut Vec<Piece>| {
            for (k, ep) in eps.iter().enumerate() {
                let mut full = key.to_vec();
                full.push((offset + k as u32).to_ne_bytes().to_vec());
                out.push(element(
                    set,
                    concat_key(&full),
                    Some(ElementValue::Data(concat_key(&[
                        ip_bytes(&ep.ip),
                        ep.port.to_be_bytes().to_vec(),
                    ]))),
                ));
            }
        };
        let all = topology_filter(usable_endpoints(endpoints, f), cfg);
        let local = usable_endpoints(&local_endpoints, f);

        // ClusterIPs (internalTrafficPolicy).
        for ip in &cluster {
            pieces.push(element(SET_CLUSTER_IPS, ip_bytes(ip), None));
        }
        let internal = if svc.internal_traffic_policy == TrafficPolicy::Local {
            &local
        } else {
            &all
        };
        if !internal.is_empty() {
            let n = internal.len() as u32;
            let kind = match svc.session_affinity_timeout {
                Some(t) => LbKind::ClusterAffinity(t),
                None => LbKind::Cluster,
            };
            let chain = super::lb_chain(family, n, kind, cfg);
            let target = chain.chain.name.clone();
            pieces.push(Piece::Chain { family, chain });
            for ip in &cluster {
                slots(
                    MAP_SERVICE_ENDPOINTS,
                    &frontend(ip),
                    internal,
                    0,
                    &mut pieces,
                );
                pieces.push(element(
                    MAP_SERVICE_IPS,
                    concat_key(&frontend(ip)),
                    goto(&target),
                ));
            }
        } else if !all.is_empty() {
            // internalTrafficPolicy Local without a local endpoint: dropped (endpoints exist elsewhere).
            for ip in &cluster {
                pieces.push(element(
                    MAP_SERVICE_IPS,
                    concat_key(&frontend(ip)),
                    Some(ElementValue::Verdict(Verdict::Drop)),
                ));
            }
        }
        // Otherwise no dispatch element: the packet leaves NAT untouched and is rejected in filter (every
        // port of a ClusterIP is ours).

        // External IPs, LoadBalancer IPs and the NodePort (externalTrafficPolicy).
        if all.is_empty() {
            // External addresses may serve other things on other ports: rejected per port.
            for ip in &external {
                pieces.push(element(
                    MAP_NO_ENDPOINT_SERVICES,
                    concat_key(&frontend(ip)),
                    goto(CHAIN_REJECT),
                ));
            }
            if let Some(np) = node_port {
                pieces.push(element(
                    MAP_NO_ENDPOINT_NODEPORTS,
                    concat_key(&node_port_key(np)),
                    goto(CHAIN_REJECT),
                ));
            }
            continue;
        }
        let n = all.len() as u32;
        let etp_local = svc.external_traffic_policy == TrafficPolicy::Local;
        let (ext_kind, np_kind) = if etp_local {
            let l = local.len() as u32;
            (LbKind::LocalExternal(l), LbKind::LocalNodePort(l))
        } else {
            let ext = match svc.session_affinity_timeout {
                Some(t) => LbKind::ExternalAffinity(t),
                None => LbKind::External,
            };
            (ext, LbKind::NodePort)
        };
        if !external.is_empty() {
            let chain = super::lb_chain(family, n, ext_kind, cfg);
            let target = chain.chain.name.clone();
            pieces.push(Piece::Chain { family, chain });
            // loadBalancerSourceRanges filter the LoadBalancer IPs (not external IPs, not the NodePort)
            // before DNAT, in a chain of this service's own.
            let ranges: Vec<&Cidr> = svc
                .load_balancer_source_ranges
                .iter()
                .filter(|c| c.family() == f)
                .collect();
            let firewall = (!ranges.is_empty()).then(|| {
                let chain = firewall_chain_state(svc, f, &ranges, &target, cfg);
                let name = chain.chain.name.clone();
                pieces.push(Piece::Chain {
                    family,
                    chain: std::sync::Arc::new(chain),
                });
                name
            });
            for ip in &external {
                slots(MAP_SERVICE_ENDPOINTS, &frontend(ip), &all, 0, &mut pieces);
                if etp_local {
                    slots(
                        MAP_SERVICE_ENDPOINTS,
                        &frontend(ip),
                        &local,
                        LOCAL_SLOTS,
                        &mut pieces,
                    );
                }
                let to = match &firewall {
                    Some(fw) if svc.load_balancer_ips.contains(ip) => fw,
                    _ => &target,
                };
                pieces.push(element(
                    MAP_SERVICE_IPS,
                    concat_key(&frontend(ip)),
                    goto(to),
                ));
            }
        }
        if let Some(np) = node_port {
            let chain = super::lb_chain(family, n, np_kind, cfg);
            let target = chain.chain.name.clone();
            pieces.push(Piece::Chain { family, chain });
            slots(
                MAP_NODEPORT_ENDPOINTS,
                &node_port_key(np),
                &all,
                0,
                &mut pieces,
            );
            if etp_local {
                slots(
                    MAP_NODEPORT_ENDPOINTS,
                    &node_port_key(np),
                    &local,
                    LOCAL_SLOTS,
                    &mut pieces,
                );
            }
            pieces.push(element(
                MAP_SERVICE_NODEPORTS,
                concat_key(&node_port_key(np)),
                goto(&target),
            ));
        }
        let mut hairpin: Vec<&Endpoint> = all.iter().chain(local.iter()).collect();
        hairpin.sort();
        hairpin.dedup();
        for ep in hairpin {
            pieces.push(element(
                SET_HAIRPIN,
                concat_key(&[ip_bytes(&ep.ip), ip_bytes(&ep.ip)]),
                None,
            ));
        }
    }
    // Kept for the life of the service in the sync index: no spare capacity.
    pieces.shrink_to_fit();
    pieces
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::*;
    use crate::model::*;

    fn svc(name: &str, ip: &str, port: u16, proto: Protocol) -> (ServicePortName, ServicePort) {
        let spn = ServicePortName {
            service: NamespacedName::new("ns", name),
            port: "p".into(),
            protocol: proto,
        };
        let sp = ServicePort {
            name: spn.clone(),
            service_type: ServiceType::ClusterIP,
            cluster_ips: vec![ip.parse().unwrap()],
            port,
            protocol: proto,
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            external_traffic_policy: TrafficPolicy::Cluster,
            internal_traffic_policy: TrafficPolicy::Cluster,
            session_affinity_timeout: None,
            health_check_node_port: None,
        };
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
    fn endpoints_fill_one_slot_each_and_dispatch_goes_to_the_count_chain() {
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
        let text = crate::nft::text::render_table(v4);
        assert!(text.contains("10.96.0.1 . tcp . 80 : goto lb-3"), "{text}");
        assert!(
            text.contains("10.96.0.1 . tcp . 80 . 2 : 10.0.0.3 . 8080"),
            "{text}"
        );
        assert!(
            text.contains("dnat ip addr . port to ip daddr . meta l4proto . th dport . numgen random mod 3 map @service-endpoints"),
            "{text}"
        );
        assert_eq!(v4.sets[MAP_SERVICE_ENDPOINTS].elements.len(), 3);
        assert_eq!(v4.sets[SET_HAIRPIN].elements.len(), 3);
        // Only the count chain in use exists; no per-service chain.
        assert!(v4.chains.contains_key("lb-3") && !v4.chains.contains_key("lb-2"));
        // The v6 table exists but holds no service.
        assert!(tables[1].sets[MAP_SERVICE_IPS].elements.is_empty());
    }

    #[test]
    fn service_without_ready_endpoints_is_not_dispatched_but_listed_for_rejection() {
        let (spn, sp) = svc("a", "10.96.0.1", 80, Protocol::Udp);
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let eps: EndpointsMap = [(spn.clone(), vec![ep("10.0.0.1", 8080, false)])].into();
        let t = &render(&services, &eps, &RenderConfig::default())[0];
        assert!(t.sets[MAP_SERVICE_IPS].elements.is_empty());
        assert!(t.sets[MAP_SERVICE_ENDPOINTS].elements.is_empty());
        assert_eq!(t.sets[SET_CLUSTER_IPS].elements.len(), 1);
        assert!(!t.chains.keys().any(|c| c.starts_with(LB_CHAIN_PREFIX)));
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
    fn masquerade_rule_follows_config() {
        let mut cfg = RenderConfig::default();
        let lb = |cfg: &RenderConfig| lb_chain_state(Family::Ip, 2, LbKind::Cluster, cfg);
        assert_eq!(lb(&cfg).rules.len(), 1);
        cfg.cluster_cidrs = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()];
        let t = TableState::new(Family::Ip, TABLE);
        let rules = lb(&cfg).rules;
        assert_eq!(rules.len(), 2, "only the v4 CIDR applies to the ip table");
        assert_eq!(
            crate::nft::text::render_rule(&rules[0], &t),
            "ip saddr != 10.0.0.0/8 meta mark set meta mark | 0x00004000 comment \"not from a pod\""
        );
        cfg.masquerade_all = true;
        assert_eq!(
            crate::nft::text::render_rule(&lb(&cfg).rules[0], &t),
            "meta mark set meta mark | 0x00004000"
        );
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
        let text = crate::nft::text::render_table(t);
        assert!(text.contains("10.96.0.1 . tcp . 80 : goto lb-2"), "{text}");
        assert!(
            text.contains("192.168.250.10 . tcp . 80 : goto lb-ext-2"),
            "{text}"
        );
        assert!(
            text.contains("192.168.250.20 . tcp . 80 . 1 : 10.0.0.2 . 8080"),
            "{text}"
        );
        // External addresses are not ClusterIPs: never rejected wholesale.
        assert_eq!(t.sets[SET_CLUSTER_IPS].elements.len(), 1);
        // Without a cluster CIDR, external traffic is always masqueraded; ClusterIP traffic never.
        assert_eq!(t.chains["lb-ext-2"].rules.len(), 2);
        assert_eq!(t.chains["lb-2"].rules.len(), 1);

        let none: EndpointsMap = EndpointsMap::new();
        let t = &render(&services, &none, &RenderConfig::default())[0];
        let text = crate::nft::text::render_table(t);
        assert!(
            text.contains("192.168.250.10 . tcp . 80 : goto reject-chain"),
            "{text}"
        );
        assert!(
            text.contains("192.168.250.20 . tcp . 80 : goto reject-chain"),
            "{text}"
        );
        assert!(t.sets[MAP_SERVICE_IPS].elements.is_empty());
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
        let text = crate::nft::text::render_table(&render(&services, &eps, &cfg)[0]);
        // ClusterIP: only the local endpoint (internalTrafficPolicy Local).
        assert!(text.contains("10.96.0.1 . tcp . 80 : goto lb-1"), "{text}");
        // External: both endpoints for the short-circuit, the local one in the local slots.
        assert!(
            text.contains("192.168.250.10 . tcp . 80 : goto lb-etp-1-2"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "192.168.250.10 . tcp . 80 . {LOCAL_SLOTS} : 10.0.0.1 . 8080"
            )),
            "{text}"
        );
        assert!(text.contains("numgen random mod 1 offset 65536"), "{text}");
        // No local endpoint: ClusterIP traffic dropped, outside traffic dropped in lb-etp-0-1.
        let eps: EndpointsMap = [(spn.clone(), vec![remote])].into();
        let text = crate::nft::text::render_table(&render(&services, &eps, &cfg)[0]);
        assert!(text.contains("10.96.0.1 . tcp . 80 : drop"), "{text}");
        assert!(text.contains("goto lb-etp-0-1"), "{text}");
        assert!(
            text.contains("drop comment \"from outside: no local endpoint\""),
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
        assert!(tables[0].chains.contains_key("lb-1") && tables[1].chains.contains_key("lb-1"));
    }
}
