//! The workspace's layering, checked (docs/architecture.md). The layers are made of crates under `crates/`,
//! so the compiler already refuses a cycle; what it cannot refuse is a dependency that runs sideways or up
//! the layers (render on source, sync on relay), which would let the next cycle in through the back door.
//! This test reads each crate's manifest and names every such dependency.

use std::path::Path;

/// Each crate of the workspace (its directory under `crates/`) and its layer: the lower the number, the
/// more basic the crate. Crates of one layer do not use each other.
const LAYERS: &[(&str, u8)] = &[
    // The kernel's and the world's formats, and the process itself.
    ("netlink", 0),
    ("yaml", 0),
    ("model", 0),
    ("process", 0),
    ("metrics", 0),
    // nf_tables, conntrack and node facts over netlink.
    ("nft", 1),
    ("conntrack", 1),
    ("node", 1),
    // From the model to tables; from the world to the model.
    ("render", 2),
    ("source", 2),
    // Committing tables; the CNI plugin; the tracer.
    ("sync", 3),
    ("portmap", 3),
    ("trace", 3),
    // What runs beside the sync loop.
    ("relay", 4),
    ("admin", 4),
    // Settings, then the agent that ties everything together. The command line is the binary's, on top.
    ("config", 5),
    ("agent", 6),
];

fn layer_of(krate: &str) -> Option<u8> {
    LAYERS.iter().find(|(c, _)| *c == krate).map(|(_, l)| *l)
}

/// The workspace crates a manifest depends on (normal and dev dependencies): `nftkube-x` gives `x`.
fn workspace_dependencies(manifest: &str) -> Vec<String> {
    let mut in_dependencies = false;
    let mut out = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_dependencies = matches!(line, "[dependencies]" | "[dev-dependencies]");
            continue;
        }
        if !in_dependencies {
            continue;
        }
        if let Some(rest) = line.strip_prefix("nftkube-") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
    }
    out
}

/// Every crate directory under `crates/`, sorted.
fn crates() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("reading crates/")
        .map(|e| e.expect("a directory entry").file_name())
        .filter_map(|n| n.to_str().map(str::to_string))
        .collect();
    names.sort();
    names
}

/// The dependencies of `krate` (its manifest `text`) that run sideways or up, and those on unknown crates.
fn violations(krate: &str, text: &str) -> Vec<String> {
    let layer = layer_of(krate).expect("only layered crates are checked");
    let mut out = Vec::new();
    for dep in workspace_dependencies(text) {
        match layer_of(&dep) {
            Some(l) if l < layer => {}
            Some(l) => out.push(format!(
                "{krate} (layer {layer}) depends on nftkube-{dep} (layer {l})"
            )),
            None => out.push(format!(
                "{krate} depends on nftkube-{dep}, which has no layer"
            )),
        }
    }
    out
}

#[test]
fn no_crate_depends_on_one_of_its_own_or_a_higher_layer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut found = Vec::new();
    for krate in crates() {
        let text = std::fs::read_to_string(root.join(&krate).join("Cargo.toml"))
            .expect("reading a crate's Cargo.toml");
        found.extend(violations(&krate, &text));
    }
    assert!(
        found.is_empty(),
        "dependencies that run sideways or up the layers (move the shared part down instead):\n{}",
        found.join("\n")
    );
}

#[test]
fn every_crate_has_a_layer_and_every_layer_a_crate() {
    let crates = crates();
    let unlayered: Vec<&String> = crates.iter().filter(|c| layer_of(c).is_none()).collect();
    assert!(
        unlayered.is_empty(),
        "crates without a layer: {unlayered:?}"
    );
    let missing: Vec<&str> = LAYERS
        .iter()
        .map(|(c, _)| *c)
        .filter(|c| !crates.iter().any(|k| k == c))
        .collect();
    assert!(missing.is_empty(), "layers without a crate: {missing:?}");
}

#[test]
fn an_upward_dependency_is_caught() {
    // The check itself: sync on render is fine; sync on relay (higher) and on trace (same layer) are not,
    // in either dependency table; other tables and other crates' names are not dependencies.
    let manifest = "[package]\nname = \"nftkube-sync\"\n\n[dependencies]\nnftkube-render = { path = \"../render\" }\n\
                    nftkube-relay = { path = \"../relay\" }\ntracing = \"0.1\"\n\n[lints]\nworkspace = true\n\n\
                    [dev-dependencies]\nnftkube-trace = { path = \"../trace\" }\n";
    assert_eq!(
        workspace_dependencies(manifest),
        ["render", "relay", "trace"]
    );
    assert_eq!(
        violations("sync", manifest),
        [
            "sync (layer 3) depends on nftkube-relay (layer 4)",
            "sync (layer 3) depends on nftkube-trace (layer 3)"
        ]
    );
}
