//! One YAML document: whenever the fast path (`yaml::fast::parse`) takes it, serde-saphyr alone
//! (`yaml::parse_document_full`, the reference and the fallback) must accept it and return the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::yaml;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Some(fast) = yaml::fast::parse(text) else {
        return;
    };
    match yaml::parse_document_full(text) {
        Ok(full) => assert_eq!(fast, full, "fast path and serde-saphyr differ on {text:?}"),
        Err(e) => panic!("fast path took what serde-saphyr rejects ({e}): {text:?}"),
    }
});
