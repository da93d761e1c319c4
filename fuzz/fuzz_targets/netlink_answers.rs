//! Datagrams fed to the sans-IO exchange (`netlink::Exchange`), which decodes NLMSG_ERROR (errno, extended
//! ack) and NLMSG_DONE. Input: a selector byte (what the exchange waits for), then datagrams, each prefixed
//! with its length (u16, little endian). Properties: no panic; every error displays, and a kernel refusal
//! has an errno.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::netlink::{Exchange, Expect, NetlinkError, Outcome, Progress, Request};

/// Our port id: the corpus' datagrams are addressed to it.
const PORT: u32 = 0;

fn check(e: &NetlinkError) {
    assert!(!e.to_string().is_empty());
    if e.is_refusal() {
        assert!(e.errno().is_some());
    }
    let _ = (e.ext_ack(), e.breaks_socket(), e.needs_new_credentials());
}

fn expect(selector: u8) -> Expect {
    if selector & 1 == 0 {
        Expect::Answer { seq: 1 }
    } else {
        Expect::Acks {
            first: 1,
            last: 3,
            ack: 3,
            batch_begin: (selector & 2 != 0).then_some(1),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, mut rest)) = data.split_first() else {
        return;
    };
    let request = Request {
        what: "fuzz".into(),
        seq: 1,
    };
    let mut ex = Exchange::new(request, expect(selector), PORT);
    let mut sink = |_t: u16, _p: &[u8]| {};
    while rest.len() >= 2 && ex.progress() != Progress::Complete {
        let len = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        let (datagram, tail) = rest[2..].split_at(len);
        rest = tail;
        if let Err(e) = ex.feed(datagram, &mut sink) {
            return check(&e);
        }
    }
    match ex.finish() {
        Ok(Outcome::Acked(errors)) => errors.iter().for_each(check),
        Ok(Outcome::Faulty(f)) => assert!(!f.to_string().is_empty()),
        Ok(Outcome::Answered) => {}
        Err(e) => check(&e),
    }
});
