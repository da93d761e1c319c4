//! The kernel as the record every command reads: reading one network's objects in one family, and planning the
//! changes that bring them to what a command wants. Planning is pure (tested without root).

use super::kernel::Kernel;
use super::netconf::{NetConf, Subnet};
use super::render::{self, Names, Wanted, TABLE};
use nftkube_nft::ir::*;
use nftkube_nft::netlink::DumpError;
use nftkube_nft::tx::{Op, Transaction};
use std::collections::BTreeMap;

/// An element as read back, with its comment.
pub(crate) type Read = (Element, Option<String>);

/// One network's objects in one family's table, as the kernel has them.
#[derive(Debug, Clone, Default)]
pub(crate) struct NetworkView {
    /// The table's chains, rules and set declarations (no elements); None when the table does not exist.
    pub(crate) table: Option<TableState>,
    /// The elements of the network's sets, by set name.
    pub(crate) elements: BTreeMap<String, Vec<Read>>,
}

impl NetworkView {
    fn find(&self, set: &str, key: &[u8]) -> Option<&Read> {
        self.elements
            .get(set)?
            .iter()
            .find(|(e, _)| e.key.as_slice() == key)
    }
}

/// Reads the network's objects: the table's structure and the elements of the network's own sets only.
pub(crate) fn read(
    kernel: &mut impl Kernel,
    family: Family,
    names: &Names,
) -> Result<NetworkView, DumpError> {
    let table = kernel.structure(family, TABLE)?;
    let mut elements = BTreeMap::new();
    if let Some(t) = &table {
        for set in names.element_sets() {
            if t.sets.contains_key(set) {
                elements.insert(set.to_owned(), kernel.commented(family, TABLE, set)?);
            }
        }
    }
    Ok(NetworkView { table, elements })
}

/// Adds to `tx` what makes the network's table, sets and chains what `conf` asks for. Chains whose rules
/// differ are replaced within the batch (flush and refill in one transaction: no packet sees them empty).
/// Every message is idempotent (NEWTABLE, NEWSET and NEWCHAIN without NLM_F_EXCL; a flush before the rules),
/// so two invocations that both found the network missing leave one copy of it.
pub(crate) fn ensure_structure(
    tx: &mut Transaction,
    family: Family,
    view: &NetworkView,
    names: &Names,
    conf: &NetConf,
    subnet: Option<Subnet>,
) {
    let empty = TableState::new(family, TABLE);
    let table = match &view.table {
        Some(t) => t,
        None => {
            tx.push(family, TABLE, Op::AddTable);
            &empty
        }
    };
    for set in render::sets(family, names) {
        if table.sets.get(&set.name).map(|s| &s.set) != Some(&set) {
            tx.push(family, TABLE, Op::AddSet(set));
        }
    }
    let wanted = render::chains(family, names, conf, &subnets(table, names, subnet));
    let stale: Vec<&ChainState> = wanted
        .iter()
        .filter(|c| table.chains.get(&c.chain.name) != Some(*c))
        .collect();
    for c in &stale {
        tx.push(family, TABLE, Op::AddChain(c.chain.clone()));
    }
    for c in stale {
        // Also when the chain was absent: a concurrent invocation may create it between our read and our
        // commit, and its rules must not end up in the chain twice.
        tx.push(family, TABLE, Op::FlushChain(c.chain.name.clone()));
        for rule in &c.rules {
            tx.push(
                family,
                TABLE,
                Op::AddRule {
                    chain: c.chain.name.clone(),
                    rule: rule.clone(),
                },
            );
        }
    }
}

/// The container subnets the network's hairpin rules cover: those its chain has, and `new`.
fn subnets(table: &TableState, names: &Names, new: Option<Subnet>) -> Vec<Subnet> {
    let mut all = render::known_subnets(table.chains.get(&names.post));
    all.extend(new);
    all.sort();
    all.dedup();
    all
}

/// What a plan removed: (set, element) pairs, to clean conntrack after the commit.
pub(crate) type Removed = Vec<(String, Element)>;

