//! What wakes the proxy loop, and how: every thread that has news for the loop rings its doorbell, and the
//! loop sleeps on its inbox until a ring or its next timer. Nothing polls.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

/// One reason to wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The source has events waiting (its own channel holds them, in order).
    Source,
    /// Someone else changed our tables, or nf_tables events were lost: read back and repair.
    Drift,
    /// Stop was asked (a signal, or the embedding program).
    Stop,
}

/// A handle that wakes the loop; cheap to clone, usable from any thread (never from a signal handler).
#[derive(Debug, Clone)]
pub struct Doorbell(Sender<Wake>);

impl Doorbell {
    /// Wakes the loop. A loop that has ended ignores it.
    pub(crate) fn ring(&self, why: Wake) {
        let _ = self.0.send(why);
    }

    /// A callback that rings with `why`, for threads that know nothing of the loop (sources, the monitor).
    pub fn notifier(&self, why: Wake) -> nftkube_source::Notify {
        let bell = self.clone();
        Arc::new(move || bell.ring(why))
    }
}

/// How a proxy loop is asked to stop: the flag it checks, and a ring so that it notices at once.
#[derive(Debug, Clone)]
pub struct StopHandle {
    flag: Arc<AtomicBool>,
    bell: Doorbell,
}

impl StopHandle {
    /// Asks the loop to stop; it returns after its current step.
    pub fn stop(&self) {
        self.flag.store(true, Ordering::SeqCst);
        self.bell.ring(Wake::Stop);
    }
}

/// The loop's side: where the rings arrive.
#[derive(Debug)]
pub struct Inbox {
    rx: Receiver<Wake>,
    tx: Sender<Wake>,
    stop: Arc<AtomicBool>,
}

impl Inbox {
    /// An inbox and the handle that stops the loop reading it.
    pub fn new() -> (StopHandle, Inbox) {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let handle = StopHandle {
            flag: stop.clone(),
            bell: Doorbell(tx.clone()),
        };
        (handle, Inbox { rx, tx, stop })
    }

    /// A doorbell that wakes this inbox, for the threads that feed it.
    pub(crate) fn doorbell(&self) -> Doorbell {
        Doorbell(self.tx.clone())
    }

    /// Whether a stop was asked for.
    pub(crate) fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Sleeps until a ring or `deadline` (None: no timer), then returns every ring that has arrived, without
    /// duplicates: a burst of rings costs one pass of the loop.
    pub(crate) fn wait(&self, deadline: Option<Instant>) -> Vec<Wake> {
        let first = match deadline {
            None => self.rx.recv().ok(),
            // A timeout, or (never: the inbox holds a sender) every sender gone.
            Some(d) => self
                .rx
                .recv_timeout(d.saturating_duration_since(Instant::now()))
                .ok(),
        };
        let mut rings: Vec<Wake> = first.into_iter().collect();
        while let Ok(w) = self.rx.try_recv() {
            if !rings.contains(&w) {
                rings.push(w);
            }
        }
        rings
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rings_coalesce_and_a_deadline_ends_the_wait() {
        let (_stop, inbox) = Inbox::new();
        let bell = inbox.doorbell();
        for _ in 0..100 {
            bell.ring(Wake::Source);
        }
        bell.ring(Wake::Drift);
        assert_eq!(inbox.wait(None), vec![Wake::Source, Wake::Drift]);
        let deadline = Instant::now() + Duration::from_millis(20);
        assert_eq!(inbox.wait(Some(deadline)), vec![]);
        assert!(Instant::now() >= deadline);
    }

    #[test]
    fn stop_sets_the_flag_and_wakes_a_sleeping_loop() {
        let (stop, inbox) = Inbox::new();
        let t = std::thread::spawn(move || {
            let rings = inbox.wait(None);
            (rings, inbox.stop_requested())
        });
        stop.stop();
        assert_eq!(t.join().unwrap(), (vec![Wake::Stop], true));
    }

    #[test]
    fn a_callback_rings_from_another_thread() {
        let (_stop, inbox) = Inbox::new();
        let notify = inbox.doorbell().notifier(Wake::Drift);
        std::thread::spawn(move || notify()).join().unwrap();
        assert_eq!(inbox.wait(None), vec![Wake::Drift]);
    }
}
