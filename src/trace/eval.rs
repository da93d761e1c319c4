//! An interpreter of nf_tables expressions over one packet: the kernel's `nft_do_chain` (rules in order,
//! registers, break on a failed match, jump / goto / return, policy at the end of a base chain) applied to the
//! typed IR, whatever shape the render gives it.
//!
//! One run is deterministic: each `numgen` takes its value from `choices`; a `numgen` beyond them interrupts the
//! run with its modulus, and the caller (`super::enumerate`) runs again once per value. That keeps this code a
//! plain sequential evaluation while every random choice is still explored with its probability.

use super::attribution::Attribution;
use super::packet::{ip_octets, NodeContext, Origin, Packet};
use super::regs::{Label, Regs};
use super::report::{Branch, Fate, Step};
use super::TraceError;
use crate::nft::ir::*;
use crate::nft::text;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Deepest jump stack the kernel allows (NFT_JUMP_STACK_SIZE).
const JUMP_STACK: usize = 16;
/// `RTN_UNICAST`: what `fib ... type` gives for an address that is not local.
const RTN_UNICAST: u32 = 1;
/// `IFNAMSIZ`: interface names are loaded as 16 zero-padded bytes.
const IFNAMSIZ: usize = 16;

/// Why a run stopped early.
#[derive(Debug)]
pub enum Interrupt {
    /// A `numgen` with no value chosen yet: run again once per value.
    Choice {
        modulus: u32,
    },
    Error(TraceError),
}

impl From<TraceError> for Interrupt {
    fn from(e: TraceError) -> Self {
        Interrupt::Error(e)
    }
}

/// What a rule or a chain decided.
#[derive(Debug, Clone, PartialEq)]
enum Flow {
    /// The rule did not match (a failed comparison or lookup), or matched without a verdict: next rule.
    Next,
    Jump(String),
    Goto(String),
    Return,
    Accept,
    Drop,
    Reject(RejectKind),
}

/// The connection-tracking state the rules see: a first packet of a new connection.
#[derive(Debug, Clone)]
struct Conntrack {
    status: u32,
    original_dst: SocketAddr,
    /// A NAT binding of that kind exists: later nat chains of the same kind are not run (`nf_nat_inet_fn`).
    dnat_bound: bool,
    snat_bound: bool,
}

/// Everything the evaluator needs besides the packet.
pub struct Context<'a> {
    pub tables: &'a [&'a TableState],
    pub node: &'a NodeContext,
    pub origin: Origin,
    pub attribution: &'a dyn Attribution,
}

/// One run of the packet through the hooks it meets.
pub fn run(ctx: &Context<'_>, packet: &Packet, choices: &[u32]) -> Result<Branch, Interrupt> {
    let mut ev = Eval {
        ctx,
        choices,
        chosen: Vec::new(),
        pkt: packet.clone(),
        ct: Conntrack {
            status: 0,
            original_dst: packet.dst,
            dnat_bound: false,
            snat_bound: false,
        },
        regs: Regs::default(),
        hook: Hook::Prerouting,
        branch: Branch::default(),
    };
    let fate = ev.path()?;
    ev.branch.fate = fate;
    ev.branch.choices = ev.chosen;
    ev.branch.final_packet = Some((ev.pkt.src, ev.pkt.dst));
    Ok(ev.branch)
}

struct Eval<'a> {
    ctx: &'a Context<'a>,
    choices: &'a [u32],
    chosen: Vec<(u32, u32)>,
    pkt: Packet,
    ct: Conntrack,
    regs: Regs,
    hook: Hook,
    branch: Branch,
}

/// What a hook did with the packet.
enum HookEnd {
    Pass,
    Stop(Fate),
}

impl<'a> Eval<'a> {
    /// The hooks in the order the packet meets them, with the routing decision between them.
    fn path(&mut self) -> Result<Fate, Interrupt> {
        let first = if self.ctx.origin == Origin::Node {
            Hook::Output
        } else {
            Hook::Prerouting
        };
        if let HookEnd::Stop(f) = self.hook_chains(first)? {
            return Ok(f);
        }
        let local = self.ctx.node.is_local(&self.pkt.dst.ip());
        let route = if local {
            format!(
                "{} is a local address: delivered to this node (input)",
                self.pkt.dst.ip()
            )
        } else if self.ctx.origin == Origin::Node {
            format!("{} is not local: sent out (postrouting)", self.pkt.dst.ip())
        } else {
            format!(
                "{} is not local: forwarded (forward, postrouting)",
                self.pkt.dst.ip()
            )
        };
        self.branch.steps.push(Step::routing(first.as_str(), route));
        let rest: &[Hook] = match (self.ctx.origin, local) {
            (Origin::Node, false) => &[Hook::Postrouting],
            (Origin::Node, true) => &[Hook::Postrouting, Hook::Input],
            (_, true) => &[Hook::Input],
            (_, false) => &[Hook::Forward, Hook::Postrouting],
        };
        for &hook in rest {
            if let HookEnd::Stop(f) = self.hook_chains(hook)? {
                return Ok(f);
            }
        }
        Ok(if local {
            Fate::accepted(format!("delivered locally to {}", self.pkt.dst))
        } else {
            Fate::accepted(format!("sent on to {}", self.pkt.dst))
        })
    }

