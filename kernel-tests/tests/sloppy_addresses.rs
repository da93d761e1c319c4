//! Addresses as the API server accepts them (Go's ParseIPSloppy / ParseCIDRSloppy: leading zeros are decimal,
//! `::ffff:a.b.c.d` is IPv4), through the real agent and manifests: a LoadBalancer restricted with a
//! leading-zero range closes for clients outside it, a restriction the agent cannot read closes the
//! LoadBalancer instead of leaving its older, open version in effect, and mapped addresses serve and restrict
//! as their IPv4 addresses.

use kernel_tests::fake_api::{objects_from_yaml, FakeApi};
use kernel_tests::sandbox;
use kernel_tests::*;
use serde_json::json;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

const SYNC: Duration = Duration::from_secs(15);
const SHORT: Duration = Duration::from_millis(700);

/// A LoadBalancer at 192.168.250.70 with these source ranges; its endpoint is pod1 (10.244.1.2), written
/// as `endpoint`.
fn manifest(ranges: &str, endpoint: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: sloppy, namespace: demo}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.70
  loadBalancerSourceRanges: [{ranges}]
  ports: [{{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30120}}]
status:
  loadBalancer:
    ingress: [{{ip: 192.168.250.70}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: sloppy-1, namespace: demo, labels: {{kubernetes.io/service-name: sloppy}}}}
addressType: IPv4
ports: [{{name: tcp, port: 8080, protocol: TCP}}]
endpoints:
- {{addresses: ["{endpoint}"]}}
"#
    )
}

const POD1: &str = "10.244.1.2";

fn served(ns: &nftkube_sandbox::netns::NetNs, dst: SocketAddr) -> bool {
    kernel_tests::served(ns, dst, SHORT)
}

