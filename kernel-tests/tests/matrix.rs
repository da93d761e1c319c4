//! The matrix: sources {pod, node, outside} × destinations {ClusterIP, NodePort, LoadBalancer IP} × policies
//! {Cluster, externalTrafficPolicy Local, internalTrafficPolicy Local} × {default, masquerade-all}. For every
//! cell: is it reachable, which endpoints answer, and does the backend see the client's own address.
//! Endpoint 1 (pod1) is on this node (node-1), endpoint 2 (pod2) on another (node-2).

use kernel_tests::matrix::*;
use kernel_tests::*;
use std::net::Ipv4Addr;
use std::time::Duration;

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);

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
                    let (want_eps, want_kept) = expected(src, dest, policy, masquerade_all);
                    let seen = observe(&sb, src, target(policy, dest), 24, T);
                    let (eps, peers, errors) = (seen.endpoints, seen.peers, seen.errors);
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
