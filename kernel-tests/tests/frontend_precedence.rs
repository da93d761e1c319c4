//! A contested frontend (`addr . proto . port` claimed by two Services) with real packets and the real agent:
//! the `kubernetes` Service's ClusterIP 10.96.0.1:443 against another namespace's Service whose `externalIPs`
//! name that address (CVE-2020-8554 class). A ClusterIP outranks an external IP whatever the names, the ages
//! and the order of arrival; a waiting claim takes the frontend when its holder goes, and gives it back when
//! the holder returns (see `crates/render/src/claims.rs`). `nftkube_refused_frontend_claims` counts one waiting
//! claim per family the attacker contests.
//!
//! Why this fails on the code before the precedence fix (4271f00's parent): there the first claimant in
//! namespace/name order held a contested frontend. The attacker lives in namespace `aaa`, which sorts before
//! `default`, so at a full sync (both services present at start, and every restart) its external IP element
//! took 10.96.0.1:443 and every connection to the API server's VIP reached the attacker's pod: the first
//! traffic check of the first and third tests (`first sync`, `dual stack, IPv4`) sees pod 2 instead of pod 1.
//! The attacker is also given an older creationTimestamp than the victim, so that only the frontend's kind
//! can decide for the victim: a fix that ranked by age alone would fail the same checks. (The second test,
//! the attacker arriving later in a partial sync, kept the victim on the old code too: there the frontend's
//! first holder kept it. It fails there on the gauge only, which did not exist.)
//!
//! The last three tests reproduce bugs of the first precedence code, found while writing these and fixed
//! since; each says what happened and why.

use kernel_tests::sandbox::{self, parse_answer, tcp_request};
use kernel_tests::*;
use nftkube::admin::http::get;
use nftkube_sandbox::netns::NetNs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

const SYNC: Duration = Duration::from_secs(15);
const SHORT: Duration = Duration::from_millis(400);
/// The API server's VIP: the victim's ClusterIP and the attacker's external IP.
const VIP: &str = "10.96.0.1";
/// The attacker's own ClusterIP: shows that the attacker is programmed (a positive control).
const ATTACKER_CIP: &str = "10.96.0.77";
const PORT: u16 = 443;
/// Backend pods (sandbox pod indices; each answers `pod{i} ...`).
const VICTIM_POD: usize = 1;
const ATTACKER_POD: usize = 2;
const OTHER_POD: usize = 3;
/// The attacker is the OLDEST service: age must not help it against a ClusterIP.
const ATTACKER_CREATED: &str = "2020-01-01T00:00:00Z";
const VICTIM_CREATED: &str = "2024-01-01T00:00:00Z";
/// A victim deleted and created again is younger still.
const VICTIM_RECREATED: &str = "2026-11-01T00:00:00Z";
const METRICS: &str = "127.0.0.1:10249";
const REFUSED: &str = "nftkube_refused_frontend_claims";

