//! Decoding of nf_tables dump messages back into the IR, so the kernel's state can be compared with ours.

use super::consts::*;
use crate::ir::*;
use nftkube_netlink::attr::{Attr, Attrs};

#[derive(Debug, thiserror::Error)]
#[error("cannot decode nf_tables {what}: {reason}")]
/// A kernel message that does not decode into the IR.
pub struct DecodeError {
    /// What kind of message ("table", "rule", ...).
    pub what: &'static str,
    /// What is wrong with it.
    pub(crate) reason: String,
}

fn err(what: &'static str, reason: impl Into<String>) -> DecodeError {
    DecodeError {
        what,
        reason: reason.into(),
    }
}

/// Splits off the nfgenmsg header: (family, attributes).
fn split<'a>(payload: &'a [u8], what: &'static str) -> Result<(u8, Attrs<'a>), DecodeError> {
    if payload.len() < 4 {
        return Err(err(what, "short message"));
    }
    Ok((payload[0], Attrs(&payload[4..])))
}

fn req_str<'a>(
    a: &Attrs<'a>,
    kind: u16,
    what: &'static str,
    field: &str,
) -> Result<&'a str, DecodeError> {
    a.get(kind)
        .and_then(|x| x.str())
        .ok_or_else(|| err(what, format!("missing {field}")))
}

fn be32(a: &Attrs<'_>, kind: u16) -> Option<u32> {
    a.get(kind).and_then(|x| x.be32())
}

/// A table message: (family, name).
pub fn decode_table(payload: &[u8]) -> Result<(Family, String), DecodeError> {
    let (fam, a) = split(payload, "table")?;
    let family = Family::from_nfproto(fam).ok_or_else(|| err("table", format!("family {fam}")))?;
    Ok((
        family,
        req_str(&a, NFTA_TABLE_NAME, "table", "name")?.to_owned(),
    ))
}

/// A table message's flags (none when absent).
pub(crate) fn decode_table_flags(payload: &[u8]) -> Result<TableFlags, DecodeError> {
    let (_, a) = split(payload, "table")?;
    Ok(TableFlags::from_bits_retain(
        be32(&a, NFTA_TABLE_FLAGS).unwrap_or(0),
    ))
}

/// A chain message: (table, chain).
pub fn decode_chain(payload: &[u8]) -> Result<(String, Chain), DecodeError> {
    let (_, a) = split(payload, "chain")?;
    let table = req_str(&a, NFTA_CHAIN_TABLE, "chain", "table")?.to_owned();
    let name = req_str(&a, NFTA_CHAIN_NAME, "chain", "name")?.to_owned();
    let base = match a.get(NFTA_CHAIN_HOOK) {
        None => None,
        Some(h) => {
            let h = h.nested();
            let hook = be32(&h, NFTA_HOOK_HOOKNUM)
                .and_then(Hook::from_number)
                .ok_or_else(|| err("chain", format!("{name}: hook")))?;
            let priority = be32(&h, NFTA_HOOK_PRIORITY).unwrap_or(0) as i32;
            let chain_type = a
                .get(NFTA_CHAIN_TYPE)
                .and_then(|t| t.str())
                .and_then(ChainType::parse)
                .unwrap_or(ChainType::Filter);
            // The kernel always dumps a base chain's policy; a value we do not know must not read as ours.
            let policy = be32(&a, NFTA_CHAIN_POLICY)
                .map(|p| {
                    Policy::from_number(p)
                        .ok_or_else(|| err("chain", format!("{name}: policy {p}")))
                })
                .transpose()?
                .unwrap_or(Policy::Accept);
            let device = h
                .get(NFTA_HOOK_DEV)
                .and_then(|d| d.str())
                .map(str::to_owned);
            Some(BaseHook {
                hook,
                chain_type,
                priority,
                policy,
                device,
            })
        }
    };
    Ok((table, Chain { name, base }))
}

