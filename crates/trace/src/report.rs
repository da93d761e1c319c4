//! What a trace found: the steps of each random branch, gathered into outcomes with probabilities, and their
//! rendering as text (JSON is the same data through serde).

use nftkube_nft::ir::{Rule, TableState};
use nftkube_nft::text;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::SocketAddr;

/// One thing the packet met: a rule (matched or not), a chain's policy, a skipped chain, the routing decision.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Step {
    /// The hook it happened in.
    pub hook: &'static str,
    /// `ip nftkube`; empty for the routing decision.
    pub table: String,
    /// The chain (`(routing)` for the routing decision).
    pub chain: String,
    /// The rule's position in its chain (None: not a rule).
    pub(crate) rule: Option<usize>,
    /// The rule in nft syntax, with its comment.
    pub(crate) text: String,
    /// Whether it matched (a policy and a routing decision always do).
    pub(crate) matched: bool,
    /// What the rule did, or why it did not match.
    pub(crate) result: String,
    /// Lookups, random choices, NAT and mark changes, with the service they belong to where known.
    pub notes: Vec<String>,
}

impl Step {
    /// Rule `index` of `chain`, before evaluation.
    pub(crate) fn rule(
        hook: &'static str,
        table: &TableState,
        chain: &str,
        index: usize,
        rule: &Rule,
    ) -> Step {
        let mut text = text::render_rule(rule, table);
        if let Some(c) = &rule.comment {
            if !text.contains("comment") {
                let _ = write!(text, " comment {c:?}");
            }
        }
        Step {
            hook,
            table: table_name(table),
            chain: chain.into(),
            rule: Some(index),
            text,
            ..Step::default()
        }
    }
    /// The end of a base chain: its policy.
    pub(crate) fn policy(
        hook: &'static str,
        table: &TableState,
        chain: &str,
        policy: &str,
    ) -> Step {
        Step {
            hook,
            table: table_name(table),
            chain: chain.into(),
            text: format!("policy {policy}"),
            matched: true,
            result: format!("end of base chain: policy {policy}"),
            ..Step::default()
        }
    }
    /// A chain the packet does not traverse, and why.
    pub(crate) fn skipped(hook: &'static str, table: &TableState, chain: &str, why: &str) -> Step {
        Step {
            hook,
            table: table_name(table),
            chain: chain.into(),
            result: why.into(),
            ..Step::default()
        }
    }
    /// The routing decision between hooks.
    pub(crate) fn routing(hook: &'static str, decision: String) -> Step {
        Step {
            hook,
            chain: "(routing)".into(),
            matched: true,
            result: decision,
            ..Step::default()
        }
    }
    /// `table chain rule N` for messages.
    pub(crate) fn place(&self) -> String {
        match self.rule {
            Some(i) => format!("{} chain {} rule {i}", self.table, self.chain),
            None => format!("{} chain {}", self.table, self.chain),
        }
    }
}

fn table_name(t: &TableState) -> String {
    format!("{} {}", t.family.as_str(), t.name)
}

/// What happened to the packet in the end.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub(crate) struct Fate {
    /// `accept`, `drop` or `reject`.
    pub verdict: String,
    pub(crate) detail: String,
}

impl Fate {
    pub(crate) fn accepted(detail: String) -> Fate {
        Fate {
            verdict: "accept".into(),
            detail,
        }
    }
    pub(crate) fn dropped(by: &str) -> Fate {
        Fate {
            verdict: "drop".into(),
            detail: format!("dropped by {by}"),
        }
    }
    pub(crate) fn rejected(with: &str, by: &str) -> Fate {
        Fate {
            verdict: "reject".into(),
            detail: format!("{with}, by {by}"),
        }
    }
}

