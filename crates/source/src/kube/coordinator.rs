//! The coordinator: a pure state machine from watcher events (objects already converted) to the model
//! events to send, with no I/O, so that the guarantees of the module documentation are unit-tested without
//! HTTP. Per kind it remembers a fingerprint of what was emitted, holds a relist back until it completes,
//! and closes what a failure must not leave open.

use std::collections::BTreeMap;
use std::time::SystemTime;

use kube::runtime::watcher;

use super::events::{Converted, Model};
use super::service_cidrs::ServiceCidrs;
use crate::fail_closed::ExposedServices;
use crate::{fingerprint, Event};
use nftkube_model::{
    FastMap, FastSet, Interner, NameKey, NamespacedName, SharedName, SharedValues,
};

/// Which watcher an item came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A Service.
    Service,
    /// An EndpointSlice.
    EndpointSlice,
    /// This node's Node.
    Node,
    /// A ServiceCIDR.
    ServiceCidr,
}

impl Kind {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// A relist in progress: which objects it has listed, and those that differ from what was emitted.
#[derive(Default)]
struct Relist {
    seen: FastSet<SharedName>,
    changed: BTreeMap<NamespacedName, (u64, Model, Option<SystemTime>)>,
    /// One copy of each namespace, port name and endpoint topology among the slices held in `changed`
    /// until the list completes: a million endpoints held back would keep a topology per endpoint
    /// (111 MB, measured when the first list was held back too) where the store keeps one per node.
    shared: SharedValues,
}

/// Per-kind memory: a fingerprint of what was emitted for each object.
struct Tracker {
    kind: Kind,
    /// Keyed by shared strings: a namespace is one copy for all its objects, a slice's name is the
    /// slice's own copy (which the store keeps).
    emitted: FastMap<SharedName, u64>,
    namespaces: Interner<str>,
    relist: Option<Relist>,
    /// The first list completed.
    listed: bool,
    /// The emitted Services that outside traffic reaches, to close them if an update cannot be read.
    exposed: ExposedServices,
}

impl Tracker {
    fn new(kind: Kind) -> Self {
        Tracker {
            kind,
            emitted: FastMap::default(),
            namespaces: Interner::default(),
            relist: None,
            listed: false,
            exposed: ExposedServices::default(),
        }
    }

    fn emitted_print(&self, key: &NamespacedName) -> Option<u64> {
        self.emitted.get::<dyn NameKey>(key).copied()
    }

    /// `key` with a shared namespace and, for a slice, the slice's own name.
    fn shared_key(&mut self, key: &NamespacedName, model: Option<&Model>) -> SharedName {
        let name = match model {
            Some(Model::Slice(s)) if s.name == key.name => s.name.clone(),
            _ => key.name.clone(),
        };
        SharedName {
            namespace: self.namespaces.string(&key.namespace),
            name,
        }
    }

    /// Records what is emitted for `key` now. The old entry goes first: a map keeps an existing key on
    /// insert, and the new key shares its strings with the version the store gets now.
    fn remember(&mut self, key: &NamespacedName, model: &Model, print: u64) {
        self.emitted.remove::<dyn NameKey>(key);
        let shared = self.shared_key(key, Some(model));
        self.emitted.insert(shared, print);
        if let Model::Service(ports) = model {
            self.exposed.emitted(key, ports);
        }
    }

    /// Forgets `key`; whether it had been emitted.
    fn forget(&mut self, key: &NamespacedName) -> bool {
        self.exposed.deleted(key);
        self.emitted.remove::<dyn NameKey>(key).is_some()
    }

    /// What to do with an object of this kind that did not convert: Err keeps its last good version (and
    /// is logged by the caller); Ok is what to use instead (see [`crate::fail_closed`]).
    fn on_failure(
        &self,
        key: &NamespacedName,
        reason: String,
        restricts_sources: bool,
    ) -> Result<Option<Model>, String> {
        match self.kind {
            Kind::EndpointSlice => {
                tracing::warn!(
                    "EndpointSlice {}: {reason}; its endpoints (if any were in effect) are withdrawn until a usable version comes",
                    display_key(key)
                );
                Ok(None)
            }
            Kind::Service => match self.exposed.closed_on_failure(key, restricts_sources) {
                Some(ports) => {
                    tracing::warn!(
                        "Service {}: {reason}; it or its version in effect has loadBalancerSourceRanges, so \
                         its external and LoadBalancer IPs are closed until a usable version comes",
                        display_key(key)
                    );
                    Ok(Some(Model::Service(ports)))
                }
                None => Err(reason),
            },
            Kind::Node | Kind::ServiceCidr => Err(reason),
        }
    }
}

/// Turns watcher events into model events; see the module documentation for what it guarantees.
pub struct Coordinator {
    services: Tracker,
    slices: Tracker,
    node: Tracker,
    /// ServiceCIDRs: merged into one list, and no part of `Synced` (see `super::service_cidrs`).
    cidrs: ServiceCidrs,
    synced: bool,
    /// Trigger times from before this instant are not ours to measure (kube-proxy's rule).
    started: SystemTime,
    /// Malformed objects skipped so far (for tests and metrics).
    pub(crate) skipped: u64,
}

impl Default for Coordinator {
    fn default() -> Self {
        Self::new(SystemTime::now())
    }
}

impl Coordinator {
    /// A coordinator for a source started at `started`.
    pub fn new(started: SystemTime) -> Self {
        Coordinator {
            services: Tracker::new(Kind::Service),
            slices: Tracker::new(Kind::EndpointSlice),
            node: Tracker::new(Kind::Node),
            cidrs: ServiceCidrs::default(),
            synced: false,
            started,
            skipped: 0,
        }
    }

