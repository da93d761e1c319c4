//! One dumped ctnetlink message's payload (nfgenmsg + attributes). Properties: no panic; a decoded entry
//! re-encoded as a NEW message decodes to the same tuples (ports only where the protocol has them), mark, zone and timeout.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::conntrack::wire::{decode_entry, encode_new, NewEntry, Tuple, ZoneScope};
use nftkube::netlink::attr::messages;

/// A tuple as a message carries it: ports only for protocols that have them (TCP, UDP, DCCP, SCTP,
/// UDP-Lite), as the kernel does.
fn sent(t: Tuple) -> Tuple {
    if matches!(t.proto, 6 | 17 | 33 | 132 | 136) {
        t
    } else {
        Tuple {
            sport: 0,
            dport: 0,
            ..t
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some(e) = decode_entry(data) else {
        return;
    };
    // A NEW message sets one zone for both directions; an original-only zone has no NEW form.
    let zone = match e.zone {
        ZoneScope::None => 0,
        ZoneScope::Both(z) => z,
        ZoneScope::Orig(_) => return,
    };
    let new = NewEntry {
        orig: e.orig,
        reply: e.reply,
        timeout_s: e.timeout,
        mark: e.mark,
        zone,
    };
    let bytes = encode_new(&new, 1, false);
    let msg = messages(&bytes).next().expect("one message");
    let back = decode_entry(msg.payload).expect("an encoded entry decodes");
    assert_eq!((back.orig, back.reply), (sent(e.orig), sent(e.reply)));
    assert_eq!(
        (back.mark, back.timeout, back.zone),
        (e.mark, e.timeout, e.zone)
    );
});
