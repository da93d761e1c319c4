//! The netlink socket's waits against the real kernel (CAP_NET_ADMIN: nfnetlink refuses others at once):
//! a kernel that never answers is a timeout that costs the socket, and a shutdown ends any wait promptly.

use nftkube::netlink::{
    Expect, Limits, MsgBuilder, NetlinkError, NlSocket, NLMSG_NOOP, NLM_F_ACK, NLM_F_REQUEST,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A netlink message the kernel accepts and never answers (NLMSG_NOOP without NLM_F_ACK), or answers with
/// a plain ACK; it touches nothing.
fn noop(seq: u32, flags: u16) -> Vec<u8> {
    MsgBuilder::new(NLMSG_NOOP, NLM_F_REQUEST | flags, seq)
        .finish()
        .expect("a bare header fits")
}

fn silent_socket(cancel: &'static AtomicBool) -> NlSocket {
    let mut s = NlSocket::open(libc::NETLINK_NETFILTER).expect("netlink socket");
    s.set_limits(Limits {
        silence: Duration::from_millis(300),
        total: Duration::from_secs(2),
    });
    s.set_cancel(cancel);
    s
}

#[test]
fn a_kernel_that_never_answers_is_a_timeout_and_the_socket_is_replaced() {
    let mut s = silent_socket(Box::leak(Box::new(AtomicBool::new(false))));
    let seq = s.reserve_seq(2);
    // The kernel acknowledges `seq`, but we wait for `seq + 1`: the stale ACK is no answer.
    let expect = Expect::Acks {
        first: seq + 1,
        last: seq + 1,
        ack: seq + 1,
        batch_begin: None,
    };
    let start = Instant::now();
    let e = s
        .transact("noop", &noop(seq, NLM_F_ACK), expect)
        .unwrap_err();
    assert!(matches!(e, NetlinkError::Timeout { .. }), "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    // The kernel may hand the new socket the old one's port id; what matters is the fresh queue.
    assert_eq!(s.replacements(), 1, "a broken exchange costs the socket");
    // The new socket works.
    let seq = s.reserve_seq(1);
    s.request_ack(&noop(seq, NLM_F_ACK)).unwrap();
}

#[test]
fn shutdown_ends_a_wait_within_100_ms() {
    let cancel: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
    let mut s = silent_socket(cancel);
    s.set_limits(Limits {
        silence: Duration::from_secs(30),
        total: Duration::from_secs(30),
    });
    let seq = s.reserve_seq(1);
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        cancel.store(true, Ordering::SeqCst);
        Instant::now()
    });
    let e = s.dump(&noop(seq, 0)).unwrap_err();
    let ended = Instant::now();
    let set_at = setter.join().unwrap();
    assert!(matches!(e, NetlinkError::Cancelled { .. }), "{e}");
    assert!(
        ended - set_at < Duration::from_millis(100),
        "{:?}",
        ended - set_at
    );
}
