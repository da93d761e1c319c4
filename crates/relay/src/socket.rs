//! The relay's sockets: listeners bound with the options the relay needs, and UDP datagrams received with
//! their destination address and sent back from it (IP_PKTINFO / IPV6_PKTINFO), so that a reply leaves from
//! the address the client's datagram reached — the one conntrack maps back to the service's address.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Pending connections the kernel queues per TCP listener while the relay is busy or at its limit.
const BACKLOG: libc::c_int = 1024;

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn set_int(fd: &OwnedFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: passes a pointer to a local c_int with its exact size.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// A `sockaddr_storage` holding `addr`, and its length.
fn to_sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match ss.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddrV4::new(ip, u16::from_be(sin.sin_port)).into())
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddrV6::new(ip, u16::from_be(sin6.sin6_port), 0, sin6.sin6_scope_id).into())
        }
        _ => None,
    }
}

/// A non-blocking socket of `ty` bound to `addr`; an IPv6 socket takes IPv6 only (the IPv4 wildcard is a
/// listener of its own).
fn bound(addr: SocketAddr, ty: libc::c_int) -> io::Result<OwnedFd> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain syscall; the fd is owned right away.
    let raw =
        check(unsafe { libc::socket(domain, ty | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: raw is a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    if addr.is_ipv6() {
        set_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    }
    let (ss, len) = to_sockaddr(&addr);
    // SAFETY: ss holds a valid address of `len` bytes.
    check(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &ss as *const _ as *const libc::sockaddr,
            len,
        )
    })?;
    Ok(fd)
}

/// A TCP listener on `addr` (port 0: one the kernel picks).
pub(crate) fn tcp_listener(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SO_REUSEADDR must precede bind: a restarted relay binds while old connections sit in TIME_WAIT.
    // SAFETY: plain syscall; the fd is owned right away.
    let raw = check(unsafe {
        libc::socket(
            domain,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    // SAFETY: raw is a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    set_int(&fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    if addr.is_ipv6() {
        set_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    }
    let (ss, len) = to_sockaddr(&addr);
    // SAFETY: ss holds a valid address of `len` bytes.
    check(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &ss as *const _ as *const libc::sockaddr,
            len,
        )
    })?;
    // SAFETY: plain syscall on an fd we own.
    check(unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) })?;
    Ok(std::net::TcpListener::from(fd))
}

/// A UDP socket on `addr` that reports each datagram's destination address.
pub(crate) fn udp_listener(addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let fd = bound(addr, libc::SOCK_DGRAM)?;
    if addr.is_ipv4() {
        set_int(&fd, libc::IPPROTO_IP, libc::IP_PKTINFO, 1)?;
    } else {
        set_int(&fd, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1)?;
    }
    Ok(std::net::UdpSocket::from(fd))
}

/// A UDP socket on an ephemeral port of `peer`'s family, connected to `peer`: one flow's upstream side.
pub(crate) fn udp_connected(peer: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let any: SocketAddr = if peer.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let fd = bound(any, libc::SOCK_DGRAM)?;
    let (ss, len) = to_sockaddr(&peer);
    // SAFETY: ss holds a valid address of `len` bytes.
    check(unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &ss as *const _ as *const libc::sockaddr,
            len,
        )
    })?;
    Ok(std::net::UdpSocket::from(fd))
}

/// Room for one IPv4 or IPv6 packet-info control message.
const CMSG_SPACE: usize = 64;

#[repr(C, align(8))]
struct CmsgBuf([u8; CMSG_SPACE]);

/// Receives one datagram into `buf`: (length, sender, the address it was sent to). A datagram longer than
/// `buf` is an error (it would arrive cut).
pub(crate) fn recv_with_destination(
    fd: RawFd,
    buf: &mut [u8],
) -> io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    // SAFETY: plain data, all-zero valid.
    let mut from: libc::sockaddr_storage = unsafe { zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut cbuf = CmsgBuf([0; CMSG_SPACE]);
    // SAFETY: plain data, all-zero valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_name = &mut from as *mut _ as *mut libc::c_void;
    msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = CMSG_SPACE;
    // SAFETY: every pointer in msg refers to a live local buffer of the stated size.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "datagram larger than the buffer",
        ));
    }
    let sender = from_sockaddr(&from)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "sender of an unknown family"))?;
    Ok((n as usize, sender, destination(&msg)))
}

