//! A blocking netlink socket that sends requests and batches and collects their answers.
//!
//! The kernel handles a netlink message synchronously inside `sendmsg`, so by the time `send` returns every
//! acknowledgement and error of the batch is already queued on the socket. `transact` therefore asks for an ACK
//! only on the last message (a bounded wait that always ends) and then drains what is queued without blocking:
//! errors are delivered whether or not an ACK was asked for, and a 100k-message batch never floods the receive
//! buffer with ACKs.

use super::attr::{messages, Attrs, Msg};
use super::{NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, NLM_F_ACK};
use netlink_sys::Socket;
use std::io;
use std::os::fd::AsRawFd;

const NLMSGERR_ATTR_MSG: u16 = 1;
const NLM_F_ACK_TLVS: u16 = 0x200;
const SOCKET_BUFFER: usize = 32 << 20;

/// An error the kernel answered to one message, or a socket failure.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("netlink socket: {0}")]
    Io(#[from] io::Error),
    #[error("{} (errno {errno}, message seq {seq}){}", io::Error::from_raw_os_error(*.errno), ext_suffix(.ext_ack))]
    Kernel {
        seq: u32,
        errno: i32,
        ext_ack: Option<String>,
    },
    #[error("malformed netlink answer: {0}")]
    Protocol(String),
}

fn ext_suffix(ext: &Option<String>) -> String {
    match ext {
        Some(m) if !m.is_empty() => format!(": {m}"),
        _ => String::new(),
    }
}

impl NetlinkError {
    /// The errno the kernel answered, if this is a kernel error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetlinkError::Kernel { errno, .. } => Some(*errno),
            NetlinkError::Io(e) => e.raw_os_error(),
            NetlinkError::Protocol(_) => None,
        }
    }
}

/// All kernel errors of one transaction, in the order the kernel reported them.
#[derive(Debug)]
pub struct BatchErrors(pub Vec<NetlinkError>);

pub struct NlSocket {
    sock: Socket,
    next_seq: u32,
}

