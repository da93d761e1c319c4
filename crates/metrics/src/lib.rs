//! The agent's metrics, named as kube-proxy names its own, kept in prometheus-client's types and encoded by
//! it (OpenMetrics text, rewritten into the classic Prometheus text format unless the scraper asks for
//! OpenMetrics: [`exposition`]; served on `/metrics` by `admin`, which adds the health, conntrack and
//! API-source counters). Process-wide statics: one agent per process.
//!
//! A histogram is one prometheus-client `Histogram`: its buckets, sum and count change under one lock, so
//! a scrape always sees a consistent snapshot (no bucket above `+Inf`, `_count` equal to `+Inf`).
//!
//! Counters and gauges of whole numbers are [`AtomicMetric`]s: the prometheus-client metric is what is
//! registered and encoded, and it dereferences to its own atomic, so `fetch_add` / `store` call sites
//! (the proxy loop's) bump the metric itself.
#![forbid(unsafe_code)]

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Metric, Registry};
use std::ops::Deref;
use std::sync::atomic::AtomicU64;
use std::sync::LazyLock;
use std::time::Duration;

mod build_info;
pub mod exposition;
mod family;
mod process;
mod relay;

pub use exposition::Format;
pub use family::{
    FamilyCounter, FamilyHistogram, FamilyTimestamp, IpFamily, NoLocalEndpoints, TrafficPolicy,
};
pub use relay::{
    localhost_nodeport_listener_failed, set_localhost_nodeport_listeners, RelayPortMetrics,
    RelayRefusal,
};

/// kube-proxy's sync-duration buckets: 1 ms doubling, 15 of them.
pub(crate) fn sync_bounds() -> impl Iterator<Item = f64> {
    (0..15).map(|i| 0.001 * (1u64 << i) as f64)
}

/// kube-proxy's network programming latency buckets: 0.25 s, 0.5 s, 1..59 s, 60..115 s by 5, 120..300 s
/// by 30.
pub(crate) fn network_programming_bounds() -> impl Iterator<Item = f64> {
    [0.25, 0.5]
        .into_iter()
        .chain((1..60).map(f64::from))
        .chain((0..12).map(|i| 60.0 + 5.0 * f64::from(i)))
        .chain((0..7).map(|i| 120.0 + 30.0 * f64::from(i)))
}

/// A counter (or gauge) of whole numbers: a prometheus-client metric in a static, registered on first use;
/// call sites use the metric's own methods (`inc`, `inc_by`, `set`, `get`).
pub struct AtomicMetric<M: 'static>(LazyLock<M>);

/// A monotonic count.
pub type CounterU64 = AtomicMetric<Counter<u64, AtomicU64>>;
/// A level that goes up and down.
pub type GaugeU64 = AtomicMetric<Gauge<u64, AtomicU64>>;

impl CounterU64 {
    /// A counter at 0.
    pub(crate) const fn counter() -> Self {
        AtomicMetric(LazyLock::new(Counter::default))
    }
}

impl GaugeU64 {
    /// A gauge at 0.
    pub(crate) const fn gauge() -> Self {
        AtomicMetric(LazyLock::new(Gauge::default))
    }
}

impl<M: Clone> AtomicMetric<M> {
    /// The metric itself (a handle on the same value), for a registry.
    pub(crate) fn metric(&self) -> M {
        (*self.0).clone()
    }
}

impl<M> Deref for AtomicMetric<M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.0
    }
}

/// Every sync, full or partial (`sync_proxy_rules_duration_seconds`).
pub(crate) static SYNC_DURATION: FamilyHistogram = FamilyHistogram::new(family::sync_histograms);
/// Full syncs (`sync_full_proxy_rules_duration_seconds`).
pub(crate) static SYNC_FULL_DURATION: FamilyHistogram =
    FamilyHistogram::new(family::sync_histograms);
/// Partial syncs (`sync_partial_proxy_rules_duration_seconds`).
pub(crate) static SYNC_PARTIAL_DURATION: FamilyHistogram =
    FamilyHistogram::new(family::sync_histograms);
/// From an EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time` to the commit that
/// programmed it, under the family of the service's cluster IPs.
pub static NETWORK_PROGRAMMING: FamilyHistogram =
    FamilyHistogram::new(family::network_programming_histograms);
