//! The agent binary as a user meets it: cold sync and change → traffic latency, from manifests and from the
//! Kubernetes API, every number beside an anchor measured in the same run.
//!
//! 1. Cold sync at each N (ClusterIP services × E endpoints, spread over 1000 nodes by `nodeName` as in a
//!    real cluster, the agent being one of them): the library's render + commit in a fresh
//!    namespace (the anchor); the binary from YAML manifests of the same objects, and from JSON ones (the
//!    YAML parser's share of the time); the binary from a fake API
//!    server that serves them as paged lists (500 per page, as kube-rs asks and kube-apiserver answers) and
//!    watches. Wall time from spawning the binary to its first "sync complete", and its peak RSS (VmHWM);
//!    printed as they come: when each list completed, the snapshot, the sync, and the agent's CPU time per
//!    thread to the first sync.
//! 2. Change → new endpoint answering, at `NFTKUBE_BENCH_LATENCY_SERVICES` services (default 10 000): a
//!    probe service's one endpoint moves between two real backend pods; the time from the change (a manifest
//!    file written, or an EndpointSlice applied to the API) until a new TCP connection from the client pod to
//!    the ClusterIP is answered by the new pod. p50 and p99 over CHANGES changes, quiet (each change after the
//!    sync runner's token is back) and under churn (100 endpoint changes per second to other services for
//!    CHURN_SECONDS, the agent's RSS sampled every second). The anchor: one TCP request to the ClusterIP,
//!    median, in the same sandbox.
//!
//! `bash ci/bench` runs it with its defaults; the full run is
//! `cargo bench -p kernel-tests --bench latency -- 10000,44000,50000,100000 5 200 60` and, for a million endpoints,
//! `cargo bench -p kernel-tests --bench latency -- 100000 10 0`. Arguments: COLD_SIZES (comma-separated; 0 or
//! empty skips part 1), ENDPOINTS per service, CHANGES (0 skips part 2), CHURN_SECONDS. Root (namespaces);
//! the release binary must be built (`cargo build --release --bins`), or named by `NFTKUBE_BIN`.
//! `NFTKUBE_BENCH_COLD_SOURCES` (comma-separated, of `yaml`, `json`, `api`; default all three) picks the cold
//! runs' sources; the library's anchor always runs. `NFTKUBE_BENCH_API_OBJECTS=served` has the fake API serve
//! its objects as kube-apiserver does (below, `as_served`): `managedFields` and a uid on every object, a
//! `targetRef` on every endpoint, the defaulted spec fields; by default it serves them bare, as the manifests
//! hold them.

use kernel_tests::fake_api::FakeApi;
use kernel_tests::sandbox::{self, parse_answer, tcp_request_here, Sandbox};
use kernel_tests::{require_root, BACKEND_TCP_PORT};
use nftkube::model::*;
use nftkube::nft::netlink::NftSocket;
use nftkube::render::{self, RenderConfig};
use nftkube::sync::SyncEngine;
use nftkube_sandbox::netns::{unique_name, NetNs};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The cold runs' pod range (the endpoints are addresses nobody has; only rules are measured).
const COLD_CLUSTER_CIDR: &str = "10.240.0.0/12";
/// The latency runs' sync runner period: quiet changes come after a token is back, churn coalesces into
/// one sync per period (the goal under churn: this + 20 ms).
const MIN_SYNC_PERIOD: Duration = Duration::from_millis(100);
/// Nodes the cold runs' endpoints are spread over (the agent is one of them, `node-1`).
const NODES: usize = 1000;
/// Background endpoint changes per second during the churn runs.
const CHURN_RATE: u32 = 100;
/// Services whose endpoints the churn rewrites (their slices live in a file of their own).
const CHURNED: usize = 10;

fn main() {
    require_root();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let sizes: Vec<usize> = arg(0, "10000")
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("COLD_SIZES: comma-separated numbers"))
        .filter(|&n| n > 0)
        .collect();
    let endpoints: usize = arg(1, "5").parse().expect("ENDPOINTS: a number");
    let changes: usize = arg(2, "200").parse().expect("CHANGES: a number");
    let churn_secs: u64 = arg(3, "60").parse().expect("CHURN_SECONDS: a number");
    let bin = release_binary();
    if !sizes.is_empty() {
        cold_table(&bin, &sizes, endpoints);
    }
    if changes > 0 {
        let n: usize = std::env::var("NFTKUBE_BENCH_LATENCY_SERVICES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10_000);
        latency_table(&bin, n, changes, Duration::from_secs(churn_secs));
    }
}

