//! An in-memory stand-in for the kernel's nf_tables, strict where the kernel is strict (missing objects,
//! objects still in use, key lengths), so the sync engine's transactions are tested without root.

use super::backend::Backend;
use super::ir::*;
use super::netlink::{CommitError, DumpError};
use super::tx::{Op, Transaction};
use nftkube_netlink::NetlinkError;
use std::collections::BTreeMap;

#[derive(Debug, Default, Clone)]
/// An in-memory nf_tables that applies transactions all or nothing and refuses what the kernel refuses.
pub struct FakeKernel {
    /// Our tables, by family and name.
    pub tables: BTreeMap<(Family, String), TableState>,
    /// The transactions committed, in order.
    pub committed: Vec<Transaction>,
    /// When set, the next commit fails with this errno on the change at this index.
    pub fail_next: Option<(usize, i32)>,
    /// When set, every commit that adds an element whose key or value holds these bytes, or a chain whose
    /// name does, fails with this errno on that change, as the kernel refuses an object it cannot hold.
    pub refuse: Option<(Vec<u8>, i32)>,
    /// The ruleset generation: one more with every commit that changed something, as the kernel counts.
    pub generation: u32,
    /// Element comments (their user data), by family, table, set and key.
    pub comments: BTreeMap<(Family, String, String, ElementBytes), String>,
    /// When set, committed as another process's batch just before the next [`FakeKernel::commit_at`] is
    /// checked: the competing change that lands between a command's read and its commit.
    pub interleave: Option<Transaction>,
}

/// The kernel's answer to a batch whose generation moved: ERESTART on BATCH_BEGIN, nothing applied.
fn generation_moved() -> CommitError {
    CommitError {
        failures: vec![(
            None,
            NetlinkError::Batch {
                seq: 0,
                errno: libc::ERESTART,
                ext_ack: None,
            },
        )],
    }
}

fn fail(i: usize, errno: i32, what: String) -> CommitError {
    CommitError {
        failures: vec![(
            Some(what),
            NetlinkError::Kernel {
                seq: i as u32,
                errno,
                ext_ack: None,
            },
        )],
    }
}

/// Whether `change` adds an element or a chain that holds `bytes` (see `FakeKernel::refuse`).
fn adds(change: &super::tx::Change, bytes: &[u8]) -> bool {
    let holds = |s: &[u8]| s.windows(bytes.len()).any(|w| w == bytes);
    match &change.op {
        Op::AddElements { elements, .. } => elements
            .iter()
            .any(|e| holds(&e.key) || matches!(&e.value, Some(ElementValue::Data(d)) if holds(d))),
        Op::AddChain(c) => holds(c.name.as_bytes()),
        _ => false,
    }
}

impl FakeKernel {
    /// As `NftSocket::commit_at`: applies `tx` only if the generation is still `generation` (after the
    /// `interleave`d batch, if one is waiting), and refuses all of it with ERESTART otherwise.
    pub fn commit_at(&mut self, tx: &Transaction, generation: u32) -> Result<usize, CommitError> {
        if let Some(competing) = self.interleave.take() {
            self.commit(&competing)?;
        }
        if tx.is_empty() {
            return Ok(0);
        }
        if generation != self.generation {
            return Err(generation_moved());
        }
        self.commit(tx)
    }

