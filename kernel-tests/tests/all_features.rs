//! Every feature at once (kernel-tests/manifests/all_features.yaml, next to the examples): ClusterIP, NodePort,
//! LoadBalancer with source ranges, external IPs, both Local traffic policies, ClientIP affinity on every
//! frontend, dual-stack, SCTP (programmed only), headless and ExternalName (skipped). Real TCP and UDP from a
//! pod and from outside through each frontend, and the listing invariant after every sync (`Agent` checks it).
//!
//! The example a new feature copies: add its Service to the manifest, its frontends to the tables below.

use kernel_tests::sandbox::{self, tcp_requests, udp_requests};
use kernel_tests::*;
use nftkube::nft::ir::Family;
use nftkube_sandbox::netns::NetNs;
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

const MANIFEST: &str = include_str!("../manifests/all_features.yaml");
const SYNC: Duration = Duration::from_secs(15);
const T: Duration = Duration::from_secs(2);
/// New connections per client, frontend and protocol: with three endpoints and no affinity, ten landing on one
/// endpoint has probability 3·(1/3)^10 ≈ 5e-5.
const TRIES: usize = 10;

/// One frontend: where TCP and UDP requests go, which backends may answer, and whether they see the client's
/// own address or the node's (masqueraded).
struct Frontend {
    name: &'static str,
    tcp: SocketAddr,
    udp: SocketAddr,
    endpoints: BTreeSet<usize>,
    source: Source,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Kept,
    Masqueraded,
}
use Source::*;

