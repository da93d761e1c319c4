//! Feature gates, by kube-proxy's names (`--feature-gates A=true,B=false`, or the file's `featureGates`).
//!
//! Only the gates that change what a proxy does are looked at; each one kube-proxy 1.37 knows is accepted.
//! A name nftkube does not know is warned about and ignored: kube-proxy would refuse to start, but a gate
//! meant for another release must not take a node's services down.

use std::collections::BTreeMap;

use super::{err, ConfigError};

/// The gates nftkube honours, with their values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureGates {
    /// `AllowServiceExternalIPs` (deprecated, on by default): off, Services' `externalIPs` are not served,
    /// as kube-proxy then ignores them.
    pub allow_service_external_ips: bool,
}

impl Default for FeatureGates {
    fn default() -> Self {
        FeatureGates {
            allow_service_external_ips: true,
        }
    }
}

/// Gates kube-proxy 1.37 reads or registers, that nftkube accepts without acting on them, and why.
const ACCEPTED: &[(&str, &str)] = &[
    (
        "KubeProxyNFTablesLocalhostNodePorts",
        "nftkube serves localhost NodePorts whenever nodePortAddresses names loopback",
    ),
    ("NFTablesProxyMode", "nftkube always programs nf_tables"),
    ("KubeProxyIPVS", "nftkube has no IPVS mode"),
    (
        "ServiceTrafficDistribution",
        "always on: trafficDistribution is followed",
    ),
    (
        "PreferSameTrafficDistribution",
        "always on: trafficDistribution is followed",
    ),
    (
        "TopologyAwareHints",
        "always on: topology hints are followed",
    ),
    (
        "MultiCIDRServiceAllocator",
        "always on: ServiceCIDRs are watched",
    ),
    ("ContextualLogging", "logging gate"),
    ("LoggingAlphaOptions", "logging gate"),
    ("LoggingBetaOptions", "logging gate"),
    ("ComponentSLIs", "metrics gate"),
    ("ComponentFlagz", "no /flagz page"),
    ("ComponentStatusz", "no /statusz page"),
];

/// Reads `--feature-gates`' text: comma-separated `Name=bool`.
pub fn parse_feature_gates(text: &str) -> Result<BTreeMap<String, bool>, ConfigError> {
    let mut gates = BTreeMap::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((name, value)) = item.split_once('=') else {
            return err(format!(
                "--feature-gates {item:?}: want Name=true or Name=false"
            ));
        };
        let value = parse_bool(value.trim()).ok_or_else(|| {
            ConfigError(format!(
                "--feature-gates {item:?}: {value:?} is not a boolean"
            ))
        })?;
        gates.insert(name.trim().to_string(), value);
    }
    Ok(gates)
}

/// Go's strconv.ParseBool, which kube-proxy's gate parsing uses.
fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// The gates' effect, and a warning for each name nftkube does not know.
pub(crate) fn resolve_gates(
    given: &BTreeMap<String, bool>,
    warnings: &mut Vec<String>,
) -> FeatureGates {
    let mut gates = FeatureGates::default();
    for (name, &value) in given {
        match name.as_str() {
            "AllowServiceExternalIPs" => gates.allow_service_external_ips = value,
            known if ACCEPTED.iter().any(|(n, _)| *n == known) => {}
            unknown => warnings.push(format!(
                "feature gate {unknown}={value} is not one nftkube knows (ignored)"
            )),
        }
    }
    if !gates.allow_service_external_ips {
        warnings.push(
            "feature gate AllowServiceExternalIPs=false: Services' externalIPs are not served"
                .into(),
        );
    }
    gates
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gates_read_as_kube_proxy_reads_them_and_unknown_names_are_warned_about() {
        let g = parse_feature_gates("AllowServiceExternalIPs=false, NoSuchGate=T,ComponentFlagz=1")
            .unwrap();
        let mut w = Vec::new();
        let gates = resolve_gates(&g, &mut w);
        assert!(!gates.allow_service_external_ips);
        assert_eq!(
            w,
            [
                "feature gate NoSuchGate=true is not one nftkube knows (ignored)",
                "feature gate AllowServiceExternalIPs=false: Services' externalIPs are not served"
            ]
        );
        assert!(resolve_gates(&BTreeMap::new(), &mut Vec::new()).allow_service_external_ips);
        for bad in ["AllowServiceExternalIPs", "A=yes"] {
            let e = parse_feature_gates(bad).unwrap_err().0;
            assert!(e.contains("--feature-gates"), "{bad}: {e}");
        }
        assert!(parse_feature_gates("").unwrap().is_empty());
    }
}
