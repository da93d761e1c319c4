use clap::{CommandFactory, FromArgMatches};
use nftkube::cli::{Cli, Command};
use std::process::ExitCode;
use std::sync::atomic::Ordering;

/// The library's flag: the proxy loop and every netlink wait in progress both watch it.
use nftkube::netlink::SHUTDOWN as STOP;

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// SIGTERM and SIGINT ask the proxy loop to stop at its next turn.
fn install_signal_handlers() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe; sigaction is given a
        // zeroed, fully initialised struct.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Probes what needs more than CAP_NET_ADMIN, drops every other capability, then runs the proxy loop.
///
/// The drop happens here, on the main thread while it is the only one (the conntrack probe's thread has
/// ended; the source, monitor and admin threads are spawned by `run_proxy`), so every thread inherits the
/// reduced sets. Not in `run_proxy`: `nftkube demo` and tests run that inside a process that keeps its
/// privileges.
fn start_proxy(mut opts: nftkube::agent::ProxyOptions) -> anyhow::Result<()> {
    // The probe creates a scratch network namespace (CAP_SYS_ADMIN): before the drop, never again after.
    opts.conntrack_features = Some(nftkube::conntrack::probe_features());
    let ports = opts
        .admin
        .iter()
        .flat_map(|a| [a.healthz, a.metrics])
        .flatten()
        .map(|a| a.port());
    let dropped = nftkube::privs::drop_to(nftkube::privs::needed(ports))
        .map_err(|e| anyhow::anyhow!("dropping capabilities: {e}"))?;
    tracing::info!(
        kept = format!("{:#x}", dropped.kept),
        bounding = format!("{:#x}", dropped.bounding),
        "capabilities dropped (kept: CAP_NET_ADMIN, and CAP_NET_BIND_SERVICE for a healthz or metrics port below 1024); no_new_privs set"
    );
    nftkube::agent::run_proxy(&opts, &STOP)
}

/// An invalid flag value: kube-proxy-style exit code 64 (EX_USAGE).
fn usage_error(e: &str) -> ExitCode {
    eprintln!("nftkube: {e}");
    ExitCode::from(64)
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
    let level = cli.log_level.parse().unwrap_or(tracing::Level::INFO);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let result = match cli.command {
        Command::Proxy(args) => {
            install_signal_handlers();
            let sub = matches.subcommand_matches("proxy");
            // A flag given on the command line overrides the config file; a default does not.
            let given = |id: &str| {
                sub.and_then(|m| m.value_source(id)) == Some(clap::parser::ValueSource::CommandLine)
            };
            match args.options(&given) {
                Ok(opts) => start_proxy(opts),
                Err(e) => return usage_error(&e),
            }
        }
        Command::Plan(args) => {
            let cfg = match args.render.render_config() {
                Ok(cfg) => cfg,
                Err(e) => return usage_error(&e),
            };
            let Some(manifests) = args.render.manifests.clone() else {
                return usage_error("plan needs --manifests DIR");
            };
            let tables = nftkube::agent::plan(manifests, &cfg, |e| eprintln!("error: {e}"));
            for t in tables {
                print!("{}", nftkube::nft::text::render_table(&t));
            }
            Ok(())
        }
        Command::Cleanup => nftkube::agent::cleanup().map(|n| eprintln!("removed {n} table(s)")),
        Command::Demo(args) => nftkube::demo::run(&args.manifests, args.requests),
        Command::Portmap => return ExitCode::from(nftkube::portmap::main()),
        Command::Version => {
            println!("nftkube {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nftkube: {e:#}");
            ExitCode::FAILURE
        }
    }
}
