//! ServiceCIDRs from the API: the real agent, with no `--service-cidr`, drops traffic to addresses of the
//! cluster's ServiceCIDRs that no Service holds, and follows the objects as they change and go; and what such
//! a change costs the kernel at a few thousand services.

use kernel_tests::fake_api::{objects_from_yaml, FakeApi, Resource};
use kernel_tests::sandbox::tcp_request;
use kernel_tests::*;
use nftkube::model::{
    Endpoint, EndpointsMap, NamespacedName, Protocol, ServiceMap, ServicePort, ServicePortName,
};
use nftkube::nft::ir::Family;
use nftkube::nft::netlink::NftSocket;
use nftkube::render::{self, RenderConfig};
use nftkube::sync::SyncEngine;
use nftkube_sandbox::netns::{unique_name, NetNs};
use serde_json::{json, Value};
use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SYNC: Duration = Duration::from_secs(20);
/// The ServiceCIDR watcher failed from the start: its backoff may have grown to 30 s (with jitter).
const RECOVER: Duration = Duration::from_secs(45);
const SHORT: Duration = Duration::from_millis(600);

fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
           "metadata": {"name": name}, "spec": {"cidrs": cidrs}})
}

/// Dropped: no answer at all (a reject would refuse the connection at once).
fn dropped(ns: &NetNs, dst: SocketAddr) -> bool {
    matches!(
        tcp_request(ns, dst, SHORT),
        Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock)
    )
}

