//! Flags, the file and the defaults combined into the settings the agent runs with ([`Resolved`]): which
//! one wins for each setting, the checks across settings, and the reading of the values that flags and
//! file share (bind addresses, cluster CIDRs, node port addresses).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use super::gates::resolve_gates;
use super::{err, load, ConfigError, ConntrackFlags, FeatureGates, FileConfig, Flags};
use nftkube_admin::{AdminOptions, DEFAULT_HEALTHZ_PORT, DEFAULT_METRICS_PORT};
use nftkube_conntrack::sysctls::Settings as ConntrackSettings;
use nftkube_model::{Cidr, DetectLocal, NodePortSpec};

/// Where the cluster state comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    /// Service and EndpointSlice manifests in this directory (or file).
    Manifests(PathBuf),
    /// The Kubernetes API.
    Kube(nftkube_source::KubeOptions),
}

/// The effective settings after file, flags and defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// Where Services and EndpointSlices come from.
    pub source: SourceSpec,
    /// This node's name (lower-cased; empty with manifests and no override).
    pub node_name: String,
    /// The cluster's pod ranges, at most one per family.
    pub cluster_cidrs: Vec<Cidr>,
    /// How traffic from pods is told apart.
    pub detect_local: DetectLocal,
    /// Masquerade every connection to a service.
    pub masquerade_all: bool,
    /// The fwmark bit (0-31) that asks for masquerade.
    pub masquerade_bit: u32,
    /// How often the periodic check runs.
    pub sync_period: Duration,
    /// The least time between two syncs.
    pub min_sync_period: Duration,
    /// Health and metrics servers.
    pub admin: AdminOptions,
    /// `--nodeport-addresses`: keywords and CIDRs (nothing given: `primary`).
    pub nodeport: NodePortSpec,
    /// `--bind-address`, when it is one (kube-proxy takes a specific one as the node's primary IP of its
    /// family).
    pub bind_address: Option<IpAddr>,
    /// `mode: userspace` / `--proxy-mode userspace`: services are relayed in user space.
    pub userspace: bool,
    /// The conntrack table size and timeouts to hold (`conntrack`, `--conntrack-*`).
    pub conntrack: ConntrackSettings,
    /// The agent's OOM score adjustment (`oomScoreAdj`, kube-proxy's -999 by default).
    pub oom_score_adj: i32,
    /// Feature gates.
    pub feature_gates: FeatureGates,
    /// How to log.
    pub logging: Logging,
    /// To log at startup.
    pub warnings: Vec<String>,
}

/// How to log (`-v`, `--logging-format`, or the file's `logging`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Logging {
    /// klog's verbosity: 0-2 info, 3-4 debug, 5 and above trace.
    pub verbosity: u32,
    /// JSON lines instead of text.
    pub json: bool,
}

/// Inputs from the environment, injectable for tests.
#[derive(Debug, Clone, Default)]
pub struct Env {
    /// The machine's hostname (kube-proxy's default node name).
    pub(crate) hostname: String,
    /// KUBERNETES_SERVICE_HOST is set: running in a pod, the in-cluster configuration exists.
    pub(crate) in_cluster: bool,
}

impl Env {
    /// This machine's values.
    pub fn current() -> Env {
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Env {
            hostname,
            in_cluster: std::env::var_os("KUBERNETES_SERVICE_HOST").is_some_and(|v| !v.is_empty()),
        }
    }
}

/// Combines defaults, the file (if `flags.config`) and the flags (which win).
pub fn resolve(flags: &Flags, env: &Env) -> Result<Resolved, ConfigError> {
    let file = match &flags.config {
        Some(p) => load(p)?,
        None => FileConfig::default(),
    };
    let r = resolve_with(flags, file, env)?;
    if let SourceSpec::Kube(nftkube_source::KubeOptions {
        kubeconfig: Some(path),
        ..
    }) = &r.source
    {
        kube::config::Kubeconfig::read_from(path)
            .map_err(|e| ConfigError(format!("kubeconfig {}: {e}", path.display())))?;
    }
    Ok(r)
}

