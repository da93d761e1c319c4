//! Services and EndpointSlices from manifest files: a directory of `*.yaml` / `*.yml` / `*.json` files
//! (non-recursive, sorted by name, dotfiles ignored) or a single file.
//!
//! Policy: bad input loses nothing.
//! - A malformed document is reported ([`SourceError`], also logged with `tracing::warn`) and skipped;
//!   every other document of the file, and every other file, still loads.
//! - If a document fails for an identifiable object (kind Service / EndpointSlice with a name), the last
//!   good version of that object stays: no Deleted event for it. Except where that version would leave
//!   traffic flowing that neither version allows (`super::fail_closed`): a Service whose failed document
//!   or last good version has `loadBalancerSourceRanges` loses its external and LoadBalancer IPs until a
//!   usable version comes, and an EndpointSlice is deleted (its endpoints withdrawn).
//! - If a file has a document that cannot be identified (YAML syntax error, no kind, no name) or the
//!   file cannot be read, every object it produced before is kept: we cannot tell a removed object from
//!   a broken one. Deletions from that file take effect once it loads cleanly again.
//! - If the path itself cannot be read (a missing directory or file), nothing is deleted.
//! - A file that disappears from a directory is a deletion of its objects.
//! - The same object defined twice: the first definition (in file order) wins, the other is an error.
//!
//! In parts: `decode` turns one document into objects and errors; `units` parses a batch of documents on
//! every CPU and merges the parts in the documents' order; `reconcile` tells which files changed and turns
//! a read into events against what was emitted before; `snapshot` is what a read gives, which they share.
//! This module reads the files and keeps what was emitted between reads.

mod decode;
mod reconcile;
mod snapshot;
#[cfg(test)]
mod test_support;
mod units;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use decode::parse_file;
use decode::{documents_of, Document};
use reconcile::{changed_files, reconcile, Emitted, FileStamp, Fingerprint, FirstRead};
use snapshot::{report, ObjectKey, Snapshot};
use units::{merge, parse_in_order};

use super::fail_closed::ExposedServices;
use super::Event;

/// A problem with one file or one document of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceError {
    /// The file.
    pub(crate) path: PathBuf,
    /// 0-based index of the document in the file (among non-empty documents); None for the whole file.
    pub(crate) document: Option<usize>,
    /// "namespace/name" of the object, when known.
    pub(crate) object: Option<String>,
    /// What is wrong.
    pub(crate) reason: String,
}

impl SourceError {
    /// A failure of a whole file (or of the path itself).
    fn of_file(path: PathBuf, reason: String) -> SourceError {
        SourceError {
            path,
            document: None,
            object: None,
            reason,
        }
    }
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(d) = self.document {
            write!(f, " document {d}")?;
        }
        if let Some(o) = &self.object {
            write!(f, " ({o})")?;
        }
        write!(f, ": {}", self.reason)
    }
}

impl std::error::Error for SourceError {}

/// Reads Services and EndpointSlices from files and reports them as [`Event`]s.
#[derive(Debug)]
pub struct ManifestSource {
    path: PathBuf,
    fingerprint: Option<Fingerprint>,
    /// A fingerprint of what we last emitted for each object, and where it came from, in key order. Only a
    /// hash: the consumer holds the objects, and keeping a second copy of a 10k-service cluster here would
    /// double the agent's memory. A sorted vector, not a map: a poll walks it in order anyway (and looks
    /// keys up by binary search), and a vector has no per-entry overhead.
    emitted: Vec<(ObjectKey, Emitted)>,
    /// The last read reported no error at all: nothing emitted is protected by a failure, and no object is
    /// defined twice, so a change to some files can be read from those files alone.
    clean: bool,
    /// How many files the last read opened: all of them, or only the changed ones.
    files_read: usize,
    /// The emitted Services that outside traffic reaches, to close them if an update cannot be read.
    exposed: ExposedServices,
}

impl ManifestSource {
    /// `path` is a directory (its `*.yaml`, `*.yml` and `*.json` files) or a single file.
    pub fn new(path: PathBuf) -> Self {
        ManifestSource {
            path,
            fingerprint: None,
            emitted: Vec::new(),
            clean: false,
            files_read: 0,
            exposed: ExposedServices::default(),
        }
    }

    /// The directory or file watched.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    #[cfg(test)]
    /// How many files the last read opened (all of them, or only those that changed).
    pub(crate) fn files_read(&self) -> usize {
        self.files_read
    }

    /// A complete snapshot (Applied for every object, in the files' order) followed by `Event::Synced`.
    /// Forgets anything emitted before.
    pub fn initial(&mut self) -> (Vec<Event>, Vec<SourceError>) {
        let mut events = Vec::new();
        let errors = self.initial_streamed(&mut |batch| events.extend(batch));
        (events, errors)
    }

