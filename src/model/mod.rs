//! Service and endpoint model: what the cluster asks for, independent of where it came from.
mod detect_local;
mod intern;
mod node;
mod tracker;
mod types;
pub use detect_local::*;
pub use intern::*;
pub use node::*;
pub use tracker::*;
pub use types::*;
