//! kube-proxy's command line and configuration as a DaemonSet uses them: `--init-only` sets the conntrack
//! sysctls (in its own network namespace: the kernel keeps the table size to the host's), the agent after
//! it finds nothing left to write, a changed configuration file ends the agent as it ends kube-proxy, and
//! the file's logging settings give JSON lines.

use kernel_tests::*;
use nftkube::nft::ir::Family;
use nftkube_sandbox::netns::NetNs;
use std::path::Path;
use std::time::Duration;

const NETFILTER: &str = "/proc/sys/net/netfilter";

/// A `net.netfilter` sysctl as the namespace `ns` sees it.
fn sysctl_in(ns: &NetNs, name: &str) -> u64 {
    let path = Path::new(NETFILTER).join(name);
    ns.run(|| std::fs::read_to_string(&path))
        .expect("entering the namespace")
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

/// The table size kube-proxy's defaults ask for on this machine.
fn default_table_size() -> u64 {
    let cpus = nftkube::conntrack::sysctls::online_cpus(Path::new("/"));
    nftkube::conntrack::sysctls::table_size(&Default::default(), cpus).unwrap()
}

#[test]
fn init_only_sets_the_conntrack_sysctls_then_the_agent_finds_nothing_to_write() {
    let sb = sandbox("initonly", 1);
    let node = sb.node();
    let host_established =
        std::fs::read_to_string(format!("{NETFILTER}/nf_conntrack_tcp_timeout_established"))
            .unwrap();
    let stream_before = sysctl_in(node, "nf_conntrack_udp_timeout_stream");
    let examples = examples_dir();
    let examples = examples.to_str().unwrap();
    let out = nftkube_in(
        node,
        &[
            "proxy",
            "--init-only",
            "--manifests",
            examples,
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-be-liberal",
            "--conntrack-udp-timeout=45s",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // kube-proxy's defaults for what was not given; what was given; what is unset stays the kernel's.
    assert_eq!(
        sysctl_in(node, "nf_conntrack_tcp_timeout_established"),
        86_400
    );
    assert_eq!(sysctl_in(node, "nf_conntrack_tcp_timeout_close_wait"), 3600);
    assert_eq!(sysctl_in(node, "nf_conntrack_tcp_be_liberal"), 1);
    assert_eq!(sysctl_in(node, "nf_conntrack_udp_timeout"), 45);
    assert_eq!(
        sysctl_in(node, "nf_conntrack_udp_timeout_stream"),
        stream_before
    );
    // Nothing else: no table, and the host's own values untouched.
    for family in [Family::Ip, Family::Ip6] {
        assert!(
            dump_table(node, family).is_none(),
            "--init-only programmed {family:?}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(format!("{NETFILTER}/nf_conntrack_tcp_timeout_established"))
            .unwrap(),
        host_established
    );

    // The table size is the host's: from another namespace the kernel refuses it, and --init-only fails
    // naming it, unless it already holds kube-proxy's value.
    let out = nftkube_in(node, &["proxy", "--init-only", "--manifests", examples]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if sysctl_in(node, "nf_conntrack_max") == default_table_size() {
        assert!(out.status.success(), "{stderr}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("/proc/sys/net/netfilter/nf_conntrack_max cannot be set"),
            "{stderr}"
        );
    }

    // The agent after it, given the same settings, has nothing to write and warns about nothing.
    let mut agent = Agent::start(
        node,
        &examples_dir(),
        &[
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-be-liberal",
            "--conntrack-udp-timeout=45s",
        ],
    );
    agent.wait_syncs(1, Duration::from_secs(30));
    let log = agent.log();
    assert!(
        log.contains("nf_conntrack_tcp_timeout_established is 86400 already"),
        "{log}"
    );
    assert!(
        !log.contains("cannot be set") && !log.contains(" set to "),
        "{log}"
    );
    assert!(agent.stop(), "{}", agent.log());
}

#[test]
fn a_changed_config_file_ends_the_agent_and_json_logging_comes_from_it() {
    let sb = sandbox("cfgwatch", 1);
    let dir = std::env::temp_dir().join(format!("nftkube-cfgwatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.conf");
    let text = format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
         mode: nftables\nclusterCIDR: {}\nhealthzBindAddress: \"\"\nmetricsBindAddress: \"\"\n\
         nftables:\n  minSyncPeriod: 100ms\nconntrack:\n  maxPerCore: 0\n\
         logging:\n  format: json\n  verbosity: 4\n",
        sandbox::CLUSTER_CIDR_V4
    );
    std::fs::write(&config, &text).unwrap();
    let mut cmd = sb.node().command(nftkube_bin());
    cmd.arg("proxy")
        .arg("--config")
        .arg(&config)
        .arg("--manifests")
        .arg(examples_dir())
        .arg("--masquerade-all");
    let mut agent = Agent::spawn(cmd, sb.node());
    agent.wait_syncs(1, Duration::from_secs(30));

    // JSON lines, at debug (verbosity 4), with the flag the file overrules named.
    let log = agent.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.iter().any(|l| l["level"] == "DEBUG"), "{log}");
    assert!(
        lines.iter().any(|l| l["message"]
            .as_str()
            .is_some_and(|m| m.contains("--masquerade-all is ignored: with --config"))),
        "{log}"
    );

    // Rewriting the same content changes nothing; a new content ends the agent with an error, and its
    // rules stay in place for the restarted agent (as kube-proxy leaves its own).
    std::fs::write(&config, &text).unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(agent.running(), "{}", agent.log());
    std::fs::write(&config, text.replace("verbosity: 4", "verbosity: 2")).unwrap();
    let status = agent.wait_exit(Duration::from_secs(15));
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{}", agent.log());
    assert!(
        agent
            .log()
            .contains("content of the configuration file was updated"),
        "{}",
        agent.log()
    );
    assert!(dump_table(sb.node(), Family::Ip).is_some());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `nftkube proxy --cleanup`, as kube-proxy's: what every mode left (nftkube's tables and kube-proxy's),
/// and nothing else, then exit.
#[test]
fn proxy_cleanup_removes_every_proxys_tables_and_nothing_else() {
    let sb = sandbox("pcleanup", 1);
    let node = sb.node();
    let mut agent = Agent::start(node, &examples_dir(), &[]);
    agent.wait_syncs(1, Duration::from_secs(30));
    assert!(agent.stop());
    add_foreign_table(node, Family::Ip, "kube-proxy");
    add_foreign_table(node, Family::Ip, "someone-else");
    let examples = examples_dir();
    let out = nftkube_in(
        node,
        &[
            "proxy",
            "--cleanup",
            "--manifests",
            examples.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(table_names(node, Family::Ip), ["someone-else"]);
    assert!(dump_table(node, Family::Ip6).is_none());
}
