//! Metrics labelled `ip_family`, as kube-proxy labels them.
//!
//! A dual-stack kube-proxy runs one proxier per family, and each records its own sample (`ip_family="IPv4"`,
//! `ip_family="IPv6"`). nftkube programs both of its tables (`ip nftkube`, `ip6 nftkube`) in every sync, in
//! one batch: so a sync, a failure or a verification is recorded once under each family, with the same
//! value, and a dashboard filtering on either family sees what a kube-proxy of that family would show.
//! Measures that do belong to one family (network programming latency of a service's slices, services
//! without local endpoints) are recorded under that family only ([`FamilyHistogram::observe_in`]).
//! Both samples exist from the start (at 0), so that a query by family never finds nothing.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use std::sync::atomic::AtomicU64;
use std::sync::LazyLock;
use std::time::Duration;

/// An IP family, as the `ip_family` label spells it (Kubernetes' `IPFamily`: `IPv4`, `IPv6`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    /// `IPv4`.
    V4,
    /// `IPv6`.
    V6,
}

impl IpFamily {
    /// Both families: what every sync programs.
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

/// One `ip_family` label pair.
pub(crate) type FamilyLabel = [(&'static str, &'static str); 1];

fn label(f: IpFamily) -> FamilyLabel {
    [("ip_family", f.label())]
}

pub(crate) type HistogramFamily = Family<FamilyLabel, Histogram, fn() -> Histogram>;

/// A histogram of durations, in seconds, one per family.
pub struct FamilyHistogram(LazyLock<HistogramFamily>);

impl FamilyHistogram {
    /// Built by `make` on first use ([`sync_histograms`], [`network_programming_histograms`]).
    pub(crate) const fn new(make: fn() -> HistogramFamily) -> Self {
        FamilyHistogram(LazyLock::new(make))
    }

    /// Records one duration under every family.
    pub fn observe(&self, d: Duration) {
        for f in IpFamily::ALL {
            self.observe_in(f, d);
        }
    }

    /// Records one duration under family `f`.
    pub fn observe_in(&self, f: IpFamily, d: Duration) {
        self.0.get_or_create(&label(f)).observe(d.as_secs_f64());
    }

    /// The family itself (a handle on the same histograms), for a registry; both samples present.
    pub(crate) fn metric(&self) -> HistogramFamily {
        for f in IpFamily::ALL {
            let _ = self.0.get_or_create(&label(f));
        }
        (*self.0).clone()
    }
}

/// Histograms with kube-proxy's sync-duration buckets, one per family.
pub(crate) fn sync_histograms() -> HistogramFamily {
    Family::new_with_constructor(|| Histogram::new(crate::sync_bounds()))
}

/// Histograms with kube-proxy's network programming buckets, one per family.
pub(crate) fn network_programming_histograms() -> HistogramFamily {
    Family::new_with_constructor(|| Histogram::new(crate::network_programming_bounds()))
}

/// A count, one per family.
pub struct FamilyCounter(LazyLock<Family<FamilyLabel, Counter<u64, AtomicU64>>>);

impl FamilyCounter {
    /// At 0.
    pub(crate) const fn new() -> Self {
        FamilyCounter(LazyLock::new(Family::default))
    }

    /// One more under every family.
    pub fn inc(&self) {
        for f in IpFamily::ALL {
            self.inc_in(f);
        }
    }

    /// One more under family `f`.
    pub fn inc_in(&self, f: IpFamily) {
        self.0.get_or_create(&label(f)).inc();
    }

    /// The value under family `f`.
    pub fn get(&self, f: IpFamily) -> u64 {
        self.0.get_or_create(&label(f)).get()
    }

    /// The family itself, for a registry; both samples present.
    pub(crate) fn metric(&self) -> Family<FamilyLabel, Counter<u64, AtomicU64>> {
        for f in IpFamily::ALL {
            let _ = self.0.get_or_create(&label(f));
        }
        (*self.0).clone()
    }
}

impl Default for FamilyCounter {
    fn default() -> Self {
        Self::new()
    }
}

/// A Unix timestamp in seconds, one per family.
pub struct FamilyTimestamp(LazyLock<Family<FamilyLabel, Gauge<f64, AtomicU64>>>);

impl FamilyTimestamp {
    /// Unset (0).
    pub(crate) const fn new() -> Self {
        FamilyTimestamp(LazyLock::new(Family::default))
    }