    /// What [`ManifestSource::initial`] gives, handed to `send` a batch at a time while the files are
    /// parsed, in the files' order, so that the consumer can start on the first objects before the last
    /// are parsed; the last batch is `Event::Synced`. Returns the errors.
    pub(crate) fn initial_streamed(
        &mut self,
        send: &mut dyn FnMut(Vec<Event>),
    ) -> Vec<SourceError> {
        self.fingerprint = Some(self.fingerprint());
        let mut first = FirstRead::default();
        self.read_into(&mut |part| send(first.take(part)));
        let (emitted, exposed, errors) = first.finish();
        self.emitted = emitted;
        self.exposed = exposed;
        self.clean = errors.is_empty();
        send(vec![Event::Synced]);
        errors
    }

    /// If any file changed (mtime, ctime, size, inode, or the set of files), re-reads and returns the
    /// difference against what was last emitted. Nothing (and no errors) if nothing changed.
    pub(crate) fn poll(&mut self) -> (Vec<Event>, Vec<SourceError>) {
        let fingerprint = self.fingerprint();
        if self.fingerprint.as_ref() == Some(&fingerprint) {
            return (Vec::new(), Vec::new());
        }
        let changed = changed_files(self.fingerprint.as_ref(), &fingerprint);
        self.fingerprint = Some(fingerprint);
        if let Some(changed) = changed.filter(|_| self.clean) {
            if let Some(events) = self.poll_files(&changed) {
                return (events, Vec::new());
            }
        }
        let snap = self.read();
        let (events, errors) = self.reconcile_all(snap);
        self.clean = errors.is_empty();
        (events, errors)
    }

    /// Re-reads only the `changed` files (written, added or removed since the last read), when what they
    /// hold now is as clean as the last read was: no error, and no object that another file defines too.
    /// None otherwise, and nothing is changed: the caller reads everything again, which sorts out which
    /// definition wins and what a failure protects.
    fn poll_files(&mut self, changed: &BTreeSet<PathBuf>) -> Option<Vec<Event>> {
        let Some(Ok(listed)) = &self.fingerprint else {
            return None;
        };
        let present = changed.iter().filter(|p| listed.contains_key(*p)).cloned();
        let mut snap = Snapshot::default();
        self.read_files(present.collect(), &mut |part| merge(&mut snap, part));
        if !snap.errors.is_empty() {
            return None;
        }
        let from_changed = |path: &Path| changed.contains(path);
        // An object of a changed file that an unchanged one defines too: a duplicate, for the full read.
        // Looked up in the sorted `emitted`: the cost follows the changed files, not the whole directory.
        let defined_elsewhere = |key: &ObjectKey| {
            let found = self.emitted.binary_search_by(|(k, _)| k.cmp(key));
            found.is_ok_and(|i| !from_changed(&self.emitted[i].1.path))
        };
        if snap.objects.keys().any(defined_elsewhere) {
            return None;
        }
        let objects = std::mem::take(&mut snap.objects);
        let emitted = std::mem::take(&mut self.emitted);
        // What a file not read again emitted is unchanged (and, by the check above, not read now).
        let (emitted, events) = reconcile(&snap, emitted, objects, &mut self.exposed, |e| {
            !from_changed(&e.path)
        });
        self.emitted = emitted;
        Some(events)
    }

    /// The difference between a complete read and what was last emitted.
    fn reconcile_all(&mut self, mut snap: Snapshot) -> (Vec<Event>, Vec<SourceError>) {
        let objects = std::mem::take(&mut snap.objects);
        let emitted = std::mem::take(&mut self.emitted);
        let (emitted, events) = reconcile(&snap, emitted, objects, &mut self.exposed, |_| false);
        self.emitted = emitted;
        (events, snap.errors)
    }

