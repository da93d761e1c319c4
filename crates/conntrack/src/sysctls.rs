//! The kernel's conntrack table size and timeouts, set as kube-proxy sets them when it starts (and in
//! `--init-only`): through `/proc/sys` and `/sys`, no binary.
//!
//! Each value is read first and written only when it differs. That is what lets the agent run with
//! CAP_NET_ADMIN alone behind a read-only `/proc/sys`: a privileged init container (`nftkube proxy
//! --init-only`) wrote the values, and the agent finds nothing left to write.
//!
//! The table size (`nf_conntrack_max`, and the hash size beside it) is global and only writable from the
//! host's network namespace; the timeouts and `tcp_be_liberal` belong to the network namespace of the
//! writer. The kernel itself refuses the global ones from any other namespace, which is why a test in a
//! namespace of its own cannot change the host's.

use std::fmt;
use std::path::Path;
use std::time::Duration;

/// What kube-proxy's `conntrack` settings ask of the kernel (its defaults: [`Settings::default`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Entries per CPU (`maxPerCore`); 0 leaves the table size as it is, and `min` with it.
    pub max_per_core: u32,
    /// The least table size whatever the CPU count (`min`).
    pub min: u32,
    /// Established TCP idle timeout; None or zero: as it is.
    pub tcp_established_timeout: Option<Duration>,
    /// TCP CLOSE_WAIT timeout; None or zero: as it is.
    pub tcp_close_wait_timeout: Option<Duration>,
    /// Turn on `nf_conntrack_tcp_be_liberal` (false leaves it as it is, as kube-proxy does).
    pub tcp_be_liberal: bool,
    /// Unreplied UDP timeout; None or zero: as it is.
    pub udp_timeout: Option<Duration>,
    /// Assured UDP (stream) timeout; None or zero: as it is.
    pub udp_stream_timeout: Option<Duration>,
}

impl Default for Settings {
    /// kube-proxy's defaults: 32768 per CPU, at least 131072; established 24 h, close-wait 1 h.
    fn default() -> Self {
        Settings {
            max_per_core: 32768,
            min: 131_072,
            tcp_established_timeout: Some(Duration::from_secs(24 * 3600)),
            tcp_close_wait_timeout: Some(Duration::from_secs(3600)),
            tcp_be_liberal: false,
            udp_timeout: None,
            udp_stream_timeout: None,
        }
    }
}

/// One kernel setting to hold a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sysctl {
    /// Its file, relative to the root (`proc/sys/net/netfilter/nf_conntrack_max`).
    pub path: &'static str,
    /// The value it must hold.
    pub value: u64,
}

/// What became of one setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It already held the value.
    Kept(Sysctl),
    /// It held another value and now holds this one.
    Set {
        /// The setting and its value now.
        sysctl: Sysctl,
        /// What it held before.
        from: u64,
    },
    /// It could not be read or written.
    Failed {
        /// The setting and the value it was to hold.
        sysctl: Sysctl,
        /// Why not.
        error: String,
    },
}

impl Outcome {
    /// Whether the kernel does not hold the value.
    pub fn failed(&self) -> bool {
        matches!(self, Outcome::Failed { .. })
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Kept(s) => write!(f, "/{} is {} already", s.path, s.value),
            Outcome::Set { sysctl, from } => {
                write!(f, "/{} set to {} (was {from})", sysctl.path, sysctl.value)
            }
            Outcome::Failed { sysctl, error } => write!(
                f,
                "/{} cannot be set to {}: {error}",
                sysctl.path, sysctl.value
            ),
        }
    }
}

const NETFILTER_MAX: &str = "proc/sys/net/netfilter/nf_conntrack_max";
const HASHSIZE: &str = "sys/module/nf_conntrack/parameters/hashsize";
const TCP_ESTABLISHED: &str = "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established";
const TCP_CLOSE_WAIT: &str = "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait";
const TCP_BE_LIBERAL: &str = "proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal";
const UDP: &str = "proc/sys/net/netfilter/nf_conntrack_udp_timeout";
const UDP_STREAM: &str = "proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream";

