//! Puts the CNI portmap plugin's mappings back within a second after a firewall reload deleted its tables
//! (`nft flush ruleset`), on nodes where the agent runs; elsewhere `nftkube-portmap restore` does it, from a
//! systemd unit. The truth is the plugin's record of what its ADDs succeeded with, under the lock its commands
//! hold; this only notices that a table is gone and runs the same restore.

use nftkube_nft::ir::Family;
use nftkube_nft::netlink::NftSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the tables are looked for: a listing of each family's table names, a few hundred bytes.
const POLL: Duration = Duration::from_millis(250);

/// The watching thread; stopped and joined when dropped.
pub(crate) struct PortmapRestore {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PortmapRestore {
    /// Starts watching, on a thread that inherits this one's network namespace.
    pub(crate) fn start() -> std::io::Result<PortmapRestore> {
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::Builder::new()
            .name("portmap-restore".into())
            .spawn(move || watch(&st))?;
        Ok(PortmapRestore {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for PortmapRestore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Restores once at start (the agent may start after a reload), then whenever a table that was there is
/// gone. A family with nothing recorded never gets a table, so absence alone does not trigger.
fn watch(stop: &AtomicBool) {
    let mut sock: Option<NftSocket> = None;
    let mut had = [false; 2];
    let mut first = true;
    while !stop.load(Ordering::SeqCst) {
        if let Some(present) = tables_present(&mut sock) {
            let lost = had.iter().zip(present).any(|(h, p)| *h && !p);
            had = match first || lost {
                true => restore_and_look(&mut sock).unwrap_or(present),
                false => present,
            };
            first = false;
        }
        std::thread::sleep(POLL);
    }
}

/// Restores, then reads the tables back: what the restore left is what the next poll compares with (the
/// tables seen before it would hide a flush that comes before that poll). A flush between the restore and
/// the read leaves no table although attachments were restored: restore again, a few times at most.
fn restore_and_look(sock: &mut Option<NftSocket>) -> Option<[bool; 2]> {
    for _ in 0..3 {
        let restored = restore();
        let present = tables_present(sock)?;
        if restored == 0 || present != [false; 2] {
            return Some(present);
        }
    }
    None
}

/// Whether the plugin's table exists in `ip` and `ip6`; None (said in the log) when nf_tables cannot be
/// asked, and the socket is opened afresh next time.
fn tables_present(sock: &mut Option<NftSocket>) -> Option<[bool; 2]> {
    if sock.is_none() {
        *sock = NftSocket::open()
            .map_err(|e| tracing::warn!("portmap restore: opening nf_tables: {e}"))
            .ok();
    }
    let s = sock.as_mut()?;
    let mut present = [false; 2];
    for (i, family) in [Family::Ip, Family::Ip6].into_iter().enumerate() {
        match s.list_tables(family) {
            Ok(names) => present[i] = names.iter().any(|n| n == nftkube_portmap::TABLE),
            Err(e) => {
                tracing::warn!("portmap restore: listing tables: {e}");
                *sock = None;
                return None;
            }
        }
    }
    Some(present)
}

/// Runs the plugin's restore; how many attachments it put (back) in place.
fn restore() -> usize {
    match nftkube_portmap::restore_recorded() {
        None | Some(Ok(0)) => 0,
        Some(Ok(n)) => {
            tracing::info!(attachments = n, "portmap: mappings in place");
            n
        }
        Some(Err(failed)) => {
            for f in &failed {
                tracing::warn!("portmap restore: {f}");
            }
            0
        }
    }
}
