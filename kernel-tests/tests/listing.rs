//! The listing invariant itself (kernel_tests::listing): it passes on a ruleset of the shapes nftkube relies on,
//! and it catches each kind of failure — a reload that fails (the known faults, unless tolerated), a warning on
//! stderr, an nft that aborts — naming the nft version. Without this, a check that never fails would look
//! like a ruleset that is always fine.

use kernel_tests::listing::{listing_problems, nfts, Faults};
use kernel_tests::require_root;
use nftkube::nft::build::{Field, RuleBuilder};
use nftkube::nft::ir::*;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube_sandbox::netns::{unique_name, NetNs};

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

/// nftkube's ClientIP affinity shapes in both families: the record after DNAT (a map update; for IPv6 its
/// 20-byte value is more than nft 1.0.6 can load) and the hit. The sets are written by the distribution's nft
/// (`SETS`: nft 1.0.6 cannot list sets that 1.1.x wrote), the ip6 record rule by the newest (`IP6_RECORD`).
const AFFINITY_SETS: &str = r#"
table ip listing {
	map affinity {
		type ipv4_addr . ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service
		size 262144
		flags dynamic,timeout
		timeout 1d
	}
	chain affinity-600 {
		meta l4proto { tcp, udp, sctp } update @affinity { ip saddr . ct original ip daddr . meta l4proto . ct original proto-dst timeout 10m : ip daddr . th dport }
	}
	chain affinity-hit {
		dnat ip to ip saddr . ip daddr . meta l4proto . th dport map @affinity
	}
}
table ip6 listing {
	map affinity {
		type ipv6_addr . ipv6_addr . inet_proto . inet_service : ipv6_addr . inet_service
		size 262144
		flags dynamic,timeout
		timeout 1d
	}
	chain affinity-600 {
	}
}
"#;

const IP6_RECORD: &str = "add rule ip6 listing affinity-600 meta l4proto { tcp, udp, sctp } update @affinity { ip6 saddr . ct original ip6 daddr . meta l4proto . ct original proto-dst timeout 10m : ip6 daddr . th dport }\n";

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
    let mut child = ns
        .command(&nft.program)
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
    load(&ns, 0, AFFINITY_SETS);
    load(&ns, newest(), IP6_RECORD);
    let problems = listing_problems(&ns, Faults::Tolerated);
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

#[test]
fn the_known_fault_is_real_and_reported_when_not_tolerated() {
    let ns = scratch();
    load(&ns, 0, BASE);
    load(&ns, 0, AFFINITY_SETS);
    load(&ns, newest(), IP6_RECORD);
    let problems = listing_problems(&ns, Faults::Strict);
    let all = problems.join("\n\n");
    let distribution = problems_of(&problems, (1, 0));
    assert!(
        distribution.len() == 2
            && distribution.iter().any(|p| p
                .contains("`nft -j list ruleset` exited 0 but wrote to stderr")
                && p.contains("warning: stmt ops map have no json callback"))
            && distribution.iter().any(|p| p
                .contains("`nft -f <its own listing>` was killed by signal 6")
                && p.contains("Assertion `dreg < ctx->reg_low' failed")),
        "{all}"
    );
    // nft 1.1.x needs no exception: it reloads its own `priority dstnat` on the output hook.
    assert!(problems_of(&problems, (1, 1)).is_empty(), "{all}");
}

#[test]
fn a_warning_fails_the_check_though_nft_exits_0() {
    let ns = scratch();
    load(&ns, 0, MAP_UPDATE);
    // Tolerated, this one warning is the known fault; strict, it is what any warning does.
    assert!(listing_problems(&ns, Faults::Tolerated).is_empty());
    let problems = listing_problems(&ns, Faults::Strict);
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
