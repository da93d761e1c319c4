//! Stale UDP / SCTP conntrack cleanup over ctnetlink, without the `conntrack` binary.
//!
//! UDP has no teardown: a client that keeps its source port stays glued to its conntrack entry, and so to the
//! endpoint that entry was DNATed to (or to no endpoint at all), for as long as it keeps sending. After each
//! committed sync the proxy deletes the entries its changes made stale ([`filter`] says which, [`plan`] works
//! out the targets from the model's changes):
//!
//! 1. dump only what can match: per original destination address with a kernel-side filter where the kernel
//!    handles it correctly (probed once, in a throwaway namespace), else per protocol, else per family;
//! 2. decide in user space (the rule "reply source is not a serving endpoint" has no kernel filter);
//! 3. delete each stale entry by its exact original tuple, zone and id.
//!
//! The proxy runs the planning on its loop and the walks (1–3) on a thread of their own ([`worker`]), so a
//! sync never waits for a conntrack walk.
//!
//! A DELETE without a tuple flushes the whole table; [`wire`] cannot encode one and the socket refuses to send
//! one. Kernel-side filtered deletes (6.12+) are used only if enabled and probed (see [`CleanerOptions`]).

pub mod cleaner;
pub mod filter;
pub mod options;
pub mod plan;
pub mod socket;
pub mod sysctls;
pub mod unnated;
pub mod walker;
pub mod wire;
pub mod worker;

pub use cleaner::{Cleaner, Planner, Round};
pub use filter::{Frontend, NodePort, Reason, StaleFilter};
pub use options::{CleanerOptions, CleanupError, CleanupReport};
pub use plan::{build_filter, FrontendIndex, FrontendKinds, Pending, Targets};
pub use socket::{probe, start_probe, CtSocket, DeleteOutcome, Features};
pub use unnated::Frontends;
pub use walker::{plan_dumps, probe_features, PendingFeatures, Walker};
pub use wire::{DeleteFilter, DumpFilter, Entry, NewEntry, Tuple, ZoneScope};
pub use worker::{CleanupQueue, Walk};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Cleanup counters: plain atomics, read by whoever exports them (an admin endpoint, tests).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Cleanups that ran (something to look at), successful or not.
    pub(crate) cleanups: AtomicU64,
    /// Cleanups that failed.
    pub(crate) cleanup_failures: AtomicU64,
    /// Entries the dumps returned.
    pub(crate) entries_scanned: AtomicU64,
    /// Entries deleted by exact tuple.
    pub(crate) entries_deleted: AtomicU64,
    /// Of them, IPv4 and IPv6 entries, each counted on its own so that neither ever goes back.
    pub(crate) entries_deleted_v4: AtomicU64,
    /// See `entries_deleted_v4`.
    pub(crate) entries_deleted_v6: AtomicU64,
    /// Deletes that failed for another reason than "already gone".
    pub(crate) delete_errors: AtomicU64,
    /// Kernel-side filtered deletes sent.
    pub filtered_deletes: AtomicU64,
    /// Total, last and longest cleanup duration, in microseconds.
    pub(crate) duration_us_total: AtomicU64,
    /// See `duration_us_total`.
    pub(crate) duration_us_last: AtomicU64,
    /// See `duration_us_total`.
    pub(crate) duration_us_max: AtomicU64,
}

/// A consistent-enough copy of [`Metrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// See [`Metrics::cleanups`].
    pub cleanups: u64,
    /// See [`Metrics::cleanup_failures`].
    pub cleanup_failures: u64,
    /// See [`Metrics::entries_scanned`].
    pub entries_scanned: u64,
    /// See [`Metrics::entries_deleted`].
    pub entries_deleted: u64,
    /// See [`Metrics::entries_deleted_v4`].
    pub entries_deleted_v4: u64,
    /// See [`Metrics::entries_deleted_v6`].
    pub entries_deleted_v6: u64,
    /// See [`Metrics::delete_errors`].
    pub delete_errors: u64,
    /// See [`Metrics::filtered_deletes`].
    pub filtered_deletes: u64,
    /// See [`Metrics::duration_us_total`].
    pub duration_us_total: u64,
    /// See [`Metrics::duration_us_last`].
    pub duration_us_last: u64,
    /// See [`Metrics::duration_us_max`].
    pub(crate) duration_us_max: u64,
}

impl Metrics {
    fn record_duration(&self, d: Duration) {
        // kube-proxy's reconciler runs once per family and sync; one cleanup here walks both families'
        // flows, so it is one run of each.
        nftkube_metrics::CONNTRACK_RECONCILE.observe(d);
        let us = d.as_micros().min(u64::MAX as u128) as u64;
        self.cleanups.fetch_add(1, Ordering::Relaxed);
        self.duration_us_total.fetch_add(us, Ordering::Relaxed);
        self.duration_us_last.store(us, Ordering::Relaxed);
        self.duration_us_max.fetch_max(us, Ordering::Relaxed);
    }

    pub(crate) fn record(&self, r: &CleanupReport) {
        if r.dumps == 0 && r.filtered_deletes == 0 {
            return; // nothing was looked at
        }
        self.record_duration(r.elapsed);
        self.entries_scanned
            .fetch_add(r.scanned as u64, Ordering::Relaxed);
        self.entries_deleted
            .fetch_add(r.deleted as u64, Ordering::Relaxed);
        self.entries_deleted_v4.fetch_add(
            r.deleted.saturating_sub(r.deleted_v6) as u64,
            Ordering::Relaxed,
        );
        self.entries_deleted_v6
            .fetch_add(r.deleted_v6 as u64, Ordering::Relaxed);
        self.delete_errors
            .fetch_add(r.errors as u64, Ordering::Relaxed);
        self.filtered_deletes
            .fetch_add(r.filtered_deletes as u64, Ordering::Relaxed);
    }

    pub(crate) fn record_failure(&self, d: Duration) {
        self.record_duration(d);
        self.cleanup_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now (each read on its own).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            cleanups: l(&self.cleanups),
            cleanup_failures: l(&self.cleanup_failures),
            entries_scanned: l(&self.entries_scanned),
            entries_deleted: l(&self.entries_deleted),
            entries_deleted_v4: l(&self.entries_deleted_v4),
            entries_deleted_v6: l(&self.entries_deleted_v6),
            delete_errors: l(&self.delete_errors),
            filtered_deletes: l(&self.filtered_deletes),
            duration_us_total: l(&self.duration_us_total),
            duration_us_last: l(&self.duration_us_last),
            duration_us_max: l(&self.duration_us_max),
        }
    }
}

#[cfg(test)]
mod tests;