#[test]
fn service_cidrs_from_the_api_drop_unallocated_addresses_and_follow_the_objects() {
    let sb = sandbox("nk-kcidr", 3);
    // Beyond the node (on ext) something answers on two addresses of the service range: a packet the node
    // forwards gets an answer.
    let first = SocketAddr::new(Ipv4Addr::new(10, 96, 0, 99).into(), 80);
    let second = SocketAddr::new(Ipv4Addr::new(10, 97, 0, 99).into(), 80);
    let stop = Arc::new(AtomicBool::new(false));
    for a in [first, second] {
        sb.ext()
            .run(move || nftkube_sandbox::netns::add_address("lo", a.ip(), 32))
            .unwrap()
            .unwrap();
        hello_listener(sb.ext(), a, stop.clone());
    }
    let api = FakeApi::in_namespace(sb.node());
    for file in ["services.yaml", "endpointslices.yaml"] {
        let text = std::fs::read_to_string(examples_dir().join(file)).unwrap();
        for obj in objects_from_yaml(&text).into_iter() {
            if Resource::of(&obj).is_some() {
                api.apply(obj);
            }
        }
    }
    // The resource is forbidden at first (an older ClusterRole): the agent syncs all the same.
    api.fail(Resource::ServiceCidrs, Some(403));
    let mut cmd = sb.node().command(nftkube_bin());
    cmd.args(proxy_args_from(&["--master".into(), api.url().into()], &[]));
    let agent = Agent::spawn(cmd, sb.node());
    let echo = addr("10.96.0.10", 80);
    wait_until(SYNC, || tcp_request(sb.client(), echo, SHORT).is_ok())
        .unwrap_or_else(|_| panic!("no sync without ServiceCIDRs; log:\n{}", agent.log()));
    assert!(tcp_request(sb.client(), first, Duration::from_secs(2)).is_ok());

    // Allowed again, and one object: its unallocated addresses are dropped, and only the checks changed.
    api.apply(service_cidr("kubernetes", &["10.96.0.0/24"]));
    api.fail(Resource::ServiceCidrs, None);
    wait_until(RECOVER, || dropped(sb.client(), first))
        .unwrap_or_else(|_| panic!("10.96.0.99 not dropped; log:\n{}", agent.log()));
    assert!(tcp_request(sb.client(), second, Duration::from_secs(2)).is_ok());
    // The allocated ClusterIP still serves; its other ports are still rejected, not dropped.
    assert!(tcp_request(sb.client(), echo, Duration::from_secs(2)).is_ok());
    let e = tcp_request(
        sb.client(),
        addr("10.96.0.10", 9999),
        Duration::from_secs(2),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
    if oracles() {
        let problems = listing::listing_problems(sb.node(), listing::Faults::Tolerated);
        assert!(problems.is_empty(), "{}", problems.join("\n\n"));
    }

    // The object changes: the drop follows.
    api.apply(service_cidr("kubernetes", &["10.97.0.0/24"]));
    wait_until(SYNC, || dropped(sb.client(), second))
        .unwrap_or_else(|_| panic!("10.97.0.99 not dropped; log:\n{}", agent.log()));
    assert!(tcp_request(sb.client(), first, Duration::from_secs(2)).is_ok());

    // The object goes: nothing is dropped any more.
    api.delete(Resource::ServiceCidrs, "", "kubernetes");
    wait_until(SYNC, || tcp_request(sb.client(), second, SHORT).is_ok())
        .unwrap_or_else(|_| panic!("10.97.0.99 still dropped; log:\n{}", agent.log()));
    assert!(tcp_request(sb.client(), echo, Duration::from_secs(2)).is_ok());
    stop.store(true, Ordering::SeqCst);

    let log = agent.log();
    // Said once while it lasted, not at every retry.
    assert_eq!(
        log.matches("ServiceCIDRs cannot be listed").count(),
        1,
        "{log}"
    );
    // Each change went out on its own: the checks alone, no full sync.
    assert_eq!(
        log.matches("checks updated, services untouched").count(),
        3,
        "{log}"
    );
    // No error logged (the client's own debug lines name the 403s `otel.status_code="ERROR"`).
    assert!(!log.lines().any(|l| l.contains(" ERROR ")), "{log}");
}

/// `n` ClusterIP services of two endpoints each, 10.96.0.0/16 onwards.
fn services(n: u32) -> (ServiceMap, EndpointsMap) {
    let (mut services, mut endpoints) = (ServiceMap::new(), EndpointsMap::new());
    for i in 0..n {
        let spn = ServicePortName {
            service: NamespacedName::new("bench", format!("s{i}")),
            port: "tcp".into(),
            protocol: Protocol::Tcp,
        };
        let ip = Ipv4Addr::new(10, 96, (i / 250) as u8, (i % 250 + 1) as u8);
        services.insert(
            spn.clone(),
            ServicePort::cluster_ip(spn.clone(), vec![ip.into()], 80),
        );
        let eps = (1..=2)
            .map(|k| Endpoint::ready(Ipv4Addr::new(10, 244, k, (i % 250 + 1) as u8).into(), 8080))
            .collect();
        endpoints.insert(spn, eps);
    }
    (services, endpoints)
}

/// What a change of the service CIDRs costs at 2 000 services: the checks alone (`sync_skeleton`) against
/// the full sync any other configuration change takes (every service rendered, the tables read back and
/// compared). Prints both; fails if the checks' commit is not a handful of objects.
#[test]
fn a_service_cidr_change_at_2000_services_commits_only_the_checks() {
    require_root();
    let ns = NetNs::create(&unique_name("nk-cidrcost")).unwrap();
    let (services, endpoints) = services(2000);
    let cidrs = |list: &[&str]| RenderConfig {
        service_cidrs: list.iter().map(|c| c.parse().unwrap()).collect(),
        ..RenderConfig::default()
    };
    let (before, after) = (
        cidrs(&["10.96.0.0/16"]),
        cidrs(&["10.96.0.0/16", "10.100.0.0/16"]),
    );
    let text = ns
        .run(move || {
            let mut engine = SyncEngine::new(NftSocket::open().unwrap());
            let first = render::all_pieces(&services, &endpoints, &before);
            engine.sync_full(render::skeleton(&before), first).unwrap();
            let start = Instant::now();
            let checks = engine.sync_skeleton(render::skeleton(&after)).unwrap();
            let checks_elapsed = start.elapsed();
            // Back, then the same change the way any other configuration change goes: a full sync.
            engine.sync_skeleton(render::skeleton(&before)).unwrap();
            engine.force_full_sync();
            let start = Instant::now();
            let pieces = render::all_pieces(&services, &endpoints, &after);
            let full = engine.sync_full(render::skeleton(&after), pieces).unwrap();
            let full_elapsed = start.elapsed();
            eprintln!(
                "service CIDR change at 2000 services: checks only: {} objects, {} bytes, commit {:?}, \
                 whole call {:?}; as a full sync: {} objects, {} bytes, commit {:?}, whole sync {:?}",
                checks.changes,
                checks.bytes,
                checks.commit_time,
                checks_elapsed,
                full.changes,
                full.bytes,
                full.commit_time,
                full_elapsed,
            );
            assert!(checks.changes <= 8, "{checks:?}");
            assert_eq!(checks.transactions, 1);
            let t = engine.backend().dump_table(Family::Ip, "nftkube").unwrap().unwrap();
            nftkube::nft::text::render_table(&t)
        })
        .unwrap();
    let check = text
        .split("chain cluster-ips-check")
        .nth(1)
        .and_then(|rest| rest.split('}').next())
        .unwrap_or_default();
    assert!(
        check.contains("10.100.0.0/16") && check.contains("10.96.0.0/16"),
        "{check}"
    );
}
