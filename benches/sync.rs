//! Sync benchmarks: nftkube against the anchors, every number measured in the same run, in fresh network
//! namespaces (never the host's).
//!
//! For each N (ClusterIP services × 5 endpoints; the anchors, upstream's rulesets for the same services,
//! come from `sync/anchors.rs`):
//! - nftkube cold full sync (library: render + one netlink batch), and the same through the real binary
//!   reading generated manifests (wall time to the first completed sync, and the agent's peak RSS; with
//!   `NFTKUBE_BENCH_IDLE_SECONDS=S`, then its CPU time over S idle seconds, as a share of one core);
//! - a one-endpoint change (same count) and an endpoint-count change, as partial syncs: time and bytes;
//! - `nft -f` of nftkube's own ruleset (`plan` output);
//! - upstream kube-proxy's nftables mode: `nft -f` of its first full sync, then its partial sync;
//! - upstream's iptables mode: `iptables-restore` (legacy and nft-backed) of its full and partial syncs.
//!
//! Run as root: `bash ci/bench [SIZES]` (e.g. `bash ci/bench 100,1000,10000`). Slow anchors are skipped and
//! marked as such above a size: upstream nft above `NFTKUBE_BENCH_SLOW_MAX` (default 10000),
//! iptables-nft-restore above `NFTKUBE_BENCH_IPTABLES_NFT_MAX` (default 1000; over 15 minutes at 10k here).

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

#[path = "sync/anchors.rs"]
mod anchors;

use nftkube::model::*;
use nftkube::nft::netlink::NftSocket;
use nftkube::render::{self, RenderConfig};
use nftkube::sync::SyncEngine;
use nftkube_sandbox::netns::{unique_name, NetNs};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ENDPOINTS: usize = 5;

