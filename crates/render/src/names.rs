//! Deterministic names for what we create in the kernel.

use nftkube_model::ServicePortName;

/// The table every nftkube object lives in (one per address family).
pub const TABLE: &str = "nftkube";

/// What the name of every table of `nftkube trace --live` starts with (`nftkube cleanup` removes them all;
/// with `--traces`, those of ended runs).
pub const TRACE_TABLE_PREFIX: &str = "nftkube-trace-";

/// Base chain: nat prerouting (dstnat), jumps to `services`.
pub(crate) const CHAIN_NAT_PREROUTING: &str = "nat-prerouting";
/// Base chain: nat output (dstnat), jumps to `services`.
pub(crate) const CHAIN_NAT_OUTPUT: &str = "nat-output";
/// Base chain: nat postrouting (srcnat), jumps to `masquerading`.
pub(crate) const CHAIN_NAT_POSTROUTING: &str = "nat-postrouting";
/// Base chain: filter forward, the checks after NAT.
pub(crate) const CHAIN_FILTER_FORWARD: &str = "filter-forward";
/// Base chain: filter output, the checks after NAT.
pub(crate) const CHAIN_FILTER_OUTPUT: &str = "filter-output";
/// The dispatch: frontends and NodePorts to their `lb*` chains.
pub(crate) const CHAIN_SERVICES: &str = "services";
/// Masquerades marked packets and hairpin connections.
pub(crate) const CHAIN_MASQUERADING: &str = "masquerading";
/// After NAT: rejects what still goes to a ClusterIP or to a frontend without endpoints.
pub(crate) const CHAIN_CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
/// TCP reset, ICMP port unreachable otherwise.
pub(crate) const CHAIN_REJECT: &str = "reject-chain";
/// kubelet's guard: the drop mark and martian localnet traffic.
pub(crate) const CHAIN_FIREWALL: &str = "firewall";

