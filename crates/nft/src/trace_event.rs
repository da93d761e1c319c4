//! The kernel's nf_tables trace events (NFT_MSG_TRACE on the NFNLGRP_NFTRACE group): one per rule a packet with
//! the nftrace bit matched, per return from a chain and per base-chain policy applied. Sans-IO: bytes in, data out.

use super::ir::Family;
use super::wire::consts::NFNL_SUBSYS_NFTABLES;
use super::wire::{decode_verdict, DecodeError};
use nftkube_netlink::attr::Attrs;
use serde::Serialize;

/// The multicast group of trace events.
pub const NFNLGRP_NFTRACE: u32 = 9;
/// `NFT_MSG_TRACE`.
pub(crate) const NFT_MSG_TRACE: u16 = 17;

const NFTA_TRACE_TABLE: u16 = 1;
const NFTA_TRACE_CHAIN: u16 = 2;
const NFTA_TRACE_RULE_HANDLE: u16 = 3;
const NFTA_TRACE_TYPE: u16 = 4;
const NFTA_TRACE_VERDICT: u16 = 5;
const NFTA_TRACE_ID: u16 = 6;
const NFTA_TRACE_NETWORK_HEADER: u16 = 8;
const NFTA_TRACE_TRANSPORT_HEADER: u16 = 9;
const NFTA_TRACE_IIF: u16 = 10;
const NFTA_TRACE_OIF: u16 = 12;
const NFTA_TRACE_MARK: u16 = 14;
const NFTA_TRACE_POLICY: u16 = 16;

/// `enum nft_trace_types`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceKind {
    /// A rule matched (its verdict, `continue` when it had none).
    Rule,
    /// The end of a chain that was jumped to: back to the caller.
    Return,
    /// The end of a base chain: its policy decided.
    Policy,
}

/// One trace event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    /// The same for every event of one packet.
    pub id: u32,
    #[serde(serialize_with = "family_name")]
    /// The table's family.
    pub family: Family,
    /// The table the event happened in.
    pub table: String,
    /// The chain the event happened in.
    pub chain: String,
    /// What happened (a rule matched, a chain returned, a policy decided, ...).
    pub kind: TraceKind,
    /// The handle of the rule that matched, if a rule did.
    pub rule_handle: Option<u64>,
    /// `accept`, `drop`, `continue`, `jump CHAIN`, ...; the policy's for a policy event.
    pub verdict: Option<String>,
    /// The packet as it was at this point (after any NAT so far).
    pub network_header: Option<Vec<u8>>,
    /// The transport header as it was at this point.
    pub transport_header: Option<Vec<u8>>,
    /// The input interface's index.
    pub iif: Option<u32>,
    /// The output interface's index.
    pub oif: Option<u32>,
    /// The packet's mark.
    pub mark: Option<u32>,
}

fn family_name<S: serde::Serializer>(f: &Family, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(f.as_str())
}

fn err(reason: impl Into<String>) -> DecodeError {
    DecodeError {
        what: "trace event",
        reason: reason.into(),
    }
}

/// Whether a netlink message type is an nf_tables trace event.
pub fn is_trace(msg_type: u16) -> bool {
    msg_type == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_TRACE
}

/// Decodes a trace event's payload (nfgenmsg, then NFTA_TRACE_* attributes).
pub fn decode_trace(payload: &[u8]) -> Result<TraceEvent, DecodeError> {
    if payload.len() < 4 {
        return Err(err("short message"));
    }
    let family =
        Family::from_nfproto(payload[0]).ok_or_else(|| err(format!("family {}", payload[0])))?;
    let a = Attrs(&payload[4..]);
    let text = |k: u16, field: &str| -> Result<String, DecodeError> {
        a.get(k)
            .and_then(|x| x.str())
            .map(str::to_owned)
            .ok_or_else(|| err(format!("missing {field}")))
    };
    let be32 = |k: u16| a.get(k).and_then(|x| x.be32());
    let rule_handle = a.get(NFTA_TRACE_RULE_HANDLE).and_then(|h| h.be64());
    let kind = match be32(NFTA_TRACE_TYPE) {
        Some(1) => TraceKind::Policy,
        // A return that names a rule is a rule whose verdict is `return`: kernels up to 6.1 at least trace it
        // so, 6.12 as a rule. Reported as a rule everywhere.
        Some(2) if rule_handle.is_some() => TraceKind::Rule,
        Some(2) => TraceKind::Return,
        Some(3) => TraceKind::Rule,
        other => return Err(err(format!("trace type {other:?}"))),
    };
    let verdict = match (kind, a.get(NFTA_TRACE_VERDICT), be32(NFTA_TRACE_POLICY)) {
        (_, Some(v), _) => Some(verdict_text(v)?),
        (TraceKind::Policy, None, Some(p)) => Some(if p == 1 { "accept" } else { "drop" }.into()),
        _ => None,
    };
    Ok(TraceEvent {
        id: be32(NFTA_TRACE_ID).ok_or_else(|| err("missing id"))?,
        family,
        table: text(NFTA_TRACE_TABLE, "table")?,
        chain: text(NFTA_TRACE_CHAIN, "chain")?,
        kind,
        rule_handle,
        verdict,
        network_header: a.get(NFTA_TRACE_NETWORK_HEADER).map(|h| h.payload.to_vec()),
        transport_header: a
            .get(NFTA_TRACE_TRANSPORT_HEADER)
            .map(|h| h.payload.to_vec()),
        iif: be32(NFTA_TRACE_IIF),
        oif: be32(NFTA_TRACE_OIF),
        mark: be32(NFTA_TRACE_MARK),
    })
}

