//! `conditionsV4` / `conditionsV6`: a documented subset of nft's match syntax, parsed into typed matches that
//! become IR expressions. Nothing is passed to the kernel (or to nft) as text.
//!
//! The list's strings are joined with spaces, as upstream joins them: one string may hold several matches
//! (`["ip saddr 10.0.0.0/8 iifname eth0"]`), or each string one word (`["ip", "saddr", "10.0.0.0/8"]`). All
//! matches must hold (AND) for the network's port mappings to apply. The grammar:
//!
//! ```text
//! match   := addr | ifname | mark | iptables
//! addr    := ("ip" | "ip6") ("saddr" | "daddr") [op] ADDRESS ["/" PREFIX]
//! ifname  := "iifname" [op] NAME          NAME may be quoted; a trailing "*" matches a prefix
//! mark    := "meta" "mark" [op] NUMBER    decimal or 0x hexadecimal
//! op      := "==" | "!="
//! iptables := ["!"] ("-s" | "--source" | "-d" | "--destination") ADDRESS ["/" PREFIX]
//!           | ["!"] ("-i" | "--in-interface") NAME        a trailing "+" matches a prefix
//! ```
//!
//! `ip` matches are allowed in `conditionsV4` only, `ip6` in `conditionsV6` only. Parsing is linear in the
//! input and every error names the list, the string's index and the word at fault.

use nftkube_nft::build::{Field, RuleBuilder};
use nftkube_nft::ir::{CmpOp, Family};
use std::net::IpAddr;

/// One parsed match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Match {
    /// `ip saddr != 10.0.0.0/8`: the field, the network and its prefix length.
    Addr {
        /// Which address.
        field: Field,
        /// The network.
        net: IpAddr,
        /// Its prefix length.
        prefix: u8,
        /// `!=`.
        negate: bool,
    },
    /// `iifname "eth*"`.
    IifName {
        /// The interface name (without the `*`).
        name: String,
        /// Ends in `*`: a prefix.
        prefix: bool,
        /// `!=`.
        negate: bool,
    },
    /// `meta mark 0x10`.
    Mark {
        /// The mark.
        value: u32,
        /// `!=`.
        negate: bool,
    },
}

impl Match {
    /// Appends the match's expressions to a rule.
    pub(crate) fn apply(&self, rule: RuleBuilder) -> RuleBuilder {
        match self {
            Match::Addr {
                field,
                net,
                prefix,
                negate,
            } => {
                let full = if net.is_ipv4() { 32 } else { 128 };
                if *prefix == full {
                    let op = if *negate { CmpOp::Neq } else { CmpOp::Eq };
                    rule.cmp(*field, op, nftkube_nft::build::ip_bytes(net))
                } else {
                    rule.prefix(*field, net, *prefix, *negate)
                }
            }
            Match::IifName {
                name,
                prefix,
                negate,
            } => rule.iifname(name, *prefix, *negate),
            Match::Mark { value, negate } => {
                let op = if *negate { CmpOp::Neq } else { CmpOp::Eq };
                rule.cmp(Field::Mark, op, value.to_ne_bytes().to_vec())
            }
        }
    }
}

/// A condition that does not parse: which list, which string, which word, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{list}[{index}]: {reason}")]
pub(crate) struct ConditionError {
    /// Which list (`conditionsV4`, `conditionsV6`).
    pub(crate) list: &'static str,
    /// The condition's index in it.
    pub(crate) index: usize,
    /// Why it cannot be read.
    pub(crate) reason: String,
}

/// The list's name in the configuration, for errors.
pub(crate) fn list_name(family: Family) -> &'static str {
    if family == Family::Ip6 {
        "conditionsV6"
    } else {
        "conditionsV4"
    }
}

/// Parses a conditions list for a table of `family`. The strings are read as one sequence of words, as
/// upstream joins them with spaces: `["ip saddr 1.2.3.4"]` and `["ip", "saddr", "1.2.3.4"]` are the same
/// condition, and a match may span strings. Blank strings add nothing.
pub(crate) fn parse(family: Family, conditions: &[String]) -> Result<Vec<Match>, ConditionError> {
    let words: Vec<(&str, usize)> = conditions
        .iter()
        .enumerate()
        .flat_map(|(index, text)| text.split_whitespace().map(move |w| (w, index)))
        .collect();
    let mut p = Parser {
        words: &words,
        at: 0,
        family,
    };
    let mut out = Vec::new();
    while p.at < words.len() {
        let m = p.one().map_err(|reason| ConditionError {
            list: list_name(family),
            index: p.index(),
            reason,
        })?;
        out.push(m);
    }
    Ok(out)
}

struct Parser<'a> {
    /// Every word of the list, with the index of the string it is in.
    words: &'a [(&'a str, usize)],
    at: usize,
    family: Family,
}

