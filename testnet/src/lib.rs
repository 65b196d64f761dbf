//! Local testnets: a launcher of real `cannabis` node processes on loopback, a client of
//! their local API, and benchmarks over them. (The deterministic simulator of many sans-IO
//! market nodes joins it with the market.)
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod bench;
pub mod client;
pub mod launcher;
pub mod sim;
pub mod stats;

pub use client::ApiClient;
pub use launcher::{Testnet, TestnetOptions};
