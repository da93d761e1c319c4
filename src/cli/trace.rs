//! The `nftkube trace` command line, and running it: which ruleset, which packet, which output. The tracer
//! itself (`nftkube::trace`) takes plain requests and knows nothing of the command line.

// clap turns the doc comments below into `--help` text, where `[IPv6]:PORT` and `[::1]` are meant
// literally, not as links.
#![allow(rustdoc::broken_intra_doc_links)]

use super::RenderArgs;
use clap::Args;
use nftkube::trace::live::{Filter, LiveRequest};
use nftkube::trace::packet::{parse_endpoint, DEFAULT_SOURCE_PORT};
use nftkube::trace::{
    kernel_ruleset, node_context, render_text, trace, Attribution, FromModel, KeysOnly,
    NodeContext, Origin, Packet, Proto, Request, Ruleset, TraceError,
};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// `nftkube trace`'s arguments: the packet, where the ruleset comes from, live mode and output.
#[derive(Debug, Args)]
pub(crate) struct TraceArgs {
    /// The packet's source: IP[:PORT] ([IPv6]:PORT); the port defaults to 40000.
    #[arg(long, value_parser = parse_src)]
    pub src: Source,
    /// The packet's destination: IP:PORT ([IPv6]:PORT).
    #[arg(long, value_parser = parse_dst)]
    pub dst: SocketAddr,
    /// tcp, udp or sctp.
    #[arg(long, value_parser = Proto::parse)]
    pub proto: Proto,
    /// The interface the packet arrives on (what `iifname` rules see).
    #[arg(long)]
    pub iif: Option<String>,
    /// Where the packet comes from: pod, node or outside [default: node when --src is a local address,
    /// else outside].
    #[arg(long, value_parser = Origin::parse)]
    pub from: Option<Origin>,
    /// This node's addresses, comma-separated (what `fib ... type local` and routing treat as local)
    /// [default: this network namespace's].
    #[arg(long, value_delimiter = ',')]
    pub node_ip: Vec<IpAddr>,
    /// Output: text or json.
    #[arg(short = 'o', long, default_value = "text", value_parser = ["text", "json"])]
    pub output: String,
    /// Ask the kernel: add a narrowly matching `meta nftrace set 1` rule in a table of its own and print the
    /// trace events of the next matching packets (real ones: send them yourself). Needs root. Ctrl-C stops
    /// and removes the table; a second Ctrl-C exits at once and may leave it (`nftkube cleanup --traces`).
    #[arg(long)]
    pub live: bool,
    /// --live: stop after this many packets.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub count: u64,
    /// --live: stop after this long ("10s", or seconds).
    #[arg(long, default_value = "10s", value_parser = nftkube::config::parse_duration_flag)]
    pub timeout: Duration,
    /// Render the plan from --manifests (and the usual proxy flags) instead of reading the kernel.
    #[command(flatten)]
    pub render: RenderArgs,
}

/// `--src`: the address, and whether the port was given (`--live` matches the source port only then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Source {
    /// The address, with the default port when none was given.
    pub addr: SocketAddr,
    /// Whether the port was given.
    pub port_given: bool,
}

fn parse_src(s: &str) -> Result<Source, String> {
    let port_given = parse_endpoint(s, None).is_ok();
    parse_endpoint(s, Some(DEFAULT_SOURCE_PORT)).map(|addr| Source { addr, port_given })
}

fn parse_dst(s: &str) -> Result<SocketAddr, String> {
    parse_endpoint(s, None)
}

impl TraceArgs {
    /// Checks what clap cannot: arguments that only make sense together.
    pub(crate) fn validate(&self) -> Result<(), TraceError> {
        if self.src.addr.is_ipv4() != self.dst.is_ipv4() {
            return Err(TraceError::Usage(format!(
                "--src {} and --dst {} are of different IP families",
                self.src.addr.ip(),
                self.dst.ip()
            )));
        }
        if self.live && self.render.manifests.is_some() {
            return Err(TraceError::Usage(
                "--live traces the kernel's state; it cannot be combined with --manifests".into(),
            ));
        }
        if let Some(iif) = &self.iif {
            if iif.is_empty() || iif.len() >= 16 {
                return Err(TraceError::Usage(format!(
                    "--iif {iif:?}: an interface name has 1 to 15 bytes"
                )));
            }
        }
        Ok(())
    }

