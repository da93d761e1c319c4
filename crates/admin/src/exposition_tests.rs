//! `/metrics` as scrapers see it: served by the real handler over HTTP, in each format the `Accept` header
//! picks, and read by the parsers of Prometheus' own Python client (Debian's `python3-prometheus-client`:
//! the classic text parser and the strict OpenMetrics one). A parser from outside the project is the
//! oracle: our own reading of the text would share our misreadings.
// The oracle is a python program: a test may start it (the product never starts a process).
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use super::{metrics, metrics_handler, metrics_registry};
use crate::http::{self, ServerKind};

/// Debian's interpreter: the Debian package installs the module for it (not for a python3 of pyenv, venvs
/// and the like that may come first on PATH).
const PYTHON: &str = "/usr/bin/python3";

/// Reads an exposition on stdin with the parser named by argv[1] and prints, as JSON, each family's name,
/// type and samples (name, labels, value).
const PARSE: &str = r#"
import json, sys
try:
    if sys.argv[1] == "classic":
        from prometheus_client.parser import text_string_to_metric_families
    else:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
except ImportError as e:
    print("MISSING " + str(e))
    sys.exit(3)
families = [
    {"name": f.name, "type": f.type,
     "samples": [[s.name, s.labels, s.value] for s in f.samples]}
    for f in text_string_to_metric_families(sys.stdin.read())
]
print(json.dumps(families))
"#;

/// One parsed family: type and samples as (name, labels) → value.
#[derive(Debug)]
struct Parsed {
    kind: String,
    samples: BTreeMap<(String, BTreeMap<String, String>), f64>,
}

/// `text` read by the python parser `which` ("classic" or "openmetrics"), by family name.
fn python_parse(which: &str, text: &str) -> BTreeMap<String, Parsed> {
    let mut child = Command::new(PYTHON)
        .args(["-c", PARSE, which])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run {PYTHON} ({e}): install python3-prometheus-client (ci/install-deps does)")
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.starts_with("MISSING"),
        "{stdout}: install python3-prometheus-client (apt-get install python3-prometheus-client; \
         ci/install-deps does)"
    );
    assert!(
        out.status.success(),
        "the {which} parser refused /metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let families: Vec<serde_json::Value> = serde_json::from_str(&stdout).unwrap();
    families
        .into_iter()
        .map(|f| {
            let samples = f["samples"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    let labels = s[1]
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                        .collect();
                    let value = s[2].as_f64().unwrap_or(f64::NAN);
                    ((s[0].as_str().unwrap().to_string(), labels), value)
                })
                .collect();
            let name = f["name"].as_str().unwrap().to_string();
            let kind = f["type"].as_str().unwrap().to_string();
            (name, Parsed { kind, samples })
        })
        .collect()
}

/// The real metrics handler on an ephemeral loopback port, for `life`.
fn serve_metrics(life: Duration) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let handler = metrics_handler(metrics_registry(Arc::default()), "nftables");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            let _ = tokio::time::timeout(life, http::serve(l, handler, ServerKind::Metrics)).await;
        })
    });
    addr
}

/// GET /metrics with this `Accept` header (none: None): the content type and the body.
fn scrape(addr: SocketAddr, accept: Option<&str>) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\n{accept}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .expect("a Content-Type");
    (content_type, body.to_string())
}

/// Samples by family name, without values (they move between two scrapes) and without `_created`.
fn shape(parsed: &BTreeMap<String, Parsed>) -> BTreeMap<String, (String, BTreeSet<String>)> {
    parsed
        .iter()
        .map(|(name, f)| {
            let samples = f
                .samples
                .keys()
                .filter(|(n, _)| !n.ends_with("_created"))
                .map(|(n, labels)| {
                    // `le` is spelled differently by the two formats (`1` / `1.0`): compared as numbers.
                    let labels: Vec<String> = labels
                        .iter()
                        .map(|(k, v)| match (k.as_str(), v.parse::<f64>()) {
                            ("le", Ok(f)) => format!("le={f}"),
                            _ => format!("{k}={v}"),
                        })
                        .collect();
                    format!("{n}{labels:?}")
                })
                .collect();
            (name.clone(), (f.kind.clone(), samples))
        })
        .collect()
}