/// One run: a value for every random choice met, and what followed.
#[derive(Debug, Clone, Default)]
pub(crate) struct Branch {
    pub(crate) steps: Vec<Step>,
    pub(crate) fate: Fate,
    /// (values leading this way, modulus) of each random choice that mattered, in order.
    pub(crate) choices: Vec<(u32, u32)>,
    pub(crate) dnat: Option<SocketAddr>,
    pub(crate) snat: Option<SocketAddr>,
    /// The rule that masqueraded, if one did.
    pub(crate) masquerade: Option<String>,
    /// Rules that changed the packet mark (what asks for masquerade).
    pub(crate) mark_changes: Vec<String>,
    pub affinity: Vec<String>,
    pub(crate) final_packet: Option<(SocketAddr, SocketAddr)>,
}

impl Branch {
    pub(crate) fn probability(&self) -> f64 {
        self.choices
            .iter()
            .map(|(n, m)| *n as f64 / *m as f64)
            .product()
    }

    /// Whether, and why (not), the packet is masqueraded.
    fn masquerade_reason(&self) -> String {
        match &self.masquerade {
            Some(by) if self.mark_changes.is_empty() => format!("masquerade by {by}"),
            Some(by) => format!(
                "masquerade by {by}; the mark was set by {}",
                self.mark_changes.join(", ")
            ),
            None => {
                let missed: Vec<String> = self
                    .steps
                    .iter()
                    .filter(|s| !s.matched && s.text.contains("meta mark set"))
                    .map(|s| format!("{} ({})", s.place(), s.result))
                    .collect();
                if missed.is_empty() {
                    "no rule on its path masquerades it".into()
                } else {
                    format!("not marked for masquerade: {}", missed.join("; "))
                }
            }
        }
    }
}

/// Branches with the same fate, NAT and masquerade decision.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The probability of this outcome (sum over its branches).
    pub(crate) probability: f64,
    /// The final verdict (accept, drop, reject …).
    pub verdict: String,
    /// The verdict and where the packet ends up, in a line.
    pub(crate) detail: String,
    /// Where DNAT sent the packet (None: not DNATed).
    pub(crate) dnat: Option<SocketAddr>,
    /// Where SNAT sent the source (None: not SNATed).
    pub(crate) snat: Option<SocketAddr>,
    /// Whether the packet is masqueraded.
    pub(crate) masquerade: bool,
    /// The rule that decided masquerading, and why.
    pub(crate) masquerade_reason: String,
    /// Affinity entries hit or recorded.
    pub affinity: Vec<String>,
    /// The random choices that lead here (values leading this way, modulus), one list per branch.
    pub(crate) choices: Vec<Vec<(u32, u32)>>,
    /// The path of the most likely branch of this outcome (of those as likely, the first): with `pick`'s
    /// draws, the draw that hits rather than the rounds of misses before the search.
    pub(crate) path: Vec<Step>,
    /// That branch's probability.
    #[serde(skip)]
    path_probability: f64,
}

/// The whole answer.
#[derive(Debug, Clone, Serialize)]
pub struct Trace {
    /// The packet, in a line.
    pub packet: String,
    /// `pod`, `node` or `outside`.
    pub origin: &'static str,
    /// Where the ruleset came from (`kernel`, `manifests DIR`).
    pub(crate) ruleset: String,
    /// What the path depends on that the ruleset does not say, and what was assumed for it.
    pub assumptions: Vec<String>,
    /// The outcomes, most likely first.
    pub(crate) outcomes: Vec<Outcome>,
}

/// Groups branches by what the operator cares about: verdict, DNAT target, SNAT, masquerade.
pub(crate) fn outcomes(branches: Vec<Branch>) -> Vec<Outcome> {
    type Key = (Fate, Option<SocketAddr>, Option<SocketAddr>, bool, String);
    let mut groups: BTreeMap<Key, Outcome> = BTreeMap::new();
    for b in branches {
        let reason = b.masquerade_reason();
        let key = (
            b.fate.clone(),
            b.dnat,
            b.snat,
            b.masquerade.is_some(),
            reason.clone(),
        );
        let p = b.probability();
        match groups.get_mut(&key) {
            Some(o) => {
                o.probability += p;
                o.choices.push(b.choices.clone());
                if p > o.path_probability {
                    o.path = b.steps;
                    o.path_probability = p;
                }
                for a in b.affinity {
                    if !o.affinity.contains(&a) {
                        o.affinity.push(a);
                    }
                }
            }
            None => {
                groups.insert(
                    key,
                    Outcome {
                        probability: p,
                        verdict: b.fate.verdict.clone(),
                        detail: b.fate.detail.clone(),
                        dnat: b.dnat,
                        snat: b.snat,
                        masquerade: b.masquerade.is_some(),
                        masquerade_reason: reason,
                        affinity: b.affinity.clone(),
                        choices: vec![b.choices.clone()],
                        path: b.steps,
                        path_probability: p,
                    },
                );
            }
        }
    }
    let mut out: Vec<Outcome> = groups.into_values().collect();
    out.sort_by(|a, b| {
        b.probability
            .total_cmp(&a.probability)
            .then(a.dnat.cmp(&b.dnat))
    });
    out
}

