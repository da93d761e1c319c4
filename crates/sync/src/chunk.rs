//! What a sync will commit, and its cutting into several transactions, so that no single commit holds the
//! kernel's nf_tables mutex for long (a 50k-service first sync would otherwise be one multi-second batch;
//! see docs/kernel-facts.md, "Large transactions hold the nf_tables mutex"). The diff removes dispatch elements first and adds them last, so every
//! chunk leaves each service either fully programmed or not yet reachable; changes that are only consistent
//! together (a chain's flush and its new rules, a table replaced with all its content) form a group, which a
//! cut never splits: a group that does not fit what is left of a part starts the next one, and a group
//! bigger than a part is a part of its own.
//!
//! Element operations borrow their elements from wherever they already live (the index's pieces, the table
//! as read back, a partial sync's delta); each part copies only its own elements, when it is built, and is
//! dropped once committed. At 50k services a whole owned transaction was ~40 MB.

use nftkube_nft::ir::{Element, Family};
use nftkube_nft::tx::{Change, Op, Transaction};
use std::fmt;

/// Elements per transaction above which a transaction is cut.
pub const MAX_ELEMENTS_PER_TRANSACTION: usize = 25_000;

/// The ordered changes of one sync, before they are cut into transactions.
#[derive(Debug, Default)]
pub(crate) struct Plan<'a> {
    changes: Vec<Planned<'a>>,
}

#[derive(Debug)]
enum Planned<'a> {
    Object(Change),
    Elements {
        family: Family,
        table: String,
        set: String,
        add: bool,
        elements: Vec<&'a Element>,
    },
    /// Never cut: committed in one transaction.
    Group(Vec<Planned<'a>>),
}

impl Planned<'_> {
    /// Its weight against a part's budget: objects count one, element operations their elements.
    fn load(&self) -> usize {
        match self {
            Planned::Object(_) => 1,
            Planned::Elements { elements, .. } => elements.len(),
            Planned::Group(g) => g.iter().map(Planned::load).sum(),
        }
    }

    /// Appends it, whole, to a transaction.
    fn append_to(self, part: &mut Transaction) {
        match self {
            Planned::Object(Change { family, table, op }) => part.push(family, &table, op),
            Planned::Elements {
                family,
                table,
                set,
                add,
                elements,
            } => {
                let elements = elements.into_iter().cloned().collect();
                part.push(family, &table, element_op(add, set, elements));
            }
            Planned::Group(g) => g.into_iter().for_each(|p| p.append_to(part)),
        }
    }
}

impl<'a> Plan<'a> {
    /// An object change (anything but elements: see `add_elements` / `delete_elements`).
    pub(crate) fn push(&mut self, family: Family, table: &str, op: Op) {
        debug_assert!(
            !matches!(op, Op::AddElements { .. } | Op::DeleteElements { .. }),
            "element operations borrow their elements"
        );
        self.changes.push(Planned::Object(Change {
            family,
            table: table.to_owned(),
            op,
        }));
    }

    /// Adds elements to a set.
    pub(crate) fn add_elements(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
        elements: Vec<&'a Element>,
    ) {
        self.push_elements(family, table, set, true, elements);
    }

    /// Deletes elements from a set.
    pub(crate) fn delete_elements(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
        elements: Vec<&'a Element>,
    ) {
        self.push_elements(family, table, set, false, elements);
    }

    fn push_elements(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
        add: bool,
        elements: Vec<&'a Element>,
    ) {
        if elements.is_empty() {
            return;
        }
        self.changes.push(Planned::Elements {
            family,
            table: table.to_owned(),
            set: set.to_owned(),
            add,
            elements,
        });
    }

