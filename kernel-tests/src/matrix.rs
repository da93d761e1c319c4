//! The matrix of sources × destinations × policies × variants shared by `tests/matrix.rs` (real packets against kube-proxy's
//! expected answers) and `tests/trace.rs` (`nftkube trace` against where real packets went): three LoadBalancer
//! services (ClusterIP 10.96.1.i, LB IP 192.168.251.i, NodePort 31000 + i) with one endpoint on this node
//! (pod1, node-1) and one on another (pod2, node-2).

use crate::sandbox;
use std::collections::BTreeSet;
use std::fmt::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

#[derive(Debug, Clone, Copy, PartialEq)]
/// A service's traffic policies.
pub enum Policy {
    /// Both policies Cluster.
    Cluster,
    /// externalTrafficPolicy: Local.
    EtpLocal,
    /// internalTrafficPolicy: Local.
    ItpLocal,
}

#[derive(Debug, Clone, Copy, PartialEq)]
/// The frontend a connection goes to.
pub enum Dest {
    /// The ClusterIP.
    ClusterIp,
    /// The NodePort on the node's address.
    NodePort,
    /// The LoadBalancer ingress IP.
    LbIp,
}

#[derive(Debug, Clone, Copy, PartialEq)]
/// Where a connection comes from.
pub enum Source {
    /// A pod on this node.
    Pod,
    /// The node itself.
    Node,
    /// A client outside the cluster.
    Outside,
}

