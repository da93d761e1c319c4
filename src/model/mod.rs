//! Service and endpoint model: what the cluster asks for, independent of where it came from.
mod tracker;
mod types;
pub use tracker::*;
pub use types::*;
