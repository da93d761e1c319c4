//! The shared `lb-*` chains (masquerade marking and the uniform choice of an endpoint slot) and the
//! per-service firewall chains of loadBalancerSourceRanges.

use super::common::*;
use super::names::*;
use super::{LocalDetector, RenderConfig};
use crate::model::{Cidr, IpFamily, ServicePort};
use crate::nft::build::{ip_bytes, Field, RuleBuilder};
use crate::nft::ir::*;

/// Which frontends an `lb-*` chain serves: they differ in masquerading and in the key of their endpoints.
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
    /// `lb-aff-<seconds>-<n>`: ClusterIPs of a service with ClientIP affinity of that timeout.
    ClusterAffinity(u32),
    /// `lb-ext-aff-<seconds>-<n>`: external and LoadBalancer IPs of such a service.
    ExternalAffinity(u32),
}

/// Slots of a service's node-local endpoints start here (the first ones hold all its endpoints).
pub const LOCAL_SLOTS: u32 = 1 << 16;

/// An `lb-*` chain: masquerade marking, then the uniform choice among n endpoint slots.
pub fn lb_chain_state(family: Family, n: u32, kind: LbKind, cfg: &RenderConfig) -> ChainState {
    let f = ip_family(family);
    let frontend_key = vec![daddr(f), Field::L4Proto, Field::ThDport];
    let port_key = vec![Field::L4Proto, Field::ThDport];
    let (name, key, map) = match kind {
        LbKind::Cluster => (lb_chain(n), frontend_key, MAP_SERVICE_ENDPOINTS),
        LbKind::External => (lb_external_chain(n), frontend_key, MAP_SERVICE_ENDPOINTS),
        LbKind::NodePort => (lb_nodeport_chain(n), port_key, MAP_NODEPORT_ENDPOINTS),
        LbKind::LocalExternal(l) => (
            format!("{LB_CHAIN_PREFIX}etp-{l}-{n}"),
            frontend_key,
            MAP_SERVICE_ENDPOINTS,
        ),
        LbKind::LocalNodePort(l) => (
            format!("{LB_CHAIN_PREFIX}np-etp-{l}-{n}"),
            port_key,
            MAP_NODEPORT_ENDPOINTS,
        ),
        LbKind::ClusterAffinity(t) => (
            format!("{LB_CHAIN_PREFIX}aff-{t}-{n}"),
            frontend_key,
            MAP_SERVICE_ENDPOINTS,
        ),
        LbKind::ExternalAffinity(t) => (
            format!("{LB_CHAIN_PREFIX}ext-aff-{t}-{n}"),
            frontend_key,
            MAP_SERVICE_ENDPOINTS,
        ),
    };
    // "From a pod" and "not from a pod", if the detector can tell in this family.
    let from_pod = |negate: bool| local_traffic(f, cfg, negate);
    let mut rules = Vec::new();
    if let LbKind::LocalExternal(local) | LbKind::LocalNodePort(local) = kind {
        // Pods reach every endpoint (keeping their address unless masquerade-all: their traffic is treated
        // as cluster traffic); so does the node itself, masqueraded.
        if let Some(mut pod) = from_pod(false) {
            if cfg.masquerade_all {
                pod = pod.mark_or(cfg.masquerade_bit);
            }
            rules.push(
                pod.dnat_map(&key, n, map, family)
                    .comment("from a pod: every endpoint")
                    .build(),
            );
        }
        rules.push(
            RuleBuilder::new()
                .saddr_is_local()
                .mark_or(cfg.masquerade_bit)
                .dnat_map(&key, n, map, family)
                .comment("from the node: every endpoint")
                .build(),
        );
        rules.push(if local > 0 {
            RuleBuilder::new()
                .dnat_map_offset(&key, local, LOCAL_SLOTS, map, family)
                .comment("from outside: local endpoints, source kept")
                .build()
        } else {
            RuleBuilder::new()
                .verdict(Verdict::Drop)
                .comment("from outside: no local endpoint")
                .build()
        });
        return ChainState {
            chain: Chain::regular(&name),
            rules,
        };
    }
    let external = matches!(kind, LbKind::External | LbKind::ExternalAffinity(_));
    let not_pod = from_pod(true);
    let always = cfg.masquerade_all || kind == LbKind::NodePort || (external && not_pod.is_none());
    if always {
        rules.push(RuleBuilder::new().mark_or(cfg.masquerade_bit).build());
    } else if let Some(not_pod) = not_pod {
        rules.push(
            not_pod
                .mark_or(cfg.masquerade_bit)
                .comment("not from a pod")
                .build(),
        );
    }
    match kind {
        LbKind::ClusterAffinity(t) | LbKind::ExternalAffinity(t) => {
            let ms = t as u64 * 1000;
            rules.push(
                RuleBuilder::new()
                    .affinity_hit(family, MAP_AFFINITY, ms)
                    .comment("ClientIP affinity: the endpoint this client had")
                    .build(),
            );
            rules.push(
                RuleBuilder::new()
                    .affinity_pick(family, n, map, MAP_AFFINITY, ms)
                    .comment("ClientIP affinity: choose and remember")
                    .build(),
            );
        }
        _ => rules.push(RuleBuilder::new().dnat_map(&key, n, map, family).build()),
    }
    ChainState {
        chain: Chain::regular(&name),
        rules,
    }
}

/// The start of a rule matching traffic from this node's pods (`negate`: not from them), per the configured
/// detector; None when it cannot tell in this family (no cluster CIDR of the family given).
pub(super) fn local_traffic(f: IpFamily, cfg: &RenderConfig, negate: bool) -> Option<RuleBuilder> {
    match &cfg.local_detector {
        LocalDetector::ClusterCidr => {
            let cidr = cfg.cluster_cidrs.iter().find(|c| c.family() == f)?;
            Some(RuleBuilder::new().prefix(saddr(f), &cidr.addr, cidr.prefix, negate))
        }
        LocalDetector::InterfaceNamePrefix(p) => Some(RuleBuilder::new().iifname(p, true, negate)),
        LocalDetector::BridgeInterface(b) => Some(RuleBuilder::new().iifname(b, false, negate)),
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
