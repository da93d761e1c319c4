//! SCTP services carry real SCTP associations: a ClusterIP from a pod (both endpoints, the pod's address kept)
//! and a NodePort from outside (both endpoints, masqueraded), as kube-proxy's SCTP rules do.
//!
//! Needs a kernel with SCTP (`CONFIG_IP_SCTP`). The VM matrix's Debian kernels have it and run this test
//! (`ci/vm-init` passes `--include-ignored`); a host kernel without it reports the test as ignored, never as
//! passed. Run by hand on such a kernel with `cargo test -p kernel-tests --test sctp -- --include-ignored`.

use kernel_tests::sandbox;
use kernel_tests::*;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::collections::BTreeSet;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const CLUSTER_IP: &str = "10.96.0.60";
const PORT: u16 = 9000;
const TARGET_PORT: u16 = 9132;
const NODE_PORT: u16 = 30132;
const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(15);
const TRIES: usize = 24;

const MANIFEST: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: assoc, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.60
  ports:
  - {name: sctp, port: 9000, targetPort: 9132, protocol: SCTP, nodePort: 30132}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: assoc-1
  namespace: demo
  labels: {kubernetes.io/service-name: assoc}
addressType: IPv4
ports:
- {name: sctp, port: 9132, protocol: SCTP}
endpoints:
- addresses: ["10.244.1.2"]
  nodeName: node-1
- addresses: ["10.244.2.2"]
  nodeName: node-2
"#;

fn sctp_socket() -> io::Result<Socket> {
    Socket::new(
        Domain::IPV4,
        Type::STREAM,
        Some(Protocol::from(libc::IPPROTO_SCTP)),
    )
}

/// An SCTP server in pod `i` answering each association with `pod{i} {peer}` (the sandbox's echo format), until
/// `stop` is set.
fn serve(sb: &sandbox::Sandbox, i: usize, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let listener = sb
        .pod(i)
        .run(|| -> io::Result<Socket> {
            let s = sctp_socket()?;
            s.set_reuse_address(true)?;
            s.bind(&SockAddr::from(SocketAddr::from((
                Ipv4Addr::UNSPECIFIED,
                TARGET_PORT,
            ))))?;
            s.listen(64)?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .unwrap()
        .expect("an SCTP socket in a pod: does this kernel have SCTP?");
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((conn, peer)) => {
                    let peer = peer
                        .as_socket()
                        .map(|p| p.ip().to_string())
                        .unwrap_or_default();
                    let _ = conn.set_nonblocking(false);
                    let _ = (&conn).write_all(format!("pod{i} {peer}\n").as_bytes());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("accept in pod {i}: {e}"),
            }
        }
    })
}

/// One SCTP association from `ns` to `to`: the answer, read to the end.
fn request(ns: &nftkube_sandbox::netns::NetNs, to: SocketAddr) -> io::Result<String> {
    ns.run(move || {
        let s = sctp_socket()?;
        s.connect_timeout(&SockAddr::from(to), T)?;
        s.set_read_timeout(Some(T))?;
        let mut answer = String::new();
        (&s).read_to_string(&mut answer)?;
        Ok(answer)
    })?
}

/// The endpoints that answered `TRIES` associations and the peers they saw; panics on a failed one.
fn tally(
    ns: &nftkube_sandbox::netns::NetNs,
    to: SocketAddr,
) -> (BTreeSet<usize>, BTreeSet<IpAddr>) {
    let mut pods = BTreeSet::new();
    let mut peers = BTreeSet::new();
    for n in 0..TRIES {
        let answer = request(ns, to).unwrap_or_else(|e| panic!("association {n} to {to}: {e}"));
        let (pod, peer) = sandbox::parse_answer(&answer)
            .unwrap_or_else(|| panic!("association {n} to {to}: answer {answer:?}"));
        pods.insert(pod);
        peers.insert(peer);
    }
    (pods, peers)
}

