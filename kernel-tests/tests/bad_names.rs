//! Objects with names the API server would refuse, in the manifest source, beside ordinary services: the real
//! agent, real packets. A LoadBalancer Service with a 300-character `metadata.name`,
//! `loadBalancerSourceRanges` and an ingress IP (with its EndpointSlice); a Service in a 300-character
//! namespace; a Service with a 40-character port name. Each is refused at conversion with the rule it breaks
//! (`crates/source/src/validate.rs`, logged with the file and the rule; the line shows prefixes of the name, never
//! all of it: the last test), and
//! everything else is programmed: at start, and when such an object arrives while the agent runs beside an
//! ordinary change. /healthz and /livez stay 200, and no chain in the kernel has a name longer than the
//! kernel's limit (255 bytes). A LoadBalancer with the longest names the API server takes (63-character
//! namespace and name, 15-character port name) and source ranges is programmed and served as any other.
//!
//! Why this fails on the code before the fix (checked against 5055fc4 with `NFTKUBE_BIN`): the manifest source
//! took any name, and the long LoadBalancer's firewall chain was named after it
//! (`fw-TAYV74C6-demo/lb-aaaa…/tcp/tcp-ip`, past the kernel's 255 bytes). The kernel refused that `add chain`
//! with ERANGE ("Numerical result out of range (os error 34)"), which failed the whole batch ("sync failed, the
//! previous rules stay in place: nf_tables transaction rejected, nothing applied"), retried every second or
//! so. With the object present at start nothing was ever programmed: the first `wait_syncs` below never sees a
//! sync complete (the echo service never answers). Started without it and given it later (the second part),
//! the old agent took the object and froze: the new ordinary service written beside it never answered within
//! `LATENCY` (every later sync failed whole, the endpoint change's too). (The review also saw /healthz and /livez
//! turn 503 in that state: the health checks here would catch it; the runs against 5055fc4 stopped before.)

use kernel_tests::sandbox::{self, tcp_requests};
use kernel_tests::*;
use nftkube::admin::http::get;
use nftkube::nft::ir::Family;
use nftkube::nft::netlink::NftSocket;
use nftkube_sandbox::netns::NetNs;
use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

/// Hang guard for the first sync.
const SYNC: Duration = Duration::from_secs(15);
/// How long an ordinary change may take to reach traffic (a manifest edit usually takes well under a second;
/// see `event_loop.rs`).
const LATENCY: Duration = Duration::from_secs(5);
const SHORT: Duration = Duration::from_millis(400);
const T: Duration = Duration::from_secs(2);
const HEALTHZ: &str = "127.0.0.1:10256";
const METRICS: &str = "127.0.0.1:10249";
/// The kernel's limit on chain names (NFT_CHAIN_MAXNAMELEN less the NUL).
const CHAIN_NAME_MAX: usize = 255;

/// The examples' echo service: pods 1..3.
const ECHO: &str = "10.96.0.10";
/// An ordinary LoadBalancer with source ranges (only the outside client): its firewall chain is the positive
/// control for the hostile one's.
const LB_OK_CIP: &str = "10.96.0.80";
const LB_OK_IP: &str = "192.168.250.80";
/// The same with the longest valid names (see `max_names`).
const LB_MAX_CIP: &str = "10.96.0.81";
const LB_MAX_IP: &str = "192.168.250.81";
/// The hostile objects' addresses: none may be served.
const LONG_LB_CIP: &str = "10.96.0.90";
const LONG_LB_IP: &str = "192.168.250.90";
const LONG_LB_NODE_PORT: u16 = 30190;
const LONG_NS_CIP: &str = "10.96.0.91";
const LONG_PORT_CIP: &str = "10.96.0.92";
/// Added while the agent runs.
const LATE_LB_CIP: &str = "10.96.0.93";
const LATE_LB_IP: &str = "192.168.250.93";
const LATE_LB_NODE_PORT: u16 = 30193;
const FRESH_CIP: &str = "10.96.0.78";

