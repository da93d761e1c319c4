//! externalIPs and LoadBalancer ingress IPs: reachable from outside and from pods, masqueraded from both as
//! kube-proxy does, rejected per port when the service has no endpoints, and never wholesale.

use kernel_tests::sandbox::{self, parse_answer, tcp_request, tcp_requests, udp_requests};
use kernel_tests::*;
use std::collections::BTreeSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);
const EXTERNAL_IP: &str = "192.168.250.10";
const LB_IP: &str = "192.168.250.20";
const LB_PROXY_IP: &str = "192.168.250.30";
const EMPTY_EXTERNAL_IP: &str = "192.168.250.40";
/// An external IP without endpoints that is also one of the node's own addresses.
const EMPTY_LOCAL_IP: &str = "192.168.250.50";

/// A TCP+UDP service with an external IP and a LoadBalancer status (one ingress in ipMode Proxy, which is
/// the load balancer's business and must be ignored), backed by the examples' echo endpoints; and two services
/// without endpoints that have an external IP, the second one assigned to the node itself.
const MANIFEST: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.30
  externalIPs: ["192.168.250.10"]
  ports:
  - {name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}
  - {name: udp, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}
status:
  loadBalancer:
    ingress:
    - ip: 192.168.250.20
    - ip: 192.168.250.30
      ipMode: Proxy
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: demo
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: tcp, port: 8080, protocol: TCP}
- {name: udp, port: 5353, protocol: UDP}
endpoints:
- addresses: ["10.244.1.2"]
  conditions: {ready: true}
- addresses: ["10.244.2.2"]
  conditions: {ready: true}
---
apiVersion: v1
kind: Service
metadata: {name: idle, namespace: demo}
spec:
  clusterIP: 10.96.0.31
  externalIPs: ["192.168.250.40"]
  ports:
  - {name: tcp, port: 80, protocol: TCP}
---
apiVersion: v1
kind: Service
metadata: {name: idle-local, namespace: demo}
spec:
  clusterIP: 10.96.0.32
  externalIPs: ["192.168.250.50"]
  ports:
  - {name: tcp, port: 7080, protocol: TCP}
"#;

