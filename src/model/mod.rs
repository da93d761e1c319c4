//! Service and endpoint model: what the cluster asks for, independent of where it came from.
mod types;
pub use types::*;
