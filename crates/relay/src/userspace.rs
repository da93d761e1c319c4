//! `--proxy-mode userspace`: every TCP and UDP service port is relayed in user space. The relay listens on
//! ephemeral ports per service port and family (on every address): one for its ClusterIPs, one for its
//! external and LoadBalancer IPs, each with the endpoints its traffic policy chooses; nf_tables redirects
//! the service's addresses to them through one map (`render::userspace`), applies the policies' drops and
//! loadBalancerSourceRanges, and drops what reaches those ports without a redirect. NodePorts are listened on
//! directly, on the addresses `--nodeport-addresses` selects.

use super::{Frontend, Inside, Insiders, Relay, RelayError, RelayOptions};
use nftkube_model::{
    ClusterState, DetectLocal, Endpoint, IpFamily, NamespacedName, NodePortAddresses, Protocol,
    ServicePort, ServicePortName, TrafficPolicy,
};
use nftkube_nft::Backend;
use nftkube_render::userspace::{Choice, RelayPorts};
use nftkube_render::{self as render, Piece, RenderConfig};
use nftkube_sync::{SyncEngine, SyncError, SyncReport};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// The relay of userspace mode and what nf_tables needs from it.
#[derive(Debug)]
pub struct UserspaceProxy {
    relay: Relay,
    /// The configuration the listeners were last made for (NodePort addresses, node name, pod ranges): a
    /// change rebuilds every listener.
    cfg: Option<RenderConfig>,
    /// SCTP service ports, refused: the relay carries TCP and UDP (their frontends are rejected, so a client
    /// is told at once rather than left waiting).
    sctp_refused: BTreeSet<ServicePortName>,
}

fn any(f: IpFamily, port: u16) -> SocketAddr {
    match f {
        IpFamily::V4 => (Ipv4Addr::UNSPECIFIED, port).into(),
        IpFamily::V6 => (Ipv6Addr::UNSPECIFIED, port).into(),
    }
}

/// The relay's name for a service port's NodePort listener (its own balancer and affinity, as each
/// frontend has in the nf_tables mode).
fn node_port_name(svc: &ServicePort) -> String {
    format!("{} (NodePort)", svc.name)
}

/// Where NodePorts of family `f` are listened on: the addresses `--nodeport-addresses` selects (every
/// address when it selects all of them; loopback is the localhost relay's).
fn node_port_ips(nodeport: &NodePortAddresses, f: IpFamily) -> Vec<IpAddr> {
    match nodeport {
        NodePortAddresses::AllLocal => vec![any(f, 0).ip()],
        NodePortAddresses::Only(ips) => ips
            .iter()
            .copied()
            .filter(|ip| IpFamily::of(ip) == f)
            .collect(),
        NodePortAddresses::None => Vec::new(),
    }
}

/// A listener's endpoint addresses.
fn addresses(eps: &[Endpoint]) -> Vec<SocketAddr> {
    eps.iter().map(|e| SocketAddr::new(e.ip, e.port)).collect()
}

/// The relay's name for a service port's listener of its external and LoadBalancer IPs.
fn external_name(svc: &ServicePort) -> String {
    format!("{} (external)", svc.name)
}

/// The clients an externalTrafficPolicy Local does not hold to this node's endpoints: the node and its pods,
/// by address (the pod ranges of a CIDR detector; an interface detector tells nothing to the relay).
fn insiders(cfg: &RenderConfig) -> Insiders {
    let pod_cidrs = match cfg.local_detector {
        DetectLocal::ClusterCidr | DetectLocal::NodeCidr => cfg.cluster_cidrs.clone(),
        _ => Vec::new(),
    };
    Insiders {
        pod_cidrs,
        node_ips: cfg.node_ips.clone(),
    }
}

/// The listeners one service port needs, per family it has addresses in: a redirect target for its
/// ClusterIPs (internalTrafficPolicy's endpoints), one for its external and LoadBalancer IPs and the NodePort
/// on each NodePort address (externalTrafficPolicy's, every endpoint for the node and its pods).
fn frontends_of(svc: &ServicePort, endpoints: &[Endpoint], cfg: &RenderConfig) -> Vec<Frontend> {
    if svc.protocol == Protocol::Sctp {
        return Vec::new();
    }
    let mut out = Vec::new();
    for f in [IpFamily::V4, IpFamily::V6] {
        let choice = Choice::of(endpoints, f, cfg);
        let inside = (svc.external_traffic_policy == TrafficPolicy::Local).then(|| Inside {
            endpoints: addresses(&choice.all),
            clients: insiders(cfg),
        });
        let frontend =
            |service: String, listen, eps: &[Endpoint], inside: Option<Inside>| Frontend {
                service,
                protocol: svc.protocol,
                listen,
                endpoints: addresses(eps),
                affinity: svc
                    .session_affinity_timeout
                    .map(|s| Duration::from_secs(s.into())),
                inside,
            };
        let has_cluster_ip = !render::userspace::cluster_ips(svc, f).is_empty();
        if has_cluster_ip {
            out.push(frontend(
                svc.name.to_string(),
                any(f, 0),
                choice.internal(svc),
                None,
            ));
        }
        if !render::userspace::external_ips(svc, f, cfg).is_empty() {
            let eps = choice.external(svc);
            out.push(frontend(external_name(svc), any(f, 0), eps, inside.clone()));
        }
        if let Some(np) = svc.node_port.filter(|_| has_cluster_ip) {
            for ip in node_port_ips(&cfg.nodeport_addresses, f) {
                let listen = SocketAddr::new(ip, np);
                let eps = choice.external(svc);
                out.push(frontend(node_port_name(svc), listen, eps, inside.clone()));
            }
        }
    }
    out
}

