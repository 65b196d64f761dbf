//! Local testnets: a deterministic in-process simulator of many sans-IO nodes and a launcher
//! of real `cannabis` processes on loopback, with scenarios, faults on demand and
//! benchmarks. It arrives with the swarm and market issues (see `docs/architecture.md`).
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub use cannabis_protocol as protocol;
