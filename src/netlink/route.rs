//! rtnetlink (links, addresses, routes) in netlink-packet-route's types, carried by our own socket.
//!
//! Requests are the field's crate's messages: it knows every `struct ifinfomsg` / `ifaddrmsg` / `rtmsg`
//! field and attribute, RTA_MULTIPATH's `struct rtnexthop` list included. The exchange stays ours
//! ([`NlSocket`]): its bounded waits, sequence matching, dump retries and typed errors are what every other
//! netlink user here relies on, and a netlink-packet-route message is just bytes to it.
//!
//! Answers are decoded selectively: each answer's fixed header, then only the attributes the caller reads,
//! each by netlink-packet-route's own parsers ([`attributes`]). Decoding whole messages (every attribute of
//! every link or address: statistics, cache info, labels...) made reading the node 1.6 times slower than
//! the hand-written parser it replaced (benches/rtnetlink.rs), and an attribute nobody reads can then never
//! fail a read either.

use super::{NetlinkError, NlSocket, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_core::{
    DecodeError, NetlinkHeader, NetlinkMessage, NetlinkPayload, NlaBuffer, NlasIterator,
};
use netlink_packet_route::RouteNetlinkMessage;
use std::io;

/// Message types of answers (linux/rtnetlink.h), to tell them apart before decoding.
pub const RTM_NEWLINK: u16 = 16;
pub const RTM_NEWADDR: u16 = 20;
pub const RTM_NEWROUTE: u16 = 24;

/// The whole netlink message (header included) for `msg`, with `flags` and sequence number `seq`.
pub fn encode(msg: RouteNetlinkMessage, flags: u16, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::from(msg));
    message.finalize();
    let mut buf = vec![0u8; message.buffer_len()];
    message.serialize(&mut buf);
    buf
}

/// The attributes of the `kinds` wanted in an answer's payload, after its fixed header of `header_len`
/// bytes, ready for netlink-packet-route's attribute parsers. A malformed attribute list is an error item.
pub fn attributes<'a>(
    payload: &'a [u8],
    header_len: usize,
    kinds: &'a [u16],
) -> impl Iterator<Item = Result<NlaBuffer<&'a [u8]>, DecodeError>> + 'a {
    NlasIterator::new(payload.get(header_len..).unwrap_or_default()).filter(move |nla| match nla {
        Ok(nla) => kinds.contains(&nla.kind()),
        Err(_) => true,
    })
}

/// A NETLINK_ROUTE socket of the calling thread's network namespace.
pub struct RouteSocket(NlSocket);

impl RouteSocket {
    pub fn open() -> io::Result<Self> {
        NlSocket::open(libc::NETLINK_ROUTE).map(RouteSocket)
    }

    /// Sends `msg` with NLM_F_REQUEST | NLM_F_ACK | `flags` and waits for the kernel's acknowledgement.
    pub fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> Result<(), NetlinkError> {
        let seq = self.0.reserve_seq(1);
        self.0
            .request_ack(&encode(msg, NLM_F_REQUEST | NLM_F_ACK | flags, seq))
    }

    /// Dumps what `msg` asks for (NLM_F_DUMP): the answers as they came, (type, payload).
    pub fn dump(
        &mut self,
        what: &str,
        msg: RouteNetlinkMessage,
    ) -> Result<Vec<(u16, Vec<u8>)>, NetlinkError> {
        self.get(what, msg, NLM_F_DUMP)
    }

    /// Sends `msg` with NLM_F_REQUEST | `flags` (a dump, or a GET with NLM_F_ACK): the answers, (type,
    /// payload).
    pub fn get(
        &mut self,
        what: &str,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<(u16, Vec<u8>)>, NetlinkError> {
        let seq = self.0.reserve_seq(1);
        self.0
            .dump_as(what, &encode(msg, NLM_F_REQUEST | flags, seq))
    }
}
