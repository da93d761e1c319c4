//! What is committed, per service port, so that a partial sync computes its transaction from the changed
//! services alone: O(changes), never O(cluster).
//!
//! Pieces that several services can need at once (a ClusterIP shared by two ports, an endpoint in two
//! services, an `lb*` chain) are reference-counted; the rest (dispatch and endpoint-slot elements, whose
//! keys name the service's own frontend) belong to one service and are added and removed with it.

use nftkube_model::{NamespacedName, ServicePortName};
use nftkube_nft::ir::{ChainState, Element, Family};
use nftkube_render::claims::{
    self, shared_set, Acquired, Claims, Fingerprint, Fingerprinter, Released,
};
use nftkube_render::names::PieceSet;
use nftkube_render::Piece;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// The kernel-level effect of replacing some services' pieces.
#[derive(Debug, Default)]
pub(crate) struct Delta {
    /// Chains a service now needs that nobody needed.
    pub(crate) chains_added: Vec<(Family, Arc<ChainState>)>,
    /// Chains no service needs any more (deleted in a later transaction, see docs/kernel-facts.md, "Deleting chains: EBUSY before 6.2").
    pub(crate) chains_unused: Vec<(Family, String)>,
    /// Elements to delete, by family and set.
    pub elements_removed: BTreeMap<(Family, &'static str), Vec<Element>>,
    /// Elements to add, by family and set.
    pub elements_added: BTreeMap<(Family, &'static str), Vec<Element>>,
}

/// Service ports' pieces before a `replace`: what `restore` puts back.
#[derive(Debug, Default)]
pub struct Former(Vec<(ServicePortName, Vec<Piece>)>);

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
                index.count(&holder, p);
            }
            index.pieces.insert(holder, list);
        }
        for (holder, first) in index.claims.waiting() {
            tracing::warn!(
                service = %holder, holder = %first,
                "another service port of higher precedence holds this address and port; this claim waits"
            );
        }
        index
    }

    /// Every piece that is in the kernel: all of them but those whose frontend another port holds.
    pub(crate) fn committed_pieces(&self) -> impl Iterator<Item = &Piece> {
        self.pieces.iter().flat_map(move |(spn, list)| {
            list.iter()
                .filter(move |p| claims::committed(&self.claims, spn, p))
        })
    }

    /// Claims that wait because another service port holds their frontend (see `claims`).
    pub(crate) fn refused_claims(&self) -> usize {
        self.claims.refused()
    }

    /// Service ports of a service currently committed (a range of the name-ordered map: O(log n)).
    /// The committed pieces of one service port.
    pub(crate) fn pieces_of(&self, port: &ServicePortName) -> &[Piece] {
        self.pieces.get(port).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The ports of a service that are committed.
    pub(crate) fn ports_of(&self, service: &NamespacedName) -> Vec<ServicePortName> {
        let first = ServicePortName {
            service: service.clone(),
            port: "".into(),
            protocol: nftkube_model::Protocol::Tcp,
        };
        self.pieces
            .range::<ServicePortName, _>(&first..)
            .take_while(|(spn, _)| &spn.service == service)
            .map(|(spn, _)| ServicePortName::clone(spn))
            .collect()
    }

    /// Whether a chain is needed by some service.
    pub(crate) fn chain_in_use(&self, family: Family, name: &str) -> bool {
        self.chains.contains_key(&(family, name.to_owned()))
    }

    /// Replaces the pieces of the given service ports (empty: the port is gone) and returns what changes in
    /// the kernel, and the ports' former pieces (for `restore`). Applying the delta is the caller's
    /// business; on failure the caller restores the former pieces or discards this index.
    pub(crate) fn replace(
        &mut self,
        updates: Vec<(ServicePortName, Vec<Piece>)>,
    ) -> (Delta, Former) {
        let mut delta = Delta::default();
        let mut former = Former(Vec::with_capacity(updates.len()));
        for (spn, new) in updates {
            let (holder, old) = match self.pieces.remove_entry(&spn) {
                Some(entry) => entry,
                None => (Arc::new(spn), Vec::new()),
            };
            former.0.push((ServicePortName::clone(&holder), Vec::new()));
            let old_set: HashSet<&Piece> = old.iter().collect();
            let new_set: HashSet<&Piece> = new.iter().collect();
            for p in old.iter().filter(|p| !new_set.contains(p)) {
                self.release(&holder, p, &mut delta);
            }
            for p in new.iter().filter(|p| !old_set.contains(p)) {
                self.acquire(&holder, p, &mut delta);
            }
            if !new.is_empty() {
                self.pieces.insert(holder, new);
            }
            former.0.last_mut().expect("pushed above").1 = old;
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
        cancel_out(&mut delta);
        (delta, former)
    }

    /// Puts back what `replace` returned, after the kernel refused its delta: the index describes the
    /// kernel again. Claims are a function of who claims what, not of the order, so they come back as they
    /// were.
    pub(crate) fn restore(&mut self, former: Former) {
        self.replace(former.0);
    }

    /// The endpoint slots the frontend of `element` has in the kernel now (its holder's), by set.
    pub(crate) fn frontend_slots(
        &self,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> Vec<(&'static str, &Element)> {
        let key = self.claims.key(family, set, element);
        let Some(holder) = self.claims.holder_of(key) else {
            return Vec::new();
        };
        self.frontend_elements(holder, key)
            .into_iter()
            .filter(|(_, set, _)| set.has_slot_keys())
            .map(|(_, set, e)| (set.name(), e))
            .collect()
    }

    /// The given ports' pieces as they are now, for another try.
    pub(crate) fn current(&self, ports: &[ServicePortName]) -> Vec<(ServicePortName, Vec<Piece>)> {
        ports
            .iter()
            .map(|p| (p.clone(), self.pieces_of(p).to_vec()))
            .collect()
    }

    /// The ports with a committed piece that `present` says the kernel does not hold: the only ones whose
    /// objects a commit of this index adds, so the only ones the kernel can refuse it for.
    pub(crate) fn ports_adding(&self, present: impl Fn(&Piece) -> bool) -> Vec<ServicePortName> {
        self.pieces
            .iter()
            .filter(|(spn, list)| {
                list.iter()
                    .any(|p| claims::committed(&self.claims, spn, p) && !present(p))
            })
            .map(|(spn, _)| ServicePortName::clone(spn))
            .collect()
    }

    /// Takes the given ports out, as if they were gone, and returns their pieces.
    pub(crate) fn withdraw(
        &mut self,
        ports: &[ServicePortName],
    ) -> Vec<(ServicePortName, Vec<Piece>)> {
        let held = self.current(ports);
        self.replace(ports.iter().map(|p| (p.clone(), Vec::new())).collect());
        held
    }

    /// Counts `p` as needed by `holder` in an index of what is already in the kernel: nothing to record.
    fn count(&mut self, holder: &Arc<ServicePortName>, p: &Piece) {
        match p {
            Piece::Element {
                family,
                set,
                element,
                precedence,
            } => {
                if shared_set(*set) {
                    self.count_shared(*family, *set, element);
                } else {
                    self.claims
                        .acquire(holder, *precedence, *family, *set, element);
                }
            }
            Piece::Chain { family, chain } => {
                self.count_chain(*family, chain);
            }
        }
    }

    /// Counts `p` as needed by `holder` and records in `delta` what that adds to (or, when `holder` takes a
    /// frontend over, removes from) the kernel.
    fn acquire(&mut self, holder: &Arc<ServicePortName>, p: &Piece, delta: &mut Delta) {
        match p {
            Piece::Element {
                family,
                set,
                element,
                precedence,
            } => {
                if shared_set(*set) {
                    if self.count_shared(*family, *set, element) > 1 {
                        return;
                    }
                } else {
                    match self
                        .claims
                        .acquire(holder, *precedence, *family, *set, element)
                    {
                        Acquired::Holds => {}
                        Acquired::Waits { holder: first, new } => {
                            if new {
                                // Once per claim, not once per endpoint slot.
                                tracing::warn!(
                                    service = %holder, holder = %first, set = set.name(),
                                    "another service port of higher precedence holds this address and port; this claim waits"
                                );
                            }
                            return;
                        }
                        Acquired::TookOver(former) => {
                            tracing::warn!(
                                service = %holder, former = %former, set = set.name(),
                                "a service port of higher precedence takes this address and port over"
                            );
                            let theirs = self.elements_of_frontend(&former, *family, *set, element);
                            push_elements(&mut delta.elements_removed, theirs);
                        }
                    }
                }
                push_elements(&mut delta.elements_added, [(*family, *set, element)]);
            }
            Piece::Chain { family, chain } => {
                if self.count_chain(*family, chain) == 1 {
                    delta.chains_added.push((*family, chain.clone()));
                }
            }
        }
    }

    /// One more port wants this element of a shared set; how many do now.
    fn count_shared(&mut self, family: Family, set: PieceSet, element: &Element) -> u32 {
        let n = self
            .shared_elements
            .entry(self.fingerprints.of(&(family, set, element)))
            .or_insert(0);
        *n += 1;
        *n
    }

    /// One more port needs this chain; how many do now.
    fn count_chain(&mut self, family: Family, chain: &Arc<ChainState>) -> u32 {
        let n = self
            .chains
            .entry((family, chain.chain.name.clone()))
            .or_insert(0);
        *n += 1;
        *n
    }

    /// The claim key of a piece of a per-service set.
    fn claim_key(&self, p: &Piece) -> Option<Fingerprint> {
        match p {
            Piece::Element {
                family,
                set,
                element,
                ..
            } if !shared_set(*set) => Some(self.claims.key(*family, *set, element)),
            _ => None,
        }
    }

    /// The elements `holder` has on the frontend of `element` (see `frontend_elements`).
    fn elements_of_frontend(
        &self,
        holder: &ServicePortName,
        family: Family,
        set: PieceSet,
        element: &Element,
    ) -> Vec<(Family, PieceSet, &Element)> {
        self.frontend_elements(holder, self.claims.key(family, set, element))
    }

    /// The elements `holder` has on the frontend of claim `key` (what it has in the kernel while it holds it).
    fn frontend_elements(
        &self,
        holder: &ServicePortName,
        key: Fingerprint,
    ) -> Vec<(Family, PieceSet, &Element)> {
        self.pieces
            .get(holder)
            .into_iter()
            .flatten()
            .filter(|p| self.claim_key(p) == Some(key))
            .filter_map(|p| match p {
                Piece::Element {
                    family,
                    set,
                    element,
                    ..
                } => Some((*family, *set, element)),
                Piece::Chain { .. } => None,
            })
            .collect()
    }

    fn release(&mut self, holder: &Arc<ServicePortName>, p: &Piece, delta: &mut Delta) {
        match p {
            Piece::Element {
                family,
                set,
                element,
                ..
            } => {
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
                } else {
                    match self.claims.release(holder, *family, *set, element) {
                        Released::Held => {}
                        // Never ours (the claim waited): nothing of ours is in the kernel.
                        Released::NotHeld => return,
                        Released::HandedOver(next) => {
                            tracing::info!(
                                service = %next, former = %holder, set = set.name(),
                                "a waiting service port takes over the address and port let go"
                            );
                            let theirs = self.elements_of_frontend(&next, *family, *set, element);
                            push_elements(&mut delta.elements_added, theirs);
                        }
                    }
                }
                push_elements(&mut delta.elements_removed, [(*family, *set, element)]);
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

fn push_elements<'e>(
    to: &mut BTreeMap<(Family, &'static str), Vec<Element>>,
    elements: impl IntoIterator<Item = (Family, PieceSet, &'e Element)>,
) {
    for (family, set, element) in elements {
        to.entry((family, set.name()))
            .or_default()
            .push(element.clone());
    }
}

/// Keeps of a delta the kernel's net change. An element's presence flips with each step the index took
/// (a frontend handed over and taken back within one replace, a port's elements released and claimed again
/// under another precedence), so what counts is how often it was added less how often it was removed:
/// +1 adds it, -1 deletes it, 0 leaves it as it was.
fn cancel_out(delta: &mut Delta) {
    for (set, removed) in delta.elements_removed.iter_mut() {
        let Some(added) = delta.elements_added.get_mut(set) else {
            continue;
        };
        let mut net: HashMap<Element, i64> = HashMap::new();
        for e in added.iter() {
            *net.entry(e.clone()).or_default() += 1;
        }
        for e in removed.iter() {
            *net.entry(e.clone()).or_default() -= 1;
        }
        let mut once = HashSet::new();
        added.retain(|e| net[e] > 0 && once.insert(e.clone()));
        removed.retain(|e| net[e] < 0 && once.insert(e.clone()));
    }
    delta.elements_removed.retain(|_, v| !v.is_empty());
    delta.elements_added.retain(|_, v| !v.is_empty());
}
