//! kube-proxy-compatible configuration: a `KubeProxyConfiguration` file
//! (`kubeproxy.config.k8s.io/v1alpha1`, `--config`) and kube-proxy-named flags, flags winning over the file.
//!
//! Fields nftkube honours: `clientConnection.kubeconfig`, `hostnameOverride`, `bindAddress` (only for the
//! family of the default health and metrics addresses), `healthzBindAddress`, `metricsBindAddress`,
//! `bindAddressHardFail`, `mode` (selects the section below), `clusterCIDR`, `detectLocalMode`
//! (`ClusterCIDR`, `NodeCIDR`), `nodePortAddresses` (validated and kept), and from the section of the
//! configured mode — `nftables` for `mode: nftables`, `iptables` for `iptables` or unset, `ipvs` (sync
//! periods) plus `iptables` (masquerade) for `ipvs` — `masqueradeBit`, `masqueradeAll`, `syncPeriod`,
//! `minSyncPeriod`.
//!
//! The file is read into typed structs (`file.rs`). Every other known field is accepted; set to anything but
//! its zero value or kube-proxy's default, it is warned about by name as not supported. Unknown fields are
//! warned about by name (kube-proxy decodes leniently too). Invalid values (a bad CIDR, duration, address, mask bit, an unsupported detect-local
//! mode) are a [`ConfigError`]: startup stops with exit code 64.
//!
//! In parts: `file` reads the file into a [`FileConfig`], `duration` reads durations, `flags` holds the
//! flags as given, and `resolve` combines flags, file and defaults into the [`Resolved`] settings.
#![forbid(unsafe_code)]

mod duration;
mod file;
mod flags;
mod gates;
mod resolve;
mod watch;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use duration::{parse_duration_flag, parse_go_duration, DurationError};
pub use flags::{ConntrackFlags, Flags};
pub use gates::{parse_feature_gates, FeatureGates};
pub use resolve::{
    parse_bind_address, parse_cluster_cidrs, resolve, resolve_with, Env, Logging, Resolved,
    SourceSpec,
};
pub use watch::{on_config_change, WATCH_PERIOD};

/// The only `apiVersion` read.
pub(crate) const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The only `kind` read.
pub(crate) const KIND: &str = "KubeProxyConfiguration";

/// An invalid configuration file or flag value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

/// The values the file sets (None: not set, or set to its zero value as Go's decoder would leave it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FileConfig {
    /// `clientConnection.kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `hostnameOverride`.
    pub hostname_override: Option<String>,
    /// `bindAddress` (its family picks the default admin addresses').
    pub bind_address: Option<String>,
    /// `healthzBindAddress`.
    pub healthz_bind_address: Option<String>,
    /// `metricsBindAddress`.
    pub metrics_bind_address: Option<String>,
    /// `bindAddressHardFail`.
    pub bind_address_hard_fail: Option<bool>,
    /// `mode`.
    pub mode: Option<String>,
    /// `masqueradeBit` of the mode's section (range checked when resolved).
    pub masquerade_bit: Option<i64>,
    /// `masqueradeAll` of the mode's section.
    pub masquerade_all: Option<bool>,
    /// `syncPeriod` of the mode's section (None when 0).
    pub sync_period: Option<Duration>,
    /// `minSyncPeriod` of the mode's section.
    pub min_sync_period: Option<Duration>,
    /// `detectLocalMode`.
    pub detect_local_mode: Option<String>,
    /// `detectLocal.bridgeInterface`.
    pub(crate) bridge_interface: Option<String>,
    /// `detectLocal.interfaceNamePrefix`.
    pub(crate) interface_name_prefix: Option<String>,
    /// `clusterCIDR` (comma-separated, read when resolved).
    pub cluster_cidr: Option<String>,
    /// `nodePortAddresses` (CIDRs or keywords, read when resolved).
    pub node_port_addresses: Option<Vec<String>>,
    /// `conntrack`.
    pub conntrack: ConntrackFlags,
    /// `oomScoreAdj` (range checked when resolved).
    pub oom_score_adj: Option<i64>,
    /// `featureGates`.
    pub feature_gates: Option<BTreeMap<String, bool>>,
    /// `logging.format`.
    pub logging_format: Option<String>,
    /// `logging.verbosity` (range checked when resolved).
    pub verbosity: Option<i64>,
    /// Fields warned about (unknown, unsupported, or of another mode's section).
    pub(crate) warnings: Vec<String>,
}

/// Reads and checks a configuration file.
pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("cannot read --config {}: {e}", path.display())))?;
    parse(&text).map_err(|e| ConfigError(format!("{}: {}", path.display(), e.0)))
}

/// Parses a configuration (YAML or JSON).
pub fn parse(text: &str) -> Result<FileConfig, ConfigError> {
    let root = nftkube_yaml::parse_document(text)
        .map_err(|e| ConfigError(format!("not valid YAML: {e}")))?;
    file::read(root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_unsupported_fields_are_warned_by_name() {
        let text = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clusterCIDR: 10.244.0.0/16
oomScoreAdj: -500
conntrack:
  maxPerCore: 32768
  min: 65536
ipvs:
  scheduler: rr
  strictARP: true
featureGates:
  SomeGate: true
frobnicate: 3
iptables:
  masqueradeAll: true
  surprise: x
"#;
        let f = parse(text).unwrap();
        let w = f.warnings.join("\n");
        for want in [
            "ipvs.scheduler is not supported",
            "ipvs.strictARP is not supported",
            "unknown field frobnicate",
            "unknown field iptables.surprise",
        ] {
            assert!(w.contains(want), "{want} missing from:\n{w}");
        }
        // Honoured fields are read, not warned about.
        for honoured in ["oomScoreAdj", "conntrack", "featureGates"] {
            assert!(!w.contains(honoured), "{honoured} warned about:\n{w}");
        }
        assert_eq!(f.oom_score_adj, Some(-500));
        assert_eq!(f.conntrack.max_per_core, Some(32768));
        assert_eq!(f.conntrack.min, Some(65536));
        assert!(f.feature_gates.as_ref().unwrap()["SomeGate"]);
        assert_eq!(f.masquerade_all, Some(true), "mode unset reads iptables.*");
    }

    #[test]
    fn sections_are_typed_and_null_sections_are_empty() {
        let base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let f = parse(&format!(
            "{base}clientConnection: null\niptables: ~\ndetectLocal:\n  bridgeInterface: cbr0\n  color: red\nwinkernel:\n  enableDSR: true\n"
        ))
        .unwrap();
        assert_eq!(f.bridge_interface.as_deref(), Some("cbr0"));
        assert_eq!(
            f.warnings,
            [
                "unknown field detectLocal.color (ignored)",
                "winkernel.enableDSR is not supported by nftkube (ignored; set to true)"
            ]
        );
        // A section that is not a mapping is an error naming it, as is a list of non-strings.
        let e = parse(&format!("{base}iptables: 5\n")).unwrap_err().0;
        assert!(
            e.contains("iptables: invalid type: integer `5`, expected a mapping"),
            "{e}"
        );
        let e = parse(&format!("{base}nodePortAddresses: [1]\n"))
            .unwrap_err()
            .0;
        assert_eq!(e, "nodePortAddresses: want strings, got 1");
        let e = parse(&format!("{base}ipvs:\n  masqueradeBit: 3\n")).unwrap();
        assert_eq!(e.warnings, ["unknown field ipvs.masqueradeBit (ignored)"]);
    }
}
