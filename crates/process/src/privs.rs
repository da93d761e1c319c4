//! Least privilege: right after start, `nftkube proxy` gives up every capability it does not need.
//!
//! What is kept: CAP_NET_ADMIN (nf_tables and ctnetlink writes, the nf_tables event group), and
//! CAP_NET_BIND_SERVICE only when a configured healthz or metrics port is below 1024. The conntrack feature
//! probe needs CAP_SYS_ADMIN (`unshare(CLONE_NEWNET)` for its scratch namespace) and nothing else; it runs
//! before the drop, so CAP_SYS_ADMIN goes with the rest.
//!
//! Capabilities are per thread: [`drop_to`] changes the calling thread only, so it must run while that is
//! the only thread of the process (before any tokio runtime, monitor or admin thread exists); every thread
//! spawned afterwards inherits the reduced sets.

use std::io;

/// linux/capability.h
pub(crate) const CAP_NET_BIND_SERVICE: u32 = 10;
/// CAP_NET_ADMIN: nf_tables, ctnetlink, rtnetlink writes.
pub(crate) const CAP_NET_ADMIN: u32 = 12;
/// CAP_SETPCAP: changing the bounding set.
pub(crate) const CAP_SETPCAP: u32 = 8;

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAP_VERSION_3: u32 = 0x2008_0522;

/// A capability set as a bit mask (bit n: capability n), as `/proc/PID/status` shows it.
pub(crate) type CapSet = u64;

/// Ports below this need CAP_NET_BIND_SERVICE (the kernel's default `ip_unprivileged_port_start`).
const FIRST_UNPRIVILEGED_PORT: u16 = 1024;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

#[derive(Debug, thiserror::Error)]
/// A failed step of dropping capabilities.
pub enum PrivsError {
    #[error("reading this thread's capabilities (capget): {0}")]
    /// capget failed.
    Get(io::Error),
    #[error("setting this thread's capabilities (capset): {0}")]
    /// capset failed.
    Set(io::Error),
    #[error("clearing the ambient capability set: {0}")]
    /// Clearing the ambient set failed.
    Ambient(io::Error),
    #[error("dropping capability {cap} from the bounding set: {source}")]
    /// A capability could not be dropped from the bounding set.
    Bounding {
        /// The capability.
        cap: u32,
        /// The error.
        source: io::Error,
    },
    #[error("setting no_new_privs: {0}")]
    /// PR_SET_NO_NEW_PRIVS failed.
    NoNewPrivs(io::Error),
    #[error("capabilities after the drop: effective {effective:#x}, permitted {permitted:#x}, inheritable {inheritable:#x}; wanted {wanted:#x}")]
    /// After the drop, the sets are not what was asked for.
    Verify {
        /// The effective set.
        effective: CapSet,
        /// The permitted set.
        permitted: CapSet,
        /// The inheritable set.
        inheritable: CapSet,
        /// What was asked for.
        wanted: CapSet,
    },
}

/// What the drop left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// Effective = permitted after the drop; inheritable and ambient are empty.
    pub kept: CapSet,
    /// The bounding set after the drop.
    pub bounding: CapSet,
}

/// The capabilities `nftkube proxy` keeps: CAP_NET_ADMIN, and CAP_NET_BIND_SERVICE if one of `ports` (the
/// healthz and metrics ports it binds) is privileged. healthCheckNodePorts come from the cluster's NodePort
/// range (30000-32767 by default) and are not considered: one below 1024 fails to bind (logged, retried).
pub fn needed(ports: impl IntoIterator<Item = u16>) -> CapSet {
    let mut keep = bit(CAP_NET_ADMIN);
    if ports
        .into_iter()
        .any(|p| p != 0 && p < FIRST_UNPRIVILEGED_PORT)
    {
        keep |= bit(CAP_NET_BIND_SERVICE);
    }
    keep
}

fn bit(cap: u32) -> CapSet {
    1 << cap
}

