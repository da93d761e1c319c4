//! The matrix: sources {pod, node, outside} × destinations {ClusterIP, NodePort, LoadBalancer IP} × policies
//! {Cluster, externalTrafficPolicy Local, internalTrafficPolicy Local} × {default, masquerade-all}. For every
//! cell: is it reachable, which endpoints answer, and does the backend see the client's own address.
//! Endpoint 1 (pod1) is on this node (node-1), endpoint 2 (pod2) on another (node-2).

use kernel_tests::sandbox::{self, parse_answer, tcp_requests};
use kernel_tests::*;
use std::collections::BTreeSet;
use std::fmt::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Policy {
    Cluster,
    EtpLocal,
    ItpLocal,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Dest {
    ClusterIp,
    NodePort,
    LbIp,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Source {
    Pod,
    Node,
    Outside,
}

/// Service i: ClusterIP 10.96.1.i, LB IP 192.168.251.i, NodePort 31000 + i.
fn manifest() -> String {
    let mut out = String::new();
    for (i, policy) in [Policy::Cluster, Policy::EtpLocal, Policy::ItpLocal]
        .iter()
        .enumerate()
    {
        let i = i + 1;
        let extra = match policy {
            Policy::Cluster => "",
            Policy::EtpLocal => "  externalTrafficPolicy: Local\n",
            Policy::ItpLocal => "  internalTrafficPolicy: Local\n",
        };
        let _ = write!(
            out,
            r#"---
apiVersion: v1
kind: Service
metadata: {{name: m{i}, namespace: demo}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.1.{i}
{extra}  ports: [{{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: {np}}}]
status:
  loadBalancer:
    ingress: [{{ip: 192.168.251.{i}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: m{i}-1, namespace: demo, labels: {{kubernetes.io/service-name: m{i}}}}}
addressType: IPv4
ports: [{{name: tcp, port: 8080, protocol: TCP}}]
endpoints:
- {{addresses: ["10.244.1.2"], nodeName: node-1}}
- {{addresses: ["10.244.2.2"], nodeName: node-2}}
"#,
            np = 31000 + i
        );
    }
    out
}

fn target(policy: Policy, dest: Dest) -> SocketAddr {
    let i = match policy {
        Policy::Cluster => 1,
        Policy::EtpLocal => 2,
        Policy::ItpLocal => 3,
    };
    match dest {
        Dest::ClusterIp => SocketAddr::new(Ipv4Addr::new(10, 96, 1, i).into(), 80),
        Dest::LbIp => SocketAddr::new(Ipv4Addr::new(192, 168, 251, i).into(), 80),
        Dest::NodePort => SocketAddr::new(sandbox::node_ip_v4().into(), 31000 + i as u16),
    }
}

/// kube-proxy's answer for a cell: (endpoints that answer, whether the backend sees the client's address).
fn expected(
    src: Source,
    dest: Dest,
    policy: Policy,
    masquerade_all: bool,
) -> (BTreeSet<usize>, bool) {
    let all: BTreeSet<usize> = [1, 2].into();
    let local: BTreeSet<usize> = [1].into();
    match dest {
        Dest::ClusterIp => {
            let eps = if policy == Policy::ItpLocal {
                local
            } else {
                all
            };
            // Only pods (inside the cluster CIDR) keep their address, and not with masquerade-all.
            (eps, src == Source::Pod && !masquerade_all)
        }
        Dest::NodePort | Dest::LbIp => match (policy, src) {
            // externalTrafficPolicy Local: outside traffic to local endpoints, client kept; pods and the node
            // are short-circuited to every endpoint (pods keep their address unless masquerade-all).
            (Policy::EtpLocal, Source::Outside) => (local, true),
            (Policy::EtpLocal, Source::Pod) => (all, !masquerade_all),
            (Policy::EtpLocal, Source::Node) => (all, false),
            // Cluster policy: NodePorts always masquerade; LB IPs spare pods (unless masquerade-all).
            (_, Source::Pod) => (all, dest == Dest::LbIp && !masquerade_all),
            _ => (all, false),
        },
    }
}

/// The client's own address. The node's connections to a pod leave from its address on that pod's link,
/// masqueraded or not, so for the node only reachability and endpoints are compared.
fn client_addr(src: Source) -> Option<IpAddr> {
    match src {
        Source::Pod => Some(sandbox::pod_ip_v4(0).into()),
        Source::Outside => Some(sandbox::ext_ip_v4().into()),
        Source::Node => None,
    }
}

#[test]
fn sources_destinations_policies_and_masquerade_all() {
    let sb = sandbox("nk-mx", 2);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 251, 0), 24);
    let m = Manifests::examples();
    m.write("matrix.yaml", &manifest());
    let mut failures = Vec::new();
    let mut cells = 0;
    for masquerade_all in [false, true] {
        let extra: &[&str] = if masquerade_all {
            &["--masquerade-all"]
        } else {
            &[]
        };
        let agent = Agent::start(sb.node(), &m.dir, extra);
        agent.wait_syncs(1, SYNC);
        wait_until(SYNC, || {
            sandbox::tcp_request(
                sb.ext(),
                target(Policy::Cluster, Dest::LbIp),
                Duration::from_millis(300),
            )
            .is_ok()
        })
        .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
        for policy in [Policy::Cluster, Policy::EtpLocal, Policy::ItpLocal] {
            for dest in [Dest::ClusterIp, Dest::NodePort, Dest::LbIp] {
                for src in [Source::Pod, Source::Node, Source::Outside] {
                    cells += 1;
                    let ns = match src {
                        Source::Pod => sb.client(),
                        Source::Node => sb.node(),
                        Source::Outside => sb.ext(),
                    };
                    let (want_eps, want_kept) = expected(src, dest, policy, masquerade_all);
                    let answers = tcp_requests(ns, target(policy, dest), 24, T);
                    let mut eps = BTreeSet::new();
                    let mut peers = BTreeSet::new();
                    let mut errors = 0;
                    for a in &answers {
                        match a.as_ref().ok().and_then(|s| parse_answer(s)) {
                            Some((pod, peer)) => {
                                eps.insert(pod);
                                peers.insert(peer);
                            }
                            None => errors += 1,
                        }
                    }
                    let kept = client_addr(src).map(|c| peers == [c].into());
                    let cell = format!(
                        "{src:?} → {dest:?} [{policy:?}, masquerade-all={masquerade_all}]: answered by {eps:?}, \
                         seen as {peers:?}, {errors} errors; expected {want_eps:?}, client kept={want_kept}"
                    );
                    let ok = errors == 0 && eps == want_eps && kept.is_none_or(|k| k == want_kept);
                    eprintln!("{} {cell}", if ok { "ok  " } else { "FAIL" });
                    if !ok {
                        failures.push(cell);
                    }
                }
            }
        }
        drop(agent);
    }
    assert_eq!(cells, 54);
    assert!(
        failures.is_empty(),
        "{} of {cells} cells differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