/// The listeners of every port of one service.
fn service_frontends(
    state: &ClusterState,
    name: &NamespacedName,
    cfg: &RenderConfig,
) -> Vec<Frontend> {
    let endpoints = state.service_endpoints(name);
    let mut out = Vec::new();
    for sp in state.service_ports(name) {
        let eps = endpoints.get(&sp.name).map(Vec::as_slice).unwrap_or(&[]);
        out.extend(frontends_of(sp, eps, cfg));
    }
    out
}

impl UserspaceProxy {
    /// Starts the relay in the calling thread's namespace.
    pub fn start(opts: &RelayOptions) -> Result<UserspaceProxy, RelayError> {
        tracing::info!("userspace mode: services are relayed in user space");
        Ok(UserspaceProxy {
            relay: Relay::start(opts)?.with_port_metrics(),
            cfg: None,
            sctp_refused: BTreeSet::new(),
        })
    }

    /// One sync: the relay's listeners follow the model, then nf_tables' redirect map follows the relay's
    /// ports (all of it in a full sync, the changed services' elements in a partial one).
    pub fn sync<B: Backend>(
        &mut self,
        engine: &mut SyncEngine<B>,
        state: &ClusterState,
        changed: &BTreeSet<NamespacedName>,
        cfg: &RenderConfig,
    ) -> Result<SyncReport, SyncError> {
        let full = engine.needs_full_sync();
        if full || self.cfg.as_ref() != Some(cfg) {
            self.apply_listeners(state, cfg);
            self.cfg = Some(cfg.clone());
        } else {
            for name in changed {
                self.apply_service_listeners(state, name, cfg);
            }
        }
        let looked_at: Vec<NamespacedName> = match full {
            true => state.service_names().into_iter().collect(),
            false => changed.iter().cloned().collect(),
        };
        self.note_sctp(state, &looked_at, full);
        if full {
            let mut pieces = BTreeMap::new();
            for name in state.service_names() {
                let endpoints = state.service_endpoints(&name);
                for sp in state.service_ports(&name) {
                    pieces.insert(
                        sp.name.clone(),
                        self.pieces(sp, endpoints.get(&sp.name), cfg),
                    );
                }
            }
            return engine.sync_full(render::userspace::skeleton_for(cfg), pieces);
        }
        let mut updates = Vec::new();
        for name in changed {
            let current = state.service_ports(name);
            let endpoints = state.service_endpoints(name);
            for sp in &current {
                updates.push((
                    sp.name.clone(),
                    self.pieces(sp, endpoints.get(&sp.name), cfg),
                ));
            }
            for old in engine.committed_ports(name) {
                if !current.iter().any(|sp| sp.name == old) {
                    updates.push((old, Vec::new()));
                }
            }
        }
        engine.sync_partial(updates)
    }

    /// Every listener follows the model (a full sync, or new NodePort addresses).
    fn apply_listeners(&mut self, state: &ClusterState, cfg: &RenderConfig) {
        let mut frontends = Vec::new();
        for name in state.service_names() {
            frontends.extend(service_frontends(state, &name, cfg));
        }
        for e in self.relay.apply(&frontends) {
            tracing::warn!("not relayed: {e}");
        }
    }

    /// One changed service's listeners follow the model (none when it was deleted); the others are not
    /// looked at.
    fn apply_service_listeners(
        &mut self,
        state: &ClusterState,
        name: &NamespacedName,
        cfg: &RenderConfig,
    ) {
        let frontends = service_frontends(state, name, cfg);
        for e in self.relay.apply_service(&name.to_string(), &frontends) {
            tracing::warn!("not relayed: {e}");
        }
    }

    /// Follows the SCTP service ports of `services` (every service on a full sync): each newly refused one is
    /// logged, and the count is a metric.
    fn note_sctp(&mut self, state: &ClusterState, services: &[NamespacedName], full: bool) {
        if full {
            self.sctp_refused.clear();
        } else {
            self.sctp_refused
                .retain(|port| !services.contains(&port.service));
        }
        for name in services {
            for sp in state.service_ports(name) {
                if sp.protocol == Protocol::Sctp && self.sctp_refused.insert(sp.name.clone()) {
                    tracing::warn!(
                        service_port = %sp.name,
                        "userspace mode does not relay SCTP: the service port's addresses are rejected"
                    );
                }
            }
        }
        nftkube_metrics::USERSPACE_SCTP_REFUSED.set(self.sctp_refused.len() as u64);
    }

    /// The nf_tables elements of a service port, per family: redirects to its listeners, the drops of its
    /// Local policies and its loadBalancerSourceRanges (see `render::userspace::service_pieces`).
    fn pieces(
        &self,
        sp: &ServicePort,
        endpoints: Option<&Vec<Endpoint>>,
        cfg: &RenderConfig,
    ) -> Vec<Piece> {
        let endpoints = endpoints.map(Vec::as_slice).unwrap_or(&[]);
        let mut out = Vec::new();
        for f in [IpFamily::V4, IpFamily::V6] {
            let choice = Choice::of(endpoints, f, cfg);
            let port = |name: String| {
                self.relay
                    .local_addr(&name, sp.protocol, any(f, 0))
                    .map(|a| a.port())
            };
            let ports = RelayPorts {
                cluster: port(sp.name.to_string()),
                external: port(external_name(sp)),
            };
            out.extend(render::userspace::service_pieces(
                sp, f, &choice, ports, cfg,
            ));
        }
        out
    }
}
