//! The sync engine against a real kernel: self-repair, restarts without outage, rejected batches.

use kernel_tests::sandbox::{parse_answer, tcp_request, tcp_request_here, tcp_requests};
use kernel_tests::*;
use nftkube::model::*;
use nftkube::nft::ir::{Element, Family};
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube::render::{self, RenderConfig};
use nftkube::sync::SyncEngine;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);

fn echo() -> SocketAddr {
    "10.96.0.10:80".parse().unwrap()
}

fn wait_reachable(ns: &nftkube_sandbox::netns::NetNs, dst: SocketAddr) {
    wait_until(SYNC, || {
        tcp_request(ns, dst, Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("{dst} never became reachable"));
}

#[test]
fn deleted_or_flushed_tables_are_repaired_within_a_second() {
    let sb = sandbox("nk-rep", 3);
    let m = Manifests::examples();
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_reachable(sb.client(), echo());

    for (what, cmd) in [
        ("table deleted", "delete table ip nftkube"),
        ("dispatch set flushed", "flush set ip nftkube lb-ips"),
        ("chain flushed", "flush chain ip nftkube services"),
    ] {
        let status = sb.node().command("nft").arg(cmd).status().unwrap();
        assert!(status.success(), "nft {cmd}");
        let broken_at = Instant::now();
        // Fresh connections each time; the first ones fail while the table is broken.
        let took = wait_until(Duration::from_secs(5), || {
            tcp_request(sb.client(), echo(), Duration::from_millis(200)).is_ok()
        })
        .unwrap_or_else(|_| panic!("{what}: not repaired; log:\n{}", agent.log()));
        eprintln!("{what}: traffic back after {:?}", broken_at.elapsed());
        assert!(
            took < Duration::from_secs(1),
            "{what}: repair took {took:?}"
        );
        assert_eq!(
            tcp_requests(sb.client(), echo(), 30, T)
                .iter()
                .filter(|r| r.is_err())
                .count(),
            0
        );
    }
    assert!(
        agent.log().contains("changed by someone else"),
        "{}",
        agent.log()
    );
}

#[test]
fn restarting_the_agent_drops_no_connection() {
    let sb = sandbox("nk-rst", 3);
    let m = Manifests::examples();
    let mut agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_reachable(sb.client(), echo());

    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (s, o, f) = (stop.clone(), ok.clone(), failed.clone());
    let client = sb
        .client()
        .spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match tcp_request_here(echo(), T) {
                    Ok(a) if parse_answer(&a).is_some() => o.fetch_add(1, Ordering::SeqCst),
                    _ => f.fetch_add(1, Ordering::SeqCst),
                };
            }
        })
        .unwrap();

    std::thread::sleep(Duration::from_millis(300));
    assert!(agent.stop());
    std::thread::sleep(Duration::from_millis(300));
    let agent2 = Agent::start(sb.node(), &m.dir, &[]);
    agent2.wait_syncs(1, SYNC);
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    client.join().unwrap();
    let (ok, failed) = (ok.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    eprintln!("connections during stop/start: {ok} answered, {failed} failed");
    assert!(ok > 50, "too few connections to mean anything: {ok}");
    assert_eq!(failed, 0, "connections failed across the restart");
    // The restarted agent adopted the table as it was.
    assert!(
        agent2.log().contains("full=true changes=0"),
        "{}",
        agent2.log()
    );
}

fn model() -> (ServiceMap, EndpointsMap, RenderConfig) {
    let spn = ServicePortName {
        service: NamespacedName::new("demo", "echo"),
        port: "tcp".into(),
        protocol: Protocol::Tcp,
    };
    let sp = ServicePort::cluster_ip(spn.clone(), vec![echo().ip()], 80);
    let eps = (1..=3)
        .map(|i| Endpoint::ready(sandbox::pod_ip_v4(i).into(), BACKEND_TCP_PORT))
        .collect();
    let cfg = RenderConfig {
        cluster_cidrs: vec![sandbox::CLUSTER_CIDR_V4.parse().unwrap()],
        ..RenderConfig::default()
    };
    ([(spn.clone(), sp)].into(), [(spn, eps)].into(), cfg)
}