/// Every ClusterIP: whatever reaches one un-NATed is rejected.
pub const SET_CLUSTER_IPS: &str = "cluster-ips";
/// The dispatch's exceptions: `addr . proto . port : goto <chain>` for frontends whose chain is their own (more
/// than `SHARED_COUNTS` endpoints, or loadBalancerSourceRanges). Every other frontend is dispatched by
/// membership of one of the `*_DISPATCH` sets, which is data (see `DISPATCH_SETS`).
pub const MAP_SERVICE_IPS: &str = "service-ips";
/// ClusterIPs (shared counts, no affinity), the most frequent frontends: `addr . proto . port`, to `lb`.
pub const SET_LB_IPS: &str = "lb-ips";
/// External and LoadBalancer IPs (externalTrafficPolicy Cluster): to `lb-ext`.
pub(crate) const SET_LB_EXT_IPS: &str = "lb-ext-ips";
/// External and LoadBalancer IPs (externalTrafficPolicy Local): to `lb-etp`.
pub(crate) const SET_LB_ETP_IPS: &str = "lb-etp-ips";
/// ClusterIPs with ClientIP affinity: to `lb-aff`.
pub(crate) const SET_LB_AFF_IPS: &str = "lb-aff-ips";
/// External and LoadBalancer IPs with ClientIP affinity: to `lb-ext-aff`.
pub(crate) const SET_LB_EXT_AFF_IPS: &str = "lb-ext-aff-ips";
/// externalTrafficPolicy Local with ClientIP affinity: to `lb-etp-aff`.
pub(crate) const SET_LB_ETP_AFF_IPS: &str = "lb-etp-aff-ips";
/// Every frontend but those of `lb-ips`: one lookup keeps a packet that is no service's from trying each
/// of the rarer kinds.
pub(crate) const SET_OTHER_SERVICE_IPS: &str = "other-service-ips";
/// NodePorts (externalTrafficPolicy Cluster, no affinity): `proto . port`, to `lb-np`.
pub(crate) const SET_LB_NP_PORTS: &str = "lb-np-ports";
/// NodePorts, externalTrafficPolicy Local: to `lb-np-etp`.
pub(crate) const SET_LB_NP_ETP_PORTS: &str = "lb-np-etp-ports";
/// NodePorts with ClientIP affinity: to `lb-np-aff`.
pub(crate) const SET_LB_NP_AFF_PORTS: &str = "lb-np-aff-ports";
/// NodePorts, externalTrafficPolicy Local, with ClientIP affinity: to `lb-np-etp-aff`.
pub(crate) const SET_LB_NP_ETP_AFF_PORTS: &str = "lb-np-etp-aff-ports";
/// Every NodePort but those of `lb-np-ports`.
pub(crate) const SET_OTHER_SERVICE_NODEPORTS: &str = "other-service-nodeports";
/// The dispatch of the frontends other than `lb-ips`' (rarer kinds and the exceptions).
pub(crate) const CHAIN_SERVICES_OTHER: &str = "services-other";
/// The NodePort dispatch, on the addresses NodePorts are served on.
pub(crate) const CHAIN_NODEPORTS: &str = "nodeports";
/// The dispatch of the NodePorts other than `lb-np-ports`'.
pub(crate) const CHAIN_NODEPORTS_OTHER: &str = "nodeports-other";
/// Endpoint slots of frontends: `addr . proto . port . slot : endpoint addr . port`.
pub const MAP_SERVICE_ENDPOINTS: &str = "service-endpoints";
/// `endpoint . endpoint`: an endpoint reaching itself through its service is masqueraded.
pub(crate) const SET_HAIRPIN: &str = "hairpin-endpoints";
/// The addresses NodePorts are served on, when `--nodeport-addresses` names them.
pub(crate) const SET_NODEPORT_IPS: &str = "nodeport-ips";
/// ClientIP affinity: `saddr . daddr . proto . port : endpoint addr . port`, filled by the packet path.
pub const MAP_AFFINITY: &str = "affinity";
/// Frontends of services with ClientIP affinity: `addr . proto . port : goto affinity-<seconds>`.
pub const MAP_AFFINITY_SERVICES: &str = "affinity-services";
/// NodePorts of services with ClientIP affinity: `proto . port : goto affinity-<seconds>`.
pub const MAP_AFFINITY_NODEPORTS: &str = "affinity-nodeports";
/// The transport protocols of the frontends with ClientIP affinity: a new connection of another protocol
/// skips `affinity-record`'s two lookups.
pub(crate) const SET_AFFINITY_PROTOCOLS: &str = "affinity-protocols";
/// After DNAT: finds the affinity service a new connection went to, and records its endpoint.
pub(crate) const CHAIN_AFFINITY_RECORD: &str = "affinity-record";
/// The NodePort dispatch's exceptions: `proto . port : goto <chain>` (more than `SHARED_COUNTS` endpoints).
pub(crate) const MAP_SERVICE_NODEPORTS: &str = "service-nodeports";
/// The sets and verdict maps that send packets to a service's endpoints: a sync withdraws their elements
/// first and publishes them last, so no chunk of it leaves one pointing at a service half written. Every
/// verdict map is one (a unit test checks it on every skeleton).
pub const DISPATCH_SETS: [&str; 16] = [
    MAP_SERVICE_IPS,
    MAP_SERVICE_NODEPORTS,
    MAP_AFFINITY_SERVICES,
    MAP_AFFINITY_NODEPORTS,
    SET_LB_IPS,
    SET_LB_EXT_IPS,
    SET_LB_ETP_IPS,
    SET_LB_AFF_IPS,
    SET_LB_EXT_AFF_IPS,
    SET_LB_ETP_AFF_IPS,
    SET_OTHER_SERVICE_IPS,
    SET_LB_NP_PORTS,
    SET_LB_NP_ETP_PORTS,
    SET_LB_NP_AFF_PORTS,
    SET_LB_NP_ETP_AFF_PORTS,
    SET_OTHER_SERVICE_NODEPORTS,
];

/// Whether elements of `set` are dispatch (see `DISPATCH_SETS`).
pub fn is_dispatch_set(set: &str) -> bool {
    DISPATCH_SETS.contains(&set)
}
/// Endpoint slots of NodePorts: `proto . port . slot : endpoint addr . port`.
pub const MAP_NODEPORT_ENDPOINTS: &str = "nodeport-endpoints";
/// NodePorts of services without endpoints (`proto . port`): rejected on input.
pub(crate) const SET_NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
/// Base chain: filter input (the NodePort check, the guard, affinity records).
pub(crate) const CHAIN_FILTER_INPUT: &str = "filter-input";
/// On input: rejects NodePorts of services without endpoints.
pub(crate) const CHAIN_NODEPORTS_CHECK: &str = "nodeports-check";

