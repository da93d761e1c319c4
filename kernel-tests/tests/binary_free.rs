//! Binary-free proof: the statically linked release binary does its whole job in a root filesystem that
//! holds nothing but itself (and the manifests it reads), and no process is ever spawned by the agent during
//! full syncs, partial syncs, repairs and cleanup (every task it creates and every execve it attempts is seen
//! through ptrace).
//!
//! The static binary: `$NFTKUBE_STATIC_BIN`, or `target/static/x86_64-unknown-linux-gnu/release/nftkube`, built
//! by `bash ci/build-static` (ci/test and ci/vm-tests run it).

use kernel_tests::fake_api::{objects_from_yaml, FakeApi, Resource};
use kernel_tests::sandbox::{parse_answer, tcp_request, tcp_requests, udp_request};
use kernel_tests::*;
use nftkube::nft::ir::Family;
use nftkube::nft::netlink::NftSocket;
use nftkube::nft::tx::{Op, Transaction};
use nftkube_sandbox::netns::{unique_name, NetNs};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(2);
const SYNC: Duration = Duration::from_secs(20);

fn echo_v4() -> SocketAddr {
    "10.96.0.10:80".parse().unwrap()
}

fn echo_v6() -> SocketAddr {
    "[fd00:96::10]:80".parse().unwrap()
}

fn echo_v4_udp() -> SocketAddr {
    "10.96.0.10:53".parse().unwrap()
}

fn wait_reachable(ns: &NetNs, dst: SocketAddr, log: impl Fn() -> String) {
    wait_until(SYNC, || {
        tcp_request(ns, dst, Duration::from_millis(300)).is_ok()
    })
    .unwrap_or_else(|_| panic!("{dst} never became reachable; agent log:\n{}", log()));
}

fn backends_seen(sb: &sandbox::Sandbox, n: usize) -> BTreeSet<usize> {
    tcp_requests(sb.client(), echo_v4(), n, T)
        .iter()
        .filter_map(|a| a.as_ref().ok().and_then(|s| parse_answer(s)))
        .map(|(pod, _)| pod)
        .collect()
}

// ------------------------------------------------------------------------------------------------------------
// The static binary

/// The statically linked release binary (see the module comment); panics with how to build it.
fn static_bin() -> PathBuf {
    let p = std::env::var_os("NFTKUBE_STATIC_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/static/x86_64-unknown-linux-gnu/release/nftkube")
        });
    assert!(
        p.exists(),
        "{} not found: run `bash ci/build-static` first (ci/test does), or set NFTKUBE_STATIC_BIN",
        p.display()
    );
    p
}

