//! The network configuration on stdin, typed and checked. Every error names the field at fault.

use super::cni::{check_container_id, check_ifname, code, negotiate_version, Attachment, CniError};
use super::conditions::{self, Match};
use nftkube_nft::ir::Family;
use serde_json::{Map, Value};
use std::net::IpAddr;

/// The default `markMasqBit`, upstream's (kubelet's masquerade bit is 14; portmap's default stays clear of it).
pub(crate) const DEFAULT_MARK_MASQ_BIT: u32 = 13;

/// The model's protocol: the same three, the same numbers.
pub use nftkube_model::Protocol;

/// One `runtimeConfig.portMappings` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortMapping {
    /// The port on the host.
    pub(crate) host_port: u16,
    /// The port in the container.
    pub(crate) container_port: u16,
    /// The protocol.
    pub(crate) protocol: Protocol,
    /// A specific node address; None for every local address (`""`, absent), or `0.0.0.0` / `::` for every
    /// local address of that family only.
    pub(crate) host_ip: Option<IpAddr>,
    /// `0.0.0.0` or `::`: every address, of that family only.
    pub(crate) any_of: Option<Family>,
}

impl PortMapping {
    /// Whether the mapping applies to a table of `family`.
    pub fn applies_to(&self, family: Family) -> bool {
        match (self.host_ip, self.any_of) {
            (Some(ip), _) => family_of(&ip) == family,
            (None, Some(f)) => f == family,
            (None, None) => true,
        }
    }
}

/// The family of an address.
pub(crate) fn family_of(ip: &IpAddr) -> Family {
    if ip.is_ipv4() {
        Family::Ip
    } else {
        Family::Ip6
    }
}

/// What a chained plugin needs from the previous plugin's result.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrevResult {
    /// The container's first address of each family, with its prefix length (the container's subnet).
    pub(crate) container_ips: Vec<(IpAddr, u8)>,
    /// Interfaces in the node's namespace (the bridge, the host end of a veth): where route_localnet goes.
    pub(crate) host_interfaces: Vec<String>,
    /// The object itself, passed on as this plugin's result.
    pub(crate) raw: Value,
}

impl PrevResult {
    /// The container's first address of a family, from the previous result.
    pub fn container_ip(&self, family: Family) -> Option<IpAddr> {
        self.container_ips
            .iter()
            .map(|(ip, _)| *ip)
            .find(|ip| family_of(ip) == family)
    }

    /// The container's subnet in `family`: (network address, prefix length).
    pub fn container_subnet(&self, family: Family) -> Option<Subnet> {
        let (ip, prefix) = *self
            .container_ips
            .iter()
            .find(|(ip, _)| family_of(ip) == family)?;
        Some(Subnet::of(ip, prefix))
    }
}

/// An address prefix: its network address (host bits cleared) and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Subnet {
    /// The network address.
    pub(crate) net: IpAddr,
    /// The prefix length.
    pub(crate) prefix: u8,
}

impl Subnet {
    /// The subnet of `ip` with this prefix (host bits cleared).
    pub(crate) fn of(ip: IpAddr, prefix: u8) -> Subnet {
        let net = match ip {
            IpAddr::V4(a) => {
                let mask = u32::MAX
                    .checked_shl(32 - prefix.min(32) as u32)
                    .unwrap_or(0);
                IpAddr::from((u32::from(a) & mask).to_be_bytes())
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - prefix.min(128) as u32)
                    .unwrap_or(0);
                IpAddr::from((u128::from(a) & mask).to_be_bytes())
            }
        };
        Subnet { net, prefix }
    }

    /// Reads "ADDR/PREFIX".
    pub(crate) fn parse(text: &str) -> Option<Subnet> {
        let (ip, prefix) = text.split_once('/')?;
        let ip: IpAddr = ip.parse().ok()?;
        let prefix: u8 = prefix.parse().ok()?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        (prefix <= max).then(|| Subnet::of(ip, prefix))
    }
}

impl std::fmt::Display for Subnet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.net, self.prefix)
    }
}

