//! The proxy agent: its options, the loop that keeps the kernel in sync with the source (`run`), and the
//! one-shot commands (`plan`, `cleanup`, and `cleanup --kube-proxy`: kube_proxy.rs).
#![forbid(unsafe_code)]

mod kube_proxy;
mod node_addresses;
mod portmap_restore;
mod quarantine;
mod run;
pub mod runner;
mod service_cidrs;
pub mod wake;

pub use kube_proxy::{
    cleanup_kube_proxy, outside_nf_tables, FamilyOutcome, FamilyReport, KubeProxyCleanupError,
};
pub use wake::{Doorbell, Inbox, StopHandle, Wake};

use run::{ProxyLoop, Relays};

use nftkube_admin::{health::ProxyHealth, Admin, AdminOptions, Observer};
use nftkube_config::{Resolved, SourceSpec};
use nftkube_model::{
    About, ClusterState, DetectLocal, NamespacedName, NodePortSpec, Notice, Notices,
    ServicePortName,
};
use nftkube_nft::ir::{Family, TableState};
use nftkube_nft::monitor::{self, Drift};
use nftkube_nft::netlink::NftSocket;
use nftkube_render::{self as render, names::TABLE, Piece, RenderConfig};
use nftkube_source::{apply_event, KubeSource, ManifestSource, ManifestWatcher, ProxySource};
use nftkube_sync::{delete_tables, SyncEngine, SyncError, SyncReport};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Everything the proxy loop needs to know.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// Manifest files or the Kubernetes API.
    pub source: SourceSpec,
    /// The render configuration (node facts refreshed at every full sync).
    pub render: RenderConfig,
    /// Full resync (re-read the kernel, repair drift) at least this often (kube-proxy's `--sync-period`).
    pub sync_period: Duration,
    /// Syncs are at least this far apart, so bursts of changes coalesce (`--min-sync-period`).
    pub min_sync_period: Duration,
    /// How often the manifest directory is checked for changes that inotify did not report (a filesystem
    /// without events; a directory created later is found sooner through its parent's events).
    pub(crate) manifest_fallback: Duration,
    /// `--nodeport-addresses`, re-resolved against the node's addresses at every full sync.
    pub(crate) nodeport: NodePortSpec,
    /// `--bind-address`: a specific one is the node's primary IP of its family (`primary`).
    pub(crate) bind_address: Option<std::net::IpAddr>,
    /// Health, metrics and healthCheckNodePort servers (None: no admin servers).
    pub admin: Option<AdminOptions>,
    /// Periodic checks read the kernel back at least this often even when its generation id is unchanged
    /// (`--full-read-period`; zero: every check reads).
    pub full_read_period: Duration,
    /// Elements per transaction above which a sync is committed in several (`--max-transaction-elements`).
    pub max_transaction_elements: usize,
    /// The conntrack features, probed before the capabilities the probe needs were dropped (None: probed
    /// at the first cleanup).
    pub(crate) conntrack_features: Option<nftkube_conntrack::Features>,
    /// The conntrack features from a probe started before the capabilities were dropped and still running
    /// (used when `conntrack_features` is None).
    pub conntrack_probe: Option<Arc<nftkube_conntrack::PendingFeatures>>,
    /// The userspace relay (localhost NodePorts, userspace mode).
    pub relay: nftkube_relay::RelayOptions,
    /// `--proxy-mode userspace`: services relayed in user space, nf_tables only redirects to the relay.
    pub userspace: bool,
}

impl ProxyOptions {
    /// Options for manifests in `manifests`, with kube-proxy's default periods and no admin servers.
    pub fn new(manifests: PathBuf, render: RenderConfig) -> Self {
        ProxyOptions {
            source: SourceSpec::Manifests(manifests),
            render,
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
            manifest_fallback: Duration::from_secs(30),
            nodeport: NodePortSpec::default(),
            bind_address: None,
            admin: None,
            max_transaction_elements: nftkube_sync::chunk::MAX_ELEMENTS_PER_TRANSACTION,
            full_read_period: run::FULL_READ_INTERVAL,
            conntrack_features: None,
            conntrack_probe: None,
            relay: Default::default(),
            userspace: false,
        }
    }

