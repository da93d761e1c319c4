//! The namespace topology used by the demo (this package's `nftkube-demo` binary) and by the kernel tests: a node,
//! an outside client, a client pod and N backend pods, wired with veth pairs, fixed addresses and routes, plus tiny
//! TCP/UDP backend servers and client helpers that run inside a namespace.
//!
//! ```text
//!   {prefix}-ext  eth0 192.168.200.2/24, fd00:200::2/64
//!        │             routes 10.96.0.0/12, 10.244.0.0/16, fd00:96::/64, fd00:244::/48 via the node
//!   {prefix}-node eth0 192.168.200.1/24, fd00:200::1/64     default routes via ext (so traffic the node does not
//!                 pod{i} 10.244.{i}.1/24, fd00:244:0:{i}::1/64  NAT is forwarded and filtered, not unroutable)
//!        │             ip_forward=1, ipv6 forwarding=1 (ICMP rate limits are off in every namespace)
//!   {prefix}-pod{i} eth0 10.244.{i}.2/24, fd00:244:0:{i}::2/64, default routes via the node side
//!                 pod0 is a client pod; pod1..=N are backends
//! ```
//!
//! `ext` does not forward (ip_forward=0): a packet the node sends it that is not addressed to it is dropped
//! silently, so "not programmed" shows up as a timeout, never as an ICMP error from ext.
//!
//! IPv6 pod prefixes put `i` in the *fourth* 16-bit group (fd00:244:0:{i}::/64) so that every pod lies inside
//! the /48 cluster CIDR fd00:244::/48 (fd00:244:{i}::/64 would leave it for i ≥ 1). Pod 10 is `fd00:244:0:a::2`.

// The test rig (and the demo's): it reports to the terminal of the test or demo that runs it.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

pub mod netns;

use self::netns::{
    add_address, add_route, create_veth, set_link_up, set_sysctl, NetNs, NetnsError,
};
use anyhow::Context;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The pods' IPv4 range (every pod's /24 lies in it).
pub const CLUSTER_CIDR_V4: &str = "10.244.0.0/16";
/// The pods' IPv6 range.
pub const CLUSTER_CIDR_V6: &str = "fd00:244::/48";
/// Service (ClusterIP) ranges the outside client routes to the node.
pub const SERVICE_CIDR_V4: &str = "10.96.0.0/12";
/// The Service (ClusterIP) IPv6 range.
pub const SERVICE_CIDR_V6: &str = "fd00:96::/64";
/// The node's link towards `ext` (and `ext`'s towards the node).
pub const NODE_UPLINK: &str = "eth0";
/// A pod's only link.
pub const POD_IFNAME: &str = "eth0";
/// Most pods the addressing scheme allows (pod0 plus backends: 10.244.{i}.0/24 with i ≤ 255).
pub const MAX_BACKENDS: usize = 255;

const SERVER_POLL: Duration = Duration::from_millis(100);

/// The node's IPv4 address on its uplink.
pub fn node_ip_v4() -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 200, 1)
}
/// The outside client's IPv4 address.
pub fn ext_ip_v4() -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 200, 2)
}
/// The node's IPv6 address on its uplink.
pub fn node_ip_v6() -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 1)
}
/// The outside client's IPv6 address.
pub fn ext_ip_v6() -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 2)
}

fn pod_octet(i: usize) -> u8 {
    u8::try_from(i).unwrap_or_else(|_| panic!("pod index {i} out of range (0..=255)"))
}

/// Pod `i`'s address, 10.244.{i}.2 (pod0 is the client pod). Panics for i > 255.
pub fn pod_ip_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, pod_octet(i), 2)
}
/// Pod `i`'s IPv6 address, fd00:244:0:{i}::2 (i as a hexadecimal group), inside fd00:244::/48.
pub fn pod_ip_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x244, 0, pod_octet(i) as u16, 0, 0, 0, 2)
}
/// The node's side of pod `i`'s link, 10.244.{i}.1: the pod's default gateway.
pub fn pod_gateway_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, pod_octet(i), 1)
}
/// The node's side of pod `i`'s link in IPv6, fd00:244:0:{i}::1.
pub fn pod_gateway_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x244, 0, pod_octet(i) as u16, 0, 0, 0, 1)
}
/// The node's link to pod `i`: `pod{i}`.
pub fn node_pod_ifname(i: usize) -> String {
    format!("pod{i}")
}

