//! The answer side of one netlink exchange, free of I/O: fed the datagrams a socket received, it says
//! whether to keep waiting, and what the exchange came to. Tests feed it scripted datagrams (out of order,
//! duplicated, stale, truncated) with no socket; `socket.rs` drives it with a real one and owns the clocks.
//!
//! Only messages addressed to our port and carrying one of the request's sequence numbers count. Anything
//! else (an answer to an earlier request left queued after an error, a duplicate, a message after the end)
//! is discarded and counted, never taken as an answer.

use super::attr::{split, Attrs, Msg};
use super::error::{DumpFault, NetlinkError, Request};
use super::{align4, NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN};
use std::collections::BTreeMap;

/// Set on dump messages when the kernel's objects changed while it was dumping them.
pub(crate) const NLM_F_DUMP_INTR: u16 = 0x10;
/// On NLMSG_ERROR: only the original header is echoed (we ask for capped acks).
const NLM_F_CAPPED: u16 = 0x100;
/// On NLMSG_ERROR and NLMSG_DONE: extended-ack attributes follow.
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLMSGERR_ATTR_MSG: u16 = 1;

/// What answers a request is waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Messages `first..=last` went out in one `sendmsg`; the one at `ack` asked for an acknowledgement,
    /// the others answer only when they fail. `batch_begin`: an nfnetlink BATCH_BEGIN at that sequence
    /// number, on which the kernel reports errors that refuse the whole batch (and nothing else comes).
    Acks {
        /// The first message's sequence number.
        first: u32,
        /// The last message's sequence number.
        last: u32,
        /// The message that asked for an acknowledgement.
        ack: u32,
        /// An nfnetlink BATCH_BEGIN's sequence number, if the messages are a batch.
        batch_begin: Option<u32>,
    },
    /// One request answered by data messages ending with NLMSG_DONE (a dump), or with an acknowledgement
    /// (a plain GET that asked for one), or by an error.
    Answer {
        /// The request's sequence number.
        seq: u32,
    },
}

/// Where the exchange stands after a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The final answer has not come: keep reading, within the deadline.
    Waiting,
    /// The final answer, or an error, came. The kernel queues every answer of a `sendmsg` before it
    /// returns, so read only what is already queued (without blocking), then `finish`.
    Draining,
    /// Nothing more can belong to this exchange: `finish`.
    Complete,
}

/// What a finished exchange came to.
#[derive(Debug)]
pub enum Outcome {
    /// `Expect::Acks`: the kernel processed the messages; these ones it refused (by sequence number).
    Acked(Vec<NetlinkError>),
    /// `Expect::Answer`: every data message went to the sink, and the answer is complete and consistent.
    Answered,
    /// `Expect::Answer`: the answer ended but cannot be trusted; ask again.
    Faulty(DumpFault),
}

/// The state of one exchange.
#[derive(Debug)]
pub struct Exchange {
    request: Request,
    expect: Expect,
    port: u32,
    progress: Progress,
    /// Per sequence number, the first error the kernel reported for it.
    errors: BTreeMap<u32, NetlinkError>,
    /// An error that ends the exchange as a whole (batch refused, request refused).
    fatal: Option<NetlinkError>,
    fault: Option<DumpFault>,
    /// Whether the message that asked for an acknowledgement got its answer.
    acked: bool,
    /// Messages that were not answers to this request.
    pub(crate) discarded: u64,
}

impl Exchange {
    /// `port`: our socket's port id; the kernel addresses its answers to it.
    pub fn new(request: Request, expect: Expect, port: u32) -> Self {
        Exchange {
            request,
            expect,
            port,
            progress: Progress::Waiting,
            errors: BTreeMap::new(),
            fatal: None,
            fault: None,
            acked: false,
            discarded: 0,
        }
    }

    /// The request the exchange is for.
    pub fn request(&self) -> &Request {
        &self.request
    }

    /// Where the exchange stands.
    pub fn progress(&self) -> Progress {
        self.progress
    }

    /// Takes one received datagram. Data messages of an `Answer` go to `sink` (type, payload). A datagram
    /// that does not parse is an error: the socket's stream can no longer be trusted.
    pub fn feed(
        &mut self,
        datagram: &[u8],
        sink: &mut dyn FnMut(u16, &[u8]),
    ) -> Result<Progress, NetlinkError> {
        for msg in split(datagram).map_err(|d| self.malformed(d.to_string()))? {
            if !self.is_ours(&msg) {
                self.discard(&msg, "not an answer to this request");
                continue;
            }
            match self.expect {
                Expect::Acks {
                    ack, batch_begin, ..
                } => self.on_ack_reply(&msg, ack, batch_begin)?,
                Expect::Answer { .. } => self.on_answer(&msg, sink)?,
            }
        }
        Ok(self.progress)
    }

    /// Ends the exchange. Call it at `Complete`, or at `Draining` once nothing more is queued.
    pub fn finish(self) -> Result<Outcome, NetlinkError> {
        if let Some(e) = self.fatal {
            return Err(e);
        }
        if self.progress == Progress::Waiting {
            return Err(NetlinkError::Protocol {
                request: self.request.clone(),
                detail: "the exchange ended before its final answer".into(),
            });
        }
        Ok(match (self.expect, self.fault) {
            (Expect::Acks { .. }, _) => Outcome::Acked(self.errors.into_values().collect()),
            (Expect::Answer { .. }, Some(f)) => Outcome::Faulty(f),
            (Expect::Answer { .. }, None) => Outcome::Answered,
        })
    }

