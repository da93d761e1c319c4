//! Model → desired nf_tables state. Pure: the same model and config always give the same tables.
#![forbid(unsafe_code)]

mod base;
mod chains;
pub mod claims;
mod common;
mod desired;
pub mod names;
mod services;
pub mod userspace;

pub use chains::{
    affinity_chain_state, lb_chain_state, pick_chain_states, region, Counts, LbKind, LOCAL_REGIONS,
    MAX_ENDPOINTS, PICK_GROUP, SHARED_COUNTS, SLOT_SPACE,
};
pub use desired::{Desired, DesiredSet};
pub use services::usable_endpoints;

use nftkube_model::{
    Cidr, DetectLocal, EndpointsMap, IpFamily, ServiceMap, ServicePort, ServicePortName,
};
use nftkube_nft::ir::{ChainState, Element, Family, TableState};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

/// An `lb-*` chain of a family under a config, built once and shared by every service piece that needs it
/// (10k services would otherwise hold 10k copies of a handful of chains).
pub(crate) fn lb_chain(
    family: Family,
    kind: LbKind,
    counts: Counts,
    affinity: bool,
    cfg: &RenderConfig,
) -> Arc<ChainState> {
    type Cache = Mutex<HashMap<(Family, LbKind, Counts, bool, RenderConfig), Arc<ChainState>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if cache.len() > 4096 {
        cache.clear(); // configs do not change at run time; this only bounds tests that vary them
    }
    cache
        .entry((family, kind, counts, affinity, cfg.clone()))
        .or_insert_with(|| Arc::new(lb_chain_state(family, kind, counts, affinity, cfg)))
        .clone()
}

/// `affinity-<seconds>` of a family, shared like `lb_chain`.
pub(crate) fn affinity_chain(family: Family, seconds: u32) -> Arc<ChainState> {
    type Cache = Mutex<HashMap<(Family, u32), Arc<ChainState>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    cache
        .entry((family, seconds))
        .or_insert_with(|| Arc::new(affinity_chain_state(family, seconds)))
        .clone()
}

/// Something one service port needs in the kernel. Pieces of different services may coincide (two services
/// of one kind share its `lb-*` chain; two ports of one ClusterIP share its `cluster-ips` element):
/// the sync engine counts references, so an object goes when the last service needing it goes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Piece {
    /// An element of one of the piece sets.
    Element {
        /// The table's family.
        family: Family,
        /// Which set.
        set: names::PieceSet,
        /// The element.
        element: Element,
        /// How strongly the element's service port claims its frontend (see `claims`; meaningless in
        /// shared sets). Five bytes in what was padding: a piece is no larger for it.
        precedence: claims::Precedence,
    },
    /// A chain (with its rules) some service needs.
    Chain {
        /// The table's family.
        family: Family,
        /// Shared: every service of one kind points at the same `lb-*` chain (see `lb_chain`).
        chain: Arc<ChainState>,
    },
}

/// The objects every table has whatever the services (ip, then ip6). Rendered even without services so that
/// the hooks are in place before the first service of a family appears.
pub fn skeleton(cfg: &RenderConfig) -> Vec<TableState> {
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .map(|f| base::table(f, cfg))
        .collect()
}

/// What one service port contributes, given all endpoints of that port.
pub fn service_pieces(
    svc: &ServicePort,
    endpoints: Option<&Vec<nftkube_model::Endpoint>>,
    cfg: &RenderConfig,
) -> Vec<Piece> {
    let mut pieces =
        services::service_pieces(svc, endpoints.map(Vec::as_slice).unwrap_or(&[]), cfg);
    // Kept for as long as the service is committed: the vector's growth slack would be ~20% of it.
    pieces.shrink_to_fit();
    pieces
}

/// Pieces of every service port.
pub fn all_pieces(
    services: &ServiceMap,
    endpoints: &EndpointsMap,
    cfg: &RenderConfig,
) -> BTreeMap<ServicePortName, Vec<Piece>> {
    services
        .iter()
        .map(|(spn, svc)| (spn.clone(), service_pieces(svc, endpoints.get(spn), cfg)))
        .collect()
}

