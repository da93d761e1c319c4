//! Stale UDP conntrack cleanup through ctnetlink, proven with live flows: the real agent in the sandbox's node
//! namespace, UDP clients that keep one source port, and the node's conntrack table read back through our own
//! dump (cross-checked once with the `conntrack` tool).
//!
//! NodePorts: the renderer programs ClusterIPs only so far; NodePort matching is covered by unit tests
//! (`conntrack::filter` / `conntrack::plan`), and a kernel test joins these once the NodePort renderer lands.

use kernel_tests::sandbox::{self, parse_answer, tcp_request, udp_request_from, Sandbox};
use kernel_tests::*;
use nftkube::conntrack::wire::{AF_INET, IPPROTO_TCP, IPPROTO_UDP};
use nftkube::conntrack::*;
use nftkube::model::Protocol;
use nftkube_sandbox::netns::{unique_name, NetNs};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

const ECHO_V4: &str = "10.96.0.10";
const ECHO_V6: &str = "fd00:96::10";
const EMPTY_V4: &str = "10.96.0.20";
const LATE_V4: &str = "10.96.0.30";
const SYNC: Duration = Duration::from_secs(15);
const T: Duration = Duration::from_secs(2);

fn pod_udp(i: usize) -> SocketAddr {
    SocketAddr::new(sandbox::pod_ip_v4(i).into(), BACKEND_UDP_PORT)
}

fn client_ip() -> IpAddr {
    sandbox::pod_ip_v4(0).into()
}

/// Every conntrack entry of the node namespace, through our own ctnetlink dump.
fn node_entries(sb: &Sandbox) -> Vec<Entry> {
    sb.node()
        .run(|| CtSocket::open().unwrap().list_all().unwrap())
        .unwrap()
}

/// The entry of the client's flow from `sport` (original direction), if any.
fn flow(entries: &[Entry], proto: u8, src: IpAddr, sport: u16) -> Option<Entry> {
    entries
        .iter()
        .find(|e| e.orig.proto == proto && e.orig.src == src && e.orig.sport == sport)
        .cloned()
}

fn udp_flow(sb: &Sandbox, sport: u16) -> Option<Entry> {
    flow(&node_entries(sb), IPPROTO_UDP, client_ip(), sport)
}

fn reply_src(e: &Entry) -> SocketAddr {
    SocketAddr::new(e.reply.src, e.reply.sport)
}

/// Which backend answered a UDP request from the client's `sport` (panics on failure).
fn ask(sb: &Sandbox, sport: u16, dst: SocketAddr) -> usize {
    let a = udp_request_from(sb.client(), sport, dst, T)
        .unwrap_or_else(|e| panic!("UDP from :{sport} to {dst}: {e}"));
    parse_answer(&a).unwrap().0
}

/// Completed syncs that applied some change.
fn change_syncs(agent: &Agent) -> usize {
    agent
        .log()
        .lines()
        .filter(|l| l.contains("sync complete") && !l.contains("changed_services=0"))
        .count()
}

/// The position among all completed syncs (1-based: the commit number the cleanup worker logs) of the
/// `n`-th sync that applied a change.
fn commit_of_change_sync(log: &str, n: usize) -> Option<u64> {
    let syncs = log.lines().filter(|l| l.contains("sync complete"));
    let mut changes = 0;
    for (i, l) in syncs.enumerate() {
        if !l.contains("changed_services=0") {
            changes += 1;
            if changes == n {
                return Some(i as u64 + 1);
            }
        }
    }
    None
}

