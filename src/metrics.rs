//! Counters the agent keeps, named as kube-proxy names its metrics, rendered in the Prometheus text format
//! (served on `/metrics` by `admin`, which adds the conntrack and API-source counters). Process-wide
//! statics: one agent per process.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// kube-proxy's sync-duration buckets: 1 ms doubling, 15 of them.
const fn sync_bounds() -> [f64; 15] {
    let mut b = [0.0; 15];
    let mut i = 0;
    while i < b.len() {
        b[i] = 0.001 * (1u64 << i) as f64;
        i += 1;
    }
    b
}

/// A sync-duration histogram.
pub type Histogram = BoundedHistogram<15>;

impl Histogram {
    pub const fn sync_durations() -> Self {
        BoundedHistogram::new(sync_bounds())
    }
}

/// A histogram with explicit bucket bounds (seconds), lock-free.
pub struct BoundedHistogram<const N: usize> {
    bounds: [f64; N],
    counts: [AtomicU64; N],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl<const N: usize> BoundedHistogram<N> {
    pub const fn new(bounds: [f64; N]) -> Self {
        BoundedHistogram {
            bounds,
            counts: [const { AtomicU64::new(0) }; N],
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if s <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// kube-proxy's network programming latency buckets: 0.25 s, 0.5 s, 1..59 s, 60..115 s by 5, 120..300 s
/// by 30.
const fn network_programming_bounds() -> [f64; 80] {
    let mut b = [0.0; 80];
    b[0] = 0.25;
    b[1] = 0.5;
    let mut i = 0;
    while i < 59 {
        b[2 + i] = (i + 1) as f64;
        i += 1;
    }
    i = 0;
    while i < 12 {
        b[61 + i] = 60.0 + 5.0 * i as f64;
        i += 1;
    }
    i = 0;
    while i < 7 {
        b[73 + i] = 120.0 + 30.0 * i as f64;
        i += 1;
    }
    b
}

/// Every sync, full or partial (`sync_proxy_rules_duration_seconds`).
pub static SYNC_DURATION: Histogram = Histogram::sync_durations();
/// From an EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time` to the commit that
/// programmed it.
pub static NETWORK_PROGRAMMING: BoundedHistogram<80> =
    BoundedHistogram::new(network_programming_bounds());
/// Unix time (ms) when a sync was last asked for (a change arrived, or a periodic resync fell due).
pub static LAST_QUEUED_UNIX_MS: AtomicU64 = AtomicU64::new(0);
/// Service / EndpointSlice changes received, in total and since the last sync started.
pub static SERVICE_CHANGES_TOTAL: AtomicU64 = AtomicU64::new(0);
pub static SERVICE_CHANGES_PENDING: AtomicU64 = AtomicU64::new(0);
pub static ENDPOINT_CHANGES_TOTAL: AtomicU64 = AtomicU64::new(0);
pub static ENDPOINT_CHANGES_PENDING: AtomicU64 = AtomicU64::new(0);
/// nf_tables objects (elements, chains, rules, sets) added or removed by committed syncs.
pub static OBJECT_CHANGES_TOTAL: AtomicU64 = AtomicU64::new(0);
/// Netlink bytes sent by committed syncs.
pub static NETLINK_BYTES_TOTAL: AtomicU64 = AtomicU64::new(0);
/// Service ports in the model after the last successful sync.
pub static SERVICE_PORTS: AtomicU64 = AtomicU64::new(0);

/// Unix time now, in milliseconds.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub static SYNC_FULL_DURATION: Histogram = Histogram::sync_durations();
pub static SYNC_PARTIAL_DURATION: Histogram = Histogram::sync_durations();
pub static SYNC_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Successful full syncs that followed someone else changing our tables (noticed by the event monitor).
pub static REPAIRS: AtomicU64 = AtomicU64::new(0);
/// Unix time (ms) of the last successful sync.
pub static LAST_SYNC_UNIX_MS: AtomicU64 = AtomicU64::new(0);
/// Services changed in the model and not yet committed.
pub static PENDING_CHANGES: AtomicU64 = AtomicU64::new(0);

/// Records a successful sync.
pub fn record_sync(full: bool, elapsed: Duration) {
    if full {
        SYNC_FULL_DURATION.observe(elapsed);
    } else {
        SYNC_PARTIAL_DURATION.observe(elapsed);
    }
    SYNC_DURATION.observe(elapsed);
    LAST_SYNC_UNIX_MS.store(now_unix_ms(), Ordering::Relaxed);
}

/// Everything above in the Prometheus text exposition format.
pub fn render_prometheus() -> String {
    let mut out = String::new();
    SYNC_FULL_DURATION.render(
        &mut out,
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "Full sync duration (reads the kernel back and repairs it).",
    );
    SYNC_PARTIAL_DURATION.render(
        &mut out,
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "Partial sync duration (changed services only).",
    );
    SYNC_DURATION.render(
        &mut out,
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "Sync duration, full and partial.",
    );
    NETWORK_PROGRAMMING.render(
        &mut out,
        "kubeproxy_network_programming_duration_seconds",
        "From an EndpointSlice change (its last-change-trigger-time) to the commit that programmed it.",
    );
    let counter = |out: &mut String, name: &str, help: &str, kind: &str, v: f64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    };
    counter(
        &mut out,
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "When the last successful sync finished.",
        "gauge",
        LAST_SYNC_UNIX_MS.load(Ordering::Relaxed) as f64 / 1000.0,
    );
    counter(
        &mut out,
        "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
        "Transactions the kernel rejected (nothing of them was applied).",
        "counter",
        SYNC_FAILURES.load(Ordering::Relaxed) as f64,
    );
    counter(
        &mut out,
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "When a sync was last asked for (a change arrived, or a periodic resync fell due).",
        "gauge",
        LAST_QUEUED_UNIX_MS.load(Ordering::Relaxed) as f64 / 1000.0,
    );
    for (name, help, kind, v) in [
        (
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "Service changes received.",
            "counter",
            &SERVICE_CHANGES_TOTAL,
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Service changes received since the last sync started.",
            "gauge",
            &SERVICE_CHANGES_PENDING,
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "EndpointSlice changes received.",
            "counter",
            &ENDPOINT_CHANGES_TOTAL,
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "EndpointSlice changes received since the last sync started.",
            "gauge",
            &ENDPOINT_CHANGES_PENDING,
        ),
        (
            "nftkube_sync_object_changes_total",
            "nf_tables objects (set elements, chains, rules, sets) added or removed by committed syncs.",
            "counter",
            &OBJECT_CHANGES_TOTAL,
        ),
        (
            "nftkube_sync_netlink_bytes_total",
            "Netlink bytes sent by committed syncs.",
            "counter",
            &NETLINK_BYTES_TOTAL,
        ),
        (
            "nftkube_service_ports",
            "Service ports in the model at the last successful sync.",
            "gauge",
            &SERVICE_PORTS,
        ),
    ] {
        counter(&mut out, name, help, kind, v.load(Ordering::Relaxed) as f64);
    }
    counter(
        &mut out,
        "nftkube_repairs_total",
        "Full syncs triggered by someone else changing our tables.",
        "counter",
        REPAIRS.load(Ordering::Relaxed) as f64,
    );
    counter(
        &mut out,
        "nftkube_pending_service_changes",
        "Services changed in the model and not yet committed.",
        "gauge",
        PENDING_CHANGES.load(Ordering::Relaxed) as f64,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::sync_durations();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(100));
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.001\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.004\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"), "{out}");
    }

    #[test]
    fn exposition_names_the_kube_proxy_metrics() {
        record_sync(false, Duration::from_millis(2));
        let text = render_prometheus();
        assert!(text.contains("kubeproxy_sync_partial_proxy_rules_duration_seconds_count"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_nftables_sync_failures_total"));
        assert!(text.contains("nftkube_repairs_total"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_count"));
        assert!(text.contains("kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\"}"));
    }

    #[test]
    fn network_programming_buckets_are_kube_proxys() {
        let b = network_programming_bounds();
        assert_eq!(&b[..4], &[0.25, 0.5, 1.0, 2.0]);
        assert_eq!(b[60], 59.0);
        assert_eq!(b[61], 60.0);
        assert_eq!(b[72], 115.0);
        assert_eq!(b[73], 120.0);
        assert_eq!(b[79], 300.0);
        assert!(b.windows(2).all(|w| w[0] < w[1]));
        let h = BoundedHistogram::new(b);
        h.observe(Duration::from_millis(700));
        let mut out = String::new();
        h.render(&mut out, "x", "h");
        assert!(out.contains("x_bucket{le=\"0.5\"} 0\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"1\"} 1\n"), "{out}");
    }
}
