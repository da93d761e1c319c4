//! The transaction that turns the committed state of a table into the desired one, touching only what
//! differs. Order inside the batch respects the kernel's references: sets and chains exist before the
//! rules and elements that name them; rules and elements that name a chain or set go before it is deleted.

use super::chunk::Plan;
use nftkube_nft::ir::*;
use nftkube_nft::tx::Op;
use nftkube_render::names::is_dispatch_set;
use nftkube_render::{Desired, DesiredSet};

/// Appends to `tx` the changes from `old` (None: the table does not exist) to `new`. Returns the stale
/// chains it left in place because something in `old` still pointed at them: kernels before 6.2 can answer
/// EBUSY when a chain is deleted in the transaction that removes the last reference to it, so such chains
/// are deleted by the next sync instead (as upstream kube-proxy does).
pub(crate) fn diff_table<'a>(
    tx: &mut Plan<'a>,
    old: Option<&'a TableState>,
    new: Desired<'a>,
) -> Vec<String> {
    let (fam, name) = (new.family, new.name);
    let old = match old {
        Some(o) if compatible(o, &new) => o,
        Some(o) => {
            // A set's type or a base chain's hook changed (an upgrade of nftkube itself): such objects cannot
            // be altered in place, so the table is replaced with all its content in one transaction (a
            // group: never cut), so that no packet ever meets a table half old, half new.
            tracing::info!(
                table = %format!("{} {name}", fam.as_str()),
                replaced = %incompatible(o, &new).join(", "),
                "migrating a table of another layout: replaced in one transaction"
            );
            tx.group(|g| {
                g.push(fam, name, Op::DeleteTable);
                create_table(g, new);
            });
            return Vec::new();
        }
        None => {
            create_table(tx, new);
            return Vec::new();
        }
    };

    if !old.flags.is_empty() {
        // Dormant (or any other flag): an update of the existing table to flags 0 re-attaches its hooks.
        tx.push(fam, name, Op::AddTable);
    }
    for (n, s) in &new.sets {
        if !old.sets.contains_key(*n) {
            tx.push(fam, name, Op::AddSet(s.set.clone()));
        }
    }
    // New chains complete with their rules before any element can send a packet into them.
    let fresh: Vec<&ChainState> = new
        .chains
        .values()
        .filter(|c| !old.chains.contains_key(&c.chain.name))
        .copied()
        .collect();
    for c in &fresh {
        tx.push(fam, name, Op::AddChain(c.chain.clone()));
    }
    for c in &fresh {
        add_rules(tx, fam, name, c);
    }
    let replaced = replace_or_update_base_chains(tx, fam, name, old, &new);
    // Elements: removals first, so that an element whose value changed is replaced (delete, then add).
    // Dispatch (`DISPATCH_SETS`) is withdrawn first and published last, so that even when a big transaction is
    // committed in chunks no packet reaches a service whose other elements are not all in place. An element
    // whose key is gone for good is removed last, after the rules: a rule this sync replaces may still look it
    // up (a new layout of the endpoint slots, after an upgrade), and a chunk must not leave the old rules
    // without their elements.
    let mut order: Vec<(&str, &DesiredSet<'a>)> = new
        .sets
        .iter()
        // Dynamic sets (affinity) are filled by the packet path: their elements are the kernel's, never
        // diffed.
        .filter(|(_, s)| !s.set.dynamic)
        .map(|(n, s)| (*n, s))
        .collect();
    order.sort_by_key(|(n, _)| (!is_dispatch_set(n), *n));
    let mut gone_for_good = Vec::new();
    for (n, s) in &order {
        let Some(o) = old.sets.get(*n) else { continue };
        let (now, later): (Vec<&Element>, Vec<&Element>) = o
            .elements
            .iter()
            .filter(|e| !s.contains(e))
            .partition(|e| is_dispatch_set(n) || s.has_key(&e.key));
        tx.delete_elements(fam, name, n, now);
        gone_for_good.push((*n, later));
    }
    for (n, s) in order.iter().rev() {
        let added: Vec<&Element> = match old.sets.get(*n) {
            Some(o) => s.elements().filter(|e| !o.elements.contains(*e)).collect(),
            None => s.elements().collect(),
        };
        tx.add_elements(fam, name, n, added);
    }
    for (n, c) in &new.chains {
        match old.chains.get(*n) {
            _ if replaced.contains(n) => {} // re-created above, with its rules
            Some(o) if o.rules == c.rules => {}
            // The flush and the new rules are one group: a cut between them would leave the chain empty.
            Some(o) => tx.group(|g| {
                if !o.rules.is_empty() {
                    g.push(fam, name, Op::FlushChain(n.to_string()));
                }
                add_rules(g, fam, name, c);
            }),
            None => {} // added above
        }
    }
    for (n, gone) in gone_for_good {
        tx.delete_elements(fam, name, n, gone);
    }
    // Stale chains: those still referenced by the old state wait for the next sync; the others are flushed
    // first (they may jump into each other), then deleted.
    let (deferred, stale): (Vec<&ChainState>, Vec<&ChainState>) = old
        .chains
        .values()
        .filter(|c| !new.chains.contains_key(c.chain.name.as_str()))
        .partition(|c| referenced(old, &c.chain.name));
    // Deferred chains are flushed now all the same: their rules may name a set or chain deleted below
    // (someone else's objects, added to our table together).
    for c in stale.iter().chain(&deferred) {
        if !c.rules.is_empty() {
            tx.push(fam, name, Op::FlushChain(c.chain.name.clone()));
        }
    }
    for c in &stale {
        tx.push(fam, name, Op::DeleteChain(c.chain.name.clone()));
    }
    for n in old.sets.keys() {
        if !new.sets.contains_key(n.as_str()) {
            tx.push(fam, name, Op::DeleteSet(n.clone()));
        }
    }
    deferred.iter().map(|c| c.chain.name.clone()).collect()
}

/// Brings every base chain both states have to its desired attachment: a different policy is changed in place
/// (NEWCHAIN on the existing chain), a different type, hook, priority or device cannot be, so the chain is
/// deleted and created again with its rules, inside this same batch (nothing ever sees it missing). Returns
/// the names of the re-created chains.
fn replace_or_update_base_chains<'n>(
    tx: &mut Plan,
    fam: Family,
    table: &str,
    old: &TableState,
    new: &Desired<'n>,
) -> Vec<&'n str> {
    let mut replaced = Vec::new();
    for (n, c) in &new.chains {
        let (Some(o), Some(want)) = (old.chains.get(*n), &c.chain.base) else {
            continue;
        };
        let Some(have) = &o.chain.base else { continue };
        if have == want {
            continue;
        }
        if have.updatable_to(want) {
            tx.push(fam, table, Op::AddChain(c.chain.clone()));
            continue;
        }
        // A base chain is never a jump target, so nothing else needs to change for it to go.
        if !o.rules.is_empty() {
            tx.push(fam, table, Op::FlushChain(n.to_string()));
        }
        tx.push(fam, table, Op::DeleteChain(n.to_string()));
        tx.push(fam, table, Op::AddChain(c.chain.clone()));
        add_rules(tx, fam, table, c);
        replaced.push(*n);
    }
    replaced
}

