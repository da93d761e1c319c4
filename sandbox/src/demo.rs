//! The demo: the whole agent in a sandbox of network namespaces, with real traffic.
//!
//! Builds an outside client, a client pod, a node and three backend pods (this package's library), runs the proxy
//! loop on a thread inside the node namespace against the manifests, sends connections and datagrams to every
//! ClusterIP service port from the pod and from outside, prints which backend answered and which client
//! address it saw, prints the live ruleset read back from the kernel, and removes everything. The host's own
//! namespace is never touched.

// The demo talks to the terminal that started it.
#![allow(clippy::disallowed_macros)]

use anyhow::Context;
use nftkube::agent::{run_proxy, Inbox, ProxyOptions};
use nftkube::model::{ClusterState, Protocol, ServicePort};
use nftkube::nft::ir::Family;
use nftkube::nft::netlink::NftSocket;
use nftkube::render::{names::TABLE, RenderConfig};
use nftkube::source::{apply_event, ManifestSource};
use nftkube_sandbox::netns::{unique_name, NetNs};
use nftkube_sandbox::{self as sandbox, parse_answer, tcp_requests, udp_requests, Sandbox};
use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

/// Ports the demo backends listen on (the examples' targetPorts).
const BACKEND_TCP_PORT: u16 = 8080;
const BACKEND_UDP_PORT: u16 = 5353;
const BACKENDS: usize = 3;
const TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) fn run(manifests: &Path, requests: usize) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    anyhow::ensure!(
        euid == 0,
        "the demo needs root: it creates network namespaces (it never changes the host's own)"
    );
    anyhow::ensure!(
        manifests.exists(),
        "{} not found: run the demo from the repository root or pass --manifests",
        manifests.display()
    );
    let services = load_services(manifests);

    let sb = Sandbox::build(&unique_name("nkdemo"), BACKENDS).context("building the sandbox")?;
    sb.start_backends(BACKEND_TCP_PORT, BACKEND_UDP_PORT)?;
    println!("sandbox: namespaces {}", names(&sb));
    println!(
        "  node {} / {}, outside client {}, client pod {}, backends {}",
        sandbox::node_ip_v4(),
        sandbox::node_ip_v6(),
        sandbox::ext_ip_v4(),
        sandbox::pod_ip_v4(0),
        (1..=BACKENDS)
            .map(|i| sandbox::pod_ip_v4(i).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );

    let mut opts = ProxyOptions::new(
        manifests.to_path_buf(),
        RenderConfig {
            node_name: "node-1".into(),
            cluster_cidrs: nftkube::model::parse_cidrs(&format!(
                "{},{}",
                sandbox::CLUSTER_CIDR_V4,
                sandbox::CLUSTER_CIDR_V6
            ))
            .map_err(anyhow::Error::msg)?,
            ..RenderConfig::default()
        },
    );
    opts.min_sync_period = Duration::from_millis(200);
    let (stop, inbox) = Inbox::new();
    let started = Instant::now();
    let agent = sb
        .node()
        .spawn(move || run_proxy(&opts, inbox))
        .context("starting the agent in the node namespace")?;

    let result = exercise(&sb, &services, requests, started);
    stop.stop();
    let agent_result = agent
        .join()
        .map_err(|_| anyhow::anyhow!("the agent thread panicked"))?;
    let prefix = sb.prefix().to_owned();
    drop(sb);
    let left = std::fs::read_dir(sandbox::netns::NETNS_RUN_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .count()
        })
        .unwrap_or(0);
    println!("sandbox removed ({left} namespaces left)");
    result?;
    agent_result
}

/// The ClusterIP service ports of the manifests (bad documents are reported by the source).
fn load_services(manifests: &Path) -> Vec<ServicePort> {
    let mut source = ManifestSource::new(manifests.to_path_buf());
    let mut state = ClusterState::new();
    let (events, _) = source.initial();
    for ev in events {
        apply_event(&mut state, ev);
    }
    state.service_map().values().cloned().collect()
}