/// The text form: packet and assumptions, then per outcome its probability, verdict, NAT, masquerade and path.
pub fn render_text(t: &Trace) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "packet: {} (from {})", t.packet, t.origin);
    let _ = writeln!(s, "ruleset: {}", t.ruleset);
    for a in &t.assumptions {
        let _ = writeln!(s, "assumed: {a}");
    }
    let _ = writeln!(s, "\noutcomes:");
    for o in &t.outcomes {
        let _ = writeln!(s, "  {:6.2}%  {}", o.probability * 100.0, summary(o));
    }
    for (i, o) in t.outcomes.iter().enumerate() {
        let _ = writeln!(
            s,
            "\noutcome {} ({:.2}%): {}",
            i + 1,
            o.probability * 100.0,
            summary(o)
        );
        let _ = writeln!(s, "  {}", o.detail);
        let _ = writeln!(s, "  masquerade: {}", o.masquerade_reason);
        for a in &o.affinity {
            let _ = writeln!(s, "  affinity: {a}");
        }
        match (i, t.outcomes.first()) {
            (1.., Some(first)) if same_shape(&first.path, &o.path) => {
                let _ = writeln!(s, "  path: as outcome 1, except:");
                let differing: Vec<Step> = first
                    .path
                    .iter()
                    .zip(&o.path)
                    .filter(|(a, b)| a != b)
                    .map(|(_, b)| b.clone())
                    .collect();
                render_path(&mut s, &differing);
            }
            _ => render_path(&mut s, &o.path),
        }
    }
    s
}

/// The same rules met with the same match results (only notes, such as random values, differ).
fn same_shape(a: &[Step], b: &[Step]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            (x.hook, &x.table, &x.chain, x.rule, x.matched)
                == (y.hook, &y.table, &y.chain, y.rule, y.matched)
        })
}

fn summary(o: &Outcome) -> String {
    let mut parts = vec![o.verdict.clone()];
    if let Some(d) = o.dnat {
        parts.push(format!("dnat to {d}"));
    }
    if let Some(d) = o.snat {
        parts.push(format!("snat to {d}"));
    }
    parts.push(
        if o.masquerade {
            "masquerade"
        } else {
            "no masquerade"
        }
        .into(),
    );
    parts.join(", ")
}

fn render_path(s: &mut String, path: &[Step]) {
    let mut last_hook = "";
    let mut last_chain = (String::new(), String::new());
    for step in path {
        if step.hook != last_hook {
            let _ = writeln!(s, "  hook {}:", step.hook);
            last_hook = step.hook;
            last_chain = Default::default();
        }
        if (step.table.clone(), step.chain.clone()) != last_chain {
            if step.table.is_empty() {
                let _ = writeln!(s, "    {}", step.chain);
            } else {
                let _ = writeln!(s, "    {} chain {}", step.table, step.chain);
            }
            last_chain = (step.table.clone(), step.chain.clone());
        }
        let mark = if step.matched { "+" } else { "-" };
        match step.rule {
            Some(i) => {
                let _ = writeln!(s, "      {mark} [{i}] {}", step.text);
                let _ = writeln!(s, "          -> {}", step.result);
            }
            None => {
                let _ = writeln!(s, "      {mark} {}", step.result);
            }
        }
        for n in &step.notes {
            let _ = writeln!(s, "          . {n}");
        }
    }
}