fn main() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "benchmarks need root (network namespaces)");
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "100,1000,10000".into())
        .split(',')
        .map(|s| s.parse().expect("sizes: comma-separated numbers"))
        .collect();
    let slow_max: usize = std::env::var("NFTKUBE_BENCH_SLOW_MAX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let iptables_nft_max: usize = std::env::var("NFTKUBE_BENCH_IPTABLES_NFT_MAX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let bin = nftkube_sandbox::workspace_binary("NFTKUBE_BIN", "release", "nftkube");

    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut push = |name: &str, col: usize, v: String| {
        // Also as it comes, so a long run that is cut short still reports what it measured.
        eprintln!("  N={} {name}: {v}", sizes[col]);
        if let Some(r) = rows.iter_mut().find(|r| r.0 == name) {
            r.1[col] = v;
        } else {
            let mut cells = vec![String::from("-"); sizes.len()];
            cells[col] = v;
            rows.push((name.to_owned(), cells));
        }
    };

    for (col, &n) in sizes.iter().enumerate() {
        eprintln!("== N = {n}");
        let work = std::env::temp_dir().join(unique_name("nftkube-bench"));
        std::fs::create_dir_all(&work).unwrap();
        let model = Model::generate(n);

        let cold = nftkube_cold_and_changes(&model);
        push("nftkube cold full sync (s)", col, secs(cold.full));
        push("  of which netlink commit (s)", col, secs(cold.full_commit));
        push(
            "  transaction size (MB)",
            col,
            format!("{:.1}", cold.full_bytes as f64 / 1e6),
        );
        push(
            "  transactions / longest one (s)",
            col,
            format!("{} / {}", cold.full_transactions, secs(cold.full_longest)),
        );
        push("nftkube 1-endpoint change, median (ms)", col, ms(cold.swap));
        push("  of which netlink commit (ms) ", col, ms(cold.swap_commit));
        push(
            "  netlink bytes sent (1-endpoint)",
            col,
            cold.swap_bytes.to_string(),
        );
        push(
            "nftkube endpoint-count change, median (ms)",
            col,
            ms(cold.grow),
        );
        push(
            "  netlink bytes sent (count change)",
            col,
            cold.grow_bytes.to_string(),
        );

        push(
            "nftkube endpoint-count change past 32 (40 <-> 41), median (ms)",
            col,
            ms(cold.own_grow),
        );
        push("nftkube service added, median (ms)", col, ms(cold.added));
        push(
            "nftkube service removed, median (ms)",
            col,
            ms(cold.removed),
        );

        let refused = nftkube_cold_with_one_refused(&model);
        push(
            "nftkube cold full sync, one service refused by the kernel (s)",
            col,
            secs(refused),
        );
        push(
            "  ratio: with one refused / nftkube cold",
            col,
            ratio(refused, cold.full),
        );

        let lat = latency_to_last_service(n);
        push(
            "new-connection latency to the last service, median (µs)",
            col,
            format!("{:.0}", lat.as_secs_f64() * 1e6),
        );

        let (agent_wall, agent_rss, idle) = agent_binary(&bin, &model, &work);
        push(
            "agent binary: manifests → first sync (s)",
            col,
            secs(agent_wall),
        );
        push(
            "agent binary: peak RSS (MiB)",
            col,
            format!("{:.0}", agent_rss as f64 / 1024.0),
        );
        if let Some((cpu, over)) = idle {
            push(
                &format!(
                    "agent binary: idle CPU over {}s (% of a core)",
                    over.as_secs()
                ),
                col,
                format!("{:.3}", cpu * 100.0),
            );
        }

        let plan = work.join("plan.nft");
        std::fs::write(&plan, model.plan_text()).unwrap();
        let t = timed_in_fresh_ns(&["nft", "-f", plan.to_str().unwrap()]);
        push("nft -f of nftkube's plan (s)", col, secs(t));
        push(
            "  ratio: nft -f plan / nftkube cold",
            col,
            ratio(t, cold.full),
        );

        let anchor_dir = work.join("anchors");
        let upstream = anchors::generate(n, ENDPOINTS);
        upstream.assert_shape();
        upstream.write_to(&anchor_dir).expect("writing the anchors");

        if n <= slow_max {
            let (full, inc) = upstream_nft(&anchor_dir);
            push("upstream nft mode: nft -f full sync (s)", col, secs(full));
            push(
                "  ratio: upstream nft full / nftkube cold",
                col,
                ratio(full, cold.full),
            );
            push("upstream nft mode: partial sync (ms)", col, ms(inc));
            push(
                "  ratio: upstream nft partial / nftkube 1-endpoint",
                col,
                ratio(inc, cold.swap),
            );
        } else {
            push(
                "upstream nft mode: nft -f full sync (s)",
                col,
                "skipped (slow)".into(),
            );
        }
        for (label, restore) in [
            ("legacy", "iptables-legacy-restore"),
            ("nft", "iptables-nft-restore"),
        ] {
            // iptables-nft-restore is quadratic too (over 15 minutes at 10k here): its own, lower limit.
            if label == "nft" && n > iptables_nft_max {
                push(
                    &format!("upstream iptables-{label}: full restore (s)"),
                    col,
                    "skipped (slow)".into(),
                );
                continue;
            }
            match upstream_iptables(&anchor_dir, restore) {
                Some((full, partial)) => {
                    push(
                        &format!("upstream iptables-{label}: full restore (s)"),
                        col,
                        secs(full),
                    );
                    push(
                        &format!("  ratio: iptables-{label} full / nftkube cold"),
                        col,
                        ratio(full, cold.full),
                    );
                    push(
                        &format!("upstream iptables-{label}: partial restore (ms)"),
                        col,
                        ms(partial),
                    );
                }
                None => push(
                    &format!("upstream iptables-{label}: full restore (s)"),
                    col,
                    "not installed".into(),
                ),
            }
        }
        let _ = std::fs::remove_dir_all(&work);
    }

    println!();
    println!(
        "| N (ClusterIP services × {ENDPOINTS} endpoints) | {} |",
        sizes
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---|".repeat(sizes.len()));
    for (name, cells) in rows {
        println!("| {name} | {} |", cells.join(" | "));
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64())
}
fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}
fn ratio(anchor: Duration, ours: Duration) -> String {
    format!(
        "{:.1}×",
        anchor.as_secs_f64() / ours.as_secs_f64().max(1e-9)
    )
}

/// N services shaped like the anchors: service i at 10.96.0.0 + 1 + i:80/TCP, endpoint j of service i at
/// 10.240.0.0 + 1 + 8i + j:8080.
struct Model {
    services: ServiceMap,
    endpoints: EndpointsMap,
    cfg: RenderConfig,
}

fn v4(base: [u8; 4], offset: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::from(base)) + offset))
}

fn service(i: usize) -> ServicePort {
    ServicePort::cluster_ip(
        ServicePortName {
            service: NamespacedName::new(format!("ns{}", i % 100), format!("svc{i}")),
            port: "p80".into(),
            protocol: Protocol::Tcp,
        },
        vec![v4([10, 96, 0, 0], 1 + i as u32)],
        80,
    )
}

fn endpoint(ip: IpAddr) -> Endpoint {
    Endpoint::ready(ip, 8080)
}

