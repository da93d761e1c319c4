//! The admin endpoints' HTTP/1 server, on hyper: GET (and HEAD) of a path answered from memory by a
//! [`Handler`], with connection limits no single client can use to starve the others, and timeouts.
//!
//! hyper parses requests (a malformed one is answered 400, a head larger than [`MAX_HEAD`] 431) and keeps
//! connections alive unless the client says `Connection: close`.
//!
//! Why the limits look as they do: these servers answer load balancers' health checks (healthCheckNodePorts,
//! `/healthz`) and the kubelet's liveness probe (`/livez`), on ports any pod can reach. An earlier version
//! took one of 64 slots before each `accept()`: 64 idle connections from one pod filled them, the rest
//! waited in the listen backlog, and every probe timed out while the pod held them (the node was drained,
//! the agent restarted). So the accept loop never waits: it accepts every connection first, then decides,
//! at a cost bounded per connection (a hash lookup, at worst a scan of the sources of a full listener):
//! - a source address holding [`Limits::per_source`] connections to this listener has its new one closed
//!   at once: one peer cannot take more than that, whatever it opens;
//! - a listener holding [`Limits::connections`] (many sources, each under its cap) makes room by closing the
//!   oldest connection of the source holding the most, unless the new connection's source already holds as
//!   many as any other (then the new one is closed). A prober with one connection is never the one closed
//!   while another source holds two. The handlers answer from memory, so a held connection is idle nearly
//!   all its life: closing one loses at most a keep-alive;
//! - [`Limits::header_read`]: from the moment the server waits for a request head (a new connection, or a
//!   kept-alive one after its last answer) the whole head must arrive within it, else the connection is
//!   closed. This is also the idle timeout of kept-alive connections: short, so that what is held is
//!   returned soon;
//! - [`Limits::lifetime`]: no connection lives longer, whatever it does (a client that never reads its
//!   answer).
//!
//! Connections closed by the first two rules are counted in `CONNECTIONS_REFUSED`
//! (`nftkube_admin_connections_refused_total{listener, reason}`).
//!
//! It runs on the admin thread's tokio runtime, so thousands of healthCheckNodePort listeners cost tasks,
//! not threads.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// Longest request head accepted (hyper's read buffer limit; above it the answer is 431).
pub(crate) const MAX_HEAD: usize = 8192;

/// How long and how many connections a server accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections one listener serves at once; when reached, room is made (see the module's doc).
    pub(crate) connections: usize,
    /// Connections one source address may hold on one listener; more are closed at once.
    pub(crate) per_source: usize,
    /// Time for a whole request head, counted from when the server starts waiting for it (idle included).
    pub(crate) header_read: Duration,
    /// Longest life of a connection.
    pub(crate) lifetime: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // File descriptors: the agent raises its soft limit to the hard one at start; 512 per listener
            // is far above what probes and scrapes use, and bounds what a crowd of sources can take.
            connections: 512,
            // A load balancer's prober, the kubelet or a scraper hold one or two connections each.
            per_source: 8,
            header_read: Duration::from_secs(3),
            lifetime: Duration::from_secs(60),
        }
    }
}

/// Which server a listener belongs to: the `listener` label of
/// `nftkube_admin_connections_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServerKind {
    /// `/healthz` and `/livez`.
    Healthz,
    /// `/metrics`.
    Metrics,
    /// A healthCheckNodePort.
    HealthCheck,
}

impl ServerKind {
    const ALL: [ServerKind; 3] = [
        ServerKind::Healthz,
        ServerKind::Metrics,
        ServerKind::HealthCheck,
    ];

    fn label(self) -> &'static str {
        match self {
            ServerKind::Healthz => "healthz",
            ServerKind::Metrics => "metrics",
            ServerKind::HealthCheck => "health_check",
        }
    }
}

/// Why a connection was closed by the limits: the `reason` label of [`CONNECTIONS_REFUSED`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// A new connection from a source already holding [`Limits::per_source`].
    PerSource,
    /// A new connection to a full listener, from a source holding as many as any other.
    ListenerFull,
    /// An older connection closed to make room for a new one on a full listener.
    Evicted,
}

impl Refusal {
    const ALL: [Refusal; 3] = [Refusal::PerSource, Refusal::ListenerFull, Refusal::Evicted];