/// A set message: (table, set, its NFT_SET_* flags as the kernel stores them).
pub fn decode_set(payload: &[u8]) -> Result<(String, Set, u32), DecodeError> {
    let (_, a) = split(payload, "set")?;
    let table = req_str(&a, NFTA_SET_TABLE, "set", "table")?.to_owned();
    let name = req_str(&a, NFTA_SET_NAME, "set", "name")?.to_owned();
    let flags = be32(&a, NFTA_SET_FLAGS).unwrap_or(0);
    let key_type = be32(&a, NFTA_SET_KEY_TYPE).unwrap_or(0);
    let key_len = be32(&a, NFTA_SET_KEY_LEN).unwrap_or(0) as usize;
    let key = split_type_id(key_type, key_len)
        .unwrap_or_else(|| vec![DataType::Integer(key_len.min(255) as u8)]);
    let data = if flags & NFT_SET_MAP != 0 {
        let dt = be32(&a, NFTA_SET_DATA_TYPE).unwrap_or(0);
        if dt == NFT_DATA_VERDICT {
            vec![DataType::Verdict]
        } else {
            let dl = be32(&a, NFTA_SET_DATA_LEN).unwrap_or(0) as usize;
            split_type_id(dt, dl).unwrap_or_else(|| vec![DataType::Integer(dl.min(255) as u8)])
        }
    } else {
        Vec::new()
    };
    let timeout_ms = a.get(NFTA_SET_TIMEOUT).and_then(|t| t.be64());
    let size = a
        .get(NFTA_SET_DESC)
        .and_then(|d| be32(&d.nested(), NFTA_SET_DESC_SIZE))
        .filter(|&n| n != 0);
    let udata = a.get(NFTA_SET_USERDATA).map(|u| u.payload).unwrap_or(&[]);
    let (key_typeof, data_typeof) = crate::udata::parse_typeof(udata);
    let set = Set {
        name,
        key,
        data,
        timeout_ms,
        dynamic: flags & NFT_SET_EVAL != 0,
        size,
        key_typeof,
        data_typeof,
    };
    // User data that is not exactly what we would write (someone else's set, or tampering) must not
    // compare equal to ours: an empty typeof, which we never declare, marks it.
    let ours = crate::udata::set_userdata(crate::udata::Declared::of(&set));
    let set = if flags & NFT_SET_ANONYMOUS == 0 && ours != udata {
        Set {
            key_typeof: Some(Vec::new()),
            ..set
        }
    } else {
        set
    };
    Ok((table, set, flags))
}

/// A set element message: (table, set, elements).
pub fn decode_elements(payload: &[u8]) -> Result<(String, String, Vec<Element>), DecodeError> {
    let (table, set, elements) = decode_commented_elements(payload)?;
    Ok((table, set, elements.into_iter().map(|(e, _)| e).collect()))
}

/// A set element message with each element's comment (nft's user data TLV), if it has one.
#[allow(clippy::type_complexity)]
pub(crate) fn decode_commented_elements(
    payload: &[u8],
) -> Result<(String, String, Vec<(Element, Option<String>)>), DecodeError> {
    let (_, a) = split(payload, "set elements")?;
    let table = req_str(&a, NFTA_SET_ELEM_LIST_TABLE, "set elements", "table")?.to_owned();
    let set = req_str(&a, NFTA_SET_ELEM_LIST_SET, "set elements", "set")?.to_owned();
    let mut out = Vec::new();
    if let Some(list) = a.get(NFTA_SET_ELEM_LIST_ELEMENTS) {
        for item in list.nested().iter().filter(|x| x.kind == NFTA_LIST_ELEM) {
            let e = item.nested();
            let key = e
                .get(NFTA_SET_ELEM_KEY)
                .and_then(|k| k.nested().get(NFTA_DATA_VALUE))
                .map(|v| v.payload.to_vec())
                .ok_or_else(|| err("set elements", format!("{set}: element without key")))?;
            let value = match e.get(NFTA_SET_ELEM_DATA) {
                None => None,
                Some(d) => {
                    Some(decode_data(d).map_err(|r| err("set elements", format!("{set}: {r}")))?)
                }
            };
            let comment = e
                .get(NFTA_SET_ELEM_USERDATA)
                .and_then(|u| element_comment(u.payload));
            let element = Element {
                key: key.into(),
                value,
            };
            out.push((element, comment));
        }
    }
    Ok((table, set, out))
}

