//! The command line and the configuration file together, as `main` resolves them, with kube-proxy's
//! precedence: beside --config the file wins (but for logging and --hostname-override); without it, the
//! flags the operator gave override the defaults.

use super::{Cli, Command, Given, Startup};
use clap::{CommandFactory, FromArgMatches};

/// The command line as `main` sees it: flags given vs. defaults, and the resulting options.
fn proxy_startup(args: &[&str]) -> Result<(nftkube::agent::ProxyOptions, Startup), String> {
    let mut argv = vec!["nftkube", "proxy"];
    argv.extend_from_slice(args);
    let m = Cli::command()
        .try_get_matches_from(argv)
        .map_err(|e| e.to_string())?;
    let cli = Cli::from_arg_matches(&m).unwrap();
    let Command::Proxy(p) = cli.command else {
        unreachable!()
    };
    let sub = m.subcommand_matches("proxy").unwrap();
    let given = |id: &str| sub.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    let cli_given = Given {
        given: &given,
        verbosity: cli.verbosity,
        without_effect: super::kube_proxy::given_without_effect(sub),
    };
    p.options(&cli_given).map_err(|e| e.to_string())
}

fn proxy(args: &[&str]) -> Result<nftkube::agent::ProxyOptions, String> {
    proxy_startup(args).map(|(o, _)| o)
}

