//! The anchors: upstream kube-proxy's rulesets for the same services and endpoints the bench gives nftkube,
//! in both of upstream's modes, generated in-process so the bench needs nothing outside the repository.
//!
//! For N ClusterIP services (TCP port 80, port name `http`), each with E endpoints on port 8080:
//! - nftables mode: the text transactions knftables pipes into `nft -f -`: a first full sync, a later
//!   full sync of the same state, and the partial sync after one endpoint is added to the last service;
//! - iptables mode: `iptables-restore --noflush --counters` input: a full sync, a full sync after that
//!   change (what upstream wrote on every change before it had partial syncs), the partial sync after it,
//!   and the one-time jumps from the built-in chains (upstream makes those with single `iptables` calls).
//!
//! Shapes and names follow a reading of upstream's layout (chain names carry SHA-256/base32 hash prefixes,
//! as upstream's do); no upstream code is copied. The addresses are the bench model's, all private and used
//! only inside throw-away network namespaces:
//! - ClusterIPs in 10.96.0.0/12: service i gets 10.96.0.0 + 1 + i;
//! - endpoints in 10.240.0.0/13: endpoint j of service i gets 10.240.0.0 + 1 + (si + j) mod (2^19 - 2), with a
//!   stride s = max(8, E + 1) (8i + j up to 7 endpoints); distinct within a service, and shared between services
//!   only where the plan overflows the /13 (e.g. 10 000 services × 100), which no rule shape depends on;
//! - cluster CIDR 10.240.0.0/12 (upstream's local-traffic detector; the bench's client is in 10.250.0.0/24).

use serde::ser::{Serialize, SerializeMap, Serializer};
use sha2::{Digest, Sha256};
use std::fmt::{self, Write as _};
use std::net::Ipv4Addr;
use std::path::Path;

/// Upstream nftables mode's first full sync.
pub(crate) const NFT_FULL: &str = "nft-full.nft";
/// Upstream nftables mode's later full sync of the same state.
const NFT_RESYNC: &str = "nft-resync.nft";
/// Upstream nftables mode's partial sync after one endpoint is added to the last service.
pub(crate) const NFT_PARTIAL: &str = "nft-inc.nft";
/// Upstream iptables mode's one-time jumps from the built-in chains, as iptables-restore input.
pub(crate) const IPT_JUMPS: &str = "ipt-jumps.restore";
/// The same jumps, one `table<TAB>chain<TAB>from<TAB>arguments` a line, for upstream's per-sync checks.
const IPT_JUMP_CHECKS: &str = "ipt-jumps.txt";
/// Upstream iptables mode's full sync.
pub(crate) const IPT_FULL: &str = "ipt-full.restore";
/// Upstream iptables mode's full sync after the endpoint change.
const IPT_FULL_AFTER_CHANGE: &str = "ipt-full-inc.restore";
/// Upstream iptables mode's partial sync after the endpoint change.
pub(crate) const IPT_PARTIAL: &str = "ipt-partial-inc.restore";
/// Counts, the first and last services' addresses, and each file's size.
const META: &str = "meta.json";

const CLUSTER_CIDR: &str = "10.240.0.0/12";
const SERVICE_CIDR: &str = "10.96.0.0/12";
const CLUSTER_IP_BASE: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 0);
const ENDPOINT_BASE: Ipv4Addr = Ipv4Addr::new(10, 240, 0, 0);
/// Endpoint addresses reserved per service (at least; more for services of more endpoints), so that one
/// service's endpoints never run into the next's while the plan fits the range.
const ENDPOINT_STRIDE: usize = 8;
/// Addresses in the endpoint range (a /13) and the ClusterIP range (a /12).
const ENDPOINT_ADDRESSES: usize = 1 << 19;
const CLUSTER_IP_ADDRESSES: usize = 1 << 20;
const PROTOCOL: &str = "tcp";
const PORT_NAME: &str = "http";
const SERVICE_PORT: u16 = 80;
const ENDPOINT_PORT: u16 = 8080;

/// The anchors' files, by name, in memory.
pub(crate) struct Anchors {
    services: usize,
    endpoints_per_service: usize,
    files: Vec<(&'static str, String)>,
}

/// The anchors for `services` services of `endpoints_per_service` endpoints each.
pub(crate) fn generate(services: usize, endpoints_per_service: usize) -> Anchors {
    check_address_plan(services, endpoints_per_service);
    let stride = ENDPOINT_STRIDE.max(endpoints_per_service + 1);
    let before: Vec<Service> = (0..services)
        .map(|i| Service::new(i, endpoints_per_service, stride))
        .collect();
    let after = with_endpoint_added_to_last(&before, stride);
    let changed = after.last().expect("anchors: at least one service");
    let partial = IptSync::Partial {
        changed: changed.index,
    };
    let mut files = vec![
        (NFT_FULL, nft_full_sync(&before, FullSync::First)),
        (NFT_RESYNC, nft_full_sync(&before, FullSync::Later)),
        (NFT_PARTIAL, nft_partial_sync(std::slice::from_ref(changed))),
        (IPT_FULL, ipt_sync(&before, IptSync::Full)),
        (IPT_FULL_AFTER_CHANGE, ipt_sync(&after, IptSync::Full)),
        (IPT_PARTIAL, ipt_sync(&after, partial)),
        (IPT_JUMPS, ipt_jumps_restore()),
        (IPT_JUMP_CHECKS, ipt_jump_checks()),
    ];
    let meta = meta_json(&before, endpoints_per_service, &files);
    files.push((META, meta));
    Anchors {
        services,
        endpoints_per_service,
        files,
    }
}

/// Panics unless every address the anchors need fits in its range.
fn check_address_plan(services: usize, endpoints_per_service: usize) {
    assert!(services > 0, "anchors: at least one service");
    assert!(
        (1..ENDPOINT_ADDRESSES - 2).contains(&endpoints_per_service),
        "anchors: 1 to {} endpoints per service (the change adds one)",
        ENDPOINT_ADDRESSES - 3
    );
    assert!(
        services < CLUSTER_IP_ADDRESSES - 2,
        "anchors: {services} services do not fit the address plan"
    );
}

/// The incremental change the partial syncs carry: one endpoint added to the last service.
fn with_endpoint_added_to_last(services: &[Service], stride: usize) -> Vec<Service> {
    let mut after = services.to_vec();
    if let Some(last) = after.last_mut() {
        *last = Service::new(last.index, last.endpoints.len() + 1, stride);
    }
    after
}

impl Anchors {
    /// Writes every file into `dir`, creating it if needed.
    pub(crate) fn write_to(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        for (name, text) in &self.files {
            std::fs::write(dir.join(name), text)?;
        }
        Ok(())
    }

