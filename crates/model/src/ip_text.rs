//! IP addresses and CIDRs read the way the API server validates them and kube-proxy reads them: Go's
//! `netutils.ParseIPSloppy` / `ParseCIDRSloppy` (k8s.io/utils/net, a fork of Go 1.16's `net.ParseIP` /
//! `net.ParseCIDR`), followed by Go's `IP.To4()` view of the result.
//!
//! Rust's parsers are stricter, and a stricter reading is not safe here: an object the API server stored
//! would be refused whole, and the source would keep its older version (a `loadBalancerSourceRanges`
//! restriction that never takes effect, endpoints that stay after their pod's IP was reused). So:
//! - An IPv4 field is decimal digits, any number of them, leading zeros included and read as DECIMAL
//!   ("010" is 10, never octal 8), with a value of at most 255 ("256" and "0256" are refused). Go's `dtoi`
//!   gives up once the running value reaches 0xFFFFFF, which only a field far above 255 does.
//! - An IPv6 group is hex digits, any number of them (leading zeros included: "0000fd00" is fd00), with a
//!   value of at most 0xFFFF. A trailing dotted IPv4 part is read as above. No zone ("%eth0").
//! - An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, in either notation) IS that IPv4 address: kube-proxy
//!   sorts addresses into families with `To4()`, so it lands in the IPv4 table.
//! - A CIDR's prefix length is decimal digits (leading zeros allowed, no sign) up to the bits of the way its
//!   address was written (32 dotted, 128 with colons). A mapped IPv6 CIDR whose masked network is still
//!   mapped (prefix 96 or more) is the IPv4 CIDR of prefix − 96 (`::ffff:10.0.0.0/104` is `10.0.0.0/8`, as
//!   Go's `IPNet` prints and matches it); with a shorter prefix the mapping bits are masked away and it stays
//!   an IPv6 CIDR.
//!
//! Every function here walks its input once and never panics, whatever the text.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Go's `big`: `dtoi` and `xtoi` refuse a running value that reaches it (this also bounds the arithmetic).
const BIG: u32 = 0x00FF_FFFF;

/// An IP address as `ParseIPSloppy` reads it, an IPv4-mapped one as IPv4. None if it is not one.
pub fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    // Go dispatches on the first '.' or ':' of the text.
    let bytes = s.as_bytes();
    match bytes.iter().find(|b| matches!(b, b'.' | b':'))? {
        b'.' => parse_ipv4(bytes).map(|(ip, _)| IpAddr::V4(ip)),
        _ => parse_ipv6(bytes).map(|(ip, _)| as_ipv4_if_mapped(ip)),
    }
}

/// Why a CIDR did not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CidrTextError {
    /// The part before '/' is no address.
    Address,
    /// The part after '/' is no prefix length of the address's width.
    Prefix,
}

/// A network written `address/prefix` as `ParseCIDRSloppy` reads it: the address with its host bits
/// cleared, and its prefix length, both in the family Go's `IPNet` presents (see the module docs).
pub(crate) fn parse_cidr_sloppy(
    address: &str,
    prefix: &str,
) -> Result<(IpAddr, u8), CidrTextError> {
    // Go tries the dotted form first, then the colon one; the width follows the form, not the value.
    let parsed = parse_ipv4(address.as_bytes())
        .map(|(ip, _)| (u128::from(ip.to_ipv6_mapped()), 32))
        .or_else(|| parse_ipv6(address.as_bytes()).map(|(ip, _)| (u128::from(ip), 128)));
    let (bits, width) = parsed.ok_or(CidrTextError::Address)?;
    let prefix = parse_decimal(prefix.as_bytes())
        .filter(|p| *p <= width)
        .ok_or(CidrTextError::Prefix)?;
    // The prefix of a dotted address counts from the start of its IPv4 bits, the last 32 of the 128.
    let prefix128 = prefix + (128 - width);
    let mask = u128::MAX.checked_shl(128 - prefix128).unwrap_or(0);
    let network = Ipv6Addr::from(bits & mask);
    Ok(match network.to_ipv4_mapped() {
        Some(v4) => (IpAddr::V4(v4), (prefix128 - 96) as u8),
        None => (IpAddr::V6(network), prefix128 as u8),
    })
}

/// Go's `To4()`: an IPv4-mapped IPv6 address is its IPv4 address.
fn as_ipv4_if_mapped(ip: Ipv6Addr) -> IpAddr {
    match ip.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(ip),
    }
}

/// The whole of `s` as a decimal number (Go's `dtoi` that must use every byte).
fn parse_decimal(s: &[u8]) -> Option<u32> {
    match dtoi(s) {
        Some((n, used)) if used == s.len() => Some(n),
        _ => None,
    }
}

