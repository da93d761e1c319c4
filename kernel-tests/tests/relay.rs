//! The userspace relay with real traffic: the relay runs in the sandbox's node namespace (its runtime threads
//! are created there), clients in the client pod and outside, endpoints in backend pods.

use kernel_tests::sandbox::{self, parse_answer, tcp_request, tcp_requests};
use kernel_tests::*;
use nftkube::model::Protocol;
use nftkube::relay::{Frontend, Relay, RelayError, RelayOptions};
use nftkube_sandbox::netns::NetNs;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(3);

fn relay_in(ns: &NetNs, opts: RelayOptions) -> Relay {
    ns.run(move || Relay::start(&opts))
        .expect("entering the node namespace")
        .expect("starting the relay")
}

fn tcp_frontend(name: &str, listen: SocketAddr, endpoints: Vec<SocketAddr>) -> Frontend {
    Frontend {
        service: name.into(),
        protocol: Protocol::Tcp,
        listen,
        endpoints,
        affinity: None,
        inside: None,
    }
}

fn backend(i: usize, port: u16) -> SocketAddr {
    SocketAddr::from((sandbox::pod_ip_v4(i), port))
}

/// The node's address as the client pod sees it (its gateway).
fn node_from_pod0(port: u16) -> SocketAddr {
    SocketAddr::from((sandbox::pod_gateway_v4(0), port))
}

fn pod_of(answer: &io::Result<String>) -> Option<usize> {
    answer
        .as_ref()
        .ok()
        .and_then(|a| parse_answer(a))
        .map(|(p, _)| p)
}

fn apply(relay: &mut Relay, frontends: &[Frontend]) {
    let errors = relay.apply(frontends);
    assert!(errors.is_empty(), "relay.apply: {errors:?}");
}

