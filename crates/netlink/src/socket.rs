//! A blocking netlink socket that sends requests and batches and collects their answers, driving the
//! sans-IO `Exchange` with real reads.
//!
//! Every wait is bounded (see `Limits`) and abandoned within `POLL_SLICE` of a shutdown request. After an
//! exchange breaks off (I/O error, timeout, lost or malformed answers) the socket is closed and a fresh one
//! opened for the next request, so nothing left queued on the old one can be taken for a later answer.

use super::error::{DumpFault, NetlinkError, Request};
use super::exchange::{Exchange, Expect, Outcome, Progress};
use netlink_sys::Socket;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SOCKET_BUFFER: usize = 32 << 20;
/// Larger than any datagram the kernel sends to a request socket: dump parts are at most 32 KiB, and
/// errors echo only the failing message's header (capped acks).
const RECV_BUFFER: usize = 128 << 10;
/// How often a wait looks at the shutdown flag: SIGTERM ends any wait within two of these.
pub const POLL_SLICE: Duration = Duration::from_millis(50);
/// Dump attempts when the kernel marks the answer inconsistent (a concurrent change).
pub(crate) const DUMP_ATTEMPTS: u32 = 4;

/// Set by the signal handler; every socket wait gives up (`NetlinkError::Cancelled`) once it is set.
pub static SHUTDOWN: AtomicBool = AtomicBool::new(false);

/// How long to wait for the kernel.
///
/// The kernel handles a request inside `sendmsg`: when it returns, every answer to a batch is already
/// queued, and each part of a dump is produced inside our `recv`. An answer that is due is therefore there
/// at once; `silence` (5 s, thousands of times the longest gap measured) means none is coming, e.g. an error
/// the kernel reported on a sequence number nobody waited for. `total` caps a whole exchange, a dump of the
/// largest table included (50 000 services read back in well under a second here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The longest wait for the next datagram.
    pub silence: Duration,
    /// The longest whole exchange.
    pub total: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            silence: Duration::from_secs(5),
            total: Duration::from_secs(60),
        }
    }
}

/// A blocking netlink socket of one protocol, with bounded exchanges (see the module).
pub struct NlSocket {
    protocol: i32,
    /// None after an exchange broke and no replacement could be opened yet.
    sock: Option<Socket>,
    /// The port id of the current socket: events caused by our requests carry it (shared with monitors).
    port: Arc<AtomicU32>,
    next_seq: u32,
    limits: Limits,
    cancel: &'static AtomicBool,
    buf: Vec<u8>,
    replaced: u64,
}