/// [`resolve`] with the file already parsed.
pub fn resolve_with(flags: &Flags, file: FileConfig, env: &Env) -> Result<Resolved, ConfigError> {
    let mut warnings = file.warnings.clone();
    let flags = &applicable_flags(flags, &mut warnings);
    check_proxy_mode(flags, &mut warnings)?;
    let (source, node_name) = source_and_node(flags, &file, env)?;
    let kube = matches!(source, SourceSpec::Kube(_));
    let cluster_cidrs = cluster_cidrs(flags, &file)?;
    let detect_local = detect_local(flags, &file, kube)?;
    if detect_local == DetectLocal::ClusterCidr && cluster_cidrs.is_empty() {
        warnings.push(
            "no clusterCIDR: pods cannot be told from other clients, so ClusterIP traffic is never masqueraded and \
             externalTrafficPolicy Local sends pods to local endpoints only (kube-proxy's no-op local-traffic detector)"
                .into(),
        );
    }
    let masquerade_bit = masquerade_bit(flags, &file)?;
    let (sync_period, min_sync_period) = sync_periods(flags, &file, &mut warnings)?;
    let admin = admin_options(flags, &file)?;
    let nodeport = match (&flags.nodeport_addresses, &file.node_port_addresses) {
        (Some(spec), _) => spec.clone(),
        (None, Some(list)) => NodePortSpec::from_items(list.iter().map(String::as_str))
            .map_err(|e| ConfigError(format!("nodePortAddresses: {e}")))?,
        (None, None) => NodePortSpec::default(),
    };
    let bind_address = bind_address(flags, &file)?;
    let gates = flags.feature_gates.as_ref().or(file.feature_gates.as_ref());
    Ok(Resolved {
        source,
        node_name,
        cluster_cidrs,
        detect_local,
        masquerade_all: flags
            .masquerade_all
            .or(file.masquerade_all)
            .unwrap_or(false),
        masquerade_bit,
        sync_period,
        min_sync_period,
        admin,
        nodeport,
        bind_address,
        userspace: mode(flags, &file) == "userspace",
        conntrack: conntrack(&flags.conntrack, &file.conntrack)?,
        oom_score_adj: oom_score_adj(flags, &file)?,
        feature_gates: resolve_gates(gates.unwrap_or(&Default::default()), &mut warnings),
        logging: logging(flags, &file)?,
        warnings,
    })
}

/// The flags that apply: beside `--config`, only those the file has no field for (kube-proxy's rule), each
/// flag the file overrules warned about; and a warning for each kube-proxy flag without effect here.
fn applicable_flags(flags: &Flags, warnings: &mut Vec<String>) -> Flags {
    let applicable = if flags.config.is_some() {
        let (kept, overruled) = flags.under_config_file();
        warnings.extend(overruled.into_iter().map(|name| {
            format!("{name} is ignored: with --config the file's value applies, as in kube-proxy")
        }));
        kept
    } else {
        flags.clone()
    };
    warnings.extend(
        flags
            .without_effect
            .iter()
            .map(|name| format!("{name} has no effect in nftkube (ignored)")),
    );
    applicable
}

/// The proxy mode asked for: the flag, else the file's `mode` ("" when neither).
fn mode(flags: &Flags, file: &FileConfig) -> String {
    flags
        .proxy_mode
        .clone()
        .filter(|m| !m.is_empty())
        .or(file.mode.clone())
        .unwrap_or_default()
}

/// kube-proxy's `conntrack` settings: given values, else its defaults; an explicit 0 leaves the kernel's value.
fn conntrack(
    flags: &ConntrackFlags,
    file: &ConntrackFlags,
) -> Result<ConntrackSettings, ConfigError> {
    let d = ConntrackSettings::default();
    let count = |name: &str, flag: Option<i32>, file: Option<i32>, default: u32| match flag.or(file)
    {
        Some(n) => u32::try_from(n)
            .map_err(|_| ConfigError(format!("conntrack {name} {n} must not be negative"))),
        None => Ok(default),
    };
    Ok(ConntrackSettings {
        max_per_core: count(
            "maxPerCore",
            flags.max_per_core,
            file.max_per_core,
            d.max_per_core,
        )?,
        min: count("min", flags.min, file.min, d.min)?,
        tcp_established_timeout: flags
            .tcp_established_timeout
            .or(file.tcp_established_timeout)
            .or(d.tcp_established_timeout),
        tcp_close_wait_timeout: flags
            .tcp_close_wait_timeout
            .or(file.tcp_close_wait_timeout)
            .or(d.tcp_close_wait_timeout),
        tcp_be_liberal: flags
            .tcp_be_liberal
            .or(file.tcp_be_liberal)
            .unwrap_or(false),
        udp_timeout: flags.udp_timeout.or(file.udp_timeout),
        udp_stream_timeout: flags.udp_stream_timeout.or(file.udp_stream_timeout),
    })
}

/// `oomScoreAdj`: -1000..=1000, kube-proxy's -999 by default.
fn oom_score_adj(flags: &Flags, file: &FileConfig) -> Result<i32, ConfigError> {
    let v = flags
        .oom_score_adj
        .map(i64::from)
        .or(file.oom_score_adj)
        .unwrap_or(-999);
    if !(-1000..=1000).contains(&v) {
        return err(format!("oomScoreAdj {v} is out of range (-1000-1000)"));
    }
    Ok(v as i32)
}

/// `-v` and `--logging-format` (text or json), else the file's `logging`.
fn logging(flags: &Flags, file: &FileConfig) -> Result<Logging, ConfigError> {
    let verbosity = match flags.verbosity {
        Some(v) => v,
        None => match file.verbosity {
            Some(v) => u32::try_from(v)
                .map_err(|_| ConfigError(format!("logging.verbosity {v} is out of range")))?,
            None => 0,
        },
    };
    let format = flags
        .logging_format
        .clone()
        .or(file.logging_format.clone())
        .unwrap_or_else(|| "text".into());
    let json = match format.as_str() {
        "text" => false,
        "json" => true,
        other => return err(format!("logging format {other:?} is not text or json")),
    };
    Ok(Logging { verbosity, json })
}