/// A TCP server of the test's own in a pod: `handle` runs for each connection on the server thread. Stops
/// (and leaves the namespace) when dropped.
struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn tcp(ns: &NetNs, port: u16, handle: impl Fn(TcpStream) + Send + Sync + 'static) -> Server {
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let handle = Arc::new(handle);
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = ns
            .spawn(move || {
                let l = TcpListener::bind(("0.0.0.0", port)).expect("binding the test server");
                l.set_nonblocking(true).unwrap();
                ready_tx.send(()).unwrap();
                // One thread per connection (spawned here, so inside the pod's namespace).
                let mut conns = Vec::new();
                while !st.load(Ordering::SeqCst) {
                    match l.accept() {
                        Ok((s, _)) => {
                            s.set_nonblocking(false).unwrap();
                            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                            let h = handle.clone();
                            conns.push(std::thread::spawn(move || h(s)));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
                for c in conns {
                    let _ = c.join();
                }
            })
            .expect("starting the test server");
        ready_rx.recv_timeout(T).expect("test server ready");
        Server {
            stop,
            thread: Some(thread),
        }
    }

    /// A UDP echo server (64 KiB buffer) in `ns`.
    fn udp_echo(ns: &NetNs, listen: SocketAddr) -> Server {
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = ns
            .spawn(move || {
                let s = UdpSocket::bind(listen).expect("binding the udp echo server");
                s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                ready_tx.send(()).unwrap();
                let mut buf = vec![0u8; 65_536];
                while !st.load(Ordering::SeqCst) {
                    if let Ok((n, peer)) = s.recv_from(&mut buf) {
                        let _ = s.send_to(&buf[..n], peer);
                    }
                }
            })
            .expect("starting the udp echo server");
        ready_rx.recv_timeout(T).expect("udp echo server ready");
        Server {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn tcp_round_robin_spreads_connections_evenly_over_endpoints() {
    let sb = sandbox("nk-rrr", 3);
    // Under load (parallel tests on two cores) a dial could outlast the first 250 ms timeout and be retried
    // on the next endpoint, which skews the count without any fault in the balancing: one long attempt, so
    // that the count measures round robin alone (and a failed dial fails the test below, not the count).
    let patient = Duration::from_secs(20);
    let opts = RelayOptions {
        dial_timeouts: vec![patient],
        ..RelayOptions::default()
    };
    let mut relay = relay_in(sb.node(), opts);
    let eps = (1..=3).map(|i| backend(i, BACKEND_TCP_PORT)).collect();
    apply(
        &mut relay,
        &[tcp_frontend(
            "default/rr",
            "0.0.0.0:7000".parse().unwrap(),
            eps,
        )],
    );
    let answers = tcp_requests(sb.client(), node_from_pod0(7000), 300, patient);
    let mut counts = [0usize; 3];
    for a in &answers {
        let pod = pod_of(a).unwrap_or_else(|| panic!("bad answer {a:?}"));
        counts[pod - 1] += 1;
    }
    // Round robin is exact: one client, 300 connections, 3 endpoints.
    assert_eq!(counts, [100, 100, 100]);
    // The endpoints see the relay (the node), not the client.
    let (_, peer) = parse_answer(answers[0].as_ref().unwrap()).unwrap();
    assert_eq!(peer, IpAddr::from(sandbox::pod_gateway_v4(1)));
    assert!(relay.stats().accepted.load(Ordering::Relaxed) >= 300);
    assert_eq!(relay.stats().dial_failures.load(Ordering::Relaxed), 0);
}

#[test]
fn client_ip_affinity_sticks_per_client_and_expires() {
    let sb = sandbox("nk-rla", 3);
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    let ttl = Duration::from_millis(1500);
    let mut f = tcp_frontend(
        "default/aff",
        "0.0.0.0:7001".parse().unwrap(),
        (1..=3).map(|i| backend(i, BACKEND_TCP_PORT)).collect(),
    );
    f.affinity = Some(ttl);
    apply(&mut relay, &[f]);
    let pod0 = |k| -> Vec<Option<usize>> {
        tcp_requests(sb.client(), node_from_pod0(7001), k, T)
            .iter()
            .map(pod_of)
            .collect()
    };
    let first = pod0(20);
    assert!(first[0].is_some(), "{first:?}");
    assert!(
        first.iter().all(|p| *p == first[0]),
        "not sticky: {first:?}"
    );
    // Another client (outside, through the node's uplink address) is balanced on its own.
    let ext_dst = SocketAddr::from((sandbox::node_ip_v4(), 7001));
    let ext: Vec<_> = tcp_requests(sb.ext(), ext_dst, 10, T)
        .iter()
        .map(pod_of)
        .collect();
    assert!(
        ext[0].is_some() && ext[0] != first[0],
        "{ext:?} vs {first:?}"
    );
    assert!(ext.iter().all(|p| *p == ext[0]), "not sticky: {ext:?}");
    // Silence longer than the timeout: the next connection is balanced afresh (round robin moves on).
    std::thread::sleep(ttl + Duration::from_millis(300));
    let after = pod0(5);
    assert!(
        after[0].is_some() && after[0] != first[0],
        "{after:?} vs {first:?}"
    );
    assert!(
        after.iter().all(|p| *p == after[0]),
        "not sticky: {after:?}"
    );
}

#[test]
fn a_failed_dial_is_retried_on_the_next_endpoint() {
    let sb = sandbox("nk-rlf", 2);
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    // pod1:9 refuses at once; 10.244.77.2 does not exist (the node's default route leads to ext, which drops
    // it): that dial, the second attempt, times out after 500 ms. Only pod2 answers.
    let refused = backend(1, 9);
    let black_hole = SocketAddr::from(([10, 244, 77, 2], BACKEND_TCP_PORT));
    let live = backend(2, BACKEND_TCP_PORT);
    let mut f = tcp_frontend(
        "default/retry",
        "0.0.0.0:7002".parse().unwrap(),
        vec![refused, black_hole, live],
    );
    f.affinity = Some(Duration::from_secs(60));
    apply(&mut relay, &[f.clone()]);
    let started = Instant::now();
    let first = tcp_request(sb.client(), node_from_pod0(7002), T);
    let first_took = started.elapsed();
    assert_eq!(pod_of(&first), Some(2), "{first:?}");
    // The refusal cost the first attempt nothing; the black hole cost the second its 500 ms timeout; the third
    // attempt got through (not a kernel connect timeout of minutes).
    assert!(first_took >= Duration::from_millis(500), "{first_took:?}");
    assert!(first_took < Duration::from_millis(2500), "{first_took:?}");
    let answers = tcp_requests(sb.client(), node_from_pod0(7002), 5, T);
    for a in &answers {
        assert_eq!(pod_of(a), Some(2), "{answers:?}");
    }
    // Affinity pinned pod2 after the failures: no more retries.
    assert_eq!(relay.stats().dial_failures.load(Ordering::Relaxed), 2);

    // No endpoint answers: the client's connection is reset after the last attempt, nothing hangs.
    f.endpoints = vec![refused];
    f.listen = "0.0.0.0:7003".parse().unwrap();
    f.service = "default/dead".into();
    apply(&mut relay, &[f]);
    let r = tcp_request(sb.client(), node_from_pod0(7003), T);
    let e = r.expect_err("a service whose endpoints all refuse");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
}

#[test]
fn half_close_is_propagated_both_ways() {
    let sb = sandbox("nk-rlh", 1);
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    let (seen_tx, seen_rx) = mpsc::channel::<Vec<u8>>();
    // The endpoint speaks first and closes its sending side, then reads the client's bytes until the client
    // closes its own: only a relay that forwards each FIN separately gets both through.
    let _server = Server::tcp(sb.pod(1), 9000, move |mut s| {
        s.write_all(b"hello").unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        let _ = seen_tx.send(got);
    });
    apply(
        &mut relay,
        &[tcp_frontend(
            "default/half",
            "0.0.0.0:7004".parse().unwrap(),
            vec![backend(1, 9000)],
        )],
    );
    let dst = node_from_pod0(7004);
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let sent = big.clone();
    let first = sb
        .client()
        .run(move || -> io::Result<Vec<u8>> {
            let mut s = TcpStream::connect_timeout(&dst, T)?;
            s.set_read_timeout(Some(T))?;
            let mut got = Vec::new();
            s.read_to_end(&mut got)?; // the endpoint's FIN arrives while our side is still open
            s.write_all(&sent)?;
            s.shutdown(Shutdown::Write)?;
            let mut rest = Vec::new();
            s.read_to_end(&mut rest)?;
            assert!(rest.is_empty());
            Ok(got)
        })
        .unwrap()
        .expect("client exchange");
    assert_eq!(first, b"hello");
    let seen = seen_rx
        .recv_timeout(T)
        .expect("the endpoint saw the client's FIN");
    assert_eq!(seen.len(), big.len());
    assert!(seen == big, "the bytes arrived altered");
}

/// Sends `payload` from a fresh socket in the calling thread's namespace to `dst` and returns the reply and
/// the address it came from.
fn udp_exchange(dst: SocketAddr, payload: &[u8]) -> io::Result<(Vec<u8>, SocketAddr)> {
    let any: SocketAddr = if dst.is_ipv4() {
        "0.0.0.0:0".parse().unwrap()
    } else {
        "[::]:0".parse().unwrap()
    };
    let s = UdpSocket::bind(any)?;
    s.set_read_timeout(Some(T))?;
    s.send_to(payload, dst)?;
    let mut buf = vec![0u8; 65_536];
    let (n, from) = s.recv_from(&mut buf)?;
    buf.truncate(n);
    Ok((buf, from))
}

#[test]
fn udp_datagrams_of_64_kib_arrive_intact_and_replies_come_from_the_address_used() {
    let sb = sandbox("nk-rlu", 1);
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    let _v4 = Server::udp_echo(sb.pod(1), "0.0.0.0:9001".parse().unwrap());
    let _v6 = Server::udp_echo(sb.pod(1), "[::]:9002".parse().unwrap());
    let udp = |listen: &str, ep: SocketAddr| Frontend {
        service: "default/dns".into(),
        protocol: Protocol::Udp,
        listen: listen.parse().unwrap(),
        endpoints: vec![ep],
        affinity: None,
        inside: None,
    };
    apply(
        &mut relay,
        &[
            udp("0.0.0.0:7005", backend(1, 9001)),
            udp("[::]:7005", SocketAddr::from((sandbox::pod_ip_v6(1), 9002))),
        ],
    );
    // The largest payloads IPv4 and IPv6 carry (65 535 minus headers), and a small one.
    let cases = [
        (node_from_pod0(7005), 3usize),
        (node_from_pod0(7005), 65_507),
        (SocketAddr::from((sandbox::pod_gateway_v6(0), 7005)), 65_527),
    ];
    for (dst, len) in cases {
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
        let sent = payload.clone();
        let (reply, from) = sb
            .client()
            .run(move || udp_exchange(dst, &sent))
            .unwrap()
            .unwrap_or_else(|e| panic!("{len} bytes to {dst}: {e}"));
        assert_eq!(reply.len(), len, "to {dst}");
        assert!(reply == payload, "{len} bytes to {dst} came back altered");
        assert_eq!(
            from, dst,
            "the reply must come from the address the client sent to"
        );
    }
    // The node's other address (ext's side) is answered from that address.
    let dst = SocketAddr::from((sandbox::node_ip_v4(), 7005));
    let (reply, from) = sb
        .ext()
        .run(move || udp_exchange(dst, b"ping"))
        .unwrap()
        .unwrap();
    assert_eq!((reply.as_slice(), from), (&b"ping"[..], dst));
}

/// A long-lived connection: sends a line, reads the endpoint's echo line.
struct Line {
    s: TcpStream,
}

impl Line {
    fn open(ns: &NetNs, dst: SocketAddr) -> Line {
        ns.run(move || Line::open_here(dst))
            .unwrap()
            .expect("connecting")
    }
    fn open_here(dst: SocketAddr) -> io::Result<Line> {
        let s = TcpStream::connect_timeout(&dst, T)?;
        s.set_read_timeout(Some(T))?;
        Ok(Line { s })
    }
    /// The endpoint's name, or the error the connection ended with.
    fn ask(&mut self) -> io::Result<String> {
        self.s.write_all(b"?\n")?;
        let mut buf = [0u8; 64];
        let n = self.s.read(&mut buf)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
    }
}

/// In pod `i`, a server answering each line with `pod{i}` until the client closes.
fn line_server(sb: &sandbox::Sandbox, i: usize, port: u16) -> Server {
    Server::tcp(sb.pod(i), port, move |mut s| {
        let mut buf = [0u8; 64];
        while matches!(s.read(&mut buf), Ok(n) if n > 0) {
            if s.write_all(format!("pod{i}\n").as_bytes()).is_err() {
                break;
            }
        }
    })
}

#[test]
fn endpoint_changes_keep_connections_to_remaining_endpoints_and_close_the_others() {
    let sb = sandbox("nk-rlc", 3);
    let _servers: Vec<Server> = (1..=3).map(|i| line_server(&sb, i, 9003)).collect();
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    let listen: SocketAddr = "0.0.0.0:7006".parse().unwrap();
    let eps = |pods: &[usize]| pods.iter().map(|&i| backend(i, 9003)).collect::<Vec<_>>();
    apply(
        &mut relay,
        &[tcp_frontend("default/lines", listen, eps(&[1, 2]))],
    );
    let dst = node_from_pod0(7006);
    // One at a time: the relay picks an endpoint when it handles a connection, and connections accepted
    // together may be handled in either order.
    let mut lines = Vec::new();
    let mut names = Vec::new();
    for _ in 0..4 {
        let mut l = Line::open(sb.client(), dst);
        names.push(l.ask().unwrap());
        lines.push(l);
    }
    assert_eq!(names, ["pod1", "pod2", "pod1", "pod2"]);
    assert_eq!(relay.live_connections(), 4);

    apply(
        &mut relay,
        &[tcp_frontend("default/lines", listen, eps(&[1, 3]))],
    );
    for (line, name) in lines.iter_mut().zip(&names) {
        let r = line.ask();
        if name == "pod1" {
            assert_eq!(
                r.unwrap(),
                "pod1",
                "a connection to a remaining endpoint was disturbed"
            );
        } else {
            assert!(
                r.is_err(),
                "a connection to a removed endpoint survived: {r:?}"
            );
        }
    }
    // New connections go to the new set only.
    let mut fresh: Vec<String> = (0..4)
        .map(|_| Line::open(sb.client(), dst).ask().unwrap())
        .collect();
    fresh.sort();
    assert_eq!(fresh, ["pod1", "pod1", "pod3", "pod3"]);
}

#[test]
fn churn_during_traffic_disturbs_only_connections_to_removed_endpoints() {
    let sb = sandbox("nk-rlx", 3);
    let _lines: Vec<Server> = (1..=3).map(|i| line_server(&sb, i, 9003)).collect();
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    // pod1 stays throughout; pod2 and pod3 come and go. Two services churn alike: one taking short requests,
    // one holding a long connection.
    let sets: [&[usize]; 4] = [&[1], &[1, 2], &[1, 2, 3], &[1, 3]];
    let frontends = |pods: &[usize]| {
        let eps = |port| pods.iter().map(|&i| backend(i, port)).collect::<Vec<_>>();
        [
            tcp_frontend(
                "default/churn",
                "0.0.0.0:7007".parse().unwrap(),
                eps(BACKEND_TCP_PORT),
            ),
            tcp_frontend("default/long", "0.0.0.0:7011".parse().unwrap(), eps(9003)),
        ]
    };
    apply(&mut relay, &frontends(sets[0]));
    let mut long = Line::open(sb.client(), node_from_pod0(7011));
    assert_eq!(long.ask().unwrap(), "pod1");
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let dst = node_from_pod0(7007);
    let client = sb
        .client()
        .spawn(move || {
            let mut results = Vec::new();
            while !st.load(Ordering::SeqCst) {
                results.push(sandbox::tcp_request_here(dst, T));
            }
            results
        })
        .unwrap();
    for round in 1..=40 {
        apply(&mut relay, &frontends(sets[round % sets.len()]));
        std::thread::sleep(Duration::from_millis(25));
        if round % 10 == 0 {
            assert_eq!(
                long.ask().unwrap(),
                "pod1",
                "the long connection to pod1 was disturbed"
            );
        }
    }
    stop.store(true, Ordering::SeqCst);
    let results = client.join().unwrap();
    let failures = results.iter().filter(|r| pod_of(r).is_none()).count();
    let closed = relay
        .stats()
        .closed_by_endpoint_removal
        .load(Ordering::Relaxed) as usize;
    assert!(
        results.len() > 10,
        "only {} requests went through",
        results.len()
    );
    // A request fails only when its endpoint was removed while it was in flight.
    assert!(
        failures <= closed,
        "{failures} of {} requests failed, only {closed} connections were closed for a removed endpoint",
        results.len()
    );
    assert!(
        failures * 20 <= results.len(),
        "{failures} of {} failed",
        results.len()
    );
}

#[test]
fn bad_frontends_are_reported_and_the_others_keep_working() {
    let sb = sandbox("nk-rlb", 1);
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    let good = tcp_frontend(
        "default/good",
        "0.0.0.0:7008".parse().unwrap(),
        vec![backend(1, BACKEND_TCP_PORT)],
    );
    // Held by someone else in the node namespace.
    let _squatter = sb
        .node()
        .run(|| TcpListener::bind("0.0.0.0:7009"))
        .unwrap()
        .unwrap();
    let taken = tcp_frontend("default/taken", "0.0.0.0:7009".parse().unwrap(), vec![]);
    let mut sctp = tcp_frontend("default/sctp", "0.0.0.0:7010".parse().unwrap(), vec![]);
    sctp.protocol = Protocol::Sctp;
    let errors = relay.apply(&[good, taken, sctp]);
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, RelayError::Listen { service, source, .. }
            if service == "default/taken" && source.raw_os_error() == Some(libc::EADDRINUSE))),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e
            .to_string()
            .starts_with("default/taken: cannot listen on tcp 0.0.0.0:7009")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(
            |e| matches!(e, RelayError::Unsupported { service, .. } if service == "default/sctp")
        ),
        "{errors:?}"
    );
    assert_eq!(relay.listeners(), 1);
    let a = tcp_request(sb.client(), node_from_pod0(7008), T);
    assert_eq!(pod_of(&a), Some(1), "{a:?}");
}

/// NodePort services for the agent tests: TCP+UDP (IPv4) on the sandbox's backends, an IPv6 one, and one
/// whose endpoints hold connections open (the line servers on 9003).
const NODE_PORTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.30
  ports:
  - {name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}
  - {name: udp, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: demo
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: tcp, port: 8080, protocol: TCP}
- {name: udp, port: 5353, protocol: UDP}
endpoints:
- addresses: ["10.244.1.2"]
- addresses: ["10.244.2.2"]
- addresses: ["10.244.3.2"]
---
apiVersion: v1
kind: Service
metadata: {name: web6, namespace: demo}
spec:
  type: NodePort
  clusterIP: fd00:96::30
  ipFamilies: [IPv6]
  ports:
  - {name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30090}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web6-1
  namespace: demo
  labels: {kubernetes.io/service-name: web6}
addressType: IPv6
ports:
- {name: tcp, port: 8080, protocol: TCP}
endpoints:
- addresses: ["fd00:244:0:1::2"]
---
apiVersion: v1
kind: Service
metadata: {name: lines, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.31
  ports:
  - {name: tcp, port: 80, targetPort: 9003, protocol: TCP, nodePort: 30100}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: lines-1
  namespace: demo
  labels: {kubernetes.io/service-name: lines}
addressType: IPv4
ports:
- {name: tcp, port: 9003, protocol: TCP}
endpoints:
- addresses: ["10.244.1.2"]
- addresses: ["10.244.2.2"]
"#;

const SYNC: Duration = Duration::from_secs(15);

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[test]
fn localhost_node_ports_are_served_to_the_node_itself() {
    let sb = sandbox("nk-rll", 3);
    let m = Manifests::examples();
    m.write("nodeports.yaml", NODE_PORTS);
    // Another process holds the NodePort of `lines` on loopback: its listener cannot be opened.
    let _taken = sb
        .node()
        .run(|| TcpListener::bind("127.0.0.1:30100"))
        .unwrap()
        .expect("binding 127.0.0.1:30100");
    let agent = Agent::start(
        sb.node(),
        &m.dir,
        &["--nodeport-addresses", "127.0.0.0/8,::1/128"],
    );
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || served(sb.node(), loopback(30080), T))
        .expect("127.0.0.1:30080 never served");
    // Round robin over the three endpoints, from the node's own loopback.
    let answers = tcp_requests(sb.node(), loopback(30080), 30, T);
    let mut counts = [0usize; 3];
    for a in &answers {
        counts[pod_of(a).unwrap_or_else(|| panic!("{a:?}")) - 1] += 1;
    }
    assert_eq!(counts, [10, 10, 10]);
    // UDP, and IPv6 on ::1.
    let udp = sandbox::udp_request(sb.node(), loopback(30053), T).expect("udp on 127.0.0.1:30053");
    assert!(parse_answer(&udp).is_some(), "{udp:?}");
    let v6 = tcp_request(sb.node(), "[::1]:30090".parse().unwrap(), T).expect("tcp on [::1]:30090");
    assert_eq!(parse_answer(&v6).map(|(p, _)| p), Some(1), "{v6:?}");
    // Only loopback was asked for: the node's uplink address does not serve NodePorts.
    let outside = SocketAddr::from((sandbox::node_ip_v4(), 30080));
    assert!(!served(sb.ext(), outside, Duration::from_millis(500)));
    // KEP-6032's metrics: the listeners open per family, and the one that could not be opened.
    let listeners = |s: &[Sample], family| {
        sample(
            s,
            "kubeproxy_nftables_localhost_nodeport_listeners",
            &[("ip_family", family)],
        )
        .unwrap()
    };
    let metrics = scrape(&sb);
    let failures = "kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total";
    assert!(
        sample(&metrics, failures, &[("ip_family", "IPv4")]) >= Some(1.0),
        "{metrics:?}"
    );
    assert_eq!(
        sample(&metrics, failures, &[("ip_family", "IPv6")]),
        Some(0.0)
    );
    let (v4, v6) = (listeners(&metrics, "IPv4"), listeners(&metrics, "IPv6"));
    assert!(v6 >= 1.0, "{metrics:?}");

    // The service goes: so does its listener.
    let without_web: String = NODE_PORTS
        .split("---")
        .skip(2)
        .collect::<Vec<_>>()
        .join("---");
    m.write("nodeports.yaml", &without_web);
    wait_until(SYNC, || {
        matches!(tcp_request(sb.node(), loopback(30080), T), Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
    })
    .expect("127.0.0.1:30080 still served after the service was deleted");
    assert!(served(sb.node(), "[::1]:30090".parse().unwrap(), T));
    // Its TCP and UDP listeners went; the IPv6 ones stayed.
    let metrics = scrape(&sb);
    assert_eq!(listeners(&metrics, "IPv4"), v4 - 2.0, "{metrics:?}");
    assert_eq!(listeners(&metrics, "IPv6"), v6);
}

/// Runs the agent with at most `limit` open files (soft and hard).
fn agent_with_nofile_limit(
    ns: &NetNs,
    manifests: &std::path::Path,
    limit: u64,
    extra: &[&str],
) -> Agent {
    use std::os::unix::process::CommandExt;
    let mut cmd = ns.command(nftkube_bin());
    cmd.args(proxy_args(manifests, extra));
    // SAFETY: runs in the forked child before exec and only calls setrlimit, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Agent::spawn(cmd, ns)
}

#[test]
fn running_out_of_file_descriptors_backs_off_and_recovers_without_a_panic() {
    let sb = sandbox("nk-rle", 2);
    let _lines: Vec<Server> = (1..=2).map(|i| line_server(&sb, i, 9003)).collect();
    let m = Manifests::examples();
    m.write("nodeports.yaml", NODE_PORTS);
    let mut agent = agent_with_nofile_limit(
        sb.node(),
        &m.dir,
        128,
        &["--nodeport-addresses", "127.0.0.0/8"],
    );
    agent.wait_syncs(1, SYNC);
    let dst = loopback(30100);
    wait_until(SYNC, || {
        sb.node()
            .run(|| Line::open_here(dst).and_then(|mut l| l.ask()))
            .unwrap()
            .is_ok()
    })
    .expect("127.0.0.1:30100 never served");
    // Far more long connections than 128 descriptors allow (each relayed one costs two).
    let held: Vec<TcpStream> = sb
        .node()
        .run(|| {
            (0..150)
                .filter_map(|_| TcpStream::connect_timeout(&dst, T).ok())
                .collect()
        })
        .unwrap();
    assert!(held.len() > 64, "only {} connections opened", held.len());
    wait_until(SYNC, || agent.log().contains("out of file descriptors"))
        .expect("the agent never reported running out of file descriptors");
    assert!(agent.running(), "the agent died:\n{}", agent.log());
    drop(held);
    // Descriptors come back: new connections are relayed again.
    wait_until(SYNC, || {
        sb.node()
            .run(|| Line::open_here(dst).and_then(|mut l| l.ask()))
            .unwrap()
            .is_ok()
    })
    .expect("no recovery after the connections closed");
    assert!(agent.running(), "the agent died:\n{}", agent.log());
    assert!(!agent.log().contains("panicked"), "{}", agent.log());
}

/// The examples' ClusterIPs (echo: TCP 80 and UDP 53 on pods 1-3, echo6 on IPv6) through the relay.
const ECHO_V4: &str = "10.96.0.10";
const ECHO_V6: &str = "fd00:96::10";

#[test]
fn userspace_mode_relays_cluster_ips_and_node_ports_through_one_redirect_map() {
    let sb = sandbox("nk-rlm", 3);
    let m = Manifests::examples();
    m.write("nodeports.yaml", NODE_PORTS);
    // Bad input, as in the other modes: logged by file and name, skipped; everything else is served.
    m.write(
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: broken\n  namespace: demo\nspec:\n  clusterIP: 10.96.0.300\n  ports:\n  - port: 80\n",
    );
    let agent = Agent::start(sb.node(), &m.dir, &["--proxy-mode", "userspace"]);
    agent.wait_syncs(1, SYNC);
    let echo = addr(ECHO_V4, 80);
    wait_until(SYNC, || served(sb.client(), echo, T)).expect("ClusterIP never served");
    let log = agent.log();
    assert!(
        log.contains("broken.yaml") && log.contains("demo/broken"),
        "{log}"
    );

    // From a pod: exact round robin over the three endpoints, which see the node (the relay), not the pod.
    let answers = tcp_requests(sb.client(), echo, 30, T);
    let mut counts = [0usize; 3];
    for a in &answers {
        let (pod, peer) = parse_answer(a.as_ref().unwrap()).unwrap();
        counts[pod - 1] += 1;
        assert_eq!(peer, IpAddr::from(sandbox::pod_gateway_v4(pod)));
    }
    assert_eq!(counts, [10, 10, 10]);
    // UDP: the reply comes back from the ClusterIP and port the client sent to.
    let dns = addr(ECHO_V4, 53);
    let (reply, from) = sb
        .client()
        .run(move || udp_exchange(dns, b"hi"))
        .unwrap()
        .expect("udp through the relay");
    assert!(parse_answer(&String::from_utf8_lossy(&reply)).is_some());
    assert_eq!(from, dns);
    // IPv6, from the node itself (nat output: redirected to loopback), and a NodePort from outside.
    assert!(served(sb.client(), addr(ECHO_V6, 80), T), "IPv6 ClusterIP");
    assert!(served(sb.node(), echo, T), "ClusterIP from the node itself");
    let node_port = SocketAddr::from((sandbox::node_ip_v4(), 30080));
    assert!(served(sb.ext(), node_port, T), "NodePort from outside");

    // The kernel holds one redirect map and one element per frontend, no chain per service.
    let t = dump_table(sb.node(), nftkube::nft::ir::Family::Ip).expect("ip nftkube");
    let text = nftkube::nft::text::render_table(&t);
    // nat prerouting and output, filter input, forward and output, and the reject chain.
    assert_eq!(t.chains.len(), 6, "{text}");
    assert!(
        text.contains("redirect to :ip daddr . meta l4proto . th dport map @relay-ports"),
        "{text}"
    );
    // The relay's port for the ClusterIP answers only redirected connections: not from outside, not from a
    // pod dialling the node's address, while the ClusterIP still works.
    let relay_port = relay_port_of(&text, "10.96.0.10 . tcp . 80 : ");
    let direct_ext = SocketAddr::from((sandbox::node_ip_v4(), relay_port));
    let direct_pod = node_from_pod0(relay_port);
    assert!(
        !served(sb.ext(), direct_ext, Duration::from_millis(500)),
        "relay port {relay_port} reachable from outside"
    );
    assert!(
        !served(sb.client(), direct_pod, Duration::from_millis(500)),
        "relay port {relay_port} reachable from a pod"
    );
    assert!(served(sb.client(), echo, T), "ClusterIP from a pod");

    // A service deleted: its frontend stops answering (the redirect element goes, the listener closes).
    m.write(
        "nodeports.yaml",
        &NODE_PORTS
            .split("---")
            .skip(2)
            .collect::<Vec<_>>()
            .join("---"),
    );
    wait_until(SYNC, || {
        !served(sb.ext(), node_port, Duration::from_millis(300))
    })
    .expect("the NodePort of a deleted service is still served");
    assert!(served(sb.client(), echo, T));
}

#[test]
fn userspace_node_ports_listen_on_the_nodeport_addresses_only() {
    let sb = sandbox("nk-rln", 3);
    let m = Manifests::examples();
    m.write("nodeports.yaml", NODE_PORTS);
    let only_node_ip = format!("{}/32", sandbox::node_ip_v4());
    let agent = Agent::start(
        sb.node(),
        &m.dir,
        &[
            "--proxy-mode",
            "userspace",
            "--nodeport-addresses",
            &only_node_ip,
        ],
    );
    agent.wait_syncs(1, SYNC);
    let node_port = SocketAddr::from((sandbox::node_ip_v4(), 30080));
    wait_until(SYNC, || served(sb.ext(), node_port, T))
        .expect("NodePort on the node IP never served");
    // The node's address on the pods' side is not a NodePort address: nothing answers there.
    let other = node_from_pod0(30080);
    assert!(!served(sb.client(), other, T), "NodePort served on {other}");
    assert!(
        served(sb.client(), addr(ECHO_V4, 80), T),
        "ClusterIP from a pod"
    );
    // The admin server says which proxy runs.
    let (status, _, mode) = sb
        .node()
        .run(|| nftkube::admin::http::get(addr("127.0.0.1", 10249), "/proxyMode", T))
        .unwrap()
        .expect("/proxyMode");
    assert_eq!((status, mode.as_str()), (200, "userspace"));
}

/// A service with a TCP and a UDP port and no endpoints.
const EMPTY_SERVICE: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: demo}
spec:
  clusterIP: 10.96.0.40
  ports:
  - {name: tcp, port: 80, protocol: TCP}
  - {name: udp, port: 53, protocol: UDP}
"#;

#[test]
fn userspace_services_without_endpoints_are_rejected_tcp_by_reset_udp_by_icmp() {
    let sb = sandbox("nk-rl0", 1);
    let m = Manifests::examples();
    m.write("empty.yaml", EMPTY_SERVICE);
    let agent = Agent::start(sb.node(), &m.dir, &["--proxy-mode", "userspace"]);
    agent.wait_syncs(1, SYNC);
    wait_until(SYNC, || served(sb.client(), addr(ECHO_V4, 80), T)).expect("ClusterIP never served");
    let tcp = addr("10.96.0.40", 80);
    let udp = addr("10.96.0.40", 53);
    // From the node itself the rejected datagram never leaves: its send fails at once (EPERM).
    let udp_refusals = [
        (sb.client(), vec![io::ErrorKind::ConnectionRefused]),
        (
            sb.node(),
            vec![
                io::ErrorKind::ConnectionRefused,
                io::ErrorKind::PermissionDenied,
            ],
        ),
    ];
    for (from, udp_expected) in udp_refusals {
        let connected = from
            .run(move || TcpStream::connect_timeout(&tcp, T).map(drop))
            .unwrap();
        let refused = connected.as_ref().map_err(io::Error::kind);
        assert_eq!(
            refused,
            Err(io::ErrorKind::ConnectionRefused),
            "TCP to {tcp}"
        );
        // ICMP port unreachable: a connected UDP socket's next receive reports it.
        let answered = from
            .run(move || -> io::Result<usize> {
                let s = UdpSocket::bind("0.0.0.0:0")?;
                s.connect(udp)?;
                s.set_read_timeout(Some(T))?;
                s.send(b"hi")?;
                s.recv(&mut [0u8; 64])
            })
            .unwrap();
        let refused = answered.as_ref().map_err(io::Error::kind);
        assert!(
            refused.is_err_and(|k| udp_expected.contains(&k)),
            "UDP to {udp}: {answered:?}"
        );
    }
}

/// The relay port a `relay-ports` element maps `key` (as nft lists it, "addr . tcp . port : ") to.
fn relay_port_of(listing: &str, key: &str) -> u16 {
    let at = listing
        .find(key)
        .unwrap_or_else(|| panic!("{key} not in {listing}"))
        + key.len();
    let digits: String = listing[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no port after {key} in {listing}"))
}

#[test]
fn udp_flows_keep_their_endpoint_until_idle_unless_it_is_removed() {
    let sb = sandbox("nk-rlv", 2);
    let opts = RelayOptions {
        udp_idle_timeout: Duration::from_millis(700),
        ..RelayOptions::default()
    };
    let mut relay = relay_in(sb.node(), opts);
    let listen: SocketAddr = "0.0.0.0:7012".parse().unwrap();
    let frontend = |pods: &[usize]| Frontend {
        service: "default/dns".into(),
        protocol: Protocol::Udp,
        listen,
        endpoints: pods.iter().map(|&i| backend(i, BACKEND_UDP_PORT)).collect(),
        affinity: None,
        inside: None,
    };
    apply(&mut relay, &[frontend(&[1])]);
    let dst = node_from_pod0(7012);
    // Two clients, each one socket (one flow), asking in turns.
    let (a, b) = sb
        .client()
        .run(|| -> io::Result<(UdpSocket, UdpSocket)> {
            let open = || -> io::Result<UdpSocket> {
                let s = UdpSocket::bind("0.0.0.0:0")?;
                s.connect(dst)?;
                s.set_read_timeout(Some(T))?;
                Ok(s)
            };
            Ok((open()?, open()?))
        })
        .unwrap()
        .unwrap();
    let ask = |s: &UdpSocket| -> Option<usize> {
        s.send(b"hi").ok()?;
        let mut buf = [0u8; 128];
        let n = s.recv(&mut buf).ok()?;
        parse_answer(&String::from_utf8_lossy(&buf[..n])).map(|(p, _)| p)
    };
    assert_eq!(ask(&a), Some(1));
    // A new endpoint, first in the list (where round robin starts): the live flow stays where it is, a new
    // client's flow goes to the new endpoint.
    apply(&mut relay, &[frontend(&[2, 1])]);
    assert_eq!(ask(&a), Some(1));
    assert_eq!(ask(&b), Some(2));
    assert_eq!(ask(&a), Some(1));
    assert_eq!(relay.live_connections(), 2);
    // pod1 removed: its flow is closed, and that client's next datagram opens a flow to pod2.
    apply(&mut relay, &[frontend(&[2])]);
    assert_eq!(ask(&a), Some(2));
    assert_eq!(ask(&b), Some(2));
    // Idle past the timeout: both flows are gone.
    assert!(
        wait_until(Duration::from_secs(5), || relay.live_connections() == 0).is_ok(),
        "{} flows still open after the idle timeout",
        relay.live_connections()
    );
}

#[test]
fn at_the_connection_limit_a_new_client_is_reset_at_once_and_served_once_one_closes() {
    let sb = sandbox("nk-rlk", 1);
    let _lines = line_server(&sb, 1, 9003);
    let opts = RelayOptions {
        max_connections: 2,
        ..RelayOptions::default()
    };
    let mut relay = relay_in(sb.node(), opts);
    apply(
        &mut relay,
        &[tcp_frontend(
            "default/limited",
            "0.0.0.0:7013".parse().unwrap(),
            vec![backend(1, 9003)],
        )],
    );
    let dst = node_from_pod0(7013);
    let mut first = Line::open(sb.client(), dst);
    let mut second = Line::open(sb.client(), dst);
    assert_eq!(first.ask().unwrap(), "pod1");
    assert_eq!(second.ask().unwrap(), "pod1");
    // The third is accepted and reset: the client learns at once, nothing waits in a backlog.
    assert!(
        refused(&sb, dst),
        "a third connection was relayed over a limit of 2"
    );
    assert_eq!(relay.live_connections(), 2);
    assert_eq!(relay.stats().refused_total_limit.load(Ordering::Relaxed), 1);
    // One closes: the next client is served.
    drop(first);
    wait_until(T, || relay.live_connections() == 1).expect("the closed connection's place back");
    let mut fourth = Line::open(sb.client(), dst);
    assert_eq!(fourth.ask().unwrap(), "pod1");
    assert_eq!(second.ask().unwrap(), "pod1");
}

#[test]
fn a_limit_smaller_than_the_number_of_listeners_still_lets_each_accept() {
    let sb = sandbox("nk-rlp", 1);
    let _lines = line_server(&sb, 1, 9004);
    let opts = RelayOptions {
        max_connections: 2,
        ..RelayOptions::default()
    };
    let mut relay = relay_in(sb.node(), opts);
    let ports = 7020..7026u16;
    let frontends: Vec<_> = ports
        .clone()
        .map(|p| {
            tcp_frontend(
                &format!("default/svc{p}"),
                SocketAddr::from(([0, 0, 0, 0], p)),
                vec![backend(1, 9004)],
            )
        })
        .collect();
    apply(&mut relay, &frontends);
    // Six listeners, two places, no traffic before: each service answers its client in turn.
    for p in ports {
        let mut line = Line::open(sb.client(), node_from_pod0(p));
        assert_eq!(line.ask().unwrap(), "pod1", "listener on port {p}");
        // The next client comes once this one's place is free: the relay frees it when it sees the close,
        // which under load can lag behind the next connection (and two lagging closes filled both places).
        drop(line);
        wait_until(T, || relay.live_connections() == 0).expect("the connection never ended");
    }
}

#[test]
fn applying_one_service_touches_its_listeners_only() {
    let sb = sandbox("nk-rls", 1);
    let _lines = line_server(&sb, 1, 9007);
    let mut relay = relay_in(sb.node(), RelayOptions::default());
    let fe = |name: &str, port: u16| {
        tcp_frontend(
            name,
            SocketAddr::from(([0, 0, 0, 0], port)),
            vec![backend(1, 9007)],
        )
    };
    // "default/web2" extends "default/web" as a string: it is another service all the same.
    apply(
        &mut relay,
        &[
            fe("default/web:http", 7040),
            fe("default/web (NodePort)", 7041),
            fe("default/web2:http", 7042),
        ],
    );
    let mut kept = Line::open(sb.client(), node_from_pod0(7042));
    assert_eq!(kept.ask().unwrap(), "pod1");
    // default/web changes: one listener goes, one comes; default/web2 and its connection are untouched.
    let errors = relay.apply_service("default/web", &[fe("default/web:http", 7043)]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(relay.listeners(), 2);
    assert!(refused(&sb, node_from_pod0(7040)));
    assert!(refused(&sb, node_from_pod0(7041)));
    assert_eq!(
        Line::open(sb.client(), node_from_pod0(7043)).ask().unwrap(),
        "pod1"
    );
    assert_eq!(kept.ask().unwrap(), "pod1");
    // A deleted service: all of its listeners go.
    assert!(relay.apply_service("default/web", &[]).is_empty());
    assert_eq!(relay.listeners(), 1);
    assert_eq!(kept.ask().unwrap(), "pod1");
}

/// Whether a connection from the client pod to `dst` is reset, at connect (the reset can arrive before
/// `connect` returns) or at its first request, instead of answered.
fn refused(sb: &sandbox::Sandbox, dst: SocketAddr) -> bool {
    sb.client()
        .run(move || Line::open_here(dst).and_then(|mut l| l.ask()))
        .unwrap()
        .is_err()
}

/// `n` datagrams to `dst`, each from a fresh source port (a new flow each), from the client pod.
fn udp_flood(sb: &sandbox::Sandbox, dst: SocketAddr, n: usize) {
    sb.client()
        .run(move || -> io::Result<()> {
            for _ in 0..n {
                UdpSocket::bind("0.0.0.0:0")?.send_to(b"flood", dst)?;
            }
            Ok(())
        })
        .unwrap()
        .unwrap();
}

#[test]
fn a_flood_of_udp_sources_to_one_service_never_blocks_another_beyond_the_udp_timeout() {
    let sb = sandbox("nk-rlq", 1);
    let _lines = line_server(&sb, 1, 9005);
    let udp_timeout = Duration::from_millis(1500);
    let flooded = |max_per_service| {
        let opts = RelayOptions {
            max_connections: 4,
            max_connections_per_service: max_per_service,
            udp_idle_timeout: udp_timeout,
            ..RelayOptions::default()
        };
        let mut relay = relay_in(sb.node(), opts);
        let dns = Frontend {
            service: "default/dns".into(),
            protocol: Protocol::Udp,
            listen: "0.0.0.0:7030".parse().unwrap(),
            endpoints: vec![backend(1, BACKEND_UDP_PORT)],
            // Hours of affinity must not keep flows (and their places) alive: only the balancer keeps it.
            affinity: Some(Duration::from_secs(3 * 3600)),
            inside: None,
        };
        let web = tcp_frontend(
            "default/web",
            "0.0.0.0:7031".parse().unwrap(),
            vec![backend(1, 9005)],
        );
        apply(&mut relay, &[dns, web]);
        udp_flood(&sb, node_from_pod0(7030), 30);
        // Each flood flow takes a place until the service's share (or the relay) is full.
        wait_until(T, || relay.live_connections() == max_per_service).expect("flood flows opened");
        relay
    };
    let web = node_from_pod0(7031);
    // A per-service limit below the total: the flood takes its service's share, the other is served at once.
    let relay = flooded(2);
    assert_eq!(relay.live_connections(), 2);
    assert_eq!(Line::open(sb.client(), web).ask().unwrap(), "pod1");
    drop(relay);
    // No per-service limit: the flood takes every place, and the other service is refused only until the
    // flows idle out.
    let relay = flooded(4);
    assert_eq!(relay.live_connections(), 4);
    assert!(refused(&sb, web));
    let freed = wait_until(udp_timeout * 3, || relay.live_connections() == 0)
        .expect("the flood's flows outlived the udp timeout");
    assert!(freed <= udp_timeout + Duration::from_secs(1), "{freed:?}");
    assert_eq!(Line::open(sb.client(), web).ask().unwrap(), "pod1");
}

#[test]
fn an_idle_tcp_connection_is_closed_after_its_timeout_and_a_talking_one_is_not() {
    let sb = sandbox("nk-rli", 1);
    let _lines = line_server(&sb, 1, 9006);
    let idle_timeout = Duration::from_secs(1);
    let opts = RelayOptions {
        tcp_idle_timeout: idle_timeout,
        ..RelayOptions::default()
    };
    let mut relay = relay_in(sb.node(), opts);
    apply(
        &mut relay,
        &[tcp_frontend(
            "default/idle",
            "0.0.0.0:7032".parse().unwrap(),
            vec![backend(1, 9006)],
        )],
    );
    let dst = node_from_pod0(7032);
    let mut idle = Line::open(sb.client(), dst);
    let mut talking = Line::open(sb.client(), dst);
    assert_eq!(idle.ask().unwrap(), "pod1");
    // The talking one speaks every 300 ms for three timeouts.
    let start = Instant::now();
    while start.elapsed() < idle_timeout * 3 {
        assert_eq!(
            talking.ask().unwrap(),
            "pod1",
            "after {:?}",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    // The idle one was reset: the client reads an error (or end of stream), not a hang.
    let mut buf = [0u8; 16];
    let read = idle.s.read(&mut buf);
    assert!(matches!(read, Err(_) | Ok(0)), "{read:?}");
    assert_eq!(relay.stats().closed_idle.load(Ordering::Relaxed), 1);
    assert_eq!(relay.live_connections(), 1);
}

/// Traffic policies in userspace mode. `itp`: internalTrafficPolicy Local; `etp`: externalTrafficPolicy
/// Local on a LoadBalancer; `elsewhere`: both Local, its only endpoint on another node. The agent is
/// `node-1`; pod1 is on it, pod2 on `node-2`.
const POLICIES: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: itp, namespace: demo}
spec:
  clusterIP: 10.96.0.70
  internalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: itp-1, namespace: demo, labels: {kubernetes.io/service-name: itp}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], nodeName: node-1}
- {addresses: ["10.244.2.2"], nodeName: node-2}
---
apiVersion: v1
kind: Service
metadata: {name: etp, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.71
  externalIPs: ["192.168.250.71"]
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30120}]
status:
  loadBalancer:
    ingress: [{ip: 192.168.250.70}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: etp-1, namespace: demo, labels: {kubernetes.io/service-name: etp}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.1.2"], nodeName: node-1}
- {addresses: ["10.244.2.2"], nodeName: node-2}
---
apiVersion: v1
kind: Service
metadata: {name: elsewhere, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.72
  externalIPs: ["192.168.250.72"]
  internalTrafficPolicy: Local
  externalTrafficPolicy: Local
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30121}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: elsewhere-1, namespace: demo, labels: {kubernetes.io/service-name: elsewhere}}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- {addresses: ["10.244.2.2"], nodeName: node-2}
"#;

/// The backends that answered `n` requests to `dst` from `from`, sorted and deduplicated; panics on a failure.
fn backends_reached(from: &NetNs, dst: SocketAddr, n: usize) -> Vec<usize> {
    let mut pods: Vec<usize> = tcp_requests(from, dst, n, T)
        .iter()
        .map(|a| pod_of(a).unwrap_or_else(|| panic!("{dst}: {a:?}")))
        .collect();
    pods.sort();
    pods.dedup();
    pods
}

/// A TCP connection to `dst` gets no answer at all (dropped, as kube-proxy drops), rather than a reset.
fn dropped(from: &NetNs, dst: SocketAddr) -> bool {
    let outcome = from
        .run(move || TcpStream::connect_timeout(&dst, Duration::from_millis(700)).map(drop))
        .unwrap();
    matches!(&outcome, Err(e) if e.kind() == io::ErrorKind::TimedOut)
}

#[test]
fn userspace_mode_honours_internal_and_external_traffic_policies() {
    let sb = sandbox("nk-rlt", 2);
    route_from_outside(&sb, std::net::Ipv4Addr::new(192, 168, 250, 0), 24);
    let m = Manifests::examples();
    m.write("policies.yaml", POLICIES);
    let agent = Agent::start(sb.node(), &m.dir, &["--proxy-mode", "userspace"]);
    agent.wait_syncs(1, SYNC);
    let itp = addr("10.96.0.70", 80);
    wait_until(SYNC, || served(sb.client(), itp, T))
        .unwrap_or_else(|_| panic!("never served; log:\n{}", agent.log()));

    // internalTrafficPolicy Local: this node's endpoint only, from a pod and from the node.
    assert_eq!(backends_reached(sb.client(), itp, 12), [1]);
    assert_eq!(backends_reached(sb.node(), itp, 6), [1]);

    // externalTrafficPolicy Local: from outside, this node's endpoint only, on every external frontend...
    let lb = addr("192.168.250.70", 80);
    let external = addr("192.168.250.71", 80);
    let node_port = SocketAddr::from((sandbox::node_ip_v4(), 30120));
    for dst in [lb, external, node_port] {
        assert_eq!(
            backends_reached(sb.ext(), dst, 8),
            [1],
            "{dst} from outside"
        );
    }
    // ...while the node's pods and the node itself reach every endpoint, as kube-proxy short-circuits them.
    for dst in [lb, external, node_port] {
        assert_eq!(
            backends_reached(sb.client(), dst, 12),
            [1, 2],
            "{dst} from a pod"
        );
    }
    assert_eq!(
        backends_reached(sb.node(), external, 12),
        [1, 2],
        "from the node"
    );
    // The ClusterIP follows internalTrafficPolicy (Cluster here): every endpoint.
    assert_eq!(
        backends_reached(sb.ext(), addr("10.96.0.71", 80), 12),
        [1, 2]
    );

    // No local endpoint: the ClusterIP (internal policy) is dropped for everyone; the external IP and the
    // NodePort are dropped from outside and still reach the remote endpoint from a pod.
    let elsewhere = addr("10.96.0.72", 80);
    assert!(dropped(sb.client(), elsewhere), "ClusterIP from a pod");
    assert!(dropped(sb.ext(), elsewhere), "ClusterIP from outside");
    let external = addr("192.168.250.72", 80);
    let node_port = SocketAddr::from((sandbox::node_ip_v4(), 30121));
    assert!(dropped(sb.ext(), external), "external IP from outside");
    assert!(dropped(sb.ext(), node_port), "NodePort from outside");
    assert_eq!(backends_reached(sb.client(), external, 4), [2]);
    assert_eq!(backends_reached(sb.client(), node_port, 4), [2]);
    assert_listable(sb.node());
}

fn guarded(ranges: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: guarded, namespace: demo}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.73
  externalIPs: ["192.168.250.74"]
  loadBalancerSourceRanges: [{ranges}]
  ports: [{{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30122}}]
status:
  loadBalancer:
    ingress: [{{ip: 192.168.250.73}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: guarded-1, namespace: demo, labels: {{kubernetes.io/service-name: guarded}}}}
addressType: IPv4
ports: [{{name: tcp, port: 8080, protocol: TCP}}]
endpoints:
- {{addresses: ["10.244.1.2"]}}
"#
    )
}

