//! The `process_*` metrics every Kubernetes component exports (client_golang's process collector, which
//! kube-proxy registers), read from `/proc/self` at each scrape: no binaries, no cached values, no
//! system calls but file reads.
//!
//! A value that cannot be read (a file missing, an unexpected layout) is left out of that scrape rather
//! than shown as 0: a 0 would look like a real reading to an alert.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use std::fmt;

/// What one scrape read; None where the reading failed.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct ProcessStats {
    cpu_seconds: Option<f64>,
    open_fds: Option<f64>,
    max_fds: Option<f64>,
    virtual_bytes: Option<f64>,
    virtual_max_bytes: Option<f64>,
    resident_bytes: Option<f64>,
    start_time_seconds: Option<f64>,
}

/// The fields of `/proc/<pid>/stat` used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    /// User and system CPU time, in clock ticks (fields 14 and 15).
    cpu_ticks: u64,
    /// Start time after boot, in clock ticks (field 22).
    start_ticks: u64,
    /// Virtual memory size in bytes (field 23).
    vsize: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may itself hold spaces
/// and parentheses: the fields are counted from after its last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    // rest[0] is field 3 (state).
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        cpu_ticks: field(14)? + field(15)?,
        start_ticks: field(22)?,
        vsize: field(23)?,
    })
}

/// The value of `key:` in `/proc/<pid>/status`, in bytes (the file gives kB).
fn status_kb(text: &str, key: &str) -> Option<u64> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?;
    let kb: u64 = line.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// The soft limit of `name` in `/proc/<pid>/limits`; "unlimited" as `u64::MAX` (what client_golang shows).
fn soft_limit(text: &str, name: &str) -> Option<u64> {
    let rest = text.lines().find_map(|l| l.strip_prefix(name))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX),
        n => n.parse().ok(),
    }
}

/// `AT_CLKTCK`: the auxiliary vector's entry for the clock tick rate.
const AT_CLKTCK: u64 = 17;

/// The unit of the CPU and start times of `/proc/<pid>/stat` (`USER_HZ`), in ticks per second, from the
/// auxiliary vector the kernel gave this process (`/proc/self/auxv`: native-endian (type, value) pairs of
/// native words, ending with type 0). That is where the C library's `sysconf(_SC_CLK_TCK)` reads it; a
/// file read needs no `unsafe` nor a layer-0 crate of its own.
fn clock_ticks(auxv: &[u8]) -> Option<u64> {
    const WORD: usize = std::mem::size_of::<usize>();
    let word = |b: &[u8]| -> u64 {
        let mut w = [0u8; WORD];
        w.copy_from_slice(b);
        usize::from_ne_bytes(w) as u64
    };
    auxv.chunks_exact(2 * WORD)
        .map(|pair| (word(&pair[..WORD]), word(&pair[WORD..])))
        .take_while(|&(kind, _)| kind != 0)
        .find(|&(kind, _)| kind == AT_CLKTCK)
        .map(|(_, ticks)| ticks)
        .filter(|&t| t > 0)
}

/// `btime` of `/proc/stat`: boot time in Unix seconds.
fn boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

impl ProcessStats {
    /// Reads this process's statistics now.
    fn read() -> ProcessStats {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let stat = read("/proc/self/stat").and_then(|t| parse_stat(&t));
        let status = read("/proc/self/status");
        let limits = read("/proc/self/limits");
        let ticks = std::fs::read("/proc/self/auxv")
            .ok()
            .and_then(|a| clock_ticks(&a))
            .map(|t| t as f64);
        let boot = read("/proc/stat").and_then(|t| boot_time(&t));
        let f = |v: u64| v as f64;
        ProcessStats {
            cpu_seconds: stat.zip(ticks).map(|(s, t)| f(s.cpu_ticks) / t),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|d| d.count() as f64),
            max_fds: limits
                .as_deref()
                .and_then(|l| soft_limit(l, "Max open files"))
                .map(f),
            virtual_bytes: stat.map(|s| f(s.vsize)),
            virtual_max_bytes: limits
                .as_deref()
                .and_then(|l| soft_limit(l, "Max address space"))
                .map(f),
            resident_bytes: status.as_deref().and_then(|s| status_kb(s, "VmRSS")).map(f),
            start_time_seconds: stat
                .zip(ticks)
                .zip(boot)
                .map(|((s, t), b)| f(b) + f(s.start_ticks) / t),
        }
    }
}

