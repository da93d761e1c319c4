//! Userspace mode (`--proxy-mode userspace`): nf_tables only sends service traffic to the relay. One map,
//! `relay-ports`, keyed like the nf_tables mode's dispatch (`daddr . l4proto . dport`), gives the relay's
//! listening port for each frontend, and a few rules per hook redirect there: no rule or chain per service.
//! The relay's listeners for those redirects bind every address on ephemeral ports; one input rule drops what
//! reaches them without having been redirected (`ct status dnat` unset), so a ClusterIP-only service is never
//! reachable at `node:port` from outside, nor from the node itself. A service port without endpoints has no
//! redirect: its addresses are in `relay-no-endpoints`, rejected in filter input, forward and output.
//!
//! The Service's policies, as kube-proxy applies them:
//! - internalTrafficPolicy Local: the ClusterIPs go to a listener with this node's endpoints only; with none
//!   here (while there are some elsewhere) the ClusterIPs are in `no-local-endpoints` and have no redirect:
//!   dropped, whoever sends.
//! - externalTrafficPolicy Local: external and LoadBalancer IPs go to a listener with this node's endpoints,
//!   which sends this node's pods and the node itself to every endpoint (the relay tells them by address).
//!   With no local endpoint, they are in `no-local-endpoints` (NodePorts: `no-local-endpoint-nodeports`):
//!   traffic from the node and its pods is redirected first, the rest dropped.
//! - loadBalancerSourceRanges: the LoadBalancer IPs jump, through `service-ips` (the dispatch map's name, so
//!   the sync engine orders it before the chains it names), to a chain of the service's own that returns for
//!   sources in the ranges and drops the rest, before anything is redirected.

use super::claims::{FrontendKind, Precedence};
use super::common::*;
use super::names::*;
use super::{Piece, RenderConfig};
use nftkube_model::{
    Cidr, Endpoint, IpFamily, NodePortAddresses, Protocol, ServicePort, TrafficPolicy,
};
use nftkube_nft::build::{concat_key, ip_bytes, Field, RuleBuilder};
use nftkube_nft::ir::*;
use std::net::IpAddr;
use std::sync::Arc;

/// The tables of userspace mode, without elements (ip, then ip6), for a renderer configured as `cfg` (its
/// pod detector tells this node's pods).
pub fn skeleton_for(cfg: &RenderConfig) -> Vec<TableState> {
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .map(|f| table(f, cfg))
        .collect()
}

/// The tables of userspace mode for the default configuration (no pod detector).
pub fn skeleton() -> Vec<TableState> {
    skeleton_for(&RenderConfig::default())
}

fn table(f: IpFamily, cfg: &RenderConfig) -> TableState {
    let mut t = TableState::new(nft_family(f), TABLE);
    let frontend_key = vec![addr_type(f), DataType::InetProto, DataType::InetService];
    t.add_set(Set::new(
        MAP_RELAY_PORTS,
        frontend_key.clone(),
        vec![DataType::InetService],
    ));
    t.add_set(Set::new(
        MAP_SERVICE_IPS,
        frontend_key.clone(),
        vec![DataType::Verdict],
    ));
    t.add_set(Set::new(SET_NO_LOCAL_ENDPOINTS, frontend_key, vec![]));
    t.add_set(Set::new(
        SET_NO_LOCAL_NODEPORTS,
        vec![DataType::InetProto, DataType::InetService],
        vec![],
    ));
    let rules = nat_rules(f, cfg);
    // Traffic from pods and outside (to the incoming interface's address), and from the node itself (to
    // loopback): the relay listens on every address.
    for (name, hook) in [
        (CHAIN_NAT_PREROUTING, Hook::Prerouting),
        (CHAIN_NAT_OUTPUT, Hook::Output),
    ] {
        t.add_chain(Chain::base(name, ChainType::Nat, hook, PRIO_DSTNAT))
            .rules = rules.clone();
    }
    t.add_set(Set::new(
        SET_RELAY_LISTENERS,
        vec![DataType::InetProto, DataType::InetService],
        vec![],
    ));
    // `redirect` sets the connection's DNAT status on its first packet, so every packet of a redirected
    // connection (or UDP flow) passes; one addressed to a relay port directly does not.
    let unredirected = RuleBuilder::new()
        .in_set(
            &[Field::L4Proto, Field::ThDport],
            SET_RELAY_LISTENERS,
            false,
        )
        .ct_lacks(CtKey::Status, CT_STATUS_DNAT)
        .verdict(Verdict::Drop)
        .build();
    add_no_endpoint_reject(&mut t, f, unredirected);
    t
}

