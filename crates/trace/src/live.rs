//! `nftkube trace --live`: the kernel's own account of real packets. A table of our own
//! (`nftkube-trace-PID-START-RANDOM`) holds one rule per entry hook (prerouting, output; raw priority, before conntrack and NAT) that matches the
//! traced packet narrowly and sets its nftrace bit; the kernel then reports every rule it matches, every return
//! and every policy on NFNLGRP_NFTRACE. The table goes in one batch and leaves in one batch, when the count of
//! packets is reached, at the timeout, or on SIGINT / SIGTERM (`STOP`). The table's name is the run's own
//! (`owner.rs`: process id, start time, a random part) and is created exclusively, so two runs never share a
//! table; one a killed run left behind is removed by `nftkube cleanup --traces`.

use super::packet::Proto;
use super::TraceError;
use nftkube_netlink::attr::messages;
use nftkube_netlink::NlSocket;
use nftkube_nft::build::{Field, RuleBuilder};
use nftkube_nft::ir::*;
use nftkube_nft::netlink::NftSocket;
use nftkube_nft::text;
use nftkube_nft::trace_event::{decode_trace, is_trace, TraceEvent, TraceKind, NFNLGRP_NFTRACE};
use nftkube_nft::tx::{Op, Transaction};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Set by the signal thread: stop waiting, remove the table, print what was seen. Not netlink's
/// `SHUTDOWN`, which would also abandon the removal's own netlink exchange.
pub static STOP: AtomicBool = AtomicBool::new(false);

/// nft's `raw` priority: before conntrack (-200) and destination NAT (-100).
const RAW_PRIORITY: i32 = -300;
/// How long to keep listening once the last counted packet was seen: its later hooks' events follow at once.
const GRACE: Duration = Duration::from_millis(300);
const POLL_SLICE: Duration = Duration::from_millis(100);

/// The packets to trace: addresses, protocol, ports (the source port only when given), incoming interface.
#[derive(Debug, Clone)]
pub struct Filter {
    /// Source address.
    pub src: IpAddr,
    /// Source port (None: any).
    pub src_port: Option<u16>,
    /// Destination address and port.
    pub dst: SocketAddr,
    /// Transport protocol.
    pub proto: Proto,
    /// Incoming interface (None: any).
    pub iif: Option<String>,
}

impl Filter {
    /// The table family of the packets (that of the source address).
    pub fn family(&self) -> Family {
        if self.src.is_ipv4() {
            Family::Ip
        } else {
            Family::Ip6
        }
    }

    /// The matching part and `meta nftrace set 1`; `iifname` only where packets have an incoming interface.
    fn rule(&self, with_iif: bool) -> Rule {
        let mut r = RuleBuilder::new()
            .cmp(Field::saddr(&self.src), CmpOp::Eq, ip_bytes(&self.src))
            .cmp(
                Field::daddr(&self.dst.ip()),
                CmpOp::Eq,
                ip_bytes(&self.dst.ip()),
            )
            .cmp(Field::L4Proto, CmpOp::Eq, vec![self.proto.number()]);
        if let Some(p) = self.src_port {
            r = r.cmp(Field::ThSport, CmpOp::Eq, p.to_be_bytes().to_vec());
        }
        r = r.cmp(
            Field::ThDport,
            CmpOp::Eq,
            self.dst.port().to_be_bytes().to_vec(),
        );
        if let (true, Some(iif)) = (with_iif, &self.iif) {
            r = r.iifname(iif, false, false);
        }
        r.expr(Expr::Immediate {
            dreg: REG_1,
            data: vec![1],
        })
        .expr(Expr::MetaSet {
            key: MetaKey::NfTrace,
            sreg: REG_1,
        })
        .build()
    }
}

fn ip_bytes(ip: &IpAddr) -> Vec<u8> {
    nftkube_nft::build::ip_bytes(ip)
}

/// A new trace table name for this run: `nftkube-trace-PID-START-RANDOM` (see `owner.rs`).
pub(crate) fn table_name() -> String {
    super::owner::new_table_name()
}

/// The trace table: a raw-priority chain on prerouting and on output, one rule each.
pub(crate) fn trace_table(name: &str, filter: &Filter) -> TableState {
    let mut t = TableState::new(filter.family(), name);
    for (chain, hook) in [("prerouting", Hook::Prerouting), ("output", Hook::Output)] {
        t.add_chain(Chain::base(chain, ChainType::Filter, hook, RAW_PRIORITY))
            .rules
            .push(filter.rule(hook == Hook::Prerouting));
    }
    t
}

