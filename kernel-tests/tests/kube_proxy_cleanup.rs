//! `nftkube cleanup --kube-proxy` on a node where kube-proxy ran, while nftkube serves traffic: kube-proxy's
//! state is programmed with the real tools as a user's node would have it (its nftables-mode tables with
//! `nft -f`, its iptables-mode rules with iptables-nft-restore, beside kubelet's chains and the operator's own
//! rules), and after the cleanup only kube-proxy's objects are gone, by `nft -j list ruleset`.

use kernel_tests::*;
use nftkube_sandbox::netns::NetNs;
use serde_json::Value;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

/// kube-proxy's nftables mode, shaped like its tables: base chains at dstnat-10 and friends, a services
/// map, a service chain and an endpoint chain. Its one service (10.96.99.99) is not the one the client uses,
/// so the table cannot change what the client sees.
const KUBE_PROXY_NFT: &str = r#"
table ip kube-proxy {
    comment "rules for kube-proxy"
    map service-ips {
        type ipv4_addr . inet_proto . inet_service : verdict
        comment "ClusterIP, ExternalIP and LoadBalancer IP traffic"
    }
    chain endpoint-ABCDEF12-default/other/tcp/p80__10.244.9.9/80 {
        meta l4proto tcp dnat to 10.244.9.9:80
    }
    chain service-ABCDEF12-default/other/tcp/p80 {
        ip daddr 10.96.99.99 tcp dport 80 goto endpoint-ABCDEF12-default/other/tcp/p80__10.244.9.9/80
    }
    chain services {
        ip daddr . meta l4proto . th dport vmap @service-ips
    }
    chain nat-prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        jump services
    }
    chain filter-prerouting {
        type filter hook prerouting priority dstnat - 10; policy accept;
    }
    chain nat-output {
        type nat hook output priority -100; policy accept;
        jump services
    }
    chain nat-postrouting {
        type nat hook postrouting priority srcnat; policy accept;
    }
}
add element ip kube-proxy service-ips { 10.96.99.99 . tcp . 80 : goto service-ABCDEF12-default/other/tcp/p80 }
table ip6 kube-proxy {
    chain nat-prerouting {
        type nat hook prerouting priority dstnat; policy accept;
    }
}
"#;

/// kube-proxy's iptables mode as it writes it (jumps with its comments, a service and endpoint chain pair),
/// kubelet's KUBE-FIREWALL (which `kube-proxy --cleanup` leaves), and the operator's own chain and rules.
const KUBE_PROXY_IPTABLES: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]
:KUBE-SEP-ABCDEFGHIJKLMNOP - [0:0]
:OPERATOR-NAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 192.0.2.0/24 -j OPERATOR-NAT
-A OPERATOR-NAT -j RETURN
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE
-A KUBE-SERVICES -d 10.96.99.99/32 -p tcp -m comment --comment "default/other cluster IP" -m tcp --dport 80 -j KUBE-SVC-ABCDEFGHIJKLMNOP
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-ABCDEFGHIJKLMNOP -m comment --comment "default/other -> 10.244.9.9:80" -j KUBE-SEP-ABCDEFGHIJKLMNOP
-A KUBE-SEP-ABCDEFGHIJKLMNOP -s 10.244.9.9/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-ABCDEFGHIJKLMNOP -p tcp -m tcp -j DNAT --to-destination 10.244.9.9:80
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:OPERATOR-IN - [0:0]
-A INPUT -j KUBE-FIREWALL
-A INPUT -p tcp --dport 2222 -j OPERATOR-IN
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FIREWALL -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A OPERATOR-IN -j ACCEPT
COMMIT
"#;

/// The IPv6 half: one jump and its chain, to show the second family's transaction.
const KUBE_PROXY_IP6TABLES: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
COMMIT
"#;

/// What `nft -j list ruleset` shows, flattened: tables, chains and rules (as `family table chain → target`
/// for jumps, `family table chain: exprs` otherwise).
#[derive(Debug, Default)]
struct Listing {
    tables: BTreeSet<String>,
    chains: BTreeSet<String>,
    jumps: BTreeSet<String>,
    rules: Vec<String>,
}

