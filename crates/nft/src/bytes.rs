//! The bytes of a set element's key or value, stored inline when short.
//!
//! Every element nftkube programs is short: the longest key is an IPv6 address, a protocol, a port and an
//! endpoint slot (16 + 4 + 4 + 4 bytes, components padded to 4), the longest value an IPv6 address and a
//! port. A `Vec<u8>` costs a heap allocation per key and per value (~64 bytes with the allocator's
//! overhead, beside the 24-byte handle); at 50k services that is ~400k elements held several times over
//! (pieces, the transaction). Inline, an element costs no allocation at all. Longer byte strings (the
//! kernel may hand us anything in a dump, up to 64 bytes) fall back to the heap.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

/// Bytes kept inline up to this length (the enum is then 32 bytes, like a `Box<[u8]>` plus a tag).
const INLINE: usize = 30;

#[derive(Clone)]
/// The key or value bytes of an element: inline up to 30 bytes (no allocation), on the heap beyond.
pub enum ElementBytes {
    /// Up to 30 bytes, in place.
    Inline {
        /// How many of `bytes` are used.
        len: u8,
        /// The bytes, zero after `len`.
        bytes: [u8; INLINE],
    },
    /// Longer than 30 bytes.
    Heap(Box<[u8]>),
}

impl ElementBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            ElementBytes::Inline { len, bytes } => &bytes[..*len as usize],
            ElementBytes::Heap(b) => b,
        }
    }
}

impl From<&[u8]> for ElementBytes {
    fn from(b: &[u8]) -> Self {
        if b.len() <= INLINE {
            let mut bytes = [0; INLINE];
            bytes[..b.len()].copy_from_slice(b);
            ElementBytes::Inline {
                len: b.len() as u8,
                bytes,
            }
        } else {
            ElementBytes::Heap(b.into())
        }
    }
}

impl From<Vec<u8>> for ElementBytes {
    fn from(v: Vec<u8>) -> Self {
        v.as_slice().into()
    }
}

impl<const N: usize> From<[u8; N]> for ElementBytes {
    fn from(a: [u8; N]) -> Self {
        a.as_slice().into()
    }
}

impl Deref for ElementBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for ElementBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Borrow<[u8]> for ElementBytes {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

// Equality, order and hash are those of the byte string, whichever way it is stored (Borrow requires it).
impl PartialEq for ElementBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for ElementBytes {}

impl PartialEq<[u8]> for ElementBytes {
    fn eq(&self, other: &[u8]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<Vec<u8>> for ElementBytes {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialOrd for ElementBytes {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ElementBytes {
    fn cmp(&self, other: &Self) -> Ordering {
        self.as_slice().cmp(other.as_slice())
    }
}

impl Hash for ElementBytes {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state)
    }
}

impl fmt::Debug for ElementBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_bytes_are_inline_long_ones_on_the_heap_and_both_compare_as_bytes() {
        let short = ElementBytes::from(vec![1u8; INLINE]);
        let long = ElementBytes::from(vec![1u8; INLINE + 1]);
        assert!(matches!(short, ElementBytes::Inline { .. }));
        assert!(matches!(long, ElementBytes::Heap(_)));
        assert_eq!(&*short, &[1u8; INLINE][..]);
        assert_eq!(long.len(), INLINE + 1);
        assert!(short < long, "a prefix sorts first, as for slices");
        assert_eq!(ElementBytes::from([0u8, 80]), vec![0u8, 80]);
        assert_eq!(std::mem::size_of::<ElementBytes>(), 32);
        let empty = ElementBytes::from(Vec::new());
        assert!(empty.is_empty());
    }
}
