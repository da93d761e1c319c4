//! The `nftkube` binary: the agent (`proxy`), the CNI portmap plugin, the tracer and the tools around them,
//! one command line over the library.

mod cli;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};
use cli::{Cli, Command, Tool};
use nftkube::config;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::Ordering;

/// Writes a line to stderr. A stderr that cannot be written is ignored: `eprintln!` would panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// The library's flag: every netlink wait in progress watches it.
use nftkube::netlink::SHUTDOWN;

/// Blocks SIGTERM and SIGINT in this thread and in every thread started from it afterwards, so that they
/// stay pending until the thread of `forward_stop_signals` takes them with sigwait: outside a signal
/// handler, where it may wake the proxy loop.
fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: the set is initialised by sigemptyset before use; pthread_sigmask only changes this thread's
    // mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Takes the blocked stop signals on a thread of its own: the first runs `stop` (a graceful stop, which may
/// still wait on netlink for a while); a second one exits at once, with `what_is_left` on stderr.
fn on_stop_signals(
    set: libc::sigset_t,
    stop: impl FnOnce(i32) + Send + 'static,
    what_is_left: &'static str,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut stop = Some(stop);
            loop {
                let mut sig = 0;
                // SAFETY: `set` is a valid, initialised signal set; `sig` is a valid out pointer.
                if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                    continue;
                }
                match stop.take() {
                    Some(stop) => stop(sig),
                    None => {
                        // Not eprintln!, which panics where stderr cannot be written, and would not exit.
                        let _ = writeln!(
                            std::io::stderr(),
                            "nftkube: second signal {sig}: exiting now{what_is_left}"
                        );
                        std::process::exit(1);
                    }
                }
            }
        })
        .map(drop)
}

/// The first stop signal stops the proxy (netlink waits end within their slice, the loop wakes at once); a
/// second one exits at once.
fn forward_stop_signals(
    set: libc::sigset_t,
    stop: nftkube::agent::StopHandle,
) -> std::io::Result<()> {
    let stop_proxy = move |sig| {
        tracing::info!(signal = sig, "stop requested");
        SHUTDOWN.store(true, Ordering::SeqCst);
        stop.stop();
    };
    on_stop_signals(set, stop_proxy, "")
}

/// Probes what needs more than CAP_NET_ADMIN, drops every other capability, then runs the proxy loop.
///
/// The drop happens here, on the main thread while every other thread is reduced already (the conntrack
/// probe's thread drops its own first; the signal thread is started after it, the source, monitor and admin
/// threads by `run_proxy`), so every thread inherits the reduced sets. Not in `run_proxy`: the demo
/// (`nftkube-demo`, of the nftkube-sandbox package) and the tests run that inside a process that keeps its
/// privileges, to build and remove network namespaces around it.
fn start_proxy(
    mut opts: nftkube::agent::ProxyOptions,
    startup: &cli::Startup,
    signals: libc::sigset_t,
) -> anyhow::Result<()> {
    nftkube::process::one_heap_per_cpu();
    // What kube-proxy does with its privileges before it proxies. A sysctl that cannot be written (a
    // read-only /proc/sys, the table size from a network namespace not the host's) is warned about: the
    // DaemonSet's privileged init container (`--init-only`) is where it must succeed.
    for outcome in set_conntrack_sysctls(&startup.conntrack) {
        if outcome.failed() {
            tracing::warn!(
                "conntrack: {outcome} (run `nftkube proxy --init-only` with privileges first, or set the \
                 conntrack settings to 0 to leave the kernel's values)"
            );
        }
    }
    if let Err(e) = nftkube::process::set_oom_score_adj(startup.oom_score_adj) {
        tracing::debug!("oom_score_adj {} not applied: {e}", startup.oom_score_adj);
    }
    let ports = opts
        .admin
        .iter()
        .flat_map(|a| [a.healthz, a.metrics])
        .flatten()
        .map(|a| a.port());
    let keep = nftkube::process::privs::needed(ports);
    // The conntrack probe creates a scratch network namespace (CAP_SYS_ADMIN): its thread does that, then
    // drops to `keep` itself before this returns, so every thread is reduced after the drop below; the rest
    // of the probe waits for the source's first snapshot and overlaps the first sync.
    let drop_probe_thread = move || {
        nftkube::process::privs::drop_to(keep)
            .map(drop)
            .map_err(|e| format!("dropping capabilities: {e}"))
    };
    opts.conntrack_probe = Some(nftkube::conntrack::PendingFeatures::start(
        drop_probe_thread,
    ));
    let dropped = nftkube::process::privs::drop_to(keep)
        .map_err(|e| anyhow::anyhow!("dropping capabilities: {e}"))?;
    tracing::info!(
        kept = format!("{:#x}", dropped.kept),
        bounding = format!("{:#x}", dropped.bounding),
        "capabilities dropped (kept: CAP_NET_ADMIN, and CAP_NET_BIND_SERVICE for a healthz or metrics port below 1024); no_new_privs set"
    );
    let (stop, inbox) = nftkube::agent::Inbox::new();
    if let Some(path) = &startup.config_file {
        let stop = stop.clone();
        nftkube::config::on_config_change(path.clone(), nftkube::config::WATCH_PERIOD, move || {
            tracing::warn!("the configuration file changed: stopping, to be started again with it");
            CONFIG_CHANGED.store(true, Ordering::SeqCst);
            stop.stop();
        })
        .with_context(|| format!("watching --config {}", path.display()))?;
    }
    forward_stop_signals(signals, stop)?;
    nftkube::agent::run_proxy(&opts, inbox)?;
    // kube-proxy's answer to a new configuration: exit with an error, so that the DaemonSet restarts it.
    anyhow::ensure!(
        !CONFIG_CHANGED.load(Ordering::SeqCst),
        "content of the configuration file was updated"
    );
    Ok(())
}

