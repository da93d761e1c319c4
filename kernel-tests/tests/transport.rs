//! The nf_tables transport against a real kernel: refusals the kernel reports on BATCH_BEGIN only (no
//! CAP_NET_ADMIN), the agent without the capability, and reads that stay consistent while someone else
//! commits.
//!
//! How the capability goes away: nfnetlink checks CAP_NET_ADMIN of the sending thread and of whoever opened
//! the socket. The library tests open the socket on a thread of their own and then clear CAP_NET_ADMIN
//! from that thread's effective set with capset (it stays permitted, so it can come back); the binary test
//! drops it from the bounding set before exec, so the agent never has it.

use kernel_tests::*;
use nftkube::netlink::NetlinkError;
use nftkube::nft::ir::{Chain, DataType, Element, Family, Set, TableState};
use nftkube::nft::netlink::{CommitError, DumpError, NftSocket};
use nftkube::nft::tx::{Op, Transaction};
use nftkube_sandbox::netns::{unique_name, NetNs};
use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CAP_NET_ADMIN: u32 = 12;
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
/// "Promptly": the kernel answers inside sendmsg; anything near the transport's 5 s silence limit would
/// mean the refusal was missed and a deadline ended the wait instead.
const PROMPT: Duration = Duration::from_millis(500);

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Adds or removes CAP_NET_ADMIN in the calling thread's effective set (it stays permitted).
fn net_admin_effective(on: bool) {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two CapData (version 3) through a valid pointer and reads a valid header.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
    if on {
        data[0].effective |= 1 << CAP_NET_ADMIN;
    } else {
        data[0].effective &= !(1 << CAP_NET_ADMIN);
    }
    // SAFETY: capset reads a valid header and two CapData; pid 0 is the calling thread only.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
}

fn scratch_ns(tag: &str) -> NetNs {
    require_root();
    NetNs::create(&unique_name(tag)).expect("creating a network namespace")
}

fn add_table(name: &str) -> Transaction {
    let mut tx = Transaction::default();
    tx.push(Family::Ip, name, Op::AddTable);
    tx
}

fn add_chain(table: &str, chain: &str) -> Transaction {
    let mut tx = Transaction::default();
    tx.push(Family::Ip, table, Op::AddChain(Chain::regular(chain)));
    tx
}

/// The refusal must be the batch-level EPERM, reported promptly, and say so.
fn assert_batch_eperm(result: Result<usize, CommitError>, took: Duration) {
    let e = result.expect_err("a commit without CAP_NET_ADMIN went through");
    assert!(took < PROMPT, "the refusal took {took:?}: {e}");
    assert!(
        matches!(
            e.failures.as_slice(),
            [(
                _,
                NetlinkError::Batch {
                    errno: libc::EPERM,
                    ..
                }
            )]
        ),
        "{e:?}"
    );
    let text = e.to_string();
    assert!(
        text.contains("whole batch") && text.contains("Operation not permitted"),
        "{text}"
    );
    assert!(!e.outcome_unknown(), "a refusal is a known outcome: {text}");
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let r = f();
    (r, start.elapsed())
}

#[test]
fn losing_cap_net_admin_after_start_is_a_prompt_batch_error_and_the_socket_recovers_with_it() {
    let ns = scratch_ns("nk-caplost");
    ns.run(|| {
        let mut s = NftSocket::open().unwrap();
        s.commit(&add_table("nk-cap")).unwrap();

        net_admin_effective(false);
        let (r, took) = timed(|| s.commit(&add_chain("nk-cap", "c1")));
        assert_batch_eperm(r, took);
        // Reads are refused too, on their own request, which the error names.
        let e = s.read_tables(&[(Family::Ip, "nk-cap")]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("GETGEN") && text.contains("Operation not permitted"),
            "{text}"
        );

        net_admin_effective(true);
        s.commit(&add_chain("nk-cap", "c1")).unwrap();
        let tables = s.read_tables(&[(Family::Ip, "nk-cap")]).unwrap();
        let table = tables[0].as_ref().expect("our table");
        assert!(table.chains.contains_key("c1"));
    })
    .unwrap();
}

