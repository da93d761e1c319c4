//! What is committed, per service port, so that a partial sync computes its transaction from the changed
//! services alone: O(changes), never O(cluster).
//!
//! Pieces that several services can need at once (a ClusterIP shared by two ports, an endpoint in two
//! services, an `lb-<n>` chain) are reference-counted; the rest (dispatch and endpoint-slot elements, whose
//! keys name the service's own frontend) belong to one service and are added and removed with it.

use crate::model::{NamespacedName, ServicePortName};
use crate::nft::ir::{ChainState, Element, Family};
use crate::render::names::{PieceSet, SET_CLUSTER_IPS, SET_HAIRPIN};
use crate::render::Piece;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::Arc;

/// Whether elements of this set may be wanted by more than one service port.
fn shared_set(set: &PieceSet) -> bool {
    [SET_CLUSTER_IPS, SET_HAIRPIN].contains(&set.name())
}

/// The kernel-level effect of replacing some services' pieces.
#[derive(Debug, Default)]
pub struct Delta {
    pub chains_added: Vec<(Family, Arc<ChainState>)>,
    /// Chains no service needs any more (deleted in a later transaction, see KERNEL-NOTES on EBUSY).
    pub chains_unused: Vec<(Family, String)>,
    pub elements_removed: BTreeMap<(Family, &'static str), Vec<Element>>,
    pub elements_added: BTreeMap<(Family, &'static str), Vec<Element>>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.chains_added.is_empty()
            && self.chains_unused.is_empty()
            && self.elements_removed.is_empty()
            && self.elements_added.is_empty()
    }
}

/// A 128-bit fingerprint of an element's identity (family, set, key or whole element), standing in for the
/// element itself in the index's maps. At 50k services the maps hold ~300k keys; storing the bytes cost ~80
/// MB, fingerprints ~20 MB. Two different elements share a fingerprint with probability ~n²/2¹²⁹ (≈1e-28 at
/// 300k), and the hash keys are random per process, so nobody can craft a collision.
/// Two u64 rather than a u128: a u128 is 16-byte aligned, which pads every map entry to 32 bytes.
type Fingerprint = [u64; 2];

/// Two independently keyed SipHashes make one 128-bit fingerprint.
#[derive(Debug, Default, Clone)]
struct Fingerprinter {
    high: RandomState,
    low: RandomState,
}

impl Fingerprinter {
    fn of(&self, value: &impl Hash) -> Fingerprint {
        [self.high.hash_one(value), self.low.hash_one(value)]
    }
}

#[derive(Debug, Default, Clone)]
pub struct Index {
    /// Keyed by the same `Arc` that the holders map points at: one copy of each name.
    pieces: BTreeMap<Arc<ServicePortName>, Vec<Piece>>,
    /// How many service ports want each element of a shared set (by fingerprint of family, set, element).
    shared_elements: HashMap<Fingerprint, u32>,
    /// Which service port holds each key of the per-service sets (by fingerprint of family, set, key). Two
    /// ports claiming one frontend (two Services given the same ClusterIP and port) must not make the kernel
    /// refuse the batch (EEXIST): the first keeps it, the other is logged and waits (a full sync, or its next
    /// change, re-renders it).
    holders: HashMap<Fingerprint, Arc<ServicePortName>>,
    chains: HashMap<(Family, String), u32>,
    fingerprints: Fingerprinter,
}

impl Index {
    /// The index of a complete state.
    pub fn build(pieces: BTreeMap<ServicePortName, Vec<Piece>>) -> Index {
        let mut index = Index::default();
        for (spn, list) in pieces {
            let holder = Arc::new(spn);
            for p in &list {
                index.acquire(&holder, p, None);
            }
            index.pieces.insert(holder, list);
        }
        index
    }

    /// Every piece of every service port.
    pub fn pieces(&self) -> impl Iterator<Item = &Piece> {
        self.pieces.values().flatten()
    }

    /// Service ports of a service currently committed (a range of the name-ordered map: O(log n)).
    pub fn ports_of(&self, service: &NamespacedName) -> Vec<ServicePortName> {
        let first = ServicePortName {
            service: service.clone(),
            port: "".into(),
            protocol: crate::model::Protocol::Tcp,
        };
        self.pieces
            .range::<ServicePortName, _>(&first..)
            .take_while(|(spn, _)| &spn.service == service)
            .map(|(spn, _)| ServicePortName::clone(spn))
            .collect()
    }

    pub fn service_ports(&self) -> usize {
        self.pieces.len()
    }

    /// Whether a chain is needed by some service.
    pub fn chain_in_use(&self, family: Family, name: &str) -> bool {
        self.chains.contains_key(&(family, name.to_owned()))
    }

