//! The kernel half of the conntrack cleanup: the ctnetlink socket, the probed kernel features, the metrics, and
//! the dumps and deletes themselves. It knows nothing of the model: it is handed a [`StaleFilter`] (or the
//! [`Frontends`] after a repair) and walks the conntrack table of the namespace it runs in.

use super::filter::StaleFilter;
use super::options::{CleanerOptions, CleanupError, CleanupReport};
use super::socket::{probe, start_probe, CtSocket, Features, ProbeError, Probed};
use super::unnated::Frontends;
use super::wire::{family_of, DeleteFilter, DumpFilter, Entry, AF_INET, AF_INET6};
use super::Metrics;
use nftkube_model::Protocol;
use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Stale entries logged one by one (debug level) per cleanup.
const LOGGED_ENTRIES: usize = 16;

/// Probes the kernel's ctnetlink filters in a scratch namespace (needs CAP_SYS_ADMIN), logging what it found;
/// without them (or on failure), per-family dumps.
pub fn probe_features() -> Features {
    let start = Instant::now();
    let probed = probe();
    logged(probed, start.elapsed())
}

fn logged(probed: Result<Features, ProbeError>, elapsed: Duration) -> Features {
    match probed {
        Ok(f) => {
            tracing::info!(
                elapsed_ms = elapsed.as_secs_f64() * 1000.0,
                dump_proto_v4 = f.dump_proto_v4,
                dump_proto_v6 = f.dump_proto_v6,
                dump_addr_v4 = f.dump_addr_v4,
                dump_addr_v6 = f.dump_addr_v6,
                filtered_delete_v4 = f.filtered_delete_v4,
                filtered_delete_v6 = f.filtered_delete_v6,
                "conntrack: kernel features probed"
            );
            f
        }
        Err(e) => {
            tracing::warn!(
                "conntrack: cannot probe kernel filters ({e}); dumping per address family"
            );
            Features::default()
        }
    }
}

/// The feature probe running beside the agent's start-up. `nftkube proxy` starts it before it drops its
/// capabilities: the probe's thread enters its scratch namespace (the one step that needs CAP_SYS_ADMIN),
/// drops its own capabilities (`entered`), and only then does `start` return, so every thread is reduced
/// when the caller drops its own.
///
/// The rest of the probe (about 70 ms, mostly the kernel's dumps) waits for [`Self::release`]: each dump
/// walks the host's whole conntrack hash table inside one system call, where the scheduler cannot take the
/// core back whatever the thread's priority, and at start-up that core is wanted by the source's parallel
/// parse and then by the first sync's parallel render. The agent releases it once its first sync is over
/// (the first conntrack walk, which follows that sync, waits for the probe's ~70 ms).
pub struct PendingFeatures {
    thread: Mutex<Option<JoinHandle<Probed>>>,
    /// Dropped (or sent to) to let the probe start.
    go: Mutex<Option<mpsc::Sender<()>>>,
    features: OnceLock<Features>,
}

impl PendingFeatures {
    /// Starts the probe; returns once its thread has run `entered` in its namespace.
    pub fn start(
        entered: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> Arc<PendingFeatures> {
        let (go, gate) = mpsc::channel::<()>();
        let pending = PendingFeatures {
            thread: Mutex::new(None),
            go: Mutex::new(Some(go)),
            features: OnceLock::new(),
        };
        // Between its dumps' system calls, the probe takes only the CPU the agent leaves idle.
        let entered = move || entered().map(|()| lowest_priority());
        // A message or a dropped sender alike open the gate.
        let gate = move || {
            let _ = gate.recv();
        };
        match start_probe(entered, gate) {
            Ok(thread) => *pending.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread),
            Err(e) => {
                let _ = pending.features.set(logged(Err(e), Duration::ZERO));
            }
        }
        Arc::new(pending)
    }

    /// Lets the probe run its dumps (it waits for this after entering its namespace). Idempotent.
    pub fn release(&self) {
        drop(self.go.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    /// The features, once the probe has finished (releasing it first if nobody has).
    pub fn wait(&self) -> Features {
        self.release();
        *self.features.get_or_init(|| {
            let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
            match thread.map(JoinHandle::join) {
                Some(Ok((result, elapsed))) => logged(result, elapsed),
                Some(Err(_)) | None => logged(Err(ProbeError::Panicked), Duration::ZERO),
            }
        })
    }
}

/// Lowers the calling thread (only it: on Linux a thread is a task of its own) to nice 19; a failure only
/// leaves it where it was.
fn lowest_priority() {
    // SAFETY: plain syscall without pointers; who = 0 is the calling thread.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) } != 0 {
        let e = std::io::Error::last_os_error();
        tracing::debug!("conntrack probe: cannot lower its priority ({e})");
    }
}

impl std::fmt::Debug for PendingFeatures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingFeatures")
            .field("features", &self.features.get())
            .finish_non_exhaustive()
    }
}

