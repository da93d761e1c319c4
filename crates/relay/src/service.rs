//! What the listener of one relayed service port shares with its connections: the balancer, the live
//! connections (so an endpoint that leaves takes its connections with it) and the relay-wide limits.

use super::balancer::Balancer;
use super::capacity::{Admission, Capacity, Refusal};
use super::{Inside, Insiders};
use nftkube_metrics::{RelayPortMetrics, RelayRefusal};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Limits shared by every listener of a relay.
#[derive(Debug)]
pub(crate) struct Limits {
    /// Places for relayed TCP connections and UDP flows: in total, per service port, per client.
    pub(crate) capacity: Arc<Capacity>,
    /// A relayed TCP connection that moved no byte either way for this long is closed.
    pub(crate) tcp_idle_timeout: Duration,
    /// Dial timeouts, one per attempt (each attempt tries the next endpoint).
    pub(crate) dial_timeouts: Vec<Duration>,
    /// Counters for logs and tests.
    pub stats: Stats,
}

#[derive(Debug, Default)]
/// A relayed service's counters.
pub struct Stats {
    /// Connections (or UDP flows) accepted.
    pub accepted: AtomicU64,
    /// Connections to an endpoint that failed.
    pub dial_failures: AtomicU64,
    /// Accepts or dials that failed for want of file descriptors (EMFILE / ENFILE).
    pub(crate) fd_exhausted: AtomicU64,
    /// Connections closed because their endpoint left the service.
    pub closed_by_endpoint_removal: AtomicU64,
    /// Connections (reset) or UDP flows (datagram dropped) refused at `--relay-max-connections`.
    pub refused_total_limit: AtomicU64,
    /// Connections or flows refused at the per-service-port limit.
    pub refused_service_limit: AtomicU64,
    /// Connections or flows refused at the per-client-address limit.
    pub refused_source_limit: AtomicU64,
    /// TCP connections closed after the idle timeout.
    pub closed_idle: AtomicU64,
}

impl Stats {
    /// Adds one.
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// One relayed service port.
#[derive(Debug)]
pub(crate) struct Service {
    /// For logs: "namespace/name:port".
    pub name: String,
    pub(crate) limits: Arc<Limits>,
    balancer: Mutex<Balancer>,
    /// externalTrafficPolicy Local: the balancer of the clients the policy does not apply to.
    inside: Mutex<Option<(Insiders, Balancer)>>,
    live: Mutex<Live>,
    /// Places this service port holds under [`Limits::capacity`].
    admitted: Arc<AtomicUsize>,
    /// Bumped by every update, so a flow can tell cheaply whether its endpoint needs checking again.
    generation: AtomicU64,
    /// Its service port's series (userspace mode; None for the localhost relay).
    pub(crate) metrics: Option<RelayPortMetrics>,
}

/// A relayed connection or flow counted live in its service port's metrics until dropped.
pub(crate) struct LiveCount {
    metrics: Option<RelayPortMetrics>,
}

impl Drop for LiveCount {
    fn drop(&mut self) {
        if let Some(m) = &self.metrics {
            m.active.dec();
        }
    }
}

/// Live connections (or UDP flows): id → (endpoint, a sender whose drop tells the connection to close).
#[derive(Debug, Default)]
struct Live {
    next_id: u64,
    by_id: HashMap<u64, (SocketAddr, oneshot::Sender<()>)>,
}

/// Ends a connection's registration when dropped.
pub(crate) struct Registration {
    service: Arc<Service>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.service.live().by_id.remove(&self.id);
    }
}

