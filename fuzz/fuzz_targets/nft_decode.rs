//! One nf_tables dump message's payload (nfgenmsg + attributes); the first byte picks the decoder (table,
//! chain, set, elements, rule). Properties: no panic; an error displays; what decodes, encoded by the
//! batch encoder, decodes to the same object (a rule's comment as stored: cut to 127 bytes).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::netlink::attr::messages;
use nftkube::nft::ir::{Family, Rule, Set};
use nftkube::nft::tx::{Change, Op, Transaction};
use nftkube::nft::wire::{
    decode_chain, decode_elements, decode_rule, decode_set, decode_table, encode_batch,
    stored_comment,
};

/// The payloads of the object messages `op` encodes to (the batch's BEGIN and END left out); None when
/// the object does not fit a netlink message.
fn encode(table: &str, op: Op) -> Option<Vec<Vec<u8>>> {
    let tx = Transaction {
        changes: vec![Change {
            family: Family::Ip,
            table: table.to_owned(),
            op,
        }],
    };
    let batch = encode_batch(&tx, 1).ok()?;
    let msgs: Vec<Vec<u8>> = messages(&batch.bytes).map(|m| m.payload.to_vec()).collect();
    Some(msgs[1..msgs.len() - 1].to_vec())
}

fn only(mut payloads: Vec<Vec<u8>>) -> Vec<u8> {
    assert_eq!(payloads.len(), 1, "one message per object");
    payloads.pop().unwrap()
}

fn chain(payload: &[u8]) {
    let Ok((table, c)) = decode_chain(payload).map_err(|e| e.to_string()) else {
        return;
    };
    let Some(p) = encode(&table, Op::AddChain(c.clone())) else {
        return;
    };
    assert_eq!(decode_chain(&only(p)).unwrap(), (table, c));
}

fn set(payload: &[u8]) {
    let Ok((table, s, _)) = decode_set(payload).map_err(|e| e.to_string()) else {
        return;
    };
    let Some(p) = encode(&table, Op::AddSet(s.clone())) else {
        return;
    };
    let (t2, s2, _) = decode_set(&only(p)).unwrap();
    // An empty key typeof marks user data that is not ours (never equal to a set we render); it has no
    // encoding of its own, so only the rest of such a set is compared.
    let unmarked = |s: Set| match s.key_typeof.as_deref() {
        Some([]) => Set {
            key_typeof: None,
            ..s
        },
        _ => s,
    };
    if s.key_typeof.as_deref() == Some(&[]) {
        assert_eq!((t2, unmarked(s2)), (table, unmarked(s)));
    } else {
        assert_eq!((t2, s2), (table, s));
    }
}

fn elements(payload: &[u8]) {
    let Ok((table, set, elements)) = decode_elements(payload).map_err(|e| e.to_string()) else {
        return;
    };
    let op = Op::AddElements {
        set: set.clone(),
        elements: elements.clone(),
    };
    let Some(p) = encode(&table, op) else {
        return;
    };
    let mut back = Vec::new();
    for m in p {
        let (t2, s2, e2) = decode_elements(&m).unwrap();
        assert_eq!((&t2, &s2), (&table, &set));
        back.extend(e2);
    }
    assert_eq!(back, elements);
}

fn rule(payload: &[u8]) {
    let Ok((table, chain, r)) = decode_rule(payload).map_err(|e| e.to_string()) else {
        return;
    };
    let op = Op::AddRule {
        chain: chain.clone(),
        rule: r.clone(),
    };
    let Some(p) = encode(&table, op) else {
        return;
    };
    let want = Rule {
        comment: r.comment.as_deref().map(|c| stored_comment(c).to_owned()),
        ..r
    };
    assert_eq!(decode_rule(&only(p)).unwrap(), (table, chain, want));
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, payload)) = data.split_first() else {
        return;
    };
    match selector % 5 {
        0 => {
            let _ = decode_table(payload).map_err(|e| e.to_string());
        }
        1 => chain(payload),
        2 => set(payload),
        3 => elements(payload),
        _ => rule(payload),
    }
});
