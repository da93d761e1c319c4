//! Small vocabulary shared by the renderers: families, address fields, priorities.

use nftkube_model::IpFamily;
use nftkube_nft::build::Field;
use nftkube_nft::ir::*;

pub(super) fn nft_family(f: IpFamily) -> Family {
    match f {
        IpFamily::V4 => Family::Ip,
        IpFamily::V6 => Family::Ip6,
    }
}

pub(super) fn ip_family(f: Family) -> IpFamily {
    match f {
        Family::Ip6 => IpFamily::V6,
        _ => IpFamily::V4,
    }
}

pub(super) fn addr_type(f: IpFamily) -> DataType {
    match f {
        IpFamily::V4 => DataType::Ipv4Addr,
        IpFamily::V6 => DataType::Ipv6Addr,
    }
}

pub(super) fn saddr(f: IpFamily) -> Field {
    match f {
        IpFamily::V4 => Field::IpSaddr,
        IpFamily::V6 => Field::Ip6Saddr,
    }
}

pub(super) fn daddr(f: IpFamily) -> Field {
    match f {
        IpFamily::V4 => Field::IpDaddr,
        IpFamily::V6 => Field::Ip6Daddr,
    }
}

/// Priorities as nft names them: dstnat -100, srcnat 100, filter 0 (we run just before filter).
pub(super) const PRIO_DSTNAT: i32 = -100;
pub(super) const PRIO_SRCNAT: i32 = 100;
pub(super) const PRIO_FILTER_EARLY: i32 = -10;