/// A Service `ns/name` (port `https` 443/TCP → 8080) and its EndpointSlice with the sandbox pods `pods`.
fn service(
    ns: &str,
    name: &str,
    cluster_ip: &str,
    external_ips: &[&str],
    created: &str,
    pods: &[usize],
) -> String {
    let externals = external_ips
        .iter()
        .map(|ip| format!("\"{ip}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let endpoints = pods
        .iter()
        .map(|&i| {
            let ip = sandbox::pod_ip_v4(i);
            format!("{{addresses: [\"{ip}\"], conditions: {{ready: true}}}}")
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {ns}, creationTimestamp: "{created}"}}
spec:
  type: ClusterIP
  clusterIP: {cluster_ip}
  clusterIPs: [{cluster_ip}]
  externalIPs: [{externals}]
  ports:
  - {{name: https, port: {PORT}, targetPort: 8080, protocol: TCP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: {ns}
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports:
- {{name: https, port: 8080, protocol: TCP}}
endpoints: [{endpoints}]
"#
    )
}

/// `default/kubernetes`: ClusterIP 10.96.0.1, port 443 → `pods`.
fn victim(created: &str, pods: &[usize]) -> String {
    service("default", "kubernetes", VIP, &[], created, pods)
}

/// `aaa/x`: ClusterIP of its own, `externalIPs: [10.96.0.1]`, port 443 → the attacker's pod.
fn attacker(pods: &[usize]) -> String {
    service("aaa", "x", ATTACKER_CIP, &[VIP], ATTACKER_CREATED, pods)
}

/// A manifest directory with no example services: only what each test writes.
fn manifests() -> Manifests {
    let m = Manifests::examples();
    m.remove("services.yaml");
    m.remove("endpointslices.yaml");
    m
}

/// What one connection got: the answering pod and the client address it saw, or the error's kind.
type Answer = Result<(usize, IpAddr), io::ErrorKind>;

/// `n` TCP connections to `ip:443` from `from`.
fn answers(from: &NetNs, ip: &str, n: usize, timeout: Duration) -> Vec<Answer> {
    (0..n)
        .map(|_| match tcp_request(from, addr(ip, PORT), timeout) {
            Ok(a) => parse_answer(&a).ok_or(io::ErrorKind::InvalidData),
            Err(e) => Err(e.kind()),
        })
        .collect()
}

fn all_from(seen: &[Answer], pod: usize) -> bool {
    seen.iter().all(|a| a.is_ok_and(|(p, _)| p == pod))
}

/// Which claim serves a frontend, as the source address the endpoint sees tells: a ClusterIP keeps a pod's
/// address; an external IP (externalTrafficPolicy Cluster) masquerades it, as kube-proxy does.
#[derive(Debug, Clone, Copy)]
enum Via {
    ClusterIp,
    External,
}

/// Waits until every connection to `ip:443` from the client pod reaches `pod`, then checks 20 more do (none
/// may go anywhere else) and that the pod sees the source `via` gives: the client's own address through a
/// ClusterIP, the node's side of the pod's link through an external IP.
#[track_caller]
fn expect_pod(sb: &sandbox::Sandbox, agent: &Agent, ip: &str, pod: usize, via: Via, when: &str) {
    expect_pod_from(sb.client(), agent, ip, pod, when);
    let source = match via {
        Via::ClusterIp => IpAddr::from(sandbox::pod_ip_v4(0)),
        Via::External => IpAddr::from(sandbox::pod_gateway_v4(pod)),
    };
    let seen = answers(sb.client(), ip, 20, Duration::from_secs(2));
    assert!(
        seen.iter().all(|a| *a == Ok((pod, source))),
        "{when}: {ip}:{PORT} must reach pod {pod} only, from {source} ({via:?}): {seen:?}; log:\n{}",
        agent.log()
    );
}

/// The same from any namespace, without the check of the source address.
#[track_caller]
fn expect_pod_from(from: &NetNs, agent: &Agent, ip: &str, pod: usize, when: &str) {
    wait_until(SYNC, || all_from(&answers(from, ip, 6, SHORT), pod)).unwrap_or_else(|_| {
        panic!(
            "{when}: {ip}:{PORT} never answered from pod {pod} alone from {} (last: {:?}); log:\n{}",
            from.name(),
            answers(from, ip, 6, SHORT),
            agent.log()
        )
    });
    let seen = answers(from, ip, 20, Duration::from_secs(2));
    assert!(
        all_from(&seen, pod),
        "{when}: {ip}:{PORT} must reach pod {pod} only from {}: {seen:?}; log:\n{}",
        from.name(),
        agent.log()
    );
}

/// Waits until every connection to `ip:443` from the client pod is refused (a service without endpoints).
#[track_caller]
fn expect_refused_connections(sb: &sandbox::Sandbox, agent: &Agent, ip: &str, when: &str) {
    let refused = |seen: &[Answer]| {
        seen.iter()
            .all(|a| *a == Err(io::ErrorKind::ConnectionRefused))
    };
    wait_until(SYNC, || refused(&answers(sb.client(), ip, 6, SHORT))).unwrap_or_else(|_| {
        panic!(
            "{when}: {ip}:{PORT} never refused (last: {:?}); log:\n{}",
            answers(sb.client(), ip, 6, SHORT),
            agent.log()
        )
    });
    let seen = answers(sb.client(), ip, 20, Duration::from_secs(2));
    assert!(refused(&seen), "{when}: {ip}:{PORT}: {seen:?}");
}

/// `nftkube_refused_frontend_claims` from the agent's /metrics (in the node namespace).
fn refused_claims(node: &NetNs) -> Option<f64> {
    let at: SocketAddr = METRICS.parse().unwrap();
    let (status, _, body) = node.run(move || get(at, "/metrics", SHORT)).ok()?.ok()?;
    if status != 200 {
        return None;
    }
    body.lines()
        .find_map(|l| l.strip_prefix(REFUSED)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits until the gauge reads `want` (it is set when the sync that changed it completes).
#[track_caller]
fn expect_waiting_claims(sb: &sandbox::Sandbox, agent: &Agent, want: f64, when: &str) {
    wait_until(SYNC, || refused_claims(sb.node()) == Some(want)).unwrap_or_else(|_| {
        panic!(
            "{when}: {REFUSED} is {:?}, expected {want}; log:\n{}",
            refused_claims(sb.node()),
            agent.log()
        )
    });
}

/// Both services present at the first sync; kept across a restart; the victim deleted (the attacker, the
/// waiting claim, takes the free frontend) and created again (it takes it back); its endpoints changed
/// while the attacker waits.
#[test]
fn a_cluster_ip_keeps_its_frontend_against_an_older_services_external_ip() {
    let sb = sandbox("nk-prec", 3);
    // The outside client routes the VIP to the node: traffic from outside the cluster is dispatched by the
    // same map, and must reach the victim too.
    route_from_outside(&sb, Ipv4Addr::new(10, 96, 0, 1), 32);
    let m = manifests();
    m.write("victim.yaml", &victim(VICTIM_CREATED, &[VICTIM_POD]));
    m.write("attacker.yaml", &attacker(&[ATTACKER_POD]));

    // a. The first sync, both present: the ClusterIP wins.
    let mut agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    expect_pod(
        &sb,
        &agent,
        ATTACKER_CIP,
        ATTACKER_POD,
        Via::ClusterIp,
        "first sync, attacker's own ClusterIP",
    );
    expect_pod(&sb, &agent, VIP, VICTIM_POD, Via::ClusterIp, "first sync");
    expect_pod_from(
        sb.ext(),
        &agent,
        VIP,
        VICTIM_POD,
        "first sync, from outside",
    );
    // One waiting claim: the attacker's 10.96.0.1:443, in the ip family only.
    expect_waiting_claims(&sb, &agent, 1.0, "first sync");

    // b. A restart: the rules stay while no agent runs, and the new agent's full sync keeps the victim and
    // finds nothing to change.
    assert!(agent.stop(), "the agent did not exit cleanly on SIGTERM");
    let seen = answers(sb.client(), VIP, 10, Duration::from_secs(2));
    assert!(all_from(&seen, VICTIM_POD), "no agent running: {seen:?}");
    drop(agent);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    assert!(
        agent.log().contains("full=true changes=0"),
        "the restart's full sync changed the kernel; log:\n{}",
        agent.log()
    );
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "after a restart",
    );
    expect_pod(
        &sb,
        &agent,
        ATTACKER_CIP,
        ATTACKER_POD,
        Via::ClusterIp,
        "after a restart, attacker's own ClusterIP",
    );
    expect_waiting_claims(&sb, &agent, 1.0, "after a restart");

    // c. The victim deleted: its frontend is free, and the waiting claim takes it over (documented).
    m.remove("victim.yaml");
    expect_pod(
        &sb,
        &agent,
        VIP,
        ATTACKER_POD,
        Via::External,
        "victim deleted",
    );
    expect_waiting_claims(&sb, &agent, 0.0, "victim deleted");
    // Created again (younger than ever) while the attacker stays: the ClusterIP takes it back.
    m.write("victim.yaml", &victim(VICTIM_RECREATED, &[VICTIM_POD]));
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "victim created again",
    );
    expect_pod(
        &sb,
        &agent,
        ATTACKER_CIP,
        ATTACKER_POD,
        Via::ClusterIp,
        "victim created again, attacker's own ClusterIP",
    );
    expect_waiting_claims(&sb, &agent, 1.0, "victim created again");

    // The holder's endpoints change while the attacker waits: the frontend stays the victim's.
    m.write("victim.yaml", &victim(VICTIM_RECREATED, &[OTHER_POD]));
    expect_pod(
        &sb,
        &agent,
        VIP,
        OTHER_POD,
        Via::ClusterIp,
        "victim's endpoints changed",
    );
    expect_waiting_claims(&sb, &agent, 1.0, "victim's endpoints changed");
    // Even without any endpoint the victim keeps its frontend: its connections are refused, never sent to
    // the attacker.
    m.write("victim.yaml", &victim(VICTIM_RECREATED, &[]));
    expect_refused_connections(&sb, &agent, VIP, "victim without endpoints");
    expect_waiting_claims(&sb, &agent, 1.0, "victim without endpoints");
    m.write("victim.yaml", &victim(VICTIM_RECREATED, &[OTHER_POD]));
    expect_pod(
        &sb,
        &agent,
        VIP,
        OTHER_POD,
        Via::ClusterIp,
        "victim's endpoints back",
    );

    // The attacker removed: nothing waits any more, and the victim is untouched.
    m.remove("attacker.yaml");
    expect_waiting_claims(&sb, &agent, 0.0, "attacker removed");
    expect_pod(
        &sb,
        &agent,
        VIP,
        OTHER_POD,
        Via::ClusterIp,
        "attacker removed",
    );
    assert!(
        !agent.log().contains("sync failed"),
        "a sync failed; log:\n{}",
        agent.log()
    );
}

/// The reverse arrival order: the victim programmed first, the attacker added later (a partial sync) never
/// gets the frontend, also when its own endpoints change while it waits.
#[test]
fn an_external_ip_added_later_does_not_take_a_programmed_cluster_ip() {
    let sb = sandbox("nk-prec2", 3);
    let m = manifests();
    m.write("victim.yaml", &victim(VICTIM_CREATED, &[VICTIM_POD]));
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    expect_pod(&sb, &agent, VIP, VICTIM_POD, Via::ClusterIp, "victim alone");
    expect_waiting_claims(&sb, &agent, 0.0, "victim alone");

    // d. The attacker arrives: its own ClusterIP is served (so its change was synced), the VIP is not its.
    m.write("attacker.yaml", &attacker(&[ATTACKER_POD]));
    expect_pod(
        &sb,
        &agent,
        ATTACKER_CIP,
        ATTACKER_POD,
        Via::ClusterIp,
        "attacker added, its own ClusterIP",
    );
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "attacker added",
    );
    expect_waiting_claims(&sb, &agent, 1.0, "attacker added");

    // The waiting attacker's endpoints change (a partial sync of the waiting claimant): still waiting.
    m.write("attacker.yaml", &attacker(&[OTHER_POD]));
    expect_pod(
        &sb,
        &agent,
        ATTACKER_CIP,
        OTHER_POD,
        Via::ClusterIp,
        "attacker's endpoints changed, its own ClusterIP",
    );
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "attacker's endpoints changed",
    );
    expect_waiting_claims(&sb, &agent, 1.0, "attacker's endpoints changed");
    // Without endpoints, the waiting attacker's rejection of 10.96.0.1:443 is not committed either.
    m.write("attacker.yaml", &attacker(&[]));
    expect_refused_connections(&sb, &agent, ATTACKER_CIP, "attacker without endpoints");
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "attacker without endpoints",
    );
    expect_waiting_claims(&sb, &agent, 1.0, "attacker without endpoints");

    // The attacker removed: nothing waits.
    m.remove("attacker.yaml");
    expect_waiting_claims(&sb, &agent, 0.0, "attacker removed");
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "attacker removed",
    );
    assert!(
        !agent.log().contains("sync failed"),
        "a sync failed; log:\n{}",
        agent.log()
    );
}

