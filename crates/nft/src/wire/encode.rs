//! Encoding of transactions into one nf_tables netlink batch. Pure: bytes in, bytes out.

use super::consts::*;
use crate::ir::*;
use crate::tx::{Change, Op, Transaction};
use nftkube_netlink::{
    LengthError, MsgBuilder, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST,
};

/// Elements per NEWSETELEM message are limited by the 64 KiB length of the nested element list attribute.
const MAX_ELEMENT_BYTES: usize = 48 * 1024;

/// An encoded batch and the map from sequence numbers back to the transaction's changes.
#[derive(Debug)]
pub struct EncodedBatch {
    /// The batch's bytes, ready for one `sendmsg`.
    pub bytes: Vec<u8>,
    /// (sequence number, index of the change in the transaction) for every object message.
    pub(crate) seqs: Vec<(u32, usize)>,
    /// The sequence number whose acknowledgement closes the batch.
    pub ack_seq: u32,
}

impl EncodedBatch {
    /// The change a kernel error's sequence number points at.
    pub(crate) fn change_index(&self, seq: u32) -> Option<usize> {
        self.seqs.iter().find(|(s, _)| *s == seq).map(|(_, i)| *i)
    }
}

fn nfgen(family: u8, res_id: u16) -> [u8; 4] {
    let r = res_id.to_be_bytes();
    [family, 0, r[0], r[1]]
}

fn msg_type(t: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | t
}

/// Encodes the transaction as BEGIN, one message per object (element lists split into chunks), END.
/// Sequence numbers start at `first_seq`. Only the last object message asks for an ACK (see socket.rs).
pub fn encode_batch(tx: &Transaction, first_seq: u32) -> Result<EncodedBatch, LengthError> {
    encode_batch_at(tx, first_seq, None)
}

/// As [`encode_batch`], and with `generation`, BATCH_BEGIN carries NFNL_BATCH_GENID: the kernel then applies
/// the batch only if the ruleset generation is still that one, and otherwise refuses all of it with ERESTART
/// on BATCH_BEGIN (nothing applied). A generation of 0 asks for no check: the kernel reads 0 as "absent".
pub fn encode_batch_at(
    tx: &Transaction,
    first_seq: u32,
    generation: Option<u32>,
) -> Result<EncodedBatch, LengthError> {
    let mut seq = first_seq;
    let mut bytes = Vec::new();
    let mut begin = MsgBuilder::new(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq);
    begin.raw(&nfgen(0, NFNL_SUBSYS_NFTABLES));
    if let Some(generation) = generation {
        begin.attr_be32(NFNL_BATCH_GENID, generation);
    }
    bytes.extend(begin.finish()?);
    seq = seq.wrapping_add(1);

    let mut msgs: Vec<(u16, u8, usize, Body)> = Vec::new();
    for (i, change) in tx.changes.iter().enumerate() {
        for (t, flags, body) in object_messages(change) {
            msgs.push((t, flags, i, body));
        }
    }
    let mut seqs = Vec::with_capacity(msgs.len());
    let n = msgs.len();
    for (k, (t, extra, i, body)) in msgs.into_iter().enumerate() {
        let mut flags = NLM_F_REQUEST | ((extra as u16) << 8);
        if k + 1 == n {
            flags |= NLM_F_ACK;
        }
        let mut m = MsgBuilder::new(msg_type(t), flags, seq);
        m.raw(&nfgen(tx.changes[i].family.nfproto(), 0));
        body(&mut m);
        bytes.extend(m.finish()?);
        seqs.push((seq, i));
        seq = seq.wrapping_add(1);
    }
    let ack_seq = seqs.last().map(|(s, _)| *s).unwrap_or(first_seq);
    let mut end = MsgBuilder::new(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq);
    end.raw(&nfgen(0, NFNL_SUBSYS_NFTABLES));
    bytes.extend(end.finish()?);
    Ok(EncodedBatch {
        bytes,
        seqs,
        ack_seq,
    })
}

/// The number of sequence numbers `encode_batch` will use for this transaction.
pub fn seq_count(tx: &Transaction) -> u32 {
    2 + tx
        .changes
        .iter()
        .map(|c| object_messages(c).len() as u32)
        .sum::<u32>()
}

