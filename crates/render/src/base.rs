//! The objects every table has whatever the services: hooks, the fixed chains (dispatch, masquerading,
//! rejection, kubelet's guard) and the sets and maps the services fill.

use super::chains::{
    dispatch_set, lb_chain_state, lb_name, pick_bit_set, pick_chain_states, pick_over_set, Counts,
    LbKind,
};
use super::common::*;
use super::names::*;
use super::{RenderConfig, SLOT_SPACE};
use nftkube_model::IpFamily;
use nftkube_model::NodePortAddresses;
use nftkube_nft::build::{ip_bytes, Field, RuleBuilder};
use nftkube_nft::ir::*;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The objects every table has whatever the services: hooks, the fixed chains and the sets.
pub(super) fn table(f: IpFamily, cfg: &RenderConfig) -> TableState {
    let mut t = TableState::new(nft_family(f), TABLE);
    add_sets(&mut t, f);
    let nodeport_match = nodeport_match(&mut t, f, cfg);
    add_hooks(&mut t, f);
    t.add_chain(Chain::regular(CHAIN_AFFINITY_RECORD)).rules = affinity_record_rules(f);
    t.add_chain(Chain::regular(CHAIN_FIREWALL)).rules = firewall_rules(f, cfg);
    add_dispatch(&mut t, f, nodeport_match, cfg);
    t.add_chain(Chain::regular(CHAIN_MASQUERADING)).rules = masquerading_rules(f, cfg);
    add_cluster_ips_check(&mut t, f, cfg);
    add_reject(&mut t, f);
    t
}

/// The sets and maps service pieces fill (and the affinity map the rules fill).
fn add_sets(t: &mut TableState, f: IpFamily) {
    let a = addr_type(f);
    let plain_set = Set::new;
    let daddr_of = match f {
        IpFamily::V4 => TypeofExpr::IpDaddr,
        IpFamily::V6 => TypeofExpr::Ip6Daddr,
    };
    let slot = TypeofExpr::NumgenRandom {
        modulus: SLOT_SPACE,
        offset: 0,
    };
    t.add_set(plain_set(SET_CLUSTER_IPS, vec![a], vec![]));
    let frontend_key = vec![a, DataType::InetProto, DataType::InetService];
    let port_key = vec![DataType::InetProto, DataType::InetService];
    for kind in LbKind::ALL {
        let key = if kind.is_node_port() {
            &port_key
        } else {
            &frontend_key
        };
        for affinity in [false, true] {
            t.add_set(plain_set(dispatch_set(kind, affinity), key.clone(), vec![]));
        }
    }
    t.add_set(plain_set(
        SET_OTHER_SERVICE_IPS,
        frontend_key.clone(),
        vec![],
    ));
    t.add_set(plain_set(
        SET_OTHER_SERVICE_NODEPORTS,
        port_key.clone(),
        vec![],
    ));
    for node_port in [false, true] {
        let key = if node_port { &port_key } else { &frontend_key };
        for local in [false, true] {
            for group in 0..PICK_OVER_SETS[0].len() {
                let name = pick_over_set(node_port, local, group);
                t.add_set(plain_set(name, key.clone(), vec![]));
            }
            for bit in [4, 2, 1] {
                let name = pick_bit_set(node_port, local, bit);
                t.add_set(plain_set(name, key.clone(), vec![]));
            }
        }
    }
    t.add_set(plain_set(
        MAP_SERVICE_IPS,
        vec![a, DataType::InetProto, DataType::InetService],
        vec![DataType::Verdict],
    ));
    // The slot has no nft type name: declared `typeof`, as nft would, so that listings reload.
    t.add_set(Set::typed(
        MAP_SERVICE_ENDPOINTS,
        vec![daddr_of, TypeofExpr::MetaL4proto, TypeofExpr::ThDport, slot],
        vec![daddr_of, TypeofExpr::ThDport],
    ));
    t.add_set(plain_set(SET_HAIRPIN, vec![a, a], vec![]));
    t.add_set(plain_set(
        SET_NO_ENDPOINT_SERVICES,
        frontend_key.clone(),
        vec![],
    ));
    t.add_set(plain_set(
        SET_NO_LOCAL_ENDPOINTS,
        frontend_key.clone(),
        vec![],
    ));
    t.add_set(Set {
        // Each element carries its service's own timeout (set by the rule); this is only the default.
        timeout_ms: Some(crate::MAX_AFFINITY_SECONDS as u64 * 1000),
        dynamic: true,
        size: Some(AFFINITY_CAPACITY),
        ..Set::new(
            MAP_AFFINITY,
            vec![a, a, DataType::InetProto, DataType::InetService],
            vec![a, DataType::InetService],
        )
    });
    t.add_set(plain_set(
        SET_AFFINITY_PROTOCOLS,
        vec![DataType::InetProto],
        vec![],
    ));
    t.add_set(plain_set(
        MAP_AFFINITY_SERVICES,
        vec![a, DataType::InetProto, DataType::InetService],
        vec![DataType::Verdict],
    ));
    t.add_set(plain_set(
        MAP_SERVICE_NODEPORTS,
        port_key.clone(),
        vec![DataType::Verdict],
    ));
    t.add_set(plain_set(
        SET_NO_ENDPOINT_NODEPORTS,
        port_key.clone(),
        vec![],
    ));
    t.add_set(plain_set(SET_NO_LOCAL_NODEPORTS, port_key.clone(), vec![]));
    t.add_set(plain_set(
        MAP_AFFINITY_NODEPORTS,
        port_key,
        vec![DataType::Verdict],
    ));
    t.add_set(Set::typed(
        MAP_NODEPORT_ENDPOINTS,
        vec![TypeofExpr::MetaL4proto, TypeofExpr::ThDport, slot],
        vec![daddr_of, TypeofExpr::ThDport],
    ));
}

