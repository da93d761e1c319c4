//! UDP conntrack entries of a host port, deleted by exact tuple through ctnetlink.
//!
//! UDP has no teardown: a client that keeps sending to a host port stays glued to its conntrack entry, and so
//! to the container the entry was DNATed to (or to none, when it was created before the mapping existed).
//! After ADD and DEL commit, the entries whose original destination is the host port on a local address (or
//! the mapping's node address) are deleted, so the next packet is NATed by the new state. Entries towards
//! the same port on remote hosts (the node's own DNS queries to port 53, say) are left alone.

use nftkube_conntrack::wire::IPPROTO_UDP;
use nftkube_conntrack::{CtSocket, DumpFilter, Entry};
use std::collections::BTreeSet;
use std::net::IpAddr;

/// A published UDP port: the node address it is bound to (None: every local address) and the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct HostPort {
    /// IPv6.
    pub(crate) v6: bool,
    /// The mapping's `hostIP` (None: any local address).
    pub(crate) host_ip: Option<IpAddr>,
    /// The host port.
    pub(crate) port: u16,
}

/// Whether an entry was sent to `hp`, given the node's local addresses.
fn sent_to(e: &Entry, hp: &HostPort, local: &BTreeSet<IpAddr>) -> bool {
    e.orig.proto == IPPROTO_UDP
        && e.orig.dport == hp.port
        && e.orig.dst.is_ipv6() == hp.v6
        && match hp.host_ip {
            Some(ip) => e.orig.dst == ip,
            None => e.orig.dst.is_loopback() || local.contains(&e.orig.dst),
        }
}

/// Why clearing a host port's UDP flows failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClearError {
    /// The node's addresses (which tell `hostIP`-less mappings' destinations) could not be read.
    #[error("reading the node's addresses: {0}")]
    NodeAddresses(std::io::Error),
    /// The ctnetlink socket did not open.
    #[error("opening ctnetlink: {0}")]
    Socket(std::io::Error),
    /// The dump of one family's UDP entries failed.
    #[error("dumping UDP conntrack entries: {0}")]
    Dump(nftkube_netlink::NetlinkError),
    /// The delete batch failed as a whole.
    #[error("deleting conntrack entries: {0}")]
    Delete(nftkube_netlink::NetlinkError),
    /// The kernel refused to delete one entry.
    #[error("deleting conntrack entry {entry}: {error}")]
    Entry {
        /// The entry's original tuple.
        entry: String,
        /// The kernel's answer.
        error: String,
    },
}

/// Deletes the entries sent to any of `ports`; returns how many were deleted.
pub(crate) fn clear(ports: &[HostPort]) -> Result<usize, ClearError> {
    if ports.is_empty() {
        return Ok(0);
    }
    let local: BTreeSet<IpAddr> = nftkube_node::addresses()
        .map_err(ClearError::NodeAddresses)?
        .into_iter()
        .map(|a| a.ip)
        .collect();
    let mut sock = CtSocket::open().map_err(ClearError::Socket)?;
    let mut stale = Vec::new();
    for v6 in [false, true] {
        if !ports.iter().any(|p| p.v6 == v6) {
            continue;
        }
        let af = if v6 { libc::AF_INET6 } else { libc::AF_INET } as u8;
        let filter = DumpFilter::proto(af, IPPROTO_UDP);
        sock.dump(&filter, |e| {
            // Kernels before 5.8 ignore the dump filter: check it again here.
            if filter.matches(&e) && ports.iter().any(|p| sent_to(&e, p, &local)) {
                stale.push(e);
            }
        })
        .map_err(ClearError::Dump)?;
    }
    let outcome = sock.delete(&stale).map_err(ClearError::Delete)?;
    if let Some((entry, err)) = outcome.errors.first() {
        return Err(ClearError::Entry {
            entry: entry.orig.to_string(),
            error: err.to_string(),
        });
    }
    Ok(outcome.deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nftkube_conntrack::{Tuple, ZoneScope};

    fn entry(dst: &str, dport: u16) -> Entry {
        let orig = Tuple::new(
            "10.0.0.9".parse().unwrap(),
            4000,
            dst.parse().unwrap(),
            dport,
            IPPROTO_UDP,
        );
        Entry {
            orig,
            reply: orig.inverse(),
            zone: ZoneScope::None,
            id: None,
            mark: 0,
            status: 0,
            timeout: 30,
        }
    }

    #[test]
    fn only_local_destinations_of_the_port() {
        let local: BTreeSet<IpAddr> = ["10.0.0.1".parse().unwrap()].into();
        let any = HostPort {
            v6: false,
            host_ip: None,
            port: 53,
        };
        assert!(sent_to(&entry("10.0.0.1", 53), &any, &local));
        assert!(sent_to(&entry("127.0.0.1", 53), &any, &local));
        assert!(
            !sent_to(&entry("8.8.8.8", 53), &any, &local),
            "a remote DNS server"
        );
        assert!(!sent_to(&entry("10.0.0.1", 54), &any, &local));
        let one = HostPort {
            v6: false,
            host_ip: Some("10.0.0.5".parse().unwrap()),
            port: 53,
        };
        assert!(sent_to(&entry("10.0.0.5", 53), &one, &local));
        assert!(!sent_to(&entry("10.0.0.1", 53), &one, &local));
    }
}
