//! A ctnetlink socket: dump, delete by exact tuple, filtered delete, create; and the feature probe.
//!
//! Opened in the calling thread's network namespace; conntrack tables are per namespace.

use super::wire::{
    decode_entry, delete_has_tuple, encode_delete, encode_dump, encode_filtered_delete, encode_new,
    DeleteFilter, DumpFilter, Entry, NewEntry, Tuple, AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP,
    NFNL_SUBSYS_CTNETLINK,
};
use nftkube_netlink::{Expect, NetlinkError, NlSocket, Request};
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::thread::JoinHandle;

/// Messages per `sendmsg` when deleting or creating many entries.
const CHUNK: usize = 2048;

const ENOENT: i32 = libc::ENOENT;

/// Whether an entry is an IPv6 flow.
fn is_v6(e: &Entry) -> bool {
    e.orig.src.is_ipv6()
}

/// What a batch of exact deletes did.
#[derive(Debug, Default)]
pub struct DeleteOutcome {
    /// Entries deleted.
    pub deleted: usize,
    /// Of them, IPv6 entries (kube-proxy counts deletions per family).
    pub deleted_v6: usize,
    /// Already gone (expired, deleted by someone else, or replaced by a newer entry with another id).
    pub(crate) gone: usize,
    /// Any other error, with the entry it concerned.
    pub errors: Vec<(Entry, NetlinkError)>,
}

/// A ctnetlink socket in the calling thread's network namespace: dumps, exact and filtered deletes.
pub struct CtSocket {
    sock: NlSocket,
}

impl CtSocket {
    /// A NETLINK_NETFILTER socket in the calling thread's namespace.
    pub fn open() -> io::Result<CtSocket> {
        Ok(CtSocket {
            sock: NlSocket::open(libc::NETLINK_NETFILTER)?,
        })
    }

    /// Dumps the entries `filter` asks for, handing each to `f`; returns how many were received. Messages of
    /// other subsystems (none expected) and undecodable ones are skipped.
    pub fn dump(
        &mut self,
        filter: &DumpFilter,
        mut f: impl FnMut(Entry),
    ) -> Result<usize, NetlinkError> {
        let seq = self.sock.reserve_seq(1);
        let mut n = 0usize;
        self.sock
            .dump_each(&encode_dump(filter, seq), |t, payload| {
                if t >> 8 != NFNL_SUBSYS_CTNETLINK {
                    return;
                }
                if let Some(e) = decode_entry(payload) {
                    n += 1;
                    f(e);
                }
            })?;
        Ok(n)
    }

    /// All entries `filter` asks for.
    pub(crate) fn list(&mut self, filter: &DumpFilter) -> Result<Vec<Entry>, NetlinkError> {
        let mut v = Vec::new();
        self.dump(filter, |e| v.push(e))?;
        Ok(v)
    }

    /// Both families, no filter: everything in this namespace's table.
    pub fn list_all(&mut self) -> Result<Vec<Entry>, NetlinkError> {
        let mut v = self.list(&DumpFilter::family(AF_INET))?;
        v.extend(self.list(&DumpFilter::family(AF_INET6))?);
        Ok(v)
    }

    /// Deletes each entry by its exact original tuple, zone and id, `CHUNK` messages per `sendmsg`.
    pub fn delete(&mut self, entries: &[Entry]) -> Result<DeleteOutcome, NetlinkError> {
        let mut out = DeleteOutcome::default();
        for chunk in entries.chunks(CHUNK) {
            let first = self.sock.reserve_seq(chunk.len() as u32);
            let mut bytes = Vec::with_capacity(chunk.len() * 96);
            for (i, e) in chunk.iter().enumerate() {
                bytes.extend(encode_delete(
                    e,
                    first.wrapping_add(i as u32),
                    i + 1 == chunk.len(),
                ));
            }
            let by_seq: HashMap<u32, &Entry> = chunk
                .iter()
                .enumerate()
                .map(|(i, e)| (first.wrapping_add(i as u32), e))
                .collect();
            let errors = self.send_checked("conntrack delete", &bytes, first, chunk.len())?;
            let mut failed = 0;
            let mut failed_v6 = 0;
            for err in errors {
                let entry = match &err {
                    NetlinkError::Kernel { seq, .. } => by_seq.get(seq).copied(),
                    _ => None,
                };
                failed_v6 += usize::from(entry.is_some_and(is_v6));
                match (entry, err.errno()) {
                    (Some(_), Some(ENOENT)) => {
                        out.gone += 1;
                        failed += 1;
                    }
                    (Some(e), _) => {
                        out.errors.push((e.clone(), err));
                        failed += 1;
                    }
                    // A socket-level failure: nothing is known about the rest of the chunk.
                    (None, _) => return Err(err),
                }
            }
            out.deleted += chunk.len() - failed;
            out.deleted_v6 += chunk.iter().filter(|e| is_v6(e)).count() - failed_v6;
        }
        Ok(out)
    }

