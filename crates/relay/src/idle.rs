//! Idle tracking for one relayed TCP connection: each direction marks the connection active when it moves
//! bytes, and a timer ends the connection once neither did for the idle timeout. A relayed connection holds
//! two descriptors and a place under the connection limits, so one a client abandoned must not live forever.
//! Time is tokio's clock (which tests can pause and advance).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// When a connection last moved bytes, as milliseconds since it opened (an atomic, so both directions can
/// mark it without a lock).
#[derive(Debug)]
pub(crate) struct Activity {
    epoch: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    pub(crate) fn new() -> Activity {
        Activity {
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Bytes just moved.
    pub(crate) fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long until the connection has been idle for `timeout`; None once it has.
    fn left(&self, timeout: Duration) -> Option<Duration> {
        let idle = Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.last_ms.load(Ordering::Relaxed)),
        );
        timeout.checked_sub(idle).filter(|d| !d.is_zero())
    }

    /// Completes once no bytes moved for `timeout`. One timer at a time, re-armed for the time left whenever
    /// it fires early (activity meanwhile), so a busy connection costs one wake-up per timeout, not one per
    /// read.
    pub(crate) async fn idle_for(&self, timeout: Duration) {
        while let Some(left) = self.left(timeout) {
            tokio::time::sleep(left).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn activity_postpones_the_end_by_a_whole_timeout() {
        let a = Activity::new();
        let timeout = Duration::from_secs(10);
        let start = tokio::time::Instant::now();
        let idle = a.idle_for(timeout);
        let touch = async {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_secs(6)).await;
                a.touch();
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            () = idle => {}
            () = touch => unreachable!(),
        }
        // Touched at 6, 12 and 18 s: idle from 18 s, so ended at 28 s.
        let took = start.elapsed();
        assert!(took >= Duration::from_secs(28), "{took:?}");
        assert!(took < Duration::from_secs(29), "{took:?}");
    }
}
