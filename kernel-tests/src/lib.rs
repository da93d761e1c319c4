//! Harness for privileged kernel tests: a sandbox of namespaces (the nftkube-sandbox crate), the real `nftkube` binary
//! running as the agent inside the node namespace, and helpers to observe traffic and the kernel's tables.
//!
//! Every test builds its own uniquely named namespaces and removes them on drop, also when it panics. Nothing
//! here touches the host's own network namespace: the agent process enters the node namespace before it
//! executes, and every client and server runs on a thread that entered its namespace.

use nftkube::nft::ir::{Family, TableState};
use nftkube::nft::netlink::NftSocket;
use nftkube_sandbox::netns::{unique_name, NetNs};
use nftkube_sandbox::Sandbox;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use nftkube_sandbox as sandbox;

pub mod fake_api;
pub mod listing;
pub mod matrix;

pub use listing::assert_listable;
use listing::ListingWatch;

/// The TCP port the sandbox backends listen on; the examples' targetPort.
pub const BACKEND_TCP_PORT: u16 = 8080;
/// The UDP port the sandbox backends listen on; the examples' targetPort.
pub const BACKEND_UDP_PORT: u16 = 5353;

/// Panics unless root: these tests need namespaces and nf_tables. Never skip silently.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "kernel tests need root (they create network namespaces); run `bash ci/test` as root"
    );
}

/// The agent binary: `$NFTKUBE_BIN`, or the workspace's debug build.
pub fn nftkube_bin() -> PathBuf {
    workspace_bin("nftkube", "NFTKUBE_BIN")
}

/// The CNI portmap plugin's own binary (the nftkube-portmap package's): `$NFTKUBE_PORTMAP_BIN`, or the
/// workspace's debug build.
pub fn portmap_bin() -> PathBuf {
    workspace_bin("nftkube-portmap", "NFTKUBE_PORTMAP_BIN")
}

/// The demo binary (the nftkube-sandbox package's `nftkube-demo`): `$NFTKUBE_DEMO_BIN`, or the workspace's
/// debug build.
pub fn demo_bin() -> PathBuf {
    workspace_bin("nftkube-demo", "NFTKUBE_DEMO_BIN")
}

/// Binary `name` of the workspace's debug build, or the path in `$env` (the VM matrix sets them);
/// `cargo build --bins --workspace` builds them (ci/kernel-tests runs it; the sandbox is not a default member).
fn workspace_bin(name: &str, env: &str) -> PathBuf {
    nftkube_sandbox::workspace_binary(env, "debug", name)
}

/// A fresh sandbox with running backends; the name prefix is unique per test and process.
pub fn sandbox(tag: &str, backends: usize) -> Sandbox {
    require_root();
    let sb = Sandbox::build(&unique_name(tag), backends).expect("building the sandbox");
    sb.start_backends(BACKEND_TCP_PORT, BACKEND_UDP_PORT)
        .expect("starting backends");
    sb
}

/// Runs `nftkube ARGS` in `ns` to completion; whatever it left in the kernel must satisfy the listing invariant.
pub fn nftkube_in(ns: &NetNs, args: &[&str]) -> Output {
    let out = ns
        .command(nftkube_bin())
        .args(args)
        .output()
        .expect("running nftkube");
    assert_listable(ns);
    out
}

/// Whether the test oracles (`nft`, `conntrack`, `ip` binaries) may be used. `NFTKUBE_NO_ORACLE=1` says they are
/// absent (the kernel-matrix VMs, minimal images): oracle-only checks then fall back to our own netlink reads,
/// while every traffic assertion runs as always.
pub fn oracles() -> bool {
    std::env::var_os("NFTKUBE_NO_ORACLE").is_none_or(|v| v.is_empty() || v == "0")
}