/// What a backend answers: `pod{i} {peer_ip}` (TCP adds a newline, which `tcp_request` removes). Returns
/// `(i, peer_ip)`.
pub fn parse_answer(answer: &str) -> Option<(usize, IpAddr)> {
    let (pod, peer) = answer.trim_end().split_once(' ')?;
    Some((pod.strip_prefix("pod")?.parse().ok()?, peer.parse().ok()?))
}

/// The topology; every namespace is removed when it drops (also while unwinding from a panic).
pub struct Sandbox {
    prefix: String,
    backends: usize,
    shutdown: Arc<AtomicBool>,
    servers: Mutex<Vec<JoinHandle<()>>>,
    // Dropped after Drop::drop stopped the servers: deleting the namespaces is the last thing that happens.
    node: NetNs,
    ext: NetNs,
    pods: Vec<NetNs>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("prefix", &self.prefix)
            .field("backends", &self.backends)
            .finish_non_exhaustive()
    }
}

/// Tests count ICMP errors (the node's rejects, a backend's port unreachable); the per-destination limit (a burst
/// of about 6, then one per second) would turn most of them into timeouts. Per namespace, so only ours.
fn no_icmp_ratelimit() -> Result<(), NetnsError> {
    set_sysctl("net/ipv4/icmp_ratelimit", "0")?;
    set_sysctl("net/ipv6/icmp/ratelimit", "0")?;
    // Besides the per-destination limit there is a host-wide budget (icmp_msgs_per_sec) shared by every
    // namespace, which parallel tests drain; an empty rate mask exempts every ICMP type from both limits.
    set_sysctl("net/ipv4/icmp_ratemask", "0")?;
    // The IPv6 mask is a bitmap list; older kernels lack it, so it is best-effort.
    let _ = set_sysctl("net/ipv6/icmp/ratemask", "");
    Ok(())
}

/// No duplicate address detection for any link created from now on, link-local addresses included. With DAD the
/// link-local address stays tentative for a second or two, and a *forwarding* node cannot solicit a neighbour
/// meanwhile (a forwarded packet's source is not on the outgoing link, so the kernel falls back to the link-local
/// source, which must not be tentative): the first forwarded IPv6 packet to each pod would wait ~2 s.
fn no_dad() -> Result<(), NetnsError> {
    set_sysctl("net/ipv6/conf/all/accept_dad", "0")?;
    set_sysctl("net/ipv6/conf/default/accept_dad", "0")
}

fn in_ns<T>(
    ns: &NetNs,
    what: &str,
    f: impl FnOnce() -> Result<T, NetnsError> + Send,
) -> anyhow::Result<T>
where
    T: Send,
{
    ns.run(f)
        .with_context(|| format!("{what} in namespace {}", ns.name()))?
        .with_context(|| format!("{what} in namespace {}", ns.name()))
}

