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

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::Value;

use super::convert::{self, ServiceConversion, SliceConversion};
use super::fail_closed::{asks_source_ranges, value_asks_source_ranges, ExposedServices};
use super::{fingerprint, Event};
use crate::model::{NamespacedName, ServicePort, SharedValues, SliceInfo};

/// A problem with one file or one document of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceError {
    /// The file.
    pub path: PathBuf,
    /// 0-based index of the document in the file (among non-empty documents); None for the whole file.
    pub document: Option<usize>,
    /// "namespace/name" of the object, when known.
    pub object: Option<String>,
    /// What is wrong.
    pub reason: String,
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

/// Services sort before EndpointSlices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum ObjectKind {
    Service,
    Slice,
}

/// An object's identity, ordered by kind, namespace, name. The strings are shared: a namespace by every
/// object of a read, a slice's name with the slice itself (and so with the store that keeps it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct ObjectKey {
    kind: ObjectKind,
    namespace: Arc<str>,
    name: Arc<str>,
}

impl ObjectKey {
    /// The same shared strings: the model's copy of the name is this one.
    fn namespaced_name(&self) -> NamespacedName {
        NamespacedName::new(self.namespace.clone(), self.name.clone())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Object {
    Service(Vec<ServicePort>),
    Slice(SliceInfo),
}

/// Where an object was loaded from. The path is shared by every object of its file (one allocation per
/// file, not per object: at 50k services that is ~10 MB); a thin pointer, as every emitted object keeps one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Origin {
    path: Arc<PathBuf>,
    document: usize,
    /// The item of a `List` document (named in errors as `items[i]`).
    item: Option<usize>,
}

/// What was emitted for one object: a fingerprint of it, and the file it came from (a failure in that file
/// protects it from deletion).
#[derive(Debug)]
struct Emitted {
    print: u64,
    path: Arc<PathBuf>,
}

/// One poll's walk over what was emitted and what was read, both in key order: the events between them
/// (in key order) and what is emitted afterwards (in key order again).
struct Reconcile<'a> {
    snap: &'a Snapshot,
    emitted: Vec<(ObjectKey, Emitted)>,
    events: Vec<Event>,
    exposed: &'a mut ExposedServices,
}

impl Reconcile<'_> {
    /// One key: emitted before (`old`), read now (`new`), or both.
    fn object(
        &mut self,
        old: Option<(ObjectKey, Emitted)>,
        new: Option<(ObjectKey, (Object, Origin))>,
    ) {
        match (old, new) {
            (Some((key, e)), None) => self.gone(key, e),
            // Unchanged: the store keeps its version, and the key keeps pointing at its strings.
            (Some((key, e)), Some((_, (object, origin)))) if e.print == fingerprint(&object) => {
                let e = Emitted {
                    path: origin.path,
                    ..e
                };
                self.emitted.push((key, e));
            }
            // New or changed: the new key shares its strings with the version the store gets now.
            (_, Some((key, (object, origin)))) => self.apply(key, object, origin.path),
            (None, None) => {}
        }
    }

    fn apply(&mut self, key: ObjectKey, object: Object, path: Arc<PathBuf>) {
        if let Object::Service(ports) = &object {
            self.exposed.emitted(&key.namespaced_name(), ports);
        }
        let print = fingerprint(&object);
        self.emitted.push((key.clone(), Emitted { print, path }));
        self.events.push(applied(key, object));
    }

    /// Emitted before, absent now: deleted, unless a failure may be hiding it (then it stays, or closes).
    fn gone(&mut self, key: ObjectKey, e: Emitted) {
        let snap = self.snap;
        if snap.withdrawn.contains(&key) {
            tracing::warn!(
                "EndpointSlice {}/{}: could not be read; its endpoints are withdrawn until a usable version comes",
                key.namespace,
                key.name
            );
        } else if let Some(closed) = self.closed_on_failure(&key) {
            tracing::warn!(
                "Service {}/{}: could not be read, and it or its version in effect has \
                 loadBalancerSourceRanges; its external and LoadBalancer IPs are closed until a usable version comes",
                key.namespace,
                key.name
            );
            return self.apply(key, closed, e.path);
        } else if snap.keep.contains(&key) || snap.tainted.contains(&*e.path) || snap.unreadable {
            self.emitted.push((key, e));
            return;
        }
        if key.kind == ObjectKind::Service {
            self.exposed.deleted(&key.namespaced_name());
        }
        self.events.push(match key.kind {
            ObjectKind::Service => Event::ServiceDeleted(key.namespaced_name()),
            ObjectKind::Slice => Event::SliceDeleted {
                namespace: key.namespace.to_string(),
                name: key.name.to_string(),
            },
        });
    }

    /// For a Service whose document failed: the version to emit instead of keeping the last good one.
    fn closed_on_failure(&self, key: &ObjectKey) -> Option<Object> {
        let restricts_sources = *self.snap.failed_services.get(key)?;
        self.exposed
            .closed_on_failure(&key.namespaced_name(), restricts_sources)
            .map(Object::Service)
    }
}

/// Identity of a file's content as far as the filesystem tells: re-read when it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    ctime: (i64, i64),
    size: u64,
    inode: u64,
}

type Fingerprint = Result<BTreeMap<PathBuf, FileStamp>, String>;

