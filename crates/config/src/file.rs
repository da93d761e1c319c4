//! The configuration file's own shape: `KubeProxyConfiguration` (v1alpha1, as of Kubernetes 1.33) as typed
//! structs, and its reading into a [`FileConfig`].
//!
//! Fields nftkube honours have a type that says how they are read ([`Text`], [`Flag`], [`GoDuration`],
//! [`Int`], [`Addresses`]): null and Go's zero value mean "not set", anything of the wrong type is an
//! error naming the field. Fields nftkube does not support are kept as raw values ([`Unsupported`]) so that
//! one set to anything but its zero value or kube-proxy's default can be warned about by name. Fields the
//! structs do not know are reported by serde_ignored, by their dotted path.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::{parse_go_duration, ConfigError, ConntrackFlags, FileConfig, API_VERSION, KIND};

/// Reads a document already parsed (through the budgeted [`nftkube_yaml`] path) into the file's values.
pub(super) fn read(root: Value) -> Result<FileConfig, ConfigError> {
    check_header(&root)?;
    let mut unknown = Vec::new();
    let mut note_unknown = |path: serde_ignored::Path| unknown.push(dotted(&path));
    let typed: KubeProxyConfiguration = {
        let ignored = serde_ignored::Deserializer::new(root, &mut note_unknown);
        serde_path_to_error::deserialize(ignored).map_err(|e| {
            let path = e.path().to_string();
            ConfigError(format!("{path}: {}", e.into_inner()))
        })?
    };
    let mut warnings: Vec<String> = unknown
        .into_iter()
        .map(|path| format!("unknown field {path} (ignored)"))
        .collect();
    typed.warn_unsupported(&mut warnings);
    typed.into_file_config(warnings)
}

/// `apiVersion` and `kind` come first: a document of another kind is not read any further.
fn check_header(root: &Value) -> Result<(), ConfigError> {
    let Value::Object(map) = root else {
        return Err(ConfigError("the file is not a mapping".into()));
    };
    match map.get("apiVersion").and_then(Value::as_str) {
        Some(API_VERSION) => {}
        Some(other) => {
            return Err(ConfigError(format!(
                "apiVersion {other:?} is not supported (want {API_VERSION})"
            )))
        }
        None => {
            return Err(ConfigError(format!(
                "apiVersion is missing (want {API_VERSION})"
            )))
        }
    }
    match map.get("kind").and_then(Value::as_str) {
        Some(KIND) => Ok(()),
        other => Err(ConfigError(format!("kind {other:?} is not {KIND}"))),
    }
}

/// A serde_ignored path as the file spells it (`iptables.surprise`), without its markers for options and
/// newtypes.
fn dotted(path: &serde_ignored::Path) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", dotted(parent)),
        Path::Map { parent, key } => match dotted(parent) {
            p if p.is_empty() => key.clone(),
            p => format!("{p}.{key}"),
        },
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => dotted(parent),
    }
}

/// A section that may be missing or null (read as empty).
fn section<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Reads a field's raw value and turns it into `T` with `read`, whose error becomes the field's error.
fn typed<'de, D, T>(
    d: D,
    read: impl FnOnce(Value) -> Result<Option<T>, String>,
) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    match Value::deserialize(d)? {
        Value::Null => Ok(None),
        v => read(v).map_err(serde::de::Error::custom),
    }
}

/// A string field; empty is not set.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Text(pub Option<String>);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        typed(d, |v| match v {
            Value::String(s) if s.is_empty() => Ok(None),
            Value::String(s) => Ok(Some(s)),
            other => Err(format!("want a string, got {other}")),
        })
        .map(Text)
    }
}

/// A boolean field.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Flag(pub Option<bool>);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        typed(d, |v| match v {
            Value::Bool(b) => Ok(Some(b)),
            other => Err(format!("want true or false, got {other}")),
        })
        .map(Flag)
    }
}

/// A metav1.Duration field ("30s"); empty is not set.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct GoDuration(pub Option<Duration>);

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        typed(d, |v| match v {
            Value::String(s) if s.is_empty() => Ok(None),
            Value::String(s) => parse_go_duration(&s).map(Some).map_err(|e| e.to_string()),
            other => Err(format!(
                "want a duration string such as \"30s\", got {other}"
            )),
        })
        .map(GoDuration)
    }
}