    fn files(&self) -> Result<Vec<PathBuf>, String> {
        let meta = std::fs::metadata(&self.path).map_err(|e| format!("cannot read: {e}"))?;
        if !meta.is_dir() {
            return Ok(vec![self.path.clone()]);
        }
        let dir =
            std::fs::read_dir(&self.path).map_err(|e| format!("cannot list directory: {e}"))?;
        let mut files = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|e| format!("cannot list directory: {e}"))?;
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') {
                continue;
            }
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !matches!(ext, "yaml" | "yml" | "json") {
                continue;
            }
            // Follows symlinks (ConfigMap mounts are symlinks); dangling ones are skipped.
            if std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
                files.push(path);
            }
        }
        files.sort();
        Ok(files)
    }

    fn fingerprint(&self) -> Fingerprint {
        use std::os::unix::fs::MetadataExt;
        let mut out = BTreeMap::new();
        for path in self.files()? {
            // A file we cannot stat gets an empty stamp; reading it reports the error.
            let stamp = match std::fs::metadata(&path) {
                Ok(m) => FileStamp {
                    modified: m.modified().ok(),
                    ctime: (m.ctime(), m.ctime_nsec()),
                    size: m.size(),
                    inode: m.ino(),
                },
                Err(_) => FileStamp {
                    modified: None,
                    ctime: (0, 0),
                    size: 0,
                    inode: 0,
                },
            };
            out.insert(path, stamp);
        }
        Ok(out)
    }

    /// Reads every file: the documents are parsed in parallel, in units of the files' order, and merged in
    /// that order, so the first definition of an object still wins.
    fn read(&mut self) -> Snapshot {
        let mut snap = Snapshot::default();
        self.read_into(&mut |part| merge(&mut snap, part));
        snap
    }

    /// Reads every file, handing the parts of the snapshot to `part` in the files' order.
    fn read_into(&mut self, part: &mut dyn FnMut(Snapshot)) {
        self.files_read = 0;
        match self.files() {
            Ok(files) => self.read_files(files, part),
            Err(reason) => {
                let mut snap = Snapshot {
                    unreadable: true,
                    ..Snapshot::default()
                };
                let path = self.path.clone();
                report(&mut snap, SourceError::of_file(path, reason));
                part(snap);
            }
        }
    }

    /// Reads `files`, handing the parts of their snapshot to `part` in the files' order (see
    /// [`parse_in_order`]).
    fn read_files(&mut self, files: Vec<PathBuf>, part: &mut dyn FnMut(Snapshot)) {
        self.files_read = files.len();
        // In batches of files, so that the texts held at once stay bounded whatever the directory holds.
        let mut batch: Vec<(Arc<PathBuf>, String)> = Vec::new();
        let mut batch_bytes = 0;
        let mut files = files.into_iter().peekable();
        while let Some(path) = files.next() {
            match read_text(&path) {
                Ok(text) => {
                    batch_bytes += text.len();
                    batch.push((Arc::new(path), text));
                }
                Err(reason) => {
                    let mut failed = Snapshot::default();
                    failed.tainted.insert(path.clone());
                    report(&mut failed, SourceError::of_file(path, reason));
                    part(failed);
                }
            }
            if batch_bytes >= READ_BATCH_BYTES || files.peek().is_none() {
                let documents: Vec<Document> = batch
                    .iter()
                    .flat_map(|(path, text)| documents_of(path, text))
                    .collect();
                parse_in_order(&documents, part);
                batch.clear();
                batch_bytes = 0;
            }
        }
    }
}

/// File text read before it is parsed: the manifests in memory at once, apart from what they become.
const READ_BATCH_BYTES: usize = 8 << 20;

/// The file as text, in the buffer it was read into (a copy of a 100 MB file costs ~50 ms and its pages),
/// or `text_of`'s reasons.
fn read_text(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    String::from_utf8(bytes).map_err(|_| "cannot read: not UTF-8".to_string())
}

#[cfg(test)]
mod tests {
    use super::test_support::{names, service, slice, TempDir};
    use super::*;
    use crate::apply_event;
    use nftkube_model::{ClusterState, NamespacedName, Protocol};

