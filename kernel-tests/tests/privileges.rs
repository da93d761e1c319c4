//! Least privilege, seen from outside: the real agent, started by root with every capability, keeps only
//! CAP_NET_ADMIN in every thread (and in its bounding set, with no_new_privs) while it syncs, repairs a
//! deleted table and cleans up stale conntrack entries; its healthCheckNodePort servers listen on the NodePort
//! addresses only, and follow them when they change.

use kernel_tests::sandbox::{self, parse_answer, tcp_request, udp_request_from, Sandbox};
use kernel_tests::*;
use nftkube::conntrack::wire::IPPROTO_UDP;
use nftkube::conntrack::{CtSocket, Entry};
use nftkube::nft::ir::Family;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

const ECHO_V4: &str = "10.96.0.10";
const SYNC: Duration = Duration::from_secs(20);
const T: Duration = Duration::from_secs(2);

/// linux/capability.h
const CAP_NET_ADMIN: u32 = 12;

/// The capability lines and NoNewPrivs of one `/proc/.../status` file.
fn privileges(status: &str) -> BTreeMap<&str, u64> {
    status
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| k.starts_with("Cap") || *k == "NoNewPrivs")
        .map(|(k, v)| {
            let v = v.trim();
            let n = if k == "NoNewPrivs" {
                v.parse().unwrap()
            } else {
                u64::from_str_radix(v, 16).unwrap()
            };
            (k, n)
        })
        .collect()
}

/// Asserts that the agent process and each of its threads hold exactly CAP_NET_ADMIN (effective,
/// permitted, bounding), nothing inheritable or ambient, and no_new_privs; returns the thread count.
fn assert_only_net_admin(agent: &Agent) -> usize {
    let pid = agent.pid().expect("the agent runs");
    let want = BTreeMap::from([
        ("CapInh", 0),
        ("CapPrm", 1 << CAP_NET_ADMIN),
        ("CapEff", 1 << CAP_NET_ADMIN),
        ("CapBnd", 1 << CAP_NET_ADMIN),
        ("CapAmb", 0),
        ("NoNewPrivs", 1),
    ]);
    let process = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert_eq!(privileges(&process), want, "the process:\n{process}");
    let mut threads = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path().join("status");
        // A thread that ended since the listing has no status left to check.
        let Ok(status) = std::fs::read_to_string(&path) else {
            continue;
        };
        assert_eq!(privileges(&status), want, "{}:\n{status}", path.display());
        threads += 1;
    }
    threads
}

/// Every conntrack entry of the node namespace, through our own ctnetlink dump.
fn node_entries(sb: &Sandbox) -> Vec<Entry> {
    sb.node()
        .run(|| CtSocket::open().unwrap().list_all().unwrap())
        .unwrap()
}

/// The client's UDP flow from `sport`, if the node has an entry for it.
fn udp_flow(sb: &Sandbox, sport: u16) -> Option<Entry> {
    let client: IpAddr = sandbox::pod_ip_v4(0).into();
    node_entries(sb)
        .into_iter()
        .find(|e| e.orig.proto == IPPROTO_UDP && e.orig.src == client && e.orig.sport == sport)
}

/// Which backend answered a UDP request to echo from the client's `sport`.
fn ask(sb: &Sandbox, sport: u16) -> usize {
    let a = udp_request_from(sb.client(), sport, addr(ECHO_V4, 53), T)
        .unwrap_or_else(|e| panic!("UDP from :{sport}: {e}"));
    parse_answer(&a).unwrap().0
}

/// `nft delete table ip nftkube` in the node namespace (without oracles: the same through our netlink).
fn delete_table(sb: &Sandbox) {
    if oracles() {
        let status = sb
            .node()
            .command("nft")
            .args(["delete", "table", "ip", "nftkube"])
            .status()
            .expect("running nft (apt-get install nftables)");
        assert!(status.success(), "nft delete table ip nftkube");
        return;
    }
    sb.node()
        .run(|| {
            let mut tx = Transaction::default();
            tx.push(Family::Ip, "nftkube", Op::DeleteTable);
            NftSocket::open().unwrap().commit(&tx).unwrap();
        })
        .unwrap();
}

fn echo_reachable(sb: &Sandbox) -> bool {
    tcp_request(sb.client(), addr(ECHO_V4, 80), Duration::from_millis(300)).is_ok()
}