/// Walks the conntrack table and deletes what a filter finds stale, in the namespace of the thread that first
/// uses it (its socket is opened there, on first use).
pub struct Walker {
    opts: CleanerOptions,
    socket: Option<CtSocket>,
    features: Option<Features>,
    /// A probe started elsewhere, waited for at the first walk.
    pending: Option<Arc<PendingFeatures>>,
    metrics: Arc<Metrics>,
}

impl Walker {
    /// A walker with these options; its socket opens at the first walk.
    pub fn new(opts: CleanerOptions) -> Walker {
        Walker {
            opts,
            socket: None,
            features: None,
            pending: None,
            metrics: Arc::new(Metrics::default()),
        }
    }

    /// The counters (shared; an admin endpoint can hold on to them).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// The kernel features in use (probing on first call, if enabled).
    pub(crate) fn features(&mut self) -> Features {
        if let Some(f) = self.features {
            return f;
        }
        let f = if let Some(pending) = self.pending.take() {
            pending.wait()
        } else if self.opts.probe {
            probe_features()
        } else {
            Features::default()
        };
        self.features = Some(f);
        f
    }

    /// Sets the features instead of probing (tests, and kernels known in advance).
    pub(crate) fn set_features(&mut self, f: Features) {
        self.features = Some(f);
    }

    /// Takes the features from a probe already running, instead of probing.
    pub(crate) fn set_pending_features(&mut self, pending: Arc<PendingFeatures>) {
        self.pending = Some(pending);
    }

    /// After a repair: deletes the TCP, UDP and SCTP flows to `frontends` that were never DNATed (see
    /// [`super::unnated`]). Records the metrics; the caller logs.
    pub(crate) fn clear_black_holes(
        &mut self,
        frontends: &Frontends,
    ) -> Result<CleanupReport, CleanupError> {
        if frontends.is_empty() {
            return Ok(CleanupReport::default());
        }
        if self.opts.dump_filters {
            // Probe once, outside the timed cleanup (it creates a namespace: a one-off cost).
            self.features();
        }
        let start = Instant::now();
        let r = self.clear_black_holes_inner(frontends, start);
        match &r {
            Ok(report) => self.metrics.record(report),
            Err(_) => {
                self.metrics.record_failure(start.elapsed());
                self.socket = None;
            }
        }
        r
    }

    fn clear_black_holes_inner(
        &mut self,
        frontends: &Frontends,
        start: Instant,
    ) -> Result<CleanupReport, CleanupError> {
        let features = match self.opts.dump_filters {
            true => self.features(),
            false => Features::default(),
        };
        let mut report = CleanupReport::default();
        let sock = self.socket()?;
        let mut stale = Vec::new();
        for d in frontends.dumps(|family| features.dump_proto(family)) {
            report.dumps += 1;
            sock.dump(&d, |e| {
                report.scanned += 1;
                if frontends.is_black_hole(&e) {
                    stale.push(e);
                }
            })
            .map_err(|source| CleanupError::Netlink {
                what: "dump",
                source,
            })?;
        }
        report.stale = stale.len();
        for e in stale.iter().take(LOGGED_ENTRIES) {
            tracing::debug!(orig = %e.orig, status = e.status, "conntrack: deleting a flow that was never DNATed");
        }
        delete_into(sock, &stale, &mut report)?;
        report.elapsed = start.elapsed();
        Ok(report)
    }

    fn socket(&mut self) -> Result<&mut CtSocket, CleanupError> {
        if self.socket.is_none() {
            self.socket = Some(CtSocket::open().map_err(CleanupError::Open)?);
        }
        Ok(self.socket.as_mut().expect("just opened"))
    }

    /// Deletes the entries `filter` finds stale, in the calling thread's namespace (the socket is opened there
    /// on first use). Records the metrics.
    pub fn cleanup(&mut self, filter: &StaleFilter) -> Result<CleanupReport, CleanupError> {
        self.cleanup_checked(filter, &|_| true)
    }

