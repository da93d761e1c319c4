//! The API server's rules for the names the proxy reads. Objects from the API already follow them; the
//! manifest source must check them itself, since a name ends up in log lines, health answers and kernel
//! object names: a name the API server would refuse is refused here with the rule it breaks. Each check
//! reads its input once (linear in its length) and stops at the first byte out of bounds.

/// The longest DNS-1123 label (namespaces, Service names).
const LABEL_MAX: usize = 63;
/// The longest DNS-1123 subdomain (EndpointSlice names).
const SUBDOMAIN_MAX: usize = 253;
/// The longest IANA service name (Service port names).
const IANA_SVC_NAME_MAX: usize = 15;

/// A lower-case letter or digit.
fn alphanumeric(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// What a rule's message shows of a refused name: quoted, and past 40 characters cut, with its length.
fn shown(s: &str) -> String {
    match cut(s, 40) {
        Some(prefix) => format!("{prefix:?}… ({} bytes)", s.len()),
        None => format!("{s:?}"),
    }
}

/// The first `chars` characters of `s`, when it has more.
fn cut(s: &str, chars: usize) -> Option<&str> {
    s.char_indices().nth(chars).map(|(at, _)| &s[..at])
}

/// A name as an object's description shows it: whole up to the longest name the API server accepts for a
/// label (63 characters), cut with '…' beyond, so that a refused name never fills a log line.
pub(crate) fn shortened(s: &str) -> std::borrow::Cow<'_, str> {
    match cut(s, LABEL_MAX) {
        Some(prefix) => format!("{prefix}…").into(),
        None => s.into(),
    }
}

/// A DNS-1123 label: at most 63 lower-case letters, digits and '-', starting and ending with a letter or
/// digit (namespaces).
pub(crate) fn dns1123_label(what: &str, s: &str) -> Result<(), String> {
    label(what, s, "a DNS-1123 label", alphanumeric)
}

/// A Service name: a DNS-1123 label. It may start with a digit since KEP-5311 (GA in Kubernetes 1.37), which
/// relaxed the DNS-1035 rule that made it start with a letter: an API server of 1.37 accepts `1web`.
pub(crate) fn service_name(what: &str, s: &str) -> Result<(), String> {
    label(what, s, "a Service name (a DNS-1123 label)", alphanumeric)
}

fn label(what: &str, s: &str, rule: &str, first_ok: fn(u8) -> bool) -> Result<(), String> {
    let bytes = s.as_bytes();
    let fits = !bytes.is_empty()
        && bytes.len() <= LABEL_MAX
        && first_ok(bytes[0])
        && alphanumeric(bytes[bytes.len() - 1])
        && bytes.iter().all(|&b| alphanumeric(b) || b == b'-');
    match fits {
        true => Ok(()),
        false => Err(format!(
            "{what} {} is not {rule} (at most {LABEL_MAX} lower-case letters, digits and '-', \
             starting and ending with a letter or digit)",
            shown(s)
        )),
    }
}

/// A DNS-1123 subdomain: at most 253 characters, DNS-1123 labels joined by '.' (EndpointSlice names).
pub(crate) fn dns1123_subdomain(what: &str, s: &str) -> Result<(), String> {
    let fits = s.len() <= SUBDOMAIN_MAX
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            !b.is_empty()
                && alphanumeric(b[0])
                && alphanumeric(b[b.len() - 1])
                && b.iter().all(|&c| alphanumeric(c) || c == b'-')
        });
    match fits {
        true => Ok(()),
        false => Err(format!(
            "{what} {} is not a DNS-1123 subdomain (at most {SUBDOMAIN_MAX} characters: lower-case \
             letters, digits, '-' and '.')",
            shown(s)
        )),
    }
}

/// An IANA service name: at most 15 lower-case letters, digits and '-', with a letter, no '-' at either end
/// and no "--" (Service port names).
pub(crate) fn iana_svc_name(what: &str, s: &str) -> Result<(), String> {
    let b = s.as_bytes();
    let fits = !b.is_empty()
        && b.len() <= IANA_SVC_NAME_MAX
        && b.iter().all(|&c| alphanumeric(c) || c == b'-')
        && b.iter().any(u8::is_ascii_lowercase)
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
        && !s.contains("--");
    match fits {
        true => Ok(()),
        false => Err(format!(
            "{what} {} is not an IANA service name (at most {IANA_SVC_NAME_MAX} lower-case letters, \
             digits and '-', with a letter, no '-' at either end and no \"--\")",
            shown(s)
        )),
    }
}

/// A label value: at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or
/// digit (an EndpointSlice's service-name label).
pub(crate) fn label_value(what: &str, s: &str) -> Result<(), String> {
    let b = s.as_bytes();
    let ends = |c: u8| c.is_ascii_alphanumeric();
    let fits = !b.is_empty()
        && b.len() <= LABEL_MAX
        && ends(b[0])
        && ends(b[b.len() - 1])
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
    match fits {
        true => Ok(()),
        false => Err(format!(
            "{what} {} is not a label value (at most {LABEL_MAX} letters, digits, '-', '_' and '.')",
            shown(s)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_api_server_accepts_pass() {
        assert!(dns1123_label("namespace", "kube-system").is_ok());
        assert!(dns1123_label("namespace", "0abc").is_ok());
        assert!(dns1123_label("namespace", &"a".repeat(63)).is_ok());
        assert!(service_name("name", "web-1").is_ok());
        assert!(service_name("name", "1web").is_ok(), "KEP-5311");
        assert!(dns1123_subdomain("name", "web-abc12.x").is_ok());
        assert!(iana_svc_name("port name", "http-alt").is_ok());
        assert!(iana_svc_name("port name", "h2c").is_ok());
        assert!(label_value("label", "My_Service.v1").is_ok());
    }

    #[test]
    fn a_description_shows_a_long_name_cut() {
        assert_eq!(shortened("web"), "web");
        let long = shortened(&"x".repeat(300)).into_owned();
        assert_eq!(long.chars().count(), LABEL_MAX + 1);
        assert!(long.ends_with('…'));
    }

    #[test]
    fn names_the_api_server_refuses_are_refused_with_the_rule() {
        let long = "a".repeat(300);
        let e = service_name("metadata.name", &long).unwrap_err();
        assert!(
            e.contains("Service name") && e.contains("(300 bytes)"),
            "{e}"
        );
        assert!(
            e.len() < 250,
            "the message shows a prefix, not the name: {e}"
        );
        assert!(dns1123_label("namespace", &"a".repeat(64)).is_err());
        assert!(dns1123_label("namespace", "Demo").is_err());
        assert!(dns1123_label("namespace", "demo-").is_err());
        assert!(dns1123_label("namespace", "").is_err());
        assert!(service_name("name", "-web").is_err());
        assert!(service_name("name", "we b").is_err());
        assert!(dns1123_subdomain("name", &"a.".repeat(127)).is_err());
        assert!(dns1123_subdomain("name", "a..b").is_err());
        assert!(iana_svc_name("port name", "http--alt").is_err());
        assert!(iana_svc_name("port name", "8080").is_err());
        assert!(iana_svc_name("port name", "a-very-long-port-name").is_err());
        assert!(label_value("label", "-x").is_err());
        // Not valid UTF-8 trouble: a multi-byte name is refused, and shown cut at a character boundary.
        let e = service_name("name", &"é".repeat(100)).unwrap_err();
        assert!(e.contains("(200 bytes)"), "{e}");
    }
}
