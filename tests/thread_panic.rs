//! A panic on any thread ends the process (`nftkube::agent::exit_on_panic`, which `nftkube proxy` sets first).

// The test runs a copy of itself and reads what it printed.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::process::Command;

/// Set in the copy of this test's binary that the test runs: that copy panics on a thread of its own.
const CHILD: &str = "NFTKUBE_TEST_PANICKING_CHILD";
const TEST: &str = "a_panic_on_any_thread_ends_the_process_with_101";

#[test]
fn a_panic_on_any_thread_ends_the_process_with_101() {
    if std::env::var_os(CHILD).is_some() {
        panic_on_a_thread();
    }
    let out = Command::new(std::env::current_exe().expect("this test's binary"))
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .expect("running this test's binary again");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(101), "{stdout}\n{stderr}");
    assert!(stderr.contains("a bug on a worker thread"), "{stderr}");
    assert!(!stdout.contains("still running"), "{stdout}");
}

/// The child: the policy, then a thread that panics. Without the policy the thread dies alone, the process
/// says so and exits 0.
fn panic_on_a_thread() -> ! {
    nftkube::agent::exit_on_panic();
    let joined = std::thread::spawn(|| panic!("a bug on a worker thread")).join();
    println!("still running after the thread's panic ({joined:?})");
    std::process::exit(0);
}
