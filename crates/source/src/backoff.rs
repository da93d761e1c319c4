//! The API watchers' backoff: exponential with jitter while the API fails (0.2 s, doubling every second error
//! up to 30 s, plus a random part of up to as much again), and back to the start as soon as the API answers
//! one of the watcher's requests again.
//!
//! Why it starts lower than kube-runtime's default (client-go's reflector: 0.8 s, doubling every error): a
//! change made right after a short outage should reach the kernel within 1 s of the API's return (issue 14).
//! With 0.8 s + jitter, a watch that failed once waits up to 1.6 s. Here the first two delays are 0.2–0.4 s
//! and the next two 0.4–0.8 s, so an outage of up to ~1 s is followed by a retry within ~0.8 s; longer
//! outages back off as steeply as before (30 s after ~16 errors), and the jitter spreads a fleet's retries.
//!
//! Why not kube-runtime's `default_backoff()` (kube-runtime 5): its `StreamBackoff` resets the backoff only
//! when the watcher emits an `Ok` item, and a watcher that re-establishes its watch emits none: a watch
//! started from `InitListed` becomes `Watching` without an event, and bookmarks yield none either
//! (`watcher.rs`, `step_trampolined`), so nothing is emitted until an object changes. Its `ResetTimerBackoff`
//! resets on its own only when two errors are more than 120 s apart. After a short outage the watcher is
//! back, but its backoff is not: the next outage continues the sequence where the last one left it (0.8 s,
//! then 1.6, 3.2, 6.4, 12.8 s ...), and the first change after the API returns waits for that sleep.
//!
//! Here each watcher has a client of its own whose successful answers (HTTP 2xx: a list page, or the
//! headers of a watch, which the API server sends as soon as the watch is established) are counted
//! ([`Answered`]); the backoff starts over at the first error after any such answer. A watch that is refused
//! outright (connection refused, 5xx, 403) counts nothing, so a lasting outage still backs off to 30 s.

use kube::runtime::utils::Backoff;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The first delay after an error (before jitter); it doubles every second error.
pub(crate) const MIN_DELAY: Duration = Duration::from_millis(200);
/// The longest delay before jitter.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(30);

/// Successful answers to one watcher's requests, counted by its client.
#[derive(Debug, Clone, Default)]
pub(crate) struct Answered(Arc<AtomicU64>);

impl Answered {
    /// How many times it backed off.
    pub(crate) fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    /// Counts `res` if it is a success; hands it on unchanged.
    pub(crate) fn observe<B>(&self, res: http::Response<B>) -> http::Response<B> {
        if res.status().is_success() {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        res
    }
}

/// A client for `config` whose successful answers `answered` counts.
pub(crate) fn counting_client(
    config: kube::Config,
    answered: &Answered,
) -> Result<kube::Client, kube::Error> {
    let answered = answered.clone();
    let count = tower::util::MapResponseLayer::new(
        move |res: http::Response<Box<kube::client::DynBody>>| answered.observe(res),
    );
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&count)
        .build())
}

/// Exponential backoff with jitter that starts over once the watcher's requests are answered again.
pub(crate) struct WatchBackoff {
    answered: Answered,
    /// `answered` when the last delay was handed out.
    seen: u64,
    /// Errors since the last answer.
    attempt: u32,
    rng: fastrand::Rng,
}

impl WatchBackoff {
    /// A backoff that starts over whenever `answered` moves (a request of the watcher was answered).
    pub(crate) fn new(answered: Answered) -> WatchBackoff {
        WatchBackoff::with_rng(answered, fastrand::Rng::new())
    }

    fn with_rng(answered: Answered, rng: fastrand::Rng) -> WatchBackoff {
        let seen = answered.count();
        WatchBackoff {
            answered,
            seen,
            attempt: 0,
            rng,
        }
    }

    /// The delay before jitter after `attempt` errors in a row.
    fn base(attempt: u32) -> Duration {
        MIN_DELAY
            .saturating_mul(1u32 << (attempt / 2).min(16))
            .min(MAX_DELAY)
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    /// The delay after an error: the sequence starts over if the API answered since the last one.
    fn next(&mut self) -> Option<Duration> {
        let answered = self.answered.count();
        if answered != self.seen {
            self.seen = answered;
            self.attempt = 0;
        }
        let base = Self::base(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        Some(base + base.mul_f64(self.rng.f64()))
    }
}

impl Backoff for WatchBackoff {
    /// The watcher emitted an event: it is working.
    fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff() -> (WatchBackoff, Answered) {
        let answered = Answered::default();
        (
            WatchBackoff::with_rng(answered.clone(), fastrand::Rng::with_seed(7)),
            answered,
        )
    }

    fn answer(a: &Answered, status: u16) {
        let res = http::Response::builder().status(status).body(()).unwrap();
        a.observe(res);
    }

    /// Each delay lies in [base, 2 × base).
    fn assert_around(d: Duration, base: Duration) {
        assert!(d >= base && d < base * 2, "{d:?} for a base of {base:?}");
    }

    #[test]
    fn doubles_every_second_error_from_200_ms_to_30_s_with_jitter_while_the_api_fails() {
        let (mut b, a) = backoff();
        let bases = [
            0.2, 0.2, 0.4, 0.4, 0.8, 0.8, 1.6, 1.6, 3.2, 3.2, 6.4, 6.4, 12.8, 12.8, 25.6, 25.6,
            30.0, 30.0,
        ];
        for base in bases {
            assert_around(b.next().unwrap(), Duration::from_secs_f64(base));
            // Refusals are not answers.
            answer(&a, 503);
            answer(&a, 403);
        }
        let delays: Vec<Duration> = (0..20).map(|_| b.next().unwrap()).collect();
        assert!(delays.iter().all(|d| *d >= MAX_DELAY && *d < MAX_DELAY * 2));
        assert!(
            delays.windows(2).any(|w| w[0] != w[1]),
            "no jitter: {delays:?}"
        );
    }

    #[test]
    fn starts_over_after_an_answer_between_outages() {
        let (mut b, a) = backoff();
        for _ in 0..4 {
            // An outage: two errors, then the API answers the re-established watch.
            assert_around(b.next().unwrap(), MIN_DELAY);
            assert_around(b.next().unwrap(), MIN_DELAY);
            assert_around(b.next().unwrap(), MIN_DELAY * 2);
            answer(&a, 200);
        }
        // Several answers count as one.
        answer(&a, 200);
        answer(&a, 201);
        assert_around(b.next().unwrap(), MIN_DELAY);
        // An event from the watcher resets too (kube-runtime's StreamBackoff calls reset()).
        b.next();
        b.reset();
        assert_around(b.next().unwrap(), MIN_DELAY);
    }
}
