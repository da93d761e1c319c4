//! ClientIP session affinity: a client sticks to one endpoint for the timeout, refreshed by each new
//! connection, held in the kernel (a dynamic map with per-element timeouts); after the timeout it may move.

use kernel_tests::sandbox::{tcp_requests, udp_requests};
use kernel_tests::*;
use std::net::SocketAddr;
use std::time::Duration;

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);

const MANIFEST: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: demo}
spec:
  clusterIP: 10.96.0.50
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 3}}
  ports:
  - {name: tcp, port: 80, targetPort: 8080, protocol: TCP}
  - {name: udp, port: 53, targetPort: 5353, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-1, namespace: demo, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports:
- {name: tcp, port: 8080, protocol: TCP}
- {name: udp, port: 5353, protocol: UDP}
endpoints:
- {addresses: ["10.244.1.2"]}
- {addresses: ["10.244.2.2"]}
- {addresses: ["10.244.3.2"]}
"#;

#[test]
fn a_client_sticks_to_one_endpoint_until_the_affinity_times_out() {
    let sb = sandbox("nk-aff", 3);
    let m = Manifests::examples();
    m.write("sticky.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    let dst: SocketAddr = "10.96.0.50:80".parse().unwrap();
    wait_until(SYNC, || {
        sandbox::tcp_request(sb.client(), dst, Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));

    // Many new connections (fresh source ports) from one client: one endpoint. Without affinity, 40
    // connections over 3 endpoints would all land on one with probability 3·(1/3)^40.
    let first = pods(&tcp_requests(sb.client(), dst, 40, T));
    assert_eq!(
        first.len(),
        1,
        "the client moved between endpoints: {first:?}"
    );
    // Other clients are balanced independently: the outside client gets its own choice, and sticks too.
    let other = pods(&tcp_requests(sb.ext(), dst, 20, T));
    assert_eq!(other.len(), 1, "{other:?}");
    // UDP follows its own (per port) affinity and also sticks.
    let udp: SocketAddr = "10.96.0.50:53".parse().unwrap();
    assert_eq!(pods(&udp_requests(sb.client(), udp, 30, T)).len(), 1);

    // Connections keep refreshing it: 2.5 s of steady connections, still the same endpoint.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(pods(&tcp_requests(sb.client(), dst, 2, T)), first);
    }
    // After the timeout without connections, the choice is made afresh: over several idle periods the
    // client ends up on another endpoint at least once (each time with probability 2/3; staying put through
    // all twelve has probability (1/3)^12 ≈ 2e-6 — six periods failed once in a few hundred VM runs).
    let mut seen = first.clone();
    for _ in 0..12 {
        std::thread::sleep(Duration::from_millis(3300));
        let now = pods(&tcp_requests(sb.client(), dst, 5, T));
        assert_eq!(now.len(), 1, "{now:?}");
        seen.extend(now);
        if seen.len() > 1 {
            break;
        }
    }
    assert!(seen.len() > 1, "affinity never expired: {seen:?}");
}

/// A client pinned to an endpoint that leaves the service is sent to another one at once (its affinity
/// entry is deleted with the endpoint), not to the departed pod for the rest of the timeout.
#[test]
fn a_client_whose_endpoint_leaves_moves_at_once() {
    let sb = sandbox("nk-affgone", 3);
    let m = Manifests::examples();
    let long = MANIFEST.replace("timeoutSeconds: 3", "timeoutSeconds: 600");
    m.write("sticky.yaml", &long);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    let dst: SocketAddr = "10.96.0.50:80".parse().unwrap();
    wait_until(SYNC, || {
        sandbox::tcp_request(sb.client(), dst, Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
    let before = pods(&tcp_requests(sb.client(), dst, 10, T));
    assert_eq!(before.len(), 1, "{before:?}");
    let gone = *before.iter().next().unwrap();

    // Traffic flows as soon as the commit is in, before the sync is logged: count from a logged one.
    agent.wait_syncs(1, SYNC);
    let syncs = agent.log().matches("sync complete").count();
    let line = format!("- {{addresses: [\"10.244.{gone}.2\"]}}\n");
    assert!(long.contains(&line), "test bug: no {line}");
    m.write("sticky.yaml", &long.replace(&line, ""));
    agent.wait_syncs(syncs + 1, SYNC);
    let after = pods(&tcp_requests(sb.client(), dst, 20, T));
    assert!(
        !after.contains(&gone),
        "still sent to the removed endpoint {gone}: {after:?}; log:\n{}",
        agent.log()
    );
    assert_eq!(after.len(), 1, "a new affinity, sticky again: {after:?}");
}