/// When a sync was last asked for (a change arrived, or a periodic resync fell due).
pub static LAST_QUEUED: FamilyTimestamp = FamilyTimestamp::new();
/// When the last successful sync, or check that the kernel holds what it committed, finished.
pub(crate) static LAST_SYNC: FamilyTimestamp = FamilyTimestamp::new();
/// Service / EndpointSlice changes received, in total and since the last sync started.
pub static SERVICE_CHANGES_TOTAL: CounterU64 = CounterU64::counter();
/// Service changes received since the last sync started.
pub static SERVICE_CHANGES_PENDING: GaugeU64 = GaugeU64::gauge();
/// EndpointSlice changes received in total.
pub static ENDPOINT_CHANGES_TOTAL: CounterU64 = CounterU64::counter();
/// EndpointSlice changes received since the last sync started.
pub static ENDPOINT_CHANGES_PENDING: GaugeU64 = GaugeU64::gauge();
/// nf_tables objects (elements, chains, rules, sets) added or removed by committed syncs.
pub static OBJECT_CHANGES_TOTAL: CounterU64 = CounterU64::counter();
/// Netlink bytes sent by committed syncs.
pub static NETLINK_BYTES_TOTAL: CounterU64 = CounterU64::counter();
/// Service ports in the model after the last successful sync.
pub static SERVICE_PORTS: GaugeU64 = GaugeU64::gauge();
/// Transactions the kernel rejected.
pub static SYNC_FAILURES: FamilyCounter = FamilyCounter::new();
/// Cleanup transactions (run apart from a sync's, deleting what no rule needs any more) the kernel
/// rejected.
pub static CLEANUP_FAILURES: FamilyCounter = FamilyCounter::new();
/// Conntrack cleanups after syncs, how long each took (kube-proxy's conntrack reconciler).
pub static CONNTRACK_RECONCILE: FamilyHistogram = FamilyHistogram::new(family::sync_histograms);
/// Service ports with a Local traffic policy and no local endpoint, by family and policy: the whole
/// model's count after each sync (the observer recounts the services the sync touched).
pub static NO_LOCAL_ENDPOINTS: NoLocalEndpoints = NoLocalEndpoints::new();
/// Successful full syncs that followed someone else changing our tables (noticed by the event monitor).
pub static REPAIRS: CounterU64 = CounterU64::counter();
/// Services changed in the model and not yet committed.
pub static PENDING_CHANGES: GaugeU64 = GaugeU64::gauge();
/// Frontend claims refused at the last successful sync: another service port of higher precedence holds the
/// address and port.
pub static REFUSED_CLAIMS: GaugeU64 = GaugeU64::gauge();
/// Service ports the kernel refuses, left out of it while every other one is programmed.
pub static QUARANTINED_PORTS: GaugeU64 = GaugeU64::gauge();
/// SCTP service ports refused in userspace mode (the relay carries TCP and UDP).
pub static USERSPACE_SCTP_REFUSED: GaugeU64 = GaugeU64::gauge();
/// Endpoints left out of a frontend past the cap of one count, each time their service port is rendered.
pub static ENDPOINTS_OVER_CAP: CounterU64 = CounterU64::counter();
/// Service ports the kernel refused, each time it did.
pub static KERNEL_REJECTED_PORTS: CounterU64 = CounterU64::counter();

/// Unix time now, in milliseconds.
pub(crate) fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Records a successful sync.
pub fn record_sync(full: bool, elapsed: Duration) {
    if full {
        SYNC_FULL_DURATION.observe(elapsed);
    } else {
        SYNC_PARTIAL_DURATION.observe(elapsed);
    }
    SYNC_DURATION.observe(elapsed);
    LAST_SYNC.mark();
}

/// A periodic check found the kernel holding what the last sync committed. kube-proxy re-runs its sync every
/// sync period, and dashboards alert on `kubeproxy_sync_proxy_rules_last_timestamp_seconds` going stale; a
/// verified kernel is as fresh as a sync, so it moves the timestamp too.
pub fn record_kernel_verified() {
    LAST_SYNC.mark();
}

/// The last successful sync or verification, in Unix seconds (0 before the first; the same in both
/// families).
pub fn last_sync_seconds() -> f64 {
    LAST_SYNC.get(IpFamily::V4)
}

/// Registers `metric` under `name` (prometheus-client appends `_total` to counters).
fn add(registry: &mut Registry, name: &str, help: &str, metric: impl Metric) {
    registry.register(name, help, metric);
}