impl NlSocket {
    /// Opens a netlink socket of the given protocol (`libc::NETLINK_NETFILTER`, `NETLINK_ROUTE`, ...) in the
    /// calling thread's network namespace. Replacements are opened in the namespace of the thread that uses
    /// the socket, so use it from a thread that stays in its namespace.
    pub fn open(protocol: i32) -> io::Result<Self> {
        let sock = open_socket(protocol)?;
        Ok(NlSocket {
            protocol,
            port: Arc::new(AtomicU32::new(bound_port(&sock)?)),
            sock: Some(sock),
            next_seq: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as u32)
                .unwrap_or(1),
            limits: Limits::default(),
            cancel: &SHUTDOWN,
            buf: vec![0u8; RECV_BUFFER],
            replaced: 0,
        })
    }

    /// Other wait limits (tests).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// Another flag to abandon waits on instead of the process-wide `SHUTDOWN` (tests).
    pub fn set_cancel(&mut self, cancel: &'static AtomicBool) {
        self.cancel = cancel;
    }

    /// How many times the socket was closed and replaced after a broken exchange.
    pub fn replacements(&self) -> u64 {
        self.replaced
    }

    /// Reserves `n` consecutive sequence numbers and returns the first.
    pub fn reserve_seq(&mut self, n: u32) -> u32 {
        let first = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(n.max(1));
        first
    }

    /// The port id the kernel assigned to the current socket.
    pub(crate) fn port_id(&mut self) -> io::Result<u32> {
        self.live()?;
        Ok(self.port.load(Ordering::SeqCst))
    }

    /// The port id, kept current across socket replacements, for an event monitor on another thread.
    pub fn port_handle(&self) -> Arc<AtomicU32> {
        self.port.clone()
    }

    /// Waits at most `timeout` for something to read (false: nothing came, or a signal interrupted).
    pub fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        match &self.sock {
            Some(s) => poll_in(s, timeout),
            None => Err(io::Error::from_raw_os_error(libc::EBADF)),
        }
    }

    /// Sends messages (one `sendmsg`) and collects their acknowledgements as `expect` describes. Returns the
    /// kernel's per-message refusals; a refusal of the whole batch or a broken exchange is the error.
    pub fn transact(
        &mut self,
        what: impl Into<String>,
        bytes: &[u8],
        expect: Expect,
    ) -> Result<Vec<NetlinkError>, NetlinkError> {
        let seq = match expect {
            Expect::Acks { first, .. } | Expect::Answer { seq: first } => first,
        };
        let request = Request {
            what: what.into(),
            seq,
        };
        match self.exchange(request.clone(), bytes, expect, &mut |_, _| {})? {
            Outcome::Acked(errors) => Ok(errors),
            Outcome::Answered => Ok(Vec::new()),
            Outcome::Faulty(last) => Err(NetlinkError::Inconsistent {
                request,
                attempts: 1,
                last,
            }),
        }
    }

    /// Sends one dump request (or a GET with NLM_F_ACK) and returns every answer (type, payload). A dump the
    /// kernel marks inconsistent is asked again, up to `DUMP_ATTEMPTS` times.
    pub fn dump(&mut self, request: &[u8]) -> Result<Vec<(u16, Vec<u8>)>, NetlinkError> {
        self.dump_as("netlink dump", request)
    }

    /// `dump`, naming the request in errors.
    pub fn dump_as(
        &mut self,
        what: &str,
        request: &[u8],
    ) -> Result<Vec<(u16, Vec<u8>)>, NetlinkError> {
        let mut request = request.to_vec();
        let mut last = DumpFault::Interrupted;
        for attempt in 1..=DUMP_ATTEMPTS {
            if attempt > 1 {
                // A fresh sequence number: answers to the abandoned attempt cannot be mixed in.
                let seq = self.reserve_seq(1);
                request[8..12].copy_from_slice(&seq.to_ne_bytes());
            }
            let mut out = Vec::new();
            match self.answer(what, &request, &mut |t, p| out.push((t, p.to_vec())))? {
                None => return Ok(out),
                Some(fault) => {
                    super::DUMP_RETRIES.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(what, attempt, "dump inconsistent, asking again: {fault}");
                    last = fault;
                }
            }
        }
        Err(NetlinkError::Inconsistent {
            request: Request {
                what: what.into(),
                seq: header_seq(&request),
            },
            attempts: DUMP_ATTEMPTS,
            last,
        })
    }

    /// Sends one dump request and hands every answer (type, payload) to `f` as it arrives, without copying:
    /// for dumps too big to collect (a conntrack table). What `f` saw cannot be taken back, so an
    /// inconsistent dump is an error, not a retry.
    pub fn dump_each(
        &mut self,
        request: &[u8],
        mut f: impl FnMut(u16, &[u8]),
    ) -> Result<(), NetlinkError> {
        match self.answer("netlink dump", request, &mut f)? {
            None => Ok(()),
            Some(last) => Err(NetlinkError::Inconsistent {
                request: Request {
                    what: "netlink dump".into(),
                    seq: header_seq(request),
                },
                attempts: 1,
                last,
            }),
        }
    }

    /// Sends one request carrying NLM_F_ACK and waits for its acknowledgement.
    pub fn request_ack(&mut self, request: &[u8]) -> Result<(), NetlinkError> {
        let seq = header_seq(request);
        let expect = Expect::Acks {
            first: seq,
            last: seq,
            ack: seq,
            batch_begin: None,
        };
        match self.transact("netlink request", request, expect)?.pop() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Subscribes to a multicast group (for event monitors).
    pub fn add_membership(&mut self, group: u32) -> io::Result<()> {
        self.live()?.add_membership(group)
    }

    /// A second handle on this socket's membership of `group`, for another thread to leave and rejoin the
    /// group while this one blocks in reads (the sync engine silences the event monitor during its large
    /// commits). It refers to the socket open now; a replaced socket would need a new handle (monitors never
    /// replace theirs: they make no requests).
    pub fn membership(&mut self, group: u32) -> io::Result<Membership> {
        let fd = self.live()?.as_fd().try_clone_to_owned()?;
        // SAFETY: `fd` is a new descriptor (a dup) of our open netlink socket that nothing else owns; the
        // Socket takes it over and closes it when dropped.
        let sock = unsafe { Socket::from_raw_fd(fd.into_raw_fd()) };
        Ok(Membership { sock, group })
    }

    /// Reads the next datagram of messages, blocking (monitors call `wait_readable` first). A datagram
    /// longer than `buf` is an error, never silently cut.
    pub fn recv_raw(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        recv(self.live()?, buf, 0)
    }

    /// One answer exchange: None when complete and consistent, else why it was not.
    fn answer(
        &mut self,
        what: &str,
        request: &[u8],
        sink: &mut dyn FnMut(u16, &[u8]),
    ) -> Result<Option<DumpFault>, NetlinkError> {
        let seq = header_seq(request);
        let req = Request {
            what: what.into(),
            seq,
        };
        match self.exchange(req, request, Expect::Answer { seq }, sink)? {
            Outcome::Faulty(f) => Ok(Some(f)),
            _ => Ok(None),
        }
    }

    /// Sends, then reads until the exchange is over; a broken exchange costs the socket.
    fn exchange(
        &mut self,
        request: Request,
        bytes: &[u8],
        expect: Expect,
        sink: &mut dyn FnMut(u16, &[u8]),
    ) -> Result<Outcome, NetlinkError> {
        let result = self.send_and_read(request, bytes, expect, sink);
        match &result {
            Err(e) if e.breaks_socket() => {
                tracing::debug!("netlink exchange broke off, replacing the socket: {e}");
                self.replace();
            }
            Err(e) if e.needs_new_credentials() => self.replace(),
            Ok(Outcome::Acked(refused)) if refused.iter().any(|e| e.needs_new_credentials()) => {
                self.replace()
            }
            _ => {}
        }
        result
    }

    fn send_and_read(
        &mut self,
        request: Request,
        bytes: &[u8],
        expect: Expect,
        sink: &mut dyn FnMut(u16, &[u8]),
    ) -> Result<Outcome, NetlinkError> {
        let port = self.port_id()?;
        let sock = self.sock.as_ref().expect("live() opened it");
        force_buffer(sock, libc::SO_SNDBUFFORCE, bytes.len() + 4096);
        sock.send(bytes, 0)?;
        let mut ex = Exchange::new(request, expect, port);
        let start = Instant::now();
        let mut last_answer = start;
        loop {
            let n = match ex.progress() {
                Progress::Complete => break,
                Progress::Draining => match recv(sock, &mut self.buf, libc::MSG_DONTWAIT) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    r => r,
                },
                Progress::Waiting => {
                    self.wait(sock, ex.request(), start, last_answer)?;
                    recv(sock, &mut self.buf, 0)
                }
            };
            let n = n.map_err(|e| read_error(e, ex.request()))?;
            last_answer = Instant::now();
            ex.feed(&self.buf[..n], sink)?;
        }
        ex.finish()
    }

    /// Blocks until something is readable, the limits pass, or shutdown is requested.
    fn wait(
        &self,
        sock: &Socket,
        request: &Request,
        start: Instant,
        last_answer: Instant,
    ) -> Result<(), NetlinkError> {
        loop {
            if poll_in(sock, POLL_SLICE)? {
                return Ok(());
            }
            if self.cancel.load(Ordering::SeqCst) {
                return Err(NetlinkError::Cancelled {
                    request: request.clone(),
                });
            }
            let now = Instant::now();
            if now - last_answer >= self.limits.silence || now - start >= self.limits.total {
                return Err(NetlinkError::Timeout {
                    request: request.clone(),
                    waited: now - start,
                });
            }
        }
    }

    /// The current socket, opening a replacement if the last exchange broke.
    fn live(&mut self) -> io::Result<&Socket> {
        if self.sock.is_none() {
            let sock = open_socket(self.protocol)?;
            self.port.store(bound_port(&sock)?, Ordering::SeqCst);
            self.sock = Some(sock);
        }
        Ok(self.sock.as_ref().expect("just opened"))
    }

    /// Closes the socket with whatever is still queued on it. The next request opens a fresh one, with
    /// the credentials the thread has then (a refused capability may have come back by then).
    fn replace(&mut self) {
        self.sock = None;
        self.replaced += 1;
    }
}