#[test]
fn both_formats_are_read_alike_by_prometheus_python_parsers() {
    metrics::record_sync(true, Duration::from_millis(3));
    metrics::SYNC_FAILURES.inc();
    let addr = serve_metrics(Duration::from_secs(60));

    let (classic_type, classic) = scrape(addr, None);
    assert_eq!(classic_type, "text/plain; version=0.0.4; charset=utf-8");
    let (om_type, om) = scrape(
        addr,
        Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
    );
    assert_eq!(
        om_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    // Prometheus asking for the classic format first gets it.
    let (prefers_classic, _) = scrape(
        addr,
        Some("text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.5"),
    );
    assert_eq!(prefers_classic, classic_type);

    assert!(
        om.ends_with("# EOF\n") && !classic.contains("# EOF"),
        "{classic}"
    );
    // kube-proxy's spelling in the classic format: `le="1"`, counters typed under their `_total` name.
    assert!(classic.contains("le=\"1\""), "{classic}");
    assert!(!classic.contains("le=\"1.0\""), "{classic}");
    assert!(om.contains("le=\"1.0\""), "{om}");
    assert!(
        classic
            .contains("# TYPE kubeproxy_sync_proxy_rules_nftables_sync_failures_total counter\n"),
        "{classic}"
    );

    let classic_parsed = python_parse("classic", &classic);
    let om_parsed = python_parse("openmetrics", &om);
    assert_eq!(shape(&classic_parsed), shape(&om_parsed));
    for (name, kind) in [
        ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
        ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge"),
        (
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "counter",
        ),
        ("kubeproxy_proxy_healthz", "counter"),
        (
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
            "counter",
        ),
        (
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "gauge",
        ),
        (
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "histogram",
        ),
        ("process_cpu_seconds", "counter"),
        ("process_resident_memory_bytes", "gauge"),
        ("process_start_time_seconds", "gauge"),
        ("process_open_fds", "gauge"),
        ("process_max_fds", "gauge"),
        ("process_virtual_memory_bytes", "gauge"),
        ("process_virtual_memory_max_bytes", "gauge"),
        ("kubernetes_build_info", "gauge"),
    ] {
        for parsed in [&classic_parsed, &om_parsed] {
            let f = parsed
                .get(name)
                .unwrap_or_else(|| panic!("{name} not parsed from:\n{classic}"));
            assert_eq!(f.kind, kind, "{name}");
        }
    }
    // Every family has a type the parsers understood (none fell back to untyped / unknown).
    for (name, f) in &classic_parsed {
        assert!(
            !matches!(f.kind.as_str(), "untyped" | "unknown"),
            "{name} is {}",
            f.kind
        );
    }
    let build = &classic_parsed["kubernetes_build_info"].samples;
    let ((_, labels), one) = build.iter().next().expect("a build_info sample");
    assert_eq!(*one, 1.0);
    assert!(labels["git_version"].starts_with("v0."), "{labels:?}");
    let start = classic_parsed["process_start_time_seconds"]
        .samples
        .values()
        .next()
        .copied()
        .unwrap();
    assert!(start > 1.6e9, "{start}");
    // The sync recorded above is in both families' samples.
    let failures = &classic_parsed["kubeproxy_sync_proxy_rules_nftables_sync_failures"].samples;
    for family in ["IPv4", "IPv6"] {
        let key = (
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total".to_string(),
            BTreeMap::from([("ip_family".to_string(), family.to_string())]),
        );
        assert!(
            failures.get(&key).is_some_and(|v| *v >= 1.0),
            "{failures:?}"
        );
    }
}