/// Reduces the calling thread to `keep` (intersected with what it has): effective, permitted and
/// inheritable sets, ambient set cleared, bounding set lowered (when CAP_SETPCAP allows it), no_new_privs
/// set. Call it while the calling thread is the process's only thread.
pub fn drop_to(keep: CapSet) -> Result<Dropped, PrivsError> {
    clear_ambient()?;
    let before = capget()?;
    // Before capset: PR_CAPBSET_DROP needs CAP_SETPCAP in the effective set, which capset removes.
    let bounding = lower_bounding(keep, before.effective & bit(CAP_SETPCAP) != 0)?;
    let kept = keep & before.permitted;
    capset(Sets {
        effective: kept,
        permitted: kept,
        inheritable: 0,
    })?;
    set_no_new_privs()?;
    let after = capget()?;
    if after.effective != kept || after.permitted != kept || after.inheritable != 0 {
        return Err(PrivsError::Verify {
            effective: after.effective,
            permitted: after.permitted,
            inheritable: after.inheritable,
            wanted: kept,
        });
    }
    Ok(Dropped { kept, bounding })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sets {
    effective: CapSet,
    permitted: CapSet,
    inheritable: CapSet,
}

fn capget() -> Result<Sets, PrivsError> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two CapData (the layout of struct __user_cap_data_struct) for version 3 and
    // reads the header; both outlive the call. pid 0 is the calling thread.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            data.as_mut_ptr(),
        )
    };
    if r != 0 {
        return Err(PrivsError::Get(io::Error::last_os_error()));
    }
    let join = |f: fn(&CapData) -> u32| u64::from(f(&data[0])) | u64::from(f(&data[1])) << 32;
    Ok(Sets {
        effective: join(|d| d.effective),
        permitted: join(|d| d.permitted),
        inheritable: join(|d| d.inheritable),
    })
}

fn capset(sets: Sets) -> Result<(), PrivsError> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let split = |s: CapSet, word: usize| (s >> (32 * word)) as u32;
    let data: [CapData; 2] = std::array::from_fn(|w| CapData {
        effective: split(sets.effective, w),
        permitted: split(sets.permitted, w),
        inheritable: split(sets.inheritable, w),
    });
    // SAFETY: capset reads the header and two CapData (version 3 layout), which outlive the call; it only
    // changes the calling thread's credentials.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if r != 0 {
        return Err(PrivsError::Set(io::Error::last_os_error()));
    }
    Ok(())
}

/// Ambient capabilities would survive an execve; nftkube executes nothing, but a cleared set says so.
fn clear_ambient() -> Result<(), PrivsError> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    match r {
        0 => Ok(()),
        // Before Linux 4.3 there is no ambient set to clear.
        _ if io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) => Ok(()),
        _ => Err(PrivsError::Ambient(io::Error::last_os_error())),
    }
}

/// Whether `cap` is in the bounding set; None past the last capability this kernel knows.
fn in_bounding(cap: u32) -> Option<bool> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong, 0, 0, 0) };
    (r >= 0).then_some(r == 1)
}

/// Drops everything but `keep` from the bounding set; returns what it holds afterwards. Without CAP_SETPCAP
/// (a container started with `drop: [ALL], add: [NET_ADMIN]` has a bounding set of NET_ADMIN alone, so there
/// is nothing to drop) what cannot be dropped is logged: no_new_privs still keeps an execve from regaining it.
fn lower_bounding(keep: CapSet, can_drop: bool) -> Result<CapSet, PrivsError> {
    let mut bounding = 0;
    for cap in 0..64u32 {
        let Some(present) = in_bounding(cap) else {
            break;
        };
        if !present {
            continue;
        }
        if keep & bit(cap) != 0 {
            bounding |= bit(cap);
            continue;
        }
        if !can_drop {
            bounding |= bit(cap);
            continue;
        }
        // SAFETY: prctl with integer arguments only; it changes the calling thread's bounding set.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            return Err(PrivsError::Bounding {
                cap,
                source: io::Error::last_os_error(),
            });
        }
    }
    if bounding & !keep != 0 {
        tracing::warn!(
            bounding = format!("{bounding:#x}"),
            "no CAP_SETPCAP: the bounding set keeps capabilities nftkube does not use (no_new_privs is set)"
        );
    }
    Ok(bounding)
}

fn set_no_new_privs() -> Result<(), PrivsError> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(PrivsError::NoNewPrivs(io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_service_is_kept_only_for_a_privileged_port() {
        assert_eq!(needed([10256, 10249]), 1 << CAP_NET_ADMIN);
        assert_eq!(needed([]), 1 << CAP_NET_ADMIN);
        // Port 0: the kernel picks an unprivileged one.
        assert_eq!(needed([0]), 1 << CAP_NET_ADMIN);
        assert_eq!(
            needed([10256, 443]),
            (1 << CAP_NET_ADMIN) | (1 << CAP_NET_BIND_SERVICE)
        );
    }

    /// In a thread of its own (capabilities are per thread; the others in this process keep theirs).
    #[test]
    fn a_thread_keeps_only_what_it_asks_for() {
        let got = std::thread::spawn(|| {
            let before = capget().unwrap();
            let d = drop_to(needed([])).unwrap();
            (before, d, capget().unwrap())
        })
        .join()
        .unwrap();
        let (before, dropped, after) = got;
        let want = (1 << CAP_NET_ADMIN) & before.permitted;
        assert_eq!(dropped.kept, want);
        assert_eq!(
            after,
            Sets {
                effective: want,
                permitted: want,
                inheritable: 0
            }
        );
    }
}
