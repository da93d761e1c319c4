//! Where transactions go: the kernel over netlink, or an in-memory model of it for tests.

use super::ir::{Element, Family, TableState};
use super::netlink::{CommitError, DumpError, NftSocket};
use super::tx::Transaction;

pub trait Backend {
    /// Applies the transaction atomically; returns the bytes sent.
    fn commit(&mut self, tx: &Transaction) -> Result<usize, CommitError>;
    /// Reads a table back; None when it does not exist.
    fn read_table(&mut self, family: Family, name: &str) -> Result<Option<TableState>, DumpError>;
    /// Reads the elements of one set (those the packet path added too).
    fn read_set(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Element>, DumpError>;
}

impl Backend for NftSocket {
    fn commit(&mut self, tx: &Transaction) -> Result<usize, CommitError> {
        NftSocket::commit(self, tx)
    }
    fn read_table(&mut self, family: Family, name: &str) -> Result<Option<TableState>, DumpError> {
        self.dump_table(family, name)
    }
    fn read_set(
        &mut self,
        family: Family,
        table: &str,
        set: &str,
    ) -> Result<Vec<Element>, DumpError> {
        self.dump_set(family, table, set)
    }
}
