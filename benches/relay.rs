//! The userspace relay's data path against HAProxy in TCP mode and the kernel's DNAT, on the same endpoints,
//! in the same run, interleaved (round r measures every path once before round r+1), medians and ratios.
//!
//! Real packets in a sandbox (see sandbox/src/lib.rs): clients in pod0, servers in pod1, the proxies in the node.
//! - relay: `nftkube proxy --proxy-mode userspace` (the release binary) on a Service of ClusterIP 10.96.0.50:
//!   nf_tables redirects the ClusterIP to the relay's listener;
//! - HAProxy (Debian's `haproxy`, `mode tcp`, 2 threads like the relay's runtime) listening on the node's
//!   address on pod0's link, config in a temp dir;
//! - kernel DNAT: a table of the bench's own, `ip daddr 10.96.0.60 dnat to 10.244.1.2` (ports kept);
//! - direct: pod0 to pod1, no proxy (the latency baseline).
//!
//! Measured: bulk throughput (one stream, 8 streams: the client writes, the server counts and acknowledges),
//! connections per second (connect, read one byte the server sends, close; 2 client threads), request
//! latency on an established connection (1-byte ping-pong; added p50/p99 = the path's minus direct's), and
//! memory per idle relayed connection (the proxy's RSS before and after 5000 connections held open).
//!
//! Run as root: `cargo bench --bench relay` (also run by `bash ci/bench`). `NFTKUBE_BENCH_RELAY_ROUNDS`
//! (default 9) and `NFTKUBE_BENCH_RELAY_MB` (MB per bulk run, default 256) scale it.

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use nftkube_sandbox::netns::{unique_name, NetNs};
use nftkube_sandbox::{self as sandbox, Sandbox};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BULK: u16 = 9100;
const ECHO: u16 = 9101;
const ACCEPT: u16 = 9102;
const IDLE: u16 = 9103;
const RELAY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const DNAT_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 60);
/// HAProxy listens on BULK + this, ... on the node's address on pod0's link.
const HAPROXY_OFFSET: u16 = 1000;
const IDLE_CONNECTIONS: usize = 5000;
const PINGS: usize = 2000;
const CONNECTIONS_PER_THREAD: usize = 1000;
const T: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path_ {
    Relay,
    Haproxy,
    Dnat,
    Direct,
}

impl Path_ {
    fn name(self) -> &'static str {
        match self {
            Path_::Relay => "nftkube relay",
            Path_::Haproxy => "HAProxy (tcp mode)",
            Path_::Dnat => "kernel DNAT",
            Path_::Direct => "direct (no proxy)",
        }
    }
    fn addr(self, port: u16) -> SocketAddr {
        match self {
            Path_::Relay => SocketAddrV4::new(RELAY_VIP, port).into(),
            Path_::Dnat => SocketAddrV4::new(DNAT_VIP, port).into(),
            Path_::Haproxy => {
                SocketAddrV4::new(sandbox::pod_gateway_v4(0), port + HAPROXY_OFFSET).into()
            }
            Path_::Direct => SocketAddrV4::new(sandbox::pod_ip_v4(1), port).into(),
        }
    }
}

const PROXIES: [Path_; 3] = [Path_::Relay, Path_::Haproxy, Path_::Dnat];

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "the relay benchmark needs root");
    raise_nofile_limit();
    let rounds = env_usize("NFTKUBE_BENCH_RELAY_ROUNDS", 9);
    let mb = env_usize("NFTKUBE_BENCH_RELAY_MB", 256);
    let sb = Sandbox::build(&unique_name("nkbench-relay"), 1).expect("sandbox");
    let idle_held = start_servers(sb.pod(1));
    let dir = std::env::temp_dir().join(unique_name("nftkube-bench-relay"));
    std::fs::create_dir_all(&dir).unwrap();
    let agent = Reaped(start_agent(sb.node(), &dir));
    let haproxy = Reaped(start_haproxy(sb.node(), &dir));
    program_dnat(sb.node());
    for p in PROXIES {
        wait_served(sb.client(), p.addr(ACCEPT));
    }

    let mut m = Measurements::default();
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        for p in PROXIES {
            m.push(p, "bulk1", bulk(sb.client(), p.addr(BULK), 1, mb));
            m.push(p, "bulk8", bulk(sb.client(), p.addr(BULK), 8, mb));
            m.push(p, "rate", connection_rate(sb.client(), p.addr(ACCEPT)));
        }
        for p in [Path_::Direct, Path_::Relay, Path_::Haproxy, Path_::Dnat] {
            let (p50, p99) = latency(sb.client(), p.addr(ECHO));
            m.push(p, "p50", p50);
            m.push(p, "p99", p99);
        }
    }
    let relay_mem = idle_memory(sb.client(), Path_::Relay, agent.0.id(), &idle_held);
    let haproxy_mem = idle_memory(sb.client(), Path_::Haproxy, haproxy.0.id(), &idle_held);
    print_table(&m, relay_mem, haproxy_mem, rounds, mb);
    drop((agent, haproxy));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A child process killed and reaped when dropped, also when the bench panics.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The bench holds thousands of sockets (clients and servers of the idle connections).
fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads and writes the local struct only.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}

/// Median of the samples of one path and metric.
#[derive(Default)]
struct Measurements {
    samples: Vec<(Path_, &'static str, f64)>,
}

impl Measurements {
    fn push(&mut self, p: Path_, metric: &'static str, v: f64) {
        self.samples.push((p, metric, v));
    }
    fn median(&self, p: Path_, metric: &str) -> f64 {
        let mut v: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.0 == p && s.1 == metric)
            .map(|s| s.2)
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// `$NFTKUBE_BIN`, or the workspace's release build (ci/bench builds it).
fn nftkube_bin() -> PathBuf {
    nftkube_sandbox::workspace_binary("NFTKUBE_BIN", "release", "nftkube")
}

fn start_agent(node: &NetNs, dir: &Path) -> Child {
    let manifests = dir.join("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    let ports: String = [BULK, ECHO, ACCEPT, IDLE]
        .iter()
        .map(|p| format!("  - {{name: p{p}, port: {p}, protocol: TCP}}\n"))
        .collect();
    let slice_ports: String = [BULK, ECHO, ACCEPT, IDLE]
        .iter()
        .map(|p| format!("- {{name: p{p}, port: {p}, protocol: TCP}}\n"))
        .collect();
    let yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: bench, namespace: bench}}\nspec:\n  clusterIP: {RELAY_VIP}\n  ports:\n{ports}---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: bench-1\n  namespace: bench\n  labels: {{kubernetes.io/service-name: bench}}\naddressType: IPv4\nports:\n{slice_ports}endpoints:\n- addresses: [\"{}\"]\n",
        sandbox::pod_ip_v4(1)
    );
    std::fs::write(manifests.join("bench.yaml"), yaml).unwrap();
    let log = std::fs::File::create(dir.join("agent.log")).unwrap();
    node.command(nftkube_bin())
        .args(["--log-level", "warn", "proxy", "--proxy-mode", "userspace"])
        // One client pod holds IDLE_CONNECTIONS to one service: above the per-client and per-service defaults.
        .args(["--relay-max-connections-per-source=20000"])
        .args(["--relay-max-connections-per-service=20000"])
        .args(["--relay-max-connections=20000"])
        .arg("--manifests")
        .arg(&manifests)
        .args(["--hostname-override", "node-1", "--healthz-bind-address="])
        .args(["--metrics-bind-address="])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting nftkube")
}

fn start_haproxy(node: &NetNs, dir: &Path) -> Child {
    let mut cfg = String::from(
        "global\n  maxconn 6000\n  nbthread 2\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 1h\n  timeout server 1h\n",
    );
    for p in [BULK, ECHO, ACCEPT, IDLE] {
        cfg += &format!(
            "listen p{p}\n  bind {}:{}\n  server s1 {}:{p}\n",
            sandbox::pod_gateway_v4(0),
            p + HAPROXY_OFFSET,
            sandbox::pod_ip_v4(1)
        );
    }
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, cfg).unwrap();
    node.command("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting haproxy (apt-get install haproxy; ci/bench does)")
}