    fn text(&self, name: &str) -> &str {
        self.files
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| text.as_str())
            .unwrap_or_else(|| panic!("anchors: no file {name}"))
    }
}

/// A ClusterIP service: its place in the address plan and its endpoints' addresses.
#[derive(Clone)]
struct Service {
    index: usize,
    endpoints: Vec<Ipv4Addr>,
}

impl Service {
    fn new(index: usize, endpoint_count: usize, stride: usize) -> Service {
        // The range's first and last addresses are left out, as a subnet's would be.
        let usable = ENDPOINT_ADDRESSES - 2;
        let endpoints = (0..endpoint_count)
            .map(|j| offset(ENDPOINT_BASE, 1 + (stride * index + j) % usable))
            .collect();
        Service { index, endpoints }
    }

    /// A hundred services per namespace.
    fn namespace(&self) -> String {
        format!("ns{}", self.index / 100)
    }

    fn name(&self) -> String {
        format!("svc{}", self.index)
    }

    fn cluster_ip(&self) -> Ipv4Addr {
        offset(CLUSTER_IP_BASE, 1 + self.index)
    }

    /// Upstream's ServicePortName as a string, `namespace/name:port`: iptables mode's comments and hashes.
    fn port_name(&self) -> String {
        format!("{}/{}:{PORT_NAME}", self.namespace(), self.name())
    }

    /// nftables mode's readable chain-name stem, `namespace/name/protocol/port`.
    fn nft_name(&self) -> String {
        format!(
            "{}/{}/{PROTOCOL}/{PORT_NAME}",
            self.namespace(),
            self.name()
        )
    }

    /// nftables mode names chains `KIND-HASH-readable`: the hash keeps names unique when the readable part
    /// is cut, and the readable part is there for people reading `nft list ruleset`.
    fn nft_service_chain(&self) -> String {
        let name = self.nft_name();
        format!("service-{}-{name}", hash_prefix(&name, 8))
    }

    fn nft_endpoint_chain(&self, endpoint: Ipv4Addr) -> String {
        let name = format!("{}__{endpoint}/{ENDPOINT_PORT}", self.nft_name());
        format!("endpoint-{}-{name}", hash_prefix(&name, 8))
    }

    /// iptables mode has only 28 characters per chain name: a prefix and 16 characters of hash.
    fn ipt_service_chain(&self) -> String {
        let hashed = format!("{}{PROTOCOL}", self.port_name());
        format!("KUBE-SVC-{}", hash_prefix(&hashed, 16))
    }

    fn ipt_endpoint_chain(&self, endpoint: Ipv4Addr) -> String {
        let hashed = format!("{}{PROTOCOL}{endpoint}:{ENDPOINT_PORT}", self.port_name());
        format!("KUBE-SEP-{}", hash_prefix(&hashed, 16))
    }
}

fn offset(base: Ipv4Addr, by: usize) -> Ipv4Addr {
    let by = u32::try_from(by).expect("anchors: address offset beyond IPv4");
    Ipv4Addr::from(u32::from(base) + by)
}

/// The first `chars` characters of the RFC 4648 base32 encoding of `text`'s SHA-256, upstream's hash for
/// chain names (the encoding's padding lies far beyond the characters it keeps).
fn hash_prefix(text: &str, chars: usize) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let digest: [u8; 32] = Sha256::digest(text.as_bytes()).into();
    (0..chars)
        .map(|k| char::from(ALPHABET[five_bits_at(&digest, 5 * k)]))
        .collect()
}

/// The five bits of `bytes` starting `bit` bits in, most significant first.
fn five_bits_at(bytes: &[u8], bit: usize) -> usize {
    let byte = bit / 8;
    let next = bytes.get(byte + 1).copied().unwrap_or(0);
    let window = u16::from_be_bytes([bytes[byte], next]);
    usize::from((window >> (11 - bit % 8)) & 0x1f)
}

/// Text built a line at a time, every line ending in a newline, as `nft -f` and iptables-restore read it.
#[derive(Default)]
struct Lines(String);

