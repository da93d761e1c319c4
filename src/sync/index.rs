//! What is committed, per service port, so that a partial sync computes its transaction from the changed
//! services alone: O(changes), never O(cluster).
//!
//! Pieces that several services can need at once (a ClusterIP shared by two ports, an endpoint in two
//! services, an `lb*` chain) are reference-counted; the rest (dispatch and endpoint-slot elements, whose
//! keys name the service's own frontend) belong to one service and are added and removed with it.

use crate::model::{NamespacedName, ServicePortName};
use crate::nft::ir::{ChainState, Element, Family};
use crate::render::claims::{shared_set, Claims, Fingerprint, Fingerprinter};
use crate::render::Piece;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// The kernel-level effect of replacing some services' pieces.
#[derive(Debug, Default)]
pub struct Delta {
    /// Chains a service now needs that nobody needed.
    pub chains_added: Vec<(Family, Arc<ChainState>)>,
    /// Chains no service needs any more (deleted in a later transaction, see KERNEL-NOTES on EBUSY).
    pub chains_unused: Vec<(Family, String)>,
    /// Elements to delete, by family and set.
    pub elements_removed: BTreeMap<(Family, &'static str), Vec<Element>>,
    /// Elements to add, by family and set.
    pub elements_added: BTreeMap<(Family, &'static str), Vec<Element>>,
}

impl Delta {
    /// Nothing changes.
    pub fn is_empty(&self) -> bool {
        self.chains_added.is_empty()
            && self.chains_unused.is_empty()
            && self.elements_removed.is_empty()
            && self.elements_added.is_empty()
    }
}

#[derive(Debug, Default, Clone)]
/// What is committed, per service port, with reference counts of shared pieces (see the module).
pub struct Index {
    /// Keyed by the same `Arc` that the holders map points at: one copy of each name.
    pieces: BTreeMap<Arc<ServicePortName>, Vec<Piece>>,
    /// How many service ports want each element of a shared set (by fingerprint of family, set, element).
    shared_elements: HashMap<Fingerprint, u32>,
    /// Which service port holds each frontend of the per-service sets.
    claims: Claims,
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

    /// Every piece that is in the kernel: all of them but those whose frontend another port holds.
    pub fn committed_pieces(&self) -> impl Iterator<Item = &Piece> {
        self.pieces.iter().flat_map(move |(spn, list)| {
            list.iter().filter(move |p| match p {
                Piece::Element {
                    family,
                    set,
                    element,
                } if !shared_set(*set) => self.claims.holds(spn, *family, *set, element),
                _ => true,
            })
        })
    }

    /// Service ports of a service currently committed (a range of the name-ordered map: O(log n)).
    /// The committed pieces of one service port.
    pub fn pieces_of(&self, port: &ServicePortName) -> &[Piece] {
        self.pieces.get(port).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The ports of a service that are committed.
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

    /// How many service ports are committed.
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
                if shared_set(*set) {
                    let n = self
                        .shared_elements
                        .entry(self.fingerprints.of(&(family, set, element)))
                        .or_insert(0);
                    *n += 1;
                    if *n > 1 {
                        return;
                    }
                } else if let Err(other) = self.claims.acquire(holder, *family, *set, element) {
                    tracing::warn!(
                        service = %holder, holder = %other, set = set.name(),
                        "another service port already uses this address and port; ignored"
                    );
                    return;
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
                if !shared_set(*set) && !self.claims.release(holder, *family, *set, element) {
                    // Never ours (we lost the claim): nothing of ours is in the kernel.
                    return;
                }
                if shared_set(*set) {
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
