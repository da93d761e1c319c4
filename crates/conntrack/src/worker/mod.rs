//! Conntrack cleanup beside the proxy loop, so that no sync waits for a conntrack walk (one walk of 500k
//! entries takes 200–285 ms).
//!
//! The [`Planner`] stays on the caller's thread: it turns each commit's changes into targets and resolves
//! them against the state of that commit (cheap, proportional to the changes). The [`Walk`]er runs on a
//! thread of its own, one job at a time, in the order of the commits. A job that is still waiting for its
//! turn when the next commit's targets come is merged with them and resolved again against the newer state
//! (what a retry does too), so a slow walk never lets a backlog grow. The targets of a failed walk come back to
//! the planner and are looked at again after the next commit.
//!
//! A walk in progress while a later commit lands was planned against the older state: an endpoint that the
//! later commit adds back (or makes serving again) gets new flows that the older filter finds stale. So each
//! commit also resolves what it touched of the running walk's targets against its own state (O(changes)), and
//! the walk deletes only what both verdicts find stale (asked right before the deletes: a flow confirmed between that question and its
//! delete, a window of microseconds, can still go; it is re-balanced by the rules on its next packet).

use super::cleaner::{log_black_holes, log_cleanup, Cleaner, Planner, Queued};
use super::filter::StaleFilter;
use super::options::{CleanupError, CleanupReport};
use super::plan::Targets;
use super::unnated::Frontends;
use super::walker::Walker;
use super::wire::Entry;
use super::Metrics;
use nftkube_model::{Changes, ClusterState};
use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long [`CleanupQueue::stop`] waits for the queued walks (each is bounded by the netlink transport's
/// own limits; at 500k entries one takes a few hundred milliseconds).
pub(crate) const STOP_DEADLINE: Duration = Duration::from_secs(5);

/// The kernel half of a cleanup, as the worker thread uses it ([`Walker`]; tests put a fake or a wrapper
/// in its place).
pub trait Walk: Send + 'static {
    /// Deletes the entries `filter` finds stale, but those that `still_stale`, asked after the dumps and
    /// right before the deletes, no longer finds stale.
    fn cleanup(
        &mut self,
        filter: &StaleFilter,
        still_stale: &dyn Fn(&Entry) -> bool,
    ) -> Result<CleanupReport, CleanupError>;
    /// Deletes the flows to `frontends` that were never DNATed.
    fn clear_black_holes(&mut self, frontends: &Frontends) -> Result<CleanupReport, CleanupError>;
}

impl Walk for Walker {
    fn cleanup(
        &mut self,
        filter: &StaleFilter,
        still_stale: &dyn Fn(&Entry) -> bool,
    ) -> Result<CleanupReport, CleanupError> {
        self.cleanup_checked(filter, still_stale)
    }

    fn clear_black_holes(&mut self, frontends: &Frontends) -> Result<CleanupReport, CleanupError> {
        Walker::clear_black_holes(self, frontends)
    }
}

enum Work {
    /// Stale flows after commits; `targets` go back to the planner if the walk fails.
    Clean {
        targets: Targets,
        filter: StaleFilter,
    },
    /// Flows to our frontends that were never DNATed, after a repair.
    BlackHoles(Frontends),
}

struct Job {
    /// Numbers the jobs, so a refreshed filter is matched to its walk.
    id: u64,
    work: Work,
    /// The commits this job follows (several when waiting jobs were merged).
    first_commit: u64,
    last_commit: u64,
    queued_at: Instant,
}

#[derive(Default)]
struct Queue {
    /// Jobs not started yet, oldest first.
    jobs: VecDeque<Job>,
    /// No more jobs will come: finish these and end.
    closing: bool,
    /// Give up: drop the jobs not started and end after the one in progress.
    abandon: bool,
    /// A job is in progress (taken from `jobs`, its outcome not yet handed back).
    busy: bool,
    /// The cleanup in progress: its job and targets (shared, not copied: a startup walk's are the cluster's).
    running: Option<(u64, Arc<Targets>)>,
    /// What later commits changed of it (see [`CleanupQueue::after_sync`]).
    refreshed: Option<Arc<Refreshed>>,
}

