//! Renders tables in nft syntax, for `plan`, logs and diffs. The output is meant to be loadable by `nft -f`
//! (benchmarks use it as an anchor), so it sticks to syntax nft 1.0 accepts.
//!
//! Rules are rendered by following the registers through the expression list, the way nft's own
//! netlink_delinearize does for the shapes we generate; anything unrecognised is printed in nft's debug form
//! (`[ payload load 4b @ network header + 16 => reg 1 ]`) rather than guessed.

use super::ir::*;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::{Ipv4Addr, Ipv6Addr};

/// Renders a whole table.
pub fn render_table(t: &TableState) -> String {
    let rules: Vec<Vec<String>> = t
        .chains
        .values()
        .map(|c| c.rules.iter().map(|r| render_rule(r, t)).collect())
        .collect();
    let mut out = String::new();
    let _ = writeln!(out, "table {} {} {{", t.family.as_str(), t.name);
    if t.flags.contains(TableFlags::DORMANT) {
        let _ = writeln!(out, "\tflags dormant");
    }
    for s in t.sets.values() {
        render_set(&mut out, s);
    }
    for (c, rules) in t.chains.values().zip(rules) {
        let _ = writeln!(out, "\tchain {} {{", c.chain.name);
        if let Some(b) = &c.chain.base {
            let device = match &b.device {
                Some(d) => format!(" device \"{d}\""),
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "\t\ttype {} hook {}{device} priority {}; policy {};",
                b.chain_type.as_str(),
                b.hook.as_str(),
                b.priority,
                b.policy.as_str()
            );
        }
        for r in rules {
            let _ = writeln!(out, "\t\t{r}");
        }
        let _ = writeln!(out, "\t}}");
    }
    let _ = writeln!(out, "}}");
    out
}

fn render_set(out: &mut String, s: &SetState) {
    let set = &s.set;
    let kind = if set.is_map() { "map" } else { "set" };
    let _ = writeln!(out, "\t{kind} {} {{", set.name);
    let _ = writeln!(out, "\t\t{}", declaration(set));
    if let Some(size) = set.size {
        let _ = writeln!(out, "\t\tsize {size}");
    }
    let mut flags = Vec::new();
    if set.dynamic {
        flags.push("dynamic");
    }
    if set.timeout_ms.is_some() {
        flags.push("timeout");
    }
    if !flags.is_empty() {
        let _ = writeln!(out, "\t\tflags {}", flags.join(","));
    }
    if let Some(ms) = set.timeout_ms {
        let _ = writeln!(out, "\t\ttimeout {}", duration(ms));
    }
    if !s.elements.is_empty() {
        let items: Vec<String> = s.elements.iter().map(|e| element_text(set, e)).collect();
        let _ = writeln!(out, "\t\telements = {{ {} }}", items.join(",\n\t\t\t     "));
    }
    let _ = writeln!(out, "\t}}");
}

/// `typeof ip daddr . th dport : ...` when declared so, else `type ipv4_addr . inet_service : ...`.
fn declaration(set: &Set) -> String {
    let typeof_text = |exprs: &[TypeofExpr]| {
        let parts: Vec<String> = exprs.iter().map(|e| e.text()).collect();
        parts.join(" . ")
    };
    let type_text = |types: &[DataType]| {
        let parts: Vec<&str> = types.iter().map(|t| t.name()).collect();
        parts.join(" . ")
    };
    match &set.key_typeof {
        Some(key) if !key.is_empty() => {
            let mut s = format!("typeof {}", typeof_text(key));
            match &set.data_typeof {
                Some(data) => {
                    let _ = write!(s, " : {}", typeof_text(data));
                }
                None if set.is_map() => {
                    let _ = write!(s, " : {}", type_text(&set.data));
                }
                None => {}
            }
            s
        }
        _ => {
            let mut s = format!("type {}", type_text(&set.key));
            if set.is_map() {
                let _ = write!(s, " : {}", type_text(&set.data));
            }
            s
        }
    }
}