/// A dual-stack Service `ns/name` (port 443/TCP → 8080) with one IPv4 and one IPv6 slice of pod `pod`.
fn dual_stack(
    ns: &str,
    name: &str,
    cluster_ips: [&str; 2],
    external_ips: &[&str],
    created: &str,
    pod: usize,
) -> String {
    let [v4, v6] = cluster_ips;
    let externals = external_ips
        .iter()
        .map(|ip| format!("\"{ip}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let slice = |n: u8, family: &str, ip: String| {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: {name}-{n}, namespace: {ns}, labels: {{kubernetes.io/service-name: {name}}}}}\n\
             addressType: {family}\nports: [{{name: https, port: 8080, protocol: TCP}}]\n\
             endpoints: [{{addresses: [\"{ip}\"], conditions: {{ready: true}}}}]\n"
        )
    };
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {ns}, creationTimestamp: "{created}"}}
spec:
  clusterIP: {v4}
  clusterIPs: [{v4}, "{v6}"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  externalIPs: [{externals}]
  ports: [{{name: https, port: {PORT}, targetPort: 8080, protocol: TCP}}]
{}{}"#,
        slice(1, "IPv4", sandbox::pod_ip_v4(pod).to_string()),
        slice(2, "IPv6", sandbox::pod_ip_v6(pod).to_string()),
    )
}

