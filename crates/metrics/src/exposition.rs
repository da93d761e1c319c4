//! The two text formats `/metrics` speaks, and which one a scraper gets.
//!
//! prometheus-client writes OpenMetrics 1.0.0 only. Prometheus, client_golang (what kube-proxy answers
//! with) and most scrapers default to the classic Prometheus text format 0.0.4, and dashboards built on
//! kube-proxy match its spelling: `le="1"` (OpenMetrics: `le="1.0"`), `# TYPE x_total counter`
//! (OpenMetrics: `# TYPE x counter`). So the registry is encoded once as OpenMetrics and, unless the
//! scraper's `Accept` header asks for OpenMetrics, rewritten line by line into the classic format
//! ([`to_classic`]). The rewrite only needs the shape prometheus-client writes (metadata before samples,
//! one sample a line), which OpenMetrics requires of every producer anyway.

use std::fmt::Write as _;

/// The content type of OpenMetrics text.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of the classic Prometheus text format (what client_golang answers by default).
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// An exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4.
    Classic,
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
}

impl Format {
    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Classic => CLASSIC_CONTENT_TYPE,
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
        }
    }

    /// The format to answer an `Accept` header with (None: no header), as client_golang negotiates it:
    /// media ranges in order of preference (`q`, then position; `q=0` refuses), the first one naming a
    /// format we write wins; OpenMetrics only when asked for by name, the classic format otherwise.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let mut ranges: Vec<(f64, MediaRange)> = accept
            .unwrap_or_default()
            .split(',')
            .filter_map(MediaRange::parse)
            .map(|r| (r.q, r))
            .filter(|(q, _)| *q > 0.0)
            .collect();
        // Stable: equal preferences keep the client's order.
        ranges.sort_by(|a, b| b.0.total_cmp(&a.0));
        ranges
            .iter()
            .find_map(|(_, r)| r.format())
            .unwrap_or(Format::Classic)
    }
}

/// One media range of an `Accept` header: type and the parameters that matter here.
#[derive(Debug)]
struct MediaRange {
    media_type: String,
    version: Option<String>,
    q: f64,
}

impl MediaRange {
    fn parse(text: &str) -> Option<MediaRange> {
        let mut parts = text.split(';').map(str::trim);
        let media_type = parts.next().filter(|t| !t.is_empty())?.to_ascii_lowercase();
        let (mut version, mut q) = (None, 1.0);
        for param in parts {
            let Some((key, value)) = param.split_once('=') else {
                continue;
            };
            let value = value.trim().trim_matches('"');
            match key.trim().to_ascii_lowercase().as_str() {
                "version" => version = Some(value.to_string()),
                // An unreadable q is no preference: treated as refused rather than as the default 1.
                "q" => q = value.parse().unwrap_or(0.0),
                _ => {}
            }
        }
        Some(MediaRange {
            media_type,
            version,
            q,
        })
    }

    /// The format this range names, if we write one it accepts.
    fn format(&self) -> Option<Format> {
        let version = self.version.as_deref();
        match self.media_type.as_str() {
            "application/openmetrics-text" if matches!(version, None | Some("1.0.0" | "0.0.1")) => {
                Some(Format::OpenMetrics)
            }
            "text/plain" if matches!(version, None | Some("0.0.4" | "1.0.0")) => {
                Some(Format::Classic)
            }
            _ => None,
        }
    }
}

/// The classic text format (0.0.4) of an OpenMetrics exposition: `# EOF` and `# UNIT` dropped, counter
/// families named with their `_total` suffix, `_created` samples dropped (the classic format has none),
/// `info` families as gauges, `unknown` as `untyped`, numbers spelled as Go's `strconv.FormatFloat(f, 'g',
/// -1, 64)` spells them (client_golang's spelling: `1`, `0.001`, `1.7e+09`), timestamps in milliseconds,
/// exemplars dropped.
pub fn to_classic(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // HELP comes before TYPE, and a counter's HELP must be renamed once its TYPE is known.
    let mut help: Option<(&str, String)> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            flush_help(&mut out, help.take(), None);
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, unescape_help(text)));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (name, kind) = classic_family(name, kind);
            flush_help(&mut out, help.take(), Some(&name));
            let _ = writeln!(out, "# TYPE {name} {kind}");
        } else if line.starts_with('#') {
            // `# EOF`, `# UNIT`: no classic counterpart.
            continue;
        } else if !line.is_empty() {
            flush_help(&mut out, help.take(), None);
            classic_sample(&mut out, line);
        }
    }
    flush_help(&mut out, help, None);
    out
}

