//! What each nf_tables expression does to the registers, the packet and the connection: the kernel's `eval`
//! functions of payload, meta, cmp, bitwise, lookup, numgen, dynset, nat, masq, redir, reject, ct and fib, for
//! the one packet a run follows.

use super::eval::{verdict_flow, Eval, ExprEnd, Flow, Interrupt};
use super::lookup::{cmp_holds, find_element, find_set};
use super::packet::{ip_octets, Origin};
use super::regs::{Label, Random};
use super::report::Step;
use super::TraceError;
use nftkube_nft::ir::*;
use nftkube_nft::text;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `RTN_UNICAST`: what `fib ... type` gives for an address that is not local.
const RTN_UNICAST: u32 = 1;
/// `IFNAMSIZ`: interface names are loaded as 16 zero-padded bytes.
const IFNAMSIZ: usize = 16;

impl Eval<'_> {
    pub(super) fn expr(
        &mut self,
        table: &TableState,
        e: &Expr,
        step: &mut Step,
    ) -> Result<ExprEnd, Interrupt> {
        self.decide_reads(table, e, step)?;
        match e {
            Expr::Payload {
                base,
                offset,
                len,
                dreg,
            } => self.payload(*base, *offset, *len, *dreg)?,
            Expr::Meta { key, dreg } => self.meta(*key, *dreg, step)?,
            Expr::MetaSet { key, sreg } => self.meta_set(*key, *sreg, step)?,
            Expr::Cmp { sreg, op, data } => return Ok(self.cmp(*sreg, *op, data)?),
            Expr::Bitwise {
                sreg,
                dreg,
                len,
                mask,
                xor,
            } => {
                let src = self.regs.read(*sreg, *len as usize)?.to_vec();
                let out: Vec<u8> = (0..src.len())
                    .map(|i| {
                        (src[i] & mask.get(i).copied().unwrap_or(0))
                            ^ xor.get(i).copied().unwrap_or(0)
                    })
                    .collect();
                // The label keeps the value before masking, so a failed prefix match shows the address.
                let label = self.regs.label(*sreg).map(|l| Label {
                    name: format!(
                        "{} {} & {}",
                        l.name,
                        value_of(l.ty, &src),
                        value_of(l.ty, mask)
                    ),
                    ty: l.ty,
                });
                self.regs.write(*dreg, &out, label)?;
            }
            Expr::Immediate { dreg, data } => self.regs.write(*dreg, data, None)?,
            Expr::Verdict(v) => return Ok(ExprEnd::Flow(verdict_flow(v))),
            Expr::Lookup {
                set,
                sreg,
                dreg,
                invert,
            } => return Ok(self.lookup(table, set, *sreg, *dreg, *invert, step)?),
            Expr::LookupAnon { set, sreg } => {
                let key = self.regs.read(*sreg, set.key.len())?;
                if !set.elements.iter().any(|el| el.as_slice() == key) {
                    let shown = text::value_text(&[set.key], key);
                    return Ok(ExprEnd::Break(format!(
                        "{shown} is not in the rule's literal set"
                    )));
                }
            }
            Expr::Numgen {
                dreg,
                modulus,
                offset,
                ..
            } => self.numgen(*dreg, *modulus, *offset)?,
            Expr::Dynset {
                set,
                op,
                sreg_key,
                sreg_data,
                timeout_ms,
            } => self.dynset(table, set, *op, *sreg_key, *sreg_data, *timeout_ms, step)?,
            Expr::Nat {
                kind,
                family,
                reg_addr,
                reg_proto,
                ..
            } => {
                return Ok(ExprEnd::Flow(
                    self.nat(*kind, *family, *reg_addr, *reg_proto, step)?,
                ))
            }
            Expr::Masq { flags } => {
                let random = if flags.contains(NatFlags::PROTO_RANDOM_FULLY) {
                    " (fully random ports)"
                } else {
                    ""
                };
                step.notes.push(format!(
                    "masquerade: the source becomes the outgoing interface's address{random}"
                ));
                self.branch.masquerade = Some(step.place());
                self.ct.snat_bound = true;
                return Ok(ExprEnd::Flow(Flow::Accept));
            }
            Expr::Redir { reg_proto, .. } => {
                return Ok(ExprEnd::Flow(self.redirect(*reg_proto, step)?))
            }
            Expr::Reject(k) => return Ok(ExprEnd::Flow(Flow::Reject(*k))),
            Expr::Ct { key, dreg } | Expr::CtOriginal { key, dreg } => self.ct(*key, *dreg)?,
            Expr::Fib {
                flags,
                result,
                dreg,
            } => self.fib(*flags, *result, *dreg, step)?,
            Expr::Counter => {}
        }
        Ok(ExprEnd::Continue)
    }

    fn payload(
        &mut self,
        base: PayloadBase,
        offset: u32,
        len: u32,
        dreg: u32,
    ) -> Result<(), TraceError> {
        let (header, name) = match base {
            PayloadBase::Network => (self.pkt.network_header(), "network"),
            PayloadBase::Transport => (self.pkt.transport_header(), "transport"),
            PayloadBase::LinkLayer => {
                return Err(TraceError::Unsupported("link-layer payload loads".into()))
            }
        };
        let (off, len) = (offset as usize, len as usize);
        let bytes = header.get(off..off + len).ok_or_else(|| {
            TraceError::Unsupported(format!(
                "{name} header bytes {off}..{} (not modelled)",
                off + len
            ))
        })?;
        let label = payload_label(self.pkt.family(), base, offset, len as u32);
        self.regs.write(dreg, bytes, label)
    }

    fn meta(&mut self, key: MetaKey, dreg: u32, step: &mut Step) -> Result<(), TraceError> {
        let (bytes, ty): (Vec<u8>, DataType) = match key {
            MetaKey::Mark => (self.pkt.mark.to_ne_bytes().to_vec(), DataType::Mark),
            MetaKey::L4Proto => (vec![self.pkt.proto.number()], DataType::InetProto),
            MetaKey::NfProto => (vec![self.pkt.family().nfproto()], DataType::Integer(1)),
            MetaKey::IifName => (
                ifname_bytes(self.pkt.iif.as_deref(), step, "iif"),
                DataType::Integer(16),
            ),
            MetaKey::OifName => (ifname_bytes(None, step, "oif"), DataType::Integer(16)),
            MetaKey::NfTrace => (vec![0], DataType::Integer(1)),
            MetaKey::Iif | MetaKey::Oif => {
                step.notes.push(format!(
                    "meta {}: interface index not known, assumed 0",
                    key.as_str()
                ));
                (vec![0; 4], DataType::Integer(4))
            }
        };
        let label = Label {
            name: format!("meta {}", key.as_str()),
            ty,
        };
        self.regs.write(dreg, &bytes, Some(label))
    }

    fn meta_set(&mut self, key: MetaKey, sreg: u32, step: &mut Step) -> Result<(), TraceError> {
        if key == MetaKey::NfTrace {
            // A `--live` trace rule: it marks the packet for the kernel's tracer and changes nothing else.
            step.notes
                .push("the kernel traces this packet (meta nftrace set)".into());
            return Ok(());
        }
        if key != MetaKey::Mark {
            return Err(TraceError::Unsupported(format!(
                "meta {} set",
                key.as_str()
            )));
        }
        let b = self.regs.read(sreg, 4)?;
        let mark = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        let change = format!("meta mark {:#x} -> {mark:#x}", self.pkt.mark);
        if mark & !self.pkt.mark != 0 {
            // Bits set (what asks for masquerade); clearing them on the way out is not a reason.
            self.branch
                .mark_changes
                .push(format!("{} ({change})", step.place()));
        }
        step.notes.push(change);
        self.pkt.mark = mark;
        Ok(())
    }

    fn cmp(&self, sreg: u32, op: CmpOp, data: &[u8]) -> Result<ExprEnd, TraceError> {
        let have = self.regs.read(sreg, data.len())?;
        let ok = cmp_holds(have, op, data);
        if ok {
            return Ok(ExprEnd::Continue);
        }
        let (what, shown) = match self.regs.label(sreg) {
            Some(l) => (l.name.clone(), value_of(l.ty, have)),
            None => ("the value".into(), hex(have)),
        };
        let want = match self.regs.label(sreg) {
            Some(l) => value_of(l.ty, data),
            None => hex(data),
        };
        Ok(ExprEnd::Break(format!(
            "{what} is {shown}, not {} {want}",
            op.as_str()
        )))
    }

    #[allow(clippy::too_many_arguments)]
    fn lookup(
        &mut self,
        table: &TableState,
        name: &str,
        sreg: u32,
        dreg: Option<u32>,
        invert: bool,
        step: &mut Step,
    ) -> Result<ExprEnd, TraceError> {
        let set = find_set(table, name)?;
        let key = self.regs.read(sreg, key_len(&set.set.key))?.to_vec();
        let key_text = text::value_text(&set.set.key, &key);
        let found = find_element(set, &key);
        let about = self
            .ctx
            .attribution
            .describe(&set.set, &key)
            .map(|a| format!(" [{a}]"))
            .unwrap_or_default();
        let Some(dreg) = dreg else {
            let member = found.is_some();
            return Ok(if member != invert {
                step.notes.push(format!(
                    "{key_text} {} @{name}{about}",
                    if member { "is in" } else { "is not in" }
                ));
                ExprEnd::Continue
            } else {
                ExprEnd::Break(format!(
                    "{key_text} {} @{name}",
                    if member { "is in" } else { "is not in" }
                ))
            });
        };
        let Some(element) = found else {
            return Ok(ExprEnd::Break(format!("no element {key_text} in @{name}")));
        };
        let value_text = match &element.value {
            Some(ElementValue::Verdict(v)) => text::verdict_text(v),
            Some(ElementValue::Data(d)) => text::value_text(&set.set.data, d),
            None => String::new(),
        };
        step.notes
            .push(format!("@{name}: {key_text} : {value_text}{about}"));
        if set.set.dynamic {
            self.branch.affinity.push(format!(
                "hit: @{name} has {key_text} : {value_text} (this client's earlier choice)"
            ));
        }
        match &element.value {
            Some(ElementValue::Verdict(v)) if dreg == REG_VERDICT => {
                Ok(ExprEnd::Flow(verdict_flow(v)))
            }
            Some(ElementValue::Data(d)) => {
                let label = Label {
                    name: format!("@{name} value"),
                    ty: set
                        .set
                        .data
                        .first()
                        .copied()
                        .unwrap_or(DataType::Integer(d.len() as u8)),
                };
                self.regs.write(dreg, d, Some(label))?;
                Ok(ExprEnd::Continue)
            }
            _ => Err(TraceError::Ruleset(format!(
                "map @{name}: element {key_text} has no value of the kind the rule reads"
            ))),
        }
    }

    /// `numgen`: the value is left undecided until something reads it (`decide.rs`).
    fn numgen(&mut self, dreg: u32, modulus: u32, offset: u32) -> Result<(), Interrupt> {
        if modulus == 0 {
            return Err(TraceError::Ruleset("numgen with modulus 0".into()).into());
        }
        let label = Label {
            name: format!("numgen random mod {modulus}"),
            ty: DataType::Integer(4),
        };
        self.regs
            .write_random(dreg, Random { modulus, offset }, label)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn dynset(
        &mut self,
        table: &TableState,
        name: &str,
        op: DynsetOp,
        sreg_key: u32,
        sreg_data: Option<u32>,
        timeout_ms: Option<u64>,
        step: &mut Step,
    ) -> Result<(), TraceError> {
        let set = find_set(table, name)?;
        let key = self.regs.read(sreg_key, key_len(&set.set.key))?;
        let mut entry = text::value_text(&set.set.key, key);
        if let Some(ms) = timeout_ms {
            entry.push_str(&format!(" timeout {}s", ms / 1000));
        }
        if let Some(r) = sreg_data {
            let data = self.regs.read(r, key_len(&set.set.data))?;
            entry.push_str(&format!(" : {}", text::value_text(&set.set.data, data)));
        }
        let op = match op {
            DynsetOp::Add => "add",
            DynsetOp::Update => "update",
        };
        let note = format!("{op} @{name} {{ {entry} }}");
        step.notes.push(note.clone());
        self.branch.affinity.push(format!("recorded: {note}"));
        Ok(())
    }

    fn nat(
        &mut self,
        kind: NatKind,
        family: Family,
        reg_addr: Option<u32>,
        reg_proto: Option<u32>,
        step: &mut Step,
    ) -> Result<Flow, TraceError> {
        let old = match kind {
            NatKind::Dnat => self.pkt.dst,
            NatKind::Snat => self.pkt.src,
        };
        let ip = match reg_addr {
            Some(r) => addr_from(family, self.regs.read(r, addr_len(family))?),
            None => old.ip(),
        };
        let port = match reg_proto {
            Some(r) => {
                let b = self.regs.read(r, 2)?;
                u16::from_be_bytes([b[0], b[1]])
            }
            None => old.port(),
        };
        let new = SocketAddr::new(ip, port);
        match kind {
            NatKind::Dnat => {
                step.notes.push(format!("dnat {old} -> {new}"));
                self.pkt.dst = new;
                self.ct.status |= CT_STATUS_DNAT;
                self.ct.dnat_bound = true;
                self.branch.dnat = Some(new);
            }
            NatKind::Snat => {
                step.notes.push(format!("snat {old} -> {new}"));
                self.pkt.src = new;
                self.ct.snat_bound = true;
                self.branch.snat = Some(new);
            }
        }
        Ok(Flow::Accept)
    }

    /// `redirect`: DNAT to the incoming interface's primary address (loopback for the node's own traffic).
    fn redirect(&mut self, reg_proto: Option<u32>, step: &mut Step) -> Result<Flow, TraceError> {
        let port = match reg_proto {
            Some(r) => {
                let b = self.regs.read(r, 2)?;
                u16::from_be_bytes([b[0], b[1]])
            }
            None => self.pkt.dst.port(),
        };
        let ip = if self.ctx.origin == Origin::Node {
            match self.pkt.family() {
                Family::Ip6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
                _ => IpAddr::V4(Ipv4Addr::LOCALHOST),
            }
        } else {
            let same_family = |ip: &&IpAddr| ip.is_ipv4() == self.pkt.dst.is_ipv4();
            let first = self
                .ctx
                .node
                .local_addresses
                .iter()
                .find(same_family)
                .copied();
            step.notes.push("redirect goes to the incoming interface's primary address: assumed the node's first address of the family".into());
            first.unwrap_or(self.pkt.dst.ip())
        };
        let new = SocketAddr::new(ip, port);
        step.notes
            .push(format!("redirect {} -> {new}", self.pkt.dst));
        self.pkt.dst = new;
        self.ct.status |= CT_STATUS_DNAT;
        self.ct.dnat_bound = true;
        self.branch.dnat = Some(new);
        Ok(Flow::Accept)
    }

    fn ct(&mut self, key: CtKey, dreg: u32) -> Result<(), TraceError> {
        let orig = self.ct.original_dst;
        let (bytes, name, ty): (Vec<u8>, &str, DataType) = match key {
            CtKey::State => (
                CT_STATE_NEW.to_ne_bytes().to_vec(),
                "ct state",
                DataType::Integer(4),
            ),
            CtKey::Status => (
                self.ct.status.to_ne_bytes().to_vec(),
                "ct status",
                DataType::Integer(4),
            ),
            CtKey::Mark => (0u32.to_ne_bytes().to_vec(), "ct mark", DataType::Mark),
            CtKey::ProtoDst => (
                orig.port().to_be_bytes().to_vec(),
                "ct original proto-dst",
                DataType::InetService,
            ),
            CtKey::DstIp => (
                ip_octets(&orig.ip()),
                "ct original ip daddr",
                DataType::Ipv4Addr,
            ),
            CtKey::DstIp6 => (
                ip_octets(&orig.ip()),
                "ct original ip6 daddr",
                DataType::Ipv6Addr,
            ),
        };
        self.regs.write(
            dreg,
            &bytes,
            Some(Label {
                name: name.into(),
                ty,
            }),
        )
    }

    fn fib(
        &mut self,
        flags: FibFlags,
        result: FibResult,
        dreg: u32,
        step: &mut Step,
    ) -> Result<(), TraceError> {
        if result != FibResult::ADDRTYPE {
            return Err(TraceError::Unsupported(format!(
                "fib result {} (only `type` is modelled)",
                result.number()
            )));
        }
        let (ip, which) = if flags.contains(FibFlags::SADDR) {
            (self.pkt.src.ip(), "saddr")
        } else {
            (self.pkt.dst.ip(), "daddr")
        };
        let local = self.ctx.node.is_local(&ip);
        step.notes.push(format!(
            "fib {which} type: {ip} is {}",
            if local {
                "local"
            } else {
                "not local (unicast)"
            }
        ));
        let t = if local { RTN_LOCAL } else { RTN_UNICAST };
        let label = Label {
            name: format!("fib {which} type"),
            ty: DataType::Integer(4),
        };
        self.regs.write(dreg, &t.to_ne_bytes(), Some(label))
    }
}

