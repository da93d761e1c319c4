//! Where NodePorts are served and which IPs are the node's, from three inputs: the node's own links (read
//! over rtnetlink at full syncs), `--bind-address`, and the Node object's addresses (the API source; followed
//! while running, where kube-proxy restarts when they change).

use nftkube_model::{
    primary_node_ips, resolve_nodeport_addresses, source_range_node_ips, NodePortSpec,
};
use nftkube_node::{NodeView, ReadError};
use nftkube_render::RenderConfig;
use std::net::IpAddr;

/// The inputs, kept between reads so that each can change on its own; [`NodeAddresses::apply`] derives
/// what the rules get from them.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeAddresses {
    /// `--nodeport-addresses`.
    spec: NodePortSpec,
    /// `--bind-address` (only a specific one counts: see `primary_node_ips`).
    bind_address: Option<IpAddr>,
    /// The Node object's InternalIP and ExternalIP addresses; empty until it is known, and always with the
    /// manifest source.
    node_object: Vec<IpAddr>,
    /// The last good read of the node's links; None until one succeeds.
    local: Option<NodeView>,
}

impl NodeAddresses {
    pub(crate) fn new(spec: NodePortSpec, bind_address: Option<IpAddr>) -> Self {
        NodeAddresses {
            spec,
            bind_address,
            ..NodeAddresses::default()
        }
    }

    /// Reads the node's links (in the calling thread's namespace) and applies the result to `cfg`.
    pub(crate) fn refresh(&mut self, cfg: &mut RenderConfig) {
        self.refresh_from(cfg, nftkube_node::read);
    }

    /// `refresh` with the read given, so a test can make it fail.
    ///
    /// A failed read keeps what the last good one gave: a transient rtnetlink error (ENOBUFS while the routing
    /// table churns, a dump interrupted by a change) says nothing about the addresses, and withdrawing every
    /// NodePort for it would cut live traffic. With no good read yet (the first one, at startup) there is
    /// nothing to keep: NodePorts are not served (but with a zero CIDR, which needs no address) until a read
    /// succeeds, retried at every full sync (the first sync of `proxy` is one).
    pub(crate) fn refresh_from(
        &mut self,
        cfg: &mut RenderConfig,
        read: impl FnOnce() -> Result<NodeView, ReadError>,
    ) {
        match read() {
            Ok(view) => self.local = Some(view),
            Err(e) if self.local.is_none() => {
                tracing::warn!(error = %e, "reading the node failed and none of its addresses is known: NodePorts are not served on them until a read succeeds (retried at the next full sync)");
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the node failed: keeping its last known addresses (read again at the next full sync)");
            }
        }
        self.apply(cfg);
    }

    /// The Node object's addresses, as the source last reported them. True when that changed what the rules
    /// get (the caller then asks for a full sync).
    pub(crate) fn follow_node_object(&mut self, ips: &[IpAddr], cfg: &mut RenderConfig) -> bool {
        if ips == self.node_object.as_slice() {
            return false;
        }
        self.node_object = ips.to_vec();
        let before = (cfg.nodeport_addresses.clone(), cfg.node_ips.clone());
        self.apply(cfg);
        tracing::info!(
            node_object = ?ips,
            primary = ?primary_node_ips(self.bind_address, &self.node_object),
            nodeport_addresses = ?cfg.nodeport_addresses,
            "this node's addresses, from its Node object"
        );
        before != (cfg.nodeport_addresses.clone(), cfg.node_ips.clone())
    }

    /// Fills in where NodePorts are served and the node IPs of the loadBalancerSourceRanges check.
    fn apply(&self, cfg: &mut RenderConfig) {
        let primary = primary_node_ips(self.bind_address, &self.node_object);
        let view = self.local.clone().unwrap_or_default();
        cfg.nodeport_addresses =
            resolve_nodeport_addresses(&self.spec, &view.addresses, &primary, &view.primary_links);
        cfg.node_ips = source_range_node_ips(&view.addresses, &primary);
    }

