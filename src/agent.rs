//! The proxy loop: watch the source, keep the kernel in sync, retry failures, resync periodically.

use crate::metrics;
use crate::model::{Cidr, ClusterState, NamespacedName};
use crate::nft::ir::{Family, TableState};
use crate::nft::monitor::{self, Drift};
use crate::nft::netlink::NftSocket;
use crate::render::{self, names::TABLE, RenderConfig};
use crate::source::{apply_event, ManifestSource};
use crate::sync::{delete_tables, SyncEngine, SyncError, SyncReport};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything the proxy loop needs to know.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    pub manifests: PathBuf,
    pub render: RenderConfig,
    /// Full resync (re-read the kernel, repair drift) at least this often (kube-proxy's `--sync-period`).
    pub sync_period: Duration,
    /// Syncs are at least this far apart, so bursts of changes coalesce (`--min-sync-period`).
    pub min_sync_period: Duration,
    /// How often the manifest directory is checked for changes.
    pub poll_interval: Duration,
    /// `--nodeport-addresses`, re-resolved against the node's addresses at every full sync.
    pub nodeport_cidrs: Vec<Cidr>,
}

impl ProxyOptions {
    pub fn new(manifests: PathBuf, render: RenderConfig) -> Self {
        ProxyOptions {
            manifests,
            render,
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
            poll_interval: Duration::from_millis(500),
            nodeport_cidrs: Vec::new(),
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

/// Runs until `stop` is set. Rules stay in place when it returns, as kube-proxy's do.
pub fn run_proxy(opts: &ProxyOptions, stop: &AtomicBool) -> anyhow::Result<()> {
    let mut source = ManifestSource::new(opts.manifests.clone());
    let mut state = ClusterState::new();
    let (events, _errors) = source.initial(); // errors are logged by the source
    for ev in events {
        apply_event(&mut state, ev);
    }
    let socket = NftSocket::open()
        .map_err(|e| anyhow::anyhow!("opening the nf_tables netlink socket: {e}"))?;
    let mut engine = SyncEngine::new(socket);
    let monitor = start_monitor(&mut engine)?;
    // Clean what the renderer programs: ClusterIPs, external IPs, LoadBalancer IPs and NodePorts (on any node
    // address: a stale entry to a NodePort is stale whichever address it came in on).
    let mut conntrack = crate::conntrack::Cleaner::with_options(crate::conntrack::CleanerOptions {
        kinds: crate::conntrack::FrontendKinds {
            external_ips: true,
            load_balancer_ips: true,
            node_ports: true,
        },
        ..Default::default()
    });

    let mut cfg = opts.render.clone();
    let mut dirty = true;
    let mut last_sync: Option<Instant> = None;
    let mut last_full = Instant::now();
    let mut backoff = Duration::from_secs(1);
    let mut retry_at: Option<Instant> = None;
    let mut last_poll = Instant::now();

    while !stop.load(Ordering::SeqCst) {
        if last_poll.elapsed() >= opts.poll_interval {
            last_poll = Instant::now();
            let (events, _errors) = source.poll();
            if !events.is_empty() {
                dirty = true;
                for ev in events {
                    apply_event(&mut state, ev);
                }
            }
        }
        if last_full.elapsed() >= opts.sync_period {
            engine.force_full_sync();
            dirty = true;
        }
        if monitor.drift.detected.swap(false, Ordering::SeqCst) {
            // Someone changed our tables: read them back and repair now, bypassing the debounce.
            engine.force_full_sync();
            metrics::REPAIRS.fetch_add(1, Ordering::Relaxed);
            dirty = true;
            last_sync = None;
        }
        let debounced = last_sync.is_none_or(|t| t.elapsed() >= opts.min_sync_period);
        let retry_due = retry_at.is_none_or(|t| Instant::now() >= t);
        if dirty && debounced && retry_due {
            let changes = state.take_changes();
            last_sync = Some(Instant::now());
            if engine.needs_full_sync() {
                // Node addresses can change; full syncs pick that up for NodePorts.
                cfg.nodeport_addresses = nodeport_addresses(&opts.nodeport_cidrs);
                cfg.node_ips = crate::node::addresses()
                    .map(|a| a.into_iter().map(|a| a.ip).collect())
                    .unwrap_or_default();
            }
            match sync_once(&mut engine, &state, &changes.changed_services, &cfg) {
                Ok(report) => {
                    // The rules are in: delete the UDP / SCTP flows this round (and failed ones) made stale.
                    conntrack.after_sync(&changes, &state);
                    if report.full {
                        last_full = Instant::now();
                    }
                    metrics::record_sync(report.full, report.elapsed);
                    metrics::PENDING_CHANGES.store(0, Ordering::Relaxed);
                    tracing::info!(
                        full = report.full,
                        changes = report.changes,
                        bytes = report.bytes,
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
    let own_pid = engine.backend().socket().port_id()?;
    let drift = Arc::new(Drift::default());
    let stop = Arc::new(AtomicBool::new(false));
    let (d, st) = (drift.clone(), stop.clone());
    let thread = std::thread::Builder::new()
        .name("nft-monitor".into())
        .spawn(move || {
            if let Err(e) = monitor::watch(own_pid, TABLE, d.clone(), st) {
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

/// Where NodePorts are served, from `--nodeport-addresses` and the addresses of the calling thread's
/// namespace. If the addresses cannot be read, NodePorts are not served (and that is logged).
pub fn nodeport_addresses(cidrs: &[Cidr]) -> crate::node::NodePortAddresses {
    let read = crate::node::addresses().and_then(|a| Ok((a, crate::node::default_route_links()?)));
    match read {
        Ok((addresses, primary)) => {
            crate::node::resolve_nodeport_addresses(cidrs, &addresses, &primary)
        }
        Err(e) => {
            tracing::error!("reading the node's addresses: {e}; NodePorts are not served");
            crate::node::NodePortAddresses::None
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
