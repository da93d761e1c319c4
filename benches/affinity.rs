//! ClientIP session affinity: new-connection latency on the hit path and on the miss path, as ratios against
//! the same endpoints without affinity, all measured in the same run, interleaved.
//!
//! Real packets in a sandbox (see sandbox/src/lib.rs): the client pod opens a TCP connection to a ClusterIP that
//! the library programmed in the node namespace (`SyncEngine` + `render::all_pieces`), the backend answers
//! one line and closes. The client pod has `CLIENTS` extra addresses, and round r of the measurement binds
//! every probe to client address r mod `CLIENTS`, so all variants send from the same addresses. For each
//! endpoint count E, services with the same E endpoints:
//! - anchor: no affinity;
//! - hit: affinity; every client address connected to it before the timed rounds, so its entry exists (the
//!   `lb-aff-<n>` lookup finds it, and the record refreshes it);
//! - miss: affinity, several frontends; round r goes to miss frontend r div `CLIENTS`, so every (client,
//!   frontend) pair is used once: each probe is a client's first connection (lookup miss, random choice, the
//!   record inserting an entry).
//!
//! Nothing but probes happens during the timed rounds: no netlink traffic, no sleeping. (Deleting the entry
//! over netlink before each miss probe was tried first: a control, the anchor after the same kind of
//! one-element commit, came out 0–16% slower than the anchor, as much as the miss itself, so that method
//! measured the commit as much as the miss.)
//!
//! The E endpoints are E distinct addresses on the one backend pod (10.244.1.2 and up): every slot is a real
//! backend, and the endpoint map values differ as they would in a cluster.
//!
//! Run as root: `cargo bench --bench affinity -- 2,10,100` (also run by `bash ci/bench`).
//! `NFTKUBE_BENCH_AFFINITY_PROBES` sets the timed probes per variant and E (default 1000).

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use nftkube::model::*;
use nftkube::nft::ir::{Element, ElementValue, Family};
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube::nft::Backend;
use nftkube::render::names::{MAP_AFFINITY, TABLE};
use nftkube::render::{self, RenderConfig};
use nftkube::sync::SyncEngine;
use nftkube_sandbox::netns::unique_name;
use nftkube_sandbox::{self as sandbox, Sandbox};
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::FromRawFd;
use std::time::{Duration, Instant};

/// Rounds before the timed ones, discarded: caches and the node's neighbour entries settle.
const WARMUP: usize = 50;
/// Client addresses (10.244.0.3 and up, in the client pod's /24).
const CLIENTS: usize = 250;
/// The service's timeoutSeconds: long enough that no entry expires during the run.
const AFFINITY_SECONDS: u32 = 3 * 3600;
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const BACKEND_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
/// The backend pod holding every endpoint address.
const BACKEND_POD: usize = 1;
/// A second backend pod, no service's endpoint: only a connection that used a (doctored) affinity entry gets
/// there (see `check_hits_use_the_entry`).
const TRAP_POD: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Anchor,
    Hit,
    Miss,
}

const VARIANTS: [Variant; 3] = [Variant::Anchor, Variant::Hit, Variant::Miss];

/// The services of one endpoint count, by ClusterIP.
struct Group {
    endpoints: usize,
    anchor: Ipv4Addr,
    hit: Ipv4Addr,
    misses: Vec<Ipv4Addr>,
}

impl Group {
    /// Group g's ClusterIPs: 10.96.(1+g).1 the anchor, .2 the hit service, .10 and up the miss services.
    fn new(g: usize, endpoints: usize, misses: usize) -> Group {
        let ip = |k: usize| Ipv4Addr::new(10, 96, 1 + g as u8, k as u8);
        Group {
            endpoints,
            anchor: ip(1),
            hit: ip(2),
            misses: (0..misses).map(|m| ip(10 + m)).collect(),
        }
    }

    /// Where round `round` sends a probe of `v`.
    fn frontend(&self, v: Variant, round: usize) -> Ipv4Addr {
        match v {
            Variant::Anchor => self.anchor,
            Variant::Hit => self.hit,
            Variant::Miss => self.misses[round / CLIENTS],
        }
    }

    /// Every service of the group, with or without affinity.
    fn services(&self) -> impl Iterator<Item = (Ipv4Addr, bool)> + '_ {
        [(self.anchor, false), (self.hit, true)]
            .into_iter()
            .chain(self.misses.iter().map(|&m| (m, true)))
    }
}

