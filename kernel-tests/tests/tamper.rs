//! Whatever differs from the desired state is repaired: someone else (`nft`, run in the node namespace)
//! tampers with our tables in one way per test, and real TCP through a ClusterIP, from the client pod, must be
//! back within a second, after exactly one repair sync, with the kernel holding exactly what it held before.

use kernel_tests::sandbox::{parse_answer, tcp_request, tcp_request_here};
use kernel_tests::*;
use nftkube::nft::ir::{Family, TableState};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SYNC: Duration = Duration::from_secs(15);
/// How long a repair may take, tamper to traffic back.
const REPAIR: Duration = Duration::from_secs(1);

fn echo() -> SocketAddr {
    "10.96.0.10:80".parse().unwrap()
}

/// `nft -a list chain ip nftkube CHAIN`.
fn list_chain_with_handles(sb: &sandbox::Sandbox, chain: &str) -> String {
    let out = sb
        .node()
        .command("nft")
        .args(["-a", "list", "chain", "ip", "nftkube", chain])
        .output()
        .expect("running nft");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Repair syncs the agent has completed (its "sync complete" lines with `repair=true`).
fn repairs(agent: &Agent) -> usize {
    agent
        .log()
        .lines()
        .filter(|l| l.contains("sync complete") && l.contains("repair=true"))
        .count()
}

/// A sandbox with the examples programmed and the echo service answering; the ip table as programmed.
fn steady(tag: &str, extra: &[&str]) -> (sandbox::Sandbox, Manifests, Agent, TableState) {
    steady_with(tag, extra, &[])
}

/// `steady`, with more manifest files (name, content) beside the examples.
fn steady_with(
    tag: &str,
    extra: &[&str],
    files: &[(&str, String)],
) -> (sandbox::Sandbox, Manifests, Agent, TableState) {
    let sb = sandbox(tag, 3);
    let m = Manifests::examples();
    for (name, content) in files {
        m.write(name, content);
    }
    let agent = Agent::start(sb.node(), &m.dir, extra);
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || {
        tcp_request(sb.client(), echo(), Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("echo never reachable; log:\n{}", agent.log()));
    // Let any sync that follows the first (released chains) happen before taking the reference.
    std::thread::sleep(Duration::from_millis(400));
    let table = dump_table(sb.node(), Family::Ip).expect("our ip table");
    assert_eq!(repairs(&agent), 0, "{}", agent.log());
    (sb, m, agent, table)
}

/// Tampers with `script(sandbox)` and checks the repair: traffic back within `REPAIR` of the tamper, exactly
/// one repair sync, and the table exactly as before.
fn tamper_and_check_repair(tag: &str, what: &str, script: impl Fn(&sandbox::Sandbox) -> String) {
    tamper_and_check_repair_with(tag, what, &[], script)
}

/// `tamper_and_check_repair`, with more manifest files beside the examples.
fn tamper_and_check_repair_with(
    tag: &str,
    what: &str,
    files: &[(&str, String)],
    script: impl Fn(&sandbox::Sandbox) -> String,
) {
    let (sb, _m, agent, before) = steady_with(tag, &[], files);
    let script = script(&sb);
    let tampered_at = Instant::now();
    nft_script(sb.node(), &script);
    let applied = tampered_at.elapsed();
    // Fresh connections, each with a short timeout (the resolution of the measurement); the first ones fail
    // while the tables are wrong.
    let took = sb
        .client()
        .run(move || loop {
            if tcp_request_here(echo(), Duration::from_millis(50)).is_ok() {
                return Some(tampered_at.elapsed());
            }
            if tampered_at.elapsed() > Duration::from_secs(5) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        })
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: traffic never came back; log:\n{}", agent.log()));
    eprintln!("{what}: nft applied after {applied:?}, traffic back {took:?} after the tamper");
    assert!(took < REPAIR, "{what}: traffic back only after {took:?}");
    // Any second repair (or a repair loop) would show within this time.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        repairs(&agent),
        1,
        "{what}: expected exactly one repair sync; log:\n{}",
        agent.log()
    );
    let after = dump_table(sb.node(), Family::Ip).expect("our ip table after the repair");
    assert_eq!(after, before, "{what}: the table is not as it was");
    let answers: Vec<_> = (0..20)
        .map(|_| tcp_request(sb.client(), echo(), Duration::from_secs(2)))
        .collect();
    assert!(
        answers
            .iter()
            .all(|a| a.as_ref().is_ok_and(|s| parse_answer(s).is_some())),
        "{what}: {answers:?}"
    );
}

#[test]
fn a_dormant_table_is_woken() {
    tamper_and_check_repair("nk-tdorm", "table made dormant", |_| {
        "add table ip nftkube { flags dormant; }".into()
    });
}

#[test]
fn a_base_chain_policy_drop_is_set_back_to_accept() {
    tamper_and_check_repair("nk-tpol", "filter-forward policy drop", |_| {
        "add chain ip nftkube filter-forward { type filter hook forward priority -10; policy drop; }"
            .into()
    });
}

#[test]
fn a_hook_priority_change_is_undone() {
    // The kernel changes no priority in place: whoever wants another one re-creates the chain.
    tamper_and_check_repair("nk-tprio", "nat-prerouting priority 50", |_| {
        "flush chain ip nftkube nat-prerouting\n\
         delete chain ip nftkube nat-prerouting\n\
         add chain ip nftkube nat-prerouting { type nat hook prerouting priority 50; policy accept; }\n"
            .into()
    });
}

/// The repair re-creates a base chain inside one batch: connections going through it all along never notice.
/// Here the tamper itself keeps traffic working (nat at priority 50 still DNATs), so any failure would be the
/// repair's.
#[test]
fn replacing_a_chain_with_another_priority_drops_no_connection() {
    let (sb, _m, agent, before) = steady("nk-tprio2", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (s, o, f) = (stop.clone(), ok.clone(), failed.clone());
    let client = sb
        .client()
        .spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match tcp_request_here(echo(), Duration::from_secs(2)) {
                    Ok(a) if parse_answer(&a).is_some() => o.fetch_add(1, Ordering::SeqCst),
                    _ => f.fetch_add(1, Ordering::SeqCst),
                };
            }
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    nft_script(
        sb.node(),
        "flush chain ip nftkube nat-prerouting\n\
         delete chain ip nftkube nat-prerouting\n\
         add chain ip nftkube nat-prerouting { type nat hook prerouting priority 50; policy accept; }\n\
         add rule ip nftkube nat-prerouting jump services\n",
    );
    wait_until(Duration::from_secs(5), || repairs(&agent) == 1)
        .unwrap_or_else(|_| panic!("no repair; log:\n{}", agent.log()));
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    client.join().unwrap();
    let (ok, failed) = (ok.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    eprintln!("connections across the tamper and the repair: {ok} answered, {failed} failed");
    assert!(ok > 50, "too few connections to mean anything: {ok}");
    assert_eq!(
        failed, 0,
        "connections failed across the chain's replacement"
    );
    assert_eq!(
        dump_table(sb.node(), Family::Ip).expect("our table"),
        before
    );
    assert_eq!(repairs(&agent), 1, "{}", agent.log());
}

#[test]
fn a_foreign_rule_at_the_head_of_services_is_removed() {
    tamper_and_check_repair("nk-tfrule", "foreign rule at the head of services", |_| {
        "insert rule ip nftkube services ip daddr 10.96.0.10 tcp dport 80 drop".into()
    });
}

#[test]
fn a_deleted_rule_of_ours_is_restored() {
    tamper_and_check_repair("nk-tdrule", "dispatch rule deleted", |sb| {
        let listing = list_chain_with_handles(sb, "services");
        let line = listing
            .lines()
            .find(|l| l.contains("@lb-ips goto lb"))
            .unwrap_or_else(|| panic!("no dispatch rule in:\n{listing}"));
        let handle = line
            .rsplit("# handle ")
            .next()
            .and_then(|h| h.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no handle in {line}"));
        format!("delete rule ip nftkube services handle {handle}")
    });
}

/// Services, each with its ClusterIP and the three pods as endpoints: five elements or more each, so the
/// cold sync is committed with the event monitor paused (`sync::quiet`).
const LARGE: usize = 300;

fn large_manifest() -> String {
    let pods: Vec<String> = (1..=3).map(|p| sandbox::pod_ip_v4(p).to_string()).collect();
    (0..LARGE)
        .map(|i| {
            let ip = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 100, 0, 0)) + i as u32);
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: large{i}, namespace: demo}}\nspec:\n  clusterIP: {ip}\n  ports: [{{name: tcp, port: 80, targetPort: {port}, protocol: TCP}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: large{i}-a, namespace: demo, labels: {{kubernetes.io/service-name: large{i}}}}}\naddressType: IPv4\nports: [{{name: tcp, port: {port}, protocol: TCP}}]\nendpoints:\n- addresses: [{}, {}, {}]\n  conditions: {{ready: true}}\n",
                pods[0], pods[1], pods[2], port = BACKEND_TCP_PORT,
            )
        })
        .collect()
}

