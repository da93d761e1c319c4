//! The first packet of a connection through a ClusterIP: nftkube against upstream kube-proxy's nftables and
//! iptables shapes for the same services, on the same topology and client, in the same run.
//!
//! For each cell (S ClusterIP services × E endpoints), one sandbox (client pod → node → backend pod, fresh
//! network namespaces, never the host's; removed when dropped, also on a panic) per way of programming the node:
//! - nftkube: the agent itself, `nftkube proxy --manifests DIR` in the node, on generated manifests;
//! - upstream nftables mode: its first full sync (`sync/anchors.rs`) loaded with `nft -f`;
//! - upstream iptables mode: its jumps and full sync through `iptables-legacy-restore` (or, if absent,
//!   `iptables-nft-restore`: the table says which);
//! - no rules at all: plain forwarding, the floor; and a second such sandbox, whose difference from the first
//!   is the noise between two sandboxes programmed alike (a difference between columns smaller than that is
//!   not one);
//! - with `--nft NAME=FILE` (repeatable), any other ruleset loaded with `nft -f` (e.g. an edited `nftkube plan`,
//!   to see what one rule costs; the file must use this bench's addresses).
//!
//! The backend pod owns the first and the last service's endpoint addresses (the other services point at
//! addresses nobody has). Measured from the client: the time `connect()` takes (SYN out, SYN-ACK back: the
//! first packet through DNAT and the filter hooks, and its answer) to the first service's ClusterIP, to the
//! last one's, and to the first endpoint's address directly (a packet no service matches; without rules, the
//! floor). Rounds interleave every path of every sandbox (one connection each, in a new random order each
//! round); every connection is new to conntrack (a fresh source port), and each node's table is emptied
//! (ctnetlink) every 10 rounds. Reported: the added cost over the floor, median and 99th percentile (each
//! path's minus the floor's).
//!
//! Run as root: `cargo bench --bench first_packet -- SERVICES [--endpoints E,..] [--rounds N]
//! [--anchor-timeout SECONDS] [--anchors-max-services N] [--sandboxes K] [--nft NAME=FILE]...`, e.g.
//! `-- 100,10000 --endpoints 1,5,32`. An anchor whose loading takes longer than the timeout (upstream's
//! `nft -f` takes minutes at 50 000 services) is killed and its cell reported as skipped, as are anchors
//! above `--anchors-max-services`. With `--sandboxes K`, every way of programming (the floor too) gets K
//! sandboxes and its samples are pooled: one sandbox may run a few µs faster or slower than another
//! programmed alike, and K of them average that out.

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

#[path = "sync/anchors.rs"]
mod anchors;

use nftkube::conntrack::CtSocket;
use nftkube_sandbox::netns::{add_address, add_route, unique_name, NetNs};
use nftkube_sandbox::{self as sandbox, Sandbox};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SERVICE_PORT: u16 = 80;
const ENDPOINT_PORT: u16 = 8080;
const CLUSTER_CIDR: &str = "10.240.0.0/12";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const WARMUP: usize = 20;
/// Rounds between two flushes of every node's conntrack table (a flush takes ~0.1 s here, whatever the
/// table holds). Every connection is new to conntrack anyway (a fresh source port).
const FLUSH_EVERY: usize = 10;

struct Args {
    services: Vec<usize>,
    endpoints: Vec<usize>,
    rounds: usize,
    anchor_timeout: Duration,
    anchors_max_services: usize,
    /// Sandboxes per way of programming (`--sandboxes`): their samples are pooled, so that what one sandbox
    /// costs more or less than another programmed alike averages out.
    sandboxes: usize,
    extra: Vec<(String, PathBuf)>,
}

fn list(s: &str) -> Vec<usize> {
    s.split(',')
        .map(|x| x.parse().expect("a comma-separated list of numbers"))
        .collect()
}