#[test]
fn userspace_mode_drops_load_balancer_traffic_from_outside_its_source_ranges() {
    let sb = sandbox("nk-rlg", 1);
    route_from_outside(&sb, std::net::Ipv4Addr::new(192, 168, 250, 0), 24);
    let lb = addr("192.168.250.73", 80);
    let external = addr("192.168.250.74", 80);
    let node_port = SocketAddr::from((sandbox::node_ip_v4(), 30122));
    let m = Manifests::examples();
    // Only the outside client's address is allowed.
    m.write("guarded.yaml", &guarded("192.168.200.2/32"));
    let agent = Agent::start(sb.node(), &m.dir, &["--proxy-mode", "userspace"]);
    wait_until(SYNC, || served(sb.ext(), lb, T))
        .unwrap_or_else(|_| panic!("allowed source never served; log:\n{}", agent.log()));
    assert!(
        dropped(sb.client(), lb),
        "a pod outside the ranges reached the LoadBalancer IP"
    );
    // Same service, not filtered: its external IP and NodePort.
    assert!(served(sb.client(), external, T));
    assert!(served(sb.client(), node_port, T));
    assert!(served(sb.ext(), node_port, T));
    assert_listable(sb.node());

    // The ranges change: now pods are allowed and the outside client is not.
    m.write("guarded.yaml", &guarded("10.244.0.0/16"));
    wait_until(SYNC, || served(sb.client(), lb, T))
        .unwrap_or_else(|_| panic!("new range never applied; log:\n{}", agent.log()));
    assert!(dropped(sb.ext(), lb));
    assert!(served(sb.ext(), external, T));
    // The old firewall chain is gone once nothing points at it.
    wait_until(SYNC, || {
        let t = dump_table(sb.node(), nftkube::nft::ir::Family::Ip).unwrap();
        t.chains.keys().filter(|c| c.starts_with("fw-")).count() == 1
    })
    .unwrap_or_else(|_| panic!("stale firewall chain left behind"));
}

