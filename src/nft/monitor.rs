//! Notices when anyone else changes our tables: subscribes to nf_tables events (as `nft monitor` does) and
//! raises a flag that makes the agent run a full sync, which reads the kernel back and repairs it. Events
//! caused by our own commits carry our socket's port id and are ignored.

use super::wire::consts::*;
use crate::netlink::attr::{messages, Attrs};
use crate::netlink::NlSocket;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Shared between the monitor thread and the agent.
#[derive(Debug, Default)]
pub struct Drift {
    /// Set when our tables changed behind our back (or events were lost); cleared by the agent.
    pub detected: AtomicBool,
    /// Foreign changes seen, for metrics and logs.
    pub events: AtomicU64,
}

/// Whether an nf_tables event is someone else's change to one of our tables.
pub fn is_foreign_change(
    msg_type: u16,
    pid: u32,
    payload: &[u8],
    own_pid: u32,
    table: &str,
) -> bool {
    if msg_type >> 8 != NFNL_SUBSYS_NFTABLES || pid == own_pid {
        return false;
    }
    let kind = msg_type & 0xff;
    if kind == NFT_MSG_NEWGEN || payload.len() < 4 {
        return false;
    }
    // Attribute 1 names the table in table, chain, rule, set and element messages alike.
    Attrs(&payload[4..]).get(1).and_then(|a| a.str()) == Some(table)
}

/// Runs on the calling thread (which must be in the agent's namespace) until `stop`: every foreign change to
/// `table` sets `drift.detected`. `own_pid` is the port id of the socket the sync engine commits through.
pub fn watch(
    own_pid: u32,
    table: &str,
    drift: Arc<Drift>,
    stop: Arc<AtomicBool>,
) -> io::Result<()> {
    let sock = NlSocket::open(libc::NETLINK_NETFILTER)?;
    sock.add_membership(NFNLGRP_NFTABLES)?;
    let mut buf = vec![0u8; 1 << 20];
    while !stop.load(Ordering::SeqCst) {
        if !sock.wait_readable(Duration::from_millis(200))? {
            continue;
        }
        let n = match sock.recv_raw(&mut buf) {
            Ok(n) => n,
            // Events were lost (our own big commits can flood the socket): assume the worst; the full sync it
            // triggers finds nothing to do if nothing was touched.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                drift.detected.store(true, Ordering::SeqCst);
                continue;
            }
            Err(e) => return Err(e),
        };
        for msg in messages(&buf[..n]) {
            if is_foreign_change(msg.msg_type, msg.pid, msg.payload, own_pid, table) {
                drift.events.fetch_add(1, Ordering::Relaxed);
                if !drift.detected.swap(true, Ordering::SeqCst) {
                    tracing::warn!(
                        event = msg.msg_type & 0xff,
                        pid = msg.pid,
                        "our table was changed by someone else; repairing"
                    );
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::MsgBuilder;

    fn event(kind: u16, pid: u32, table: &str) -> (u16, u32, Vec<u8>) {
        let mut m = MsgBuilder::new((NFNL_SUBSYS_NFTABLES << 8) | kind, 0, 0);
        m.raw(&[2, 0, 0, 0]);
        m.attr_str(1, table);
        let bytes = m.finish();
        (
            ((NFNL_SUBSYS_NFTABLES << 8) | kind),
            pid,
            bytes[16..].to_vec(),
        )
    }

    #[test]
    fn only_other_peoples_changes_to_our_table_count() {
        let (t, p, payload) = event(NFT_MSG_DELTABLE, 99, "nftkube");
        assert!(is_foreign_change(t, p, &payload, 42, "nftkube"));
        // Our own commit.
        assert!(!is_foreign_change(t, 42, &payload, 42, "nftkube"));
        // Someone else's table.
        let (t, p, payload) = event(NFT_MSG_DELCHAIN, 99, "filter");
        assert!(!is_foreign_change(t, p, &payload, 42, "nftkube"));
        // Generation bumps carry no object.
        let (t, p, payload) = event(NFT_MSG_NEWGEN, 99, "nftkube");
        assert!(!is_foreign_change(t, p, &payload, 42, "nftkube"));
        // Another netfilter subsystem (conntrack events).
        assert!(!is_foreign_change(0x0100, 99, &payload, 42, "nftkube"));
    }
}
