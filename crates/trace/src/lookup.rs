//! What a set lookup or a comparison decides on bytes: shared by the expression interpreter (`expr.rs`)
//! and the `numgen` branching (`decide.rs`), which asks the same questions of every value in a range.

use super::TraceError;
use nftkube_nft::ir::*;

/// The element with this key. Elements are ordered by key, then value (None first): the first at or after
/// (key, None) is it, if any is.
pub(super) fn find_element<'s>(set: &'s SetState, key: &[u8]) -> Option<&'s Element> {
    let probe = Element {
        key: key.into(),
        value: None,
    };
    set.elements
        .range(probe..)
        .next()
        .filter(|e| e.key.as_slice() == key)
}

/// The set or map `name` of `table`.
pub(super) fn find_set<'t>(table: &'t TableState, name: &str) -> Result<&'t SetState, TraceError> {
    table.sets.get(name).ok_or_else(|| {
        TraceError::Ruleset(format!(
            "table {} {}: set @{name} is looked up but does not exist",
            table.family.as_str(),
            table.name
        ))
    })
}

/// What `cmp` decides on these bytes.
pub(super) fn cmp_holds(have: &[u8], op: CmpOp, data: &[u8]) -> bool {
    let ord = have.cmp(data);
    match op {
        CmpOp::Eq => ord.is_eq(),
        CmpOp::Neq => ord.is_ne(),
        CmpOp::Lt => ord.is_lt(),
        CmpOp::Lte => ord.is_le(),
        CmpOp::Gt => ord.is_gt(),
        CmpOp::Gte => ord.is_ge(),
    }
}