#[test]
fn beside_config_the_file_wins_and_without_it_the_flags_do() {
    let dir = std::env::temp_dir().join(format!("nftkube-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.yaml");
    std::fs::write(
        &file,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         clusterCIDR: 10.244.0.0/16\nmetricsBindAddress: 127.0.0.1:20249\n\
         iptables:\n  masqueradeAll: true\n  masqueradeBit: 4\n  syncPeriod: 45s\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let o = proxy(&["--config", f, "--manifests", "/m"]).unwrap();
    assert!(o.render.masquerade_all);
    assert_eq!(o.render.masquerade_bit, 1 << 4);
    assert_eq!(o.sync_period, std::time::Duration::from_secs(45));
    assert_eq!(o.render.cluster_cidrs[0].to_string(), "10.244.0.0/16");
    let admin = o.admin.clone().unwrap();
    assert_eq!(admin.metrics, Some("127.0.0.1:20249".parse().unwrap()));
    assert_eq!(admin.healthz, Some("0.0.0.0:10256".parse().unwrap()));
    let overruled = [
        "--masquerade-all=false",
        "--iptables-masquerade-bit",
        "6",
        "--sync-period",
        "10s",
        "--cluster-cidr",
        "10.0.0.0/8",
        "--metrics-bind-address",
        "127.0.0.1:30249",
    ];
    let mut args = vec!["--config", f, "--manifests", "/m", "-v=4"];
    args.extend(overruled);
    let (o, startup) = proxy_startup(&args).unwrap();
    assert!(o.render.masquerade_all);
    assert_eq!(o.render.masquerade_bit, 1 << 4);
    assert_eq!(o.sync_period, std::time::Duration::from_secs(45));
    assert_eq!(o.render.cluster_cidrs[0].to_string(), "10.244.0.0/16");
    assert_eq!(
        o.admin.unwrap().metrics,
        Some("127.0.0.1:20249".parse().unwrap())
    );
    assert_eq!(startup.logging.verbosity, 4, "-v wins over the file");
    for flag in [
        "--masquerade-all",
        "--masquerade-bit",
        "--sync-period",
        "--cluster-cidr",
    ] {
        let w = format!("{flag} is ignored: with --config");
        assert!(
            startup.warnings.iter().any(|x| x.starts_with(&w)),
            "{w}: {:?}",
            startup.warnings
        );
    }
    // Without --config the same flags apply.
    let mut args = vec!["--manifests", "/m"];
    args.extend(overruled);
    let o = proxy(&args).unwrap();
    assert!(!o.render.masquerade_all);
    assert_eq!(o.render.masquerade_bit, 1 << 6);
    assert_eq!(o.sync_period, std::time::Duration::from_secs(10));
    assert_eq!(o.render.cluster_cidrs[0].to_string(), "10.0.0.0/8");
    assert_eq!(
        o.admin.unwrap().metrics,
        Some("127.0.0.1:30249".parse().unwrap())
    );
    // Seconds still work (the flags used to take them), and --masquerade-all alone means true.
    let o = proxy(&[
        "--manifests",
        "/m",
        "--min-sync-period",
        "0.2",
        "--masquerade-all",
    ])
    .unwrap();
    assert_eq!(o.min_sync_period, std::time::Duration::from_millis(200));
    assert!(o.render.masquerade_all);
    // Invalid values are errors (main exits 64 with them).
    assert!(proxy(&["--manifests", "/m", "--masquerade-bit", "40"]).is_err());
    assert!(proxy(&["--manifests", "/m", "--sync-period", "soon"]).is_err());
    let e = proxy(&["--config", f, "--manifests", "/m", "--drop-bit", "4"]).unwrap_err();
    assert!(e.contains("--masquerade-bit and --drop-bit"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--nodeport-addresses` as given: keywords and CIDRs together, read as the config file's field is.
fn nodeport_flag(value: &str) -> Result<nftkube::model::NodePortSpec, String> {
    let flag = format!("--nodeport-addresses={value}");
    let m = Cli::command()
        .try_get_matches_from(["nftkube", "proxy", "--manifests", "/m", &flag])
        .map_err(|e| e.to_string())?;
    let Command::Proxy(p) = Cli::from_arg_matches(&m).unwrap().command else {
        unreachable!()
    };
    Ok(p.render.nodeport_addresses)
}

#[test]
fn nodeport_addresses_take_keywords_and_cidrs_together() {
    let spec = nodeport_flag("primary,10.0.0.0/8,localhost").unwrap();
    assert!(spec.wants_primary());
    assert_eq!(spec.to_string(), "primary,10.0.0.0/8,localhost");
    assert_eq!(nodeport_flag("").unwrap(), Default::default(), "primary");
    let e = nodeport_flag("primary,eth0").unwrap_err();
    assert!(e.contains("\"eth0\" is neither a CIDR"), "{e}");
    assert!(e.contains("--nodeport-addresses"), "{e}");
    assert!(nodeport_flag("10.0.0.0/33").is_err());
    // The whole resolution accepts them too.
    proxy(&[
        "--manifests",
        "/m",
        "--nodeport-addresses=primary,localhost",
    ])
    .unwrap();
}

/// A kube-proxy DaemonSet's command line: every flag of kube-proxy 1.37 parses; those without effect are
/// warned about by name, the others act.
#[test]
fn kube_proxys_whole_command_line_is_accepted() {
    let (o, startup) = proxy_startup(&[
        "--manifests",
        "/m",
        "-v=2",
        "--v=3",
        "--logging-format=json",
        "--conntrack-max-per-core=0",
        "--conntrack-min",
        "100",
        "--conntrack-tcp-timeout-established=2h",
        "--conntrack-tcp-timeout-close-wait",
        "30m",
        "--conntrack-tcp-be-liberal",
        "--conntrack-udp-timeout=40s",
        "--conntrack-udp-timeout-stream=3m",
        "--oom-score-adj=-500",
        "--feature-gates=AllowServiceExternalIPs=false,KubeProxyNFTablesLocalhostNodePorts=true",
        "--healthz-port=0",
        "--metrics-port",
        "10249",
        "--ipvs-sync-period=5s",
        "--ipvs-min-sync-period=1s",
        "--init-only=false",
        "--cleanup=false",
        "--write-config-to=/tmp/x",
        "--kube-api-content-type",
        "application/json",
        "--kube-api-burst=20",
        "--kube-api-qps=10",
        "--config-sync-period=15m",
        "--profiling",
        "--show-hidden-metrics-for-version=1.36",
        "--iptables-localhost-nodeports=false",
        "--ipvs-scheduler=rr",
        "--ipvs-exclude-cidrs=10.0.0.0/8",
        "--ipvs-strict-arp",
        "--ipvs-tcp-timeout=0s",
        "--ipvs-tcpfin-timeout=0s",
        "--ipvs-udp-timeout=0s",
        "--vmodule=x=2",
        "--log-flush-frequency=5s",
        "--log-json-split-stream",
        "--log-json-info-buffer-size=0",
        "--log-text-split-stream=false",
        "--log-text-info-buffer-size=0",
        "--proxy-mode=nftables",
        "--bind-address=0.0.0.0",
        "--bind-address-hard-fail=false",
        "--detect-local-mode=ClusterCIDR",
        "--cluster-cidr=10.244.0.0/16",
        "--nodeport-addresses=primary",
        "--masquerade-all=false",
        "--iptables-masquerade-bit=14",
        "--iptables-sync-period=30s",
        "--iptables-min-sync-period=1s",
        "--hostname-override=node-1",
    ])
    .unwrap();
    assert_eq!(
        startup.logging,
        nftkube::config::Logging {
            verbosity: 3,
            json: true
        }
    );
    let c = &startup.conntrack;
    assert_eq!((c.max_per_core, c.min), (0, 100));
    assert_eq!(
        c.tcp_established_timeout,
        Some(std::time::Duration::from_secs(7200))
    );
    assert_eq!(
        c.tcp_close_wait_timeout,
        Some(std::time::Duration::from_secs(1800))
    );
    assert!(c.tcp_be_liberal);
    assert_eq!(c.udp_timeout, Some(std::time::Duration::from_secs(40)));
    assert_eq!(
        c.udp_stream_timeout,
        Some(std::time::Duration::from_secs(180))
    );
    assert_eq!(startup.oom_score_adj, -500);
    assert!(!o.render.serve_external_ips);
    assert_eq!(
        o.admin.as_ref().unwrap().healthz,
        None,
        "--healthz-port=0 turns it off"
    );
    for flag in [
        "--write-config-to",
        "--kube-api-content-type",
        "--kube-api-burst",
        "--kube-api-qps",
        "--config-sync-period",
        "--profiling",
        "--show-hidden-metrics-for-version",
        "--iptables-localhost-nodeports",
        "--ipvs-scheduler",
        "--ipvs-exclude-cidrs",
        "--ipvs-strict-arp",
        "--ipvs-tcp-timeout",
        "--ipvs-tcpfin-timeout",
        "--ipvs-udp-timeout",
        "--vmodule",
        "--log-flush-frequency",
        "--log-json-split-stream",
        "--log-json-info-buffer-size",
        "--log-text-split-stream",
        "--log-text-info-buffer-size",
        "--ipvs-sync-period",
        "--ipvs-min-sync-period",
    ] {
        let n = startup
            .warnings
            .iter()
            .filter(|w| w.starts_with(&format!("{flag} ")))
            .count();
        assert_eq!(n, 1, "{flag}: {:?}", startup.warnings);
    }
    // Values that are wrong are still errors, naming the flag.
    let e = proxy(&["--manifests", "/m", "--feature-gates=Nope"]).unwrap_err();
    assert!(e.contains("--feature-gates"), "{e}");
    let e = proxy(&["--manifests", "/m", "--oom-score-adj=-2000"]).unwrap_err();
    assert!(e.contains("oomScoreAdj -2000"), "{e}");
}
