//! `nftkube trace`: for every cell of the matrix (sources × destinations × policies × masquerade-all), the
//! offline trace (through the kernel's state, and through the plan rendered from the same manifests) names
//! the same verdict, endpoints and masquerade decision as real connections show; bad arguments are refused
//! with exit code 64 and a message naming the argument; `--live` reports the path a real packet took; a
//! portmap hostPort mapping is traced through the plugin's own table.

use kernel_tests::matrix::*;
use kernel_tests::*;
use serde_json::Value;
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::Duration;

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);
/// Connections per cell: with two endpoints, the chance that one is never chosen is 2 · 2⁻¹⁶.
const REQUESTS: usize = 16;

/// What a trace says about a cell, in the terms real packets can be compared with.
#[derive(Debug, PartialEq)]
struct Traced {
    verdicts: BTreeSet<String>,
    /// Pods the DNAT targets are (index i of 10.244.i.2).
    endpoints: BTreeSet<usize>,
    masquerade: BTreeSet<bool>,
    /// Every outcome has probability 1/|endpoints| (uniform choice).
    uniform: bool,
}

fn pod_index(ip: &str) -> usize {
    let ip: IpAddr = ip
        .trim_matches(|c| c == '[' || c == ']')
        .parse()
        .expect("a DNAT target address");
    (0..=3)
        .find(|&i| {
            IpAddr::from(sandbox::pod_ip_v4(i)) == ip || IpAddr::from(sandbox::pod_ip_v6(i)) == ip
        })
        .unwrap_or_else(|| panic!("DNAT target {ip} is no pod"))
}

fn summarize(json: &Value) -> Traced {
    let outcomes = json["outcomes"].as_array().expect("outcomes");
    let endpoints: BTreeSet<usize> = outcomes
        .iter()
        .filter_map(|o| o["dnat"].as_str())
        .map(|d| pod_index(d.rsplit_once(':').expect("IP:PORT").0))
        .collect();
    let total: f64 = outcomes
        .iter()
        .map(|o| o["probability"].as_f64().unwrap())
        .sum();
    let uniform = (total - 1.0).abs() < 1e-9
        && outcomes.iter().all(|o| {
            (o["probability"].as_f64().unwrap() - 1.0 / outcomes.len() as f64).abs() < 1e-9
        });
    Traced {
        verdicts: outcomes
            .iter()
            .map(|o| o["verdict"].as_str().unwrap().to_string())
            .collect(),
        endpoints,
        masquerade: outcomes
            .iter()
            .map(|o| o["masquerade"].as_bool().unwrap())
            .collect(),
        uniform,
    }
}

/// The packet's flags for a cell: the client's address, the interface it arrives on, its origin.
fn packet_args(src: Source, policy: Policy, dest: Dest) -> Vec<String> {
    let (ip, iif, from): (Ipv4Addr, Option<String>, &str) = match src {
        Source::Pod => (
            sandbox::pod_ip_v4(0),
            Some(sandbox::node_pod_ifname(0)),
            "pod",
        ),
        Source::Node => (sandbox::node_ip_v4(), None, "node"),
        Source::Outside => (
            sandbox::ext_ip_v4(),
            Some(sandbox::NODE_UPLINK.into()),
            "outside",
        ),
    };
    let mut args = vec![
        "trace".into(),
        "--src".into(),
        ip.to_string(),
        "--dst".into(),
        target(policy, dest).to_string(),
        "--proto".into(),
        "tcp".into(),
        "--from".into(),
        from.into(),
        "-o".into(),
        "json".into(),
    ];
    if let Some(i) = iif {
        args.extend(["--iif".into(), i]);
    }
    args
}

