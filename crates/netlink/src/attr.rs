//! Netlink message and attribute (NLA) encoding and decoding, free of I/O.
//!
//! `MsgBuilder` writes one netlink message: header, a fixed family header, then attributes, with nested
//! attributes opened and closed like brackets so their lengths are patched in place. `Attrs` walks the
//! attributes of a received payload.

use super::{align4, NLMSG_HDRLEN};

/// Set on an attribute whose payload is itself a list of attributes. Some kernel parsers insist on it.
pub const NLA_F_NESTED: u16 = 0x8000;
const NLA_F_NET_BYTEORDER: u16 = 0x4000;
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

/// An attribute or message too long for its length field. Netlink attribute lengths are 16 bits and message
/// lengths 32: writing a longer one would silently truncate the length, and the kernel would then parse
/// whatever follows as attributes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LengthError {
    #[error("netlink attribute type {kind} is {len} bytes long; an attribute holds at most 65535")]
    /// An attribute too long for its 16-bit length.
    Attribute {
        /// The attribute's type.
        kind: u16,
        /// Its length.
        len: usize,
    },
    #[error("netlink message is {len} bytes long; a message holds at most 4294967295")]
    /// A message too long for its 32-bit length.
    Message {
        /// Its length.
        len: usize,
    },
}

impl From<LengthError> for std::io::Error {
    fn from(e: LengthError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
    }
}

/// Builds one netlink message. Lengths are fixed up when `finish` is called.
///
/// The attribute writers chain (`m.attr(..).attr(..)`), so an overflow cannot be returned where it happens:
/// the first one is remembered and `finish` returns it instead of the message.
#[derive(Debug)]
pub struct MsgBuilder {
    buf: Vec<u8>,
    open: Vec<(usize, u16)>,
    overflow: Option<LengthError>,
}

impl MsgBuilder {
    /// Starts a message with the given type, flags and sequence number; the port id is left 0 (kernel).
    pub fn new(msg_type: u16, flags: u16, seq: u32) -> Self {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched in finish()
        buf.extend_from_slice(&msg_type.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        MsgBuilder {
            buf,
            open: Vec::new(),
            overflow: None,
        }
    }

    /// Appends raw bytes (a family header such as `nfgenmsg` or `ifinfomsg`), padded to 4 bytes.
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self.pad();
        self
    }

    fn pad(&mut self) {
        let aligned = align4(self.buf.len());
        self.buf.resize(aligned, 0);
    }

    /// Appends an attribute with an opaque payload.
    pub fn attr(&mut self, kind: u16, payload: &[u8]) -> &mut Self {
        let len = 4 + payload.len();
        let Ok(len16) = u16::try_from(len) else {
            self.overflowed(LengthError::Attribute { kind, len });
            return self;
        };
        self.buf.extend_from_slice(&len16.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
        self
    }

    /// Appends a one-byte attribute.
    pub fn attr_u8(&mut self, kind: u16, v: u8) -> &mut Self {
        self.attr(kind, &[v])
    }

    /// A 32-bit attribute in network byte order (what nf_tables uses for its integers).
    pub fn attr_be32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.attr(kind, &v.to_be_bytes())
    }

    /// A 64-bit attribute in network byte order.
    pub fn attr_be64(&mut self, kind: u16, v: u64) -> &mut Self {
        self.attr(kind, &v.to_be_bytes())
    }

