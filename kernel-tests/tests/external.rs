//! externalIPs and LoadBalancer ingress IPs: reachable from outside and from pods, masqueraded as
//! kube-proxy does, rejected per port when the service has no endpoints, and never wholesale.

use kernel_tests::sandbox::{self, parse_answer, tcp_request, tcp_requests, udp_requests};
use kernel_tests::*;
use std::collections::BTreeSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);
const EXTERNAL_IP: &str = "192.168.250.10";
const LB_IP: &str = "192.168.250.20";
const LB_PROXY_IP: &str = "192.168.250.30";
const EMPTY_EXTERNAL_IP: &str = "192.168.250.40";

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// A TCP+UDP service with an external IP and a LoadBalancer status (one ingress in ipMode Proxy, which is
/// the load balancer's business and must be ignored), backed by the examples' echo endpoints; and a service
/// without endpoints that has an external IP.
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
"#;

fn tally(answers: &[io::Result<String>]) -> (BTreeSet<usize>, BTreeSet<IpAddr>) {
    let mut pods = BTreeSet::new();
    let mut peers = BTreeSet::new();
    for a in answers {
        let (pod, peer) = parse_answer(a.as_ref().expect("request failed")).expect("answer");
        pods.insert(pod);
        peers.insert(peer);
    }
    (pods, peers)
}

#[test]
fn external_and_load_balancer_ips_are_served_masqueraded_from_outside_and_rejected_without_endpoints() {
    let sb = sandbox("nk-ext", 3);
    // The outside client routes the external range to the node.
    sb.ext()
        .run(|| {
            nftkube::netns::add_route(
                Ipv4Addr::new(192, 168, 250, 0).into(),
                24,
                Some(sandbox::node_ip_v4().into()),
                Some("eth0"),
            )
        })
        .unwrap()
        .unwrap();
    let m = Manifests::examples();
    m.write("web.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_until(SYNC, || tcp_request(sb.ext(), addr(EXTERNAL_IP, 80), Duration::from_millis(300)).is_ok())
        .unwrap_or_else(|_| panic!("external IP never reachable; log:\n{}", agent.log()));

    let node_side: BTreeSet<IpAddr> = (1..=2).map(|i| IpAddr::from(sandbox::pod_gateway_v4(i))).collect();
    for ip in [EXTERNAL_IP, LB_IP] {
        // From outside: both endpoints answer, and they see the node (the reply must come back through it).
        let (pods, peers) = tally(&tcp_requests(sb.ext(), addr(ip, 80), 40, T));
        assert_eq!(pods, [1, 2].into(), "{ip} from outside");
        assert!(peers.is_subset(&node_side), "{ip} from outside not masqueraded: {peers:?}");
        let (pods, peers) = tally(&udp_requests(sb.ext(), addr(ip, 53), 40, T));
        assert_eq!(pods, [1, 2].into(), "{ip} UDP from outside");
        assert!(peers.is_subset(&node_side), "{peers:?}");
        // From a pod: the pod's own address is kept.
        let (pods, peers) = tally(&tcp_requests(sb.client(), addr(ip, 80), 40, T));
        assert_eq!(pods, [1, 2].into(), "{ip} from a pod");
        assert_eq!(peers, [IpAddr::from(sandbox::pod_ip_v4(0))].into());
    }

    // A service without endpoints: its external IP's port is rejected at once...
    for client in [sb.ext(), sb.client()] {
        let e = tcp_request(client, addr(EMPTY_EXTERNAL_IP, 80), T).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "from {}", client.name());
    }
    // ...but only that port: other ports of the address are not ours to answer (no reject; the node forwards
    // the packet towards ext, which drops it, so the client times out).
    let e = tcp_request(sb.client(), addr(EMPTY_EXTERNAL_IP, 81), Duration::from_millis(500)).unwrap_err();
    assert_ne!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");

    // An ingress in ipMode Proxy is the load balancer's: no rule for it.
    let t = dump_table(sb.node(), nftkube::nft::ir::Family::Ip).unwrap();
    let text = nftkube::nft::text::render_table(&t);
    assert!(text.contains(LB_IP) && !text.contains(LB_PROXY_IP), "{text}");
}
