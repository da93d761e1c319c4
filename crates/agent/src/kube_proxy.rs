//! `nftkube cleanup --kube-proxy`: removes what kube-proxy leaves behind when it is replaced, over nf_tables
//! netlink, and nothing else.
//!
//! What counts as kube-proxy's follows its own `CleanupLeftovers` (pkg/proxy/nftables/proxier.go and
//! pkg/proxy/iptables/proxier.go in kubernetes/kubernetes):
//! - nftables mode: the tables `ip kube-proxy` and `ip6 kube-proxy`, whole;
//! - iptables mode (iptables-nft, whose tables are ordinary nf_tables tables): the jump rules from the built-in
//!   chains into kube-proxy's top chains, identified by source chain, target and kube-proxy's comment; then,
//!   in `nat`, KUBE-SERVICES, KUBE-NODEPORTS, KUBE-POSTROUTING and every service and endpoint chain (KUBE-SVC-,
//!   KUBE-SVL-, KUBE-EXT-, KUBE-FW-, KUBE-SEP-); in `filter`, KUBE-SERVICES, KUBE-EXTERNAL-SERVICES,
//!   KUBE-FORWARD and KUBE-NODEPORTS. kube-proxy leaves KUBE-MARK-MASQ, KUBE-PROXY-FIREWALL (unlinked), its
//!   canaries and kubelet's chains (KUBE-FIREWALL, KUBE-MARK-DROP, KUBE-KUBELET-CANARY): so does this.
//!
//! Each family is one transaction: a rule read as a jump but changed since (a stale handle) makes the kernel
//! refuse the whole of it, and nothing of that family changes.

use nftkube_nft::ir::{Family, Verdict};
use nftkube_nft::netlink::{CommitError, DumpError, NftSocket};
use nftkube_nft::tx::{Op, Transaction};
use nftkube_nft::wire::RuleOutline;
use std::collections::BTreeSet;
use std::fmt;

/// kube-proxy's nftables-mode table, in both families.
const NFTABLES_TABLE: &str = "kube-proxy";

/// One of kube-proxy's jump rules: (table, built-in chain, kube-proxy chain, kube-proxy's comment).
type Jump = (&'static str, &'static str, &'static str, &'static str);

/// kube-proxy's `iptablesJumpChains`, and the INPUT → KUBE-SERVICES rule of 1.13 to 1.19 that later releases
/// kept in `iptablesCleanupOnlyChains`.
const JUMPS: [Jump; 13] = [
    ("filter", "INPUT", "KUBE-EXTERNAL-SERVICES", EXTERNAL),
    ("filter", "FORWARD", "KUBE-EXTERNAL-SERVICES", EXTERNAL),
    (
        "filter",
        "INPUT",
        "KUBE-NODEPORTS",
        "kubernetes health check service ports",
    ),
    ("filter", "FORWARD", "KUBE-SERVICES", PORTALS),
    ("filter", "OUTPUT", "KUBE-SERVICES", PORTALS),
    ("filter", "INPUT", "KUBE-SERVICES", PORTALS),
    (
        "filter",
        "FORWARD",
        "KUBE-FORWARD",
        "kubernetes forwarding rules",
    ),
    ("filter", "INPUT", "KUBE-PROXY-FIREWALL", LB_FIREWALL),
    ("filter", "OUTPUT", "KUBE-PROXY-FIREWALL", LB_FIREWALL),
    ("filter", "FORWARD", "KUBE-PROXY-FIREWALL", LB_FIREWALL),
    ("nat", "OUTPUT", "KUBE-SERVICES", PORTALS),
    ("nat", "PREROUTING", "KUBE-SERVICES", PORTALS),
    (
        "nat",
        "POSTROUTING",
        "KUBE-POSTROUTING",
        "kubernetes postrouting rules",
    ),
];
const PORTALS: &str = "kubernetes service portals";
const EXTERNAL: &str = "kubernetes externally-visible service portals";
const LB_FIREWALL: &str = "kubernetes load balancer firewall";

