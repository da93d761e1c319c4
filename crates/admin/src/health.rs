//! `/healthz` and `/livez` with kube-proxy's meaning.
//!
//! The proxier is healthy while nothing waits to be programmed, or while the oldest waiting request is
//! younger than the health timeout (kube-proxy: twice the sync period). A sync is requested when a change
//! arrives and when a periodic resync falls due; a successful sync clears it. So a loop that stalls, or
//! keeps failing to commit, turns unhealthy one timeout after it should have synced, and an idle proxy with
//! nothing to do stays healthy. Before the source's first complete snapshot nothing is requested (kube-proxy
//! is healthy while it starts up).
//!
//! `/healthz` is also unhealthy when this node is being deleted (a deletion timestamp, or the cluster
//! autoscaler's `ToBeDeletedByClusterAutoscaler` taint), so that load balancers that probe it drain the
//! node first; `/livez` ignores the node (a liveness probe must not restart a healthy proxy on a draining
//! node).

use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::http::Response;
use nftkube_metrics as metrics;

/// An answer's label set: its status code.
type Code = [(&'static str, &'static str); 1];

/// Answers given, by code (kubeproxy_proxy_healthz_total{code}, kubeproxy_proxy_livez_total{code}).
pub(crate) static HEALTHZ_ANSWERS: LazyLock<Family<Code, Counter>> = LazyLock::new(Family::default);
/// `/livez` answers, by status code (kube-proxy's `proxy_livez_total`).
pub(crate) static LIVEZ_ANSWERS: LazyLock<Family<Code, Counter>> = LazyLock::new(Family::default);

fn code(healthy: bool) -> Code {
    [("code", if healthy { "200" } else { "503" })]
}

/// Registers the answer counters, both codes present from the start (as kube-proxy shows them).
pub(crate) fn register_metrics(registry: &mut Registry) {
    for (name, help, family) in [
        (
            "kubeproxy_proxy_healthz",
            "Answers of /healthz, by code",
            &HEALTHZ_ANSWERS,
        ),
        (
            "kubeproxy_proxy_livez",
            "Answers of /livez, by code",
            &LIVEZ_ANSWERS,
        ),
    ] {
        for healthy in [true, false] {
            let _ = family.get_or_create(&code(healthy));
        }
        registry.register(name, help, (**family).clone());
    }
}

#[derive(Debug)]
struct State {
    last_updated: Option<SystemTime>,
    oldest_queued: Option<Instant>,
    node_eligible: bool,
    /// Services the kernel refused, with its answer (see `agent::quarantine`), the first few of them.
    rejected: Vec<(String, String)>,
    rejected_total: usize,
}

/// How many refused services a health answer names: enough to act on, bounded whatever the cluster.
const REJECTED_SHOWN: usize = 10;

/// The proxy loop's health, shared with the admin server.
#[derive(Debug)]
pub struct ProxyHealth {
    timeout: Duration,
    state: Mutex<State>,
}

impl ProxyHealth {
    /// `timeout`: how long a requested sync may wait before the proxier counts as unhealthy.
    pub fn new(timeout: Duration) -> Self {
        ProxyHealth {
            timeout,
            state: Mutex::new(State {
                last_updated: None,
                oldest_queued: None,
                node_eligible: true,
                rejected: Vec::new(),
                rejected_total: 0,
            }),
        }
    }

    /// How long a queued sync may wait before the proxier counts as unhealthy.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The services the kernel refuses (left out of the kernel while every other one is programmed): the
    /// answers name them, and stay healthy, since syncs go on.
    pub fn set_rejected(&self, mut rejected: Vec<(String, String)>) {
        let mut state = self.lock();
        state.rejected_total = rejected.len();
        rejected.truncate(REJECTED_SHOWN);
        state.rejected = rejected;
    }

    /// A sync was requested (kube-proxy's `QueuedUpdate`); the oldest pending request counts.
    pub(crate) fn queued(&self) {
        self.queued_at(Instant::now());
        metrics::LAST_QUEUED.mark();
    }

    /// [`Self::queued`] at a given time (tests).
    pub(crate) fn queued_at(&self, now: Instant) {
        let mut s = self.lock();
        if s.oldest_queued.is_none() {
            s.oldest_queued = Some(now);
        }
    }

    /// A sync succeeded (kube-proxy's `Updated`).
    pub(crate) fn updated(&self) {
        let mut s = self.lock();
        s.last_updated = Some(SystemTime::now());
        s.oldest_queued = None;
    }

