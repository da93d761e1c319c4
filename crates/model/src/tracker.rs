//! Cluster state store and change tracking: what kube-proxy's ServiceChangeTracker /
//! EndpointsChangeTracker and `UpdateServiceMap` / `UpdateEndpointsMap` do, as plain data.
//!
//! The store keeps every service port and every EndpointSlice. Mutations remember a snapshot of each
//! affected service as it was at the previous [`ClusterState::take_changes`] (taken lazily, on the first
//! mutation that touches the service), so computing the changes costs O(changed services), never
//! O(cluster).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::intern::{FastMap, NameKey, SharedName, SharedValues, Topology};
use super::types::*;

/// One port of an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SlicePort {
    /// The port's name ("" if unnamed); matched against the service port's name. Shared: most slices
    /// use the same few names.
    pub name: Arc<str>,
    /// The port number.
    pub port: u16,
    /// The port's protocol.
    pub protocol: Protocol,
}

/// One endpoint of an EndpointSlice, with its conditions already defaulted the way the API says
/// (ready unknown → ready; serving unknown → ready; terminating unknown → false).
///
/// 32 bytes: a cluster has millions of these.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SliceEndpoint {
    /// The endpoint's first address, the only one consumers use (the API says an endpoint's addresses
    /// are fungible, and kube-proxy programs the first). The converter still validates all of them.
    pub address: IpAddr,
    /// `conditions.ready`.
    pub ready: bool,
    /// `conditions.serving`.
    pub serving: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
    /// Node, zone and hints; None when the endpoint has none of them. Shared between endpoints.
    pub topology: Option<Arc<Topology>>,
}

impl SliceEndpoint {
    /// An endpoint without node, zone or hints.
    pub fn new(address: IpAddr, ready: bool, serving: bool, terminating: bool) -> Self {
        SliceEndpoint {
            address,
            ready,
            serving,
            terminating,
            topology: None,
        }
    }

    /// The same endpoint on `node` (tests and sources build endpoints this way).
    pub fn on_node(mut self, node: &str) -> Self {
        let mut t = self.topology.as_deref().cloned().unwrap_or_default();
        t.node_name = Some(node.into());
        self.topology = Some(Arc::new(t));
        self
    }

    /// The node the endpoint is on.
    pub fn node_name(&self) -> Option<&str> {
        self.topology.as_deref()?.node_name.as_deref()
    }

    /// The zone the endpoint is in.
    pub fn zone(&self) -> Option<&str> {
        self.topology.as_deref()?.zone.as_deref()
    }

    /// Topology hints: the zones that should use this endpoint.
    pub fn zone_hints(&self) -> &[String] {
        self.topology.as_deref().map_or(&[], |t| &t.zone_hints)
    }

    /// Topology hints: the nodes that should use this endpoint.
    pub fn node_hints(&self) -> &[String] {
        self.topology.as_deref().map_or(&[], |t| &t.node_hints)
    }

    /// The model endpoint for a service port whose slice port resolved to `port`.
    fn to_endpoint(&self, port: u16) -> Endpoint {
        let t = self.topology.as_deref();
        Endpoint {
            ip: self.address,
            port,
            ready: self.ready,
            serving: self.serving,
            terminating: self.terminating,
            node_name: t.and_then(|t| t.node_name.clone()),
            zone: t.and_then(|t| t.zone.clone()),
            zone_hints: t.map(|t| t.zone_hints.clone()).unwrap_or_default(),
            node_hints: t.map(|t| t.node_hints.clone()).unwrap_or_default(),
        }
    }
}

/// An EndpointSlice, converted (see `source::convert::endpoint_slice`). No kube types. The strings are
/// shared: the store, and the source that produced the slice, point at one copy.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SliceInfo {
    /// The slice's namespace.
    pub namespace: Arc<str>,
    /// The slice's name.
    pub name: Arc<str>,
    /// Name of the owning service (label `kubernetes.io/service-name`), in the same namespace.
    pub service: Arc<str>,
    /// Which family its addresses are.
    pub address_type: IpFamily,
    /// Its ports (each endpoint serves all of them).
    pub ports: Vec<SlicePort>,
    /// Its endpoints.
    pub endpoints: Vec<SliceEndpoint>,
}

impl SliceInfo {
    /// "namespace/slice-name".
    pub fn key(&self) -> NamespacedName {
        NamespacedName::new(self.namespace.clone(), self.name.clone())
    }
    /// "namespace/service-name" of the owning service.
    pub fn service_key(&self) -> NamespacedName {
        NamespacedName::new(self.namespace.clone(), self.service.clone())
    }

