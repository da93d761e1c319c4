//! loadBalancerSourceRanges: enforced on the LoadBalancer IP before DNAT; the NodePort and external IPs of
//! the same service are not filtered.

use kernel_tests::sandbox;
use kernel_tests::*;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

const SYNC: Duration = Duration::from_secs(15);
const SHORT: Duration = Duration::from_millis(700);

fn manifest(ranges: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: guarded, namespace: demo}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.60
  externalIPs: ["192.168.250.61"]
  loadBalancerSourceRanges: [{ranges}]
  ports: [{{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30110}}]
status:
  loadBalancer:
    ingress: [{{ip: 192.168.250.60}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: guarded-1, namespace: demo, labels: {{kubernetes.io/service-name: guarded}}}}
addressType: IPv4
ports: [{{name: tcp, port: 8080, protocol: TCP}}]
endpoints:
- {{addresses: ["10.244.1.2"]}}
"#
    )
}

fn served(ns: &nftkube_sandbox::netns::NetNs, dst: SocketAddr) -> bool {
    kernel_tests::served(ns, dst, SHORT)
}

#[test]
fn source_ranges_allow_and_block_on_the_load_balancer_ip_only() {
    let sb = sandbox("nk-fw", 1);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let lb: SocketAddr = "192.168.250.60:80".parse().unwrap();
    let external: SocketAddr = "192.168.250.61:80".parse().unwrap();
    let node_port = SocketAddr::new(sandbox::node_ip_v4().into(), 30110);
    let m = Manifests::examples();

    // Only the outside client's address is allowed.
    m.write("guarded.yaml", &manifest("192.168.200.2/32"));
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_until(SYNC, || served(sb.ext(), lb))
        .unwrap_or_else(|_| panic!("allowed source never served; log:\n{}", agent.log()));
    assert!(
        !served(sb.client(), lb),
        "a pod outside the ranges reached the LoadBalancer IP"
    );
    // Same service, not filtered: its external IP and NodePort.
    assert!(served(sb.client(), external));
    assert!(served(sb.client(), node_port));

    // The ranges change: now pods are allowed and the outside client is not.
    m.write("guarded.yaml", &manifest("10.244.0.0/16"));
    wait_until(SYNC, || served(sb.client(), lb))
        .unwrap_or_else(|_| panic!("new range never applied; log:\n{}", agent.log()));
    assert!(!served(sb.ext(), lb));
    assert!(served(sb.ext(), node_port));
    // The old firewall chain is gone once nothing points at it.
    wait_until(SYNC, || {
        let t = dump_table(sb.node(), nftkube::nft::ir::Family::Ip).unwrap();
        t.chains.keys().filter(|c| c.starts_with("fw-")).count() == 1
    })
    .unwrap_or_else(|_| panic!("stale firewall chain left behind"));
}
