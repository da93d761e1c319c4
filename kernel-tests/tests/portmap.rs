//! The CNI portmap plugin, driven as a runtime drives it: Debian's stock `bridge` + `host-local` plugins make the
//! container's interface and address (so `prevResult` is real), then nftkube's portmap (the nftkube-portmap
//! binary under the name `portmap`, as a runtime finds it in CNI_PATH) publishes the host ports. Everything runs inside a node
//! namespace of the test's own (the bridge plugin makes its bridge in the namespace it runs in); the client
//! is the sandbox's outside namespace, wired to the node's uplink. Real packets decide every case, and the
//! ruleset must list and reload under nft after every step.

use kernel_tests::sandbox::{self, ext_ip_v4, node_ip_v4, node_ip_v6, Sandbox};
use kernel_tests::*;
use nftkube::nft::ir::Family;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube_sandbox::netns::{self, unique_name, NetNs};
use serde_json::{json, Value};
use std::io::{ErrorKind, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const CNI_BIN: &str = "/usr/lib/cni";
const TABLE: &str = "nftkube-portmap";
const WAIT: Duration = Duration::from_secs(2);
/// A request that must not be answered: refused or silent within this.
const SHORT: Duration = Duration::from_millis(700);
const TCP_PORT: u16 = 80;
const UDP_PORT: u16 = 5353;

/// The node (the sandbox's node and outside client), a scratch directory, and the plugin as runtimes find it.
struct Node {
    sb: Sandbox,
    dir: PathBuf,
    /// A directory holding `portmap` (a symlink to the nftkube-portmap binary) and Debian's plugins, as CNI_PATH.
    cni_path: PathBuf,
    /// `portmap` as nodes set up before nftkube-portmap have it: a symlink to the agent binary, which answers
    /// as the plugin by that name.
    legacy: PathBuf,
}

impl Node {
    fn new(tag: &str) -> Node {
        require_root();
        for p in ["bridge", "host-local"] {
            assert!(
                Path::new(CNI_BIN).join(p).exists(),
                "{CNI_BIN}/{p} missing: install containernetworking-plugins (ci/install-deps does)"
            );
        }
        let name = unique_name(tag);
        let sb = Sandbox::build(&name, 0).expect("building the sandbox");
        let dir = std::env::temp_dir().join(format!("nftkube-{name}"));
        let cni_path = dir.join("bin");
        std::fs::create_dir_all(&cni_path).unwrap();
        std::os::unix::fs::symlink(portmap_bin(), cni_path.join("portmap")).unwrap();
        for p in ["bridge", "host-local"] {
            std::os::unix::fs::symlink(Path::new(CNI_BIN).join(p), cni_path.join(p)).unwrap();
        }
        let legacy = dir.join("legacy");
        std::fs::create_dir_all(&legacy).unwrap();
        let legacy = legacy.join("portmap");
        std::os::unix::fs::symlink(nftkube_bin(), &legacy).unwrap();
        Node {
            sb,
            dir,
            cni_path,
            legacy,
        }
    }

    fn ns(&self) -> &NetNs {
        self.sb.node()
    }

    /// Runs plugin `plugin` with the CNI variables and `conf` on stdin, in the node namespace. Returns the exit
    /// status's success and stdout parsed as JSON (Null when empty).
    fn invoke(
        &self,
        plugin: &str,
        command: &str,
        att: Option<(&Container, &str)>,
        conf: &Value,
    ) -> (bool, Value) {
        self.invoke_program(&self.cni_path.join(plugin), command, att, conf)
    }

    /// [`Node::invoke`] of the executable at `program`.
    fn invoke_program(
        &self,
        program: &Path,
        command: &str,
        att: Option<(&Container, &str)>,
        conf: &Value,
    ) -> (bool, Value) {
        let mut cmd = self.ns().command(program);
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", &self.cni_path);
        if let Some((c, ifname)) = att {
            cmd.env("CNI_CONTAINERID", &c.id)
                .env("CNI_NETNS", c.ns.path())
                .env("CNI_IFNAME", ifname);
        }
        run_with_stdin(cmd, conf)
    }

    /// The interface plugin's ADD (bridge, with host-local): its result, portmap's prevResult.
    fn bridge_up(&self, net: &Network, c: &Container, ifname: &str) -> Value {
        let (ok, prev) = self.invoke(
            "bridge",
            "ADD",
            Some((c, ifname)),
            &net.bridge_conf(&self.dir),
        );
        assert!(ok, "bridge ADD failed: {prev}");
        prev
    }

    /// ADD as a runtime chains it: bridge (with host-local), then portmap with bridge's result as prevResult.
    fn attach(&self, net: &Network, c: &Container, ifname: &str, mappings: Value) -> Value {
        let prev = self.bridge_up(net, c, ifname);
        let conf = net.portmap_conf(Some(&prev), mappings);
        let (ok, out) = self.invoke("portmap", "ADD", Some((c, ifname)), &conf);
        assert!(ok, "portmap ADD failed: {out}");
        assert_eq!(
            out["cniVersion"], net.version,
            "the result is in the requested version"
        );
        assert_eq!(
            out["ips"], prev["ips"],
            "portmap passes the previous result on"
        );
        assert_listable(self.ns());
        prev
    }

    /// portmap ADD alone, again (a runtime retrying): must succeed and change nothing.
    fn portmap(
        &self,
        command: &str,
        net: &Network,
        c: &Container,
        ifname: &str,
        prev: &Value,
        mappings: Value,
    ) -> (bool, Value) {
        let out = self.invoke(
            "portmap",
            command,
            Some((c, ifname)),
            &net.portmap_conf(Some(prev), mappings),
        );
        assert_listable(self.ns());
        out
    }

    /// DEL as a runtime chains it: portmap first, then bridge.
    fn detach(&self, net: &Network, c: &Container, ifname: &str, prev: &Value, mappings: Value) {
        let (ok, out) = self.portmap("DEL", net, c, ifname, prev, mappings);
        assert!(ok, "portmap DEL failed: {out}");
        let (ok, out) = self.invoke(
            "bridge",
            "DEL",
            Some((c, ifname)),
            &net.bridge_conf(&self.dir),
        );
        assert!(ok, "bridge DEL failed: {out}");
        assert_listable(self.ns());
    }

    /// The elements of set `set` of the plugin's table: (key bytes, comment).
    fn elements(&self, family: Family, set: &str) -> Vec<(Vec<u8>, Option<String>)> {
        let set = set.to_owned();
        self.ns()
            .run(move || {
                let mut s = NftSocket::open().unwrap();
                s.dump_set_commented(family, TABLE, &set)
                    .map(|v| v.into_iter().map(|(e, c)| (e.key.to_vec(), c)).collect())
                    .unwrap_or_default()
            })
            .unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        // The plugin's records of this namespace: a later namespace may get the same inode. (No panic in
        // a drop that may run while a failed test unwinds.)
        if let Some(dir) = records_dir(self.ns()) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Where the plugin records the attachments of the namespace `ns` (by its device and inode).
fn records_dir(ns: &NetNs) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(ns.path()).ok()?;
    Some(PathBuf::from(format!(
        "/run/nftkube-portmap/netns-{}-{}",
        m.dev(),
        m.ino()
    )))
}

fn run_with_stdin(mut cmd: std::process::Command, stdin: &Value) -> (bool, Value) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running a CNI plugin");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!(
                "plugin stdout is not JSON ({e}): {text}\nstderr: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
    };
    (out.status.success(), value)
}