#[test]
fn external_and_load_balancer_ips_are_served_masqueraded_from_outside_and_rejected_without_endpoints(
) {
    let sb = sandbox("nk-ext", 3);
    // The outside client routes the external range to the node.
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let m = Manifests::examples();
    m.write("web.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_until(SYNC, || {
        tcp_request(sb.ext(), addr(EXTERNAL_IP, 80), Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("external IP never reachable; log:\n{}", agent.log()));

    let node_side: BTreeSet<IpAddr> = (1..=2)
        .map(|i| IpAddr::from(sandbox::pod_gateway_v4(i)))
        .collect();
    for ip in [EXTERNAL_IP, LB_IP] {
        // From outside: both endpoints answer, and they see the node (the reply must come back through it).
        let (pods, peers) = tally(&tcp_requests(sb.ext(), addr(ip, 80), 40, T));
        assert_eq!(pods, [1, 2].into(), "{ip} from outside");
        assert!(
            peers.is_subset(&node_side),
            "{ip} from outside not masqueraded: {peers:?}"
        );
        let (pods, peers) = tally(&udp_requests(sb.ext(), addr(ip, 53), 40, T));
        assert_eq!(pods, [1, 2].into(), "{ip} UDP from outside");
        assert!(peers.is_subset(&node_side), "{peers:?}");
        // From a pod: masqueraded too (externalTrafficPolicy Cluster: kube-proxy's "pod to external IP" and
        // "pod to LB IP" flows), since the endpoint may be on another node.
        let (pods, peers) = tally(&tcp_requests(sb.client(), addr(ip, 80), 40, T));
        assert_eq!(pods, [1, 2].into(), "{ip} from a pod");
        assert!(
            peers.is_subset(&node_side),
            "{ip} from a pod not masqueraded: {peers:?}"
        );
    }

    // A service without endpoints: its external IP's port is rejected at once...
    for client in [sb.ext(), sb.client()] {
        let e = tcp_request(client, addr(EMPTY_EXTERNAL_IP, 80), T).unwrap_err();
        assert_eq!(
            e.kind(),
            io::ErrorKind::ConnectionRefused,
            "from {}",
            client.name()
        );
    }
    // ...but only that port: other ports of the address are not ours to answer (no reject; the node forwards
    // the packet towards ext, which drops it, so the client times out).
    let e = tcp_request(
        sb.client(),
        addr(EMPTY_EXTERNAL_IP, 81),
        Duration::from_millis(500),
    )
    .unwrap_err();
    assert_ne!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    assert_local_external_ip_without_endpoints_is_rejected(&sb);

    // An ingress in ipMode Proxy is the load balancer's: no rule for it.
    let t = dump_table(sb.node(), nftkube::nft::ir::Family::Ip).unwrap();
    let text = nftkube::nft::text::render_table(&t);
    assert!(
        text.contains(LB_IP) && !text.contains(LB_PROXY_IP),
        "{text}"
    );
}

/// An external IP assigned to the node, of a service without endpoints: its packets are for this host, so
/// they are rejected on input (kube-proxy's `service-endpoints-check` on filter-input), even though a process
/// on the node listens on that port. Other ports of the address still reach the node's own sockets.
fn assert_local_external_ip_without_endpoints_is_rejected(sb: &sandbox::Sandbox) {
    let ip: IpAddr = EMPTY_LOCAL_IP.parse().unwrap();
    sb.node()
        .run(move || nftkube_sandbox::netns::add_address("lo", ip, 32))
        .unwrap()
        .unwrap();
    let listeners: Vec<std::net::TcpListener> = [7080, 7081]
        .into_iter()
        .map(|port| {
            sb.node()
                .run(move || std::net::TcpListener::bind(("0.0.0.0", port)))
                .unwrap()
                .unwrap()
        })
        .collect();
    let e = tcp_request(sb.ext(), addr(EMPTY_LOCAL_IP, 7080), T).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    let other_port = addr(EMPTY_LOCAL_IP, 7081);
    let open = sb
        .ext()
        .run(move || std::net::TcpStream::connect_timeout(&other_port, T).map(drop))
        .unwrap();
    drop(listeners);
    open.expect("another port of the node's address reaches the node's socket");
}

/// An IPv6 NodePort service backed by pods 1 and 2.
const MANIFEST_V6: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web6, namespace: demo}
spec:
  type: NodePort
  clusterIP: fd00:96::30
  ipFamilies: [IPv6]
  ports:
  - {name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30090}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web6-1
  namespace: demo
  labels: {kubernetes.io/service-name: web6}
addressType: IPv6
ports:
- {name: tcp, port: 8080, protocol: TCP}
endpoints:
- addresses: ["fd00:244:0:1::2"]
- addresses: ["fd00:244:0:2::2"]
"#;