fn parse_args() -> Args {
    let mut args = Args {
        services: vec![100],
        endpoints: vec![1, 5],
        rounds: 300,
        anchor_timeout: Duration::from_secs(600),
        anchors_max_services: usize::MAX,
        sandboxes: 1,
        extra: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--bench" => {}
            "--endpoints" => args.endpoints = list(&value()),
            "--rounds" => args.rounds = value().parse().expect("--rounds N"),
            "--anchor-timeout" => {
                args.anchor_timeout =
                    Duration::from_secs(value().parse().expect("--anchor-timeout SECONDS"))
            }
            "--anchors-max-services" => {
                args.anchors_max_services = value().parse().expect("--anchors-max-services N")
            }
            "--sandboxes" => {
                args.sandboxes = value().parse().expect("--sandboxes K");
                assert!(args.sandboxes > 0, "--sandboxes K: at least one");
            }
            "--nft" => {
                let v = value();
                let (name, file) = v.split_once('=').expect("--nft NAME=FILE");
                args.extra.push((name.to_owned(), file.into()));
            }
            s if !s.starts_with('-') => args.services = list(s),
            s => panic!("unknown argument {s}"),
        }
    }
    args
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "benchmarks need root (network namespaces)");
    let args = parse_args();
    let bin = nftkube_sandbox::workspace_binary("NFTKUBE_BIN", "release", "nftkube");
    let restore = iptables_restore();
    let mut rows = Vec::new();
    for &n in &args.services {
        for &e in &args.endpoints {
            eprintln!("== {n} services × {e} endpoints");
            let row = cell(&args, &bin, restore, n, e);
            eprintln!("{row}");
            rows.push(row);
        }
    }
    print_table(&args, restore, &rows);
}

/// Which iptables-restore the iptables anchor uses: legacy (upstream's usual) if installed.
fn iptables_restore() -> &'static str {
    let installed = |bin: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {bin}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if installed("iptables-legacy-restore") {
        "iptables-legacy-restore"
    } else {
        "iptables-nft-restore"
    }
}

// ---------------------------------------------------------------------------------------------------------
// The services: the anchors' address plan, written again for nftkube's manifests and checked against the
// anchors' description of their first and last services.
// ---------------------------------------------------------------------------------------------------------

fn v4(base: [u8; 4], offset: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::from(base)) + offset as u32)
}

fn cluster_ip(i: usize) -> Ipv4Addr {
    v4([10, 96, 0, 0], 1 + i)
}

fn endpoint_ips(i: usize, e: usize) -> Vec<Ipv4Addr> {
    let stride = 8.max(e + 1);
    let usable = (1 << 19) - 2;
    (0..e)
        .map(|j| v4([10, 240, 0, 0], 1 + (stride * i + j) % usable))
        .collect()
}

/// Services and EndpointSlices as Kubernetes YAML, named as the anchors name them (ns{i/100}/svc{i}, port http).
fn write_manifests(dir: &Path, n: usize, e: usize) {
    use std::fmt::Write as _;
    std::fs::create_dir_all(dir).unwrap();
    let (mut svc, mut eps) = (String::new(), String::new());
    for i in 0..n {
        let (ns, name) = (format!("ns{}", i / 100), format!("svc{i}"));
        let _ = write!(
            svc,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  clusterIP: {}\n  ports: [{{name: http, port: {SERVICE_PORT}, targetPort: {ENDPOINT_PORT}, protocol: TCP}}]\n",
            cluster_ip(i)
        );
        let _ = write!(
            eps,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-x\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: http, port: {ENDPOINT_PORT}, protocol: TCP}}]\nendpoints:\n"
        );
        for ip in endpoint_ips(i, e) {
            let _ = write!(
                eps,
                "  - addresses: [\"{ip}\"]\n    conditions: {{ready: true}}\n"
            );
        }
    }
    std::fs::write(dir.join("services.yaml"), svc).unwrap();
    std::fs::write(dir.join("endpointslices.yaml"), eps).unwrap();
}

