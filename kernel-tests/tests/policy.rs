//! Traffic policies: externalTrafficPolicy Local (outside traffic only to this node's endpoints, client address
//! kept; pods and the node short-circuited to every endpoint; no local endpoint → dropped) and
//! internalTrafficPolicy Local (ClusterIP traffic only to this node's endpoints; none → dropped).
//! The agent runs as node-1; pod 1 is on node-1, pods 2 and 3 are said to be on node-2.

use kernel_tests::sandbox::{self, tcp_request, tcp_requests};
use kernel_tests::*;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);

const MANIFEST: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: etp, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.40
  externalIPs: ["192.168.250.50"]
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30100}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: etp-1, namespace: demo, labels: {kubernetes.io/service-name: etp}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], nodeName: node-1}
- {addresses: ["10.244.2.2"], nodeName: node-2}
---
apiVersion: v1
kind: Service
metadata: {name: etp-remote, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.41
  externalIPs: ["192.168.250.51"]
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30101}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: etp-remote-1, namespace: demo, labels: {kubernetes.io/service-name: etp-remote}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.2.2"], nodeName: node-2}
- {addresses: ["10.244.3.2"], nodeName: node-2}
---
apiVersion: v1
kind: Service
metadata: {name: itp, namespace: demo}
spec:
  clusterIP: 10.96.0.42
  internalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: itp-1, namespace: demo, labels: {kubernetes.io/service-name: itp}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], nodeName: node-1}
- {addresses: ["10.244.2.2"], nodeName: node-2}
---
apiVersion: v1
kind: Service
metadata: {name: itp-remote, namespace: demo}
spec:
  clusterIP: 10.96.0.43
  internalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: itp-remote-1, namespace: demo, labels: {kubernetes.io/service-name: itp-remote}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.2.2"], nodeName: node-2}
"#;

#[test]
fn local_traffic_policies_choose_endpoints_and_keep_sources_as_kube_proxy_does() {
    let sb = sandbox("nk-pol", 3);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let m = Manifests::examples();
    m.write("policy.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    let node_port = SocketAddr::new(sandbox::node_ip_v4().into(), 30100);
    wait_until(SYNC, || {
        tcp_request(sb.ext(), node_port, Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
    let client: IpAddr = sandbox::ext_ip_v4().into();
    let pod0: IpAddr = sandbox::pod_ip_v4(0).into();

    // externalTrafficPolicy Local, from outside: only the local endpoint, and it sees the real client.
    for dst in [node_port, addr("192.168.250.50", 80)] {
        let (pods, peers) = tally(&tcp_requests(sb.ext(), dst, 30, T));
        assert_eq!(pods, [1].into(), "{dst} from outside");
        assert_eq!(peers, [client].into(), "{dst}: client address not kept");
    }
    // From a pod to the external IP: short-circuited to every endpoint, pod address kept.
    let (pods, peers) = tally(&tcp_requests(
        sb.client(),
        addr("192.168.250.50", 80),
        40,
        T,
    ));
    assert_eq!(pods, [1, 2].into());
    assert_eq!(peers, [pod0].into());
    // From the node itself to its NodePort: every endpoint too (masqueraded, as kube-proxy does).
    let (pods, _) = tally(&tcp_requests(sb.node(), node_port, 40, T));
    assert_eq!(pods, [1, 2].into());
    // The ClusterIP of the same service is not affected by the external policy.
    let (pods, _) = tally(&tcp_requests(sb.client(), addr("10.96.0.40", 80), 40, T));
    assert_eq!(pods, [1, 2].into());

    // externalTrafficPolicy Local with no endpoint on this node: outside traffic is dropped (not rejected:
    // another node may serve it), pods still reach the remote endpoints.
    for dst in [
        SocketAddr::new(sandbox::node_ip_v4().into(), 30101),
        addr("192.168.250.51", 80),
    ] {
        let e = tcp_request(sb.ext(), dst, Duration::from_millis(700)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{dst}: {e}");
    }
    let (pods, _) = tally(&tcp_requests(
        sb.client(),
        addr("192.168.250.51", 80),
        30,
        T,
    ));
    assert_eq!(pods, [2, 3].into());

    // internalTrafficPolicy Local: only the local endpoint; none → dropped.
    let (pods, peers) = tally(&tcp_requests(sb.client(), addr("10.96.0.42", 80), 30, T));
    assert_eq!(pods, [1].into());
    assert_eq!(peers, [pod0].into());
    let e = tcp_request(
        sb.client(),
        addr("10.96.0.43", 80),
        Duration::from_millis(700),
    )
    .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
}

const HINTED: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: zoned, namespace: demo}
spec:
  clusterIP: 10.96.0.70
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: zoned-1, namespace: demo, labels: {kubernetes.io/service-name: zoned}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], zone: zone-a, hints: {forZones: [{name: zone-a}]}}
- {addresses: ["10.244.2.2"], zone: zone-b, hints: {forZones: [{name: zone-b}]}}
- {addresses: ["10.244.3.2"], zone: zone-b, hints: {forZones: [{name: zone-b}]}}
---
apiVersion: v1
kind: Service
metadata: {name: noded, namespace: demo}
spec:
  clusterIP: 10.96.0.71
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: noded-1, namespace: demo, labels: {kubernetes.io/service-name: noded}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], hints: {forNodes: [{name: node-2}]}}
- {addresses: ["10.244.2.2"], hints: {forNodes: [{name: node-1}]}}
---
apiVersion: v1
kind: Service
metadata: {name: leaving, namespace: demo}
spec:
  clusterIP: 10.96.0.72
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: leaving-1, namespace: demo, labels: {kubernetes.io/service-name: leaving}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], zone: zone-a, hints: {forZones: [{name: zone-a}]}, conditions: {ready: false, serving: true, terminating: true}}
- {addresses: ["10.244.2.2"], zone: zone-b, hints: {forZones: [{name: zone-b}]}, conditions: {ready: false, serving: true, terminating: true}}
"#;

