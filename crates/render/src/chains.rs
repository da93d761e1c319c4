//! The shared `lb-*` chains (masquerade marking and the uniform choice of an endpoint slot) and the
//! per-service firewall chains of loadBalancerSourceRanges.

use super::common::*;
use super::names::*;
use super::RenderConfig;
use nftkube_model::DetectLocal;
use nftkube_model::{Cidr, IpFamily, ServicePort};
use nftkube_nft::build::{ip_bytes, Field, RuleBuilder};
use nftkube_nft::ir::*;

/// Which frontends an `lb-*` chain serves: they differ in masquerading and in the key of their endpoints.
/// With ClientIP affinity (`lb-...aff`), each choice is preceded by a lookup of the endpoint the client had
/// (see `RuleBuilder::affinity_hit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LbKind {
    /// `lb`: ClusterIPs. Masqueraded when from outside the cluster CIDR (never without one, as kube-proxy).
    /// internalTrafficPolicy Local without a local endpoint: dropped (`no-local-endpoints`).
    Cluster,
    /// `lb-ext`: external and LoadBalancer IPs (externalTrafficPolicy Cluster). Always masqueraded, pods'
    /// traffic too, as kube-proxy does: the endpoint may be on another node, and its reply must come back
    /// through this one.
    External,
    /// `lb-np`: NodePorts, keyed by protocol and port alone. Always masqueraded (externalTrafficPolicy
    /// Cluster).
    NodePort,
    /// `lb-etp`: external and LoadBalancer IPs of an externalTrafficPolicy Local service: traffic from pods
    /// and from the node itself goes to every endpoint (short-circuit), outside traffic only to the
    /// endpoints on this node, keeping its source address; none → dropped.
    LocalExternal,
    /// `lb-np-etp`: the same for the NodePort of such a service.
    LocalNodePort,
}

impl LbKind {
    /// Every kind, in the order the dispatch tries their sets (most frequent first).
    pub(crate) const ALL: [LbKind; 5] = [
        LbKind::Cluster,
        LbKind::External,
        LbKind::LocalExternal,
        LbKind::NodePort,
        LbKind::LocalNodePort,
    ];

    pub(crate) fn is_node_port(self) -> bool {
        matches!(self, LbKind::NodePort | LbKind::LocalNodePort)
    }

    fn is_local(self) -> bool {
        matches!(self, LbKind::LocalExternal | LbKind::LocalNodePort)
    }
}

/// How an `lb-*` chain finds the endpoint count of the frontend it serves.
///
/// An endpoint count is data, not structure: a frontend with n ≤ `SHARED_COUNTS` endpoints keeps them in
/// slots of its endpoint map (`shared_slots`), which the shared `pick` chains draw from and, failing that,
/// search by count (a lookup that misses ends its rule and the next is tried); a frontend with more keeps
/// them in region n (slots `region(n) .. region(n) + n`) for its own chain. So a service going from n to m
/// endpoints changes only elements of its own: no verdict element (which would make the kernel re-validate
/// the whole table, O(services)) and no chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Counts {
    /// Up to `SHARED_COUNTS` endpoints (and as many local ones): the shared `pick` chains find the count.
    Shared,
    /// More: a chain of the frontend's own count (`lb-…-<n>`, `lb-…-<local>-<n>`), shared by every frontend
    /// with those counts. A change of such a count rewrites the frontend's dispatch element.
    Own {
        /// Endpoints in all.
        all: u32,
        /// Of them, on this node (externalTrafficPolicy Local chains only).
        local: u32,
    },
}

impl Counts {
    /// The chain for a frontend with `all` endpoints, `local` of them on this node.
    pub fn of(all: usize, local: usize) -> Counts {
        if all as u32 <= SHARED_COUNTS && local as u32 <= SHARED_COUNTS {
            Counts::Shared
        } else {
            Counts::Own {
                all: all as u32,
                local: local as u32,
            }
        }
    }
}