fn frontend(
    name: &'static str,
    ip: IpAddr,
    ports: (u16, u16),
    endpoints: &[usize],
    source: Source,
) -> Frontend {
    Frontend {
        name,
        tcp: SocketAddr::new(ip, ports.0),
        udp: SocketAddr::new(ip, ports.1),
        endpoints: endpoints.iter().copied().collect(),
        source,
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// `web`'s frontends, reached from a pod: every endpoint; NodePort traffic is always masqueraded.
fn web_from_a_pod() -> Vec<Frontend> {
    let all = [1, 2, 3];
    let node = sandbox::node_ip_v4().into();
    vec![
        frontend("ClusterIP", ip("10.96.1.10"), (80, 53), &all, Kept),
        frontend("ClusterIP v6", ip("fd00:96::1:10"), (80, 53), &all, Kept),
        frontend("NodePort", node, (30200, 30201), &all, Masqueraded),
        frontend(
            "external IP",
            ip("192.168.251.10"),
            (80, 53),
            &all,
            Masqueraded,
        ),
    ]
}

/// `web`'s frontends, reached from outside (the LoadBalancer IP allows only this client), and `local`'s, whose
/// externalTrafficPolicy Local keeps outside traffic on this node's endpoints (pods 1 and 3) and the client's
/// address.
fn from_outside() -> Vec<Frontend> {
    let (all, local) = ([1, 2, 3], [1, 3]);
    let (node, node6) = (sandbox::node_ip_v4().into(), sandbox::node_ip_v6().into());
    vec![
        frontend("ClusterIP", ip("10.96.1.10"), (80, 53), &all, Masqueraded),
        frontend("NodePort", node, (30200, 30201), &all, Masqueraded),
        frontend("NodePort v6", node6, (30200, 30201), &all, Masqueraded),
        frontend(
            "external IP",
            ip("192.168.251.10"),
            (80, 53),
            &all,
            Masqueraded,
        ),
        frontend(
            "LoadBalancer IP",
            ip("192.168.251.20"),
            (80, 53),
            &all,
            Masqueraded,
        ),
        frontend("ETP Local NodePort", node, (30210, 30211), &local, Kept),
        frontend(
            "ETP Local external IP",
            ip("192.168.251.30"),
            (80, 53),
            &local,
            Kept,
        ),
    ]
}

/// `TRIES` new TCP connections and `TRIES` new UDP flows from `ns` (whose addresses are `client`) through `f`:
/// each protocol sticks to one endpoint (ClientIP affinity), one of `f`'s, which sees the client's address or
/// not as `f` says.
fn assert_sticks(ns: &NetNs, client: &BTreeSet<IpAddr>, f: &Frontend) {
    let who = ns.name();
    for (proto, answers) in [
        ("TCP", tcp_requests(ns, f.tcp, TRIES, T)),
        ("UDP", udp_requests(ns, f.udp, TRIES, T)),
    ] {
        let (pods, peers) = tally(&answers);
        assert!(
            pods.len() == 1 && pods.is_subset(&f.endpoints),
            "{proto} from {who} through the {}: answered by {pods:?}; want one of {:?} (affinity)",
            f.name,
            f.endpoints
        );
        assert_eq!(
            peers.is_subset(client),
            f.source == Kept,
            "{proto} from {who} through the {}: the backend saw {peers:?}",
            f.name
        );
    }
}

fn addresses_of_pod0() -> BTreeSet<IpAddr> {
    [sandbox::pod_ip_v4(0).into(), sandbox::pod_ip_v6(0).into()].into()
}

fn addresses_outside() -> BTreeSet<IpAddr> {
    [sandbox::ext_ip_v4().into(), sandbox::ext_ip_v6().into()].into()
}

#[test]
fn every_feature_at_once_carries_traffic_and_lists_after_every_sync() {
    let sb = sandbox("nk-all", 3);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 251, 0), 24);
    let m = Manifests::examples();
    m.write("all_features.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || served(sb.client(), addr("10.96.1.10", 80), T))
        .unwrap_or_else(|_| panic!("web never served; log:\n{}", agent.log()));

    // Every frontend, TCP and UDP, from a pod (its own address kept for the ClusterIPs only) and from outside.
    for f in web_from_a_pod() {
        assert_sticks(sb.client(), &addresses_of_pod0(), &f);
    }
    for f in from_outside() {
        assert_sticks(sb.ext(), &addresses_outside(), &f);
    }
    assert_policies_and_ranges(&sb);
    assert_programmed_but_not_sent(&sb, &agent);

    // An endpoint leaves (a partial sync): nobody reaches it any more, affinity or not.
    let syncs = agent.log().matches("sync complete").count();
    let line = "- {addresses: [\"10.244.3.2\"], nodeName: node-1}\n";
    m.write("all_features.yaml", &MANIFEST.replacen(line, "", 1));
    agent.wait_syncs(syncs + 1, SYNC);
    let node = sandbox::node_ip_v4().into();
    let f = frontend("NodePort", node, (30200, 30201), &[1, 2], Masqueraded);
    wait_until(SYNC, || {
        pods(&tcp_requests(sb.ext(), f.tcp, TRIES, T)).is_subset(&f.endpoints)
    })
    .unwrap_or_else(|_| panic!("pod 3 still reached; log:\n{}", agent.log()));
    assert_sticks(sb.ext(), &addresses_outside(), &f);

    // Everything goes: the tables hold the examples only, and still list.
    let syncs = agent.log().matches("sync complete").count();
    m.remove("all_features.yaml");
    agent.wait_syncs(syncs + 1, SYNC);
    wait_until(SYNC, || !served(sb.client(), addr("10.96.1.10", 80), T))
        .unwrap_or_else(|_| panic!("web still served; log:\n{}", agent.log()));
}

/// internalTrafficPolicy Local from a pod: this node's endpoints only. loadBalancerSourceRanges: a pod is
/// not in them, so the LoadBalancer IP does not serve it, while the same service's external IP does.
fn assert_policies_and_ranges(sb: &sandbox::Sandbox) {
    let itp = frontend(
        "ITP Local ClusterIP",
        ip("10.96.1.20"),
        (80, 53),
        &[1, 3],
        Kept,
    );
    assert_sticks(sb.client(), &addresses_of_pod0(), &itp);
    assert!(!served(
        sb.client(),
        addr("192.168.251.20", 80),
        Duration::from_millis(700)
    ));
    assert!(served(sb.client(), addr("192.168.251.10", 80), T));
}

/// SCTP is programmed (this kernel has no SCTP sockets to send with); headless and ExternalName services are
/// skipped with a logged reason.
fn assert_programmed_but_not_sent(sb: &sandbox::Sandbox, agent: &Agent) {
    let text = nftkube::nft::text::render_table(&dump_table(sb.node(), Family::Ip).unwrap());
    for (what, needle) in [
        ("SCTP ClusterIP port", "sctp . 9999"),
        ("SCTP NodePort", "sctp . 30202"),
    ] {
        assert!(
            text.contains(needle),
            "{what} ({needle}) not programmed:\n{text}"
        );
    }
    let log = agent.log();
    for name in ["headless", "elsewhere"] {
        assert!(
            log.lines()
                .any(|l| l.contains("service not proxied") && l.contains(name)),
            "{name} not reported as skipped:\n{log}"
        );
    }
}
