//! Decoding one document (YAML or JSON, one object or a List) into the snapshot: its Services and
//! EndpointSlices converted to model objects under their keys, or an error naming the file, the document,
//! the List item and the object, and what a failure protects (the object's last good version, or the
//! whole file's when the object cannot be identified).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::Value;

use super::snapshot::{applied, report, Object, ObjectKey, ObjectKind, Origin, Snapshot};
use super::SourceError;
use crate::convert::{self, ServiceConversion, SliceConversion};
use crate::fail_closed::{asks_source_ranges, value_asks_source_ranges};
use crate::Event;
use nftkube_model::SharedValues;

/// One document of a file, ready to parse.
pub(super) struct Document<'a> {
    pub(super) path: &'a Arc<PathBuf>,
    pub(super) index: usize,
    pub(super) text: &'a str,
    pub(super) json: bool,
}

/// A file's documents: a JSON file is one; a YAML stream is split at its markers (see `split_documents`).
pub(super) fn documents_of<'a>(path: &'a Arc<PathBuf>, text: &'a str) -> Vec<Document<'a>> {
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
pub(super) struct RawList<'a> {
    pub(super) kind: String,
    #[serde(rename = "apiVersion", default)]
    pub(super) api_version: String,
    #[serde(borrow)]
    pub(super) items: Vec<&'a serde_json::value::RawValue>,
}

/// The kind (and apiVersion) a typed List (`ServiceList`) gives its items; None for a plain `List`.
pub(super) fn list_item_kind<'k>(
    kind: &'k str,
    api_version: &'k str,
) -> Option<(&'k str, &'k str)> {
    let element_kind = kind.strip_suffix("List").filter(|k| !k.is_empty());
    element_kind.map(|k| (k, api_version))
}

pub(super) fn is_list_kind(kind: &str) -> bool {
    matches!(kind, "List" | "ServiceList" | "EndpointSliceList")
}

pub(super) fn parse_document(d: &Document, snap: &mut Snapshot) {
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
        nftkube_yaml::parse_document(d.text).map_err(|e| format!("invalid YAML: {e}"))
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

pub(super) struct DocContext<'a> {
    pub(super) path: &'a Arc<PathBuf>,
    pub(super) document: usize,
    pub(super) snap: &'a mut Snapshot,
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
    /// `units::BigList`).
    fn raw_list(&mut self, list: RawList) {
        let items: Vec<(usize, &str)> = list.items.iter().map(|r| r.get()).enumerate().collect();
        self.raw_items(&items, list_item_kind(&list.kind, &list.api_version));
    }

    /// Items of a JSON List, each with its index in the list.
    pub(super) fn raw_items(
        &mut self,
        items: &[(usize, &str)],
        default_kind: Option<(&str, &str)>,
    ) {
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
            crate::validate::shortened(namespace),
            crate::validate::shortened(name)
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

/// A second definition of `key`, at `origin`: ignored.
pub(super) fn duplicate_error(key: &ObjectKey, origin: &Origin, first: &Origin) -> SourceError {
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
    use crate::manifests::test_support::{names, service, TempDir};
    use crate::manifests::ManifestSource;
    use nftkube_model::Protocol;

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
    fn lists_json_and_fqdn_slices() {
        let dir = TempDir::new("list");
        dir.write(
            "list.yaml",
            &format!(
                "apiVersion: v1\nkind: List\nitems:\n- {}\n- kind: ConfigMap\n  metadata: {{name: x}}\n",
                serde_json::to_string(&nftkube_yaml::parse_document(&service("a", "10.96.0.1")).unwrap()).unwrap()
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
    fn split_documents_markers() {
        let docs = split_documents(
            "%YAML 1.2\n---\na: 1\n--- # c\nb: 2\n...\n---\n\n# c\n---\nc: '---'\n",
        );
        assert_eq!(docs, ["\na: 1\n", " # c\nb: 2\n", "\nc: '---'\n"]);
        assert_eq!(split_documents("a: 1\n----x: 2\n"), ["a: 1\n----x: 2\n"]);
        assert!(split_documents("\n# nothing\n---\n").is_empty());
    }
}
