//! The nf_tables transport: commits a transaction as one atomic batch and reads tables back.

use super::ir::*;
use super::tx::Transaction;
use super::wire::{self, consts::*};
use nftkube_netlink::{Expect, NetlinkError, NlSocket};
use std::fmt;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

/// Reads of our tables before giving up on one that is not changed by someone else meanwhile.
pub(crate) const READ_ATTEMPTS: u32 = 6;

/// A rejected transaction: nothing of it was applied. Each error names the object that caused it.
#[derive(Debug)]
pub struct CommitError {
    /// Each refused object (its description, when the failing message could be traced to one) and the error.
    pub failures: Vec<(Option<String>, NetlinkError)>,
}

impl CommitError {
    /// The first errno, for callers that react to specific errors (EBUSY, ENOENT...).
    pub fn errno(&self) -> Option<i32> {
        self.failures.first().and_then(|(_, e)| e.errno())
    }

    /// Whether the kernel refused the batch for what it holds (a value out of range, a name too long, a
    /// message we could not encode), so that the same objects will be refused again; not because its state
    /// is not what we thought (a missing or busy object, a generation that moved: someone else changed it,
    /// and a full sync reads it back), nor because the exchange broke off.
    pub fn refuses_content(&self) -> bool {
        const STATE_OR_TRANSIENT: [i32; 7] = [
            libc::ENOENT,
            libc::EBUSY,
            libc::EAGAIN,
            libc::ENOMEM,
            libc::ENOBUFS,
            libc::EINTR,
            libc::ERESTART,
        ];
        !self.outcome_unknown()
            && self
                .failures
                .iter()
                .all(|(_, e)| !e.errno().is_some_and(|n| STATE_OR_TRANSIENT.contains(&n)))
    }

    /// Whether the exchange broke off, so the kernel may or may not have applied the transaction.
    pub fn outcome_unknown(&self) -> bool {
        self.failures.iter().any(|(_, e)| e.breaks_socket())
    }

    fn one(what: Option<String>, e: NetlinkError) -> Self {
        CommitError {
            failures: vec![(what, e)],
        }
    }
}

impl fmt::Display for CommitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.outcome_unknown() {
            // The next full sync reads the kernel back, whatever happened.
            write!(f, "nf_tables transaction failed, outcome unknown")?;
        } else {
            write!(f, "nf_tables transaction rejected, nothing applied")?;
        }
        // Later errors are mostly consequences of the first ones (a set that was refused, then every
        // element and rule naming it); show the first few.
        const SHOWN: usize = 3;
        for (what, e) in self.failures.iter().take(SHOWN) {
            match what {
                Some(w) => write!(f, "; {w}: {e}")?,
                None => write!(f, "; {e}")?,
            }
        }
        if self.failures.len() > SHOWN {
            write!(f, "; and {} more", self.failures.len() - SHOWN)?;
        }
        Ok(())
    }
}

impl std::error::Error for CommitError {}

/// A netlink socket speaking nf_tables, bound to the namespace of the thread that opened it.
pub struct NftSocket {
    sock: NlSocket,
    /// Reads of `read_tables` repeated because the ruleset changed meanwhile, since open.
    reread: u64,
}

impl NftSocket {
    /// An nf_tables socket in the calling thread's network namespace.
    pub fn open() -> std::io::Result<Self> {
        Ok(NftSocket {
            sock: NlSocket::open(libc::NETLINK_NETFILTER)?,
            reread: 0,
        })
    }

    /// Applies the transaction atomically. Returns the number of bytes sent.
    pub fn commit(&mut self, tx: &Transaction) -> Result<usize, CommitError> {
        self.send_batch(tx, None)
    }

    /// Applies the transaction atomically if the ruleset is still at `generation` (as [`Self::generation`]
    /// read it before the state the transaction was planned from): when anyone committed since, the kernel
    /// refuses the whole batch with ERESTART and nothing of it is applied. For read-plan-commit cycles whose
    /// plan is only right for what they read, such as deleting elements chosen by their comment: deletion is
    /// by key, and the key may meanwhile belong to someone else.
    pub fn commit_at(&mut self, tx: &Transaction, generation: u32) -> Result<usize, CommitError> {
        self.send_batch(tx, Some(generation))
    }