#[test]
fn after_a_large_commit_the_monitor_listens_again() {
    const { assert!(LARGE * 5 >= nftkube::sync::quiet::QUIET_COMMIT_ELEMENTS) };
    tamper_and_check_repair_with(
        "nk-tlarge",
        "dispatch element deleted after a large commit",
        &[("large.yaml", large_manifest())],
        |_| "delete element ip nftkube lb-ips { 10.96.0.10 . tcp . 80 }".into(),
    );
}

#[test]
fn a_deleted_element_is_restored() {
    tamper_and_check_repair("nk-tdel", "dispatch element deleted", |_| {
        "delete element ip nftkube lb-ips { 10.96.0.10 . tcp . 80 }".into()
    });
}

/// A frontend moved from its dispatch set to a foreign verdict: both are repaired.
#[test]
fn a_changed_element_verdict_is_restored() {
    tamper_and_check_repair("nk-tverd", "dispatch element verdict changed", |_| {
        "delete element ip nftkube lb-ips { 10.96.0.10 . tcp . 80 }\n\
         add element ip nftkube service-ips { 10.96.0.10 . tcp . 80 : drop }\n"
            .into()
    });
}

#[test]
fn a_flushed_map_is_refilled() {
    tamper_and_check_repair("nk-tflmap", "endpoint map flushed", |_| {
        "flush map ip nftkube service-endpoints".into()
    });
}

