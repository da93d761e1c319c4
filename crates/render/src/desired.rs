//! The desired content of our tables, with everything borrowed from where it already lives (the skeleton
//! tables and the services' pieces) instead of copied. A full sync at 50k services diffs ~400k elements;
//! an owned copy of them cost ~70 MB, this costs a pointer each.

use super::Piece;
use nftkube_nft::ir::{ChainState, Element, Family, Set, SetState, TableFlags, TableState};
use std::collections::BTreeMap;

/// One table as it should be.
#[derive(Debug)]
pub struct Desired<'a> {
    /// The table's family.
    pub family: Family,
    /// The table's name.
    pub name: &'a str,
    /// Its sets, each with its elements.
    pub sets: BTreeMap<&'a str, DesiredSet<'a>>,
    /// Its chains with their rules.
    pub chains: BTreeMap<&'a str, &'a ChainState>,
}

/// One set as it should be: its declaration and its elements.
#[derive(Debug)]
pub struct DesiredSet<'a> {
    /// The declaration.
    pub set: &'a Set,
    /// Sorted by element, one per key (a sorted vector: a third of a BTreeSet's memory).
    elements: Vec<&'a Element>,
}

impl<'a> DesiredSet<'a> {
    /// The elements in order.
    pub fn elements(&self) -> impl ExactSizeIterator<Item = &'a Element> + '_ {
        self.elements.iter().copied()
    }

    /// The elements in order, as a vector the caller keeps.
    pub fn into_elements(self) -> Vec<&'a Element> {
        self.elements
    }

    /// Whether `e` (key and value) is among the elements.
    pub fn contains(&self, e: &Element) -> bool {
        self.elements.binary_search(&e).is_ok()
    }

    /// Whether an element with this key is among the elements (whatever its value).
    pub fn has_key(&self, key: &[u8]) -> bool {
        self.elements
            .binary_search_by(|e| (*e.key).cmp(key))
            .is_ok()
    }

    /// Whether the set has no element.
    pub fn is_empty(&self) -> bool {
        self.elements.is_empty()
    }

    /// Orders the elements and keeps one per key: the first pushed (see `Desired::assemble`).
    fn seal(&mut self) {
        // Stable: among elements with one key, the first pushed stays first and survives the dedup.
        self.elements.sort_by(|a, b| a.key.cmp(&b.key));
        self.elements
            .dedup_by(|later, first| later.key == first.key);
        self.elements.shrink_to_fit();
    }
}

impl<'a> Desired<'a> {
    /// The skeleton tables with the pieces added (pieces whose frontend another port holds are left out by
    /// the caller, see `claims`). One element per key: the first given (shared sets repeat elements).
    pub fn assemble<'p: 'a>(
        skeleton: &'a [TableState],
        pieces: impl IntoIterator<Item = &'p Piece>,
    ) -> Vec<Desired<'a>> {
        let mut tables: Vec<Desired<'a>> = skeleton.iter().map(Desired::of).collect();
        for p in pieces {
            let family = match p {
                Piece::Element { family, .. } | Piece::Chain { family, .. } => *family,
            };
            let Some(t) = tables.iter_mut().find(|t| t.family == family) else {
                continue;
            };
            match p {
                Piece::Element { set, element, .. } => {
                    t.sets
                        .get_mut(set.name())
                        .unwrap_or_else(|| panic!("set {set} not declared"))
                        .elements
                        .push(element);
                }
                Piece::Chain { chain, .. } => {
                    t.chains.entry(&chain.chain.name).or_insert(chain);
                }
            }
        }
        for t in &mut tables {
            t.sets.values_mut().for_each(DesiredSet::seal);
        }
        tables
    }

    /// An owned table as given.
    pub fn of(table: &'a TableState) -> Desired<'a> {
        Desired {
            family: table.family,
            name: &table.name,
            sets: table
                .sets
                .iter()
                .map(|(n, s)| {
                    let set = DesiredSet {
                        set: &s.set,
                        // A BTreeSet iterates in order, and an owned table has one value per key.
                        elements: s.elements.iter().collect(),
                    };
                    (n.as_str(), set)
                })
                .collect(),
            chains: table.chains.iter().map(|(n, c)| (n.as_str(), c)).collect(),
        }
    }

    /// An owned copy (for `plan`, tests and anything else that keeps the result).
    pub(crate) fn to_table(&self) -> TableState {
        TableState {
            family: self.family,
            name: self.name.to_owned(),
            flags: TableFlags::EMPTY,
            sets: self
                .sets
                .iter()
                .map(|(n, s)| {
                    let set = SetState {
                        set: s.set.clone(),
                        elements: s.elements.iter().map(|e| (*e).clone()).collect(),
                    };
                    (n.to_string(), set)
                })
                .collect(),
            chains: self
                .chains
                .iter()
                .map(|(n, c)| (n.to_string(), (*c).clone()))
                .collect(),
        }
    }
}