    fn send_batch(
        &mut self,
        tx: &Transaction,
        generation: Option<u32>,
    ) -> Result<usize, CommitError> {
        if tx.is_empty() {
            return Ok(0);
        }
        let n = wire::seq_count(tx);
        let first = self.sock.reserve_seq(n);
        let batch = wire::encode_batch_at(tx, first, generation)
            .map_err(|e| CommitError::one(None, e.into()))?;
        let expect = Expect::Acks {
            first,
            last: first.wrapping_add(n - 1),
            ack: batch.ack_seq,
            batch_begin: Some(first),
        };
        let refused = self
            .sock
            .transact("nf_tables batch", &batch.bytes, expect)
            .map_err(|e| CommitError::one(None, e))?;
        if refused.is_empty() {
            return Ok(batch.bytes.len());
        }
        Err(CommitError {
            failures: refused
                .into_iter()
                .map(|e| (Self::object_of(tx, &batch, &e), e))
                .collect(),
        })
    }

    /// The change a kernel error names, by its message's sequence number.
    fn object_of(tx: &Transaction, batch: &wire::EncodedBatch, e: &NetlinkError) -> Option<String> {
        match e {
            NetlinkError::Kernel { seq, .. } => {
                batch.change_index(*seq).map(|i| tx.changes[i].to_string())
            }
            _ => None,
        }
    }

    /// The ruleset generation: it changes with every commit by anyone.
    pub fn generation(&mut self) -> Result<u32, NetlinkError> {
        let seq = self.sock.reserve_seq(1);
        // GETGEN is not a dump: the request asks for an ACK, which ends the answer after NEWGEN.
        let msgs = self
            .sock
            .dump_as("nf_tables GETGEN", &wire::getgen_request(seq)?)?;
        msgs.iter()
            .find(|(t, _)| *t & 0xff == NFT_MSG_NEWGEN)
            .and_then(|(_, p)| nftkube_netlink::Attrs(p.get(4..)?).get(NFTA_GEN_ID)?.be32())
            .ok_or_else(|| NetlinkError::Protocol {
                request: nftkube_netlink::Request {
                    what: "nf_tables GETGEN".into(),
                    seq,
                },
                detail: "no generation in the answer".into(),
            })
    }

    /// Reads several tables as one consistent view: the ruleset generation is read before and after, and
    /// the read is repeated (up to `READ_ATTEMPTS` times) when anyone committed in between, since the
    /// separate dumps could then mix states from before and after that commit.
    pub fn read_tables(
        &mut self,
        tables: &[(Family, &str)],
    ) -> Result<Vec<Option<TableState>>, DumpError> {
        for attempt in 1..=READ_ATTEMPTS {
            let before = self.generation()?;
            let states = tables
                .iter()
                .map(|(family, name)| self.dump_table(*family, name))
                .collect::<Result<Vec<_>, _>>()?;
            let after = self.generation()?;
            if before == after {
                return Ok(states);
            }
            self.reread += 1;
            tracing::debug!(
                attempt,
                before,
                after,
                "the ruleset changed while our tables were read; reading again"
            );
        }
        Err(DumpError::Unstable {
            attempts: READ_ATTEMPTS,
        })
    }

    /// How many reads `read_tables` had to repeat because someone committed during them.
    pub fn rereads(&self) -> u64 {
        self.reread
    }

    /// The names of every table of `family`, ours and everyone else's.
    pub fn list_tables(&mut self, family: Family) -> Result<Vec<String>, DumpError> {
        let mut names = Vec::new();
        for p in self.dump(NFT_MSG_GETTABLE, family, None, None)? {
            let (f, n) = wire::decode_table(&p)?;
            if f == family {
                names.push(n);
            }
        }
        Ok(names)
    }

    /// Reads one table back (None when it does not exist). Its parts come from separate dumps: for a view
    /// that no concurrent commit can tear, use `read_tables`.
    pub fn dump_table(
        &mut self,
        family: Family,
        name: &str,
    ) -> Result<Option<TableState>, DumpError> {
        self.dump_table_with(family, name, true)
    }

    /// The rules of one table with their kernel handles, as (chain, handle, rule): what trace events refer to.
    pub fn rules_with_handles(
        &mut self,
        family: Family,
        table: &str,
    ) -> Result<Vec<(String, u64, Rule)>, DumpError> {
        let mut out = Vec::new();
        for p in self.dump(NFT_MSG_GETRULE, family, Some(table), None)? {
            let (t, chain, rule) = wire::decode_rule(&p)?;
            if t == table {
                out.push((chain, wire::decode_rule_handle(&p)?, rule));
            }
        }
        Ok(out)
    }

    /// The chains of one table, anyone's, without their rules.
    pub fn list_chains(&mut self, family: Family, table: &str) -> Result<Vec<Chain>, DumpError> {
        let mut out = Vec::new();
        for p in self.dump(NFT_MSG_GETCHAIN, family, Some(table), None)? {
            let (t, chain) = wire::decode_chain(&p)?;
            if t == table {
                out.push(chain);
            }
        }
        Ok(out)
    }