/// The table size kube-proxy asks for: `max_per_core` × CPUs, at least `min`; None leaves it as it is.
pub fn table_size(s: &Settings, cpus: u32) -> Option<u64> {
    (s.max_per_core > 0)
        .then(|| (u64::from(s.max_per_core) * u64::from(cpus)).max(u64::from(s.min)))
}

/// The settings that are not the table size, in kube-proxy's order, as (file, value).
fn timeouts(s: &Settings) -> Vec<(&'static str, u64)> {
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs()).filter(|&n| n > 0);
    let mut out = Vec::new();
    let mut add = |name, v: Option<u64>| {
        if let Some(v) = v {
            out.push((name, v));
        }
    };
    add(TCP_ESTABLISHED, secs(s.tcp_established_timeout));
    add(TCP_CLOSE_WAIT, secs(s.tcp_close_wait_timeout));
    add(TCP_BE_LIBERAL, s.tcp_be_liberal.then_some(1));
    add(UDP, secs(s.udp_timeout));
    add(UDP_STREAM, secs(s.udp_stream_timeout));
    out
}

/// Applies `s` under `root` (`/` on a node; a directory of its own in unit tests), with `cpus` online
/// CPUs. Every setting is tried, whatever became of the others; the hash size is raised to a quarter of the
/// table size, as kube-proxy does, only once the table size is in place.
pub fn apply(s: &Settings, root: &Path, cpus: u32) -> Vec<Outcome> {
    let mut out = Vec::new();
    if let Some(max) = table_size(s, cpus) {
        let sized = ensure(root, NETFILTER_MAX, max);
        let in_place = !sized.failed();
        out.push(sized);
        if in_place {
            out.extend(raise_hashsize(root, max / 4));
        }
    }
    for (path, value) in timeouts(s) {
        out.push(ensure(root, path, value));
    }
    out
}

/// The hash size only ever grows, and only when it is below `want` (kube-proxy's rule: a write from outside
/// the host's network namespace fails, and is not needed when the size is large enough already).
fn raise_hashsize(root: &Path, want: u64) -> Option<Outcome> {
    let sysctl = Sysctl {
        path: HASHSIZE,
        value: want,
    };
    match read(&root.join(HASHSIZE)) {
        Ok(now) if now >= want => None,
        Ok(_) => Some(ensure(root, HASHSIZE, want)),
        Err(error) => Some(Outcome::Failed { sysctl, error }),
    }
}

/// Reads the setting at `path` and writes `value` when it holds something else.
fn ensure(root: &Path, path: &'static str, value: u64) -> Outcome {
    let sysctl = Sysctl { path, value };
    let file = root.join(path);
    match read(&file) {
        Ok(now) if now == value => Outcome::Kept(sysctl),
        Ok(from) => match std::fs::write(&file, format!("{value}\n")) {
            Ok(()) => Outcome::Set { sysctl, from },
            Err(e) => Outcome::Failed {
                sysctl,
                error: format!("writing: {e}"),
            },
        },
        Err(error) => Outcome::Failed { sysctl, error },
    }
}

fn read(file: &Path) -> Result<u64, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("reading: {e}"))?;
    text.trim()
        .parse()
        .map_err(|_| format!("reading: not a number: {:?}", text.trim()))
}

/// The online CPUs, as kube-proxy counts them for the table size (every online CPU, not the affinity or
/// cgroup quota of this process): `/sys/devices/system/cpu/online` under `root`, else what std sees.
pub fn online_cpus(root: &Path) -> u32 {
    std::fs::read_to_string(root.join("sys/devices/system/cpu/online"))
        .ok()
        .and_then(|list| count_cpu_list(list.trim()))
        .unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1))
        })
}