fn add_tx(t: &TableState) -> Transaction {
    let mut tx = Transaction::default();
    // Exclusive: an existing table of that name is another run's, whose rules must not be mixed with ours.
    tx.push(t.family, &t.name, Op::CreateTable);
    for c in t.chains.values() {
        tx.push(t.family, &t.name, Op::AddChain(c.chain.clone()));
        for r in &c.rules {
            tx.push(
                t.family,
                &t.name,
                Op::AddRule {
                    chain: c.chain.name.clone(),
                    rule: r.clone(),
                },
            );
        }
    }
    tx
}

/// Removes the trace table when dropped: on every way out, errors and panics included.
struct Installed {
    family: Family,
    name: String,
}

impl Installed {
    fn install(t: &TableState) -> Result<Installed, TraceError> {
        let mut s = nft_socket()?;
        s.commit(&add_tx(t)).map_err(|e| {
            let why = if e.errno() == Some(libc::EEXIST) {
                " (the table exists already: another run's, or one left behind; names are random per run, so \
                 this is not expected)"
            } else {
                ""
            };
            TraceError::Kernel(format!(
                "adding table {} {}: {e}{why}",
                t.family.as_str(),
                t.name
            ))
        })?;
        Ok(Installed {
            family: t.family,
            name: t.name.clone(),
        })
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let mut tx = Transaction::default();
        tx.push(self.family, &self.name, Op::DeleteTable);
        let removed = nft_socket().and_then(|mut s| {
            s.commit(&tx)
                .map(drop)
                .map_err(|e| TraceError::Kernel(e.to_string()))
        });
        if let Err(e) = removed {
            use std::io::Write as _;
            // Not eprintln!, which panics where stderr cannot be written: a panic in a drop while unwinding
            // aborts.
            let _ = writeln!(
                std::io::stderr(),
                "nftkube trace: removing table {} {} failed ({e}); remove it with `nftkube cleanup --traces` or nft",
                self.family.as_str(),
                self.name
            );
        }
    }
}

fn nft_socket() -> Result<NftSocket, TraceError> {
    NftSocket::open().map_err(|e| TraceError::Kernel(format!("opening the nf_tables socket: {e}")))
}

/// One event, with the rule it names and the packet as it was there.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LiveEvent {
    /// `ip nftkube`.
    pub table: String,
    /// The chain the event is in.
    pub chain: String,
    /// Rule, return or policy event.
    pub kind: TraceKind,
    /// The rule's handle, for rule events.
    pub rule_handle: Option<u64>,
    /// The rule in nft syntax (read from the kernel by its handle).
    pub(crate) rule: Option<String>,
    /// The verdict the event reports (accept, jump CHAIN, …).
    pub verdict: Option<String>,
    /// `tcp 10.244.0.2:40000 -> 10.244.1.2:8080`: addresses after any NAT so far.
    pub packet: Option<String>,
    /// Incoming interface index.
    pub iif: Option<u32>,
    /// Outgoing interface index.
    pub(crate) oif: Option<u32>,
    /// The packet mark.
    pub mark: Option<u32>,
}

/// One traced packet: its events in the order the kernel sent them.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LivePacket {
    /// The kernel's trace id (reused across packets of one flow).
    pub id: u32,
    /// What the packet met.
    pub(crate) events: Vec<LiveEvent>,
}

/// What `--live` saw.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LiveTrace {
    /// The trace table and its rule, as installed.
    pub table: String,
    /// The `meta nftrace set 1` rule, in nft syntax.
    pub(crate) rule: String,
    /// The packets seen, in order.
    pub(crate) packets: Vec<LivePacket>,
    /// Why it stopped: `count`, `timeout` or `signal`.
    pub(crate) stopped_by: String,
}

/// What `--live` traces and for how long: the command line's request, already checked.
#[derive(Debug, Clone)]
pub struct LiveRequest {
    /// The packets to trace.
    pub filter: Filter,
    /// Stop after this many packets.
    pub count: u64,
    /// Stop after this long.
    pub timeout: Duration,
    /// JSON output instead of text.
    pub json: bool,
}

