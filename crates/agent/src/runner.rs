//! kube-proxy's sync-runner semantics (its BoundedFrequencyRunner with a burst of 2): the first change after a
//! quiet period syncs at once, and a burst of changes coalesces into at most one sync per
//! `--min-sync-period`. A token bucket: two tokens, one back every `min_sync_period`, one spent per sync.

use std::time::{Duration, Instant};

/// Syncs allowed back to back after a quiet period (kube-proxy's `burstSyncs`).
pub(crate) const BURST: u32 = 2;

#[derive(Debug, Clone)]
/// kube-proxy's BoundedFrequencyRunner (burst 2): the token bucket that says when a requested sync may run.
pub(crate) struct SyncRunner {
    min_interval: Duration,
    /// Tokens at `at`, in units of one sync (fractions are partly refilled tokens).
    tokens: f64,
    at: Instant,
}

impl SyncRunner {
    /// A runner with a full bucket at `now`: [`BURST`] syncs may run at once, then one per `min_interval`.
    pub(crate) fn new(min_interval: Duration, now: Instant) -> SyncRunner {
        SyncRunner {
            min_interval,
            tokens: f64::from(BURST),
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        if self.min_interval.is_zero() {
            self.tokens = f64::from(BURST);
        } else {
            let earned = now.saturating_duration_since(self.at).as_secs_f64()
                / self.min_interval.as_secs_f64();
            self.tokens = (self.tokens + earned).min(f64::from(BURST));
        }
        self.at = now;
    }

    /// When a sync requested now may run: now, or when the next token is back.
    pub(crate) fn next_allowed(&mut self, now: Instant) -> Instant {
        self.refill(now);
        if self.tokens >= 1.0 {
            now
        } else {
            now + self.min_interval.mul_f64(1.0 - self.tokens)
        }
    }

    /// A sync ran now. A sync that had to run early (a repair) spends what is left and never goes into debt.
    pub(crate) fn ran(&mut self, now: Instant) {
        self.refill(now);
        self.tokens = (self.tokens - 1.0).max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(1);

    #[test]
    fn a_quiet_runner_syncs_twice_at_once_then_once_per_interval() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(MIN, t0);
        assert_eq!(r.next_allowed(t0), t0);
        r.ran(t0);
        assert_eq!(r.next_allowed(t0), t0, "burst of two");
        r.ran(t0);
        assert_eq!(r.next_allowed(t0), t0 + MIN);
        let t1 = t0 + MIN;
        r.ran(t1);
        assert_eq!(r.next_allowed(t1), t1 + MIN, "steady: one per interval");
    }

    #[test]
    fn a_quiet_period_restores_the_burst() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(MIN, t0);
        r.ran(t0);
        r.ran(t0);
        let later = t0 + MIN * 10;
        assert_eq!(r.next_allowed(later), later);
        r.ran(later);
        assert_eq!(r.next_allowed(later), later);
    }

    #[test]
    fn half_a_token_waits_half_an_interval() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(MIN, t0);
        r.ran(t0);
        r.ran(t0);
        let half = t0 + MIN / 2;
        assert_eq!(r.next_allowed(half), t0 + MIN);
    }

    #[test]
    fn an_early_sync_never_goes_into_debt() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(MIN, t0);
        for _ in 0..5 {
            r.ran(t0);
        }
        assert_eq!(r.next_allowed(t0), t0 + MIN);
    }

    #[test]
    fn no_minimum_never_waits() {
        let t0 = Instant::now();
        let mut r = SyncRunner::new(Duration::ZERO, t0);
        for _ in 0..10 {
            r.ran(t0);
            assert_eq!(r.next_allowed(t0), t0);
        }
    }
}
