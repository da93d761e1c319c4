//! What the plugin wants in the kernel, as IR: the objects of one network in one family's table, and the
//! elements of one attachment.
//!
//! ```text
//! table ip nftkube-portmap {
//!   map ports-NET  { typeof meta l4proto . th dport : ip daddr . th dport }             any local address
//!   map hostip-NET { typeof ip daddr . meta l4proto . th dport : ip daddr . th dport }  one node address
//!   set targets-NET { typeof ip daddr . meta l4proto . th dport }            container . proto . port
//!   chain dnat-NET { CONDITIONS meta l4proto { tcp, udp, sctp } dnat ip addr . port to ip daddr . meta l4proto . th dport map @hostip-NET
//!                    CONDITIONS meta l4proto { tcp, udp, sctp } dnat ip addr . port to meta l4proto . th dport map @ports-NET }
//!   chain pre-NET  { type nat hook prerouting priority -100; fib daddr type local jump dnat-NET }
//!   chain out-NET  { type nat hook output priority -100; fib daddr type local jump dnat-NET }
//!   chain post-NET { type nat hook postrouting priority 100;
//!                    ct status dnat ip saddr SUBNET ip daddr . meta l4proto . th dport @targets-NET meta mark set meta mark | BIT
//!                    ct status dnat ip saddr 127.0.0.0/8 ip daddr . meta l4proto . th dport @targets-NET meta mark set ...
//!                    meta mark & BIT == BIT masquerade }
//!   chain guard-in-NET  { type filter hook input priority 0;                          (ip, with snat only)
//!                         ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct status & dnat == 0 drop }
//!   chain guard-fwd-NET { type filter hook forward priority 0; the same rule }
//! }
//! ```
//!
//! The postrouting rules are upstream's SNAT: connections from the containers' own subnet (hairpin: a
//! container to its own host port, or to a neighbour's on the same bridge, whose answer would otherwise go
//! straight back over the bridge and miss the node's NAT) and, in IPv4, from 127.0.0.1; with `masqAll`, one rule
//! for every connection to a mapped container instead. `targets` restricts them to connections this network
//! DNATed to its containers. One hairpin rule per container subnet seen on the network (its comment names
//! the subnet, so that the next ADD keeps it).
//!
//! The guard chains: 127.0.0.1 mappings need `route_localnet` on the node-side interfaces, which also lets a
//! container send packets to 127.0.0.0/8 over the bridge and reach the node's services bound to loopback.
//! kube-proxy's (and the agent's) firewall chain drops those "martian" packets, but the plugin must not
//! depend on an agent running: it drops them itself, all but the replies of connections it DNATed (a
//! localhost mapping's replies, addressed back to 127.0.0.1). IPv6 has no route_localnet.
//!
//! Every element carries the comment `CONTAINERID IFNAME`: DEL, CHECK and GC find an attachment's elements by
//! reading the kernel. Each network has its own chains and maps, so its conditions and its DEL never touch
//! another network. No rule per mapping: a mapping is one element in each of three sets.

use super::netconf::{NetConf, PortMapping, Subnet};
use nftkube_nft::build::{concat_key, ip_bytes, load_concat, Field, RuleBuilder};
use nftkube_nft::ir::*;
use std::net::IpAddr;

/// The plugin's table, in each family; never the proxy's `nftkube`.
pub(crate) const TABLE: &str = "nftkube-portmap";
/// The table's families.
pub(crate) const FAMILIES: [Family; 2] = [Family::Ip, Family::Ip6];

/// Base chain priorities, nft's `dstnat`, `srcnat` and `filter`.
const DSTNAT: i32 = -100;
const SRCNAT: i32 = 100;
const FILTER: i32 = 0;

/// The objects of one network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// The prerouting chain.
    pub(crate) pre: String,
    /// The output chain.
    pub(crate) out: String,
    /// The postrouting chain.
    pub(crate) post: String,
    /// The DNAT chain.
    pub(crate) dnat: String,
    /// The host-port map.
    pub(crate) ports: String,
    /// The host-IP map.
    pub(crate) hostip: String,
    /// The set of mapping targets.
    pub(crate) targets: String,
    /// The input chain that drops martian packets to 127.0.0.0/8 (IPv4).
    pub(crate) guard_in: String,
    /// The forward chain that drops them.
    pub(crate) guard_fwd: String,
}

impl Names {
    /// Names from a network name (checked by `netconf`: letters, digits, `_.-`, so an nft identifier once
    /// prefixed).
    pub fn of(network: &str) -> Names {
        let n = |prefix: &str| format!("{prefix}-{network}");
        Names {
            pre: n("pre"),
            out: n("out"),
            post: n("post"),
            dnat: n("dnat"),
            ports: n("ports"),
            hostip: n("hostip"),
            targets: n("targets"),
            guard_in: n("guard-in"),
            guard_fwd: n("guard-fwd"),
        }
    }