    /// [`Self::cleanup`], sparing the entries found stale that `still_stale` no longer finds stale when it
    /// is asked, after the dumps and right before the deletes (a walk that runs beside later commits asks
    /// about their endpoints: see [`super::worker`]). Kernel-side filtered deletes, if enabled, are not
    /// asked.
    pub fn cleanup_checked(
        &mut self,
        filter: &StaleFilter,
        still_stale: &dyn Fn(&Entry) -> bool,
    ) -> Result<CleanupReport, CleanupError> {
        if !filter.is_empty() && (self.opts.dump_filters || self.opts.filtered_delete) {
            // Probe once, outside the timed cleanup (it creates a namespace: a one-off cost).
            self.features();
        }
        let start = Instant::now();
        let r = self.cleanup_inner(filter, still_stale, start);
        match &r {
            Ok(report) => self.metrics.record(report),
            Err(_) => {
                self.metrics.record_failure(start.elapsed());
                // Start over with a fresh socket next time (a dump may have been cut short).
                self.socket = None;
            }
        }
        r
    }

    fn cleanup_inner(
        &mut self,
        filter: &StaleFilter,
        still_stale: &dyn Fn(&Entry) -> bool,
        start: Instant,
    ) -> Result<CleanupReport, CleanupError> {
        let mut report = CleanupReport::default();
        if filter.is_empty() {
            report.elapsed = start.elapsed();
            return Ok(report);
        }
        let probed = self.opts.dump_filters || self.opts.filtered_delete;
        let mut features = if probed {
            self.features()
        } else {
            Features::default()
        };
        let features_before = features;
        let opts = self.opts.clone();
        let sock = self.socket()?;

        let mut rest = filter.clone();
        if opts.filtered_delete {
            for (ip, proto, port) in filter.delete_all_targets() {
                if !features.filtered_delete(family_of(&ip)) {
                    continue;
                }
                let df = match port {
                    Some(p) => DeleteFilter::to_socket(ip, p, proto.number()),
                    None => DeleteFilter::to_ip(ip, proto.number()),
                };
                match sock.filtered_delete(&df) {
                    Ok(()) => {
                        rest.forget_delete_all(ip, proto, port);
                        report.filtered_deletes += 1;
                    }
                    // The kernel refused after all: the dump path handles this target.
                    Err(e) if e.is_refusal() => {
                        tracing::warn!("conntrack: filtered delete refused ({e}); dumping instead");
                    }
                    Err(e) => {
                        return Err(CleanupError::Netlink {
                            what: "filtered delete",
                            source: e,
                        })
                    }
                }
            }
        }

        let dumps = plan_dumps(&rest, &features, &opts);
        let mut seen = HashSet::new();
        let mut stale: Vec<Entry> = Vec::new();
        for d in dumps {
            report.dumps += 1;
            let mut collect = |e: Entry| {
                report.scanned += 1;
                if rest.is_stale(&e) && seen.insert((e.orig, e.zone)) {
                    stale.push(e);
                }
            };
            match sock.dump(&d, &mut collect) {
                Ok(_) => {}
                Err(e) if e.is_refusal() && d.proto.is_some() => {
                    // A kernel that refuses the filter: fall back to the family dump for good.
                    tracing::warn!("conntrack: filtered dump refused ({e}); dumping per family");
                    if d.family == AF_INET {
                        features.dump_proto_v4 = false;
                        features.dump_addr_v4 = false;
                    } else {
                        features.dump_proto_v6 = false;
                        features.dump_addr_v6 = false;
                    }
                    report.dumps += 1;
                    sock.dump(&DumpFilter::family(d.family), &mut collect)
                        .map_err(|source| CleanupError::Netlink {
                            what: "dump",
                            source,
                        })?;
                }
                Err(source) => {
                    return Err(CleanupError::Netlink {
                        what: "dump",
                        source,
                    })
                }
            }
        }
        if probed && features != features_before {
            self.features = Some(features);
        }
        let found = stale.len();
        stale.retain(|e| still_stale(e));
        if stale.len() < found {
            tracing::debug!(
                spared = found - stale.len(),
                "conntrack: entries that a later commit made healthy again are kept"
            );
        }
        report.stale = stale.len();
        if tracing::enabled!(tracing::Level::DEBUG) {
            for e in stale.iter().take(LOGGED_ENTRIES) {
                tracing::debug!(
                    orig = %e.orig,
                    reply = %e.reply,
                    id = ?e.id,
                    zone = e.zone.id(),
                    "conntrack: deleting stale entry"
                );
            }
            if stale.len() > LOGGED_ENTRIES {
                tracing::debug!(
                    more = stale.len() - LOGGED_ENTRIES,
                    "conntrack: deleting more stale entries"
                );
            }
        }
        delete_into(self.socket()?, &stale, &mut report)?;
        report.elapsed = start.elapsed();
        Ok(report)
    }
}

