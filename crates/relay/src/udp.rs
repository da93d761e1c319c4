//! The UDP side of the relay: a flow per client address, each with a socket connected to the endpoint chosen
//! for it, an idle timeout, and replies sent from the address the client's datagrams reached.
//!
//! Datagrams are relayed whole, up to the protocol's 64 KiB: the listener reads into one 64 KiB buffer, and a
//! reply is read into a buffer of exactly its length. After an endpoint change new clients are balanced over
//! the new endpoints; a live flow keeps its endpoint until it idles out, unless that endpoint was removed.

use super::capacity::Admission;
use super::service::{LiveCount, Registration, Service, Stats};
use super::socket::{next_datagram_len, recv_with_destination, send_from, udp_connected};
use super::tcp::fd_exhausted;
use futures::future::{self, Either};
use nftkube_metrics::RelayRefusal;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::Interest;
use tokio::net::UdpSocket;

/// Largest UDP payload (IPv6 jumbograms aside): what one read must hold so no datagram arrives cut.
pub(crate) const MAX_DATAGRAM: usize = 65_536;

struct Flow {
    upstream: UdpSocket,
    endpoint: SocketAddr,
    /// Milliseconds since the listener's epoch at the last datagram either way.
    last_active_ms: AtomicU64,
    /// The service generation at which `endpoint` was last known to be one of its endpoints.
    checked: AtomicU64,
}

/// Flows of one listener by client address. A flow leaves it only under its lock, after a last check (still
/// idle, still the same flow), so a datagram never goes to a flow that is closing.
type Flows = Arc<Mutex<HashMap<SocketAddr, Arc<Flow>>>>;

fn lock(flows: &Flows) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Arc<Flow>>> {
    flows.lock().unwrap_or_else(|e| e.into_inner())
}

/// Relays datagrams until the task is aborted.
pub(crate) async fn serve(listener: UdpSocket, svc: Arc<Service>, idle_timeout: Duration) {
    let listener = Arc::new(listener);
    let flows: Flows = Arc::default();
    let epoch = Instant::now();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        if listener.readable().await.is_err() {
            return;
        }
        let fd = listener.as_raw_fd();
        let (n, client, local) =
            match listener.try_io(Interest::READABLE, || recv_with_destination(fd, &mut buf)) {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => {
                    tracing::debug!(service = %svc.name, error = %e, "udp receive failed");
                    continue;
                }
            };
        let existing = live_flow(&flows, &svc, client, epoch);
        let flow = match existing {
            Some(f) => f,
            None => match open_flow(&svc, client, local, &listener, &flows, idle_timeout, epoch) {
                Some(f) => f,
                None => continue, // no endpoint or no descriptor: the datagram is dropped, as the network may
            },
        };
        // Straight to the socket: tokio's try_send would refuse until the new socket was first seen writable.
        match send_from(flow.upstream.as_raw_fd(), &buf[..n], None, None) {
            Ok(_) => svc.moved(true, n),
            Err(e) => {
                tracing::debug!(service = %svc.name, %client, error = %e, "udp send to the endpoint failed; datagram dropped")
            }
        }
    }
}

/// The client's flow, marked active, unless there is none or its endpoint left the service (then it is
/// forgotten here, and its task ends on its own).
fn live_flow(
    flows: &Flows,
    svc: &Service,
    client: SocketAddr,
    epoch: Instant,
) -> Option<Arc<Flow>> {
    let mut map = lock(flows);
    let flow = map.get(&client)?;
    if !svc.still_serves(flow.endpoint, &flow.checked) {
        map.remove(&client);
        return None;
    }
    flow.last_active_ms
        .store(elapsed_ms(epoch), Ordering::Relaxed);
    Some(flow.clone())
}

fn elapsed_ms(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64
}

