//! The proxy loop: watch the source, keep the kernel in sync, retry failures, resync periodically.

use crate::admin::{health::ProxyHealth, Admin, AdminOptions, Observer};
use crate::config::{DetectLocal, Resolved, SourceSpec};
use crate::metrics;
use crate::model::{Cidr, ClusterState, NamespacedName};
use crate::nft::ir::{Family, TableState};
use crate::nft::monitor::{self, Drift};
use crate::nft::netlink::NftSocket;
use crate::render::{self, names::TABLE, RenderConfig};
use crate::source::{apply_event, Event, KubeSource, ManifestSource, ProxySource};
use crate::sync::{delete_tables, SyncEngine, SyncError, SyncReport};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything the proxy loop needs to know.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Manifest files or the Kubernetes API.
    pub source: SourceSpec,
    pub render: RenderConfig,
    /// Full resync (re-read the kernel, repair drift) at least this often (kube-proxy's `--sync-period`).
    pub sync_period: Duration,
    /// Syncs are at least this far apart, so bursts of changes coalesce (`--min-sync-period`).
    pub min_sync_period: Duration,
    /// How often the manifest directory is checked for changes.
    pub poll_interval: Duration,
    /// `--nodeport-addresses`, re-resolved against the node's addresses at every full sync.
    pub nodeport_cidrs: Vec<Cidr>,
    /// Health, metrics and healthCheckNodePort servers (None: no admin servers).
    pub admin: Option<AdminOptions>,
    /// NodeCIDR: `render.cluster_cidrs` come from this node's podCIDRs (API source), and nothing is
    /// programmed before they are known. The other modes are in `render.local_detector`.
    pub detect_local: DetectLocal,
    /// Elements per transaction above which a sync is committed in several (`--max-transaction-elements`).
    pub max_transaction_elements: usize,
    /// The conntrack features, probed before the capabilities the probe needs were dropped (None: probed
    /// at the first cleanup).
    pub conntrack_features: Option<crate::conntrack::Features>,
    /// The userspace relay (localhost NodePorts, userspace mode).
    pub relay: crate::relay::RelayOptions,
    /// `--proxy-mode userspace`: services relayed in user space, nf_tables only redirects to the relay.
    pub userspace: bool,
}

impl ProxyOptions {
    pub fn new(manifests: PathBuf, render: RenderConfig) -> Self {
        ProxyOptions {
            source: SourceSpec::Manifests(manifests),
            render,
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
            poll_interval: Duration::from_millis(500),
            nodeport_cidrs: Vec::new(),
            admin: None,
            detect_local: DetectLocal::ClusterCidr,
            max_transaction_elements: crate::sync::chunk::MAX_ELEMENTS_PER_TRANSACTION,
            conntrack_features: None,
            relay: Default::default(),
            userspace: false,
        }
    }

    /// `nftkube proxy`'s options: config file, flags and defaults resolved, `render` built from them.
    pub fn from_resolved(r: Resolved, mut render: RenderConfig) -> Self {
        if r.detect_local == DetectLocal::NodeCidr {
            // The local ranges come from the Node object.
            render.cluster_cidrs = Vec::new();
        }
        ProxyOptions {
            source: r.source,
            render,
            sync_period: r.sync_period.max(Duration::from_millis(100)),
            min_sync_period: r.min_sync_period,
            poll_interval: Duration::from_millis(500),
            nodeport_cidrs: r.nodeport_cidrs,
            admin: Some(r.admin),
            detect_local: r.detect_local,
            max_transaction_elements: crate::sync::chunk::MAX_ELEMENTS_PER_TRANSACTION,
            conntrack_features: None,
            relay: Default::default(),
            userspace: r.userspace,
        }
    }
}

/// Loads the manifests once and renders the tables, without touching the kernel (`nftkube plan`).
/// Bad documents are reported through `report` and skipped.
pub fn plan(
    manifests: PathBuf,
    cfg: &RenderConfig,
    mut report: impl FnMut(String),
) -> Vec<TableState> {
    let mut source = ManifestSource::new(manifests);
    let (events, errors) = source.initial();
    for e in errors {
        report(e.to_string());
    }
    let mut state = ClusterState::new();
    for ev in events {
        apply_event(&mut state, ev);
    }
    render::render(state.service_map(), &state.endpoints_map(), cfg)
}