impl NlSocket {
    /// Opens a netlink socket of the given protocol (`libc::NETLINK_NETFILTER`, `NETLINK_ROUTE`, ...) in the
    /// calling thread's network namespace.
    pub fn open(protocol: i32) -> io::Result<Self> {
        let mut sock = Socket::new(protocol as isize)?;
        sock.bind_auto()?;
        // Extended acks carry the kernel's own explanation; capped acks keep error messages small.
        let _ = sock.set_ext_ack(true);
        let _ = sock.set_cap_ack(true);
        force_buffer(&sock, libc::SO_RCVBUFFORCE, SOCKET_BUFFER);
        Ok(NlSocket {
            sock,
            next_seq: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as u32)
                .unwrap_or(1),
        })
    }

    /// Reserves `n` consecutive sequence numbers and returns the first.
    pub fn reserve_seq(&mut self, n: u32) -> u32 {
        let first = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(n.max(1));
        first
    }

    /// The port id the kernel assigned to this socket: events caused by our own requests carry it.
    pub fn port_id(&mut self) -> io::Result<u32> {
        let mut addr = netlink_sys::SocketAddr::new(0, 0);
        self.sock.get_address(&mut addr)?;
        Ok(addr.port_number())
    }

    /// Waits at most `timeout` for something to read (false: nothing came).
    pub fn wait_readable(&self, timeout: std::time::Duration) -> io::Result<bool> {
        let mut pfd = libc::pollfd {
            fd: self.sock.as_raw_fd(),
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
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        Ok(n > 0)
    }

    pub fn raw_fd(&self) -> i32 {
        self.sock.as_raw_fd()
    }

    /// Sends already-encoded messages in one `sendmsg` and returns every error the kernel reported.
    /// The caller sets NLM_F_ACK on the last message whose answer proves the batch was processed
    /// (`ack_seq`); this waits for that answer, then drains anything else already queued.
    pub fn transact(&mut self, bytes: &[u8], ack_seq: u32) -> Result<(), BatchErrors> {
        force_buffer(&self.sock, libc::SO_SNDBUFFORCE, bytes.len() + 4096);
        if let Err(e) = self.sock.send(bytes, 0) {
            return Err(BatchErrors(vec![NetlinkError::Io(e)]));
        }
        let mut errors = Vec::new();
        let mut acked = false;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let flags = if acked { libc::MSG_DONTWAIT } else { 0 };
            let n = match recv(&self.sock, &mut buf, flags) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    errors.push(NetlinkError::Io(e));
                    break;
                }
            };
            for msg in messages(&buf[..n]) {
                if msg.msg_type != NLMSG_ERROR {
                    continue;
                }
                match parse_error(&msg) {
                    Ok(None) => {}
                    Ok(Some(e)) => errors.push(e),
                    Err(e) => errors.push(e),
                }
                if msg.seq == ack_seq {
                    acked = true;
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(BatchErrors(errors))
        }
    }

    /// Sends one dump request and returns the payloads of every answer message (type, payload).
    pub fn dump(&mut self, request: &[u8]) -> Result<Vec<(u16, Vec<u8>)>, NetlinkError> {
        self.sock.send(request, 0)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = recv(&self.sock, &mut buf, 0)?;
            for msg in messages(&buf[..n]) {
                match msg.msg_type {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        if let Some(e) = parse_error(&msg)? {
                            return Err(e);
                        }
                        return Ok(out);
                    }
                    t => out.push((t, msg.payload.to_vec())),
                }
            }
        }
    }

    /// Sends one dump request and hands every answer (type, payload) to `f` as it arrives, without copying:
    /// for dumps too big to collect (a conntrack table). Messages with another sequence number are skipped.
    pub fn dump_each(
        &mut self,
        request: &[u8],
        mut f: impl FnMut(u16, &[u8]),
    ) -> Result<(), NetlinkError> {
        let seq = u32::from_ne_bytes(request[8..12].try_into().unwrap());
        self.sock.send(request, 0)?;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = recv(&self.sock, &mut buf, 0)?;
            for msg in messages(&buf[..n]) {
                if msg.seq != seq {
                    continue;
                }
                match msg.msg_type {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        return match parse_error(&msg)? {
                            Some(e) => Err(e),
                            None => Ok(()),
                        }
                    }
                    t => f(t, msg.payload),
                }
            }
        }
    }

    /// Sends one request carrying NLM_F_ACK and waits for its acknowledgement.
    pub fn request_ack(&mut self, request: &[u8]) -> Result<(), NetlinkError> {
        let seq = u32::from_ne_bytes(request[8..12].try_into().unwrap());
        debug_assert!(u16::from_ne_bytes(request[6..8].try_into().unwrap()) & NLM_F_ACK != 0);
        self.sock.send(request, 0)?;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = recv(&self.sock, &mut buf, 0)?;
            for msg in messages(&buf[..n]) {
                if msg.msg_type == NLMSG_ERROR && msg.seq == seq {
                    return match parse_error(&msg)? {
                        None => Ok(()),
                        Some(e) => Err(e),
                    };
                }
            }
        }
    }

    /// Subscribes to a multicast group (for event monitors).
    pub fn add_membership(&self, group: u32) -> io::Result<()> {
        self.sock.add_membership(group)
    }

    /// Blocks for the next datagram of messages.
    pub fn recv_raw(&self, buf: &mut [u8]) -> io::Result<usize> {
        recv(&self.sock, buf, 0)
    }
}

fn recv(sock: &Socket, buf: &mut [u8], flags: i32) -> io::Result<usize> {
    loop {
        // SAFETY: buf is a valid writable slice of buf.len() bytes for the duration of the call.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                flags,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
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

/// Decodes an NLMSG_ERROR payload: `Ok(None)` for an acknowledgement, `Ok(Some(err))` for an error.
fn parse_error(msg: &Msg<'_>) -> Result<Option<NetlinkError>, NetlinkError> {
    let p = msg.payload;
    if p.len() < 4 + NLMSG_HDRLEN {
        return Err(NetlinkError::Protocol("short NLMSG_ERROR".into()));
    }
    let code = i32::from_ne_bytes(p[0..4].try_into().unwrap());
    if code == 0 {
        return Ok(None);
    }
    let orig_seq = u32::from_ne_bytes(p[12..16].try_into().unwrap());
    let orig_len = u32::from_ne_bytes(p[4..8].try_into().unwrap()) as usize;
    // With capped acks only the original header is echoed; otherwise the whole original message.
    let echoed = if msg.flags & 0x100 != 0 {
        NLMSG_HDRLEN
    } else {
        orig_len.max(NLMSG_HDRLEN)
    };
    let mut ext_ack = None;
    if msg.flags & NLM_F_ACK_TLVS != 0 {
        if let Some(tlvs) = p.get(4 + super::align4(echoed)..) {
            ext_ack = Attrs(tlvs)
                .get(NLMSGERR_ATTR_MSG)
                .and_then(|a| a.str())
                .map(str::to_owned);
        }
    }
    Ok(Some(NetlinkError::Kernel {
        seq: orig_seq,
        errno: -code,
        ext_ack,
    }))
}
