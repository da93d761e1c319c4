//! The userspace relay: TCP and UDP listeners that forward each connection (or UDP flow) to an endpoint of
//! their service, chosen round robin with ClientIP affinity. It serves NodePorts on loopback, which nf_tables
//! DNAT cannot, and the userspace proxy mode.
//!
//! A [`Relay`] runs on a tokio runtime of its own (its worker threads are created in the namespace of the
//! thread that starts it, and every socket is opened by them). [`Relay::apply`] takes the whole desired set of
//! [`Frontend`]s after each sync: new listeners are opened, gone ones closed, and endpoint changes applied in
//! place without touching connections to endpoints that remain.

mod balancer;
mod capacity;
mod frontends;
mod idle;
mod localhost;
mod service;
mod socket;
mod splice;
mod tcp;
mod udp;
mod userspace;

pub use balancer::Balancer;
pub use frontends::localhost_nodeports;
pub use localhost::{loopback_families, LocalhostNodePorts};
pub use service::Stats;
pub use tcp::DIAL_TIMEOUTS;
pub use userspace::UserspaceProxy;

use capacity::Capacity;
use nftkube_model::Protocol;
use service::{Limits, Service};
use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::AbortHandle;

/// The default TCP idle timeout: kube-proxy's default for established TCP connections in conntrack
/// (`--conntrack-tcp-timeout-established`), so an idle connection lives as long through the relay as through
/// the kernel's DNAT path.
pub const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// How a relay behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayOptions {
    /// Relayed TCP connections plus UDP flows at most; beyond it a new connection is reset (a new UDP
    /// flow's datagram dropped).
    pub max_connections: usize,
    /// Relayed TCP connections plus UDP flows of one service port (listener) at most, so that a flood to one
    /// service leaves room for the others.
    pub max_connections_per_service: usize,
    /// Relayed TCP connections plus UDP flows from one client address at most (loopback clients, the node
    /// itself, excepted).
    pub max_connections_per_source: usize,
    /// A UDP flow without a datagram either way for this long is closed (kube-proxy's `--udp-timeout`).
    /// ClientIP affinity outlives it: the balancer keeps the client's endpoint for the affinity timeout.
    pub udp_idle_timeout: Duration,
    /// A TCP connection that moved no byte either way for this long is closed (both sides reset).
    pub tcp_idle_timeout: Duration,
    /// One dial attempt per timeout, each to the next endpoint.
    pub dial_timeouts: Vec<Duration>,
    /// The runtime's worker threads.
    pub worker_threads: usize,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            max_connections: 10_000,
            max_connections_per_service: 5_000,
            max_connections_per_source: 1_000,
            udp_idle_timeout: Duration::from_millis(250),
            tcp_idle_timeout: TCP_IDLE_TIMEOUT,
            dial_timeouts: DIAL_TIMEOUTS.to_vec(),
            worker_threads: 2,
        }
    }
}

/// One listener the relay should have, and where its connections go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frontend {
    /// For logs: the service port ("namespace/name:port").
    pub service: String,
    /// The protocol.
    pub protocol: Protocol,
    /// Where to listen (port 0: a port the kernel picks, see [`Relay::local_addr`]).
    pub listen: SocketAddr,
    /// The endpoints connections go to.
    pub endpoints: Vec<SocketAddr>,
    /// ClientIP affinity timeout.
    pub affinity: Option<Duration>,
    /// Under externalTrafficPolicy Local: the clients the policy does not hold to `endpoints` (this
    /// node's pods and the node itself), and the endpoints they reach instead.
    pub inside: Option<Inside>,
}

/// The clients of an externalTrafficPolicy Local frontend that reach every endpoint (kube-proxy sends
/// traffic from this node's pods and from the node itself to the cluster-wide endpoints), and those
/// endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inside {
    /// The cluster-wide endpoints.
    pub endpoints: Vec<SocketAddr>,
    /// Who counts as inside.
    pub clients: Insiders,
}

/// This node's pods (by address: the cluster CIDRs of a CIDR detector) and the node itself (its addresses
/// and loopback).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Insiders {
    /// The pod ranges of `--detect-local-mode` ClusterCIDR or NodeCIDR (none with an interface detector,
    /// which a relayed connection cannot be told by).
    pub pod_cidrs: Vec<nftkube_model::Cidr>,
    /// The node's addresses.
    pub node_ips: Vec<std::net::IpAddr>,
}

impl Insiders {
    /// Whether `client` is this node or one of its pods.
    pub(crate) fn contain(&self, client: std::net::IpAddr) -> bool {
        let client = match client {
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(client, Into::into),
            v4 => v4,
        };
        client.is_loopback()
            || self.node_ips.contains(&client)
            || self.pod_cidrs.iter().any(|c| c.contains(&client))
    }
}

