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
pub const SET_HAIRPIN: &str = "hairpin-endpoints";

/// Prefix of every per-service-port chain.
pub const SERVICE_CHAIN_PREFIX: &str = "service-";

/// `service-<hash>-<namespace>/<name>/<protocol>/<port>`: readable, and unique even when names are long or
/// would collide after truncation (the hash covers the full identity). Kernel limit: 256 bytes.
pub fn service_chain(spn: &ServicePortName) -> String {
    let id = format!(
        "{}/{}/{}/{}",
        spn.service.namespace, spn.service.name, spn.protocol, spn.port
    );
    format!("{SERVICE_CHAIN_PREFIX}{}-{id}", short_hash(&id))
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
    fn service_chain_names_are_stable_and_distinct() {
        let a = ServicePortName {
            service: NamespacedName::new("demo", "echo"),
            port: "tcp".into(),
            protocol: Protocol::Tcp,
        };
        let mut b = a.clone();
        b.protocol = Protocol::Udp;
        assert_eq!(service_chain(&a), service_chain(&a.clone()));
        assert_ne!(service_chain(&a), service_chain(&b));
        assert!(service_chain(&a).ends_with("-demo/echo/tcp/tcp"));
        assert!(service_chain(&a).starts_with("service-"));
    }
}