impl Lines {
    fn push(&mut self, line: impl fmt::Display) {
        writeln!(self.0, "{line}").expect("formatting into a String cannot fail");
    }

    fn append(&mut self, other: Lines) {
        self.0.push_str(&other.0);
    }
}

// ---------------------------------------------------------------------------------------------------------
// nftables mode
// ---------------------------------------------------------------------------------------------------------

/// Upstream's nftables mode keeps everything in one table of its own.
const TABLE: &str = "ip kube-proxy";

/// A chain hooked into the kernel's packet path.
struct BaseChain {
    name: &'static str,
    kind: &'static str,
    hook: &'static str,
    /// Numeric, as upstream writes it: dstnat is -100 and srcnat 100; the filter chains sit just before
    /// DNAT (-110), and `filter-output-post-dnat` just after it (-90), to see the translated address.
    priority: i32,
}

const BASE_CHAINS: [BaseChain; 8] = [
    base_chain("filter-prerouting", "filter", "prerouting", -110),
    base_chain("filter-input", "filter", "input", -110),
    base_chain("filter-forward", "filter", "forward", -110),
    base_chain("filter-output", "filter", "output", -110),
    base_chain("filter-output-post-dnat", "filter", "output", -90),
    base_chain("nat-prerouting", "nat", "prerouting", -100),
    base_chain("nat-output", "nat", "output", -100),
    base_chain("nat-postrouting", "nat", "postrouting", 100),
];

const fn base_chain(
    name: &'static str,
    kind: &'static str,
    hook: &'static str,
    priority: i32,
) -> BaseChain {
    BaseChain {
        name,
        kind,
        hook,
        priority,
    }
}

/// A jump from a base chain into one of upstream's regular chains.
struct NftJump {
    to: &'static str,
    from: &'static str,
    /// The filter checks only judge the first packet of a connection.
    new_connections_only: bool,
}

const NFT_JUMPS: [NftJump; 11] = [
    nft_jump("nodeport-endpoints-check", "filter-input", true),
    nft_jump("service-endpoints-check", "filter-input", true),
    nft_jump("service-endpoints-check", "filter-forward", true),
    nft_jump("service-endpoints-check", "filter-output", true),
    nft_jump("firewall-check", "filter-prerouting", true),
    nft_jump("firewall-check", "filter-output", true),
    nft_jump("services", "nat-output", false),
    nft_jump("services", "nat-prerouting", false),
    nft_jump("masquerading", "nat-postrouting", false),
    nft_jump("cluster-ips-check", "filter-forward", true),
    nft_jump("cluster-ips-check", "filter-output-post-dnat", true),
];

const fn nft_jump(to: &'static str, from: &'static str, new_connections_only: bool) -> NftJump {
    NftJump {
        to,
        from,
        new_connections_only,
    }
}

/// The mark upstream sets on packets to masquerade: 1 << 14, written the way upstream formats it (`%#08x`).
const NFT_MASQ_MARK: &str = "0x004000";

/// Which full sync: upstream's first one also clears base chains left by an older kube-proxy.
#[derive(Clone, Copy, PartialEq)]
enum FullSync {
    First,
    Later,
}

/// A full sync: upstream rewrites its whole table in one transaction, every chain added and flushed
/// (`add` is a no-op when the object exists, `flush` empties it) and refilled.
fn nft_full_sync(services: &[Service], sync: FullSync) -> String {
    let mut out = Lines::default();
    nft_table_and_base_chains(&mut out, sync);
    nft_regular_chains(&mut out);
    nft_masquerading(&mut out);
    nft_cluster_ips_check(&mut out);
    nft_no_endpoint_maps(&mut out);
    nft_firewall(&mut out);
    nft_service_maps(&mut out);
    nft_flush_sets_and_maps(&mut out);
    for service in services {
        nft_service(&mut out, service, MapElements::Add);
    }
    out.0
}

/// A partial sync: the map elements are already in place, only the changed services' chains are rewritten.
fn nft_partial_sync(changed: &[Service]) -> String {
    let mut out = Lines::default();
    for service in changed {
        nft_service(&mut out, service, MapElements::Keep);
    }
    out.0
}

fn nft_table_and_base_chains(out: &mut Lines, sync: FullSync) {
    out.push(format_args!(
        "add table {TABLE} {{ comment \"rules for kube-proxy\" ; }}"
    ));
    if sync == FullSync::First {
        // A base chain's hook or priority cannot be changed in place: deleting them first replaces
        // whatever an older version created.
        for chain in &BASE_CHAINS {
            out.push(format_args!("add chain {TABLE} {}", chain.name));
            out.push(format_args!("delete chain {TABLE} {}", chain.name));
        }
    }
    for chain in &BASE_CHAINS {
        out.push(format_args!(
            "add chain {TABLE} {} {{ type {} hook {} priority {} ; }}",
            chain.name, chain.kind, chain.hook, chain.priority
        ));
        out.push(format_args!("flush chain {TABLE} {}", chain.name));
    }
}

/// Creates `name` empty, whether or not it existed: upstream's idiom for a chain it is about to refill.
fn nft_fresh_chain(out: &mut Lines, name: &str) {
    out.push(format_args!("add chain {TABLE} {name}"));
    out.push(format_args!("flush chain {TABLE} {name}"));
}

