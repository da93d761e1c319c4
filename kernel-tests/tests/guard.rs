//! kubelet's guard semantics and ClusterIP hygiene: the drop mark, and unallocated service addresses.

use kernel_tests::sandbox::{self, tcp_request};
use kernel_tests::*;
use nftkube::nft::build::{Field, RuleBuilder};
use nftkube::nft::ir::{Chain, ChainType, CmpOp, Family, Hook};
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube_sandbox::netns::NetNs;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const SYNC: Duration = Duration::from_secs(15);
const SHORT: Duration = Duration::from_millis(600);

/// A table of the test's own (not nftkube's) that sets the drop mark on chosen traffic, the way kube-proxy's
/// or another component's rules would mark it.
fn mark_for_drop(node: &NetNs, prerouting_dport: u16, output_daddr: Ipv4Addr) {
    node.run(move || {
        let mut tx = Transaction::default();
        let t = "guard-test";
        tx.push(Family::Ip, t, Op::AddTable);
        for (name, hook) in [("pre", Hook::Prerouting), ("out", Hook::Output)] {
            tx.push(
                Family::Ip,
                t,
                Op::AddChain(Chain::base(name, ChainType::Filter, hook, -300)),
            );
        }
        let tcp = || RuleBuilder::new().cmp(Field::L4Proto, CmpOp::Eq, vec![6]);
        tx.push(
            Family::Ip,
            t,
            Op::AddRule {
                chain: "pre".into(),
                rule: tcp()
                    .cmp(
                        Field::ThDport,
                        CmpOp::Eq,
                        prerouting_dport.to_be_bytes().to_vec(),
                    )
                    .mark_or(0x8000)
                    .build(),
            },
        );
        tx.push(
            Family::Ip,
            t,
            Op::AddRule {
                chain: "out".into(),
                rule: tcp()
                    .cmp(Field::IpDaddr, CmpOp::Eq, output_daddr.octets().to_vec())
                    .mark_or(0x8000)
                    .build(),
            },
        );
        NftSocket::open().unwrap().commit(&tx).unwrap();
    })
    .unwrap();
}

#[test]
fn packets_carrying_the_drop_mark_are_dropped_on_input_forward_and_output() {
    let sb = sandbox("nk-drop", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    let stop = Arc::new(AtomicBool::new(false));
    let node_addr: IpAddr = sandbox::pod_gateway_v4(0).into();
    for port in [5555, 5556] {
        hello_listener(sb.node(), SocketAddr::new(node_addr, port), stop.clone());
    }
    // Before any mark: everything answers.
    let pod = |i: usize| SocketAddr::new(sandbox::pod_ip_v4(i).into(), BACKEND_TCP_PORT);
    assert!(tcp_request(sb.client(), SocketAddr::new(node_addr, 5555), SHORT).is_ok());
    assert!(tcp_request(sb.client(), pod(1), SHORT).is_ok());
    assert!(tcp_request(sb.node(), pod(2), SHORT).is_ok());

    // Mark: input to port 5555, and (forwarded) anything to port 8080, and output to pod 2.
    mark_for_drop(sb.node(), 5555, sandbox::pod_ip_v4(2));
    // Input: marked dropped, unmarked served.
    assert!(tcp_request(sb.client(), SocketAddr::new(node_addr, 5555), SHORT).is_err());
    assert!(tcp_request(sb.client(), SocketAddr::new(node_addr, 5556), SHORT).is_ok());
    // Output: the node's own connection to pod 2 is marked and dropped; to pod 3 it is not.
    assert!(tcp_request(sb.node(), pod(2), SHORT).is_err());
    assert!(tcp_request(sb.node(), pod(3), SHORT).is_ok());
    drop(agent);
    // Without nftkube's table the mark means nothing: proof that it is our rule that drops.
    assert!(nftkube_in(sb.node(), &["cleanup"]).status.success());
    assert!(tcp_request(sb.client(), SocketAddr::new(node_addr, 5555), SHORT).is_ok());
    assert!(tcp_request(sb.node(), pod(2), SHORT).is_ok());
    stop.store(true, Ordering::SeqCst);
}

#[test]
fn marked_forwarded_traffic_is_dropped() {
    let sb = sandbox("nk-dropf", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    let pod = |i: usize| SocketAddr::new(sandbox::pod_ip_v4(i).into(), BACKEND_TCP_PORT);
    assert!(tcp_request(sb.client(), pod(1), SHORT).is_ok());
    // Forwarded pod-to-pod traffic to port 8080 gets the mark in prerouting.
    mark_for_drop(sb.node(), BACKEND_TCP_PORT, Ipv4Addr::new(192, 0, 2, 1));
    assert!(tcp_request(sb.client(), pod(1), SHORT).is_err());
    assert!(sandbox::udp_request(
        sb.client(),
        SocketAddr::new(sandbox::pod_ip_v4(1).into(), BACKEND_UDP_PORT),
        SHORT
    )
    .is_ok());
}

#[test]
fn unallocated_addresses_in_the_service_cidr_are_dropped() {
    let sb = sandbox("nk-scidr", 3);
    // Something answers on 10.96.0.99 beyond the node (on ext), so an undropped packet gets an answer.
    let unallocated = Ipv4Addr::new(10, 96, 0, 99);
    sb.ext()
        .run(move || nftkube_sandbox::netns::add_address("lo", unallocated.into(), 32))
        .unwrap()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    hello_listener(
        sb.ext(),
        SocketAddr::new(unallocated.into(), 80),
        stop.clone(),
    );
    let m = Manifests::examples();
    let dst = SocketAddr::new(unallocated.into(), 80);

    // Without --service-cidr the node forwards it (kube-proxy's behaviour without the flag).
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    assert!(tcp_request(sb.client(), dst, Duration::from_secs(2)).is_ok());
    drop(agent);

    let agent = Agent::start(sb.node(), &m.dir, &["--service-cidr", "10.96.0.0/12"]);
    wait_until(SYNC, || tcp_request(sb.client(), dst, SHORT).is_err()).unwrap_or_else(|_| {
        panic!(
            "unallocated service address still forwarded; log:\n{}",
            agent.log()
        )
    });
    // Allocated ClusterIPs still work, and a ClusterIP's other ports are still rejected (not dropped).
    assert!(tcp_request(
        sb.client(),
        "10.96.0.10:80".parse().unwrap(),
        Duration::from_secs(2)
    )
    .is_ok());
    let e = tcp_request(
        sb.client(),
        "10.96.0.10:9999".parse().unwrap(),
        Duration::from_secs(2),
    )
    .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    stop.store(true, Ordering::SeqCst);
}