#[test]
fn only_cap_net_admin_is_kept_in_every_thread_while_the_agent_syncs_repairs_and_cleans_up() {
    let sb = sandbox("nk-caps", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || echo_reachable(&sb)).expect("echo never became reachable");
    // The proxy loop, the nf_tables monitor and the admin servers at least.
    let threads = assert_only_net_admin(&agent);
    assert!(threads >= 3, "only {threads} threads");

    // A repair: the table deleted behind the agent's back comes back, and serves.
    let syncs = agent.log().matches("sync complete").count();
    delete_table(&sb);
    agent.wait_syncs(syncs + 1, SYNC);
    wait_until(SYNC, || {
        dump_table(sb.node(), Family::Ip).is_some() && echo_reachable(&sb)
    })
    .unwrap_or_else(|_| panic!("the table was not repaired; log:\n{}", agent.log()));
    assert!(agent.log().contains("repair=true"), "{}", agent.log());

    // A conntrack cleanup: the UDP flow pinned to a removed endpoint is deleted.
    let sport = 42200;
    let victim = ask(&sb, sport);
    assert!(udp_flow(&sb, sport).is_some(), "no conntrack entry");
    let cleanups = agent.log().matches("conntrack cleanup").count();
    m.write(
        "endpointslices.yaml",
        &without_endpoint(
            &m.read("endpointslices.yaml"),
            &sandbox::pod_ip_v4(victim).to_string(),
        ),
    );
    wait_until(SYNC, || udp_flow(&sb, sport).is_none())
        .unwrap_or_else(|_| panic!("the stale entry stayed; log:\n{}", agent.log()));
    // The walk logs its report after its deletes: the entry can be gone a moment before the line is out.
    wait_until(SYNC, || {
        agent.log().matches("conntrack cleanup").count() > cleanups
    })
    .unwrap_or_else(|_| panic!("no cleanup logged; log:\n{}", agent.log()));
    assert_ne!(ask(&sb, sport), victim);
    // The kernel features were probed (with CAP_SYS_ADMIN, before the drop), not given up on.
    assert!(
        agent.log().contains("conntrack: kernel features probed"),
        "{}",
        agent.log()
    );

    assert_only_net_admin(&agent);
}

/// The status of `GET /` on `to` from inside the node namespace; None when refused (or unanswered).
fn hc_status(sb: &Sandbox, to: SocketAddr) -> Option<u16> {
    sb.node()
        .run(move || nftkube::admin::http::get(to, "/", T))
        .unwrap()
        .ok()
        .map(|r| r.0)
}

#[test]
fn health_check_node_ports_listen_on_the_nodeport_addresses_and_follow_them() {
    let sb = sandbox("nk-hcaddr", 2);
    let m = Manifests::examples();
    let port = 32011;
    m.write("lb.yaml", &local_load_balancer(port, 30160));
    // Periodic checks every second, each a full sync that reads the kernel back (`--full-read-period 0`):
    // they pick up the node's address changes, and "sync complete" lines mark that one has run.
    let agent = Agent::start(
        sb.node(),
        &m.dir,
        &["--sync-period", "1s", "--full-read-period", "0"],
    );
    agent.wait_syncs(1, SYNC);

    // The NodePort addresses (default: those of the link with the default route, eth0) answer.
    let on_node = SocketAddr::new(sandbox::node_ip_v4().into(), port);
    wait_until(SYNC, || hc_status(&sb, on_node) == Some(200))
        .unwrap_or_else(|_| panic!("{on_node} never answered 200; log:\n{}", agent.log()));
    let on_node_v6 = SocketAddr::new(sandbox::node_ip_v6().into(), port);
    assert_eq!(hc_status(&sb, on_node_v6), Some(200));
    // Other local addresses of the node do not: a second address added on pod 1's link (not a NodePort
    // link), pod 1's gateway, loopback.
    let second: IpAddr = "10.250.0.1".parse().unwrap();
    let pod_link = sandbox::node_pod_ifname(1);
    sb.node()
        .run(move || nftkube_sandbox::netns::add_address(&pod_link, second, 32))
        .unwrap()
        .expect("adding a second address to the node");
    // Let a full sync see it (it must not be picked up).
    let syncs = agent.log().matches("sync complete").count();
    agent.wait_syncs(syncs + 2, SYNC);
    for ip in [
        second,
        sandbox::pod_gateway_v4(1).into(),
        "127.0.0.1".parse().unwrap(),
    ] {
        let other = SocketAddr::new(ip, port);
        assert_eq!(hc_status(&sb, other), None, "{other} answered");
    }

    // A new address on the NodePort link: after the next full sync the servers listen there too.
    let added: IpAddr = "192.168.200.77".parse().unwrap();
    sb.node()
        .run(move || nftkube_sandbox::netns::add_address(sandbox::NODE_UPLINK, added, 24))
        .unwrap()
        .expect("adding an address to the node's uplink");
    let on_added = SocketAddr::new(added, port);
    wait_until(SYNC, || hc_status(&sb, on_added) == Some(200))
        .unwrap_or_else(|_| panic!("{on_added} never answered; log:\n{}", agent.log()));
    assert_eq!(hc_status(&sb, on_node), Some(200));
    assert_eq!(
        hc_status(
            &sb,
            SocketAddr::new(sandbox::pod_gateway_v4(1).into(), port)
        ),
        None
    );
}