#[test]
fn a_deleted_regular_chain_is_restored() {
    // A chain others jump to cannot go alone: the jumps go first, in the same batch.
    tamper_and_check_repair("nk-tdchain", "services chain deleted", |_| {
        "flush chain ip nftkube nat-prerouting\n\
         flush chain ip nftkube nat-output\n\
         flush chain ip nftkube services\n\
         delete chain ip nftkube services\n"
            .into()
    });
}

#[test]
fn a_deleted_table_is_restored() {
    tamper_and_check_repair("nk-tdtab", "table deleted", |_| {
        "delete table ip nftkube".into()
    });
}

#[test]
fn a_flushed_ruleset_is_restored() {
    tamper_and_check_repair("nk-tflrs", "ruleset flushed", |_| "flush ruleset".into());
}

#[test]
fn a_foreign_base_chain_is_removed() {
    tamper_and_check_repair("nk-tfchain", "foreign drop-all forward chain", |_| {
        "add chain ip nftkube intruder { type filter hook forward priority 0; policy drop; }".into()
    });
}

#[test]
fn a_foreign_set_and_element_are_removed() {
    // Nothing here stops traffic: the repair is checked by the table read back and the single repair sync.
    tamper_and_check_repair("nk-tfset", "foreign set and element", |_| {
        "add set ip nftkube intruders { type ipv4_addr; size 16; }\n\
         add element ip nftkube intruders { 192.0.2.1 }\n\
         add element ip nftkube cluster-ips { 10.96.0.99 }\n"
            .into()
    });
}

/// The agent's own commits are not drift: manifest edits (partial syncs, chains created and released) and
/// periodic full syncs cause no repair.
#[test]
fn the_agents_own_commits_cause_no_repair() {
    // Periodic full syncs every second as well, each reading the kernel back (`--full-read-period 0`, not
    // trusting the generation id): they must find it as committed.
    let (_sb, m, agent, _) = steady(
        "nk-tself",
        &["--sync-period", "1", "--full-read-period", "0"],
    );
    let slices = m.read("endpointslices.yaml");
    let fewer = without_endpoint(&slices, &sandbox::pod_ip_v4(1).to_string());
    let syncs = || agent.log().matches("sync complete").count();
    for content in [&fewer, &slices, &fewer, &slices, &fewer, &slices] {
        let n = syncs();
        m.write("endpointslices.yaml", content);
        wait_until(SYNC, || syncs() > n)
            .unwrap_or_else(|_| panic!("the edit was not synced; log:\n{}", agent.log()));
        // The follow-up sync that deletes a released chain, and any event of our own commits.
        std::thread::sleep(Duration::from_millis(600));
    }
    // Quiet for more than a sync period: the last periodic full sync has nothing left to do.
    std::thread::sleep(Duration::from_millis(1500));
    let log = agent.log();
    assert!(
        log.matches("sync complete").count() >= 7,
        "expected the edits' syncs:\n{log}"
    );
    // Periodic full syncs read the kernel back: it is as committed. (One that follows an edit may delete the
    // chain the edit released; the last ones, a second after the last edit, have nothing at all to do.)
    let periodic: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("sync complete") && l.contains("full=true"))
        .skip(1)
        .collect();
    assert!(periodic.len() >= 3, "no periodic full syncs:\n{log}");
    let last = periodic.last().unwrap();
    assert!(
        last.contains("changes=0"),
        "the last full sync changed something: {last}\n{log}"
    );
    assert_eq!(repairs(&agent), 0, "{log}");
    assert!(!log.contains("changed by someone else"), "{log}");
}