/// The configuration of one invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConf {
    /// `cniVersion`.
    pub(crate) cni_version: String,
    /// The network's `name`.
    pub name: String,
    /// `snat`: masquerade connections from the host's loopback.
    pub snat: bool,
    /// `masqAll`: masquerade every mapped connection.
    pub(crate) masq_all: bool,
    /// `markMasqBit`: the fwmark bit that asks for masquerade.
    pub(crate) mark_masq_bit: u32,
    /// `conditionsV4`: extra matches for IPv4 mappings.
    pub(crate) conditions_v4: Vec<Match>,
    /// `conditionsV6`: extra matches for IPv6 mappings.
    pub(crate) conditions_v6: Vec<Match>,
    /// `runtimeConfig.portMappings`.
    pub port_mappings: Vec<PortMapping>,
    /// `prevResult`: the container's interfaces and addresses.
    pub prev_result: Option<PrevResult>,
    /// GC: `cni.dev/valid-attachments`.
    pub(crate) valid_attachments: Option<Vec<Attachment>>,
}

impl NetConf {
    /// The conditions of a family.
    pub(crate) fn conditions(&self, family: Family) -> &[Match] {
        if family == Family::Ip6 {
            &self.conditions_v6
        } else {
            &self.conditions_v4
        }
    }
}

fn invalid(msg: impl Into<String>) -> CniError {
    CniError::new(code::INVALID_CONFIG, msg)
}

/// The configuration as a JSON object, and the version it is answered in. The version is checked first, so
/// that a runtime speaking another version hears so.
fn document(stdin: &[u8]) -> Result<(Map<String, Value>, String), CniError> {
    let v: Value = serde_json::from_slice(stdin).map_err(|e| {
        CniError::new(code::DECODE_FAILURE, "network configuration: not JSON")
            .with_details(e.to_string())
    })?;
    let not_object = || {
        CniError::new(
            code::DECODE_FAILURE,
            "network configuration: not a JSON object",
        )
    };
    if !v.is_object() {
        return Err(not_object());
    }
    let cni_version = negotiate_version(&v)?;
    let Value::Object(obj) = v else {
        return Err(not_object());
    };
    Ok((obj, cni_version))
}

/// What DEL and GC read of the configuration, and nothing more: they find an attachment's elements by the
/// network's name and their comments, so conditions, SNAT settings, port mappings and unknown keys cannot
/// make them fail. That matters: libcni stops a chained DEL at the first plugin that fails, and portmap's
/// DEL runs before the interface and IPAM plugins', which would never release the container's address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Removal {
    /// The network's name; None when it is not one ADD accepts (then the plugin has nothing of it).
    pub(crate) name: Option<String>,
    /// GC: `cni.dev/valid-attachments` (checked by GC, which needs it).
    pub(crate) valid_attachments: Option<Vec<Attachment>>,
}

/// Parses stdin for DEL or GC: only the version, the name and (for GC) the valid attachments.
pub(crate) fn parse_removal(stdin: &[u8], gc: bool) -> Result<Removal, CniError> {
    let (obj, _) = document(stdin)?;
    Ok(Removal {
        name: network_name(&obj).ok(),
        valid_attachments: if gc { valid_attachments(&obj)? } else { None },
    })
}

/// Parses stdin for ADD, CHECK and STATUS: everything, strictly.
pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
    let (obj, cni_version) = document(stdin)?;
    let obj = &obj;
    if obj.contains_key("externalSetMarkChain") {
        return Err(CniError::new(
            code::UNSUPPORTED_FIELD,
            "externalSetMarkChain: not supported (an iptables chain); use markMasqBit",
        ));
    }
    let name = network_name(obj)?;
    let mark_masq_bit = match obj.get("markMasqBit") {
        None | Some(Value::Null) => DEFAULT_MARK_MASQ_BIT,
        Some(b) => b
            .as_u64()
            .filter(|b| *b <= 31)
            .ok_or_else(|| invalid(format!("markMasqBit: {b} is not a bit number (0-31)")))?
            as u32,
    };
    let conditions_of = |family: Family| -> Result<Vec<Match>, CniError> {
        let key = conditions::list_name(family);
        let list = string_list(obj, key)?;
        conditions::parse(family, &list).map_err(|e| invalid(e.to_string()))
    };
    Ok(NetConf {
        snat: opt_bool(obj, "snat")?.unwrap_or(true),
        masq_all: opt_bool(obj, "masqAll")?.unwrap_or(false),
        mark_masq_bit,
        conditions_v4: conditions_of(Family::Ip)?,
        conditions_v6: conditions_of(Family::Ip6)?,
        port_mappings: port_mappings(obj)?,
        prev_result: obj.get("prevResult").map(prev_result).transpose()?,
        valid_attachments: valid_attachments(obj)?,
        cni_version,
        name,
    })
}

