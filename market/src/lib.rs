//! The market's state machines, sans-IO.
//!
//! Like `cannabis-protocol` this crate does no I/O and reads no clock: every input carries
//! the current time, and the caller carries out what comes back. That is what lets the
//! testnet drive many simulated nodes deterministically.
//!
//! - [`View`]: the live market a node sees, fed with gossip. It decides for each message
//!   whether to accept (and forward), ignore, or reject (and penalize the sender): size cap,
//!   signature, author, source, expiry, replay and staleness.
//! - [`matching`]: an offer's task against capability ads, both the verdict and the
//!   explanation (which requirement excluded how many ads).
//! - [`quote`]: a worker's owner policy and price against an offer: bid, decline or stay
//!   silent.
//! - [`placement`]: the cheapest bids that satisfy a task, whole-job or a gang of `k`.
//! - [`job`]: the requester's state machine for one job: bids, placement, leases with
//!   epochs, renewals, retries within the budget, cancellation, task graphs.
//! - [`lease`]: the worker's side of leases.
//! - [`spec`]: the job file.
//!
//! ```
//! use cannabis_market::{View, ViewConfig, Verdict};
//! use cannabis_protocol::Timestamp;
//!
//! let mut view = View::new(ViewConfig::default());
//! // Garbage from the network is rejected, so the sender's score drops.
//! let verdict = view.on_ad(b"not a signed ad", None, Timestamp(1_000), 1_000_000);
//! assert!(matches!(verdict, Verdict::Reject(_)));
//! ```
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod job;
pub mod lease;
pub mod matching;
pub mod placement;
pub mod quote;
pub mod spec;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

mod view;

pub use spec::OfferTemplate;
pub use view::{
    AdEntry, Expired, IgnoreReason, OfferEntry, RejectReason, Verdict, View, ViewConfig,
};