    fn label(self) -> &'static str {
        match self {
            Refusal::PerSource => "per_source_limit",
            Refusal::ListenerFull => "listener_full",
            Refusal::Evicted => "evicted",
        }
    }
}

/// The label set of [`CONNECTIONS_REFUSED`]: both values come from fixed lists (never a client address).
type RefusedLabels = [(&'static str, &'static str); 2];

/// Connections the limits closed, by listener kind and reason
/// (`nftkube_admin_connections_refused_total{listener, reason}`).
pub(crate) static CONNECTIONS_REFUSED: LazyLock<Family<RefusedLabels, Counter>> =
    LazyLock::new(Family::default);

fn count_refusal(kind: ServerKind, why: Refusal) {
    CONNECTIONS_REFUSED
        .get_or_create(&[("listener", kind.label()), ("reason", why.label())])
        .inc();
}

/// Registers [`CONNECTIONS_REFUSED`], every label pair present from the start at 0.
pub(crate) fn register_metrics(registry: &mut Registry) {
    for kind in ServerKind::ALL {
        for why in Refusal::ALL {
            let _ = CONNECTIONS_REFUSED
                .get_or_create(&[("listener", kind.label()), ("reason", why.label())]);
        }
    }
    registry.register(
        "nftkube_admin_connections_refused",
        "Admin and healthCheckNodePort connections closed by the per-source or per-listener limits",
        (*CONNECTIONS_REFUSED).clone(),
    );
}

/// A request as handlers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The request method ("GET", "HEAD", ...).
    pub(crate) method: String,
    /// The path without the query.
    pub(crate) path: String,
    /// The `Accept` header, when there is one readable as text (`/metrics` picks its format by it).
    pub(crate) accept: Option<String>,
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status code.
    pub(crate) status: u16,
    /// The `Content-Type` header.
    pub content_type: &'static str,
    /// Further headers.
    pub headers: Vec<(&'static str, String)>,
    /// The body (empty for HEAD).
    pub(crate) body: String,
}