/// One connection of the black-hole test: when it started, and how it ended.
type Attempt = (Instant, Result<(), String>);

/// After a repair no client stays black-holed: connections tried while the rules were gone leave conntrack
/// entries that were never DNATed, and a later connection from the same source port would follow them. The
/// client's port range is narrowed to 64 ports, so ports come back within a fraction of a second.
#[test]
fn no_client_stays_black_holed_after_a_ruleset_flush() {
    let (sb, _m, agent, _) = steady("nk-tbh", &[]);
    sb.client()
        .run(|| std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "40000 40063"))
        .unwrap()
        .expect("narrowing the client's port range");
    let stop = Arc::new(AtomicBool::new(false));
    let results: Arc<Mutex<Vec<Attempt>>> = Arc::default();
    let (s, r) = (stop.clone(), results.clone());
    let client = sb
        .client()
        .spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let start = Instant::now();
                let outcome = match tcp_request_here(echo(), Duration::from_millis(200)) {
                    Ok(a) if parse_answer(&a).is_some() => Ok(()),
                    Ok(a) => Err(format!("odd answer {a:?}")),
                    Err(e) => Err(e.to_string()),
                };
                r.lock().unwrap().push((start, outcome));
                std::thread::sleep(Duration::from_millis(5));
            }
        })
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let flushed_at = Instant::now();
    nft_script(sb.node(), "flush ruleset");
    std::thread::sleep(Duration::from_secs(38));
    stop.store(true, Ordering::SeqCst);
    client.join().unwrap();

    let results = results.lock().unwrap();
    let late: Vec<_> = results
        .iter()
        .filter(|(t, o)| o.is_err() && *t > flushed_at + REPAIR)
        .map(|(t, o)| (t.duration_since(flushed_at), o.clone()))
        .collect();
    let early = results
        .iter()
        .filter(|(t, o)| o.is_err() && *t <= flushed_at + REPAIR)
        .count();
    let before = results
        .iter()
        .filter(|(t, o)| o.is_err() && *t < flushed_at)
        .count();
    eprintln!(
        "{} connections, {early} failed within {REPAIR:?} of the flush ({before} before it), {} later",
        results.len(),
        late.len()
    );
    let log = agent.log();
    let cleaned: Vec<&str> = log.lines().filter(|l| l.contains("never DNATed")).collect();
    eprintln!("agent: {cleaned:?}");
    assert!(
        results.len() > 2000,
        "too few connections: {}",
        results.len()
    );
    assert_eq!(before, 0, "failures before the flush");
    assert!(
        late.is_empty(),
        "connections failed long after the flush: {:?}\nlog:\n{}",
        &late[..late.len().min(20)],
        agent.log()
    );
    assert_eq!(repairs(&agent), 1, "{}", agent.log());
}

/// A map that a dynset expression updates (affinity) gets an element limit from the kernel; the desired map
/// says the same limit, so periodic full syncs find nothing to repair (no table replacement every period).
/// Nothing here lists the ruleset with nft (it cannot list affinity rules).
#[test]
fn periodic_full_syncs_with_an_affinity_service_change_nothing() {
    const STICKY: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: demo}
spec:
  clusterIP: 10.96.0.50
  sessionAffinity: ClientIP
  ports:
  - {name: tcp, port: 80, targetPort: 8080, protocol: TCP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-1, namespace: demo, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports:
- {name: tcp, port: 8080, protocol: TCP}
endpoints:
- {addresses: ["10.244.1.2"]}
- {addresses: ["10.244.2.2"]}
"#;
    let sb = sandbox("nk-taff", 2);
    let m = Manifests::examples();
    m.write("sticky.yaml", STICKY);
    // Periodic full syncs that read the kernel back (`--full-read-period 0`).
    let agent = Agent::start(
        sb.node(),
        &m.dir,
        &["--sync-period", "0.5", "--full-read-period", "0"],
    );
    let full_syncs = || {
        agent
            .log()
            .lines()
            .filter(|l| l.contains("sync complete") && l.contains("full=true"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    wait_until(SYNC, || full_syncs().len() >= 4)
        .unwrap_or_else(|_| panic!("no periodic full syncs; log:\n{}", agent.log()));
    let dst: SocketAddr = "10.96.0.50:80".parse().unwrap();
    assert!(tcp_request(sb.client(), dst, Duration::from_secs(2)).is_ok());
    let syncs = full_syncs();
    for s in &syncs[1..] {
        assert!(
            s.contains("changes=0"),
            "a periodic full sync changed something: {s}\n{}",
            agent.log()
        );
    }
}
