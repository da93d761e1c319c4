//! A loopback HTTP server that speaks the Kubernetes API's list + watch protocol for Services,
//! EndpointSlices, Nodes and ServiceCIDRs, so that the real agent can be driven without a kube-apiserver.
//!
//! What it does as the API server does:
//! - every change bumps a global `resourceVersion`; objects carry theirs in `metadata.resourceVersion`;
//! - lists answer `{"kind":"…List","metadata":{"resourceVersion":RV,"continue":…},"items":[…]}`, honour
//!   `limit` / `continue` (pages), `labelSelector` (`k`, `!k`, `k=v`, `k!=v`) and `fieldSelector`
//!   (`metadata.name=`, `metadata.namespace=`);
//! - `watch=true` streams newline-delimited JSON events (ADDED, MODIFIED, DELETED) after the given
//!   resourceVersion over chunked transfer encoding, sends BOOKMARK events when asked
//!   (`allowWatchBookmarks`), ends after `timeoutSeconds`, and answers a resourceVersion older than the
//!   compacted history with an ERROR event carrying a `410 Gone` Status, as etcd compaction makes it do;
//! - an object that stops matching a watch's label selector is sent as DELETED.
//!
//! Test controls: [`FakeApi::apply`] / [`FakeApi::delete`], [`FakeApi::compact`] (force 410 on re-watch),
//! [`FakeApi::drop_watches`] (connections cut), [`FakeApi::set_down`] (listener closed: connection
//! refused), [`FakeApi::fail`] (answer a resource with an HTTP error), and a log of the requests.

use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The resources served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    /// core/v1 Services.
    Services,
    /// discovery.k8s.io/v1 EndpointSlices.
    EndpointSlices,
    /// core/v1 Nodes.
    Nodes,
    /// networking.k8s.io/v1 ServiceCIDRs.
    ServiceCidrs,
}

impl Resource {
    /// The collection's path on the API server.
    pub fn path(self) -> &'static str {
        match self {
            Resource::Services => "/api/v1/services",
            Resource::EndpointSlices => "/apis/discovery.k8s.io/v1/endpointslices",
            Resource::Nodes => "/api/v1/nodes",
            Resource::ServiceCidrs => "/apis/networking.k8s.io/v1/servicecidrs",
        }
    }
    fn kind(self) -> &'static str {
        match self {
            Resource::Services => "Service",
            Resource::EndpointSlices => "EndpointSlice",
            Resource::Nodes => "Node",
            Resource::ServiceCidrs => "ServiceCIDR",
        }
    }
    fn api_version(self) -> &'static str {
        match self {
            Resource::EndpointSlices => "discovery.k8s.io/v1",
            Resource::ServiceCidrs => "networking.k8s.io/v1",
            _ => "v1",
        }
    }
    /// The resource of an object, by its `kind`.
    pub fn of(obj: &Value) -> Option<Resource> {
        match obj.get("kind")?.as_str()? {
            "Service" => Some(Resource::Services),
            "EndpointSlice" => Some(Resource::EndpointSlices),
            "Node" => Some(Resource::Nodes),
            "ServiceCIDR" => Some(Resource::ServiceCidrs),
            _ => None,
        }
    }
}

type Key = (Resource, String, String);

#[derive(Debug, Clone)]
struct Entry {
    rv: u64,
    resource: Resource,
    kind: &'static str,
    object: Value,
}

/// An object and its JSON text, serialized once when it is applied: a list page is the texts of its objects
/// put together, so serving a page costs the server little beside the client it serves.
#[derive(Debug)]
struct Stored {
    value: Value,
    json: String,
}