fn duration(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// One element as nft writes it: `key : value`.
pub(crate) fn element_text(set: &Set, e: &Element) -> String {
    let mut s = value_text(&set.key, &e.key);
    match &e.value {
        Some(ElementValue::Verdict(v)) => {
            let _ = write!(s, " : {}", verdict_text(v));
        }
        Some(ElementValue::Data(d)) => {
            let _ = write!(s, " : {}", value_text(&set.data, d));
        }
        None => {}
    }
    s
}

/// A verdict in nft syntax (`accept`, `goto lb-3`, ...).
pub fn verdict_text(v: &Verdict) -> String {
    match v {
        Verdict::Accept => "accept".into(),
        Verdict::Drop => "drop".into(),
        Verdict::Continue => "continue".into(),
        Verdict::Return => "return".into(),
        Verdict::Jump(c) => format!("jump {c}"),
        Verdict::Goto(c) => format!("goto {c}"),
    }
}

/// Formats a (possibly concatenated) value of the given types.
pub fn value_text(types: &[DataType], bytes: &[u8]) -> String {
    if types.len() <= 1 {
        let t = types
            .first()
            .copied()
            .unwrap_or(DataType::Integer(bytes.len() as u8));
        return scalar_text(t, bytes);
    }
    let mut parts = Vec::new();
    let mut off = 0;
    for t in types {
        let end = (off + t.len()).min(bytes.len());
        parts.push(scalar_text(*t, &bytes[off..end]));
        off = nftkube_netlink::align4(off + t.len());
    }
    parts.join(" . ")
}

fn scalar_text(t: DataType, b: &[u8]) -> String {
    match (t, b.len()) {
        (DataType::Ipv4Addr, 4) => Ipv4Addr::new(b[0], b[1], b[2], b[3]).to_string(),
        (DataType::Ipv6Addr, 16) => {
            let a: [u8; 16] = b.try_into().unwrap();
            Ipv6Addr::from(a).to_string()
        }
        (DataType::InetProto, 1) => match b[0] {
            6 => "tcp".into(),
            17 => "udp".into(),
            132 => "sctp".into(),
            n => n.to_string(),
        },
        (DataType::InetService, 2) => u16::from_be_bytes([b[0], b[1]]).to_string(),
        (DataType::Mark, 4) => format!("0x{:08x}", u32::from_ne_bytes(b.try_into().unwrap())),
        (_, 4) => u32::from_ne_bytes(b.try_into().unwrap()).to_string(),
        (_, 1) => b[0].to_string(),
        _ => hex(b),
    }
}

fn hex(b: &[u8]) -> String {
    let mut s = String::from("0x");
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// What a register holds while a rule is being read.
#[derive(Debug, Clone)]
struct RegValue {
    text: String,
    ty: DataType,
    /// Set by `& mask` with a zero xor: a later compare may read as a prefix or flag test.
    mask: Option<Vec<u8>>,
    kind: RegKind,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum RegKind {
    Plain,
    CtStatus,
    CtState,
    FibType,
    Literal,
    /// A map lookup whose value is a concatenation (`addr . port`).
    MapConcat,
    /// An interface name (`iifname`, `oifname`).
    IfName,
}

/// Renders one rule; `table` supplies set definitions for typing lookups.
pub fn render_rule(rule: &Rule, table: &TableState) -> String {
    let mut reader = RuleReader {
        table,
        regs: BTreeMap::new(),
        out: Vec::new(),
    };
    for e in &rule.exprs {
        reader.read(e);
    }
    let mut s = reader.out.join(" ");
    if let Some(c) = &rule.comment {
        let _ = write!(s, " comment \"{c}\"");
    }
    s
}

/// Reads a rule's expressions in order, as nft does: loads fill registers, and statements (compares, lookups,
/// verdicts, nat...) print what the registers they read hold.
struct RuleReader<'a> {
    table: &'a TableState,
    regs: BTreeMap<u32, RegValue>,
    out: Vec<String>,
}

impl RuleReader<'_> {
    fn read(&mut self, e: &Expr) {
        let family = self.table.family;
        match e {
            Expr::Payload {
                base,
                offset,
                len,
                dreg,
            } => {
                let (text, ty) = payload_name(family, *base, *offset, *len);
                self.load(*dreg, plain(text, ty));
            }
            Expr::Meta { key, dreg } => self.load(*dreg, meta_value(*key)),
            Expr::Ct { key, dreg } => self.load(*dreg, ct_value(*key, "")),
            Expr::CtOriginal { key, dreg } => self.load(*dreg, ct_value(*key, "original ")),
            Expr::Numgen {
                dreg,
                modulus,
                random,
                offset,
            } => self.load(*dreg, numgen_value(*modulus, *random, *offset)),
            Expr::Fib {
                flags,
                result,
                dreg,
            } => self.load(*dreg, fib_value(*flags, *result)),
            Expr::Immediate { dreg, data } => self.load(*dreg, immediate_value(family, data)),
            Expr::Bitwise {
                sreg,
                dreg,
                mask,
                xor,
                ..
            } => match get(&self.regs, *sreg) {
                Some(src) => {
                    let v = bitwise_value(src, mask, xor);
                    self.load(*dreg, v);
                }
                None => self.out.push(debug_expr(e)),
            },
            Expr::LookupAnon { set, sreg } => {
                let text = get(&self.regs, *sreg).map(|v| {
                    let items: Vec<String> = set
                        .elements
                        .iter()
                        .map(|e| scalar_text(set.key, e))
                        .collect();
                    format!("{} {{ {} }}", v.text, items.join(", "))
                });
                self.print_or_debug(text, e);
            }
            Expr::Cmp { sreg, op, data } => {
                let text = get(&self.regs, *sreg).map(|v| cmp_text(v, *op, data));
                self.print_or_debug(text, e);
            }
            Expr::MetaSet { key, sreg } => {
                let text =
                    get(&self.regs, *sreg).map(|v| format!("meta {} set {}", key.as_str(), v.text));
                self.print_or_debug(text, e);
            }
            Expr::Lookup {
                set,
                sreg,
                dreg,
                invert,
            } => self.lookup(e, set, *sreg, *dreg, *invert),
            Expr::Dynset {
                set,
                op,
                sreg_key,
                sreg_data,
                timeout_ms,
            } => {
                let text = self.dynset(set, *op, *sreg_key, *sreg_data, *timeout_ms);
                self.out.push(text);
            }
            Expr::Nat {
                kind,
                family: nat_family,
                reg_addr,
                reg_proto,
                flags,
            } => {
                let text = self.nat(*kind, *nat_family, *reg_addr, *reg_proto, *flags);
                self.out.push(text);
            }
            Expr::Redir { reg_proto, flags } => {
                let text = self.redirect(*reg_proto, *flags);
                self.out.push(text);
            }
            Expr::Verdict(v) => self.out.push(verdict_text(v)),
            Expr::Masq { flags } => self
                .out
                .push(format!("masquerade{}", nat_flags_text(*flags))),
            Expr::Reject(kind) => self.out.push(reject_text(family, *kind)),
            Expr::Counter => self.out.push("counter".into()),
        }
    }

    fn load(&mut self, reg: u32, v: RegValue) {
        put(&mut self.regs, reg, v);
    }

    /// Prints `text`, or the expression itself when the register it reads holds nothing we know.
    fn print_or_debug(&mut self, text: Option<String>, e: &Expr) {
        self.out.push(text.unwrap_or_else(|| debug_expr(e)));
    }

    /// The text of the register(s) a set's key (or data) is read from: a concatenation when the set says so.
    fn key_text(&self, sreg: u32, types: Option<&[DataType]>) -> Option<String> {
        match types {
            Some(types) => concat_text(&self.regs, sreg, types),
            None => get(&self.regs, sreg).map(|v| v.text.clone()),
        }
    }

    /// A set match (`KEY @set`, `KEY != @set`), a verdict map (`KEY vmap @set`) or a map load
    /// (`KEY map @set` into a register).
    fn lookup(&mut self, e: &Expr, set: &str, sreg: u32, dreg: Option<u32>, invert: bool) {
        let def = self.table.sets.get(set).map(|s| &s.set);
        let Some(key) = self.key_text(sreg, def.map(|d| d.key.as_slice())) else {
            self.out.push(debug_expr(e));
            return;
        };
        match dreg {
            None => self
                .out
                .push(format!("{key} {}@{set}", if invert { "!= " } else { "" })),
            Some(REG_VERDICT) => self.out.push(format!("{key} vmap @{set}")),
            Some(r) => {
                let ty = def
                    .and_then(|d| d.data.first().copied())
                    .unwrap_or(DataType::Integer(4));
                let mut v = plain(format!("{key} map @{set}"), ty);
                if def.is_some_and(|d| d.data.len() > 1) {
                    v.kind = RegKind::MapConcat;
                }
                self.load(r, v);
            }
        }
    }

    /// `add @set { KEY [timeout T] [: DATA] }` or `update ...`.
    fn dynset(
        &self,
        set: &str,
        op: DynsetOp,
        sreg_key: u32,
        sreg_data: Option<u32>,
        timeout_ms: Option<u64>,
    ) -> String {
        let def = self.table.sets.get(set).map(|s| &s.set);
        let text_of = |reg: u32, types: Option<&[DataType]>| {
            types
                .and_then(|t| concat_text(&self.regs, reg, t))
                .or_else(|| get(&self.regs, reg).map(|v| v.text.clone()))
                .unwrap_or_else(|| "?".into())
        };
        let key = text_of(sreg_key, def.map(|d| d.key.as_slice()));
        let verb = if op == DynsetOp::Add { "add" } else { "update" };
        let mut s = format!("{verb} @{set} {{ {key}");
        if let Some(ms) = timeout_ms {
            let _ = write!(s, " timeout {}", duration(ms));
        }
        if let Some(d) = sreg_data {
            let _ = write!(s, " : {}", text_of(d, def.map(|dd| dd.data.as_slice())));
        }
        s.push_str(" }");
        s
    }

    /// `dnat`/`snat`: to an address and port from a map (`addr . port to`), or from registers.
    fn nat(
        &self,
        kind: NatKind,
        nat_family: Family,
        reg_addr: Option<u32>,
        reg_proto: Option<u32>,
        flags: NatFlags,
    ) -> String {
        let verb = if kind == NatKind::Dnat {
            "dnat"
        } else {
            "snat"
        };
        let from_map = reg_addr
            .and_then(|r| get(&self.regs, r))
            .filter(|v| v.kind == RegKind::MapConcat);
        if let Some(v) = from_map {
            return format!(
                "{verb} {} addr . port to {}{}",
                nat_family.as_str(),
                v.text,
                nat_flags_text(flags)
            );
        }
        let text = |reg: Option<u32>| reg.and_then(|r| get(&self.regs, r)).map(|v| v.text.clone());
        let mut s = format!("{verb} to ");
        match (text(reg_addr), text(reg_proto)) {
            (Some(a), Some(p)) if nat_family == Family::Ip6 => {
                let _ = write!(s, "[{a}]:{p}");
            }
            (Some(a), Some(p)) => {
                let _ = write!(s, "{a}:{p}");
            }
            (Some(a), None) => s.push_str(&a),
            (None, Some(p)) => {
                let _ = write!(s, ":{p}");
            }
            (None, None) => s = verb.to_string(),
        }
        s.push_str(&nat_flags_text(flags));
        s
    }

    /// `redirect [to :PORT]`; nft prints a port from a map with no space after the colon.
    fn redirect(&self, reg_proto: Option<u32>, flags: NatFlags) -> String {
        let port = reg_proto
            .and_then(|r| get(&self.regs, r))
            .map(|v| v.text.clone());
        let flags = nat_flags_text(flags.difference(NatFlags::PROTO_SPECIFIED));
        match port {
            Some(p) => format!("redirect to :{p}{flags}"),
            None => format!("redirect{flags}"),
        }
    }
}

/// What `meta KEY` loads.
fn meta_value(key: MetaKey) -> RegValue {
    let ty = match key {
        MetaKey::L4Proto => DataType::InetProto,
        MetaKey::Mark => DataType::Mark,
        _ => DataType::Integer(4),
    };
    let mut v = plain(format!("meta {}", key.as_str()), ty);
    if matches!(key, MetaKey::IifName | MetaKey::OifName) {
        v.text = key.as_str().to_string();
        v.kind = RegKind::IfName;
    }
    v
}

/// What `numgen random|inc mod N [offset O]` loads.
fn numgen_value(modulus: u32, random: bool, offset: u32) -> RegValue {
    let mut text = format!(
        "numgen {} mod {modulus}",
        if random { "random" } else { "inc" }
    );
    if offset != 0 {
        let _ = write!(text, " offset {offset}");
    }
    plain(text, DataType::Integer(4))
}

/// What `fib saddr . iif ... type|oif|oifname` loads.
fn fib_value(flags: FibFlags, result: FibResult) -> RegValue {
    let inputs = [
        (FibFlags::SADDR, "saddr"),
        (FibFlags::DADDR, "daddr"),
        (FibFlags::MARK, "mark"),
        (FibFlags::IIF, "iif"),
        (FibFlags::OIF, "oif"),
    ];
    let what: Vec<&str> = inputs
        .iter()
        .filter(|(bit, _)| flags.contains(*bit))
        .map(|(_, name)| *name)
        .collect();
    let res = match result {
        FibResult::ADDRTYPE => "type",
        FibResult::OIF => "oif",
        _ => "oifname",
    };
    let mut v = plain(
        format!("fib {} {res}", what.join(" . ")),
        DataType::Integer(4),
    );
    if result == FibResult::ADDRTYPE {
        v.kind = RegKind::FibType;
    }
    v
}

/// A literal, typed by its length (an address of the table's family, a port, or an integer).
fn immediate_value(family: Family, data: &[u8]) -> RegValue {
    let ty = match data.len() {
        4 if family == Family::Ip => DataType::Ipv4Addr,
        16 => DataType::Ipv6Addr,
        2 => DataType::InetService,
        n => DataType::Integer(n as u8),
    };
    let mut v = plain(scalar_text(ty, data), ty);
    v.kind = RegKind::Literal;
    v
}

/// `src & mask ^ xor`: a mask alone is kept for the compare that follows (a prefix or flag test); nft's
/// `| x` and `^ x` shapes are recognised, anything else is printed in full.
fn bitwise_value(src: &RegValue, mask: &[u8], xor: &[u8]) -> RegValue {
    let zero_xor = xor.iter().all(|b| *b == 0);
    let inverse = mask.iter().zip(xor).all(|(m, x)| *m == !*x);
    let all_ones = mask.iter().all(|b| *b == 0xff);
    let mut v = src.clone();
    if zero_xor {
        v.mask = Some(mask.to_vec());
    } else if inverse {
        v.text = format!("{} | {}", src.text, scalar_text(src.ty, xor));
    } else if all_ones {
        v.text = format!("{} ^ {}", src.text, scalar_text(src.ty, xor));
    } else {
        v.text = format!(
            "({} & {}) ^ {}",
            src.text,
            scalar_text(src.ty, mask),
            scalar_text(src.ty, xor)
        );
    }
    v
}

/// What `ct [original] KEY` loads: its text and type.
fn ct_value(key: CtKey, dir: &str) -> RegValue {
    let (name, ty, kind) = match key {
        CtKey::State => ("state", DataType::Mark, RegKind::CtState),
        CtKey::Status => ("status", DataType::Mark, RegKind::CtStatus),
        CtKey::Mark => ("mark", DataType::Mark, RegKind::Plain),
        CtKey::ProtoDst => ("proto-dst", DataType::InetService, RegKind::Plain),
        CtKey::DstIp => ("ip daddr", DataType::Ipv4Addr, RegKind::Plain),
        CtKey::DstIp6 => ("ip6 daddr", DataType::Ipv6Addr, RegKind::Plain),
    };
    let mut v = plain(format!("ct {dir}{name}"), ty);
    v.kind = kind;
    v
}

fn plain(text: String, ty: DataType) -> RegValue {
    RegValue {
        text,
        ty,
        mask: None,
        kind: RegKind::Plain,
    }
}

fn put(regs: &mut BTreeMap<u32, RegValue>, reg: u32, v: RegValue) {
    if let Some(slot) = reg_slot(reg) {
        regs.insert(slot, v);
    }
}

fn get(regs: &BTreeMap<u32, RegValue>, reg: u32) -> Option<&RegValue> {
    regs.get(&reg_slot(reg)?)
}

/// Reads a concatenated key of the given types out of consecutive registers starting at `sreg`.
fn concat_text(regs: &BTreeMap<u32, RegValue>, sreg: u32, types: &[DataType]) -> Option<String> {
    let mut slot = reg_slot(sreg)?;
    // A map lookup that produced a whole concatenated value at once reads as that lookup.
    if types.len() > 1
        && regs
            .get(&slot)
            .is_some_and(|v| v.kind == RegKind::MapConcat)
    {
        return Some(regs[&slot].text.clone());
    }
    let mut parts = Vec::new();
    for t in types {
        parts.push(regs.get(&slot)?.text.clone());
        slot += nftkube_netlink::align4(t.len()).max(4) as u32 / 4;
    }
    Some(parts.join(" . "))
}

fn payload_name(family: Family, base: PayloadBase, offset: u32, len: u32) -> (String, DataType) {
    let named = match (base, offset, len) {
        (PayloadBase::Network, 12, 4) if family != Family::Ip6 => {
            Some(("ip saddr", DataType::Ipv4Addr))
        }
        (PayloadBase::Network, 16, 4) if family != Family::Ip6 => {
            Some(("ip daddr", DataType::Ipv4Addr))
        }
        (PayloadBase::Network, 9, 1) if family != Family::Ip6 => {
            Some(("ip protocol", DataType::InetProto))
        }
        (PayloadBase::Network, 8, 16) if family != Family::Ip => {
            Some(("ip6 saddr", DataType::Ipv6Addr))
        }
        (PayloadBase::Network, 24, 16) if family != Family::Ip => {
            Some(("ip6 daddr", DataType::Ipv6Addr))
        }
        (PayloadBase::Transport, 0, 2) => Some(("th sport", DataType::InetService)),
        (PayloadBase::Transport, 2, 2) => Some(("th dport", DataType::InetService)),
        _ => None,
    };
    match named {
        Some((n, t)) => (n.to_string(), t),
        None => {
            let b = match base {
                PayloadBase::LinkLayer => "ll",
                PayloadBase::Network => "nh",
                PayloadBase::Transport => "th",
            };
            (
                format!("@{b},{},{}", offset * 8, len * 8),
                DataType::Integer(len as u8),
            )
        }
    }
}

fn cmp_text(v: &RegValue, op: CmpOp, data: &[u8]) -> String {
    let is_zero = data.iter().all(|b| *b == 0);
    if let Some(mask) = &v.mask {
        // Flag tests: `ct status dnat`, `ct state established,related`.
        if matches!(v.kind, RegKind::CtStatus | RegKind::CtState) && is_zero && mask.len() == 4 {
            let bits = u32::from_ne_bytes(mask[..4].try_into().unwrap());
            let names = if v.kind == RegKind::CtStatus {
                ct_status_names(bits)
            } else {
                ct_state_names(bits)
            };
            return match op {
                CmpOp::Neq => format!("{} {names}", v.text),
                // nft's own spelling: `ct status & dnat == 0`, `ct state & (established | related) == 0`.
                _ if names.contains(',') => {
                    format!("{} & ({}) == 0", v.text, names.replace(',', " | "))
                }
                _ => format!("{} & {names} == 0", v.text),
            };
        }
        // Prefix matches: `ip saddr != 10.244.0.0/16`.
        if matches!(v.ty, DataType::Ipv4Addr | DataType::Ipv6Addr) {
            if let Some(prefix) = prefix_len(mask) {
                let net = scalar_text(v.ty, data);
                let op = if op == CmpOp::Eq {
                    String::new()
                } else {
                    format!("{} ", op.as_str())
                };
                return format!("{} {op}{net}/{prefix}", v.text);
            }
        }
        return format!(
            "{} & {} {} {}",
            v.text,
            scalar_text(v.ty, mask),
            op.as_str(),
            scalar_text(v.ty, data)
        );
    }
    if v.kind == RegKind::IfName {
        // An interface name; without its terminating NUL the compare is a prefix: `"veth*"`.
        let (name, wildcard) = match data.iter().position(|b| *b == 0) {
            Some(end) => (&data[..end], ""),
            None => (data, "*"),
        };
        let op = if op == CmpOp::Eq {
            String::new()
        } else {
            format!("{} ", op.as_str())
        };
        return format!(
            "{} {op}\"{}{wildcard}\"",
            v.text,
            String::from_utf8_lossy(name)
        );
    }
    if v.kind == RegKind::FibType && data.len() == 4 {
        let t = u32::from_ne_bytes(data.try_into().unwrap());
        let name = match t {
            RTN_LOCAL => "local".to_string(),
            1 => "unicast".to_string(),
            3 => "broadcast".to_string(),
            5 => "multicast".to_string(),
            n => n.to_string(),
        };
        let op = if op == CmpOp::Eq {
            String::new()
        } else {
            format!("{} ", op.as_str())
        };
        return format!("{} {op}{name}", v.text);
    }
    let value = scalar_text(v.ty, data);
    match op {
        CmpOp::Eq => format!("{} {value}", v.text),
        _ => format!("{} {} {value}", v.text, op.as_str()),
    }
}

fn prefix_len(mask: &[u8]) -> Option<u32> {
    let mut ones = 0;
    let mut seen_zero = false;
    for b in mask {
        for i in (0..8).rev() {
            if b & (1 << i) != 0 {
                if seen_zero {
                    return None;
                }
                ones += 1;
            } else {
                seen_zero = true;
            }
        }
    }
    Some(ones)
}

fn ct_status_names(bits: u32) -> String {
    let names = [
        (1 << 0, "expected"),
        (1 << 1, "seen-reply"),
        (1 << 2, "assured"),
        (1 << 3, "confirmed"),
        (1 << 4, "snat"),
        (1 << 5, "dnat"),
        (1 << 9, "dying"),
    ];
    flag_names(bits, &names)
}

fn ct_state_names(bits: u32) -> String {
    let names = [
        (CT_STATE_INVALID, "invalid"),
        (CT_STATE_ESTABLISHED, "established"),
        (CT_STATE_RELATED, "related"),
        (CT_STATE_NEW, "new"),
        (1 << 6, "untracked"),
    ];
    flag_names(bits, &names)
}

fn flag_names(bits: u32, names: &[(u32, &str)]) -> String {
    let mut out: Vec<String> = names
        .iter()
        .filter(|(b, _)| bits & b != 0)
        .map(|(_, n)| n.to_string())
        .collect();
    let known: u32 = names.iter().map(|(b, _)| b).fold(0, |a, b| a | b);
    if bits & !known != 0 {
        out.push(format!("0x{:x}", bits & !known));
    }
    out.join(",")
}

fn nat_flags_text(flags: NatFlags) -> String {
    let mut s = String::new();
    if flags.contains(NatFlags::PROTO_RANDOM_FULLY) {
        s.push_str(" fully-random");
    }
    if flags.contains(NatFlags::PROTO_RANDOM) {
        s.push_str(" random");
    }
    if flags.contains(NatFlags::PERSISTENT) {
        s.push_str(" persistent");
    }
    s
}

fn reject_text(family: Family, kind: RejectKind) -> String {
    match (family, kind) {
        (_, RejectKind::TcpReset) => "reject with tcp reset".into(),
        (Family::Ip, RejectKind::IcmpUnreach(ICMP_PORT_UNREACH)) => "reject".into(),
        (Family::Ip6, RejectKind::IcmpUnreach(ICMPV6_PORT_UNREACH)) => "reject".into(),
        (Family::Ip6, RejectKind::IcmpUnreach(c)) => format!("reject with icmpv6 type {c}"),
        (_, RejectKind::IcmpUnreach(c)) => format!("reject with icmp type {c}"),
        (Family::Inet, RejectKind::IcmpxUnreach(1)) => "reject".into(),
        (_, RejectKind::IcmpxUnreach(c)) => format!("reject with icmpx type {c}"),
    }
}

/// nft's `--debug=netlink` style for expressions we cannot put into words.
fn debug_expr(e: &Expr) -> String {
    format!("[ {} {:?} ]", e.kernel_name(), e)
}