/// The highest commit number a finished conntrack walk covered (its `last_commit`).
fn cleaned_through(log: &str) -> u64 {
    log.lines()
        .filter(|l| l.contains("conntrack cleanup") || l.contains("never DNATed"))
        .filter_map(|l| {
            l.split("last_commit=")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .max()
        .unwrap_or(0)
}

/// Waits for the next sync that applies a change (after `before` of them), then for the conntrack walk that
/// follows its commit: the walk runs beside the loop, after the sync's line. `before` must be counted after
/// [`wait_programmed`]: until the initial sync's line is out, a count taken now would be 0 and that line would
/// pass for the change.
fn wait_change_sync(agent: &Agent, before: usize) {
    assert!(
        before >= 1,
        "test bug: change syncs counted before the initial sync completed (call wait_programmed first)"
    );
    wait_until(SYNC, || change_syncs(agent) > before)
        .unwrap_or_else(|_| panic!("no sync applied the change; log:\n{}", agent.log()));
    let commit = commit_of_change_sync(&agent.log(), before + 1).expect("just seen");
    wait_until(SYNC, || cleaned_through(&agent.log()) >= commit).unwrap_or_else(|_| {
        panic!(
            "no conntrack walk followed commit {commit}; log:\n{}",
            agent.log()
        )
    });
}

/// Waits for an agent's first sync and the conntrack walk that follows it (which runs after the sync's line).
fn wait_first_walk(agent: &Agent) {
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || cleaned_through(&agent.log()) >= 1).unwrap_or_else(|_| {
        panic!(
            "no conntrack walk followed the first sync; log:\n{}",
            agent.log()
        )
    });
}

/// The lines the agent logged about conntrack cleanups.
fn cleanup_lines(agent: &Agent) -> Vec<String> {
    agent
        .log()
        .lines()
        .filter(|l| l.contains("conntrack cleanup"))
        .map(str::to_owned)
        .collect()
}

/// Waits until the agent's initial sync is complete and TCP to echo answers.
///
/// The rules answer traffic as soon as the initial sync commits, before its "sync complete" line: a test that
/// counted change syncs before that line would take the initial sync for its change.
fn wait_programmed(sb: &Sandbox, agent: &Agent) {
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || {
        tcp_request(sb.client(), addr(ECHO_V4, 80), Duration::from_millis(300)).is_ok()
    })
    .expect("echo never became reachable");
}

/// A UDP flow from the client to echo from the first source port in `ports` that the kernel sends to a
/// backend accepted by `want`.
fn flow_to(
    sb: &Sandbox,
    ports: std::ops::Range<u16>,
    want: impl Fn(usize) -> bool,
) -> (u16, usize) {
    for p in ports.clone() {
        let pod = ask(sb, p, addr(ECHO_V4, 53));
        if want(pod) {
            return (p, pod);
        }
    }
    panic!("no flow from ports {ports:?} landed on a wanted backend");
}

fn slice_doc(service: &str, name: &str, pod: usize) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: demo\n  \
         labels:\n    kubernetes.io/service-name: {service}\naddressType: IPv4\nports:\n- name: udp\n  port: 5353\n  \
         protocol: UDP\nendpoints:\n- addresses: [\"{}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  \
         nodeName: node-1\n",
        sandbox::pod_ip_v4(pod)
    )
}

const LATE_SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: late\n  namespace: demo\nspec:\n  \
type: ClusterIP\n  clusterIP: 10.96.0.30\n  clusterIPs: [10.96.0.30]\n  ipFamilies: [IPv4]\n  ipFamilyPolicy: SingleStack\n  \
ports:\n  - name: udp\n    port: 53\n    targetPort: 5353\n    protocol: UDP\n";