    /// One kernel-side filtered delete (Linux 6.12+; see [`probe`]).
    pub fn filtered_delete(&mut self, f: &DeleteFilter) -> Result<(), NetlinkError> {
        let seq = self.sock.reserve_seq(1);
        let bytes = encode_filtered_delete(f, seq);
        self.send_checked("conntrack filtered delete", &bytes, seq, 1)?
            .into_iter()
            .next()
            .map_or(Ok(()), Err)
    }

    /// Creates entries (`IPCTNL_MSG_CT_NEW`), `CHUNK` per `sendmsg`; returns how many were created and the
    /// errors of the others.
    pub fn create(
        &mut self,
        entries: &[NewEntry],
    ) -> Result<(usize, Vec<NetlinkError>), NetlinkError> {
        let mut created = 0;
        let mut errors = Vec::new();
        for chunk in entries.chunks(CHUNK) {
            let first = self.sock.reserve_seq(chunk.len() as u32);
            let mut bytes = Vec::with_capacity(chunk.len() * 112);
            for (i, e) in chunk.iter().enumerate() {
                bytes.extend(encode_new(
                    e,
                    first.wrapping_add(i as u32),
                    i + 1 == chunk.len(),
                ));
            }
            let errs = self.send_checked("conntrack create", &bytes, first, chunk.len())?;
            created += chunk.len() - errs.len();
            errors.extend(errs);
        }
        Ok((created, errors))
    }

    /// Sends `count` messages numbered from `first` (the last asks for an ACK) after checking that no DELETE
    /// among them lacks a tuple; returns the kernel's per-message errors, or the socket error.
    fn send_checked(
        &mut self,
        what: &'static str,
        bytes: &[u8],
        first: u32,
        count: usize,
    ) -> Result<Vec<NetlinkError>, NetlinkError> {
        if !delete_has_tuple(bytes) {
            // Unreachable through this module's encoders; refusing is the whole point of checking.
            return Err(NetlinkError::Protocol {
                request: Request {
                    what: what.into(),
                    seq: first,
                },
                detail:
                    "refusing to send a conntrack DELETE without a tuple (it would flush the table)"
                        .into(),
            });
        }
        let last = first.wrapping_add(count.max(1) as u32 - 1);
        let expect = Expect::Acks {
            first,
            last,
            ack: last,
            batch_begin: None,
        };
        self.sock.transact(what, bytes, expect)
    }
}

/// What the running kernel was seen to do with ctnetlink filters (per address family).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Features {
    /// A dump with `CTA_FILTER` on the protocol returns exactly that protocol's entries (5.8+).
    pub dump_proto_v4: bool,
    /// As `dump_proto_v4`, for IPv6.
    pub dump_proto_v6: bool,
    /// A dump with `CTA_FILTER` on protocol and original destination returns exactly the matching entries.
    /// (IPv6 fails on Linux 6.18: the kernel's address comparison is inverted, it returns the others.)
    pub dump_addr_v4: bool,
    /// As `dump_addr_v4`, for IPv6.
    pub(crate) dump_addr_v6: bool,
    /// A DELETE with `CTA_FILTER` and a partial tuple deletes exactly the matching entries (6.12+; IPv6 has
    /// the same inverted comparison, so there it deletes the *other* flows).
    pub(crate) filtered_delete_v4: bool,
    /// As `filtered_delete_v4`, for IPv6.
    pub(crate) filtered_delete_v6: bool,
}

