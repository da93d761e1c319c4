//! The agent as a kube-proxy replacement: the real binary watches a fake Kubernetes API (list + watch with
//! resourceVersions, bookmarks, 410 Gone, dropped connections, outages) served from a thread inside the
//! sandbox's node namespace on 127.0.0.1, programs the kernel, and serves health, metrics and
//! healthCheckNodePort answers; the config file and flags are resolved as kube-proxy resolves them.

use kernel_tests::fake_api::{objects_from_yaml, FakeApi, Resource};
use kernel_tests::sandbox::{self, parse_answer, tcp_request, tcp_requests};
use kernel_tests::*;
use nftkube::admin::http::{get, Reply};
use nftkube::nft::ir::Family;
use nftkube_sandbox::netns::NetNs;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

const ECHO_V4: &str = "10.96.0.10";
const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(20);
/// Long enough for the API watchers' backoff (0.2 s doubling every second error, 30 s at most) after an
/// outage.
const RECOVER: Duration = Duration::from_secs(45);

/// The examples' Services and EndpointSlices, plus this node's object.
fn load_examples(api: &FakeApi) {
    let dir = examples_dir();
    for file in ["services.yaml", "endpointslices.yaml"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        for obj in objects_from_yaml(&text) {
            if Resource::of(&obj).is_some() {
                api.apply(obj);
            }
        }
    }
    api.apply(node("node-1", false));
}

fn node(name: &str, deleting: bool) -> Value {
    let taints = if deleting {
        json!([{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}])
    } else {
        json!([])
    };
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name,
           "labels": {"topology.kubernetes.io/zone": "z1"}},
           "spec": {"podCIDRs": ["10.244.0.0/16"], "taints": taints},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.168.200.1"}]}})
}

fn service(name: &str, ip: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "demo"},
           "spec": {"clusterIP": ip, "clusterIPs": [ip],
                    "ports": [{"name": "tcp", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
}

/// An EndpointSlice of `service` with pods `pods` (1-based) on `node`.
fn slice(name: &str, service: &str, pods: &[usize], node: &str) -> Value {
    let eps: Vec<Value> = pods
        .iter()
        .map(|i| {
            json!({"addresses": [sandbox::pod_ip_v4(*i).to_string()],
                        "conditions": {"ready": true}, "nodeName": node})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "namespace": "demo",
                        "labels": {"kubernetes.io/service-name": service}},
           "addressType": "IPv4",
           "ports": [{"name": "tcp", "port": 8080, "protocol": "TCP"}, {"name": "udp", "port": 5353, "protocol": "UDP"}],
           "endpoints": eps})
}

fn backends_seen(sb: &sandbox::Sandbox, ip: &str, n: usize) -> BTreeSet<usize> {
    tcp_requests(sb.client(), addr(ip, 80), n, T)
        .iter()
        .filter_map(|a| a.as_ref().ok().and_then(|s| parse_answer(s)))
        .map(|(pod, _)| pod)
        .collect()
}

fn wait_backends(
    sb: &sandbox::Sandbox,
    agent: &Agent,
    ip: &str,
    want: &[usize],
    timeout: Duration,
) {
    let want: BTreeSet<usize> = want.iter().copied().collect();
    wait_until(timeout, || backends_seen(sb, ip, 24) == want).unwrap_or_else(|_| {
        panic!(
            "{ip} never answered from exactly {want:?} (last: {:?}); log:\n{}",
            backends_seen(sb, ip, 24),
            agent.log()
        )
    });
}

/// GET from inside `ns`.
fn get_in(ns: &NetNs, to: SocketAddr, path: &str) -> std::io::Result<Reply> {
    let path = path.to_string();
    ns.run(move || get(to, &path, T))?
}

/// The classic text format (what a scrape without `Accept` gets) → sample name (with labels) → value;
/// panics on a malformed line or an OpenMetrics `# EOF`.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    assert!(!text.contains("# EOF"), "OpenMetrics unasked:\n{text}");
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            assert!(
                line.is_empty() || line.starts_with("# HELP ") || line.starts_with("# TYPE "),
                "bad comment line {line:?}"
            );
            continue;
        }
        let (name, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let v: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        out.insert(name.to_string(), v);
    }
    out
}

fn metrics(ns: &NetNs, at: SocketAddr) -> BTreeMap<String, f64> {
    let (status, _, body) = get_in(ns, at, "/metrics").expect("scraping /metrics");
    assert_eq!(status, 200, "{body}");
    parse_metrics(&body)
}

