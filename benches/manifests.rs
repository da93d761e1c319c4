//! Hostile manifests: what each adversarial shape costs the manifest source, as a ratio against ordinary
//! manifests of the same size parsed in the same run.
//!
//! Every shape goes through `parse_file`, the source's own path from a file's bytes to events and errors
//! (document split, YAML or JSON, conversion). Shapes and sizes interleave, and each cell is the median of
//! `ROUNDS` runs, so a noisy neighbour hurts every shape alike. Rejecting input must cost time linear in its
//! size: a ratio stays flat as the size grows (a quadratic shape would grow tenfold per step).
//!
//! A second table compares the YAML parsers on ordinary documents, each document parsed into a JSON value
//! as the source does: the fast path for the block subset (`nftkube::yaml::fast`, what ordinary manifests
//! go through), serde-saphyr with our budget (the fallback for everything else), and serde_yaml 0.9
//! (deprecated upstream, the parser before them).
//!
//! `cargo bench --bench manifests -- [SIZES_IN_KB]` (default 100,1000). No root needed.

// A benchmark prints its table to the terminal and runs the tools it measures against (nft, iptables-restore).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use nftkube::source::manifests::parse_file;
use std::path::Path;
use std::time::{Duration, Instant};

const ROUNDS: usize = 7;

/// One ordinary Service and its EndpointSlice, the k-th of a file.
fn ordinary_pair(k: usize) -> String {
    let (a, b) = (k / 250 % 250, k % 250);
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: svc-{k}\n  namespace: default\nspec:\n  clusterIP: 10.96.{a}.{b}\n  ports:\n  - name: http\n    port: 80\n    protocol: TCP\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: svc-{k}-x\n  namespace: default\n  labels:\n    kubernetes.io/service-name: svc-{k}\naddressType: IPv4\nendpoints:\n- addresses: [10.244.{a}.{b}]\n  conditions: {{ready: true}}\nports:\n- name: http\n  port: 8080\n  protocol: TCP\n---\n"
    )
}

/// Repeats `unit(i)` for i = 0, 1, ... until the text is `size` bytes long.
fn fill(size: usize, mut unit: impl FnMut(usize) -> String) -> String {
    let mut text = String::with_capacity(size + 256);
    let mut i = 0;
    while text.len() < size {
        text.push_str(&unit(i));
        i += 1;
    }
    text
}

/// Ten anchored levels, each ten aliases of the one before: 10^10 nodes if expanded ("billion laughs").
fn laughs() -> String {
    let mut text = String::from("a0: &a0 [x,x,x,x,x,x,x,x,x,x]\n");
    for k in 1..10 {
        let p = k - 1;
        text.push_str(&format!(
            "a{k}: &a{k} [*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p}]\n"
        ));
    }
    text
}