/// The comment TLV of an element's user data (other TLVs, such as nft's flags, are skipped).
fn element_comment(mut udata: &[u8]) -> Option<String> {
    while udata.len() >= 2 {
        let (kind, len) = (udata[0], udata[1] as usize);
        let value = udata.get(2..2 + len)?;
        if kind == NFTNL_UDATA_SET_ELEM_COMMENT {
            let text = value.strip_suffix(&[0]).unwrap_or(value);
            return Some(String::from_utf8_lossy(text).into_owned());
        }
        udata = &udata[2 + len..];
    }
    None
}

fn decode_data(d: Attr<'_>) -> Result<ElementValue, String> {
    let inner = d.nested();
    if let Some(v) = inner.get(NFTA_DATA_VALUE) {
        return Ok(ElementValue::Data(v.payload.into()));
    }
    if let Some(v) = inner.get(NFTA_DATA_VERDICT) {
        return decode_verdict(v).map(ElementValue::Verdict);
    }
    Err("data without value or verdict".into())
}

/// A verdict attribute (NFTA_DATA_VERDICT's nest); the error says what is missing or unknown.
pub(crate) fn decode_verdict(v: Attr<'_>) -> Result<Verdict, String> {
    let v = v.nested();
    let code = be32(&v, NFTA_VERDICT_CODE).ok_or("verdict without code")? as i32;
    let chain = || {
        v.get(NFTA_VERDICT_CHAIN)
            .and_then(|c| c.str())
            .map(str::to_owned)
            .ok_or_else(|| "jump without chain".to_string())
    };
    Ok(match code {
        0 => Verdict::Drop,
        1 => Verdict::Accept,
        -1 => Verdict::Continue,
        -3 => Verdict::Jump(chain()?.into()),
        -4 => Verdict::Goto(chain()?.into()),
        -5 => Verdict::Return,
        c => return Err(format!("verdict code {c}")),
    })
}

/// A rule message: (table, chain, rule). A rule with an expression we do not model decodes to an empty
/// rule whose comment says so: it never equals a rule we render, so the chain gets rewritten.
pub fn decode_rule(payload: &[u8]) -> Result<(String, String, Rule), DecodeError> {
    let (_, a) = split(payload, "rule")?;
    let table = req_str(&a, NFTA_RULE_TABLE, "rule", "table")?.to_owned();
    let chain = req_str(&a, NFTA_RULE_CHAIN, "rule", "chain")?.to_owned();
    let comment = a
        .get(NFTA_RULE_USERDATA)
        .and_then(|u| parse_comment(u.payload));
    let mut exprs = Vec::new();
    if let Some(list) = a.get(NFTA_RULE_EXPRESSIONS) {
        for item in list.nested().iter().filter(|x| x.kind == NFTA_LIST_ELEM) {
            let e = item.nested();
            let name = e.get(NFTA_EXPR_NAME).and_then(|n| n.str()).unwrap_or("?");
            let data = e
                .get(NFTA_EXPR_DATA)
                .map(|d| d.nested())
                .unwrap_or(Attrs(&[]));
            match decode_expr(name, &data) {
                Ok(x) => exprs.push(x),
                Err(ExprError { reason, .. }) => {
                    return Ok((
                        table,
                        chain,
                        Rule {
                            exprs: Vec::new(),
                            comment: Some(format!("undecodable {name}: {reason}")),
                        },
                    ))
                }
            }
        }
    }
    Ok((table, chain, Rule { exprs, comment }))
}