/// A verdict as nft prints it; codes without an IR verdict (queue, stolen, break) by name.
fn verdict_text(v: nftkube_netlink::attr::Attr<'_>) -> Result<String, DecodeError> {
    let code = v
        .nested()
        .get(super::wire::consts::NFTA_VERDICT_CODE)
        .and_then(|c| c.be32())
        .ok_or_else(|| err("verdict without code"))? as i32;
    Ok(match code {
        -2 => "break".into(),
        2 => "stolen".into(),
        3 => "queue".into(),
        4 => "repeat".into(),
        _ => match decode_verdict(v) {
            Ok(v) => super::text::verdict_text(&v),
            // A drop with an errno (NF_DROP_ERR) keeps NF_DROP in its low byte.
            Err(_) if code & 0xff == 0 => "drop".into(),
            Err(e) => return Err(err(e)),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_netlink::MsgBuilder;

    /// An event as the kernel sends it for `ip nftkube services` rule 7 going to `lb-2`.
    fn event() -> Vec<u8> {
        let mut m = MsgBuilder::new((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_TRACE, 0, 0);
        m.raw(&[2, 0, 0, 0]); // nfgenmsg: NFPROTO_IPV4
        m.attr_str(NFTA_TRACE_TABLE, "nftkube");
        m.attr_str(NFTA_TRACE_CHAIN, "services");
        m.attr_be64(NFTA_TRACE_RULE_HANDLE, 7);
        m.attr_be32(NFTA_TRACE_TYPE, 3);
        m.nested(NFTA_TRACE_VERDICT, |m| {
            m.attr_be32(super::super::wire::consts::NFTA_VERDICT_CODE, -4i32 as u32);
            m.attr_str(super::super::wire::consts::NFTA_VERDICT_CHAIN, "lb-2");
        });
        m.attr_be32(NFTA_TRACE_ID, 0xdead);
        m.attr(NFTA_TRACE_NETWORK_HEADER, &[0x45, 0, 0, 20]);
        m.attr_be32(NFTA_TRACE_IIF, 3);
        m.attr_be32(NFTA_TRACE_MARK, 0x4000);
        m.finish().unwrap()
    }

    /// A return event in `masquerading`, naming rule 9 or no rule (the end of the chain).
    fn return_event(handle: Option<u64>) -> TraceEvent {
        let mut m = MsgBuilder::new((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_TRACE, 0, 0);
        m.raw(&[2, 0, 0, 0]);
        m.attr_str(NFTA_TRACE_TABLE, "nftkube");
        m.attr_str(NFTA_TRACE_CHAIN, "masquerading");
        if let Some(h) = handle {
            m.attr_be64(NFTA_TRACE_RULE_HANDLE, h);
        }
        m.attr_be32(NFTA_TRACE_TYPE, 2);
        m.attr_be32(NFTA_TRACE_ID, 1);
        let bytes = m.finish().unwrap();
        let msg = nftkube_netlink::attr::messages(&bytes).next().unwrap();
        decode_trace(msg.payload).unwrap()
    }

    #[test]
    fn a_return_naming_a_rule_is_that_rule_matching() {
        // 5.10 and 6.1 trace a rule whose verdict is `return` as a return event with the rule's handle.
        assert_eq!(return_event(Some(9)).kind, TraceKind::Rule);
        assert_eq!(return_event(None).kind, TraceKind::Return);
    }

    #[test]
    fn a_rule_event_decodes() {
        let bytes = event();
        let msg = nftkube_netlink::attr::messages(&bytes).next().unwrap();
        assert!(is_trace(msg.msg_type));
        let e = decode_trace(msg.payload).unwrap();
        assert_eq!(
            e,
            TraceEvent {
                id: 0xdead,
                family: Family::Ip,
                table: "nftkube".into(),
                chain: "services".into(),
                kind: TraceKind::Rule,
                rule_handle: Some(7),
                verdict: Some("goto lb-2".into()),
                network_header: Some(vec![0x45, 0, 0, 20]),
                transport_header: None,
                iif: Some(3),
                oif: None,
                mark: Some(0x4000),
            }
        );
    }

    #[test]
    fn truncated_or_foreign_events_are_refused() {
        assert!(decode_trace(&[2, 0]).is_err());
        let bytes = event();
        let msg = nftkube_netlink::attr::messages(&bytes).next().unwrap();
        // Without its type attribute the event says nothing.
        let mut cut = msg.payload.to_vec();
        let pos = cut.windows(4).position(|w| w == [8, 0, 4, 0]).unwrap();
        cut.drain(pos..pos + 8);
        assert!(decode_trace(&cut).is_err());
    }
}