/// An integer field (`masqueradeBit`, `oomScoreAdj`, `conntrack.min`…), its range checked when resolved (the
/// error then names the winning value).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Int(pub Option<i64>);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        typed(d, |v| {
            v.as_i64()
                .map(Some)
                .ok_or_else(|| format!("want an integer, got {v}"))
        })
        .map(Int)
    }
}

/// `nodePortAddresses`: a list of strings (CIDRs or keywords, read when resolved).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Addresses(pub Option<Vec<String>>);

impl<'de> Deserialize<'de> for Addresses {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        typed(d, |v| match v {
            Value::Array(items) => items
                .into_iter()
                .map(|item| match item {
                    Value::String(s) => Ok(s),
                    other => Err(format!("want strings, got {other}")),
                })
                .collect::<Result<_, _>>()
                .map(Some),
            other => Err(format!("want a list, got {other}")),
        })
        .map(Addresses)
    }
}

/// A field nftkube accepts but does not act on, kept raw to be warned about when set.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub(crate) struct Unsupported(Option<Value>);

impl Unsupported {
    /// Warns about the field at `path` unless it is at Go's zero value or one of kube-proxy's `defaults`.
    fn warn(&self, path: &str, defaults: &[&str], warnings: &mut Vec<String>) {
        let Some(v) = &self.0 else { return };
        let text = scalar_text(v);
        if !is_zero(v) && !defaults.contains(&text.as_str()) {
            warnings.push(format!(
                "{path} is not supported by nftkube (ignored; set to {text})"
            ));
        }
    }
}