fn endpoints_of(i: usize, count: usize) -> Vec<Endpoint> {
    (0..count)
        .map(|j| endpoint(v4([10, 240, 0, 0], 1 + 8 * i as u32 + j as u32)))
        .collect()
}

impl Model {
    fn generate(n: usize) -> Model {
        let mut services = ServiceMap::new();
        let mut endpoints = EndpointsMap::new();
        for i in 0..n {
            let sp = service(i);
            endpoints.insert(sp.name.clone(), endpoints_of(i, ENDPOINTS));
            services.insert(sp.name.clone(), sp);
        }
        Model {
            services,
            endpoints,
            cfg: RenderConfig {
                cluster_cidrs: vec!["10.240.0.0/12".parse().unwrap()],
                ..RenderConfig::default()
            },
        }
    }

    fn plan_text(&self) -> String {
        render::render(&self.services, &self.endpoints, &self.cfg)
            .iter()
            .map(nftkube::nft::text::render_table)
            .collect()
    }

    /// Services and EndpointSlices as Kubernetes YAML, for the agent binary.
    fn write_manifests(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let mut svc = String::new();
        let mut eps = String::new();
        for (i, (spn, sp)) in self.services.iter().enumerate() {
            let (ns, name) = (&spn.service.namespace, &spn.service.name);
            svc.push_str(&format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  clusterIP: {}\n  ports: [{{name: p80, port: 80, targetPort: 8080, protocol: TCP}}]\n",
                sp.cluster_ips[0]
            ));
            let addrs: Vec<String> = self.endpoints[spn]
                .iter()
                .map(|e| {
                    format!(
                        "  - addresses: [\"{}\"]\n    conditions: {{ready: true}}\n",
                        e.ip
                    )
                })
                .collect();
            eps.push_str(&format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-{i}\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: p80, port: 8080, protocol: TCP}}]\nendpoints:\n{}",
                addrs.concat()
            ));
        }
        std::fs::write(dir.join("services.yaml"), svc).unwrap();
        std::fs::write(dir.join("endpointslices.yaml"), eps).unwrap();
    }
}

