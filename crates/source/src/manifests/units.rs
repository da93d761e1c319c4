//! The parallel read: a batch of documents cut into units of about [`UNIT_BYTES`] (runs of whole
//! documents, or runs of one big JSON List's items), parsed on every CPU, and their snapshots merged back
//! in the documents' order, so that the first definition of an object still wins.

use super::decode::{
    duplicate_error, is_list_kind, list_item_kind, parse_document, DocContext, Document, RawList,
};
use super::snapshot::{report, Snapshot};

/// Parses `documents` on every CPU, in units of about [`UNIT_BYTES`], and hands each unit's snapshot to
/// `part` in the documents' order, as soon as it and the units before it are parsed.
pub(super) fn parse_in_order(documents: &[Document], part: &mut dyn FnMut(Snapshot)) {
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
    crate::in_order::map_in_order(&units, Unit::parse, part);
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
pub(super) fn merge(into: &mut Snapshot, part: Snapshot) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifests::decode::documents_of;
    use crate::manifests::test_support::{service, TempDir};
    use crate::manifests::ManifestSource;
    use crate::Event;
    use nftkube_model::ServicePort;
    use std::path::PathBuf;
    use std::sync::Arc;

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
}