/// Adds to `tx` what makes the attachment `owner` hold exactly `wanted` in the network's sets: missing
/// elements are added, elements of the same key held by someone else (a port taken over) are replaced, and
/// the owner's elements that are no longer wanted are removed.
pub(crate) fn converge(
    tx: &mut Transaction,
    family: Family,
    view: &NetworkView,
    names: &Names,
    wanted: &[Wanted],
    owner: &str,
) -> Removed {
    let mut removed = Vec::new();
    let mut adds: BTreeMap<&str, Vec<CommentedElement>> = BTreeMap::new();
    for w in wanted {
        match view.find(&w.set, &w.element.element.key) {
            Some((e, Some(c))) if *e == w.element.element && c == owner => continue,
            Some((e, _)) => removed.push((w.set.clone(), e.clone())),
            None => {}
        }
        adds.entry(&w.set).or_default().push(w.element.clone());
    }
    for set in names.element_sets() {
        for (e, c) in view.elements.get(set).into_iter().flatten() {
            let still_wanted = wanted
                .iter()
                .any(|w| w.set == set && w.element.element.key == e.key);
            if c.as_deref() == Some(owner) && !still_wanted {
                removed.push((set.to_owned(), e.clone()));
            }
        }
    }
    push_deletes(tx, family, &removed);
    for (set, elements) in adds {
        tx.push(
            family,
            TABLE,
            Op::AddCommentedElements {
                set: set.to_owned(),
                elements,
            },
        );
    }
    removed
}

/// Adds to `tx` the removal of every element of the network's sets whose comment `doomed` selects.
pub(crate) fn remove_where(
    tx: &mut Transaction,
    family: Family,
    view: &NetworkView,
    names: &Names,
    doomed: impl Fn(Option<&str>) -> bool,
) -> Removed {
    let mut removed = Vec::new();
    for set in names.element_sets() {
        for (e, c) in view.elements.get(set).into_iter().flatten() {
            if doomed(c.as_deref()) {
                removed.push((set.to_owned(), e.clone()));
            }
        }
    }
    push_deletes(tx, family, &removed);
    removed
}

fn push_deletes(tx: &mut Transaction, family: Family, removed: &Removed) {
    let mut by_set: BTreeMap<&str, Vec<Element>> = BTreeMap::new();
    for (set, e) in removed {
        by_set.entry(set).or_default().push(e.clone());
    }
    for (set, elements) in by_set {
        tx.push(
            family,
            TABLE,
            Op::DeleteElements {
                set: set.to_owned(),
                elements,
            },
        );
    }
}