/// The result of reading every file once.
#[derive(Default)]
struct Snapshot {
    objects: BTreeMap<ObjectKey, (Object, Origin)>,
    errors: Vec<SourceError>,
    /// Objects whose document failed: keep their last good version.
    keep: BTreeSet<ObjectKey>,
    /// Services whose document failed (also in `keep`), and whether it lists `loadBalancerSourceRanges`.
    failed_services: BTreeMap<ObjectKey, bool>,
    /// EndpointSlices whose document failed: withdrawn rather than kept.
    withdrawn: BTreeSet<ObjectKey>,
    /// Files with a failure we cannot attribute to an object: keep everything they produced.
    tainted: BTreeSet<PathBuf>,
    /// The path itself could not be read: keep everything.
    unreadable: bool,
    /// Namespaces, port names and endpoint topologies of this read, one copy each. Per read, not kept:
    /// the store keeps its own, and two long-lived sets would keep each other's unused values alive.
    shared: SharedValues,
}

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
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many files the last read opened (all of them, or only those that changed).
    pub fn files_read(&self) -> usize {
        self.files_read
    }

    /// Whether [`ManifestSource::initial`] has run.
    pub fn started(&self) -> bool {
        self.fingerprint.is_some()
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
    pub fn initial_streamed(&mut self, send: &mut dyn FnMut(Vec<Event>)) -> Vec<SourceError> {
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
    pub fn poll(&mut self) -> (Vec<Event>, Vec<SourceError>) {
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

/// The first read, emitted while it is parsed: of each part, the objects no earlier part defined (the first
/// definition wins, as in `merge`), and what `emitted` keeps of them.
#[derive(Default)]
struct FirstRead {
    seen: BTreeMap<ObjectKey, (u64, Origin)>,
    errors: Vec<SourceError>,
    exposed: ExposedServices,
}

impl FirstRead {
    /// The Applied events of `part`'s new objects.
    fn take(&mut self, part: Snapshot) -> Vec<Event> {
        self.errors.extend(part.errors);
        let mut events = Vec::with_capacity(part.objects.len());
        for (key, (object, origin)) in part.objects {
            if let Some((_, first)) = self.seen.get(&key) {
                let err = duplicate_error(&key, &origin, first);
                tracing::warn!("{err}");
                self.errors.push(err);
                continue;
            }
            if let Object::Service(ports) = &object {
                self.exposed.emitted(&key.namespaced_name(), ports);
            }
            self.seen
                .insert(key.clone(), (fingerprint(&object), origin));
            events.push(applied(key, object));
        }
        events
    }

    /// What was emitted, in key order, the exposed Services among it, and every error.
    fn finish(self) -> (Vec<(ObjectKey, Emitted)>, ExposedServices, Vec<SourceError>) {
        let emitted = self
            .seen
            .into_iter()
            .map(|(key, (print, origin))| {
                let path = origin.path;
                (key, Emitted { print, path })
            })
            .collect();
        (emitted, self.exposed, self.errors)
    }
}

/// Walks what was emitted and what was read, both in key order, into the events between them and what is
/// emitted afterwards. An emitted object for which `untouched` holds is kept as it is (its file was not read).
fn reconcile(
    snap: &Snapshot,
    emitted: Vec<(ObjectKey, Emitted)>,
    objects: BTreeMap<ObjectKey, (Object, Origin)>,
    exposed: &mut ExposedServices,
    untouched: impl Fn(&Emitted) -> bool,
) -> (Vec<(ObjectKey, Emitted)>, Vec<Event>) {
    let mut r = Reconcile {
        snap,
        emitted: Vec::with_capacity(emitted.len().max(objects.len())),
        events: Vec::new(),
        exposed,
    };
    let mut old = emitted.into_iter().peekable();
    let mut new = objects.into_iter().peekable();
    loop {
        let order = match (old.peek(), new.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((a, _)), Some((b, _))) => a.cmp(b),
        };
        let before = (order != Ordering::Greater).then(|| old.next()).flatten();
        let now = (order != Ordering::Less).then(|| new.next()).flatten();
        match before {
            Some(entry) if now.is_none() && untouched(&entry.1) => r.emitted.push(entry),
            before => r.object(before, now),
        }
    }
    r.emitted.shrink_to_fit();
    (r.emitted, r.events)
}

/// The files whose stamp differs between two listings (written, added or removed); None when either listing
/// failed (then everything is read again).
fn changed_files(before: Option<&Fingerprint>, now: &Fingerprint) -> Option<BTreeSet<PathBuf>> {
    let (Some(Ok(before)), Ok(now)) = (before, now) else {
        return None;
    };
    let mut changed: BTreeSet<PathBuf> = now
        .iter()
        .filter(|(path, stamp)| before.get(*path) != Some(stamp))
        .map(|(path, _)| path.clone())
        .collect();
    changed.extend(before.keys().filter(|p| !now.contains_key(*p)).cloned());
    Some(changed)
}

/// File text read before it is parsed: the manifests in memory at once, apart from what they become.
const READ_BATCH_BYTES: usize = 8 << 20;

/// One document of a file, ready to parse.
struct Document<'a> {
    path: &'a Arc<PathBuf>,
    index: usize,
    text: &'a str,
    json: bool,
}

/// A file's documents: a JSON file is one; a YAML stream is split at its markers (see `split_documents`).
fn documents_of<'a>(path: &'a Arc<PathBuf>, text: &'a str) -> Vec<Document<'a>> {
    let json = path.extension().is_some_and(|e| e == "json");
    let texts = if json {
        vec![text]
    } else {
        split_documents(text)
    };
    texts
        .into_iter()
        .enumerate()
        .map(|(index, text)| Document {
            path,
            index,
            text,
            json,
        })
        .collect()
}

/// Parses `documents` on every CPU, in units of about [`UNIT_BYTES`], and hands each unit's snapshot to
/// `part` in the documents' order, as soon as it and the units before it are parsed.
fn parse_in_order(documents: &[Document], part: &mut dyn FnMut(Snapshot)) {
    let lists: Vec<Option<BigList>> = documents.iter().map(BigList::of).collect();
    let document_runs = |documents| runs_of(documents, |d: &Document| d.text.len());
    let mut units = Vec::new();
    // The first document not yet in a unit.
    let mut next = 0;
    for (i, list) in lists.iter().enumerate() {
        let Some(list) = list else { continue };
        units.extend(
            document_runs(&documents[next..i])
                .into_iter()
                .map(Unit::Documents),
        );
        let item_runs = runs_of(&list.items, |(_, text)| text.len());
        units.extend(item_runs.into_iter().map(|items| Unit::Items {
            document: &documents[i],
            list,
            items,
        }));
        next = i + 1;
    }
    units.extend(
        document_runs(&documents[next..])
            .into_iter()
            .map(Unit::Documents),
    );
    super::in_order::map_in_order(&units, Unit::parse, part);
}

/// What a parser thread takes at a time: a run of whole documents, or a run of one big List's items.
enum Unit<'a> {
    Documents(&'a [Document<'a>]),
    Items {
        document: &'a Document<'a>,
        list: &'a BigList<'a>,
        items: &'a [(usize, &'a str)],
    },
}

impl Unit<'_> {
    fn parse(&self) -> Snapshot {
        match self {
            Unit::Documents(documents) => parse_documents(documents),
            Unit::Items {
                document,
                list,
                items,
            } => {
                let mut snap = Snapshot::default();
                let mut ctx = DocContext {
                    path: document.path,
                    document: document.index,
                    snap: &mut snap,
                };
                ctx.raw_items(items, list.default_kind());
                snap
            }
        }
    }
}

/// A JSON List document of at least [`UNIT_BYTES`], its items found by one scan of the text, so that they are
/// parsed a unit at a time (see [`RawList`]); smaller Lists are parsed whole, as any document.
struct BigList<'a> {
    kind: String,
    api_version: String,
    items: Vec<(usize, &'a str)>,
}