#[test]
fn a_rejected_batch_leaves_the_old_rules_carrying_traffic() {
    let sb = sandbox("nk-err", 3);
    let (services, endpoints, cfg) = model();
    // The sync engine runs on a thread in the node namespace, as the agent does.
    let (to_engine, from_test) = std::sync::mpsc::channel::<&'static str>();
    let (to_test, from_engine) = std::sync::mpsc::channel::<String>();
    let engine_thread = sb
        .node()
        .spawn(move || {
            let mut engine = SyncEngine::new(NftSocket::open().unwrap());
            let pieces = render::all_pieces(&services, &endpoints, &cfg);
            engine.sync_full(render::skeleton(&cfg), pieces).unwrap();
            to_test.send("synced".into()).unwrap();
            from_test.recv().unwrap();
            // One transaction: a valid change (the service's endpoints emptied), then an element whose key
            // has the wrong length for its map.
            let mut tx = Transaction::default();
            tx.push(
                Family::Ip,
                "nftkube",
                Op::DeleteElements {
                    set: "lb-ips".into(),
                    elements: engine_elements(&mut engine, "lb-ips"),
                },
            );
            tx.push(
                Family::Ip,
                "nftkube",
                Op::AddElements {
                    set: "cluster-ips".into(),
                    elements: vec![Element {
                        key: vec![1, 2, 3].into(),
                        value: None,
                    }],
                },
            );
            let err = engine.backend().commit(&tx).unwrap_err();
            to_test.send(err.to_string()).unwrap();
        })
        .unwrap();
    assert_eq!(from_engine.recv().unwrap(), "synced");
    wait_reachable(sb.client(), echo());
    to_engine.send("go").unwrap();
    let err = from_engine.recv().unwrap();
    engine_thread.join().unwrap();
    assert!(
        err.contains("cluster-ips"),
        "the error must name the failing object: {err}"
    );
    assert!(err.contains("nothing applied"), "{err}");
    // The valid half was not applied either: the service still answers, from every backend.
    let answers = tcp_requests(sb.client(), echo(), 60, T);
    let pods: std::collections::BTreeSet<usize> = answers
        .iter()
        .map(|a| {
            parse_answer(a.as_ref().expect("old rules must still carry traffic"))
                .unwrap()
                .0
        })
        .collect();
    assert_eq!(pods, [1, 2, 3].into());
}

fn engine_elements(engine: &mut SyncEngine<NftSocket>, set: &str) -> Vec<Element> {
    let t = engine
        .backend()
        .dump_table(Family::Ip, "nftkube")
        .unwrap()
        .unwrap();
    t.sets[set].elements.iter().cloned().collect()
}

/// A first sync big enough to be cut into several transactions still ends with exactly the desired tables,
/// and services at the start, middle and end of it carry traffic.
#[test]
fn a_big_first_sync_is_committed_in_chunks_and_is_complete() {
    let sb = sandbox("nk-big", 3);
    let (_, _, cfg) = model();
    let n = 6000u32;
    // Every service gets the three real backends, so any of them can be probed.
    let (services, endpoints) = pod_backed_services(n);
    let probes: Vec<SocketAddr> = [0, n / 2, n - 1].map(pod_backed_service).into();
    let desired = render::render(&services, &endpoints, &cfg);
    let (report, dumped) = sb
        .node()
        .run(move || {
            let mut engine = SyncEngine::new(NftSocket::open().unwrap());
            let r = engine
                .sync_full(
                    render::skeleton(&cfg),
                    render::all_pieces(&services, &endpoints, &cfg),
                )
                .unwrap();
            let t = engine
                .backend()
                .dump_table(Family::Ip, "nftkube")
                .unwrap()
                .unwrap();
            (r, t)
        })
        .unwrap();
    eprintln!(
        "{n} services: {} transactions, longest {:?}, total commit {:?}",
        report.transactions, report.longest_transaction, report.commit_time
    );
    assert!(
        report.transactions > 1,
        "expected a chunked commit: {report:?}"
    );
    assert_eq!(
        dumped, desired[0],
        "the kernel must hold exactly the desired table"
    );
    for dst in probes {
        let answers = tcp_requests(sb.client(), dst, 10, T);
        assert!(answers.iter().all(|a| a.is_ok()), "{dst}: {answers:?}");
    }
}