#[derive(Debug, thiserror::Error)]
/// Why the relay could not serve a service.
pub enum RelayError {
    #[error("starting the relay's runtime: {0}")]
    /// The relay's runtime did not start.
    Runtime(#[source] io::Error),
    #[error("{service}: cannot listen on {protocol} {listen}: {source}")]
    /// A listening socket could not be opened.
    Listen {
        /// The service.
        service: String,
        /// The protocol.
        protocol: Protocol,
        /// The address.
        listen: SocketAddr,
        #[source]
        /// The socket error.
        source: io::Error,
    },
    #[error("{service}: {protocol} {listen}: the relay carries TCP and UDP only")]
    /// The relay does not serve this protocol.
    Unsupported {
        /// The service.
        service: String,
        /// The protocol.
        protocol: Protocol,
        /// The address.
        listen: SocketAddr,
    },
}

/// A listener is identified by its service, protocol and requested address (many ask for port 0).
type Key = (String, Protocol, SocketAddr);

/// The service port a listener serves: its name less a kind's suffix (" (NodePort)", " (external)").
fn service_port_of(listener: &str) -> &str {
    listener.split(" (").next().unwrap_or(listener)
}

/// Whether a listener named `name` belongs to `service` (see [`Relay::apply_service`]).
fn owned_by(name: &str, service: &str) -> bool {
    name.strip_prefix(service)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(':') || rest.starts_with(' '))
}

struct Active {
    frontend: Frontend,
    service: Arc<Service>,
    local: SocketAddr,
    task: AbortHandle,
}

/// The running relay. Dropping it closes every listener and connection.
pub struct Relay {
    runtime: tokio::runtime::Runtime,
    /// Each listener adds to its service port's metrics (userspace mode).
    port_metrics: bool,
    limits: Arc<Limits>,
    udp_idle_timeout: Duration,
    active: BTreeMap<Key, Active>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("listeners", &self.active.len())
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Starts the runtime in the calling thread's network namespace. Raises the soft open-files limit to the
    /// hard one (each relayed connection holds two descriptors), as the agent does at start: a relay may be
    /// started without the agent (tests, benches).
    pub fn start(opts: &RelayOptions) -> Result<Relay, RelayError> {
        if let Err(e) = nftkube_process::raise_open_files_limit() {
            tracing::debug!("{e}");
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.worker_threads.max(1))
            .thread_name("relay")
            .enable_io()
            .enable_time()
            .build()
            .map_err(RelayError::Runtime)?;
        let limits = Arc::new(Limits {
            capacity: Arc::new(Capacity::new(
                opts.max_connections,
                opts.max_connections_per_service,
                opts.max_connections_per_source,
            )),
            tcp_idle_timeout: opts.tcp_idle_timeout,
            dial_timeouts: opts.dial_timeouts.clone(),
            stats: Stats::default(),
        });
        Ok(Relay {
            runtime,
            port_metrics: false,
            limits,
            udp_idle_timeout: opts.udp_idle_timeout,
            active: BTreeMap::new(),
        })
    }

    /// Listeners from now on count their connections, flows, bytes and refusals in their service port's
    /// metrics (`nftkube_userspace_relay_*`).
    pub(crate) fn with_port_metrics(mut self) -> Relay {
        self.port_metrics = true;
        self
    }

    /// Makes the listeners exactly `frontends`. A listener that cannot be opened is reported and left out;
    /// every other one is served.
    pub fn apply(&mut self, frontends: &[Frontend]) -> Vec<RelayError> {
        let scope: Vec<Key> = self.active.keys().cloned().collect();
        self.reconcile(scope, frontends)
    }

    /// Makes the listeners of one service (`namespace/name`) exactly `frontends`, leaving every other
    /// service's alone: O(its listeners), so a sync costs O(changed services). A listener belongs to the
    /// service when its name is the service's, or the service's followed by `:` (a port) or a space (a
    /// NodePort listener's suffix); Kubernetes names hold neither.
    pub fn apply_service(&mut self, service: &str, frontends: &[Frontend]) -> Vec<RelayError> {
        let from: Key = (
            service.to_owned(),
            Protocol::Tcp,
            SocketAddr::from(([0; 4], 0)),
        );
        let scope: Vec<Key> = self
            .active
            .range(from..)
            .map(|(k, _)| k)
            .take_while(|k| k.0.starts_with(service))
            .filter(|k| owned_by(&k.0, service))
            .cloned()
            .collect();
        self.reconcile(scope, frontends)
    }

