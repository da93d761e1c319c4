//! ServiceCIDRs (networking.k8s.io/v1): the union of every object's `spec.cidrs`, sent whole as one
//! [`Event::ServiceCidrs`] each time it changes. kube-proxy hands its proxier the complete list on every
//! change too; the list is short (a cluster has a handful of ranges), so there is nothing to gain from
//! per-object events.
//!
//! Unlike Services and EndpointSlices, ServiceCIDRs never hold back `Synced`: the resource is absent before
//! Kubernetes 1.33 (and may be forbidden by an older ClusterRole), and without it the proxy still works;
//! only the drop of unallocated service addresses waits for it.

use std::collections::{BTreeMap, BTreeSet};

use kube::runtime::watcher;

use super::events::{Converted, Model};
use crate::Event;
use nftkube_model::Cidr;

/// What was learnt of the ServiceCIDR objects, and the union last sent.
#[derive(Default)]
pub(super) struct ServiceCidrs {
    /// Each object's last good CIDRs, by name (ServiceCIDRs are cluster-scoped).
    objects: BTreeMap<String, Vec<Cidr>>,
    /// A list in progress: the objects it has listed so far (a relist replaces `objects` when complete).
    listing: Option<BTreeMap<String, Vec<Cidr>>>,
    /// The union last emitted.
    emitted: Vec<Cidr>,
    /// Malformed objects skipped so far.
    pub(super) skipped: u64,
}

impl ServiceCidrs {
    /// Takes one watcher event; the event to send when the union changed.
    pub(super) fn handle(&mut self, ev: watcher::Event<Converted>) -> Option<Event> {
        match ev {
            watcher::Event::Init => self.listing = Some(BTreeMap::new()),
            watcher::Event::InitApply(obj) => {
                let (name, cidrs) = self.read(obj)?;
                self.listing
                    .get_or_insert_with(BTreeMap::new)
                    .insert(name, cidrs);
                return None;
            }
            watcher::Event::InitDone => {
                // A list is applied whole: what it no longer has is gone.
                self.objects = self.listing.take().unwrap_or_default();
            }
            watcher::Event::Apply(obj) => {
                let (name, cidrs) = self.read(obj)?;
                self.objects.insert(name, cidrs);
            }
            watcher::Event::Delete(obj) => {
                let name = obj.key?.name.to_string();
                self.objects.remove(&name);
            }
        }
        self.changed()
    }

    /// An object's name and the CIDRs to keep for it: a malformed version is skipped (logged, naming the
    /// object), and its last good version, if any, stays.
    fn read(&mut self, obj: Converted) -> Option<(String, Vec<Cidr>)> {
        let Some(key) = obj.key else {
            self.skipped += 1;
            tracing::warn!("skipping a ServiceCIDR without metadata.name");
            return None;
        };
        let name = key.name.to_string();
        match obj.model {
            Ok(Some(Model::ServiceCidr(cidrs))) => Some((name, cidrs)),
            Ok(_) => None,
            Err(reason) => {
                self.skipped += 1;
                tracing::warn!(
                    "ServiceCIDR {name}: {reason}; skipped (its last good version, if any, stays in effect)"
                );
                let last = self.objects.get(&name).cloned()?;
                Some((name, last))
            }
        }
    }

    /// The union of every object's CIDRs, if it differs from what was last sent.
    fn changed(&mut self) -> Option<Event> {
        let union: BTreeSet<Cidr> = self.objects.values().flatten().copied().collect();
        let union: Vec<Cidr> = union.into_iter().collect();
        if union == self.emitted {
            return None;
        }
        tracing::info!(cidrs = ?union, "ServiceCIDRs changed");
        self.emitted = union.clone();
        Some(Event::ServiceCidrs(union))
    }
}
