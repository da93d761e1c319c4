//! Whose a `--live` trace table is: its name carries the process id, the process's start time and a random
//! part, `nftkube-trace-PID-START-RANDOM`.
//!
//! The process id alone is not enough: two runs in different PID namespaces (two `kubectl debug`
//! containers, both PID 1, in the host's network namespace) would share one table, and the first to stop
//! would remove both runs' rules. The random part makes the name a run's own; the table is created with
//! NLM_F_EXCL, so a name in use is refused instead of shared. The process id and start time let
//! `nftkube cleanup --traces` tell a running trace's table from an abandoned one.

use std::path::Path;

use nftkube_render::names::TRACE_TABLE_PREFIX as TABLE_PREFIX;

/// The run a trace table belongs to, as its name says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner {
    /// The process id, in the PID namespace the trace ran in.
    pub(crate) pid: u32,
    /// The process's start time, in clock ticks after boot (`/proc/PID/stat` field 22); 0 when unknown.
    pub(crate) start: u64,
}

/// This process's trace table name: a new random part on every call.
pub(crate) fn new_table_name() -> String {
    let pid = std::process::id();
    let start = process_start(Path::new("/proc/self")).unwrap_or(0);
    table_name(Owner { pid, start }, fastrand::u64(..))
}

/// `nftkube-trace-PID-START-RANDOM`: at most 14 + 10 + 1 + 20 + 1 + 16 = 62 bytes, well within nf_tables'
/// 255 (NFT_NAME_MAXLEN 256 with its NUL).
fn table_name(owner: Owner, random: u64) -> String {
    format!("{TABLE_PREFIX}{}-{}-{random:016x}", owner.pid, owner.start)
}

/// The owner a trace table's name gives; None for a name of another shape (an older version's
/// `nftkube-trace-PID`, which says too little to tell whether its run is alive).
pub(crate) fn parse_table_name(name: &str) -> Option<Owner> {
    let mut parts = name.strip_prefix(TABLE_PREFIX)?.split('-');
    let pid = parts.next()?.parse().ok()?;
    let start = parts.next()?.parse().ok()?;
    let random = parts.next()?;
    let well_formed = random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit());
    (well_formed && parts.next().is_none()).then_some(Owner { pid, start })
}

/// The start time in `/proc/PID/stat` (field 22): after the command name in parentheses, which may itself
/// hold spaces and parentheses, hence the split at the last `)`.
fn start_time(stat: &str) -> Option<u64> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    // Field 3 (the state) is the first after the name: field 22 is the 20th.
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// The start time of the process whose `/proc` directory is `dir`.
fn process_start(dir: &Path) -> Option<u64> {
    start_time(&std::fs::read_to_string(dir.join("stat")).ok()?)
}

/// The process id in the innermost PID namespace of the process whose `/proc` directory is `dir`: the last
/// field of `NSpid` (the id `std::process::id()` returned to it), or its only id on kernels without NSpid.
fn innermost_pid(dir: &Path) -> Option<u32> {
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .or_else(|| status.lines().find_map(|l| l.strip_prefix("Pid:")))?;
    line.split_whitespace().last()?.parse().ok()
}

