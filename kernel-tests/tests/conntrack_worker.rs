//! Conntrack cleanup off the sync path (`conntrack::CleanupQueue`), with real flows: the sync engine commits in
//! the sandbox's node namespace, the queue's worker thread (started there) walks that namespace's conntrack
//! table. The walk is made to wait for the test, which proves by the order of events, not by timing, that a
//! commit made while a walk is in progress is neither delayed by it nor reordered with it.

use kernel_tests::sandbox::{self, parse_answer, udp_request_from, Sandbox};
use kernel_tests::*;
use nftkube::conntrack::wire::IPPROTO_UDP;
use nftkube::conntrack::*;
use nftkube::model::*;
use nftkube::nft::netlink::NftSocket;
use nftkube::render::{self, RenderConfig};
use nftkube::sync::SyncEngine;
use std::net::{IpAddr, SocketAddr};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

const ECHO: &str = "10.96.0.10";
const LATE: &str = "10.96.0.30";
const T: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(30);

/// What happened, in order: commits (by the test, when the engine returned) and walks (by the worker).
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<String>>>);

impl Events {
    fn push(&self, e: String) {
        eprintln!("event: {e}");
        self.0.lock().unwrap().push(e);
    }
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn position(&self, e: &str) -> Option<usize> {
        self.all().iter().position(|x| x == e)
    }
    fn wait(&self, e: &str) {
        wait_until(WAIT, || self.position(e).is_some())
            .unwrap_or_else(|_| panic!("{e:?} never happened: {:?}", self.all()));
    }
}

/// The real walker, held at the start of each walk until the test lets it go.
struct Gated {
    inner: Walker,
    events: Events,
    gate: mpsc::Receiver<()>,
    walks: usize,
}

impl Walk for Gated {
    fn cleanup(
        &mut self,
        filter: &StaleFilter,
        still_stale: &dyn Fn(&Entry) -> bool,
    ) -> Result<CleanupReport, CleanupError> {
        self.walks += 1;
        let n = self.walks;
        self.events.push(format!("walk {n} started"));
        self.gate
            .recv_timeout(WAIT)
            .expect("the test never let the walk go");
        let r = self.inner.cleanup_checked(filter, still_stale);
        self.events.push(format!("walk {n} ended"));
        r
    }

    fn clear_black_holes(&mut self, frontends: &Frontends) -> Result<CleanupReport, CleanupError> {
        self.inner.clear_black_holes(frontends)
    }
}

fn udp_service(name: &str, ip: &str) -> Vec<ServicePort> {
    let spn = ServicePortName {
        service: NamespacedName::new("demo", name),
        port: "udp".into(),
        protocol: Protocol::Udp,
    };
    vec![ServicePort::cluster_ip(spn, vec![ip.parse().unwrap()], 53)]
}

fn slice(service: &str, pods: &[usize]) -> SliceInfo {
    SliceInfo {
        namespace: "demo".into(),
        name: format!("{service}-a").into(),
        service: service.into(),
        address_type: IpFamily::V4,
        ports: vec![SlicePort {
            name: "udp".into(),
            port: BACKEND_UDP_PORT,
            protocol: Protocol::Udp,
        }],
        endpoints: pods
            .iter()
            .map(|i| SliceEndpoint::new(sandbox::pod_ip_v4(*i).into(), true, true, false))
            .collect(),
    }
}

fn pod_udp(i: usize) -> SocketAddr {
    SocketAddr::new(sandbox::pod_ip_v4(i).into(), BACKEND_UDP_PORT)
}

/// The client's UDP entry from `sport`, through our own dump of the node's table.
fn udp_flow(sb: &Sandbox, sport: u16) -> Option<Entry> {
    let client: IpAddr = sandbox::pod_ip_v4(0).into();
    sb.node()
        .run(|| CtSocket::open().unwrap().list_all().unwrap())
        .unwrap()
        .into_iter()
        .find(|e| e.orig.proto == IPPROTO_UDP && e.orig.src == client && e.orig.sport == sport)
}

/// Which backend answered a UDP request from the client's `sport`.
fn ask(sb: &Sandbox, sport: u16, dst: SocketAddr) -> usize {
    let a = udp_request_from(sb.client(), sport, dst, T)
        .unwrap_or_else(|e| panic!("UDP from :{sport} to {dst}: {e}"));
    parse_answer(&a).unwrap().0
}

/// The first source port in `ports` whose flow to echo lands on a backend `want` accepts.
fn flow_to(
    sb: &Sandbox,
    ports: std::ops::Range<u16>,
    want: impl Fn(usize) -> bool,
) -> (u16, usize) {
    for p in ports.clone() {
        let pod = ask(sb, p, addr(ECHO, 53));
        if want(pod) {
            return (p, pod);
        }
    }
    panic!("no flow from ports {ports:?} landed on a wanted backend");
}

/// The engine and the model, committing as the agent does (a full sync each time: these tables are small).
struct Proxy {
    engine: SyncEngine<NftSocket>,
    state: ClusterState,
    cfg: RenderConfig,
    commits: usize,
    events: Events,
}