impl<'a> Parser<'a> {
    fn next(&mut self, what: &str) -> Result<&'a str, String> {
        let (w, _) = self
            .words
            .get(self.at)
            .ok_or_else(|| format!("ends where {what} was expected"))?;
        self.at += 1;
        Ok(w)
    }

    /// The index of the string holding the last word read (the one at fault when reading fails).
    fn index(&self) -> usize {
        self.words
            .get(self.at.saturating_sub(1))
            .map_or(0, |(_, i)| *i)
    }

    /// An optional `==` / `!=`: whether it negates.
    fn op(&mut self) -> bool {
        match self.words.get(self.at).map(|(w, _)| *w) {
            Some("!=") => {
                self.at += 1;
                true
            }
            Some("==") => {
                self.at += 1;
                false
            }
            _ => false,
        }
    }

    fn one(&mut self) -> Result<Match, String> {
        let word = self.next("a match")?;
        match word {
            "ip" | "ip6" => self.addr(word),
            "iifname" => self.iifname(),
            "!" => self.iptables(true),
            w if w.starts_with('-') => {
                self.at -= 1;
                self.iptables(false)
            }
            "meta" => match self.next("a meta key")? {
                "mark" => self.mark(),
                "iifname" => self.iifname(),
                other => Err(format!(
                    "meta {other:?} is not supported (supported: meta mark, meta iifname)"
                )),
            },
            other => Err(format!(
                "{other:?} is not a supported match (supported: ip saddr/daddr, ip6 saddr/daddr, iifname, meta mark)"
            )),
        }
    }

    fn addr(&mut self, proto: &str) -> Result<Match, String> {
        let v6 = proto == "ip6";
        if v6 != (self.family == Family::Ip6) {
            return Err(format!(
                "{proto} matches belong in {}",
                if v6 { "conditionsV6" } else { "conditionsV4" }
            ));
        }
        let source = match self.next("saddr or daddr")? {
            "saddr" => true,
            "daddr" => false,
            other => return Err(format!("{proto} {other:?}: expected saddr or daddr")),
        };
        let negate = self.op();
        self.address(source, negate)
    }

    /// `ADDRESS[/PREFIX]` of the list's family, for the source or destination field.
    fn address(&mut self, source: bool, negate: bool) -> Result<Match, String> {
        let v6 = self.family == Family::Ip6;
        let proto = if v6 { "ip6" } else { "ip" };
        let field = match (source, v6) {
            (true, false) => Field::IpSaddr,
            (false, false) => Field::IpDaddr,
            (true, true) => Field::Ip6Saddr,
            (false, true) => Field::Ip6Daddr,
        };
        let text = self.next("an address")?;
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let net: IpAddr = addr
            .parse()
            .map_err(|_| format!("{text:?} is not an address"))?;
        if net.is_ipv6() != v6 {
            return Err(format!("{text:?} is not an {proto} address"));
        }
        let full = if v6 { 128 } else { 32 };
        let prefix = match prefix {
            None => full,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= full)
                .ok_or_else(|| format!("{text:?}: prefix length must be 0-{full}"))?,
        };
        Ok(Match::Addr {
            field,
            net,
            prefix,
            negate,
        })
    }

    fn iifname(&mut self) -> Result<Match, String> {
        let negate = self.op();
        let raw = self.next("an interface name")?;
        let name = raw
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix('"'))
            .unwrap_or(raw);
        interface(raw, name, '*', negate)
    }

    /// iptables syntax (the stock plugin's iptables backend passes the words to iptables): the three options
    /// that say the same as a match of this grammar are read as it, `[!] -s|--source ADDR[/LEN]`,
    /// `[!] -d|--destination ADDR[/LEN]` and `[!] -i|--in-interface NAME[+]`. Any other option is refused:
    /// iptables' modules (`-m ...`), protocols and ports have no typed match here, and reading part of a
    /// condition would map ports for traffic the author meant to leave out.
    fn iptables(&mut self, negate: bool) -> Result<Match, String> {
        let option = self.next("an iptables option after \"!\"")?;
        match option {
            "-s" | "--source" => self.address(true, negate),
            "-d" | "--destination" => self.address(false, negate),
            "-i" | "--in-interface" => {
                let raw = self.next("an interface name")?;
                interface(raw, raw, '+', negate)
            }
            other => Err(format!(
                "iptables option {other:?} is not supported (of iptables syntax only [!] -s, -d and -i are read; \
                 write nft syntax: ip saddr, ip daddr, iifname, meta mark)"
            )),
        }
    }

    fn mark(&mut self) -> Result<Match, String> {
        let negate = self.op();
        let text = self.next("a mark")?;
        let value = match text.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => text.parse(),
        }
        .map_err(|_| format!("{text:?} is not a 32-bit mark"))?;
        Ok(Match::Mark { value, negate })
    }
}