/// A registry holding every metric above (handles on the statics: registering copies nothing).
pub fn registry() -> Registry {
    let mut r = Registry::default();
    for (name, help, h) in [
        (
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "Full sync duration (reads the kernel back and repairs it)",
            &SYNC_FULL_DURATION,
        ),
        (
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "Partial sync duration (changed services only)",
            &SYNC_PARTIAL_DURATION,
        ),
        (
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "Sync duration, full and partial",
            &SYNC_DURATION,
        ),
        (
            "kubeproxy_network_programming_duration_seconds",
            "From an EndpointSlice change (its last-change-trigger-time) to the commit that programmed it",
            &NETWORK_PROGRAMMING,
        ),
    ] {
        add(&mut r, name, help, h.metric());
    }
    add(
        &mut r,
        "kubeproxy_sync_proxy_rules_nftables_sync_failures",
        "Transactions the kernel rejected (nothing of them was applied)",
        SYNC_FAILURES.metric(),
    );
    add(
        &mut r,
        "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
        "Cleanup transactions (stale affinity entries, deleted apart from the sync) the kernel rejected",
        CLEANUP_FAILURES.metric(),
    );
    add(
        &mut r,
        "kubeproxy_conntrack_reconciler_sync_duration_seconds",
        "Duration of each conntrack cleanup run after a sync",
        CONNTRACK_RECONCILE.metric(),
    );
    add(
        &mut r,
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        "Number of services with a Local traffic policy and no endpoints",
        NO_LOCAL_ENDPOINTS.metric(),
    );
    add(
        &mut r,
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "When the last successful sync, or check that the kernel holds what it committed, finished",
        LAST_SYNC.metric(),
    );
    add(
        &mut r,
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "When a sync was last asked for (a change arrived, or a periodic resync fell due)",
        LAST_QUEUED.metric(),
    );
    for (name, help, c) in [
        (
            "kubeproxy_sync_proxy_rules_service_changes",
            "Service changes received",
            &SERVICE_CHANGES_TOTAL,
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "EndpointSlice changes received",
            &ENDPOINT_CHANGES_TOTAL,
        ),
        (
            "nftkube_sync_object_changes",
            "nf_tables objects (set elements, chains, rules, sets) added or removed by committed syncs",
            &OBJECT_CHANGES_TOTAL,
        ),
        (
            "nftkube_sync_netlink_bytes",
            "Netlink bytes sent by committed syncs",
            &NETLINK_BYTES_TOTAL,
        ),
        (
            "nftkube_endpoints_over_cap",
            "Endpoints left out of a frontend past its cap of 32767, each time the service port is rendered",
            &ENDPOINTS_OVER_CAP,
        ),
        (
            "nftkube_kernel_rejected_service_ports",
            "Service ports the kernel refused on their own (left out, everything else committed)",
            &KERNEL_REJECTED_PORTS,
        ),
        (
            "nftkube_repairs",
            "Full syncs triggered by someone else changing our tables",
            &REPAIRS,
        ),
    ] {
        add(&mut r, name, help, c.metric());
    }
    for (name, help, g) in [
        (
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Service changes received since the last sync started",
            &SERVICE_CHANGES_PENDING,
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "EndpointSlice changes received since the last sync started",
            &ENDPOINT_CHANGES_PENDING,
        ),
        (
            "nftkube_service_ports",
            "Service ports in the model at the last successful sync",
            &SERVICE_PORTS,
        ),
        (
            "nftkube_pending_service_changes",
            "Services changed in the model and not yet committed",
            &PENDING_CHANGES,
        ),
        (
            "nftkube_quarantined_service_ports",
            "Service ports the kernel refuses, left out while every other one is programmed",
            &QUARANTINED_PORTS,
        ),
        (
            "nftkube_refused_frontend_claims",
            "Service ports whose address and port another service port of higher precedence holds",
            &REFUSED_CLAIMS,
        ),
        (
            "nftkube_userspace_refused_sctp_service_ports",
            "SCTP service ports refused in userspace mode: the relay carries TCP and UDP, their frontends are rejected",
            &USERSPACE_SCTP_REFUSED,
        ),
    ] {
        add(&mut r, name, help, g.metric());
    }
    register_relay(&mut r);
    // What every Kubernetes component exports, read when scraped.
    r.register_collector(Box::new(process::ProcessCollector));
    r.register_collector(Box::new(build_info::BuildInfo));
    r
}