/// Whether any element or rule of `t` jumps or goes to `chain`.
fn referenced(t: &TableState, chain: &str) -> bool {
    let by_element = t.sets.values().any(|s| {
        s.elements
            .iter()
            .any(|e| matches!(&e.value, Some(ElementValue::Verdict(v)) if v.chain() == Some(chain)))
    });
    let by_rule = t.chains.values().any(|c| {
        c.rules.iter().any(|r| {
            r.exprs
                .iter()
                .any(|e| matches!(e, Expr::Verdict(v) if v.chain() == Some(chain)))
        })
    });
    by_element || by_rule
}

/// Whether `old` can be turned into `new` object by object: every set both have is the same definition (a
/// set in use by rules cannot be altered or swapped alone), and every chain both have is a base chain on both
/// sides or a regular chain on both (base chains are re-created in place; a regular chain may be a jump
/// target, which the kernel does not let go).
fn compatible(old: &TableState, new: &Desired) -> bool {
    new.sets
        .iter()
        .all(|(n, s)| old.sets.get(*n).is_none_or(|o| o.set == *s.set))
        && new.chains.iter().all(|(n, c)| {
            old.chains
                .get(*n)
                .is_none_or(|o| o.chain.base.is_some() == c.chain.base.is_some())
        })
}

/// The sets and base chains of `old` that `new` declares differently.
fn incompatible(old: &TableState, new: &Desired) -> Vec<String> {
    let sets = new
        .sets
        .iter()
        .filter(|(n, s)| old.sets.get(**n).is_some_and(|o| o.set != *s.set))
        .map(|(n, _)| format!("set {n}"));
    let chains = new
        .chains
        .iter()
        .filter(|(n, c)| old.chains.get(**n).is_some_and(|o| o.chain != c.chain))
        .map(|(n, _)| format!("chain {n}"));
    sets.chain(chains).collect()
}

/// `t` is consumed: its element lists move into the plan as they are (at 50k services a copy of them is
/// ~5 MB, at the agent's peak).
fn create_table<'a>(tx: &mut Plan<'a>, t: Desired<'a>) {
    let (fam, name) = (t.family, t.name);
    tx.push(fam, name, Op::AddTable);
    for s in t.sets.values() {
        tx.push(fam, name, Op::AddSet(s.set.clone()));
    }
    for c in t.chains.values() {
        tx.push(fam, name, Op::AddChain(c.chain.clone()));
    }
    for c in t.chains.values() {
        add_rules(tx, fam, name, c);
    }
    // Dispatch elements last (see diff_table).
    let mut sets: Vec<DesiredSet> = t.sets.into_values().collect();
    sets.sort_by_key(|s| (is_dispatch_set(&s.set.name), s.set.name.clone()));
    for s in sets {
        let set = s.set;
        tx.add_elements(fam, name, &set.name, s.into_elements());
    }
}

fn add_rules(tx: &mut Plan, fam: Family, table: &str, c: &ChainState) {
    for r in &c.rules {
        tx.push(
            fam,
            table,
            Op::AddRule {
                chain: c.chain.name.clone(),
                rule: r.clone(),
            },
        );
    }
}
