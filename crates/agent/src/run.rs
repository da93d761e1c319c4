//! The proxy loop: a small state machine over wake-ups.
//!
//! It sleeps on its inbox until a source has events, the monitor reports drift, a stop is asked, or its
//! next timer falls due (the sync runner's next token, a retry, the periodic check). Then it applies what
//! arrived and syncs if a sync is due. Sources read and parse on threads of their own, so a sync never waits
//! for a file or the API.

use super::node_addresses::NodeAddresses;
use super::wake::{Inbox, Wake};
use super::{sync_once, ProxyOptions};
use nftkube_admin::Observer;
use nftkube_conntrack::{CleanupQueue, FrontendKinds, Frontends};
use nftkube_metrics as metrics;
use nftkube_model::ClusterState;
use nftkube_model::DetectLocal;
use nftkube_nft::monitor::Drift;
use nftkube_nft::netlink::NftSocket;
use nftkube_render::RenderConfig;
use nftkube_source::{apply_event, Event, ProxySource};
use nftkube_sync::SyncEngine;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::quarantine::Quarantine;
use super::runner::SyncRunner;
use nftkube_model::NamespacedName;

/// Periodic checks skip reading the kernel back while its generation id is the one our last sync left (and
/// the monitor saw nothing foreign); still, the tables are read back in full at least this often (the
/// default of `--full-read-period`). The
/// generation id and the event monitor catch every change we know of; this read guards against what
/// neither sees (a monitor that died, a kernel bug). At 50k services a read costs about 0.5 s of CPU, so
/// every 10 minutes is under 0.1 % of a core.
pub(crate) const FULL_READ_INTERVAL: Duration = Duration::from_secs(600);

/// A batch of events this long (a snapshot, a large re-read) leaves enough freed memory behind to hand back
/// before the sync that follows builds its own structures; a small one is not worth the heap walk.
const LARGE_BATCH: usize = 1000;

/// The first retry of a failed sync, doubled up to `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The userspace relay's parts, when asked for: localhost NodePorts (beside the nf_tables proxy) and
/// userspace mode (the relay serves the services; nf_tables only redirects to it).
#[derive(Default)]
pub(super) struct Relays {
    pub(crate) localhost: Option<nftkube_relay::LocalhostNodePorts>,
    pub userspace: Option<nftkube_relay::UserspaceProxy>,
}

pub(super) struct ProxyLoop<'a> {
    pub(crate) opts: &'a ProxyOptions,
    pub source: ProxySource,
    pub(crate) state: ClusterState,
    pub(crate) engine: SyncEngine<NftSocket>,
    /// Conntrack cleanup on a thread of its own: a sync never waits for a walk.
    pub(crate) conntrack: CleanupQueue,
    pub(crate) observer: Observer,
    pub(crate) cfg: RenderConfig,
    pub(crate) drift: Arc<Drift>,
    /// The source has delivered a complete snapshot.
    pub(crate) synced: bool,
    pub(crate) waiting_logged: bool,
    /// Something changed that the kernel does not have yet.
    pub(crate) pending: bool,
    /// Someone changed our tables: the next sync is a repair, and runs without waiting for a token.
    pub(crate) repair: bool,
    pub(crate) runner: SyncRunner,
    pub(crate) retry_at: Option<Instant>,
    pub(crate) backoff: Duration,
    /// The next periodic check (`--sync-period`).
    pub(crate) next_check: Instant,
    /// When a periodic check reads the kernel back even if its generation says nothing changed.
    pub(crate) next_full_read: Instant,
    /// The node's addresses were read since the last sync (by a periodic check): the full sync it asked for
    /// need not read them again.
    pub(crate) addresses_fresh: bool,
    /// Where NodePorts are served and the node's IPs come from: its links, --bind-address, its Node object.
    pub(crate) node_addresses: NodeAddresses,
    pub(crate) relay: Relays,
    /// Services the kernel refused, left out and retried on their own.
    pub(crate) quarantine: Quarantine,
    /// The service CIDRs changed since the last sync (`cfg.service_cidrs`): the checks are committed first.
    pub(crate) service_cidrs_changed: bool,
}