#[test]
fn topology_hints_keep_traffic_in_the_zone_or_on_the_node() {
    let sb = sandbox("nk-topo", 3);
    let m = Manifests::examples();
    m.write("hinted.yaml", HINTED);
    let zoned = addr("10.96.0.70", 80);
    let noded = addr("10.96.0.71", 80);
    // Without a known zone, zone hints cannot apply: every endpoint. Node hints need only the node name.
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_until(SYNC, || {
        tcp_request(sb.client(), zoned, Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
    assert_eq!(
        tally(&tcp_requests(sb.client(), zoned, 40, T)).0,
        [1, 2, 3].into()
    );
    assert_eq!(
        tally(&tcp_requests(sb.client(), noded, 20, T)).0,
        [2].into()
    );
    drop(agent);
    // In zone-a: only the endpoint hinted for zone-a.
    let agent = Agent::start(sb.node(), &m.dir, &["--node-zone", "zone-a"]);
    wait_until(SYNC, || {
        tally(&tcp_requests(sb.client(), zoned, 10, T)).0 == [1].into()
    })
    .unwrap_or_else(|_| panic!("zone hints not applied; log:\n{}", agent.log()));
    assert_eq!(
        tally(&tcp_requests(sb.client(), zoned, 30, T)).0,
        [1].into()
    );
    // No endpoint of `leaving` is ready: the terminating fallback takes both, whatever their hints (kube-proxy
    // narrows by topology before falling back, never after).
    assert_eq!(
        tally(&tcp_requests(sb.client(), addr("10.96.0.72", 80), 30, T)).0,
        [1, 2].into()
    );
    drop(agent);
    // In a zone no endpoint is hinted for: every endpoint.
    let _agent = Agent::start(sb.node(), &m.dir, &["--node-zone", "zone-c"]);
    wait_until(SYNC, || {
        tally(&tcp_requests(sb.client(), zoned, 30, T)).0 == [1, 2, 3].into()
    })
    .unwrap_or_else(|_| panic!("unmatched zone must fall back to every endpoint"));
}

const TERMINATING: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: rolling, namespace: demo}
spec:
  clusterIP: 10.96.0.80
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: rolling-1, namespace: demo, labels: {kubernetes.io/service-name: rolling}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], conditions: {ready: false, serving: true, terminating: true}}
- {addresses: ["10.244.2.2"], conditions: {ready: false, serving: true, terminating: true}}
- {addresses: ["10.244.3.2"], conditions: {ready: false, serving: false, terminating: true}}
"#;