/// Go's `dtoi`: the leading decimal digits of `s` and how many there were; None without a digit or once the
/// value reaches [`BIG`].
fn dtoi(s: &[u8]) -> Option<(u32, usize)> {
    let digits = s.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let mut n: u32 = 0;
    for b in &s[..digits] {
        n = n * 10 + u32::from(b - b'0');
        if n >= BIG {
            return None;
        }
    }
    Some((n, digits))
}

/// Go's `xtoi`: the leading hex digits of `s` and how many there were; None without a digit or once the
/// value reaches [`BIG`].
fn xtoi(s: &[u8]) -> Option<(u32, usize)> {
    let digits = s.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return None;
    }
    let mut n: u32 = 0;
    for b in &s[..digits] {
        let d = char::from(*b).to_digit(16)?;
        n = n * 16 + d;
        if n >= BIG {
            return None;
        }
    }
    Some((n, digits))
}

/// Go's forked `parseIPv4`: exactly four dot-separated decimal fields of at most 255, and nothing else.
/// Also returns how many bytes it read (all of them).
fn parse_ipv4(s: &[u8]) -> Option<(Ipv4Addr, usize)> {
    let mut octets = [0u8; 4];
    let mut at = 0;
    for (i, octet) in octets.iter_mut().enumerate() {
        if i > 0 {
            if s.get(at) != Some(&b'.') {
                return None;
            }
            at += 1;
        }
        let (n, used) = dtoi(&s[at..])?;
        *octet = u8::try_from(n).ok()?;
        at += used;
    }
    (at == s.len()).then_some((Ipv4Addr::from(octets), at))
}

/// Go's `parseIPv6` (RFC 4291 text, with a trailing dotted IPv4 part allowed). Also returns how many bytes
/// it read (all of them).
fn parse_ipv6(s: &[u8]) -> Option<(Ipv6Addr, usize)> {
    let mut ip = [0u8; 16];
    let mut ellipsis: Option<usize> = None;
    let mut at = 0;
    if s.starts_with(b"::") {
        ellipsis = Some(0);
        at = 2;
        if at == s.len() {
            return Some((Ipv6Addr::UNSPECIFIED, at));
        }
    }
    let mut i = 0;
    while i < 16 {
        let (n, used) = xtoi(&s[at..])?;
        if n > 0xFFFF {
            return None;
        }
        // A dot after the digits: they start a trailing IPv4 part, which fills the last four bytes.
        if s.get(at + used) == Some(&b'.') {
            if (ellipsis.is_none() && i != 12) || i + 4 > 16 {
                return None;
            }
            let (v4, _) = parse_ipv4(&s[at..])?;
            ip[i..i + 4].copy_from_slice(&v4.octets());
            at = s.len();
            i += 4;
            break;
        }
        ip[i] = (n >> 8) as u8;
        ip[i + 1] = n as u8;
        i += 2;
        at += used;
        if at == s.len() {
            break;
        }
        // Otherwise a colon and more must follow.
        if s[at] != b':' || at + 1 == s.len() {
            return None;
        }
        at += 1;
        if s[at] == b':' {
            if ellipsis.is_some() {
                return None;
            }
            ellipsis = Some(i);
            at += 1;
            if at == s.len() {
                break;
            }
        }
    }
    if at != s.len() {
        return None;
    }
    expand_ellipsis(&mut ip, i, ellipsis)?;
    Some((Ipv6Addr::from(ip), at))
}

