//! Moving bytes from one TCP socket to another: splice(2) through a pipe (zero-copy: the data stays in the
//! kernel), with a plain read/write fallback when no pipe can be had or the kernel refuses to splice.
//!
//! A connection holds a pipe only while bytes are in flight: an idle connection costs its two sockets and
//! nothing else (5 000 idle connections must fit in 20 000 descriptors). Drained pipes go back to a small
//! shared pool. A pipe holds at most 64 KiB (the kernel's default pipe size), which bounds the bytes buffered
//! per direction.

use super::idle::Activity;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Most bytes moved per splice call; also the pipe's capacity (the kernel default, 16 pages).
pub(crate) const CHUNK: usize = 64 * 1024;
/// Drained pipes kept for reuse; more are closed.
const POOL_MAX: usize = 64;

/// A pipe: bytes written to `write` come out of `read`.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two fds into the array we pass; they are owned right after.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both fds were just created and belong to nobody else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Pipe { read, write })
    }
}

static POOL: Mutex<Vec<Pipe>> = Mutex::new(Vec::new());

fn take_pipe() -> io::Result<Pipe> {
    let pooled = POOL.lock().unwrap_or_else(|e| e.into_inner()).pop();
    match pooled {
        Some(p) => Ok(p),
        None => Pipe::new(),
    }
}

/// Only empty pipes may be returned: a pipe with bytes left in it is dropped (closed) instead.
fn return_pipe(p: Pipe) {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if pool.len() < POOL_MAX {
        pool.push(p);
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: plain syscall on fds the caller keeps open for its duration; null offsets (sockets and pipes
    // have none).
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Copies `from` → `to` until `from` reaches end of stream (everything before its FIN delivered); then shuts
/// down `to`'s sending side (half-close propagated). An error ends the direction (the caller tears the
/// connection down). Every move of bytes (and the FIN) marks `activity`.
pub(crate) async fn pump(
    from: &TcpStream,
    to: &TcpStream,
    activity: &Activity,
    count: impl Fn(usize),
) -> io::Result<()> {
    let mut spliceable = true;
    loop {
        from.readable().await?;
        let moved = if spliceable {
            match splice_once(from, to).await {
                Err(e) if fallback_worthy(&e) => {
                    tracing::debug!(error = %e, "splice unavailable, copying through user space");
                    spliceable = false;
                    continue;
                }
                r => r?,
            }
        } else {
            copy_once(from, to).await?
        };
        if let Some(n) = moved {
            activity.touch();
            count(n);
        }
        if moved == Some(0) {
            shutdown_write(to);
            return Ok(());
        }
    }
}

/// Errors after which copying through a buffer may still work: no pipe (descriptors exhausted) or no
/// splice support between these two files.
fn fallback_worthy(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::EINVAL | libc::ENOSYS)
    )
}

/// One splice round: socket → pipe, then pipe → socket until the pipe is empty. Some(0): end of stream;
/// None: spurious readiness.
async fn splice_once(from: &TcpStream, to: &TcpStream) -> io::Result<Option<usize>> {
    let pipe = take_pipe()?;
    let filled = match from.try_io(Interest::READABLE, || {
        splice(from.as_raw_fd(), pipe.write.as_raw_fd(), CHUNK)
    }) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            return_pipe(pipe);
            return Ok(None);
        }
        Err(e) => {
            return_pipe(pipe);
            return Err(e);
        }
    };
    let mut left = filled;
    while left > 0 {
        to.writable().await?;
        match to.try_io(Interest::WRITABLE, || {
            splice(pipe.read.as_raw_fd(), to.as_raw_fd(), left)
        }) {
            Ok(n) => left -= n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // The pipe still holds bytes: it is closed with the error, never pooled.
            Err(e) => return Err(e),
        }
    }
    return_pipe(pipe);
    Ok(Some(filled))
}

/// One buffered round (the fallback): read up to 16 KiB, write it all. The buffer lives only for this round.
async fn copy_once(from: &TcpStream, to: &TcpStream) -> io::Result<Option<usize>> {
    let mut buf = vec![0u8; 16 * 1024];
    let n = match from.try_read(&mut buf) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut sent = 0;
    while sent < n {
        to.writable().await?;
        match to.try_write(&buf[sent..n]) {
            Ok(k) => sent += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(n))
}

/// Sends FIN on `s` (its peer reads end of stream) while its receiving side stays open.
pub(crate) fn shutdown_write(s: &TcpStream) {
    // SAFETY: plain syscall on an fd `s` keeps open. A failure (the peer already reset) needs no handling:
    // the other direction will see the error.
    unsafe {
        libc::shutdown(s.as_raw_fd(), libc::SHUT_WR);
    }
}

/// Makes closing `s` send a reset instead of FIN: a relayed connection that broke on one side is reset on the
/// other, as a direct connection would be.
pub(crate) fn reset_on_close(s: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: passes a pointer to a local linger struct with its exact size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}