    /// Every base chain on `hook` in priority order (all tables of the family).
    fn hook_chains(&mut self, hook: Hook) -> Result<HookEnd, Interrupt> {
        self.hook = hook;
        let mut chains: Vec<(&TableState, &ChainState, &BaseHook)> = Vec::new();
        for t in self.ctx.tables {
            for c in t.chains.values() {
                if let Some(b) = c.chain.base.as_ref().filter(|b| b.hook == hook) {
                    chains.push((t, c, b));
                }
            }
        }
        chains
            .sort_by_key(|(t, c, b)| (b.priority, t.family, t.name.clone(), c.chain.name.clone()));
        for (table, chain, base) in chains {
            if table.flags & TABLE_F_DORMANT != 0 {
                continue;
            }
            if base.chain_type == ChainType::Nat && self.nat_bound(hook) {
                self.branch.steps.push(Step::skipped(
                    hook.as_str(),
                    table,
                    &chain.chain.name,
                    "nat chain not run: this connection's NAT of that direction is already set up",
                ));
                continue;
            }
            match self.base_chain(table, chain, base)? {
                Flow::Drop => return Ok(HookEnd::Stop(Fate::dropped(&self.last_decider()))),
                Flow::Reject(k) => {
                    let with = reject_text(self.pkt.family(), k);
                    return Ok(HookEnd::Stop(Fate::rejected(&with, &self.last_decider())));
                }
                _ => {}
            }
        }
        Ok(HookEnd::Pass)
    }

    fn nat_bound(&self, hook: Hook) -> bool {
        match hook {
            Hook::Prerouting | Hook::Output => self.ct.dnat_bound,
            Hook::Postrouting | Hook::Input => self.ct.snat_bound,
            Hook::Forward => false,
        }
    }

    fn last_decider(&self) -> String {
        self.branch
            .steps
            .last()
            .map(|s| s.place())
            .unwrap_or_default()
    }

    /// `nft_do_chain`: rules in order, a stack of jumps, the policy at the end.
    fn base_chain(
        &mut self,
        table: &TableState,
        chain: &ChainState,
        base: &BaseHook,
    ) -> Result<Flow, Interrupt> {
        let mut stack: Vec<(String, usize)> = Vec::new();
        let mut current = chain.chain.name.clone();
        let mut index = 0;
        loop {
            let cs = table.chains.get(&current).ok_or_else(|| {
                TraceError::Ruleset(format!(
                    "table {} {}: chain {current} is jumped to but does not exist",
                    table.family.as_str(),
                    table.name
                ))
            })?;
            let flow = match cs.rules.get(index) {
                Some(rule) => self.rule(table, &current, index, rule)?,
                None => Flow::Return,
            };
            match flow {
                Flow::Next => index += 1,
                Flow::Jump(target) => {
                    if stack.len() >= JUMP_STACK {
                        return Err(TraceError::Ruleset(format!(
                            "jumps nested deeper than {JUMP_STACK} at chain {target}"
                        ))
                        .into());
                    }
                    stack.push((current, index + 1));
                    current = target;
                    index = 0;
                }
                Flow::Goto(target) => {
                    current = target;
                    index = 0;
                }
                Flow::Return => match stack.pop() {
                    Some((c, i)) => {
                        current = c;
                        index = i;
                    }
                    None => {
                        let policy = base.policy;
                        self.branch.steps.push(Step::policy(
                            self.hook.as_str(),
                            table,
                            &chain.chain.name,
                            policy.as_str(),
                        ));
                        return Ok(match policy {
                            Policy::Accept => Flow::Accept,
                            Policy::Drop => Flow::Drop,
                        });
                    }
                },
                end @ (Flow::Accept | Flow::Drop | Flow::Reject(_)) => return Ok(end),
            }
        }
    }

