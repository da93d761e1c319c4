//! No client can starve the agent's health answers: the real agent serves a healthCheckNodePort and
//! `/healthz` on all addresses; a pod holds hundreds of idle connections to both, and keeps opening new ones,
//! while the outside client's probes and `/livez` on loopback (the kubelet's liveness probe) are answered
//! within a second. Before the per-source limits, 64 idle connections filled each listener and every
//! probe timed out while the pod held them. The agent starts with a low soft open-files limit, which it
//! raises to the hard one.

use kernel_tests::sandbox::{self, Sandbox};
use kernel_tests::*;
use nftkube::admin::http::get;
use nftkube_sandbox::netns::NetNs;
use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const SYNC: Duration = Duration::from_secs(20);
/// What a load balancer's or the kubelet's probe waits, at most (the agent must answer well within it).
const PROBE: Duration = Duration::from_secs(1);
const HC_PORT: u16 = 32021;
const HEALTHZ_PORT: u16 = 10256;
/// Idle connections the pod holds to each port.
const HELD: usize = 300;

/// GET `path` on `to` from inside `ns`, with a probe's timeout: the status and how long it took.
fn probe(ns: &NetNs, to: SocketAddr, path: &str) -> (Option<u16>, Duration) {
    let path = path.to_string();
    let t = Instant::now();
    let status = ns
        .run(move || get(to, &path, PROBE))
        .expect("entering the namespace")
        .ok()
        .map(|r| r.0);
    (status, t.elapsed())
}

/// `n` silent connections to each of `targets`, opened from pod 1's namespace and held by the caller.
fn hold_idle(sb: &Sandbox, targets: &[SocketAddr], n: usize) -> Vec<TcpStream> {
    let targets = targets.to_vec();
    sb.pod(1)
        .run(move || {
            targets
                .iter()
                .flat_map(|to| {
                    (0..n).filter_map(move |_| TcpStream::connect_timeout(to, PROBE).ok())
                })
                .collect()
        })
        .expect("entering pod 1's namespace")
}

/// Keeps opening idle connections to `targets` from inside `ns` until `stop`, holding the newest
/// [`HELD`] per target (dropping the oldest): a pod that keeps its pressure up however many the agent
/// closes. Returns how many it opened.
fn churn(ns: &NetNs, targets: &[SocketAddr], stop: &AtomicBool) -> usize {
    ns.run(|| {
        let mut held = VecDeque::new();
        let mut opened = 0;
        while !stop.load(Ordering::SeqCst) {
            for to in targets {
                if let Ok(s) = TcpStream::connect_timeout(to, PROBE) {
                    opened += 1;
                    held.push_back(s);
                }
            }
            while held.len() > HELD * targets.len() {
                held.pop_front();
            }
            // A pod's CPU is capped by its cgroup; here the churner shares two cores with the agent and
            // the probes. Unpaced it starved the whole machine under a parallel build (a loopback probe
            // missed 1 s); paced it still opens thousands of connections a second, far past every cap.
            std::thread::sleep(Duration::from_micros(500));
        }
        opened
    })
    .expect("entering the namespace")
}

