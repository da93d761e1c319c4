//! Generic netlink plumbing shared by nf_tables, ctnetlink and rtnetlink code: attribute encoding and
//! decoding and the answer state machine (sans-IO), and a small blocking request/acknowledge socket.

pub mod attr;
pub mod error;
pub mod exchange;
pub mod route;
pub mod socket;
#[cfg(test)]
mod tests;

pub use attr::{AttrIter, Attrs, LengthError, MsgBuilder, NLA_F_NESTED};
pub use error::{DumpFault, NetlinkError, Request};
pub use exchange::{Exchange, Expect, Outcome, Progress};
pub use socket::{Limits, Membership, NlSocket, SHUTDOWN};

use std::sync::atomic::AtomicU64;

/// Messages received that answered no pending request (stale, duplicated, foreign), since start.
pub(crate) static DISCARDED: AtomicU64 = AtomicU64::new(0);
/// Dumps asked again because the kernel marked the answer inconsistent, since start.
pub static DUMP_RETRIES: AtomicU64 = AtomicU64::new(0);

/// Size of `struct nlmsghdr`.
pub(crate) const NLMSG_HDRLEN: usize = 16;

/// A request (every message to the kernel).
pub const NLM_F_REQUEST: u16 = 0x01;
/// Asks for an acknowledgement.
pub const NLM_F_ACK: u16 = 0x04;
/// GET: the whole table.
pub(crate) const NLM_F_ROOT: u16 = 0x100;
/// GET: every entry that matches.
pub(crate) const NLM_F_MATCH: u16 = 0x200;
/// GET: a dump.
pub const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;
/// NEW: replace an existing object.
pub const NLM_F_REPLACE: u16 = 0x100;
/// NEW: fail if the object exists.
pub const NLM_F_EXCL: u16 = 0x200;
/// NEW: create the object if it does not exist.
pub const NLM_F_CREATE: u16 = 0x400;
/// NEW: add at the end of the list.
pub const NLM_F_APPEND: u16 = 0x800;

/// Nothing; to be skipped.
pub const NLMSG_NOOP: u16 = 1;
/// An error or an acknowledgement.
pub(crate) const NLMSG_ERROR: u16 = 2;
/// The end of a multipart answer.
pub(crate) const NLMSG_DONE: u16 = 3;

/// Round up to the 4-byte netlink alignment.
pub const fn align4(len: usize) -> usize {
    (len + 3) & !3
}