/// Reads the classic exposition on stdin with Prometheus' own Python parser and prints every sample as JSON
/// `[name, labels, value]`: a parser from outside the project is the oracle.
const PARSE_METRICS: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
print(json.dumps([[s.name, s.labels, s.value]
                  for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]))
"#;

type Sample = (String, std::collections::BTreeMap<String, String>, f64);

/// The agent's `/metrics` (in the node's namespace), as Prometheus' Python client parses it.
fn scrape(sb: &sandbox::Sandbox) -> Vec<Sample> {
    let (status, _, body) = sb
        .node()
        .run(|| nftkube::admin::http::get(addr("127.0.0.1", 10249), "/metrics", T))
        .unwrap()
        .expect("/metrics");
    assert_eq!(status, 200, "{body}");
    if std::env::var_os("NFTKUBE_NO_PYTHON_ORACLE").is_some() {
        return read_plainly(&body);
    }
    let mut child = std::process::Command::new("/usr/bin/python3")
        .args(["-c", PARSE_METRICS])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("/usr/bin/python3 (with python3-prometheus-client: ci/install-deps installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the parser refused /metrics: {}\n{body}",
        String::from_utf8_lossy(&out.stderr)
    );
    let raw: Vec<(String, std::collections::BTreeMap<String, String>, f64)> =
        serde_json::from_slice(&out.stdout).unwrap();
    raw
}

