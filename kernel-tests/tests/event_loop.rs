//! The agent's loop is driven by events: inotify wakes it for manifest changes (no polling), bursts
//! coalesce as kube-proxy's sync runner does, and periodic checks trust the ruleset's generation id instead
//! of reading the tables back.

use kernel_tests::sandbox::tcp_requests;
use kernel_tests::sandbox::Sandbox;
use kernel_tests::*;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);

fn echo() -> SocketAddr {
    "10.96.0.10:80".parse().unwrap()
}

fn syncs(agent: &Agent) -> usize {
    agent.log().matches("sync complete").count()
}

fn verified(agent: &Agent) -> usize {
    agent.log().matches("nothing read back").count()
}

/// A second service, served by pod 1.
const EXTRA: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: extra, namespace: demo}\nspec:\n  clusterIP: 10.96.0.77\n  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: extra-a, namespace: demo, labels: {kubernetes.io/service-name: extra}}\naddressType: IPv4\nports: [{name: tcp, port: 8080, protocol: TCP}]\nendpoints:\n- addresses: [10.244.1.2]\n  conditions: {ready: true}\n";

/// The pods the echo service answers from, over `n` fresh connections.
fn answering(sb: &Sandbox, n: usize) -> std::collections::BTreeSet<usize> {
    pods(&tcp_requests(sb.client(), echo(), n, T))
}

/// The periodic check (and with it the manifest source's fallback) comes once an hour here: every change
/// the agent applies was reported by inotify.
#[test]
fn manifest_changes_arrive_through_inotify_without_polling() {
    let sb = sandbox("nk-evino", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &["--sync-period", "1h"]);
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || answering(&sb, 30) == [1, 2, 3].into())
        .unwrap_or_else(|_| panic!("never served by every pod; log:\n{}", agent.log()));

    let slices = m.read("endpointslices.yaml");
    let written = Instant::now();
    m.write(
        "endpointslices.yaml",
        &without_endpoint(&slices, &sandbox::pod_ip_v4(2).to_string()),
    );
    let took = wait_until(SYNC, || answering(&sb, 20) == [1, 3].into())
        .unwrap_or_else(|_| panic!("the edit never arrived; log:\n{}", agent.log()));
    eprintln!("manifest edit → traffic follows: {took:?} (hang guard {SYNC:?})");
    // A new file, then the file removed again: both arrive, in order.
    m.write("extra.yaml", EXTRA);
    wait_until(SYNC, || served(sb.client(), addr("10.96.0.77", 80), T))
        .unwrap_or_else(|_| panic!("the new file never arrived; log:\n{}", agent.log()));
    m.remove("extra.yaml");
    wait_until(SYNC, || !served(sb.client(), addr("10.96.0.77", 80), T))
        .unwrap_or_else(|_| panic!("the removal never arrived; log:\n{}", agent.log()));
    assert!(written.elapsed() < Duration::from_secs(3600));
    assert_eq!(
        verified(&agent),
        0,
        "no periodic check ran: {}",
        agent.log()
    );
}

/// The agent's process, killed if a test fails while it runs.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The agent logs to a pipe whose reader goes away (a log collector restarting): what it logs from then on
/// is lost, and nothing else. Every thread that logs goes on (tracing-subscriber reported the failed write
/// with `eprintln!`, which panicked on the same stderr: the loop exited with 101 at its next sync, a
/// watcher or the signal thread died, and SIGTERM was lost with it).
#[test]
fn a_closed_log_pipe_loses_the_log_and_nothing_else() {
    let sb = sandbox("nk-evpipe", 3);
    let m = Manifests::examples();
    let mut agent = Running(
        sb.node()
            .command(nftkube_bin())
            .args(proxy_args(&m.dir, &["--sync-period", "1s"]))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the agent"),
    );
    // Read up to the first sync on a thread of ours (a read has no timeout), then close the only reader.
    let stderr = agent.0.stderr.take().unwrap();
    let (synced_tx, synced) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let first_sync = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("sync complete"));
        let _ = synced_tx.send(first_sync);
    });
    assert_eq!(synced.recv_timeout(SYNC), Ok(true), "no first sync");
    wait_until(SYNC, || answering(&sb, 30) == [1, 2, 3].into()).expect("never served by every pod");

    // The source, the loop and the periodic check (every second) all log into the closed pipe now.
    m.write("extra.yaml", EXTRA);
    wait_until(SYNC, || served(sb.client(), addr("10.96.0.77", 80), T))
        .expect("a change after the log's pipe closed never arrived");
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        agent.0.try_wait().unwrap().is_none(),
        "the agent exited: {:?}",
        agent.0.try_wait()
    );
    assert!(served(sb.client(), addr("10.96.0.77", 80), T));

    // SIGTERM stops it as it would with a log it can write (the signal thread logs the request first).
    let status = terminate(&mut agent.0);
    assert!(
        status.is_some_and(|s| s.success()),
        "SIGTERM did not stop the agent cleanly: {status:?}"
    );
}

