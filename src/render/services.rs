//! ClusterIP services: dispatch, load balancing, masquerade marking and rejection of unserved addresses.
//!
//! Per family, one table:
//! - `services` (reached from nat prerouting and output) looks up `daddr . l4proto . dport` in the verdict
//!   map `service-ips` and jumps to the service port's chain: one lookup per new connection whatever the
//!   number of services.
//! - a service port chain marks for masquerade (source outside the cluster CIDR, or everything with
//!   masquerade-all), then picks an endpoint uniformly: rule k of E is `numgen random mod (E-k) == 0 dnat`,
//!   so each endpoint is chosen with probability 1/E, and no anonymous set or map is bound per service (the
//!   shape that makes big kernel transactions quadratic, see KERNEL-NOTES.md).
//! - postrouting masquerades marked packets and hairpin connections (an endpoint reaching itself through
//!   its service: `ct status dnat` and `saddr . daddr` in `hairpin-endpoints`).
//! - filter forward and output reject whatever still goes to a ClusterIP after NAT: a service with no
//!   endpoints, or a port that is no service port (TCP: reset; others: ICMP port unreachable).

use super::names::*;
use super::RenderConfig;
use crate::model::{Endpoint, EndpointsMap, IpFamily, ServiceMap, ServicePort};
use crate::nft::build::{concat_key, ip_bytes, Field, RuleBuilder};
use crate::nft::ir::*;
use std::net::IpAddr;

/// Renders both tables (ip, then ip6). Tables are rendered even when empty so that the hooks are in
/// place before the first service of a family appears.
pub fn render(
    services: &ServiceMap,
    endpoints: &EndpointsMap,
    cfg: &RenderConfig,
) -> Vec<TableState> {
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .map(|f| render_family(f, services, endpoints, cfg))
        .collect()
}

