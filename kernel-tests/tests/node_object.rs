//! What the agent takes from its own Node object (API source), with real traffic: the zone label for topology
//! hints, followed as it changes (kube-proxy's OnTopologyChange), and the podCIDRs for
//! `--detect-local-mode=NodeCIDR`, where a change makes the agent exit to restart with the new ranges, leaving
//! its rules in place (kube-proxy's NodeManager does the same).

use kernel_tests::fake_api::{objects_from_yaml, FakeApi, Resource};
use kernel_tests::sandbox::{self, parse_answer, tcp_requests};
use kernel_tests::*;
use nftkube_sandbox::netns::NetNs;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

const ECHO_V4: &str = "10.96.0.10";
const ZONED: &str = "10.96.0.70";
const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(20);

/// A service whose endpoints carry zone hints: pod 1 for zone-a, pods 2 and 3 for zone-b.
const HINTED: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: zoned, namespace: demo}
spec:
  clusterIP: 10.96.0.70
  clusterIPs: [10.96.0.70]
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: zoned-1, namespace: demo, labels: {kubernetes.io/service-name: zoned}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], zone: zone-a, hints: {forZones: [{name: zone-a}]}}
- {addresses: ["10.244.2.2"], zone: zone-b, hints: {forZones: [{name: zone-b}]}}
- {addresses: ["10.244.3.2"], zone: zone-b, hints: {forZones: [{name: zone-b}]}}
"#;

fn node(zone: &str, pod_cidr: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1",
           "labels": {"topology.kubernetes.io/zone": zone}},
           "spec": {"podCIDRs": [pod_cidr]},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.168.200.1"}]}})
}

fn load(api: &FakeApi, texts: &[String]) {
    for text in texts {
        for obj in objects_from_yaml(text) {
            if Resource::of(&obj).is_some() {
                api.apply(obj);
            }
        }
    }
}

/// `nftkube proxy --master URL` as node-1, without the sandbox's cluster CIDRs (the Node's podCIDRs stand in).
fn start_agent(ns: &NetNs, api: &FakeApi, extra: &[&str]) -> Agent {
    let mut cmd = ns.command(nftkube_bin());
    cmd.args(["--log-level", "debug", "proxy", "--master", &api.url()]);
    cmd.args(["--hostname-override", "node-1", "--min-sync-period", "0.2"]);
    cmd.args(extra);
    Agent::spawn(cmd, ns)
}

/// The endpoints that answered from `from` and the client addresses they saw.
fn seen(from: &NetNs, ip: &str, n: usize) -> (BTreeSet<usize>, BTreeSet<IpAddr>) {
    tcp_requests(from, addr(ip, 80), n, T)
        .iter()
        .filter_map(|a| parse_answer(a.as_ref().ok()?))
        .unzip()
}

fn wait_zone_endpoints(sb: &sandbox::Sandbox, agent: &Agent, want: &[usize]) {
    let want: BTreeSet<usize> = want.iter().copied().collect();
    wait_until(SYNC, || seen(sb.client(), ZONED, 24).0 == want).unwrap_or_else(|_| {
        panic!(
            "{ZONED} never answered from exactly {want:?} (last: {:?}); log:\n{}",
            seen(sb.client(), ZONED, 24).0,
            agent.log()
        )
    });
}

#[test]
fn zone_and_pod_cidrs_come_from_the_node_object() {
    let sb = sandbox("nk-nobj", 3);
    let api = FakeApi::in_namespace(sb.node());
    let dir = examples_dir();
    let examples = ["services.yaml", "endpointslices.yaml"]
        .map(|f| std::fs::read_to_string(dir.join(f)).unwrap());
    load(
        &api,
        &[examples[0].clone(), examples[1].clone(), HINTED.into()],
    );
    // pod0 (the client, 10.244.0.2) is in this node's podCIDR; pod1 (10.244.1.2) is not.
    api.apply(node("zone-a", "10.244.0.0/24"));
    let mut agent = start_agent(sb.node(), &api, &["--detect-local-mode", "NodeCIDR"]);

    // The zone label picks the zone's endpoints, and a relabelled node follows without a restart.
    wait_zone_endpoints(&sb, &agent, &[1]);
    api.apply(node("zone-b", "10.244.0.0/24"));
    wait_zone_endpoints(&sb, &agent, &[2, 3]);

    // NodeCIDR: pod0 keeps its address; pod1, outside the podCIDR, is masqueraded.
    let (_, peers) = seen(sb.client(), ECHO_V4, 20);
    assert_eq!(peers, [IpAddr::from(sandbox::pod_ip_v4(0))].into());
    assert!(
        masqueraded_from_pod(&sb, 1, 3, addr(ECHO_V4, 80)),
        "pod1 is outside the podCIDR but not masqueraded"
    );

    // New podCIDRs: the agent exits to be restarted with them, and its rules stay meanwhile.
    api.apply(node("zone-b", "10.244.0.0/16"));
    wait_until(SYNC, || !agent.running())
        .unwrap_or_else(|_| panic!("the agent kept running; log:\n{}", agent.log()));
    let log = agent.log();
    assert!(log.contains("podCIDRs changed"), "{log}");
    let (pods, _) = seen(sb.client(), ECHO_V4, 20);
    assert_eq!(pods, [1, 2, 3].into(), "rules gone after the exit");
}
