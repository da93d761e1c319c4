//! kube-proxy-named flags as the command line gave them, each None when not given: the command line
//! (`cli`) fills them in, [`super::resolve()`] applies kube-proxy's precedence between them and the file.
//!
//! kube-proxy's rule: with `--config`, the file is the configuration, and every flag that has a field in
//! it is ignored, except the logging flags (`-v`, `--logging-format`) and `--hostname-override`, which win
//! over the file. Flags that are not fields of the file (`--master`, `--manifests`, `--init-only`,
//! `--cleanup`, and nftkube's own) always apply. [`Flags::under_config_file`] does that split.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use nftkube_model::{Cidr, NodePortSpec};

/// kube-proxy-named flags, as given on the command line (None: not given, so the file or the default
/// applies).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Flags {
    /// `--config`.
    pub config: Option<PathBuf>,
    /// `--manifests`.
    pub manifests: Option<PathBuf>,
    /// `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `--master`.
    pub master: Option<String>,
    /// `--hostname-override`.
    pub hostname_override: Option<String>,
    /// `--cluster-cidr`.
    pub cluster_cidr: Option<Vec<Cidr>>,
    /// `--nodeport-addresses`.
    pub nodeport_addresses: Option<NodePortSpec>,
    /// `--masquerade-all`.
    pub masquerade_all: Option<bool>,
    /// `--masquerade-bit`.
    pub masquerade_bit: Option<u32>,
    /// `--sync-period` (`--iptables-sync-period`).
    pub sync_period: Option<Duration>,
    /// `--min-sync-period` (`--iptables-min-sync-period`).
    pub min_sync_period: Option<Duration>,
    /// `--ipvs-sync-period`: the sync period when the mode is ipvs.
    pub ipvs_sync_period: Option<Duration>,
    /// `--ipvs-min-sync-period`: the minimum sync period when the mode is ipvs.
    pub ipvs_min_sync_period: Option<Duration>,
    /// `--healthz-bind-address` (empty: off).
    pub healthz_bind_address: Option<String>,
    /// `--metrics-bind-address` (empty: off).
    pub metrics_bind_address: Option<String>,
    /// `--healthz-port` (deprecated; 0: off).
    pub healthz_port: Option<u16>,
    /// `--metrics-port` (deprecated; 0: off).
    pub metrics_port: Option<u16>,
    /// `--bind-address-hard-fail`.
    pub bind_address_hard_fail: Option<bool>,
    /// `--bind-address`.
    pub bind_address: Option<String>,
    /// `--detect-local-mode`.
    pub detect_local_mode: Option<String>,
    /// `--pod-interface-name-prefix`.
    pub pod_interface_name_prefix: Option<String>,
    /// `--pod-bridge-interface`.
    pub pod_bridge_interface: Option<String>,
    /// `--proxy-mode`.
    pub proxy_mode: Option<String>,
    /// The `--conntrack-*` flags.
    pub conntrack: ConntrackFlags,
    /// `--oom-score-adj`.
    pub oom_score_adj: Option<i32>,
    /// `--feature-gates`, read into names and values.
    pub feature_gates: Option<BTreeMap<String, bool>>,
    /// `-v` / `--v`.
    pub verbosity: Option<u32>,
    /// `--logging-format`.
    pub logging_format: Option<String>,
    /// kube-proxy flags that were given and that nftkube has no use for, as `--name`: each is warned
    /// about once.
    pub without_effect: Vec<String>,
}

/// kube-proxy's `--conntrack-*` flags.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConntrackFlags {
    /// `--conntrack-max-per-core`.
    pub max_per_core: Option<i32>,
    /// `--conntrack-min`.
    pub min: Option<i32>,
    /// `--conntrack-tcp-timeout-established`.
    pub tcp_established_timeout: Option<Duration>,
    /// `--conntrack-tcp-timeout-close-wait`.
    pub tcp_close_wait_timeout: Option<Duration>,
    /// `--conntrack-tcp-be-liberal`.
    pub tcp_be_liberal: Option<bool>,
    /// `--conntrack-udp-timeout`.
    pub udp_timeout: Option<Duration>,
    /// `--conntrack-udp-timeout-stream`.
    pub udp_stream_timeout: Option<Duration>,
}