/// Encodes the `process_*` families, read at each scrape.
#[derive(Debug, Default)]
pub(crate) struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        encode_stats(&ProcessStats::read(), encoder)
    }
}

fn encode_stats(s: &ProcessStats, mut encoder: DescriptorEncoder) -> fmt::Result {
    if let Some(v) = s.cpu_seconds {
        let c = ConstCounter::new(v);
        // Registered as `process_cpu_seconds`: counters are written with `_total`.
        c.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            c.metric_type(),
        )?)?;
    }
    for (name, help, value) in [
        (
            "process_open_fds",
            "Number of open file descriptors",
            s.open_fds,
        ),
        (
            "process_max_fds",
            "Maximum number of open file descriptors",
            s.max_fds,
        ),
        (
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            s.virtual_bytes,
        ),
        (
            "process_virtual_memory_max_bytes",
            "Maximum amount of virtual memory available in bytes",
            s.virtual_max_bytes,
        ),
        (
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            s.resident_bytes,
        ),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            s.start_time_seconds,
        ),
    ] {
        if let Some(v) = value {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_are_parsed() {
        // A command name with a space and a parenthesis; fields 14, 15 = 7, 5; 22 = 4786688; 23 = 3133440.
        let stat =
            "24351 (ca t) x) R 24348 24348 29549 0 -1 4194304 122 0 0 0 7 5 0 0 20 0 1 0 4786688 \
                    3133440 382 18446744073709551615 93878033612800";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                cpu_ticks: 12,
                start_ticks: 4786688,
                vsize: 3133440,
            })
        );
        assert_eq!(parse_stat("1 (x) R 2 3"), None);
        let status = "Name:\tx\nVmSize:\t    3892 kB\nVmRSS:\t    2064 kB\n";
        assert_eq!(status_kb(status, "VmRSS"), Some(2064 * 1024));
        assert_eq!(status_kb(status, "VmSwap"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 20000                files     \n\
                      Max address space         unlimited            unlimited            bytes     \n";
        assert_eq!(soft_limit(limits, "Max open files"), Some(1024));
        assert_eq!(soft_limit(limits, "Max address space"), Some(u64::MAX));
        assert_eq!(boot_time("cpu 1 2\nbtime 1795856148\n"), Some(1795856148));
        let aux = |pairs: &[(usize, usize)]| -> Vec<u8> {
            pairs
                .iter()
                .flat_map(|(k, v)| [k.to_ne_bytes(), v.to_ne_bytes()])
                .flatten()
                .collect()
        };
        assert_eq!(
            clock_ticks(&aux(&[(6, 4096), (17, 100), (0, 0)])),
            Some(100)
        );
        // Past the end marker nothing counts.
        assert_eq!(clock_ticks(&aux(&[(6, 4096), (0, 0), (17, 100)])), None);
        // This process's own: the tick rate every Linux reports to user space on common architectures.
        let own = clock_ticks(&std::fs::read("/proc/self/auxv").unwrap());
        assert!(own.is_some_and(|t| (100..=1024).contains(&t)), "{own:?}");
    }

    #[test]
    fn this_process_is_read() {
        let s = ProcessStats::read();
        let now = crate::now_unix_ms() as f64 / 1000.0;
        let start = s.start_time_seconds.expect("start time");
        assert!(
            start <= now + 1.0 && start > now - 86_400.0 * 365.0,
            "{start}"
        );
        assert!(s.resident_bytes.expect("rss") > 100_000.0);
        assert!(s.virtual_bytes.expect("vsize") >= s.resident_bytes.unwrap());
        assert!(s.open_fds.expect("fds") >= 3.0);
        assert!(s.max_fds.expect("limit") >= s.open_fds.unwrap());
        assert!(s.cpu_seconds.expect("cpu") >= 0.0);
        assert!(s.virtual_max_bytes.is_some());
        // Burn some CPU: the counter moves.
        let before = s.cpu_seconds.unwrap();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        assert!(ProcessStats::read().cpu_seconds.unwrap() > before);
    }
}
