//! The listing invariant (docs/kernels-and-nft.md "The listing invariant"): every state nftkube programs lists with
//! `nft list ruleset` and `nft -j list ruleset`, without error, signal or warning, under the distribution's nft
//! and under the newest one Debian ships (`ci/nft-newest`), and the text listing reloads with `nft -f` into a
//! fresh namespace that then lists identically.
//!
//! Operators, firewall managers and other agents on a node list the ruleset; a state they cannot list or
//! reload breaks them even though the kernel accepted it, and no traffic test notices.

use nftkube_sandbox::netns::{unique_name, NetNs};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// One nft binary the invariant runs.
#[derive(Debug)]
pub struct Nft {
    /// The program run.
    pub program: PathBuf,
    /// Its version, as `nft --version` prints it.
    pub version: (u32, u32, u32),
}

impl Nft {
    fn label(&self) -> String {
        let (a, b, c) = self.version;
        format!("nft {a}.{b}.{c} ({})", self.program.display())
    }
}

/// The nfts the invariant runs: the distribution's `nft` from PATH, then the newest (`$NFTKUBE_NFT_NEWEST`, else
/// where `ci/nft-newest` puts it). `NFTKUBE_NFT_NEWEST=none` says this environment has the distribution's nft
/// only (the VM matrix, which copies the host's nft in). A newest nft that is missing fails every check.
pub fn nfts() -> &'static [Nft] {
    static NFTS: OnceLock<Vec<Nft>> = OnceLock::new();
    NFTS.get_or_init(|| {
        let mut v = vec![probe("nft".into())];
        if let Some(newest) = newest_nft_path() {
            v.push(probe(newest));
        }
        v
    })
}

fn newest_nft_path() -> Option<PathBuf> {
    let path = match std::env::var_os("NFTKUBE_NFT_NEWEST") {
        Some(v) if v == "none" => return None,
        Some(v) => PathBuf::from(v),
        None => default_newest_nft(),
    };
    assert!(
        path.exists(),
        "the newest nft is missing at {}: run `bash ci/nft-newest` (ci/test does), set NFTKUBE_NFT_NEWEST, or \
         NFTKUBE_NO_ORACLE=1 to run without any nft",
        path.display()
    );
    Some(path)
}

/// `ci/nft-newest`'s wrapper: `${XDG_CACHE_HOME:-$HOME/.cache}/nftkube-nft/prefix/nft`.
fn default_newest_nft() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
        });
    cache.join("nftkube-nft/prefix/nft")
}

fn probe(program: PathBuf) -> Nft {
    let out = std::process::Command::new(&program)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("running {} --version: {e}", program.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    // "nftables v1.1.7 (Commodore Bullmoose #8)"
    let version = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix('v'))
        .and_then(parse_version)
        .unwrap_or_else(|| panic!("{} --version printed {text:?}", program.display()));
    Nft { program, version }
}