fn listing(ns: &NetNs) -> Listing {
    let out = ns
        .command("nft")
        .args(["-j", "list", "ruleset"])
        .output()
        .expect("running nft");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: Value = serde_json::from_slice(&out.stdout).expect("nft -j output");
    let mut l = Listing::default();
    for o in json["nftables"].as_array().expect("nftables array") {
        let s = |v: &Value, k: &str| v[k].as_str().unwrap_or("").to_string();
        if let Some(t) = o.get("table") {
            l.tables
                .insert(format!("{} {}", s(t, "family"), s(t, "name")));
        } else if let Some(c) = o.get("chain") {
            let name = [s(c, "family"), s(c, "table"), s(c, "name")].join(" ");
            l.chains.insert(name);
        } else if let Some(r) = o.get("rule") {
            let at = [s(r, "family"), s(r, "table"), s(r, "chain")].join(" ");
            for e in r["expr"].as_array().into_iter().flatten() {
                if let Some(target) = e["jump"]["target"].as_str() {
                    l.jumps.insert(format!("{at} → {target}"));
                }
            }
            l.rules.push(format!("{at}: {}", r["expr"]));
        }
    }
    l
}

fn run_cleanup(ns: &NetNs) -> String {
    let out = ns
        .command(nftkube_bin())
        .args(["cleanup", "--kube-proxy"])
        .output()
        .expect("running nftkube");
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "cleanup --kube-proxy failed:\n{text}");
    text
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn kube_proxys_leftovers_go_under_traffic_and_nothing_else_does() {
    let sb = sandbox("nk-kpclean", 3);
    let node = sb.node();
    let m = Manifests::examples();
    // Without the listing invariant: iptables-nft's tables (xtables matches) never reload with nft.
    let mut agent = Agent::spawn_unlisted({
        let mut cmd = node.command(nftkube_bin());
        cmd.args(proxy_args(&m.dir, &[]));
        cmd
    });
    agent.wait_syncs(1, Duration::from_secs(15));
    nft_script(node, KUBE_PROXY_NFT);
    feed(
        node,
        "iptables-nft-restore",
        &["--noflush"],
        KUBE_PROXY_IPTABLES,
    );
    feed(
        node,
        "ip6tables-nft-restore",
        &["--noflush"],
        KUBE_PROXY_IP6TABLES,
    );
    let before = listing(node);
    assert!(
        before.jumps.contains("ip nat PREROUTING → KUBE-SERVICES"),
        "{before:?}"
    );

    let echo: SocketAddr = "10.96.0.10:80".parse().unwrap();
    assert!(
        served(sb.client(), echo, Duration::from_secs(5)),
        "nftkube does not serve {echo}"
    );
    let client = ContinuousClient::start(sb.client(), echo);
    std::thread::sleep(Duration::from_millis(500));
    let first = run_cleanup(node);
    std::thread::sleep(Duration::from_millis(500));
    let second = run_cleanup(node);
    std::thread::sleep(Duration::from_millis(500));
    client.assert_never_failed(50, "cleanup --kube-proxy");

    let after = listing(node);
    // kube-proxy's nftables tables are gone; nftkube's and the iptables-nft tables stay.
    assert!(
        !after.tables.iter().any(|t| t.ends_with(" kube-proxy")),
        "{after:?}"
    );
    for t in [
        "ip nftkube",
        "ip6 nftkube",
        "ip nat",
        "ip filter",
        "ip6 nat",
    ] {
        assert!(after.tables.contains(t), "{t} is gone:\n{after:?}");
    }
    // Exactly kube-proxy's chains went (its service, endpoint and top chains), as `kube-proxy --cleanup`.
    let gone: BTreeSet<String> = before.chains.difference(&after.chains).cloned().collect();
    let kube_proxys = set(&[
        "ip kube-proxy endpoint-ABCDEF12-default/other/tcp/p80__10.244.9.9/80",
        "ip kube-proxy service-ABCDEF12-default/other/tcp/p80",
        "ip kube-proxy services",
        "ip kube-proxy nat-prerouting",
        "ip kube-proxy filter-prerouting",
        "ip kube-proxy nat-output",
        "ip kube-proxy nat-postrouting",
        "ip6 kube-proxy nat-prerouting",
        "ip nat KUBE-SERVICES",
        "ip nat KUBE-NODEPORTS",
        "ip nat KUBE-POSTROUTING",
        "ip nat KUBE-SVC-ABCDEFGHIJKLMNOP",
        "ip nat KUBE-SEP-ABCDEFGHIJKLMNOP",
        "ip filter KUBE-FORWARD",
        "ip filter KUBE-SERVICES",
        "ip6 nat KUBE-SERVICES",
    ]);
    assert_eq!(gone, kube_proxys, "first run:\n{first}");
    // What kube-proxy's own cleanup leaves stays: kubelet's firewall, KUBE-MARK-MASQ; and the operator's.
    for c in [
        "ip filter KUBE-FIREWALL",
        "ip nat KUBE-MARK-MASQ",
        "ip nat OPERATOR-NAT",
        "ip filter OPERATOR-IN",
    ] {
        assert!(after.chains.contains(c), "{c} is gone");
    }
    // Exactly kube-proxy's jump rules went from the built-in chains.
    let builtin = |l: &Listing| -> BTreeSet<String> {
        const HOOKS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
        l.jumps
            .iter()
            .filter(|j| HOOKS.contains(&j.split(' ').nth(2).unwrap_or("")))
            .cloned()
            .collect()
    };
    let jumps_gone: BTreeSet<String> = builtin(&before)
        .difference(&builtin(&after))
        .cloned()
        .collect();
    assert_eq!(
        jumps_gone,
        set(&[
            "ip nat PREROUTING → KUBE-SERVICES",
            "ip nat OUTPUT → KUBE-SERVICES",
            "ip nat POSTROUTING → KUBE-POSTROUTING",
            "ip filter OUTPUT → KUBE-SERVICES",
            "ip filter FORWARD → KUBE-FORWARD",
            "ip filter FORWARD → KUBE-SERVICES",
            "ip6 nat PREROUTING → KUBE-SERVICES",
        ]),
        "first run:\n{first}"
    );
    for j in [
        "ip filter INPUT → KUBE-FIREWALL",
        "ip filter OUTPUT → KUBE-FIREWALL",
        "ip filter INPUT → OPERATOR-IN",
        "ip nat POSTROUTING → OPERATOR-NAT",
    ] {
        assert!(after.jumps.contains(j), "{j} is gone");
    }
    // The operator's ACCEPT and the kubelet's DROP keep their content.
    assert!(after
        .rules
        .iter()
        .any(|r| r.starts_with("ip filter OPERATOR-IN:")));
    assert!(after
        .rules
        .iter()
        .any(|r| r.starts_with("ip filter KUBE-FIREWALL:")));
    // The report says what went and what was left; the second run finds nothing more to remove.
    assert!(
        first.contains("ip: removed 1 table(s) [kube-proxy], 7 chain(s)"),
        "{first}"
    );
    assert!(
        first.contains("nat/KUBE-MARK-MASQ") && first.contains("filter/KUBE-FIREWALL"),
        "{first}"
    );
    assert!(
        first.contains("ip6: removed 1 table(s) [kube-proxy], 1 chain(s)"),
        "{first}"
    );
    for family in ["ip", "ip6"] {
        let line =
            format!("{family}: removed 0 table(s) [none], 0 chain(s) [none], 0 rule(s) [none]");
        assert!(
            second.contains(&line),
            "second run removed something:\n{second}"
        );
    }
    assert_eq!(
        listing(node).rules,
        after.rules,
        "the second run changed the ruleset"
    );
    let log = agent.log();
    assert!(
        agent.stop() && !log.contains(" ERROR "),
        "the agent did not stop cleanly:\n{log}"
    );
}