#[test]
fn api_source_syncs_and_follows_adds_updates_and_deletes() {
    let sb = sandbox("nk-kapi", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    let agent = Agent::start_api(sb.node(), &api, &[]);
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2, 3], SYNC);
    // kube-proxy's selector: objects claimed by another proxy or headless are not asked for.
    let reqs = api.requests().join("\n");
    assert!(
        reqs.contains("labelSelector=%21service.kubernetes.io%2Fservice-proxy-name")
            || reqs.contains("labelSelector=!service.kubernetes.io/service-proxy-name"),
        "{reqs}"
    );
    assert!(reqs.contains("watch=true"), "{reqs}");
    assert!(
        reqs.contains("fieldSelector=metadata.name%3Dnode-1"),
        "{reqs}"
    );

    // Update: an endpoint removed from the slice.
    api.apply(slice("echo-abc", "echo", &[1, 3], "node-1"));
    wait_backends(&sb, &agent, ECHO_V4, &[1, 3], SYNC);

    // Add: a new service whose endpoints are split over two slices (merged by the service-name label).
    api.apply(service("web", "10.96.0.30"));
    api.apply(slice("web-a", "web", &[1], "node-1"));
    api.apply(slice("web-b", "web", &[2], "node-2"));
    wait_backends(&sb, &agent, "10.96.0.30", &[1, 2], SYNC);
    // One slice goes: the other's endpoints stay.
    api.delete(Resource::EndpointSlices, "demo", "web-a");
    wait_backends(&sb, &agent, "10.96.0.30", &[2], SYNC);

    // Delete: the service's address is gone from the kernel.
    api.delete(Resource::Services, "demo", "echo");
    wait_until(SYNC, || {
        let t = dump_table(sb.node(), Family::Ip).unwrap();
        !nftkube::nft::text::render_table(&t).contains(ECHO_V4)
    })
    .unwrap_or_else(|_| panic!("service deletion not applied; log:\n{}", agent.log()));
    assert!(tcp_request(sb.client(), addr(ECHO_V4, 80), Duration::from_millis(500)).is_err());
    assert!(!backends_seen(&sb, "10.96.0.30", 6).is_empty());
    let log = agent.log();
    assert!(log.contains("initial list complete"), "{log}");
    assert!(!log.contains("ERROR"), "{log}");
}

#[test]
fn api_outage_keeps_the_rules_and_a_relist_after_410_converges() {
    let sb = sandbox("nk-kout", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    let agent = Agent::start_api(sb.node(), &api, &[]);
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2, 3], SYNC);

    // Dropped connections: every watch is cut; a change right after still arrives (re-watch from the
    // last resourceVersion, no relist needed).
    api.drop_watches();
    api.apply(slice("echo-abc", "echo", &[1, 2], "node-1"));
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2], SYNC);

    // Outage: connections refused. The rules keep serving; nothing is flushed. (First let the follow-up
    // sync that deletes released chains happen.)
    let text = || nftkube::nft::text::render_table(&dump_table(sb.node(), Family::Ip).unwrap());
    let mut before = text();
    wait_until(SYNC, || {
        std::thread::sleep(Duration::from_millis(700));
        let now = text();
        std::mem::replace(&mut before, now) == before
    })
    .expect("the ruleset never settled");
    api.set_down(true);
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(backends_seen(&sb, ECHO_V4, 24), BTreeSet::from([1, 2]));
    assert_eq!(before, text(), "rules changed while the API was down");

    // While it is down the cluster moves on and the history is compacted: the agent's resourceVersion is
    // too old, so its re-watch gets 410 Gone and it must relist; the relist is applied whole.
    api.apply(slice("echo-abc", "echo", &[3], "node-1"));
    api.apply(service("web", "10.96.0.30"));
    api.apply(slice("web-a", "web", &[1, 2], "node-1"));
    api.delete(Resource::Services, "demo", "empty");
    // Enough services that the relist takes two pages (the watcher asks for 500 at a time).
    for i in 0..520u32 {
        api.apply(service(
            &format!("bulk-{i}"),
            &format!("10.97.{}.{}", i / 250, i % 250 + 1),
        ));
    }
    api.compact();
    api.set_down(false);
    wait_backends(&sb, &agent, ECHO_V4, &[3], RECOVER);
    wait_backends(&sb, &agent, "10.96.0.30", &[1, 2], SYNC);
    wait_until(SYNC, || {
        let t = dump_table(sb.node(), Family::Ip).unwrap();
        !nftkube::nft::text::render_table(&t).contains("10.96.0.20")
    })
    .unwrap_or_else(|_| {
        panic!(
            "deletion during the outage not applied; log:\n{}",
            agent.log()
        )
    });
    let t = dump_table(sb.node(), Family::Ip).unwrap();
    let text = nftkube::nft::text::render_table(&t);
    assert!(
        text.contains("10.97.0.1") && text.contains("10.97.2.20"),
        "bulk services missing"
    );
    let log = agent.log();
    assert!(log.contains("API watch failed"), "{log}");
    assert!(log.contains("relist complete"), "{log}");
    let pages = api
        .requests()
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/services?") && r.contains("continue="))
        .count();
    assert!(pages >= 1, "the relist was not paged: {:?}", api.requests());
    let m = metrics(sb.node(), "127.0.0.1:10249".parse().unwrap());
    assert!(
        m["nftkube_api_watch_errors_total{resource=\"Service\"}"] > 0.0,
        "{m:?}"
    );
}