/// The most endpoints (and local endpoints) a frontend has for the shared `pick` chains to serve it.
pub const SHARED_COUNTS: u32 = 32;

/// The most endpoints a frontend uses (the region of a count holds 2^16 slots, and bit 31 marks the local
/// regions); kube-proxy has no such limit, but no Service has 32 767 ready endpoints on one node's view.
pub const MAX_ENDPOINTS: usize = (1 << 15) - 1;

/// Bit 31 of a slot: a region of a frontend's node-local endpoints (externalTrafficPolicy Local).
pub const LOCAL_REGIONS: u32 = 1 << 31;

/// The first slot of the region of frontends with `count` endpoints (`local`: node-local endpoints).
pub fn region(count: u32, local: bool) -> u32 {
    let base = if local { LOCAL_REGIONS } else { 0 };
    base | (count << 16)
}

/// The draws the `pick` chains make before they search for the count: `(modulus, first slot)` in region 0,
/// one per class of counts: 2 to 8 endpoints draw among slots 0–7, 9 to 16 among 40–55, 17 to 32 among
/// 8–39. A frontend with n shared endpoints (2 ≤ n ≤ `SHARED_COUNTS`) fills the first n·⌊m/n⌋ slots of the
/// draw of the smallest modulus m ≥ n, endpoint k at slots k, k + n, k + 2n, …: a draw that lands on a filled
/// slot finds each endpoint with probability exactly 1/n, one that lands beyond misses (the lookup fails,
/// the next rule runs). The classes' slots do not overlap, so no draw sees part of another class's frontend.
/// Each draw is made twice; what misses them all goes on to the search, whose rule for count n draws `mod n`
/// among the same slots. So most new connections make two to four endpoint-map lookups in all, against up
/// to seven through the search alone.
///
/// Copies are kept to eight slots or fewer: above eight endpoints a class is as wide as its largest count,
/// so every frontend fills exactly its n slots and hits a draw with probability n/m ≥ ½. A single draw of
/// 32 for 9 to 32 would hit as often only with two or three copies of every endpoint, and a million
/// endpoints (100 000 services × 10) then cost 452 MiB and 12.0 s to a first sync from the API, against
/// 290–293 MiB and 6–8 s with these classes (docs/performance.md "Draws before the search").
pub(crate) const DRAWS: [(u32, u32); 3] = [
    (PICK_GROUP, 0),
    (2 * PICK_GROUP, PICK_GROUP + SHARED_COUNTS),
    (SHARED_COUNTS, PICK_GROUP),
];

/// How often each draw is tried (each a new random number) before the search.
pub(crate) const DRAW_ROUNDS: usize = 2;

/// Where the slots of a frontend with `n` shared endpoints begin, and how many it fills: the first n·⌊m/n⌋
/// of the draw of the smallest modulus m ≥ n (see `DRAWS`); one endpoint keeps region 1's slot, which the
/// first rule of `pick` looks up alone.
pub(crate) fn shared_slots(n: u32, local: bool) -> (u32, u32) {
    if n <= 1 {
        return (region(1, local), 1);
    }
    let (modulus, first) = DRAWS
        .iter()
        .find(|(modulus, _)| n <= *modulus)
        .expect("shared counts fit the largest draw");
    (region(0, local) + first, n * (modulus / n))
}

/// The modulus the endpoint maps are declared with (`typeof ... numgen random mod SLOT_SPACE`). nft only
/// reads the declaration to type the slot (a 32-bit integer); the slots themselves go up to `u32::MAX`.
pub const SLOT_SPACE: u32 = 1 << 17;

