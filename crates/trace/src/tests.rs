//! The evaluator on hand-built tables (chain semantics, NAT bindings) and on rendered ones (affinity).

use super::*;
use nftkube_model::{Endpoint, NamespacedName, Protocol, ServicePort, ServicePortName};
use nftkube_nft::build::{concat_key, Field, RuleBuilder};
use nftkube_nft::ir::*;
use nftkube_render::{self as render, names::MAP_AFFINITY, RenderConfig};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

fn packet(src: &str, dst: &str) -> Packet {
    Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        proto: Proto::Tcp,
        mark: 0,
        iif: None,
    }
}

fn node(ips: &[&str]) -> NodeContext {
    NodeContext {
        local_addresses: ips.iter().map(|i| i.parse().unwrap()).collect(),
        source: "test".into(),
    }
}

fn run(tables: Vec<TableState>, pkt: Packet, origin: Origin, node: &NodeContext) -> Trace {
    let ruleset = Ruleset {
        tables,
        description: "test".into(),
        notes: vec![],
    };
    trace(
        &ruleset,
        &Request {
            packet: pkt,
            origin,
        },
        node,
        &KeysOnly,
    )
    .unwrap()
}

fn proto_is(p: u8) -> RuleBuilder {
    RuleBuilder::new().cmp(Field::L4Proto, CmpOp::Eq, vec![p])
}

#[test]
fn jump_returns_goto_does_not_and_the_base_policy_decides_at_the_end() {
    let mut t = TableState::new(Family::Ip, "t");
    let mut base = Chain::base("in", ChainType::Filter, Hook::Input, 0);
    base.base.as_mut().unwrap().policy = Policy::Drop;
    t.add_chain(base).rules = vec![
        RuleBuilder::new()
            .verdict(Verdict::Jump("a".into()))
            .build(),
        RuleBuilder::new()
            .verdict(Verdict::Goto("b".into()))
            .build(),
        RuleBuilder::new().verdict(Verdict::Accept).build(),
    ];
    // a: only UDP is accepted; TCP falls off the end and returns to `in`.
    t.add_chain(Chain::regular("a")).rules = vec![proto_is(17).verdict(Verdict::Accept).build()];
    // b: matches TCP without a verdict; its end, reached by goto from the base chain, is the policy.
    t.add_chain(Chain::regular("b")).rules = vec![proto_is(6).build()];
    let out = run(
        vec![t],
        packet("192.0.2.9:1000", "192.0.2.1:80"),
        Origin::Outside,
        &node(&["192.0.2.1"]),
    );
    assert_eq!(out.outcomes.len(), 1);
    let o = &out.outcomes[0];
    assert_eq!(o.verdict, "drop", "{o:#?}");
    assert!(o.detail.contains("ip t chain in"), "{}", o.detail);
    let walked: Vec<(String, Option<usize>, bool)> = o
        .path
        .iter()
        .filter(|s| !s.table.is_empty())
        .map(|s| (s.chain.clone(), s.rule, s.matched))
        .collect();
    let want = [
        ("in", Some(0), true),
        ("a", Some(0), false),
        ("in", Some(1), true),
        ("b", Some(0), true),
        ("in", None, true),
    ];
    let want: Vec<(String, Option<usize>, bool)> = want
        .iter()
        .map(|(c, r, m)| (c.to_string(), *r, *m))
        .collect();
    assert_eq!(walked, want);
    // The failed match says what it compared.
    assert!(
        o.path
            .iter()
            .any(|s| s.result.contains("meta l4proto is tcp, not == udp")),
        "{o:#?}"
    );
}

fn dnat_table(name: &str, priority: i32, to: &str) -> TableState {
    let to: SocketAddr = to.parse().unwrap();
    let mut t = TableState::new(Family::Ip, name);
    t.add_chain(Chain::base(
        "pre",
        ChainType::Nat,
        Hook::Prerouting,
        priority,
    ))
    .rules = vec![RuleBuilder::new().dnat(&to.ip(), to.port()).build()];
    t
}

