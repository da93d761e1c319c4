//! `nftkube plan` output for examples/ is pinned: any change to what we program shows up in review.
//! Regenerate with `UPDATE_GOLDEN=1 cargo test --test plan_golden` after checking the diff is intended.

use nftkube::agent::plan;
use nftkube::model::parse_cidrs;
use nftkube::render::RenderConfig;
use std::path::Path;

#[test]
fn plan_of_examples_matches_golden() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg = RenderConfig {
        node_name: "node-1".into(),
        cluster_cidrs: parse_cidrs("10.244.0.0/16,fd00:244::/48").unwrap(),
        nodeport_addresses: nftkube::model::NodePortAddresses::Only(vec![
            "192.168.200.1".parse().unwrap(),
            "fd00:200::1".parse().unwrap(),
        ]),
        ..RenderConfig::default()
    };
    let mut errors = Vec::new();
    let text: String = plan(root.join("examples"), &cfg, |e| errors.push(e))
        .iter()
        .map(nftkube::nft::text::render_table)
        .collect();
    assert!(errors.is_empty(), "examples must load cleanly: {errors:?}");
    let golden = root.join("tests/golden/examples.nft");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, &text).unwrap();
    }
    let want =
        std::fs::read_to_string(&golden).expect("golden file (run with UPDATE_GOLDEN=1 to create)");
    assert_eq!(
        text, want,
        "plan output changed; if intended, regenerate with UPDATE_GOLDEN=1"
    );
}