/// Deletes `stale` by exact tuple and counts the outcome into `report`; failures are logged (the first few).
fn delete_into(
    sock: &mut CtSocket,
    stale: &[Entry],
    report: &mut CleanupReport,
) -> Result<(), CleanupError> {
    let outcome = sock.delete(stale).map_err(|source| CleanupError::Netlink {
        what: "delete",
        source,
    })?;
    report.deleted = outcome.deleted;
    report.deleted_v6 = outcome.deleted_v6;
    report.gone = outcome.gone;
    report.errors = outcome.errors.len();
    for (e, err) in outcome.errors.iter().take(5) {
        tracing::warn!(entry = %e.orig, zone = e.zone.id(), "conntrack delete failed: {err}");
    }
    Ok(())
}

/// The dumps that see every entry `filter` may find stale, as narrow as the kernel allows: per address when
/// there are few, per protocol otherwise, per family where the kernel's filters are not trusted.
pub fn plan_dumps(
    filter: &StaleFilter,
    features: &Features,
    opts: &CleanerOptions,
) -> Vec<DumpFilter> {
    let scopes = filter.dump_scopes();
    let mut out = Vec::new();
    for family in [AF_INET, AF_INET6] {
        let mut by_proto: BTreeMap<Protocol, Vec<IpAddr>> = BTreeMap::new();
        for (ip, p) in &scopes.addresses {
            if family_of(ip) == family {
                by_proto.entry(*p).or_default().push(*ip);
            }
        }
        for p in &scopes.any_address {
            by_proto.entry(*p).or_default();
        }
        if by_proto.is_empty() {
            continue;
        }
        if !(opts.dump_filters && features.dump_proto(family)) {
            out.push(DumpFilter::family(family));
            continue;
        }
        for (p, ips) in by_proto {
            let per_address = features.dump_addr(family)
                && !scopes.any_address.contains(&p)
                && ips.len() <= opts.max_address_dumps;
            if per_address {
                out.extend(ips.into_iter().map(|ip| DumpFilter::dst(ip, p.number())));
            } else {
                out.push(DumpFilter::proto(family, p.number()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::filter::Frontend;
    use super::*;
    use std::net::SocketAddr;

    fn fe(s: &str) -> Frontend {
        let a: SocketAddr = s.parse().unwrap();
        Frontend {
            ip: a.ip(),
            port: a.port(),
            proto: Protocol::Udp,
        }
    }

    const ALL: Features = Features::ALL;

    #[test]
    fn dumps_per_address_then_per_protocol_then_per_family() {
        let mut f = StaleFilter::new();
        f.frontend(fe("10.96.0.10:53"), []);
        f.frontend(fe("10.96.0.11:53"), []);
        f.frontend(fe("[fd00:96::10]:53"), []);
        let opts = CleanerOptions::default();
        let d = plan_dumps(&f, &ALL, &opts);
        assert_eq!(
            d,
            vec![
                DumpFilter::dst("10.96.0.10".parse().unwrap(), 17),
                DumpFilter::dst("10.96.0.11".parse().unwrap(), 17),
                DumpFilter::dst("fd00:96::10".parse().unwrap(), 17),
            ]
        );
        // Many addresses: one dump of the protocol.
        let few = CleanerOptions {
            max_address_dumps: 1,
            ..CleanerOptions::default()
        };
        assert_eq!(
            plan_dumps(&f, &ALL, &few),
            vec![
                DumpFilter::proto(AF_INET, 17),
                DumpFilter::dst("fd00:96::10".parse().unwrap(), 17),
            ]
        );
        // IPv6 address filters fail the probe (Linux 6.18): one dump of the protocol for IPv6.
        let no_v6_addr = Features {
            dump_addr_v6: false,
            ..ALL
        };
        assert_eq!(
            plan_dumps(&f, &no_v6_addr, &opts)[2],
            DumpFilter::proto(AF_INET6, 17)
        );
        // No filter works for a family: one unfiltered dump of that family.
        let no_v6 = Features {
            dump_addr_v6: false,
            dump_proto_v6: false,
            ..ALL
        };
        assert_eq!(
            plan_dumps(&f, &no_v6, &opts)[2],
            DumpFilter::family(AF_INET6)
        );
        // Nothing probed: per family.
        assert_eq!(
            plan_dumps(&f, &Features::default(), &opts),
            vec![DumpFilter::family(AF_INET), DumpFilter::family(AF_INET6)]
        );
        // NodePorts on any address: per protocol.
        let mut np = StaleFilter::new();
        np.node_port(
            super::super::filter::NodePort {
                port: 30053,
                proto: Protocol::Udp,
            },
            [],
        );
        assert_eq!(
            plan_dumps(&np, &ALL, &opts),
            vec![
                DumpFilter::proto(AF_INET, 17),
                DumpFilter::proto(AF_INET6, 17)
            ]
        );
        assert!(plan_dumps(&StaleFilter::new(), &ALL, &opts).is_empty());
    }
}