/// The anchors' meta.json agrees with this file's plan for the first and last service.
fn check_plan_against_anchors(dir: &Path, n: usize, e: usize) {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("meta.json")).unwrap()).unwrap();
    for (key, i) in [("first", 0), ("last", n - 1)] {
        let s = &meta[key];
        assert_eq!(
            s["cluster_ip"],
            cluster_ip(i).to_string(),
            "{key} ClusterIP"
        );
        let theirs: Vec<String> = s["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[0].as_str().unwrap().to_owned())
            .collect();
        let ours: Vec<String> = endpoint_ips(i, e).iter().map(|ip| ip.to_string()).collect();
        assert_eq!(theirs, ours, "{key} service's endpoints");
    }
}

// ---------------------------------------------------------------------------------------------------------
// The node, programmed one way per sandbox
// ---------------------------------------------------------------------------------------------------------

#[derive(Clone, PartialEq)]
enum Mode {
    Nftkube,
    UpstreamNft,
    UpstreamIptables,
    NoRules,
    /// A second sandbox without rules: how far two sandboxes programmed alike differ (the noise between
    /// columns).
    NoRulesAgain,
    NftFile(String, PathBuf),
}

impl Mode {
    fn name(&self) -> String {
        match self {
            Mode::Nftkube => "nftkube (agent)".into(),
            Mode::UpstreamNft => "upstream nftables".into(),
            Mode::UpstreamIptables => "upstream iptables".into(),
            Mode::NoRules => "no rules".into(),
            Mode::NoRulesAgain => "no rules, a second sandbox".into(),
            Mode::NftFile(name, _) => name.clone(),
        }
    }
}

/// A child process killed and reaped when dropped, also when the bench panics.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A sandbox whose node is programmed one way, with what keeps that programming alive (the agent).
struct Node {
    mode: Mode,
    sandbox: Sandbox,
    _agent: Option<Reaped>,
}

/// A command that runs inside `ns`.
fn command_in(ns: &NetNs, argv: &[&str]) -> Command {
    let mut cmd = ns.command(argv[0]);
    cmd.args(&argv[1..]);
    cmd
}

/// Runs `argv` in `ns` (stdin from `input`); None if it outlasts `limit` (then it is killed). Panics if it fails.
fn run_limited(ns: &NetNs, argv: &[&str], input: Option<&Path>, limit: Duration) -> Option<()> {
    let mut cmd = command_in(ns, argv);
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    if let Some(p) = input {
        cmd.stdin(std::fs::File::open(p).unwrap());
    }
    let mut child = Reaped(cmd.spawn().unwrap_or_else(|e| panic!("{argv:?}: {e}")));
    let start = Instant::now();
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut err);
            assert!(status.success(), "{argv:?} failed: {err}");
            return Some(());
        }
        if start.elapsed() > limit {
            eprintln!("  {argv:?}: over {limit:?}, killed");
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The agent on `manifests` in the node, until its first sync completes.
fn start_agent(ns: &NetNs, bin: &Path, manifests: &Path) -> Reaped {
    let mut child = Reaped(
        command_in(
            ns,
            &[
                bin.to_str().unwrap(),
                "proxy",
                "--manifests",
                manifests.to_str().unwrap(),
                "--cluster-cidr",
                CLUSTER_CIDR,
            ],
        )
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stderr.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.contains("sync complete") {
            // Keep reading its log, so that it never blocks on a full pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return child;
        }
        assert!(!line.contains("ERROR"), "agent: {line}");
    }
    panic!("the agent ended before its first sync");
}

/// The backend pod answers on `addrs` (routed to it by the node), besides its own address.
fn give_backend(sb: &Sandbox, addrs: &[Ipv4Addr]) {
    let own: Vec<Ipv4Addr> = addrs.to_vec();
    sb.pod(1)
        .run(move || {
            for a in own {
                add_address(sandbox::POD_IFNAME, a.into(), 32).expect("backend address");
            }
        })
        .unwrap();
    let routed: Vec<Ipv4Addr> = addrs.to_vec();
    sb.node()
        .run(move || {
            let via = IpAddr::from(sandbox::pod_ip_v4(1));
            let dev = sandbox::node_pod_ifname(1);
            for a in routed {
                add_route(a.into(), 32, Some(via), Some(&dev)).expect("route to the backend");
            }
        })
        .unwrap();
}

struct Cell<'a> {
    args: &'a Args,
    bin: &'a Path,
    restore: &'static str,
    work: PathBuf,
    backend_addrs: Vec<Ipv4Addr>,
}

