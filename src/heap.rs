//! The agent's malloc arenas (glibc), and so how many threads its parallel steps (a manifest parse, a full
//! sync's render) use. `nftkube proxy` chooses once, before any other thread exists, for its source:
//! - **manifests**: one arena per CPU. The parse and the render run on every CPU; in one shared arena their
//!   threads queued on its lock (at 1M endpoints from JSON a third of the render threads' time went to
//!   sleeping and waking on it: cold sync 6.4 s against 4.6 s; at 10k services 350 against 300 ms), and peak
//!   RSS was the same either way (35 / 37 MiB at 10k, 291 / 292 MiB at 1M, two CPUs).
//! - **the API**: one arena, and those steps on one thread. The watcher's thread converts every object the
//!   proxy loop then keeps, and in one arena the loop reuses the memory the watcher's garbage freed. At 1M
//!   endpoints: 293 MiB and 6.4 s this way, 308 MiB and 5.7 s with the render on every CPU in the one arena,
//!   335 MiB and 6.0 s with an arena per CPU.
//!
//! A library user that never calls [`configure`] keeps glibc's arenas and gets one thread per CPU.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether every thread shares one arena (set by [`configure`]).
static ONE_ARENA: AtomicBool = AtomicBool::new(false);

/// How the agent's threads share malloc arenas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arenas {
    /// Every thread in one arena; parallel steps on one thread.
    One,
    /// Up to one arena per CPU; parallel steps on every CPU.
    PerCpu,
}

/// Sets glibc's arena limit. Call it before any other thread exists: glibc fixes the limit when a thread
/// first needs an arena of its own, and a thread keeps the arena it has.
pub fn configure(arenas: Arenas) {
    let limit = match arenas {
        Arenas::One => 1,
        Arenas::PerCpu => i32::try_from(cpus()).unwrap_or(i32::MAX),
    };
    // SAFETY: mallopt only sets a parameter of glibc's allocator; no memory is touched.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, limit);
    }
    ONE_ARENA.store(arenas == Arenas::One, Ordering::Relaxed);
}

/// How many threads a parallel step should use.
pub fn parallelism() -> usize {
    if ONE_ARENA.load(Ordering::Relaxed) {
        1
    } else {
        cpus()
    }
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_arena_means_one_thread_and_per_cpu_one_per_cpu() {
        configure(Arenas::One);
        assert_eq!(parallelism(), 1);
        configure(Arenas::PerCpu);
        assert_eq!(parallelism(), cpus());
    }
}