/// Set when the configuration file changed: the agent stopped for that, and exits 1.
static CONFIG_CHANGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The conntrack sysctls, each as it went (logged at info when set, at debug when already in place).
fn set_conntrack_sysctls(
    settings: &nftkube::conntrack::sysctls::Settings,
) -> Vec<nftkube::conntrack::sysctls::Outcome> {
    use nftkube::conntrack::sysctls;
    let root = std::path::Path::new("/");
    let outcomes = sysctls::apply(settings, root, sysctls::online_cpus(root));
    for o in &outcomes {
        match o {
            sysctls::Outcome::Set { .. } => tracing::info!("conntrack: {o}"),
            sysctls::Outcome::Kept(_) => tracing::debug!("conntrack: {o}"),
            sysctls::Outcome::Failed { .. } => {}
        }
    }
    outcomes
}

/// `nftkube proxy --init-only`: the conntrack sysctls, each of which must succeed.
fn init_only(settings: &nftkube::conntrack::sysctls::Settings) -> anyhow::Result<()> {
    let failed: Vec<String> = set_conntrack_sysctls(settings)
        .iter()
        .filter(|o| o.failed())
        .map(ToString::to_string)
        .collect();
    anyhow::ensure!(failed.is_empty(), "--init-only: {}", failed.join("; "));
    tracing::info!("initialised; the agent can now run with CAP_NET_ADMIN alone");
    Ok(())
}

/// `nftkube proxy --cleanup`, as kube-proxy's: what every mode of the proxy left (nftkube's tables, and
/// kube-proxy's own state), then exit.
fn cleanup_everything() -> anyhow::Result<()> {
    let removed = nftkube::agent::cleanup()?;
    say!("removed {removed} nftkube table(s)");
    cleanup_kube_proxy()
}

/// An invalid flag value: kube-proxy-style exit code 64 (EX_USAGE).
fn usage_error(e: &str) -> ExitCode {
    say!("nftkube: {e}");
    ExitCode::from(64)
}