/// Userspace mode: `addr . proto . port : relay port`, what `redirect to :` looks up.
pub(crate) const MAP_RELAY_PORTS: &str = "relay-ports";
/// Userspace mode: the relay's redirect targets (`proto . port`), which answer redirected traffic only.
pub(crate) const SET_RELAY_LISTENERS: &str = "relay-listeners";
/// Userspace mode: frontends (`addr . proto . port`) of service ports without endpoints, rejected in filter.
pub(crate) const SET_RELAY_NO_ENDPOINTS: &str = "relay-no-endpoints";

/// External and LoadBalancer frontends of services without endpoints (`addr . proto . port`): rejected in
/// filter. A plain set, so that a service losing its last endpoint adds no verdict element.
pub(crate) const SET_NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";

/// Frontends (`addr . proto . port`) whose service has endpoints, none of them on this node, under a Local
/// traffic policy: their `lb-*` chain drops what no local endpoint took.
pub(crate) const SET_NO_LOCAL_ENDPOINTS: &str = "no-local-endpoints";

/// The same for NodePorts (`proto . port`).
pub(crate) const SET_NO_LOCAL_NODEPORTS: &str = "no-local-endpoint-nodeports";

/// The shared choice of an endpoint by count (see `chains::Counts`): frontends, their local endpoints,
/// NodePorts, and their local endpoints.
pub(crate) const CHAIN_PICK: &str = "pick";
/// The choice among a frontend's node-local endpoints.
pub(crate) const CHAIN_PICK_LOCAL: &str = "pick-local";
/// The choice among a NodePort's endpoints.
pub(crate) const CHAIN_PICK_NODEPORT: &str = "pick-np";
/// The choice among a NodePort's node-local endpoints.
pub(crate) const CHAIN_PICK_NODEPORT_LOCAL: &str = "pick-np-local";

/// `pick…-over-<n>`: the frontends (NodePorts) with more than n endpoints, n = 8, 16, 24, that a `pick` chain
/// sends on to the chain of the next eight counts (see `chains::pick_chain_states`). One row per `pick`
/// chain: `pick`, `pick-local`, `pick-np`, `pick-np-local`.
pub(crate) const PICK_OVER_SETS: [[&str; 3]; 4] = [
    ["pick-over-8", "pick-over-16", "pick-over-24"],
    [
        "pick-local-over-8",
        "pick-local-over-16",
        "pick-local-over-24",
    ],
    ["pick-np-over-8", "pick-np-over-16", "pick-np-over-24"],
    [
        "pick-np-local-over-8",
        "pick-np-local-over-16",
        "pick-np-local-over-24",
    ],
];

/// `pick…-bit-<b>`: the frontends (NodePorts) whose endpoint count n has bit b (4, 2, 1) set in `(n - 1) % 8`,
/// its place within its `pick` chain's eight counts: the chain finds the rule of that count by these three
/// lookups, a binary search, and makes a single lookup in the endpoint map (see `chains::pick_chain_states`).
/// One row per `pick` chain, as `PICK_OVER_SETS`.
pub(crate) const PICK_BIT_SETS: [[&str; 3]; 4] = [
    ["pick-bit-4", "pick-bit-2", "pick-bit-1"],
    ["pick-local-bit-4", "pick-local-bit-2", "pick-local-bit-1"],
    ["pick-np-bit-4", "pick-np-bit-2", "pick-np-bit-1"],
    [
        "pick-np-local-bit-4",
        "pick-np-local-bit-2",
        "pick-np-local-bit-1",
    ],
];

/// A set that service pieces put elements in, as one byte: a piece exists per element (~650k at 50k
/// services), where a 16-byte `&str` cost ~10 MB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PieceSet(u8);

