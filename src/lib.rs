//! nftkube: Kubernetes services programmed into nf_tables over netlink, with no binaries.
pub mod admin;
pub mod agent;
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod demo;
pub mod metrics;
pub mod model;
pub mod netlink;
pub mod netns;
pub mod nft;
pub mod node;
pub mod privs;
pub mod render;
pub mod sandbox;
pub mod source;
pub mod sync;