impl Response {
    /// A response with this status, content type and body.
    pub fn new(status: u16, content_type: &'static str, body: impl Into<String>) -> Self {
        Response {
            status,
            content_type,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// A `text/plain` response.
    pub(crate) fn text(status: u16, body: impl Into<String>) -> Self {
        Self::new(status, "text/plain; charset=utf-8", body)
    }

    /// Adds a header.
    pub(crate) fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    /// The hyper response (hyper adds Content-Length, and leaves the body out for HEAD).
    fn into_hyper(self) -> hyper::Response<Full<Bytes>> {
        let mut builder = hyper::Response::builder()
            .status(self.status)
            .header(hyper::header::CONTENT_TYPE, self.content_type);
        for (name, value) in &self.headers {
            builder = builder.header(*name, value.as_str());
        }
        builder
            .body(Full::new(Bytes::from(self.body)))
            .unwrap_or_else(|e| {
                // Only a handler's invalid header value can get here: say so rather than panic.
                tracing::error!("admin handler built an invalid response: {e}");
                let mut r =
                    hyper::Response::new(Full::new(Bytes::from_static(b"internal error\n")));
                *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
                r
            })
    }
}

/// What answers requests.
pub(crate) type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Answers one request: GET and HEAD go to the handler, other methods get 405.
fn answer(req: &hyper::Request<Incoming>, handler: &Handler) -> Response {
    let method = req.method();
    if method != hyper::Method::GET && method != hyper::Method::HEAD {
        return Response::text(405, "method not allowed\n").header("Allow", "GET, HEAD");
    }
    handler(&Request {
        method: method.as_str().to_string(),
        path: req.uri().path().to_string(),
        accept: req
            .headers()
            .get(hyper::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
    })
}

/// Serves one connection until it closes, a timeout ends it, or its lifetime is over.
pub(crate) async fn handle_connection(stream: TcpStream, handler: Handler, limits: Limits) {
    let service = service_fn(move |req: hyper::Request<Incoming>| {
        let response = answer(&req, &handler).into_hyper();
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(limits.lifetime, connection).await {
        Ok(Ok(())) => {}
        // Clients that go away, send junk or time out: nothing to do about them but close.
        Ok(Err(e)) => tracing::debug!("admin connection ended: {e}"),
        Err(_) => tracing::debug!("admin connection closed at the end of its lifetime"),
    }
}

/// One live connection in a [`ConnectionTable`]: dropping it ends the connection.
#[derive(Debug)]
struct Held {
    id: u64,
    /// Never sent on: its drop wakes the connection's task, which then closes the connection.
    _close: oneshot::Sender<()>,
}

/// The connections one listener holds, by source address, to apply [`Limits`] at accept time.
#[derive(Debug)]
struct ConnectionTable {
    limits: Limits,
    next_id: u64,
    /// Oldest first within each source.
    by_source: HashMap<IpAddr, VecDeque<Held>>,
    total: usize,
}

/// A connection admitted by a [`ConnectionTable`]: resolves `closed` when the table evicts it, and leaves
/// the table when dropped (the connection's task ends).
#[derive(Debug)]
struct Admitted {
    table: Arc<Mutex<ConnectionTable>>,
    source: IpAddr,
    id: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        lock(&self.table).release(self.source, self.id);
    }
}

/// The table. Nothing panics while holding it; were something to, the table would still be the best
/// record of the connections there is, so a poisoned lock is taken over rather than propagated.
fn lock(table: &Mutex<ConnectionTable>) -> std::sync::MutexGuard<'_, ConnectionTable> {
    table.lock().unwrap_or_else(|e| e.into_inner())
}

impl ConnectionTable {
    fn new(limits: Limits) -> Self {
        ConnectionTable {
            limits,
            next_id: 0,
            by_source: HashMap::new(),
            total: 0,
        }
    }

    fn held_by(&self, source: IpAddr) -> usize {
        self.by_source.get(&source).map_or(0, VecDeque::len)
    }

    /// Takes a new connection from `source`: its id and what resolves when it is evicted, or why it must
    /// be closed at once. Evictions made to admit it are counted for `kind`.
    fn admit(
        &mut self,
        source: IpAddr,
        kind: ServerKind,
    ) -> Result<(u64, oneshot::Receiver<()>), Refusal> {
        if self.held_by(source) >= self.limits.per_source.max(1) {
            return Err(Refusal::PerSource);
        }
        if self.total >= self.limits.connections.max(1) {
            self.evict_for(source)?;
            count_refusal(kind, Refusal::Evicted);
        }
        let (close, closed) = oneshot::channel();
        let id = self.next_id;
        self.next_id += 1;
        self.by_source
            .entry(source)
            .or_default()
            .push_back(Held { id, _close: close });
        self.total += 1;
        Ok((id, closed))
    }

    /// Closes the oldest connection of the source holding the most (the oldest such connection when
    /// several hold as many), unless `source` holds as many already. A scan of at most
    /// [`Limits::connections`] sources.
    fn evict_for(&mut self, source: IpAddr) -> Result<(), Refusal> {
        let largest = self
            .by_source
            .iter()
            .filter_map(|(ip, held)| Some((held.len(), std::cmp::Reverse(held.front()?.id), *ip)))
            .max();
        let Some((most, _, victim)) = largest else {
            return Err(Refusal::ListenerFull);
        };
        if most <= self.held_by(source) {
            return Err(Refusal::ListenerFull);
        }
        if let Some(held) = self.by_source.get_mut(&victim) {
            // Dropping its sender wakes the connection's task, which closes it.
            held.pop_front();
            self.total -= 1;
            if held.is_empty() {
                self.by_source.remove(&victim);
            }
        }
        Ok(())
    }

    /// A connection ended (a no-op when it was evicted already).
    fn release(&mut self, source: IpAddr, id: u64) {
        let Some(held) = self.by_source.get_mut(&source) else {
            return;
        };
        if let Some(i) = held.iter().position(|h| h.id == id) {
            held.remove(i);
            self.total -= 1;
        }
        if held.is_empty() {
            self.by_source.remove(&source);
        }
    }
}

/// Accepts connections forever, each served on a task of its own, within the default [`Limits`].
pub(crate) async fn serve(listener: TcpListener, handler: Handler, kind: ServerKind) {
    serve_with(listener, handler, kind, Limits::default()).await
}

/// [`serve`] with other limits.
pub(crate) async fn serve_with(
    listener: TcpListener,
    handler: Handler,
    kind: ServerKind,
    limits: Limits,
) {
    let table = Arc::new(Mutex::new(ConnectionTable::new(limits)));
    loop {
        // Never wait for room before accepting: a full backlog would starve every other client.
        match listener.accept().await {
            Ok((stream, peer)) => {
                // An IPv4 client of a dual-stack listener is the same source as over IPv4.
                let source = peer.ip().to_canonical();
                admit_and_serve(&table, stream, source, handler.clone(), kind, limits);
            }
            Err(e) => {
                // Out of file descriptors and the like: do not spin.
                tracing::warn!("admin server accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves `stream` on a task of its own if the table admits it; else closes it at once.
fn admit_and_serve(
    table: &Arc<Mutex<ConnectionTable>>,
    stream: TcpStream,
    source: IpAddr,
    handler: Handler,
    kind: ServerKind,
    limits: Limits,
) {
    let admitted = lock(table).admit(source, kind);
    let (id, evicted) = match admitted {
        Ok(admitted) => admitted,
        Err(why) => {
            // Counted, not logged: a flood must not become a flood of log lines.
            count_refusal(kind, why);
            return; // dropping the stream closes it
        }
    };
    let slot = Admitted {
        table: table.clone(),
        source,
        id,
    };
    tokio::spawn(async move {
        tokio::select! {
            () = handle_connection(stream, handler, limits) => {}
            _ = evicted => {} // counted when it was evicted
        }
        drop(slot);
    });
}

/// An answer as [`get`] returns it: status, headers (names lower-cased), body.
pub type Reply = (u16, Vec<(String, String)>, String);

/// A blocking client for tests and probes: GET `path` from `addr`.
pub fn get(addr: std::net::SocketAddr, path: &str, timeout: Duration) -> std::io::Result<Reply> {
    let s = std::net::TcpStream::connect_timeout(&addr, timeout)?;
    get_on(s, addr, path, timeout)
}

/// [`get`] on a connection made already.
fn get_on(
    mut s: std::net::TcpStream,
    addr: std::net::SocketAddr,
    path: &str,
    timeout: Duration,
) -> std::io::Result<Reply> {
    use std::io::{Read, Write};
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad HTTP response");
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok((status, headers, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::SocketAddr;
    use std::time::Instant;

    /// A real server on 127.0.0.1 (an ephemeral port) in this process, on a thread of its own that ends
    /// after `life`.
    fn start(limits: Limits, life: Duration) -> SocketAddr {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = std_listener.local_addr().unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let handler: Handler = Arc::new(|req: &Request| {
            if req.path == "/hello" {
                Response::text(200, "hi\n").header("X-Seen-Method", req.method.clone())
            } else {
                Response::text(404, "not found\n")
            }
        });
        std::thread::spawn(move || {
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).unwrap();
                let _ = tokio::time::timeout(
                    life,
                    serve_with(listener, handler, ServerKind::Healthz, limits),
                )
                .await;
            })
        });
        addr
    }

    /// Sends `raw` on a fresh connection and reads until the server closes it.
    fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(raw).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn serves_over_loopback() {
        let addr = start(Limits::default(), Duration::from_secs(20));
        let t = Duration::from_secs(5);
        let (status, headers, body) = get(addr, "/hello?verbose=1", t).unwrap();
        assert_eq!((status, body.as_str()), (200, "hi\n"));
        assert!(headers.contains(&("connection".into(), "close".into())));
        assert!(headers.contains(&("content-length".into(), "3".into())));
        assert!(headers.contains(&("x-seen-method".into(), "GET".into())));
        assert_eq!(get(addr, "/nope", t).unwrap().0, 404);
        // A client that connects and says nothing does not block others.
        let idle = std::net::TcpStream::connect(addr).unwrap();
        assert_eq!(get(addr, "/hello", t).unwrap().0, 200);
        drop(idle);
        // Other methods are refused; junk is a 400; a head too large a 431.
        let huge = format!(
            "GET /hello HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "a".repeat(MAX_HEAD * 2)
        );
        for (req, want) in [
            ("POST /hello HTTP/1.1\r\nConnection: close\r\n\r\n", "405"),
            ("garbage\r\n\r\n", "400"),
            (huge.as_str(), "431"),
        ] {
            let out = exchange(addr, req.as_bytes());
            assert!(
                out.starts_with(&format!("HTTP/1.1 {want}")),
                "{want}: {out}"
            );
        }
        // HEAD: the headers of GET, no body.
        let out = exchange(addr, b"HEAD /hello HTTP/1.1\r\nConnection: close\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(
            out.to_ascii_lowercase().contains("x-seen-method: head"),
            "{out}"
        );
        assert!(out.ends_with("\r\n\r\n"), "no body after HEAD: {out:?}");
    }

    #[test]
    fn keeps_alive_and_closes_idle_and_silent_connections() {
        let limits = Limits {
            header_read: Duration::from_millis(300),
            ..Limits::default()
        };
        let addr = start(limits, Duration::from_secs(20));
        // Two requests on one connection, then silence: closed once the header timeout has passed.
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /hello HTTP/1.1\r\n\r\nGET /nope HTTP/1.1\r\n\r\n")
            .unwrap();
        let t = Instant::now();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        let out = String::from_utf8_lossy(&out);
        assert_eq!(out.matches("HTTP/1.1 ").count(), 2, "{out}");
        assert!(out.contains("HTTP/1.1 404"), "{out}");
        let idle = t.elapsed();
        assert!(
            idle >= Duration::from_millis(250) && idle < Duration::from_secs(3),
            "idle connection closed after {idle:?}"
        );
        // A connection that never completes its head: closed too.
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /hello HTTP/1.1\r\nX-Slow: ").unwrap();
        let t = Instant::now();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "slow head cut after {:?}",
            t.elapsed()
        );
        assert!(!String::from_utf8_lossy(&out).contains("200 OK"));
    }

    /// A client socket bound to `source` (any 127/8 address is local), connected to `addr`.
    fn connect_from(source: [u8; 4], addr: SocketAddr) -> std::net::TcpStream {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let s = rt.block_on(async {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(SocketAddr::from((source, 0))).unwrap();
            s.connect(addr).await.unwrap().into_std().unwrap()
        });
        s.set_nonblocking(false).unwrap();
        s
    }

    /// `n` silent connections from each of `sources`.
    fn hold_idle(sources: &[[u8; 4]], n: usize, addr: SocketAddr) -> Vec<std::net::TcpStream> {
        sources
            .iter()
            .flat_map(|src| (0..n).map(move |_| connect_from(*src, addr)))
            .collect()
    }

    /// Whether the server closed `s` (EOF or reset), without waiting.
    fn closed_by_server(s: &std::net::TcpStream) -> bool {
        s.set_nonblocking(true).unwrap();
        let closed = match (&*s).read(&mut [0u8; 1]) {
            Ok(_) => true,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        };
        s.set_nonblocking(false).unwrap();
        closed
    }

    /// Waits up to 2 s for the server to have closed exactly the connections `want` says.
    fn assert_closed(held: &[std::net::TcpStream], want: impl Fn(usize) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let wrong: Vec<usize> = (0..held.len())
                .filter(|&i| closed_by_server(&held[i]) != want(i))
                .collect();
            if wrong.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "connections {wrong:?} are not as expected"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// GET from `source`, timed.
    fn timed_get_from(source: [u8; 4], addr: SocketAddr) -> (std::io::Result<Reply>, Duration) {
        let t = Instant::now();
        let reply = get_on(
            connect_from(source, addr),
            addr,
            "/hello",
            Duration::from_secs(1),
        );
        (reply, t.elapsed())
    }

    fn refused(why: Refusal) -> u64 {
        CONNECTIONS_REFUSED
            .get_or_create(&[("listener", "healthz"), ("reason", why.label())])
            .get()
    }

    /// The review's attack: one peer opens hundreds of idle connections; a probe from another address is
    /// still answered at once (it waited for a header timeout, or forever, when the peer could fill the
    /// listener).
    #[test]
    fn one_peer_holding_hundreds_of_idle_connections_cannot_delay_another_probe() {
        let addr = start(Limits::default(), Duration::from_secs(30));
        let per_source_before = refused(Refusal::PerSource);
        let held = hold_idle(&[[127, 0, 0, 1]], 300, addr);
        let (reply, took) = timed_get_from([127, 0, 0, 2], addr);
        assert_eq!(reply.map(|r| r.0).ok(), Some(200), "after {took:?}");
        assert!(took < Duration::from_secs(1), "answered after {took:?}");
        // The peer keeps its first 8; the others were closed at once, and counted.
        let cap = Limits::default().per_source;
        assert_closed(&held, |i| i >= cap);
        assert!(refused(Refusal::PerSource) >= per_source_before + (300 - cap) as u64);
    }

    /// Many sources, each under its cap, fill the listener: the newcomer still gets in, by closing the
    /// oldest connection of the source holding the most.
    #[test]
    fn a_crowd_of_sources_cannot_delay_another_probe() {
        let limits = Limits {
            connections: 64,
            ..Limits::default()
        };
        let addr = start(limits, Duration::from_secs(30));
        let crowd: Vec<[u8; 4]> = (1..=60).map(|i| [127, 0, 1, i]).collect();
        let closed = || refused(Refusal::Evicted) + refused(Refusal::ListenerFull);
        let closed_before = closed();
        let _held = hold_idle(&crowd, 5, addr);
        let (reply, took) = timed_get_from([127, 0, 0, 2], addr);
        assert_eq!(reply.map(|r| r.0).ok(), Some(200), "after {took:?}");
        assert!(took < Duration::from_secs(1), "answered after {took:?}");
        // Each connection beyond 64 closed one (an older one, or itself when its source held the most).
        assert!(closed() >= closed_before + 300 - 64);
    }

    #[test]
    fn a_full_listener_closes_the_oldest_connection_of_the_largest_holder() {
        let limits = Limits {
            connections: 4,
            per_source: 3,
            header_read: Duration::from_secs(10),
            lifetime: Duration::from_secs(60),
        };
        let addr = start(limits, Duration::from_secs(30));
        let (a, b, c) = ([127, 0, 2, 1], [127, 0, 2, 2], [127, 0, 2, 3]);
        // Full: a holds 2, b and c one each.
        let mut held = hold_idle(&[a, a, b, c], 1, addr);
        assert_closed(&held, |_| false);
        let evicted_before = refused(Refusal::Evicted);
        // A newcomer gets in: a's oldest connection makes room.
        let (reply, _) = timed_get_from([127, 0, 2, 4], addr);
        assert_eq!(reply.unwrap().0, 200);
        assert_closed(&held, |i| i == 0);
        assert!(refused(Refusal::Evicted) > evicted_before);
        // Full again, everyone holding one: a second connection from b is the one closed.
        held.push(connect_from([127, 0, 2, 5], addr));
        let full_before = refused(Refusal::ListenerFull);
        held.push(connect_from(b, addr));
        assert_closed(&held, |i| i == 0 || i == 5);
        assert!(refused(Refusal::ListenerFull) > full_before);
    }

    /// The table's bookkeeping: an evicted connection's own release later is a no-op, and counts stay
    /// right through admissions, evictions, refusals and releases.
    #[test]
    fn the_table_counts_each_connection_once() {
        let limits = Limits {
            connections: 3,
            per_source: 2,
            ..Limits::default()
        };
        let mut table = ConnectionTable::new(limits);
        let (a, b, c) = (
            IpAddr::from([10, 0, 0, 1]),
            IpAddr::from([10, 0, 0, 2]),
            IpAddr::from([10, 0, 0, 3]),
        );
        let kind = ServerKind::Metrics;
        let (a0, mut a0_closed) = table.admit(a, kind).unwrap();
        let (a1, _a1_closed) = table.admit(a, kind).unwrap();
        assert_eq!(table.admit(a, kind).unwrap_err(), Refusal::PerSource);
        let (b0, _b0_closed) = table.admit(b, kind).unwrap();
        // Full: c's connection takes the place of a's oldest, whose task is told to close it.
        let (c0, _c0_closed) = table.admit(c, kind).unwrap();
        assert!(a0_closed
            .try_recv()
            .is_err_and(|e| e == oneshot::error::TryRecvError::Closed));
        assert_eq!((table.total, table.held_by(a)), (3, 1));
        // Everyone holds one: b's second connection is the one refused.
        assert_eq!(table.admit(b, kind).unwrap_err(), Refusal::ListenerFull);
        table.release(a, a0);
        assert_eq!(table.total, 3);
        for (source, id) in [(a, a1), (b, b0), (c, c0)] {
            table.release(source, id);
        }
        assert_eq!(table.total, 0);
        assert!(table.by_source.is_empty());
    }
}
