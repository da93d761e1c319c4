//! What one read of the manifests gives: the objects by key (kind, namespace, name), where each came from,
//! the errors, and the failures that protect earlier versions from deletion. Every part of the source
//! speaks it: decoding fills it, the parallel read merges it, reconciling compares it with what was emitted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use super::SourceError;
use crate::Event;
use nftkube_model::{NamespacedName, ServicePort, SharedValues, SliceInfo};

/// Services sort before EndpointSlices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum ObjectKind {
    Service,
    Slice,
}

/// An object's identity, ordered by kind, namespace, name. The strings are shared: a namespace by every
/// object of a read, a slice's name with the slice itself (and so with the store that keeps it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct ObjectKey {
    pub(super) kind: ObjectKind,
    pub(super) namespace: Arc<str>,
    pub(super) name: Arc<str>,
}

impl ObjectKey {
    /// The same shared strings: the model's copy of the name is this one.
    pub(super) fn namespaced_name(&self) -> NamespacedName {
        NamespacedName::new(self.namespace.clone(), self.name.clone())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Object {
    Service(Vec<ServicePort>),
    Slice(SliceInfo),
}

/// Where an object was loaded from. The path is shared by every object of its file (one allocation per
/// file, not per object: at 50k services that is ~10 MB); a thin pointer, as every emitted object keeps one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Origin {
    pub(super) path: Arc<PathBuf>,
    pub(super) document: usize,
    /// The item of a `List` document (named in errors as `items[i]`).
    pub(super) item: Option<usize>,
}

/// The result of reading every file once.
#[derive(Default)]
pub(super) struct Snapshot {
    pub(super) objects: BTreeMap<ObjectKey, (Object, Origin)>,
    pub(super) errors: Vec<SourceError>,
    /// Objects whose document failed: keep their last good version.
    pub(super) keep: BTreeSet<ObjectKey>,
    /// Services whose document failed (also in `keep`), and whether it lists `loadBalancerSourceRanges`.
    pub(super) failed_services: BTreeMap<ObjectKey, bool>,
    /// EndpointSlices whose document failed: withdrawn rather than kept.
    pub(super) withdrawn: BTreeSet<ObjectKey>,
    /// Files with a failure we cannot attribute to an object: keep everything they produced.
    pub(super) tainted: BTreeSet<PathBuf>,
    /// The path itself could not be read: keep everything.
    pub(super) unreadable: bool,
    /// Namespaces, port names and endpoint topologies of this read, one copy each. Per read, not kept:
    /// the store keeps its own, and two long-lived sets would keep each other's unused values alive.
    pub(super) shared: SharedValues,
}

pub(super) fn applied(key: ObjectKey, object: Object) -> Event {
    match (key, object) {
        (key, Object::Service(ports)) => {
            debug_assert_eq!(key.kind, ObjectKind::Service);
            Event::ServiceApplied {
                key: key.namespaced_name(),
                ports,
            }
        }
        (_, Object::Slice(s)) => Event::SliceApplied(s),
    }
}

pub(super) fn report(snap: &mut Snapshot, err: SourceError) {
    tracing::warn!("{err}");
    snap.errors.push(err);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read is walked, and its events emitted, in key order: Services before EndpointSlices, each by
    /// namespace, then name.
    #[test]
    fn keys_order_services_before_slices_then_by_namespace_and_name() {
        let key = |kind, namespace: &str, name: &str| ObjectKey {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        };
        let mut keys = [
            key(ObjectKind::Slice, "a", "a"),
            key(ObjectKind::Service, "b", "a"),
            key(ObjectKind::Service, "a", "b"),
        ];
        keys.sort();
        let order: Vec<_> = keys
            .iter()
            .map(|k| (k.kind, &*k.namespace, &*k.name))
            .collect();
        assert_eq!(
            order,
            [
                (ObjectKind::Service, "a", "b"),
                (ObjectKind::Service, "b", "a"),
                (ObjectKind::Slice, "a", "a")
            ]
        );
    }
}