/// Timings of one endpoint count, indexed like `VARIANTS`.
struct Samples {
    endpoints: usize,
    times: [Vec<Duration>; 3],
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "benchmarks need root (network namespaces)");
    let counts: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "2,10,100".into())
        .split(',')
        .map(|s| s.parse().expect("endpoint counts: comma-separated numbers"))
        .collect();
    assert!(
        counts.iter().all(|&e| (1..=250).contains(&e)),
        "endpoint counts must be 1..=250 (addresses of the backend pod's /24)"
    );
    let probes: usize = std::env::var("NFTKUBE_BENCH_AFFINITY_PROBES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let rounds = WARMUP + probes;

    let sb = Sandbox::build(&unique_name("nkbench-aff"), TRAP_POD).unwrap();
    sb.start_backends(BACKEND_PORT, 5353).unwrap();
    let backends = sb.add_pod_addresses(BACKEND_POD, 0, *counts.iter().max().unwrap());
    let clients = sb.add_pod_addresses(0, 1, CLIENTS);
    let groups: Vec<Group> = counts
        .iter()
        .enumerate()
        .map(|(g, &e)| Group::new(g, e, rounds.div_ceil(CLIENTS)))
        .collect();
    program(&sb, &groups, &backends);
    // Opened in the node namespace, used from the client's thread: a socket keeps its namespace.
    let node_nft = sb.node().run(NftSocket::open).unwrap().unwrap();
    let results = sb
        .client()
        .run(move || measure(&groups, &backends, &clients, node_nft, rounds))
        .unwrap();
    print_table(&results, probes);
}

fn endpoint(ip: Ipv4Addr) -> Endpoint {
    Endpoint::ready(ip.into(), BACKEND_PORT)
}

/// One full sync through the library in the node namespace: every group's services.
fn program(sb: &Sandbox, groups: &[Group], backends: &[Ipv4Addr]) {
    let mut services = ServiceMap::new();
    let mut endpoints = EndpointsMap::new();
    for g in groups {
        for (ip, affinity) in g.services() {
            let name = ServicePortName {
                service: NamespacedName::new("bench", format!("svc-{}", ip).replace('.', "-")),
                port: "p80".into(),
                protocol: Protocol::Tcp,
            };
            let mut sp = ServicePort::cluster_ip(name.clone(), vec![ip.into()], SERVICE_PORT);
            sp.session_affinity_timeout = affinity.then_some(AFFINITY_SECONDS);
            let eps = backends[..g.endpoints]
                .iter()
                .map(|&a| endpoint(a))
                .collect();
            endpoints.insert(name.clone(), eps);
            services.insert(name, sp);
        }
    }
    let cfg = RenderConfig {
        cluster_cidrs: vec![sandbox::CLUSTER_CIDR_V4.parse().unwrap()],
        ..RenderConfig::default()
    };
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
}

/// A TCP connection from `src` (one of the client pod's addresses) to `dst`: connect, read the answer to
/// the end, close. Returns the answer.
fn request_from(src: Ipv4Addr, dst: SocketAddrV4) -> String {
    let sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain syscall; the fd is owned by the TcpStream right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh socket nobody else owns.
    let mut stream = unsafe { TcpStream::from_raw_fd(fd) };
    // The timeout also bounds a blocking connect (SO_SNDTIMEO).
    stream.set_write_timeout(Some(PROBE_TIMEOUT)).unwrap();
    stream.set_read_timeout(Some(PROBE_TIMEOUT)).unwrap();
    let (from, to) = (sockaddr(SocketAddrV4::new(src, 0)), sockaddr(dst));
    // SAFETY: both are valid sockaddr_in of the size passed, on an fd we own.
    unsafe {
        let from = &from as *const libc::sockaddr_in as *const libc::sockaddr;
        assert_eq!(libc::bind(fd, from, len), 0, "bind {src}");
        let to = &to as *const libc::sockaddr_in as *const libc::sockaddr;
        let rc = libc::connect(fd, to, len);
        assert_eq!(
            rc,
            0,
            "connect {src} → {dst}: {}",
            std::io::Error::last_os_error()
        );
    }
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("answer");
    answer
}

/// One timed probe; the answer must come from the backend pod and name the source address it was sent from
/// (so replies to every client address route back, and no probe reached the trap pod).
fn probe(src: Ipv4Addr, frontend: Ipv4Addr) -> Duration {
    let start = Instant::now();
    let answer = request_from(src, SocketAddrV4::new(frontend, SERVICE_PORT));
    let t = start.elapsed();
    assert_eq!(
        sandbox::parse_answer(&answer),
        Some((BACKEND_POD, src.into())),
        "{src} → {frontend}: {answer:?}"
    );
    t
}

/// Before anything is timed: one connection to every backend address and from every client address, so the
/// node has resolved each neighbour (a first packet to an address waits for ARP); those from the clients go to
/// the hit services, recording the entries the hit variant finds.
fn prepare(groups: &[Group], backends: &[Ipv4Addr], clients: &[Ipv4Addr]) {
    for &b in backends {
        request_from(clients[0], SocketAddrV4::new(b, BACKEND_PORT));
    }
    for &c in clients {
        for g in groups {
            probe(c, g.hit);
        }
    }
}

/// A small xorshift: the probe order of each round is shuffled, so that no variant always follows the same
/// one, without a dependency and the same in every run.
struct Shuffle(u64);

