//! Command-line interface. Flag names follow kube-proxy's where one exists.

// clap turns the doc comments below into `--help` text, where `[IPv6]:PORT` and `[::1]` are meant
// literally, not as links.
#![allow(rustdoc::broken_intra_doc_links)]

use clap::{Args, Parser, Subcommand};
use nftkube::agent::{self, ProxyOptions};
use nftkube::config;
use nftkube::model::{DetectLocal, DetectLocalError};
use nftkube::render::RenderConfig;
use std::path::PathBuf;
use std::time::Duration;

pub(crate) mod kube_proxy;
mod relay;
pub(crate) mod trace;

#[cfg(test)]
mod tests;

#[derive(Debug, Parser)]
#[command(
    name = "nftkube",
    version,
    about = "Kubernetes services in nf_tables, over netlink, with no binaries",
    // A flag given twice takes its last value, as kube-proxy's command line does.
    args_override_self = true
)]
/// The command line.
pub(crate) struct Cli {
    /// Log level: error, warn, info, debug, trace [default: info, or what -v says].
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    /// kube-proxy's (klog's) verbosity: 0-2 log at info, 3-4 at debug, 5 and above at trace; --log-level
    /// wins over it.
    #[arg(short = 'v', long = "v", global = true)]
    pub verbosity: Option<u32>,
    #[command(subcommand)]
    /// What to do.
    pub command: Command,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once
/// The subcommands.
pub(crate) enum Command {
    /// Keep the kernel in sync with the Services and EndpointSlices (Kubernetes API or manifests) until SIGTERM.
    #[command(args_override_self = true)]
    Proxy(ProxyArgs),
    #[command(flatten)]
    /// The tools around the agent.
    Tool(Tool),
}

#[derive(Debug, Subcommand)]
/// The commands that are not the agent: each runs once and ends.
pub(crate) enum Tool {
    /// Print, without root and without touching the kernel, the ruleset `proxy` would program.
    Plan(PlanArgs),
    /// Explain where a packet goes through the programmed state (the kernel's, or the plan of --manifests):
    /// every hook, chain, rule and lookup, the verdict, DNAT targets with probabilities, masquerade and why.
    Trace(trace::TraceArgs),
    /// Remove every table nftkube owns, and nothing else (with --traces: only abandoned trace tables; with
    /// --kube-proxy: only what kube-proxy left behind).
    Cleanup(CleanupArgs),
    /// Act as the CNI portmap plugin (CNI_COMMAND etc. in the environment, the network configuration on
    /// stdin); the same as running this binary under the name `portmap` or `nftkube-portmap`.
    Portmap,
    /// Print the version.
    Version,
}

#[derive(Debug, Args, Clone)]
/// The flags that shape the rendered ruleset (shared by `proxy` and `plan`).
pub(crate) struct RenderArgs {
    /// Directory (or file) of Service and EndpointSlice YAML manifests (`proxy`: instead of the API).
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    /// This node's name, as endpoints' nodeName spell it.
    #[arg(long, default_value = "")]
    pub hostname_override: String,
    /// Pod CIDRs, comma-separated (one per family); traffic to a ClusterIP from outside them is masqueraded.
    #[arg(long, value_parser = nftkube::model::parse_cidrs, default_value = "")]
    pub cluster_cidr: std::vec::Vec<nftkube::model::Cidr>,
    /// Where NodePorts are served, comma-separated: CIDRs and the keywords `primary` (the node's primary IP
    /// per family: a specific --bind-address, else the Node object's; without either, the addresses of the
    /// links with a default route), `localhost` (127.0.0.0/8 and ::1, through the relay) and `all` (every
    /// local address but loopback, as a zero CIDR), in any combination: the union. Default: primary.
    #[arg(long, value_parser = parse_nodeport_spec, default_value = "")]
    pub nodeport_addresses: nftkube::model::NodePortSpec,
    /// Masquerade all traffic sent to service IPs (`--masquerade-all=false` overrides a config file).
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub masquerade_all: bool,
    /// The fwmark bit (0-31) that asks for masquerade (kube-proxy's --iptables-masquerade-bit).
    #[arg(long, visible_alias = "iptables-masquerade-bit", default_value_t = 14, value_parser = clap::value_parser!(u32).range(0..32))]
    pub masquerade_bit: u32,
    /// Masquerade with fully random source ports, as kube-proxy's nftables mode always does
    /// (`--masquerade-fully-random=false`: the kernel's default port choice, which keeps the source port
    /// when it is free).
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub masquerade_fully_random: bool,
    /// The fwmark bit (0-31) whose packets are dropped (kubelet's --iptables-drop-bit).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(0..32))]
    pub drop_bit: u32,
    /// Service CIDRs, comma-separated: traffic to an address in them that no Service has is dropped. With
    /// the API source the CIDRs of the cluster's ServiceCIDR objects are added to these (a union), and
    /// follow them as they change.
    #[arg(long, value_parser = nftkube::model::parse_cidrs, default_value = "")]
    pub service_cidr: std::vec::Vec<nftkube::model::Cidr>,
    /// How pod traffic is recognised: ClusterCIDR, NodeCIDR (API source), InterfaceNamePrefix or
    /// BridgeInterface.
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

/// `--nodeport-addresses`: clap's error names the flag, ours the entry it could not read.
fn parse_nodeport_spec(
    s: &str,
) -> Result<nftkube::model::NodePortSpec, nftkube::model::NodePortSpecError> {
    s.parse()
}

/// Flags (or a config file) that do not make a usable configuration; `main` exits 64 with it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OptionsError {
    /// The config file, or a flag it is combined with.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// `--detect-local-mode` and its arguments.
    #[error(transparent)]
    DetectLocal(#[from] DetectLocalError),
    /// NodeCIDR needs the Node object, which `plan` has not.
    #[error("--detect-local-mode=NodeCIDR needs the Node object (nftkube proxy with the Kubernetes API source)")]
    NodeCidrWithoutNode,
    /// The masquerade and drop marks would be the same bit.
    #[error("--masquerade-bit and --drop-bit are both {0}")]
    SameMarkBits(u32),
}

impl RenderArgs {
    /// The render configuration, or what is wrong with the flags.
    pub(crate) fn render_config(&self) -> Result<RenderConfig, OptionsError> {
        let local_detector = DetectLocal::parse(
            &self.detect_local_mode,
            &self.pod_interface_name_prefix,
            &self.pod_bridge_interface,
        )?;
        if local_detector == DetectLocal::NodeCidr {
            return Err(OptionsError::NodeCidrWithoutNode);
        }
        if self.masquerade_bit == self.drop_bit {
            return Err(OptionsError::SameMarkBits(self.drop_bit));
        }
        let mut cfg = RenderConfig {
            node_name: self.hostname_override.clone(),
            cluster_cidrs: self.cluster_cidr.clone(),
            masquerade_all: self.masquerade_all,
            masquerade_bit: 1 << self.masquerade_bit,
            masquerade_fully_random: self.masquerade_fully_random,
            nodeport_addresses: nftkube::model::NodePortAddresses::None,
            drop_bit: 1 << self.drop_bit,
            service_cidrs: self.service_cidr.clone(),
            node_ips: Vec::new(),
            local_detector,
            node_zone: self.node_zone.clone(),
            serve_external_ips: true,
        };
        // Where NodePorts are served and the node's own IPs, from this namespace's addresses.
        agent::refresh_node_addresses(&mut cfg, &self.nodeport_addresses);
        Ok(cfg)
    }
}

#[derive(Debug, Args)]
/// `nftkube proxy`'s flags.
pub(crate) struct ProxyArgs {
    /// A KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API (default: the config file's clientConnection.kubeconfig, else
    /// the in-cluster service account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The Kubernetes API server's address (overrides the kubeconfig's).
    #[arg(long)]
    pub master: Option<String>,
    #[command(flatten)]
    /// The flags that shape the ruleset.
    pub render: RenderArgs,
    /// Periodic check at least this often: the node's addresses re-read, and the kernel's ruleset verified
    /// (by its generation id; read back and repaired when that moved): "30s", or seconds.
    #[arg(long, visible_alias = "iptables-sync-period", default_value = "30s", value_parser = config::parse_duration_flag)]
    pub sync_period: Duration,
    /// Minimum time between syncs, so that bursts of changes coalesce: "1s", or seconds.
    #[arg(long, visible_alias = "iptables-min-sync-period", default_value = "1s", value_parser = config::parse_duration_flag)]
    pub min_sync_period: Duration,
    /// IP:PORT of /healthz and /livez [default: 0.0.0.0:10256, as kube-proxy; [::]:10256 with an IPv6
    /// --bind-address; empty: off].
    #[arg(long)]
    pub healthz_bind_address: Option<String>,
    /// IP:PORT of /metrics [default: 127.0.0.1:10249; empty: off].
    #[arg(long)]
    pub metrics_bind_address: Option<String>,
    /// Exit when the healthz or metrics address cannot be bound (else retry every 5 s).
    #[arg(long, num_args = 0..=1, require_equals = true, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub bind_address_hard_fail: bool,
    /// The node's primary IP; an IPv6 one makes the default admin addresses [::1].
    #[arg(long)]
    pub bind_address: Option<String>,
    /// nftables (the default; iptables and ipvs are accepted and mean it too) or userspace (every service
    /// relayed in user space, nf_tables redirecting to the relay).
    #[arg(long)]
    pub proxy_mode: Option<String>,
    /// A sync bigger than this many set elements is committed as several transactions, so that none holds
    /// the kernel's nf_tables lock for long (changes that belong together are never cut apart).
    #[arg(long, default_value_t = nftkube::sync::chunk::MAX_ELEMENTS_PER_TRANSACTION as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_transaction_elements: u64,
    /// Periodic checks read our tables back in full at least this often, even when the ruleset's
    /// generation id says nothing changed since our last sync ("0": at every check).
    #[arg(long, default_value = "10m", value_parser = config::parse_duration_flag)]
    pub full_read_period: Duration,
    #[command(flatten)]
    /// The relay's limits and timeouts.
    pub relay: relay::RelayArgs,
    #[command(flatten)]
    /// The rest of kube-proxy's flags.
    pub kube_proxy: kube_proxy::KubeProxyArgs,
}

/// What `nftkube proxy` does before (or instead of) running the loop, and how it logs.
#[derive(Debug)]
pub(crate) struct Startup {
    /// Warnings about the configuration, to log once logging is set up.
    pub warnings: Vec<String>,
    /// How to log.
    pub logging: config::Logging,
    /// The conntrack sysctls to hold.
    pub conntrack: nftkube::conntrack::sysctls::Settings,
    /// The agent's oom_score_adj.
    pub oom_score_adj: i32,
    /// The configuration file, watched: a change ends the agent, as in kube-proxy.
    pub config_file: Option<PathBuf>,
}

/// What the command line gave besides the flags' values: which were given, and the global ones.
pub(crate) struct Given<'a> {
    /// Whether the argument with this id was given on the command line.
    pub given: &'a dyn Fn(&str) -> bool,
    /// `-v`.
    pub verbosity: Option<u32>,
    /// kube-proxy flags without effect that were given, as `--name`.
    pub without_effect: Vec<String>,
}

impl ProxyArgs {
    /// The flags given on the command line (`given(id)`: the argument with that id was given), for
    /// [`config::resolve`]; flags left at their defaults do not override the config file.
    pub(crate) fn flags(&self, cli: &Given) -> config::Flags {
        fn when<T: Clone>(given: &dyn Fn(&str) -> bool, id: &str, v: &T) -> Option<T> {
            given(id).then(|| v.clone())
        }
        let given = cli.given;
        let r = &self.render;
        let mut flags = config::Flags {
            config: self.config.clone(),
            manifests: r.manifests.clone(),
            kubeconfig: self.kubeconfig.clone(),
            master: self.master.clone(),
            hostname_override: when(given, "hostname_override", &r.hostname_override),
            cluster_cidr: when(given, "cluster_cidr", &r.cluster_cidr),
            nodeport_addresses: when(given, "nodeport_addresses", &r.nodeport_addresses),
            masquerade_all: when(given, "masquerade_all", &r.masquerade_all),
            masquerade_bit: when(given, "masquerade_bit", &r.masquerade_bit),
            sync_period: when(given, "sync_period", &self.sync_period),
            min_sync_period: when(given, "min_sync_period", &self.min_sync_period),
            healthz_bind_address: self.healthz_bind_address.clone(),
            metrics_bind_address: self.metrics_bind_address.clone(),
            bind_address_hard_fail: when(
                given,
                "bind_address_hard_fail",
                &self.bind_address_hard_fail,
            ),
            bind_address: self.bind_address.clone(),
            detect_local_mode: when(given, "detect_local_mode", &r.detect_local_mode),
            pod_interface_name_prefix: when(
                given,
                "pod_interface_name_prefix",
                &r.pod_interface_name_prefix,
            ),
            pod_bridge_interface: when(given, "pod_bridge_interface", &r.pod_bridge_interface),
            proxy_mode: self.proxy_mode.clone(),
            verbosity: cli.verbosity,
            without_effect: cli.without_effect.clone(),
            ..config::Flags::default()
        };
        self.kube_proxy.fill(&mut flags);
        flags
    }