    /// Evaluates one rule and records it as a step.
    fn rule(
        &mut self,
        table: &TableState,
        chain: &str,
        index: usize,
        rule: &Rule,
    ) -> Result<Flow, Interrupt> {
        let mut step = Step::rule(self.hook.as_str(), table, chain, index, rule);
        let mut flow = Flow::Next;
        let mut matched = true;
        for e in &rule.exprs {
            match self.expr(table, e, &mut step)? {
                ExprEnd::Continue => {}
                ExprEnd::Break(why) => {
                    matched = false;
                    step.result = format!("no match: {why}");
                    break;
                }
                ExprEnd::Flow(f) => {
                    flow = f;
                    break;
                }
            }
        }
        if matched {
            step.matched = true;
            step.result = match &flow {
                Flow::Next => "matched".into(),
                Flow::Jump(c) => format!("matched: jump {c}"),
                Flow::Goto(c) => format!("matched: goto {c}"),
                Flow::Return => "matched: return".into(),
                Flow::Accept => "matched: accept".into(),
                Flow::Drop => "matched: drop".into(),
                Flow::Reject(k) => format!("matched: {}", reject_text(self.pkt.family(), *k)),
            };
        }
        self.branch.steps.push(step);
        Ok(flow)
    }

    fn expr(
        &mut self,
        table: &TableState,
        e: &Expr,
        step: &mut Step,
    ) -> Result<ExprEnd, Interrupt> {
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
            } => self.numgen(*dreg, *modulus, *offset, step)?,
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
                let random = if flags & NAT_F_PROTO_RANDOM_FULLY != 0 {
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
        let ord = have.cmp(data);
        let ok = match op {
            CmpOp::Eq => ord.is_eq(),
            CmpOp::Neq => ord.is_ne(),
            CmpOp::Lt => ord.is_lt(),
            CmpOp::Lte => ord.is_le(),
            CmpOp::Gt => ord.is_gt(),
            CmpOp::Gte => ord.is_ge(),
        };
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
        // Elements are ordered by key, then value (None first): the first at or after (key, None) is it.
        let probe = Element {
            key: key.as_slice().into(),
            value: None,
        };
        let found = set
            .elements
            .range(probe..)
            .next()
            .filter(|e| e.key.as_slice() == key.as_slice());
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

    fn numgen(
        &mut self,
        dreg: u32,
        modulus: u32,
        offset: u32,
        step: &mut Step,
    ) -> Result<(), Interrupt> {
        if modulus == 0 {
            return Err(TraceError::Ruleset("numgen with modulus 0".into()).into());
        }
        let Some(&choice) = self.choices.get(self.chosen.len()) else {
            return Err(Interrupt::Choice { modulus });
        };
        self.chosen.push((choice, modulus));
        let value = offset + choice;
        step.notes.push(format!(
            "numgen random mod {modulus}{} = {value} (probability 1/{modulus})",
            if offset > 0 {
                format!(" offset {offset}")
            } else {
                String::new()
            }
        ));
        let label = Label {
            name: format!("numgen random mod {modulus}"),
            ty: DataType::Integer(4),
        };
        self.regs.write(dreg, &value.to_ne_bytes(), Some(label))?;
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
        flags: u32,
        result: u32,
        dreg: u32,
        step: &mut Step,
    ) -> Result<(), TraceError> {
        if result != FIB_RESULT_ADDRTYPE {
            return Err(TraceError::Unsupported(format!(
                "fib result {result} (only `type` is modelled)"
            )));
        }
        let (ip, which) = if flags & FIB_F_SADDR != 0 {
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

enum ExprEnd {
    Continue,
    Break(String),
    Flow(Flow),
}

fn verdict_flow(v: &Verdict) -> Flow {
    match v {
        Verdict::Accept => Flow::Accept,
        Verdict::Drop => Flow::Drop,
        Verdict::Continue => Flow::Next,
        Verdict::Return => Flow::Return,
        Verdict::Jump(c) => Flow::Jump(c.to_string()),
        Verdict::Goto(c) => Flow::Goto(c.to_string()),
    }
}

fn find_set<'t>(table: &'t TableState, name: &str) -> Result<&'t SetState, TraceError> {
    table.sets.get(name).ok_or_else(|| {
        TraceError::Ruleset(format!(
            "table {} {}: set @{name} is looked up but does not exist",
            table.family.as_str(),
            table.name
        ))
    })
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

fn reject_text(family: Family, k: RejectKind) -> String {
    match k {
        RejectKind::TcpReset => "reject with tcp reset".into(),
        RejectKind::IcmpUnreach(c) | RejectKind::IcmpxUnreach(c) => {
            let kind = match (family, k) {
                (_, RejectKind::IcmpxUnreach(_)) => "icmpx",
                (Family::Ip6, _) => "icmpv6",
                _ => "icmp",
            };
            format!("reject with {kind} code {c}")
        }
    }
}
