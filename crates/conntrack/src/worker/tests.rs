//! The queue with a fake walker: ordering, merging of waiting walks, retries, shutdown.

use super::*;
use crate::options::CleanerOptions;
use crate::wire::{Entry, Tuple, ZoneScope, IPPROTO_UDP};
use crate::FrontendKinds;
use nftkube_model::NodePortAddresses;
use nftkube_model::{
    IpFamily, NamespacedName, Protocol, ServicePort, ServicePortName, SliceEndpoint, SliceInfo,
    SlicePort,
};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

const T: Duration = Duration::from_secs(10);

/// What the fake walker was asked to do, in order.
#[derive(Debug, Clone)]
enum Seen {
    /// The filter, and what `still_stale` said of each probe once the walk was let go.
    Clean(StaleFilter, Vec<bool>),
    BlackHoles(Frontends),
}

/// Records each walk; with a gate, each walk first says it started and then waits for a permit; fails the
/// walks whose number (1-based) is in `fail`.
struct Fake {
    seen: Arc<Mutex<Vec<Seen>>>,
    started: mpsc::Sender<usize>,
    gate: Option<mpsc::Receiver<()>>,
    fail: Vec<usize>,
    /// Entries `still_stale` is asked about.
    probes: Vec<Entry>,
    busy: Arc<AtomicBool>,
    /// Disconnected when the fake is dropped, i.e. when the worker thread ends.
    _alive: mpsc::Sender<()>,
}

impl Fake {
    fn walk(
        &mut self,
        what: Seen,
        still_stale: &dyn Fn(&Entry) -> bool,
    ) -> Result<CleanupReport, CleanupError> {
        assert!(!self.busy.swap(true, Ordering::SeqCst), "two walks at once");
        let n = {
            let mut seen = self.seen.lock().unwrap();
            seen.push(what);
            seen.len()
        };
        let _ = self.started.send(n);
        if let Some(gate) = &self.gate {
            gate.recv_timeout(T)
                .expect("the test never let the walk go");
        }
        if let Seen::Clean(_, answers) = &mut self.seen.lock().unwrap()[n - 1] {
            *answers = self.probes.iter().map(still_stale).collect();
        }
        self.busy.store(false, Ordering::SeqCst);
        if self.fail.contains(&n) {
            return Err(CleanupError::Open(std::io::Error::other("injected")));
        }
        Ok(CleanupReport::default())
    }
}

impl Walk for Fake {
    fn cleanup(
        &mut self,
        filter: &StaleFilter,
        still_stale: &dyn Fn(&Entry) -> bool,
    ) -> Result<CleanupReport, CleanupError> {
        self.walk(Seen::Clean(filter.clone(), Vec::new()), still_stale)
    }
    fn clear_black_holes(&mut self, frontends: &Frontends) -> Result<CleanupReport, CleanupError> {
        self.walk(Seen::BlackHoles(frontends.clone()), &|_| true)
    }
}

struct Harness {
    queue: CleanupQueue,
    seen: Arc<Mutex<Vec<Seen>>>,
    started: mpsc::Receiver<usize>,
    permits: mpsc::Sender<()>,
    alive: mpsc::Receiver<()>,
    state: ClusterState,
}

impl Harness {
    fn new(gated: bool, fail: &[usize]) -> Harness {
        Harness::with_probes(gated, fail, Vec::new())
    }

    fn with_probes(gated: bool, fail: &[usize], probes: Vec<Entry>) -> Harness {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (started_tx, started) = mpsc::channel();
        let (permits, gate) = mpsc::channel();
        let (alive_tx, alive) = mpsc::channel();
        let fake = Fake {
            seen: seen.clone(),
            started: started_tx,
            gate: gated.then_some(gate),
            fail: fail.to_vec(),
            probes,
            busy: Arc::new(AtomicBool::new(false)),
            _alive: alive_tx,
        };
        let planner = Planner::new(&CleanerOptions::default());
        let queue = CleanupQueue::start_with(planner, fake, Arc::default()).unwrap();
        Harness {
            queue,
            seen,
            started,
            permits,
            alive,
            state: ClusterState::new(),
        }
    }

    /// A commit of whatever changed in the state since the last one.
    fn commit(&mut self) {
        let changes = self.state.take_changes();
        self.queue.after_sync(&changes, &self.state);
    }

