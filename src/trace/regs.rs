//! The kernel's register file as the trace evaluator models it: 16 four-byte slots (NFT_REG_1..4 overlap
//! NFT_REG32_00..15), each remembering what was loaded into it so that a failed comparison can say what it
//! compared.

use super::TraceError;
use crate::nft::ir::{reg_slot, DataType};

const SLOTS: usize = 16;

/// What a slot holds: the expression that loaded it (`ip saddr`, `numgen random mod 2`) and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub name: String,
    pub ty: DataType,
}

#[derive(Debug, Clone)]
pub struct Regs {
    data: [u8; SLOTS * 4],
    labels: [Option<Label>; SLOTS],
}

impl Default for Regs {
    fn default() -> Self {
        Regs {
            data: [0; SLOTS * 4],
            labels: Default::default(),
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
    pub fn write(
        &mut self,
        reg: u32,
        bytes: &[u8],
        label: Option<Label>,
    ) -> Result<(), TraceError> {
        let padded = crate::netlink::align4(bytes.len());
        let at = start(reg, padded)?;
        self.data[at..at + padded].fill(0);
        self.data[at..at + bytes.len()].copy_from_slice(bytes);
        for slot in at / 4..(at + padded) / 4 {
            self.labels[slot] = None;
        }
        self.labels[at / 4] = label;
        Ok(())
    }

    pub fn read(&self, reg: u32, len: usize) -> Result<&[u8], TraceError> {
        let at = start(reg, len)?;
        Ok(&self.data[at..at + len])
    }

    /// What the slot at `reg` was loaded from, if known.
    pub fn label(&self, reg: u32) -> Option<&Label> {
        let slot = reg_slot(reg)? as usize;
        self.labels.get(slot)?.as_ref()
    }
}