/// The userspace relay's (see `relay`).
fn register_relay(r: &mut Registry) {
    add(
        r,
        "kubeproxy_nftables_localhost_nodeport_listeners",
        "Localhost NodePort listeners open (the relay serving NodePorts on loopback)",
        (*relay::LOCALHOST_NODEPORT_LISTENERS).clone(),
    );
    add(
        r,
        "kubeproxy_nftables_localhost_nodeport_listener_creation_failures",
        "Localhost NodePort listeners that could not be opened, each time a sync tried",
        (*relay::LOCALHOST_NODEPORT_LISTENER_FAILURES).clone(),
    );
    add(
        r,
        "nftkube_userspace_relay_connections",
        "Userspace mode: TCP connections and UDP flows the relay accepted, per service port",
        (*relay::CONNECTIONS).clone(),
    );
    add(
        r,
        "nftkube_userspace_relay_active_connections",
        "Userspace mode: TCP connections and UDP flows being relayed, per service port",
        (*relay::ACTIVE).clone(),
    );
    add(
        r,
        "nftkube_userspace_relay_bytes",
        "Userspace mode: bytes relayed per service port, from_client (to endpoints) or to_client",
        (*relay::BYTES).clone(),
    );
    add(
        r,
        "nftkube_userspace_relay_refused_connections",
        "Userspace mode: TCP connections reset and UDP flows whose first datagram was dropped, per service port and reason",
        (*relay::REFUSED).clone(),
    );
}

/// Appends `registry`'s metrics to `out` (no `# EOF`: see [`finish`]).
pub fn encode_into(out: &mut String, registry: &Registry) {
    // Writing into a String cannot fail.
    let _ = encode_registry(out, registry);
}

/// Ends an exposition (OpenMetrics' `# EOF`).
pub fn finish(out: &mut String) {
    let _ = encode_eof(out);
}

/// The whole exposition of `registry` in `format`.
pub fn render(registry: &Registry, format: Format) -> String {
    let mut out = String::new();
    encode_into(&mut out, registry);
    finish(&mut out);
    match format {
        Format::OpenMetrics => out,
        Format::Classic => exposition::to_classic(&out),
    }
}

