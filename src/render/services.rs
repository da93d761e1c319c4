//! What each service port contributes (set elements, and which shared chains it needs), and the endpoint
//! selection rules (readiness fallback, topology hints, traffic policies). The fixed objects are in
//! `base.rs`, the `lb-*` and firewall chains in `chains.rs`.
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

use super::chains::*;
use super::common::*;
use super::names::*;
use super::{Piece, RenderConfig};
use crate::model::NodePortAddresses;
use crate::model::{Cidr, Endpoint, IpFamily, ServicePort, TrafficPolicy};
use crate::nft::build::{concat_key, ip_bytes};
use crate::nft::ir::*;
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
                set: PieceSet::named(set),
                element: Element {
                    key: key.into(),
                    value,
                },
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
                    Some(ElementValue::Data(
                        concat_key(&[ip_bytes(&ep.ip), ep.port.to_be_bytes().to_vec()]).into(),
                    )),
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
        // ClientIP affinity: every frontend of the service records its connections' endpoints.
        let affinity = svc.session_affinity_timeout;
        let record = affinity.map(|seconds| {
            let chain = super::affinity_chain(family, seconds);
            let target = chain.chain.name.clone();
            pieces.push(Piece::Chain { family, chain });
            target
        });
        if !internal.is_empty() {
            let n = internal.len() as u32;
            let chain = super::lb_chain(family, n, LbKind::Cluster, affinity.is_some(), cfg);
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
                if let Some(r) = &record {
                    pieces.push(element(
                        MAP_AFFINITY_SERVICES,
                        concat_key(&frontend(ip)),
                        goto(r),
                    ));
                }
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
            (LbKind::External, LbKind::NodePort)
        };
        if !external.is_empty() {
            let chain = super::lb_chain(family, n, ext_kind, affinity.is_some(), cfg);
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
                if let Some(r) = &record {
                    pieces.push(element(
                        MAP_AFFINITY_SERVICES,
                        concat_key(&frontend(ip)),
                        goto(r),
                    ));
                }
            }
        }
        if let Some(np) = node_port {
            let chain = super::lb_chain(family, n, np_kind, affinity.is_some(), cfg);
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
            if let Some(r) = &record {
                pieces.push(element(
                    MAP_AFFINITY_NODEPORTS,
                    concat_key(&node_port_key(np)),
                    goto(r),
                ));
            }
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
        let lb = |cfg: &RenderConfig| lb_chain_state(Family::Ip, 2, LbKind::Cluster, false, cfg);
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
