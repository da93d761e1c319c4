//! CNI portmap ADD and DEL latency, from process start to exit, with 1, 100 and 1000 mappings already in place:
//! nftkube's plugin as two binaries, `new` (nftkube-portmap, the plugin's own small binary, what ships) and
//! `old` (the nftkube agent binary under the name `portmap`, as nodes ran it before the plugin had its own),
//! against Debian's `stock` portmap (containernetworking-plugins 1.1.1, which runs `iptables`, iptables-nft
//! here) in the same run, each in a fresh namespace of its own.
//!
//! Each plugin's namespace is filled with mappings (one container, one TCP host port each, ADDed the way a
//! runtime does) up to each size in turn; at each size, rounds of ADD then DEL of one more container are timed,
//! from spawning the plugin to its exit, the plugins interleaved round by round (a shared machine's load
//! then weighs on all alike). The floors, measured in the same rounds, are each nftkube binary's VERSION: the
//! same process start and exit with no kernel work (`old VER`, `new VER`). Printed: median, 90th percentile
//! and minimum per command and size, and the old and stock plugins' medians over the new one's. The goal
//! (issue 11): ours ≤ 5 ms, flat in the number of mappings.
//!
//! Run as root: `cargo bench --bench portmap -- 1,100,1000` (also run by `bash ci/bench`), after
//! `cargo build --release --bins`. `NFTKUBE_BENCH_PORTMAP_REPS` sets the timed rounds per size (default 30);
//! `NFTKUBE_BIN` and `NFTKUBE_PORTMAP_BIN` name other builds of the two binaries.

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use nftkube_sandbox::netns::{set_link_up, unique_name, NetNs};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const STOCK: &str = "/usr/lib/cni/portmap";