/// What CHECK finds wrong, in words; empty when the kernel holds everything `wanted` asks for.
pub(crate) fn differences(
    family: Family,
    view: &NetworkView,
    names: &Names,
    conf: &NetConf,
    subnet: Option<Subnet>,
    wanted: &[Wanted],
    owner: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    let where_ = |what: &str| format!("{what} of table {} {TABLE}", family.as_str());
    let Some(table) = &view.table else {
        if !wanted.is_empty() {
            out.push(format!("table {} {TABLE} is missing", family.as_str()));
        }
        return out;
    };
    if !wanted.is_empty() {
        for c in render::chains(family, names, conf, &subnets(table, names, subnet)) {
            match table.chains.get(&c.chain.name) {
                None => out.push(format!(
                    "{} is missing",
                    where_(&format!("chain {}", c.chain.name))
                )),
                Some(have) if *have != c => out.push(format!(
                    "{} differs",
                    where_(&format!("chain {}", c.chain.name))
                )),
                Some(_) => {}
            }
        }
    }
    for w in wanted {
        let what = || where_(&format!("an element of set {}", w.set));
        match view.find(&w.set, &w.element.element.key) {
            None => out.push(format!("{} is missing", what())),
            Some((e, _)) if *e != w.element.element => {
                out.push(format!("{} maps elsewhere", what()))
            }
            Some((_, c)) if c.as_deref() != Some(owner) => out.push(format!(
                "{} belongs to {:?}",
                what(),
                c.as_deref().unwrap_or("nobody")
            )),
            Some(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netconf::{self, PortMapping, Protocol};

    fn conf() -> NetConf {
        netconf::parse(br#"{"cniVersion": "1.1.0", "name": "n1"}"#).unwrap()
    }

    fn subnet() -> Option<Subnet> {
        Subnet::parse("10.0.0.0/24")
    }

    fn wanted(names: &Names, port: u16, ip: &str, owner: &str) -> Vec<Wanted> {
        let m = PortMapping {
            host_port: port,
            container_port: 80,
            protocol: Protocol::Tcp,
            host_ip: None,
            any_of: None,
        };
        render::elements(Family::Ip, names, &[m], ip.parse().unwrap(), owner)
    }

    /// The view a kernel would show after `tx` was applied to `view`.
    fn apply(view: &mut NetworkView, tx: &Transaction) {
        for c in &tx.changes {
            let t = view
                .table
                .get_or_insert_with(|| TableState::new(Family::Ip, TABLE));
            match &c.op {
                Op::AddSet(s) => {
                    t.add_set(s.clone());
                }
                Op::AddChain(ch) => {
                    t.add_chain(ch.clone());
                }
                Op::FlushChain(chain) => t.chain_mut(chain).rules.clear(),
                Op::AddRule { chain, rule } => t.chain_mut(chain).rules.push(rule.clone()),
                Op::AddCommentedElements { set, elements } => {
                    view.elements.entry(set.clone()).or_default().extend(
                        elements
                            .iter()
                            .map(|e| (e.element.clone(), Some(e.comment.clone()))),
                    )
                }
                Op::DeleteElements { set, elements } => {
                    if let Some(have) = view.elements.get_mut(set) {
                        have.retain(|(e, _)| !elements.contains(e));
                    }
                }
                _ => {}
            }
        }
    }

    fn applied(tx: &Transaction) -> NetworkView {
        let mut view = NetworkView::default();
        apply(&mut view, tx);
        view
    }

    fn applied_on(mut view: NetworkView, tx: &Transaction) -> NetworkView {
        apply(&mut view, tx);
        view
    }

    #[test]
    fn add_is_idempotent_and_del_removes_only_the_owner() {
        let names = Names::of("n1");
        let mut tx = Transaction::default();
        ensure_structure(
            &mut tx,
            Family::Ip,
            &NetworkView::default(),
            &names,
            &conf(),
            subnet(),
        );
        let a = wanted(&names, 8080, "10.0.0.2", "a eth0");
        converge(
            &mut tx,
            Family::Ip,
            &NetworkView::default(),
            &names,
            &a,
            "a eth0",
        );
        let b = wanted(&names, 9090, "10.0.0.3", "b eth0");
        converge(
            &mut tx,
            Family::Ip,
            &NetworkView::default(),
            &names,
            &b,
            "b eth0",
        );
        let view = applied(&tx);

        let mut again = Transaction::default();
        ensure_structure(&mut again, Family::Ip, &view, &names, &conf(), subnet());
        converge(&mut again, Family::Ip, &view, &names, &a, "a eth0");
        assert!(again.is_empty(), "{again:#?}");
        assert!(differences(Family::Ip, &view, &names, &conf(), subnet(), &a, "a eth0").is_empty());

        let mut del = Transaction::default();
        let removed = remove_where(&mut del, Family::Ip, &view, &names, |c| c == Some("a eth0"));
        assert_eq!(removed.len(), 2, "a's ports and targets elements");
        let after = applied_on(view, &del);
        assert!(
            !differences(Family::Ip, &after, &names, &conf(), subnet(), &a, "a eth0").is_empty()
        );
        assert!(
            differences(Family::Ip, &after, &names, &conf(), subnet(), &b, "b eth0").is_empty()
        );
    }

    #[test]
    fn a_taken_over_port_is_replaced() {
        let names = Names::of("n1");
        let mut tx = Transaction::default();
        let a = wanted(&names, 8080, "10.0.0.2", "a eth0");
        converge(
            &mut tx,
            Family::Ip,
            &NetworkView::default(),
            &names,
            &a,
            "a eth0",
        );
        let view = applied(&tx);
        let b = wanted(&names, 8080, "10.0.0.3", "b eth0");
        let mut take = Transaction::default();
        let removed = converge(&mut take, Family::Ip, &view, &names, &b, "b eth0");
        assert_eq!(removed.len(), 1, "the old ports element, replaced");
        let after = applied_on(view, &take);
        assert!(
            differences(Family::Ip, &after, &names, &conf(), subnet(), &b, "b eth0")
                .iter()
                .all(|d| d.contains("chain"))
        );
    }
}
