//! The nf_tables transport: commits a transaction as one atomic batch and reads tables back.

use super::ir::*;
use super::tx::Transaction;
use super::wire::{self, consts::*};
use crate::netlink::{NetlinkError, NlSocket};
use std::fmt;

/// A rejected transaction: nothing of it was applied. Each error names the object that caused it.
#[derive(Debug)]
pub struct CommitError {
    pub failures: Vec<(Option<String>, NetlinkError)>,
}

impl CommitError {
    /// The first errno, for callers that react to specific errors (EBUSY, ENOENT...).
    pub fn errno(&self) -> Option<i32> {
        self.failures.first().and_then(|(_, e)| e.errno())
    }
}

impl fmt::Display for CommitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nf_tables transaction rejected, nothing applied")?;
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
}

impl NftSocket {
    pub fn open() -> std::io::Result<Self> {
        Ok(NftSocket {
            sock: NlSocket::open(libc::NETLINK_NETFILTER)?,
        })
    }

    /// Applies the transaction atomically. Returns the number of bytes sent.
    pub fn commit(&mut self, tx: &Transaction) -> Result<usize, CommitError> {
        if tx.is_empty() {
            return Ok(0);
        }
        let first = self.sock.reserve_seq(wire::seq_count(tx));
        let batch = wire::encode_batch(tx, first);
        match self.sock.transact(&batch.bytes, batch.ack_seq) {
            Ok(()) => Ok(batch.bytes.len()),
            Err(errors) => Err(CommitError {
                failures: errors
                    .0
                    .into_iter()
                    .map(|e| {
                        let what = match &e {
                            NetlinkError::Kernel { seq, .. } => {
                                batch.change_index(*seq).map(|i| tx.changes[i].to_string())
                            }
                            _ => None,
                        };
                        (what, e)
                    })
                    .collect(),
            }),
        }
    }

    /// The ruleset generation: it changes with every commit by anyone.
    pub fn generation(&mut self) -> Result<u32, NetlinkError> {
        let seq = self.sock.reserve_seq(1);
        // GETGEN is not a dump: the request asks for an ACK, which ends the answer after NEWGEN.
        let msgs = self.sock.dump(&wire::getgen_request(seq))?;
        msgs.iter()
            .find(|(t, _)| *t & 0xff == NFT_MSG_NEWGEN)
            .and_then(|(_, p)| crate::netlink::Attrs(p.get(4..)?).get(NFTA_GEN_ID)?.be32())
            .ok_or_else(|| NetlinkError::Protocol("no generation in answer".into()))
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

    /// Reads one table back (None when it does not exist).
    pub fn dump_table(
        &mut self,
        family: Family,
        name: &str,
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
        for p in self.dump(NFT_MSG_GETSET, family, Some(name), None)? {
            let (t, set, flags) = wire::decode_set(&p)?;
            // Anonymous sets belong to the rule that uses them; we never create them.
            if t == name && flags & SET_F_ANONYMOUS == 0 {
                set_names.push(set.name.clone());
                state.add_set(set);
            }
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
                    c.rules.push(rule);
                }
            }
        }
        Ok(Some(state))
    }

    fn dump(
        &mut self,
        msg: u16,
        family: Family,
        table: Option<&str>,
        set: Option<&str>,
    ) -> Result<Vec<Vec<u8>>, NetlinkError> {
        let seq = self.sock.reserve_seq(1);
        let req = wire::dump_request(msg, family, table, set, seq);
        Ok(self.sock.dump(&req)?.into_iter().map(|(_, p)| p).collect())
    }

    /// The raw socket, for event subscriptions.
    pub fn socket(&mut self) -> &mut NlSocket {
        &mut self.sock
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Decode(#[from] wire::DecodeError),
}