/// Opens the configured source (the API source builds its client here: a bad kubeconfig fails now).
fn open_source(spec: &SourceSpec) -> anyhow::Result<ProxySource> {
    Ok(match spec {
        SourceSpec::Manifests(dir) => ProxySource::Manifests(ManifestSource::new(dir.clone())),
        SourceSpec::Kube(k) => ProxySource::Kube(KubeSource::start(k.clone())?),
    })
}

/// Runs until `stop` is set. Rules stay in place when it returns, as kube-proxy's do.
///
/// Nothing is programmed before the source has delivered a complete snapshot (`Event::Synced`): an API
/// that cannot be reached at startup leaves whatever an earlier run programmed untouched.
pub fn run_proxy(opts: &ProxyOptions, stop: &AtomicBool) -> anyhow::Result<()> {
    let mut source = open_source(&opts.source)?;
    let mut state = ClusterState::new();
    let socket = NftSocket::open()
        .map_err(|e| anyhow::anyhow!("opening the nf_tables netlink socket: {e}"))?;
    let mut engine = SyncEngine::new(socket);
    engine.set_max_transaction_elements(opts.max_transaction_elements);
    let monitor = start_monitor(&mut engine)?;
    // NodePorts on loopback, when asked for, through the relay (after each sync).
    let mut localhost = crate::relay::LocalhostNodePorts::start(&opts.nodeport_cidrs, &opts.relay)?;
    // Userspace mode: the relay serves the services, nf_tables only redirects to it.
    let mut userspace = match opts.userspace {
        true => Some(crate::relay::UserspaceProxy::start(&opts.relay)?),
        false => None,
    };
    // Clean what the renderer programs: ClusterIPs, external IPs, LoadBalancer IPs and NodePorts (on any node
    // address: a stale entry to a NodePort is stale whichever address it came in on).
    let frontend_kinds = crate::conntrack::FrontendKinds::ALL;
    let mut conntrack = crate::conntrack::Cleaner::with_options(crate::conntrack::CleanerOptions {
        kinds: frontend_kinds,
        ..Default::default()
    });
    if let Some(f) = opts.conntrack_features {
        conntrack.set_features(f);
    }

    // kube-proxy's health timeout: twice the sync period.
    let health = Arc::new(ProxyHealth::new(opts.sync_period * 2));
    let admin = match &opts.admin {
        Some(a) => Some(Admin::start(a, health.clone(), conntrack.metrics())?),
        None => None,
    };
    let mut observer = Observer::new(health, admin, opts.render.node_name.clone());
    // The API source's channel is cheap to poll; the manifest source stats files.
    let poll_interval = match opts.source {
        SourceSpec::Kube(_) => Duration::ZERO,
        SourceSpec::Manifests(_) => opts.poll_interval,
    };

    let mut cfg = opts.render.clone();
    let mut synced = false;
    let mut waiting_logged = false;
    let mut dirty = true;
    let mut last_sync: Option<Instant> = None;
    let mut last_full = Instant::now();
    let mut backoff = Duration::from_secs(1);
    let mut retry_at: Option<Instant> = None;
    let mut last_poll: Option<Instant> = None;
    // Someone else changed our tables and the full sync that repairs it has not succeeded yet.
    let mut repairing = false;

    while !stop.load(Ordering::SeqCst) {
        if last_poll.is_none_or(|t| t.elapsed() >= poll_interval) {
            last_poll = Some(Instant::now());
            let events = source.poll();
            if !events.is_empty() {
                dirty = true;
                for ev in events {
                    observer.on_event(&ev);
                    if ev == Event::Synced && !synced {
                        synced = true;
                        tracing::info!(
                            services = state.service_map().len(),
                            "source synced: complete snapshot received"
                        );
                    }
                    apply_event(&mut state, ev);
                }
                if synced {
                    observer.sync_requested();
                }
            }
        }
        if opts.render.node_zone.is_none() {
            // Topology hints: this node's zone from its Node object (unless given as a flag).
            let zone = observer.node.as_ref().and_then(|n| n.zone.clone());
            if zone.is_some() && zone != cfg.node_zone {
                tracing::info!(zone = ?zone, "this node's zone, from its Node object");
                cfg.node_zone = zone;
                engine.force_full_sync();
                dirty = true;
            }
        }
        if opts.detect_local == DetectLocal::NodeCidr {
            let node_cidrs = observer.node.as_ref().map(|n| &n.pod_cidrs);
            if let Some(cidrs) = node_cidrs.filter(|c| !c.is_empty()) {
                if cfg.cluster_cidrs.is_empty() {
                    tracing::info!(pod_cidrs = ?cidrs, "local traffic: this node's podCIDRs");
                    cfg.cluster_cidrs = cidrs.clone();
                    engine.force_full_sync();
                    dirty = true;
                } else if *cidrs != cfg.cluster_cidrs {
                    // What kube-proxy does too: the rules were built for the old ranges.
                    anyhow::bail!(
                        "this node's podCIDRs changed from {:?} to {cidrs:?}: exiting to restart with them (the rules stay)",
                        cfg.cluster_cidrs
                    );
                }
            }
        }
        if last_full.elapsed() >= opts.sync_period {
            engine.force_full_sync();
            dirty = true;
            if synced {
                observer.sync_requested();
            }
        }
        if monitor.drift.detected.swap(false, Ordering::SeqCst) {
            // Someone changed our tables: read them back and repair now, bypassing the debounce.
            engine.force_full_sync();
            repairing = true;
            dirty = true;
            last_sync = None;
            if synced {
                observer.sync_requested();
            }
        }
        let ready =
            synced && (opts.detect_local != DetectLocal::NodeCidr || !cfg.cluster_cidrs.is_empty());
        if dirty && !ready && !waiting_logged {
            waiting_logged = true;
            tracing::info!(
                "waiting for the source's first complete snapshot (and, with NodeCIDR, this node's podCIDRs) before programming anything"
            );
        }
        let debounced = last_sync.is_none_or(|t| t.elapsed() >= opts.min_sync_period);
        let retry_due = retry_at.is_none_or(|t| Instant::now() >= t);
        if dirty && ready && debounced && retry_due {
            let changes = state.take_changes();
            last_sync = Some(Instant::now());
            observer.sync_started();
            if engine.needs_full_sync() {
                // Node addresses can change; full syncs pick that up for NodePorts.
                refresh_node_addresses(&mut cfg, &opts.nodeport_cidrs);
            }
            let synced = match &mut userspace {
                Some(u) => u.sync(&mut engine, &state, &changes.changed_services),
                None => sync_once(&mut engine, &state, &changes.changed_services, &cfg),
            };
            match synced {
                Ok(report) => {
                    if report.full {
                        // The health check servers follow the addresses NodePorts are now served on.
                        observer.nodeport_addresses(&cfg.nodeport_addresses);
                    }
                    observer.sync_succeeded(&report, &changes.changed_services, &state);
                    if let Some(l) = &mut localhost {
                        l.sync(&state);
                    }
                    // The rules are in: delete the UDP / SCTP flows this round (and failed ones) made stale.
                    conntrack.after_sync(&changes, &state);
                    if report.full {
                        last_full = Instant::now();
                    }
                    if report.full && report.changes > 0 {
                        // Rules were missing or wrong until now: connections tried meanwhile may have left
                        // entries that would keep a reused source port away from the service.
                        let frontends = crate::conntrack::Frontends::of(
                            &state,
                            frontend_kinds,
                            &cfg.nodeport_addresses,
                            &cfg.node_ips,
                        );
                        conntrack.clear_black_holes(&frontends);
                    }
                    let repair = std::mem::take(&mut repairing);
                    if repair {
                        metrics::REPAIRS.fetch_add(1, Ordering::Relaxed);
                    }
                    metrics::record_sync(report.full, report.elapsed);
                    metrics::PENDING_CHANGES.store(0, Ordering::Relaxed);
                    tracing::info!(
                        full = report.full,
                        changes = report.changes,
                        repair,
                        bytes = report.bytes,
                        transactions = report.transactions,
                        services = state.service_map().len(),
                        changed_services = changes.changed_services.len(),
                        commit_ms = report.commit_time.as_secs_f64() * 1000.0,
                        elapsed_ms = report.elapsed.as_secs_f64() * 1000.0,
                        "sync complete"
                    );
                    // Chains released by this commit are deleted by the next one.
                    dirty = engine.has_pending_cleanup();
                    retry_at = None;
                    backoff = Duration::from_secs(1);
                }
                Err(e) => {
                    conntrack.sync_failed(&changes);
                    metrics::SYNC_FAILURES.fetch_add(1, Ordering::Relaxed);
                    metrics::PENDING_CHANGES
                        .store(changes.changed_services.len() as u64, Ordering::Relaxed);
                    tracing::error!(
                        retry_in_s = backoff.as_secs(),
                        "sync failed, the previous rules stay in place: {e}"
                    );
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    monitor.stop.store(true, Ordering::SeqCst);
    let _ = monitor.thread.join();
    tracing::info!("stopping; rules stay in place");
    Ok(())
}

struct Monitor {
    drift: Arc<Drift>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

/// Watches nf_tables events on a thread of its own, in this thread's network namespace (a new thread
/// inherits it).
fn start_monitor(engine: &mut SyncEngine<NftSocket>) -> anyhow::Result<Monitor> {
    let drift = Arc::new(Drift::default());
    let stop = Arc::new(AtomicBool::new(false));
    // The port handle is kept current when the engine's socket is replaced after a broken exchange.
    let watcher = monitor::Watcher::new(engine.backend().port_handle(), TABLE, drift.clone());
    let st = stop.clone();
    let thread = std::thread::Builder::new()
        .name("nft-monitor".into())
        .spawn(move || {
            if let Err(e) = monitor::watch(watcher, st) {
                // Without events, drift is still repaired by the periodic full sync.
                tracing::error!("nf_tables event monitor stopped: {e}");
            }
        })?;
    Ok(Monitor {
        drift,
        stop,
        thread,
    })
}

/// One sync: full (every service rendered, the kernel read back and repaired) when the engine cannot trust
/// its memory, otherwise partial (only the changed services rendered, nothing read from the kernel).
pub fn sync_once<B: crate::nft::Backend>(
    engine: &mut SyncEngine<B>,
    state: &ClusterState,
    changed: &BTreeSet<NamespacedName>,
    cfg: &RenderConfig,
) -> Result<SyncReport, SyncError> {
    if engine.needs_full_sync() {
        // Service by service, so the endpoints of the whole cluster are never materialised at once.
        let mut pieces = std::collections::BTreeMap::new();
        for name in state.service_names() {
            let endpoints = state.service_endpoints(&name);
            for sp in state.service_ports(&name) {
                pieces.insert(
                    sp.name.clone(),
                    render::service_pieces(sp, endpoints.get(&sp.name), cfg),
                );
            }
        }
        let report = engine.sync_full(render::skeleton(cfg), pieces);
        release_free_memory();
        return report;
    }
    let mut updates = Vec::new();
    for name in changed {
        let endpoints = state.service_endpoints(name);
        let current = state.service_ports(name);
        for sp in &current {
            updates.push((
                sp.name.clone(),
                render::service_pieces(sp, endpoints.get(&sp.name), cfg),
            ));
        }
        for old in engine.committed_ports(name) {
            if !current.iter().any(|sp| sp.name == old) {
                updates.push((old, Vec::new()));
            }
        }
    }
    engine.sync_partial(updates)
}

/// A full sync builds and drops large transient structures; hand the freed pages back to the system so the
/// agent's resident size reflects what it keeps, not its peak.
fn release_free_memory() {
    // SAFETY: malloc_trim only walks glibc's own heap structures; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Removes every table nftkube owns (`nftkube cleanup`), and nothing else.
pub fn cleanup() -> anyhow::Result<usize> {
    let mut socket = NftSocket::open()?;
    Ok(delete_tables(
        &mut socket,
        &[(Family::Ip, TABLE), (Family::Ip6, TABLE)],
    )?)
}

/// Reads the node's addresses (in the calling thread's namespace) once and fills in what the rules need from
/// them: where NodePorts are served (from `--nodeport-addresses`) and the node's own IPs.
pub fn refresh_node_addresses(cfg: &mut RenderConfig, nodeport_cidrs: &[Cidr]) {
    refresh_node_addresses_from(cfg, nodeport_cidrs, crate::node::read);
}

/// `refresh_node_addresses` with the read given, so a test can make it fail.
///
/// A failed read keeps what the last good one gave: a transient rtnetlink error (ENOBUFS while the routing
/// table churns, a dump interrupted by a change) says nothing about the addresses, and withdrawing every
/// NodePort for it would cut live traffic. With no good read yet (the first one, at startup) there is nothing
/// to keep: NodePorts are not served (but with a zero CIDR, which needs no address) until a read succeeds,
/// retried at every full sync (the first sync of `proxy` is one). Either way it is logged with the error.
pub fn refresh_node_addresses_from(
    cfg: &mut RenderConfig,
    nodeport_cidrs: &[Cidr],
    read: impl FnOnce() -> Result<crate::node::NodeView, crate::node::ReadError>,
) {
    match read() {
        Ok(node) => {
            cfg.nodeport_addresses = crate::node::resolve_nodeport_addresses(
                nodeport_cidrs,
                &node.addresses,
                &node.primary_links,
            );
            cfg.node_ips = node.addresses.iter().map(|a| a.ip).collect();
        }
        Err(e) if cfg.nodeport_addresses == crate::node::NodePortAddresses::None => {
            // A zero CIDR needs no address (the kernel's fib tells local ones), so it is served all the same.
            cfg.nodeport_addresses =
                crate::node::resolve_nodeport_addresses(nodeport_cidrs, &[], &[]);
            tracing::warn!(error = %e, nodeport_addresses = ?cfg.nodeport_addresses, "reading the node failed and none of its addresses is known: NodePorts are not served on them until a read succeeds (retried at the next full sync)");
        }
        Err(e) => {
            tracing::warn!(error = %e, nodeport_addresses = ?cfg.nodeport_addresses, "reading the node failed: keeping its last known addresses (read again at the next full sync)");
        }
    }
}

/// Parses a comma-separated list of CIDRs (kube-proxy accepts `--cluster-cidr=a,b` for dual-stack).
pub fn parse_cidrs(s: &str) -> Result<Vec<Cidr>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<Cidr>())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::{NodeAddress, NodePortAddresses, NodeView, ReadError};

    fn node(ip: &str) -> NodeView {
        NodeView {
            addresses: vec![NodeAddress {
                ifindex: 2,
                ip: ip.parse().unwrap(),
            }],
            primary_links: vec![2],
        }
    }

    fn failed() -> Result<NodeView, ReadError> {
        Err(ReadError::Routes(std::io::Error::from_raw_os_error(
            libc::ENOBUFS,
        )))
    }

    fn served_on(ip: &str) -> NodePortAddresses {
        NodePortAddresses::Only(vec![ip.parse().unwrap()])
    }

    #[test]
    fn a_failed_read_keeps_the_last_known_addresses() {
        let mut cfg = RenderConfig::default();
        refresh_node_addresses_from(&mut cfg, &[], || Ok(node("192.168.200.1")));
        assert_eq!(cfg.nodeport_addresses, served_on("192.168.200.1"));
        let before = cfg.clone();
        refresh_node_addresses_from(&mut cfg, &[], failed);
        assert_eq!(cfg, before);
        // The next good read replaces them.
        refresh_node_addresses_from(&mut cfg, &[], || Ok(node("192.168.201.1")));
        assert_eq!(cfg.nodeport_addresses, served_on("192.168.201.1"));
        assert_eq!(
            cfg.node_ips,
            vec!["192.168.201.1".parse::<std::net::IpAddr>().unwrap()]
        );
    }

    #[test]
    fn a_failed_first_read_serves_node_ports_on_no_address_until_a_read_succeeds() {
        let mut cfg = RenderConfig::default();
        refresh_node_addresses_from(&mut cfg, &[], failed);
        assert_eq!(cfg.nodeport_addresses, NodePortAddresses::None);
        assert!(cfg.node_ips.is_empty());
        refresh_node_addresses_from(&mut cfg, &[], || Ok(node("192.168.200.1")));
        assert_eq!(cfg.nodeport_addresses, served_on("192.168.200.1"));
        // Every local address needs none read: the kernel tells them.
        let mut cfg = RenderConfig::default();
        refresh_node_addresses_from(&mut cfg, &["0.0.0.0/0".parse().unwrap()], failed);
        assert_eq!(cfg.nodeport_addresses, NodePortAddresses::AllLocal);
    }
}
