//! nftkube: Kubernetes services programmed into nf_tables over netlink, with no binaries.
//!
//! A facade over the workspace's crates (docs/architecture.md): each is re-exported under its old module name,
//! which the binary, the tests and benches, the kernel tests, the fuzz targets and the sandbox keep using.
#![forbid(unsafe_code)]
pub use nftkube_admin as admin;
pub use nftkube_agent as agent;
pub use nftkube_config as config;
pub use nftkube_conntrack as conntrack;
pub use nftkube_metrics as metrics;
pub use nftkube_model as model;
pub use nftkube_netlink as netlink;
pub use nftkube_nft as nft;
pub use nftkube_node as node;
pub use nftkube_portmap as portmap;
pub use nftkube_process as process;
pub use nftkube_relay as relay;
pub use nftkube_render as render;
pub use nftkube_source as source;
pub use nftkube_sync as sync;
pub use nftkube_trace as trace;
pub use nftkube_yaml as yaml;