    fn is_ours(&self, msg: &Msg<'_>) -> bool {
        if msg.pid != self.port || self.progress == Progress::Complete {
            return false;
        }
        match self.expect {
            Expect::Acks { first, last, .. } => {
                msg.seq.wrapping_sub(first) <= last.wrapping_sub(first)
            }
            Expect::Answer { seq } => msg.seq == seq,
        }
    }

    fn discard(&mut self, msg: &Msg<'_>, why: &str) {
        self.discarded += 1;
        super::DISCARDED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!(
            request = %self.request,
            msg_type = msg.msg_type,
            seq = msg.seq,
            pid = msg.pid,
            "netlink message discarded: {why}"
        );
    }

    fn malformed(&self, detail: String) -> NetlinkError {
        NetlinkError::Protocol {
            request: self.request.clone(),
            detail,
        }
    }

    /// An error answering a single request, named by the request.
    fn refused(&self, e: NetlinkError) -> NetlinkError {
        match e {
            NetlinkError::Kernel { errno, ext_ack, .. } => NetlinkError::Refused {
                request: self.request.clone(),
                errno,
                ext_ack,
            },
            other => other,
        }
    }

    fn on_ack_reply(
        &mut self,
        msg: &Msg<'_>,
        ack: u32,
        batch_begin: Option<u32>,
    ) -> Result<(), NetlinkError> {
        if msg.msg_type != NLMSG_ERROR {
            self.discard(msg, "not an acknowledgement");
            return Ok(());
        }
        let err = parse_error(msg).map_err(|d| self.malformed(d))?;
        if msg.seq == ack && self.acked && err.is_none() {
            self.discard(msg, "duplicate acknowledgement");
            return Ok(());
        }
        match err {
            Some(e) if Some(msg.seq) == batch_begin => {
                self.fatal = Some(into_batch(e));
                self.progress = Progress::Complete;
                return Ok(());
            }
            Some(_) if self.errors.contains_key(&msg.seq) => self.discard(msg, "duplicate error"),
            Some(e) => {
                self.errors.insert(msg.seq, e);
                // Every answer was queued before `sendmsg` returned, so the rest are queued too. And the
                // acknowledgement may never come: a batch the kernel aborts at a failing message (ENOMEM)
                // is not processed to its end.
                self.progress = Progress::Draining;
            }
            None => {}
        }
        if msg.seq == ack {
            self.acked = true;
            self.progress = Progress::Draining;
        }
        Ok(())
    }

    fn on_answer(
        &mut self,
        msg: &Msg<'_>,
        sink: &mut dyn FnMut(u16, &[u8]),
    ) -> Result<(), NetlinkError> {
        if msg.flags & NLM_F_DUMP_INTR != 0 {
            self.fault = Some(DumpFault::Interrupted);
        }
        match msg.msg_type {
            NLMSG_ERROR => {
                if let Some(e) = parse_error(msg).map_err(|d| self.malformed(d))? {
                    self.fatal = Some(self.refused(e));
                }
                self.progress = Progress::Complete;
            }
            NLMSG_DONE => {
                if let Some(f) = parse_done(msg).map_err(|d| self.malformed(d))? {
                    self.fault.get_or_insert(f);
                }
                self.progress = Progress::Complete;
            }
            super::NLMSG_NOOP => {}
            t => sink(t, msg.payload),
        }
        Ok(())
    }
}

fn into_batch(e: NetlinkError) -> NetlinkError {
    match e {
        NetlinkError::Kernel {
            seq,
            errno,
            ext_ack,
        } => NetlinkError::Batch {
            seq,
            errno,
            ext_ack,
        },
        other => other,
    }
}

/// Decodes an NLMSG_ERROR: `None` for an acknowledgement, the kernel's error otherwise.
fn parse_error(msg: &Msg<'_>) -> Result<Option<NetlinkError>, String> {
    let p = msg.payload;
    if p.len() < 4 + NLMSG_HDRLEN {
        return Err(format!("NLMSG_ERROR of {} bytes", p.len()));
    }
    let code = i32::from_ne_bytes(p[0..4].try_into().unwrap());
    if code == 0 {
        return Ok(None);
    }
    let orig_len = u32::from_ne_bytes(p[4..8].try_into().unwrap()) as usize;
    // With capped acks only the original header is echoed; otherwise the whole original message.
    let echoed = if msg.flags & NLM_F_CAPPED != 0 {
        NLMSG_HDRLEN
    } else {
        orig_len.max(NLMSG_HDRLEN)
    };
    Ok(Some(NetlinkError::Kernel {
        seq: msg.seq,
        errno: code.saturating_neg(),
        ext_ack: ext_ack(msg, p.get(4 + align4(echoed)..)),
    }))
}

/// Decodes NLMSG_DONE: a dump that ended early carries its error code there.
fn parse_done(msg: &Msg<'_>) -> Result<Option<DumpFault>, String> {
    let Some(code) = msg.payload.get(0..4) else {
        // Old kernels and some families send an empty DONE.
        return Ok(None);
    };
    let code = i32::from_ne_bytes(code.try_into().unwrap());
    Ok((code != 0).then(|| DumpFault::DoneError {
        errno: code.saturating_neg(),
        ext_ack: ext_ack(msg, msg.payload.get(4..)),
    }))
}

fn ext_ack(msg: &Msg<'_>, tlvs: Option<&[u8]>) -> Option<String> {
    if msg.flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    Attrs(tlvs?)
        .get(NLMSGERR_ATTR_MSG)
        .and_then(|a| a.str())
        .map(str::to_owned)
}
