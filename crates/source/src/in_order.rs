//! Work on every CPU whose results are consumed in order, each as soon as it and those before it are done:
//! a parse whose objects a consumer may start on before the last of them is parsed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Runs `work` on each of `units` on up to one thread per CPU (taking the next unit as each finishes), and
/// hands the results to `done`, on the calling thread, in the units' order.
pub(crate) fn map_in_order<U: Sync, R: Send>(
    units: &[U],
    work: impl Fn(&U) -> R + Sync,
    mut done: impl FnMut(R),
) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads == 1 || units.len() <= 1 {
        units.iter().for_each(|u| done(work(u)));
        return;
    }
    let next = AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        for _ in 0..threads.min(units.len()) {
            let tx = tx.clone();
            let (next, work) = (&next, &work);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(unit) = units.get(i) else { break };
                if tx.send((i, work(unit))).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        // Results that came before one of their predecessors wait here for it.
        let mut early = BTreeMap::new();
        let mut due = 0;
        for (i, result) in rx {
            early.insert(i, result);
            while let Some(result) = early.remove(&due) {
                done(result);
                due += 1;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_in_order_however_long_each_unit_takes() {
        // Early units take longest, so later ones finish first on the other threads.
        let units: Vec<u64> = (0..40).collect();
        let mut seen = Vec::new();
        map_in_order(
            &units,
            |&u| {
                std::thread::sleep(std::time::Duration::from_micros((40 - u) * 200));
                u * 2
            },
            |r| seen.push(r),
        );
        assert_eq!(seen, units.iter().map(|u| u * 2).collect::<Vec<_>>());
    }

    #[test]
    fn no_unit_and_one_unit() {
        let mut seen = Vec::new();
        map_in_order(&[] as &[u8], |&u| u, |r| seen.push(r));
        map_in_order(&[7u8], |&u| u + 1, |r| seen.push(r));
        assert_eq!(seen, vec![8]);
    }
}