    /// `nftkube proxy`'s options: config file, flags and defaults resolved, `render` built from them.
    pub fn from_resolved(r: Resolved, mut render: RenderConfig) -> Self {
        render.local_detector = r.detect_local;
        if render.local_detector == DetectLocal::NodeCidr {
            // The local ranges come from the Node object: nothing is programmed before they are known.
            render.cluster_cidrs = Vec::new();
        }
        ProxyOptions {
            source: r.source,
            render,
            sync_period: r.sync_period.max(Duration::from_millis(100)),
            min_sync_period: r.min_sync_period,
            // A changed file that inotify did not report is read within a sync period.
            manifest_fallback: r.sync_period.max(Duration::from_millis(100)),
            nodeport: r.nodeport,
            bind_address: r.bind_address,
            admin: Some(r.admin),
            max_transaction_elements: nftkube_sync::chunk::MAX_ELEMENTS_PER_TRANSACTION,
            full_read_period: run::FULL_READ_INTERVAL,
            conntrack_features: None,
            conntrack_probe: None,
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

/// Opens the configured source on threads of its own (the API source builds its client here: a bad
/// kubeconfig fails now); it rings `bell` when events are waiting.
fn open_source(opts: &ProxyOptions, bell: &Doorbell) -> anyhow::Result<ProxySource> {
    let notify = bell.notifier(Wake::Source);
    Ok(match &opts.source {
        SourceSpec::Manifests(dir) => ProxySource::Manifests(ManifestWatcher::start(
            dir.clone(),
            opts.manifest_fallback,
            notify,
        )?),
        SourceSpec::Kube(k) => ProxySource::Kube(KubeSource::start_notifying(k.clone(), notify)?),
    })
}

/// Runs until `inbox`'s stop handle is used. Rules stay in place when it returns, as kube-proxy's do.
///
/// Nothing is programmed before the source has delivered a complete snapshot (`Event::Synced`): an API
/// that cannot be reached at startup leaves whatever an earlier run programmed untouched.
pub fn run_proxy(opts: &ProxyOptions, inbox: Inbox) -> anyhow::Result<()> {
    // Before any listener or socket: every mode (nftables, userspace, with or without the relay) serves
    // connections. Not fatal: the agent works within the soft limit, only with fewer connections.
    match nftkube_process::raise_open_files_limit() {
        Ok(limit) => tracing::info!(limit, "open-files limit"),
        Err(e) => tracing::warn!("{e}"),
    }
    let bell = inbox.doorbell();
    let source = open_source(opts, &bell)?;
    let notices = match &source {
        ProxySource::Kube(k) => k.notices(),
        _ => Notices::none(),
    };
    // kube-proxy's first event on its Node.
    notices.send(Notice {
        about: About::Node,
        warning: false,
        reason: "Starting",
        action: "StartKubeProxy",
        note: String::new(),
    });
    let socket = NftSocket::open()
        .map_err(|e| anyhow::anyhow!("opening the nf_tables netlink socket: {e}"))?;
    let mut engine = SyncEngine::new(socket);
    engine.set_max_transaction_elements(opts.max_transaction_elements);
    // Stopped and joined when dropped, whichever way this function returns.
    let monitor = start_monitor(&mut engine, bell.notifier(Wake::Drift))?;
    // The CNI portmap plugin's tables, back after a firewall reload; stopped when dropped.
    let _portmap = portmap_restore::PortmapRestore::start()?;
    // NodePorts on loopback, when asked for, through the relay (after each sync).
    let localhost = nftkube_relay::LocalhostNodePorts::start(&opts.nodeport.cidrs(), &opts.relay)?;
    // Userspace mode: the relay serves the services, nf_tables only redirects to it.
    let userspace = match opts.userspace {
        true => Some(nftkube_relay::UserspaceProxy::start(&opts.relay)?),
        false => None,
    };
    // Clean what the renderer programs: ClusterIPs, external IPs, LoadBalancer IPs and NodePorts (on any node
    // address: a stale entry to a NodePort is stale whichever address it came in on).
    let mut cleaner = nftkube_conntrack::Cleaner::with_options(nftkube_conntrack::CleanerOptions {
        kinds: nftkube_conntrack::FrontendKinds::ALL,
        ..Default::default()
    });
    if let Some(f) = opts.conntrack_features {
        cleaner.set_features(f);
    } else if let Some(pending) = &opts.conntrack_probe {
        cleaner.set_pending_features(pending.clone());
    }
    // Its thread inherits this one's network namespace, whose conntrack table it cleans.
    let conntrack = nftkube_conntrack::CleanupQueue::start(cleaner)?;
    // kube-proxy's health timeout: twice the sync period.
    let health = Arc::new(ProxyHealth::new(opts.sync_period * 2));
    let admin = match &opts.admin {
        Some(a) => Some(Admin::start(
            a,
            health.clone(),
            conntrack.metrics(),
            notices.clone(),
            if opts.userspace {
                "userspace"
            } else {
                "nftables"
            },
        )?),
        None => None,
    };
    let observer = Observer::new(health, admin, opts.render.node_name.clone());
    let drift = monitor.drift.clone();
    let mut proxy = ProxyLoop::new(opts, source, engine, conntrack, observer, drift);
    proxy.quarantine.notices = notices;
    proxy.relay = Relays {
        localhost,
        userspace,
    };
    let result = proxy.run(&inbox);
    proxy.finish();
    drop(monitor);
    tracing::info!("stopping; rules stay in place");
    result
}

/// Makes a panic on any thread end the process with status 101, as one on the main thread does, after the
/// usual message. Without it a thread that panics dies alone and the agent looks alive without it: a source
/// that no longer delivers changes, a monitor that no longer sees drift, a signal thread that no longer
/// stops it. Exiting leaves the rules in place, as any exit does, and the supervisor's restart reads them
/// back. `nftkube proxy` sets it before starting any thread.
pub fn exit_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::exit(101);
    }));
}

