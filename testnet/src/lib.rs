//! Local testnets: a launcher of real `cannabis` node processes on loopback, benchmarks over
//! them (their local API's client is `cannabis-api`), and the deterministic simulator that
//! drives many nodes' market engines in virtual time.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod bench;
pub mod demo;
pub mod launcher;
pub mod plot;
pub mod scenario;
pub mod sim;
pub mod stats;

pub use launcher::{Testnet, TestnetOptions};