/// The destination address in a received message's packet-info control message.
fn destination(msg: &libc::msghdr) -> Option<IpAddr> {
    // SAFETY: msg was filled by recvmsg; the CMSG macros walk its control buffer within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c);
            match ((*c).cmsg_level, (*c).cmsg_type) {
                (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                    let info = std::ptr::read_unaligned(data as *const libc::in_pktinfo);
                    return Some(Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr)).into());
                }
                (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                    let info = std::ptr::read_unaligned(data as *const libc::in6_pktinfo);
                    return Some(Ipv6Addr::from(info.ipi6_addr.s6_addr).into());
                }
                _ => {}
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    None
}

/// Sends `data` without blocking to `to` (None: the connected peer), from source address `from` when given
/// (the address the client's datagram reached). A full send buffer is `WouldBlock`: the datagram is dropped.
pub(crate) fn send_from(
    fd: RawFd,
    data: &[u8],
    to: Option<SocketAddr>,
    from: Option<IpAddr>,
) -> io::Result<usize> {
    let (mut ss, len) = match to {
        Some(to) => to_sockaddr(&to),
        // SAFETY: plain data, all-zero valid; unused with a zero length.
        None => (unsafe { zeroed() }, 0),
    };
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cbuf = CmsgBuf([0; CMSG_SPACE]);
    // SAFETY: plain data, all-zero valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    if len > 0 {
        msg.msg_name = &mut ss as *mut _ as *mut libc::c_void;
        msg.msg_namelen = len;
    }
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(src) = from {
        // SAFETY: the control buffer is CMSG_SPACE bytes, enough for one in6_pktinfo message; CMSG_FIRSTHDR
        // of a msghdr whose controllen covers it is non-null.
        unsafe {
            msg.msg_control = cbuf.0.as_mut_ptr() as *mut libc::c_void;
            let (level, ty, payload) = match src {
                IpAddr::V4(_) => (
                    libc::IPPROTO_IP,
                    libc::IP_PKTINFO,
                    size_of::<libc::in_pktinfo>(),
                ),
                IpAddr::V6(_) => (
                    libc::IPPROTO_IPV6,
                    libc::IPV6_PKTINFO,
                    size_of::<libc::in6_pktinfo>(),
                ),
            };
            msg.msg_controllen = libc::CMSG_SPACE(payload as u32) as usize;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = level;
            (*c).cmsg_type = ty;
            (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as usize;
            let data = libc::CMSG_DATA(c);
            match src {
                IpAddr::V4(a) => {
                    let mut info: libc::in_pktinfo = zeroed();
                    info.ipi_spec_dst.s_addr = u32::from(a).to_be();
                    std::ptr::write_unaligned(data as *mut libc::in_pktinfo, info);
                }
                IpAddr::V6(a) => {
                    let mut info: libc::in6_pktinfo = zeroed();
                    info.ipi6_addr.s6_addr = a.octets();
                    std::ptr::write_unaligned(data as *mut libc::in6_pktinfo, info);
                }
            }
        }
    }
    // SAFETY: every pointer in msg refers to a live local buffer of the stated size.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Length of the next datagram queued on `fd`, without taking it.
pub(crate) fn next_datagram_len(fd: RawFd) -> io::Result<usize> {
    // SAFETY: a zero-length receive with MSG_PEEK | MSG_TRUNC writes nothing and returns the real length.
    let n = unsafe {
        libc::recv(
            fd,
            std::ptr::null_mut(),
            0,
            libc::MSG_PEEK | libc::MSG_TRUNC | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}
