//! Large commits without event notifications. For every subscriber of nf_tables events the kernel builds
//! one notification per object and element it commits; the agent's own drift monitor is such a subscriber,
//! so a cold sync of a million endpoints also built a million notifications that the monitor read only to
//! discard as ours (or lost to a full socket, which then asked for a needless full resync): the commit took
//! 6.1 s instead of 2.6 s. So the engine has the monitor leave its group for the length of a large commit,
//! and tells what the monitor missed from the generation id instead: every successful commit, ours or
//! anyone's, advances it by one, so if it moved by more than our own transactions, someone else committed
//! while the monitor was deaf, and the engine reports that as the monitor would have.

/// Element operations from which a plan is committed with the subscriber paused. Below, the notifications
/// cost less than the pause (two socket options and a generation read, some 30 µs).
pub const QUIET_COMMIT_ELEMENTS: usize = 1000;

/// The generation id after `commits` successful commits from `generation` (the kernel skips 0 when it
/// wraps around).
pub(crate) fn advanced(generation: u32, commits: usize) -> u32 {
    let mut g = generation;
    for _ in 0..commits {
        g = g.wrapping_add(1);
        if g == 0 {
            g = 1;
        }
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generation_advances_by_one_per_commit_skipping_zero() {
        assert_eq!(advanced(7, 0), 7);
        assert_eq!(advanced(7, 3), 10);
        assert_eq!(advanced(u32::MAX - 1, 1), u32::MAX);
        assert_eq!(advanced(u32::MAX - 1, 2), 1);
        assert_eq!(advanced(u32::MAX, 3), 3);
    }
}
