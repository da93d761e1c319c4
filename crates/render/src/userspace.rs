//! Userspace mode (`--proxy-mode userspace`): nf_tables only sends service traffic to the relay. One map,
//! `relay-ports`, keyed like the nf_tables mode's dispatch (`daddr . l4proto . dport`), gives the relay's
//! listening port for each frontend, and one rule per hook redirects there: no rule or chain per service.
//! The relay's listeners for those redirects bind every address on ephemeral ports; one input rule drops what
//! reaches them without having been redirected (`ct status dnat` unset), so a ClusterIP-only service is never
//! reachable at `node:port` from outside, nor from the node itself. A service port without endpoints has no
//! redirect: its addresses are in `relay-no-endpoints`, rejected in filter input, forward and output.

use super::claims::{FrontendKind, Precedence};
use super::common::*;
use super::names::*;
use super::Piece;
use nftkube_model::{IpFamily, Protocol, ServicePort};
use nftkube_nft::build::{concat_key, ip_bytes, Field, RuleBuilder};
use nftkube_nft::ir::*;
use std::net::IpAddr;

/// The tables of userspace mode, without elements (ip, then ip6).
pub fn skeleton() -> Vec<TableState> {
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .map(table)
        .collect()
}

fn table(f: IpFamily) -> TableState {
    let mut t = TableState::new(nft_family(f), TABLE);
    t.add_set(Set::new(
        MAP_RELAY_PORTS,
        vec![addr_type(f), DataType::InetProto, DataType::InetService],
        vec![DataType::InetService],
    ));
    let redirect = || {
        RuleBuilder::new()
            .redirect_map(&[daddr(f), Field::L4Proto, Field::ThDport], MAP_RELAY_PORTS)
            .build()
    };
    // Traffic from pods and outside (to the incoming interface's address), and from the node itself (to
    // loopback): the relay listens on every address.
    for (name, hook) in [
        (CHAIN_NAT_PREROUTING, Hook::Prerouting),
        (CHAIN_NAT_OUTPUT, Hook::Output),
    ] {
        t.add_chain(Chain::base(name, ChainType::Nat, hook, PRIO_DSTNAT))
            .rules = vec![redirect()];
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

/// Every frontend address of a service port in a family: ClusterIPs, external IPs, LoadBalancer IPs.
pub fn frontend_ips(svc: &ServicePort, f: IpFamily) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = svc
        .cluster_ips
        .iter()
        .chain(&svc.external_ips)
        .chain(&svc.load_balancer_ips)
        .copied()
        .filter(|ip| IpFamily::of(ip) == f)
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

/// One service port's `relay-ports` elements: each frontend address of family `f` to `relay_port`. None for
/// SCTP, which the relay does not carry.
pub fn relay_pieces(svc: &ServicePort, f: IpFamily, relay_port: u16) -> Vec<Piece> {
    if svc.protocol == Protocol::Sctp {
        return Vec::new();
    }
    let value = ElementValue::Data(relay_port.to_be_bytes().to_vec().into());
    frontend_pieces(svc, f, MAP_RELAY_PORTS, Some(value))
}

/// One service port's `relay-no-endpoints` elements, for a port without endpoints of family `f`, or an SCTP
/// port (the relay carries TCP and UDP): each frontend address, rejected instead of redirected.
pub fn no_endpoint_pieces(svc: &ServicePort, f: IpFamily) -> Vec<Piece> {
    frontend_pieces(svc, f, SET_RELAY_NO_ENDPOINTS, None)
}

/// An element per frontend address of family `f` (`addr . proto . port`) in `set`.
fn frontend_pieces(
    svc: &ServicePort,
    f: IpFamily,
    set: &str,
    value: Option<ElementValue>,
) -> Vec<Piece> {
    let set = PieceSet::named(set);
    frontend_ips(svc, f)
        .iter()
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
        let t = table(IpFamily::V4);
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

    #[test]
    fn every_frontend_address_of_the_family_maps_to_the_relay_port() {
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
        let v4 = relay_pieces(&sp, IpFamily::V4, 40000);
        assert_eq!(v4.len(), 2);
        let Piece::Element { element, .. } = &v4[0] else {
            panic!("{v4:?}")
        };
        assert_eq!(&element.key[..], &[10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0]);
        assert_eq!(relay_pieces(&sp, IpFamily::V6, 40001).len(), 1);
        let rejected = no_endpoint_pieces(&sp, IpFamily::V4);
        assert_eq!(rejected.len(), 2);
        let Piece::Element { element, .. } = &rejected[0] else {
            panic!("{rejected:?}")
        };
        assert!(element.value.is_none());
        // SCTP is never redirected (the relay carries TCP and UDP): its frontends are rejected instead.
        sp.protocol = Protocol::Sctp;
        assert!(relay_pieces(&sp, IpFamily::V4, 40000).is_empty());
        let rejected = no_endpoint_pieces(&sp, IpFamily::V4);
        assert_eq!(rejected.len(), 2);
        let Piece::Element { element, .. } = &rejected[0] else {
            panic!("{rejected:?}")
        };
        assert_eq!(element.key[4], 132, "the key names SCTP: {:?}", element.key);
    }
}
