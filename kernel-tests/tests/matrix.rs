//! The matrix: sources {pod, node, outside} × destinations {ClusterIP, NodePort, LoadBalancer IP} × policies
//! {Cluster, externalTrafficPolicy Local, internalTrafficPolicy Local} × {default, no local-traffic detector,
//! masquerade-all}, kube-proxy's TestInternalExternalMasquerade with real packets. For every cell: is it
//! reachable, which endpoints answer, and does the backend see the client's own address.
//! Endpoint 1 (pod1) is on this node (node-1), endpoint 2 (pod2) on another (node-2).

use kernel_tests::matrix::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(2);

#[test]
fn sources_destinations_policies_and_masquerading_variants() {
    let (sb, m) = setup("nk-mx");
    let mut failures = Vec::new();
    let mut cells = 0;
    for variant in VARIANTS {
        let agent = start_agent(&sb, &m, variant);
        for policy in [Policy::Cluster, Policy::EtpLocal, Policy::ItpLocal] {
            for dest in [Dest::ClusterIp, Dest::NodePort, Dest::LbIp] {
                for src in [Source::Pod, Source::Node, Source::Outside] {
                    cells += 1;
                    let (want_eps, want_kept) = expected(src, dest, policy, variant);
                    let seen = observe(&sb, src, target(policy, dest), 24, T);
                    let (eps, peers, errors) = (seen.endpoints, seen.peers, seen.errors);
                    let kept = client_addr(src).map(|c| peers == [c].into());
                    let cell = format!(
                        "{src:?} → {dest:?} [{policy:?}, {variant:?}]: answered by {eps:?}, \
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
    assert_eq!(cells, 81);
    assert!(
        failures.is_empty(),
        "{} of {cells} cells differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
