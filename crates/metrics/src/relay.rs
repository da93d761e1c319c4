//! The userspace relay's metrics: per service port in userspace mode (connections and UDP flows, those live,
//! bytes, refusals by reason), and the localhost-NodePort relay's under KEP-6032's names.
//!
//! A service port's series are labelled `service_port` ("namespace/name:port", or "namespace/name" for a single
//! unnamed port, as kube-proxy writes a service port name) and `protocol` ("TCP", "UDP"). Every listener of a
//! service port (its ClusterIPs', its external IPs', its NodePort's, in each family) adds to the same series;
//! they are removed when the port's last listener closes, so a deleted service leaves no series behind.

use super::family::{FamilyLabel, IpFamily};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::AtomicU64;
use std::sync::LazyLock;

/// `service_port`, `protocol`.
type PortLabels = [(&'static str, String); 2];
/// `service_port`, `protocol`, and one more (`direction` or `reason`).
type PortLabels3 = [(&'static str, String); 3];

pub(crate) type PortCounters = Family<PortLabels, Counter<u64, AtomicU64>>;
pub(crate) type PortGauges = Family<PortLabels, Gauge>;
pub(crate) type PortCounters3 = Family<PortLabels3, Counter<u64, AtomicU64>>;

/// Relayed TCP connections and UDP flows accepted.
pub(crate) static CONNECTIONS: LazyLock<PortCounters> = LazyLock::new(Family::default);
/// TCP connections and UDP flows being relayed.
pub(crate) static ACTIVE: LazyLock<PortGauges> = LazyLock::new(Family::default);
/// Bytes relayed, by `direction`: `from_client` (to the endpoint) or `to_client`.
pub(crate) static BYTES: LazyLock<PortCounters3> = LazyLock::new(Family::default);
/// Connections reset (UDP: first datagrams dropped) by `reason`.
pub(crate) static REFUSED: LazyLock<PortCounters3> = LazyLock::new(Family::default);

/// Why the relay refused a connection or flow (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayRefusal {
    /// `--relay-max-connections`.
    TotalLimit,
    /// `--relay-max-connections-per-service`.
    ServiceLimit,
    /// `--relay-max-connections-per-source`.
    SourceLimit,
    /// The listener has no endpoint for this client.
    NoEndpoint,
    /// No endpoint answered the dials.
    DialFailed,
}

impl RelayRefusal {
    fn label(self) -> &'static str {
        match self {
            RelayRefusal::TotalLimit => "total_limit",
            RelayRefusal::ServiceLimit => "service_limit",
            RelayRefusal::SourceLimit => "source_limit",
            RelayRefusal::NoEndpoint => "no_endpoint",
            RelayRefusal::DialFailed => "dial_failed",
        }
    }
}

/// One service port's relay metrics: handles on its series, taken once when a listener opens, so the data
/// path bumps atomics and never looks a label set up.
#[derive(Debug, Clone)]
pub struct RelayPortMetrics {
    labels: PortLabels,
    /// Connections and flows accepted.
    pub connections: Counter<u64, AtomicU64>,
    /// Connections and flows live.
    pub active: Gauge,
    /// Bytes from clients, relayed to endpoints.
    pub bytes_from_client: Counter<u64, AtomicU64>,
    /// Bytes from endpoints, relayed to clients.
    pub bytes_to_client: Counter<u64, AtomicU64>,
}

impl RelayPortMetrics {
    /// The series of `service_port` (`protocol`: "TCP" or "UDP").
    pub fn of(service_port: &str, protocol: &str) -> RelayPortMetrics {
        let labels: PortLabels = [
            ("service_port", service_port.to_owned()),
            ("protocol", protocol.to_owned()),
        ];
        let with = |key: &'static str, value: &str| -> PortLabels3 {
            let [a, b] = labels.clone();
            [a, b, (key, value.to_owned())]
        };
        // One statement each: `get_or_create` returns a read guard, and a second call on the same family
        // while the first guard lives would wait for the write lock forever.
        let connections = CONNECTIONS.get_or_create(&labels).clone();
        let active = ACTIVE.get_or_create(&labels).clone();
        let bytes_from_client = BYTES
            .get_or_create(&with("direction", "from_client"))
            .clone();
        let bytes_to_client = BYTES.get_or_create(&with("direction", "to_client")).clone();
        RelayPortMetrics {
            connections,
            active,
            bytes_from_client,
            bytes_to_client,
            labels,
        }
    }

    /// Counts a refusal (rare: the series of a reason is made when first needed).
    pub fn refused(&self, why: RelayRefusal) {
        let [a, b] = self.labels.clone();
        REFUSED
            .get_or_create(&[a, b, ("reason", why.label().to_owned())])
            .inc();
    }

    /// Removes every series of this service port (its last listener closed).
    pub fn forget(&self) {
        let [a, b] = self.labels.clone();
        CONNECTIONS.remove(&self.labels);
        ACTIVE.remove(&self.labels);
        for direction in ["from_client", "to_client"] {
            BYTES.remove(&[a.clone(), b.clone(), ("direction", direction.to_owned())]);
        }
        for why in [
            RelayRefusal::TotalLimit,
            RelayRefusal::ServiceLimit,
            RelayRefusal::SourceLimit,
            RelayRefusal::NoEndpoint,
            RelayRefusal::DialFailed,
        ] {
            REFUSED.remove(&[a.clone(), b.clone(), ("reason", why.label().to_owned())]);
        }
    }
}

/// KEP-6032's `kubeproxy_nftables_localhost_nodeport_listeners{ip_family}`: loopback NodePort listeners open.
pub(crate) static LOCALHOST_NODEPORT_LISTENERS: LazyLock<Family<FamilyLabel, Gauge>> =
    LazyLock::new(|| {
        let f: Family<FamilyLabel, Gauge> = Family::default();
        for fam in IpFamily::ALL {
            let _ = f.get_or_create(&label_of(fam));
        }
        f
    });

/// KEP-6032's `kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total{ip_family}`: loopback
/// NodePort listeners that could not be opened (the port taken by another process, and the like), each time
/// a sync tried.
pub(crate) static LOCALHOST_NODEPORT_LISTENER_FAILURES: LazyLock<
    Family<FamilyLabel, Counter<u64, AtomicU64>>,
> = LazyLock::new(|| {
    let f: Family<FamilyLabel, Counter<u64, AtomicU64>> = Family::default();
    for fam in IpFamily::ALL {
        let _ = f.get_or_create(&label_of(fam));
    }
    f
});

fn label_of(f: IpFamily) -> FamilyLabel {
    [("ip_family", f.label())]
}

/// Sets the localhost relay's listener count of family `f`.
pub fn set_localhost_nodeport_listeners(f: IpFamily, n: usize) {
    LOCALHOST_NODEPORT_LISTENERS
        .get_or_create(&label_of(f))
        .set(n as i64);
}

/// Counts one loopback NodePort listener of family `f` that could not be opened.
pub fn localhost_nodeport_listener_failed(f: IpFamily) {
    LOCALHOST_NODEPORT_LISTENER_FAILURES
        .get_or_create(&label_of(f))
        .inc();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_ports_series_are_shared_by_its_listeners_and_go_when_forgotten() {
        let a = RelayPortMetrics::of("ns/a:http", "TCP");
        let b = RelayPortMetrics::of("ns/a:http", "TCP");
        a.connections.inc();
        b.connections.inc();
        b.bytes_to_client.inc_by(7);
        a.refused(RelayRefusal::SourceLimit);
        let labels: PortLabels = [
            ("service_port", "ns/a:http".into()),
            ("protocol", "TCP".into()),
        ];
        assert_eq!(CONNECTIONS.get_or_create(&labels).get(), 2);
        assert_eq!(a.bytes_to_client.get(), 7);
        a.forget();
        let text = crate::render_prometheus();
        assert!(!text.contains("ns/a:http"), "{text}");
    }
}