    /// Closes the listeners of `scope` that `frontends` does not name, updates those it names differently,
    /// and opens the new ones.
    fn reconcile(&mut self, scope: Vec<Key>, frontends: &[Frontend]) -> Vec<RelayError> {
        let wanted: BTreeMap<Key, &Frontend> = frontends
            .iter()
            .map(|f| ((f.service.clone(), f.protocol, f.listen), f))
            .collect();
        for key in scope.into_iter().filter(|k| !wanted.contains_key(k)) {
            if let Some(a) = self.active.remove(&key) {
                a.service.update(Vec::new(), None, None);
                a.task.abort();
                self.forget_port_if_unserved(&key, &a.service);
            }
        }
        let mut errors = Vec::new();
        for (key, f) in wanted {
            match self.active.get_mut(&key) {
                Some(a) if a.frontend == *f => {}
                Some(a) => {
                    a.service
                        .update(f.endpoints.clone(), f.affinity, f.inside.clone());
                    a.frontend = f.clone();
                }
                None => match self.open(f) {
                    Ok(a) => {
                        self.active.insert(key, a);
                    }
                    Err(e) => errors.push(e),
                },
            }
        }
        errors
    }

    /// Removes a service port's series once no listener of it remains (`key`'s was the last).
    fn forget_port_if_unserved(&self, key: &Key, service: &Service) {
        let Some(m) = &service.metrics else { return };
        let port = service_port_of(&key.0);
        let served = self
            .active
            .keys()
            .any(|k| k.1 == key.1 && service_port_of(&k.0) == port);
        if !served {
            m.forget();
        }
    }

    /// Opens a listener on one of the runtime's threads (so in the relay's namespace) and starts serving it.
    fn open(&self, f: &Frontend) -> Result<Active, RelayError> {
        let metrics = self.port_metrics.then(|| {
            let protocol = f.protocol.as_str().to_ascii_uppercase();
            nftkube_metrics::RelayPortMetrics::of(service_port_of(&f.service), &protocol)
        });
        let service = Service::new(
            f.service.clone(),
            self.limits.clone(),
            f.endpoints.clone(),
            f.affinity,
            f.inside.clone(),
            metrics,
        );
        let listen_error = |source| RelayError::Listen {
            service: f.service.clone(),
            protocol: f.protocol,
            listen: f.listen,
            source,
        };
        let (protocol, listen, svc) = (f.protocol, f.listen, service.clone());
        let idle = self.udp_idle_timeout;
        let started = self.runtime.block_on(self.runtime.spawn(async move {
            match protocol {
                Protocol::Tcp => {
                    let l = tokio::net::TcpListener::from_std(socket::tcp_listener(listen)?)?;
                    let local = l.local_addr()?;
                    Ok(Some((
                        local,
                        tokio::spawn(tcp::serve(l, svc)).abort_handle(),
                    )))
                }
                Protocol::Udp => {
                    let s = tokio::net::UdpSocket::from_std(socket::udp_listener(listen)?)?;
                    let local = s.local_addr()?;
                    Ok(Some((
                        local,
                        tokio::spawn(udp::serve(s, svc, idle)).abort_handle(),
                    )))
                }
                Protocol::Sctp => Ok(None),
            }
        }));
        let started: io::Result<_> = started.unwrap_or_else(|e| Err(io::Error::other(e)));
        match started.map_err(listen_error)? {
            Some((local, task)) => {
                tracing::info!(service = %f.service, protocol = %f.protocol, %local, endpoints = f.endpoints.len(), "relay listening");
                Ok(Active {
                    frontend: f.clone(),
                    service,
                    local,
                    task,
                })
            }
            None => Err(RelayError::Unsupported {
                service: f.service.clone(),
                protocol: f.protocol,
                listen: f.listen,
            }),
        }
    }

    /// The address a frontend's listener is bound to (its port when it asked for port 0).
    pub(crate) fn local_addr(
        &self,
        service: &str,
        protocol: Protocol,
        listen: SocketAddr,
    ) -> Option<SocketAddr> {
        self.active
            .get(&(service.to_owned(), protocol, listen))
            .map(|a| a.local)
    }

    /// Listeners open.
    pub fn listeners(&self) -> usize {
        self.active.len()
    }

    /// Listeners open on addresses of IPv4 and of IPv6.
    pub(crate) fn listeners_by_family(&self) -> (usize, usize) {
        let v4 = self.active.values().filter(|a| a.local.is_ipv4()).count();
        (v4, self.active.len() - v4)
    }

    /// TCP connections and UDP flows being relayed.
    pub fn live_connections(&self) -> usize {
        self.active.values().map(|a| a.service.live_count()).sum()
    }

    /// Its counters.
    pub fn stats(&self) -> &Stats {
        &self.limits.stats
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for a in self.active.values() {
            a.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::owned_by;

    #[test]
    fn a_listener_belongs_to_its_service_and_to_no_service_whose_name_it_extends() {
        for name in [
            "ns/web",
            "ns/web:http",
            "ns/web:http (NodePort)",
            "ns/web (NodePort)",
        ] {
            assert!(owned_by(name, "ns/web"), "{name}");
        }
        for name in ["ns/web2", "ns/web2:http", "ns/we", "ns2/web:http"] {
            assert!(!owned_by(name, "ns/web"), "{name}");
        }
    }
}