    /// Replaces the pieces of the given service ports (empty: the port is gone) and returns what changes in
    /// the kernel. Applying it is the caller's business; on failure the caller discards this index.
    pub fn replace(&mut self, updates: Vec<(ServicePortName, Vec<Piece>)>) -> Delta {
        let mut delta = Delta::default();
        for (spn, new) in updates {
            let (holder, old) = match self.pieces.remove_entry(&spn) {
                Some(entry) => entry,
                None => (Arc::new(spn), Vec::new()),
            };
            let old_set: HashSet<&Piece> = old.iter().collect();
            let new_set: HashSet<&Piece> = new.iter().collect();
            for p in old.iter().filter(|p| !new_set.contains(p)) {
                self.release(&holder, p, &mut delta);
            }
            for p in new.iter().filter(|p| !old_set.contains(p)) {
                self.acquire(&holder, p, Some(&mut delta));
            }
            if !new.is_empty() {
                self.pieces.insert(holder, new);
            }
        }
        // A chain released and needed again within this delta stays as it is in the kernel. This relies on a
        // chain's content being a function of its name while the index lives: `lb-*` names encode everything
        // that shapes them (the config only changes with a full sync, which rebuilds the index), and
        // firewall chains carry a hash of their rules in their name.
        let unused: BTreeSet<(Family, String)> = delta.chains_unused.iter().cloned().collect();
        let added: BTreeSet<(Family, String)> = delta
            .chains_added
            .iter()
            .map(|(f, c)| (*f, c.chain.name.clone()))
            .collect();
        delta.chains_unused.retain(|c| !added.contains(c));
        delta
            .chains_added
            .retain(|(f, c)| !unused.contains(&(*f, c.chain.name.clone())));
        delta
    }

    /// Counts `p` as needed by `holder`; records in `delta` what that adds to the kernel (None: building an
    /// index of what is already there, where recording would copy every element for nothing).
    fn acquire(&mut self, holder: &Arc<ServicePortName>, p: &Piece, delta: Option<&mut Delta>) {
        match p {
            Piece::Element {
                family,
                set,
                element,
            } => {
                if shared_set(set) {
                    let n = self
                        .shared_elements
                        .entry(self.fingerprints.of(&(family, set, element)))
                        .or_insert(0);
                    *n += 1;
                    if *n > 1 {
                        return;
                    }
                } else {
                    let key = self.fingerprints.of(&(family, set, &element.key));
                    match self.holders.get(&key) {
                        Some(other) if **other != **holder => {
                            tracing::warn!(
                                service = %holder, holder = %other, set = set.name(),
                                "another service port already uses this address and port; ignored"
                            );
                            return;
                        }
                        _ => {
                            self.holders.insert(key, holder.clone());
                        }
                    }
                }
                if let Some(delta) = delta {
                    delta
                        .elements_added
                        .entry((*family, set.name()))
                        .or_default()
                        .push(element.clone());
                }
            }
            Piece::Chain { family, chain } => {
                let n = self
                    .chains
                    .entry((*family, chain.chain.name.clone()))
                    .or_insert(0);
                *n += 1;
                if let (1, Some(delta)) = (*n, delta) {
                    delta.chains_added.push((*family, chain.clone()));
                }
            }
        }
    }

    fn release(&mut self, holder: &Arc<ServicePortName>, p: &Piece, delta: &mut Delta) {
        match p {
            Piece::Element {
                family,
                set,
                element,
            } => {
                if !shared_set(set) {
                    let key = self.fingerprints.of(&(family, set, &element.key));
                    match self.holders.get(&key) {
                        Some(h) if **h == **holder => {
                            self.holders.remove(&key);
                        }
                        // Never ours (we lost the claim): nothing of ours is in the kernel.
                        _ => return,
                    }
                }
                if shared_set(set) {
                    let key = self.fingerprints.of(&(family, set, element));
                    match self.shared_elements.get_mut(&key) {
                        Some(n) if *n > 1 => {
                            *n -= 1;
                            return;
                        }
                        _ => {
                            self.shared_elements.remove(&key);
                        }
                    }
                }
                delta
                    .elements_removed
                    .entry((*family, set.name()))
                    .or_default()
                    .push(element.clone());
            }
            Piece::Chain { family, chain } => {
                let key = (*family, chain.chain.name.clone());
                match self.chains.get_mut(&key) {
                    Some(n) if *n > 1 => *n -= 1,
                    _ => {
                        self.chains.remove(&key);
                        delta.chains_unused.push(key);
                    }
                }
            }
        }
    }
}
