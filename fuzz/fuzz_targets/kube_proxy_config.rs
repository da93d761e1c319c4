//! A KubeProxyConfiguration file's text. Properties: no panic; an error displays.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match nftkube::config::parse(text) {
        Ok(cfg) => {
            let _ = format!("{cfg:?}");
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
