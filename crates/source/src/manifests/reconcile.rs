//! Which files changed since the last read (their stamps), and what a read's objects mean against what
//! was emitted before: the Applied and Deleted events between the two, with the policy's exceptions (an
//! object whose document failed keeps its last good version or closes; a file with a failure keeps
//! everything it produced; an unreadable path deletes nothing).

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use super::decode::duplicate_error;
use super::snapshot::{applied, Object, ObjectKey, ObjectKind, Origin, Snapshot};
use super::SourceError;
use crate::fail_closed::ExposedServices;
use crate::{fingerprint, Event};

/// What was emitted for one object: a fingerprint of it, and the file it came from (a failure in that file
/// protects it from deletion).
#[derive(Debug)]
pub(super) struct Emitted {
    print: u64,
    pub(super) path: Arc<PathBuf>,
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
pub(super) struct FileStamp {
    pub(super) modified: Option<SystemTime>,
    pub(super) ctime: (i64, i64),
    pub(super) size: u64,
    pub(super) inode: u64,
}

pub(super) type Fingerprint = Result<BTreeMap<PathBuf, FileStamp>, String>;

/// The first read, emitted while it is parsed: of each part, the objects no earlier part defined (the first
/// definition wins, as in `merge`), and what `emitted` keeps of them.
#[derive(Default)]
pub(super) struct FirstRead {
    seen: BTreeMap<ObjectKey, (u64, Origin)>,
    errors: Vec<SourceError>,
    exposed: ExposedServices,
}

impl FirstRead {
    /// The Applied events of `part`'s new objects.
    pub(super) fn take(&mut self, part: Snapshot) -> Vec<Event> {
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
    pub(super) fn finish(self) -> (Vec<(ObjectKey, Emitted)>, ExposedServices, Vec<SourceError>) {
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
pub(super) fn reconcile(
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
pub(super) fn changed_files(
    before: Option<&Fingerprint>,
    now: &Fingerprint,
) -> Option<BTreeSet<PathBuf>> {
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

#[cfg(test)]
mod tests {
    use crate::manifests::test_support::{names, service, slice, TempDir};
    use crate::manifests::ManifestSource;
    use crate::Event;

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
}