/// Sets its flag when dropped: a failing assertion still stops the churning thread, which the scope joins.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Probes each of `probes` (namespace, address, path) every 100 ms for `during`; panics on any answer
/// other than 200 within [`PROBE`]. Returns how many were made and the slowest answer.
fn probe_repeatedly(
    probes: &[(&NetNs, SocketAddr, &str)],
    during: Duration,
    log: impl Fn() -> String,
) -> (usize, Duration) {
    let until = Instant::now() + during;
    let (mut count, mut slowest) = (0, Duration::ZERO);
    while Instant::now() < until {
        for (ns, to, path) in probes {
            let (status, took) = probe(ns, *to, path);
            assert_eq!(
                status,
                Some(200),
                "GET {to}{path} during the flood, after {took:?}; log:\n{}",
                log()
            );
            slowest = slowest.max(took);
            count += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (count, slowest)
}

/// Starts the agent with a soft open-files limit of 256 (under the hard one), as many service managers
/// leave it: the agent must raise it.
fn with_low_soft_open_files_limit(cmd: &mut std::process::Command) {
    // SAFETY: the closure runs in the forked child before exec and only calls getrlimit and setrlimit,
    // which are async-signal-safe, on a local struct.
    unsafe {
        cmd.pre_exec(|| {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            lim.rlim_cur = lim.rlim_max.min(256);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Raises this test process's soft open-files limit to its hard one: the pod's held connections and the
/// churn's hold over a thousand descriptors together, past a default soft limit of 1024 (the VM matrix's).
fn raise_own_open_files_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the local struct they are given.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(
        lim.rlim_cur as usize >= 4 * HELD + 64,
        "the hard open-files limit ({}) is too low for this test",
        lim.rlim_cur
    );
}

/// The soft and hard open-files limits of process `pid`, from `/proc/PID/limits`.
fn open_files_limits(pid: u32) -> (String, String) {
    let limits =
        std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("reading the limits");
    let line = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .expect("a Max open files line");
    let mut values = line.split_whitespace();
    let mut next = || values.next().expect("a limit").to_string();
    (next(), next())
}

/// The value of one sample line of the agent's `/metrics`, read from the node namespace.
fn metric(sb: &Sandbox, sample: &str) -> Option<f64> {
    let (_, _, text) = sb
        .node()
        .run(|| get(addr("127.0.0.1", 10249), "/metrics", Duration::from_secs(2)))
        .expect("entering the node namespace")
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn a_pod_holding_hundreds_of_idle_connections_cannot_starve_health_probes() {
    raise_own_open_files_limit();
    let sb = sandbox("nk-hcstarve", 2);
    let m = Manifests::examples();
    m.write("lb.yaml", &local_load_balancer(HC_PORT, 30161));
    let healthz_on_all = format!("0.0.0.0:{HEALTHZ_PORT}");
    let mut cmd = sb.node().command(nftkube_bin());
    cmd.args(proxy_args(
        &m.dir,
        &["--healthz-bind-address", &healthz_on_all],
    ));
    with_low_soft_open_files_limit(&mut cmd);
    let mut agent = Agent::spawn(cmd, sb.node());
    agent.wait_syncs(1, SYNC);
    let (soft, hard) = open_files_limits(agent.pid().expect("the agent's pid"));
    assert_eq!(
        soft, hard,
        "the agent did not raise its soft open-files limit"
    );
    let node_ip = sandbox::node_ip_v4().to_string();
    let hc = addr(&node_ip, HC_PORT);
    let healthz = addr(&node_ip, HEALTHZ_PORT);
    let livez = addr("127.0.0.1", HEALTHZ_PORT);
    wait_until(SYNC, || probe(sb.ext(), hc, "/").0 == Some(200))
        .unwrap_or_else(|_| panic!("{hc} never answered 200; log:\n{}", agent.log()));
    assert_eq!(probe(sb.ext(), healthz, "/healthz").0, Some(200));

    // The pod takes hundreds of connections to both ports, and keeps opening more.
    let held = hold_idle(&sb, &[hc, healthz], HELD);
    assert!(
        held.len() >= HELD,
        "the pod opened {} connections",
        held.len()
    );
    let stop = AtomicBool::new(false);
    let (probes, slowest, churned) = std::thread::scope(|scope| {
        let churner = scope.spawn(|| churn(sb.pod(1), &[hc, healthz], &stop));
        let _stop_churning = SetOnDrop(&stop);
        // Meanwhile the outside client's probes and the kubelet's /livez on loopback are answered at
        // once, for longer than the header timeout (so that no answer comes only because something
        // timed out).
        let (probes, slowest) = probe_repeatedly(
            &[
                (sb.ext(), hc, "/"),
                (sb.ext(), healthz, "/healthz"),
                (sb.node(), livez, "/livez"),
            ],
            Duration::from_secs(5),
            || agent.log(),
        );
        drop(_stop_churning);
        let churned = churner.join().expect("the churning thread");
        (probes, slowest, churned)
    });
    eprintln!(
        "{probes} probes, slowest {slowest:?}, while the pod held {} connections and opened {churned} more",
        held.len()
    );
    assert!(slowest < PROBE, "slowest probe {slowest:?}");

    // The connections closed at once were counted, by listener and reason (never by address).
    for listener in ["health_check", "healthz"] {
        let sample = format!(
            "nftkube_admin_connections_refused_total{{listener=\"{listener}\",reason=\"per_source_limit\"}}"
        );
        let refused = metric(&sb, &sample).unwrap_or_else(|| panic!("{sample} missing"));
        assert!(refused >= (HELD - 8) as f64, "{sample} = {refused}");
    }
    drop(held);
    assert!(agent.running(), "the agent exited; log:\n{}", agent.log());
}
