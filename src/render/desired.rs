//! The desired content of our tables, with everything borrowed from where it already lives (the skeleton
//! tables and the services' pieces) instead of copied. A full sync at 50k services diffs ~400k elements;
//! an owned copy of them cost ~70 MB, this costs a pointer each.

use super::Piece;
use crate::nft::ir::{ChainState, Element, Family, Set, SetState, TableState};
use std::collections::{BTreeMap, BTreeSet};

/// One table as it should be.
#[derive(Debug)]
pub struct Desired<'a> {
    pub family: Family,
    pub name: &'a str,
    pub sets: BTreeMap<&'a str, DesiredSet<'a>>,
    pub chains: BTreeMap<&'a str, &'a ChainState>,
}

#[derive(Debug)]
pub struct DesiredSet<'a> {
    pub set: &'a Set,
    pub elements: BTreeSet<&'a Element>,
}

impl<'a> Desired<'a> {
    /// The skeleton tables with the pieces added. One value per key: when two service ports claim the same
    /// frontend, the first (in name order) keeps it, as the sync engine's index does.
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
                    let elements = &mut t
                        .sets
                        .get_mut(set)
                        .unwrap_or_else(|| panic!("set {set} not declared"))
                        .elements;
                    let probe = Element {
                        key: element.key.clone(),
                        value: None,
                    };
                    let taken = elements
                        .range::<&Element, _>(&probe..)
                        .next()
                        .is_some_and(|e| e.key == element.key);
                    if !taken {
                        elements.insert(element);
                    }
                }
                Piece::Chain { chain, .. } => {
                    t.chains.entry(&chain.chain.name).or_insert(chain);
                }
            }
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
                        elements: s.elements.iter().collect(),
                    };
                    (n.as_str(), set)
                })
                .collect(),
            chains: table.chains.iter().map(|(n, c)| (n.as_str(), c)).collect(),
        }
    }

    /// An owned copy (for `plan`, tests and anything else that keeps the result).
    pub fn to_table(&self) -> TableState {
        TableState {
            family: self.family,
            name: self.name.to_owned(),
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