impl Cell<'_> {
    /// A fresh sandbox programmed as `mode`; None when the programming outlasted the anchor timeout.
    fn node(&self, mode: Mode) -> Option<Node> {
        let sandbox = Sandbox::build(&unique_name("nkfp"), 1).expect("sandbox");
        sandbox.start_backends(ENDPOINT_PORT, 5353).unwrap();
        give_backend(&sandbox, &self.backend_addrs);
        let ns = sandbox.node();
        let anchors = self.work.join("anchors");
        let limit = self.args.anchor_timeout;
        let start = Instant::now();
        let mut agent = None;
        let loaded = match &mode {
            Mode::Nftkube => {
                agent = Some(start_agent(ns, self.bin, &self.work.join("manifests")));
                Some(())
            }
            Mode::UpstreamNft => {
                let file = anchors.join(anchors::NFT_FULL);
                run_limited(ns, &["nft", "-f", file.to_str().unwrap()], None, limit)
            }
            Mode::UpstreamIptables => {
                let argv = [self.restore, "--noflush", "--counters"];
                run_limited(ns, &argv, Some(&anchors.join(anchors::IPT_JUMPS)), limit).and_then(
                    |()| run_limited(ns, &argv, Some(&anchors.join(anchors::IPT_FULL)), limit),
                )
            }
            Mode::NoRules | Mode::NoRulesAgain => Some(()),
            Mode::NftFile(_, file) => {
                run_limited(ns, &["nft", "-f", file.to_str().unwrap()], None, limit)
            }
        };
        eprintln!("  {}: programmed in {:.2?}", mode.name(), start.elapsed());
        loaded.map(|()| Node {
            mode,
            sandbox,
            _agent: agent,
        })
    }
}

// ---------------------------------------------------------------------------------------------------------
// Measuring
// ---------------------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Target {
    First,
    Last,
    NoService,
}

const TARGETS: [Target; 3] = [Target::First, Target::Last, Target::NoService];

fn destination(t: Target, services: usize) -> SocketAddr {
    match t {
        Target::First => (cluster_ip(0), SERVICE_PORT).into(),
        Target::Last => (cluster_ip(services - 1), SERVICE_PORT).into(),
        Target::NoService => (endpoint_ips(0, 1)[0], ENDPOINT_PORT).into(),
    }
}

/// Empties the node's conntrack table, through a socket opened in the node once (a socket stays in the
/// namespace it was opened in).
fn flush_conntrack(ct: &mut CtSocket) {
    let entries = ct.list_all().expect("conntrack dump");
    let out = ct.delete(&entries).expect("conntrack delete");
    assert!(out.errors.is_empty(), "conntrack delete: {:?}", out.errors);
}

/// A thread in the client's namespace that times one connect() per destination it is sent, closing each
/// connection at once; it ends when the prober is dropped.
struct Prober {
    ask: std::sync::mpsc::Sender<SocketAddr>,
    answer: std::sync::mpsc::Receiver<Duration>,
}

impl Prober {
    fn new(client: &NetNs) -> Prober {
        let (ask, asked) = std::sync::mpsc::channel::<SocketAddr>();
        let (answered, answer) = std::sync::mpsc::channel();
        client
            .spawn(move || {
                for dst in asked {
                    let start = Instant::now();
                    let s = TcpStream::connect_timeout(&dst, CONNECT_TIMEOUT)
                        .unwrap_or_else(|e| panic!("connect to {dst}: {e}"));
                    let took = start.elapsed();
                    drop(s);
                    if answered.send(took).is_err() {
                        break;
                    }
                }
            })
            .unwrap();
        Prober { ask, answer }
    }