impl Shuffle {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn apply<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

/// Runs in the client pod. Rounds of one probe per group and variant in a shuffled order, all from the
/// round's client address.
fn measure(
    groups: &[Group],
    backends: &[Ipv4Addr],
    clients: &[Ipv4Addr],
    mut nft: NftSocket,
    rounds: usize,
) -> Vec<Samples> {
    prepare(groups, backends, clients);
    let mut out: Vec<Samples> = groups
        .iter()
        .map(|g| Samples {
            endpoints: g.endpoints,
            times: Default::default(),
        })
        .collect();
    let mut order: Vec<(usize, usize)> = (0..groups.len())
        .flat_map(|g| (0..VARIANTS.len()).map(move |v| (g, v)))
        .collect();
    let mut shuffle = Shuffle(0x9e37_79b9_7f4a_7c15);
    for round in 0..rounds {
        let client = clients[round % CLIENTS];
        shuffle.apply(&mut order);
        for &(gi, vi) in &order {
            let t = probe(client, groups[gi].frontend(VARIANTS[vi], round));
            if round >= WARMUP {
                out[gi].times[vi].push(t);
            }
        }
    }
    check_misses_were_recorded(&mut nft, groups, rounds);
    check_hits_use_the_entry(&mut nft, groups, clients[0]);
    out
}

/// The affinity entries whose key (saddr . daddr . l4proto . dport, 4-byte registers) starts with `prefix`.
fn entries(nft: &mut NftSocket, prefix: &[u8]) -> Vec<Element> {
    nft.read_set(Family::Ip, TABLE, MAP_AFFINITY)
        .unwrap()
        .into_iter()
        .filter(|e| e.key.starts_with(prefix))
        .collect()
}

/// Every miss probe was a first connection that the record path saw: one entry per (client, miss frontend)
/// pair used, each pair used once by construction.
fn check_misses_were_recorded(nft: &mut NftSocket, groups: &[Group], rounds: usize) {
    let all = nft.read_set(Family::Ip, TABLE, MAP_AFFINITY).unwrap();
    for g in groups {
        let recorded = all
            .iter()
            .filter(|e| {
                g.misses
                    .iter()
                    .any(|m| e.key.get(4..8) == Some(&m.octets()))
            })
            .count();
        assert_eq!(
            recorded, rounds,
            "miss entries of the {}-endpoint group",
            g.endpoints
        );
    }
}

/// The hit variant must really hit, that is the `lb-aff-<n>` chain must take the entry before choosing. The
/// endpoint reached cannot be told from an answer (the one backend pod answers for all its addresses) and the
/// record never overwrites an existing entry's endpoint, so the check is a trap: point `client`'s hit entries
/// at the trap pod, which is no endpoint of any service. Only a connection that used the entry gets there.
fn check_hits_use_the_entry(nft: &mut NftSocket, groups: &[Group], client: Ipv4Addr) {
    let mut tx = Transaction::default();
    for g in groups {
        let mut entry = entries(nft, &[client.octets(), g.hit.octets()].concat());
        assert_eq!(entry.len(), 1, "one hit entry for {client} → {}", g.hit);
        let mut trap = entry.remove(0);
        let Some(ElementValue::Data(value)) = &trap.value else {
            panic!("affinity entry without an endpoint: {trap:?}")
        };
        // Value: endpoint address (4 bytes) . port (network order, in a 4-byte register).
        let mut bytes = value.to_vec();
        bytes[..4].copy_from_slice(&sandbox::pod_ip_v4(TRAP_POD).octets());
        let set = || MAP_AFFINITY.to_string();
        tx.push(
            Family::Ip,
            TABLE,
            Op::DeleteElements {
                set: set(),
                elements: vec![trap.clone()],
            },
        );
        trap.value = Some(ElementValue::Data(bytes.into()));
        tx.push(
            Family::Ip,
            TABLE,
            Op::AddElements {
                set: set(),
                elements: vec![trap],
            },
        );
    }
    nft.commit(&tx).unwrap();
    for g in groups {
        let answer = request_from(client, SocketAddrV4::new(g.hit, SERVICE_PORT));
        let pod = sandbox::parse_answer(&answer).map(|(pod, _)| pod);
        assert_eq!(pod, Some(TRAP_POD), "the hit entry was not used: {answer}");
    }
}

fn quantile(v: &[Duration], q: f64) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    s[((s.len() - 1) as f64 * q).round() as usize]
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn print_table(results: &[Samples], probes: usize) {
    println!();
    println!(
        "ClientIP affinity, new TCP connection (connect, one answer, close), {probes} probes per cell; µs median / p90"
    );
    println!("| endpoints | no affinity (anchor) | hit | miss | hit / anchor | miss / anchor |");
    println!("|---|---|---|---|---|---|");
    for s in results {
        let med: Vec<Duration> = s.times.iter().map(|t| quantile(t, 0.5)).collect();
        let p90: Vec<Duration> = s.times.iter().map(|t| quantile(t, 0.9)).collect();
        let cell = |i: usize| format!("{} / {}", us(med[i]), us(p90[i]));
        let ratio = |i: usize| format!("{:.2}", med[i].as_secs_f64() / med[0].as_secs_f64());
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            s.endpoints,
            cell(0),
            cell(1),
            cell(2),
            ratio(1),
            ratio(2)
        );
    }
}