impl<'a> BigList<'a> {
    fn of(d: &Document<'a>) -> Option<BigList<'a>> {
        if !d.json || d.text.len() < UNIT_BYTES {
            return None;
        }
        let list: RawList<'a> = serde_json::from_str(d.text).ok()?;
        is_list_kind(&list.kind).then(|| BigList {
            items: list.items.iter().map(|r| r.get()).enumerate().collect(),
            kind: list.kind,
            api_version: list.api_version,
        })
    }

    /// The kind a typed list (`ServiceList`) gives items that name none.
    fn default_kind(&self) -> Option<(&str, &str)> {
        list_item_kind(&self.kind, &self.api_version)
    }
}

/// `items` cut into contiguous runs of about [`UNIT_BYTES`] (by `len` of each).
fn runs_of<T>(items: &[T], len: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut runs = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        bytes += len(item);
        if bytes >= UNIT_BYTES {
            runs.push(&items[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < items.len() {
        runs.push(&items[start..]);
    }
    runs
}

/// The text a parser thread takes at a time: small enough that a big file's objects come out in many steps
/// (a consumer starts on them meanwhile), big enough that a unit costs far more than handing it over.
const UNIT_BYTES: usize = 1024 * 1024;

fn parse_documents(documents: &[Document]) -> Snapshot {
    let mut snap = Snapshot::default();
    for d in documents {
        parse_document(d, &mut snap);
    }
    snap
}

/// Adds `part` (the next documents in order) to `into`: an object `into` already has is a duplicate, and
/// the first definition wins.
fn merge(into: &mut Snapshot, part: Snapshot) {
    into.unreadable |= part.unreadable;
    into.errors.extend(part.errors);
    into.keep.extend(part.keep);
    for (key, restricts_sources) in part.failed_services {
        *into.failed_services.entry(key).or_default() |= restricts_sources;
    }
    into.withdrawn.extend(part.withdrawn);
    into.tainted.extend(part.tainted);
    for (key, (object, origin)) in part.objects {
        match into.objects.get(&key) {
            Some((_, first)) => {
                let err = duplicate_error(&key, &origin, first);
                into.keep.insert(key);
                report(into, err);
            }
            None => {
                into.objects.insert(key, (object, origin));
            }
        }
    }
}

/// A second definition of `key`, at `origin`: ignored.
fn duplicate_error(key: &ObjectKey, origin: &Origin, first: &Origin) -> SourceError {
    SourceError {
        path: origin.path.to_path_buf(),
        document: Some(origin.document),
        object: Some(format!("{}/{}", key.namespace, key.name)),
        reason: with_item(origin.item, duplicate_reason(key.kind, first)),
    }
}

fn duplicate_reason(kind: ObjectKind, first: &Origin) -> String {
    let kind = match kind {
        ObjectKind::Service => "Service",
        ObjectKind::Slice => "EndpointSlice",
    };
    format!(
        "duplicate {kind}, already defined in {} document {}; ignoring this one",
        first.path.display(),
        first.document
    )
}

fn applied(key: ObjectKey, object: Object) -> Event {
    match (key, object) {
        (key, Object::Service(ports)) => {
            debug_assert_eq!(key.kind, ObjectKind::Service);
            Event::ServiceApplied {
                key: key.namespaced_name(),
                ports,
            }
        }
        (_, Object::Slice(s)) => Event::SliceApplied(s),
    }
}

fn report(snap: &mut Snapshot, err: SourceError) {
    tracing::warn!("{err}");
    snap.errors.push(err);
}

/// One file's content as the source reads it: the Applied events of its objects (in key order) and its
/// errors. `path` names the file in errors and decides JSON (`.json`) or YAML. The fuzz target's entry point
/// (`fuzz/`); the source itself reads through the same code with the file's bytes.
pub fn parse_file(path: &Path, bytes: &[u8]) -> (Vec<Event>, Vec<SourceError>) {
    let mut snap = Snapshot::default();
    match text_of(Ok(bytes)) {
        Ok(text) => {
            let path = Arc::new(path.to_path_buf());
            for d in documents_of(&path, text) {
                parse_document(&d, &mut snap);
            }
        }
        Err(reason) => {
            snap.tainted.insert(path.to_path_buf());
            report(&mut snap, SourceError::of_file(path.to_path_buf(), reason));
        }
    }
    let events = snap
        .objects
        .into_iter()
        .map(|(key, (object, _))| applied(key, object))
        .collect();
    (events, snap.errors)
}

/// The file as text, in the buffer it was read into (a copy of a 100 MB file costs ~50 ms and its pages),
/// or `text_of`'s reasons.
fn read_text(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    String::from_utf8(bytes).map_err(|_| "cannot read: not UTF-8".to_string())
}

fn text_of(bytes: Result<&[u8], String>) -> Result<&str, String> {
    bytes
        .and_then(|b| std::str::from_utf8(b).map_err(|_| "not UTF-8".to_string()))
        .map_err(|e| format!("cannot read: {e}"))
}

/// A JSON `List` document, its items left as slices of the text: each item becomes a value of its own in
/// turn, so a list of 100k objects never exists as one parsed value (1154 MiB peak at 100k services and
/// their slices, against 294 MiB for the same objects as YAML documents). Anything that does not fit this
/// shape (no items, items not a list, a duplicate key) is read as a whole value instead, with that path's
/// errors.
#[derive(serde::Deserialize)]
struct RawList<'a> {
    kind: String,
    #[serde(rename = "apiVersion", default)]
    api_version: String,
    #[serde(borrow)]
    items: Vec<&'a serde_json::value::RawValue>,
}

/// The kind (and apiVersion) a typed List (`ServiceList`) gives its items; None for a plain `List`.
fn list_item_kind<'k>(kind: &'k str, api_version: &'k str) -> Option<(&'k str, &'k str)> {
    let element_kind = kind.strip_suffix("List").filter(|k| !k.is_empty());
    element_kind.map(|k| (k, api_version))
}

fn is_list_kind(kind: &str) -> bool {
    matches!(kind, "List" | "ServiceList" | "EndpointSliceList")
}

fn parse_document(d: &Document, snap: &mut Snapshot) {
    if d.json {
        if let Ok(list) = serde_json::from_str::<RawList>(d.text) {
            if is_list_kind(&list.kind) {
                let mut ctx = DocContext {
                    path: d.path,
                    document: d.index,
                    snap,
                };
                return ctx.raw_list(list);
            }
        }
    }
    if d.json {
        let mut ctx = DocContext {
            path: d.path,
            document: d.index,
            snap,
        };
        if ctx.typed_item(None, d.text, None) {
            return;
        }
    }
    let parsed: Result<Value, String> = if d.json {
        serde_json::from_str(d.text).map_err(|e| format!("invalid JSON: {e}"))
    } else {
        crate::yaml::parse_document(d.text).map_err(|e| format!("invalid YAML: {e}"))
    };
    let mut ctx = DocContext {
        path: d.path,
        document: d.index,
        snap,
    };
    match parsed {
        Ok(value) => ctx.value(value, None, None),
        Err(reason) => ctx.unidentified(None, reason),
    }
}

/// Splits a YAML stream into its non-empty documents at `---` / `...` marker lines (which YAML forbids
/// inside content, so this is exact) so that a syntax error in one document does not hide the others. The
/// documents are slices of `text` (what follows a `---` on its line belongs to the next document): nothing is
/// copied.
fn split_documents(text: &str) -> Vec<&str> {
    fn is_marker(line: &str, marker: &str) -> bool {
        line.strip_prefix(marker)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
    }
    /// Nothing for us: blank lines, comments, and directives (`%YAML`, `%TAG`, which precede a `---`).
    fn is_blank(doc: &str) -> bool {
        doc.lines().all(|l| {
            let t = l.trim();
            t.is_empty() || t.starts_with('#') || l.starts_with('%')
        })
    }
    let mut bounds = Vec::new();
    let (mut start, mut pos) = (0, 0);
    for line in text.split_inclusive('\n') {
        let content = line.trim_end_matches(['\n', '\r']);
        if is_marker(content, "---") {
            bounds.push(start..pos);
            start = pos + 3;
        } else if is_marker(content, "...") {
            bounds.push(start..pos);
            start = pos + line.len();
        }
        pos += line.len();
    }
    bounds.push(start..text.len());
    bounds
        .into_iter()
        .map(|r| &text[r])
        .filter(|doc| !is_blank(doc))
        .collect()
}

struct DocContext<'a> {
    path: &'a Arc<PathBuf>,
    document: usize,
    snap: &'a mut Snapshot,
}

impl DocContext<'_> {
    fn error(&mut self, object: Option<String>, reason: String) {
        let err = SourceError {
            path: self.path.to_path_buf(),
            document: Some(self.document),
            object,
            reason,
        };
        report(self.snap, err);
    }

    /// A failure we cannot attribute to an object: keep everything the file produced before.
    fn unidentified(&mut self, item: Option<usize>, reason: String) {
        self.snap.tainted.insert(self.path.to_path_buf());
        self.error(None, with_item(item, reason));
    }

    /// The items of a JSON List (see [`RawList`]), one at a time (a big List is cut into units first: see
    /// [`BigList`]).
    fn raw_list(&mut self, list: RawList) {
        let items: Vec<(usize, &str)> = list.items.iter().map(|r| r.get()).enumerate().collect();
        self.raw_items(&items, list_item_kind(&list.kind, &list.api_version));
    }

    /// Items of a JSON List, each with its index in the list.
    fn raw_items(&mut self, items: &[(usize, &str)], default_kind: Option<(&str, &str)>) {
        for &(i, raw) in items {
            if self.typed_item(Some(i), raw, default_kind) {
                continue;
            }
            match serde_json::from_str::<Value>(raw) {
                Ok(value) => self.value(value, Some(i), default_kind),
                Err(e) => self.unidentified(Some(i), format!("invalid JSON: {e}")),
            }
        }
    }