/// The part of a running walk's targets that commits after its planning touched, resolved against the newest
/// commit's state.
struct Refreshed {
    job: u64,
    targets: Targets,
    filter: StaleFilter,
}

impl Refreshed {
    /// The newest verdict on `e` if a later commit touched its destination.
    fn verdict(&self, e: &Entry) -> Option<bool> {
        let touched = self.filter.judges(e) || self.targets.ips.contains(&e.orig.dst);
        touched.then(|| self.filter.is_stale(e))
    }
}

impl Queue {
    /// Whether `e`, found stale by job `id`'s filter, is still stale as of the newest commit.
    fn still_stale(&self, id: u64, e: &Entry) -> bool {
        match &self.refreshed {
            Some(r) if r.job == id => r.verdict(e).unwrap_or(true),
            _ => true,
        }
    }
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// The worker waits on it for jobs.
    wake: Condvar,
    /// Signalled when the worker finished a job and found none waiting.
    idle: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic elsewhere cannot leave the queue half-updated (every change is one push, pop or flag).
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Conntrack cleanup beside the proxy loop: targets are computed on the caller's thread from the state of the
/// commit they follow (cheap, proportional to the changes); the kernel walk runs on a thread of its own, in
/// commit order.
pub struct CleanupQueue {
    planner: Planner,
    shared: Arc<Shared>,
    /// Targets of walks that failed, back from the worker.
    failed: mpsc::Receiver<Targets>,
    /// Disconnected when the worker thread ends.
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
    metrics: Arc<Metrics>,
    /// Commits reported so far (`after_sync` calls): numbers the jobs in the logs.
    commits: u64,
    /// Jobs queued so far.
    jobs: u64,
}

impl CleanupQueue {
    /// Spawns the worker thread. It inherits the calling thread's network namespace (a thread's namespace
    /// is its creator's), and the walker opens its ctnetlink socket there on first use: call this on the
    /// thread, or in the namespace, whose conntrack table the proxy programs for.
    pub fn start(cleaner: Cleaner) -> std::io::Result<CleanupQueue> {
        let metrics = cleaner.metrics();
        let (planner, walker) = cleaner.into_parts();
        CleanupQueue::start_with(planner, walker, metrics)
    }

