//! A CNI portmap network configuration (stdin of the plugin): `portmap::netconf::parse`, then, for what parses,
//! the pure rendering of the network's chains and sets and of the attachment's elements.
//! Properties: no panic; an error is a CNI error with a code and a message that names a field (it displays
//! as JSON); what parses renders, every element carries the attachment's comment, and each mapping that
//! applies to a family with a container address yields its elements.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::nft::ir::Family;
use nftkube::portmap::{netconf, render};

fuzz_target!(|data: &[u8]| {
    let conf = match netconf::parse(data) {
        Ok(c) => c,
        Err(e) => {
            assert!(e.code > 0 && !e.msg.is_empty(), "{e:?}");
            let json: serde_json::Value = serde_json::from_str(&e.to_json("1.1.0")).unwrap();
            assert_eq!(json["code"], e.code);
            return;
        }
    };
    let names = render::Names::of(&conf.name);
    let owner = render::owner_comment("fuzz", "eth0");
    for family in [Family::Ip, Family::Ip6] {
        let prev = conf.prev_result.as_ref();
        let subnets: Vec<_> = prev.and_then(|p| p.container_subnet(family)).into_iter().collect();
        let chains = render::chains(family, &names, &conf, &subnets);
        // The four NAT chains; in IPv4 with snat (route_localnet on), the two martian guards too.
        let guards = if family == Family::Ip && conf.snat { 2 } else { 0 };
        assert_eq!(chains.len(), 4 + guards);
        let _ = render::sets(family, &names);
        let Some(ip) = prev.and_then(|p| p.container_ip(family)) else {
            continue;
        };
        let elements = render::elements(family, &names, &conf.port_mappings, ip, &owner);
        assert!(elements.iter().all(|w| w.element.comment == owner));
        if conf.port_mappings.iter().any(|m| m.applies_to(family)) {
            assert!(!elements.is_empty());
        }
    }
});
