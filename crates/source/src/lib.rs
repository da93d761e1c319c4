//! Sources of cluster state: they turn kube objects (from files or from the API) into model events.
//! The only layer that sees kube types; everything below gets [`Event`]s.
#![forbid(unsafe_code)]

pub mod backoff;
pub mod convert;
mod fail_closed;
mod in_order;
pub mod kube;
pub mod manifests;
mod validate;
pub mod watch;

pub use convert::{ConvertError, ServiceConversion, SliceConversion};
pub use kube::{KubeOptions, KubeSource};
pub use manifests::{ManifestSource, SourceError};
pub use watch::ManifestWatcher;

use nftkube_model::{Cidr, ClusterState, NamespacedName, ServicePort, SliceInfo};
use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;
use std::sync::{Arc, LazyLock};
use std::time::SystemTime;

/// A 64-bit digest of what a source emitted for an object, compared with the next version's to drop
/// events that change nothing. foldhash's quality variant, seeded once per process. The std hasher's
/// SipHash, used before, took a tenth of the API watcher's thread in a cold list of 50k services (perf).
pub(crate) fn fingerprint<T: Hash + ?Sized>(value: &T) -> u64 {
    static SEED: LazyLock<foldhash::quality::RandomState> = LazyLock::new(Default::default);
    SEED.hash_one(value)
}

/// A change to the cluster state, as every source reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A Service was added or changed. A service the proxy does not handle (headless, ExternalName)
    /// comes with no ports, so a service that turns headless is removed from the model.
    ServiceApplied {
        /// The Service.
        key: NamespacedName,
        /// Its ports.
        ports: Vec<ServicePort>,
    },
    /// A Service was deleted.
    ServiceDeleted(NamespacedName),
    /// An EndpointSlice was added or changed.
    SliceApplied(SliceInfo),
    /// An EndpointSlice was deleted.
    SliceDeleted {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
    /// The source has delivered a complete snapshot (after the initial list).
    Synced,
    /// An EndpointSlice of `service` changed, and its `endpoints.kubernetes.io/last-change-trigger-time`
    /// annotation says when the change behind it happened: the start of kube-proxy's network programming
    /// latency. Sent just before the `SliceApplied` it belongs to; changes nothing in the store.
    EndpointsChangeTriggered {
        /// The Service.
        service: NamespacedName,
        /// When the change was triggered (the slice's last-change-trigger-time).
        at: SystemTime,
    },
    /// This node's object changed (API source only); changes nothing in the store.
    NodeApplied(NodeInfo),
    /// This node's object was deleted (API source only).
    NodeDeleted,
    /// The ServiceCIDR objects changed (API source only): every CIDR their `spec.cidrs` list now, sorted,
    /// without duplicates (empty: none, or every object gone). Changes nothing in the store.
    ServiceCidrs(Vec<Cidr>),
}

/// What the agent keeps of its own Node object: no kube types, only what it uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct NodeInfo {
    /// The node's name.
    pub name: String,
    /// `topology.kubernetes.io/zone`, for topology-aware routing.
    pub zone: Option<String>,
    /// InternalIP addresses, then ExternalIP ones, each in status order (kube-proxy's order: the first of a
    /// family is the node's primary IP).
    pub addresses: Vec<IpAddr>,
    /// `spec.podCIDRs` (or `spec.podCIDR`): the local pod ranges for `detectLocalMode: NodeCIDR`.
    pub pod_cidrs: Vec<Cidr>,
    /// The node is going away (a deletion timestamp, or the cluster autoscaler's
    /// `ToBeDeletedByClusterAutoscaler` taint): `/healthz` then answers 503, as kube-proxy's does, so load
    /// balancers drain it first.
    pub deleting: bool,
}

/// Called by a source's thread after it has queued events: wakes the consumer.
pub type Notify = Arc<dyn Fn() + Send + Sync>;

/// Joins a source's thread if it ends within `limit` (a read or a connect in progress finishes first), and
/// leaves it to end on its own otherwise.
pub(crate) fn join_within(thread: std::thread::JoinHandle<()>, limit: std::time::Duration) {
    let deadline = std::time::Instant::now() + limit;
    while !thread.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    if thread.is_finished() {
        let _ = thread.join();
    }
}

/// A source thread's end of the channel to its consumer: each batch is queued, then announced.
pub(crate) struct Outbox {
    tx: std::sync::mpsc::Sender<Vec<Event>>,
    notify: Notify,
}

impl Outbox {
    pub(crate) fn channel(notify: Notify) -> (Outbox, std::sync::mpsc::Receiver<Vec<Event>>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (Outbox { tx, notify }, rx)
    }

    /// Queues a batch (an empty one is not sent) and wakes the consumer; an error when it is gone.
    pub(crate) fn send(
        &self,
        batch: Vec<Event>,
    ) -> Result<(), std::sync::mpsc::SendError<Vec<Event>>> {
        if batch.is_empty() {
            return Ok(());
        }
        self.tx.send(batch)?;
        (self.notify)();
        Ok(())
    }
}

/// Where the proxy loop gets cluster state from. Both read on threads of their own and ring the loop's
/// doorbell (a [`Notify`]) when events are waiting.
#[derive(Debug)]
pub enum ProxySource {
    /// Manifest files.
    Manifests(ManifestWatcher),
    /// The Kubernetes API.
    Kube(KubeSource),
}

impl ProxySource {
    /// Events since the previous call (the first events are a complete snapshot). Never blocks. A complete
    /// snapshot ends with [`Event::Synced`]. Both sources send their first snapshot as it is read (the
    /// files a unit at a time, the API a page at a time), so the consumer must not act on it before
    /// `Synced`; later changes come whole (a relist, a re-read of the files), never half of one.
    pub fn poll(&mut self) -> Vec<Event> {
        match self {
            ProxySource::Manifests(m) => m.poll(),
            ProxySource::Kube(k) => k.poll(),
        }
    }
}

/// Every batch queued in `rx`, in order, as one: a single batch as it is, several copied once into a
/// vector of their total length (a vector grown batch by batch reallocates at each doubling, and a first
/// list queues thousands of events of about a hundred bytes each).
pub(crate) fn drain_batches(rx: &std::sync::mpsc::Receiver<Vec<Event>>) -> Vec<Event> {
    let mut batches: Vec<Vec<Event>> = rx.try_iter().collect();
    if batches.len() <= 1 {
        return batches.pop().unwrap_or_default();
    }
    let mut out = Vec::with_capacity(batches.iter().map(Vec::len).sum());
    for batch in batches {
        out.extend(batch);
    }
    out
}

/// Applies one event to the store (`Synced` changes nothing).
pub fn apply_event(state: &mut ClusterState, ev: Event) {
    match ev {
        Event::ServiceApplied { key, ports } => state.apply_service(key, ports),
        Event::ServiceDeleted(key) => state.delete_service(&key),
        Event::SliceApplied(slice) => state.apply_slice(slice),
        Event::SliceDeleted { namespace, name } => state.delete_slice(&namespace, &name),
        Event::Synced
        | Event::EndpointsChangeTriggered { .. }
        | Event::NodeApplied(_)
        | Event::NodeDeleted
        | Event::ServiceCidrs(_) => {}
    }
}
