//! Facts about the node that rules depend on, as plain values: its addresses and where NodePorts are
//! served. The node crate reads them over rtnetlink; render takes them from here, with no I/O of its own.

use super::Cidr;
use std::net::IpAddr;

/// One address configured on one of the node's links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeAddress {
    /// The link's interface index.
    pub ifindex: u32,
    /// The address.
    pub ip: IpAddr,
}

/// Where NodePorts are served, after kube-proxy's `--nodeport-addresses`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum NodePortAddresses {
    /// Every local address but loopback (a zero CIDR was given): matched with `fib daddr type local`.
    AllLocal,
    /// These addresses only.
    Only(Vec<IpAddr>),
    /// Not served (no address matched).
    #[default]
    None,
}

/// One entry of kube-proxy's `--nodeport-addresses` / `nodePortAddresses`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NodePortEntry {
    /// `primary`: the node's primary IP of each family (see [`primary_node_ips`]).
    Primary,
    /// `localhost`: 127.0.0.0/8 and ::1/128 (served through the relay, never with route_localnet).
    Localhost,
    /// `all`: every local address but loopback (0.0.0.0/0 and ::/0).
    All,
    /// A CIDR (a bare address is its host prefix).
    Cidr(Cidr),
}

/// `--nodeport-addresses` as written: keywords and CIDRs in any combination (kube-proxy 1.37), meaning the
/// union of what each selects. No entry means `primary`, the default of kube-proxy's nftables mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct NodePortSpec {
    entries: Vec<NodePortEntry>,
}

/// A `--nodeport-addresses` entry that is neither a keyword nor a CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodePortSpecError {
    /// Not a keyword, and no address either.
    #[error("{0:?} is neither a CIDR nor one of primary, localhost, all")]
    Unknown(String),
    /// It looks like a CIDR, but is not one.
    #[error(transparent)]
    Cidr(#[from] super::ParseError),
}

impl NodePortSpec {
    /// The entries of a list (the config file's `nodePortAddresses`); blank ones are skipped.
    pub fn from_items<'a>(
        items: impl IntoIterator<Item = &'a str>,
    ) -> Result<NodePortSpec, NodePortSpecError> {
        let entries = items
            .into_iter()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(parse_entry)
            .collect::<Result<_, _>>()?;
        Ok(NodePortSpec { entries })
    }

    /// Whether the node's primary IPs serve NodePorts (`primary` given, or nothing given).
    pub fn wants_primary(&self) -> bool {
        self.entries.is_empty() || self.entries.contains(&NodePortEntry::Primary)
    }

    /// The CIDRs the entries name, the keywords `all` and `localhost` as theirs (`primary` has none).
    pub fn cidrs(&self) -> Vec<Cidr> {
        let cidr = |s: &str| s.parse::<Cidr>().expect("a valid CIDR literal");
        let mut out = Vec::new();
        for e in &self.entries {
            match e {
                NodePortEntry::Primary => {}
                NodePortEntry::Localhost => out.extend([cidr("127.0.0.0/8"), cidr("::1/128")]),
                NodePortEntry::All => out.extend([cidr("0.0.0.0/0"), cidr("::/0")]),
                NodePortEntry::Cidr(c) => out.push(*c),
            }
        }
        out
    }
}

/// Keywords are matched as kube-proxy spells them (lower case); anything else must read as an address.
fn parse_entry(item: &str) -> Result<NodePortEntry, NodePortSpecError> {
    Ok(match item {
        "primary" => NodePortEntry::Primary,
        "localhost" => NodePortEntry::Localhost,
        "all" => NodePortEntry::All,
        // A word with no address characters is a misspelt keyword, not a bad address: say so.
        cidr if cidr.contains(['/', '.', ':']) => NodePortEntry::Cidr(cidr.parse()?),
        other => return Err(NodePortSpecError::Unknown(other.into())),
    })
}

impl std::str::FromStr for NodePortSpec {
    type Err = NodePortSpecError;
    /// A comma-separated list, as the flag takes it.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NodePortSpec::from_items(s.split(','))
    }
}

impl std::fmt::Display for NodePortSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.entries.is_empty() {
            return f.write_str("primary");
        }
        let words: Vec<String> = self
            .entries
            .iter()
            .map(|e| match e {
                NodePortEntry::Primary => "primary".into(),
                NodePortEntry::Localhost => "localhost".into(),
                NodePortEntry::All => "all".into(),
                NodePortEntry::Cidr(c) => c.to_string(),
            })
            .collect();
        f.write_str(&words.join(","))
    }
}

/// The node's primary IP of each family, as kube-proxy picks them: a specific `--bind-address` for its own
/// family, else the Node object's first address of the family (`node_object` in the order kube-proxy reads
/// status.addresses). Unspecified and loopback addresses name no node IP and are skipped. Empty: nothing is
/// known (no bind address, no Node object yet, or the manifest source).
pub fn primary_node_ips(bind_address: Option<IpAddr>, node_object: &[IpAddr]) -> Vec<IpAddr> {
    let usable = |ip: &&IpAddr| !ip.is_unspecified() && !ip.is_loopback();
    let bind = bind_address.as_ref().filter(usable);
    let mut out: Vec<IpAddr> = bind.into_iter().copied().collect();
    for ip in node_object.iter().filter(usable) {
        if !out.iter().any(|o| o.is_ipv4() == ip.is_ipv4()) {
            out.push(*ip);
        }
    }
    out.sort();
    out
}

