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

use super::{align4, NetlinkError, NlSocket, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_core::{
    DecodeError, NetlinkHeader, NetlinkMessage, NetlinkPayload, NlaBuffer, NLA_HEADER_SIZE,
    NLA_TYPE_MASK,
};
use netlink_packet_route::RouteNetlinkMessage;
use std::io;

/// Message types of answers (linux/rtnetlink.h), to tell them apart before decoding.
pub const RTM_NEWLINK: u16 = 16;
/// rtnetlink: an address (an answer of an address dump).
pub const RTM_NEWADDR: u16 = 20;
/// rtnetlink: a route (an answer of a route dump).
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
/// bytes, ready for netlink-packet-route's attribute parsers. An attribute whose length runs out of the
/// payload is an error item, and the last.
///
/// The walk itself is ours (plain TLV framing, as `netlink::attr` does for nf_tables): netlink-packet-core's
/// `NlasIterator` with a filter cost a node read about 8 % more (benches/rtnetlink.rs) for nothing this
/// needs.
pub fn attributes<'a>(
    payload: &'a [u8],
    header_len: usize,
    kinds: &'a [u16],
) -> impl Iterator<Item = Result<NlaBuffer<&'a [u8]>, DecodeError>> + 'a {
    let mut rest = payload.get(header_len..).unwrap_or_default();
    std::iter::from_fn(move || loop {
        if rest.len() < NLA_HEADER_SIZE {
            return None;
        }
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        if len < NLA_HEADER_SIZE || len > rest.len() {
            let left = rest.len();
            rest = &[];
            return Some(Err(DecodeError::from(format!(
                "attribute length {len} with {left} bytes left"
            ))));
        }
        let nla = &rest[..len];
        rest = &rest[align4(len).min(rest.len())..];
        let kind = u16::from_ne_bytes([nla[2], nla[3]]) & NLA_TYPE_MASK;
        if kinds.contains(&kind) {
            return Some(Ok(NlaBuffer::new(nla)));
        }
    })
}

/// A NETLINK_ROUTE socket of the calling thread's network namespace.
pub struct RouteSocket(NlSocket);

impl RouteSocket {
    /// An rtnetlink socket in the calling thread's network namespace.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MsgBuilder;

    /// A payload: a 4-byte fixed header, then the attributes `f` writes.
    fn payload(f: impl FnOnce(&mut MsgBuilder)) -> Vec<u8> {
        let mut m = MsgBuilder::new(0, 0, 0);
        m.raw(&[9, 9, 9, 9]);
        f(&mut m);
        m.finish().unwrap()[16..].to_vec()
    }

    #[test]
    fn attributes_yields_the_wanted_kinds_and_stops_at_a_bad_length() {
        let p = payload(|m| {
            m.attr_u32(1, 10);
            m.attr_str(3, "eth0");
            m.nested(4, |m| {
                m.attr_u32(1, 7);
            });
            m.attr_u32(3, 11);
        });
        let found: Vec<(u16, Vec<u8>)> = attributes(&p, 4, &[3, 4])
            .map(|nla| {
                let nla = nla.unwrap();
                (nla.kind(), nla.value().to_vec())
            })
            .collect();
        assert_eq!(found.len(), 3);
        assert_eq!(found[0], (3, b"eth0\0".to_vec()));
        assert_eq!(found[1].0, 4, "the nested flag is masked off the kind");
        assert_eq!(found[2], (3, 11u32.to_ne_bytes().to_vec()));
        // A length beyond the payload: one error, then nothing.
        let mut bad = p.clone();
        bad[4..6].copy_from_slice(&200u16.to_ne_bytes());
        let items: Vec<_> = attributes(&bad, 4, &[3]).collect();
        assert_eq!(items.len(), 1);
        assert!(items[0].is_err());
        // A length shorter than the attribute header, and a payload shorter than the fixed header.
        bad[4..6].copy_from_slice(&2u16.to_ne_bytes());
        assert!(attributes(&bad, 4, &[3]).next().unwrap().is_err());
        assert!(attributes(&p[..2], 4, &[3]).next().is_none());
    }
}