struct Cold {
    full: Duration,
    full_commit: Duration,
    full_bytes: usize,
    full_transactions: usize,
    full_longest: Duration,
    swap: Duration,
    swap_commit: Duration,
    swap_bytes: usize,
    grow: Duration,
    grow_bytes: usize,
    added: Duration,
    removed: Duration,
    own_grow: Duration,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The library path in a fresh namespace: a cold full sync, then partial syncs of the last service.
/// A cold full sync in which the kernel refuses one service's objects (a chain named past the kernel's 255
/// bytes, added to the pieces of the service in the middle): the time to find that service and commit every
/// other one.
fn nftkube_cold_with_one_refused(m: &Model) -> Duration {
    let ns = NetNs::create(&unique_name("nkbench")).unwrap();
    let (services, endpoints, cfg) = (m.services.clone(), m.endpoints.clone(), m.cfg.clone());
    ns.run(move || {
        let mut engine = SyncEngine::new(NftSocket::open().unwrap());
        let start = Instant::now();
        let mut pieces = render::all_pieces(&services, &endpoints, &cfg);
        let middle = pieces.keys().nth(pieces.len() / 2).unwrap().clone();
        let refused = nftkube::nft::ir::ChainState {
            chain: nftkube::nft::ir::Chain::regular(&"x".repeat(300)),
            rules: Vec::new(),
        };
        pieces.get_mut(&middle).unwrap().push(render::Piece::Chain {
            family: nftkube::nft::ir::Family::Ip,
            chain: std::sync::Arc::new(refused),
        });
        let r = engine.sync_full(render::skeleton(&cfg), pieces).unwrap();
        let took = start.elapsed();
        let rejected: Vec<_> = r.rejected.iter().map(|(port, _)| port).collect();
        assert_eq!(
            rejected,
            [&middle],
            "exactly the service with the bad chain is refused"
        );
        took
    })
    .unwrap()
}

fn nftkube_cold_and_changes(m: &Model) -> Cold {
    let ns = NetNs::create(&unique_name("nkbench")).unwrap();
    let services = m.services.clone();
    let mut endpoints = m.endpoints.clone();
    let cfg = m.cfg.clone();
    ns.run(move || {
        let mut engine = SyncEngine::new(NftSocket::open().unwrap());
        let start = Instant::now();
        let pieces = render::all_pieces(&services, &endpoints, &cfg);
        let r = engine.sync_full(render::skeleton(&cfg), pieces).unwrap();
        let full = start.elapsed();
        let last = services.keys().last().unwrap().clone();
        let last_i = services.len() - 1;
        let sync_last = |engine: &mut SyncEngine<NftSocket>, eps: &EndpointsMap| {
            let start = Instant::now();
            let pieces = render::service_pieces(&services[&last], eps.get(&last), &cfg);
            let r = engine.sync_partial(vec![(last.clone(), pieces)]).unwrap();
            (start.elapsed(), r)
        };
        // One endpoint replaced by another (same count), back and forth.
        let (mut swaps, mut commits, mut bytes) = (Vec::new(), Vec::new(), 0);
        for k in 0..21 {
            let mut list = endpoints_of(last_i, ENDPOINTS);
            if k % 2 == 0 {
                list[0] = endpoint(v4([10, 250, 1, 0], 1 + k));
            }
            endpoints.insert(last.clone(), list);
            let (t, r) = sync_last(&mut engine, &endpoints);
            swaps.push(t);
            commits.push(r.commit_time);
            bytes = r.bytes;
        }
        // The endpoint count changes (5 → 6 → 5).
        let mut grows = Vec::new();
        let mut grow_bytes = 0;
        for k in 0..11 {
            let count = if k % 2 == 0 { ENDPOINTS + 1 } else { ENDPOINTS };
            endpoints.insert(last.clone(), endpoints_of(last_i, count));
            let (t, r) = sync_last(&mut engine, &endpoints);
            grows.push(t);
            grow_bytes = grow_bytes.max(r.bytes);
        }
        // The same past the shared counts (40 -> 41 -> 40): such a frontend has a chain of its own count,
        // named by a verdict element, so this change still makes the kernel re-validate the table.
        let mut own_grows = Vec::new();
        for k in 0..11 {
            let count = if k % 2 == 0 { 41 } else { 40 };
            endpoints.insert(last.clone(), endpoints_of(last_i, count));
            own_grows.push(sync_last(&mut engine, &endpoints).0);
        }
        endpoints.insert(last.clone(), endpoints_of(last_i, ENDPOINTS));
        sync_last(&mut engine, &endpoints);
        // A service added and removed again, each timed (render included). Were its dispatch element a
        // verdict, either would make the kernel re-validate the table: O(services).
        let extra = service(services.len());
        let (mut adds, mut removes) = (Vec::new(), Vec::new());
        for _ in 0..11 {
            let start = Instant::now();
            let pieces =
                render::service_pieces(&extra, Some(&endpoints_of(last_i + 1, ENDPOINTS)), &cfg);
            engine
                .sync_partial(vec![(extra.name.clone(), pieces)])
                .unwrap();
            adds.push(start.elapsed());
            let start = Instant::now();
            engine
                .sync_partial(vec![(extra.name.clone(), Vec::new())])
                .unwrap();
            removes.push(start.elapsed());
        }
        Cold {
            added: median(adds),
            removed: median(removes),
            own_grow: median(own_grows),
            full,
            full_commit: r.commit_time,
            full_bytes: r.bytes,
            full_transactions: r.transactions,
            full_longest: r.longest_transaction,
            swap: median(swaps),
            swap_commit: median(commits),
            swap_bytes: bytes,
            grow: median(grows),
            grow_bytes,
        }
    })
    .unwrap()
}

/// A command that runs inside `ns`.
fn command_in(ns: &NetNs, argv: &[&str]) -> Command {
    let mut cmd = ns.command(argv[0]);
    cmd.args(&argv[1..]);
    cmd
}

fn run_timed(ns: &NetNs, argv: &[&str], stdin: Option<&Path>) -> Duration {
    let mut cmd = command_in(ns, argv);
    if let Some(p) = stdin {
        cmd.stdin(std::fs::File::open(p).unwrap());
    }
    let start = Instant::now();
    let out = cmd.output().unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let t = start.elapsed();
    assert!(
        out.status.success(),
        "{argv:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    t
}

fn timed_in_fresh_ns(argv: &[&str]) -> Duration {
    let ns = NetNs::create(&unique_name("nkbench")).unwrap();
    run_timed(&ns, argv, None)
}

/// Upstream's nftables mode: its first full sync, then its one-endpoint partial sync.
fn upstream_nft(dir: &Path) -> (Duration, Duration) {
    let ns = NetNs::create(&unique_name("nkbench")).unwrap();
    let full = run_timed(
        &ns,
        &["nft", "-f", dir.join(anchors::NFT_FULL).to_str().unwrap()],
        None,
    );
    let inc = run_timed(
        &ns,
        &[
            "nft",
            "-f",
            dir.join(anchors::NFT_PARTIAL).to_str().unwrap(),
        ],
        None,
    );
    (full, inc)
}

/// Upstream's iptables mode with the given restore binary: jumps, full restore, partial restore.
fn upstream_iptables(dir: &Path, restore: &str) -> Option<(Duration, Duration)> {
    if Command::new("sh")
        .args(["-c", &format!("command -v {restore}")])
        .output()
        .ok()?
        .status
        .success()
    {
        let ns = NetNs::create(&unique_name("nkbench")).unwrap();
        let flags = ["--noflush", "--counters"];
        let mut argv = vec![restore];
        argv.extend(flags);
        run_timed(&ns, &argv, Some(&dir.join(anchors::IPT_JUMPS)));
        let full = run_timed(&ns, &argv, Some(&dir.join(anchors::IPT_FULL)));
        let partial = run_timed(&ns, &argv, Some(&dir.join(anchors::IPT_PARTIAL)));
        Some((full, partial))
    } else {
        None
    }
}

/// The real binary on generated manifests in a fresh namespace: time to its first completed sync, and its
/// peak RSS (VmHWM) at that point; then, if `NFTKUBE_BENCH_IDLE_SECONDS` is set, the CPU time it uses while
/// nothing changes (periodic checks included) as a share of one core, and over how long.
fn agent_binary(bin: &Path, m: &Model, work: &Path) -> (Duration, u64, Option<(f64, Duration)>) {
    let dir: PathBuf = work.join("manifests");
    m.write_manifests(&dir);
    let ns = NetNs::create(&unique_name("nkbench")).unwrap();
    let start = Instant::now();
    let mut child = command_in(
        &ns,
        &[
            bin.to_str().unwrap(),
            "proxy",
            "--manifests",
            dir.to_str().unwrap(),
            "--cluster-cidr",
            "10.240.0.0/12",
        ],
    )
    .stderr(Stdio::piped())
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut wall = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.contains("sync complete") {
            wall = Some(start.elapsed());
            break;
        }
        assert!(!line.contains("ERROR"), "agent: {line}");
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let hwm: BTreeMap<&str, u64> = status
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k, v.trim().trim_end_matches(" kB").parse().ok()?))
        })
        .collect();
    // Keep reading its log, so that it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    let idle = idle_seconds().map(|over| (idle_cpu(child.id(), over), over));
    // SAFETY: kill on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    (wall.expect("agent never synced"), hwm["VmHWM"], idle)
}