/// The redirect, after the policies: loadBalancerSourceRanges first; then the node's own traffic and its
/// pods' are redirected (a Local external policy does not hold them); then what has no local endpoint is
/// dropped; then everything else is redirected. A redirect ends the chain.
fn nat_rules(f: IpFamily, cfg: &RenderConfig) -> Vec<Rule> {
    let frontend = [daddr(f), Field::L4Proto, Field::ThDport];
    let redirect = |start: RuleBuilder, comment: &str| {
        start
            .redirect_map(&frontend, MAP_RELAY_PORTS)
            .comment(comment)
            .build()
    };
    let pod = super::chains::local_traffic(f, cfg, false);
    let mut rules = vec![RuleBuilder::new()
        .vmap(&frontend, MAP_SERVICE_IPS)
        .comment("loadBalancerSourceRanges")
        .build()];
    rules.push(redirect(
        RuleBuilder::new().saddr_is_local(),
        "from the node",
    ));
    if let Some(pod) = pod.clone() {
        rules.push(redirect(pod, "from a pod"));
    }
    rules.push(
        RuleBuilder::new()
            .in_set(&frontend, SET_NO_LOCAL_ENDPOINTS, false)
            .verdict(Verdict::Drop)
            .comment("no local endpoint")
            .build(),
    );
    // NodePorts are listened on directly: only their drop is here, for outside traffic.
    rules.push(
        RuleBuilder::new()
            .saddr_is_local()
            .verdict(Verdict::Accept)
            .build(),
    );
    if let Some(pod) = pod {
        rules.push(pod.verdict(Verdict::Accept).build());
    }
    rules.push(
        RuleBuilder::new()
            .daddr_is_local()
            .in_set(
                &[Field::L4Proto, Field::ThDport],
                SET_NO_LOCAL_NODEPORTS,
                false,
            )
            .verdict(Verdict::Drop)
            .comment("NodePort: no local endpoint")
            .build(),
    );
    rules.push(redirect(RuleBuilder::new(), "to the relay"));
    rules
}

/// Frontends of service ports without endpoints are not redirected (they have no `relay-ports` element):
/// their packets are rejected where they would leave or enter the node (TCP reset, else ICMP port
/// unreachable), as in the nf_tables mode. `input_first` leads the input chain.
fn add_no_endpoint_reject(t: &mut TableState, f: IpFamily, input_first: Rule) {
    t.add_set(Set::new(
        SET_RELAY_NO_ENDPOINTS,
        vec![addr_type(f), DataType::InetProto, DataType::InetService],
        vec![],
    ));
    super::base::add_reject(t, f);
    let reject = || {
        RuleBuilder::new()
            .in_set(
                &[daddr(f), Field::L4Proto, Field::ThDport],
                SET_RELAY_NO_ENDPOINTS,
                false,
            )
            .verdict(Verdict::Goto(CHAIN_REJECT.into()))
            .build()
    };
    t.add_chain(Chain::base(
        CHAIN_FILTER_INPUT,
        ChainType::Filter,
        Hook::Input,
        PRIO_FILTER_EARLY,
    ))
    .rules = vec![input_first, reject()];
    for (name, hook) in [
        (CHAIN_FILTER_FORWARD, Hook::Forward),
        (CHAIN_FILTER_OUTPUT, Hook::Output),
    ] {
        t.add_chain(Chain::base(
            name,
            ChainType::Filter,
            hook,
            PRIO_FILTER_EARLY,
        ))
        .rules = vec![reject()];
    }
}