fn ifname_bytes(name: Option<&str>, step: &mut Step, which: &str) -> Vec<u8> {
    let mut b = vec![0u8; IFNAMSIZ];
    match name {
        Some(n) => {
            let n = &n.as_bytes()[..n.len().min(IFNAMSIZ - 1)];
            b[..n.len()].copy_from_slice(n);
        }
        None => step
            .notes
            .push(format!("{which}name not known (give --iif): assumed empty")),
    }
    b
}

fn payload_label(family: Family, base: PayloadBase, offset: u32, len: u32) -> Option<Label> {
    let v6 = family == Family::Ip6;
    let (name, ty) = match (base, offset, len, v6) {
        (PayloadBase::Network, 12, 4, false) => ("ip saddr", DataType::Ipv4Addr),
        (PayloadBase::Network, 16, 4, false) => ("ip daddr", DataType::Ipv4Addr),
        (PayloadBase::Network, 9, 1, false) => ("ip protocol", DataType::InetProto),
        (PayloadBase::Network, 8, 16, true) => ("ip6 saddr", DataType::Ipv6Addr),
        (PayloadBase::Network, 24, 16, true) => ("ip6 daddr", DataType::Ipv6Addr),
        (PayloadBase::Network, 6, 1, true) => ("ip6 nexthdr", DataType::InetProto),
        (PayloadBase::Transport, 0, 2, _) => ("th sport", DataType::InetService),
        (PayloadBase::Transport, 2, 2, _) => ("th dport", DataType::InetService),
        _ => return None,
    };
    Some(Label {
        name: name.into(),
        ty,
    })
}

fn value_of(ty: DataType, bytes: &[u8]) -> String {
    if ty.len() == bytes.len() {
        text::value_text(&[ty], bytes)
    } else {
        hex(bytes)
    }
}

fn hex(b: &[u8]) -> String {
    let mut s = String::from("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

fn addr_len(family: Family) -> usize {
    if family == Family::Ip6 {
        16
    } else {
        4
    }
}

fn addr_from(family: Family, b: &[u8]) -> IpAddr {
    if family == Family::Ip6 {
        let mut a = [0u8; 16];
        a.copy_from_slice(&b[..16]);
        IpAddr::V6(a.into())
    } else {
        IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
    }
}
