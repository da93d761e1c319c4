//! The CNI portmap plugin on nf_tables: hostPorts mapped to containers through maps in its own tables
//! (`ip nftkube-portmap`, `ip6 nftkube-portmap`). The kernel is what every command reads; a file per attachment
//! keeps what ADD succeeded with, only to put it back after a firewall reload.
//!
//! Its binary, `nftkube-portmap`, is what a runtime runs (installed as `portmap` in its CNI_PATH); the nftkube
//! binary still speaks the protocol when invoked as `portmap` or `nftkube-portmap` (a symlink or a copy) and as
//! `nftkube portmap`, for nodes set up before the plugin had a binary of its own.
//!
//! - [`cni`]: the protocol (environment, error object, versions);
//! - [`netconf`]: the configuration on stdin, typed;
//! - [`conditions`]: `conditionsV4/V6`, a subset of nft match syntax parsed into IR;
//! - [`render`]: the objects of a network and the elements of an attachment;
//! - `kernel`: the reads and the generation-checked commit, over netlink or on the fake kernel;
//! - `state`: reading them back and planning one batch;
//! - `flows`: UDP conntrack cleanup;
//! - `records`: what ADD succeeded with, kept until DEL or GC, for `restore` after a firewall reload;
//! - `plugin`: the commands, and `restore`.
#![forbid(unsafe_code)]

pub mod cni;
pub mod conditions;
mod flows;
mod kernel;
pub mod netconf;
mod plugin;
mod records;
pub mod render;
mod state;

use std::io::{Read, Write};

/// The names the binary answers to as a CNI plugin.
pub(crate) const PLUGIN_NAMES: [&str; 2] = ["portmap", "nftkube-portmap"];

/// Whether `argv[0]` (a path) names the plugin.
pub fn invoked_as_plugin(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| PLUGIN_NAMES.contains(&n))
}

/// Runs the plugin on the process's environment, stdin and stdout; returns the exit status (0 or 1).
pub fn main() -> u8 {
    let mut stdin = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut stdin) {
        let err =
            cni::CniError::new(cni::code::IO_FAILURE, "reading stdin").with_details(e.to_string());
        // Nothing more can be done for a runtime that closed our stdout.
        let _ = writeln!(std::io::stdout(), "{}", err.to_json(cni::CURRENT_VERSION));
        return 1;
    }
    let out = plugin::run(|k| std::env::var(k).ok(), &stdin);
    let mut stdout = std::io::stdout().lock();
    if !out.stdout.is_empty() {
        let _ = writeln!(stdout, "{}", out.stdout);
    }
    let _ = stdout.flush();
    u8::from(!out.ok)
}

/// The plugin's table, in each family.
pub const TABLE: &str = render::TABLE;

/// What `nftkube-portmap restore` does, for the agent: None when the plugin never recorded anything in this
/// network namespace (and nothing is created), otherwise how many attachments were restored, or what failed.
pub fn restore_recorded() -> Option<Result<usize, Vec<String>>> {
    records::any().then(plugin::restore)
}

/// `nftkube-portmap restore`: puts back the mappings of every attachment recorded in this network namespace
/// (after a firewall reload deleted the plugin's tables); prints what it did. Returns the exit status.
pub fn restore_main() -> u8 {
    match plugin::restore() {
        Ok(n) => {
            let _ = writeln!(
                std::io::stdout(),
                "nftkube-portmap restore: {n} attachments' mappings in place"
            );
            0
        }
        Err(failed) => {
            let mut err = std::io::stderr().lock();
            for f in &failed {
                let _ = writeln!(err, "nftkube-portmap restore: {f}");
            }
            1
        }
    }
}
