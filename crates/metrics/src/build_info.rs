//! `kubernetes_build_info`: the constant 1 every Kubernetes component exports, labelled with what it was
//! built from. Dashboards group and join on it (the version panel, "which nodes run which proxy").
//!
//! The labels are kube-proxy's; their values are nftkube's, where it has one:
//! - `git_version` `v<version>`, `major` / `minor` from nftkube's version (the workspace's crates share it);
//! - `git_commit`, `git_tree_state` empty and `build_date` `1970-01-01T00:00:00Z`: what a Kubernetes binary
//!   built without its release stamping shows (nftkube's build stamps none);
//! - `compiler` `rustc`, `go_version` empty (no Go is involved);
//! - `platform` `linux/<arch>` with Go's architecture names (`amd64`, `arm64`), as kube-proxy's.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use std::fmt;

/// nftkube's version.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Go's name (`GOARCH`) of the architecture this was built for.
fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "x86" => "386",
        "aarch64" => "arm64",
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        "powerpc64" => "ppc64",
        "loongarch64" => "loong64",
        other => other,
    }
}

/// The label pairs, in kube-proxy's (alphabetical) order.
pub(crate) fn labels() -> Vec<(&'static str, String)> {
    let mut parts = VERSION.split('.');
    let major = parts.next().unwrap_or("0").to_string();
    let minor = parts.next().unwrap_or("0").to_string();
    vec![
        ("build_date", "1970-01-01T00:00:00Z".into()),
        ("compiler", "rustc".into()),
        ("git_commit", String::new()),
        ("git_tree_state", String::new()),
        ("git_version", format!("v{VERSION}")),
        ("go_version", String::new()),
        ("major", major),
        ("minor", minor),
        (
            "platform",
            format!("{}/{}", std::env::consts::OS, go_arch()),
        ),
    ]
}

/// Encodes `kubernetes_build_info`.
#[derive(Debug, Default)]
pub(crate) struct BuildInfo;

impl Collector for BuildInfo {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let one = ConstGauge::new(1i64);
        let mut family = encoder.encode_descriptor(
            "kubernetes_build_info",
            "A metric with a constant '1' value labeled by major, minor, git version, git commit, git tree \
             state, build date, Go version, and compiler from which it was built, and platform on which it \
             is running",
            None,
            one.metric_type(),
        )?;
        let labels = labels();
        let pairs: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
        one.encode(family.encode_family(&pairs)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_kube_proxys_with_nftkubes_version() {
        let l = labels();
        let names: Vec<&str> = l.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            names,
            [
                "build_date",
                "compiler",
                "git_commit",
                "git_tree_state",
                "git_version",
                "go_version",
                "major",
                "minor",
                "platform"
            ]
        );
        let get = |k: &str| l.iter().find(|(n, _)| *n == k).unwrap().1.clone();
        assert_eq!(get("git_version"), format!("v{VERSION}"));
        assert_eq!(
            format!("{}.{}", get("major"), get("minor")),
            VERSION.rsplit_once('.').unwrap().0
        );
        assert!(get("platform").starts_with("linux/"));
        assert!(!get("platform").contains("x86_64"));
    }
}