/// `$NFTKUBE_BIN`, or the workspace's release build.
fn release_binary() -> PathBuf {
    nftkube_sandbox::workspace_binary("NFTKUBE_BIN", "release", "nftkube")
}

// ---------------------------------------------------------------------------------------------------------
// The cluster: N services and their slices, as the library's model, as YAML and as API objects.

struct Cluster {
    n: usize,
    endpoints: usize,
}

impl Cluster {
    fn namespace(i: usize) -> String {
        format!("ns{}", i % 100)
    }
    fn name(i: usize) -> String {
        format!("svc{i}")
    }
    fn cluster_ip(i: usize) -> Ipv4Addr {
        add(Ipv4Addr::new(10, 96, 0, 0), 1 + i as u32)
    }
    /// The node endpoint `j` of service `i` runs on: the endpoints are spread over `NODES` nodes, as the
    /// EndpointSlice controller names them (`nodeName`); the agent is `node-1`.
    fn node_of(&self, i: usize, j: usize) -> String {
        format!("node-{}", (i * self.endpoints + j) % NODES)
    }
    /// Endpoint `j` of service `i`, with version `v` of its first endpoint (the churn bumps it).
    fn endpoint_ip(&self, i: usize, j: usize, v: u32) -> Ipv4Addr {
        let base = add(
            Ipv4Addr::new(10, 240, 0, 0),
            1 + (i * self.endpoints + j) as u32,
        );
        if j == 0 && v > 0 {
            add(Ipv4Addr::new(10, 255, 0, 0), (i as u32 * 251 + v) % 65_000)
        } else {
            base
        }
    }

    fn model(&self) -> (ServiceMap, EndpointsMap) {
        let mut services = ServiceMap::new();
        let mut eps = EndpointsMap::new();
        for i in 0..self.n {
            let sp = ServicePort::cluster_ip(
                ServicePortName {
                    service: NamespacedName::new(Self::namespace(i), Self::name(i)),
                    port: "p80".into(),
                    protocol: Protocol::Tcp,
                },
                vec![IpAddr::V4(Self::cluster_ip(i))],
                80,
            );
            let list = (0..self.endpoints)
                .map(|j| Endpoint {
                    node_name: Some(self.node_of(i, j)),
                    ..Endpoint::ready(IpAddr::V4(self.endpoint_ip(i, j, 0)), 8080)
                })
                .collect();
            eps.insert(sp.name.clone(), list);
            services.insert(sp.name.clone(), sp);
        }
        (services, eps)
    }

