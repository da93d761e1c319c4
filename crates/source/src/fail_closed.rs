//! What the sources do with an object they cannot convert, where keeping its last good version (their rule
//! otherwise) would leave traffic flowing that neither version allows.
//!
//! - **A Service whose update restricts sources.** When the update that cannot be read has
//!   `loadBalancerSourceRanges`, or the version in effect has them, the last good version may be wider than
//!   what the owner asked for now (an open LoadBalancer they are restricting). Its frontends reachable from
//!   outside the cluster (external and LoadBalancer IPs) are closed instead, until a version that converts
//!   arrives: the last good version goes out again without them. Cluster IPs and node ports stay as they
//!   were: the source ranges never applied to them (kube-proxy filters only the LoadBalancer IPs).
//! - **An EndpointSlice.** Its endpoints are withdrawn (a deletion of the slice): the addresses it held
//!   may belong to other pods by now, and traffic to none is better than traffic to the wrong pod.
//!
//! Closing, rather than keeping the stricter of the two versions: "stricter" needs both versions read,
//! and the new one is exactly what could not be read.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;
use serde_json::Value;

use nftkube_model::{NamespacedName, ServicePort};

/// The last good ports of the Services emitted with frontends reachable from outside (external or
/// LoadBalancer IPs): what closing them needs. Only those Services: the sources otherwise keep a fingerprint
/// per object, not the object, and most Services have no such frontend.
#[derive(Debug, Default)]
pub(crate) struct ExposedServices {
    ports: BTreeMap<NamespacedName, Vec<ServicePort>>,
}

impl ExposedServices {
    /// `ports` were emitted for `key`.
    pub(crate) fn emitted(&mut self, key: &NamespacedName, ports: &[ServicePort]) {
        if ports.iter().any(reachable_from_outside) {
            self.ports.insert(key.clone(), ports.to_vec());
        } else {
            self.ports.remove(key);
        }
    }

    /// `key` was deleted.
    pub(crate) fn deleted(&mut self, key: &NamespacedName) {
        self.ports.remove(key);
    }

    /// An update of `key` could not be converted (`update_restricts_sources`: it has
    /// `loadBalancerSourceRanges`). The version to emit instead of keeping the last good one: that one
    /// without its outside frontends, when either version restricts sources and there is something to
    /// close. None: keep the last good version.
    pub(crate) fn closed_on_failure(
        &self,
        key: &NamespacedName,
        update_restricts_sources: bool,
    ) -> Option<Vec<ServicePort>> {
        let last_good = self.ports.get(key)?;
        let restricted = last_good
            .iter()
            .any(|p| !p.load_balancer_source_ranges.is_empty());
        (update_restricts_sources || restricted).then(|| without_outside_frontends(last_good))
    }
}

fn reachable_from_outside(port: &ServicePort) -> bool {
    !port.external_ips.is_empty() || !port.load_balancer_ips.is_empty()
}

/// `ports` with no external or LoadBalancer IP: nothing outside reaches the service through them.
fn without_outside_frontends(ports: &[ServicePort]) -> Vec<ServicePort> {
    ports
        .iter()
        .map(|p| ServicePort {
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            ..p.clone()
        })
        .collect()
}

/// Whether a Service's spec lists any `loadBalancerSourceRanges` entry (read or not).
pub(crate) fn asks_source_ranges(svc: &Service) -> bool {
    svc.spec
        .as_ref()
        .and_then(|s| s.load_balancer_source_ranges.as_ref())
        .is_some_and(|r| !r.is_empty())
}

/// The same for a Service that may not even deserialize: anything there but null or an empty list counts
/// (a malformed field may well be a restriction).
pub(crate) fn value_asks_source_ranges(svc: &Value) -> bool {
    match svc.pointer("/spec/loadBalancerSourceRanges") {
        None | Some(Value::Null) => false,
        Some(Value::Array(ranges)) => !ranges.is_empty(),
        Some(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_model::{Protocol, ServicePortName};

    fn port(lb: &[&str], ranges: &[&str]) -> ServicePort {
        let name = ServicePortName {
            service: NamespacedName::new("demo", "lb"),
            port: "".into(),
            protocol: Protocol::Tcp,
        };
        let mut p = ServicePort::cluster_ip(name, vec!["10.96.0.1".parse().unwrap()], 80);
        p.load_balancer_ips = lb.iter().map(|s| s.parse().unwrap()).collect();
        p.load_balancer_source_ranges = ranges.iter().map(|s| s.parse().unwrap()).collect();
        p
    }

    #[test]
    fn closes_only_when_a_version_restricts_sources_and_something_is_exposed() {
        let key = NamespacedName::new("demo", "lb");
        let mut exposed = ExposedServices::default();
        // Nothing emitted: nothing to close.
        assert_eq!(exposed.closed_on_failure(&key, true), None);
        // An open LoadBalancer: kept on an unrelated failure, closed when the update restricts.
        exposed.emitted(&key, &[port(&["192.0.2.10"], &[])]);
        assert_eq!(exposed.closed_on_failure(&key, false), None);
        let closed = exposed.closed_on_failure(&key, true).unwrap();
        assert!(closed[0].load_balancer_ips.is_empty());
        assert_eq!(closed[0].cluster_ips, port(&[], &[]).cluster_ips);
        // A restricted one: closed on any failure (the update may be lifting or widening it).
        exposed.emitted(&key, &[port(&["192.0.2.10"], &["10.0.0.0/8"])]);
        assert!(exposed.closed_on_failure(&key, false).is_some());
        // Once closed (or never exposed), nothing is kept.
        exposed.emitted(&key, &closed);
        assert_eq!(exposed.closed_on_failure(&key, true), None);
        exposed.emitted(&key, &[port(&["192.0.2.10"], &[])]);
        exposed.deleted(&key);
        assert_eq!(exposed.closed_on_failure(&key, true), None);
    }

    #[test]
    fn source_ranges_asked_in_raw_specs() {
        let v = |spec: Value| serde_json::json!({"spec": spec});
        assert!(!value_asks_source_ranges(&v(serde_json::json!({}))));
        assert!(!value_asks_source_ranges(&v(
            serde_json::json!({"loadBalancerSourceRanges": null})
        )));
        assert!(!value_asks_source_ranges(&v(
            serde_json::json!({"loadBalancerSourceRanges": []})
        )));
        assert!(value_asks_source_ranges(&v(
            serde_json::json!({"loadBalancerSourceRanges": ["x"]})
        )));
        assert!(value_asks_source_ranges(&v(
            serde_json::json!({"loadBalancerSourceRanges": "10.0.0.0/8"})
        )));
        let svc: Service = serde_json::from_value(v(
            serde_json::json!({"loadBalancerSourceRanges": ["010.0.0.0/8"]}),
        ))
        .unwrap();
        assert!(asks_source_ranges(&svc));
        assert!(!asks_source_ranges(&Service::default()));
    }
}