/// The regular chains the base chains jump to, each created where it is first jumped to, then the helper
/// the service chains jump to.
fn nft_regular_chains(out: &mut Lines) {
    let mut created: Vec<&str> = Vec::new();
    for jump in &NFT_JUMPS {
        if !created.contains(&jump.to) {
            nft_fresh_chain(out, jump.to);
            created.push(jump.to);
        }
        let only_new = if jump.new_connections_only {
            "ct state new "
        } else {
            ""
        };
        out.push(format_args!(
            "add rule {TABLE} {} {only_new}jump {}",
            jump.from, jump.to
        ));
    }
    nft_fresh_chain(out, "mark-for-masquerade");
}

/// Packets are marked on the way in and masqueraded on the way out, the mark cleared so that it does not
/// leak into the packet's later life.
fn nft_masquerading(out: &mut Lines) {
    out.push(format_args!(
        "add rule {TABLE} mark-for-masquerade mark set mark or {NFT_MASQ_MARK}"
    ));
    out.push(format_args!(
        "add rule {TABLE} masquerading mark and {NFT_MASQ_MARK} == 0 return"
    ));
    out.push(format_args!(
        "add rule {TABLE} masquerading mark set mark xor {NFT_MASQ_MARK}"
    ));
    out.push(format_args!(
        "add rule {TABLE} masquerading masquerade fully-random"
    ));
}

/// Traffic that DNAT left on a ClusterIP went to a port no service has, and traffic to the rest of the
/// service range to an address no service has: reject the first, drop the second.
fn nft_cluster_ips_check(out: &mut Lines) {
    out.push(format_args!(
        "add set {TABLE} cluster-ips {{ type ipv4_addr ; comment \"Active ClusterIPs\" ; }}"
    ));
    out.push(format_args!(
        "add rule {TABLE} cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
    ));
    out.push(format_args!(
        "add rule {TABLE} cluster-ips-check ip daddr {{ {SERVICE_CIDR} }} drop comment \"Drop traffic to unallocated ClusterIPs\""
    ));
    // With nodePortAddresses unset (NodePorts on every address), upstream creates this set and deletes it
    // again in the same transaction, so that one left by an earlier configuration goes away.
    out.push(format_args!(
        "add set {TABLE} nodeport-ips {{ type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ; }}"
    ));
    out.push(format_args!("delete set {TABLE} nodeport-ips"));
}

/// Services without endpoints are rejected through verdict maps, checked before DNAT.
fn nft_no_endpoint_maps(out: &mut Lines) {
    out.push(format_args!(
        "add map {TABLE} no-endpoint-services {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to services with no endpoints\" ; }}"
    ));
    out.push(format_args!(
        "add map {TABLE} no-endpoint-nodeports {{ type inet_proto . inet_service : verdict ; comment \"vmap to drop or reject packets to service nodeports with no endpoints\" ; }}"
    ));
    out.push(format_args!(
        "add chain {TABLE} reject-chain {{ comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }}"
    ));
    out.push(format_args!("flush chain {TABLE} reject-chain"));
    out.push(format_args!("add rule {TABLE} reject-chain reject"));
    out.push(format_args!(
        "add rule {TABLE} service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services"
    ));
    out.push(format_args!(
        "add rule {TABLE} nodeport-endpoints-check ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @no-endpoint-nodeports"
    ));
}

/// LoadBalancer source ranges: a verdict map, empty here (ClusterIP services only), but always checked.
fn nft_firewall(out: &mut Lines) {
    out.push(format_args!(
        "add map {TABLE} firewall-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"destinations that are subject to LoadBalancerSourceRanges\" ; }}"
    ));
    out.push(format_args!(
        "add rule {TABLE} firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips"
    ));
}

/// The dispatch: one verdict-map lookup on (address, protocol, port) sends a packet to its service's
/// chain, however many services there are; NodePorts are looked up only on the node's own addresses.
fn nft_service_maps(out: &mut Lines) {
    out.push(format_args!(
        "add map {TABLE} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }}"
    ));
    out.push(format_args!(
        "add map {TABLE} service-nodeports {{ type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }}"
    ));
    out.push(format_args!(
        "add rule {TABLE} services ip daddr . meta l4proto . th dport vmap @service-ips"
    ));
    out.push(format_args!(
        "add rule {TABLE} services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"
    ));
}

/// A full sync refills every set and map from scratch.
fn nft_flush_sets_and_maps(out: &mut Lines) {
    out.push(format_args!("flush set {TABLE} cluster-ips"));
    for map in [
        "service-ips",
        "firewall-ips",
        "no-endpoint-services",
        "no-endpoint-nodeports",
        "service-nodeports",
    ] {
        out.push(format_args!("flush map {TABLE} {map}"));
    }
}

/// Whether a service's sync (re)adds its map elements: a full sync flushed them, a partial one did not.
#[derive(Clone, Copy, PartialEq)]
enum MapElements {
    Add,
    Keep,
}