    fn service_yaml(i: usize) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {}, namespace: {}}}\nspec:\n  clusterIP: {}\n  ports: [{{name: p80, port: 80, targetPort: 8080, protocol: TCP}}]\n",
            Self::name(i),
            Self::namespace(i),
            Self::cluster_ip(i)
        )
    }

    fn slice_yaml(&self, i: usize, v: u32) -> String {
        let addrs: String = (0..self.endpoints)
            .map(|j| {
                format!(
                    "  - addresses: [\"{}\"]\n    conditions: {{ready: true}}\n    nodeName: {}\n",
                    self.endpoint_ip(i, j, v),
                    self.node_of(i, j)
                )
            })
            .collect();
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-x\n  namespace: {}\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: p80, port: 8080, protocol: TCP}}]\nendpoints:\n{addrs}",
            Self::namespace(i),
            name = Self::name(i),
        )
    }

    /// services.yaml and endpointslices.yaml (the slices of the first `CHURNED` services in churn.yaml).
    fn write_manifests(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let services: String = (0..self.n).map(Self::service_yaml).collect();
        let slices: String = (CHURNED.min(self.n)..self.n)
            .map(|i| self.slice_yaml(i, 0))
            .collect();
        std::fs::write(dir.join("services.yaml"), services).unwrap();
        std::fs::write(dir.join("endpointslices.yaml"), slices).unwrap();
        self.write_churn(dir, &[0; CHURNED]);
    }

    /// The churned services' slices, service `i` at version `versions[i]`; through a rename, as ConfigMap
    /// updates and editors write.
    fn write_churn(&self, dir: &Path, versions: &[u32]) {
        let text: String = (0..CHURNED.min(self.n))
            .map(|i| self.slice_yaml(i, versions[i]))
            .collect();
        write_atomically(&dir.join("churn.yaml"), &text);
    }

    fn service_json(i: usize) -> Value {
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": Self::name(i), "namespace": Self::namespace(i)},
               "spec": {"clusterIP": Self::cluster_ip(i).to_string(),
                        "clusterIPs": [Self::cluster_ip(i).to_string()],
                        "ports": [{"name": "p80", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
    }

    fn slice_json(&self, i: usize, v: u32) -> Value {
        let eps: Vec<Value> = (0..self.endpoints)
            .map(|j| json!({"addresses": [self.endpoint_ip(i, j, v).to_string()], "conditions": {"ready": true},
                            "nodeName": self.node_of(i, j)}))
            .collect();
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": format!("{}-x", Self::name(i)), "namespace": Self::namespace(i),
                            "labels": {"kubernetes.io/service-name": Self::name(i)}},
               "addressType": "IPv4",
               "ports": [{"name": "p80", "port": 8080, "protocol": "TCP"}],
               "endpoints": eps})
    }

    /// The same objects as JSON manifests: one `List` per file.
    fn write_json_manifests(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let list = |items: Vec<Value>| {
            json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
        };
        let services = (0..self.n).map(Self::service_json).collect();
        let slices = (0..self.n).map(|i| self.slice_json(i, 0)).collect();
        std::fs::write(dir.join("services.json"), list(services)).unwrap();
        std::fs::write(dir.join("endpointslices.json"), list(slices)).unwrap();
    }

    fn load_api(&self, api: &FakeApi) {
        let served = std::env::var("NFTKUBE_BENCH_API_OBJECTS").as_deref() == Ok("served");
        for i in 0..self.n {
            let (mut svc, mut slice) = (Self::service_json(i), self.slice_json(i, 0));
            if served {
                as_served(&mut svc, i);
                as_served(&mut slice, i);
            }
            api.apply(svc);
            api.apply(slice);
        }
        api.apply(
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
                         "spec": {}, "status": {"addresses": []}}),
        );
    }
}

/// An object as kube-apiserver serves it: a uid, a creation time, the `managedFields` of its writer (a
/// controller's or `kubectl apply`'s field tree), and what the API defaults or the controllers add (a
/// Service's defaulted spec fields and status; a slice's managed-by label, owner and each endpoint's
/// `targetRef` and full conditions). None of it is read by the proxy but the creation time.
fn as_served(v: &mut Value, i: usize) {
    let kind = v["kind"].as_str().unwrap().to_owned();
    let meta = &mut v["metadata"];
    meta["uid"] = json!(format!("00000000-0000-4000-8000-{i:012}"));
    meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    let fields = if kind == "Service" {
        json!({"f:metadata": {"f:annotations": {".": {}, "f:kubectl.kubernetes.io/last-applied-configuration": {}}},
               "f:spec": {"f:internalTrafficPolicy": {}, "f:ports": {".": {}, "k:{\"port\":80,\"protocol\":\"TCP\"}":
                   {".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}},
                   "f:selector": {}, "f:sessionAffinity": {}, "f:type": {}}})
    } else {
        json!({"f:addressType": {}, "f:endpoints": {}, "f:metadata": {"f:generateName": {}, "f:labels": {".": {},
               "f:endpointslice.kubernetes.io/managed-by": {}, "f:kubernetes.io/service-name": {}},
               "f:ownerReferences": {".": {}, "k:{\"uid\":\"u\"}": {}}}, "f:ports": {}})
    };
    let manager = if kind == "Service" {
        "kubectl-client-side-apply"
    } else {
        "kube-controller-manager"
    };
    meta["managedFields"] = json!([{"manager": manager, "operation": "Update", "apiVersion": "v1",
                                    "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": fields}]);
    if kind == "Service" {
        let spec = v["spec"].clone();
        v["metadata"]["annotations"] = json!({"kubectl.kubernetes.io/last-applied-configuration":
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": v["metadata"]["name"],
                   "namespace": v["metadata"]["namespace"]}, "spec": spec}).to_string()});
        let spec = &mut v["spec"];
        spec["selector"] = json!({"app": format!("app-{i}")});
        spec["type"] = json!("ClusterIP");
        spec["sessionAffinity"] = json!("None");
        spec["ipFamilies"] = json!(["IPv4"]);
        spec["ipFamilyPolicy"] = json!("SingleStack");
        spec["internalTrafficPolicy"] = json!("Cluster");
        v["status"] = json!({"loadBalancer": {}});
    } else {
        let meta = &mut v["metadata"];
        meta["generateName"] = json!(format!(
            "{}-",
            meta["labels"]["kubernetes.io/service-name"]
                .as_str()
                .unwrap()
        ));
        meta["labels"]["endpointslice.kubernetes.io/managed-by"] =
            json!("endpointslice-controller.k8s.io");
        meta["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "Service", "controller": true,
            "blockOwnerDeletion": true, "name": meta["labels"]["kubernetes.io/service-name"], "uid": "u"}]);
        let namespace = meta["namespace"].clone();
        for (j, e) in v["endpoints"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .enumerate()
        {
            e["conditions"] = json!({"ready": true, "serving": true, "terminating": false});
            e["targetRef"] = json!({"kind": "Pod", "namespace": namespace, "name": format!("app-{i}-{j:05}"),
                                    "uid": format!("00000000-0000-4000-8001-{i:06}{j:06}")});
        }
    }
}