/// Moves the `filled` bytes after the "::" at `ellipsis` to the end and zeroes the gap; None when the groups
/// do not add up to 16 bytes (no "::" and too few, or a "::" that stands for no group at all).
fn expand_ellipsis(ip: &mut [u8; 16], filled: usize, ellipsis: Option<usize>) -> Option<()> {
    match ellipsis {
        None if filled < 16 => None,
        None => Some(()),
        Some(_) if filled == 16 => None,
        Some(at) => {
            let gap = 16 - filled;
            ip.copy_within(at..filled, at + gap);
            ip[at..at + gap].fill(0);
            Some(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<String> {
        parse_ip_sloppy(s).map(|ip| ip.to_string())
    }

    fn cidr(s: &str) -> Option<String> {
        let (address, prefix) = s.split_once('/')?;
        parse_cidr_sloppy(address, prefix)
            .ok()
            .map(|(a, p)| format!("{a}/{p}"))
    }

    #[test]
    fn ipv4_leading_zeros_are_decimal() {
        assert_eq!(ip("010.020.000.005").as_deref(), Some("10.20.0.5"));
        assert_eq!(ip("0010.1.1.1").as_deref(), Some("10.1.1.1"));
        assert_eq!(ip("000000000255.0.0.1").as_deref(), Some("255.0.0.1"));
        // 08 and 09 are no octal, and 010 is not 8.
        assert_eq!(ip("10.08.09.010").as_deref(), Some("10.8.9.10"));
    }

    #[test]
    fn ipv4_out_of_range_and_malformed_are_refused() {
        for bad in [
            "256.0.0.1",
            "0256.0.0.1",
            "1.2.3",
            "1.2.3.4.",
            "1.2.3.4.5",
            ".1.2.3.4",
            "1..2.3",
            "1.2.3.-4",
            "1.2.3.+4",
            "1.2.3.4 ",
            " 1.2.3.4",
            "1.2.3.0x4",
            "99999999999999999999.1.1.1",
            "",
            "abc",
            "1.2.3.4/24",
        ] {
            assert_eq!(ip(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ipv6_as_go_reads_it() {
        assert_eq!(ip("fd00::1").as_deref(), Some("fd00::1"));
        assert_eq!(ip("::").as_deref(), Some("::"));
        assert_eq!(ip("::1").as_deref(), Some("::1"));
        assert_eq!(ip("1::").as_deref(), Some("1::"));
        assert_eq!(ip("1:2:3:4:5:6:7:8").as_deref(), Some("1:2:3:4:5:6:7:8"));
        // Go's xtoi takes any number of leading zeros in a group.
        assert_eq!(ip("0000fd00::01").as_deref(), Some("fd00::1"));
        assert_eq!(ip("64:ff9b::1.2.3.4").as_deref(), Some("64:ff9b::102:304"));
        assert_eq!(
            ip("1:2:3:4:5:6:1.2.3.4").as_deref(),
            Some("1:2:3:4:5:6:102:304")
        );
        for bad in [
            "fd00::zz",
            "1:2:3:4:5:6:7:8:9",
            "1:2:3:4:5:6:7",
            "1:2:3:4:5:6:7:8::",
            "1::2::3",
            "10000::1",
            ":1::2",
            "1:",
            "1:2:3:4:5:1.2.3.4",
            "fe80::1%eth0",
            "::ffff:1.2.3.256",
            "[::1]",
        ] {
            assert_eq!(ip(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ipv4_mapped_addresses_are_ipv4() {
        assert_eq!(ip("::ffff:10.244.1.5").as_deref(), Some("10.244.1.5"));
        assert_eq!(ip("::FFFF:010.244.1.5").as_deref(), Some("10.244.1.5"));
        assert_eq!(ip("::ffff:af4:105").as_deref(), Some("10.244.1.5"));
        assert_eq!(
            ip("0:0:0:0:0:ffff:10.244.1.5").as_deref(),
            Some("10.244.1.5")
        );
        assert!(parse_ip_sloppy("::ffff:10.244.1.5").unwrap().is_ipv4());
        // IPv4-compatible (no ffff) and NAT64 addresses stay IPv6, as Go's To4 has them.
        assert!(parse_ip_sloppy("::10.244.1.5").unwrap().is_ipv6());
        assert!(parse_ip_sloppy("64:ff9b::10.244.1.5").unwrap().is_ipv6());
    }

    #[test]
    fn cidrs_as_parse_cidr_sloppy_reads_them() {
        assert_eq!(cidr("010.20.0.0/16").as_deref(), Some("10.20.0.0/16"));
        assert_eq!(cidr("010.20.1.7/016").as_deref(), Some("10.20.0.0/16"));
        assert_eq!(cidr("10.0.0.0/0").as_deref(), Some("0.0.0.0/0"));
        assert_eq!(cidr("2001:db8::1/32").as_deref(), Some("2001:db8::/32"));
        assert_eq!(cidr("::ffff:10.0.0.0/104").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(cidr("::ffff:10.1.2.3/128").as_deref(), Some("10.1.2.3/32"));
        assert_eq!(cidr("::ffff:10.1.2.3/96").as_deref(), Some("0.0.0.0/0"));
        // Below 96 bits the mapping prefix itself is masked: an IPv6 network, as Go's IPNet has it.
        assert_eq!(cidr("::ffff:10.0.0.0/95").as_deref(), Some("::fffe:0:0/95"));
        assert_eq!(cidr("::ffff:10.0.0.0/64").as_deref(), Some("::/64"));
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0/+8",
            "10.0.0.0/-1",
            "10.0.0.0/",
            "10.0.0.0/8a",
            "::/129",
            "::ffff:10.0.0.0/129",
            "256.0.0.0/8",
            "nope/8",
        ] {
            assert_eq!(cidr(bad), None, "{bad:?}");
        }
    }

    /// Random address-like texts (dotted quads and colon groups, with "::", IPv4 tails, zeros, big numbers
    /// and stray characters): never a panic, and whatever Rust's strict parser accepts, the sloppy one reads
    /// as the same address (a mapped one as its IPv4 address).
    #[test]
    fn agrees_with_the_strict_parser_where_it_accepts_and_never_panics() {
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let mut accepted = [0usize; 2];
        for _ in 0..100_000 {
            let mut text = String::new();
            let dotted = next(2) == 0;
            let fields = match (dotted, next(4)) {
                (true, 0) => 1 + next(5),
                (true, _) => 4,
                (false, _) => 1 + next(9),
            };
            for i in 0..fields {
                if i > 0 {
                    text.push(if dotted { '.' } else { ':' });
                }
                if !dotted && next(6) == 0 {
                    text.push(':');
                }
                let value = [next(10), next(256), next(300), next(0x10000), next(0x20000)]
                    [next(5) as usize];
                let field = match (dotted, next(4)) {
                    (true, 0) => format!("0{value}"),
                    (true, _) => value.to_string(),
                    (false, 0) => format!("{value:05x}"),
                    (false, _) => format!("{value:x}"),
                };
                text.push_str(&field);
            }
            match next(8) {
                0 => text.push_str(&format!(
                    ":{}.{}.{}.{}",
                    next(256),
                    next(256),
                    next(256),
                    next(256)
                )),
                1 => text.insert_str(0, "::ffff:"),
                2 => text.push_str(["/", "%", " ", "x", "."][next(5) as usize]),
                _ => {}
            }
            let sloppy = parse_ip_sloppy(&text);
            if let Some((address, prefix)) = text.split_once('/') {
                let _ = parse_cidr_sloppy(address, prefix);
            }
            if let Ok(strict) = text.parse::<IpAddr>() {
                accepted[usize::from(strict.is_ipv6())] += 1;
                let want = match strict {
                    IpAddr::V6(v6) => as_ipv4_if_mapped(v6),
                    v4 => v4,
                };
                assert_eq!(sloppy, Some(want), "{text:?}");
            }
        }
        assert!(
            accepted.iter().all(|n| *n > 500),
            "the generator hardly made addresses: {accepted:?}"
        );
    }

    #[test]
    fn long_garbage_is_refused_in_linear_time() {
        let zeros = "0".repeat(1 << 20);
        assert_eq!(ip(&format!("{zeros}10.0.0.1")).as_deref(), Some("10.0.0.1"));
        assert_eq!(ip(&format!("{zeros}1.0.0.1")).as_deref(), Some("1.0.0.1"));
        assert_eq!(ip(&format!("::{zeros}1")).as_deref(), Some("::1"));
        assert_eq!(ip(&"9".repeat(1 << 20)), None);
        assert_eq!(ip(&":".repeat(1 << 20)), None);
        assert_eq!(ip(&"1.".repeat(1 << 20)), None);
        assert_eq!(ip(&"1:".repeat(1 << 20)), None);
    }
}

#[cfg(test)]
mod cidr_from_str_tests {
    use crate::{Cidr, IpFamily, ParseError};

    #[test]
    fn cidr_from_str_reads_sloppy_text() {
        let c: Cidr = "010.20.0.0/16".parse().unwrap();
        assert_eq!(c.to_string(), "10.20.0.0/16");
        let c: Cidr = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(
            (c.to_string(), c.family()),
            ("10.0.0.0/8".into(), IpFamily::V4)
        );
        assert!(c.contains(&"10.9.8.7".parse().unwrap()));
        // A bare address is its host prefix, a mapped one an IPv4 host.
        let c: Cidr = " ::ffff:192.0.2.1 ".parse().unwrap();
        assert_eq!(c.to_string(), "192.0.2.1/32");
        assert_eq!(
            " 10.0.0.0 / 8 ".parse::<Cidr>().unwrap().to_string(),
            "10.0.0.0/8"
        );
    }

    #[test]
    fn cidr_from_str_refuses_garbage_with_a_reason() {
        assert_eq!(
            "10.0.0.0/33".parse::<Cidr>(),
            Err(ParseError::CidrPrefix("10.0.0.0/33".into()))
        );
        assert_eq!(
            "10.0.0.256/8".parse::<Cidr>(),
            Err(ParseError::CidrAddress("10.0.0.256/8".into()))
        );
        let e = "garbage".parse::<Cidr>().unwrap_err();
        assert_eq!(e.to_string(), "invalid CIDR \"garbage\": bad address");
    }
}