/// `nft list ruleset` in `ns` (the oracle): (exit success, stdout + stderr). Without oracles: every table of
/// every family read back through our own netlink dump and rendered in nft syntax; a table we cannot decode
/// makes it fail.
pub fn nft_list_ruleset(ns: &NetNs) -> (bool, String) {
    if !oracles() {
        return ns
            .run(|| {
                let mut s = NftSocket::open().expect("nf_tables socket");
                let mut text = String::new();
                for family in [Family::Ip, Family::Ip6, Family::Inet] {
                    let names = match s.list_tables(family) {
                        Ok(n) => n,
                        Err(e) => return (false, format!("listing {family:?} tables: {e}")),
                    };
                    for name in names {
                        match s.dump_table(family, &name) {
                            Ok(Some(t)) => text.push_str(&nftkube::nft::text::render_table(&t)),
                            Ok(None) => {}
                            Err(e) => return (false, format!("{text}\ndumping {name}: {e}")),
                        }
                    }
                }
                (true, text)
            })
            .expect("entering the namespace");
    }
    let out = ns
        .command("nft")
        .args(["list", "ruleset"])
        .output()
        .expect("running nft (apt-get install nftables)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Adds an empty table that is not ours (`nft add table FAMILY NAME`; without oracles, through our netlink).
pub fn add_foreign_table(ns: &NetNs, family: Family, name: &str) {
    if oracles() {
        let status = ns
            .command("nft")
            .args(["add", "table", family.as_str(), name])
            .status()
            .expect("running nft (apt-get install nftables)");
        assert!(status.success(), "nft add table {} {name}", family.as_str());
        return;
    }
    ns.run(|| {
        let mut tx = nftkube::nft::tx::Transaction::default();
        tx.push(family, name, nftkube::nft::tx::Op::AddTable);
        NftSocket::open()
            .expect("nf_tables socket")
            .commit(&tx)
            .expect("adding a foreign table");
    })
    .expect("entering the namespace");
}

/// Reads one of our tables back through netlink, from inside `ns`.
pub fn dump_table(ns: &NetNs, family: Family) -> Option<TableState> {
    ns.run(move || {
        let mut s = NftSocket::open().expect("nf_tables socket");
        s.dump_table(family, "nftkube").expect("dumping the table")
    })
    .expect("entering the namespace")
}

/// The agent (`nftkube proxy`) running in the sandbox's node namespace. SIGTERM and wait on drop.
///
/// Every state it programs is checked against the listing invariant ([`assert_listable`]): after each sync it
/// logs (on a thread of its own, see [`ListingWatch`]), in [`Agent::wait_syncs`], and once more after it exits;
/// a violation fails the test when it waits for syncs or stops the agent (also on drop).
pub struct Agent {
    child: Option<Child>,
    log: PathBuf,
    listing: Option<ListingWatch>,
}

impl Agent {
    /// Starts `nftkube proxy --manifests DIR` in `ns` with the sandbox's cluster CIDRs and `extra` flags.
    pub fn start(ns: &NetNs, manifests: &Path, extra: &[&str]) -> Agent {
        let mut cmd = ns.command(nftkube_bin());
        cmd.args(proxy_args(manifests, extra));
        Agent::spawn(cmd, ns)
    }

    /// Starts `nftkube proxy --master URL` in `ns` against a fake API server, as node-1 with the sandbox's
    /// cluster CIDRs and `extra` flags.
    pub fn start_api(ns: &NetNs, api: &fake_api::FakeApi, extra: &[&str]) -> Agent {
        let mut cmd = ns.command(nftkube_bin());
        cmd.args(proxy_args_from(
            &["--master".into(), api.url().into()],
            extra,
        ));
        Agent::spawn(cmd, ns)
    }

    /// Starts a prepared command (the agent binary with its arguments, in whatever root or sandbox the
    /// command's hooks set up, programming the ruleset of `ns`), logging to a file as `start` does.
    pub fn spawn(cmd: Command, ns: &NetNs) -> Agent {
        let mut agent = Agent::spawn_unlisted(cmd);
        agent.listing = ListingWatch::start(ns, agent.log.clone());
        agent
    }

    /// `spawn` without the listing invariant: for a test that puts tables nft cannot reload beside the
    /// agent's (iptables-nft's xtables matches), where the whole ruleset never lists and reloads.
    pub fn spawn_unlisted(mut cmd: Command) -> Agent {
        let log = std::env::temp_dir().join(format!("{}.log", unique_name("nftkube-agent")));
        let logfile = std::fs::File::create(&log).expect("agent log file");
        let child = cmd
            .stdout(Stdio::null())
            .stderr(logfile)
            .spawn()
            .expect("starting nftkube proxy");
        Agent {
            child: Some(child),
            log,
            listing: None,
        }
    }

    /// The agent's process id while it has not been stopped (for /proc/PID/... checks).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Whether the agent process is still running (not exited, not killed).
    pub fn running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Waits up to `timeout` for the agent to exit on its own; its exit status, None if it is still running
    /// (it is then stopped as `stop` does).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let exited = wait_until(timeout, || !self.running()).is_ok();
        let mut child = self.child.take()?;
        if !exited {
            self.child = Some(child);
            self.stop();
            return None;
        }
        if let Some(watch) = self.listing.take() {
            watch.finish();
        }
        child.try_wait().ok().flatten()
    }

    /// SIGTERM, then wait; returns the exit status (None if it had to be killed or was already reaped).
    /// Then checks the state the agent leaves behind, and panics with every listing problem seen since it
    /// started (unless the test is already failing).
    pub fn stop_status(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let status = terminate(&mut child);
        if let Some(watch) = self.listing.take() {
            let problems = watch.finish();
            assert!(
                problems.is_empty() || std::thread::panicking(),
                "the agent programmed states that break the listing invariant:\n{}",
                problems.join("\n\n")
            );
        }
        status
    }

    /// Everything the agent logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the agent has logged `n` completed syncs; panics with the log after `timeout`.
    /// Each of those states has been checked against the listing invariant when it returns.
    pub fn wait_syncs(&self, n: usize, timeout: Duration) {
        wait_until(timeout, || self.log().matches("sync complete").count() >= n)
            .unwrap_or_else(|_| panic!("agent did not complete {n} syncs; log:\n{}", self.log()));
        if let Some(watch) = &self.listing {
            watch.assert_checked(n);
        }
    }

    /// SIGTERM, then wait; returns whether it exited successfully.
    pub fn stop(&mut self) -> bool {
        if self.child.is_none() {
            return true;
        }
        self.stop_status().is_some_and(|s| s.success())
    }
}

/// SIGTERM, then wait up to 10 s (then SIGKILL); the exit status, None if it had to be killed.
pub fn terminate(child: &mut Child) -> Option<std::process::ExitStatus> {
    // SAFETY: kill on a pid we spawned and have not reaped yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        } else {
            eprintln!("agent log kept at {}", self.log.display());
        }
    }
}

