//! An address or CIDR as Services, EndpointSlices and kube-proxy's flags write it, through `Cidr::from_str`
//! (the API server's sloppy reading: leading zeros decimal, IPv4-mapped addresses as IPv4).
//! Properties: no panic; what parses prints as a CIDR that parses to the same value, with its host bits
//! clear; wherever Rust's strict parser takes a plain address, the sloppy reading is the same address (or,
//! for an IPv4-mapped one, its IPv4 address).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::model::Cidr;
use std::net::IpAddr;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cidr) = text.parse::<Cidr>() else {
        return;
    };
    let again: Cidr = cidr.to_string().parse().expect("a CIDR's own text parses");
    assert_eq!(again, cidr);
    if let Ok(strict) = text.trim().parse::<IpAddr>() {
        let expected = strict.to_canonical();
        let host = if expected.is_ipv4() { 32 } else { 128 };
        assert_eq!((cidr.addr, cidr.prefix), (expected, host), "{text:?}");
    }
});