fn names(sb: &Sandbox) -> String {
    sb.namespaces()
        .map(|n| n.name().to_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

fn exercise(
    sb: &Sandbox,
    services: &[ServicePort],
    requests: usize,
    started: Instant,
) -> anyhow::Result<()> {
    let first = services
        .iter()
        .find(|s| s.protocol == Protocol::Tcp && !s.cluster_ips.is_empty())
        .context("the manifests hold no TCP ClusterIP service")?;
    let probe = SocketAddr::new(first.cluster_ips[0], first.port);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        // Every try is a new connection (fresh source port), so an early try cannot pin later ones.
        let ok = tcp_requests(sb.client(), probe, 1, Duration::from_millis(300))
            .pop()
            .is_some_and(|r| r.is_ok());
        if ok {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "{probe} never became reachable");
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "agent synced; {probe} answers {:?} after start\n",
        started.elapsed()
    );

    println!("traffic ({requests} new connections or datagrams each):");
    for svc in services {
        for ip in &svc.cluster_ips {
            let dst = SocketAddr::new(*ip, svc.port);
            let label = format!("{} {dst}/{}", svc.name, svc.protocol);
            let mut clients = vec![("pod", sb.client())];
            if ip.is_ipv4() {
                clients.push(("outside", sb.ext()));
            }
            for (who, ns) in clients {
                println!(
                    "  {label:<40} from {who:<8} {}",
                    describe(ns, svc.protocol, dst, requests)
                );
            }
        }
    }

    println!("\nlive ruleset, read back from the node's kernel over netlink:\n");
    for family in [Family::Ip, Family::Ip6] {
        let table = sb.node().run(move || -> anyhow::Result<_> {
            Ok(NftSocket::open()?.dump_table(family, TABLE)?)
        })??;
        match table {
            Some(t) => print!("{}", nftkube::nft::text::render_table(&t)),
            None => println!("(no {} table)", family.as_str()),
        }
    }
    Ok(())
}

/// Sends the requests and summarises: hits per backend and the client addresses the backends saw, or how
/// the service refused.
fn describe(ns: &NetNs, proto: Protocol, dst: SocketAddr, n: usize) -> String {
    let start = Instant::now();
    let answers: Vec<io::Result<String>> = match proto {
        Protocol::Tcp => tcp_requests(ns, dst, n, TIMEOUT),
        Protocol::Udp => udp_requests(ns, dst, n, TIMEOUT),
        Protocol::Sctp => return "SCTP: not exercised by the demo".into(),
    };
    let mut hits: BTreeMap<usize, usize> = BTreeMap::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for a in &answers {
        match a.as_ref().map(|s| parse_answer(s)) {
            Ok(Some((pod, peer))) => {
                *hits.entry(pod).or_default() += 1;
                *seen.entry(peer.to_string()).or_default() += 1;
            }
            Ok(None) => *errors.entry("unexpected answer".into()).or_default() += 1,
            Err(e) => *errors.entry(error_name(e)).or_default() += 1,
        }
    }
    let per_request = start.elapsed() / n.max(1) as u32;
    let mut parts = Vec::new();
    if !hits.is_empty() {
        let h: Vec<String> = hits.iter().map(|(p, c)| format!("pod{p} {c:>3}")).collect();
        let s: Vec<&str> = seen.keys().map(String::as_str).collect();
        parts.push(format!("{}   backend saw {}", h.join("  "), s.join(", ")));
    }
    for (e, c) in errors {
        parts.push(format!("{e} x{c}"));
    }
    format!("{}   [{per_request:.1?} per request]", parts.join("; "))
}

fn error_name(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "rejected (TCP reset / ICMP port unreachable)".into(),
        io::ErrorKind::TimedOut => "timed out".into(),
        _ => e.to_string(),
    }
}