/// `wait_until` gave up.
#[derive(Debug, Clone, Copy)]
pub struct TimedOut;

/// The arguments `Agent::start` gives `nftkube`: `proxy --manifests DIR` with the sandbox's node name and cluster
/// CIDRs, a short debounce (unless `extra` sets one), then `extra`.
pub fn proxy_args(manifests: &Path, extra: &[&str]) -> Vec<std::ffi::OsString> {
    proxy_args_from(&["--manifests".into(), manifests.into()], extra)
}

/// The same for any source: `source` is e.g. `--manifests DIR` or `--master URL`.
pub fn proxy_args_from(source: &[std::ffi::OsString], extra: &[&str]) -> Vec<std::ffi::OsString> {
    let cidrs = format!("{},{}", sandbox::CLUSTER_CIDR_V4, sandbox::CLUSTER_CIDR_V6);
    let mut args: Vec<std::ffi::OsString> = ["--log-level", "debug", "proxy"]
        .iter()
        .map(Into::into)
        .collect();
    args.extend(source.iter().cloned());
    for a in ["--hostname-override", "node-1", "--cluster-cidr", &cidrs] {
        args.push(a.into());
    }
    if !extra.contains(&"--min-sync-period") {
        args.extend(["--min-sync-period".into(), "0.2".into()]);
    }
    args.extend(extra.iter().map(Into::into));
    args
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes; returns how long it took.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> Result<Duration, TimedOut> {
    let start = Instant::now();
    loop {
        if cond() {
            return Ok(start.elapsed());
        }
        if start.elapsed() > timeout {
            return Err(TimedOut);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The repository's examples/: `$NFTKUBE_EXAMPLES`, or the path compiled in (the VM matrix copies them to a
/// fixed place, since the build's path may be hidden in the VM, e.g. under its /tmp).
pub fn examples_dir() -> PathBuf {
    std::env::var_os("NFTKUBE_EXAMPLES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples"))
}

/// A private copy of the repository's examples/ that a test may edit; removed on drop.
pub struct Manifests {
    /// The directory the agent reads (`--manifests`).
    pub dir: PathBuf,
}

impl Manifests {
    /// A fresh copy of examples/.
    pub fn examples() -> Manifests {
        let dir = std::env::temp_dir().join(unique_name("nftkube-manifests"));
        std::fs::create_dir_all(&dir).unwrap();
        let src = examples_dir();
        for entry in std::fs::read_dir(src).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "yaml") {
                std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
            }
        }
        Manifests { dir }
    }

    /// The path of `file` in the copy.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// Rewrites a file through a rename, so the agent never reads it half-written (and sees a new inode, so
    /// the change is noticed even within one mtime tick).
    pub fn write(&self, file: &str, content: &str) {
        let tmp = self.dir.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, self.path(file)).unwrap();
    }

    /// The content of `file`.
    pub fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.path(file)).unwrap()
    }

    /// Deletes `file` (the agent sees its objects go).
    pub fn remove(&self, file: &str) {
        std::fs::remove_file(self.path(file)).unwrap();
    }
}