/// Without the Python oracle (the VM matrix has no Python: ci/vm-init says so): the classic text read line by
/// line, `name{key="value",...} value`, enough for the values the tests assert; the format itself is checked
/// by the oracle on the host.
fn read_plainly(body: &str) -> Vec<Sample> {
    let sample = |line: &str| -> Sample {
        let (series, value) = line.rsplit_once(' ').expect("a sample line");
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.strip_suffix('}').expect("labels end with }")),
            None => (series, ""),
        };
        let labels = labels
            .split("\",")
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (key, value) = pair.split_once("=\"").expect("key=\"value\"");
                (key.to_string(), value.trim_end_matches('"').to_string())
            })
            .collect();
        (name.to_string(), labels, value.parse().expect("a number"))
    };
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(sample)
        .collect()
}

/// The value of the sample `name` whose labels include `labels` (None: no such sample).
fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.2)
}

/// A NodePort service without endpoints: its NodePort listener has nothing to relay to.
const NO_ENDPOINT_NODE_PORT: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: nonode, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.75
  ports: [{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30130}]
"#;

#[test]
fn userspace_relay_metrics_count_connections_bytes_and_refusals_per_service_port() {
    let sb = sandbox("nk-rlw", 3);
    let m = Manifests::examples();
    m.write("nodeports.yaml", NODE_PORTS);
    m.write("nonode.yaml", NO_ENDPOINT_NODE_PORT);
    let agent = Agent::start(sb.node(), &m.dir, &["--proxy-mode", "userspace"]);
    agent.wait_syncs(1, SYNC);
    let web = addr("10.96.0.30", 80);
    wait_until(SYNC, || served(sb.client(), web, T))
        .unwrap_or_else(|_| panic!("never served; log:\n{}", agent.log()));
    let tcp = [("service_port", "demo/web:tcp"), ("protocol", "TCP")];
    let from_client = [tcp[0], tcp[1], ("direction", "from_client")];
    let to_client = [tcp[0], tcp[1], ("direction", "to_client")];
    let before = scrape(&sb);
    let connections = |s: &[Sample]| sample(s, "nftkube_userspace_relay_connections_total", &tcp);
    let bytes = |s: &[Sample], labels: &[(&str, &str)]| {
        sample(s, "nftkube_userspace_relay_bytes_total", labels).unwrap_or(0.0)
    };

    let mut answered = 0;
    for a in tcp_requests(sb.client(), web, 6, T) {
        assert!(pod_of(&a).is_some(), "{a:?}");
        answered += a.unwrap().len() + 1; // and the newline tcp_request took off
    }
    let udp = addr("10.96.0.30", 53);
    let (reply, _) = sb
        .client()
        .run(move || udp_exchange(udp, b"hello"))
        .unwrap()
        .expect("udp through the relay");
    // No endpoint behind the NodePort: the connection is reset, and counted by its reason.
    let node_port = SocketAddr::from((sandbox::node_ip_v4(), 30130));
    assert!(!served(sb.ext(), node_port, T));

    let after = scrape(&sb);
    assert_eq!(
        connections(&after).unwrap() - connections(&before).unwrap(),
        6.0
    );
    let answer = bytes(&after, &to_client) - bytes(&before, &to_client);
    assert_eq!(answer, answered as f64, "bytes to clients");
    assert!(bytes(&after, &from_client) >= bytes(&before, &from_client));
    let udp_labels = [
        ("service_port", "demo/web:udp"),
        ("protocol", "UDP"),
        ("direction", "from_client"),
    ];
    assert_eq!(
        bytes(&after, &udp_labels),
        5.0,
        "datagram bytes from the client"
    );
    let udp_back = [udp_labels[0], udp_labels[1], ("direction", "to_client")];
    assert_eq!(bytes(&after, &udp_back), reply.len() as f64);
    let refused = [
        ("service_port", "demo/nonode:tcp"),
        ("protocol", "TCP"),
        ("reason", "no_endpoint"),
    ];
    assert!(
        sample(
            &after,
            "nftkube_userspace_relay_refused_connections_total",
            &refused
        ) >= Some(1.0),
        "{after:?}"
    );
    // Every connection ended: none active.
    wait_until(SYNC, || {
        sample(
            &scrape(&sb),
            "nftkube_userspace_relay_active_connections",
            &tcp,
        ) == Some(0.0)
    })
    .expect("connections still counted active");

    // The service goes: its series go with its last listener.
    m.write("nonode.yaml", "");
    wait_until(SYNC, || {
        sample(
            &scrape(&sb),
            "nftkube_userspace_relay_refused_connections_total",
            &refused,
        )
        .is_none()
    })
    .expect("a deleted service's series remain");
}
