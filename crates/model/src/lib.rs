//! Service and endpoint model: what the cluster asks for, independent of where it came from.
#![forbid(unsafe_code)]
mod detect_local;
mod intern;
mod ip_text;
mod node;
mod notice;
mod tracker;
mod types;
pub use detect_local::*;
pub use intern::*;
pub use ip_text::parse_ip_sloppy;
pub use node::*;
pub use notice::*;
pub use tracker::*;
pub use types::*;