impl Proxy {
    fn commit(&mut self, sb: &Sandbox, queue: &mut CleanupQueue) {
        let changes = self.state.take_changes();
        let pieces = render::all_pieces(
            self.state.service_map(),
            &self.state.endpoints_map(),
            &self.cfg,
        );
        self.engine
            .sync_full(render::skeleton(&self.cfg), pieces)
            .expect("commit");
        self.commits += 1;
        self.events.push(format!("commit {}", self.commits));
        queue.after_sync(&changes, &self.state);
        assert_listable(sb.node());
    }
}

#[test]
fn a_slow_walk_delays_no_commit_and_the_worker_deletes_the_stale_udp_entry() {
    let sb = sandbox("ct-wk", 3);
    let events = Events::default();
    let (permit, gate) = mpsc::channel();
    let ev = events.clone();
    // The engine's socket and the queue's worker thread belong to the node namespace from here on.
    let (engine, mut queue) = sb
        .node()
        .run(move || {
            let cleaner = Cleaner::with_options(CleanerOptions {
                kinds: FrontendKinds::ALL,
                ..Default::default()
            });
            let metrics = cleaner.metrics();
            let (planner, walker) = cleaner.into_parts();
            let gated = Gated {
                inner: walker,
                events: ev,
                gate,
                walks: 0,
            };
            (
                SyncEngine::new(NftSocket::open().unwrap()),
                CleanupQueue::start_with(planner, gated, metrics).unwrap(),
            )
        })
        .unwrap();
    let mut proxy = Proxy {
        engine,
        state: ClusterState::new(),
        cfg: RenderConfig {
            cluster_cidrs: vec![sandbox::CLUSTER_CIDR_V4.parse().unwrap()],
            ..RenderConfig::default()
        },
        commits: 0,
        events: events.clone(),
    };

    // Commit 1: echo on pods 1-3; its walk (the startup's) is let go at once.
    proxy.state.apply_service(
        NamespacedName::new("demo", "echo"),
        udp_service("echo", ECHO),
    );
    proxy.state.apply_slice(slice("echo", &[1, 2, 3]));
    proxy.commit(&sb, &mut queue);
    events.wait("walk 1 started");
    permit.send(()).unwrap();
    assert!(queue.wait_idle(WAIT), "walk 1 never finished");

    // A client flow on the endpoint about to go, and one on a survivor.
    let (sport, victim) = flow_to(&sb, 45000..45010, |_| true);
    let (other_port, survivor) = flow_to(&sb, 45010..45100, |p| p != victim);
    let stale = udp_flow(&sb, sport).expect("the client's flow has an entry");
    assert_eq!(
        (stale.reply.src, stale.reply.sport),
        (pod_udp(victim).ip(), BACKEND_UDP_PORT)
    );
    assert!(stale.timeout >= 20, "{stale:?}");
    let kept = udp_flow(&sb, other_port).unwrap();

    // Commit 2 removes the victim; its walk starts and is held.
    let rest: Vec<usize> = (1..=3).filter(|p| *p != victim).collect();
    proxy.state.apply_slice(slice("echo", &rest));
    proxy.commit(&sb, &mut queue);
    events.wait("walk 2 started");
    // The stale entry is still there: nothing but the held walk would delete it.
    assert_eq!(
        udp_flow(&sb, sport).map(|e| (e.orig, e.reply, e.id)),
        Some((stale.orig, stale.reply, stale.id)),
        "the entry went before the worker's walk"
    );

    // Commit 3, a new service, commits while walk 2 is in progress, and carries traffic.
    proxy.state.apply_service(
        NamespacedName::new("demo", "late"),
        udp_service("late", LATE),
    );
    proxy.state.apply_slice(slice("late", &[survivor]));
    proxy.commit(&sb, &mut queue);
    assert_eq!(ask(&sb, 46000, addr(LATE, 53)), survivor);
    assert_eq!(
        events.all(),
        [
            "commit 1",
            "walk 1 started",
            "walk 1 ended",
            "commit 2",
            "walk 2 started",
            "commit 3"
        ],
        "commit 3 must not wait for walk 2"
    );

    // Walk 2 goes, then walk 3 (the new service's) after it.
    permit.send(()).unwrap();
    events.wait("walk 3 started");
    permit.send(()).unwrap();
    assert!(queue.wait_idle(WAIT), "walks never finished");
    let order = events.all();
    println!("{order:?}");
    assert_eq!(
        order[5..],
        ["commit 3", "walk 2 ended", "walk 3 started", "walk 3 ended"],
        "walks in commit order, one at a time"
    );

    // The stale entry is gone, the survivor's flow untouched, and the client's next datagram moves.
    assert_eq!(
        udp_flow(&sb, sport),
        None,
        "the worker left the stale entry"
    );
    assert_eq!(
        udp_flow(&sb, other_port).map(|e| (e.orig, e.reply, e.id)),
        Some((kept.orig, kept.reply, kept.id)),
        "a flow on a surviving endpoint was touched"
    );
    assert_ne!(ask(&sb, sport, addr(ECHO, 53)), victim);
    assert_eq!(ask(&sb, other_port, addr(ECHO, 53)), survivor);
    let m = queue.metrics().snapshot();
    assert!(m.entries_deleted >= 1, "{m:?}");
    assert_eq!(m.cleanup_failures, 0, "{m:?}");
    queue.stop();
}
