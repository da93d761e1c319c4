//! The agent's HTTP side: `/healthz` and `/livez` (kube-proxy's healthz server, default `0.0.0.0:10256` as
//! kube-proxy's), `/metrics` (kube-proxy's metrics server, default `127.0.0.1:10249`), and the
//! healthCheckNodePort servers of `externalTrafficPolicy: Local` services.
//!
//! Everything runs on one thread with a single-threaded tokio runtime, started from the proxy loop's
//! thread so that it inherits that thread's network namespace (it never changes namespace itself). The
//! proxy loop reports to it through an [`Observer`]: events received, syncs requested and committed.
//!
//! Every listener accepts all connections and applies [`http::Limits`] after accepting (per source address,
//! then per listener): no client can keep another from being answered. `/livez` shares the healthz
//! listener even when that is bound to a non-loopback address (`0.0.0.0:10256`): the limits count each
//! source apart, and loopback is a source no pod can use, so pods flooding the node address cannot delay
//! the kubelet's `/livez` on 127.0.0.1 (the kernel test `health_starvation` checks it). A loopback listener
//! of its own would need another port (127.0.0.1:10256 cannot be bound beside 0.0.0.0:10256), which
//! kube-proxy's probes do not expect.
#![forbid(unsafe_code)]

#[cfg(test)]
mod exposition_tests;
pub mod hc;
pub mod health;
pub mod http;
mod no_local;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use hc::{HcConfig, HcDesired, HcService};
use health::ProxyHealth;
use http::{Handler, Request, Response};
use nftkube_conntrack as conntrack;
use nftkube_metrics as metrics;
use nftkube_model::{About, NodePortAddresses, Notice, Notices};
use nftkube_model::{ClusterState, IpFamily, NamespacedName};
use nftkube_source::{Event, NodeInfo};
use nftkube_sync::SyncReport;

/// kube-proxy's default ports.
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// kube-proxy's default `/metrics` port.
pub const DEFAULT_METRICS_PORT: u16 = 10249;

/// Where the admin servers listen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdminOptions {
    /// `/healthz`, `/livez`; None: no server.
    pub healthz: Option<SocketAddr>,
    /// `/metrics`; None: no server.
    pub metrics: Option<SocketAddr>,
    /// A healthz or metrics address that cannot be bound stops startup (else: logged, retried every 5 s).
    pub bind_address_hard_fail: bool,
}