/// Writes the attributes of one message; borrows the change, so nothing is copied while encoding.
type Body<'a> = Box<dyn Fn(&mut MsgBuilder) + 'a>;

/// NEWTABLE's attributes: the name, and flags 0, explicit: without NLM_F_EXCL on an existing table the message
/// is an update, and flags 0 wakes a dormant one.
fn new_table(table: &str) -> Body<'_> {
    Box::new(move |m: &mut MsgBuilder| {
        m.attr_str(NFTA_TABLE_NAME, table);
        m.attr_be32(NFTA_TABLE_FLAGS, 0);
    })
}

/// Message type, high flag byte (CREATE/APPEND >> 8) and attribute writer for each message of a change.
fn object_messages(c: &Change) -> Vec<(u16, u8, Body<'_>)> {
    let table = c.table.as_str();
    let create = (NLM_F_CREATE >> 8) as u8;
    match &c.op {
        Op::AddTable => vec![(NFT_MSG_NEWTABLE, create, new_table(table))],
        Op::CreateTable => vec![(
            NFT_MSG_NEWTABLE,
            create | (NLM_F_EXCL >> 8) as u8,
            new_table(table),
        )],
        Op::DeleteTable => vec![(
            NFT_MSG_DELTABLE,
            0,
            Box::new(move |m: &mut MsgBuilder| {
                m.attr_str(NFTA_TABLE_NAME, table);
            }),
        )],
        Op::AddChain(chain) => vec![(
            NFT_MSG_NEWCHAIN,
            create,
            Box::new(move |m: &mut MsgBuilder| encode_chain(m, table, chain)),
        )],
        Op::FlushChain(name) => vec![(
            NFT_MSG_DELRULE,
            0,
            Box::new(move |m: &mut MsgBuilder| {
                m.attr_str(NFTA_RULE_TABLE, table);
                m.attr_str(NFTA_RULE_CHAIN, name);
            }),
        )],
        Op::DeleteChain(name) => vec![(
            NFT_MSG_DELCHAIN,
            0,
            Box::new(move |m: &mut MsgBuilder| {
                m.attr_str(NFTA_CHAIN_TABLE, table);
                m.attr_str(NFTA_CHAIN_NAME, name);
            }),
        )],
        Op::DeleteRule { chain, handle } => vec![(
            NFT_MSG_DELRULE,
            0,
            Box::new(move |m: &mut MsgBuilder| {
                m.attr_str(NFTA_RULE_TABLE, table);
                m.attr_str(NFTA_RULE_CHAIN, chain);
                m.attr_be64(NFTA_RULE_HANDLE, *handle);
            }),
        )],
        Op::AddRule { chain, rule } => rule_messages(table, chain, rule),
        Op::AddSet(set) => vec![(
            NFT_MSG_NEWSET,
            create,
            Box::new(move |m: &mut MsgBuilder| encode_set(m, table, set)),
        )],
        Op::DeleteSet(name) => vec![(
            NFT_MSG_DELSET,
            0,
            Box::new(move |m: &mut MsgBuilder| {
                m.attr_str(NFTA_SET_TABLE, table);
                m.attr_str(NFTA_SET_NAME, name);
            }),
        )],
        Op::AddElements { set, elements } => element_chunks(elements)
            .into_iter()
            .map(|chunk| {
                (
                    NFT_MSG_NEWSETELEM,
                    create,
                    Box::new(move |m: &mut MsgBuilder| encode_elements(m, table, set, chunk))
                        as Body,
                )
            })
            .collect(),
        Op::AddCommentedElements { set, elements } => elements
            .chunks(COMMENTED_PER_MESSAGE)
            .map(|chunk| {
                (
                    NFT_MSG_NEWSETELEM,
                    create,
                    Box::new(move |m: &mut MsgBuilder| {
                        encode_commented_elements(m, table, set, chunk)
                    }) as Body,
                )
            })
            .collect(),
        Op::DeleteElements { set, elements } => element_chunks(elements)
            .into_iter()
            .map(|chunk| {
                (
                    NFT_MSG_DELSETELEM,
                    0,
                    Box::new(move |m: &mut MsgBuilder| encode_elements(m, table, set, chunk))
                        as Body,
                )
            })
            .collect(),
    }
}