/// `--proxy-mode`: nftables or userspace; iptables and ipvs are accepted with a warning.
fn check_proxy_mode(flags: &Flags, warnings: &mut Vec<String>) -> Result<(), ConfigError> {
    match flags.proxy_mode.as_deref().filter(|m| !m.is_empty()) {
        None | Some("nftables" | "userspace") => Ok(()),
        Some(mode @ ("iptables" | "ipvs")) => {
            warnings.push(format!(
                "--proxy-mode {mode}: nftkube always programs nf_tables"
            ));
            Ok(())
        }
        Some(other) => err(format!(
            "--proxy-mode {other:?} is not a Linux proxy mode (iptables, ipvs, nftables, userspace)"
        )),
    }
}

/// Where Services come from, and this node's name (which the API source watches its Node by).
fn source_and_node(
    flags: &Flags,
    file: &FileConfig,
    env: &Env,
) -> Result<(SourceSpec, String), ConfigError> {
    let master = checked_master(flags)?;
    let kubeconfig = flags.kubeconfig.clone().or(file.kubeconfig.clone());
    let source = match &flags.manifests {
        Some(_) if flags.kubeconfig.is_some() || master.is_some() => {
            return err("--manifests cannot be combined with --kubeconfig or --master")
        }
        Some(dir) => SourceSpec::Manifests(dir.clone()),
        None if kubeconfig.is_some() || master.is_some() || env.in_cluster => {
            SourceSpec::Kube(nftkube_source::KubeOptions {
                kubeconfig,
                master,
                node_name: String::new(),
            })
        }
        None => {
            return err(
                "no source of Services: give --manifests DIR, --kubeconfig FILE or --master URL \
                 (or clientConnection.kubeconfig in --config), or run in a pod for the in-cluster configuration",
            )
        }
    };
    let node_name = node_name(flags, file, env, matches!(source, SourceSpec::Kube(_)))?;
    let source = match source {
        SourceSpec::Kube(k) => SourceSpec::Kube(nftkube_source::KubeOptions {
            node_name: node_name.clone(),
            ..k
        }),
        m => m,
    };
    Ok((source, node_name))
}

/// `--master`, when given: an http(s) URL with a host.
fn checked_master(flags: &Flags) -> Result<Option<String>, ConfigError> {
    let master = flags.master.clone().filter(|m| !m.is_empty());
    if let Some(m) = &master {
        let uri: http::Uri = m
            .parse()
            .map_err(|e| ConfigError(format!("--master {m:?}: {e}")))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return err(format!("--master {m:?}: want http(s)://HOST[:PORT]"));
        }
    }
    Ok(master)
}

/// kube-proxy's rule (the override, else the hostname), lower-cased; with manifests the override alone (no
/// node-local semantics unless asked for).
fn node_name(
    flags: &Flags,
    file: &FileConfig,
    env: &Env,
    kube: bool,
) -> Result<String, ConfigError> {
    let name = flags
        .hostname_override
        .clone()
        .or(file.hostname_override.clone())
        .map(|s| s.trim().to_lowercase())
        .filter(|s| !s.is_empty())
        .or_else(|| kube.then(|| env.hostname.trim().to_lowercase()))
        .unwrap_or_default();
    if kube && name.is_empty() {
        return err("cannot tell this node's name: give --hostname-override");
    }
    Ok(name)
}

fn cluster_cidrs(flags: &Flags, file: &FileConfig) -> Result<Vec<Cidr>, ConfigError> {
    match (&flags.cluster_cidr, &file.cluster_cidr) {
        (Some(c), _) => {
            check_families("--cluster-cidr", c)?;
            Ok(c.clone())
        }
        (None, Some(s)) => parse_cluster_cidrs("clusterCIDR", s),
        (None, None) => Ok(Vec::new()),
    }
}