/// Dual stack: the attacker names the victim's ClusterIP of each family. Each family's frontend is a claim
/// of its own: two wait while both services exist, and both go to the attacker while the victim is gone.
#[test]
fn each_family_is_its_own_contested_frontend() {
    const VIP6: &str = "fd00:96::1";
    let sb = sandbox("nk-prec6", 2);
    let m = manifests();
    let victim = dual_stack(
        "default",
        "kubernetes",
        [VIP, VIP6],
        &[],
        VICTIM_CREATED,
        VICTIM_POD,
    );
    m.write("victim.yaml", &victim);
    m.write(
        "attacker.yaml",
        &dual_stack(
            "aaa",
            "x",
            [ATTACKER_CIP, "fd00:96::77"],
            &[VIP, VIP6],
            ATTACKER_CREATED,
            ATTACKER_POD,
        ),
    );
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "dual stack, IPv4",
    );
    expect_pod_from(sb.client(), &agent, VIP6, VICTIM_POD, "dual stack, IPv6");
    expect_waiting_claims(&sb, &agent, 2.0, "dual stack");

    m.remove("victim.yaml");
    expect_pod(
        &sb,
        &agent,
        VIP,
        ATTACKER_POD,
        Via::External,
        "victim deleted, IPv4",
    );
    expect_pod_from(
        sb.client(),
        &agent,
        VIP6,
        ATTACKER_POD,
        "victim deleted, IPv6",
    );
    expect_waiting_claims(&sb, &agent, 0.0, "victim deleted");
    m.write("victim.yaml", &victim);
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "victim back, IPv4",
    );
    expect_pod_from(sb.client(), &agent, VIP6, VICTIM_POD, "victim back, IPv6");
    expect_waiting_claims(&sb, &agent, 2.0, "victim back");
    assert!(
        !agent.log().contains("sync failed"),
        "a sync failed; log:\n{}",
        agent.log()
    );
}

