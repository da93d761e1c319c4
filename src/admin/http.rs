//! A deliberately small HTTP/1.1 server for the admin endpoints: GET (and HEAD) of a path, one request per
//! connection (`Connection: close`), bounded request size and time.
//!
//! Why not hyper's server: the endpoints are four fixed GETs answered from memory, probes and Prometheus
//! handle `Connection: close` fine, and a hand-written request reader (about a hundred lines, tested
//! below) costs no extra features or crates, where hyper's server side would add its `server` and
//! `http1` features plus hyper-util's server glue to the build. It runs on the admin thread's tokio
//! runtime, so thousands of healthCheckNodePort listeners cost tasks, not threads.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest request head accepted.
const MAX_HEAD: usize = 8192;
/// A connection that has not sent its request head and read the answer by then is dropped.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// A parsed request line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without the query.
    pub path: String,
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

impl Response {
    pub fn new(status: u16, content_type: &'static str, body: impl Into<String>) -> Self {
        Response {
            status,
            content_type,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self::new(status, "text/plain; charset=utf-8", body)
    }

    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    fn reason(&self) -> &'static str {
        match self.status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            431 => "Request Header Fields Too Large",
            503 => "Service Unavailable",
            _ => "Unknown",
        }
    }

    /// The bytes on the wire; HEAD gets the headers only.
    pub fn encode(&self, head_only: bool) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.reason(),
            self.content_type,
            self.body.len()
        );
        for (name, value) in &self.headers {
            out.push_str(name);
            out.push_str(": ");
            out.push_str(value);
            out.push_str("\r\n");
        }
        out.push_str("\r\n");
        let mut bytes = out.into_bytes();
        if !head_only {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}

/// What answers requests.
pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Parses a request head (everything up to the blank line). Err: the response to send instead.
pub fn parse_head(head: &[u8]) -> Result<Request, Response> {
    let text = std::str::from_utf8(head).map_err(|_| Response::text(400, "bad request\n"))?;
    let line = text.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Response::text(400, "bad request line\n"));
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Err(Response::text(400, "bad request line\n"));
    }
    let path = target.split(['?', '#']).next().unwrap_or("/").to_string();
    Ok(Request {
        method: method.to_string(),
        path,
    })
}

/// Reads one request from `stream`, answers it with `handler`, closes.
pub async fn handle_connection(mut stream: TcpStream, handler: Handler) {
    let work = async {
        let mut buf = Vec::with_capacity(512);
        let mut chunk = [0u8; 1024];
        let head_end = loop {
            if let Some(i) = find_head_end(&buf) {
                break i;
            }
            if buf.len() > MAX_HEAD {
                let r = Response::text(431, "request head too large\n");
                let _ = stream.write_all(&r.encode(false)).await;
                return;
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let (response, head_only) = match parse_head(&buf[..head_end]) {
            Ok(req) => match req.method.as_str() {
                "GET" => (handler(&req), false),
                "HEAD" => (handler(&req), true),
                _ => (
                    Response::text(405, "method not allowed\n").header("Allow", "GET, HEAD"),
                    false,
                ),
            },
            Err(r) => (r, false),
        };
        let _ = stream.write_all(&response.encode(head_only)).await;
        let _ = stream.shutdown().await;
    };
    let _ = tokio::time::timeout(CONNECTION_TIMEOUT, work).await;
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

/// Accepts connections forever, each answered on a task of its own.
pub async fn serve(listener: TcpListener, handler: Handler) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(handle_connection(stream, handler.clone()));
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

    #[test]
    fn request_lines() {
        assert_eq!(
            parse_head(b"GET /healthz?verbose=1 HTTP/1.1\r\nHost: x").unwrap(),
            Request {
                method: "GET".into(),
                path: "/healthz".into()
            }
        );
        assert_eq!(parse_head(b"GET / HTTP/1.0").unwrap().path, "/");
        for bad in [
            &b"GET /x"[..],
            b"GET x HTTP/1.1",
            b"GET /x HTTP/2 extra",
            b"GET /x SPDY/3",
            b"\xff\xfe",
        ] {
            assert_eq!(parse_head(bad).unwrap_err().status, 400, "{bad:?}");
        }
    }

    #[test]
    fn encoding() {
        let r = Response::text(503, "no\n").header("X-A", "1");
        let wire = String::from_utf8(r.encode(false)).unwrap();
        assert!(
            wire.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{wire}"
        );
        assert!(wire.contains("Content-Length: 3\r\n"), "{wire}");
        assert!(wire.contains("X-A: 1\r\n"), "{wire}");
        assert!(wire.ends_with("\r\n\r\nno\n"), "{wire}");
        let head = String::from_utf8(r.encode(true)).unwrap();
        assert!(head.ends_with("\r\n\r\n"), "{head}");
    }

    /// A real server on 127.0.0.1 (an ephemeral port) in this process: requests, a slow client, junk.
    #[test]
    fn serves_over_loopback() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = std_listener.local_addr().unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let handler: Handler = Arc::new(|req: &Request| {
            if req.path == "/hello" {
                Response::text(200, "hi\n")
            } else {
                Response::text(404, "not found\n")
            }
        });
        let server = std::thread::spawn(move || {
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).unwrap();
                let _ =
                    tokio::time::timeout(Duration::from_secs(20), serve(listener, handler)).await;
            })
        });
        let t = Duration::from_secs(5);
        let (status, headers, body) = get(addr, "/hello", t).unwrap();
        assert_eq!((status, body.as_str()), (200, "hi\n"));
        assert!(headers.contains(&("connection".into(), "close".into())));
        assert_eq!(get(addr, "/nope", t).unwrap().0, 404);
        // A client that connects and says nothing does not block others.
        let idle = std::net::TcpStream::connect(addr).unwrap();
        assert_eq!(get(addr, "/hello", t).unwrap().0, 200);
        drop(idle);
        // Other methods are refused; junk is a 400.
        use std::io::{Read, Write};
        for (req, want) in [
            ("POST /hello HTTP/1.1\r\n\r\n", "405"),
            ("garbage\r\n\r\n", "400"),
        ] {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(t)).unwrap();
            s.write_all(req.as_bytes()).unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            assert!(out.starts_with(&format!("HTTP/1.1 {want}")), "{out}");
        }
        drop(server); // the thread ends with its timeout; not joined, to keep the test fast
    }
}