    /// A 32-bit attribute in host byte order (what rtnetlink uses).
    pub fn attr_u32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.attr(kind, &v.to_ne_bytes())
    }

    /// A NUL-terminated string attribute.
    pub fn attr_str(&mut self, kind: u16, s: &str) -> &mut Self {
        let mut payload = Vec::with_capacity(s.len() + 1);
        payload.extend_from_slice(s.as_bytes());
        payload.push(0);
        self.attr(kind, &payload)
    }

    /// Opens a nested attribute (NLA_F_NESTED is set); close it with `end_nested`.
    pub(crate) fn begin_nested(&mut self, kind: u16) -> &mut Self {
        self.open.push((self.buf.len(), kind));
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    /// Closes the innermost nested attribute, writing its length.
    pub(crate) fn end_nested(&mut self) -> &mut Self {
        let (start, kind) = self.open.pop().expect("end_nested without begin_nested");
        let len = self.buf.len() - start;
        match u16::try_from(len) {
            Ok(len) => self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes()),
            Err(_) => self.overflowed(LengthError::Attribute { kind, len }),
        }
        self
    }

    fn overflowed(&mut self, e: LengthError) {
        self.overflow.get_or_insert(e);
    }

    /// Writes a nested attribute whose content `f` produces.
    pub fn nested(&mut self, kind: u16, f: impl FnOnce(&mut Self)) -> &mut Self {
        self.begin_nested(kind);
        f(self);
        self.end_nested()
    }

    /// Patches the total length and returns the encoded message, or the first length that did not fit.
    pub fn finish(mut self) -> Result<Vec<u8>, LengthError> {
        assert!(self.open.is_empty(), "unclosed nested attribute");
        if let Some(e) = self.overflow {
            return Err(e);
        }
        let len = u32::try_from(self.buf.len()).map_err(|_| LengthError::Message {
            len: self.buf.len(),
        })?;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        Ok(self.buf)
    }
}

/// One decoded netlink message header plus its payload.
#[derive(Debug, Clone, Copy)]
pub struct Msg<'a> {
    /// Message type.
    pub msg_type: u16,
    /// Header flags (NLM_F_*).
    pub flags: u16,
    /// Sequence number.
    pub seq: u32,
    /// Port id of the sender (0: the kernel).
    pub pid: u32,
    /// What follows the header.
    pub payload: &'a [u8],
}

/// Splits a receive buffer into netlink messages.
pub fn messages(mut buf: &[u8]) -> impl Iterator<Item = Msg<'_>> {
    std::iter::from_fn(move || {
        if buf.len() < NLMSG_HDRLEN {
            return None;
        }
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return None;
        }
        let msg = msg_of(buf, len);
        buf = &buf[align4(len).min(buf.len())..];
        Some(msg)
    })
}

/// The message at the start of `buf`, whose length field (checked by the caller) says `len`.
fn msg_of(buf: &[u8], len: usize) -> Msg<'_> {
    Msg {
        msg_type: u16::from_ne_bytes(buf[4..6].try_into().unwrap()),
        flags: u16::from_ne_bytes(buf[6..8].try_into().unwrap()),
        seq: u32::from_ne_bytes(buf[8..12].try_into().unwrap()),
        pid: u32::from_ne_bytes(buf[12..16].try_into().unwrap()),
        payload: &buf[NLMSG_HDRLEN..len],
    }
}

/// A datagram that is not a sequence of whole netlink messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MalformedDatagram {
    /// Fewer bytes than a header after the last message.
    #[error("{0} stray bytes after the last message")]
    StrayBytes(usize),
    /// A header whose length is shorter than a header or overruns the datagram.
    #[error("message length {len} with {left} bytes left in the datagram")]
    BadLength {
        /// The length the header claims.
        len: usize,
        /// The bytes left in the datagram from that header on.
        left: usize,
    },
}

/// Splits a datagram into messages; any byte that is not part of a whole message makes it malformed
/// (a truncated message, a length that overruns the datagram, a header shorter than a header).
pub fn split(mut buf: &[u8]) -> Result<Vec<Msg<'_>>, MalformedDatagram> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        if buf.len() < NLMSG_HDRLEN {
            return Err(MalformedDatagram::StrayBytes(buf.len()));
        }
        let len = u32::from_ne_bytes(buf[0..4].try_into().unwrap()) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return Err(MalformedDatagram::BadLength {
                len,
                left: buf.len(),
            });
        }
        out.push(msg_of(buf, len));
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// A decoded attribute: its type (flags stripped) and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// Attribute type, flags stripped.
    pub kind: u16,
    /// Attribute payload.
    pub payload: &'a [u8],
}