/// Runs `--live`: install, listen, remove, and the output (text or JSON).
pub fn run(request: &LiveRequest) -> Result<String, TraceError> {
    let LiveRequest {
        filter,
        count,
        timeout,
        json,
    } = request;
    let table = trace_table(&table_name(), filter);
    let rule_text = table
        .chains
        .get("prerouting")
        .and_then(|c| c.rules.first())
        .map(|r| text::render_rule(r, &table))
        .unwrap_or_default();
    // Listen before the rule exists, so that no event of a matching packet is missed.
    let mut sock = NlSocket::open(libc::NETLINK_NETFILTER)
        .map_err(|e| TraceError::Kernel(format!("opening a netfilter socket: {e}")))?;
    sock.add_membership(NFNLGRP_NFTRACE)
        .map_err(|e| TraceError::Kernel(format!("subscribing to trace events: {e}")))?;
    let installed = Installed::install(&table)?;
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "nftkube trace: tracing {} packet(s) matching `{rule_text}` for at most {:?} (table {} {})",
        count,
        timeout,
        table.family.as_str(),
        table.name
    );
    let (events, stopped_by) = listen(&mut sock, &table.name, *count as usize, *timeout)?;
    let packets = describe(events)?;
    drop(installed);
    let live = LiveTrace {
        table: format!("{} {}", table.family.as_str(), table.name),
        rule: rule_text,
        packets,
        stopped_by,
    };
    Ok(if *json {
        serde_json::to_string_pretty(&live).map_err(|e| TraceError::Output(e.to_string()))? + "\n"
    } else {
        render_text(&live)
    })
}

type Events = Vec<(u32, Vec<TraceEvent>)>;

/// Collects the events of the first `count` packets; stops `GRACE` after the last one started, at the
/// timeout, or on `STOP`.
fn listen(
    sock: &mut NlSocket,
    table: &str,
    count: usize,
    timeout: Duration,
) -> Result<(Events, String), TraceError> {
    let deadline = Instant::now() + timeout;
    let mut packets: Events = Vec::new();
    let mut until: Option<Instant> = None;
    let mut collecting = false;
    let mut buf = vec![0u8; 1 << 20];
    let stopped_by = loop {
        let now = Instant::now();
        if STOP.load(Ordering::SeqCst) {
            break "signal";
        }
        if until.is_some_and(|u| now >= u) {
            break "count";
        }
        if now >= deadline {
            break "timeout";
        }
        let slice = POLL_SLICE.min(deadline - now);
        let readable = sock
            .wait_readable(slice)
            .map_err(|e| TraceError::Kernel(format!("waiting for trace events: {e}")))?;
        if !readable {
            continue;
        }
        let n = sock.recv_raw(&mut buf).map_err(|e| {
            TraceError::Kernel(format!("reading trace events (some may be lost): {e}"))
        })?;
        for msg in messages(&buf[..n]).filter(|m| is_trace(m.msg_type)) {
            let ev = decode_trace(msg.payload).map_err(|e| TraceError::Kernel(e.to_string()))?;
            // A packet starts at our own rule, which it meets once, on the hook it enters by: the kernel's
            // trace id is derived from the socket buffer, which the next packet of a flow may reuse.
            let starts =
                ev.table == table && ev.kind == TraceKind::Rule && ev.rule_handle.is_some();
            if starts {
                // A packet beyond the count: its events are not collected (`collecting` is false).
                collecting = packets.len() < count;
                if collecting {
                    packets.push((ev.id, vec![ev]));
                    if packets.len() == count {
                        until = Some(Instant::now() + GRACE);
                    }
                }
            } else if let Some((id, evs)) = packets.last_mut().filter(|_| collecting) {
                if *id == ev.id {
                    evs.push(ev);
                }
            }
        }
    };
    Ok((packets, stopped_by.to_string()))
}

/// Names each event's rule (read back by handle from the tables the events name) and packet.
fn describe(packets: Events) -> Result<Vec<LivePacket>, TraceError> {
    let mut rules: BTreeMap<(Family, String), BTreeMap<(String, u64), String>> = BTreeMap::new();
    let mut socket = nft_socket()?;
    for (_, evs) in &packets {
        for e in evs {
            let key = (e.family, e.table.clone());
            if rules.contains_key(&key) {
                continue;
            }
            let texts = rule_texts(&mut socket, e.family, &e.table).unwrap_or_default();
            rules.insert(key, texts);
        }
    }
    Ok(packets
        .into_iter()
        .map(|(id, evs)| LivePacket {
            id,
            events: evs
                .into_iter()
                .map(|e| {
                    let rule = e.rule_handle.and_then(|h| {
                        rules
                            .get(&(e.family, e.table.clone()))
                            .and_then(|m| m.get(&(e.chain.clone(), h)))
                            .cloned()
                    });
                    LiveEvent {
                        table: format!("{} {}", e.family.as_str(), e.table),
                        packet: packet_text(&e),
                        chain: e.chain,
                        kind: e.kind,
                        rule_handle: e.rule_handle,
                        rule,
                        verdict: e.verdict,
                        iif: e.iif,
                        oif: e.oif,
                        mark: e.mark,
                    }
                })
                .collect(),
        })
        .collect())
}

