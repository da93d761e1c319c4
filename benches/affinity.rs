//! ClientIP session affinity: new-connection latency on the hit path and on the miss path, as ratios against
//! the same service without affinity, all measured in the same run, interleaved.
//!
//! Real packets in a sandbox (see src/sandbox.rs): the client pod opens a TCP connection to a ClusterIP that
//! the library programmed in the node namespace (`SyncEngine` + `render::all_pieces`), the backend answers
//! one line and closes. For each endpoint count E, three services share the same E endpoints:
//! - `anchor`: no affinity;
//! - `hit`: affinity; the same client connects again and again, so its entry exists (the `lb-aff-<n>` lookup
//!   finds it, and the record refreshes it);
//! - `miss`: affinity; before each of its probes the client's entry for that frontend is deleted over
//!   netlink (`Op::DeleteElements` in the node namespace, outside the timed window), so every probe is the
//!   first connection of a client: the lookup misses, the random choice runs, and the record inserts.
//!
//! The E endpoints are E distinct addresses on the one backend pod (10.244.1.2 and up): every slot is a real
//! backend, and the endpoint map values differ as they would in a cluster.
//!
//! Run as root: `cargo bench --bench affinity -- 2,10,100` (also run by `bash ci/bench`).
//! `NFTKUBE_BENCH_AFFINITY_PROBES` sets the timed probes per variant and E (default 1000).

use nftkube::model::*;
use nftkube::netns::{add_address, unique_name};
use nftkube::nft::ir::{Element, ElementValue, Family};
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube::nft::Backend;
use nftkube::render::names::{MAP_AFFINITY, TABLE};
use nftkube::render::{self, RenderConfig};
use nftkube::sandbox::{self, Sandbox};
use nftkube::sync::SyncEngine;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

/// Untimed probes per variant before measuring: neighbour entries, conntrack and caches settle.
const WARMUP: usize = 50;
/// The same idle gap before every probe of every variant. The miss variant's netlink delete leaves deferred
/// kernel work (the transaction's release after an RCU grace period); without a gap it could land inside the
/// next timed window, and only the miss variant's.
const SETTLE: Duration = Duration::from_millis(1);
/// The service's timeoutSeconds: long enough that no entry expires during the run.
const AFFINITY_SECONDS: u32 = 3 * 3600;
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const BACKEND_PORT: u16 = 8080;
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
    /// The anchor's service, each probe preceded by a one-element commit to the affinity map (of an entry no
    /// connection uses), like a miss probe: shows what the commit before a miss costs by itself.
    AnchorAfterCommit,
}

const VARIANTS: [Variant; 4] = [
    Variant::Anchor,
    Variant::Hit,
    Variant::Miss,
    Variant::AnchorAfterCommit,
];

impl Variant {
    /// Which of the group's services the variant connects to.
    fn service(self) -> usize {
        match self {
            Variant::Anchor | Variant::AnchorAfterCommit => 0,
            Variant::Hit => 1,
            Variant::Miss => 2,
        }
    }
}

/// The services of one endpoint count: the ClusterIPs of the anchor, hit and miss services.
struct Group {
    endpoints: usize,
    frontends: [Ipv4Addr; 3],
}

/// Timings of one endpoint count, indexed like `VARIANTS`.
struct Samples {
    endpoints: usize,
    times: [Vec<Duration>; 4],
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "benchmarks need root (network namespaces)"
    );
    let counts: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "2,10,100".into())
        .split(',')
        .map(|s| s.parse().expect("endpoint counts: comma-separated numbers"))
        .collect();
    assert!(
        counts.iter().all(|&e| (1..=250).contains(&e)),
        "endpoint counts must be 1..=250 (addresses of 10.244.1.0/24)"
    );
    let probes: usize = std::env::var("NFTKUBE_BENCH_AFFINITY_PROBES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);

    let sb = Sandbox::build(&unique_name("nkbench-aff"), TRAP_POD).unwrap();
    sb.start_backends(BACKEND_PORT, 5353).unwrap();
    let backends = backend_addresses(&sb, *counts.iter().max().unwrap());
    let groups: Vec<Group> = counts
        .iter()
        .enumerate()
        .map(|(g, &e)| Group {
            endpoints: e,
            frontends: [1, 2, 3].map(|k| Ipv4Addr::new(10, 96, 1 + g as u8, k)),
        })
        .collect();
    program(&sb, &groups, &backends);
    // Opened in the node namespace, used from the client's thread: a socket keeps its namespace.
    let node_nft = sb.node().run(NftSocket::open).unwrap().unwrap();
    let results = sb
        .client()
        .run(move || measure(&groups, &backends, node_nft, probes))
        .unwrap();
    print_table(&results, probes);
}