/// `aaa/x` claiming 10.96.0.1 through its LoadBalancer status instead of `externalIPs`.
fn attacker_by_load_balancer(pods: &[usize]) -> String {
    attacker(pods)
        .replace("  type: ClusterIP\n", "  type: LoadBalancer\n")
        .replace(&format!("  externalIPs: [\"{VIP}\"]\n"), "")
        .replace(
            "protocol: TCP}\n---",
            &format!(
                "protocol: TCP, nodePort: 30443}}\nstatus:\n  loadBalancer:\n    ingress: [{{ip: {VIP}}}]\n---"
            ),
        )
}

/// Regression (the first precedence code failed it): the holder's precedence changes and a claimant
/// of higher precedence arrives in one partial sync. The attacker holds 10.96.0.1:443 through its
/// LoadBalancer ingress IP (no victim); then one manifest change turns the attacker's claim into an external
/// IP and creates the victim. The kernel refuses that partial sync's batch (EEXIST on `service-endpoints`
/// and `service-ips`), "sync failed" is logged, and the attacker keeps the VIP until the retry's full sync a
/// second later. A new creationTimestamp of the attacker instead of the kind change does the same. Each
/// change alone, or the victim with an endpoint change of the attacker, syncs fine.
///
/// Why it happened (fixed in crates/sync/src/index.rs, `cancel_out` now keeps each element's net count): a piece's precedence is part of its identity, so the holder's elements are
/// released (removed) and acquired again (added) with the same bytes; the victim's takeover then removes
/// the holder's new elements once more. Net: one removal. `cancel_out` drops an element that is on both
/// sides whatever the counts, so neither side keeps it: the holder's element stays in the kernel and the
/// victim's element of the same key is refused.
#[test]
fn a_holder_changing_kind_as_a_cluster_ip_arrives_is_one_clean_partial_sync() {
    let sb = sandbox("nk-prec3", 3);
    let m = manifests();
    m.write("both.yaml", &attacker_by_load_balancer(&[ATTACKER_POD]));
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    expect_pod(
        &sb,
        &agent,
        VIP,
        ATTACKER_POD,
        Via::External,
        "the attacker's LoadBalancer IP alone",
    );
    // One file, so that both changes are one partial sync.
    let both = format!(
        "{}---\n{}",
        attacker(&[ATTACKER_POD]),
        victim(VICTIM_CREATED, &[VICTIM_POD])
    );
    m.write("both.yaml", &both);
    agent.wait_syncs(2, SYNC);
    assert!(
        !agent.log().contains("sync failed"),
        "the partial sync failed; log:\n{}",
        agent.log()
    );
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "victim created",
    );
    expect_waiting_claims(&sb, &agent, 1.0, "victim created");
}

