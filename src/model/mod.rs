//! Service and endpoint model: what the cluster asks for, independent of where it came from.
mod intern;
mod tracker;
mod types;
pub use intern::*;
pub use tracker::*;
pub use types::*;