/// Go's zero value of a decoded field: null, false, 0, "", "0s", empty list or map (recursively).
fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || s == "0s" || s == "0",
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_zero),
    }
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `kubeproxy.config.k8s.io/v1alpha1` `KubeProxyConfiguration`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct KubeProxyConfiguration {
    // Checked by `check_header` before the structs are read.
    #[allow(dead_code)]
    api_version: Option<Value>,
    #[allow(dead_code)]
    kind: Option<Value>,
    #[serde(deserialize_with = "section")]
    client_connection: ClientConnection,
    hostname_override: Text,
    bind_address: Text,
    healthz_bind_address: Text,
    metrics_bind_address: Text,
    bind_address_hard_fail: Flag,
    mode: Text,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Text,
    detect_local_mode: Text,
    #[serde(deserialize_with = "section")]
    detect_local: DetectLocalSection,
    node_port_addresses: Addresses,
    #[serde(deserialize_with = "section")]
    iptables: IptablesSection,
    #[serde(deserialize_with = "section")]
    ipvs: IpvsSection,
    #[serde(deserialize_with = "section")]
    nftables: ProxierSection,
    #[serde(deserialize_with = "section")]
    conntrack: ConntrackSection,
    /// Windows only: every field is known, none applies.
    #[serde(deserialize_with = "section")]
    winkernel: std::collections::BTreeMap<String, Unsupported>,
    feature_gates: Gates,
    #[serde(deserialize_with = "section")]
    logging: LoggingSection,
    enable_profiling: Unsupported,
    show_hidden_metrics_for_version: Unsupported,
    port_range: Unsupported,
    windows_run_as_service: Unsupported,
    oom_score_adj: Int,
    config_sync_period: Unsupported,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct ClientConnection {
    kubeconfig: Text,
    accept_content_types: Unsupported,
    content_type: Unsupported,
    qps: Unsupported,
    burst: Unsupported,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct DetectLocalSection {
    bridge_interface: Text,
    interface_name_prefix: Text,
}

/// The settings a proxier section (`iptables`, `nftables`; `ipvs` has no masquerade fields) gives.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct ProxierSection {
    masquerade_bit: Int,
    masquerade_all: Flag,
    sync_period: GoDuration,
    min_sync_period: GoDuration,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct IptablesSection {
    masquerade_bit: Int,
    masquerade_all: Flag,
    sync_period: GoDuration,
    min_sync_period: GoDuration,
    localhost_node_ports: Unsupported,
    #[serde(rename = "snatNodeInternalIP")]
    snat_node_internal_ip: Unsupported,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct IpvsSection {
    sync_period: GoDuration,
    min_sync_period: GoDuration,
    scheduler: Unsupported,
    #[serde(rename = "excludeCIDRs")]
    exclude_cidrs: Unsupported,
    #[serde(rename = "strictARP")]
    strict_arp: Unsupported,
    tcp_timeout: Unsupported,
    tcp_fin_timeout: Unsupported,
    udp_timeout: Unsupported,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct ConntrackSection {
    max_per_core: Int,
    min: Int,
    tcp_established_timeout: GoDuration,
    tcp_close_wait_timeout: GoDuration,
    tcp_be_liberal: Flag,
    udp_timeout: GoDuration,
    udp_stream_timeout: GoDuration,
}

impl ConntrackSection {
    /// The section as the flags give it; a count outside 0..=i32::MAX is an error naming its field.
    fn settings(&self) -> Result<ConntrackFlags, ConfigError> {
        let count = |field: &str, v: Option<i64>| {
            v.map(|n| {
                i32::try_from(n).ok().filter(|n| *n >= 0).ok_or_else(|| {
                    ConfigError(format!(
                        "conntrack.{field} {n} is out of range (0-2147483647)"
                    ))
                })
            })
            .transpose()
        };
        Ok(ConntrackFlags {
            max_per_core: count("maxPerCore", self.max_per_core.0)?,
            min: count("min", self.min.0)?,
            tcp_established_timeout: self.tcp_established_timeout.0,
            tcp_close_wait_timeout: self.tcp_close_wait_timeout.0,
            tcp_be_liberal: self.tcp_be_liberal.0,
            udp_timeout: self.udp_timeout.0,
            udp_stream_timeout: self.udp_stream_timeout.0,
        })
    }
}

/// `logging`: the format and verbosity are honoured, the rest accepted.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, expecting = "a mapping")]
struct LoggingSection {
    format: Text,
    verbosity: Int,
    flush_frequency: Unsupported,
    vmodule: Unsupported,
    options: Unsupported,
}

/// `featureGates`: gate names and booleans.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Gates(pub Option<BTreeMap<String, bool>>);

impl<'de> Deserialize<'de> for Gates {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        typed(d, |v| match v {
            Value::Object(map) => map
                .into_iter()
                .map(|(name, value)| match value {
                    Value::Bool(b) => Ok((name, b)),
                    other => Err(format!("{name}: want true or false, got {other}")),
                })
                .collect::<Result<_, _>>()
                .map(Some),
            other => Err(format!(
                "want a mapping of gate names to booleans, got {other}"
            )),
        })
        .map(Gates)
    }
}

impl IptablesSection {
    fn proxier(&self) -> ProxierSection {
        ProxierSection {
            masquerade_bit: self.masquerade_bit,
            masquerade_all: self.masquerade_all,
            sync_period: self.sync_period,
            min_sync_period: self.min_sync_period,
        }
    }
}

impl IpvsSection {
    fn proxier(&self) -> ProxierSection {
        ProxierSection {
            sync_period: self.sync_period,
            min_sync_period: self.min_sync_period,
            ..ProxierSection::default()
        }
    }
}

/// The sections a mode reads its settings from: sync periods from one, masquerade settings from another.
struct ModeSections {
    sync: &'static str,
    masquerade: &'static str,
}

impl ModeSections {
    fn of(mode: &str) -> Result<ModeSections, ConfigError> {
        let (sync, masquerade) = match mode {
            // userspace: kube-proxy's userspace proxier read the iptables section too.
            "" | "iptables" | "userspace" => ("iptables", "iptables"),
            "nftables" => ("nftables", "nftables"),
            "ipvs" => ("ipvs", "iptables"),
            other => {
                return Err(ConfigError(format!(
                "mode {other:?} is not a Linux proxy mode (iptables, ipvs, nftables, userspace)"
            )))
            }
        };
        Ok(ModeSections { sync, masquerade })
    }
}

impl KubeProxyConfiguration {
    /// Warns about every unsupported field set to something.
    fn warn_unsupported(&self, w: &mut Vec<String>) {
        let c = &self.client_connection;
        c.accept_content_types.warn(
            "clientConnection.acceptContentTypes",
            &["application/json"],
            w,
        );
        c.content_type.warn(
            "clientConnection.contentType",
            &["application/vnd.kubernetes.protobuf", "application/json"],
            w,
        );
        c.qps.warn("clientConnection.qps", &["5"], w);
        c.burst.warn("clientConnection.burst", &["10"], w);
        let l = &self.logging;
        l.flush_frequency
            .warn("logging.flushFrequency", &["5s", "5000000000"], w);
        l.vmodule.warn("logging.vmodule", &[], w);
        l.options.warn("logging.options", &[], w);
        self.enable_profiling.warn("enableProfiling", &[], w);
        self.show_hidden_metrics_for_version
            .warn("showHiddenMetricsForVersion", &[], w);
        self.port_range.warn("portRange", &[], w);
        self.windows_run_as_service
            .warn("windowsRunAsService", &[], w);
        self.config_sync_period
            .warn("configSyncPeriod", &["15m0s", "15m"], w);
        let i = &self.iptables;
        i.localhost_node_ports
            .warn("iptables.localhostNodePorts", &["true"], w);
        i.snat_node_internal_ip
            .warn("iptables.snatNodeInternalIP", &[], w);
        let v = &self.ipvs;
        v.scheduler.warn("ipvs.scheduler", &[], w);
        v.exclude_cidrs.warn("ipvs.excludeCIDRs", &[], w);
        v.strict_arp.warn("ipvs.strictARP", &[], w);
        v.tcp_timeout.warn("ipvs.tcpTimeout", &[], w);
        v.tcp_fin_timeout.warn("ipvs.tcpFinTimeout", &[], w);
        v.udp_timeout.warn("ipvs.udpTimeout", &[], w);
        for (name, value) in &self.winkernel {
            value.warn(&format!("winkernel.{name}"), &[], w);
        }
    }

    fn proxier(&self, section: &str) -> ProxierSection {
        match section {
            "iptables" => self.iptables.proxier(),
            "ipvs" => self.ipvs.proxier(),
            _ => self.nftables,
        }
    }

    /// Warns about the settings of the sections the mode does not read.
    fn warn_other_sections(&self, mode: &str, used: &ModeSections, w: &mut Vec<String>) {
        for section in ["iptables", "ipvs", "nftables"] {
            let s = self.proxier(section);
            let masquerade_set = [
                ("masqueradeBit", s.masquerade_bit.0.is_some_and(|b| b != 0)),
                ("masqueradeAll", s.masquerade_all.0 == Some(true)),
            ];
            let sync_set = [
                ("syncPeriod", s.sync_period.0.is_some_and(|d| !d.is_zero())),
                (
                    "minSyncPeriod",
                    s.min_sync_period.0.is_some_and(|d| !d.is_zero()),
                ),
            ];
            let groups = [(masquerade_set, used.masquerade), (sync_set, used.sync)];
            for (fields, applies) in groups {
                for (field, set) in fields {
                    if set && section != applies {
                        w.push(format!(
                            "{section}.{field} is ignored: with mode {mode:?} the {applies} section applies"
                        ));
                    }
                }
            }
        }
    }

    /// The values of the configured mode's sections.
    fn into_file_config(self, mut warnings: Vec<String>) -> Result<FileConfig, ConfigError> {
        let mode = self.mode.0.clone().unwrap_or_default();
        let used = ModeSections::of(&mode)?;
        if !matches!(mode.as_str(), "" | "nftables" | "userspace") {
            warnings.push(format!(
                "mode {mode:?}: nftkube always programs nf_tables; the {} section's settings are used",
                used.sync
            ));
        }
        self.warn_other_sections(&mode, &used, &mut warnings);
        let sync = self.proxier(used.sync);
        let masquerade = self.proxier(used.masquerade);
        Ok(FileConfig {
            kubeconfig: self.client_connection.kubeconfig.0.map(PathBuf::from),
            hostname_override: self.hostname_override.0,
            bind_address: self.bind_address.0,
            healthz_bind_address: self.healthz_bind_address.0,
            metrics_bind_address: self.metrics_bind_address.0,
            bind_address_hard_fail: self.bind_address_hard_fail.0,
            mode: self.mode.0,
            masquerade_bit: masquerade.masquerade_bit.0,
            masquerade_all: masquerade.masquerade_all.0,
            sync_period: sync.sync_period.0.filter(|d| !d.is_zero()),
            min_sync_period: sync.min_sync_period.0,
            detect_local_mode: self.detect_local_mode.0,
            bridge_interface: self.detect_local.bridge_interface.0,
            interface_name_prefix: self.detect_local.interface_name_prefix.0,
            cluster_cidr: self.cluster_cidr.0,
            node_port_addresses: self.node_port_addresses.0,
            conntrack: self.conntrack.settings()?,
            oom_score_adj: self.oom_score_adj.0,
            feature_gates: self.feature_gates.0,
            logging_format: self.logging.format.0,
            verbosity: self.logging.verbosity.0,
            warnings,
        })
    }
}