/// The network's name: required, and spelled the way libcni requires, which also makes it a valid part of
/// an nft identifier.
fn network_name(obj: &Map<String, Value>) -> Result<String, CniError> {
    let name = match obj.get("name") {
        None => return Err(invalid("name: missing")),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(invalid(format!("name: {other} is not a string"))),
    };
    let first_ok = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    let rest_ok = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !first_ok || !rest_ok {
        return Err(invalid(format!(
            "name: {name:?} must start with a letter or digit and hold only letters, digits, '_', '.' and '-'"
        )));
    }
    if name.len() > 200 {
        return Err(invalid("name: longer than 200 characters"));
    }
    Ok(name)
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, CniError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(invalid(format!("{key}: {other} is not true or false"))),
    }
}

fn string_list(obj: &Map<String, Value>, key: &str) -> Result<Vec<String>, CniError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| invalid(format!("{key}[{i}]: {x} is not a string")))
            })
            .collect(),
        Some(other) => Err(invalid(format!("{key}: {other} is not a list of strings"))),
    }
}

fn port_mappings(obj: &Map<String, Value>) -> Result<Vec<PortMapping>, CniError> {
    let Some(rc) = obj.get("runtimeConfig").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let rc = rc
        .as_object()
        .ok_or_else(|| invalid("runtimeConfig: not an object"))?;
    let list = match rc.get("portMappings") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("runtimeConfig.portMappings: not a list")),
    };
    let mut out: Vec<PortMapping> = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let at = format!("runtimeConfig.portMappings[{i}]");
        let m = item
            .as_object()
            .ok_or_else(|| invalid(format!("{at}: not an object")))?;
        out.push(port_mapping(&at, m)?);
    }
    Ok(out)
}

fn port_mapping(at: &str, m: &Map<String, Value>) -> Result<PortMapping, CniError> {
    let port = |key: &str| -> Result<u16, CniError> {
        let v = m
            .get(key)
            .ok_or_else(|| invalid(format!("{at}.{key}: missing")))?;
        v.as_u64()
            .filter(|p| (1..=65535).contains(p))
            .map(|p| p as u16)
            .ok_or_else(|| invalid(format!("{at}.{key}: {v} is not a port (1-65535)")))
    };
    let host_port = port("hostPort")?;
    let container_port = port("containerPort")?;
    let protocol = match m.get("protocol") {
        None => return Err(invalid(format!("{at}.protocol: missing"))),
        Some(Value::String(p)) => match p.to_ascii_lowercase().as_str() {
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            "sctp" => Protocol::Sctp,
            _ => {
                return Err(invalid(format!(
                    "{at}.protocol: {p:?} is not tcp, udp or sctp"
                )))
            }
        },
        Some(other) => return Err(invalid(format!("{at}.protocol: {other} is not a string"))),
    };
    let (host_ip, any_of) = match m.get("hostIP") {
        None | Some(Value::Null) => (None, None),
        Some(Value::String(s)) if s.is_empty() => (None, None),
        Some(Value::String(s)) => {
            let ip: IpAddr = s
                .parse()
                .map_err(|_| invalid(format!("{at}.hostIP: {s:?} is not an IP address")))?;
            if ip.is_unspecified() {
                (None, Some(family_of(&ip)))
            } else {
                (Some(ip), None)
            }
        }
        Some(other) => return Err(invalid(format!("{at}.hostIP: {other} is not a string"))),
    };
    Ok(PortMapping {
        host_port,
        container_port,
        protocol,
        host_ip,
        any_of,
    })
}

