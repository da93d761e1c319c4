//! nf_tables: the typed IR, its text rendering, the netlink codec and transport.
#![forbid(unsafe_code)]
pub mod backend;
pub mod build;
pub mod bytes;
// The in-memory nf_tables the sync engine is tested against; other crates (kernel tests, benches, fuzz
// targets) get it with the `testing` feature. Never in a release build.
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub mod ir;
pub mod monitor;
pub mod netlink;
pub mod text;
pub mod trace_event;
pub mod tx;
pub mod udata;
pub mod wire;

pub use backend::Backend;
