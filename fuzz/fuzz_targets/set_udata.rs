//! nft set user data (`udata::parse_typeof`). Properties: no panic; what parses, written back as nft writes
//! it, parses the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::nft::udata::{parse_typeof, set_userdata, Declared};

fuzz_target!(|data: &[u8]| {
    let (key, value) = parse_typeof(data);
    let Some(key) = key else {
        return;
    };
    let key_types: Vec<_> = key.iter().map(|e| e.data_type()).collect();
    let value_types: Vec<_> = value.iter().flatten().map(|e| e.data_type()).collect();
    let written = set_userdata(Declared {
        key: &key_types,
        data: &value_types,
        key_typeof: Some(&key),
        data_typeof: value.as_deref(),
        anonymous: false,
    });
    assert_eq!(parse_typeof(&written), (Some(key), value));
});