/// Reads `interfaces` and `ips` of a result (0.3.0 to 1.1.0 share these fields).
fn prev_result(v: &Value) -> Result<PrevResult, CniError> {
    let obj = v
        .as_object()
        .ok_or_else(|| invalid("prevResult: not an object"))?;
    let interfaces: Vec<&Map<String, Value>> = match obj.get("interfaces") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_object()
                    .ok_or_else(|| invalid(format!("prevResult.interfaces[{i}]: not an object")))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid("prevResult.interfaces: not a list")),
    };
    let in_sandbox = |i: &Map<String, Value>| {
        i.get("sandbox")
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
    };
    let host_interfaces = interfaces
        .iter()
        .filter(|i| !in_sandbox(i))
        .filter_map(|i| i.get("name").and_then(Value::as_str))
        .filter(|n| check_ifname(n).is_ok())
        .map(str::to_owned)
        .collect();
    let ips = match obj.get("ips") {
        None | Some(Value::Null) => &Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid("prevResult.ips: not a list")),
    };
    let mut container_ips: Vec<(IpAddr, u8)> = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        let at = format!("prevResult.ips[{i}]");
        let address = ip
            .get("address")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(format!("{at}.address: missing")))?;
        let subnet = Subnet::parse(address).ok_or_else(|| {
            invalid(format!(
                "{at}.address: {address:?} is not an address/prefix"
            ))
        })?;
        let addr: IpAddr = address
            .split_once('/')
            .and_then(|(a, _)| a.parse().ok())
            .unwrap_or(subnet.net);
        // An address of a host-side interface is not the container's.
        let on_host = ip
            .get("interface")
            .and_then(Value::as_u64)
            .and_then(|k| interfaces.get(k as usize))
            .is_some_and(|iface| !in_sandbox(iface));
        if !on_host
            && !container_ips
                .iter()
                .any(|(c, _)| c.is_ipv4() == addr.is_ipv4())
        {
            container_ips.push((addr, subnet.prefix));
        }
    }
    Ok(PrevResult {
        container_ips,
        host_interfaces,
        raw: v.clone(),
    })
}