    fn wait_started(&self, n: usize) {
        assert_eq!(
            self.started.recv_timeout(T),
            Ok(n),
            "walk {n} never started"
        );
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn clean(&self, i: usize) -> StaleFilter {
        match &self.seen()[i] {
            Seen::Clean(f, _) => f.clone(),
            other => panic!("walk {i} was {other:?}"),
        }
    }
}

fn key(name: &str) -> NamespacedName {
    NamespacedName::new("ns", name)
}

fn udp_port(svc: &str, ip: &str) -> Vec<ServicePort> {
    let spn = ServicePortName {
        service: key(svc),
        port: "udp".into(),
        protocol: Protocol::Udp,
    };
    vec![ServicePort::cluster_ip(spn, vec![ip.parse().unwrap()], 53)]
}

fn slice(svc: &str, endpoints: &[&str]) -> SliceInfo {
    SliceInfo {
        namespace: "ns".into(),
        name: format!("{svc}-a").into(),
        service: svc.into(),
        address_type: IpFamily::V4,
        ports: vec![SlicePort {
            name: "udp".into(),
            port: 5353,
            protocol: Protocol::Udp,
        }],
        endpoints: endpoints
            .iter()
            .map(|ip| SliceEndpoint::new(ip.parse().unwrap(), true, true, false))
            .collect(),
    }
}

/// A UDP flow from a client to `vip`:53 answered by `reply_src` (an endpoint, or the VIP for a black hole).
fn flow(vip: &str, reply_src: &str) -> Entry {
    let (c, r): (SocketAddr, SocketAddr) = (
        "10.244.0.2:40000".parse().unwrap(),
        reply_src.parse().unwrap(),
    );
    Entry {
        orig: Tuple::new(c.ip(), c.port(), vip.parse().unwrap(), 53, IPPROTO_UDP),
        reply: Tuple::new(r.ip(), r.port(), c.ip(), c.port(), IPPROTO_UDP),
        zone: ZoneScope::None,
        id: None,
        mark: 0,
        status: 0,
        timeout: 30,
    }
}

const ECHO: &str = "10.96.0.10";
const OTHER: &str = "10.96.0.11";

/// echo (A, B) and other (C) are programmed; their first walk has run.
fn two_services(h: &mut Harness) {
    h.state.apply_service(key("echo"), udp_port("echo", ECHO));
    h.state
        .apply_slice(slice("echo", &["10.244.1.2", "10.244.2.2"]));
    h.state
        .apply_service(key("other"), udp_port("other", OTHER));
    h.state.apply_slice(slice("other", &["10.244.3.2"]));
    h.commit();
    h.wait_started(1);
}

#[test]
fn walks_run_one_at_a_time_in_commit_order_and_a_waiting_walk_takes_later_targets() {
    let mut h = Harness::new(true, &[]);
    two_services(&mut h);
    // Walk 1 is blocked in the kernel. Commit 2 removes B from echo: its walk waits.
    h.state.apply_slice(slice("echo", &["10.244.1.2"]));
    h.commit();
    // Commit 3 replaces C by D in other: it joins the waiting walk, judged against commit 3's endpoints.
    h.state.apply_slice(slice("other", &["10.244.4.2"]));
    h.commit();
    // A repair after commit 3, then commit 4 deletes echo: after the black holes, in that order.
    let frontends = Frontends::of(
        &h.state,
        FrontendKinds::CLUSTER_IP_ONLY,
        &NodePortAddresses::None,
        &[],
    );
    h.queue.clear_black_holes(frontends.clone());
    h.state.delete_service(&key("echo"));
    h.commit();
    assert_eq!(h.seen().len(), 1, "the proxy loop waited for nothing");

    for n in 2..=4 {
        h.permits.send(()).unwrap();
        h.wait_started(n);
    }
    h.permits.send(()).unwrap();
    assert!(h.queue.wait_idle(T));
    let seen = h.seen();
    assert_eq!(seen.len(), 4, "{seen:#?}");

    // Walk 1: the first snapshot, flows to no serving endpoint.
    let first = h.clean(0);
    assert!(first.is_stale(&flow(ECHO, "10.96.0.10:53")));
    assert!(!first.is_stale(&flow(ECHO, "10.244.2.2:5353")));
    // Walk 2: commits 2 and 3 in one walk.
    let merged = h.clean(1);
    assert!(
        merged.is_stale(&flow(ECHO, "10.244.2.2:5353")),
        "commit 2's target"
    );
    assert!(!merged.is_stale(&flow(ECHO, "10.244.1.2:5353")));
    assert!(
        merged.is_stale(&flow(OTHER, "10.244.3.2:5353")),
        "commit 3's target"
    );
    assert!(!merged.is_stale(&flow(OTHER, "10.244.4.2:5353")));
    // Walk 3: the black holes; walk 4: every flow to the deleted service's address.
    assert!(matches!(&seen[2], Seen::BlackHoles(f) if *f == frontends));
    let deleted = h.clean(3);
    assert!(deleted.is_stale(&flow(ECHO, "10.244.1.2:5353")));
    assert!(!deleted.is_stale(&flow(OTHER, "10.244.4.2:5353")));
    h.queue.stop();
}

#[test]
fn a_walk_in_progress_spares_what_a_later_commit_made_healthy() {
    let b = flow(ECHO, "10.244.2.2:5353");
    let gone = flow(ECHO, "10.244.9.9:5353");
    let mut h = Harness::with_probes(true, &[], vec![b.clone(), gone.clone()]);
    two_services(&mut h);
    h.permits.send(()).unwrap();
    // Walk 2 (B removed from echo) is in progress when commit 3 adds B back.
    h.state.apply_slice(slice("echo", &["10.244.1.2"]));
    h.commit();
    h.wait_started(2);
    h.state
        .apply_slice(slice("echo", &["10.244.1.2", "10.244.2.2"]));
    h.commit();
    h.permits.send(()).unwrap();
    assert!(h.queue.wait_idle(T));
    let seen = h.seen();
    let Seen::Clean(filter, answers) = &seen[1] else {
        panic!("{seen:?}")
    };
    assert!(filter.is_stale(&b), "stale as planned at commit 2");
    assert_eq!(
        answers,
        &[false, true],
        "B's flow is healthy again at commit 3; a flow to no endpoint is still stale"
    );
    h.queue.stop();
}

#[test]
fn a_later_commit_changes_the_verdicts_of_what_it_touched_only() {
    let to_reused_ip = flow(ECHO, "10.244.1.2:5353");
    let to_removed_c = flow(OTHER, "10.244.3.2:5353");
    let mut h = Harness::with_probes(true, &[], vec![to_reused_ip.clone(), to_removed_c.clone()]);
    two_services(&mut h);
    h.permits.send(()).unwrap();
    // Walk 2: echo deleted (every flow to its address), C removed from other.
    h.state.delete_service(&key("echo"));
    h.state.apply_slice(slice("other", &["10.244.4.2"]));
    h.commit();
    h.wait_started(2);
    // Commit 3, while walk 2 runs: a new service takes echo's address; other is left alone.
    h.state.apply_service(key("again"), udp_port("again", ECHO));
    h.state.apply_slice(slice("again", &["10.244.1.2"]));
    h.commit();
    h.permits.send(()).unwrap();
    h.wait_started(3);
    h.permits.send(()).unwrap();
    assert!(h.queue.wait_idle(T));
    let seen = h.seen();
    let Seen::Clean(filter, answers) = &seen[1] else {
        panic!("{seen:?}")
    };
    assert!(filter.is_stale(&to_reused_ip) && filter.is_stale(&to_removed_c));
    assert_eq!(
        answers,
        &[false, true],
        "the address is in use again (its new service's walk judges it next); other was not touched"
    );
    h.queue.stop();
}

#[test]
fn a_failed_walk_is_retried_after_the_next_commit_against_the_endpoints_of_then() {
    let mut h = Harness::new(false, &[2]);
    two_services(&mut h);
    assert!(h.queue.wait_idle(T));
    // Walk 2 (B removed from echo) fails.
    h.state.apply_slice(slice("echo", &["10.244.1.2"]));
    h.commit();
    h.wait_started(2);
    assert!(h.queue.wait_idle(T));
    // Commit 3 adds E to echo: no reason to look by itself, but the failed targets come back with it.
    h.state
        .apply_slice(slice("echo", &["10.244.1.2", "10.244.5.2"]));
    h.commit();
    h.wait_started(3);
    assert!(h.queue.wait_idle(T));
    let retry = h.clean(2);
    assert!(retry.is_stale(&flow(ECHO, "10.244.2.2:5353")));
    assert!(
        !retry.is_stale(&flow(ECHO, "10.244.5.2:5353")),
        "judged against the endpoints of the retry's commit"
    );
    // Retried once: the next commit with nothing to look at walks nothing.
    h.commit();
    assert!(h.queue.wait_idle(T));
    assert_eq!(h.seen().len(), 3);
    h.queue.stop();
}

#[test]
fn changes_of_a_failed_sync_are_cleaned_after_the_next_commit() {
    let mut h = Harness::new(false, &[]);
    two_services(&mut h);
    h.state.apply_slice(slice("echo", &["10.244.1.2"]));
    let failed = h.state.take_changes();
    h.queue.sync_failed(&failed);
    h.commit();
    h.wait_started(2);
    assert!(h.queue.wait_idle(T));
    assert!(h.clean(1).is_stale(&flow(ECHO, "10.244.2.2:5353")));
    h.queue.stop();
}

#[test]
fn stop_finishes_the_queue() {
    let mut h = Harness::new(false, &[]);
    two_services(&mut h);
    h.state.delete_service(&key("echo"));
    h.commit();
    h.queue.stop();
    assert_eq!(h.seen.lock().unwrap().len(), 2);
    assert_eq!(
        h.alive.recv_timeout(T),
        Err(mpsc::RecvTimeoutError::Disconnected)
    );
}

#[test]
fn stop_gives_up_on_queued_walks_at_its_deadline() {
    let mut h = Harness::new(true, &[]);
    two_services(&mut h);
    h.state.delete_service(&key("echo"));
    h.commit();
    let start = Instant::now();
    h.queue.stop_within(Duration::from_millis(200));
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < T,
        "{waited:?}"
    );
    // The walk in progress ends; the queued one never starts.
    h.permits.send(()).unwrap();
    assert_eq!(
        h.alive.recv_timeout(T),
        Err(mpsc::RecvTimeoutError::Disconnected)
    );
    assert_eq!(h.seen.lock().unwrap().len(), 1);
}