/// `nftkube trace`: the trace on stdout; bad arguments exit 64, a failed trace 1.
fn run_trace(args: &cli::trace::TraceArgs) -> ExitCode {
    let result = if args.live {
        // Ctrl-C or SIGTERM ends the wait; the trace table is removed and what was seen is printed.
        // A second one exits at once, while the removal may still wait on netlink.
        let set = block_stop_signals();
        let started = on_stop_signals(
            set,
            |_| nftkube::trace::live::STOP.store(true, Ordering::SeqCst),
            " (the trace table may be left behind: `nftkube cleanup --traces` removes it)",
        );
        if let Err(e) = started {
            say!("nftkube trace: starting the signal thread: {e}");
            return ExitCode::FAILURE;
        }
        cli::trace::run_live(args)
    } else {
        cli::trace::run_offline(args)
    };
    match result {
        Ok(out) => match std::io::stdout().write_all(out.as_bytes()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                say!("nftkube trace: writing the trace: {e}");
                ExitCode::FAILURE
            }
        },
        Err(nftkube::trace::TraceError::Usage(e)) => usage_error(&e),
        Err(e) => {
            say!("nftkube trace: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `nftkube cleanup --kube-proxy`: one line per family, then what lies outside nf_tables. A family that failed
/// changed nothing, and fails the command once the other family has had its turn.
fn cleanup_kube_proxy() -> anyhow::Result<()> {
    let mut failed = 0;
    for outcome in nftkube::agent::cleanup_kube_proxy()? {
        match outcome {
            Ok(report) => say!("kube-proxy {report}"),
            Err(e) => {
                failed += 1;
                say!("kube-proxy: {e:#}");
            }
        }
    }
    for line in nftkube::agent::outside_nf_tables() {
        say!("kube-proxy outside nf_tables, not removed: {line}");
    }
    anyhow::ensure!(
        failed == 0,
        "{failed} family(ies) not cleaned up: nothing of them was changed"
    );
    Ok(())
}

fn main() -> ExitCode {
    // A CNI plugin is run by its file name (a symlink or a copy named portmap or nftkube-portmap).
    if std::env::args_os()
        .next()
        .is_some_and(|argv0| nftkube::portmap::invoked_as_plugin(&argv0))
    {
        return ExitCode::from(nftkube::portmap::main());
    }
    // Invalid flags exit with 64, as invalid configuration does; --help and --version with 0.
    let matches = match Cli::command().try_get_matches() {
        Ok(m) => m,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(64)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(64);
        }
    };
    let log_level = cli.log_level.clone();
    let verbosity = cli.verbosity;
    let proxy = matches.subcommand_matches("proxy");
    match cli.command {
        Command::Proxy(args) => run_proxy(&args, proxy, log_level.as_deref(), verbosity),
        Command::Tool(command) => {
            let logging = config::Logging {
                verbosity: verbosity.unwrap_or(0),
                json: false,
            };
            init_logging(log_level.as_deref(), logging);
            run_tool(command)
        }
    }
}

/// `nftkube proxy`: its options resolved (exit 64 when they are invalid), logging set up as they say, then
/// `--cleanup`, `--init-only`, or the agent.
fn run_proxy(
    args: &cli::ProxyArgs,
    matches: Option<&clap::ArgMatches>,
    log_level: Option<&str>,
    verbosity: Option<u32>,
) -> ExitCode {
    // A flag given on the command line overrides the config file; a default does not.
    let given = |id: &str| {
        matches.and_then(|m| m.value_source(id)) == Some(clap::parser::ValueSource::CommandLine)
    };
    let cli_given = cli::Given {
        given: &given,
        verbosity,
        without_effect: matches
            .map(cli::kube_proxy::given_without_effect)
            .unwrap_or_default(),
    };
    let (opts, startup) = match args.options(&cli_given) {
        Ok(o) => o,
        Err(e) => return usage_error(&e.to_string()),
    };
    init_logging(log_level, startup.logging);
    for w in &startup.warnings {
        tracing::warn!("config: {w}");
    }
    if args.kube_proxy.cleanup == Some(true) {
        return exit_with(cleanup_everything());
    }
    if args.kube_proxy.init_only == Some(true) {
        return exit_with(init_only(&startup.conntrack));
    }
    // The long-running agent only, where a thread that dies alone leaves it half alive; the other
    // commands end on their own, and `trace --live` must unwind to remove its trace table.
    nftkube::agent::exit_on_panic();
    let signals = block_stop_signals();
    exit_with(start_proxy(opts, &startup, signals))
}

/// The other commands than `proxy`.
fn run_tool(command: Tool) -> ExitCode {
    let result = match command {
        Tool::Plan(args) => {
            let cfg = match args.render.render_config() {
                Ok(cfg) => cfg,
                Err(e) => return usage_error(&e.to_string()),
            };
            let Some(manifests) = args.render.manifests.clone() else {
                return usage_error("plan needs --manifests DIR");
            };
            let tables = nftkube::agent::plan(manifests, &cfg, |e| say!("error: {e}"));
            // A closed stdout (`nftkube plan | head`) ends the plan with an error, not a panic.
            let mut out = std::io::stdout().lock();
            tables.iter().try_for_each(|t| {
                out.write_all(nftkube::nft::text::render_table(t).as_bytes())
                    .context("writing the plan")
            })
        }
        Tool::Trace(args) => return run_trace(&args),
        Tool::Cleanup(args) if args.kube_proxy => cleanup_kube_proxy(),
        Tool::Cleanup(args) => {
            let removed = if args.traces {
                nftkube::agent::cleanup_abandoned_traces()
            } else {
                nftkube::agent::cleanup()
            };
            removed.map(|n| say!("removed {n} table(s)"))
        }
        Tool::Portmap => return ExitCode::from(nftkube::portmap::main()),
        Tool::Version => {
            let _ = writeln!(std::io::stdout(), "nftkube {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
    };
    exit_with(result)
}

/// Success, or the error on stderr and exit code 1.
fn exit_with(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say!("nftkube: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr at `--log-level`, else at what `-v` (or the file's verbosity) says, as text or JSON lines.
///
/// A log that cannot be written (its pipe's reader gone: a collector restarting) is lost, and nothing
/// else. tracing-subscriber would report the failed write with `eprintln!`, which panics on that same
/// stderr: the thread that logged died with it (the proxy loop, the API watcher, the signal thread).
fn init_logging(log_level: Option<&str>, logging: config::Logging) {
    let level = log_level
        .and_then(|l| l.parse().ok())
        .unwrap_or(match logging.verbosity {
            0..=2 => tracing::Level::INFO,
            3..=4 => tracing::Level::DEBUG,
            _ => tracing::Level::TRACE,
        });
    let fmt = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .log_internal_errors(false);
    if logging.json {
        fmt.json().flatten_event(true).init();
    } else {
        fmt.init();
    }
}