#[test]
fn a_leading_zero_source_range_closes_an_open_load_balancer_to_outsiders() {
    let sb = sandbox("nk-slop", 1);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let lb: SocketAddr = "192.168.250.70:80".parse().unwrap();
    let cluster_ip: SocketAddr = "10.96.0.70:80".parse().unwrap();
    let m = Manifests::examples();

    // Open: the pod client (10.244.0.2) and the outside client (192.168.200.2) both get through.
    m.write("sloppy.yaml", &manifest("", POD1));
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_until(SYNC, || served(sb.ext(), lb) && served(sb.client(), lb))
        .unwrap_or_else(|_| panic!("the open LoadBalancer never served; log:\n{}", agent.log()));

    // The owner restricts it to the pod client's /24, written with leading zeros (the API server accepts
    // this and kube-proxy programs 10.244.0.0/24): the outside client is shut out, the pod is not.
    m.write("sloppy.yaml", &manifest(r#""010.244.000.0/24""#, POD1));
    wait_until(SYNC, || !served(sb.ext(), lb)).unwrap_or_else(|_| {
        panic!(
            "the restriction never took effect: the LB stayed open to outsiders; log:\n{}",
            agent.log()
        )
    });
    assert!(
        served(sb.client(), lb),
        "a client inside 010.244.000.0/24 was refused"
    );

    // A restriction the agent cannot read (a prefix longer than 32 bits): the LoadBalancer closes for
    // everyone rather than keep a version wider than the update asked; the cluster IP stays.
    m.write(
        "sloppy.yaml",
        &manifest(r#""192.168.200.002/32", "010.244.0.0/99""#, POD1),
    );
    wait_until(SYNC, || !served(sb.client(), lb)).unwrap_or_else(|_| {
        panic!(
            "an unreadable restriction left the LB open; log:\n{}",
            agent.log()
        )
    });
    assert!(!served(sb.ext(), lb), "an outsider reached a closed LB");
    assert!(
        served(sb.client(), cluster_ip),
        "the cluster IP was closed too"
    );

    // Readable again: only the outside client's address (leading zeros again) is allowed.
    m.write("sloppy.yaml", &manifest(r#""192.168.200.002/32""#, POD1));
    wait_until(SYNC, || served(sb.ext(), lb)).unwrap_or_else(|_| {
        panic!(
            "the LB never reopened for the allowed client; log:\n{}",
            agent.log()
        )
    });
    assert!(
        !served(sb.client(), lb),
        "a client outside 192.168.200.002/32 got through"
    );

    // An EndpointSlice the agent cannot read: its old endpoint is withdrawn (the IP may be another pod's now).
    m.write(
        "sloppy.yaml",
        &manifest(r#""192.168.200.002/32""#, "10.244.1.2.9"),
    );
    wait_until(SYNC, || !served(sb.ext(), lb)).unwrap_or_else(|_| {
        panic!(
            "the unreadable slice's old endpoint kept serving; log:\n{}",
            agent.log()
        )
    });
}

#[test]
fn mapped_addresses_serve_and_restrict_from_the_first_sync() {
    let sb = sandbox("nk-slop0", 1);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let lb: SocketAddr = "192.168.250.70:80".parse().unwrap();
    let m = Manifests::examples();
    // The endpoint as an IPv4 slice may hold it, IPv4-mapped (the API server's IsValidIPv4Address takes it).
    m.write(
        "sloppy.yaml",
        &manifest(r#""::ffff:192.168.200.0/120""#, "::ffff:10.244.1.2"),
    );
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    wait_until(SYNC, || served(sb.ext(), lb))
        .unwrap_or_else(|_| panic!("the allowed client never served; log:\n{}", agent.log()));
    assert!(
        !served(sb.client(), lb),
        "a client outside ::ffff:192.168.200.0/120 (192.168.200.0/24) got through"
    );
}

/// Applies every object of a manifest to the fake API server.
fn apply_manifest(api: &FakeApi, text: &str) {
    for obj in objects_from_yaml(text) {
        api.apply(obj);
    }
}

#[test]
fn the_api_source_reads_leading_zeros_closes_on_an_unreadable_restriction_and_withdraws_bad_slices()
{
    let sb = sandbox("nk-slapi", 1);
    route_from_outside(&sb, Ipv4Addr::new(192, 168, 250, 0), 24);
    let lb: SocketAddr = "192.168.250.70:80".parse().unwrap();
    let cluster_ip: SocketAddr = "10.96.0.70:80".parse().unwrap();
    let api = FakeApi::in_namespace(sb.node());
    api.apply(
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.168.200.1"}]}}),
    );
    apply_manifest(&api, &manifest("", POD1));
    let mut cmd = sb.node().command(nftkube_bin());
    cmd.args(proxy_args_from(&["--master".into(), api.url().into()], &[]));
    let agent = Agent::spawn(cmd, sb.node());
    wait_until(SYNC, || served(sb.ext(), lb) && served(sb.client(), lb))
        .unwrap_or_else(|_| panic!("the open LoadBalancer never served; log:\n{}", agent.log()));

    // Restricted with leading zeros: the outsider is shut out, the pod client is not.
    apply_manifest(&api, &manifest(r#""010.244.000.0/24""#, POD1));
    wait_until(SYNC, || !served(sb.ext(), lb)).unwrap_or_else(|_| {
        panic!(
            "the restriction never took effect: the LB stayed open to outsiders; log:\n{}",
            agent.log()
        )
    });
    assert!(
        served(sb.client(), lb),
        "a client inside the range was refused"
    );

    // Unreadable restriction: the LB closes for everyone, the cluster IP keeps serving.
    apply_manifest(&api, &manifest(r#""010.244.000.0/99""#, POD1));
    wait_until(SYNC, || !served(sb.client(), lb)).unwrap_or_else(|_| {
        panic!(
            "an unreadable restriction left the LB open; log:\n{}",
            agent.log()
        )
    });
    assert!(
        served(sb.client(), cluster_ip),
        "the cluster IP was closed too"
    );

    // An EndpointSlice update that cannot be read: its endpoint is withdrawn, not kept.
    apply_manifest(&api, &manifest(r#""010.244.000.0/24""#, "10.244.1.2.9"));
    wait_until(SYNC, || !served(sb.client(), cluster_ip)).unwrap_or_else(|_| {
        panic!(
            "the unreadable slice's old endpoint kept serving; log:\n{}",
            agent.log()
        )
    });
    assert!(
        agent
            .log()
            .contains("its endpoints (if any were in effect) are withdrawn"),
        "{}",
        agent.log()
    );
}