/// The chains kube-proxy's cleanup deletes, by table.
const NAT_CHAINS: [&str; 3] = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING"];
const FILTER_CHAINS: [&str; 4] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
];
/// Service and endpoint chains (`isServiceChainName`): nat only.
const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

/// The iptables-nft tables looked at: nat and filter hold what is removed; mangle only what is reported
/// (kube-proxy's and kubelet's canaries).
const IPTABLES_TABLES: [&str; 3] = ["nat", "filter", "mangle"];

/// Why the cleanup of one family stopped; nothing of that family was changed.
#[derive(Debug, thiserror::Error)]
pub enum KubeProxyCleanupError {
    /// No nf_tables socket.
    #[error("opening an nf_tables socket: {0}")]
    Open(#[source] std::io::Error),
    /// A table could not be read: nothing is deleted on a partial view.
    #[error("reading table {} {table}: {source}", family.as_str())]
    Dump {
        /// The family.
        family: Family,
        /// The table.
        table: String,
        /// The dump's error (errno, or what did not decode).
        #[source]
        source: DumpError,
    },
    /// The kernel refused the family's transaction (each refused object with its errno and extended ack).
    #[error("removing kube-proxy's {} objects: {source}", family.as_str())]
    Commit {
        /// The family.
        family: Family,
        /// The refusal.
        #[source]
        source: CommitError,
    },
}

/// What was found of kube-proxy's in one family: removed, and left.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FamilyReport {
    /// The family.
    pub family: Option<Family>,
    /// Whole tables removed (`kube-proxy`).
    pub tables: Vec<String>,
    /// Chains removed, as `table/chain`.
    pub chains: Vec<String>,
    /// Jump rules removed, as `table/chain#handle → target`.
    pub rules: Vec<String>,
    /// Found and left, each with why.
    pub left: Vec<String>,
}

impl fmt::Display for FamilyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let family = self.family.map_or("?", Family::as_str);
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        write!(
            f,
            "{family}: removed {} table(s) [{}], {} chain(s) [{}], {} rule(s) [{}]; left {} [{}]",
            self.tables.len(),
            list(&self.tables),
            self.chains.len(),
            list(&self.chains),
            self.rules.len(),
            list(&self.rules),
            self.left.len(),
            list(&self.left)
        )
    }
}

/// One iptables-nft table as read: its user chains (not base chains) and its rules in outline.
#[derive(Debug, Default)]
pub(crate) struct TableView {
    pub(crate) name: String,
    /// Every chain's name, with whether it is a base chain.
    pub(crate) chains: Vec<(String, bool)>,
    pub(crate) rules: Vec<RuleOutline>,
    /// (set, chain) for every set element that jumps or goes to a chain.
    pub(crate) set_targets: Vec<(String, String)>,
}

/// What to do in one table: rules by handle, then chains (flushed, then deleted), and what stays.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct TablePlan {
    pub(crate) rules: Vec<(String, u64, String)>,
    pub(crate) chains: Vec<String>,
    pub(crate) left: Vec<String>,
}

/// What became of one family: each is its own transaction, so one family's failure leaves the other's outcome.
pub type FamilyOutcome = Result<FamilyReport, KubeProxyCleanupError>;

/// Removes kube-proxy's leftovers in both families, one transaction each, and says what it did in each.
pub fn cleanup_kube_proxy() -> Result<Vec<FamilyOutcome>, KubeProxyCleanupError> {
    let mut socket = NftSocket::open().map_err(KubeProxyCleanupError::Open)?;
    Ok([Family::Ip, Family::Ip6]
        .into_iter()
        .map(|family| cleanup_family(&mut socket, family))
        .collect())
}

