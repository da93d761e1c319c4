//! Conntrack cleanup on the sync path against off it, measured in the same run, in a fresh network namespace
//! (never the host's).
//!
//! A table of N unrelated UDP entries (other clients, other VIPs: what a busy node holds), 1 000 UDP services
//! × 5 endpoints programmed by the library. Each round creates 100 flows to one endpoint of the first service,
//! removes that endpoint (a partial sync) and runs the post-commit cleanup hook, then puts the endpoint back
//! (unmeasured). Timed per round, from the start of the commit to the return of the hook, i.e. until the proxy
//! loop could start its next sync:
//! - anchor: the commit alone, no cleanup;
//! - `Cleaner::after_sync` on the loop's thread (what the agent did): the walk is inside;
//! - `CleanupQueue::after_sync`: the walk runs on the worker thread (waited for after the timing, so rounds
//!   do not overlap), and its own time is read from the cleanup metrics.
//!
//! Every round's 100 stale entries must be deleted in both modes. Usage (root):
//! `cargo bench --bench conntrack -- [ENTRIES] [ROUNDS]` (default 150000 entries, 20 rounds; the kernel's
//! `nf_conntrack_max`, shared by every namespace, bounds ENTRIES: 262144 on the development VM).

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use nftkube::conntrack::wire::IPPROTO_UDP;
use nftkube::conntrack::{
    Cleaner, CleanerOptions, CleanupQueue, CtSocket, DumpFilter, NewEntry, Tuple,
};
use nftkube::model::*;
use nftkube::nft::netlink::NftSocket;
use nftkube::render::{self, RenderConfig};
use nftkube::sync::SyncEngine;
use nftkube_sandbox::netns::{unique_name, NetNs};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

const SERVICES: u32 = 1000;
const ENDPOINTS: u32 = 5;
const STALE_PER_ROUND: u32 = 100;
const PORT: u16 = 5353;

fn main() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "benchmarks need root (network namespaces)");
    let args: Vec<u32> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .map(|a| a.parse().expect("usage: [ENTRIES] [ROUNDS]"))
        .collect();
    let entries = args.first().copied().unwrap_or(150_000);
    let rounds = args.get(1).copied().unwrap_or(20) as usize;
    let ns = NetNs::create(&unique_name("bench-ct")).expect("namespace");
    let results = ns.run(move || run(entries, rounds)).expect("bench thread");
    print(entries, rounds, &results);
}

fn vip(i: u32) -> IpAddr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i).into()
}

fn endpoint(service: u32, e: u32) -> IpAddr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 244, 0, 0)) + service * 8 + e).into()
}

fn state() -> ClusterState {
    let mut st = ClusterState::new();
    for i in 0..SERVICES {
        let name = format!("svc{i}");
        let spn = ServicePortName {
            service: NamespacedName::new("bench", name.as_str()),
            port: "dns".into(),
            protocol: Protocol::Udp,
        };
        let sp = ServicePort::cluster_ip(spn, vec![vip(i)], 53);
        st.apply_service(NamespacedName::new("bench", name.as_str()), vec![sp]);
        st.apply_slice(slice(i, &(0..ENDPOINTS).collect::<Vec<_>>()));
    }
    st
}

fn slice(service: u32, endpoints: &[u32]) -> SliceInfo {
    SliceInfo {
        namespace: "bench".into(),
        name: format!("svc{service}-a").into(),
        service: format!("svc{service}").into(),
        address_type: IpFamily::V4,
        ports: vec![SlicePort {
            name: "dns".into(),
            port: PORT,
            protocol: Protocol::Udp,
        }],
        endpoints: endpoints
            .iter()
            .map(|e| SliceEndpoint::new(endpoint(service, *e), true, true, false))
            .collect(),
    }
}

/// N flows nobody cleans: clients of 10.16.0.0/12 to VIPs no service has.
fn unrelated(n: u32) -> Vec<NewEntry> {
    (0..n)
        .map(|i| {
            let src = IpAddr::V4(Ipv4Addr::from(0x0a10_0000 + i));
            let dst = IpAddr::V4(Ipv4Addr::from(0x0a61_0000 + (i % 4096)));
            NewEntry::plain(
                Tuple::new(src, 1024 + (i % 60000) as u16, dst, 53, IPPROTO_UDP),
                3600,
            )
        })
        .collect()
}

/// Flows of round `r` to service 0, DNATed to its endpoint `e`.
fn stale(r: usize, e: u32) -> Vec<NewEntry> {
    let ep = SocketAddr::new(endpoint(0, e), PORT);
    (0..STALE_PER_ROUND)
        .map(|i| {
            let client = IpAddr::V4(Ipv4Addr::from(0x0af4_0000 + r as u32 * 1000 + i));
            NewEntry {
                orig: Tuple::new(client, 2000, vip(0), 53, IPPROTO_UDP),
                reply: Tuple::new(ep.ip(), ep.port(), client, 2000, IPPROTO_UDP),
                timeout_s: 3600,
                mark: 0,
                zone: 0,
            }
        })
        .collect()
}

/// Commits the services that changed (a partial sync, as the agent's).
fn commit(
    engine: &mut SyncEngine<NftSocket>,
    st: &ClusterState,
    changes: &Changes,
    cfg: &RenderConfig,
) {
    let mut updates = Vec::new();
    for name in &changes.changed_services {
        let endpoints = st.service_endpoints(name);
        for sp in st.service_ports(name) {
            updates.push((
                sp.name.clone(),
                render::service_pieces(sp, endpoints.get(&sp.name), cfg),
            ));
        }
    }
    engine.sync_partial(updates).expect("partial sync");
}