/// A rule, preceded by the anonymous sets it owns (created in the same batch and bound to it, as nft does).
fn rule_messages<'a>(table: &'a str, chain: &'a str, rule: &'a Rule) -> Vec<(u16, u8, Body<'a>)> {
    let create = (NLM_F_CREATE >> 8) as u8;
    let append = (NLM_F_APPEND >> 8) as u8;
    let anon: Vec<(&AnonSet, u32)> = rule
        .exprs
        .iter()
        .filter_map(|e| match e {
            Expr::LookupAnon { set, .. } => Some((set, next_anon_set_id())),
            _ => None,
        })
        .collect();
    let mut msgs: Vec<(u16, u8, Body<'a>)> = Vec::new();
    for &(set, id) in &anon {
        msgs.push((
            NFT_MSG_NEWSET,
            create,
            Box::new(move |m: &mut MsgBuilder| encode_anon_set(m, table, set, id)),
        ));
        msgs.push((
            NFT_MSG_NEWSETELEM,
            create,
            Box::new(move |m: &mut MsgBuilder| encode_anon_elements(m, table, set, id)),
        ));
    }
    let ids: Vec<u32> = anon.iter().map(|(_, id)| *id).collect();
    msgs.push((
        NFT_MSG_NEWRULE,
        create | append,
        Box::new(move |m: &mut MsgBuilder| encode_rule(m, table, chain, rule, &ids)),
    ));
    msgs
}

/// Set IDs of anonymous sets only need to be unique within a batch; a process-wide counter is.
fn next_anon_set_id() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0x4000_0000);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

fn encode_anon_set(m: &mut MsgBuilder, table: &str, set: &AnonSet, id: u32) {
    m.attr_str(NFTA_SET_TABLE, table);
    m.attr_str(NFTA_SET_NAME, ANON_SET_NAME);
    m.attr_be32(NFTA_SET_FLAGS, NFT_SET_ANONYMOUS | NFT_SET_CONSTANT);
    m.attr_be32(NFTA_SET_KEY_TYPE, set.key.nft_id());
    m.attr_be32(NFTA_SET_KEY_LEN, set.key.len() as u32);
    m.attr_be32(NFTA_SET_ID, id);
    m.nested(NFTA_SET_DESC, |m| {
        m.attr_be32(NFTA_SET_DESC_SIZE, set.elements.len() as u32);
    });
    let udata = crate::udata::set_userdata(crate::udata::Declared {
        key: std::slice::from_ref(&set.key),
        data: &[],
        key_typeof: Some(std::slice::from_ref(&set.key_typeof)),
        data_typeof: None,
        anonymous: true,
    });
    m.attr(NFTA_SET_USERDATA, &udata);
}

fn encode_anon_elements(m: &mut MsgBuilder, table: &str, set: &AnonSet, id: u32) {
    m.attr_str(NFTA_SET_ELEM_LIST_TABLE, table);
    m.attr_str(NFTA_SET_ELEM_LIST_SET, ANON_SET_NAME);
    m.attr_be32(NFTA_SET_ELEM_LIST_SET_ID, id);
    m.nested(NFTA_SET_ELEM_LIST_ELEMENTS, |m| {
        for key in &set.elements {
            m.nested(NFTA_LIST_ELEM, |m| {
                m.nested(NFTA_SET_ELEM_KEY, |m| {
                    m.attr(NFTA_DATA_VALUE, key);
                });
            });
        }
    });
}

/// Consecutive runs of elements that each fit one message.
fn element_chunks(elements: &[Element]) -> Vec<&[Element]> {
    let mut chunks = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, e) in elements.iter().enumerate() {
        let s = element_size(e);
        if size + s > MAX_ELEMENT_BYTES && i > start {
            chunks.push(&elements[start..i]);
            start = i;
            size = 0;
        }
        size += s;
    }
    if start < elements.len() {
        chunks.push(&elements[start..]);
    }
    chunks
}