#[test]
fn the_first_dnat_binds_and_later_nat_chains_of_that_hook_are_not_run() {
    let tables = vec![
        dnat_table("late", -90, "10.0.0.2:81"),
        dnat_table("early", -100, "10.0.0.1:80"),
    ];
    let out = run(
        tables,
        packet("192.0.2.9:1000", "192.0.2.1:80"),
        Origin::Outside,
        &node(&["192.0.2.1"]),
    );
    let o = &out.outcomes[0];
    assert_eq!(o.dnat, Some("10.0.0.1:80".parse().unwrap()));
    assert!(o.detail.contains("sent on to 10.0.0.1:80"), "{}", o.detail);
    let late = o
        .path
        .iter()
        .find(|s| s.table == "ip late")
        .expect("the late table is met");
    assert!(
        !late.matched && late.result.contains("not run"),
        "{late:#?}"
    );
}

fn affinity_service() -> (nftkube_model::ServiceMap, nftkube_model::EndpointsMap) {
    let name = ServicePortName {
        service: NamespacedName::new("demo", "sticky"),
        port: "http".into(),
        protocol: Protocol::Tcp,
    };
    let mut sp = ServicePort::cluster_ip(name.clone(), vec!["10.96.5.5".parse().unwrap()], 80);
    sp.session_affinity_timeout = Some(600);
    let eps = ["10.244.1.2", "10.244.2.2"]
        .iter()
        .map(|ip| Endpoint::ready(ip.parse().unwrap(), 8080))
        .collect();
    (
        BTreeMap::from([(name.clone(), sp)]),
        BTreeMap::from([(name, eps)]),
    )
}

#[test]
fn affinity_is_recorded_on_a_choice_and_followed_when_present() {
    let (services, endpoints) = affinity_service();
    let cfg = RenderConfig {
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..RenderConfig::default()
    };
    let mut tables = render::render(&services, &endpoints, &cfg);
    let attribution = FromModel::new(&services);
    let pkt = packet("10.244.0.2:40000", "10.96.5.5:80");
    let req = Request {
        packet: pkt,
        origin: Origin::Pod,
    };
    let n = node(&["192.0.2.1"]);
    let ruleset = |tables: Vec<TableState>| Ruleset {
        tables,
        description: "test".into(),
        notes: vec![],
    };
    // No entry yet: a uniform choice, and the choice recorded with the service's timeout.
    let out = trace(&ruleset(tables.clone()), &req, &n, &attribution).unwrap();
    assert_eq!(out.outcomes.len(), 2, "{out:#?}");
    for o in &out.outcomes {
        assert!((o.probability - 0.5).abs() < 1e-9);
        let rec = o
            .affinity
            .iter()
            .find(|a| a.starts_with("recorded"))
            .expect("recorded");
        assert!(
            rec.contains("timeout 600s") && rec.contains(&o.dnat.unwrap().ip().to_string()),
            "{rec}"
        );
        let attributed = o.path.iter().flat_map(|s| &s.notes).any(|n| {
            n.contains("service demo/sticky:http (ClusterIP 10.96.5.5, ClientIP affinity 600s)")
        });
        assert!(attributed, "{o:#?}");
    }
    // The kernel's affinity map holds this client's endpoint: followed, with certainty.
    let ip = |s: &str| nftkube_nft::build::ip_bytes(&s.parse::<IpAddr>().unwrap());
    let key = concat_key(&[
        ip("10.244.0.2"),
        ip("10.96.5.5"),
        vec![6],
        80u16.to_be_bytes().to_vec(),
    ]);
    let value = concat_key(&[ip("10.244.2.2"), 8080u16.to_be_bytes().to_vec()]);
    let v4 = tables.iter_mut().find(|t| t.family == Family::Ip).unwrap();
    v4.set_mut(MAP_AFFINITY).elements.insert(Element {
        key: key.into(),
        value: Some(ElementValue::Data(value.into())),
    });
    let out = trace(&ruleset(tables), &req, &n, &attribution).unwrap();
    assert_eq!(out.outcomes.len(), 1, "{out:#?}");
    let o = &out.outcomes[0];
    assert_eq!(o.dnat, Some("10.244.2.2:8080".parse().unwrap()));
    assert!((o.probability - 1.0).abs() < 1e-9);
    assert!(
        o.affinity
            .iter()
            .any(|a| a.starts_with("hit") && a.contains("10.244.2.2 . 8080")),
        "{:?}",
        o.affinity
    );
}

