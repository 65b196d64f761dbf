//! The market's state machines, sans-IO.
//!
//! Like `cannabis-protocol` this crate does no I/O and reads no clock: every input carries
//! the current time, and the caller carries out what comes back. That is what lets the
//! testnet drive many simulated nodes deterministically.
//!
//! - [`Market`]: the engine, one per node (and per simulated node): the view, the
//!   requester's jobs, the worker's bids and leases, challenge passes; inputs with time in,
//!   ordered outputs out, durable before sent.
//! - [`View`]: the live market a node sees, fed with gossip. It decides for each message
//!   whether to accept (and forward), ignore, or reject (and penalize the sender): size cap,
//!   signature, author, expiry, replay, staleness and each signer's rate.
//! - [`matching`]: an offer's task against capability ads, both the verdict and the
//!   explanation (which requirement excluded how many ads).
//! - [`quote`]: a worker's owner policy and price against an offer: bid, decline or stay
//!   silent.
//! - [`placement`]: the cheapest bids that satisfy a task, whole-job or a gang of `k`.
//! - [`job`]: the requester's state machine for one job: bids, placement, leases with
//!   epochs, renewals, retries within the budget, cancellation, task graphs.
//! - [`lease`]: the worker's side of leases.
//! - [`fanin`]: how an offer draws a bounded number of bids however many workers match.
//! - [`spec`]: the job file.
//! - [`attest`]: which workers' confidential-execution evidence counts.
//!
//! ```
//! use std::sync::Arc;
//! use cannabis_market::{RejectReason, Signatures, Verdict, View, ViewConfig, decode_gossip};
//! use cannabis_protocol::{CapabilityAd, Timestamp};
//!
//! let mut view = View::new(ViewConfig::default(), Signatures::Check);
//! // Garbage from the network does not even decode: rejected, so the sender's score drops.
//! let verdict = match decode_gossip::<CapabilityAd>(b"not a signed ad") {
//!     Ok(ad) => view.on_ad(Arc::new(ad), Timestamp(1_000), 1_000_000),
//!     Err(why) => Verdict::Reject(why),
//! };
//! assert!(matches!(verdict, Verdict::Reject(RejectReason::Decode(_))));
//! ```
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod attest;
mod engine;
pub mod fanin;
pub mod job;
pub mod lease;
pub mod ledger;
pub mod matching;
pub mod placement;
pub mod quote;
pub mod rate;
pub mod spec;
pub mod spot;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

mod refusal;
mod view;

pub use engine::{
    Answer, BatchId, Capacity, Command, CommandError, CommandOk, EvaluationOrder, GossipId, Heard,
    Identity, Inbound, InboundId, Input, Market, MarketConfig, MarketEvent, Origin, Outbound,
    OutboundId, Output, ProductCheck, Publish, Record, RecordKey, RecordOp, Reply, RunOrder,
    Settle, SyncId,
};
pub use refusal::Refusal;
pub use spec::OfferTemplate;
pub use view::{
    AdEntry, Expired, IgnoreReason, OfferEntry, RejectReason, Signatures, Verdict, View,
    ViewConfig, decode_gossip,
};