#[test]
fn nothing_is_programmed_before_both_lists_and_an_unreachable_api_flushes_nothing() {
    let sb = sandbox("nk-kgate", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    let mut first = Agent::start_api(sb.node(), &api, &[]);
    wait_backends(&sb, &first, ECHO_V4, &[1, 2, 3], SYNC);
    assert!(first.stop(), "agent did not exit cleanly");
    let programmed = nftkube::nft::text::render_table(&dump_table(sb.node(), Family::Ip).unwrap());

    // A new agent whose EndpointSlice list fails: Services alone are not a complete view, so it must not
    // sync (a sync without endpoints would reject every connection).
    api.apply(slice("echo-abc", "echo", &[2], "node-1"));
    api.fail(Resource::EndpointSlices, Some(500));
    let agent = Agent::start_api(sb.node(), &api, &[]);
    std::thread::sleep(Duration::from_secs(4));
    assert!(!agent.log().contains("sync complete"), "{}", agent.log());
    assert!(
        agent.log().contains("waiting for the source"),
        "{}",
        agent.log()
    );
    assert_eq!(
        nftkube::nft::text::render_table(&dump_table(sb.node(), Family::Ip).unwrap()),
        programmed
    );
    assert_eq!(backends_seen(&sb, ECHO_V4, 24), BTreeSet::from([1, 2, 3]));
    // healthy while starting up (nothing queued yet), as kube-proxy
    let (status, _, _) = get_in(sb.node(), "127.0.0.1:10256".parse().unwrap(), "/healthz").unwrap();
    assert_eq!(status, 200);

    // The list succeeds: one sync, with the current endpoints.
    api.fail(Resource::EndpointSlices, None);
    wait_backends(&sb, &agent, ECHO_V4, &[2], RECOVER);
}

#[test]
fn malformed_objects_are_skipped_with_a_logged_reason() {
    let sb = sandbox("nk-kbad", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    api.apply(service("broken", "10.96.0.300"));
    let mut unlabelled = slice("stray", "x", &[1], "node-1");
    unlabelled["metadata"]["labels"] = json!({});
    api.apply(unlabelled);
    // An endpoint the API server would never store, in a slice of a working service, beside what the watcher
    // reads without using (a targetRef, a hostname) and a slice written as Go writes an empty one.
    let mut garbage = slice("echo-bad", "echo", &[1], "node-1");
    garbage["endpoints"][0]["addresses"] = json!(["10.244.1.999"]);
    garbage["endpoints"][0]["targetRef"] = json!({"kind": "Pod", "name": "p", "namespace": "demo"});
    garbage["endpoints"][0]["hostname"] = json!("p");
    api.apply(garbage);
    let mut empty = slice("echo-empty", "echo", &[], "node-1");
    empty["endpoints"] = Value::Null;
    api.apply(empty);
    let agent = Agent::start_api(sb.node(), &api, &[]);
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2, 3], SYNC);
    let log = agent.log();
    assert!(log.contains("EndpointSlice demo/echo-bad"), "{log}");
    assert!(log.contains("10.244.1.999"), "{log}");
    assert!(log.contains("Service demo/broken"), "{log}");
    assert!(log.contains("10.96.0.300"), "{log}");
    assert!(log.contains("EndpointSlice demo/stray"), "{log}");
    assert!(
        log.contains("missing label kubernetes.io/service-name"),
        "{log}"
    );
    // A bad update of a working service: skipped, the last good version keeps serving.
    let mut bad = service("echo", "10.96.0.10");
    bad["spec"]["ports"][0]["protocol"] = json!("ICMP");
    api.apply(bad);
    wait_until(SYNC, || {
        agent.log().contains("unsupported protocol \"ICMP\"")
    })
    .unwrap_or_else(|_| panic!("{}", agent.log()));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(backends_seen(&sb, ECHO_V4, 24), BTreeSet::from([1, 2, 3]));
}

