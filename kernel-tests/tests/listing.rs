//! The listing invariant itself (kernel_tests::listing): it passes on a ruleset of the shapes nftkube relies on,
//! and it catches each kind of failure — a reload that fails (the known faults, unless tolerated), a warning on
//! stderr, an nft that aborts — naming the nft version. Without this, a check that never fails would look
//! like a ruleset that is always fine.

use kernel_tests::listing::{listing_problems, nfts, Faults};
use kernel_tests::{command_in, require_root};
use nftkube::netns::{unique_name, NetNs};
use nftkube::nft::build::{Field, RuleBuilder};
use nftkube::nft::ir::*;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};

/// Shapes nftkube programs, loadable by the distribution's nft: a numgen slot map with typeof, a dispatch
/// verdict map, a nat chain on the output hook at priority -100 (nft 1.1.x lists it as `dstnat`, which 1.1.x
/// reloads and 1.0.6 would refuse), ip6.
const BASE: &str = r#"
table ip listing {
	map endpoints {
		typeof ip daddr . th dport . numgen random mod 2 : ip daddr . th dport
		elements = { 10.96.0.10 . 80 . 0 : 10.244.1.2 . 8080, 10.96.0.10 . 80 . 1 : 10.244.2.2 . 8080 }
	}
	map dispatch {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 10.96.0.10 . tcp . 80 : goto lb-2 }
	}
	chain lb-2 {
		meta l4proto { tcp, udp } dnat ip to ip daddr . th dport . numgen random mod 2 map @endpoints
	}
	chain services {
		ip daddr . meta l4proto . th dport vmap @dispatch
	}
	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		jump services
	}
	chain output {
		type nat hook output priority -100; policy accept;
		jump services
	}
}
table ip6 listing {
	set cluster-ips {
		type ipv6_addr
		elements = { fd00:96::10 }
	}
	chain filter-output {
		type filter hook output priority -10; policy accept;
		ip6 daddr @cluster-ips counter packets 0 bytes 0 reject with icmpv6 port-unreachable
	}
}
"#;

/// An affinity map keyed by `ct original proto-dst` (only nft 1.1.x parses that typeof), with an element that
/// expires (the invariant must not trip over the time left) and the rule that reads it.
const NEWEST_ONLY: &str = r#"
table ip listing {
	map affinity {
		typeof ip saddr . ct original ip daddr . meta l4proto . ct original proto-dst : ip daddr . th dport
		size 65535
		flags dynamic,timeout
		timeout 3h
		elements = { 10.244.0.2 . 10.96.0.10 . tcp . 80 timeout 3h : 10.244.1.2 . 8080 }
	}
	chain affinity-hit {
		meta l4proto { tcp, udp } dnat ip to ip saddr . ip daddr . meta l4proto . th dport map @affinity
	}
}
"#;

/// A map statement (`update @m { key : data }`): nft 1.0.6's JSON printer has no callback for it.
const MAP_UPDATE: &str = r#"
table ip listing {
	map seen {
		type ipv4_addr : ipv4_addr
		flags dynamic,timeout
		timeout 1h
	}
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		update @seen { ip saddr : ip daddr }
	}
}
"#;

fn scratch() -> NetNs {
    require_root();
    NetNs::create(&unique_name("nk-listing")).expect("creating a namespace")
}

/// `nft -f -` of `ruleset` in `ns` with the `i`-th nft (0: the distribution's, last: the newest).
fn load(ns: &NetNs, i: usize, ruleset: &str) {
    use std::io::Write;
    let nft = &nfts()[i];
    let mut child = command_in(ns, &nft.program)
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("running nft");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(ruleset.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "{nft:?} -f:\n{ruleset}");
}

fn newest() -> usize {
    assert_eq!(nfts().len(), 2, "this test compares two nfts: {:?}", nfts());
    1
}

/// The problems reported for the nft of `version` (major, minor).
fn problems_of(problems: &[String], major_minor: (u32, u32)) -> Vec<&String> {
    let (a, b) = major_minor;
    problems
        .iter()
        .filter(|p| p.starts_with(&format!("nft {a}.{b}.")))
        .collect()
}

