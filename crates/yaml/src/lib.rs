//! YAML whose cost is linear in its size, whatever its shape.
//!
//! Manifests and the configuration file come from outside, so a document of a few hundred kilobytes must not
//! cost minutes: serde_yaml (deprecated upstream) took 47 s to reject 300 KB of `[` (its nesting check runs
//! after work quadratic in the depth). serde-saphyr checks a budget while it parses, so every limit below
//! ends the parse as soon as it is crossed. The budget is derived from the document's own size: a document
//! can never make the parser produce more nodes, replay more alias events or copy more scalar bytes than it
//! has bytes (plus a small constant), which bounds alias and merge-key expansion ("billion laughs") to a
//! linear amount of work; nesting is capped at a constant depth no Kubernetes object comes near.
//!
//! Ordinary manifests first go through a hand-written parser of the block subset they use (`fast`), which
//! returns exactly what serde-saphyr would or declines; serde-saphyr parses whatever it declines, and words
//! every error.
#![forbid(unsafe_code)]

use serde_json::Value;

#[cfg(test)]
mod differential;
pub mod fast;
mod flow;
mod scalar;

/// Deepest nesting accepted, block and flow alike. A Service or EndpointSlice nests about ten levels.
pub(crate) const MAX_DEPTH: usize = 64;

/// Slack for tiny documents, whose node and event counts can exceed their byte count (`[]` is one node in
/// two bytes, but the stream and document events come on top).
const SLACK: usize = 64;

/// A document that is not valid YAML, or crossed the budget (the error names line and column).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct YamlError(#[from] serde_saphyr::Error);

/// Parses one YAML document (no `---` separators: split the stream first) into a JSON value.
pub fn parse_document(text: &str) -> Result<Value, YamlError> {
    match fast::parse(text) {
        Some(value) => Ok(value),
        None => parse_document_full(text),
    }
}

/// [`parse_document`] by serde-saphyr alone, whatever the document: the reference the fast path is
/// checked against, and its fallback.
pub fn parse_document_full(text: &str) -> Result<Value, YamlError> {
    Ok(serde_saphyr::from_str_with_options(
        text,
        options(text.len()),
    )?)
}

/// The budget for a document of `len` bytes: see the module's comment.
fn options(len: usize) -> serde_saphyr::Options {
    let linear = len.saturating_add(SLACK);
    let mut budget = serde_saphyr::Budget::default();
    budget.max_depth = MAX_DEPTH;
    budget.flow_nesting_limit = MAX_DEPTH;
    budget.max_documents = 1;
    budget.max_nodes = linear;
    budget.max_events = linear.saturating_mul(2);
    budget.max_aliases = linear;
    budget.max_anchors = linear;
    budget.max_merge_keys = linear;
    budget.max_recorded_anchor_events = linear;
    budget.max_recorded_anchor_bytes = linear;
    budget.max_total_scalar_bytes = linear;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.alias_limits.max_total_replayed_events = linear;
    // The error names line and column; a snippet of a hostile line would only repeat the input.
    options.with_snippet = false;
    // Scalars as Kubernetes reads them (YAML 1.1, go-yaml v2 under sigs.k8s.io/yaml): `0777` is octal 511,
    // not the float 777 (serde-saphyr's default), and `yes` / `on` are true.
    options.legacy_octal_numbers = true;
    options
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ordinary_documents_parse_as_kubernetes_reads_them() {
        let v = parse_document(
            "apiVersion: v1\nkind: Service\nmetadata: {name: a, labels: {x: 'y'}}\nspec:\n  clusterIP: 10.96.0.1\n  ports:\n  - {port: 80, protocol: TCP}\n  publishNotReadyAddresses: true\n",
        )
        .unwrap();
        assert_eq!(
            v,
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a", "labels": {"x": "y"}},
                   "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80, "protocol": "TCP"}],
                            "publishNotReadyAddresses": true}})
        );
    }

    #[test]
    fn scalars_follow_kubernetes_yaml_1_1_reading() {
        let v = parse_document("a: 0777\nb: yes\nc: 1_000\nd: \"80\"\ne: 0x1F\n").unwrap();
        assert_eq!(
            v,
            json!({"a": 511, "b": true, "c": 1000, "d": "80", "e": 31})
        );
    }

    #[test]
    fn anchors_and_merge_keys_within_the_budget_work() {
        let v = parse_document("a: &p {port: 80}\nb: *p\nc: {<<: *p, name: x}\n").unwrap();
        assert_eq!(v["b"], json!({"port": 80}));
        assert_eq!(v["c"], json!({"port": 80, "name": "x"}));
    }

    fn rejected(text: &str) -> String {
        parse_document(text)
            .expect_err("hostile input must be rejected")
            .to_string()
    }

    #[test]
    fn deep_nesting_is_rejected_at_the_depth_limit() {
        assert!(rejected(&"[".repeat(300_000)).contains("recursion limit"));
        assert!(rejected(&"{a: ".repeat(100_000)).contains("recursion limit"));
        let mut block = String::new();
        for i in 0..1000 {
            block.push_str(&format!("{}a:\n", " ".repeat(i)));
        }
        assert!(rejected(&block).contains("Depth"));
        assert!(rejected(&"- ".repeat(10_000)).contains("Depth"));
    }

    #[test]
    fn alias_expansion_is_bounded_by_the_document_size() {
        let mut laughs = String::from("a: &a [x,x,x,x,x,x,x,x,x,x]\n");
        for k in 1..9u8 {
            let (p, c) = ((b'a' + k - 1) as char, (b'a' + k) as char);
            laughs.push_str(&format!(
                "{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
            ));
        }
        assert!(rejected(&laughs).contains("budget breached"));
        // One long scalar repeated by aliases: more scalar bytes than the document has.
        let mut repeated = format!("a: &a {}\nb: [", "x".repeat(10_000));
        repeated.push_str(&"*a,".repeat(1000));
        repeated.push(']');
        assert!(rejected(&repeated).contains("ScalarBytes"));
    }

    #[test]
    fn a_second_document_is_an_error() {
        assert!(rejected("a: 1\n---\nb: 2\n").contains("Documents"));
    }

    #[test]
    fn malformed_documents_name_line_and_column() {
        for text in ["a: \"unclosed\n", "a: [1, 2\n", "a: b: c\n"] {
            let e = rejected(text);
            assert!(e.contains("line ") && e.contains("column "), "{e}");
        }
    }
}
