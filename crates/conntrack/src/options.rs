//! What a conntrack cleanup is asked to do and what it reports: shared by the planning half
//! ([`Cleaner`](super::cleaner::Cleaner)) and the walking half ([`Walker`](super::walker::Walker)).

use super::plan::FrontendKinds;
use nftkube_netlink::NetlinkError;
use std::net::IpAddr;
use std::time::Duration;

/// How the cleaner works.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanerOptions {
    /// Frontend kinds the rules program (only those are cleaned).
    pub kinds: FrontendKinds,
    /// Node addresses NodePorts are served on (empty: all).
    pub node_port_addresses: Vec<IpAddr>,
    /// Probe the kernel's ctnetlink filters (in a throwaway namespace) and use those that work. Off: dump per
    /// address family only, which every kernel honours.
    pub probe: bool,
    /// Kernel-side dump filters (protocol, original destination) where the probe shows they work.
    pub dump_filters: bool,
    /// Kernel-side filtered deletes for "every flow to this address / frontend" targets where the probe
    /// shows the kernel honours them (6.12+). Off by default: the kernel does not say how many entries it
    /// removed (so `entries_deleted` undercounts), and it saves little: one filtered delete walks the whole
    /// table like one address-filtered dump does (measured with 100k entries: 60–140 ms with it, 66–70 ms
    /// without, depending on load).
    pub filtered_delete: bool,
    /// Per family and protocol, up to this many addresses are dumped one by one with an address filter;
    /// beyond that, one dump of the protocol. Each dump walks the whole hash table in the kernel (~30 ms at
    /// 100k entries on the test VM), so per-address dumps pay off only for a few addresses.
    pub max_address_dumps: usize,
}

impl Default for CleanerOptions {
    fn default() -> Self {
        CleanerOptions {
            kinds: FrontendKinds::CLUSTER_IP_ONLY,
            node_port_addresses: Vec::new(),
            probe: true,
            dump_filters: true,
            filtered_delete: false,
            max_address_dumps: 4,
        }
    }
}

/// What one cleanup did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Dump requests sent.
    pub dumps: usize,
    /// Entries the dumps returned (after any kernel-side filter).
    pub scanned: usize,
    /// Entries found stale.
    pub stale: usize,
    /// Stale entries deleted by exact tuple.
    pub deleted: usize,
    /// Of them, IPv6 entries.
    pub deleted_v6: usize,
    /// Stale entries that were gone by the time of the delete.
    pub gone: usize,
    /// Deletes that failed otherwise.
    pub errors: usize,
    /// Kernel-side filtered deletes sent (their deletions are not counted in `deleted`).
    pub filtered_deletes: usize,
    /// How long the walk took.
    pub elapsed: Duration,
}

#[derive(Debug, thiserror::Error)]
/// Why a cleanup failed (its targets are retried after the next commit).
pub enum CleanupError {
    #[error("opening the ctnetlink socket: {0}")]
    /// The ctnetlink socket did not open.
    Open(std::io::Error),
    #[error("conntrack {what}: {source}")]
    /// A dump or delete failed.
    Netlink {
        /// Which step ("dump", "delete", ...).
        what: &'static str,
        /// The netlink error.
        source: NetlinkError,
    },
}