impl Stored {
    fn new(value: Value) -> Stored {
        Stored {
            json: value.to_string(),
            value,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    rv: u64,
    objects: BTreeMap<Key, Stored>,
    log: Vec<Entry>,
    /// Watches from before this resourceVersion get 410 Gone.
    compacted: u64,
    /// Bumped to cut every open watch.
    generation: u64,
    down: bool,
    fail: HashMap<Resource, u16>,
    requests: Vec<String>,
    /// Events (events.k8s.io/v1) created or patched, as last written.
    events: BTreeMap<(String, String), Value>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
}

/// Binds the listening socket (in whatever network namespace the test needs).
pub type Binder = Arc<dyn Fn(SocketAddr) -> io::Result<TcpListener> + Send + Sync>;

/// The fake API server. Stops (and closes its port) on drop.
pub struct FakeApi {
    shared: Arc<Shared>,
    addr: SocketAddr,
    binder: Binder,
    accept: Mutex<Option<JoinHandle<()>>>,
}

fn key_of(resource: Resource, obj: &Value) -> Key {
    let meta = &obj["metadata"];
    (
        resource,
        meta["namespace"].as_str().unwrap_or("").to_string(),
        meta["name"].as_str().unwrap_or("").to_string(),
    )
}

impl FakeApi {
    /// A fake API server listening on 127.0.0.1 inside `ns` (rebinds there after an outage, too).
    pub fn in_namespace(ns: &nftkube_sandbox::netns::NetNs) -> FakeApi {
        let name = ns.name().to_string();
        FakeApi::start_with(Arc::new(move |a| {
            nftkube_sandbox::netns::NetNs::open_existing(&name)
                .map_err(|e| std::io::Error::other(e.to_string()))?
                .run(move || TcpListener::bind(a))?
        }))
    }

    /// Serves on 127.0.0.1 (an ephemeral port) of the current network namespace.
    pub fn start() -> FakeApi {
        Self::start_with(Arc::new(TcpListener::bind))
    }

    /// Serves on a socket `binder` creates (e.g. inside a test namespace); port chosen by the kernel.
    pub fn start_with(binder: Binder) -> FakeApi {
        let listener = binder("127.0.0.1:0".parse().unwrap()).expect("binding the fake API server");
        let addr = listener.local_addr().unwrap();
        let api = FakeApi {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
                stop: AtomicBool::new(false),
            }),
            addr,
            binder,
            accept: Mutex::new(None),
        };
        api.serve(listener);
        api
    }

