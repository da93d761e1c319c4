//! Cutting a big transaction into several smaller ones, so that no single commit holds the kernel's
//! nf_tables mutex for long (a 50k-service first sync would otherwise be one multi-second batch; see
//! KERNEL-NOTES on soft lockups). Cuts fall only inside or between element operations, never between a chain
//! flush and its new rules, and the diff removes dispatch elements first and adds them last, so every chunk
//! leaves each service either fully programmed or not yet reachable.

use crate::nft::ir::Element;
use crate::nft::tx::{Change, Op, Transaction};

/// Elements per transaction above which a transaction is cut.
pub const MAX_ELEMENTS_PER_TRANSACTION: usize = 25_000;

/// Splits `tx` into transactions of at most `max` elements each (other objects count one), in order.
///
/// Lazy: each part is built (its elements moved, never copied, into a vector of exactly its size) only when
/// the caller asks for it, so a caller that commits and drops each part before the next holds one part's
/// worth of elements beside the rest of `tx`, not a second copy of everything.
pub fn split(tx: Transaction, max: usize) -> Split {
    Split {
        changes: tx.changes.into_iter(),
        pending: None,
        max: max.max(1),
    }
}

/// The parts of a split transaction, in order (see [`split`]).
pub struct Split {
    changes: std::vec::IntoIter<Change>,
    /// An element operation cut part-way: what is left of it goes first into the next part.
    pending: Option<Pending>,
    max: usize,
}

struct Pending {
    family: crate::nft::ir::Family,
    table: String,
    set: String,
    add: bool,
    elements: std::iter::Peekable<std::vec::IntoIter<Element>>,
}

impl Iterator for Split {
    type Item = Transaction;

    fn next(&mut self) -> Option<Transaction> {
        let mut part = Transaction::default();
        let mut load = 0;
        while load < self.max {
            let Some(p) = &mut self.pending else {
                let Some(Change { family, table, op }) = self.changes.next() else {
                    break;
                };
                let (set, elements, add) = match op {
                    Op::AddElements { set, elements } => (set, elements, true),
                    Op::DeleteElements { set, elements } => (set, elements, false),
                    op => {
                        load += 1;
                        part.push(family, &table, op);
                        continue;
                    }
                };
                let elements = elements.into_iter().peekable();
                self.pending = Some(Pending {
                    family,
                    table,
                    set,
                    add,
                    elements,
                });
                continue;
            };
            let elements: Vec<Element> = p.elements.by_ref().take(self.max - load).collect();
            load += elements.len();
            if !elements.is_empty() {
                let set = p.set.clone();
                let op = if p.add {
                    Op::AddElements { set, elements }
                } else {
                    Op::DeleteElements { set, elements }
                };
                part.push(p.family, &p.table, op);
            }
            if p.elements.peek().is_none() {
                self.pending = None;
            }
        }
        (!part.is_empty()).then_some(part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::ir::Family;

    fn elements(n: usize) -> Vec<Element> {
        (0..n)
            .map(|i| Element {
                key: (i as u32).to_be_bytes().to_vec(),
                value: None,
            })
            .collect()
    }

    #[test]
    fn small_transactions_stay_whole_and_big_ones_are_cut_in_order() {
        let mut tx = Transaction::default();
        tx.push(Family::Ip, "t", Op::AddTable);
        tx.push(Family::Ip, "t", Op::FlushChain("c".into()));
        tx.push(
            Family::Ip,
            "t",
            Op::AddElements {
                set: "a".into(),
                elements: elements(25),
            },
        );
        tx.push(
            Family::Ip,
            "t",
            Op::DeleteElements {
                set: "b".into(),
                elements: elements(7),
            },
        );
        assert_eq!(split(tx.clone(), 1000).count(), 1);
        let parts: Vec<Transaction> = split(tx.clone(), 10).collect();
        assert!(parts.iter().all(|p| p
            .changes
            .iter()
            .map(|c| match &c.op {
                Op::AddElements { elements, .. } | Op::DeleteElements { elements, .. } =>
                    elements.len(),
                _ => 1,
            })
            .sum::<usize>()
            <= 10));
        // Nothing lost, nothing reordered.
        let flat: Vec<Change> = parts.into_iter().flat_map(|p| p.changes).collect();
        let count = |set: &str, add: bool| -> Vec<Element> {
            flat.iter()
                .filter_map(|c| match &c.op {
                    Op::AddElements { set: s, elements } if add && s == set => {
                        Some(elements.clone())
                    }
                    Op::DeleteElements { set: s, elements } if !add && s == set => {
                        Some(elements.clone())
                    }
                    _ => None,
                })
                .flatten()
                .collect()
        };
        assert_eq!(count("a", true), elements(25));
        assert_eq!(count("b", false), elements(7));
        assert!(matches!(flat[0].op, Op::AddTable));
        assert!(matches!(flat[1].op, Op::FlushChain(_)));
    }
}