    /// The sets that hold elements of attachments.
    pub(crate) fn element_sets(&self) -> [&str; 3] {
        [&self.ports, &self.hostip, &self.targets]
    }
}

/// The `ip`/`ip6` address fields and typeof expressions of a family.
fn addr_fields(family: Family) -> (Field, Field, TypeofExpr, TypeofExpr) {
    if family == Family::Ip6 {
        (
            Field::Ip6Saddr,
            Field::Ip6Daddr,
            TypeofExpr::Ip6Saddr,
            TypeofExpr::Ip6Daddr,
        )
    } else {
        (
            Field::IpSaddr,
            Field::IpDaddr,
            TypeofExpr::IpSaddr,
            TypeofExpr::IpDaddr,
        )
    }
}

/// The sets of a network, declared `typeof` as nft declares them, so that their listing reloads.
pub fn sets(family: Family, names: &Names) -> Vec<Set> {
    use TypeofExpr::{MetaL4proto as Proto, ThDport as Port};
    let (_, _, _, daddr) = addr_fields(family);
    vec![
        Set::typed(&names.ports, vec![Proto, Port], vec![daddr, Port]),
        Set::typed(&names.hostip, vec![daddr, Proto, Port], vec![daddr, Port]),
        Set::typed(&names.targets, vec![daddr, Proto, Port], vec![]),
    ]
}

/// The chains of a network, with their rules; `subnets`: the container subnets of the network in `family`.
pub fn chains(
    family: Family,
    names: &Names,
    conf: &NetConf,
    subnets: &[Subnet],
) -> Vec<ChainState> {
    let entry = |name: &str, hook| ChainState {
        chain: Chain::base(name, ChainType::Nat, hook, DSTNAT),
        rules: vec![RuleBuilder::new()
            .daddr_is_local()
            .verdict(Verdict::Jump(names.dnat.as_str().into()))
            .build()],
    };
    let mut chains = vec![
        entry(&names.pre, Hook::Prerouting),
        entry(&names.out, Hook::Output),
        ChainState {
            chain: Chain::base(&names.post, ChainType::Nat, Hook::Postrouting, SRCNAT),
            rules: masquerade_rules(family, names, conf, subnets),
        },
        ChainState {
            chain: Chain::regular(&names.dnat),
            rules: dnat_rules(family, names, conf),
        },
    ];
    // With `snat` (IPv4), ADD turns route_localnet on: its martians are dropped here.
    if family == Family::Ip && conf.snat {
        let guard = |name: &str, hook| ChainState {
            chain: Chain::base(name, ChainType::Filter, hook, FILTER),
            rules: vec![drop_martian_localnet()],
        };
        chains.push(guard(&names.guard_in, Hook::Input));
        chains.push(guard(&names.guard_fwd, Hook::Forward));
    }
    chains
}

/// `ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct status & dnat == 0 drop`: packets to loopback from
/// elsewhere (a container, over an interface with route_localnet), but for the replies of DNATed connections.
fn drop_martian_localnet() -> Rule {
    let localnet: IpAddr = [127, 0, 0, 0].into();
    RuleBuilder::new()
        .prefix(Field::IpDaddr, &localnet, 8, false)
        .prefix(Field::IpSaddr, &localnet, 8, true)
        .ct_lacks(CtKey::Status, CT_STATUS_DNAT)
        .verdict(Verdict::Drop)
        .comment("martian localnet")
        .build()
}

/// The two lookups, the node-address-specific map first, each behind the network's conditions.
fn dnat_rules(family: Family, names: &Names, conf: &NetConf) -> Vec<Rule> {
    let (_, daddr, _, _) = addr_fields(family);
    let conditions = || {
        conf.conditions(family)
            .iter()
            .fold(RuleBuilder::new(), |r, m| m.apply(r))
            .transport_protocol()
    };
    vec![
        dnat_through(
            conditions(),
            family,
            &[daddr, Field::L4Proto, Field::ThDport],
            &names.hostip,
        ),
        dnat_through(
            conditions(),
            family,
            &[Field::L4Proto, Field::ThDport],
            &names.ports,
        ),
    ]
}