/// Every set a service piece may name; a `PieceSet` is an index into this list.
const PIECE_SETS: [&str; 52] = [
    SET_CLUSTER_IPS,
    MAP_SERVICE_IPS,
    MAP_SERVICE_ENDPOINTS,
    SET_HAIRPIN,
    MAP_SERVICE_NODEPORTS,
    MAP_NODEPORT_ENDPOINTS,
    SET_NO_ENDPOINT_NODEPORTS,
    SET_NO_ENDPOINT_SERVICES,
    SET_NO_LOCAL_ENDPOINTS,
    SET_NO_LOCAL_NODEPORTS,
    MAP_AFFINITY_SERVICES,
    MAP_AFFINITY_NODEPORTS,
    MAP_RELAY_PORTS,
    SET_RELAY_LISTENERS,
    SET_RELAY_NO_ENDPOINTS,
    SET_LB_IPS,
    SET_LB_EXT_IPS,
    SET_LB_ETP_IPS,
    SET_LB_AFF_IPS,
    SET_LB_EXT_AFF_IPS,
    SET_LB_ETP_AFF_IPS,
    SET_OTHER_SERVICE_IPS,
    SET_LB_NP_PORTS,
    SET_LB_NP_ETP_PORTS,
    SET_LB_NP_AFF_PORTS,
    SET_LB_NP_ETP_AFF_PORTS,
    SET_OTHER_SERVICE_NODEPORTS,
    PICK_OVER_SETS[0][0],
    PICK_OVER_SETS[0][1],
    PICK_OVER_SETS[0][2],
    PICK_OVER_SETS[1][0],
    PICK_OVER_SETS[1][1],
    PICK_OVER_SETS[1][2],
    PICK_OVER_SETS[2][0],
    PICK_OVER_SETS[2][1],
    PICK_OVER_SETS[2][2],
    PICK_OVER_SETS[3][0],
    PICK_OVER_SETS[3][1],
    PICK_OVER_SETS[3][2],
    PICK_BIT_SETS[0][0],
    PICK_BIT_SETS[0][1],
    PICK_BIT_SETS[0][2],
    PICK_BIT_SETS[1][0],
    PICK_BIT_SETS[1][1],
    PICK_BIT_SETS[1][2],
    PICK_BIT_SETS[2][0],
    PICK_BIT_SETS[2][1],
    PICK_BIT_SETS[2][2],
    PICK_BIT_SETS[3][0],
    PICK_BIT_SETS[3][1],
    PICK_BIT_SETS[3][2],
    SET_AFFINITY_PROTOCOLS,
];

impl PieceSet {
    /// The piece set of this name. Panics for a set pieces never use (a programming error caught by every test).
    pub fn named(name: &str) -> PieceSet {
        let at = PIECE_SETS
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("set {name} is not a piece set"));
        PieceSet(at as u8)
    }

    /// The set's name in the table.
    pub fn name(self) -> &'static str {
        PIECE_SETS[self.0 as usize]
    }

    /// Whether the set's keys are a NodePort's `proto . port` (else a frontend's `addr . proto . port`).
    pub(crate) fn is_nodeport_keyed(self) -> bool {
        [
            MAP_SERVICE_NODEPORTS,
            MAP_NODEPORT_ENDPOINTS,
            SET_NO_ENDPOINT_NODEPORTS,
            SET_NO_LOCAL_NODEPORTS,
            MAP_AFFINITY_NODEPORTS,
            SET_LB_NP_PORTS,
            SET_LB_NP_ETP_PORTS,
            SET_LB_NP_AFF_PORTS,
            SET_LB_NP_ETP_AFF_PORTS,
            SET_OTHER_SERVICE_NODEPORTS,
        ]
        .contains(&self.name())
            || PICK_OVER_SETS[2..]
                .iter()
                .chain(&PICK_BIT_SETS[2..])
                .flatten()
                .any(|s| *s == self.name())
    }

    /// Whether the set's keys end with an endpoint slot (4 bytes) after the frontend they belong to.
    pub fn has_slot_keys(self) -> bool {
        [MAP_SERVICE_ENDPOINTS, MAP_NODEPORT_ENDPOINTS].contains(&self.name())
    }
}

impl std::fmt::Display for PieceSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Prefix of the load-balancing chains (see `chains::lb_chain_state`).
pub(crate) const LB_CHAIN_PREFIX: &str = "lb-";

/// `affinity-<seconds>`: records the endpoint of a new connection for that long (one chain per timeout in
/// use, shared by every service with that timeout).
pub(crate) fn affinity_chain(seconds: u32) -> String {
    format!("affinity-{seconds}")
}

/// The longest identity a firewall chain's name shows as it is: every name the sources accept fits (63 for
/// the namespace and the Service, 15 for the port name), and the whole name stays far below the kernel's
/// 255 bytes.
const FIREWALL_ID_MAX: usize = 160;