    /// Plans the changes `f` makes as a group that no cut splits (see the module's comment).
    pub(crate) fn group(&mut self, f: impl FnOnce(&mut Plan<'a>)) {
        let mut inner = Plan::default();
        f(&mut inner);
        if !inner.changes.is_empty() {
            self.changes.push(Planned::Group(inner.changes));
        }
    }

    /// Number of planned changes (an element operation counts one, a group its members).
    pub(crate) fn len(&self) -> usize {
        fn count(p: &Planned) -> usize {
            match p {
                Planned::Group(g) => g.iter().map(count).sum(),
                _ => 1,
            }
        }
        self.changes.iter().map(count).sum()
    }

    /// Its weight: element operations count their elements, other changes one each.
    pub(crate) fn elements(&self) -> usize {
        self.changes.iter().map(Planned::load).sum()
    }

    /// No changes.
    pub(crate) fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// One line per change, for trace logs.
    pub(crate) fn describe(&self) -> impl Iterator<Item = String> + '_ {
        fn lines(p: &Planned, out: &mut Vec<String>) {
            match p {
                Planned::Group(g) => g.iter().for_each(|q| lines(q, out)),
                _ => out.push(p.to_string()),
            }
        }
        let mut out = Vec::new();
        self.changes.iter().for_each(|c| lines(c, &mut out));
        out.into_iter()
    }

    /// The plan as transactions of at most `max` elements each (other objects count one), in order. Lazy:
    /// each part's elements are copied only when the part is asked for.
    pub(crate) fn parts(self, max: usize) -> Parts<'a> {
        Parts {
            changes: self.changes.into_iter().peekable(),
            pending: None,
            max: max.max(1),
        }
    }
}

fn element_op(add: bool, set: String, elements: Vec<Element>) -> Op {
    if add {
        Op::AddElements { set, elements }
    } else {
        Op::DeleteElements { set, elements }
    }
}

impl fmt::Display for Planned<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Planned::Object(c) => c.fmt(f),
            Planned::Group(g) => write!(f, "a group of {} changes", g.len()),
            Planned::Elements {
                family,
                table,
                set,
                add,
                elements,
            } => {
                let (verb, prep) = if *add {
                    ("add", "to")
                } else {
                    ("delete", "from")
                };
                let (n, fam) = (elements.len(), family.as_str());
                write!(
                    f,
                    "{verb} {n} elements {prep} set {set} of table {fam} {table}"
                )
            }
        }
    }
}

/// The parts of a plan, in order (see [`Plan::parts`]).
pub(crate) struct Parts<'a> {
    changes: std::iter::Peekable<std::vec::IntoIter<Planned<'a>>>,
    /// An element operation cut part-way: what is left of it goes first into the next part.
    pending: Option<Pending<'a>>,
    max: usize,
}

struct Pending<'a> {
    family: Family,
    table: String,
    set: String,
    add: bool,
    elements: std::vec::IntoIter<&'a Element>,
}

