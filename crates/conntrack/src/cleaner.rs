//! The cleanup after each commit, in two halves: the [`Planner`] works out from the model's changes what may
//! have gone stale (cheap, proportional to the changes, on the proxy loop's thread), the
//! `Walker` (`walker.rs`) walks the kernel's conntrack table and deletes it (the expensive part).
//! [`Cleaner`] runs both in turn on the calling thread; [`super::worker::CleanupQueue`] runs the walks on a
//! thread of their own.

use super::filter::StaleFilter;
use super::options::{CleanerOptions, CleanupError, CleanupReport};
use super::plan::{collect_targets, resolve, FrontendIndex, FrontendKinds, Pending, Targets};
use super::socket::Features;
use super::walker::Walker;
use super::Metrics;
use nftkube_model::{Changes, ClusterState, NamespacedName, Protocol, ServicePortName};
use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

/// The planning half: which frontends and endpoints a round of changes asks to look at.
///
/// It keeps the frontend index (the frontends as of the previous round: a deleted one is known only from
/// there), the changes of syncs that failed, and the targets of walks that failed, until the next commit.
pub struct Planner {
    kinds: FrontendKinds,
    node_port_addresses: Vec<IpAddr>,
    /// Changes of syncs that failed: the kernel still has the rules they were meant to replace.
    pending: Pending,
    /// Targets of a cleanup that failed, retried after the next commit.
    retry: Targets,
    index: FrontendIndex,
}

/// One round's work for a walker: the filter to walk with, and the targets it came from (handed back to the
/// planner if the walk fails, and judged again then against the endpoints of that time).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Round {
    /// What the round looks at.
    pub(crate) targets: Targets,
    /// What a flow must match to be deleted.
    pub filter: StaleFilter,
}

impl Planner {
    /// A planner with nothing pending yet.
    pub fn new(opts: &CleanerOptions) -> Planner {
        Planner {
            kinds: opts.kinds,
            node_port_addresses: opts.node_port_addresses.clone(),
            pending: Pending::new(),
            retry: Targets::default(),
            index: FrontendIndex::new(),
        }
    }

    /// A sync failed: its changes wait for the next successful one.
    pub(crate) fn sync_failed(&mut self, changes: &Changes) {
        self.pending.merge(changes);
    }

    /// A walk failed: its targets are looked at again after the next commit.
    pub(crate) fn retry_later(&mut self, targets: Targets) {
        self.retry.merge(targets);
    }

    /// A sync committed: the targets its changes (and those of failed syncs and walks before it) ask to look
    /// at, updating the frontend index. O(changes).
    pub(crate) fn take_targets(&mut self, changes: &Changes, state: &ClusterState) -> Targets {
        // Merge only behind a failed sync: a copy of a first sync's changes (every service) would be
        // ~14 MB at 50k services, at the moment the agent's memory peaks.
        let behind = !self.pending.is_empty();
        if behind {
            self.pending.merge(changes);
        }
        let round = if behind {
            self.pending.changes()
        } else {
            changes
        };
        let mut targets = Targets::default();
        if !round.is_empty() {
            targets = collect_targets(round, &mut self.index, state, self.kinds);
        }
        self.pending.clear();
        targets.merge(std::mem::take(&mut self.retry));
        targets
    }

    /// The filter for `targets`, with the current owners of their frontends and the serving endpoints of
    /// `state`. O(targets).
    pub fn resolve(&self, targets: Targets, state: &ClusterState) -> Round {
        let mut filter = resolve(&targets, &self.index, state);
        filter.node_port_addresses = self.node_port_addresses.clone();
        Round { targets, filter }
    }

    /// The part of `running` (the targets of a walk planned before this commit) that this commit's `changes`
    /// may have made healthy again: deleted addresses in use again, lost frontends and NodePorts that a
    /// changed service owns now, judged ports of changed services. O(changes + running's lost addresses and
    /// frontends), never O(running's judged ports). Call after [`Self::take_targets`] for the same commit.
    pub(crate) fn touched(
        &self,
        running: &Targets,
        changes: &Changes,
        state: &ClusterState,
    ) -> Targets {
        let changed: HashSet<&NamespacedName> = changes
            .changed_services
            .iter()
            .chain(changes.newly_active_services.iter().map(|n| &n.service))
            .chain(changes.stale_endpoints.iter().map(|(n, _)| &n.service))
            .collect();
        let owned_by_changed =
            |owner: Option<&ServicePortName>| owner.is_some_and(|o| changed.contains(&o.service));
        let mut t = Targets::default();
        t.ips.extend(
            running
                .ips
                .iter()
                .filter(|ip| self.index.ip_in_use(**ip, Protocol::Udp)),
        );
        t.frontends.extend(
            running
                .frontends
                .iter()
                .filter(|fe| owned_by_changed(self.index.owner(fe))),
        );
        t.node_ports.extend(
            running
                .node_ports
                .iter()
                .filter(|np| owned_by_changed(self.index.node_port_owner(np))),
        );
        for name in changed {
            for sp in state.service_ports(name) {
                if running.judged.contains(&sp.name) {
                    t.judged.insert(sp.name.clone());
                }
            }
        }
        t
    }

    /// [`Self::take_targets`] then [`Self::resolve`]; None when there is nothing to look at.
    pub(crate) fn plan(&mut self, changes: &Changes, state: &ClusterState) -> Option<Round> {
        let targets = self.take_targets(changes, state);
        (!targets.is_empty()).then(|| self.resolve(targets, state))
    }
}

