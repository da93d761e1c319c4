//! `nftkube-demo`: README's first command (`cargo run --release -p nftkube-sandbox`, from the repository root).
//! Builds a sandbox of network namespaces, runs the agent in it on the manifests, sends traffic, tears down.
//!
//! A binary of the sandbox package rather than a subcommand of `nftkube`: the product ships no test rig.

mod demo;

use clap::Parser;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "nftkube-demo",
    version,
    about = "Build a sandbox of network namespaces, run the nftkube agent in it on the manifests, send traffic, \
             tear down (root; the host's own namespace is never touched)"
)]
/// The demo's flags.
struct Args {
    /// Manifests to load into the sandbox's node.
    #[arg(long, default_value = "examples")]
    manifests: PathBuf,
    /// Connections (and datagrams) to send through each ClusterIP.
    #[arg(long, default_value_t = 30)]
    requests: usize,
    /// The agent's log level: error, warn, info, debug, trace.
    #[arg(long, default_value = "info")]
    log_level: tracing::Level,
}

fn main() -> ExitCode {
    let args = Args::parse();
    // The agent logs through tracing, as `nftkube proxy` does; the same subscriber, for the same reason: a log
    // that cannot be written is lost, and nothing else (tracing-subscriber would report the failed write with
    // `eprintln!`, which panics on that same stderr).
    tracing_subscriber::fmt()
        .with_max_level(args.log_level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .log_internal_errors(false)
        .init();
    // Unlike `nftkube proxy`: no exit on a thread's panic (a panic must unwind, so that the sandbox is dropped
    // and its namespaces removed), no capabilities dropped (the demo builds and removes namespaces around the
    // agent), no heap tuning (it runs for seconds).
    match demo::run(&args.manifests, args.requests) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!, which panics where stderr cannot be written.
            let _ = writeln!(std::io::stderr(), "nftkube-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}
