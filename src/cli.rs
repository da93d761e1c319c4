//! Command-line interface. Flag names follow kube-proxy's where one exists.

use crate::agent::{self, ProxyOptions};
use crate::render::RenderConfig;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "nftkube",
    version,
    about = "Kubernetes services in nf_tables, over netlink, with no binaries"
)]
pub struct Cli {
    /// Log level: error, warn, info, debug, trace.
    #[arg(long, global = true, default_value = "info")]
    pub log_level: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Keep the kernel in sync with the Services and EndpointSlices in a manifest directory until SIGTERM.
    Proxy(ProxyArgs),
    /// Print, without root and without touching the kernel, the ruleset `proxy` would program.
    Plan(PlanArgs),
    /// Remove every table nftkube owns, and nothing else.
    Cleanup,
    /// Build a sandbox of network namespaces, run the agent in it on examples/, send traffic, tear down.
    Demo(DemoArgs),
    /// Print the version.
    Version,
}

#[derive(Debug, Args, Clone)]
pub struct RenderArgs {
    /// Directory (or file) of Service and EndpointSlice YAML manifests.
    #[arg(long)]
    pub manifests: PathBuf,
    /// This node's name, as endpoints' nodeName spell it.
    #[arg(long, default_value = "")]
    pub hostname_override: String,
    /// Pod CIDRs, comma-separated (one per family); traffic to a ClusterIP from outside them is masqueraded.
    #[arg(long, value_parser = agent::parse_cidrs, default_value = "")]
    pub cluster_cidr: std::vec::Vec<crate::model::Cidr>,
    /// CIDRs of the node addresses that serve NodePorts, comma-separated; a zero CIDR (0.0.0.0/0, ::/0) means
    /// every local address but loopback. Default: the node's primary addresses (on links with a default route).
    #[arg(long, value_parser = agent::parse_cidrs, default_value = "")]
    pub nodeport_addresses: std::vec::Vec<crate::model::Cidr>,
    /// Masquerade all traffic sent to service IPs.
    #[arg(long)]
    pub masquerade_all: bool,
    /// The fwmark bit (0-31) that asks for masquerade (kube-proxy's --iptables-masquerade-bit).
    #[arg(long, default_value_t = 14, value_parser = clap::value_parser!(u32).range(0..32))]
    pub masquerade_bit: u32,
    /// Masquerade with fully random source ports.
    #[arg(long)]
    pub masquerade_fully_random: bool,
    /// The fwmark bit (0-31) whose packets are dropped (kubelet's --iptables-drop-bit).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(0..32))]
    pub drop_bit: u32,
    /// Service CIDRs, comma-separated: traffic to an address in them that no Service has is dropped.
    #[arg(long, value_parser = agent::parse_cidrs, default_value = "")]
    pub service_cidr: std::vec::Vec<crate::model::Cidr>,
    /// How pod traffic is recognised: ClusterCIDR, InterfaceNamePrefix or BridgeInterface.
    #[arg(long, default_value = "ClusterCIDR")]
    pub detect_local_mode: String,
    /// With --detect-local-mode=InterfaceNamePrefix: the prefix of the pods' interfaces on the node.
    #[arg(long, default_value = "")]
    pub pod_interface_name_prefix: String,
    /// With --detect-local-mode=BridgeInterface: the bridge the pods hang off.
    #[arg(long, default_value = "")]
    pub pod_bridge_interface: String,
    /// This node's zone, for topology hints (nftkube's; from the API, the Node's topology.kubernetes.io/zone).
    #[arg(long)]
    pub node_zone: Option<String>,
}

impl RenderArgs {
    /// The render configuration, or what is wrong with the flags.
    pub fn render_config(&self) -> Result<RenderConfig, String> {
        use crate::render::LocalDetector;
        let local_detector = match self.detect_local_mode.as_str() {
            "ClusterCIDR" | "" => LocalDetector::ClusterCidr,
            "InterfaceNamePrefix" if !self.pod_interface_name_prefix.is_empty() => {
                LocalDetector::InterfaceNamePrefix(self.pod_interface_name_prefix.clone())
            }
            "BridgeInterface" if !self.pod_bridge_interface.is_empty() => {
                LocalDetector::BridgeInterface(self.pod_bridge_interface.clone())
            }
            "InterfaceNamePrefix" => return Err("--detect-local-mode=InterfaceNamePrefix needs --pod-interface-name-prefix".into()),
            "BridgeInterface" => return Err("--detect-local-mode=BridgeInterface needs --pod-bridge-interface".into()),
            other => return Err(format!("--detect-local-mode={other:?} is not supported (ClusterCIDR, InterfaceNamePrefix, BridgeInterface; NodeCIDR needs the Node object)")),
        };
        if self.masquerade_bit == self.drop_bit {
            return Err(format!(
                "--masquerade-bit and --drop-bit are both {}",
                self.drop_bit
            ));
        }
        Ok(RenderConfig {
            node_name: self.hostname_override.clone(),
            cluster_cidrs: self.cluster_cidr.clone(),
            masquerade_all: self.masquerade_all,
            masquerade_bit: 1 << self.masquerade_bit,
            masquerade_fully_random: self.masquerade_fully_random,
            nodeport_addresses: agent::nodeport_addresses(&self.nodeport_addresses),
            drop_bit: 1 << self.drop_bit,
            service_cidrs: self.service_cidr.clone(),
            node_ips: crate::node::addresses()
                .map(|a| a.into_iter().map(|a| a.ip).collect())
                .unwrap_or_default(),
            local_detector,
            node_zone: self.node_zone.clone(),
        })
    }
}

#[derive(Debug, Args)]
pub struct ProxyArgs {
    #[command(flatten)]
    pub render: RenderArgs,
    /// Full resync (re-read the kernel and repair drift) at least this often, in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub sync_period: f64,
    /// Minimum time between syncs, in seconds: bursts of changes coalesce.
    #[arg(long, default_value_t = 1.0)]
    pub min_sync_period: f64,
}

impl ProxyArgs {
    pub fn options(&self) -> Result<ProxyOptions, String> {
        let mut o = ProxyOptions::new(self.render.manifests.clone(), self.render.render_config()?);
        o.nodeport_cidrs = self.render.nodeport_addresses.clone();
        o.sync_period = Duration::from_secs_f64(self.sync_period.max(0.1));
        o.min_sync_period = Duration::from_secs_f64(self.min_sync_period.max(0.0));
        Ok(o)
    }
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub render: RenderArgs,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Manifests to load into the sandbox's node.
    #[arg(long, default_value = "examples")]
    pub manifests: PathBuf,
    /// Connections (and datagrams) to send through each ClusterIP.
    #[arg(long, default_value_t = 30)]
    pub requests: usize,
}
