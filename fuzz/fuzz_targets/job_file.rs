//! Job files, as a requester writes them.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = cannabis_market::spec::JobSpec::parse(text);
    }
});