/// The `relay-listeners` element of the relay's redirect target for one service port and family.
pub fn listener_piece(svc: &ServicePort, f: IpFamily, relay_port: u16) -> Piece {
    Piece::Element {
        family: nft_family(f),
        set: PieceSet::named(SET_RELAY_LISTENERS),
        element: Element {
            key: concat_key(&[
                vec![svc.protocol.number()],
                relay_port.to_be_bytes().to_vec(),
            ])
            .into(),
            value: None,
        },
        precedence: Precedence::of(svc, FrontendKind::ClusterIp),
    }
}

/// The ClusterIPs of a service port in a family.
pub fn cluster_ips(svc: &ServicePort, f: IpFamily) -> Vec<IpAddr> {
    of_family(&svc.cluster_ips, f)
}

/// The external frontends of a service port in a family: its external IPs (when served) and LoadBalancer IPs,
/// less any that is also a ClusterIP.
pub fn external_ips(svc: &ServicePort, f: IpFamily, cfg: &RenderConfig) -> Vec<IpAddr> {
    let mut ips = match cfg.serve_external_ips {
        true => of_family(&svc.external_ips, f),
        false => Vec::new(),
    };
    ips.extend(of_family(&svc.load_balancer_ips, f));
    ips.sort();
    ips.dedup();
    ips.retain(|ip| !svc.cluster_ips.contains(ip));
    ips
}

/// Every frontend address of a service port in a family: ClusterIPs, external IPs, LoadBalancer IPs.
pub fn frontend_ips(svc: &ServicePort, f: IpFamily, cfg: &RenderConfig) -> Vec<IpAddr> {
    let mut ips = cluster_ips(svc, f);
    ips.extend(external_ips(svc, f, cfg));
    ips
}

fn of_family(ips: &[IpAddr], f: IpFamily) -> Vec<IpAddr> {
    ips.iter()
        .copied()
        .filter(|ip| IpFamily::of(ip) == f)
        .collect()
}

/// The endpoints a service port's frontends of one family choose among, as the nf_tables mode chooses them:
/// `all`, cluster-wide (readiness fallback and topology hints applied); `local`, this node's (readiness
/// fallback applied).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Choice {
    /// Cluster-wide.
    pub all: Vec<Endpoint>,
    /// On this node.
    pub local: Vec<Endpoint>,
}

impl Choice {
    /// The choice for `svc`'s endpoints `endpoints` in family `f`.
    pub fn of(endpoints: &[Endpoint], f: IpFamily, cfg: &RenderConfig) -> Choice {
        let ready: Vec<Endpoint> = endpoints
            .iter()
            .filter(|e| IpFamily::of(&e.ip) == f && e.ready)
            .cloned()
            .collect();
        let all = match ready.is_empty() {
            false => super::services::topology_filter(ready, cfg),
            true => super::usable_endpoints(endpoints, f),
        };
        let mine: Vec<Endpoint> = endpoints
            .iter()
            .filter(|e| {
                !cfg.node_name.is_empty() && e.node_name.as_deref() == Some(cfg.node_name.as_str())
            })
            .cloned()
            .collect();
        Choice {
            all,
            local: super::usable_endpoints(&mine, f),
        }
    }

    /// What ClusterIP traffic reaches (internalTrafficPolicy).
    pub fn internal(&self, svc: &ServicePort) -> &[Endpoint] {
        match svc.internal_traffic_policy {
            TrafficPolicy::Local => &self.local,
            TrafficPolicy::Cluster => &self.all,
        }
    }

    /// What outside traffic to external IPs, LoadBalancer IPs and NodePorts reaches
    /// (externalTrafficPolicy; the node and its pods reach `all`).
    pub fn external(&self, svc: &ServicePort) -> &[Endpoint] {
        match svc.external_traffic_policy {
            TrafficPolicy::Local => &self.local,
            TrafficPolicy::Cluster => &self.all,
        }
    }

    /// A Local policy holds traffic to no endpoint while there are endpoints elsewhere: dropped.
    fn none_local(&self, policy: TrafficPolicy) -> bool {
        policy == TrafficPolicy::Local && self.local.is_empty() && !self.all.is_empty()
    }
}