impl ProxyLoop<'_> {
    pub(crate) fn new<'a>(
        opts: &'a ProxyOptions,
        source: ProxySource,
        engine: SyncEngine<NftSocket>,
        conntrack: CleanupQueue,
        observer: Observer,
        drift: Arc<Drift>,
    ) -> ProxyLoop<'a> {
        let now = Instant::now();
        ProxyLoop {
            opts,
            source,
            state: ClusterState::new(),
            engine,
            conntrack,
            observer,
            cfg: opts.render.clone(),
            drift,
            synced: false,
            waiting_logged: false,
            pending: true,
            repair: false,
            runner: SyncRunner::new(opts.min_sync_period, now),
            retry_at: None,
            backoff: FIRST_BACKOFF,
            next_check: now + opts.sync_period,
            next_full_read: now + opts.full_read_period,
            addresses_fresh: false,
            node_addresses: NodeAddresses::new(opts.nodeport.clone(), opts.bind_address),
            relay: Relays::default(),
            quarantine: Quarantine::default(),
            service_cidrs_changed: false,
        }
    }

    /// Ends the conntrack worker (its queued walks finish, within a bound).
    pub(crate) fn finish(self) {
        self.conntrack.stop();
    }

    /// Runs until a stop is asked. An error only for what kube-proxy also exits on (podCIDRs changed).
    pub(crate) fn run(&mut self, inbox: &Inbox) -> anyhow::Result<()> {
        loop {
            let now = Instant::now();
            let rings = inbox.wait(self.deadline(now));
            if inbox.stop_requested() || rings.contains(&Wake::Stop) {
                return Ok(());
            }
            // The ring only wakes; the source's channel and the drift flag hold what happened.
            self.take_source_events();
            if self.drift.detected.swap(false, Ordering::SeqCst) {
                self.on_drift();
            }
            self.follow_node_object()?;
            let now = Instant::now();
            if now >= self.next_check {
                self.periodic_check(now);
            }
            if self.quarantine.next_retry().is_some_and(|t| now >= t) {
                self.pending = true;
            }
            if self.sync_due(now) {
                self.sync(now);
            }
        }
    }

    /// When the loop must wake even if nothing rings: the periodic check, or the moment a pending sync may
    /// run (the runner's next token, or a failed sync's retry).
    fn deadline(&mut self, now: Instant) -> Option<Instant> {
        let mut deadline = self.next_check;
        if self.pending && self.ready() {
            let mut at = if self.repair {
                now
            } else {
                self.runner.next_allowed(now)
            };
            if let Some(retry) = self.retry_at {
                at = at.max(retry);
            }
            deadline = deadline.min(at);
        }
        if let Some(retry) = self.quarantine.next_retry().filter(|t| *t > now) {
            deadline = deadline.min(retry);
        }
        Some(deadline)
    }

    /// Whether anything may be programmed: the source's first complete snapshot has arrived (and, with
    /// NodeCIDR, this node's podCIDRs are known). Until then whatever an earlier run programmed stays.
    fn ready(&self) -> bool {
        self.synced
            && (self.opts.render.local_detector != DetectLocal::NodeCidr
                || !self.cfg.cluster_cidrs.is_empty())
    }

    fn request_sync(&mut self) {
        self.pending = true;
        if self.synced {
            self.observer.sync_requested();
        }
    }

    fn take_source_events(&mut self) {
        let events = self.source.poll();
        if events.is_empty() {
            return;
        }
        // A large batch frees much (the objects it replaces): hand that back, but not batch by batch while
        // a source streams its first snapshot (see `ProxySource::poll`), only once at its end.
        let mut trim = events.len() >= LARGE_BATCH && self.synced;
        for ev in events {
            self.observer.on_event(&ev);
            if ev == Event::Synced && !self.synced {
                self.synced = true;
                trim = true;
                tracing::info!(
                    services = self.state.service_map().len(),
                    "source synced: complete snapshot received"
                );
            }
            if let Event::ServiceCidrs(api) = &ev {
                self.follow_service_cidrs(api);
            }
            apply_event(&mut self.state, ev);
        }
        if trim {
            nftkube_process::release_free_memory();
        }
        self.request_sync();
    }

    /// Someone changed our tables (or events were lost): read back and repair now.
    fn on_drift(&mut self) {
        self.engine.force_full_sync();
        self.repair = true;
        self.request_sync();
    }

    /// This node's addresses (`primary` NodePorts), zone (topology hints) and podCIDRs (NodeCIDR local
    /// detection) from its Node object.
    fn follow_node_object(&mut self) -> anyhow::Result<()> {
        let node = self.observer.node.as_ref();
        if node.is_some_and(|n| {
            self.node_addresses
                .follow_node_object(&n.addresses, &mut self.cfg)
        }) {
            self.engine.force_full_sync();
            self.request_sync();
        }
        if self.opts.render.node_zone.is_none() {
            let zone = self.observer.node.as_ref().and_then(|n| n.zone.clone());
            if zone.is_some() && zone != self.cfg.node_zone {
                tracing::info!(zone = ?zone, "this node's zone, from its Node object");
                self.cfg.node_zone = zone;
                self.engine.force_full_sync();
                self.request_sync();
            }
        }
        if self.opts.render.local_detector == DetectLocal::NodeCidr {
            let node_cidrs = self.observer.node.as_ref().map(|n| n.pod_cidrs.clone());
            if let Some(cidrs) = node_cidrs.filter(|c| !c.is_empty()) {
                if self.cfg.cluster_cidrs.is_empty() {
                    tracing::info!(pod_cidrs = ?cidrs, "local traffic: this node's podCIDRs");
                    self.cfg.cluster_cidrs = cidrs;
                    self.engine.force_full_sync();
                    self.request_sync();
                } else if cidrs != self.cfg.cluster_cidrs {
                    // What kube-proxy does too: the rules were built for the old ranges.
                    anyhow::bail!(
                        "this node's podCIDRs changed from {:?} to {cidrs:?}: exiting to restart with them (the rules stay)",
                        self.cfg.cluster_cidrs
                    );
                }
            }
        }
        Ok(())
    }

    /// The API's ServiceCIDRs changed: the checks follow `--service-cidr` and them together.
    fn follow_service_cidrs(&mut self, api: &[nftkube_model::Cidr]) {
        let cidrs = super::service_cidrs::effective(&self.opts.render.service_cidrs, api);
        if cidrs != self.cfg.service_cidrs {
            tracing::info!(service_cidrs = ?cidrs, "service CIDRs: --service-cidr and the API's ServiceCIDRs");
            self.cfg.service_cidrs = cidrs;
            self.service_cidrs_changed = true;
        }
    }

    /// Every `--sync-period`: re-read the node's addresses (NodePorts follow them), then make sure the kernel
    /// still holds what we committed — by its generation id when nothing says otherwise, by reading it back
    /// when the id moved, after `--full-read-period`, or when memory is not trusted.
    fn periodic_check(&mut self, now: Instant) {
        self.next_check = now + self.opts.sync_period;
        if !self.ready() {
            return;
        }
        let before = (
            self.cfg.nodeport_addresses.clone(),
            self.cfg.node_ips.clone(),
        );
        self.node_addresses.refresh(&mut self.cfg);
        let moved = before
            != (
                self.cfg.nodeport_addresses.clone(),
                self.cfg.node_ips.clone(),
            );
        if moved {
            tracing::info!(nodeport_addresses = ?self.cfg.nodeport_addresses, "the node's addresses changed");
        }
        let read_due = now >= self.next_full_read;
        if !moved && !read_due && self.engine.kernel_unchanged() {
            tracing::info!("periodic check: the ruleset's generation is the one our last sync left; nothing read back");
            self.observer.kernel_verified();
            return;
        }
        self.engine.force_full_sync();
        self.addresses_fresh = true;
        self.request_sync();
    }

    fn sync_due(&mut self, now: Instant) -> bool {
        let ready = self.ready();
        if self.pending && !ready && !self.waiting_logged {
            self.waiting_logged = true;
            tracing::info!(
                "waiting for the source's first complete snapshot (and, with NodeCIDR, this node's podCIDRs) before programming anything"
            );
        }
        let retry_due = self.retry_at.is_none_or(|t| now >= t);
        let allowed = self.repair || self.runner.next_allowed(now) <= now;
        self.pending && ready && retry_due && allowed
    }

    fn sync(&mut self, now: Instant) {
        let mut changes = self.state.take_changes();
        // Refused services whose retry is due are tried again, as if they had changed.
        changes.changed_services.extend(self.quarantine.due(now));
        let withheld = self.quarantine.withheld(now);
        self.runner.ran(now);
        self.observer.sync_started();
        // Node addresses can change; full syncs pick that up for NodePorts (unless a periodic check just did).
        if self.engine.needs_full_sync() && !std::mem::take(&mut self.addresses_fresh) {
            self.node_addresses.refresh(&mut self.cfg);
        }
        if std::mem::take(&mut self.service_cidrs_changed) {
            match self.relay.userspace {
                Some(_) => self.engine.force_full_sync(),
                None => super::service_cidrs::commit(&mut self.engine, &self.cfg),
            }
        }
        let synced = match &mut self.relay.userspace {
            Some(u) => u.sync(
                &mut self.engine,
                &self.state,
                &changes.changed_services,
                &self.cfg,
            ),
            None => sync_once(
                &mut self.engine,
                &self.state,
                &changes.changed_services,
                &withheld,
                &self.cfg,
            ),
        };
        // The first sync is over: the conntrack probe's dumps may have a core now (each walks the host's whole
        // conntrack table in one system call, and they took one from the first sync's parallel render).
        if let Some(probe) = &self.opts.conntrack_probe {
            probe.release();
        }
        match synced {
            Ok(report) => {
                let tried = |n: &NamespacedName| match report.full {
                    true => !withheld.contains(n),
                    false => changes.changed_services.contains(n),
                };
                self.quarantine.after_sync(&report, tried, now);
                metrics::QUARANTINED_PORTS.set(self.quarantine.ports() as u64);
                metrics::KERNEL_REJECTED_PORTS.inc_by(report.rejected.len() as u64);
                self.observer
                    .health
                    .set_rejected(self.quarantine.describe());
                if report.full {
                    // The health check servers follow the addresses NodePorts are now served on.
                    self.observer
                        .nodeport_addresses(&self.cfg.nodeport_addresses);
                    self.next_full_read = now + self.opts.full_read_period;
                    self.next_check = now + self.opts.sync_period;
                }
                self.observer
                    .sync_succeeded(&report, &changes.changed_services, &self.state);
                if let Some(l) = &mut self.relay.localhost {
                    l.sync(&self.state);
                }
                // The rules are in: queue the deletion of the UDP / SCTP flows this round (and failed ones) made
                // stale; the walk runs beside the loop, after this commit.
                self.conntrack.after_sync(&changes, &self.state);
                if report.full && report.changes > 0 {
                    // Rules were missing or wrong until now: connections tried meanwhile may have left
                    // entries that would keep a reused source port away from the service.
                    let frontends = Frontends::of(
                        &self.state,
                        FrontendKinds::ALL,
                        &self.cfg.nodeport_addresses,
                        &self.node_addresses.local_ips(),
                    );
                    self.conntrack.clear_black_holes(frontends);
                }
                let repair = std::mem::take(&mut self.repair);
                if repair {
                    metrics::REPAIRS.inc();
                }
                metrics::record_sync(report.full, report.elapsed);
                metrics::PENDING_CHANGES.set(0);
                tracing::info!(
                    full = report.full,
                    changes = report.changes,
                    repair,
                    bytes = report.bytes,
                    transactions = report.transactions,
                    services = self.state.service_map().len(),
                    changed_services = changes.changed_services.len(),
                    commit_ms = report.commit_time.as_secs_f64() * 1000.0,
                    elapsed_ms = report.elapsed.as_secs_f64() * 1000.0,
                    "sync complete"
                );
                // Chains released by this commit are deleted by the next one.
                self.pending = self.engine.has_pending_cleanup();
                self.retry_at = None;
                self.backoff = FIRST_BACKOFF;
            }
            Err(e) => {
                self.conntrack.sync_failed(&changes);
                metrics::SYNC_FAILURES.inc();
                metrics::PENDING_CHANGES.set(changes.changed_services.len() as u64);
                tracing::error!(
                    retry_in_s = self.backoff.as_secs(),
                    "sync failed, the previous rules stay in place: {e}"
                );
                self.retry_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