/// The flag if given, else the file's value, trimmed ("" when neither).
fn flag_or_file(flag: &Option<String>, file: &Option<String>) -> String {
    flag.clone()
        .or(file.clone())
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn detect_local(flags: &Flags, file: &FileConfig, kube: bool) -> Result<DetectLocal, ConfigError> {
    let detect_local = DetectLocal::parse(
        &flag_or_file(&flags.detect_local_mode, &file.detect_local_mode),
        &flag_or_file(
            &flags.pod_interface_name_prefix,
            &file.interface_name_prefix,
        ),
        &flag_or_file(&flags.pod_bridge_interface, &file.bridge_interface),
    )
    .map_err(|e| ConfigError(e.to_string()))?;
    if detect_local == DetectLocal::NodeCidr && !kube {
        return err(
            "detectLocalMode NodeCIDR needs the Kubernetes API source (this node's podCIDRs)",
        );
    }
    Ok(detect_local)
}

fn masquerade_bit(flags: &Flags, file: &FileConfig) -> Result<u32, ConfigError> {
    let bit = match (flags.masquerade_bit, file.masquerade_bit) {
        (Some(b), _) => b as i64,
        (None, Some(b)) => b,
        (None, None) => 14,
    };
    if !(0..=31).contains(&bit) {
        return err(format!("masqueradeBit {bit} is out of range (0-31)"));
    }
    Ok(bit as u32)
}

/// syncPeriod (30 s by default, never 0) and minSyncPeriod (1 s by default, at most syncPeriod). As in
/// kube-proxy, the `--ipvs-*` period flags apply in ipvs mode and the others in every other mode.
fn sync_periods(
    flags: &Flags,
    file: &FileConfig,
    warnings: &mut Vec<String>,
) -> Result<(Duration, Duration), ConfigError> {
    let ipvs = flags.proxy_mode.as_deref() == Some("ipvs");
    let pairs = [
        (
            "--sync-period",
            flags.sync_period,
            "--ipvs-sync-period",
            flags.ipvs_sync_period,
        ),
        (
            "--min-sync-period",
            flags.min_sync_period,
            "--ipvs-min-sync-period",
            flags.ipvs_min_sync_period,
        ),
    ];
    let mut applied = [None, None];
    for (slot, (plain, plain_v, ipvs_name, ipvs_v)) in applied.iter_mut().zip(pairs) {
        let (used, unused, unused_name) = if ipvs {
            (ipvs_v, plain_v, plain)
        } else {
            (plain_v, ipvs_v, ipvs_name)
        };
        if unused.is_some() {
            let mode = if ipvs { "ipvs" } else { "not ipvs" };
            warnings.push(format!(
                "{unused_name} is ignored: the proxy mode is {mode}"
            ));
        }
        *slot = used;
    }
    let sync_period = applied[0]
        .or(file.sync_period)
        .unwrap_or(Duration::from_secs(30));
    let min_sync_period = applied[1]
        .or(file.min_sync_period)
        .unwrap_or(Duration::from_secs(1));
    if sync_period.is_zero() {
        return err("syncPeriod must be greater than 0");
    }
    if min_sync_period > sync_period {
        return err(format!(
            "minSyncPeriod ({min_sync_period:?}) must not exceed syncPeriod ({sync_period:?})"
        ));
    }
    Ok((sync_period, min_sync_period))
}

/// Admin addresses, with kube-proxy's defaults: `/healthz` on every address (0.0.0.0:10256, `[::]:10256` when
/// bindAddress is IPv6), since cloud load balancers probe it from outside; `/metrics` on loopback
/// (127.0.0.1:10249, `[::1]`). A field left empty in the file (kubeadm writes `healthzBindAddress: ""`) takes
/// the default too; an empty flag turns the server off.
///
/// The deprecated `--healthz-port` and `--metrics-port` act as in kube-proxy: 0 turns the server off;
/// another port applies only to a bind address flag given without one (the defaults have theirs).
fn admin_options(flags: &Flags, file: &FileConfig) -> Result<AdminOptions, ConfigError> {
    let (any, loopback) = admin_defaults(flags, file)?;
    let addr = |what: &str,
                field: &str,
                (flag, port): (&Option<String>, Option<u16>),
                file: &Option<String>,
                default: SocketAddr|
     -> Result<Option<SocketAddr>, ConfigError> {
        let file = file.as_deref().filter(|f| !f.trim().is_empty());
        let default_port = port.unwrap_or(default.port());
        match (flag, file) {
            _ if port == Some(0) => Ok(None),
            (Some(f), _) if f.trim().is_empty() => Ok(None),
            (Some(f), _) => parse_bind_address(&format!("--{what}"), f, default_port).map(Some),
            (None, Some(f)) => parse_bind_address(field, f, default.port()).map(Some),
            (None, None) => Ok(Some(default)),
        }
    };
    Ok(AdminOptions {
        healthz: addr(
            "healthz-bind-address",
            "healthzBindAddress",
            (&flags.healthz_bind_address, flags.healthz_port),
            &file.healthz_bind_address,
            SocketAddr::new(any, DEFAULT_HEALTHZ_PORT),
        )?,
        metrics: addr(
            "metrics-bind-address",
            "metricsBindAddress",
            (&flags.metrics_bind_address, flags.metrics_port),
            &file.metrics_bind_address,
            SocketAddr::new(loopback, DEFAULT_METRICS_PORT),
        )?,
        bind_address_hard_fail: flags
            .bind_address_hard_fail
            .or(file.bind_address_hard_fail)
            .unwrap_or(false),
    })
}

/// The unspecified and the loopback address of bindAddress's family (IPv4 when it is not set), as
/// kube-proxy's defaulting picks them.
fn admin_defaults(flags: &Flags, file: &FileConfig) -> Result<(IpAddr, IpAddr), ConfigError> {
    let bind_v6 = bind_address(flags, file)?.is_some_and(|ip| ip.is_ipv6());
    Ok(if bind_v6 {
        (Ipv6Addr::UNSPECIFIED.into(), Ipv6Addr::LOCALHOST.into())
    } else {
        (Ipv4Addr::UNSPECIFIED.into(), Ipv4Addr::LOCALHOST.into())
    })
}

/// `--bind-address` (else the file's `bindAddress`), when set.
fn bind_address(flags: &Flags, file: &FileConfig) -> Result<Option<IpAddr>, ConfigError> {
    flags
        .bind_address
        .as_deref()
        .or(file.bind_address.as_deref())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<IpAddr>()
                .map_err(|_| ConfigError(format!("bindAddress {s:?} is not an IP address")))
        })
        .transpose()
}