/// The set whose members the dispatch sends to the shared chain of `kind` (`lb`, `lb-ext`, …, with or without
/// affinity): a frontend enters and leaves it as data, so adding or removing a service never makes the kernel
/// re-validate the table.
pub(crate) fn dispatch_set(kind: LbKind, affinity: bool) -> &'static str {
    match (kind, affinity) {
        (LbKind::Cluster, false) => SET_LB_IPS,
        (LbKind::External, false) => SET_LB_EXT_IPS,
        (LbKind::LocalExternal, false) => SET_LB_ETP_IPS,
        (LbKind::Cluster, true) => SET_LB_AFF_IPS,
        (LbKind::External, true) => SET_LB_EXT_AFF_IPS,
        (LbKind::LocalExternal, true) => SET_LB_ETP_AFF_IPS,
        (LbKind::NodePort, false) => SET_LB_NP_PORTS,
        (LbKind::LocalNodePort, false) => SET_LB_NP_ETP_PORTS,
        (LbKind::NodePort, true) => SET_LB_NP_AFF_PORTS,
        (LbKind::LocalNodePort, true) => SET_LB_NP_ETP_AFF_PORTS,
    }
}

/// The name of the chain of `kind` with these counts.
pub(crate) fn lb_name(kind: LbKind, counts: Counts, affinity: bool) -> String {
    let base = match kind {
        LbKind::Cluster => "",
        LbKind::External => "ext",
        LbKind::NodePort => "np",
        LbKind::LocalExternal => "etp",
        LbKind::LocalNodePort => "np-etp",
    };
    let mut parts: Vec<String> = Vec::new();
    if !base.is_empty() {
        parts.push(base.into());
    }
    if affinity {
        parts.push("aff".into());
    }
    match counts {
        Counts::Shared => {}
        Counts::Own { all, local } if kind.is_local() => parts.push(format!("{local}-{all}")),
        Counts::Own { all, .. } => parts.push(all.to_string()),
    }
    if parts.is_empty() {
        "lb".into()
    } else {
        format!("{LB_CHAIN_PREFIX}{}", parts.join("-"))
    }
}

/// The endpoint map and key fields of a kind's frontends.
fn endpoint_key(kind: LbKind, f: IpFamily) -> (Vec<Field>, &'static str) {
    if kind.is_node_port() {
        (vec![Field::L4Proto, Field::ThDport], MAP_NODEPORT_ENDPOINTS)
    } else {
        (
            vec![daddr(f), Field::L4Proto, Field::ThDport],
            MAP_SERVICE_ENDPOINTS,
        )
    }
}

/// `pick`, `pick-local`, `pick-np`, `pick-np-local`: one rule per shared count (see `Counts`).
pub(crate) fn pick_chain_name(node_port: bool, local: bool) -> &'static str {
    match (node_port, local) {
        (false, false) => CHAIN_PICK,
        (false, true) => CHAIN_PICK_LOCAL,
        (true, false) => CHAIN_PICK_NODEPORT,
        (true, true) => CHAIN_PICK_NODEPORT_LOCAL,
    }
}

/// Counts one `pick` chain tries before it sends frontends with more endpoints on to the next chain.
pub const PICK_GROUP: u32 = 8;

/// The `pick` chain of the counts `first..=last` of a variant: `pick` for the first group of eight, else
/// `pick-<first>-<last>` (`pick-9-16`, and within a group the halves its search goes to: `pick-5-8`, `pick-3-4`).
fn pick_range_chain(node_port: bool, local: bool, first: u32, last: u32) -> String {
    let base = pick_chain_name(node_port, local);
    match (first, last) {
        (1, 8) => base.into(),
        _ => format!("{base}-{first}-{last}"),
    }
}

/// The set of frontends with more than `(group + 1) * PICK_GROUP` endpoints, for a variant.
pub(crate) fn pick_over_set(node_port: bool, local: bool, group: usize) -> &'static str {
    PICK_OVER_SETS[usize::from(node_port) * 2 + usize::from(local)][group]
}

/// The set of frontends whose count n has `bit` (4, 2 or 1) set in `(n - 1) % PICK_GROUP`, for a variant.
pub(crate) fn pick_bit_set(node_port: bool, local: bool, bit: u32) -> &'static str {
    let column = match bit {
        4 => 0,
        2 => 1,
        1 => 2,
        _ => unreachable!("pick bits are 4, 2 and 1"),
    };
    PICK_BIT_SETS[usize::from(node_port) * 2 + usize::from(local)][column]
}