impl Iterator for Parts<'_> {
    type Item = Transaction;

    fn next(&mut self) -> Option<Transaction> {
        let mut part = Transaction::default();
        let mut load = 0;
        while load < self.max {
            let Some(p) = &mut self.pending else {
                // A group goes whole into this part, or (when it does not fit what is left) starts the next.
                if let Some(Planned::Group(_)) = self.changes.peek() {
                    let need = self.changes.peek().map_or(0, Planned::load);
                    if load > 0 && load + need > self.max {
                        break;
                    }
                    load += need;
                    self.changes.next().expect("peeked").append_to(&mut part);
                    continue;
                }
                match self.changes.next() {
                    None => break,
                    Some(Planned::Object(Change { family, table, op })) => {
                        load += 1;
                        part.push(family, &table, op);
                    }
                    Some(Planned::Group(_)) => unreachable!("handled above"),
                    Some(Planned::Elements {
                        family,
                        table,
                        set,
                        add,
                        elements,
                    }) => {
                        let elements = elements.into_iter();
                        self.pending = Some(Pending {
                            family,
                            table,
                            set,
                            add,
                            elements,
                        });
                    }
                }
                continue;
            };
            let elements: Vec<Element> =
                p.elements.by_ref().take(self.max - load).cloned().collect();
            load += elements.len();
            let set = p.set.clone();
            part.push(p.family, &p.table, element_op(p.add, set, elements));
            if p.elements.len() == 0 {
                self.pending = None;
            }
        }
        (!part.is_empty()).then_some(part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elements(n: usize) -> Vec<Element> {
        (0..n)
            .map(|i| Element {
                key: (i as u32).to_be_bytes().into(),
                value: None,
            })
            .collect()
    }

    #[test]
    fn small_plans_stay_whole_and_big_ones_are_cut_in_order() {
        let (a, b) = (elements(25), elements(7));
        let plan = || {
            let mut plan = Plan::default();
            plan.push(Family::Ip, "t", Op::AddTable);
            plan.push(Family::Ip, "t", Op::FlushChain("c".into()));
            plan.add_elements(Family::Ip, "t", "a", a.iter().collect());
            plan.delete_elements(Family::Ip, "t", "b", b.iter().collect());
            plan.add_elements(Family::Ip, "t", "empty", vec![]);
            plan
        };
        assert_eq!(plan().len(), 4, "an empty element operation is no change");
        assert_eq!(plan().parts(1000).count(), 1);
        let parts: Vec<Transaction> = plan().parts(10).collect();
        assert_eq!(parts.len(), 4, "2 objects + 32 elements in parts of 10");
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
        let collect = |set: &str, add: bool| -> Vec<Element> {
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
        assert_eq!(collect("a", true), a);
        assert_eq!(collect("b", false), b);
        assert!(matches!(flat[0].op, Op::AddTable));
        assert!(matches!(flat[1].op, Op::FlushChain(_)));
    }

    /// The changes of each part, as (kind, element count) pairs.
    fn shape(parts: &[Transaction]) -> Vec<Vec<(&'static str, usize)>> {
        parts
            .iter()
            .map(|p| {
                p.changes
                    .iter()
                    .map(|c| match &c.op {
                        Op::AddElements { elements, .. } => ("add", elements.len()),
                        Op::DeleteElements { elements, .. } => ("delete", elements.len()),
                        Op::FlushChain(_) => ("flush", 1),
                        Op::AddRule { .. } => ("rule", 1),
                        _ => ("object", 1),
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_group_on_the_boundary_moves_whole_into_the_next_part() {
        let (a, b) = (elements(8), elements(30));
        let rule = || Op::AddRule {
            chain: "c".into(),
            rule: nftkube_nft::ir::Rule {
                exprs: vec![],
                comment: None,
            },
        };
        let mut plan = Plan::default();
        plan.add_elements(Family::Ip, "t", "a", a.iter().collect());
        // 8 elements used; the group (flush + 3 rules) would straddle the cut at 10.
        plan.group(|g| {
            g.push(Family::Ip, "t", Op::FlushChain("c".into()));
            for _ in 0..3 {
                g.push(Family::Ip, "t", rule());
            }
        });
        // A group bigger than a part is a part of its own, elements and all.
        plan.group(|g| {
            g.push(Family::Ip, "t", Op::DeleteTable);
            g.push(Family::Ip, "t", Op::AddTable);
            g.add_elements(Family::Ip, "t", "b", b.iter().collect());
        });
        plan.add_elements(Family::Ip, "t", "a", a.iter().collect());
        let parts: Vec<Transaction> = plan.parts(10).collect();
        assert_eq!(
            shape(&parts),
            vec![
                vec![("add", 8)],
                vec![("flush", 1), ("rule", 1), ("rule", 1), ("rule", 1)],
                vec![("object", 1), ("object", 1), ("add", 30)],
                vec![("add", 8)],
            ]
        );
    }

    #[test]
    fn plans_describe_their_changes() {
        let a = elements(3);
        let mut plan = Plan::default();
        plan.push(Family::Ip6, "nftkube", Op::AddTable);
        plan.delete_elements(Family::Ip6, "nftkube", "s", a.iter().collect());
        let lines: Vec<String> = plan.describe().collect();
        assert_eq!(
            lines,
            [
                "add table ip6 nftkube",
                "delete 3 elements from set s of table ip6 nftkube"
            ]
        );
    }
}