/// One service: its chain, reached from `service-ips`, picks an endpoint chain at random, which DNATs.
fn nft_service(out: &mut Lines, service: &Service, elements: MapElements) {
    let service_chain = service.nft_service_chain();
    let endpoint_chains: Vec<String> = service
        .endpoints
        .iter()
        .map(|&endpoint| service.nft_endpoint_chain(endpoint))
        .collect();
    // Chains first: the map element and the vmap below refer to them.
    for chain in &endpoint_chains {
        nft_fresh_chain(out, chain);
    }
    nft_fresh_chain(out, &service_chain);
    let ip = service.cluster_ip();
    if elements == MapElements::Add {
        out.push(format_args!("add element {TABLE} cluster-ips {{ {ip} }}"));
        out.push(format_args!(
            "add element {TABLE} service-ips {{ {ip} . {PROTOCOL} . {SERVICE_PORT} : goto {service_chain} }}"
        ));
    }
    // Off-cluster clients reaching the ClusterIP are masqueraded (the cluster-CIDR local-traffic detector).
    out.push(format_args!(
        "add rule {TABLE} {service_chain} ip daddr {ip} {PROTOCOL} dport {SERVICE_PORT} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade"
    ));
    out.push(format_args!(
        "add rule {TABLE} {service_chain} {}",
        nft_endpoint_choice(&endpoint_chains)
    ));
    for (chain, endpoint) in endpoint_chains.iter().zip(&service.endpoints) {
        nft_endpoint_rules(out, chain, *endpoint);
    }
}

/// Upstream's load balancing: a random number modulo the endpoint count, looked up in an anonymous
/// verdict map from each number to an endpoint's chain.
fn nft_endpoint_choice(endpoint_chains: &[String]) -> String {
    let elements: Vec<String> = endpoint_chains
        .iter()
        .enumerate()
        .map(|(k, chain)| format!("{k} : goto {chain}"))
        .collect();
    format!(
        "numgen random mod {} vmap {{ {} }}",
        endpoint_chains.len(),
        elements.join(" , ")
    )
}

/// An endpoint's chain: hairpin traffic (the endpoint reaching itself through the service) is
/// masqueraded so the reply comes back through the node, then DNAT to the endpoint.
fn nft_endpoint_rules(out: &mut Lines, chain: &str, endpoint: Ipv4Addr) {
    out.push(format_args!(
        "add rule {TABLE} {chain} ip saddr {endpoint} jump mark-for-masquerade"
    ));
    out.push(format_args!(
        "add rule {TABLE} {chain} meta l4proto {PROTOCOL} dnat to {endpoint}:{ENDPOINT_PORT}"
    ));
}

// ---------------------------------------------------------------------------------------------------------
// iptables mode
// ---------------------------------------------------------------------------------------------------------

/// The same mark as nftables mode's, as iptables prints it.
const IPT_MASQ_MARK: &str = "0x4000";

/// Above this many endpoints in all, upstream's iptables mode leaves out the per-endpoint comments, which
/// cost restore time at scale.
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// A jump from a built-in chain into one of upstream's chains.
struct IptJump {
    table: &'static str,
    to: &'static str,
    from: &'static str,
    comment: &'static str,
    /// Matches before the comment: most filter jumps only judge a connection's first packet.
    matches: &'static str,
}

const NEW_ONLY: &str = "-m conntrack --ctstate NEW";
const PORTALS: &str = "kubernetes service portals";
const EXTERNAL: &str = "kubernetes externally-visible service portals";
const FIREWALL: &str = "kubernetes load balancer firewall";

const BUILT_IN_JUMPS: [IptJump; 14] = [
    ipt_jump(
        "filter",
        "KUBE-EXTERNAL-SERVICES",
        "INPUT",
        EXTERNAL,
        NEW_ONLY,
    ),
    ipt_jump(
        "filter",
        "KUBE-EXTERNAL-SERVICES",
        "FORWARD",
        EXTERNAL,
        NEW_ONLY,
    ),
    ipt_jump(
        "filter",
        "KUBE-NODEPORTS",
        "INPUT",
        "kubernetes health check service ports",
        "",
    ),
    ipt_jump("filter", "KUBE-SERVICES", "FORWARD", PORTALS, NEW_ONLY),
    ipt_jump("filter", "KUBE-SERVICES", "OUTPUT", PORTALS, NEW_ONLY),
    ipt_jump(
        "filter",
        "KUBE-FORWARD",
        "FORWARD",
        "kubernetes forwarding rules",
        "",
    ),
    ipt_jump("filter", "KUBE-PROXY-FIREWALL", "INPUT", FIREWALL, NEW_ONLY),
    ipt_jump(
        "filter",
        "KUBE-PROXY-FIREWALL",
        "OUTPUT",
        FIREWALL,
        NEW_ONLY,
    ),
    ipt_jump(
        "filter",
        "KUBE-PROXY-FIREWALL",
        "FORWARD",
        FIREWALL,
        NEW_ONLY,
    ),
    ipt_jump("nat", "KUBE-SERVICES", "OUTPUT", PORTALS, ""),
    ipt_jump("nat", "KUBE-SERVICES", "PREROUTING", PORTALS, ""),
    ipt_jump(
        "nat",
        "KUBE-POSTROUTING",
        "POSTROUTING",
        "kubernetes postrouting rules",
        "",
    ),
    // The kubelet-style localnet firewall that comes with localhost NodePorts: no comment.
    ipt_jump("filter", "KUBE-FIREWALL", "INPUT", "", ""),
    ipt_jump("filter", "KUBE-FIREWALL", "OUTPUT", "", ""),
];

const fn ipt_jump(
    table: &'static str,
    to: &'static str,
    from: &'static str,
    comment: &'static str,
    matches: &'static str,
) -> IptJump {
    IptJump {
        table,
        to,
        from,
        comment,
        matches,
    }
}

