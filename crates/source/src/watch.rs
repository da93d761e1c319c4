//! The manifest source on a thread of its own, woken by inotify.
//!
//! Reading and parsing happen on this thread, never on the proxy loop's: a huge or hostile manifest delays
//! only its own events, and the loop keeps syncing what it has. The thread watches the manifest directory
//! (or a single file's directory) with inotify, lets a burst of writes settle, re-reads what changed
//! ([`ManifestSource::poll`] compares each file's stamp), and hands the events over with a ring of the
//! loop's doorbell. A slow periodic check backs inotify up: for filesystems that send no events (some
//! network and FUSE mounts) and for a path that does not exist yet.

use super::{Event, ManifestSource, Notify, Outbox};
use futures::StreamExt;
use inotify::{EventMask, EventStream, Inotify, WatchMask};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

/// A write rarely comes alone (truncate, write, close; or a tool writing many files): wait until the
/// directory has been quiet this long before reading...
const SETTLE: Duration = Duration::from_millis(5);
/// ...but never longer than this after the first event, so a steady stream of writes is still read. Under such
/// a stream every change waits this long before it is read; a read costs only the changed files, so it can
/// come often (50 ms gave a p99 of 131 ms from a manifest write to traffic under 100 writes per second with
/// `--min-sync-period` 100 ms, 20 ms gave 112 ms: `kernel-tests/benches/latency.rs`).
const MAX_SETTLE: Duration = Duration::from_millis(20);

/// Everything that can change what the source reads: files written, created, removed, renamed (a
/// ConfigMap mount swaps a `..data` symlink), and the watched directory itself going away.
fn mask() -> WatchMask {
    WatchMask::CLOSE_WRITE
        | WatchMask::MODIFY
        | WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::ATTRIB
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF
}

/// The running watcher: its events arrive in a channel, each batch announced through the notifier.
#[derive(Debug)]
pub struct ManifestWatcher {
    rx: mpsc::Receiver<Vec<Event>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ManifestWatcher {
    /// Starts reading `path` (a directory or a file) on a new thread: first the complete snapshot (ending
    /// with [`Event::Synced`]), then the differences as files change. `fallback` is the period of the
    /// check that does not rely on inotify.
    pub fn start(
        path: PathBuf,
        fallback: Duration,
        notify: Notify,
    ) -> std::io::Result<ManifestWatcher> {
        let (outbox, rx) = Outbox::channel(notify);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("manifests".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => return tracing::error!("manifest watcher: no runtime: {e}"),
                };
                rt.block_on(run(ManifestSource::new(path), fallback, outbox, stop_rx));
            })?;
        Ok(ManifestWatcher {
            rx,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Every event received so far, in order.
    pub(crate) fn poll(&mut self) -> Vec<Event> {
        super::drain_batches(&self.rx)
    }
}

impl Drop for ManifestWatcher {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            // A read in progress (a huge directory) finishes first.
            super::join_within(t, Duration::from_secs(2));
        }
    }
}

type Stream = EventStream<Vec<u8>>;

async fn run(
    mut source: ManifestSource,
    fallback: Duration,
    outbox: Outbox,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    // Watch before the first read, so that nothing written during it is missed.
    let mut watched = Watched::default();
    watched.refresh(source.path(), false);
    // Sent as it is parsed: the loop stores the first objects while the rest are parsed. Nothing to hand
    // back here: `Synced` goes out after the last unit is parsed, and the loop trims the heap when it comes.
    let mut consumer_gone = false;
    source.initial_streamed(&mut |batch| consumer_gone |= outbox.send(batch).is_err());
    if consumer_gone {
        return;
    }
    loop {
        let mut lost = false;
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(fallback) => {}
            event = next_event(&mut watched.stream) => {
                lost = settle(&mut watched.stream, event).await;
            }
        }
        // Again before the read: what is written after it is then seen by the new watch.
        watched.refresh(source.path(), lost);
        let changes = source.poll().0;
        // A read leaves the texts and parsed documents freed in this thread's heap and the parsers': glibc
        // keeps such pages, and the proxy loop's thread cannot reuse another thread's heap.
        nftkube_process::release_free_memory();
        if outbox.send(changes).is_err() {
            return;
        }
    }
}

/// The inotify watch and the directory it is on.
#[derive(Default)]
struct Watched {
    dir: Option<PathBuf>,
    stream: Option<Stream>,
}

impl Watched {
    /// Watches the directory `path` needs (see [`target_dir`]) unless it already does and nothing was lost:
    /// a manifest directory created after the start is first seen from its parent, then watched itself.
    fn refresh(&mut self, path: &Path, lost: bool) {
        let dir = target_dir(path);
        if !lost && self.stream.is_some() && self.dir.as_ref() == Some(&dir) {
            return;
        }
        self.stream = watch(&dir);
        self.dir = Some(dir);
    }
}