    /// Sets every family's to now.
    pub fn mark(&self) {
        let now = crate::now_unix_ms() as f64 / 1000.0;
        for f in IpFamily::ALL {
            self.0.get_or_create(&label(f)).set(now);
        }
    }

    /// Family `f`'s value (0 before the first mark).
    pub fn get(&self, f: IpFamily) -> f64 {
        self.0.get_or_create(&label(f)).get()
    }

    /// The family itself, for a registry; both samples present.
    pub(crate) fn metric(&self) -> Family<FamilyLabel, Gauge<f64, AtomicU64>> {
        for f in IpFamily::ALL {
            let _ = self.0.get_or_create(&label(f));
        }
        (*self.0).clone()
    }
}

impl Default for FamilyTimestamp {
    fn default() -> Self {
        Self::new()
    }
}

/// A service's traffic policy as the `traffic_policy` label names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TrafficPolicy {
    /// `internalTrafficPolicy: Local` (cluster IPs).
    Internal,
    /// `externalTrafficPolicy: Local` (NodePorts, load balancer and external IPs).
    External,
}

impl TrafficPolicy {
    /// Both.
    pub const ALL: [TrafficPolicy; 2] = [TrafficPolicy::Internal, TrafficPolicy::External];

    fn label(self) -> &'static str {
        match self {
            TrafficPolicy::Internal => "internal",
            TrafficPolicy::External => "external",
        }
    }
}

type PolicyLabels = [(&'static str, &'static str); 2];

/// `kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family, traffic_policy}`: a gauge despite its
/// name (kube-proxy's), set at each sync to the count over the whole model.
pub struct NoLocalEndpoints(
    LazyLock<Family<PolicyLabels, Gauge<i64, std::sync::atomic::AtomicI64>>>,
);

impl NoLocalEndpoints {
    /// Every count at 0.
    pub(crate) const fn new() -> Self {
        NoLocalEndpoints(LazyLock::new(Family::default))
    }

    fn labels(f: IpFamily, p: TrafficPolicy) -> PolicyLabels {
        [("ip_family", f.label()), ("traffic_policy", p.label())]
    }

    /// Sets the count of family `f` and policy `p`.
    pub fn set(&self, f: IpFamily, p: TrafficPolicy, count: usize) {
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        self.0.get_or_create(&Self::labels(f, p)).set(count);
    }

    /// The count of family `f` and policy `p`.
    pub fn get(&self, f: IpFamily, p: TrafficPolicy) -> i64 {
        self.0.get_or_create(&Self::labels(f, p)).get()
    }

    /// The family itself, for a registry; all four samples present.
    pub(crate) fn metric(&self) -> Family<PolicyLabels, Gauge<i64, std::sync::atomic::AtomicI64>> {
        for f in IpFamily::ALL {
            for p in TrafficPolicy::ALL {
                let _ = self.0.get_or_create(&Self::labels(f, p));
            }
        }
        (*self.0).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_wide_records_land_in_both_and_family_ones_in_one() {
        let h = FamilyHistogram::new(sync_histograms);
        h.observe(Duration::from_millis(3));
        h.observe_in(IpFamily::V6, Duration::from_millis(3));
        let counts: Vec<u64> = IpFamily::ALL
            .iter()
            .map(|f| {
                let mut r = prometheus_client::registry::Registry::default();
                r.register("x", "h", h.metric());
                let text = crate::render(&r, crate::Format::Classic);
                let key = format!("x_count{{ip_family=\"{}\"}} ", f.label());
                text.lines()
                    .find_map(|l| l.strip_prefix(&key))
                    .unwrap_or_else(|| panic!("{key} in {text}"))
                    .parse()
                    .unwrap()
            })
            .collect();
        assert_eq!(counts, [1, 2]);
        let c = FamilyCounter::new();
        c.inc();
        c.inc_in(IpFamily::V4);
        assert_eq!((c.get(IpFamily::V4), c.get(IpFamily::V6)), (2, 1));
        let t = FamilyTimestamp::new();
        assert_eq!(t.get(IpFamily::V4), 0.0);
        t.mark();
        assert!(t.get(IpFamily::V4) > 1e9 && t.get(IpFamily::V4) == t.get(IpFamily::V6));
    }
}