#[test]
#[ignore = "needs a kernel with SCTP: the VM matrix runs it (--include-ignored)"]
fn sctp_cluster_ip_and_node_port_carry_associations() {
    let sb = sandbox("nk-sctp", 2);
    let stop = Arc::new(AtomicBool::new(false));
    let servers: Vec<_> = (1..=2).map(|i| serve(&sb, i, stop.clone())).collect();
    let m = Manifests::examples();
    m.write("sctp.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    let cluster_ip = addr(CLUSTER_IP, PORT);
    wait_until(SYNC, || request(sb.client(), cluster_ip).is_ok())
        .unwrap_or_else(|_| panic!("{cluster_ip} never answered; log:\n{}", agent.log()));

    // From a pod to the ClusterIP: both endpoints, the pod's own address kept.
    let (pods, peers) = tally(sb.client(), cluster_ip);
    assert_eq!(pods, [1, 2].into(), "ClusterIP from a pod");
    assert_eq!(peers, [IpAddr::from(sandbox::pod_ip_v4(0))].into());

    // From outside to the NodePort: both endpoints, masqueraded to the node's side of their links.
    let node_port = SocketAddr::from((sandbox::node_ip_v4(), NODE_PORT));
    let (pods, peers) = tally(sb.ext(), node_port);
    assert_eq!(pods, [1, 2].into(), "NodePort from outside");
    let node_side: BTreeSet<IpAddr> = (1..=2)
        .map(|i| IpAddr::from(sandbox::pod_gateway_v4(i)))
        .collect();
    assert!(
        peers.is_subset(&node_side),
        "NodePort not masqueraded: {peers:?}"
    );

    stop.store(true, Ordering::Relaxed);
    for s in servers {
        s.join().unwrap();
    }
    drop(agent);
}

/// Userspace mode does not relay SCTP: the service port's addresses are rejected, and the agent says so. The
/// ruleset part needs no SCTP in the kernel (a set element naming protocol 132).
#[test]
fn userspace_mode_rejects_sctp_service_ports_and_says_why() {
    let sb = sandbox("nk-sctpu", 1);
    let m = Manifests::examples();
    m.write("sctp.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &["--proxy-mode", "userspace"]);
    agent.wait_syncs(1, SYNC);
    let t = dump_table(sb.node(), nftkube::nft::ir::Family::Ip).expect("ip nftkube");
    let text = nftkube::nft::text::render_table(&t);
    let rejected = text
        .split("set relay-no-endpoints")
        .nth(1)
        .and_then(|s| s.split('}').next())
        .unwrap_or_else(|| panic!("no relay-no-endpoints set:\n{text}"));
    assert!(
        rejected.contains(&format!("{CLUSTER_IP} . sctp . {PORT}")),
        "{text}"
    );
    assert!(!text.contains("sctp . 9000 :"), "an SCTP redirect:\n{text}");
    let log = agent.log();
    assert!(
        log.contains("userspace mode does not relay SCTP") && log.contains("demo/assoc"),
        "{log}"
    );
}

/// IP_RECVERR: an ICMP error fails the socket at once (SCTP otherwise keeps it as a soft error and retries
/// until its timeout).
fn ask_for_icmp_errors(s: &Socket) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let on: libc::c_int = 1;
    // SAFETY: a valid socket descriptor, and a pointer to a c_int of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_RECVERR,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An SCTP association to such a service is refused at once (ICMP port unreachable, which SCTP reports as
/// ECONNREFUSED on a socket asking for ICMP errors), not left to time out.
#[test]
#[ignore = "needs a kernel with SCTP: the VM matrix runs it (--include-ignored)"]
fn userspace_mode_refuses_sctp_associations() {
    let sb = sandbox("nk-sctpr", 2);
    let stop = Arc::new(AtomicBool::new(false));
    let servers: Vec<_> = (1..=2).map(|i| serve(&sb, i, stop.clone())).collect();
    let m = Manifests::examples();
    m.write("sctp.yaml", MANIFEST);
    let agent = Agent::start(sb.node(), &m.dir, &["--proxy-mode", "userspace"]);
    agent.wait_syncs(1, SYNC);
    let to = addr(CLUSTER_IP, PORT);
    let refused = sb
        .client()
        .run(move || -> io::Result<io::Result<()>> {
            let s = sctp_socket()?;
            ask_for_icmp_errors(&s)?;
            Ok(s.connect_timeout(&SockAddr::from(to), T * 3))
        })
        .unwrap()
        .unwrap();
    let e = refused.expect_err("an SCTP association through userspace mode");
    assert_eq!(
        e.kind(),
        io::ErrorKind::ConnectionRefused,
        "{e}; log:\n{}",
        agent.log()
    );
    stop.store(true, Ordering::Relaxed);
    for s in servers {
        s.join().unwrap();
    }
}