/// `fw-<hash>-<namespace>/<name>/<protocol>/<port>-<family>`: the loadBalancerSourceRanges check of one
/// service port. The hash covers the identity and the chain's `content`, so a changed rule set is a new
/// chain (swapped in by the dispatch element, the old one deleted later) rather than an edit in place.
///
/// Bounded by construction whatever the input: an identity longer than `FIREWALL_ID_MAX` or with a byte
/// outside `[A-Za-z0-9._/-]` (neither passes the sources' checks) is shown cut and cleaned, followed by a
/// hash of all of it, so that two such identities still name two chains.
pub(crate) fn firewall_chain(spn: &ServicePortName, family: &str, content: &str) -> String {
    let id = format!(
        "{}/{}/{}/{}",
        spn.service.namespace, spn.service.name, spn.protocol, spn.port
    );
    let hash = short_hash(&format!("{id}\n{content}"));
    format!("fw-{hash}-{}-{family}", bounded_readable(&id))
}

/// `id` itself when it is short and plain; else its first bytes with anything unusual as '_', then '~' and
/// a hash of the whole.
fn bounded_readable(id: &str) -> String {
    let plain = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-');
    if id.len() <= FIREWALL_ID_MAX && id.bytes().all(plain) {
        return id.to_owned();
    }
    const KEPT: usize = FIREWALL_ID_MAX - 20;
    let cleaned: String = id
        .bytes()
        .take(KEPT)
        .map(|b| if plain(b) { b as char } else { '_' })
        .collect();
    format!(
        "{cleaned}~{}{}",
        short_hash(id),
        short_hash(&format!("~{id}"))
    )
}

/// 8 characters of base32 over FNV-1a 64: stable across versions and platforms.
fn short_hash(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    (0..8)
        .map(|i| ALPHABET[((h >> (i * 5)) & 31) as usize] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{skeleton, userspace, RenderConfig};
    use std::collections::BTreeSet;

    #[test]
    fn a_firewall_chain_name_is_bounded_whatever_the_service_is_called() {
        let spn = |ns: &str, name: &str| ServicePortName {
            service: nftkube_model::NamespacedName::new(ns, name),
            port: "http".into(),
            protocol: nftkube_model::Protocol::Tcp,
        };
        // The longest names the sources accept are shown whole.
        let longest = firewall_chain(&spn(&"n".repeat(63), &"s".repeat(63)), "ip6", "rules");
        assert!(longest.contains(&"s".repeat(63)), "{longest}");
        // Longer or stranger ones are cut and cleaned, and still tell two services apart.
        let a = firewall_chain(&spn("demo", &format!("{}a", "x".repeat(300))), "ip6", "r");
        let b = firewall_chain(&spn("demo", &format!("{}b", "x".repeat(300))), "ip6", "r");
        let odd = firewall_chain(&spn("demo", "we\"b}\n;é"), "ip", "r");
        for name in [&longest, &a, &b, &odd] {
            assert!(name.len() <= 200, "{} bytes: {name}", name.len());
        }
        assert_ne!(a, b);
        assert!(
            odd.bytes()
                .all(|c| c.is_ascii_graphic() && c != b'"' && c != b'}'),
            "{odd}"
        );
    }

    #[test]
    fn every_verdict_map_of_every_skeleton_is_a_dispatch_set() {
        let cfg = RenderConfig {
            nodeport_addresses: nftkube_model::NodePortAddresses::AllLocal,
            ..RenderConfig::default()
        };
        let tables = [skeleton(&cfg), userspace::skeleton()].concat();
        let verdict_maps: BTreeSet<&str> = tables
            .iter()
            .flat_map(|t| t.sets.values())
            .filter(|s| s.set.is_verdict_map())
            .map(|s| s.set.name.as_str())
            .collect();
        assert!(
            verdict_maps.iter().all(|m| is_dispatch_set(m)),
            "{verdict_maps:?}"
        );
        let skeleton_sets: BTreeSet<&str> = tables
            .iter()
            .flat_map(|t| t.sets.keys().map(|k| k.as_str()))
            .collect();
        for set in DISPATCH_SETS {
            assert!(skeleton_sets.contains(set), "{set} is in no skeleton");
        }
    }
}