fn program_dnat(node: &NetNs) {
    let rules = format!(
        "table ip nkbench {{\n chain pre {{\n  type nat hook prerouting priority -110; policy accept;\n  ip daddr {DNAT_VIP} dnat to {}\n }}\n}}\n",
        sandbox::pod_ip_v4(1)
    );
    let mut child = node
        .command("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("nft");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(rules.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "nft -f failed");
}

fn wait_served(client: &NetNs, dst: SocketAddr) {
    let start = Instant::now();
    loop {
        let ok = client
            .run(move || {
                let mut s = TcpStream::connect_timeout(&dst, Duration::from_millis(300))?;
                s.set_read_timeout(Some(Duration::from_millis(300)))?;
                let mut b = [0u8; 1];
                s.read_exact(&mut b)
            })
            .unwrap()
            .is_ok();
        if ok {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{dst} never served"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Servers in the backend pod; returns the count of idle connections held.
fn start_servers(pod: &NetNs) -> Arc<IdleHeld> {
    let held = Arc::new(IdleHeld::default());
    let listen = |port| {
        pod.run(move || TcpListener::bind(("0.0.0.0", port)))
            .unwrap()
            .expect("bind")
    };
    let (bulk_l, echo_l, accept_l, idle_l) =
        (listen(BULK), listen(ECHO), listen(ACCEPT), listen(IDLE));
    // A socket stays in the namespace it was created in, whichever thread then serves it.
    std::thread::spawn(move || per_connection(bulk_l, sink));
    std::thread::spawn(move || per_connection(echo_l, echo));
    std::thread::spawn(move || {
        for mut s in accept_l.incoming().flatten() {
            let _ = s.write_all(b"k");
        }
    });
    let h = held.clone();
    std::thread::spawn(move || {
        for s in idle_l.incoming().flatten() {
            h.conns.lock().unwrap().push(s);
            h.count.fetch_add(1, Ordering::SeqCst);
        }
    });
    held
}

#[derive(Default)]
struct IdleHeld {
    conns: Mutex<Vec<TcpStream>>,
    count: AtomicUsize,
}

fn per_connection(l: TcpListener, f: fn(TcpStream)) {
    for s in l.incoming().flatten() {
        std::thread::spawn(move || f(s));
    }
}

/// Counts bytes to end of stream, then acknowledges with one byte.
fn sink(mut s: TcpStream) {
    let mut buf = vec![0u8; 256 * 1024];
    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
    let _ = s.write_all(b"k");
}

fn echo(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let mut buf = [0u8; 64];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 || s.write_all(&buf[..n]).is_err() {
            break;
        }
    }
}

/// Gbit/s of `streams` parallel streams carrying `mb` MB in total.
fn bulk(client: &NetNs, dst: SocketAddr, streams: usize, mb: usize) -> f64 {
    let per_stream = mb * 1024 * 1024 / streams;
    let elapsed = client
        .run(move || {
            let start = Instant::now();
            std::thread::scope(|sc| {
                for _ in 0..streams {
                    sc.spawn(move || {
                        let mut s = TcpStream::connect_timeout(&dst, T).expect("bulk connect");
                        s.set_read_timeout(Some(T)).unwrap();
                        let chunk = vec![7u8; 256 * 1024];
                        let mut left = per_stream;
                        while left > 0 {
                            let n = left.min(chunk.len());
                            s.write_all(&chunk[..n]).expect("bulk write");
                            left -= n;
                        }
                        s.shutdown(std::net::Shutdown::Write).unwrap();
                        let mut ack = [0u8; 1];
                        s.read_exact(&mut ack).expect("bulk ack");
                    });
                }
            });
            start.elapsed()
        })
        .unwrap();
    (per_stream * streams) as f64 * 8.0 / elapsed.as_secs_f64() / 1e9
}

/// New connections per second (2 client threads, each connect / read one byte / close).
fn connection_rate(client: &NetNs, dst: SocketAddr) -> f64 {
    let threads = 2;
    let elapsed = client
        .run(move || {
            let start = Instant::now();
            std::thread::scope(|sc| {
                for _ in 0..threads {
                    sc.spawn(move || {
                        for _ in 0..CONNECTIONS_PER_THREAD {
                            let mut s = TcpStream::connect_timeout(&dst, T).expect("connect");
                            s.set_read_timeout(Some(T)).unwrap();
                            let mut b = [0u8; 1];
                            s.read_exact(&mut b).expect("accept byte");
                        }
                    });
                }
            });
            start.elapsed()
        })
        .unwrap();
    (threads * CONNECTIONS_PER_THREAD) as f64 / elapsed.as_secs_f64()
}

/// (p50, p99) round trip in µs of a 1-byte ping-pong on one connection.
fn latency(client: &NetNs, dst: SocketAddr) -> (f64, f64) {
    client
        .run(move || {
            let mut s = TcpStream::connect_timeout(&dst, T).expect("echo connect");
            s.set_nodelay(true).unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            let mut rtts = Vec::with_capacity(PINGS);
            let mut b = [0u8; 1];
            for i in 0..PINGS + 100 {
                let t = Instant::now();
                s.write_all(b"p").unwrap();
                s.read_exact(&mut b).unwrap();
                if i >= 100 {
                    rtts.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            rtts.sort_by(f64::total_cmp);
            (rtts[rtts.len() / 2], rtts[rtts.len() * 99 / 100])
        })
        .unwrap()
}

fn rss_kib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// Bytes of the proxy's RSS per idle relayed connection (5000 held open).
fn idle_memory(client: &NetNs, p: Path_, pid: u32, held: &IdleHeld) -> f64 {
    held.conns.lock().unwrap().clear();
    held.count.store(0, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(500));
    let before = rss_kib(pid);
    let dst = p.addr(IDLE);
    let clients: Vec<TcpStream> = client
        .run(move || {
            (0..IDLE_CONNECTIONS)
                .map(|_| TcpStream::connect_timeout(&dst, T).expect("idle connect"))
                .collect()
        })
        .unwrap();
    let start = Instant::now();
    while held.count.load(Ordering::SeqCst) < IDLE_CONNECTIONS {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{}: only {} of {IDLE_CONNECTIONS} idle connections relayed",
            p.name(),
            held.count.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_kib(pid);
    drop(clients);
    held.conns.lock().unwrap().clear();
    (after - before) * 1024.0 / IDLE_CONNECTIONS as f64
}

fn print_table(m: &Measurements, relay_mem: f64, haproxy_mem: f64, rounds: usize, mb: usize) {
    let dnat = |metric| m.median(Path_::Dnat, metric);
    let direct = |metric| m.median(Path_::Direct, metric);
    println!("\nUserspace relay vs HAProxy vs kernel DNAT: medians of {rounds} interleaved rounds ({mb} MB per bulk run)\n");
    println!("| path | 1 stream Gbit/s (vs DNAT) | 8 streams Gbit/s (vs DNAT) | connections/s (vs DNAT) | added p50 µs | added p99 µs | per idle connection |");
    println!("|---|---|---|---|---|---|---|");
    for p in PROXIES {
        let mem = match p {
            Path_::Relay => format!("{:.0} B", relay_mem),
            Path_::Haproxy => format!("{:.0} B", haproxy_mem),
            _ => "— (kernel only)".into(),
        };
        println!(
            "| {} | {:.2} ({:.2}×) | {:.2} ({:.2}×) | {:.0} ({:.2}×) | {:.1} | {:.1} | {} |",
            p.name(),
            m.median(p, "bulk1"),
            m.median(p, "bulk1") / dnat("bulk1"),
            m.median(p, "bulk8"),
            m.median(p, "bulk8") / dnat("bulk8"),
            m.median(p, "rate"),
            m.median(p, "rate") / dnat("rate"),
            m.median(p, "p50") - direct("p50"),
            m.median(p, "p99") - direct("p99"),
            mem
        );
    }
    println!(
        "\ndirect (no proxy) round trip: p50 {:.1} µs, p99 {:.1} µs. Relay vs HAProxy: 1 stream {:.2}×, 8 streams {:.2}×, connections/s {:.2}×, memory per idle connection {:.2}×",
        direct("p50"),
        direct("p99"),
        m.median(Path_::Relay, "bulk1") / m.median(Path_::Haproxy, "bulk1"),
        m.median(Path_::Relay, "bulk8") / m.median(Path_::Haproxy, "bulk8"),
        m.median(Path_::Relay, "rate") / m.median(Path_::Haproxy, "rate"),
        relay_mem / haproxy_mem,
    );
}
