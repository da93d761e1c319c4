//! What the commands need of nf_tables, as a trait: the kernel over netlink in the binary, the in-memory fake
//! in unit tests (which can commit a competing batch between a command's read and its commit).

use super::state::Read;
use nftkube_nft::ir::{Family, TableState};
use nftkube_nft::netlink::{CommitError, DumpError, NftSocket};
use nftkube_nft::tx::Transaction;

/// The reads and the generation-checked commit of one command.
pub(crate) trait Kernel {
    /// The ruleset generation, read before the state a batch is planned from.
    fn generation(&mut self) -> Result<u32, DumpError>;
    /// A table's chains, rules and set declarations, without elements; None when it does not exist.
    fn structure(&mut self, family: Family, table: &str) -> Result<Option<TableState>, DumpError>;
    /// One set's elements with their comments.
    fn commented(&mut self, family: Family, table: &str, set: &str)
        -> Result<Vec<Read>, DumpError>;
    /// Applies `tx` only if the ruleset is still at `generation` (ERESTART, nothing applied, otherwise).
    fn commit_at(&mut self, tx: &Transaction, generation: u32) -> Result<usize, CommitError>;
}

impl Kernel for NftSocket {
    fn generation(&mut self) -> Result<u32, DumpError> {
        Ok(NftSocket::generation(self)?)
    }
    fn structure(&mut self, family: Family, table: &str) -> Result<Option<TableState>, DumpError> {
        self.dump_table_structure(family, table)
    }
    fn commented(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Read>, DumpError> {
        self.dump_set_commented(family, table, set)
    }
    fn commit_at(&mut self, tx: &Transaction, generation: u32) -> Result<usize, CommitError> {
        NftSocket::commit_at(self, tx, generation)
    }
}

#[cfg(test)]
impl Kernel for nftkube_nft::fake::FakeKernel {
    fn generation(&mut self) -> Result<u32, DumpError> {
        Ok(self.generation)
    }
    fn structure(&mut self, family: Family, table: &str) -> Result<Option<TableState>, DumpError> {
        let mut t = self.tables.get(&(family, table.to_owned())).cloned();
        for s in t.iter_mut().flat_map(|t| t.sets.values_mut()) {
            s.elements.clear();
        }
        Ok(t)
    }
    fn commented(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Read>, DumpError> {
        Ok(self.read_set_commented(family, table, set))
    }
    fn commit_at(&mut self, tx: &Transaction, generation: u32) -> Result<usize, CommitError> {
        nftkube_nft::fake::FakeKernel::commit_at(self, tx, generation)
    }
}