    fn serve(&self, listener: TcpListener) {
        listener.set_nonblocking(true).unwrap();
        let shared = self.shared.clone();
        let thread = std::thread::Builder::new()
            .name("fake-api".into())
            .spawn(move || loop {
                // Read with the down flag, before the accept: a connection accepted while an outage begins
                // belongs to the generation before it, and is cut with the others.
                let generation = {
                    let st = shared.state.lock().unwrap();
                    if shared.stop.load(Ordering::SeqCst) || st.down {
                        return; // drops the listener: connections are refused
                    }
                    st.generation
                };
                match listener.accept() {
                    Ok((stream, _)) => {
                        let s = shared.clone();
                        std::thread::spawn(move || {
                            let _ = handle(&s, stream, generation);
                        });
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait_readable(&listener, 5),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            })
            .unwrap();
        *self.accept.lock().unwrap() = Some(thread);
    }

    /// `http://127.0.0.1:PORT`, for `--master`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn change(&self, f: impl FnOnce(&mut State)) {
        let mut st = self.shared.state.lock().unwrap();
        f(&mut st);
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Creates or replaces an object (its `kind` says which resource); returns its resourceVersion.
    pub fn apply(&self, obj: Value) -> u64 {
        let resource =
            Resource::of(&obj).expect("object kind Service, EndpointSlice, Node or ServiceCIDR");
        let mut rv = 0;
        self.change(|st| {
            st.rv += 1;
            rv = st.rv;
            let mut obj = obj;
            obj["metadata"]["resourceVersion"] = json!(rv.to_string());
            let key = key_of(resource, &obj);
            let kind = if st.objects.insert(key, Stored::new(obj.clone())).is_some() {
                "MODIFIED"
            } else {
                "ADDED"
            };
            st.log.push(Entry {
                rv,
                resource,
                kind,
                object: obj,
            });
        });
        rv
    }

    /// Deletes an object; false if it did not exist.
    pub fn delete(&self, resource: Resource, namespace: &str, name: &str) -> bool {
        let mut found = false;
        self.change(|st| {
            if let Some(Stored { value: mut obj, .. }) =
                st.objects
                    .remove(&(resource, namespace.to_string(), name.to_string()))
            {
                found = true;
                st.rv += 1;
                obj["metadata"]["resourceVersion"] = json!(st.rv.to_string());
                let rv = st.rv;
                st.log.push(Entry {
                    rv,
                    resource,
                    kind: "DELETED",
                    object: obj,
                });
            }
        });
        found
    }

    /// Current objects of a resource.
    pub fn objects(&self, resource: Resource) -> Vec<Value> {
        let st = self.shared.state.lock().unwrap();
        st.objects
            .iter()
            .filter(|(k, _)| k.0 == resource)
            .map(|(_, v)| v.value.clone())
            .collect()
    }

    /// Forgets the history: a watch from any earlier resourceVersion gets 410 Gone (and the client must
    /// relist).
    pub fn compact(&self) {
        self.change(|st| {
            st.compacted = st.rv + 1;
            st.log.clear();
        });
    }

    /// Ends every open watch now (as a load balancer or an apiserver restart does).
    pub fn drop_watches(&self) {
        self.change(|st| st.generation += 1);
    }

    /// Down: open watches are cut and the port refuses connections. Up: the same port serves again.
    pub fn set_down(&self, down: bool) {
        if down {
            self.change(|st| {
                st.down = true;
                st.generation += 1;
            });
            if let Some(t) = self.accept.lock().unwrap().take() {
                let _ = t.join();
            }
        } else {
            let mut last = None;
            // The port may linger briefly after close; retry the bind for a while.
            for _ in 0..100 {
                match (self.binder)(self.addr) {
                    Ok(l) => {
                        self.change(|st| st.down = false);
                        self.serve(l);
                        return;
                    }
                    Err(e) => last = Some(e),
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            panic!("cannot rebind {}: {last:?}", self.addr);
        }
    }

    /// Answers lists and watches of `resource` with this HTTP status (None: serve normally).
    pub fn fail(&self, resource: Resource, status: Option<u16>) {
        self.change(|st| match status {
            Some(s) => {
                st.fail.insert(resource, s);
                st.generation += 1;
            }
            None => {
                st.fail.remove(&resource);
            }
        });
    }

    /// Request lines received so far ("GET /api/v1/services?…").
    pub fn requests(&self) -> Vec<String> {
        self.shared.state.lock().unwrap().requests.clone()
    }

    /// The Events posted so far (events.k8s.io/v1), as last written: a series patch replaces its event.
    pub fn events(&self) -> Vec<Value> {
        self.shared
            .state
            .lock()
            .unwrap()
            .events
            .values()
            .cloned()
            .collect()
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.change(|st| st.generation += 1);
        if let Some(t) = self.accept.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(target: &str) -> (String, HashMap<String, String>) {
    let (path, q) = target.split_once('?').unwrap_or((target, ""));
    let params = q
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect();
    (path.to_string(), params)
}

/// Label selector requirements, comma-separated: `k`, `!k`, `k=v`, `k==v`, `k!=v`.
fn labels_match(selector: &str, obj: &Value) -> bool {
    let labels = &obj["metadata"]["labels"];
    selector
        .split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .all(|r| {
            if let Some(k) = r.strip_prefix('!') {
                labels.get(k).is_none()
            } else if let Some((k, v)) = r.split_once("!=") {
                labels.get(k).and_then(Value::as_str) != Some(v)
            } else if let Some((k, v)) = r.split_once('=') {
                labels.get(k).and_then(Value::as_str) == Some(v.trim_start_matches('='))
            } else {
                labels.get(r).is_some()
            }
        })
}

fn fields_match(selector: &str, obj: &Value) -> bool {
    selector
        .split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .all(|r| match r.split_once('=') {
            Some((path, v)) => {
                let mut cur = obj;
                for part in path.split('.') {
                    cur = &cur[part];
                }
                cur.as_str().unwrap_or("") == v.trim_start_matches('=')
            }
            None => false,
        })
}

/// Waits until `listener` has a connection to accept, at most `ms` milliseconds: a connection is taken at
/// once, and the stop and down flags are still looked at every few milliseconds.
fn wait_readable(listener: &TcpListener, ms: i32) {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for a socket this thread owns; poll only writes its revents.
    unsafe { libc::poll(&mut fd, 1, ms) };
}

fn write_response(stream: &mut TcpStream, status: u16, body: &str) -> io::Result<()> {
    let reason = match status {
        200 => "OK",
        201 => "Created",
        404 => "Not Found",
        410 => "Gone",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    };
    write!(
        stream,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

fn status_body(code: u16, reason: &str, message: &str) -> String {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
    .to_string()
}

/// An Event created (POST …/namespaces/NS/events) or a series update of one (PATCH …/events/NAME, a merge
/// of the fields sent): stored, and answered with the stored object, as the API server does.
fn event(
    shared: &Shared,
    stream: &mut TcpStream,
    method: &str,
    path: &str,
    body: &[u8],
) -> io::Result<()> {
    let sent: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let segments: Vec<&str> = path.split('/').collect();
    // ["", "apis", "events.k8s.io", "v1", "namespaces", NS, "events", NAME?]
    let namespace = segments.get(5).copied().unwrap_or("").to_string();
    let mut st = shared.state.lock().unwrap();
    let stored = match (method, segments.get(7)) {
        ("POST", None) => {
            let name = sent["metadata"]["name"].as_str().unwrap_or("").to_string();
            let mut obj = sent;
            obj["metadata"]["namespace"] = json!(namespace);
            st.events.insert((namespace, name), obj.clone());
            obj
        }
        ("PATCH", Some(name)) => match st.events.get_mut(&(namespace, name.to_string())) {
            Some(obj) => {
                merge(obj, &sent);
                obj.clone()
            }
            None => {
                return write_response(stream, 404, &status_body(404, "NotFound", "no such event"))
            }
        },
        _ => return write_response(stream, 405, &status_body(405, "MethodNotAllowed", "events")),
    };
    drop(st);
    let status = if method == "POST" { 201 } else { 200 };
    write_response(stream, status, &stored.to_string())
}

/// A JSON merge patch of `patch` into `obj`.
fn merge(obj: &mut Value, patch: &Value) {
    match (obj, patch) {
        (Value::Object(o), Value::Object(p)) => {
            for (k, v) in p {
                merge(o.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (o, p) => *o = p.clone(),
    }
}

fn handle(shared: &Shared, mut stream: TcpStream, generation: u64) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let request_line = line.trim_end().to_string();
    let mut content_length = 0;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((name, value)) = h.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                content_length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut parts = request_line.split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
    shared
        .state
        .lock()
        .unwrap()
        .requests
        .push(format!("{method} {target}"));
    let (path, params) = query(target);
    if path.starts_with("/apis/events.k8s.io/v1/") {
        let mut body = vec![0; content_length];
        reader.read_exact(&mut body)?;
        return event(shared, &mut stream, method, &path, &body);
    }
    let resource = [
        Resource::Services,
        Resource::EndpointSlices,
        Resource::Nodes,
        Resource::ServiceCidrs,
    ]
    .into_iter()
    .find(|r| r.path() == path);
    let Some(resource) = resource.filter(|_| method == "GET") else {
        return write_response(
            &mut stream,
            404,
            &status_body(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    if let Some(code) = shared.state.lock().unwrap().fail.get(&resource).copied() {
        return write_response(
            &mut stream,
            code,
            &status_body(code, "InternalError", "injected failure"),
        );
    }
    let labels = params.get("labelSelector").cloned().unwrap_or_default();
    let fields = params.get("fieldSelector").cloned().unwrap_or_default();
    let selected = |o: &Value| labels_match(&labels, o) && fields_match(&fields, o);
    if matches!(params.get("watch").map(String::as_str), Some("true" | "1")) {
        return watch(shared, stream, generation, resource, &params, &selected);
    }
    // A list, possibly one page of it.
    let st = shared.state.lock().unwrap();
    // The continue token names the list's resourceVersion and the last key served, as kube-apiserver's
    // does: the next page starts after that key, so a paged list of 100k objects costs each page its own
    // length.
    let (list_rv, after) = match params.get("continue").filter(|c| !c.is_empty()) {
        Some(c) => {
            let mut parts = c.splitn(3, '/');
            let rv = parts.next().and_then(|r| r.parse().ok()).unwrap_or(st.rv);
            let key: Key = (
                resource,
                parts.next().unwrap_or("").to_string(),
                parts.next().unwrap_or("").to_string(),
            );
            (rv, Bound::Excluded(key))
        }
        None => (
            st.rv,
            Bound::Included((resource, String::new(), String::new())),
        ),
    };
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let mut page: Vec<(&Key, &Stored)> = st
        .objects
        .range((after, Bound::Unbounded))
        .take_while(|(k, _)| k.0 == resource)
        .filter(|(_, v)| selected(&v.value))
        .take(limit.saturating_add(1))
        .collect();
    let more = page.len() > limit;
    page.truncate(limit);
    let last = page
        .last()
        .map(|(k, _)| format!("{list_rv}/{}/{}", k.1, k.2));
    let mut meta = json!({"resourceVersion": list_rv.to_string()});
    if let Some(token) = last.filter(|_| more) {
        meta["continue"] = json!(token);
    }
    let head =
        json!({"kind": format!("{}List", resource.kind()), "apiVersion": resource.api_version(),
                      "metadata": meta})
        .to_string();
    let items: Vec<&str> = page.iter().map(|(_, v)| v.json.as_str()).collect();
    // `{...head fields..., "items": [texts]}`: the head without its closing brace, then the items.
    let body = format!(
        "{},\"items\":[{}]}}",
        head.strip_suffix('}').expect("a JSON object"),
        items.join(",")
    );
    drop(st);
    write_response(&mut stream, 200, &body)
}

fn chunk(stream: &mut TcpStream, data: &str) -> io::Result<()> {
    write!(stream, "{:x}\r\n{data}\r\n", data.len())?;
    stream.flush()
}

fn watch(
    shared: &Shared,
    mut stream: TcpStream,
    generation: u64,
    resource: Resource,
    params: &HashMap<String, String>,
    selected: &dyn Fn(&Value) -> bool,
) -> io::Result<()> {
    let from: u64 = params
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = params.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let deadline = Instant::now()
        + Duration::from_secs(
            params
                .get("timeoutSeconds")
                .and_then(|t| t.parse().ok())
                .unwrap_or(290),
        );
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )?;
    let mut st = shared.state.lock().unwrap();
    if from != 0 && from < st.compacted {
        let ev = json!({"type": "ERROR", "object": serde_json::from_str::<Value>(
            &status_body(410, "Expired", &format!("too old resource version: {from} ({})", st.compacted)))
            .unwrap()});
        drop(st);
        chunk(&mut stream, &format!("{ev}\n"))?;
        return chunk(&mut stream, "");
    }
    let mut sent = from;
    if from == 0 {
        // No resourceVersion: the current objects as ADDED first, as the API server does.
        let initial: Vec<Value> = st
            .objects
            .iter()
            .filter(|(k, v)| k.0 == resource && selected(&v.value))
            .map(|(_, v)| json!({"type": "ADDED", "object": v.value}))
            .collect();
        sent = st.rv;
        drop(st);
        for ev in initial {
            chunk(&mut stream, &format!("{ev}\n"))?;
        }
        st = shared.state.lock().unwrap();
    }
    let mut last_bookmark = Instant::now();
    loop {
        if st.generation != generation || shared.stop.load(Ordering::SeqCst) {
            return Ok(()); // cut: no terminating chunk, like a dropped connection
        }
        let mut out = Vec::new();
        // The log is in resourceVersion order: a wake-up costs what is new, not the whole history.
        let first = st.log.partition_point(|e| e.rv <= sent);
        for e in st.log[first..].iter().filter(|e| e.resource == resource) {
            let kind = if e.kind != "DELETED" && !selected(&e.object) {
                "DELETED"
            } else if e.kind == "DELETED" && !selected(&e.object) {
                continue;
            } else {
                e.kind
            };
            out.push(json!({"type": kind, "object": e.object}).to_string());
        }
        sent = st.rv;
        let bookmark =
            (bookmarks && last_bookmark.elapsed() >= Duration::from_millis(500)).then(|| {
                json!({"type": "BOOKMARK", "object": {"kind": resource.kind(),
                    "apiVersion": resource.api_version(),
                    "metadata": {"resourceVersion": st.rv.to_string()}}})
                .to_string()
            });
        drop(st);
        for line in out {
            chunk(&mut stream, &format!("{line}\n"))?;
        }
        if let Some(b) = bookmark {
            last_bookmark = Instant::now();
            chunk(&mut stream, &format!("{b}\n"))?;
        }
        if Instant::now() >= deadline {
            return chunk(&mut stream, "");
        }
        st = shared.state.lock().unwrap();
        let (guard, _) = shared
            .changed
            .wait_timeout(st, Duration::from_millis(200))
            .unwrap();
        st = guard;
    }
}

/// Converts YAML manifests (multi-document) into API objects.
pub fn objects_from_yaml(text: &str) -> Vec<Value> {
    text.split("\n---")
        .filter(|d| !d.trim().is_empty())
        .filter_map(|d| nftkube::yaml::parse_document(d).ok())
        .filter(|v| v.is_object())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors() {
        let o = json!({"metadata": {"name": "a", "namespace": "ns",
            "labels": {"kubernetes.io/service-name": "web", "x": "1"}}});
        assert!(labels_match("!service.kubernetes.io/headless,x", &o));
        assert!(!labels_match("!x", &o));
        assert!(labels_match("kubernetes.io/service-name=web", &o));
        assert!(labels_match("x!=2", &o));
        assert!(fields_match("metadata.name=a", &o));
        assert!(!fields_match("metadata.name=b", &o));
        assert_eq!(percent_decode("%21a%2Fb%2Cc"), "!a/b,c");
    }
}