/// Test 1: a service without endpoints while the client keeps its port; an endpoint appears → the very next
/// datagram after one sync reaches it. (a) the examples' `empty` service (rejected while empty: the reject
/// drops the packet before conntrack confirms it, so no entry exists); (b) a ClusterIP the node does not know
/// yet (an agent that has not synced it, or rules from before): the datagrams leave un-NATed and leave a
/// black-hole entry (reply source == original destination) that would pin the flow forever without cleanup.
#[test]
fn endpoint_appearing_clears_black_holes_within_one_sync() {
    let sb = sandbox("ct-bh", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_programmed(&sb, &agent);

    // (a) Rejected while there is no endpoint.
    let sport_a = 41000;
    for _ in 0..3 {
        let e = udp_request_from(sb.client(), sport_a, addr(EMPTY_V4, 81), T).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    }
    assert_eq!(
        udp_flow(&sb, sport_a),
        None,
        "a rejected datagram leaves no entry"
    );

    // (b) Un-NATed while the address is unknown to the node: a black-hole entry.
    let sport_b = 41001;
    for _ in 0..3 {
        let e = udp_request_from(
            sb.client(),
            sport_b,
            addr(LATE_V4, 53),
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
    }
    let hole = udp_flow(&sb, sport_b).expect("the un-NATed datagrams left an entry");
    assert_eq!(reply_src(&hole), addr(LATE_V4, 53), "{hole:?}");
    assert!(hole.timeout >= 20, "{hole:?}");

    // Both get an endpoint (pod1 for empty, pod2 for the new service late) in one manifest change.
    let before = change_syncs(&agent);
    m.write(
        "appear.yaml",
        &format!(
            "{}---\n{}---\n{LATE_SERVICE}",
            slice_doc("empty", "empty-abc", 1),
            slice_doc("late", "late-abc", 2)
        ),
    );
    wait_change_sync(&agent, before);
    // Before any new datagram: the black-hole entry is gone.
    assert_eq!(
        udp_flow(&sb, sport_b),
        None,
        "the black-hole entry survived the sync"
    );
    // No retry: the first datagram after that one sync is answered.
    assert_eq!(ask(&sb, sport_a, addr(EMPTY_V4, 81)), 1);
    assert_eq!(ask(&sb, sport_b, addr(LATE_V4, 53)), 2);

    let entries = node_entries(&sb);
    let a = flow(&entries, IPPROTO_UDP, client_ip(), sport_a).unwrap();
    assert_eq!(reply_src(&a), pod_udp(1));
    let b = flow(&entries, IPPROTO_UDP, client_ip(), sport_b).unwrap();
    assert_eq!(reply_src(&b), pod_udp(2), "{b:?}");
    assert_ne!(b.reply, hole.reply);
    let lines = cleanup_lines(&agent);
    println!("{}", lines.join("\n"));
    let log = agent.log();
    let probe_line = log
        .lines()
        .find(|l| l.contains("conntrack: kernel features probed"))
        .unwrap_or_else(|| panic!("no probe line:\n{log}"));
    println!("{probe_line}");
    assert!(
        lines.iter().any(|l| l.contains("deleted=1")),
        "{lines:#?}\n{}",
        agent.log()
    );
}

/// Test 2: an endpoint is removed while the client keeps its port → after one sync its next datagram reaches
/// a surviving endpoint; a flow that was on a survivor keeps its entry. Cross-checked with `conntrack -L`.
#[test]
fn removed_endpoint_moves_the_flow_to_a_survivor_within_one_sync() {
    let sb = sandbox("ct-rm", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_programmed(&sb, &agent);

    let (sport, victim) = flow_to(&sb, 42000..42010, |_| true);
    let (other_port, survivor) = flow_to(&sb, 42010..42100, |p| p != victim);
    let stale = udp_flow(&sb, sport).unwrap();
    assert_eq!(reply_src(&stale), pod_udp(victim));
    // It would outlive the test by far if nothing deleted it.
    assert!(stale.timeout >= 20, "{stale:?}");
    let kept = udp_flow(&sb, other_port).unwrap();
    // Sticky before the change: the same port keeps reaching the same pod.
    for _ in 0..3 {
        assert_eq!(ask(&sb, sport, addr(ECHO_V4, 53)), victim);
    }

    let before = change_syncs(&agent);
    let victim_ip = sandbox::pod_ip_v4(victim).to_string();
    m.write(
        "endpointslices.yaml",
        &without_endpoint(&m.read("endpointslices.yaml"), &victim_ip),
    );
    wait_change_sync(&agent, before);
    // Before any new datagram: the stale entry is gone, the one on a survivor is untouched.
    let entries = node_entries(&sb);
    assert_eq!(
        flow(&entries, IPPROTO_UDP, client_ip(), sport),
        None,
        "stale entry survived"
    );
    assert_eq!(
        flow(&entries, IPPROTO_UDP, client_ip(), other_port).map(|e| (e.orig, e.reply, e.id)),
        Some((kept.orig, kept.reply, kept.id)),
        "a flow on a surviving endpoint was touched"
    );
    assert!(
        !entries
            .iter()
            .any(|e| e.orig.proto == IPPROTO_UDP && reply_src(e) == pod_udp(victim)),
        "an entry still points at the removed endpoint"
    );
    let now = ask(&sb, sport, addr(ECHO_V4, 53));
    assert_ne!(now, victim, "the flow still reaches the removed endpoint");
    assert_eq!(ask(&sb, other_port, addr(ECHO_V4, 53)), survivor);

    let entries = node_entries(&sb);
    let moved = flow(&entries, IPPROTO_UDP, client_ip(), sport).unwrap();
    assert_eq!(reply_src(&moved), pod_udp(now));
    assert_ne!(moved.reply, stale.reply);

    // The conntrack tool sees the same UDP flows to echo as our dump.
    let out = sb
        .node()
        .command("conntrack")
        .args(["-L", "-p", "udp", "--orig-dst", ECHO_V4])
        .output()
        .expect("running conntrack (apt-get install conntrack)");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let tool: BTreeSet<(u16, String)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let sport = f
                .iter()
                .find_map(|x| x.strip_prefix("sport="))?
                .parse()
                .ok()?;
            let reply = f.iter().filter_map(|x| x.strip_prefix("src=")).nth(1)?;
            Some((sport, reply.to_owned()))
        })
        .collect();
    let ours: BTreeSet<(u16, String)> = entries
        .iter()
        .filter(|e| e.orig.proto == IPPROTO_UDP && e.orig.dst.to_string() == ECHO_V4)
        .map(|e| (e.orig.sport, e.reply.src.to_string()))
        .collect();
    assert_eq!(tool, ours, "conntrack -L:\n{text}");
    assert!(!text.contains(&format!("src={victim_ip} ")), "{text}");
}

/// Test 3: a deleted service's UDP entries are gone (and its traffic is no longer answered); its TCP entry
/// and another service's UDP flow stay.
#[test]
fn deleted_service_takes_its_udp_entries_with_it() {
    let sb = sandbox("ct-del", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_programmed(&sb, &agent);

    let ports = [43000, 43001, 43002];
    for p in ports {
        ask(&sb, p, addr(ECHO_V4, 53));
    }
    let v6_pod = ask(&sb, 43010, addr(ECHO_V6, 53));
    tcp_request(sb.client(), addr(ECHO_V4, 80), T).unwrap();
    let before_entries = node_entries(&sb);
    let tcp = before_entries
        .iter()
        .find(|e| e.orig.proto == IPPROTO_TCP && e.orig.dst.to_string() == ECHO_V4)
        .cloned()
        .expect("the TCP connection's entry");
    let v6 = before_entries
        .iter()
        .find(|e| e.orig.proto == IPPROTO_UDP && e.orig.sport == 43010)
        .cloned()
        .expect("the IPv6 flow's entry");
    for p in ports {
        assert!(flow(&before_entries, IPPROTO_UDP, client_ip(), p).is_some());
    }

    let before = change_syncs(&agent);
    let services = m.read("services.yaml");
    let kept: Vec<&str> = services
        .split("\n---")
        .filter(|doc| !doc.contains("name: echo\n"))
        .collect();
    m.write("services.yaml", &kept.join("\n---"));
    wait_change_sync(&agent, before);

    let entries = node_entries(&sb);
    let left: Vec<&Entry> = entries
        .iter()
        .filter(|e| e.orig.proto == IPPROTO_UDP && e.orig.dst.to_string() == ECHO_V4)
        .collect();
    assert!(
        left.is_empty(),
        "UDP entries of the deleted service: {left:?}"
    );
    assert!(
        entries.iter().any(|e| e.id == tcp.id && e.orig == tcp.orig),
        "TCP entry deleted"
    );
    assert!(
        entries.iter().any(|e| e.id == v6.id && e.orig == v6.orig),
        "another service's flow deleted"
    );
    // The old flow no longer reaches any backend (the address is now routed out and dropped).
    assert!(udp_request_from(
        sb.client(),
        ports[0],
        addr(ECHO_V4, 53),
        Duration::from_millis(500)
    )
    .is_err());
    assert_eq!(ask(&sb, 43010, addr(ECHO_V6, 53)), v6_pod);
    let lines = cleanup_lines(&agent);
    println!("{}", lines.join("\n"));
    assert!(lines.iter().any(|l| l.contains("deleted=3")), "{lines:#?}");
}

/// Test 5: TCP flows, unrelated UDP flows and healthy UDP flows survive endpoint changes and agent restarts;
/// a restart deletes only what points at an endpoint that stopped serving while the agent was down.
#[test]
fn tcp_unrelated_and_healthy_flows_survive_restarts() {
    let sb = sandbox("ct-rst", 3);
    let m = Manifests::examples();
    let mut agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_programmed(&sb, &agent);

    // Unrelated entries: 1000 injected ones, and a real UDP flow that is no service flow (client → ext).
    let injected: Vec<NewEntry> = (0..1000u32)
        .map(|i| {
            let src = IpAddr::V4(Ipv4Addr::from(0x0a05_0000 + i));
            let dst = IpAddr::V4(Ipv4Addr::from(0xc633_6400 + (i % 200))); // 198.51.100.x
            NewEntry::plain(Tuple::new(src, 5000, dst, 53, IPPROTO_UDP), 600)
        })
        .collect();
    let (created, errors) = sb
        .node()
        .run(|| CtSocket::open().unwrap().create(&injected).unwrap())
        .unwrap();
    assert_eq!(created, injected.len(), "{errors:?}");
    let _ = udp_request_from(
        sb.client(),
        44900,
        SocketAddr::new(sandbox::ext_ip_v4().into(), 9999),
        Duration::from_millis(200),
    );

    // A healthy flow on pod K, a flow on pod L != K, a TCP connection to L.
    let (healthy_port, k) = flow_to(&sb, 44000..44010, |_| true);
    let (l_port, l) = flow_to(&sb, 44010..44100, |p| p != k);
    let l_addr = SocketAddr::new(sandbox::pod_ip_v4(l).into(), BACKEND_TCP_PORT);
    wait_until(SYNC, || {
        tcp_request(sb.client(), addr(ECHO_V4, 80), T).is_ok()
            && node_entries(&sb)
                .iter()
                .any(|e| e.orig.proto == IPPROTO_TCP && reply_src(e) == l_addr)
    })
    .expect("no TCP connection landed on pod L");

    let snapshot = node_entries(&sb);
    let ids = |v: &[Entry], pred: &dyn Fn(&Entry) -> bool| -> BTreeMap<Tuple, Option<u32>> {
        v.iter()
            .filter(|e| pred(e))
            .map(|e| (e.orig, e.id))
            .collect()
    };
    let is_unrelated = |e: &Entry| {
        e.orig.proto == IPPROTO_UDP
            && (e.orig.dst.to_string().starts_with("198.51.100.")
                || e.orig.dst == IpAddr::from(sandbox::ext_ip_v4()))
    };
    let is_tcp = |e: &Entry| e.orig.proto == IPPROTO_TCP;
    let unrelated = ids(&snapshot, &is_unrelated);
    let tcp = ids(&snapshot, &is_tcp);
    assert_eq!(
        unrelated.len(),
        1001,
        "injected entries plus the client → ext flow"
    );
    let healthy = udp_flow(&sb, healthy_port).unwrap();
    let on_l = udp_flow(&sb, l_port).unwrap();
    assert_eq!(reply_src(&on_l), pod_udp(l));

    // Restart with nothing changed: nothing is deleted.
    assert!(agent.stop());
    agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_first_walk(&agent);
    let after = node_entries(&sb);
    assert_eq!(ids(&after, &is_unrelated), unrelated);
    assert!(tcp
        .iter()
        .all(|(t, id)| ids(&after, &is_tcp).get(t) == Some(id)));
    assert_eq!(udp_flow(&sb, healthy_port).unwrap().id, healthy.id);
    assert_eq!(udp_flow(&sb, l_port).unwrap().id, on_l.id);
    assert_eq!(ask(&sb, healthy_port, addr(ECHO_V4, 53)), k);
    assert_eq!(ask(&sb, l_port, addr(ECHO_V4, 53)), l);
    // The restart's cleanup looked (the initial snapshot makes every service "newly active") and found
    // nothing stale.
    let lines = cleanup_lines(&agent);
    println!("{}", lines.join("\n"));
    assert!(lines.iter().all(|l| l.contains("deleted=0")), "{lines:#?}");

    // Pod L stops serving while the agent is down: the restart deletes the UDP flow to L and nothing else.
    assert!(agent.stop());
    let l_ip = sandbox::pod_ip_v4(l).to_string();
    m.write(
        "endpointslices.yaml",
        &without_endpoint(&m.read("endpointslices.yaml"), &l_ip),
    );
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_first_walk(&agent);
    let after = node_entries(&sb);
    assert_eq!(
        flow(&after, IPPROTO_UDP, client_ip(), l_port).map(|e| e.id),
        None,
        "the flow to the endpoint removed while the agent was down survived"
    );
    assert_eq!(ids(&after, &is_unrelated), unrelated);
    assert!(
        tcp.iter()
            .all(|(t, id)| ids(&after, &is_tcp).get(t) == Some(id)),
        "TCP entries (one to the removed pod) must stay"
    );
    assert_eq!(
        flow(&after, IPPROTO_UDP, client_ip(), healthy_port)
            .unwrap()
            .id,
        healthy.id
    );
    assert_eq!(ask(&sb, healthy_port, addr(ECHO_V4, 53)), k);
    assert_ne!(ask(&sb, l_port, addr(ECHO_V4, 53)), l);
    let lines = cleanup_lines(&agent);
    println!("{}", lines.join("\n"));
    assert!(lines.iter().any(|l| l.contains("deleted=1")), "{lines:#?}");
}

/// The agent starts the probe early (its namespace needs CAP_SYS_ADMIN) but its dumps wait for their gate:
/// nothing of the probe runs before, its duration counts from the gate, and a waiter opens it itself.
#[test]
fn a_started_probe_dumps_only_once_its_gate_opens() {
    let (open, gate) = std::sync::mpsc::channel::<()>();
    let probe = start_probe(
        || Ok(()),
        move || {
            let _ = gate.recv();
        },
    )
    .expect("probe thread");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!probe.is_finished(), "the probe ran before its gate opened");
    let opened = Instant::now();
    drop(open);
    let (features, took) = probe.join().expect("probe thread");
    let features = features.expect("the probe");
    // Its socket round trips and dumps came after the gate: they take well over half a millisecond.
    assert!(
        took <= opened.elapsed() && took >= Duration::from_micros(500),
        "timed from the gate: {took:?}"
    );

    // Nobody releases this one: the first walk's wait does, instead of waiting for ever.
    let pending = PendingFeatures::start(|| Ok(()));
    assert_eq!(pending.wait(), features);
}

/// The library against the kernel: create, dump, exact delete, the probe, and the `conntrack` tool as oracle.
#[test]
fn ctnetlink_create_dump_delete_and_probe() {
    require_root();
    let ns = NetNs::create(&unique_name("ct-lib")).unwrap();
    let features = ns.run(probe).unwrap().expect("probe");
    println!("kernel features: {features:?}");
    // Linux 6.18 (this machine): every IPv4 filter works; IPv6 protocol filters work but address filters are
    // inverted, and the probe must have caught that.
    assert!(features.dump_proto_v4 && features.dump_addr_v4 && features.dump_proto_v6);

    let c4: IpAddr = "10.244.0.2".parse().unwrap();
    let c6: IpAddr = "fd00:244::2".parse().unwrap();
    let vip4: IpAddr = ECHO_V4.parse().unwrap();
    let vip6: IpAddr = ECHO_V6.parse().unwrap();
    let dead: IpAddr = "10.244.2.2".parse().unwrap();
    let alive: IpAddr = "10.244.1.2".parse().unwrap();
    let nat = |client: IpAddr, sport: u16, vip: IpAddr, ep: IpAddr, proto: u8| {
        let orig = Tuple::new(client, sport, vip, 53, proto);
        NewEntry {
            orig,
            reply: Tuple::new(ep, 5353, client, sport, proto),
            timeout_s: 600,
            mark: 0,
            zone: 0,
        }
    };
    let entries = vec![
        nat(c4, 1, vip4, dead, IPPROTO_UDP),  // stale
        nat(c4, 2, vip4, alive, IPPROTO_UDP), // healthy
        nat(c4, 3, vip4, vip4, IPPROTO_UDP),  // black hole
        nat(c4, 4, vip4, dead, IPPROTO_TCP),  // TCP: never touched
        NewEntry {
            zone: 7,
            ..nat(c4, 5, vip4, dead, IPPROTO_UDP) // stale, in zone 7
        },
        NewEntry {
            orig: Tuple::new(c6, 6, vip6, 53, IPPROTO_UDP),
            reply: Tuple::new(vip6, 53, c6, 6, IPPROTO_UDP), // IPv6 black hole
            timeout_s: 600,
            mark: 0,
            zone: 0,
        },
        nat(c4, 7, "10.96.0.99".parse().unwrap(), dead, IPPROTO_UDP), // another service
    ];
    let (report, left, tool) = ns
        .run(|| {
            let mut s = CtSocket::open().unwrap();
            let (n, errs) = s.create(&entries).unwrap();
            assert_eq!(n, entries.len(), "{errs:?}");
            // Creating the same tuple again is refused (EEXIST), not duplicated.
            let (n, errs) = s.create(&entries[..1]).unwrap();
            assert_eq!((n, errs.len()), (0, 1));
            assert_eq!(errs[0].errno(), Some(libc::EEXIST));
            let all = s.list_all().unwrap();
            assert_eq!(all.len(), entries.len());
            let zoned = all.iter().find(|e| e.orig.sport == 5).unwrap();
            assert_eq!(zoned.zone, ZoneScope::Both(7));

            let mut filter = StaleFilter::new();
            let serving = [SocketAddr::new(alive, 5353)];
            filter.frontend(
                Frontend {
                    ip: vip4,
                    port: 53,
                    proto: Protocol::Udp,
                },
                serving,
            );
            filter.frontend(
                Frontend {
                    ip: vip6,
                    port: 53,
                    proto: Protocol::Udp,
                },
                [],
            );
            let mut cleaner = Cleaner::new();
            let report = cleaner.cleanup(&filter).unwrap();
            let left = s.list_all().unwrap();
            let tool = std::process::Command::new("conntrack")
                .args(["-L", "-o", "id"])
                .output()
                .expect("conntrack -L");
            let tool6 = std::process::Command::new("conntrack")
                .args(["-L", "-f", "ipv6"])
                .output()
                .expect("conntrack -L -f ipv6");
            let tool = format!(
                "{}{}",
                String::from_utf8_lossy(&tool.stdout),
                String::from_utf8_lossy(&tool6.stdout)
            );
            (report, left, tool)
        })
        .unwrap();
    println!("{report:?}");
    let mut left_ports: Vec<u16> = left.iter().map(|e| e.orig.sport).collect();
    left_ports.sort();
    assert_eq!(left_ports, [2, 4, 7], "left: {left:#?}");
    // Of the four, the IPv6 black hole is IPv6 (kube-proxy counts deletions per family).
    assert_eq!(
        (
            report.stale,
            report.deleted,
            report.deleted_v6,
            report.gone,
            report.errors
        ),
        (4, 4, 1, 0, 0)
    );
    // The tool (run inside the namespace) lists exactly what our dump lists.
    let tool_sports: BTreeSet<u16> = tool
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|x| x.strip_prefix("sport="))?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(tool_sports, left_ports.iter().copied().collect(), "{tool}");
    for e in &left {
        let id = e.id.unwrap();
        assert!(
            tool.contains(&format!("id={id}")),
            "id {id} not in:\n{tool}"
        );
    }
    drop(ns);
}