impl Sandbox {
    /// Creates namespaces `{prefix}-node`, `{prefix}-ext`, `{prefix}-pod0` (client) and `{prefix}-pod1..=backends`
    /// and wires them. On failure everything created so far is removed.
    pub fn build(prefix: &str, backends: usize) -> anyhow::Result<Sandbox> {
        anyhow::ensure!(
            backends <= MAX_BACKENDS,
            "at most {MAX_BACKENDS} backends, asked for {backends}"
        );
        let create = |suffix: &str| {
            let name = format!("{prefix}-{suffix}");
            NetNs::create(&name).with_context(|| format!("creating sandbox namespace {name}"))
        };
        // Each NetNs removes itself if a later step fails.
        let node = create("node")?;
        let ext = create("ext")?;
        let pods = (0..=backends)
            .map(|i| create(&format!("pod{i}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let sandbox = Sandbox {
            prefix: prefix.to_owned(),
            backends,
            shutdown: Arc::new(AtomicBool::new(false)),
            servers: Mutex::new(Vec::new()),
            node,
            ext,
            pods,
        };
        sandbox
            .wire()
            .with_context(|| format!("wiring sandbox {prefix}"))?;
        tracing::debug!(prefix, backends, "sandbox built");
        Ok(sandbox)
    }

    fn wire(&self) -> anyhow::Result<()> {
        // Before any veth exists: a link copies its IPv6 settings from `default` when it is created.
        for ns in self.namespaces() {
            let forward = if std::ptr::eq(ns, &self.node) {
                "1"
            } else {
                "0"
            };
            in_ns(ns, "preparing the namespace", || {
                set_link_up("lo")?;
                no_dad()?;
                no_icmp_ratelimit()?;
                // New namespaces inherit the host's IPv4 forwarding setting: only the node forwards.
                set_sysctl("net/ipv4/ip_forward", forward)?;
                Ok(())
            })?;
        }
        let (ext, pods) = (&self.ext, &self.pods);
        in_ns(&self.node, "configuring the node", || {
            create_veth(NODE_UPLINK, NODE_UPLINK, ext)?;
            set_link_up(NODE_UPLINK)?;
            add_address(NODE_UPLINK, node_ip_v4().into(), 24)?;
            add_address(NODE_UPLINK, node_ip_v6().into(), 64)?;
            for (i, pod) in pods.iter().enumerate() {
                let ifname = node_pod_ifname(i);
                create_veth(&ifname, POD_IFNAME, pod)?;
                set_link_up(&ifname)?;
                add_address(&ifname, pod_gateway_v4(i).into(), 24)?;
                add_address(&ifname, pod_gateway_v6(i).into(), 64)?;
            }
            // After the links exist: writing the "all" knob also switches every existing link.
            set_sysctl("net/ipv6/conf/all/forwarding", "1")?;
            Ok(())
        })?;
        in_ns(&self.ext, "configuring ext", || {
            set_link_up(NODE_UPLINK)?;
            add_address(NODE_UPLINK, ext_ip_v4().into(), 24)?;
            add_address(NODE_UPLINK, ext_ip_v6().into(), 64)?;
            let via4 = Some(IpAddr::from(node_ip_v4()));
            let via6 = Some(IpAddr::from(node_ip_v6()));
            add_route(
                Ipv4Addr::new(10, 96, 0, 0).into(),
                12,
                via4,
                Some(NODE_UPLINK),
            )?;
            add_route(
                Ipv4Addr::new(10, 244, 0, 0).into(),
                16,
                via4,
                Some(NODE_UPLINK),
            )?;
            add_route(
                Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0).into(),
                64,
                via6,
                Some(NODE_UPLINK),
            )?;
            add_route(
                Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0).into(),
                48,
                via6,
                Some(NODE_UPLINK),
            )?;
            Ok(())
        })?;
        for (i, pod) in self.pods.iter().enumerate() {
            in_ns(pod, "configuring a pod", move || {
                set_link_up(POD_IFNAME)?;
                add_address(POD_IFNAME, pod_ip_v4(i).into(), 24)?;
                add_address(POD_IFNAME, pod_ip_v6(i).into(), 64)?;
                add_route(
                    Ipv4Addr::UNSPECIFIED.into(),
                    0,
                    Some(pod_gateway_v4(i).into()),
                    Some(POD_IFNAME),
                )?;
                add_route(
                    Ipv6Addr::UNSPECIFIED.into(),
                    0,
                    Some(pod_gateway_v6(i).into()),
                    Some(POD_IFNAME),
                )?;
                Ok(())
            })?;
        }
        in_ns(&self.node, "adding the node's default routes", || {
            add_route(
                Ipv4Addr::UNSPECIFIED.into(),
                0,
                Some(ext_ip_v4().into()),
                Some(NODE_UPLINK),
            )?;
            add_route(
                Ipv6Addr::UNSPECIFIED.into(),
                0,
                Some(ext_ip_v6().into()),
                Some(NODE_UPLINK),
            )?;
            Ok(())
        })?;
        Ok(())
    }

    /// What every namespace name of this sandbox starts with.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// Number of backend pods (pod1..=backends).
    pub fn backends(&self) -> usize {
        self.backends
    }
    /// The node, where the agent runs.
    pub fn node(&self) -> &NetNs {
        &self.node
    }
    /// The client outside the cluster, on the node's uplink.
    pub fn ext(&self) -> &NetNs {
        &self.ext
    }
    /// The client pod, pod0.
    pub fn client(&self) -> &NetNs {
        &self.pods[0]
    }
    /// Pod `i` (0 = client, 1..=backends). Panics when out of range.
    pub fn pod(&self, i: usize) -> &NetNs {
        &self.pods[i]
    }