/// The directory whose events can change what `path` reads: `path` itself if it is a directory; else the
/// parent (a single file replaced by rename, or a directory that does not exist yet).
fn target_dir(path: &Path) -> PathBuf {
    if path.is_dir() {
        return path.to_path_buf();
    }
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The next event, or forever if there is no stream.
async fn next_event(stream: &mut Option<Stream>) -> Option<EventMask> {
    match stream {
        Some(s) => match s.next().await {
            Some(Ok(event)) => Some(event.mask),
            Some(Err(e)) => {
                tracing::warn!(
                    "manifest watcher: inotify failed ({e}); checking every period instead"
                );
                *stream = None;
                None
            }
            None => {
                *stream = None;
                None
            }
        },
        None => std::future::pending().await,
    }
}

/// Lets a burst of events settle (see [`SETTLE`]). True when the watch is gone and must be made again (the
/// directory was removed or renamed, the kernel's queue overflowed, or the stream failed).
async fn settle(stream: &mut Option<Stream>, first: Option<EventMask>) -> bool {
    let lost = |mask: Option<EventMask>| {
        mask.is_none_or(|m| {
            m.intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED)
        })
    };
    let mut rewatch = lost(first);
    let end = tokio::time::Instant::now() + MAX_SETTLE;
    while stream.is_some() && !rewatch {
        let quiet = tokio::time::Instant::now() + SETTLE;
        match tokio::time::timeout_at(quiet.min(end), next_event(stream)).await {
            Ok(mask) => rewatch |= lost(mask),
            Err(_) => break,
        }
        if tokio::time::Instant::now() >= end {
            break;
        }
    }
    // An overflow (Q_OVERFLOW) needs no new watch: the read that follows compares every file anyway.
    rewatch
}

/// An inotify stream on `dir`. None (logged) when it cannot be watched: the periodic check covers it, and
/// the next one tries again.
fn watch(dir: &Path) -> Option<Stream> {
    let attempt = || -> std::io::Result<Stream> {
        let inotify = Inotify::init()?;
        inotify.watches().add(dir, mask())?;
        inotify.into_event_stream(vec![0u8; 64 * 1024])
    };
    match attempt() {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(
                path = %dir.display(),
                "manifest watcher: cannot watch ({e}); checking every period instead"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!(
                "nftkube-watch-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn service(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  clusterIP: {ip}\n  ports: [{{port: 80, protocol: TCP}}]\n"
        )
    }

    /// Waits (bounded: a hang guard, not a timing assertion) until the watcher has delivered events.
    fn next_batch(w: &mut ManifestWatcher, rings: &AtomicUsize, seen: &mut usize) -> Vec<Event> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = w.poll();
            if !got.is_empty() {
                assert!(
                    rings.load(Ordering::SeqCst) > *seen,
                    "events came without a ring"
                );
                *seen = rings.load(Ordering::SeqCst);
                return got;
            }
            assert!(Instant::now() < deadline, "no events from the watcher");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn counting() -> (Arc<AtomicUsize>, Notify) {
        let rings = Arc::new(AtomicUsize::new(0));
        let r = rings.clone();
        (
            rings,
            Arc::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    /// The fallback period is an hour: whatever arrives came through inotify.
    #[test]
    fn writes_creations_renames_and_removals_arrive_through_inotify() {
        let dir = TempDir::new("inotify");
        std::fs::write(dir.0.join("a.yaml"), service("a", "10.96.0.1")).unwrap();
        let (rings, notify) = counting();
        let mut w =
            ManifestWatcher::start(dir.0.clone(), Duration::from_secs(3600), notify).unwrap();
        let mut seen = 0;
        let first = next_batch(&mut w, &rings, &mut seen);
        assert_eq!(first.last(), Some(&Event::Synced));
        assert_eq!(first.len(), 2);

        // A new file.
        std::fs::write(dir.0.join("b.yaml"), service("b", "10.96.0.2")).unwrap();
        let got = next_batch(&mut w, &rings, &mut seen);
        assert!(
            matches!(&got[..], [Event::ServiceApplied { key, .. }] if &*key.name == "b"),
            "{got:?}"
        );

        // Replaced by rename, as editors and ConfigMap mounts do.
        let tmp = dir.0.join(".a.tmp");
        std::fs::write(&tmp, service("a", "10.96.0.9")).unwrap();
        std::fs::rename(&tmp, dir.0.join("a.yaml")).unwrap();
        let got = next_batch(&mut w, &rings, &mut seen);
        assert!(
            matches!(&got[..], [Event::ServiceApplied { key, ports }] if &*key.name == "a" && ports[0].cluster_ips[0].to_string() == "10.96.0.9"),
            "{got:?}"
        );

        std::fs::remove_file(dir.0.join("b.yaml")).unwrap();
        let got = next_batch(&mut w, &rings, &mut seen);
        assert!(
            matches!(&got[..], [Event::ServiceDeleted(key)] if &*key.name == "b"),
            "{got:?}"
        );
    }

    #[test]
    fn a_directory_created_later_is_seen_from_its_parent_and_then_watched() {
        let parent = TempDir::new("later");
        let dir = parent.0.join("manifests");
        let (rings, notify) = counting();
        let mut w = ManifestWatcher::start(dir.clone(), Duration::from_secs(3600), notify).unwrap();
        let mut seen = 0;
        assert_eq!(next_batch(&mut w, &rings, &mut seen), vec![Event::Synced]);
        std::fs::create_dir(&dir).unwrap();
        // Nothing to read yet: the empty directory is now watched, with no events to send.
        std::thread::sleep(Duration::from_millis(200));
        std::fs::write(dir.join("a.yaml"), service("a", "10.96.0.1")).unwrap();
        let got = next_batch(&mut w, &rings, &mut seen);
        assert!(
            matches!(&got[..], [Event::ServiceApplied { key, .. }] if &*key.name == "a"),
            "{got:?}"
        );
    }
}
