//! NodePorts on loopback for the nf_tables proxy: nf_tables DNAT cannot serve 127.0.0.1 without
//! route_localnet (which opens the node's loopback to the network), so a relay listens there instead.

use super::{localhost_nodeports, Relay, RelayError, RelayOptions};
use nftkube_metrics::IpFamily as MetricsFamily;
use nftkube_model::{Cidr, ClusterState};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Which loopback families `--nodeport-addresses` asks NodePorts to be served on: a CIDR (not a zero one,
/// which means every address but loopback) holding 127.0.0.1, or ::1.
pub fn loopback_families(nodeport_cidrs: &[Cidr]) -> (bool, bool) {
    let asks = |ip: IpAddr| {
        nodeport_cidrs
            .iter()
            .any(|c| c.prefix > 0 && c.contains(&ip))
    };
    (
        asks(Ipv4Addr::LOCALHOST.into()),
        asks(Ipv6Addr::LOCALHOST.into()),
    )
}

/// The relay serving NodePorts on loopback, kept in step with the model after each sync.
#[derive(Debug)]
pub struct LocalhostNodePorts {
    relay: Relay,
    v4: bool,
    v6: bool,
}

impl LocalhostNodePorts {
    /// None when `--nodeport-addresses` does not ask for loopback. Starts the relay in the calling thread's
    /// namespace.
    pub fn start(
        nodeport_cidrs: &[Cidr],
        opts: &RelayOptions,
    ) -> Result<Option<LocalhostNodePorts>, RelayError> {
        let (v4, v6) = loopback_families(nodeport_cidrs);
        if !v4 && !v6 {
            return Ok(None);
        }
        tracing::info!(
            ipv4 = v4,
            ipv6 = v6,
            "serving NodePorts on loopback through the relay"
        );
        Ok(Some(LocalhostNodePorts {
            relay: Relay::start(opts)?,
            v4,
            v6,
        }))
    }

    /// Listeners follow the model: one per NodePort and loopback family. A port that cannot be bound is
    /// logged by name; every other one is served.
    pub fn sync(&mut self, state: &ClusterState) {
        let frontends: Vec<_> = localhost_nodeports(state)
            .into_iter()
            .filter(|f| if f.listen.is_ipv4() { self.v4 } else { self.v6 })
            .collect();
        for e in self.relay.apply(&frontends) {
            if let RelayError::Listen { listen, .. } = &e {
                nftkube_metrics::localhost_nodeport_listener_failed(family(listen));
            }
            tracing::warn!("localhost NodePort not served: {e}");
        }
        let (v4, v6) = self.relay.listeners_by_family();
        nftkube_metrics::set_localhost_nodeport_listeners(MetricsFamily::V4, v4);
        nftkube_metrics::set_localhost_nodeport_listeners(MetricsFamily::V6, v6);
    }
}

fn family(a: &std::net::SocketAddr) -> MetricsFamily {
    match a.is_ipv4() {
        true => MetricsFamily::V4,
        false => MetricsFamily::V6,
    }
}