/// `dnat <family> addr . port to KEY map @map`.
fn dnat_through(rule: RuleBuilder, family: Family, key: &[Field], map: &str) -> Rule {
    let addr_slots = if family == Family::Ip6 { 4 } else { 1 };
    let mut rule = rule;
    for e in load_concat(key) {
        rule = rule.expr(e);
    }
    rule.expr(Expr::Lookup {
        set: map.to_owned(),
        sreg: REG_1,
        dreg: Some(REG_1),
        invert: false,
    })
    .expr(Expr::Nat {
        kind: NatKind::Dnat,
        family,
        reg_addr: Some(REG_1),
        reg_proto: Some(reg_at_slot(addr_slots)),
        flags: NatFlags::MAP_IPS | NatFlags::PROTO_SPECIFIED,
    })
    .build()
}

/// Upstream's SNAT semantics: with `snat`, connections from the container subnets (hairpin) and, in IPv4, from
/// 127.0.0.0/8 are masqueraded, or all of them with `masqAll`; the decision sets `markMasqBit`, and marked
/// packets are masqueraded.
fn masquerade_rules(
    family: Family,
    names: &Names,
    conf: &NetConf,
    subnets: &[Subnet],
) -> Vec<Rule> {
    if !conf.snat {
        return Vec::new();
    }
    let bit = 1u32 << conf.mark_masq_bit;
    let (saddr, daddr, _, _) = addr_fields(family);
    let target = [daddr, Field::L4Proto, Field::ThDport];
    let to_target = |r: RuleBuilder| {
        r.ct_has(CtKey::Status, CT_STATUS_DNAT)
            .in_set(&target, &names.targets, false)
            .mark_or(bit)
    };
    let from = |net: &IpAddr, prefix: u8| RuleBuilder::new().prefix(saddr, net, prefix, false);
    let mut rules = Vec::new();
    if conf.masq_all {
        rules.push(to_target(RuleBuilder::new()).build());
    } else {
        for s in subnets {
            let rule = from(&s.net, s.prefix).comment(subnet_comment(s));
            rules.push(to_target(rule).build());
        }
        if family == Family::Ip {
            let loopback: IpAddr = [127, 0, 0, 0].into();
            rules.push(to_target(from(&loopback, 8)).build());
        }
    }
    rules.push(
        RuleBuilder::new()
            .mark_has(bit, true)
            .masquerade(false)
            .build(),
    );
    rules
}

const SUBNET_COMMENT: &str = "hairpin from ";

fn subnet_comment(s: &Subnet) -> String {
    format!("{SUBNET_COMMENT}{s}")
}

/// The container subnets a network's postrouting chain already masquerades (from its rules' comments).
pub(crate) fn known_subnets(chain: Option<&ChainState>) -> Vec<Subnet> {
    chain
        .into_iter()
        .flat_map(|c| &c.rules)
        .filter_map(|r| r.comment.as_deref()?.strip_prefix(SUBNET_COMMENT))
        .filter_map(Subnet::parse)
        .collect()
}

/// The comment that marks an attachment's elements.
pub fn owner_comment(container_id: &str, ifname: &str) -> String {
    format!("{container_id} {ifname}")
}

/// Splits a comment written by `owner_comment`.
pub(crate) fn parse_owner(comment: &str) -> Option<(&str, &str)> {
    let (id, ifname) = comment.split_once(' ')?;
    (!id.is_empty() && !ifname.is_empty() && !ifname.contains(' ')).then_some((id, ifname))
}

/// One element to hold: the set it belongs to and the element.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Wanted {
    /// The set or map.
    pub(crate) set: String,
    /// The element, with its comment.
    pub element: CommentedElement,
}

/// The elements of one attachment in one family: for each mapping that applies, one in `ports` or `hostip`
/// and one in `targets`.
pub fn elements(
    family: Family,
    names: &Names,
    mappings: &[PortMapping],
    container: IpAddr,
    comment: &str,
) -> Vec<Wanted> {
    let mut out = Vec::new();
    let mut push = |set: &str, key: Vec<u8>, value: Option<Vec<u8>>| {
        out.push(Wanted {
            set: set.to_owned(),
            element: CommentedElement {
                element: Element {
                    key: key.into(),
                    value: value.map(|v| ElementValue::Data(v.into())),
                },
                comment: comment.to_owned(),
            },
        })
    };
    let c = ip_bytes(&container);
    for m in mappings.iter().filter(|m| m.applies_to(family)) {
        let proto = vec![m.protocol.number()];
        let hport = m.host_port.to_be_bytes().to_vec();
        let cport = m.container_port.to_be_bytes().to_vec();
        let value = concat_key(&[c.clone(), cport.clone()]);
        match m.host_ip {
            Some(ip) => push(
                &names.hostip,
                concat_key(&[ip_bytes(&ip), proto.clone(), hport]),
                Some(value),
            ),
            None => push(
                &names.ports,
                concat_key(&[proto.clone(), hport]),
                Some(value),
            ),
        }
        push(&names.targets, concat_key(&[c.clone(), proto, cport]), None);
    }
    out.sort();
    out.dedup_by(|a, b| a.set == b.set && a.element.element.key == b.element.element.key);
    out
}