/// The relay's listening ports for one service port's frontends of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelayPorts {
    /// Where its ClusterIPs are redirected.
    pub cluster: Option<u16>,
    /// Where its external and LoadBalancer IPs are redirected.
    pub external: Option<u16>,
}

/// One service port's elements (and firewall chain) in family `f`: redirects to the relay's `ports`, drops
/// where a Local policy finds no endpoint here, loadBalancerSourceRanges; rejects without endpoints (and for
/// SCTP, which the relay does not carry).
pub fn service_pieces(
    svc: &ServicePort,
    f: IpFamily,
    choice: &Choice,
    ports: RelayPorts,
    cfg: &RenderConfig,
) -> Vec<Piece> {
    if svc.protocol == Protocol::Sctp || choice.all.is_empty() {
        return no_endpoint_pieces(svc, f, cfg);
    }
    let mut out = firewall_pieces(svc, f, cfg);
    let port_value = |p: u16| Some(ElementValue::Data(p.to_be_bytes().to_vec().into()));
    let cluster = cluster_ips(svc, f);
    if choice.none_local(svc.internal_traffic_policy) {
        out.extend(frontend_pieces(
            svc,
            f,
            &cluster,
            SET_NO_LOCAL_ENDPOINTS,
            None,
        ));
    } else if let Some(p) = ports.cluster {
        out.extend(frontend_pieces(
            svc,
            f,
            &cluster,
            MAP_RELAY_PORTS,
            port_value(p),
        ));
    }
    let external = external_ips(svc, f, cfg);
    if let Some(p) = ports.external {
        out.extend(frontend_pieces(
            svc,
            f,
            &external,
            MAP_RELAY_PORTS,
            port_value(p),
        ));
    }
    if choice.none_local(svc.external_traffic_policy) {
        out.extend(frontend_pieces(
            svc,
            f,
            &external,
            SET_NO_LOCAL_ENDPOINTS,
            None,
        ));
        out.extend(no_local_node_port(svc, f, cfg));
    }
    for p in [ports.cluster, ports.external].into_iter().flatten() {
        out.push(listener_piece(svc, f, p));
    }
    out
}

/// The `no-local-endpoint-nodeports` element of a service port's NodePort, where NodePorts are served.
fn no_local_node_port(svc: &ServicePort, f: IpFamily, cfg: &RenderConfig) -> Option<Piece> {
    let np = svc.node_port?;
    if cfg.nodeport_addresses == NodePortAddresses::None || cluster_ips(svc, f).is_empty() {
        return None;
    }
    Some(Piece::Element {
        family: nft_family(f),
        set: PieceSet::named(SET_NO_LOCAL_NODEPORTS),
        element: Element {
            key: concat_key(&[vec![svc.protocol.number()], np.to_be_bytes().to_vec()]).into(),
            value: None,
        },
        precedence: Precedence::of(svc, FrontendKind::NodePort),
    })
}

/// loadBalancerSourceRanges of family `f`: a chain of the service port's own, which returns for sources in
/// the ranges (and for the LoadBalancer IPs themselves when a range holds one of the node's addresses, as
/// kube-proxy allows load balancers that hairpin through the node) and drops the rest; each LoadBalancer
/// IP jumps to it. Nothing without ranges of the family.
fn firewall_pieces(svc: &ServicePort, f: IpFamily, cfg: &RenderConfig) -> Vec<Piece> {
    let ranges: Vec<&Cidr> = svc
        .load_balancer_source_ranges
        .iter()
        .filter(|c| c.family() == f)
        .collect();
    let lb_ips = of_family(&svc.load_balancer_ips, f);
    if ranges.is_empty() || lb_ips.is_empty() {
        return Vec::new();
    }
    let chain = super::chains::firewall_chain_state(svc, f, &ranges, Verdict::Return, cfg);
    let name = chain.chain.name.clone();
    let verdict = ElementValue::Verdict(Verdict::Jump(name.as_str().into()));
    let mut out = vec![Piece::Chain {
        family: nft_family(f),
        chain: Arc::new(chain),
    }];
    out.extend(frontend_pieces(
        svc,
        f,
        &lb_ips,
        MAP_SERVICE_IPS,
        Some(verdict),
    ));
    out
}

