//! Deterministic names for what we create in the kernel.

use crate::model::ServicePortName;

/// The table every nftkube object lives in (one per address family).
pub const TABLE: &str = "nftkube";

pub const CHAIN_NAT_PREROUTING: &str = "nat-prerouting";
pub const CHAIN_NAT_OUTPUT: &str = "nat-output";
pub const CHAIN_NAT_POSTROUTING: &str = "nat-postrouting";
pub const CHAIN_FILTER_FORWARD: &str = "filter-forward";
pub const CHAIN_FILTER_OUTPUT: &str = "filter-output";
pub const CHAIN_SERVICES: &str = "services";
pub const CHAIN_MASQUERADING: &str = "masquerading";
pub const CHAIN_CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub const CHAIN_REJECT: &str = "reject-chain";

pub const SET_CLUSTER_IPS: &str = "cluster-ips";
pub const MAP_SERVICE_IPS: &str = "service-ips";
pub const MAP_SERVICE_ENDPOINTS: &str = "service-endpoints";
pub const SET_HAIRPIN: &str = "hairpin-endpoints";

/// Prefix of the load-balancing chains, one per endpoint count in use.
pub const LB_CHAIN_PREFIX: &str = "lb-";

/// `lb-<n>`: picks one of n endpoints with `numgen random mod n`.
pub fn lb_chain(n: u32) -> String {
    format!("{LB_CHAIN_PREFIX}{n}")
}

/// The endpoint count an `lb-<n>` chain serves, if `name` is one.
pub fn lb_count(name: &str) -> Option<u32> {
    name.strip_prefix(LB_CHAIN_PREFIX)?.parse().ok()
}

/// `<hash>-<namespace>/<name>/<protocol>/<port>`: a readable identity for a service port, unique even when
/// names are long (the hash covers the full identity). Used in comments and logs.
pub fn service_id(spn: &ServicePortName) -> String {
    let id = format!(
        "{}/{}/{}/{}",
        spn.service.namespace, spn.service.name, spn.protocol, spn.port
    );
    format!("{}-{id}", short_hash(&id))
}

/// 8 characters of base32 over FNV-1a 64: stable across versions and platforms.
fn short_hash(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    (0..8)
        .map(|i| ALPHABET[((h >> (i * 5)) & 31) as usize] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NamespacedName, Protocol};

    #[test]
    fn lb_chain_names_round_trip() {
        assert_eq!(lb_count(&lb_chain(7)), Some(7));
        assert_eq!(lb_count("services"), None);
    }

    #[test]
    fn service_ids_are_stable_and_distinct() {
        let a = ServicePortName {
            service: NamespacedName::new("demo", "echo"),
            port: "tcp".into(),
            protocol: Protocol::Tcp,
        };
        let mut b = a.clone();
        b.protocol = Protocol::Udp;
        assert_eq!(service_id(&a), service_id(&a.clone()));
        assert_ne!(service_id(&a), service_id(&b));
        assert!(service_id(&a).ends_with("-demo/echo/tcp/tcp"));
    }
}