fn cleanup_family(
    socket: &mut NftSocket,
    family: Family,
) -> Result<FamilyReport, KubeProxyCleanupError> {
    let dump_err = |table: &str| {
        let table = table.to_string();
        move |source| KubeProxyCleanupError::Dump {
            family,
            table,
            source,
        }
    };
    let tables = socket.list_tables(family).map_err(dump_err("*"))?;
    let mut report = FamilyReport {
        family: Some(family),
        ..FamilyReport::default()
    };
    let mut tx = Transaction::default();
    if tables.iter().any(|t| t == NFTABLES_TABLE) {
        tx.push(family, NFTABLES_TABLE, Op::DeleteTable);
        report.tables.push(NFTABLES_TABLE.to_string());
    }
    for name in IPTABLES_TABLES {
        if !tables.iter().any(|t| t == name) {
            continue;
        }
        let view = read_view(socket, family, name).map_err(dump_err(name))?;
        let plan = plan_table(&view);
        push_plan(&mut tx, family, name, &plan, &mut report);
    }
    socket
        .commit(&tx)
        .map_err(|source| KubeProxyCleanupError::Commit { family, source })?;
    Ok(report)
}

fn read_view(socket: &mut NftSocket, family: Family, name: &str) -> Result<TableView, DumpError> {
    let chains = socket.list_chains(family, name)?;
    Ok(TableView {
        name: name.to_string(),
        chains: chains
            .into_iter()
            .map(|c| (c.name, c.base.is_some()))
            .collect(),
        rules: socket.rule_outlines(family, name)?,
        set_targets: socket.set_verdict_targets(family, name)?,
    })
}

/// Rules first: a chain can only go once nothing jumps into it. Flushes before deletions: a deleted chain's
/// rules may jump into another deleted chain.
fn push_plan(
    tx: &mut Transaction,
    family: Family,
    table: &str,
    plan: &TablePlan,
    report: &mut FamilyReport,
) {
    for (chain, handle, target) in &plan.rules {
        let op = Op::DeleteRule {
            chain: chain.clone(),
            handle: *handle,
        };
        tx.push(family, table, op);
        report
            .rules
            .push(format!("{table}/{chain}#{handle} → {target}"));
    }
    for chain in &plan.chains {
        tx.push(family, table, Op::FlushChain(chain.clone()));
    }
    for chain in &plan.chains {
        tx.push(family, table, Op::DeleteChain(chain.clone()));
        report.chains.push(format!("{table}/{chain}"));
    }
    report
        .left
        .extend(plan.left.iter().map(|why| format!("{table}/{why}")));
}

/// Whether kube-proxy's cleanup deletes this chain of this table.
fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => {
            NAT_CHAINS.contains(&chain)
                || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        "filter" => FILTER_CHAINS.contains(&chain),
        _ => false,
    }
}

/// Whether the rule is one of kube-proxy's jumps: in the built-in chain it puts it in, ending in a jump to
/// the kube-proxy chain, with kube-proxy's comment. Anything less is someone else's rule.
fn is_kube_proxy_jump(table: &str, rule: &RuleOutline) -> Option<&'static str> {
    let Some(Verdict::Jump(target)) = &rule.last_verdict else {
        return None;
    };
    JUMPS
        .iter()
        .find(|(t, src, dst, comment)| {
            *t == table
                && rule.chain == *src
                && &**target == *dst
                && rule.comment.as_deref() == Some(*comment)
                && !rule.unreadable
        })
        .map(|(_, _, dst, _)| *dst)
}

/// Decides what goes in one table. A kube-proxy chain that a kept rule or a map element still jumps into is
/// kept (and said so), with what it leads to: the kernel would refuse its deletion, and the rule or element is
/// not ours to remove.
pub(crate) fn plan_table(view: &TableView) -> TablePlan {
    let table = view.name.as_str();
    let jumps: Vec<(&RuleOutline, &str)> = view
        .rules
        .iter()
        .filter_map(|r| is_kube_proxy_jump(table, r).map(|dst| (r, dst)))
        .collect();
    let mut doomed: BTreeSet<&str> = view
        .chains
        .iter()
        .filter(|(name, base)| !base && is_kube_proxy_chain(table, name))
        .map(|(name, _)| name.as_str())
        .collect();
    let mut left = keep_referenced(view, &jumps, &mut doomed);
    // Every other KUBE- chain stays, as kube-proxy's own cleanup leaves it: named, so the operator knows.
    let others: Vec<String> = view
        .chains
        .iter()
        .map(|(name, _)| name)
        .filter(|name| name.starts_with("KUBE-") && !doomed.contains(name.as_str()))
        .filter(|name| !left.iter().any(|l| l.starts_with(&format!("{name} "))))
        .cloned()
        .collect();
    left.extend(others);
    TablePlan {
        rules: jumps
            .iter()
            .map(|(r, dst)| (r.chain.clone(), r.handle, dst.to_string()))
            .collect(),
        chains: doomed.into_iter().map(str::to_owned).collect(),
        left,
    }
}