fn parse_version(s: &str) -> Option<(u32, u32, u32)> {
    let mut it = s.split('.').map(|p| p.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// The known faults of nft 1.0.x (docs/kernels-and-nft.md "Tolerated nft bugs"), tolerated narrowly: only the lines and
/// messages named here, and only for 1.0.x; anything else, and any other version, is checked as it is.
///
/// 1. nft 1.0.6's register allocator cannot write a map update whose value is longer than 16 bytes: loading
///    `update @affinity { ... : ip6 daddr . th dport }` (an IPv6 address and a port, 20 bytes) aborts
///    (`netlink_gen_expr: Assertion 'dreg < ctx->reg_low' failed`), though it lists the rule. That rule is
///    left out of the reload and of the comparison; the rest of the listing must still reload identically.
/// 2. nft 1.0.6's JSON printer has no callback for the map update statement: `nft -j list ruleset` prints it
///    as a string and warns `stmt ops map have no json callback` (exit 0). That warning alone is tolerated.
///
/// (nft 1.1.x lists a nat chain on the output hook at priority -100 as `priority dstnat`; 1.1.7 reloads that,
/// 1.0.6 would refuse it. Each nft here reloads its own listing, so that needs no exception.)
struct FaultRewriter {
    version: (u32, u32, u32),
    in_ip6_table: bool,
}

impl FaultRewriter {
    /// The line to use instead of `line` (None: leave it out).
    fn line(&mut self, line: &str) -> Option<String> {
        if self.version >= (1, 1, 0) {
            return Some(line.to_owned());
        }
        if line.starts_with("table ") {
            self.in_ip6_table = line.starts_with("table ip6 ");
        }
        let long_map_update =
            line.contains("update @") && line.ends_with(": ip6 daddr . th dport }");
        (!(self.in_ip6_table && long_map_update)).then(|| line.to_owned())
    }
}

/// The JSON printer's warning for map updates (fault 2), the only stderr 1.0.x may write for `-j`.
const MAP_JSON_WARNING: &str = "warning: stmt ops map have no json callback";

fn tolerated_stderr(nft: &Nft, what: &str, stderr: &str) -> bool {
    nft.version < (1, 1, 0)
        && what == "nft -j list ruleset"
        && stderr.lines().all(|l| l == MAP_JSON_WARNING)
}

/// Whether the known faults are tolerated (always, but in the harness's own test that shows they are real).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Faults {
    /// The known nft faults are rewritten away before comparing.
    Tolerated,
    /// Every difference counts.
    Strict,
}

fn rewrite(nft: &Nft, text: &str, faults: Faults) -> String {
    let mut faulty = FaultRewriter {
        version: nft.version,
        in_ip6_table: false,
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines().map(without_expiry) {
        let line = match faults {
            Faults::Tolerated => faulty.line(&line),
            Faults::Strict => Some(line),
        };
        if let Some(l) = line {
            out.push_str(&l);
            out.push('\n');
        }
    }
    out
}

/// Drops ` expires <time>` from a dynamic set's elements: the time left changes while we look. The reloaded
/// element gets its full timeout again, so it cannot expire between the reload and the second listing.
fn without_expiry(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(i) = rest.find(" expires ") {
        out.push_str(&rest[..i]);
        let time = &rest[i + " expires ".len()..];
        let end = time
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '.'))
            .unwrap_or(time.len());
        rest = &time[end..];
    }
    out.push_str(rest);
    // nft 1.1 notes how many elements a dynamic set holds (`size 65535\t# count 2`): live, like the expiry.
    if let Some(i) = out.find("\t# count ") {
        out.truncate(i);
    }
    out
}

/// What one nft run left: its output and how it ended.
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

fn run(ns: &NetNs, nft: &Nft, args: &[&str]) -> Run {
    run_with_input(ns, nft, args, "")
}