    /// (namespace, slice name), shared.
    fn shared_key(&self) -> SharedName {
        SharedName {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    /// (namespace, service name), shared.
    fn shared_service_key(&self) -> SharedName {
        SharedName {
            namespace: self.namespace.clone(),
            name: self.service.clone(),
        }
    }

    /// Points every repeated value (namespace, port names, topologies) at `shared`'s copy and drops spare
    /// capacity.
    pub fn share_values(&mut self, shared: &mut SharedValues) {
        self.namespace = shared.strings.share(&self.namespace);
        for p in &mut self.ports {
            p.name = shared.strings.share(&p.name);
        }
        for ep in &mut self.endpoints {
            if let Some(t) = &ep.topology {
                ep.topology = Some(shared.topologies.share(t));
            }
        }
        self.ports.shrink_to_fit();
        self.endpoints.shrink_to_fit();
    }
}

/// What changed since the previous [`ClusterState::take_changes`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services whose ports or endpoints differ from the previous snapshot.
    pub changed_services: BTreeSet<NamespacedName>,
    /// Cluster IPs of removed UDP service ports that no remaining UDP service port uses.
    pub deleted_udp_cluster_ips: BTreeSet<IpAddr>,
    /// Endpoints that were serving and are now gone or no longer serving (all protocols; the
    /// consumer filters for UDP / SCTP conntrack cleanup).
    pub stale_endpoints: Vec<(ServicePortName, Endpoint)>,
    /// Service ports that went from no serving endpoint to at least one (all protocols).
    pub newly_active_services: BTreeSet<ServicePortName>,
}

impl Changes {
    /// No services and no slices.
    pub fn is_empty(&self) -> bool {
        self.changed_services.is_empty()
            && self.deleted_udp_cluster_ips.is_empty()
            && self.stale_endpoints.is_empty()
            && self.newly_active_services.is_empty()
    }
}

/// What one service looked like: its ports and its endpoints per port.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Snapshot {
    ports: Vec<ServicePort>,
    endpoints: BTreeMap<ServicePortName, Vec<Endpoint>>,
}

/// Every service port and EndpointSlice the source reported, plus change tracking.
#[derive(Debug, Default)]
pub struct ClusterState {
    services: ServiceMap,
    /// (namespace, service) → the EndpointSlices whose service label names it, sorted by slice name (the
    /// merge's tie-break order). Grouped by service because that is how they are read; the service name
    /// in the key is the slices' own copy.
    slices: FastMap<SharedName, Vec<SliceInfo>>,
    /// (namespace, slice name) → the service the slice belongs to: finds a slice on update and delete.
    /// Both strings are the slice's own copies.
    slice_owners: FastMap<SharedName, Arc<str>>,
    /// Namespaces, port names and endpoint topologies, one copy each.
    shared: SharedValues,
    /// Cluster IP → number of UDP service ports using it.
    udp_cluster_ip_refs: FastMap<IpAddr, usize>,
    /// Services touched since the last `take_changes`, with their state at that time.
    pending: BTreeMap<NamespacedName, Snapshot>,
    /// Smallest size of `services` since its last rebuild (see `compact_services`).
    services_low: usize,
}

impl ClusterState {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces all ports of a service (an empty list removes the service, e.g. one that became headless).
    /// Each port's `name.service` is forced to `key`.
    pub fn apply_service(&mut self, mut key: NamespacedName, ports: Vec<ServicePort>) {
        // One copy of the namespace for the whole store, one of the name for all of the service's ports.
        key.namespace = self.shared.strings.share(&key.namespace);
        self.touch(&key);
        self.remove_ports(&key);
        for mut port in ports {
            debug_assert_eq!(port.name.service, key, "service port of another service");
            port.name.service = key.clone();
            port.name.port = self.shared.strings.share(&port.name.port);
            if port.protocol == Protocol::Udp {
                for ip in &port.cluster_ips {
                    *self.udp_cluster_ip_refs.entry(*ip).or_default() += 1;
                }
            }
            if let Some(old) = self.services.insert(port.name.clone(), port) {
                // Duplicate port names in one call: the last one wins.
                self.unref_udp(&old);
            }
        }
    }

    /// Removes a Service (its slices stay, waiting for it or for their own deletion).
    pub fn delete_service(&mut self, key: &NamespacedName) {
        if self.ports_of(key).next().is_none() {
            return;
        }
        self.touch(key);
        self.remove_ports(key);
    }

    /// Adds or replaces an EndpointSlice (keyed by namespace and slice name).
    pub fn apply_slice(&mut self, mut slice: SliceInfo) {
        slice.share_values(&mut self.shared);
        if let Some(old) = self.slice(&slice.namespace, &slice.name) {
            if *old == slice {
                return;
            }
            if old.service != slice.service {
                let old_service = old.service_key();
                self.touch(&old_service);
                self.remove_slice(&slice.namespace, &slice.name);
            }
        }
        self.touch(&slice.service_key());
        self.insert_slice(slice);
    }

    /// Removes an EndpointSlice.
    pub fn delete_slice(&mut self, namespace: &str, name: &str) {
        let Some(old) = self.slice(namespace, name) else {
            return;
        };
        let service = old.service_key();
        self.touch(&service);
        self.remove_slice(namespace, name);
    }

    /// All service ports.
    pub fn service_map(&self) -> &ServiceMap {
        &self.services
    }

    /// Names of the services that have at least one port.
    pub fn service_names(&self) -> BTreeSet<NamespacedName> {
        self.services.keys().map(|n| n.service.clone()).collect()
    }

    /// The ports of one service, in `ServicePortName` order.
    pub fn service_ports(&self, key: &NamespacedName) -> Vec<&ServicePort> {
        self.ports_of(key).collect()
    }

    /// An EndpointSlice by namespace and name.
    pub(crate) fn slice(&self, namespace: &str, name: &str) -> Option<&SliceInfo> {
        let service = self.slice_owners.get::<dyn NameKey>(&(namespace, name))?;
        let group = self.slices.get::<dyn NameKey>(&(namespace, &**service))?;
        let at = find_slice(group, name).ok()?;
        Some(&group[at])
    }

    #[cfg(test)]
    /// Every EndpointSlice, in (namespace, name) order.
    pub(crate) fn slices(&self) -> impl Iterator<Item = &SliceInfo> {
        let mut all: Vec<&SliceInfo> = self.slices.values().flatten().collect();
        all.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        all.into_iter()
    }

