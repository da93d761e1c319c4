//! The CNI protocol (spec 1.1): the command and its environment variables, the error JSON, versions.
//!
//! A runtime runs the plugin with `CNI_COMMAND` and friends in the environment and the network configuration on
//! stdin; the plugin answers on stdout with a result (ADD), version information (VERSION), nothing (DEL, CHECK,
//! GC, STATUS), or an error object `{cniVersion, code, msg, details}` and a non-zero exit status.

use serde_json::{json, Value};

/// The versions this plugin speaks. Chaining (`prevResult`) exists since 0.3.0, and a portmap plugin is only
/// ever chained, so older versions are refused.
pub(crate) const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The version of the answers that carry no result of their own (VERSION).
pub(crate) const CURRENT_VERSION: &str = "1.1.0";

/// Well-known error codes of the CNI specification.
pub mod code {
    /// CNI error code: the runtime's CNI version is not supported.
    pub(crate) const INCOMPATIBLE_VERSION: u32 = 1;
    /// CNI error code: a field of the configuration is not supported.
    pub(crate) const UNSUPPORTED_FIELD: u32 = 2;
    /// CNI error code: the environment variables are invalid.
    pub(crate) const INVALID_ENVIRONMENT: u32 = 4;
    /// CNI error code: an I/O error.
    pub(crate) const IO_FAILURE: u32 = 5;
    /// CNI error code: the configuration does not decode.
    pub(crate) const DECODE_FAILURE: u32 = 6;
    /// CNI error code: the configuration is invalid.
    pub(crate) const INVALID_CONFIG: u32 = 7;
    /// CNI error code: try again later.
    pub(crate) const TRY_AGAIN_LATER: u32 = 11;
    /// CNI error code (STATUS): the plugin is not available.
    pub(crate) const NOT_AVAILABLE: u32 = 50;
    /// Plugin-specific (codes from 100 are the plugin's own): CHECK found the kernel's state differs.
    pub(crate) const CHECK_FAILED: u32 = 100;
}

/// A failure reported to the runtime as the CNI error object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}{}", if details.is_empty() { String::new() } else { format!(": {details}") })]
pub struct CniError {
    /// The CNI error code.
    pub code: u32,
    /// A short message.
    pub msg: String,
    /// Details (may be empty).
    pub(crate) details: String,
}

impl CniError {
    /// An error with this code and message.
    pub(crate) fn new(code: u32, msg: impl Into<String>) -> CniError {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }
    /// Adds details.
    pub(crate) fn with_details(mut self, details: impl Into<String>) -> CniError {
        self.details = details.into();
        self
    }
    /// The error object, in the version the runtime asked for (or the current one when unknown).
    pub fn to_json(&self, version: &str) -> String {
        let mut v = json!({"cniVersion": version, "code": self.code, "msg": self.msg});
        if !self.details.is_empty() {
            v["details"] = Value::String(self.details.clone());
        }
        v.to_string()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// `CNI_COMMAND`.
pub(crate) enum Command {
    /// Add the container's mappings.
    Add,
    /// Remove the container's mappings.
    Del,
    /// Check the container's mappings are in place.
    Check,
    /// Report the CNI versions supported.
    Version,
    /// Remove mappings of containers that no longer exist.
    Gc,
    /// Report whether the plugin can serve ADD.
    Status,
}

impl Command {
    fn parse(s: &str) -> Option<Command> {
        Some(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "GC" => Command::Gc,
            "STATUS" => Command::Status,
            _ => return None,
        })
    }
}

/// The attachment a command is about: the container and its interface name, as the runtime names them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Attachment {
    /// `CNI_CONTAINERID`.
    pub(crate) container_id: String,
    /// `CNI_IFNAME`.
    pub(crate) ifname: String,
}

/// The environment of one invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Env {
    /// `CNI_COMMAND`.
    pub(crate) command: Command,
    /// Set for ADD, DEL and CHECK.
    pub(crate) attachment: Option<Attachment>,
}

/// Reads the CNI variables through `get` (the process environment, or a map in tests).
pub(crate) fn read_env(get: impl Fn(&str) -> Option<String>) -> Result<Env, CniError> {
    let var = |name: &str| get(name).filter(|v| !v.is_empty());
    let command = var("CNI_COMMAND")
        .ok_or_else(|| CniError::new(code::INVALID_ENVIRONMENT, "CNI_COMMAND: missing"))?;
    let command = Command::parse(&command).ok_or_else(|| {
        CniError::new(
            code::INVALID_ENVIRONMENT,
            format!("CNI_COMMAND: unknown command {command:?}"),
        )
        .with_details("expected ADD, DEL, CHECK, VERSION, GC or STATUS")
    })?;
    let required = |name: &str| {
        var(name).ok_or_else(|| {
            CniError::new(
                code::INVALID_ENVIRONMENT,
                format!("{name}: missing (required for {command:?})"),
            )
        })
    };
    let attachment = match command {
        Command::Add | Command::Del | Command::Check => {
            if command != Command::Del {
                // Not used here (port mappings live in the node's namespace), but required by the spec.
                required("CNI_NETNS")?;
            }
            let container_id = required("CNI_CONTAINERID")?;
            check_container_id(&container_id)?;
            let ifname = required("CNI_IFNAME")?;
            check_ifname(&ifname)?;
            Some(Attachment {
                container_id,
                ifname,
            })
        }
        Command::Version | Command::Gc | Command::Status => None,
    };
    Ok(Env {
        command,
        attachment,
    })
}

/// The longest container id accepted: the id and the interface name go into element comments, which nft
/// prints only up to 128 bytes (runtimes use 64 hex digits).
pub(crate) const CONTAINER_ID_MAX: usize = 100;

