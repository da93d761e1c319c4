//! The TCP side of the relay: a listener per service port, a task per connection that dials an endpoint
//! (retrying the next one with growing timeouts) and splices bytes both ways, half-close included.

use super::idle::Activity;
use super::service::{Service, Stats};
use super::splice::{pump, reset_on_close};
use futures::future;
use nftkube_metrics::RelayRefusal;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// Kube-proxy userspace's dial timeouts: each failed attempt resets affinity and tries the next endpoint.
pub const DIAL_TIMEOUTS: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

const FD_BACKOFF_MIN: Duration = Duration::from_millis(50);
const FD_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Out of file descriptors, for the process (EMFILE) or the system (ENFILE).
pub(crate) fn fd_exhausted(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Out of kernel memory for sockets: as passing as a descriptor shortage, and handled alike.
fn memory_short(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::ENOMEM))
}

/// Accepts connections until the task is aborted, always: a connection is admitted after `accept()`, and one
/// over a limit is reset at once (the client learns right away instead of waiting in a backlog that would
/// also hold clients of other limits). Without file descriptors it backs off, logs, and tries again.
pub(crate) async fn serve(listener: TcpListener, svc: Arc<Service>) {
    let mut backoff = FD_BACKOFF_MIN;
    loop {
        match listener.accept().await {
            Ok((client, peer)) => {
                backoff = FD_BACKOFF_MIN;
                admit(client, peer, &svc);
            }
            Err(e) if fd_exhausted(&e) || memory_short(&e) => {
                if fd_exhausted(&e) {
                    Stats::bump(&svc.limits.stats.fd_exhausted);
                }
                if backoff == FD_BACKOFF_MIN {
                    tracing::warn!(service = %svc.name, error = %e, "out of file descriptors or socket memory accepting connections: backing off (up to 1 s between tries) until some close");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(FD_BACKOFF_MAX);
            }
            // A client that reset before we accepted it, and the like: nothing to do with the next one.
            Err(e) => tracing::debug!(service = %svc.name, error = %e, "accept failed"),
        }
    }
}

/// Relays an accepted connection on a task of its own if a limit lets it in; resets it otherwise.
fn admit(client: TcpStream, peer: SocketAddr, svc: &Arc<Service>) {
    match svc.admit(peer.ip()) {
        Ok(admission) => {
            Stats::bump(&svc.limits.stats.accepted);
            let svc = svc.clone();
            tokio::spawn(async move {
                relay_connection(client, peer, &svc).await;
                drop(admission);
            });
        }
        Err(refusal) => {
            tracing::debug!(service = %svc.name, %peer, reason = refusal.reason(), "connection refused: reset");
            reset_on_close(&client);
        }
    }
}

/// One client connection, start to end.
async fn relay_connection(client: TcpStream, peer: SocketAddr, svc: &Arc<Service>) {
    let _live = svc.opened();
    let Some((upstream, endpoint)) = dial(svc, peer).await else {
        // No endpoint could be reached: the client sees a reset, as it would from a closed port.
        reset_on_close(&client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (_registration, removed) = svc.register(endpoint);
    let activity = Activity::new();
    let outcome = tokio::select! {
        r = future::try_join(pump(&client, &upstream, &activity, |n| svc.moved(true, n)), pump(&upstream, &client, &activity, |n| svc.moved(false, n))) => match r {
            Ok(_) => Ok(()), // both sides sent FIN: close normally
            Err(e) => Err(format!("connection broken: {e}")),
        },
        _ = removed => Err("endpoint removed".to_string()),
        () = activity.idle_for(svc.limits.tcp_idle_timeout) => {
            Stats::bump(&svc.limits.stats.closed_idle);
            Err("idle timeout".to_string())
        }
    };
    if let Err(why) = outcome {
        tracing::debug!(service = %svc.name, %peer, %endpoint, "{why}: resetting both sides");
        reset_on_close(&client);
        reset_on_close(&upstream);
    }
}

/// Dials an endpoint for `peer`: up to one attempt per timeout in [`DIAL_TIMEOUTS`], each after a failure
/// resetting the client's affinity so that the next endpoint is tried.
async fn dial(svc: &Service, peer: SocketAddr) -> Option<(TcpStream, SocketAddr)> {
    let mut reset = false;
    for timeout in &svc.limits.dial_timeouts {
        let Some(endpoint) = svc.pick(peer.ip(), reset) else {
            tracing::debug!(service = %svc.name, %peer, "no endpoint: refusing the connection");
            svc.refused(RelayRefusal::NoEndpoint);
            return None;
        };
        match tokio::time::timeout(*timeout, TcpStream::connect(endpoint)).await {
            Ok(Ok(s)) => return Some((s, endpoint)),
            Ok(Err(e)) if fd_exhausted(&e) => {
                Stats::bump(&svc.limits.stats.fd_exhausted);
                tracing::warn!(service = %svc.name, %peer, error = %e, "out of file descriptors dialing an endpoint: dropping the connection");
                return None;
            }
            Ok(Err(e)) => {
                tracing::debug!(service = %svc.name, %endpoint, error = %e, "dial failed, trying the next endpoint")
            }
            Err(_) => {
                tracing::debug!(service = %svc.name, %endpoint, timeout_ms = timeout.as_millis() as u64, "dial timed out, trying the next endpoint")
            }
        }
        svc.limits
            .stats
            .dial_failures
            .fetch_add(1, Ordering::Relaxed);
        reset = true;
    }
    tracing::warn!(service = %svc.name, %peer, "no endpoint answered after {} attempts", svc.limits.dial_timeouts.len());
    svc.refused(RelayRefusal::DialFailed);
    None
}