impl<'a> Attr<'a> {
    /// The payload as a big-endian u32.
    pub fn be32(&self) -> Option<u32> {
        Some(u32::from_be_bytes(self.payload.get(..4)?.try_into().ok()?))
    }
    /// The payload as a big-endian u64.
    pub fn be64(&self) -> Option<u64> {
        Some(u64::from_be_bytes(self.payload.get(..8)?.try_into().ok()?))
    }
    /// The payload as a u8.
    pub fn u8(&self) -> Option<u8> {
        self.payload.first().copied()
    }
    /// A NUL-terminated string (the terminator and anything after it dropped).
    pub fn str(&self) -> Option<&'a str> {
        let end = self
            .payload
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.payload.len());
        std::str::from_utf8(&self.payload[..end]).ok()
    }
    /// The payload as nested attributes.
    pub fn nested(&self) -> Attrs<'a> {
        Attrs(self.payload)
    }
}

/// The attributes of a payload.
#[derive(Debug, Clone, Copy)]
pub struct Attrs<'a>(pub &'a [u8]);

impl<'a> Attrs<'a> {
    /// The attributes in order.
    pub fn iter(&self) -> AttrIter<'a> {
        AttrIter(self.0)
    }
    /// The first attribute of the given type.
    pub fn get(&self, kind: u16) -> Option<Attr<'a>> {
        self.iter().find(|a| a.kind == kind)
    }
}

/// Iterates attributes; stops at the first malformed one.
#[derive(Debug, Clone)]
pub struct AttrIter<'a>(&'a [u8]);

impl<'a> Iterator for AttrIter<'a> {
    type Item = Attr<'a>;
    fn next(&mut self) -> Option<Attr<'a>> {
        let b = self.0;
        if b.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let kind = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            return None;
        }
        let payload = &b[4..len];
        self.0 = &b[align4(len).min(b.len())..];
        Some(Attr { kind, payload })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_lengths_are_patched_and_parse_back() {
        let mut m = MsgBuilder::new(0x0a00, 0x5, 7);
        m.raw(&[2, 0, 0, 0]);
        m.attr_str(1, "nftkube");
        m.nested(2, |m| {
            m.attr_be32(1, 0x4000);
        });
        let bytes = m.finish().unwrap();
        assert_eq!(
            bytes.len() as u32,
            u32::from_ne_bytes(bytes[0..4].try_into().unwrap())
        );
        let msg = messages(&bytes).next().unwrap();
        assert_eq!((msg.msg_type, msg.flags, msg.seq), (0x0a00, 5, 7));
        let attrs = Attrs(&msg.payload[4..]);
        assert_eq!(attrs.get(1).unwrap().str(), Some("nftkube"));
        let inner = attrs.get(2).unwrap().nested();
        assert_eq!(inner.get(1).unwrap().be32(), Some(0x4000));
        // The nested flag is on the wire but stripped when decoding.
        let raw_kind = u16::from_ne_bytes(msg.payload[4 + 12 + 2..4 + 12 + 4].try_into().unwrap());
        assert_eq!(raw_kind, 2 | NLA_F_NESTED);
    }

    #[test]
    fn truncated_input_stops_cleanly() {
        let bytes = [8u8, 0, 1, 0, 0xaa];
        assert_eq!(Attrs(&bytes).iter().count(), 0);
        assert_eq!(messages(&bytes).count(), 0);
    }

    #[test]
    fn an_attribute_too_long_for_its_length_field_is_an_error() {
        let mut m = MsgBuilder::new(1, 0, 1);
        m.attr(7, &vec![0u8; 65531]);
        assert!(m.finish().is_ok(), "65535 bytes with the header fit");
        let mut m = MsgBuilder::new(1, 0, 1);
        m.attr(7, &vec![0u8; 65532]).attr_u8(8, 1);
        assert_eq!(
            m.finish(),
            Err(LengthError::Attribute {
                kind: 7,
                len: 65536
            })
        );
    }

    #[test]
    fn a_nested_attribute_too_long_is_an_error_not_a_truncated_length() {
        let mut m = MsgBuilder::new(1, 0, 1);
        m.nested(3, |m| {
            for _ in 0..3 {
                m.attr(1, &vec![0u8; 30000]);
            }
        });
        assert!(matches!(
            m.finish(),
            Err(LengthError::Attribute { kind: 3, len }) if len > 65535
        ));
    }
}