fn open_socket(protocol: i32) -> io::Result<Socket> {
    let mut sock = Socket::new(protocol as isize)?;
    sock.bind_auto()?;
    // Extended acks carry the kernel's own explanation; capped acks keep error messages small.
    let _ = sock.set_ext_ack(true);
    let _ = sock.set_cap_ack(true);
    force_buffer(&sock, libc::SO_RCVBUFFORCE, SOCKET_BUFFER);
    Ok(sock)
}

fn bound_port(sock: &Socket) -> io::Result<u32> {
    let mut addr = netlink_sys::SocketAddr::new(0, 0);
    sock.get_address(&mut addr)?;
    Ok(addr.port_number())
}

fn header_seq(request: &[u8]) -> u32 {
    u32::from_ne_bytes(request[8..12].try_into().unwrap())
}

/// A failed read: ENOBUFS means the kernel dropped answers, anything else is the socket's failure.
fn read_error(e: io::Error, request: &Request) -> NetlinkError {
    if e.raw_os_error() == Some(libc::ENOBUFS) {
        NetlinkError::Overrun {
            request: request.clone(),
        }
    } else if e.kind() == io::ErrorKind::InvalidData {
        NetlinkError::Protocol {
            request: request.clone(),
            detail: e.to_string(),
        }
    } else {
        NetlinkError::Io(e)
    }
}

