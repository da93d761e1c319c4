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

/// An invalid flag value: kube-proxy-style exit code 64 (EX_USAGE).
fn usage_error(e: &str) -> ExitCode {
    eprintln!("nftkube: {e}");
    ExitCode::from(64)
}

fn main() -> ExitCode {
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
                Ok(opts) => nftkube::agent::run_proxy(&opts, &STOP),
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
