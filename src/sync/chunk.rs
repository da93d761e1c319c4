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
pub fn split(tx: Transaction, max: usize) -> Vec<Transaction> {
    let max = max.max(1);
    let mut out = Vec::new();
    let mut current = Transaction::default();
    let mut load = 0;
    for Change { family, table, op } in tx.changes {
        let (set, mut rest, add) = match op {
            Op::AddElements { set, elements } => (set, elements, true),
            Op::DeleteElements { set, elements } => (set, elements, false),
            op => {
                load += 1;
                current.changes.push(Change { family, table, op });
                continue;
            }
        };
        while !rest.is_empty() {
            if load >= max {
                out.push(std::mem::take(&mut current));
                load = 0;
            }
            let tail = rest.split_off((max - load).min(rest.len()));
            let part: Vec<Element> = std::mem::replace(&mut rest, tail);
            load += part.len();
            let op = if add {
                Op::AddElements {
                    set: set.clone(),
                    elements: part,
                }
            } else {
                Op::DeleteElements {
                    set: set.clone(),
                    elements: part,
                }
            };
            current.push(family, &table, op);
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
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
        assert_eq!(split(tx.clone(), 1000).len(), 1);
        let parts = split(tx.clone(), 10);
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
