//! A manifest file's bytes, as the manifest source reads them (YAML stream, or JSON by the first byte).
//! Properties: no panic; every error names the file and displays; every event is an Applied one.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nftkube::source::manifests::parse_file;
use nftkube::source::Event;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the format, so one corpus drives both parsers.
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    let path = Path::new(if selector & 1 == 0 {
        "fuzz.yaml"
    } else {
        "fuzz.json"
    });
    let (events, errors) = parse_file(path, bytes);
    for e in &errors {
        assert!(e.to_string().starts_with(path.to_str().unwrap()));
    }
    for e in &events {
        assert!(matches!(
            e,
            Event::ServiceApplied { .. } | Event::SliceApplied(_)
        ));
    }
});