/// A burst of edits with `--min-sync-period 3s`: the first syncs at once (a quiet agent has two syncs in
/// hand), the rest coalesce into one sync per period; the last edit wins.
#[test]
fn a_burst_of_changes_coalesces_into_at_most_one_sync_per_min_sync_period() {
    let sb = sandbox("nk-evburst", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &["--min-sync-period", "3s"]);
    agent.wait_syncs(1, SYNC);
    // Let the bucket fill again after the first sync (and the follow-up that deletes released chains).
    std::thread::sleep(Duration::from_secs(7));
    let before = syncs(&agent);

    let slices = m.read("endpointslices.yaml");
    let variants: Vec<String> = (1..=3)
        .map(|pod| without_endpoint(&slices, &sandbox::pod_ip_v4(pod).to_string()))
        .collect();
    let burst = Instant::now();
    for i in 0..12 {
        m.write("endpointslices.yaml", &variants[i % 3]);
        std::thread::sleep(Duration::from_millis(100));
    }
    let burst_took = burst.elapsed();
    // The last edit (i = 11: without pod 3) is applied in the end.
    wait_until(SYNC, || answering(&sb, 20) == [1, 2].into())
        .unwrap_or_else(|_| panic!("the last edit never applied; log:\n{}", agent.log()));
    let during = syncs(&agent) - before;
    // 1.2 s of edits: the two tokens in hand, then at most one more per 3 s from the burst's start until the
    // last edit was applied.
    let allowed = 2 + (burst.elapsed().as_secs_f64() / 3.0).ceil() as usize;
    eprintln!(
        "{during} syncs for 12 edits over {burst_took:?} (applied after {:?}; allowed {allowed})",
        burst.elapsed()
    );
    assert!(during >= 1, "no sync at all");
    assert!(
        during <= allowed,
        "{during} syncs for a burst of 12 edits (at most {allowed}):\n{}",
        agent.log()
    );
}

/// Periodic checks every 300 ms: while nobody commits they read nothing back; after someone else's commit
/// (to a table of theirs, which the monitor does not count as drift) the generation id moved, and the
/// next check reads our tables back, finds them as committed, and changes nothing.
#[test]
fn periodic_checks_read_the_kernel_back_only_when_its_generation_moved() {
    let sb = sandbox("nk-evgen", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &["--sync-period", "0.3"]);
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || verified(&agent) >= 3).unwrap_or_else(|_| {
        panic!(
            "no periodic check trusted the generation; log:\n{}",
            agent.log()
        )
    });
    let full_reads = || {
        agent
            .log()
            .lines()
            .filter(|l| l.contains("sync complete") && l.contains("full=true"))
            .count()
    };
    let (reads, checks) = (full_reads(), verified(&agent));
    wait_until(SYNC, || verified(&agent) >= checks + 3).unwrap();
    assert_eq!(
        full_reads(),
        reads,
        "a check read back without cause:\n{}",
        agent.log()
    );

    add_foreign_table(sb.node(), nftkube::nft::ir::Family::Ip, "someone-else");
    wait_until(SYNC, || full_reads() > reads).unwrap_or_else(|_| {
        panic!(
            "the moved generation was not noticed; log:\n{}",
            agent.log()
        )
    });
    let log = agent.log();
    let read = log
        .lines()
        .rfind(|l| l.contains("sync complete") && l.contains("full=true"))
        .unwrap();
    assert!(
        read.contains("changes=0") && read.contains("repair=false"),
        "{read}"
    );
    // And then the checks trust the new generation again.
    let checks = verified(&agent);
    wait_until(SYNC, || verified(&agent) >= checks + 2).unwrap_or_else(|_| {
        panic!(
            "the checks never trusted the new generation; log:\n{}",
            agent.log()
        )
    });
    assert_eq!(answering(&sb, 30), [1, 2, 3].into());
}
