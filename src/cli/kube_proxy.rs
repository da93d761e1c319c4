//! The rest of kube-proxy's command line, so that a DaemonSet written for kube-proxy runs nftkube as it is:
//! the flags nftkube acts on (conntrack settings, OOM score, feature gates, the deprecated ports, the ipvs
//! periods, `--init-only`, `--cleanup`, logging), and those it accepts and warns about once by name.

use clap::{ArgMatches, Args};
use nftkube::config;
use std::time::Duration;

#[derive(Debug, Args, Clone, Default)]
#[command(next_help_heading = "kube-proxy's other flags")]
/// kube-proxy flags beyond those shaping the ruleset.
pub(crate) struct KubeProxyArgs {
    /// Do what needs more than CAP_NET_ADMIN (the conntrack sysctls), then exit, so that the agent itself
    /// can run with CAP_NET_ADMIN alone; a setting that cannot be written fails it (exit 1).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub init_only: Option<bool>,
    /// Remove nftkube's tables and what kube-proxy left behind (`nftkube cleanup`, then `nftkube cleanup
    /// --kube-proxy`), then exit.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub cleanup: Option<bool>,
    /// Conntrack entries per CPU (0: leave the table size and --conntrack-min alone) [default: 32768].
    #[arg(long, allow_negative_numbers = true)]
    pub conntrack_max_per_core: Option<i32>,
    /// The least conntrack table size, whatever the CPU count [default: 131072].
    #[arg(long, allow_negative_numbers = true)]
    pub conntrack_min: Option<i32>,
    /// Idle timeout of established TCP connections (0: leave it) [default: 24h].
    #[arg(long, value_parser = config::parse_duration_flag)]
    pub conntrack_tcp_timeout_established: Option<Duration>,
    /// Timeout of TCP connections in CLOSE_WAIT (0: leave it) [default: 1h].
    #[arg(long, value_parser = config::parse_duration_flag)]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,
    /// Set nf_conntrack_tcp_be_liberal to 1.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// Idle timeout of unreplied UDP flows (0: leave it).
    #[arg(long, value_parser = config::parse_duration_flag)]
    pub conntrack_udp_timeout: Option<Duration>,
    /// Idle timeout of assured UDP flows (0: leave it).
    #[arg(long, value_parser = config::parse_duration_flag)]
    pub conntrack_udp_timeout_stream: Option<Duration>,
    /// The agent's oom_score_adj, -1000 to 1000 [default: -999].
    #[arg(long, allow_negative_numbers = true)]
    pub oom_score_adj: Option<i32>,
    /// Feature gates, `Name=true,Other=false`; AllowServiceExternalIPs=false stops serving externalIPs.
    #[arg(long, value_parser = config::parse_feature_gates)]
    pub feature_gates: Option<std::collections::BTreeMap<String, bool>>,
    /// Deprecated: the healthz port (0: off); applies to a --healthz-bind-address given without a port.
    #[arg(long)]
    pub healthz_port: Option<u16>,
    /// Deprecated: the metrics port (0: off); applies to a --metrics-bind-address given without a port.
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// With --proxy-mode ipvs, the period of the periodic check (as --sync-period in other modes).
    #[arg(long, value_parser = config::parse_duration_flag)]
    pub ipvs_sync_period: Option<Duration>,
    /// With --proxy-mode ipvs, the least time between syncs (as --min-sync-period in other modes).
    #[arg(long, value_parser = config::parse_duration_flag)]
    pub ipvs_min_sync_period: Option<Duration>,
    /// Log format: text or json (one JSON object a line) [default: text].
    #[arg(long)]
    pub logging_format: Option<String>,
    #[command(flatten)]
    /// Accepted, without effect.
    pub without_effect: WithoutEffect,
}

/// kube-proxy flags that mean nothing for nftkube: each given one is warned about by name, never refused.
#[derive(Debug, Args, Clone, Default)]
pub(crate) struct WithoutEffect {
    #[arg(long, hide = true)]
    write_config_to: Option<String>,
    #[arg(long, hide = true)]
    kube_api_content_type: Option<String>,
    #[arg(long, hide = true)]
    kube_api_burst: Option<String>,
    #[arg(long, hide = true)]
    kube_api_qps: Option<String>,
    #[arg(long, hide = true)]
    config_sync_period: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    profiling: Option<String>,
    #[arg(long, hide = true)]
    show_hidden_metrics_for_version: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    iptables_localhost_nodeports: Option<String>,
    #[arg(long, hide = true)]
    ipvs_scheduler: Option<String>,
    #[arg(long, hide = true)]
    ipvs_exclude_cidrs: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    ipvs_strict_arp: Option<String>,
    #[arg(long, hide = true)]
    ipvs_tcp_timeout: Option<String>,
    #[arg(long, hide = true)]
    ipvs_tcpfin_timeout: Option<String>,
    #[arg(long, hide = true)]
    ipvs_udp_timeout: Option<String>,
    #[arg(long, hide = true)]
    vmodule: Option<String>,
    #[arg(long, hide = true)]
    log_flush_frequency: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    log_json_split_stream: Option<String>,
    #[arg(long, hide = true)]
    log_json_info_buffer_size: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    log_text_split_stream: Option<String>,
    #[arg(long, hide = true)]
    log_text_info_buffer_size: Option<String>,
}

/// The flags without effect that the command line gave, as `--name`: [`WithoutEffect`]'s own arguments, read
/// from its clap definition, so that the list is the struct.
pub(crate) fn given_without_effect(matches: &ArgMatches) -> Vec<String> {
    WithoutEffect::augment_args(clap::Command::new("without-effect"))
        .get_arguments()
        .filter(|arg| {
            matches.value_source(arg.get_id().as_str())
                == Some(clap::parser::ValueSource::CommandLine)
        })
        .filter_map(|arg| arg.get_long().map(|long| format!("--{long}")))
        .collect()
}

impl KubeProxyArgs {
    /// Copies what the file could also say into `flags`.
    pub(crate) fn fill(&self, flags: &mut config::Flags) {
        flags.conntrack = config::ConntrackFlags {
            max_per_core: self.conntrack_max_per_core,
            min: self.conntrack_min,
            tcp_established_timeout: self.conntrack_tcp_timeout_established,
            tcp_close_wait_timeout: self.conntrack_tcp_timeout_close_wait,
            tcp_be_liberal: self.conntrack_tcp_be_liberal,
            udp_timeout: self.conntrack_udp_timeout,
            udp_stream_timeout: self.conntrack_udp_timeout_stream,
        };
        flags.oom_score_adj = self.oom_score_adj;
        flags.feature_gates = self.feature_gates.clone();
        flags.healthz_port = self.healthz_port;
        flags.metrics_port = self.metrics_port;
        flags.ipvs_sync_period = self.ipvs_sync_period;
        flags.ipvs_min_sync_period = self.ipvs_min_sync_period;
        flags.logging_format = self.logging_format.clone();
    }
}