/// The spec's rule for container ids (alphanumerics, underscore, dot, hyphen), and our length limit.
pub(crate) fn check_container_id(id: &str) -> Result<(), CniError> {
    let bad = |why: &str| {
        Err(CniError::new(
            code::INVALID_ENVIRONMENT,
            format!("CNI_CONTAINERID: {why}"),
        ))
    };
    if id.len() > CONTAINER_ID_MAX {
        return bad(&format!(
            "{} characters, more than the {CONTAINER_ID_MAX} this plugin can record",
            id.len()
        ));
    }
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    if !id.chars().all(ok) {
        return bad("only letters, digits, '_', '.' and '-' are allowed");
    }
    Ok(())
}

/// An interface name as the kernel allows it (the spec's rule).
pub(crate) fn check_ifname(name: &str) -> Result<(), CniError> {
    let bad = |why: &str| {
        Err(CniError::new(
            code::INVALID_ENVIRONMENT,
            format!("CNI_IFNAME: {name:?} {why}"),
        ))
    };
    if name.len() > 15 {
        return bad("is longer than 15 characters");
    }
    if name == "." || name == ".." {
        return bad("is not an interface name");
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return bad("contains '/', ':' or white space");
    }
    Ok(())
}

/// The `cniVersion` of a configuration: present, a string, and one we speak.
pub(crate) fn negotiate_version(conf: &Value) -> Result<String, CniError> {
    let v = match conf.get("cniVersion") {
        None => {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                "cniVersion: missing",
            ))
        }
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("cniVersion: {other} is not a string"),
            ))
        }
    };
    if !SUPPORTED_VERSIONS.contains(&v.as_str()) {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!("cniVersion: {v:?} is not supported"),
        )
        .with_details(format!("supported: {}", SUPPORTED_VERSIONS.join(", "))));
    }
    Ok(v)
}

/// The answer to VERSION.
pub(crate) fn version_info() -> String {
    json!({"cniVersion": CURRENT_VERSION, "supportedVersions": SUPPORTED_VERSIONS}).to_string()
}

/// Whether `version` is 1.0.0 or later (results without `ips[].version`).
pub(crate) fn is_v1(version: &str) -> bool {
    version
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok())
        >= Some(1)
}

/// `prevResult` converted to the result format of `version`: the same object, with `cniVersion` set and
/// `ips[].version` present before 1.0.0 and absent from 1.0.0 on (the only difference between 0.3.0 and 1.1.0
/// results that a chained plugin passes through).
pub(crate) fn convert_result(prev: &Value, version: &str) -> Value {
    let mut out = prev.clone();
    if let Some(obj) = out.as_object_mut() {
        obj.insert("cniVersion".into(), Value::String(version.into()));
        if let Some(Value::Array(ips)) = obj.get_mut("ips") {
            for ip in ips.iter_mut().filter_map(Value::as_object_mut) {
                if is_v1(version) {
                    ip.remove("version");
                } else {
                    let v6 = ip
                        .get("address")
                        .and_then(Value::as_str)
                        .is_some_and(|a| a.contains(':'));
                    ip.insert(
                        "version".into(),
                        Value::String(if v6 { "6" } else { "4" }.into()),
                    );
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Result<Env, CniError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        read_env(|k| m.get(k).cloned())
    }

    #[test]
    fn add_needs_container_ifname_and_netns() {
        let e = env(&[("CNI_COMMAND", "ADD"), ("CNI_NETNS", "/x")]).unwrap_err();
        assert_eq!(e.code, code::INVALID_ENVIRONMENT);
        assert!(e.msg.starts_with("CNI_CONTAINERID"), "{e}");
        let e = env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0"),
        ])
        .unwrap_err();
        assert!(e.msg.starts_with("CNI_NETNS"), "{e}");
        let ok = env(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0"),
        ])
        .unwrap();
        assert_eq!(ok.attachment.unwrap().container_id, "c1");
    }

    #[test]
    fn bad_command_and_ids() {
        assert!(env(&[("CNI_COMMAND", "FOO")])
            .unwrap_err()
            .msg
            .contains("FOO"));
        assert!(env(&[]).unwrap_err().msg.starts_with("CNI_COMMAND"));
        let long = "a".repeat(CONTAINER_ID_MAX + 1);
        assert!(check_container_id(&long).is_err());
        assert!(check_container_id("abc def").is_err());
        assert!(check_ifname("eth0/1").is_err());
        assert!(check_ifname("a-very-long-interface").is_err());
    }

    #[test]
    fn versions() {
        assert_eq!(
            negotiate_version(&json!({"cniVersion": "1.1.0"})).unwrap(),
            "1.1.0"
        );
        for bad in [
            json!({}),
            json!({"cniVersion": 1}),
            json!({"cniVersion": "0.2.0"}),
        ] {
            let e = negotiate_version(&bad).unwrap_err();
            assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
            assert!(e.msg.starts_with("cniVersion"), "{e}");
        }
    }

    #[test]
    fn results_follow_the_requested_version() {
        let prev = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.2/24"}, {"address": "fd00::2/64"}]});
        let old = convert_result(&prev, "0.4.0");
        assert_eq!(old["cniVersion"], "0.4.0");
        assert_eq!(old["ips"][0]["version"], "4");
        assert_eq!(old["ips"][1]["version"], "6");
        let new = convert_result(&old, "1.1.0");
        assert!(new["ips"][0].get("version").is_none());
    }

    #[test]
    fn error_json_shape() {
        let e = CniError::new(7, "name: missing").with_details("x");
        let v: Value = serde_json::from_str(&e.to_json("1.1.0")).unwrap();
        assert_eq!(
            v,
            json!({"cniVersion": "1.1.0", "code": 7, "msg": "name: missing", "details": "x"})
        );
    }
}
