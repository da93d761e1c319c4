//! A transaction: the ordered object changes that one atomic netlink batch carries.

use super::ir::*;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    AddTable,
    DeleteTable,
    AddChain(Chain),
    /// Removes every rule of a chain (DELRULE without a handle).
    FlushChain(String),
    DeleteChain(String),
    AddRule {
        chain: String,
        rule: Rule,
    },
    AddSet(Set),
    DeleteSet(String),
    AddElements {
        set: String,
        elements: Vec<Element>,
    },
    DeleteElements {
        set: String,
        elements: Vec<Element>,
    },
    /// Adds elements that carry a comment (their user data).
    AddCommentedElements {
        set: String,
        elements: Vec<CommentedElement>,
    },
}

/// One change to one object of one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub family: Family,
    pub table: String,
    pub op: Op,
}

impl fmt::Display for Change {
    /// Names the object, for error messages: "add rule to chain services of table ip nftkube".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = format!("table {} {}", self.family.as_str(), self.table);
        match &self.op {
            Op::AddTable => write!(f, "add {t}"),
            Op::DeleteTable => write!(f, "delete {t}"),
            Op::AddChain(c) => write!(f, "add chain {} to {t}", c.name),
            Op::FlushChain(c) => write!(f, "flush chain {c} of {t}"),
            Op::DeleteChain(c) => write!(f, "delete chain {c} of {t}"),
            Op::AddRule { chain, rule } => match &rule.comment {
                Some(c) => write!(f, "add rule ({c}) to chain {chain} of {t}"),
                None => write!(f, "add rule to chain {chain} of {t}"),
            },
            Op::AddSet(s) => write!(f, "add set {} to {t}", s.name),
            Op::DeleteSet(s) => write!(f, "delete set {s} of {t}"),
            Op::AddElements { set, elements } => {
                write!(f, "add {} elements to set {set} of {t}", elements.len())
            }
            Op::AddCommentedElements { set, elements } => {
                write!(f, "add {} elements to set {set} of {t}", elements.len())
            }
            Op::DeleteElements { set, elements } => {
                write!(
                    f,
                    "delete {} elements from set {set} of {t}",
                    elements.len()
                )
            }
        }
    }
}

/// Changes applied all-or-nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transaction {
    pub changes: Vec<Change>,
}

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }
    pub fn push(&mut self, family: Family, table: &str, op: Op) {
        self.changes.push(Change {
            family,
            table: table.to_owned(),
            op,
        });
    }
}