/// The shared `pick` chains of the skeleton, for one variant (`pick`, `pick-local`, `pick-np`,
/// `pick-np-local`): for each count n ≤ `SHARED_COUNTS`, the uniform choice among the frontend's slots.
///
/// `pick` first looks up the slot of a one-endpoint frontend, then makes the draws of `DRAWS`: one lookup
/// each, which lands on one of the frontend's endpoints or misses. Only what missed them all searches for
/// its count: each group of eight counts (`pick`, `pick-9-16`, …) first sends the frontends with more
/// endpoints (its `-over-<n>` set) to the next group, then finds the count within its eight by a binary
/// search on the `-bit-4`, `-bit-2` and `-bit-1` sets, ending in the count's rule, `mod n` over the
/// frontend's first n slots. The search walks at most 3 + 3 set lookups and one endpoint-map lookup,
/// whatever the count; docs/performance.md measures it against the draws.
pub fn pick_chain_states(f: IpFamily, node_port: bool, local: bool) -> Vec<ChainState> {
    let groups = SHARED_COUNTS / PICK_GROUP;
    let mut chains = Vec::new();
    for group in 0..groups {
        let first = group * PICK_GROUP + 1;
        let over = (group + 1 < groups).then(|| {
            let next = pick_range_chain(
                node_port,
                local,
                first + PICK_GROUP,
                first + 2 * PICK_GROUP - 1,
            );
            (pick_over_set(node_port, local, group as usize), next)
        });
        pick_search(f, node_port, local, first, PICK_GROUP, over, &mut chains);
    }
    let pick = pick_chain_name(node_port, local);
    let entry = chains
        .iter_mut()
        .find(|c| c.chain.name == pick)
        .expect("the search's first chain");
    entry.rules.splice(0..0, draw_rules(f, node_port, local));
    chains
}

/// The rules `pick` starts with: the slot of a one-endpoint frontend, then each draw of `DRAWS`, twice.
fn draw_rules(f: IpFamily, node_port: bool, local: bool) -> Vec<Rule> {
    let (key, map) = endpoint_key(pick_kind(node_port), f);
    let family = nft_family(f);
    let draw = |modulus: u32, first: u32| {
        RuleBuilder::new()
            .dnat_map_offset(&key, modulus, first, map, family)
            .build()
    };
    let mut rules = vec![draw(1, region(1, local))];
    for _ in 0..DRAW_ROUNDS {
        for (modulus, first) in DRAWS {
            rules.push(draw(modulus, region(0, local) + first));
        }
    }
    rules
}

fn pick_kind(node_port: bool) -> LbKind {
    if node_port {
        LbKind::NodePort
    } else {
        LbKind::Cluster
    }
}