/// A host port a `ports` or `hostip` element publishes: (node address or any, protocol number, port).
pub(crate) fn published(
    family: Family,
    names: &Names,
    set: &str,
    key: &[u8],
) -> Option<(Option<IpAddr>, u8, u16)> {
    let port = |at: usize| Some(u16::from_be_bytes(key.get(at..at + 2)?.try_into().ok()?));
    if set == names.ports {
        return Some((None, *key.first()?, port(4)?));
    }
    if set == names.hostip {
        let alen = if family == Family::Ip6 { 16 } else { 4 };
        let ip: IpAddr = if alen == 4 {
            <[u8; 4]>::try_from(key.get(..4)?).ok()?.into()
        } else {
            <[u8; 16]>::try_from(key.get(..16)?).ok()?.into()
        };
        return Some((Some(ip), *key.get(alen)?, port(alen + 4)?));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netconf::Protocol;

    fn mapping(host_ip: Option<&str>) -> PortMapping {
        PortMapping {
            host_port: 8080,
            container_port: 80,
            protocol: Protocol::Udp,
            host_ip: host_ip.map(|h| h.parse().unwrap()),
            any_of: None,
        }
    }

    #[test]
    fn elements_and_published_ports() {
        let n = Names::of("net1");
        let c: IpAddr = "10.88.0.2".parse().unwrap();
        let e = elements(
            Family::Ip,
            &n,
            &[mapping(None), mapping(Some("10.1.0.1"))],
            c,
            "c1 eth0",
        );
        // ports, hostip, and one targets element for both mappings (the same container port).
        assert_eq!(e.len(), 3, "{e:#?}");
        let ports = e.iter().find(|w| w.set == n.ports).unwrap();
        assert_eq!(
            published(Family::Ip, &n, &n.ports, &ports.element.element.key),
            Some((None, 17, 8080))
        );
        let hostip = e.iter().find(|w| w.set == n.hostip).unwrap();
        assert_eq!(
            published(Family::Ip, &n, &n.hostip, &hostip.element.element.key),
            Some((Some("10.1.0.1".parse().unwrap()), 17, 8080))
        );
        // An IPv4 node address does not apply to the ip6 table.
        let v6 = elements(
            Family::Ip6,
            &n,
            &[mapping(Some("10.1.0.1"))],
            "fd00::2".parse().unwrap(),
            "c1 eth0",
        );
        assert!(v6.is_empty());
    }

    #[test]
    fn ipv4_with_snat_guards_loopback_on_input_and_forward() {
        let n = Names::of("net1");
        let conf = |snat: bool| {
            let text = format!(r#"{{"cniVersion": "1.1.0", "name": "net1", "snat": {snat}}}"#);
            crate::netconf::parse(text.as_bytes()).unwrap()
        };
        let guards = |family, snat| -> Vec<(Option<Hook>, String)> {
            let mut t = TableState::new(family, TABLE);
            for c in chains(family, &n, &conf(snat), &[]) {
                t.add_chain(c.chain).rules = c.rules;
            }
            [&n.guard_in, &n.guard_fwd]
                .into_iter()
                .filter_map(|name| t.chains.get(name.as_str()))
                .map(|c| {
                    let hook = c.chain.base.as_ref().map(|b| b.hook);
                    let rules: Vec<String> = c
                        .rules
                        .iter()
                        .map(|r| nftkube_nft::text::render_rule(r, &t))
                        .collect();
                    (hook, rules.join("; "))
                })
                .collect()
        };
        let v4 = guards(Family::Ip, true);
        assert_eq!(
            v4.iter().map(|(h, _)| *h).collect::<Vec<_>>(),
            [Some(Hook::Input), Some(Hook::Forward)]
        );
        for (_, rule) in &v4 {
            assert!(
                rule.starts_with("ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct status")
                    && rule.contains("dnat")
                    && rule.contains("drop"),
                "{rule}"
            );
        }
        assert!(
            guards(Family::Ip6, true).is_empty(),
            "IPv6 has no route_localnet"
        );
        assert!(
            guards(Family::Ip, false).is_empty(),
            "without snat route_localnet stays off"
        );
    }

    #[test]
    fn owner_comments_round_trip() {
        assert_eq!(
            parse_owner(&owner_comment("abc", "eth0")),
            Some(("abc", "eth0"))
        );
        assert_eq!(parse_owner("foreign"), None);
    }
}
