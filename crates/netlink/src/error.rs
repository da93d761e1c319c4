//! What can go wrong between a request and its answers, typed so callers can tell a refusal by the kernel
//! (the socket is fine, the request was wrong or not allowed) from a broken exchange (the socket is replaced
//! and the outcome of a batch is unknown).

use super::attr::LengthError;
use std::fmt;
use std::io;
use std::time::Duration;

/// Which request an error concerns: what it was and the sequence number it went out with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// What the request was ("dump nf_tables rules", ...).
    pub what: String,
    /// Its sequence number.
    pub seq: u32,
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (seq {})", self.what, self.seq)
    }
}

/// An error the kernel answered, a socket failure, or an exchange that could not complete.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    /// The socket failed.
    Io(#[from] io::Error),
    /// The kernel refused one message (`seq` is that message's).
    #[error("{} (errno {errno}, message seq {seq}){}", errno_text(*.errno), ext_suffix(.ext_ack))]
    Kernel {
        /// The refused message's sequence number.
        seq: u32,
        /// The kernel's errno.
        errno: i32,
        /// The kernel's extended ack message, if any.
        ext_ack: Option<String>,
    },
    /// The kernel refused a single request (a dump, a GET).
    #[error("{request}: {} (errno {errno}){}", errno_text(*.errno), ext_suffix(.ext_ack))]
    Refused {
        /// The refused request.
        request: Request,
        /// The kernel's errno.
        errno: i32,
        /// The kernel's extended ack message, if any.
        ext_ack: Option<String>,
    },
    /// The kernel refused a whole batch before looking at its messages, and said so only on BATCH_BEGIN's
    /// sequence number: no CAP_NET_ADMIN (EPERM), a malformed batch, no memory.
    #[error("the kernel refused the whole batch: {} (errno {errno}, reported on BATCH_BEGIN seq {seq}){}", errno_text(*.errno), ext_suffix(.ext_ack))]
    Batch {
        /// BATCH_BEGIN's sequence number.
        seq: u32,
        /// The kernel's errno.
        errno: i32,
        /// The kernel's extended ack message, if any.
        ext_ack: Option<String>,
    },
    /// Nothing answered in time; what the request did is unknown.
    #[error("{request}: no answer from the kernel within {waited:?}; outcome unknown")]
    Timeout {
        /// The request.
        request: Request,
        /// How long it waited.
        waited: Duration,
    },
    /// The agent is shutting down; the wait was abandoned.
    #[error("{request}: abandoned, shutting down")]
    Cancelled {
        /// The request.
        request: Request,
    },
    /// The receive buffer overflowed (ENOBUFS): answers were dropped, so the outcome is unknown.
    #[error("{request}: the kernel dropped answers (receive buffer overflow); outcome unknown")]
    Overrun {
        /// The request.
        request: Request,
    },
    /// An answer that does not parse.
    #[error("{request}: malformed netlink answer: {detail}")]
    Protocol {
        /// The request.
        request: Request,
        /// What does not parse.
        detail: String,
    },
    /// A dump the kernel kept marking inconsistent (NLM_F_DUMP_INTR, an error in NLMSG_DONE).
    #[error("{request}: dump still inconsistent after {attempts} attempts (last: {last})")]
    Inconsistent {
        /// The dump.
        request: Request,
        /// How many times it was tried.
        attempts: u32,
        /// Why the last attempt was not usable.
        last: DumpFault,
    },
    /// A request that could not be encoded.
    #[error(transparent)]
    Length(#[from] LengthError),
}

/// Why one dump attempt was not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DumpFault {
    /// The kernel's objects changed while it was dumping them.
    #[error("interrupted by a concurrent change (NLM_F_DUMP_INTR)")]
    Interrupted,
    /// NLMSG_DONE carried an error: the dump ended early.
    #[error("ended with {} (errno {errno}){}", errno_text(*.errno), ext_suffix(.ext_ack))]
    DoneError {
        /// The kernel's errno.
        errno: i32,
        /// The kernel's extended ack message, if any.
        ext_ack: Option<String>,
    },
}

fn errno_text(errno: i32) -> io::Error {
    io::Error::from_raw_os_error(errno)
}

fn ext_suffix(ext: &Option<String>) -> String {
    match ext {
        Some(m) if !m.is_empty() => format!(": {m}"),
        _ => String::new(),
    }
}

impl NetlinkError {
    /// The errno the kernel answered or the socket failed with.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Kernel { errno, .. }
            | NetlinkError::Batch { errno, .. }
            | NetlinkError::Refused { errno, .. } => Some(*errno),
            NetlinkError::Io(e) => e.raw_os_error(),
            NetlinkError::Overrun { .. } => Some(libc::ENOBUFS),
            NetlinkError::Timeout { .. } => Some(libc::ETIMEDOUT),
            NetlinkError::Cancelled { .. } => Some(libc::EINTR),
            _ => None,
        }
    }

    /// The kernel's extended-ack text, when it gave one.
    pub fn ext_ack(&self) -> Option<&str> {
        match self {
            NetlinkError::Kernel { ext_ack, .. }
            | NetlinkError::Batch { ext_ack, .. }
            | NetlinkError::Refused { ext_ack, .. } => ext_ack.as_deref(),
            _ => None,
        }
    }

    /// Whether the kernel answered with a refusal (the request was wrong or not allowed, the socket is fine).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            NetlinkError::Kernel { .. } | NetlinkError::Batch { .. } | NetlinkError::Refused { .. }
        )
    }

    /// Whether the socket's opener lacked a permission: the kernel checks the credentials the socket
    /// was opened with as well as the sender's, so only a new socket can use a capability regained since.
    pub fn needs_new_credentials(&self) -> bool {
        self.is_refusal() && self.errno() == Some(libc::EPERM)
    }

    /// Whether the exchange broke off: answers may still be queued or lost, so the socket must not carry
    /// another request. Refusals by the kernel (`Kernel`, `Batch`) and finished-but-inconsistent dumps
    /// leave it clean.
    pub fn breaks_socket(&self) -> bool {
        matches!(
            self,
            NetlinkError::Io(_)
                | NetlinkError::Timeout { .. }
                | NetlinkError::Cancelled { .. }
                | NetlinkError::Overrun { .. }
                | NetlinkError::Protocol { .. }
        )
    }
}
