//! The service / endpoint model the renderer consumes. Plain data: no kube types, no I/O.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;

use super::ip_text::{parse_cidr_sloppy, parse_ip_sloppy, CidrTextError};

/// Layer-4 protocol of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    /// IANA protocol number (what `meta l4proto` compares against).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// Lower-case name as nft and kube-proxy chain names spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

/// Text the model cannot read, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not TCP, UDP or SCTP.
    #[error("unsupported protocol {0:?}")]
    Protocol(String),
    /// A CIDR whose address part is not an IP address.
    #[error("invalid CIDR {0:?}: bad address")]
    CidrAddress(String),
    /// A CIDR whose prefix length is not a number within the family's bits.
    #[error("invalid CIDR {0:?}: bad prefix length")]
    CidrPrefix(String),
}

impl FromStr for Protocol {
    type Err = ParseError;
    /// Kubernetes spelling ("TCP", "UDP", "SCTP"); empty means TCP as the API defaults it.
    fn from_str(s: &str) -> Result<Self, ParseError> {
        match s {
            "TCP" | "" => Ok(Protocol::Tcp),
            "UDP" => Ok(Protocol::Udp),
            "SCTP" => Ok(Protocol::Sctp),
            other => Err(ParseError::Protocol(other.into())),
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// The family of an address.
    pub fn of(ip: &IpAddr) -> IpFamily {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }
}

/// A namespaced object name ("namespace/name"). Shared strings: a name is copied into many maps (the model,
/// the sync index, change sets), and at 50k services a `String` per copy cost tens of megabytes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    /// The namespace.
    pub namespace: Arc<str>,
    /// The name.
    pub name: Arc<str>,
}

impl NamespacedName {
    /// A name in a namespace.
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        NamespacedName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Identifies one port of one service: kube-proxy's ServicePortName ("namespace/name:port").
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    /// The Service.
    pub service: NamespacedName,
    /// The port's name in the Service spec ("" for a single unnamed port).
    pub port: Arc<str>,
    /// The port's protocol.
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
/// A Service's `spec.type` (ExternalName services are not proxied and never reach the model).
pub enum ServiceType {
    /// A cluster IP only.
    ClusterIP,
    /// A cluster IP and a port on every node.
    NodePort,
    /// A NodePort, plus the load balancer's IPs from `status.loadBalancer`.
    LoadBalancer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
/// `externalTrafficPolicy` / `internalTrafficPolicy`.
pub enum TrafficPolicy {
    #[default]
    /// Any ready endpoint in the cluster.
    Cluster,
    /// Endpoints on this node only.
    Local,
}

/// An IP prefix ("10.0.0.0/8"); the address is stored with host bits cleared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    /// The network address (host bits cleared).
    pub addr: IpAddr,
    /// The prefix length.
    pub prefix: u8,
}

impl Cidr {
    /// The prefix's family.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.addr)
    }