fn poll_in(sock: &Socket, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: pfd is one valid pollfd for the duration of the call.
    let n = unsafe {
        libc::poll(
            &mut pfd,
            1,
            timeout.as_millis().min(i32::MAX as u128) as i32,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        // A signal: let the caller look at the shutdown flag.
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(n > 0)
}

/// Reads one datagram. With MSG_TRUNC the kernel reports a datagram's real length even when `buf` was
/// too small; such a datagram is an error (InvalidData), not a silently shortened answer.
fn recv(sock: &Socket, buf: &mut [u8], flags: i32) -> io::Result<usize> {
    loop {
        // SAFETY: buf is a valid writable slice of buf.len() bytes for the duration of the call.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                flags | libc::MSG_TRUNC,
            )
        };
        if n >= 0 {
            return oversized(n as usize, buf.len());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `n` bytes came for a buffer of `capacity`: an error when the datagram did not fit.
pub(crate) fn oversized(n: usize, capacity: usize) -> io::Result<usize> {
    if n > capacity {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {n}-byte datagram does not fit the {capacity}-byte receive buffer"),
        ));
    }
    Ok(n)
}

/// See [`NlSocket::membership`].
pub struct Membership {
    sock: Socket,
    group: u32,
}

impl Membership {
    /// Stops the socket's delivery of the group's messages (those already queued stay readable).
    pub fn leave(&self) -> io::Result<()> {
        self.sock.drop_membership(self.group)
    }

    /// Delivers the group's messages again, from now on.
    pub fn join(&self) -> io::Result<()> {
        self.sock.add_membership(self.group)
    }
}

fn force_buffer(sock: &Socket, opt: i32, size: usize) {
    let size = size.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: setsockopt reads sizeof(c_int) bytes from a valid pointer to a local c_int.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            &size as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