/// A healthz / metrics bind address: `IP:PORT`, `[IPv6]:PORT`, or an IP (the default port).
pub fn parse_bind_address(
    what: &str,
    s: &str,
    default_port: u16,
) -> Result<SocketAddr, ConfigError> {
    let t = s.trim();
    if let Ok(a) = t.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = t
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        return Ok(SocketAddr::new(ip, default_port));
    }
    err(format!(
        "{what} {s:?} is not IP:PORT (for example 127.0.0.1:{default_port})"
    ))
}

/// A comma-separated list of CIDRs, at most one per family (kube-proxy's clusterCIDR rule).
pub fn parse_cluster_cidrs(what: &str, s: &str) -> Result<Vec<Cidr>, ConfigError> {
    let cidrs = nftkube_model::parse_cidrs(s).map_err(|e| ConfigError(format!("{what}: {e}")))?;
    check_families(what, &cidrs)?;
    Ok(cidrs)
}

fn check_families(what: &str, cidrs: &[Cidr]) -> Result<(), ConfigError> {
    if cidrs.len() > 2 || (cidrs.len() == 2 && cidrs[0].family() == cidrs[1].family()) {
        let list: Vec<String> = cidrs.iter().map(|c| c.to_string()).collect();
        return err(format!(
            "{what} {}: at most one CIDR per IP family (a dual-stack pair)",
            list.join(",")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse;
    use std::path::Path;

    const KUBEADM: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

    fn env() -> Env {
        Env {
            hostname: "Node-A".into(),
            in_cluster: false,
        }
    }

    #[test]
    fn kubeadms_default_file_loads_without_warnings() {
        let f = parse(KUBEADM).unwrap();
        assert!(f.warnings.is_empty(), "{:?}", f.warnings);
        assert_eq!(
            f.kubeconfig.as_deref(),
            Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        let r = resolve_with(&Flags::default(), f, &env()).unwrap();
        assert_eq!(
            r.source,
            SourceSpec::Kube(nftkube_source::KubeOptions {
                kubeconfig: Some("/var/lib/kube-proxy/kubeconfig.conf".into()),
                master: None,
                node_name: "node-a".into(),
            })
        );
        assert_eq!(r.node_name, "node-a");
        assert_eq!(r.cluster_cidrs[0].to_string(), "10.244.0.0/16");
        assert_eq!(r.masquerade_bit, 14);
        assert_eq!(r.sync_period, Duration::from_secs(30));
        assert_eq!(r.min_sync_period, Duration::ZERO, "0s is an explicit 0");
        // kubeadm's `healthzBindAddress: ""` is kube-proxy's default: every address, for load balancers.
        assert_eq!(r.admin.healthz, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(r.admin.metrics, Some("127.0.0.1:10249".parse().unwrap()));
        assert!(!r.admin.bind_address_hard_fail);
    }

    #[test]
    fn honoured_fields_and_flag_precedence() {
        let text = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
hostnameOverride: from-file
clusterCIDR: "10.244.0.0/16,fd00:244::/48"
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: "[::1]:9999"
bindAddressHardFail: true
nftables:
  masqueradeAll: true
  masqueradeBit: 5
  syncPeriod: 1m
  minSyncPeriod: 500ms
iptables:
  masqueradeBit: 7
nodePortAddresses: ["primary", "192.168.0.0/16"]
detectLocalMode: ClusterCIDR
"#;
        let f = parse(text).unwrap();
        assert_eq!(
            f.warnings,
            ["iptables.masqueradeBit is ignored: with mode \"nftables\" the nftables section applies"]
        );
        let flags = Flags {
            manifests: Some("/m".into()),
            ..Flags::default()
        };
        let r = resolve_with(&flags, f.clone(), &env()).unwrap();
        assert_eq!(r.source, SourceSpec::Manifests("/m".into()));
        assert_eq!(r.node_name, "from-file");
        assert_eq!(r.cluster_cidrs.len(), 2);
        assert!(r.masquerade_all);
        assert_eq!(r.masquerade_bit, 5);
        assert_eq!(r.sync_period, Duration::from_secs(60));
        assert_eq!(r.min_sync_period, Duration::from_millis(500));
        assert_eq!(r.admin.healthz, Some("0.0.0.0:10256".parse().unwrap()));
        assert_eq!(r.admin.metrics, Some("[::1]:9999".parse().unwrap()));
        assert!(r.admin.bind_address_hard_fail);
        assert_eq!(r.nodeport.cidrs().len(), 1, "{}", r.nodeport);
        assert!(r.nodeport.wants_primary(), "{}", r.nodeport);
        // Without --config, flags win over defaults (and would over a file): here the parsed file stands
        // in for one, as the unit under test does not read it.
        let flags = Flags {
            manifests: Some("/m".into()),
            hostname_override: Some("Flag-Node".into()),
            cluster_cidr: Some(vec!["10.0.0.0/8".parse().unwrap()]),
            masquerade_all: Some(false),
            masquerade_bit: Some(3),
            sync_period: Some(Duration::from_secs(10)),
            min_sync_period: Some(Duration::from_secs(2)),
            healthz_bind_address: Some(String::new()),
            metrics_bind_address: Some("127.0.0.1:1234".into()),
            bind_address_hard_fail: Some(false),
            nodeport_addresses: Some("0.0.0.0/0".parse().unwrap()),
            ..Flags::default()
        };
        let r = resolve_with(&flags, f, &env()).unwrap();
        assert_eq!(r.node_name, "flag-node");
        assert_eq!(r.cluster_cidrs.len(), 1);
        assert!(!r.masquerade_all);
        assert_eq!(r.masquerade_bit, 3);
        assert_eq!(r.sync_period, Duration::from_secs(10));
        assert_eq!(r.min_sync_period, Duration::from_secs(2));
        assert_eq!(r.admin.healthz, None, "an empty flag turns healthz off");
        assert_eq!(r.admin.metrics, Some("127.0.0.1:1234".parse().unwrap()));
        assert!(!r.admin.bind_address_hard_fail);
        assert_eq!(r.nodeport.to_string(), "0.0.0.0/0", "the flag wins");
    }

    #[test]
    fn with_a_config_file_the_file_wins_but_for_logging_and_the_node_name() {
        let text = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
hostnameOverride: from-file
metricsBindAddress: 127.0.0.1:2000
oomScoreAdj: -500
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 2h
logging:
  format: json
  verbosity: 2
featureGates:
  AllowServiceExternalIPs: false
"#;
        let flags = Flags {
            config: Some("/c".into()),
            manifests: Some("/m".into()),
            hostname_override: Some(" Flag-Node ".into()),
            metrics_bind_address: Some("127.0.0.1:3000".into()),
            masquerade_all: Some(true),
            verbosity: Some(5),
            conntrack: ConntrackFlags {
                tcp_be_liberal: Some(true),
                ..ConntrackFlags::default()
            },
            without_effect: vec!["--profiling".into()],
            ..Flags::default()
        };
        let r = resolve_with(&flags, parse(text).unwrap(), &env()).unwrap();
        assert_eq!(r.node_name, "flag-node", "--hostname-override wins");
        assert_eq!(
            r.logging,
            Logging {
                verbosity: 5,
                json: true
            },
            "-v wins, the file's format stays"
        );
        assert_eq!(r.admin.metrics, Some("127.0.0.1:2000".parse().unwrap()));
        assert!(!r.masquerade_all);
        assert_eq!(r.conntrack.max_per_core, 0);
        assert_eq!(
            r.conntrack.tcp_established_timeout,
            Some(Duration::from_secs(7200))
        );
        assert_eq!(
            r.conntrack.tcp_close_wait_timeout,
            Some(Duration::from_secs(3600))
        );
        assert!(!r.conntrack.tcp_be_liberal);
        assert_eq!(r.oom_score_adj, -500);
        assert!(!r.feature_gates.allow_service_external_ips);
        for want in [
            "--metrics-bind-address is ignored: with --config the file's value applies",
            "--masquerade-all is ignored",
            "--conntrack-tcp-be-liberal is ignored",
            "--profiling has no effect in nftkube",
        ] {
            assert!(
                r.warnings.iter().any(|w| w.contains(want)),
                "{want}: {:?}",
                r.warnings
            );
        }
    }

    #[test]
    fn without_a_file_kube_proxys_flags_and_defaults_apply() {
        let flags = Flags {
            manifests: Some("/m".into()),
            ..Flags::default()
        };
        let r = resolve_with(&flags, FileConfig::default(), &env()).unwrap();
        assert_eq!(r.conntrack, ConntrackSettings::default());
        assert_eq!(r.oom_score_adj, -999);
        assert_eq!(r.logging, Logging::default());
        assert_eq!(r.feature_gates, FeatureGates::default());
        // The deprecated port flags: 0 turns a server off; a port fills in an address given without one.
        let ports = Flags {
            healthz_port: Some(0),
            metrics_bind_address: Some("127.0.0.2".into()),
            metrics_port: Some(3333),
            ..flags.clone()
        };
        let r = resolve_with(&ports, FileConfig::default(), &env()).unwrap();
        assert_eq!(r.admin.healthz, None);
        assert_eq!(r.admin.metrics, Some("127.0.0.2:3333".parse().unwrap()));
        // In ipvs mode the --ipvs-* periods apply, and the others are ignored with a warning.
        let ipvs = Flags {
            proxy_mode: Some("ipvs".into()),
            sync_period: Some(Duration::from_secs(7)),
            ipvs_sync_period: Some(Duration::from_secs(9)),
            ..flags.clone()
        };
        let r = resolve_with(&ipvs, FileConfig::default(), &env()).unwrap();
        assert_eq!(r.sync_period, Duration::from_secs(9));
        assert!(r
            .warnings
            .iter()
            .any(|w| w == "--sync-period is ignored: the proxy mode is ipvs"));
        for (bad, want) in [
            (
                Flags {
                    oom_score_adj: Some(1001),
                    ..flags.clone()
                },
                "oomScoreAdj 1001 is out of range",
            ),
            (
                Flags {
                    logging_format: Some("xml".into()),
                    ..flags.clone()
                },
                "logging format \"xml\"",
            ),
            (
                Flags {
                    conntrack: ConntrackFlags {
                        min: Some(-1),
                        ..ConntrackFlags::default()
                    },
                    ..flags.clone()
                },
                "conntrack min -1 must not be negative",
            ),
        ] {
            let e = resolve_with(&bad, FileConfig::default(), &env())
                .unwrap_err()
                .0;
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn invalid_values_are_errors() {
        let base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let flags = Flags {
            manifests: Some("/m".into()),
            ..Flags::default()
        };
        for (extra, want) in [
            ("clusterCIDR: 10.244.0.0/33", "clusterCIDR"),
            (
                "clusterCIDR: 10.0.0.0/8,10.1.0.0/16",
                "at most one CIDR per IP family",
            ),
            (
                "iptables:\n  masqueradeBit: 32",
                "masqueradeBit 32 is out of range",
            ),
            ("iptables:\n  syncPeriod: 30", "want a duration string"),
            ("iptables:\n  syncPeriod: 30 seconds", "invalid duration"),
            (
                "iptables:\n  syncPeriod: 1s\n  minSyncPeriod: 5s",
                "must not exceed syncPeriod",
            ),
            ("healthzBindAddress: localhost:x", "healthzBindAddress"),
            ("metricsBindAddress: 1.2.3.4:99999", "metricsBindAddress"),
            (
                "detectLocalMode: BridgeInterface",
                "needs detectLocal.bridgeInterface",
            ),
            ("detectLocalMode: Sideways", "is not one of"),
            (
                "detectLocalMode: NodeCIDR",
                "needs the Kubernetes API source",
            ),
            (
                "nodePortAddresses: [\"eth0\"]",
                "\"eth0\" is neither a CIDR",
            ),
            ("nodePortAddresses: [\"10.0.0.0/99\"]", "nodePortAddresses"),
            ("mode: kernelspace", "not a Linux proxy mode"),
            ("bindAddressHardFail: yes please", "want true or false"),
            ("bindAddress: nope", "bindAddress"),
        ] {
            let r =
                parse(&format!("{base}{extra}\n")).and_then(|f| resolve_with(&flags, f, &env()));
            let e = r.expect_err(extra).0;
            assert!(e.contains(want), "{extra}: got {e}, want {want}");
        }
        for (text, want) in [
            ("kind: KubeProxyConfiguration\n", "apiVersion is missing"),
            (
                "apiVersion: kubeproxy.config.k8s.io/v1beta9\nkind: KubeProxyConfiguration\n",
                "not supported",
            ),
            (
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: Pod\n",
                "kind",
            ),
            ("[1, 2", "not valid YAML"),
        ] {
            assert!(parse(text).unwrap_err().0.contains(want), "{text}");
        }
        for m in ["127.0.0.1:6443", "ftp://x", "http://"] {
            let f = Flags {
                master: Some(m.into()),
                ..Flags::default()
            };
            let e = resolve_with(&f, FileConfig::default(), &env()).unwrap_err();
            assert!(e.0.contains("--master"), "{m}: {e}");
        }
        let f = Flags {
            kubeconfig: Some("/nonexistent/kubeconfig".into()),
            ..Flags::default()
        };
        let e = resolve(&f, &env()).unwrap_err();
        assert!(e.0.contains("kubeconfig /nonexistent/kubeconfig"), "{e}");
        // No source at all, or two of them.
        let e = resolve_with(&Flags::default(), FileConfig::default(), &env()).unwrap_err();
        assert!(e.0.contains("no source of Services"), "{e}");
        let both = Flags {
            manifests: Some("/m".into()),
            master: Some("http://127.0.0.1:1".into()),
            ..Flags::default()
        };
        assert!(resolve_with(&both, FileConfig::default(), &env()).is_err());
        // In a pod, the in-cluster configuration is the default source.
        let r = resolve_with(
            &Flags::default(),
            FileConfig::default(),
            &Env {
                hostname: "n".into(),
                in_cluster: true,
            },
        )
        .unwrap();
        assert!(
            matches!(r.source, SourceSpec::Kube(ref k) if k.kubeconfig.is_none() && k.master.is_none())
        );
    }

    #[test]
    fn detect_local_modes_and_node_port_keywords() {
        let base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let flags = Flags {
            manifests: Some("/m".into()),
            ..Flags::default()
        };
        let f = parse(&format!(
            "{base}detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: veth\n"
        ))
        .unwrap();
        let r = resolve_with(&flags, f.clone(), &env()).unwrap();
        assert_eq!(
            r.detect_local,
            DetectLocal::InterfaceNamePrefix("veth".into())
        );
        let over = Flags {
            detect_local_mode: Some("BridgeInterface".into()),
            pod_bridge_interface: Some("cbr0".into()),
            ..flags.clone()
        };
        let r = resolve_with(&over, f, &env()).unwrap();
        assert_eq!(r.detect_local, DetectLocal::BridgeInterface("cbr0".into()));
        let f = parse(&format!("{base}nodePortAddresses: [all, localhost]\n")).unwrap();
        let r = resolve_with(&flags, f, &env()).unwrap();
        // localhost: loopback CIDRs, served by the relay.
        assert_eq!(r.nodeport.cidrs().len(), 4);
        assert_eq!(
            nftkube_relay::loopback_families(&r.nodeport.cidrs()),
            (true, true)
        );
    }

    #[test]
    fn node_port_keywords_combine_with_cidrs_and_the_bind_address_is_kept() {
        let base = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let flags = Flags {
            manifests: Some("/m".into()),
            ..Flags::default()
        };
        let f = parse(&format!(
            "{base}bindAddress: 192.168.200.1\nnodePortAddresses: [primary, 10.0.0.0/8, localhost]\n"
        ))
        .unwrap();
        let r = resolve_with(&flags, f.clone(), &env()).unwrap();
        assert_eq!(r.nodeport.to_string(), "primary,10.0.0.0/8,localhost");
        assert!(
            r.warnings.iter().all(|w| !w.contains("nodePortAddresses")),
            "{:?}",
            r.warnings
        );
        assert_eq!(r.bind_address, Some("192.168.200.1".parse().unwrap()));
        // The flags win, and are read the same way.
        let over = Flags {
            nodeport_addresses: Some("all,primary".parse().unwrap()),
            bind_address: Some("fd00:200::1".into()),
            ..flags.clone()
        };
        let r = resolve_with(&over, f, &env()).unwrap();
        assert_eq!(r.nodeport.to_string(), "all,primary");
        assert_eq!(r.bind_address, Some("fd00:200::1".parse().unwrap()));
        // Nothing given: primary.
        let r = resolve_with(&flags, parse(base).unwrap(), &env()).unwrap();
        assert_eq!(r.nodeport, NodePortSpec::default());
        assert_eq!(r.bind_address, None);
    }

    /// deploy/nftkube.yaml's ConfigMap: the config loads without a warning, names the kubeconfig, and the
    /// kubeconfig is one the client reads.
    #[test]
    fn the_deploy_config_map_is_valid() {
        let text = include_str!("../../../deploy/nftkube.yaml");
        let cm: serde_json::Value = text
            .split("\n---")
            .map(|d| nftkube_yaml::parse_document(d).unwrap())
            .find(|d| d["kind"] == "ConfigMap")
            .unwrap();
        let f = parse(cm["data"]["config.conf"].as_str().unwrap()).unwrap();
        assert!(f.warnings.is_empty(), "{:?}", f.warnings);
        let r = resolve_with(&Flags::default(), f, &env()).unwrap();
        assert!(matches!(r.source, SourceSpec::Kube(ref k)
            if k.kubeconfig.as_deref() == Some(Path::new("/var/lib/nftkube/kubeconfig.conf"))));
        let kc =
            kube::config::Kubeconfig::from_yaml(cm["data"]["kubeconfig.conf"].as_str().unwrap())
                .unwrap();
        assert_eq!(kc.current_context.as_deref(), Some("default"));
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(
            user.token_file.as_deref(),
            Some("/var/run/secrets/kubernetes.io/serviceaccount/token")
        );
        // The privileged init container runs --init-only with the agent's own configuration; the agent
        // keeps CAP_NET_ADMIN alone.
        let ds: serde_json::Value = text
            .split("\n---")
            .map(|d| nftkube_yaml::parse_document(d).unwrap())
            .find(|d| d["kind"] == "DaemonSet")
            .unwrap();
        let pod = &ds["spec"]["template"]["spec"];
        let init = &pod["initContainers"][0];
        let agent = &pod["containers"][0];
        assert!(init["command"]
            .as_array()
            .unwrap()
            .contains(&"--init-only".into()));
        assert_eq!(init["securityContext"]["privileged"], true);
        for c in [init, agent] {
            assert!(c["command"]
                .as_array()
                .unwrap()
                .contains(&"--config=/var/lib/nftkube/config.conf".into()));
        }
        assert_eq!(
            agent["securityContext"]["capabilities"]["add"],
            serde_json::json!(["NET_ADMIN"])
        );
    }

    #[test]
    fn bind_addresses_and_ipv6_defaults() {
        assert_eq!(
            parse_bind_address("x", "0.0.0.0", 10256).unwrap(),
            "0.0.0.0:10256".parse().unwrap()
        );
        assert_eq!(
            parse_bind_address("x", "[::]:1", 10256).unwrap(),
            "[::]:1".parse().unwrap()
        );
        let flags = Flags {
            manifests: Some("/m".into()),
            bind_address: Some("::".into()),
            ..Flags::default()
        };
        let r = resolve_with(&flags, FileConfig::default(), &env()).unwrap();
        assert_eq!(r.admin.metrics, Some("[::1]:10249".parse().unwrap()));
        assert_eq!(r.admin.healthz, Some("[::]:10256".parse().unwrap()));
    }
}
