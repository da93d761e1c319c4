//! `--nodeport-addresses` as kube-proxy 1.37 reads it, through the real agent, a fake API server and real
//! packets: by default (`primary`) a NodePort answers on the node's primary IP, the Node object's InternalIP
//! (or a specific `--bind-address`), and not on a secondary address of the same uplink; it follows the Node
//! object when that address changes, without a restart; and keywords combine with CIDRs as a union.

use kernel_tests::fake_api::FakeApi;
use kernel_tests::sandbox;
use kernel_tests::*;
use nftkube_sandbox::netns::add_address;
use serde_json::{json, Value};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

const SYNC: Duration = Duration::from_secs(20);
const SHORT: Duration = Duration::from_millis(500);
const NODE_PORT: u16 = 30160;

/// A second address on the node's uplink, in the uplink's subnet: the outside client reaches it on-link, and
/// the default route leaves through its link, so nftkube's fallback (the default route's links) would serve
/// it. Only the Node object can tell it is no primary IP.
fn secondary() -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 200, 11)
}

fn primary() -> Ipv4Addr {
    sandbox::node_ip_v4()
}

/// This node's object, with `internal_ip` as its InternalIP.
fn node_object(internal_ip: Ipv4Addr) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
           "status": {"addresses": [{"type": "InternalIP", "address": internal_ip.to_string()},
                                    {"type": "Hostname", "address": "node-1"}]}})
}

/// A NodePort service backed by pods 1 and 2.
fn load_service(api: &FakeApi) {
    api.apply(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "np", "namespace": "demo"},
        "spec": {"type": "NodePort", "clusterIP": "10.96.0.60", "clusterIPs": ["10.96.0.60"],
                 "ports": [{"name": "tcp", "port": 80, "targetPort": 8080, "protocol": "TCP",
                            "nodePort": NODE_PORT}]}}));
    let endpoints: Vec<Value> = [1, 2]
        .iter()
        .map(|i| {
            json!({"addresses": [sandbox::pod_ip_v4(*i).to_string()],
                        "conditions": {"ready": true}, "nodeName": "node-1"})
        })
        .collect();
    api.apply(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "np-1", "namespace": "demo", "labels": {"kubernetes.io/service-name": "np"}},
        "addressType": "IPv4", "ports": [{"name": "tcp", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints}));
}

/// A sandbox whose node holds `secondary()` beside its primary address, and a fake API server in it holding
/// the service and a Node object naming the primary address.
fn setup(tag: &str) -> (sandbox::Sandbox, FakeApi) {
    let sb = kernel_tests::sandbox(tag, 2);
    sb.node()
        .run(|| add_address(sandbox::NODE_UPLINK, secondary().into(), 24))
        .expect("entering the node's namespace")
        .expect("adding the secondary address");
    let api = FakeApi::in_namespace(sb.node());
    api.apply(node_object(primary()));
    load_service(&api);
    (sb, api)
}

/// Whether the outside client gets an answer from a backend through the NodePort on `ip`.
fn answers_on(sb: &sandbox::Sandbox, ip: Ipv4Addr) -> bool {
    served(sb.ext(), SocketAddr::new(IpAddr::V4(ip), NODE_PORT), SHORT)
}

/// Waits until the NodePort answers on exactly `on` of the two addresses (`on` and not `off`).
fn wait_served_on(sb: &sandbox::Sandbox, agent: &Agent, on: &[Ipv4Addr], off: &[Ipv4Addr]) {
    wait_until(SYNC, || {
        on.iter().all(|ip| answers_on(sb, *ip)) && off.iter().all(|ip| !answers_on(sb, *ip))
    })
    .unwrap_or_else(|_| {
        let state = |ip: &Ipv4Addr| format!("{ip}: {}", answers_on(sb, *ip));
        let seen: Vec<String> = on.iter().chain(off).map(state).collect();
        panic!(
            "want the NodePort on {on:?} and not on {off:?}, saw {seen:?}; log:\n{}",
            agent.log()
        )
    });
}

/// Waits until the agent has taken its NodePort addresses from the Node object and completed a sync since:
/// before that, `primary` is the fallback (the default route's links), which serves both addresses.
fn wait_node_object_programmed(agent: &Agent) {
    let programmed = |log: &str| {
        log.find("from its Node object")
            .is_some_and(|at| log[at..].contains("sync complete"))
    };
    wait_until(SYNC, || programmed(&agent.log())).unwrap_or_else(|_| {
        panic!(
            "the Node object's addresses were never programmed; log:\n{}",
            agent.log()
        )
    });
}

#[test]
fn primary_serves_the_node_objects_internal_ip_and_follows_it() {
    let (sb, api) = setup("nk-npa");
    let agent = Agent::start_api(sb.node(), &api, &[]);
    // The default, primary: the InternalIP only, though the secondary address is on the same uplink (the
    // fallback before the Node object arrives would serve both: only the Node object leads here).
    wait_served_on(&sb, &agent, &[primary()], &[secondary()]);

    // The Node object's InternalIP moves to the other address: NodePorts follow, without a restart.
    let mut agent = agent;
    api.apply(node_object(secondary()));
    wait_served_on(&sb, &agent, &[secondary()], &[primary()]);
    assert!(agent.running(), "the agent restarted:\n{}", agent.log());
}

#[test]
fn primary_combines_with_a_cidr_as_a_union() {
    let (sb, api) = setup("nk-npu");
    let cidr = format!("primary,{}/32", secondary());
    let agent = Agent::start_api(sb.node(), &api, &[&format!("--nodeport-addresses={cidr}")]);
    wait_node_object_programmed(&agent);
    wait_served_on(&sb, &agent, &[primary(), secondary()], &[]);

    // The CIDR alone: the secondary address, not the primary one.
    drop(agent);
    let only = format!("--nodeport-addresses={}/32", secondary());
    let agent = Agent::start_api(sb.node(), &api, &[&only]);
    wait_served_on(&sb, &agent, &[secondary()], &[primary()]);
}

#[test]
fn a_specific_bind_address_is_the_primary_ip_over_the_node_object() {
    let (sb, api) = setup("nk-npb");
    let bind = secondary().to_string();
    let agent = Agent::start_api(sb.node(), &api, &["--bind-address", &bind]);
    wait_served_on(&sb, &agent, &[secondary()], &[primary()]);
}