    /// Gives pod `pod` `count` addresses in its /24, starting `skip` after its own (skip 0: its own first),
    /// all answered by its servers; returns them in order.
    pub fn add_pod_addresses(&self, pod: usize, skip: usize, count: usize) -> Vec<Ipv4Addr> {
        let [a, b, c, d] = pod_ip_v4(pod).octets();
        let addrs: Vec<Ipv4Addr> = (skip..skip + count)
            .map(|k| Ipv4Addr::new(a, b, c, d + k as u8))
            .collect();
        let own = pod_ip_v4(pod);
        let extra: Vec<Ipv4Addr> = addrs.iter().copied().filter(|&x| x != own).collect();
        self.pod(pod)
            .run(move || {
                for x in extra {
                    add_address(POD_IFNAME, x.into(), 24).expect("adding a pod address");
                }
            })
            .expect("entering the pod's namespace");
        addrs
    }
    /// Every namespace of the sandbox: node, ext, pod0..=N.
    pub fn namespaces(&self) -> impl Iterator<Item = &NetNs> {
        [&self.node, &self.ext].into_iter().chain(self.pods.iter())
    }

    /// Starts, in every backend pod i, a dual-stack TCP server on `[::]:tcp_port` answering each connection with
    /// `pod{i} {peer_ip}\n` and a dual-stack UDP server on `[::]:udp_port` answering each datagram with
    /// `pod{i} {peer_ip}`. Both listen before this returns; they stop when the Sandbox drops.
    pub fn start_backends(&self, tcp_port: u16, udp_port: u16) -> anyhow::Result<()> {
        for i in 1..=self.backends {
            let pod = &self.pods[i];
            let (tcp, udp) = pod
                .run(move || -> io::Result<(TcpListener, UdpSocket)> {
                    let tcp = TcpListener::from(dual_stack_socket(libc::SOCK_STREAM, tcp_port)?);
                    let udp = UdpSocket::from(dual_stack_socket(libc::SOCK_DGRAM, udp_port)?);
                    tcp.set_nonblocking(true)?;
                    udp.set_nonblocking(true)?;
                    Ok((tcp, udp))
                })
                .and_then(|r| r)
                .with_context(|| {
                    format!(
                        "binding backend servers in {} (tcp {tcp_port}, udp {udp_port})",
                        pod.name()
                    )
                })?;
            let shutdown = self.shutdown.clone();
            let handle = pod
                .spawn(move || serve(i, tcp, udp, &shutdown))
                .with_context(|| format!("starting backend servers in {}", pod.name()))?;
            self.servers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(handle);
        }
        Ok(())
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // Servers first: a thread inside a namespace keeps it alive after /run/netns/NAME is gone.
        self.shutdown.store(true, Ordering::SeqCst);
        let servers = std::mem::take(self.servers.get_mut().unwrap_or_else(|e| e.into_inner()));
        for h in servers {
            if h.join().is_err() {
                tracing::error!(prefix = %self.prefix, "a backend server thread panicked");
            }
        }
        // The NetNs fields drop next and delete the namespaces.
    }
}