/// A jump's rule arguments after the chain: matches, comment, target.
fn ipt_jump_arguments(jump: &IptJump) -> String {
    let mut arguments = String::new();
    if !jump.matches.is_empty() {
        arguments.push_str(jump.matches);
        arguments.push(' ');
    }
    if !jump.comment.is_empty() {
        arguments.push_str(&format!("-m comment --comment \"{}\" ", jump.comment));
    }
    arguments.push_str(&format!("-j {}", jump.to));
    arguments
}

/// The jumps as one iptables-restore input: each table declares the chains it jumps to, then inserts the
/// jumps at the top of the built-in chains, where upstream puts them.
fn ipt_jumps_restore() -> String {
    let mut out = Lines::default();
    for table in ["filter", "nat"] {
        let jumps: Vec<&IptJump> = BUILT_IN_JUMPS.iter().filter(|j| j.table == table).collect();
        out.push(format_args!("*{table}"));
        let mut declared: Vec<&str> = Vec::new();
        for jump in &jumps {
            if !declared.contains(&jump.to) {
                out.push(format_args!(":{} - [0:0]", jump.to));
                declared.push(jump.to);
            }
        }
        for jump in &jumps {
            out.push(format_args!(
                "-I {} {}",
                jump.from,
                ipt_jump_arguments(jump)
            ));
        }
        out.push("COMMIT");
    }
    out.0
}

/// Upstream checks every jump on every sync (`iptables -C`): one tab-separated line per check.
fn ipt_jump_checks() -> String {
    let mut out = Lines::default();
    for jump in &BUILT_IN_JUMPS {
        out.push(format_args!(
            "{}\t{}\t{}\t{}",
            jump.table,
            jump.to,
            jump.from,
            ipt_jump_arguments(jump)
        ));
    }
    out.0
}

/// Which services' own chains a sync writes; both write every service's KUBE-SERVICES rule.
#[derive(Clone, Copy)]
enum IptSync {
    Full,
    /// Upstream's partial sync: only the changed service's KUBE-SVC and KUBE-SEP chains; chains it leaves
    /// out of the input survive thanks to `--noflush`.
    Partial {
        changed: usize,
    },
}

impl IptSync {
    fn writes_chains_of(self, service: &Service) -> bool {
        match self {
            IptSync::Full => true,
            IptSync::Partial { changed } => service.index == changed,
        }
    }
}

/// One iptables-restore input: the filter table, then the nat table.
fn ipt_sync(services: &[Service], sync: IptSync) -> String {
    let mut out = Lines::default();
    ipt_filter_table(&mut out);
    ipt_nat_table(&mut out, services, sync);
    out.0
}

/// The filter table holds no per-service rules when every service has endpoints, but upstream rewrites
/// its chains on every sync all the same.
fn ipt_filter_table(out: &mut Lines) {
    out.push("*filter");
    for chain in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
        "KUBE-FIREWALL",
    ] {
        out.push(format_args!(":{chain} - [0:0]"));
    }
    // Localhost NodePorts (on by default for IPv4) route 127.0.0.0/8: keep off-node traffic away from it.
    out.push("-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP");
    out.push("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP");
    out.push(format_args!(
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {IPT_MASQ_MARK}/{IPT_MASQ_MARK} -j ACCEPT"
    ));
    out.push("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT");
    out.push("COMMIT");
}

/// The nat table: iptables-restore wants every chain declared before the first rule, so declarations and
/// rules are gathered apart and written one after the other.
fn ipt_nat_table(out: &mut Lines, services: &[Service], sync: IptSync) {
    let mut chains = Lines::default();
    let mut rules = Lines::default();
    for chain in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
    ] {
        chains.push(format_args!(":{chain} - [0:0]"));
    }
    ipt_masquerading(&mut rules);
    let total_endpoints: usize = services.iter().map(|s| s.endpoints.len()).sum();
    let comments = if total_endpoints > LARGE_CLUSTER_ENDPOINTS {
        EndpointComments::Off
    } else {
        EndpointComments::On
    };
    for service in services {
        ipt_service_dispatch(&mut rules, service);
        if sync.writes_chains_of(service) {
            ipt_service_chains(&mut chains, &mut rules, service, comments);
        }
    }
    // After every ClusterIP rule: packets to the node's own addresses that matched none are NodePort traffic.
    rules.push("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS");
    out.push("*nat");
    out.append(chains);
    out.append(rules);
    out.push("COMMIT");
}

/// As in nftables mode: mark on the way in, masquerade (and clear the mark) on the way out.
fn ipt_masquerading(rules: &mut Lines) {
    rules.push(format_args!(
        "-A KUBE-POSTROUTING -m mark ! --mark {IPT_MASQ_MARK}/{IPT_MASQ_MARK} -j RETURN"
    ));
    rules.push(format_args!(
        "-A KUBE-POSTROUTING -j MARK --xor-mark {IPT_MASQ_MARK}"
    ));
    rules.push("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully");
    rules.push(format_args!(
        "-A KUBE-MARK-MASQ -j MARK --or-mark {IPT_MASQ_MARK}"
    ));
}

/// iptables mode has no maps: KUBE-SERVICES tests the services one rule after another, which is why its
/// cost grows with the number of services.
fn ipt_service_dispatch(rules: &mut Lines, service: &Service) {
    rules.push(format_args!(
        "-A KUBE-SERVICES -m comment --comment \"{} cluster IP\" -m {PROTOCOL} -p {PROTOCOL} -d {} --dport {SERVICE_PORT} -j {}",
        service.port_name(),
        service.cluster_ip(),
        service.ipt_service_chain()
    ));
}