    /// The elements of one set with their comments, as `NftSocket::dump_set_commented` reads them.
    pub fn read_set_commented(
        &self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Vec<(Element, Option<String>)> {
        let Some(s) = self
            .tables
            .get(&(family, table.to_owned()))
            .and_then(|t| t.sets.get(set))
        else {
            return Vec::new();
        };
        s.elements
            .iter()
            .map(|e| {
                let key = (family, table.to_owned(), set.to_owned(), e.key.clone());
                (e.clone(), self.comments.get(&key).cloned())
            })
            .collect()
    }

    /// Keeps `comments` in step with a committed transaction.
    fn record_comments(&mut self, tx: &Transaction) {
        for c in &tx.changes {
            let key =
                |set: &str, e: &Element| (c.family, c.table.clone(), set.to_owned(), e.key.clone());
            match &c.op {
                Op::AddCommentedElements { set, elements } => {
                    for e in elements {
                        self.comments
                            .insert(key(set, &e.element), e.comment.clone());
                    }
                }
                Op::DeleteElements { set, elements } => {
                    for e in elements {
                        self.comments.remove(&key(set, e));
                    }
                }
                Op::DeleteSet(set) => self
                    .comments
                    .retain(|(f, t, s, _), _| (*f, t, s) != (c.family, &c.table, set)),
                Op::DeleteTable => self
                    .comments
                    .retain(|(f, t, _, _), _| (*f, t) != (c.family, &c.table)),
                _ => {}
            }
        }
    }

    fn apply(
        tables: &mut BTreeMap<(Family, String), TableState>,
        tx: &Transaction,
    ) -> Result<(), CommitError> {
        for (i, c) in tx.changes.iter().enumerate() {
            let key = (c.family, c.table.clone());
            let what = c.to_string();
            if let Op::AddTable = c.op {
                // On an existing table: an update to flags 0, as NEWTABLE without NLM_F_EXCL is.
                tables
                    .entry(key.clone())
                    .or_insert_with(|| TableState::new(c.family, c.table.clone()))
                    .flags = TableFlags::EMPTY;
                continue;
            }
            if let Op::CreateTable = c.op {
                if tables.contains_key(&key) {
                    return Err(fail(i, libc::EEXIST, what));
                }
                tables.insert(key, TableState::new(c.family, c.table.clone()));
                continue;
            }
            if let Op::DeleteTable = c.op {
                if tables.remove(&key).is_none() {
                    return Err(fail(i, libc::ENOENT, what));
                }
                continue;
            }
            let t = tables
                .get_mut(&key)
                .ok_or_else(|| fail(i, libc::ENOENT, what.clone()))?;
            // The fake keeps no user data: a commented element is stored as a plain one.
            let plain;
            let op = match &c.op {
                Op::AddCommentedElements { set, elements } => {
                    plain = Op::AddElements {
                        set: set.clone(),
                        elements: elements.iter().map(|e| e.element.clone()).collect(),
                    };
                    &plain
                }
                op => op,
            };
            match op {
                Op::AddTable | Op::CreateTable | Op::DeleteTable => unreachable!(),
                Op::AddChain(ch) => match t.chains.get_mut(&ch.name) {
                    None => {
                        t.add_chain(ch.clone());
                    }
                    Some(existing) => update_chain(&mut existing.chain, ch)
                        .map_err(|errno| fail(i, errno, what.clone()))?,
                },
                Op::FlushChain(name) => {
                    t.chains
                        .get_mut(name)
                        .ok_or_else(|| fail(i, libc::ENOENT, what.clone()))?
                        .rules
                        .clear();
                }
                // The fake keeps no rule handles, so it cannot tell which rule a handle names.
                Op::DeleteRule { .. } => return Err(fail(i, libc::EOPNOTSUPP, what)),
                Op::DeleteChain(name) => {
                    let used = t.chains.values().any(|ch| {
                        ch.rules.iter().any(|r| {
                            r.exprs.iter().any(|e| matches!(e, Expr::Verdict(v) if v.chain() == Some(name)))
                        })
                    }) || t.sets.values().any(|s| {
                        s.elements.iter().any(|e| {
                            matches!(&e.value, Some(ElementValue::Verdict(v)) if v.chain() == Some(name))
                        })
                    });
                    let ch = t
                        .chains
                        .get(name)
                        .ok_or_else(|| fail(i, libc::ENOENT, what.clone()))?;
                    if used || !ch.rules.is_empty() {
                        return Err(fail(i, libc::EBUSY, what));
                    }
                    t.chains.remove(name);
                }
                Op::AddRule { chain, rule } => {
                    for e in &rule.exprs {
                        let missing_set = match e {
                            Expr::Lookup { set, .. } | Expr::Dynset { set, .. } => {
                                !t.sets.contains_key(set)
                            }
                            _ => false,
                        };
                        let missing_chain = match e {
                            Expr::Verdict(v) => {
                                v.chain().is_some_and(|c| !t.chains.contains_key(c))
                            }
                            _ => false,
                        };
                        if missing_set || missing_chain {
                            return Err(fail(i, libc::ENOENT, what));
                        }
                    }
                    t.chains
                        .get_mut(chain)
                        .ok_or_else(|| fail(i, libc::ENOENT, what.clone()))?
                        .rules
                        .push(rule.clone());
                }
                Op::AddSet(s) => {
                    if let Some(existing) = t.sets.get(&s.name) {
                        if existing.set != *s {
                            return Err(fail(i, libc::EEXIST, what));
                        }
                    } else {
                        t.add_set(s.clone());
                    }
                }
                Op::DeleteSet(name) => {
                    let used = t.chains.values().any(|ch| {
                        ch.rules.iter().any(|r| {
                            r.exprs.iter().any(|e| {
                                matches!(e, Expr::Lookup { set, .. } | Expr::Dynset { set, .. } if set == name)
                            })
                        })
                    });
                    if used {
                        return Err(fail(i, libc::EBUSY, what));
                    }
                    t.sets
                        .remove(name)
                        .ok_or_else(|| fail(i, libc::ENOENT, what))?;
                }
                Op::AddCommentedElements { .. } => unreachable!("made plain above"),
                Op::AddElements { set, elements } => {
                    let chains: Vec<String> = t.chains.keys().cloned().collect();
                    let s = t
                        .sets
                        .get_mut(set)
                        .ok_or_else(|| fail(i, libc::ENOENT, what.clone()))?;
                    let klen = key_len(&s.set.key);
                    for e in elements {
                        if e.key.len() != klen {
                            return Err(fail(i, libc::EINVAL, what));
                        }
                        if let Some(ElementValue::Verdict(v)) = &e.value {
                            if v.chain().is_some_and(|c| !chains.iter().any(|x| x == c)) {
                                return Err(fail(i, libc::ENOENT, what));
                            }
                        }
                        // Same key with another value: the kernel refuses to overwrite.
                        if s.elements
                            .iter()
                            .any(|x| x.key == e.key && x.value != e.value)
                        {
                            return Err(fail(i, libc::EEXIST, what));
                        }
                        s.elements.insert(e.clone());
                    }
                }
                Op::DeleteElements { set, elements } => {
                    let s = t
                        .sets
                        .get_mut(set)
                        .ok_or_else(|| fail(i, libc::ENOENT, what.clone()))?;
                    for e in elements {
                        if !s.elements.iter().any(|x| x.key == e.key) {
                            return Err(fail(i, libc::ENOENT, what));
                        }
                        s.elements.retain(|x| x.key != e.key);
                    }
                }
            }
        }
        Ok(())
    }
}

/// NEWCHAIN on an existing chain, as the kernel treats it: a base chain's policy changes; another type,
/// hook, priority or device is refused (EOPNOTSUPP), and so is a hook for a regular chain (EEXIST).
fn update_chain(have: &mut Chain, want: &Chain) -> Result<(), i32> {
    match (&mut have.base, &want.base) {
        (_, None) => Ok(()),
        (None, Some(_)) => Err(libc::EEXIST),
        (Some(h), Some(w)) if h.updatable_to(w) => {
            h.policy = w.policy;
            Ok(())
        }
        (Some(_), Some(_)) => Err(libc::EOPNOTSUPP),
    }
}

impl Backend for FakeKernel {
    fn read_set(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Element>, DumpError> {
        Ok(self
            .tables
            .get(&(family, table.to_owned()))
            .and_then(|t| t.sets.get(set))
            .map(|s| s.elements.iter().cloned().collect())
            .unwrap_or_default())
    }
    fn commit(&mut self, tx: &Transaction) -> Result<usize, CommitError> {
        if let Some((i, errno)) = self.fail_next.take() {
            let what = tx.changes.get(i).map(|c| c.to_string()).unwrap_or_default();
            return Err(fail(i, errno, what));
        }
        if let Some((bytes, errno)) = &self.refuse {
            if let Some(i) = tx.changes.iter().position(|c| adds(c, bytes)) {
                return Err(fail(i, *errno, tx.changes[i].to_string()));
            }
        }
        // Atomic: work on a copy and keep it only if every change applies.
        let mut next = self.tables.clone();
        Self::apply(&mut next, tx)?;
        self.tables = next;
        self.record_comments(tx);
        if !tx.is_empty() {
            self.generation = self.generation.wrapping_add(1);
        }
        self.committed.push(tx.clone());
        Ok(tx.changes.len())
    }

    fn read_table(&mut self, family: Family, name: &str) -> Result<Option<TableState>, DumpError> {
        Ok(self.tables.get(&(family, name.to_owned())).cloned())
    }
}