/// Takes out of `doomed` every chain that something staying leads to (a map element, a rule not removed),
/// until nothing staying does; says why for each.
fn keep_referenced(
    view: &TableView,
    jumps: &[(&RuleOutline, &str)],
    doomed: &mut BTreeSet<&str>,
) -> Vec<String> {
    let mut left = Vec::new();
    for (set, chain) in &view.set_targets {
        if doomed.remove(chain.as_str()) {
            left.push(format!("{chain} (an element of set {set} jumps to it)"));
        }
    }
    loop {
        let referenced = view.rules.iter().find_map(|r| {
            let removed = doomed.contains(r.chain.as_str())
                || jumps.iter().any(|(j, _)| j.handle == r.handle);
            let into = r.targets.iter().find(|t| doomed.contains(t.as_str()))?;
            (!removed).then(|| (into.clone(), r.chain.clone(), r.handle))
        });
        let Some((chain, from, handle)) = referenced else {
            return left;
        };
        doomed.remove(chain.as_str());
        left.push(format!("{chain} (rule {from}#{handle} jumps to it)"));
    }
}

/// State kube-proxy may have left outside nf_tables, which nftkube cannot read or remove without binaries:
/// what the operator should look at, one line each.
pub fn outside_nf_tables() -> Vec<String> {
    let mut out = Vec::new();
    for (file, what) in [
        (
            "/proc/net/ip_tables_names",
            "iptables-legacy (x_tables) IPv4",
        ),
        (
            "/proc/net/ip6_tables_names",
            "iptables-legacy (x_tables) IPv6",
        ),
    ] {
        let names = read_lines(file);
        if !names.is_empty() {
            out.push(format!(
                "{what} tables in use: {}; nftkube cannot read x_tables: if kube-proxy ran with \
                 iptables-legacy, run `kube-proxy --cleanup` once on this node",
                names.join(", ")
            ));
        }
    }
    // /proc/net/ip_vs: two header lines, then the virtual services.
    let services = read_lines("/proc/net/ip_vs").len().saturating_sub(2);
    if services > 0 {
        out.push(format!(
            "{services} IPVS virtual service line(s): if kube-proxy ran in ipvs mode, run `kube-proxy \
             --cleanup` (it also deletes the kube-ipvs0 link and its ipsets)"
        ));
    }
    out
}