/// Whether rules carry per-endpoint comments (left out in large clusters).
#[derive(Clone, Copy, PartialEq)]
enum EndpointComments {
    On,
    Off,
}

/// A service's KUBE-SVC chain (masquerade off-cluster clients, then pick an endpoint) and its endpoints'
/// KUBE-SEP chains.
fn ipt_service_chains(
    chains: &mut Lines,
    rules: &mut Lines,
    service: &Service,
    comments: EndpointComments,
) {
    let service_chain = service.ipt_service_chain();
    let port_name = service.port_name();
    rules.push(format_args!(
        "-A {service_chain} -m comment --comment \"{port_name} cluster IP\" -m {PROTOCOL} -p {PROTOCOL} -d {} --dport {SERVICE_PORT} ! -s {CLUSTER_CIDR} -j KUBE-MARK-MASQ",
        service.cluster_ip()
    ));
    chains.push(format_args!(":{service_chain} - [0:0]"));
    let count = service.endpoints.len();
    for (k, &endpoint) in service.endpoints.iter().enumerate() {
        let mut rule = format!("-A {service_chain}");
        if comments == EndpointComments::On {
            rule.push_str(&format!(
                " -m comment --comment \"{port_name} -> {endpoint}:{ENDPOINT_PORT}\""
            ));
        }
        // Endpoint k of n is taken with probability 1/(n-k) among those left, so each gets 1/n;
        // the last one takes whatever is left, unconditionally.
        if k + 1 < count {
            rule.push_str(&format!(
                " -m statistic --mode random --probability {:.10}",
                1.0 / (count - k) as f64
            ));
        }
        rules.push(format_args!(
            "{rule} -j {}",
            service.ipt_endpoint_chain(endpoint)
        ));
    }
    for &endpoint in &service.endpoints {
        ipt_endpoint_chain(chains, rules, service, endpoint, comments);
    }
}

/// An endpoint's KUBE-SEP chain: masquerade hairpin traffic, then DNAT.
fn ipt_endpoint_chain(
    chains: &mut Lines,
    rules: &mut Lines,
    service: &Service,
    endpoint: Ipv4Addr,
    comments: EndpointComments,
) {
    let chain = service.ipt_endpoint_chain(endpoint);
    chains.push(format_args!(":{chain} - [0:0]"));
    let mut head = format!("-A {chain}");
    if comments == EndpointComments::On {
        // Upstream's comment here is the bare port name, unquoted (it has no spaces).
        head.push_str(&format!(" -m comment --comment {}", service.port_name()));
    }
    rules.push(format_args!("{head} -s {endpoint} -j KUBE-MARK-MASQ"));
    rules.push(format_args!(
        "{head} -m {PROTOCOL} -p {PROTOCOL} -j DNAT --to-destination {endpoint}:{ENDPOINT_PORT}"
    ));
}

// ---------------------------------------------------------------------------------------------------------
// meta.json
// ---------------------------------------------------------------------------------------------------------

#[derive(serde::Serialize)]
struct Meta<'a> {
    services: usize,
    endpoints_per_service: usize,
    first: ServiceMeta,
    last: ServiceMeta,
    cluster_cidr: &'static str,
    service_cidr: &'static str,
    files: FileSizes<'a>,
}

#[derive(serde::Serialize)]
struct ServiceMeta {
    cluster_ip: Ipv4Addr,
    port: u16,
    endpoints: Vec<(Ipv4Addr, u16)>,
}

impl From<&Service> for ServiceMeta {
    fn from(service: &Service) -> ServiceMeta {
        ServiceMeta {
            cluster_ip: service.cluster_ip(),
            port: SERVICE_PORT,
            endpoints: service
                .endpoints
                .iter()
                .map(|&ip| (ip, ENDPOINT_PORT))
                .collect(),
        }
    }
}

#[derive(serde::Serialize)]
struct FileSize {
    bytes: usize,
    lines: usize,
}

/// Each file's size, in the files' own order (a JSON object, but not a sorted one).
struct FileSizes<'a>(&'a [(&'static str, String)]);

impl Serialize for FileSizes<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, text) in self.0 {
            let size = FileSize {
                bytes: text.len(),
                lines: text.matches('\n').count(),
            };
            map.serialize_entry(name, &size)?;
        }
        map.end()
    }
}