    /// Endpoints of every service port that has at least one (built on demand: O(cluster)).
    pub fn endpoints_map(&self) -> EndpointsMap {
        let mut map = EndpointsMap::new();
        for key in self.service_names() {
            map.extend(self.service_endpoints(&key));
        }
        map
    }

    /// Endpoints of the ports of one service (ports without endpoints are absent), from all slices whose
    /// service label names it. A slice port matches a service port with the same name and protocol.
    /// Only an endpoint's first address is used. Endpoints are deduplicated by (ip, port), preferring a
    /// ready one, then a serving one, then the one from the slice whose name sorts first; sorted by
    /// (ip, port).
    pub fn service_endpoints(
        &self,
        key: &NamespacedName,
    ) -> BTreeMap<ServicePortName, Vec<Endpoint>> {
        let mut out = BTreeMap::new();
        let Some(slices) = self.slices.get::<dyn NameKey>(key) else {
            return out;
        };
        for sp in self.ports_of(key) {
            let best = merge_port_endpoints(slices, sp);
            if !best.is_empty() {
                out.insert(sp.name.clone(), best.into_values().collect());
            }
        }
        out
    }

    /// Puts a slice into its service's group (replacing one of the same name) and the owner index.
    fn insert_slice(&mut self, mut slice: SliceInfo) {
        let service_key = slice.shared_service_key();
        let group = self.slices.entry(service_key).or_default();
        // The group's key holds the service name: the slice and the owner index point at that copy.
        if let Some(first) = group.first() {
            slice.service = first.service.clone();
        }
        self.slice_owners
            .insert(slice.shared_key(), slice.service.clone());
        match find_slice(group, &slice.name) {
            Ok(at) => group[at] = slice,
            Err(at) => {
                // One more, not a doubling: most services have a single slice.
                group.reserve_exact(1);
                group.insert(at, slice);
            }
        }
    }

    /// Takes a slice out of its group and the owner index (the caller has touched its service).
    fn remove_slice(&mut self, namespace: &str, name: &str) -> Option<SliceInfo> {
        let service = self
            .slice_owners
            .remove::<dyn NameKey>(&(namespace, name))?;
        let group_key: &dyn NameKey = &(namespace, &*service);
        let group = self.slices.get_mut(group_key)?;
        let removed = find_slice(group, name).ok().map(|at| group.remove(at));
        if group.is_empty() {
            self.slices.remove(group_key);
        } else {
            group.shrink_to_fit();
        }
        removed
    }
    #[cfg(test)]
    /// True if something was mutated since the last `take_changes` (the result may still be empty if
    /// the mutations cancelled out).
    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// What changed since the previous call, comparing each touched service with its snapshot.
    pub fn take_changes(&mut self) -> Changes {
        self.compact_services();
        let pending = std::mem::take(&mut self.pending);
        let mut changes = Changes::default();
        let mut changed = Vec::new();
        let mut newly_active = Vec::new();
        for (key, before) in pending {
            if before == Snapshot::default() {
                // New since the last take (every service at a cold start): nothing to compare, no endpoint
                // to call stale, and no snapshot to build.
                if self.appeared(&key, &mut newly_active) {
                    changed.push(key);
                }
                continue;
            }
            let after = self.snapshot(&key);
            if before == after {
                continue;
            }
            self.deleted_udp_ips(&before, &after, &mut changes.deleted_udp_cluster_ips);
            stale_endpoints(&before, &after, &mut changes.stale_endpoints);
            newly_active_ports(&before, &after, &mut newly_active);
            changed.push(key);
        }
        // Built from the collected (already sorted) names in one go: a B-tree set grown by inserts in
        // order leaves its nodes about half empty, one built at once packs them.
        changes.changed_services = changed.into_iter().collect();
        changes.newly_active_services = newly_active.into_iter().collect();
        changes
    }

    /// For a service that had no ports before: whether it has any now (then it changed), and its ports
    /// with a serving endpoint (all newly active), found as [`Self::take_changes`] would find them.
    fn appeared(&self, key: &NamespacedName, newly_active: &mut Vec<ServicePortName>) -> bool {
        let slices = self.slices.get::<dyn NameKey>(key);
        let mut any = false;
        for sp in self.ports_of(key) {
            any = true;
            if slices.is_some_and(|slices| port_serves(slices, sp)) {
                newly_active.push(sp.name.clone());
            }
        }
        any
    }

    /// Cluster IPs of the UDP ports a service no longer has on that IP that no UDP port uses any more.
    fn deleted_udp_ips(&self, before: &Snapshot, after: &Snapshot, out: &mut BTreeSet<IpAddr>) {
        for old in before.ports.iter().filter(|p| p.protocol == Protocol::Udp) {
            let new = after.ports.iter().find(|p| p.name == old.name);
            for ip in &old.cluster_ips {
                let removed = new.is_none_or(|n| !n.cluster_ips.contains(ip));
                if removed && !self.udp_cluster_ip_refs.contains_key(ip) {
                    out.insert(*ip);
                }
            }
        }
    }

    /// Rebuilds the service map once it has grown to twice its smallest size since the last rebuild (so
    /// at least half of it was inserted since): a full load inserts ports in name order, and a B-tree grown
    /// that way leaves its nodes about half empty, where a map built at once packs them. Amortised O(1)
    /// per insertion; the rebuild needs one extra copy of the entries for its duration, before a sync.
    fn compact_services(&mut self) {
        self.services_low = self.services_low.min(self.services.len());
        if self.services.len() >= (2 * self.services_low).max(COMPACT_FLOOR) {
            self.services = std::mem::take(&mut self.services).into_iter().collect();
            self.services_low = self.services.len();
        }
    }