    /// [`Self::start`] with any walker (tests wrap or fake the real one); `metrics` are what
    /// [`Self::metrics`] hands out.
    pub fn start_with<W: Walk>(
        planner: Planner,
        walker: W,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<CleanupQueue> {
        let shared = Arc::new(Shared::default());
        let (failed_tx, failed) = mpsc::channel();
        let (done_tx, done) = mpsc::channel::<()>();
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("conntrack-cleanup".into())
            .spawn(move || {
                let _done = done_tx; // dropped when this thread ends, however it ends
                yield_to_the_proxy_loop();
                work(walker, &s, &failed_tx);
            })?;
        Ok(CleanupQueue {
            planner,
            shared,
            failed,
            done,
            thread: Some(thread),
            metrics,
            commits: 0,
            jobs: 0,
        })
    }

    /// The walker's counters (shared; an admin endpoint can hold on to them).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// A sync committed: queues the walk for what its changes (and those of failed syncs and walks before it)
    /// made stale. Returns at once.
    ///
    /// A walk in progress was planned against an older state: what this commit touched of its targets is
    /// resolved again against this one, and the walk spares what this commit made healthy (an endpoint added
    /// back serves new flows that the older filter would find stale).
    pub fn after_sync(&mut self, changes: &Changes, state: &ClusterState) {
        self.commits += 1;
        while let Ok(targets) = self.failed.try_recv() {
            self.planner.retry_later(targets);
        }
        let mut targets = self.planner.take_targets(changes, state);
        self.refresh_running(changes, state);
        let mut first_commit = self.commits;
        if let Some((mut waiting, first)) = self.take_waiting_clean() {
            // Not started yet: it runs once, with this commit's targets, judged against this state.
            waiting.merge(targets);
            targets = waiting;
            first_commit = first;
        }
        if targets.is_empty() {
            return;
        }
        let round = self.planner.resolve(targets, state);
        self.push(
            Work::Clean {
                targets: round.targets,
                filter: round.filter,
            },
            first_commit,
        );
    }

    /// A sync failed: its changes wait for the next successful one.
    pub fn sync_failed(&mut self, changes: &Changes) {
        self.planner.sync_failed(changes);
    }

    /// After a repair (following the last `after_sync`): queues the deletion of the flows to `frontends` that
    /// were never DNATed. A black-hole job still waiting is replaced (these frontends are the newer whole set).
    pub fn clear_black_holes(&mut self, frontends: Frontends) {
        if frontends.is_empty() {
            return;
        }
        let mut first_commit = self.commits;
        {
            let mut q = self.shared.lock();
            if let Some(Job {
                work: Work::BlackHoles(_),
                ..
            }) = q.jobs.back()
            {
                first_commit = q.jobs.pop_back().expect("just seen").first_commit;
            }
        }
        self.push(Work::BlackHoles(frontends), first_commit);
    }

    /// Finishes the queued walks (bounded: gives up after [`STOP_DEADLINE`], logged) and joins the thread.
    pub fn stop(self) {
        self.stop_within(STOP_DEADLINE);
    }

    /// [`Self::stop`] with another deadline. Past it, the walks not started are dropped and the thread is left
    /// to end on its own after the walk in progress (whose netlink waits are bounded).
    pub(crate) fn stop_within(mut self, deadline: Duration) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        let queued = {
            let mut q = self.shared.lock();
            q.closing = true;
            q.jobs.len()
        };
        self.shared.wake.notify_all();
        let start = Instant::now();
        match self.done.recv_timeout(deadline) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let dropped = {
                    let mut q = self.shared.lock();
                    q.abandon = true;
                    std::mem::take(&mut q.jobs).len()
                };
                self.shared.wake.notify_all();
                tracing::warn!(
                    waited_ms = start.elapsed().as_secs_f64() * 1000.0,
                    dropped,
                    "conntrack cleanup: giving up on the queued walks at shutdown (the walk in progress ends on its own)"
                );
            }
            _ => {
                if thread.join().is_err() {
                    tracing::error!("conntrack cleanup thread panicked");
                }
                tracing::debug!(
                    queued,
                    elapsed_ms = start.elapsed().as_secs_f64() * 1000.0,
                    "conntrack cleanup: queued walks finished"
                );
            }
        }
    }

    /// Waits until every queued walk has finished and the outcome of each is back (a failed one's targets
    /// included), or `timeout` passed; whether the queue is idle. For tests and tools: the proxy loop never
    /// waits for walks.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.lock();
        while q.busy || !q.jobs.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                return false;
            }
            q = self
                .shared
                .idle
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// Resolves what this commit (and earlier ones since its planning) touched of the cleanup in progress, if
    /// any, against `state`, for the walk's last check. O(changes), not O(the running walk).
    fn refresh_running(&self, changes: &Changes, state: &ClusterState) {
        let (running, earlier) = {
            let q = self.shared.lock();
            let Some((id, targets)) = q.running.clone() else {
                return;
            };
            let earlier = q.refreshed.clone().filter(|r| r.job == id);
            ((id, targets), earlier)
        };
        let (id, targets) = running;
        let mut touched = self.planner.touched(&targets, changes, state);
        if let Some(r) = earlier {
            touched.merge(r.targets.clone());
        }
        if touched.is_empty() {
            return;
        }
        let round = self.planner.resolve(touched, state);
        let refreshed = Arc::new(Refreshed {
            job: id,
            targets: round.targets,
            filter: round.filter,
        });
        let mut q = self.shared.lock();
        if q.running.as_ref().is_some_and(|(job, _)| *job == id) {
            q.refreshed = Some(refreshed);
        }
    }

    /// The newest job if it is a cleanup that has not started: its targets and first commit.
    fn take_waiting_clean(&mut self) -> Option<(Targets, u64)> {
        let mut q = self.shared.lock();
        if !matches!(
            q.jobs.back(),
            Some(Job {
                work: Work::Clean { .. },
                ..
            })
        ) {
            return None;
        }
        let job = q.jobs.pop_back().expect("just seen");
        match job.work {
            Work::Clean { targets, .. } => Some((targets, job.first_commit)),
            Work::BlackHoles(_) => unreachable!("checked above"),
        }
    }

    fn push(&mut self, work: Work, first_commit: u64) {
        self.jobs += 1;
        let job = Job {
            id: self.jobs,
            work,
            first_commit,
            last_commit: self.commits,
            queued_at: Instant::now(),
        };
        self.shared.lock().jobs.push_back(job);
        self.shared.wake.notify_one();
    }
}