#[derive(Default)]
struct Results {
    anchor: Vec<Duration>,
    inline: Vec<Duration>,
    queued: Vec<Duration>,
    walk_inline: Vec<Duration>,
    walk_queued: Vec<Duration>,
    setup: Duration,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Anchor,
    Inline,
    Queued,
}

fn run(entries: u32, rounds: usize) -> Results {
    let cfg = RenderConfig::default();
    let mut st = state();
    let mut engine = SyncEngine::new(NftSocket::open().expect("nf_tables socket"));
    engine
        .sync_full(
            render::skeleton(&cfg),
            render::all_pieces(st.service_map(), &st.endpoints_map(), &cfg),
        )
        .expect("first sync");
    let mut ct = CtSocket::open().expect("ctnetlink socket");
    let t = Instant::now();
    let (n, errors) = ct.create(&unrelated(entries)).expect("creating entries");
    assert_eq!(
        n as u32,
        entries,
        "{:?} (nf_conntrack_max?)",
        errors.first()
    );
    let mut results = Results {
        setup: t.elapsed(),
        ..Results::default()
    };
    let opts = || CleanerOptions {
        kinds: nftkube::conntrack::FrontendKinds::ALL,
        ..CleanerOptions::default()
    };
    let mut inline = Cleaner::with_options(opts());
    let mut queue = CleanupQueue::start(Cleaner::with_options(opts())).expect("worker thread");
    // Both planners learn the frontends from the first snapshot (not timed).
    let first = st.take_changes();
    inline.after_sync(&first, &st);
    queue.after_sync(&first, &st);
    assert!(queue.wait_idle(Duration::from_secs(60)));

    let all: Vec<u32> = (0..ENDPOINTS).collect();
    for r in 0..rounds {
        for mode in [Mode::Anchor, Mode::Inline, Mode::Queued] {
            let victim = (r as u32) % ENDPOINTS;
            let (made, _) = ct.create(&stale(r, victim)).expect("stale entries");
            assert_eq!(made as u32, STALE_PER_ROUND);
            let rest: Vec<u32> = all.iter().copied().filter(|e| *e != victim).collect();
            st.apply_slice(slice(0, &rest));
            let changes = st.take_changes();
            let deleted_before = queue.metrics().snapshot().entries_deleted
                + inline.metrics().snapshot().entries_deleted;
            let start = Instant::now();
            commit(&mut engine, &st, &changes, &cfg);
            match mode {
                Mode::Anchor => results.anchor.push(start.elapsed()),
                Mode::Inline => {
                    let report = inline.after_sync(&changes, &st).expect("cleanup");
                    results.inline.push(start.elapsed());
                    results.walk_inline.push(report.elapsed);
                }
                Mode::Queued => {
                    queue.after_sync(&changes, &st);
                    results.queued.push(start.elapsed());
                    assert!(queue.wait_idle(Duration::from_secs(60)), "walk never ended");
                    let us = queue.metrics().snapshot().duration_us_last;
                    results.walk_queued.push(Duration::from_micros(us));
                }
            }
            // Each planner must see every change; the anchor's round is cleaned untimed.
            if mode == Mode::Anchor {
                inline.after_sync(&changes, &st);
                queue.after_sync(&changes, &st);
                assert!(queue.wait_idle(Duration::from_secs(60)));
            } else if mode == Mode::Inline {
                queue.after_sync(&changes, &st);
                assert!(queue.wait_idle(Duration::from_secs(60)));
            } else {
                inline.after_sync(&changes, &st);
            }
            let deleted = queue.metrics().snapshot().entries_deleted
                + inline.metrics().snapshot().entries_deleted
                - deleted_before;
            assert_eq!(
                deleted, STALE_PER_ROUND as u64,
                "round {r}: stale entries left"
            );
            // The endpoint comes back, untimed.
            st.apply_slice(slice(0, &all));
            let back = st.take_changes();
            commit(&mut engine, &st, &back, &cfg);
            inline.after_sync(&back, &st);
            queue.after_sync(&back, &st);
            assert!(queue.wait_idle(Duration::from_secs(60)));
        }
    }
    queue.stop();
    let left = ct
        .dump(
            &DumpFilter::family(nftkube::conntrack::wire::AF_INET),
            |_| {},
        )
        .expect("dump");
    assert_eq!(left as u32, entries, "only the stale entries went");
    results
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn quantile(v: &[Duration], q: f64) -> Duration {
    let mut s = v.to_vec();
    s.sort();
    s[((s.len() - 1) as f64 * q).round() as usize]
}

fn print(entries: u32, rounds: usize, r: &Results) {
    println!(
        "conntrack cleanup after a UDP endpoint removal: {entries} unrelated entries (created in {:.0} ms), \
         {SERVICES} UDP services × {ENDPOINTS}, {STALE_PER_ROUND} stale entries per round, {rounds} rounds",
        ms(r.setup)
    );
    println!("| commit → proxy loop free again | p50 ms | p90 ms | p50 / anchor |");
    println!("|---|---|---|---|");
    let anchor = quantile(&r.anchor, 0.5);
    for (name, v) in [
        ("anchor: the commit alone", &r.anchor),
        ("cleanup on the loop (Cleaner::after_sync)", &r.inline),
        ("cleanup queued (CleanupQueue::after_sync)", &r.queued),
    ] {
        let p50 = quantile(v, 0.5);
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            ms(p50),
            ms(quantile(v, 0.9)),
            ms(p50) / ms(anchor)
        );
    }
    println!(
        "walk's own time, p50: {:.1} ms on the loop, {:.1} ms on the worker",
        ms(quantile(&r.walk_inline, 0.5)),
        ms(quantile(&r.walk_queued, 0.5))
    );
}