fn inside_balancer(inside: Inside, affinity: Option<Duration>) -> (Insiders, Balancer) {
    let mut b = Balancer::new(affinity);
    b.set_endpoints(inside.endpoints);
    (inside.clients, b)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Service {
    pub(crate) fn new(
        name: String,
        limits: Arc<Limits>,
        endpoints: Vec<SocketAddr>,
        affinity: Option<Duration>,
        inside: Option<Inside>,
        metrics: Option<RelayPortMetrics>,
    ) -> Arc<Service> {
        let mut balancer = Balancer::new(affinity);
        balancer.set_endpoints(endpoints);
        Arc::new(Service {
            name,
            limits,
            balancer: Mutex::new(balancer),
            inside: Mutex::new(inside.map(|i| inside_balancer(i, affinity))),
            live: Mutex::new(Live::default()),
            admitted: Arc::default(),
            generation: AtomicU64::new(0),
            metrics,
        })
    }

    fn live(&self) -> MutexGuard<'_, Live> {
        lock(&self.live)
    }

    /// A place for a new connection or flow from `client`; a refusal is counted by its reason.
    pub(crate) fn admit(&self, client: IpAddr) -> Result<Admission, Refusal> {
        let admitted = self.limits.capacity.admit(&self.admitted, client);
        if let Err(refusal) = admitted {
            let stats = &self.limits.stats;
            Stats::bump(match refusal {
                Refusal::Total => &stats.refused_total_limit,
                Refusal::Service => &stats.refused_service_limit,
                Refusal::Source => &stats.refused_source_limit,
            });
            self.refused(match refusal {
                Refusal::Total => RelayRefusal::TotalLimit,
                Refusal::Service => RelayRefusal::ServiceLimit,
                Refusal::Source => RelayRefusal::SourceLimit,
            });
        }
        admitted
    }

    /// Counts a refusal in the service port's metrics.
    pub(crate) fn refused(&self, why: RelayRefusal) {
        if let Some(m) = &self.metrics {
            m.refused(why);
        }
    }

    /// Counts a connection or flow relayed from now on; it is live until the returned value drops.
    pub(crate) fn opened(&self) -> LiveCount {
        if let Some(m) = &self.metrics {
            m.connections.inc();
            m.active.inc();
        }
        LiveCount {
            metrics: self.metrics.clone(),
        }
    }

    /// Counts bytes from a client (`from_client`) or to one.
    pub(crate) fn moved(&self, from_client: bool, bytes: usize) {
        if let Some(m) = &self.metrics {
            let c = match from_client {
                true => &m.bytes_from_client,
                false => &m.bytes_to_client,
            };
            c.inc_by(bytes as u64);
        }
    }

    /// The endpoint for a new connection from `client` (see [`Balancer::pick`]): among every endpoint for
    /// this node and its pods under externalTrafficPolicy Local, else among the frontend's own.
    pub(crate) fn pick(&self, client: IpAddr, reset: bool) -> Option<SocketAddr> {
        let now = Instant::now();
        if let Some((insiders, b)) = lock(&self.inside).as_mut() {
            if insiders.contain(client) {
                return b.pick(client, reset, now);
            }
        }
        lock(&self.balancer).pick(client, reset, now)
    }

    /// Whether `endpoint` is one that some client of this listener may be relayed to.
    fn serves(&self, endpoint: &SocketAddr) -> bool {
        lock(&self.balancer).endpoints().contains(endpoint)
            || lock(&self.inside)
                .as_ref()
                .is_some_and(|(_, b)| b.endpoints().contains(endpoint))
    }

    /// New endpoints and affinity. Connections and flows to endpoints that remain are untouched; those to
    /// removed endpoints are told to close. Returns how many were.
    pub(crate) fn update(
        &self,
        endpoints: Vec<SocketAddr>,
        affinity: Option<Duration>,
        inside: Option<Inside>,
    ) -> usize {
        {
            let mut b = lock(&self.balancer);
            b.set_affinity(affinity);
            b.set_endpoints(endpoints);
            let mut kept = lock(&self.inside);
            match (kept.as_mut(), inside) {
                (Some((insiders, b)), Some(new)) => {
                    *insiders = new.clients;
                    b.set_affinity(affinity);
                    b.set_endpoints(new.endpoints);
                }
                (_, new) => *kept = new.map(|i| inside_balancer(i, affinity)),
            }
            self.generation.fetch_add(1, Ordering::Release);
        }
        let mut serving: Vec<SocketAddr> = lock(&self.balancer).endpoints().to_vec();
        if let Some((_, b)) = lock(&self.inside).as_ref() {
            serving.extend_from_slice(b.endpoints());
        }
        let mut live = self.live();
        let before = live.by_id.len();
        // Dropping the sender wakes the connection's task, which closes both sides.
        live.by_id.retain(|_, (ep, _)| serving.contains(ep));
        let closed = before - live.by_id.len();
        for _ in 0..closed {
            Stats::bump(&self.limits.stats.closed_by_endpoint_removal);
        }
        closed
    }

    /// Registers a connection to `endpoint`; the receiver completes when it must close (its endpoint left).
    /// An endpoint that left between the pick and now closes it at once.
    pub(crate) fn register(
        self: &Arc<Self>,
        endpoint: SocketAddr,
    ) -> (Registration, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let still_there = self.serves(&endpoint);
        let mut live = self.live();
        let id = live.next_id;
        live.next_id += 1;
        if still_there {
            live.by_id.insert(id, (endpoint, tx));
        } else {
            // Removed while it was being dialed: dropping `tx` closes the connection at once, and it counts
            // as closed for its endpoint's removal like the ones `update` closes.
            Stats::bump(&self.limits.stats.closed_by_endpoint_removal);
        }
        let reg = Registration {
            service: self.clone(),
            id,
        };
        (reg, rx)
    }

    /// Whether `endpoint` is still one of the service's. `checked` is the generation the caller last saw it
    /// valid at: while no update happened since, the answer needs no lock.
    pub(crate) fn still_serves(&self, endpoint: SocketAddr, checked: &AtomicU64) -> bool {
        let now = self.generation.load(Ordering::Acquire);
        if checked.load(Ordering::Relaxed) == now {
            return true;
        }
        let valid = self.serves(&endpoint);
        if valid {
            checked.store(now, Ordering::Relaxed);
        }
        valid
    }

    /// The current generation (see [`Service::still_serves`]).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Connections and flows currently relayed.
    pub(crate) fn live_count(&self) -> usize {
        self.live().by_id.len()
    }
}