/// A CNI network: a bridge with a subnet per family, and portmap's settings.
struct Network {
    name: &'static str,
    bridge: &'static str,
    subnet4: &'static str,
    subnet6: &'static str,
    version: &'static str,
    extra: Value,
}

impl Network {
    fn a() -> Network {
        Network {
            name: "net-a",
            bridge: "pmbr-a",
            subnet4: "10.99.0.0/24",
            subnet6: "fd99::/64",
            version: "1.0.0",
            extra: json!({}),
        }
    }
    fn b() -> Network {
        Network {
            name: "net-b",
            bridge: "pmbr-b",
            subnet4: "10.98.0.0/24",
            subnet6: "fd98::/64",
            version: "0.4.0",
            extra: json!({}),
        }
    }

    fn bridge_conf(&self, dir: &Path) -> Value {
        json!({
            "cniVersion": self.version, "name": self.name, "type": "bridge",
            "bridge": self.bridge, "isGateway": true, "ipMasq": false, "hairpinMode": true,
            "ipam": {"type": "host-local", "dataDir": dir.join("ipam"),
                     "ranges": [[{"subnet": self.subnet4}], [{"subnet": self.subnet6}]],
                     "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}
        })
    }

    fn portmap_conf(&self, prev: Option<&Value>, mappings: Value) -> Value {
        let mut c = json!({
            "cniVersion": self.version, "name": self.name, "type": "portmap",
            "capabilities": {"portMappings": true},
            "runtimeConfig": {"portMappings": mappings},
        });
        if let Some(p) = prev {
            c["prevResult"] = p.clone();
        }
        for (k, v) in self.extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }
}

/// A container: its own namespace, with a TCP server on port 80 and a UDP server on 5353 that answer its name.
struct Container {
    id: String,
    ns: NetNs,
    stop: Arc<AtomicBool>,
}

impl Container {
    fn start(name: &str) -> Container {
        let ns = NetNs::create(&unique_name("pmc")).unwrap();
        ns.run(|| {
            netns::set_link_up("lo").unwrap();
            // Addresses usable at once, not tentative for duplicate address detection.
            netns::set_sysctl("net/ipv6/conf/all/accept_dad", "0").unwrap();
            netns::set_sysctl("net/ipv6/conf/default/accept_dad", "0").unwrap();
        })
        .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let id = format!("{name}-{}", unique_name("id"));
        let (tag, flag) = (name.to_owned(), Arc::clone(&stop));
        let tcp = ns
            .run(|| TcpListener::bind(("::", TCP_PORT)))
            .unwrap()
            .unwrap();
        tcp.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match tcp.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.write_all(format!("{tag}\n").as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        let (tag, flag) = (name.to_owned(), Arc::clone(&stop));
        let udp = ns
            .run(|| UdpSocket::bind(("::", UDP_PORT)))
            .unwrap()
            .unwrap();
        udp.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while !flag.load(Ordering::Relaxed) {
                if let Ok((_, peer)) = udp.recv_from(&mut buf) {
                    let _ = udp.send_to(tag.as_bytes(), peer);
                }
            }
        });
        Container { id, ns, stop }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn tcp(ns: &NetNs, ip: IpAddr, port: u16) -> std::io::Result<String> {
    sandbox::tcp_request(ns, SocketAddr::new(ip, port), WAIT)
}

fn udp(ns: &NetNs, ip: IpAddr, port: u16) -> std::io::Result<String> {
    sandbox::udp_request(ns, SocketAddr::new(ip, port), WAIT)
}

/// Fails unless nothing answers (refused, or silence within SHORT).
#[track_caller]
fn assert_unanswered(r: std::io::Result<String>, what: &str) {
    match r {
        Ok(a) => panic!("{what}: answered {a:?}, expected no answer"),
        Err(e) => assert!(
            matches!(
                e.kind(),
                ErrorKind::ConnectionRefused | ErrorKind::TimedOut | ErrorKind::WouldBlock
            ),
            "{what}: {e}"
        ),
    }
}

fn tcp_short(ns: &NetNs, ip: IpAddr, port: u16) -> std::io::Result<String> {
    sandbox::tcp_request(ns, SocketAddr::new(ip, port), SHORT)
}

fn udp_short(ns: &NetNs, ip: IpAddr, port: u16) -> std::io::Result<String> {
    sandbox::udp_request(ns, SocketAddr::new(ip, port), SHORT)
}

fn mapping(host: u16, container: u16, proto: &str) -> Value {
    json!({"hostPort": host, "containerPort": container, "protocol": proto})
}

fn gateway(net: &Network) -> IpAddr {
    let base: std::net::Ipv4Addr = net.subnet4.split('/').next().unwrap().parse().unwrap();
    let o = base.octets();
    IpAddr::from([o[0], o[1], o[2], 1])
}

fn v4(ip: std::net::Ipv4Addr) -> IpAddr {
    ip.into()
}

#[test]
fn tcp_udp_from_outside_localhost_hairpin_hostip_and_ipv6() {
    let node = Node::new("pm-basic");
    let net = Network::a();
    let c1 = Container::start("c1");
    let maps = json!([
        mapping(8080, TCP_PORT, "tcp"),
        mapping(8053, UDP_PORT, "udp"),
        {"hostPort": 8081, "containerPort": TCP_PORT, "protocol": "tcp", "hostIP": node_ip_v4().to_string()},
    ]);
    let prev = node.attach(&net, &c1, "eth0", maps.clone());
    let (ext, here) = (node.sb.ext(), node.ns());
    let (n4, n6) = (v4(node_ip_v4()), IpAddr::from(node_ip_v6()));

    assert_eq!(tcp(ext, n4, 8080).unwrap(), "c1", "TCP from outside");
    assert_eq!(udp(ext, n4, 8053).unwrap(), "c1", "UDP from outside");
    assert_eq!(tcp(ext, n6, 8080).unwrap(), "c1", "TCP over IPv6");
    assert_eq!(udp(ext, n6, 8053).unwrap(), "c1", "UDP over IPv6");
    let lo = v4(std::net::Ipv4Addr::LOCALHOST);
    assert_eq!(
        tcp(here, lo, 8080).unwrap(),
        "c1",
        "TCP from 127.0.0.1 on the node"
    );
    assert_eq!(
        udp(here, lo, 8053).unwrap(),
        "c1",
        "UDP from 127.0.0.1 on the node"
    );
    // Hairpin: the container reaches its own host port; without SNAT its answer would bypass the node.
    assert_eq!(tcp(&c1.ns, n4, 8080).unwrap(), "c1", "hairpin TCP");
    assert_eq!(udp(&c1.ns, n4, 8053).unwrap(), "c1", "hairpin UDP");
    // A neighbour on the same bridge: c1's answer would go straight back over the bridge without SNAT.
    let c2 = Container::start("c2");
    node.attach(&net, &c2, "eth0", json!([]));
    assert_eq!(
        tcp(&c2.ns, n4, 8080).unwrap(),
        "c1",
        "a neighbour's TCP to c1's host port"
    );
    assert_eq!(
        udp(&c2.ns, n4, 8053).unwrap(),
        "c1",
        "a neighbour's UDP to c1's host port"
    );
    // A hostIP mapping answers on that address only, and only in its family.
    assert_eq!(tcp(ext, n4, 8081).unwrap(), "c1", "hostIP mapping");
    assert_unanswered(
        tcp_short(here, gateway(&net), 8081),
        "hostIP mapping on another node address",
    );
    assert_unanswered(tcp_short(ext, n6, 8081), "an IPv4 hostIP mapping over IPv6");

    // A repeated ADD changes nothing: the same elements, owned the same way.
    let before = node.elements(Family::Ip, "ports-net-a");
    assert_eq!(before.len(), 2, "{before:?}");
    let comment = format!("{} eth0", c1.id);
    assert!(
        before
            .iter()
            .all(|(_, c)| c.as_deref() == Some(comment.as_str())),
        "{before:?}"
    );
    let (ok, out) = node.portmap("ADD", &net, &c1, "eth0", &prev, maps.clone());
    assert!(ok, "{out}");
    assert_eq!(node.elements(Family::Ip, "ports-net-a"), before);
    let (ok, out) = node.portmap("CHECK", &net, &c1, "eth0", &prev, maps.clone());
    assert!(ok, "CHECK of a complete attachment: {out}");

    node.detach(&net, &c1, "eth0", &prev, maps.clone());
    assert_unanswered(tcp_short(ext, n4, 8080), "TCP after DEL");
    assert_unanswered(udp_short(ext, n4, 8053), "UDP after DEL");
    for set in ["ports-net-a", "hostip-net-a", "targets-net-a"] {
        assert!(node.elements(Family::Ip, set).is_empty(), "{set} after DEL");
        assert!(
            node.elements(Family::Ip6, set).is_empty(),
            "ip6 {set} after DEL"
        );
    }
    // DEL of something absent succeeds.
    let (ok, out) = node.portmap("DEL", &net, &c1, "eth0", &prev, maps);
    assert!(ok, "a second DEL: {out}");
}

/// route_localnet cannot be set on a node-side interface of the previous result (here: it is gone): ADD fails
/// and leaves no mapping behind, in the kernel or on the wire (whether a runtime calls DEL after a failed ADD
/// is up to the runtime).
#[test]
fn a_failed_route_localnet_write_leaves_no_mapping() {
    let node = Node::new("pm-lnet");
    let net = Network::a();
    let c1 = Container::start("c1");
    let mut prev = node.bridge_up(&net, &c1, "eth0");
    // The bridge, as if deleted since: /proc/sys/net/ipv4/conf/pmgone0/route_localnet does not exist.
    let bridge = prev["interfaces"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|i| i["name"] == net.bridge)
        .expect("the bridge in the previous result");
    bridge["name"] = json!("pmgone0");
    let maps = json!([mapping(8080, TCP_PORT, "tcp")]);
    let (ok, out) = node.portmap("ADD", &net, &c1, "eth0", &prev, maps);
    assert!(!ok, "ADD succeeded without route_localnet: {out}");
    assert_eq!(out["code"], 5, "an I/O failure: {out}");
    assert!(
        out["msg"]
            .as_str()
            .unwrap()
            .contains("pmgone0/route_localnet"),
        "{out}"
    );
    for set in ["ports-net-a", "hostip-net-a", "targets-net-a"] {
        assert!(
            node.elements(Family::Ip, set).is_empty(),
            "{set} after a failed ADD"
        );
        assert!(
            node.elements(Family::Ip6, set).is_empty(),
            "ip6 {set} after a failed ADD"
        );
    }
    let n4 = v4(node_ip_v4());
    assert_unanswered(
        tcp_short(node.sb.ext(), n4, 8080),
        "a mapping of a failed ADD",
    );
}

/// Parses `aa:bb:cc:dd:ee:ff`.
fn mac(text: &str) -> [u8; 6] {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).expect("a MAC address byte"))
        .collect();
    bytes.try_into().expect("six bytes")
}