/// Gives the backend pod `count` addresses (its own 10.244.1.2 first, `pod_ip_v4(BACKEND_POD)`), all answered by its wildcard server.
fn backend_addresses(sb: &Sandbox, count: usize) -> Vec<Ipv4Addr> {
    let [a, b, c, d] = sandbox::pod_ip_v4(BACKEND_POD).octets();
    let addrs: Vec<Ipv4Addr> = (0..count)
        .map(|k| Ipv4Addr::new(a, b, c, d + k as u8))
        .collect();
    let extra = addrs[1..].to_vec();
    sb.pod(BACKEND_POD)
        .run(move || {
            for a in extra {
                add_address(sandbox::POD_IFNAME, a.into(), 24).unwrap();
            }
        })
        .unwrap();
    addrs
}

fn endpoint(ip: Ipv4Addr) -> Endpoint {
    Endpoint {
        ip: ip.into(),
        port: BACKEND_PORT,
        ready: true,
        serving: true,
        terminating: false,
        node_name: None,
        zone: None,
        zone_hints: vec![],
        node_hints: vec![],
    }
}

/// One full sync through the library in the node namespace: every group's three services.
fn program(sb: &Sandbox, groups: &[Group], backends: &[Ipv4Addr]) {
    let mut services = ServiceMap::new();
    let mut endpoints = EndpointsMap::new();
    for g in groups {
        for (v, ip) in VARIANTS.iter().zip(g.frontends) {
            // VARIANTS[..3] name the three services (the fourth reuses the anchor's).
            let name = ServicePortName {
                service: NamespacedName::new(
                    "bench",
                    format!("{v:?}-{}", g.endpoints).to_lowercase(),
                ),
                port: "p80".into(),
                protocol: Protocol::Tcp,
            };
            let mut sp = ServicePort::cluster_ip(name.clone(), vec![ip.into()], 80);
            if *v != Variant::Anchor {
                sp.session_affinity_timeout = Some(AFFINITY_SECONDS);
            }
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

/// The client's affinity entries for `frontend` (key: saddr . daddr . l4proto . dport, 4-byte registers).
fn entries_for(nft: &mut NftSocket, frontend: Ipv4Addr) -> Vec<Element> {
    nft.read_set(Family::Ip, TABLE, MAP_AFFINITY)
        .unwrap()
        .into_iter()
        .filter(|e| {
            let client = sandbox::pod_ip_v4(0).octets();
            e.key.get(..8) == Some(&[client, frontend.octets()].concat()[..])
        })
        .collect()
}

/// Forgets the client's endpoint for `frontend`. There must be exactly one entry: the previous miss probe
/// recorded it (proof that the record path ran), and deleting it makes the next probe a first connection.
fn forget(nft: &mut NftSocket, frontend: Ipv4Addr) {
    let elements = entries_for(nft, frontend);
    assert_eq!(elements.len(), 1, "one entry for {frontend}: {elements:?}");
    let mut tx = Transaction::default();
    tx.push(
        Family::Ip,
        TABLE,
        Op::DeleteElements {
            set: MAP_AFFINITY.into(),
            elements,
        },
    );
    nft.commit(&tx).unwrap();
}

fn probe(frontend: Ipv4Addr) -> Duration {
    let dst = SocketAddr::new(IpAddr::V4(frontend), 80);
    let start = Instant::now();
    sandbox::tcp_request_here(dst, PROBE_TIMEOUT).expect("probe");
    start.elapsed()
}

/// Opens one connection to every backend address directly, so the node has resolved each neighbour before
/// anything is timed (a first packet to an address waits for ARP).
fn resolve_neighbours(backends: &[Ipv4Addr]) {
    for &a in backends {
        sandbox::tcp_request_here(SocketAddr::new(a.into(), BACKEND_PORT), PROBE_TIMEOUT)
            .expect("backend reachable directly");
    }
}

/// An affinity entry no connection ever looks up (a client address nobody has), deleted and added back in
/// turn before each `AnchorAfterCommit` probe, so that variant pays the same kind of commit a miss does.
struct Decoy {
    element: Element,
    present: bool,
}

impl Decoy {
    /// Copies a real entry (for its layout) under a client address nobody has and a frontend no service has.
    fn new(nft: &mut NftSocket, from: Ipv4Addr) -> Decoy {
        let mut element = entries_for(nft, from).remove(0);
        let mut key = element.key.to_vec();
        key[..8].copy_from_slice(&[10, 244, 0, 250, 10, 96, 255, 250]);
        element.key = key.into();
        Decoy {
            element,
            present: false,
        }
    }

    fn toggle(&mut self, nft: &mut NftSocket) {
        // The same read a miss's `forget` does.
        let _ = entries_for(nft, Ipv4Addr::UNSPECIFIED);
        let elements = vec![self.element.clone()];
        let set = MAP_AFFINITY.into();
        let op = if self.present {
            Op::DeleteElements { set, elements }
        } else {
            Op::AddElements { set, elements }
        };
        let mut tx = Transaction::default();
        tx.push(Family::Ip, TABLE, op);
        nft.commit(&tx).unwrap();
        self.present = !self.present;
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

/// Runs in the client pod. Rounds of one probe per group and variant in a shuffled order; every probe waits
/// the same `SETTLE` after its preparation (the miss's delete, the decoy's commit, nothing for the others).
fn measure(
    groups: &[Group],
    backends: &[Ipv4Addr],
    mut nft: NftSocket,
    probes: usize,
) -> Vec<Samples> {
    resolve_neighbours(backends);
    let mut out: Vec<Samples> = groups
        .iter()
        .map(|g| Samples {
            endpoints: g.endpoints,
            times: Default::default(),
        })
        .collect();
    // The miss frontends need an entry to delete before their first probe.
    for g in groups {
        probe(g.frontends[2]);
    }
    let mut decoy = Decoy::new(&mut nft, groups[0].frontends[2]);
    let mut order: Vec<(usize, Variant)> = (0..groups.len())
        .flat_map(|g| VARIANTS.map(|v| (g, v)))
        .collect();
    let mut shuffle = Shuffle(0x9e37_79b9_7f4a_7c15);
    for round in 0..WARMUP + probes {
        shuffle.apply(&mut order);
        for &(gi, v) in &order {
            let frontend = groups[gi].frontends[v.service()];
            match v {
                Variant::Miss => forget(&mut nft, frontend),
                Variant::AnchorAfterCommit => decoy.toggle(&mut nft),
                Variant::Anchor | Variant::Hit => {}
            }
            std::thread::sleep(SETTLE);
            let t = probe(frontend);
            if round >= WARMUP {
                out[gi].times[v as usize].push(t);
            }
        }
    }
    check_hits_use_the_entry(&mut nft, groups);
    out
}

/// The hit variant must really hit, that is the `lb-aff-<n>` chain must take the entry before choosing. The
/// endpoint reached cannot be told from an answer (the one backend pod answers for all its addresses) and the
/// record never overwrites an existing entry's endpoint, so the check is a trap: point each hit entry at the
/// trap pod, which is no endpoint of any service. Only a connection that used the entry can reach it.
fn check_hits_use_the_entry(nft: &mut NftSocket, groups: &[Group]) {
    let mut tx = Transaction::default();
    for g in groups {
        let mut entry = entries_for(nft, g.frontends[1]);
        assert_eq!(entry.len(), 1, "one hit entry for {}", g.frontends[1]);
        let mut trap = entry.remove(0);
        let Some(ElementValue::Data(value)) = &trap.value else {
            panic!("affinity entry without an endpoint: {trap:?}")
        };
        // Value: endpoint address (4 bytes) . port (network order, in a 4-byte register).
        let mut bytes = value.to_vec();
        bytes[..4].copy_from_slice(&sandbox::pod_ip_v4(TRAP_POD).octets());
        tx.push(
            Family::Ip,
            TABLE,
            Op::DeleteElements {
                set: MAP_AFFINITY.into(),
                elements: vec![trap.clone()],
            },
        );
        trap.value = Some(ElementValue::Data(bytes.into()));
        tx.push(
            Family::Ip,
            TABLE,
            Op::AddElements {
                set: MAP_AFFINITY.into(),
                elements: vec![trap],
            },
        );
    }
    nft.commit(&tx).unwrap();
    for g in groups {
        let dst = SocketAddr::new(IpAddr::V4(g.frontends[1]), 80);
        let answer = sandbox::tcp_request_here(dst, PROBE_TIMEOUT).expect("trap probe");
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
    format!("{:.0}", d.as_secs_f64() * 1e6)
}

fn print_table(results: &[Samples], probes: usize) {
    println!();
    println!(
        "ClientIP affinity, new TCP connection (connect, one answer, close), {probes} probes per cell; µs median / p90"
    );
    println!("| endpoints | no affinity (anchor) | hit | miss | anchor after a commit (control) | hit / anchor | miss / anchor | control / anchor |");
    println!("|---|---|---|---|---|---|---|---|");
    for s in results {
        let med: Vec<Duration> = s.times.iter().map(|t| quantile(t, 0.5)).collect();
        let p90: Vec<Duration> = s.times.iter().map(|t| quantile(t, 0.9)).collect();
        let cell = |i: usize| format!("{} / {}", us(med[i]), us(p90[i]));
        let ratio = |i: usize| format!("{:.2}", med[i].as_secs_f64() / med[0].as_secs_f64());
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            s.endpoints,
            cell(0),
            cell(1),
            cell(2),
            cell(3),
            ratio(1),
            ratio(2),
            ratio(3)
        );
    }
}