/// externalTrafficPolicy Local NodePorts during a rollout, and one without endpoints: `etp-leaving` has a
/// terminating-but-serving endpoint on this node (pod 1) and a ready one elsewhere (pod 2); `etp-gone` only a
/// terminating-but-serving endpoint elsewhere (pod 2); `np-empty` none at all.
const ETP_TERMINATING: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: etp-leaving, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.81
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30110}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: etp-leaving-1, namespace: demo, labels: {kubernetes.io/service-name: etp-leaving}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], nodeName: node-1, conditions: {ready: false, serving: true, terminating: true}}
- {addresses: ["10.244.2.2"], nodeName: node-2}
---
apiVersion: v1
kind: Service
metadata: {name: etp-gone, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.82
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30111}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: etp-gone-1, namespace: demo, labels: {kubernetes.io/service-name: etp-gone}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.2.2"], nodeName: node-2, conditions: {ready: false, serving: true, terminating: true}}
---
apiVersion: v1
kind: Service
metadata: {name: np-empty, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.83
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30112}]
"#;

/// kube-proxy's TestTerminatingEndpointsTrafficPolicyLocal and TestNoEndpointsReject on NodePorts, from outside:
/// a local endpoint that is terminating but serving takes outside traffic (the client's address kept) when no
/// local endpoint is ready, even though another node has a ready one; with no local endpoint at all, outside
/// traffic is dropped while pods still reach the remote one; a NodePort without endpoints is rejected.
fn assert_local_policy_during_a_rollout(sb: &sandbox::Sandbox) {
    let node = |port| SocketAddr::new(sandbox::node_ip_v4().into(), port);
    let (pods, peers) = tally(&tcp_requests(sb.ext(), node(30110), 30, T));
    assert_eq!(pods, [1].into(), "etp-leaving from outside");
    assert_eq!(peers, [IpAddr::from(sandbox::ext_ip_v4())].into());

    let e = tcp_request(sb.ext(), node(30111), Duration::from_millis(700)).unwrap_err();
    assert_eq!(
        e.kind(),
        io::ErrorKind::TimedOut,
        "etp-gone from outside: {e}"
    );
    let (pods, _) = tally(&tcp_requests(sb.client(), addr("10.96.0.82", 80), 20, T));
    assert_eq!(pods, [2].into(), "etp-gone from a pod");

    let e = tcp_request(sb.ext(), node(30112), T).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "np-empty: {e}");
}

#[test]
fn terminating_endpoints_that_still_serve_take_over_when_none_is_ready() {
    let sb = sandbox("nk-term", 3);
    let m = Manifests::examples();
    m.write("rolling.yaml", TERMINATING);
    m.write("etp-rolling.yaml", ETP_TERMINATING);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    let dst = addr("10.96.0.80", 80);
    wait_until(SYNC, || {
        tcp_request(sb.client(), dst, Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
    // No endpoint is ready: the serving ones that are terminating carry the traffic; the one that no
    // longer serves gets none.
    assert_eq!(
        tally(&tcp_requests(sb.client(), dst, 40, T)).0,
        [1, 2].into()
    );
    assert_local_policy_during_a_rollout(&sb);
    // A ready endpoint appears: it alone serves new connections.
    m.write(
        "rolling.yaml",
        &TERMINATING.replace(
            "{ready: false, serving: false, terminating: true}",
            "{ready: true, serving: true, terminating: false}",
        ),
    );
    wait_until(SYNC, || {
        tally(&tcp_requests(sb.client(), dst, 20, T)).0 == [3].into()
    })
    .unwrap_or_else(|_| panic!("the ready endpoint never took over; log:\n{}", agent.log()));
}
