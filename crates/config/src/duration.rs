//! Durations as kube-proxy reads them: Go's duration syntax (the file's fields and the flags), and for
//! flags a plain number of seconds too.

use std::time::Duration;

/// A duration that cannot be read, as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a Go duration (or a number of seconds, for flags), or too large.
    #[error("invalid duration {0:?} (examples: \"30s\", \"1m30s\", \"500ms\")")]
    Invalid(String),
    /// Below zero.
    #[error("invalid duration {0:?}: negative")]
    Negative(String),
}

/// A Go duration ("300ms", "1.5h", "2h45m", "0"): what metav1.Duration and kube-proxy's flags accept.
pub fn parse_go_duration(s: &str) -> Result<Duration, DurationError> {
    let bad = || DurationError::Invalid(s.into());
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    if t.starts_with('-') {
        return Err(DurationError::Negative(s.into()));
    }
    let t = t.strip_prefix('+').unwrap_or(t);
    if t.is_empty() {
        return Err(bad());
    }
    let mut total = 0f64;
    let mut rest = t;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        if num_len == 0 {
            return Err(bad());
        }
        let n: f64 = rest[..num_len].parse().map_err(|_| bad())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total += n * scale;
    }
    if !total.is_finite() || total > 1e12 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(total))
}

/// A duration flag: a Go duration ("30s", as kube-proxy's flags take) or a plain number of seconds.
pub fn parse_duration_flag(s: &str) -> Result<Duration, DurationError> {
    if let Ok(secs) = s.trim().parse::<f64>() {
        if secs < 0.0 {
            return Err(DurationError::Negative(s.into()));
        }
        if secs < 1e12 {
            return Ok(Duration::from_secs_f64(secs));
        }
        return Err(DurationError::Invalid(s.into()));
    }
    parse_go_duration(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        for (s, ms) in [
            ("30s", 30_000),
            ("1m30s", 90_000),
            ("500ms", 500),
            ("1.5h", 5_400_000),
            ("0", 0),
            ("0s", 0),
            ("2h45m", 9_900_000),
        ] {
            assert_eq!(parse_go_duration(s).unwrap().as_millis(), ms, "{s}");
        }
        for s in ["", "s", "10", "10x", "-1s", "1..5s", "abc"] {
            assert!(parse_go_duration(s).is_err(), "{s}");
        }
        assert_eq!(
            parse_duration_flag("0.2").unwrap(),
            Duration::from_millis(200)
        );
        assert_eq!(parse_duration_flag("30s").unwrap(), Duration::from_secs(30));
        assert!(parse_duration_flag("-1").is_err());
    }
}