impl Drop for Manifests {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `ip:port`.
pub fn addr(ip: &str, port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::new(ip.parse().unwrap(), port)
}

/// (backends that answered, client addresses they saw); panics on any failure.
pub fn tally(
    answers: &[std::io::Result<String>],
) -> (
    std::collections::BTreeSet<usize>,
    std::collections::BTreeSet<std::net::IpAddr>,
) {
    let mut pods = std::collections::BTreeSet::new();
    let mut peers = std::collections::BTreeSet::new();
    for a in answers {
        let answer = a.as_ref().expect("request failed");
        let (pod, peer) = sandbox::parse_answer(answer).expect("answer");
        pods.insert(pod);
        peers.insert(peer);
    }
    (pods, peers)
}

/// The backends that answered (pod indices); panics on any failed request.
pub fn pods(answers: &[std::io::Result<String>]) -> std::collections::BTreeSet<usize> {
    tally(answers).0
}

/// Whether a backend answers a TCP request to `dst` from `ns` within `timeout`.
pub fn served(ns: &NetNs, dst: std::net::SocketAddr, timeout: Duration) -> bool {
    sandbox::tcp_request(ns, dst, timeout).is_ok_and(|a| sandbox::parse_answer(&a).is_some())
}

/// A slices manifest without the endpoint at `ip` (a partial sync: one service's endpoints change). Panics if
/// no endpoint has that address (a test asking for a change that would not happen).
pub fn without_endpoint(slices: &str, ip: &str) -> String {
    let mut out = Vec::new();
    let mut skip = false;
    for line in slices.lines() {
        if line.starts_with("- addresses:") {
            skip = line.contains(&format!("\"{ip}\""));
        } else if !line.starts_with(' ') {
            skip = false;
        }
        if !skip {
            out.push(line);
        }
    }
    let s = out.join("\n") + "\n";
    assert_ne!(s, slices, "test bug: endpoint {ip} not in the slices");
    s
}

/// Chi-square statistic of observed counts against a uniform expectation.
pub fn chi_square(counts: &[usize]) -> f64 {
    chi_square_shares(counts, &vec![1; counts.len()])
}

/// Chi-square statistic of observed counts against shares in proportion to `weights`.
pub fn chi_square_shares(counts: &[usize], weights: &[usize]) -> f64 {
    let total: usize = counts.iter().sum();
    let weight: usize = weights.iter().sum();
    counts
        .iter()
        .zip(weights)
        .map(|(&c, &w)| {
            let expected = total as f64 * w as f64 / weight as f64;
            (c as f64 - expected).powi(2) / expected
        })
        .sum()
}

/// Routes `net/prefix` from the outside client to the node: where tests put external and LoadBalancer IPs.
pub fn route_from_outside(sb: &Sandbox, net: std::net::Ipv4Addr, prefix: u8) {
    sb.ext()
        .run(move || {
            nftkube_sandbox::netns::add_route(
                net.into(),
                prefix,
                Some(sandbox::node_ip_v4().into()),
                Some(sandbox::NODE_UPLINK),
            )
        })
        .expect("entering the outside client's namespace")
        .expect("adding the route");
}

/// A client that connects every 5 ms until stopped, and counts what failed (with when).
pub struct ContinuousClient {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(usize, Vec<(Duration, String)>)>,
}

impl ContinuousClient {
    /// Starts connecting to `dst` from `ns`, one connection after another, until stopped.
    pub fn start(ns: &NetNs, dst: SocketAddr) -> ContinuousClient {
        let ns = NetNs::open_existing(ns.name()).expect("opening the client's namespace");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            ns.run(move || {
                let (start, mut tries, mut failures) = (Instant::now(), 0, Vec::new());
                while !flag.load(Ordering::Relaxed) {
                    tries += 1;
                    if let Err(e) = sandbox::tcp_request_here(dst, Duration::from_secs(1)) {
                        failures.push((start.elapsed(), format!("{dst}: {e}")));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                (tries, failures)
            })
            .expect("entering the client's namespace")
        });
        ContinuousClient { stop, thread }
    }

