//! The relay's flags (localhost NodePorts beside the nf_tables proxy, and `--proxy-mode userspace`).

use clap::Args;
use nftkube::config;
use nftkube::relay::RelayOptions;
use std::time::Duration;

/// Largest limit a flag may set: far beyond any descriptor limit, and small enough for any counter.
const MAX_LIMIT: u64 = 1 << 31;

#[derive(Debug, Args)]
/// The relay's limits and timeouts.
pub(crate) struct RelayArgs {
    /// The relay: a UDP flow idle this long is closed (ClientIP affinity is kept apart from flows, for the
    /// service's affinity timeout): "250ms", or seconds.
    #[arg(long, default_value = "250ms", value_parser = config::parse_duration_flag)]
    pub udp_timeout: Duration,
    /// The relay: a TCP connection that moved no byte either way this long is closed; the default is
    /// kube-proxy's conntrack timeout for established TCP connections: "24h", or seconds.
    #[arg(long, default_value = "24h", value_parser = parse_positive_duration)]
    pub relay_tcp_idle_timeout: Duration,
    /// The relay: TCP connections plus UDP flows at most; beyond it new connections are reset.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=MAX_LIMIT))]
    pub relay_max_connections: u64,
    /// The relay: TCP connections plus UDP flows of one service port at most.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..=MAX_LIMIT))]
    pub relay_max_connections_per_service: u64,
    /// The relay: TCP connections plus UDP flows from one client address at most (the node itself, on
    /// loopback, excepted).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..=MAX_LIMIT))]
    pub relay_max_connections_per_source: u64,
}

/// A duration flag that must not be zero (a zero idle timeout would close every connection at once).
fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    match config::parse_duration_flag(s) {
        Ok(d) if d.is_zero() => Err("must be more than 0".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

impl RelayArgs {
    /// Sets the relay's options from the flags.
    pub(crate) fn apply(&self, relay: &mut RelayOptions) {
        let limit = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        relay.udp_idle_timeout = self.udp_timeout;
        relay.tcp_idle_timeout = self.relay_tcp_idle_timeout;
        relay.max_connections = limit(self.relay_max_connections);
        relay.max_connections_per_service = limit(self.relay_max_connections_per_service);
        relay.max_connections_per_source = limit(self.relay_max_connections_per_source);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cmd {
        #[command(flatten)]
        relay: RelayArgs,
    }

    #[test]
    fn flags_reach_the_relay_options_and_defaults_match_the_relay_s() {
        let mut opts = RelayOptions::default();
        Cmd::parse_from(["x"]).relay.apply(&mut opts);
        assert_eq!(opts, RelayOptions::default());
        Cmd::parse_from([
            "x",
            "--relay-tcp-idle-timeout=90s",
            "--relay-max-connections-per-service=7",
            "--relay-max-connections-per-source=3",
        ])
        .relay
        .apply(&mut opts);
        assert_eq!(opts.tcp_idle_timeout, Duration::from_secs(90));
        assert_eq!(opts.max_connections_per_service, 7);
        assert_eq!(opts.max_connections_per_source, 3);
        assert!(Cmd::try_parse_from(["x", "--relay-tcp-idle-timeout=0"]).is_err());
        assert!(Cmd::try_parse_from(["x", "--relay-max-connections-per-source=0"]).is_err());
    }
}