fn valid_attachments(obj: &Map<String, Value>) -> Result<Option<Vec<Attachment>>, CniError> {
    const KEY: &str = "cni.dev/valid-attachments";
    let list = match obj.get(KEY) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid(format!("{KEY}: not a list"))),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, a) in list.iter().enumerate() {
        let field = |k: &str| {
            a.get(k)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| invalid(format!("{KEY}[{i}].{k}: missing")))
        };
        let attachment = Attachment {
            container_id: field("containerID")?,
            ifname: field("ifname")?,
        };
        // Ids this plugin could never have recorded cannot own anything: no need to refuse them.
        if check_container_id(&attachment.container_id).is_ok() {
            out.push(attachment);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conf(extra: Value) -> Value {
        let mut c = json!({"cniVersion": "1.1.0", "name": "net1", "type": "portmap"});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    fn err_of(v: Value) -> CniError {
        parse(v.to_string().as_bytes()).unwrap_err()
    }

    #[test]
    fn a_full_config() {
        let c = parse(
            conf(json!({
                "snat": false, "masqAll": true, "markMasqBit": 5,
                "conditionsV4": ["ip saddr 10.0.0.0/8"],
                "runtimeConfig": {"portMappings": [
                    {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
                    {"hostPort": 53, "containerPort": 5353, "protocol": "UDP", "hostIP": "10.1.0.1"},
                    {"hostPort": 9, "containerPort": 9, "protocol": "sctp", "hostIP": "::"}]},
                "prevResult": {"cniVersion": "1.1.0",
                    "interfaces": [{"name": "cni0"}, {"name": "veth1"}, {"name": "eth0", "sandbox": "/run/netns/x"}],
                    "ips": [{"address": "10.88.0.2/16", "interface": 2}, {"address": "fd00::2/64", "interface": 2}]}
            }))
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        assert!(!c.snat && c.masq_all && c.mark_masq_bit == 5);
        assert_eq!(c.port_mappings.len(), 3);
        assert_eq!(c.port_mappings[1].protocol, Protocol::Udp);
        assert!(c.port_mappings[1].applies_to(Family::Ip));
        assert!(!c.port_mappings[1].applies_to(Family::Ip6));
        assert!(c.port_mappings[2].applies_to(Family::Ip6));
        assert!(!c.port_mappings[2].applies_to(Family::Ip));
        let prev = c.prev_result.unwrap();
        assert_eq!(prev.host_interfaces, vec!["cni0", "veth1"]);
        assert_eq!(prev.container_ips.len(), 2);
        assert_eq!(
            prev.container_subnet(Family::Ip).unwrap().to_string(),
            "10.88.0.0/16"
        );
        assert_eq!(
            prev.container_subnet(Family::Ip6).unwrap().to_string(),
            "fd00::/64"
        );
    }

    /// DEL and GC read past everything ADD would refuse: iptables conditions, wrong types, an iptables
    /// chain, unknown keys, a broken prevResult. GC still needs its list, and a name ADD would refuse is no
    /// network of ours.
    #[test]
    fn del_and_gc_read_only_the_name_and_the_attachments() {
        let hostile = conf(json!({
            "conditionsV4": ["-m", "comment", "--comment", "x"], "conditionsV6": "nope",
            "snat": "yes", "masqAll": 3, "markMasqBit": 99, "externalSetMarkChain": "KUBE-MARK",
            "unknown": {"deep": [1]}, "prevResult": [], "runtimeConfig": {"portMappings": 7},
        }));
        let bytes = hostile.to_string();
        assert!(parse(bytes.as_bytes()).is_err(), "ADD refuses it");
        let del = parse_removal(bytes.as_bytes(), false).unwrap();
        assert_eq!(del.name.as_deref(), Some("net1"));
        let gc = parse_removal(bytes.as_bytes(), true).unwrap();
        assert_eq!(gc.valid_attachments, None, "absent: GC says so itself");
        let mut with = hostile.clone();
        with["cni.dev/valid-attachments"] = json!([{"containerID": "c1", "ifname": "eth0"}]);
        let gc = parse_removal(with.to_string().as_bytes(), true).unwrap();
        assert_eq!(gc.valid_attachments.map(|v| v.len()), Some(1));
        let mut bad_name = hostile;
        bad_name["name"] = json!("no spaces allowed");
        assert_eq!(
            parse_removal(bad_name.to_string().as_bytes(), false)
                .unwrap()
                .name,
            None
        );
        assert!(
            parse_removal(b"[]", false).is_err(),
            "not a configuration at all"
        );
    }

    #[test]
    fn errors_name_the_field() {
        let m = |pm: Value| conf(json!({"runtimeConfig": {"portMappings": [pm]}}));
        let cases = [
            (
                m(json!({"containerPort": 80, "protocol": "tcp"})),
                "runtimeConfig.portMappings[0].hostPort: missing",
            ),
            (
                m(json!({"hostPort": 0, "containerPort": 80, "protocol": "tcp"})),
                "portMappings[0].hostPort: 0 is not a port",
            ),
            (
                m(json!({"hostPort": 70000, "containerPort": 80, "protocol": "tcp"})),
                "hostPort: 70000",
            ),
            (
                m(json!({"hostPort": 1, "containerPort": 80, "protocol": "icmp"})),
                "protocol: \"icmp\"",
            ),
            (
                m(json!({"hostPort": 1, "containerPort": 80, "protocol": "tcp", "hostIP": "x"})),
                "hostIP",
            ),
            (
                conf(json!({"conditionsV4": ["ip saddr nope"]})),
                "conditionsV4[0]",
            ),
            (conf(json!({"markMasqBit": 32})), "markMasqBit"),
            (conf(json!({"snat": "yes"})), "snat"),
            (json!({"cniVersion": "1.1.0"}), "name: missing"),
            (json!({"cniVersion": "1.1.0", "name": "-x"}), "name:"),
            (json!({"cniVersion": "0.1.0", "name": "x"}), "cniVersion"),
        ];
        for (input, want) in cases {
            let e = err_of(input.clone());
            assert!(e.msg.contains(want), "{input}: {e:?}");
        }
        assert_eq!(
            err_of(conf(json!({"externalSetMarkChain": "KUBE-MARK-MASQ"}))).code,
            code::UNSUPPORTED_FIELD
        );
        assert_eq!(parse(b"{").unwrap_err().code, code::DECODE_FAILURE);
    }
}