    /// The `--live` request these arguments make (validated).
    fn live_request(&self) -> Result<LiveRequest, TraceError> {
        self.validate()?;
        Ok(LiveRequest {
            filter: Filter {
                src: self.src.addr.ip(),
                src_port: self.src.port_given.then_some(self.src.addr.port()),
                dst: self.dst,
                proto: self.proto,
                iif: self.iif.clone(),
            },
            count: self.count,
            timeout: self.timeout,
            json: self.output == "json",
        })
    }

    fn packet(&self) -> Packet {
        Packet {
            src: self.src.addr,
            dst: self.dst,
            proto: self.proto,
            mark: 0,
            iif: self.iif.clone(),
        }
    }
}

/// Runs `--live` (the kernel's own trace events) and returns its output (text or JSON).
pub(crate) fn run_live(args: &TraceArgs) -> Result<String, TraceError> {
    nftkube::trace::live::run(&args.live_request()?)
}

/// Runs an offline trace and returns its output (text or JSON).
pub(crate) fn run_offline(args: &TraceArgs) -> Result<String, TraceError> {
    args.validate()?;
    let packet = args.packet();
    let (ruleset, attribution, node) = match &args.render.manifests {
        Some(dir) => manifests_ruleset(args, dir)?,
        None => (
            kernel_ruleset(packet.family())?,
            Box::new(KeysOnly) as Box<dyn Attribution>,
            node_context(&args.node_ip)?,
        ),
    };
    let origin = args.from.unwrap_or(if node.is_local(&args.src.addr.ip()) {
        Origin::Node
    } else {
        Origin::Outside
    });
    let req = Request { packet, origin };
    let mut t = trace(&ruleset, &req, &node, attribution.as_ref())?;
    if args.from.is_none() {
        t.assumptions.push(format!(
            "from {} (--from not given; --src {} is {}a local address)",
            origin.as_str(),
            args.src.addr.ip(),
            if origin == Origin::Node { "" } else { "not " }
        ));
    }
    Ok(if args.output == "json" {
        serde_json::to_string_pretty(&t).map_err(|e| TraceError::Output(e.to_string()))? + "\n"
    } else {
        render_text(&t)
    })
}

/// The plan `nftkube plan` would print for these flags, with the model for attribution.
fn manifests_ruleset(
    args: &TraceArgs,
    dir: &std::path::Path,
) -> Result<(Ruleset, Box<dyn Attribution>, NodeContext), TraceError> {
    let mut cfg = args
        .render
        .render_config()
        .map_err(|e| TraceError::Usage(e.to_string()))?;
    if !args.node_ip.is_empty() {
        cfg.node_ips = args.node_ip.clone();
    }
    let mut source = nftkube::source::ManifestSource::new(dir.to_path_buf());
    let (events, errors) = source.initial();
    let notes: Vec<String> = errors
        .iter()
        .map(|e| format!("manifest error (that object left out): {e}"))
        .collect();
    let mut state = nftkube::model::ClusterState::new();
    for ev in events {
        nftkube::source::apply_event(&mut state, ev);
    }
    let tables = nftkube::render::render(state.service_map(), &state.endpoints_map(), &cfg);
    let node = NodeContext {
        local_addresses: cfg.node_ips.clone(),
        source: if args.node_ip.is_empty() {
            "this network namespace's addresses, and loopback".into()
        } else {
            "from --node-ip".into()
        },
    };
    Ok((
        Ruleset {
            tables,
            description: format!("the plan rendered from {} (no kernel read)", dir.display()),
            notes,
        },
        Box::new(FromModel::new(state.service_map())),
        node,
    ))
}
