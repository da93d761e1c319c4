//! An interpreter of nf_tables expressions over one packet: the kernel's `nft_do_chain` (rules in order,
//! registers, break on a failed match, jump / goto / return, policy at the end of a base chain) applied to the
//! typed IR, whatever shape the render gives it. What each expression does is in `expr.rs`.
//!
//! One run is deterministic: each random choice that matters takes its value from `choices`; one beyond them
//! interrupts the run with its groups of values (`decide.rs`), and the caller (`super::enumerate`) runs again once
//! per group. That keeps this code a
//! plain sequential evaluation while every random choice is still explored with its probability.

use super::attribution::Attribution;
use super::packet::{NodeContext, Origin, Packet};
use super::regs::Regs;
use super::report::{Branch, Fate, Step};
use super::TraceError;
use nftkube_nft::ir::*;
use std::net::SocketAddr;

/// Deepest jump stack the kernel allows (NFT_JUMP_STACK_SIZE).
const JUMP_STACK: usize = 16;

/// Why a run stopped early.
#[derive(Debug)]
pub(crate) enum Interrupt {
    /// A `numgen` value read with no choice made yet: run again once per group of its values (`decide.rs`);
    /// `groups` of them.
    Choice {
        groups: usize,
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
pub(super) enum Flow {
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
pub(super) struct Conntrack {
    pub(super) status: u32,
    pub(super) original_dst: SocketAddr,
    /// A NAT binding of that kind exists: later nat chains of the same kind are not run (`nf_nat_inet_fn`).
    pub(super) dnat_bound: bool,
    pub(super) snat_bound: bool,
}

/// Everything the evaluator needs besides the packet.
pub(crate) struct Context<'a> {
    pub tables: &'a [&'a TableState],
    pub node: &'a NodeContext,
    pub origin: Origin,
    pub(crate) attribution: &'a dyn Attribution,
}

/// One run of the packet through the hooks it meets.
pub(crate) fn run(
    ctx: &Context<'_>,
    packet: &Packet,
    choices: &[u32],
) -> Result<Branch, Interrupt> {
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

pub(super) struct Eval<'a> {
    pub(super) ctx: &'a Context<'a>,
    pub(super) choices: &'a [u32],
    pub(super) chosen: Vec<(u32, u32)>,
    pub(super) pkt: Packet,
    pub(super) ct: Conntrack,
    pub(super) regs: Regs,
    pub(super) hook: Hook,
    pub(super) branch: Branch,
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
            if table.flags.contains(TableFlags::DORMANT) {
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
}

pub(super) enum ExprEnd {
    Continue,
    Break(String),
    Flow(Flow),
}

pub(super) fn verdict_flow(v: &Verdict) -> Flow {
    match v {
        Verdict::Accept => Flow::Accept,
        Verdict::Drop => Flow::Drop,
        Verdict::Continue => Flow::Next,
        Verdict::Return => Flow::Return,
        Verdict::Jump(c) => Flow::Jump(c.to_string()),
        Verdict::Goto(c) => Flow::Goto(c.to_string()),
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
