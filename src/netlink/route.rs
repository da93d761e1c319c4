//! rtnetlink (links, addresses, routes) in netlink-packet-route's types, carried by our own socket.
//!
//! The messages are the field's crate's: it knows every `struct ifinfomsg` / `ifaddrmsg` / `rtmsg` field and
//! attribute, RTA_MULTIPATH's `struct rtnexthop` list included. The exchange stays ours ([`NlSocket`]): its
//! bounded waits, sequence matching, dump retries and typed errors are what every other netlink user here
//! relies on, and a netlink-packet-route message is just bytes to it.

use super::{NetlinkError, NlSocket, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_core::{
    DecodeError, NetlinkHeader, NetlinkMessage, NetlinkPayload, ParseableParametrized,
};
use netlink_packet_route::RouteNetlinkMessage;
use std::io;

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

/// One answer of a dump (its message type and payload, as [`NlSocket::dump`] returns them), decoded.
pub fn decode(msg_type: u16, payload: &[u8]) -> Result<RouteNetlinkMessage, DecodeError> {
    RouteNetlinkMessage::parse_with_param(payload, msg_type)
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

    /// Dumps what `msg` asks for (NLM_F_DUMP): every answer, each decoded on its own so a caller can
    /// decide what an answer that does not decode means to it.
    pub fn dump(
        &mut self,
        what: &str,
        msg: RouteNetlinkMessage,
    ) -> Result<Vec<Result<RouteNetlinkMessage, DecodeError>>, NetlinkError> {
        self.get(what, msg, NLM_F_DUMP)
    }

    /// Dumps what `msg` asks for (NLM_F_DUMP) and returns the answers as they came (type, payload), for
    /// callers that decode only the parts they read.
    pub fn dump_raw(
        &mut self,
        what: &str,
        msg: RouteNetlinkMessage,
    ) -> Result<Vec<(u16, Vec<u8>)>, NetlinkError> {
        let seq = self.0.reserve_seq(1);
        self.0
            .dump_as(what, &encode(msg, NLM_F_REQUEST | NLM_F_DUMP, seq))
    }

    /// Sends `msg` with NLM_F_REQUEST | `flags` (a dump, or a GET with NLM_F_ACK) and decodes every answer.
    pub fn get(
        &mut self,
        what: &str,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<Result<RouteNetlinkMessage, DecodeError>>, NetlinkError> {
        let seq = self.0.reserve_seq(1);
        let answers = self
            .0
            .dump_as(what, &encode(msg, NLM_F_REQUEST | flags, seq))?;
        Ok(answers.iter().map(|(t, p)| decode(*t, p)).collect())
    }
}