/// A new flow for `client`: an endpoint, a connected socket to it, and the task that carries replies back.
fn open_flow(
    svc: &Arc<Service>,
    client: SocketAddr,
    local: Option<IpAddr>,
    listener: &Arc<UdpSocket>,
    flows: &Flows,
    idle_timeout: Duration,
    epoch: Instant,
) -> Option<Arc<Flow>> {
    let admission = match svc.admit(client.ip()) {
        Ok(a) => a,
        Err(refusal) => {
            tracing::debug!(service = %svc.name, %client, reason = refusal.reason(), "udp flow refused: datagram dropped");
            return None;
        }
    };
    // Read before the pick: an update between the two makes the flow check its endpoint again.
    let generation = svc.generation();
    let Some(endpoint) = svc.pick(client.ip(), false) else {
        svc.refused(RelayRefusal::NoEndpoint);
        return None;
    };
    let upstream = match udp_connected(endpoint).and_then(UdpSocket::from_std) {
        Ok(s) => s,
        Err(e) => {
            if fd_exhausted(&e) {
                Stats::bump(&svc.limits.stats.fd_exhausted);
                tracing::warn!(service = %svc.name, %client, error = %e, "out of file descriptors opening a udp flow: datagram dropped");
            } else {
                tracing::debug!(service = %svc.name, %endpoint, error = %e, "opening a udp flow failed");
            }
            return None;
        }
    };
    let flow = Arc::new(Flow {
        upstream,
        endpoint,
        last_active_ms: AtomicU64::new(elapsed_ms(epoch)),
        checked: AtomicU64::new(generation),
    });
    lock(flows).insert(client, flow.clone());
    let (registration, removed) = svc.register(endpoint);
    let live = svc.opened();
    let replies = Replies {
        svc: svc.clone(),
        flow: flow.clone(),
        flows: flows.clone(),
        listener: listener.clone(),
        client,
        local,
        idle_timeout,
        epoch,
    };
    tokio::spawn(async move {
        let _hold: (Registration, Admission, LiveCount) = (registration, admission, live);
        let carry = std::pin::pin!(replies.carry());
        if let Either::Right(_) = future::select(carry, removed).await {
            tracing::debug!(%client, %endpoint, "endpoint removed: udp flow closed");
        }
    });
    Some(flow)
}

/// Carries one flow's replies back to its client.
struct Replies {
    svc: Arc<Service>,
    flow: Arc<Flow>,
    flows: Flows,
    listener: Arc<UdpSocket>,
    client: SocketAddr,
    local: Option<IpAddr>,
    idle_timeout: Duration,
    epoch: Instant,
}

impl Replies {
    /// Returns when the flow has been idle (no datagram either way) for the idle timeout; it has then left
    /// the flow table.
    async fn carry(self) {
        loop {
            let Some(left) = self.idle_left() else {
                if self.leave_if_idle() {
                    return;
                }
                continue;
            };
            match tokio::time::timeout(left, self.flow.upstream.readable()).await {
                Err(_) => continue, // re-check: the client side may have been active meanwhile
                Ok(Err(_)) => return,
                Ok(Ok(())) => self.forward_one(),
            }
        }
    }

    /// Time until the flow is idle, None once it is.
    fn idle_left(&self) -> Option<Duration> {
        let idle_for = Duration::from_millis(
            elapsed_ms(self.epoch).saturating_sub(self.flow.last_active_ms.load(Ordering::Relaxed)),
        );
        self.idle_timeout
            .checked_sub(idle_for)
            .filter(|d| !d.is_zero())
    }

    /// Under the table's lock (where the listener marks flows active): removes the flow if it is still idle.
    fn leave_if_idle(&self) -> bool {
        let mut map = lock(&self.flows);
        if self.idle_left().is_some() {
            return false;
        }
        self.remove_from(&mut map);
        true
    }

    /// Removes this flow from the table, unless the client already has another one.
    fn remove_from(&self, map: &mut HashMap<SocketAddr, Arc<Flow>>) {
        if map
            .get(&self.client)
            .is_some_and(|f| Arc::ptr_eq(f, &self.flow))
        {
            map.remove(&self.client);
        }
    }

    /// Reads one reply (into a buffer of exactly its size) and sends it to the client.
    fn forward_one(&self) {
        let up = &self.flow.upstream;
        let fd = up.as_raw_fd();
        let read = up
            .try_io(Interest::READABLE, || next_datagram_len(fd))
            .and_then(|len| {
                let mut data = vec![0u8; len];
                let n = up.try_recv(&mut data)?;
                data.truncate(n);
                Ok(data)
            });
        match read {
            Ok(data) => {
                self.flow
                    .last_active_ms
                    .store(elapsed_ms(self.epoch), Ordering::Relaxed);
                let sent = send_from(
                    self.listener.as_raw_fd(),
                    &data,
                    Some(self.client),
                    self.local,
                );
                match sent {
                    Ok(_) => self.svc.moved(false, data.len()),
                    Err(e) => {
                        tracing::debug!(client = %self.client, error = %e, "udp reply dropped")
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // An ICMP error from the endpoint (port unreachable): the client's next datagram may find it up.
            Err(e) => {
                tracing::debug!(client = %self.client, error = %e, "udp receive from the endpoint failed")
            }
        }
    }
}

impl Drop for Replies {
    /// However the flow ends (idle, its endpoint removed, the listener closed), it leaves the table.
    fn drop(&mut self) {
        self.remove_from(&mut lock(&self.flows));
    }
}