/// A ClusterIP service with `n` endpoints 10.244.i.2:8080, rendered.
fn rendered_with_endpoints(n: usize) -> Vec<TableState> {
    let name = ServicePortName {
        service: NamespacedName::new("demo", "many"),
        port: "http".into(),
        protocol: Protocol::Tcp,
    };
    let sp = ServicePort::cluster_ip(name.clone(), vec!["10.96.7.7".parse().unwrap()], 80);
    let eps = (1..=n)
        .map(|i| {
            Endpoint::ready(
                format!("10.244.{}.{}", i / 250, i % 250 + 2)
                    .parse()
                    .unwrap(),
                8080,
            )
        })
        .collect();
    let cfg = RenderConfig {
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        ..RenderConfig::default()
    };
    render::render(
        &BTreeMap::from([(name.clone(), sp)]),
        &BTreeMap::from([(name, eps)]),
        &cfg,
    )
}

#[test]
fn only_random_choices_that_matter_branch_and_each_endpoint_gets_its_share() {
    // Whatever rules with other numgen ranges the packet passes on the way, only choices that can lead
    // elsewhere branch, and each endpoint ends up with probability 1/n in all.
    for n in [1, 2, 3, 7, 32, 40] {
        let out = run(
            rendered_with_endpoints(n),
            packet("10.244.0.2:40000", "10.96.7.7:80"),
            Origin::Pod,
            &node(&["192.0.2.1"]),
        );
        assert_eq!(out.outcomes.len(), n, "{n} endpoints");
        for o in &out.outcomes {
            assert!(
                (o.probability - 1.0 / n as f64).abs() < 1e-12,
                "{n}: {}",
                o.probability
            );
            assert!(o.dnat.is_some() && o.verdict == "accept");
            // The ways to this endpoint: a draw that lands on it, or draws that miss (a branch each) and then
            // one that does, or the search's rule of count n after two rounds of misses. A draw that can
            // only miss (a modulus for other counts), or only hit (n fills it: 2, 32; a count of its own:
            // 40), makes no branch of its own.
            let choices: Vec<usize> = o.choices.iter().map(Vec::len).collect();
            let most = match n {
                1 => 0,
                2 | 32 | 40 => 1,
                _ => 3,
            };
            assert!(
                choices.iter().all(|&c| c <= most && (c > 0) == (n > 1)),
                "{n}: {choices:?}"
            );
        }
        let targets: std::collections::BTreeSet<_> = out.outcomes.iter().map(|o| o.dnat).collect();
        assert_eq!(targets.len(), n);
    }
}

#[test]
fn an_outcome_shows_its_most_likely_path() {
    // Three endpoints: a draw of eight finds each in 2 of 8 values; the search after two rounds of misses
    // is far less likely, so each outcome's path is the draw's.
    let out = run(
        rendered_with_endpoints(3),
        packet("10.244.0.2:40000", "10.96.7.7:80"),
        Origin::Pod,
        &node(&["192.0.2.1"]),
    );
    for o in &out.outcomes {
        let chosen = o.path.iter().find(|s| s.matched && s.text.contains("dnat"));
        let chosen = chosen.expect("a dnat rule matched");
        assert_eq!(chosen.chain, "pick", "{:?}", chosen.text);
        assert!(
            chosen.text.contains("numgen random mod 8 "),
            "{}",
            chosen.text
        );
    }
}