/// The nf_tables event monitor's thread; stopped and joined when dropped.
struct Monitor {
    drift: Arc<Drift>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Watches nf_tables events on a thread of its own, in this thread's network namespace (a new thread
/// inherits it); `notify` is called whenever drift is raised.
fn start_monitor(
    engine: &mut SyncEngine<NftSocket>,
    notify: nftkube_source::Notify,
) -> anyhow::Result<Monitor> {
    let drift = Arc::new(Drift::default());
    let stop = Arc::new(AtomicBool::new(false));
    // The port handle is kept current when the engine's socket is replaced after a broken exchange.
    let watcher = monitor::Watcher::new(engine.backend().port_handle(), TABLE, drift.clone())
        .with_notify(notify);
    // Opened here, in the agent's namespace; read on the monitor's thread.
    let (sock, membership) = match monitor::subscribe() {
        Ok(subscribed) => subscribed,
        Err(e) => {
            // Without CAP_NET_ADMIN, say: the agent keeps retrying its syncs (and logging why they fail),
            // and without events drift is still repaired by the periodic full sync.
            tracing::error!("nf_tables event monitor not started: {e}");
            return Ok(Monitor {
                drift,
                stop,
                thread: None,
            });
        }
    };
    engine.set_event_subscriber(Box::new(watcher.pausable(membership)));
    let st = stop.clone();
    let thread = std::thread::Builder::new()
        .name("nft-monitor".into())
        .spawn(move || {
            if let Err(e) = monitor::watch(sock, watcher, st) {
                // Without events, drift is still repaired by the periodic full sync.
                tracing::error!("nf_tables event monitor stopped: {e}");
            }
        })?;
    Ok(Monitor {
        drift,
        stop,
        thread: Some(thread),
    })
}

/// One sync: full (every service rendered, the kernel read back and repaired) when the engine cannot trust
/// its memory, otherwise partial (only the changed services rendered, nothing read from the kernel). A full
/// sync leaves out the `withheld` services (refused by the kernel, their retry not yet due).
pub(crate) fn sync_once<B: nftkube_nft::Backend>(
    engine: &mut SyncEngine<B>,
    state: &ClusterState,
    changed: &BTreeSet<NamespacedName>,
    withheld: &BTreeSet<NamespacedName>,
    cfg: &RenderConfig,
) -> Result<SyncReport, SyncError> {
    if engine.needs_full_sync() {
        let pieces = render_all(state, withheld, cfg);
        let report = engine.sync_full(render::skeleton(cfg), pieces);
        nftkube_process::release_free_memory();
        return report;
    }
    let mut updates = Vec::new();
    for name in changed {
        let from = updates.len();
        render_service(state, name, cfg, &mut updates);
        let current = updates.len();
        for old in engine.committed_ports(name) {
            if !updates[from..current].iter().any(|(port, _)| *port == old) {
                updates.push((old, Vec::new()));
            }
        }
    }
    engine.sync_partial(updates)
}

/// The pieces of each of one service's ports, appended to `out` in port name order.
fn render_service(
    state: &ClusterState,
    name: &NamespacedName,
    cfg: &RenderConfig,
    out: &mut Vec<(ServicePortName, Vec<Piece>)>,
) {
    let endpoints = state.service_endpoints(name);
    for sp in state.service_ports(name) {
        let pieces = render::service_pieces(sp, endpoints.get(&sp.name), cfg);
        out.push((sp.name.clone(), pieces));
    }
}

/// Every service's pieces, for a full sync. Service by service, so the endpoints of the whole cluster are
/// never materialised at once, and on every CPU: contiguous runs of services rendered apart and joined in
/// name order (below [`SERVICES_PER_THREAD`] services a thread costs more than it saves).
fn render_all(
    state: &ClusterState,
    withheld: &BTreeSet<NamespacedName>,
    cfg: &RenderConfig,
) -> BTreeMap<ServicePortName, Vec<Piece>> {
    let names: Vec<NamespacedName> = state
        .service_names()
        .into_iter()
        .filter(|n| !withheld.contains(n))
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = names.len().div_ceil(threads).max(SERVICES_PER_THREAD);
    let render_run = |run: &[NamespacedName]| {
        let mut pieces = Vec::new();
        for name in run {
            render_service(state, name, cfg, &mut pieces);
        }
        pieces
    };
    if names.len() <= per_thread {
        return render_run(&names).into_iter().collect();
    }
    std::thread::scope(|scope| {
        let runs: Vec<_> = names
            .chunks(per_thread)
            .map(|run| scope.spawn(move || render_run(run)))
            .collect();
        runs.into_iter()
            .flat_map(|run| run.join().expect("a render thread panicked"))
            .collect()
    })
}

/// Below this many services per thread, rendering them on another thread costs more than it saves.
const SERVICES_PER_THREAD: usize = 2000;

/// Removes every table nftkube owns (`nftkube cleanup`), and nothing else.
pub fn cleanup() -> anyhow::Result<usize> {
    let mut socket = NftSocket::open()?;
    let mut tables = vec![
        (Family::Ip, TABLE.to_string()),
        (Family::Ip6, TABLE.to_string()),
    ];
    // Every trace table, a running `nftkube trace --live`'s too (which then loses its rule): a rollback
    // removes everything.
    tables.extend(trace_tables(&mut socket)?);
    let tables: Vec<(Family, &str)> = tables.iter().map(|(f, n)| (*f, n.as_str())).collect();
    Ok(delete_tables(&mut socket, &tables)?)
}

/// Removes the trace tables of `nftkube trace --live` runs that have ended (`nftkube cleanup --traces`), and
/// nothing else: not the proxy's tables, not a running trace's table. A run counts as running when this
/// process's /proc shows it (see `trace::owner`): from another container's PID namespace it does not.
pub fn cleanup_abandoned_traces() -> anyhow::Result<usize> {
    let mut socket = NftSocket::open()?;
    let mut abandoned = Vec::new();
    for (family, name) in trace_tables(&mut socket)? {
        let ended = nftkube_trace::is_abandoned(&name).map_err(|e| {
            anyhow::anyhow!("reading /proc to tell whether the run of {name} still runs: {e}")
        })?;
        if ended {
            abandoned.push((family, name));
        }
    }
    let tables: Vec<(Family, &str)> = abandoned.iter().map(|(f, n)| (*f, n.as_str())).collect();
    Ok(delete_tables(&mut socket, &tables)?)
}

/// Every table of `nftkube trace --live` (by its name's prefix), in both families.
fn trace_tables(socket: &mut NftSocket) -> anyhow::Result<Vec<(Family, String)>> {
    let mut tables = Vec::new();
    for family in [Family::Ip, Family::Ip6] {
        let names = socket.list_tables(family)?;
        let traces = names
            .into_iter()
            .filter(|n| n.starts_with(nftkube_render::names::TRACE_TABLE_PREFIX));
        tables.extend(traces.map(|n| (family, n)));
    }
    Ok(tables)
}

/// Reads the node's addresses (in the calling thread's namespace) once and fills in what the rules need from
/// them: where NodePorts are served (from `--nodeport-addresses`; `primary` without a bind address or a Node
/// object: the addresses of the default route's links) and the node's own IPs.
pub fn refresh_node_addresses(cfg: &mut RenderConfig, nodeport: &NodePortSpec) {
    node_addresses::NodeAddresses::new(nodeport.clone(), None).refresh(cfg);
}

#[cfg(test)]
mod tests {
    use super::*;
    /// Enough services for several render threads: the same pieces as one service after another.
    #[test]
    fn a_full_render_on_every_cpu_gives_the_pieces_of_a_render_service_by_service() {
        use nftkube_model::{IpFamily, Protocol, ServicePort, SliceEndpoint, SliceInfo, SlicePort};
        let mut state = ClusterState::new();
        let services = 3 * SERVICES_PER_THREAD + 7;
        for i in 0..services {
            let (a, b) = (i / 250, i % 250);
            let name = ServicePortName {
                service: NamespacedName::new("ns", format!("svc{i}")),
                port: "http".into(),
                protocol: Protocol::Tcp,
            };
            let ip = format!("10.96.{a}.{b}").parse().unwrap();
            state.apply_service(
                name.service.clone(),
                vec![ServicePort::cluster_ip(name, vec![ip], 80)],
            );
            state.apply_slice(SliceInfo {
                namespace: "ns".into(),
                name: format!("svc{i}-x").into(),
                service: format!("svc{i}").into(),
                address_type: IpFamily::V4,
                ports: vec![SlicePort {
                    name: "http".into(),
                    port: 8080,
                    protocol: Protocol::Tcp,
                }],
                endpoints: (1..=2)
                    .map(|e| {
                        SliceEndpoint::new(
                            format!("10.{e}.{a}.{b}").parse().unwrap(),
                            true,
                            true,
                            false,
                        )
                    })
                    .collect(),
            });
        }
        let cfg = RenderConfig::default();
        let mut one_by_one = Vec::new();
        for name in state.service_names() {
            render_service(&state, &name, &cfg, &mut one_by_one);
        }
        assert_eq!(one_by_one.len(), services);
        let one_by_one: BTreeMap<_, _> = one_by_one.into_iter().collect();
        assert_eq!(render_all(&state, &BTreeSet::new(), &cfg), one_by_one);
    }
}