/// What the ELF program and dynamic headers say about linking: (has an interpreter, DT_NEEDED libraries).
fn elf_linking(path: &Path) -> (bool, usize) {
    let b = std::fs::read(path).unwrap();
    assert!(
        b.len() > 64 && &b[..4] == b"\x7fELF" && b[4] == 2 && b[5] == 1,
        "{} is not a 64-bit little-endian ELF file",
        path.display()
    );
    let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize;
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    let mut interp = false;
    let mut needed = 0;
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        match u32_at(ph) {
            // PT_INTERP: the program asks for a dynamic loader.
            3 => interp = true,
            // PT_DYNAMIC: static-pie binaries have one (for self-relocation) but need no library.
            2 => {
                let (off, size) = (u64_at(ph + 8), u64_at(ph + 32));
                for e in (off..off + size).step_by(16) {
                    match u64_at(e) {
                        0 => break,
                        1 => needed += 1, // DT_NEEDED
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (interp, needed)
}

#[test]
fn the_release_binary_is_statically_linked() {
    let bin = static_bin();
    let (interp, needed) = elf_linking(&bin);
    assert!(!interp, "{} asks for a dynamic loader", bin.display());
    assert_eq!(needed, 0, "{} needs shared libraries", bin.display());
    // Independent oracles where they exist (not in the kernel-matrix VMs): file(1) and ldd(1).
    if let Ok(out) = Command::new("file").arg("-L").arg(&bin).output() {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("statically linked") || text.contains("static-pie linked"),
            "file says: {text}"
        );
    } else {
        eprintln!("note: no file(1) here; the ELF headers were checked directly");
    }
    if let Ok(out) = Command::new("ldd").arg(&bin).output() {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("not a dynamic executable") || text.contains("statically linked"),
            "ldd says: {text}"
        );
    }
}

// ------------------------------------------------------------------------------------------------------------
// An empty root

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A directory the child mounts its private tmpfs root on (in its own mount namespace; the host never sees
/// that mount). Removed on drop.
struct RootDir(PathBuf);

impl RootDir {
    fn new() -> RootDir {
        let d = std::env::temp_dir().join(unique_name("nftkube-root"));
        std::fs::create_dir_all(&d).unwrap();
        RootDir(d)
    }
}

impl Drop for RootDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `nftkube ARGS` in the network namespace `ns` and in an empty root: a new mount namespace whose root is a
/// fresh tmpfs holding a copy of `bin` as `/nftkube` and, if given, the manifest directory bind-mounted at
/// `/manifests`; nothing else (no /proc, /sys, /dev, /etc, /tmp, no shell, no library, no loader). All of it
/// is set up in the child between fork and exec, with async-signal-safe system calls only.
fn in_empty_root(ns: &NetNs, bin: &Path, manifests: Option<&Path>, root: &RootDir) -> Command {
    let netns = File::open(ns.path()).expect("opening the namespace file");
    let root_c = cstr(&root.0);
    let bin_c = cstr(bin);
    let dst_bin = cstr(&root.0.join("nftkube"));
    let dst_man = cstr(&root.0.join("manifests"));
    let man_c = manifests.map(cstr);
    let mut cmd = Command::new("/nftkube");
    // SAFETY: the closure runs in the forked child before exec; it only makes system calls (no allocation, no
    // lock) on strings prepared before the fork. `netns` stays open in the parent until the command is dropped.
    unsafe {
        cmd.pre_exec(move || {
            check(libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET))?;
            check(libc::unshare(libc::CLONE_NEWNS))?;
            // Nothing below propagates back to the host's mounts.
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"nftkube-root".as_ptr(),
                root_c.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                c"mode=0755".as_ptr().cast(),
            ))?;
            // A copy of the binary, not a bind mount: the root holds the file itself.
            let src = libc::open(bin_c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            check(src)?;
            let dst = libc::open(
                dst_bin.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o755,
            );
            check(dst)?;
            loop {
                let n = libc::sendfile(dst, src, std::ptr::null_mut(), 1 << 20);
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
                if n == 0 {
                    break;
                }
            }
            check(libc::close(dst))?;
            check(libc::close(src))?;
            if let Some(man) = &man_c {
                check(libc::mkdir(dst_man.as_ptr(), 0o755))?;
                check(libc::mount(
                    man.as_ptr(),
                    dst_man.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ))?;
            }
            // pivot_root(".", "."): the old root ends up stacked under the new one and is detached at once.
            check(libc::chdir(root_c.as_ptr()))?;
            check(
                libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int,
            )?;
            check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            check(libc::chdir(c"/".as_ptr()))?;
            Ok(())
        });
    }
    cmd
}

/// The names in a process's root directory, seen from outside through /proc/PID/root.
fn root_entries(pid: u32) -> BTreeSet<String> {
    std::fs::read_dir(format!("/proc/{pid}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn the_static_binary_syncs_repairs_and_cleans_up_from_an_empty_root() {
    let bin = static_bin();
    let sb = sandbox("nk-empty", 3);
    let m = Manifests::examples();
    add_foreign_table(sb.node(), Family::Ip, "someone-else");
    let root = RootDir::new();

    let mut cmd = in_empty_root(sb.node(), &bin, Some(&m.dir), &root);
    cmd.args(proxy_args(Path::new("/manifests"), &[]));
    let mut agent = Agent::spawn(cmd, sb.node());
    let pid = agent.pid().unwrap();
    let log = || agent.log();

    // Traffic through every kind of service the examples hold: TCP and UDP, IPv4 and IPv6.
    wait_reachable(sb.client(), echo_v4(), log);
    wait_reachable(sb.client(), echo_v6(), log);
    wait_until(SYNC, || udp_request(sb.client(), echo_v4_udp(), T).is_ok())
        .unwrap_or_else(|_| panic!("UDP never answered; log:\n{}", log()));
    assert_eq!(backends_seen(&sb, 40), BTreeSet::from([1, 2, 3]));

    // While it runs, its root holds the binary and the manifests, nothing else, and it runs from there.
    assert_eq!(
        root_entries(pid),
        BTreeSet::from(["manifests".to_string(), "nftkube".to_string()])
    );
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
        Path::new("/nftkube")
    );
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    assert_eq!(mounts.lines().count(), 2, "mounts it can see:\n{mounts}");

    // A partial sync: one endpoint removed from the manifests.
    let original = m.read("endpointslices.yaml");
    m.write(
        "endpointslices.yaml",
        &without_endpoint(&original, "10.244.2.2"),
    );
    wait_until(SYNC, || backends_seen(&sb, 20) == BTreeSet::from([1, 3]))
        .unwrap_or_else(|_| panic!("endpoint removal not applied; log:\n{}", log()));

    // A repair (full sync after someone else deleted the table).
    delete_table(sb.node(), Family::Ip);
    wait_reachable(sb.client(), echo_v4(), log);
    assert!(agent.running(), "the agent died; log:\n{}", agent.log());

    let status = agent.stop_status();
    assert!(
        status.is_some_and(|s| s.success()),
        "agent exit {status:?}; log:\n{}",
        agent.log()
    );
    assert!(agent.log().contains("sync complete"), "{}", agent.log());

    // cleanup, from an empty root too.
    let out = in_empty_root(sb.node(), &bin, None, &root)
        .arg("cleanup")
        .output()
        .expect("running nftkube cleanup");
    assert!(
        out.status.success(),
        "cleanup failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dump_table(sb.node(), Family::Ip).is_none());
    assert!(dump_table(sb.node(), Family::Ip6).is_none());
    let (ok, text) = nft_list_ruleset(sb.node());
    assert!(ok, "{text}");
    assert!(
        text.contains("someone-else") && !text.contains("nftkube"),
        "{text}"
    );
}

/// The Kubernetes API source from an empty root: no CA bundle, no /etc, nothing but the binary (a plain-http
/// fake API server in the node's namespace).
#[test]
fn the_static_binary_follows_the_api_server_from_an_empty_root() {
    let bin = static_bin();
    let sb = sandbox("nk-empty-api", 3);
    let node_ns = sb.node().name().to_string();
    let api = FakeApi::start_with(Arc::new(move |a| {
        NetNs::open_existing(&node_ns)
            .map_err(|e| io::Error::other(e.to_string()))?
            .run(move || TcpListener::bind(a))?
    }));
    let examples = examples_dir();
    for file in ["services.yaml", "endpointslices.yaml"] {
        let text = std::fs::read_to_string(examples.join(file)).unwrap();
        for obj in objects_from_yaml(&text) {
            if Resource::of(&obj).is_some() {
                api.apply(obj);
            }
        }
    }
    api.apply(
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"},
        "spec": {"podCIDRs": ["10.244.0.0/16"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.168.200.1"}]}}),
    );

    let root = RootDir::new();
    let mut cmd = in_empty_root(sb.node(), &bin, None, &root);
    cmd.args(proxy_args_from(&["--master".into(), api.url().into()], &[]));
    let mut agent = Agent::spawn(cmd, sb.node());
    let pid = agent.pid().unwrap();
    wait_reachable(sb.client(), echo_v4(), || agent.log());
    assert_eq!(root_entries(pid), BTreeSet::from(["nftkube".to_string()]));
    let status = agent.stop_status();
    assert!(
        status.is_some_and(|s| s.success()),
        "agent exit {status:?}; log:\n{}",
        agent.log()
    );
}

/// Deletes our table of `family` through netlink, as someone else would.
fn delete_table(ns: &NetNs, family: Family) {
    ns.run(|| {
        let mut tx = Transaction::default();
        tx.push(family, "nftkube", Op::DeleteTable);
        NftSocket::open()
            .expect("nf_tables socket")
            .commit(&tx)
            .expect("deleting the table");
    })
    .expect("entering the namespace");
}

// ------------------------------------------------------------------------------------------------------------
// No process, ever: a ptrace tracer

/// What a traced program did, as seen by its tracer.
#[derive(Debug, Default)]
struct TraceReport {
    /// Threads created by a traced process (clone with CLONE_THREAD: same thread group).
    threads: usize,
    /// Processes created: fork, vfork, or clone without CLONE_THREAD (PTRACE_EVENT_FORK / VFORK / CLONE into a
    /// new thread group).
    processes: Vec<String>,
    /// Successful execs after the program's own (PTRACE_EVENT_EXEC).
    execs: usize,
    /// execve / execveat entries after the program's own exec, successful or not (syscall-entry stops), with
    /// the file name.
    exec_attempts: Vec<String>,
    /// fork / vfork / clone / clone3 entries that would create a process, successful or not.
    spawn_attempts: Vec<String>,
    /// System call entries seen (to show that the tracer saw the program work at all).
    syscalls: u64,
    /// The wait status of the program's main thread.
    status: Option<i32>,
}

impl TraceReport {
    fn assert_spawned_nothing(&self, what: &str) {
        assert!(
            self.processes.is_empty()
                && self.execs == 0
                && self.exec_attempts.is_empty()
                && self.spawn_attempts.is_empty(),
            "{what} spawned or tried to: {self:#?}"
        );
        assert!(
            self.syscalls > 10,
            "{what}: the tracer saw almost nothing: {self:#?}"
        );
    }

    fn exited_ok(&self) -> bool {
        self.status
            .is_some_and(|s| libc::WIFEXITED(s) && libc::WEXITSTATUS(s) == 0)
    }
}

/// A program running under a tracer thread. The tracer thread forks it (so it is the tracer: PTRACE_TRACEME
/// attaches a child to the thread that forked it) and waits only for its own tracees (`__WNOTHREAD`), so the
/// other tests' children in this process are never reaped by it.
struct Traced {
    pid: i32,
    log: PathBuf,
    report: Option<mpsc::Receiver<TraceReport>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Traced {
    fn spawn(mut cmd: Command) -> Traced {
        let log = std::env::temp_dir().join(format!("{}.log", unique_name("nftkube-traced")));
        let logfile = File::create(&log).unwrap();
        // SAFETY: ptrace(PTRACE_TRACEME) in the forked child before exec: no allocation, no lock. The exec that
        // follows stops the child with SIGTRAP until the tracer lets it go on.
        unsafe {
            cmd.pre_exec(|| {
                if libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logfile);
        let (pid_tx, pid_rx) = mpsc::channel();
        let (report_tx, report_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tracer".into())
            .spawn(move || {
                let child = match cmd.spawn() {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = pid_tx.send(Err(e));
                        return;
                    }
                };
                let pid = child.id() as i32;
                let _ = pid_tx.send(Ok(pid));
                // The child is reaped by the tracer below, never through `child`.
                std::mem::forget(child);
                let _ = report_tx.send(trace(pid));
            })
            .unwrap();
        let pid = pid_rx
            .recv()
            .unwrap()
            .unwrap_or_else(|e| panic!("starting the traced program: {e}"));
        Traced {
            pid,
            log,
            report: Some(report_rx),
            thread: Some(thread),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `timeout` for the program to end by itself; SIGKILL after that.
    fn wait(&mut self, timeout: Duration) -> TraceReport {
        let rx = self.report.take().expect("already waited");
        let report = match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => {
                // SAFETY: kill on the pid of our own (traced, not yet reaped) child.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
                rx.recv().expect("tracer thread ended without a report")
            }
        };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        report
    }

    /// SIGTERM, then wait (the tracer passes the signal on).
    fn stop(&mut self) -> TraceReport {
        // SAFETY: as above.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        self.wait(Duration::from_secs(15))
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if let Some(rx) = self.report.take() {
            if rx.try_recv().is_err() {
                // SAFETY: kill on the pid of our own traced child; EXITKILL would also end it with the tracer.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
                let _ = rx.recv_timeout(Duration::from_secs(10));
            }
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        if std::thread::panicking() {
            eprintln!("traced program's log kept at {}", self.log.display());
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

fn waitpid_any() -> io::Result<(i32, i32)> {
    let mut status = 0;
    loop {
        // SAFETY: status is a valid out pointer.
        let tid = unsafe { libc::waitpid(-1, &mut status, libc::__WALL | libc::__WNOTHREAD) };
        if tid >= 0 {
            return Ok((tid, status));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn ptrace_req(req: libc::c_uint, tid: i32, addr: usize, data: usize) -> io::Result<libc::c_long> {
    // SAFETY: errno is thread-local; the requests used here take plain integers or a pointer to a value of the
    // right type that the caller owns.
    unsafe {
        *libc::__errno_location() = 0;
        let r = libc::ptrace(req, tid, addr, data);
        if r == -1 && *libc::__errno_location() != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(r)
    }
}

/// The thread group a task belongs to, from /proc.
fn tgid(tid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// A NUL-terminated string in a tracee's memory (at most 256 bytes).
fn peek_string(tid: i32, addr: u64) -> String {
    let mut bytes = Vec::new();
    let mut a = addr as usize;
    while bytes.len() < 256 {
        let Ok(word) = ptrace_req(libc::PTRACE_PEEKDATA, tid, a, 0) else {
            break;
        };
        for b in word.to_ne_bytes() {
            if b == 0 {
                return String::from_utf8_lossy(&bytes).into_owned();
            }
            bytes.push(b);
        }
        a += 8;
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Examines one system call entry.
#[cfg(target_arch = "x86_64")]
fn syscall_entry(tid: i32, r: &mut TraceReport) {
    // SAFETY: user_regs_struct is plain data; PTRACE_GETREGS fills it.
    let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    if ptrace_req(libc::PTRACE_GETREGS, tid, 0, &mut regs as *mut _ as usize).is_err() {
        return;
    }
    r.syscalls += 1;
    let thread = libc::CLONE_THREAD as u64;
    match regs.orig_rax as libc::c_long {
        libc::SYS_execve => r
            .exec_attempts
            .push(format!("{tid}: execve({:?})", peek_string(tid, regs.rdi))),
        libc::SYS_execveat => r
            .exec_attempts
            .push(format!("{tid}: execveat({:?})", peek_string(tid, regs.rsi))),
        libc::SYS_fork => r.spawn_attempts.push(format!("{tid}: fork()")),
        libc::SYS_vfork => r.spawn_attempts.push(format!("{tid}: vfork()")),
        libc::SYS_clone if regs.rdi & thread == 0 => r
            .spawn_attempts
            .push(format!("{tid}: clone(flags {:#x})", regs.rdi)),
        libc::SYS_clone3 => {
            // struct clone_args starts with the u64 flags.
            let flags = ptrace_req(libc::PTRACE_PEEKDATA, tid, regs.rdi as usize, 0)
                .map(|w| w as u64)
                .unwrap_or(0);
            if flags & thread == 0 {
                r.spawn_attempts
                    .push(format!("{tid}: clone3(flags {flags:#x})"));
            }
        }
        _ => {}
    }
}

/// Traces `pid` (stopped at its exec by PTRACE_TRACEME) and every task it creates until all have exited: each
/// task's creation (fork / vfork / clone events, auto-attached), each exec, and each system call entry.
fn trace(pid: i32) -> TraceReport {
    let mut r = TraceReport::default();
    match waitpid_any() {
        Ok((tid, st))
            if tid == pid && libc::WIFSTOPPED(st) && libc::WSTOPSIG(st) == libc::SIGTRAP => {}
        other => panic!("traced child did not stop at its exec: {other:?}"),
    }
    let opts = libc::PTRACE_O_TRACESYSGOOD
        | libc::PTRACE_O_TRACEFORK
        | libc::PTRACE_O_TRACEVFORK
        | libc::PTRACE_O_TRACECLONE
        | libc::PTRACE_O_TRACEEXEC
        | libc::PTRACE_O_EXITKILL;
    ptrace_req(libc::PTRACE_SETOPTIONS, pid, 0, opts as usize).expect("PTRACE_SETOPTIONS");
    ptrace_req(libc::PTRACE_SYSCALL, pid, 0, 0).expect("PTRACE_SYSCALL");
    let mut alive: HashSet<i32> = HashSet::from([pid]);
    // Per task: inside a system call (between its entry and exit stops).
    let mut in_syscall: HashMap<i32, bool> = HashMap::new();
    while !alive.is_empty() {
        let Ok((tid, st)) = waitpid_any() else { break };
        if libc::WIFEXITED(st) || libc::WIFSIGNALED(st) {
            alive.remove(&tid);
            in_syscall.remove(&tid);
            if tid == pid {
                r.status = Some(st);
            }
            continue;
        }
        if !libc::WIFSTOPPED(st) {
            continue;
        }
        alive.insert(tid);
        let sig = libc::WSTOPSIG(st);
        let event = (st >> 16) & 0xff;
        let mut inject = 0;
        if sig == libc::SIGTRAP | 0x80 {
            let inside = in_syscall.entry(tid).or_insert(false);
            *inside = !*inside;
            if *inside {
                syscall_entry(tid, &mut r);
            }
        } else if sig == libc::SIGTRAP && event != 0 {
            match event {
                libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK | libc::PTRACE_EVENT_CLONE => {
                    let mut new: libc::c_ulong = 0;
                    let _ = ptrace_req(
                        libc::PTRACE_GETEVENTMSG,
                        tid,
                        0,
                        &mut new as *mut _ as usize,
                    );
                    let new = new as i32;
                    alive.insert(new);
                    let same_group = tgid(new).is_some() && tgid(new) == tgid(tid);
                    if event == libc::PTRACE_EVENT_CLONE && same_group {
                        r.threads += 1;
                    } else {
                        let kind = match event {
                            libc::PTRACE_EVENT_FORK => "fork",
                            libc::PTRACE_EVENT_VFORK => "vfork",
                            _ => "clone into a new thread group",
                        };
                        r.processes.push(format!("{tid} -> {new} ({kind})"));
                    }
                }
                libc::PTRACE_EVENT_EXEC => r.execs += 1,
                _ => {}
            }
        } else if sig == libc::SIGSTOP || sig == libc::SIGTRAP {
            // A new task's first stop (auto-attached tasks start with SIGSTOP), or a stray trap: swallowed.
        } else {
            // A real signal (SIGTERM to stop the agent): delivered.
            inject = sig as usize;
        }
        let _ = ptrace_req(libc::PTRACE_SYSCALL, tid, 0, inject);
    }
    r
}

/// The tracer itself: a shell that runs a real program and tries a missing one must show up as processes,
/// execs and exec attempts; otherwise "nothing seen" would prove nothing.
#[test]
fn the_tracer_sees_processes_and_execs() {
    require_root();
    let me = std::env::current_exe().unwrap();
    let mut cmd = Command::new("/bin/sh");
    cmd.args([
        "-c",
        "\"$0\" --list >/dev/null; /nonexistent/nftkube-tracer-check 2>/dev/null; true",
    ])
    .arg(&me);
    let mut t = Traced::spawn(cmd);
    let r = t.wait(Duration::from_secs(60));
    eprintln!("{r:#?}");
    assert!(r.exited_ok(), "{r:#?}\n{}", t.log());
    assert!(r.processes.len() >= 2, "{r:#?}");
    assert!(r.execs >= 1, "{r:#?}");
    assert!(
        r.exec_attempts
            .iter()
            .any(|a| a.contains("nftkube-tracer-check")),
        "{r:#?}"
    );
    assert!(
        r.exec_attempts
            .iter()
            .any(|a| a.contains(&*me.to_string_lossy())),
        "{r:#?}"
    );
}

#[test]
fn no_process_is_spawned_during_full_and_partial_syncs_repairs_and_cleanup() {
    let sb = sandbox("nk-noexec", 3);
    let m = Manifests::examples();
    // --sync-period 1: periodic full resyncs (which read the kernel back: --full-read-period 0) while it is
    // traced.
    let mut cmd = sb.node().command(nftkube_bin());
    cmd.args(proxy_args(
        &m.dir,
        &["--sync-period", "1", "--full-read-period", "0"],
    ));
    let mut agent = Traced::spawn(cmd);
    let log = || agent.log();

    // Full sync at start.
    wait_reachable(sb.client(), echo_v4(), log);
    assert_eq!(backends_seen(&sb, 30), BTreeSet::from([1, 2, 3]));
    // Partial syncs: an endpoint goes and comes back, until two syncs were partial. With a full resync
    // every second, a slow machine (a VM without KVM, where a full sync takes most of a second) may apply a
    // change in a periodic full sync first.
    let original = m.read("endpointslices.yaml");
    for _ in 0..5 {
        m.write(
            "endpointslices.yaml",
            &without_endpoint(&original, "10.244.2.2"),
        );
        wait_until(SYNC, || backends_seen(&sb, 20) == BTreeSet::from([1, 3]))
            .unwrap_or_else(|_| panic!("endpoint removal not applied; log:\n{}", log()));
        m.write("endpointslices.yaml", &original);
        wait_until(SYNC, || backends_seen(&sb, 30) == BTreeSet::from([1, 2, 3]))
            .unwrap_or_else(|_| panic!("endpoint re-add not applied; log:\n{}", log()));
        if log().matches("full=false").count() >= 2 {
            break;
        }
    }
    // A repair: a full sync forced by someone else's change.
    delete_table(sb.node(), Family::Ip);
    wait_reachable(sb.client(), echo_v4(), log);
    // Periodic full resyncs happened too.
    let started = Instant::now();
    wait_until(SYNC, || {
        log().matches("full=true").count() >= 3 && log().matches("full=false").count() >= 2
    })
    .unwrap_or_else(|_| {
        panic!(
            "expected full and partial syncs after {:?}; log:\n{}",
            started.elapsed(),
            log()
        )
    });

    let r = agent.stop();
    assert!(r.exited_ok(), "agent: {r:#?}\nlog:\n{}", agent.log());
    r.assert_spawned_nothing("nftkube proxy");
    // The agent has threads of its own (the nf_tables event monitor): the tracer told them from processes.
    assert!(r.threads >= 1, "{r:#?}");
    eprintln!(
        "proxy: {} system calls, {} threads, no process, no exec",
        r.syscalls, r.threads
    );

    let mut cleanup = Traced::spawn({
        let mut c = sb.node().command(nftkube_bin());
        c.arg("cleanup");
        c
    });
    let r = cleanup.wait(Duration::from_secs(60));
    assert!(r.exited_ok(), "cleanup: {r:#?}\n{}", cleanup.log());
    r.assert_spawned_nothing("nftkube cleanup");
    assert!(dump_table(sb.node(), Family::Ip).is_none());
    assert!(dump_table(sb.node(), Family::Ip6).is_none());
}