#[cfg(test)]
/// Every metric above, as a whole OpenMetrics exposition.
pub(crate) fn render_prometheus() -> String {
    render(&registry(), Format::OpenMetrics)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// The samples of `name` (a histogram's `_bucket` lines by `le`, and its `_count`).
    fn histogram_samples(text: &str, name: &str) -> (BTreeMap<String, u64>, u64) {
        let mut buckets = BTreeMap::new();
        let mut count = None;
        for line in text.lines() {
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            if let Some(le) = key
                .strip_prefix(&format!("{name}_bucket{{le=\""))
                .and_then(|r| r.strip_suffix("\",ip_family=\"IPv4\"}"))
            {
                buckets.insert(le.to_string(), value.parse().unwrap());
            } else if key == format!("{name}_count{{ip_family=\"IPv4\"}}") {
                count = Some(value.parse().unwrap());
            }
        }
        (buckets, count.expect("a _count line"))
    }

    fn render_one(h: &FamilyHistogram) -> String {
        let mut r = Registry::default();
        r.register("x", "help", h.metric());
        let mut out = String::new();
        encode_into(&mut out, &r);
        out
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = FamilyHistogram::new(family::sync_histograms);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(100));
        let out = render_one(&h);
        assert!(
            out.contains("x_bucket{le=\"0.001\",ip_family=\"IPv4\"} 1\n"),
            "{out}"
        );
        assert!(
            out.contains("x_bucket{le=\"0.004\",ip_family=\"IPv4\"} 2\n"),
            "{out}"
        );
        assert!(
            out.contains("x_bucket{le=\"+Inf\",ip_family=\"IPv6\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("x_count{ip_family=\"IPv4\"} 3\n"), "{out}");
        assert!(out.contains("x_sum{ip_family=\"IPv4\"} 100.0035"), "{out}");
    }

    /// Observers on two threads, a scraper on a third: every scrape shows buckets that never decrease
    /// with `le`, a `+Inf` bucket equal to `_count`, and no bucket above it. With per-bucket atomics read
    /// one by one (what this replaced) a scrape taken between an observation's bucket and count updates
    /// showed a bucket larger than `+Inf`.
    #[test]
    fn scrapes_see_consistent_histograms_under_concurrent_observation() {
        let h = Arc::new(FamilyHistogram::new(family::sync_histograms));
        let stop = Arc::new(AtomicBool::new(false));
        let observers: Vec<_> = (0..2)
            .map(|t| {
                let (h, stop) = (h.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Spread over every bucket and beyond the last.
                        h.observe(Duration::from_micros((i * 7919 + t) % 40_000_000));
                        i += 1;
                    }
                    i
                })
            })
            .collect();
        let mut scrapes = 0;
        let mut last_count = 0;
        let deadline = std::time::Instant::now() + Duration::from_millis(700);
        while std::time::Instant::now() < deadline {
            let (buckets, count) = histogram_samples(&render_one(&h), "x");
            let inf = buckets["+Inf"];
            assert_eq!(inf, count, "+Inf equals _count");
            let mut finite: Vec<(f64, u64)> = buckets
                .iter()
                .filter(|(le, _)| le.as_str() != "+Inf")
                .map(|(le, v)| (le.parse().unwrap(), *v))
                .collect();
            finite.sort_by(|a, b| a.0.total_cmp(&b.0));
            assert_eq!(finite.len(), 15);
            assert!(
                finite.windows(2).all(|w| w[0].1 <= w[1].1),
                "cumulative: {finite:?}"
            );
            assert!(finite.iter().all(|(_, v)| *v <= inf), "{finite:?} > {inf}");
            assert!(count >= last_count, "counts never go back");
            last_count = count;
            scrapes += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let observed: u64 = observers.into_iter().map(|t| t.join().unwrap()).sum();
        let (_, count) = histogram_samples(&render_one(&h), "x");
        assert_eq!(count, observed, "every observation counted once");
        assert!(
            scrapes > 10 && observed > 1000,
            "{scrapes} scrapes, {observed} observations"
        );
    }

    #[test]
    fn exposition_names_the_kube_proxy_metrics() {
        record_sync(false, Duration::from_millis(2));
        REPAIRS.inc();
        PENDING_CHANGES.set(7);
        let text = render_prometheus();
        for name in [
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv6\"}",
            "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"}",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\",ip_family=\"IPv4\"}",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv6\"}",
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "nftkube_sync_object_changes_total",
            "nftkube_sync_netlink_bytes_total",
            "nftkube_service_ports",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{name} "))),
                "{name} missing:\n{text}"
            );
        }
        assert!(
            text.contains("\nnftkube_pending_service_changes 7\n"),
            "{text}"
        );
        let repairs = text
            .lines()
            .find_map(|l| l.strip_prefix("nftkube_repairs_total "))
            .expect("nftkube_repairs_total");
        assert!(repairs.parse::<u64>().unwrap() >= 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    /// The timestamp dashboards alert on moves in both families with a verified kernel, not only a sync.
    #[test]
    fn a_verified_kernel_refreshes_the_last_sync_of_both_families() {
        let before: Vec<f64> = IpFamily::ALL.iter().map(|&f| LAST_SYNC.get(f)).collect();
        std::thread::sleep(Duration::from_millis(5));
        record_kernel_verified();
        for (f, was) in IpFamily::ALL.into_iter().zip(before) {
            assert!(LAST_SYNC.get(f) > was, "{f:?}");
        }
    }

    #[test]
    fn network_programming_buckets_are_kube_proxys() {
        let b: Vec<f64> = network_programming_bounds().collect();
        assert_eq!(b.len(), 80);
        assert_eq!(&b[..4], &[0.25, 0.5, 1.0, 2.0]);
        assert_eq!(b[60], 59.0);
        assert_eq!(b[61], 60.0);
        assert_eq!(b[72], 115.0);
        assert_eq!(b[73], 120.0);
        assert_eq!(b[79], 300.0);
        assert!(b.windows(2).all(|w| w[0] < w[1]));
        let h = FamilyHistogram::new(family::network_programming_histograms);
        h.observe(Duration::from_millis(700));
        let out = render_one(&h);
        assert!(
            out.contains("x_bucket{le=\"0.5\",ip_family=\"IPv4\"} 0\n"),
            "{out}"
        );
        assert!(
            out.contains("x_bucket{le=\"1.0\",ip_family=\"IPv4\"} 1\n"),
            "{out}"
        );
    }
}