    /// Config file, flags and defaults combined; Err: what is invalid.
    pub(crate) fn options(&self, cli: &Given) -> Result<(ProxyOptions, Startup), OptionsError> {
        let r = config::resolve(&self.flags(cli), &config::Env::current())?;
        let startup = Startup {
            warnings: r.warnings.clone(),
            logging: r.logging,
            conntrack: r.conntrack.clone(),
            oom_score_adj: r.oom_score_adj,
            config_file: self.config.clone(),
        };
        // Render flags without a config-file counterpart come from RenderArgs (which validates them);
        // the rest from the resolution.
        let mut args = self.render.clone();
        args.masquerade_bit = r.masquerade_bit;
        args.detect_local_mode = "ClusterCIDR".into();
        args.nodeport_addresses = r.nodeport.clone();
        let mut render = args.render_config()?;
        render.node_name = r.node_name.clone();
        render.cluster_cidrs = r.cluster_cidrs.clone();
        render.masquerade_all = r.masquerade_all;
        render.serve_external_ips = r.feature_gates.allow_service_external_ips;
        let mut opts = ProxyOptions::from_resolved(r, render);
        opts.max_transaction_elements =
            usize::try_from(self.max_transaction_elements).unwrap_or(usize::MAX);
        opts.full_read_period = self.full_read_period;
        self.relay.apply(&mut opts.relay);
        Ok((opts, startup))
    }
}

#[derive(Debug, Args)]
/// `nftkube plan`'s flags.
pub(crate) struct PlanArgs {
    #[command(flatten)]
    /// The flags that shape the ruleset.
    pub render: RenderArgs,
}

#[derive(Debug, Args)]
/// `nftkube cleanup`'s flags.
pub(crate) struct CleanupArgs {
    /// Remove only the tables that ended `nftkube trace --live` runs left behind (a killed run, or one whose
    /// removal failed), not the proxy's tables and not the table of a trace still running. A run counts as
    /// running when this command sees its process (the PID and start time in the table's name): run it in
    /// the host's PID namespace, or in the one the traces ran in; a trace running in a container whose
    /// processes this command cannot see loses its table.
    #[arg(long)]
    pub traces: bool,
    /// Remove only what kube-proxy leaves behind, as `kube-proxy --cleanup` does, over nf_tables: its
    /// nftables-mode tables (`ip kube-proxy`, `ip6 kube-proxy`) and, in iptables-nft's `nat` and `filter`
    /// tables, its jump rules and chains. Not nftkube's tables, not anyone else's rules or chains. Prints one
    /// line per family of what was removed and what was found but left; iptables-legacy and IPVS state is
    /// reported only.
    #[arg(long, conflicts_with = "traces")]
    pub kube_proxy: bool,
}