/// Cost: the same cleanup with 100k unrelated UDP entries in the table, per dump strategy. Prints entries
/// scanned and deleted and the time per cleanup (no timed assertions; debug build).
#[test]
fn cost_with_100k_unrelated_entries() {
    require_root();
    let ns = NetNs::create(&unique_name("ct-cost")).unwrap();
    ns.run(|| {
        let mut s = CtSocket::open().unwrap();
        let unrelated: Vec<NewEntry> = (0..100_000u32)
            .map(|i| {
                let src = IpAddr::V4(Ipv4Addr::from(0x0a10_0000 + i)); // 10.16.0.0/12 clients
                let dst = IpAddr::V4(Ipv4Addr::from(0x0a60_1000 + (i % 4096))); // 10.96.16.0+: other VIPs
                NewEntry::plain(Tuple::new(src, 1024 + (i % 60000) as u16, dst, 53, IPPROTO_UDP), 3600)
            })
            .collect();
        let t = Instant::now();
        let (n, errs) = s.create(&unrelated).unwrap();
        assert_eq!(n, unrelated.len(), "{:?}", errs.first());
        println!("created {n} unrelated UDP entries in {:?}", t.elapsed());

        let vip: IpAddr = ECHO_V4.parse().unwrap();
        let deleted_vip: IpAddr = EMPTY_V4.parse().unwrap();
        let client = |i: u32| IpAddr::V4(Ipv4Addr::from(0x0af4_0000 + i)); // 10.244.x.y
        let alive: Vec<SocketAddr> = (1..=3).map(pod_udp).collect();
        let dead = pod_udp(4);
        let mk = |i: u32, vip: IpAddr, reply: SocketAddr| NewEntry {
            orig: Tuple::new(client(i), 2000, vip, 53, IPPROTO_UDP),
            reply: Tuple::new(reply.ip(), reply.port(), client(i), 2000, IPPROTO_UDP),
            timeout_s: 3600,
            mark: 0,
            zone: 0,
        };
        // 300 healthy flows (kept), and per run: 100 flows to a removed endpoint, 20 black holes, 50 flows to a
        // deleted service's address.
        let healthy: Vec<NewEntry> = (0..300).map(|i| mk(i, vip, alive[i as usize % 3])).collect();
        assert_eq!(s.create(&healthy).unwrap().0, healthy.len());
        let stale: Vec<NewEntry> = (1000..1100)
            .map(|i| mk(i, vip, dead))
            .chain((2000..2020).map(|i| mk(i, vip, SocketAddr::new(vip, 53))))
            .chain((3000..3050).map(|i| mk(i, deleted_vip, pod_udp(1))))
            .collect();
        let mut filter = StaleFilter::new();
        filter.frontend(
            Frontend { ip: vip, port: 53, proto: Protocol::Udp },
            alive.iter().copied(),
        );
        filter.delete_all_to_ip(deleted_vip, Protocol::Udp);

        let features = probe().unwrap();
        let strategies: Vec<(&str, CleanerOptions, Features)> = vec![
            (
                "portable: dump per family",
                CleanerOptions { probe: false, dump_filters: false, ..CleanerOptions::default() },
                Features::default(),
            ),
            (
                "dump per protocol (CTA_FILTER proto)",
                CleanerOptions { max_address_dumps: 0, ..CleanerOptions::default() },
                features,
            ),
            ("default: dump per address (CTA_FILTER proto + dst)", CleanerOptions::default(), features),
            (
                "per address + kernel filtered delete for the deleted address",
                CleanerOptions { filtered_delete: true, ..CleanerOptions::default() },
                features,
            ),
        ];
        println!("features: {features:?}");
        println!("table: {} entries; stale per run: {}", unrelated.len() + healthy.len() + stale.len(), stale.len());
        for (name, opts, f) in strategies {
            let (n, errs) = s.create(&stale).unwrap();
            assert_eq!(n, stale.len(), "{:?}", errs.first());
            let mut cleaner = Cleaner::with_options(opts);
            cleaner.set_features(f);
            let r = cleaner.cleanup(&filter).unwrap();
            let m = cleaner.metrics().snapshot();
            println!(
                "{name:<62} dumps {:>2}  scanned {:>6}  stale {:>3}  deleted {:>3}  filtered deletes {}  time {:>8.1} ms",
                r.dumps,
                r.scanned,
                r.stale,
                r.deleted,
                r.filtered_deletes,
                r.elapsed.as_secs_f64() * 1000.0
            );
            assert_eq!(m.entries_deleted as usize, r.deleted);
            assert_eq!(m.entries_scanned as usize, r.scanned);
            assert_eq!(r.deleted + 50 * r.filtered_deletes, stale.len());
            // Exactly the stale ones went.
            let count = s.dump(&DumpFilter::family(AF_INET), |_| {}).unwrap();
            assert_eq!(count, unrelated.len() + healthy.len());
        }
        // An empty cleanup costs nothing.
        let r = Cleaner::new().cleanup(&StaleFilter::new()).unwrap();
        assert_eq!((r.dumps, r.scanned), (0, 0));
    })
    .unwrap();
}