/// The known primary IP of `ip`'s family, if any.
fn primary_of_family(primary: &[IpAddr], ip: &IpAddr) -> Option<IpAddr> {
    primary
        .iter()
        .copied()
        .find(|p| p.is_ipv4() == ip.is_ipv4())
}

/// Where NodePorts are served: the union of what the spec's entries select among the node's `addresses`.
/// `primary` selects, per family, the known primary IP (`primary`, from [`primary_node_ips`]; only when it
/// is one of the node's addresses, as kube-proxy matches it against the interfaces), else the addresses of
/// the links carrying a default route (`primary_links`): the fallback with the manifest source, or before
/// the Node object is known. A zero CIDR (`all`) means every local address. Loopback is never among
/// `addresses`: localhost NodePorts are the relay's.
pub fn resolve_nodeport_addresses(
    spec: &NodePortSpec,
    addresses: &[NodeAddress],
    primary: &[IpAddr],
    primary_links: &[u32],
) -> NodePortAddresses {
    let cidrs = spec.cidrs();
    if cidrs.iter().any(|c| c.prefix == 0) {
        return NodePortAddresses::AllLocal;
    }
    let is_primary = |a: &NodeAddress| match primary_of_family(primary, &a.ip) {
        Some(p) => p == a.ip,
        None => primary_links.contains(&a.ifindex),
    };
    let mut ips: Vec<IpAddr> = addresses
        .iter()
        .filter(|a| {
            (spec.wants_primary() && is_primary(a)) || cidrs.iter().any(|c| c.contains(&a.ip))
        })
        .map(|a| a.ip)
        .collect();
    ips.sort();
    ips.dedup();
    if ips.is_empty() {
        NodePortAddresses::None
    } else {
        NodePortAddresses::Only(ips)
    }
}