fn idle_seconds() -> Option<Duration> {
    let s: u64 = std::env::var("NFTKUBE_BENCH_IDLE_SECONDS")
        .ok()?
        .parse()
        .ok()?;
    (s > 0).then(|| Duration::from_secs(s))
}

/// CPU time (user + system, every thread) process `pid` uses over the next `over`, as a share of one core.
fn idle_cpu(pid: u32, over: Duration) -> f64 {
    let ticks = || -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let (before, start) = (ticks(), Instant::now());
    std::thread::sleep(over);
    (ticks() - before) as f64 / hz / start.elapsed().as_secs_f64()
}

/// Median time for a new TCP connection (connect, one answer, close) from a pod to the last of `n` services,
/// whose one endpoint is a real backend in the sandbox; the other services point at addresses nobody has.
fn latency_to_last_service(n: usize) -> Duration {
    use nftkube_sandbox::{self as sandbox, Sandbox};
    let sb = Sandbox::build(&unique_name("nkbench-lat"), 1).unwrap();
    sb.start_backends(8080, 5353).unwrap();
    let mut m = Model::generate(n);
    let last = m.services.keys().last().unwrap().clone();
    let dst = std::net::SocketAddr::new(m.services[&last].cluster_ips[0], 80);
    m.endpoints
        .insert(last, vec![endpoint(sandbox::pod_ip_v4(1).into())]);
    m.cfg.cluster_cidrs = vec![sandbox::CLUSTER_CIDR_V4.parse().unwrap()];
    let (services, endpoints, cfg) = (m.services, m.endpoints, m.cfg);
    sb.node()
        .run(move || {
            let mut engine = SyncEngine::new(NftSocket::open().unwrap());
            engine
                .sync_full(
                    render::skeleton(&cfg),
                    render::all_pieces(&services, &endpoints, &cfg),
                )
                .unwrap();
        })
        .unwrap();
    sb.client()
        .run(move || {
            let mut times = Vec::new();
            for i in 0..600 {
                let start = Instant::now();
                sandbox::tcp_request_here(dst, Duration::from_secs(2)).expect("latency probe");
                if i >= 100 {
                    times.push(start.elapsed());
                }
            }
            median(times)
        })
        .unwrap()
}