#[test]
fn a_socket_opened_without_cap_net_admin_is_refused_promptly_then_replaced() {
    let ns = scratch_ns("nk-capnone");
    ns.run(|| {
        net_admin_effective(false);
        let mut s = NftSocket::open().unwrap();
        // The hang of issue 17: the only answer comes on BATCH_BEGIN's sequence number.
        let (r, took) = timed(|| s.commit(&add_table("nk-cap")));
        assert_batch_eperm(r, took);
        // The kernel also checks who opened the socket: only a new one can use the capability once it is
        // back. The refusal made the transport replace it.
        net_admin_effective(true);
        s.commit(&add_table("nk-cap")).unwrap();
        assert!(s.read_tables(&[(Family::Ip, "nk-cap")]).unwrap()[0].is_some());
    })
    .unwrap();
}

#[test]
fn the_agent_without_cap_net_admin_logs_the_refusal_keeps_retrying_and_stops_on_sigterm() {
    let sb = sandbox("nk-nocap", 1);
    let m = Manifests::examples();
    let mut cmd = sb.node().command(nftkube_bin());
    // SAFETY: runs in the forked child before exec (after the namespace hook) and only calls prctl,
    // which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(
                libc::PR_CAPBSET_DROP,
                CAP_NET_ADMIN as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.args(proxy_args(&m.dir, &[]));
    let mut agent = Agent::spawn(cmd, sb.node());
    // The first sync and at least one retry (backoff 1 s, then 2 s) fail, each with the kernel's reason.
    wait_until(Duration::from_secs(15), || {
        agent.log().matches("sync failed").count() >= 2
    })
    .unwrap_or_else(|_| panic!("no failed syncs logged; log:\n{}", agent.log()));
    let log = agent.log();
    assert!(
        log.lines()
            .filter(|l| l.contains("sync failed"))
            .all(|l| l.contains("Operation not permitted")),
        "{log}"
    );
    assert!(!log.contains("sync complete"), "{log}");
    eprintln!(
        "{}",
        log.lines()
            .find(|l| l.contains("sync failed"))
            .unwrap_or_default()
    );
    assert!(agent.running(), "the agent gave up; log:\n{log}");
    let (status, took) = timed(|| agent.stop_status());
    let status = status.expect("the agent did not stop on SIGTERM");
    assert!(status.success(), "{status:?}; log:\n{}", agent.log());
    assert!(
        took < Duration::from_secs(1),
        "SIGTERM took {took:?} to end the agent"
    );
    eprintln!("SIGTERM to exit: {took:?}");
}

const RACE_TABLE: &str = "nk-race";

fn v4(k: u32) -> Element {
    Element {
        key: (0x0a00_0000u32 + k).to_be_bytes().to_vec().into(),
        value: None,
    }
}

fn addr_set(name: &str) -> Set {
    Set::new(name, vec![DataType::Ipv4Addr], Vec::new())
}

/// One transaction that keeps sets `a` and `b` equal: the same elements go into (or out of) both.
fn both(op: fn(String, Vec<Element>) -> Op, elements: Vec<Element>) -> Transaction {
    let mut tx = Transaction::default();
    for set in ["a", "b"] {
        tx.push(Family::Ip, RACE_TABLE, op(set.into(), elements.clone()));
    }
    tx
}

fn add(set: String, elements: Vec<Element>) -> Op {
    Op::AddElements { set, elements }
}

fn del(set: String, elements: Vec<Element>) -> Op {
    Op::DeleteElements { set, elements }
}