impl Drop for CleanupQueue {
    /// Without [`CleanupQueue::stop`]: the worker finishes the queue on its own, nobody waits for it.
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shared.lock().closing = true;
            self.shared.wake.notify_all();
        }
    }
}

/// Walks are background work: on a busy node the proxy loop's commits get the CPU first. Lowers this
/// thread's own nice value (Linux applies it per thread); the kernel's dump and delete work runs in its
/// system calls, so that counts too. A failure changes nothing but the scheduling, and is logged.
fn yield_to_the_proxy_loop() {
    const NICE: libc::c_int = 10;
    // SAFETY: gettid has no preconditions; setpriority with PRIO_PROCESS and a thread id changes the nice
    // value of that thread only, and reads no memory of ours.
    let r = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, NICE)
    };
    if r != 0 {
        tracing::debug!(
            "conntrack cleanup: cannot lower the worker's priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// The worker thread: one job at a time, oldest first, until closed (and the queue empty) or abandoned.
fn work<W: Walk>(mut walker: W, shared: &Shared, failed: &mpsc::Sender<Targets>) {
    while let Some(job) = next_job(shared) {
        let queued = Queued {
            first_commit: job.first_commit,
            last_commit: job.last_commit,
            waited: job.queued_at.elapsed(),
        };
        match job.work {
            Work::Clean { targets, filter } => {
                let targets = Arc::new(targets);
                shared.lock().running = Some((job.id, targets.clone()));
                let still_stale = |e: &Entry| shared.lock().still_stale(job.id, e);
                let result = walker.cleanup(&filter, &still_stale);
                shared.lock().running = None; // the planner's copy, if it holds one, is its last
                if log_cleanup(&result, Some(queued)).is_none() {
                    // The planner may be gone at shutdown: then nobody retries, as nobody syncs.
                    let targets = Arc::try_unwrap(targets).unwrap_or_else(|t| (*t).clone());
                    let _ = failed.send(targets);
                }
            }
            Work::BlackHoles(frontends) => {
                log_black_holes(&walker.clear_black_holes(&frontends), Some(queued));
            }
        }
        let mut q = shared.lock();
        q.busy = false;
        q.running = None;
        q.refreshed = None;
        if q.jobs.is_empty() {
            shared.idle.notify_all();
        }
    }
}

fn next_job(shared: &Shared) -> Option<Job> {
    let mut q = shared.lock();
    loop {
        if q.abandon {
            return None;
        }
        if let Some(job) = q.jobs.pop_front() {
            q.busy = true;
            return Some(job);
        }
        if q.closing {
            return None;
        }
        q = shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
    }
}

#[cfg(test)]
mod tests;