fn add(ip: Ipv4Addr, offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(ip) + offset)
}

fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_file_name(format!(
        ".tmp-{}",
        path.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

// ---------------------------------------------------------------------------------------------------------
// The binary.

/// The agent binary running in a namespace, its log read on a thread of ours.
struct Agent {
    child: Child,
    /// When each sync completed (a Mutex: the churn thread shares the run).
    synced: std::sync::Mutex<std::sync::mpsc::Receiver<Instant>>,
}

enum Source<'a> {
    Manifests(&'a Path),
    Api(&'a FakeApi),
}

impl Agent {
    fn start(bin: &Path, ns: &NetNs, source: Source, cluster_cidr: &str) -> Agent {
        let mut cmd = ns.command(bin);
        cmd.args(["--log-level", "info", "proxy"]);
        match source {
            Source::Manifests(dir) => cmd.arg("--manifests").arg(dir),
            Source::Api(api) => cmd.args(["--master", &api.url()]),
        };
        let period = format!("{}", MIN_SYNC_PERIOD.as_secs_f64());
        cmd.args([
            "--hostname-override",
            "node-1",
            "--cluster-cidr",
            cluster_cidr,
        ])
        .args(["--min-sync-period", &period]);
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the agent");
        let (tx, synced) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let spawned = Instant::now();
        std::thread::spawn(move || {
            let mut first = true;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                // Where the time to the first sync went: each list's end, the snapshot, the sync itself.
                if first && FIRST_SYNC_MILESTONES.iter().any(|m| line.contains(m)) {
                    let at = spawned.elapsed().as_secs_f64();
                    eprintln!("    agent +{at:.3} s: {}", milestone(&line));
                }
                if line.contains("sync complete") {
                    first = false;
                    let _ = tx.send(Instant::now());
                }
                if line.contains("ERROR") {
                    eprintln!("agent: {line}");
                }
            }
        });
        Agent {
            child,
            synced: std::sync::Mutex::new(synced),
        }
    }

    /// When the first sync completed (panics after `limit`).
    fn first_sync(&self, limit: Duration) -> Instant {
        self.synced
            .lock()
            .unwrap()
            .recv_timeout(limit)
            .expect("the agent did not complete its first sync")
    }

    fn status(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the agent's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc status"))
    }
}

/// The agent's log lines that mark a phase of its first sync.
const FIRST_SYNC_MILESTONES: [&str; 3] =
    ["initial list complete", "source synced", "sync complete"];

/// A log line from its message on (the timestamp and level before it say nothing here).
fn milestone(line: &str) -> &str {
    FIRST_SYNC_MILESTONES
        .iter()
        .find_map(|m| line.find(m))
        .map_or(line, |i| &line[i..])
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: kill on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------------------
// Part 1: cold sync.

fn cold_table(bin: &Path, sizes: &[usize], endpoints: usize) {
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut push = |name: &str, col: usize, v: String| {
        eprintln!("  N={} {name}: {v}", sizes[col]);
        match rows.iter_mut().find(|r| r.0 == name) {
            Some(r) => r.1[col] = v,
            None => {
                let mut cells = vec!["-".to_string(); sizes.len()];
                cells[col] = v;
                rows.push((name.to_owned(), cells));
            }
        }
    };
    for (col, &n) in sizes.iter().enumerate() {
        eprintln!("== cold sync, N = {n} × {endpoints}");
        let cluster = Cluster { n, endpoints };
        let library = library_cold(&cluster);
        push("library: render + commit (s)", col, secs(library));
        let sources = cold_sources();

        // The same objects as YAML and as JSON manifests (the YAML parser's share of the time).
        for run in MANIFEST_RUNS {
            if !sources.contains(&run.source) {
                continue;
            }
            let [first_sync, ratio_row, rss_row] = run.rows;
            let dir = std::env::temp_dir().join(unique_name("nftkube-latency"));
            (run.write)(&cluster, &dir);
            let (wall, rss) = binary_cold(bin, Source::Manifests(&dir));
            let _ = std::fs::remove_dir_all(&dir);
            push(first_sync, col, secs(wall));
            push(ratio_row, col, ratio(wall, library));
            push(rss_row, col, mib(rss));
        }

        if sources.contains(&"api") {
            let ns = NetNs::create(&unique_name("nklat")).unwrap();
            // The API is served on the namespace's loopback.
            ns.run(|| nftkube_sandbox::netns::set_link_up("lo"))
                .unwrap()
                .expect("loopback up");
            let api = FakeApi::in_namespace(&ns);
            cluster.load_api(&api);
            let (wall, rss) = binary_cold_in(bin, &ns, Source::Api(&api));
            push(
                "binary from the API (paged lists): first sync (s)",
                col,
                secs(wall),
            );
            push("  ratio: binary (API) / library", col, ratio(wall, library));
            push("  peak RSS (MiB) ", col, mib(rss));
        }
    }
    println!();
    println!(
        "| N (ClusterIP services × {endpoints} endpoints) | {} |",
        sizes
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---|".repeat(sizes.len()));
    for (name, cells) in rows {
        println!("| {name} | {} |", cells.join(" | "));
    }
}

/// A cold run from manifest files: its source's name, how its files are written, its rows in the table.
struct ManifestRun {
    source: &'static str,
    write: fn(&Cluster, &Path),
    rows: [&'static str; 3],
}

const MANIFEST_RUNS: [ManifestRun; 2] = [
    ManifestRun {
        source: "yaml",
        write: Cluster::write_manifests,
        rows: [
            "binary from YAML manifests: first sync (s)",
            "  ratio: binary (manifests) / library",
            "  peak RSS (MiB)",
        ],
    },
    ManifestRun {
        source: "json",
        write: Cluster::write_json_manifests,
        rows: [
            "binary from JSON manifests (a List per file): first sync (s)",
            "  ratio: binary (JSON) / library",
            "  peak RSS (MiB)  ",
        ],
    },
];

/// The cold runs' sources, from `NFTKUBE_BENCH_COLD_SOURCES` (all three by default).
fn cold_sources() -> Vec<&'static str> {
    let all = ["yaml", "json", "api"];
    let Ok(chosen) = std::env::var("NFTKUBE_BENCH_COLD_SOURCES") else {
        return all.to_vec();
    };
    let chosen: Vec<&str> = chosen.split(',').map(str::trim).collect();
    for c in &chosen {
        assert!(
            all.contains(c),
            "NFTKUBE_BENCH_COLD_SOURCES: {c:?} is none of {all:?}"
        );
    }
    all.into_iter().filter(|s| chosen.contains(s)).collect()
}

/// The library's cold full sync in a fresh namespace: render + one commit (chunked as the agent's).
fn library_cold(cluster: &Cluster) -> Duration {
    let (services, endpoints) = cluster.model();
    // As the agent runs (`--hostname-override node-1`).
    let cfg = RenderConfig {
        cluster_cidrs: vec![COLD_CLUSTER_CIDR.parse().unwrap()],
        node_name: "node-1".into(),
        ..RenderConfig::default()
    };
    let ns = NetNs::create(&unique_name("nklat")).unwrap();
    ns.run(move || {
        let mut engine = SyncEngine::new(NftSocket::open().unwrap());
        let start = Instant::now();
        let pieces = render::all_pieces(&services, &endpoints, &cfg);
        engine.sync_full(render::skeleton(&cfg), pieces).unwrap();
        start.elapsed()
    })
    .unwrap()
}

fn binary_cold(bin: &Path, source: Source) -> (Duration, u64) {
    let ns = NetNs::create(&unique_name("nklat")).unwrap();
    binary_cold_in(bin, &ns, source)
}

/// Spawn → first "sync complete", and the peak RSS (KiB) then.
fn binary_cold_in(bin: &Path, ns: &NetNs, source: Source) -> (Duration, u64) {
    let start = Instant::now();
    let agent = Agent::start(bin, ns, source, COLD_CLUSTER_CIDR);
    let at = agent.first_sync(Duration::from_secs(600));
    eprintln!(
        "    agent CPU by thread to the first sync: {}",
        thread_cpu(agent.child.id())
    );
    (at - start, agent.status("VmHWM"))
}

/// CPU time (user + system) of each of a process's threads, by name: on a shared machine, what the agent did
/// moves less from run to run than the wall time it took.
fn thread_cpu(pid: u32) -> String {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut by_name: Vec<(String, f64)> = Vec::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the agent's threads");
    for task in tasks.map_while(Result::ok) {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ...`: the name may hold spaces, so the fields are read after its `)`.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let cpu: f64 =
            fields[11].parse::<f64>().unwrap_or(0.0) + fields[12].parse::<f64>().unwrap_or(0.0);
        match by_name.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += cpu / ticks,
            None => by_name.push((name, cpu / ticks)),
        }
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    by_name
        .iter()
        .filter(|(_, s)| *s >= 0.01)
        .map(|(n, s)| format!("{n} {s:.2} s"))
        .collect::<Vec<_>>()
        .join(", ")
}

// ---------------------------------------------------------------------------------------------------------
// Part 2: change → traffic.

struct Latencies {
    p50: Duration,
    p99: Duration,
}

fn latency_table(bin: &Path, n: usize, changes: usize, churn: Duration) {
    let sb = Sandbox::build(&unique_name("nklat"), 2).expect("sandbox");
    sb.start_backends(BACKEND_TCP_PORT, kernel_tests::BACKEND_UDP_PORT)
        .expect("backends");
    let cluster = Cluster { n, endpoints: 5 };
    let mut lines = Vec::new();
    let mut anchor = Duration::ZERO;
    for api_source in [false, true] {
        let label = if api_source {
            "API event"
        } else {
            "manifest write"
        };
        eprintln!("== change → traffic from a {label}, {n} services");
        let run = Run::start(bin, &sb, &cluster, api_source);
        anchor = run.probe_anchor();
        let quiet = run.changes(changes, None);
        let stop = AtomicBool::new(false);
        let (churned, samples, churn_changes) = std::thread::scope(|scope| {
            let churner = scope.spawn(|| churn_endpoints(&run, &stop));
            let sampler = RssSampler::start(run.agent.child.id());
            let spacing = churn / changes.max(1) as u32;
            let lat = run.changes(changes, Some(spacing));
            stop.store(true, Ordering::SeqCst);
            let made = churner.join().expect("churner");
            (lat, sampler.stop(), made)
        });
        lines.push(format!(
            "| {label}, quiet | {} | {} | {} |",
            ms(quiet.p50),
            ms(quiet.p99),
            ratio(quiet.p99, Duration::from_millis(20))
        ));
        lines.push(format!(
            "| {label}, churn ({churn_changes} changes in {} s) | {} | {} | {} |",
            churn.as_secs(),
            ms(churned.p50),
            ms(churned.p99),
            ratio(churned.p99, MIN_SYNC_PERIOD + Duration::from_millis(20))
        ));
        let (first, max, last) = (
            samples.first().copied().unwrap_or(0),
            samples.iter().copied().max().unwrap_or(0),
            samples.last().copied().unwrap_or(0),
        );
        lines.push(format!(
            "| {label}: agent RSS over the churn (MiB, first / max / last of {} samples) | {} / {} / {} | | |",
            samples.len(),
            mib(first),
            mib(max),
            mib(last)
        ));
    }
    println!();
    println!(
        "Change → new endpoint answering, {n} services, {changes} changes each, --min-sync-period {} ms; \
         anchor: one TCP request to the ClusterIP, median {} ms",
        MIN_SYNC_PERIOD.as_millis(),
        ms(anchor)
    );
    println!();
    println!(
        "| source, load | p50 (ms) | p99 (ms) | p99 / goal (quiet 20 ms, churn period + 20 ms) |"
    );
    println!("|---|---|---|---|");
    for l in lines {
        println!("{l}");
    }
}

/// One agent over the cluster plus the probe service, in the sandbox's node.
struct Run<'a> {
    /// First: the agent stops before its API server goes.
    agent: Agent,
    sb: &'a Sandbox,
    cluster: &'a Cluster,
    dir: PathBuf,
    api: Option<FakeApi>,
}

const PROBE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);

fn probe_service_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: probe, namespace: probe}}\nspec:\n  clusterIP: {PROBE_IP}\n  ports: [{{name: tcp, port: 80, targetPort: {BACKEND_TCP_PORT}, protocol: TCP}}]\n"
    )
}

fn probe_slice_json(pod: usize) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": "probe-x", "namespace": "probe",
                        "labels": {"kubernetes.io/service-name": "probe"}},
           "addressType": "IPv4",
           "ports": [{"name": "tcp", "port": BACKEND_TCP_PORT, "protocol": "TCP"}],
           "endpoints": [{"addresses": [sandbox::pod_ip_v4(pod).to_string()], "conditions": {"ready": true}}]})
}

fn probe_slice_yaml(pod: usize) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: probe-x\n  namespace: probe\n  labels: {{kubernetes.io/service-name: probe}}\naddressType: IPv4\nports: [{{name: tcp, port: {BACKEND_TCP_PORT}, protocol: TCP}}]\nendpoints:\n- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n",
        sandbox::pod_ip_v4(pod)
    )
}

impl<'a> Run<'a> {
    fn start(bin: &Path, sb: &'a Sandbox, cluster: &'a Cluster, api_source: bool) -> Run<'a> {
        let dir = std::env::temp_dir().join(unique_name("nftkube-latency"));
        let api = api_source.then(|| FakeApi::in_namespace(sb.node()));
        match &api {
            Some(api) => {
                cluster.load_api(api);
                let svc: Value = {
                    let mut v = Cluster::service_json(0);
                    v["metadata"] = json!({"name": "probe", "namespace": "probe"});
                    v["spec"] = json!({"clusterIP": PROBE_IP.to_string(), "clusterIPs": [PROBE_IP.to_string()],
                        "ports": [{"name": "tcp", "port": 80, "targetPort": BACKEND_TCP_PORT, "protocol": "TCP"}]});
                    v
                };
                api.apply(svc);
                api.apply(probe_slice_json(1));
            }
            None => {
                cluster.write_manifests(&dir);
                std::fs::write(dir.join("probe-service.yaml"), probe_service_yaml()).unwrap();
                write_atomically(&dir.join("probe.yaml"), &probe_slice_yaml(1));
            }
        }
        let source = match &api {
            Some(api) => Source::Api(api),
            None => Source::Manifests(&dir),
        };
        let agent = Agent::start(bin, sb.node(), source, sandbox::CLUSTER_CIDR_V4);
        agent.first_sync(Duration::from_secs(300));
        let run = Run {
            sb,
            cluster,
            dir,
            api,
            agent,
        };
        assert_eq!(
            run.answering_pod(Duration::from_secs(30)),
            1,
            "the probe service never answered from pod 1"
        );
        run
    }

    fn target() -> SocketAddr {
        SocketAddr::new(IpAddr::V4(PROBE_IP), 80)
    }

    /// Which pod answers a new connection to the probe service (retried until one does, within `limit`).
    fn answering_pod(&self, limit: Duration) -> usize {
        self.sb
            .client()
            .run(move || {
                let end = Instant::now() + limit;
                loop {
                    let answer = tcp_request_here(Self::target(), Duration::from_secs(1));
                    if let Some((pod, _)) = answer.ok().as_deref().and_then(parse_answer) {
                        return pod;
                    }
                    assert!(Instant::now() < end, "the probe service never answered");
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
            .unwrap()
    }

    /// The median of 200 requests to the probe service: what one probe of a change costs.
    fn probe_anchor(&self) -> Duration {
        self.sb
            .client()
            .run(|| {
                let times = (0..200)
                    .map(|_| {
                        let start = Instant::now();
                        tcp_request_here(Self::target(), Duration::from_secs(2)).expect("probe");
                        start.elapsed()
                    })
                    .collect();
                median(times)
            })
            .unwrap()
    }

    /// Moves the probe's endpoint to `pod`.
    fn change(&self, pod: usize) {
        match &self.api {
            Some(api) => {
                api.apply(probe_slice_json(pod));
            }
            None => write_atomically(&self.dir.join("probe.yaml"), &probe_slice_yaml(pod)),
        }
    }

    /// `count` changes, each timed until a new connection is answered by the new pod. Quiet (`spacing`
    /// None): each after the runner's token is back; else one every `spacing`.
    fn changes(&self, count: usize, spacing: Option<Duration>) -> Latencies {
        let mut times = Vec::with_capacity(count);
        let mut pod = self.answering_pod(Duration::from_secs(10));
        for _ in 0..count {
            let next_at = Instant::now() + spacing.unwrap_or(Duration::ZERO);
            pod = 3 - pod;
            let start = Instant::now();
            self.change(pod);
            let elapsed = self.wait_answer_from(pod, start);
            times.push(elapsed);
            match spacing {
                None => std::thread::sleep(MIN_SYNC_PERIOD * 3),
                Some(_) => std::thread::sleep(next_at.saturating_duration_since(Instant::now())),
            }
        }
        times.sort();
        Latencies {
            p50: times[times.len() / 2],
            p99: times[(times.len() * 99).div_ceil(100) - 1],
        }
    }

    /// Time from `start` until a new connection is answered by `pod` (probing every millisecond).
    fn wait_answer_from(&self, pod: usize, start: Instant) -> Duration {
        self.sb
            .client()
            .run(move || loop {
                let answer = tcp_request_here(Self::target(), Duration::from_secs(1));
                if answer.ok().as_deref().and_then(parse_answer).map(|a| a.0) == Some(pod) {
                    return start.elapsed();
                }
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "pod {pod} never answered after the change"
                );
                std::thread::sleep(Duration::from_millis(1));
            })
            .unwrap()
    }
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `CHURN_RATE` endpoint changes per second to the churned services until `stop`; how many it made.
fn churn_endpoints(run: &Run, stop: &AtomicBool) -> usize {
    let churned = CHURNED.min(run.cluster.n);
    let mut versions = [0u32; CHURNED];
    let period = Duration::from_secs(1) / CHURN_RATE;
    let mut next = Instant::now();
    let mut done = 0;
    while !stop.load(Ordering::SeqCst) {
        let i = done % churned;
        versions[i] += 1;
        match &run.api {
            Some(api) => {
                api.apply(run.cluster.slice_json(i, versions[i]));
            }
            None => run.cluster.write_churn(&run.dir, &versions),
        }
        done += 1;
        next += period;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    done
}

/// The agent's RSS (KiB) every second.
struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u64>>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::SeqCst) {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
                let rss = status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
                    .expect("VmRSS");
                samples.push(rss);
                for _ in 0..20 {
                    if flag.load(Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            samples
        });
        RssSampler { stop, thread }
    }

    fn stop(self) -> Vec<u64> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().expect("RSS sampler")
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}
fn secs(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64())
}
fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}
fn mib(kib: u64) -> String {
    format!("{:.0}", kib as f64 / 1024.0)
}
fn ratio(ours: Duration, anchor: Duration) -> String {
    format!(
        "{:.2}×",
        ours.as_secs_f64() / anchor.as_secs_f64().max(1e-9)
    )
}
