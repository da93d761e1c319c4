//! The admin endpoints' HTTP/1 server, on hyper: GET (and HEAD) of a path answered from memory by a
//! [`Handler`], with a connection limit and timeouts.
//!
//! hyper parses requests (a malformed one is answered 400, a head larger than [`MAX_HEAD`] 431) and keeps
//! connections alive unless the client says `Connection: close`. Bounds, per server:
//! - at most [`Limits::connections`] connections at once; further ones wait in the listen backlog until one
//!   ends (probes and scrapes are few; a flood of idle connections cannot take file descriptors without end);
//! - [`Limits::header_read`]: from the moment the server waits for a request head (a new connection, or a
//!   kept-alive one after its last answer) the whole head must arrive within it, else the connection is
//!   closed. This is also the idle timeout of kept-alive connections;
//! - [`Limits::lifetime`]: no connection lives longer, whatever it does (a client that never reads its
//!   answer).
//!
//! It runs on the admin thread's tokio runtime, so thousands of healthCheckNodePort listeners cost tasks,
//! not threads.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Longest request head accepted (hyper's read buffer limit; above it the answer is 431).
pub const MAX_HEAD: usize = 8192;

/// How long and how many connections a server accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once.
    pub connections: usize,
    /// Time for a whole request head, counted from when the server starts waiting for it (idle included).
    pub header_read: Duration,
    /// Longest life of a connection.
    pub lifetime: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connections: 64,
            header_read: Duration::from_secs(10),
            lifetime: Duration::from_secs(60),
        }
    }
}

/// A request as handlers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The request method ("GET", "HEAD", ...).
    pub method: String,
    /// The path without the query.
    pub path: String,
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status code.
    pub status: u16,
    /// The `Content-Type` header.
    pub content_type: &'static str,
    /// Further headers.
    pub headers: Vec<(&'static str, String)>,
    /// The body (empty for HEAD).
    pub body: String,
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
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self::new(status, "text/plain; charset=utf-8", body)
    }

    /// Adds a header.
    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
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
pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Answers one request: GET and HEAD go to the handler, other methods get 405.
fn answer(req: &hyper::Request<Incoming>, handler: &Handler) -> Response {
    let method = req.method();
    if method != hyper::Method::GET && method != hyper::Method::HEAD {
        return Response::text(405, "method not allowed\n").header("Allow", "GET, HEAD");
    }
    handler(&Request {
        method: method.as_str().to_string(),
        path: req.uri().path().to_string(),
    })
}

/// Serves one connection until it closes, a timeout ends it, or its lifetime is over.
pub async fn handle_connection(stream: TcpStream, handler: Handler, limits: Limits) {
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

/// Accepts connections forever, each served on a task of its own, at most `limits.connections` at once.
pub async fn serve(listener: TcpListener, handler: Handler) {
    serve_with(listener, handler, Limits::default()).await
}

/// [`serve`] with other limits.
pub async fn serve_with(listener: TcpListener, handler: Handler, limits: Limits) {
    let slots = Arc::new(Semaphore::new(limits.connections.max(1)));
    loop {
        // Wait for a free slot before accepting: the kernel's backlog holds the others meanwhile.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return; // never closed
        };
        match listener.accept().await {
            Ok((stream, _)) => {
                let handler = handler.clone();
                tokio::spawn(async move {
                    handle_connection(stream, handler, limits).await;
                    drop(slot);
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: do not spin.
                tracing::warn!("admin server accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// An answer as [`get`] returns it: status, headers (names lower-cased), body.
pub type Reply = (u16, Vec<(String, String)>, String);

/// A blocking client for tests and probes: GET `path` from `addr`.
pub fn get(addr: std::net::SocketAddr, path: &str, timeout: Duration) -> std::io::Result<Reply> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout)?;
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
                let _ = tokio::time::timeout(life, serve_with(listener, handler, limits)).await;
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

    #[test]
    fn connections_beyond_the_limit_wait_for_a_free_slot() {
        let limits = Limits {
            connections: 2,
            header_read: Duration::from_millis(500),
            lifetime: Duration::from_secs(60),
        };
        let addr = start(limits, Duration::from_secs(20));
        // Two silent connections take both slots (connect, then give the server time to accept them).
        let held: Vec<_> = (0..2)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let (status, _, _) = get(addr, "/hello", Duration::from_secs(5)).unwrap();
        let waited = t.elapsed();
        assert_eq!(status, 200);
        // Answered only once the header timeout freed a slot.
        assert!(
            waited >= Duration::from_millis(300),
            "a third connection was served at once ({waited:?}): no limit"
        );
        drop(held);
        // With the slots free again, answers are immediate.
        let t = Instant::now();
        assert_eq!(get(addr, "/hello", Duration::from_secs(5)).unwrap().0, 200);
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    }
}