/// Whether the run that owns a table still runs: a process visible under `proc` started at the owner's start
/// time and has the owner's id in its own PID namespace. From the host's PID namespace every run is visible
/// (a container's processes too, under other ids); a run in a PID namespace `proc` does not show (a sibling
/// container's) is not, and is taken for ended. An unknown start time (0) never matches.
pub(crate) fn is_running(owner: Owner, proc: &Path) -> std::io::Result<bool> {
    if owner.start == 0 {
        return Ok(false);
    }
    let same_namespace = proc.join(owner.pid.to_string());
    if process_start(&same_namespace) == Some(owner.start)
        && innermost_pid(&same_namespace) == Some(owner.pid)
    {
        return Ok(true);
    }
    for entry in std::fs::read_dir(proc)? {
        let dir = entry?.path();
        let is_process = dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()));
        // A process that ends during the walk reads as None, and is not the owner.
        if is_process
            && process_start(&dir) == Some(owner.start)
            && innermost_pid(&dir) == Some(owner.pid)
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the trace table `name` was left by a run that has ended, as `proc` (a `/proc`) shows processes. A
/// name of another shape (an older version's) says nothing about its run, and counts as abandoned.
pub(crate) fn is_abandoned(name: &str, proc: &Path) -> std::io::Result<bool> {
    match parse_table_name(name) {
        Some(owner) => is_running(owner, proc).map(|running| !running),
        None => Ok(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const PROC: &str = "/proc";

    #[test]
    fn names_of_one_process_never_repeat() {
        let names: BTreeSet<String> = (0..10_000).map(|_| new_table_name()).collect();
        assert_eq!(names.len(), 10_000);
    }

    #[test]
    fn same_pid_in_two_namespaces_gives_two_names() {
        // Two runs as PID 1 in two containers started in the same clock tick: only the random part differs.
        let owner = Owner {
            pid: 1,
            start: 4242,
        };
        assert_ne!(table_name(owner, 1), table_name(owner, 2));
    }

    #[test]
    fn the_longest_name_fits_nf_tables() {
        let owner = Owner {
            pid: u32::MAX,
            start: u64::MAX,
        };
        let name = table_name(owner, u64::MAX);
        assert!(name.len() <= 255, "{} bytes: {name}", name.len());
        assert_eq!(name.len(), 62, "{name}");
    }

    #[test]
    fn names_keep_the_prefix_cleanup_matches_and_parse_back() {
        let name = new_table_name();
        assert!(name.starts_with(TABLE_PREFIX), "{name}");
        let owner = parse_table_name(&name).expect("our own name parses");
        assert_eq!(owner.pid, std::process::id());
        assert_ne!(
            owner.start, 0,
            "the start time is read from /proc/self/stat"
        );
        let other = Owner { pid: 7, start: 123 };
        assert_eq!(parse_table_name(&table_name(other, 0xabc)), Some(other));
    }

    #[test]
    fn other_shapes_do_not_parse() {
        for name in [
            "nftkube-trace-1234", // an older version's
            "nftkube-trace-1-2",
            "nftkube-trace-1-2-xyz0000000000000",
            "nftkube-trace-1-2-0000000000000000-3",
            "nftkube-trace--2-0000000000000000",
            "nftkube-1-2-0000000000000000",
            "nftkube",
        ] {
            assert_eq!(parse_table_name(name), None, "{name}");
        }
    }

    #[test]
    fn the_start_time_is_field_22_even_with_parentheses_in_the_name() {
        let stat = "77 (a) b (c)) S 1 77 77 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(start_time(stat), Some(987_654));
        assert_eq!(start_time("77 (short) S 1"), None);
    }

    #[test]
    fn this_process_runs_and_a_name_with_another_start_does_not() {
        let me = parse_table_name(&new_table_name()).unwrap();
        assert!(is_running(me, Path::new(PROC)).unwrap());
        let restarted = Owner {
            start: me.start + 1,
            ..me
        };
        assert!(!is_running(restarted, Path::new(PROC)).unwrap());
        let unknown = Owner { start: 0, ..me };
        assert!(!is_running(unknown, Path::new(PROC)).unwrap());
    }

    #[test]
    fn a_running_trace_is_not_abandoned_an_old_shape_is() {
        assert!(!is_abandoned(&new_table_name(), Path::new(PROC)).unwrap());
        assert!(is_abandoned("nftkube-trace-1234", Path::new(PROC)).unwrap());
    }

    #[test]
    fn an_ended_process_does_not_run() {
        // A process id nobody holds (from the top of the range, where ids are handed out last), with this
        // process's start time: what a trace that ended leaves in its table's name.
        let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .map_or(32_768, |s| s.trim().parse().unwrap_or(32_768));
        let free = (2..pid_max)
            .rev()
            .find(|pid| !Path::new(PROC).join(pid.to_string()).exists())
            .expect("a free process id");
        let me = parse_table_name(&new_table_name()).unwrap();
        let ended = Owner { pid: free, ..me };
        assert!(!is_running(ended, Path::new(PROC)).unwrap());
    }
}
