//! `kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family, traffic_policy}`: service ports whose
//! traffic policy is Local and that have no usable endpoint on this node, so that their traffic of that
//! kind is dropped here.
//!
//! kube-proxy recounts every service port at each sync. To keep a partial sync's cost in proportion to
//! its changes, the count of each service is kept and only the services a sync touched are recounted
//! (all of them after a full sync); the totals move by the difference.
//!
//! Per service port and per family of its cluster IPs (a dual-stack kube-proxy's proxiers each count the
//! ports of their family), with kube-proxy's conditions:
//! - `internal`: `internalTrafficPolicy: Local`, no local endpoint of the family;
//! - `external`: externally reachable (NodePort, LoadBalancer or external IPs), `externalTrafficPolicy:
//!   Local`, no local endpoint of the family.
//!
//! A local endpoint is usable when it is ready, or, when none of them is, serving while terminating
//! (kube-proxy's fallback).

use std::collections::{BTreeMap, HashMap};

use nftkube_metrics::{IpFamily as Family, TrafficPolicy as Policy, NO_LOCAL_ENDPOINTS};
use nftkube_model::{
    ClusterState, Endpoint, IpFamily, NamespacedName, ServicePort, ServiceType, TrafficPolicy,
};

/// Counts by family and policy (absent: 0).
type Counts = BTreeMap<(Family, Policy), usize>;

/// The counts of every service, and their totals as published.
#[derive(Debug, Default)]
pub(crate) struct NoLocalEndpoints {
    /// Only services with a non-zero count.
    by_service: HashMap<NamespacedName, Counts>,
    totals: Counts,
}

impl NoLocalEndpoints {
    /// Recounts service `name` as `state` holds it now.
    pub(crate) fn recount(&mut self, state: &ClusterState, name: &NamespacedName, node: &str) {
        let new = service_counts(state, name, node);
        let old = match new.is_empty() {
            true => self.by_service.remove(name),
            false => self.by_service.insert(name.clone(), new.clone()),
        };
        for (key, n) in old.unwrap_or_default() {
            *self.totals.entry(key).or_default() -= n;
        }
        for (key, n) in new {
            *self.totals.entry(key).or_default() += n;
        }
    }

    /// The services counted now (a full sync recounts them too, in case one left the model unnoticed).
    pub(crate) fn services(&self) -> impl Iterator<Item = &NamespacedName> {
        self.by_service.keys()
    }

    /// Sets the gauge to the totals.
    pub(crate) fn publish(&self) {
        for f in Family::ALL {
            for p in Policy::ALL {
                let n = self.totals.get(&(f, p)).copied().unwrap_or(0);
                NO_LOCAL_ENDPOINTS.set(f, p, n);
            }
        }
    }
}

/// The counts of one service.
fn service_counts(state: &ClusterState, name: &NamespacedName, node: &str) -> Counts {
    let mut out = Counts::new();
    let ports = state.service_ports(name);
    // Most services have no Local policy: their endpoints are not even gathered.
    if !ports.iter().any(|p| local_policies(p).next().is_some()) {
        return out;
    }
    let endpoints = state.service_endpoints(name);
    for port in ports {
        let eps = endpoints.get(&port.name).map(Vec::as_slice).unwrap_or(&[]);
        for f in port_families(port) {
            if has_local_endpoint(eps, f, node) {
                continue;
            }
            for policy in local_policies(port) {
                *out.entry((metric_family(f), policy)).or_default() += 1;
            }
        }
    }
    out
}

/// The families of a port's cluster IPs, each once.
fn port_families(port: &ServicePort) -> Vec<IpFamily> {
    let mut families: Vec<IpFamily> = port.cluster_ips.iter().map(IpFamily::of).collect();
    families.sort();
    families.dedup();
    families
}

/// The policies of `port` that are Local and apply to it.
fn local_policies(port: &ServicePort) -> impl Iterator<Item = Policy> {
    let internal = port.internal_traffic_policy == TrafficPolicy::Local;
    let reachable_outside =
        port.service_type != ServiceType::ClusterIP || !port.external_ips.is_empty();
    let external = reachable_outside && port.external_traffic_policy == TrafficPolicy::Local;
    [(internal, Policy::Internal), (external, Policy::External)]
        .into_iter()
        .filter_map(|(local, p)| local.then_some(p))
}

/// Whether `node` has an endpoint of family `f` that traffic may use: ready, or serving and terminating
/// (the fallback applies when no ready one exists, so either kind is enough).
fn has_local_endpoint(eps: &[Endpoint], f: IpFamily, node: &str) -> bool {
    !node.is_empty()
        && eps.iter().any(|e| {
            e.node_name.as_deref() == Some(node)
                && IpFamily::of(&e.ip) == f
                && (e.ready || (e.serving && e.terminating))
        })
}