    /// Whether `ip` is inside the prefix (never across families).
    pub fn contains(&self, ip: &IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(*ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(*ip) & mask
            }
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = ParseError;
    /// `address/prefix` as the API server and kube-proxy read it (Go's `ParseCIDRSloppy`: leading zeros are
    /// decimal, an IPv4-mapped network is IPv4; see `super::ip_text`); a bare address is its host prefix.
    fn from_str(s: &str) -> Result<Self, ParseError> {
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => {
                parse_cidr_sloppy(addr.trim(), prefix.trim()).map_err(|e| match e {
                    CidrTextError::Address => ParseError::CidrAddress(s.into()),
                    CidrTextError::Prefix => ParseError::CidrPrefix(s.into()),
                })?
            }
            None => {
                let addr =
                    parse_ip_sloppy(s.trim()).ok_or_else(|| ParseError::CidrAddress(s.into()))?;
                (addr, if addr.is_ipv4() { 32 } else { 128 })
            }
        };
        Ok(Cidr { addr, prefix })
    }
}

/// Parses a comma-separated list of CIDRs (kube-proxy accepts `--cluster-cidr=a,b` for dual-stack).
pub fn parse_cidrs(s: &str) -> Result<Vec<Cidr>, ParseError> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<Cidr>())
        .collect()
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Everything kube-proxy knows about one port of one service.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServicePort {
    /// Service and port name.
    pub name: ServicePortName,
    /// `spec.type`.
    pub service_type: ServiceType,
    /// Cluster IPs of every family the service has (spec.clusterIPs).
    pub cluster_ips: Vec<IpAddr>,
    /// The service port.
    pub port: u16,
    /// Its protocol.
    pub protocol: Protocol,
    /// `nodePort`, for NodePort and LoadBalancer services.
    pub node_port: Option<u16>,
    /// `spec.externalIPs` (of the cluster IPs' families).
    pub external_ips: Vec<IpAddr>,
    /// LoadBalancer ingress IPs (ingress with ipMode Proxy excluded).
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`.
    pub load_balancer_source_ranges: Vec<Cidr>,
    /// `spec.externalTrafficPolicy`.
    pub external_traffic_policy: TrafficPolicy,
    /// `spec.internalTrafficPolicy`.
    pub internal_traffic_policy: TrafficPolicy,
    /// ClientIP affinity timeout in seconds; None without affinity.
    pub session_affinity_timeout: Option<u32>,
    /// `spec.healthCheckNodePort` (LoadBalancer services with externalTrafficPolicy Local).
    pub health_check_node_port: Option<u16>,
    /// When the Service was created: the older of two services claiming one frontend keeps it.
    pub created: Created,
}

/// An object's `metadata.creationTimestamp`, in whole seconds since the epoch (the API's precision), or
/// unknown (manifests often leave it out). Ordered oldest first, unknown last: an object of unknown age never
/// outranks one whose age is known.
///
/// Four big-endian bytes, clamped to what 32 bits hold (1970 to 2106): byte order is numeric order, and with
/// an alignment of one it fits the padding of every rendered piece that carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Created([u8; 4]);

impl Created {
    /// No creation time given.
    pub const UNKNOWN: Created = Created([0xff; 4]);

    /// Seconds since the epoch.
    pub fn from_unix_seconds(seconds: i64) -> Created {
        Created((seconds.clamp(0, u32::MAX as i64 - 1) as u32).to_be_bytes())
    }
}

impl ServicePort {
    /// A plain ClusterIP service port (every other field at its API default): the starting point that tests,
    /// benchmarks and sources adjust.
    pub fn cluster_ip(name: ServicePortName, cluster_ips: Vec<IpAddr>, port: u16) -> ServicePort {
        ServicePort {
            protocol: name.protocol,
            name,
            service_type: ServiceType::ClusterIP,
            cluster_ips,
            port,
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            external_traffic_policy: TrafficPolicy::Cluster,
            internal_traffic_policy: TrafficPolicy::Cluster,
            session_affinity_timeout: None,
            health_check_node_port: None,
            created: Created::UNKNOWN,
        }
    }
}

/// One endpoint of one service port, from an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    /// The endpoint's address.
    pub ip: IpAddr,
    /// The port resolved from the slice's port of the same name as the service port.
    pub port: u16,
    /// `conditions.ready`.
    pub ready: bool,
    /// `conditions.serving`.
    pub serving: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
    /// The node it is on.
    pub node_name: Option<String>,
    /// The zone it is in.
    pub zone: Option<String>,
    /// Topology hints: zones this endpoint should serve ("forZones").
    pub zone_hints: Vec<String>,
    /// Topology hints: nodes this endpoint should serve ("forNodes").
    pub node_hints: Vec<String>,
}

impl Endpoint {
    /// A ready, serving endpoint with no node, zone or hints (tests, benchmarks, simple sources).
    pub fn ready(ip: IpAddr, port: u16) -> Endpoint {
        Endpoint {
            ip,
            port,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
            zone_hints: vec![],
            node_hints: vec![],
        }
    }
}

/// All service ports, keyed by name.
pub type ServiceMap = BTreeMap<ServicePortName, ServicePort>;
/// Endpoints per service port, sorted and deduplicated by (ip, port).
pub type EndpointsMap = BTreeMap<ServicePortName, Vec<Endpoint>>;
