//! `--proxy-mode userspace`: every TCP and UDP service port is relayed in user space. The relay listens on an
//! ephemeral port per service port and family (on every address), and nf_tables redirects the service's
//! ClusterIPs, external IPs and LoadBalancer IPs to it through one map (`render::userspace`), and drops what
//! reaches those ports without a redirect. NodePorts are listened on directly, on the addresses
//! `--nodeport-addresses` selects.

use super::{Frontend, Relay, RelayError, RelayOptions};
use nftkube_model::{
    ClusterState, Endpoint, IpFamily, NamespacedName, NodePortAddresses, Protocol, ServicePort,
    ServicePortName,
};
use nftkube_nft::Backend;
use nftkube_render::{self as render, usable_endpoints, Piece};
use nftkube_sync::{SyncEngine, SyncError, SyncReport};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// The relay of userspace mode and what nf_tables needs from it.
#[derive(Debug)]
pub struct UserspaceProxy {
    relay: Relay,
    /// The NodePort addresses the listeners were last made for: a change rebuilds every listener.
    nodeport: Option<NodePortAddresses>,
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

/// The listeners one service port needs: per family it has addresses in, one redirect target on an
/// ephemeral port, and its NodePort on each NodePort address.
fn frontends_of(
    svc: &ServicePort,
    endpoints: &[Endpoint],
    nodeport: &NodePortAddresses,
) -> Vec<Frontend> {
    if svc.protocol == Protocol::Sctp {
        return Vec::new();
    }
    let mut out = Vec::new();
    for f in [IpFamily::V4, IpFamily::V6] {
        let eps: Vec<SocketAddr> = usable_endpoints(endpoints, f)
            .iter()
            .map(|e| SocketAddr::new(e.ip, e.port))
            .collect();
        let frontend = |service: String, listen| Frontend {
            service,
            protocol: svc.protocol,
            listen,
            endpoints: eps.clone(),
            affinity: svc
                .session_affinity_timeout
                .map(|s| Duration::from_secs(s.into())),
        };
        if !render::userspace::frontend_ips(svc, f).is_empty() {
            out.push(frontend(svc.name.to_string(), any(f, 0)));
        }
        let has_family = svc.cluster_ips.iter().any(|ip| IpFamily::of(ip) == f);
        if let Some(np) = svc.node_port.filter(|_| has_family) {
            for ip in node_port_ips(nodeport, f) {
                out.push(frontend(node_port_name(svc), SocketAddr::new(ip, np)));
            }
        }
    }
    out
}

/// The listeners of every port of one service.
fn service_frontends(
    state: &ClusterState,
    name: &NamespacedName,
    nodeport: &NodePortAddresses,
) -> Vec<Frontend> {
    let endpoints = state.service_endpoints(name);
    let mut out = Vec::new();
    for sp in state.service_ports(name) {
        let eps = endpoints.get(&sp.name).map(Vec::as_slice).unwrap_or(&[]);
        out.extend(frontends_of(sp, eps, nodeport));
    }
    out
}

impl UserspaceProxy {
    /// Starts the relay in the calling thread's namespace.
    pub fn start(opts: &RelayOptions) -> Result<UserspaceProxy, RelayError> {
        tracing::info!("userspace mode: services are relayed in user space");
        Ok(UserspaceProxy {
            relay: Relay::start(opts)?,
            nodeport: None,
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
        nodeport: &NodePortAddresses,
    ) -> Result<SyncReport, SyncError> {
        let full = engine.needs_full_sync();
        if full || self.nodeport.as_ref() != Some(nodeport) {
            self.apply_listeners(state, nodeport);
            self.nodeport = Some(nodeport.clone());
        } else {
            for name in changed {
                self.apply_service_listeners(state, name, nodeport);
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
                    pieces.insert(sp.name.clone(), self.pieces(sp, endpoints.get(&sp.name)));
                }
            }
            return engine.sync_full(render::userspace::skeleton(), pieces);
        }
        let mut updates = Vec::new();
        for name in changed {
            let current = state.service_ports(name);
            let endpoints = state.service_endpoints(name);
            for sp in &current {
                updates.push((sp.name.clone(), self.pieces(sp, endpoints.get(&sp.name))));
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
    fn apply_listeners(&mut self, state: &ClusterState, nodeport: &NodePortAddresses) {
        let mut frontends = Vec::new();
        for name in state.service_names() {
            frontends.extend(service_frontends(state, &name, nodeport));
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
        nodeport: &NodePortAddresses,
    ) {
        let frontends = service_frontends(state, name, nodeport);
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

    /// The nf_tables elements of a service port, per family: with endpoints, redirects to its listener and
    /// that listener's port among those that answer redirected traffic only; without, or for SCTP (which the
    /// relay does not carry), rejects.
    fn pieces(&self, sp: &ServicePort, endpoints: Option<&Vec<Endpoint>>) -> Vec<Piece> {
        if sp.protocol == Protocol::Sctp {
            return [IpFamily::V4, IpFamily::V6]
                .into_iter()
                .flat_map(|f| render::userspace::no_endpoint_pieces(sp, f))
                .collect();
        }
        let endpoints = endpoints.map(Vec::as_slice).unwrap_or(&[]);
        let mut out = Vec::new();
        for f in [IpFamily::V4, IpFamily::V6] {
            if usable_endpoints(endpoints, f).is_empty() {
                out.extend(render::userspace::no_endpoint_pieces(sp, f));
                continue;
            }
            let name = sp.name.to_string();
            if let Some(local) = self.relay.local_addr(&name, sp.protocol, any(f, 0)) {
                out.extend(render::userspace::relay_pieces(sp, f, local.port()));
                out.push(render::userspace::listener_piece(sp, f, local.port()));
            }
        }
        out
    }
}