    /// One document, or one item of a List. `default_kind` comes from a typed list (`ServiceList`).
    fn value(&mut self, mut value: Value, item: Option<usize>, default_kind: Option<(&str, &str)>) {
        if value.is_null() {
            return;
        }
        let Some(obj) = value.as_object_mut() else {
            return self.unidentified(item, "not an object".into());
        };
        if let Some((kind, api_version)) = default_kind {
            obj.entry("kind")
                .or_insert_with(|| Value::String(kind.into()));
            obj.entry("apiVersion")
                .or_insert_with(|| Value::String(api_version.into()));
        }
        let Some(kind) = obj.get("kind").and_then(Value::as_str).map(str::to_owned) else {
            return self.unidentified(item, "missing kind".into());
        };
        let api_version = obj
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        match kind.as_str() {
            "Service" | "EndpointSlice" => self.object(&kind, &api_version, value, item),
            list if is_list_kind(list) && item.is_none() => {
                let Some(items) = obj.get_mut("items").map(Value::take) else {
                    return self.unidentified(item, format!("{kind} without items"));
                };
                let Value::Array(items) = items else {
                    return self.unidentified(item, format!("{kind} items is not a list"));
                };
                for (i, it) in items.into_iter().enumerate() {
                    self.value(it, Some(i), list_item_kind(&kind, &api_version));
                }
            }
            other => {
                tracing::debug!(
                    path = %self.path.display(),
                    document = self.document,
                    kind = other,
                    "ignoring document of another kind"
                );
            }
        }
    }

    /// A JSON document or List item read straight into its type, without a `Value` in between (a million
    /// endpoints as JSON, spawn to first sync: 7.7–8.0 s → 5.7–6.1 s). Only when that works: anything else
    /// (malformed JSON, another kind, a field of the wrong type, a key given twice, no name) is read the
    /// `Value` way, which words the errors. False: not read.
    fn typed_item(
        &mut self,
        item: Option<usize>,
        raw: &str,
        default_kind: Option<(&str, &str)>,
    ) -> bool {
        let Ok(header) = serde_json::from_str::<ItemHeader>(raw) else {
            return false;
        };
        // A null kind or apiVersion is not the List's: the `Value` way words what is wrong with it.
        let given = |field: &Option<Option<std::borrow::Cow<'_, str>>>, default: Option<&str>| {
            match field {
                None => Ok(default.map(str::to_owned)),
                Some(Some(v)) => Ok(Some(v.to_string())),
                Some(None) => Err(()),
            }
        };
        let (Ok(kind), Ok(api_version)) = (
            given(&header.kind, default_kind.map(|d| d.0)),
            given(&header.api_version, default_kind.map(|d| d.1)),
        ) else {
            return false;
        };
        let Some(meta) = header
            .metadata
            .filter(|m| m.name.as_deref().is_some_and(|n| !n.is_empty()))
        else {
            return false;
        };
        let typed = match kind.as_deref() {
            Some("Service") => serde_json::from_str(raw).map(|s| Typed::Service(Box::new(s))),
            Some("EndpointSlice") => serde_json::from_str(raw).map(|s| Typed::Slice(Box::new(s))),
            _ => return false,
        };
        let Ok(typed) = typed else {
            return false;
        };
        let kind = typed.kind();
        let restricts_sources = matches!(&typed, Typed::Service(svc) if asks_source_ranges(svc));
        let api_version = api_version.unwrap_or_default();
        let name = meta.name.as_deref().unwrap_or_default();
        let namespace = meta.namespace.as_deref().filter(|n| !n.is_empty());
        self.named_object(kind, name, namespace, item, restricts_sources, |shared| {
            check_api_version(kind, &api_version)?;
            convert_typed(typed, shared)
        });
        true
    }

    fn object(&mut self, kind: &str, api_version: &str, value: Value, item: Option<usize>) {
        let meta = value.get("metadata");
        let name = meta
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        let Some(name) = name else {
            return self.unidentified(item, format!("{kind} without metadata.name"));
        };
        let namespace = meta
            .and_then(|m| m.get("namespace"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        let (name, namespace) = (name.to_owned(), namespace.map(str::to_owned));
        let restricts_sources = kind == "Service" && value_asks_source_ranges(&value);
        self.named_object(
            kind,
            &name,
            namespace.as_deref(),
            item,
            restricts_sources,
            |shared| convert_object(kind, api_version, value, shared),
        );
    }

    /// An object of `kind` named `name` in `namespace` (None: "default"), converted by `convert`;
    /// `restricts_sources`: a Service that lists `loadBalancerSourceRanges`.
    fn named_object(
        &mut self,
        kind: &str,
        name: &str,
        namespace: Option<&str>,
        item: Option<usize>,
        restricts_sources: bool,
        convert: impl FnOnce(&mut SharedValues) -> Result<Option<Object>, String>,
    ) {
        let namespace = namespace.unwrap_or("default");
        // As its errors show it: a name the API server would refuse may be any length.
        let object_name = format!(
            "{}/{}",
            super::validate::shortened(namespace),
            super::validate::shortened(name)
        );
        let key = ObjectKey {
            kind: if kind == "Service" {
                ObjectKind::Service
            } else {
                ObjectKind::Slice
            },
            namespace: self.snap.shared.string(namespace),
            name: name.into(),
        };
        match convert(&mut self.snap.shared) {
            Ok(Some(mut object)) => {
                if let Object::Slice(info) = &mut object {
                    // The same strings, shared with the key.
                    debug_assert_eq!(
                        (&*info.namespace, &*info.name),
                        (&*key.namespace, &*key.name)
                    );
                    info.namespace = key.namespace.clone();
                    info.name = key.name.clone();
                }
                if let Some((_, first)) = self.snap.objects.get(&key) {
                    let reason = duplicate_reason(key.kind, first);
                    self.snap.keep.insert(key);
                    return self.error(Some(object_name), with_item(item, reason));
                }
                let origin = Origin {
                    path: self.path.clone(),
                    document: self.document,
                    item,
                };
                self.snap.objects.insert(key, (object, origin));
            }
            Ok(None) => {}
            Err(reason) => {
                match key.kind {
                    ObjectKind::Service => {
                        let failed = self.snap.failed_services.entry(key.clone()).or_default();
                        *failed |= restricts_sources;
                        self.snap.keep.insert(key);
                    }
                    ObjectKind::Slice => {
                        self.snap.withdrawn.insert(key);
                    }
                }
                self.error(Some(object_name), with_item(item, reason));
            }
        }
    }
}

fn with_item(item: Option<usize>, reason: String) -> String {
    match item {
        Some(i) => format!("items[{i}]: {reason}"),
        None => reason,
    }
}

/// The parts of a List item that say what it is, read before the item itself (everything else is skipped).
/// `kind` and `apiVersion`: None when absent (the List's kind applies), Some(None) when null.
#[derive(serde::Deserialize)]
struct ItemHeader<'a> {
    #[serde(borrow, default, deserialize_with = "present")]
    kind: Option<Option<std::borrow::Cow<'a, str>>>,
    #[serde(rename = "apiVersion", borrow, default, deserialize_with = "present")]
    api_version: Option<Option<std::borrow::Cow<'a, str>>>,
    #[serde(borrow)]
    metadata: Option<MetaHeader<'a>>,
}

/// A field that is there, null or not (serde's `default` makes an absent one None).
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

#[derive(serde::Deserialize)]
struct MetaHeader<'a> {
    #[serde(borrow)]
    name: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow)]
    namespace: Option<std::borrow::Cow<'a, str>>,
}

/// A Service or an EndpointSlice, read.
enum Typed {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
}

impl Typed {
    fn kind(&self) -> &'static str {
        match self {
            Typed::Service(_) => "Service",
            Typed::Slice(_) => "EndpointSlice",
        }
    }
}

/// The apiVersion nftkube reads `kind` in.
fn check_api_version(kind: &str, api_version: &str) -> Result<(), String> {
    let want = match kind {
        "Service" => "v1",
        _ => "discovery.k8s.io/v1",
    };
    match api_version == want {
        true => Ok(()),
        false => Err(format!(
            "unsupported apiVersion {api_version:?} for {kind} (want {want})"
        )),
    }
}