    /// The rules of one table, anyone's, in outline: enough to delete some by handle (see
    /// [`wire::RuleOutline`]).
    pub fn rule_outlines(
        &mut self,
        family: Family,
        table: &str,
    ) -> Result<Vec<wire::RuleOutline>, DumpError> {
        let mut out = Vec::new();
        for p in self.dump(NFT_MSG_GETRULE, family, Some(table), None)? {
            let (t, rule) = wire::decode_rule_outline(&p)?;
            if t == table {
                out.push(rule);
            }
        }
        Ok(out)
    }

    /// The chains the sets and maps of one table (anyone's, anonymous ones too) jump or go to from their
    /// elements, as (set, chain): references to chains that rules in outline do not show.
    pub fn set_verdict_targets(
        &mut self,
        family: Family,
        table: &str,
    ) -> Result<Vec<(String, String)>, DumpError> {
        let mut sets = Vec::new();
        for p in self.dump(NFT_MSG_GETSET, family, Some(table), None)? {
            let (t, set, _) = wire::decode_set(&p)?;
            if t == table {
                sets.push(set.name);
            }
        }
        let mut out = Vec::new();
        for set in sets {
            for element in self.dump_set(family, table, &set)? {
                if let Some(ElementValue::Verdict(v)) = &element.value {
                    out.extend(v.chain().map(|c| (set.clone(), c.to_owned())));
                }
            }
        }
        Ok(out)
    }

    /// Reads one table's chains, rules and set declarations, without the sets' elements: a read whose cost
    /// does not grow with the elements (the portmap plugin reads its elements by owner, set by set).
    pub fn dump_table_structure(
        &mut self,
        family: Family,
        name: &str,
    ) -> Result<Option<TableState>, DumpError> {
        self.dump_table_with(family, name, false)
    }

    fn dump_table_with(
        &mut self,
        family: Family,
        name: &str,
        with_elements: bool,
    ) -> Result<Option<TableState>, DumpError> {
        let tables = self.dump(NFT_MSG_GETTABLE, family, None, None)?;
        let mut found = None;
        for p in &tables {
            let (f, n) = wire::decode_table(p)?;
            if f == family && n == name {
                found = Some(wire::decode_table_flags(p)?);
            }
        }
        let Some(flags) = found else {
            return Ok(None);
        };
        let mut state = TableState::new(family, name);
        state.flags = flags;
        for p in self.dump(NFT_MSG_GETCHAIN, family, Some(name), None)? {
            let (t, chain) = wire::decode_chain(&p)?;
            if t == name {
                state.add_chain(chain);
            }
        }
        let mut set_names = Vec::new();
        let mut anonymous = Vec::new();
        for p in self.dump(NFT_MSG_GETSET, family, Some(name), None)? {
            let (t, set, flags) = wire::decode_set(&p)?;
            // Anonymous sets belong to the rule that uses them: read with it (`resolve_anonymous_sets`).
            if t == name && flags & NFT_SET_ANONYMOUS != 0 {
                anonymous.push(set);
            } else if t == name {
                set_names.push(set.name.clone());
                state.add_set(set);
            }
        }
        let anonymous = self.anonymous_sets(family, name, anonymous)?;
        if !with_elements {
            set_names.clear();
        }
        for set in set_names {
            for p in self.dump(NFT_MSG_GETSETELEM, family, Some(name), Some(&set))? {
                let (t, s, elements) = wire::decode_elements(&p)?;
                if t == name && s == set {
                    state.set_mut(&set).elements.extend(elements);
                }
            }
        }
        for p in self.dump(NFT_MSG_GETRULE, family, Some(name), None)? {
            let (t, chain, rule) = wire::decode_rule(&p)?;
            if t == name {
                if let Some(c) = state.chains.get_mut(&chain) {
                    c.rules.push(resolve_anonymous_sets(rule, &anonymous));
                }
            }
        }
        Ok(Some(state))
    }

