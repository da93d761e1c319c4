//! Where transactions go: the kernel over netlink, or an in-memory model of it for tests.

use super::ir::{Element, Family, TableState};
use super::netlink::{CommitError, DumpError, NftSocket};
use super::tx::Transaction;

/// Where transactions go: the kernel ([`NftSocket`]) or, in unit tests, an in-memory model of it.
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
    /// The ruleset's generation id, which every commit by anyone changes; None for a backend without one
    /// (which then is always read back in full).
    fn generation(&mut self) -> Result<Option<u32>, DumpError> {
        Ok(None)
    }
    /// Reads several tables as one consistent view (no commit by anyone in between), for a full sync.
    /// Backends that cannot change during a read need nothing more than reading each table.
    fn read_tables(
        &mut self,
        tables: &[(Family, &str)],
    ) -> Result<Vec<Option<TableState>>, DumpError> {
        tables
            .iter()
            .map(|(family, name)| self.read_table(*family, name))
            .collect()
    }
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
    fn read_tables(
        &mut self,
        tables: &[(Family, &str)],
    ) -> Result<Vec<Option<TableState>>, DumpError> {
        NftSocket::read_tables(self, tables)
    }
    fn generation(&mut self) -> Result<Option<u32>, DumpError> {
        Ok(Some(NftSocket::generation(self)?))
    }
}