/// Whether a read of the race table shows what no transaction ever left: `a` and `b` differing.
fn torn(t: &TableState) -> bool {
    let elements = |s: &str| -> BTreeSet<Element> { t.sets[s].elements.clone() };
    elements("a") != elements("b")
}

/// A second writer commits to our table while it is read: each transaction keeps its two sets equal, so a
/// read that mixes dumps from before and after a commit shows them different.
#[test]
fn reads_stay_consistent_while_a_second_writer_commits() {
    let ns = scratch_ns("nk-race");
    ns.run(|| {
        let mut setup = add_table(RACE_TABLE);
        setup.push(Family::Ip, RACE_TABLE, Op::AddSet(addr_set("a")));
        setup.push(Family::Ip, RACE_TABLE, Op::AddSet(addr_set("b")));
        NftSocket::open().unwrap().commit(&setup).unwrap();
        // Large enough that each set's dump takes several datagrams.
        NftSocket::open()
            .unwrap()
            .commit(&both(add, (0..3000).map(v4).collect()))
            .unwrap();
    })
    .unwrap();

    // The writer's long pause must let a whole read fit: under the VM matrix's software emulation a read of
    // these sets takes far longer than on hardware (with a fixed 30 ms pause every read there overlapped a
    // commit, and all gave up).
    let read_time = ns
        .run(|| {
            let t = std::time::Instant::now();
            NftSocket::open()
                .unwrap()
                .read_tables(&[(Family::Ip, RACE_TABLE)])
                .unwrap();
            t.elapsed()
        })
        .unwrap();
    let long_pause = (read_time * 3).max(Duration::from_millis(30));
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let writer = ns
        .spawn(move || {
            let mut s = NftSocket::open().unwrap();
            let mut commits = 0u32;
            while !st.load(Ordering::SeqCst) {
                let k = 10_000 + commits;
                s.commit(&both(add, vec![v4(k)])).unwrap();
                if commits >= 20 {
                    s.commit(&both(del, vec![v4(k - 20)])).unwrap();
                }
                commits += 1;
                // Bursts and pauses, so that some reads fit between commits and others overlap them.
                let pause = if commits.is_multiple_of(4) {
                    long_pause
                } else {
                    Duration::from_millis(1)
                };
                std::thread::sleep(pause);
            }
            commits
        })
        .unwrap();

    let (consistent, unstable, rereads, torn_unchecked) = ns
        .run(|| {
            let mut s = NftSocket::open().unwrap();
            let (mut consistent, mut unstable) = (0, 0);
            for _ in 0..40 {
                match s.read_tables(&[(Family::Ip, RACE_TABLE)]) {
                    Ok(t) => {
                        let t = t[0].as_ref().expect("the race table");
                        assert!(!torn(t), "a checked read mixed two states");
                        consistent += 1;
                    }
                    // Bounded: an error, never a mixed view.
                    Err(DumpError::Unstable { .. }) => unstable += 1,
                    Err(e) => panic!("reading: {e}"),
                }
            }
            // The control: the same reads without the generation check.
            let torn_unchecked = (0..40)
                .filter(|_| torn(&s.dump_table(Family::Ip, RACE_TABLE).unwrap().unwrap()))
                .count();
            (consistent, unstable, s.rereads(), torn_unchecked)
        })
        .unwrap();
    stop.store(true, Ordering::SeqCst);
    let commits = writer.join().unwrap();
    eprintln!(
        "{commits} commits by the writer; checked reads: {consistent} consistent, {unstable} gave up, \
         {rereads} repeated; unchecked reads: {torn_unchecked}/40 torn; {} dumps marked interrupted \
         and asked again",
        nftkube::netlink::DUMP_RETRIES.load(Ordering::Relaxed)
    );
    assert!(commits > 40, "the writer hardly ran ({commits} commits)");
    assert!(consistent >= 20, "{consistent} of 40 reads succeeded");
    assert!(
        rereads > 0,
        "no read ever overlapped a commit: the test did not race"
    );
}
