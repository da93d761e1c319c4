//! nftkube: Kubernetes services programmed into nf_tables over netlink, with no binaries.
#![warn(missing_docs)]
pub mod admin;
pub mod agent;
pub mod cli;
pub mod config;
pub mod metrics;
pub mod process;
pub mod relay;
pub mod render;
pub mod source;
pub mod sync;
pub mod trace;

// The bottom layers, crates of their own so that the compiler refuses an upward import; re-exported under
// their module names, which the rest of the library and its users keep using.
pub use nftkube_conntrack as conntrack;
pub use nftkube_model as model;
pub use nftkube_netlink as netlink;
pub use nftkube_nft as nft;
pub use nftkube_node as node;
pub use nftkube_portmap as portmap;
pub use nftkube_yaml as yaml;