    fn ports_of<'a>(&'a self, key: &NamespacedName) -> impl Iterator<Item = &'a ServicePort> + 'a {
        let start = ServicePortName {
            service: key.clone(),
            port: "".into(),
            protocol: Protocol::Tcp,
        };
        let key = key.clone();
        self.services
            .range(start..)
            .take_while(move |(n, _)| n.service == key)
            .map(|(_, p)| p)
    }

    fn snapshot(&self, key: &NamespacedName) -> Snapshot {
        Snapshot {
            ports: self.ports_of(key).cloned().collect(),
            endpoints: self.service_endpoints(key),
        }
    }

    /// Remember the state of a service before its first mutation since the last `take_changes`.
    fn touch(&mut self, key: &NamespacedName) {
        if !self.pending.contains_key(key) {
            let snap = self.snapshot(key);
            self.pending.insert(key.clone(), snap);
        }
    }

    fn remove_ports(&mut self, key: &NamespacedName) {
        let names: Vec<ServicePortName> = self.ports_of(key).map(|p| p.name.clone()).collect();
        for name in names {
            if let Some(old) = self.services.remove(&name) {
                self.unref_udp(&old);
            }
        }
    }

    fn unref_udp(&mut self, port: &ServicePort) {
        if port.protocol != Protocol::Udp {
            return;
        }
        for ip in &port.cluster_ips {
            if let Some(n) = self.udp_cluster_ip_refs.get_mut(ip) {
                *n -= 1;
                if *n == 0 {
                    self.udp_cluster_ip_refs.remove(ip);
                }
            }
        }
    }
}

/// Below this many service ports a rebuild of the map saves too little to bother.
const COMPACT_FLOOR: usize = 1024;

/// Endpoints that were serving before and are gone or no longer serving after.
fn stale_endpoints(
    before: &Snapshot,
    after: &Snapshot,
    out: &mut Vec<(ServicePortName, Endpoint)>,
) {
    for (name, old_eps) in &before.endpoints {
        let new_eps = after.endpoints.get(name);
        for ep in old_eps.iter().filter(|e| e.serving) {
            let still_serving = new_eps
                .and_then(|n| n.iter().find(|e| e.ip == ep.ip && e.port == ep.port))
                .is_some_and(|e| e.serving);
            if !still_serving {
                out.push((name.clone(), ep.clone()));
            }
        }
    }
}

/// Ports with a serving endpoint after and none before, in name order.
fn newly_active_ports(before: &Snapshot, after: &Snapshot, out: &mut Vec<ServicePortName>) {
    let serving = |eps: &Vec<Endpoint>| eps.iter().any(|e| e.serving);
    for (name, new_eps) in &after.endpoints {
        if serving(new_eps) && !before.endpoints.get(name).is_some_and(serving) {
            out.push(name.clone());
        }
    }
}

/// Where a slice of that name is (Ok) or would go (Err) in a group sorted by name.
fn find_slice(group: &[SliceInfo], name: &str) -> Result<usize, usize> {
    group.binary_search_by(|s| (*s.name).cmp(name))
}

/// The slices that carry a service port, each with its port.
fn slices_of_port<'a>(
    slices: &'a [SliceInfo],
    sp: &'a ServicePort,
) -> impl Iterator<Item = (&'a SliceInfo, &'a SlicePort)> + 'a {
    slices.iter().filter_map(|slice| {
        let port = slice
            .ports
            .iter()
            .find(|p| p.name == sp.name.port && p.protocol == sp.protocol)?;
        Some((slice, port))
    })
}

/// Whether [`merge_port_endpoints`] gives the port a serving endpoint, mostly without building the merge.
/// A candidate both ready and serving wins its address, so it settles the question; if no candidate is
/// ready but not serving, every address's winner serves as soon as one of its candidates does. Only a
/// ready endpoint that is not serving (which the API does not produce) leaves it to the merge.
fn port_serves(slices: &[SliceInfo], sp: &ServicePort) -> bool {
    let (mut serving, mut ready_not_serving) = (false, false);
    for (slice, _) in slices_of_port(slices, sp) {
        for ep in &slice.endpoints {
            if ep.ready && ep.serving {
                return true;
            }
            serving |= ep.serving;
            ready_not_serving |= ep.ready;
        }
    }
    if !ready_not_serving {
        return serving;
    }
    merge_port_endpoints(slices, sp).values().any(|e| e.serving)
}