/// The chain of the counts `first..first + width` (width 8, 4 or 2), and the chains of the upper halves its
/// search goes to: `… @<bit set> goto <upper half>` for each half wider than one count, then the rule of
/// count `first + 1` behind its `-bit-1` membership, then the rule of count `first`.
fn pick_search(
    f: IpFamily,
    node_port: bool,
    local: bool,
    first: u32,
    width: u32,
    over: Option<(&'static str, String)>,
    chains: &mut Vec<ChainState>,
) {
    let (key, map) = endpoint_key(pick_kind(node_port), f);
    let family = nft_family(f);
    let guard = |set: &str| RuleBuilder::new().in_set(&key, set, false);
    let count_rule = |start: RuleBuilder, n: u32| {
        start
            .dnat_map_offset(&key, n, shared_slots(n, local).0, map, family)
            .build()
    };
    let mut rules = Vec::new();
    if let Some((set, next)) = over {
        rules.push(guard(set).verdict(Verdict::Goto(next.into())).build());
    }
    let mut half = width / 2;
    while half > 1 {
        let upper = first + half;
        rules.push(
            guard(pick_bit_set(node_port, local, half))
                .verdict(Verdict::Goto(
                    pick_range_chain(node_port, local, upper, upper + half - 1).into(),
                ))
                .build(),
        );
        pick_search(f, node_port, local, upper, half, None, chains);
        half /= 2;
    }
    rules.push(count_rule(
        guard(pick_bit_set(node_port, local, 1)),
        first + 1,
    ));
    rules.push(count_rule(RuleBuilder::new(), first));
    chains.push(ChainState {
        chain: Chain::regular(&pick_range_chain(
            node_port,
            local,
            first,
            first + width - 1,
        )),
        rules,
    });
}

/// The choice of an endpoint after `start`: a jump to the shared `pick` chain, or with an own count the
/// rule of that count (None: no endpoint to choose from).
fn pick(
    start: RuleBuilder,
    kind: LbKind,
    counts: Counts,
    local: bool,
    f: IpFamily,
) -> Option<RuleBuilder> {
    let (key, map) = endpoint_key(kind, f);
    match counts {
        Counts::Shared => {
            let chain = pick_chain_name(kind.is_node_port(), local);
            Some(start.verdict(Verdict::Jump(chain.into())))
        }
        Counts::Own { all, local: l } => {
            let n = if local { l } else { all };
            (n > 0).then(|| start.dnat_map_offset(&key, n, region(n, local), map, nft_family(f)))
        }
    }
}

/// `… @no-local-endpoints drop`: a frontend whose endpoints are all on other nodes (the packet reaches this
/// rule only when no local endpoint was chosen). A frontend without any endpoint is not in the set: its
/// packet leaves NAT untouched and is rejected in filter.
fn no_local_endpoint_drop(kind: LbKind, f: IpFamily, comment: &str) -> Rule {
    let (key, _) = endpoint_key(kind, f);
    let set = if kind.is_node_port() {
        SET_NO_LOCAL_NODEPORTS
    } else {
        SET_NO_LOCAL_ENDPOINTS
    };
    RuleBuilder::new()
        .in_set(&key, set, false)
        .verdict(Verdict::Drop)
        .comment(comment)
        .build()
}

/// An `lb-*` chain: masquerade marking, then the uniform choice of an endpoint.
pub fn lb_chain_state(
    family: Family,
    kind: LbKind,
    counts: Counts,
    affinity: bool,
    cfg: &RenderConfig,
) -> ChainState {
    let f = ip_family(family);
    // Each choice, preceded (with affinity) by the same match and the lookup of the client's endpoint.
    let choose = |start: RuleBuilder, local: bool, comment: &str| -> Vec<Rule> {
        let mut rules = Vec::new();
        let Some(chosen) = pick(start.clone(), kind, counts, local, f) else {
            return rules;
        };
        if affinity {
            rules.push(
                start
                    .affinity_hit(family, MAP_AFFINITY)
                    .comment(format!("{comment}: the endpoint this client had"))
                    .build(),
            );
        }
        rules.push(chosen.comment(comment).build());
        rules
    };
    let rules = if kind.is_local() {
        local_policy_rules(f, kind, cfg, &choose)
    } else {
        let mut rules = masquerade_marking(f, kind, cfg);
        rules.extend(choose(RuleBuilder::new(), false, "an endpoint, by count"));
        if kind == LbKind::Cluster {
            rules.push(no_local_endpoint_drop(
                kind,
                f,
                "internalTrafficPolicy Local: no local endpoint",
            ));
        }
        rules
    };
    ChainState {
        chain: Chain::regular(&lb_name(kind, counts, affinity)),
        rules,
    }
}

/// The masquerade mark of ClusterIP, external and NodePort (externalTrafficPolicy Cluster) traffic: external
/// and NodePort traffic always; ClusterIP traffic unless from a pod (never without a detector, as kube-proxy).
fn masquerade_marking(f: IpFamily, kind: LbKind, cfg: &RenderConfig) -> Vec<Rule> {
    let not_pod = local_traffic(f, cfg, true);
    if cfg.masquerade_all || kind != LbKind::Cluster {
        vec![RuleBuilder::new().mark_or(cfg.masquerade_bit).build()]
    } else if let Some(not_pod) = not_pod {
        vec![not_pod
            .mark_or(cfg.masquerade_bit)
            .comment("not from a pod")
            .build()]
    } else {
        Vec::new()
    }
}

type Choose<'a> = dyn Fn(RuleBuilder, bool, &str) -> Vec<Rule> + 'a;

/// externalTrafficPolicy Local: pods reach every endpoint, keeping their address; so does the node itself,
/// masqueraded; outside traffic only the local endpoints, keeping its source address (none: dropped).
/// masquerade-all changes none of this: kube-proxy's masquerade-all rule matches the ClusterIP only.
fn local_policy_rules(
    f: IpFamily,
    kind: LbKind,
    cfg: &RenderConfig,
    choose: &Choose<'_>,
) -> Vec<Rule> {
    let mut rules = Vec::new();
    if let Some(pod) = local_traffic(f, cfg, false) {
        rules.extend(choose(pod, false, "from a pod: every endpoint"));
    }
    let node = RuleBuilder::new()
        .saddr_is_local()
        .mark_or(cfg.masquerade_bit);
    rules.extend(choose(node, false, "from the node: every endpoint"));
    rules.extend(choose(
        RuleBuilder::new(),
        true,
        "from outside: local endpoints, source kept",
    ));
    rules.push(no_local_endpoint_drop(
        kind,
        f,
        "from outside: no local endpoint",
    ));
    rules
}

/// `affinity-<seconds>`: records, after DNAT, the endpoint a new connection to a service with that affinity
/// timeout went to (every new connection: a hit refreshes the entry, as kube-proxy's `recent --set` does).
pub fn affinity_chain_state(family: Family, seconds: u32) -> ChainState {
    ChainState {
        chain: Chain::regular(&affinity_chain(seconds)),
        rules: vec![RuleBuilder::new()
            .transport_protocol()
            .affinity_record(family, MAP_AFFINITY, seconds as u64 * 1000)
            .build()],
    }
}

/// The start of a rule matching traffic from this node's pods (`negate`: not from them), per the configured
/// detector; None when it cannot tell in this family (no cluster CIDR of the family given).
pub(super) fn local_traffic(f: IpFamily, cfg: &RenderConfig, negate: bool) -> Option<RuleBuilder> {
    match &cfg.local_detector {
        DetectLocal::ClusterCidr | DetectLocal::NodeCidr => {
            let cidr = cfg.cluster_cidrs.iter().find(|c| c.family() == f)?;
            Some(RuleBuilder::new().prefix(saddr(f), &cidr.addr, cidr.prefix, negate))
        }
        DetectLocal::InterfaceNamePrefix(p) => Some(RuleBuilder::new().iifname(p, true, negate)),
        DetectLocal::BridgeInterface(b) => Some(RuleBuilder::new().iifname(b, false, negate)),
    }
}

/// `fw-<id>`: sources in the service's loadBalancerSourceRanges `pass` (go on to its endpoints; in userspace
/// mode, return to the redirect), others are dropped. When a range contains one of the node's addresses, the
/// LoadBalancer IPs themselves are allowed as sources too (kube-proxy's rule for load balancers that hairpin
/// through the node).
pub(super) fn firewall_chain_state(
    svc: &ServicePort,
    f: IpFamily,
    ranges: &[&Cidr],
    pass: Verdict,
    cfg: &RenderConfig,
) -> ChainState {
    let family_name = if f == IpFamily::V4 { "ip" } else { "ip6" };
    let mut rules: Vec<Rule> = ranges
        .iter()
        .map(|c| {
            RuleBuilder::new()
                .prefix(saddr(f), &c.addr, c.prefix, false)
                .verdict(pass.clone())
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
                    .verdict(pass.clone())
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
        chain: Chain::regular(&firewall_chain(
            &svc.name,
            family_name,
            &format!("{rules:?}"),
        )),
        rules,
    }
}
