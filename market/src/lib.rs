//! The market's state machines, sans-IO: matching offers against capability ads, quote
//! scoring, placement (whole-job and gang), the lease lifecycle, task graphs, the escrow
//! lifecycle and the embedded ledger's rules.
//!
//! Like `cannabis-protocol` it does no I/O and reads no clock: inputs carry the current time,
//! outputs are actions for the node to carry out. The message types and money rules it
//! works on live in `cannabis-protocol`; the state machines arrive with the market issue
//! (see `docs/architecture.md`).
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub use cannabis_protocol as protocol;