#[test]
fn health_metrics_and_health_check_node_ports_are_served() {
    let sb = sandbox("nk-kadm", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    // A LoadBalancer service with externalTrafficPolicy Local and a healthCheckNodePort; endpoints on
    // this node.
    api.apply(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "lb", "namespace": "demo"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.50", "clusterIPs": ["10.96.0.50"],
                 "externalTrafficPolicy": "Local", "healthCheckNodePort": 32001,
                 "ports": [{"name": "tcp", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30150}]}}));
    api.apply(slice("lb-1", "lb", &[1, 2], "node-1"));
    let agent = Agent::start_api(sb.node(), &api, &[]);
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2, 3], SYNC);
    let healthz: SocketAddr = "127.0.0.1:10256".parse().unwrap();
    let metrics_at: SocketAddr = "127.0.0.1:10249".parse().unwrap();

    let (status, headers, body) = get_in(sb.node(), healthz, "/healthz").unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(headers.contains(&("content-type".into(), "application/json".into())));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["nodeEligible"], true, "{body}");
    assert!(v["lastUpdated"].is_string(), "{body}");
    assert_eq!(get_in(sb.node(), healthz, "/livez").unwrap().0, 200);
    // Bound to every address by default, as kube-proxy's: a load balancer outside probes the node's address.
    let outside = SocketAddr::new(sandbox::node_ip_v4().into(), 10256);
    let (status, _, body) = get_in(sb.ext(), outside, "/healthz").unwrap();
    assert_eq!(status, 200, "{body}");

    // The health check node port, on the NodePort addresses (the node's primary ones): two local endpoints.
    let hc = SocketAddr::new(sandbox::node_ip_v4().into(), 32001);
    wait_until(SYNC, || {
        get_in(sb.node(), hc, "/").is_ok_and(|r| r.0 == 200)
    })
    .unwrap_or_else(|_| panic!("no health check server; log:\n{}", agent.log()));
    let (_, headers, body) = get_in(sb.node(), hc, "/").unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v,
        json!({"service": {"namespace": "demo", "name": "lb"}, "localEndpoints": 2, "serviceProxyHealthy": true})
    );
    assert!(headers.contains(&("x-load-balancing-endpoint-weight".into(), "2".into())));
    // The endpoints move to another node: 503, no local endpoints.
    api.apply(slice("lb-1", "lb", &[1, 2], "node-2"));
    wait_until(SYNC, || {
        get_in(sb.node(), hc, "/").is_ok_and(|r| r.0 == 503)
    })
    .unwrap_or_else(|_| panic!("health check did not follow; log:\n{}", agent.log()));
    assert!(get_in(sb.node(), hc, "/")
        .unwrap()
        .2
        .contains("\"localEndpoints\":0"));

    // Metrics: kube-proxy's names, parsed; an endpoint change with a trigger time is measured.
    let m = metrics(sb.node(), metrics_at);
    assert!(
        m["kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}"] > 1.6e9,
        "{m:?}"
    );
    assert!(m["kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}"] >= 1.0);
    assert!(m["kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}"] >= 1.0);
    assert!(
        m["kubeproxy_sync_proxy_rules_endpoint_changes_total"] >= 3.0,
        "{m:?}"
    );
    assert!(
        m["kubeproxy_sync_proxy_rules_service_changes_total"] >= 4.0,
        "{m:?}"
    );
    assert!(
        m.contains_key("kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv6\"}")
    );
    assert!(m.contains_key("kubeproxy_proxy_healthz_total{code=\"200\"}"));
    assert_eq!(
        m["kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}"], 0.0,
        "no trigger time given yet"
    );
    let now = nftkube::admin::health::rfc3339(SystemTime::now() - Duration::from_millis(250));
    let mut s = slice("echo-abc", "echo", &[1, 2], "node-1");
    s["metadata"]["annotations"] = json!({"endpoints.kubernetes.io/last-change-trigger-time": now});
    api.apply(s);
    wait_until(SYNC, || {
        metrics(sb.node(), metrics_at)
            ["kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}"]
            >= 1.0
    })
    .unwrap_or_else(|_| panic!("latency not measured; log:\n{}", agent.log()));
    let m = metrics(sb.node(), metrics_at);
    let sum = m["kubeproxy_network_programming_duration_seconds_sum{ip_family=\"IPv4\"}"];
    assert!((0.25..10.0).contains(&sum), "latency {sum}");
    // echo is IPv4 only: its slices' latency is an IPv4 proxier's, as in a dual-stack kube-proxy.
    assert_eq!(
        m["kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv6\"}"], 0.0,
        "{m:?}"
    );
    assert_eq!(
        m["kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\",ip_family=\"IPv4\"}"],
        0.0,
        "{m:?}"
    );

    // The node is about to be deleted: /healthz says 503 (load balancers drain it), /livez stays 200.
    api.apply(node("node-1", true));
    wait_until(SYNC, || {
        get_in(sb.node(), healthz, "/healthz").is_ok_and(|r| r.0 == 503)
    })
    .unwrap_or_else(|_| panic!("node eligibility ignored; log:\n{}", agent.log()));
    let (_, _, body) = get_in(sb.node(), healthz, "/healthz").unwrap();
    assert!(body.contains("\"nodeEligible\":false"), "{body}");
    assert_eq!(get_in(sb.node(), healthz, "/livez").unwrap().0, 200);
}