/// Regression (the first precedence code failed it): a handover in a partial sync keeps the
/// affinity entries of the frontend. The attacker has sessionAffinity ClientIP and holds 10.96.0.1:443 (no
/// victim); the client's connections record `client . 10.96.0.1 . tcp . 443 : pod2`. The victim is created
/// and takes the frontend; the waiting attacker's endpoints move from pod 2 to pod 3; the victim is deleted,
/// and the attacker gets the frontend back with its affinity chain, which finds the old entry: the client
/// keeps reaching pod 2, an endpoint of no service any more (for the affinity timeout, 3 h, or until a full
/// sync prunes it). The partial sync pruned affinity entries only for the ports it was given (fixed: a frontend
/// that gains affinity in a delta, or loses it, has its entries checked against its endpoints now)
/// (`affinity_touched`, `removed_endpoint_pairs` in `sync_partial`), not for the ports a takeover or a
/// handover changed. (Likewise when the holder had affinity, dropped it and was then deleted: the client
/// then keeps reaching the deleted holder's endpoint.)
#[test]
fn a_handed_over_frontend_forgets_stale_affinity_entries() {
    let sb = sandbox("nk-prec4", 3);
    let m = manifests();
    let affinity = |s: String| {
        s.replace(
            "  type: ClusterIP\n",
            "  type: ClusterIP\n  sessionAffinity: ClientIP\n",
        )
    };
    m.write("attacker.yaml", &affinity(attacker(&[ATTACKER_POD])));
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    expect_pod(
        &sb,
        &agent,
        VIP,
        ATTACKER_POD,
        Via::External,
        "the attacker alone",
    );
    m.write("victim.yaml", &victim(VICTIM_CREATED, &[VICTIM_POD]));
    expect_pod(
        &sb,
        &agent,
        VIP,
        VICTIM_POD,
        Via::ClusterIp,
        "victim created",
    );
    m.write("attacker.yaml", &affinity(attacker(&[OTHER_POD])));
    expect_pod(
        &sb,
        &agent,
        ATTACKER_CIP,
        OTHER_POD,
        Via::ClusterIp,
        "the attacker's endpoints moved",
    );
    m.remove("victim.yaml");
    expect_pod(&sb, &agent, VIP, OTHER_POD, Via::External, "victim deleted");
}

/// Regression (the first precedence code failed it), the mirror of the EEXIST one above and worse: silent. The victim holds 10.96.0.1:443 and `zzz/x` (a namespace that sorts after `default`) waits with
/// `externalIPs: [10.96.0.1]`. One manifest change deletes the victim and gives `zzz/x` a new
/// creationTimestamp (a kind change does the same). The partial sync "completes", the gauge reads 0, and
/// 10.96.0.1:443 has no element in any set: connections time out. The periodic check does not notice (the
/// generation is the one the agent left), so it lasts until the next full sync (a restart, a repair).
///
/// Why it happened (same fix): the victim is updated first; its release hands the frontend over and adds `zzz/x`'s elements of
/// the index (its old pieces); `zzz/x`'s own update then releases those old pieces (removed once) and
/// acquires its new ones with the same bytes (added a second time). Net: one addition; `cancel_out` drops
/// the element from both sides.
#[test]
fn a_frontend_handed_over_to_a_claimant_whose_precedence_changes_is_served() {
    let sb = sandbox("nk-prec5", 2);
    let m = manifests();
    let waiting =
        |created: &str| service("zzz", "x", ATTACKER_CIP, &[VIP], created, &[ATTACKER_POD]);
    m.write(
        "both.yaml",
        &format!(
            "{}---\n{}",
            waiting(ATTACKER_CREATED),
            victim(VICTIM_CREATED, &[VICTIM_POD])
        ),
    );
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    expect_pod(&sb, &agent, VIP, VICTIM_POD, Via::ClusterIp, "both");
    expect_waiting_claims(&sb, &agent, 1.0, "both");
    // One file, so that both changes are one partial sync.
    m.write("both.yaml", &waiting("2021-01-01T00:00:00Z"));
    expect_pod(
        &sb,
        &agent,
        VIP,
        ATTACKER_POD,
        Via::External,
        "victim deleted, zzz/x recreated",
    );
}
