//! Sources of cluster state: they turn kube objects (from files, later from the API) into model events.
//! The only layer that sees kube types; everything below gets [`Event`]s.

pub mod convert;
pub mod manifests;

pub use convert::{ConvertError, ServiceConversion, SliceConversion};
pub use manifests::{ManifestSource, SourceError};

use crate::model::{ClusterState, NamespacedName, ServicePort, SliceInfo};

/// A change to the cluster state, as every source reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A Service was added or changed. A service the proxy does not handle (headless, ExternalName)
    /// comes with no ports, so a service that turns headless is removed from the model.
    ServiceApplied {
        key: NamespacedName,
        ports: Vec<ServicePort>,
    },
    ServiceDeleted(NamespacedName),
    SliceApplied(SliceInfo),
    SliceDeleted {
        namespace: String,
        name: String,
    },
    /// The source has delivered a complete snapshot (after the initial list).
    Synced,
}

/// Applies one event to the store (`Synced` changes nothing).
pub fn apply_event(state: &mut ClusterState, ev: Event) {
    match ev {
        Event::ServiceApplied { key, ports } => state.apply_service(key, ports),
        Event::ServiceDeleted(key) => state.delete_service(&key),
        Event::SliceApplied(slice) => state.apply_slice(slice),
        Event::SliceDeleted { namespace, name } => state.delete_slice(&namespace, &name),
        Event::Synced => {}
    }
}
