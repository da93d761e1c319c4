//! A first sync big enough to be committed in several transactions (docs/sync.md "Chunked commits": chunks of
//! at most `--max-transaction-elements`, 25 000 by default; 100 here, so that the test stays small enough for the
//! emulated kernels of the VM matrix) never exposes a half state: services that already exist keep answering
//! every connection while a restarted agent programs two hundred new ones around them. Under the VM matrix's
//! software emulation, listing and reloading the state after the sync (the listing invariant every agent test
//! checks) costs most of the time: five hundred services, each with its draws' eight slots, took the oldest
//! kernel past its three-minute limit.

use kernel_tests::*;
use std::net::SocketAddr;
use std::time::Duration;

const SYNC: Duration = Duration::from_secs(60);
const SERVICES: usize = 200;
const CHUNK: &str = "100";

#[test]
fn a_chunked_first_sync_never_fails_a_connection_to_a_service_that_exists() {
    let sb = sandbox("nk-chunk", 3);
    let m = Manifests::examples();
    let mut agent = Agent::start(sb.node(), &m.dir, &[]);
    agent.wait_syncs(1, SYNC);
    assert!(agent.stop(), "the first agent did not stop cleanly");

    // The rules stay when the agent exits; clients keep using them while the next agent starts.
    m.write("bulk.yaml", &many_services(SERVICES));
    let targets: Vec<SocketAddr> = ["10.96.0.10:80", "[fd00:96::10]:80"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    for dst in &targets {
        assert!(served(sb.client(), *dst, Duration::from_secs(2)), "{dst}");
    }
    let clients: Vec<ContinuousClient> = targets
        .iter()
        .map(|d| ContinuousClient::start(sb.client(), *d))
        .collect();
    let agent = Agent::start(sb.node(), &m.dir, &["--max-transaction-elements", CHUNK]);
    agent.wait_syncs(1, SYNC);
    std::thread::sleep(Duration::from_millis(500));
    for client in clients {
        client.assert_never_failed(20, "the chunked sync");
    }
    let log = agent.log();
    let transactions = log
        .lines()
        .find(|l| l.contains("sync complete") && l.contains("full=true"))
        .and_then(|l| l.split("transactions=").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<usize>().ok());
    assert!(
        transactions.is_some_and(|t| t >= 10),
        "the first sync was not chunked ({transactions:?} transactions); log:\n{log}"
    );
    // One of the new services is programmed too.
    let new = sb.node().run(|| {
        let mut s = nftkube::nft::netlink::NftSocket::open().unwrap();
        s.dump_set(
            nftkube::nft::ir::Family::Ip,
            "nftkube",
            nftkube::render::names::SET_LB_IPS,
        )
        .unwrap()
        .len()
    });
    assert!(new.unwrap() > SERVICES, "not every service was dispatched");
}
