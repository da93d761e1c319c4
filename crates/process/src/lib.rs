//! What the agent asks of its own process, apart from its job: capabilities (`privs`), the allocator
//! (one heap per CPU; freed pages handed back after a full sync) and the open-files limit. In one place so
//! that the modules doing the work (sources, relay, admin servers) need not reach up into the agent for them.

pub mod privs;

/// One malloc arena per CPU: not glibc's default of eight per CPU, and not one for every thread.
/// - With an arena per thread, the memory the manifest source's threads freed could not be reused by the
///   loop's render and index, which then took fresh pages: peak RSS 51 MiB instead of 42 at 10k services,
///   184 instead of 152 at 50k.
/// - With one arena, the threads that parse manifests and render a full sync on every CPU
///   queued on its lock: at 1M endpoints from JSON a third of the render threads' time went to sleeping and
///   waking on it, and the cold sync took 6.4 s instead of 4.6 s; at 10k services 350 ms instead of 300.
///   The peak RSS was the same with an arena per CPU (two CPUs: 35 / 37 MiB at 10k, 291 / 292 MiB at 1M).
///   From the API: 0.32 / 1.44 / 3.20 s with one arena at 10k / 50k / 100k services, 0.28 / 1.32 / 2.86 s
///   with one per CPU, peak RSS 36 / 113 / 211 against 37 / 116 / 216 MiB.
pub fn one_heap_per_cpu() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: mallopt only sets a glibc allocator parameter; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, i32::try_from(cpus).unwrap_or(i32::MAX));
    }
}

/// A full sync builds and drops large transient structures; hand the freed pages back to the system so the
/// agent's resident size reflects what it keeps, not its peak.
pub fn release_free_memory() {
    // SAFETY: malloc_trim only walks glibc's own heap structures; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Raising the soft open-files limit failed.
#[derive(Debug, thiserror::Error)]
#[error("raising the soft open-files limit (RLIMIT_NOFILE) to the hard one: {0}")]
pub struct OpenFilesLimitError(#[source] std::io::Error);

/// Raises the soft open-files limit to the hard one; returns the soft limit now in force. The relay holds
/// two descriptors per relayed connection, and the admin servers one per connection (up to their limits,
/// on each of possibly thousands of healthCheckNodePorts): the usual soft default of 1024 would run out
/// long before the hard limit the administrator granted. Go raises it so for kube-proxy at start too.
pub fn raise_open_files_limit() -> Result<u64, OpenFilesLimitError> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given, a valid local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(OpenFilesLimitError(std::io::Error::last_os_error()));
    }
    if lim.rlim_cur >= lim.rlim_max {
        return Ok(lim.rlim_cur);
    }
    let raised = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit only reads the struct it is given, a valid local.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(OpenFilesLimitError(std::io::Error::last_os_error()));
    }
    Ok(raised.rlim_cur)
}
