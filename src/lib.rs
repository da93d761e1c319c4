//! nftkube: Kubernetes services programmed into nf_tables over netlink, with no binaries.
#![warn(missing_docs)]
pub mod admin;
pub mod agent;
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod metrics;
pub mod model;
pub mod netlink;
pub mod nft;
pub mod node;
pub mod portmap;
pub mod process;
pub mod relay;
pub mod render;
pub mod source;
pub mod sync;
pub mod trace;
pub mod yaml;