/// A 300-character name shaped like a Service name: only its length is wrong.
fn long_name(c: char) -> String {
    format!("lb-{}", c.to_string().repeat(297))
}

/// A ClusterIP service `ns/name` (port `name`/80 → 8080) and its EndpointSlice with the sandbox pods `pods`.
fn service(ns: &str, name: &str, port_name: &str, cluster_ip: &str, pods: &[usize]) -> String {
    let endpoints: String = pods
        .iter()
        .map(|&i| format!("- {{addresses: [\"{}\"]}}\n", sandbox::pod_ip_v4(i)))
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\n\
         spec:\n  clusterIP: {cluster_ip}\n  clusterIPs: [{cluster_ip}]\n\
         \x20 ports: [{{name: {port_name}, port: 80, targetPort: 8080, protocol: TCP}}]\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}-1, namespace: {ns}, labels: {{kubernetes.io/service-name: {name}}}}}\n\
         addressType: IPv4\nports: [{{name: {port_name}, port: 8080, protocol: TCP}}]\nendpoints:\n{endpoints}"
    )
}

/// A LoadBalancer `demo/name` (port `tcp` 80 → 8080) whose source ranges allow the outside client only, with
/// an ingress IP and an EndpointSlice with pod `pod`.
fn load_balancer(
    name: &str,
    cluster_ip: &str,
    ingress: &str,
    node_port: u16,
    pod: usize,
) -> String {
    load_balancer_in("demo", name, "tcp", cluster_ip, ingress, node_port, pod)
}

/// The same in namespace `ns`, with port name `port`.
fn load_balancer_in(
    ns: &str,
    name: &str,
    port: &str,
    cluster_ip: &str,
    ingress: &str,
    node_port: u16,
    pod: usize,
) -> String {
    let client = sandbox::ext_ip_v4();
    let pod = sandbox::pod_ip_v4(pod);
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\n\
         spec:\n  type: LoadBalancer\n  clusterIP: {cluster_ip}\n  clusterIPs: [{cluster_ip}]\n\
         \x20 loadBalancerSourceRanges: [\"{client}/32\"]\n\
         \x20 ports: [{{name: {port}, port: 80, targetPort: 8080, protocol: TCP, nodePort: {node_port}}}]\n\
         status:\n  loadBalancer:\n    ingress: [{{ip: {ingress}}}]\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}-1, namespace: {ns}, labels: {{kubernetes.io/service-name: {name}}}}}\n\
         addressType: IPv4\nports: [{{name: {port}, port: 8080, protocol: TCP}}]\n\
         endpoints:\n- {{addresses: [\"{pod}\"]}}\n"
    )
}

/// The longest names the API server takes (63-character namespace and name, 15-character port name): an
/// ordinary LoadBalancer with source ranges, programmed as any other (its firewall chain keeps its readable
/// name: the bound is not a cut of every long name).
fn max_names() -> String {
    load_balancer_in(
        &"m".repeat(63),
        &"z".repeat(63),
        "abcdefghijklmno",
        LB_MAX_CIP,
        LB_MAX_IP,
        30181,
        1,
    )
}

/// The three hostile objects of the first part, in one file.
fn hostile() -> String {
    [
        load_balancer(
            &long_name('a'),
            LONG_LB_CIP,
            LONG_LB_IP,
            LONG_LB_NODE_PORT,
            2,
        ),
        service(&"n".repeat(300), "victim", "tcp", LONG_NS_CIP, &[2]),
        service("demo", "longport", &"p".repeat(40), LONG_PORT_CIP, &[2]),
    ]
    .join("---\n")
}

/// `n` fresh connections to `ip:80` from `from`: the pods that answered; empty if any failed.
fn answering(from: &NetNs, ip: &str, n: usize) -> BTreeSet<usize> {
    let answers = tcp_requests(from, addr(ip, 80), n, SHORT);
    if answers.iter().any(|a| a.is_err()) {
        return BTreeSet::new();
    }
    pods(&answers)
}

