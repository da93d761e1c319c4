//! Which relay listeners the model asks for.

use super::Frontend;
use nftkube_model::{ClusterState, IpFamily, Protocol};
use nftkube_render::usable_endpoints;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// NodePorts on loopback (`--nodeport-addresses` with 127.0.0.0/8 or `localhost`): for every TCP and UDP
/// service port with a NodePort, a listener on 127.0.0.1 (and on ::1 for a service with an IPv6 ClusterIP)
/// at the NodePort, relaying to the port's usable endpoints of that family. Traffic from the node itself
/// reaches every endpoint (as with the nf_tables rules), whatever the traffic policies say.
pub fn localhost_nodeports(state: &ClusterState) -> Vec<Frontend> {
    let mut out = Vec::new();
    for name in state.service_names() {
        let ports = state.service_ports(&name);
        if !ports.iter().any(|p| p.node_port.is_some()) {
            continue;
        }
        let endpoints = state.service_endpoints(&name);
        for sp in ports {
            let Some(node_port) = sp.node_port else {
                continue;
            };
            if sp.protocol == Protocol::Sctp {
                continue; // the relay carries TCP and UDP; SCTP NodePorts are left to nf_tables
            }
            let all = endpoints.get(&sp.name).map(Vec::as_slice).unwrap_or(&[]);
            let families = [
                (
                    IpFamily::V4,
                    SocketAddr::from((Ipv4Addr::LOCALHOST, node_port)),
                ),
                (
                    IpFamily::V6,
                    SocketAddr::from((Ipv6Addr::LOCALHOST, node_port)),
                ),
            ];
            for (family, listen) in families {
                if !sp.cluster_ips.iter().any(|ip| IpFamily::of(ip) == family) {
                    continue;
                }
                out.push(Frontend {
                    service: sp.name.to_string(),
                    protocol: sp.protocol,
                    listen,
                    endpoints: usable_endpoints(all, family)
                        .iter()
                        .map(|e| SocketAddr::new(e.ip, e.port))
                        .collect(),
                    affinity: sp
                        .session_affinity_timeout
                        .map(|s| Duration::from_secs(s.into())),
                    inside: None,
                });
            }
        }
    }
    out
}