fn metric_family(f: IpFamily) -> Family {
    match f {
        IpFamily::V4 => Family::V4,
        IpFamily::V6 => Family::V6,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_model::{Protocol, ServicePortName, SliceEndpoint, SliceInfo, SlicePort};
    use std::net::IpAddr;

    fn port(service: &str, ips: &[&str], kind: ServiceType, itp: bool, etp: bool) -> ServicePort {
        let name = ServicePortName {
            service: NamespacedName::new("ns", service),
            port: "p".into(),
            protocol: Protocol::Tcp,
        };
        let mut p =
            ServicePort::cluster_ip(name, ips.iter().map(|i| i.parse().unwrap()).collect(), 80);
        p.service_type = kind;
        let local = |b: bool| {
            if b {
                TrafficPolicy::Local
            } else {
                TrafficPolicy::Cluster
            }
        };
        p.internal_traffic_policy = local(itp);
        p.external_traffic_policy = local(etp);
        p
    }

    fn ep(ip: &str, node: &str, ready: bool, terminating: bool) -> Endpoint {
        let mut e = Endpoint::ready(ip.parse::<IpAddr>().unwrap(), 8080);
        e.ready = ready;
        e.serving = true;
        e.terminating = terminating;
        e.node_name = Some(node.into());
        e
    }

    #[test]
    fn local_policies_follow_kube_proxys_conditions() {
        let cip = port("a", &["10.0.0.1"], ServiceType::ClusterIP, true, true);
        assert_eq!(local_policies(&cip).collect::<Vec<_>>(), [Policy::Internal]);
        let mut ext = port("a", &["10.0.0.1"], ServiceType::ClusterIP, false, true);
        assert_eq!(local_policies(&ext).count(), 0);
        ext.external_ips = vec!["192.0.2.1".parse().unwrap()];
        assert_eq!(local_policies(&ext).collect::<Vec<_>>(), [Policy::External]);
        let lb = port("a", &["10.0.0.1"], ServiceType::LoadBalancer, true, true);
        assert_eq!(
            local_policies(&lb).collect::<Vec<_>>(),
            [Policy::Internal, Policy::External]
        );
        let dual = port(
            "a",
            &["fd00::1", "10.0.0.1", "10.0.0.2"],
            ServiceType::NodePort,
            false,
            true,
        );
        assert_eq!(port_families(&dual), [IpFamily::V4, IpFamily::V6]);
    }

    #[test]
    fn local_endpoints_count_by_family_node_and_readiness() {
        let eps = [
            ep("10.1.0.1", "node-2", true, false),
            ep("fd01::1", "node-1", false, true),
            ep("10.1.0.2", "node-1", false, false),
        ];
        // IPv4: the only local one is neither ready nor terminating; the ready one is elsewhere.
        assert!(!has_local_endpoint(&eps, IpFamily::V4, "node-1"));
        // IPv6: a serving terminating local endpoint is the fallback.
        assert!(has_local_endpoint(&eps, IpFamily::V6, "node-1"));
        assert!(has_local_endpoint(&eps, IpFamily::V4, "node-2"));
        assert!(!has_local_endpoint(&eps, IpFamily::V4, ""));
    }

    fn slice(eps: Vec<SliceEndpoint>) -> SliceInfo {
        SliceInfo {
            namespace: "ns".into(),
            name: "a-v4".into(),
            service: "a".into(),
            address_type: IpFamily::V4,
            ports: vec![SlicePort {
                name: "p".into(),
                port: 8080,
                protocol: Protocol::Tcp,
            }],
            endpoints: eps,
        }
    }

    #[test]
    fn totals_follow_each_recounted_service() {
        let name = NamespacedName::new("ns", "a");
        let mut st = ClusterState::new();
        let dual = port(
            "a",
            &["10.0.0.1", "fd00::1"],
            ServiceType::NodePort,
            true,
            true,
        );
        st.apply_service(name.clone(), vec![dual]);
        let local =
            SliceEndpoint::new("10.1.0.1".parse().unwrap(), true, true, false).on_node("node-1");
        st.apply_slice(slice(vec![local]));
        let mut n = NoLocalEndpoints::default();
        n.recount(&st, &name, "node-1");
        let t = |n: &NoLocalEndpoints, f, p| n.totals.get(&(f, p)).copied().unwrap_or(0);
        // IPv4 has its local endpoint; IPv6 has none: both of its policies count.
        assert_eq!(t(&n, Family::V4, Policy::Internal), 0);
        assert_eq!(t(&n, Family::V6, Policy::Internal), 1);
        assert_eq!(t(&n, Family::V6, Policy::External), 1);
        // Seen from another node, IPv4 has none either.
        n.recount(&st, &name, "node-2");
        assert_eq!(t(&n, Family::V4, Policy::External), 1);
        assert_eq!(
            t(&n, Family::V6, Policy::External),
            1,
            "recounted, not added"
        );
        n.publish();
        assert_eq!(NO_LOCAL_ENDPOINTS.get(Family::V4, Policy::Internal), 1);
        // A service gone from the model takes its counts away.
        st.delete_service(&name);
        n.recount(&st, &name, "node-2");
        assert!(n.totals.values().all(|&v| v == 0), "{:?}", n.totals);
        assert!(n.by_service.is_empty());
    }
}