    fn connect_time(&self, dst: SocketAddr) -> Duration {
        self.ask.send(dst).unwrap();
        self.answer
            .recv()
            .expect("the prober ended (a connect failed)")
    }
}

/// Each node's paths: the ClusterIPs mean nothing without rules.
fn targets(mode: &Mode) -> &'static [Target] {
    if matches!(mode, Mode::NoRules | Mode::NoRulesAgain) {
        &TARGETS[2..]
    } else {
        &TARGETS
    }
}

/// Samples per (node, target), in the nodes' order.
fn measure(nodes: &[Node], services: usize, rounds: usize) -> Vec<Vec<Vec<Duration>>> {
    let mut sockets: Vec<CtSocket> = nodes
        .iter()
        .map(|n| {
            n.sandbox
                .node()
                .run(|| CtSocket::open().expect("ctnetlink socket"))
                .unwrap()
        })
        .collect();
    let probers: Vec<Prober> = nodes
        .iter()
        .map(|n| Prober::new(n.sandbox.client()))
        .collect();
    let mut samples: Vec<Vec<Vec<Duration>>> = nodes
        .iter()
        .map(|n| vec![Vec::new(); targets(&n.mode).len()])
        .collect();
    let mut points: Vec<(usize, usize)> = nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| (0..targets(&n.mode).len()).map(move |t| (i, t)))
        .collect();
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    for round in 0..WARMUP + rounds {
        if round % FLUSH_EVERY == 0 {
            sockets.iter_mut().for_each(flush_conntrack);
        }
        shuffle(&mut points, &mut rng);
        for &(i, t) in &points {
            let target = targets(&nodes[i].mode)[t];
            let took = probers[i].connect_time(destination(target, services));
            if round >= WARMUP {
                samples[i][t].push(took);
            }
        }
    }
    samples
}

/// A new order each round (xorshift, Fisher-Yates): no path always follows the same one, or comes first.
fn shuffle<T>(v: &mut [T], state: &mut u64) {
    for k in (1..v.len()).rev() {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        v.swap(k, (*state % (k as u64 + 1)) as usize);
    }
}

fn percentile(v: &[Duration], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort();
    let at = ((v.len() as f64 * p) as usize).min(v.len() - 1);
    v[at].as_secs_f64() * 1e6
}

/// The samples of target `t` from every sandbox programmed as `mode`, together.
fn pooled(nodes: &[Node], samples: &[Vec<Vec<Duration>>], mode: &Mode, t: usize) -> Vec<Duration> {
    nodes
        .iter()
        .zip(samples)
        .filter(|(node, _)| node.mode == *mode)
        .flat_map(|(_, s)| s[t].iter().copied())
        .collect()
}

/// A mode's three added costs ("+median / +p99" µs over the floor) or why there are none.
type ModeCells = Result<[String; 3], String>;

struct Row {
    services: usize,
    endpoints: usize,
    floor: (f64, f64),
    /// The second no-rules sandbox's median minus the floor's.
    between_sandboxes: f64,
    modes: Vec<(String, ModeCells)>,
}

impl std::fmt::Display for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "| {} × {} | {:.1} / {:.1} | {:+.1} |",
            self.services, self.endpoints, self.floor.0, self.floor.1, self.between_sandboxes
        )?;
        for (_, cells) in &self.modes {
            match cells {
                Ok(c) => write!(f, " {} | {} | {} |", c[0], c[1], c[2])?,
                Err(why) => write!(f, " {why} | {why} | {why} |")?,
            }
        }
        Ok(())
    }
}

fn modes(args: &Args) -> Vec<Mode> {
    let mut m = vec![Mode::Nftkube, Mode::UpstreamNft, Mode::UpstreamIptables];
    m.extend(
        args.extra
            .iter()
            .map(|(n, f)| Mode::NftFile(n.clone(), f.clone())),
    );
    m
}