/// A family's classic name and type.
fn classic_family(name: &str, kind: &str) -> (String, &'static str) {
    match kind {
        "counter" => (format!("{name}_total"), "counter"),
        "gauge" => (name.to_string(), "gauge"),
        "histogram" => (name.to_string(), "histogram"),
        "summary" => (name.to_string(), "summary"),
        "info" => (format!("{name}_info"), "gauge"),
        "stateset" => (name.to_string(), "gauge"),
        "gaugehistogram" => (name.to_string(), "histogram"),
        _ => (name.to_string(), "untyped"),
    }
}

/// Writes a pending HELP line, under the family's classic name when its TYPE gave one.
fn flush_help(out: &mut String, help: Option<(&str, String)>, renamed: Option<&str>) {
    if let Some((name, text)) = help {
        let name = renamed.unwrap_or(name);
        let _ = writeln!(out, "# HELP {name} {}", escape_classic_help(&text));
    }
}

/// OpenMetrics HELP escapes `\`, newline and `"`.
fn unescape_help(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(escaped) => out.push(escaped),
            None => out.push('\\'),
        }
    }
    out
}

/// The classic format's HELP escapes only `\` and newline.
fn escape_classic_help(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\n', "\\n")
}

/// One sample line, rewritten (or dropped: `_created`).
fn classic_sample(out: &mut String, line: &str) {
    let (series, rest) = split_series(line);
    let name = series.split('{').next().unwrap_or(series);
    if name.ends_with("_created") {
        return;
    }
    // An exemplar follows ` # `; the classic format has none.
    let rest = rest.split(" # ").next().unwrap_or(rest);
    let mut fields = rest.split_whitespace();
    let value = fields.next().unwrap_or("NaN");
    out.push_str(&classic_series(series));
    out.push(' ');
    out.push_str(&go_number(value));
    if let Some(ts) = fields.next().and_then(|t| t.parse::<f64>().ok()) {
        let _ = write!(out, " {}", (ts * 1000.0).round() as i64);
    }
    out.push('\n');
}

/// `name{labels}` and what follows it. Label values may hold spaces and `}`, so the end of the label set
/// is found by walking its quoted values.
fn split_series(line: &str) -> (&str, &str) {
    let Some(open) = line.find('{').filter(|&i| !line[..i].contains(' ')) else {
        return line.split_once(' ').unwrap_or((line, ""));
    };
    let bytes = line.as_bytes();
    let (mut i, mut quoted) = (open + 1, false);
    while i < bytes.len() {
        match (bytes[i], quoted) {
            (b'\\', true) => i += 1,
            (b'"', _) => quoted = !quoted,
            (b'}', false) => return (&line[..=i], line[i + 1..].trim_start()),
            _ => {}
        }
        i += 1;
    }
    (line, "")
}