/// What a cleanup of someone else's chains needs to know of one of their rules, read without modelling its
/// expressions (iptables-nft's rules hold xtables `match` and `target` expressions the IR has no place for).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleOutline {
    /// The rule's chain.
    pub chain: String,
    /// The kernel's handle of the rule.
    pub handle: u64,
    /// Its comment: nft's (user data), or iptables' `-m comment` (an xtables match).
    pub comment: Option<String>,
    /// Every chain the rule jumps or goes to (immediate verdicts).
    pub targets: Vec<String>,
    /// The verdict of its last expression, when that is an immediate verdict.
    pub last_verdict: Option<Verdict>,
    /// Whether a verdict in it did not decode: it may then lead to chains `targets` does not name.
    pub unreadable: bool,
}

/// A rule message as a [`RuleOutline`], with its table's name.
pub fn decode_rule_outline(payload: &[u8]) -> Result<(String, RuleOutline), DecodeError> {
    let (_, a) = split(payload, "rule")?;
    let table = req_str(&a, NFTA_RULE_TABLE, "rule", "table")?.to_owned();
    let mut outline = RuleOutline {
        chain: req_str(&a, NFTA_RULE_CHAIN, "rule", "chain")?.to_owned(),
        handle: decode_rule_handle(payload)?,
        comment: a
            .get(NFTA_RULE_USERDATA)
            .and_then(|u| parse_comment(u.payload)),
        targets: Vec::new(),
        last_verdict: None,
        unreadable: false,
    };
    if let Some(list) = a.get(NFTA_RULE_EXPRESSIONS) {
        for item in list.nested().iter().filter(|x| x.kind == NFTA_LIST_ELEM) {
            outline_expr(&mut outline, &item.nested());
        }
    }
    Ok((table, outline))
}

/// Adds what one expression says to the outline: a verdict, or an xtables comment.
fn outline_expr(outline: &mut RuleOutline, e: &Attrs<'_>) {
    let name = e.get(NFTA_EXPR_NAME).and_then(|n| n.str()).unwrap_or("");
    let data = e
        .get(NFTA_EXPR_DATA)
        .map(|d| d.nested())
        .unwrap_or(Attrs(&[]));
    outline.last_verdict = None;
    match name {
        "immediate" => {
            let Some(v) = data
                .get(NFTA_IMMEDIATE_DATA)
                .and_then(|d| d.nested().get(NFTA_DATA_VERDICT))
            else {
                return; // a value for a register, not a verdict
            };
            match decode_verdict(v) {
                Ok(v) => {
                    outline.targets.extend(v.chain().map(str::to_owned));
                    outline.last_verdict = Some(v);
                }
                Err(_) => outline.unreadable = true,
            }
        }
        "match" if data.get(NFTA_MATCH_NAME).and_then(|n| n.str()) == Some("comment") => {
            // struct xt_comment_info: the comment, NUL-terminated, in a 256-byte field.
            let info = data.get(NFTA_MATCH_INFO).map(|i| i.payload).unwrap_or(&[]);
            let end = info.iter().position(|b| *b == 0).unwrap_or(info.len());
            if let Ok(text) = std::str::from_utf8(&info[..end]) {
                outline.comment.get_or_insert_with(|| text.to_owned());
            }
        }
        _ => {}
    }
}

/// A rule message's handle (what trace events name the rule by).
pub(crate) fn decode_rule_handle(payload: &[u8]) -> Result<u64, DecodeError> {
    let (_, a) = split(payload, "rule")?;
    a.get(NFTA_RULE_HANDLE)
        .and_then(|h| h.be64())
        .ok_or_else(|| err("rule", "missing handle"))
}

fn parse_comment(mut udata: &[u8]) -> Option<String> {
    while udata.len() >= 2 {
        let (t, l) = (udata[0], udata[1] as usize);
        let v = udata.get(2..2 + l)?;
        if t == NFTNL_UDATA_RULE_COMMENT {
            let end = v.iter().position(|b| *b == 0).unwrap_or(v.len());
            return std::str::from_utf8(&v[..end]).ok().map(str::to_owned);
        }
        udata = &udata[2 + l..];
    }
    None
}

