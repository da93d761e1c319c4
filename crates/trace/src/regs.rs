//! The kernel's register file as the trace evaluator models it: 16 four-byte slots (NFT_REG_1..4 overlap
//! NFT_REG32_00..15), each remembering what was loaded into it so that a failed comparison can say what it
//! compared. A `numgen` result stays undecided (`Random`) until an expression reads it: only then is it known
//! which of its values make a difference (`super::decide`).

use super::TraceError;
use nftkube_nft::ir::{reg_slot, DataType};

const SLOTS: usize = 16;

/// What a slot holds: the expression that loaded it (`ip saddr`, `numgen random mod 2`) and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Label {
    pub name: String,
    pub(crate) ty: DataType,
}

/// An undecided `numgen random mod modulus offset offset` in a 4-byte slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Random {
    pub modulus: u32,
    pub(crate) offset: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Regs {
    data: [u8; SLOTS * 4],
    labels: [Option<Label>; SLOTS],
    random: [Option<Random>; SLOTS],
}

impl Default for Regs {
    fn default() -> Self {
        Regs {
            data: [0; SLOTS * 4],
            labels: Default::default(),
            random: [None; SLOTS],
        }
    }
}

fn start(reg: u32, len: usize) -> Result<usize, TraceError> {
    let slot = reg_slot(reg).ok_or_else(|| TraceError::Unsupported(format!("register {reg}")))?;
    let start = slot as usize * 4;
    if start + len > SLOTS * 4 {
        return Err(TraceError::Unsupported(format!(
            "{len} bytes from register {reg} run past the register file"
        )));
    }
    Ok(start)
}

impl Regs {
    /// Stores `bytes` at `reg`, zero-padding the last 4-byte word as the kernel does.
    pub(crate) fn write(
        &mut self,
        reg: u32,
        bytes: &[u8],
        label: Option<Label>,
    ) -> Result<(), TraceError> {
        let padded = nftkube_netlink::align4(bytes.len());
        let at = start(reg, padded)?;
        self.data[at..at + padded].fill(0);
        self.data[at..at + bytes.len()].copy_from_slice(bytes);
        for slot in at / 4..(at + padded) / 4 {
            self.labels[slot] = None;
            self.random[slot] = None;
        }
        self.labels[at / 4] = label;
        Ok(())
    }

    /// Marks the slot at `reg` as holding an undecided random value.
    pub(crate) fn write_random(
        &mut self,
        reg: u32,
        r: Random,
        label: Label,
    ) -> Result<(), TraceError> {
        self.write(reg, &[0; 4], Some(label))?;
        let at = start(reg, 4)?;
        self.random[at / 4] = Some(r);
        Ok(())
    }

    /// The first undecided slot among the `len` bytes at `reg`: (slot, what it holds).
    pub(crate) fn random_in(&self, reg: u32, len: usize) -> Option<(usize, Random)> {
        let at = start(reg, len).ok()?;
        (at / 4..(at + len).div_ceil(4)).find_map(|slot| self.random[slot].map(|r| (slot, r)))
    }

    /// How many undecided slots the `len` bytes at `reg` hold.
    pub(crate) fn randoms_in(&self, reg: u32, len: usize) -> usize {
        match start(reg, len) {
            Ok(at) => (at / 4..(at + len).div_ceil(4))
                .filter(|s| self.random[*s].is_some())
                .count(),
            Err(_) => 0,
        }
    }

    /// The `len` bytes at `reg` as they would be with `slot` holding `value`.
    pub(crate) fn read_with(
        &self,
        reg: u32,
        len: usize,
        slot: usize,
        value: u32,
    ) -> Result<Vec<u8>, TraceError> {
        let at = start(reg, len)?;
        let mut data = self.data;
        data[slot * 4..slot * 4 + 4].copy_from_slice(&value.to_ne_bytes());
        Ok(data[at..at + len].to_vec())
    }

    /// Decides an undecided slot.
    pub(crate) fn fix(&mut self, slot: usize, value: u32) {
        self.data[slot * 4..slot * 4 + 4].copy_from_slice(&value.to_ne_bytes());
        self.random[slot] = None;
    }

    /// The `len` bytes at `reg`. Undecided slots must have been decided first (`super::decide`).
    pub(crate) fn read(&self, reg: u32, len: usize) -> Result<&[u8], TraceError> {
        if self.random_in(reg, len).is_some() {
            return Err(TraceError::Unsupported(format!(
                "a read of an undecided numgen value in register {reg}"
            )));
        }
        let at = start(reg, len)?;
        Ok(&self.data[at..at + len])
    }

    /// What the slot at `reg` was loaded from, if known.
    pub(crate) fn label(&self, reg: u32) -> Option<&Label> {
        let slot = reg_slot(reg)? as usize;
        self.labels.get(slot)?.as_ref()
    }
}
