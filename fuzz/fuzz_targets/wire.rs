//! Every signed message, request-response body, sync page and block, as a peer sends them.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    cannabis_protocol::fuzzing::decode_any(data);
});
