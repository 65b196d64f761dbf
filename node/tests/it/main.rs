//! Tests of the `cannabis` binary, run as a user runs it.

mod cli;