fn value(a: &Attrs<'_>, kind: u16) -> Option<Vec<u8>> {
    a.get(kind)
        .and_then(|d| d.nested().get(NFTA_DATA_VALUE))
        .map(|v| v.payload.to_vec())
}

fn need(a: &Attrs<'_>, kind: u16, field: &str) -> Result<u32, String> {
    be32(a, kind).ok_or_else(|| format!("missing {field}"))
}

/// An expression the IR does not model (or not in this form).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{expr} expression: {reason}")]
pub(crate) struct ExprError {
    /// The expression's kernel name ("payload", "nat", ...).
    pub(crate) expr: String,
    /// What in it is not modelled or missing.
    pub(crate) reason: String,
}

/// One expression from its kernel name and attributes.
pub(crate) fn decode_expr(name: &str, a: &Attrs<'_>) -> Result<Expr, ExprError> {
    expr_of(name, a).map_err(|reason| ExprError {
        expr: name.into(),
        reason,
    })
}

fn expr_of(name: &str, a: &Attrs<'_>) -> Result<Expr, String> {
    Ok(match name {
        "payload" => {
            if a.get(5).is_some() {
                return Err("payload write".into());
            }
            Expr::Payload {
                base: match need(a, NFTA_PAYLOAD_BASE, "base")? {
                    0 => PayloadBase::LinkLayer,
                    1 => PayloadBase::Network,
                    2 => PayloadBase::Transport,
                    b => return Err(format!("payload base {b}")),
                },
                offset: need(a, NFTA_PAYLOAD_OFFSET, "offset")?,
                len: need(a, NFTA_PAYLOAD_LEN, "len")?,
                dreg: need(a, NFTA_PAYLOAD_DREG, "dreg")?,
            }
        }
        "meta" => {
            let key = need(a, NFTA_META_KEY, "key")?;
            let key = MetaKey::from_number(key).ok_or_else(|| format!("meta key {key}"))?;
            match (be32(a, NFTA_META_DREG), be32(a, NFTA_META_SREG)) {
                (Some(dreg), _) => Expr::Meta { key, dreg },
                (None, Some(sreg)) => Expr::MetaSet { key, sreg },
                _ => return Err("meta without register".into()),
            }
        }
        "cmp" => Expr::Cmp {
            sreg: need(a, NFTA_CMP_SREG, "sreg")?,
            op: CmpOp::from_number(need(a, NFTA_CMP_OP, "op")?).ok_or("cmp op")?,
            data: value(a, NFTA_CMP_DATA).ok_or("cmp data")?,
        },
        "bitwise" => {
            if be32(a, 6).unwrap_or(0) != 0 {
                return Err("bitwise shift".into());
            }
            Expr::Bitwise {
                sreg: need(a, NFTA_BITWISE_SREG, "sreg")?,
                dreg: need(a, NFTA_BITWISE_DREG, "dreg")?,
                len: need(a, NFTA_BITWISE_LEN, "len")?,
                mask: value(a, NFTA_BITWISE_MASK).ok_or("mask")?,
                xor: value(a, NFTA_BITWISE_XOR).ok_or("xor")?,
            }
        }
        "immediate" => {
            let dreg = need(a, NFTA_IMMEDIATE_DREG, "dreg")?;
            let data = a.get(NFTA_IMMEDIATE_DATA).ok_or("immediate data")?;
            match decode_data(data)? {
                ElementValue::Verdict(v) => Expr::Verdict(v),
                ElementValue::Data(d) => Expr::Immediate {
                    dreg,
                    data: d.to_vec(),
                },
            }
        }
        "lookup" => Expr::Lookup {
            set: a
                .get(NFTA_LOOKUP_SET)
                .and_then(|s| s.str())
                .ok_or("lookup set")?
                .to_owned(),
            sreg: need(a, NFTA_LOOKUP_SREG, "sreg")?,
            dreg: be32(a, NFTA_LOOKUP_DREG),
            invert: be32(a, NFTA_LOOKUP_FLAGS).unwrap_or(0) & NFT_LOOKUP_F_INV != 0,
        },
        "numgen" => Expr::Numgen {
            dreg: need(a, NFTA_NG_DREG, "dreg")?,
            modulus: need(a, NFTA_NG_MODULUS, "modulus")?,
            random: need(a, NFTA_NG_TYPE, "type")? == NFT_NG_RANDOM,
            offset: be32(a, NFTA_NG_OFFSET).unwrap_or(0),
        },
        "dynset" => Expr::Dynset {
            set: a
                .get(NFTA_DYNSET_SET_NAME)
                .and_then(|s| s.str())
                .ok_or("dynset set")?
                .to_owned(),
            op: match need(a, NFTA_DYNSET_OP, "op")? {
                0 => DynsetOp::Add,
                1 => DynsetOp::Update,
                o => return Err(format!("dynset op {o}")),
            },
            sreg_key: need(a, NFTA_DYNSET_SREG_KEY, "sreg key")?,
            sreg_data: be32(a, NFTA_DYNSET_SREG_DATA),
            timeout_ms: a
                .get(NFTA_DYNSET_TIMEOUT)
                .and_then(|t| t.be64())
                .filter(|t| *t != 0),
        },
        "nat" => Expr::Nat {
            kind: match need(a, NFTA_NAT_TYPE, "type")? {
                0 => NatKind::Snat,
                1 => NatKind::Dnat,
                t => return Err(format!("nat type {t}")),
            },
            family: Family::from_nfproto(need(a, NFTA_NAT_FAMILY, "family")? as u8)
                .ok_or("nat family")?,
            reg_addr: be32(a, NFTA_NAT_REG_ADDR_MIN),
            reg_proto: be32(a, NFTA_NAT_REG_PROTO_MIN),
            flags: NatFlags::from_bits_retain(be32(a, NFTA_NAT_FLAGS).unwrap_or(0)),
        },
        "masq" => Expr::Masq {
            flags: NatFlags::from_bits_retain(be32(a, NFTA_MASQ_FLAGS).unwrap_or(0)),
        },
        "redir" => Expr::Redir {
            reg_proto: be32(a, NFTA_REDIR_REG_PROTO_MIN),
            flags: NatFlags::from_bits_retain(be32(a, NFTA_REDIR_FLAGS).unwrap_or(0)),
        },
        "reject" => {
            let code = a
                .get(NFTA_REJECT_ICMP_CODE)
                .and_then(|c| c.u8())
                .unwrap_or(0);
            Expr::Reject(match need(a, NFTA_REJECT_TYPE, "type")? {
                0 => RejectKind::IcmpUnreach(code),
                1 => RejectKind::TcpReset,
                2 => RejectKind::IcmpxUnreach(code),
                t => return Err(format!("reject type {t}")),
            })
        }
        "ct" => {
            let key = need(a, NFTA_CT_KEY, "key")?;
            let key = CtKey::from_number(key).ok_or_else(|| format!("ct key {key}"))?;
            let dreg = need(a, NFTA_CT_DREG, "dreg")?;
            match a.get(NFTA_CT_DIRECTION).and_then(|d| d.u8()) {
                None => Expr::Ct { key, dreg },
                Some(0) => Expr::CtOriginal { key, dreg },
                Some(d) => return Err(format!("ct direction {d}")),
            }
        }
        "fib" => Expr::Fib {
            flags: FibFlags::from_bits_retain(need(a, NFTA_FIB_FLAGS, "flags")?),
            result: FibResult::from_number(need(a, NFTA_FIB_RESULT, "result")?),
            dreg: need(a, NFTA_FIB_DREG, "dreg")?,
        },
        "counter" => Expr::Counter,
        other => return Err(format!("expression {other} is not modelled")),
    })
}