    /// Every address of the node's links (the last good read): where a zero CIDR serves NodePorts, so where
    /// a flow to one may have missed our rules.
    pub(crate) fn local_ips(&self) -> Vec<IpAddr> {
        let addresses = self.local.as_ref().map(|v| v.addresses.as_slice());
        addresses.unwrap_or_default().iter().map(|a| a.ip).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_model::{NodeAddress, NodePortAddresses};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Link 2 (the default route's) holds `ips`.
    fn node(ips: &[&str]) -> NodeView {
        NodeView {
            addresses: ips
                .iter()
                .map(|s| NodeAddress {
                    ifindex: 2,
                    ip: ip(s),
                })
                .collect(),
            primary_links: vec![2],
        }
    }

    fn failed() -> Result<NodeView, ReadError> {
        Err(ReadError::Routes(std::io::Error::from_raw_os_error(
            libc::ENOBUFS,
        )))
    }

    fn served_on(ips: &[&str]) -> NodePortAddresses {
        NodePortAddresses::Only(ips.iter().map(|s| ip(s)).collect())
    }

    #[test]
    fn a_failed_read_keeps_the_last_known_addresses() {
        let mut cfg = RenderConfig::default();
        let mut n = NodeAddresses::default();
        n.refresh_from(&mut cfg, || Ok(node(&["192.168.200.1"])));
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.200.1"]));
        let before = cfg.clone();
        n.refresh_from(&mut cfg, failed);
        assert_eq!(cfg, before);
        // The next good read replaces them.
        n.refresh_from(&mut cfg, || Ok(node(&["192.168.201.1"])));
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.201.1"]));
        assert_eq!(cfg.node_ips, vec![ip("192.168.201.1")]);
        assert_eq!(n.local_ips(), vec![ip("192.168.201.1")]);
    }

    #[test]
    fn a_failed_first_read_serves_node_ports_on_no_address_until_a_read_succeeds() {
        let mut cfg = RenderConfig::default();
        let mut n = NodeAddresses::default();
        n.refresh_from(&mut cfg, failed);
        assert_eq!(cfg.nodeport_addresses, NodePortAddresses::None);
        assert!(cfg.node_ips.is_empty());
        n.refresh_from(&mut cfg, || Ok(node(&["192.168.200.1"])));
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.200.1"]));
        // Every local address needs none read: the kernel tells them.
        let mut cfg = RenderConfig::default();
        let mut n = NodeAddresses::new("0.0.0.0/0".parse().unwrap(), None);
        n.refresh_from(&mut cfg, failed);
        assert_eq!(cfg.nodeport_addresses, NodePortAddresses::AllLocal);
    }

    #[test]
    fn the_node_objects_address_narrows_primary_to_it_and_follows_its_changes() {
        let mut cfg = RenderConfig::default();
        let mut n = NodeAddresses::default();
        let two = || Ok(node(&["192.168.200.1", "192.168.210.1"]));
        // Before the Node object: the default route's link, both addresses.
        n.refresh_from(&mut cfg, two);
        assert_eq!(
            cfg.nodeport_addresses,
            served_on(&["192.168.200.1", "192.168.210.1"])
        );
        assert!(n.follow_node_object(&[ip("192.168.200.1")], &mut cfg));
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.200.1"]));
        assert_eq!(cfg.node_ips, vec![ip("192.168.200.1")]);
        // The same addresses again change nothing; a new InternalIP moves NodePorts to it.
        assert!(!n.follow_node_object(&[ip("192.168.200.1")], &mut cfg));
        assert!(n.follow_node_object(&[ip("192.168.210.1")], &mut cfg));
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.210.1"]));
        // A re-read of the links keeps the Node object's choice.
        n.refresh_from(&mut cfg, two);
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.210.1"]));
        // The conntrack check still sees every local address.
        assert_eq!(n.local_ips().len(), 2);
    }

    #[test]
    fn a_specific_bind_address_is_the_primary_ip_of_its_family() {
        let mut cfg = RenderConfig::default();
        let mut n = NodeAddresses::new("primary".parse().unwrap(), Some(ip("192.168.210.1")));
        n.refresh_from(&mut cfg, || Ok(node(&["192.168.200.1", "192.168.210.1"])));
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.210.1"]));
        // It wins over the Node object.
        assert!(!n.follow_node_object(&[ip("192.168.200.1")], &mut cfg));
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.210.1"]));
        // 0.0.0.0 is no address: the Node object's applies.
        let mut n = NodeAddresses::new(NodePortSpec::default(), Some(ip("0.0.0.0")));
        n.refresh_from(&mut cfg, || Ok(node(&["192.168.200.1", "192.168.210.1"])));
        n.follow_node_object(&[ip("192.168.200.1")], &mut cfg);
        assert_eq!(cfg.nodeport_addresses, served_on(&["192.168.200.1"]));
    }
}