    /// Sets whether the node may take load balancer traffic (kube-proxy's nodeEligible); `/healthz` fails
    /// while it is false.
    pub(crate) fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = eligible;
    }

    /// See [`Self::set_node_eligible`].
    pub(crate) fn node_eligible(&self) -> bool {
        self.lock().node_eligible
    }

    /// Whether the proxier is healthy at `now` (ignoring the node).
    pub(crate) fn healthy_at(&self, now: Instant) -> bool {
        match self.lock().oldest_queued {
            None => true,
            Some(q) => now.saturating_duration_since(q) < self.timeout,
        }
    }

    /// [`Self::healthy_at`] now.
    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy_at(Instant::now())
    }

    fn body(&self, healthy: bool, node: Option<bool>) -> String {
        let now = SystemTime::now();
        // As kube-proxy: a healthy proxier reports lastUpdated = now (its old clients compare the two).
        let last = if healthy {
            Some(now)
        } else {
            self.lock().last_updated
        };
        let mut v = serde_json::json!({
            "lastUpdated": last.map(rfc3339),
            "currentTime": rfc3339(now),
        });
        if let Some(eligible) = node {
            v["nodeEligible"] = eligible.into();
        }
        let state = self.lock();
        if state.rejected_total > 0 {
            let shown: serde_json::Map<String, serde_json::Value> = state
                .rejected
                .iter()
                .map(|(name, why)| (name.clone(), why.clone().into()))
                .collect();
            v["rejectedServices"] = serde_json::json!({
                "count": state.rejected_total,
                "services": shown,
            });
        }
        v.to_string()
    }

    /// The `/healthz` answer: the proxier's health and the node's eligibility.
    pub fn healthz(&self) -> Response {
        let eligible = self.node_eligible();
        let healthy = self.is_healthy() && eligible;
        HEALTHZ_ANSWERS.get_or_create(&code(healthy)).inc();
        json(healthy, self.body(healthy, Some(eligible)))
    }

    /// The `/livez` answer: the proxier's health only.
    pub(crate) fn livez(&self) -> Response {
        let healthy = self.is_healthy();
        LIVEZ_ANSWERS.get_or_create(&code(healthy)).inc();
        json(healthy, self.body(healthy, None))
    }
}

fn json(healthy: bool, body: String) -> Response {
    Response::new(if healthy { 200 } else { 503 }, "application/json", body)
        .header("X-Content-Type-Options", "nosniff")
}

/// RFC 3339 rendering of a system time.
pub fn rfc3339(t: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t)
        .map(|ts| ts.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_until_a_queued_sync_waits_past_the_timeout() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let t0 = Instant::now();
        // Starting up: nothing queued, healthy.
        assert!(h.healthy_at(t0 + Duration::from_secs(3600)));
        h.queued_at(t0);
        assert!(h.healthy_at(t0 + Duration::from_secs(59)));
        // A later request does not restart the clock: the oldest one counts.
        h.queued_at(t0 + Duration::from_secs(30));
        assert!(!h.healthy_at(t0 + Duration::from_secs(60)));
        h.updated();
        assert!(h.healthy_at(t0 + Duration::from_secs(120)));
    }

    #[test]
    fn answers_and_node_eligibility() {
        let h = ProxyHealth::new(Duration::from_secs(60));
        let r = h.healthz();
        assert_eq!(r.status, 200);
        assert_eq!(r.content_type, "application/json");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["nodeEligible"], true);
        assert_eq!(v["lastUpdated"], v["currentTime"]);
        assert!(v["currentTime"].as_str().unwrap().ends_with('Z'));
        // A draining node: healthz says 503, livez stays 200.
        h.set_node_eligible(false);
        assert_eq!(h.healthz().status, 503);
        let live = h.livez();
        assert_eq!(live.status, 200);
        let v: serde_json::Value = serde_json::from_str(&live.body).unwrap();
        assert!(v.get("nodeEligible").is_none());
        // A stalled proxier: both 503, and lastUpdated is the last real sync (none yet).
        h.set_node_eligible(true);
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(61))
            .unwrap_or_else(Instant::now);
        h.queued_at(long_ago);
        if long_ago + Duration::from_secs(61) <= Instant::now() {
            let r = h.livez();
            assert_eq!(r.status, 503);
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert!(v["lastUpdated"].is_null());
        }
    }
}
