//! The packet a trace follows, and what the path depends on that is not in the ruleset: where the packet comes
//! from, the node's local addresses, and the connection-tracking state of a first packet.

use nftkube_nft::ir::Family;
use serde::Serialize;
use std::net::{IpAddr, SocketAddr};

/// Where the packet enters the node: that decides the hooks it meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// From a pod on this node: arrives on the pod's link (prerouting, then input or forward).
    Pod,
    /// Sent by the node itself (output, then postrouting).
    Node,
    /// From another host: arrives on an uplink (prerouting, then input or forward).
    Outside,
}

impl Origin {
    /// `pod`, `node` or `outside`.
    pub fn parse(s: &str) -> Result<Origin, String> {
        match s {
            "pod" => Ok(Origin::Pod),
            "node" => Ok(Origin::Node),
            "outside" => Ok(Origin::Outside),
            other => Err(format!("{other:?} is not one of pod, node, outside")),
        }
    }
    /// The name `parse` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Pod => "pod",
            Origin::Node => "node",
            Origin::Outside => "outside",
        }
    }
}

/// The transport protocols a service port can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Proto {
    /// `tcp`, `udp` or `sctp`, in any case.
    pub fn parse(s: &str) -> Result<Proto, String> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Proto::Tcp),
            "udp" => Ok(Proto::Udp),
            "sctp" => Ok(Proto::Sctp),
            _ => Err(format!("{s:?} is not one of tcp, udp, sctp")),
        }
    }
    /// IANA protocol number (`meta l4proto`).
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
            Proto::Sctp => 132,
        }
    }
    /// The lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

/// The source port used when `--src` names none (any port works the same in our rules).
pub const DEFAULT_SOURCE_PORT: u16 = 40000;

/// `IP[:PORT]` (`[v6]:PORT` for IPv6 with a port); the port defaults to `default_port`, None: a port is required.
pub fn parse_endpoint(s: &str, default_port: Option<u16>) -> Result<SocketAddr, String> {
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok(sa);
    }
    match (s.parse::<IpAddr>(), default_port) {
        (Ok(ip), Some(port)) => Ok(SocketAddr::new(ip, port)),
        (Ok(_), None) => Err(format!("{s:?} has no port (IP:PORT, [IPv6]:PORT)")),
        (Err(_), _) => Err(format!("{s:?} is not an address (IP[:PORT], [IPv6]:PORT)")),
    }
}

/// A packet's header fields, as nf_tables expressions read them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Packet {
    /// Source address and port.
    pub src: SocketAddr,
    /// Destination address and port (rewritten by DNAT as it goes).
    pub dst: SocketAddr,
    /// Transport protocol.
    pub proto: Proto,
    /// The packet mark.
    pub mark: u32,
    /// The incoming interface's name (None: not known; `iifname` rules see an empty name).
    pub iif: Option<String>,
}

impl Packet {
    /// The family of the packet's tables.
    pub fn family(&self) -> Family {
        if self.src.is_ipv4() {
            Family::Ip
        } else {
            Family::Ip6
        }
    }

    /// The network header bytes (only the fields our rules read are filled in: protocol, addresses).
    pub(crate) fn network_header(&self) -> Vec<u8> {
        match (self.src.ip(), self.dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let mut h = vec![0u8; 20];
                h[0] = 0x45;
                h[9] = self.proto.number();
                h[12..16].copy_from_slice(&s.octets());
                h[16..20].copy_from_slice(&d.octets());
                h
            }
            (s, d) => {
                let mut h = vec![0u8; 40];
                h[0] = 0x60;
                h[6] = self.proto.number();
                h[8..24].copy_from_slice(&ip_octets(&s));
                h[24..40].copy_from_slice(&ip_octets(&d));
                h
            }
        }
    }

    /// The transport header bytes: ports (the rest zero).
    pub(crate) fn transport_header(&self) -> Vec<u8> {
        let mut h = vec![0u8; 20];
        h[0..2].copy_from_slice(&self.src.port().to_be_bytes());
        h[2..4].copy_from_slice(&self.dst.port().to_be_bytes());
        h
    }
}

/// The address's bytes, as nf_tables compares them.
pub(crate) fn ip_octets(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The node's side of the path: which addresses are its own (for `fib ... type local` and routing).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NodeContext {
    /// The node's own addresses (loopback included).
    pub local_addresses: Vec<IpAddr>,
    /// Where the local addresses came from, for the output ("this namespace's addresses (rtnetlink)", ...).
    pub source: String,
}

impl NodeContext {
    /// Whether an address is this node's: one of its addresses, or loopback (the kernel's local table holds
    /// 127.0.0.0/8 and ::1).
    pub fn is_local(&self, ip: &IpAddr) -> bool {
        ip.is_loopback() || self.local_addresses.contains(ip)
    }
}