    /// Stops it: (connections tried, failures with the time since start).
    pub fn stop(self) -> (usize, Vec<(Duration, String)>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("client thread")
    }

    /// Stops it and fails unless it tried more than `min_tries` connections and none failed `during` what.
    #[track_caller]
    pub fn assert_never_failed(self, min_tries: usize, during: &str) {
        let (tries, failures) = self.stop();
        assert!(tries > min_tries, "only {tries} connections tried");
        assert!(
            failures.is_empty(),
            "{} of {tries} connections failed during {during}: {failures:?}",
            failures.len()
        );
    }
}

/// Runs an nft script (`nft -f -`) in `ns`: a tamper, or a ruleset a test needs. Panics if nft refuses it.
pub fn nft_script(ns: &NetNs, script: &str) {
    feed(ns, "nft", &["-f", "-"], script);
}

/// Runs `program args` in `ns` with `input` on its stdin (`nft -f -`, `iptables-nft-restore`: the real tools
/// building the state a test needs). Panics if it cannot run or refuses the input.
pub fn feed(ns: &NetNs, program: &str, args: &[&str], input: &str) {
    use std::io::Write;
    let mut child = ns
        .command(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {program} (apt-get install nftables iptables): {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{program} refused:\n{input}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `n` ClusterIP services `bulk-<i>` (10.100.0.0/16), each with two endpoints nobody answers on
/// (10.200.0.0/16 and 10.201.0.0/16): about six set elements each, for tests that need a big table.
pub fn many_services(n: usize) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for i in 0..n {
        let (hi, lo) = (i / 250, i % 250 + 1);
        let _ = write!(
            out,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: bulk-{i}, namespace: bulk}}\n\
             spec:\n  clusterIP: 10.100.{hi}.{lo}\n  ports:\n  - {{name: tcp, port: 80, protocol: TCP}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: bulk-{i}-a, namespace: bulk, labels: {{kubernetes.io/service-name: bulk-{i}}}}}\n\
             addressType: IPv4\nports:\n- {{name: tcp, port: 8080, protocol: TCP}}\nendpoints:\n\
             - {{addresses: [\"10.200.{hi}.{lo}\"]}}\n- {{addresses: [\"10.201.{hi}.{lo}\"]}}\n"
        );
    }
    out
}

/// `n` ClusterIP services `demo/svc<i>` (port `tcp`, 80/TCP) at [`pod_backed_service`]`(i)`, each with the
/// sandbox's three pods as endpoints, so that any of them can be probed with real packets.
pub fn pod_backed_services(n: u32) -> (nftkube::model::ServiceMap, nftkube::model::EndpointsMap) {
    use nftkube::model::*;
    let (mut services, mut endpoints) = (ServiceMap::new(), EndpointsMap::new());
    for i in 0..n {
        let name = ServicePortName {
            service: NamespacedName::new("demo", format!("svc{i}")),
            port: "tcp".into(),
            protocol: Protocol::Tcp,
        };
        let sp = ServicePort::cluster_ip(name.clone(), vec![pod_backed_service(i).ip()], 80);
        let eps = (1..=3)
            .map(|p| Endpoint::ready(sandbox::pod_ip_v4(p).into(), BACKEND_TCP_PORT))
            .collect();
        endpoints.insert(name.clone(), eps);
        services.insert(name, sp);
    }
    (services, endpoints)
}

/// The ClusterIP and port of service `i` of [`pod_backed_services`]: 10.100.0.0 + i, port 80.
pub fn pod_backed_service(i: u32) -> SocketAddr {
    let ip = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 100, 0, 0)) + i);
    SocketAddr::new(ip.into(), 80)
}

