//! The shared `lb-*` chains (masquerade marking and the uniform choice of an endpoint slot) and the
//! per-service firewall chains of loadBalancerSourceRanges.

use super::common::*;
use super::names::*;
use super::RenderConfig;
use crate::model::DetectLocal;
use crate::model::{Cidr, IpFamily, ServicePort};
use crate::nft::build::{ip_bytes, Field, RuleBuilder};
use crate::nft::ir::*;

/// Which frontends an `lb-*` chain serves: they differ in masquerading and in the key of their endpoints.
/// With ClientIP affinity (`lb-...-aff-...`), each choice is preceded by a lookup of the endpoint the client
/// had (see `RuleBuilder::affinity_hit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LbKind {
    /// `lb-<n>`: ClusterIPs. Masqueraded when from outside the cluster CIDR (never without one, as kube-proxy).
    Cluster,
    /// `lb-ext-<n>`: external and LoadBalancer IPs. Masqueraded unless from the cluster CIDR (always without
    /// one: the reply must come back through this node).
    External,
    /// `lb-np-<n>`: NodePorts, keyed by protocol and port alone. Always masqueraded (externalTrafficPolicy
    /// Cluster).
    NodePort,
    /// `lb-etp-<local>-<n>`: external and LoadBalancer IPs of an externalTrafficPolicy Local service: traffic
    /// from pods and from the node itself goes to all n endpoints (short-circuit), outside traffic only to
    /// the `local` endpoints on this node, keeping its source address; none → dropped.
    LocalExternal(u32),
    /// `lb-np-etp-<local>-<n>`: the same for the NodePort of such a service.
    LocalNodePort(u32),
}

/// Slots of a service's node-local endpoints start here (the first ones hold all its endpoints).
pub const LOCAL_SLOTS: u32 = 1 << 16;

/// The modulus the endpoint maps are declared with (`typeof ... numgen random mod SLOT_SPACE`): room for
/// every slot and every local slot. nft only reads the declaration to type the slot.
pub const SLOT_SPACE: u32 = 2 * LOCAL_SLOTS;

fn lb_name(kind: LbKind, n: u32, affinity: bool) -> String {
    let aff = if affinity { "aff-" } else { "" };
    match kind {
        LbKind::Cluster => format!("{LB_CHAIN_PREFIX}{aff}{n}"),
        LbKind::External => format!("{LB_CHAIN_PREFIX}ext-{aff}{n}"),
        LbKind::NodePort => format!("{LB_CHAIN_PREFIX}np-{aff}{n}"),
        LbKind::LocalExternal(l) => format!("{LB_CHAIN_PREFIX}etp-{aff}{l}-{n}"),
        LbKind::LocalNodePort(l) => format!("{LB_CHAIN_PREFIX}np-etp-{aff}{l}-{n}"),
    }
}

/// An `lb-*` chain: masquerade marking, then the uniform choice among n endpoint slots.
pub fn lb_chain_state(
    family: Family,
    n: u32,
    kind: LbKind,
    affinity: bool,
    cfg: &RenderConfig,
) -> ChainState {
    let f = ip_family(family);
    let (key, map) = match kind {
        LbKind::NodePort | LbKind::LocalNodePort(_) => {
            (vec![Field::L4Proto, Field::ThDport], MAP_NODEPORT_ENDPOINTS)
        }
        _ => (
            vec![daddr(f), Field::L4Proto, Field::ThDport],
            MAP_SERVICE_ENDPOINTS,
        ),
    };
    // Each choice, preceded (with affinity) by the same match and the lookup of the client's endpoint.
    let choose = |start: RuleBuilder, pick: RuleBuilder, comment: &str| -> Vec<Rule> {
        let mut rules = Vec::new();
        if affinity {
            rules.push(
                start
                    .clone()
                    .affinity_hit(family, MAP_AFFINITY)
                    .comment(format!("{comment}: the endpoint this client had"))
                    .build(),
            );
        }
        rules.push(pick.comment(comment).build());
        rules
    };
    let rules = match kind {
        LbKind::LocalExternal(local) | LbKind::LocalNodePort(local) => {
            local_policy_rules(f, family, n, local, (&key, map), cfg, &choose)
        }
        _ => {
            let mut rules = masquerade_marking(f, kind, cfg);
            let pick = RuleBuilder::new().dnat_map(&key, n, map, family);
            if affinity {
                rules.extend(choose(RuleBuilder::new(), pick, "ClientIP affinity"));
            } else {
                rules.push(pick.build());
            }
            rules
        }
    };
    ChainState {
        chain: Chain::regular(&lb_name(kind, n, affinity)),
        rules,
    }
}

/// The masquerade mark of ClusterIP, external and NodePort (externalTrafficPolicy Cluster) traffic.
fn masquerade_marking(f: IpFamily, kind: LbKind, cfg: &RenderConfig) -> Vec<Rule> {
    let not_pod = local_traffic(f, cfg, true);
    let external = kind == LbKind::External;
    let always = cfg.masquerade_all || kind == LbKind::NodePort || (external && not_pod.is_none());
    if always {
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

type Choose<'a> = dyn Fn(RuleBuilder, RuleBuilder, &str) -> Vec<Rule> + 'a;

/// externalTrafficPolicy Local: pods reach every endpoint (keeping their address unless masquerade-all: their
/// traffic is treated as cluster traffic); so does the node itself, masqueraded; outside traffic only the
/// local endpoints, keeping its source address (none: dropped).
fn local_policy_rules(
    f: IpFamily,
    family: Family,
    n: u32,
    local: u32,
    (key, map): (&[Field], &str),
    cfg: &RenderConfig,
    choose: &Choose<'_>,
) -> Vec<Rule> {
    let mut rules = Vec::new();
    if let Some(mut pod) = local_traffic(f, cfg, false) {
        if cfg.masquerade_all {
            pod = pod.mark_or(cfg.masquerade_bit);
        }
        let pick = pod.clone().dnat_map(key, n, map, family);
        rules.extend(choose(pod, pick, "from a pod: every endpoint"));
    }
    let node = RuleBuilder::new()
        .saddr_is_local()
        .mark_or(cfg.masquerade_bit);
    let pick = node.clone().dnat_map(key, n, map, family);
    rules.extend(choose(node, pick, "from the node: every endpoint"));
    if local > 0 {
        let pick = RuleBuilder::new().dnat_map_offset(key, local, LOCAL_SLOTS, map, family);
        rules.extend(choose(
            RuleBuilder::new(),
            pick,
            "from outside: local endpoints, source kept",
        ));
    } else {
        rules.push(
            RuleBuilder::new()
                .verdict(Verdict::Drop)
                .comment("from outside: no local endpoint")
                .build(),
        );
    }
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

/// `fw-<id>`: sources in the service's loadBalancerSourceRanges go on to its endpoints, others are dropped.
/// When a range contains one of the node's addresses, the LoadBalancer IPs themselves are allowed as sources
/// too (kube-proxy's rule for load balancers that hairpin through the node).
pub(super) fn firewall_chain_state(
    svc: &ServicePort,
    f: IpFamily,
    ranges: &[&Cidr],
    target: &str,
    cfg: &RenderConfig,
) -> ChainState {
    let family_name = if f == IpFamily::V4 { "ip" } else { "ip6" };
    let mut rules: Vec<Rule> = ranges
        .iter()
        .map(|c| {
            RuleBuilder::new()
                .prefix(saddr(f), &c.addr, c.prefix, false)
                .verdict(Verdict::Goto(target.into()))
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
                    .verdict(Verdict::Goto(target.into()))
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
