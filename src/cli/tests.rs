//! The command line and the configuration file together, as `main` resolves them: flags the operator gave
//! override the file; defaults do not.

use super::{Cli, Command};
use clap::{CommandFactory, FromArgMatches};

/// The command line as `main` sees it: flags given vs. defaults, and the resulting options.
fn proxy(args: &[&str]) -> Result<nftkube::agent::ProxyOptions, String> {
    let mut argv = vec!["nftkube", "proxy"];
    argv.extend_from_slice(args);
    let m = Cli::command()
        .try_get_matches_from(argv)
        .map_err(|e| e.to_string())?;
    let Command::Proxy(p) = Cli::from_arg_matches(&m).unwrap().command else {
        unreachable!()
    };
    let sub = m.subcommand_matches("proxy").unwrap();
    let given = |id: &str| sub.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    p.options(&given).map_err(|e| e.to_string())
}

#[test]
fn flags_override_the_file_and_defaults_do_not() {
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
    let o = proxy(&[
        "--config",
        f,
        "--manifests",
        "/m",
        "--masquerade-all=false",
        "--iptables-masquerade-bit",
        "6",
        "--sync-period",
        "10s",
        "--cluster-cidr",
        "10.0.0.0/8",
        "--metrics-bind-address",
        "127.0.0.1:30249",
    ])
    .unwrap();
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
