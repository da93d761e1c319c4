//! kube-proxy's local-traffic detectors (`detectLocalMode`): what makes a packet "from a pod" (not
//! masqueraded on its way to a ClusterIP, short-circuited for externalTrafficPolicy Local). One type for the
//! config file, the flags and render.

/// How local (pod) traffic is told apart.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum DetectLocal {
    /// Sources inside `clusterCIDR` (the first CIDR of each family) are local.
    #[default]
    ClusterCidr,
    /// Sources inside this node's `spec.podCIDRs` are local (needs the API source). Rendered like
    /// `ClusterCidr`, with the node's pod CIDRs as the cluster CIDRs.
    NodeCidr,
    /// Packets that arrive on an interface whose name starts with this prefix (`--pod-interface-name-prefix`).
    InterfaceNamePrefix(String),
    /// Packets that arrive on this bridge (`--pod-bridge-interface`).
    BridgeInterface(String),
}

/// A `detectLocalMode` that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DetectLocalError {
    /// The mode names no detector.
    #[error("detectLocalMode {0:?} is not one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix")]
    Unknown(String),
    /// InterfaceNamePrefix without a prefix.
    #[error("detectLocalMode InterfaceNamePrefix needs detectLocal.interfaceNamePrefix (--pod-interface-name-prefix)")]
    NoInterfacePrefix,
    /// BridgeInterface without a bridge.
    #[error("detectLocalMode BridgeInterface needs detectLocal.bridgeInterface (--pod-bridge-interface)")]
    NoBridge,
}

impl DetectLocal {
    /// Reads kube-proxy's mode name ("" is ClusterCIDR) with the interface prefix and bridge that two of the
    /// modes need (empty: not given).
    pub fn parse(
        mode: &str,
        interface_prefix: &str,
        bridge: &str,
    ) -> Result<Self, DetectLocalError> {
        Ok(match mode.trim() {
            "" | "ClusterCIDR" => DetectLocal::ClusterCidr,
            "NodeCIDR" => DetectLocal::NodeCidr,
            "InterfaceNamePrefix" if interface_prefix.is_empty() => {
                return Err(DetectLocalError::NoInterfacePrefix)
            }
            "InterfaceNamePrefix" => DetectLocal::InterfaceNamePrefix(interface_prefix.into()),
            "BridgeInterface" if bridge.is_empty() => return Err(DetectLocalError::NoBridge),
            "BridgeInterface" => DetectLocal::BridgeInterface(bridge.into()),
            other => return Err(DetectLocalError::Unknown(other.into())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_their_arguments() {
        assert_eq!(DetectLocal::parse("", "", ""), Ok(DetectLocal::ClusterCidr));
        assert_eq!(
            DetectLocal::parse("NodeCIDR", "", ""),
            Ok(DetectLocal::NodeCidr)
        );
        assert_eq!(
            DetectLocal::parse("InterfaceNamePrefix", "veth", ""),
            Ok(DetectLocal::InterfaceNamePrefix("veth".into()))
        );
        assert_eq!(
            DetectLocal::parse("BridgeInterface", "veth", ""),
            Err(DetectLocalError::NoBridge)
        );
        assert_eq!(
            DetectLocal::parse("Sideways", "", ""),
            Err(DetectLocalError::Unknown("Sideways".into()))
        );
    }
}
