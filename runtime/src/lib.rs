//! The local executor: hardware probe, the supervisor and its ceilings, the sandbox, the
//! adapters (`process`, `synthetic`, `torchrun`), the durable attempt journal and bounded
//! output reads. See `docs/architecture.md` for where it sits.
//!
//! Today it holds the host part of the probe (what the operating system says about CPU,
//! memory, swap, storage and itself) and the prover of the capability challenge.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod cdi;
pub mod challenge;
pub mod exec;
pub mod gpu;
pub mod groupnet;
pub mod probe;
pub mod restart;
pub mod sandbox;
