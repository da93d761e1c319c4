//! Which service port put a set element there: read off the element's key (its address, protocol and port
//! components, whatever else the key holds) and matched against the model's service ports.

use nftkube_model::{ServiceMap, ServicePort, TrafficPolicy};
use nftkube_nft::ir::{DataType, Set};
use std::net::IpAddr;

/// Names the owner of a set element from its key.
pub trait Attribution {
    /// The service port (and its policies) an element of `set` with `key` belongs to, if known.
    fn describe(&self, set: &Set, key: &[u8]) -> Option<String>;
}

/// No model (the kernel's state alone): the keys speak for themselves.
pub struct KeysOnly;

impl Attribution for KeysOnly {
    fn describe(&self, _set: &Set, _key: &[u8]) -> Option<String> {
        None
    }
}

/// The service ports of the manifests the plan was rendered from.
pub struct FromModel {
    ports: Vec<ServicePort>,
}

impl FromModel {
    /// Attribution by the service ports of this model.
    pub fn new(services: &ServiceMap) -> FromModel {
        FromModel {
            ports: services.values().cloned().collect(),
        }
    }
}

/// The address, protocol and port components of a key, in the order the key types give them.
#[derive(Debug, Default, PartialEq)]
struct KeyParts {
    ip: Option<IpAddr>,
    proto: Option<u8>,
    port: Option<u16>,
}

fn key_parts(types: &[DataType], key: &[u8]) -> KeyParts {
    let mut parts = KeyParts::default();
    let mut off = 0;
    for t in types {
        let len = t.len();
        let Some(b) = key.get(off..off + len) else {
            break;
        };
        match t {
            DataType::Ipv4Addr if parts.ip.is_none() => {
                parts.ip = Some(IpAddr::from([b[0], b[1], b[2], b[3]]));
            }
            DataType::Ipv6Addr if parts.ip.is_none() => {
                let mut a = [0u8; 16];
                a.copy_from_slice(b);
                parts.ip = Some(IpAddr::from(a));
            }
            DataType::InetProto if parts.proto.is_none() => parts.proto = Some(b[0]),
            DataType::InetService if parts.port.is_none() => {
                parts.port = Some(u16::from_be_bytes([b[0], b[1]]))
            }
            _ => {}
        }
        off += if types.len() > 1 {
            nftkube_netlink::align4(len)
        } else {
            len
        };
    }
    parts
}

/// `demo/web:http (ClusterIP 10.96.0.10, externalTrafficPolicy Local, ClientIP affinity 10800s)`.
fn describe_port(sp: &ServicePort, frontend: &str) -> String {
    let mut s = format!("service {} ({frontend}", sp.name);
    if sp.external_traffic_policy == TrafficPolicy::Local {
        s.push_str(", externalTrafficPolicy Local");
    }
    if sp.internal_traffic_policy == TrafficPolicy::Local {
        s.push_str(", internalTrafficPolicy Local");
    }
    if let Some(t) = sp.session_affinity_timeout {
        s.push_str(&format!(", ClientIP affinity {t}s"));
    }
    if !sp.load_balancer_source_ranges.is_empty() {
        s.push_str(", loadBalancerSourceRanges");
    }
    s.push(')');
    s
}

fn frontend_of(sp: &ServicePort, parts: &KeyParts) -> Option<String> {
    let proto = parts.proto.is_none_or(|p| p == sp.protocol.number());
    if !proto {
        return None;
    }
    match (parts.ip, parts.port) {
        (Some(ip), Some(port)) if port == sp.port => {
            if sp.cluster_ips.contains(&ip) {
                Some(format!("ClusterIP {ip}"))
            } else if sp.load_balancer_ips.contains(&ip) {
                Some(format!("LoadBalancer IP {ip}"))
            } else if sp.external_ips.contains(&ip) {
                Some(format!("external IP {ip}"))
            } else {
                None
            }
        }
        (None, Some(port)) if sp.node_port == Some(port) => Some(format!("NodePort {port}")),
        _ => None,
    }
}

impl Attribution for FromModel {
    fn describe(&self, set: &Set, key: &[u8]) -> Option<String> {
        let parts = key_parts(&set.key, key);
        parts.port?;
        let owners: Vec<String> = self
            .ports
            .iter()
            .filter_map(|sp| frontend_of(sp, &parts).map(|f| describe_port(sp, &f)))
            .collect();
        (!owners.is_empty()).then(|| owners.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_parts_skip_padding_and_slots() {
        let types = [
            DataType::Ipv4Addr,
            DataType::InetProto,
            DataType::InetService,
            DataType::Integer(4),
        ];
        let key = [10, 96, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0, 1, 0, 0, 0];
        assert_eq!(
            key_parts(&types, &key),
            KeyParts {
                ip: Some("10.96.0.10".parse().unwrap()),
                proto: Some(6),
                port: Some(80)
            }
        );
    }
}