#[test]
fn config_file_and_flags_resolve_like_kube_proxy() {
    let sb = sandbox("nk-kcfg", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    let dir = std::env::temp_dir().join(nftkube_sandbox::netns::unique_name("nftkube-cfg"));
    std::fs::create_dir_all(&dir).unwrap();
    // The API address from a kubeconfig named by the config file, as kubeadm's kube-proxy ConfigMap does.
    let kubeconfig = dir.join("kubeconfig.conf");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: c\n  context:\n    cluster: fake\n    user: u\n\
             users:\n- name: u\n  user: {{}}\ncurrent-context: c\n",
            api.url()
        ),
    )
    .unwrap();
    let config = dir.join("config.conf");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             clientConnection:\n  kubeconfig: {}\nhostnameOverride: node-1\n\
             clusterCIDR: {},{}\nhealthzBindAddress: 127.0.0.1:20256\nmetricsBindAddress: 127.0.0.1:20249\n\
             mode: nftables\nnftables:\n  minSyncPeriod: 200ms\n  syncPeriod: 20s\n\
             conntrack:\n  maxPerCore: 65536\nfrobnicate: true\n",
            kubeconfig.display(),
            sandbox::CLUSTER_CIDR_V4,
            sandbox::CLUSTER_CIDR_V6
        ),
    )
    .unwrap();
    let mut cmd = sb.node().command(nftkube_bin());
    cmd.args(["--log-level", "debug", "proxy", "--config"])
        .arg(&config)
        .args(["--metrics-bind-address", "127.0.0.1:30249"]);
    let agent = Agent::spawn(cmd, sb.node());
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2, 3], SYNC);
    let log = agent.log();
    assert!(log.contains("unknown field frobnicate"), "{log}");
    // kube-proxy's precedence: beside --config the file's metrics address applies, and the flag is
    // ignored (with a warning naming it).
    assert!(
        log.contains("--metrics-bind-address is ignored: with --config the file's value applies"),
        "{log}"
    );
    wait_until(SYNC, || {
        get_in(sb.node(), "127.0.0.1:20249".parse().unwrap(), "/metrics").is_ok()
    })
    .unwrap_or_else(|_| panic!("metrics not on the file's address; log:\n{log}"));
    assert!(get_in(sb.node(), "127.0.0.1:30249".parse().unwrap(), "/metrics").is_err());
    assert_eq!(
        get_in(sb.node(), "127.0.0.1:20256".parse().unwrap(), "/healthz")
            .unwrap()
            .0,
        200
    );
    drop(agent);

    // Invalid values stop startup with exit code 64 and say what is wrong, before touching anything.
    let bad = dir.join("bad.conf");
    std::fs::write(
        &bad,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/33\n",
    )
    .unwrap();
    for args in [
        vec![
            "proxy",
            "--config",
            bad.to_str().unwrap(),
            "--master",
            "http://127.0.0.1:1",
        ],
        vec![
            "proxy",
            "--master",
            "http://127.0.0.1:1",
            "--masquerade-bit",
            "40",
        ],
        vec![
            "proxy",
            "--master",
            "http://127.0.0.1:1",
            "--sync-period",
            "soon",
        ],
        vec![
            "proxy",
            "--master",
            "http://127.0.0.1:1",
            "--metrics-bind-address",
            "nowhere",
        ],
        vec!["proxy", "--no-such-flag"],
        vec!["proxy", "--kubeconfig", "/nonexistent/kubeconfig"],
        vec!["proxy", "--master", "127.0.0.1:6443"],
    ] {
        let out = nftkube_in(sb.node(), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(!stderr.is_empty(), "{args:?}");
    }
    let out = nftkube_in(
        sb.node(),
        &[
            "proxy",
            "--config",
            bad.to_str().unwrap(),
            "--master",
            "http://127.0.0.1:1",
        ],
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("clusterCIDR"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// linux/capability.h
const CAP_NET_ADMIN: i32 = 12;

/// Drops every capability but CAP_NET_ADMIN from the bounding set of the command's process (before exec, so
/// root's capabilities after exec are NET_ADMIN alone), as `capabilities: {drop: [ALL], add: [NET_ADMIN]}`
/// does in deploy/nftkube.yaml.
fn only_net_admin(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: runs in the forked child before exec; prctl is async-signal-safe and touches no memory.
    unsafe {
        cmd.pre_exec(|| {
            for cap in 0..64 {
                if cap != CAP_NET_ADMIN
                    && libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0
                    && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

#[test]
fn cap_net_admin_is_the_only_capability_needed() {
    let sb = sandbox("nk-kcap", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    api.apply(json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "lb", "namespace": "demo"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.50", "clusterIPs": ["10.96.0.50"],
                 "externalTrafficPolicy": "Local", "healthCheckNodePort": 32002,
                 "ports": [{"name": "tcp", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": 30151}]}}));
    api.apply(slice("lb-1", "lb", &[1], "node-1"));
    let cidrs = format!("{},{}", sandbox::CLUSTER_CIDR_V4, sandbox::CLUSTER_CIDR_V6);
    let mut cmd = sb.node().command(nftkube_bin());
    cmd.args(["--log-level", "debug", "proxy", "--master", &api.url()])
        .args(["--hostname-override", "node-1", "--cluster-cidr", &cidrs])
        .args(["--min-sync-period", "0.2"]);
    only_net_admin(&mut cmd);
    let agent = Agent::spawn(cmd, sb.node());
    // Right after spawn the child may not have exec'd yet (its capabilities would be the test's): wait until
    // the process is nftkube itself.
    let status_path = format!("/proc/{}/status", agent.pid().unwrap());
    wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&status_path)
            .is_ok_and(|s| s.lines().next() == Some("Name:\tnftkube"))
    })
    .expect("the agent never exec'd");
    let status = std::fs::read_to_string(&status_path).unwrap();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(cap_eff, 1 << CAP_NET_ADMIN, "{status}");

    // nf_tables, the event monitor, ctnetlink, the admin and health check ports: all work.
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2, 3], SYNC);
    let udp = sandbox::udp_requests(sb.client(), addr(ECHO_V4, 53), 10, T);
    assert!(udp.iter().all(|a| a.is_ok()), "{udp:?}");
    assert_eq!(
        get_in(sb.node(), "127.0.0.1:10256".parse().unwrap(), "/healthz")
            .unwrap()
            .0,
        200
    );
    wait_until(SYNC, || {
        get_in(
            sb.node(),
            SocketAddr::new(sandbox::node_ip_v4().into(), 32002),
            "/",
        )
        .is_ok_and(|r| r.0 == 200)
    })
    .unwrap_or_else(|_| panic!("no health check server; log:\n{}", agent.log()));
    // An endpoint goes away: the stale UDP flows are cleaned up. Kernel-side conntrack filters need a
    // scratch namespace to be probed (CAP_SYS_ADMIN); without it the portable dump is used.
    api.apply(slice("echo-abc", "echo", &[1, 3], "node-1"));
    wait_until(SYNC, || {
        metrics(sb.node(), "127.0.0.1:10249".parse().unwrap())["nftkube_conntrack_cleanups_total"]
            >= 1.0
    })
    .unwrap_or_else(|_| panic!("no conntrack cleanup; log:\n{}", agent.log()));
    let m = metrics(sb.node(), "127.0.0.1:10249".parse().unwrap());
    assert_eq!(
        m["nftkube_conntrack_cleanup_failures_total"],
        0.0,
        "{}",
        agent.log()
    );
    assert!(
        agent.log().contains("cannot probe kernel filters"),
        "{}",
        agent.log()
    );
    wait_backends(&sb, &agent, ECHO_V4, &[1, 3], SYNC);
    // Repairs (the nf_tables event monitor) work too.
    assert!(
        !agent.log().contains("event monitor stopped"),
        "{}",
        agent.log()
    );
}

/// The API source alone, in this process, against the fake API server on the host's 127.0.0.1 (no
/// namespace, no kernel): the event stream the proxy loop sees.
#[test]
fn kube_source_event_stream_over_http() {
    use nftkube::source::{Event, KubeOptions, KubeSource};
    let api = FakeApi::start();
    load_examples(&api);
    let mut source = KubeSource::start(KubeOptions {
        kubeconfig: None,
        master: Some(api.url()),
        node_name: "node-1".into(),
    })
    .unwrap();
    let mut seen: Vec<Event> = Vec::new();
    let collect = |source: &mut KubeSource, until: &dyn Fn(&[Event]) -> bool| -> Vec<Event> {
        let mut got = Vec::new();
        wait_until(SYNC, || {
            got.extend(source.poll());
            until(&got)
        })
        .unwrap_or_else(|_| panic!("events so far: {got:?}"));
        got
    };
    let short = |e: &Event| match e {
        Event::ServiceApplied { key, .. } => format!("svc+ {key}"),
        Event::ServiceDeleted(k) => format!("svc- {k}"),
        Event::SliceApplied(s) => format!("slice+ {}", s.key()),
        Event::SliceDeleted { namespace, name } => format!("slice- {namespace}/{name}"),
        Event::Synced => "synced".into(),
        Event::EndpointsChangeTriggered { service, .. } => format!("trigger {service}"),
        Event::NodeApplied(n) => format!("node+ {}", n.name),
        Event::NodeDeleted => "node-".into(),
        Event::ServiceCidrs(c) => format!("cidrs {c:?}"),
    };
    // The initial lists: every object, then Synced once (the node's list does not gate it).
    let initial = collect(&mut source, &|e| {
        e.contains(&Event::Synced) && e.iter().any(|e| matches!(e, Event::NodeApplied(_)))
    });
    let names: BTreeSet<String> = initial.iter().map(short).collect();
    for want in [
        "svc+ demo/echo",
        "svc+ demo/empty",
        "svc+ demo/echo6",
        "slice+ demo/echo-abc",
        "slice+ demo/echo6-abc",
        "node+ node-1",
        "synced",
    ] {
        assert!(names.contains(want), "{want} missing from {names:?}");
    }
    assert_eq!(initial.iter().filter(|e| **e == Event::Synced).count(), 1);
    seen.extend(initial);

    // Watch events, across bookmarks (sent every 500 ms) and a dropped connection.
    std::thread::sleep(Duration::from_millis(1200));
    api.drop_watches();
    api.apply(service("web", "10.96.0.30"));
    let got = collect(&mut source, &|e| {
        e.iter().any(|e| short(e) == "svc+ demo/web")
    });
    assert_eq!(got.iter().map(short).collect::<Vec<_>>(), ["svc+ demo/web"]);
    // Re-applying an object unchanged emits nothing; a real change emits one event.
    api.apply(service("web", "10.96.0.30"));
    api.apply(service("web", "10.96.0.31"));
    let got = collect(&mut source, &|e| !e.is_empty());
    std::thread::sleep(Duration::from_millis(300));
    let mut got = got;
    got.extend(source.poll());
    assert_eq!(got.iter().map(short).collect::<Vec<_>>(), ["svc+ demo/web"]);

    // Outage with compaction: after it, the relist yields exactly the difference, in one go.
    api.set_down(true);
    api.delete(Resource::Services, "demo", "empty");
    api.apply(slice("echo-abc", "echo", &[1], "node-1"));
    api.compact();
    api.set_down(false);
    let got = collect(&mut source, &|e| e.len() >= 2);
    std::thread::sleep(Duration::from_millis(500));
    let mut got = got;
    got.extend(source.poll());
    let names: BTreeSet<String> = got.iter().map(short).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "svc- demo/empty".to_string(),
            "slice+ demo/echo-abc".to_string()
        ]),
        "{got:?}"
    );
    seen.extend(got);
    assert_eq!(seen.iter().filter(|e| **e == Event::Synced).count(), 1);
}

/// Watch requests the fake API has received for `r`.
fn watches(api: &FakeApi, r: Resource) -> usize {
    let prefix = format!("GET {}?", r.path());
    api.requests()
        .iter()
        .filter(|q| q.starts_with(&prefix) && q.contains("watch=true"))
        .count()
}

/// Short API outages in a row, each long enough to fail every watch once: after each, the watchers'
/// backoff starts over (kube-runtime's default backoff did not: the outages' delays added up, 0.8, 1.6, 3.2,
/// 6.4 s ..., and the change after the fourth waited 6–13 s). Then a change right after the API is back is
/// programmed within the first delays of the sequence (0.2–0.4 s each, see `source::backoff`).
#[test]
fn changes_after_repeated_short_outages_come_within_the_first_backoff_delay() {
    const OUTAGE: Duration = Duration::from_millis(300);
    const AFTER: &str = "10.96.0.40";
    let sb = sandbox("nk-kbo", 3);
    let api = FakeApi::in_namespace(sb.node());
    load_examples(&api);
    let agent = Agent::start_api(sb.node(), &api, &[]);
    wait_backends(&sb, &agent, ECHO_V4, &[1, 2, 3], SYNC);
    let resources = [
        Resource::Services,
        Resource::EndpointSlices,
        Resource::Nodes,
    ];
    for outage in 1..=4 {
        let before: Vec<usize> = resources.iter().map(|r| watches(&api, *r)).collect();
        api.set_down(true);
        std::thread::sleep(OUTAGE);
        api.set_down(false);
        let back = std::time::Instant::now();
        if outage == 4 {
            break;
        }
        // Every watcher re-establishes its watch before the next outage.
        wait_until(RECOVER, || {
            resources
                .iter()
                .zip(&before)
                .all(|(r, n)| watches(&api, *r) > *n)
        })
        .unwrap_or_else(|_| panic!("outage {outage}: the watches never came back"));
        println!(
            "outage {outage}: every watch re-established {:?} after the API was back",
            back.elapsed()
        );
    }
    let back = std::time::Instant::now();
    api.apply(service("after", AFTER));
    api.apply(slice("after-a", "after", &[2], "node-1"));
    let programmed = || {
        let t = dump_table(sb.node(), Family::Ip).unwrap();
        nftkube::nft::text::render_table(&t).contains(AFTER)
    };
    // A hang guard, not the goal: the goal (1 s) is printed.
    wait_until(Duration::from_secs(5), || {
        std::thread::sleep(Duration::from_millis(10));
        programmed()
    })
    .unwrap_or_else(|_| {
        panic!(
            "the change after the last outage was not programmed within 5 s; log:\n{}",
            agent.log()
        )
    });
    println!(
        "change after 4 short outages: programmed {:?} after the API was back",
        back.elapsed()
    );
    wait_backends(&sb, &agent, AFTER, &[2], SYNC);
    let m = metrics(sb.node(), "127.0.0.1:10249".parse().unwrap());
    assert!(
        m["nftkube_api_watch_errors_total{resource=\"EndpointSlice\"}"] >= 4.0,
        "every outage failed the watch: {m:?}"
    );
}

/// kube-proxy's Events, published through the API: `Starting` on the Node, and warnings for a healthz
/// address and a healthCheckNodePort that something else holds (on the Node and on the Service).
#[test]
fn events_are_published_where_kube_proxy_publishes_them() {
    const HC_PORT: u16 = 30981;
    const HEALTHZ: &str = "127.0.0.1:20356";
    let sb = sandbox("nk-events", 1);
    let api = FakeApi::in_namespace(sb.node());
    api.apply(node("node-1", false));
    for obj in objects_from_yaml(&local_load_balancer(HC_PORT, 30982)) {
        api.apply(obj);
    }
    let _held = sb
        .node()
        .run(|| {
            (
                std::net::TcpListener::bind(("0.0.0.0", HC_PORT)).unwrap(),
                std::net::TcpListener::bind(HEALTHZ).unwrap(),
            )
        })
        .unwrap();
    let agent = Agent::start_api(sb.node(), &api, &["--healthz-bind-address", HEALTHZ]);
    let find = |reason: &str| api.events().into_iter().find(|e| e["reason"] == reason);
    let reasons = [
        "Starting",
        "FailedToStartProxierHealthcheck",
        "FailedToStartServiceHealthcheck",
    ];
    wait_until(SYNC, || reasons.iter().all(|r| find(r).is_some()))
        .unwrap_or_else(|_| panic!("events: {:#?}\nlog:\n{}", api.events(), agent.log()));
    for e in api.events() {
        assert_eq!(e["reportingController"], "nftkube", "{e:#}");
        assert_eq!(e["reportingInstance"], "node-1", "{e:#}");
    }
    let starting = find("Starting").unwrap();
    assert_eq!(starting["type"], "Normal");
    assert_eq!(starting["action"], "StartKubeProxy");
    assert_eq!(starting["regarding"]["kind"], "Node");
    assert_eq!(starting["regarding"]["name"], "node-1");
    let healthz = find("FailedToStartProxierHealthcheck").unwrap();
    assert_eq!(healthz["type"], "Warning");
    assert_eq!(healthz["regarding"]["kind"], "Node");
    assert!(
        healthz["note"].as_str().unwrap().contains(HEALTHZ),
        "{healthz:#}"
    );
    let hc = find("FailedToStartServiceHealthcheck").unwrap();
    assert_eq!(hc["type"], "Warning");
    assert_eq!(hc["regarding"]["kind"], "Service");
    assert_eq!(hc["regarding"]["namespace"], "demo");
    assert_eq!(hc["regarding"]["name"], "lb");
    assert_eq!(
        hc["metadata"]["namespace"], "demo",
        "a Service's events live in its namespace"
    );
    assert!(
        hc["note"]
            .as_str()
            .unwrap()
            .contains(&format!("on port {HC_PORT}")),
        "{hc:#}"
    );
}