impl Features {
    /// Everything works (for tests of the planning logic).
    pub const ALL: Features = Features {
        dump_proto_v4: true,
        dump_proto_v6: true,
        dump_addr_v4: true,
        dump_addr_v6: true,
        filtered_delete_v4: true,
        filtered_delete_v6: true,
    };

    fn pick(family: u8, v4: bool, v6: bool) -> bool {
        if family == AF_INET {
            v4
        } else {
            v6
        }
    }
    /// Whether a protocol-filtered dump works in this family (AF_INET, AF_INET6).
    pub(crate) fn dump_proto(&self, family: u8) -> bool {
        Self::pick(family, self.dump_proto_v4, self.dump_proto_v6)
    }
    /// Whether an address-filtered dump works in this family.
    pub(crate) fn dump_addr(&self, family: u8) -> bool {
        Self::pick(family, self.dump_addr_v4, self.dump_addr_v6)
    }
    /// Whether a filtered delete works in this family.
    pub fn filtered_delete(&self, family: u8) -> bool {
        Self::pick(family, self.filtered_delete_v4, self.filtered_delete_v6)
    }
}

/// Probes the kernel's ctnetlink filters in a throwaway network namespace (on a thread of its own that
/// `unshare`s, so no table anyone uses is touched): a few entries are created, then a filtered dump and a
/// filtered delete must select exactly the right ones. Anything unexpected, including not being allowed to
/// create a namespace, leaves the feature off; the portable path (dump by family, filter in user space,
/// delete by exact tuple) needs none of them.
pub fn probe() -> Result<Features, ProbeError> {
    start_probe(|| Ok(()), || ())?
        .join()
        .map_or(Err(ProbeError::Panicked), |(result, _)| result)
}

/// What a probe's thread ends with: its result, and how long it took.
pub(crate) type Probed = (Result<Features, ProbeError>, std::time::Duration);

/// [`probe`] left running on its thread: `entered` runs on that thread as soon as it is in its scratch
/// namespace (or failed to get there), and this returns once it has; the probe itself starts when `gate`
/// returns. Joining the handle gives the result and the probe's own duration (from the gate's opening).
/// The agent drops the probe thread's capabilities in `entered`, so that only the unshare runs with
/// CAP_SYS_ADMIN and the rest of the probe (mostly the kernel's dumps) can overlap its start-up. An error
/// from `entered` ends the probe before this returns.
pub fn start_probe(
    entered: impl FnOnce() -> Result<(), String> + Send + 'static,
    gate: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<Probed>, ProbeError> {
    let (moved_tx, moved_rx) = std::sync::mpsc::channel::<bool>();
    let handle = std::thread::Builder::new()
        .name("ct-probe".into())
        .spawn(move || {
            let mut start = std::time::Instant::now();
            let result = probe_thread(entered, moved_tx, || {
                gate();
                start = std::time::Instant::now();
            });
            (result, start.elapsed())
        })
        .map_err(ProbeError::Spawn)?;
    if moved_rx.recv() != Ok(true) {
        // The thread did not get past `entered` and ends now: joined before the caller goes on.
        return match handle.join() {
            Ok((Err(e), _)) => Err(e),
            Ok((Ok(_), _)) | Err(_) => Err(ProbeError::Panicked),
        };
    }
    Ok(handle)
}

/// The probe's thread: into a scratch namespace, `entered`, `gate`, then the probe (see [`start_probe`]).
fn probe_thread(
    entered: impl FnOnce() -> Result<(), String>,
    moved: std::sync::mpsc::Sender<bool>,
    gate: impl FnOnce(),
) -> Result<Features, ProbeError> {
    #[allow(clippy::disallowed_methods)] // the probe's own thread, which does nothing else
    // SAFETY: plain syscall without pointers; it moves only this thread, which ends right after.
    let unshared = match unsafe { libc::unshare(libc::CLONE_NEWNET) } {
        0 => Ok(()),
        _ => Err(ProbeError::Namespace(io::Error::last_os_error())),
    };
    // Always, even without a namespace: the caller counts on this thread being reduced.
    let entered = entered().map_err(ProbeError::Entered);
    let _ = moved.send(entered.is_ok());
    unshared?;
    entered?;
    gate();
    probe_here()
}

/// The probe itself, in the calling thread's (scratch) namespace.
fn probe_here() -> Result<Features, ProbeError> {
    let mut s = CtSocket::open().map_err(ProbeError::Socket)?;
    // Documentation addresses (RFC 5737, RFC 3849): the target, another one, the client (see probe_family).
    let mut family = |family: &'static str, [a, b, client]: [&str; 3]| {
        let ip = |t: &str| t.parse().expect("a literal address");
        probe_family(&mut s, ip(a), ip(b), ip(client))
            .map_err(|detail| ProbeError::Family { family, detail })
    };
    let v4 = family("IPv4", ["192.0.2.1", "192.0.2.2", "192.0.2.100"])?;
    let v6 = family("IPv6", ["2001:db8::1", "2001:db8::2", "2001:db8::100"])?;
    Ok(Features {
        dump_proto_v4: v4.proto,
        dump_addr_v4: v4.addr,
        filtered_delete_v4: v4.delete,
        dump_proto_v6: v6.proto,
        dump_addr_v6: v6.addr,
        filtered_delete_v6: v6.delete,
    })
}

