//! Upgrades without an outage: the agent meets tables that the previous release programmed (a DaemonSet
//! rolling onto a node) and replaces their layout in one transaction while clients keep connecting.
//!
//! The fixtures are the batches the previous release (commit 65f86d8) committed for the examples, and for
//! the examples with a ClientIP-affinity service (`fixtures/upgrade-sticky.yaml`, the affinity shape nft could
//! not list): encoded by that release's own codec into empty tables, replayed here byte for byte. They were
//! made in a checkout of 65f86d8 by a throwaway program: `agent::plan` of the manifests (node-1, the sandbox's
//! cluster CIDRs and node addresses as NodePort addresses), then AddTable, AddSet, AddChain, AddRule and
//! AddElements for every object of both tables, `wire::encode_batch(&tx, 1)`, the bytes written as they are.

use kernel_tests::sandbox;
use kernel_tests::*;
use nftkube::netlink::attr::messages;
use nftkube::netlink::{Expect, NlSocket, NLM_F_ACK};
use nftkube_sandbox::netns::NetNs;
use std::net::SocketAddr;
use std::time::Duration;

const SYNC: Duration = Duration::from_secs(15);

// Compiled in: the kernel matrix runs these tests in VMs that have no source tree.
const EXAMPLES_BATCH: &[u8] = include_bytes!("../fixtures/upgrade-examples.batch");
const AFFINITY_BATCH: &[u8] = include_bytes!("../fixtures/upgrade-affinity.batch");
const STICKY: &str = include_str!("../fixtures/upgrade-sticky.yaml");

/// Commits a recorded batch (BEGIN, objects, END; the last object asks for the acknowledgement) in `ns`.
fn replay(ns: &NetNs, batch: Vec<u8>) {
    let seqs: Vec<u32> = messages(&batch).map(|m| m.seq).collect();
    let ack = messages(&batch)
        .find(|m| m.flags & NLM_F_ACK != 0)
        .expect("a message asking for the acknowledgement")
        .seq;
    let expect = Expect::Acks {
        first: seqs[0],
        last: *seqs.last().unwrap(),
        ack,
        batch_begin: Some(seqs[0]),
    };
    ns.run(move || {
        let mut sock = NlSocket::open(libc::NETLINK_NETFILTER).expect("netfilter socket");
        let refused = sock
            .transact("the previous release's batch", &batch, expect)
            .expect("replaying the fixture");
        assert!(refused.is_empty(), "the fixture was refused: {refused:?}");
    })
    .expect("entering the node namespace");
}

/// Replays `batch`, checks the old layout serves `targets`, then starts the agent under continuous clients to
/// every target: not one connection may fail, and the agent must say it migrated the layout.
fn upgrade_under_traffic(tag: &str, batch: &[u8], sticky: bool, targets: &[SocketAddr]) {
    let sb = sandbox(tag, 3);
    let m = Manifests::examples();
    if sticky {
        m.write("sticky.yaml", STICKY);
    }
    replay(sb.node(), batch.to_vec());
    for dst in targets {
        assert!(
            served(sb.client(), *dst, Duration::from_secs(2)),
            "the previous release's tables do not serve {dst}"
        );
    }
    let clients: Vec<ContinuousClient> = targets
        .iter()
        .map(|d| ContinuousClient::start(sb.client(), *d))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    std::thread::sleep(Duration::from_secs(1));
    for client in clients {
        client.assert_never_failed(50, "the upgrade");
    }
    let log = agent.log();
    assert!(
        log.contains("migrating a table of another layout"),
        "no migration reported; log:\n{log}"
    );
    assert!(agent.stop(), "agent did not stop cleanly");
}

#[test]
fn the_previous_releases_tables_are_replaced_without_a_failed_connection() {
    let echo: SocketAddr = "10.96.0.10:80".parse().unwrap();
    upgrade_under_traffic("nk-upg", EXAMPLES_BATCH, false, &[echo]);
}

#[test]
fn the_previous_releases_affinity_layout_is_replaced_without_a_failed_connection() {
    let echo: SocketAddr = "10.96.0.10:80".parse().unwrap();
    let sticky: SocketAddr = "10.96.0.50:80".parse().unwrap();
    let node_port = SocketAddr::new(sandbox::node_ip_v4().into(), 30050);
    upgrade_under_traffic(
        "nk-upgaff",
        AFFINITY_BATCH,
        true,
        &[echo, sticky, node_port],
    );
}