/// Ok(None) for an object that converts to nothing (an FQDN slice).
fn convert_object(
    kind: &str,
    api_version: &str,
    value: Value,
    shared: &mut SharedValues,
) -> Result<Option<Object>, String> {
    check_api_version(kind, api_version)?;
    let typed = match kind {
        "Service" => Typed::Service(
            serde_json::from_value(value).map_err(|e| format!("invalid Service: {e}"))?,
        ),
        _ => Typed::Slice(
            serde_json::from_value(value).map_err(|e| format!("invalid EndpointSlice: {e}"))?,
        ),
    };
    convert_typed(typed, shared)
}

/// Ok(None) for an object that converts to nothing (an FQDN slice).
fn convert_typed(typed: Typed, shared: &mut SharedValues) -> Result<Option<Object>, String> {
    match typed {
        Typed::Service(svc) => match convert::service_ports(&svc).map_err(|e| e.reason)? {
            ServiceConversion::Ports(ports) => Ok(Some(Object::Service(ports))),
            ServiceConversion::Skipped(reason) => {
                tracing::debug!(service = ?svc.metadata.name, reason, "service not proxied");
                Ok(Some(Object::Service(Vec::new())))
            }
        },
        Typed::Slice(slice) => {
            match convert::endpoint_slice_sharing(&slice, shared).map_err(|e| e.reason)? {
                SliceConversion::Slice(info) => Ok(Some(Object::Slice(info))),
                SliceConversion::Skipped(reason) => {
                    tracing::debug!(slice = ?slice.metadata.name, reason, "EndpointSlice ignored");
                    Ok(None)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ClusterState, Protocol};
    use crate::source::apply_event;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A temporary directory removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let dir = std::env::temp_dir().join(format!(
                "nftkube-manifests-{tag}-{}-{}-{nanos}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        /// Writes through a temporary file and a rename, as editors and ConfigMap updates do (a new
        /// inode, so the change is seen even within one mtime tick).
        fn write(&self, name: &str, content: &str) -> PathBuf {
            let tmp = self.0.join(format!(".tmp-{name}"));
            std::fs::write(&tmp, content).unwrap();
            let path = self.0.join(name);
            std::fs::rename(&tmp, &path).unwrap();
            path
        }

        fn remove(&self, name: &str) {
            std::fs::remove_file(self.0.join(name)).unwrap();
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn service(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: demo\n\
             spec:\n  clusterIP: {ip}\n  ports:\n  - name: tcp\n    port: 80\n    targetPort: 8080\n"
        )
    }

    fn slice(name: &str, svc: &str, ips: &[&str]) -> String {
        let mut s = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: demo\n  \
             labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv4\nports:\n- name: tcp\n  port: 8080\n  \
             protocol: TCP\nendpoints:\n"
        );
        for ip in ips {
            s.push_str(&format!(
                "- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n"
            ));
        }
        s
    }

    /// A short rendering of events for assertions.
    fn names(events: &[Event]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                Event::ServiceApplied { key, ports } => {
                    format!("svc+ {key} ({} ports)", ports.len())
                }
                Event::ServiceDeleted(key) => format!("svc- {key}"),
                Event::SliceApplied(s) => format!(
                    "slice+ {}/{} ({} eps)",
                    s.namespace,
                    s.name,
                    s.endpoints.len()
                ),
                Event::SliceDeleted { namespace, name } => format!("slice- {namespace}/{name}"),
                Event::Synced => "synced".into(),
                other => format!("{other:?}"),
            })
            .collect()
    }

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

    /// The fuzz target's entry point reads bytes as the source reads a file: format by extension, errors
    /// naming the path, invalid UTF-8 reported.
    #[test]
    fn parse_file_reads_bytes_like_a_file() {
        let yaml = format!("{}---\nkind: Service\n", service("web", "10.96.0.1"));
        let (events, errors) = parse_file(Path::new("a.yaml"), yaml.as_bytes());
        assert_eq!(names(&events), ["svc+ demo/web (1 ports)"]);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].to_string().starts_with("a.yaml document 1"),
            "{}",
            errors[0]
        );
        let (events, errors) =
            parse_file(Path::new("a.json"), b"{\"kind\": \"List\", \"items\": [7]}");
        assert!(events.is_empty());
        assert_eq!(errors[0].reason, "items[0]: not an object");
        let (_, errors) = parse_file(Path::new("a.yaml"), b"\xff");
        assert_eq!(errors[0].reason, "cannot read: not UTF-8");
    }

    /// A JSON List's items are read one at a time from the text; a list of another shape is read whole, and
    /// both report as before.
    #[test]
    fn json_lists_item_by_item() {
        let svc = r#"{"metadata": {"name": "a", "namespace": "demo"}, "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}"#;
        let typed = format!(
            r#"{{"kind": "ServiceList", "apiVersion": "v1", "items": [{svc}, 7, {{"kind": "Service"}}]}}"#
        );
        let (events, errors) = parse_file(Path::new("l.json"), typed.as_bytes());
        assert_eq!(names(&events), ["svc+ demo/a (1 ports)"]);
        let reasons: Vec<&str> = errors.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(
            reasons,
            [
                "items[1]: not an object",
                "items[2]: Service without metadata.name"
            ]
        );
        let (_, errors) = parse_file(Path::new("l.json"), br#"{"kind": "List", "items": {}}"#);
        assert_eq!(errors[0].reason, "List items is not a list");
        let (_, errors) = parse_file(
            Path::new("l.json"),
            br#"{"kind": "List", "items": [1], "items": [2]}"#,
        );
        assert_eq!(errors[0].reason, "items[0]: not an object");
    }

    /// List items are read straight into their types when that works, and the `Value` way otherwise, with
    /// the same results and the same errors as reading every item as a `Value`.
    #[test]
    fn list_items_read_typed_or_as_values_alike() {
        let svc = |name: &str, extra: &str| {
            format!(
                r#"{{"metadata": {{"name": "{name}", "namespace": "demo"}}{extra}, "spec": {{"clusterIP": "10.96.0.{}", "ports": [{{"port": 80}}]}}}}"#,
                name.len()
            )
        };
        let items = [
            svc("a", ""),
            // A key given twice: the typed read refuses it, a `Value` keeps the last.
            svc(
                "bb",
                r#", "metadata": {"name": "bb", "namespace": "other"}"#,
            ),
            svc("ccc", r#", "kind": null"#),
            svc("dddd", r#", "apiVersion": "v2""#),
            svc("eeeee", "").replace(r#""port": 80"#, r#""port": "80""#),
            svc("ffffff", r#", "kind": "EndpointSlice""#),
        ];
        let text = format!(
            r#"{{"kind": "ServiceList", "apiVersion": "v1", "items": [{}]}}"#,
            items.join(", ")
        );
        let (events, errors) = parse_file(Path::new("l.json"), text.as_bytes());
        assert_eq!(
            names(&events),
            ["svc+ demo/a (1 ports)", "svc+ other/bb (1 ports)"]
        );
        let reasons: Vec<&str> = errors.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(reasons.len(), 4, "{reasons:?}");
        assert_eq!(reasons[0], "items[2]: missing kind");
        assert_eq!(
            reasons[1],
            r#"items[3]: unsupported apiVersion "v2" for Service (want v1)"#
        );
        assert!(
            reasons[2].starts_with("items[4]: invalid Service: invalid type: string \"80\""),
            "{}",
            reasons[2]
        );
        assert!(reasons[3].starts_with("items[5]: unsupported apiVersion \"v1\" for EndpointSlice"));
        // A document that is one object: the same, without an item.
        let doc = svc("a", r#", "kind": "Service", "apiVersion": "v1""#);
        let (events, errors) = parse_file(Path::new("a.json"), doc.as_bytes());
        assert_eq!(
            (names(&events), errors.len()),
            (vec!["svc+ demo/a (1 ports)".to_string()], 0)
        );
        let bad = doc.replace(r#""port": 80"#, r#""port": "80""#);
        let (_, errors) = parse_file(Path::new("a.json"), bad.as_bytes());
        assert!(
            errors[0]
                .reason
                .starts_with("invalid Service: invalid type: string \"80\""),
            "{}",
            errors[0].reason
        );
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
    fn reread_events_come_in_object_order() {
        let dir = TempDir::new("order");
        let services = |names: &[(&str, &str)]| {
            names
                .iter()
                .map(|(n, ip)| service(n, ip))
                .collect::<Vec<_>>()
                .join("---\n")
        };
        let (a, c, d) = (("a", "10.96.0.1"), ("c", "10.96.0.3"), ("d", "10.96.0.4"));
        let (b, c2, e) = (("b", "10.96.0.2"), ("c", "10.96.0.33"), ("e", "10.96.0.5"));
        dir.write("svc.yaml", &services(&[a, c, d]));
        dir.write("eps.yaml", &slice("a-1", "a", &["10.244.1.2"]));
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        // Deletions, changes and additions of both kinds, interleaved by name.
        dir.write("svc.yaml", &services(&[b, c2, e]));
        dir.write("eps.yaml", &slice("b-1", "b", &["10.244.1.3"]));
        let (events, errors) = src.poll();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            names(&events),
            [
                "svc- demo/a",
                "svc+ demo/b (1 ports)",
                "svc+ demo/c (1 ports)",
                "svc- demo/d",
                "svc+ demo/e (1 ports)",
                "slice- demo/a-1",
                "slice+ demo/b-1 (1 eps)"
            ]
        );
        // What was emitted is remembered: the same content again is no change.
        dir.write("svc.yaml", &services(&[b, c2, e]));
        let (events, _) = src.poll();
        assert!(events.is_empty(), "{:?}", names(&events));
    }

    #[test]
    fn reread_emits_only_the_difference() {
        let dir = TempDir::new("diff");
        dir.write(
            "svc.yaml",
            &format!(
                "{}---\n{}",
                service("a", "10.96.0.1"),
                service("b", "10.96.0.2")
            ),
        );
        dir.write("eps.yaml", &slice("a-1", "a", &["10.244.1.2"]));
        let mut src = ManifestSource::new(dir.0.clone());
        let (events, _) = src.initial();
        assert_eq!(events.len(), 4);
        // Change b, add c, leave a alone; add an endpoint.
        dir.write(
            "svc.yaml",
            &format!(
                "{}---\n{}---\n{}",
                service("a", "10.96.0.1"),
                service("b", "10.96.0.22"),
                service("c", "10.96.0.3")
            ),
        );
        dir.write(
            "eps.yaml",
            &slice("a-1", "a", &["10.244.1.2", "10.244.2.2"]),
        );
        let (events, errors) = src.poll();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            names(&events),
            [
                "svc+ demo/b (1 ports)",
                "svc+ demo/c (1 ports)",
                "slice+ demo/a-1 (2 eps)"
            ]
        );
        // Rewriting identical content re-reads but reports nothing.
        dir.write(
            "eps.yaml",
            &slice("a-1", "a", &["10.244.1.2", "10.244.2.2"]),
        );
        let (events, errors) = src.poll();
        assert!(events.is_empty() && errors.is_empty());
        // Moving an object to another file is not a change.
        dir.write(
            "svc.yaml",
            &format!(
                "{}---\n{}",
                service("a", "10.96.0.1"),
                service("b", "10.96.0.22")
            ),
        );
        dir.write("svc2.yml", &service("c", "10.96.0.3"));
        let (events, _) = src.poll();
        assert!(events.is_empty(), "{:?}", names(&events));
        // Removing a document deletes its object.
        dir.write("svc.yaml", &service("a", "10.96.0.1"));
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["svc- demo/b"]);
    }

    #[test]
    fn deleting_a_file_deletes_its_objects() {
        let dir = TempDir::new("delete");
        dir.write("svc.yaml", &service("a", "10.96.0.1"));
        dir.write("eps.yaml", &slice("a-1", "a", &["10.244.1.2"]));
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        dir.remove("eps.yaml");
        let (events, errors) = src.poll();
        assert!(errors.is_empty());
        assert_eq!(names(&events), ["slice- demo/a-1"]);
        dir.remove("svc.yaml");
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["svc- demo/a"]);
    }

    #[test]
    fn invalid_object_keeps_its_last_good_version() {
        let dir = TempDir::new("keep-object");
        dir.write(
            "svc.yaml",
            &format!(
                "{}---\n{}",
                service("a", "10.96.0.1"),
                service("b", "10.96.0.2")
            ),
        );
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        // a becomes invalid, b is removed: b is deleted, a stays as it was.
        dir.write("svc.yaml", &service("a", "10.96.0.999"));
        let (events, errors) = src.poll();
        assert_eq!(names(&events), ["svc- demo/b"]);
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].object.as_deref(), Some("demo/a"));
        // Fixed: a changes.
        dir.write("svc.yaml", &service("a", "10.96.0.11"));
        let (events, errors) = src.poll();
        assert!(errors.is_empty());
        assert_eq!(names(&events), ["svc+ demo/a (1 ports)"]);
        // Broken again, then the whole file is removed: now it is a deletion.
        dir.write("svc.yaml", &service("a", "bogus"));
        let (events, _) = src.poll();
        assert!(events.is_empty());
        dir.remove("svc.yaml");
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["svc- demo/a"]);
    }

    /// A LoadBalancer Service "demo/lb" at 192.0.2.10, with these source ranges (YAML flow list).
    fn lb_service(ranges: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: lb\n  namespace: demo\n\
             spec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  loadBalancerSourceRanges: {ranges}\n\
             \x20 ports:\n  - name: tcp\n    port: 80\n    nodePort: 30080\n\
             status:\n  loadBalancer:\n    ingress:\n    - ip: 192.0.2.10\n"
        )
    }

    /// The LoadBalancer IPs and source ranges of the one ServiceApplied in `events`.
    fn lb_frontends(events: &[Event]) -> (Vec<String>, Vec<String>) {
        let [Event::ServiceApplied { ports, .. }] = events else {
            panic!("want one ServiceApplied, got {:?}", names(events))
        };
        let ips = ports[0].load_balancer_ips.iter().map(ToString::to_string);
        let ranges = ports[0].load_balancer_source_ranges.iter();
        (ips.collect(), ranges.map(ToString::to_string).collect())
    }

    #[test]
    fn a_restricting_update_is_read_as_the_api_server_reads_it_or_closes_the_load_balancer() {
        let dir = TempDir::new("fail-closed");
        dir.write("lb.yaml", &lb_service("[]"));
        let mut src = ManifestSource::new(dir.0.clone());
        let (events, _) = src.initial();
        assert_eq!(
            lb_frontends(&events[..1]),
            (vec!["192.0.2.10".into()], vec![])
        );
        // Leading zeros, as the API server accepts them: the restriction takes effect.
        dir.write("lb.yaml", &lb_service("[\"010.20.0.0/16\"]"));
        let (events, errors) = src.poll();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            lb_frontends(&events),
            (vec!["192.0.2.10".into()], vec!["10.20.0.0/16".into()])
        );
        // Open again, then a restriction that cannot be read: closed, not left open.
        dir.write("lb.yaml", &lb_service("[]"));
        src.poll();
        dir.write("lb.yaml", &lb_service("[\"10.20.0.0/99\"]"));
        let (events, errors) = src.poll();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(lb_frontends(&events), (vec![], vec![]));
        // Still broken: nothing more. Fixed: open as asked.
        dir.write("lb.yaml", &lb_service("[\"10.20.0.0/98\"]"));
        assert!(src.poll().0.is_empty());
        dir.write("lb.yaml", &lb_service("[\"10.20.0.0/16\"]"));
        let (events, _) = src.poll();
        assert_eq!(lb_frontends(&events).0, ["192.0.2.10"]);
        // A restriction of the wrong shape (no list): read as no Service at all, still closes it.
        dir.write("lb.yaml", &lb_service("\"10.20.0.0/16\""));
        let (events, errors) = src.poll();
        assert!(errors[0].reason.contains("invalid Service"), "{errors:?}");
        assert_eq!(lb_frontends(&events), (vec![], vec!["10.20.0.0/16".into()]));
    }

    #[test]
    fn a_json_list_item_that_cannot_be_read_closes_the_load_balancer_too() {
        let dir = TempDir::new("fail-closed-json");
        let item = |ranges: serde_json::Value| {
            serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [{
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "lb", "namespace": "demo"},
                "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                         "loadBalancerSourceRanges": ranges,
                         "ports": [{"name": "tcp", "port": 80, "nodePort": 30080}]},
                "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}},
            }]})
            .to_string()
        };
        dir.write("lb.json", &item(serde_json::json!([])));
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        dir.write(
            "lb.json",
            &item(serde_json::json!(["::ffff:10.20.0.0/112"])),
        );
        let (events, _) = src.poll();
        assert_eq!(lb_frontends(&events).1, ["10.20.0.0/16"]);
        dir.write(
            "lb.json",
            &item(serde_json::json!(["10.20.0.0/16", "nope"])),
        );
        let (events, _) = src.poll();
        assert_eq!(lb_frontends(&events).0, Vec::<String>::new());
    }

    #[test]
    fn a_slice_that_cannot_be_read_withdraws_its_endpoints() {
        let dir = TempDir::new("withdraw");
        dir.write("s.yaml", &slice("echo-1", "echo", &["10.244.1.2"]));
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        // A mapped address is that IPv4 endpoint.
        dir.write("s.yaml", &slice("echo-1", "echo", &["::ffff:10.244.1.3"]));
        let (events, _) = src.poll();
        let [Event::SliceApplied(info)] = &events[..] else {
            panic!("{:?}", names(&events))
        };
        assert_eq!(info.endpoints[0].address.to_string(), "10.244.1.3");
        // Unreadable: the endpoint that may now be another pod's is withdrawn, not kept.
        dir.write("s.yaml", &slice("echo-1", "echo", &["10.244.1.3.4"]));
        let (events, errors) = src.poll();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(names(&events), ["slice- demo/echo-1"]);
        assert!(src.poll().0.is_empty());
        dir.write("s.yaml", &slice("echo-1", "echo", &["10.244.1.4"]));
        assert_eq!(names(&src.poll().0), ["slice+ demo/echo-1 (1 eps)"]);
    }

    #[test]
    fn unparsable_file_keeps_everything_it_produced() {
        let dir = TempDir::new("keep-file");
        dir.write(
            "svc.yaml",
            &format!(
                "{}---\n{}",
                service("a", "10.96.0.1"),
                service("b", "10.96.0.2")
            ),
        );
        dir.write("other.yaml", &service("c", "10.96.0.3"));
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        dir.write("svc.yaml", "kind: Service\nmetadata: {name: a\n");
        dir.write("other.yaml", &service("c", "10.96.0.33"));
        let (events, errors) = src.poll();
        assert_eq!(
            names(&events),
            ["svc+ demo/c (1 ports)"],
            "other files still load"
        );
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].document, Some(0));
        // One broken document among good ones also protects objects that vanished from the file.
        dir.write(
            "svc.yaml",
            &format!("{}---\nfoo: [\n", service("a", "10.96.0.1")),
        );
        let (events, errors) = src.poll();
        assert!(events.is_empty(), "{:?}", names(&events));
        assert_eq!(errors.len(), 1);
        // Clean again: b is really gone.
        dir.write("svc.yaml", &service("a", "10.96.0.1"));
        let (events, errors) = src.poll();
        assert!(errors.is_empty());
        assert_eq!(names(&events), ["svc- demo/b"]);
    }

    #[test]
    fn missing_path_deletes_nothing() {
        let dir = TempDir::new("missing");
        let file = dir.write("svc.yaml", &service("a", "10.96.0.1"));
        let mut src = ManifestSource::new(file.clone());
        let (events, errors) = src.initial();
        assert_eq!(events.len(), 2);
        assert!(errors.is_empty());
        dir.remove("svc.yaml");
        let (events, errors) = src.poll();
        assert!(events.is_empty());
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].document, None);
        // The same error is not reported again while nothing changes.
        let (events, errors) = src.poll();
        assert!(events.is_empty() && errors.is_empty());
        dir.write("svc.yaml", &service("a", "10.96.0.2"));
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["svc+ demo/a (1 ports)"]);
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
    fn lists_json_and_fqdn_slices() {
        let dir = TempDir::new("list");
        dir.write(
            "list.yaml",
            &format!(
                "apiVersion: v1\nkind: List\nitems:\n- {}\n- kind: ConfigMap\n  metadata: {{name: x}}\n",
                serde_json::to_string(&crate::yaml::parse_document(&service("a", "10.96.0.1")).unwrap()).unwrap()
            ),
        );
        dir.write(
            "svc.json",
            r#"{"apiVersion": "v1", "kind": "ServiceList", "items": [
                {"metadata": {"name": "b", "namespace": "demo"}, "spec": {"clusterIP": "10.96.0.2", "ports": [{"port": 53, "protocol": "UDP"}]}},
                {"metadata": {"name": "c", "namespace": "demo"}, "spec": {"clusterIP": "10.96.0.x", "ports": [{"port": 53}]}}
            ]}"#,
        );
        dir.write(
            "fqdn.yaml",
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: f\n  labels: \
             {kubernetes.io/service-name: a}\naddressType: FQDN\nendpoints:\n- addresses: [example.com]\n",
        );
        let mut src = ManifestSource::new(dir.0.clone());
        let (events, errors) = src.initial();
        assert_eq!(
            names(&events),
            ["svc+ demo/a (1 ports)", "svc+ demo/b (1 ports)", "synced"]
        );
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].object.as_deref(), Some("demo/c"));
        assert!(
            errors[0].reason.starts_with("items[1]: invalid clusterIP"),
            "{}",
            errors[0]
        );
        let Event::ServiceApplied { ports, .. } = &events[1] else {
            panic!()
        };
        assert_eq!(ports[0].protocol, Protocol::Udp);
    }

    #[test]
    fn duplicate_objects_first_wins() {
        let dir = TempDir::new("dup");
        dir.write("1.yaml", &service("a", "10.96.0.1"));
        dir.write("2.yaml", &service("a", "10.96.0.2"));
        let mut src = ManifestSource::new(dir.0.clone());
        let (events, errors) = src.initial();
        assert_eq!(events.len(), 2);
        let Event::ServiceApplied { ports, .. } = &events[0] else {
            panic!()
        };
        assert_eq!(ports[0].cluster_ips[0].to_string(), "10.96.0.1");
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].reason.contains("duplicate Service"),
            "{}",
            errors[0]
        );
    }

    /// A change to one file of a clean directory reads that file alone; adding and removing files too.
    #[test]
    fn a_change_rereads_only_its_file() {
        let dir = TempDir::new("incremental");
        let two = format!(
            "{}---\n{}",
            service("a", "10.96.0.1"),
            service("b", "10.96.0.2")
        );
        dir.write("svc.yaml", &two);
        dir.write("eps.yaml", &slice("a-1", "a", &["10.244.1.2"]));
        dir.write("churn.yaml", &slice("b-1", "b", &["10.244.1.3"]));
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        assert_eq!(src.files_read(), 3);
        dir.write(
            "churn.yaml",
            &slice("b-1", "b", &["10.244.1.3", "10.244.1.4"]),
        );
        let (events, errors) = src.poll();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(names(&events), ["slice+ demo/b-1 (2 eps)"]);
        assert_eq!(src.files_read(), 1);
        dir.write("new.yaml", &service("c", "10.96.0.3"));
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["svc+ demo/c (1 ports)"]);
        assert_eq!(src.files_read(), 1);
        dir.remove("churn.yaml");
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["slice- demo/b-1"]);
        assert_eq!(src.files_read(), 0);
        // What the files not read emitted is still known: removing them deletes it.
        dir.remove("svc.yaml");
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["svc- demo/a", "svc- demo/b"]);
        // The same as a full read would give.
        let mut fresh = ManifestSource::new(dir.0.clone());
        let (all, _) = fresh.initial();
        assert_eq!(
            names(&all),
            ["svc+ demo/c (1 ports)", "slice+ demo/a-1 (1 eps)", "synced"]
        );
    }

    /// A changed file defining what an unchanged one defines, or any error, sends the read back to every
    /// file: which definition wins, and what a failure protects, depends on all of them.
    #[test]
    fn a_duplicate_or_an_error_rereads_everything() {
        let dir = TempDir::new("incremental-dup");
        dir.write("1.yaml", &service("a", "10.96.0.1"));
        dir.write("2.yaml", &service("b", "10.96.0.2"));
        let mut src = ManifestSource::new(dir.0.clone());
        src.initial();
        let both = format!(
            "{}---\n{}",
            service("b", "10.96.0.2"),
            service("a", "10.96.0.9")
        );
        dir.write("2.yaml", &both);
        let (events, errors) = src.poll();
        assert!(events.is_empty(), "{:?}", names(&events));
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].reason.contains("duplicate Service"),
            "{}",
            errors[0]
        );
        assert_eq!(src.files_read(), 2);
        // The first definition goes: the second one takes over (found by reading every file).
        dir.write("1.yaml", "");
        let (events, errors) = src.poll();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(names(&events), ["svc+ demo/a (1 ports)"]);
        let Event::ServiceApplied { ports, .. } = &events[0] else {
            panic!()
        };
        assert_eq!(ports[0].cluster_ips[0].to_string(), "10.96.0.9");
        assert_eq!(src.files_read(), 2);
        // Clean again: the next change reads its file alone.
        dir.write("1.yaml", &service("c", "10.96.0.3"));
        let (events, _) = src.poll();
        assert_eq!(names(&events), ["svc+ demo/c (1 ports)"]);
        assert_eq!(src.files_read(), 1);
        // A broken document: everything is read, and the object keeps its last good version.
        dir.write("1.yaml", &service("c", "10.96.0.300"));
        let (events, errors) = src.poll();
        assert!(events.is_empty(), "{:?}", names(&events));
        assert_eq!(errors.len(), 1);
        assert_eq!(src.files_read(), 2);
    }

    /// Enough documents for several parser threads: the parallel read gives what one thread would, and a
    /// duplicate in a later run of documents still loses to the first definition.
    #[test]
    fn parallel_parsing_merges_in_file_order() {
        let dir = TempDir::new("par");
        let many = |from: usize| -> String {
            (from..from + 6000)
                .map(|i| {
                    service(
                        &format!("s{i}"),
                        &format!("10.96.{}.{}", i / 250, i % 250 + 1),
                    )
                })
                .collect::<Vec<_>>()
                .join("---\n")
        };
        dir.write("1.yaml", &many(0));
        dir.write("2.yaml", &many(6000));
        dir.write(
            "3.yaml",
            &format!("{}---\n{}", many(12000), service("s1", "10.99.0.1")),
        );
        let total: u64 = ["1.yaml", "2.yaml", "3.yaml"]
            .iter()
            .map(|f| std::fs::metadata(dir.0.join(f)).unwrap().len())
            .sum();
        assert!(
            total > 2 * UNIT_BYTES as u64,
            "test bug: too small for two threads ({total} bytes)"
        );

        let (events, errors) = ManifestSource::new(dir.0.clone()).initial();
        assert_eq!(events.len(), 18000 + 1, "every service once, then Synced");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].reason.contains("duplicate Service"),
            "{}",
            errors[0]
        );
        assert!(errors[0].path.ends_with("3.yaml"), "{}", errors[0]);
        assert_eq!(
            service_ports(&events, "s1")[0].cluster_ips[0].to_string(),
            "10.96.0.2"
        );
        // The same as one thread reading the documents in order.
        let texts: Vec<(Arc<PathBuf>, String)> = ["1.yaml", "2.yaml", "3.yaml"]
            .iter()
            .map(|f| {
                (
                    Arc::new(dir.0.join(f)),
                    std::fs::read_to_string(dir.0.join(f)).unwrap(),
                )
            })
            .collect();
        let docs: Vec<Document> = texts.iter().flat_map(|(p, t)| documents_of(p, t)).collect();
        let one = parse_documents(&docs);
        let parallel = ManifestSource::new(dir.0.clone()).read();
        assert_eq!(one.objects.len(), parallel.objects.len());
        assert!(one.objects.keys().eq(parallel.objects.keys()));
    }

    /// The ports an event applies to the service named `name`.
    fn service_ports<'a>(events: &'a [Event], name: &str) -> &'a [ServicePort] {
        events
            .iter()
            .find_map(|e| match e {
                Event::ServiceApplied { key, ports } if &*key.name == name => {
                    Some(ports.as_slice())
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("no service {name} applied"))
    }

    /// A List big enough for several units: emitted a unit at a time, with the same objects and errors as one
    /// thread reading its items in order, and a duplicate in a later unit still loses to the first
    /// definition, named by its item.
    #[test]
    fn a_big_json_list_is_read_in_parallel_and_emitted_in_item_order() {
        let n = 30000;
        let item = |i: usize, ip: String| {
            format!(
                r#"{{"metadata": {{"name": "s{i}", "namespace": "demo"}}, "spec": {{"clusterIP": "{ip}", "ports": [{{"name": "tcp", "port": 80, "protocol": "TCP", "targetPort": 8080}}]}}}}"#
            )
        };
        let mut items: Vec<String> = (0..n)
            .map(|i| item(i, format!("10.96.{}.{}", i / 250, i % 250 + 1)))
            .collect();
        items[n / 2] = item(n / 2, "10.96.0.300".into());
        items.push(item(1, "10.99.0.1".into()));
        let text = format!(
            r#"{{"apiVersion": "v1", "kind": "ServiceList", "items": [{}]}}"#,
            items.join(",\n")
        );
        assert!(
            text.len() > 4 * UNIT_BYTES,
            "test bug: too small for several units ({} bytes)",
            text.len()
        );
        let dir = TempDir::new("big-list");
        dir.write("list.json", &text);
        let mut batches = Vec::new();
        let errors =
            ManifestSource::new(dir.0.clone())
                .initial_streamed(&mut |batch: Vec<Event>| batches.push(batch));
        assert!(batches.len() > 4, "one batch per unit, as each is parsed");
        assert_eq!(batches.pop(), Some(vec![Event::Synced]));
        let events: Vec<Event> = batches.into_iter().flatten().collect();
        assert_eq!(events.len(), n - 1, "every valid service once");
        let reasons: Vec<&str> = errors.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(errors.len(), 2, "{reasons:?}");
        assert!(reasons[0].starts_with(&format!("items[{}]: invalid clusterIP", n / 2)));
        assert!(reasons[1].starts_with(&format!("items[{n}]: duplicate Service")));
        assert_eq!(errors[1].object.as_deref(), Some("demo/s1"));
        assert_eq!(
            service_ports(&events, "s1")[0].cluster_ips[0].to_string(),
            "10.96.0.2"
        );
    }

    #[test]
    fn split_documents_markers() {
        let docs = split_documents(
            "%YAML 1.2\n---\na: 1\n--- # c\nb: 2\n...\n---\n\n# c\n---\nc: '---'\n",
        );
        assert_eq!(docs, ["\na: 1\n", " # c\nb: 2\n", "\nc: '---'\n"]);
        assert_eq!(split_documents("a: 1\n----x: 2\n"), ["a: 1\n----x: 2\n"]);
        assert!(split_documents("\n# nothing\n---\n").is_empty());
    }

    #[test]
    fn examples_directory_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
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
        let echo_udp = crate::model::ServicePortName {
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
        let echo6_tcp = crate::model::ServicePortName {
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
