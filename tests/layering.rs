//! The library's layering, checked: a top-level module may use only modules of lower layers
//! (docs/architecture.md). Until the layers are crates of their own, this test is what makes an upward
//! import fail: it reads every non-test source file under `src/` and names each `crate::` path that points
//! at a module of the same or a higher layer.

use std::path::{Path, PathBuf};

/// Each top-level module of the library and its layer: the lower the number, the more basic the module.
/// Modules of one layer do not use each other.
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
    // Settings, the agent that ties everything together, and the command line on top.
    ("config", 5),
    ("agent", 6),
    ("cli", 7),
];

fn layer_of(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

/// Every `.rs` file under `dir`, but test modules kept in files of their own (`tests.rs`, `tests/`).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading src/") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name != "tests" {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// The code of a file without its trailing `#[cfg(test)] mod tests` (tests may reach anywhere) and
/// without line comments (which may name any module).
fn production_code(text: &str) -> String {
    let code = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    code.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level modules a piece of code names through `crate::`.
fn crate_paths(code: &str) -> Vec<String> {
    code.match_indices("crate::")
        .map(|(at, _)| {
            code[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

/// The top-level module a file under `src/` belongs to (None for the crate roots and the binary's files).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let module = first.strip_suffix(".rs").unwrap_or(first);
    layer_of(module).map(|_| module.to_string())
}

#[test]
fn no_module_uses_one_of_its_own_or_a_higher_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut upward = Vec::new();
    let mut unknown = Vec::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            // lib.rs and main.rs sit above every layer.
            continue;
        };
        let layer = layer_of(&module).expect("module_of only returns layered modules");
        let text = std::fs::read_to_string(file).expect("reading a source file");
        for target in crate_paths(&production_code(&text)) {
            if target == module {
                continue;
            }
            match layer_of(&target) {
                Some(l) if l < layer => {}
                Some(l) => upward.push(format!(
                    "{}: {module} (layer {layer}) uses crate::{target} (layer {l})",
                    file.display()
                )),
                None => unknown.push(format!("{}: crate::{target}", file.display())),
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "modules missing from LAYERS (give each a layer):\n{}",
        unknown.join("\n")
    );
    assert!(
        upward.is_empty(),
        "imports that run sideways or up the layers (move the shared part down instead):\n{}",
        upward.join("\n")
    );
}

#[test]
fn every_top_level_module_has_a_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("reading src/lib.rs");
    let missing: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';'))
        .filter(|m| layer_of(m).is_none())
        .collect();
    assert!(missing.is_empty(), "modules without a layer: {missing:?}");
}

#[test]
fn an_upward_import_is_caught() {
    // The check itself: a sync file naming the agent is found; a comment naming it is not.
    let code = production_code(
        "use crate::nft::ir;\n// crate::agent in a comment\nfn f() { crate::agent::run(); }\n",
    );
    assert_eq!(crate_paths(&code), ["nft", "agent"]);
    let tests_only =
        production_code("use crate::nft;\n#[cfg(test)]\nmod tests {\n use crate::agent;\n}\n");
    assert_eq!(crate_paths(&tests_only), ["nft"]);
}
