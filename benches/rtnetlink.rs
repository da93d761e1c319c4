//! rtnetlink: what decoding and encoding the messages costs on top of the kernel's own work, as ratios against
//! the same requests sent as raw bytes (the anchor), in the same run, interleaved.
//!
//! In a fresh namespace with a veth whose end carries `ADDRESSES` addresses (IPv4 and IPv6) and a multipath
//! default route:
//! - `node::read` (an address dump and a route dump, decoded: what a full sync of the agent does) against
//!   the same two dumps sent from hand-built bytes and not decoded;
//! - `netns::link_index` (a GETLINK by name, its answer decoded: what every `add_address` / `add_route` of
//!   the test topologies does first) against the same GETLINK from hand-built bytes.
//!
//! Only public API, so the same file measures an older build too. Run as root:
//! `cargo bench --bench rtnetlink` (`NFTKUBE_BENCH_RTNL_ROUNDS`, default 2000).

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use nftkube::netlink::{MsgBuilder, NlSocket, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use nftkube_sandbox::netns::{self, unique_name, NetNs};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

const ADDRESSES: u32 = 100;
const WARMUP: usize = 100;

/// The anchor for `node::read`: the same two dumps, sent from hand-built bytes, answers not decoded.
fn raw_dumps(sock: &mut NlSocket) -> usize {
    let mut answers = 0;
    // RTM_GETADDR with a `struct ifaddrmsg`, RTM_GETROUTE with a `struct rtmsg`, family AF_UNSPEC.
    for (kind, header_len) in [(22u16, 8usize), (26, 12)] {
        let seq = sock.reserve_seq(1);
        let mut m = MsgBuilder::new(kind, NLM_F_REQUEST | NLM_F_DUMP, seq);
        m.raw(&vec![0u8; header_len]);
        answers += sock.dump(&m.finish().unwrap()).unwrap().len();
    }
    answers
}

/// The anchor for `link_index`: RTM_GETLINK by IFLA_IFNAME from hand-built bytes.
fn raw_getlink(sock: &mut NlSocket, name: &str) -> usize {
    let seq = sock.reserve_seq(1);
    let mut m = MsgBuilder::new(18, NLM_F_REQUEST | NLM_F_ACK, seq);
    m.raw(&[0u8; 16]);
    m.attr_str(3, name);
    sock.dump(&m.finish().unwrap()).unwrap().len()
}

fn setup(ns: &NetNs, peer: &NetNs) {
    ns.run(|| {
        netns::create_veth("up0", "peer0", peer).unwrap();
        netns::create_veth("up1", "peer1", peer).unwrap();
        for (i, link) in ["lo", "up0", "up1"].iter().enumerate() {
            netns::set_link_up(link).unwrap();
            if i > 0 {
                let gw = Ipv4Addr::new(192, 168, 200 + i as u8, 1);
                netns::add_address(link, gw.into(), 24).unwrap();
            }
        }
        for i in 0..ADDRESSES {
            let v4 = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 50, 0, 0)) + i);
            let v6 =
                Ipv6Addr::from(u128::from("fd00:50::".parse::<Ipv6Addr>().unwrap()) + i as u128);
            netns::add_address("up0", IpAddr::V4(v4), 32).unwrap();
            netns::add_address("up0", IpAddr::V6(v6), 128).unwrap();
        }
        let hops = [
            (IpAddr::from(Ipv4Addr::new(192, 168, 201, 2)), "up0"),
            (IpAddr::from(Ipv4Addr::new(192, 168, 202, 2)), "up1"),
        ];
        netns::replace_route_multipath(Ipv4Addr::UNSPECIFIED.into(), 0, &hops).unwrap();
    })
    .unwrap();
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn p90(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() * 9 / 10]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "benchmarks need root (network namespaces)");
    let rounds: usize = std::env::var("NFTKUBE_BENCH_RTNL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let ns = NetNs::create(&unique_name("nkbench-rtnl")).unwrap();
    let peer = NetNs::create(&unique_name("nkbench-rtnl-peer")).unwrap();
    setup(&ns, &peer);
    let [mut read, mut read_anchor, mut index, mut index_anchor]: [Vec<Duration>; 4] =
        Default::default();
    ns.run(|| {
        let mut sock = NlSocket::open(libc::NETLINK_ROUTE).unwrap();
        let view = nftkube::node::read().unwrap();
        assert_eq!(view.primary_links.len(), 2, "both next hops' links");
        assert!(view.addresses.len() >= 2 * ADDRESSES as usize);
        for round in 0..WARMUP + rounds {
            let keep = round >= WARMUP;
            let t = Instant::now();
            std::hint::black_box(raw_dumps(&mut sock));
            let a = t.elapsed();
            let t = Instant::now();
            std::hint::black_box(nftkube::node::read().unwrap());
            let r = t.elapsed();
            let t = Instant::now();
            std::hint::black_box(raw_getlink(&mut sock, "up1"));
            let ia = t.elapsed();
            let t = Instant::now();
            std::hint::black_box(netns::link_index("up1").unwrap());
            let i = t.elapsed();
            if keep {
                read_anchor.push(a);
                read.push(r);
                index_anchor.push(ia);
                index.push(i);
            }
        }
    })
    .unwrap();
    println!(
        "rtnetlink, {rounds} rounds, {} addresses (µs, median / p90; ratio of medians)",
        2 * ADDRESSES + 2
    );
    println!("| request | raw bytes (anchor) | nftkube | nftkube / anchor |");
    println!("|---|---|---|---|");
    for (what, anchor, v) in [
        (
            "node::read (address + route dumps)",
            &mut read_anchor,
            &mut read,
        ),
        (
            "netns::link_index (GETLINK by name)",
            &mut index_anchor,
            &mut index,
        ),
    ] {
        let (am, vm) = (median(anchor), median(v));
        println!(
            "| {what} | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} |",
            us(am),
            us(p90(anchor)),
            us(vm),
            us(p90(v)),
            vm.as_secs_f64() / am.as_secs_f64()
        );
    }
}
