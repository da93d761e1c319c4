//! kube-proxy-named flags as the command line gave them, each None when not given: the command line
//! (`cli`) fills them in, [`super::resolve()`] lets the given ones win over the file.

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
    /// `--sync-period`.
    pub sync_period: Option<Duration>,
    /// `--min-sync-period`.
    pub min_sync_period: Option<Duration>,
    /// `--healthz-bind-address` (empty: off).
    pub healthz_bind_address: Option<String>,
    /// `--metrics-bind-address` (empty: off).
    pub metrics_bind_address: Option<String>,
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
}
