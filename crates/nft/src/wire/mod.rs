//! The sans-IO nf_tables codec: transactions to netlink bytes, dump messages back to the IR.
pub mod consts;
pub mod decode;
pub mod encode;

pub use decode::*;
pub use encode::*;

#[cfg(test)]
mod tests;
