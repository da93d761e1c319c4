//! Deciding a `numgen` value where it is read. The values of its range are grouped by what the reading
//! expression makes of them (a lookup's element or miss, a comparison's result, else the bytes themselves), and
//! each group is one branch, with probability size / modulus. A value that makes no difference costs no branch:
//! a rule `... numgen random mod k offset O map @m` whose lookup misses for every value (a packet passing the
//! rules of other endpoint counts) stays on one path.

use super::eval::{Eval, Interrupt};
use super::lookup::{cmp_holds, find_element, find_set};
use super::report::Step;
use super::TraceError;
use nftkube_nft::ir::*;
use std::collections::BTreeMap;

/// More values than this in one numgen range are not enumerated.
const MAX_VALUES: u32 = 1 << 20;

impl Eval<'_> {
    /// Decides every undecided value `e` reads, grouped by what `e` makes of it.
    pub(super) fn decide_reads(
        &mut self,
        table: &TableState,
        e: &Expr,
        step: &mut Step,
    ) -> Result<(), Interrupt> {
        let bytes = |b: &[u8]| b.to_vec();
        match e {
            Expr::Cmp { sreg, op, data } => self.decide(*sreg, data.len(), step, |b| {
                vec![cmp_holds(b, *op, data) as u8]
            }),
            Expr::Lookup { set, sreg, .. } => {
                let s = find_set(table, set)?;
                self.decide(*sreg, key_len(&s.set.key), step, |k| {
                    match find_element(s, k) {
                        None => vec![0],
                        Some(el) => {
                            let mut out = vec![1];
                            match &el.value {
                                Some(ElementValue::Data(d)) => out.extend_from_slice(d),
                                Some(ElementValue::Verdict(v)) => {
                                    out.extend_from_slice(format!("{v:?}").as_bytes())
                                }
                                None => {}
                            }
                            out
                        }
                    }
                })
            }
            Expr::LookupAnon { set, sreg } => self.decide(*sreg, set.key.len(), step, |k| {
                vec![set.elements.iter().any(|el| el.as_slice() == k) as u8]
            }),
            Expr::Bitwise { sreg, len, .. } => self.decide(*sreg, *len as usize, step, bytes),
            Expr::MetaSet { sreg, .. } => self.decide(*sreg, 4, step, bytes),
            Expr::Dynset {
                set,
                sreg_key,
                sreg_data,
                ..
            } => {
                let s = find_set(table, set)?;
                self.decide(*sreg_key, key_len(&s.set.key), step, bytes)?;
                match sreg_data {
                    Some(r) => self.decide(*r, key_len(&s.set.data), step, bytes),
                    None => Ok(()),
                }
            }
            Expr::Nat {
                family,
                reg_addr,
                reg_proto,
                ..
            } => {
                let len = if *family == Family::Ip6 { 16 } else { 4 };
                if let Some(r) = reg_addr {
                    self.decide(*r, len, step, bytes)?;
                }
                match reg_proto {
                    Some(r) => self.decide(*r, 2, step, bytes),
                    None => Ok(()),
                }
            }
            Expr::Redir {
                reg_proto: Some(r), ..
            } => self.decide(*r, 2, step, bytes),
            _ => Ok(()),
        }
    }

    /// Decides the undecided slots among the `len` bytes at `reg`, one at a time.
    fn decide(
        &mut self,
        reg: u32,
        len: usize,
        step: &mut Step,
        outcome: impl Fn(&[u8]) -> Vec<u8>,
    ) -> Result<(), Interrupt> {
        while let Some((slot, r)) = self.regs.random_in(reg, len) {
            if r.modulus > MAX_VALUES {
                return Err(TraceError::Unsupported(format!(
                    "numgen random mod {} (more than {MAX_VALUES} values)",
                    r.modulus
                ))
                .into());
            }
            // With another undecided slot in the same bytes, the outcome is not known yet: every value apart.
            let alone = self.regs.randoms_in(reg, len) == 1;
            let mut groups: BTreeMap<Vec<u8>, Vec<u32>> = BTreeMap::new();
            for i in 0..r.modulus {
                let value = r.offset.wrapping_add(i);
                let b = self.regs.read_with(reg, len, slot, value)?;
                let key = if alone { outcome(&b) } else { b };
                groups.entry(key).or_default().push(value);
            }
            let groups: Vec<Vec<u32>> = groups.into_values().collect();
            let group = if groups.len() == 1 {
                &groups[0]
            } else {
                let Some(&index) = self.choices.get(self.chosen.len()) else {
                    return Err(Interrupt::Choice {
                        groups: groups.len(),
                    });
                };
                let group = groups.get(index as usize).ok_or_else(|| {
                    TraceError::Ruleset(format!("numgen choice {index} out of range"))
                })?;
                self.chosen.push((group.len() as u32, r.modulus));
                group
            };
            step.notes.push(choice_note(r.modulus, r.offset, group));
            self.regs.fix(slot, group[0]);
        }
        Ok(())
    }
}

/// `numgen random mod 3 offset 196608 = 196609 (probability 1/3)`.
fn choice_note(modulus: u32, offset: u32, group: &[u32]) -> String {
    let gen = if offset > 0 {
        format!("numgen random mod {modulus} offset {offset}")
    } else {
        format!("numgen random mod {modulus}")
    };
    let n = group.len() as u32;
    if n == modulus {
        format!(
            "{gen}: all {modulus} values lead the same way (no branch; shown with {})",
            group[0]
        )
    } else if n == 1 {
        format!("{gen} = {} (probability 1/{modulus})", group[0])
    } else {
        format!(
            "{gen} in {} values from {} (probability {n}/{modulus})",
            n, group[0]
        )
    }
}