fn served_at(from: &NetNs, dst: SocketAddr) -> bool {
    served(from, dst, SHORT)
}

/// GET `path` on the agent's admin address `at` (in the node namespace): (status, body).
fn admin(sb: &sandbox::Sandbox, at: &str, path: &str) -> (u16, String) {
    let at: SocketAddr = at.parse().unwrap();
    let owned = path.to_string();
    let (status, _, body) = sb
        .node()
        .run(move || get(at, &owned, T))
        .expect("entering the node namespace")
        .unwrap_or_else(|e| panic!("GET {at}{path}: {e}"));
    (status, body)
}

/// A sample of the agent's /metrics (a name without labels).
fn metric(sb: &sandbox::Sandbox, name: &str) -> Option<f64> {
    let (status, body) = admin(sb, METRICS, "/metrics");
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// Every chain of every table in `ns` (all families, ours and anyone's), as `family table chain`, read back
/// through netlink.
fn chains(ns: &NetNs) -> Vec<(Family, String, String)> {
    ns.run(|| {
        let mut s = NftSocket::open().expect("nf_tables socket");
        let mut out = Vec::new();
        for family in [Family::Ip, Family::Ip6, Family::Inet] {
            for table in s.list_tables(family).expect("listing tables") {
                if let Some(t) = s.dump_table(family, &table).expect("dumping a table") {
                    out.extend(t.chains.into_keys().map(|c| (family, table.clone(), c)));
                }
            }
        }
        out
    })
    .expect("entering the node namespace")
}

/// The agent is running, /healthz and /livez answer 200, nothing was refused by the kernel (the names were
/// refused before), no chain name is past the kernel's limit or carries a hostile name, and the ordinary
/// LoadBalancer's firewall chain is there.
#[track_caller]
fn expect_healthy(sb: &sandbox::Sandbox, agent: &mut Agent, when: &str) {
    assert!(
        agent.running(),
        "{when}: the agent exited; log:\n{}",
        agent.log()
    );
    let (status, body) = admin(sb, HEALTHZ, "/healthz");
    assert_eq!(
        status,
        200,
        "{when}: /healthz: {body}; log:\n{}",
        agent.log()
    );
    assert!(
        !body.contains("rejectedServices"),
        "{when}: the kernel refused something: {body}"
    );
    let (status, body) = admin(sb, HEALTHZ, "/livez");
    assert_eq!(status, 200, "{when}: /livez: {body}; log:\n{}", agent.log());
    assert_eq!(
        metric(sb, "nftkube_quarantined_service_ports"),
        Some(0.0),
        "{when}"
    );
    assert_eq!(
        metric(sb, "nftkube_kernel_rejected_service_ports_total"),
        Some(0.0),
        "{when}"
    );

    let all = chains(sb.node());
    let long: Vec<_> = all
        .iter()
        .filter(|(_, _, c)| c.len() > CHAIN_NAME_MAX)
        .collect();
    assert!(
        long.is_empty(),
        "{when}: chain names past {CHAIN_NAME_MAX}: {long:?}"
    );
    for hostile in [
        "a".repeat(40),
        "b".repeat(40),
        "n".repeat(40),
        "p".repeat(16),
    ] {
        let named: Vec<_> = all
            .iter()
            .filter(|(_, _, c)| c.contains(&hostile))
            .collect();
        assert!(
            named.is_empty(),
            "{when}: chains of a refused object: {named:?}"
        );
    }
    let firewalls: Vec<_> = all
        .iter()
        .filter(|(f, t, c)| *f == Family::Ip && t == "nftkube" && c.starts_with("fw-"))
        .map(|(_, _, c)| c.as_str())
        .collect();
    let max_id = format!("{}/{}/tcp/abcdefghijklmno", "m".repeat(63), "z".repeat(63));
    assert!(
        firewalls.len() == 2
            && firewalls.iter().any(|c| c.contains("-demo/lb-ok/"))
            && firewalls.iter().any(|c| c.contains(&max_id)),
        "{when}: expected the firewall chains of lb-ok and of the longest valid names only: {firewalls:?}"
    );
}

/// None of the hostile addresses is served: not the ClusterIPs, not the LoadBalancer IP (from the client
/// the source ranges would allow), not the NodePort.
#[track_caller]
fn expect_not_served(sb: &sandbox::Sandbox, cluster_ips: &[&str], lbs: &[(&str, u16)], when: &str) {
    let node = sandbox::node_ip_v4().to_string();
    for ip in cluster_ips {
        assert!(
            !served_at(sb.client(), addr(ip, 80)),
            "{when}: {ip}:80 is served"
        );
    }
    for (ip, node_port) in lbs {
        assert!(
            !served_at(sb.ext(), addr(ip, 80)),
            "{when}: {ip}:80 is served"
        );
        assert!(
            !served_at(sb.client(), addr(&node, *node_port)),
            "{when}: NodePort {node_port} is served"
        );
    }
}

/// Log lines that mention `needle`.
fn lines_with(log: &str, needle: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

#[test]
fn objects_with_names_the_api_server_refuses_are_refused_alone() {
    let sb = sandbox("nk-names", 3);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let m = Manifests::examples();
    m.write(
        "lb-ok.yaml",
        &load_balancer("lb-ok", LB_OK_CIP, LB_OK_IP, 30180, 3),
    );
    m.write("max-names.yaml", &max_names());
    m.write("hostile.yaml", &hostile());

    // 1. At start: the ordinary services are programmed by the first sync.
    let mut agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    assert_eq!(
        answering(sb.client(), ECHO, 30),
        BTreeSet::from([1, 2, 3]),
        "first sync: echo; log:\n{}",
        agent.log()
    );
    // The ordinary LoadBalancer: its ingress IP serves the allowed outside client and not a pod.
    assert!(
        served_at(sb.ext(), addr(LB_OK_IP, 80)),
        "first sync: lb-ok from outside; log:\n{}",
        agent.log()
    );
    assert!(
        !served_at(sb.client(), addr(LB_OK_IP, 80)),
        "first sync: lb-ok's source ranges not enforced"
    );
    assert!(served_at(sb.client(), addr(LB_OK_CIP, 80)));
    // The longest valid names: the same.
    assert!(
        served_at(sb.ext(), addr(LB_MAX_IP, 80)),
        "first sync: the longest valid names from outside; log:\n{}",
        agent.log()
    );
    assert!(!served_at(sb.client(), addr(LB_MAX_IP, 80)));
    assert!(served_at(sb.client(), addr(LB_MAX_CIP, 80)));
    expect_not_served(
        &sb,
        &[LONG_LB_CIP, LONG_NS_CIP, LONG_PORT_CIP],
        &[(LONG_LB_IP, LONG_LB_NODE_PORT)],
        "first sync",
    );

    // Each refusal is logged with the rule it breaks and the file it came from; the long names are shown
    // by a prefix only.
    let log = agent.log();
    for rule in [
        "not a Service name",
        "metadata.namespace",
        "IANA service name",
    ] {
        let lines = lines_with(&log, rule);
        assert!(
            lines.iter().any(|l| l.contains("hostile.yaml")),
            "no refusal naming {rule:?} and the file; log:\n{log}"
        );
    }
    assert!(
        lines_with(&log, "metadata.name")
            .iter()
            .any(|l| l.contains(&long_name('a')[..40])),
        "the refused name's prefix is not shown; log:\n{log}"
    );
    // (That the whole name is not logged is the last test's business.)
    expect_healthy(&sb, &mut agent, "first sync");

    // 2. While it runs: a file with another long-named LoadBalancer and a new ordinary service, then the
    // next write an endpoint change of echo (pod 2 leaves). Both ordinary changes reach traffic promptly.
    let refusals_before = lines_with(&agent.log(), "not a Service name").len();
    let late = [
        load_balancer(
            &long_name('b'),
            LATE_LB_CIP,
            LATE_LB_IP,
            LATE_LB_NODE_PORT,
            2,
        ),
        service("demo", "fresh", "tcp", FRESH_CIP, &[3]),
    ]
    .join("---\n");
    let written = Instant::now();
    m.write("late.yaml", &late);
    let slices = m.read("endpointslices.yaml");
    m.write(
        "endpointslices.yaml",
        &without_endpoint(&slices, &sandbox::pod_ip_v4(2).to_string()),
    );
    wait_until(LATENCY, || {
        answering(sb.client(), FRESH_CIP, 3) == BTreeSet::from([3])
    })
    .unwrap_or_else(|_| {
        panic!(
            "the new service beside the hostile one never served within {LATENCY:?}; log:\n{}",
            agent.log()
        )
    });
    wait_until(LATENCY, || {
        answering(sb.client(), ECHO, 20) == BTreeSet::from([1, 3])
    })
    .unwrap_or_else(|_| {
        panic!(
            "the endpoint change never reached traffic within {LATENCY:?}; log:\n{}",
            agent.log()
        )
    });
    eprintln!(
        "ordinary changes beside a hostile object → traffic: {:?}",
        written.elapsed()
    );
    assert_eq!(
        answering(sb.client(), ECHO, 30),
        BTreeSet::from([1, 3]),
        "after the change"
    );
    assert_eq!(answering(sb.client(), FRESH_CIP, 10), BTreeSet::from([3]));
    // The rest stays as it was.
    assert!(
        served_at(sb.ext(), addr(LB_OK_IP, 80)),
        "after the change: lb-ok"
    );
    assert!(
        served_at(sb.ext(), addr(LB_MAX_IP, 80)),
        "after the change: the longest valid names"
    );
    expect_not_served(
        &sb,
        &[LONG_LB_CIP, LONG_NS_CIP, LONG_PORT_CIP, LATE_LB_CIP],
        &[
            (LONG_LB_IP, LONG_LB_NODE_PORT),
            (LATE_LB_IP, LATE_LB_NODE_PORT),
        ],
        "after the change",
    );
    let log = agent.log();
    let refusals = lines_with(&log, "not a Service name");
    assert!(
        refusals.len() > refusals_before && refusals.iter().any(|l| l.contains("late.yaml")),
        "the late hostile object's refusal is not logged; log:\n{log}"
    );
    expect_healthy(&sb, &mut agent, "after the change");

    assert!(
        agent.stop(),
        "the agent did not exit cleanly on SIGTERM; log:\n{}",
        agent.log()
    );
}

/// What the log shows of a refused 300-character name or namespace: prefixes, never the whole name (the
/// rule's message shows 40 characters and the length, the object's description 63 and '…').
///
/// A regression test: when it was written, the manifest source described the failed document's object as
/// `namespace/name` in full (`DocContext::named_object`), so every refusal line carried the whole name.
#[test]
fn refusals_do_not_log_a_long_name_whole() {
    let sb = sandbox("nk-namelog", 1);
    let m = Manifests::examples();
    m.write("hostile.yaml", &hostile());
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    let log = agent.log();
    for rule in ["not a Service name", "metadata.namespace"] {
        assert!(
            !lines_with(&log, rule).is_empty(),
            "no {rule:?} refusal; log:\n{log}"
        );
    }
    let whole: Vec<String> = [long_name('a'), "n".repeat(300)]
        .iter()
        .flat_map(|name| lines_with(&log, name))
        .collect();
    assert!(
        whole.is_empty(),
        "{} log lines carry a whole 300-character name or namespace:\n{}",
        whole.len(),
        whole.join("\n")
    );
}