/// `nft ARGS` in `ns` with `input` on its stdin (`-f -` reads it: nft's messages then say `/dev/stdin:LINE`,
/// the same for the same fault every time).
fn run_with_input(ns: &NetNs, nft: &Nft, args: &[&str], input: &str) -> Run {
    use std::io::Write;
    let mut child = ns
        .command(&nft.program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", nft.label()));
    // Written on a thread of its own, so that a large input never waits on output nobody reads yet.
    let mut stdin = child.stdin.take().expect("nft's stdin");
    let input = input.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("running {}: {e}", nft.label()));
    // nft may exit without reading everything (an early fatal error): a broken pipe is not our failure.
    let _ = writer.join();
    Run {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A failed run (non-zero exit, a signal such as an assertion's abort) or one that wrote to stderr.
fn run_problem(nft: &Nft, what: &str, r: &Run) -> Option<String> {
    let ended = match (r.status.code(), r.status.signal()) {
        (Some(0), _) if r.stderr.is_empty() => return None,
        (Some(0), _) => "exited 0 but wrote to stderr".to_string(),
        (Some(c), _) => format!("exited {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        (None, None) => "ended abnormally".to_string(),
    };
    Some(format!(
        "{}: `{what}` {ended}:\n{}",
        nft.label(),
        r.stderr.trim_end()
    ))
}

/// Everything wrong with `ns`'s ruleset under every nft (empty: the invariant holds).
pub fn listing_problems(ns: &NetNs, faults: Faults) -> Vec<String> {
    let scratch = NetNs::create(&unique_name("nk-reload")).expect("creating a scratch namespace");
    nfts()
        .iter()
        .flat_map(|nft| problems_with(ns, nft, &scratch, faults))
        .collect()
}

fn problems_with(ns: &NetNs, nft: &Nft, scratch: &NetNs, faults: Faults) -> Vec<String> {
    let text = run(ns, nft, &["list", "ruleset"]);
    let json = run(ns, nft, &["-j", "list", "ruleset"]);
    let json_problem = match faults {
        Faults::Tolerated
            if json.status.code() == Some(0)
                && tolerated_stderr(nft, "nft -j list ruleset", &json.stderr) =>
        {
            None
        }
        _ => run_problem(nft, "nft -j list ruleset", &json),
    };
    let mut problems: Vec<String> = [run_problem(nft, "nft list ruleset", &text), json_problem]
        .into_iter()
        .flatten()
        .collect();
    if text.status.success() {
        problems.extend(reload_problem(nft, &text.stdout, scratch, faults));
    }
    problems
}

/// Loads `listing` into the (flushed) scratch namespace and lists it again: it must load, and list the same.
fn reload_problem(nft: &Nft, listing: &str, scratch: &NetNs, faults: Faults) -> Option<String> {
    let flush = run(scratch, nft, &["flush", "ruleset"]);
    if let Some(p) = run_problem(nft, "nft flush ruleset (scratch namespace)", &flush) {
        return Some(p);
    }
    let want = rewrite(nft, listing, faults);
    let load = run_with_input(scratch, nft, &["-f", "-"], &want);
    if let Some(p) = run_problem(nft, "nft -f <its own listing>", &load) {
        return Some(format!("{p}\nthe listing it could not reload:\n{want}"));
    }
    let again = run(scratch, nft, &["list", "ruleset"]);
    if let Some(p) = run_problem(nft, "nft list ruleset (reloaded)", &again) {
        return Some(p);
    }
    first_difference(&want, &rewrite(nft, &again.stdout, faults)).map(|d| {
        format!(
            "{}: the reloaded listing differs: {d}\nlisting:\n{want}",
            nft.label()
        )
    })
}

fn first_difference(want: &str, got: &str) -> Option<String> {
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let i = (0..w.len().max(g.len())).find(|&i| w.get(i) != g.get(i))?;
    Some(format!(
        "line {}: listed {:?}, after reload {:?}",
        i + 1,
        w.get(i).unwrap_or(&"<end>"),
        g.get(i).unwrap_or(&"<end>")
    ))
}

/// Panics with every problem unless `ns`'s ruleset lists and reloads under every nft. Without oracles
/// (`NFTKUBE_NO_ORACLE=1`: no nft binary at all) there is nothing to run and it checks nothing.
#[track_caller]
pub fn assert_listable(ns: &NetNs) {
    if !crate::oracles() {
        return;
    }
    let problems = listing_problems(ns, Faults::Tolerated);
    assert!(
        problems.is_empty(),
        "the ruleset in {} breaks the listing invariant:\n{}",
        ns.name(),
        problems.join("\n\n")
    );
}

/// Checks the listing invariant after every sync an agent logs ("sync complete"), on a thread of its own, so
/// that every test running the agent checks each state it programs without a line of its own. A state may be
/// replaced before it is listed (two syncs in quick succession); each listing is of a state the agent committed.
pub struct ListingWatch {
    stop: Arc<AtomicBool>,
    checked: Arc<Mutex<Checked>>,
    thread: Option<JoinHandle<()>>,
    ns: NetNs,
}

/// How many of the agent's syncs have been followed by a check, and what the checks found (each distinct
/// problem once, with the sync after which it first showed).
#[derive(Default)]
struct Checked {
    syncs: usize,
    problems: Vec<(usize, String)>,
}

impl Checked {
    fn record(&mut self, sync: usize, problems: Vec<String>) {
        self.syncs = self.syncs.max(sync);
        for p in problems {
            // What failed and nft's first line about it: the same fault again after a later sync is not news.
            let head: String = p.lines().take(2).collect::<Vec<_>>().join("\n");
            if !self.problems.iter().any(|(_, q)| q.starts_with(&head)) {
                self.problems.push((sync, p));
            }
        }
    }

    fn report(&self) -> Vec<String> {
        self.problems
            .iter()
            .map(|(n, p)| format!("after sync {n}: {p}"))
            .collect()
    }
}

/// How long a test waits for the listing check of a sync.
const LISTING_CHECK: Duration = Duration::from_secs(90);

impl ListingWatch {
    /// None without oracles (no nft to run). Resolves the nfts here, so a missing newest nft fails the test.
    pub fn start(ns: &NetNs, log: PathBuf) -> Option<ListingWatch> {
        if !crate::oracles() {
            return None;
        }
        nfts();
        let handle = || NetNs::open_existing(ns.name()).expect("opening the agent's namespace");
        let (stop, checked) = (Arc::new(AtomicBool::new(false)), Arc::default());
        let thread = {
            let (stop, checked, ns) = (Arc::clone(&stop), Arc::clone(&checked), handle());
            std::thread::spawn(move || watch(&ns, &log, &stop, &checked))
        };
        Some(ListingWatch {
            stop,
            checked,
            thread: Some(thread),
            ns: handle(),
        })
    }

    /// Waits until the state after sync `n` (or a later one) has been checked; panics with the problems found.
    #[track_caller]
    pub fn assert_checked(&self, n: usize) {
        // Listing, reloading and listing again a state of hundreds of services takes tens of seconds under
        // the VM matrix's software emulation.
        crate::wait_until(LISTING_CHECK, || self.checked.lock().unwrap().syncs >= n)
            .unwrap_or_else(|_| {
                panic!("the listing check after sync {n} did not happen within {LISTING_CHECK:?}")
            });
        let problems = self.checked.lock().unwrap().report();
        assert!(
            problems.is_empty(),
            "the agent programmed states that break the listing invariant:\n{}",
            problems.join("\n\n")
        );
    }

    /// Stops watching and checks the current state (the agent has exited: what it leaves behind); every
    /// problem found since the start.
    pub fn finish(mut self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut checked = self.checked.lock().unwrap();
        let last = checked.syncs + 1;
        checked.record(last, listing_problems(&self.ns, Faults::Tolerated));
        checked.report()
    }
}

impl Drop for ListingWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn watch(ns: &NetNs, log: &Path, stop: &AtomicBool, checked: &Mutex<Checked>) {
    let (mut offset, mut syncs) = (0u64, 0usize);
    while !stop.load(Ordering::Relaxed) {
        syncs += new_syncs(log, &mut offset);
        if syncs > checked.lock().unwrap().syncs {
            let problems = listing_problems(ns, Faults::Tolerated);
            checked.lock().unwrap().record(syncs, problems);
        } else {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// "sync complete" lines the log gained since `offset` (complete lines only; `offset` moves past them).
fn new_syncs(log: &Path, offset: &mut u64) -> usize {
    let Ok(mut f) = std::fs::File::open(log) else {
        return 0;
    };
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(*offset)).is_err() || f.read_to_end(&mut buf).is_err() {
        return 0;
    }
    let Some(end) = buf.iter().rposition(|&b| b == b'\n') else {
        return 0;
    };
    *offset += end as u64 + 1;
    String::from_utf8_lossy(&buf[..end])
        .matches("sync complete")
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_is_dropped_with_its_time_only() {
        assert_eq!(
            without_expiry(
                "elements = { 1.2.3.4 timeout 3s expires 2s970ms, 5.6.7.8 timeout 3s expires 1s }"
            ),
            "elements = { 1.2.3.4 timeout 3s, 5.6.7.8 timeout 3s }"
        );
        assert_eq!(without_expiry("\t\tflags timeout"), "\t\tflags timeout");
    }

    #[test]
    fn only_the_long_ip6_map_update_is_left_out_and_only_for_1_0() {
        let listing = "table ip t {\n\tchain a {\n\t\tupdate @m { ip saddr : ip daddr . th dport }\n\t}\n}\ntable ip6 t {\n\tchain a {\n\t\tmeta l4proto { tcp, udp, sctp } update @affinity { ip6 saddr timeout 3h : ip6 daddr . th dport }\n\t\taccept\n\t}\n}\n";
        let old = |v| {
            let mut r = FaultRewriter {
                version: v,
                in_ip6_table: false,
            };
            listing.lines().filter_map(|l| r.line(l)).count()
        };
        assert_eq!(old((1, 0, 6)), listing.lines().count() - 1);
        assert_eq!(old((1, 1, 7)), listing.lines().count());
    }
}