    /// The elements of one set.
    pub fn dump_set(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Element>, DumpError> {
        let mut out = Vec::new();
        for p in self.dump(NFT_MSG_GETSETELEM, family, Some(table), Some(set))? {
            let (t, s, elements) = wire::decode_elements(&p)?;
            if t == table && s == set {
                out.extend(elements);
            }
        }
        Ok(out)
    }

    /// The elements of one set, each with its comment (element user data) if it has one.
    pub fn dump_set_commented(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<(Element, Option<String>)>, DumpError> {
        let mut out = Vec::new();
        for p in self.dump(NFT_MSG_GETSETELEM, family, Some(table), Some(set))? {
            let (t, s, elements) = wire::decode_commented_elements(&p)?;
            if t == table && s == set {
                out.extend(elements);
            }
        }
        Ok(out)
    }

    /// The content of each anonymous set, by the name the kernel gave it (`__set3`).
    fn anonymous_sets(
        &mut self,
        family: Family,
        table: &str,
        sets: Vec<Set>,
    ) -> Result<std::collections::HashMap<String, AnonSet>, DumpError> {
        let mut out = std::collections::HashMap::new();
        for set in sets {
            let mut elements = Vec::new();
            for p in self.dump(NFT_MSG_GETSETELEM, family, Some(table), Some(&set.name))? {
                let (_, _, found) = wire::decode_elements(&p)?;
                elements.extend(found.into_iter().map(|e| e.key));
            }
            elements.sort();
            let (Some(&key), Some(&[key_typeof])) = (set.key.first(), set.key_typeof.as_deref())
            else {
                continue; // not one nftkube writes: the rule keeps naming it, and so differs from ours
            };
            let content = AnonSet {
                key,
                key_typeof,
                elements,
            };
            out.insert(set.name, content);
        }
        Ok(out)
    }

    fn dump(
        &mut self,
        msg: u16,
        family: Family,
        table: Option<&str>,
        set: Option<&str>,
    ) -> Result<Vec<Vec<u8>>, NetlinkError> {
        let seq = self.sock.reserve_seq(1);
        let req = wire::dump_request(msg, family, table, set, seq)?;
        let what = format!(
            "nf_tables dump {} {} {}{}",
            dump_kind(msg),
            family.as_str(),
            table.unwrap_or("*"),
            set.map(|s| format!(" set {s}")).unwrap_or_default()
        );
        Ok(self
            .sock
            .dump_as(&what, &req)?
            .into_iter()
            .map(|(_, p)| p)
            .collect())
    }

    /// The port id our commits carry, kept current when the socket is replaced: the event monitor ignores
    /// events with it.
    pub fn port_handle(&self) -> Arc<AtomicU32> {
        self.sock.port_handle()
    }
}

/// A rule read back with its anonymous sets' contents in place of their kernel-chosen names, so it compares
/// equal to the rule we wrote.
fn resolve_anonymous_sets(
    mut rule: Rule,
    sets: &std::collections::HashMap<String, AnonSet>,
) -> Rule {
    for e in &mut rule.exprs {
        if let Expr::Lookup {
            set,
            sreg,
            dreg: None,
            invert: false,
        } = e
        {
            if let Some(content) = sets.get(set.as_str()) {
                *e = Expr::LookupAnon {
                    set: content.clone(),
                    sreg: *sreg,
                };
            }
        }
    }
    rule
}

fn dump_kind(msg: u16) -> &'static str {
    match msg {
        NFT_MSG_GETTABLE => "tables",
        NFT_MSG_GETCHAIN => "chains",
        NFT_MSG_GETSET => "sets",
        NFT_MSG_GETSETELEM => "elements",
        NFT_MSG_GETRULE => "rules",
        _ => "objects",
    }
}

#[derive(Debug, thiserror::Error)]
/// Why our tables could not be read back.
pub enum DumpError {
    #[error(transparent)]
    /// The dump failed.
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    /// An answer did not decode.
    Decode(#[from] wire::DecodeError),
    /// Someone kept committing while we read: no consistent view was had.
    #[error("the ruleset changed during each of {attempts} reads of our tables")]
    Unstable {
        /// How many reads were tried.
        attempts: u32,
    },
}

impl From<nftkube_netlink::LengthError> for DumpError {
    fn from(e: nftkube_netlink::LengthError) -> Self {
        DumpError::Netlink(e.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tx::Op;

    #[test]
    fn an_attribute_too_long_fails_the_commit_before_anything_is_sent() {
        let mut s = NftSocket::open().expect("netlink socket");
        let mut tx = Transaction::default();
        let huge = Element {
            key: vec![0u8; 70_000].into(),
            value: None,
        };
        tx.push(
            Family::Ip,
            "nftkube",
            Op::AddElements {
                set: "s".into(),
                elements: vec![huge],
            },
        );
        let e = s.commit(&tx).unwrap_err();
        assert!(
            matches!(
                e.failures.as_slice(),
                [(
                    None,
                    NetlinkError::Length(nftkube_netlink::LengthError::Attribute { .. })
                )]
            ),
            "{e:?}"
        );
        assert!(!e.outcome_unknown(), "nothing was sent: {e}");
    }
}
