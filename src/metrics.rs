//! Counters the agent keeps, named as kube-proxy names its metrics, rendered in the Prometheus text format
//! (the HTTP endpoint that serves them is a later step). Process-wide statics: one agent per process.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A histogram with kube-proxy's sync-duration buckets (1 ms doubling, 15 buckets), lock-free.
pub struct Histogram {
    counts: [AtomicU64; BUCKETS],
    count: AtomicU64,
    sum_us: AtomicU64,
}

const BUCKETS: usize = 15;

fn bound_seconds(i: usize) -> f64 {
    0.001 * (1u64 << i) as f64
}

impl Histogram {
    pub const fn new() -> Self {
        Histogram {
            counts: [const { AtomicU64::new(0) }; BUCKETS],
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (i, c) in self.counts.iter().enumerate() {
            if s <= bound_seconds(i) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, c) in self.counts.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{}\"}} {}",
                bound_seconds(i),
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

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

pub static SYNC_FULL_DURATION: Histogram = Histogram::new();
pub static SYNC_PARTIAL_DURATION: Histogram = Histogram::new();
pub static SYNC_FAILURES: AtomicU64 = AtomicU64::new(0);
/// Full syncs started because someone changed our tables (the event monitor).
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
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    LAST_SYNC_UNIX_MS.store(now, Ordering::Relaxed);
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
        let h = Histogram::new();
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
    }
}
