//! README's first command, the demo (`nftkube-demo`, of the nftkube-sandbox package), works and cleans up after
//! itself.

use kernel_tests::{demo_bin, examples_dir, require_root};
use std::process::Command;

#[test]
fn demo_shows_balanced_traffic_rejections_and_the_ruleset_then_removes_its_sandbox() {
    require_root();
    // README's command runs from the repository root, where `examples/` is the default manifest directory.
    let root = examples_dir().join("..");
    let out = Command::new(demo_bin())
        .args(["--requests", "30"])
        .current_dir(&root)
        .output()
        .expect("running nftkube-demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    // Every backend answered through the TCP ClusterIP from the pod.
    let tcp_line = stdout
        .lines()
        .find(|l| l.contains("demo/echo:tcp") && l.contains("from pod"))
        .unwrap_or_else(|| panic!("{stdout}"));
    for pod in ["pod1", "pod2", "pod3"] {
        assert!(tcp_line.contains(pod), "{tcp_line}");
    }
    assert!(
        stdout.contains("demo/empty:udp") && stdout.contains("rejected"),
        "{stdout}"
    );
    assert!(
        stdout.contains("table ip nftkube {") && stdout.contains("table ip6 nftkube {"),
        "{stdout}"
    );
    assert!(
        stdout.contains("sandbox removed (0 namespaces left)"),
        "{stdout}"
    );
    let prefix_left = std::fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().starts_with("nkdemo-"))
        })
        .unwrap_or(false);
    assert!(!prefix_left, "demo namespaces left behind");
}