/// One service port's `relay-no-endpoints` elements, for a port without endpoints of family `f`, or an SCTP
/// port (the relay carries TCP and UDP): each frontend address, rejected instead of redirected.
pub fn no_endpoint_pieces(svc: &ServicePort, f: IpFamily, cfg: &RenderConfig) -> Vec<Piece> {
    let ips = frontend_ips(svc, f, cfg);
    frontend_pieces(svc, f, &ips, SET_RELAY_NO_ENDPOINTS, None)
}

/// An element per address of `ips` (`addr . proto . port`) in `set`.
fn frontend_pieces(
    svc: &ServicePort,
    f: IpFamily,
    ips: &[IpAddr],
    set: &str,
    value: Option<ElementValue>,
) -> Vec<Piece> {
    let set = PieceSet::named(set);
    ips.iter()
        .map(|ip| Piece::Element {
            family: nft_family(f),
            set,
            element: Element {
                key: concat_key(&[
                    ip_bytes(ip),
                    vec![svc.protocol.number()],
                    svc.port.to_be_bytes().to_vec(),
                ])
                .into(),
                value: value.clone(),
            },
            precedence: Precedence::of_address(svc, ip),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_model::{NamespacedName, ServicePortName};

    #[test]
    fn the_userspace_table_redirects_through_one_map_and_lists_like_nft() {
        let t = table(IpFamily::V4, &RenderConfig::default());
        let text = nftkube_nft::text::render_table(&t);
        assert!(
            text.contains("meta l4proto { tcp, udp } redirect to :ip daddr . meta l4proto . th dport map @relay-ports"),
            "{text}"
        );
        assert!(
            text.contains("meta l4proto . th dport @relay-listeners ct status & dnat == 0 drop"),
            "{text}"
        );
        assert!(
            text.contains(
                "ip daddr . meta l4proto . th dport @relay-no-endpoints goto reject-chain"
            ),
            "{text}"
        );
        // nat prerouting and output; filter input, forward and output; the reject chain.
        assert_eq!(t.chains.len(), 6, "{text}");
    }

    fn sp() -> ServicePort {
        let name = ServicePortName {
            service: NamespacedName::new("ns", "web"),
            port: "http".into(),
            protocol: Protocol::Tcp,
        };
        let mut sp = ServicePort::cluster_ip(
            name,
            vec!["10.96.0.1".parse().unwrap(), "fd00::1".parse().unwrap()],
            80,
        );
        sp.external_ips = vec!["192.0.2.1".parse().unwrap(), "10.96.0.1".parse().unwrap()];
        sp
    }

    fn ep(ip: &str, node: &str) -> Endpoint {
        let mut e = Endpoint::ready(ip.parse().unwrap(), 8080);
        e.node_name = Some(node.into());
        e
    }

    fn in_set<'a>(pieces: &'a [Piece], name: &str) -> Vec<&'a Element> {
        let want = PieceSet::named(name);
        pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Element { set, element, .. } if *set == want => Some(element),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn every_frontend_address_of_the_family_maps_to_the_relay_port() {
        let mut sp = sp();
        let cfg = RenderConfig::default();
        let choice = Choice::of(&[ep("10.0.0.1", "a")], IpFamily::V4, &cfg);
        let ports = RelayPorts {
            cluster: Some(40000),
            external: Some(40001),
        };
        let v4 = service_pieces(&sp, IpFamily::V4, &choice, ports, &cfg);
        let redirects = in_set(&v4, MAP_RELAY_PORTS);
        assert_eq!(redirects.len(), 2);
        assert_eq!(
            &redirects[0].key[..],
            &[10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0]
        );
        assert_eq!(in_set(&v4, SET_RELAY_LISTENERS).len(), 2);
        // Without endpoints of the family: every frontend rejected.
        let none = service_pieces(&sp, IpFamily::V6, &Choice::default(), ports, &cfg);
        assert_eq!(in_set(&none, SET_RELAY_NO_ENDPOINTS).len(), 1);
        assert!(in_set(&none, MAP_RELAY_PORTS).is_empty());
        // SCTP is never redirected (the relay carries TCP and UDP): its frontends are rejected instead.
        sp.protocol = Protocol::Sctp;
        let rejected = service_pieces(&sp, IpFamily::V4, &choice, ports, &cfg);
        let rejected = in_set(&rejected, SET_RELAY_NO_ENDPOINTS);
        assert_eq!(rejected.len(), 2);
        assert!(rejected[0].value.is_none());
        assert_eq!(
            rejected[0].key[4], 132,
            "the key names SCTP: {:?}",
            rejected[0].key
        );
    }

    #[test]
    fn local_policies_without_a_local_endpoint_drop_instead_of_redirecting() {
        let mut sp = sp();
        sp.internal_traffic_policy = TrafficPolicy::Local;
        sp.external_traffic_policy = TrafficPolicy::Local;
        sp.node_port = Some(30080);
        let cfg = RenderConfig {
            node_name: "here".into(),
            nodeport_addresses: NodePortAddresses::AllLocal,
            ..RenderConfig::default()
        };
        let ports = RelayPorts {
            cluster: Some(40000),
            external: Some(40001),
        };
        let elsewhere = Choice::of(&[ep("10.0.0.1", "there")], IpFamily::V4, &cfg);
        let pieces = service_pieces(&sp, IpFamily::V4, &elsewhere, ports, &cfg);
        // The ClusterIP: dropped, not redirected; the external IP: redirected (the node and its pods reach
        // every endpoint) and dropped for the rest; the NodePort likewise.
        assert_eq!(in_set(&pieces, SET_NO_LOCAL_ENDPOINTS).len(), 2);
        assert_eq!(in_set(&pieces, MAP_RELAY_PORTS).len(), 1);
        assert_eq!(in_set(&pieces, SET_NO_LOCAL_NODEPORTS).len(), 1);
        let here = Choice::of(
            &[ep("10.0.0.1", "there"), ep("10.0.0.2", "here")],
            IpFamily::V4,
            &cfg,
        );
        assert_eq!(here.internal(&sp).len(), 1);
        let pieces = service_pieces(&sp, IpFamily::V4, &here, ports, &cfg);
        assert!(in_set(&pieces, SET_NO_LOCAL_ENDPOINTS).is_empty());
        assert!(in_set(&pieces, SET_NO_LOCAL_NODEPORTS).is_empty());
        assert_eq!(in_set(&pieces, MAP_RELAY_PORTS).len(), 2);
    }

    #[test]
    fn source_ranges_guard_the_load_balancer_ips_only() {
        let mut sp = sp();
        sp.load_balancer_ips = vec!["203.0.113.7".parse().unwrap()];
        sp.load_balancer_source_ranges = vec![Cidr {
            addr: "198.51.100.0".parse().unwrap(),
            prefix: 24,
        }];
        let cfg = RenderConfig::default();
        let choice = Choice::of(&[ep("10.0.0.1", "a")], IpFamily::V4, &cfg);
        let ports = RelayPorts {
            cluster: Some(40000),
            external: Some(40001),
        };
        let pieces = service_pieces(&sp, IpFamily::V4, &choice, ports, &cfg);
        let jumps = in_set(&pieces, MAP_SERVICE_IPS);
        assert_eq!(jumps.len(), 1, "the LoadBalancer IP, not the external IP");
        let chain = pieces
            .iter()
            .find_map(|p| match p {
                Piece::Chain { chain, .. } => Some(chain.clone()),
                _ => None,
            })
            .expect("a firewall chain");
        let mut t = TableState::new(Family::Ip, TABLE);
        t.add_chain(chain.chain.clone()).rules = chain.rules.clone();
        let text = nftkube_nft::text::render_table(&t);
        assert!(text.contains("ip saddr 198.51.100.0/24 return"), "{text}");
        assert!(text.contains("drop"), "{text}");
        assert!(in_set(
            &service_pieces(&sp, IpFamily::V6, &choice, ports, &cfg),
            MAP_SERVICE_IPS
        )
        .is_empty());
    }
}