fn nft_family(f: IpFamily) -> Family {
    match f {
        IpFamily::V4 => Family::Ip,
        IpFamily::V6 => Family::Ip6,
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

fn render_family(
    f: IpFamily,
    services: &ServiceMap,
    endpoints: &EndpointsMap,
    cfg: &RenderConfig,
) -> TableState {
    let mut t = TableState::new(nft_family(f), TABLE);
    skeleton(&mut t, f, cfg);

    for (spn, svc) in services {
        let ips: Vec<&IpAddr> = svc
            .cluster_ips
            .iter()
            .filter(|ip| IpFamily::of(ip) == f)
            .collect();
        if ips.is_empty() {
            continue;
        }
        for ip in &ips {
            t.set_mut(SET_CLUSTER_IPS).elements.insert(Element {
                key: ip_bytes(ip),
                value: None,
            });
        }
        let eps = usable_endpoints(endpoints.get(spn).map(Vec::as_slice).unwrap_or(&[]), f);
        if eps.is_empty() {
            // No element in the dispatch map: the packet leaves NAT untouched and is rejected in filter.
            continue;
        }
        let chain = service_chain(spn);
        t.add_chain(regular(&chain)).rules = service_rules(f, svc, &eps, cfg);
        for ip in &ips {
            t.set_mut(MAP_SERVICE_IPS).elements.insert(Element {
                key: concat_key(&[
                    ip_bytes(ip),
                    vec![svc.protocol.number()],
                    svc.port.to_be_bytes().to_vec(),
                ]),
                value: Some(ElementValue::Verdict(Verdict::Goto(chain.clone()))),
            });
        }
        for ep in &eps {
            t.set_mut(SET_HAIRPIN).elements.insert(Element {
                key: concat_key(&[ip_bytes(&ep.ip), ip_bytes(&ep.ip)]),
                value: None,
            });
        }
    }
    t
}

/// Ready endpoints of the family; when none is ready, the serving ones that are terminating (kube-proxy's
/// fallback so that a rolling update does not black-hole a service).
fn usable_endpoints(all: &[Endpoint], f: IpFamily) -> Vec<Endpoint> {
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

fn skeleton(t: &mut TableState, f: IpFamily, cfg: &RenderConfig) {
    let a = addr_type(f);
    t.add_set(Set {
        name: SET_CLUSTER_IPS.into(),
        key: vec![a],
        data: vec![],
        timeout_ms: None,
        dynamic: false,
    });
    t.add_set(Set {
        name: MAP_SERVICE_IPS.into(),
        key: vec![a, DataType::InetProto, DataType::InetService],
        data: vec![DataType::Verdict],
        timeout_ms: None,
        dynamic: false,
    });
    t.add_set(Set {
        name: SET_HAIRPIN.into(),
        key: vec![a, a],
        data: vec![],
        timeout_ms: None,
        dynamic: false,
    });

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
    .rules = vec![jump(CHAIN_CLUSTER_IPS_CHECK)];
    t.add_chain(base(
        CHAIN_FILTER_OUTPUT,
        ChainType::Filter,
        Hook::Output,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![jump(CHAIN_CLUSTER_IPS_CHECK)];

    t.add_chain(regular(CHAIN_SERVICES)).rules = vec![RuleBuilder::new()
        .vmap(&[daddr(f), Field::L4Proto, Field::ThDport], MAP_SERVICE_IPS)
        .build()];

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

    t.add_chain(regular(CHAIN_CLUSTER_IPS_CHECK)).rules = vec![RuleBuilder::new()
        .in_set(&[daddr(f)], SET_CLUSTER_IPS, false)
        .verdict(Verdict::Goto(CHAIN_REJECT.into()))
        .comment("no endpoints, or not a service port")
        .build()];

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
}

fn service_rules(
    f: IpFamily,
    svc: &ServicePort,
    eps: &[Endpoint],
    cfg: &RenderConfig,
) -> Vec<Rule> {
    let comment = svc.name.to_string();
    let mut rules = Vec::new();
    if cfg.masquerade_all {
        rules.push(RuleBuilder::new().mark_or(cfg.masquerade_bit).build());
    } else {
        for cidr in cfg.cluster_cidrs.iter().filter(|c| c.family() == f) {
            rules.push(
                RuleBuilder::new()
                    .prefix(saddr(f), &cidr.addr, cidr.prefix, true)
                    .mark_or(cfg.masquerade_bit)
                    .comment("from outside the cluster CIDR")
                    .build(),
            );
        }
    }
    let n = eps.len() as u32;
    for (k, ep) in eps.iter().enumerate() {
        let remaining = n - k as u32;
        // The transport match makes the port mapping explicit (and keeps the text loadable by nft).
        let mut r = RuleBuilder::new().cmp(Field::L4Proto, CmpOp::Eq, vec![svc.protocol.number()]);
        if remaining > 1 {
            r = r.numgen_eq(remaining, 0);
        }
        rules.push(r.dnat(&ep.ip, ep.port).comment(comment.clone()).build());
    }
    rules
}

#[cfg(test)]
mod tests {
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
    fn endpoints_are_chosen_uniformly_and_dispatched_by_map() {
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
        let chain = &v4.chains[&service_chain(&spn)];
        let moduli: Vec<Option<u32>> = chain
            .rules
            .iter()
            .map(|r| {
                r.exprs.iter().find_map(|e| match e {
                    Expr::Numgen { modulus, .. } => Some(*modulus),
                    _ => None,
                })
            })
            .collect();
        assert_eq!(moduli, vec![Some(3), Some(2), None]);
        assert_eq!(v4.sets[MAP_SERVICE_IPS].elements.len(), 1);
        assert_eq!(v4.sets[SET_HAIRPIN].elements.len(), 3);
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
        assert_eq!(t.sets[SET_CLUSTER_IPS].elements.len(), 1);
        assert!(!t.chains.contains_key(&service_chain(&spn)));
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
        let (spn, sp) = svc("a", "10.96.0.1", 80, Protocol::Tcp);
        let services: ServiceMap = [(spn.clone(), sp)].into();
        let eps: EndpointsMap = [(spn.clone(), vec![ep("10.0.0.1", 8080, true)])].into();
        let mut cfg = RenderConfig::default();
        let none = render(&services, &eps, &cfg)[0].chains[&service_chain(&spn)]
            .rules
            .len();
        cfg.cluster_cidrs = vec!["10.0.0.0/8".parse().unwrap()];
        let cidr = &render(&services, &eps, &cfg)[0];
        let text = crate::nft::text::render_table(cidr);
        assert!(
            text.contains("ip saddr != 10.0.0.0/8 meta mark set meta mark | 0x00004000"),
            "{text}"
        );
        assert_eq!(cidr.chains[&service_chain(&spn)].rules.len(), none + 1);
        cfg.masquerade_all = true;
        let all = &render(&services, &eps, &cfg)[0];
        let rules = &all.chains[&service_chain(&spn)].rules;
        assert_eq!(
            crate::nft::text::render_rule(&rules[0], all),
            "meta mark set meta mark | 0x00004000"
        );
    }
}