/// A series with its `le` / `quantile` label values in Go's spelling (`le="1.0"` → `le="1"`); other
/// labels as they are.
fn classic_series(series: &str) -> String {
    let mut out = String::with_capacity(series.len());
    let mut rest = series;
    for key in ["le=\"", "quantile=\""] {
        if let Some(start) = find_label(rest, key) {
            let value_start = start + key.len();
            if let Some(len) = rest[value_start..].find('"') {
                out.push_str(&rest[..value_start]);
                out.push_str(&go_number(&rest[value_start..value_start + len]));
                rest = &rest[value_start + len..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Where label `key` (`le="`) starts: right after `{` or `,`, never inside another label's value.
fn find_label(series: &str, key: &str) -> Option<usize> {
    series
        .match_indices(key)
        .map(|(i, _)| i)
        .find(|&i| i > 0 && matches!(series.as_bytes()[i - 1], b'{' | b','))
}

/// A number as Go's `strconv.FormatFloat(f, 'g', -1, 64)` writes it, with client_golang's `+Inf`, `-Inf`
/// and `NaN`; text that is not a number is left as it is.
pub(crate) fn go_number(text: &str) -> String {
    match text.parse::<f64>() {
        Ok(f) => go_float(f),
        Err(_) => text.to_string(),
    }
}

/// Go's shortest `%g`: exponent form when the decimal exponent is below -4 or at least 6 (mantissa as
/// short as round-trips, exponent signed, at least two digits), plain decimal otherwise.
pub(crate) fn go_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // Rust's `{:e}` is the shortest round-tripping mantissa: `1.234567e6`, `1e-5`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..6).contains(&exp) {
        // Rust's `{}` is the shortest round-tripping decimal, without an exponent.
        return format!("{f}");
    }
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_spelled_as_go_spells_them() {
        for (f, go) in [
            (1.0, "1"),
            (0.001, "0.001"),
            (16.384, "16.384"),
            (0.25, "0.25"),
            (300.0, "300"),
            (100000.0, "100000"),
            (1e6, "1e+06"),
            (1234567.0, "1.234567e+06"),
            (1.7648e9, "1.7648e+09"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5, "-2.5"),
            (-1e-7, "-1e-07"),
            (1e100, "1e+100"),
            (0.0, "0"),
            (f64::INFINITY, "+Inf"),
            (f64::NEG_INFINITY, "-Inf"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(go_float(f), go, "{f}");
        }
        assert_eq!(go_number("+Inf"), "+Inf");
        assert_eq!(go_number("1.0"), "1");
        assert_eq!(go_number("x"), "x");
    }

    #[test]
    fn negotiation_follows_client_golang() {
        use Format::*;
        for (accept, want) in [
            (None, Classic),
            (Some(""), Classic),
            (Some("*/*"), Classic),
            (Some("text/plain"), Classic),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("application/openmetrics-text; version=1.0.0; charset=utf-8"),
                OpenMetrics,
            ),
            // Prometheus 2.x's default scrape header.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
            // A scraper configured to prefer the classic format.
            (
                Some("text/plain;version=0.0.4;q=0.9,application/openmetrics-text;version=1.0.0;q=0.5"),
                Classic,
            ),
            (Some("application/openmetrics-text;q=0"), Classic),
            // A version we do not write is passed over.
            (Some("application/openmetrics-text;version=2.0.0"), Classic),
            (Some("application/json, text/html"), Classic),
            (Some("APPLICATION/OpenMetrics-Text"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), want, "{accept:?}");
        }
    }

    #[test]
    fn openmetrics_is_rewritten_as_classic_text() {
        let om = "# HELP a_seconds Sync \\\"time\\\" \\\\ in\\nseconds.\n\
                  # TYPE a_seconds histogram\n\
                  # UNIT a_seconds seconds\n\
                  a_seconds_sum 0.0035\n\
                  a_seconds_count 2\n\
                  a_seconds_bucket{le=\"0.001\",ip_family=\"IPv4\"} 1\n\
                  a_seconds_bucket{le=\"1.0\",ip_family=\"IPv4\"} 2\n\
                  a_seconds_bucket{le=\"+Inf\",ip_family=\"IPv4\"} 2\n\
                  # HELP b Things.\n\
                  # TYPE b counter\n\
                  b_total{x=\"s p} a,le=\\\"1.0\\\"\"} 7 # {trace_id=\"1\"} 1.0 1.5\n\
                  b_created 1.7e9\n\
                  # HELP c Level.\n\
                  # TYPE c gauge\n\
                  c 1.0 1700000000.5\n\
                  # TYPE d unknown\n\
                  d 3\n\
                  # EOF\n";
        let want = "# HELP a_seconds Sync \"time\" \\\\ in\\nseconds.\n\
                    # TYPE a_seconds histogram\n\
                    a_seconds_sum 0.0035\n\
                    a_seconds_count 2\n\
                    a_seconds_bucket{le=\"0.001\",ip_family=\"IPv4\"} 1\n\
                    a_seconds_bucket{le=\"1\",ip_family=\"IPv4\"} 2\n\
                    a_seconds_bucket{le=\"+Inf\",ip_family=\"IPv4\"} 2\n\
                    # HELP b_total Things.\n\
                    # TYPE b_total counter\n\
                    b_total{x=\"s p} a,le=\\\"1.0\\\"\"} 7\n\
                    # HELP c Level.\n\
                    # TYPE c gauge\n\
                    c 1 1700000000500\n\
                    # TYPE d untyped\n\
                    d 3\n";
        assert_eq!(to_classic(om), want);
    }
}