/// A LoadBalancer service `demo/lb` with `externalTrafficPolicy: Local`, the given healthCheckNodePort and
/// NodePort, and one ready endpoint on this node (pod 1): what a cloud load balancer's health checks probe.
pub fn local_load_balancer(health_check_node_port: u16, node_port: u16) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: lb\n  namespace: demo\nspec:\n  type: LoadBalancer\n  \
         clusterIP: 10.96.0.50\n  clusterIPs: [10.96.0.50]\n  ipFamilies: [IPv4]\n  ipFamilyPolicy: SingleStack\n  \
         externalTrafficPolicy: Local\n  healthCheckNodePort: {health_check_node_port}\n  ports:\n  - name: tcp\n    port: 80\n    \
         targetPort: 8080\n    protocol: TCP\n    nodePort: {node_port}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: lb-1\n  namespace: demo\n  \
         labels:\n    kubernetes.io/service-name: lb\naddressType: IPv4\nports:\n- name: tcp\n  port: 8080\n  \
         protocol: TCP\nendpoints:\n- addresses: [\"{}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  \
         nodeName: node-1\n",
        sandbox::pod_ip_v4(1)
    )
}

/// Whether pod `pod`'s connections to `dst` reach the other endpoints (of pods 1..=`pods`) masqueraded: they
/// see the node's side of their own link, not `pod`'s address. Its own answers come back hairpinned, which is
/// masqueraded whatever the local-traffic detector says, so they tell nothing and are left out.
pub fn masqueraded_from_pod(sb: &Sandbox, pod: usize, pods: usize, dst: SocketAddr) -> bool {
    let answers = sandbox::tcp_requests(sb.pod(pod), dst, 30, Duration::from_secs(2));
    let peers: std::collections::BTreeSet<std::net::IpAddr> = answers
        .iter()
        .filter_map(|a| sandbox::parse_answer(a.as_ref().ok()?))
        .filter(|(p, _)| *p != pod)
        .map(|(_, peer)| peer)
        .collect();
    let node_side: std::collections::BTreeSet<std::net::IpAddr> = (1..=pods)
        .filter(|i| *i != pod)
        .map(|i| sandbox::pod_gateway_v4(i).into())
        .collect();
    !peers.is_empty() && peers.is_subset(&node_side)
}

/// A TCP server on a thread inside `ns` answering "hello" to every connection, until `stop` is set: a
/// socket of the node's (or of a host beyond it) that a rule must keep traffic from, or let it reach.
pub fn hello_listener(
    ns: &NetNs,
    addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let l = ns
        .run(move || std::net::TcpListener::bind(addr))
        .unwrap()
        .unwrap();
    l.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((mut s, _)) => {
                    let _ = std::io::Write::write_all(&mut s, b"hello\n");
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
}

/// The names of `family`'s tables in `ns`, read over nf_tables netlink (no oracle needed).
pub fn table_names(ns: &NetNs, family: Family) -> Vec<String> {
    ns.run(|| {
        NftSocket::open()
            .expect("nf_tables socket")
            .list_tables(family)
            .expect("listing tables")
    })
    .expect("entering the namespace")
}