fn node_port(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

#[test]
fn node_ports_are_served_on_the_chosen_node_addresses_only() {
    let sb = sandbox("nk-np", 3);
    let m = Manifests::examples();
    m.write("web.yaml", MANIFEST);
    m.write("web6.yaml", MANIFEST_V6);
    let node_v4: IpAddr = sandbox::node_ip_v4().into();
    let node_v6: IpAddr = sandbox::node_ip_v6().into();
    // The node's address on the client pod's link: not a primary address (no default route there).
    let pod_link: IpAddr = sandbox::pod_gateway_v4(0).into();

    // Default --nodeport-addresses: the primary addresses (the uplink with the default route).
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_until(SYNC, || {
        tcp_request(
            sb.ext(),
            node_port(node_v4, 30080),
            Duration::from_millis(300),
        )
        .is_ok()
    })
    .unwrap_or_else(|_| panic!("NodePort never reachable; log:\n{}", agent.log()));
    let node_side: BTreeSet<IpAddr> = (1..=2)
        .map(|i| IpAddr::from(sandbox::pod_gateway_v4(i)))
        .collect();
    let (pods, peers) = tally(&tcp_requests(sb.ext(), node_port(node_v4, 30080), 40, T));
    assert_eq!(pods, [1, 2].into());
    assert!(
        peers.is_subset(&node_side),
        "NodePort traffic is masqueraded: {peers:?}"
    );
    let (pods, _) = tally(&udp_requests(sb.ext(), node_port(node_v4, 30053), 40, T));
    assert_eq!(pods, [1, 2].into());
    // From a pod through the primary address too.
    let (pods, _) = tally(&tcp_requests(sb.client(), node_port(node_v4, 30080), 20, T));
    assert_eq!(pods, [1, 2].into());
    // IPv6.
    let (pods, peers) = tally(&tcp_requests(sb.ext(), node_port(node_v6, 30090), 40, T));
    assert_eq!(pods, [1, 2].into());
    let node_side6: BTreeSet<IpAddr> = (1..=2)
        .map(|i| IpAddr::from(sandbox::pod_gateway_v6(i)))
        .collect();
    assert!(peers.is_subset(&node_side6), "{peers:?}");
    // Not through an address outside --nodeport-addresses: no backend answers there.
    let r = tcp_request(
        sb.client(),
        node_port(pod_link, 30080),
        Duration::from_millis(500),
    );
    assert!(
        r.as_ref().map_or(true, |a| parse_answer(a).is_none()),
        "{r:?}"
    );
    // Never on loopback.
    let r = tcp_request(
        sb.node(),
        node_port("127.0.0.1".parse().unwrap(), 30080),
        Duration::from_millis(500),
    );
    assert!(r.is_err(), "{r:?}");
    drop(agent);

    // A zero CIDR: every local address (still not loopback).
    let agent = Agent::start(
        sb.node(),
        &m.dir,
        &["--nodeport-addresses", "0.0.0.0/0,::/0"],
    );
    wait_until(SYNC, || {
        tcp_request(
            sb.client(),
            node_port(pod_link, 30080),
            Duration::from_millis(300),
        )
        .is_ok_and(|a| parse_answer(&a).is_some())
    })
    .unwrap_or_else(|_| {
        panic!(
            "NodePort on every address never served; log:\n{}",
            agent.log()
        )
    });
    let (pods, _) = tally(&tcp_requests(sb.ext(), node_port(node_v4, 30080), 20, T));
    assert_eq!(pods, [1, 2].into());
    let r = tcp_request(
        sb.node(),
        node_port("127.0.0.1".parse().unwrap(), 30080),
        Duration::from_millis(500),
    );
    assert!(r.is_err(), "{r:?}");
    let t = dump_table(sb.node(), nftkube::nft::ir::Family::Ip).unwrap();
    let text = nftkube::nft::text::render_table(&t);
    assert!(
        text.contains("fib daddr type local ip daddr != 127.0.0.0/8 goto nodeports"),
        "{text}"
    );
}

/// The node's second uplink, to ext as the first, on 192.168.201.0/24 and fd00:201::/64.
const UPLINK2: &str = "eth1";

fn uplink2_ip(host: u8, v6: bool) -> IpAddr {
    if v6 {
        Ipv6Addr::new(0xfd00, 0x201, 0, 0, 0, 0, 0, host.into()).into()
    } else {
        Ipv4Addr::new(192, 168, 201, host).into()
    }
}

/// Adds a second veth between the node and ext, then makes each of the node's default routes (IPv4, IPv6) one
/// route with a next hop through each uplink, as a node with bonded-by-routing uplinks has.
fn multipath_default_routes(sb: &sandbox::Sandbox) {
    use nftkube_sandbox::netns::{add_address, create_veth, replace_route_multipath, set_link_up};
    let ext = sb.ext();
    let node_end = |host| {
        move || -> Result<(), nftkube_sandbox::netns::NetnsError> {
            set_link_up(UPLINK2)?;
            add_address(UPLINK2, uplink2_ip(host, false), 24)?;
            add_address(UPLINK2, uplink2_ip(host, true), 64)
        }
    };
    sb.node()
        .run(|| create_veth(UPLINK2, UPLINK2, ext).and_then(|()| node_end(1)()))
        .unwrap()
        .expect("the node's second uplink");
    ext.run(node_end(2)).unwrap().expect("ext's end of it");
    sb.node()
        .run(|| {
            replace_route_multipath(
                Ipv4Addr::UNSPECIFIED.into(),
                0,
                &[
                    (sandbox::ext_ip_v4().into(), sandbox::NODE_UPLINK),
                    (uplink2_ip(2, false), UPLINK2),
                ],
            )?;
            replace_route_multipath(
                Ipv6Addr::UNSPECIFIED.into(),
                0,
                &[
                    (sandbox::ext_ip_v6().into(), sandbox::NODE_UPLINK),
                    (uplink2_ip(2, true), UPLINK2),
                ],
            )
        })
        .unwrap()
        .expect("multipath default routes");
}

/// The oracle's view of the node's default routes, when `ip` may be used: each must list both next hops.
fn assert_default_routes_are_multipath(sb: &sandbox::Sandbox) {
    if !oracles() {
        return;
    }
    for family in ["-4", "-6"] {
        let out = sb
            .node()
            .command("ip")
            .args([family, "route", "show", "default"])
            .output()
            .expect("running ip (apt-get install iproute2)");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.matches("nexthop").count() == 2
                && text.contains(sandbox::NODE_UPLINK)
                && text.contains(UPLINK2),
            "ip {family} route show default:\n{text}"
        );
    }
}