/// The running admin servers. Dropping it stops them.
pub struct Admin {
    hc: watch::Sender<HcConfig>,
    stop: Option<futures::channel::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

type Listener = (
    &'static str,
    http::ServerKind,
    SocketAddr,
    Option<std::net::TcpListener>,
    Handler,
);

impl Admin {
    /// Binds the healthz and metrics addresses now (in the caller's network namespace) and serves them
    /// from a thread of their own. `/proxyMode` answers `proxy_mode` ("nftables", "userspace").
    pub fn start(
        opts: &AdminOptions,
        health: Arc<ProxyHealth>,
        conntrack: Arc<conntrack::Metrics>,
        notices: Notices,
        proxy_mode: &'static str,
    ) -> anyhow::Result<Admin> {
        let h = health.clone();
        let healthz: Handler = Arc::new(move |req: &Request| match req.path.as_str() {
            "/healthz" => h.healthz(),
            "/livez" => h.livez(),
            _ => Response::text(404, "404 page not found\n"),
        });
        let metrics_handler = metrics_handler(metrics_registry(conntrack), proxy_mode);
        let mut listeners: Vec<Listener> = Vec::new();
        for (what, kind, addr, handler) in [
            ("healthz", http::ServerKind::Healthz, opts.healthz, healthz),
            (
                "metrics",
                http::ServerKind::Metrics,
                opts.metrics,
                metrics_handler,
            ),
        ] {
            let Some(addr) = addr else { continue };
            match bind(addr) {
                Ok(l) => {
                    tracing::info!(%addr, "{what} server listening");
                    listeners.push((what, kind, addr, Some(l), handler));
                }
                Err(e) if opts.bind_address_hard_fail => {
                    anyhow::bail!("cannot serve {what} on {addr}: {e} (bindAddressHardFail is set)")
                }
                Err(e) => {
                    tracing::error!(%addr, "cannot serve {what}, retrying every 5 s: {e}");
                    if kind == http::ServerKind::Healthz {
                        notices.send(Notice {
                            about: About::Node,
                            warning: true,
                            reason: "FailedToStartProxierHealthcheck",
                            action: "StartKubeProxy",
                            note: format!("Failed to start proxier healthz on {addr}: {e}"),
                        });
                    }
                    listeners.push((what, kind, addr, None, handler));
                }
            }
        }
        let (hc_tx, hc_rx) = watch::channel(HcConfig::default());
        let (stop_tx, stop_rx) = futures::channel::oneshot::channel::<()>();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("admin".into())
            .spawn(move || {
                rt.block_on(async move {
                    for (what, kind, addr, listener, handler) in listeners {
                        tokio::spawn(serve_or_retry(what, kind, addr, listener, handler));
                    }
                    tokio::spawn(hc::run(hc_rx, health, notices));
                    let _ = stop_rx.await;
                });
            })?;
        Ok(Admin {
            hc: hc_tx,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Sets the healthCheckNodePort servers to run.
    pub(crate) fn set_health_checks(&self, desired: HcDesired) {
        self.hc
            .send_if_modified(|cur| replace(&mut cur.ports, desired));
    }

    /// Sets the addresses the healthCheckNodePort servers listen on: the NodePort addresses.
    pub(crate) fn set_health_check_addresses(&self, addresses: &NodePortAddresses) {
        self.hc
            .send_if_modified(|cur| replace(&mut cur.addresses, addresses.clone()));
    }
}

/// Stores `new` in `cur`; whether that changed it.
fn replace<T: PartialEq>(cur: &mut T, new: T) -> bool {
    if *cur == new {
        return false;
    }
    *cur = new;
    true
}

impl Drop for Admin {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

async fn serve_or_retry(
    what: &'static str,
    kind: http::ServerKind,
    addr: SocketAddr,
    mut listener: Option<std::net::TcpListener>,
    handler: Handler,
) {
    loop {
        if let Some(l) = listener.take() {
            match tokio::net::TcpListener::from_std(l) {
                Ok(l) => return http::serve(l, handler, kind).await,
                Err(e) => tracing::error!(%addr, "cannot serve {what}: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        match bind(addr) {
            Ok(l) => {
                tracing::info!(%addr, "{what} server listening");
                listener = Some(l);
            }
            Err(e) => tracing::debug!(%addr, "still cannot serve {what}: {e}"),
        }
    }
}

/// The metrics server's answers: `/metrics` in the format the scraper's `Accept` header asks for (the
/// classic text format unless it names OpenMetrics), kube-proxy's `/healthz` and `/proxyMode` of that port.
fn metrics_handler(registry: Registry, proxy_mode: &'static str) -> Handler {
    Arc::new(move |req: &Request| match req.path.as_str() {
        "/metrics" => {
            let format = metrics::Format::negotiate(req.accept.as_deref());
            Response::new(
                200,
                format.content_type(),
                metrics::render(&registry, format),
            )
        }
        "/healthz" => Response::text(200, "ok"),
        "/proxyMode" => Response::text(200, proxy_mode),
        _ => Response::text(404, "404 page not found\n"),
    })
}

/// Everything `/metrics` shows: the proxy's metrics, health answers, conntrack cleanup, API watch errors.
pub fn metrics_registry(ct: Arc<conntrack::Metrics>) -> Registry {
    let mut registry = metrics::registry();
    health::register_metrics(&mut registry);
    http::register_metrics(&mut registry);
    registry.register_collector(Box::new(Counts { ct }));
    registry
}

/// The exposition of `registry` (OpenMetrics text).
#[cfg(test)]
pub(crate) fn render_metrics(registry: &Registry) -> String {
    metrics::render(registry, metrics::Format::OpenMetrics)
}

/// Counts other parts keep as plain atomics (conntrack cleanups, API watch errors), read at each scrape.
#[derive(Debug)]
struct Counts {
    ct: Arc<conntrack::Metrics>,
}

impl Collector for Counts {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let s = self.ct.snapshot();
        let mut deleted = encoder.encode_descriptor(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Stale conntrack entries deleted after syncs, by the family of the flow",
            None,
            MetricType::Counter,
        )?;
        for (family, v) in [
            ("IPv4", s.entries_deleted_v4),
            ("IPv6", s.entries_deleted_v6),
        ] {
            ConstCounter::new(v).encode(deleted.encode_family(&[("ip_family", family)])?)?;
        }
        // prometheus-client appends `_total` to counter names.
        for (name, help, v) in [
            (
                "nftkube_conntrack_cleanups",
                "Conntrack cleanups run after syncs",
                s.cleanups,
            ),
            (
                "nftkube_conntrack_cleanup_failures",
                "Conntrack cleanups that failed",
                s.cleanup_failures,
            ),
            (
                "nftkube_conntrack_entries_scanned",
                "Conntrack entries dumped and examined",
                s.entries_scanned,
            ),
            (
                "nftkube_conntrack_delete_errors",
                "Conntrack deletes that failed for another reason than the entry being gone",
                s.delete_errors,
            ),
        ] {
            let counter = ConstCounter::new(v);
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        let seconds = ConstCounter::new(s.duration_us_total as f64 / 1e6);
        seconds.encode(encoder.encode_descriptor(
            "nftkube_conntrack_cleanup_duration_seconds",
            "Time spent in conntrack cleanups",
            None,
            seconds.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "nftkube_api_watch_errors",
            "Kubernetes API list/watch errors, by resource",
            None,
            MetricType::Counter,
        )?;
        for (i, kind) in ["Service", "EndpointSlice", "Node", "ServiceCIDR"]
            .iter()
            .enumerate()
        {
            let errors = nftkube_source::kube::WATCH_ERRORS[i].load(Ordering::Relaxed);
            ConstCounter::new(errors).encode(family.encode_family(&[("resource", *kind)])?)?;
        }
        Ok(())
    }
}

/// The families a service is programmed in: those of its cluster IPs (a dual-stack kube-proxy observes a
/// slice's programming latency in the proxier of the slice's family, and a service's slices of a family
/// are programmed only where it has a cluster IP of that family). A service gone from the model by the
/// time of the sync was programmed out of both.
fn service_families(state: &ClusterState, name: &NamespacedName) -> BTreeSet<metrics::IpFamily> {
    let families: BTreeSet<_> = state
        .service_ports(name)
        .iter()
        .flat_map(|p| p.cluster_ips.iter())
        .map(|ip| match IpFamily::of(ip) {
            IpFamily::V4 => metrics::IpFamily::V4,
            IpFamily::V6 => metrics::IpFamily::V6,
        })
        .collect();
    match families.is_empty() {
        true => metrics::IpFamily::ALL.into_iter().collect(),
        false => families,
    }
}

/// Trigger times kept while waiting for a successful sync.
const MAX_TRIGGERS: usize = 100_000;

/// What the proxy loop reports: it keeps health, metrics and the health check servers current.
pub struct Observer {
    /// The proxier's health, shared with `/healthz` and `/livez`.
    pub health: Arc<ProxyHealth>,
    admin: Option<Admin>,
    node_name: String,
    /// Trigger times of slice changes not yet programmed, with their service.
    triggers: Vec<(NamespacedName, SystemTime)>,
    /// Services that need a health check server: port and local endpoints.
    health_checks: BTreeMap<NamespacedName, (u16, usize)>,
    /// This node's object, when the source reports it.
    pub node: Option<NodeInfo>,
    /// Service ports with a Local policy and no local endpoint.
    no_local: no_local::NoLocalEndpoints,
}

impl Observer {
    /// An observer reporting to `health` and, when given, the admin servers' state.
    pub fn new(health: Arc<ProxyHealth>, admin: Option<Admin>, node_name: String) -> Self {
        Observer {
            health,
            admin,
            node_name,
            triggers: Vec::new(),
            health_checks: BTreeMap::new(),
            node: None,
            no_local: no_local::NoLocalEndpoints::default(),
        }
    }

    /// An event from the source, before it is applied to the store.
    pub fn on_event(&mut self, ev: &Event) {
        let bump = |total: &metrics::CounterU64, pending: &metrics::GaugeU64| {
            total.inc();
            pending.inc();
        };
        match ev {
            Event::ServiceApplied { .. } | Event::ServiceDeleted(_) => bump(
                &metrics::SERVICE_CHANGES_TOTAL,
                &metrics::SERVICE_CHANGES_PENDING,
            ),
            Event::SliceApplied(_) | Event::SliceDeleted { .. } => bump(
                &metrics::ENDPOINT_CHANGES_TOTAL,
                &metrics::ENDPOINT_CHANGES_PENDING,
            ),
            // Bounded: while syncs keep failing, the oldest trigger times are the ones that matter.
            Event::EndpointsChangeTriggered { service, at }
                if self.triggers.len() < MAX_TRIGGERS =>
            {
                self.triggers.push((service.clone(), *at))
            }
            Event::EndpointsChangeTriggered { .. } => {}
            Event::NodeApplied(n) => {
                if n.deleting == self.health.node_eligible() {
                    tracing::info!(
                        node = n.name,
                        deleting = n.deleting,
                        "node eligibility changed"
                    );
                }
                self.health.set_node_eligible(!n.deleting);
                self.node = Some(n.clone());
            }
            Event::NodeDeleted => {
                tracing::warn!("this node's object was deleted");
                self.health.set_node_eligible(false);
            }
            Event::Synced | Event::ServiceCidrs(_) => {}
        }
    }

    /// A sync is due (a change arrived, a periodic resync fell due, someone changed our tables).
    pub fn sync_requested(&self) {
        self.health.queued();
    }

    /// A periodic check found the kernel still holding what the last sync committed: as healthy and as
    /// fresh as a sync (the last-sync timestamp moves, as kube-proxy's periodic sync moves it).
    pub fn kernel_verified(&self) {
        self.health.updated();
        metrics::record_kernel_verified();
    }

    /// A sync starts: the changes received so far are in it.
    pub fn sync_started(&self) {
        metrics::SERVICE_CHANGES_PENDING.set(0);
        metrics::ENDPOINT_CHANGES_PENDING.set(0);
    }

    /// A full sync committed with these NodePort addresses: the health check servers listen there.
    pub fn nodeport_addresses(&self, addresses: &NodePortAddresses) {
        if let Some(admin) = &self.admin {
            admin.set_health_check_addresses(addresses);
        }
    }

    /// A sync committed: health, programming latency, health check servers.
    pub fn sync_succeeded(
        &mut self,
        report: &SyncReport,
        changed: &BTreeSet<NamespacedName>,
        state: &ClusterState,
    ) {
        self.health.updated();
        metrics::OBJECT_CHANGES_TOTAL.inc_by(report.changes as u64);
        metrics::NETLINK_BYTES_TOTAL.inc_by(report.bytes as u64);
        metrics::SERVICE_PORTS.set(state.service_map().len() as u64);
        metrics::REFUSED_CLAIMS.set(report.refused_claims as u64);
        let now = SystemTime::now();
        for (service, t) in self.triggers.drain(..) {
            let latency = now.duration_since(t).unwrap_or_default();
            for family in service_families(state, &service) {
                metrics::NETWORK_PROGRAMMING.observe_in(family, latency);
            }
        }
        let names: Vec<NamespacedName> = if report.full {
            let mut all: BTreeSet<NamespacedName> = state.service_names();
            all.extend(self.health_checks.keys().cloned());
            all.extend(self.no_local.services().cloned());
            all.into_iter().collect()
        } else {
            changed.iter().cloned().collect()
        };
        let mut modified = false;
        for name in names {
            self.no_local.recount(state, &name, &self.node_name);
            let new = hc::health_check_of(state, &name, &self.node_name);
            let old = match new {
                Some(v) => self.health_checks.insert(name, v),
                None => self.health_checks.remove(&name),
            };
            modified |= old != new;
        }
        self.no_local.publish();
        if modified {
            if let Some(admin) = &self.admin {
                admin.set_health_checks(self.desired_health_checks());
            }
        }
    }

    /// The health check servers the model asks for, by port (one port claimed twice: the first service
    /// in name order keeps it, the other is logged).
    pub(crate) fn desired_health_checks(&self) -> HcDesired {
        let mut out = HcDesired::new();
        for (name, (port, local)) in &self.health_checks {
            if let Some(other) = out.get(port) {
                tracing::warn!(port, service = %name, owner = %other.service, "healthCheckNodePort already used by another service");
                continue;
            }
            out.insert(
                *port,
                HcService {
                    service: name.clone(),
                    local_endpoints: *local,
                },
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_page_has_kube_proxy_and_nftkube_names() {
        let text = render_metrics(&metrics_registry(Arc::default()));
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
            "kubeproxy_network_programming_duration_seconds_count",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
            "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"}",
            "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv6\"}",
            "kubeproxy_proxy_healthz_total{code=\"200\"}",
            "kubeproxy_proxy_healthz_total{code=\"503\"}",
            "kubeproxy_proxy_livez_total{code=\"200\"}",
            "kubeproxy_proxy_livez_total{code=\"503\"}",
            "nftkube_conntrack_cleanups_total",
            "nftkube_conntrack_cleanup_failures_total",
            "nftkube_conntrack_entries_scanned_total",
            "nftkube_conntrack_delete_errors_total",
            "nftkube_conntrack_cleanup_duration_seconds_total",
            "nftkube_sync_netlink_bytes_total",
            "nftkube_service_ports",
            "nftkube_pending_service_changes",
            "nftkube_refused_frontend_claims",
            "nftkube_quarantined_service_ports",
            "nftkube_kernel_rejected_service_ports_total",
            "nftkube_endpoints_over_cap_total",
            "nftkube_repairs_total",
            "nftkube_sync_object_changes_total",
            "nftkube_api_watch_errors_total{resource=\"Service\"}",
            "nftkube_api_watch_errors_total{resource=\"EndpointSlice\"}",
            "nftkube_api_watch_errors_total{resource=\"Node\"}",
            "nftkube_admin_connections_refused_total{listener=\"healthz\",reason=\"per_source_limit\"}",
            "nftkube_admin_connections_refused_total{listener=\"health_check\",reason=\"evicted\"}",
        ] {
            assert!(
                text.lines().any(|l| l
                    .strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']))),
                "{name} missing:\n{text}"
            );
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        // Every sample line parses as `name{labels} value`.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = line.rsplit_once(' ').unwrap();
            assert!(v.parse::<f64>().is_ok(), "{line}");
        }
    }

    #[test]
    fn observer_tracks_changes_triggers_and_node() {
        let health = Arc::new(ProxyHealth::new(Duration::from_secs(60)));
        let mut o = Observer::new(health.clone(), None, "node-1".into());
        let before = metrics::ENDPOINT_CHANGES_TOTAL.get();
        o.on_event(&Event::SliceDeleted {
            namespace: "a".into(),
            name: "b".into(),
        });
        assert!(metrics::ENDPOINT_CHANGES_TOTAL.get() > before);
        o.on_event(&Event::EndpointsChangeTriggered {
            service: NamespacedName::new("a", "b"),
            at: SystemTime::now() - Duration::from_millis(300),
        });
        o.on_event(&Event::NodeApplied(NodeInfo {
            name: "node-1".into(),
            deleting: true,
            ..NodeInfo::default()
        }));
        assert!(!health.node_eligible());
        // The node object is deleted: not eligible (a 503 on /healthz), where kube-proxy would exit.
        o.on_event(&Event::NodeApplied(NodeInfo {
            name: "node-1".into(),
            ..NodeInfo::default()
        }));
        assert!(health.node_eligible());
        o.on_event(&Event::NodeDeleted);
        assert!(!health.node_eligible());
        // A verified kernel refreshes the last-sync timestamp on an idle node.
        let before = metrics::last_sync_seconds();
        std::thread::sleep(Duration::from_millis(20));
        o.kernel_verified();
        assert!(metrics::last_sync_seconds() > before);
        let programmed = || {
            let text = render_metrics(&metrics::registry());
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(
                        "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv6\"} ",
                    )
                })
                .map(|v| v.parse::<u64>().unwrap())
                .unwrap()
        };
        let count = programmed();
        let report = SyncReport {
            full: true,
            changes: 3,
            bytes: 100,
            commit_time: Duration::ZERO,
            transactions: 1,
            longest_transaction: Duration::ZERO,
            elapsed: Duration::from_millis(1),
            refused_claims: 0,
            rejected: Vec::new(),
        };
        o.sync_succeeded(&report, &BTreeSet::new(), &ClusterState::new());
        assert!(programmed() > count);
        assert!(o.triggers.is_empty());
    }
}
