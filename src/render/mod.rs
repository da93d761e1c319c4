//! Model → desired nf_tables state. Pure: the same model and config always give the same tables.

pub mod names;
mod services;

pub use services::render;

use crate::model::Cidr;

/// What shapes the rules besides the services themselves (kube-proxy's flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderConfig {
    /// This node's name (`--hostname-override`).
    pub node_name: String,
    /// Pod network ranges (`--cluster-cidr`): traffic to a ClusterIP from outside them is masqueraded.
    pub cluster_cidrs: Vec<Cidr>,
    /// Masquerade every service connection (`--masquerade-all`).
    pub masquerade_all: bool,
    /// The mark bit that asks postrouting to masquerade (kube-proxy's 0x4000).
    pub masquerade_bit: u32,
    /// `masquerade fully-random` (kube-proxy's `--iptables-masquerade-fully-random`... mapped to nft).
    pub masquerade_fully_random: bool,
}

impl Default for RenderConfig {
    fn default() -> Self {
        RenderConfig {
            node_name: String::new(),
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            masquerade_bit: 0x4000,
            masquerade_fully_random: false,
        }
    }
}