#[test]
fn shapes_nftkube_relies_on_list_and_reload_under_every_nft() {
    let ns = scratch();
    load(&ns, 0, BASE);
    load(&ns, newest(), NEWEST_ONLY);
    let problems = listing_problems(&ns, Faults::Tolerated);
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

#[test]
fn the_known_fault_is_real_and_reported_when_not_tolerated() {
    let ns = scratch();
    load(&ns, 0, BASE);
    load(&ns, newest(), NEWEST_ONLY);
    let problems = listing_problems(&ns, Faults::Strict);
    let all = problems.join("\n\n");
    let distribution = problems_of(&problems, (1, 0));
    assert!(
        distribution.len() == 1
            && distribution[0].contains("`nft -f <its own listing>` exited 1")
            && distribution[0].contains("Error: datatype mismatch, map expects concatenation of (IPv4 address, IPv4 address, Internet protocol), mapping expression has type concatenation of (IPv4 address, IPv4 address, Internet protocol, internet network service)"),
        "{all}"
    );
    // nft 1.1.x needs no exception: it reloads its own `priority dstnat` on the output hook.
    assert!(problems_of(&problems, (1, 1)).is_empty(), "{all}");
}

#[test]
fn a_warning_fails_the_check_though_nft_exits_0() {
    let ns = scratch();
    load(&ns, 0, MAP_UPDATE);
    let problems = listing_problems(&ns, Faults::Tolerated);
    let all = problems.join("\n\n");
    let distribution = problems_of(&problems, (1, 0));
    assert!(
        distribution.len() == 1
            && distribution[0].contains("`nft -j list ruleset` exited 0 but wrote to stderr")
            && distribution[0].contains("warning: stmt ops map have no json callback"),
        "{all}"
    );
    assert!(problems_of(&problems, (1, 1)).is_empty(), "{all}");
}

/// A dynset whose data comes from a map lookup's register (register chaining): the kernel accepts it, nft
/// cannot print it. Committed through nftkube's own netlink codec, since nft cannot write it.
fn register_chaining() -> Transaction {
    let (f, t) = (Family::Ip, "listing");
    let map = |name: &str, dynamic: bool| Set {
        timeout_ms: dynamic.then_some(60_000),
        dynamic,
        size: dynamic.then_some(1024),
        ..Set::new(name, vec![DataType::Ipv4Addr], vec![DataType::Ipv4Addr])
    };
    let rule = RuleBuilder::new()
        .expr(Field::IpSaddr.load(REG_1))
        .expr(Expr::Lookup {
            set: "chosen".into(),
            sreg: REG_1,
            dreg: Some(REG_2),
            invert: false,
        })
        .expr(Expr::Dynset {
            set: "affinity".into(),
            op: DynsetOp::Update,
            sreg_key: REG_1,
            sreg_data: Some(REG_2),
            timeout_ms: None,
        })
        .build();
    let mut tx = Transaction::default();
    tx.push(f, t, Op::AddTable);
    tx.push(f, t, Op::AddSet(map("chosen", false)));
    tx.push(f, t, Op::AddSet(map("affinity", true)));
    tx.push(f, t, Op::AddChain(Chain::regular("c")));
    tx.push(
        f,
        t,
        Op::AddRule {
            chain: "c".into(),
            rule,
        },
    );
    tx
}

#[test]
fn an_nft_that_aborts_fails_the_check_under_every_version() {
    let ns = scratch();
    ns.run(|| NftSocket::open().unwrap().commit(&register_chaining()))
        .unwrap()
        .expect("the kernel accepts register chaining");
    let problems = listing_problems(&ns, Faults::Tolerated);
    let all = problems.join("\n\n");
    for version in [(1, 0), (1, 1)] {
        let p = problems_of(&problems, version);
        // SIGABRT (6): an assertion in nft's netlink_parse_concat_expr / netlink_delinearize.
        assert!(
            p.iter()
                .any(|p| p.contains("`nft list ruleset` was killed by signal 6")),
            "{version:?}: {all}"
        );
        assert!(
            p.iter()
                .any(|p| p.contains("`nft -j list ruleset` was killed by signal 6")),
            "{version:?}: {all}"
        );
    }
}