/// The endpoints of one service port from the slices of its service, deduplicated by (ip, port): a ready
/// one wins, then a serving one, then the first in slice name order.
fn merge_port_endpoints(
    slices: &[SliceInfo],
    sp: &ServicePort,
) -> BTreeMap<(IpAddr, u16), Endpoint> {
    let mut best: BTreeMap<(IpAddr, u16), Endpoint> = BTreeMap::new();
    for (slice, port) in slices_of_port(slices, sp) {
        for ep in &slice.endpoints {
            match best.entry((ep.address, port.port)) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(ep.to_endpoint(port.port));
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    if (ep.ready, ep.serving) > (o.get().ready, o.get().serving) {
                        o.insert(ep.to_endpoint(port.port));
                    }
                }
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc_port(
        ns: &str,
        svc: &str,
        port_name: &str,
        proto: Protocol,
        port: u16,
        ip: &str,
    ) -> ServicePort {
        ServicePort::cluster_ip(
            ServicePortName {
                service: NamespacedName::new(ns, svc),
                port: port_name.into(),
                protocol: proto,
            },
            vec![ip.parse().unwrap()],
            port,
        )
    }

    fn ep(ip: &str, ready: bool, serving: bool) -> SliceEndpoint {
        SliceEndpoint::new(ip.parse().unwrap(), ready, serving, !ready).on_node("node-1")
    }

    /// A slice of the "echo" service with the examples' two ports.
    fn echo_slice(name: &str, eps: Vec<SliceEndpoint>) -> SliceInfo {
        slice(name, "echo", ECHO_SLICE_PORTS, eps)
    }

    fn slice(
        name: &str,
        svc: &str,
        ports: &[(&str, u16, Protocol)],
        eps: Vec<SliceEndpoint>,
    ) -> SliceInfo {
        SliceInfo {
            namespace: "ns".into(),
            name: name.into(),
            service: svc.into(),
            address_type: IpFamily::V4,
            ports: ports
                .iter()
                .map(|(n, p, proto)| SlicePort {
                    name: (*n).into(),
                    port: *p,
                    protocol: *proto,
                })
                .collect(),
            endpoints: eps,
        }
    }

    fn key(name: &str) -> NamespacedName {
        NamespacedName::new("ns", name)
    }

    fn spn(svc: &str, port: &str, proto: Protocol) -> ServicePortName {
        ServicePortName {
            service: key(svc),
            port: port.into(),
            protocol: proto,
        }
    }

    fn echo_ports() -> Vec<ServicePort> {
        vec![
            svc_port("ns", "echo", "tcp", Protocol::Tcp, 80, "10.96.0.10"),
            svc_port("ns", "echo", "udp", Protocol::Udp, 53, "10.96.0.10"),
        ]
    }

    const ECHO_SLICE_PORTS: &[(&str, u16, Protocol)] =
        &[("tcp", 8080, Protocol::Tcp), ("udp", 5353, Protocol::Udp)];

    fn ips(eps: &[Endpoint]) -> Vec<String> {
        eps.iter().map(|e| format!("{}:{}", e.ip, e.port)).collect()
    }

    #[test]
    fn service_map_apply_and_delete() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        assert_eq!(st.service_map().len(), 2);
        st.apply_service(
            key("other"),
            vec![svc_port("ns", "other", "", Protocol::Tcp, 80, "10.96.0.11")],
        );
        assert_eq!(st.service_ports(&key("echo")).len(), 2);
        assert_eq!(st.service_ports(&key("other")).len(), 1);
        let ch = st.take_changes();
        assert_eq!(
            ch.changed_services,
            [key("echo"), key("other")].into_iter().collect()
        );
        st.delete_service(&key("echo"));
        assert_eq!(st.service_map().len(), 1);
        let ch = st.take_changes();
        assert_eq!(ch.changed_services, [key("echo")].into_iter().collect());
        // Deleting an unknown service changes nothing.
        st.delete_service(&key("nope"));
        assert!(st.take_changes().is_empty());
    }

    #[test]
    fn service_map_is_rebuilt_after_growth_and_stays_consistent() {
        let mut st = ClusterState::new();
        let name = |i: usize| format!("s{i:04}");
        let ip = |i: usize| format!("10.96.{}.{}", i / 256, i % 256);
        for i in 0..3 * COMPACT_FLOOR {
            let port = svc_port("ns", &name(i), "", Protocol::Udp, 53, &ip(i));
            st.apply_service(key(&name(i)), vec![port]);
        }
        let ch = st.take_changes();
        assert_eq!(ch.changed_services.len(), 3 * COMPACT_FLOOR);
        assert_eq!(st.services_low, 3 * COMPACT_FLOOR, "rebuilt");
        let names: Vec<String> = st
            .service_map()
            .keys()
            .map(|n| n.service.name.to_string())
            .collect();
        assert_eq!(names, (0..3 * COMPACT_FLOOR).map(name).collect::<Vec<_>>());
        // The rebuilt map keeps working: lookups, deletions, UDP references.
        st.delete_service(&key(&name(1)));
        st.apply_service(
            key("zz"),
            vec![svc_port("ns", "zz", "", Protocol::Tcp, 80, "10.97.0.1")],
        );
        assert!(st.service_ports(&key(&name(1))).is_empty());
        assert_eq!(st.service_ports(&key(&name(2))).len(), 1);
        let ch = st.take_changes();
        assert_eq!(
            ch.changed_services,
            [key(&name(1)), key("zz")].into_iter().collect()
        );
        assert_eq!(
            ch.deleted_udp_cluster_ips,
            [ip(1).parse().unwrap()].into_iter().collect()
        );
        assert_eq!(st.services_low, 3 * COMPACT_FLOOR, "no second rebuild");
    }

    #[test]
    fn port_resolution_by_name_and_protocol() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        // The slice lists the ports in another order, plus a port with a name no service port has and a
        // port with the right name but another protocol.
        st.apply_slice(slice(
            "echo-a",
            "echo",
            &[
                ("udp", 5353, Protocol::Udp),
                ("metrics", 9090, Protocol::Tcp),
                ("tcp", 9999, Protocol::Udp),
                ("tcp", 8080, Protocol::Tcp),
            ],
            vec![ep("10.244.1.2", true, true)],
        ));
        let map = st.endpoints_map();
        assert_eq!(
            ips(&map[&spn("echo", "tcp", Protocol::Tcp)]),
            ["10.244.1.2:8080"]
        );
        assert_eq!(
            ips(&map[&spn("echo", "udp", Protocol::Udp)]),
            ["10.244.1.2:5353"]
        );
        assert_eq!(map.len(), 2);
    }

    #[test]
    fn unnamed_port_matches_unnamed_slice_port() {
        let mut st = ClusterState::new();
        st.apply_service(
            key("web"),
            vec![svc_port("ns", "web", "", Protocol::Tcp, 80, "10.96.0.12")],
        );
        st.apply_slice(slice(
            "web-a",
            "web",
            &[("", 8080, Protocol::Tcp)],
            vec![ep("10.244.1.5", true, true)],
        ));
        let map = st.endpoints_map();
        assert_eq!(
            ips(&map[&spn("web", "", Protocol::Tcp)]),
            ["10.244.1.5:8080"]
        );
    }

    #[test]
    fn multi_slice_merge_sorted() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        st.apply_slice(echo_slice(
            "echo-b",
            vec![ep("10.244.3.2", true, true), ep("10.244.2.2", true, true)],
        ));
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        // A slice of another service does not leak in.
        st.apply_slice(slice(
            "other-a",
            "other",
            ECHO_SLICE_PORTS,
            vec![ep("10.244.9.9", true, true)],
        ));
        let map = st.endpoints_map();
        assert_eq!(
            ips(&map[&spn("echo", "tcp", Protocol::Tcp)]),
            ["10.244.1.2:8080", "10.244.2.2:8080", "10.244.3.2:8080"]
        );
        assert_eq!(
            map.len(),
            2,
            "no entry for the service without a Service object"
        );
        st.delete_slice("ns", "echo-b");
        let map = st.endpoints_map();
        assert_eq!(
            ips(&map[&spn("echo", "tcp", Protocol::Tcp)]),
            ["10.244.1.2:8080"]
        );
    }

    #[test]
    fn dedup_prefers_ready_then_serving() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", false, false)]));
        st.apply_slice(echo_slice("echo-b", vec![ep("10.244.1.2", false, true)]));
        let map = st.endpoints_map();
        let eps = &map[&spn("echo", "tcp", Protocol::Tcp)];
        assert_eq!(eps.len(), 1);
        assert!(eps[0].serving && !eps[0].ready);
        st.apply_slice(echo_slice("echo-c", vec![ep("10.244.1.2", true, true)]));
        let map = st.endpoints_map();
        let eps = &map[&spn("echo", "tcp", Protocol::Tcp)];
        assert_eq!(eps.len(), 1);
        assert!(eps[0].ready);
        // Same ip with a different port is a different endpoint.
        st.apply_slice(slice(
            "echo-d",
            "echo",
            &[("tcp", 8081, Protocol::Tcp)],
            vec![ep("10.244.1.2", true, true)],
        ));
        let map = st.endpoints_map();
        assert_eq!(
            ips(&map[&spn("echo", "tcp", Protocol::Tcp)]),
            ["10.244.1.2:8080", "10.244.1.2:8081"]
        );
    }

    #[test]
    fn all_families_kept() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        let mut s6 = echo_slice("echo-6", vec![ep("fd00::2", true, true)]);
        s6.address_type = IpFamily::V6;
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        st.apply_slice(s6);
        let map = st.endpoints_map();
        assert_eq!(
            ips(&map[&spn("echo", "tcp", Protocol::Tcp)]),
            ["10.244.1.2:8080", "fd00::2:8080"]
        );
    }

    #[test]
    fn endpoint_topology_reaches_the_model_endpoint() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        let mut e = ep("10.244.1.2", true, true);
        e.topology = Some(Arc::new(Topology {
            node_name: Some("node-1".into()),
            zone: Some("z1".into()),
            zone_hints: vec!["z1".into(), "z2".into()],
            node_hints: vec!["node-1".into()],
        }));
        let bare = SliceEndpoint::new("10.244.2.2".parse().unwrap(), false, true, true);
        st.apply_slice(slice("echo-a", "echo", ECHO_SLICE_PORTS, vec![e, bare]));
        let map = st.endpoints_map();
        let eps = &map[&spn("echo", "tcp", Protocol::Tcp)];
        assert_eq!(
            eps[0],
            Endpoint {
                ip: "10.244.1.2".parse().unwrap(),
                port: 8080,
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some("node-1".into()),
                zone: Some("z1".into()),
                zone_hints: vec!["z1".into(), "z2".into()],
                node_hints: vec!["node-1".into()],
            }
        );
        assert_eq!(
            eps[1],
            Endpoint {
                ip: "10.244.2.2".parse().unwrap(),
                port: 8080,
                ready: false,
                serving: true,
                terminating: true,
                node_name: None,
                zone: None,
                zone_hints: vec![],
                node_hints: vec![],
            }
        );
    }

    #[test]
    fn slices_share_repeated_values() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        // Two slices converted separately: equal values in separate allocations.
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        st.apply_slice(echo_slice("echo-b", vec![ep("10.244.2.2", true, true)]));
        let a = st.slice("ns", "echo-a").unwrap();
        let b = st.slice("ns", "echo-b").unwrap();
        assert!(Arc::ptr_eq(&a.namespace, &b.namespace));
        assert!(Arc::ptr_eq(&a.service, &b.service));
        assert!(Arc::ptr_eq(&a.ports[0].name, &b.ports[0].name));
        assert!(Arc::ptr_eq(
            a.endpoints[0].topology.as_ref().unwrap(),
            b.endpoints[0].topology.as_ref().unwrap()
        ));
        assert_eq!(a.endpoints[0].node_name(), Some("node-1"));
    }

    #[test]
    fn slice_lookup_and_order() {
        let mut st = ClusterState::new();
        for (name, svc) in [("b-1", "b"), ("a-2", "a"), ("a-1", "a"), ("c-1", "b")] {
            st.apply_slice(slice(
                name,
                svc,
                ECHO_SLICE_PORTS,
                vec![ep("10.244.1.2", true, true)],
            ));
        }
        let names: Vec<String> = st.slices().map(|s| s.key().to_string()).collect();
        assert_eq!(names, ["ns/a-1", "ns/a-2", "ns/b-1", "ns/c-1"]);
        assert_eq!(st.slice("ns", "c-1").unwrap().service_key(), key("b"));
        assert!(st.slice("ns", "d-1").is_none());
        assert!(st.slice("other", "a-1").is_none());
        // Moving a slice to another service and deleting slices keep the lookups consistent.
        st.apply_slice(slice(
            "c-1",
            "a",
            ECHO_SLICE_PORTS,
            vec![ep("10.244.1.2", true, true)],
        ));
        assert_eq!(st.slice("ns", "c-1").unwrap().service_key(), key("a"));
        st.delete_slice("ns", "b-1");
        st.delete_slice("ns", "b-1");
        let names: Vec<String> = st.slices().map(|s| s.key().to_string()).collect();
        assert_eq!(names, ["ns/a-1", "ns/a-2", "ns/c-1"]);
        assert!(
            !st.slices.contains_key::<dyn NameKey>(&("ns", "b")),
            "empty group removed"
        );
        assert_eq!(st.slice_owners.len(), 3);
    }

    #[test]
    fn a_new_service_is_newly_active_exactly_where_its_merged_endpoints_serve() {
        let flags = [(false, false), (false, true), (true, false), (true, true)];
        for (a, b) in flags
            .iter()
            .flat_map(|a| flags.iter().map(move |b| (*a, *b)))
        {
            for second_ip in ["10.244.1.2", "10.244.2.2"] {
                let mut st = ClusterState::new();
                // The same address in two slices competes in the merge; two addresses do not.
                st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", a.0, a.1)]));
                st.apply_slice(echo_slice("echo-b", vec![ep(second_ip, b.0, b.1)]));
                st.apply_service(key("echo"), echo_ports());
                let merged = st.service_endpoints(&key("echo"));
                let expected: BTreeSet<ServicePortName> = merged
                    .into_iter()
                    .filter(|(_, eps)| eps.iter().any(|e| e.serving))
                    .map(|(name, _)| name)
                    .collect();
                let ch = st.take_changes();
                assert_eq!(ch.changed_services, [key("echo")].into_iter().collect());
                assert_eq!(
                    ch.newly_active_services, expected,
                    "{a:?} {b:?} {second_ip}"
                );
                assert!(ch.stale_endpoints.is_empty());
            }
        }
        // Ready and not serving beats not ready and serving at the same address: not active.
        let mut st = ClusterState::new();
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, false)]));
        st.apply_slice(echo_slice("echo-b", vec![ep("10.244.1.2", false, true)]));
        st.apply_service(key("echo"), echo_ports());
        assert!(st.take_changes().newly_active_services.is_empty());
        // A service with no ports that comes and goes within one take is no change.
        st.apply_service(key("other"), Vec::new());
        assert!(st.take_changes().changed_services.is_empty());
    }

    #[test]
    fn newly_active_zero_to_n() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        let ch = st.take_changes();
        assert!(ch.newly_active_services.is_empty());
        // Not serving endpoints do not make a service active.
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", false, false)]));
        let ch = st.take_changes();
        assert_eq!(ch.changed_services, [key("echo")].into_iter().collect());
        assert!(ch.newly_active_services.is_empty());
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        let ch = st.take_changes();
        assert_eq!(
            ch.newly_active_services,
            [
                spn("echo", "tcp", Protocol::Tcp),
                spn("echo", "udp", Protocol::Udp)
            ]
            .into_iter()
            .collect()
        );
        // 1 → 2 is not newly active.
        st.apply_slice(echo_slice(
            "echo-a",
            vec![ep("10.244.1.2", true, true), ep("10.244.2.2", true, true)],
        ));
        let ch = st.take_changes();
        assert!(ch.newly_active_services.is_empty());
        assert!(ch.stale_endpoints.is_empty());
    }

    #[test]
    fn new_service_with_existing_slice_is_newly_active() {
        let mut st = ClusterState::new();
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        st.take_changes();
        st.apply_service(key("echo"), echo_ports());
        let ch = st.take_changes();
        assert_eq!(ch.newly_active_services.len(), 2);
    }

    #[test]
    fn stale_endpoints_detected() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        st.apply_slice(slice(
            "echo-a",
            "echo",
            ECHO_SLICE_PORTS,
            vec![
                ep("10.244.1.2", true, true),
                ep("10.244.2.2", true, true),
                ep("10.244.3.2", true, true),
                ep("10.244.4.2", false, false),
            ],
        ));
        st.take_changes();
        // .1 stays, .2 goes away, .3 is terminating but still serving, .4 was never serving and goes.
        st.apply_slice(echo_slice(
            "echo-a",
            vec![ep("10.244.1.2", true, true), ep("10.244.3.2", false, true)],
        ));
        let ch = st.take_changes();
        let stale: Vec<String> = ch
            .stale_endpoints
            .iter()
            .map(|(n, e)| format!("{}/{} {}:{}", n, n.protocol, e.ip, e.port))
            .collect();
        assert_eq!(
            stale,
            [
                "ns/echo:tcp/tcp 10.244.2.2:8080",
                "ns/echo:udp/udp 10.244.2.2:5353"
            ]
        );
        // Serving → not serving is stale too.
        st.apply_slice(echo_slice(
            "echo-a",
            vec![ep("10.244.1.2", true, true), ep("10.244.3.2", false, false)],
        ));
        let ch = st.take_changes();
        assert_eq!(ch.stale_endpoints.len(), 2);
        assert!(ch
            .stale_endpoints
            .iter()
            .all(|(_, e)| e.ip.to_string() == "10.244.3.2"));
        // An endpoint that moves from one slice to another is not stale.
        st.apply_slice(echo_slice("echo-b", vec![ep("10.244.1.2", true, true)]));
        st.delete_slice("ns", "echo-a");
        let ch = st.take_changes();
        assert!(ch.stale_endpoints.is_empty());
        // Deleting the service makes its serving endpoints stale.
        st.delete_service(&key("echo"));
        let ch = st.take_changes();
        assert_eq!(ch.stale_endpoints.len(), 2);
    }

    #[test]
    fn changes_that_cancel_out_are_not_reported() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        st.take_changes();
        st.delete_slice("ns", "echo-a");
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        assert!(st.has_pending());
        assert!(st.take_changes().is_empty());
        // Re-applying an identical slice does not even mark the service.
        st.apply_slice(echo_slice("echo-a", vec![ep("10.244.1.2", true, true)]));
        assert!(!st.has_pending());
    }

    #[test]
    fn deleted_udp_cluster_ips() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        st.apply_service(
            key("dns"),
            vec![svc_port(
                "ns",
                "dns",
                "dns",
                Protocol::Udp,
                53,
                "10.96.0.53",
            )],
        );
        st.take_changes();
        // Removing the UDP port of echo: its IP is stale for UDP.
        st.apply_service(
            key("echo"),
            vec![svc_port(
                "ns",
                "echo",
                "tcp",
                Protocol::Tcp,
                80,
                "10.96.0.10",
            )],
        );
        let ch = st.take_changes();
        assert_eq!(
            ch.deleted_udp_cluster_ips,
            ["10.96.0.10".parse().unwrap()].into_iter().collect()
        );
        // Removing a TCP port reports nothing.
        st.delete_service(&key("echo"));
        let ch = st.take_changes();
        assert!(ch.deleted_udp_cluster_ips.is_empty());
        assert_eq!(ch.changed_services.len(), 1);
        // Deleting the service reports its UDP IP.
        st.delete_service(&key("dns"));
        let ch = st.take_changes();
        assert_eq!(
            ch.deleted_udp_cluster_ips,
            ["10.96.0.53".parse().unwrap()].into_iter().collect()
        );
    }

    #[test]
    fn deleted_udp_ip_still_used_is_not_reported() {
        let mut st = ClusterState::new();
        st.apply_service(
            key("a"),
            vec![
                svc_port("ns", "a", "x", Protocol::Udp, 53, "10.96.0.10"),
                svc_port("ns", "a", "y", Protocol::Udp, 54, "10.96.0.10"),
            ],
        );
        st.take_changes();
        st.apply_service(
            key("a"),
            vec![svc_port("ns", "a", "y", Protocol::Udp, 54, "10.96.0.10")],
        );
        let ch = st.take_changes();
        assert!(
            ch.deleted_udp_cluster_ips.is_empty(),
            "port y still uses the IP"
        );
        // Another service taking over the IP in the same round.
        st.delete_service(&key("a"));
        st.apply_service(
            key("b"),
            vec![svc_port("ns", "b", "", Protocol::Udp, 53, "10.96.0.10")],
        );
        let ch = st.take_changes();
        assert!(ch.deleted_udp_cluster_ips.is_empty());
        // A port renamed: the old name's IP is still in use by the new name.
        st.apply_service(
            key("b"),
            vec![svc_port("ns", "b", "dns", Protocol::Udp, 53, "10.96.0.10")],
        );
        let ch = st.take_changes();
        assert!(ch.deleted_udp_cluster_ips.is_empty());
    }

    #[test]
    fn slice_changing_service_touches_both() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        st.apply_service(
            key("other"),
            vec![svc_port(
                "ns",
                "other",
                "tcp",
                Protocol::Tcp,
                80,
                "10.96.0.11",
            )],
        );
        st.apply_slice(echo_slice("s", vec![ep("10.244.1.2", true, true)]));
        st.take_changes();
        st.apply_slice(slice(
            "s",
            "other",
            ECHO_SLICE_PORTS,
            vec![ep("10.244.1.2", true, true)],
        ));
        let ch = st.take_changes();
        assert_eq!(
            ch.changed_services,
            [key("echo"), key("other")].into_iter().collect()
        );
        assert_eq!(ch.stale_endpoints.len(), 2);
        assert_eq!(
            ch.newly_active_services,
            [spn("other", "tcp", Protocol::Tcp)].into_iter().collect()
        );
        let map = st.endpoints_map();
        assert!(!map.contains_key(&spn("echo", "tcp", Protocol::Tcp)));
        assert_eq!(
            ips(&map[&spn("other", "tcp", Protocol::Tcp)]),
            ["10.244.1.2:8080"]
        );
    }

    #[test]
    fn empty_ports_removes_service() {
        let mut st = ClusterState::new();
        st.apply_service(key("echo"), echo_ports());
        st.take_changes();
        st.apply_service(key("echo"), vec![]);
        assert!(st.service_map().is_empty());
        let ch = st.take_changes();
        assert_eq!(ch.changed_services.len(), 1);
        assert_eq!(ch.deleted_udp_cluster_ips.len(), 1);
    }
}
