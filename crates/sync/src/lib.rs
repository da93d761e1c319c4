//! Keeping the kernel in step with the model: diff, commit, recover.
#![forbid(unsafe_code)]
pub mod affinity;
pub mod chunk;
pub mod diff;
pub mod engine;
pub mod index;
pub mod quiet;

pub use engine::{delete_tables, SyncEngine, SyncError, SyncReport};
