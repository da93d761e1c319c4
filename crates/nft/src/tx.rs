//! A transaction: the ordered object changes that one atomic netlink batch carries.

use super::ir::*;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
/// One change to one object; the table and family are the [`Change`]'s.
pub enum Op {
    /// Creates the table, or updates it (flags 0) when it exists.
    AddTable,
    /// Creates the table, and fails with EEXIST when it exists (NLM_F_EXCL): for a table that must be
    /// this process's alone.
    CreateTable,
    /// Deletes the table and everything in it.
    DeleteTable,
    /// Creates a chain.
    AddChain(Chain),
    /// Removes every rule of a chain (DELRULE without a handle).
    FlushChain(String),
    /// Deletes an empty, unreferenced chain.
    DeleteChain(String),
    /// Deletes one rule by the handle the kernel gave it: for rules of chains that are not ours, which we
    /// cannot rewrite as a whole.
    DeleteRule {
        /// The chain.
        chain: String,
        /// The rule's handle, as read back.
        handle: u64,
    },
    /// Appends a rule to a chain.
    AddRule {
        /// The chain.
        chain: String,
        /// The rule.
        rule: Rule,
    },
    /// Creates a set or map.
    AddSet(Set),
    /// Deletes a set or map no rule references.
    DeleteSet(String),
    /// Adds elements to a set or map.
    AddElements {
        /// The set.
        set: String,
        /// The elements.
        elements: Vec<Element>,
    },
    /// Deletes elements from a set or map.
    DeleteElements {
        /// The set.
        set: String,
        /// The elements.
        elements: Vec<Element>,
    },
    /// Adds elements that carry a comment (their user data).
    AddCommentedElements {
        /// The set.
        set: String,
        /// The elements and their comments.
        elements: Vec<CommentedElement>,
    },
}

/// One change to one object of one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The table's family.
    pub family: Family,
    /// The table.
    pub table: String,
    /// What changes.
    pub op: Op,
}

impl fmt::Display for Change {
    /// Names the object, for error messages: "add rule to chain services of table ip nftkube".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = format!("table {} {}", self.family.as_str(), self.table);
        match &self.op {
            Op::AddTable => write!(f, "add {t}"),
            Op::CreateTable => write!(f, "create {t}"),
            Op::DeleteTable => write!(f, "delete {t}"),
            Op::AddChain(c) => write!(f, "add chain {} to {t}", c.name),
            Op::FlushChain(c) => write!(f, "flush chain {c} of {t}"),
            Op::DeleteChain(c) => write!(f, "delete chain {c} of {t}"),
            Op::DeleteRule { chain, handle } => {
                write!(f, "delete rule handle {handle} of chain {chain} of {t}")
            }
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
    /// The changes, in the order the kernel applies them.
    pub changes: Vec<Change>,
}

impl Transaction {
    /// No changes.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }
    /// Appends a change.
    pub fn push(&mut self, family: Family, table: &str, op: Op) {
        self.changes.push(Change {
            family,
            table: table.to_owned(),
            op,
        });
    }
}
