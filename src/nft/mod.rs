//! nf_tables: the typed IR, its text rendering, the netlink codec and transport.
pub mod backend;
pub mod build;
pub mod bytes;
#[cfg(test)]
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