/// NodePorts: on which of the node's addresses (kube-proxy's --nodeport-addresses): the start of the rules
/// that match them (None: NodePorts are not served).
fn nodeport_match(t: &mut TableState, f: IpFamily, cfg: &RenderConfig) -> Option<RuleBuilder> {
    let a = addr_type(f);
    match &cfg.nodeport_addresses {
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
            let set = t.add_set(Set::new(SET_NODEPORT_IPS, vec![a], vec![]));
            for ip in ips.iter().filter(|ip| IpFamily::of(ip) == f) {
                set.elements.insert(Element {
                    key: ip_bytes(ip).into(),
                    value: None,
                });
            }
            Some(RuleBuilder::new().in_set(&[daddr(f)], SET_NODEPORT_IPS, false))
        }
    }
}

fn jump(chain: &str) -> Rule {
    RuleBuilder::new()
        .verdict(Verdict::Jump(chain.into()))
        .build()
}

/// The base chains: nat hooks to dispatch and masquerading, filter hooks to the checks after NAT.
fn add_hooks(t: &mut TableState, f: IpFamily) {
    t.add_chain(Chain::base(
        CHAIN_NAT_PREROUTING,
        ChainType::Nat,
        Hook::Prerouting,
        PRIO_DSTNAT,
    ))
    .rules = vec![jump(CHAIN_SERVICES)];
    t.add_chain(Chain::base(
        CHAIN_NAT_OUTPUT,
        ChainType::Nat,
        Hook::Output,
        PRIO_DSTNAT,
    ))
    .rules = vec![jump(CHAIN_SERVICES)];
    t.add_chain(Chain::base(
        CHAIN_NAT_POSTROUTING,
        ChainType::Nat,
        Hook::Postrouting,
        PRIO_SRCNAT,
    ))
    .rules = vec![jump(CHAIN_MASQUERADING)];
    t.add_chain(Chain::base(
        CHAIN_FILTER_FORWARD,
        ChainType::Filter,
        Hook::Forward,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![
        jump(CHAIN_FIREWALL),
        record_affinity(),
        new_connections_jump(CHAIN_CLUSTER_IPS_CHECK),
    ];
    t.add_chain(Chain::base(
        CHAIN_FILTER_OUTPUT,
        ChainType::Filter,
        Hook::Output,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![
        jump(CHAIN_FIREWALL),
        record_affinity(),
        new_connections_jump(CHAIN_CLUSTER_IPS_CHECK),
    ];
    t.add_chain(Chain::base(
        CHAIN_FILTER_INPUT,
        ChainType::Filter,
        Hook::Input,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![
        jump(CHAIN_FIREWALL),
        record_affinity(),
        // (the NodePort check goes here when NodePorts are served)
        no_endpoint_reject(RuleBuilder::new().ct_has(CtKey::State, CT_STATE_NEW), f),
    ];
}

/// `ct state new jump <chain>`: the checks after NAT concern the first packet of a connection only (one that
/// is rejected is never confirmed, so its next packet is new again), as in kube-proxy; later packets, most of
/// them, skip them.
fn new_connections_jump(chain: &str) -> Rule {
    RuleBuilder::new()
        .ct_has(CtKey::State, CT_STATE_NEW)
        .verdict(Verdict::Jump(chain.into()))
        .build()
}

/// `... @no-endpoint-services goto reject-chain`: a frontend of a service without endpoints is not NATed, so
/// its packet still carries the frontend after NAT. On input too: an external or LoadBalancer IP assigned to
/// this node is rejected like one routed through it, as kube-proxy's `service-endpoints-check` does.
fn no_endpoint_reject(start: RuleBuilder, f: IpFamily) -> Rule {
    start
        .in_set(
            &[daddr(f), Field::L4Proto, Field::ThDport],
            SET_NO_ENDPOINT_SERVICES,
            false,
        )
        .verdict(Verdict::Goto(CHAIN_REJECT.into()))
        .build()
}

/// kubelet's KUBE-FIREWALL: packets carrying the drop mark are dropped; so is "martian" traffic to
/// 127.0.0.0/8 from elsewhere that is not part of a known or DNATed connection (with route_localnet on,
/// it could otherwise reach services bound to loopback).
fn firewall_rules(f: IpFamily, cfg: &RenderConfig) -> Vec<Rule> {
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
    firewall
}

/// `services`: the dispatch by frontend, then by NodePort; the NodePort check on input; the shared `lb*` and
/// `pick` chains.
///
/// A frontend is dispatched by membership: `lb-ips` (ClusterIPs, the most frequent) goes to `lb`; every other
/// frontend is in `other-service-ips` too, whose chain tries the rarer kinds' sets and last the verdict map of
/// the frontends with a chain of their own. Sets, not one verdict map, because a verdict element added makes
/// the kernel re-validate the whole table, every verdict element included (O(services)); a set element is data.
fn add_dispatch(
    t: &mut TableState,
    f: IpFamily,
    nodeport_match: Option<RuleBuilder>,
    cfg: &RenderConfig,
) {
    let family = nft_family(f);
    for kind in LbKind::ALL {
        for affinity in [false, true] {
            let lb = lb_chain_state(family, kind, Counts::Shared, affinity, cfg);
            t.add_chain(lb.chain.clone()).rules = lb.rules;
        }
    }
    let frontend = [daddr(f), Field::L4Proto, Field::ThDport];
    let port = [Field::L4Proto, Field::ThDport];
    let rarer = [
        (LbKind::External, false),
        (LbKind::LocalExternal, false),
        (LbKind::Cluster, true),
        (LbKind::External, true),
        (LbKind::LocalExternal, true),
    ];
    let mut services = add_kind_dispatch(
        t,
        &frontend,
        LbKind::Cluster,
        (SET_OTHER_SERVICE_IPS, CHAIN_SERVICES_OTHER),
        &rarer,
        MAP_SERVICE_IPS,
    );
    if let Some(m) = &nodeport_match {
        services.push(
            m.clone()
                .verdict(Verdict::Goto(CHAIN_NODEPORTS.into()))
                .build(),
        );
        let rarer = [
            (LbKind::LocalNodePort, false),
            (LbKind::NodePort, true),
            (LbKind::LocalNodePort, true),
        ];
        let nodeports = add_kind_dispatch(
            t,
            &port,
            LbKind::NodePort,
            (SET_OTHER_SERVICE_NODEPORTS, CHAIN_NODEPORTS_OTHER),
            &rarer,
            MAP_SERVICE_NODEPORTS,
        );
        t.add_chain(Chain::regular(CHAIN_NODEPORTS)).rules = nodeports;
        // A NodePort of a service without endpoints is not NATed: the packet is for this host, so it is
        // rejected on input.
        t.chain_mut(CHAIN_FILTER_INPUT)
            .rules
            .insert(2, new_connections_jump(CHAIN_NODEPORTS_CHECK));
        t.add_chain(Chain::regular(CHAIN_NODEPORTS_CHECK)).rules = vec![m
            .clone()
            .in_set(&port, SET_NO_ENDPOINT_NODEPORTS, false)
            .verdict(Verdict::Goto(CHAIN_REJECT.into()))
            .build()];
    }
    t.add_chain(Chain::regular(CHAIN_SERVICES)).rules = services;
    for node_port in [false, true] {
        for local in [false, true] {
            for pick in pick_chain_states(f, node_port, local) {
                t.add_chain(pick.chain.clone()).rules = pick.rules;
            }
        }
    }
}

/// The dispatch of one key (frontends, or NodePorts): the rules of `first`'s set and of the guard set of every
/// other frontend (`guard`: the set and the chain it goes to). The guard's chain, added here, tries the `rarer`
/// kinds' sets and last the verdict map of the `exceptions`.
fn add_kind_dispatch(
    t: &mut TableState,
    key: &[Field],
    first: LbKind,
    guard: (&str, &str),
    rarer: &[(LbKind, bool)],
    exceptions: &str,
) -> Vec<Rule> {
    let (guard_set, guard_chain) = guard;
    t.add_chain(Chain::regular(guard_chain)).rules = other_dispatch(key, rarer, exceptions);
    vec![
        dispatch_rule(key, first, false),
        RuleBuilder::new()
            .in_set(key, guard_set, false)
            .verdict(Verdict::Goto(guard_chain.into()))
            .build(),
    ]
}

/// `key @<kind's set> goto <kind's shared chain>`.
fn dispatch_rule(key: &[Field], kind: LbKind, affinity: bool) -> Rule {
    RuleBuilder::new()
        .in_set(key, dispatch_set(kind, affinity), false)
        .verdict(Verdict::Goto(
            lb_name(kind, Counts::Shared, affinity).into(),
        ))
        .build()
}

/// The rarer kinds' dispatch rules, then the verdict map of the frontends with a chain of their own.
fn other_dispatch(key: &[Field], kinds: &[(LbKind, bool)], exceptions: &str) -> Vec<Rule> {
    let mut rules: Vec<Rule> = kinds
        .iter()
        .map(|&(kind, affinity)| dispatch_rule(key, kind, affinity))
        .collect();
    rules.push(RuleBuilder::new().vmap(key, exceptions).build());
    rules
}

fn masquerading_rules(f: IpFamily, cfg: &RenderConfig) -> Vec<Rule> {
    let bit = cfg.masquerade_bit;
    vec![
        // Marked already (external traffic, or from outside the cluster): no need to look for a hairpin.
        RuleBuilder::new()
            .mark_has(bit, false)
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
    ]
}

/// After NAT: frontends without endpoints, and whatever still goes to a ClusterIP, are rejected.
fn add_cluster_ips_check(t: &mut TableState, f: IpFamily, cfg: &RenderConfig) {
    t.add_chain(Chain::regular(CHAIN_CLUSTER_IPS_CHECK)).rules = vec![
        no_endpoint_reject(RuleBuilder::new(), f),
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
}

pub(crate) fn add_reject(t: &mut TableState, f: IpFamily) {
    let unreach = match f {
        IpFamily::V4 => RejectKind::IcmpUnreach(ICMP_PORT_UNREACH),
        IpFamily::V6 => RejectKind::IcmpUnreach(ICMPV6_PORT_UNREACH),
    };
    t.add_chain(Chain::regular(CHAIN_REJECT)).rules = vec![
        RuleBuilder::new()
            .cmp(Field::L4Proto, CmpOp::Eq, vec![6])
            .reject(RejectKind::TcpReset)
            .build(),
        RuleBuilder::new().reject(unreach).build(),
    ];
}

/// The most affinity entries a table holds (one per client and frontend while it lasts). kube-proxy's
/// `recent` lists hold 100 each; a full map records nothing new (connections still flow, unpinned).
pub(crate) const AFFINITY_CAPACITY: u32 = 262_144;

/// `ct state new ct status dnat goto affinity-record`: after DNAT (filter runs after nat), a new connection's
/// endpoint is known; the forward, input and output hooks together see every DNATed connection. A `goto`: a
/// DNATed packet carries its endpoint's address, which the checks after it (frontends without endpoints,
/// ClusterIPs, NodePorts) could only miss, so it skips their lookups.
fn record_affinity() -> Rule {
    RuleBuilder::new()
        .ct_has(CtKey::State, CT_STATE_NEW)
        .ct_has(CtKey::Status, CT_STATUS_DNAT)
        .verdict(Verdict::Goto(CHAIN_AFFINITY_RECORD.into()))
        .build()
}

/// Which affinity services' frontends a connection was sent to: by its original destination (ClusterIPs,
/// external and LoadBalancer IPs), else by its original destination port (NodePorts). A NodePort number that
/// is also the port of some other address records an entry nothing looks up (lookups are by frontend).
/// First, a connection whose protocol no affinity frontend has returns: one bitmap lookup instead of two
/// hash lookups (and two bitmap ones) for every new connection to a service, when no service (or none of
/// that protocol) has affinity.
fn affinity_record_rules(f: IpFamily) -> Vec<Rule> {
    let original = match f {
        IpFamily::V4 => Field::CtOriginalDaddr,
        IpFamily::V6 => Field::CtOriginalDaddr6,
    };
    vec![
        RuleBuilder::new()
            .in_set(&[Field::L4Proto], SET_AFFINITY_PROTOCOLS, true)
            .verdict(Verdict::Return)
            .build(),
        RuleBuilder::new()
            .transport_protocol()
            .vmap(
                &[original, Field::L4Proto, Field::CtOriginalProtoDst],
                MAP_AFFINITY_SERVICES,
            )
            .build(),
        RuleBuilder::new()
            .transport_protocol()
            .vmap(
                &[Field::L4Proto, Field::CtOriginalProtoDst],
                MAP_AFFINITY_NODEPORTS,
            )
            .build(),
    ]
}