/// The non-empty lines of a /proc file; none when it does not exist (the module is not loaded).
fn read_lines(path: &str) -> Vec<String> {
    std::fs::read_to_string(path)
        .map(|s| {
            s.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(chain: &str, handle: u64, comment: Option<&str>, jump: Option<&str>) -> RuleOutline {
        RuleOutline {
            chain: chain.into(),
            handle,
            comment: comment.map(str::to_owned),
            targets: jump.into_iter().map(str::to_owned).collect(),
            last_verdict: jump.map(|j| Verdict::Jump(j.into())),
            unreadable: false,
        }
    }

    fn view(name: &str, chains: &[(&str, bool)], rules: Vec<RuleOutline>) -> TableView {
        TableView {
            name: name.into(),
            chains: chains.iter().map(|(c, b)| (c.to_string(), *b)).collect(),
            rules,
            set_targets: Vec::new(),
        }
    }

    fn nat() -> TableView {
        view(
            "nat",
            &[
                ("PREROUTING", true),
                ("POSTROUTING", true),
                ("KUBE-SERVICES", false),
                ("KUBE-SVC-AAAA", false),
                ("KUBE-SEP-BBBB", false),
                ("KUBE-MARK-MASQ", false),
                ("KUBE-MARK-DROP", false),
                ("OPERATOR", false),
            ],
            vec![
                rule("PREROUTING", 10, Some(PORTALS), Some("KUBE-SERVICES")),
                rule("POSTROUTING", 11, None, Some("OPERATOR")),
                rule("KUBE-SERVICES", 12, Some("x"), Some("KUBE-SVC-AAAA")),
                rule("KUBE-SVC-AAAA", 13, None, Some("KUBE-SEP-BBBB")),
                rule("KUBE-SEP-BBBB", 14, None, Some("KUBE-MARK-MASQ")),
            ],
        )
    }

    #[test]
    fn kube_proxys_jumps_and_chains_go_and_everything_else_stays() {
        let plan = plan_table(&nat());
        assert_eq!(
            plan.rules,
            [("PREROUTING".into(), 10, "KUBE-SERVICES".into())]
        );
        assert_eq!(
            plan.chains,
            ["KUBE-SEP-BBBB", "KUBE-SERVICES", "KUBE-SVC-AAAA"]
        );
        assert_eq!(plan.left, ["KUBE-MARK-MASQ", "KUBE-MARK-DROP"]);
    }

    #[test]
    fn a_jump_without_kube_proxys_comment_is_kept_and_keeps_its_target() {
        let mut v = nat();
        v.rules[0].comment = Some("the operator's own".into());
        let plan = plan_table(&v);
        assert!(plan.rules.is_empty());
        // KUBE-SERVICES stays, and so does everything it leads to.
        assert!(plan.chains.is_empty(), "{plan:?}");
        assert!(plan.left[0].starts_with("KUBE-SERVICES (rule PREROUTING#10"));
    }

    #[test]
    fn a_chain_a_map_element_jumps_to_stays_with_what_it_leads_to() {
        let mut v = nat();
        v.set_targets.push(("m".into(), "KUBE-SVC-AAAA".into()));
        let plan = plan_table(&v);
        assert_eq!(plan.chains, ["KUBE-SERVICES"], "{plan:?}");
        assert_eq!(plan.rules.len(), 1);
        assert!(plan.left[0].starts_with("KUBE-SVC-AAAA (an element of set m"));
        assert!(plan.left[1].starts_with("KUBE-SEP-BBBB (rule KUBE-SVC-AAAA#13"));
    }

    #[test]
    fn an_unreadable_rule_is_never_taken_for_a_jump() {
        let mut v = nat();
        v.rules[0].unreadable = true;
        assert!(plan_table(&v).rules.is_empty());
    }

    #[test]
    fn chains_of_other_tables_and_base_chains_are_never_kube_proxys() {
        let v = view(
            "mangle",
            &[("KUBE-SERVICES", false), ("KUBE-PROXY-CANARY", false)],
            vec![rule("PREROUTING", 1, Some(PORTALS), Some("KUBE-SERVICES"))],
        );
        let plan = plan_table(&v);
        assert!(plan.rules.is_empty() && plan.chains.is_empty());
        assert_eq!(plan.left, ["KUBE-SERVICES", "KUBE-PROXY-CANARY"]);
        let v = view("nat", &[("KUBE-SERVICES", true)], vec![]);
        assert!(plan_table(&v).chains.is_empty());
    }

    #[test]
    fn the_load_balancer_firewall_is_unlinked_but_its_chain_stays_as_upstream_leaves_it() {
        let v = view(
            "filter",
            &[
                ("INPUT", true),
                ("KUBE-PROXY-FIREWALL", false),
                ("KUBE-FORWARD", false),
            ],
            vec![
                rule("INPUT", 3, Some(LB_FIREWALL), Some("KUBE-PROXY-FIREWALL")),
                rule(
                    "FORWARD",
                    4,
                    Some("kubernetes forwarding rules"),
                    Some("KUBE-FORWARD"),
                ),
            ],
        );
        let plan = plan_table(&v);
        assert_eq!(plan.rules.len(), 2);
        assert_eq!(plan.chains, ["KUBE-FORWARD"]);
        assert_eq!(plan.left, ["KUBE-PROXY-FIREWALL"]);
    }
}