/// The MAC address of interface `name` in a CNI result.
fn result_mac(result: &Value, name: &str) -> [u8; 6] {
    let iface = result["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == name)
        .unwrap_or_else(|| panic!("no interface {name} in {result}"));
    mac(iface["mac"].as_str().expect("a mac"))
}

/// The Internet checksum of an IPv4 header.
fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet frame holding an IPv4 UDP datagram (UDP checksum 0: none, which IPv4 allows).
fn udp_frame(
    macs: ([u8; 6], [u8; 6]),
    src: std::net::SocketAddrV4,
    dst: std::net::SocketAddrV4,
    payload: &[u8],
) -> Vec<u8> {
    let (src_mac, dst_mac) = macs;
    let udp_len = 8 + payload.len() as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
    ip[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
    ip.extend(src.ip().octets());
    ip.extend(dst.ip().octets());
    let checksum = ipv4_checksum(&ip);
    ip[10..12].copy_from_slice(&checksum.to_be_bytes());
    let mut frame = Vec::new();
    frame.extend(dst_mac);
    frame.extend(src_mac);
    frame.extend(0x0800u16.to_be_bytes());
    frame.extend(ip);
    frame.extend(src.port().to_be_bytes());
    frame.extend(dst.port().to_be_bytes());
    frame.extend(udp_len.to_be_bytes());
    frame.extend([0, 0]);
    frame.extend(payload);
    frame
}

/// Sends `frame` out of interface `ifname` of `ns` through a packet socket: as a container could, whatever its
/// own routes say (its loopback would take 127.0.0.1).
fn send_frame(ns: &NetNs, ifname: &str, frame: Vec<u8>) {
    let ifname = std::ffi::CString::new(ifname).unwrap();
    ns.run(move || {
        // SAFETY: if_nametoindex reads a NUL-terminated string; socket, sendto and close take plain values
        // and pointers to the initialised `addr` and `frame`, which outlive the calls.
        unsafe {
            let ifindex = libc::if_nametoindex(ifname.as_ptr());
            assert_ne!(ifindex, 0, "no interface {ifname:?}");
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
            assert!(
                fd >= 0,
                "packet socket: {}",
                std::io::Error::last_os_error()
            );
            let mut addr: libc::sockaddr_ll = std::mem::zeroed();
            addr.sll_family = libc::AF_PACKET as u16;
            addr.sll_protocol = 0x0800u16.to_be();
            addr.sll_ifindex = ifindex as i32;
            addr.sll_halen = 6;
            addr.sll_addr[..6].copy_from_slice(&frame[..6]);
            let sent = libc::sendto(
                fd,
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            let error = std::io::Error::last_os_error();
            libc::close(fd);
            assert_eq!(sent, frame.len() as isize, "sending the frame: {error}");
        }
    })
    .unwrap();
}

/// ADD turns route_localnet on for 127.0.0.1 mappings, which also lets a container's packets to 127.0.0.0/8
/// in over the bridge: the plugin's own guard drops them (no agent runs here), so a service bound to the
/// node's loopback is out of the containers' reach, the mapped container's and a second one's on the same
/// bridge with no mapping of its own. Without the guard the same packet gets there.
#[test]
fn containers_do_not_reach_the_nodes_loopback_through_route_localnet() {
    let node = Node::new("pm-mart");
    let net = Network::a();
    let (c1, c2) = (Container::start("c1"), Container::start("c2"));
    let prev1 = node.attach(&net, &c1, "eth0", json!([mapping(8080, TCP_PORT, "tcp")]));
    let prev = node.bridge_up(&net, &c2, "eth0");
    let lo_port = 9999;
    let service = node
        .ns()
        .run(move || UdpSocket::bind(("127.0.0.1", lo_port)))
        .unwrap()
        .unwrap();
    service.set_read_timeout(Some(SHORT)).unwrap();
    let address = |prev: &Value| -> std::net::Ipv4Addr {
        match prev["ips"][0]["address"].as_str().unwrap().split_once('/') {
            Some((ip, _)) => ip.parse().unwrap(),
            None => panic!("no container address in {prev}"),
        }
    };
    let frame_from = |prev: &Value| {
        udp_frame(
            (result_mac(prev, "eth0"), result_mac(prev, net.bridge)),
            std::net::SocketAddrV4::new(address(prev), 40000),
            std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, lo_port),
            b"martian",
        )
    };
    let container_ip = address(&prev);
    let frame = frame_from(&prev);
    let mut buf = [0u8; 64];
    for (c, frame) in [(&c1, frame_from(&prev1)), (&c2, frame.clone())] {
        send_frame(&c.ns, "eth0", frame);
        if let Ok((n, from)) = service.recv_from(&mut buf) {
            panic!(
                "the node's loopback service got {:?} from {from}",
                String::from_utf8_lossy(&buf[..n])
            );
        }
    }
    // Without the guard chains the same frame reaches it: the test sends what a container could.
    node.ns()
        .run(|| {
            let mut tx = Transaction::default();
            for chain in ["guard-in-net-a", "guard-fwd-net-a"] {
                tx.push(Family::Ip, TABLE, Op::FlushChain(chain.into()));
                tx.push(Family::Ip, TABLE, Op::DeleteChain(chain.into()));
            }
            NftSocket::open().unwrap().commit(&tx).unwrap();
        })
        .unwrap();
    send_frame(&c2.ns, "eth0", frame);
    let (n, from) = service
        .recv_from(&mut buf)
        .expect("without the guard the frame reaches the loopback service");
    assert_eq!(
        (&buf[..n], from.ip()),
        (&b"martian"[..], IpAddr::from(container_ip))
    );
}

#[test]
fn a_second_container_takes_over_a_udp_port_at_once() {
    let node = Node::new("pm-udp");
    let net = Network::a();
    let (c1, c2) = (Container::start("c1"), Container::start("c2"));
    let maps = json!([mapping(8053, UDP_PORT, "udp")]);
    let prev1 = node.attach(&net, &c1, "eth0", maps.clone());

    // One client socket, one source port, sending all along: its conntrack entry would glue it to c1.
    let dst = SocketAddr::new(v4(node_ip_v4()), 8053);
    let sock = node
        .sb
        .ext()
        .run(|| {
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            s.connect(dst).unwrap();
            s
        })
        .unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let ask = |s: &UdpSocket| -> Option<String> {
        let _ = s.send(b"hi");
        let mut buf = [0u8; 64];
        s.recv(&mut buf)
            .ok()
            .map(|n| String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    assert!(
        (0..20).any(|_| ask(&sock).as_deref() == Some("c1")),
        "c1 answers first"
    );

    node.detach(&net, &c1, "eth0", &prev1, maps.clone());
    // The client keeps sending while nobody holds the port (an un-NATed entry to the node itself).
    for _ in 0..5 {
        assert_ne!(ask(&sock).as_deref(), Some("c1"));
    }
    node.attach(&net, &c2, "eth0", maps);
    // Without the cleanup the entry made while the port was unmapped would live for UDP's conntrack timeout
    // (30 s unreplied, 120 s assured) and no packet of this client would reach c2.
    let answers: Vec<Option<String>> = (0..3)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            ask(&sock)
        })
        .collect();
    assert_eq!(
        answers.first().cloned().flatten().as_deref(),
        Some("c2"),
        "answers after ADD of c2: {answers:?}"
    );
}

#[test]
fn networks_are_independent_for_del_and_conditions() {
    let node = Node::new("pm-nets");
    let mut a = Network::a();
    // Network A only forwards for the outside client; network B has no conditions.
    a.extra = json!({"conditionsV4": [format!("ip saddr {}", ext_ip_v4())]});
    let b = Network::b();
    let c1 = Container::start("c1");
    let maps_a = json!([mapping(8080, TCP_PORT, "tcp")]);
    let maps_b = json!([mapping(9090, TCP_PORT, "tcp")]);
    let prev_a = node.attach(&a, &c1, "eth0", maps_a.clone());
    let _prev_b = node.attach(&b, &c1, "eth1", maps_b.clone());
    let (ext, here) = (node.sb.ext(), node.ns());
    let (n4, lo) = (v4(node_ip_v4()), v4(std::net::Ipv4Addr::LOCALHOST));

    assert_eq!(
        tcp(ext, n4, 8080).unwrap(),
        "c1",
        "A from the allowed client"
    );
    assert_unanswered(
        tcp_short(here, lo, 8080),
        "A from 127.0.0.1, which A's conditions leave out",
    );
    assert_eq!(
        tcp(here, lo, 9090).unwrap(),
        "c1",
        "B from 127.0.0.1: A's conditions are not B's"
    );
    assert_eq!(tcp(ext, n4, 9090).unwrap(), "c1", "B from outside");

    // The same container id on both networks: DEL on A leaves B's mapping alone.
    node.detach(&a, &c1, "eth0", &prev_a, maps_a);
    assert_unanswered(tcp_short(ext, n4, 8080), "A after DEL on A");
    assert_eq!(tcp(ext, n4, 9090).unwrap(), "c1", "B after DEL on A");
    assert_eq!(node.elements(Family::Ip, "ports-net-b").len(), 1);
}

#[test]
fn check_gc_status_and_version() {
    let node = Node::new("pm-gc");
    let net = Network::a();
    let (c1, c2) = (Container::start("c1"), Container::start("c2"));
    let maps1 = json!([
        mapping(8080, TCP_PORT, "tcp"),
        mapping(8081, TCP_PORT, "tcp")
    ]);
    let maps2 = json!([mapping(9090, TCP_PORT, "tcp")]);
    let prev1 = node.attach(&net, &c1, "eth0", maps1.clone());
    let prev2 = node.attach(&net, &c2, "eth0", maps2.clone());
    let (ext, n4) = (node.sb.ext(), v4(node_ip_v4()));

    let (ok, out) = node.portmap("CHECK", &net, &c1, "eth0", &prev1, maps1.clone());
    assert!(ok, "{out}");
    // Someone removes c1's 8080 element: CHECK says so.
    let key: Vec<u8> = [vec![6, 0, 0, 0], 8080u16.to_be_bytes().to_vec(), vec![0, 0]].concat();
    let victim = node
        .elements(Family::Ip, "ports-net-a")
        .into_iter()
        .find(|(k, _)| *k == key)
        .expect("c1's 8080 element");
    node.ns()
        .run(move || {
            let mut tx = Transaction::default();
            let element = nftkube::nft::ir::Element {
                key: victim.0.into(),
                value: None,
            };
            tx.push(
                Family::Ip,
                TABLE,
                Op::DeleteElements {
                    set: "ports-net-a".into(),
                    elements: vec![element],
                },
            );
            NftSocket::open().unwrap().commit(&tx).unwrap();
        })
        .unwrap();
    let (ok, out) = node.portmap("CHECK", &net, &c1, "eth0", &prev1, maps1.clone());
    assert!(!ok, "CHECK after a mapping was removed must fail");
    assert_eq!(out["code"], 100, "{out}");
    assert!(
        out["msg"].as_str().unwrap().contains("ports-net-a"),
        "{out}"
    );
    let (ok, out) = node.portmap("CHECK", &net, &c2, "eth0", &prev2, maps2.clone());
    assert!(ok, "c2 is untouched: {out}");

    // GC with only c2 valid: c1's remaining mapping goes, c2's stays.
    assert_eq!(tcp(ext, n4, 8081).unwrap(), "c1");
    let mut gc = net.portmap_conf(None, json!([]));
    gc["cni.dev/valid-attachments"] = json!([{"containerID": c2.id, "ifname": "eth0"}]);
    gc.as_object_mut().unwrap().remove("runtimeConfig");
    let (ok, out) = node.invoke("portmap", "GC", None, &gc);
    assert!(ok, "GC: {out}");
    assert_listable(node.ns());
    assert_unanswered(tcp_short(ext, n4, 8081), "c1's port after GC");
    assert_eq!(tcp(ext, n4, 9090).unwrap(), "c2", "c2's port after GC");
    let owners: Vec<Option<String>> = ["ports-net-a", "targets-net-a"]
        .iter()
        .flat_map(|s| node.elements(Family::Ip, s))
        .map(|(_, c)| c)
        .collect();
    assert!(
        owners
            .iter()
            .all(|c| c.as_deref() == Some(format!("{} eth0", c2.id).as_str())),
        "{owners:?}"
    );

    let (ok, out) = node.invoke(
        "portmap",
        "STATUS",
        None,
        &net.portmap_conf(None, json!([])),
    );
    assert!(ok && out.is_null(), "STATUS: {out}");
    let (ok, out) = node.invoke("portmap", "VERSION", None, &json!({"cniVersion": "1.1.0"}));
    assert!(ok, "{out}");
    assert!(
        out["supportedVersions"]
            .as_array()
            .unwrap()
            .contains(&json!("1.1.0")),
        "{out}"
    );
}

/// The agent binary under the name `portmap` (nodes that installed it so before nftkube-portmap existed) is
/// the same plugin: it checks and deletes what nftkube-portmap added, over the same tables.
#[test]
fn the_agent_binary_named_portmap_is_the_same_plugin() {
    let node = Node::new("pm-legacy");
    let net = Network::a();
    let c1 = Container::start("c1");
    let maps = json!([mapping(8080, TCP_PORT, "tcp")]);
    let prev = node.attach(&net, &c1, "eth0", maps.clone());
    let (ext, n4) = (node.sb.ext(), v4(node_ip_v4()));
    assert_eq!(tcp(ext, n4, 8080).unwrap(), "c1");
    let conf = net.portmap_conf(Some(&prev), maps);
    for command in ["CHECK", "DEL"] {
        let (ok, out) = node.invoke_program(&node.legacy, command, Some((&c1, "eth0")), &conf);
        assert!(ok, "{command} through nftkube as portmap: {out}");
        assert_listable(node.ns());
    }
    assert_unanswered(tcp_short(ext, n4, 8080), "the port after DEL");
    let (ok, out) = node.invoke("portmap", "CHECK", Some((&c1, "eth0")), &conf);
    assert!(!ok, "CHECK after DEL must fail: {out}");
}

#[test]
fn bad_configs_are_refused_naming_the_field_and_change_nothing() {
    let node = Node::new("pm-bad");
    let net = Network::a();
    let (c1, c2) = (Container::start("c1"), Container::start("c2"));
    let maps = json!([mapping(8080, TCP_PORT, "tcp")]);
    let prev = node.attach(&net, &c1, "eth0", maps);
    let prev2 = node.bridge_up(&net, &c2, "eth0");
    let good = || net.portmap_conf(Some(&prev2), json!([mapping(9090, TCP_PORT, "tcp")]));
    let with_mapping = |m: Value| net.portmap_conf(Some(&prev2), json!([m]));
    let mut wrong_version = good();
    wrong_version["cniVersion"] = json!("0.2.0");
    let mut no_name = good();
    no_name.as_object_mut().unwrap().remove("name");
    let mut bad_conditions = good();
    bad_conditions["conditionsV4"] = json!(["ip saddr 10.0.0.0/8 accept; flush ruleset"]);
    let cases = [
        (
            with_mapping(json!({"containerPort": 80, "protocol": "tcp"})),
            7,
            "portMappings[0].hostPort: missing",
        ),
        (
            with_mapping(json!({"hostPort": 0, "containerPort": 80, "protocol": "tcp"})),
            7,
            "portMappings[0].hostPort: 0",
        ),
        (
            with_mapping(json!({"hostPort": 65536, "containerPort": 80, "protocol": "tcp"})),
            7,
            "hostPort: 65536",
        ),
        (
            with_mapping(json!({"hostPort": 80, "containerPort": 80, "protocol": "icmp"})),
            7,
            "protocol: \"icmp\"",
        ),
        (bad_conditions, 7, "conditionsV4[0]"),
        (wrong_version, 1, "cniVersion"),
        (no_name, 7, "name: missing"),
    ];
    for (conf, code, field) in cases {
        // Through `nftkube portmap`, the agent binary's subcommand (kept for nodes set up before
        // nftkube-portmap).
        let mut cmd = node.ns().command(nftkube_bin());
        cmd.arg("portmap")
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", &c2.id)
            .env("CNI_NETNS", c2.ns.path())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", &node.cni_path);
        let (ok, out) = run_with_stdin(cmd, &conf);
        assert!(!ok, "accepted: {conf}");
        assert_eq!(out["code"], code, "{out}");
        assert!(
            out["msg"].as_str().unwrap().contains(field),
            "{field}: {out}"
        );
        assert_listable(node.ns());
    }
    let (ext, n4) = (node.sb.ext(), v4(node_ip_v4()));
    assert_eq!(
        tcp(ext, n4, 8080).unwrap(),
        "c1",
        "the valid mapping keeps working"
    );
    assert_unanswered(tcp_short(ext, n4, 9090), "nothing of the refused configs");
    let (ok, out) = node.invoke("portmap", "ADD", Some((&c2, "eth0")), &good());
    assert!(ok, "{out}");
    assert_eq!(tcp(ext, n4, 9090).unwrap(), "c2");
    let _ = prev;
    // Without prevResult (not chained) ADD is refused too.
    let (ok, out) = node.invoke(
        "portmap",
        "ADD",
        Some((&c2, "eth0")),
        &net.portmap_conf(None, json!([mapping(1, 1, "tcp")])),
    );
    assert!(
        !ok && out["msg"].as_str().unwrap().contains("prevResult"),
        "{out}"
    );
}

/// A container runtime: Debian's podman (CNI backend, runc) runs a container from a local root filesystem
/// (busybox-static, no image pull) with `-p 18080:8080` on a network whose plugin list is bridge, then
/// nftkube's portmap (`nftkube-portmap`). Podman runs in the test's node namespace (so the bridge is made
/// there); its configuration, storage and state live in the test's directory. (libcni itself keeps its result
/// cache under /var/lib/cni/results, which podman cannot move; `podman rm` empties it again.)
#[test]
fn podman_publishes_a_port_through_nftkube_portmap() {
    let node = Node::new("pm-podman");
    for tool in ["podman", "runc", "conmon"] {
        assert!(
            which(tool),
            "{tool} missing: install podman, runc and busybox-static (ci/install-deps does)"
        );
    }
    let pod = Podman::new(&node);
    let name = unique_name("pmpod");
    let id = pod.run(&[
        "run",
        "-d",
        "--name",
        &name,
        "--network",
        "pmnet",
        "-p",
        "18080:8080",
        "--rootfs",
        pod.rootfs().to_str().unwrap(),
        "/bin/busybox",
        "httpd",
        "-f",
        "-p",
        "8080",
        "-h",
        "/www",
    ]);
    let _cleanup = Removal {
        pod: &pod,
        name: &name,
    };
    assert_listable(node.ns());
    let page = http_get(node.sb.ext(), SocketAddr::new(v4(node_ip_v4()), 18080));
    assert!(page.contains("served by podman"), "{page}");
    let comments: Vec<Option<String>> = node
        .elements(Family::Ip, "ports-pmnet")
        .into_iter()
        .map(|(_, c)| c)
        .collect();
    assert_eq!(
        comments,
        vec![Some(format!("{id} eth0"))],
        "the element names podman's container"
    );

    pod.run(&["rm", "-f", "-t", "0", &name]);
    assert_listable(node.ns());
    assert!(
        node.elements(Family::Ip, "ports-pmnet").is_empty(),
        "DEL through podman rm"
    );
    assert_unanswered(
        tcp_short(node.sb.ext(), v4(node_ip_v4()), 18080),
        "the port after podman rm",
    );
}

fn which(tool: &str) -> bool {
    [
        "/usr/bin",
        "/usr/sbin",
        "/bin",
        "/sbin",
        "/usr/libexec/podman",
    ]
    .iter()
    .any(|d| Path::new(d).join(tool).exists())
}

/// Podman's configuration in the test's directory: containers.conf (runc, cgroupfs, CNI with the test's plugin
/// and configuration directories, explicit ulimits), storage.conf (vfs, graph and run roots), the network
/// `pmnet`, and a busybox root filesystem serving one page.
struct Podman {
    dir: PathBuf,
    ns_path: PathBuf,
    ns_name: String,
}

impl Podman {
    fn new(node: &Node) -> Podman {
        let dir = node.dir.join("podman");
        let rootfs = dir.join("rootfs");
        for d in ["bin", "www", "proc", "sys", "dev", "etc", "tmp"] {
            std::fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        std::fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
            .expect("/bin/busybox (busybox-static) missing");
        std::fs::write(rootfs.join("www/index.html"), "served by podman\n").unwrap();
        let (conf_dir, bin) = (dir.join("net.d"), dir.join("cni-bin"));
        std::fs::create_dir_all(&conf_dir).unwrap();
        std::fs::create_dir_all(&bin).unwrap();
        for p in ["bridge", "host-local", "loopback"] {
            std::os::unix::fs::symlink(Path::new(CNI_BIN).join(p), bin.join(p)).unwrap();
        }
        std::os::unix::fs::symlink(portmap_bin(), bin.join("nftkube-portmap")).unwrap();
        let conflist = json!({"cniVersion": "1.0.0", "name": "pmnet", "plugins": [
            {"type": "bridge", "bridge": "pmpod0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
             "ipam": {"type": "host-local", "dataDir": dir.join("ipam"),
                      "ranges": [[{"subnet": "10.97.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "nftkube-portmap", "capabilities": {"portMappings": true}}]});
        std::fs::write(conf_dir.join("pmnet.conflist"), conflist.to_string()).unwrap();
        let d = dir.display();
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                "[containers]\ndefault_ulimits = [\"nofile=20000:20000\", \"nproc=32768:32768\"]\n\
                 [engine]\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n\
                 events_logfile_path = \"{d}/events.log\"\ntmp_dir = \"{d}/tmp\"\n\
                 [network]\nnetwork_backend = \"cni\"\ncni_plugin_dirs = [\"{}\"]\nnetwork_config_dir = \"{}\"\n",
                bin.display(),
                conf_dir.display()
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"vfs\"\nrunroot = \"{d}/run\"\ngraphroot = \"{d}/storage\"\n"
            ),
        )
        .unwrap();
        Podman {
            dir,
            ns_path: node.ns().path().to_owned(),
            ns_name: node.ns().name().to_owned(),
        }
    }

    fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    /// Runs podman in the node namespace; panics unless it succeeds; returns its stdout, trimmed.
    fn run(&self, args: &[&str]) -> String {
        let ns = NetNs::open_existing(&self.ns_name).expect("the node namespace");
        assert_eq!(ns.path(), self.ns_path);
        let out = ns
            .command("podman")
            .args(args)
            .env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .env("CONTAINERS_STORAGE_CONF", self.dir.join("storage.conf"))
            .output()
            .expect("running podman");
        assert!(
            out.status.success(),
            "podman {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

/// Removes the container even when the test fails half-way (its conmon would outlive the test).
struct Removal<'a> {
    pod: &'a Podman,
    name: &'a str,
}

impl Drop for Removal<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let ns = NetNs::open_existing(&self.pod.ns_name).expect("the node namespace");
            let _ = ns
                .command("podman")
                .args(["rm", "-f", "-t", "0", self.name])
                .env("CONTAINERS_CONF", self.pod.dir.join("containers.conf"))
                .env("CONTAINERS_STORAGE_CONF", self.pod.dir.join("storage.conf"))
                .output();
        }
    }
}

/// `GET /` over HTTP/1.0 from `ns`; the whole answer.
fn http_get(ns: &NetNs, dst: SocketAddr) -> String {
    ns.run(move || {
        let mut s = std::net::TcpStream::connect_timeout(&dst, WAIT)?;
        s.set_read_timeout(Some(WAIT))?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
        let mut out = String::new();
        std::io::Read::read_to_string(&mut s, &mut out)?;
        Ok::<_, std::io::Error>(out)
    })
    .unwrap()
    .unwrap_or_else(|e| panic!("GET http://{dst}/: {e}"))
}

/// Runtimes create pods in parallel: concurrent ADDs on one network, each its own process, all land (a batch
/// refused because another invocation changed the same objects is read, planned and sent again), and each
/// port reaches its own container.
#[test]
fn concurrent_adds_on_one_network_all_land() {
    let node = Node::new("pm-par");
    let net = Network::a();
    let containers: Vec<Container> = (0..6).map(|i| Container::start(&format!("p{i}"))).collect();
    // The interfaces first, one by one (host-local's own lock is not what is tested here).
    let prevs: Vec<Value> = containers
        .iter()
        .map(|c| node.bridge_up(&net, c, "eth0"))
        .collect();
    std::thread::scope(|s| {
        for (i, (c, prev)) in containers.iter().zip(&prevs).enumerate() {
            let (node, net) = (&node, &net);
            s.spawn(move || {
                let conf = net.portmap_conf(
                    Some(prev),
                    json!([mapping(7000 + i as u16, TCP_PORT, "tcp")]),
                );
                let (ok, out) = node.invoke("portmap", "ADD", Some((c, "eth0")), &conf);
                assert!(ok, "concurrent ADD {i}: {out}");
            });
        }
    });
    assert_listable(node.ns());
    assert_eq!(
        node.elements(Family::Ip, "ports-net-a").len(),
        containers.len()
    );
    // CHECK compares the chains exactly: two invocations that both created the network left one copy of
    // each rule.
    for (i, (c, prev)) in containers.iter().zip(&prevs).enumerate() {
        let maps = json!([mapping(7000 + i as u16, TCP_PORT, "tcp")]);
        let (ok, out) = node.portmap("CHECK", &net, c, "eth0", prev, maps);
        assert!(ok, "CHECK {i}: {out}");
    }
    for i in 0..containers.len() {
        let answer = tcp(node.sb.ext(), v4(node_ip_v4()), 7000 + i as u16).unwrap();
        assert_eq!(answer, format!("p{i}"));
    }
}

/// A replaced pod: the old pod's DEL and the new pod's ADD of the same hostPort run at once, each its own
/// process, hundreds of times. The DEL chose its elements by their comment in a read; had it deleted them by
/// key after the ADD took the key over, the new pod would lose its port with both commands exiting 0. Every
/// round, the port's element is the new pod's, CHECK agrees, and at the end a real connection reaches it.
#[test]
fn a_replaced_pods_del_never_removes_the_new_pods_mapping() {
    const ROUNDS: usize = 300;
    let node = Node::new("pm-race");
    let net = Network::a();
    let maps = || json!([mapping(8080, TCP_PORT, "tcp")]);
    let pods = [Container::start("p0"), Container::start("p1")];
    let prevs: Vec<Value> = pods
        .iter()
        .map(|c| node.bridge_up(&net, c, "eth0"))
        .collect();
    let (ok, out) = node.portmap("ADD", &net, &pods[0], "eth0", &prevs[0], maps());
    assert!(ok, "{out}");
    let mut lost = Vec::new();
    for round in 0..ROUNDS {
        let (old, new) = (round % 2, (round + 1) % 2);
        let ((del_ok, del_out), (add_ok, add_out)) = std::thread::scope(|s| {
            let del = s.spawn(|| {
                let conf = net.portmap_conf(Some(&prevs[old]), maps());
                node.invoke("portmap", "DEL", Some((&pods[old], "eth0")), &conf)
            });
            let add = s.spawn(|| {
                let conf = net.portmap_conf(Some(&prevs[new]), maps());
                node.invoke("portmap", "ADD", Some((&pods[new], "eth0")), &conf)
            });
            (del.join().unwrap(), add.join().unwrap())
        });
        assert!(
            del_ok && add_ok,
            "round {round}: DEL {del_out}, ADD {add_out}"
        );
        let owners: Vec<Option<String>> = node
            .elements(Family::Ip, "ports-net-a")
            .into_iter()
            .map(|(_, c)| c)
            .collect();
        if owners != [Some(format!("{} eth0", pods[new].id))] {
            lost.push((round, owners));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {ROUNDS} rounds lost the new pod's port: {lost:?}",
        lost.len()
    );
    let last = ROUNDS % 2;
    let (ok, out) = node.portmap("CHECK", &net, &pods[last], "eth0", &prevs[last], maps());
    assert!(ok, "CHECK of the last pod: {out}");
    assert_eq!(
        node.elements(Family::Ip, "targets-net-a").len(),
        1,
        "only the last pod's target is left"
    );
    assert_eq!(
        tcp(node.sb.ext(), v4(node_ip_v4()), 8080).unwrap(),
        format!("p{last}")
    );
}

/// Conditions as upstream writes them (one word per string, joined with spaces) work like the one-string
/// form; and DEL succeeds, removing the mapping, on a configuration ADD refuses (the stock plugin's iptables
/// conditions with a module, a non-boolean snat, unknown keys), so that the interface plugin's DEL runs after
/// it and the address is released.
#[test]
fn upstreams_condition_lists_and_del_on_a_config_add_refuses() {
    let node = Node::new("pm-conf");
    let mut net = Network::a();
    let ext = ext_ip_v4();
    net.extra = json!({"conditionsV4": ["ip", "saddr", "!=", format!("{ext}/32")]});
    let c1 = Container::start("c1");
    let prev = node.attach(&net, &c1, "eth0", json!([mapping(8080, TCP_PORT, "tcp")]));
    let (n4, lo) = (v4(node_ip_v4()), IpAddr::from([127, 0, 0, 1]));
    assert_unanswered(
        tcp_short(node.sb.ext(), n4, 8080),
        "the client the condition leaves out",
    );
    assert_eq!(
        tcp(node.ns(), lo, 8080).unwrap(),
        "c1",
        "from the node: not that client"
    );

    let mut stock = net.portmap_conf(Some(&prev), json!([mapping(8080, TCP_PORT, "tcp")]));
    stock["conditionsV4"] = json!(["-m", "comment", "--comment", "from the stock plugin"]);
    let (ok, out) = node.invoke("portmap", "ADD", Some((&c1, "eth0")), &stock);
    assert!(
        !ok && out["msg"].as_str().unwrap().contains("\"-m\""),
        "ADD must refuse it: {out}"
    );
    stock["snat"] = json!("yes");
    stock["someRuntimeKey"] = json!({"x": [1]});
    let (ok, out) = node.invoke("portmap", "DEL", Some((&c1, "eth0")), &stock);
    assert!(ok, "DEL must not fail on what it does not need: {out}");
    assert!(node.elements(Family::Ip, "ports-net-a").is_empty());
    assert_unanswered(tcp_short(node.ns(), lo, 8080), "the port after DEL");
    let (ok, out) = node.invoke(
        "bridge",
        "DEL",
        Some((&c1, "eth0")),
        &net.bridge_conf(&node.dir),
    );
    assert!(ok, "bridge DEL: {out}");
    let mut gc = stock;
    gc["cni.dev/valid-attachments"] = json!([]);
    let (ok, out) = node.invoke("portmap", "GC", None, &gc);
    assert!(ok, "GC must not fail on what it does not need: {out}");
}

/// Deletes the plugin's tables in the node's namespace, as `nft flush ruleset` in a firewall reload does.
fn flush_plugin_tables(node: &Node) {
    node.ns()
        .run(|| {
            let mut tx = Transaction::default();
            for family in [Family::Ip, Family::Ip6] {
                tx.push(family, TABLE, Op::DeleteTable);
            }
            NftSocket::open().unwrap().commit(&tx).unwrap();
        })
        .unwrap();
}

/// Runs `nftkube-portmap restore` in the node's namespace; its success and output.
fn restore(node: &Node) -> (bool, String) {
    let out = node
        .ns()
        .command(portmap_bin())
        .arg("restore")
        .output()
        .expect("running nftkube-portmap restore");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A firewall reload deletes the plugin's tables: one command (`nftkube-portmap restore`, what the systemd
/// unit runs) brings back the mappings of every attachment whose last command was a successful ADD, with
/// their conditions and hairpin, and not those of an attachment DELeted while the tables were gone. Run again,
/// or while the tables are intact, it changes nothing; racing DELs and ADDs, it never brings back what a DEL
/// removed.
#[test]
fn restore_after_a_flush_brings_back_what_was_not_deleted() {
    let node = Node::new("pm-restore");
    let net = Network::a();
    let (c1, c2, c3) = (
        Container::start("c1"),
        Container::start("c2"),
        Container::start("c3"),
    );
    let prev1 = node.attach(
        &net,
        &c1,
        "eth0",
        json!([
            mapping(8081, TCP_PORT, "tcp"),
            mapping(8053, UDP_PORT, "udp")
        ]),
    );
    let prev2 = node.attach(&net, &c2, "eth0", json!([mapping(8082, TCP_PORT, "tcp")]));
    let prev3 = node.attach(&net, &c3, "eth0", json!([mapping(8083, TCP_PORT, "tcp")]));
    let (ext, n4) = (node.sb.ext(), v4(node_ip_v4()));
    let lo = IpAddr::from([127, 0, 0, 1]);
    assert_eq!(tcp(ext, n4, 8082).unwrap(), "c2");

    flush_plugin_tables(&node);
    assert_unanswered(tcp_short(ext, n4, 8081), "after the flush");
    // c2 goes away while the tables are gone: its DEL finds nothing, and must be remembered all the same.
    node.detach(
        &net,
        &c2,
        "eth0",
        &prev2,
        json!([mapping(8082, TCP_PORT, "tcp")]),
    );

    let (ok, out) = restore(&node);
    assert!(ok, "restore: {out}");
    assert!(out.contains("2 attachments"), "{out}");
    assert_listable(node.ns());
    assert_eq!(tcp(ext, n4, 8081).unwrap(), "c1");
    assert_eq!(udp(ext, n4, 8053).unwrap(), "c1");
    assert_eq!(tcp(ext, n4, 8083).unwrap(), "c3");
    assert_eq!(
        tcp(node.ns(), lo, 8083).unwrap(),
        "c3",
        "127.0.0.1 and its SNAT too"
    );
    assert_unanswered(
        tcp_short(ext, n4, 8082),
        "c2, deleted while the tables were gone",
    );
    for (c, prev, maps) in [
        (
            &c1,
            &prev1,
            json!([
                mapping(8081, TCP_PORT, "tcp"),
                mapping(8053, UDP_PORT, "udp")
            ]),
        ),
        (&c3, &prev3, json!([mapping(8083, TCP_PORT, "tcp")])),
    ] {
        let (ok, out) = node.portmap("CHECK", &net, c, "eth0", prev, maps);
        assert!(ok, "CHECK after restore: {out}");
    }
    let before = node.elements(Family::Ip, "ports-net-a");
    let (ok, out) = restore(&node);
    assert!(ok, "restore again: {out}");
    assert_eq!(
        node.elements(Family::Ip, "ports-net-a"),
        before,
        "a restore of intact tables changes nothing"
    );

    // Restores racing a DEL: whichever runs first, c3's mapping is gone once the DEL returned.
    flush_plugin_tables(&node);
    std::thread::scope(|s| {
        let r = s.spawn(|| restore(&node));
        let conf = net.portmap_conf(Some(&prev3), json!([mapping(8083, TCP_PORT, "tcp")]));
        let (ok, out) = node.invoke("portmap", "DEL", Some((&c3, "eth0")), &conf);
        assert!(ok, "DEL: {out}");
        let (ok, out) = r.join().unwrap();
        assert!(ok, "restore: {out}");
    });
    let (ok, out) = restore(&node);
    assert!(ok, "{out}");
    assert_unanswered(tcp_short(ext, n4, 8083), "c3 after its DEL");
    assert_eq!(tcp(ext, n4, 8081).unwrap(), "c1");
}

/// Where the agent runs, no command is needed: after the plugin's tables are deleted (a firewall reload), the
/// agent puts the recorded mappings back within a second, and again after a second flush, but not those of an
/// attachment DELeted while the tables were gone.
#[test]
fn the_agent_restores_the_mappings_within_a_second_of_a_flush() {
    let node = Node::new("pm-agent");
    let net = Network::a();
    let (c1, c2) = (Container::start("c1"), Container::start("c2"));
    let _ = node.attach(&net, &c1, "eth0", json!([mapping(8081, TCP_PORT, "tcp")]));
    let prev2 = node.attach(&net, &c2, "eth0", json!([mapping(8082, TCP_PORT, "tcp")]));
    let manifests = Manifests::examples();
    let agent = Agent::start(node.ns(), &manifests.dir, &[]);
    agent.wait_syncs(1, Duration::from_secs(20));
    let (ext, n4) = (node.sb.ext(), v4(node_ip_v4()));
    let ports = |node: &Node| node.elements(Family::Ip, "ports-net-a").len();

    // The agent alone, timed from the flush.
    let flushed = std::time::Instant::now();
    flush_plugin_tables(&node);
    let took = wait_until(Duration::from_secs(1), || ports(&node) == 2)
        .map(|_| flushed.elapsed())
        .unwrap_or_else(|_| panic!("not restored within 1 s of the flush:\n{}", agent.log()));
    assert_eq!(tcp(ext, n4, 8082).unwrap(), "c2", "restored after {took:?}");

    // A DEL while the tables are gone is not undone by the next restore.
    flush_plugin_tables(&node);
    node.detach(
        &net,
        &c2,
        "eth0",
        &prev2,
        json!([mapping(8082, TCP_PORT, "tcp")]),
    );
    wait_until(Duration::from_secs(2), || ports(&node) == 1).unwrap_or_else(|_| {
        panic!(
            "not restored after the second flush: {:?}\n{}",
            node.elements(Family::Ip, "ports-net-a"),
            agent.log()
        )
    });
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(ports(&node), 1, "c2 came back");
    assert_eq!(tcp(ext, n4, 8081).unwrap(), "c1");
    assert_unanswered(
        tcp_short(ext, n4, 8082),
        "c2, deleted while the tables were gone",
    );
    assert_listable(node.ns());
}
