//! kube-proxy ends when its configuration file changes, so that its DaemonSet starts it again with the new
//! ConfigMap; nftkube does the same. The file is compared by content once a second rather than through
//! inotify: a ConfigMap volume replaces the file by swapping a symlink above it, which a watch on the file
//! itself does not see, and a second's delay is nothing next to a pod restart.

use std::path::PathBuf;
use std::time::Duration;

/// How often the file is read again.
pub const WATCH_PERIOD: Duration = Duration::from_secs(1);

/// Runs `on_change` once, on a thread of its own, when the content of `path` differs from what it is now.
/// A file that cannot be read for a moment (being replaced) is not a change.
pub fn on_config_change(
    path: PathBuf,
    period: Duration,
    on_change: impl FnOnce() + Send + 'static,
) -> std::io::Result<()> {
    let first = std::fs::read(&path)?;
    std::thread::Builder::new()
        .name("config-watch".into())
        .spawn(move || loop {
            std::thread::sleep(period);
            if std::fs::read(&path).is_ok_and(|now| now != first) {
                on_change();
                return;
            }
        })
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_changed_file_is_noticed_and_a_rewrite_of_the_same_content_is_not() {
        let dir = std::env::temp_dir().join(format!("nftkube-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.conf");
        std::fs::write(&file, "a: 1\n").unwrap();
        let (tx, rx) = mpsc::channel();
        on_config_change(file.clone(), Duration::from_millis(10), move || {
            tx.send(()).unwrap();
        })
        .unwrap();
        std::fs::write(&file, "a: 1\n").unwrap();
        std::fs::remove_file(&file).unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        std::fs::write(&file, "a: 2\n").unwrap();
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