/// Service i: ClusterIP 10.96.1.i, LB IP 192.168.251.i, NodePort 31000 + i.
pub fn manifest() -> String {
    let mut out = String::new();
    for (i, policy) in [Policy::Cluster, Policy::EtpLocal, Policy::ItpLocal]
        .iter()
        .enumerate()
    {
        let i = i + 1;
        let extra = match policy {
            Policy::Cluster => "",
            Policy::EtpLocal => "  externalTrafficPolicy: Local\n",
            Policy::ItpLocal => "  internalTrafficPolicy: Local\n",
        };
        let _ = write!(
            out,
            r#"---
apiVersion: v1
kind: Service
metadata: {{name: m{i}, namespace: demo}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.1.{i}
{extra}  ports: [{{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: {np}}}]
status:
  loadBalancer:
    ingress: [{{ip: 192.168.251.{i}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: m{i}-1, namespace: demo, labels: {{kubernetes.io/service-name: m{i}}}}}
addressType: IPv4
ports: [{{name: tcp, port: 8080, protocol: TCP}}]
endpoints:
- {{addresses: ["10.244.1.2"], nodeName: node-1}}
- {{addresses: ["10.244.2.2"], nodeName: node-2}}
"#,
            np = 31000 + i
        );
    }
    out
}

/// The address of `dest` of the service with `policy`.
pub fn target(policy: Policy, dest: Dest) -> SocketAddr {
    let i = match policy {
        Policy::Cluster => 1,
        Policy::EtpLocal => 2,
        Policy::ItpLocal => 3,
    };
    match dest {
        Dest::ClusterIp => SocketAddr::new(Ipv4Addr::new(10, 96, 1, i).into(), 80),
        Dest::LbIp => SocketAddr::new(Ipv4Addr::new(192, 168, 251, i).into(), 80),
        Dest::NodePort => SocketAddr::new(sandbox::node_ip_v4().into(), 31000 + i as u16),
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
/// How the agent runs: kube-proxy's TestInternalExternalMasquerade columns.
pub enum Variant {
    /// With the sandbox's cluster CIDRs (the ClusterCIDR local-traffic detector).
    Base,
    /// Without a cluster CIDR: no local-traffic detector.
    NoDetector,
    /// With the cluster CIDRs and `--masquerade-all`.
    MasqueradeAll,
}

/// Every variant, in matrix order.
pub const VARIANTS: [Variant; 3] = [Variant::Base, Variant::NoDetector, Variant::MasqueradeAll];

impl Variant {
    /// Drops the `--cluster-cidr` pair from `args` for `NoDetector`, adds `--masquerade-all` for
    /// `MasqueradeAll`.
    pub fn apply<S: AsRef<std::ffi::OsStr> + From<&'static str>>(self, args: &mut Vec<S>) {
        match self {
            Variant::Base => {}
            Variant::NoDetector => {
                if let Some(i) = args.iter().position(|a| a.as_ref() == "--cluster-cidr") {
                    args.drain(i..i + 2);
                }
            }
            Variant::MasqueradeAll => args.push("--masquerade-all".into()),
        }
    }
}

/// kube-proxy's answer for a cell: (endpoints that answer, whether the backend sees the client's address).
pub fn expected(
    src: Source,
    dest: Dest,
    policy: Policy,
    variant: Variant,
) -> (BTreeSet<usize>, bool) {
    let all: BTreeSet<usize> = [1, 2].into();
    let local: BTreeSet<usize> = [1].into();
    match dest {
        Dest::ClusterIp => {
            let eps = if policy == Policy::ItpLocal {
                local
            } else {
                all
            };
            let kept = match variant {
                // Only pods (inside the cluster CIDR) keep their address.
                Variant::Base => src == Source::Pod,
                // Without a detector, ClusterIP traffic is never masqueraded ("no LocalTrafficDetector").
                Variant::NoDetector => true,
                Variant::MasqueradeAll => false,
            };
            (eps, kept)
        }
        Dest::NodePort | Dest::LbIp => match (policy, src) {
            // externalTrafficPolicy Local: outside traffic to local endpoints, client kept; pods and the node
            // are short-circuited to every endpoint, pods keeping their address (masquerade-all too: kube-proxy's
            // masquerade-all rule matches the ClusterIP only). Without a detector pods are not told apart:
            // like outside traffic, they get the local endpoints only.
            (Policy::EtpLocal, Source::Outside) => (local, true),
            (Policy::EtpLocal, Source::Pod) if variant == Variant::NoDetector => (local, true),
            (Policy::EtpLocal, Source::Pod) => (all, true),
            (Policy::EtpLocal, Source::Node) => (all, false),
            // Cluster policy: NodePorts and LB IPs always masquerade, pods' traffic too
            // (kube-proxy's TestExternalTrafficPolicyCluster, TestInternalExternalMasquerade).
            _ => (all, false),
        },
    }
}

/// The client's own address. The node's connections to a pod leave from its address on that pod's link,
/// masqueraded or not, so for the node only reachability and endpoints are compared.
pub fn client_addr(src: Source) -> Option<IpAddr> {
    match src {
        Source::Pod => Some(sandbox::pod_ip_v4(0).into()),
        Source::Outside => Some(sandbox::ext_ip_v4().into()),
        Source::Node => None,
    }
}

/// Every policy, in matrix order.
pub const POLICIES: [Policy; 3] = [Policy::Cluster, Policy::EtpLocal, Policy::ItpLocal];
/// Every destination, in matrix order.
pub const DESTS: [Dest; 3] = [Dest::ClusterIp, Dest::NodePort, Dest::LbIp];
/// Every source, in matrix order.
pub const SOURCES: [Source; 3] = [Source::Pod, Source::Node, Source::Outside];

/// The namespace a source sends from.
pub fn source_ns(sb: &sandbox::Sandbox, src: Source) -> &nftkube_sandbox::netns::NetNs {
    match src {
        Source::Pod => sb.client(),
        Source::Node => sb.node(),
        Source::Outside => sb.ext(),
    }
}

/// Where real connections went: the endpoints that answered, the client addresses they saw, failures.
#[derive(Debug, Default)]
pub struct Observed {
    /// The endpoints (pod numbers) that answered.
    pub endpoints: BTreeSet<usize>,
    /// The client addresses the endpoints saw.
    pub peers: BTreeSet<IpAddr>,
    /// Connections that failed.
    pub errors: usize,
}

/// `k` TCP connections from `src` to `dst`.
pub fn observe(
    sb: &sandbox::Sandbox,
    src: Source,
    dst: SocketAddr,
    k: usize,
    timeout: std::time::Duration,
) -> Observed {
    let mut seen = Observed::default();
    for a in sandbox::tcp_requests(source_ns(sb, src), dst, k, timeout) {
        match a.as_ref().ok().and_then(|s| sandbox::parse_answer(s)) {
            Some((pod, peer)) => {
                seen.endpoints.insert(pod);
                seen.peers.insert(peer);
            }
            None => seen.errors += 1,
        }
    }
    seen
}

/// The matrix's sandbox: two backend pods, and a route from outside to the LoadBalancer IPs; its manifests
/// (the examples and the matrix's services).
pub fn setup(tag: &str) -> (sandbox::Sandbox, crate::Manifests) {
    let sb = crate::sandbox(tag, 2);
    crate::route_from_outside(&sb, Ipv4Addr::new(192, 168, 251, 0), 24);
    let m = crate::Manifests::examples();
    m.write("matrix.yaml", &manifest());
    (sb, m)
}

/// The agent on the matrix's manifests, run as `variant` says, once it serves them.
pub fn start_agent(sb: &sandbox::Sandbox, m: &crate::Manifests, variant: Variant) -> crate::Agent {
    const SYNC: std::time::Duration = std::time::Duration::from_secs(15);
    let mut args = crate::proxy_args(&m.dir, &[]);
    variant.apply(&mut args);
    let mut cmd = sb.node().command(crate::nftkube_bin());
    cmd.args(args);
    let agent = crate::Agent::spawn(cmd, sb.node());
    agent.wait_syncs(1, SYNC);
    let probe = std::time::Duration::from_millis(300);
    crate::wait_until(SYNC, || {
        crate::served(sb.ext(), target(Policy::Cluster, Dest::LbIp), probe)
    })
    .unwrap_or_else(|_| panic!("never programmed; log:\n{}", agent.log()));
    agent
}
