//! nftkube: Kubernetes services programmed into nf_tables over netlink, with no binaries.
pub mod netlink;
pub mod model;