fn main() {
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "the portmap benchmark needs root (namespaces, nf_tables)"
    );
    assert!(
        Path::new(STOCK).exists(),
        "{STOCK} missing: install containernetworking-plugins (ci/install-deps does)"
    );
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "1,100,1000".into())
        .split(',')
        .map(|s| s.parse().expect("sizes: comma-separated numbers"))
        .collect();
    let reps: usize = std::env::var("NFTKUBE_BENCH_PORTMAP_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    assert!(
        reps <= 5000,
        "at most 5000 rounds (their host ports are 5000 and up, below the filled ones)"
    );
    let dir = std::env::temp_dir().join(unique_name("nftkube-bench-portmap"));
    std::fs::create_dir_all(&dir).unwrap();
    // The agent binary answers as the plugin by its file name.
    let old = dir.join("portmap");
    std::os::unix::fs::symlink(release_binary("NFTKUBE_BIN", "nftkube"), &old).unwrap();
    let new = release_binary("NFTKUBE_PORTMAP_BIN", "nftkube-portmap");

    // The order of the medians' ratios below: new first.
    let mut subjects = [
        Subject::new("new", new),
        Subject::new("old", old),
        Subject::new("stock", PathBuf::from(STOCK)),
    ];
    println!("portmap ADD / DEL latency, process start to exit, {reps} rounds per size, plugins interleaved");
    println!("(new: nftkube-portmap; old: nftkube as portmap; stock: {STOCK})");
    println!(
        "(floors: each nftkube binary's VERSION, the same process start and exit without touching the kernel)"
    );
    println!(
        "{:>8} {:>8} | {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10}",
        "plugin", "mappings", "ADD p50", "ADD p90", "ADD min", "DEL p50", "DEL p90", "DEL min"
    );
    for &n in &sizes {
        for s in subjects.iter_mut() {
            s.fill(n);
        }
        let mut floors = [Vec::new(), Vec::new()];
        let mut times: Vec<(Vec<Duration>, Vec<Duration>)> =
            vec![Default::default(); subjects.len()];
        for r in 0..reps {
            for (s, (adds, dels)) in subjects.iter().zip(times.iter_mut()) {
                let (add, del) = s.round(ROUND_BASE + r);
                adds.push(add);
                dels.push(del);
            }
            for (floor, s) in floors.iter_mut().zip(&subjects) {
                floor.push(s.version());
            }
        }
        let mut medians = Vec::new();
        for (s, (adds, dels)) in subjects.iter().zip(times) {
            let (add, del) = (stats(adds), stats(dels));
            println!(
                "{:>8} {n:>8} | {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10}",
                s.label,
                ms(add.p50),
                ms(add.p90),
                ms(add.min),
                ms(del.p50),
                ms(del.p90),
                ms(del.min)
            );
            medians.push((add.p50, del.p50));
        }
        for (floor, s) in floors.iter_mut().zip(&subjects) {
            let floor = stats(std::mem::take(floor));
            println!(
                "{:>8} {n:>8} | {:>10} {:>10} {:>10} |",
                format!("{} VER", s.label),
                ms(floor.p50),
                ms(floor.p90),
                ms(floor.min)
            );
        }
        for (i, other) in [(1, "old"), (2, "stock")] {
            println!(
                "{:>8} {n:>8} | {other} / new medians: ADD {:.1}x, DEL {:.1}x",
                "",
                ratio(medians[i].0, medians[0].0),
                ratio(medians[i].1, medians[0].1)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One plugin in a namespace of its own, holding `filled` mappings.
struct Subject {
    label: &'static str,
    plugin: PathBuf,
    ns: NetNs,
    filled: usize,
}

impl Subject {
    fn new(label: &'static str, plugin: PathBuf) -> Subject {
        let ns = NetNs::create(&unique_name("pmbench")).expect("creating the namespace");
        ns.run(|| set_link_up("lo")).unwrap().expect("lo up");
        Subject {
            label,
            plugin,
            ns,
            filled: 0,
        }
    }

    /// ADDs containers until `n` mappings are in place.
    fn fill(&mut self, n: usize) {
        let (plugin, label, from) = (&self.plugin, self.label, self.filled);
        self.ns
            .run(|| {
                for k in from..n {
                    let (ok, stdout, _) = invoke(plugin, "ADD", k);
                    assert!(ok, "{label} ADD while filling: {stdout}");
                }
            })
            .expect("entering the benchmark namespace");
        self.filled = self.filled.max(n);
    }

    /// ADD then DEL of container `k`: their times.
    fn round(&self, k: usize) -> (Duration, Duration) {
        let label = self.label;
        self.ns
            .run(|| {
                let (ok, stdout, add) = invoke(&self.plugin, "ADD", k);
                assert!(ok, "{label} ADD: {stdout}");
                let (ok, stdout, del) = invoke(&self.plugin, "DEL", k);
                assert!(ok, "{label} DEL: {stdout}");
                (add, del)
            })
            .expect("entering the benchmark namespace")
    }

    /// VERSION: process start and exit, no kernel work.
    fn version(&self) -> Duration {
        self.ns
            .run(|| invoke(&self.plugin, "VERSION", 0).2)
            .expect("entering the benchmark namespace")
    }
}

impl Drop for Subject {
    /// Removes nftkube's plugin records of the namespace (`/run/nftkube-portmap/netns-DEV-INODE`, one file
    /// per filled container): a namespace created later may get the same inode, and must not inherit them.
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(self.ns.path()) {
            let dir = format!("/run/nftkube-portmap/netns-{}-{}", m.dev(), m.ino());
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `$var`, or the workspace's release build of `name` (`cargo build --release --bins`; ci/bench does).
fn release_binary(var: &str, name: &str) -> PathBuf {
    std::fs::canonicalize(nftkube_sandbox::workspace_binary(var, "release", name)).unwrap()
}

#[derive(Debug, Clone, Copy)]
struct Stats {
    p50: Duration,
    p90: Duration,
    min: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Stats {
        p50: at(0.5),
        p90: at(0.9),
        min: v[0],
    }
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Containers 0.. fill the namespace; the timed ones are `ROUND_BASE` and up. Their host ports never meet: a
/// timed ADD that took over a filled container's port would also delete that container's element.
const ROUND_BASE: usize = 100_000;

/// Container `k`: id `bench-k`, address 10.77.x.y, a host port of its own (10000 + k while filling, 5000 + r
/// for timed round r) → 80.
fn conf(k: usize) -> Value {
    let ip = format!("10.77.{}.{}", k / 250 % 256, k % 250 + 2);
    json!({
        "cniVersion": "1.0.0", "name": "bench", "type": "portmap",
        "runtimeConfig": {"portMappings": [
            {"hostPort": host_port(k), "containerPort": 80, "protocol": "tcp"}]},
        "prevResult": {"cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "sandbox": "/proc/self/ns/net"}],
            "ips": [{"address": format!("{ip}/16"), "interface": 0}]}
    })
}

fn host_port(k: usize) -> usize {
    if k >= ROUND_BASE {
        5000 + (k - ROUND_BASE)
    } else {
        assert!(k < 50_000, "at most 50 000 mappings");
        10_000 + k
    }
}

/// Runs the plugin in the calling thread's namespace (a child forked by this thread is in it too); returns
/// success, stdout and the time from spawn to exit.
fn invoke(plugin: &Path, command: &str, k: usize) -> (bool, String, Duration) {
    let stdin = conf(k).to_string();
    let start = Instant::now();
    let mut child = Command::new(plugin)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", format!("bench-{k}"))
        .env("CNI_NETNS", "/proc/self/ns/net")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning the plugin");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().expect("waiting for the plugin");
    let elapsed = start.elapsed();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        elapsed,
    )
}
