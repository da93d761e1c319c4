//! Services the kernel refused. The sync engine leaves a refused service port out and commits everything
//! else (`SyncReport::rejected`); this keeps such services out of later full syncs, so that each of those
//! does not pay for finding them again, and tries them again on their own, with a backoff, or as soon as
//! they change.

use nftkube_model::{About, NamespacedName, Notice, Notices};
use nftkube_sync::SyncReport;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The first retry of a refused service, doubled up to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_secs(2);
const MAX_RETRY: Duration = Duration::from_secs(300);

/// One refused service.
#[derive(Debug)]
struct Held {
    /// Its ports the kernel refused.
    ports: usize,
    /// The kernel's answer for one of them.
    reason: String,
    retry_at: Instant,
    backoff: Duration,
}

/// The services the kernel refused, until it takes them.
#[derive(Debug, Default)]
pub(crate) struct Quarantine {
    held: BTreeMap<NamespacedName, Held>,
    /// A service refused for the first time is a Warning Event on it.
    pub(crate) notices: Notices,
}

impl Quarantine {
    /// Services whose retry is due: rendered again, as if they had changed.
    pub(crate) fn due(&self, now: Instant) -> BTreeSet<NamespacedName> {
        self.held
            .iter()
            .filter(|(_, h)| h.retry_at <= now)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Services left out of a full sync: refused, and not yet due.
    pub(crate) fn withheld(&self, now: Instant) -> BTreeSet<NamespacedName> {
        self.held
            .iter()
            .filter(|(_, h)| h.retry_at > now)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// When the next retry is due.
    pub(crate) fn next_retry(&self) -> Option<Instant> {
        self.held.values().map(|h| h.retry_at).min()
    }

    /// Service ports held.
    pub(crate) fn ports(&self) -> usize {
        self.held.values().map(|h| h.ports).sum()
    }

    /// After a successful sync that rendered `tried` (every service but the withheld ones, on a full
    /// sync): a service refused again waits twice as long, one refused for the first time waits
    /// `FIRST_RETRY`, and one the kernel took is released.
    pub(crate) fn after_sync(
        &mut self,
        report: &SyncReport,
        tried: impl Fn(&NamespacedName) -> bool,
        now: Instant,
    ) {
        let mut refused: BTreeMap<&NamespacedName, (usize, &str)> = BTreeMap::new();
        for (port, reason) in &report.rejected {
            let entry = refused.entry(&port.service).or_insert((0, reason));
            entry.0 += 1;
        }
        self.held.retain(|name, _| {
            let released = tried(name) && !refused.contains_key(name);
            if released {
                tracing::info!(service = %name, "the kernel takes the service it refused before");
            }
            !released
        });
        for (name, (ports, reason)) in refused {
            let backoff = match self.held.get(name) {
                Some(h) => (h.backoff * 2).min(MAX_RETRY),
                None => {
                    self.notices.send(Notice {
                        about: About::Service(name.clone()),
                        warning: true,
                        reason: "FailedToProgramService",
                        action: "Sync",
                        note: format!(
                            "the kernel refuses {ports} port(s) of this service, left out while every other \
                             service is programmed (retried with a backoff): {reason}"
                        ),
                    });
                    FIRST_RETRY
                }
            };
            tracing::warn!(
                service = %name, ports, retry_in_s = backoff.as_secs(), error = reason,
                "the kernel refuses the service: left out, every other service is programmed"
            );
            let held = Held {
                ports,
                reason: reason.to_owned(),
                retry_at: now + backoff,
                backoff,
            };
            self.held.insert(name.clone(), held);
        }
    }

    /// The refused services with the kernel's answer, for the health report.
    pub(crate) fn describe(&self) -> Vec<(String, String)> {
        self.held
            .iter()
            .map(|(name, h)| (name.to_string(), h.reason.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_model::{Protocol, ServicePortName};

    fn rejected(names: &[&str]) -> SyncReport {
        SyncReport {
            rejected: names
                .iter()
                .map(|n| {
                    let port = ServicePortName {
                        service: NamespacedName::new("ns", *n),
                        port: "p".into(),
                        protocol: Protocol::Tcp,
                    };
                    (port, "Numerical result out of range".to_string())
                })
                .collect(),
            ..SyncReport::default()
        }
    }

    #[test]
    fn a_refused_service_is_withheld_then_retried_with_a_growing_backoff_until_taken() {
        let (bad, good) = (
            NamespacedName::new("ns", "bad"),
            NamespacedName::new("ns", "good"),
        );
        let (sent_tx, sent) = std::sync::mpsc::channel();
        let mut q = Quarantine {
            notices: Notices::new(move |n| sent_tx.send(n).unwrap()),
            ..Quarantine::default()
        };
        let t0 = Instant::now();
        q.after_sync(&rejected(&["bad"]), |_| true, t0);
        assert_eq!(q.ports(), 1);
        // The first refusal is a Warning Event on the service, naming the kernel's answer.
        let n = sent.try_recv().unwrap();
        assert_eq!(n.about, About::Service(bad.clone()));
        assert!(
            n.warning && n.note.ends_with("Numerical result out of range"),
            "{n:?}"
        );
        assert_eq!(q.withheld(t0), [bad.clone()].into());
        assert!(q.due(t0).is_empty());
        assert_eq!(q.next_retry(), Some(t0 + FIRST_RETRY));
        // Refused again at its retry: it waits twice as long.
        let t1 = t0 + FIRST_RETRY;
        assert_eq!(q.due(t1), [bad.clone()].into());
        q.after_sync(&rejected(&["bad"]), |_| true, t1);
        assert_eq!(q.next_retry(), Some(t1 + FIRST_RETRY * 2));
        assert!(sent.try_recv().is_err(), "one event, not one per retry");
        // A sync that did not render it (a full sync withholding it) does not release it.
        q.after_sync(&rejected(&[]), |n| *n == good, t1);
        assert_eq!(q.ports(), 1);
        // Taken: released.
        q.after_sync(&rejected(&[]), |n| *n == bad, t1);
        assert_eq!(q.ports(), 0);
        assert!(q.next_retry().is_none());
    }
}
