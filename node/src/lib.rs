//! The `cannabis` node: the libp2p swarm, the store, the local API and the driver that wires
//! them to the market view. The `cannabis` binary (`src/main.rs`) is its command line.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod api;
pub mod clock;
pub mod config;
pub mod delivery;
pub mod evaluate;
pub mod exec;
pub mod group;
pub mod keystore;
pub mod logging;
pub mod metrics;
pub mod service;
pub mod store;
pub mod supervisor;
pub mod swarm;

pub use config::NodeConfig;
pub use service::{NodeHandle, OfferTemplate, start};