fn element_size(e: &Element) -> usize {
    let value = match &e.value {
        None => 0,
        Some(ElementValue::Data(d)) => 8 + d.len(),
        Some(ElementValue::Verdict(v)) => 24 + v.chain().map_or(0, |c| c.len() + 1),
    };
    24 + e.key.len() + value + 8
}

fn encode_chain(m: &mut MsgBuilder, table: &str, chain: &Chain) {
    m.attr_str(NFTA_CHAIN_TABLE, table);
    m.attr_str(NFTA_CHAIN_NAME, &chain.name);
    if let Some(b) = &chain.base {
        m.nested(NFTA_CHAIN_HOOK, |m| {
            m.attr_be32(NFTA_HOOK_HOOKNUM, b.hook.number());
            m.attr_be32(NFTA_HOOK_PRIORITY, b.priority as u32);
            if let Some(dev) = &b.device {
                m.attr_str(NFTA_HOOK_DEV, dev);
            }
        });
        // Always explicit: on an existing chain this message is an update, and it must set the policy back.
        m.attr_be32(NFTA_CHAIN_POLICY, b.policy.number());
        m.attr_str(NFTA_CHAIN_TYPE, b.chain_type.as_str());
    }
}

/// A named set's NFT_SET_* flags, as the kernel stores them: from what the set declares.
pub(crate) fn set_flags(set: &Set) -> u32 {
    let mut f = 0;
    if set.is_map() {
        f |= NFT_SET_MAP;
    }
    if set.timeout_ms.is_some() {
        f |= NFT_SET_TIMEOUT;
    }
    if set.dynamic {
        f |= NFT_SET_EVAL;
    }
    f
}

fn encode_set(m: &mut MsgBuilder, table: &str, set: &Set) {
    m.attr_str(NFTA_SET_TABLE, table);
    m.attr_str(NFTA_SET_NAME, &set.name);
    m.attr_be32(NFTA_SET_FLAGS, set_flags(set));
    m.attr_be32(NFTA_SET_KEY_TYPE, concat_type_id(&set.key));
    m.attr_be32(NFTA_SET_KEY_LEN, key_len(&set.key) as u32);
    if set.is_verdict_map() {
        m.attr_be32(NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT);
    } else if set.is_map() {
        m.attr_be32(NFTA_SET_DATA_TYPE, concat_type_id(&set.data));
        m.attr_be32(NFTA_SET_DATA_LEN, key_len(&set.data) as u32);
    }
    if let Some(ms) = set.timeout_ms {
        m.attr_be64(NFTA_SET_TIMEOUT, ms);
    }
    if let Some(size) = set.size {
        m.nested(NFTA_SET_DESC, |m| {
            m.attr_be32(NFTA_SET_DESC_SIZE, size);
        });
    }
    // The kernel requires an ID (it lets later messages of the batch name the set before it has a
    // handle). We always refer to sets by name, so any stable number will do.
    m.attr_be32(NFTA_SET_ID, set_id(&set.name));
    let udata = crate::udata::set_userdata(crate::udata::Declared::of(set));
    m.attr(NFTA_SET_USERDATA, &udata);
}