/// Why the conntrack filter probe gave up (every filter feature then stays off).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// `unshare(CLONE_NEWNET)` failed (no CAP_SYS_ADMIN, or namespaces are not allowed).
    #[error("creating a scratch network namespace: {0}")]
    Namespace(io::Error),
    /// The ctnetlink socket did not open.
    #[error("ctnetlink socket: {0}")]
    Socket(io::Error),
    /// A step of one family's probe failed.
    #[error("{family} probe: {detail}")]
    Family {
        /// "IPv4" or "IPv6".
        family: &'static str,
        /// The step and its error.
        detail: String,
    },
    /// What the caller ran once the probe was in its namespace failed.
    #[error("after entering the scratch namespace: {0}")]
    Entered(String),
    /// The probe's thread could not start.
    #[error("spawning the probe thread: {0}")]
    Spawn(io::Error),
    /// The probe's thread panicked.
    #[error("the probe thread panicked")]
    Panicked,
}

struct FamilyFeatures {
    proto: bool,
    addr: bool,
    delete: bool,
}

/// What works for one family: `a` is the target address, `b` another one.
fn probe_family(
    s: &mut CtSocket,
    a: IpAddr,
    b: IpAddr,
    client: IpAddr,
) -> Result<FamilyFeatures, String> {
    let udp_a = Tuple::new(client, 1000, a, 53, IPPROTO_UDP);
    let udp_a2 = Tuple::new(client, 1001, a, 54, IPPROTO_UDP);
    let udp_b = Tuple::new(client, 1000, b, 53, IPPROTO_UDP);
    let tcp_a = Tuple::new(client, 1000, a, 53, IPPROTO_TCP);
    let all = [udp_a, udp_a2, udp_b, tcp_a];
    let new: Vec<NewEntry> = all.iter().map(|t| NewEntry::plain(*t, 60)).collect();
    let (created, errors) = s
        .create(&new)
        .map_err(|e| format!("creating probe entries: {e}"))?;
    if created != new.len() {
        return Err(format!("creating probe entries: {errors:?}"));
    }
    let family = if a.is_ipv4() { AF_INET } else { AF_INET6 };
    let tuples = |v: Vec<Entry>| {
        let mut t: Vec<Tuple> = v.into_iter().map(|e| e.orig).collect();
        t.sort();
        t
    };
    let expect = |v: &[Tuple]| {
        let mut v = v.to_vec();
        v.sort();
        v
    };
    let proto = match s.list(&DumpFilter::proto(family, IPPROTO_UDP)) {
        Ok(v) => tuples(v) == expect(&[udp_a, udp_a2, udp_b]),
        Err(_) => false,
    };
    let addr = match s.list(&DumpFilter::dst(a, IPPROTO_UDP)) {
        Ok(v) => tuples(v) == expect(&[udp_a, udp_a2]),
        Err(_) => false,
    };
    let delete = match s.filtered_delete(&DeleteFilter::to_socket(a, 53, IPPROTO_UDP)) {
        Ok(()) => {
            let left = s
                .list(&DumpFilter::family(family))
                .map_err(|e| format!("listing probe entries: {e}"))?;
            tuples(left) == expect(&[udp_a2, udp_b, tcp_a])
        }
        Err(_) => false,
    };
    Ok(FamilyFeatures {
        proto,
        addr,
        delete,
    })
}