/// (name, file name, content) of every shape at `size` bytes.
fn shapes(size: usize) -> Vec<(&'static str, &'static str, String)> {
    let depth_block = fill(size, |i| format!("{}a:\n", " ".repeat(i % 4096)));
    let alias_fan = format!(
        "a: &a [{}]\nb: [{}]\n",
        "x,".repeat(100),
        "*a,".repeat(size / 3)
    );
    let merge = format!(
        "a: &a {{k0: 0, k1: 1, k2: 2, k3: 3, k4: 4, k5: 5, k6: 6, k7: 7, k8: 8, k9: 9}}\n{}",
        fill(size, |i| format!("m{i}: {{<<: *a}}\n"))
    );
    vec![
        ("ordinary", "o.yaml", fill(size, ordinary_pair)),
        ("deep flow sequence", "s.yaml", "[".repeat(size)),
        ("deep flow mapping", "m.yaml", "{a: ".repeat(size / 4)),
        ("deep block nesting", "b.yaml", depth_block),
        ("deep block sequence", "q.yaml", "- ".repeat(size / 2)),
        ("deep JSON", "j.json", "[".repeat(size)),
        (
            "billion laughs, per document",
            "l.yaml",
            fill(size, |_| laughs() + "---\n"),
        ),
        ("alias fan-out", "f.yaml", alias_fan),
        ("merge keys", "k.yaml", merge),
        (
            "huge scalar (a name)",
            "h.yaml",
            format!(
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: {}\n",
                "x".repeat(size)
            ),
        ),
        (
            "unclosed quote",
            "u.yaml",
            format!("a: \"{}\n", "x ".repeat(size / 2)),
        ),
        ("many empty documents", "e.yaml", "---\n".repeat(size / 4)),
        (
            "many tiny documents",
            "t.yaml",
            fill(size, |i| format!("k{i}: 1\n---\n")),
        ),
        ("many keys", "n.yaml", fill(size, |i| format!("k{i}: v\n"))),
    ]
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Parses every document of `docs` with `parse`: the median time over `ROUNDS`, interleaved by the caller.
fn time_docs(docs: &[&str], parse: impl Fn(&str) -> bool) -> Duration {
    let start = Instant::now();
    for d in docs {
        assert!(parse(d), "an ordinary document failed to parse");
    }
    start.elapsed()
}

/// Ordinary documents through the three parsers, interleaved, medians: the fast path (which must take every
/// one of them), serde-saphyr with our budget (its fallback), serde_yaml 0.9 (the former parser).
fn compare_parsers(size: usize) {
    let text = fill(size, ordinary_pair);
    let docs: Vec<&str> = text
        .split("---\n")
        .filter(|d| !d.trim().is_empty())
        .collect();
    let (mut fast, mut full, mut former) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        fast.push(time_docs(&docs, |d| {
            nftkube::yaml::fast::parse(d).is_some()
        }));
        full.push(time_docs(&docs, |d| {
            nftkube::yaml::parse_document_full(d).is_ok()
        }));
        former.push(time_docs(&docs, |d| {
            serde_yaml::from_str::<serde_json::Value>(d).is_ok()
        }));
    }
    let mb_s = |t: Duration| text.len() as f64 / t.as_secs_f64() / 1e6;
    let (fast, full, former) = (median(fast), median(full), median(former));
    for (name, t) in [
        ("YAML: fast path", fast),
        ("YAML: serde-saphyr", full),
        ("YAML: serde_yaml 0.9", former),
    ] {
        println!(
            "{:<30} {:>8}K {:>9.2}ms {:>7.2}x   ({} documents, {:.0} MB/s; ratio to serde-saphyr)",
            name,
            text.len() / 1000,
            t.as_secs_f64() * 1e3,
            t.as_secs_f64() / full.as_secs_f64(),
            docs.len(),
            mb_s(t)
        );
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "100,1000".into())
        .split(',')
        .map(|s| s.trim().parse::<usize>().expect("sizes in KB") * 1000)
        .collect();
    println!(
        "{:<30} {:>9} {:>11} {:>8} {:>7}",
        "shape", "size", "median", "ratio", "errors"
    );
    for size in sizes {
        let shapes = shapes(size);
        let mut times = vec![Vec::new(); shapes.len()];
        let mut errors = vec![0; shapes.len()];
        for _ in 0..ROUNDS {
            for (i, (_, file, text)) in shapes.iter().enumerate() {
                let start = Instant::now();
                let (_, errs) = parse_file(Path::new(file), text.as_bytes());
                times[i].push(start.elapsed());
                errors[i] = errs.len();
            }
        }
        let medians: Vec<Duration> = times.into_iter().map(median).collect();
        let anchor = medians[0].as_secs_f64();
        for (i, (name, _, text)) in shapes.iter().enumerate() {
            println!(
                "{:<30} {:>8}K {:>9.2}ms {:>7.2}x {:>7}",
                name,
                text.len() / 1000,
                medians[i].as_secs_f64() * 1e3,
                medians[i].as_secs_f64() / anchor,
                errors[i]
            );
        }
        compare_parsers(size);
    }
}