    #[test]
    fn multi_document_file() {
        let dir = TempDir::new("multi");
        let content = format!(
            "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: demo\n---\n{}---\n# only a comment\n---\n{}\n---\n{}...\n",
            service("a", "10.96.0.1"),
            service("b", "10.96.0.2"),
            slice("a-1", "a", &["10.244.1.2", "10.244.2.2"]),
        );
        dir.write("all.yaml", &content);
        dir.write("ignored.txt", "not: loaded");
        let mut src = ManifestSource::new(dir.0.clone());
        let (events, errors) = src.initial();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            names(&events),
            [
                "svc+ demo/a (1 ports)",
                "svc+ demo/b (1 ports)",
                "slice+ demo/a-1 (2 eps)",
                "synced"
            ]
        );
        // Nothing changed: nothing to report.
        let (events, errors) = src.poll();
        assert!(events.is_empty() && errors.is_empty());
    }

    #[test]
    fn malformed_document_next_to_valid_ones() {
        let dir = TempDir::new("malformed");
        let content = format!(
            "{}---\nkind: Service\nmetadata: [unclosed\n---\n{}---\n{}---\n{}---\nkind: Service\nmetadata: {{namespace: x}}\n",
            service("good", "10.96.0.1"),
            service("broken", "10.0.0.300").replace("namespace: demo", "namespace: default"),
            slice("good-1", "good", &["10.244.1.2"]),
            slice("bad-1", "good", &["10.244.1.256"]),
        );
        let path = dir.write("bad.yaml", &content);
        let mut src = ManifestSource::new(dir.0.clone());
        let (events, errors) = src.initial();
        assert_eq!(
            names(&events),
            [
                "svc+ demo/good (1 ports)",
                "slice+ demo/good-1 (1 eps)",
                "synced"
            ]
        );
        assert_eq!(errors.len(), 4, "{errors:?}");
        assert_eq!(errors[0].document, Some(1));
        assert_eq!(errors[0].object, None);
        assert!(
            errors[0].reason.starts_with("invalid YAML"),
            "{}",
            errors[0]
        );
        assert_eq!(
            errors[1].to_string(),
            format!(
                "{} document 2 (default/broken): invalid clusterIP \"10.0.0.300\"",
                path.display()
            )
        );
        assert_eq!(errors[2].object.as_deref(), Some("demo/bad-1"));
        assert!(
            errors[2]
                .reason
                .contains("invalid endpoint address \"10.244.1.256\""),
            "{}",
            errors[2]
        );
        assert_eq!(errors[3].document, Some(5));
        assert!(
            errors[3].reason.contains("without metadata.name"),
            "{}",
            errors[3]
        );
    }

    #[test]
    fn headless_and_external_name_are_skipped() {
        let dir = TempDir::new("headless");
        dir.write(
            "svc.yaml",
            &format!(
                "{}---\n{}---\napiVersion: v1\nkind: Service\nmetadata: {{name: ext, namespace: demo}}\n\
                 spec: {{type: ExternalName, externalName: example.com}}\n",
                service("a", "10.96.0.1"),
                service("headless", "None"),
            ),
        );
        let mut src = ManifestSource::new(dir.0.clone());
        let (events, errors) = src.initial();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            names(&events),
            [
                "svc+ demo/a (1 ports)",
                "svc+ demo/ext (0 ports)",
                "svc+ demo/headless (0 ports)",
                "synced"
            ]
        );
        // A service that turns headless is applied with no ports, which removes it from the model.
        let mut state = ClusterState::new();
        for ev in events {
            apply_event(&mut state, ev);
        }
        assert_eq!(state.service_map().len(), 1);
        dir.write("svc.yaml", &service("a", "None"));
        let (events, _) = src.poll();
        assert_eq!(
            names(&events),
            [
                "svc+ demo/a (0 ports)",
                "svc- demo/ext",
                "svc- demo/headless"
            ]
        );
        for ev in events {
            apply_event(&mut state, ev);
        }
        assert!(state.service_map().is_empty());
    }

    #[test]
    fn examples_directory_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let mut src = ManifestSource::new(dir);
        let (events, errors) = src.initial();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(events.last(), Some(&Event::Synced));
        let mut state = ClusterState::new();
        for ev in events {
            apply_event(&mut state, ev);
        }
        let demo = |n: &str| NamespacedName::new("demo", n);
        assert!(state
            .service_names()
            .is_superset(&[demo("echo"), demo("echo6"), demo("empty")].into()));
        let ports = |n: &str| state.service_ports(&demo(n)).len();
        assert_eq!((ports("echo"), ports("echo6"), ports("empty")), (2, 2, 2));
        let eps = state.endpoints_map();
        let count = |n: &str| -> usize {
            eps.iter()
                .filter(|(k, _)| k.service == demo(n))
                .map(|(_, v)| v.len())
                .sum()
        };
        assert_eq!((count("echo"), count("echo6"), count("empty")), (6, 6, 0));
        let echo_udp = nftkube_model::ServicePortName {
            service: demo("echo"),
            port: "udp".into(),
            protocol: Protocol::Udp,
        };
        let udp: Vec<String> = eps[&echo_udp]
            .iter()
            .map(|e| format!("{}:{}", e.ip, e.port))
            .collect();
        assert_eq!(
            udp,
            ["10.244.1.2:5353", "10.244.2.2:5353", "10.244.3.2:5353"]
        );
        let echo6_tcp = nftkube_model::ServicePortName {
            service: demo("echo6"),
            port: "tcp".into(),
            protocol: Protocol::Tcp,
        };
        let tcp6: Vec<String> = eps[&echo6_tcp]
            .iter()
            .map(|e| format!("[{}]:{}", e.ip, e.port))
            .collect();
        assert_eq!(
            tcp6,
            [
                "[fd00:244:0:1::2]:8080",
                "[fd00:244:0:2::2]:8080",
                "[fd00:244:0:3::2]:8080"
            ]
        );
        let echo = state.service_ports(&demo("echo"));
        assert_eq!(
            echo[0].cluster_ips,
            vec!["10.96.0.10".parse::<std::net::IpAddr>().unwrap()]
        );
        let echo6 = state.service_ports(&demo("echo6"));
        assert_eq!(
            echo6[0].cluster_ips,
            vec!["fd00:96::10".parse::<std::net::IpAddr>().unwrap()]
        );
    }
}