#[test]
fn node_ports_are_served_on_every_uplink_of_a_multipath_default_route() {
    let sb = sandbox("nk-mpath", 3);
    multipath_default_routes(&sb);
    assert_default_routes_are_multipath(&sb);
    let m = Manifests::examples();
    m.write("web.yaml", MANIFEST);
    m.write("web6.yaml", MANIFEST_V6);
    let primary = [
        node_port(sandbox::node_ip_v4().into(), 30080),
        node_port(uplink2_ip(1, false), 30080),
        node_port(sandbox::node_ip_v6().into(), 30090),
        node_port(uplink2_ip(1, true), 30090),
    ];

    // Default --nodeport-addresses: the primary addresses, those of both next hops' links.
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    for dst in primary {
        wait_until(SYNC, || served(sb.ext(), dst, Duration::from_millis(300))).unwrap_or_else(
            |_| {
                panic!(
                    "NodePort {dst} never served from outside; log:\n{}",
                    agent.log()
                )
            },
        );
        let (pods, _) = tally(&tcp_requests(sb.ext(), dst, 20, T));
        assert_eq!(pods, [1, 2].into(), "{dst}");
    }
    // Still only the primary addresses: not the node's address on a pod's link.
    let pod_link = node_port(sandbox::pod_gateway_v4(0).into(), 30080);
    assert!(
        !served(sb.client(), pod_link, Duration::from_millis(500)),
        "{pod_link} is no primary address"
    );
}

/// `--feature-gates=AllowServiceExternalIPs=false`, as kube-proxy: externalIPs are not served (neither
/// dispatched nor rejected: the node's own handling of the address decides), LoadBalancer IPs and the
/// ClusterIP still are.
#[test]
fn external_ips_are_not_served_when_the_gate_is_off() {
    let sb = sandbox("nk-extgate", 3);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let m = Manifests::examples();
    m.write("web.yaml", MANIFEST);
    let agent = Agent::start(
        sb.node(),
        &m.dir,
        &["--feature-gates=AllowServiceExternalIPs=false"],
    );
    wait_until(SYNC, || {
        tcp_request(sb.ext(), addr(LB_IP, 80), Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("LoadBalancer IP never reachable; log:\n{}", agent.log()));
    assert!(tcp_request(sb.pod(1), addr("10.96.0.30", 80), T).is_ok());
    for ip in [EXTERNAL_IP, EMPTY_EXTERNAL_IP] {
        assert!(
            tcp_request(sb.ext(), addr(ip, 80), Duration::from_millis(500)).is_err(),
            "{ip} served with the gate off"
        );
    }
    let log = agent.log();
    assert!(log.contains("AllowServiceExternalIPs=false"), "{log}");
}
