//! Large commits with the event monitor paused (`crates/sync/src/quiet.rs`): the kernel builds no notification of
//! them for the monitor's socket, small commits still reach it, and a foreign commit made while the monitor
//! was deaf is still reported, from the generation id. Real kernel, real monitor socket, real packets.

use kernel_tests::sandbox::tcp_requests;
use kernel_tests::*;
use nftkube::model::*;
use nftkube::netlink::{Membership, NlSocket};
use nftkube::nft::ir::Family;
use nftkube::nft::monitor;
use nftkube::nft::monitor::EventSubscriber;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube::render::{self, RenderConfig};
use nftkube::sync::quiet::QUIET_COMMIT_ELEMENTS;
use nftkube::sync::SyncEngine;
use nftkube_sandbox::netns::{unique_name, NetNs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Services in the large model: each brings its dispatch element, its ClusterIP and three endpoints.
const SERVICES: u32 = 400;

/// A subscriber on a real monitor socket that records what the engine asks of it, and can commit to a
/// table of someone else's right after leaving the group (a foreign commit the monitor cannot see).
struct Probe {
    membership: Membership,
    calls: Arc<Mutex<Vec<&'static str>>>,
    foreign_commit_on_pause: bool,
}

impl EventSubscriber for Probe {
    fn pause(&self) -> std::io::Result<()> {
        self.calls.lock().unwrap().push("pause");
        self.membership.leave()?;
        if self.foreign_commit_on_pause {
            let mut other = NftSocket::open()?;
            let mut tx = Transaction::default();
            tx.push(Family::Ip, "someone-else", Op::AddTable);
            other.commit(&tx).expect("the foreign commit");
        }
        Ok(())
    }

    fn resume(&self) -> std::io::Result<()> {
        self.calls.lock().unwrap().push("resume");
        self.membership.join()
    }

    fn missed_foreign_commit(&self) {
        self.calls.lock().unwrap().push("missed");
    }
}

/// `SERVICES` services backed by the sandbox's pods, and the render configuration.
fn model() -> (ServiceMap, EndpointsMap, RenderConfig) {
    let (services, endpoints) = pod_backed_services(SERVICES);
    let cfg = RenderConfig {
        cluster_cidrs: vec![sandbox::CLUSTER_CIDR_V4.parse().unwrap()],
        ..RenderConfig::default()
    };
    (services, endpoints, cfg)
}

/// An engine whose subscriber is a `Probe` on a freshly subscribed monitor socket (returned, to count what
/// reaches it). Call in the namespace.
fn engine_with_probe(
    foreign_commit_on_pause: bool,
) -> (
    SyncEngine<NftSocket>,
    NlSocket,
    Arc<Mutex<Vec<&'static str>>>,
) {
    let (sock, membership) = monitor::subscribe().expect("monitor socket");
    let calls = Arc::new(Mutex::new(Vec::new()));
    let mut engine = SyncEngine::new(NftSocket::open().unwrap());
    // Several transactions, so the generation must have moved by exactly their number.
    engine.set_max_transaction_elements(500);
    engine.set_event_subscriber(Box::new(Probe {
        membership,
        calls: calls.clone(),
        foreign_commit_on_pause,
    }));
    (engine, sock, calls)
}

/// The events queued on `sock` that `port` caused.
fn events_from(sock: &mut NlSocket, port: u32) -> usize {
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0;
    while sock.wait_readable(Duration::from_millis(200)).unwrap() {
        let len = sock.recv_raw(&mut buf).expect("monitor read");
        let msgs = nftkube::netlink::attr::split(&buf[..len]).unwrap();
        n += msgs.iter().filter(|m| m.pid == port).count();
    }
    n
}

#[test]
fn a_large_commit_reaches_no_subscriber_and_a_small_one_does() {
    let sb = sandbox("nk-quiet", 3);
    let (services, mut endpoints, cfg) = model();
    let (report, large_events, small_events, calls) = sb
        .node()
        .run(move || {
            let (mut engine, mut sock, calls) = engine_with_probe(false);
            let port = engine
                .backend()
                .port_handle()
                .load(std::sync::atomic::Ordering::SeqCst);
            let report = engine
                .sync_full(
                    render::skeleton(&cfg),
                    render::all_pieces(&services, &endpoints, &cfg),
                )
                .unwrap();
            let large_events = events_from(&mut sock, port);
            let large_calls = calls.lock().unwrap().clone();
            // One endpoint less for one service: a handful of element operations, committed listening.
            let name = services.keys().next().unwrap().clone();
            endpoints.get_mut(&name).unwrap().pop();
            let pieces = render::service_pieces(&services[&name], endpoints.get(&name), &cfg);
            engine.sync_partial(vec![(name, pieces)]).unwrap();
            let small_events = events_from(&mut sock, port);
            let all_calls = calls.lock().unwrap().clone();
            (report, large_events, small_events, (large_calls, all_calls))
        })
        .unwrap();
    eprintln!("large commit: {report:?}; calls {calls:?}; events {large_events} / {small_events}");
    assert!(report.transactions > 1, "{report:?}");
    const { assert!(SERVICES as usize * 5 >= QUIET_COMMIT_ELEMENTS) };
    assert_eq!(
        calls.0,
        ["pause", "resume"],
        "the large commit paused the subscriber once"
    );
    assert_eq!(
        large_events, 0,
        "no event of the large commit reached the paused socket"
    );
    assert_eq!(
        calls.1,
        ["pause", "resume"],
        "the small commit did not pause it"
    );
    assert!(
        small_events > 0,
        "the small commit's events reached the socket"
    );
    // The rules the paused commit made carry traffic.
    for i in [0, SERVICES / 2, SERVICES - 1] {
        let answers = tcp_requests(
            sb.client(),
            pod_backed_service(i),
            5,
            Duration::from_secs(2),
        );
        assert!(
            answers.iter().all(|a| a.is_ok()),
            "service {i}: {answers:?}"
        );
    }
}

#[test]
fn a_foreign_commit_while_paused_is_reported_from_the_generation() {
    let (services, endpoints, cfg) = model();
    for foreign in [false, true] {
        let ns = NetNs::create(&unique_name("nkquiet")).unwrap();
        let (services, endpoints, cfg) = (services.clone(), endpoints.clone(), cfg.clone());
        let calls = ns
            .run(move || {
                let (mut engine, _sock, calls) = engine_with_probe(foreign);
                engine
                    .sync_full(
                        render::skeleton(&cfg),
                        render::all_pieces(&services, &endpoints, &cfg),
                    )
                    .unwrap();
                let recorded = calls.lock().unwrap().clone();
                recorded
            })
            .unwrap();
        let expected: &[&str] = match foreign {
            true => &["pause", "resume", "missed"],
            false => &["pause", "resume"],
        };
        assert_eq!(
            calls, expected,
            "foreign commit during the pause: {foreign}"
        );
    }
}