/// The skeleton with every service port's pieces added: the complete desired tables, owned. Where two ports
/// claim one frontend, the one of highest precedence keeps it (see `claims`), as the sync engine decides:
/// every claim is counted first, so the order of the ports does not matter.
pub(crate) fn assemble(
    skeleton: Vec<TableState>,
    pieces: &BTreeMap<ServicePortName, Vec<Piece>>,
) -> Vec<TableState> {
    let mut claims = claims::Claims::default();
    let holders: Vec<_> = pieces.keys().map(|spn| Arc::new(spn.clone())).collect();
    for (holder, list) in holders.iter().zip(pieces.values()) {
        for p in list {
            if let Piece::Element {
                family,
                set,
                element,
                precedence,
            } = p
            {
                if !claims::shared_set(*set) {
                    claims.acquire(holder, *precedence, *family, *set, element);
                }
            }
        }
    }
    let kept = holders
        .iter()
        .zip(pieces.values())
        .flat_map(|(holder, list)| {
            list.iter()
                .filter(|p| claims::committed(&claims, holder, p))
        });
    Desired::assemble(&skeleton, kept)
        .iter()
        .map(Desired::to_table)
        .collect()
}

/// The complete desired tables for a model.
pub fn render(
    services: &ServiceMap,
    endpoints: &EndpointsMap,
    cfg: &RenderConfig,
) -> Vec<TableState> {
    assemble(skeleton(cfg), &all_pieces(services, endpoints, cfg))
}

/// The longest ClientIP affinity timeout the API allows (one day).
pub(crate) const MAX_AFFINITY_SECONDS: u32 = 86_400;

/// What shapes the rules besides the services themselves (kube-proxy's flags).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RenderConfig {
    /// This node's name (`--hostname-override`).
    pub node_name: String,
    /// Pod network ranges (`--cluster-cidr`): traffic to a ClusterIP from outside them is masqueraded.
    pub cluster_cidrs: Vec<Cidr>,
    /// Masquerade every service connection (`--masquerade-all`).
    pub masquerade_all: bool,
    /// The mark bit that asks postrouting to masquerade (kube-proxy's 0x4000).
    pub masquerade_bit: u32,
    /// `masquerade fully-random`: on by default, as in kube-proxy's nftables mode (every source port drawn
    /// at random, so two nodes' flows to one endpoint rarely collide on a port).
    pub masquerade_fully_random: bool,
    /// Where NodePorts are served (resolved from `--nodeport-addresses` and the node's addresses).
    pub nodeport_addresses: nftkube_model::NodePortAddresses,
    /// The mark bit whose packets are dropped (kubelet's KUBE-MARK-DROP, 0x8000).
    pub drop_bit: u32,
    /// Service ranges (`--service-cidr`): addresses in them that no Service has are dropped.
    pub service_cidrs: Vec<Cidr>,
    /// The node's own addresses (for loadBalancerSourceRanges that include the node).
    pub node_ips: Vec<std::net::IpAddr>,
    /// How traffic from this node's pods is told apart (kube-proxy's `--detect-local-mode`).
    pub local_detector: DetectLocal,
    /// This node's zone (its `topology.kubernetes.io/zone` label), for topology hints.
    pub node_zone: Option<String>,
    /// Serve Services' `externalIPs` (the `AllowServiceExternalIPs` feature gate, on by default).
    pub serve_external_ips: bool,
}

impl Default for RenderConfig {
    fn default() -> Self {
        RenderConfig {
            node_name: String::new(),
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            masquerade_bit: 0x4000,
            masquerade_fully_random: true,
            nodeport_addresses: nftkube_model::NodePortAddresses::None,
            drop_bit: 0x8000,
            service_cidrs: Vec::new(),
            node_ips: Vec::new(),
            local_detector: DetectLocal::ClusterCidr,
            node_zone: None,
            serve_external_ips: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Piece;

    /// A piece exists per element (a million and more at a million endpoints): its precedence must fit what
    /// was padding before it came.
    #[test]
    fn a_piece_is_no_larger_than_an_element_and_eight_bytes() {
        let element = std::mem::size_of::<nftkube_nft::ir::Element>();
        assert_eq!(std::mem::size_of::<Piece>(), element + 8);
    }
}
