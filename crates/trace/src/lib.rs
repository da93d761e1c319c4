//! `nftkube trace`: where a packet goes through the programmed state, and why.
//!
//! Offline, the packet is evaluated by an interpreter of the nf_tables expressions (`eval.rs`) over the typed
//! state: read back from the kernel (every table of the packet's family that decodes, ours and the portmap
//! plugin's included) or rendered from manifests like `nftkube plan`. Random choices (`numgen`) are explored
//! one branch per value, so the result lists every outcome with its probability. What the path depends on
//! that the ruleset does not hold (the node's addresses, the connection state) is taken from the node or
//! the flags and listed as assumptions.
//!
//! `--live` (`live.rs`) asks the kernel instead: a narrowly matching `meta nftrace set 1` rule in a table of
//! its own, and the trace events of the next matching packets.
#![forbid(unsafe_code)]

mod attribution;
mod decide;
mod eval;
mod expr;
pub mod live;
mod lookup;
mod owner;
pub mod packet;
mod regs;
mod report;

pub use attribution::{Attribution, FromModel, KeysOnly};
pub use packet::{NodeContext, Origin, Packet, Proto};

/// Whether the `--live` trace table `name` was left by a run that has ended, as this process's /proc shows
/// processes (`nftkube cleanup --traces`).
pub fn is_abandoned(name: &str) -> std::io::Result<bool> {
    owner::is_abandoned(name, std::path::Path::new("/proc"))
}
pub use report::{render_text, Outcome, Step, Trace};

use nftkube_nft::ir::{Family, TableState};

/// More random branches than this is not a trace anyone reads (and a sign of an unexpected shape).
const MAX_BRANCHES: usize = 65_536;

/// Why a trace could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The ruleset refers to something that is not there (a chain, a set).
    #[error("inconsistent ruleset: {0}")]
    Ruleset(String),
    /// An expression or an operand the evaluator does not model.
    #[error("cannot evaluate {0}")]
    Unsupported(String),
    /// Too many random branches to follow.
    #[error("more than {MAX_BRANCHES} random branches (nested numgen choices)")]
    TooManyBranches,
    /// The kernel's ruleset could not be read.
    #[error("reading the ruleset from the kernel: {0}")]
    Kernel(String),
    /// A bad argument (exit code 64).
    #[error("{0}")]
    Usage(String),
    /// The output could not be written.
    #[error("writing the output: {0}")]
    Output(String),
}

/// What to trace.
#[derive(Debug, Clone)]
pub struct Request {
    /// The packet.
    pub packet: Packet,
    /// Where it comes from (which hooks it meets).
    pub origin: Origin,
}

/// The state to trace through and where it came from.
pub struct Ruleset {
    /// The tables, as typed state.
    pub tables: Vec<TableState>,
    /// Where they came from (`kernel`, `manifests DIR`).
    pub description: String,
    /// What could not be read (tables that did not decode), for the assumptions.
    pub notes: Vec<String>,
}

/// Evaluates the packet through every random branch of the ruleset.
pub fn trace(
    ruleset: &Ruleset,
    req: &Request,
    node: &NodeContext,
    attribution: &dyn Attribution,
) -> Result<Trace, TraceError> {
    let family = req.packet.family();
    let tables: Vec<&TableState> = ruleset
        .tables
        .iter()
        .filter(|t| t.family == family || t.family == Family::Inet)
        .collect();
    let ctx = eval::Context {
        tables: &tables,
        node,
        origin: req.origin,
        attribution,
    };
    let branches = enumerate(&ctx, &req.packet)?;
    let mut assumptions = vec![
        "the first packet of a new connection (ct state new, no conntrack entry yet)".to_string(),
        format!(
            "local addresses {} ({})",
            list(&node.local_addresses),
            node.source
        ),
        match &req.packet.iif {
            Some(i) => format!("arrives on interface {i}"),
            None => {
                "incoming interface not given (--iif): iifname matches see an empty name".into()
            }
        },
    ];
    assumptions.extend(ruleset.notes.iter().cloned());
    Ok(Trace {
        packet: format!(
            "{} {} -> {}",
            req.packet.proto.as_str(),
            req.packet.src,
            req.packet.dst
        ),
        origin: req.origin.as_str(),
        ruleset: ruleset.description.clone(),
        assumptions,
        outcomes: report::outcomes(branches),
    })
}

fn list(ips: &[std::net::IpAddr]) -> String {
    if ips.is_empty() {
        return "none".into();
    }
    ips.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs the packet once per combination of `numgen` values, depth first.
fn enumerate(ctx: &eval::Context<'_>, packet: &Packet) -> Result<Vec<report::Branch>, TraceError> {
    let mut pending: Vec<Vec<u32>> = vec![Vec::new()];
    let mut done = Vec::new();
    while let Some(choices) = pending.pop() {
        match eval::run(ctx, packet, &choices) {
            Ok(b) => done.push(b),
            Err(eval::Interrupt::Choice { groups }) => {
                if done.len() + pending.len() + groups > MAX_BRANCHES {
                    return Err(TraceError::TooManyBranches);
                }
                for index in (0..groups as u32).rev() {
                    let mut next = choices.clone();
                    next.push(index);
                    pending.push(next);
                }
            }
            Err(eval::Interrupt::Error(e)) => return Err(e),
        }
    }
    Ok(done)
}

/// Every table of the families a packet of `family` meets (`family` and inet), read back from the kernel of
/// this network namespace. Tables that do not decode (foreign expressions) are left out and said so.
pub fn kernel_ruleset(family: Family) -> Result<Ruleset, TraceError> {
    let mut socket = nftkube_nft::netlink::NftSocket::open()
        .map_err(|e| TraceError::Kernel(format!("opening the nf_tables socket: {e}")))?;
    let mut tables = Vec::new();
    let mut notes = Vec::new();
    for f in [family, Family::Inet] {
        let names = socket.list_tables(f).map_err(|e| {
            TraceError::Kernel(format!(
                "listing {} tables: {e} (reading the kernel needs root; --manifests DIR traces the plan without)",
                f.as_str()
            ))
        })?;
        for name in names {
            match socket.dump_table(f, &name) {
                Ok(Some(t)) => tables.push(t),
                Ok(None) => {}
                Err(e) => notes.push(format!(
                    "table {} {name} not evaluated (it does not decode: {e}); it may change the path",
                    f.as_str()
                )),
            }
        }
    }
    if !tables.iter().any(|t| t.family == family) {
        notes.push(format!(
            "no {} table in this namespace's kernel: is the agent running here?",
            family.as_str()
        ));
    }
    Ok(Ruleset {
        tables,
        description: "the kernel's tables in this network namespace".into(),
        notes,
    })
}

/// The node's addresses from this namespace (rtnetlink), or `given` ones.
pub fn node_context(given: &[std::net::IpAddr]) -> Result<NodeContext, TraceError> {
    if !given.is_empty() {
        return Ok(NodeContext {
            local_addresses: given.to_vec(),
            source: "from --node-ip".into(),
        });
    }
    let addresses = nftkube_node::addresses()
        .map_err(|e| TraceError::Kernel(format!("reading this namespace's addresses: {e}")))?;
    let mut local: Vec<_> = addresses.iter().map(|a| a.ip).collect();
    local.sort();
    local.dedup();
    Ok(NodeContext {
        local_addresses: local,
        source: "this network namespace's addresses, and loopback".into(),
    })
}

#[cfg(test)]
mod tests;
