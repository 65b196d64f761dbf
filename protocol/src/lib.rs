//! Wire types and rules of the cannabis compute market.
//!
//! This crate is pure: no I/O, no clock, no randomness of its own. Callers pass time
//! ([`Timestamp`]) and random bytes (key seeds, job ids) in.
//!
//! - [`Keypair`], [`Address`] (`cpc1...`, the bech32m of the ed25519 public key) and the age
//!   [`DeliveryIdentity`] for encrypted delivery.
//! - Canonical CBOR ([`encode`], [`decode`]): one byte form per value, size caps, versions.
//! - [`Signed<T>`]: domain-separated, strictly verified signatures.
//! - The messages: [`CapabilityAd`], [`JobOffer`], [`Bid`], [`Award`], [`LeaseAccept`],
//!   [`LeaseRenewal`], [`Cancel`], [`DeliveryManifest`], [`ComputeResult`],
//!   [`Transaction`], [`Block`].
//! - Money ([`Amount`], [`Split`]) and merkle roots ([`merkle`]).
//!
//! ```
//! use cannabis_protocol::{Amount, Bid, Digest, Keypair, Signed, Timestamp, Uuid};
//!
//! let worker = Keypair::from_secret([7; 32]);
//! let bid = Bid {
//!     job_id: Uuid::from_random([1; 16]),
//!     task: 0,
//!     offer: Digest::of(b"the offer"),
//!     worker: worker.address(),
//!     price: Amount(1_000),
//!     earliest_start: Timestamp(0),
//!     issued_at: Timestamp(0),
//!     valid_until: Timestamp(60_000),
//! };
//! let wire = Signed::sign(&worker, &bid).to_bytes();
//!
//! let received = Signed::<Bid>::from_bytes(&wire)?.verify()?;
//! assert_eq!(received.signer, worker.address());
//! assert_eq!(received.body, bid);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod bytes;
pub mod challenge;
pub mod channel;
mod codec;
pub mod draw;
#[doc(hidden)]
pub mod fuzzing;
mod genesis;
mod identity;
pub mod merkle;
mod messages;
mod money;
mod signed;
pub mod synthetic;
mod types;
pub mod units;

pub use bytes::{Digest, HexError, PublicKeyBytes, SignatureBytes};
pub use codec::{
    DecodeError, Invalid, Message, Wire, decode, decode_with_limit, encode, to_canonical,
};
pub use draw::BidCall;
pub use genesis::{Allocation, Faucet, Genesis, GenesisError, Rewards, Vesting};
pub use identity::{
    ADDRESS_HRP, Address, AddressError, BadSignature, DeliveryIdentity, DeliveryRecipient,
    KeyError, Keypair,
};
pub use messages::*;
pub use money::{
    Amount, BPS_DENOMINATOR, FOUNDER_FEE_BPS, FeeTerms, MoneyError, Outcome, PPM_DENOMINATOR,
    Quote, Split, fee_on,
};
pub use signed::{
    ENVELOPE_OVERHEAD, OpenError, Received, Signed, Verified, message_id, signing_input,
};
pub use types::{Fixed, Timestamp, Uuid, UuidError};