/// Deletes stale UDP / SCTP conntrack entries after each commit (see [`super::filter`] for which), on the
/// calling thread: the planner and the walker in turn. The agent runs the walker on a thread of its own
/// instead ([`super::worker::CleanupQueue`]); this is the same code, for tests, benches and tools.
///
/// ```text
/// let changes = state.take_changes();
/// match sync_once(&mut engine, &state, &changes.changed_services, &cfg) {
///     Ok(_) => conntrack.after_sync(&changes, &state),
///     Err(_) => conntrack.sync_failed(&changes), // kept for the next successful commit
/// }
/// ```
pub struct Cleaner {
    planner: Planner,
    walker: Walker,
}

impl Default for Cleaner {
    fn default() -> Self {
        Self::new()
    }
}

impl Cleaner {
    /// A cleaner with the default options.
    pub fn new() -> Cleaner {
        Cleaner::with_options(CleanerOptions::default())
    }

    /// A cleaner with these options.
    pub fn with_options(opts: CleanerOptions) -> Cleaner {
        Cleaner {
            planner: Planner::new(&opts),
            walker: Walker::new(opts),
        }
    }

    /// The two halves, to run apart.
    pub fn into_parts(self) -> (Planner, Walker) {
        (self.planner, self.walker)
    }

    /// The counters (shared; an admin endpoint can hold on to them).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.walker.metrics()
    }

    /// Sets the features instead of probing (tests, and kernels known in advance).
    pub fn set_features(&mut self, f: Features) {
        self.walker.set_features(f);
    }

    /// Takes the features from a probe already running (see [`super::walker::PendingFeatures`]).
    pub fn set_pending_features(
        &mut self,
        pending: std::sync::Arc<super::walker::PendingFeatures>,
    ) {
        self.walker.set_pending_features(pending);
    }

    /// A sync committed: clean what its changes (and those of failed syncs before it) made stale. Logs the
    /// outcome; a failure keeps the targets for the cleanup after the next commit.
    pub fn after_sync(&mut self, changes: &Changes, state: &ClusterState) -> Option<CleanupReport> {
        let round = self.planner.plan(changes, state)?;
        let report = log_cleanup(&self.walker.cleanup(&round.filter), None);
        if report.is_none() {
            self.planner.retry_later(round.targets);
        }
        report
    }

    /// Deletes the entries `filter` finds stale, in the calling thread's namespace (the socket is opened there
    /// on first use). Records the metrics.
    pub fn cleanup(&mut self, filter: &StaleFilter) -> Result<CleanupReport, CleanupError> {
        self.walker.cleanup(filter)
    }
}

/// Where a walk run by the worker stood: the commits it follows and how long it waited for its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Queued {
    /// The first commit whose changes the walk covers.
    pub(crate) first_commit: u64,
    /// The last commit whose changes the walk covers.
    pub(crate) last_commit: u64,
    /// How long it waited for the walk before it.
    pub(crate) waited: Duration,
}

/// Logs a cleanup after a commit; the report, or None on failure (then retried after the next commit).
pub(crate) fn log_cleanup(
    result: &Result<CleanupReport, CleanupError>,
    queued: Option<Queued>,
) -> Option<CleanupReport> {
    match result {
        Ok(r) => {
            log_report(r, queued, "conntrack cleanup");
            Some(r.clone())
        }
        Err(e) => {
            match queued {
                Some(q) => tracing::error!(
                    first_commit = q.first_commit,
                    last_commit = q.last_commit,
                    "conntrack cleanup failed, retrying after the next sync: {e}"
                ),
                None => {
                    tracing::error!("conntrack cleanup failed, retrying after the next sync: {e}")
                }
            }
            None
        }
    }
}

/// Logs a black-hole cleanup after a repair; the report, or None on failure (not retried).
pub(crate) fn log_black_holes(
    result: &Result<CleanupReport, CleanupError>,
    queued: Option<Queued>,
) -> Option<CleanupReport> {
    match result {
        Ok(r) => {
            log_report(
                r,
                queued,
                "conntrack: flows to services that were never DNATed",
            );
            Some(r.clone())
        }
        Err(e) => {
            tracing::error!("conntrack: deleting flows that were never DNATed failed: {e}");
            None
        }
    }
}

/// One line per cleanup: at info when it deleted or failed to delete something, else at debug (a cleanup
/// that finds nothing runs after many syncs). `elapsed_ms` is the walk's own time; a queued walk also says
/// which commits it follows and how long it waited behind earlier walks (`queued_ms`).
fn log_report(r: &CleanupReport, queued: Option<Queued>, what: &str) {
    let q = queued.unwrap_or(Queued {
        first_commit: 0,
        last_commit: 0,
        waited: Duration::ZERO,
    });
    macro_rules! log {
        ($lvl:ident) => {
            tracing::$lvl!(
                dumps = r.dumps,
                scanned = r.scanned,
                stale = r.stale,
                deleted = r.deleted,
                gone = r.gone,
                errors = r.errors,
                filtered_deletes = r.filtered_deletes,
                elapsed_ms = r.elapsed.as_secs_f64() * 1000.0,
                first_commit = q.first_commit,
                last_commit = q.last_commit,
                queued_ms = q.waited.as_secs_f64() * 1000.0,
                "{what}"
            )
        };
    }
    if r.deleted > 0 || r.errors > 0 || r.filtered_deletes > 0 {
        log!(info);
    } else {
        log!(debug);
    }
}