/// Counts a kernel CPU list (`0-3,5,7-8`); None when it does not read.
fn count_cpu_list(list: &str) -> Option<u32> {
    list.split(',').try_fold(0u32, |n, part| {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (u32, u32) = (lo.parse().ok()?, hi.parse().ok()?);
        n.checked_add(hi.checked_sub(lo)?.checked_add(1)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake root holding the files kube-proxy's settings touch, with the kernel's defaults.
    fn fake_root(name: &str) -> std::path::PathBuf {
        let root =
            std::env::temp_dir().join(format!("nftkube-sysctls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("proc/sys/net/netfilter")).unwrap();
        std::fs::create_dir_all(root.join("sys/module/nf_conntrack/parameters")).unwrap();
        for (path, v) in [
            (NETFILTER_MAX, 65536),
            (TCP_ESTABLISHED, 432_000),
            (TCP_CLOSE_WAIT, 60),
            (TCP_BE_LIBERAL, 0),
            (UDP, 30),
            (UDP_STREAM, 120),
        ] {
            std::fs::write(root.join(path), format!("{v}\n")).unwrap();
        }
        std::fs::write(root.join(HASHSIZE), "16384\n").unwrap();
        root
    }

    fn value(root: &Path, path: &str) -> u64 {
        read(&root.join(path)).unwrap()
    }

    #[test]
    fn kube_proxys_defaults_size_the_table_and_set_the_tcp_timeouts() {
        let root = fake_root("defaults");
        let out = apply(&Settings::default(), &root, 8);
        assert!(out.iter().all(|o| !o.failed()), "{out:?}");
        // 32768 × 8 CPUs is above the minimum; the hash size follows at a quarter.
        assert_eq!(value(&root, NETFILTER_MAX), 262_144);
        assert_eq!(value(&root, HASHSIZE), 65_536);
        assert_eq!(value(&root, TCP_ESTABLISHED), 86_400);
        assert_eq!(value(&root, TCP_CLOSE_WAIT), 3600);
        // Unset or false settings are left as they are.
        assert_eq!(value(&root, TCP_BE_LIBERAL), 0);
        assert_eq!(value(&root, UDP), 30);
        // A second run finds everything in place and writes nothing.
        let again = apply(&Settings::default(), &root, 8);
        assert!(
            again.iter().all(|o| matches!(o, Outcome::Kept(_))),
            "{again:?}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_minimum_wins_on_small_machines_and_zero_per_core_leaves_the_size() {
        assert_eq!(table_size(&Settings::default(), 2), Some(131_072));
        let off = Settings {
            max_per_core: 0,
            ..Settings::default()
        };
        assert_eq!(table_size(&off, 64), None);
        let root = fake_root("off");
        let out = apply(&off, &root, 2);
        assert_eq!(value(&root, NETFILTER_MAX), 65536);
        assert_eq!(out.len(), 2, "only the two TCP timeouts: {out:?}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn every_setting_is_tried_and_a_failure_names_its_file_and_value() {
        let root = fake_root("failing");
        // The table size cannot be written (as from a network namespace not the host's): the hash size is
        // then not touched, and the timeouts still are.
        std::fs::remove_file(root.join(NETFILTER_MAX)).unwrap();
        std::fs::create_dir(root.join(NETFILTER_MAX)).unwrap();
        let s = Settings {
            tcp_be_liberal: true,
            udp_timeout: Some(Duration::from_secs(45)),
            udp_stream_timeout: Some(Duration::from_millis(500)),
            ..Settings::default()
        };
        let out = apply(&s, &root, 2);
        let failed: Vec<String> = out
            .iter()
            .filter(|o| o.failed())
            .map(|o| o.to_string())
            .collect();
        assert_eq!(failed.len(), 1, "{out:?}");
        assert!(
            failed[0].starts_with(
                "/proc/sys/net/netfilter/nf_conntrack_max cannot be set to 131072: reading:"
            ),
            "{}",
            failed[0]
        );
        assert_eq!(value(&root, HASHSIZE), 16384);
        assert_eq!(value(&root, TCP_BE_LIBERAL), 1);
        assert_eq!(value(&root, UDP), 45);
        // Below a second is "leave it", as kube-proxy's whole-second conversion makes it.
        assert_eq!(value(&root, UDP_STREAM), 120);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn cpu_lists_count_as_the_kernel_writes_them() {
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0-3,5,7-8"), Some(7));
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("x"), None);
    }
}