    #[cfg(test)]
    /// Whether `Synced` was sent.
    pub(crate) fn synced(&self) -> bool {
        self.synced
    }

    #[cfg(test)]
    /// Malformed objects skipped so far, ServiceCIDRs included.
    pub(crate) fn skipped(&self) -> u64 {
        self.skipped + self.cidrs.skipped
    }

    /// Handles one watcher event of `kind` (objects already converted). Returns the events to send, as
    /// one batch.
    pub(crate) fn handle(&mut self, kind: Kind, ev: watcher::Event<Converted>) -> Vec<Event> {
        let started = self.started;
        let skipped = &mut self.skipped;
        let tracker = match kind {
            Kind::Service => &mut self.services,
            Kind::EndpointSlice => &mut self.slices,
            Kind::Node => &mut self.node,
            Kind::ServiceCidr => return self.cidrs.handle(ev).into_iter().collect(),
        };
        let mut out = Vec::new();
        match ev {
            watcher::Event::Init => {
                // A new list starts (the first one, or a relist after 410 Gone or a failed list):
                // whatever an earlier unfinished one collected is dropped.
                tracker.relist = Some(Relist::default());
            }
            watcher::Event::InitApply(obj) => {
                let Some(key) = obj.key.clone() else {
                    *skipped += 1;
                    tracing::warn!(
                        kind = kind.as_str(),
                        "skipping an object without metadata.name"
                    );
                    return out;
                };
                // A kind's first list goes out as it arrives; later ones are held back (module docs).
                let first_list = !tracker.listed;
                let emitted = tracker.emitted_print(&key);
                let seen = tracker.shared_key(&key, None);
                let model = obj.model.or_else(|reason| {
                    *skipped += 1;
                    tracker.on_failure(&key, reason, obj.restricts_sources)
                });
                let relist = tracker.relist.get_or_insert_with(Relist::default);
                match model {
                    Ok(Some(model)) if first_list => {
                        relist.seen.insert(seen);
                        let print = fingerprint(&model);
                        if emitted != Some(print) {
                            tracker.remember(&key, &model, print);
                            emit_applied(&mut out, &key, model, obj.trigger, started);
                        }
                    }
                    Ok(Some(mut model)) => {
                        if let Model::Slice(slice) = &mut model {
                            slice.share_values(&mut relist.shared);
                        }
                        let print = fingerprint(&model);
                        relist.seen.insert(seen);
                        if emitted != Some(print) {
                            relist.changed.insert(key, (print, model, obj.trigger));
                        } else {
                            relist.changed.remove(&key);
                        }
                    }
                    // Ignored by the proxy: absent for us, so not "seen" (deleted if it was emitted).
                    Ok(None) => {
                        relist.seen.remove(&seen);
                        relist.changed.remove(&key);
                    }
                    Err(reason) => {
                        warn_malformed(kind, &key, &reason);
                        // Keep the last good version: seen, unchanged.
                        relist.seen.insert(seen);
                        relist.changed.remove(&key);
                    }
                }
            }
            watcher::Event::InitDone => {
                let relist = tracker.relist.take().unwrap_or_default();
                let mut deleted: Vec<NamespacedName> = tracker
                    .emitted
                    .keys()
                    .filter(|k| !relist.seen.contains(*k))
                    .map(SharedName::to_namespaced_name)
                    .collect();
                deleted.sort();
                for (key, (print, model, trigger)) in relist.changed {
                    tracker.remember(&key, &model, print);
                    emit_applied(&mut out, &key, model, trigger, started);
                }
                for key in deleted {
                    tracker.forget(&key);
                    out.push(deleted_event(tracker.kind, key));
                }
                if !tracker.listed {
                    tracker.listed = true;
                    tracing::info!(
                        kind = kind.as_str(),
                        objects = tracker.emitted.len(),
                        "initial list complete"
                    );
                } else {
                    tracing::info!(kind = kind.as_str(), changes = out.len(), "relist complete");
                }
            }
            watcher::Event::Apply(obj) => {
                let Some(key) = obj.key.clone() else {
                    *skipped += 1;
                    tracing::warn!(
                        kind = kind.as_str(),
                        "skipping an object without metadata.name"
                    );
                    return out;
                };
                let model = obj.model.or_else(|reason| {
                    *skipped += 1;
                    tracker.on_failure(&key, reason, obj.restricts_sources)
                });
                match model {
                    Ok(Some(model)) => {
                        let print = fingerprint(&model);
                        if tracker.emitted_print(&key) != Some(print) {
                            tracker.remember(&key, &model, print);
                            emit_applied(&mut out, &key, model, obj.trigger, started);
                        }
                    }
                    Ok(None) => {
                        if tracker.forget(&key) {
                            out.push(deleted_event(kind, key));
                        }
                    }
                    Err(reason) => warn_malformed(kind, &key, &reason),
                }
            }
            watcher::Event::Delete(obj) => {
                if let Some(key) = obj.key {
                    if tracker.forget(&key) {
                        out.push(deleted_event(kind, key));
                    }
                }
            }
        }
        if !self.synced && self.services.listed && self.slices.listed {
            self.synced = true;
            out.push(Event::Synced);
        }
        out
    }
}

fn warn_malformed(kind: Kind, key: &NamespacedName, reason: &str) {
    tracing::warn!(
        "{} {}: {reason}; skipped (its last good version, if any, stays in effect)",
        kind.as_str(),
        display_key(key)
    );
}

fn display_key(key: &NamespacedName) -> String {
    if key.namespace.is_empty() {
        key.name.to_string()
    } else {
        key.to_string()
    }
}

fn emit_applied(
    out: &mut Vec<Event>,
    key: &NamespacedName,
    model: Model,
    trigger: Option<SystemTime>,
    started: SystemTime,
) {
    match model {
        Model::Service(ports) => out.push(Event::ServiceApplied {
            key: key.clone(),
            ports,
        }),
        Model::Slice(slice) => {
            if let Some(at) = trigger.filter(|t| *t > started) {
                out.push(Event::EndpointsChangeTriggered {
                    service: slice.service_key(),
                    at,
                });
            }
            out.push(Event::SliceApplied(slice));
        }
        Model::Node(node) => out.push(Event::NodeApplied(node)),
        // Merged into one list by `super::service_cidrs`, never sent per object.
        Model::ServiceCidr(_) => {}
    }
}

fn deleted_event(kind: Kind, key: NamespacedName) -> Event {
    match kind {
        Kind::Service => Event::ServiceDeleted(key),
        Kind::EndpointSlice => Event::SliceDeleted {
            namespace: key.namespace.to_string(),
            name: key.name.to_string(),
        },
        Kind::Node => Event::NodeDeleted,
        Kind::ServiceCidr => {
            unreachable!("ServiceCIDRs are merged by service_cidrs, never tracked per object")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply_event;
    use crate::kube::events::{map_event, parse_rfc3339, TRIGGER_TIME_ANNOTATION};
    use k8s_openapi::api::core::v1::{Node, Service};
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use nftkube_model::{ClusterState, Protocol};
    use std::sync::Arc;
    use std::time::Duration;
    use watcher::Event as W;

    fn svc(name: &str, ip: &str) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]},
        }))
        .unwrap()
    }

    fn slice(name: &str, service: &str, ips: &[&str], trigger: Option<&str>) -> EndpointSlice {
        let mut annotations = serde_json::Map::new();
        if let Some(t) = trigger {
            annotations.insert(TRIGGER_TIME_ANNOTATION.into(), t.into());
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns",
                         "labels": {"kubernetes.io/service-name": service},
                         "annotations": annotations},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": ips.iter().map(|ip| serde_json::json!({"addresses": [ip]})).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    fn s(ev: W<Service>) -> W<Converted> {
        map_event(ev, Converted::service)
    }
    fn e(ev: W<EndpointSlice>) -> W<Converted> {
        map_event(ev, Converted::slice)
    }

    fn names(events: &[Event]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                Event::ServiceApplied { key, ports } => format!("svc+ {key} {}", ports.len()),
                Event::ServiceDeleted(k) => format!("svc- {k}"),
                Event::SliceApplied(s) => format!("slice+ {} {}", s.key(), s.endpoints.len()),
                Event::SliceDeleted { namespace, name } => format!("slice- {namespace}/{name}"),
                Event::Synced => "synced".into(),
                Event::EndpointsChangeTriggered { service, .. } => format!("trigger {service}"),
                Event::NodeApplied(n) => format!("node+ {}", n.name),
                Event::NodeDeleted => "node-".into(),
                Event::ServiceCidrs(c) => {
                    let c: Vec<String> = c.iter().map(ToString::to_string).collect();
                    format!("cidrs {}", c.join(","))
                }
            })
            .collect()
    }

    /// A ServiceCIDR object with these `spec.cidrs` (raw text).
    fn cidr_object(name: &str, cidrs: &[&str]) -> W<Converted> {
        let object: k8s_openapi::api::networking::v1::ServiceCIDR =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name},
                "spec": {"cidrs": cidrs},
            }))
            .unwrap();
        W::Apply(Converted::service_cidr(&object))
    }

    /// The same object as a list item.
    fn listed(object: W<Converted>) -> W<Converted> {
        match object {
            W::Apply(o) => W::InitApply(o),
            _ => unreachable!(),
        }
    }

    fn cidrs(c: &mut Coordinator, ev: W<Converted>) -> Vec<String> {
        names(&c.handle(Kind::ServiceCidr, ev))
    }

    #[test]
    fn service_cidrs_go_out_as_one_complete_list_when_it_changes() {
        let mut c = synced_coordinator();
        // The first list goes out when complete: the union of every object, sorted, without duplicates.
        assert!(cidrs(&mut c, W::Init).is_empty());
        let kubernetes = cidr_object("kubernetes", &["10.96.0.0/16", "fd00:10:96::/112"]);
        assert!(cidrs(&mut c, listed(kubernetes)).is_empty());
        let extra = cidr_object("extra", &["10.97.0.0/24", "10.96.0.0/16"]);
        assert!(cidrs(&mut c, listed(extra)).is_empty());
        assert_eq!(
            cidrs(&mut c, W::InitDone),
            ["cidrs 10.96.0.0/16,10.97.0.0/24,fd00:10:96::/112"]
        );
        // An update that changes the union; one that does not (a status change, a CIDR another object
        // also has) sends nothing.
        assert_eq!(
            cidrs(&mut c, cidr_object("extra", &["10.98.0.0/24"])),
            ["cidrs 10.96.0.0/16,10.98.0.0/24,fd00:10:96::/112"]
        );
        assert!(cidrs(&mut c, cidr_object("extra", &["10.98.0.0/24"])).is_empty());
        assert!(cidrs(&mut c, cidr_object("again", &["10.96.0.0/16"])).is_empty());
        // A CIDR two objects list stays while one of them has it.
        let deleted = |name: &str| match cidr_object(name, &[]) {
            W::Apply(o) => W::Delete(o),
            _ => unreachable!(),
        };
        assert_eq!(
            cidrs(&mut c, deleted("kubernetes")),
            ["cidrs 10.96.0.0/16,10.98.0.0/24"]
        );
        assert_eq!(cidrs(&mut c, deleted("again")), ["cidrs 10.98.0.0/24"]);
        assert_eq!(cidrs(&mut c, deleted("extra")), ["cidrs "]);
        // A relist is applied whole: what it no longer lists is gone, and nothing goes out before it ends.
        c.handle(Kind::ServiceCidr, cidr_object("a", &["10.1.0.0/16"]));
        c.handle(Kind::ServiceCidr, cidr_object("b", &["10.2.0.0/16"]));
        assert!(cidrs(&mut c, W::Init).is_empty());
        assert!(cidrs(&mut c, listed(cidr_object("b", &["10.2.0.0/16"]))).is_empty());
        assert_eq!(cidrs(&mut c, W::InitDone), ["cidrs 10.2.0.0/16"]);
        assert_eq!(c.skipped(), 0);
    }

    #[test]
    fn a_malformed_service_cidr_is_skipped_and_its_last_good_version_stays() {
        let mut c = synced_coordinator();
        assert_eq!(
            cidrs(&mut c, cidr_object("a", &["10.96.0.0/16"])),
            ["cidrs 10.96.0.0/16"]
        );
        assert!(cidrs(&mut c, cidr_object("a", &["10.96.0.0/99"])).is_empty());
        assert_eq!(c.skipped(), 1);
        // Through a relist too; a malformed object never seen before adds nothing.
        c.handle(Kind::ServiceCidr, W::Init);
        c.handle(Kind::ServiceCidr, listed(cidr_object("a", &["nope"])));
        c.handle(
            Kind::ServiceCidr,
            listed(cidr_object("b", &["10.1.0.0/40"])),
        );
        assert!(cidrs(&mut c, W::InitDone).is_empty());
        assert_eq!(c.skipped(), 3);
        // Fixed: applied.
        assert_eq!(
            cidrs(&mut c, cidr_object("a", &["10.100.0.0/16"])),
            ["cidrs 10.100.0.0/16"]
        );
    }

    /// ServiceCIDRs are no part of `Synced`: a cluster where their watcher never lists (the resource is
    /// absent, or forbidden) syncs on Services and EndpointSlices alone, and CIDRs listed later still go out.
    #[test]
    fn service_cidrs_never_hold_back_synced() {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        c.handle(Kind::ServiceCidr, W::Init);
        for k in [Kind::Service, Kind::EndpointSlice] {
            c.handle(k, s(W::Init));
        }
        assert!(names(&c.handle(Kind::Service, s(W::InitDone))).is_empty());
        assert_eq!(
            names(&c.handle(Kind::EndpointSlice, e(W::InitDone))),
            ["synced"]
        );
        assert!(c.synced());
        assert_eq!(
            cidrs(&mut c, cidr_object("kubernetes", &["10.96.0.0/12"])),
            ["cidrs 10.96.0.0/12"]
        );
    }

    #[test]
    fn emitted_keys_share_strings_with_what_was_emitted() {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        let slice_name = |out: &[Event]| match out.last() {
            Some(Event::SliceApplied(s)) => s.name.clone(),
            other => panic!("{other:?}"),
        };
        let key = |c: &Coordinator, name: &str| {
            let (k, _) = c
                .slices
                .emitted
                .get_key_value::<dyn NameKey>(&("ns", name))
                .unwrap();
            k.clone()
        };
        // From a list and from a watch event: the key is the emitted slice's name.
        c.handle(Kind::EndpointSlice, e(W::Init));
        let listed = slice_name(&c.handle(
            Kind::EndpointSlice,
            e(W::InitApply(slice("a-1", "a", &["10.244.1.2"], None))),
        ));
        c.handle(Kind::EndpointSlice, e(W::InitDone));
        assert!(Arc::ptr_eq(&key(&c, "a-1").name, &listed));
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::Apply(slice("a-1", "a", &["10.244.1.3"], None))),
        );
        let changed = slice_name(&out);
        assert!(Arc::ptr_eq(&key(&c, "a-1").name, &changed), "key replaced");
        c.handle(
            Kind::EndpointSlice,
            e(W::Apply(slice("b-1", "b", &["10.244.1.4"], None))),
        );
        assert!(Arc::ptr_eq(
            &key(&c, "a-1").namespace,
            &key(&c, "b-1").namespace
        ));
        // Deleting forgets the key.
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::Delete(slice("a-1", "a", &[], None))),
        );
        assert_eq!(names(&out), ["slice- ns/a-1"]);
        assert_eq!(c.slices.emitted.len(), 1);
    }

    /// The slices a relist holds back until it completes share one copy of each topology (a million endpoints
    /// on a thousand nodes: a thousand copies, not a million).
    #[test]
    fn a_lists_slices_share_topologies_while_held_back() {
        let on_node = |name: &str, ip: &str| -> EndpointSlice {
            let mut s = slice(name, name, &[ip], None);
            s.endpoints[0].node_name = Some("node-7".into());
            s
        };
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        // A relist (the first list is not held back).
        c.handle(Kind::EndpointSlice, e(W::Init));
        c.handle(Kind::EndpointSlice, e(W::InitDone));
        c.handle(Kind::EndpointSlice, e(W::Init));
        for (name, ip) in [("a-1", "10.244.1.2"), ("b-1", "10.244.1.3")] {
            c.handle(Kind::EndpointSlice, e(W::InitApply(on_node(name, ip))));
        }
        let held: Vec<_> = c.slices.relist.as_ref().unwrap().changed.values().collect();
        let topology = |i: usize| match &held[i].1 {
            Model::Slice(s) => s.endpoints[0].topology.clone().expect("a topology"),
            _ => panic!("not a slice"),
        };
        assert_eq!(topology(0).node_name.as_deref(), Some("node-7"));
        assert!(Arc::ptr_eq(&topology(0), &topology(1)));
    }

    #[test]
    fn synced_only_after_both_lists() {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        assert!(c.handle(Kind::Service, s(W::Init)).is_empty());
        // A first list's objects go out as they arrive; Synced waits for both lists.
        let out = c.handle(Kind::Service, s(W::InitApply(svc("a", "10.96.0.1"))));
        assert_eq!(names(&out), ["svc+ ns/a 1"]);
        assert!(c.handle(Kind::Service, s(W::InitDone)).is_empty());
        assert!(!c.synced());
        // The node's list does not gate the sync.
        c.handle(Kind::Node, map_event(W::<Node>::Init, Converted::node));
        assert!(
            !names(&c.handle(Kind::Node, map_event(W::<Node>::InitDone, Converted::node)))
                .contains(&"synced".to_string())
        );
        c.handle(Kind::EndpointSlice, e(W::Init));
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::InitApply(slice("a-1", "a", &["10.244.1.2"], None))),
        );
        assert_eq!(names(&out), ["slice+ ns/a-1 1"]);
        let out = c.handle(Kind::EndpointSlice, e(W::InitDone));
        assert_eq!(names(&out), ["synced"]);
        assert!(c.synced());
        // Synced is sent once.
        c.handle(Kind::Service, s(W::Init));
        c.handle(Kind::Service, s(W::InitApply(svc("a", "10.96.0.1"))));
        assert!(c.handle(Kind::Service, s(W::InitDone)).is_empty());
    }

    /// A first list streams; one interrupted and started again ends with the deletion of what the earlier
    /// attempt emitted and the new one does not have, and nothing it emitted twice.
    #[test]
    fn a_first_list_goes_out_as_it_arrives_and_a_restarted_one_deletes_what_it_lost() {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        c.handle(Kind::Service, s(W::Init));
        let mut out = c.handle(Kind::Service, s(W::InitApply(svc("a", "10.96.0.1"))));
        out.extend(c.handle(Kind::Service, s(W::InitApply(svc("b", "10.96.0.2")))));
        assert_eq!(names(&out), ["svc+ ns/a 1", "svc+ ns/b 1"]);
        // The list fails and starts again: a unchanged, b gone, c new, d malformed (skipped).
        assert!(c.handle(Kind::Service, s(W::Init)).is_empty());
        assert!(c
            .handle(Kind::Service, s(W::InitApply(svc("a", "10.96.0.1"))))
            .is_empty());
        let out = c.handle(Kind::Service, s(W::InitApply(svc("c", "10.96.0.3"))));
        assert_eq!(names(&out), ["svc+ ns/c 1"]);
        let mut bad = svc("d", "10.96.0.4");
        bad.spec.as_mut().unwrap().cluster_ip = Some("not an address".into());
        assert!(c.handle(Kind::Service, s(W::InitApply(bad))).is_empty());
        assert_eq!(c.skipped, 1);
        let out = c.handle(Kind::Service, s(W::InitDone));
        assert_eq!(names(&out), ["svc- ns/b"]);
        // Later relists are held back again.
        c.handle(Kind::Service, s(W::Init));
        assert!(c
            .handle(Kind::Service, s(W::InitApply(svc("e", "10.96.0.5"))))
            .is_empty());
        let out = c.handle(Kind::Service, s(W::InitDone));
        assert_eq!(names(&out), ["svc+ ns/e 1", "svc- ns/a", "svc- ns/c"]);
    }

    #[test]
    fn relist_emits_only_the_difference_in_one_batch() {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        c.handle(Kind::EndpointSlice, e(W::Init));
        c.handle(Kind::EndpointSlice, e(W::InitDone));
        c.handle(Kind::Service, s(W::Init));
        let mut out = Vec::new();
        for (n, ip) in [("a", "10.96.0.1"), ("b", "10.96.0.2"), ("c", "10.96.0.3")] {
            out.extend(c.handle(Kind::Service, s(W::InitApply(svc(n, ip)))));
        }
        out.extend(c.handle(Kind::Service, s(W::InitDone)));
        assert_eq!(out.len(), 4, "{:?}", names(&out));
        let mut state = ClusterState::new();
        for ev in out {
            apply_event(&mut state, ev);
        }
        // A relist (after 410 Gone): a unchanged, b changed, c gone, d new. Nothing comes out until the
        // list is complete, then exactly the difference.
        assert!(c.handle(Kind::Service, s(W::Init)).is_empty());
        for (n, ip) in [("a", "10.96.0.1"), ("b", "10.96.0.22"), ("d", "10.96.0.4")] {
            assert!(c
                .handle(Kind::Service, s(W::InitApply(svc(n, ip))))
                .is_empty());
        }
        let out = c.handle(Kind::Service, s(W::InitDone));
        assert_eq!(names(&out), ["svc+ ns/b 1", "svc+ ns/d 1", "svc- ns/c"]);
        for ev in out {
            apply_event(&mut state, ev);
        }
        let ips: Vec<String> = state
            .service_map()
            .values()
            .map(|p| format!("{} {}", p.name.service, p.cluster_ips[0]))
            .collect();
        assert_eq!(ips, ["ns/a 10.96.0.1", "ns/b 10.96.0.22", "ns/d 10.96.0.4"]);
        // An interrupted relist (a new Init before InitDone) drops what it had collected.
        c.handle(Kind::Service, s(W::Init));
        c.handle(Kind::Service, s(W::InitApply(svc("e", "10.96.0.5"))));
        c.handle(Kind::Service, s(W::Init));
        for (n, ip) in [("a", "10.96.0.1"), ("b", "10.96.0.22"), ("d", "10.96.0.4")] {
            c.handle(Kind::Service, s(W::InitApply(svc(n, ip))));
        }
        assert!(c.handle(Kind::Service, s(W::InitDone)).is_empty());
    }

    #[test]
    fn watch_events_apply_only_real_changes() {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        for k in [Kind::Service, Kind::EndpointSlice] {
            c.handle(k, s(W::Init));
            c.handle(k, s(W::InitDone));
        }
        assert_eq!(
            names(&c.handle(Kind::Service, s(W::Apply(svc("a", "10.96.0.1"))))),
            ["svc+ ns/a 1"]
        );
        // The same content again (a resourceVersion bump, a status change we do not use): nothing.
        assert!(c
            .handle(Kind::Service, s(W::Apply(svc("a", "10.96.0.1"))))
            .is_empty());
        assert_eq!(
            names(&c.handle(Kind::Service, s(W::Delete(svc("a", "10.96.0.1"))))),
            ["svc- ns/a"]
        );
        // Deleting what was never emitted: nothing.
        assert!(c
            .handle(Kind::Service, s(W::Delete(svc("zz", "10.96.0.9"))))
            .is_empty());
        // A service that turns headless is removed; headless from the start is never emitted.
        c.handle(Kind::Service, s(W::Apply(svc("h", "10.96.0.7"))));
        assert_eq!(
            names(&c.handle(Kind::Service, s(W::Apply(svc("h", "None"))))),
            ["svc- ns/h"]
        );
        assert!(c
            .handle(Kind::Service, s(W::Apply(svc("h2", "None"))))
            .is_empty());
    }

    #[test]
    fn malformed_objects_are_skipped_and_the_last_good_version_stays() {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        for k in [Kind::Service, Kind::EndpointSlice] {
            c.handle(k, s(W::Init));
            c.handle(k, s(W::InitDone));
        }
        c.handle(Kind::Service, s(W::Apply(svc("a", "10.96.0.1"))));
        assert!(c
            .handle(Kind::Service, s(W::Apply(svc("a", "10.96.0.300"))))
            .is_empty());
        assert_eq!(c.skipped, 1);
        // A relist that still has the broken version keeps the good one (no deletion).
        c.handle(Kind::Service, s(W::Init));
        c.handle(Kind::Service, s(W::InitApply(svc("a", "10.96.0.300"))));
        c.handle(Kind::Service, s(W::InitApply(svc("bad", "nope"))));
        assert!(c.handle(Kind::Service, s(W::InitDone)).is_empty());
        assert_eq!(c.skipped, 3);
        // A slice without the service-name label is skipped too.
        let mut sl = slice("x-1", "x", &["10.244.1.2"], None);
        sl.metadata.labels = None;
        assert!(c.handle(Kind::EndpointSlice, e(W::Apply(sl))).is_empty());
        assert_eq!(c.skipped, 4);
        // Fixed: applied.
        assert_eq!(
            names(&c.handle(Kind::Service, s(W::Apply(svc("a", "10.96.0.2"))))),
            ["svc+ ns/a 1"]
        );
    }

    /// A LoadBalancer Service "ns/lb" at 192.0.2.10 with these source ranges (raw text).
    fn lb(ranges: &[&str]) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "lb", "namespace": "ns"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                     "loadBalancerSourceRanges": ranges,
                     "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}},
        }))
        .unwrap()
    }

    /// The one ServiceApplied of `events`: its LoadBalancer IPs and source ranges, as text.
    fn lb_frontends(events: &[Event]) -> (Vec<String>, Vec<String>) {
        let [Event::ServiceApplied { ports, .. }] = events else {
            panic!("want one ServiceApplied, got {:?}", names(events))
        };
        let text = |v: &[std::net::IpAddr]| v.iter().map(ToString::to_string).collect();
        let ranges = ports[0].load_balancer_source_ranges.iter();
        (
            text(&ports[0].load_balancer_ips),
            ranges.map(ToString::to_string).collect(),
        )
    }

    fn synced_coordinator() -> Coordinator {
        let mut c = Coordinator::new(SystemTime::UNIX_EPOCH);
        for k in [Kind::Service, Kind::EndpointSlice] {
            c.handle(k, s(W::Init));
            c.handle(k, s(W::InitDone));
        }
        c
    }

    #[test]
    fn a_leading_zero_source_range_restricts_as_the_api_server_reads_it() {
        let mut c = synced_coordinator();
        let out = c.handle(Kind::Service, s(W::Apply(lb(&[]))));
        assert_eq!(lb_frontends(&out), (vec!["192.0.2.10".into()], vec![]));
        // The owner restricts the open LB with text the API server accepts: it takes effect.
        let out = c.handle(Kind::Service, s(W::Apply(lb(&["010.20.0.0/16"]))));
        assert_eq!(
            lb_frontends(&out),
            (vec!["192.0.2.10".into()], vec!["10.20.0.0/16".into()])
        );
        assert_eq!(c.skipped, 0);
    }

    #[test]
    fn a_restricting_update_that_cannot_be_read_closes_the_load_balancer() {
        let mut c = synced_coordinator();
        c.handle(Kind::Service, s(W::Apply(lb(&[]))));
        // The update restricts sources but cannot be read: the older, open version must not stay.
        let out = c.handle(Kind::Service, s(W::Apply(lb(&["10.20.0.0/99"]))));
        assert_eq!(lb_frontends(&out), (vec![], vec![]));
        assert_eq!(c.skipped, 1);
        // Still broken: still closed, nothing new.
        assert!(c
            .handle(Kind::Service, s(W::Apply(lb(&["10.20.0.0/98"]))))
            .is_empty());
        // A usable version opens it as asked.
        let out = c.handle(Kind::Service, s(W::Apply(lb(&["10.20.0.0/16"]))));
        assert_eq!(
            lb_frontends(&out),
            (vec!["192.0.2.10".into()], vec!["10.20.0.0/16".into()])
        );
        // A restricted LB whose next update breaks elsewhere (no ranges any more) closes too: the update
        // may lift the restriction, but it cannot widen anything while it cannot be read.
        let mut broken = lb(&[]);
        broken.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.300".into());
        let out = c.handle(Kind::Service, s(W::Apply(broken)));
        assert_eq!(lb_frontends(&out).0, Vec::<String>::new());
        // An unrestricted, unrelated failure keeps the last good version, as before.
        let out = c.handle(Kind::Service, s(W::Apply(lb(&[]))));
        assert_eq!(lb_frontends(&out).0, ["192.0.2.10"]);
        let mut broken = lb(&[]);
        broken.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.300".into());
        assert!(c.handle(Kind::Service, s(W::Apply(broken))).is_empty());
    }

    #[test]
    fn a_relist_with_an_unreadable_restricting_update_closes_the_load_balancer() {
        let mut c = synced_coordinator();
        c.handle(Kind::Service, s(W::Apply(lb(&[]))));
        c.handle(Kind::Service, s(W::Init));
        assert!(c
            .handle(Kind::Service, s(W::InitApply(lb(&["bogus"]))))
            .is_empty());
        let out = c.handle(Kind::Service, s(W::InitDone));
        assert_eq!(lb_frontends(&out), (vec![], vec![]));
    }

    #[test]
    fn a_slice_that_cannot_be_read_withdraws_its_endpoints() {
        let mut c = synced_coordinator();
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::Apply(slice("x-1", "x", &["10.244.1.2"], None))),
        );
        assert_eq!(names(&out), ["slice+ ns/x-1 1"]);
        // The pod is gone and its IP reused; the update cannot be read: the old endpoint must go.
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::Apply(slice("x-1", "x", &["10.244.1.2.7"], None))),
        );
        assert_eq!(names(&out), ["slice- ns/x-1"]);
        assert_eq!(c.skipped, 1);
        // A mapped address is read as the API server reads it: that IPv4 endpoint.
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::Apply(slice("x-1", "x", &["::ffff:10.244.1.3"], None))),
        );
        let [Event::SliceApplied(info)] = &out[..] else {
            panic!("{:?}", names(&out))
        };
        assert_eq!(info.endpoints[0].address.to_string(), "10.244.1.3");
        // The same through a relist.
        c.handle(Kind::EndpointSlice, e(W::Init));
        c.handle(
            Kind::EndpointSlice,
            e(W::InitApply(slice("x-1", "x", &["nope"], None))),
        );
        let out = c.handle(Kind::EndpointSlice, e(W::InitDone));
        assert_eq!(names(&out), ["slice- ns/x-1"]);
    }

    #[test]
    fn slices_merge_per_service_and_carry_trigger_times() {
        let started = parse_rfc3339("2024-05-01T10:00:00Z").unwrap();
        let mut c = Coordinator::new(started);
        c.handle(Kind::Service, s(W::Init));
        c.handle(Kind::Service, s(W::InitApply(svc("web", "10.96.0.1"))));
        c.handle(Kind::Service, s(W::InitDone));
        c.handle(Kind::EndpointSlice, e(W::Init));
        // A trigger time from before the start is not measured.
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::InitApply(slice(
                "web-1",
                "web",
                &["10.244.1.2"],
                Some("2024-05-01T09:59:00Z"),
            ))),
        );
        assert_eq!(names(&out), ["slice+ ns/web-1 1"]);
        let out = c.handle(Kind::EndpointSlice, e(W::InitDone));
        assert_eq!(names(&out), ["synced"]);
        let out = c.handle(
            Kind::EndpointSlice,
            e(W::Apply(slice(
                "web-2",
                "web",
                &["10.244.2.2", "10.244.3.2"],
                Some("2024-05-01T10:00:01.5Z"),
            ))),
        );
        assert_eq!(names(&out), ["trigger ns/web", "slice+ ns/web-2 2"]);
        let Event::EndpointsChangeTriggered { at, .. } = &out[0] else {
            unreachable!()
        };
        assert_eq!(
            at.duration_since(started).unwrap(),
            Duration::from_millis(1500)
        );
        let mut state = ClusterState::new();
        let mut c2 = Coordinator::new(started);
        for k in [Kind::Service, Kind::EndpointSlice] {
            c2.handle(k, s(W::Init));
            c2.handle(k, s(W::InitDone));
        }
        for ev in c2
            .handle(Kind::Service, s(W::Apply(svc("web", "10.96.0.1"))))
            .into_iter()
            .chain(c2.handle(
                Kind::EndpointSlice,
                e(W::Apply(slice("web-1", "web", &["10.244.1.2"], None))),
            ))
            .chain(c2.handle(
                Kind::EndpointSlice,
                e(W::Apply(slice("web-2", "web", &["10.244.2.2"], None))),
            ))
        {
            apply_event(&mut state, ev);
        }
        let eps = state.endpoints_map();
        let (name, list) = eps.iter().next().unwrap();
        assert_eq!(name.protocol, Protocol::Tcp);
        assert_eq!(list.len(), 2, "both slices of the service are merged");
    }
}
