//! Kernel behaviours that differ between the kernels nftkube supports, and why nftkube needs no version check
//! (or probe) for them. Run on every kernel of the matrix (ci/vm-tests).

use kernel_tests::require_root;
use nftkube::nft::ir::Family;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube::nft::wire;
use nftkube_sandbox::netns::{unique_name, NetNs};
use std::io;

const NLMSG_ERROR: u16 = 2;
const NLM_F_ACK: u16 = 4;

/// A raw NETLINK_NETFILTER socket (no library code between the test and the kernel).
struct RawNl(i32);

impl RawNl {
    fn open() -> RawNl {
        // SAFETY: plain socket call.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_NETFILTER,
            )
        };
        assert!(fd >= 0, "netlink socket: {}", io::Error::last_os_error());
        RawNl(fd)
    }

    fn send(&self, bytes: &[u8]) {
        // SAFETY: the kernel is the default destination of an unbound netlink socket; `bytes` is valid.
        let n = unsafe { libc::send(self.0, bytes.as_ptr().cast(), bytes.len(), 0) };
        assert_eq!(n, bytes.len() as isize, "{}", io::Error::last_os_error());
    }

    /// Every NLMSG_ERROR (acknowledgement when errno is 0) as (seq, errno), in arrival order, until the one
    /// for `last_seq` (a waiting recv: the caller makes sure that one comes).
    fn acks_until(&self, last_seq: u32) -> Vec<(u32, i32)> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            // SAFETY: buf is valid for its length.
            let n = unsafe { libc::recv(self.0, buf.as_mut_ptr().cast(), buf.len(), 0) };
            assert!(n >= 0, "recv: {}", io::Error::last_os_error());
            let mut off = 0;
            let n = n as usize;
            while off + 16 <= n {
                let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
                let typ = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap());
                let seq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().unwrap());
                if typ == NLMSG_ERROR {
                    let err = i32::from_ne_bytes(buf[off + 16..off + 20].try_into().unwrap());
                    out.push((seq, -err));
                    if seq == last_seq {
                        return out;
                    }
                }
                off += (len + 3) & !3;
            }
        }
    }
}

impl Drop for RawNl {
    fn drop(&mut self) {
        // SAFETY: our own descriptor.
        unsafe { libc::close(self.0) };
    }
}

/// Offsets of the netlink messages in a batch.
fn message_offsets(bytes: &[u8]) -> Vec<usize> {
    let mut v = Vec::new();
    let mut off = 0;
    while off + 16 <= bytes.len() {
        v.push(off);
        let len = u32::from_ne_bytes(bytes[off..off + 4].try_into().unwrap()) as usize;
        off += (len + 3) & !3;
    }
    v
}

/// Batch BEGIN / END acknowledgements: kernels before 6.10 never acknowledge them, later ones do when asked
/// (NLM_F_ACK). nftkube never asks: a batch is complete when the acknowledgement of its last object message
/// arrives (errors of earlier messages, and a failed commit's error on BEGIN's sequence number, come before
/// it). This test records what this kernel does when asked, and shows that the answer to the next request is
/// never confused with a batch message's, whichever way the kernel behaves.
#[test]
fn batch_begin_and_end_acks_are_optional_and_the_transport_asks_for_none() {
    require_root();
    let ns = NetNs::create(&unique_name("nk-ack")).expect("creating a namespace");
    ns.run(|| {
        let mut tx = Transaction::default();
        tx.push(Family::Ip, "nftkube-ack", Op::AddTable);

        // As nftkube sends it: no ACK flag on BEGIN / END.
        let b = wire::encode_batch(&tx, 100).unwrap();
        let offs = message_offsets(&b.bytes);
        assert_eq!(offs.len(), 3, "BEGIN, NEWTABLE, END");
        let flags = |bytes: &[u8], off: usize| u16::from_ne_bytes([bytes[off + 6], bytes[off + 7]]);
        assert_eq!(flags(&b.bytes, offs[0]) & NLM_F_ACK, 0);
        assert_eq!(flags(&b.bytes, offs[2]) & NLM_F_ACK, 0);
        assert_eq!(b.ack_seq, 101);
        let s = RawNl::open();
        s.send(&b.bytes);
        s.send(&wire::getgen_request(103).unwrap());
        let acks = s.acks_until(103);
        assert_eq!(
            acks,
            vec![(101, 0), (103, 0)],
            "not asked, never acknowledged"
        );

        // Asking for them: what this kernel does.
        let mut tx = Transaction::default();
        tx.push(Family::Ip, "nftkube-ack", Op::DeleteTable);
        let mut b = wire::encode_batch(&tx, 200).unwrap();
        let offs = message_offsets(&b.bytes);
        for off in [offs[0], offs[2]] {
            let f = flags(&b.bytes, off) | NLM_F_ACK;
            b.bytes[off + 6..off + 8].copy_from_slice(&f.to_ne_bytes());
        }
        s.send(&b.bytes);
        s.send(&wire::getgen_request(203).unwrap());
        let acks = s.acks_until(203);
        let begin = acks.iter().any(|&(q, _)| q == 200);
        let end = acks.iter().any(|&(q, _)| q == 202);
        eprintln!(
            "kernel {}: acknowledges batch BEGIN when asked: {begin}, END: {end}",
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
        );
        assert!(
            acks.iter().all(|&(_, e)| e == 0),
            "errors where none were expected: {acks:?}"
        );
        // Whatever the kernel does, the object message's ack comes in order and the sentinel comes last.
        let object = acks
            .iter()
            .position(|&(q, _)| q == 201)
            .expect("object ack");
        assert!(!end || acks.iter().position(|&(q, _)| q == 202).unwrap() > object);
        assert_eq!(acks.last(), Some(&(203, 0)));
        assert!(
            acks.iter().all(|&(q, _)| [200, 201, 202, 203].contains(&q)),
            "{acks:?}"
        );

        // nftkube's own transport on the same kernel: commits and the next request's answer line up.
        let mut sock = NftSocket::open().unwrap();
        let g0 = sock.generation().unwrap();
        for op in [Op::AddTable, Op::DeleteTable, Op::AddTable] {
            let mut tx = Transaction::default();
            tx.push(Family::Ip, "nftkube-ack", op);
            sock.commit(&tx).unwrap();
        }
        assert_eq!(sock.generation().unwrap(), g0.wrapping_add(3));
        assert!(sock
            .list_tables(Family::Ip)
            .unwrap()
            .contains(&"nftkube-ack".to_string()));
    })
    .expect("entering the namespace");
}
