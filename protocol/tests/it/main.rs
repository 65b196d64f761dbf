//! Integration tests of the protocol crate: properties over every wire type, the
//! known-answer vectors that pin the wire format, and bad input.

mod bad_input;
mod docs;
mod fuzz_inputs;
mod known_answers;
mod properties;
