//! The local executor: hardware probe, the supervisor and its ceilings, the sandbox, the
//! adapters (`process`, `synthetic`, `torchrun`), the durable attempt journal and bounded
//! output reads. See `docs/architecture.md` for where it sits; it arrives with the executor
//! and probe issues.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub use cannabis_protocol as protocol;