/// The node's IPs for kube-proxy's loadBalancerSourceRanges check (a range holding the node lets the
/// LoadBalancer IPs in as sources): per family the known primary IP, as kube-proxy's `nodeIP`; for a family
/// without one, every address of that family (what nftkube checked before the primary IP was known).
pub fn source_range_node_ips(addresses: &[NodeAddress], primary: &[IpAddr]) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = primary.to_vec();
    ips.extend(
        addresses
            .iter()
            .map(|a| a.ip)
            .filter(|ip| primary_of_family(primary, ip).is_none()),
    );
    ips.sort();
    ips.dedup();
    ips
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(ifindex: u32, ip: &str) -> NodeAddress {
        NodeAddress {
            ifindex,
            ip: ip.parse().unwrap(),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn only(ips: &[&str]) -> NodePortAddresses {
        NodePortAddresses::Only(ips.iter().map(|s| ip(s)).collect())
    }

    fn spec(s: &str) -> NodePortSpec {
        s.parse().unwrap()
    }

    /// Link 2 carries the default route and two addresses per family (the first of each is the Node
    /// object's); link 3 is a pod link.
    fn addrs() -> [NodeAddress; 5] {
        [
            a(2, "192.168.200.1"),
            a(2, "192.168.210.1"),
            a(2, "fd00:200::1"),
            a(2, "fd00:210::1"),
            a(3, "10.244.0.1"),
        ]
    }

    #[test]
    fn keywords_and_cidrs_parse_in_any_combination() {
        let s = spec(" primary, 10.0.0.0/8 ,localhost,all");
        assert!(s.wants_primary());
        assert_eq!(s.to_string(), "primary,10.0.0.0/8,localhost,all");
        assert_eq!(s.cidrs().len(), 5, "{:?}", s.cidrs());
        assert_eq!(spec(""), NodePortSpec::default());
        assert!(spec("").wants_primary(), "nothing given means primary");
        assert!(!spec("10.0.0.0/8").wants_primary());
        // A bare address is its host prefix; addresses read as the API server reads them.
        assert_eq!(
            spec("10.1.2.3").cidrs(),
            vec!["10.1.2.3/32".parse().unwrap()]
        );
        assert_eq!(
            spec("010.0.0.0/8").cidrs(),
            vec!["10.0.0.0/8".parse().unwrap()]
        );
        let items = NodePortSpec::from_items(["localhost", "", "fd00::/64"]).unwrap();
        assert_eq!(items.to_string(), "localhost,fd00::/64");
    }

    #[test]
    fn an_unknown_word_or_a_bad_cidr_is_an_error_naming_it() {
        let e = "primary,Primary".parse::<NodePortSpec>().unwrap_err();
        assert_eq!(e, NodePortSpecError::Unknown("Primary".into()));
        assert!(e.to_string().contains("\"Primary\""), "{e}");
        let e = "primray".parse::<NodePortSpec>().unwrap_err();
        assert!(e.to_string().contains("primray"), "{e}");
        let e = "10.0.0.0/33".parse::<NodePortSpec>().unwrap_err();
        assert!(matches!(e, NodePortSpecError::Cidr(_)), "{e:?}");
        assert!(e.to_string().contains("10.0.0.0/33"), "{e}");
    }

    #[test]
    fn the_primary_ip_is_the_bind_address_else_the_node_objects_first_of_each_family() {
        let node = [ip("192.168.200.1"), ip("192.168.210.1"), ip("fd00:200::1")];
        assert_eq!(
            primary_node_ips(None, &node),
            vec![ip("192.168.200.1"), ip("fd00:200::1")]
        );
        // A specific bind address replaces its own family's only.
        assert_eq!(
            primary_node_ips(Some(ip("192.168.210.1")), &node),
            vec![ip("192.168.210.1"), ip("fd00:200::1")]
        );
        // 0.0.0.0 and loopback name no node IP.
        assert_eq!(
            primary_node_ips(Some(ip("0.0.0.0")), &node),
            primary_node_ips(None, &node)
        );
        assert_eq!(
            primary_node_ips(Some(ip("127.0.0.1")), &[]),
            Vec::<IpAddr>::new()
        );
        assert_eq!(
            primary_node_ips(Some(ip("fd00:210::1")), &[]),
            vec![ip("fd00:210::1")]
        );
    }

    #[test]
    fn primary_serves_the_known_primary_ips_and_not_the_secondary_ones() {
        let primary = [ip("192.168.200.1"), ip("fd00:200::1")];
        assert_eq!(
            resolve_nodeport_addresses(&spec("primary"), &addrs(), &primary, &[2]),
            only(&["192.168.200.1", "fd00:200::1"])
        );
        assert_eq!(
            resolve_nodeport_addresses(&NodePortSpec::default(), &addrs(), &primary, &[2]),
            only(&["192.168.200.1", "fd00:200::1"])
        );
        // A family without a known primary IP falls back to the default-route links' addresses.
        assert_eq!(
            resolve_nodeport_addresses(&spec("primary"), &addrs(), &primary[..1], &[2]),
            only(&["192.168.200.1", "fd00:200::1", "fd00:210::1"])
        );
        // A primary IP the node does not hold serves nothing (kube-proxy matches it against interfaces).
        assert_eq!(
            resolve_nodeport_addresses(&spec("primary"), &addrs(), &[ip("192.168.99.9")], &[]),
            NodePortAddresses::None
        );
    }

    #[test]
    fn without_a_known_primary_ip_primary_is_the_default_route_links_addresses() {
        assert_eq!(
            resolve_nodeport_addresses(&NodePortSpec::default(), &addrs(), &[], &[2]),
            only(&[
                "192.168.200.1",
                "192.168.210.1",
                "fd00:200::1",
                "fd00:210::1"
            ])
        );
    }

    #[test]
    fn entries_resolve_to_their_union() {
        let primary = [ip("192.168.200.1")];
        assert_eq!(
            resolve_nodeport_addresses(&spec("primary,192.168.210.0/24"), &addrs(), &primary, &[]),
            only(&["192.168.200.1", "192.168.210.1"])
        );
        assert_eq!(
            resolve_nodeport_addresses(&spec("10.244.0.0/16,primary"), &addrs(), &primary, &[]),
            only(&["10.244.0.1", "192.168.200.1"])
        );
        // Without primary, CIDRs alone: not the primary IP.
        assert_eq!(
            resolve_nodeport_addresses(&spec("10.244.0.0/16"), &addrs(), &primary, &[2]),
            only(&["10.244.0.1"])
        );
        // localhost adds loopback, which is no node address here (the relay serves it).
        assert_eq!(
            resolve_nodeport_addresses(&spec("primary,localhost"), &addrs(), &primary, &[]),
            only(&["192.168.200.1"])
        );
        // all, or a zero CIDR, with anything: every local address.
        for s in [
            "all",
            "primary,all",
            "localhost,0.0.0.0/0",
            "::/0,10.0.0.0/8",
        ] {
            assert_eq!(
                resolve_nodeport_addresses(&spec(s), &addrs(), &primary, &[]),
                NodePortAddresses::AllLocal,
                "{s}"
            );
        }
        // Nothing matches: not served.
        assert_eq!(
            resolve_nodeport_addresses(&spec("172.16.0.0/12"), &addrs(), &primary, &[2]),
            NodePortAddresses::None
        );
    }

    #[test]
    fn the_source_range_check_uses_the_primary_ip_of_each_family_it_knows() {
        assert_eq!(
            source_range_node_ips(&addrs(), &[ip("192.168.200.1")]),
            vec![ip("192.168.200.1"), ip("fd00:200::1"), ip("fd00:210::1")]
        );
        assert_eq!(source_range_node_ips(&addrs(), &[]).len(), 5);
    }
}