impl ConntrackFlags {
    /// The flags given, by name.
    fn given(&self) -> Vec<&'static str> {
        let c = self;
        [
            ("--conntrack-max-per-core", c.max_per_core.is_some()),
            ("--conntrack-min", c.min.is_some()),
            (
                "--conntrack-tcp-timeout-established",
                c.tcp_established_timeout.is_some(),
            ),
            (
                "--conntrack-tcp-timeout-close-wait",
                c.tcp_close_wait_timeout.is_some(),
            ),
            ("--conntrack-tcp-be-liberal", c.tcp_be_liberal.is_some()),
            ("--conntrack-udp-timeout", c.udp_timeout.is_some()),
            (
                "--conntrack-udp-timeout-stream",
                c.udp_stream_timeout.is_some(),
            ),
        ]
        .into_iter()
        .filter_map(|(name, given)| given.then_some(name))
        .collect()
    }
}

impl Flags {
    /// The flags that still apply beside a `--config` file, and the names of those the file overrules
    /// (kube-proxy ignores them silently; nftkube warns about each).
    pub fn under_config_file(&self) -> (Flags, Vec<&'static str>) {
        let kept = Flags {
            config: self.config.clone(),
            manifests: self.manifests.clone(),
            master: self.master.clone(),
            hostname_override: self.hostname_override.clone(),
            verbosity: self.verbosity,
            logging_format: self.logging_format.clone(),
            without_effect: self.without_effect.clone(),
            ..Flags::default()
        };
        (kept, self.file_fields_given())
    }

    /// The flags given that have a field in the configuration file (and so yield to it).
    fn file_fields_given(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = [
            ("--kubeconfig", self.kubeconfig.is_some()),
            ("--cluster-cidr", self.cluster_cidr.is_some()),
            ("--nodeport-addresses", self.nodeport_addresses.is_some()),
            ("--masquerade-all", self.masquerade_all.is_some()),
            ("--masquerade-bit", self.masquerade_bit.is_some()),
            ("--sync-period", self.sync_period.is_some()),
            ("--min-sync-period", self.min_sync_period.is_some()),
            ("--ipvs-sync-period", self.ipvs_sync_period.is_some()),
            (
                "--ipvs-min-sync-period",
                self.ipvs_min_sync_period.is_some(),
            ),
            (
                "--healthz-bind-address",
                self.healthz_bind_address.is_some(),
            ),
            (
                "--metrics-bind-address",
                self.metrics_bind_address.is_some(),
            ),
            ("--healthz-port", self.healthz_port.is_some()),
            ("--metrics-port", self.metrics_port.is_some()),
            (
                "--bind-address-hard-fail",
                self.bind_address_hard_fail.is_some(),
            ),
            ("--bind-address", self.bind_address.is_some()),
            ("--detect-local-mode", self.detect_local_mode.is_some()),
            (
                "--pod-interface-name-prefix",
                self.pod_interface_name_prefix.is_some(),
            ),
            (
                "--pod-bridge-interface",
                self.pod_bridge_interface.is_some(),
            ),
            ("--proxy-mode", self.proxy_mode.is_some()),
            ("--oom-score-adj", self.oom_score_adj.is_some()),
            ("--feature-gates", self.feature_gates.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, given)| given.then_some(name))
        .collect();
        names.extend(self.conntrack.given());
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beside_a_config_file_only_logging_the_node_name_and_the_source_stay() {
        let flags = Flags {
            config: Some("/c".into()),
            master: Some("http://m".into()),
            hostname_override: Some("n".into()),
            verbosity: Some(4),
            metrics_bind_address: Some("127.0.0.1:1".into()),
            conntrack: ConntrackFlags {
                min: Some(5),
                ..ConntrackFlags::default()
            },
            feature_gates: Some(BTreeMap::new()),
            without_effect: vec!["--profiling".into()],
            ..Flags::default()
        };
        let (kept, overruled) = flags.under_config_file();
        assert_eq!(
            overruled,
            [
                "--metrics-bind-address",
                "--feature-gates",
                "--conntrack-min"
            ]
        );
        assert_eq!(kept.metrics_bind_address, None);
        assert_eq!(kept.conntrack, ConntrackFlags::default());
        assert_eq!(kept.master.as_deref(), Some("http://m"));
        assert_eq!(kept.hostname_override.as_deref(), Some("n"));
        assert_eq!(kept.verbosity, Some(4));
        assert_eq!(kept.without_effect, ["--profiling"]);
    }
}