fn set_id(name: &str) -> u32 {
    name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

fn encode_elements(m: &mut MsgBuilder, table: &str, set: &str, elements: &[Element]) {
    m.attr_str(NFTA_SET_ELEM_LIST_TABLE, table);
    m.attr_str(NFTA_SET_ELEM_LIST_SET, set);
    m.nested(NFTA_SET_ELEM_LIST_ELEMENTS, |m| {
        for e in elements {
            m.nested(NFTA_LIST_ELEM, |m| encode_element(m, e));
        }
    });
}

/// Commented elements per NEWSETELEM message: each is at most ~64 bytes of key and value plus a comment of
/// at most `ELEMENT_COMMENT_MAX` bytes, so 200 stay well inside the 64 KiB attribute limit.
const COMMENTED_PER_MESSAGE: usize = 200;

fn encode_commented_elements(
    m: &mut MsgBuilder,
    table: &str,
    set: &str,
    elements: &[CommentedElement],
) {
    m.attr_str(NFTA_SET_ELEM_LIST_TABLE, table);
    m.attr_str(NFTA_SET_ELEM_LIST_SET, set);
    m.nested(NFTA_SET_ELEM_LIST_ELEMENTS, |m| {
        for e in elements {
            m.nested(NFTA_LIST_ELEM, |m| {
                encode_element(m, &e.element);
                m.attr(NFTA_SET_ELEM_USERDATA, &element_comment_udata(&e.comment));
            });
        }
    });
}

/// An element comment as nft writes it: one TLV, the text NUL-terminated.
pub(crate) fn element_comment_udata(comment: &str) -> Vec<u8> {
    let text = &comment.as_bytes()[..comment.len().min(ELEMENT_COMMENT_MAX)];
    let mut out = vec![NFTNL_UDATA_SET_ELEM_COMMENT, text.len() as u8 + 1];
    out.extend_from_slice(text);
    out.push(0);
    out
}

fn encode_element(m: &mut MsgBuilder, e: &Element) {
    m.nested(NFTA_SET_ELEM_KEY, |m| {
        m.attr(NFTA_DATA_VALUE, &e.key);
    });
    match &e.value {
        None => {}
        Some(ElementValue::Data(d)) => {
            m.nested(NFTA_SET_ELEM_DATA, |m| {
                m.attr(NFTA_DATA_VALUE, d);
            });
        }
        Some(ElementValue::Verdict(v)) => {
            m.nested(NFTA_SET_ELEM_DATA, |m| encode_verdict(m, v));
        }
    }
}

fn encode_verdict(m: &mut MsgBuilder, v: &Verdict) {
    m.nested(NFTA_DATA_VERDICT, |m| {
        m.attr_be32(NFTA_VERDICT_CODE, v.code() as u32);
        if let Some(c) = v.chain() {
            m.attr_str(NFTA_VERDICT_CHAIN, c);
        }
    });
}

/// `anon_ids`: the batch IDs of the rule's anonymous sets, in the order its expressions use them.
fn encode_rule(m: &mut MsgBuilder, table: &str, chain: &str, rule: &Rule, anon_ids: &[u32]) {
    m.attr_str(NFTA_RULE_TABLE, table);
    m.attr_str(NFTA_RULE_CHAIN, chain);
    let mut ids = anon_ids.iter();
    m.nested(NFTA_RULE_EXPRESSIONS, |m| {
        for e in &rule.exprs {
            m.nested(NFTA_LIST_ELEM, |m| {
                m.attr_str(NFTA_EXPR_NAME, e.kernel_name());
                m.nested(NFTA_EXPR_DATA, |m| match e {
                    Expr::LookupAnon { sreg, .. } => {
                        m.attr_str(NFTA_LOOKUP_SET, ANON_SET_NAME);
                        m.attr_be32(NFTA_LOOKUP_SREG, *sreg);
                        let id = ids.next().expect("an ID for every anonymous set");
                        m.attr_be32(NFTA_LOOKUP_SET_ID, *id);
                    }
                    _ => encode_expr(m, e),
                });
            });
        }
    });
    if let Some(c) = &rule.comment {
        m.attr(NFTA_RULE_USERDATA, &comment_udata(c));
    }
}

/// The longest comment stored, in bytes, without its NUL (nft accepts 128 with the NUL).
pub(crate) const MAX_COMMENT_BYTES: usize = 127;

/// The part of a comment that is stored in the kernel and read back: at most `MAX_COMMENT_BYTES`, cut at a
/// character boundary (a cut inside a UTF-8 sequence would not decode back as text).
pub fn stored_comment(c: &str) -> &str {
    let mut end = c.len().min(MAX_COMMENT_BYTES);
    while !c.is_char_boundary(end) {
        end -= 1;
    }
    &c[..end]
}

/// nftnl's userdata TLV holding a comment (NUL-terminated, at most 128 bytes with the NUL).
pub(crate) fn comment_udata(c: &str) -> Vec<u8> {
    let mut text: Vec<u8> = stored_comment(c).as_bytes().to_vec();
    text.push(0);
    let mut out = vec![NFTNL_UDATA_RULE_COMMENT, text.len() as u8];
    out.extend(text);
    out
}

fn encode_expr(m: &mut MsgBuilder, e: &Expr) {
    match e {
        Expr::Payload {
            base,
            offset,
            len,
            dreg,
        } => {
            m.attr_be32(NFTA_PAYLOAD_DREG, *dreg);
            m.attr_be32(
                NFTA_PAYLOAD_BASE,
                match base {
                    PayloadBase::LinkLayer => 0,
                    PayloadBase::Network => 1,
                    PayloadBase::Transport => 2,
                },
            );
            m.attr_be32(NFTA_PAYLOAD_OFFSET, *offset);
            m.attr_be32(NFTA_PAYLOAD_LEN, *len);
        }
        Expr::Meta { key, dreg } => {
            m.attr_be32(NFTA_META_KEY, key.number());
            m.attr_be32(NFTA_META_DREG, *dreg);
        }
        Expr::MetaSet { key, sreg } => {
            m.attr_be32(NFTA_META_KEY, key.number());
            m.attr_be32(NFTA_META_SREG, *sreg);
        }
        Expr::Cmp { sreg, op, data } => {
            m.attr_be32(NFTA_CMP_SREG, *sreg);
            m.attr_be32(NFTA_CMP_OP, op.number());
            m.nested(NFTA_CMP_DATA, |m| {
                m.attr(NFTA_DATA_VALUE, data);
            });
        }
        Expr::Bitwise {
            sreg,
            dreg,
            len,
            mask,
            xor,
        } => {
            m.attr_be32(NFTA_BITWISE_SREG, *sreg);
            m.attr_be32(NFTA_BITWISE_DREG, *dreg);
            m.attr_be32(NFTA_BITWISE_LEN, *len);
            m.nested(NFTA_BITWISE_MASK, |m| {
                m.attr(NFTA_DATA_VALUE, mask);
            });
            m.nested(NFTA_BITWISE_XOR, |m| {
                m.attr(NFTA_DATA_VALUE, xor);
            });
        }
        Expr::Immediate { dreg, data } => {
            m.attr_be32(NFTA_IMMEDIATE_DREG, *dreg);
            m.nested(NFTA_IMMEDIATE_DATA, |m| {
                m.attr(NFTA_DATA_VALUE, data);
            });
        }
        Expr::Verdict(v) => {
            m.attr_be32(NFTA_IMMEDIATE_DREG, REG_VERDICT);
            m.nested(NFTA_IMMEDIATE_DATA, |m| encode_verdict(m, v));
        }
        Expr::Lookup {
            set,
            sreg,
            dreg,
            invert,
        } => {
            m.attr_str(NFTA_LOOKUP_SET, set);
            m.attr_be32(NFTA_LOOKUP_SREG, *sreg);
            if let Some(d) = dreg {
                m.attr_be32(NFTA_LOOKUP_DREG, *d);
            }
            if *invert {
                m.attr_be32(NFTA_LOOKUP_FLAGS, NFT_LOOKUP_F_INV);
            }
        }
        Expr::Numgen {
            dreg,
            modulus,
            random,
            offset,
        } => {
            m.attr_be32(NFTA_NG_DREG, *dreg);
            m.attr_be32(NFTA_NG_MODULUS, *modulus);
            m.attr_be32(
                NFTA_NG_TYPE,
                if *random {
                    NFT_NG_RANDOM
                } else {
                    NFT_NG_INCREMENTAL
                },
            );
            if *offset != 0 {
                m.attr_be32(NFTA_NG_OFFSET, *offset);
            }
        }
        Expr::Dynset {
            set,
            op,
            sreg_key,
            sreg_data,
            timeout_ms,
        } => {
            m.attr_str(NFTA_DYNSET_SET_NAME, set);
            m.attr_be32(
                NFTA_DYNSET_OP,
                match op {
                    DynsetOp::Add => 0,
                    DynsetOp::Update => 1,
                },
            );
            m.attr_be32(NFTA_DYNSET_SREG_KEY, *sreg_key);
            if let Some(d) = sreg_data {
                m.attr_be32(NFTA_DYNSET_SREG_DATA, *d);
            }
            if let Some(t) = timeout_ms {
                m.attr_be64(NFTA_DYNSET_TIMEOUT, *t);
            }
        }
        Expr::Nat {
            kind,
            family,
            reg_addr,
            reg_proto,
            flags,
        } => {
            m.attr_be32(
                NFTA_NAT_TYPE,
                match kind {
                    NatKind::Snat => 0,
                    NatKind::Dnat => 1,
                },
            );
            m.attr_be32(NFTA_NAT_FAMILY, family.nfproto() as u32);
            if let Some(r) = reg_addr {
                m.attr_be32(NFTA_NAT_REG_ADDR_MIN, *r);
            }
            if let Some(r) = reg_proto {
                m.attr_be32(NFTA_NAT_REG_PROTO_MIN, *r);
            }
            if !flags.is_empty() {
                m.attr_be32(NFTA_NAT_FLAGS, flags.bits());
            }
        }
        Expr::Masq { flags } => {
            if !flags.is_empty() {
                m.attr_be32(NFTA_MASQ_FLAGS, flags.bits());
            }
        }
        Expr::Redir { reg_proto, flags } => {
            if let Some(r) = reg_proto {
                m.attr_be32(NFTA_REDIR_REG_PROTO_MIN, *r);
            }
            if !flags.is_empty() {
                m.attr_be32(NFTA_REDIR_FLAGS, flags.bits());
            }
        }
        Expr::Reject(kind) => {
            let (t, code) = match kind {
                RejectKind::IcmpUnreach(c) => (0, *c),
                RejectKind::TcpReset => (1, 0),
                RejectKind::IcmpxUnreach(c) => (2, *c),
            };
            m.attr_be32(NFTA_REJECT_TYPE, t);
            m.attr_u8(NFTA_REJECT_ICMP_CODE, code);
        }
        Expr::Ct { key, dreg } => {
            m.attr_be32(NFTA_CT_DREG, *dreg);
            m.attr_be32(NFTA_CT_KEY, key.number());
        }
        Expr::CtOriginal { key, dreg } => {
            m.attr_be32(NFTA_CT_DREG, *dreg);
            m.attr_be32(NFTA_CT_KEY, key.number());
            m.attr_u8(NFTA_CT_DIRECTION, 0);
        }
        Expr::LookupAnon { .. } => unreachable!("encode_rule writes anonymous lookups"),
        Expr::Fib {
            flags,
            result,
            dreg,
        } => {
            m.attr_be32(NFTA_FIB_DREG, *dreg);
            m.attr_be32(NFTA_FIB_RESULT, result.number());
            m.attr_be32(NFTA_FIB_FLAGS, flags.bits());
        }
        Expr::Counter => {
            m.attr_be64(NFTA_COUNTER_BYTES, 0);
            m.attr_be64(NFTA_COUNTER_PACKETS, 0);
        }
    }
}

/// A dump request for one object kind of one family, optionally naming the table (and set, for elements).
pub(crate) fn dump_request(
    msg: u16,
    family: Family,
    table: Option<&str>,
    set: Option<&str>,
    seq: u32,
) -> Result<Vec<u8>, LengthError> {
    let flags = NLM_F_REQUEST | nftkube_netlink::NLM_F_DUMP;
    let mut m = MsgBuilder::new(msg_type(msg), flags, seq);
    m.raw(&nfgen(family.nfproto(), 0));
    if let Some(t) = table {
        // NFTA_TABLE_NAME, NFTA_CHAIN_TABLE, NFTA_RULE_TABLE, NFTA_SET_TABLE and
        // NFTA_SET_ELEM_LIST_TABLE are all attribute 1.
        m.attr_str(1, t);
    }
    if let Some(s) = set {
        m.attr_str(NFTA_SET_ELEM_LIST_SET, s);
    }
    m.finish()
}

/// A NFT_MSG_GETGEN request: the ruleset generation changes with every commit by anyone.
pub fn getgen_request(seq: u32) -> Result<Vec<u8>, LengthError> {
    let mut m = MsgBuilder::new(msg_type(NFT_MSG_GETGEN), NLM_F_REQUEST | NLM_F_ACK, seq);
    m.raw(&nfgen(0, 0));
    m.finish()
}
