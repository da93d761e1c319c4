//! Notices when anyone else changes our tables: subscribes to nf_tables events (as `nft monitor` does) and
//! raises a flag that makes the agent run a full sync, which reads the kernel back and repairs it. Events
//! caused by our own commits carry our socket's port id and are ignored. The flag goes up once per foreign
//! transaction, at its NEWGEN (the kernel announces the new generation after the transaction's object
//! events): raised at the first event instead, a repair sync could start before the rest of the same
//! transaction arrived, which then asked for a second, needless repair. When events are lost (the socket's
//! buffer overflowed: ENOBUFS), nobody can say what changed, so that raises the flag too.

use super::wire::consts::*;
use nftkube_netlink::attr::{split, Attrs};
use nftkube_netlink::socket::POLL_SLICE;
use nftkube_netlink::{Membership, NlSocket};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Shared between the monitor thread and the agent.
#[derive(Debug, Default)]
pub struct Drift {
    /// Set when our tables changed behind our back (or events were lost); cleared by the agent.
    pub detected: AtomicBool,
    /// Foreign changes seen, for metrics and logs.
    pub(crate) events: AtomicU64,
    /// Times events were lost (ENOBUFS, or a datagram too big to read).
    pub(crate) lost: AtomicU64,
}

/// Whether an nf_tables event is someone else's change to one of our tables.
pub(crate) fn is_foreign_change(
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

/// The event that ends every transaction's events.
fn is_new_generation(msg_type: u16) -> bool {
    msg_type >> 8 == NFNL_SUBSYS_NFTABLES && msg_type & 0xff == NFT_MSG_NEWGEN
}

/// A listener of nf_tables events in this process that the engine can pause (the drift monitor): the
/// sync engine leaves the events group for the length of a large commit, see `sync::quiet`.
pub trait EventSubscriber: Send {
    /// Stops receiving events.
    fn pause(&self) -> io::Result<()>;
    /// Receives events again.
    fn resume(&self) -> io::Result<()>;
    /// Someone else may have committed while it was paused: do what a foreign change seen would.
    fn missed_foreign_commit(&self);
}

/// Called after the drift flag is raised: the owner's doorbell (the agent passes the one that wakes its
/// proxy loop). A plain closure, so that the monitor knows nothing of who listens.
pub(crate) type OnDrift = Arc<dyn Fn() + Send + Sync>;

/// What the monitor thread does with each read of its socket, apart from the socket itself.
pub struct Watcher {
    /// The port id of the socket the sync engine commits through (it changes when that socket is replaced).
    pub(crate) own_port: Arc<AtomicU32>,
    /// The table whose changes count.
    pub table: String,
    /// Raised on a foreign change (or lost events).
    pub(crate) drift: Arc<Drift>,
    /// A foreign change to our table was seen in a transaction whose NEWGEN has not come yet.
    pending: AtomicBool,
    /// Called after the drift flag is raised (wakes the proxy loop).
    notify: Option<OnDrift>,
}

impl Watcher {
    /// A watcher for `table`, ignoring the commits of the socket whose port id `own_port` holds.
    pub fn new(own_port: Arc<AtomicU32>, table: &str, drift: Arc<Drift>) -> Watcher {
        Watcher {
            own_port,
            table: table.into(),
            drift,
            pending: AtomicBool::new(false),
            notify: None,
        }
    }

    /// Calls `notify` whenever drift is raised.
    pub fn with_notify(mut self, notify: OnDrift) -> Watcher {
        self.notify = Some(notify);
        self
    }

    fn raise(&self) {
        raise(&self.drift, self.notify.as_ref());
    }

    /// The handle through which the sync engine pauses this watcher's socket (`membership`) during large
    /// commits; what it missed is raised like what it sees.
    pub fn pausable(&self, membership: Membership) -> Pausable {
        Pausable {
            membership,
            drift: self.drift.clone(),
            notify: self.notify.clone(),
        }
    }

    /// Takes one read: a datagram of events, or the error the read failed with. Lost events raise the
    /// drift flag; any other error stops the monitor.
    pub(crate) fn on_read(&self, read: io::Result<&[u8]>) -> io::Result<()> {
        match read {
            Ok(datagram) => {
                self.on_events(datagram);
                Ok(())
            }
            // Someone's big commit can flood the socket (ours are committed with it out of the group, see
            // `sync::quiet`); whatever the cause, the full sync it triggers finds nothing to do if nothing
            // was touched.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                self.lost("the event socket overflowed (ENOBUFS)");
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                self.lost(&e.to_string());
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn lost(&self, why: &str) {
        self.drift.lost.fetch_add(1, Ordering::Relaxed);
        self.raise();
        tracing::warn!("nf_tables events lost: {why}; reading our tables back with a full sync");
    }

    fn on_events(&self, datagram: &[u8]) {
        let own = self.own_port.load(Ordering::SeqCst);
        let msgs = match split(datagram) {
            Ok(msgs) => msgs,
            // What it held cannot be known: as good as lost.
            Err(e) => return self.lost(&format!("malformed event datagram: {e}")),
        };
        for msg in msgs {
            if is_foreign_change(msg.msg_type, msg.pid, msg.payload, own, &self.table) {
                self.drift.events.fetch_add(1, Ordering::Relaxed);
                if !self.pending.swap(true, Ordering::SeqCst) {
                    tracing::warn!(
                        event = msg.msg_type & 0xff,
                        pid = msg.pid,
                        "our table was changed by someone else; repairing"
                    );
                }
            } else if is_new_generation(msg.msg_type) && self.pending.swap(false, Ordering::SeqCst)
            {
                self.raise();
            }
        }
    }
}

fn raise(drift: &Drift, notify: Option<&OnDrift>) {
    drift.detected.store(true, Ordering::SeqCst);
    if let Some(n) = notify {
        n();
    }
}

/// The monitor as the sync engine's [`EventSubscriber`]: its socket leaves the nf_tables events group for
/// the length of a large commit of ours (see `sync::quiet`).
pub struct Pausable {
    membership: Membership,
    drift: Arc<Drift>,
    notify: Option<OnDrift>,
}

impl EventSubscriber for Pausable {
    fn pause(&self) -> io::Result<()> {
        self.membership.leave()
    }

    fn resume(&self) -> io::Result<()> {
        self.membership.join()
    }

    fn missed_foreign_commit(&self) {
        self.drift.events.fetch_add(1, Ordering::Relaxed);
        raise(&self.drift, self.notify.as_ref());
    }
}

/// Opens a socket subscribed to nf_tables events, in the calling thread's namespace, and the handle that
/// pauses it.
pub fn subscribe() -> io::Result<(NlSocket, Membership)> {
    let mut sock = NlSocket::open(libc::NETLINK_NETFILTER)?;
    sock.add_membership(NFNLGRP_NFTABLES)?;
    let membership = sock.membership(NFNLGRP_NFTABLES)?;
    Ok((sock, membership))
}

/// Reads `sock` (see [`subscribe`]) until `stop`, handing every read to `watcher`. Stops within
/// `POLL_SLICE` of `stop`.
pub fn watch(mut sock: NlSocket, watcher: Watcher, stop: Arc<AtomicBool>) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    while !stop.load(Ordering::SeqCst) {
        if !sock.wait_readable(POLL_SLICE)? {
            continue;
        }
        let read = sock.recv_raw(&mut buf);
        watcher.on_read(read.map(|n| &buf[..n]))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_netlink::MsgBuilder;

    fn event(kind: u16, pid: u32, table: &str) -> (u16, u32, Vec<u8>) {
        let mut m = MsgBuilder::new((NFNL_SUBSYS_NFTABLES << 8) | kind, 0, 0);
        m.raw(&[2, 0, 0, 0]);
        m.attr_str(1, table);
        let bytes = m.finish().unwrap();
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

    fn watcher() -> Watcher {
        Watcher::new(
            Arc::new(AtomicU32::new(42)),
            "nftkube",
            Arc::new(Drift::default()),
        )
    }

    fn datagram(events: &[(u16, u32)]) -> Vec<u8> {
        let mut out = Vec::new();
        for &(kind, pid) in events {
            let mut m = MsgBuilder::new((NFNL_SUBSYS_NFTABLES << 8) | kind, 0, 0);
            m.raw(&[2, 0, 0, 0]);
            if kind != NFT_MSG_NEWGEN {
                m.attr_str(1, "nftkube");
            }
            let mut bytes = m.finish().unwrap();
            bytes[12..16].copy_from_slice(&pid.to_ne_bytes());
            out.extend(bytes);
        }
        out
    }

    #[test]
    fn one_foreign_transaction_raises_the_flag_once_at_its_generation() {
        let w = watcher();
        // A chain deleted and re-created at another priority, its events split over two reads.
        w.on_read(Ok(&datagram(&[(NFT_MSG_DELCHAIN, 99)]))).unwrap();
        assert!(
            !w.drift.detected.load(Ordering::SeqCst),
            "not before NEWGEN"
        );
        w.on_read(Ok(&datagram(&[
            (NFT_MSG_NEWCHAIN, 99),
            (NFT_MSG_NEWGEN, 99),
        ])))
        .unwrap();
        assert!(w.drift.detected.swap(false, Ordering::SeqCst));
        // Our own transaction's NEWGEN raises nothing.
        w.on_read(Ok(&datagram(&[
            (NFT_MSG_NEWCHAIN, 42),
            (NFT_MSG_NEWGEN, 42),
        ])))
        .unwrap();
        assert!(!w.drift.detected.load(Ordering::SeqCst));
    }

    #[test]
    fn lost_events_raise_the_drift_flag() {
        let w = watcher();
        w.on_read(Err(io::Error::from_raw_os_error(libc::ENOBUFS)))
            .unwrap();
        assert!(w.drift.detected.load(Ordering::SeqCst));
        assert_eq!(w.drift.lost.load(Ordering::SeqCst), 1);
        // A datagram too big for the buffer is lost events too.
        w.drift.detected.store(false, Ordering::SeqCst);
        w.on_read(Err(io::Error::new(io::ErrorKind::InvalidData, "too big")))
            .unwrap();
        assert!(w.drift.detected.load(Ordering::SeqCst));
        // So is a datagram that does not parse.
        w.drift.detected.store(false, Ordering::SeqCst);
        w.on_read(Ok(&[1, 2, 3])).unwrap();
        assert!(w.drift.detected.load(Ordering::SeqCst));
        assert_eq!(w.drift.lost.load(Ordering::SeqCst), 3);
        // Anything else stops the monitor (the periodic full sync still repairs).
        assert!(w
            .on_read(Err(io::Error::from_raw_os_error(libc::EBADF)))
            .is_err());
    }

    #[test]
    fn own_events_follow_the_replaced_socket() {
        let w = watcher();
        let mut m = MsgBuilder::new((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWCHAIN, 0, 0);
        m.raw(&[2, 0, 0, 0]);
        m.attr_str(1, "nftkube");
        let mut bytes = m.finish().unwrap();
        bytes[12..16].copy_from_slice(&43u32.to_ne_bytes());
        let gen = datagram(&[(NFT_MSG_NEWGEN, 43)]);
        w.on_read(Ok(&bytes)).unwrap();
        w.on_read(Ok(&gen)).unwrap();
        assert!(
            w.drift.detected.swap(false, Ordering::SeqCst),
            "43 is not us yet"
        );
        // The engine's socket was replaced and got port 43: its commits are ours now.
        w.own_port.store(43, Ordering::SeqCst);
        w.on_read(Ok(&bytes)).unwrap();
        w.on_read(Ok(&gen)).unwrap();
        assert!(!w.drift.detected.load(Ordering::SeqCst));
    }
}