/// An interface name match; `raw` as written (for errors), `name` unquoted, `wildcard` the suffix that makes
/// it a prefix (nft's `*`, iptables' `+`).
fn interface(raw: &str, name: &str, wildcard: char, negate: bool) -> Result<Match, String> {
    let (name, prefix) = match name.strip_suffix(wildcard) {
        Some(n) => (n, true),
        None => (name, false),
    };
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 15 || !name.chars().all(valid) {
        return Err(format!("{raw:?} is not an interface name"));
    }
    Ok(Match::IifName {
        name: name.into(),
        prefix,
        negate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p4(s: &[&str]) -> Result<Vec<Match>, ConditionError> {
        parse(
            Family::Ip,
            &s.iter().map(|x| x.to_string()).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn parses_the_subset() {
        let m = p4(&["ip saddr != 10.0.0.0/8 iifname \"eth*\"", "meta mark 0x10"]).unwrap();
        assert_eq!(
            m,
            vec![
                Match::Addr {
                    field: Field::IpSaddr,
                    net: "10.0.0.0".parse().unwrap(),
                    prefix: 8,
                    negate: true
                },
                Match::IifName {
                    name: "eth".into(),
                    prefix: true,
                    negate: false
                },
                Match::Mark {
                    value: 16,
                    negate: false
                },
            ]
        );
        let tokens = p4(&[
            "ip",
            "saddr",
            "!=",
            "10.0.0.0/8",
            "",
            "iifname",
            "\"eth*\"",
            "meta mark",
            "0x10",
        ])
        .unwrap();
        assert_eq!(tokens, m, "upstream's one word per string reads the same");
        assert_eq!(p4(&["", "  "]).unwrap(), [], "blank strings add nothing");
        let v6 = parse(Family::Ip6, &["ip6 daddr fd00::1".to_string()]).unwrap();
        assert!(matches!(v6[0], Match::Addr { prefix: 128, .. }));
    }

    /// The stock plugin's iptables-syntax source, destination and input interface read as their nft
    /// equivalents; every other iptables option is refused, naming it.
    #[test]
    fn iptables_syntax_reads_the_three_options_and_refuses_the_rest() {
        let ipt = p4(&[
            "!",
            "-s",
            "10.0.0.0/8",
            "-i",
            "eth+",
            "--destination 1.2.3.4",
        ])
        .unwrap();
        let nft = p4(&["ip saddr != 10.0.0.0/8 iifname eth* ip daddr 1.2.3.4"]).unwrap();
        assert_eq!(ipt, nft);
        let v6 = parse(Family::Ip6, &["-d".to_string(), "fd00::/8".to_string()]).unwrap();
        assert!(matches!(
            v6[0],
            Match::Addr {
                field: Field::Ip6Daddr,
                prefix: 8,
                ..
            }
        ));
        for (input, want) in [
            (
                &["-p", "tcp"][..],
                "conditionsV4[0]: iptables option \"-p\" is not supported",
            ),
            (&["-m", "mark", "--mark", "0x10"], "iptables option \"-m\""),
            (&["-o", "eth0"], "iptables option \"-o\""),
            (&["-s", "1.2.3.4,5.6.7.8"], "not an address"),
            (&["-s", "10.0.0.0/255.0.0.0"], "prefix length"),
            (&["-i", "eth*"], "not an interface name"),
            (
                &["ip saddr 1.2.3.4", "!"],
                "conditionsV4[1]: ends where an iptables option",
            ),
        ] {
            let e = p4(input).unwrap_err().to_string();
            assert!(e.contains(want), "{input:?}: {e}");
        }
    }

    #[test]
    fn errors_name_the_place() {
        let cases: &[(&[&str], &str)] = &[
            (&["ip saddr"], "conditionsV4[0]: ends where an address"),
            (
                &["ip saddr 1.2.3.4", "tcp dport 80"],
                "conditionsV4[1]: \"tcp\"",
            ),
            (&["ip saddr 1.2.3.4/33"], "prefix length"),
            (&["ip6 saddr ::1"], "belong in conditionsV6"),
            (&["ip saddr fd00::1"], "not an ip address"),
            (&["meta mark zz"], "not a 32-bit mark"),
            (&["iifname a/b"], "not an interface name"),
            (&["ip", "saddr"], "conditionsV4[1]: ends where an address"),
            (
                &["ip", "saddr", "1.2.3.4", "tcp"],
                "conditionsV4[3]: \"tcp\"",
            ),
            (&["ip saddr 1.2.3.4; drop"], "not an address"),
        ];
        for (input, want) in cases {
            let e = p4(input).unwrap_err().to_string();
            assert!(e.contains(want), "{input:?}: {e}");
        }
    }
}