fn cell(args: &Args, bin: &Path, restore: &'static str, n: usize, e: usize) -> Row {
    let work = std::env::temp_dir().join(unique_name("nftkube-bench-fp"));
    // Above the limit the anchors are not even written (50 000 × 100 would be gigabytes of rules).
    if n <= args.anchors_max_services {
        let upstream = anchors::generate(n, e);
        upstream.assert_shape();
        upstream.write_to(&work.join("anchors")).unwrap();
        check_plan_against_anchors(&work.join("anchors"), n, e);
    }
    write_manifests(&work.join("manifests"), n, e);
    let mut backend_addrs = endpoint_ips(0, e);
    backend_addrs.extend(endpoint_ips(n - 1, e));
    backend_addrs.sort();
    backend_addrs.dedup();
    let c = Cell {
        args,
        bin,
        restore,
        work: work.clone(),
        backend_addrs,
    };
    let mut nodes = Vec::new();
    for mode in [Mode::NoRules, Mode::NoRulesAgain] {
        for _ in 0..args.sandboxes {
            nodes.push(c.node(mode.clone()).unwrap());
        }
    }
    let mut skipped = Vec::new();
    'modes: for mode in modes(args) {
        let anchor = matches!(mode, Mode::UpstreamNft | Mode::UpstreamIptables);
        if anchor && n > args.anchors_max_services {
            skipped.push((mode, "skipped (size)".to_owned()));
            continue;
        }
        for _ in 0..args.sandboxes {
            match c.node(mode.clone()) {
                Some(node) => nodes.push(node),
                None => {
                    nodes.retain(|x| x.mode != mode);
                    let why = format!("skipped (over {}s)", args.anchor_timeout.as_secs());
                    skipped.push((mode, why));
                    continue 'modes;
                }
            }
        }
    }
    let samples = measure(&nodes, n, args.rounds);
    let floor = pooled(&nodes, &samples, &Mode::NoRules, 0);
    let floor = (percentile(&floor, 0.5), percentile(&floor, 0.99));
    let again = pooled(&nodes, &samples, &Mode::NoRulesAgain, 0);
    let mut row = Row {
        services: n,
        endpoints: e,
        floor,
        between_sandboxes: percentile(&again, 0.5) - floor.0,
        modes: Vec::new(),
    };
    for mode in modes(args) {
        let cells = match nodes.iter().any(|x| x.mode == mode) {
            true => {
                let added = |t: usize| {
                    let s = pooled(&nodes, &samples, &mode, t);
                    format!(
                        "{:+.1} / {:+.1}",
                        percentile(&s, 0.5) - floor.0,
                        percentile(&s, 0.99) - floor.1
                    )
                };
                Ok([added(0), added(1), added(2)])
            }
            false => Err(skipped
                .iter()
                .find(|(m, _)| *m == mode)
                .map(|(_, why)| why.clone())
                .unwrap()),
        };
        row.modes.push((mode.name(), cells));
    }
    drop(nodes);
    let _ = std::fs::remove_dir_all(&work);
    row
}

fn print_table(args: &Args, restore: &str, rows: &[Row]) {
    let names: Vec<String> = modes(args).iter().map(Mode::name).collect();
    println!();
    println!(
        "TCP connect() through the node, added cost over plain forwarding (no rules), \"+median / +p99\" µs; \
         {} rounds; {} sandbox(es) per column, samples pooled; upstream iptables via {restore}",
        args.rounds, args.sandboxes
    );
    println!();
    let mut head = String::from(
        "| services × endpoints | floor: no rules, median / p99 (µs) | second no-rules sandboxes: median − floor's |",
    );
    for name in &names {
        head.push_str(&format!(
            " {name}: first | {name}: last | {name}: no service |"
        ));
    }
    println!("{head}");
    println!("|---|---|---|{}", "---|".repeat(3 * names.len()));
    for row in rows {
        println!("{row}");
    }
}