/// (chain, handle) → rule text of one table; a table that does not decode gives no texts.
fn rule_texts(
    socket: &mut NftSocket,
    family: Family,
    table: &str,
) -> Option<BTreeMap<(String, u64), String>> {
    let state = socket.dump_table(family, table).ok()??;
    let rules = socket.rules_with_handles(family, table).ok()?;
    Some(
        rules
            .into_iter()
            .map(|(chain, handle, rule)| ((chain, handle), text::render_rule(&rule, &state)))
            .collect(),
    )
}

/// The traced packet's protocol, addresses and ports from the headers the event carries.
fn packet_text(e: &TraceEvent) -> Option<String> {
    let n = e.network_header.as_deref()?;
    let (proto, src, dst): (u8, IpAddr, IpAddr) = match n.first()? >> 4 {
        4 if n.len() >= 20 => (
            n[9],
            IpAddr::from(<[u8; 4]>::try_from(&n[12..16]).ok()?),
            IpAddr::from(<[u8; 4]>::try_from(&n[16..20]).ok()?),
        ),
        6 if n.len() >= 40 => (
            n[6],
            IpAddr::from(<[u8; 16]>::try_from(&n[8..24]).ok()?),
            IpAddr::from(<[u8; 16]>::try_from(&n[24..40]).ok()?),
        ),
        _ => return None,
    };
    let name = match proto {
        6 => "tcp".to_string(),
        17 => "udp".to_string(),
        132 => "sctp".to_string(),
        p => format!("proto {p}"),
    };
    Some(match e.transport_header.as_deref() {
        Some(t) if t.len() >= 4 => {
            let sport = u16::from_be_bytes([t[0], t[1]]);
            let dport = u16::from_be_bytes([t[2], t[3]]);
            format!(
                "{name} {} -> {}",
                SocketAddr::new(src, sport),
                SocketAddr::new(dst, dport)
            )
        }
        _ => format!("{name} {src} -> {dst}"),
    })
}

fn render_text(t: &LiveTrace) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "live trace: {} packet(s) matching `{}` (table {}, removed; stopped by {})",
        t.packets.len(),
        t.rule,
        t.table,
        t.stopped_by
    );
    if t.packets.is_empty() {
        let _ = writeln!(s, "no matching packet was seen");
    }
    for (i, p) in t.packets.iter().enumerate() {
        let _ = writeln!(s, "\npacket {} (trace id {:#010x}):", i + 1, p.id);
        let mut last_packet = None;
        for e in &p.events {
            let what = match e.kind {
                TraceKind::Rule if e.rule_handle.is_none() => "end of the chain's rules".into(),
                TraceKind::Rule => format!(
                    "[{}] {}",
                    e.rule_handle.map(|h| h.to_string()).unwrap_or_default(),
                    e.rule.as_deref().unwrap_or("(rule text not readable)")
                ),
                TraceKind::Return => "return".into(),
                TraceKind::Policy => "policy".into(),
            };
            let verdict = e.verdict.as_deref().unwrap_or("continue");
            let _ = writeln!(s, "  {} chain {}: {what} -> {verdict}", e.table, e.chain);
            if e.packet != last_packet {
                if let Some(pk) = &e.packet {
                    let mark = e.mark.map(|m| format!(" mark {m:#x}")).unwrap_or_default();
                    let _ = writeln!(s, "      packet: {pk}{mark}");
                }
                last_packet = e.packet.clone();
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_rule_matches_narrowly_and_sets_nftrace() {
        let f = Filter {
            src: "10.244.0.2".parse().unwrap(),
            src_port: None,
            dst: "10.96.0.10:53".parse().unwrap(),
            proto: Proto::Udp,
            iif: Some("pod0".into()),
        };
        let t = trace_table("nftkube-trace-1", &f);
        let pre = text::render_rule(&t.chains["prerouting"].rules[0], &t);
        let out = text::render_rule(&t.chains["output"].rules[0], &t);
        assert!(
            pre.contains("10.244.0.2") && pre.contains("10.96.0.10") && pre.contains("iifname"),
            "{pre}"
        );
        assert!(pre.ends_with("meta nftrace set 1"), "{pre}");
        assert!(!out.contains("iifname"), "{out}");
        assert_eq!(
            t.chains["output"].chain.base.as_ref().unwrap().priority,
            RAW_PRIORITY
        );
    }
}