/// The description of the anchors, indented by one space a level and without a final newline.
fn meta_json(
    services: &[Service],
    endpoints_per_service: usize,
    files: &[(&'static str, String)],
) -> String {
    let (first, last) = match services {
        [first, .., last] => (first, last),
        [only] => (only, only),
        [] => panic!("anchors: no services"),
    };
    let meta = Meta {
        services: services.len(),
        endpoints_per_service,
        first: first.into(),
        last: last.into(),
        cluster_cidr: CLUSTER_CIDR,
        service_cidr: SERVICE_CIDR,
        files: FileSizes(files),
    };
    let mut json = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b" ");
    let mut serializer = serde_json::Serializer::with_formatter(&mut json, formatter);
    meta.serialize(&mut serializer)
        .expect("anchors: meta.json serializes");
    String::from_utf8(json).expect("anchors: meta.json is UTF-8")
}

// ---------------------------------------------------------------------------------------------------------
// Shape check
// ---------------------------------------------------------------------------------------------------------

/// How many of each thing a ruleset file holds.
struct Shape {
    service_chains: usize,
    endpoint_chains: usize,
    /// Rules or map elements that send a ClusterIP's packets to its service chain.
    dispatches: usize,
}

/// One name of each hashed kind, for service 0 and its first endpoint, worked out apart from this code
/// (`printf %s ns0/svc0/tcp/http | sha256sum | xxd -r -p | base32`, and so on): they pin the hash and its
/// encoding, which the counts cannot see.
const PINNED_NAMES: [(&str, &str); 4] = [
    (
        NFT_FULL,
        "\nadd chain ip kube-proxy service-STU6VVPB-ns0/svc0/tcp/http\n",
    ),
    (
        NFT_FULL,
        "\nadd chain ip kube-proxy endpoint-E7DFDMK2-ns0/svc0/tcp/http__10.240.0.1/8080\n",
    ),
    (IPT_FULL, "\n:KUBE-SVC-K7ZVFMM3TUXRXRZR - [0:0]\n"),
    (IPT_FULL, "\n:KUBE-SEP-X47TASSCJW66TG5D - [0:0]\n"),
];

impl Anchors {
    /// Counts upstream's shapes in every ruleset against the service and endpoint counts, and looks for the
    /// pinned names, so that an edit breaking the generator fails the bench loudly instead of timing some
    /// other ruleset. Cheap next to what the bench then does with the files.
    pub(crate) fn assert_shape(&self) {
        let (n, e) = (self.services, self.endpoints_per_service);
        let before = shape(n, n * e, n);
        let after = shape(n, n * e + 1, n);
        self.assert_nft_shape(NFT_FULL, &before);
        self.assert_nft_shape(NFT_RESYNC, &before);
        self.assert_nft_shape(NFT_PARTIAL, &shape(1, e + 1, 0));
        self.assert_ipt_shape(IPT_FULL, &before);
        self.assert_ipt_shape(IPT_FULL_AFTER_CHANGE, &after);
        self.assert_ipt_shape(IPT_PARTIAL, &shape(1, e + 1, n));
        let jumps = count_lines(self.text(IPT_JUMPS), "-I ", "");
        expect_count(IPT_JUMPS, "jumps", jumps, BUILT_IN_JUMPS.len());
        for (file, name) in PINNED_NAMES {
            assert!(
                self.text(file).contains(name),
                "anchors: {file} lacks {:?}: the chain-name hash changed",
                name.trim()
            );
        }
    }

    /// Service chains, endpoint chains (each named once in the numgen vmap and DNATing once), and the
    /// `service-ips` elements.
    fn assert_nft_shape(&self, file: &str, wanted: &Shape) {
        let text = self.text(file);
        let service_chain = format!("add chain {TABLE} service-");
        let readable_end = format!("/{PROTOCOL}/{PORT_NAME}");
        let found = [
            (
                "service chains",
                count_lines(text, &service_chain, &readable_end),
            ),
            (
                "endpoint chains",
                count_lines(text, &format!("add chain {TABLE} endpoint-"), ""),
            ),
            ("vmap elements", text.matches(" : goto endpoint-").count()),
            ("DNAT rules", text.matches(" dnat to ").count()),
            (
                "service-ips elements",
                count_lines(text, &format!("add element {TABLE} service-ips "), ""),
            ),
        ];
        let endpoints = wanted.endpoint_chains;
        let wanted = [
            wanted.service_chains,
            endpoints,
            endpoints,
            endpoints,
            wanted.dispatches,
        ];
        for ((what, found), wanted) in found.into_iter().zip(wanted) {
            expect_count(file, what, found, wanted);
        }
    }

    /// KUBE-SVC and KUBE-SEP chains, the DNAT rules, the random picks (every endpoint but each service's
    /// last), and the KUBE-SERVICES rules (one a service, and the NodePort rule).
    fn assert_ipt_shape(&self, file: &str, wanted: &Shape) {
        let text = self.text(file);
        let found = [
            ("KUBE-SVC chains", count_lines(text, ":KUBE-SVC-", "")),
            ("KUBE-SEP chains", count_lines(text, ":KUBE-SEP-", "")),
            ("DNAT rules", text.matches(" -j DNAT ").count()),
            ("random picks", text.matches(" --probability ").count()),
            (
                "KUBE-SERVICES rules",
                count_lines(text, "-A KUBE-SERVICES ", ""),
            ),
        ];
        let endpoints = wanted.endpoint_chains;
        let wanted = [
            wanted.service_chains,
            endpoints,
            endpoints,
            endpoints - wanted.service_chains,
            wanted.dispatches + 1,
        ];
        for ((what, found), wanted) in found.into_iter().zip(wanted) {
            expect_count(file, what, found, wanted);
        }
    }
}

fn shape(service_chains: usize, endpoint_chains: usize, dispatches: usize) -> Shape {
    Shape {
        service_chains,
        endpoint_chains,
        dispatches,
    }
}

/// Lines that start with `start` and end with `end`.
fn count_lines(text: &str, start: &str, end: &str) -> usize {
    text.lines()
        .filter(|line| line.starts_with(start) && line.ends_with(end))
        .count()
}

fn expect_count(file: &str, what: &str, found: usize, wanted: usize) {
    assert_eq!(
        found, wanted,
        "anchors: {file} has {found} {what}, not {wanted}"
    );
}