fn setsockopt_int(
    fd: &OwnedFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: passes a pointer to a local c_int with its exact size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An AF_INET6 socket bound to `[::]:port` that also takes IPv4 (IPV6_V6ONLY=0 set explicitly, whatever the
/// namespace's net.ipv6.bindv6only says); listening if it is a stream socket.
fn dual_stack_socket(ty: libc::c_int, port: u16) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned right away.
    let raw = unsafe { libc::socket(libc::AF_INET6, ty | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    setsockopt_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0)?;
    if ty == libc::SOCK_STREAM {
        // Lets a restarted server bind while old connections sit in TIME_WAIT. Not for UDP, where it would let
        // two servers share the port.
        setsockopt_int(&fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    }
    // SAFETY: sockaddr_in6 is plain data; all-zero is the unspecified address.
    let mut sa: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    sa.sin6_port = port.to_be();
    // SAFETY: sa is a valid sockaddr_in6 and its size is passed.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sa as *const libc::sockaddr_in6 as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: plain syscall on an fd we own.
    if ty == libc::SOCK_STREAM && unsafe { libc::listen(fd.as_raw_fd(), 512) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn serve(i: usize, tcp: TcpListener, udp: UdpSocket, shutdown: &AtomicBool) {
    let mut fds = [
        libc::pollfd {
            fd: tcp.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: udp.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let mut buf = [0u8; 2048];
    while !shutdown.load(Ordering::SeqCst) {
        // SAFETY: fds is a valid array of two pollfd for the duration of the call.
        let n = unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                SERVER_POLL.as_millis() as i32,
            )
        };
        if n <= 0 {
            continue;
        }
        if fds[0].revents != 0 {
            while let Ok((stream, peer)) = tcp.accept() {
                answer_tcp(i, stream, peer);
            }
        }
        if fds[1].revents != 0 {
            while let Ok((_, peer)) = udp.recv_from(&mut buf) {
                let reply = format!("pod{i} {}", peer.ip().to_canonical());
                if let Err(e) = udp.send_to(reply.as_bytes(), peer) {
                    tracing::debug!(pod = i, %peer, error = %e, "udp reply failed");
                }
            }
        }
    }
}

fn answer_tcp(i: usize, mut stream: TcpStream, peer: SocketAddr) {
    let reply = format!("pod{i} {}\n", peer.ip().to_canonical());
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    if let Err(e) = stream.write_all(reply.as_bytes()) {
        tracing::debug!(pod = i, %peer, error = %e, "tcp reply failed");
        return;
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // Closing with unread input would send a reset instead of a clean FIN: drain what is already there.
    let _ = stream.set_nonblocking(true);
    let mut sink = [0u8; 512];
    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
}

/// A read timeout surfaces as WouldBlock on Linux; call it what it is.
fn timeout_kind(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "timed out waiting for an answer")
    } else {
        e
    }
}

/// One TCP request from the calling thread's namespace: connect to `dst`, read until the server closes, return
/// the answer without its trailing newline. A reset or ICMP port unreachable is `ConnectionRefused`; no answer
/// within `timeout` (per step) is `TimedOut`.
pub fn tcp_request_here(dst: SocketAddr, timeout: Duration) -> io::Result<String> {
    let mut s = TcpStream::connect_timeout(&dst, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(timeout_kind)?;
    if out.ends_with('\n') {
        out.pop();
    }
    Ok(out)
}

/// One UDP request from the calling thread's namespace: send "hi" from a fresh socket (source port `src_port`, or
/// an ephemeral one) connected to `dst` and wait for one answer. ICMP port unreachable is `ConnectionRefused`
/// (the socket is connected, so the kernel reports it); silence is `TimedOut`.
pub fn udp_request_here(
    src_port: Option<u16>,
    dst: SocketAddr,
    timeout: Duration,
) -> io::Result<String> {
    let local: SocketAddr = match dst {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, src_port.unwrap_or(0)).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, src_port.unwrap_or(0)).into(),
    };
    let s = bind_and_connect(local, dst)?;
    s.set_read_timeout(Some(timeout))?;
    s.send(b"hi")?;
    let mut buf = [0u8; 2048];
    let n = s.recv(&mut buf).map_err(timeout_kind)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// A UDP socket from `local` connected to `dst`. A fixed source port reused at once by the next request can
/// still be taken for a moment (seen once under load in CI: EADDRINUSE right after the previous socket of that
/// port was closed), so that error is retried for up to 200 ms.
fn bind_and_connect(local: SocketAddr, dst: SocketAddr) -> io::Result<UdpSocket> {
    let mut tries = 0;
    loop {
        let attempt = UdpSocket::bind(local).and_then(|s| s.connect(dst).map(|()| s));
        match attempt {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && local.port() != 0 && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

fn flatten<T>(r: io::Result<io::Result<T>>) -> io::Result<T> {
    r.and_then(|x| x)
}

fn batch_error(e: io::Error, k: usize) -> Vec<io::Result<String>> {
    let msg = e.to_string();
    (0..k)
        .map(|_| Err(io::Error::new(e.kind(), msg.clone())))
        .collect()
}

/// [`tcp_request_here`] on a thread inside `ns`.
pub fn tcp_request(ns: &NetNs, dst: SocketAddr, timeout: Duration) -> io::Result<String> {
    flatten(ns.run(move || tcp_request_here(dst, timeout)))
}

/// `k` sequential TCP requests on one thread inside `ns` (entering a namespace per request is slow).
pub fn tcp_requests(
    ns: &NetNs,
    dst: SocketAddr,
    k: usize,
    timeout: Duration,
) -> Vec<io::Result<String>> {
    ns.run(move || (0..k).map(|_| tcp_request_here(dst, timeout)).collect())
        .unwrap_or_else(|e| batch_error(e, k))
}

/// [`udp_request_here`] with an ephemeral source port, on a thread inside `ns`.
pub fn udp_request(ns: &NetNs, dst: SocketAddr, timeout: Duration) -> io::Result<String> {
    flatten(ns.run(move || udp_request_here(None, dst, timeout)))
}

/// [`udp_request_here`] from a fixed source port, on a thread inside `ns`.
pub fn udp_request_from(
    ns: &NetNs,
    src_port: u16,
    dst: SocketAddr,
    timeout: Duration,
) -> io::Result<String> {
    flatten(ns.run(move || udp_request_here(Some(src_port), dst, timeout)))
}

/// `k` sequential UDP requests, each from a fresh socket (a new ephemeral port, so a new conntrack flow), on one
/// thread inside `ns`.
pub fn udp_requests(
    ns: &NetNs,
    dst: SocketAddr,
    k: usize,
    timeout: Duration,
) -> Vec<io::Result<String>> {
    ns.run(move || {
        (0..k)
            .map(|_| udp_request_here(None, dst, timeout))
            .collect()
    })
    .unwrap_or_else(|e| batch_error(e, k))
}

/// Re-exported so sandbox users need one import for unique prefixes.
pub use netns::unique_name;

/// Binary `name` of this workspace as cargo's `profile` ("debug" or "release") built it: the path in `$env`
/// when set (the VM matrix, another build), else under `$CARGO_TARGET_DIR` or the workspace's `target/`. The
/// kernel tests and the benchmarks run the product's binaries through this one lookup.
pub fn workspace_binary(env: &str, profile: &str, name: &str) -> std::path::PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return p.into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let bin = target.join(profile).join(name);
    let release = if profile == "release" {
        " --release"
    } else {
        ""
    };
    assert!(
        bin.exists(),
        "{} not found: run `cargo build{release} --bins --workspace` first, or set {env}",
        bin.display()
    );
    bin
}

#[cfg(test)]
mod tests {
    use super::netns::tests::{host_links, require_root};
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::path::PathBuf;
    use std::time::Instant;

    /// Network namespace inodes our own threads are in right now.
    fn our_thread_namespaces() -> Vec<u64> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::metadata(t.ok()?.path().join("ns/net")).ok())
            .map(|m| m.ino())
            .collect()
    }

    fn leftovers(prefix: &str) -> Vec<String> {
        std::fs::read_dir(netns::NETNS_RUN_DIR)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&format!("{prefix}-")))
                    .collect()
            })
            .unwrap_or_default()
    }

    const T: Duration = Duration::from_secs(3);

    fn in_cidr(ip: IpAddr, cidr: &str) -> bool {
        let (net, len) = cidr.split_once('/').unwrap();
        let (net, len): (IpAddr, u32) = (net.parse().unwrap(), len.parse().unwrap());
        match (ip, net) {
            (IpAddr::V4(a), IpAddr::V4(n)) => {
                let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
                u32::from(a) & mask == u32::from(n)
            }
            (IpAddr::V6(a), IpAddr::V6(n)) => {
                let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
                u128::from(a) & mask == u128::from(n)
            }
            _ => false,
        }
    }

    #[test]
    fn addressing_constants_agree() {
        assert_eq!(pod_ip_v4(3).to_string(), "10.244.3.2");
        assert_eq!(pod_ip_v6(0).to_string(), "fd00:244::2");
        assert_eq!(pod_ip_v6(10).to_string(), "fd00:244:0:a::2");
        assert_eq!(pod_gateway_v6(1).to_string(), "fd00:244:0:1::1");
        assert_eq!(
            parse_answer("pod2 10.244.0.2\n"),
            Some((2, IpAddr::from(pod_ip_v4(0))))
        );
        assert_eq!(
            parse_answer("pod1 fd00:200::2"),
            Some((1, IpAddr::from(ext_ip_v6())))
        );
        assert_eq!(parse_answer("garbage"), None);
        // Every pod address (and the node's side of each pod link) lies inside the cluster CIDRs: ext routes only
        // those to the node, and masquerade decisions compare against them.
        for i in 0..=MAX_BACKENDS {
            assert!(
                in_cidr(pod_ip_v4(i).into(), CLUSTER_CIDR_V4),
                "{}",
                pod_ip_v4(i)
            );
            assert!(in_cidr(pod_gateway_v4(i).into(), CLUSTER_CIDR_V4));
            assert!(
                in_cidr(pod_ip_v6(i).into(), CLUSTER_CIDR_V6),
                "{}",
                pod_ip_v6(i)
            );
            assert!(in_cidr(pod_gateway_v6(i).into(), CLUSTER_CIDR_V6));
        }
        assert!(!in_cidr("fd00:244:1::2".parse().unwrap(), CLUSTER_CIDR_V6));
        assert!(!in_cidr(node_ip_v4().into(), CLUSTER_CIDR_V4));
        for (cidr, net) in [
            (CLUSTER_CIDR_V4, IpAddr::from(Ipv4Addr::new(10, 244, 0, 0))),
            (
                CLUSTER_CIDR_V6,
                IpAddr::from(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0)),
            ),
            (SERVICE_CIDR_V4, IpAddr::from(Ipv4Addr::new(10, 96, 0, 0))),
            (
                SERVICE_CIDR_V6,
                IpAddr::from(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0)),
            ),
        ] {
            assert_eq!(
                cidr.split('/').next().unwrap().parse::<IpAddr>().unwrap(),
                net
            );
        }
    }

    #[test]
    fn sandbox_connectivity_and_cleanup() {
        require_root();
        let t0 = Instant::now();
        let before = host_links();
        let prefix = unique_name("nftk-t-sb");
        let sb = Sandbox::build(&prefix, 3).unwrap();
        let built = t0.elapsed();
        assert_eq!(sb.namespaces().count(), 6);
        assert_eq!(leftovers(&prefix).len(), 6);
        let inodes: Vec<u64> = sb.namespaces().map(|n| n.inode().unwrap()).collect();
        let paths: Vec<PathBuf> = sb.namespaces().map(|n| n.path().to_owned()).collect();
        let (tcp, udp) = (8080, 5353);
        sb.start_backends(tcp, udp).unwrap();

        let v4 = |i: usize, p: u16| SocketAddr::from((pod_ip_v4(i), p));
        let v6 = |i: usize, p: u16| SocketAddr::from((pod_ip_v6(i), p));

        // pod0 → pod1 directly (through the node's routing), v4 and v6, TCP and UDP.
        assert_eq!(
            tcp_request(sb.client(), v4(1, tcp), T).unwrap(),
            "pod1 10.244.0.2"
        );
        assert_eq!(
            udp_request(sb.client(), v4(1, udp), T).unwrap(),
            "pod1 10.244.0.2"
        );
        assert_eq!(
            tcp_request(sb.client(), v6(1, tcp), T).unwrap(),
            "pod1 fd00:244::2"
        );
        assert_eq!(
            udp_request(sb.client(), v6(1, udp), T).unwrap(),
            "pod1 fd00:244::2"
        );
        assert_eq!(
            udp_request_from(sb.client(), 40000, v4(3, udp), T).unwrap(),
            "pod3 10.244.0.2"
        );
        assert_eq!(
            udp_request_from(sb.client(), 40000, v4(3, udp), T).unwrap(),
            "pod3 10.244.0.2"
        );

        // ext → pod2 through the forwarding node. The first forwarded IPv6 packet to a pod must not wait for the
        // node's link-local DAD (~2 s without `no_dad`).
        let t = Instant::now();
        assert_eq!(
            tcp_request(sb.ext(), v6(2, tcp), T).unwrap(),
            "pod2 fd00:200::2"
        );
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "first forwarded v6 request took {:?}",
            t.elapsed()
        );
        assert_eq!(
            tcp_request(sb.ext(), v4(2, tcp), T).unwrap(),
            "pod2 192.168.200.2"
        );
        assert_eq!(
            udp_request(sb.ext(), v4(2, udp), T).unwrap(),
            "pod2 192.168.200.2"
        );
        assert_eq!(
            tcp_request(sb.ext(), v6(2, tcp), T).unwrap(),
            "pod2 fd00:200::2"
        );
        assert_eq!(
            udp_request(sb.ext(), v6(2, udp), T).unwrap(),
            "pod2 fd00:200::2"
        );

        // Batches on one namespace thread.
        let t = Instant::now();
        let answers = tcp_requests(sb.client(), v4(3, tcp), 50, T);
        let tcp50 = t.elapsed();
        assert!(
            answers
                .iter()
                .all(|a| a.as_deref().ok() == Some("pod3 10.244.0.2")),
            "{answers:?}"
        );
        let t = Instant::now();
        let answers = udp_requests(sb.ext(), v6(3, udp), 50, T);
        let udp50 = t.elapsed();
        assert!(
            answers
                .iter()
                .all(|a| a.as_deref().ok() == Some("pod3 fd00:200::2")),
            "{answers:?}"
        );

        // Nothing listening: refused fast, for TCP (RST) and UDP (ICMP port unreachable), v4 and v6.
        let t = Instant::now();
        for dst in [v4(1, tcp + 1), v6(1, tcp + 1)] {
            let e = tcp_request(sb.client(), dst, T).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "tcp {dst}: {e}");
        }
        for dst in [v4(1, udp + 1), v6(1, udp + 1)] {
            let e = udp_request(sb.client(), dst, T).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "udp {dst}: {e}");
        }
        // Refusals counted through the node: the backend's ICMP rate limit is off, so none becomes a timeout.
        let refusals = udp_requests(sb.ext(), v4(2, udp + 1), 20, T);
        assert!(
            refusals
                .iter()
                .all(|r| matches!(r, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)),
            "{refusals:?}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "refusals are fast: {:?}",
            t.elapsed()
        );

        // A service address nobody programmed: the node forwards it to ext, which drops it: a timeout, not an error.
        let short = Duration::from_millis(300);
        let e = tcp_request(
            sb.client(),
            SocketAddr::from((Ipv4Addr::new(10, 96, 0, 1), 80)),
            short,
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        let e = udp_request(
            sb.ext(),
            SocketAddr::from((Ipv4Addr::new(10, 96, 0, 1), 53)),
            short,
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");

        // Starting the same ports twice fails with context instead of hanging.
        let err = sb.start_backends(tcp, udp).unwrap_err();
        assert!(format!("{err:#}").contains("in use"), "{err:#}");

        assert_eq!(
            host_links(),
            before,
            "host link list unchanged while the sandbox exists"
        );
        let t = Instant::now();
        drop(sb);
        let dropped = t.elapsed();
        assert!(leftovers(&prefix).is_empty(), "{:?}", leftovers(&prefix));
        for p in &paths {
            assert!(!p.exists(), "{} removed", p.display());
        }
        let ours = our_thread_namespaces();
        assert!(
            inodes.iter().all(|i| !ours.contains(i)),
            "no thread of ours is left in a sandbox namespace"
        );
        assert_eq!(host_links(), before, "host link list unchanged");
        eprintln!(
            "sandbox: build {built:?}, 50 tcp {tcp50:?}, 50 udp {udp50:?}, drop {dropped:?}, total {:?}",
            t0.elapsed()
        );
    }

    #[test]
    fn failed_build_removes_what_it_created() {
        require_root();
        let prefix = unique_name("nftk-t-sbfail");
        // Occupy pod2's name: build creates node, ext, pod0, pod1, then fails.
        let squatter = NetNs::create(&format!("{prefix}-pod2")).unwrap();
        let err = Sandbox::build(&prefix, 3).unwrap_err();
        assert!(format!("{err:#}").contains("exists"), "{err:#}");
        assert_eq!(
            leftovers(&prefix),
            [format!("{prefix}-pod2")],
            "only the squatter is left"
        );
        drop(squatter);
        assert!(leftovers(&prefix).is_empty());
        assert!(Sandbox::build(&prefix, MAX_BACKENDS + 1).is_err());
    }
}