/// `nftkube trace ARGS` in the node's namespace; panics unless it succeeds with JSON.
fn trace_json(ns: &nftkube_sandbox::netns::NetNs, args: &[String]) -> Value {
    let out = ns
        .command(nftkube_bin())
        .args(args)
        .output()
        .expect("running nftkube trace");
    assert!(
        out.status.success(),
        "nftkube {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "nftkube {args:?}: not JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The render flags the agent runs with, for a trace of the plan.
fn plan_args(dir: &Path, variant: Variant) -> Vec<String> {
    let mut a: Vec<String> = [
        "--manifests",
        dir.to_str().unwrap(),
        "--hostname-override",
        "node-1",
        "--cluster-cidr",
        &format!("{},{}", sandbox::CLUSTER_CIDR_V4, sandbox::CLUSTER_CIDR_V6),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    variant.apply(&mut a);
    a
}

#[test]
fn offline_trace_agrees_with_real_packets_in_every_matrix_cell() {
    let (sb, m) = setup("nk-tr");
    let mut failures = Vec::new();
    let mut cells = 0;
    for variant in VARIANTS {
        let agent = start_agent(&sb, &m, variant);
        for policy in POLICIES {
            for dest in DESTS {
                for src in SOURCES {
                    cells += 1;
                    let seen = observe(&sb, src, target(policy, dest), REQUESTS, T);
                    let args = packet_args(src, policy, dest);
                    let kernel = summarize(&trace_json(sb.node(), &args));
                    let mut with_plan = args.clone();
                    with_plan.extend(plan_args(&m.dir, variant));
                    let plan = summarize(&trace_json(sb.node(), &with_plan));
                    // Real packets: reachable, by which endpoints, client address kept or not. The node's own
                    // connections leave from whichever address its route picks, so for them the masquerade
                    // decision is compared with kube-proxy's answer (the matrix test checks that one).
                    let kept = match client_addr(src) {
                        Some(c) => seen.peers == [c].into(),
                        None => expected(src, dest, policy, variant).1,
                    };
                    let real = Traced {
                        verdicts: [if seen.errors == 0 {
                            "accept"
                        } else {
                            "not answered"
                        }
                        .to_string()]
                        .into(),
                        endpoints: seen.endpoints.clone(),
                        masquerade: [!kept].into(),
                        uniform: true,
                    };
                    let cell = format!(
                        "{src:?} → {dest:?} [{policy:?}, {variant:?}]: real {real:?}; \
                         kernel trace {kernel:?}; plan trace {plan:?}"
                    );
                    let ok = kernel == real && plan == real;
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

/// Runs `nftkube ARGS` (no namespace needed: the arguments are refused before anything is read).
fn refused(args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(nftkube_bin())
        .args(args)
        .output()
        .expect("running nftkube");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_arguments_are_refused_with_the_argument_named() {
    let ok = [
        "--src",
        "10.244.0.2",
        "--dst",
        "10.96.0.10:80",
        "--proto",
        "tcp",
    ];
    let with = |name: &str, value: &str| -> Vec<String> {
        let mut args = vec!["trace".to_string()];
        let mut i = 0;
        while i < ok.len() {
            if ok[i] != name {
                args.extend([ok[i].to_string(), ok[i + 1].to_string()]);
            }
            i += 2;
        }
        args.extend([name.to_string(), value.to_string()]);
        args
    };
    let cases: Vec<(Vec<String>, &str, &str)> = vec![
        (with("--src", "pod-a"), "--src", "not an address"),
        (with("--dst", "10.96.0.10"), "--dst", "has no port"),
        (with("--dst", "10.96.0.10:http"), "--dst", "not an address"),
        (
            with("--proto", "icmp"),
            "--proto",
            "not one of tcp, udp, sctp",
        ),
        (
            with("--from", "moon"),
            "--from",
            "not one of pod, node, outside",
        ),
        (with("--src", "fd00::1"), "--src", "different IP families"),
        (
            with("--iif", "a-name-longer-than-15"),
            "--iif",
            "1 to 15 bytes",
        ),
        (with("--count", "0"), "--count", "0"),
        (
            {
                let mut a = with("--manifests", "/nonexistent");
                a.push("--live".into());
                a
            },
            "--live",
            "cannot be combined with --manifests",
        ),
    ];
    for (args, name, reason) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = refused(&args);
        assert_eq!(
            code,
            Some(64),
            "nftkube {args:?}: exit code, stderr:\n{stderr}"
        );
        assert!(
            stderr.contains(name) && stderr.contains(reason),
            "nftkube {args:?}: the message should name {name} and say {reason:?}:\n{stderr}"
        );
    }
    let (code, stderr) = refused(&["trace", "--dst", "10.96.0.10:80", "--proto", "tcp"]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("--src"), "{stderr}");
}

/// `nftkube trace ARGS` (a `--live` run) in `ns`, once its table is in place: the child and the table's name.
/// `capture`: its output piped for the test to read, else discarded.
fn start_live(
    ns: &nftkube_sandbox::netns::NetNs,
    args: &[String],
    capture: bool,
) -> (std::process::Child, String) {
    let output = || {
        if capture {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        }
    };
    let child = ns
        .command(nftkube_bin())
        .args(args)
        .stdout(output())
        .stderr(output())
        .spawn()
        .expect("starting nftkube trace --live");
    let mut table = None;
    wait_until(Duration::from_secs(10), || {
        table = trace_table_of(ns, child.id());
        table.is_some()
    })
    .unwrap_or_else(|_| panic!("no trace table of process {} appeared", child.id()));
    (child, table.unwrap())
}

/// The trace table of process `pid` in `ns` (family ip): `nftkube-trace-PID-START-RANDOM`.
fn trace_table_of(ns: &nftkube_sandbox::netns::NetNs, pid: u32) -> Option<String> {
    let prefix = format!("{}{pid}-", nftkube::render::names::TRACE_TABLE_PREFIX);
    table_names(ns, nftkube::nft::ir::Family::Ip)
        .into_iter()
        .find(|n| n.starts_with(&prefix))
}

/// Whether table `name` exists in `ns` (family ip).
fn has_table(ns: &nftkube_sandbox::netns::NetNs, name: &str) -> bool {
    table_names(ns, nftkube::nft::ir::Family::Ip)
        .iter()
        .any(|n| n == name)
}

/// The rules of table `ip nftkube` an offline outcome says matched, in order.
fn offline_matched_rules(outcome: &Value) -> Vec<String> {
    outcome["path"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["table"] == "ip nftkube" && s["matched"] == true && !s["rule"].is_null())
        .map(|s| s["text"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn live_trace_reports_the_path_of_a_real_packet_and_removes_its_table() {
    let sb = sandbox("nk-tl", 2);
    let m = Manifests::examples();
    m.write("matrix.yaml", &manifest());
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    let dst = target(Policy::Cluster, Dest::ClusterIp);
    wait_until(SYNC, || served(sb.client(), dst, T))
        .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
    let mut args = packet_args(Source::Pod, Policy::Cluster, Dest::ClusterIp);
    args.extend(["--live", "--count", "1", "--timeout", "20s"].map(String::from));
    let (child, table) = start_live(sb.node(), &args, true);
    // The trace table obeys the listing invariant like every state we program.
    assert_listable(sb.node());
    let answer =
        sandbox::tcp_request(sb.client(), dst, T).expect("a connection through the service");
    let (pod, _) = sandbox::parse_answer(&answer).expect("a backend's answer");
    let out = child
        .wait_with_output()
        .expect("waiting for nftkube trace --live");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "nftkube trace --live failed: {stderr}"
    );
    assert!(!has_table(sb.node(), &table), "table {table} left behind");
    let live: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(live["stopped_by"], "count", "{live:#}");
    let events = live["packets"][0]["events"]
        .as_array()
        .expect("one packet's events");
    let live_rules: Vec<String> = events
        .iter()
        .filter(|e| {
            e["table"] == "ip nftkube" && e["kind"] == "rule" && !e["rule_handle"].is_null()
        })
        .map(|e| {
            e["rule"]
                .as_str()
                .expect("rule text read by handle")
                .to_string()
        })
        .collect();
    // After DNAT the events carry the endpoint's address: the one that answered.
    let endpoint = format!("{}:{}", sandbox::pod_ip_v4(pod), BACKEND_TCP_PORT);
    // (The kernel dumps the packet with the first event of each base chain.)
    let last = events
        .iter()
        .rev()
        .find_map(|e| e["packet"].as_str())
        .expect("events with the packet")
        .to_string();
    assert!(
        last.ends_with(&format!("-> {endpoint}")),
        "last event's packet {last}, answered by {endpoint}"
    );
    // The offline trace of the same packet, the outcome with that endpoint: the same rules, in order.
    let offline_args = packet_args(Source::Pod, Policy::Cluster, Dest::ClusterIp);
    let offline = trace_json(sb.node(), &offline_args);
    let outcome = offline["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["dnat"] == endpoint.as_str())
        .unwrap_or_else(|| panic!("no offline outcome reaches {endpoint}: {offline:#}"));
    let offline_rules = offline_matched_rules(outcome);
    assert!(!offline_rules.is_empty());
    assert_eq!(live_rules, offline_rules, "live events:\n{live:#}");

    // Ctrl-C while waiting: the table goes, what was seen (nothing) is printed, exit 0.
    let (child, table) = start_live(sb.node(), &args, true);
    // SAFETY: kill has no memory-safety preconditions; the pid is our own child's, not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child
        .wait_with_output()
        .expect("waiting for nftkube trace --live");
    assert!(
        out.status.success(),
        "after SIGINT: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let live: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(live["stopped_by"], "signal");
    assert_eq!(live["packets"].as_array().map(Vec::len), Some(0));
    assert!(
        !has_table(sb.node(), &table),
        "table {table} left behind after SIGINT"
    );

    // SIGKILL leaves the table behind; `nftkube cleanup` removes it with nftkube's own tables.
    let (mut child, table) = start_live(sb.node(), &args, false);
    child.kill().unwrap();
    child.wait().unwrap();
    drop(agent);
    assert!(
        has_table(sb.node(), &table),
        "a killed trace removed its table"
    );
    let out = nftkube_in(sb.node(), &["cleanup"]);
    assert!(
        out.status.success(),
        "cleanup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!has_table(sb.node(), &table), "cleanup left {table}");
    assert!(
        !has_table(sb.node(), "nftkube"),
        "cleanup left nftkube's own table"
    );
}

/// Sends `sig` to the child `pid`.
fn signal(pid: u32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions; the pid is the test's own child's, not yet reaped.
    let rc = unsafe { libc::kill(pid as i32, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

/// Whether process `pid` is stopped (state T in /proc/PID/stat).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s.rsplit_once(')')?.1.split_whitespace().next()? == "T"))
        .unwrap_or(false)
}

/// The arguments of a `--live` trace that no packet of the test matches: it runs until stopped.
fn idle_live_args() -> Vec<String> {
    [
        "trace",
        "--src",
        "10.244.9.9",
        "--dst",
        "10.96.9.9:9",
        "--proto",
        "tcp",
        "--live",
        "--timeout",
        "30s",
        "-o",
        "json",
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn a_second_stop_signal_ends_a_live_trace_at_once() {
    let sb = sandbox("nk-tss", 0);
    let (child, _) = start_live(sb.node(), &idle_live_args(), true);
    let pid = child.id();
    // Stopped, the process takes both signals at once when it continues, while the first one's removal of
    // the table is still to come: the second must not wait for it.
    signal(pid, libc::SIGSTOP);
    wait_until(Duration::from_secs(5), || is_stopped(pid)).expect("the trace never stopped");
    signal(pid, libc::SIGINT);
    signal(pid, libc::SIGTERM);
    signal(pid, libc::SIGCONT);
    let out = child
        .wait_with_output()
        .expect("waiting for nftkube trace --live");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("second signal"), "{stderr}");
    assert!(stderr.contains("cleanup --traces"), "{stderr}");
}

/// A trace table is created exclusively: a second run that picked the same name would be refused (EEXIST)
/// instead of sharing the first one's table, while the proxy's create-or-update of its own table still
/// succeeds on an existing one.
#[test]
fn creating_an_existing_table_exclusively_is_refused() {
    use nftkube::nft::{ir::Family, netlink::NftSocket, tx::Op, tx::Transaction};
    let sb = sandbox("nk-tex", 0);
    let commit = |op: Op| {
        let mut tx = Transaction::default();
        tx.push(Family::Ip, "nftkube-trace-1-2-0000000000000003", op);
        sb.node()
            .run(move || {
                NftSocket::open()
                    .expect("nf_tables socket")
                    .commit(&tx)
                    .map(drop)
            })
            .expect("entering the namespace")
    };
    commit(Op::CreateTable).expect("creating a new table");
    let refused = commit(Op::CreateTable).expect_err("created an existing table");
    assert_eq!(refused.errno(), Some(libc::EEXIST), "{refused}");
    commit(Op::AddTable).expect("add (create or update) of an existing table");
}

#[test]
fn cleanup_traces_removes_abandoned_trace_tables_only() {
    let sb = sandbox("nk-tcl", 0);
    let ns = sb.node();
    // The proxy's table (empty: what is in it does not matter here).
    ns.run(|| {
        let mut tx = nftkube::nft::tx::Transaction::default();
        tx.push(
            nftkube::nft::ir::Family::Ip,
            "nftkube",
            nftkube::nft::tx::Op::AddTable,
        );
        nftkube::nft::netlink::NftSocket::open()
            .expect("nf_tables socket")
            .commit(&tx)
            .expect("adding table ip nftkube");
    })
    .expect("entering the namespace");
    let args = idle_live_args();
    // A killed run leaves its table behind.
    let (mut killed, abandoned) = start_live(ns, &args, false);
    killed.kill().unwrap();
    killed.wait().unwrap();
    let (running, alive) = start_live(ns, &args, true);
    assert_ne!(abandoned, alive);

    let out = nftkube_in(ns, &["cleanup", "--traces"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cleanup --traces: {stderr}");
    assert!(stderr.contains("removed 1 table(s)"), "{stderr}");
    assert!(
        !has_table(ns, &abandoned),
        "cleanup --traces left {abandoned}"
    );
    assert!(
        has_table(ns, &alive),
        "cleanup --traces removed the running trace's {alive}"
    );
    assert!(
        has_table(ns, "nftkube"),
        "cleanup --traces removed the proxy's table"
    );

    // The running trace still ends as usual, removing its own table.
    signal(running.id(), libc::SIGINT);
    let out = running
        .wait_with_output()
        .expect("waiting for nftkube trace --live");
    assert!(
        out.status.success(),
        "after SIGINT: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!has_table(ns, &alive), "{alive} left after SIGINT");
}

/// `nftkube-portmap` (the CNI plugin, as shipped) `command` (ADD, DEL) for pod1 as the container, with `mappings`;
/// the previous result is written by hand (pod1's address on its eth0), as a bridge plugin would have returned
/// it.
fn portmap(sb: &kernel_tests::sandbox::Sandbox, command: &str, mappings: Value) {
    use std::io::Write as _;
    let pod = sb.pod(1);
    let conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "trace-net", "type": "portmap",
        "capabilities": {"portMappings": true},
        "runtimeConfig": {"portMappings": mappings},
        "prevResult": {
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "sandbox": pod.path()}],
            "ips": [{"address": format!("{}/24", sandbox::pod_ip_v4(1)), "interface": 0,
                     "gateway": sandbox::pod_gateway_v4(1).to_string()}]
        }
    });
    let mut child = sb
        .node()
        .command(portmap_bin())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", "trace-container")
        .env("CNI_NETNS", pod.path())
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/nonexistent")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running nftkube-portmap");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "portmap {command} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_listable(sb.node());
}

#[test]
fn a_portmap_mapping_is_traced_through_the_plugins_table() {
    let sb = sandbox("nk-tp", 1);
    let host_port = 30080;
    let mappings = serde_json::json!([{"hostPort": host_port, "containerPort": BACKEND_TCP_PORT, "protocol": "tcp"}]);
    portmap(&sb, "ADD", mappings.clone());
    let dst = std::net::SocketAddr::new(sandbox::node_ip_v4().into(), host_port);
    // Real packets from outside: answered by pod1, which sees the client's own address.
    let answer = sandbox::tcp_request(sb.ext(), dst, T).expect("the host port answers");
    let (pod, peer) = sandbox::parse_answer(&answer).unwrap();
    assert_eq!((pod, peer), (1, IpAddr::from(sandbox::ext_ip_v4())));
    let args: Vec<String> = [
        "trace",
        "--src",
        &sandbox::ext_ip_v4().to_string(),
        "--dst",
        &dst.to_string(),
        "--proto",
        "tcp",
        "--from",
        "outside",
        "--iif",
        sandbox::NODE_UPLINK,
        "-o",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let json = trace_json(sb.node(), &args);
    let traced = summarize(&json);
    assert_eq!(
        traced,
        Traced {
            verdicts: ["accept".to_string()].into(),
            endpoints: [1].into(),
            masquerade: [false].into(),
            uniform: true,
        },
        "{json:#}"
    );
    let path = json["outcomes"][0]["path"].as_array().unwrap();
    assert!(
        path.iter().any(|s| s["table"] == "ip nftkube-portmap"
            && s["matched"] == true
            && s["notes"].to_string().contains("dnat")),
        "the DNAT is the portmap table's: {json:#}"
    );
    // A port nothing maps: through the same table, not DNATed, delivered to the node itself.
    let mut other = args.clone();
    other[4] = std::net::SocketAddr::new(sandbox::node_ip_v4().into(), host_port + 1).to_string();
    let json = trace_json(sb.node(), &other);
    let o = &json["outcomes"][0];
    assert!(o["dnat"].is_null() && o["verdict"] == "accept", "{json:#}");
    assert!(
        o["detail"].as_str().unwrap().contains("delivered locally"),
        "{json:#}"
    );
    // As a runtime would: the container's DEL, which also forgets the plugin's record of it.
    portmap(&sb, "DEL", mappings);
}

/// `nftkube trace` of a packet from pod0 (arriving on pod0's link) to `dst`.
fn from_pod(
    sb: &kernel_tests::sandbox::Sandbox,
    src: IpAddr,
    dst: std::net::SocketAddr,
    proto: &str,
) -> Value {
    let args: Vec<String> = [
        "trace",
        "--src",
        &src.to_string(),
        "--dst",
        &dst.to_string(),
        "--proto",
        proto,
        "--from",
        "pod",
        "--iif",
        &sandbox::node_pod_ifname(0),
        "-o",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    trace_json(sb.node(), &args)
}

#[test]
fn rejects_and_ipv6_are_traced_as_real_packets_go() {
    let sb = sandbox("nk-te", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || served(sb.client(), addr("10.96.0.10", 80), T))
        .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
    let pod4 = IpAddr::from(sandbox::pod_ip_v4(0));
    // demo/empty has no endpoints: TCP is reset, UDP gets port unreachable; the trace says reject, and how.
    let refused = |r: std::io::Result<String>| matches!(r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused);
    assert!(refused(sandbox::tcp_request(
        sb.client(),
        addr("10.96.0.20", 80),
        T
    )));
    assert!(refused(sandbox::udp_request(
        sb.client(),
        addr("10.96.0.20", 81),
        T
    )));
    for (dst, proto, how) in [
        (addr("10.96.0.20", 80), "tcp", "tcp reset"),
        (addr("10.96.0.20", 81), "udp", "reject with icmp"),
    ] {
        let json = from_pod(&sb, pod4, dst, proto);
        let outcomes = json["outcomes"].as_array().unwrap();
        assert_eq!(outcomes.len(), 1, "{json:#}");
        assert_eq!(outcomes[0]["verdict"], "reject", "{json:#}");
        assert!(
            outcomes[0]["detail"].as_str().unwrap().contains(how),
            "{json:#}"
        );
        assert!(outcomes[0]["dnat"].is_null(), "{json:#}");
    }
    // IPv6: demo/echo6 from pod0, through table ip6 nftkube.
    let dst6: std::net::SocketAddr = "[fd00:96::10]:80".parse().unwrap();
    let pod6 = IpAddr::from(sandbox::pod_ip_v6(0));
    let seen = kernel_tests::sandbox::tcp_requests(sb.client(), dst6, 40, T);
    let answers: Vec<(usize, IpAddr)> = seen
        .iter()
        .map(|a| sandbox::parse_answer(a.as_ref().expect("IPv6 answered")).unwrap())
        .collect();
    let json = from_pod(&sb, pod6, dst6, "tcp");
    let traced = summarize(&json);
    assert_eq!(
        traced,
        Traced {
            verdicts: ["accept".to_string()].into(),
            endpoints: answers.iter().map(|a| a.0).collect(),
            masquerade: [answers.iter().any(|a| a.1 != pod6)].into(),
            uniform: true,
        },
        "{json:#}"
    );
    drop(agent);
}
